#version 450
// SwiGLU, elementwise (host module: vktrain/runtime/delegate/kernels/swiglu.py), with sig = sigmoid(gate):
//   forward:  h = silu(gate) * up = gate * sig * up
//   BACKWARD: d_gate = d_h * up * sig * (1 + gate * (1 - sig)),  d_up = d_h * gate * sig
// sigmoid from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) for g < 0. exp never overflows
// (Vulkan does not promise IEEE infinities), and for g << 0 sig keeps its relative accuracy down to
// fp32's smallest numbers instead of becoming 1 / (1 + exp(-g)) with a huge, error-amplified exp.
// VEC4 moves vec4s (count % 4 == 0); the plain source single floats.
// vktrain-variants: -, VEC4, BACKWARD, VEC4+BACKWARD
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;

#ifdef VEC4
#define VALUE vec4
#else
#define VALUE float
#endif

#ifdef BACKWARD
layout(std430, set = 0, binding = 0) readonly buffer DHBuf { VALUE d_h[]; };
layout(std430, set = 0, binding = 1) readonly buffer GateBuf { VALUE gate[]; };
layout(std430, set = 0, binding = 2) readonly buffer UpBuf { VALUE up[]; };
layout(std430, set = 0, binding = 3) writeonly buffer DGateBuf { VALUE d_gate[]; };
layout(std430, set = 0, binding = 4) writeonly buffer DUpBuf { VALUE d_up[]; };
#else
layout(std430, set = 0, binding = 0) readonly buffer GateBuf { VALUE gate[]; };
layout(std430, set = 0, binding = 1) readonly buffer UpBuf { VALUE up[]; };
layout(std430, set = 0, binding = 2) writeonly buffer HBuf { VALUE h[]; };
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint count;  // VALUEs (floats or vec4s)
} pc;

void main() {
  const uint i = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
  if (i >= pc.count) return;
  const VALUE g = gate[i];
  const VALUE e = exp(-abs(g));
  const VALUE positive_sig = 1.0 / (1.0 + e);
  const VALUE sig = mix(e * positive_sig, positive_sig, step(VALUE(0.0), g));  // exact select: 0 or 1
#ifdef BACKWARD
  const VALUE dh = d_h[i];
  const VALUE u = up[i];
  d_gate[i] = dh * u * sig * (1.0 + g * (1.0 - sig));
  d_up[i] = dh * (g * sig);
#else
  h[i] = g * sig * up[i];
#endif
}
