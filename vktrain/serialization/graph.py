"""The in-memory delegate graph: plain dataclasses mirroring schema.fbs.

The backend builds a `VkGraph`; `blob.serialize_blob` writes it, `blob.deserialize_blob` reads it back
and the runtime executes it. Value ids, constant ids and memory object ids are indices/ids exactly as
stored in the blob. `VkGraph.validate()` checks every cross reference, so a malformed graph is refused
when it is written (and when it is read), not when a GPU kernel reads garbage.

A constant is either bytes (stored in the blob) or, for benchmarks only, a `SyntheticConstant`
(synthetic.py). Element types and layouts live in tensor_types.py; both are re-exported here, so
`graph.DType`, `graph.SyntheticConstant`, ... name the one definition.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

# SyntheticKind and the tensor types are re-exported: `graph.X` names the one definition.
from vktrain.serialization.synthetic import SyntheticConstant, SyntheticKind, check_synthetic_reader  # noqa: F401
from vktrain.serialization.narrow_constant import (NARROW_DTYPES, ConstantEncoding, NarrowConstant,  # noqa: F401
                                                   narrow_losslessly, stored_constant)
from vktrain.serialization.tensor_types import LAYOUT_STORAGE, DType, GraphError, Layout, store_as_tuple

from vktrain.contract import METADATA_PLANNED_MEMORY_BYTES, METADATA_SOURCE_MODEL  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class TensorValue:
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout = Layout.PLAIN
    constant_id: int = -1  # index into VkGraph.constants; -1 = not a constant
    mem_obj_id: int = -1  # id of a VkGraph.memory_objects entry; -1 = own allocation
    name: str = ""  # optional, for diagnostics
    # The final storage (decided by vktrain/backend/passes, see schema.fbs `Tensor`):
    mem_offset: int = 0  # byte offset inside memory object `mem_obj_id`
    storage_of: int = -1  # value id whose storage this tensor uses (a view or an in-place output); -1 = own
    is_view: bool = False  # no op writes it: its bytes are `storage_of`'s, read through the view below
    view_strides: tuple[int, ...] = ()  # element strides of the view; () = contiguous
    view_offset: int = 0  # element offset of that view
    stored_dtype: DType | None = None  # element type of the stored bytes; None = `dtype`

    def __post_init__(self):
        # Normalise so that equality does not depend on list vs tuple or numpy ints.
        try:
            object.__setattr__(self, "dtype", DType(self.dtype))
            object.__setattr__(self, "layout", Layout(self.layout))
            if self.stored_dtype is not None:
                object.__setattr__(self, "stored_dtype", DType(self.stored_dtype))
        except ValueError as exc:
            raise GraphError(f"tensor {self.name or 'unnamed'}: {exc}; expected one of "
                             f"{[m.name for m in DType]} / {[m.name for m in Layout]}") from None
        store_as_tuple(self, "shape", int)
        store_as_tuple(self, "view_strides", int)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def storage_dtype(self) -> DType:
        """The element type of the bytes as stored (on the GPU)."""
        return self.dtype if self.stored_dtype is None else self.stored_dtype

    @property
    def stored_nbytes(self) -> int:
        return self.numel * self.storage_dtype.itemsize


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
        store_as_tuple(self, "items", int)


@dataclass(frozen=True)
class DoubleListValue:
    items: tuple[float, ...]

    def __post_init__(self):
        store_as_tuple(self, "items", float)


@dataclass(frozen=True)
class BoolListValue:
    items: tuple[bool, ...]

    def __post_init__(self):
        store_as_tuple(self, "items", bool)


@dataclass(frozen=True)
class ValueListValue:
    """A list of other values, by value id (e.g. the tensors of a list argument)."""

    items: tuple[int, ...]

    def __post_init__(self):
        store_as_tuple(self, "items", int)


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
        store_as_tuple(self, "args", int)
        store_as_tuple(self, "outputs", int)


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


# Anything exposing its bytes through the buffer protocol; numpy arrays must be C-contiguous or they
# are copied once when serialised. A SyntheticConstant is generated instead of stored; a NarrowConstant
# is stored in fewer bytes (2-byte elements or GGUF Q8_0 blocks) and read as the float32 array it widens to.
ConstantData = Union[bytes, bytearray, memoryview, np.ndarray, SyntheticConstant, NarrowConstant]


def constant_nbytes(data: ConstantData) -> int:
    """Size of one constant in bytes as its tensors read it, without generating a synthetic one or
    widening a narrow one."""
    if isinstance(data, (SyntheticConstant, NarrowConstant)):
        return data.nbytes
    return constant_bytes(data).nbytes


def stored_bytes(data: ConstantData) -> memoryview:
    """The bytes of one constant as the blob stores them: a NarrowConstant's narrow form, any other
    constant's own bytes (constant_bytes)."""
    return data.stored_bytes if isinstance(data, NarrowConstant) else constant_bytes(data)


