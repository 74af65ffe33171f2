#version 450
// Runtime self-test kernel for split dispatches: every invocation of a (gx, gy, gz)-group grid of
// local size (2, 2, 2) bumps the counter at its global linear index and records that index, so a
// test can see each invocation ran exactly once, however the runtime cut the grid.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 2, local_size_y = 2, local_size_z = 2) in;

layout(std430, set = 0, binding = 0) buffer Counts { uint counts[]; };
layout(std430, set = 0, binding = 1) writeonly buffer Ids { uint ids[]; };

layout(push_constant, std430) uniform Push {
    VKTRAIN_PUSH_HEADER;
    uvec4 size;  // invocations along x, y, z
} pc;

void main() {
    uvec3 g = VKTRAIN_GLOBAL_INVOCATION_ID(pc);
    if (any(greaterThanEqual(g, pc.size.xyz))) {
        return;
    }
    uint linear = g.x + pc.size.x * (g.y + pc.size.y * g.z);
    atomicAdd(counts[linear], 1u);
    ids[linear] = linear;
}
