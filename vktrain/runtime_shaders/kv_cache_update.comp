#version 450
// KV-cache write at runtime positions (host module: vktrain/runtime/delegate/kernels/kv_cache.py).
//   cache [B, C, Hkv, D], new [B, L, Hkv, D], input_pos int32 [L]:
//   out = cache with out[b, input_pos[l]] = new[b, l].
// Variant "-": out[i] = cache[i] (raw 32-bit words); SCATTER: one thread per element of new writes it
// to its row of out (recorded after the copy). A position outside [0, C) writes nothing: the host
// refuses such positions before the program runs (check_cache_positions), a kernel cannot raise.
// vktrain-variants: -, SCATTER
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

layout(local_size_x = 64) in;

layout(std430, set = 0, binding = 0) writeonly buffer OutBuf { uint out_words[]; };

#ifdef SCATTER
layout(std430, set = 0, binding = 1) readonly buffer NewBuf { uint new_words[]; };
layout(std430, set = 0, binding = 2) readonly buffer PosBuf { int input_pos[]; };

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint numel;      // B * L * Hkv * D
  uint rows;       // L
  uint row_words;  // Hkv * D
  uint cache_length;    // C
} pc;

void main() {
  const uint t = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
  if (t >= pc.numel) return;
  const uint row = t / pc.row_words;  // b * L + l
  const uint element = t % pc.row_words;
  const int position = input_pos[row % pc.rows];
  if (position < 0 || uint(position) >= pc.cache_length) return;
  const uint batch = row / pc.rows;
  out_words[(batch * pc.cache_length + uint(position)) * pc.row_words + element] = new_words[t];
}
#else
layout(std430, set = 0, binding = 1) readonly buffer CacheBuf { uint cache_words[]; };

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint numel;      // B * C * Hkv * D
} pc;

void main() {
  const uint t = VKTRAIN_GLOBAL_INVOCATION_ID(pc).x;
  if (t < pc.numel) out_words[t] = cache_words[t];
}
#endif
