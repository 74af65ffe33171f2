"""Float32 constants stored in fewer bytes when that is lossless (schema.fbs `ConstantData.stored_dtype`
and `ConstantData.stored_encoding`), widened back bit for bit when read.

A frozen float32 constant is stored in the smallest of these forms that holds every one of its values
exactly, decided from its bits (`narrow_losslessly`); anything that would not round-trip stays float32:
- GGUF_Q8_0 (8.5 bits a value): GGUF's Q8_0 blocks. Per 32 consecutive values in flat order, a
  little-endian float16 scale d then 32 int8 codes q; value = float32(d) * q, as gguf's dequantize
  computes it. A GGUF Q8_0 tensor dequantized by the importer (SmolLM2's token embedding) is such a
  constant. Only for element counts that are a multiple of 32.
- BFLOAT16 / FLOAT16 elements (16 bits a value; `stored_dtype`, encoding ELEMENTS): every value is a
  bfloat16 number (Hugging Face bf16 checkpoints) or a float16 number (GGUF F16 tensors).
Smallest first: a constant that is both (all zeros, small integers) is stored as Q8_0. The widened
array is bit for bit the one that was narrowed, so the program computes exactly what it computed with
the float32 constant.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

import numpy as np

from vktrain.quant.q8_0 import GGUF_Q8_0_BLOCK as _Q8_0_BLOCK, Q8_0_BLOCK_VALUES  # noqa: F401 (re-exported)
from vktrain.serialization.tensor_types import DType, GraphError

NARROW_DTYPES = (DType.BFLOAT16, DType.FLOAT16)  # the order narrow_losslessly tries them in
_BFLOAT16_SHIFT = 16  # a bfloat16 is the upper half of a float32

_Q8_0_LARGEST_CODE = 127  # llama.cpp's scale is amax / 127, so the largest |q| of a block is 127
_Q8_0_CHUNK_BLOCKS = 8192  # blocks encoded at a time


class ConstantEncoding(enum.IntEnum):
    """How a constant's stored bytes encode its float32 values; values equal schema.fbs `ConstantEncoding`."""

    ELEMENTS = 0  # elements of the tensors' dtype, or of `stored_dtype`
    GGUF_Q8_0 = 1


@dataclass(frozen=True, eq=False)
class NarrowConstant:
    """A float32 constant stored in fewer bytes (`data`, as stored): `stored_dtype` elements (encoding
    ELEMENTS), or GGUF_Q8_0 blocks (stored_dtype None)."""

    data: Union[bytes, bytearray, memoryview, np.ndarray]
    stored_dtype: DType | None
    encoding: ConstantEncoding = ConstantEncoding.ELEMENTS

    def __post_init__(self):
        try:
            object.__setattr__(self, "encoding", ConstantEncoding(self.encoding))
        except ValueError:
            raise GraphError(f"narrow constant has stored_encoding {self.encoding}; expected one of "
                             f"{[f'{e.name} ({int(e)})' for e in ConstantEncoding]}") from None
        if self.encoding == ConstantEncoding.GGUF_Q8_0:
            if self.stored_dtype is not None:
                raise GraphError(f"narrow constant stored as GGUF_Q8_0 blocks also has stored_dtype "
                                 f"{getattr(self.stored_dtype, 'name', self.stored_dtype)} (expected none)")
            if self.stored_nbytes % _Q8_0_BLOCK.itemsize:
                raise GraphError(f"narrow constant (GGUF_Q8_0) has {self.stored_nbytes} bytes, not a whole "
                                 f"number of {_Q8_0_BLOCK.itemsize}-byte blocks")
            return
        if self.stored_dtype not in NARROW_DTYPES:
            raise GraphError(f"a narrow constant is stored as one of {[d.name for d in NARROW_DTYPES]} or as "
                             f"GGUF_Q8_0 blocks, got {getattr(self.stored_dtype, 'name', self.stored_dtype)}")
        if self.stored_nbytes % self.stored_dtype.itemsize:
            raise GraphError(f"narrow constant ({self.stored_dtype.name}) has {self.stored_nbytes} bytes, "
                             f"not a whole number of {self.stored_dtype.itemsize}-byte elements")

    @property
    def stored_form(self) -> str:
        """What the stored bytes are, for reports: 'bfloat16', 'float16' or 'gguf_q8_0'."""
        return (self.encoding if self.stored_dtype is None else self.stored_dtype).name.lower()

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
        if self.encoding == ConstantEncoding.GGUF_Q8_0:
            values = self.stored_nbytes // _Q8_0_BLOCK.itemsize * Q8_0_BLOCK_VALUES
        else:
            values = self.stored_nbytes // self.stored_dtype.itemsize
        return values * DType.FLOAT32.itemsize

    def widen(self) -> np.ndarray:
        """The float32 values, flat (a new array)."""
        if self.encoding == ConstantEncoding.GGUF_Q8_0:
            blocks = np.frombuffer(self.stored_bytes, _Q8_0_BLOCK)
            return (blocks["d"].astype(np.float32)[:, None] * blocks["q"].astype(np.float32)).reshape(-1)
        stored = np.frombuffer(self.stored_bytes, self.stored_dtype.numpy_dtype)
        if self.stored_dtype == DType.BFLOAT16:
            return (stored.astype(np.uint32) << _BFLOAT16_SHIFT).view(np.float32)
        return stored.astype(np.float32)  # every float16 is exactly a float32


