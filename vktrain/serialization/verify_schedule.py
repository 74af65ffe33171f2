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
"""
from __future__ import annotations

import math
from typing import Collection

from vktrain.serialization import graph as g
from vktrain.serialization.dispatch import MAX_SPLIT_DISPATCHES, PUSH_HEADER_BYTES
from vktrain.serialization.dispatch import BufferBinding, Dispatch
from vktrain.serialization.schedule import Schedule, graph_digest
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


__all__ = ["GUARANTEED_GROUP_COUNT", "MAX_PUSH_BYTES", "check_schedule_bindings", "check_schedule_dispatches",
           "check_schedule_graph", "check_schedule_guard", "verify_schedule"]
