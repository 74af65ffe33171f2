#include "vk_device.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "resident.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr const char* kValidationLayer = "VK_LAYER_KHRONOS_validation";

// VK_KHR_cooperative_matrix (vulkan_core.h from header 1.3.255 on; older headers, Debian 12's among them, lack
// it): the structs and entry point device creation uses, laid out as the spec defines them.
constexpr const char* kCoopmatExtension = "VK_KHR_cooperative_matrix";
constexpr VkStructureType kCoopmatFeaturesType = VkStructureType(1000506000);
constexpr VkStructureType kCoopmatPropertiesType = VkStructureType(1000506001);
struct CoopmatFeaturesKHR {
  VkStructureType sType;
  void* pNext;
  VkBool32 cooperativeMatrix, cooperativeMatrixRobustBufferAccess;
};
struct CoopmatPropertiesKHR {
  VkStructureType sType;
  void* pNext;
  uint32_t MSize, NSize, KSize;
  int32_t AType, BType, CType, ResultType;  // VkComponentTypeKHR
  VkBool32 saturatingAccumulation;
  int32_t scope;  // VkScopeKHR
};
using CoopmatPropertiesFn = VkResult(VKAPI_PTR*)(VkPhysicalDevice, uint32_t*, CoopmatPropertiesKHR*);

bool has_device_extension(VkPhysicalDevice physical, const char* name) {
  uint32_t count = 0;
  vkEnumerateDeviceExtensionProperties(physical, nullptr, &count, nullptr);
  std::vector<VkExtensionProperties> found(count);
  if (count) vkEnumerateDeviceExtensionProperties(physical, nullptr, &count, found.data());
  return std::any_of(found.begin(), found.end(), [&](const VkExtensionProperties& e) { return std::strcmp(e.extensionName, name) == 0; });
}
// device.py _TYPE_RANK: discrete > integrated > virtual > cpu > other.
int type_rank(VkPhysicalDeviceType t) {
  switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return 4;
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return 3;
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return 2;
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return 1;
    default: return 0;
  }
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return false;
  std::string s(v);
  return !(s.empty() || s == "0" || s == "false" || s == "no" || s == "off");
}

VKAPI_ATTR VkBool32 VKAPI_CALL on_message(VkDebugUtilsMessageSeverityFlagBitsEXT severity,
                                          VkDebugUtilsMessageTypeFlagsEXT, const VkDebugUtilsMessengerCallbackDataEXT* data,
                                          void* user) {
  // Warnings fail the run too, as the Python runtime's test fixtures fail on them.
  if (severity & (VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT))
    static_cast<Device*>(user)->validation_errors.push_back(data && data->pMessage ? data->pMessage : "(no message)");
  return VK_FALSE;
}

}  // namespace

void vk_check(VkResult result, const char* call, const std::string& detail) {
  if (result == VK_SUCCESS) return;
  refuse(ErrorCode::kDevice, std::string(call) + " failed with VkResult " + std::to_string(int(result)) +
                                 (result == VK_ERROR_OUT_OF_DEVICE_MEMORY ? " (out of device memory)"
                                  : result == VK_ERROR_OUT_OF_HOST_MEMORY ? " (out of host memory)"
                                  : result == VK_ERROR_DEVICE_LOST ? " (device lost)"
                                  : result == VK_TIMEOUT ? " (timed out)" : "") +
                                 (detail.empty() ? "" : ": " + detail));
}

Device::Device(const std::string& selector) {
  try {
    create_instance(env_flag("VKTRAIN_VALIDATION"));
    const char* env = std::getenv("VKTRAIN_DEVICE");
    choose(selector.empty() && env ? std::string(env) : selector);
    create_device();
  } catch (...) {
    release();
    throw;
  }
}

Device::~Device() { release(); }

void Device::release() {
  if (device_) {
    vkDeviceWaitIdle(device_);
    if (pool_) vkDestroyCommandPool(device_, pool_, nullptr);
    vkDestroyDevice(device_, nullptr);
  }
  if (messenger_) {
    auto destroy = reinterpret_cast<PFN_vkDestroyDebugUtilsMessengerEXT>(
        vkGetInstanceProcAddr(instance_, "vkDestroyDebugUtilsMessengerEXT"));
    if (destroy) destroy(instance_, messenger_, nullptr);
  }
  if (instance_) vkDestroyInstance(instance_, nullptr);
  device_ = VK_NULL_HANDLE;
  pool_ = VK_NULL_HANDLE;
  messenger_ = VK_NULL_HANDLE;
  instance_ = VK_NULL_HANDLE;
}

