// Register-tile body of the linear GEMMs for CPU Vulkan implementations (lavapipe / llvmpipe):
// linear_gemm.glsl includes it, after the bindings and helpers, for the variants defining
// CPU_REGISTER_TILES (modes FWD and BWD; host: kernels/linear.py with CPU_TUNING).
//
// Why a second body: llvmpipe runs a workgroup's invocations as the SIMD lanes of one CPU thread, splits
// the shader at every barrier, and inside any loop turns every buffer load, even one whose address is the
// same for all lanes, into a loop over the lanes, one scalar per lane and component. So this body has no
// shared memory and no barrier, and counts loads: a workgroup is one subgroup of CPU_LANES invocations
// (the plan checks the device's subgroup size); the lanes walk the output's columns four at a time, and
// each invocation owns CPU_ROWS rows x 4 columns of C in registers. The operand that is the same for
// every lane (the activation rows) is loaded once per CPU_LANES reduction steps, each lane loading a
// different step, and handed to all lanes with subgroupShuffle (one vector permute); each W_4X8 word a
// lane loads feeds 8 weights to CPU_ROWS rows.
//   FWD: y[i, 4q .. 4q+3] = sum over k of x[i, k] * deq(W)[4q .. 4q+3, k]; per group of K the lane
//        loads its 4 scales, then walks the group's k4 steps (4 k each) in chunks of CPU_LANES, reading
//        2 words (rows 4q .. 4q+3) per step.
//   BWD: dx[i, 4q .. 4q+3] = sum over n of d_out[i, n] * s[g, n] * (code[n, 4q .. 4q+3] - 8). All lanes
//        of a workgroup lie in one group g (the plan needs group_size % (4 * CPU_LANES) == 0), so the
//        scaled row d_out[i, n] * s[g, n] is shared like the activations; the reduction walks N by
//        8-row W_4X8 blocks (one uvec4 per lane: 8 n x its 4 k), CPU_LANES blocks per chunk.
// lavapipe's per-lane loop costs the same for 32 and 64 bits, so every input is read as uint64_t (pairs of
// floats or words; K, N % 4 == 0 keep every pair aligned; linear_gemm.glsl declares them so).
// The sum over the reduction runs in the same order as in the shared-memory body (k resp. n ascending).
// Lanes past the last column quad recompute the last one and store nothing; rows past the end read the
// last row, never stored; reduction steps past the end read clamped addresses and add zeros.

#if LINEAR_MODE == LINEAR_MODE_DW
#error "CPU_REGISTER_TILES has no LINEAR_MODE_DW body (the plan keeps the shared-memory one)"
#endif

#if LINEAR_MODE == LINEAR_MODE_FWD
#define VEC4_SOURCE x
#else
#define VEC4_SOURCE d_out
#endif

#ifndef CPU_ROWS
#define CPU_ROWS 8
#endif
#ifndef CPU_LANES
#define CPU_LANES 8
#endif

vec2 floats2(uint64_t pair) { return uintBitsToFloat(unpackUint2x32(pair)); }
// Element v of a vec4 array / 4 consecutive floats at the multiple of 4 `e` of the scales.
vec4 x_vec4(uint v) { return vec4(floats2(VEC4_SOURCE[2u * v]), floats2(VEC4_SOURCE[2u * v + 1u])); }
// (Both from the placement's offsets, multiples of 4: linear_gemm.glsl.)
vec4 scales4(uint e) { return vec4(floats2(scales[(pc.s_offset + e) / 2u]), floats2(scales[(pc.s_offset + e) / 2u + 1u])); }
// The W_4X8 words e, e + 1 (e even).
uvec2 words2(uint e) { return unpackUint2x32(w4x8[(pc.w_offset + e) / 2u]); }

