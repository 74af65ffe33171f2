// Small-M (GEMV-like) paths of the 4-bit linear (GLSL reference: ../linear_q4gsw_gemv.comp), bound by
// reading W_4X8 once:
//   linear_q4gsw_gemv (@HAS_BIAS): y[M, N]  = x[M, K] @ deq(W).T (+ bias)   reduce over K
//   linear_q4gsw_gemv@BACKWARD:    dx[M, K] = d_out[M, N] @ deq(W)          reduce over N
// A workgroup of WG_X x WG_Y threads (ids 0, 1; powers of two) covers ROWS (id 3) activation rows; each
// thread reads whole 16-byte W_4X8 blocks (4 k x 8 n), and the threads sharing an output slice split the
// reduction, their partial sums added by a workgroup-memory tree in a fixed order.
//   forward:  x-lanes = output n8 columns, y-lanes = slices of the K4 reduction;
//   backward: x-lanes = slices of the N8 reduction, y-lanes = output k4 columns.
// The partial sums live in workgroup memory from the start (each thread owns its slots): WGSL sizes
// per-thread arrays by constants only, ROWS is an override. Codes decode as (code - 8) floats (the GLSL's
// exponent-bit decoding gives the same products; it only saves conversions).
// vktrain-variants: -, HAS_BIAS, BACKWARD

@id(0) override WG_X: u32 = 4u;
@id(1) override WG_Y: u32 = 64u;
@id(3) override ROWS: u32 = 1u;         // activation rows per workgroup
@id(4) override GROUP_SIZE: u32 = 32u;  // the q4gsw group size

struct Params {
    vktrain_group_offset: vec4<u32>,
    M: u32,
    N: u32,
    K: u32,
}

@group(0) @binding(0) var<storage, read_write> out_data: array<vec4<f32>>;  // y or dx
@group(0) @binding(1) var<storage, read> in_data: array<vec4<f32>>;         // x or d_out
@group(0) @binding(2) var<storage, read> w4x8_blocks: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> scales4: array<vec4<f32>>;         // [G, N], N % 4 == 0
#if HAS_BIAS
@group(0) @binding(4) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(4) var<uniform> params: Params;
#endif

// Forward: 2 vec4 partial sums per row (8 n), backward 1 (4 k): sized for the larger.
var<workgroup> partial: array<vec4<f32>, WG_X * WG_Y * ROWS * 2u>;

fn n8_count() -> u32 { return (params.N / 4u + 1u) / 2u; }

// Scales of rows 8 n8 .. 8 n8 + 7 in group g; the upper four exist only when N4 is even (else they are
// W_4X8 padding rows and their scales would overrun the buffer).
fn scales_lo(g: u32, n8: u32) -> vec4<f32> { return scales4[(g * params.N + 8u * n8) / 4u]; }
fn scales_hi(g: u32, n8: u32) -> vec4<f32> {
    if (8u * n8 + 4u >= params.N) {
        return vec4<f32>(0.0);
    }
    return scales4[(g * params.N + 8u * n8) / 4u + 1u];
}

// Codes of one W_4X8 word for the row pair (n, n + 1), k = 4 k4 + 0..3: low nibbles row n, high n + 1.
fn decode_low(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xfu)) - 8.0;
}
fn decode_high(word: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(0xfu)) - 8.0;
}

