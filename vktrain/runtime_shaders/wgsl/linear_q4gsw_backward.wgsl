// d_x[M, K] = d_out[M, N] @ deq(W), reading the same W_4X8 buffer along N (GLSL reference:
// ../linear_q4gsw_backward.comp; the body is linear_gemm.inc.wgsl).
#define LINEAR_MODE 1
#include "linear_gemm.inc.wgsl"
