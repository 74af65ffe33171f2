"""The in-memory delegate graph: plain dataclasses mirroring schema.fbs.

The backend builds a `VkGraph`; `blob.serialize_blob` writes it, `blob.deserialize_blob` reads it back
and the runtime executes it. Value ids, constant ids and memory object ids are indices/ids exactly as
stored in the blob. `VkGraph.validate()` checks every cross reference, so a malformed graph is refused
when it is written (and when it is read), not when a GPU kernel reads garbage.

A constant is either bytes (stored in the blob) or, for benchmarks only, a `SyntheticConstant`: a
recipe (random bits / normal / fill, seed, dtype, shape) that `materialize()` turns into the same array
on every reader, so a 1B-parameter graph travels as megabytes. Synthetic data is not a model.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Union

import numpy as np

from vktrain import quant
from vktrain.opdefs.dtypes import DTYPES
from vktrain.errors import VktrainError

from vktrain.contract import METADATA_PLANNED_MEMORY_BYTES, METADATA_SOURCE_MODEL  # noqa: F401  (re-exported)


class GraphError(VktrainError, ValueError):
    """A VkGraph is inconsistent (dangling id, wrong constant size, bad layout...)."""


def _store_as_tuple(record, field_name: str, element_type) -> None:
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

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_NUMPY_DTYPES[self]).newbyteorder("<")

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


_NUMPY_DTYPES = {DType(d.blob_code): d.name for d in DTYPES}  # vktrain/opdefs/dtypes.py: the one table


class Layout(enum.IntEnum):
    """How a tensor's stored bytes are arranged; values equal schema.fbs `TensorLayout`.

    dtype and shape always describe the stored buffer; the layout says how to interpret it
    (docs/spec/w4x8.md): Q4GSW_FLAT is uint8 [N, Kp/2], Q4GSW_W4X8 is uint32 [K4 * N8 * 4].
    """

    PLAIN = 0
    Q4GSW_FLAT = 1
    Q4GSW_W4X8 = 2


# The dtype and rank a packed layout's stored buffer must have.
_LAYOUT_STORAGE = {Layout.Q4GSW_FLAT: (DType.UINT8, 2), Layout.Q4GSW_W4X8: (DType.UINT32, 1)}


@dataclass(frozen=True)
class TensorValue:
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout = Layout.PLAIN
    constant_id: int = -1  # index into VkGraph.constants; -1 = not a constant
    mem_obj_id: int = -1  # id of a VkGraph.memory_objects entry; -1 = own allocation
    name: str = ""  # optional, for diagnostics

    def __post_init__(self):
        # Normalise so that equality does not depend on list vs tuple or numpy ints.
        try:
            object.__setattr__(self, "dtype", DType(self.dtype))
            object.__setattr__(self, "layout", Layout(self.layout))
        except ValueError as exc:
            raise GraphError(f"tensor {self.name or 'unnamed'}: {exc}; expected one of "
                             f"{[m.name for m in DType]} / {[m.name for m in Layout]}") from None
        _store_as_tuple(self, "shape", int)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class NullValue:
    pass


@dataclass(frozen=True)
class IntValue:
    value: int


@dataclass(frozen=True)
class DoubleValue:
    value: float


@dataclass(frozen=True)
class BoolValue:
    value: bool


@dataclass(frozen=True)
class StringValue:
    value: str


@dataclass(frozen=True)
class IntListValue:
    items: tuple[int, ...]

    def __post_init__(self):
        _store_as_tuple(self, "items", int)


@dataclass(frozen=True)
class DoubleListValue:
    items: tuple[float, ...]

    def __post_init__(self):
        _store_as_tuple(self, "items", float)


@dataclass(frozen=True)
class BoolListValue:
    items: tuple[bool, ...]

    def __post_init__(self):
        _store_as_tuple(self, "items", bool)


@dataclass(frozen=True)
class ValueListValue:
    """A list of other values, by value id (e.g. the tensors of a list argument)."""

    items: tuple[int, ...]

    def __post_init__(self):
        _store_as_tuple(self, "items", int)


Value = Union[NullValue, IntValue, DoubleValue, BoolValue, StringValue, TensorValue, IntListValue,
              DoubleListValue, BoolListValue, ValueListValue]
VALUE_TYPES = (NullValue, IntValue, DoubleValue, BoolValue, StringValue, TensorValue, IntListValue,
               DoubleListValue, BoolListValue, ValueListValue)


@dataclass(frozen=True)
class OpCall:
    """One op of the chain: `name` (e.g. "vktrain.linear_q4gsw.default") applied to value ids."""

    name: str
    args: tuple[int, ...]
    outputs: tuple[int, ...]

    def __post_init__(self):
        _store_as_tuple(self, "args", int)
        _store_as_tuple(self, "outputs", int)


@dataclass(frozen=True)
class MutableState:
    """State that persists across executions: after each run, `state_id` takes `update_id`'s contents."""

    state_id: int
    update_id: int
    initial_constant_id: int = -1  # -1 = starts zero-filled


