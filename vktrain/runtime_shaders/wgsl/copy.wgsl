// Generic strided copy and fill (GLSL reference: ../copy.comp; host module: kernels/layout.py).
// out[out_offset + sum_d i_d * out_strides[d]] = convert(in[in_offset + sum_d i_d * in_strides[d]]) over
// the index space `sizes` (innermost dim first), on raw 32-bit words. CONVERT (id 3): 0 = bit copy,
// 1 = int32 -> fp32, 2 = fp32 -> int32 (toward zero). FILL: out[i] = value for i < numel.
// vktrain-variants: -, FILL

const WORKGROUP_SIZE = 64u;
const MAX_RANK = 6u;

@id(3) override CONVERT: u32 = 0u;

@group(0) @binding(0) var<storage, read_write> out_words: array<u32>;
#if FILL
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,
    value: u32,
}
@group(0) @binding(1) var<uniform> params: Params;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let index = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (index < params.numel) {
        out_words[index] = params.value;
    }
}
#else
@group(0) @binding(1) var<storage, read> in_words: array<u32>;
// The GLSL's sizes[6], in_strides[6], out_strides[6] as scalars (dim 0 innermost).
struct Params {
    vktrain_group_offset: vec4<u32>,
    numel: u32,
    rank: u32,
    in_offset: u32,
    out_offset: u32,
    size0: u32, size1: u32, size2: u32, size3: u32, size4: u32, size5: u32,
    in_stride0: u32, in_stride1: u32, in_stride2: u32, in_stride3: u32, in_stride4: u32, in_stride5: u32,
    out_stride0: u32, out_stride1: u32, out_stride2: u32, out_stride3: u32, out_stride4: u32, out_stride5: u32,
    window_start: u32,  // a window of a split copy: invocation i moves element window_start + i
}
@group(0) @binding(2) var<uniform> params: Params;

fn convert_word(value: u32) -> u32 {
    if (CONVERT == 1u) {
        return bitcast<u32>(f32(bitcast<i32>(value)));
    }
    if (CONVERT == 2u) {
        return bitcast<u32>(i32(bitcast<f32>(value)));
    }
    return value;
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let index = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (index >= params.numel) {
        return;
    }
    let p = params;
    var sizes = array<u32, MAX_RANK>(p.size0, p.size1, p.size2, p.size3, p.size4, p.size5);
    var in_strides = array<u32, MAX_RANK>(p.in_stride0, p.in_stride1, p.in_stride2, p.in_stride3, p.in_stride4,
                                          p.in_stride5);
    var out_strides = array<u32, MAX_RANK>(p.out_stride0, p.out_stride1, p.out_stride2, p.out_stride3,
                                           p.out_stride4, p.out_stride5);
    var rest = p.window_start + index;
    var in_index = p.in_offset;
    var out_index = p.out_offset;
    for (var d = 0u; d < p.rank; d++) {
        let coord = rest % sizes[d];
        rest /= sizes[d];
        in_index += coord * in_strides[d];
        out_index += coord * out_strides[d];
    }
    out_words[out_index] = convert_word(in_words[in_index]);
}
#endif
