"""The one dtype table: name <-> numpy dtype <-> blob DataType code (schema.fbs) <-> bytes per element.

The names are numpy's (and torch's without `torch.`); the blob codes are read from the flatc-generated
`DataType` (schema.fbs is their one definition). Torch-free; torch's mapping is derived from the names
next to the op library (vktrain/ops/_library.py `torch_dtype`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from vktrain.errors import VktrainError
from vktrain.serialization.generated.vkt_blob.DataType import DataType


# Dtypes numpy has no type for: their elements are held as these unsigned integers of the same width (a
# bfloat16 is the upper half of a float32's bits; only stored constants use it, serialization/narrow_constant.py).
BIT_CONTAINERS = {"bfloat16": "uint16"}


@dataclass(frozen=True)
class DTypeInfo:
    name: str  # the name every layer uses ("float32"); equals numpy's and torch's (torch.<name>)

    @property
    def blob_code(self) -> int:
        """schema.fbs `DataType` value."""
        return getattr(DataType, self.name.upper())

    @cached_property  # asked per tensor per transfer (a federation client writes ~1,260 state tensors)
    def numpy(self) -> np.dtype:
        """numpy's dtype of the elements (for bfloat16: the uint16 holding its bits, BIT_CONTAINERS)."""
        return np.dtype(BIT_CONTAINERS.get(self.name, self.name)).newbyteorder("<")

    @property
    def itemsize(self) -> int:
        """Bytes per element as stored in the blob."""
        return self.numpy.itemsize


# Every DataType of the blob schema.
_CODES = {name: code for name, code in vars(DataType).items() if not name.startswith("_")}
DTYPES = tuple(DTypeInfo(name.lower()) for name in sorted(_CODES, key=_CODES.get))
_BY_NAME = {d.name: d for d in DTYPES}


def dtype_info(name: str) -> DTypeInfo:
    info = _BY_NAME.get(name)
    if info is None:
        raise VktrainError(f"dtype {name!r} is not one vktrain stores; known: {', '.join(_BY_NAME)}")
    return info


__all__ = ["BIT_CONTAINERS", "DTYPES", "DTypeInfo", "dtype_info"]