def same_stored_bytes(a: ConstantData, b: ConstantData) -> bool:
    """Whether two constants store the same bytes (stored_bytes equal): how a method's constant is found to be
    another method's (the frozen base the eval method binds: program_sharing.py, GraphExecutor.constants_matching).
    Decided without generating synthetic constants where their records settle it (the recipe is exact: equal
    records, or FILLs of one value, dtype and shape, give equal bytes) and without reading two views of the same
    memory (the .pte's named data both methods refer to)."""
    if a is b:
        return True
    if isinstance(a, SyntheticConstant) and isinstance(b, SyntheticConstant) and \
            _synthetic_content(a) == _synthetic_content(b):
        return True
    mine, other = np.frombuffer(stored_bytes(a), np.uint8), np.frombuffer(stored_bytes(b), np.uint8)
    if mine.size != other.size:
        return False
    if mine.size and mine.__array_interface__["data"][0] == other.__array_interface__["data"][0]:
        return True
    return bool(np.array_equal(mine, other))


def _synthetic_content(constant: SyntheticConstant) -> tuple:
    """What a synthetic constant's bytes depend on: the whole record, but a FILL's seed (it draws nothing)."""
    fields = tuple(getattr(constant, name) for name in constant.__dataclass_fields__)
    if constant.kind == SyntheticKind.FILL:
        return tuple(value for name, value in zip(constant.__dataclass_fields__, fields) if name != "seed")
    return fields


