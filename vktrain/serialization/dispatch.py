"""The dispatch records of a host schedule: `Dispatch` (one compute dispatch) and `BufferBinding` (one
storage-buffer binding of it). Pure data on the ground floor: the planner (vktrain/backend/kernel_planning) makes
them, the schedule format (schedule.py beside this) stores them, and the device layers
(vktrain/runtime/vk/commands.py, vktrain/runtime/webgpu/program.py) record them. The conventions every
shader and every Dispatch follow are in vktrain/runtime/vk/schedule.py's docstring."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from vktrain.errors import VktrainError


class ScheduleError(VktrainError, ValueError):
    """A Dispatch list is malformed (unknown buffer, bad group count, push constants too large...)."""


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
    `push_constants` are the kernel's push bytes (after the 16-byte group-offset header in shaders
    that start their push block with it), a multiple of 4; see pack_push.
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


def pack_push(*values: int | float) -> bytes:
    """Pack scalars as consecutive 32-bit push-constant fields: int -> int32/uint32, float -> float32.

    Matches a push struct of scalar fields (uint/int/float) declared in the same order after
    the group-offset header. Vector fields have their own std430 alignment; pack those by hand.
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
