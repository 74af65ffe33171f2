"""CPU reference of vktrain.mm_scaled (definition: vktrain/opdefs/gemm_ops.py): the mm, then the multiply by a
Python scalar, as torch computes `(self @ mat2) * scale`. The backend writes the op into the delegate graph;
the reference exists so that every definition has a torch op (and for tests)."""
from __future__ import annotations

from ._library import define_op


def _mm_scaled_cpu(self, mat2, scale):
    return ((self @ mat2) * scale).contiguous()


define_op("mm_scaled", _mm_scaled_cpu)
