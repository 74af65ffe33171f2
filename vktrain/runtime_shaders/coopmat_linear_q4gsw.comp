#version 450
// Tensor-core y[M, N] = x[M, K] @ deq(W).T: W_4X8 words dequantized straight into fp16 tiles in shared
// memory, x rounded to fp16 while staged, fp32 accumulation (body and tiling: coopmat_gemm.glsl).
// Bindings: 0 y fp32 [M, N], 1 x fp32 [M, K], 2 W_4X8 words, 3 scales fp32 [G, N].
// Variants: BM=64 halves the tile along M (more workgroups at small M); PREFETCH issues the next
// step's loads before this step's products.
// vktrain-variants: -, BM=64, PREFETCH, BM=64+PREFETCH
#extension GL_GOOGLE_include_directive : require

#define COOPMAT_B_Q4GSW
#include "coopmat_gemm.glsl"
