// Tensor-core GEMM body (VK_KHR_cooperative_matrix): C[M, N] = A[M, K] @ B[K, N] with fp16 inputs and
// fp32 accumulation, included by coopmat_linear_q4gsw.comp, coopmat_linear_q4gsw_backward.comp and
// coopmat_mm.comp, each of which defines how the B tile is staged first: COOPMAT_B_Q4GSW (B = deq(W).T),
// COOPMAT_B_Q4GSW_T (B = deq(W), the base's d_x), COOPMAT_B_ROW_MAJOR or COOPMAT_B_TRANSPOSED.
//
// A_SCALE: A is multiplied by the power of two 2^e that puts its largest magnitude (binding 4: the
// pc.a_partials per-workgroup maxima of |A| from coopmat_absmax.slang, as float bits) in [2^14, 2^15) before the fp16 rounding, and the
// accumulators by 2^-e before they are stored: both exact, so the result is that of A with fp16's full
// precision wherever |a| > max|A| * 2^-29 (gradients, whose scale follows the loss divisor).
// AB_SCALE (the dense B operands only): both A and B scaled so, each by its own power of two (binding 3:
// pc.a_partials maxima of |A|, then pc.b_partials of |B|), and the accumulators by the inverse of their
// product. Every workgroup reduces the partials itself (a few hundred words at most; coopmat_scale.glsl).
//
// A (fp32 in memory, row-major) and B are rounded to fp16 while they are staged in shared memory: no
// separate cast pass, no fp16 copy of the activations (the H200 probe of shared/device/NOTES.md).
// Rounding error: each product a_k b_k is computed from fp16(a_k) fp16(b_k), relative error <= 2^-11
// each, then summed in fp32 (tests/test_kernels_coopmat.py derives its tolerance from this).
//
// Tiling: a workgroup of SG_M x SG_N subgroups (defines, default 2 x 2) of SUBGROUP_SIZE invocations
// (a define, default 32: the variant name carries it, e.g. coopmat_mm@SUBGROUP_SIZE=64) owns a BM x BN
// tile of C (defines, default 128 x 128) as subgroup tiles of (BM/SG_M) x (BN/SG_N), each a grid of
// 16 x 16 accumulators. The reduction advances BK (a define, 32 or 64) at a time: every thread fetches
// its share of the A and B tiles from memory into registers, converts and writes them into shared
// memory, and the subgroups multiply (BK/16 steps of 16x16x16 products). STAGES=1 (default): one shared
// buffer, a barrier after the writes and one after the products; with PREFETCH the next step's loads
// are issued before this step's products (latency hidden behind them, at the cost of the registers
// that hold them). STAGES=2: two shared buffers and one barrier per step: step k+1 is fetched before
// step k's products and written into the other buffer after them. Shared rows carry a 16-byte skew
// (found best by the probe: fewer bank conflicts in the matrix loads). The output is stored straight
// from the accumulators where a 16 x 16 block lies inside C, and through a per-subgroup shared block
// with bounds checks at the edges. kernels/coopmat_tiling.py (CoopmatTiling) names the variants and checks
// what fits the 48 KiB of shared memory (the #error below says it again).
//
// Split-K (pc.k_slice > 0): workgroup z takes the reduction slice [z * k_slice, (z + 1) * k_slice) and
// stores its partial product at C + z * M * N (the plan points C at a scratch buffer and adds the slices
// in order with linear_splitk_reduce.comp: bitwise reproducible, no atomics). The operand scales are
// those of the whole tensors, so every slice unscales by the same power of two.
//
// COOPMAT_EMULATE replaces the cooperative-matrix operations (load, multiply-add, store) by plain
// shared-memory arithmetic with the same semantics, so a device without the extension (lavapipe in
// CI) runs everything else of this file: staging, W_4X8 decoding, tiling, fragment offsets and the
// edge stores. It is a test path, not a fast one.

#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#ifndef COOPMAT_EMULATE
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#ifndef SUBGROUP_SIZE
#define SUBGROUP_SIZE 32
#endif
#ifndef SG_M
#define SG_M 2                         // subgroups along M
#endif
#ifndef SG_N
#define SG_N 2                         // subgroups along N
#endif
#define NUM_SUBGROUPS (SG_M * SG_N)
#define NUM_THREADS (NUM_SUBGROUPS * SUBGROUP_SIZE)
layout(local_size_x = NUM_THREADS, local_size_y = 1, local_size_z = 1) in;

