// dW[N, K] = d_out[M, N].T @ x (GLSL reference: ../linear_dw.comp; the body is linear_gemm.inc.wgsl).
#define LINEAR_MODE 2
#include "linear_gemm.inc.wgsl"
