"""Vector builders the blob's and the schedule's flatbuffer writers share (flatbuffer_reading.py is their
reading side)."""
from __future__ import annotations

from typing import Iterable

import flatbuffers
import numpy as np


def numpy_vector(builder: flatbuffers.Builder, items: Iterable, dtype) -> int:
    """A vector of scalars of `dtype` (any iterable or array, flattened)."""
    return builder.CreateNumpyVector(np.asarray(list(items) if not isinstance(items, np.ndarray) else items,
                                                dtype=dtype).reshape(-1))


def table_vector(builder: flatbuffers.Builder, offsets: list[int]) -> int:
    """A vector of the tables (or strings) at `offsets`, in order."""
    builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


__all__ = ["numpy_vector", "table_vector"]
