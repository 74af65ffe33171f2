"""Load-time verification of a .pte program and its vktrain delegate, run before anything is allocated.

The loaders (ProgramInterpreter, TrainingRunner, the fuzzer in vktrain/runtime/program/fuzz.py) call
the steps below; each `check_*` function checks one fact and raises `VerificationError` (a
PteFormatError, so a VktrainError) naming the file, the field, what was found and what was expected:

    verify_plan(pte, plan, limits)              host side: tensor records, arenas, aliasing
    load_delegate_graph(pte, plan, ...)         the one vktrain delegate: its blob (integrity, format),
                                                its call's arguments against the graph's I/O (each
                                                input written before the call), op shapes
    check_device_memory(source, graph, limit)   once the device is known: what the graph will allocate

What the .pte itself says is never trusted for sizes: an arena is allocated with what its tensors
need (and refused when the file declares less), and every size is capped by what the machine has.
The delegate blob carries its own checksums (vktrain/serialization/blob.py); the .pte plan around it has
none (ExecuTorch's format), so its consistency is what these checks establish.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import numpy as np

from vktrain.contract import BACKEND_ID
from vktrain.errors import VktrainError
from vktrain.serialization.pte import (
    NUMPY_SCALAR_TYPES,
    SCALAR_TYPE_NAMES,
    DelegateCall,
    ExecutionPlan,
    KernelCall,
    MoveCall,
    PteFile,
    PteFormatError,
    Tensor,
)
from vktrain.serialization import BlobFormatError, deserialize_blob
from vktrain.serialization import graph as g

# ExecuTorch enums the interpreter supports (executorch/schema/program.fbs): TensorShapeDynamism.STATIC
# and Layout.Strided; anything else would be read as if it were these.
_STATIC_SHAPE = 0
_STRIDED_LAYOUT = 0


class VerificationError(PteFormatError):
    """The program is inconsistent (or asks for more memory than the machine has). `check` names the
    check that refused it (one of the check_* functions of this module)."""

    def __init__(self, message: str, check: str):
        super().__init__(message)
        self.check = check


class UnsupportedProgramError(VktrainError, ValueError):
    """The .pte holds something this runner cannot execute (instruction, delegate count, input names)."""


def _refuse(source: str, check: Callable, message: str) -> VerificationError:
    """The refusal of `check`, naming the file (or blob) `source` it read."""
    return VerificationError(f"{source}: {message}", check.__name__)


# ---------------------------------------------------------------------------------------------------
# Memory limits
# ---------------------------------------------------------------------------------------------------

def host_memory_bytes() -> int:
    """Physical RAM of this machine (os.sysconf); the cap on the interpreter's host arenas."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no cap better than "what 64 bits address"
        return 1 << 48


_VK_MEMORY_HEAP_DEVICE_LOCAL_BIT = 0x1


def device_memory_bytes(device) -> int:
    """The largest device-local memory heap of `device` (a vktrain.runtime.vk Device): no single program
    can use more. Falls back to the host's RAM when the device reports no heaps."""
    properties = getattr(device, "memory_properties", None)
    heaps = []
    if properties is not None:
        heaps = [properties.memoryHeaps[i].size for i in range(properties.memoryHeapCount)
                 if properties.memoryHeaps[i].flags & _VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]
    return int(max(heaps)) if heaps else host_memory_bytes()


# ---------------------------------------------------------------------------------------------------
# The execution plan
# ---------------------------------------------------------------------------------------------------

