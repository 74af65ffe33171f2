// C[M, N] = A[M, K] @ B[K, N] (B_TRANSPOSED: A @ B^T, B^T given [N, K]) in f16 WGSL (GLSL reference:
// ../coopmat_mm.comp; body coopmat_gemm.inc.wgsl). Both operands are scaled per tensor by a power of two
// before their f16 rounding (AB_SCALE: binding 3 holds the partial maxima of |A|, then of |B|).
// Bindings: 0 C fp32 [M, N], 1 A fp32 [M, K], 2 B fp32 [K, N] (B_TRANSPOSED: [N, K]), 3 partial maxima;
// ADDEND: 4 D fp32 [M, N], C = A @ B + D, D added in f32 after the unscaling.
// vktrain-requires-features: shader-f16
// vktrain-variants: AB_SCALE+BM=64, AB_SCALE+B_TRANSPOSED+BM=64, AB_SCALE+BM=64+ADDEND, AB_SCALE+B_TRANSPOSED+BM=64+ADDEND
#if B_TRANSPOSED
#define COOPMAT_B 3
#else
#define COOPMAT_B 2
#endif
#define DENSE_B 1
#include "coopmat_gemm.inc.wgsl"
