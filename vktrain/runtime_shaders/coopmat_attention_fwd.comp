#version 450
// Causal self-attention forward on tensor cores (host module:
// vktrain/backend/kernel_planning/kernels/coopmat_attention.py), the semantics, buffers and push constants of
// attention_fwd.comp:
//   out[b, i, h] = sum_{j <= i} softmax_j(scale * q_i . k_j) v_j        [B, S, Hq, D]
//   lse[b, h, i] = log sum_{j <= i} exp(scale * q_i . k_j)               [B, Hq, S]
// GQA: query head h reads kv head h / (Hq / Hkv).
//
// A workgroup owns OWN_ROWS queries of one (batch, query head), subgroup s the 16 rows from 16 s; the
// key/value tiles (STREAM_ROWS rows, fp16) stream through shared memory up to the causal diagonal. Per
// tile a subgroup: S = Q K^T (16 x STREAM_ROWS accumulators, stored to its scratch); the online softmax
// in fp32 (row max, P = exp(scale s - m) in [0, 1], rounded to fp16 for the next product, the row sum
// from the fp32 P; max and sum by subgroup shuffles); the output accumulators rescaled by exp(m_old - m_new) (stored to the scratch 16
// columns at a time, scaled per row, loaded back: a KHR accumulator cannot be scaled by rows; skipped
// when no row's max moved); O += P V.
// A subgroup whose rows all precede the tile skips it (causal).
// vktrain-variants: HEAD_DIM=64+ROW_BLOCKS=4+STREAM_ROWS=32, HEAD_DIM=64+ROW_BLOCKS=2+STREAM_ROWS=32, HEAD_DIM=32+ROW_BLOCKS=4+STREAM_ROWS=32, HEAD_DIM=32+ROW_BLOCKS=2+STREAM_ROWS=32, HEAD_DIM=16+ROW_BLOCKS=4+STREAM_ROWS=32, HEAD_DIM=16+ROW_BLOCKS=2+STREAM_ROWS=32
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_shader_subgroup_shuffle : require
#include "coopmat_attention.glsl"
#if STREAM_ROWS != 32 || SUBGROUP_SIZE > TILE * STREAM_ROWS / 4
#error "the softmax's shuffle reductions take rows of 8 vec4 groups and whole rows per subgroup"
#endif

layout(std430, set = 0, binding = 0) readonly buffer QBuf { vec4 q[]; };       // [B, S, Hq, D]
layout(std430, set = 0, binding = 1) readonly buffer KBuf { vec4 k[]; };       // [B, S, Hkv, D]
layout(std430, set = 0, binding = 2) readonly buffer VBuf { vec4 v[]; };       // [B, S, Hkv, D]
layout(std430, set = 0, binding = 3) writeonly buffer OutBuf { vec4 out_[]; };  // [B, S, Hq, D]
layout(std430, set = 0, binding = 4) writeonly buffer LseBuf { float lse[]; };  // [B, Hq, S]

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint S;
  uint Hq;
  uint Hkv;
  float scale;
} pc;

shared f16vec4 q_tile[OWN_ROWS * HEAD_STRIDE4];
shared f16vec4 k_tile[STREAM_ROWS * HEAD_STRIDE4];
shared f16vec4 v_tile[STREAM_ROWS * HEAD_STRIDE4];
shared f16vec4 p_tile[OWN_ROWS * SCORE_STRIDE4];            // subgroup s: rows [16 s, 16 s + 16)
shared float scratch[ROW_BLOCKS * TILE * SCRATCH_STRIDE];    // subgroup s: rows [16 s, 16 s + 16)
shared float row_max[OWN_ROWS];
shared float row_sum[OWN_ROWS];
shared float row_correction[OWN_ROWS];

EMULATED_MUL_ADD(q_tile, k_tile)
EMULATED_MUL_ADD(p_tile, v_tile)
EMULATED_ACC_IO(scratch)

