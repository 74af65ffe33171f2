"""The one dtype table: name <-> numpy dtype <-> blob DataType code (schema.fbs) <-> bytes per element.

Torch-free; torch's mapping is derived from the names next to the op library (vktrain/ops/_library.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vktrain.errors import VktrainError


@dataclass(frozen=True)
class DTypeInfo:
    name: str        # the name every layer uses ("float32"); equals numpy's and torch's (torch.<name>)
    blob_code: int   # schema.fbs `DataType` value
    itemsize: int    # bytes per element as stored in the blob

    @property
    def numpy(self) -> np.dtype:
        return np.dtype(self.name).newbyteorder("<")


DTYPES = (
    DTypeInfo("float32", 0, 4), DTypeInfo("float16", 1, 2), DTypeInfo("int32", 2, 4), DTypeInfo("int64", 3, 8),
    DTypeInfo("uint8", 4, 1), DTypeInfo("uint32", 5, 4), DTypeInfo("bool", 6, 1), DTypeInfo("int8", 7, 1),
)
_BY_NAME = {d.name: d for d in DTYPES}


def dtype_info(name: str) -> DTypeInfo:
    info = _BY_NAME.get(name)
    if info is None:
        raise VktrainError(f"dtype {name!r} is not one vktrain stores; known: {', '.join(_BY_NAME)}")
    return info


__all__ = ["DTYPES", "DTypeInfo", "dtype_info"]
