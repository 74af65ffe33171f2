"""Which embedded schedule a program's method runs on a device (vktrain/serialization/embedded.py: the
schedules `vktrain export --target` put in the delegate blob, and the matching rule).

    selection = step_selection(graph, device, source)        # the training step: by the matching rule
    selection = method_selection(graph, training, source)    # eval / accumulate: the step's profile
    obtained = method_schedule(graph, device, embedded=selection.schedule if selection else None, ...)
    GraphExecutor(device, graph, obtained.schedule, **module_options(selection))

None: the blob embeds no schedules (or the step plans at load, or an emulated profile fits none of them), and the
executor plans at load as before.
The tables are verified (verify_schedule.py verify_embedded) before one is chosen: all of them for the training step
(the matching rule reads every one), the one of the step's profile for its other methods (they read no other).
"""
from __future__ import annotations

from typing import Any

from vktrain.runtime.device_profiles import planning_profile, profile_of
from vktrain.serialization import graph as g
from vktrain.serialization.embedded import NoMatchingScheduleError, Selection, schedule_for_profile, select_schedule
from vktrain.serialization.verify_schedule import verify_embedded


def step_selection(graph: g.VkGraph, device: Any, source: str) -> Selection | None:
    """The embedded schedule the device's planning profile satisfies (the matching rule); None without
    embedded schedules for the device's api; NoMatchingScheduleError when none of those fits. Under an
    emulated profile (--device-profile) that no embedded schedule fits, None: the runtime plans for the
    emulated profile at load, as it did before schedules were embedded (emulation runs the device as if it
    were the profile, and a .pte rarely carries that profile's schedule)."""
    profile = planning_profile(device)
    if not any(embedded.profile.api == profile.api for embedded in graph.schedules):
        return None  # none for this runtime's api (e.g. Vulkan schedules on the WebGPU runtime): plan at load
    read = verify_embedded(graph, source)
    try:
        return select_schedule(graph.schedules, graph.shader_modules, profile,
                               device_name=getattr(device, "name", "this device"), source=source, read=read)
    except NoMatchingScheduleError:
        if profile != profile_of(device):
            return None
        raise


def method_selection(graph: g.VkGraph, training: Any, source: str) -> Selection | None:
    """Another method's schedule for the profile the training step's executor (`training`) runs; None when
    the step plans at load (so does this method)."""
    target = getattr(training, "target_profile", None)
    if target is None:
        return None
    index = next((i for i, embedded in enumerate(graph.schedules) if embedded.profile.name == target.name), None)
    if index is None:  # schedule_for_profile refuses it, naming the profiles there are
        return schedule_for_profile(graph.schedules, graph.shader_modules, target.name, source=source, read=[])
    read = verify_embedded(graph, source, only=index)  # the step's profile's schedule, not every profile's
    return schedule_for_profile(graph.schedules, graph.shader_modules, target.name, source=source, read=read)


def unused_tensor_cores_hint(graph: g.VkGraph, device: Any) -> str:
    """What to say when the device lists cooperative matrices (tensor cores) but no schedule the blob embeds uses
    them (a .pte exported for desktop-gpu alone runs the fp32 kernels there: 3.7x slower for the Llama-3.2-1B step
    at 4 x 512 on an H100); "" otherwise."""
    if not graph.schedules or not getattr(device, "cooperative_matrix_properties", ()):
        return ""
    if any(embedded.profile.cooperative_matrix for embedded in graph.schedules):
        return ""
    return ("this device has cooperative matrices (tensor cores), which no schedule in the .pte uses: "
            "`--precision fp16-tc` plans them at load, or export again with the default --target portable")


def module_options(selection: Selection | None) -> dict[str, Any]:
    """GraphExecutor's modules and target_profile for `selection` (nothing for None); its schedule goes through
    schedules.method_schedule's `embedded`."""
    if selection is None:
        return {}
    return dict(modules=selection.modules, target_profile=selection.profile)


__all__ = ["module_options", "method_selection", "step_selection"]
