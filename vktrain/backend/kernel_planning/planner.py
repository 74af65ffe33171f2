"""The planner: a VkGraph and a DeviceProfile -> its Schedule (vktrain/serialization/schedule.py), with no
device object in sight.

`plan_schedule(graph, profile, ...)` is a pure function of the graph, the device profile (what planning reads
of a device: vktrain/serialization/device_profile.py; `vktrain.runtime.device_profiles.profile_of(device)`
gives an opened device's, and a built-in or a profile file plans for a device that is not here), the GEMM
precision policy, the binding limit, and the SharedTensors' offsets. It carries out the storage the AOT
backend recorded per tensor (CONTRACTS.md "Delegate graph conventions") and lowers every op through the
op-lowering table (op_lowering.py):

  1. storage: one buffer per memory object (its planned size), per constant (one upload however many
     values read it), per input, per mutable state tensor and per tensor with storage of its own but no
     memory object; a tensor with `storage_of` binds that tensor's buffer (a view reads it through its
     recorded strides); a constant or state tensor named in `shared` binds the other executor's buffer;
  2. dispatches: every op through its lowering, except ops whose outputs are all views (they move no
     data); a 4-bit base GEMM that adds an addmm's rank-r product in its tensor-core epilogue runs in the
     addmm's place (rank_epilogue.py); state updates not stored in their state are copied at the end of
     the step; op-owned scratch lives in one buffer;
  3. what the result relies on from the device (ScheduleRequirements), and the GEMM route it took;
  4. with `state_guard` (a training step), the state guard's dispatches (state_guard.py) over the state's
     buffers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Mapping

from vktrain.contract import PRECISION_AUTO
from vktrain.serialization import graph as vk
from vktrain.serialization.device_profile import API_WEBGPU, SUBGROUP_OPERATIONS, WEBGPU_DEVICE_TYPE, DeviceProfile
from vktrain.serialization.schedule import (SHARED_PREFIX, PlannedGemm, Schedule, ScheduleBuffer,
                                            ScheduleRequirements, TensorPlacement, graph_digest)
from vktrain.serialization.strided_view import StridedView
from vktrain.errors import GraphLoweringError
from vktrain.backend.kernel_planning.lowering_context import OpContext, TensorArg
from vktrain.backend.kernel_planning.op_lowering import copy_words, lowering_for
from vktrain.backend.kernel_planning.rank_epilogue import fused_plan, rank_epilogue_pairs
from vktrain.backend.kernel_planning.state_guard import plan_state_guard
from vktrain.backend.kernel_planning.kernels.coopmat import FRAGMENT, GemmRoute, WGSL_F16_FEATURE, select_gemm_route
from vktrain.contract import allowed_precisions
from vktrain.backend.kernel_planning.kernels.gemm_tuning import CPU_SUBGROUP_SIZE, CPU_TUNING, select_gemm_tuning
from vktrain.backend.kernel_planning.kernels.layout import binding_limit_of
from vktrain.serialization.dispatch import BufferBinding, Dispatch

TENSOR_CORE_SHADER_PREFIX = "coopmat_"
FP16_VARIANT_DEFINE = "FP16"  # the fp32 GEMM kernels' fp16-operand variant (the fp16 policy: kernels/linear.py)


def runs_fp16_kernel(shader: str) -> bool:
    """Whether a dispatch of `shader` is one of the route's fp16-input GEMMs (what Schedule.tensor_core_ops
    counts): a tensor-core (or f16 WGSL) kernel, or an FP16 variant; not coopmat_absmax, the scales' pass."""
    base, _, defines = shader.partition("@")
    return (base.startswith(TENSOR_CORE_SHADER_PREFIX) and base != "coopmat_absmax") or \
        FP16_VARIANT_DEFINE in defines.split("+")
MIN_MAX_BINDING_BYTES = 1 << 20  # the least max_binding_bytes: every split kernel's windows fit it
SCRATCH_KEY = "scratch"
SCRATCH_ALIGN = 256  # >= minStorageBufferOffsetAlignment of every Vulkan device (the spec caps it at 256)


