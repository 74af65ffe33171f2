// RMSNorm over the last dim (GLSL reference: ../rms_norm.comp; host module: kernels/norm.py), x as [rows, dim]:
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps) [rows];  y = x * rstd * weight
//   BACKWARD: d_x = rstd * (weight * d_y) - x * rstd^3 * mean(x * weight * d_y)
// One workgroup per row: strided per-thread sums, then a workgroup-memory tree in a fixed order (SUBGROUPS:
// subgroup sums, subgroup_reduce.inc.wgsl).
// VEC4 moves vec4s (dim % 4 == 0); the plain source single floats. Local size (WG, 1, 1), WG a power of 2.
// vktrain-variants: -, VEC4, BACKWARD, VEC4+BACKWARD
// vktrain-features: subgroup

@id(0) override WG: u32 = 256u;

#if VEC4
alias Value = vec4<f32>;
const LANES = 4u;
fn dot_value(a: vec4<f32>, b: vec4<f32>) -> f32 { return dot(a, b); }
#else
alias Value = f32;
const LANES = 1u;
fn dot_value(a: f32, b: f32) -> f32 { return a * b; }
#endif

struct Params {
    vktrain_group_offset: vec4<u32>,
    rows: u32,
    dim: u32,   // elements per row (a multiple of 4 for VEC4)
    eps: f32,   // forward only
}

#if BACKWARD
@group(0) @binding(0) var<storage, read> d_y: array<Value>;      // [rows, dim]
@group(0) @binding(1) var<storage, read> x: array<Value>;        // [rows, dim]
@group(0) @binding(2) var<storage, read> weight: array<Value>;   // [dim]
@group(0) @binding(3) var<storage, read> rstd: array<f32>;       // [rows]
@group(0) @binding(4) var<storage, read_write> d_x: array<Value>;  // [rows, dim]
@group(0) @binding(5) var<uniform> params: Params;
#else
@group(0) @binding(0) var<storage, read> x: array<Value>;        // [rows, dim]
@group(0) @binding(1) var<storage, read> weight: array<Value>;   // [dim]
@group(0) @binding(2) var<storage, read_write> y: array<Value>;  // [rows, dim]
@group(0) @binding(3) var<storage, read_write> rstd: array<f32>; // [rows]
@group(0) @binding(4) var<uniform> params: Params;
#endif

#if SUBGROUPS
#include "subgroup_reduce.inc.wgsl"
#else
var<workgroup> partial: array<f32, WG>;

// Sum of `value` over the workgroup, in a fixed order; every thread gets the total.
fn workgroup_sum(value: f32, tid: u32) -> f32 {
    partial[tid] = value;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (tid < stride) {
            partial[tid] += partial[tid + stride];
        }
        workgroupBarrier();
    }
    return partial[0];
}
#endif

@compute @workgroup_size(WG)
#if SUBGROUPS
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32,
        @builtin(subgroup_id) subgroup: u32, @builtin(num_subgroups) subgroups: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
    let place = SubgroupPlace(subgroup, subgroups, lane);
#else
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
#endif
    let row = workgroup.x + params.vktrain_group_offset.x;
    if (row >= params.rows) {
        return;  // uniform over the workgroup: no barrier is split
    }
    let values = params.dim / LANES;
    let base = row * values;
#if BACKWARD
    let r = rstd[row];
    var local_sum = 0.0;
    for (var i = tid; i < values; i += WG) {
        local_sum += dot_value(x[base + i] * weight[i], d_y[base + i]);
    }
#if SUBGROUPS
    let mean_xwdy = workgroup_sum_by_subgroups(local_sum, place) / f32(params.dim);
#else
    let mean_xwdy = workgroup_sum(local_sum, tid) / f32(params.dim);
#endif
    let x_coefficient = r * r * r * mean_xwdy;
    for (var i = tid; i < values; i += WG) {
        d_x[base + i] = r * (weight[i] * d_y[base + i]) - x[base + i] * x_coefficient;
    }
#else
    var local_sum = 0.0;
    for (var i = tid; i < values; i += WG) {
        local_sum += dot_value(x[base + i], x[base + i]);
    }
#if SUBGROUPS
    let r = inverseSqrt(workgroup_sum_by_subgroups(local_sum, place) / f32(params.dim) + params.eps);
#else
    let r = inverseSqrt(workgroup_sum(local_sum, tid) / f32(params.dim) + params.eps);
#endif
    if (tid == 0u) {
        rstd[row] = r;
    }
    for (var i = tid; i < values; i += WG) {
        y[base + i] = x[base + i] * r * weight[i];
    }
#endif
}
