#version 450
// RMSNorm over the last dim (host module: vktrain/runtime/delegate/kernels/norm.py); x viewed as [rows, dim].
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps)  [rows];  y = x * rstd * weight
//   BACKWARD: d_x = rstd * (weight * d_y) - x * rstd^3 * mean(x * weight * d_y)
// One workgroup per row: threads stride over the row (coalesced), then a shared-memory tree adds the
// per-thread partial sums in a fixed order (bitwise reproducible, unlike float atomics).
// VEC4 moves vec4s (dim % 4 == 0: every row starts 16-byte aligned); the plain source single floats.
// vktrain-variants: -, VEC4, BACKWARD, VEC4+BACKWARD
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;  // (WG, 1, 1), WG a power of two: the tree halves it

#ifdef VEC4
#define VALUE vec4
#define LANES 4u
#else
#define VALUE float
#define LANES 1u
#endif

#ifdef BACKWARD
layout(std430, set = 0, binding = 0) readonly buffer DYBuf { VALUE d_y[]; };     // [rows, dim]
layout(std430, set = 0, binding = 1) readonly buffer XBuf { VALUE x[]; };        // [rows, dim]
layout(std430, set = 0, binding = 2) readonly buffer WBuf { VALUE weight[]; };   // [dim]
layout(std430, set = 0, binding = 3) readonly buffer RstdBuf { float rstd[]; };  // [rows]
layout(std430, set = 0, binding = 4) writeonly buffer DXBuf { VALUE d_x[]; };    // [rows, dim]
#else
layout(std430, set = 0, binding = 0) readonly buffer XBuf { VALUE x[]; };        // [rows, dim]
layout(std430, set = 0, binding = 1) readonly buffer WBuf { VALUE weight[]; };   // [dim]
layout(std430, set = 0, binding = 2) writeonly buffer YBuf { VALUE y[]; };       // [rows, dim]
layout(std430, set = 0, binding = 3) writeonly buffer RstdBuf { float rstd[]; }; // [rows]
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint rows;
  uint dim;   // elements per row (a multiple of 4 for VEC4)
  float eps;  // forward only
} pc;

shared float partial[gl_WorkGroupSize.x];

// Sum of `value` over the workgroup, in a fixed order; every thread gets the total.
float workgroup_sum(float value) {
  const uint tid = gl_LocalInvocationID.x;
  partial[tid] = value;
  barrier();
  for (uint stride = gl_WorkGroupSize.x / 2u; stride > 0u; stride /= 2u) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    barrier();
  }
  return partial[0];
}

void main() {
  const uint row = VKTRAIN_GLOBAL_GROUP_ID(pc).x;
  if (row >= pc.rows) return;  // uniform over the workgroup: no barrier is split
  const uint tid = gl_LocalInvocationID.x;
  const uint values = pc.dim / LANES;  // VALUEs per row
  const uint base = row * values;
#ifdef BACKWARD
  const float r = rstd[row];
  float local_sum = 0.0;
  for (uint i = tid; i < values; i += gl_WorkGroupSize.x) local_sum += dot(x[base + i] * weight[i], d_y[base + i]);
  const float mean_xwdy = workgroup_sum(local_sum) / float(pc.dim);
  const float x_coefficient = r * r * r * mean_xwdy;
  for (uint i = tid; i < values; i += gl_WorkGroupSize.x) {
    d_x[base + i] = r * (weight[i] * d_y[base + i]) - x[base + i] * x_coefficient;
  }
#else
  float local_sum = 0.0;
  for (uint i = tid; i < values; i += gl_WorkGroupSize.x) local_sum += dot(x[base + i], x[base + i]);
  const float r = inversesqrt(workgroup_sum(local_sum) / float(pc.dim) + pc.eps);
  if (tid == 0u) rstd[row] = r;
  for (uint i = tid; i < values; i += gl_WorkGroupSize.x) y[base + i] = x[base + i] * r * weight[i];
#endif
}
