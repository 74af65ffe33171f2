#version 450
// Dense fp32 tiled GEMM (host module: vktrain/backend/kernel_planning/kernels/matmul.py).
//
// C[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n]  (+ beta * bias[b, m, n] when HAS_BIAS)
//
// A, B and bias are addressed through element strides (batch, row, column) plus an element offset,
// so transposed operands (t_copy / permute folded into the GEMM), broadcast batches (stride 0) and
// addmm's broadcast bias need no copy. C[b, m, n] is element c_offset + (b * M + m) * c_m_stride + n: rows
// may be longer than N (c_m_stride > N), so a GEMM can write a window of columns of a wider matrix (the
// runtime splits a head's logits over vocabulary windows whose weights fit a binding); unsplit, c_m_stride = N.
//
// Tiling: a workgroup of (TILE_M / 4) x (TILE_N / 4) threads computes a TILE_M x TILE_N tile of C;
// each thread owns a 4 x 4 micro-tile at rows ty + THREADS_M i and columns tx + THREADS_N j (so
// shared-memory reads are conflict-free and global stores coalesce). K advances in steps of 16
// through shared memory. Partial tiles at the M, N and K edges load zeros and skip the stores.
// Tiles: 64 x 64 (default), 64 x 16 and 16 x 64 for outputs with a dimension <= 16 (a LoRA rank),
// which would leave 3/4 of a 64-wide tile idle.
// 32 x 64 (128 threads) takes a 64 x 64 tile's place on devices with fewer than 256 invocations per
// workgroup (Vulkan guarantees 128): each output is still one thread's sum over k in order, so the same bits.
//
// Split-K: group z = slice * batch + b. Slice s reduces k in [s * k_slice, min(K, (s + 1) * k_slice))
// and writes its partial result to C + (s * batch + b) * M * c_m_stride, so with several slices C is a
// [slices, batch, M, N] scratch buffer that a second dispatch (linear_splitk_reduce.comp) sums in
// slice order: deterministic, no atomics. Only slice 0 adds the bias. Unsplit: one slice, k_slice >= K.
//
// Every loop but the one over K is unrolled: lavapipe ends an invocation after 65535 loop trips, so
// k_slice may reach 16 * 65535 there.
//
// Variants (#define): HAS_BIAS=0 (mm, bmm) or HAS_BIAS=1 (addmm / baddbmm); TILE_M / TILE_N (64 when
// not defined); VEC4_C (only for N % 4 == 0): each thread owns 4 adjacent columns instead of columns
// THREADS_N apart, reads them from shared memory as one vec4 and stores each micro-tile row as one
// vec4, 4x fewer memory instructions for the output-bound shapes (h[T, 16] @ B^T[16, N]); it also needs
// c_offset and c_m_stride multiples of 4.
// Specialization constants: A_M_FASTEST (id 3) / B_K_FASTEST (id 4) pick the order in which a
// workgroup walks a tile while loading it, so that neighbouring threads read neighbouring addresses
// whichever of the operand's two strides is 1.
// CPU_REGISTER_TILES (with HAS_BIAS=0/1, no tile defines, optionally A_PAIRS, B_PAIRS, CPU_TM): the
// register-tile body of matmul_cpu.glsl for CPU Vulkan implementations, in place of the shared-memory one.
// B_Q8_0 (with any of the above): B's storage is a frozen Q8_0 matrix (vktrain/quant/q8_0.py), int8 codes
// (binding 2) and float32 scales (binding 3; the bias, if any, then binding 4), dequantized as each element
// is loaded; the products and their order are those of the float32 variant reading the dequantized matrix.
// (The bias form adds the previous partial of a reduction the runtime splits over windows of B's rows.)
// FP16 (with HAS_BIAS, the tile defines and VEC4_C; the `fp16` GEMM precision policy, docs/PRECISION.md):
// the shared tiles hold fp16; A and B are each multiplied by the power of two that puts the tensor's
// largest magnitude in [2^14, 2^15) (either may be a gradient: the head's d_h) before their rounding
// (coopmat_scale.glsl; the partial maxima coopmat_absmax wrote of A, then of B, in the binding after the
// last input, params.a_partials + params.b_partials of them), the products formed and summed in fp32, and
// each sum multiplied by 2^-(ea + eb) (exact) before alpha and the bias.
// vktrain-variants: HAS_BIAS=0, HAS_BIAS=1, HAS_BIAS=0+TILE_M=64+TILE_N=16, HAS_BIAS=1+TILE_M=64+TILE_N=16, HAS_BIAS=0+TILE_M=16+TILE_N=64, HAS_BIAS=1+TILE_M=16+TILE_N=64, HAS_BIAS=0+VEC4_C, HAS_BIAS=1+VEC4_C, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C
// vktrain-variants: HAS_BIAS=0+CPU_REGISTER_TILES, HAS_BIAS=1+CPU_REGISTER_TILES, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS
// vktrain-variants: HAS_BIAS=0+CPU_REGISTER_TILES+CPU_TM=32, HAS_BIAS=1+CPU_REGISTER_TILES+CPU_TM=32, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=32, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=32, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=32, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=32, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=32, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=32, HAS_BIAS=0+CPU_REGISTER_TILES+CPU_TM=64, HAS_BIAS=1+CPU_REGISTER_TILES+CPU_TM=64, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=64, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=64, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=64, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=64, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=64, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=64
// vktrain-variants: HAS_BIAS=0+FP16, HAS_BIAS=1+FP16, HAS_BIAS=0+VEC4_C+FP16, HAS_BIAS=1+VEC4_C+FP16
// vktrain-variants: HAS_BIAS=0+TILE_M=64+TILE_N=16+FP16, HAS_BIAS=1+TILE_M=64+TILE_N=16+FP16, HAS_BIAS=0+TILE_M=16+TILE_N=64+FP16, HAS_BIAS=1+TILE_M=16+TILE_N=64+FP16
// vktrain-variants: HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C+FP16, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C+FP16, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C+FP16, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C+FP16
// vktrain-variants: HAS_BIAS=0+B_Q8_0, HAS_BIAS=0+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=0+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=0+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0
// vktrain-variants: HAS_BIAS=1+B_Q8_0, HAS_BIAS=1+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+B_Q8_0, HAS_BIAS=1+TILE_M=64+TILE_N=16+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+B_Q8_0, HAS_BIAS=1+TILE_M=16+TILE_N=64+VEC4_C+B_Q8_0
// vktrain-variants: HAS_BIAS=0+CPU_REGISTER_TILES+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+CPU_TM=32+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+CPU_TM=64+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=64+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=64+B_Q8_0, HAS_BIAS=0+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=64+B_Q8_0
// vktrain-variants: HAS_BIAS=1+CPU_REGISTER_TILES+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+CPU_TM=32+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=32+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+CPU_TM=64+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+CPU_TM=64+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+B_PAIRS+CPU_TM=64+B_Q8_0, HAS_BIAS=1+CPU_REGISTER_TILES+A_PAIRS+B_PAIRS+CPU_TM=64+B_Q8_0
// vktrain-variants: HAS_BIAS=0+TILE_M=32+TILE_N=64, HAS_BIAS=0+TILE_M=32+TILE_N=64+FP16, HAS_BIAS=0+TILE_M=32+TILE_N=64+B_Q8_0, HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C, HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C+FP16, HAS_BIAS=0+TILE_M=32+TILE_N=64+VEC4_C+B_Q8_0, HAS_BIAS=1+TILE_M=32+TILE_N=64, HAS_BIAS=1+TILE_M=32+TILE_N=64+FP16, HAS_BIAS=1+TILE_M=32+TILE_N=64+B_Q8_0, HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C, HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C+FP16, HAS_BIAS=1+TILE_M=32+TILE_N=64+VEC4_C+B_Q8_0
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#ifdef CPU_REGISTER_TILES
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#endif
#ifdef FP16
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#if defined(CPU_REGISTER_TILES) || defined(B_Q8_0)
#error "FP16 is a variant of the shared-memory body over float32 operands"
#endif
#endif
#include "common.glsl"

