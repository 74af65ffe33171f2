"""The host schedule as data: `Dispatch` records, group-count splitting and barrier planning.

A kernel family turns shapes into a list of `Dispatch`; `vktrain.runtime.vk.commands.Program` records the
list once into a command buffer and replays it. Nothing here touches Vulkan, so schedules can be built,
compared and tested without a device.

Conventions every shader and every Dispatch follow (see also vktrain/runtime_shaders/common.glsl):

* Buffers: binding i of a Dispatch is `binding = i` of descriptor set 0; the Dispatch binds exactly the
  buffers the shader declares. A binding names a buffer by a key (any hashable: str, int) resolved
  against the mapping given to `Program`, or by a `Buffer` object directly, with a byte offset and size.
* Push constants: `Dispatch.push_constants` are the kernel's bytes and must match the shader's block.
* Split dispatches (opt-in per shader): a shader whose push-constant block starts with
  `VKTRAIN_PUSH_HEADER` (a `uvec4 vktrain_group_offset`, 16 bytes) may be dispatched with more groups
  than maxComputeWorkGroupCount allows on an axis. The runtime records several dispatches and writes
  each one's first group into the header (0 when unsplit); the shader computes its global group as
  `gl_WorkGroupID + vktrain_group_offset.xyz` (VKTRAIN_GLOBAL_GROUP_ID / VKTRAIN_GLOBAL_INVOCATION_ID).
  For such shaders `push_constants` are the bytes AFTER the header (it starts at offset 16 in GLSL).
  A shader without the header is never split; a dispatch over the limit is then refused with a reason.
* Specialization constants: ids 0, 1, 2 are the local size x, y, z when `Dispatch.local_size` is set
  (the shader declares `VKTRAIN_LOCAL_SIZE_FROM_SPEC;` or local_size_*_id = 0/1/2); a shader's other
  constants are free, by convention from id 3. Values are packed as the type the shader declares.
"""
from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Sequence

from vktrain.runtime.vk.errors import BindingRangeError, ScheduleError

PUSH_HEADER_BYTES = 16
LOCAL_SIZE_SPEC_IDS = (0, 1, 2)
FIRST_KERNEL_SPEC_ID = 3
ACCESS_MODES = ("r", "w", "rw")

SpecValue = int | float | bool


@dataclass(frozen=True)
class BufferBinding:
    """One storage-buffer binding: `size=None` binds from `offset` to the end of the buffer.

    `access` ("r", "w", "rw") says what the shader does with it and drives barrier placement; None
    (the default) takes it from the shader's declaration (readonly -> "r", writeonly -> "w", else
    "rw"). Declaring a buffer the shader writes as "r" is a synchronization bug.
    """

    buffer: Any
    offset: int = 0
    size: int | None = None
    access: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ScheduleError(f"binding offset must be a non-negative int of bytes, got {self.offset!r}")
        if self.size is not None and (not isinstance(self.size, int) or self.size <= 0):
            raise ScheduleError(f"binding size must be a positive int of bytes or None, got {self.size!r}")
        if self.access is not None and self.access not in ACCESS_MODES:
            raise ScheduleError(f"binding access must be one of {ACCESS_MODES} or None, got {self.access!r}")

    @property
    def reads(self) -> bool:
        return self.access is None or "r" in self.access

    @property
    def writes(self) -> bool:
        return self.access is None or "w" in self.access


_MAX_GROUPS_PER_AXIS = 2**32 - 1
MAX_SPLIT_DISPATCHES = 1 << 20  # recorded dispatches one oversized Dispatch may be split into


def _normalize_groups(groups: Any) -> tuple[int, int, int]:
    if isinstance(groups, int):
        groups = (groups,)
    try:
        counts = tuple(groups)
    except TypeError:
        raise ScheduleError(f"groups must be an int or a tuple of 1-3 ints, got {groups!r}") from None
    if not 1 <= len(counts) <= 3:
        raise ScheduleError(f"groups must have 1 to 3 axes, got {len(counts)}: {groups!r}")
    for count in counts:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ScheduleError(f"every group count must be an int >= 1, got {groups!r}")
        if count > _MAX_GROUPS_PER_AXIS:
            # Shaders compute work-group (and group-offset header) indices in 32-bit uints.
            raise ScheduleError(f"group count {count} of {groups!r} does not fit the 32-bit work-group index "
                                f"(at most {_MAX_GROUPS_PER_AXIS} per axis)")
    return tuple(counts) + (1,) * (3 - len(counts))  # type: ignore[return-value]