void main() {
    const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
    const uint lane = gl_SubgroupInvocationID;
    const uint rows = rows_total(), quads = cols_total() / 4u;
    const uint c = group.x * CPU_LANES + gl_LocalInvocationID.x;
    const uint q = min(c, quads - 1u);
    const uint i0 = group.y * CPU_ROWS;
    if (i0 >= rows) {
        return;
    }
    const uint N8 = n8_count();
    // Source row offsets (in vec4s) of this invocation's rows, clamped to the last row.
    uint row_base[CPU_ROWS];
    vec4 acc[CPU_ROWS];
    [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
        row_base[a] = (pc.a_offset + min(i0 + a, rows - 1u) * pc.a_row_stride) / 4u;
        acc[a] = vec4(0.0);
#if defined(ACCUMULATE) && LINEAR_MODE == LINEAR_MODE_FWD
        // The partial so far (lanes past the last quad read the last one; they store nothing).
        if (i0 + a < rows) acc[a] = y[(pc.c_offset + (i0 + a) * pc.c_row_stride) / 4u + q];
#endif
    }

#if LINEAR_MODE == LINEAR_MODE_FWD
    const uint n0 = 4u * q, n8 = q / 2u, jw = 2u * (q % 2u);
    const uint groups = pc.K / pc.group_size, group4 = pc.group_size / 4u;
    for (uint g = 0u; g < groups; ++g) {
        const uint s = g * pc.N + n0;  // N % 4 == 0: columns n0 .. n0+3 are all real rows of W
        const vec4 scale = scales4(s);
        const uint end = (g + 1u) * group4;
        for (uint chunk = g * group4; chunk < end; chunk += CPU_LANES) {
            // This lane's share of the activations: step chunk + lane of each row (0 past the group).
            const uint mine = min(chunk + lane, end - 1u);
            vec4 x_share[CPU_ROWS];
            [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
                const vec4 value = x_vec4(row_base[a] + mine);
                x_share[a] = chunk + lane < end ? value : vec4(0.0);
            }
            [[unroll]] for (uint l = 0u; l < CPU_LANES; ++l) {
                const uint k4 = min(chunk + l, end - 1u);
                const uint word = 4u * (k4 * N8 + n8) + jw;
                const uvec2 pair = words2(word);
                const uint w0 = pair.x, w1 = pair.y;
                const vec4 lo0 = decode_low(w0) * scale.x, hi0 = decode_high(w0) * scale.y;
                const vec4 lo1 = decode_low(w1) * scale.z, hi1 = decode_high(w1) * scale.w;
                [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
                    const vec4 xv = subgroupShuffle(x_share[a], l);
                    [[unroll]] for (uint t = 0u; t < 4u; ++t) {
                        acc[a] = fma(vec4(xv[t]), vec4(lo0[t], hi0[t], lo1[t], hi1[t]), acc[a]);
                    }
                }
            }
        }
    }
#else  // LINEAR_MODE_BWD
    const uint k4 = q;
    const uint g = (4u * CPU_LANES * group.x) / pc.group_size;  // the group of every lane (see above)
    const uint N4 = pc.N / 4u;
    for (uint chunk = 0u; chunk < N8; chunk += CPU_LANES) {
        // This lane's share: block chunk + lane of d_out * s for each row, rows n .. n+7 (0 past N).
        const uint mine = min(chunk + lane, N8 - 1u);
        const bool valid = chunk + lane < N8;
        const bool full = 8u * mine + 4u < pc.N;  // N % 4 == 0: the last block may have 4 rows only
        const uint s = g * pc.N + 8u * mine, s_hi = full ? s + 4u : s;
        const vec4 scale_lo = scales4(s), scale_hi = scales4(s_hi);
        vec4 t_lo[CPU_ROWS], t_hi[CPU_ROWS];
        [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
            const uint d = row_base[a] + 2u * mine;
            const vec4 d_lo = x_vec4(d), d_hi = x_vec4(full ? d + 1u : d);
            t_lo[a] = valid ? d_lo * scale_lo : vec4(0.0);
            t_hi[a] = valid && full ? d_hi * scale_hi : vec4(0.0);
        }
        [[unroll]] for (uint l = 0u; l < CPU_LANES; ++l) {
            const uint word = 4u * (k4 * N8 + min(chunk + l, N8 - 1u));
            const uvec4 words = uvec4(words2(word), words2(word + 2u));
            // codes[r] = code[n + r, 4*k4 .. 4*k4+3] - 8; word jw holds rows n + 2jw (low), n + 2jw + 1 (high)
            vec4 codes[8];
            [[unroll]] for (uint jw = 0u; jw < 4u; ++jw) {
                codes[2u * jw] = decode_low(words[jw]);
                codes[2u * jw + 1u] = decode_high(words[jw]);
            }
            [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
                const vec4 lo = subgroupShuffle(t_lo[a], l), hi = subgroupShuffle(t_hi[a], l);
                [[unroll]] for (uint r = 0u; r < 4u; ++r) {
                    acc[a] = fma(vec4(lo[r]), codes[r], acc[a]);
                }
                [[unroll]] for (uint r = 0u; r < 4u; ++r) {
                    acc[a] = fma(vec4(hi[r]), codes[4u + r], acc[a]);
                }
            }
        }
    }
#endif
    if (c >= quads) {
        return;
    }
    [[unroll]] for (uint a = 0u; a < CPU_ROWS; ++a) {
        const uint i = i0 + a;
        if (i >= rows) {
            continue;
        }
        const uint index = (pc.c_offset + i * pc.c_row_stride) / 4u + c;
#if LINEAR_MODE == LINEAR_MODE_FWD
#ifdef HAS_BIAS
        y[index] = acc[a] + bias[c];
#else
        y[index] = acc[a];
#endif
#else
        dx[index] = acc[a];
#endif
    }
}
