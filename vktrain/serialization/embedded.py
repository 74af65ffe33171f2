"""Schedules embedded in a delegate blob: one per target device profile, with the shader modules they run
(`vktrain export --target`; the VkGraph fields `schedules` and `shader_modules`, tables EmbeddedSchedule and
ShaderModule of schema.fbs).

A .pte method's delegate blob carries, per target profile, the Schedule of its graph planned for that profile
(schedule.py, stored as its "VKS1" bytes: the same bytes the planner gives at load) and, per dispatch, the
index of its ShaderModule: the SPIR-V (Vulkan profiles) or WGSL text (WebGPU profiles) of the shader variant
it names, stored once per blob, with the reflection a runtime checks a dispatch against (its storage
bindings, push block and specialization ids). A blob without schedules is the format from before: the
runtime plans at load.

The matching rule (`select_schedule`, the one both runtimes use): an embedded schedule fits a device when the
device's profile has everything it relies on: its ScheduleRequirements (api, binding range, offset alignment,
shared memory, workgroup size, subgroup size and operations, float16, int64, cooperative-matrix shape:
ScheduleRequirements.unmet_by), and for every buffer and dispatch the device's max allocation size, storage
buffers per stage, push-constant bytes (Vulkan) and workgroup size. Among those that fit, the runtime takes
  1. the one planned for exactly this device (its profile's planning fields equal the device's),
  2. else the one that asks the most of the device: tensor cores (a cooperative-matrix shape) first, then
     kernels written for the device's subgroup size (the CPU bodies, coopmat tiles), then the larger planned
     shared memory, workgroup invocations and binding range (bigger tiles, fewer split dispatches),
  3. ties: the first embedded (the order of --target).
The device's profile is its planning profile (vktrain/runtime/device_profiles.py `planning_profile`): with
--device-profile / VKTRAIN_DEVICE_PROFILE, the emulated one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from vktrain.errors import VktrainError
from vktrain.serialization.device_profile import API_VULKAN, API_WEBGPU, DeviceProfile
from vktrain.serialization.dispatch import PUSH_HEADER_BYTES, Dispatch
from vktrain.serialization.schedule import Schedule, deserialize_schedule, module_dispatches, serialize_schedule

SPIRV, WGSL = "spirv", "wgsl"
CODE_KINDS = (SPIRV, WGSL)  # in the order of schema.fbs ShaderCodeKind
CODE_KIND_OF_API = {API_VULKAN: SPIRV, API_WEBGPU: WGSL}
MODULE_ACCESS = ("r", "w", "rw")


class NoMatchingScheduleError(VktrainError, ValueError):
    """A program whose embedded schedules all need something the device lacks; the message names each
    profile and what the device lacks for it."""


@dataclass(frozen=True)
class ModuleBinding:
    """One storage binding a shader module declares: `binding` of set 0 and its access ("r": readonly,
    "w": writeonly, "rw")."""

    binding: int
    access: str = "rw"


@dataclass(frozen=True)
class ShaderModule:
    """One compiled kernel of the blob: the shader variant `name` (Dispatch.shader), its `code` (SPIR-V
    bytes or WGSL UTF-8 text, by `kind`) and its reflection. `features`: the WebGPU features whose WGSL
    bodies the text holds."""

    name: str
    kind: str
    code: bytes
    bindings: tuple[ModuleBinding, ...]
    push_constant_bytes: int
    push_header: bool
    spec_ids: tuple[int, ...] = ()
    features: tuple[str, ...] = ()
    local_size: tuple[int, ...] = ()  # the declared workgroup size (x, y, z defaults); (): none declared
    local_size_spec_ids: tuple[int, ...] = ()  # per axis, the specialization id setting it (-1: fixed)

    @property
    def text(self) -> str:
        """A WGSL module's source text."""
        return self.code.decode("utf-8")

    def workgroup_size(self, dispatch: Dispatch) -> tuple[int, ...] | None:
        """The workgroup size `dispatch` runs this module with (its specialization over the declared size);
        None when the module declares none."""
        if len(self.local_size) != 3:
            return None
        spec = dict(dispatch.specialization())
        return tuple(int(spec.get(spec_id, default)) if spec_id >= 0 else default
                     for default, spec_id in zip(self.local_size, self.local_size_spec_ids or (-1, -1, -1)))

    @property
    def kernel_push_bytes(self) -> int:
        """The push bytes a Dispatch gives (the block without its group-offset header)."""
        return self.push_constant_bytes - (PUSH_HEADER_BYTES if self.push_header else 0)


