"""WGSL shader modules with or without naga's runtime checks.

naga compiles a module from `create_shader_module` with runtime checks: every storage and workgroup
array index bounds-checked (clamped or the access dropped: a wrong index gives a wrong result, never
an error) and ForceLoopBounding (a counter in every loop, so a shader never hangs the GPU). wgpu-native
also has `wgpuDeviceCreateShaderModuleTrusted(device, descriptor, WGPUShaderRuntimeChecks)`, which
compiles without the checks left out of the flags; wgpu-py 0.32 does not wrap it, so this module calls
it through wgpu-py's own cffi `lib` with the descriptor wgpu-py builds for WGSL
(GPUDevice.create_shader_module in wgpu/backends/wgpu_native/_api.py) and wraps the handle as that
backend's GPUShaderModule (released as wgpu-py releases its own). Native only: a browser never gets it.
"""
from __future__ import annotations

from vktrain.runtime.webgpu.errors import WebGPUUnavailableError

TRUSTED_FUNCTION = "wgpuDeviceCreateShaderModuleTrusted"
NO_RUNTIME_CHECKS = 0  # WGPUShaderRuntimeChecks_None: no bounds checks, no loop bounding


def trusted_modules_unavailable(device_handle) -> str | None:
    """Why `device_handle` (a wgpu GPUDevice) cannot create trusted modules, or None when it can."""
    try:
        from wgpu.backends.wgpu_native import _api
    except ImportError as exc:
        return f"wgpu's wgpu_native backend is not importable ({exc})"
    if not isinstance(device_handle, _api.GPUDevice):
        return (f"the device is a {type(device_handle).__module__}.{type(device_handle).__name__}, not wgpu-native's "
                "(trusted modules are a wgpu-native extension)")
    if not hasattr(_api.lib, TRUSTED_FUNCTION):
        return f"this wgpu-native build has no {TRUSTED_FUNCTION} (wgpu-py 0.32 / wgpu-native 29 have it)"
    return None


def create_trusted_wgsl_module(device_handle, label: str, code: str):
    """A GPUShaderModule of the WGSL `code` compiled without runtime checks (the caller checked
    trusted_modules_unavailable). wgpu errors raise as from create_shader_module (libf captures them)."""
    from wgpu.backends.wgpu_native._api import (GPUShaderModule, ffi, lib, libf, new_struct_p,
                                                to_c_string_view)

    reason = trusted_modules_unavailable(device_handle)
    if reason is not None:
        raise WebGPUUnavailableError(f"trusted shader module {label!r}: {reason}")
    # The WGSL branch of wgpu-py's GPUDevice.create_shader_module, descriptor for descriptor.
    source = new_struct_p("WGPUShaderSourceWGSL *", code=to_c_string_view(code))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    descriptor = new_struct_p("WGPUShaderModuleDescriptor *", nextInChain=ffi.cast("WGPUChainedStruct *", source),
                              label=to_c_string_view(label))
    handle = getattr(libf, TRUSTED_FUNCTION)(device_handle._internal, descriptor, NO_RUNTIME_CHECKS)
    if handle == ffi.NULL:
        raise RuntimeError(f"{TRUSTED_FUNCTION} returned no module for {label!r}")
    return GPUShaderModule(label, handle, device_handle)
