#version 450
// Causal self-attention forward, flash-style (host module: vktrain/backend/kernel_planning/kernels/attention.py).
//   q [B, S, Hq, D], k/v [B, S, Hkv, D] (as they leave the projections, no permute), GQA: query head h
//   reads kv head h / (Hq / Hkv).
//   out[b, i, h] = sum_{j <= i} softmax_j(scale * q_i . k_j) v_j        [B, S, Hq, D]
//   lse[b, h, i] = log sum_{j <= i} exp(scale * q_i . k_j)               [B, Hq, S] (natural log)
//
// One workgroup owns BQ consecutive queries of one (batch, query head); TPR threads share a query row.
// Keys and values stream through shared memory BK rows at a time, up to the tile's last query (causal),
// and every row keeps an online softmax (running max m, running sum l, unnormalised output o), so no
// score matrix ever reaches global memory: per workgroup only the [BQ, BK] tile of the current scores
// lives in shared memory.
//
// Thread (row r, lane t): computes the scores of its row for keys t, t + TPR, ... of the tile and owns
// the output vec4 chunks t, t + TPR, ... of the row (interleaved, so the TPR threads of a row read
// consecutive vec4s of a V row). The row's softmax statistics are recomputed identically by its TPR
// threads from the shared score tile, which costs BK extra exp per thread but saves a barrier and a
// second shared array. Tiles are vec4 arrays (a quarter of the shared-memory loads of floats) whose rows
// are padded by one vec4, so the threads of a row, which read different K rows at the same column, hit
// different banks.
//
// DOCUMENTS (packed documents): positions [B, S] (int32, binding 5) holds each token's position in its
// document, so query i sees keys first_key(i) = i - positions[i] .. i only (document_start in
// attention_common.glsl). Document starts never decrease along a row (the runner checks its positions),
// so the tile's first query has the earliest start: key tiles wholly before it are skipped.
// vktrain-variants: -, DOCUMENTS
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "attention_common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;  // (BQ * TPR, 1, 1)

layout(constant_id = 3) const uint D = 64;    // head dim, a multiple of 4 * TPR
layout(constant_id = 4) const uint BQ = 16;   // queries per workgroup
layout(constant_id = 5) const uint BK = 16;   // keys per shared tile, a multiple of TPR
layout(constant_id = 6) const uint TPR = 4;   // threads per query row

const uint D4 = D / 4u;
const uint STRIDE = D4 + 1u;         // shared row stride in vec4s, padded (see above)
const uint CHUNKS_PER_THREAD = D4 / TPR;  // output vec4s per thread
const uint KEYS_PER_THREAD = BK / TPR;
// Score rows padded by one float: the rows of a subgroup read the same column of different rows.
const uint SCORE_STRIDE = BK + 1u;
// Masked scores and the running max before the first key. Finite on purpose: Vulkan does not promise
// IEEE infinities without float-controls features, and exp(MASKED - m) underflows to exactly 0 anyway.
const float MASKED = -3.402823466e38;  // -FLT_MAX

layout(std430, set = 0, binding = 0) readonly buffer QBuf { vec4 q[]; };       // [B, S, Hq, D]
layout(std430, set = 0, binding = 1) readonly buffer KBuf { vec4 k[]; };       // [B, S, Hkv, D]
layout(std430, set = 0, binding = 2) readonly buffer VBuf { vec4 v[]; };       // [B, S, Hkv, D]
layout(std430, set = 0, binding = 3) writeonly buffer OutBuf { vec4 out_[]; };  // [B, S, Hq, D]
layout(std430, set = 0, binding = 4) writeonly buffer LseBuf { float lse[]; };  // [B, Hq, S]
#if defined(DOCUMENTS)
layout(std430, set = 0, binding = 5) readonly buffer PosBuf { int positions[]; };  // [B, S]
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint S;        // sequence length
  uint Hq;       // query heads
  uint Hkv;      // key/value heads (divides Hq)
  float scale;   // score scale, usually 1 / sqrt(D)
} pc;

shared vec4 q_tile[BQ * STRIDE];
shared vec4 k_tile[BK * STRIDE];
shared vec4 v_tile[BK * STRIDE];
shared float s_tile[BQ * SCORE_STRIDE];

