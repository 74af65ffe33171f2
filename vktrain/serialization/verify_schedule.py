"""Load-time verification of a Schedule (schedule.py) against the graph it runs, before anything is allocated.

A schedule read from bytes is trusted for nothing a device could trip over. Each `check_*` function
checks one fact and raises `VerificationError` (verify.py; `check` names the function) naming the
schedule's source, the dispatch (index and label) or buffer, what was found and what was expected:

    check_schedule_graph      planned for this graph: its digest, every tensor the graph uses placed once,
                              with the bytes the graph records, inside its buffer
    check_schedule_bindings   every binding inside its buffer, at an offset of the planned alignment, no
                              larger than the planned max storage binding size
    check_schedule_dispatches a known shader source, push bytes within what Vulkan guarantees, a local size
                              within the planned workgroup limits, group counts that split into at most
                              MAX_SPLIT_DISPATCHES dispatches on any device
    check_schedule_guard      the state guard's (if planned): its tensors inside a backup slot, its dispatches
                              as above, their bindings inside their buffers (the guard's own included) at
                              aligned offsets; the device layer checks them against its binding limit

`verify_schedule` runs them all. Whether a device satisfies the schedule's requirements is
ScheduleRequirements.unmet_by (the executor asks it once the device is known).

The schedules a blob embeds (embedded.py: `vktrain export --target`) are checked by `verify_embedded`, each
against the graph as above (its known shaders: the blob's modules), and:

    check_shader_modules      every module's code is of its kind (SPIR-V words with the magic; WGSL UTF-8),
                              declares its bindings as 0..n-1 and a workgroup size of 3 axes
    check_schedule_modules    one module per dispatch, its id in range, the shader the dispatch names, in the code
                              of the profile's api; the dispatch binds the module's bindings, pushes the bytes its
                              push block takes and specializes only ids it declares
    check_schedule_profile    within the profile it was planned for: its requirements met by that profile,
                              workgroup sizes (the module's, as the dispatch specializes it) within its limits,
                              group counts within its max workgroup count (or split, for a module whose push
                              block starts with the group-offset header)
"""
from __future__ import annotations

import math
from typing import Collection, Sequence

from vktrain.serialization import graph as g
from vktrain.serialization.device_profile import DeviceProfile
from vktrain.serialization.dispatch import LOCAL_SIZE_SPEC_IDS, MAX_SPLIT_DISPATCHES, PUSH_HEADER_BYTES
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.embedded import CODE_KIND_OF_API, SPIRV, EmbeddedSchedule, ShaderModule
from vktrain.serialization.schedule import (Schedule, ScheduleFormatError, deserialize_schedule, graph_digest,
                                            module_dispatches)
from vktrain.serialization.verify import VerificationError

# Vulkan's guaranteed maxPushConstantsSize: every kernel's push block fits it with the 16-byte group-offset
# header, so no Dispatch pushes more than this minus the header.
MAX_PUSH_BYTES = 128 - PUSH_HEADER_BYTES
# Vulkan's guaranteed maxComputeWorkGroupCount per axis: what group counts are split by on any device.
GUARANTEED_GROUP_COUNT = 65535


def _refuse(source: str, check, message: str) -> VerificationError:
    return VerificationError(f"{source}: {message}", check.__name__)


