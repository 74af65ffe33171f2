#version 450
// Tensor-core C[M, N] = A[M, K] @ B[K, N] (or, with B_TRANSPOSED, A @ B^T with B^T given [N, K]), fp32 in
// memory, rounded to fp16 while staged in shared memory, fp32 accumulation (body: coopmat_gemm.glsl).
// Either operand may be a gradient (aten.mm in a training step: the LM head's d_h reads d_logits, whose
// values follow the loss divisor), so both are scaled per tensor before their fp16 rounding (AB_SCALE:
// binding 3 holds the partial maxima of |A| and |B| from coopmat_absmax.comp).
// Bindings: 0 C fp32 [M, N], 1 A fp32 [M, K], 2 B fp32 [K, N] (B_TRANSPOSED: [N, K]), 3 partial maxima.
// vktrain-variants: AB_SCALE, AB_SCALE+BM=64, AB_SCALE+PREFETCH, AB_SCALE+BM=64+PREFETCH, AB_SCALE+STAGES=2, AB_SCALE+BM=64+STAGES=2, AB_SCALE+BK=64, AB_SCALE+BM=64+BK=64, AB_SCALE+BM=64+BK=64+PREFETCH, AB_SCALE+SG_M=4, AB_SCALE+SG_N=4, AB_SCALE+SG_M=4+PREFETCH, AB_SCALE+BK=64+SG_M=4, AB_SCALE+BM=256+SG_M=4, AB_SCALE+BN=256+SG_N=4, AB_SCALE+BM=256+SG_M=4+PREFETCH, AB_SCALE+BN=256+SG_N=4+PREFETCH, AB_SCALE+BM=64+BN=64+STAGES=2, AB_SCALE+BM=64+BN=64+BK=64
// vktrain-variants: AB_SCALE+B_TRANSPOSED, AB_SCALE+B_TRANSPOSED+BM=64, AB_SCALE+B_TRANSPOSED+PREFETCH, AB_SCALE+B_TRANSPOSED+BM=64+PREFETCH, AB_SCALE+B_TRANSPOSED+STAGES=2, AB_SCALE+B_TRANSPOSED+BM=64+STAGES=2, AB_SCALE+B_TRANSPOSED+BK=64, AB_SCALE+B_TRANSPOSED+BM=64+BK=64, AB_SCALE+B_TRANSPOSED+BM=64+BK=64+PREFETCH, AB_SCALE+B_TRANSPOSED+SG_M=4, AB_SCALE+B_TRANSPOSED+SG_N=4, AB_SCALE+B_TRANSPOSED+SG_M=4+PREFETCH, AB_SCALE+B_TRANSPOSED+BK=64+SG_M=4, AB_SCALE+B_TRANSPOSED+BM=256+SG_M=4, AB_SCALE+B_TRANSPOSED+BN=256+SG_N=4, AB_SCALE+B_TRANSPOSED+BM=256+SG_M=4+PREFETCH, AB_SCALE+B_TRANSPOSED+BN=256+SG_N=4+PREFETCH, AB_SCALE+B_TRANSPOSED+BM=64+BN=64+STAGES=2, AB_SCALE+B_TRANSPOSED+BM=64+BN=64+BK=64
#extension GL_GOOGLE_include_directive : require

#ifdef B_TRANSPOSED
#define COOPMAT_B_TRANSPOSED
#else
#define COOPMAT_B_ROW_MAJOR
#endif
#include "coopmat_gemm.glsl"
