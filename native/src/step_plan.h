// Everything the schedule interpreter decides before it touches Vulkan, as data: the .pte's step checked
// (one delegate call fed by the plan's inputs), the schedule verified against the graph and against what the
// device offers (`DeviceCaps`), every placement the host writes or reads, and every Dispatch checked against
// its shader's reflected interface (vk/commands.py Program._plan): binding ranges, access, push-constant
// bytes, specialization words, split chunks, and the barrier before it (plan_barriers). Pure: it runs under
// the sanitizers without a device (vktrain-native-inspect --schedule-fuzz-dir ... --spirv-dir), and every
// index, offset and range of a hostile schedule is checked here, so nothing later can go out of bounds.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "graph.h"
#include "pte.h"
#include "schedule.h"
#include "spirv_reflect.h"
#include "step_source.h"

namespace vktrain {

// What planning reads of a device (VkPhysicalDeviceLimits and the features the schedule may require).
struct DeviceCaps {
  std::string name;
  uint64_t max_storage_buffer_range = 0;
  uint32_t min_storage_buffer_offset_alignment = 1;
  std::array<uint32_t, 3> max_group_count{}, max_workgroup_size{};
  uint32_t max_workgroup_invocations = 0, max_shared_memory_bytes = 0, max_push_constants_size = 0;
  uint32_t subgroup_size = 0, subgroup_operations = 0;  // VkSubgroupFeatureFlags usable in compute shaders
  bool float16 = false, int64 = false;
  uint64_t memory_bytes = 0;  // the largest device-local heap: what all buffers together may take
  uint32_t api_version = 0;   // the Vulkan version the device was opened with (VK_MAKE_API_VERSION)
  std::set<std::string> features;  // Device::has_feature's names ("shaderFloat16", "cooperativeMatrix", ...)
  std::vector<std::array<int64_t, 3>> coopmat_f16;  // M, N, K of its float16 x float16 + float32 -> float32 subgroup shapes
};

// lavapipe's (llvmpipe, 256-bit) caps: the reference device of the sanitizer runs, which open no device.
DeviceCaps lavapipe_caps();

struct Placement { uint32_t buffer; uint64_t offset; };
struct IndexLimit { bool has_low; int64_t low, bound; std::string what; };
using Chunk = std::pair<std::array<uint32_t, 3>, std::array<uint32_t, 3>>;  // (group offset, group count)

struct ShaderModuleCode { std::vector<uint32_t> code; ShaderInterface interface; };

struct PlannedBinding { uint32_t buffer; uint64_t offset, range; bool reads, writes; };

struct PlannedDispatch {
  const ScheduleDispatch* dispatch = nullptr;
  std::vector<PlannedBinding> bindings;
  std::vector<std::pair<uint32_t, uint32_t>> specialization;  // (id, 32-bit word), sorted by id
  uint32_t push_size = 0;
  bool header = false;  // the push block starts with the 16-byte group-offset header
  std::vector<Chunk> chunks;
  bool barrier = false;  // a compute -> compute barrier precedes it
};

// A tensor another interpreter of the program holds (the training step's state or a frozen constant), for a method
// whose schedule binds it (buffer "shared:<name>", schedule.py SHARED_PREFIX: an eval method reads the trained adapters
// and the step's copy of the base). `constant`: the owner's constant record (null for state).
struct SharedTensor {
  uint32_t buffer = 0;         // the owner's buffer index
  uint64_t offset = 0, buffer_bytes = 0;
  const TensorValue* tensor = nullptr;
  const Constant* constant = nullptr;
};
using SharedTensors = std::map<std::string, SharedTensor>;

struct StepPlan {
  std::string where;  // "PTE: method 'forward'"
  std::map<uint32_t, uint32_t> borrowed;  // buffer index -> the owner's buffer index (shared buffers)
  const Graph* graph = nullptr;
  const Schedule* schedule = nullptr;
  std::vector<uint64_t> buffer_sizes;  // rounded up to whole words, as Buffer allocates them
  std::map<int32_t, Placement> placements;
  std::vector<std::pair<std::string, MutableState>> states;  // by name, graph order
  std::map<int32_t, std::vector<IndexLimit>> index_limits;   // graph input -> its index uses
  std::map<std::string, ShaderModuleCode> modules;
  std::vector<PlannedDispatch> dispatches;
  std::vector<std::string> input_names() const;
  const TensorValue& tensor(int32_t value_id) const;
};

// LoadError naming the file and what is wrong: kUnsupported (a plan outside the delegate, a requirement the
// device lacks), kVerification (a range outside its buffer), kShaderModule (a dispatch its shader does not take).
StepPlan plan_step(const Program& program, const StepSource& source, const DeviceCaps& caps);

// plan_step for a delegate graph alone, the program around it checked by its caller (ExecuTorch's runtime, for an
// ExecuTorch backend); `where` starts every message. Buffers the schedule marks shared bind `shared`'s tensors:
// each must be there, of the same shape, dtype and layout, at the offset the schedule places it, and a constant
// must hold the same bytes; LoadError kUnsupported / kVerification otherwise.
StepPlan plan_graph_step(const Graph& graph, const std::string& where, const StepSource& source, const DeviceCaps& caps,
                         const SharedTensors& shared = {});

}  // namespace vktrain
