#version 450
// Causal self-attention backward on tensor cores (host module:
// vktrain/backend/kernel_planning/kernels/coopmat_attention.py), the two passes of attention_bwd.comp with the
// same inputs and outputs (delta = rowsum(d_out * out) from attention_bwd_delta.comp):
//   P_ij  = exp(scale * q_i . k_j - lse_i)   (j <= i, else 0)
//   dS_ij = P_ij * (d_out_i . v_j - delta_i)
//   DQ   d_q_i = scale * sum_j dS_ij k_j                           a workgroup per (query tile, head, batch)
//   DKV  d_k_j = scale * sum_{group heads, i} dS_ij q_i,  d_v_j = sum_{group heads, i} P_ij d_out_i
//                                                                 a workgroup per (key tile, kv head, batch)
// Each output is written by one subgroup, its terms added in a fixed order: no atomics, replays are
// bitwise identical. Products as 16x16x16 cooperative matrices, fp16 inputs, fp32 accumulators: the
// scores q k^T and dP = d_out v^T go to the subgroup's fp32 scratch, where its lanes compute P and dS
// in fp32 and round them to fp16 for the products that accumulate the gradients over the whole loop.
//
// fp16 range (docs/PRECISION.md, "Attention"): d_out is a gradient (down to 1e-7 and below), so it is
// staged times 2^e_do, which puts max |d_out| in [2^14, 2^15) (binding 6: the partial maxima of |d_out|
// and then of |v| from coopmat_absmax.comp), and dP comes back times 2^-e_do. P lies in [0, 1]. dS is
// bounded by |dS_ij| <= P_ij (|dP_ij| + |delta_i|) <= 2 max_j |dP_ij| <= 2 D max|d_out| max|v|
// (delta_i = sum_j P_ij dP_ij, sum_j P_ij = 1): it is rounded times 2^e_ds with
// e_ds = e_do + e_v - 16 - log2 D, which keeps that bound below 2^15 (no overflow for any input), and
// the gradients it feeds come back times 2^-e_ds. All scales are powers of two: exact.
// vktrain-variants: DQ+HEAD_DIM=64+ROW_BLOCKS=4+STREAM_ROWS=32, DQ+HEAD_DIM=64+ROW_BLOCKS=2+STREAM_ROWS=32, DQ+HEAD_DIM=32+ROW_BLOCKS=4+STREAM_ROWS=32, DQ+HEAD_DIM=32+ROW_BLOCKS=2+STREAM_ROWS=32, DQ+HEAD_DIM=16+ROW_BLOCKS=4+STREAM_ROWS=32, DQ+HEAD_DIM=16+ROW_BLOCKS=2+STREAM_ROWS=32, DKV+HEAD_DIM=64+ROW_BLOCKS=4+STREAM_ROWS=32, DKV+HEAD_DIM=64+ROW_BLOCKS=2+STREAM_ROWS=32, DKV+HEAD_DIM=32+ROW_BLOCKS=4+STREAM_ROWS=32, DKV+HEAD_DIM=32+ROW_BLOCKS=2+STREAM_ROWS=32, DKV+HEAD_DIM=16+ROW_BLOCKS=4+STREAM_ROWS=32, DKV+HEAD_DIM=16+ROW_BLOCKS=2+STREAM_ROWS=32
#extension GL_GOOGLE_include_directive : require
#include "coopmat_attention.glsl"

#if HEAD_DIM == 16
#define LOG2_HEAD_DIM 4
#elif HEAD_DIM == 32
#define LOG2_HEAD_DIM 5
#elif HEAD_DIM == 64
#define LOG2_HEAD_DIM 6
#else
#error "HEAD_DIM must be 16, 32 or 64"
#endif
// e_ds is clamped so that 2^e_ds and 2^-e_ds are normal fp32 numbers.
#define DS_EXPONENT_LIMIT 120