#ifndef BM
#define BM 128
#endif
#ifndef BN
#define BN 128
#endif
#ifndef BK
#define BK 32
#endif
#ifndef STAGES
#define STAGES 1
#endif
#if STAGES == 2 && defined(PREFETCH)
#error "STAGES=2 already fetches the next step before the products: no PREFETCH with it"
#elif STAGES != 1 && STAGES != 2
#error "STAGES is 1 or 2"
#endif
#define TILE 16                        // the 16x16x16 cooperative-matrix shape
#define WM (BM / SG_M)                 // rows of C one subgroup owns
#define WN (BN / SG_N)
#define FRAG_M (WM / TILE)             // accumulators per subgroup along M
#define FRAG_N (WN / TILE)
#if WM % TILE != 0 || WN % TILE != 0 || BK % TILE != 0
#error "BM / SG_M, BN / SG_N and BK must be multiples of 16"
#endif
#define SKEW4 2                        // 16-byte row skew, in f16vec4 (8 bytes each)
#define K_STRIDE4 (BK / 4 + SKEW4)     // f16vec4 per shared row of a K-contiguous tile
#define N_STRIDE4 (BN / 4 + SKEW4)     // f16vec4 per shared row of an N-contiguous tile
#define A_VECS (BM * BK / 4)           // vec4 of A per step
#define A_PER_THREAD ((A_VECS + NUM_THREADS - 1) / NUM_THREADS)

layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;  // the runtime's group offset of split dispatches (common.glsl)
    uint M;
    uint N;
    uint K;
    uint group_size;      // q4gsw group size along K (COOPMAT_B_Q4GSW only)
    uint a_partials;      // A_SCALE / AB_SCALE: how many per-workgroup maxima of |A| the scale buffer holds
    uint b_partials;      // AB_SCALE: and of |B|, after those of A
    uint k_slice;         // split-K: reduction length per slice (a multiple of BK), 0 for the whole K
} pc;

layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { float c_out[]; };
layout(set = 0, binding = 1) readonly restrict buffer ABuf { vec4 a_in[]; };
#if defined(COOPMAT_B_Q4GSW)
// W_4X8 (docs/spec/w4x8.md) read as whole 16-byte blocks: block (k4, n8) covers k = 4k4..4k4+3 and
// n = 8n8..8n8+7; word j, byte t holds k = 4k4 + t of rows 8n8 + 2j (low nibble) and 8n8 + 2j + 1.
layout(set = 0, binding = 2) readonly restrict buffer WBuf { uvec4 w4x8[]; };
layout(set = 0, binding = 3) readonly restrict buffer SBuf { vec4 scales[]; };  // [G, N], N % 4 == 0
#define B_ITEMS ((BK / 4) * (BN / 8))  // W_4X8 blocks per step
#elif defined(COOPMAT_B_Q4GSW_T)
// The same W_4X8 blocks (see above) of W [N_w, K_w], where the GEMM's reduction runs along N_w = pc.K and
// its output columns along K_w = pc.N: block (k4, n8) is 8 reduction rows x 4 output columns of B.
layout(set = 0, binding = 2) readonly restrict buffer WBuf { uvec4 w4x8[]; };
layout(set = 0, binding = 3) readonly restrict buffer SBuf { vec4 scales[]; };  // [G, N_w], N_w % 4 == 0
#define B_ITEMS ((BN / 4) * (BK / 8))  // W_4X8 blocks per step
#elif defined(COOPMAT_B_ROW_MAJOR) || defined(COOPMAT_B_TRANSPOSED)
layout(set = 0, binding = 2) readonly restrict buffer BBuf { vec4 b_in[]; };
#define B_ITEMS (BK * BN / 4)          // vec4 of B per step
#else
#error "define COOPMAT_B_Q4GSW, COOPMAT_B_Q4GSW_T, COOPMAT_B_ROW_MAJOR or COOPMAT_B_TRANSPOSED before including coopmat_gemm.glsl"
#endif
#if defined(A_SCALE) && defined(AB_SCALE)
#error "A_SCALE (4-bit B) and AB_SCALE (dense B) exclude each other"
#elif defined(A_SCALE)
layout(set = 0, binding = 4) readonly restrict buffer AbsMaxBuf { uint partial_absmax_bits[]; };
#elif defined(AB_SCALE)
#if !defined(COOPMAT_B_ROW_MAJOR) && !defined(COOPMAT_B_TRANSPOSED)
#error "AB_SCALE scales a dense B operand"
#endif
layout(set = 0, binding = 3) readonly restrict buffer AbsMaxBuf { uint partial_absmax_bits[]; };
#endif
#if defined(A_SCALE) || defined(AB_SCALE)
#include "coopmat_scale.glsl"
#endif
#define B_PER_THREAD ((B_ITEMS + NUM_THREADS - 1) / NUM_THREADS)

