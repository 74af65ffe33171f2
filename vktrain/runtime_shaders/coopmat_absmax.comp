#version 450
// Per-workgroup maxima of |x| for the operand scales of the coopmat GEMMs (A_SCALE / AB_SCALE in
// coopmat_gemm.glsl), over one or two fp32 tensors in one dispatch: workgroups [0, pc.groups0) cover
// x0 [numel0], the next pc.groups1 cover x1 [numel1] (numel % 4 == 0; groups1 = 0 for one tensor, x1
// then bound to anything). Workgroup g writes partial_bits[g], the float bits of the largest |x| of the
// vec4 g, g + groups, g + 2 groups, ... of its tensor (per thread; grid-stride). Non-negative floats order
// like their bit patterns, so the GEMM reading the partials takes their uint max (an inf or NaN gives
// bits >= 0x7f800000, which it treats as "no scale"). Every partial is written: no clearing dispatch.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

// 128 threads, Vulkan's guaranteed maximum (every device profile runs it); a maximum is exact in any order,
// so the size changes no result.
#define WORKGROUP_SIZE 128
layout(local_size_x = WORKGROUP_SIZE) in;

layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;
    uint numel0;
    uint numel1;
    uint groups0;
    uint groups1;
} pc;

layout(set = 0, binding = 0) writeonly restrict buffer PartialBuf { uint partial_bits[]; };
layout(set = 0, binding = 1) readonly restrict buffer X0Buf { vec4 x0[]; };
layout(set = 0, binding = 2) readonly restrict buffer X1Buf { vec4 x1[]; };

shared uint partial[WORKGROUP_SIZE];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint group = VKTRAIN_GLOBAL_GROUP_ID(pc).x;
    const bool second = group >= pc.groups0;
    const uint local_group = second ? group - pc.groups0 : group;
    const uint groups = second ? pc.groups1 : pc.groups0;
    const uint vecs = (second ? pc.numel1 : pc.numel0) / 4u;
    uint bits = 0u;
    for (uint v = local_group * WORKGROUP_SIZE + tid; v < vecs; v += groups * WORKGROUP_SIZE) {
        const uvec4 b = floatBitsToUint(abs(second ? x1[v] : x0[v]));  // consecutive threads: consecutive vec4
        bits = max(bits, max(max(b.x, b.y), max(b.z, b.w)));
    }
    partial[tid] = bits;
    barrier();
    for (uint width = WORKGROUP_SIZE / 2u; width > 0u; width /= 2u) {
        if (tid < width) partial[tid] = max(partial[tid], partial[tid + width]);
        barrier();
    }
    if (tid == 0u) partial_bits[group] = partial[0];
}
