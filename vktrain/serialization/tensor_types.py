"""Element types and layouts of stored tensor bytes (values equal schema.fbs), and the error of an
inconsistent graph: shared by graph.py and synthetic.py."""
from __future__ import annotations

import enum

import numpy as np

from vktrain.errors import VktrainError
from vktrain.opdefs.dtypes import BIT_CONTAINERS, DTYPES


class GraphError(VktrainError, ValueError):
    """A VkGraph is inconsistent (dangling id, wrong constant size, bad layout...)."""


def store_as_tuple(record, field_name: str, element_type) -> None:
    """Store a frozen record's sequence field as a tuple of `element_type`, so that equality does not
    depend on list vs tuple or numpy scalars."""
    object.__setattr__(record, field_name, tuple(element_type(i) for i in getattr(record, field_name)))


class DType(enum.IntEnum):
    """Element type of a tensor's stored bytes; values equal schema.fbs `DataType`."""

    FLOAT32 = 0
    FLOAT16 = 1
    INT32 = 2
    INT64 = 3
    UINT8 = 4
    UINT32 = 5
    BOOL = 6
    INT8 = 7
    BFLOAT16 = 8  # stored constants only (narrow_constant.py); numpy has none: handled as uint16 bits

    @property
    def numpy_dtype(self) -> np.dtype:
        return _DTYPE_INFO[self].numpy

    @property
    def itemsize(self) -> int:
        return self.numpy_dtype.itemsize

    @classmethod
    def from_numpy(cls, dtype) -> "DType":
        dtype = np.dtype(dtype)
        for member, name in _NUMPY_DTYPES.items():
            if dtype == np.dtype(name) and dtype.byteorder in ("=", "<", "|"):
                return member
        supported = ", ".join(str(np.dtype(name)) for name in _NUMPY_DTYPES.values())
        raise GraphError(f"numpy dtype {dtype} has no vktrain DType; supported (little-endian): {supported}")


# vktrain/opdefs/dtypes.py: the one table. A dtype held in a bit container (bfloat16) has no numpy dtype
# of its own, so no numpy array maps back to it.
_DTYPE_INFO = {DType(d.blob_code): d for d in DTYPES}
_NUMPY_DTYPES = {DType(d.blob_code): d.name for d in DTYPES if d.name not in BIT_CONTAINERS}


class Layout(enum.IntEnum):
    """How a tensor's stored bytes are arranged; values equal schema.fbs `TensorLayout`.

    dtype and shape always describe the stored buffer; the layout says how to interpret it
    (docs/spec/w4x8.md): Q4GSW_FLAT is uint8 [N, Kp/2], Q4GSW_W4X8 is uint32 [K4 * N8 * 4].
    """

    PLAIN = 0
    Q4GSW_FLAT = 1
    Q4GSW_W4X8 = 2


# The dtype and rank a packed layout's stored buffer must have.
LAYOUT_STORAGE = {Layout.Q4GSW_FLAT: (DType.UINT8, 2), Layout.Q4GSW_W4X8: (DType.UINT32, 1)}