@dataclass(frozen=True)
class EmbeddedSchedule:
    """The schedule of the blob's graph for `profile`: its VKS1 bytes and the module of each dispatch (an
    index into the blob's shader modules)."""

    profile: DeviceProfile
    schedule_bytes: bytes
    dispatch_modules: tuple[int, ...]

    def schedule(self) -> Schedule:
        return deserialize_schedule(self.schedule_bytes)


@dataclass(frozen=True)
class Selection:
    """The embedded schedule a device runs: which one (`index` into the blob's schedules), read, and the
    modules of its dispatches by shader name."""

    index: int
    embedded: EmbeddedSchedule
    schedule: Schedule
    modules: dict[str, ShaderModule]

    @property
    def profile(self) -> DeviceProfile:
        return self.embedded.profile


def modules_by_name(embedded: EmbeddedSchedule, schedule: Schedule, modules: Sequence[ShaderModule]
                    ) -> dict[str, ShaderModule]:
    """Shader name -> module of every dispatch of `schedule`, its state guard's included (the verifier checked the
    names agree)."""
    return {dispatch.shader: modules[index]
            for dispatch, index in zip(module_dispatches(schedule), embedded.dispatch_modules)}


# ---- building ----------------------------------------------------------------------------------------------

def embed_schedules(planned: Sequence[tuple[DeviceProfile, Schedule]], module_for, *, serialize: bool = True
                    ) -> tuple[list[EmbeddedSchedule], list[ShaderModule]]:
    """The `schedules` and `shader_modules` of a blob holding `planned` ((profile, schedule) per target, in
    order). `module_for(shader_name, profile)` gives a ShaderModule; identical modules are stored once.
    `serialize=False` leaves the schedule bytes empty (to check the records before writing them)."""
    modules: list[ShaderModule] = []
    index_of: dict[ShaderModule, int] = {}
    embedded = []
    for profile, schedule in planned:
        ids = []
        for dispatch in module_dispatches(schedule):  # the state guard's too: every pipeline from the blob
            module = module_for(dispatch.shader, profile)
            if module not in index_of:
                index_of[module] = len(modules)
                modules.append(module)
            ids.append(index_of[module])
        embedded.append(EmbeddedSchedule(profile, serialize_schedule(schedule) if serialize else b"", tuple(ids)))
    return embedded, modules


# ---- the matching rule ---------------------------------------------------------------------------------------

def unmet_needs(schedule: Schedule, modules: Sequence[ShaderModule], embedded: EmbeddedSchedule,
                device: DeviceProfile) -> list[str]:
    """What a device with profile `device` lacks to run `schedule` (embedded with its modules), one phrase each."""
    missing = list(schedule.requirements.unmet_by(device))
    if missing and schedule.requirements.api != device.api:
        return missing
    largest = max(schedule.buffers, key=lambda b: b.size_bytes, default=None)
    if largest is not None and largest.size_bytes > device.max_allocation_bytes:
        missing.append(f"allocations of {largest.size_bytes} bytes (buffer {largest.key!r}; the device's max "
                       f"allocation size is {device.max_allocation_bytes})")
    bindings = max((len(d.bindings) for d in module_dispatches(schedule)), default=0)
    if bindings > device.max_storage_buffers_per_stage:
        missing.append(f"{bindings} storage buffers per dispatch (the device binds "
                       f"{device.max_storage_buffers_per_stage})")
    if device.api == API_VULKAN:
        push = max((modules[i].push_constant_bytes for i in set(embedded.dispatch_modules)), default=0)
        if push > device.max_push_constants_bytes:
            missing.append(f"{push} bytes of push constants (the device takes {device.max_push_constants_bytes})")
    for dispatch, module_id in zip(module_dispatches(schedule), embedded.dispatch_modules):
        local = modules[module_id].workgroup_size(dispatch) or dispatch.local_size
        if local is not None and (any(v > m for v, m in zip(local, device.max_workgroup_size))
                                  or math.prod(local) > device.max_workgroup_invocations):
            missing.append(f"workgroups of {'x'.join(map(str, local))} ({dispatch.name}; the device's max is "
                           f"{'x'.join(map(str, device.max_workgroup_size))}, "
                           f"{device.max_workgroup_invocations} invocations)")
            break
    return missing


