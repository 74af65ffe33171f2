#version 450
// Embedding lookup in a frozen Q8_0 matrix (host module: vktrain/runtime/delegate/kernels/q8_0.py; layout:
// vktrain/quant/q8_0.py): out[i, c] = codes[indices[i], c] * scales[(indices[i] * dim + c) / 32], exactly
// the float32 value embedding.comp reads from the dequantized matrix. Indices are int32 on the GPU; an
// index outside [0, num_weights) writes NaN for the whole row, as embedding.comp does.
// Each invocation writes 4 adjacent columns of one row (dim % 4 == 0: one code word).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#define WORKGROUP_SIZE 64u

layout(local_size_x = WORKGROUP_SIZE) in;

layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { vec4 out_data[]; };
layout(std430, set = 0, binding = 1) readonly buffer IndexBuffer { int indices[]; };
layout(std430, set = 0, binding = 2) readonly buffer CodeBuffer { uint codes[]; };  // int8 codes, four to a word
layout(std430, set = 0, binding = 3) readonly buffer ScaleBuffer { float scales[]; };  // one per 32 codes

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint num_indices;
    uint dim4;  // dim / 4
    uint num_weights;
    uint row_begin;  // bindings 2 and 3 hold table rows [row_begin, row_end) (a window of a table over the
    uint row_end;    // max storage binding size, starting at a whole block); 0, num_weights unsplit
} params;

void main() {
    uint e4 = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (e4 >= params.num_indices * params.dim4) {
        return;
    }
    uint i = e4 / params.dim4;
    uint c4 = e4 - i * params.dim4;
    int index = indices[i];
    if (index < 0 || uint(index) >= params.num_weights) {
        if (params.row_begin == 0u) {  // the window of row 0 writes the NaN row
            out_data[e4] = vec4(uintBitsToFloat(0x7fc00000u));
        }
        return;
    }
    if (uint(index) < params.row_begin || uint(index) >= params.row_end) {  // not in this window
        return;
    }
    uint word = (uint(index) - params.row_begin) * params.dim4 + c4;  // the word of elements 4 word .. 4 word + 3
    int packed = int(codes[word]);
    vec4 code = vec4(bitfieldExtract(packed, 0, 8), bitfieldExtract(packed, 8, 8), bitfieldExtract(packed, 16, 8),
                     bitfieldExtract(packed, 24, 8));
    out_data[e4] = code * scales[word >> 3u];  // 8 words (32 codes) per scale
}
