#version 450
// Tensor-core d_x[M, K] = d_out[M, N] @ deq(W) (the 4-bit base's input gradient), reading the same
// W_4X8 buffer as coopmat_linear_q4gsw.comp along N. In the GEMM body's terms (coopmat_gemm.glsl) the
// push constants are M, N' = K (output columns), K' = N (the reduction), group_size.
// d_out is a gradient: A_SCALE multiplies it by a power of two 2^e (binding 4: the partial maxima of
// |d_out| from coopmat_absmax.slang) before it is rounded to fp16, so its largest value lands in [2^14, 2^15) and small
// gradients keep fp16's 11 bits instead of underflowing; the result is multiplied by 2^-e (exact).
// Bindings: 0 d_x fp32 [M, K], 1 d_out fp32 [M, N], 2 W_4X8 words, 3 scales fp32 [G, N], 4 partial maxima of |d_out|.
// vktrain-variants: A_SCALE, A_SCALE+BM=64, A_SCALE+PREFETCH, A_SCALE+BM=64+PREFETCH, A_SCALE+STAGES=2, A_SCALE+BM=64+STAGES=2, A_SCALE+BK=64, A_SCALE+BM=64+BK=64, A_SCALE+BM=64+BK=64+PREFETCH, A_SCALE+SG_M=4, A_SCALE+SG_N=4, A_SCALE+SG_M=4+PREFETCH, A_SCALE+BK=64+SG_M=4, A_SCALE+BM=256+SG_M=4, A_SCALE+BN=256+SG_N=4, A_SCALE+BM=256+SG_M=4+PREFETCH, A_SCALE+BN=256+SG_N=4+PREFETCH, A_SCALE+BM=64+BN=64+STAGES=2, A_SCALE+BM=64+BN=64+BK=64
#extension GL_GOOGLE_include_directive : require

#define COOPMAT_B_Q4GSW_T
#include "coopmat_gemm.glsl"
