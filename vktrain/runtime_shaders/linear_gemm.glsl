// Tiled fp32 GEMM body shared by the linear family (included by linear_q4gsw.comp,
// linear_q4gsw_backward.comp and linear_dw.comp, each of which #defines LINEAR_MODE first; the
// forward one also has the variant linear_q4gsw@HAS_BIAS).
//
// Every mode computes C[i, j] = sum_r A[r, i] * B[r, j] with C row-major [ROWS, COLS] (j contiguous):
//   LINEAR_MODE_FWD: y[M, N]  = x[M, K] @ deq(W).T    i = m, j = n, r = k    (+ bias[n])
//   LINEAR_MODE_BWD: dx[M, K] = d_out[M, N] @ deq(W)  i = m, j = k, r = n
//   LINEAR_MODE_DW:  dW[N, K] = d_out[M, N].T @ x     i = n, j = k, r = m
// W is the W_4X8 prepacked buffer (docs/spec/w4x8.md), dequantized once per workgroup tile into
// shared memory with scales [G, N].
//
// Tiling: a workgroup of THREADS_X * THREADS_Y threads owns a BM x BN tile of C, BM = 8 * THREADS_Y,
// BN = 8 * THREADS_X; each thread owns an 8 x 8 register block split into two 4-row halves BM/2 apart
// and two 4-column halves BN/2 apart, so the shared-memory reads of a warp are consecutive vec4s
// (conflict-free) and the global stores are vec4s. The reduction advances BK at a time through
// shared memory; the global loads of step r+1 are issued into registers before the arithmetic of
// step r, so their latency hides behind it. Buffers are `restrict`: outputs never alias inputs.
//
// Variants defining CPU_REGISTER_TILES (FWD, BWD) replace this tiling, from the staging below on, with
// the register-tile body of linear_gemm_cpu.glsl for CPU Vulkan implementations; the bindings, push
// constants and W_4X8 decoding above it are shared.
//
// Placement (FWD, BWD; kernels/linear.py `GemmPlacement`, one window of a GEMM split over storage bindings):
// source row i (x / d_out) starts at element a_offset + i * a_row_stride of binding 1, C's row i at
// c_offset + i * c_row_stride of binding 0, the W_4X8 words at word w_offset of binding 2 and the scales at
// element s_offset of binding 3 (all multiples of 4; contiguous: 0, the reduction, 0, COLS, 0, 0).
// ACCUMULATE (FWD): each output starts its sum from the value binding 0 holds (a previous window of K's
// partial) instead of 0, so a reduction cut into windows adds the same products in the same order.
//
// FP16 (FWD, BWD; the `fp16` GEMM precision policy, docs/PRECISION.md): the shared tiles hold fp16
// (f16vec4: half the shared memory and its traffic), each operand rounded to nearest fp16 as it is
// committed; the products of two fp16 values are formed in fp32, where they are exact (11 + 11
// significant bits), and summed in fp32 in the fp32 body's order. FWD rounds x and deq(W) as they are;
// BWD first multiplies d_out, a gradient whose values follow the loss divisor down to fp16's subnormals,
// by the power of two 2^e that puts max |d_out| in [2^14, 2^15) (coopmat_scale.glsl: max |d_out| from the
// partial maxima coopmat_absmax wrote into binding 4, pc.a_partials of them) and the sums by 2^-e, both
// exact. The kernel's per-element bound is in docs/PRECISION.md ("The fp16 policy").

#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#ifdef CPU_REGISTER_TILES
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#endif
#ifdef FP16
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#if defined(CPU_REGISTER_TILES) || LINEAR_MODE == LINEAR_MODE_DW || defined(ACCUMULATE)
#error "FP16 is a variant of the shared-memory body of LINEAR_MODE_FWD / LINEAR_MODE_BWD without ACCUMULATE"
#endif
#endif
#include "common.glsl"

// Local size from spec ids 0, 1 (the runtime's convention): THREADS_X x THREADS_Y threads.
VKTRAIN_LOCAL_SIZE_FROM_SPEC;
const uint THREADS_X = gl_WorkGroupSize.x;
const uint THREADS_Y = gl_WorkGroupSize.y;
layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;  // the runtime's group offset of split dispatches (common.glsl)
    uint M;              // rows of x / d_out (leading dims flattened)
    uint N;              // out features
    uint K;              // in features
    uint group_size;     // q4gsw group size along K (unused by LINEAR_MODE_DW)
    uint a_offset;       // placement (above; unused by LINEAR_MODE_DW's inputs)
    uint a_row_stride;
    uint c_offset;
    uint c_row_stride;
    uint w_offset;
    uint s_offset;
