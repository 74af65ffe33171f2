#version 450
// y[M, N] = x[M, K] @ deq(W).T (+ bias): the tiled GEMM path (the host picks linear_q4gsw_gemv for small M).
// The GEMM body and its tiling live in linear_gemm.glsl.
// ACCUMULATE: the sum starts from what y holds (a window of K after the previous one; linear_gemm.glsl).
// FP16: fp16 operands in the shared tiles, fp32 products and sums (the fp16 policy; linear_gemm.glsl).
// vktrain-variants: -, HAS_BIAS, ACCUMULATE, ACCUMULATE+HAS_BIAS, CPU_REGISTER_TILES, CPU_REGISTER_TILES+HAS_BIAS
// vktrain-variants: CPU_REGISTER_TILES+ACCUMULATE, CPU_REGISTER_TILES+ACCUMULATE+HAS_BIAS
// vktrain-variants: FP16, HAS_BIAS+FP16
#extension GL_GOOGLE_include_directive : require

#define LINEAR_MODE_FWD 0
#define LINEAR_MODE_BWD 1
#define LINEAR_MODE_DW 2
#define LINEAR_MODE LINEAR_MODE_FWD

#include "linear_gemm.glsl"
