#version 450
// Rotary position embedding, Llama/HF "rotate half" pairing (host module: vktrain/runtime/delegate/kernels/rotary.py):
//   x [B, S, H, D], cos/sin [S, D/2] (or [B, S, D/2]: per token, packed documents); for i < D/2, with
//   x1 = x[i], x2 = x[i + D/2]:
//   out[i] = x1 * cos - x2 * sin,   out[i + D/2] = x2 * cos + x1 * sin
// NEGATE_SIN (spec constant 3) uses -sin: the backward, rope(d_y, cos, -sin), the inverse rotation,
// without a negated copy of the table.
// One thread per 4 consecutive pairs (vec4 loads of both halves and of the tables; D % 8 == 0).
// vktrain-variants: -
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;
layout(constant_id = 3) const bool NEGATE_SIN = false;

layout(std430, set = 0, binding = 0) readonly buffer XBuf { vec4 x[]; };      // [B, S, H, D]
layout(std430, set = 0, binding = 1) readonly buffer CosBuf { vec4 cos_[]; }; // [S, D/2]
layout(std430, set = 0, binding = 2) readonly buffer SinBuf { vec4 sin_[]; }; // [S, D/2]
layout(std430, set = 0, binding = 3) writeonly buffer OutBuf { vec4 out_[]; };// [B, S, H, D]

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint quads;        // B * S * H * D / 8: threads with work
  uint table_rows;   // rows of cos/sin: S, or B * S for per-token tables
  uint H;
  uint half_quads;   // D / 8: vec4s per half row
} pc;

void main() {
  const uint t = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
  if (t >= pc.quads) return;
  const uint row = t / pc.half_quads;      // (b * S + s) * H + h
  const uint quad = t % pc.half_quads;
  const uint position = (row / pc.H) % pc.table_rows;  // the table row of token b * S + s
  const uint first = row * 2u * pc.half_quads + quad;
  const uint second = first + pc.half_quads;
  const uint table = position * pc.half_quads + quad;
  const vec4 x1 = x[first];
  const vec4 x2 = x[second];
  const vec4 c = cos_[table];
  const vec4 s = NEGATE_SIN ? -sin_[table] : sin_[table];
  out_[first] = x1 * c - x2 * s;
  out_[second] = x2 * c + x1 * s;
}