#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#ifndef TILE_M
#define TILE_M 64
#endif
#ifndef TILE_N
#define TILE_N 64
#endif
#define TILE_K 16
#define MICRO_M 4
#define MICRO_N 4  // VEC4_C relies on it
#define THREADS_M (TILE_M / MICRO_M)
#define THREADS_N (TILE_N / MICRO_N)
#define THREADS (THREADS_M * THREADS_N)
// Elements of each operand tile every thread loads per K step (exact: TILE_K = 16 = MICRO_M * MICRO_N).
#define A_LOADS_PER_THREAD (TILE_M * TILE_K / THREADS)
#define B_LOADS_PER_THREAD (TILE_N * TILE_K / THREADS)
#if (TILE_M % MICRO_M) != 0 || (TILE_N % MICRO_N) != 0 || (TILE_M * TILE_K) % THREADS != 0 || (TILE_N * TILE_K) % THREADS != 0
#error "TILE_M and TILE_N must be multiples of 4 whose thread count divides their tile loads"
#endif

layout(constant_id = 3) const bool A_M_FASTEST = false;
layout(constant_id = 4) const bool B_K_FASTEST = false;

#ifdef VEC4_C
layout(std430, set = 0, binding = 0) writeonly buffer CBuffer { vec4 c_data[]; };
#else
layout(std430, set = 0, binding = 0) writeonly buffer CBuffer { float c_data[]; };
#endif
#ifdef A_PAIRS  // CPU_REGISTER_TILES only: A read as pairs of floats (matmul_cpu.glsl)
layout(std430, set = 0, binding = 1) readonly buffer ABuffer { uint64_t a_pairs[]; };
#else
layout(std430, set = 0, binding = 1) readonly buffer ABuffer { float a_data[]; };
#endif
#if defined(B_Q8_0)  // B's storage is a Q8_0 matrix (vktrain/quant/q8_0.py): int8 codes, four to a word, and a scale per 32
#define BIAS_BINDING 4
layout(std430, set = 0, binding = 2) readonly buffer BBuffer { uint b_codes[]; };
layout(std430, set = 0, binding = 3) readonly buffer BScaleBuffer { float b_scales[]; };
// Element e of B's storage: code * scale, exactly the float32 value the Q8_0 block holds.
float b_at(uint e) { return float(bitfieldExtract(int(b_codes[e >> 2u]), int(8u * (e & 3u)), 8)) * b_scales[e >> 5u]; }
#ifdef B_PAIRS  // elements e, e + 1 (e even): one word, one block
vec2 b_pair(uint e) {
    const int word = int(b_codes[e >> 2u]);
    const int shift = int(8u * (e & 2u));
    return vec2(bitfieldExtract(word, shift, 8), bitfieldExtract(word, shift + 8, 8)) * b_scales[e >> 5u];
}
#endif
#elif defined(B_PAIRS)  // likewise for B
layout(std430, set = 0, binding = 2) readonly buffer BBuffer { uint64_t b_pairs[]; };
#else
layout(std430, set = 0, binding = 2) readonly buffer BBuffer { float b_data[]; };
float b_at(uint e) { return b_data[e]; }
#endif
#ifndef BIAS_BINDING
#define BIAS_BINDING 3
#endif
#if HAS_BIAS
layout(std430, set = 0, binding = BIAS_BINDING) readonly buffer BiasBuffer { float bias_data[]; };
#endif
#ifdef FP16
layout(std430, set = 0, binding = BIAS_BINDING + HAS_BIAS) readonly buffer AbsmaxBuffer { uint partial_absmax_bits[]; };
#endif

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint M;
    uint N;
    uint K;
    uint a_offset;
    uint a_batch_stride;
    uint a_m_stride;
    uint a_k_stride;
    uint b_offset;
    uint b_batch_stride;
    uint b_k_stride;
    uint b_n_stride;
    uint bias_offset;
    uint bias_batch_stride;
    uint bias_m_stride;
    uint bias_n_stride;
    float alpha;
    float beta;
    uint batch;    // batches per slice: group z = slice * batch + b
    uint k_slice;  // reduction length of one slice (a multiple of TILE_K, or >= K when unsplit)
    uint c_offset;    // element of C[0, 0, 0] in binding 0
    uint c_m_stride;  // elements between rows of C (>= N)
