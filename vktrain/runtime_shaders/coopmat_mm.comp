#version 450
// Tensor-core C[M, N] = A[M, K] @ B[K, N] (or, with B_TRANSPOSED, A @ B^T with B^T given [N, K]), fp32 in
// memory, rounded to fp16 while staged in shared memory, fp32 accumulation (body: coopmat_gemm.glsl).
// Bindings: 0 C fp32 [M, N], 1 A fp32 [M, K], 2 B fp32 [K, N] (B_TRANSPOSED: [N, K]).
// vktrain-variants: -, BM=64, PREFETCH, BM=64+PREFETCH, B_TRANSPOSED, B_TRANSPOSED+BM=64, B_TRANSPOSED+PREFETCH, B_TRANSPOSED+BM=64+PREFETCH
#extension GL_GOOGLE_include_directive : require

#ifdef B_TRANSPOSED
#define COOPMAT_B_TRANSPOSED
#else
#define COOPMAT_B_ROW_MAJOR
#endif
#include "coopmat_gemm.glsl"