#if defined(FP16) && LINEAR_MODE == LINEAR_MODE_BWD
    uint a_partials;     // partial maxima of |d_out| in binding 4
#endif
} pc;

#ifdef CPU_REGISTER_TILES
// The CPU body reads its inputs 64 bits at a time (linear_gemm_cpu.glsl): same buffers, wider elements.
#define VEC4_INPUT uint64_t
#define WORD_INPUT uint64_t
#define SCALE_INPUT uint64_t
#else
#define VEC4_INPUT vec4
#define WORD_INPUT uint
#define SCALE_INPUT float
#endif

#if LINEAR_MODE == LINEAR_MODE_FWD
#ifdef ACCUMULATE  // variant linear_q4gsw@ACCUMULATE: y is read (the partial so far) and written
layout(set = 0, binding = 0) restrict buffer OutBuf { vec4 y[]; };
#else
layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { vec4 y[]; };
#endif
layout(set = 0, binding = 1) readonly restrict buffer XBuf { VEC4_INPUT x[]; };
layout(set = 0, binding = 2) readonly restrict buffer WBuf { WORD_INPUT w4x8[]; };
layout(set = 0, binding = 3) readonly restrict buffer SBuf { SCALE_INPUT scales[]; };
#ifdef HAS_BIAS  // variant linear_q4gsw@HAS_BIAS: y += bias[n]
layout(set = 0, binding = 4) readonly restrict buffer BiasBuf { vec4 bias[]; };
#endif
#elif LINEAR_MODE == LINEAR_MODE_BWD
layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { vec4 dx[]; };
layout(set = 0, binding = 1) readonly restrict buffer DOutBuf { VEC4_INPUT d_out[]; };
layout(set = 0, binding = 2) readonly restrict buffer WBuf { WORD_INPUT w4x8[]; };
layout(set = 0, binding = 3) readonly restrict buffer SBuf { SCALE_INPUT scales[]; };
#ifdef FP16
layout(set = 0, binding = 4) readonly restrict buffer AbsmaxBuf { uint partial_absmax_bits[]; };
#endif
#elif LINEAR_MODE == LINEAR_MODE_DW
layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { vec4 dw[]; };
layout(set = 0, binding = 1) readonly restrict buffer DOutBuf { vec4 d_out[]; };
layout(set = 0, binding = 2) readonly restrict buffer XBuf { vec4 x[]; };
#else
#error "LINEAR_MODE must be LINEAR_MODE_FWD, LINEAR_MODE_BWD or LINEAR_MODE_DW"
#endif

uint rows_total() {
#if LINEAR_MODE == LINEAR_MODE_DW
    return pc.N;
#else
    return pc.M;
#endif
}

uint cols_total() {
#if LINEAR_MODE == LINEAR_MODE_FWD
    return pc.N;
#else
    return pc.K;
#endif
}

uint reduction_total() {
#if LINEAR_MODE == LINEAR_MODE_FWD
    return pc.K;
#elif LINEAR_MODE == LINEAR_MODE_BWD
    return pc.N;
#else
    return pc.M;
#endif
}

#if LINEAR_MODE != LINEAR_MODE_DW
uint n8_count() { return (pc.N / 4u + 1u) / 2u; }

#ifndef CPU_REGISTER_TILES
// The scale of weight row n in group g; rows n >= N exist only as W_4X8 padding (code 8), and reading
// their scale would overrun, so they scale by 0.
float scale_at(uint g, uint n) { return n < pc.N ? scales[pc.s_offset + g * pc.N + n] : 0.0; }
#endif

// Codes of one W_4X8 word for the row pair (n, n + 1): byte t holds k = 4*k4 + t, low nibble row n.
vec4 decode_low(uint word) { return vec4((uvec4(word) >> uvec4(0u, 8u, 16u, 24u)) & 0xFu) - 8.0; }
vec4 decode_high(uint word) { return vec4((uvec4(word) >> uvec4(4u, 12u, 20u, 28u)) & 0xFu) - 8.0; }
#endif