def check_tensor_records(pte: PteFile, plan: ExecutionPlan) -> None:
    """Every tensor value is one the interpreter reads as written: a known dtype, non-negative sizes, the
    contiguous dim order, no storage offset, static shape, strided layout, and a planned
    tensor has no initial data (the interpreter would not load it)."""
    for index, value in enumerate(plan.values):
        if not isinstance(value, Tensor):
            continue
        where = f"plan {plan.name!r} value {index} ({value.scalar_type_name}{list(value.sizes)})"
        if value.scalar_type not in NUMPY_SCALAR_TYPES:
            raise _refuse(pte.source, check_tensor_records, f"{where}: scalar type {value.scalar_type_name} is not "
                          f"supported; expected one of {sorted(SCALAR_TYPE_NAMES[t] for t in NUMPY_SCALAR_TYPES)}")
        if any(d < 0 for d in value.sizes):
            raise _refuse(pte.source, check_tensor_records, f"{where}: sizes {list(value.sizes)} has a negative dimension")
        if tuple(value.dim_order) != tuple(range(len(value.sizes))):
            raise _refuse(pte.source, check_tensor_records, f"{where}: dim_order is {list(value.dim_order)}, expected "
                          f"{list(range(len(value.sizes)))} (only contiguous tensors are supported)")
        for field, found, expected in (("storage_offset", value.storage_offset, 0),
                                       ("shape_dynamism", value.shape_dynamism, _STATIC_SHAPE),
                                       ("layout", value.layout, _STRIDED_LAYOUT)):
            if found != expected:
                raise _refuse(pte.source, check_tensor_records, f"{where}: {field} is {found}, expected {expected} "
                              "(the only value the interpreter supports)")
        if value.allocation_info is not None and value.data_buffer_idx != 0:
            raise _refuse(pte.source, check_tensor_records, f"{where}: a planned tensor with initial data "
                          f"(data_buffer_idx {value.data_buffer_idx}); the interpreter supports none")


def arena_needs(pte: PteFile, plan: ExecutionPlan) -> list[int]:
    """Bytes each arena must have: the end of the last tensor placed in it. Refuses a tensor placed in a
    memory id the plan does not have, misaligned, or past the end the file declares for its arena.
    (After check_tensor_records: every tensor's nbytes is defined.)"""
    declared = plan.non_const_buffer_sizes
    needs = [0] * len(declared)
    for index, value in enumerate(plan.values):
        if not isinstance(value, Tensor) or value.allocation_info is None:
            continue
        memory = value.allocation_info
        where = f"plan {plan.name!r} value {index} ({value.scalar_type_name}{list(value.sizes)})"
        if not 0 <= memory.memory_id < len(declared):
            raise _refuse(pte.source, check_arenas, f"{where}: allocation_info.memory_id is {memory.memory_id}, expected "
                          f"0..{len(declared) - 1} (non_const_buffer_sizes has {len(declared)} entries)")
        element_size = np.dtype(NUMPY_SCALAR_TYPES[value.scalar_type]).itemsize
        if memory.memory_offset % element_size:
            raise _refuse(pte.source, check_arenas, f"{where}: allocation_info memory offset {memory.memory_offset} is not a "
                          f"multiple of its {element_size}-byte element size")
        end = memory.memory_offset + value.nbytes
        if end > declared[memory.memory_id]:
            raise _refuse(pte.source, check_arenas, f"{where}: bytes [{memory.memory_offset}, {end}) lie past the end of "
                          f"arena {memory.memory_id}, whose non_const_buffer_sizes entry is {declared[memory.memory_id]}")
        needs[memory.memory_id] = max(needs[memory.memory_id], end)
    return needs


def check_arenas(pte: PteFile, plan: ExecutionPlan, host_limit: int) -> list[int]:
    """Every planned tensor lies inside its arena, and the arenas fit in the host's memory. Returns what
    each arena needs (what the interpreter allocates, whatever larger size the file declares)."""
    needs = arena_needs(pte, plan)
    declared_total = sum(plan.non_const_buffer_sizes)
    if declared_total > host_limit:
        raise _refuse(pte.source, check_arenas, f"plan {plan.name!r} non_const_buffer_sizes ask for {declared_total} bytes "
                      f"of host memory ({list(plan.non_const_buffer_sizes)}); this machine has {host_limit}")
    return needs


def _storage(plan: ExecutionPlan, value_index: int) -> Optional[tuple[int, int, int]]:
    """(memory id, start, end) of a planned, non-empty tensor value; None otherwise."""
    value = plan.values[value_index]
    if not isinstance(value, Tensor) or value.allocation_info is None or value.nbytes == 0:
        return None
    memory = value.allocation_info
    return memory.memory_id, memory.memory_offset, memory.memory_offset + value.nbytes