#define A_STAGE4 (BM * K_STRIDE4)        // f16vec4 per stage of a_tile
#if defined(COOPMAT_B_ROW_MAJOR) || defined(COOPMAT_B_Q4GSW_T)
#define B_STAGE4 (BK * N_STRIDE4)        // b_tile [k][n]
#else
#define B_STAGE4 (BN * K_STRIDE4)        // b_tile [n][k]: B read as a column-major K x N matrix
#endif
#if 8 * STAGES * (A_STAGE4 + B_STAGE4) + 4 * NUM_SUBGROUPS * TILE * TILE + 8 > 49152
#error "the tiles of this variant exceed 48 KiB of shared memory"
#endif
shared f16vec4 a_tile[STAGES * A_STAGE4];  // [stage][m][k]
shared f16vec4 b_tile[STAGES * B_STAGE4];  // [stage][k][n] or [stage][n][k]
// Edge blocks of C go through here (one 16 x 16 block per subgroup), then to memory with bounds checks.
shared float edge_block[NUM_SUBGROUPS * TILE * TILE];

// ---- Fragment operations. Offsets and strides are in f16vec4 units of the shared arrays (what
// coopMatLoad takes for an array of vectors); B is row-major [k][n] or column-major [n][k] in b_tile.
#if defined(COOPMAT_B_ROW_MAJOR) || defined(COOPMAT_B_Q4GSW_T)
#define B_LAYOUT gl_CooperativeMatrixLayoutRowMajor
#define B_COLUMN_MAJOR false
#else
#define B_LAYOUT gl_CooperativeMatrixLayoutColumnMajor
#define B_COLUMN_MAJOR true
#endif

#ifndef COOPMAT_EMULATE
#define FragA coopmat<float16_t, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseA>
#define FragB coopmat<float16_t, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseB>
#define Acc coopmat<float, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseAccumulator>
#define ACC_ZERO Acc(0.0)
#define LOAD_A(frag, offset4, stride4) coopMatLoad(frag, a_tile, offset4, stride4, gl_CooperativeMatrixLayoutRowMajor)
#define LOAD_B(frag, offset4, stride4) coopMatLoad(frag, b_tile, offset4, stride4, B_LAYOUT)
#define MUL_ADD(acc, a, b) acc = coopMatMulAdd(a, b, acc)
#define SCALE_ACC(acc, factor) acc = acc * (factor)
#define STORE_OUT(acc, offset, stride) coopMatStore(acc, c_out, offset, stride, gl_CooperativeMatrixLayoutRowMajor)
#define STORE_EDGE(acc, offset) coopMatStore(acc, edge_block, offset, TILE, gl_CooperativeMatrixLayoutRowMajor)
#else
// An operand fragment is where it lies in shared memory; lane l of a subgroup holds the accumulator
// elements e = l + i * SUBGROUP_SIZE (row e / 16, column e % 16).
struct FragRef { uint offset4; uint stride4; };
#define ACC_PER_LANE (TILE * TILE / SUBGROUP_SIZE)
struct EmulatedAcc { float v[ACC_PER_LANE]; };
#define FragA FragRef
#define FragB FragRef
#define Acc EmulatedAcc

EmulatedAcc emulated_zero() {
    EmulatedAcc acc;
    [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) acc.v[i] = 0.0;
    return acc;
}

float a_at(FragRef f, uint row, uint col) {
    const uint h = 4u * f.offset4 + row * 4u * f.stride4 + col;
    return float(a_tile[h / 4u][h % 4u]);
}

float b_at(FragRef f, uint k, uint n) {
    const uint h = 4u * f.offset4 + (B_COLUMN_MAJOR ? n * 4u * f.stride4 + k : k * 4u * f.stride4 + n);
    return float(b_tile[h / 4u][h % 4u]);
}