#ifdef CPU_REGISTER_TILES
#include "linear_gemm_cpu.glsl"
#else
// Reduction step; multiple of 8 (the backward mode loads whole 8-row W_4X8 blocks along N).
layout(constant_id = 3) const uint BK = 16;
// Split-K: with SPLIT_K > 1, work group z = s sums only its slice of the reduction (whole BK steps)
// and writes the partial C into slice s of binding 0, a [SPLIT_K, ROWS, COLS] scratch buffer;
// linear_splitk_reduce.comp then adds the slices in a fixed order (and the bias). This keeps a large
// GPU busy when the output has few tiles but the reduction is long (M = 512 x N = 2048, thin LoRA dW).
layout(constant_id = 4) const uint SPLIT_K = 1;

const uint BM = 8u * THREADS_Y;
const uint BN = 8u * THREADS_X;
const uint NUM_THREADS = THREADS_X * THREADS_Y;

// [r][i / 4] and [r][j / 4]: one reduction step per row, vec4 along the output dimension.
#ifdef FP16
#define TILE_VEC4 f16vec4
#define TILE_SCALAR float16_t
#else
#define TILE_VEC4 vec4
#define TILE_SCALAR float
#endif
shared TILE_VEC4 a_tile[BK][BM / 4u];
shared TILE_VEC4 b_tile[BK][BN / 4u];

#if defined(FP16) && LINEAR_MODE == LINEAR_MODE_BWD
#include "coopmat_scale.glsl"
// d_out's scale 2^a_scale_exponent (module comment), set by every thread of the workgroup.
int a_scale_exponent = 0;
float a_commit_scale = 1.0;
void set_a_scale(uint tid) {
    if (tid == 0u) operand_absmax[0] = 0u;
    barrier();
    uint bits = 0u;
    for (uint i = tid; i < pc.a_partials; i += NUM_THREADS) bits = max(bits, partial_absmax_bits[i]);
    atomicMax(operand_absmax[0], bits);
    barrier();
    a_scale_exponent = scale_exponent(operand_absmax[0]);
    a_commit_scale = ldexp(1.0, a_scale_exponent);
}
#define A_COMMIT(value) TILE_SCALAR((value) * a_commit_scale)
#else
#define A_COMMIT(value) TILE_SCALAR(value)
#endif

// Global -> register -> shared staging. `fetch_*` issues the global loads of the next reduction step
// into registers (so they are in flight while the current step is computed); `commit_*` writes them
// into the shared tiles once every thread has finished reading the current step (after its closing
// barrier). Values outside the matrices are zeros.

// A tile: BK x BM values as vec4s; DW reads them along i, the other modes along r (transposed).
const uint A_VECS = BK * BM / 4u;
const uint A_PER_THREAD = (A_VECS + NUM_THREADS - 1u) / NUM_THREADS;
vec4 a_stage[A_PER_THREAD];

void fetch_a(uint r0, uint i0, uint tid) {
    [[unroll]] for (uint s = 0u; s < A_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        a_stage[s] = vec4(0.0);
        if (v >= A_VECS) continue;
#if LINEAR_MODE == LINEAR_MODE_DW
        // A[r=m, i=n] = d_out[m, n]
        const uint m = r0 + v / (BM / 4u), n = i0 + 4u * (v % (BM / 4u));
        if (m < pc.M && n < pc.N) a_stage[s] = d_out[(m * pc.N + n) / 4u];
#else
        // A[r, i] = src[i, r]: BK/4 consecutive threads read the BK contiguous floats of one source row.
        const uint red = reduction_total();
        const uint m = i0 + v / (BK / 4u), r = r0 + 4u * (v % (BK / 4u));
        if (m < pc.M && r < red) {
#if LINEAR_MODE == LINEAR_MODE_FWD
            a_stage[s] = x[(pc.a_offset + m * pc.a_row_stride + r) / 4u];
#else
            a_stage[s] = d_out[(pc.a_offset + m * pc.a_row_stride + r) / 4u];
#endif
        }
#endif
    }
}

void commit_a(uint tid) {
    [[unroll]] for (uint s = 0u; s < A_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v >= A_VECS) continue;
#if LINEAR_MODE == LINEAR_MODE_DW
        a_tile[v / (BM / 4u)][v % (BM / 4u)] = a_stage[s];
#else
        const uint i = v / (BK / 4u), r4 = v % (BK / 4u);
        [[unroll]] for (uint c = 0u; c < 4u; ++c) {
            a_tile[4u * r4 + c][i / 4u][i % 4u] = A_COMMIT(a_stage[s][c]);
        }
#endif
    }
}

