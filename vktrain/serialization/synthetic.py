"""BENCHMARK ONLY: synthetic constants, generated when a blob is loaded instead of stored in it, so that a
1B-parameter graph travels as megabytes. A record (random bits / normal / fill, seed, dtype, shape) that
`materialize()` turns into the same array on every reader. Synthetic data is not a model."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from vktrain import quant
from vktrain.serialization.tensor_types import DType, GraphError, Layout, store_as_tuple


class SyntheticKind(enum.IntEnum):
    """How a synthetic constant is generated; values equal schema.fbs `SyntheticKind`."""

    RANDOM_BITS = 0
    NORMAL = 1
    FILL = 2


# Integer dtypes whose every bit pattern is a valid value (so random bits are meaningful data).
_RANDOM_BITS_DTYPES = (DType.UINT8, DType.UINT32, DType.INT8, DType.INT32)
_FLOAT_DTYPES = (DType.FLOAT32, DType.FLOAT16)
_UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class SyntheticConstant:
    """BENCHMARK ONLY: a constant generated when it is loaded instead of stored in the blob.

    The recipe, exact so that every reader builds the same bytes from the same record:
      rng = numpy.random.default_rng(seed)   (PCG64)
      RANDOM_BITS: rng.bytes(nbytes), read as `dtype` (little-endian) in `shape`; for a q4gsw layout
                   (`layout` Q4GSW_FLAT / Q4GSW_W4X8 with `q4gsw_shape` = logical weight [N, K]) the
                   padding codes (n >= N, k >= K) are then reset to 8 through vktrain.quant, since
                   docs/spec/w4x8.md requires them to decode to zero;
      NORMAL:      rng.standard_normal(numel, dtype=float32) * float32(std), cast to `dtype`;
      FILL:        every element equals `value` (no RNG).
    """

    kind: SyntheticKind
    seed: int
    dtype: DType
    shape: tuple[int, ...]
    std: float = 0.0  # NORMAL
    value: float = 0.0  # FILL
    layout: Layout = Layout.PLAIN  # RANDOM_BITS over q4gsw codes: the stored layout
    q4gsw_shape: tuple[int, ...] = ()  # ... and the logical weight [N, K]

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", SyntheticKind(self.kind))
            object.__setattr__(self, "dtype", DType(self.dtype))
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError as exc:
            raise GraphError(f"synthetic constant: {exc}; expected one of {[m.name for m in SyntheticKind]} / "
                             f"{[m.name for m in DType]} / {[m.name for m in Layout]}") from None
        store_as_tuple(self, "shape", int)
        store_as_tuple(self, "q4gsw_shape", int)
        object.__setattr__(self, "std", float(self.std))
        object.__setattr__(self, "value", float(self.value))
        self._check()

    def _check(self) -> None:
        what = f"synthetic {self.kind.name} constant {self.dtype.name}{list(self.shape)}"
        if not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed <= _UINT64_MAX):
            raise GraphError(f"{what}: seed {self.seed!r} must be an integer in [0, 2**64)")
        if any(d < 0 for d in self.shape):
            raise GraphError(f"{what}: negative dimension in shape")
        if self.kind == SyntheticKind.RANDOM_BITS and self.dtype not in _RANDOM_BITS_DTYPES:
            raise GraphError(f"{what}: random bits need an integer dtype whose every bit pattern is valid, one of "
                             f"{[d.name for d in _RANDOM_BITS_DTYPES]}")
        if self.kind == SyntheticKind.NORMAL:
            if self.dtype not in _FLOAT_DTYPES:
                raise GraphError(f"{what}: a normal distribution needs a float dtype, one of "
                                 f"{[d.name for d in _FLOAT_DTYPES]}")
            if not (math.isfinite(self.std) and self.std >= 0):
                raise GraphError(f"{what}: std {self.std} must be finite and >= 0")
        if self.kind == SyntheticKind.FILL:
            self._check_fill_value(what)
        if self.layout != Layout.PLAIN:
            if self.kind != SyntheticKind.RANDOM_BITS:
                raise GraphError(f"{what}: layout {self.layout.name} is only meaningful for RANDOM_BITS q4gsw codes")
            self._check_q4gsw(what)
        elif self.q4gsw_shape:
            raise GraphError(f"{what}: q4gsw_shape {list(self.q4gsw_shape)} given but layout is PLAIN")

    def _check_fill_value(self, what: str) -> None:
        value = self.value
        if not math.isfinite(value):
            raise GraphError(f"{what}: fill value {value} must be finite")
        if self.dtype in _FLOAT_DTYPES:
            if abs(value) > float(np.finfo(self.dtype.numpy_dtype).max):
                raise GraphError(f"{what}: fill value {value} overflows {self.dtype.name}")
            return
        if self.dtype == DType.BOOL:
            allowed = value in (0.0, 1.0)
            bounds = "0 or 1"
        else:
            info = np.iinfo(self.dtype.numpy_dtype)
            allowed = value.is_integer() and info.min <= value <= info.max
            bounds = f"an integer in [{info.min}, {info.max}]"
        if not allowed:
            raise GraphError(f"{what}: fill value {value} is not representable; expected {bounds}")

    def _check_q4gsw(self, what: str) -> None:
        if len(self.q4gsw_shape) != 2 or min(self.q4gsw_shape) <= 0:
            raise GraphError(f"{what}: layout {self.layout.name} needs q4gsw_shape = the logical weight [N, K] "
                             f"(positive), got {list(self.q4gsw_shape)}")
        N, K = self.q4gsw_shape
        if self.layout == Layout.Q4GSW_FLAT:
            expected = (DType.UINT8, (N, quant.padded_k(K) // 2))
        else:
            try:
                expected = (DType.UINT32, (quant.w4x8_num_words(N, K),))
            except ValueError as exc:
                raise GraphError(f"{what}: {exc}") from None
        if (self.dtype, self.shape) != expected:
            raise GraphError(f"{what}: a {self.layout.name} weight [N={N}, K={K}] is stored as "
                             f"{expected[0].name}{list(expected[1])}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def materialize(self) -> np.ndarray:
        """The generated array (a new one on every call): `dtype`, `shape`, C-contiguous."""
        dtype = self.dtype.numpy_dtype
        if self.kind == SyntheticKind.FILL:
            return np.full(self.shape, self.value, dtype=dtype)
        rng = np.random.default_rng(self.seed)
        if self.kind == SyntheticKind.NORMAL:
            data = rng.standard_normal(self.numel, dtype=np.float32)
            data *= np.float32(self.std)
            return data.astype(dtype, copy=False).reshape(self.shape)
        data = np.frombuffer(rng.bytes(self.nbytes), dtype=dtype).reshape(self.shape)
        if self.layout != Layout.PLAIN and self._has_q4gsw_padding():
            data = self._reset_q4gsw_padding(data)
        return data

    def _has_q4gsw_padding(self) -> bool:
        N, K = self.q4gsw_shape
        if quant.padded_k(K) != K:
            return True
        # W_4X8 blocks cover 8 rows: rows N..8*ceil(N/8) are padding.
        return self.layout == Layout.Q4GSW_W4X8 and N % 8 != 0

    def _reset_q4gsw_padding(self, data: np.ndarray) -> np.ndarray:
        """Random codes with every padding code set to 8, through vktrain.quant's own layouts: unpacking
        drops the padding, packing writes it back as code 8."""
        N, K = self.q4gsw_shape
        flat = quant.unpack_w4x8(data, N, K) if self.layout == Layout.Q4GSW_W4X8 else data
        flat = quant.pack_flat(quant.unpack_flat(flat, K))
        return quant.pack_w4x8(flat, K) if self.layout == Layout.Q4GSW_W4X8 else flat


def check_synthetic_reader(constant: SyntheticConstant, dtype: DType, shape: tuple[int, ...], where: str) -> None:
    """A synthetic constant is generated for one dtype and shape; a tensor may not reinterpret it."""
    if (constant.dtype, constant.shape) != (dtype, tuple(shape)):
        raise GraphError(f"{where} is {dtype.name}{list(shape)} but reads a synthetic constant generated as "
                         f"{constant.dtype.name}{list(constant.shape)}; they must match exactly")
