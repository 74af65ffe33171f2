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
// Strides, offsets (C's row stride too), bias, batches and split-K slices are those of the shared-memory
// body (matmul.comp);
// the sum runs over k ascending as there. Rows and columns past the edges load the last row / column (in
// bounds) and store nothing; steps of k past the end load a clamped address and add zeros. The loop over
// K advances CHUNK = 2 * CPU_LANES steps at a time (lavapipe ends an invocation after 65535 trips of one
// loop).
//
// Paired loads. lavapipe's per-lane loop costs the same for 32 and 64 bits, so where two floats an
// invocation needs are adjacent and 8-byte aligned it loads them as one uint64_t (variants, chosen by
// the plan only when every such address is even and the length along the pairs is even):
//   A_PAIRS: A is contiguous along k; lane l holds steps 2l, 2l + 1 of a chunk (else steps l, l + 8).
//   B_PAIRS: B is contiguous along n (B_N_PAIRS, id 5: columns n0, n0 + 1 of one step; CPU_TN == 2) or
//            along k (a transposed weight: steps 2p, 2p + 1 of one column).

#ifndef CPU_LANES
#define CPU_LANES 8
#endif
#ifndef CPU_TM
#define CPU_TM 16
#endif
#ifndef CPU_TN
#define CPU_TN 2
#endif

#if CPU_TN != 2
#error "B_N_PAIRS loads CPU_TN == 2 columns as one pair"
#endif
#define CHUNK (2u * CPU_LANES)

layout(local_size_x = CPU_LANES) in;
layout(constant_id = 5) const bool B_N_PAIRS = false;

// The two floats at the even element index `e` of A / B.
#ifdef A_PAIRS
vec2 a_pair(uint e) { return uintBitsToFloat(unpackUint2x32(a_pairs[e / 2u])); }
const bool A_K_PAIRS = true;
#else
const bool A_K_PAIRS = false;
#endif
#if defined(B_PAIRS) && !defined(B_Q8_0)  // (B_Q8_0's b_pair dequantizes: matmul.comp)
vec2 b_pair(uint e) { return uintBitsToFloat(unpackUint2x32(b_pairs[e / 2u])); }
#endif

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
    // With B_N_PAIRS (N even): the first of this lane's two columns, clamped to the last pair.
    const uint b_pair_col = b_base + min(n0, params.N - 2u);
    for (uint chunk = k_begin; chunk < k_end; chunk += CHUNK) {
        // This lane's share of A: 2 steps of every row (0 past the slice).
        vec2 a_share[CPU_TM];
#ifdef A_PAIRS
        {  // K even: a pair is inside the slice or past it as a whole
            const uint k = chunk + 2u * lane;
            [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
                const vec2 value = a_pair(a_row[i] + min(k, k_end - 2u));
                a_share[i] = k < k_end ? value : vec2(0.0);
            }
        }
#else
        [[unroll]] for (uint h = 0u; h < 2u; ++h) {
            const uint k = chunk + lane + h * CPU_LANES;
            [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
                const float value = a_data[a_row[i] + min(k, k_end - 1u) * params.a_k_stride];
                a_share[i][h] = k < k_end ? value : 0.0;
            }
        }
#endif
        vec2 b_k_pair[CPU_TN];
        [[unroll]] for (uint s = 0u; s < CHUNK; ++s) {
            float b_frag[CPU_TN];
#ifdef B_PAIRS
            if (B_N_PAIRS) {
                const vec2 pair = b_pair(b_pair_col + min(chunk + s, k_end - 1u) * params.b_k_stride);
                b_frag[0] = pair.x;
                b_frag[1] = pair.y;
            } else {
                if (s % 2u == 0u) {
                    [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                        b_k_pair[j] = b_pair(b_col[j] + min(chunk + s, k_end - 2u));
                    }
                }
                [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                    b_frag[j] = b_k_pair[j][s % 2u];
                }
            }
#else
            [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                b_frag[j] = b_at(b_col[j] + min(chunk + s, k_end - 1u) * params.b_k_stride);
            }
#endif
            // Step s of the chunk is held by lane s / 2 (A_K_PAIRS) or s % CPU_LANES.
            const uint holder = A_K_PAIRS ? s / 2u : s % CPU_LANES;
            const uint part = A_K_PAIRS ? s % 2u : s / CPU_LANES;
            [[unroll]] for (uint i = 0u; i < CPU_TM; ++i) {
                const float a = subgroupShuffle(a_share[i][part], holder);
                [[unroll]] for (uint j = 0u; j < CPU_TN; ++j) {
                    acc[i][j] = fma(a, b_frag[j], acc[i][j]);
                }
            }
        }
    }

    const uint c_base = params.c_offset + group.z * params.M * params.c_m_stride;
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
            c_data[c_base + m * params.c_m_stride + n] = value;
        }
    }
}
