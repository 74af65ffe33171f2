// Tensor-core flash attention, shared by coopmat_attention_fwd.comp and coopmat_attention_bwd.comp
// (host module: vktrain/backend/kernel_planning/kernels/coopmat_attention.py; the fp32 kernels these mirror:
// attention_fwd.comp, attention_bwd.comp).
//
// Products as 16x16x16 cooperative matrices (VK_KHR_cooperative_matrix), fp16 inputs, fp32 accumulators;
// q, k, v, d_out stay fp32 in memory and are rounded to fp16 while staged into shared memory. The
// scalar math (masks, softmax statistics, dS) runs in fp32 on accumulators stored to shared memory, as
// llama.cpp's coopmat1 flash attention does: KHR cooperative matrices do not say which element a lane
// holds.
//
// A workgroup is ROW_BLOCKS subgroups; subgroup s owns the 16 rows [16 s, 16 s + 16) of the workgroup's
// OWN_ROWS rows (queries, or keys for the backward's DKV pass) and computes everything about them
// alone: between the workgroup barriers that stage a streamed tile (STREAM_ROWS rows of the other
// side), a subgroup only reads and writes its own slices of the score scratch, so subgroup barriers
// suffice there. Shared fp16 tiles are f16vec4 arrays with rows padded by 16 bytes (the skew the GEMM
// probe found best, coopmat_gemm.glsl); fp32 scratch rows are padded by 4 floats.
//
// Defines: HEAD_DIM (16, 32 or 64), ROW_BLOCKS (the number of subgroups), STREAM_ROWS (a multiple of 16),
// SUBGROUP_SIZE (the device's, default 32), COOPMAT_EMULATE (see below). Every variant name carries them.
//
// COOPMAT_EMULATE replaces the cooperative-matrix operations by plain arithmetic with the same rounding
// (fp16 x fp16 products are exact in fp32, sums in fp32) on the operands where they lie in shared memory,
// so lavapipe runs every other line of these shaders. A fragment is then a reference (offset, stride,
// layout) into a named shared array; GLSL cannot pass arrays, so each shader instantiates the emulated
// multiply-add and accumulator load/store for the arrays it uses (EMULATED_MUL_ADD, EMULATED_ACC_IO).
#ifndef VKTRAIN_COOPMAT_ATTENTION_GLSL
#define VKTRAIN_COOPMAT_ATTENTION_GLSL

#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#ifndef COOPMAT_EMULATE
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"

#ifndef SUBGROUP_SIZE
#define SUBGROUP_SIZE 32
#endif
#if !defined(HEAD_DIM) || !defined(ROW_BLOCKS) || !defined(STREAM_ROWS)
#error "define HEAD_DIM, ROW_BLOCKS and STREAM_ROWS (the variant name carries them)"
#endif
#define TILE 16                              // the 16x16x16 cooperative-matrix shape
#define OWN_ROWS (ROW_BLOCKS * TILE)
#define NUM_THREADS (ROW_BLOCKS * SUBGROUP_SIZE)
layout(local_size_x = NUM_THREADS, local_size_y = 1, local_size_z = 1) in;

#define D4 (HEAD_DIM / 4)
#define D_FRAGS (HEAD_DIM / TILE)            // 16-column blocks of a head
#define STREAM_FRAGS (STREAM_ROWS / TILE)    // 16-row blocks of a streamed tile
#define HEAD_STRIDE4 (D4 + 2)                // f16vec4 per shared row of a [rows, HEAD_DIM] tile
#define SCORE_STRIDE4 (STREAM_ROWS / 4 + 2)  // f16vec4 per row of a [16, STREAM_ROWS] fp16 tile
#define SCRATCH_STRIDE (STREAM_ROWS + 4)     // floats per row of a subgroup's fp32 scratch
#define SCRATCH_ROWS_PER_BLOCK TILE
// Masked scores and the running max before the first key: finite on purpose (see attention_fwd.comp).
#define MASKED (-3.402823466e38)
// The vec4 groups of a subgroup's [16, STREAM_ROWS] score slice each lane handles (all lanes, in order).
#define SCORE_VECS_PER_LANE ((TILE * STREAM_ROWS / 4 + SUBGROUP_SIZE - 1) / SUBGROUP_SIZE)

#define SUBGROUP_SYNC() { subgroupMemoryBarrierShared(); subgroupBarrier(); }