// Unrolled over the accumulator elements (static indices: lavapipe makes a dynamically indexed private
// array very slow), not over k (keeps the code small). The loop over k is the outer one: lavapipe gives
// each invocation a budget of 65535 loop iterations over all its loops together and silently stops it
// past that (the outputs it has not stored stay unwritten, which showed as NaN), so the loop nest is kept
// to TILE trips per multiply-add (kernels/coopmat.py `emulated_loop_trips` refuses longer reductions).
void emulated_mul_add(inout EmulatedAcc acc, FragRef a, FragRef b) {
    [[dont_unroll]] for (uint k = 0u; k < TILE; ++k) {
        [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) {
            const uint e = gl_SubgroupInvocationID + i * SUBGROUP_SIZE;
            acc.v[i] += a_at(a, e / TILE, k) * b_at(b, k, e % TILE);
        }
    }
}

void emulated_store_out(EmulatedAcc acc, uint offset, uint stride) {
    [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) {
        const uint e = gl_SubgroupInvocationID + i * SUBGROUP_SIZE;
        c_out[offset + (e / TILE) * stride + e % TILE] = acc.v[i];
    }
}

void emulated_store_edge(EmulatedAcc acc, uint offset) {
    [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) edge_block[offset + gl_SubgroupInvocationID + i * SUBGROUP_SIZE] = acc.v[i];
}

#define ACC_ZERO emulated_zero()
#define LOAD_A(frag, offset4, stride4) frag = FragRef(offset4, stride4)
#define LOAD_B(frag, offset4, stride4) frag = FragRef(offset4, stride4)
#define MUL_ADD(acc, a, b) emulated_mul_add(acc, a, b)
#define SCALE_ACC(acc, factor) [[unroll]] for (uint i_ = 0u; i_ < ACC_PER_LANE; ++i_) acc.v[i_] *= (factor)
#define STORE_OUT(acc, offset, stride) emulated_store_out(acc, offset, stride)
#define STORE_EDGE(acc, offset) emulated_store_edge(acc, offset)
#endif

// ---- A: fp32 [M, K] row-major; BK/4 consecutive threads read the BK contiguous floats of one row.
vec4 a_stage[A_PER_THREAD];
float a_scale = 1.0;  // 2^e with A_SCALE / AB_SCALE (set in main), else 1
float b_scale = 1.0;  // the same for a dense B with AB_SCALE

void fetch_a(uint m0, uint k0, uint tid) {
    [[unroll]] for (uint s = 0u; s < A_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        const uint m = m0 + v / (BK / 4u), k = k0 + 4u * (v % (BK / 4u));
        a_stage[s] = vec4(0.0);
        if (v < A_VECS && m < pc.M && k < pc.K) a_stage[s] = a_in[(m * pc.K + k) / 4u];
    }
}

void commit_a(uint tid, uint base4) {
    [[unroll]] for (uint s = 0u; s < A_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v < A_VECS) a_tile[base4 + (v / (BK / 4u)) * K_STRIDE4 + v % (BK / 4u)] = f16vec4(a_stage[s] * a_scale);
    }
}

#if defined(COOPMAT_B_Q4GSW)
// ---- B: one W_4X8 block (8 rows x 4 k) per item, k4 fastest across threads: 8 consecutive threads
// write the 8 consecutive k4 of a row's tile (64 contiguous bytes of shared memory), and their global
// reads pair up with the next 8 threads' (block n8 + 1) into whole 32-byte sectors. (With n8 fastest
// every thread of a warp stored to the same bank: rows 8 apart are 8 x 80 bytes, a multiple of 128.)
// Outside the matrix the block is code 8 with zero scales: it decodes to 0.
uvec4 b_stage_block[B_PER_THREAD];
vec4 b_stage_scale_lo[B_PER_THREAD];  // scales of rows 8n8 .. 8n8+3
vec4 b_stage_scale_hi[B_PER_THREAD];  // rows 8n8+4 .. 8n8+7 (zero where N ends inside the block)

void fetch_b(uint n0, uint k0, uint tid) {
    const uint N8 = (pc.N / 4u + 1u) / 2u;
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        const uint k4 = k0 / 4u + v % (BK / 4u), n8 = n0 / 8u + v / (BK / 4u);
        b_stage_block[s] = uvec4(0x88888888u);
        b_stage_scale_lo[s] = vec4(0.0);
        b_stage_scale_hi[s] = vec4(0.0);
        if (v < B_ITEMS && 4u * k4 < pc.K && n8 < N8) {
            b_stage_block[s] = w4x8[k4 * N8 + n8];
            const uint s4 = ((4u * k4) / pc.group_size * pc.N + 8u * n8) / 4u;
            b_stage_scale_lo[s] = scales[s4];
            if (8u * n8 + 4u < pc.N) b_stage_scale_hi[s] = scales[s4 + 1u];
        }
    }
}

