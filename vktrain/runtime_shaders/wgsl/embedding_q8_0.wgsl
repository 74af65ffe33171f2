// Embedding lookup in a frozen Q8_0 matrix (GLSL reference: ../embedding_q8_0.comp; host module:
// kernels/q8_0.py; layout: docs/spec/q8_0.md): out[i, c] = codes[indices[i], c] * scales[(indices[i] * dim + c) / 32],
// exactly the float32 value embedding.wgsl reads from the dequantized matrix. Indices are int32; an index
// outside [0, num_weights) writes NaN for the whole row. Each invocation writes 4 adjacent columns of one
// row (dim % 4 == 0: one word of codes).

const WORKGROUP_SIZE = 64u;

struct Params {
    vktrain_group_offset: vec4<u32>,
    num_indices: u32,
    dim4: u32,  // dim / 4
    num_weights: u32,
    row_begin: u32,  // bindings 2 and 3 hold table rows [row_begin, row_end) (a window of a table over the
    row_end: u32,    // max storage binding size, starting at a whole block); 0, num_weights unsplit
}

@group(0) @binding(0) var<storage, read_write> out_data: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> indices: array<i32>;
@group(0) @binding(2) var<storage, read> codes: array<u32>;   // int8 codes, four to a word
@group(0) @binding(3) var<storage, read> scales: array<f32>;  // one per 32 codes
@group(0) @binding(4) var<uniform> params: Params;

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) workgroup: vec3<u32>, @builtin(local_invocation_id) local: vec3<u32>) {
    let e4 = (workgroup.x + params.vktrain_group_offset.x) * WORKGROUP_SIZE + local.x;
    if (e4 >= params.num_indices * params.dim4) {
        return;
    }
    let i = e4 / params.dim4;
    let c4 = e4 - i * params.dim4;
    let index = indices[i];
    if (index < 0 || u32(index) >= params.num_weights) {
        if (params.row_begin == 0u) {  // the window of row 0 writes the NaN row
            out_data[e4] = vec4<f32>(bitcast<f32>(0x7fc00000u));
        }
        return;
    }
    if (u32(index) < params.row_begin || u32(index) >= params.row_end) {  // not in this window
        return;
    }
    let word = (u32(index) - params.row_begin) * params.dim4 + c4;  // the code word of elements 4 word .. 4 word + 3
    let packed = bitcast<i32>(codes[word]);
    let code = vec4<f32>(f32(extractBits(packed, 0u, 8u)), f32(extractBits(packed, 8u, 8u)),
                         f32(extractBits(packed, 16u, 8u)), f32(extractBits(packed, 24u, 8u)));
    out_data[e4] = code * scales[word >> 3u];  // 8 words (32 codes) per scale
}
