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

import struct

from vktrain.runtime_shaders.build import load_spirv
from vktrain.runtime_shaders.reflect import reflect_spirv
from vktrain.serialization.device_profile import API_WEBGPU, DeviceProfile
from vktrain.serialization.embedded import SPIRV, WGSL, ModuleBinding, ShaderModule

WGSL_F16_FEATURE = "shader-f16"


def wgsl_features(profile: DeviceProfile) -> frozenset[str]:
    """The WebGPU features whose WGSL bodies a profile's modules take."""
    return frozenset({WGSL_F16_FEATURE} if profile.float16 else ())


_OP_EXECUTION_MODE, _OP_CONSTANT, _OP_CONSTANT_COMPOSITE = 16, 43, 44
_OP_SPEC_CONSTANT, _OP_SPEC_CONSTANT_COMPOSITE, _OP_DECORATE = 50, 51, 71
_MODE_LOCAL_SIZE, _DECORATION_SPEC_ID, _DECORATION_BUILT_IN, _BUILT_IN_WORKGROUP_SIZE = 17, 1, 11, 25


def workgroup_size(spirv: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(x, y, z defaults, the specialization id of each or -1 where fixed): the workgroup size the SPIR-V
    declares, from its WorkgroupSize built-in (a composite of constants and specialization constants, as
    slang.py's fit_spirv writes a `[numthreads(VKTRAIN_LOCAL_SIZE(WG, 64), 1, 1)]` one), else its
    LocalSize execution mode; ((), ()) when it declares neither."""
    words = struct.unpack(f"<{len(spirv) // 4}I", spirv)
    spec_ids: dict[int, int] = {}
    values: dict[int, int] = {}
    composites: dict[int, tuple[int, ...]] = {}
    builtin, mode = None, ()
    position = 5
    while position < len(words):
        count, opcode = words[position] >> 16, words[position] & 0xFFFF
        operands = words[position + 1:position + count]
        if opcode == _OP_DECORATE and len(operands) >= 3 and operands[1] == _DECORATION_SPEC_ID:
            spec_ids[operands[0]] = operands[2]
        elif opcode == _OP_DECORATE and len(operands) >= 3 and operands[1:3] == (_DECORATION_BUILT_IN,
                                                                                _BUILT_IN_WORKGROUP_SIZE):
            builtin = operands[0]
        elif opcode in (_OP_CONSTANT, _OP_SPEC_CONSTANT) and len(operands) >= 3:
            values[operands[1]] = operands[2]
        elif opcode in (_OP_CONSTANT_COMPOSITE, _OP_SPEC_CONSTANT_COMPOSITE) and len(operands) >= 5:
            composites[operands[1]] = tuple(operands[2:5])
        elif opcode == _OP_EXECUTION_MODE and len(operands) >= 5 and operands[1] == _MODE_LOCAL_SIZE:
            mode = tuple(operands[2:5])
        position += max(count, 1)
    if builtin is not None and builtin in composites:
        parts = composites[builtin]
        return tuple(values.get(p, 1) for p in parts), tuple(spec_ids.get(p, -1) for p in parts)
    return (mode, (-1, -1, -1)) if mode else ((), ())


def shader_module(name: str, profile: DeviceProfile) -> ShaderModule:
    """The module of shader variant `name` on a device with `profile` (its code and reflection)."""
    spirv = load_spirv(name)
    interface = reflect_spirv(spirv)
    bindings = tuple(ModuleBinding(b.binding, "r" if b.readonly else "w" if b.writeonly else "rw")
                     for b in sorted(interface.bindings, key=lambda b: b.binding))
    push = max(interface.push_constant_size, 0)
    reflection = dict(bindings=bindings, push_constant_bytes=push, push_header=interface.has_group_offset_header,
                      spec_ids=tuple(sorted(interface.spec_ids)))
    reflection["local_size"], reflection["local_size_spec_ids"] = workgroup_size(spirv)
    if profile.api == API_WEBGPU:
        from vktrain.runtime_shaders.wgsl import wgsl_source

        features = wgsl_features(profile)
        return ShaderModule(name, WGSL, wgsl_source(name, features).encode("utf-8"), features=tuple(sorted(features)),
                            **reflection)
    return ShaderModule(name, SPIRV, spirv, **reflection)


__all__ = ["shader_module", "wgsl_features"]
