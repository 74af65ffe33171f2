#version 450
// Straight-through re-quantization (host module: vktrain/backend/kernel_planning/kernels/requant.py) of a latent
// weight [N, K] with fixed group scales [G, N], written directly in the W_4X8 layout
// (docs/spec/w4x8.md) that linear_q4gsw reads in the next step:
//   q = clamp(roundEven(latent[n, k] / scales[k / gs, n]), -8, 7), code = q + 8
//   zero scale -> code 8; padding rows n >= N (N % 8 == 4) and padding k >= K (K % 8 == 4) -> code 8.
// The op library's CPU reference returns the same codes in the flat uint8 layout
// (vktrain.quant.pack_w4x8 maps flat to W_4X8). One thread owns one uint32 word: no atomics.
//
// Word w = 4 * (k4 * N8 + n8) + j holds k = 4*k4 + t in byte t, for row n = 8*n8 + 2j in the low
// nibble and row n + 1 in the high nibble. K % 4 == 0 and gs % 4 == 0, so the 4 k of a byte-quad are
// one aligned vec4 of a latent row and share one scale.
// Division is GLSL '/', which Vulkan allows to be 2.5 ulp off: on a GPU without correctly rounded
// division a quotient within a few ulp of a .5 boundary may take the neighbouring code (power-of-two
// scales divide exactly everywhere). NaN latents give an unspecified code.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;

layout(std430, set = 0, binding = 0) readonly buffer Latent { vec4 latent[]; };    // [N, K] as [N, K/4]
layout(std430, set = 0, binding = 1) readonly buffer Scales { float scales[]; };   // [G, N]
layout(std430, set = 0, binding = 2) writeonly buffer Weights { uint weights[]; }; // K4 * N8 * 4 words

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint N;
  uint K;
  uint group_size;
} pc;

const uint CODE_ZERO = 8u;

// Codes of k = 4*k4 .. 4*k4+3 in row n (one per component); code 8 for padding rows and columns.
uvec4 codes_of(uint n, uint k4) {
  const uint K4_real = pc.K / 4u;
  if (n >= pc.N || k4 >= K4_real) return uvec4(CODE_ZERO);
  const float s = scales[(4u * k4 / pc.group_size) * pc.N + n];
  if (s == 0.0) return uvec4(CODE_ZERO);
  const vec4 q = clamp(roundEven(latent[n * K4_real + k4] / s), -8.0, 7.0);
  return uvec4(ivec4(q) + int(CODE_ZERO));
}

void main() {
  const uint K4 = (pc.K + 7u) / 8u * 2u;      // Kp / 4, Kp = K rounded up to a multiple of 8
  const uint N8 = (pc.N / 4u + 1u) / 2u;      // ceil(N4 / 2)
  const uint w = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
  if (w >= K4 * N8 * 4u) return;

  const uint j = w % 4u;
  const uint n8 = (w / 4u) % N8;
  const uint k4 = w / (4u * N8);
  const uint n_low = 8u * n8 + 2u * j;
  const uvec4 bytes = codes_of(n_low, k4) | (codes_of(n_low + 1u, k4) << 4);
  weights[w] = bytes.x | (bytes.y << 8) | (bytes.z << 16) | (bytes.w << 24);
}
