"""The host schedule as data: `Dispatch` records, group-count splitting and barrier planning.

A kernel family turns shapes into a list of `Dispatch`; `vktrain.runtime.vk.commands.Program` records the
list once into a command buffer and replays it. Nothing here touches Vulkan, so schedules can be built,
compared and tested without a device.

Conventions every shader and every Dispatch follow (see also vktrain/runtime_shaders/common.slangh):

* Buffers: binding i of a Dispatch is `binding = i` of descriptor set 0; the Dispatch binds exactly the
  buffers the shader declares. A binding names a buffer by a key (any hashable: str, int) resolved
  against the mapping given to `Program`, or by a `Buffer` object directly, with a byte offset and size.
* Push constants: `Dispatch.push_constants` are the kernel's bytes and must match the shader's block.
* Split dispatches (opt-in per shader): a shader whose push-constant block starts with
  the group-offset header (a `uint4 vktrain_group_offset`, 16 bytes) may be dispatched with more groups
  than maxComputeWorkGroupCount allows on an axis. The runtime records several dispatches and writes
  each one's first group into the header (0 when unsplit); the shader computes its global group as
  `SV_GroupID + vktrain_group_offset.xyz` (common.slangh's VKTRAIN_GLOBAL_GROUP_ID).
  For such shaders `push_constants` are the bytes AFTER the header (they start at offset 16).
  A shader without the header is never split; a dispatch over the limit is then refused with a reason.
* Specialization constants: ids 0, 1, 2 are the local size x, y, z when `Dispatch.local_size` is set
  (the shader declares `VKTRAIN_LOCAL_SIZE_FROM_SPEC;` or local_size_*_id = 0/1/2); a shader's other
  constants are free, by convention from id 3. Values are packed as the type the shader declares.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

from vktrain.runtime.vk.errors import BindingRangeError
# The Dispatch records are data on the ground floor (serialization/dispatch.py); this module splits and
# orders them for Vulkan.
from vktrain.serialization.dispatch import MAX_SPLIT_DISPATCHES, BufferBinding, ScheduleError, ceil_div


def resolve_binding(where: str, index: int, binding: BufferBinding, buffers: Mapping[Hashable, Any], device: Any,
                    buffer_type: type, alignment_name: str) -> tuple[Any, int, int]:
    """(buffer, offset, size) of Dispatch binding `index`: its buffer (named by key in `buffers`, or given
    directly) must be a live `buffer_type` of `device`, its offset a multiple of the device's
    min_storage_buffer_offset_alignment (`alignment_name`: what the device layer calls it) and its range
    inside the buffer. The one binding check of both device layers; each adds its own range limits."""
    key = binding.buffer
    if isinstance(key, buffer_type):
        buffer = key
    else:
        try:
            buffer = buffers[key]
        except (KeyError, TypeError):
            raise ScheduleError(f"{where}: binding {index} names buffer {key!r}, which is not in the "
                                f"buffers mapping (keys: {sorted(map(repr, buffers))[:20]})") from None
    if not isinstance(buffer, buffer_type) or not buffer.alive:
        raise ScheduleError(f"{where}: binding {index} ({key!r}) is not a live {buffer_type.__qualname__} of "
                            f"{buffer_type.__module__}: {buffer!r}")
    if buffer.device is not device:
        raise ScheduleError(f"{where}: binding {index} ({key!r}) belongs to another Device")
    offset = binding.offset
    size = buffer.size - offset if binding.size is None else binding.size
    alignment = device.limits.min_storage_buffer_offset_alignment
    if offset % alignment:
        raise BindingRangeError(f"{where}: binding {index} ({key!r}) offset {offset} is not a multiple of the "
                                f"device's {alignment_name} ({alignment})")
    if size <= 0 or offset + size > buffer.size:
        raise BindingRangeError(f"{where}: binding {index} ({key!r}) range [{offset}, {offset + size}) is outside "
                                f"the buffer's {buffer.size} bytes")
    return buffer, offset, size


def split_groups(groups: Sequence[int], max_counts: Sequence[int]
                 ) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """Cut a 3-D group grid into chunks no larger than `max_counts` per axis.

    Returns (group_offset, group_count) pairs in x-fastest order; one pair (0,0,0), groups when no axis
    is over its limit. The chunks tile the grid exactly once.
    """
    if len(groups) != 3 or len(max_counts) != 3:
        raise ScheduleError(f"split_groups wants 3 axes, got groups={groups!r} max_counts={max_counts!r}")
    if any(m < 1 for m in max_counts):
        raise ScheduleError(f"max group counts must be >= 1, got {max_counts!r}")
    pieces = 1
    for count, limit in zip(groups, max_counts):
        pieces *= ceil_div(count, limit)
    if pieces > MAX_SPLIT_DISPATCHES:
        # Refused before the chunk list is built: a grid from a corrupt file could need billions.
        raise ScheduleError(f"{tuple(groups)} work groups would be split into {pieces} dispatches (per-axis limit "
                            f"{tuple(max_counts)}); at most {MAX_SPLIT_DISPATCHES} are recorded for one Dispatch")
    per_axis = []
    for count, limit in zip(groups, max_counts):
        per_axis.append([(start, min(limit, count - start)) for start in range(0, count, limit)])
    chunks = []
    for (oz, cz), (oy, cy), (ox, cx) in itertools.product(per_axis[2], per_axis[1], per_axis[0]):
        chunks.append(((ox, oy, oz), (cx, cy, cz)))
    return chunks


@dataclass(frozen=True)
class ResolvedAccess:
    """A binding resolved to a concrete buffer identity and byte range [start, end)."""

    buffer_id: Hashable
    start: int
    end: int
    reads: bool
    writes: bool


def _overlaps(a: ResolvedAccess, b: ResolvedAccess) -> bool:
    return a.buffer_id == b.buffer_id and a.start < b.end and b.start < a.end


def plan_barriers(accesses: Sequence[Iterable[ResolvedAccess]]) -> list[bool]:
    """For each dispatch, whether a compute->compute memory barrier must precede it.

    A barrier is needed before dispatch j when it touches a byte range that a dispatch since the last
    barrier wrote (read-after-write, write-after-write) or, when j writes, one that such a dispatch
    read (write-after-read). Independent dispatches run without barriers between them.
    """
    needed: list[bool] = []
    # Accesses since the last barrier, per buffer, writes apart: a read only conflicts with a pending
    # write, so many dispatches reading one weight buffer stay linear.
    pending_writes: dict[Hashable, list[ResolvedAccess]] = {}
    pending_reads: dict[Hashable, list[ResolvedAccess]] = {}
    for dispatch_accesses in accesses:
        current = list(dispatch_accesses)
        hazard = False
        for now in current:
            against = pending_writes.get(now.buffer_id, [])
            if now.writes:
                against = against + pending_reads.get(now.buffer_id, [])
            if any(_overlaps(now, before) for before in against):
                hazard = True
                break
        needed.append(hazard)
        if hazard:
            pending_writes, pending_reads = {}, {}
        for now in current:
            if now.writes:
                pending_writes.setdefault(now.buffer_id, []).append(now)
            if now.reads:
                pending_reads.setdefault(now.buffer_id, []).append(now)
    return needed


def plan_submits(split_counts: Sequence[int], max_per_submit: int | None
                 ) -> list[list[tuple[int, int, int]]]:
    """Cut a replay into submits of at most `max_per_submit` recorded dispatches (a phone's GPU watchdog
    kills one long submit). `split_counts[i]` is how many vkCmdDispatch Dispatch i records (its group-count
    split chunks), each counted on its own; a split Dispatch may straddle submits (its chunks write
    disjoint groups). Returns, per submit, (dispatch index, first chunk, end chunk) runs in order.
    None or 0: one submit."""
    if max_per_submit is not None and (not isinstance(max_per_submit, int) or isinstance(max_per_submit, bool)
                                       or max_per_submit < 0):
        raise ScheduleError(f"max_dispatches_per_submit must be an integer >= 0 (0: unbounded), "
                            f"got {max_per_submit!r}")
    bound = max_per_submit or sum(split_counts) or 1
    submits: list[list[tuple[int, int, int]]] = [[]]
    room = bound
    for index, count in enumerate(split_counts):
        first = 0
        while first < count:
            if room == 0:
                submits.append([])
                room = bound
            take = min(room, count - first)
            submits[-1].append((index, first, first + take))
            first += take
            room -= take
    return submits


def timestamp_spans(submits: Sequence[Sequence[tuple[int, int, int]]], split_counts: Sequence[int]
                    ) -> tuple[list[tuple[int, int]], int]:
    """Where a timed replay of `submits` (plan_submits) writes its timestamps: one at the start of each submit
    and one after each Dispatch's last chunk, numbered in recording order. Returns, per Dispatch, (the query
    written last before its first chunk, its own), and the number of queries. A submit's own first timestamp
    keeps the idle gap between submits out of every Dispatch's time."""
    spans: list[tuple[int, int]] = [(0, 0)] * len(split_counts)
    starts = [0] * len(split_counts)
    query = 0
    for runs in submits:
        last, query = query, query + 1
        for index, first, end in runs:
            if first == 0:
                starts[index] = last
            if end == split_counts[index]:
                spans[index] = (starts[index], query)
                last, query = query, query + 1
    return spans, query
