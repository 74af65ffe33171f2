#version 450
// Causal self-attention backward, flash-style (host module: vktrain/backend/kernel_planning/kernels/attention.py).
// Inputs as in attention_fwd.comp plus d_out [B, S, Hq, D], lse [B, Hq, S] from the forward and
// delta [B, Hq, S] = rowsum(d_out * out) from attention_bwd_delta.comp. With P recomputed from lse:
//   P_ij  = exp(scale * q_i . k_j - lse_i)   (j <= i, else 0)
//   dS_ij = P_ij * (d_out_i . v_j - delta_i)
//   d_q_i = scale * sum_j dS_ij k_j
//   d_k_j = scale * sum_{heads of the group} sum_i dS_ij q_i
//   d_v_j = sum_{heads of the group} sum_i P_ij d_out_i
//
// Two variants, each writing its outputs exclusively (no atomics: every run is bitwise identical):
//   DQ   one workgroup per (tile of ROWS queries, query head, batch); streams key tiles [0, last query].
//   DKV  one workgroup per (tile of ROWS keys, kv head, batch); streams, for each query head of the
//        group in order, the query tiles from the diagonal to the end of the sequence, and accumulates
//        d_k and d_v of its keys in registers in that fixed order.
// P and dS are recomputed by both (the price of determinism without a [heads, S, S] buffer); only tiles
// of COLS x ROWS scores ever live, in shared memory.
//
// Thread (row r, lane t) of a workgroup: the scores of row r against streamed rows t, t + TPR, ...; and
// the output vec4 chunks t, t + TPR, ... of row r (interleaved, so shared reads are conflict-free).
// Tiles are vec4 arrays with rows padded by one vec4 (see attention_fwd.comp).
//
// DOCUMENTS (packed documents, as attention_fwd.comp): positions [B, S] int32 after the outputs (binding 7
// for DQ, 8 for DKV); P_ij = 0 unless i - positions[i] <= j. DQ skips the key tiles before its first
// query's document; DKV stops at the first query tile whose first query's document starts after the
// tile's last key (document starts never decrease along a row).
// vktrain-variants: DQ, DKV, DQ+DOCUMENTS, DKV+DOCUMENTS
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "attention_common.glsl"

VKTRAIN_LOCAL_SIZE_FROM_SPEC;  // (ROWS * TPR, 1, 1)

layout(constant_id = 3) const uint D = 64;     // head dim, a multiple of 4 * TPR
layout(constant_id = 4) const uint ROWS = 16;  // rows a workgroup owns (queries for DQ, keys for DKV)
layout(constant_id = 5) const uint COLS = 16;  // rows per streamed shared tile, a multiple of TPR
layout(constant_id = 6) const uint TPR = 4;    // threads per owned row

const uint D4 = D / 4u;
const uint STRIDE = D4 + 1u;              // shared row stride in vec4s
const uint CHUNKS_PER_THREAD = D4 / TPR;  // output vec4s per thread
const uint COLS_PER_THREAD = COLS / TPR;
// Score rows padded by one float: the rows of a subgroup read the same column of different rows.
const uint SCORE_STRIDE = COLS + 1u;

layout(std430, set = 0, binding = 0) readonly buffer DOutBuf { vec4 d_out[]; };  // [B, S, Hq, D]
layout(std430, set = 0, binding = 1) readonly buffer QBuf { vec4 q[]; };         // [B, S, Hq, D]
layout(std430, set = 0, binding = 2) readonly buffer KBuf { vec4 k[]; };         // [B, S, Hkv, D]
layout(std430, set = 0, binding = 3) readonly buffer VBuf { vec4 v[]; };         // [B, S, Hkv, D]
layout(std430, set = 0, binding = 4) readonly buffer LseBuf { float lse[]; };    // [B, Hq, S]
layout(std430, set = 0, binding = 5) readonly buffer DeltaBuf { float delta[]; };// [B, Hq, S]
#if defined(DQ)
layout(std430, set = 0, binding = 6) writeonly buffer DQBuf { vec4 d_q[]; };     // [B, S, Hq, D]
#if defined(DOCUMENTS)
layout(std430, set = 0, binding = 7) readonly buffer PosBuf { int positions[]; };  // [B, S]
#endif
#elif defined(DKV)
layout(std430, set = 0, binding = 6) writeonly buffer DKBuf { vec4 d_k[]; };     // [B, S, Hkv, D]
layout(std430, set = 0, binding = 7) writeonly buffer DVBuf { vec4 d_v[]; };     // [B, S, Hkv, D]
#if defined(DOCUMENTS)
layout(std430, set = 0, binding = 8) readonly buffer PosBuf { int positions[]; };  // [B, S]
#endif
#else
#error "compile attention_bwd with -DDQ or -DDKV"
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint S;
  uint Hq;
  uint Hkv;
  float scale;
} pc;

