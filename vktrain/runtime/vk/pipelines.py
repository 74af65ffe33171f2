"""Compute pipelines from SPIR-V by shader name, cached per (shader, specialization, push size).

The descriptor-set layout of a pipeline is the shader's own (reflected) list of storage buffers in set
0, so a Dispatch must bind exactly those; the push-constant range is exactly the bytes pushed. Shader
modules, set layouts and pipeline layouts are shared between pipelines that agree on them.

Pipelines are created through one VkPipelineCache per Device, seeded from the on-disk cache of this device and
driver (pipeline_store.py; VKTRAIN_PIPELINE_CACHE=0: none) and written back when the device closes, if this run
created pipelines: a later run's load takes the driver's compiled pipelines from it instead of compiling.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from vktrain.runtime_shaders import ShaderInterface, load_spirv, reflect_spirv

from vktrain.serialization.dispatch import ScheduleError
from vktrain.runtime.vk.errors import VulkanError, vk_call
from vktrain.runtime.vk.pipeline_store import DeviceKey, PipelineStore, pipeline_cache_folder
from vktrain.serialization.dispatch import SpecValue

_SPEC_FORMATS = {"uint": "<I", "int": "<i", "bool": "<I", "float": "<f"}


def pack_specialization(shader: str, interface: ShaderInterface, values: tuple[tuple[int, SpecValue], ...]
                        ) -> bytes:
    """32-bit words of `values` in the order given, each packed as the type the shader declares."""
    out = bytearray()
    for spec_id, value in values:
        kind = interface.spec_types.get(spec_id)
        if kind is None:
            known = ", ".join(f"{i}: {t}" for i, t in sorted(interface.spec_types.items())) or "none"
            raise ScheduleError(
                f"shader {shader!r} has no specialization constant with id {spec_id} (it declares {known})")
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ScheduleError(f"shader {shader!r}: spec constant {spec_id} is float, got {value!r}")
            out += struct.pack("<f", float(value))
        elif kind in ("uint", "int", "bool"):
            if isinstance(value, float):
                raise ScheduleError(
                    f"shader {shader!r}: spec constant {spec_id} is {kind}, got the float {value!r}")
            value = int(value)
            if kind == "bool":
                value = 1 if value else 0
            elif kind == "uint" and not 0 <= value < 2**32:
                raise ScheduleError(f"shader {shader!r}: spec constant {spec_id} is uint, got {value}")
            elif kind == "int" and not -(2**31) <= value < 2**31:
                raise ScheduleError(f"shader {shader!r}: spec constant {spec_id} is int, got {value}")
            out += struct.pack(_SPEC_FORMATS[kind], value)
        else:
            raise ScheduleError(
                f"shader {shader!r}: spec constant {spec_id} has a type vktrain cannot specialize "
                f"(only 32-bit int/uint/float and bool)")
    return bytes(out)


@dataclass(eq=False)
class Pipeline:
    """A compute pipeline plus the layout objects a recording needs (owned by the PipelineCache)."""

    shader: str
    interface: ShaderInterface
    handle: Any
    layout: Any
    set_layout: Any
    push_size: int


class PipelineCache:
    """Creates and owns shader modules, layouts and pipelines of one Device."""

    def __init__(self, device):
        self.device = device
        self._modules: dict[str, tuple[Any, ShaderInterface]] = {}
        self._set_layouts: dict[tuple[int, ...], Any] = {}
        self._pipeline_layouts: dict[tuple[tuple[int, ...], int], Any] = {}
        self._pipelines: dict[tuple[str, tuple, int], Pipeline] = {}
        self.created = 0  # pipelines created (not found in this object) since the device opened
        self.store = _store_of(device)
        # Off (VKTRAIN_PIPELINE_CACHE=0): no VkPipelineCache at all, pipelines created as without one.
        self._vk_cache = self._create_vk_cache() if self.store is not None else None

    def _create_vk_cache(self):
        """The device's VkPipelineCache, seeded from the store's file where it holds a valid one."""
        vk = self.device.vk
        payload = self.store.read()
        seed = vk.ffi.new("char[]", payload) if payload else None
        info = vk.VkPipelineCacheCreateInfo(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO, flags=0,
                                            initialDataSize=len(payload) if payload else 0, pInitialData=seed)
        try:
            return vk_call("vkCreatePipelineCache", vk.vkCreatePipelineCache, self.device.handle, info, None)
        except VulkanError:
            if payload is None:
                raise
            self.store.status = "ignored: the driver refused it"  # checked here, refused there: start empty
            info = vk.VkPipelineCacheCreateInfo(sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO, flags=0,
                                                initialDataSize=0, pInitialData=None)
            return vk_call("vkCreatePipelineCache", vk.vkCreatePipelineCache, self.device.handle, info, None)

    def cache_data(self) -> bytes:
        """What vkGetPipelineCacheData returns for the device's VkPipelineCache now."""
        vk = self.device.vk
        size = vk.ffi.new("size_t*")
        # The binding wraps no vkGetPipelineCacheData: the C function, called twice (size, then data).
        vk_call("vkGetPipelineCacheData", _checked(vk), self.device.handle, self._vk_cache, size, vk.ffi.NULL)
        data = vk.ffi.new("char[]", size[0])
        vk_call("vkGetPipelineCacheData", _checked(vk), self.device.handle, self._vk_cache, size, data)
        return bytes(vk.ffi.buffer(data, size[0]))

    def save(self) -> bool:
        """Write the pipelines back to the store when this run created any; True when written."""
        if self.store is None or not self.created or self._vk_cache is None:
            return False
        try:
            payload = self.cache_data()
        except Exception:  # noqa: BLE001 -- a cache left unwritten costs the next load its compile time; never a close
            return False
        return self.store.write(payload)

    def store_report(self) -> dict | None:
        """The on-disk cache: its file, what reading it found, pipelines created (None: turned off)."""
        if self.store is None:
            return None
        return {"path": str(self.store.path), "read": self.store.status, "created": self.created}

    def shader(self, name: str, code: bytes | None = None) -> tuple[Any, ShaderInterface]:
        """(VkShaderModule, reflected interface) of shader `name`: its SPIR-V `code` (a module embedded in a
        blob), else the local build, each loaded once."""
        key = name if code is None else (name, code)
        if key not in self._modules:
            vk = self.device.vk
            code = load_spirv(name) if code is None else code
            interface = reflect_spirv(code)
            not_set0 = [b for b in interface.bindings if b.set != 0]
            if not_set0:
                raise ScheduleError(f"shader {name!r} uses descriptor set {not_set0[0].set}; vktrain shaders "
                                    f"bind every buffer in set 0")
            uniform = [b.binding for b in interface.bindings if b.kind != "storage"]
            if uniform:
                raise ScheduleError(f"shader {name!r} declares uniform blocks at bindings {uniform}; vktrain binds "
                                    f"storage buffers only (declare them as `buffer`, or use push constants)")
            module_info = vk.VkShaderModuleCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(code), pCode=code)
            module = vk_call("vkCreateShaderModule", vk.vkCreateShaderModule, self.device.handle, module_info,
                             None, detail=f"shader {name!r}")
            self._modules[key] = (module, interface)
        return self._modules[key]

    def interface(self, name: str, code: bytes | None = None) -> ShaderInterface:
        return self.shader(name, code)[1]

    def _set_layout(self, bindings: tuple[int, ...]):
        if bindings not in self._set_layouts:
            vk = self.device.vk
            entries = [vk.VkDescriptorSetLayoutBinding(
                binding=b, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=1,
                stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT) for b in bindings]
            info = vk.VkDescriptorSetLayoutCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, bindingCount=len(entries),
                pBindings=entries or None)
            self._set_layouts[bindings] = vk_call("vkCreateDescriptorSetLayout", vk.vkCreateDescriptorSetLayout,
                                                  self.device.handle, info, None)
        return self._set_layouts[bindings]

    def _pipeline_layout(self, bindings: tuple[int, ...], push_size: int):
        key = (bindings, push_size)
        if key not in self._pipeline_layouts:
            vk = self.device.vk
            set_layouts = [self._set_layout(bindings)]
            ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=push_size)]
            info = vk.VkPipelineLayoutCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1, pSetLayouts=set_layouts,
                pushConstantRangeCount=1 if push_size else 0, pPushConstantRanges=ranges if push_size else None)
            self._pipeline_layouts[key] = vk_call("vkCreatePipelineLayout", vk.vkCreatePipelineLayout,
                                                  self.device.handle, info, None)
        return self._pipeline_layouts[key]

    def get(self, shader: str, specialization: tuple[tuple[int, SpecValue], ...], push_size: int,
            code: bytes | None = None) -> Pipeline:
        """The pipeline of `shader` (its SPIR-V `code`, else the local build) with these (id, value)
        specialization constants and push bytes."""
        key = (shader, tuple(specialization), push_size, code)
        if key in self._pipelines:
            return self._pipelines[key]
        vk = self.device.vk
        limit = self.device.limits.max_push_constants_size
        if push_size > limit:
            raise ScheduleError(f"shader {shader!r}: {push_size} push-constant bytes exceed the device's "
                                f"maxPushConstantsSize of {limit}")
        module, interface = self.shader(shader, code)
        bindings = interface.binding_numbers
        layout = self._pipeline_layout(bindings, push_size)
        data = pack_specialization(shader, interface, specialization)
        entries = [vk.VkSpecializationMapEntry(constantID=spec_id, offset=4 * i, size=4)
                   for i, (spec_id, _) in enumerate(specialization)]
        spec_data = vk.ffi.new("char[]", data) if data else None
        spec_info = vk.VkSpecializationInfo(
            mapEntryCount=len(entries), pMapEntries=entries or None, dataSize=len(data), pData=spec_data)
        stage = vk.VkPipelineShaderStageCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=vk.VK_SHADER_STAGE_COMPUTE_BIT,
            module=module, pName="main", pSpecializationInfo=spec_info if entries else None)
        create_info = vk.VkComputePipelineCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, stage=stage, layout=layout,
            basePipelineIndex=-1)
        create_infos = [create_info]
        handles = vk_call("vkCreateComputePipelines", vk.vkCreateComputePipelines, self.device.handle,
                          self._vk_cache, 1, create_infos, None, detail=f"shader {shader!r}")
        handle = handles[0]
        self.created += 1
        pipeline = Pipeline(shader, interface, handle, layout, self._set_layout(bindings), push_size)
        self._pipelines[key] = pipeline
        return pipeline

    def __len__(self) -> int:
        return len(self._pipelines)

    def destroy(self) -> None:
        vk = self.device.vk
        device = self.device._device
        if device is None:
            return
        self.save()
        if self._vk_cache is not None:
            vk.vkDestroyPipelineCache(device, self._vk_cache, None)
            self._vk_cache = None
        for pipeline in self._pipelines.values():
            vk.vkDestroyPipeline(device, pipeline.handle, None)
        for layout in self._pipeline_layouts.values():
            vk.vkDestroyPipelineLayout(device, layout, None)
        for set_layout in self._set_layouts.values():
            vk.vkDestroyDescriptorSetLayout(device, set_layout, None)
        for module, _ in self._modules.values():
            vk.vkDestroyShaderModule(device, module, None)
        self._pipelines.clear()
        self._pipeline_layouts.clear()
        self._set_layouts.clear()
        self._modules.clear()


def _store_of(device) -> PipelineStore | None:
    """The on-disk cache of `device`'s pipelines, None when turned off (VKTRAIN_PIPELINE_CACHE=0)."""
    folder = pipeline_cache_folder()
    if folder is None:
        return None
    vk = device.vk
    props = vk.vkGetPhysicalDeviceProperties(device.physical_device)
    key = DeviceKey(int(props.vendorID), int(props.deviceID), int(props.driverVersion),
                    bytes(vk.ffi.buffer(props.pipelineCacheUUID)))
    return PipelineStore(folder, key)


def _checked(vk):
    """vkGetPipelineCacheData as a call vk_call can check (it raises on a VkResult other than success)."""
    def call(*args):
        result = vk.lib.vkGetPipelineCacheData(*args)
        if result != vk.VK_SUCCESS:
            raise vk.exception_codes[result]
        return result
    return call
