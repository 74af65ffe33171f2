// y[M, N] = x[M, K] @ deq(W).T (+ bias): the tiled GEMM (GLSL reference: ../linear_q4gsw.comp; the body
// is linear_gemm.inc.wgsl). The register-tile CPU variants are not here: WebGPU runs the GPU tuning.
// ACCUMULATE: the sum starts from what y holds (a window of K after the previous one; linear_gemm.inc.wgsl).
// vktrain-variants: -, HAS_BIAS, ACCUMULATE, ACCUMULATE+HAS_BIAS
#define LINEAR_MODE 0
#include "linear_gemm.inc.wgsl"
