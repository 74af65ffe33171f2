#version 450
// Causal attention backward, pre-pass (host module: vktrain/runtime/delegate/kernels/attention.py):
//   delta[b, h, i] = sum_d d_out[b, i, h, d] * out[b, i, h, d]      [B, Hq, S]
// the row term of the softmax gradient, dS = P * (dP - delta), that attention_bwd.comp needs for every
// query row of every tile it visits. One thread per (batch, position, head) row, reading the row's
// vec4s in order: O(S * D) work, negligible next to the O(S^2 * D) main passes.
// vktrain-variants: -
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;

layout(std430, set = 0, binding = 0) readonly buffer DOutBuf { vec4 d_out[]; };  // [B, S, Hq, D]
layout(std430, set = 0, binding = 1) readonly buffer OutBuf { vec4 out_[]; };    // [B, S, Hq, D]
layout(std430, set = 0, binding = 2) writeonly buffer DeltaBuf { float delta[]; }; // [B, Hq, S]

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint rows;  // B * S * Hq
  uint S;
  uint Hq;
  uint D4;    // head dim / 4
} pc;

void main() {
  const uint n = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;  // row of [B * S * Hq, D]
  if (n >= pc.rows) return;
  const uint head = n % pc.Hq;
  const uint position = (n / pc.Hq) % pc.S;
  const uint b = n / (pc.Hq * pc.S);
  float total = 0.0;
  for (uint c = 0u; c < pc.D4; ++c) total += dot(d_out[n * pc.D4 + c], out_[n * pc.D4 + c]);
  delta[(b * pc.Hq + head) * pc.S + position] = total;
}
