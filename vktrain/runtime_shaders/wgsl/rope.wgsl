// Rotary position embedding, "rotate half" pairing (GLSL reference: ../rope.comp; host module:
// kernels/rotary.py): x [B, S, H, D], cos/sin [S, D/2] (or [B, S, D/2]: per token, packed documents); for
// i < D/2, x1 = x[i], x2 = x[i + D/2]:
//   out[i] = x1 cos - x2 sin,  out[i + D/2] = x2 cos + x1 sin
// NEGATE_SIN (id 3) uses -sin (the backward). One thread per 4 consecutive pairs (D % 8 == 0).

@id(0) override WG: u32 = 64u;
@id(3) override NEGATE_SIN: bool = false;

struct Params {
    vktrain_group_offset: vec4<u32>,
    quads: u32,       // B * S * H * D / 8: threads with work
    table_rows: u32,  // rows of cos/sin: S, or B * S for per-token tables
    H: u32,
    half_quads: u32,  // D / 8: vec4s per half row
}

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;          // [B, S, H, D]
@group(0) @binding(1) var<storage, read> cos_: array<vec4<f32>>;       // [S, D/2]
@group(0) @binding(2) var<storage, read> sin_: array<vec4<f32>>;       // [S, D/2]
@group(0) @binding(3) var<storage, read_write> out_: array<vec4<f32>>; // [B, S, H, D]
@group(0) @binding(4) var<uniform> params: Params;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let t = (workgroup.x + params.vktrain_group_offset.x) * WG + local.x;
    if (t >= params.quads) {
        return;
    }
    let row = t / params.half_quads;  // (b * S + s) * H + h
    let quad = t % params.half_quads;
    let position = (row / params.H) % params.table_rows;  // the table row of token b * S + s
    let first = row * 2u * params.half_quads + quad;
    let second = first + params.half_quads;
    let table = position * params.half_quads + quad;
    let x1 = x[first];
    let x2 = x[second];
    let c = cos_[table];
    let s = select(sin_[table], -sin_[table], NEGATE_SIN);
    out_[first] = x1 * c - x2 * s;
    out_[second] = x2 * c + x1 * s;
}
