#version 450
// Attention of L queries over a KV cache (host module: vktrain/runtime/delegate/kernels/kv_cache.py):
//   q [B, L, Hq, D], k/v cache [B, C, Hkv, D], input_pos int32 [L]; query l attends to the cache rows
//   0 .. input_pos[l]; query head h reads kv head h / (Hq / Hkv) (GQA). out [B, L, Hq, D].
// One work group of TILE threads per (b, l, h). Keys go by in tiles of TILE: each thread scores one
// key into shared memory, then every thread folds the tile into a running (max, sum, accumulator) for
// its own output dims d = t, t + TILE, ... (online softmax, as flash attention). D <= TILE *
// MAX_DIMS_PER_THREAD. Loops run at most C / TILE tiles of TILE keys (lavapipe's loop limits hold).
// vktrain-variants: -
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#define TILE 64
#define MAX_DIMS_PER_THREAD 4
#define MAX_D (TILE * MAX_DIMS_PER_THREAD)

layout(local_size_x = TILE) in;

layout(std430, set = 0, binding = 0) readonly buffer QBuf { float q[]; };
layout(std430, set = 0, binding = 1) readonly buffer KBuf { float k_cache[]; };
layout(std430, set = 0, binding = 2) readonly buffer VBuf { float v_cache[]; };
layout(std430, set = 0, binding = 3) readonly buffer PosBuf { int input_pos[]; };
layout(std430, set = 0, binding = 4) writeonly buffer OutBuf { float out_[]; };

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint rows;      // L
  uint q_heads;   // Hq
  uint kv_heads;  // Hkv
  uint head_dim;  // D
  uint cache_length;   // C
  float scale;
} pc;

shared float q_row[MAX_D];
shared float scores[TILE];

void main() {
  const uint group = VKTRAIN_GLOBAL_GROUP_ID(pc).x;  // (b * L + l) * Hq + h
  const uint t = gl_LocalInvocationID.x;
  const uint head = group % pc.q_heads;
  const uint row = group / pc.q_heads;  // b * L + l
  const uint batch = row / pc.rows;
  const uint kv_head = head / (pc.q_heads / pc.kv_heads);
  const uint D = pc.head_dim;
  for (uint d = t; d < D; d += TILE) q_row[d] = q[group * D + d];
  const int position = input_pos[row % pc.rows];
  // Keys 0 .. position; a position outside the cache (refused by the host) reads at most the cache.
  const uint keys = position < 0 ? 0u : min(uint(position) + 1u, pc.cache_length);
  barrier();

  float running_max = -3.402823466e38;
  float running_sum = 0.0;
  float acc[MAX_DIMS_PER_THREAD];
  for (uint i = 0u; i < MAX_DIMS_PER_THREAD; ++i) acc[i] = 0.0;
  const uint kv_stride = pc.kv_heads * D;  // floats between consecutive cache rows
  const uint kv_base = batch * pc.cache_length * kv_stride + kv_head * D;

  for (uint first = 0u; first < keys; first += TILE) {
    const uint key = first + t;
    float score = 0.0;
    if (key < keys) {
      const uint base = kv_base + key * kv_stride;
      for (uint d = 0u; d < D; ++d) score += q_row[d] * k_cache[base + d];
      score *= pc.scale;
    }
    scores[t] = score;
    barrier();
    const uint tile_keys = min(uint(TILE), keys - first);
    float tile_max = scores[0];
    for (uint j = 1u; j < tile_keys; ++j) tile_max = max(tile_max, scores[j]);
    const float new_max = max(running_max, tile_max);
    const float correction = exp(running_max - new_max);
    running_sum *= correction;
    for (uint i = 0u; i < MAX_DIMS_PER_THREAD; ++i) acc[i] *= correction;
    for (uint j = 0u; j < tile_keys; ++j) {
      const float p = exp(scores[j] - new_max);
      running_sum += p;
      const uint base = kv_base + (first + j) * kv_stride;
      for (uint i = 0u; i < MAX_DIMS_PER_THREAD; ++i) {
        const uint d = t + i * TILE;
        if (d < D) acc[i] += p * v_cache[base + d];
      }
    }
    running_max = new_max;
    barrier();  // every thread has read this tile's scores before the next overwrites them
  }
  for (uint i = 0u; i < MAX_DIMS_PER_THREAD; ++i) {
    const uint d = t + i * TILE;
    if (d < D) out_[group * D + d] = keys == 0u ? 0.0 : acc[i] / running_sum;
  }
}
