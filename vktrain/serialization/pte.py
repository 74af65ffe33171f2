"""Read an ExecuTorch .pte file without executorch (flatbuffers + numpy only).

File layout (as written by executorch.exir._serialize._program.serialize_pte_binary):

    offset 0   uint32 root table offset of the Program flatbuffer
    offset 4   4-char file identifier, "ET12" for the schema vendored in vktrain/serialization/pte_schema
    offset 8   optional extended header (present when the file has segments), little-endian:
                 4s "eh00" magic, uint32 header length (>= 24), uint64 program_size (flatbuffer bytes
                 including this header), uint64 segment_base_offset, [uint64 segment_data_size if the
                 length is >= 32]
    then the rest of the Program flatbuffer, padding, and the segment data from segment_base_offset.

Program.segments are (offset, size) relative to segment_base_offset. Delegate payloads live inline
(Program.backend_delegate_data) or in a segment; constant tensors in Program.constant_segment (one
segment, one offset per data_buffer_idx) or, in old files, in Program.constant_buffer.

Everything is parsed eagerly on load and every offset, size and index is bounds-checked: a truncated or
corrupt file raises PteFormatError naming what is wrong. Byte payloads (delegate blobs, constants,
segments, named data) are zero-copy memoryviews into the file's read-only mmap. The parsed objects and
the error classes live in vktrain/serialization/pte_objects.py and are importable from here.
"""
from __future__ import annotations

import mmap
import os
import struct
from typing import Optional, Union

from vktrain.serialization.pte_schema.executorch_flatbuffer import Program as FbProgram
from vktrain.serialization.pte_schema.executorch_flatbuffer.Bool import Bool as FbBool
from vktrain.serialization.pte_schema.executorch_flatbuffer.BoolList import BoolList as FbBoolList
from vktrain.serialization.pte_schema.executorch_flatbuffer.DataLocation import DataLocation
from vktrain.serialization.pte_schema.executorch_flatbuffer.DelegateCall import DelegateCall as FbDelegateCall
from vktrain.serialization.pte_schema.executorch_flatbuffer.Double import Double as FbDouble
from vktrain.serialization.pte_schema.executorch_flatbuffer.DoubleList import DoubleList as FbDoubleList
from vktrain.serialization.pte_schema.executorch_flatbuffer.FreeCall import FreeCall as FbFreeCall
from vktrain.serialization.pte_schema.executorch_flatbuffer.InstructionArguments import InstructionArguments
from vktrain.serialization.pte_schema.executorch_flatbuffer.Int import Int as FbInt
from vktrain.serialization.pte_schema.executorch_flatbuffer.IntList import IntList as FbIntList
from vktrain.serialization.pte_schema.executorch_flatbuffer.JumpFalseCall import JumpFalseCall as FbJumpFalseCall
from vktrain.serialization.pte_schema.executorch_flatbuffer.KernelCall import KernelCall as FbKernelCall
from vktrain.serialization.pte_schema.executorch_flatbuffer.KernelTypes import KernelTypes
from vktrain.serialization.pte_schema.executorch_flatbuffer.MoveCall import MoveCall as FbMoveCall
from vktrain.serialization.pte_schema.executorch_flatbuffer.OptionalTensorList import (
    OptionalTensorList as FbOptionalTensorList,
)
from vktrain.serialization.pte_schema.executorch_flatbuffer.String import String as FbString
from vktrain.serialization.pte_schema.executorch_flatbuffer.Tensor import Tensor as FbTensor
from vktrain.serialization.pte_schema.executorch_flatbuffer.TensorList import TensorList as FbTensorList
from vktrain.serialization.flatbuffer_reading import CORRUPTION_ERRORS, reading, scalar_vector, union_as
from vktrain.serialization.pte_objects import (  # noqa: F401  (re-exported: the reader's public types)
    PteFormatError,
    MissingMethodError,
    NUMPY_SCALAR_TYPES,
    SCALAR_TYPE_NAMES,
    PteHeader,
    AllocationDetails,
    ExtraTensorInfo,
    Tensor,
    Null,
    Int,
    Bool,
    Double,
    String,
    IntList,
    DoubleList,
    BoolList,
    TensorList,
    OptionalTensorList,
    EValue,
    Operator,
    KernelCall,
    DelegateCall,
    MoveCall,
    JumpFalseCall,
    FreeCall,
    Instruction,
    Chain,
    Delegate,
    DataSegment,
    ExecutionPlan,
)

