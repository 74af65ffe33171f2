"""The DeviceProfile (vktrain/serialization/device_profile.py) of a device this process opened, built from
what the device layer queried: a Vulkan Device (vk/device.py) or a WebGPU Device (webgpu/device.py).

The program layer hands it to the caller's planner (vktrain/runtime/program/schedules.py; the AOT side's
kernel planning reads nothing else of the device), the executor checks a schedule's requirements against it,
and `vktrain devices` prints it. `planning_profile(device)` is the profile planned for: the device's own, or,
with VKTRAIN_DEVICE_PROFILE=NAME|FILE.json (`--device-profile` of train, eval and generate sets it), that
profile emulated on the device (serialization/profile_emulation.py `intersect`). The tuning fields are the
record's defaults (measured on the H200): a device of its own is not measured here; a Vulkan device whose name
names a vendor of VENDOR_GEMM_TUNING (Adreno, Mali, Apple, Intel, AMD / Radeon) takes that row's prefers_fp16
and tiles.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from vktrain.serialization.device_profile import (API_VULKAN, API_WEBGPU, COMPONENT_TYPES, DEVICE_TYPES, SCOPES,
                                                  WEBGPU_DEVICE_TYPE, CoopmatShape, DeviceProfile,
                                                  resolve_profile, subgroup_operation_names, vendor_gemm_tuning)
from vktrain.serialization.profile_emulation import intersect

DEVICE_PROFILE_ENV = "VKTRAIN_DEVICE_PROFILE"

# wgpu's adapter types as the VkPhysicalDeviceType names profiles use.
_WEBGPU_ADAPTER_TYPES = {"DiscreteGPU": "discrete", "IntegratedGPU": "integrated", "VirtualGPU": "virtual",
                         "CPU": "cpu"}
_WEBGPU_F16 = "shader-f16"


def _coopmat_shapes(properties) -> tuple[CoopmatShape, ...]:
    """The device's cooperative-matrix list as profile shapes (combinations with a type or scope the
    profile does not name, e.g. a vendor's own, are left out: no kernel uses them)."""
    shapes = []
    for p in properties:
        types = (p.a_type, p.b_type, p.c_type, p.result_type)
        if all(t in COMPONENT_TYPES for t in types) and p.scope in SCOPES:
            shapes.append(CoopmatShape(p.m, p.n, p.k, *types, scope=p.scope))
    return tuple(shapes)


def _vulkan_profile(device: Any) -> DeviceProfile:
    limits = device.limits
    device_type = device.device_type if device.device_type in DEVICE_TYPES else "other"
    return DeviceProfile(
        name=device.name, api=API_VULKAN, device_type=device_type,
        subgroup_size=int(device.subgroup_size),
        subgroup_operations=subgroup_operation_names(int(device.subgroup_operations)),
        float16="shaderFloat16" in device.features, int64="shaderInt64" in device.features,
        cooperative_matrix=_coopmat_shapes(device.cooperative_matrix_properties),
        max_shared_memory_bytes=int(limits.max_compute_shared_memory_size),
        max_workgroup_invocations=int(limits.max_compute_work_group_invocations),
        max_workgroup_size=tuple(int(v) for v in limits.max_compute_work_group_size),
        max_workgroup_count=tuple(int(v) for v in limits.max_compute_work_group_count),
        max_storage_buffer_range=int(limits.max_storage_buffer_range),
        min_storage_buffer_offset_alignment=int(limits.min_storage_buffer_offset_alignment),
        max_allocation_bytes=int(limits.max_memory_allocation_size),
        max_push_constants_bytes=int(limits.max_push_constants_size),
        max_storage_buffers_per_stage=int(limits.max_per_stage_descriptor_storage_buffers),
        **_vendor_fields(device.name, int(limits.max_compute_work_group_invocations)),
        source=f"queried: {device.name}, Vulkan {device.version_string(device.api_version)}")


def _vendor_fields(name: str, max_invocations: int) -> dict:
    """The vendor tuning of a device its name identifies (serialization/device_profile.py VENDOR_GEMM_TUNING),
    its tiles only where the device can run them."""
    row = vendor_gemm_tuning(name)
    if row is None:
        return {}
    fits = row.gemm_tiles[0] * row.gemm_tiles[1] <= max_invocations if row.gemm_tiles else True
    return dict(prefers_fp16=row.prefers_fp16, gemm_tiles=row.gemm_tiles if fits else ())


def _webgpu_profile(device: Any) -> DeviceProfile:
    limits = device.limits
    return DeviceProfile(
        name=device.name, api=API_WEBGPU,
        device_type=_WEBGPU_ADAPTER_TYPES.get(getattr(device, "adapter_type", ""), "other"),
        # The WGSL kernels use no subgroup operations, and WGSL has no 64-bit integers.
        subgroup_size=0, subgroup_operations=(), int64=False,
        float16=_WEBGPU_F16 in device.kernel_features,  # what the kernels may use (the device may have more)
        cooperative_matrix=(),
        max_shared_memory_bytes=int(limits.max_compute_shared_memory_size),
        max_workgroup_invocations=int(limits.max_compute_work_group_invocations),
        max_workgroup_size=tuple(int(v) for v in limits.max_compute_work_group_size),
        max_workgroup_count=tuple(int(v) for v in limits.max_compute_work_group_count),
        max_storage_buffer_range=int(limits.max_storage_buffer_range),
        min_storage_buffer_offset_alignment=int(limits.min_storage_buffer_offset_alignment),
        max_allocation_bytes=int(limits.max_buffer_size),
        max_push_constants_bytes=0,  # the push block travels in a uniform buffer
        max_storage_buffers_per_stage=int(limits.max_per_stage_descriptor_storage_buffers),
        source=f"queried: {device.name}, WebGPU ({getattr(device, 'backend', '?')} backend)")


def profile_of(device: Any) -> DeviceProfile:
    """The DeviceProfile of an opened vktrain Device (Vulkan or WebGPU)."""
    if getattr(device, "device_type", None) == WEBGPU_DEVICE_TYPE:
        return _webgpu_profile(device)
    return _vulkan_profile(device)


def emulated_profile_spec(environ: Optional[Mapping[str, str]] = None) -> str | None:
    """The profile VKTRAIN_DEVICE_PROFILE names (a built-in name or a profile file), None when unset."""
    spec = (os.environ if environ is None else environ).get(DEVICE_PROFILE_ENV, "").strip()
    return spec or None


def planning_profile(device: Any, environ: Optional[Mapping[str, str]] = None) -> DeviceProfile:
    """The profile the executor plans with on `device`: its own, or the one VKTRAIN_DEVICE_PROFILE names,
    emulated on it (refused, naming the field, where the device cannot)."""
    own = profile_of(device)
    spec = emulated_profile_spec(environ)
    return own if spec is None else intersect(own, resolve_profile(spec))
