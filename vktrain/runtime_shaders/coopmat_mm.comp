#version 450
// Tensor-core C[M, N] = A[M, K] @ B[K, N] (or, with B_TRANSPOSED, A @ B^T with B^T given [N, K]), fp32 in
// memory, rounded to fp16 while staged in shared memory, fp32 accumulation (body: coopmat_gemm.glsl).
// Either operand may be a gradient (aten.mm in a training step: the LM head's d_h reads d_logits, whose
// values follow the loss divisor), so both are scaled per tensor before their fp16 rounding (AB_SCALE:
// binding 3 holds the partial maxima of |A| and |B| from coopmat_absmax.comp).
// Bindings: 0 C fp32 [M, N], 1 A fp32 [M, K], 2 B fp32 [K, N] (B_TRANSPOSED: [N, K]), 3 partial maxima;
// ADDEND: 4 D fp32 [M, N], C = A @ B + D (aten.addmm with beta = alpha = 1, added after the unscaling).
// vktrain-variants: AB_SCALE, AB_SCALE+BM=64, AB_SCALE+PREFETCH, AB_SCALE+BM=64+PREFETCH, AB_SCALE+B_TRANSPOSED, AB_SCALE+B_TRANSPOSED+BM=64, AB_SCALE+B_TRANSPOSED+PREFETCH, AB_SCALE+B_TRANSPOSED+BM=64+PREFETCH
// vktrain-variants: AB_SCALE+ADDEND, AB_SCALE+BM=64+ADDEND, AB_SCALE+PREFETCH+ADDEND, AB_SCALE+BM=64+PREFETCH+ADDEND, AB_SCALE+B_TRANSPOSED+ADDEND, AB_SCALE+B_TRANSPOSED+BM=64+ADDEND, AB_SCALE+B_TRANSPOSED+PREFETCH+ADDEND, AB_SCALE+B_TRANSPOSED+BM=64+PREFETCH+ADDEND
#extension GL_GOOGLE_include_directive : require

#ifdef B_TRANSPOSED
#define COOPMAT_B_TRANSPOSED
#else
#define COOPMAT_B_ROW_MAJOR
#endif
#include "coopmat_gemm.glsl"
