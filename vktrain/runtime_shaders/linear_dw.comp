#version 450
// dW[N, K] = d_out[M, N].T @ x[M, K], dense fp32 with the reduction over M.
// The GEMM body and its tiling live in linear_gemm.glsl.
#extension GL_GOOGLE_include_directive : require

#define LINEAR_MODE_FWD 0
#define LINEAR_MODE_BWD 1
#define LINEAR_MODE_DW 2
#define LINEAR_MODE LINEAR_MODE_DW

#include "linear_gemm.glsl"