def check_planned_storage_disjoint(pte: PteFile, plan: ExecutionPlan) -> None:
    """The tensors one instruction reads and writes are all live while it runs, so a valid memory plan
    gives them disjoint bytes; the same holds for the plan's inputs, written before the first instruction.
    (Necessary, not sufficient for programs of many instructions: lifetimes across instructions are not
    re-derived here. A training step is one DelegateCall over all its tensors, where it is exact.)"""
    groups = [("the plan inputs", plan.inputs)]
    groups += [(f"instruction {i}", instruction.args) for i, instruction in enumerate(plan.instructions)
               if isinstance(instruction, (KernelCall, DelegateCall))]
    for what, value_ids in groups:
        placed = sorted((storage, value_index) for value_index in set(value_ids)
                        if (storage := _storage(plan, value_index)) is not None)
        for (first, first_index), (second, second_index) in zip(placed, placed[1:]):
            if first[0] == second[0] and second[1] < first[2]:
                raise _refuse(pte.source, check_planned_storage_disjoint,
                              f"plan {plan.name!r}: values {first_index} and {second_index}, both used by {what}, "
                              f"have overlapping bytes [{first[1]}, {first[2]}) and [{second[1]}, {second[2]}) in arena "
                              f"{first[0]}; tensors live at the same time need disjoint memory")


def check_constant_tensors(pte: PteFile, plan: ExecutionPlan) -> None:
    """Every constant tensor of the plan has its bytes in the file."""
    for index, value in enumerate(plan.values):
        if isinstance(value, Tensor) and value.allocation_info is None and value.data_buffer_idx != 0:
            try:
                pte.tensor_data(value)
            except PteFormatError as exc:
                raise _refuse(pte.source, check_constant_tensors, f"plan {plan.name!r} value {index}: {exc}") from None


def verify_plan(pte: PteFile, plan: ExecutionPlan, host_limit: Optional[int] = None) -> list[int]:
    """All host-side checks of one execution plan; returns the bytes each arena needs."""
    check_tensor_records(pte, plan)
    needs = check_arenas(pte, plan, host_memory_bytes() if host_limit is None else host_limit)
    check_planned_storage_disjoint(pte, plan)
    check_constant_tensors(pte, plan)
    return needs


# ---------------------------------------------------------------------------------------------------
# The delegate
# ---------------------------------------------------------------------------------------------------

def check_single_delegate_call(pte: PteFile, plan: ExecutionPlan) -> DelegateCall:
    """The plan has one delegate, vktrain's, called exactly once; returns the call."""
    if len(plan.delegates) != 1 or plan.delegates[0].id != BACKEND_ID:
        raise UnsupportedProgramError(
            f"{pte.source}: expected exactly one {BACKEND_ID} delegate in plan {plan.name!r}, found "
            f"{[d.id for d in plan.delegates] or 'none'} (was the program lowered with VktrainPartitioner?)")
    calls = [i for i in plan.instructions if isinstance(i, DelegateCall)]
    if len(calls) != 1:
        raise UnsupportedProgramError(f"{pte.source}: the delegate is called {len(calls)} times; expected once")
    return calls[0]


def check_delegate_io(pte: PteFile, plan: ExecutionPlan, call: DelegateCall, graph: g.VkGraph) -> None:
    """The call passes the graph's inputs, then its outputs: as many values, each a tensor of the dtype
    and shape the graph declares."""
    expected = [("input", i, value_id) for i, value_id in enumerate(graph.inputs)]
    expected += [("output", i, value_id) for i, value_id in enumerate(graph.outputs)]
    if len(call.args) != len(expected):
        raise _refuse(pte.source, check_delegate_io, f"plan {plan.name!r}: the delegate call passes {len(call.args)} values, "
                      f"its graph has {len(graph.inputs)} inputs and {len(graph.outputs)} outputs")
    for arg, (kind, position, value_id) in zip(call.args, expected):
        want = graph.values[value_id]
        if not isinstance(want, g.TensorValue):
            raise _refuse(pte.source, check_delegate_io, f"plan {plan.name!r}: delegate graph {kind} {position} is value "
                          f"{value_id}, a {type(want).__name__}; graph inputs and outputs must be tensors")
        want_text = f"{want.dtype.name}{list(want.shape)}"
        have = plan.values[arg]
        where = f"plan {plan.name!r}: delegate {kind} {position} ({want.name or 'unnamed'}) is plan value {arg}"
        if not isinstance(have, Tensor):
            raise _refuse(pte.source, check_delegate_io, f"{where}, a {type(have).__name__}; expected a tensor {want_text}")
        have_dtype = NUMPY_SCALAR_TYPES.get(have.scalar_type)
        if have_dtype != want.dtype.numpy_dtype or tuple(have.sizes) != tuple(want.shape):
            raise _refuse(pte.source, check_delegate_io, f"{where}, {have.scalar_type_name}{list(have.sizes)}; "
                          f"the delegate graph declares {want_text}")


