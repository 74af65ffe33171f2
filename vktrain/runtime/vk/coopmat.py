"""VK_KHR_cooperative_matrix: whether a physical device has it, the feature struct that enables it, and
the list of matrix shapes and component types it supports (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR).

Device creation (device.py) calls `query_cooperative_matrix` before vkCreateDevice: where the extension and
its `cooperativeMatrix` feature exist, it returns the feature struct to chain into VkDeviceCreateInfo and
the extension name to enable; `Device.cooperative_matrix_properties` then holds the property list (empty
where the device has none, e.g. lavapipe). Planning picks tensor-core paths with
vktrain/serialization/device_profile.py `supports_shape`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vktrain.runtime.vk.errors import VulkanError, vk_call
from vktrain.serialization.device_profile import COOPMAT_EXTENSION as EXTENSION_NAME

# VkComponentTypeKHR values (the Vulkan spec's enum; the KHR values equal the older NV ones).
COMPONENT_TYPE_NAMES = {
    0: "float16", 1: "float32", 2: "float64", 3: "int8", 4: "int16", 5: "int32", 6: "int64",
    7: "uint8", 8: "uint16", 9: "uint32", 10: "uint64",
    1000141000: "bfloat16",  # VK_COMPONENT_TYPE_BFLOAT16_KHR (VK_KHR_shader_bfloat16)
}
# VkScopeKHR values.
SCOPE_NAMES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}


@dataclass(frozen=True)
class CooperativeMatrixShape:
    """One supported combination: A is M x K, B is K x N, C and the result are M x N (component types by
    name: "float16", "float32", "bfloat16", "int8", ...), at `scope` ("subgroup" for KHR)."""

    m: int
    n: int
    k: int
    a_type: str
    b_type: str
    c_type: str
    result_type: str
    saturating_accumulation: bool
    scope: str

    def describe(self) -> str:
        return (f"{self.m}x{self.n}x{self.k} {self.a_type}*{self.b_type}+{self.c_type}->{self.result_type} "
                f"({self.scope})")


def _component_name(value: int) -> str:
    return COMPONENT_TYPE_NAMES.get(int(value), f"unknown({int(value)})")


def device_extensions(vk: Any, physical_device: Any) -> set[str]:
    """Names of the device extensions `physical_device` offers."""
    return {p.extensionName for p in vk_call("vkEnumerateDeviceExtensionProperties",
                                             vk.vkEnumerateDeviceExtensionProperties, physical_device, None)}


def _properties(vk: Any, instance: Any, physical_device: Any) -> tuple[CooperativeMatrixShape, ...]:
    # Called through the raw function pointer: the binding's wrapper leaves each output struct's sType
    # zero, which the spec (and the validation layer) forbids.
    address = vk.lib.vkGetInstanceProcAddr(instance, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    if address == vk.ffi.NULL:
        raise VulkanError(f"{EXTENSION_NAME} is listed but vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR "
                          f"is not exported by the loader")
    function = vk.ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", address)
    count = vk.ffi.new("uint32_t*")
    result = function(physical_device, count, vk.ffi.NULL)
    if result != vk.VK_SUCCESS:
        raise VulkanError(f"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR returned {result}")
    entries = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for index in range(count[0]):
        entries[index].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    result = function(physical_device, count, entries)
    if result not in (vk.VK_SUCCESS, vk.VK_INCOMPLETE):
        raise VulkanError(f"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR returned {result}")
    return tuple(
        CooperativeMatrixShape(
            m=int(e.MSize), n=int(e.NSize), k=int(e.KSize), a_type=_component_name(e.AType),
            b_type=_component_name(e.BType), c_type=_component_name(e.CType),
            result_type=_component_name(e.ResultType), saturating_accumulation=bool(e.saturatingAccumulation),
            scope=SCOPE_NAMES.get(int(e.scope), f"unknown({int(e.scope)})"))
        for e in (entries[i] for i in range(count[0])))


# VK_NV_cooperative_matrix2 (workgroup scope, flexible dimensions, tensor addressing, decode in the load):
# the Python binding (vulkan 1.3.275) predates it, so its feature struct is written as raw words:
# VkPhysicalDeviceCooperativeMatrix2FeaturesNV {sType, pNext, 7 x VkBool32} (48 bytes on a 64-bit host).
NV_COOPMAT2_EXTENSION = "VK_NV_cooperative_matrix2"
NV_COOPMAT2_FEATURES_STYPE = 1000593000  # VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_2_FEATURES_NV
NV_COOPMAT2_FEATURES = ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                        "cooperativeMatrixReductions", "cooperativeMatrixConversions",
                        "cooperativeMatrixPerElementOperations", "cooperativeMatrixTensorAddressing",
                        "cooperativeMatrixBlockLoads")
_FEATURE_WORD = 4  # the first VkBool32 after sType (4 bytes), padding (4) and pNext (8)


def _nv_coopmat2_struct(vk: Any, values: tuple[int, ...] = (0,) * len(NV_COOPMAT2_FEATURES)) -> Any:
    words = vk.ffi.new("uint32_t[12]")
    words[0] = NV_COOPMAT2_FEATURES_STYPE
    for index, value in enumerate(values):
        words[_FEATURE_WORD + index] = value
    return words


@dataclass
class CooperativeMatrixSupport:
    """What device creation needs: the feature struct to chain (keep it alive until vkCreateDevice
    returns), the extensions to enable, and the supported shapes. `nv_coopmat2`: the VK_NV_cooperative_matrix2
    features enabled (empty where the device lacks the extension); its raw struct hangs off feature_struct."""

    feature_struct: Any
    extension: str
    properties: tuple[CooperativeMatrixShape, ...]
    nv_coopmat2: frozenset = frozenset()
    nv_coopmat2_struct: Any = None

    @property
    def extensions(self) -> list[str]:
        return [self.extension] + ([NV_COOPMAT2_EXTENSION] if self.nv_coopmat2 else [])


def query_cooperative_matrix(vk: Any, instance: Any, physical_device: Any, api_version: int, *,
                             nv_coopmat2: bool = False) -> CooperativeMatrixSupport | None:
    """The device's cooperative-matrix support, or None where it has no usable VK_KHR_cooperative_matrix
    (extension absent, feature off, or a Vulkan 1.1 device without the 1.2 feature structs the
    kernels' fp16 arithmetic and memory model need). `nv_coopmat2`: also enable every VK_NV_cooperative_matrix2
    feature the device has (no product kernel uses them yet: scripts/probe_coopmat2.py asks)."""
    if api_version < vk.VK_MAKE_VERSION(1, 2, 0) or EXTENSION_NAME not in device_extensions(vk, physical_device):
        return None
    supported = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR)
    features2 = vk.VkPhysicalDeviceFeatures2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                                             pNext=supported)
    vk.vkGetPhysicalDeviceFeatures2(physical_device, features2)
    if not supported.cooperativeMatrix:
        return None
    wanted = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR, cooperativeMatrix=1)
    support = CooperativeMatrixSupport(wanted, EXTENSION_NAME, _properties(vk, instance, physical_device))
    if nv_coopmat2 and NV_COOPMAT2_EXTENSION in device_extensions(vk, physical_device):
        query = _nv_coopmat2_struct(vk)
        features2 = vk.VkPhysicalDeviceFeatures2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                                                 pNext=vk.ffi.cast("void*", query))
        vk.vkGetPhysicalDeviceFeatures2(physical_device, features2)
        values = tuple(int(query[_FEATURE_WORD + i]) for i in range(len(NV_COOPMAT2_FEATURES)))
        if any(values):
            support.nv_coopmat2 = frozenset(n for n, v in zip(NV_COOPMAT2_FEATURES, values) if v)
            support.nv_coopmat2_struct = _nv_coopmat2_struct(vk, values)
            wanted.pNext = vk.ffi.cast("void*", support.nv_coopmat2_struct)
    return support
