"""The schedule of one VkGraph on one device target, as data: `Schedule`, and its bytes (`serialize_schedule`,
`deserialize_schedule`; the flatbuffer table `Schedule` of schema.fbs, file identifier "VKS1").

A Schedule is everything a runtime needs to run the graph without choosing a kernel: the buffer table
(key, bytes, role), where each tensor value lives (placements), the Dispatch list (shader variant, spec
constants, local size, bindings as (buffer, offset, size, access), push-constant bytes, group counts,
label), the GEMM route the planner took and which ops it sent to the tensor cores, what it relies on
from the device (`ScheduleRequirements`: a device with less is refused, naming what it lacks), and, for a
training step, the state guard's dispatches (`StateGuardPlan`: backups of the state and a NaN/inf check). It
is planned by vktrain/backend/kernel_planning (the AOT side) and run by GraphExecutor(device, graph, schedule)
and vktrain/runtime/delegate/state_guard.py, which choose nothing.

The bytes are deterministic (the same Schedule always serialises to the same bytes) and
deserialize_schedule(serialize_schedule(s)) == s. Format changes: add fields at the end of a table with a
default; a change of meaning bumps SCHEDULE_FORMAT_VERSION, which readers check.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable

import flatbuffers
import numpy as np

from vktrain.errors import VktrainError
from vktrain.contract import PRECISION_FP16
from vktrain.serialization import graph as g
from vktrain.serialization.device_profile import API_VULKAN, API_WEBGPU, DeviceProfile
from vktrain.serialization.dispatch import BufferBinding, Dispatch, ScheduleError
from vktrain.serialization.flatbuffer_building import numpy_vector, table_vector
from vktrain.serialization.flatbuffer_reading import (INT32, UINT8, UINT32, UINT64, reading, scalar_vector,
                                                      table_scalars, text as _text)
from vktrain.serialization.generated.vkt_blob import PlannedGemm as FbPlannedGemm
from vktrain.serialization.generated.vkt_blob import Schedule as FbSchedule
from vktrain.serialization.generated.vkt_blob import ScheduleBinding as FbBinding
from vktrain.serialization.generated.vkt_blob import ScheduleBuffer as FbBuffer
from vktrain.serialization.generated.vkt_blob import ScheduleDispatch as FbDispatch
from vktrain.serialization.generated.vkt_blob import ScheduleRequirements as FbRequirements
from vktrain.serialization.generated.vkt_blob import GuardedTensor as FbGuardedTensor
from vktrain.serialization.generated.vkt_blob import SpecConstant as FbSpecConstant
from vktrain.serialization.generated.vkt_blob import StateGuardPlan as FbStateGuardPlan
from vktrain.serialization.generated.vkt_blob import TensorPlacement as FbPlacement
from vktrain.serialization.generated.vkt_blob.BindingAccess import BindingAccess
from vktrain.serialization.generated.vkt_blob.BufferRole import BufferRole
from vktrain.serialization.generated.vkt_blob.SpecKind import SpecKind

SCHEDULE_IDENTIFIER = b"VKS1"
# The key prefix of a buffer another executor of the program owns ("shared:<tensor name>", role "shared").
SHARED_PREFIX = "shared:"
# The state guard's own buffers (StateGuardPlan): a backup slot, the per-tensor flags, the one result word.
# In the bytes, the guard's bindings name them by the indices just past the buffer table, in this order.
GUARD_SLOT, GUARD_FLAGS, GUARD_RESULT = "guard:slot", "guard:flags", "guard:result"
GUARD_KEYS = (GUARD_SLOT, GUARD_FLAGS, GUARD_RESULT)
GUARD_RESULT_BYTES = 4
SCHEDULE_FORMAT_VERSION = 1

# The buffer roles, lower-case, in the order of the schema's BufferRole values (the index is the stored value).
ROLES = tuple(name.lower() for name, _ in sorted(((name, value) for name, value in vars(BufferRole).items()
                                                 if not name.startswith("_")), key=lambda item: item[1]))
_ACCESS = {None: BindingAccess.DECLARED, "r": BindingAccess.READ, "w": BindingAccess.WRITE,
           "rw": BindingAccess.READ_WRITE}
_ACCESS_NAMES = {code: name for name, code in _ACCESS.items()}


class ScheduleFormatError(VktrainError, ValueError):
    """Bytes that are not a readable schedule: truncated, corrupt, or of another format version."""


class ScheduleMismatchError(VktrainError, ValueError):
    """A schedule planned for another graph, or for a device target this device does not satisfy."""


@dataclass(frozen=True)
class ScheduleBuffer:
    """One buffer of the table: the key the bindings name, its bytes, what it holds (one of ROLES)."""

    key: str
    size_bytes: int
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ScheduleError(f"buffer {self.key!r}: role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclass(frozen=True)
class TensorPlacement:
    """Where tensor value `value_id` lives: `size_bytes` at `offset` of buffer `key`."""

    value_id: int
    key: str
    offset: int
    size_bytes: int


@dataclass(frozen=True)
class ScheduleRequirements:
    """What a schedule relies on from a device, in DeviceProfile's terms (0 / empty / False: nothing). The
    limits are the ones planned by: kernels size tiles by the shared memory and workgroup size, windows by
    the binding range, offsets by the alignment; the subgroup size and operations, float16, int64 and the
    cooperative-matrix shape are those the kernels the GEMM route chose need (coopmat, emulated coopmat, the
    CPU bodies of the fp32 GEMMs, the f16 WGSL)."""

    api: str
    max_storage_buffer_range: int
    min_storage_buffer_offset_alignment: int
    max_shared_memory_bytes: int
    max_workgroup_invocations: int
    max_workgroup_size_x: int
    subgroup_size: int = 0
    subgroup_operations: tuple[str, ...] = ()
    float16: bool = False
    int64: bool = False
    cooperative_matrix: tuple[int, ...] = ()  # (m, n, k) of float16 x float16 + float32 at subgroup scope

    def unmet_by(self, profile: DeviceProfile) -> list[str]:
        """What a device with `profile` lacks of these requirements, one phrase each; empty when it has them."""
        missing = []
        if profile.api != self.api:
            missing.append(f"the schedule is for the {self.api} runtime, the device is {profile.api}")
        for name, have in (("max_storage_buffer_range", profile.max_storage_buffer_range),
                           ("max_shared_memory_bytes", profile.max_shared_memory_bytes),
                           ("max_workgroup_invocations", profile.max_workgroup_invocations),
                           ("max_workgroup_size_x", profile.max_workgroup_size[0])):
            if have < getattr(self, name):
                missing.append(f"{name} {getattr(self, name)} (the device has {have})")
        if self.min_storage_buffer_offset_alignment % profile.min_storage_buffer_offset_alignment:
            missing.append(f"a min_storage_buffer_offset_alignment dividing {self.min_storage_buffer_offset_alignment} "
                           f"(the device's is {profile.min_storage_buffer_offset_alignment})")
        if self.subgroup_size and profile.subgroup_size != self.subgroup_size:
            missing.append(f"subgroups of {self.subgroup_size} lanes (the device's have {profile.subgroup_size})")
        absent = [name for name in self.subgroup_operations if name not in profile.subgroup_operations]
        if absent:
            missing.append(f"subgroup operations {', '.join(absent)}")
        for name in ("float16", "int64"):
            if getattr(self, name) and not getattr(profile, name):
                missing.append(name)
        if self.cooperative_matrix:
            m, n, k = self.cooperative_matrix
            if not any((s.m, s.n, s.k, s.a_type, s.b_type, s.c_type, s.result_type, s.scope)
                       == (m, n, k, "float16", "float16", "float32", "float32", "subgroup")
                       for s in profile.cooperative_matrix):
                missing.append(f"{m}x{n}x{k} float16 x float16 + float32 cooperative matrices")
        return missing


@dataclass(frozen=True)
class PlannedGemm:
    """The GEMM route a schedule was planned with: kernels/coopmat.py GemmRoute's fields, as data
    (GemmRoute(**dataclasses.asdict(planned)) rebuilds it; a test keeps the two field lists equal)."""

    precision: str
    tensor_cores: bool
    reason: str
    emulate: bool
    subgroup_size: int
    min_workgroups: int
    split_min_workgroups: int
    split_target_workgroups: int
    fp32_tuning: str
    wgsl: bool

    @property
    def fp16_simt(self) -> bool:
        """The fp16 policy on the fp32 kernels' FP16 variants (no tensor cores): kernels/coopmat.py GemmRoute."""
        return self.precision == PRECISION_FP16 and not self.tensor_cores

    @property
    def fp16_kernels(self) -> str:
        """Where this route's fp16-input GEMMs run, for the reports."""
        if self.fp16_simt:
            return "FP16 SIMT kernels"
        return "f16 WGSL kernels" if self.wgsl else "tensor cores"

    def describe(self) -> str:
        """The route in a sentence (train's startup line: GraphExecutor.gemm_report)."""
        kernels = f"{self.fp16_kernels} (fp16 inputs, fp32 accumulation)" if self.tensor_cores else "fp32 kernels"
        if self.fp16_simt:
            kernels = "the 4-bit base GEMMs and the large mm on the FP16 SIMT kernels (fp16 operands, fp32 " \
                      "products and sums), every other GEMM on the fp32 kernels"
        return (f"GEMM precision {self.precision}: {kernels}; {self.reason}; "
                f"fp32 kernels in their {self.fp32_tuning} tuning")


