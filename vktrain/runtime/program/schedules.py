"""Where a method's Schedule comes from at load. The runtime plans nothing: it runs a schedule it is given,
one the program carries, or one the caller's planner makes for this device.

    obtained = method_schedule(graph, device, planner=plan_schedule, source="step.pte", precision="auto")
    executor = GraphExecutor(device, graph, obtained.schedule, verify=obtained.verify)

In this order: `schedule`, the caller's own (run as it is); `embedded`, the program's schedule for this device
(`vktrain export --target` stores them; vktrain/runtime/program/embedded.py selects one); else `planner(graph, profile, **options)`, with
`profile` the device's planning profile (vktrain/runtime/device_profiles.py `planning_profile`: its own, or
VKTRAIN_DEVICE_PROFILE's emulated on it). With none of them the load is refused (NoScheduleError). The app
passes vktrain.backend.kernel_planning.plan_schedule as the planner; its options are plan_schedule's
(precision, emulate_tensor_cores, max_binding_bytes, shared, state_guard).

A schedule given is verified at load (GraphExecutor's `verify`: serialization/verify_schedule.py); one carried
(`embedded`: a Selection's, which vktrain/runtime/program/embedded.py read through verify_embedded, every check
of verify_schedule against this graph and the blob's modules included) is not verified a second time; one the
planner just made for this graph and device is not (`verify` False), as when the executor planned
itself: it is the planner's output in this process, not bytes from a file -- except under an emulated profile
(VKTRAIN_DEVICE_PROFILE), whose limits the device does not enforce: that plan is verified against them as an
embedded one is (`verify`; and check_schedule_profile with each kernel's workgroup size as its SPIR-V declares
and the dispatch specializes it), so a plan that would fail on the real phone fails here too.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from vktrain.serialization.device_profile import API_VULKAN, DeviceProfile

from vktrain.contract import PRECISION_AUTO
from vktrain.errors import VktrainError
from vktrain.runtime.device_profiles import emulated_profile_spec, planning_profile
from vktrain.runtime.delegate.executor import GraphExecutor
from vktrain.runtime.program.embedded import method_selection, module_options
from vktrain.serialization import graph as vk
from vktrain.serialization.schedule import Schedule

# plan(graph, profile, **options) -> Schedule: vktrain.backend.kernel_planning.plan_schedule, or any function
# of the same signature.
Planner = Callable[..., Schedule]


class NoScheduleError(VktrainError, ValueError):
    """A method to load with no schedule for the device: none given or carried, and no planner to make one."""


class MethodSchedule(NamedTuple):
    """A method's schedule, and whether the executor verifies it (GraphExecutor's `verify`)."""

    schedule: Schedule
    verify: bool


def method_schedule(graph: vk.VkGraph, device: Any, *, planner: Optional[Planner] = None,
                    schedule: Optional[Schedule] = None, embedded: Optional[Schedule] = None,
                    source: str = "the program", **options: Any) -> MethodSchedule:
    """The Schedule `graph` (one delegate of a method of `source`) runs with on `device` (module docstring)."""
    if schedule is not None:
        return MethodSchedule(schedule, True)
    if embedded is not None:
        return MethodSchedule(embedded, False)  # verified as it was read (verify_embedded)
    if planner is None:
        raise NoScheduleError(f"{source}: no schedule for {getattr(device, 'name', 'this device')}: the program "
                              f"carries none and no planner was given (pass planner="
                              f"vktrain.backend.kernel_planning.plan_schedule to plan one at load)")
    profile = planning_profile(device)
    planned = planner(graph, profile, **options)
    emulated = emulated_profile_spec() is not None
    if emulated:
        check_within_profile(planned, profile, source)
    return MethodSchedule(planned, emulated)


class _SpirvModules(NamedTuple):
    """What shader_module reads of a profile, for the SPIR-V module (the workgroup size is the WGSL's too)."""

    api: str = API_VULKAN
    float16: bool = False


def check_within_profile(schedule: Schedule, profile: DeviceProfile, source: str) -> None:
    """Every dispatch of `schedule` within `profile`'s workgroup limits and counts, each kernel's workgroup size
    read from its SPIR-V as the dispatch specializes it (verify_schedule.check_schedule_profile); VerificationError
    naming the dispatch otherwise."""
    from vktrain.runtime_shaders.modules import shader_module
    from vktrain.serialization.embedded import embed_schedules
    from vktrain.serialization.verify_schedule import check_schedule_profile

    (embedded,), modules = embed_schedules([(profile, schedule)], lambda name, _: shader_module(name, _SpirvModules()),
                                           serialize=False)
    check_schedule_profile(schedule, embedded, modules, source)


def bound_planning_options(training: Any) -> dict[str, Any]:
    """The planning options of a method bound to the training step's executor `training` (eval, accumulate):
    the step's GEMM precision policy and binding limit, so the methods share one route. A route that emulated
    tensor cores (the planner's test path) leaves the bound methods at `auto`."""
    route = training.gemm_route
    precision = PRECISION_AUTO if route.emulate else route.precision
    return dict(precision=precision, max_binding_bytes=training.max_binding_bytes)


def bound_executor(graph: vk.VkGraph, training: Any, shared: dict, *, planner: Optional[Planner], source: str,
                   timing: bool, reuse_activations: bool):
    """The GraphExecutor of a method bound to the training step's executor `training` (eval, accumulate): it
    binds `shared` (the step's state and frozen constants), runs the schedule embedded for the step's profile
    or the planner's with the step's options, and reuses the step's activation buffers when asked."""
    selection = method_selection(graph, training, source)  # the step's target
    obtained = method_schedule(graph, training.device, planner=planner,
                               embedded=selection.schedule if selection else None, source=source,
                               shared=shared, **bound_planning_options(training))
    return GraphExecutor(training.device, graph, obtained.schedule, verify=obtained.verify, timing=timing,
                         shared=shared, resident_bytes=training.program_bytes,
                         arena=training if reuse_activations else None, **module_options(selection))


__all__ = ["MethodSchedule", "NoScheduleError", "Planner", "bound_planning_options", "check_within_profile",
           "method_schedule"]
