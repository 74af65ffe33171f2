#version 450
// Runtime self-test kernel: y[i] = SCALE * alpha * x[i] + y[i] (NEGATE variant: y[i] - ...), i < n.
// Exercises buffers, push constants after the group-offset header, a float specialization constant,
// local size from specialization constants and #include. Not used by any model.
// vktrain-variants: -, NEGATE
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;
layout(constant_id = 3) const float SCALE = 1.0;

layout(std430, set = 0, binding = 0) readonly buffer XBuffer { float x[]; };
layout(std430, set = 0, binding = 1) buffer YBuffer { float y[]; };

layout(push_constant, std430) uniform Push {
    VKTRAIN_PUSH_HEADER;
    uint n;
    float alpha;
} pc;

void main() {
    uint i = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
    if (i >= pc.n) {
        return;
    }
#ifdef NEGATE
    y[i] = y[i] - SCALE * pc.alpha * x[i];
#else
    y[i] = SCALE * pc.alpha * x[i] + y[i];
#endif
}