void main() {
  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  // Tiles in reverse: the last query tiles see the most keys; starting them first shortens the tail of
  // the dispatch (the light diagonal-start tiles fill in at the end).
  const uint q_tiles = (pc.S + BQ - 1u) / BQ;
  const uint q_start = (q_tiles - 1u - group.x) * BQ;
  const uint head = group.y;
  const uint b = group.z;
  const uint kv_head = head / (pc.Hq / pc.Hkv);
  const uint row = gl_LocalInvocationID.x / TPR;
  const uint lane = gl_LocalInvocationID.x % TPR;
  const uint query = q_start + row;
  // Causal: the tile's last query sees keys [0, q_end); uniform over the workgroup.
  const uint q_end = min(q_start + BQ, pc.S);
#if defined(DOCUMENTS)
  const uint first_key = query < pc.S ? document_start(positions, b, query) : query;
  // Uniform: every thread reads the tile's first query's start (q_start < S always).
  const uint k_begin = (document_start(positions, b, q_start) / BK) * BK;
#else
  const uint first_key = 0u;
  const uint k_begin = 0u;
#endif

  LOAD_TILE(q_tile, q, BQ, q_start, b, head, pc.Hq)

  vec4 o[CHUNKS_PER_THREAD];
  for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) o[i] = vec4(0.0);
  float m = MASKED;   // running max of the row's scores
  float l = 0.0;      // running sum of exp(score - m)

  for (uint k_start = k_begin; k_start < q_end; k_start += BK) {
    barrier();  // every thread is done with the previous K/V/score tiles
    LOAD_TILE(k_tile, k, BK, k_start, b, kv_head, pc.Hkv)
    LOAD_TILE(v_tile, v, BK, k_start, b, kv_head, pc.Hkv)
    barrier();

    // The thread's KEYS_PER_THREAD dot products side by side: each q vec4 is read once per d4, not once
    // per key (masked keys are computed too and discarded; only diagonal tiles have any).
    float dot_qk[KEYS_PER_THREAD];
    for (uint j = 0u; j < KEYS_PER_THREAD; ++j) dot_qk[j] = 0.0;
    for (uint d4 = 0u; d4 < D4; ++d4) {
      const vec4 q_value = q_tile[row * STRIDE + d4];
      for (uint j = 0u; j < KEYS_PER_THREAD; ++j) dot_qk[j] += dot(q_value, k_tile[(lane + TPR * j) * STRIDE + d4]);
    }
    for (uint j = 0u; j < KEYS_PER_THREAD; ++j) {
      const uint col = lane + TPR * j;
      const uint key = k_start + col;
      // Masked: in the future of the query, past the sequence, or before the query's document.
      s_tile[row * SCORE_STRIDE + col] = (key <= query && key < pc.S && key >= first_key) ? dot_qk[j] * pc.scale
                                                                                           : MASKED;
    }
    barrier();

    float tile_max = MASKED;
    for (uint c = 0u; c < BK; ++c) tile_max = max(tile_max, s_tile[row * SCORE_STRIDE + c]);
    // Every row sees its first key in the first tile holding it; a tile wholly outside a row's keys adds
    // nothing.
    if (tile_max != MASKED) {
      const float m_new = max(m, tile_max);
      const float correction = exp(m - m_new);  // 0 on the row's first keys (m = MASKED)
      l *= correction;
      for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) o[i] *= correction;
      for (uint c = 0u; c < BK; ++c) {
        const float p = exp(s_tile[row * SCORE_STRIDE + c] - m_new);  // masked scores: exp(~-FLT_MAX) = 0
        l += p;
        for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) o[i] += p * v_tile[c * STRIDE + lane + TPR * i];
      }
      m = m_new;
    }
  }

  if (query < pc.S) {
    // Every query sees at least itself, so l >= 1.
    const uint out_base = ((b * pc.S + query) * pc.Hq + head) * D4;
    for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) out_[out_base + lane + TPR * i] = o[i] / l;
    if (lane == 0u) lse[(b * pc.Hq + head) * pc.S + query] = m + log(l);
  }
}
