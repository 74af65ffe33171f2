#version 450
// Generic strided copy (host module: vktrain/runtime/delegate/kernels/layout.py).
//
// out[out_offset + sum_d i_d * out_strides[d]] = convert(in[in_offset + sum_d i_d * in_strides[d]])
// over the index space `sizes` (innermost dim first). One kernel materialises permute / transpose /
// expand (stride 0) / slice / select / clone, and writes into a strided region of a larger output
// (cat, slice_scatter).
//
// Buffers are raw 32-bit words, so the same SPIR-V copies fp32 and int32 tensors bit-exactly.
// CONVERT (specialization constant id 3): 0 = bit copy, 1 = int32 -> fp32, 2 = fp32 -> int32
// (truncation toward zero, like torch's float -> int cast).
//
// Variant FILL (#define): no input; out[i] = value (a 32-bit word from the push constants) for
// i < numel, for full / zeros_like / scalar_tensor.
// vktrain-variants: -, FILL
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

#define MAX_RANK 6
#define WORKGROUP_SIZE 64

layout(local_size_x = WORKGROUP_SIZE) in;

layout(constant_id = 3) const uint CONVERT = 0;

layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { uint out_words[]; };

#ifdef FILL
layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint numel;
    uint value;
} params;

void main() {
    uint index = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (index < params.numel) {
        out_words[index] = params.value;
    }
}
#else
layout(std430, set = 0, binding = 1) readonly buffer InBuffer { uint in_words[]; };

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint numel;
    uint rank;
    uint in_offset;
    uint out_offset;
    uint sizes[MAX_RANK];
    uint in_strides[MAX_RANK];
    uint out_strides[MAX_RANK];
    uint window_start;  // a window of a split copy: invocation i moves element window_start + i
} params;

uint convert_word(uint word) {
    if (CONVERT == 1u) return floatBitsToUint(float(int(word)));
    if (CONVERT == 2u) return uint(int(uintBitsToFloat(word)));
    return word;
}

void main() {
    uint index = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (index >= params.numel) {
        return;
    }
    uint rest = params.window_start + index;
    uint in_index = params.in_offset;
    uint out_index = params.out_offset;
    // Unrolled over MAX_RANK with guards: index math without loop trips.
    [[unroll]] for (uint d = 0u; d < MAX_RANK; ++d) {
        if (d < params.rank) {
            uint size = params.sizes[d];
            uint coord = rest % size;
            rest /= size;
            in_index += coord * params.in_strides[d];
            out_index += coord * params.out_strides[d];
        }
    }
    out_words[out_index] = convert_word(in_words[in_index]);
}
#endif