def _check_spec_value(spec_id: int, value: Any) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -(2**31) <= value < 2**32:
            raise ScheduleError(f"spec constant {spec_id} = {value} does not fit in 32 bits")
        return
    if isinstance(value, float):
        return
    raise ScheduleError(f"spec constant {spec_id} must be int, float or bool, got {type(value).__name__}")


@dataclass(frozen=True)
class Dispatch:
    """One compute dispatch of `shader` (a name known to vktrain.runtime_shaders, e.g. "test_axpy" or
    "linear_q4gsw@GEMV") over `groups` work groups (x, y, z; an int means (x, 1, 1)).

    `bindings` are BufferBinding (a bare buffer key is shorthand for BufferBinding(key)).
    `push_constants` are the kernel's push bytes (after the 16-byte header in shaders that declare
    VKTRAIN_PUSH_HEADER), a multiple of 4; see pack_push.
    `spec_constants` map constant_id -> int/float/bool (32-bit each); stored as sorted pairs.
    `local_size`, when set, specializes ids 0-2. `label` names the dispatch in timings and errors.
    """

    shader: str
    groups: Any
    bindings: Sequence[Any] = ()
    push_constants: bytes = b""
    spec_constants: Any = field(default_factory=tuple)
    local_size: tuple[int, int, int] | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.shader, str) or not self.shader:
            raise ScheduleError(f"Dispatch.shader must be a non-empty shader name, got {self.shader!r}")
        object.__setattr__(self, "groups", _normalize_groups(self.groups))
        bindings = tuple(b if isinstance(b, BufferBinding) else BufferBinding(b) for b in self.bindings)
        object.__setattr__(self, "bindings", bindings)

        push = bytes(self.push_constants)
        if len(push) % 4:
            raise ScheduleError(
                f"{self.name}: push_constants must be a multiple of 4 bytes, got {len(push)}")
        object.__setattr__(self, "push_constants", push)

        spec = dict(self.spec_constants.items() if isinstance(self.spec_constants, Mapping)
                    else self.spec_constants)
        for spec_id, value in spec.items():
            if not isinstance(spec_id, int) or spec_id < 0:
                raise ScheduleError(f"{self.name}: spec constant ids must be ints >= 0, got {spec_id!r}")
            _check_spec_value(spec_id, value)
        if self.local_size is not None:
            local = tuple(self.local_size)
            if len(local) != 3 or any(not isinstance(v, int) or v < 1 for v in local):
                raise ScheduleError(f"{self.name}: local_size must be 3 ints >= 1, got {self.local_size!r}")
            clash = sorted(set(spec) & set(LOCAL_SIZE_SPEC_IDS))
            if clash:
                raise ScheduleError(
                    f"{self.name}: spec constant ids {clash} are reserved for local_size; "
                    f"kernel constants start at id {FIRST_KERNEL_SPEC_ID}")
            object.__setattr__(self, "local_size", local)
        object.__setattr__(self, "spec_constants", tuple(sorted(spec.items())))

    @property
    def name(self) -> str:
        return self.label or self.shader

    def specialization(self) -> tuple[tuple[int, SpecValue], ...]:
        """All specialization constants, local size included, sorted by id (the pipeline-cache key)."""
        spec = dict(self.spec_constants)
        if self.local_size is not None:
            spec.update(zip(LOCAL_SIZE_SPEC_IDS, self.local_size))
        return tuple(sorted(spec.items()))



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


def pack_push(*values: int | float) -> bytes:
    """Pack scalars as consecutive 32-bit push-constant fields: int -> int32/uint32, float -> float32.

    Matches a GLSL block of scalar fields (uint/int/float) declared in the same order after
    VKTRAIN_PUSH_HEADER. Vector fields have their own std430 alignment; pack those by hand.
    """
    out = bytearray()
    for value in values:
        if isinstance(value, bool):
            out += struct.pack("<I", int(value))
        elif isinstance(value, int):
            if 0 <= value < 2**32:
                out += struct.pack("<I", value)
            elif -(2**31) <= value < 0:
                out += struct.pack("<i", value)
            else:
                raise ScheduleError(f"push constant {value} does not fit in 32 bits")
        elif isinstance(value, float):
            out += struct.pack("<f", value)
        else:
            raise ScheduleError(f"push constants must be int, float or bool, got {type(value).__name__}")
    return bytes(out)


def ceil_div(numerator: int, denominator: int) -> int:
    """Groups needed to cover `numerator` items with `denominator` per group."""
    return -(-numerator // denominator)


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
