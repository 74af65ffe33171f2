"""Kernel planning: a VkGraph and a DeviceProfile -> its Schedule (vktrain/serialization/schedule.py), the
runtime's whole program of dispatches. The AOT side's; the runtime interprets a Schedule and chooses nothing.

    from vktrain.backend.kernel_planning import plan_schedule
    schedule = plan_schedule(graph, profile, precision="auto")     # planner.py

planner.py walks the graph through the op-lowering table (op_lowering.py; what a lowering sees:
lowering_context.py), which calls the kernel families' plan functions (kernels/*.py: tiling, split-K, binding
windows, push constants). `plan_schedule` is the planner callable the runtime's program layer takes
(vktrain/runtime/program/schedules.py `Planner`): the app hands it over, the runtime calls it with the device's
profile.
"""
from vktrain.backend.kernel_planning.planner import plan_schedule

__all__ = ["plan_schedule"]