#ifdef FP16
    uint a_partials;  // partial maxima of |A|, then of |B|, in the absmax binding
    uint b_partials;
#endif
} params;

#ifdef CPU_REGISTER_TILES
#include "matmul_cpu.glsl"
#else
layout(local_size_x = THREADS_N, local_size_y = THREADS_M) in;

#ifdef FP16
#define TILE_SCALAR float16_t
#define TILE_VEC4 f16vec4
#else
#define TILE_SCALAR float
#define TILE_VEC4 vec4
#endif
// +1 column of padding: in k-fastest load order, 16 neighbouring threads store one tile column
// (stride TILE_M + 1 words apart), which without padding would all hit the same bank.
shared TILE_SCALAR a_tile[TILE_K][TILE_M + 1];
#ifdef VEC4_C
// Rows padded by one vec4: k-fastest loads then store 16 neighbouring k 68 words apart (2-way conflict).
shared TILE_VEC4 b_tile[TILE_K][TILE_N / 4 + 1];
#define B_TILE(kk, nn) b_tile[kk][(nn) / 4u][(nn) % 4u]
#else
shared TILE_SCALAR b_tile[TILE_K][TILE_N + 1];
#define B_TILE(kk, nn) b_tile[kk][nn]
#endif

#ifdef FP16
#define NUM_THREADS THREADS
#include "coopmat_scale.glsl"
// The operand scales 2^ea, 2^eb (module comment); every thread of the workgroup calls it.
ivec2 operand_exponents(uint tid) {
    if (tid < 2u) operand_absmax[tid] = 0u;
    barrier();
    uint a_bits = 0u, b_bits = 0u;
    for (uint i = tid; i < params.a_partials; i += NUM_THREADS) a_bits = max(a_bits, partial_absmax_bits[i]);
    for (uint i = tid; i < params.b_partials; i += NUM_THREADS) {
        b_bits = max(b_bits, partial_absmax_bits[params.a_partials + i]);
    }
    atomicMax(operand_absmax[0], a_bits);
    atomicMax(operand_absmax[1], b_bits);
    barrier();
    return ivec2(scale_exponent(operand_absmax[0]), scale_exponent(operand_absmax[1]));
}
#endif