void commit_b(uint tid, uint base4) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v >= B_ITEMS) continue;
        const uint k4l = v % (BK / 4u), n8l = v / (BK / 4u);
        const float row_scale[8] = float[8](
            b_stage_scale_lo[s].x, b_stage_scale_lo[s].y, b_stage_scale_lo[s].z, b_stage_scale_lo[s].w,
            b_stage_scale_hi[s].x, b_stage_scale_hi[s].y, b_stage_scale_hi[s].z, b_stage_scale_hi[s].w);
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            const uint word = b_stage_block[s][j];
            const vec4 low = vec4((uvec4(word) >> uvec4(0u, 8u, 16u, 24u)) & 0xFu) - 8.0;   // row 8n8 + 2j
            const vec4 high = vec4((uvec4(word) >> uvec4(4u, 12u, 20u, 28u)) & 0xFu) - 8.0;  // row 8n8 + 2j + 1
            const uint row = 8u * n8l + 2u * j;
            b_tile[base4 + row * K_STRIDE4 + k4l] = f16vec4(low * row_scale[2u * j]);
            b_tile[base4 + (row + 1u) * K_STRIDE4 + k4l] = f16vec4(high * row_scale[2u * j + 1u]);
        }
    }
}
#elif defined(COOPMAT_B_Q4GSW_T)
// ---- B = deq(W): one W_4X8 block (8 reduction rows n x 4 output columns k) per item, k4 fastest across
// threads: the 8-byte shared stores of consecutive threads are consecutive in each row of b_tile. The
// scales and the code-8 padding are those of the forward kernel above.
uvec4 b_stage_block[B_PER_THREAD];
vec4 b_stage_scale_lo[B_PER_THREAD];
vec4 b_stage_scale_hi[B_PER_THREAD];

void fetch_b(uint n0, uint k0, uint tid) {
    const uint weight_rows = pc.K, weight_cols = pc.N;
    const uint N8 = (weight_rows / 4u + 1u) / 2u;
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        const uint k4 = n0 / 4u + v % (BN / 4u), n8 = k0 / 8u + v / (BN / 4u);
        b_stage_block[s] = uvec4(0x88888888u);
        b_stage_scale_lo[s] = vec4(0.0);
        b_stage_scale_hi[s] = vec4(0.0);
        if (v < B_ITEMS && 4u * k4 < weight_cols && n8 < N8) {
            b_stage_block[s] = w4x8[k4 * N8 + n8];
            const uint s4 = ((4u * k4) / pc.group_size * weight_rows + 8u * n8) / 4u;
            b_stage_scale_lo[s] = scales[s4];
            if (8u * n8 + 4u < weight_rows) b_stage_scale_hi[s] = scales[s4 + 1u];
        }
    }
}

void commit_b(uint tid, uint base4) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v >= B_ITEMS) continue;
        const uint k4l = v % (BN / 4u), n8l = v / (BN / 4u);
        const float row_scale[8] = float[8](
            b_stage_scale_lo[s].x, b_stage_scale_lo[s].y, b_stage_scale_lo[s].z, b_stage_scale_lo[s].w,
            b_stage_scale_hi[s].x, b_stage_scale_hi[s].y, b_stage_scale_hi[s].z, b_stage_scale_hi[s].w);
        [[unroll]] for (uint j = 0u; j < 4u; ++j) {
            const uint word = b_stage_block[s][j];
            const vec4 low = vec4((uvec4(word) >> uvec4(0u, 8u, 16u, 24u)) & 0xFu) - 8.0;   // row 8n8 + 2j
            const vec4 high = vec4((uvec4(word) >> uvec4(4u, 12u, 20u, 28u)) & 0xFu) - 8.0;  // row 8n8 + 2j + 1
            const uint row = 8u * n8l + 2u * j;
            b_tile[base4 + row * N_STRIDE4 + k4l] = f16vec4(low * row_scale[2u * j]);
            b_tile[base4 + (row + 1u) * N_STRIDE4 + k4l] = f16vec4(high * row_scale[2u * j + 1u]);
        }
    }
}
#else
vec4 b_stage[B_PER_THREAD];