def binding_limited(profile: DeviceProfile, max_binding_bytes: int | None) -> DeviceProfile:
    """`profile` with its max storage binding size lowered to `max_binding_bytes` (None: as it is; above the
    profile's own: refused)."""
    if max_binding_bytes is None:
        return profile
    if isinstance(max_binding_bytes, bool) or not isinstance(max_binding_bytes, int) \
            or max_binding_bytes < MIN_MAX_BINDING_BYTES:
        raise GraphLoweringError(f"max_binding_bytes (the max storage binding size, --max-binding-mib) must be an "
                                 f"int >= {MIN_MAX_BINDING_BYTES} (1 MiB, the least vktrain's split kernels need), "
                                 f"got {max_binding_bytes!r}")
    limit = profile.max_storage_buffer_range
    if max_binding_bytes > limit:  # it lowers the device's limit, never raises it
        raise GraphLoweringError(f"max_binding_bytes (--max-binding-mib) {max_binding_bytes} is above the device's "
                                 f"max storage binding size of {limit} bytes ({limit / (1 << 20):.1f} MiB); it can "
                                 f"only lower it: give at most {limit >> 20}, or leave it out")
    return replace(profile, max_storage_buffer_range=max_binding_bytes)


@dataclass(frozen=True)
class ProfileAsDevice:
    """A DeviceProfile under the Device attribute names select_gemm_route (kernels/coopmat.py) and
    select_gemm_tuning (kernels/gemm_tuning.py) read, so they choose from the profile alone."""

    profile: DeviceProfile

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def device_type(self) -> str:
        return WEBGPU_DEVICE_TYPE if self.profile.api == API_WEBGPU else self.profile.device_type

    @property
    def subgroup_size(self) -> int:
        return self.profile.subgroup_size

    @property
    def subgroup_operations(self) -> int:
        return sum(1 << bit for bit, name in enumerate(SUBGROUP_OPERATIONS) if name in self.profile.subgroup_operations)

    @property
    def features(self) -> frozenset[str]:
        if self.profile.api == API_WEBGPU:
            return self.kernel_features
        return frozenset({"shaderFloat16"} if self.profile.float16 else ()) | \
            frozenset({"shaderInt64"} if self.profile.int64 else ())

    @property
    def kernel_features(self) -> frozenset[str]:
        """A WebGPU profile's float16 is what its kernels may use (device_profiles.py)."""
        return frozenset({WGSL_F16_FEATURE} if self.profile.api == API_WEBGPU and self.profile.float16 else ())

    @property
    def cooperative_matrix_properties(self) -> tuple:
        return self.profile.cooperative_matrix


def gemm_route_for(graph: vk.VkGraph, profile: DeviceProfile, precision: str = PRECISION_AUTO, *,
                   emulate_tensor_cores: bool = False) -> GemmRoute:
    """The GemmRoute (kernels/coopmat.py) of `precision` for `graph` on a device with `profile`, with its fp32
    tuning."""
    device = ProfileAsDevice(profile)
    route = select_gemm_route(precision, allowed_precisions(graph.metadata), device, emulate=emulate_tensor_cores,
                              profile=profile)
    return replace(route, fp32_tuning=select_gemm_tuning(device))


