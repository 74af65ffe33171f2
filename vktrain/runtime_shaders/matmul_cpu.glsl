// Register-tile body of matmul.comp for CPU Vulkan implementations (lavapipe / llvmpipe), included by
// matmul.comp for its CPU_REGISTER_TILES variants (host: kernels/matmul.py with CPU_TUNING).
//
// llvmpipe runs a workgroup's invocations as the SIMD lanes of one CPU thread, splits the shader at
// every barrier and, inside any loop, turns each buffer load into a loop over the lanes (one scalar per
// lane), even when every lane reads the same address. So: no shared memory, no barrier, and few loads. A
// workgroup is one subgroup of CPU_LANES invocations along N; each owns CPU_TM rows x CPU_TN adjacent
// columns of C in registers. The rows are every lane's, so A is loaded once per CPU_LANES steps of k,
// lane l loading step l, and handed to all lanes with subgroupShuffle (one vector permute); each
// element of B a lane loads feeds CPU_TM products.
// Strides, offsets, bias, batches and split-K slices are those of the shared-memory body (matmul.comp);
// the sum runs over k ascending as there. Rows and columns past the edges load the last row / column (in
// bounds) and store nothing; steps of k past the end load a clamped address and add zeros. The loop over
// K advances CPU_LANES steps at a time (lavapipe ends an invocation after 65535 trips of one loop).

#ifndef CPU_LANES
#define CPU_LANES 8
#endif
#ifndef CPU_TM
#define CPU_TM 16
#endif
#ifndef CPU_TN
#define CPU_TN 2
#endif

layout(local_size_x = CPU_LANES) in;

void main() {
    const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(params);
    const uint slice = group.z / params.batch;
    const uint batch = group.z % params.batch;
    const uint k_begin = slice * params.k_slice;
    const uint k_end = min(params.K, k_begin + min(params.k_slice, params.K));  // min: no uint overflow
    const uint m0 = group.y * CPU_TM;
    const uint n0 = (group.x * CPU_LANES + gl_LocalInvocationID.x) * CPU_TN;
    if (m0 >= params.M) {
        return;
    }
    const uint a_base = params.a_offset + batch * params.a_batch_stride;
    const uint b_base = params.b_offset + batch * params.b_batch_stride;

    uint a_row[CPU_TM];
    [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
        a_row[i] = a_base + min(m0 + i, params.M - 1u) * params.a_m_stride;
    }
    uint b_col[CPU_TN];
    [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
        b_col[j] = b_base + min(n0 + j, params.N - 1u) * params.b_n_stride;
    }
    float acc[CPU_TM][CPU_TN];
    [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
        [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
            acc[i][j] = 0.0;
        }
    }

    const uint lane = gl_SubgroupInvocationID;
    for (uint chunk = k_begin; chunk < k_end; chunk += CPU_LANES) {
        // This lane's share of A: step chunk + lane of every row (0 past the slice).
        const uint mine = min(chunk + lane, k_end - 1u);
        float a_share[CPU_TM];
        [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
            const float value = a_data[a_row[i] + mine * params.a_k_stride];
            a_share[i] = chunk + lane < k_end ? value : 0.0;
        }
        [[unroll]] for (uint l = 0u; l < CPU_LANES; ++l) {
            const uint k = min(chunk + l, k_end - 1u);
            float b_frag[CPU_TN];
            [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                b_frag[j] = b_data[b_col[j] + k * params.b_k_stride];
            }
            [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
                const float a = subgroupShuffle(a_share[i], l);
                [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                    acc[i][j] = fma(a, b_frag[j], acc[i][j]);
                }
            }
        }
    }

    const uint c_base = group.z * params.M * params.N;
    [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
        const uint m = m0 + i;
        if (m >= params.M) {
            continue;
        }
        [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
            const uint n = n0 + j;
            if (n >= params.N) {
                continue;
            }
            float value = params.alpha * acc[i][j];
#if HAS_BIAS
            // As in the shared-memory body: beta == 0 ignores the bias; only slice 0 adds it.
            if (params.beta != 0.0 && slice == 0u) {
                value += params.beta * bias_data[params.bias_offset + batch * params.bias_batch_stride +
                                                 m * params.bias_m_stride + n * params.bias_n_stride];
            }
#endif
            c_data[c_base + m * params.N + n] = value;
        }
    }
}