PROGRAM_IDENTIFIER = b"ET12"
EXTENDED_HEADER_MAGIC = b"eh00"
_EXTENDED_HEADER_OFFSET = 8
_EXTENDED_HEADER_MIN_LENGTH = 24  # magic, length, program_size, segment_base_offset
_EXTENDED_HEADER_FULL_LENGTH = 32  # + segment_data_size

# ---------------------------------------------------------------------------------------------------
# Reading helpers
# ---------------------------------------------------------------------------------------------------

def _bytes_vector(table, field_name: str) -> memoryview:
    """A [ubyte] vector as a zero-copy memoryview into the file."""
    if getattr(table, f"{field_name}Length")() == 0:
        return memoryview(b"")
    return memoryview(getattr(table, f"{field_name}AsNumpy")())


def _text(raw) -> Optional[str]:
    return None if raw is None else bytes(raw).decode("utf-8")


def _check_index(index: int, count: int, what: str) -> None:
    if not 0 <= index < count:
        raise PteFormatError(f"{what} {index} is out of range (0..{count - 1})" if count else
                             f"{what} {index} refers to an empty list")


def _read_header(view: memoryview) -> PteHeader:
    size = len(view)
    if size < 8:
        raise PteFormatError(f"file is {size} bytes, too short for a .pte (>= 8 bytes: root offset + identifier)")
    identifier = bytes(view[4:8])
    if identifier != PROGRAM_IDENTIFIER:
        if identifier[:2] == b"ET":
            raise PteFormatError(f".pte schema identifier is {identifier!r}; "
                                 f"this reader supports {PROGRAM_IDENTIFIER!r} "
                                 "(regenerate vktrain/serialization/pte_schema for the other executorch version)")
        raise PteFormatError(f"file identifier is {identifier!r}, expected {PROGRAM_IDENTIFIER!r} (not a .pte file)")
    start = _EXTENDED_HEADER_OFFSET
    if size < start + _EXTENDED_HEADER_MIN_LENGTH or bytes(view[start:start + 4]) != EXTENDED_HEADER_MAGIC:
        return PteHeader(identifier, False, size, 0, 0)
    length, program_size, segment_base = struct.unpack_from("<IQQ", view, start + 4)
    if length < _EXTENDED_HEADER_MIN_LENGTH:
        raise PteFormatError(f"extended header length {length} < {_EXTENDED_HEADER_MIN_LENGTH}")
    if size < start + length:
        raise PteFormatError(f"file ({size} bytes) ends inside the {length}-byte extended header (truncated)")
    segment_data_size = 0
    if length >= _EXTENDED_HEADER_FULL_LENGTH:
        (segment_data_size,) = struct.unpack_from("<Q", view, start + 24)
    if program_size < start + length or program_size > size:
        raise PteFormatError(f"extended header program_size {program_size} is outside [{start + length}, {size}] "
                             f"(file is {size} bytes: truncated?)")
    if segment_base:
        if segment_base < program_size:
            raise PteFormatError(f"segment_base_offset {segment_base} lies inside the program "
                                 f"(program_size {program_size})")
        if segment_base + segment_data_size > size:
            raise PteFormatError(f"segment data [{segment_base}, {segment_base + segment_data_size}) extends past the "
                                 f"end of the {size}-byte file (truncated)")
    elif segment_data_size:
        raise PteFormatError(f"segment_data_size {segment_data_size} with segment_base_offset 0")
    return PteHeader(identifier, True, program_size, segment_base, segment_data_size)


# ---------------------------------------------------------------------------------------------------
# PteFile
# ---------------------------------------------------------------------------------------------------