// Stage `rows` sequence positions from `start` of head `head` (of `heads`) of a [B, S, heads, HEAD_DIM]
// fp32 vec4 buffer into an f16vec4 tile, times `factor` (a power of two or 1) before the rounding;
// positions past the sequence read as zeros. All threads take part (coalesced vec4 reads).
#define STAGE_ROWS(tile, src, rows, start, b, head, heads, factor)                               \
  for (uint idx = gl_LocalInvocationID.x; idx < (rows) * D4; idx += NUM_THREADS) {              \
    const uint tile_row = idx / D4;                                                             \
    const uint col4 = idx % D4;                                                                 \
    const uint seq = (start) + tile_row;                                                        \
    vec4 value = vec4(0.0);                                                                     \
    if (seq < pc.S) value = src[(((b) * pc.S + seq) * (heads) + (head)) * D4 + col4];           \
    tile[tile_row * HEAD_STRIDE4 + col4] = f16vec4(value * (factor));                           \
  }

#ifndef COOPMAT_EMULATE
#define FragA coopmat<float16_t, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseA>
#define FragB coopmat<float16_t, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseB>
#define Acc coopmat<float, gl_ScopeSubgroup, TILE, TILE, gl_MatrixUseAccumulator>
#define ACC_ZERO Acc(0.0)
#define ROW_MAJOR gl_CooperativeMatrixLayoutRowMajor
#define COLUMN_MAJOR gl_CooperativeMatrixLayoutColumnMajor
// Offsets and strides in elements of the shared array (f16vec4 for operands, float for accumulators).
#define LOAD_A(frag, tile, offset4, stride4) coopMatLoad(frag, tile, offset4, stride4, ROW_MAJOR)
#define LOAD_B(frag, tile, offset4, stride4, layout) coopMatLoad(frag, tile, offset4, stride4, layout)
#define MUL_ADD(acc, a, a_tile, b, b_tile) acc = coopMatMulAdd(a, b, acc)
#define SCALE_ACC(acc, factor) acc = acc * (factor)
#define STORE_ACC(acc, array, offset, stride) coopMatStore(acc, array, offset, stride, ROW_MAJOR)
#define LOAD_ACC(acc, array, offset, stride) coopMatLoad(acc, array, offset, stride, ROW_MAJOR)
#define EMULATED_MUL_ADD(a_tile, b_tile)
#define EMULATED_ACC_IO(array)
#else
#define ROW_MAJOR false
#define COLUMN_MAJOR true
struct FragRef { uint offset4; uint stride4; bool column_major; };
#define ACC_PER_LANE (TILE * TILE / SUBGROUP_SIZE)
// Lane l holds the accumulator elements e = l + i * SUBGROUP_SIZE (row e / 16, column e % 16).
struct EmulatedAcc { float v[ACC_PER_LANE]; };
#define FragA FragRef
#define FragB FragRef
#define Acc EmulatedAcc

EmulatedAcc emulated_zero() {
  EmulatedAcc acc;
  [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) acc.v[i] = 0.0;
  return acc;
}
#define ACC_ZERO emulated_zero()
#define LOAD_A(frag, tile, offset4, stride4) frag = FragRef(offset4, stride4, false)
#define LOAD_B(frag, tile, offset4, stride4, layout) frag = FragRef(offset4, stride4, layout)
#define MUL_ADD(acc, a, a_tile, b, b_tile) emulated_mul_add_##a_tile##_##b_tile(acc, a, b)
#define SCALE_ACC(acc, factor) [[unroll]] for (uint i_ = 0u; i_ < ACC_PER_LANE; ++i_) acc.v[i_] *= (factor)
#define STORE_ACC(acc, array, offset, stride) emulated_store_##array(acc, offset, stride)
#define LOAD_ACC(acc, array, offset, stride) acc = emulated_load_##array(offset, stride)

// The loop over k outermost, 16 trips per multiply-add: lavapipe's loop budget (kernels/coopmat.py).
#define EMULATED_MUL_ADD(a_tile, b_tile)                                                          \
  void emulated_mul_add_##a_tile##_##b_tile(inout EmulatedAcc acc, FragRef a, FragRef b) {        \
    [[dont_unroll]] for (uint k = 0u; k < TILE; ++k) {                                            \
      [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) {                                       \
        const uint e = gl_SubgroupInvocationID + i * SUBGROUP_SIZE;                               \
        const uint ha = 4u * a.offset4 + (e / TILE) * 4u * a.stride4 + k;                         \
        const uint hb = 4u * b.offset4 + (b.column_major ? (e % TILE) * 4u * b.stride4 + k        \
                                                          : k * 4u * b.stride4 + e % TILE);      \
        acc.v[i] += float(a_tile[ha / 4u][ha % 4u]) * float(b_tile[hb / 4u][hb % 4u]);            \
      }                                                                                           \
    }                                                                                             \
  }