@dataclass(frozen=True)
class MemoryObject:
    """A planned allocation shared by tensors whose lifetimes do not overlap."""

    id: int
    size_bytes: int


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
        _store_as_tuple(self, "shape", int)
        _store_as_tuple(self, "q4gsw_shape", int)
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


# Anything exposing its bytes through the buffer protocol; numpy arrays must be C-contiguous or they
# are copied once when serialised. A SyntheticConstant is generated instead of stored.
ConstantData = Union[bytes, bytearray, memoryview, np.ndarray, SyntheticConstant]


def constant_nbytes(data: ConstantData) -> int:
    """Size of one constant in bytes, without generating a synthetic one."""
    if isinstance(data, SyntheticConstant):
        return data.nbytes
    return constant_bytes(data).nbytes


def constant_bytes(data: ConstantData) -> memoryview:
    """A flat byte view of one constant (no copy unless a numpy array is not C-contiguous).

    A SyntheticConstant is generated here (a new buffer on every call; the costly path for big ones)."""
    if isinstance(data, SyntheticConstant):
        data = data.materialize()
    if isinstance(data, np.ndarray):
        if data.dtype.byteorder == ">":
            raise GraphError(f"constant has big-endian dtype {data.dtype}; the blob is little-endian")
        data = np.ascontiguousarray(data)
        return memoryview(data.reshape(-1).view(np.uint8))
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        if not view.c_contiguous:
            raise GraphError("constant memoryview is not contiguous")
        return view.cast("B") if view.format != "B" or view.ndim != 1 else view
    raise GraphError(f"constant of type {type(data).__name__} is not bytes, bytearray, memoryview, numpy array "
                     f"or SyntheticConstant")