#if defined(DQ)

shared vec4 q_tile[ROWS * STRIDE];
shared vec4 do_tile[ROWS * STRIDE];
shared vec4 k_tile[COLS * STRIDE];
shared vec4 v_tile[COLS * STRIDE];
shared float ds_tile[ROWS * SCORE_STRIDE];

void main() {
  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  // Heaviest tiles (the last queries, which see the most keys) first: a shorter tail.
  const uint q_tiles = (pc.S + ROWS - 1u) / ROWS;
  const uint q_start = (q_tiles - 1u - group.x) * ROWS;
  const uint head = group.y;
  const uint b = group.z;
  const uint kv_head = head / (pc.Hq / pc.Hkv);
  const uint row = gl_LocalInvocationID.x / TPR;
  const uint lane = gl_LocalInvocationID.x % TPR;
  const uint query = q_start + row;
  const uint q_end = min(q_start + ROWS, pc.S);  // keys [0, q_end) are visible to the tile
#if defined(DOCUMENTS)
  const uint first_key = query < pc.S ? document_start(positions, b, query) : query;
  const uint k_begin = (document_start(positions, b, q_start) / COLS) * COLS;  // uniform
#else
  const uint first_key = 0u;
  const uint k_begin = 0u;
#endif

  LOAD_TILE(q_tile, q, ROWS, q_start, b, head, pc.Hq)
  LOAD_TILE(do_tile, d_out, ROWS, q_start, b, head, pc.Hq)
  const bool valid_query = query < pc.S;
  const uint stat_index = (b * pc.Hq + head) * pc.S + query;
  const float row_lse = valid_query ? lse[stat_index] : 0.0;
  const float row_delta = valid_query ? delta[stat_index] : 0.0;

  vec4 dq[CHUNKS_PER_THREAD];
  for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) dq[i] = vec4(0.0);

  for (uint k_start = k_begin; k_start < q_end; k_start += COLS) {
    barrier();  // the previous K/V/dS tiles are consumed
    LOAD_TILE(k_tile, k, COLS, k_start, b, kv_head, pc.Hkv)
    LOAD_TILE(v_tile, v, COLS, k_start, b, kv_head, pc.Hkv)
    barrier();

    // The thread's dot products side by side: each q / d_out vec4 of its row is read once per d4.
    float dot_qk[COLS_PER_THREAD];
    float dot_dov[COLS_PER_THREAD];
    for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
      dot_qk[j] = 0.0;
      dot_dov[j] = 0.0;
    }
    for (uint d4 = 0u; d4 < D4; ++d4) {
      const vec4 q_value = q_tile[row * STRIDE + d4];
      const vec4 do_value = do_tile[row * STRIDE + d4];
      for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
        const uint col = lane + TPR * j;
        dot_qk[j] += dot(q_value, k_tile[col * STRIDE + d4]);
        dot_dov[j] += dot(do_value, v_tile[col * STRIDE + d4]);
      }
    }
    for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
      const uint col = lane + TPR * j;
      const uint key = k_start + col;
      float ds = 0.0;
      if (valid_query && key <= query && key >= first_key) {  // key <= query < S: inside the sequence
        const float p = exp(dot_qk[j] * pc.scale - row_lse);
        ds = p * (dot_dov[j] - row_delta);
      }
      ds_tile[row * SCORE_STRIDE + col] = ds;
    }
    barrier();

    for (uint c = 0u; c < COLS; ++c) {
      const float ds = ds_tile[row * SCORE_STRIDE + c];
      for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) dq[i] += ds * k_tile[c * STRIDE + lane + TPR * i];
    }
  }

  if (valid_query) {
    const uint out_base = ((b * pc.S + query) * pc.Hq + head) * D4;
    for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) d_q[out_base + lane + TPR * i] = dq[i] * pc.scale;
  }
}

#else  // DKV

shared vec4 k_tile[ROWS * STRIDE];
shared vec4 v_tile[ROWS * STRIDE];
shared vec4 q_tile[COLS * STRIDE];
shared vec4 do_tile[COLS * STRIDE];
shared float p_tile[ROWS * SCORE_STRIDE];
shared float ds_tile[ROWS * SCORE_STRIDE];
shared float lse_tile[COLS];
shared float delta_tile[COLS];