def requirements_of(profile: DeviceProfile, route: GemmRoute) -> ScheduleRequirements:
    """What a schedule planned for `profile` (its binding limit applied) with `route` relies on from a device."""
    subgroup_size, operations, float16, int64, coopmat = 0, set(), False, False, ()
    if route.fp32_tuning == CPU_TUNING:  # the CPU bodies (kernels/gemm_tuning.py)
        subgroup_size, int64 = CPU_SUBGROUP_SIZE, True
        operations.add("shuffle")
    if route.fp16_simt or (route.tensor_cores and route.wgsl):  # the FP16 GEMM variants / the f16 WGSL kernels
        float16 = True
    elif route.tensor_cores:
        subgroup_size = route.subgroup_size
        if route.emulate:
            operations.add("basic")
            float16 = True
        else:
            coopmat = tuple(FRAGMENT)
    return ScheduleRequirements(
        api=profile.api, max_storage_buffer_range=profile.max_storage_buffer_range,
        min_storage_buffer_offset_alignment=profile.min_storage_buffer_offset_alignment,
        max_shared_memory_bytes=profile.max_shared_memory_bytes,
        max_workgroup_invocations=profile.max_workgroup_invocations,
        max_workgroup_size_x=profile.max_workgroup_size[0], subgroup_size=subgroup_size,
        subgroup_operations=tuple(name for name in SUBGROUP_OPERATIONS if name in operations), float16=float16,
        int64=int64, cooperative_matrix=coopmat)


