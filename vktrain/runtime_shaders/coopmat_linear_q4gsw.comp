#version 450
// Tensor-core y[M, N] = x[M, K] @ deq(W).T: W_4X8 words dequantized straight into fp16 tiles in shared
// memory, x rounded to fp16 while staged, fp32 accumulation (body and tiling: coopmat_gemm.glsl).
// Bindings: 0 y fp32 [M, N], 1 x fp32 [M, K], 2 W_4X8 words, 3 scales fp32 [G, N].
// Variants: the tilings of kernels/coopmat_tiling.py TILINGS (BM, BN, BK, SG_M, SG_N, STAGES, PREFETCH: see
// coopmat_gemm.glsl), the same list in every coopmat GEMM source.
// vktrain-variants: -, BM=64, PREFETCH, BM=64+PREFETCH, STAGES=2, BM=64+STAGES=2, BK=64, BM=64+BK=64, BM=64+BK=64+PREFETCH, SG_M=4, SG_N=4, SG_M=4+PREFETCH, BK=64+SG_M=4, BM=256+SG_M=4, BN=256+SG_N=4, BM=256+SG_M=4+PREFETCH, BN=256+SG_N=4+PREFETCH, BM=64+BN=64+STAGES=2, BM=64+BN=64+BK=64
#extension GL_GOOGLE_include_directive : require

#define COOPMAT_B_Q4GSW
#include "coopmat_gemm.glsl"
