#version 450
// Dense fp32 tiled GEMM (host module: vktrain/runtime/kernels/matmul.py).
//
// C[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n]  (+ beta * bias[b, m, n] when HAS_BIAS)
//
// A, B and bias are addressed through element strides (batch, row, column) plus an element offset,
// so transposed operands (t_copy / permute folded into the GEMM), broadcast batches (stride 0) and
// addmm's broadcast bias need no copy. C is contiguous [batch, M, N].
//
// Tiling: a workgroup of 16 x 16 threads computes a 64 x 64 tile of C; each thread owns a 4 x 4
// micro-tile at rows ty + 16 i and columns tx + 16 j (so shared-memory reads are conflict-free and
// global stores coalesce). K advances in steps of 16 through shared memory. Partial tiles at the M,
// N and K edges load zeros and skip the stores.
//
// Every loop but the one over K is unrolled: lavapipe ends an invocation after 65535 loop trips, so
// K may reach 16 * 65535 there.
//
// Variants (#define): HAS_BIAS=0 (mm, bmm) or HAS_BIAS=1 (addmm / baddbmm).
// Specialization constants: A_M_FASTEST (id 3) / B_K_FASTEST (id 4) pick the order in which a
// workgroup walks a tile while loading it, so that neighbouring threads read neighbouring addresses
// whichever of the operand's two strides is 1.
// vktrain-variants: HAS_BIAS=0, HAS_BIAS=1
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#ifndef HAS_BIAS
#define HAS_BIAS 0
#endif
#define TILE_M 64
#define TILE_N 64
#define TILE_K 16
#define THREADS_M 16
#define THREADS_N 16
#define MICRO_M 4   // TILE_M / THREADS_M
#define MICRO_N 4   // TILE_N / THREADS_N
#define THREADS (THREADS_M * THREADS_N)
#define LOADS_PER_THREAD 4u  // TILE_M * TILE_K / THREADS (= TILE_N * TILE_K / THREADS)

layout(local_size_x = THREADS_N, local_size_y = THREADS_M) in;

layout(constant_id = 3) const bool A_M_FASTEST = false;
layout(constant_id = 4) const bool B_K_FASTEST = false;

layout(std430, set = 0, binding = 0) writeonly buffer CBuffer { float c_data[]; };
layout(std430, set = 0, binding = 1) readonly buffer ABuffer { float a_data[]; };
layout(std430, set = 0, binding = 2) readonly buffer BBuffer { float b_data[]; };
#if HAS_BIAS
layout(std430, set = 0, binding = 3) readonly buffer BiasBuffer { float bias_data[]; };
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
} params;

// +1 column of padding: in k-fastest load order, 16 neighbouring threads store one tile column
// (stride TILE_M + 1 words apart), which without padding would all hit the same bank.
shared float a_tile[TILE_K][TILE_M + 1];
shared float b_tile[TILE_K][TILE_N + 1];

void main() {
    uint tx = gl_LocalInvocationID.x;
    uint ty = gl_LocalInvocationID.y;
    uint tid = ty * THREADS_N + tx;
    uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(params);
    uint batch = group.z;
    uint tile_m0 = group.y * TILE_M;
    uint tile_n0 = group.x * TILE_N;

    uint a_base = params.a_offset + batch * params.a_batch_stride;
    uint b_base = params.b_offset + batch * params.b_batch_stride;

    float acc[MICRO_M][MICRO_N];
    [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
        [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
            acc[i][j] = 0.0;
        }
    }

    for (uint k0 = 0u; k0 < params.K; k0 += TILE_K) {
        // Each thread loads (TILE_M * TILE_K) / THREADS = 4 elements of A and 4 of B.
        [[unroll]] for (uint load = 0u; load < LOADS_PER_THREAD; ++load) {
            uint e = tid + load * THREADS;
            uint mm = A_M_FASTEST ? e % TILE_M : e / TILE_K;
            uint kk = A_M_FASTEST ? e / TILE_M : e % TILE_K;
            uint m = tile_m0 + mm;
            uint k = k0 + kk;
            a_tile[kk][mm] = (m < params.M && k < params.K)
                ? a_data[a_base + m * params.a_m_stride + k * params.a_k_stride] : 0.0;
        }
        [[unroll]] for (uint load = 0u; load < LOADS_PER_THREAD; ++load) {
            uint e = tid + load * THREADS;
            uint nn = B_K_FASTEST ? e / TILE_K : e % TILE_N;
            uint kk = B_K_FASTEST ? e % TILE_K : e / TILE_N;
            uint n = tile_n0 + nn;
            uint k = k0 + kk;
            b_tile[kk][nn] = (n < params.N && k < params.K)
                ? b_data[b_base + k * params.b_k_stride + n * params.b_n_stride] : 0.0;
        }
        barrier();

        [[unroll]] for (uint kk = 0u; kk < TILE_K; ++kk) {
            float a_frag[MICRO_M];
            float b_frag[MICRO_N];
            [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
                a_frag[i] = a_tile[kk][ty + i * THREADS_M];
            }
            [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                b_frag[j] = b_tile[kk][tx + j * THREADS_N];
            }
            [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
                [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
                    acc[i][j] += a_frag[i] * b_frag[j];
                }
            }
        }
        barrier();
    }

    uint c_base = batch * params.M * params.N;
    [[unroll]] for (uint i = 0u; i < MICRO_M; ++i) {
        uint m = tile_m0 + ty + i * THREADS_M;
        if (m >= params.M) {
            continue;
        }
        [[unroll]] for (uint j = 0u; j < MICRO_N; ++j) {
            uint n = tile_n0 + tx + j * THREADS_N;
            if (n >= params.N) {
                continue;
            }
            float value = params.alpha * acc[i][j];
#if HAS_BIAS
            // beta == 0 ignores the bias entirely (even NaN/inf in it), as torch.addmm does.
            if (params.beta != 0.0) {
                value += params.beta * bias_data[params.bias_offset + batch * params.bias_batch_stride +
                                                 m * params.bias_m_stride + n * params.bias_n_stride];
            }
#endif
            c_data[c_base + m * params.N + n] = value;
        }
    }
}