void main() {
  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  const uint k_start = group.x * ROWS;  // the first keys see the most queries and start first
  const uint kv_head = group.y;
  const uint b = group.z;
  const uint group_heads = pc.Hq / pc.Hkv;
  const uint row = gl_LocalInvocationID.x / TPR;
  const uint lane = gl_LocalInvocationID.x % TPR;
  const uint key = k_start + row;
  const bool valid_key = key < pc.S;
  // The first query tile that can see any key of this tile: the one holding query k_start.
  const uint first_q_start = (k_start / COLS) * COLS;

  LOAD_TILE(k_tile, k, ROWS, k_start, b, kv_head, pc.Hkv)
  LOAD_TILE(v_tile, v, ROWS, k_start, b, kv_head, pc.Hkv)

  vec4 dk[CHUNKS_PER_THREAD];
  vec4 dv[CHUNKS_PER_THREAD];
  for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) {
    dk[i] = vec4(0.0);
    dv[i] = vec4(0.0);
  }

  for (uint g = 0u; g < group_heads; ++g) {
    const uint head = kv_head * group_heads + g;
    for (uint q_start = first_q_start; q_start < pc.S; q_start += COLS) {
#if defined(DOCUMENTS)
      // Uniform: this and every later query tile start their documents after the key tile's last key,
      // so they see none of its keys.
      if (document_start(positions, b, q_start) >= k_start + ROWS) break;
#endif
      barrier();  // the previous Q/dO/P/dS tiles are consumed
      LOAD_TILE(q_tile, q, COLS, q_start, b, head, pc.Hq)
      LOAD_TILE(do_tile, d_out, COLS, q_start, b, head, pc.Hq)
      for (uint c = gl_LocalInvocationID.x; c < COLS; c += gl_WorkGroupSize.x) {
        const uint query = q_start + c;
        const uint stat_index = (b * pc.Hq + head) * pc.S + query;
        lse_tile[c] = query < pc.S ? lse[stat_index] : 0.0;
        delta_tile[c] = query < pc.S ? delta[stat_index] : 0.0;
      }
      barrier();

      // The thread's dot products side by side: each k / v vec4 of its key is read once per d4.
      float dot_qk[COLS_PER_THREAD];
      float dot_dov[COLS_PER_THREAD];
      for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
        dot_qk[j] = 0.0;
        dot_dov[j] = 0.0;
      }
      for (uint d4 = 0u; d4 < D4; ++d4) {
        const vec4 k_value = k_tile[row * STRIDE + d4];
        const vec4 v_value = v_tile[row * STRIDE + d4];
        for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
          const uint col = lane + TPR * j;
          dot_qk[j] += dot(q_tile[col * STRIDE + d4], k_value);
          dot_dov[j] += dot(do_tile[col * STRIDE + d4], v_value);
        }
      }
      for (uint j = 0u; j < COLS_PER_THREAD; ++j) {
        const uint col = lane + TPR * j;
        const uint query = q_start + col;
        float p = 0.0;
        float ds = 0.0;
        if (valid_key && key <= query && query < pc.S
#if defined(DOCUMENTS)
            && key >= document_start(positions, b, query)  // within the query's document
#endif
        ) {
          p = exp(dot_qk[j] * pc.scale - lse_tile[col]);
          ds = p * (dot_dov[j] - delta_tile[col]);
        }
        p_tile[row * SCORE_STRIDE + col] = p;
        ds_tile[row * SCORE_STRIDE + col] = ds;
      }
      barrier();

      for (uint c = 0u; c < COLS; ++c) {
        const float p = p_tile[row * SCORE_STRIDE + c];
        const float ds = ds_tile[row * SCORE_STRIDE + c];
        for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) {
          const uint chunk = lane + TPR * i;
          dv[i] += p * do_tile[c * STRIDE + chunk];
          dk[i] += ds * q_tile[c * STRIDE + chunk];
        }
      }
    }
  }

  if (valid_key) {
    const uint out_base = ((b * pc.S + key) * pc.Hkv + kv_head) * D4;
    for (uint i = 0u; i < CHUNKS_PER_THREAD; ++i) {
      d_k[out_base + lane + TPR * i] = dk[i] * pc.scale;
      d_v[out_base + lane + TPR * i] = dv[i];
    }
  }
}

#endif
