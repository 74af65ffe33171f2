"""Definitions of the aten (and edge dim-order) ops vktrain lowers: schemas generated from torch
(aten_schemas.py, `python -m vktrain.opdefs.generate`), plus a shape rule where the GPU kernels need one
beyond what the graph's own metadata already guarantees (torch computed every output's shape at export).
"""
from __future__ import annotations

from vktrain.opdefs.aten_schemas import ATEN_SCHEMAS
from vktrain.opdefs.core import Call, OpDef, Refusal, TensorMeta, rank
from vktrain.opdefs.schema import Schema


def _matrices(call: Call, names: tuple[str, ...], ndim: int) -> list[TensorMeta]:
    return [rank(call, name, ndim, "(matrix)" if ndim == 2 else "(batch of matrices)") for name in names]


def _inner(a: TensorMeta, a_name: str, b: TensorMeta, b_name: str) -> None:
    if a.shape[-1] != b.shape[-2]:
        raise Refusal(f"{a_name} {a.shape} and {b_name} {b.shape} do not chain: "
                      f"{a_name}'s last dim must equal {b_name}'s dim -2")


def _mm(call: Call) -> tuple[TensorMeta, ...]:
    a, b = _matrices(call, ("self", "mat2"), 2)
    _inner(a, "self", b, "mat2")
    return (TensorMeta((a.shape[0], b.shape[1]), a.dtype),)


def _bmm(call: Call) -> tuple[TensorMeta, ...]:
    a, b = _matrices(call, ("self", "mat2"), 3)
    _inner(a, "self", b, "mat2")
    return (TensorMeta((a.shape[0], a.shape[1], b.shape[2]), a.dtype),)


def _addmm(call: Call) -> None:
    a, b = _matrices(call, ("mat1", "mat2"), 2)
    _inner(a, "mat1", b, "mat2")


def _baddbmm(call: Call) -> None:
    a, b = _matrices(call, ("batch1", "batch2"), 3)
    _inner(a, "batch1", b, "batch2")


def _linear(call: Call) -> None:
    rank(call, "weight", 2, "[out features, in features]")


def _embedding(call: Call) -> None:
    rank(call, "weight", 2, "[V, D] (one row per token id)")


_SHAPE_RULES = {
    "aten.mm.default": _mm, "aten.bmm.default": _bmm, "aten.addmm.default": _addmm,
    "aten.baddbmm.default": _baddbmm, "aten.linear.default": _linear, "aten.embedding.default": _embedding,
}

ATEN_OPS = tuple(OpDef(Schema.parse(key.split(".", 1)[0], text), _SHAPE_RULES.get(key))
                 for key, text in ATEN_SCHEMAS.items())

__all__ = ["ATEN_OPS"]
