// Shared by attention_fwd.comp and attention_bwd.comp (host module: vktrain/backend/kernel_planning/kernels/attention.py).
#ifndef VKTRAIN_ATTENTION_COMMON_GLSL
#define VKTRAIN_ATTENTION_COMMON_GLSL

// Copy `rows` sequence positions from `start` of head `head` (of `heads`) of a [B, S, heads, D] vec4
// buffer into a shared vec4 tile with row stride STRIDE (D4 + 1: padded by a vec4); positions past the
// sequence read as zeros. All threads of the workgroup take part (consecutive threads, consecutive
// vec4s of a row: coalesced). Expects D4, STRIDE and a push block `pc` with S in scope. A macro rather
// than a function: GLSL cannot pass a buffer or a shared array by reference.
#define LOAD_TILE(tile, src, rows, start, b, head, heads)                                      \
  for (uint idx = gl_LocalInvocationID.x; idx < (rows) * D4; idx += gl_WorkGroupSize.x) {      \
    const uint tile_row = idx / D4;                                                            \
    const uint col4 = idx % D4;                                                                \
    const uint seq = (start) + tile_row;                                                       \
    vec4 value = vec4(0.0);                                                                    \
    if (seq < pc.S) value = src[(((b) * pc.S + seq) * (heads) + (head)) * D4 + col4];          \
    tile[tile_row * STRIDE + col4] = value;                                                    \
  }

// The first key query `query` of batch row `b` may see with packed documents: its document's first token,
// query - positions[b, query], clamped to [0, query] (a bad position cannot reach outside the row).
#define document_start(positions, b, query) \
  ((query) - uint(clamp(positions[(b) * pc.S + (query)], 0, int(query))))

#endif
