// Straight-through re-quantization (GLSL reference: ../q4gsw_requant.comp; host module:
// kernels/requant.py) of a latent weight [N, K] with fixed group scales [G, N], written in the W_4X8
// layout (docs/spec/w4x8.md) that linear_q4gsw reads:
//   q = clamp(roundEven(latent[n, k] / scales[k / gs, n]), -8, 7), code = q + 8
//   zero scale -> code 8; padding rows n >= N (N % 8 == 4) and padding k >= K (K % 8 == 4) -> code 8.
// Word w = 4 (k4 N8 + n8) + j holds k = 4 k4 + t in byte t, row n = 8 n8 + 2 j in the low nibble and
// n + 1 in the high one. One thread per word.

@id(0) override WG: u32 = 64u;

const CODE_ZERO = 8u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    N: u32,
    K: u32,
    group_size: u32,
}

@group(0) @binding(0) var<storage, read> latent: array<vec4<f32>>;  // [N, K] as [N, K/4]
@group(0) @binding(1) var<storage, read> scales: array<f32>;        // [G, N]
@group(0) @binding(2) var<storage, read_write> weights: array<u32>; // K4 * N8 * 4 words
@group(0) @binding(3) var<uniform> params: Params;

// Codes of k = 4 k4 .. 4 k4 + 3 in row n; code 8 for padding rows and columns and zero scales.
fn codes_of(n: u32, k4: u32) -> vec4<u32> {
    let k4_real = params.K / 4u;
    if (n >= params.N || k4 >= k4_real) {
        return vec4<u32>(CODE_ZERO);
    }
    let s = scales[(4u * k4 / params.group_size) * params.N + n];
    if (s == 0.0) {
        return vec4<u32>(CODE_ZERO);
    }
    let q = clamp(round(latent[n * k4_real + k4] / s), vec4<f32>(-8.0), vec4<f32>(7.0));  // round: ties to even
    return vec4<u32>(vec4<i32>(q) + i32(CODE_ZERO));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let k4s = (params.K + 7u) / 8u * 2u;     // Kp / 4, Kp = K rounded up to a multiple of 8
    let n8s = (params.N / 4u + 1u) / 2u;     // ceil(N4 / 2)
    let w = (workgroup.x + params.vktrain_group_offset.x) * WG + local.x;
    if (w >= k4s * n8s * 4u) {
        return;
    }
    let j = w % 4u;
    let n8 = (w / 4u) % n8s;
    let k4 = w / (4u * n8s);
    let n_low = 8u * n8 + 2u * j;
    let bytes = codes_of(n_low, k4) | (codes_of(n_low + 1u, k4) << vec4<u32>(4u));
    weights[w] = bytes.x | (bytes.y << 8u) | (bytes.z << 16u) | (bytes.w << 24u);
}