#if LINEAR_MODE == LINEAR_MODE_DW
// B tile of DW: x[m, k] rows, read along j and stored as is.
const uint B_VECS = BK * BN / 4u;
const uint B_PER_THREAD = (B_VECS + NUM_THREADS - 1u) / NUM_THREADS;
vec4 b_stage[B_PER_THREAD];

void fetch_b(uint r0, uint j0, uint tid) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        b_stage[s] = vec4(0.0);
        if (v >= B_VECS) continue;
        const uint m = r0 + v / (BN / 4u), k = j0 + 4u * (v % (BN / 4u));
        if (m < pc.M && k < pc.K) b_stage[s] = x[(m * pc.K + k) / 4u];
    }
}

void commit_b(uint tid) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v < B_VECS) b_tile[v / (BN / 4u)][v % (BN / 4u)] = b_stage[s];
    }
}
#else
// B tile from W_4X8: one uint word = 4 consecutive k x the row pair (n, n+1), plus those rows' scales
// (0 for words outside the matrix, so they decode to 0 whatever the word holds).
//   FWD: the tile spans BK/4 k4-rows of BN/8 blocks; consecutive threads take consecutive words of a
//        k4-row (contiguous memory).
//   BWD: the tile spans BN/4 k4-rows of BK/8 blocks (BK/2 contiguous words per k4-row).
#if LINEAR_MODE == LINEAR_MODE_FWD
const uint B_WORDS_PER_K4 = BN / 2u;
const uint B_WORDS = (BK / 4u) * B_WORDS_PER_K4;
#else
const uint B_WORDS_PER_K4 = BK / 2u;
const uint B_WORDS = (BN / 4u) * B_WORDS_PER_K4;
#endif
const uint B_PER_THREAD = (B_WORDS + NUM_THREADS - 1u) / NUM_THREADS;
uint b_stage_word[B_PER_THREAD];
vec2 b_stage_scale[B_PER_THREAD];

void fetch_b(uint r0, uint j0, uint tid) {
    const uint N8 = n8_count();
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        b_stage_word[s] = 0u;
        b_stage_scale[s] = vec2(0.0);
        if (v >= B_WORDS) continue;
        const uint k4l = v / B_WORDS_PER_K4, rest = v % B_WORDS_PER_K4;
#if LINEAR_MODE == LINEAR_MODE_FWD
        const uint k4 = r0 / 4u + k4l, n8 = j0 / 8u + rest / 4u;
#else
        const uint k4 = j0 / 4u + k4l, n8 = r0 / 8u + rest / 4u;
#endif
        if (4u * k4 < pc.K && n8 < N8) {
            const uint jw = rest % 4u;
            const uint g = (4u * k4) / pc.group_size, n = 8u * n8 + 2u * jw;
            b_stage_word[s] = w4x8[pc.w_offset + 4u * (k4 * N8 + n8) + jw];
            b_stage_scale[s] = vec2(scale_at(g, n), scale_at(g, n + 1u));
        }
    }
}

void commit_b(uint tid) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v >= B_WORDS) continue;
        const uint k4l = v / B_WORDS_PER_K4, rest = v % B_WORDS_PER_K4;
        const uint pair = 8u * (rest / 4u) + 2u * (rest % 4u);  // tile-local n of the even row
        const vec4 low = decode_low(b_stage_word[s]) * b_stage_scale[s].x;    // row n, k = 4*k4 + 0..3
        const vec4 high = decode_high(b_stage_word[s]) * b_stage_scale[s].y;  // row n + 1
#if LINEAR_MODE == LINEAR_MODE_FWD
        // b_tile[k][n]: the pair is two adjacent floats of one vec4 (pair is even).
        [[unroll]] for (uint t = 0u; t < 4u; ++t) {
            b_tile[4u * k4l + t][pair / 4u][pair % 4u] = TILE_SCALAR(low[t]);
            b_tile[4u * k4l + t][pair / 4u][pair % 4u + 1u] = TILE_SCALAR(high[t]);
        }
#else
        // b_tile[n][k]: each row of the pair takes one vec4 (4 consecutive k).
        b_tile[pair][k4l] = TILE_VEC4(low);
        b_tile[pair + 1u][k4l] = TILE_VEC4(high);
#endif
    }
}
#endif