def _preference(profile: DeviceProfile, schedule: Schedule, device: DeviceProfile) -> tuple:
    """Larger is preferred (the module docstring's rule; ties go to the first embedded)."""
    needs = schedule.requirements
    return (profile.planning_fields() == device.planning_fields(), bool(needs.cooperative_matrix),
            needs.subgroup_size != 0, needs.max_shared_memory_bytes, needs.max_workgroup_invocations,
            needs.max_storage_buffer_range)


def select_schedule(schedules: Sequence[EmbeddedSchedule], modules: Sequence[ShaderModule], device: DeviceProfile,
                    *, device_name: str = "this device", source: str = "the program",
                    read: Sequence[Schedule] | None = None) -> Selection | None:
    """The embedded schedule `device` runs by the matching rule (module docstring); None when there are no
    embedded schedules (the runtime plans at load); NoMatchingScheduleError when none fits, naming each
    profile and what the device lacks for it. `read`: the schedules already deserialized, in order."""
    if not schedules:
        return None
    best, refusals = None, []
    for index, embedded in enumerate(schedules):
        schedule = read[index] if read is not None else embedded.schedule()
        missing = unmet_needs(schedule, modules, embedded, device)
        if missing:
            refusals.append(f"{embedded.profile.name}: {'; '.join(missing)}")
            continue
        key = _preference(embedded.profile, schedule, device)
        if best is None or key > best[0]:
            best = (key, Selection(index, embedded, schedule, modules_by_name(embedded, schedule, modules)))
    if best is None:
        raise NoMatchingScheduleError(
            f"{source} embeds schedules for the device profiles {', '.join(s.profile.name for s in schedules)}, and "
            f"{device_name} (profile {device.name!r}) runs none of them; it lacks, per profile: "
            f"{' | '.join(refusals)}. Export it again with a --target this device satisfies (its own profile: "
            f"`vktrain devices --json`), or --target none to plan at load")
    return best[1]


def schedule_for_profile(schedules: Sequence[EmbeddedSchedule], modules: Sequence[ShaderModule], name: str,
                         *, source: str = "the program", read: Sequence[Schedule] | None = None) -> Selection:
    """The embedded schedule planned for the profile named `name` (another method of a program runs the
    target its training step was selected for). `read`: the schedules already deserialized, in order."""
    for index, embedded in enumerate(schedules):
        if embedded.profile.name == name:
            schedule = read[index] if read is not None else embedded.schedule()
            return Selection(index, embedded, schedule, modules_by_name(embedded, schedule, modules))
    raise NoMatchingScheduleError(f"{source} has no schedule for device profile {name!r}, which its training step "
                                  f"runs (it has {', '.join(s.profile.name for s in schedules) or 'none'}): its "
                                  f"methods were not exported together")


__all__ = ["CODE_KINDS", "CODE_KIND_OF_API", "EmbeddedSchedule", "ModuleBinding", "NoMatchingScheduleError", "SPIRV",
           "Selection", "ShaderModule", "WGSL", "embed_schedules", "modules_by_name", "schedule_for_profile",
           "select_schedule", "unmet_needs"]
