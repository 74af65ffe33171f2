#version 450
// The training loop's device-side guard of the mutable state (host module:
// vktrain/runtime/delegate/state_guard.py): a backup copy of each state tensor and a NaN/inf flag, so
// that no step reads the state to the host to check it.
//
// Plain: backup[i] = state[i] for the tensor's `numel` 32-bit words, and flag[0] |= 1 when a word
// holds a NaN or an infinity: `check` 1 = fp32 words (exponent bits all ones), 2 = two fp16 halves per
// word, 0 = no check (integer tensors). The test is on the bits, so no float mode can hide a NaN.
// Variant ANY: out[0] = the OR of flags[k * stride] for k < count (one work group): the one word the
// host reads back.
// vktrain-variants: -, ANY
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#define WORKGROUP_SIZE 64u

layout(local_size_x = WORKGROUP_SIZE) in;

#ifdef ANY
layout(std430, set = 0, binding = 0) writeonly buffer OutBuffer { uint out_words[]; };
layout(std430, set = 0, binding = 1) readonly buffer FlagBuffer { uint flags[]; };

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint count;
    uint stride;  // words between two flags
} params;

shared uint partials[WORKGROUP_SIZE];

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint acc = 0u;
    for (uint k = tid; k < params.count; k += WORKGROUP_SIZE) {
        acc |= flags[k * params.stride];
    }
    partials[tid] = acc;
    barrier();
    if (tid == 0u) {
        uint any_set = 0u;
        for (uint i = 0u; i < WORKGROUP_SIZE; ++i) {
            any_set |= partials[i];
        }
        out_words[0] = any_set;
    }
}
#else
layout(std430, set = 0, binding = 0) writeonly buffer BackupBuffer { uint backup_words[]; };
layout(std430, set = 0, binding = 1) readonly buffer StateBuffer { uint state_words[]; };
layout(std430, set = 0, binding = 2) buffer FlagBuffer { uint flag[]; };

layout(push_constant, std430) uniform Params {
    VKTRAIN_PUSH_HEADER;
    uint numel;  // 32-bit words
    uint check;
} params;

bool non_finite(uint word) {
    if (params.check == 1u) {
        return (word & 0x7f800000u) == 0x7f800000u;
    }
    if (params.check == 2u) {
        return (word & 0x7c00u) == 0x7c00u || (word & 0x7c000000u) == 0x7c000000u;
    }
    return false;
}

void main() {
    uint index = VKTRAIN_GLOBAL_INVOCATION_ID(params).x;
    if (index >= params.numel) {
        return;
    }
    uint word = state_words[index];
    backup_words[index] = word;
    if (non_finite(word)) {
        atomicOr(flag[0], 1u);
    }
}
#endif
