// Runtime self-test kernel for split dispatches, the WGSL of test_grid.comp: every invocation of a
// grid of local size (2, 2, 2) bumps the counter at its global linear index and records that index,
// so a test can see each invocation ran exactly once, however the runtime cut the grid.

struct Params {
    vktrain_group_offset: vec4<u32>,
    size: vec4<u32>,  // invocations along x, y, z
}

@group(0) @binding(0) var<storage, read_write> counts: array<atomic<u32>>;
@group(0) @binding(1) var<storage, read_write> ids: array<u32>;
@group(0) @binding(2) var<uniform> params: Params;

@compute @workgroup_size(2, 2, 2)
fn main(@builtin(workgroup_id) group_id: vec3<u32>, @builtin(local_invocation_id) local_id: vec3<u32>) {
    let g = (group_id + params.vktrain_group_offset.xyz) * vec3<u32>(2u, 2u, 2u) + local_id;
    if (any(g >= params.size.xyz)) {
        return;
    }
    let linear = g.x + params.size.x * (g.y + params.size.y * g.z);
    atomicAdd(&counts[linear], 1u);
    ids[linear] = linear;
}
