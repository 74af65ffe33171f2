// Second pass of the split-K GEMMs (GLSL reference: ../linear_splitk_reduce.comp):
//   out[e] = sum over s < splits of partial[s, e] (+ bias[e % cols4] with HAS_BIAS), in slice order
// over the count4 vec4s of a row-major output (deterministic, no atomics).
// vktrain-variants: -, HAS_BIAS

@id(0) override WG: u32 = 256u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    count4: u32,  // vec4s of one output (rows * cols / 4)
    cols4: u32,   // vec4s of one output row (the bias length / 4)
    splits: u32,
}

@group(0) @binding(0) var<storage, read_write> out_data: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> partial: array<vec4<f32>>;  // [splits, count4]
#if HAS_BIAS
@group(0) @binding(2) var<storage, read> bias: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> params: Params;
#else
@group(0) @binding(2) var<uniform> params: Params;
#endif

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let e = (workgroup.x + params.vktrain_group_offset.x) * WG + local.x;
    if (e >= params.count4) {
        return;
    }
    var sum = partial[e];
    for (var s = 1u; s < params.splits; s++) {
        sum += partial[s * params.count4 + e];
    }
#if HAS_BIAS
    sum += bias[e % params.cols4];
#endif
    out_data[e] = sum;
}