def constant_bytes(data: ConstantData) -> memoryview:
    """A flat byte view of one constant (no copy unless a numpy array is not C-contiguous).

    A SyntheticConstant is generated here, a NarrowConstant widened (a new buffer on every call; the
    costly path for big ones)."""
    if isinstance(data, SyntheticConstant):
        data = data.materialize()
    elif isinstance(data, NarrowConstant):
        data = data.widen()
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
    raise GraphError(f"constant of type {type(data).__name__} is not bytes, bytearray, memoryview, numpy array, "
                     f"SyntheticConstant or NarrowConstant")


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
    # Schedules planned at export per target profile and the shader modules they run (embedded.py
    # EmbeddedSchedule / ShaderModule); empty: the runtime plans at load. Not part of graph_digest.
    schedules: list = field(default_factory=list)
    shader_modules: list = field(default_factory=list)

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
        if not isinstance(data, (SyntheticConstant, NarrowConstant)):
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

    def used_tensor_ids(self) -> list[int]:
        """The tensor values the graph uses, ascending: inputs, outputs, state and state updates, every op's
        arguments (a tensor list's items) and outputs, and the storage those use. A value no op reads or
        writes any more (left by a pass that dropped or rewrote its op) takes no device memory."""
        used = set(self.inputs) | set(self.outputs) | {s.state_id for s in self.mutable_state}
        used |= {s.update_id for s in self.mutable_state}
        for op in self.ops:
            for value_id in op.args + op.outputs:
                value = self.values[value_id]
                used |= set(value.items) if isinstance(value, ValueListValue) else {value_id}
        used |= {self.values[v].storage_of for v in used if isinstance(self.values[v], TensorValue)
                 and self.values[v].storage_of >= 0}
        return sorted(v for v in used if isinstance(self.values[v], TensorValue))

    def constant_array(self, value_id: int) -> np.ndarray:
        """The constant data of tensor `value_id` as a numpy array of its dtype and shape (a view, no copy;
        a synthetic constant is generated: a new array on every call)."""
        tensor = self.tensor(value_id)
        if tensor.constant_id < 0:
            raise GraphError(f"tensor value {value_id} ({tensor.name or 'unnamed'}) is not a constant")
        constant = self.constants[tensor.constant_id]
        if isinstance(constant, SyntheticConstant):
            check_synthetic_reader(constant, tensor.dtype, tensor.shape, f"tensor value {value_id}")
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
                    check_synthetic_reader(initial, target.dtype, target.shape, where)
                if isinstance(initial, NarrowConstant):
                    _check_narrow_reader(target.dtype, target.layout, where)
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
        storage = LAYOUT_STORAGE.get(tensor.layout)
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
                check_synthetic_reader(constant, tensor.dtype, tensor.shape, f"{where} ({tensor.name or 'unnamed'})")
            if isinstance(constant, NarrowConstant):
                _check_narrow_reader(tensor.dtype, tensor.layout, f"{where} ({tensor.name or 'unnamed'})")
            size = constant_sizes[tensor.constant_id]
            if size != tensor.nbytes:
                raise GraphError(f"{where} ({tensor.name or 'unnamed'}): constant {tensor.constant_id} "
                                 f"has {size} bytes, "
                                 f"but {tensor.dtype.name}{list(tensor.shape)} needs {tensor.nbytes}")
        if tensor.mem_obj_id != -1:
            if tensor.mem_obj_id not in memory_sizes:
                raise GraphError(f"{where} has mem_obj_id {tensor.mem_obj_id}, which no memory object has")
            end = tensor.mem_offset + tensor.stored_nbytes
            if tensor.mem_offset < 0 or end > memory_sizes[tensor.mem_obj_id]:
                raise GraphError(f"{where} occupies bytes [{tensor.mem_offset}, {end}) of memory object "
                                 f"{tensor.mem_obj_id}, which has {memory_sizes[tensor.mem_obj_id]}")
        if tensor.storage_of != -1:
            source = self._value(tensor.storage_of, f"{where} storage_of")
            if not isinstance(source, TensorValue) or source.storage_of != -1:
                raise GraphError(f"{where} uses the storage of value {tensor.storage_of}, which must be a tensor with "
                                 f"storage of its own")
            if source.stored_nbytes != tensor.stored_nbytes or source.storage_dtype != tensor.storage_dtype:
                raise GraphError(f"{where} ({tensor.storage_dtype.name}, {tensor.stored_nbytes} bytes) cannot use the "
                                 f"storage of value {tensor.storage_of} ({source.storage_dtype.name}, "
                                 f"{source.stored_nbytes} bytes): it must have the same stored bytes")
        elif tensor.is_view:
            raise GraphError(f"{where} is a view but has no storage_of")
        if tensor.view_strides and (not tensor.is_view or len(tensor.view_strides) != len(tensor.shape)):
            raise GraphError(f"{where} has view strides {list(tensor.view_strides)}: strides belong to a view and "
                             f"need one per dim of shape {list(tensor.shape)}")


def _check_narrow_reader(dtype: DType, layout: Layout, where: str) -> None:
    if (dtype, layout) != (DType.FLOAT32, Layout.PLAIN):
        raise GraphError(f"{where} is {dtype.name} ({layout.name}) but reads a narrow constant (stored as "
                         f"float16/bfloat16/GGUF Q8_0), which only PLAIN FLOAT32 tensors may read")


def decode_scalar(value: Value) -> Any:
    """A non-tensor graph value as the Python value a plan function or pass takes."""
    if isinstance(value, NullValue):
        return None
    if isinstance(value, (IntValue, DoubleValue, BoolValue, StringValue)):
        return value.value
    if isinstance(value, (IntListValue, DoubleListValue, BoolListValue)):
        return tuple(value.items)
    raise GraphError(f"value of type {type(value).__name__} is not a scalar argument")
