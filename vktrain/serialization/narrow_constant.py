"""Float32 constants stored in 2-byte elements when that is lossless (schema.fbs `ConstantData.stored_dtype`).

A frozen float32 constant whose every value is exactly a float16 number (GGUF F16 tensors) or a
bfloat16 number (Hugging Face bf16 checkpoints) is stored in the blob as those elements, half the bytes,
and widened back to float32 when it is read: bit for bit the array that was narrowed, so the program
computes exactly what it computed with the float32 constant. Whether a constant qualifies is decided
from its bits (`narrow_losslessly`); anything that would not round-trip stays float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from vktrain.serialization.tensor_types import DType, GraphError

NARROW_DTYPES = (DType.BFLOAT16, DType.FLOAT16)  # the order narrow_losslessly tries them in
_BFLOAT16_SHIFT = 16  # a bfloat16 is the upper half of a float32


@dataclass(frozen=True, eq=False)
class NarrowConstant:
    """A float32 constant stored as `stored_dtype` elements (`data`: their little-endian bytes)."""

    data: Union[bytes, bytearray, memoryview, np.ndarray]
    stored_dtype: DType

    def __post_init__(self):
        if self.stored_dtype not in NARROW_DTYPES:
            raise GraphError(f"a narrow constant is stored as one of {[d.name for d in NARROW_DTYPES]}, "
                             f"got {getattr(self.stored_dtype, 'name', self.stored_dtype)}")
        if self.stored_nbytes % self.stored_dtype.itemsize:
            raise GraphError(f"narrow constant ({self.stored_dtype.name}) has {self.stored_nbytes} bytes, "
                             f"not a whole number of {self.stored_dtype.itemsize}-byte elements")

    @property
    def stored_bytes(self) -> memoryview:
        """The bytes as stored in the blob."""
        if isinstance(self.data, np.ndarray):
            return memoryview(np.ascontiguousarray(self.data).reshape(-1).view(np.uint8))
        view = memoryview(self.data)
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view

    @property
    def stored_nbytes(self) -> int:
        return self.stored_bytes.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the float32 array it widens to (what the tensors reading it take)."""
        return self.stored_nbytes // self.stored_dtype.itemsize * DType.FLOAT32.itemsize

    def widen(self) -> np.ndarray:
        """The float32 values, flat (a new array)."""
        stored = np.frombuffer(self.stored_bytes, self.stored_dtype.numpy_dtype)
        if self.stored_dtype == DType.BFLOAT16:
            return (stored.astype(np.uint32) << _BFLOAT16_SHIFT).view(np.float32)
        return stored.astype(np.float32)  # every float16 is exactly a float32


def narrow_losslessly(array: np.ndarray) -> NarrowConstant | None:
    """`array` (float32) as a NarrowConstant when every element round-trips exactly (bits compared, so
    -0.0 and NaN payloads count), else None."""
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    bits = flat.view(np.uint32)
    if not np.any(bits & np.uint32((1 << _BFLOAT16_SHIFT) - 1)):
        return NarrowConstant((bits >> _BFLOAT16_SHIFT).astype("<u2"), DType.BFLOAT16)
    with np.errstate(over="ignore", invalid="ignore"):
        half = flat.astype("<f2")
    if np.array_equal(half.astype(np.float32).view(np.uint32), bits):
        return NarrowConstant(half, DType.FLOAT16)
    return None