def check_delegate_inputs_written(pte: PteFile, plan: ExecutionPlan, call: DelegateCall, graph: g.VkGraph) -> None:
    """Each delegate input holds data when the call runs: a plan input (the caller writes it), a constant
    (its bytes are in the file) or what an earlier instruction writes (a kernel's out, its last argument
    in ExecuTorch's out-variant convention; a move's destination). Anything else is arena memory nothing
    wrote: a plan whose inputs vector lost entries would load and train on zeros."""
    written = set(plan.inputs)
    for instruction in plan.instructions:
        if isinstance(instruction, DelegateCall):
            break
        if isinstance(instruction, KernelCall) and instruction.args:
            written.add(instruction.args[-1])
        elif isinstance(instruction, MoveCall):
            written.add(instruction.move_to)
    for position, (arg, value_id) in enumerate(zip(call.args, graph.inputs)):
        value = plan.values[arg]  # check_delegate_io: a tensor
        if arg in written or (value.allocation_info is None and value.data_buffer_idx != 0):
            continue
        raise _refuse(pte.source, check_delegate_inputs_written,
                      f"plan {plan.name!r}: delegate input {position} ({graph.tensor(value_id).name or 'unnamed'}) is "
                      f"plan value {arg}, which nothing writes before the call: not one of the plan's inputs "
                      f"{list(plan.inputs)}, not a constant, not an earlier instruction's output")


# What an op's outputs must be, given its inputs: op name, argument values, graph -> one (dtype, shape)
# per output, or None when the rules do not know the op. Provided by the torch-free op definitions.
OpShapeInference = Callable[[str, Sequence[g.Value], g.VkGraph], Optional[Sequence[tuple[g.DType, tuple[int, ...]]]]]


def check_op_shapes(source: str, graph: g.VkGraph, infer: Optional[OpShapeInference]) -> None:
    """Each op's output dtypes and shapes, re-inferred from its inputs, equal what the blob declares
    (outputs stored prepacked, e.g. q4gsw_requant's W_4X8 words, are not the op's logical tensor and are
    not compared); `infer` may also return the reason an op cannot run. None: nothing is re-inferred."""
    if infer is None:
        return
    for index, op in enumerate(graph.ops):
        inferred = infer(op.name, [graph.values[a] for a in op.args], graph)
        if inferred is None:
            continue
        if isinstance(inferred, str):
            raise _refuse(source, check_op_shapes, f"delegate op {index} ({op.name}): {inferred}")
        outputs = [graph.values[o] for o in op.outputs]
        if not all(isinstance(output, g.TensorValue) for output in outputs):
            raise _refuse(source, check_op_shapes, f"delegate op {index} ({op.name}) outputs values {list(op.outputs)}, "
                          f"{', '.join(type(output).__name__ for output in outputs)}; its definition gives tensors")
        inferred = [(dtype, tuple(shape)) for dtype, shape in inferred]
        if len(inferred) != len(outputs):
            raise _refuse(source, check_op_shapes, f"delegate op {index} ({op.name}) has {len(outputs)} outputs; "
                          f"its definition gives {len(inferred)}")
        pairs = [pair for pair, tensor in zip(inferred, outputs) if tensor.layout == g.Layout.PLAIN]
        declared = [(t.dtype, tuple(t.shape)) for t in outputs if t.layout == g.Layout.PLAIN]
        if pairs != declared:
            show = lambda items: ", ".join(f"{d.name}{list(s)}" for d, s in items)  # noqa: E731
            raise _refuse(source, check_op_shapes, f"delegate op {index} ({op.name}) declares outputs "
                          f"{show(declared)}; its inputs give {show(pairs)}")


