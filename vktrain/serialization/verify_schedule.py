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

`verify_schedule` runs them all. Whether a device satisfies the schedule's requirements is
ScheduleRequirements.unmet_by (the executor asks it once the device is known).
"""
from __future__ import annotations

import math
from typing import Collection

from vktrain.serialization import graph as g
from vktrain.serialization.dispatch import MAX_SPLIT_DISPATCHES, PUSH_HEADER_BYTES
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
            where = f"dispatch {index} ({dispatch.name}) binding {slot} (buffer {binding.buffer!r})"
            size = sizes[binding.buffer] - binding.offset if binding.size is None else binding.size
            if binding.offset % alignment:
                raise _refuse(source, check_schedule_bindings, f"{where}: offset {binding.offset} is not a multiple "
                                                               f"of the planned alignment {alignment}")
            if size <= 0 or binding.offset + size > sizes[binding.buffer]:
                raise _refuse(source, check_schedule_bindings,
                              f"{where}: range [{binding.offset}, {binding.offset + size}) is outside the buffer's "
                              f"{sizes[binding.buffer]} bytes")
            if size > limit:
                raise _refuse(source, check_schedule_bindings, f"{where}: binds {size} bytes, more than the planned "
                                                               f"max storage binding size {limit}")


def check_schedule_dispatches(schedule: Schedule, shader_sources: Collection[str], source: str = "schedule") -> None:
    """Known shaders (`shader_sources`: the base names of the kernels this runtime has), push bytes, local size
    and group counts within what the device guarantees or the schedule requires."""
    needs = schedule.requirements
    for index, dispatch in enumerate(schedule.dispatches):
        where = f"dispatch {index} ({dispatch.name})"
        base = dispatch.shader.partition("@")[0]
        if base not in shader_sources:
            raise _refuse(source, check_schedule_dispatches, f"{where}: shader {dispatch.shader!r} has no kernel source "
                                                             f"here ({len(shader_sources)} known)")
        if len(dispatch.push_constants) > MAX_PUSH_BYTES:
            raise _refuse(source, check_schedule_dispatches, f"{where}: pushes {len(dispatch.push_constants)} bytes, "
                                                             f"more than the {MAX_PUSH_BYTES} every device takes")
        if dispatch.local_size is not None:
            invocations = math.prod(dispatch.local_size)
            if invocations > needs.max_workgroup_invocations or \
                    dispatch.local_size[0] > needs.max_workgroup_size_x:
                raise _refuse(source, check_schedule_dispatches,
                              f"{where}: local size {dispatch.local_size} is over the planned workgroup limits "
                              f"({needs.max_workgroup_invocations} invocations, "
                              f"{needs.max_workgroup_size_x} in x)")
        pieces = math.prod(-(-count // GUARANTEED_GROUP_COUNT) for count in dispatch.groups)
        if pieces > MAX_SPLIT_DISPATCHES:
            raise _refuse(source, check_schedule_dispatches, f"{where}: {dispatch.groups} work groups would be split "
                                                             f"into {pieces} dispatches, more than "
                                                             f"{MAX_SPLIT_DISPATCHES}")


def verify_schedule(schedule: Schedule, graph: g.VkGraph, shader_sources: Collection[str],
                    source: str = "schedule") -> None:
    """Every check of this module (see its docstring)."""
    check_schedule_graph(schedule, graph, source)
    check_schedule_bindings(schedule, source)
    check_schedule_dispatches(schedule, shader_sources, source)


__all__ = ["GUARANTEED_GROUP_COUNT", "MAX_PUSH_BYTES", "check_schedule_bindings", "check_schedule_dispatches",
           "check_schedule_graph", "verify_schedule"]