#if BACKWARD
@compute @workgroup_size(WG_X, WG_Y, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let group = workgroup + params.vktrain_group_offset.xyz;
    let row0 = group.y * ROWS;
    if (row0 >= params.M) {
        return;  // uniform across the workgroup
    }
    let ns = local.x;
    let kx = local.y;
    let n8s = n8_count();
    let n4s = params.N / 4u;
    let k4s = params.K / 4u;
    let k4 = group.x * WG_Y + kx;
    for (var r = 0u; r < ROWS; r++) {
        partial[(r * WG_Y + kx) * WG_X + ns] = vec4<f32>(0.0);
    }
    if (k4 < k4s) {
        let g = (4u * k4) / GROUP_SIZE;
        for (var n8 = ns; n8 < n8s; n8 += WG_X) {
            let block = w4x8_blocks[k4 * n8s + n8];
            let s_lo = scales_lo(g, n8);
            let s_hi = scales_hi(g, n8);
            let has_upper = 2u * n8 + 1u < n4s;
            for (var r = 0u; r < ROWS && row0 + r < params.M; r++) {
                let m = row0 + r;
                // d_out[m, n] * scale[g, n] for the 8 rows n of this block.
                let ds_lo = in_data[m * n4s + 2u * n8] * s_lo;
                var ds_hi = vec4<f32>(0.0);
                if (has_upper) {
                    ds_hi = in_data[m * n4s + 2u * n8 + 1u] * s_hi;
                }
                let slot = (r * WG_Y + kx) * WG_X + ns;
                partial[slot] += ds_lo[0] * decode_low(block[0]) + ds_lo[1] * decode_high(block[0])
                               + ds_lo[2] * decode_low(block[1]) + ds_lo[3] * decode_high(block[1])
                               + ds_hi[0] * decode_low(block[2]) + ds_hi[1] * decode_high(block[2])
                               + ds_hi[2] * decode_low(block[3]) + ds_hi[3] * decode_high(block[3]);
            }
        }
    }
    workgroupBarrier();
    for (var stride = WG_X / 2u; stride > 0u; stride /= 2u) {
        if (ns < stride) {
            for (var r = 0u; r < ROWS; r++) {
                partial[(r * WG_Y + kx) * WG_X + ns] += partial[(r * WG_Y + kx) * WG_X + ns + stride];
            }
        }
        workgroupBarrier();
    }
    let tid = kx * WG_X + ns;
    for (var idx = tid; idx < ROWS * WG_Y; idx += WG_X * WG_Y) {
        let r = idx / WG_Y;
        let lane = idx % WG_Y;
        let m = row0 + r;
        let k4_out = group.x * WG_Y + lane;
        if (m < params.M && k4_out < k4s) {
            out_data[m * k4s + k4_out] = partial[(r * WG_Y + lane) * WG_X];
        }
    }
}
#else
@compute @workgroup_size(WG_X, WG_Y, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let group = workgroup + params.vktrain_group_offset.xyz;
    let row0 = group.y * ROWS;
    if (row0 >= params.M) {
        return;  // uniform across the workgroup
    }
    let nx = local.x;
    let ks = local.y;
    let n8s = n8_count();
    let k4s = params.K / 4u;  // stops before the padding of K % 8 == 4
    let n8 = group.x * WG_X + nx;
    // partial[((r * 2 + half) * WG_Y + ks) * WG_X + nx]: the tree runs over ks.
    for (var h = 0u; h < 2u * ROWS; h++) {
        partial[(h * WG_Y + ks) * WG_X + nx] = vec4<f32>(0.0);
    }
    if (n8 < n8s) {
        for (var k4 = ks; k4 < k4s; k4 += WG_Y) {
            let block = w4x8_blocks[k4 * n8s + n8];
            let g = (4u * k4) / GROUP_SIZE;
            let s_lo = scales_lo(g, n8);
            let s_hi = scales_hi(g, n8);
            for (var r = 0u; r < ROWS && row0 + r < params.M; r++) {
                let xv = in_data[(row0 + r) * k4s + k4];
                let d_lo = vec4<f32>(dot(xv, decode_low(block[0])), dot(xv, decode_high(block[0])),
                                     dot(xv, decode_low(block[1])), dot(xv, decode_high(block[1])));
                let d_hi = vec4<f32>(dot(xv, decode_low(block[2])), dot(xv, decode_high(block[2])),
                                     dot(xv, decode_low(block[3])), dot(xv, decode_high(block[3])));
                partial[((2u * r) * WG_Y + ks) * WG_X + nx] += d_lo * s_lo;
                partial[((2u * r + 1u) * WG_Y + ks) * WG_X + nx] += d_hi * s_hi;
            }
        }
    }
    workgroupBarrier();
    for (var stride = WG_Y / 2u; stride > 0u; stride /= 2u) {
        if (ks < stride) {
            for (var h = 0u; h < 2u * ROWS; h++) {
                partial[(h * WG_Y + ks) * WG_X + nx] += partial[(h * WG_Y + ks + stride) * WG_X + nx];
            }
        }
        workgroupBarrier();
    }
    // One thread per (row, vec4 of n) writes; the ks == 0 slot holds the sums.
    let tid = ks * WG_X + nx;
    for (var idx = tid; idx < ROWS * 2u * WG_X; idx += WG_X * WG_Y) {
        let r = idx / (2u * WG_X);
        let h = (idx / WG_X) % 2u;
        let lane = idx % WG_X;
        let m = row0 + r;
        let n = 8u * (group.x * WG_X + lane) + 4u * h;
        if (m < params.M && n < params.N) {
            var value = partial[((2u * r + h) * WG_Y) * WG_X + lane];
#if HAS_BIAS
            value += bias[n / 4u];
#endif
            out_data[(m * params.N + n) / 4u] = value;
        }
    }
}
#endif