def _round4(nbytes: int) -> int:
    return max(4, -(-nbytes // 4) * 4)


def check_schedule_graph(schedule: Schedule, graph: g.VkGraph, source: str = "schedule") -> None:
    """The schedule is the one of `graph`: its digest, and a placement of the recorded bytes per used tensor."""
    if schedule.graph_digest != graph_digest(graph):
        raise _refuse(source, check_schedule_graph, f"planned for another graph (digest {schedule.graph_digest[:16]}..., "
                                                    f"this graph's is {graph_digest(graph)[:16]}...)")
    sizes = {buffer.key: buffer.size_bytes for buffer in schedule.buffers}
    placed: set[int] = set()
    for placement in schedule.placements:
        value_id = placement.value_id
        if value_id in placed:
            raise _refuse(source, check_schedule_graph, f"value {value_id} is placed twice")
        placed.add(value_id)
        if not 0 <= value_id < len(graph.values) or not isinstance(graph.values[value_id], g.TensorValue):
            raise _refuse(source, check_schedule_graph, f"a placement names value {value_id}, which is not a tensor "
                                                        f"of the graph")
        expected = _round4(graph.values[value_id].stored_nbytes)
        if placement.size_bytes != expected:
            raise _refuse(source, check_schedule_graph, f"value {value_id} is placed with {placement.size_bytes} "
                                                        f"bytes, the graph records {expected}")
        if placement.offset + placement.size_bytes > sizes[placement.key]:
            raise _refuse(source, check_schedule_graph,
                          f"value {value_id} at [{placement.offset}, {placement.offset + placement.size_bytes}) is "
                          f"outside buffer {placement.key!r} of {sizes[placement.key]} bytes")
    missing = [value_id for value_id in graph.used_tensor_ids() if value_id not in placed]
    if missing:
        raise _refuse(source, check_schedule_graph, f"tensor values {missing[:10]} of the graph have no placement")


def _check_binding(where: str, binding: BufferBinding, sizes: dict[str, int], alignment: int, limit: int | None,
                   check, source: str) -> None:
    size = sizes[binding.buffer] - binding.offset if binding.size is None else binding.size
    if binding.offset % alignment:
        raise _refuse(source, check, f"{where}: offset {binding.offset} is not a multiple of the planned alignment "
                                     f"{alignment}")
    if size <= 0 or binding.offset + size > sizes[binding.buffer]:
        raise _refuse(source, check, f"{where}: range [{binding.offset}, {binding.offset + size}) is outside the "
                                     f"buffer's {sizes[binding.buffer]} bytes")
    if limit is not None and size > limit:
        raise _refuse(source, check, f"{where}: binds {size} bytes, more than the planned max storage binding size "
                                     f"{limit}")


def check_schedule_bindings(schedule: Schedule, source: str = "schedule") -> None:
    """Every binding inside its buffer, aligned as planned, within the planned binding size."""
    sizes = {buffer.key: buffer.size_bytes for buffer in schedule.buffers}
    alignment = schedule.requirements.min_storage_buffer_offset_alignment
    limit = schedule.requirements.max_storage_buffer_range
    if alignment < 1 or alignment & (alignment - 1):
        raise _refuse(source, check_schedule_bindings, f"min_storage_buffer_offset_alignment {alignment} is not a "
                                                       f"power of two")
    for index, dispatch in enumerate(schedule.dispatches):
        for slot, binding in enumerate(dispatch.bindings):
            _check_binding(f"dispatch {index} ({dispatch.name}) binding {slot} (buffer {binding.buffer!r})", binding,
                           sizes, alignment, limit, check_schedule_bindings, source)


def check_schedule_dispatches(schedule: Schedule, shader_sources: Collection[str], source: str = "schedule") -> None:
    """Known shaders (`shader_sources`: the base names of the kernels this runtime has), push bytes, local size
    and group counts within what the device guarantees or the schedule requires."""
    for index, dispatch in enumerate(schedule.dispatches):
        _check_dispatch(f"dispatch {index} ({dispatch.name})", dispatch, schedule, shader_sources,
                        check_schedule_dispatches, source)


def _check_dispatch(where: str, dispatch: Dispatch, schedule: Schedule, shader_sources: Collection[str], check,
                    source: str) -> None:
    needs = schedule.requirements
    base = dispatch.shader.partition("@")[0]
    if base not in shader_sources:
        raise _refuse(source, check, f"{where}: shader {dispatch.shader!r} has no kernel source here "
                                     f"({len(shader_sources)} known)")
    if len(dispatch.push_constants) > MAX_PUSH_BYTES:
        raise _refuse(source, check, f"{where}: pushes {len(dispatch.push_constants)} bytes, more than the "
                                     f"{MAX_PUSH_BYTES} every device takes")
    if dispatch.local_size is not None:
        invocations = math.prod(dispatch.local_size)
        if invocations > needs.max_workgroup_invocations or dispatch.local_size[0] > needs.max_workgroup_size_x:
            raise _refuse(source, check, f"{where}: local size {dispatch.local_size} is over the planned workgroup "
                                         f"limits ({needs.max_workgroup_invocations} invocations, "
                                         f"{needs.max_workgroup_size_x} in x)")
    pieces = math.prod(-(-count // GUARANTEED_GROUP_COUNT) for count in dispatch.groups)
    if pieces > MAX_SPLIT_DISPATCHES:
        raise _refuse(source, check, f"{where}: {dispatch.groups} work groups would be split into {pieces} "
                                     f"dispatches, more than {MAX_SPLIT_DISPATCHES}")


def check_schedule_guard(schedule: Schedule, shader_sources: Collection[str], source: str = "schedule") -> None:
    """The state guard's tensors inside a slot, its dispatches and their bindings (module docstring). Its
    bindings hold whole state tensors: the device layer refuses one over its own binding limit (the runtime
    then keeps no guard), not this check."""
    guard = schedule.state_guard
    if guard is None:
        return
    for index, tensor in enumerate(guard.tensors):
        if tensor.size_bytes <= 0 or tensor.slot_offset + tensor.size_bytes > guard.slot_bytes:
            raise _refuse(source, check_schedule_guard,
                          f"state guard tensor {index} ({tensor.name!r}) at [{tensor.slot_offset}, "
                          f"{tensor.slot_offset + tensor.size_bytes}) is outside the slot's {guard.slot_bytes} bytes")
    sizes = {buffer.key: buffer.size_bytes for buffer in schedule.buffers} | guard.buffer_sizes
    alignment = schedule.requirements.min_storage_buffer_offset_alignment
    for part, dispatches in (("save", guard.save), ("restore", guard.restore)):
        for index, dispatch in enumerate(dispatches):
            where = f"state guard {part} dispatch {index} ({dispatch.name})"
            _check_dispatch(where, dispatch, schedule, shader_sources, check_schedule_guard, source)
            for slot, binding in enumerate(dispatch.bindings):
                _check_binding(f"{where} binding {slot} (buffer {binding.buffer!r})", binding, sizes, alignment, None,
                               check_schedule_guard, source)


def verify_schedule(schedule: Schedule, graph: g.VkGraph, shader_sources: Collection[str],
                    source: str = "schedule") -> None:
    """Every check of this module (see its docstring)."""
    check_schedule_graph(schedule, graph, source)
    check_schedule_bindings(schedule, source)
    check_schedule_dispatches(schedule, shader_sources, source)
    check_schedule_guard(schedule, shader_sources, source)


SPIRV_MAGIC = 0x07230203


def check_shader_modules(modules: Sequence[ShaderModule], source: str = "blob") -> None:
    """Each module's code is of its kind and its bindings are numbered 0..n-1."""
    for index, module in enumerate(modules):
        where = f"shader module {index} ({module.name!r})"
        if module.kind == SPIRV:
            magic = int.from_bytes(module.code[:4], "little")
            if len(module.code) < 20 or len(module.code) % 4 or magic != SPIRV_MAGIC:
                raise _refuse(source, check_shader_modules, f"{where}: its {len(module.code)} bytes are not SPIR-V "
                                                            f"(a multiple of 4 bytes starting with the magic word)")
        else:
            try:
                module.code.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _refuse(source, check_shader_modules, f"{where}: its WGSL text is not UTF-8 ({exc})") from None
        if module.local_size and (len(module.local_size) != 3 or min(module.local_size) < 1
                                  or len(module.local_size_spec_ids) not in (0, 3)):
            raise _refuse(source, check_shader_modules, f"{where}: workgroup size {list(module.local_size)} (spec ids "
                                                        f"{list(module.local_size_spec_ids)}) is not 3 sizes >= 1")
        numbers = [b.binding for b in module.bindings]
        if numbers != list(range(len(numbers))):
            raise _refuse(source, check_shader_modules, f"{where}: declares bindings {numbers}; expected 0..n-1")


def check_schedule_modules(schedule: Schedule, embedded: EmbeddedSchedule, modules: Sequence[ShaderModule],
                           source: str = "schedule") -> None:
    """Every dispatch runs a module of the blob that is its shader, in the profile's code, and fits its
    reflection (bindings, push bytes, specialization ids)."""
    ids = embedded.dispatch_modules
    dispatches = module_dispatches(schedule)
    if len(ids) != len(dispatches):
        raise _refuse(source, check_schedule_modules, f"{len(ids)} dispatch module ids for {len(dispatches)} "
                                                      f"dispatches")
    kind = CODE_KIND_OF_API[embedded.profile.api]
    for index, (dispatch, module_id) in enumerate(zip(dispatches, ids)):
        where = f"dispatch {index} ({dispatch.name})"
        if not 0 <= module_id < len(modules):
            raise _refuse(source, check_schedule_modules, f"{where}: module id {module_id} is out of range (the blob "
                                                          f"has {len(modules)} shader modules)")
        module = modules[module_id]
        if module.name != dispatch.shader or module.kind != kind:
            raise _refuse(source, check_schedule_modules, f"{where}: runs shader {dispatch.shader!r} but module "
                                                          f"{module_id} is {module.kind} of {module.name!r} (expected "
                                                          f"{kind}: the profile is {embedded.profile.api})")
        if len(dispatch.bindings) != len(module.bindings):
            raise _refuse(source, check_schedule_modules, f"{where}: binds {len(dispatch.bindings)} buffers, its "
                                                          f"module declares {len(module.bindings)}")
        if len(dispatch.push_constants) != module.kernel_push_bytes and (dispatch.push_constants or
                                                                         module.kernel_push_bytes > 0):
            raise _refuse(source, check_schedule_modules, f"{where}: pushes {len(dispatch.push_constants)} bytes, its "
                                                          f"module's push block takes {module.kernel_push_bytes}")
        undeclared = [i for i, _ in dispatch.spec_constants if i not in module.spec_ids]
        if dispatch.local_size is not None:
            undeclared += [i for i, v in zip(LOCAL_SIZE_SPEC_IDS, dispatch.local_size)
                           if v != 1 and i not in module.spec_ids]
        if undeclared:
            raise _refuse(source, check_schedule_modules, f"{where}: specializes ids {sorted(undeclared)}, which its "
                                                          f"module does not declare ({list(module.spec_ids)})")


def check_schedule_profile(schedule: Schedule, embedded: EmbeddedSchedule, modules: Sequence[ShaderModule],
                           source: str = "schedule") -> None:
    """The schedule keeps to the profile it was planned for: requirements, workgroup size and counts."""
    profile: DeviceProfile = embedded.profile
    unmet = schedule.requirements.unmet_by(profile)
    if unmet:
        raise _refuse(source, check_schedule_profile, f"relies on what its own profile {profile.name!r} lacks: "
                                                      f"{'; '.join(unmet)}")
    for index, (dispatch, module_id) in enumerate(zip(module_dispatches(schedule), embedded.dispatch_modules)):
        where = f"dispatch {index} ({dispatch.name})"
        if len(dispatch.bindings) > profile.max_storage_buffers_per_stage:
            raise _refuse(source, check_schedule_profile, f"{where}: binds {len(dispatch.bindings)} storage buffers, "
                                                          f"over profile {profile.name!r}'s "
                                                          f"{profile.max_storage_buffers_per_stage} per stage")
        local = modules[module_id].workgroup_size(dispatch) or dispatch.local_size  # as specialized
        if local is not None and (any(v > m for v, m in zip(local, profile.max_workgroup_size))
                                  or math.prod(local) > profile.max_workgroup_invocations):
            raise _refuse(source, check_schedule_profile, f"{where}: local size {local} is over profile "
                                                          f"{profile.name!r}'s {profile.max_workgroup_size} / "
                                                          f"{profile.max_workgroup_invocations} invocations")
        over = any(count > limit for count, limit in zip(dispatch.groups, profile.max_workgroup_count))
        if over and not modules[module_id].push_header:
            raise _refuse(source, check_schedule_profile, f"{where}: {dispatch.groups} work groups are over profile "
                                                          f"{profile.name!r}'s max {profile.max_workgroup_count}, and "
                                                          f"its module cannot be split (no group-offset header)")
        pieces = math.prod(-(-count // limit) for count, limit in zip(dispatch.groups, profile.max_workgroup_count))
        if pieces > MAX_SPLIT_DISPATCHES:
            raise _refuse(source, check_schedule_profile, f"{where}: {dispatch.groups} work groups split into {pieces} "
                                                          f"dispatches under profile {profile.name!r}, more than "
                                                          f"{MAX_SPLIT_DISPATCHES}")


def verify_embedded_schedule(schedule: Schedule, embedded: EmbeddedSchedule, graph: g.VkGraph,
                             source: str = "schedule") -> None:
    """Every check above of one schedule embedded in `graph` (`embedded`: its record; the blob's modules
    are `graph.shader_modules`)."""
    modules = graph.shader_modules
    check_schedule_modules(schedule, embedded, modules, source)  # first: it names the module a dispatch lacks
    verify_schedule(schedule, graph, {module.name.partition("@")[0] for module in modules}, source)
    check_schedule_profile(schedule, embedded, modules, source)


def verify_embedded(graph: g.VkGraph, source: str = "blob", only: int | None = None) -> list[Schedule | None]:
    """Every check above of every schedule `graph` embeds (with the blob's shader modules); the schedules read.
    `only`: the index of the one schedule to read and check (the others come back None): a method that runs the
    schedule of a profile already chosen (the training step's) reads no other."""
    check_shader_modules(graph.shader_modules, source)
    schedules: list[Schedule | None] = []
    for index, embedded in enumerate(graph.schedules):
        if only is not None and index != only:
            schedules.append(None)
            continue
        where = f"{source}: embedded schedule {index} (profile {embedded.profile.name!r})"
        try:
            schedule = deserialize_schedule(embedded.schedule_bytes)
        except ScheduleFormatError as exc:
            raise ScheduleFormatError(f"{where}: {exc}") from None
        verify_embedded_schedule(schedule, embedded, graph, where)
        schedules.append(schedule)
    return schedules


__all__ = ["GUARANTEED_GROUP_COUNT", "MAX_PUSH_BYTES", "check_schedule_bindings", "check_schedule_dispatches",
           "check_schedule_graph", "check_schedule_guard", "check_schedule_modules", "check_schedule_profile",
           "check_shader_modules", "verify_embedded", "verify_embedded_schedule", "verify_schedule"]