void main() {
    uint tx = gl_LocalInvocationID.x;
    uint ty = gl_LocalInvocationID.y;
    uint tid = ty * THREADS_N + tx;
    uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(params);
    uint slice = group.z / params.batch;
    uint batch = group.z % params.batch;
    uint k_begin = slice * params.k_slice;
    uint k_end = min(params.K, k_begin + min(params.k_slice, params.K));  // min: no uint overflow
    uint tile_m0 = group.y * TILE_M;
    uint tile_n0 = group.x * TILE_N;

    uint a_base = params.a_offset + batch * params.a_batch_stride;
    uint b_base = params.b_offset + batch * params.b_batch_stride;

#ifdef FP16
    const ivec2 exponents = operand_exponents(tid);
    const float a_scale = ldexp(1.0, exponents.x), b_scale = ldexp(1.0, exponents.y);
#define A_LOAD(value) float16_t((value) * a_scale)
#define B_LOAD(value) float16_t((value) * b_scale)
#else
#define A_LOAD(value) (value)
#define B_LOAD(value) (value)
#endif
    float acc[MICRO_M][MICRO_N];
    [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
        [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
            acc[i][j] = 0.0;
        }
    }

    for (uint k0 = k_begin; k0 < k_end; k0 += TILE_K) {
        [[unroll]] for (uint load = 0u; load < A_LOADS_PER_THREAD; ++load) {
            uint e = tid + load * THREADS;
            uint mm = A_M_FASTEST ? e % TILE_M : e / TILE_K;
            uint kk = A_M_FASTEST ? e / TILE_M : e % TILE_K;
            uint m = tile_m0 + mm;
            uint k = k0 + kk;
            a_tile[kk][mm] = A_LOAD((m < params.M && k < k_end)
                ? a_data[a_base + m * params.a_m_stride + k * params.a_k_stride] : 0.0);
        }
        [[unroll]] for (uint load = 0u; load < B_LOADS_PER_THREAD; ++load) {
            uint e = tid + load * THREADS;
            uint nn = B_K_FASTEST ? e / TILE_K : e % TILE_N;
            uint kk = B_K_FASTEST ? e % TILE_K : e / TILE_N;
            uint n = tile_n0 + nn;
            uint k = k0 + kk;
            B_TILE(kk, nn) = B_LOAD((n < params.N && k < k_end)
                ? b_at(b_base + k * params.b_k_stride + n * params.b_n_stride) : 0.0);
        }
        barrier();

        [[unroll]] for (uint kk = 0u; kk < TILE_K; ++kk) {
            float a_frag[MICRO_M];
            float b_frag[MICRO_N];
            [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
                a_frag[i] = float(a_tile[kk][ty + i * THREADS_M]);
            }
#ifdef VEC4_C
            vec4 b_vec = vec4(b_tile[kk][tx]);
            [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                b_frag[j] = b_vec[j];
            }
#else
            [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                b_frag[j] = float(b_tile[kk][tx + j * THREADS_N]);
            }
#endif
            [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
                [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                    acc[i][j] += a_frag[i] * b_frag[j];
                }
            }
        }
        barrier();
    }

#ifdef FP16
#define UNSCALE(sum) ldexp(sum, -(exponents.x + exponents.y))  // exact (a normal result)
#define UNSCALE4(sum) ldexp(sum, ivec4(-(exponents.x + exponents.y)))
#else
#define UNSCALE(sum) (sum)
#define UNSCALE4(sum) (sum)
#endif
    uint c_base = params.c_offset + group.z * params.M * params.c_m_stride;
    [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
        uint m = tile_m0 + ty + i * THREADS_M;
        if (m >= params.M) {
            continue;
        }
#ifdef VEC4_C
        // N, c_offset, c_m_stride % 4 == 0: the 4 columns are all inside the output or all outside, and
        // 16-byte aligned.
        uint n0 = tile_n0 + tx * MICRO_N;
        if (n0 >= params.N) {
            continue;
        }
        vec4 row = params.alpha * UNSCALE4(vec4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
#if HAS_BIAS
        if (params.beta != 0.0 && slice == 0u) {
            [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                row[j] += params.beta * bias_data[params.bias_offset + batch * params.bias_batch_stride +
                                                  m * params.bias_m_stride + (n0 + j) * params.bias_n_stride];
            }
        }
#endif
        c_data[(c_base + m * params.c_m_stride + n0) / 4u] = row;
#else
        [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
            uint n = tile_n0 + tx + j * THREADS_N;
            if (n >= params.N) {
                continue;
            }
            float value = params.alpha * UNSCALE(acc[i][j]);
#if HAS_BIAS
            // beta == 0 ignores the bias entirely (even NaN/inf in it), as torch.addmm does. Only
            // slice 0 adds it, so the split-K reduction adds it once.
            if (params.beta != 0.0 && slice == 0u) {
                value += params.beta * bias_data[params.bias_offset + batch * params.bias_batch_stride +
                                                 m * params.bias_m_stride + n * params.bias_n_stride];
            }
#endif
            c_data[c_base + m * params.c_m_stride + n] = value;
        }
#endif
    }
}
#endif  // CPU_REGISTER_TILES
