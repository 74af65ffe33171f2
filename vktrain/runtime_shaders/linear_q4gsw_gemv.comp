#version 450
// Small-M (GEMV-like) paths of linear_q4gsw and linear_q4gsw_backward, bound by reading W_4X8 once.
//
//   linear_q4gsw_gemv (@HAS_BIAS): y[M, N]  = x[M, K] @ deq(W).T (+ bias)   reduce over K
//   linear_q4gsw_gemv@BACKWARD:    dx[M, K] = d_out[M, N] @ deq(W)          reduce over N
// vktrain-variants: -, HAS_BIAS, BACKWARD
//
// Each workgroup covers ROWS rows of the activation. Its WG_X * WG_Y threads each read whole 16-byte
// W_4X8 blocks (4 k x 8 n); the lane index runs fastest along N8, so a subgroup reads consecutive
// blocks of one k4-row (coalesced). The threads that share an output slice split the reduction
// dimension between them and their partial sums are combined with a shared-memory tree.
//   forward:  x-lanes = output n8 columns (WG_X of them), y-lanes = slices of the K4 reduction.
//   backward: x-lanes = slices of the N8 reduction, y-lanes = output k4 columns (WG_Y of them).

#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

// Local size from spec ids 0, 1 (the runtime's convention); both powers of two (tree reductions).
VKTRAIN_LOCAL_SIZE_FROM_SPEC;
const uint WG_X = gl_WorkGroupSize.x;
const uint WG_Y = gl_WorkGroupSize.y;
layout(constant_id = 3) const uint ROWS = 1;   // activation rows per workgroup
// The q4gsw group size is a specialization constant here (the GEMMs take it as a push constant): the
// group index of every block is a division by it, which a constant turns into a multiply and shift.
layout(constant_id = 4) const uint GROUP_SIZE = 32;

layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;  // the runtime's group offset of split dispatches (common.glsl)
    uint M;
    uint N;
    uint K;
} pc;

layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { vec4 out_data[]; };   // y or dx
layout(set = 0, binding = 1) readonly restrict buffer InBuf { vec4 in_data[]; };      // x or d_out
layout(set = 0, binding = 2) readonly restrict buffer WBuf { uvec4 w4x8_blocks[]; };
layout(set = 0, binding = 3) readonly restrict buffer SBuf { vec4 scales4[]; };       // [G, N], N % 4 == 0
#if defined(HAS_BIAS) && !defined(BACKWARD)
layout(set = 0, binding = 4) readonly restrict buffer BiasBuf { vec4 bias[]; };
#endif

// Forward keeps 2 vec4 partial sums per row (8 n), backward 1 (4 k): size for the larger.
shared vec4 partial[WG_X * WG_Y * ROWS * 2u];

uint n8_count() { return (pc.N / 4u + 1u) / 2u; }

// Scales of rows 8*n8 .. 8*n8+7 in group g; the upper four exist only when N4 is even (otherwise they
// are W_4X8 padding rows, code 8, and their scales would overrun the buffer).
void load_block_scales(uint g, uint n8, out vec4 s_lo, out vec4 s_hi) {
    const uint base = (g * pc.N + 8u * n8) / 4u;
    s_lo = scales4[base];
    s_hi = 8u * n8 + 4u < pc.N ? scales4[base + 1u] : vec4(0.0);
}

// Decoding without int -> float conversions (a slow, quarter-rate-or-less unit on many GPUs; a GEMV
// decodes 32 weights per 16 bytes read). Split a word into halves (word, word >> 16): every nibble
// then sits at bit p in {0, 4, 8, 12} of its half. OR-ing it, masked in place, into 0x4B000000 (2^23)
// gives the float 2^23 + code * 2^p exactly, and subtracting 2^23 + 8 * 2^p leaves (code - 8) * 2^p
// exactly: two cheap ops per weight. The 2^p factors are undone by scaling the other operand with the
// exact powers of two below, so every product equals x * (code - 8) bit for bit (outside the fp32
// range edges: |x| < 2^-114 may flush to zero, backward partial sums overflow only past ~1e34).
// Even row of a word (low nibbles, k = 0..3 at bits 0, 8, 16, 24): 2^p = (1, 256, 1, 256).
// Odd row (high nibbles, bits 4, 12, 20, 28): 2^p = (16, 4096, 16, 4096).
const vec4 EVEN_UNSCALE = vec4(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);
const vec4 ODD_UNSCALE = vec4(1.0 / 16.0, 1.0 / 4096.0, 1.0 / 16.0, 1.0 / 4096.0);

