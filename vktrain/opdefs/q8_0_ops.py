"""Definitions of the ops that read a frozen matrix W [N, K] held as Q8_0 on the device (vktrain.quant.q8_0,
docs/spec/q8_0.md): `codes` int8 [N, K] and `scales` [N * K / 32], W = codes * scales per block of 32.

    embedding_q8_0(codes, scales, indices) -> W[indices]               [*indices.shape, K]
    linear_q8_0(x, codes, scales) -> x @ W^T                           x [..., K] -> [..., N]
    linear_q8_0_backward(d_out, codes, scales) -> d_out @ W            d_out [..., N] -> [..., K]

No exported graph holds them: the backend's q8_0_weights pass writes them in place of aten.embedding and
the aten.mm ops that read a tied embedding stored as GGUF Q8_0 (vktrain/backend/passes/q8_0_weights.py).
"""
from __future__ import annotations

from vktrain.opdefs.core import Call, OpDef, Refusal, TensorMeta, last_dim, rank
from vktrain.opdefs.schema import Schema
from vktrain.quant.q8_0 import Q8_0_BLOCK_VALUES

NAMESPACE = "vktrain"
_FLOAT = ("float32", "float64")
_INDEX = ("int64", "int32")
_CODES = ("int8",)


def _weight(call: Call) -> tuple[int, int, str]:
    """(N, K, value dtype) of `codes` [N, K] and `scales` [N * K / 32]."""
    codes = rank(call, "codes", 2, "[N, K] (int8 Q8_0 codes)")
    scales = rank(call, "scales", 1, f"[N * K / {Q8_0_BLOCK_VALUES}] (one scale per {Q8_0_BLOCK_VALUES} codes)")
    n, k = codes.shape
    if (n * k) % Q8_0_BLOCK_VALUES or scales.shape[0] != n * k // Q8_0_BLOCK_VALUES:
        raise Refusal(f"codes {codes.shape} need a multiple of {Q8_0_BLOCK_VALUES} elements and scales of shape "
                      f"[{n * k // Q8_0_BLOCK_VALUES}] (one per {Q8_0_BLOCK_VALUES}), got scales {scales.shape}")
    return n, k, scales.dtype


def _embedding_q8_0(call: Call) -> tuple[TensorMeta, ...]:
    _, k, dtype = _weight(call)
    return (TensorMeta(call.tensor("indices").shape + (k,), dtype),)


def _linear_q8_0(call: Call) -> tuple[TensorMeta, ...]:
    n, k, dtype = _weight(call)
    x = last_dim(call, "x", k, "K = the columns of codes")
    return (TensorMeta(x.shape[:-1] + (n,), dtype),)


def _linear_q8_0_backward(call: Call) -> tuple[TensorMeta, ...]:
    n, k, dtype = _weight(call)
    d_out = last_dim(call, "d_out", n, "N = the rows of codes")
    return (TensorMeta(d_out.shape[:-1] + (k,), dtype),)


def _define(schema: str, shape_function, **arg_dtypes: tuple[str, ...]) -> OpDef:
    return OpDef(Schema.parse(NAMESPACE, schema), shape_function, arg_dtypes)


Q8_0_OPS = (
    _define("embedding_q8_0(Tensor codes, Tensor scales, Tensor indices) -> Tensor", _embedding_q8_0,
            codes=_CODES, scales=_FLOAT, indices=_INDEX),
    _define("linear_q8_0(Tensor x, Tensor codes, Tensor scales) -> Tensor", _linear_q8_0,
            x=_FLOAT, codes=_CODES, scales=_FLOAT),
    _define("linear_q8_0_backward(Tensor d_out, Tensor codes, Tensor scales) -> Tensor", _linear_q8_0_backward,
            d_out=_FLOAT, codes=_CODES, scales=_FLOAT),
)

__all__ = ["Q8_0_OPS"]
