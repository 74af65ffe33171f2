// Runtime self-test kernel without the group-offset header, the WGSL of test_scale.comp:
// data[i] *= factor for i < n in a grid-stride loop (so any group count covers n). The runtime must
// refuse to split it.

struct Params {
    n: u32,
    factor: f32,
}

@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(32)
fn main(@builtin(global_invocation_id) global_id: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let stride = groups.x * 32u;
    for (var i = global_id.x; i < params.n; i += stride) {
        data[i] *= params.factor;
    }
}
