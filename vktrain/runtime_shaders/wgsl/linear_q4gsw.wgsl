// y[M, N] = x[M, K] @ deq(W).T (+ bias): the tiled GEMM (GLSL reference: ../linear_q4gsw.comp; the body
// is linear_gemm.inc.wgsl). The register-tile CPU variants are not here: WebGPU runs the GPU tuning.
// vktrain-variants: -, HAS_BIAS
#define LINEAR_MODE 0
#include "linear_gemm.inc.wgsl"
