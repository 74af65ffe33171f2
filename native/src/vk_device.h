// The native Vulkan device layer (the C++ counterpart of vktrain/runtime/vk/device.py, memory.py,
// pipelines.py): an instance (with the Khronos validation layer under VKTRAIN_VALIDATION=1, every error it
// reports failing the run), the physical device chosen as device.py chooses it (VKTRAIN_DEVICE: index or name
// substring, else the best by type), one compute queue, the optional features the kernels may use, storage
// buffers in memory chosen by property flags, compute pipelines from SPIR-V with specialization constants,
// and a fence-waited submit. Every failed Vulkan call is a LoadError kDevice naming the call.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>
#include <vulkan/vulkan.h>

#include "spirv_reflect.h"

namespace vktrain {

void vk_check(VkResult result, const char* call, const std::string& detail = "");

// One entry of vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR: A (M x K) * B (K x N) + C -> result (M x N), the
// component types as VkComponentTypeKHR values, the scope as VkScopeKHR (coopmat.py CooperativeMatrixShape).
struct CoopmatProperty {
  uint32_t m = 0, n = 0, k = 0;
  int32_t a_type = 0, b_type = 0, c_type = 0, result_type = 0, scope = 0;
  bool saturating_accumulation = false;
};

class Device {
 public:
  // `selector`: a device index or a name substring; empty: $VKTRAIN_DEVICE, else the best by type.
  explicit Device(const std::string& selector = "");
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  VkDevice handle() const { return device_; }
  VkQueue queue() const { return queue_; }
  VkCommandPool command_pool() const { return pool_; }
  const VkPhysicalDeviceLimits& limits() const { return properties_.limits; }
  const std::string& name() const { return name_; }
  // VkPhysicalDeviceType as device_profile.py DEVICE_TYPES names it ("cpu", "discrete", ...).
  std::string device_type() const;
  uint64_t max_allocation_bytes() const { return max_allocation_bytes_; }  // maxMemoryAllocationSize
  uint32_t subgroup_size() const { return subgroup_size_; }
  uint32_t subgroup_operations() const { return subgroup_operations_; }  // VkSubgroupFeatureFlags in compute
  // The optional features enabled (device.py Device.features: "shaderFloat16", ...; "cooperativeMatrix" with
  // VK_KHR_cooperative_matrix enabled).
  bool has_feature(const std::string& name) const { return features_.count(name) > 0; }
  uint32_t api_version() const { return api_version_; }
  // VK_KHR_cooperative_matrix's shapes where it is enabled (device.py: wherever the device has it, shaderFloat16
  // and vulkanMemoryModel, which its shaders need too); empty elsewhere (lavapipe).
  const std::vector<CoopmatProperty>& cooperative_matrix() const { return coopmat_; }
  // Timestamps on the compute queue: valid bits (0: none) and nanoseconds per tick.
  uint32_t timestamp_valid_bits() const { return timestamp_bits_; }
  double timestamp_period_ns() const { return properties_.limits.timestampPeriod; }
  bool unified_memory() const { return unified_; }
  // Host access through staging copies even on unified memory (the discrete-GPU path, to test it anywhere).
  void force_staging(bool on) { force_staging_ = on; }
  bool staging() const { return force_staging_ || !unified_; }
  uint64_t largest_heap_bytes() const;  // the largest device-local heap
  bool validation() const { return messenger_ != VK_NULL_HANDLE; }

  // The memory type for `type_bits` with every `required` flag, one with `preferred` too where there is one.
  uint32_t memory_type(uint32_t type_bits, VkMemoryPropertyFlags required, VkMemoryPropertyFlags preferred,
                       const std::string& what) const;
  // Throws LoadError kDevice with the validation layer's errors and warnings since the last call (none: returns).
  void check_validation(const std::string& when);
  // Submits `cb` and waits for it on `fence` (reset first).
  void submit_and_wait(VkCommandBuffer cb, VkFence fence, uint64_t timeout_ns = 600ull * 1000000000ull);

  std::vector<std::string> validation_errors;  // appended by the messenger

 private:
  void release();
  void create_instance(bool validation);
  void choose(const std::string& selector);
  void create_device();

