"""Definition of the scaled product the backend writes:

    mm_scaled(self, mat2, scale) -> (self @ mat2) * scale          self [M, K], mat2 [K, N] -> [M, N]

the product rounded to the tensors' dtype first, then one multiply by the scale rounded to that dtype: the
values of aten.mm followed by aten.mul.Tensor with a Python scalar. No exported graph holds it: the backend's
gemm_scale pass writes it in place of that pair (a LoRA adapter's x @ A^T * scaling and its backward,
vktrain/backend/passes/gemm_scale.py), so one GEMM dispatch computes both.
"""
from __future__ import annotations

from vktrain.opdefs.core import Call, OpDef, Refusal, TensorMeta, rank, same_dtype
from vktrain.opdefs.schema import Schema

NAMESPACE = "vktrain"
_FLOAT = ("float32", "float64")


def _mm_scaled(call: Call) -> tuple[TensorMeta, ...]:
    a = rank(call, "self", 2, "[M, K]")
    b = rank(call, "mat2", 2, "[K, N]")
    same_dtype(call, "mat2", "self")
    if a.shape[1] != b.shape[0]:
        raise Refusal(f"self {a.shape} and mat2 {b.shape} cannot be multiplied: expected self [M, K] and mat2 [K, N]")
    call.real("scale", "the factor of the whole product")
    return (TensorMeta((a.shape[0], b.shape[1]), a.dtype),)


MM_SCALED = OpDef(Schema.parse(NAMESPACE, "mm_scaled(Tensor self, Tensor mat2, float scale) -> Tensor"), _mm_scaled,
                  {"self": _FLOAT, "mat2": _FLOAT})
SCALED_MM_OPS = (MM_SCALED,)

__all__ = ["SCALED_MM_OPS", "MM_SCALED"]
