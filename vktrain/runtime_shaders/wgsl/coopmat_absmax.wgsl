// Per-workgroup maxima of |x| for the operand scales of the f16 GEMMs (GLSL reference:
// ../coopmat_absmax.comp, same Dispatch): workgroups [0, groups0) cover x0 [numel0], the next groups1
// cover x1 [numel1] (numel % 4 == 0; groups1 = 0 for one tensor). Workgroup g writes partial_bits[g],
// the float bits of the largest |x| of the vec4 g, g + groups, ... of its tensor, per thread, then the
// workgroup's tree. Non-negative floats order like their bits, so the GEMM takes their uint max; |x| is
// taken on the bits (a compiler may assume no NaN / infinity), so an inf or NaN gives bits >= 0x7f800000,
// which the GEMM treats as "no scale". Plain f32: browser-valid without any feature.
const WORKGROUP_SIZE = 256u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    numel0: u32,
    numel1: u32,
    groups0: u32,
    groups1: u32,
}

@group(0) @binding(0) var<storage, read_write> partial_bits: array<u32>;
@group(0) @binding(1) var<storage, read> x0: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> x1: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> params: Params;

var<workgroup> partial: array<u32, WORKGROUP_SIZE>;

fn magnitude_bits(value: vec4<f32>) -> u32 {
    let bits = bitcast<vec4<u32>>(value) & vec4<u32>(0x7fffffffu);
    return max(max(bits.x, bits.y), max(bits.z, bits.w));
}

@compute @workgroup_size(WORKGROUP_SIZE, 1, 1)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let tid = local.x;
    let group = workgroup.x + params.vktrain_group_offset.x;
    let second = group >= params.groups0;
    let local_group = select(group, group - params.groups0, second);
    let groups = select(params.groups0, params.groups1, second);
    let vecs = select(params.numel0, params.numel1, second) / 4u;
    var bits = 0u;
    for (var v = local_group * WORKGROUP_SIZE + tid; v < vecs; v += groups * WORKGROUP_SIZE) {
        if (second) {
            bits = max(bits, magnitude_bits(x1[v]));
        } else {
            bits = max(bits, magnitude_bits(x0[v]));
        }
    }
    partial[tid] = bits;
    workgroupBarrier();
    for (var width = WORKGROUP_SIZE / 2u; width > 0u; width /= 2u) {
        if (tid < width) {
            partial[tid] = max(partial[tid], partial[tid + width]);
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        partial_bits[group] = partial[0];
    }
}