  VkInstance instance_ = VK_NULL_HANDLE;
  VkDebugUtilsMessengerEXT messenger_ = VK_NULL_HANDLE;
  VkPhysicalDevice physical_ = VK_NULL_HANDLE;
  VkDevice device_ = VK_NULL_HANDLE;
  VkQueue queue_ = VK_NULL_HANDLE;
  VkCommandPool pool_ = VK_NULL_HANDLE;
  uint64_t max_allocation_bytes_ = 0;
  uint32_t queue_family_ = 0, api_version_ = 0, subgroup_size_ = 0, subgroup_operations_ = 0, timestamp_bits_ = 0;
  std::vector<CoopmatProperty> coopmat_;
  VkPhysicalDeviceProperties properties_{};
  VkPhysicalDeviceMemoryProperties memory_{};
  std::set<std::string> features_;
  std::string name_;
  bool unified_ = false, force_staging_ = false;
};

// A storage buffer bound to its own memory: host-visible and mapped on unified memory (writes and reads go
// straight through), else device-local and reached through a host-visible staging buffer per access.
class Buffer {
 public:
  enum Kind { kStorage, kStaging };
  Buffer(Device& device, uint64_t size, const std::string& name, Kind kind = kStorage);  // size: whole 4-byte words
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  VkBuffer handle() const { return buffer_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  void write(uint64_t offset, const void* data, uint64_t bytes);
  void read(uint64_t offset, void* out, uint64_t bytes) const;

 private:
  void release();
  void check_range(uint64_t offset, uint64_t bytes, const char* what) const;
  void staged_copy(uint64_t offset, uint64_t bytes, void* host, bool upload) const;

  Device& device_;
  std::string name_;
  uint64_t size_;
  VkBuffer buffer_ = VK_NULL_HANDLE;
  VkDeviceMemory memory_ = VK_NULL_HANDLE;
  uint8_t* mapped_ = nullptr;
};

struct Pipeline {
  VkPipeline handle = VK_NULL_HANDLE;
  VkPipelineLayout layout = VK_NULL_HANDLE;
  VkDescriptorSetLayout set_layout = VK_NULL_HANDLE;
};

// Shader modules, layouts and pipelines of one device, shared where they agree (pipelines.py PipelineCache).
class PipelineCache {
 public:
  explicit PipelineCache(Device& device) : device_(device) {}
  ~PipelineCache();
  PipelineCache(const PipelineCache&) = delete;
  PipelineCache& operator=(const PipelineCache&) = delete;
  // The pipeline of `shader` (its SPIR-V `code`, reflected as `interface`) with `specialization` (id, 32-bit
  // word) and `push_size` push-constant bytes.
  const Pipeline& get(const std::string& shader, const std::vector<uint32_t>& code, const ShaderInterface& interface,
                      const std::vector<std::pair<uint32_t, uint32_t>>& specialization, uint32_t push_size);

 private:
  VkDescriptorSetLayout set_layout(uint32_t bindings);
  VkPipelineLayout pipeline_layout(uint32_t bindings, uint32_t push_size);

  Device& device_;
  std::map<std::string, VkShaderModule> modules_;
  std::map<uint32_t, VkDescriptorSetLayout> set_layouts_;
  std::map<std::pair<uint32_t, uint32_t>, VkPipelineLayout> pipeline_layouts_;
  std::map<std::tuple<std::string, std::vector<std::pair<uint32_t, uint32_t>>, uint32_t>, Pipeline> pipelines_;
};

// Records `record(cb)` into a one-off command buffer, submits it and waits (staging copies).
template <typename F> void submit_once(Device& device, F record);
VkCommandBuffer allocate_command_buffer(Device& device);
void begin_command_buffer(VkCommandBuffer cb);
VkFence create_fence(Device& device);
void memory_barrier(VkCommandBuffer cb, VkPipelineStageFlags src_stage, VkAccessFlags src_access,
                    VkPipelineStageFlags dst_stage, VkAccessFlags dst_access);

template <typename F> void submit_once(Device& device, F record) {
  VkCommandBuffer cb = allocate_command_buffer(device);
  VkFence fence = VK_NULL_HANDLE;
  try {
    begin_command_buffer(cb);
    record(cb);
    vk_check(vkEndCommandBuffer(cb), "vkEndCommandBuffer");
    fence = create_fence(device);
    device.submit_and_wait(cb, fence);
  } catch (...) {
    if (fence) vkDestroyFence(device.handle(), fence, nullptr);
    vkFreeCommandBuffers(device.handle(), device.command_pool(), 1, &cb);
    throw;
  }
  vkDestroyFence(device.handle(), fence, nullptr);
  vkFreeCommandBuffers(device.handle(), device.command_pool(), 1, &cb);
}

}  // namespace vktrain