layout(std430, set = 0, binding = 0) readonly buffer DOutBuf { vec4 d_out[]; };  // [B, S, Hq, D]
layout(std430, set = 0, binding = 1) readonly buffer QBuf { vec4 q[]; };         // [B, S, Hq, D]
layout(std430, set = 0, binding = 2) readonly buffer KBuf { vec4 k[]; };         // [B, S, Hkv, D]
layout(std430, set = 0, binding = 3) readonly buffer VBuf { vec4 v[]; };         // [B, S, Hkv, D]
layout(std430, set = 0, binding = 4) readonly buffer LseBuf { float lse[]; };    // [B, Hq, S]
layout(std430, set = 0, binding = 5) readonly buffer DeltaBuf { float delta[]; };// [B, Hq, S]
layout(std430, set = 0, binding = 6) readonly buffer AbsMaxBuf { uint partial_absmax_bits[]; };
#if defined(DQ)
layout(std430, set = 0, binding = 7) writeonly buffer DQBuf { vec4 d_q[]; };     // [B, S, Hq, D]
#elif defined(DKV)
layout(std430, set = 0, binding = 7) writeonly buffer DKBuf { vec4 d_k[]; };     // [B, S, Hkv, D]
layout(std430, set = 0, binding = 8) writeonly buffer DVBuf { vec4 d_v[]; };     // [B, S, Hkv, D]
#else
#error "compile coopmat_attention_bwd with -DDQ or -DDKV"
#endif

layout(push_constant, std430) uniform Push {
  VKTRAIN_PUSH_HEADER;
  uint S;
  uint Hq;
  uint Hkv;
  float scale;
  uint d_out_partials;  // partial maxima of |d_out| in binding 6, followed by
  uint v_partials;      // those of |v|
} pc;

#include "coopmat_scale.glsl"  // operand_absmax: max |d_out|, max |v| as float bits
shared f16vec4 ds_tile[OWN_ROWS * SCORE_STRIDE4];          // subgroup s: rows [16 s, 16 s + 16)
shared float scratch[ROW_BLOCKS * TILE * SCRATCH_STRIDE];   // subgroup s: rows [16 s, 16 s + 16)

#if defined(DQ)

shared f16vec4 q_tile[OWN_ROWS * HEAD_STRIDE4];
shared f16vec4 do_tile[OWN_ROWS * HEAD_STRIDE4];
shared f16vec4 k_tile[STREAM_ROWS * HEAD_STRIDE4];
shared f16vec4 v_tile[STREAM_ROWS * HEAD_STRIDE4];
shared float row_lse[OWN_ROWS];
shared float row_delta[OWN_ROWS];

EMULATED_MUL_ADD(q_tile, k_tile)
EMULATED_MUL_ADD(do_tile, v_tile)
EMULATED_MUL_ADD(ds_tile, k_tile)
EMULATED_ACC_IO(scratch)

