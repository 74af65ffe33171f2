#version 450
// fused_ce, pass 2 of 2 (host module: vktrain/runtime/delegate/kernels/cross_entropy.py): loss = the sum of the
// R per-row losses, by one workgroup. Each thread adds a strided slice in order, then a shared-memory
// tree adds the partials: the order depends only on R and the workgroup size, so every run gives the
// same bits (no float atomics).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;  // (WG, 1, 1), WG a power of two: the tree halves it

layout(std430, set = 0, binding = 0) readonly buffer RowLoss { float row_loss[]; };  // [R]
layout(std430, set = 0, binding = 1) writeonly buffer Loss { float loss; };          // scalar

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint R;
} pc;

shared float s_partial[gl_WorkGroupSize.x];

void main() {
  const uint tid = gl_LocalInvocationID.x;
  const uint WG = gl_WorkGroupSize.x;
  float acc = 0.0;
  for (uint r = tid; r < pc.R; r += WG) acc += row_loss[r];
  s_partial[tid] = acc;
  barrier();
  for (uint stride = WG / 2; stride > 0; stride /= 2) {
    if (tid < stride) s_partial[tid] += s_partial[tid + stride];
    barrier();
  }
  if (tid == 0) loss = s_partial[0];
}