@dataclass
class VkGraph:
    """A delegate graph: values (tensors and scalars, by id), the op chain, I/O, state, constants."""

    values: list[Value] = field(default_factory=list)  # a value's id is its index
    ops: list[OpCall] = field(default_factory=list)  # executed in order
    inputs: list[int] = field(default_factory=list)  # value ids supplied by the caller, in order
    outputs: list[int] = field(default_factory=list)  # value ids returned to the caller, in order
    mutable_state: list[MutableState] = field(default_factory=list)
    constants: list[ConstantData] = field(default_factory=list)  # a constant's id is its index
    memory_objects: list[MemoryObject] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)

    # -- building -------------------------------------------------------------------------------
    def add_value(self, value) -> int:
        """Append a value; return its id."""
        if not isinstance(value, VALUE_TYPES):
            raise GraphError(f"value of type {type(value).__name__} is not one of {[t.__name__ for t in VALUE_TYPES]}")
        self.values.append(value)
        return len(self.values) - 1

    def add_constant(self, data: ConstantData) -> int:
        """Append constant data (or a SyntheticConstant); return its constant id. (Identical bytes are
        stored once in the blob.)"""
        if not isinstance(data, SyntheticConstant):
            constant_bytes(data)  # refuse unusable data now, not at serialisation
        self.constants.append(data)
        return len(self.constants) - 1

    def add_constant_tensor(self, array: np.ndarray, layout: Layout = Layout.PLAIN, name: str = "") -> int:
        """Add a numpy array as a constant tensor value (dtype/shape from the array); return the value id."""
        array = np.asarray(array)
        dtype = DType.from_numpy(array.dtype)  # before add_constant, so a refusal leaves no orphan constant
        constant_id = self.add_constant(array)
        return self.add_value(TensorValue(dtype, array.shape, layout, constant_id, -1, name))

    def add_synthetic_tensor(self, synthetic: SyntheticConstant, name: str = "") -> int:
        """Add a synthetic constant as a tensor value (dtype, shape and layout from the record); return the
        value id."""
        if not isinstance(synthetic, SyntheticConstant):
            raise GraphError(f"expected a SyntheticConstant, got {type(synthetic).__name__}")
        constant_id = self.add_constant(synthetic)
        return self.add_value(TensorValue(synthetic.dtype, synthetic.shape, synthetic.layout, constant_id, -1, name))

    # -- reading --------------------------------------------------------------------------------
    def is_synthetic(self, constant_id: int) -> bool:
        return isinstance(self.constants[constant_id], SyntheticConstant)

    @property
    def synthetic_constant_ids(self) -> list[int]:
        return [i for i, c in enumerate(self.constants) if isinstance(c, SyntheticConstant)]

    def tensor(self, value_id: int) -> TensorValue:
        value = self._value(value_id, "value id")
        if not isinstance(value, TensorValue):
            raise GraphError(f"value {value_id} is {type(value).__name__}, expected TensorValue")
        return value

    def constant_array(self, value_id: int) -> np.ndarray:
        """The constant data of tensor `value_id` as a numpy array of its dtype and shape (a view, no copy;
        a synthetic constant is generated: a new array on every call)."""
        tensor = self.tensor(value_id)
        if tensor.constant_id < 0:
            raise GraphError(f"tensor value {value_id} ({tensor.name or 'unnamed'}) is not a constant")
        constant = self.constants[tensor.constant_id]
        if isinstance(constant, SyntheticConstant):
            _check_synthetic_reader(constant, tensor.dtype, tensor.shape, f"tensor value {value_id}")
            return constant.materialize()
        data = constant_bytes(constant)
        return np.frombuffer(data, dtype=tensor.dtype.numpy_dtype, count=tensor.numel).reshape(tensor.shape)

    def _value(self, value_id: int, what: str):
        if not (isinstance(value_id, (int, np.integer)) and 0 <= value_id < len(self.values)):
            raise GraphError(f"{what} {value_id!r} is out of range: the graph has {len(self.values)} values")
        return self.values[value_id]

    # -- checking -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise GraphError naming the first inconsistency; return None when the graph is well formed."""
        memory_sizes: dict[int, int] = {}
        for index, mem in enumerate(self.memory_objects):
            if not isinstance(mem, MemoryObject):
                raise GraphError(f"memory_objects[{index}] is {type(mem).__name__}, expected MemoryObject")
            if mem.id < 0 or mem.id in memory_sizes:
                raise GraphError(f"memory_objects[{index}] has id {mem.id}: ids must be unique and >= 0")
            if mem.size_bytes < 0:
                raise GraphError(f"memory object {mem.id} has negative size {mem.size_bytes}")
            memory_sizes[mem.id] = mem.size_bytes

        for index, constant in enumerate(self.constants):
            if isinstance(constant, SyntheticConstant):
                constant._check()  # also catches records built with object.__setattr__ / replace()
        constant_sizes = [constant_nbytes(c) for c in self.constants]
        for value_id, value in enumerate(self.values):
            where = f"value {value_id}"
            if not isinstance(value, VALUE_TYPES):
                raise GraphError(f"{where} is {type(value).__name__}, not a graph value type")
            if isinstance(value, TensorValue):
                self._validate_tensor(value, where, constant_sizes, memory_sizes)
            elif isinstance(value, ValueListValue):
                for item in value.items:
                    self._value(item, f"{where} (ValueList) item")

        for op_index, op in enumerate(self.ops):
            if not isinstance(op, OpCall):
                raise GraphError(f"ops[{op_index}] is {type(op).__name__}, expected OpCall")
            if not op.name:
                raise GraphError(f"ops[{op_index}] has an empty name")
            for arg in op.args:
                self._value(arg, f"ops[{op_index}] ({op.name}) argument")
            for out in op.outputs:
                self._value(out, f"ops[{op_index}] ({op.name}) output")

        for name, ids in (("inputs", self.inputs), ("outputs", self.outputs)):
            for value_id in ids:
                self._value(value_id, f"graph {name} entry")

        seen_states = set()
        for index, state in enumerate(self.mutable_state):
            where = f"mutable_state[{index}]"
            if not isinstance(state, MutableState):
                raise GraphError(f"{where} is {type(state).__name__}, expected MutableState")
            target = self._state_tensor(state.state_id, f"{where} state_id")
            update = self._state_tensor(state.update_id, f"{where} update_id")
            if state.state_id in seen_states:
                raise GraphError(f"{where}: value {state.state_id} is listed as mutable state twice")
            seen_states.add(state.state_id)
            if (update.dtype, update.shape) != (target.dtype, target.shape):
                raise GraphError(f"{where}: update value {state.update_id} is {update.dtype.name}{list(update.shape)} "
                                 f"but state value {state.state_id} is {target.dtype.name}{list(target.shape)}")
            if state.initial_constant_id != -1:
                if not 0 <= state.initial_constant_id < len(self.constants):
                    raise GraphError(f"{where}: initial_constant_id {state.initial_constant_id} is out of range "
                                     f"({len(self.constants)} constants)")
                initial = self.constants[state.initial_constant_id]
                if isinstance(initial, SyntheticConstant):
                    _check_synthetic_reader(initial, target.dtype, target.shape, where)
                size = constant_sizes[state.initial_constant_id]
                if size != target.nbytes:
                    raise GraphError(f"{where}: initial constant {state.initial_constant_id} has {size} bytes, "
                                     f"state value {state.state_id} needs {target.nbytes}")

        for key, val in self.metadata.items():
            if not isinstance(key, str) or not isinstance(val, str):
                raise GraphError(f"metadata entry {key!r}: {val!r} must map str to str")

    def _state_tensor(self, value_id: int, what: str) -> TensorValue:
        value = self._value(value_id, what)
        if not isinstance(value, TensorValue):
            raise GraphError(f"{what} {value_id} is {type(value).__name__}, expected TensorValue")
        return value

    def _validate_tensor(self, tensor: TensorValue, where: str, constant_sizes: list[int],
                         memory_sizes: dict[int, int]) -> None:
        if any(d < 0 for d in tensor.shape):
            raise GraphError(f"{where} has negative dimension in shape {list(tensor.shape)}")
        storage = _LAYOUT_STORAGE.get(tensor.layout)
        if storage is not None:
            dtype, rank = storage
            if tensor.dtype != dtype or len(tensor.shape) != rank:
                raise GraphError(f"{where} has layout {tensor.layout.name} with "
                                 f"{tensor.dtype.name}{list(tensor.shape)}; "
                                 f"that layout is stored as rank-{rank} {dtype.name}")
        if tensor.constant_id != -1:
            if not 0 <= tensor.constant_id < len(constant_sizes):
                raise GraphError(f"{where} has constant_id {tensor.constant_id}, out of range "
                                 f"({len(constant_sizes)} constants)")
            constant = self.constants[tensor.constant_id]
            if isinstance(constant, SyntheticConstant):
                _check_synthetic_reader(constant, tensor.dtype, tensor.shape, f"{where} ({tensor.name or 'unnamed'})")
            size = constant_sizes[tensor.constant_id]
            if size != tensor.nbytes:
                raise GraphError(f"{where} ({tensor.name or 'unnamed'}): constant {tensor.constant_id} "
                                 f"has {size} bytes, "
                                 f"but {tensor.dtype.name}{list(tensor.shape)} needs {tensor.nbytes}")
        if tensor.mem_obj_id != -1:
            if tensor.mem_obj_id not in memory_sizes:
                raise GraphError(f"{where} has mem_obj_id {tensor.mem_obj_id}, which no memory object has")
            if tensor.nbytes > memory_sizes[tensor.mem_obj_id]:
                raise GraphError(f"{where} needs {tensor.nbytes} bytes but memory object {tensor.mem_obj_id} "
                                 f"has {memory_sizes[tensor.mem_obj_id]}")


def _check_synthetic_reader(constant: SyntheticConstant, dtype: DType, shape: tuple[int, ...], where: str) -> None:
    """A synthetic constant is generated for one dtype and shape; a tensor may not reinterpret it."""
    if (constant.dtype, constant.shape) != (dtype, tuple(shape)):
        raise GraphError(f"{where} is {dtype.name}{list(shape)} but reads a synthetic constant generated as "
                         f"{constant.dtype.name}{list(constant.shape)}; they must match exactly")
