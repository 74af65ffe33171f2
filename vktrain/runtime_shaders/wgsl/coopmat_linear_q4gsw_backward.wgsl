// d_x[M, K] = d_out[M, N] @ deq(W) in f16 WGSL (GLSL reference: ../coopmat_linear_q4gsw_backward.comp;
// body coopmat_gemm.inc.wgsl, whose M, N, K are M, K, N here: the push block's order). d_out is scaled
// by a power of two before its f16 rounding (A_SCALE: binding 4 holds the partial maxima of |d_out|).
// Bindings: 0 d_x fp32 [M, K], 1 d_out fp32 [M, N], 2 W_4X8 words, 3 scales fp32 [G, N], 4 partial maxima.
// vktrain-requires-features: shader-f16
// vktrain-variants: A_SCALE+BM=64
#define COOPMAT_B 1
#include "coopmat_gemm.inc.wgsl"