void main() {
  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  // The last query tiles see the most keys: dispatched first, as attention_fwd.comp does.
  const uint q_tiles = (pc.S + OWN_ROWS - 1u) / OWN_ROWS;
  const uint q_start = (q_tiles - 1u - group.x) * OWN_ROWS;
  const uint head = group.y;
  const uint b = group.z;
  const uint kv_head = head / (pc.Hq / pc.Hkv);
  const uint sg = gl_SubgroupID;
  const uint lane = gl_SubgroupInvocationID;
  const uint row0 = sg * TILE;                   // this subgroup's first row in the workgroup's tiles
  const uint block_start = q_start + row0;       // and its first query
  const uint q_end = min(q_start + OWN_ROWS, pc.S);
  const uint scratch0 = sg * TILE * SCRATCH_STRIDE;
  const uint score0 = row0 * SCORE_STRIDE4;
  const bool has_rows = block_start < pc.S;

  STAGE_ROWS(q_tile, q, OWN_ROWS, q_start, b, head, pc.Hq, 1.0)
  for (uint r = lane; r < TILE; r += SUBGROUP_SIZE) {
    row_max[row0 + r] = MASKED;
    row_sum[row0 + r] = 0.0;
  }
  Acc o_acc[D_FRAGS];
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) o_acc[d] = ACC_ZERO;

  for (uint k_start = 0u; k_start < q_end; k_start += STREAM_ROWS) {
    barrier();  // every subgroup is done with the previous K/V tiles
    STAGE_ROWS(k_tile, k, STREAM_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
    STAGE_ROWS(v_tile, v, STREAM_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
    barrier();
    // Uniform over the subgroup: its rows exist and its last query sees the tile's first key.
    if (!has_rows || k_start > block_start + TILE - 1u) continue;

    SCORES_TO_SCRATCH(q_tile, row0, k_tile, scratch0)
    SUBGROUP_SYNC();
    // The online softmax, all lanes: lane l takes the vec4 group l % 8 of the rows (l + i SUBGROUP_SIZE) / 8
    // (STREAM_ROWS / 4 = 8 groups a row), so a row's 8 lanes are an aligned group of 8 and its max and
    // sum are xor-shuffle reductions over them. P = exp(scale s - m_new) in [0, 1], 0 where masked (key
    // > query; a stored row has query < S), rounded to fp16 for P V; the row sum from the fp32 P.
    [[unroll]] for (uint i = 0u; i < SCORE_VECS_PER_LANE; ++i) {
      const uint e = lane + i * SUBGROUP_SIZE;
      const uint r = e / (STREAM_ROWS / 4u), c4 = e % (STREAM_ROWS / 4u);
      const uint query = block_start + r;
      const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
      vec4 s = vec4(MASKED);
      [[unroll]] for (uint t = 0u; t < 4u; ++t) {
        if (k_start + 4u * c4 + t <= query) s[t] = scratch[at + t] * pc.scale;
      }
      float tile_max = max(max(s.x, s.y), max(s.z, s.w));
      tile_max = max(tile_max, subgroupShuffleXor(tile_max, 1u));
      tile_max = max(tile_max, subgroupShuffleXor(tile_max, 2u));
      tile_max = max(tile_max, subgroupShuffleXor(tile_max, 4u));
      const float m_old = row_max[row0 + r];
      // Finite: a row sees key 0 in the first tile, and a row before a later tile has seen earlier ones.
      const float m_new = max(m_old, tile_max);
      vec4 p = vec4(0.0);
      [[unroll]] for (uint t = 0u; t < 4u; ++t) {
        if (s[t] != MASKED) p[t] = exp(s[t] - m_new);
      }
      float total = (p.x + p.y) + (p.z + p.w);
      total += subgroupShuffleXor(total, 1u);
      total += subgroupShuffleXor(total, 2u);
      total += subgroupShuffleXor(total, 4u);
      p_tile[score0 + r * SCORE_STRIDE4 + c4] = f16vec4(p);
      // One lane per row updates its statistics (after the shuffles: the row's lanes have read m_old).
      if (c4 == 0u) {
        const float correction = exp(m_old - m_new);  // 0 on a row's first keys (m_old = MASKED)
        row_correction[row0 + r] = correction;
        row_max[row0 + r] = m_new;
        row_sum[row0 + r] = row_sum[row0 + r] * correction + total;
      }
    }
    SUBGROUP_SYNC();
    // O *= correction per row, 16 columns at a time through the scratch; skipped (uniformly: every
    // lane reads all 16 corrections) when no row's max moved, as is usual once a row has seen its
    // largest scores.
    bool max_moved = false;
    for (uint r = 0u; r < TILE; ++r) max_moved = max_moved || row_correction[row0 + r] != 1.0;
    if (max_moved) {
      [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {
        SUBGROUP_SYNC();
        STORE_ACC(o_acc[d], scratch, scratch0, SCRATCH_STRIDE);
        SUBGROUP_SYNC();
        for (uint e = lane; e < TILE * TILE; e += SUBGROUP_SIZE) {
          scratch[scratch0 + (e / TILE) * SCRATCH_STRIDE + e % TILE] *= row_correction[row0 + e / TILE];
        }
        SUBGROUP_SYNC();
        LOAD_ACC(o_acc[d], scratch, scratch0, SCRATCH_STRIDE);
      }
    }
    ACCUMULATE_PRODUCT(o_acc, p_tile, score0, v_tile)
  }

  if (!has_rows) return;  // after the loop: no barrier follows
  // out = O / l (every query sees key 0: l >= 1), through the scratch; lse = m + log l.
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {
    SUBGROUP_SYNC();
    STORE_ACC(o_acc[d], scratch, scratch0, SCRATCH_STRIDE);
    SUBGROUP_SYNC();
    for (uint e = lane; e < TILE * (TILE / 4u); e += SUBGROUP_SIZE) {
      const uint r = e / (TILE / 4u), c4 = e % (TILE / 4u);
      const uint query = block_start + r;
      const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
      if (query < pc.S) {
        out_[((b * pc.S + query) * pc.Hq + head) * D4 + d * (TILE / 4u) + c4] =
            vec4(scratch[at], scratch[at + 1u], scratch[at + 2u], scratch[at + 3u]) / row_sum[row0 + r];
      }
    }
  }
  for (uint r = lane; r < TILE; r += SUBGROUP_SIZE) {
    const uint query = block_start + r;
    if (query < pc.S) lse[(b * pc.Hq + head) * pc.S + query] = row_max[row0 + r] + log(row_sum[row0 + r]);
  }
}