def infer_from_op_definitions(name: str, args: Sequence[g.Value], graph: g.VkGraph):
    """The OpShapeInference of the torch-free op definitions (vktrain.opdefs): the reason for an op the
    runtime has no kernel for; None for ops without a shape rule and for calls with prepacked tensors
    (the q4gsw weights are checked against their definition where the kernel is planned, which knows
    the W_4X8 word count); else the outputs the definition infers."""
    from vktrain.opdefs import OP_DEFS, TensorMeta, infer_outputs
    from vktrain.opdefs.runtime_ops import RUNTIME_OPS
    from vktrain.serialization.graph import decode_scalar

    if name not in RUNTIME_OPS:
        return "vktrain's runtime has no kernel for this op"
    if name not in OP_DEFS:
        return None

    def meta(value: g.Value):
        if isinstance(value, g.TensorValue):
            return TensorMeta(tuple(value.shape), value.dtype.numpy_dtype.name) if value.layout == g.Layout.PLAIN else None
        if isinstance(value, g.ValueListValue):
            items = [meta(graph.values[i]) for i in value.items]
            return None if any(item is None for item in items) else items
        return decode_scalar(value)

    metas = [meta(value) for value in args]
    if any(m is None and isinstance(v, (g.TensorValue, g.ValueListValue)) for m, v in zip(metas, args)):
        return None
    inferred = infer_outputs(name, metas)
    if inferred is None or isinstance(inferred, str):
        return inferred
    return [(g.DType.from_numpy(m.dtype), tuple(m.shape)) for m in inferred]


def load_delegate_graph(pte: PteFile, plan: ExecutionPlan, *, verify_constants: bool = True,
                        infer_op_shapes: Optional[OpShapeInference] = infer_from_op_definitions) -> tuple[DelegateCall, g.VkGraph]:
    """The vktrain delegate's call and graph, verified: blob integrity and format, I/O, op shapes."""
    call = check_single_delegate_call(pte, plan)
    delegate = plan.delegates[call.delegate_index]
    try:
        graph = deserialize_blob(delegate.data, verify_constants=verify_constants, named_data=pte.named_data)
    except BlobFormatError as exc:
        raise BlobFormatError(f"{pte.source}: plan {plan.name!r} delegate {call.delegate_index} blob: {exc}") from None
    check_delegate_io(pte, plan, call, graph)
    check_delegate_inputs_written(pte, plan, call, graph)
    check_op_shapes(pte.source, graph, infer_op_shapes)
    return call, graph


def device_buffer_requests(graph: g.VkGraph) -> list[tuple[str, int]]:
    """(what, bytes) of each device buffer the graph asks for: every memory object, and every tensor with
    storage of its own outside them (inputs, constants, state; not views or in-place outputs, which use
    another tensor's storage; not values the graph no longer uses). An upper bound of what the executor
    allocates (tensors it finds identical share a buffer)."""
    requests = [(f"memory object {mem.id}", mem.size_bytes) for mem in graph.memory_objects]
    requests += [(f"tensor value {i} ({v.name or 'unnamed'}, {v.dtype.name}{list(v.shape)})", v.nbytes)
                 for i, v in ((i, graph.values[i]) for i in graph.used_tensor_ids())
                 if v.mem_obj_id == -1 and v.storage_of == -1]
    return requests


def check_device_memory(source: str, graph: g.VkGraph, limit: int) -> None:
    """What the graph's buffers ask for fits the device: each memory object and each tensor with its own
    buffer, and all of them together (an upper bound: the executor may alias some tensors as views)."""
    requests = device_buffer_requests(graph)
    for what, nbytes in requests:
        if nbytes > limit:
            raise _refuse(source, check_device_memory, f"delegate {what} asks for {nbytes} bytes of device memory; "
                          f"the device's largest memory heap has {limit}")
    total = sum(nbytes for _, nbytes in requests)
    if total > limit:
        raise _refuse(source, check_device_memory, f"the delegate's buffers ask for {total} bytes of device memory in "
                      f"all; the device's largest memory heap has {limit}")


__all__ = [
    "OpShapeInference", "UnsupportedProgramError", "VerificationError", "arena_needs", "check_arenas",
    "check_constant_tensors", "check_delegate_inputs_written", "check_delegate_io", "check_device_memory", "check_op_shapes",
    "check_planned_storage_disjoint", "check_single_delegate_call", "check_tensor_records",
    "device_buffer_requests", "device_memory_bytes", "host_memory_bytes", "load_delegate_graph", "verify_plan",
]