void main() {
  reduce_partials(pc.d_out_partials, pc.v_partials);
  const int do_exponent = scale_exponent(operand_absmax[0]);
  const int ds_exponent = clamp(do_exponent + scale_exponent(operand_absmax[1]) - 16 - LOG2_HEAD_DIM,
                                -DS_EXPONENT_LIMIT, DS_EXPONENT_LIMIT);
  const float inverse_do_scale = ldexp(1.0, -do_exponent);
  const float ds_scale = ldexp(1.0, ds_exponent);

  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  const uint q_tiles = (pc.S + OWN_ROWS - 1u) / OWN_ROWS;
  const uint q_start = (q_tiles - 1u - group.x) * OWN_ROWS;  // heaviest tiles first
  const uint head = group.y;
  const uint b = group.z;
  const uint kv_head = head / (pc.Hq / pc.Hkv);
  const uint sg = gl_SubgroupID;
  const uint lane = gl_SubgroupInvocationID;
  const uint row0 = sg * TILE;
  const uint block_start = q_start + row0;
  const uint q_end = min(q_start + OWN_ROWS, pc.S);
  const uint scratch0 = sg * TILE * SCRATCH_STRIDE;
  const uint score0 = row0 * SCORE_STRIDE4;
  const bool has_rows = block_start < pc.S;

  STAGE_ROWS(q_tile, q, OWN_ROWS, q_start, b, head, pc.Hq, 1.0)
  STAGE_ROWS(do_tile, d_out, OWN_ROWS, q_start, b, head, pc.Hq, ldexp(1.0, do_exponent))
  for (uint r = gl_LocalInvocationID.x; r < OWN_ROWS; r += NUM_THREADS) {
    const uint query = q_start + r;
    row_lse[r] = query < pc.S ? lse[(b * pc.Hq + head) * pc.S + query] : 0.0;
    row_delta[r] = query < pc.S ? delta[(b * pc.Hq + head) * pc.S + query] : 0.0;
  }
  Acc dq_acc[D_FRAGS];
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) dq_acc[d] = ACC_ZERO;

  for (uint k_start = 0u; k_start < q_end; k_start += STREAM_ROWS) {
    barrier();  // the previous K/V tiles are consumed
    STAGE_ROWS(k_tile, k, STREAM_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
    STAGE_ROWS(v_tile, v, STREAM_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
    barrier();
    if (!has_rows || k_start > block_start + TILE - 1u) continue;  // uniform over the subgroup

    SCORES_TO_SCRATCH(q_tile, row0, k_tile, scratch0)
    SUBGROUP_SYNC();
    vec4 p[SCORE_VECS_PER_LANE];  // this lane's vec4 groups of P, fp32
    [[unroll]] for (uint i = 0u; i < SCORE_VECS_PER_LANE; ++i) {
      const uint e = lane + i * SUBGROUP_SIZE;
      const uint r = e / (STREAM_ROWS / 4u), c4 = e % (STREAM_ROWS / 4u);
      const uint query = block_start + r;
      const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
      p[i] = vec4(0.0);
      if (e < TILE * (STREAM_ROWS / 4u) && query < pc.S) {
        [[unroll]] for (uint t = 0u; t < 4u; ++t) {
          if (k_start + 4u * c4 + t <= query) p[i][t] = exp(scratch[at + t] * pc.scale - row_lse[row0 + r]);
        }
      }
    }
    SUBGROUP_SYNC();
    SCORES_TO_SCRATCH(do_tile, row0, v_tile, scratch0)
    SUBGROUP_SYNC();
    [[unroll]] for (uint i = 0u; i < SCORE_VECS_PER_LANE; ++i) {
      const uint e = lane + i * SUBGROUP_SIZE;
      const uint r = e / (STREAM_ROWS / 4u), c4 = e % (STREAM_ROWS / 4u);
      const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
      if (e < TILE * (STREAM_ROWS / 4u)) {
        const vec4 dp = vec4(scratch[at], scratch[at + 1u], scratch[at + 2u], scratch[at + 3u]) * inverse_do_scale;
        ds_tile[score0 + r * SCORE_STRIDE4 + c4] = f16vec4(p[i] * (dp - row_delta[row0 + r]) * ds_scale);
      }
    }
    SUBGROUP_SYNC();
    ACCUMULATE_PRODUCT(dq_acc, ds_tile, score0, k_tile)
  }

  if (!has_rows) return;
  STORE_ROWS(dq_acc, d_q, block_start, b, head, pc.Hq, pc.scale * ldexp(1.0, -ds_exponent), scratch0)
}

#else  // DKV

shared f16vec4 k_tile[OWN_ROWS * HEAD_STRIDE4];
shared f16vec4 v_tile[OWN_ROWS * HEAD_STRIDE4];
shared f16vec4 q_tile[STREAM_ROWS * HEAD_STRIDE4];
shared f16vec4 do_tile[STREAM_ROWS * HEAD_STRIDE4];
shared f16vec4 p_tile[OWN_ROWS * SCORE_STRIDE4];
shared float col_lse[STREAM_ROWS];
shared float col_delta[STREAM_ROWS];

EMULATED_MUL_ADD(k_tile, q_tile)
EMULATED_MUL_ADD(v_tile, do_tile)
EMULATED_MUL_ADD(p_tile, do_tile)
EMULATED_MUL_ADD(ds_tile, q_tile)
EMULATED_ACC_IO(scratch)

void main() {
  reduce_partials(pc.d_out_partials, pc.v_partials);
  const int do_exponent = scale_exponent(operand_absmax[0]);
  const int ds_exponent = clamp(do_exponent + scale_exponent(operand_absmax[1]) - 16 - LOG2_HEAD_DIM,
                                -DS_EXPONENT_LIMIT, DS_EXPONENT_LIMIT);
  const float do_scale = ldexp(1.0, do_exponent);
  const float inverse_do_scale = ldexp(1.0, -do_exponent);
  const float ds_scale = ldexp(1.0, ds_exponent);

  const uvec3 group = VKTRAIN_GLOBAL_GROUP_ID(pc);
  const uint k_start = group.x * OWN_ROWS;  // the first keys see the most queries and start first
  const uint kv_head = group.y;
  const uint b = group.z;
  const uint group_heads = pc.Hq / pc.Hkv;
  const uint sg = gl_SubgroupID;
  const uint lane = gl_SubgroupInvocationID;
  const uint row0 = sg * TILE;
  const uint block_start = k_start + row0;  // this subgroup's first key
  const uint scratch0 = sg * TILE * SCRATCH_STRIDE;
  const uint score0 = row0 * SCORE_STRIDE4;
  const bool has_rows = block_start < pc.S;
  // The first query tile that sees any key of this workgroup: the one holding query k_start.
  const uint first_q_start = (k_start / STREAM_ROWS) * STREAM_ROWS;

  STAGE_ROWS(k_tile, k, OWN_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
  STAGE_ROWS(v_tile, v, OWN_ROWS, k_start, b, kv_head, pc.Hkv, 1.0)
  Acc dk_acc[D_FRAGS];
  Acc dv_acc[D_FRAGS];
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {
    dk_acc[d] = ACC_ZERO;
    dv_acc[d] = ACC_ZERO;
  }

  for (uint g = 0u; g < group_heads; ++g) {
    const uint head = kv_head * group_heads + g;
    for (uint q_start = first_q_start; q_start < pc.S; q_start += STREAM_ROWS) {
      barrier();  // the previous Q/dO tiles and statistics are consumed
      STAGE_ROWS(q_tile, q, STREAM_ROWS, q_start, b, head, pc.Hq, 1.0)
      STAGE_ROWS(do_tile, d_out, STREAM_ROWS, q_start, b, head, pc.Hq, do_scale)
      for (uint c = gl_LocalInvocationID.x; c < STREAM_ROWS; c += NUM_THREADS) {
        const uint query = q_start + c;
        col_lse[c] = query < pc.S ? lse[(b * pc.Hq + head) * pc.S + query] : 0.0;
        col_delta[c] = query < pc.S ? delta[(b * pc.Hq + head) * pc.S + query] : 0.0;
      }
      barrier();
      // Uniform over the subgroup: its keys exist and its first key is seen by the tile's last query.
      if (!has_rows || block_start > q_start + STREAM_ROWS - 1u) continue;

      SCORES_TO_SCRATCH(k_tile, row0, q_tile, scratch0)  // S^T: rows are keys, columns queries
      SUBGROUP_SYNC();
      vec4 p[SCORE_VECS_PER_LANE];
      [[unroll]] for (uint i = 0u; i < SCORE_VECS_PER_LANE; ++i) {
        const uint e = lane + i * SUBGROUP_SIZE;
        const uint r = e / (STREAM_ROWS / 4u), c4 = e % (STREAM_ROWS / 4u);
        const uint key = block_start + r;
        const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
        p[i] = vec4(0.0);
        if (e < TILE * (STREAM_ROWS / 4u)) {
          [[unroll]] for (uint t = 0u; t < 4u; ++t) {
            const uint query = q_start + 4u * c4 + t;
            if (key <= query && query < pc.S) p[i][t] = exp(scratch[at + t] * pc.scale - col_lse[4u * c4 + t]);
          }
          p_tile[score0 + r * SCORE_STRIDE4 + c4] = f16vec4(p[i]);
        }
      }
      SUBGROUP_SYNC();
      SCORES_TO_SCRATCH(v_tile, row0, do_tile, scratch0)  // dP^T, times 2^e_do
      SUBGROUP_SYNC();
      [[unroll]] for (uint i = 0u; i < SCORE_VECS_PER_LANE; ++i) {
        const uint e = lane + i * SUBGROUP_SIZE;
        const uint r = e / (STREAM_ROWS / 4u), c4 = e % (STREAM_ROWS / 4u);
        const uint at = scratch0 + r * SCRATCH_STRIDE + 4u * c4;
        if (e < TILE * (STREAM_ROWS / 4u)) {
          const vec4 dp = vec4(scratch[at], scratch[at + 1u], scratch[at + 2u], scratch[at + 3u]) * inverse_do_scale;
          const vec4 col_delta4 = vec4(col_delta[4u * c4], col_delta[4u * c4 + 1u], col_delta[4u * c4 + 2u],
                                       col_delta[4u * c4 + 3u]);
          ds_tile[score0 + r * SCORE_STRIDE4 + c4] = f16vec4(p[i] * (dp - col_delta4) * ds_scale);
        }
      }
      SUBGROUP_SYNC();
      ACCUMULATE_PRODUCT(dv_acc, p_tile, score0, do_tile)
      ACCUMULATE_PRODUCT(dk_acc, ds_tile, score0, q_tile)
    }
  }

  if (!has_rows) return;
  STORE_ROWS(dk_acc, d_k, block_start, b, kv_head, pc.Hkv, pc.scale * ldexp(1.0, -ds_exponent), scratch0)
  STORE_ROWS(dv_acc, d_v, block_start, b, kv_head, pc.Hkv, inverse_do_scale, scratch0)
}

#endif
