"""The shader module a device profile runs for a shader variant, for embedding in a blob
(vktrain/serialization/embedded.py ShaderModule): the built SPIR-V for a Vulkan profile, the WGSL text for a
WebGPU one, with the reflection a runtime checks dispatches against.

The reflection is the SPIR-V's (reflect.py) for both codes: the WGSL kernels follow the GLSL interface
exactly (bindings in order with the GLSL's readonly / writeonly, the params block ending where the push block
ends, every specialization id declared: wgsl/__init__.py), so the GLSL variant's interface is the contract.
A WebGPU profile's WGSL takes the shader-f16 bodies where the profile has float16 and no subgroup bodies
(a WebGPU profile promises no subgroups: vktrain/runtime/device_profiles.py).
"""
from __future__ import annotations

from vktrain.runtime_shaders.build import load_spirv
from vktrain.runtime_shaders.reflect import reflect_spirv
from vktrain.serialization.device_profile import API_WEBGPU, DeviceProfile
from vktrain.serialization.embedded import SPIRV, WGSL, ModuleBinding, ShaderModule

WGSL_F16_FEATURE = "shader-f16"


def wgsl_features(profile: DeviceProfile) -> frozenset[str]:
    """The WebGPU features whose WGSL bodies a profile's modules take."""
    return frozenset({WGSL_F16_FEATURE} if profile.float16 else ())


def shader_module(name: str, profile: DeviceProfile) -> ShaderModule:
    """The module of shader variant `name` on a device with `profile` (its code and reflection)."""
    spirv = load_spirv(name)
    interface = reflect_spirv(spirv)
    bindings = tuple(ModuleBinding(b.binding, "r" if b.readonly else "w" if b.writeonly else "rw")
                     for b in sorted(interface.bindings, key=lambda b: b.binding))
    push = max(interface.push_constant_size, 0)
    reflection = dict(bindings=bindings, push_constant_bytes=push, push_header=interface.has_group_offset_header,
                      spec_ids=tuple(sorted(interface.spec_ids)))
    if profile.api == API_WEBGPU:
        from vktrain.runtime_shaders.wgsl import wgsl_source

        features = wgsl_features(profile)
        return ShaderModule(name, WGSL, wgsl_source(name, features).encode("utf-8"), features=tuple(sorted(features)),
                            **reflection)
    return ShaderModule(name, SPIRV, spirv, **reflection)


__all__ = ["shader_module", "wgsl_features"]