def _align(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def _round4(nbytes: int) -> int:
    return max(4, -(-nbytes // 4) * 4)


@dataclass(frozen=True)
class _Tensor:
    """Where one tensor value lives while planning: the buffer key, the binding's offset and bytes, how
    it is read."""

    key: str
    offset: int
    nbytes: int
    view: StridedView | None  # a strided view of the buffer's tensor; None = contiguous


class _Planner:
    """One planning run (plan_schedule); holds the placements and the scratch high-water mark."""

    def __init__(self, graph: vk.VkGraph, profile: DeviceProfile, route: GemmRoute, shared: Mapping[str, Any]):
        self.graph, self.profile, self.route, self.shared = graph, profile, route, shared
        self.states = {s.state_id for s in graph.mutable_state}
        self.tensors: dict[int, _Tensor] = {}
        self.scratch_bytes = 0
        self.tensor_core_ops: list[str] = []

    # ------------------------------------------------------------------------------ storage
    def _shared_key(self, value_id: int) -> str | None:
        """The buffer key of a constant or state tensor bound to a SharedTensor, checked; else None."""
        tensor = self.graph.values[value_id]
        if tensor.name not in self.shared or (tensor.constant_id < 0 and value_id not in self.states):
            return None
        owner = self.shared[tensor.name].tensor
        if (owner.shape, owner.storage_dtype, owner.layout) != (tensor.shape, tensor.storage_dtype, tensor.layout):
            raise GraphLoweringError(
                f"tensor {tensor.name!r} is {tensor.storage_dtype.name}{list(tensor.shape)} ({tensor.layout.name}) "
                f"here but {owner.storage_dtype.name}{list(owner.shape)} ({owner.layout.name}) in the executor "
                f"sharing it; both must be the same tensor of one program")
        return SHARED_PREFIX + tensor.name

    def _own_key(self, value_id: int, constant_keys: dict[tuple[int, vk.DType, vk.Layout], str]) -> str:
        """The buffer key of a tensor with storage of its own."""
        tensor = self.graph.values[value_id]
        shared = self._shared_key(value_id)
        if shared is not None:
            return shared
        if tensor.constant_id >= 0:
            # Values reading the same constant bytes share one upload (unless they read it as another
            # dtype or layout, which the backend does not do today).
            identity = (tensor.constant_id, tensor.dtype, tensor.layout)
            if identity not in constant_keys:
                taken = any(other[0] == tensor.constant_id for other in constant_keys)
                constant_keys[identity] = f"constant{tensor.constant_id}" + (f".{value_id}" if taken else "")
            return constant_keys[identity]
        if value_id in self.states:
            return f"state{value_id}"  # persists across steps: never shared within a graph
        if tensor.mem_obj_id >= 0:
            return f"mem{tensor.mem_obj_id}"
        return f"value{value_id}"

    def place_tensors(self) -> None:
        """The recorded storage of every tensor the graph uses, as buffer keys and bindings."""
        constant_keys: dict[tuple[int, vk.DType, vk.Layout], str] = {}
        for value_id in self.graph.used_tensor_ids():
            tensor = self.graph.values[value_id]
            if tensor.storage_dtype == vk.DType.INT64:
                raise GraphLoweringError(f"value {value_id} ({tensor.name or 'unnamed'}) is stored as int64; the GPU "
                                         f"kernels hold int64 tensors as int32 (the backend's storage-dtype pass "
                                         f"records that: compile the graph with vktrain.backend.passes)")
            root = tensor.storage_of if tensor.storage_of >= 0 else value_id
            view = None
            if tensor.view_strides:
                view = StridedView(tensor.shape, tensor.view_strides, tensor.view_offset)
            key = self._own_key(root, constant_keys)
            offset = (self.shared[self.graph.values[root].name].offset if key.startswith(SHARED_PREFIX)
                      else tensor.mem_offset)
            self.tensors[value_id] = _Tensor(key, offset, _round4(tensor.stored_nbytes), view)

    def buffer_table(self) -> list[ScheduleBuffer]:
        """One buffer per storage key, in the order a runtime allocates them: the shared ones, then the own
        ones by key (a memory object's planned size, else the largest tensor bound to it), then scratch."""
        sizes = {f"mem{m.id}": _round4(m.size_bytes) for m in self.graph.memory_objects}
        for tensor in self.tensors.values():
            if not tensor.key.startswith("mem"):
                sizes[tensor.key] = max(sizes.get(tensor.key, 0), tensor.offset + tensor.nbytes)
        used = {tensor.key for tensor in self.tensors.values()}
        roles = self._roles()
        table = [ScheduleBuffer(key, sizes[key], "shared") for key in sorted(k for k in used
                                                                             if k.startswith(SHARED_PREFIX))]
        table += [ScheduleBuffer(key, nbytes, roles[key]) for key, nbytes in sorted(sizes.items())
                  if key in used and not key.startswith(SHARED_PREFIX)]
        if self.scratch_bytes:
            table.append(ScheduleBuffer(SCRATCH_KEY, self.scratch_bytes, "scratch"))
        return table

    def _roles(self) -> dict[str, str]:
        """Each buffer key's role: constant or state by what it holds, else input / output where a graph
        input / output lives in it, else intermediate."""
        rank = {"constant": 0, "state": 1, "input": 2, "output": 3, "intermediate": 4}
        inputs, outputs = set(self.graph.inputs), set(self.graph.outputs)
        roles: dict[str, str] = {}
        for value_id, placement in self.tensors.items():
            tensor = self.graph.values[value_id]
            role = ("constant" if tensor.constant_id >= 0 else "state" if value_id in self.states
                    else "input" if value_id in inputs else "output" if value_id in outputs else "intermediate")
            if placement.key not in roles or rank[role] < rank[roles[placement.key]]:
                roles[placement.key] = role
        return roles

    def binding(self, value_id: int) -> BufferBinding:
        tensor = self.tensors[value_id]
        return BufferBinding(tensor.key, tensor.offset, tensor.nbytes)

    # ------------------------------------------------------------------------------ dispatches
    def _tensor_arg(self, value_id: int) -> TensorArg:
        tensor = self.graph.tensor(value_id)
        return TensorArg(value_id, self.binding(value_id), tensor.shape, tensor.dtype.numpy_dtype.name,
                         tensor.layout, self.tensors[value_id].view)

    def _decode(self, value_id: int, index: int, op: vk.OpCall) -> Any:
        value = self.graph.values[value_id]
        if isinstance(value, vk.TensorValue):
            return self._tensor_arg(value_id)
        if isinstance(value, vk.ValueListValue):
            items = [self.graph.values[item] for item in value.items]
            if not all(isinstance(item, vk.TensorValue) for item in items):
                raise GraphLoweringError(f"op {index} ({op.name}): value list {value_id} mixes tensors and scalars")
            return [self._tensor_arg(item) for item in value.items]
        return vk.decode_scalar(value)

    def _scratch(self, index: int):
        """Op-owned scratch lives in ONE buffer shared by all ops: an op's scratch is dead once its own
        dispatches are done, and the dependency barriers order the next op's reuse of the same bytes.
        Within one op, each purpose gets its own aligned range."""
        purposes: dict[str, BufferBinding] = {}

        def allocate(nbytes: int, purpose: str) -> BufferBinding:
            if purpose in purposes:
                raise GraphLoweringError(f"op {index} asked twice for scratch buffer {purpose!r}")
            offset = sum(_align(b.size, SCRATCH_ALIGN) for b in purposes.values())
            purposes[purpose] = BufferBinding(SCRATCH_KEY, offset, _round4(nbytes))
            self.scratch_bytes = max(self.scratch_bytes, offset + _round4(nbytes))
            return purposes[purpose]
        return allocate

    def _check_binding_sizes(self, context: OpContext, planned: list[Dispatch]) -> None:
        """Refuse a dispatch binding more than the max storage binding size, naming the graph tensor."""
        limit = self.profile.max_storage_buffer_range
        for dispatch in planned:
            for bound in dispatch.bindings:
                if bound.size is None or bound.size <= limit:
                    continue
                tensors = [t for t in [*context.args, *context.outputs] if isinstance(t, TensorArg)
                           and t.storage == bound.buffer and t.binding.offset < bound.offset + bound.size
                           and bound.offset < t.binding.offset + t.binding.size]
                names = ", ".join(f"{self.graph.tensor(t.value_id).name or f'value {t.value_id}'} "
                                  f"{t.dtype}{list(t.shape)}" for t in tensors) or f"buffer {bound.buffer!r}"
                raise context.fail(
                    f"dispatch {dispatch.name!r} binds tensor {names} over {bound.size} "
                    f"bytes, more than the max storage binding size of {limit} bytes (device profile "
                    f"{self.profile.name!r}), and its kernel cannot split "
                    f"it (the head's mm, the linear q4gsw ops, the embeddings, fused_ce, elementwise ops, copies "
                    f"(state updates included) and adamw split; see README "
                    f"'Picking a runtime')")

    def _context(self, index: int, lowering) -> OpContext:
        op = self.graph.ops[index]
        args = [self._decode(arg, index, op) for arg in op.args]
        args += [None] * (len(lowering.arg_names) - len(args))  # trailing optional arguments a blob predates
        outputs = [self._tensor_arg(out) for out in op.outputs]
        return OpContext(index, op, args, outputs, f"{index}:{op.name}", self._scratch(index), None, self.route,
                         binding_limit_of(self.profile), self.profile)

    def plan_dispatches(self, lowerings: list, rank_epilogues: bool = False) -> list[Dispatch]:
        """Every op's dispatches, in order; with `rank_epilogues`, a 4-bit base GEMM on the tensor cores and the
        addmm adding a rank-r product to its output are one dispatch where they can be (rank_epilogue.py)."""
        dispatches: list[Dispatch] = []
        pairs = rank_epilogue_pairs(self.graph) if rank_epilogues and self.route.tensor_cores else {}
        fused_at: dict[int, tuple[OpContext, list[Dispatch]]] = {}  # addmm index -> its base GEMM's fused plan
        for index, (op, lowering) in enumerate(zip(self.graph.ops, lowerings)):
            if op.outputs and all(self.graph.tensor(out).is_view for out in op.outputs):
                continue  # the output is its source's bytes: nothing to move
            if index in fused_at:  # the base GEMM adding this addmm's product runs here, where hs and Bt exist
                context, planned = fused_at.pop(index)
            else:
                context = self._context(index, lowering)
                try:
                    if index in pairs:  # tried on contexts of their own (each lowering takes its scratch once)
                        addmm = pairs[index]
                        fused = fused_plan(self._context(index, lowering), lowering.lower,
                                           self._context(addmm, lowerings[addmm]), lowerings[addmm].lower)
                        if fused is not None:
                            fused_at[addmm] = (context, fused)
                            continue
                    planned = lowering.lower(context)
                except Exception as exc:  # a kernel's binding refusal: say which profile's limit it is
                    if "max storage binding size" in str(exc) and exc.args and isinstance(exc.args[0], str):
                        exc.args = (f"{exc.args[0]} (device profile {self.profile.name!r})", *exc.args[1:])
                    raise
            self._check_binding_sizes(context, planned)
            if any(runs_fp16_kernel(d.shader) for d in planned):
                self.tensor_core_ops.append(context.label)
            dispatches += planned
        for state in self.graph.mutable_state:
            if self.tensors[state.update_id].key == self.tensors[state.state_id].key:
                continue  # updated in place
            name = self.graph.tensor(state.state_id).name or f"state{state.state_id}"
            dispatches += copy_words(self.binding(state.state_id), self.binding(state.update_id),
                                     self.tensors[state.state_id].nbytes, label=f"state_update:{name}",
                                     binding_limit=binding_limit_of(self.profile))
        if not dispatches:
            raise GraphLoweringError("the graph has no work for the GPU (no ops and no state updates)")
        return dispatches

    def state_names(self) -> list[tuple[str, int]]:
        """(name, value id) of each mutable state tensor, named as the runtime names them."""
        return [(self.graph.tensor(s.state_id).name or f"state{s.state_id}", s.state_id)
                for s in self.graph.mutable_state]


def plan_schedule(graph: vk.VkGraph, profile: DeviceProfile, *, precision: str = PRECISION_AUTO,
                  max_binding_bytes: int | None = None, emulate_tensor_cores: bool = False,
                  shared: Mapping[str, Any] | None = None, state_guard: bool = False,
                  rank_epilogues: bool = False) -> Schedule:
    """The Schedule of `graph` on a device with `profile` (see the module docstring). `precision`: the GEMM
    precision policy (vktrain.contract.PRECISION_CHOICES); `emulate_tensor_cores` (tests): fp16-tc's coopmat
    kernels emulated on a device without tensor cores; `max_binding_bytes`: a max storage binding size to
    plan for below the profile's; `shared`: name -> SharedTensor (only its `offset` and `tensor` are read)
    for the constant and state tensors another executor of the program owns; `state_guard`: plan the state
    guard's dispatches too (a training step's, where the graph has mutable state); `rank_epilogues` (default off:
    measured slower, rank_epilogue.py): a LoRA linear's base GEMM on the tensor cores adds its adapter's
    up-product in its epilogue."""
    if not isinstance(profile, DeviceProfile):
        raise TypeError(f"plan_schedule plans for a DeviceProfile (vktrain.runtime.device_profiles.profile_of(device) "
                        f"for an opened device), got {type(profile).__name__}")
    graph.validate()
    limited = binding_limited(profile, max_binding_bytes)
    route = gemm_route_for(graph, profile, precision, emulate_tensor_cores=emulate_tensor_cores)
    lowerings = [lowering_for(op, index) for index, op in enumerate(graph.ops)]
    planner = _Planner(graph, limited, route, dict(shared or {}))
    planner.place_tensors()
    dispatches = planner.plan_dispatches(lowerings, rank_epilogues)
    placements = tuple(TensorPlacement(value_id, t.key, t.offset, t.nbytes)
                       for value_id, t in sorted(planner.tensors.items()))
    guard = None
    if state_guard and graph.mutable_state:
        guard = plan_state_guard([(name, planner.binding(value_id), graph.tensor(value_id).storage_dtype)
                                  for name, value_id in planner.state_names()])
    return Schedule(graph_digest(graph), requirements_of(limited, route), PlannedGemm(**dataclasses.asdict(route)),
                    tuple(planner.buffer_table()), placements, tuple(dispatches), tuple(planner.tensor_core_ops),
                    max_binding_bytes or 0, guard)


def gemm_route_of(schedule: Schedule) -> GemmRoute:
    """The GemmRoute a schedule was planned with."""
    return GemmRoute(**dataclasses.asdict(schedule.gemm))


__all__ = ["MIN_MAX_BINDING_BYTES", "ProfileAsDevice", "SCRATCH_KEY", "TENSOR_CORE_SHADER_PREFIX", "binding_limited",
           "gemm_route_for", "gemm_route_of", "plan_schedule", "requirements_of"]
