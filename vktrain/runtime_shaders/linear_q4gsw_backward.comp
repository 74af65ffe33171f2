#version 450
// d_x[M, K] = d_out[M, N] @ deq(W), reading the same W_4X8 buffer along N.
// The GEMM body and its tiling live in linear_gemm.glsl.
// FP16: d_out scaled per tensor, fp16 operands in the shared tiles, fp32 products and sums (linear_gemm.glsl).
// vktrain-variants: -, CPU_REGISTER_TILES, FP16
#extension GL_GOOGLE_include_directive : require

#define LINEAR_MODE_FWD 0
#define LINEAR_MODE_BWD 1
#define LINEAR_MODE_DW 2
#define LINEAR_MODE LINEAR_MODE_BWD

#include "linear_gemm.glsl"