void main() {
    const uint tx = gl_LocalInvocationID.x, ty = gl_LocalInvocationID.y;
    const uint tid = ty * THREADS_X + tx;
    const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
    const uint i0 = group.y * BM;
    const uint j0 = group.x * BN;
    const uint rows = rows_total(), cols = cols_total(), red = reduction_total();
    if (i0 >= rows) {
        return;  // uniform across the workgroup, so no barrier is skipped by part of it
    }
#if defined(FP16) && LINEAR_MODE == LINEAR_MODE_BWD
    set_a_scale(tid);
#endif
    // This workgroup's reduction range; a slice may be empty (it then writes zeros).
    uint r_begin = 0u, r_end = red;
    if (SPLIT_K > 1u) {
        const uint slice = ((red + SPLIT_K - 1u) / SPLIT_K + BK - 1u) / BK * BK;
        r_begin = min(red, group.z * slice);
        r_end = min(red, r_begin + slice);
    }

    // acc[h * 4 + a][c]: row i0 + h*BM/2 + 4*ty + a, columns j0 + c*BN/2 + 4*tx .. +3.
    vec4 acc[8][2];
    [[unroll]] for (uint a = 0u; a < 8u; ++a) {
        acc[a][0] = vec4(0.0);
        acc[a][1] = vec4(0.0);
    }
#if defined(ACCUMULATE) && LINEAR_MODE == LINEAR_MODE_FWD
    [[unroll]] for (uint h = 0u; h < 2u; ++h) {
        [[unroll]] for (uint a = 0u; a < 4u; ++a) {
            const uint i = i0 + h * (BM / 2u) + 4u * ty + a;
            [[unroll]] for (uint c = 0u; c < 2u; ++c) {
                const uint j = j0 + c * (BN / 2u) + 4u * tx;
                if (i < rows && j < cols) acc[h * 4u + a][c] = y[(pc.c_offset + i * pc.c_row_stride + j) / 4u];
            }
        }
    }
#endif

    fetch_a(r_begin, i0, tid);
    fetch_b(r_begin, j0, tid);
    for (uint r0 = r_begin; r0 < r_end; r0 += BK) {
        commit_a(tid);
        commit_b(tid);
        barrier();
        if (r0 + BK < r_end) {  // the next step's global loads overlap this step's arithmetic
            fetch_a(r0 + BK, i0, tid);
            fetch_b(r0 + BK, j0, tid);
        }
        [[unroll]] for (uint r = 0u; r < BK; ++r) {
            const vec4 a_lo = vec4(a_tile[r][ty]), a_hi = vec4(a_tile[r][ty + BM / 8u]);
            const vec4 b_lo = vec4(b_tile[r][tx]), b_hi = vec4(b_tile[r][tx + BN / 8u]);
            [[unroll]] for (uint a = 0u; a < 4u; ++a) {
                acc[a][0] += a_lo[a] * b_lo;
                acc[a][1] += a_lo[a] * b_hi;
                acc[4u + a][0] += a_hi[a] * b_lo;
                acc[4u + a][1] += a_hi[a] * b_hi;
            }
        }
        barrier();
    }

    [[unroll]] for (uint h = 0u; h < 2u; ++h) {
        [[unroll]] for (uint a = 0u; a < 4u; ++a) {
            const uint i = i0 + h * (BM / 2u) + 4u * ty + a;
            if (i >= rows) continue;
            [[unroll]] for (uint c = 0u; c < 2u; ++c) {
                const uint j = j0 + c * (BN / 2u) + 4u * tx;  // cols % 4 == 0: all 4 in or all out
                if (j >= cols) continue;
                vec4 value = acc[h * 4u + a][c];
#if defined(FP16) && LINEAR_MODE == LINEAR_MODE_BWD
                value = ldexp(value, ivec4(-a_scale_exponent));  // exact
#endif
                // Slice z of the split-K scratch (contiguous: c_row_stride = cols), or C itself (z = 0).
                const uint index = (pc.c_offset + (group.z * rows + i) * pc.c_row_stride + j) / 4u;
#if LINEAR_MODE == LINEAR_MODE_FWD
#ifdef HAS_BIAS
                value += bias[j / 4u];  // the plan never combines HAS_BIAS with SPLIT_K > 1
#endif
                y[index] = value;
#elif LINEAR_MODE == LINEAR_MODE_BWD
                dx[index] = value;
#else
                dw[index] = value;
#endif
            }
        }
    }
}
#endif  // CPU_REGISTER_TILES