def stored_constant(data: memoryview, stored_dtype: int | None, encoding: int) -> memoryview | NarrowConstant:
    """A stored constant's bytes as its blob record's stored_dtype and stored_encoding describe them: the
    bytes themselves when neither is set, else the NarrowConstant they hold (GraphError if inconsistent)."""
    if stored_dtype is None and encoding == ConstantEncoding.ELEMENTS:
        return data
    try:
        dtype = None if stored_dtype is None else DType(stored_dtype)
    except ValueError:
        raise GraphError(f"stored_dtype {stored_dtype} is no DataType; a narrow constant is stored as one of "
                         f"{[f'{d.name} ({int(d)})' for d in NARROW_DTYPES]}") from None
    return NarrowConstant(data, dtype, encoding)


def narrow_losslessly(array: np.ndarray) -> NarrowConstant | None:
    """`array` (float32) as a NarrowConstant in the smallest form every element round-trips through
    exactly (bits compared, so -0.0 and NaN payloads count): GGUF_Q8_0, then bfloat16, then float16;
    else None."""
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    q8_0 = _as_q8_0_blocks(flat)
    if q8_0 is not None:
        return NarrowConstant(q8_0, None, ConstantEncoding.GGUF_Q8_0)
    bits = flat.view(np.uint32)
    if not np.any(bits & np.uint32((1 << _BFLOAT16_SHIFT) - 1)):
        return NarrowConstant((bits >> _BFLOAT16_SHIFT).astype("<u2"), DType.BFLOAT16)
    with np.errstate(over="ignore", invalid="ignore"):
        half = flat.astype("<f2")
    if np.array_equal(half.astype(np.float32).view(np.uint32), bits):
        return NarrowConstant(half, DType.FLOAT16)
    return None


def _as_q8_0_blocks(flat: np.ndarray) -> np.ndarray | None:
    """`flat` (float32) as Q8_0 blocks when every block is exactly float32(d) * q, else None. Chunk by
    chunk: data that is not Q8_0 is refused at its first chunk, and the temporaries stay small."""
    if flat.size == 0 or flat.size % Q8_0_BLOCK_VALUES:
        return None
    values = flat.reshape(-1, Q8_0_BLOCK_VALUES)
    blocks = np.empty(len(values), _Q8_0_BLOCK)
    for start in range(0, len(values), _Q8_0_CHUNK_BLOCKS):
        chunk = slice(start, start + _Q8_0_CHUNK_BLOCKS)
        if not _encode_q8_0(values[chunk], blocks[chunk]):
            return None
    return blocks


def _encode_q8_0(values: np.ndarray, blocks: np.ndarray) -> bool:
    """Fill `blocks` with the Q8_0 encoding of `values` ([n, 32] float32); False if it is not exact.

    A block's scale is recovered as max|v| / 127: when the values are d * q with largest |q| 127, max|v|
    is d * 127 exactly (an 11-bit mantissa times 7 bits fits float32's 24), so the division gives d
    exactly. All-zero blocks get d = 0. Blocks quantized any other way fail the final bit comparison."""
    with np.errstate(all="ignore"):  # inf / NaN values give NaN codes, refused below
        scale = np.abs(values).max(axis=1) / np.float32(_Q8_0_LARGEST_CODE)
        half_scale = scale.astype("<f2")
        if not np.array_equal(half_scale.astype(np.float32).view(np.uint32), scale.view(np.uint32)):
            return False  # a scale that is not a float16 number (the cheap test most float32 data fails)
        codes = values / np.where(scale == 0, np.float32(1), scale)[:, None]
    if not (np.all(np.abs(codes) <= _Q8_0_LARGEST_CODE) and np.array_equal(codes, np.rint(codes))):
        return False
    blocks["d"], blocks["q"] = half_scale, codes.astype(np.int8)
    widened = NarrowConstant(blocks, None, ConstantEncoding.GGUF_Q8_0).widen()
    # Bits compared: -0.0 fails (the codes hold no sign of zero), as does any block whose values are not d * q.
    return np.array_equal(widened.view(np.uint32), values.reshape(-1).view(np.uint32))
