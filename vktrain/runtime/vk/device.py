"""Vulkan instance + logical device: physical-device choice, compute queue, features, validation.

Physical-device choice: discrete > integrated > virtual > CPU > other, first enumerated wins a tie.
`VKTRAIN_DEVICE` overrides it with an index (into vkEnumeratePhysicalDevices order) or a
case-insensitive substring of the device name; a selector matching nothing (or several names) is an
error listing what exists. A `GpuIdentity` selector (device_identity.py: a UUID / PCI address another API
gave, e.g. the GPU Ray assigned a fleet client) picks the device with that deviceUUID / PCI bus info.

Validation: `VKTRAIN_VALIDATION=1` (or `Device(validation=True)`) enables VK_LAYER_KHRONOS_validation
and a debug-utils messenger; warnings and errors are collected in `Device.validation_messages` so tests
can fail on them (tests/conftest.py does). Validation runs also enable robustBufferAccess where the
device has it, so a dispatch that indexes past its binding cannot corrupt a neighbouring buffer of
the same memory block (`Device.features` lists it when enabled).

Memory: buffers are sub-allocated from a few large blocks (memory.py); `memory_stats()` reports
allocations and bytes, `memory_budget()` the heaps and the largest buffer the device can hold.

Lifetime: every Buffer, Program and pipeline created from a Device registers with it; `Device.close()`
destroys whatever is still alive, then the device and instance, so teardown is leak-free in any order.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from vktrain.runtime.vk.allocator import DEFAULT_BLOCK_BYTES, MemoryBudget, MemoryHeap, MemoryStats
from vktrain.runtime.vk.coopmat import query_cooperative_matrix
from vktrain.runtime.vk.device_identity import GpuIdentity, PciAddress, match_physical_device
from vktrain.runtime.vk.errors import (
    INSTALL_HINT,
    DeviceSelectionError,
    ValidationLayerMissingError,
    VulkanError,
    VulkanUnavailableError,
    load_vulkan,
    vk_call,
)
from vktrain.runtime.vk.memory import DeviceMemory, buffer_memory_flags, find_memory_type, memory_type_flags

VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"
DEVICE_ENV = "VKTRAIN_DEVICE"
VALIDATION_ENV = "VKTRAIN_VALIDATION"

# Ranking of VkPhysicalDeviceType values (0 other, 1 integrated, 2 discrete, 3 virtual, 4 cpu):
# a larger rank is preferred.
_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {2: 4, 1: 3, 3: 2, 4: 1, 0: 0}

# Optional features enabled whenever the device supports them: kernels may rely on them after
# checking `Device.features` (8/16-bit storage for packed weights, fp16/int8 arithmetic, int64, fp64).
_OPTIONAL_FEATURES_10 = ("shaderInt64", "shaderInt16", "shaderFloat64")
_OPTIONAL_FEATURES_11 = ("storageBuffer16BitAccess", "uniformAndStorageBuffer16BitAccess")
_OPTIONAL_FEATURES_12 = ("storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess",
                         "shaderFloat16", "shaderInt8", "bufferDeviceAddress", "scalarBlockLayout",
                         "vulkanMemoryModel", "vulkanMemoryModelDeviceScope")  # cooperative-matrix shaders use it
# Enabled only with validation: bounds-checked buffer access makes out-of-range indexing harmless
# (and may cost speed, so normal runs leave it off).
_VALIDATION_FEATURES_10 = ("robustBufferAccess",)


@dataclass(frozen=True)
class PhysicalDeviceInfo:
    """What selection needs to know about one physical device."""

    index: int
    name: str
    device_type: int
    api_version: int = 0
    uuid: bytes | None = None  # VkPhysicalDeviceIDProperties.deviceUUID
    pci: PciAddress | None = None  # VK_EXT_pci_bus_info, where the device lists it

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.device_type, f"unknown({self.device_type})")

    def describe(self) -> str:
        return f"[{self.index}] {self.name} ({self.type_name})"


def select_physical_device(devices: Sequence[PhysicalDeviceInfo], selector: str | int | GpuIdentity | None) -> int:
    """Index of the device to use: `selector` (index, name substring or GpuIdentity) if given, else the
    best type."""
    if not devices:
        raise VulkanUnavailableError(f"Vulkan found no physical device; {INSTALL_HINT}")
    if isinstance(selector, GpuIdentity):
        return match_physical_device(devices, selector)
    listing = ", ".join(d.describe() for d in devices)
    if selector is None or (isinstance(selector, str) and not selector.strip()):
        best = max(devices, key=lambda d: (_TYPE_RANK.get(d.device_type, 0), -d.index))
        return best.index
    text = str(selector).strip()
    if text.isdigit():
        index = int(text)
        if not 0 <= index < len(devices):
            raise DeviceSelectionError(
                f"{DEVICE_ENV}={text}: device index out of range; available devices: {listing}")
        return index
    matches = [d for d in devices if text.lower() in d.name.lower()]
    if not matches:
        raise DeviceSelectionError(
            f"{DEVICE_ENV}={text!r} matches no device name; available devices: {listing} "
            f"(use an index or a case-insensitive part of a name)")
    if len({d.name for d in matches}) > 1:
        raise DeviceSelectionError(
            f"{DEVICE_ENV}={text!r} is ambiguous, it matches: "
            f"{', '.join(d.describe() for d in matches)}; use an index or a longer name")
    return matches[0].index


@dataclass(frozen=True)
class ValidationMessage:
    severity: str  # "error", "warning"
    types: str  # "validation", "performance", "general" (joined with "|")
    id_name: str
    message: str

    def __str__(self) -> str:
        return f"[{self.severity}/{self.types}] {self.id_name}: {self.message}"


@dataclass(frozen=True)
class DeviceLimits:
    """The limits the runtime checks against, copied out of VkPhysicalDeviceLimits."""

    max_storage_buffer_range: int
    min_storage_buffer_offset_alignment: int
    max_compute_work_group_count: tuple[int, int, int]
    max_compute_work_group_size: tuple[int, int, int]
    max_compute_work_group_invocations: int
    max_compute_shared_memory_size: int
    max_push_constants_size: int
    max_bound_descriptor_sets: int
    max_per_stage_descriptor_storage_buffers: int
    max_memory_allocation_count: int
    max_memory_allocation_size: int  # VkPhysicalDeviceMaintenance3Properties (core in 1.1)
    buffer_image_granularity: int
    non_coherent_atom_size: int
    timestamp_period_ns: float


@dataclass
class _ValidationCollector:
    messages: list[ValidationMessage] = field(default_factory=list)


def _debug_callback(severity, types, callback_data, user_data):
    """The one debug-utils callback (the binding keeps a single global); user_data points at a collector."""
    vk = load_vulkan()
    try:
        collector = vk.ffi.from_handle(user_data)
        data = callback_data
        message = vk.ffi.string(data.pMessage).decode("utf-8", "replace") if data.pMessage else ""
        id_name = vk.ffi.string(data.pMessageIdName).decode("utf-8", "replace") if data.pMessageIdName else ""
        severity_name = "error" if severity & vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT else "warning"
        kinds = []
        if types & vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT:
            kinds.append("validation")
        if types & vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT:
            kinds.append("performance")
        if types & vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT:
            kinds.append("general")
        collector.messages.append(ValidationMessage(severity_name, "|".join(kinds), id_name, message))
    except Exception as exc:  # an exception must not unwind through the C callback
        print(f"vktrain: failed to record a validation message: {exc!r}")
    return 0  # VK_FALSE: never abort the call that triggered the message


def _query_identity(vk, physical_device) -> tuple[bytes, PciAddress | None]:
    """(deviceUUID, PCI address or None) of a Vulkan 1.1 device: the bus info only where the device lists
    VK_EXT_pci_bus_info (chaining an unlisted extension's struct is invalid usage)."""
    extensions = {p.extensionName for p in vk_call("vkEnumerateDeviceExtensionProperties",
                                                   vk.vkEnumerateDeviceExtensionProperties, physical_device, None)}
    # Every struct of the chain stays in a local until the call returns (cffi frees early).
    pci_info = (vk.VkPhysicalDevicePCIBusInfoPropertiesEXT(
        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT)
        if vk.VK_EXT_PCI_BUS_INFO_EXTENSION_NAME in extensions else None)
    id_properties = vk.VkPhysicalDeviceIDProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES,
                                                    pNext=pci_info)
    properties2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                                 pNext=id_properties)
    vk.vkGetPhysicalDeviceProperties2(physical_device, properties2)
    uuid = bytes(vk.ffi.buffer(id_properties.deviceUUID))
    pci = (PciAddress(int(pci_info.pciDomain), int(pci_info.pciBus), int(pci_info.pciDevice),
                      int(pci_info.pciFunction)) if pci_info is not None else None)
    return uuid, pci


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class Device:
    """A Vulkan logical device with one compute queue.

    `selector`: index or name substring of the physical device (default: env VKTRAIN_DEVICE, else the
    best by type). `validation`: enable the Khronos validation layer (default: env VKTRAIN_VALIDATION).
    `memory_block_bytes`: the size of the shared device-memory blocks buffers are placed in.
    `nv_cooperative_matrix2`: also enable VK_NV_cooperative_matrix2's features where the device has them
    (`nv_cooperative_matrix2` then names them; no product kernel needs them yet). Use as a context manager or call `close()`.
    """

    def __init__(self, selector: str | int | None = None, *, validation: bool | None = None,
                 app_name: str = "vktrain", memory_block_bytes: int = DEFAULT_BLOCK_BYTES,
                 nv_cooperative_matrix2: bool = False):
        self.vk = vk = load_vulkan()
        self._closed = False
        self._children: dict[int, Any] = {}
        self._instance = None
        self._device = None
        self._messenger = None
        self._destroy_messenger = None
        self._command_pool = None
        self._pipelines = None
        self._collector = _ValidationCollector()
        self._collector_handle = vk.ffi.new_handle(self._collector)
        self.memory = DeviceMemory(self, memory_block_bytes)
        self._want_nv_coopmat2 = nv_cooperative_matrix2  # enable VK_NV_cooperative_matrix2 where present (probes)
        if validation is None:
            validation = _env_flag(VALIDATION_ENV)
        if selector is None:
            selector = os.environ.get(DEVICE_ENV)
        try:
            self._create_instance(app_name, validation)
            self._choose_physical_device(selector)
            self._create_device()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------------- creation
    def _create_instance(self, app_name: str, validation: bool) -> None:
        vk = self.vk
        try:
            loader_version = vk_call("vkEnumerateInstanceVersion", vk.vkEnumerateInstanceVersion)
        except (VulkanError, AttributeError):
            loader_version = vk.VK_MAKE_VERSION(1, 0, 0)
        if loader_version < vk.VK_MAKE_VERSION(1, 1, 0):
            raise VulkanUnavailableError(
                f"the Vulkan loader supports only API {self.version_string(loader_version)}; vktrain needs "
                f"Vulkan 1.1 or newer; {INSTALL_HINT}")
        self.instance_api_version = min(loader_version, vk.VK_MAKE_VERSION(1, 3, 0))

        available_layers = {p.layerName for p in vk_call(
            "vkEnumerateInstanceLayerProperties", vk.vkEnumerateInstanceLayerProperties)}
        available_extensions = {p.extensionName for p in vk_call(
            "vkEnumerateInstanceExtensionProperties", vk.vkEnumerateInstanceExtensionProperties, None)}
        layers: list[str] = []
        extensions: list[str] = []
        flags = 0
        if validation:
            if VALIDATION_LAYER not in available_layers:
                raise ValidationLayerMissingError(
                    f"validation was requested ({VALIDATION_ENV}=1 or validation=True) but {VALIDATION_LAYER} "
                    f"is not installed (Debian/Ubuntu: `apt-get install vulkan-validationlayers`)")
            if "VK_EXT_debug_utils" not in available_extensions:
                raise ValidationLayerMissingError("validation needs the VK_EXT_debug_utils instance extension")
            layers.append(VALIDATION_LAYER)
            extensions.append("VK_EXT_debug_utils")
        if "VK_KHR_portability_enumeration" in available_extensions:
            # MoltenVK and other portability drivers are only listed when asked for.
            extensions.append("VK_KHR_portability_enumeration")
            flags |= vk.VK_INSTANCE_CREATE_ENUMERATE_PORTABILITY_BIT_KHR
        self.validation_enabled = bool(validation)

        app_info = vk.VkApplicationInfo(
            sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName=app_name,
            applicationVersion=vk.VK_MAKE_VERSION(0, 1, 0), pEngineName="vktrain",
            engineVersion=vk.VK_MAKE_VERSION(0, 1, 0), apiVersion=self.instance_api_version)
        create_info = vk.VkInstanceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, flags=flags, pApplicationInfo=app_info,
            enabledLayerCount=len(layers), ppEnabledLayerNames=layers or None,
            enabledExtensionCount=len(extensions), ppEnabledExtensionNames=extensions or None)
        try:
            self._instance = vk_call("vkCreateInstance", vk.vkCreateInstance, create_info, None)
        except VulkanError as exc:
            raise VulkanUnavailableError(f"cannot create a Vulkan instance ({exc}); {INSTALL_HINT}") from exc

        if validation:
            severities = (vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
                          | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT)
            types = (vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
                     | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT
                     | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_PERFORMANCE_BIT_EXT)
            messenger_info = vk.VkDebugUtilsMessengerCreateInfoEXT(
                sType=vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
                messageSeverity=severities, messageType=types, pfnUserCallback=_debug_callback,
                pUserData=self._collector_handle)
            create_messenger = vk.vkGetInstanceProcAddr(self._instance, "vkCreateDebugUtilsMessengerEXT")
            self._destroy_messenger = vk.vkGetInstanceProcAddr(self._instance, "vkDestroyDebugUtilsMessengerEXT")
            self._messenger = vk_call("vkCreateDebugUtilsMessengerEXT", create_messenger,
                                      self._instance, messenger_info, None)

    def _choose_physical_device(self, selector: str | int | None) -> None:
        vk = self.vk
        try:
            handles = vk_call("vkEnumeratePhysicalDevices", vk.vkEnumeratePhysicalDevices, self._instance)
        except VulkanError as exc:
            raise VulkanUnavailableError(f"cannot list Vulkan devices ({exc}); {INSTALL_HINT}") from exc
        infos = []
        for index, handle in enumerate(handles):
            props = vk.vkGetPhysicalDeviceProperties(handle)
            uuid, pci = _query_identity(vk, handle) if props.apiVersion >= vk.VK_MAKE_VERSION(1, 1, 0) else (None, None)
            infos.append(PhysicalDeviceInfo(index, props.deviceName, props.deviceType, props.apiVersion, uuid, pci))
        self.available_devices: tuple[PhysicalDeviceInfo, ...] = tuple(infos)
        chosen = select_physical_device(infos, selector)
        self.physical_device = handles[chosen]
        self.info = infos[chosen]
        if self.info.api_version < vk.VK_MAKE_VERSION(1, 1, 0):
            raise VulkanUnavailableError(
                f"{self.info.describe()} supports only Vulkan {self.version_string(self.info.api_version)}; "
                f"vktrain needs 1.1 or newer")
        self.api_version = min(self.info.api_version, self.instance_api_version)

        # Every struct of the chain stays in a local until the call returns (cffi frees early).
        maintenance3 = vk.VkPhysicalDeviceMaintenance3Properties(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES)
        subgroup = vk.VkPhysicalDeviceSubgroupProperties(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES, pNext=maintenance3)
        properties2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                                     pNext=subgroup)
        vk.vkGetPhysicalDeviceProperties2(self.physical_device, properties2)
        lim = properties2.properties.limits
        self.limits = DeviceLimits(
            max_storage_buffer_range=int(lim.maxStorageBufferRange),
            min_storage_buffer_offset_alignment=int(lim.minStorageBufferOffsetAlignment),
            max_compute_work_group_count=tuple(int(v) for v in lim.maxComputeWorkGroupCount),
            max_compute_work_group_size=tuple(int(v) for v in lim.maxComputeWorkGroupSize),
            max_compute_work_group_invocations=int(lim.maxComputeWorkGroupInvocations),
            max_compute_shared_memory_size=int(lim.maxComputeSharedMemorySize),
            max_push_constants_size=int(lim.maxPushConstantsSize),
            max_bound_descriptor_sets=int(lim.maxBoundDescriptorSets),
            max_per_stage_descriptor_storage_buffers=int(lim.maxPerStageDescriptorStorageBuffers),
            max_memory_allocation_count=int(lim.maxMemoryAllocationCount),
            max_memory_allocation_size=int(maintenance3.maxMemoryAllocationSize),
            buffer_image_granularity=int(lim.bufferImageGranularity),
            non_coherent_atom_size=int(lim.nonCoherentAtomSize),
            timestamp_period_ns=float(lim.timestampPeriod),
        )
        self.memory_properties = vk.vkGetPhysicalDeviceMemoryProperties(self.physical_device)
        # Kernels may size reductions by these: the subgroup width, and the VkSubgroupFeatureFlags
        # usable in compute shaders (0 when the compute stage has no subgroup operations).
        self.subgroup_size = int(subgroup.subgroupSize)
        compute_ok = subgroup.supportedStages & vk.VK_SHADER_STAGE_COMPUTE_BIT
        self.subgroup_operations = int(subgroup.supportedOperations) if compute_ok else 0

        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical_device)
        compute = [(i, f) for i, f in enumerate(families) if f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise VulkanUnavailableError(f"{self.info.describe()} has no queue family with compute support")
        # Prefer families that can time work, then dedicated compute families (no graphics).
        index, family = max(compute, key=lambda item: (
            item[1].timestampValidBits > 0, not item[1].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT, -item[0]))
        self.queue_family_index = index
        self.timestamp_valid_bits = int(family.timestampValidBits)

    def _feature_chain(self) -> tuple[Any, Any | None, Any | None]:
        """Zeroed (VkPhysicalDeviceFeatures2, Vulkan11Features, Vulkan12Features) chained together.

        The 1.1/1.2 feature structs exist only from Vulkan 1.2 on; a 1.1 device gets the core struct only.
        """
        vk = self.vk
        if self.api_version < vk.VK_MAKE_VERSION(1, 2, 0):
            return vk.VkPhysicalDeviceFeatures2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2), None, None
        features12 = vk.VkPhysicalDeviceVulkan12Features(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES)
        features11 = vk.VkPhysicalDeviceVulkan11Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, pNext=features12)
        features2 = vk.VkPhysicalDeviceFeatures2(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=features11)
        return features2, features11, features12

    def _create_device(self) -> None:
        vk = self.vk
        # Every struct of both chains stays in a local until vkCreateDevice returns (cffi frees early).
        supported2, supported11, supported12 = self._feature_chain()
        vk.vkGetPhysicalDeviceFeatures2(self.physical_device, supported2)
        want2, want11, want12 = self._feature_chain()  # enable only optional features the device has
        enabled: set[str] = set()
        groups = [(supported2.features, want2.features, _OPTIONAL_FEATURES_10),
                  (supported11, want11, _OPTIONAL_FEATURES_11), (supported12, want12, _OPTIONAL_FEATURES_12)]
        if self.validation_enabled:
            groups.append((supported2.features, want2.features, _VALIDATION_FEATURES_10))
        for supported, wanted, names in groups:
            if supported is None:
                continue
            for name in names:
                if getattr(supported, name):
                    setattr(wanted, name, 1)
                    enabled.add(name)
        self.features = frozenset(enabled)
        # VK_KHR_cooperative_matrix where present (its shaders also need fp16 and the Vulkan memory
        # model); the supported shapes stay in cooperative_matrix_properties (empty: none).
        coopmat = query_cooperative_matrix(vk, self._instance, self.physical_device, self.api_version,
                                           nv_coopmat2=self._want_nv_coopmat2)
        if coopmat is not None and {"shaderFloat16", "vulkanMemoryModel"} <= enabled:
            want12.pNext = vk.ffi.addressof(coopmat.feature_struct)
        else:
            coopmat = None
        extensions = coopmat.extensions if coopmat is not None else []
        self.cooperative_matrix_properties = coopmat.properties if coopmat is not None else ()
        self.nv_cooperative_matrix2 = coopmat.nv_coopmat2 if coopmat is not None else frozenset()

        priorities = [1.0]
        queue_info = vk.VkDeviceQueueCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO, queueFamilyIndex=self.queue_family_index,
            queueCount=1, pQueuePriorities=priorities)
        queue_infos = [queue_info]
        device_info = vk.VkDeviceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=want2, queueCreateInfoCount=1,
            pQueueCreateInfos=queue_infos, enabledExtensionCount=len(extensions),
            ppEnabledExtensionNames=extensions or None, pEnabledFeatures=None)
        self._device = vk_call("vkCreateDevice", vk.vkCreateDevice, self.physical_device, device_info, None)
        self.queue = vk.vkGetDeviceQueue(self._device, self.queue_family_index, 0)

        pool_info = vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=self.queue_family_index)
        self._command_pool = vk_call("vkCreateCommandPool", vk.vkCreateCommandPool, self._device, pool_info, None)

    # ------------------------------------------------------------------------------ properties
    @property
    def handle(self):
        """The VkDevice."""
        self._check_open()
        return self._device

    @property
    def command_pool(self):
        self._check_open()
        return self._command_pool

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def device_type(self) -> str:
        return self.info.type_name

    @property
    def timestamps_supported(self) -> bool:
        return self.timestamp_valid_bits > 0 and self.limits.timestamp_period_ns > 0

    @property
    def unified_memory(self) -> bool:
        """True when the largest device-local heap is host-visible through a coherent memory type, so
        buffers can be written and read directly instead of through staging copies (lavapipe,
        integrated GPUs, discrete GPUs with resizable BAR)."""
        vk = self.vk
        mp = self.memory_properties
        heaps = [(i, mp.memoryHeaps[i].size) for i in range(mp.memoryHeapCount)
                 if mp.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT]
        if not heaps:
            return False
        largest_heap = max(heaps, key=lambda item: item[1])[0]
        wanted = (vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                  | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT)
        return any(mp.memoryTypes[i].heapIndex == largest_heap
                   and mp.memoryTypes[i].propertyFlags & wanted == wanted
                   for i in range(mp.memoryTypeCount))

    @property
    def allocation_count(self) -> int:
        """Live VkDeviceMemory allocations (memory blocks, not buffers)."""
        return self.memory.allocation_count

    def memory_stats(self) -> MemoryStats:
        """Allocations, bytes reserved from the driver and bytes in use by live buffers."""
        return self.memory.stats()

    def memory_budget(self) -> MemoryBudget:
        """The heaps, and what storage Buffers (on this device's default access path) may use."""
        vk = self.vk
        mp = self.memory_properties
        heaps = tuple(MemoryHeap(i, int(mp.memoryHeaps[i].size),
                                 bool(mp.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
                      for i in range(mp.memoryHeapCount))
        type_index = find_memory_type(memory_type_flags(self), ~0, *buffer_memory_flags(vk, not self.unified_memory))
        if type_index is None:
            raise VulkanUnavailableError(f"{self.info.describe()} has no memory type usable for storage buffers")
        heap = heaps[mp.memoryTypes[type_index].heapIndex]
        return MemoryBudget(heaps=heaps, buffer_heap_index=heap.index, buffer_heap_bytes=heap.size,
                            max_buffer_bytes=min(heap.size, self.limits.max_memory_allocation_size))

    @property
    def validation_messages(self) -> list[ValidationMessage]:
        """Validation warnings/errors collected so far (empty when validation is off)."""
        return self._collector.messages

    def take_validation_messages(self) -> list[ValidationMessage]:
        """Return the collected validation messages and forget them."""
        taken = list(self._collector.messages)
        self._collector.messages.clear()
        return taken

    @property
    def pipelines(self):
        """The device's PipelineCache (shared by every Program on this device)."""
        self._check_open()
        if self._pipelines is None:
            from vktrain.runtime.vk.pipelines import PipelineCache
            self._pipelines = PipelineCache(self)
        return self._pipelines

    @staticmethod
    def version_string(version: int) -> str:
        return f"{version >> 22}.{(version >> 12) & 0x3FF}.{version & 0xFFF}"

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"Vulkan {self.version_string(self.api_version)}"
        return f"Device({self.info.describe() if hasattr(self, 'info') else '?'}, {state})"

    # ------------------------------------------------------------------------------ execution
    def one_shot(self, record: Callable[[Any], None], *, timeout_s: float = 600.0) -> None:
        """Record commands with `record(command_buffer)`, submit them, wait for completion."""
        from vktrain.runtime.vk.commands import submit_once
        submit_once(self, record, timeout_s=timeout_s)

    def wait_idle(self) -> None:
        self._check_open()
        vk_call("vkDeviceWaitIdle", self.vk.vkDeviceWaitIdle, self._device)

    # ------------------------------------------------------------------------------ lifetime
    def _register(self, child: Any) -> None:
        self._check_open()
        self._children[id(child)] = child

    def _unregister(self, child: Any) -> None:
        self._children.pop(id(child), None)

    def _check_open(self) -> None:
        if self._closed:
            raise VulkanUnavailableError("this Device is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy every live child object, then the device, messenger and instance. Idempotent."""
        if self._closed:
            return
        vk = self.vk
        try:
            if self._device is not None:
                try:
                    vk_call("vkDeviceWaitIdle", vk.vkDeviceWaitIdle, self._device)
                finally:
                    for child in list(self._children.values()):
                        child.destroy()
                    self.memory.destroy()
                    if self._pipelines is not None:
                        self._pipelines.destroy()
                        self._pipelines = None
                    if self._command_pool is not None:
                        vk.vkDestroyCommandPool(self._device, self._command_pool, None)
                    vk.vkDestroyDevice(self._device, None)
        finally:
            self._closed = True
            self._device = None
            self._command_pool = None
            if self._messenger is not None:
                self._destroy_messenger(self._instance, self._messenger, None)
                self._messenger = None
            if self._instance is not None:
                vk.vkDestroyInstance(self._instance, None)
                self._instance = None

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