@dataclass(frozen=True)
class GuardedTensor:
    """A state tensor the state guard backs up: its state name, and its `size_bytes` at `slot_offset` of a slot."""

    name: str
    slot_offset: int
    size_bytes: int


@dataclass(frozen=True)
class StateGuardPlan:
    """The state guard's dispatches (vktrain/backend/kernel_planning/state_guard.py plans them): `save` copies
    every state tensor into a backup slot (GUARD_SLOT, `slot_bytes`), flags NaN/inf per tensor (GUARD_FLAGS,
    `flags_bytes`) and folds the flags into the word of GUARD_RESULT; `restore` copies a slot back into the
    state. `tensors` in the graph's mutable-state order. The bindings name the schedule's buffers and GUARD_KEYS."""

    tensors: tuple[GuardedTensor, ...]
    slot_bytes: int
    flags_bytes: int
    save: tuple[Dispatch, ...]
    restore: tuple[Dispatch, ...]

    def __post_init__(self) -> None:
        for name in ("tensors", "save", "restore"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def buffer_sizes(self) -> dict[str, int]:
        """The guard's own buffers, key -> bytes."""
        return {GUARD_SLOT: self.slot_bytes, GUARD_FLAGS: self.flags_bytes, GUARD_RESULT: GUARD_RESULT_BYTES}


@dataclass(frozen=True)
class Schedule:
    """One graph's dispatches on one device target (see the module docstring).

    `buffers` in the order a runtime allocates them; `placements` sorted by value id; `dispatches` in
    execution order, every binding naming a buffer of the table by key; `max_binding_bytes` the binding
    size the caller asked to plan for (0: the device's); `tensor_core_ops` the labels of the graph ops
    lowered to the route's fp16-input kernels: tensor cores, f16 WGSL, or the fp16 policy's FP16 variants;
    `state_guard` the state guard's dispatches (None: not planned)."""

    graph_digest: str
    requirements: ScheduleRequirements
    gemm: PlannedGemm
    buffers: tuple[ScheduleBuffer, ...]
    placements: tuple[TensorPlacement, ...]
    dispatches: tuple[Dispatch, ...]
    tensor_core_ops: tuple[str, ...] = ()
    max_binding_bytes: int = 0
    state_guard: StateGuardPlan | None = None

    def __post_init__(self) -> None:
        for name in ("buffers", "placements", "dispatches", "tensor_core_ops"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        keys = [buffer.key for buffer in self.buffers]
        if len(set(keys)) != len(keys):
            raise ScheduleError(f"the buffer table names a buffer twice: {sorted(k for k in keys if keys.count(k) > 1)}")
        known = set(keys)
        for placement in self.placements:
            if placement.key not in known:
                raise ScheduleError(f"value {placement.value_id} is placed in buffer {placement.key!r}, which is not "
                                    f"in the buffer table")
        guard = () if self.state_guard is None else self.state_guard.save + self.state_guard.restore
        for dispatch, names in [(d, known) for d in self.dispatches] + [(d, known | set(GUARD_KEYS)) for d in guard]:
            for index, binding in enumerate(dispatch.bindings):
                if binding.buffer not in names:
                    raise ScheduleError(f"{dispatch.name}: binding {index} names buffer {binding.buffer!r}, which is "
                                        f"not in the buffer table")

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the op-owned scratch buffer (0: no op needs scratch)."""
        return sum(buffer.size_bytes for buffer in self.buffers if buffer.role == "scratch")

    def buffer(self, key: str) -> ScheduleBuffer:
        return next(buffer for buffer in self.buffers if buffer.key == key)


def graph_digest(graph: g.VkGraph) -> str:
    """sha256 of everything of `graph` a schedule depends on: its values (shapes, dtypes, storage records),
    ops, inputs, outputs, state, memory objects and metadata; not the constants' bytes."""
    digest = hashlib.sha256()
    for part in (graph.values, graph.ops, graph.inputs, graph.outputs, graph.mutable_state, graph.memory_objects,
                 sorted(graph.metadata.items())):
        digest.update(repr(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------



def _strings(builder: flatbuffers.Builder, texts: Iterable[str]) -> int:
    return table_vector(builder, [builder.CreateString(text) for text in texts])


def _build_spec(builder: flatbuffers.Builder, spec_id: int, value: Any) -> int:
    FbSpecConstant.Start(builder)
    FbSpecConstant.AddId(builder, spec_id)
    if isinstance(value, bool):
        FbSpecConstant.AddKind(builder, SpecKind.BOOL)
        FbSpecConstant.AddIntValue(builder, int(value))
    elif isinstance(value, int):
        FbSpecConstant.AddKind(builder, SpecKind.INT)
        FbSpecConstant.AddIntValue(builder, value)
    else:
        FbSpecConstant.AddKind(builder, SpecKind.FLOAT)
        FbSpecConstant.AddFloatValue(builder, float(value))
    return FbSpecConstant.End(builder)


def _build_dispatch(builder: flatbuffers.Builder, dispatch: Dispatch, index_of: dict[str, int]) -> int:
    shader = builder.CreateSharedString(dispatch.shader)
    label = builder.CreateString(dispatch.label)
    bindings = []
    for binding in dispatch.bindings:
        FbBinding.Start(builder)
        FbBinding.AddBuffer(builder, index_of[binding.buffer])
        FbBinding.AddOffset(builder, binding.offset)
        FbBinding.AddSizeBytes(builder, binding.size or 0)
        FbBinding.AddAccess(builder, _ACCESS[binding.access])
        bindings.append(FbBinding.End(builder))
    specs = [_build_spec(builder, spec_id, value) for spec_id, value in dispatch.spec_constants]
    vectors = (numpy_vector(builder, dispatch.groups, np.uint32), table_vector(builder, bindings),
               numpy_vector(builder, dispatch.push_constants, np.uint8), table_vector(builder, specs),
               numpy_vector(builder, dispatch.local_size or (), np.uint32))
    FbDispatch.Start(builder)
    FbDispatch.AddShader(builder, shader)
    FbDispatch.AddGroups(builder, vectors[0])
    FbDispatch.AddBindings(builder, vectors[1])
    FbDispatch.AddPushConstants(builder, vectors[2])
    FbDispatch.AddSpecConstants(builder, vectors[3])
    FbDispatch.AddLocalSize(builder, vectors[4])
    FbDispatch.AddLabel(builder, label)
    return FbDispatch.End(builder)


def _build_requirements(builder: flatbuffers.Builder, needs: ScheduleRequirements) -> int:
    api, operations = builder.CreateString(needs.api), _strings(builder, needs.subgroup_operations)
    coopmat = numpy_vector(builder, needs.cooperative_matrix, np.uint32)
    FbRequirements.Start(builder)
    FbRequirements.AddApi(builder, api)
    FbRequirements.AddMaxStorageBufferRange(builder, needs.max_storage_buffer_range)
    FbRequirements.AddMinStorageBufferOffsetAlignment(builder, needs.min_storage_buffer_offset_alignment)
    FbRequirements.AddMaxSharedMemoryBytes(builder, needs.max_shared_memory_bytes)
    FbRequirements.AddMaxWorkgroupInvocations(builder, needs.max_workgroup_invocations)
    FbRequirements.AddMaxWorkgroupSizeX(builder, needs.max_workgroup_size_x)
    FbRequirements.AddSubgroupSize(builder, needs.subgroup_size)
    FbRequirements.AddSubgroupOperations(builder, operations)
    FbRequirements.AddFloat16(builder, needs.float16)
    FbRequirements.AddInt64(builder, needs.int64)
    FbRequirements.AddCooperativeMatrix(builder, coopmat)
    return FbRequirements.End(builder)


def _build_gemm(builder: flatbuffers.Builder, gemm: PlannedGemm) -> int:
    precision, reason, tuning = (builder.CreateString(text) for text in (gemm.precision, gemm.reason, gemm.fp32_tuning))
    FbPlannedGemm.Start(builder)
    FbPlannedGemm.AddPrecision(builder, precision)
    FbPlannedGemm.AddTensorCores(builder, gemm.tensor_cores)
    FbPlannedGemm.AddReason(builder, reason)
    FbPlannedGemm.AddEmulate(builder, gemm.emulate)
    FbPlannedGemm.AddSubgroupSize(builder, gemm.subgroup_size)
    FbPlannedGemm.AddMinWorkgroups(builder, gemm.min_workgroups)
    FbPlannedGemm.AddSplitMinWorkgroups(builder, gemm.split_min_workgroups)
    FbPlannedGemm.AddSplitTargetWorkgroups(builder, gemm.split_target_workgroups)
    FbPlannedGemm.AddFp32Tuning(builder, tuning)
    FbPlannedGemm.AddWgsl(builder, gemm.wgsl)
    return FbPlannedGemm.End(builder)


def _build_guard(builder: flatbuffers.Builder, guard: StateGuardPlan, index_of: dict[str, int]) -> int:
    index_of = {**index_of, **{key: len(index_of) + i for i, key in enumerate(GUARD_KEYS)}}
    tensors = []
    for tensor in guard.tensors:
        name = builder.CreateString(tensor.name)
        FbGuardedTensor.Start(builder)
        FbGuardedTensor.AddName(builder, name)
        FbGuardedTensor.AddSlotOffset(builder, tensor.slot_offset)
        FbGuardedTensor.AddSizeBytes(builder, tensor.size_bytes)
        tensors.append(FbGuardedTensor.End(builder))
    save = [_build_dispatch(builder, dispatch, index_of) for dispatch in guard.save]
    restore = [_build_dispatch(builder, dispatch, index_of) for dispatch in guard.restore]
    vectors = (table_vector(builder, tensors), table_vector(builder, save), table_vector(builder, restore))
    FbStateGuardPlan.Start(builder)
    FbStateGuardPlan.AddTensors(builder, vectors[0])
    FbStateGuardPlan.AddSlotBytes(builder, guard.slot_bytes)
    FbStateGuardPlan.AddFlagsBytes(builder, guard.flags_bytes)
    FbStateGuardPlan.AddSave(builder, vectors[1])
    FbStateGuardPlan.AddRestore(builder, vectors[2])
    return FbStateGuardPlan.End(builder)


def module_dispatches(schedule: "Schedule") -> tuple[Dispatch, ...]:
    """Every dispatch a runtime builds a pipeline for, in the order an embedded schedule's module ids follow
    (serialization/embedded.py): the step's, then the state guard's save and restore dispatches."""
    guard = schedule.state_guard
    return tuple(schedule.dispatches) + ((tuple(guard.save) + tuple(guard.restore)) if guard is not None else ())


def serialize_schedule(schedule: Schedule) -> bytes:
    """The schedule's flatbuffer (root table Schedule, identifier "VKS1"); the same schedule always gives the
    same bytes."""
    builder = flatbuffers.Builder(1 << 16)
    index_of = {buffer.key: index for index, buffer in enumerate(schedule.buffers)}
    buffers = []
    for buffer in schedule.buffers:
        key = builder.CreateString(buffer.key)
        FbBuffer.Start(builder)
        FbBuffer.AddKey(builder, key)
        FbBuffer.AddSizeBytes(builder, buffer.size_bytes)
        FbBuffer.AddRole(builder, ROLES.index(buffer.role))
        buffers.append(FbBuffer.End(builder))
    placements = []
    for placement in schedule.placements:
        FbPlacement.Start(builder)
        FbPlacement.AddValueId(builder, placement.value_id)
        FbPlacement.AddBuffer(builder, index_of[placement.key])
        FbPlacement.AddOffset(builder, placement.offset)
        FbPlacement.AddSizeBytes(builder, placement.size_bytes)
        placements.append(FbPlacement.End(builder))
    dispatches = [_build_dispatch(builder, dispatch, index_of) for dispatch in schedule.dispatches]
    digest = builder.CreateString(schedule.graph_digest)
    requirements, gemm = _build_requirements(builder, schedule.requirements), _build_gemm(builder, schedule.gemm)
    guard = None if schedule.state_guard is None else _build_guard(builder, schedule.state_guard, index_of)
    vectors = (table_vector(builder, buffers), table_vector(builder, placements), table_vector(builder, dispatches),
               _strings(builder, schedule.tensor_core_ops))
    FbSchedule.Start(builder)
    FbSchedule.AddFormatVersion(builder, SCHEDULE_FORMAT_VERSION)
    FbSchedule.AddGraphDigest(builder, digest)
    FbSchedule.AddRequirements(builder, requirements)
    FbSchedule.AddGemm(builder, gemm)
    FbSchedule.AddMaxBindingBytes(builder, schedule.max_binding_bytes)
    FbSchedule.AddBuffers(builder, vectors[0])
    FbSchedule.AddPlacements(builder, vectors[1])
    FbSchedule.AddDispatches(builder, vectors[2])
    FbSchedule.AddTensorCoreOps(builder, vectors[3])
    if guard is not None:
        FbSchedule.AddStateGuard(builder, guard)
    builder.Finish(FbSchedule.End(builder), file_identifier=SCHEDULE_IDENTIFIER)
    return bytes(builder.Output())


# ---------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------

def _texts(table, field: str) -> tuple[str, ...]:
    return tuple(_text(getattr(table, field)(i)) for i in range(getattr(table, f"{field}Length")()))


def _buffer_key(keys: list[str], index: int, where: str) -> str:
    if not 0 <= index < len(keys):
        raise ScheduleFormatError(f"{where} names buffer {index}; the table has {len(keys)}")
    return keys[index]


def _read_spec(table) -> tuple[int, Any]:
    kind = table.Kind()
    if kind == SpecKind.BOOL:
        return table.Id(), bool(table.IntValue())
    if kind == SpecKind.INT:
        return table.Id(), table.IntValue()
    if kind == SpecKind.FLOAT:
        return table.Id(), table.FloatValue()
    raise ScheduleFormatError(f"spec constant {table.Id()} has unknown kind {kind}")


# schema.fbs ScheduleBinding (buffer: uint32, offset: uint64, size_bytes: uint64, access: BindingAccess ubyte) and
# TensorPlacement (value_id: int32, buffer: uint32, offset: uint64, size_bytes: uint64), in slot order, all 0 by
# default: read by table_scalars (tests/test_schedule.py checks them against the generated accessors).
_BINDING_FIELDS = ((UINT32, 0), (UINT64, 0), (UINT64, 0), (UINT8, 0))
_PLACEMENT_FIELDS = ((INT32, 0), (UINT32, 0), (UINT64, 0), (UINT64, 0))


def _read_dispatch(table, keys: list[str], index: int) -> Dispatch:
    where = f"dispatch {index}"
    bindings = []
    for i in range(table.BindingsLength()):
        buffer, offset, size_bytes, access = table_scalars(table.Bindings(i), _BINDING_FIELDS)
        if access not in _ACCESS_NAMES:
            raise ScheduleFormatError(f"{where} binding {i} has unknown access {access}")
        bindings.append(BufferBinding(_buffer_key(keys, buffer, f"{where} binding {i}"), offset, size_bytes or None,
                                      _ACCESS_NAMES[access]))
    specs = tuple(_read_spec(table.SpecConstants(i)) for i in range(table.SpecConstantsLength()))
    local_size = scalar_vector(table, "LocalSize") or None
    push = bytes(table.PushConstantsAsNumpy().tobytes()) if table.PushConstantsLength() else b""
    try:
        return Dispatch(_text(table.Shader()), scalar_vector(table, "Groups"), bindings, push, specs, local_size,
                        _text(table.Label()))
    except ScheduleError as exc:
        raise ScheduleFormatError(f"{where}: {exc}") from None


def _read_guard(table, keys: list[str]) -> StateGuardPlan:
    keys = keys + list(GUARD_KEYS)
    tensors = []
    for i in range(table.TensorsLength()):
        with reading(f"Schedule.state_guard.tensors[{i}]", ScheduleFormatError):
            entry = table.Tensors(i)
            tensors.append(GuardedTensor(_text(entry.Name()), entry.SlotOffset(), entry.SizeBytes()))
    lists = {}
    for name in ("Save", "Restore"):
        dispatches = []
        for i in range(getattr(table, f"{name}Length")()):
            with reading(f"Schedule.state_guard.{name.lower()}[{i}]", ScheduleFormatError):
                dispatches.append(_read_dispatch(getattr(table, name)(i), keys, i))
        lists[name] = tuple(dispatches)
    return StateGuardPlan(tuple(tensors), table.SlotBytes(), table.FlagsBytes(), lists["Save"], lists["Restore"])


def _read(root) -> Schedule:
    version = root.FormatVersion()
    if version != SCHEDULE_FORMAT_VERSION:
        raise ScheduleFormatError(f"schedule format version {version}; this vktrain reads version "
                                  f"{SCHEDULE_FORMAT_VERSION}")
    buffers = []
    for i in range(root.BuffersLength()):
        with reading(f"Schedule.buffers[{i}]", ScheduleFormatError):
            table = root.Buffers(i)
            if table.Role() >= len(ROLES):
                raise ScheduleFormatError(f"buffer {i} has unknown role {table.Role()}")
            buffers.append(ScheduleBuffer(_text(table.Key()), table.SizeBytes(), ROLES[table.Role()]))
    keys = [buffer.key for buffer in buffers]
    placements = []
    for i in range(root.PlacementsLength()):
        with reading(f"Schedule.placements[{i}]", ScheduleFormatError):
            value_id, buffer, offset, size_bytes = table_scalars(root.Placements(i), _PLACEMENT_FIELDS)
            placements.append(TensorPlacement(value_id, _buffer_key(keys, buffer, f"placement {i}"), offset,
                                              size_bytes))
    dispatches = []
    for i in range(root.DispatchesLength()):
        with reading(f"Schedule.dispatches[{i}]", ScheduleFormatError):
            dispatches.append(_read_dispatch(root.Dispatches(i), keys, i))
    with reading("Schedule.requirements", ScheduleFormatError):
        needs = root.Requirements()
        if needs is None:
            raise ScheduleFormatError("the schedule has no requirements table")
        requirements = ScheduleRequirements(
            _text(needs.Api()), needs.MaxStorageBufferRange(), needs.MinStorageBufferOffsetAlignment(),
            needs.MaxSharedMemoryBytes(), needs.MaxWorkgroupInvocations(), needs.MaxWorkgroupSizeX(),
            needs.SubgroupSize(), _texts(needs, "SubgroupOperations"), bool(needs.Float16()), bool(needs.Int64()),
            scalar_vector(needs, "CooperativeMatrix"))
    with reading("Schedule.gemm", ScheduleFormatError):
        table = root.Gemm()
        if table is None:
            raise ScheduleFormatError("the schedule has no gemm table")
        gemm = PlannedGemm(_text(table.Precision()), bool(table.TensorCores()), _text(table.Reason()),
                           bool(table.Emulate()), table.SubgroupSize(), table.MinWorkgroups(),
                           table.SplitMinWorkgroups(), table.SplitTargetWorkgroups(), _text(table.Fp32Tuning()),
                           bool(table.Wgsl()))
    guard = None
    with reading("Schedule.state_guard", ScheduleFormatError):
        if root.StateGuard() is not None:
            guard = _read_guard(root.StateGuard(), keys)
    with reading("Schedule", ScheduleFormatError):
        try:
            return Schedule(_text(root.GraphDigest()), requirements, gemm, tuple(buffers), tuple(placements),
                            tuple(dispatches), _texts(root, "TensorCoreOps"), root.MaxBindingBytes(), guard)
        except ScheduleError as exc:
            raise ScheduleFormatError(str(exc)) from None


def deserialize_schedule(data: bytes | bytearray | memoryview) -> Schedule:
    """The Schedule `serialize_schedule` wrote; ScheduleFormatError for anything else."""
    data = bytes(data)
    if len(data) < 8 or data[4:8] != SCHEDULE_IDENTIFIER:  # the schema's own identifier is the blob's
        raise ScheduleFormatError(f"not a vktrain schedule: {len(data)} bytes without the "
                                  f"{SCHEDULE_IDENTIFIER.decode()} identifier")
    with reading("Schedule", ScheduleFormatError):
        return _read(FbSchedule.Schedule.GetRootAs(data, 0))


def placements_sorted(placements: Iterable[TensorPlacement]) -> tuple[TensorPlacement, ...]:
    """Placements in the schedule's order (by value id)."""
    return tuple(sorted(placements, key=lambda placement: placement.value_id))


__all__ = ["module_dispatches", "API_VULKAN", "API_WEBGPU", "GUARD_FLAGS", "GUARD_KEYS", "GUARD_RESULT", "GUARD_RESULT_BYTES", "GUARD_SLOT",
           "GuardedTensor", "PlannedGemm", "ROLES", "SCHEDULE_FORMAT_VERSION", "SHARED_PREFIX", "Schedule",
           "ScheduleBuffer", "StateGuardPlan", "ScheduleFormatError", "ScheduleMismatchError", "ScheduleRequirements",
           "TensorPlacement", "deserialize_schedule", "graph_digest", "serialize_schedule"]
