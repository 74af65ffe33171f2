#version 450
// absmax_bits[slot] = max(absmax_bits[slot], max_i |x[i]| as float bits), over x fp32 [numel], numel % 4 == 0.
// Non-negative floats order like their bit patterns, so a uint atomicMax finds the largest magnitude
// (an inf or NaN anywhere gives bits >= 0x7f800000, which the GEMM reading it treats as "no scale").
// The caller zeroes absmax_bits first (kernels/coopmat.py). This is the per-tensor scale of the coopmat
// GEMMs whose A operand is a gradient (A_SCALE in coopmat_gemm.glsl: slot 0) and of the dense ones, A and B
// (AB_SCALE: slots 0 and 1).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#define WORKGROUP_SIZE 256
#define VECS_PER_THREAD 4
layout(local_size_x = WORKGROUP_SIZE) in;

layout(push_constant, std430) uniform PushConstants {
    VKTRAIN_PUSH_HEADER;
    uint numel;
    uint slot;
} pc;

layout(set = 0, binding = 0) restrict buffer MaxBuf { uint absmax_bits[]; };
layout(set = 0, binding = 1) readonly restrict buffer XBuf { vec4 x[]; };

shared uint partial[WORKGROUP_SIZE];

void main() {
    const uint tid = gl_LocalInvocationID.x;
    const uint first = VKTRAIN_GLOBAL_GROUP_ID(pc).x * WORKGROUP_SIZE * VECS_PER_THREAD + tid;
    uint bits = 0u;
    for (uint s = 0u; s < VECS_PER_THREAD; ++s) {
        const uint v = first + s * WORKGROUP_SIZE;  // consecutive threads read consecutive vec4
        if (4u * v < pc.numel) {
            const uvec4 b = floatBitsToUint(abs(x[v]));
            bits = max(bits, max(max(b.x, b.y), max(b.z, b.w)));
        }
    }
    partial[tid] = bits;
    barrier();
    for (uint width = WORKGROUP_SIZE / 2u; width > 0u; width /= 2u) {
        if (tid < width) partial[tid] = max(partial[tid], partial[tid + width]);
        barrier();
    }
    if (tid == 0u) atomicMax(absmax_bits[pc.slot], partial[0]);
}