void Device::create_instance(bool validation) {
  uint32_t loader = VK_API_VERSION_1_0;
  vkEnumerateInstanceVersion(&loader);
  if (loader < VK_API_VERSION_1_1)
    refuse(ErrorCode::kDevice, "the Vulkan loader supports only API 1.0; vktrain needs Vulkan 1.1 or newer");
  api_version_ = std::min<uint32_t>(loader, VK_API_VERSION_1_3);
  std::vector<const char*> layers, extensions;
  if (validation) {
    uint32_t count = 0;
    vkEnumerateInstanceLayerProperties(&count, nullptr);
    std::vector<VkLayerProperties> found(count);
    vkEnumerateInstanceLayerProperties(&count, found.data());
    bool have = std::any_of(found.begin(), found.end(), [](const VkLayerProperties& p) {
      return std::strcmp(p.layerName, kValidationLayer) == 0;
    });
    if (!have)
      refuse(ErrorCode::kDevice, std::string("VKTRAIN_VALIDATION is set but the ") + kValidationLayer +
                                     " layer is not installed (Debian: vulkan-validationlayers)");
    layers.push_back(kValidationLayer);
    extensions.push_back(VK_EXT_DEBUG_UTILS_EXTENSION_NAME);
  }
  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "vktrain-native";
  app.apiVersion = api_version_;
  VkInstanceCreateInfo info{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  info.pApplicationInfo = &app;
  info.enabledLayerCount = uint32_t(layers.size());
  info.ppEnabledLayerNames = layers.data();
  info.enabledExtensionCount = uint32_t(extensions.size());
  info.ppEnabledExtensionNames = extensions.data();
  vk_check(vkCreateInstance(&info, nullptr, &instance_), "vkCreateInstance",
           "is a Vulkan driver installed (Debian: mesa-vulkan-drivers for lavapipe)?");
  if (validation) {
    VkDebugUtilsMessengerCreateInfoEXT m{VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT};
    m.messageSeverity = VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT;
    m.messageType = VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT | VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT;
    m.pfnUserCallback = on_message;
    m.pUserData = this;
    auto create = reinterpret_cast<PFN_vkCreateDebugUtilsMessengerEXT>(
        vkGetInstanceProcAddr(instance_, "vkCreateDebugUtilsMessengerEXT"));
    if (!create) refuse(ErrorCode::kDevice, "the validation layer has no vkCreateDebugUtilsMessengerEXT");
    vk_check(create(instance_, &m, nullptr, &messenger_), "vkCreateDebugUtilsMessengerEXT");
  }
}

void Device::choose(const std::string& selector) {
  uint32_t count = 0;
  vk_check(vkEnumeratePhysicalDevices(instance_, &count, nullptr), "vkEnumeratePhysicalDevices");
  std::vector<VkPhysicalDevice> devices(count);
  if (count) vk_check(vkEnumeratePhysicalDevices(instance_, &count, devices.data()), "vkEnumeratePhysicalDevices");
  if (devices.empty())
    refuse(ErrorCode::kDevice, "no Vulkan device found (install a driver; lavapipe: Debian mesa-vulkan-drivers)");
  std::vector<VkPhysicalDeviceProperties> props(count);
  std::string names;
  for (uint32_t i = 0; i < count; ++i) {
    vkGetPhysicalDeviceProperties(devices[i], &props[i]);
    names += (i ? ", " : "") + num(i) + ": " + props[i].deviceName;
  }
  int chosen = -1;
  if (!selector.empty()) {
    bool digits = std::all_of(selector.begin(), selector.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (digits) {
      unsigned long index = std::strtoul(selector.c_str(), nullptr, 10);
      if (selector.size() > 9 || index >= count)
        refuse(ErrorCode::kDevice, "device index " + selector + " is out of range (devices: " + names + ")");
      chosen = int(index);
    } else {
      for (uint32_t i = 0; i < count && chosen < 0; ++i)
        if (std::string(props[i].deviceName).find(selector) != std::string::npos) chosen = int(i);
      if (chosen < 0) refuse(ErrorCode::kDevice, "no Vulkan device named like '" + selector + "' (devices: " + names + ")");
    }
  } else {
    for (uint32_t i = 0; i < count; ++i)
      if (chosen < 0 || type_rank(props[i].deviceType) > type_rank(props[chosen].deviceType)) chosen = int(i);
  }
  physical_ = devices[chosen];
  properties_ = props[chosen];
  name_ = properties_.deviceName;
  api_version_ = std::min(api_version_, properties_.apiVersion);
  if (api_version_ < VK_API_VERSION_1_1) refuse(ErrorCode::kDevice, name_ + " supports only Vulkan 1.0; vktrain needs 1.1");
  VkPhysicalDeviceSubgroupProperties subgroup{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
  VkPhysicalDeviceMaintenance3Properties maintenance3{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
  subgroup.pNext = &maintenance3;
  VkPhysicalDeviceProperties2 p2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
  p2.pNext = &subgroup;
  vkGetPhysicalDeviceProperties2(physical_, &p2);
  max_allocation_bytes_ = maintenance3.maxMemoryAllocationSize;
  subgroup_size_ = subgroup.subgroupSize;
  subgroup_operations_ = (subgroup.supportedStages & VK_SHADER_STAGE_COMPUTE_BIT) ? subgroup.supportedOperations : 0;
  vkGetPhysicalDeviceMemoryProperties(physical_, &memory_);
  // device.py unified_memory: the largest device-local heap is host-visible through a coherent type (lavapipe,
  // integrated GPUs, resizable BAR), not merely some small BAR window of a discrete GPU's.
  uint32_t largest = UINT32_MAX;
  for (uint32_t h = 0; h < memory_.memoryHeapCount; ++h)
    if ((memory_.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) &&
        (largest == UINT32_MAX || memory_.memoryHeaps[h].size > memory_.memoryHeaps[largest].size))
      largest = h;
  for (uint32_t i = 0; i < memory_.memoryTypeCount; ++i) {
    VkMemoryPropertyFlags f = memory_.memoryTypes[i].propertyFlags;
    const VkMemoryPropertyFlags all = VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT |
                                      VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    if ((f & all) == all && memory_.memoryTypes[i].heapIndex == largest) unified_ = true;
  }
  uint32_t families = 0;
  vkGetPhysicalDeviceQueueFamilyProperties(physical_, &families, nullptr);
  std::vector<VkQueueFamilyProperties> fam(families);
  vkGetPhysicalDeviceQueueFamilyProperties(physical_, &families, fam.data());
  int family = -1;
  for (uint32_t i = 0; i < families && family < 0; ++i)
    if (fam[i].queueFlags & VK_QUEUE_COMPUTE_BIT) family = int(i);
  if (family < 0) refuse(ErrorCode::kDevice, name_ + " has no compute queue");
  queue_family_ = uint32_t(family);
  timestamp_bits_ = properties_.limits.timestampPeriod > 0 ? fam[family].timestampValidBits : 0;
}

std::string Device::device_type() const {
  switch (properties_.deviceType) {
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return "cpu";
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return "discrete";
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return "integrated";
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return "virtual";
    default: return "other";
  }
}

void Device::create_device() {
  // device.py _OPTIONAL_FEATURES_*: enabled wherever the device has them (robustBufferAccess with validation).
  VkPhysicalDeviceVulkan12Features have12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan11Features have11{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES};
  VkPhysicalDeviceFeatures2 have2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  bool v12 = api_version_ >= VK_API_VERSION_1_2;
  if (v12) {
    have11.pNext = &have12;
    have2.pNext = &have11;
  }
  vkGetPhysicalDeviceFeatures2(physical_, &have2);
  VkPhysicalDeviceVulkan12Features want12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan11Features want11{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES};
  VkPhysicalDeviceFeatures2 want2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  if (v12) {
    want11.pNext = &want12;
    want2.pNext = &want11;
  }
#define VKT_OPTIONAL(have, want, field)   \
  if (have.field) {                       \
    want.field = VK_TRUE;                 \
    features_.insert(#field);             \
  }
  VKT_OPTIONAL(have2.features, want2.features, shaderInt64)
  VKT_OPTIONAL(have2.features, want2.features, shaderInt16)
  VKT_OPTIONAL(have2.features, want2.features, shaderFloat64)
  if (messenger_) { VKT_OPTIONAL(have2.features, want2.features, robustBufferAccess) }
  if (v12) {
    VKT_OPTIONAL(have11, want11, storageBuffer16BitAccess)
    VKT_OPTIONAL(have11, want11, uniformAndStorageBuffer16BitAccess)
    VKT_OPTIONAL(have12, want12, storageBuffer8BitAccess)
    VKT_OPTIONAL(have12, want12, uniformAndStorageBuffer8BitAccess)
    VKT_OPTIONAL(have12, want12, shaderFloat16)
    VKT_OPTIONAL(have12, want12, shaderInt8)
    VKT_OPTIONAL(have12, want12, bufferDeviceAddress)
    VKT_OPTIONAL(have12, want12, scalarBlockLayout)
    VKT_OPTIONAL(have12, want12, vulkanMemoryModel)
    VKT_OPTIONAL(have12, want12, vulkanMemoryModelDeviceScope)
  }
#undef VKT_OPTIONAL
  // coopmat.py query_cooperative_matrix: VK_KHR_cooperative_matrix where the device lists it, its feature is on and
  // the features its shaders also need (float16 arithmetic, the Vulkan memory model) are enabled.
  std::vector<const char*> extensions;
  CoopmatFeaturesKHR coopmat{kCoopmatFeaturesType, nullptr, VK_FALSE, VK_FALSE};
  if (v12 && has_feature("shaderFloat16") && has_feature("vulkanMemoryModel") &&
      has_device_extension(physical_, kCoopmatExtension)) {
    CoopmatFeaturesKHR have{kCoopmatFeaturesType, nullptr, VK_FALSE, VK_FALSE};
    VkPhysicalDeviceFeatures2 query{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
    query.pNext = &have;
    vkGetPhysicalDeviceFeatures2(physical_, &query);
    auto list = reinterpret_cast<CoopmatPropertiesFn>(
        vkGetInstanceProcAddr(instance_, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"));
    if (have.cooperativeMatrix && list) {
      uint32_t count = 0;
      vk_check(list(physical_, &count, nullptr), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR");
      std::vector<CoopmatPropertiesKHR> entries(count, CoopmatPropertiesKHR{kCoopmatPropertiesType, nullptr, 0, 0, 0, 0, 0, 0, 0, 0, 0});
      VkResult listed = count ? list(physical_, &count, entries.data()) : VK_SUCCESS;
      if (listed != VK_INCOMPLETE) vk_check(listed, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR");
      entries.resize(std::min<size_t>(count, entries.size()));
      for (const auto& e : entries)
        coopmat_.push_back({e.MSize, e.NSize, e.KSize, e.AType, e.BType, e.CType, e.ResultType, e.scope,
                            e.saturatingAccumulation != VK_FALSE});
      coopmat.cooperativeMatrix = VK_TRUE;
      want12.pNext = &coopmat;
      extensions.push_back(kCoopmatExtension);
      features_.insert("cooperativeMatrix");
    }
  }
  float priority = 1.0f;
  VkDeviceQueueCreateInfo queue{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  queue.queueFamilyIndex = queue_family_;
  queue.queueCount = 1;
  queue.pQueuePriorities = &priority;
  VkDeviceCreateInfo info{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  info.pNext = &want2;
  info.queueCreateInfoCount = 1;
  info.pQueueCreateInfos = &queue;
  info.enabledExtensionCount = uint32_t(extensions.size());
  info.ppEnabledExtensionNames = extensions.empty() ? nullptr : extensions.data();
  vk_check(vkCreateDevice(physical_, &info, nullptr, &device_), "vkCreateDevice", name_);
  vkGetDeviceQueue(device_, queue_family_, 0, &queue_);
  VkCommandPoolCreateInfo pool{VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO};
  pool.flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT;
  pool.queueFamilyIndex = queue_family_;
  vk_check(vkCreateCommandPool(device_, &pool, nullptr, &pool_), "vkCreateCommandPool");
}

uint32_t Device::memory_type(uint32_t type_bits, VkMemoryPropertyFlags required, VkMemoryPropertyFlags preferred,
                             const std::string& what) const {
  // Every required flag; then the preferred ones; then the larger heap (a discrete GPU's small BAR window of
  // device-local, host-visible memory loses to its main heap).
  int best = -1;
  auto rank = [&](uint32_t i) {
    return std::make_pair((memory_.memoryTypes[i].propertyFlags & preferred) == preferred,
                          memory_.memoryHeaps[memory_.memoryTypes[i].heapIndex].size);
  };
  for (uint32_t i = 0; i < memory_.memoryTypeCount; ++i) {
    if (!(type_bits & (1u << i))) continue;
    VkMemoryPropertyFlags f = memory_.memoryTypes[i].propertyFlags;
    if ((f & required) != required) continue;
    if (best < 0 || rank(i) > rank(uint32_t(best))) best = int(i);
  }
  if (best < 0)
    refuse(ErrorCode::kDevice, what + ": " + name_ + " has no memory type with property flags " + hex(required));
  return uint32_t(best);
}

uint64_t Device::largest_heap_bytes() const {
  uint64_t largest = 0;
  for (uint32_t h = 0; h < memory_.memoryHeapCount; ++h)
    if (memory_.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) largest = std::max<uint64_t>(largest, memory_.memoryHeaps[h].size);
  return largest;
}

void Device::check_validation(const std::string& when) {
  if (validation_errors.empty()) return;
  std::string first = validation_errors.front();
  size_t count = validation_errors.size();
  validation_errors.clear();
  refuse(ErrorCode::kDevice, "the Vulkan validation layer reported " + num(count) + " error(s) or warning(s) " + when + "; the first: " + first);
}

void Device::submit_and_wait(VkCommandBuffer cb, VkFence fence, uint64_t timeout_ns) {
  vk_check(vkResetFences(device_, 1, &fence), "vkResetFences");
  VkSubmitInfo submit{VK_STRUCTURE_TYPE_SUBMIT_INFO};
  submit.commandBufferCount = 1;
  submit.pCommandBuffers = &cb;
  vk_check(vkQueueSubmit(queue_, 1, &submit, fence), "vkQueueSubmit");
  vk_check(vkWaitForFences(device_, 1, &fence, VK_TRUE, timeout_ns), "vkWaitForFences", "waiting for the GPU");
}

// ------------------------------------------------------------------------------------------ buffers
Buffer::Buffer(Device& device, uint64_t size, const std::string& name, Kind kind)
    : device_(device), name_(name), size_((size + 3) / 4 * 4) {
  if (size == 0) refuse(ErrorCode::kVerification, "buffer '" + name + "' has 0 bytes");
  VkBufferCreateInfo info{VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO};
  info.size = size_;
  info.usage = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT;
  info.sharingMode = VK_SHARING_MODE_EXCLUSIVE;
  VkDevice d = device.handle();
  vk_check(vkCreateBuffer(d, &info, nullptr, &buffer_), "vkCreateBuffer", "buffer '" + name + "' of " + num(size_) + " bytes");
  try {
    VkMemoryRequirements needs;
    vkGetBufferMemoryRequirements(d, buffer_, &needs);
    // memory.py buffer_memory_flags: host-visible (device-local preferred) on unified memory, else device-local.
    const VkMemoryPropertyFlags host = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    bool direct = kind == kStaging || !device.staging();
    uint32_t type = direct ? device.memory_type(needs.memoryTypeBits, host, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, "buffer '" + name + "'")
                           : device.memory_type(needs.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0, "buffer '" + name + "'");
    VkMemoryAllocateInfo alloc{VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO};
    alloc.allocationSize = needs.size;
    alloc.memoryTypeIndex = type;
    vk_check(vkAllocateMemory(d, &alloc, nullptr, &memory_), "vkAllocateMemory", "buffer '" + name + "' of " + num(size_) + " bytes");
    vk_check(vkBindBufferMemory(d, buffer_, memory_, 0), "vkBindBufferMemory");
    if (direct) {
      void* p = nullptr;
      vk_check(vkMapMemory(d, memory_, 0, VK_WHOLE_SIZE, 0, &p), "vkMapMemory", "buffer '" + name + "'");
      mapped_ = static_cast<uint8_t*>(p);
      note_device_mapping(mapped_, alloc.allocationSize);  // its resident pages are device memory, not the host's
      std::memset(mapped_, 0, size_);  // contents are defined from the start (the Python runtime's are whatever)
    } else {
      submit_once(device, [&](VkCommandBuffer cb) { vkCmdFillBuffer(cb, buffer_, 0, VK_WHOLE_SIZE, 0); });
    }
  } catch (...) {
    release();
    throw;
  }
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
  VkDevice d = device_.handle();
  if (mapped_) {
    forget_device_mapping(mapped_);
    vkUnmapMemory(d, memory_);
  }
  if (buffer_) vkDestroyBuffer(d, buffer_, nullptr);
  if (memory_) vkFreeMemory(d, memory_, nullptr);
  mapped_ = nullptr;
  buffer_ = VK_NULL_HANDLE;
  memory_ = VK_NULL_HANDLE;
}

void Buffer::check_range(uint64_t offset, uint64_t bytes, const char* what) const {
  if (offset > size_ || bytes > size_ - offset)
    refuse(ErrorCode::kInternal, std::string(what) + " of buffer '" + name_ + "': bytes [" + num(offset) + ", " +
                                     sum(offset, bytes) + ") outside its " + num(size_));
}

void Buffer::write(uint64_t offset, const void* data, uint64_t bytes) {
  check_range(offset, bytes, "write");
  if (!bytes) return;
  if (mapped_) std::memcpy(mapped_ + offset, data, bytes);
  else staged_copy(offset, bytes, const_cast<void*>(data), true);
}

void Buffer::read(uint64_t offset, void* out, uint64_t bytes) const {
  check_range(offset, bytes, "read");
  if (!bytes) return;
  if (mapped_) std::memcpy(out, mapped_ + offset, bytes);
  else staged_copy(offset, bytes, out, false);
}

void Buffer::staged_copy(uint64_t offset, uint64_t bytes, void* host, bool upload) const {
  // A host-visible buffer of the copy's size: a device-local buffer is reached through it.
  Buffer staging(device_, bytes, name_ + " (staging)", kStaging);
  if (upload) std::memcpy(staging.mapped_, host, bytes);
  submit_once(device_, [&](VkCommandBuffer cb) {
    VkBufferCopy region{upload ? 0 : offset, upload ? offset : 0, bytes};
    memory_barrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
                   VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT, VK_PIPELINE_STAGE_TRANSFER_BIT,
                   VK_ACCESS_TRANSFER_READ_BIT | VK_ACCESS_TRANSFER_WRITE_BIT);
    vkCmdCopyBuffer(cb, upload ? staging.buffer_ : buffer_, upload ? buffer_ : staging.buffer_, 1, &region);
    memory_barrier(cb, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_ACCESS_TRANSFER_WRITE_BIT,
                   VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | VK_PIPELINE_STAGE_HOST_BIT,
                   VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT | VK_ACCESS_HOST_READ_BIT);
  });
  if (!upload) std::memcpy(host, staging.mapped_, bytes);
}

// ------------------------------------------------------------------------------------------ commands
VkCommandBuffer allocate_command_buffer(Device& device) {
  VkCommandBufferAllocateInfo info{VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO};
  info.commandPool = device.command_pool();
  info.level = VK_COMMAND_BUFFER_LEVEL_PRIMARY;
  info.commandBufferCount = 1;
  VkCommandBuffer cb = VK_NULL_HANDLE;
  vk_check(vkAllocateCommandBuffers(device.handle(), &info, &cb), "vkAllocateCommandBuffers");
  return cb;
}

void begin_command_buffer(VkCommandBuffer cb) {
  VkCommandBufferBeginInfo begin{VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO};
  vk_check(vkBeginCommandBuffer(cb, &begin), "vkBeginCommandBuffer");
}

VkFence create_fence(Device& device) {
  VkFenceCreateInfo info{VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
  VkFence fence = VK_NULL_HANDLE;
  vk_check(vkCreateFence(device.handle(), &info, nullptr, &fence), "vkCreateFence");
  return fence;
}

void memory_barrier(VkCommandBuffer cb, VkPipelineStageFlags src_stage, VkAccessFlags src_access,
                    VkPipelineStageFlags dst_stage, VkAccessFlags dst_access) {
  VkMemoryBarrier barrier{VK_STRUCTURE_TYPE_MEMORY_BARRIER};
  barrier.srcAccessMask = src_access;
  barrier.dstAccessMask = dst_access;
  vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 1, &barrier, 0, nullptr, 0, nullptr);
}

// ------------------------------------------------------------------------------------------ pipelines
PipelineCache::~PipelineCache() {
  VkDevice d = device_.handle();
  for (auto& [key, p] : pipelines_) vkDestroyPipeline(d, p.handle, nullptr);
  for (auto& [key, l] : pipeline_layouts_) vkDestroyPipelineLayout(d, l, nullptr);
  for (auto& [key, l] : set_layouts_) vkDestroyDescriptorSetLayout(d, l, nullptr);
  for (auto& [key, m] : modules_) vkDestroyShaderModule(d, m, nullptr);
}

VkDescriptorSetLayout PipelineCache::set_layout(uint32_t bindings) {
  auto it = set_layouts_.find(bindings);
  if (it != set_layouts_.end()) return it->second;
  std::vector<VkDescriptorSetLayoutBinding> entries(bindings);
  for (uint32_t b = 0; b < bindings; ++b)
    entries[b] = {b, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT, nullptr};
  VkDescriptorSetLayoutCreateInfo info{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO};
  info.bindingCount = bindings;
  info.pBindings = entries.data();
  VkDescriptorSetLayout layout = VK_NULL_HANDLE;
  vk_check(vkCreateDescriptorSetLayout(device_.handle(), &info, nullptr, &layout), "vkCreateDescriptorSetLayout");
  return set_layouts_[bindings] = layout;
}

VkPipelineLayout PipelineCache::pipeline_layout(uint32_t bindings, uint32_t push_size) {
  auto key = std::make_pair(bindings, push_size);
  auto it = pipeline_layouts_.find(key);
  if (it != pipeline_layouts_.end()) return it->second;
  VkDescriptorSetLayout set = set_layout(bindings);
  VkPushConstantRange range{VK_SHADER_STAGE_COMPUTE_BIT, 0, push_size};
  VkPipelineLayoutCreateInfo info{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  info.setLayoutCount = 1;
  info.pSetLayouts = &set;
  info.pushConstantRangeCount = push_size ? 1 : 0;
  info.pPushConstantRanges = push_size ? &range : nullptr;
  VkPipelineLayout layout = VK_NULL_HANDLE;
  vk_check(vkCreatePipelineLayout(device_.handle(), &info, nullptr, &layout), "vkCreatePipelineLayout");
  return pipeline_layouts_[key] = layout;
}

const Pipeline& PipelineCache::get(const std::string& shader, const std::vector<uint32_t>& code,
                                   const ShaderInterface& interface,
                                   const std::vector<std::pair<uint32_t, uint32_t>>& specialization, uint32_t push_size) {
  auto key = std::make_tuple(shader, specialization, push_size);
  auto found = pipelines_.find(key);
  if (found != pipelines_.end()) return found->second;
  if (push_size > device_.limits().maxPushConstantsSize)
    refuse(ErrorCode::kUnsupported, "shader '" + shader + "': " + num(push_size) + " push-constant bytes exceed the device's "
           "maxPushConstantsSize of " + num(device_.limits().maxPushConstantsSize));
  VkShaderModule module;
  auto m = modules_.find(shader);
  if (m != modules_.end()) {
    module = m->second;
  } else {
    VkShaderModuleCreateInfo info{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
    info.codeSize = code.size() * 4;
    info.pCode = code.data();
    vk_check(vkCreateShaderModule(device_.handle(), &info, nullptr, &module), "vkCreateShaderModule", "shader '" + shader + "'");
    modules_[shader] = module;
  }
  uint32_t bindings = uint32_t(interface.bindings.size());
  Pipeline p;
  p.set_layout = set_layout(bindings);
  p.layout = pipeline_layout(bindings, push_size);
  std::vector<VkSpecializationMapEntry> entries;
  std::vector<uint32_t> data;
  for (size_t i = 0; i < specialization.size(); ++i) {
    entries.push_back({specialization[i].first, uint32_t(4 * i), 4});
    data.push_back(specialization[i].second);
  }
  VkSpecializationInfo spec{uint32_t(entries.size()), entries.data(), data.size() * 4, data.data()};
  VkComputePipelineCreateInfo info{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
  info.stage = {VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO};
  info.stage.stage = VK_SHADER_STAGE_COMPUTE_BIT;
  info.stage.module = module;
  info.stage.pName = "main";
  info.stage.pSpecializationInfo = entries.empty() ? nullptr : &spec;
  info.layout = p.layout;
  info.basePipelineIndex = -1;
  vk_check(vkCreateComputePipelines(device_.handle(), VK_NULL_HANDLE, 1, &info, nullptr, &p.handle),
           "vkCreateComputePipelines", "shader '" + shader + "'");
  return pipelines_[key] = p;
}

}  // namespace vktrain
