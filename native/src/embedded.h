// Schedules embedded in a delegate blob (`vktrain export --target`; schema.fbs EmbeddedSchedule and
// ShaderModule; the Python side is vktrain/serialization/embedded.py, verify_schedule.py verify_embedded and
// device_profile.py): their device profiles, their verification, and the matching rule that picks the one a
// device runs. The rule is embedded.py select_schedule's, implemented again here; change both together.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph.h"
#include "schedule.h"
#include "status.h"
#include "step_source.h"

namespace vktrain {

class Device;

// device_profile.py CoopmatShape and DeviceProfile (the fields planning reads, and name and source).
struct CoopmatShape {
  int64_t m = 0, n = 0, k = 0;
  std::string a_type, b_type, c_type, result_type, scope = "subgroup";
  bool operator==(const CoopmatShape& o) const;
};

struct DeviceProfile {
  std::string name, api, device_type;
  int64_t subgroup_size = 0;
  std::vector<std::string> subgroup_operations;
  bool float16 = false, int64 = false;
  std::vector<CoopmatShape> cooperative_matrix;
  int64_t max_shared_memory_bytes = 0, max_workgroup_invocations = 0;
  std::array<int64_t, 3> max_workgroup_size{}, max_workgroup_count{};
  int64_t max_storage_buffer_range = 0, min_storage_buffer_offset_alignment = 0, max_allocation_bytes = 0,
          max_push_constants_bytes = 0, max_storage_buffers_per_stage = 0;
  int64_t min_workgroups = 128, split_k_target_workgroups = 512, fp32_target_workgroups = 256;  // H200_* defaults
  int64_t max_dispatches_per_submit = 0, memory_budget_bytes = 0;
  bool prefers_fp16 = false;
  std::vector<int64_t> gemm_tiles;
  std::string source;

  // device_profile.py from_json: LoadError(code) "WHERE: ..." naming the unknown, missing or invalid field.
  static DeviceProfile from_json(const std::string& text, const std::string& where, ErrorCode code);
  // planning_fields() == other.planning_fields(): every field but name and source.
  bool same_planning_fields(const DeviceProfile& other) const;
};

// runtime/device_profiles.py _vulkan_profile of an opened device: its cooperative-matrix shapes where the device
// enabled VK_KHR_cooperative_matrix (else none, and a schedule that needs them is refused: "... cooperative matrices").
DeviceProfile device_profile_of(const Device& device);

// ScheduleRequirements.unmet_by: what `profile` lacks of the schedule's requirements, one phrase each.
std::vector<std::string> unmet_requirements(const ScheduleRequirements& needs, const DeviceProfile& profile);

// One embedded schedule read and verified.
struct EmbeddedSchedule {
  DeviceProfile profile;
  Schedule schedule;
  std::vector<uint32_t> dispatch_modules;  // per Schedule::module_dispatches(), an index into Graph.shader_modules
};

// verify_schedule.py verify_embedded: the modules' code and reflection, then per schedule its VKS1 bytes read,
// its dispatches against their modules, the schedule's own checks (shader names: the blob's modules) and its
// profile. `source` starts every message ("": none). Returns the schedules in the blob's order.
std::vector<EmbeddedSchedule> verify_embedded(const Graph& graph, const std::string& source);

// embedded.py select_schedule: the index of the schedule a device of `device` profile runs; LoadError
// kUnsupported naming every profile and what the device lacks for it when none fits. Requires a non-empty list.
// `only_profile` non-empty: the schedule embedded for that profile, refused when there is none or it does not fit.
size_t select_schedule(const std::vector<EmbeddedSchedule>& schedules, const std::vector<ShaderModuleRecord>& modules,
                       const DeviceProfile& device, const std::string& device_name, const std::string& source,
                       const std::string& only_profile = "");

// The step source of a blob's embedded schedule `chosen` (its SPIR-V modules by shader name). `graph` must outlive it.
std::unique_ptr<StepSource> embedded_step_source(const Graph& graph, EmbeddedSchedule chosen);

}  // namespace vktrain