vec4 decode_even_scaled(uint word) {
    const uint high = word >> 16u;
    const uvec4 bits = uvec4(word, word, high, high) & uvec4(0xFu, 0xF00u, 0xFu, 0xF00u);
    return uintBitsToFloat(bits | 0x4B000000u) - vec4(8388616.0, 8390656.0, 8388616.0, 8390656.0);
}

vec4 decode_odd_scaled(uint word) {
    const uint high = word >> 16u;
    const uvec4 bits = uvec4(word, word, high, high) & uvec4(0xF0u, 0xF000u, 0xF0u, 0xF000u);
    return uintBitsToFloat(bits | 0x4B000000u) - vec4(8388736.0, 8421376.0, 8388736.0, 8421376.0);
}

void gemv_forward(uint row0) {
    const uint nx = gl_LocalInvocationID.x, ks = gl_LocalInvocationID.y;
    const uint N8 = n8_count(), K4 = pc.K / 4u;  // K4 stops before the padding of K % 8 == 4
    const uint n8 = VKTRAIN_GLOBAL_GROUP_ID(pc).x * WG_X + nx;

    vec4 acc[ROWS][2];
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
        acc[r][0] = vec4(0.0);
        acc[r][1] = vec4(0.0);
    }
    if (n8 < N8) {
        // Two blocks per iteration, both loads issued before either is used (memory-level parallelism).
        for (uint k4_pair = ks; k4_pair < K4; k4_pair += 2u * WG_Y) {
            const uint k4s[2] = uint[2](k4_pair, k4_pair + WG_Y);
            uvec4 blocks[2];
            vec4 s_lo[2], s_hi[2];
            [[unroll]] for (uint u = 0u; u < 2u; ++u) {
                if (k4s[u] < K4) {
                    blocks[u] = w4x8_blocks[k4s[u] * N8 + n8];
                    load_block_scales((4u * k4s[u]) / GROUP_SIZE, n8, s_lo[u], s_hi[u]);
                }
            }
            [[unroll]] for (uint u = 0u; u < 2u; ++u) {
                if (k4s[u] >= K4) break;
                // (code - 8) * 2^p of the 8 rows, n_local = 2 * word + nibble.
                vec4 q[8];
                [[unroll]] for (uint jw = 0u; jw < 4u; ++jw) {
                    q[2u * jw] = decode_even_scaled(blocks[u][jw]);
                    q[2u * jw + 1u] = decode_odd_scaled(blocks[u][jw]);
                }
                [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                    const uint m = row0 + r;
                    if (m >= pc.M) break;
                    const vec4 xv = in_data[m * K4 + k4s[u]];
                    const vec4 xe = xv * EVEN_UNSCALE, xo = xv * ODD_UNSCALE;
                    const vec4 d_lo = vec4(dot(xe, q[0]), dot(xo, q[1]), dot(xe, q[2]), dot(xo, q[3]));
                    const vec4 d_hi = vec4(dot(xe, q[4]), dot(xo, q[5]), dot(xe, q[6]), dot(xo, q[7]));
                    acc[r][0] += d_lo * s_lo[u];
                    acc[r][1] += d_hi * s_hi[u];
                }
            }
        }
    }

    // partial[((r * 2 + half) * WG_Y + ks) * WG_X + nx]: the tree runs over ks.
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
        partial[((2u * r) * WG_Y + ks) * WG_X + nx] = acc[r][0];
        partial[((2u * r + 1u) * WG_Y + ks) * WG_X + nx] = acc[r][1];
    }
    barrier();
    for (uint stride = WG_Y / 2u; stride > 0u; stride /= 2u) {
        if (ks < stride) {
            [[unroll]] for (uint h = 0u; h < 2u * ROWS; ++h) {
                partial[(h * WG_Y + ks) * WG_X + nx] += partial[(h * WG_Y + ks + stride) * WG_X + nx];
            }
        }
        barrier();
    }

    // One thread per (row, vec4 of n) writes; the ks == 0 slot holds the sums.
    const uint tid = ks * WG_X + nx;
    for (uint idx = tid; idx < ROWS * 2u * WG_X; idx += WG_X * WG_Y) {
        const uint r = idx / (2u * WG_X), h = (idx / WG_X) % 2u, lane = idx % WG_X;
        const uint m = row0 + r, n = 8u * (VKTRAIN_GLOBAL_GROUP_ID(pc).x * WG_X + lane) + 4u * h;
        if (m < pc.M && n < pc.N) {
            vec4 value = partial[((2u * r + h) * WG_Y) * WG_X + lane];
#ifdef HAS_BIAS
            value += bias[n / 4u];
#endif
            out_data[(m * pc.N + n) / 4u] = value;
        }
    }
}

