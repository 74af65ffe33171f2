// Causal attention backward, pre-pass (GLSL reference: ../attention_bwd_delta.comp):
//   delta[b, h, i] = sum_d d_out[b, i, h, d] * out[b, i, h, d]      [B, Hq, S]
// one thread per (batch, position, head) row.

@id(0) override WG: u32 = 64u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    rows: u32,  // B * S * Hq
    S: u32,
    Hq: u32,
    D4: u32,    // head dim / 4
}

@group(0) @binding(0) var<storage, read> d_out: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> out_: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> delta: array<f32>;
@group(0) @binding(3) var<uniform> params: Params;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let n = (workgroup.x + params.vktrain_group_offset.x) * WG + local.x;  // row of [B * S * Hq, D]
    if (n >= params.rows) {
        return;
    }
    let head = n % params.Hq;
    let position = (n / params.Hq) % params.S;
    let b = n / (params.Hq * params.S);
    var total = 0.0;
    for (var c = 0u; c < params.D4; c++) {
        total += dot(d_out[n * params.D4 + c], out_[n * params.D4 + c]);
    }
    delta[(b * params.Hq + head) * params.S + position] = total;
}
