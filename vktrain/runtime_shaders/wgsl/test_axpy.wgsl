// Runtime self-test kernel, the WGSL of test_axpy.comp: y[i] = SCALE * alpha * x[i] + y[i], i < n.
// Exercises storage bindings, the uniform params block after the group-offset header, a float
// override constant and the local size from override constants 0-2. Not used by any model.

struct Params {
    vktrain_group_offset: vec4<u32>,
    n: u32,
    alpha: f32,
}

@id(0) override LOCAL_SIZE_X: u32 = 1u;
@id(1) override LOCAL_SIZE_Y: u32 = 1u;
@id(2) override LOCAL_SIZE_Z: u32 = 1u;
@id(3) override SCALE: f32 = 1.0;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> params: Params;

@compute @workgroup_size(LOCAL_SIZE_X, LOCAL_SIZE_Y, LOCAL_SIZE_Z)
fn main(@builtin(workgroup_id) group_id: vec3<u32>, @builtin(local_invocation_id) local_id: vec3<u32>) {
    let group = group_id + params.vktrain_group_offset.xyz;
    let i = group.x * LOCAL_SIZE_X + local_id.x;
    if (i >= params.n) {
        return;
    }
    y[i] = SCALE * params.alpha * x[i] + y[i];
}