void gemv_backward(uint row0) {
    const uint ns = gl_LocalInvocationID.x, kx = gl_LocalInvocationID.y;
    const uint N8 = n8_count(), N4 = pc.N / 4u, K4 = pc.K / 4u;
    const uint k4 = VKTRAIN_GLOBAL_GROUP_ID(pc).x * WG_Y + kx;

    // Even and odd rows of each word accumulate separately, each with its own 2^p factors, and are
    // unscaled once at the end (exact powers of two; see decode_even_scaled).
    vec4 acc_even[ROWS], acc_odd[ROWS];
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
        acc_even[r] = vec4(0.0);
        acc_odd[r] = vec4(0.0);
    }
    if (k4 < K4) {
        const uint g = (4u * k4) / GROUP_SIZE;
        for (uint n8 = ns; n8 < N8; n8 += WG_X) {
            const uvec4 block = w4x8_blocks[k4 * N8 + n8];
            vec4 s_lo, s_hi;
            load_block_scales(g, n8, s_lo, s_hi);
            const bool has_upper = 2u * n8 + 1u < N4;
            vec4 q[8];
            [[unroll]] for (uint jw = 0u; jw < 4u; ++jw) {
                q[2u * jw] = decode_even_scaled(block[jw]);
                q[2u * jw + 1u] = decode_odd_scaled(block[jw]);
            }
            [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                const uint m = row0 + r;
                if (m >= pc.M) break;
                // d_out[m, n] * scale[g, n] for the 8 rows n of this block.
                const vec4 ds_lo = in_data[m * N4 + 2u * n8] * s_lo;
                const vec4 ds_hi = has_upper ? in_data[m * N4 + 2u * n8 + 1u] * s_hi : vec4(0.0);
                acc_even[r] += ds_lo[0] * q[0] + ds_lo[2] * q[2] + ds_hi[0] * q[4] + ds_hi[2] * q[6];
                acc_odd[r] += ds_lo[1] * q[1] + ds_lo[3] * q[3] + ds_hi[1] * q[5] + ds_hi[3] * q[7];
            }
        }
    }
    vec4 acc[ROWS];
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) acc[r] = acc_even[r] * EVEN_UNSCALE + acc_odd[r] * ODD_UNSCALE;

    // partial[(r * WG_Y + kx) * WG_X + ns]: the tree runs over ns.
    [[unroll]] for (uint r = 0u; r < ROWS; ++r) partial[(r * WG_Y + kx) * WG_X + ns] = acc[r];
    barrier();
    for (uint stride = WG_X / 2u; stride > 0u; stride /= 2u) {
        if (ns < stride) {
            [[unroll]] for (uint r = 0u; r < ROWS; ++r) {
                partial[(r * WG_Y + kx) * WG_X + ns] += partial[(r * WG_Y + kx) * WG_X + ns + stride];
            }
        }
        barrier();
    }

    const uint tid = kx * WG_X + ns;
    for (uint idx = tid; idx < ROWS * WG_Y; idx += WG_X * WG_Y) {
        const uint r = idx / WG_Y, lane = idx % WG_Y;
        const uint m = row0 + r, k4_out = VKTRAIN_GLOBAL_GROUP_ID(pc).x * WG_Y + lane;
        if (m < pc.M && k4_out < K4) {
            out_data[m * K4 + k4_out] = partial[(r * WG_Y + lane) * WG_X];
        }
    }
}

void main() {
    const uint row0 = VKTRAIN_GLOBAL_GROUP_ID(pc).y * ROWS;
    if (row0 >= pc.M) {
        return;  // uniform across the workgroup
    }
#ifdef BACKWARD
    gemv_backward(row0);
#else
    gemv_forward(row0);
#endif
}
