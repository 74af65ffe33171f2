// A dispatch schedule (schema.fbs table Schedule, file identifier "VKS1"; vktrain/serialization/schedule.py
// writes it) read and verified natively: the checks of schedule.py's reader and of verify_schedule.py, in
// their order and with their messages, so that what one side refuses the other refuses too.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "file_map.h"
#include "graph.h"

namespace vktrain {

constexpr uint32_t kScheduleFormatVersion = 1;       // schedule.py SCHEDULE_FORMAT_VERSION
constexpr uint32_t kMaxPushBytes = 128 - 16;         // verify_schedule.py MAX_PUSH_BYTES (less the push header)
constexpr uint64_t kGuaranteedGroupCount = 65535;    // verify_schedule.py GUARANTEED_GROUP_COUNT
constexpr uint64_t kMaxSplitDispatches = 1u << 20;   // dispatch.py MAX_SPLIT_DISPATCHES
const char* buffer_role_name(int role);              // schedule.py ROLES: "constant"...; nullptr outside the enum
constexpr int kNumBufferRoles = 7;

struct ScheduleBuffer { std::string key; uint64_t size_bytes = 0; int role = 0; };
struct SchedulePlacement { int32_t value_id = 0; uint32_t buffer = 0; uint64_t offset = 0, size_bytes = 0; };
struct ScheduleBinding { uint32_t buffer = 0; uint64_t offset = 0, size_bytes = 0; /* 0: to the buffer's end */ int access = 0; };

// schema.fbs SpecKind: how a specialization constant's value was written (the shader's declared type decides
// how it is packed, vk/pipelines.py pack_specialization).
enum class SpecKind : int { kInt = 0, kFloat = 1, kBool = 2 };
struct ScheduleSpecConstant { uint32_t id = 0; SpecKind kind = SpecKind::kInt; int64_t int_value = 0; double float_value = 0; };

struct ScheduleDispatch {
  std::string shader, label;
  std::array<uint32_t, 3> groups{};
  std::vector<ScheduleBinding> bindings;
  uint32_t push_bytes = 0;
  std::vector<uint8_t> push_constants;          // the kernel's bytes, after the group-offset header if any
  std::vector<ScheduleSpecConstant> spec_constants;  // sorted by id, one per id (dispatch.py Dispatch)
  std::vector<uint32_t> local_size;  // empty, or x, y, z
  const std::string& name() const { return label.empty() ? shader : label; }
};

struct ScheduleRequirements {
  std::string api;
  uint64_t max_storage_buffer_range = 0;
  uint32_t min_storage_buffer_offset_alignment = 0, max_shared_memory_bytes = 0, max_workgroup_invocations = 0,
           max_workgroup_size_x = 0, subgroup_size = 0;
  std::vector<std::string> subgroup_operations;
  bool float16 = false, int64 = false;
  std::vector<uint32_t> cooperative_matrix;
};

// schema.fbs StateGuardPlan (backend/kernel_planning/state_guard.py): its dispatches bind the schedule's buffers
// and, at indices buffers.size() + 0, 1, 2, the guard's slot, flags and result word. Read and verified; this
// runtime does not replay it yet (it trains the same bits without it: the guard only backs up and checks).
struct GuardedTensor { std::string name; uint64_t slot_offset = 0, size_bytes = 0; };
struct StateGuardPlan {
  bool present = false;
  std::vector<GuardedTensor> tensors;
  uint64_t slot_bytes = 0, flags_bytes = 0;
  std::vector<ScheduleDispatch> save, restore;
};

struct Schedule {
  std::string source;  // the file as named, the start of every message
  uint32_t format_version = 0;
  std::string graph_digest;
  ScheduleRequirements requirements;
  std::string gemm_precision;
  bool gemm_tensor_cores = false;
  uint64_t max_binding_bytes = 0;
  std::vector<ScheduleBuffer> buffers;
  std::vector<SchedulePlacement> placements;
  std::vector<ScheduleDispatch> dispatches;
  std::vector<std::string> tensor_core_ops;
  StateGuardPlan state_guard;

  // schedule.py module_dispatches: the step's dispatches, then the guard's save and restore (the order of an
  // embedded schedule's dispatch_modules).
  std::vector<const ScheduleDispatch*> module_dispatches() const;

  // Reads the VKS1 bytes `data` (an embedded schedule's), `source` starting every message.
  static Schedule parse(Bytes data, const std::string& source);
  // Reads `path` (schedule.py deserialize_schedule's checks); LoadError kScheduleFormat / kIo / kLimit.
  static Schedule load(const std::string& path);
};

// verify_schedule.py, LoadError kVerification "SOURCE: ..." naming the dispatch or buffer. `graph` (nullptr:
// none given) runs check_schedule_graph's placement checks; the graph digest is not compared (see schedule.cc).
// `shader_sources`: the kernel names a dispatch may run (nullptr: this build's runtime_shaders; an embedded
// schedule's: its blob's module names, as verify_embedded passes them).
void verify_schedule(const Schedule& schedule, const Graph* graph, const std::vector<std::string>* shader_sources = nullptr);

std::string schedule_summary_text(const Schedule& schedule);
std::string schedule_summary_json(const Schedule& schedule);

}  // namespace vktrain