#define EMULATED_ACC_IO(array)                                                                    \
  void emulated_store_##array(EmulatedAcc acc, uint offset, uint stride) {                        \
    [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) {                                         \
      const uint e = gl_SubgroupInvocationID + i * SUBGROUP_SIZE;                                 \
      array[offset + (e / TILE) * stride + e % TILE] = acc.v[i];                                  \
    }                                                                                             \
  }                                                                                               \
  EmulatedAcc emulated_load_##array(uint offset, uint stride) {                                   \
    EmulatedAcc acc;                                                                              \
    [[unroll]] for (uint i = 0u; i < ACC_PER_LANE; ++i) {                                         \
      const uint e = gl_SubgroupInvocationID + i * SUBGROUP_SIZE;                                 \
      acc.v[i] = array[offset + (e / TILE) * stride + e % TILE];                                  \
    }                                                                                             \
    return acc;                                                                                   \
  }
#endif

// The score slice [16, STREAM_ROWS] of a subgroup as Q_block @ K^T-like products: acc j covers the
// streamed rows [16 j, 16 j + 16); `a_tile` rows row0.. hold the owned side, `b_tile` the streamed side,
// both [rows, HEAD_DIM]. Stores the fp32 accumulators into `scratch` at `scratch0` (row-major).
#define SCORES_TO_SCRATCH(a_tile, row0, b_tile, scratch0)                                          \
  [[unroll]] for (uint j = 0u; j < STREAM_FRAGS; ++j) {                                           \
    Acc s_acc = ACC_ZERO;                                                                         \
    [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {                                              \
      FragA a_frag;                                                                               \
      FragB b_frag;                                                                               \
      LOAD_A(a_frag, a_tile, (row0) * HEAD_STRIDE4 + d * (TILE / 4u), HEAD_STRIDE4);              \
      LOAD_B(b_frag, b_tile, j * TILE * HEAD_STRIDE4 + d * (TILE / 4u), HEAD_STRIDE4, COLUMN_MAJOR); \
      MUL_ADD(s_acc, a_frag, a_tile, b_frag, b_tile);                                             \
    }                                                                                             \
    STORE_ACC(s_acc, scratch, (scratch0) + j * TILE, SCRATCH_STRIDE);                             \
  }

// acc[d] += score_tile[16, STREAM_ROWS] (rows of this subgroup, at score0) @ b_tile[STREAM_ROWS, HEAD_DIM].
#define ACCUMULATE_PRODUCT(acc, score_tile, score0, b_tile)                                        \
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {                                                \
    [[unroll]] for (uint j = 0u; j < STREAM_FRAGS; ++j) {                                         \
      FragA a_frag;                                                                               \
      FragB b_frag;                                                                               \
      LOAD_A(a_frag, score_tile, (score0) + j * (TILE / 4u), SCORE_STRIDE4);                      \
      LOAD_B(b_frag, b_tile, j * TILE * HEAD_STRIDE4 + d * (TILE / 4u), HEAD_STRIDE4, ROW_MAJOR); \
      MUL_ADD(acc[d], a_frag, score_tile, b_frag, b_tile);                                        \
    }                                                                                             \
  }

// Write the 16 rows of accumulators acc[D_FRAGS] (times `factor`) to rows first_row.. of head `head`
// of a [B, S, heads, HEAD_DIM] vec4 buffer, rows past the sequence dropped: through the subgroup's
// scratch 16 columns at a time (the scratch is STREAM_ROWS >= 16 wide), so edges need no special case.
#define STORE_ROWS(acc, dst, first_row, b, head, heads, factor, scratch0)                          \
  [[unroll]] for (uint d = 0u; d < D_FRAGS; ++d) {                                                \
    SCALE_ACC(acc[d], factor);                                                                    \
    SUBGROUP_SYNC();                                                                              \
    STORE_ACC(acc[d], scratch, scratch0, SCRATCH_STRIDE);                                         \
    SUBGROUP_SYNC();                                                                              \
    for (uint e = gl_SubgroupInvocationID; e < TILE * (TILE / 4u); e += SUBGROUP_SIZE) {          \
      const uint r = e / (TILE / 4u), c4 = e % (TILE / 4u);                                       \
      const uint seq = (first_row) + r;                                                           \
      const uint at = (scratch0) + r * SCRATCH_STRIDE + 4u * c4;                                  \
      if (seq < pc.S)                                                                             \
        dst[(((b) * pc.S + seq) * (heads) + (head)) * D4 + d * (TILE / 4u) + c4] =                \
            vec4(scratch[at], scratch[at + 1u], scratch[at + 2u], scratch[at + 3u]);              \
    }                                                                                             \
  }

#endif
