#version 450
// Second pass of the split-K linear GEMMs (linear_gemm.glsl with SPLIT_K > 1):
//   out[e] = sum over s = 0 .. splits-1 of partial[s, e]  (+ bias[e % cols] with HAS_BIAS)
// over the `count4` vec4s of a row-major [rows, cols] output. The slices are added in index order,
// so the result does not depend on scheduling (no atomics).
// vktrain-variants: -, HAS_BIAS
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;

layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;
    uint count4;  // vec4s of one output (rows * cols / 4)
    uint cols4;   // vec4s of one output row (the bias length / 4)
    uint splits;
} pc;

layout(set = 0, binding = 0) writeonly restrict buffer OutBuf { vec4 out_data[]; };
layout(set = 0, binding = 1) readonly restrict buffer PartialBuf { vec4 partial[]; };  // [splits, count4]
#ifdef HAS_BIAS
layout(set = 0, binding = 2) readonly restrict buffer BiasBuf { vec4 bias[]; };
#endif

void main() {
    const uint e = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
    if (e >= pc.count4) {
        return;
    }
    vec4 sum = partial[e];
    for (uint s = 1u; s < pc.splits; ++s) {
        sum += partial[s * pc.count4 + e];
    }
#ifdef HAS_BIAS
    sum += bias[e % pc.cols4];
#endif
    out_data[e] = sum;
}
