"""The objects a .pte's Program flatbuffer parses into (names follow executorch's program.fbs), and the
reader's error classes. Built by vktrain.serialization.pte (which re-exports every name); numpy only."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

from vktrain.serialization.pte_schema.executorch_flatbuffer.ScalarType import ScalarType
from vktrain.errors import VktrainError

# Bytes per element of each ScalarType (executorch/runtime/core/portable_type/scalar_type.h).
_ELEMENT_SIZE = {
    ScalarType.BYTE: 1, ScalarType.CHAR: 1, ScalarType.SHORT: 2, ScalarType.INT: 4, ScalarType.LONG: 8,
    ScalarType.HALF: 2, ScalarType.FLOAT: 4, ScalarType.DOUBLE: 8, ScalarType.BOOL: 1, ScalarType.QINT8: 1,
    ScalarType.QUINT8: 1, ScalarType.QINT32: 4, ScalarType.BFLOAT16: 2, ScalarType.QUINT4X2: 1,
    ScalarType.QUINT2X4: 1, ScalarType.BITS16: 2, ScalarType.FLOAT8E5M2: 1, ScalarType.FLOAT8E4M3FN: 1,
    ScalarType.FLOAT8E5M2FNUZ: 1, ScalarType.FLOAT8E4M3FNUZ: 1, ScalarType.UINT16: 2, ScalarType.UINT32: 4,
    ScalarType.UINT64: 8,
}
SCALAR_TYPE_NAMES = {value: name for name, value in vars(ScalarType).items() if not name.startswith("_")}
# The ScalarTypes vktrain's runtime reads, as numpy dtypes.
NUMPY_SCALAR_TYPES = {
    ScalarType.BYTE: np.uint8, ScalarType.CHAR: np.int8, ScalarType.SHORT: np.int16, ScalarType.INT: np.int32,
    ScalarType.LONG: np.int64, ScalarType.HALF: np.float16, ScalarType.FLOAT: np.float32,
    ScalarType.DOUBLE: np.float64, ScalarType.BOOL: np.bool_, ScalarType.UINT32: np.uint32,
}


class PteFormatError(VktrainError, ValueError):
    """The file is not a readable .pte: truncated, corrupt, or of an unsupported schema version."""


class MissingMethodError(PteFormatError, KeyError):
    """The .pte has no execution plan of the requested name."""

    def __str__(self) -> str:  # KeyError would show the message in quotes
        return str(self.args[0])


# ---------------------------------------------------------------------------------------------------
# Parsed program objects (names follow program.fbs)
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PteHeader:
    file_identifier: bytes
    has_extended_header: bool
    program_size: int  # bytes of the Program flatbuffer (the whole file when there is no extended header)
    segment_base_offset: int  # 0 when there are no segments
    segment_data_size: int  # 0 when absent


@dataclass(frozen=True)
class AllocationDetails:
    memory_id: int
    memory_offset: int  # the 64-bit offset (low | high << 32)


@dataclass(frozen=True)
class ExtraTensorInfo:
    mutable_data_segments_idx: int
    fully_qualified_name: Optional[str]
    location: int  # TensorDataLocation: 0 SEGMENT, 1 EXTERNAL


@dataclass(frozen=True)
class Tensor:
    scalar_type: int
    storage_offset: int
    sizes: tuple[int, ...]
    dim_order: tuple[int, ...]
    requires_grad: bool
    data_buffer_idx: int
    allocation_info: Optional[AllocationDetails]
    layout: int
    shape_dynamism: int
    extra_tensor_info: Optional[ExtraTensorInfo]

    @property
    def scalar_type_name(self) -> str:
        return SCALAR_TYPE_NAMES.get(self.scalar_type, f"UNKNOWN({self.scalar_type})")

    @property
    def nbytes(self) -> int:
        size = _ELEMENT_SIZE.get(self.scalar_type)
        if size is None:
            raise PteFormatError(f"tensor has scalar type {self.scalar_type_name} of unknown element size")
        if any(d < 0 for d in self.sizes):
            raise PteFormatError(f"tensor has a negative dimension in sizes {list(self.sizes)}")
        return math.prod(self.sizes) * size

    @property
    def is_constant(self) -> bool:
        return self.data_buffer_idx > 0 and self.allocation_info is None


@dataclass(frozen=True)
class Null:
    pass


@dataclass(frozen=True)
class Int:
    int_val: int


@dataclass(frozen=True)
class Bool:
    bool_val: bool


@dataclass(frozen=True)
class Double:
    double_val: float


@dataclass(frozen=True)
class String:
    string_val: str


@dataclass(frozen=True)
class IntList:
    items: tuple[int, ...]


@dataclass(frozen=True)
class DoubleList:
    items: tuple[float, ...]


@dataclass(frozen=True)
class BoolList:
    items: tuple[bool, ...]


@dataclass(frozen=True)
class TensorList:
    items: tuple[int, ...]  # value indices


@dataclass(frozen=True)
class OptionalTensorList:
    items: tuple[int, ...]  # value indices, -1 = None


EValue = Union[Null, Int, Bool, Double, String, Tensor, IntList, DoubleList, BoolList, TensorList,
               OptionalTensorList]


@dataclass(frozen=True)
class Operator:
    name: str  # e.g. "aten::add"
    overload: str  # e.g. "out"

    @property
    def qualified_name(self) -> str:
        return f"{self.name}.{self.overload}" if self.overload else self.name


@dataclass(frozen=True)
class KernelCall:
    op_index: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class DelegateCall:
    delegate_index: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class MoveCall:
    move_from: int
    move_to: int


@dataclass(frozen=True)
class JumpFalseCall:
    cond_value_index: int
    destination_instruction: int


@dataclass(frozen=True)
class FreeCall:
    value_index: int


Instruction = Union[KernelCall, DelegateCall, MoveCall, JumpFalseCall, FreeCall]


@dataclass(frozen=True)
class Chain:
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    instructions: tuple  # tuple[Instruction, ...]


@dataclass(frozen=True)
class Delegate:
    id: str  # backend id, e.g. "VulkanBackend"
    location: int  # DataLocation: 0 INLINE (Program.backend_delegate_data), 1 SEGMENT (Program.segments)
    index: int  # index into the list `location` names
    data: memoryview = field(repr=False)  # the processed blob, zero-copy
    compile_specs: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class DataSegment:
    offset: int  # relative to the segment base offset
    size: int


@dataclass(frozen=True)
class ExecutionPlan:
    name: str
    values: tuple  # tuple[EValue, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    chains: tuple  # tuple[Chain, ...]
    operators: tuple  # tuple[Operator, ...]
    delegates: tuple  # tuple[Delegate, ...]
    non_const_buffer_sizes: tuple[int, ...]
    container_meta: Optional[tuple[str, str]]  # (encoded_inp_str, encoded_out_str)

    @property
    def instructions(self) -> list:
        """All instructions of all chains, in order (programs have one chain today)."""
        return [instruction for chain in self.chains for instruction in chain.instructions]
