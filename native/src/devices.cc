#include "devices.h"

#include <vector>
#include <vulkan/vulkan.h>

#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

const char* device_type(VkPhysicalDeviceType t) {
  switch (t) {
    case VK_PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU: return "integrated GPU";
    case VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU: return "discrete GPU";
    case VK_PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU: return "virtual GPU";
    case VK_PHYSICAL_DEVICE_TYPE_CPU: return "CPU";
    default: return "other";
  }
}

std::string version(uint32_t v) {
  return num(VK_API_VERSION_MAJOR(v)) + "." + num(VK_API_VERSION_MINOR(v)) + "." + num(VK_API_VERSION_PATCH(v));
}

}  // namespace

std::string describe_vulkan_devices() {
  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.pApplicationName = "vktrain-native-inspect";
  app.apiVersion = VK_API_VERSION_1_1;
  VkInstanceCreateInfo info{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  info.pApplicationInfo = &app;
  VkInstance instance = VK_NULL_HANDLE;
  VkResult r = vkCreateInstance(&info, nullptr, &instance);
  if (r != VK_SUCCESS)
    refuse(ErrorCode::kUnsupported, "cannot create a Vulkan 1.1 instance (VkResult " + std::to_string(int(r)) +
           "): is a Vulkan driver installed (Debian: mesa-vulkan-drivers for lavapipe)?");
  uint32_t count = 0;
  vkEnumeratePhysicalDevices(instance, &count, nullptr);
  std::vector<VkPhysicalDevice> devices(count);
  if (count) vkEnumeratePhysicalDevices(instance, &count, devices.data());
  std::string out = num(count) + " Vulkan device(s)\n";
  for (uint32_t i = 0; i < count; ++i) {
    VkPhysicalDeviceSubgroupProperties subgroup{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES};
    VkPhysicalDeviceProperties2 props{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2};
    props.pNext = &subgroup;
    vkGetPhysicalDeviceProperties2(devices[i], &props);
    VkPhysicalDeviceMemoryProperties memory{};
    vkGetPhysicalDeviceMemoryProperties(devices[i], &memory);
    uint64_t largest = 0;
    for (uint32_t h = 0; h < memory.memoryHeapCount; ++h)
      if (memory.memoryHeaps[h].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT && memory.memoryHeaps[h].size > largest)
        largest = memory.memoryHeaps[h].size;
    const VkPhysicalDeviceProperties& p = props.properties;
    const VkPhysicalDeviceLimits& l = p.limits;
    out += "device " + num(i) + ": " + p.deviceName + " (" + device_type(p.deviceType) + "), Vulkan " + version(p.apiVersion) +
           ", vendor " + hex(p.vendorID) + " device " + hex(p.deviceID) + "\n";
    out += "  largest device-local heap: " + num(largest) + " bytes; subgroup size " + num(subgroup.subgroupSize) + "\n";
    out += "  maxStorageBufferRange " + num(l.maxStorageBufferRange) + ", minStorageBufferOffsetAlignment " +
           num(l.minStorageBufferOffsetAlignment) + ", maxComputeSharedMemorySize " + num(l.maxComputeSharedMemorySize) +
           ", maxComputeWorkGroupInvocations " + num(l.maxComputeWorkGroupInvocations) + ", maxPushConstantsSize " +
           num(l.maxPushConstantsSize) + "\n";
  }
  vkDestroyInstance(instance, nullptr);
  return out;
}

}  // namespace vktrain