class PteFile:
    """A parsed .pte. Build with `PteFile.load(path)` (mmap) or `PteFile.from_bytes(data)`.

    Attributes: `header` (PteHeader), `program_version`, `execution_plans` (list[ExecutionPlan]),
    `segments` (list[DataSegment]), `backend_delegate_data` (inline delegate payloads),
    `mutable_data_segments` (list of (segment index, offsets)), `named_data` (key -> bytes view).
    Queries: `execution_plan(name)`, `delegates`, `operators`, `segment_data(i)`, `constant_data(i)`,
    `tensor_data(tensor)`.
    """

    def __init__(self, data, *, source: str = "<bytes>", _mapping: Optional[mmap.mmap] = None):
        self.source = source
        self._mapping = _mapping  # keeps the mmap alive as long as views into it exist
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self._view = view
        try:
            self.header = _read_header(view)
            self._parse_program(view[:self.header.program_size])
        except PteFormatError as exc:
            raise PteFormatError(f"{source}: {exc}") from None
        except CORRUPTION_ERRORS as exc:  # outside every field reading() names: the root table itself
            raise PteFormatError(f"{source}: Program flatbuffer is corrupt or truncated at its root table "
                                 f"({type(exc).__name__}: {exc})") from None

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "PteFile":
        with open(path, "rb") as f:
            try:
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # mmap refuses empty files
                raise PteFormatError(f"{path}: file is empty, not a .pte") from None
        return cls(mapping, source=str(path), _mapping=mapping)

    @classmethod
    def from_bytes(cls, data, source: str = "<bytes>") -> "PteFile":
        return cls(data, source=source)

    # -- public queries -------------------------------------------------------------------------
    @property
    def buffer(self) -> memoryview:
        """The whole file's bytes (the mmap when loaded from a path)."""
        return self._view

    @property
    def method_names(self) -> list[str]:
        return [plan.name for plan in self.execution_plans]

    def execution_plan(self, name: str = "forward") -> ExecutionPlan:
        for plan in self.execution_plans:
            if plan.name == name:
                return plan
        raise MissingMethodError(f"{self.source} has no execution plan {name!r}; it has {self.method_names}")

    @property
    def delegates(self) -> list[Delegate]:
        """Delegates of every execution plan, in plan order."""
        return [delegate for plan in self.execution_plans for delegate in plan.delegates]

    @property
    def operators(self) -> list[Operator]:
        """Operators of every execution plan, in plan order."""
        return [operator for plan in self.execution_plans for operator in plan.operators]

    def segment_data(self, index: int) -> memoryview:
        _check_index(index, len(self.segments), "segment index")
        segment = self.segments[index]
        start = self.header.segment_base_offset + segment.offset
        return self._view[start:start + segment.size]

    def constant_data(self, data_buffer_idx: int) -> memoryview:
        """Bytes of constant buffer `data_buffer_idx`, up to the next constant's start (may include padding)."""
        _check_index(data_buffer_idx, len(self._constants), "constant data_buffer_idx")
        return self._constants[data_buffer_idx]

    def tensor_data(self, tensor: Tensor) -> Optional[memoryview]:
        """The serialized bytes of `tensor` (exactly tensor.nbytes), or None when it has none.

        Constants come from the constant segment (or legacy constant_buffer); mutable tensors with an
        initial value from Program.mutable_data_segments.
        """
        if tensor.data_buffer_idx == 0:
            return None
        extra = tensor.extra_tensor_info
        if extra is not None and extra.location == 1:  # TensorDataLocation.EXTERNAL
            raise PteFormatError(f"tensor {extra.fully_qualified_name!r} has external data (a .ptd file), "
                                 "not in this .pte")
        if tensor.allocation_info is None:
            data = self.constant_data(tensor.data_buffer_idx)
            what = f"constant {tensor.data_buffer_idx}"
        else:
            table = extra.mutable_data_segments_idx if extra is not None else 0
            _check_index(table, len(self.mutable_data_segments), "mutable_data_segments index")
            segment_index, offsets = self.mutable_data_segments[table]
            _check_index(tensor.data_buffer_idx, len(offsets), "mutable data_buffer_idx")
            segment = self.segment_data(segment_index)
            data = segment[offsets[tensor.data_buffer_idx]:]
            what = f"mutable data {tensor.data_buffer_idx}"
        if tensor.nbytes > len(data):
            raise PteFormatError(f"{what} has {len(data)} bytes, tensor {tensor.scalar_type_name}{list(tensor.sizes)} "
                                 f"needs {tensor.nbytes}")
        return data[:tensor.nbytes]

    # -- parsing --------------------------------------------------------------------------------
    def _parse_program(self, program_view: memoryview) -> None:
        program = FbProgram.Program.GetRootAs(program_view, 0)
        self.program_version = program.Version()

        self.segments = []
        for i in range(program.SegmentsLength()):
            with reading(f"Program.segments[{i}]", PteFormatError):
                fb_segment = program.Segments(i)
                segment = DataSegment(fb_segment.Offset(), fb_segment.Size())
            self._check_segment(i, segment)
            self.segments.append(segment)

        self.backend_delegate_data = []
        for i in range(program.BackendDelegateDataLength()):
            with reading(f"Program.backend_delegate_data[{i}]", PteFormatError):
                self.backend_delegate_data.append(_bytes_vector(program.BackendDelegateData(i), "Data"))
        with reading("Program.constant_segment / constant_buffer", PteFormatError):
            self._parse_constants(program)

        self.mutable_data_segments = []
        for i in range(program.MutableDataSegmentsLength()):
            with reading(f"Program.mutable_data_segments[{i}]", PteFormatError):
                sub = program.MutableDataSegments(i)
                segment_index, offsets = sub.SegmentIndex(), scalar_vector(sub, "Offsets")
            _check_index(segment_index, len(self.segments), f"mutable_data_segments[{i}] segment index")
            limit = self.segments[segment_index].size
            for j, offset in enumerate(offsets):
                if offset > limit:
                    raise PteFormatError(f"mutable_data_segments[{i}] offset {j} = {offset} lies past its "
                                         f"{limit}-byte segment")
            self.mutable_data_segments.append((segment_index, offsets))

        self.named_data = {}
        for i in range(program.NamedDataLength()):
            with reading(f"Program.named_data[{i}]", PteFormatError):
                entry = program.NamedData(i)
                key, segment_index = _text(entry.Key()), entry.SegmentIndex()
            if key in self.named_data:
                raise PteFormatError(f"named data key {key!r} appears twice")
            self.named_data[key] = self.segment_data(segment_index)

        self.execution_plans = []
        for i in range(program.ExecutionPlanLength()):
            with reading(f"Program.execution_plan[{i}]", PteFormatError):
                self.execution_plans.append(self._parse_plan(program.ExecutionPlan(i), i))
        names = self.method_names
        if len(set(names)) != len(names):
            raise PteFormatError(f"execution plan names are not unique: {names}")

    def _check_segment(self, index: int, segment: DataSegment) -> None:
        if segment.size == 0:
            return  # executorch writes an empty constant segment even when the file has no segment data
        if not self.header.segment_base_offset:
            raise PteFormatError(f"segment {index} has {segment.size} bytes but the file has no extended "
                                 "header giving the segment base offset")
        end = self.header.segment_base_offset + segment.offset + segment.size
        if end > len(self._view):
            raise PteFormatError(f"segment {index} (offset {segment.offset}, size {segment.size}) ends at byte {end}, "
                                 f"past the end of the {len(self._view)}-byte file (truncated)")
        if self.header.segment_data_size and segment.offset + segment.size > self.header.segment_data_size:
            raise PteFormatError(f"segment {index} (offset {segment.offset}, size {segment.size}) extends past "
                                 f"segment_data_size {self.header.segment_data_size}")

    def _parse_constants(self, program) -> None:
        """Resolve each constant buffer: constant_segment (current files) or constant_buffer (legacy)."""
        self._constants: list[memoryview] = []
        sub = program.ConstantSegment()
        offsets = scalar_vector(sub, "Offsets") if sub is not None else ()
        legacy_count = program.ConstantBufferLength()
        if offsets and legacy_count:
            raise PteFormatError("the program has both constant_segment offsets and a legacy constant_buffer")
        if legacy_count:
            self._constants = [_bytes_vector(program.ConstantBuffer(i), "Storage") for i in range(legacy_count)]
            return
        if not offsets:
            return
        segment_index = sub.SegmentIndex()
        _check_index(segment_index, len(self.segments), "constant_segment segment index")
        base = self.segment_data(segment_index)
        for i, offset in enumerate(offsets):
            # Like executorch, a constant extends to the next one's start (or the segment end).
            end = offsets[i + 1] if i + 1 < len(offsets) else len(base)
            if not offset <= end <= len(base):
                raise PteFormatError(f"constant_segment offset {i} spans [{offset}, {end}), outside the "
                                     f"{len(base)}-byte constant segment {segment_index} or not ascending")
            self._constants.append(base[offset:end])

    def _parse_plan(self, fb_plan, plan_index: int) -> ExecutionPlan:
        name = _text(fb_plan.Name()) or ""
        where = f"execution plan {name or plan_index!r}"
        values = []
        for i in range(fb_plan.ValuesLength()):
            with reading(f"{where} value {i}", PteFormatError):
                values.append(self._parse_value(fb_plan.Values(i), f"{where} value {i}"))
        values = tuple(values)
        operators = []
        for i in range(fb_plan.OperatorsLength()):
            with reading(f"{where} operator {i}", PteFormatError):
                op = fb_plan.Operators(i)
                operators.append(Operator(_text(op.Name()) or "", _text(op.Overload()) or ""))
        delegates = []
        for i in range(fb_plan.DelegatesLength()):
            with reading(f"{where} delegate {i}", PteFormatError):
                delegates.append(self._parse_delegate(fb_plan.Delegates(i), f"{where} delegate {i}"))
        delegates = tuple(delegates)
        chains = []
        for i in range(fb_plan.ChainsLength()):
            with reading(f"{where} chain {i}", PteFormatError):
                chains.append(self._parse_chain(fb_plan.Chains(i), f"{where} chain {i}", len(values), len(operators),
                                                len(delegates)))
        chains = tuple(chains)
        with reading(f"{where} inputs / outputs", PteFormatError):
            inputs, outputs = scalar_vector(fb_plan, "Inputs"), scalar_vector(fb_plan, "Outputs")
        for kind, ids in (("input", inputs), ("output", outputs)):
            for value_index in ids:
                _check_index(value_index, len(values), f"{where} {kind} value index")
        for i, value in enumerate(values):
            if isinstance(value, (TensorList, OptionalTensorList)):
                for item in value.items:
                    if not (isinstance(value, OptionalTensorList) and item == -1):
                        _check_index(item, len(values), f"{where} value {i} list item")
        with reading(f"{where} container_meta_type / non_const_buffer_sizes", PteFormatError):
            meta = fb_plan.ContainerMetaType()
            container_meta = None
            if meta is not None:
                container_meta = (_text(meta.EncodedInpStr()) or "", _text(meta.EncodedOutStr()) or "")
            arena_sizes = scalar_vector(fb_plan, "NonConstBufferSizes")
        return ExecutionPlan(name, values, inputs, outputs, chains, tuple(operators), delegates, arena_sizes,
                             container_meta)

    def _parse_value(self, fb_value, where: str):
        kind = fb_value.ValType()
        holder = fb_value.Val()
        if kind == KernelTypes.Null or kind == KernelTypes.NONE:
            return Null()
        if holder is None:
            raise PteFormatError(f"{where} has union type {kind} but no payload")
        if kind == KernelTypes.Tensor:
            return self._parse_tensor(union_as(holder, FbTensor))
        if kind == KernelTypes.Int:
            return Int(union_as(holder, FbInt).IntVal())
        if kind == KernelTypes.Bool:
            return Bool(bool(union_as(holder, FbBool).BoolVal()))
        if kind == KernelTypes.Double:
            return Double(union_as(holder, FbDouble).DoubleVal())
        if kind == KernelTypes.String:
            return String(_text(union_as(holder, FbString).StringVal()) or "")
        if kind == KernelTypes.IntList:
            return IntList(scalar_vector(union_as(holder, FbIntList), "Items"))
        if kind == KernelTypes.DoubleList:
            return DoubleList(scalar_vector(union_as(holder, FbDoubleList), "Items"))
        if kind == KernelTypes.BoolList:
            return BoolList(tuple(bool(b) for b in scalar_vector(union_as(holder, FbBoolList), "Items")))
        if kind == KernelTypes.TensorList:
            return TensorList(scalar_vector(union_as(holder, FbTensorList), "Items"))
        if kind == KernelTypes.OptionalTensorList:
            return OptionalTensorList(scalar_vector(union_as(holder, FbOptionalTensorList), "Items"))
        raise PteFormatError(f"{where} has unknown value type {kind}")

    def _parse_tensor(self, t) -> Tensor:
        alloc = t.AllocationInfo()
        allocation = None if alloc is None else AllocationDetails(
            alloc.MemoryId(), alloc.MemoryOffsetLow() | (alloc.MemoryOffsetHigh() << 32))
        extra = t.ExtraTensorInfo()
        extra_info = None if extra is None else ExtraTensorInfo(
            extra.MutableDataSegmentsIdx(), _text(extra.FullyQualifiedName()), extra.Location())
        return Tensor(t.ScalarType(), t.StorageOffset(), scalar_vector(t, "Sizes"), scalar_vector(t, "DimOrder"),
                      bool(t.RequiresGrad()), t.DataBufferIdx(), allocation, t.Layout(), t.ShapeDynamism(), extra_info)

    def _parse_delegate(self, fb_delegate, where: str) -> Delegate:
        processed = fb_delegate.Processed()
        if processed is None:
            raise PteFormatError(f"{where} has no processed data reference")
        location, index = processed.Location(), processed.Index()
        if location == DataLocation.INLINE:
            _check_index(index, len(self.backend_delegate_data), f"{where} inline data index")
            data = self.backend_delegate_data[index]
        elif location == DataLocation.SEGMENT:
            _check_index(index, len(self.segments), f"{where} segment index")
            data = self.segment_data(index)
        else:
            raise PteFormatError(f"{where} has unknown data location {location}")
        specs = []
        for i in range(fb_delegate.CompileSpecsLength()):
            spec = fb_delegate.CompileSpecs(i)
            specs.append((_text(spec.Key()) or "", bytes(_bytes_vector(spec, "Value"))))
        return Delegate(_text(fb_delegate.Id()) or "", location, index, data, tuple(specs))

    def _parse_chain(self, fb_chain, where: str, num_values: int, num_operators: int, num_delegates: int) -> Chain:
        instructions = []
        for i in range(fb_chain.InstructionsLength()):
            holder_table = fb_chain.Instructions(i)
            kind, holder = holder_table.InstrArgsType(), holder_table.InstrArgs()
            at = f"{where} instruction {i}"
            if holder is None:
                raise PteFormatError(f"{at} has no arguments (type {kind})")
            if kind == InstructionArguments.KernelCall:
                call = union_as(holder, FbKernelCall)
                instruction = KernelCall(call.OpIndex(), scalar_vector(call, "Args"))
                _check_index(instruction.op_index, num_operators, f"{at} operator index")
                value_ids = instruction.args
            elif kind == InstructionArguments.DelegateCall:
                call = union_as(holder, FbDelegateCall)
                instruction = DelegateCall(call.DelegateIndex(), scalar_vector(call, "Args"))
                _check_index(instruction.delegate_index, num_delegates, f"{at} delegate index")
                value_ids = instruction.args
            elif kind == InstructionArguments.MoveCall:
                call = union_as(holder, FbMoveCall)
                instruction = MoveCall(call.MoveFrom(), call.MoveTo())
                value_ids = (instruction.move_from, instruction.move_to)
            elif kind == InstructionArguments.JumpFalseCall:
                call = union_as(holder, FbJumpFalseCall)
                instruction = JumpFalseCall(call.CondValueIndex(), call.DestinationInstruction())
                _check_index(instruction.destination_instruction, fb_chain.InstructionsLength(),
                             f"{at} jump destination")
                value_ids = (instruction.cond_value_index,)
            elif kind == InstructionArguments.FreeCall:
                instruction = FreeCall(union_as(holder, FbFreeCall).ValueIndex())
                value_ids = (instruction.value_index,)
            else:
                raise PteFormatError(f"{at} has unknown instruction type {kind}")
            for value_index in value_ids:
                _check_index(value_index, num_values, f"{at} value index")
            instructions.append(instruction)
        inputs, outputs = scalar_vector(fb_chain, "Inputs"), scalar_vector(fb_chain, "Outputs")
        for value_index in inputs + outputs:
            _check_index(value_index, num_values, f"{where} input/output value index")
        return Chain(inputs, outputs, tuple(instructions))