#if defined(COOPMAT_B_ROW_MAJOR)
// ---- B: fp32 [K, N] row-major; BN/4 consecutive threads read one row of the tile.
void fetch_b(uint n0, uint k0, uint tid) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        const uint k = k0 + v / (BN / 4u), n = n0 + 4u * (v % (BN / 4u));
        b_stage[s] = vec4(0.0);
        if (v < B_ITEMS && k < pc.K && n < pc.N) b_stage[s] = b_in[(k * pc.N + n) / 4u];
    }
}

void commit_b(uint tid, uint base4) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v < B_ITEMS) b_tile[base4 + (v / (BN / 4u)) * N_STRIDE4 + v % (BN / 4u)] = f16vec4(b_stage[s] * b_scale);
    }
}
#else
// ---- B given as B^T: fp32 [N, K] row-major (C = A @ B^T, like a linear layer's weight).
void fetch_b(uint n0, uint k0, uint tid) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        const uint n = n0 + v / (BK / 4u), k = k0 + 4u * (v % (BK / 4u));
        b_stage[s] = vec4(0.0);
        if (v < B_ITEMS && n < pc.N && k < pc.K) b_stage[s] = b_in[(n * pc.K + k) / 4u];
    }
}

void commit_b(uint tid, uint base4) {
    [[unroll]] for (uint s = 0u; s < B_PER_THREAD; ++s) {
        const uint v = tid + s * NUM_THREADS;
        if (v < B_ITEMS) b_tile[base4 + (v / (BK / 4u)) * K_STRIDE4 + v % (BK / 4u)] = f16vec4(b_stage[s] * b_scale);
    }
}
#endif
#endif

// ---- ADDEND (coopmat_mm: aten.addmm with beta = alpha = 1): C = A @ B + D, D fp32 [M, N] row-major at
// binding 4. Each unscaled accumulator element plus its element of D, one fp32 rounding that is never
// contracted with the unscaling (`precise`): the bits of the product stored and then added, as the
// separate add did (vktrain/backend/passes/gemm_epilogue.py). Full blocks add a D block to the
// accumulator before storing it; edge blocks add D element-wise inside their bounds checks.
// Unsplit GEMMs only: a split-K plan adds D in its reduce, after the slices.
#ifdef ADDEND
#if defined(A_SCALE)
#error "ADDEND takes binding 4, which A_SCALE uses"
#endif
layout(set = 0, binding = 4) readonly restrict buffer AddendBuf { float addend_in[]; };
float with_addend(float value, uint index) {
    precise float sum = value + addend_in[index];
    return sum;
}
#ifndef COOPMAT_EMULATE
#define ADD_ADDEND(acc, offset, stride) { \
    Acc addend_block; \
    coopMatLoad(addend_block, addend_in, offset, stride, gl_CooperativeMatrixLayoutRowMajor); \
    precise Acc sum_ = acc + addend_block; \
    acc = sum_; }
#else
#define ADD_ADDEND(acc, offset, stride) [[unroll]] for (uint i_ = 0u; i_ < ACC_PER_LANE; ++i_) { \
    const uint e_ = gl_SubgroupInvocationID + i_ * SUBGROUP_SIZE; \
    acc.v[i_] = with_addend(acc.v[i_], (offset) + (e_ / TILE) * (stride) + e_ % TILE); }
#endif
#else
#define with_addend(value, index) (value)
#define ADD_ADDEND(acc, offset, stride)
#endif

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
    const uint m0 = group.y * BM, n0 = group.x * BN;
    const uint sg = gl_SubgroupID;
    const uint sg_m = sg / SG_N, sg_n = sg % SG_N;
    const uint k_begin = group.z * pc.k_slice;
    const uint k_end = pc.k_slice == 0u ? pc.K : min(pc.K, k_begin + pc.k_slice);
    const uint c_base = group.z * pc.M * pc.N;  // this slice's partial product (0 unsplit)
    int exponent = 0;  // of the product of the operand scales, undone before the store
#if defined(A_SCALE) || defined(AB_SCALE)
    reduce_partials(pc.a_partials, pc.b_partials);
    const int a_exponent = scale_exponent(operand_absmax[0]);
    a_scale = ldexp(1.0, a_exponent);
    exponent += a_exponent;
#endif
#ifdef AB_SCALE
    const int b_exponent = scale_exponent(operand_absmax[1]);
    b_scale = ldexp(1.0, b_exponent);
    exponent += b_exponent;
