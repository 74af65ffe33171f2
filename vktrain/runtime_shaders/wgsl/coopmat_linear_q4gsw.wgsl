// y[M, N] = x[M, K] @ deq(W).T in f16 WGSL: the fp16-tc precision without tensor cores (GLSL reference:
// ../coopmat_linear_q4gsw.comp; body coopmat_gemm.inc.wgsl). Bindings: 0 y fp32 [M, N], 1 x fp32 [M, K],
// 2 W_4X8 words, 3 scales fp32 [G, N]. x is rounded to f16 unscaled (an activation), as in the GLSL.
// vktrain-requires-features: shader-f16
// vktrain-variants: BM=64
#define COOPMAT_B 0
#include "coopmat_gemm.inc.wgsl"
