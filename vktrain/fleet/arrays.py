"""Adapters in Flower's messages: an ArrayRecord of one Array per tensor, each Array's data the .npy file
np.save writes (Flower's own `Array(ndarray)`, byte for byte, so any Flower peer reads what vktrain sends).

Made and read here without np.save and np.load: those format and parse the .npy header on every call,
~0.1 ms a tensor, so SmolLM2-135M's 420 adapter tensors cost ~0.1 s a message on each side, more than a
client's copy of its 10 MB. The header depends only on the dtype and shape, so it is made once per (dtype,
shape) by np.save itself and cached; a message's data is that header and the array's bytes (one copy),
and reading gives a read-only numpy view of the message's bytes (no copy). Data whose header is not the
cached one (another byte order, Fortran order, a peer's other .npy version) is read by np.load.
"""
from __future__ import annotations

import math
from io import BytesIO
from typing import Optional

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

# Structured and string dtypes share a `dtype.str` across layouts: their headers are not cached.
_PLAIN_KINDS = "biufc"
_MAX_HEADER_BYTES = 1 << 16  # a .npy 1.0 header's length field is 16 bits
_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The header np.save writes before a C-ordered array of `dtype` (a plain number type: `_PLAIN_KINDS`)
    and `shape`."""
    key = (dtype.str, shape)
    header = _HEADERS.get(key)
    if header is None:
        buffer = BytesIO()
        empty = np.zeros(shape, dtype)
        np.save(buffer, empty, allow_pickle=False)
        header = _HEADERS[key] = buffer.getvalue()[:buffer.tell() - empty.nbytes]
    return header


def to_array(array: np.ndarray) -> Array:
    """`flwr.app.Array(array)`, equal field for field, without np.save's per-call header."""
    array = np.ascontiguousarray(array)
    if array.dtype.kind not in _PLAIN_KINDS:
        return Array(array)  # Flower's own (an object array it refuses, as it always did)
    shape = tuple(int(n) for n in array.shape)
    data = b"".join((npy_header(array.dtype, shape), array.reshape(-1).view(np.uint8)))
    return Array(dtype=str(array.dtype), shape=shape, stype=SType.NUMPY, data=data)


def _view(array: Array) -> Optional[np.ndarray]:
    """The Array's data as a read-only view where it is np.save's bytes of its dtype and shape, else None."""
    try:
        dtype = np.dtype(array.dtype)
        shape = tuple(int(n) for n in array.shape)
    except (TypeError, ValueError):
        return None  # not a dtype or shape this can check: np.load reads the header itself
    if array.stype != SType.NUMPY or dtype.kind not in _PLAIN_KINDS or min(shape, default=0) < 0:
        return None
    data = array.data
    header_length = len(data) - dtype.itemsize * math.prod(shape)
    # The length first: a claimed shape the data cannot hold never gets a header made for it.
    if not 0 < header_length <= _MAX_HEADER_BYTES:
        return None
    header = npy_header(dtype, shape)
    if len(header) != header_length or data[:header_length] != header:
        return None
    return np.frombuffer(data, dtype, offset=header_length).reshape(shape)


def to_numpy(array: Array) -> np.ndarray:
    """`array.numpy()`'s values: a read-only view of the Array's data where its header is the one np.save
    writes for its dtype and shape, else np.load's copy (and its errors)."""
    view = _view(array)
    return array.numpy() if view is None else view


def to_array_record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = to_array(array)
    return record


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {name: to_numpy(array) for name, array in record.items()}


__all__ = ["from_array_record", "npy_header", "to_array", "to_array_record", "to_numpy"]