#endif

    Acc acc[FRAG_M][FRAG_N];
    [[unroll]] for (uint i = 0u; i < FRAG_M; ++i) {
        [[unroll]] for (uint j = 0u; j < FRAG_N; ++j) acc[i][j] = ACC_ZERO;
    }

    uint a_base = 0u, b_base = 0u;  // this step's stage of a_tile and b_tile (f16vec4 offsets)
#if STAGES == 2
    fetch_a(m0, k_begin, tid);
    fetch_b(n0, k_begin, tid);
    commit_a(tid, 0u);
    commit_b(tid, 0u);
    barrier();
#elif defined(PREFETCH)
    fetch_a(m0, k_begin, tid);
    fetch_b(n0, k_begin, tid);
#endif
    for (uint k0 = k_begin; k0 < k_end; k0 += BK) {
        const bool more = k0 + BK < k_end;
#if STAGES == 1
#ifndef PREFETCH
        fetch_a(m0, k0, tid);
        fetch_b(n0, k0, tid);
#endif
        commit_a(tid, 0u);
        commit_b(tid, 0u);
        barrier();
#endif
#if STAGES == 2 || defined(PREFETCH)
        if (more) {
            fetch_a(m0, k0 + BK, tid);
            fetch_b(n0, k0 + BK, tid);
        }
#endif
        [[unroll]] for (uint kk = 0u; kk < BK; kk += TILE) {
            FragA a_frag[FRAG_M];
            [[unroll]] for (uint i = 0u; i < FRAG_M; ++i) {
                LOAD_A(a_frag[i], a_base + (sg_m * WM + i * TILE) * K_STRIDE4 + kk / 4u, K_STRIDE4);
            }
            [[unroll]] for (uint j = 0u; j < FRAG_N; ++j) {
                FragB b_frag;
#if defined(COOPMAT_B_ROW_MAJOR) || defined(COOPMAT_B_Q4GSW_T)
                LOAD_B(b_frag, b_base + kk * N_STRIDE4 + (sg_n * WN + j * TILE) / 4u, N_STRIDE4);
#else
                LOAD_B(b_frag, b_base + (sg_n * WN + j * TILE) * K_STRIDE4 + kk / 4u, K_STRIDE4);
#endif
                [[unroll]] for (uint i = 0u; i < FRAG_M; ++i) MUL_ADD(acc[i][j], a_frag[i], b_frag);
            }
        }
#if STAGES == 2
        // The other stage was last read before the previous barrier: write the next step there.
        if (more) {
            commit_a(tid, A_STAGE4 - a_base);
            commit_b(tid, B_STAGE4 - b_base);
        }
        a_base = A_STAGE4 - a_base;
        b_base = B_STAGE4 - b_base;
#endif
        barrier();
    }

    const uint lane = gl_SubgroupInvocationID;
#if defined(A_SCALE) || defined(AB_SCALE)
    const float inverse_scale = ldexp(1.0, -exponent);
    [[unroll]] for (uint i = 0u; i < FRAG_M; ++i) {
        [[unroll]] for (uint j = 0u; j < FRAG_N; ++j) { SCALE_ACC(acc[i][j], inverse_scale); }
    }
#endif
    [[unroll]] for (uint i = 0u; i < FRAG_M; ++i) {
        [[unroll]] for (uint j = 0u; j < FRAG_N; ++j) {
            const uint row0 = m0 + sg_m * WM + i * TILE, col0 = n0 + sg_n * WN + j * TILE;
            if (row0 >= pc.M || col0 >= pc.N) continue;  // uniform over the subgroup
            if (row0 + TILE <= pc.M && col0 + TILE <= pc.N) {
                ADD_ADDEND(acc[i][j], row0 * pc.N + col0, pc.N);
                STORE_OUT(acc[i][j], c_base + row0 * pc.N + col0, pc.N);
                continue;
            }
            STORE_EDGE(acc[i][j], sg * TILE * TILE);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = lane; e < TILE * TILE; e += SUBGROUP_SIZE) {
                const uint row = row0 + e / TILE, col = col0 + e % TILE;
                if (row < pc.M && col < pc.N) c_out[c_base + row * pc.N + col] = with_addend(edge_block[sg * TILE * TILE + e], row * pc.N + col);
            }
            subgroupBarrier();  // every lane has read the block before the next edge store overwrites it
        }
    }
}
