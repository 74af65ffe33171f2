"""Emulation: a device run as if its limits were a device profile's (`--device-profile`, issue 29): the
profile planning reads on that device, or a refusal naming what the profile promises beyond the device."""
from __future__ import annotations

import dataclasses
from typing import Any

from vktrain.serialization.device_profile import API_WEBGPU, DeviceProfile, DeviceProfileError


class EmulationError(DeviceProfileError):
    """A profile a device cannot emulate: the message names the field, the profile's value and the device's."""


# Upper limits: the profile's must be at most the device's (the plan then fits the device too).
_UPPER_LIMITS = ("max_shared_memory_bytes", "max_workgroup_invocations", "max_storage_buffer_range",
                 "max_allocation_bytes", "max_push_constants_bytes", "max_storage_buffers_per_stage")
_UPPER_TRIPLES = ("max_workgroup_size", "max_workgroup_count")


def intersect(device: DeviceProfile, target: DeviceProfile) -> DeviceProfile:
    """What to plan with to run on `device` as if it were `target`: the target's limits, features and tuning,
    on the device's api. Refused (EmulationError naming the field, the target's value and the device's) where
    the target promises more than the device has: a larger limit, a finer offset alignment, a feature
    (fp16, int64, a cooperative-matrix shape, a subgroup operation) the device lacks.

    Subgroups: where both promise the same size the target's is kept; otherwise the result promises none
    (subgroup_size 0, no operations), so the kernels take their portable path (no CPU bodies, no subgroup
    operations) -- except for a target with cooperative matrices, whose kernels are written for its
    subgroup size: refused."""
    refusals = []

    def refuse(field: str, want: Any, have: Any, why: str) -> None:
        refusals.append(f"{field}: the profile's {want} {why} the device's {have}")

    for name in _UPPER_LIMITS:
        if name == "max_push_constants_bytes" and device.api == API_WEBGPU:
            continue  # WebGPU's push block travels in a uniform buffer: no limit to emulate
        if getattr(target, name) > getattr(device, name):
            refuse(name, getattr(target, name), getattr(device, name), "is above")
    for name in _UPPER_TRIPLES:
        want, have = getattr(target, name), getattr(device, name)
        if any(w > h for w, h in zip(want, have)):
            refuse(name, "x".join(map(str, want)), "x".join(map(str, have)), "is above")
    if target.min_storage_buffer_offset_alignment < device.min_storage_buffer_offset_alignment:
        refuse("min_storage_buffer_offset_alignment", target.min_storage_buffer_offset_alignment,
               device.min_storage_buffer_offset_alignment, "is finer than")
    for name in ("float16", "int64"):
        if getattr(target, name) and not getattr(device, name):
            refuse(name, "yes", "no", "against")
    absent = [shape for shape in target.cooperative_matrix if shape not in device.cooperative_matrix]
    if absent:
        s = absent[0]
        refuse("cooperative_matrix", f"{s.m}x{s.n}x{s.k} {s.a_type}*{s.b_type}+{s.c_type} ({s.scope})",
               f"{len(device.cooperative_matrix)} shape(s) without it", "against")
    same_subgroups = target.subgroup_size == device.subgroup_size
    if same_subgroups:
        absent_ops = [op for op in target.subgroup_operations if op not in device.subgroup_operations]
        if absent_ops:
            refuse("subgroup_operations", ", ".join(absent_ops), ", ".join(device.subgroup_operations) or "none",
                   "against")
    elif target.cooperative_matrix:
        refuse("subgroup_size", target.subgroup_size, device.subgroup_size,
               "(its cooperative-matrix kernels are written for it) against")
    if refusals:
        raise EmulationError(f"{device.name} cannot emulate device profile {target.name!r}: {'; '.join(refusals)}")
    return dataclasses.replace(
        target, name=f"{target.name} (emulated on {device.name})", api=device.api,
        subgroup_size=target.subgroup_size if same_subgroups else 0,
        subgroup_operations=target.subgroup_operations if same_subgroups else (),
        max_push_constants_bytes=(device.max_push_constants_bytes if device.api == API_WEBGPU
                                  else target.max_push_constants_bytes),
        source=f"{target.source}; emulated on {device.source or device.name}")


__all__ = ["EmulationError", "intersect"]
