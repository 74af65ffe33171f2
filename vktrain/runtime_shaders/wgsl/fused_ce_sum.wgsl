// fused_ce, pass 2 of 2 (GLSL reference: ../fused_ce_sum.comp; host module: kernels/cross_entropy.py):
// loss = the sum of the R row losses, by one workgroup: strided per-thread sums, then a workgroup-memory
// tree in a fixed order (bitwise reproducible, no atomics; SUBGROUPS: subgroup sums,
// subgroup_reduce.inc.wgsl). Local size (WG, 1, 1), WG a power of two.
// vktrain-features: subgroup

@id(0) override WG: u32 = 256u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    R: u32,
}

@group(0) @binding(0) var<storage, read> row_loss: array<f32>;
@group(0) @binding(1) var<storage, read_write> loss: f32;
@group(0) @binding(2) var<uniform> params: Params;

#if SUBGROUPS
#include "subgroup_reduce.inc.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32, @builtin(subgroup_id) subgroup: u32,
        @builtin(num_subgroups) subgroups: u32, @builtin(subgroup_invocation_id) lane: u32) {
    var acc = 0.0;
    for (var r = tid; r < params.R; r += WG) {
        acc += row_loss[r];
    }
    let total = workgroup_sum_by_subgroups(acc, SubgroupPlace(subgroup, subgroups, lane));
    if (tid == 0u) {
        loss = total;
    }
}
#else
var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) tid: u32) {
    var acc = 0.0;
    for (var r = tid; r < params.R; r += WG) {
        acc += row_loss[r];
    }
    partial[tid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            partial[tid] += partial[tid + stride];
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        loss = partial[0];
    }
}
#endif
