"""GraphExecutor: a VkGraph (the delegate blob) on a Device, run from its Schedule: recorded once, replayed
per call.

The AOT backend (vktrain/backend/passes) made every storage decision and recorded it per tensor
(CONTRACTS.md "Delegate graph conventions"); kernel planning (vktrain/backend/kernel_planning, the AOT side)
turns the graph and a device profile into a Schedule (vktrain/serialization/schedule.py: the buffer table,
the tensor placements, the Dispatch list); this executor carries the schedule out and decides nothing. It
is given the schedule (the program layer obtains it: vktrain/runtime/program/schedules.py).

Load time (everything that can fail fails here, never at step time):
  1. the schedule, checked: verified against this graph (serialization/verify_schedule.py; not one the
     caller's planner just made, `verify=False`), relying on nothing the device lacks (ScheduleMismatchError
     names what it lacks), binding the shared tensors it was given;
  2. storage: one Buffer per entry of its buffer table; constants uploaded once, converted to their stored
     dtype (W_4X8 weights stay packed; a synthetic constant, benchmark blobs only, is generated here from
     its seed, then uploaded the same way); mutable state set to its initial value;
  3. ONE Program records every Dispatch.

Per call: write the inputs (converted to their stored dtype: int64 -> int32 with a range check; index
inputs checked against the embedding / logits they index), replay, read the outputs only (converted
back to their graph dtype).

GEMM precision (docs/PRECISION.md): the one device decision, made by the planner. The blob lists the
precision policies the program allows; the planner's `precision` picks one and selects the GEMM route its op
lowerings follow on the device; the schedule records it (PlannedGemm) and `gemm_report()` says what it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from vktrain.serialization import graph as vk

from vktrain.runtime.vk.commands import Program
from vktrain.runtime.vk.memory import Buffer
from vktrain.errors import GraphLoweringError
from vktrain.serialization.schedule_memory import (TRANSIENT_ROLES, check_allocations, check_memory_budget, owned_bytes,
                                                   reused_buffers)
from vktrain.runtime.device_profiles import planning_profile, profile_of
from vktrain.serialization.schedule import SHARED_PREFIX, Schedule, ScheduleMismatchError, TensorPlacement
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.embedded import ShaderModule
from vktrain.serialization.verify_schedule import verify_schedule
from vktrain.runtime_shaders.build import source_names
from vktrain.errors import VktrainError

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# The ops whose products a GEMM kernel computes (those a GemmRoute may move to the tensor cores).
GEMM_OPS = frozenset({"vktrain.linear_q4gsw.default", "vktrain.linear_q4gsw_backward.default",
                      "vktrain.linear_dW.default", "aten.mm.default", "aten.bmm.default", "aten.addmm.default",
                      "vktrain.mm_scaled.default",
                      "vktrain.causal_attention.default", "vktrain.causal_attention_backward.default"})


# The embedding lookups and the argument holding their indices: aten.embedding(weight, indices), and the
# Q8_0 table the backend's q8_0_weights pass writes, vktrain.embedding_q8_0(codes, scales, indices).
EMBEDDING_INDEX_ARG = {"aten.embedding.default": 1, "vktrain.embedding_q8_0.default": 2}


def shader_sources() -> frozenset[str]:
    """The kernel sources this runtime has (the base names a Dispatch's shader may have)."""
    return frozenset(source_names())


class ExecutorInputError(VktrainError, ValueError):
    """An input or state array does not match what the graph expects (shape, dtype, range)."""


def _to_stored_array(array: np.ndarray, tensor: vk.TensorValue, what: str) -> np.ndarray:
    """`array` (of graph dtype `tensor.dtype`) as the bytes stored for it (int64 -> range-checked int32)."""
    stored = tensor.storage_dtype
    if stored != tensor.dtype:
        if (tensor.dtype, stored) != (vk.DType.INT64, vk.DType.INT32):
            raise GraphLoweringError(f"{what}: storing {tensor.dtype.name} as {stored.name} is not supported "
                                     f"(only int64 as int32)")
        if array.dtype.kind not in "iu":
            raise ExecutorInputError(f"{what} must hold integers (graph dtype int64), got {array.dtype}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < _INT32_MIN or high > _INT32_MAX:
                raise ExecutorInputError(
                    f"{what} holds values in [{low}, {high}]; int64 tensors are int32 on the GPU, so values "
                    f"must lie in [{_INT32_MIN}, {_INT32_MAX}]")
        return np.ascontiguousarray(array, dtype=np.int32)
    expected = stored.numpy_dtype
    if stored in (vk.DType.FLOAT32, vk.DType.FLOAT16):
        if array.dtype.kind != "f":
            raise ExecutorInputError(f"{what} must be floating point (graph dtype {expected}), got {array.dtype}")
        return np.ascontiguousarray(array, dtype=expected)
    if array.dtype != expected:
        raise ExecutorInputError(f"{what} has dtype {array.dtype}, the graph expects {expected}")
    return np.ascontiguousarray(array)


@dataclass(frozen=True)
class SharedTensor:
    """A tensor another executor of the same program owns (its buffer and byte offset, and its record), for
    this executor to bind instead of storage of its own: how a .pte's eval method reads the training
    step's LoRA state without a copy."""

    buffer: Buffer
    offset: int
    tensor: vk.TensorValue


class GraphExecutor:
    """Runs one VkGraph on `device` by its `schedule` (a Schedule planned for this graph: the program layer's
    vktrain/runtime/program/schedules.py `method_schedule`, or vktrain.backend.kernel_planning.plan_schedule,
    or one read back with deserialize_schedule). See the module docstring for what happens at load and per
    call.

    `run(*inputs)` takes arrays in `input_names` order and returns the outputs (numpy, graph dtypes).
    `read_state(name)` / `write_state(name, array)` / `reset_state()` access the mutable state by the
    names the exporter recorded (parameter / buffer FQNs); `timings()` gives (label, seconds) per
    dispatch of the last call. `staging=True` forces staging copies for every host access (the path a
    discrete GPU takes; tests use it on unified devices). The schedule carries the GEMM precision, the
    tensor-core emulation and the binding limit it was planned with. `verify=False` skips the structural
    verifier for a schedule the caller's planner just made for this graph in this process (the program layer's
    MethodSchedule says which); the requirement and shared-tensor checks run for every schedule.

    `shared` (name -> SharedTensor, e.g. another executor's `shared_state()`): a constant or state tensor
    of this graph with one of these names binds that buffer (same shape and stored dtype, checked) instead
    of storage of its own; this executor never uploads, resets or frees it. That is how the methods of
    one program share their weights and state on the device (eval reads the training step's adapters;
    generation's decode reads prefill's KV caches). The schedule must have been planned with the same
    `shared` (its "shared:<name>" buffers, at the offsets given here: checked).

    `arena`: another executor of the program that never runs while this one does (the accumulate method's
    executor: the training step's): this one's intermediate and scratch buffers reuse that one's
    (serialization/schedule_memory.py reused_buffers) where they fit, so the two hold one set of activations; only the excess is
    allocated (and counted in owned_bytes).

    `resident_bytes`: the device memory the program's other executors already hold (eval's executor: the
    training step's), counted with this one's own buffers against an emulated profile's memory budget.

    `schedule`: the Schedule this executor runs (the program layer obtains it: embedded in the blob, or from
    the caller's planner; vktrain.runtime.program.schedules.method_schedule); `verify=False` skips its
    verification (a schedule the caller's planner just made for this graph).

    `modules` (shader name -> embedded ShaderModule) and `target_profile`: a schedule embedded in the blob
    (vktrain/runtime/program/embedded.py) runs with the pipelines built from the blob's modules, not the local
    SPIR-V / WGSL; `target_profile` is the profile it was planned for (its max_dispatches_per_submit bounds a
    submit where set; the program's other methods run that profile's schedules).
    """

    def __init__(self, device, graph: vk.VkGraph, schedule: Schedule, *, timing: bool = True,
                 staging: bool | None = None, shared: dict[str, SharedTensor] | None = None, resident_bytes: int = 0,
                 arena: "GraphExecutor | None" = None, verify: bool = True,
                 modules: Mapping[str, ShaderModule] | None = None, target_profile: DeviceProfile | None = None):
        if not isinstance(schedule, Schedule):
            raise TypeError(f"a GraphExecutor runs a Schedule planned for its graph (the program layer obtains it: "
                            f"vktrain.runtime.program.schedules.method_schedule), got {type(schedule).__name__}")
        graph.validate()
        self.device = device
        self._staging = staging  # Buffer's access path: None = direct on unified memory, else staging
        self._shared = dict(shared or {})
        self._borrowed: set[str] = set()  # buffer keys of shared tensors: another executor owns them
        self.graph = graph
        self.ops: list[vk.OpCall] = graph.ops
        self._buffers: dict[str, Buffer] = {}
        self.program: Program | None = None
        self._modules = dict(modules) if modules is not None else None
        self.modules = self._modules  # the state guard builds its pipelines from the same modules
        self.target_profile = target_profile
        self._state_by_name = self._index_state()
        self._index_limits = self._find_index_limits()
        # What the schedule must fit: the device's own profile, or VKTRAIN_DEVICE_PROFILE's emulated on it.
        self.profile = planning_profile(device)
        self.emulating = self.profile != profile_of(device)
        self._check_schedule(schedule, verify)
        # Buffer key -> the arena's Buffer it reuses (one the arena owns, holding only transient values).
        offered = arena.transient_buffers() if arena is not None else {}
        self._reused = {key: offered[theirs] for key, theirs in
                        reused_buffers(schedule, {k: b.size for k, b in offered.items()}).items()}
        reused_bytes = sum(b.size_bytes for b in schedule.buffers if b.key in self._reused)
        if self.emulating:  # the device's own cap is the driver's business; an emulated one is checked here
            check_allocations(schedule, self.profile)
            check_memory_budget(schedule, self.profile, resident_bytes - reused_bytes)
        # What this executor allocates, and with the other executors of the program whose memory it counts.
        self.owned_bytes = owned_bytes(schedule) - reused_bytes
        self.program_bytes = self.owned_bytes + resident_bytes
        self.schedule = schedule
        self.gemm_route = schedule.gemm  # the GEMM route it was planned with (PlannedGemm)
        self.max_binding_bytes = schedule.max_binding_bytes or None
        self.tensor_core_ops: list[str] = list(schedule.tensor_core_ops)  # labels of the ops on the coopmat kernels
        self.dispatches = list(schedule.dispatches)
        self._tensors: dict[int, TensorPlacement] = {p.value_id: p for p in schedule.placements}
        try:
            self._allocate_buffers()
            self._upload_constants()
            self.reset_state()  # of the state it owns: shared state keeps its contents
            # A phone profile bounds the dispatches per submit (its GPU watchdog): Program cuts the step there.
            bound = (target_profile.max_dispatches_per_submit if target_profile is not None else 0) \
                or self.profile.max_dispatches_per_submit
            self.program = Program(device, self.dispatches, self._buffers, timing=timing,
                                   max_dispatches_per_submit=bound, modules=self._modules)
        except BaseException:
            self.close()
            raise
        self._ran = False

    # ------------------------------------------------------------------------------ naming
    @property
    def input_names(self) -> list[str]:
        return [self.graph.tensor(v).name or f"input{i}" for i, v in enumerate(self.graph.inputs)]

    @property
    def output_names(self) -> list[str]:
        return [self.graph.tensor(v).name or f"output{i}" for i, v in enumerate(self.graph.outputs)]

    @property
    def state_names(self) -> list[str]:
        return list(self._state_by_name)

    def _index_state(self) -> dict[str, vk.MutableState]:
        by_name: dict[str, vk.MutableState] = {}
        inputs = set(self.graph.inputs)
        for state in self.graph.mutable_state:
            if state.state_id in inputs:
                raise GraphLoweringError(f"mutable state value {state.state_id} is also a graph input")
            name = self.graph.tensor(state.state_id).name or f"state{state.state_id}"
            if name in by_name:
                raise GraphLoweringError(f"two mutable state tensors are named {name!r}; state names must be unique")
            by_name[name] = state
        return by_name

    def _find_index_limits(self) -> dict[int, list[tuple[int | None, int, str]]]:
        """Graph input -> [(lowest allowed value or None, exclusive upper bound, what it indexes)] for
        inputs used as indices.

        A kernel cannot raise: an embedding index out of range reads a NaN row and a fused_ce label >= V
        is silently ignored, where the CPU reference raises. So the executor checks such inputs on the
        host. Inputs are followed through the views recorded in the blob (the labels are flattened first).
        """
        uses = []  # (index tensor, low, bound, description)
        for index, op in enumerate(self.ops):
            if op.name in EMBEDDING_INDEX_ARG:  # (table or its codes, ..., indices)
                rows = self.graph.tensor(op.args[0]).shape[0]
                indices = op.args[EMBEDDING_INDEX_ARG[op.name]]
                uses.append((indices, 0, rows, f"row of the {rows}-row embedding of op {index}"))
            elif op.name == "vktrain.fused_ce.default":  # labels < 0 are ignored rows
                vocab = self.graph.tensor(op.args[0]).shape[-1]
                uses.append((op.args[1], None, vocab, f"class of the {vocab}-wide logits of op {index} (fused_ce)"))
        limits: dict[int, list[tuple[int | None, int, str]]] = {}
        inputs = set(self.graph.inputs)
        for value_id, low, bound, what in uses:
            tensor = self.graph.tensor(value_id)
            if tensor.is_view:
                value_id = tensor.storage_of
            if value_id in inputs:
                limits.setdefault(value_id, []).append((low, bound, what))
        return limits

    @property
    def index_limits(self) -> dict[str, int]:
        """Input name -> exclusive upper bound of its values, for inputs used as indices (token ids: the
        embedding's rows; labels: the logits' classes). Checked on every run()."""
        names = dict(zip(self.graph.inputs, self.input_names))
        return {names[value_id]: min(bound for _, bound, _ in uses) for value_id, uses in self._index_limits.items()}

    def _check_index_input(self, name: str, value_id: int, array: np.ndarray) -> None:
        if not array.size:
            return
        for low, bound, what in self._index_limits.get(value_id, ()):
            for bad, position in ((int(array.max()), int(array.argmax())), (int(array.min()), int(array.argmin()))):
                if bad >= bound or (low is not None and bad < low):
                    where = [int(i) for i in np.unravel_index(position, array.shape)]
                    allowed = f"[{low}, {bound})" if low is not None else f"< {bound}"
                    raise ExecutorInputError(f"input {name!r} holds {bad} at {where}, but it must be a {what} "
                                             f"({allowed})")

    # ------------------------------------------------------------------------------ storage
    def _check_schedule(self, schedule: Schedule, verify: bool) -> None:
        """Refuse a schedule that fails verification against this graph (serialization/verify_schedule.py; where
        `verify`), that relies on what this device lacks, or that binds shared tensors this executor was not
        given (or at other offsets), naming what is wrong."""
        if verify:
            known = shader_sources() if self._modules is None else {m.name.partition("@")[0]
                                                                    for m in self._modules.values()}
            verify_schedule(schedule, self.graph, known)
        missing = schedule.requirements.unmet_by(self.profile)
        if missing:
            raise ScheduleMismatchError(f"the schedule does not fit {getattr(self.device, 'name', 'this device')}: "
                                        f"it relies on {'; '.join(missing)}")
        for placement in schedule.placements:
            if not placement.key.startswith(SHARED_PREFIX):
                continue
            name = placement.key.removeprefix(SHARED_PREFIX)
            if name not in self._shared:
                raise ScheduleMismatchError(f"the schedule binds tensor {name!r} of another executor (shared), "
                                            f"which this executor was not given")
            if self.graph.values[placement.value_id].storage_of < 0 and placement.offset != self._shared[name].offset:
                raise ScheduleMismatchError(f"the schedule binds shared tensor {name!r} at byte {placement.offset}, "
                                            f"the executor sharing it holds it at byte {self._shared[name].offset}")

    def _allocate_buffers(self) -> None:
        """One Buffer per entry of the schedule's buffer table; a shared one is the other executor's."""
        for entry in self.schedule.buffers:
            if entry.role == "shared":
                self._buffers[entry.key] = self._shared[entry.key.removeprefix(SHARED_PREFIX)].buffer
                self._borrowed.add(entry.key)
            elif entry.key in self._reused:
                self._buffers[entry.key] = self._reused[entry.key]
                self._borrowed.add(entry.key)
            else:
                self._buffers[entry.key] = Buffer(self.device, entry.size_bytes, name=entry.key, staging=self._staging)

    def _upload_constants(self) -> None:
        uploaded = set()
        self.synthetic_constant_bytes = 0  # bytes generated at load (vk.SyntheticConstant), for reports
        for value_id, placement in self._tensors.items():
            tensor = self.graph.values[value_id]
            if tensor.constant_id < 0 or placement.key in uploaded or placement.key in self._borrowed:
                continue
            # A synthetic constant is generated here (numpy, deterministic by its seed); the array is
            # dropped right after its upload, so at most one big constant is in host memory at a time.
            array = self.graph.constant_array(value_id)
            if self.graph.is_synthetic(tensor.constant_id):
                self.synthetic_constant_bytes += array.nbytes
            what = f"constant {tensor.name or value_id}"
            try:
                data = _to_stored_array(array, tensor, what)
            except ExecutorInputError as exc:
                raise GraphLoweringError(str(exc)) from None
            self._write(value_id, data)
            uploaded.add(placement.key)

    # ------------------------------------------------------------------------------ running
    def run(self, *inputs: Any) -> list[np.ndarray]:
        """Write `inputs` (in `input_names` order), replay the recorded step, return the outputs."""
        self._check_open()
        if len(inputs) != len(self.graph.inputs):
            raise ExecutorInputError(f"the graph takes {len(self.graph.inputs)} inputs ({', '.join(self.input_names)}), "
                                     f"got {len(inputs)}")
        staged = []
        for name, value_id, array in zip(self.input_names, self.graph.inputs, inputs):
            tensor = self.graph.tensor(value_id)
            array = np.asarray(array)
            if array.shape != tensor.shape:
                raise ExecutorInputError(f"input {name!r} has shape {list(array.shape)}, expected {list(tensor.shape)}")
            data = _to_stored_array(array, tensor, f"input {name!r}")
            self._check_index_input(name, value_id, data)
            staged.append((value_id, data))
        for value_id, data in staged:
            self._write(value_id, data)
        self.program.replay()
        self._ran = True
        return [self._read(value_id) for value_id in self.graph.outputs]

    __call__ = run

    def _write(self, value_id: int, stored: np.ndarray) -> None:
        placement = self._tensors[value_id]
        self._buffers[placement.key].write(stored, placement.offset)

    def _read(self, value_id: int) -> np.ndarray:
        tensor, placement = self.graph.tensor(value_id), self._tensors[value_id]
        stored = self._buffers[placement.key].read(tensor.storage_dtype.numpy_dtype, tensor.shape, placement.offset)
        return stored.astype(tensor.dtype.numpy_dtype, copy=False)

    def timings(self) -> list[tuple[str, float]] | None:
        """(dispatch label, seconds) for each dispatch of the last run; None without GPU timestamps."""
        self._check_open()
        if not self._ran:
            raise RuntimeError("timings() before the first run()")
        seconds = self.program.timings()
        if seconds is None:
            return None
        return [(dispatch.name, value) for dispatch, value in zip(self.dispatches, seconds)]

    # ------------------------------------------------------------------------------ state
    def _state(self, name: str) -> vk.MutableState:
        try:
            return self._state_by_name[name]
        except KeyError:
            raise KeyError(f"no mutable state named {name!r}; the graph has {self.state_names}") from None

    def read_state(self, name: str) -> np.ndarray:
        """A copy of mutable state `name` (e.g. "model.layers.0.lora_A") as it is after the last run."""
        self._check_open()
        return self._read(self._state(name).state_id)

    def write_state(self, name: str, array: Any) -> None:
        """Overwrite mutable state `name` (restoring a checkpoint); shape must match, dtype must be compatible."""
        self._check_open()
        self._write_state(name, array)

    def read_states(self, names: list[str]) -> dict[str, np.ndarray]:
        """read_state of each of `names`, bit for bit, in one transfer (Buffer.read_pieces)."""
        self._check_open()
        ids = [self._state(name).state_id for name in names]
        tensors = [self.graph.tensor(value_id) for value_id in ids]
        placements = [self._tensors[value_id] for value_id in ids]
        pieces = [(self._buffers[p.key], t.stored_nbytes, p.offset)
                  for t, p in zip(tensors, placements)]
        raws = type(pieces[0][0]).read_pieces(pieces) if pieces else []
        return {name: raw.view(t.storage_dtype.numpy_dtype).reshape(t.shape).astype(t.dtype.numpy_dtype, copy=False)
                for name, t, raw in zip(names, tensors, raws)}

    def write_states(self, arrays: Mapping[str, Any], zeroed: Sequence[str] = ()) -> None:
        """write_state of each (name, array) of `arrays`, bit for bit, and all-zero bytes (0.0) into each state
        of `zeroed`, in one transfer (Buffer.write_pieces: zeros filled on the device); every array is checked
        before any is written."""
        self._check_open()
        both = sorted(set(zeroed) & set(arrays))
        if both:
            raise ExecutorInputError(f"states {both[:3]} are both written and zeroed; give each one or the other")
        zeros = []
        for name in zeroed:
            state = self._state(name)
            placement = self._tensors[state.state_id]
            zeros.append((self._buffers[placement.key], self.graph.tensor(state.state_id).stored_nbytes,
                          placement.offset))
        pieces = []
        for name, array in arrays.items():
            state_id, stored = self._stored_state(name, array)
            placement = self._tensors[state_id]
            pieces.append((self._buffers[placement.key], stored, placement.offset))
        if pieces or zeros:
            type((pieces or zeros)[0][0]).write_pieces(pieces, zeros)

    def _stored_state(self, name: str, array: Any) -> tuple[int, np.ndarray]:
        """State `name`'s tensor id and `array` in its stored form, refused if the shape differs."""
        state = self._state(name)
        tensor = self.graph.tensor(state.state_id)
        array = np.asarray(array)
        if array.shape != tensor.shape:
            raise ExecutorInputError(f"state {name!r} has shape {list(tensor.shape)}, got an array of shape "
                                     f"{list(array.shape)}")
        return state.state_id, _to_stored_array(array, tensor, f"state {name!r}")

    def _write_state(self, name: str, array: Any) -> None:
        self._write(*self._stored_state(name, array))

    def initial_state(self, name: str) -> np.ndarray:
        """The value state `name` had when the graph was exported (zeros unless it has an initial constant)."""
        state = self._state(name)
        tensor = self.graph.tensor(state.state_id)
        if state.initial_constant_id < 0:
            return np.zeros(tensor.shape, tensor.dtype.numpy_dtype)
        data = vk.constant_bytes(self.graph.constants[state.initial_constant_id])  # generates a synthetic one
        return np.frombuffer(data, tensor.dtype.numpy_dtype, tensor.numel).reshape(tensor.shape).copy()

    def reset_state(self) -> None:
        """Every mutable state tensor this executor owns back to its initial value."""
        for name, state in self._state_by_name.items():
            if self._tensors[state.state_id].key not in self._borrowed:
                self._write_state(name, self.initial_state(name))

    def shared_constants(self) -> dict[str, SharedTensor]:
        """Named constant tensors this executor uploaded, by name, for another executor of the same program
        to bind (`shared`) where its constant holds the same bytes (a name read in two layouts is left out)."""
        self._check_open()
        found: dict[str, list[int]] = {}
        for value_id, placement in self._tensors.items():
            tensor = self.graph.values[value_id]
            if tensor.constant_id >= 0 and tensor.name and tensor.storage_of < 0 and placement.key not in self._borrowed:
                found.setdefault(tensor.name, []).append(value_id)
        return {name: SharedTensor(self._buffers[self._tensors[ids[0]].key], self._tensors[ids[0]].offset,
                                   self.graph.tensor(ids[0]))
                for name, ids in found.items() if len(ids) == 1}

    def constants_matching(self, graph: vk.VkGraph) -> dict[str, SharedTensor]:
        """This executor's named constants that `graph` (another method of the same program) holds byte for
        byte under the same name, shape, dtype and layout: for that graph's executor to bind (`shared`)
        rather than upload a second copy (the frozen base of eval, prefill and decode)."""
        theirs = self.shared_constants()
        same = {}
        for value in graph.values:
            if not (isinstance(value, vk.TensorValue) and value.constant_id >= 0 and value.name in theirs):
                continue
            owner = theirs[value.name]
            if (owner.tensor.shape, owner.tensor.dtype, owner.tensor.layout) != (value.shape, value.dtype, value.layout):
                continue
            if owner.tensor.storage_dtype != value.storage_dtype:
                continue
            if vk.same_stored_bytes(graph.constants[value.constant_id], self.graph.constants[owner.tensor.constant_id]):
                same[value.name] = owner
        return same

    def transient_buffers(self) -> dict[str, Buffer]:
        """The buffers this executor owns whose contents live only within one call (intermediates, op
        scratch), by key: for an executor that never runs at the same time to reuse (`arena`)."""
        return {b.key: self._buffers[b.key] for b in self.schedule.buffers
                if b.role in TRANSIENT_ROLES and b.key not in self._borrowed}

    def bound_buffers(self) -> dict[str, Buffer]:
        """Every buffer the schedule's bindings name, by key: its own, and those it binds of another executor
        (what the state guard's dispatches bind: StateGuard.for_executor)."""
        self._check_open()
        return dict(self._buffers)

    def shared_state(self) -> dict[str, SharedTensor]:
        """Every mutable state tensor by name, for another executor of the same program to bind (`shared`)."""
        self._check_open()
        return {name: SharedTensor(self._buffers[self._tensors[state.state_id].key],
                                   self._tensors[state.state_id].offset, self.graph.tensor(state.state_id))
                for name, state in self._state_by_name.items()}

    # ------------------------------------------------------------------------------ introspection
    def storage_of(self, value_id: int) -> str:
        """The buffer key value `value_id` lives in ("mem3", "state0", "constant2", "value17", ...)."""
        return self._tensors[value_id].key

    def gemm_report(self) -> str:
        """The GEMM precision chosen at load and how many ops took the tensor cores (train's startup line)."""
        gemms = sum(op.name in GEMM_OPS for op in self.ops)
        report = f"{self.gemm_route.describe()}; {len(self.tensor_core_ops)} of {gemms} GEMM ops on {self.gemm_route.fp16_kernels}"
        kernel_report = getattr(self.device, "kernel_report", None)  # WebGPU: the WGSL feature bodies taken
        return report if kernel_report is None else f"{report}; {kernel_report()}"

    @property
    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of every buffer this executor allocated, by key (not those it binds from another: `shared`)."""
        return {key: buffer.size for key, buffer in self._buffers.items() if key not in self._borrowed}

    # ------------------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self.program is None:
            raise RuntimeError("this GraphExecutor was closed")

    def close(self) -> None:
        """Free the Program and every buffer (idempotent)."""
        if self.program is not None:
            self.program.destroy()
            self.program = None
        for key, buffer in self._buffers.items():
            if key not in self._borrowed:
                buffer.destroy()
        self._buffers.clear()

    def __enter__(self) -> "GraphExecutor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["ExecutorInputError", "GraphExecutor", "GraphLoweringError", "SharedTensor"]
