#version 450
// Runtime self-test kernel without the group-offset header: data[i] *= factor for i < n, in a
// grid-stride loop (so any group count covers n). The runtime must refuse to split it.
layout(local_size_x = 32) in;

layout(std430, set = 0, binding = 0) buffer Data { float data[]; };

layout(push_constant, std430) uniform Push {
    uint n;
    float factor;
} pc;

void main() {
    uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        data[i] *= pc.factor;
    }
}
