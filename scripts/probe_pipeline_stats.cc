// What the Vulkan driver says it compiled each compute shader to (VK_KHR_pipeline_executable_properties):
// registers per invocation, shared memory, spills, and any internal representation it offers, for SPIR-V
// files of vktrain/runtime_shaders/spirv. Issue 30 asks why the tensor-core GEMMs stop at ~180 TFLOP/s on
// an H100; the register count decides how many workgroups an SM holds at once.
//
// Build (here; Vulkan headers of 1.3.255 or newer, which name VK_KHR_cooperative_matrix: Debian 12's 1.3.239 do
// not, https://github.com/KhronosGroup/Vulkan-Headers' include/ does):
//   g++ -O2 -std=c++17 -I HEADERS/include scripts/probe_pipeline_stats.cc -o probe_pipeline_stats -lvulkan
// Run (on the GPU machine):
//   ./probe_pipeline_stats vktrain/runtime_shaders/spirv/coopmat_linear_q4gsw.*.spv [--ir DIR]
// Every binding 0..15 is declared as a storage buffer and 256 push-constant bytes as one range: a superset of
// what vktrain's kernels use, which pipeline creation accepts. Every feature the device reports is enabled.
#include <vulkan/vulkan.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#define CHECK(call)                                                                       \
  do {                                                                                    \
    VkResult r_ = (call);                                                                 \
    if (r_ != VK_SUCCESS) {                                                               \
      std::fprintf(stderr, "%s failed: VkResult %d (line %d)\n", #call, r_, __LINE__);    \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

static std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

static bool has_extension(VkPhysicalDevice gpu, const char* name) {
  uint32_t n = 0;
  vkEnumerateDeviceExtensionProperties(gpu, nullptr, &n, nullptr);
  std::vector<VkExtensionProperties> props(n);
  vkEnumerateDeviceExtensionProperties(gpu, nullptr, &n, props.data());
  for (auto& p : props)
    if (std::strcmp(p.extensionName, name) == 0) return true;
  return false;
}

static void print_statistic(const VkPipelineExecutableStatisticKHR& s) {
  std::printf("    %-40s ", s.name);
  switch (s.format) {
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_BOOL32_KHR: std::printf("%s", s.value.b32 ? "true" : "false"); break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_INT64_KHR: std::printf("%lld", (long long)s.value.i64); break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_UINT64_KHR: std::printf("%llu", (unsigned long long)s.value.u64); break;
    case VK_PIPELINE_EXECUTABLE_STATISTIC_FORMAT_FLOAT64_KHR: std::printf("%g", s.value.f64); break;
    default: std::printf("?");
  }
  std::printf("   (%s)\n", s.description);
}

int main(int argc, char** argv) {
  std::vector<const char*> paths;
  const char* ir_dir = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--ir") == 0 && i + 1 < argc) ir_dir = argv[++i];
    else paths.push_back(argv[i]);
  }
  if (paths.empty()) {
    std::fprintf(stderr, "usage: %s SHADER.spv... [--ir DIR]\n", argv[0]);
    return 2;
  }
  VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
  app.apiVersion = VK_API_VERSION_1_3;
  VkInstanceCreateInfo ici{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
  ici.pApplicationInfo = &app;
  VkInstance instance;
  CHECK(vkCreateInstance(&ici, nullptr, &instance));
  uint32_t count = 0;
  vkEnumeratePhysicalDevices(instance, &count, nullptr);
  std::vector<VkPhysicalDevice> gpus(count);
  vkEnumeratePhysicalDevices(instance, &count, gpus.data());
  if (count == 0) {
    std::fprintf(stderr, "no Vulkan device\n");
    return 1;
  }
  VkPhysicalDevice gpu = gpus[0];
  VkPhysicalDeviceProperties props;
  vkGetPhysicalDeviceProperties(gpu, &props);
  std::printf("device: %s, driver %u\n", props.deviceName, props.driverVersion);

  std::vector<const char*> extensions;
  if (!has_extension(gpu, VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME)) {
    std::fprintf(stderr, "%s: no %s\n", props.deviceName, VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME);
    return 1;
  }
  extensions.push_back(VK_KHR_PIPELINE_EXECUTABLE_PROPERTIES_EXTENSION_NAME);
  const bool coopmat = has_extension(gpu, VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME);
  if (coopmat) extensions.push_back(VK_KHR_COOPERATIVE_MATRIX_EXTENSION_NAME);

  // Every feature the device has, enabled (the kernels need fp16, 16-bit storage, the memory model, ...).
  VkPhysicalDevicePipelineExecutablePropertiesFeaturesKHR exec{
      VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PIPELINE_EXECUTABLE_PROPERTIES_FEATURES_KHR};
  VkPhysicalDeviceCooperativeMatrixFeaturesKHR cm{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR};
  VkPhysicalDeviceVulkan13Features f13{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES};
  VkPhysicalDeviceVulkan12Features f12{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES};
  VkPhysicalDeviceVulkan11Features f11{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES};
  VkPhysicalDeviceFeatures2 f2{VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2};
  f2.pNext = &f11;
  f11.pNext = &f12;
  f12.pNext = &f13;
  f13.pNext = &exec;
  if (coopmat) exec.pNext = &cm;
  vkGetPhysicalDeviceFeatures2(gpu, &f2);
  f2.features.robustBufferAccess = VK_FALSE;  // as vktrain's runtime: no bounds checks added to the loads
  f13.robustImageAccess = VK_FALSE;

  float priority = 1.0f;
  VkDeviceQueueCreateInfo qci{VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO};
  qci.queueFamilyIndex = 0;
  qci.queueCount = 1;
  qci.pQueuePriorities = &priority;
  VkDeviceCreateInfo dci{VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO};
  dci.pNext = &f2;
  dci.queueCreateInfoCount = 1;
  dci.pQueueCreateInfos = &qci;
  dci.enabledExtensionCount = (uint32_t)extensions.size();
  dci.ppEnabledExtensionNames = extensions.data();
  VkDevice device;
  CHECK(vkCreateDevice(gpu, &dci, nullptr, &device));
  auto get_props = (PFN_vkGetPipelineExecutablePropertiesKHR)vkGetDeviceProcAddr(
      device, "vkGetPipelineExecutablePropertiesKHR");
  auto get_stats = (PFN_vkGetPipelineExecutableStatisticsKHR)vkGetDeviceProcAddr(
      device, "vkGetPipelineExecutableStatisticsKHR");
  auto get_ir = (PFN_vkGetPipelineExecutableInternalRepresentationsKHR)vkGetDeviceProcAddr(
      device, "vkGetPipelineExecutableInternalRepresentationsKHR");

  std::vector<VkDescriptorSetLayoutBinding> bindings(16);
  for (uint32_t b = 0; b < bindings.size(); ++b)
    bindings[b] = {b, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, 1, VK_SHADER_STAGE_COMPUTE_BIT, nullptr};
  VkDescriptorSetLayoutCreateInfo dsl{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO};
  dsl.bindingCount = (uint32_t)bindings.size();
  dsl.pBindings = bindings.data();
  VkDescriptorSetLayout set_layout;
  CHECK(vkCreateDescriptorSetLayout(device, &dsl, nullptr, &set_layout));
  VkPushConstantRange push{VK_SHADER_STAGE_COMPUTE_BIT, 0, 128};
  VkPipelineLayoutCreateInfo plci{VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO};
  plci.setLayoutCount = 1;
  plci.pSetLayouts = &set_layout;
  plci.pushConstantRangeCount = 1;
  plci.pPushConstantRanges = &push;
  VkPipelineLayout layout;
  CHECK(vkCreatePipelineLayout(device, &plci, nullptr, &layout));

  for (const char* path : paths) {
    std::vector<char> code = read_file(path);
    if (code.empty() || code.size() % 4) {
      std::printf("%s: not a SPIR-V file\n", path);
      continue;
    }
    VkShaderModuleCreateInfo smci{VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO};
    smci.codeSize = code.size();
    smci.pCode = reinterpret_cast<const uint32_t*>(code.data());
    VkShaderModule module;
    CHECK(vkCreateShaderModule(device, &smci, nullptr, &module));
    VkComputePipelineCreateInfo cpci{VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO};
    cpci.flags = VK_PIPELINE_CREATE_CAPTURE_STATISTICS_BIT_KHR |
                 (ir_dir ? VK_PIPELINE_CREATE_CAPTURE_INTERNAL_REPRESENTATIONS_BIT_KHR : 0);
    cpci.stage = {VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, nullptr, 0, VK_SHADER_STAGE_COMPUTE_BIT,
                  module, "main", nullptr};
    cpci.layout = layout;
    VkPipeline pipeline;
    VkResult r = vkCreateComputePipelines(device, VK_NULL_HANDLE, 1, &cpci, nullptr, &pipeline);
    const char* name = std::strrchr(path, '/') ? std::strrchr(path, '/') + 1 : path;
    if (r != VK_SUCCESS) {
      std::printf("%s: pipeline creation failed (VkResult %d)\n", name, r);
      vkDestroyShaderModule(device, module, nullptr);
      continue;
    }
    std::printf("%s\n", name);
    VkPipelineInfoKHR pinfo{VK_STRUCTURE_TYPE_PIPELINE_INFO_KHR};
    pinfo.pipeline = pipeline;
    uint32_t n_exec = 0;
    get_props(device, &pinfo, &n_exec, nullptr);
    std::vector<VkPipelineExecutablePropertiesKHR> execs(n_exec, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_PROPERTIES_KHR});
    get_props(device, &pinfo, &n_exec, execs.data());
    for (uint32_t e = 0; e < n_exec; ++e) {
      std::printf("  executable %u: %s (subgroup size %u)\n", e, execs[e].name, execs[e].subgroupSize);
      VkPipelineExecutableInfoKHR einfo{VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INFO_KHR};
      einfo.pipeline = pipeline;
      einfo.executableIndex = e;
      uint32_t n_stats = 0;
      get_stats(device, &einfo, &n_stats, nullptr);
      std::vector<VkPipelineExecutableStatisticKHR> stats(n_stats, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_STATISTIC_KHR});
      get_stats(device, &einfo, &n_stats, stats.data());
      for (auto& s : stats) print_statistic(s);
      if (!ir_dir) continue;
      uint32_t n_ir = 0;
      get_ir(device, &einfo, &n_ir, nullptr);
      std::vector<VkPipelineExecutableInternalRepresentationKHR> irs(
          n_ir, {VK_STRUCTURE_TYPE_PIPELINE_EXECUTABLE_INTERNAL_REPRESENTATION_KHR});
      get_ir(device, &einfo, &n_ir, irs.data());
      std::vector<std::vector<char>> data(n_ir);
      for (uint32_t i = 0; i < n_ir; ++i) {
        data[i].resize(irs[i].dataSize);
        irs[i].pData = data[i].data();
      }
      get_ir(device, &einfo, &n_ir, irs.data());
      for (uint32_t i = 0; i < n_ir; ++i) {
        std::printf("    representation %s: %zu bytes%s\n", irs[i].name, irs[i].dataSize, irs[i].isText ? " (text)" : "");
        std::string out = std::string(ir_dir) + "/" + name + "." + std::to_string(i) + (irs[i].isText ? ".txt" : ".bin");
        std::ofstream(out, std::ios::binary).write(data[i].data(), (std::streamsize)irs[i].dataSize);
      }
    }
    vkDestroyPipeline(device, pipeline, nullptr);
    vkDestroyShaderModule(device, module, nullptr);
  }
  vkDestroyPipelineLayout(device, layout, nullptr);
  vkDestroyDescriptorSetLayout(device, set_layout, nullptr);
  vkDestroyDevice(device, nullptr);
  vkDestroyInstance(instance, nullptr);
  return 0;
}
