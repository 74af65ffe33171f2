#include "step_plan.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <set>

#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr uint32_t kPushHeaderBytes = 16;  // dispatch.py PUSH_HEADER_BYTES
enum Access { kDeclared = 0, kRead = 1, kWrite = 2 };  // schema.fbs BindingAccess (READ_WRITE = both bits)
constexpr int kRoleShared = 2;                           // schema.fbs BufferRole SHARED
const std::map<std::string, int> kEmbeddingIndexArg = {{"aten.embedding.default", 1},  // executor.py EMBEDDING_INDEX_ARG
                                                       {"vktrain.embedding_q8_0.default", 2}};
constexpr const char* kFusedCe = "vktrain.fused_ce.default";
const char* const kSubgroupOperations[] = {"basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative",
                                           "clustered", "quad"};  // device_profile.py, in VkSubgroupFeatureFlagBits order

// vk/schedule.py split_groups: (group offset, group count) chunks in x-fastest order.
std::vector<Chunk> split_groups(const std::array<uint32_t, 3>& groups, const std::array<uint32_t, 3>& max_counts,
                                const std::string& where) {
  uint64_t pieces = 1;
  for (int a = 0; a < 3; ++a) {
    if (!max_counts[a] || !groups[a]) refuse(ErrorCode::kVerification, where + ": a group count or the device's limit is 0");
    pieces *= (uint64_t(groups[a]) + max_counts[a] - 1) / max_counts[a];
    if (pieces > kMaxSplitDispatches)  // refused before the list is built: a corrupt count could need billions
      refuse(ErrorCode::kVerification, where + ": its work groups would be split into more than " +
                                           num(kMaxSplitDispatches) + " dispatches (at most that many are recorded for one Dispatch)");
  }
  std::vector<Chunk> chunks;
  for (uint64_t z = 0; z < groups[2]; z += max_counts[2])
    for (uint64_t y = 0; y < groups[1]; y += max_counts[1])
      for (uint64_t x = 0; x < groups[0]; x += max_counts[0])
        chunks.push_back({{uint32_t(x), uint32_t(y), uint32_t(z)},
                          {uint32_t(std::min<uint64_t>(max_counts[0], groups[0] - x)),
                           uint32_t(std::min<uint64_t>(max_counts[1], groups[1] - y)),
                           uint32_t(std::min<uint64_t>(max_counts[2], groups[2] - z))}});
  return chunks;
}

// vk/schedule.py plan_barriers: whether a compute -> compute barrier must precede each dispatch.
void plan_barriers(std::vector<PlannedDispatch>* dispatches) {
  std::map<uint32_t, std::vector<const PlannedBinding*>> pending_writes, pending_reads;
  auto overlaps = [](const PlannedBinding& a, const PlannedBinding& b) {
    return a.offset < b.offset + b.range && b.offset < a.offset + a.range;
  };
  for (auto& d : *dispatches) {
    bool hazard = false;
    for (const auto& now : d.bindings) {
      auto conflicts = [&](const std::map<uint32_t, std::vector<const PlannedBinding*>>& pending) {
        auto it = pending.find(now.buffer);
        return it != pending.end() &&
               std::any_of(it->second.begin(), it->second.end(), [&](const PlannedBinding* b) { return overlaps(now, *b); });
      };
      if (conflicts(pending_writes) || (now.writes && conflicts(pending_reads))) { hazard = true; break; }
    }
    d.barrier = hazard;
    if (hazard) { pending_writes.clear(); pending_reads.clear(); }
    for (const auto& now : d.bindings) {
      if (now.writes) pending_writes[now.buffer].push_back(&now);
      if (now.reads) pending_reads[now.buffer].push_back(&now);
    }
  }
}

// vk/pipelines.py pack_specialization: a value packed as the type the shader declares.
uint32_t spec_word(const std::string& where, uint32_t id, SpecKind kind, int64_t int_value, double float_value,
                   const ShaderInterface& interface) {
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, where + ": " + why); };
  auto it = interface.spec_types.find(id);
  if (it == interface.spec_types.end()) bad("the shader has no specialization constant with id " + num(id));
  switch (it->second) {
    case SpecType::kFloat: {
      if (kind == SpecKind::kBool) bad("spec constant " + num(id) + " is float, got a bool");
      double value = kind == SpecKind::kFloat ? float_value : double(int_value);
      if (std::isfinite(value) && std::fabs(value) > double(FLT_MAX))  // struct.pack("<f") refuses it too
        bad("spec constant " + num(id) + " = " + real(value) + " does not fit a 32-bit float");
      float f = float(value);
      uint32_t word;
      std::memcpy(&word, &f, 4);
      return word;
    }
    case SpecType::kBool: case SpecType::kUint: case SpecType::kInt:
      if (kind == SpecKind::kFloat) bad("spec constant " + num(id) + " is an integer, got the float " + real(float_value));
      if (it->second == SpecType::kBool) return int_value ? 1 : 0;
      if (it->second == SpecType::kUint && (int_value < 0 || int_value >= (int64_t(1) << 32)))
        bad("spec constant " + num(id) + " is uint, got " + num(int_value));
      if (it->second == SpecType::kInt && (int_value < INT32_MIN || int_value > INT32_MAX))
        bad("spec constant " + num(id) + " is int, got " + num(int_value));
      return uint32_t(int_value);
    default:
      bad("spec constant " + num(id) + " has a type vktrain cannot specialize (only 32-bit int/uint/float and bool)");
      return 0;
  }
}

// What a shader's SPIR-V declares that the device must have enabled (the Vulkan spec's SPIR-V environment
// appendix): every capability vktrain's kernels use, mapped to its feature; any other capability is refused, so
// a module the device was not set up for never reaches the driver.
void check_shader_needs(const std::string& where, const std::string& shader, const ShaderInterface& interface,
                        const DeviceCaps& caps) {
  auto lacks = [&](const std::string& what) {
    refuse(ErrorCode::kUnsupported, where + ": shader '" + shader + "' needs " + what + ", which " + caps.name + " lacks (or "
                                        "the runtime did not enable); export it for a --target this device satisfies");
  };
  // SPIR-V 1.4 and 1.5 modules need Vulkan 1.2, SPIR-V 1.6 needs Vulkan 1.3 (1.0-1.3 run on Vulkan 1.1).
  const uint32_t minor = (interface.spirv_version >> 8) & 0xFF, major = interface.spirv_version >> 16;
  const uint32_t vulkan_minor = (caps.api_version >> 12) & 0x3FF;
  if (major != 1 || minor > 6) lacks("SPIR-V version " + num(major) + "." + num(minor) + " (no Vulkan version takes it)");
  const uint32_t needs_minor = minor >= 6 ? 3 : minor >= 4 ? 2 : 1;
  if (vulkan_minor < needs_minor)
    lacks("SPIR-V 1." + num(minor) + " modules (Vulkan 1." + num(needs_minor) + "; the device runs 1." + num(vulkan_minor) + ")");
  for (uint32_t capability : interface.capabilities) {
    static const std::map<uint32_t, const char*> kFeatureOf = {
        {9, "shaderFloat16"}, {10, "shaderFloat64"}, {11, "shaderInt64"}, {22, "shaderInt16"}, {39, "shaderInt8"},
        {4433, "storageBuffer16BitAccess"}, {4434, "uniformAndStorageBuffer16BitAccess"},
        {4448, "storageBuffer8BitAccess"}, {4449, "uniformAndStorageBuffer8BitAccess"},
        {5345, "vulkanMemoryModel"}, {5346, "vulkanMemoryModelDeviceScope"}, {5347, "bufferDeviceAddress"},
        {6022, "cooperativeMatrix"}};
    if (capability == 1) continue;  // Shader
    if (capability >= 61 && capability <= 68) {  // GroupNonUniform..Quad: VkSubgroupFeatureFlagBits in that order
      uint32_t bit = capability - 61;
      if (!(caps.subgroup_operations >> bit & 1)) lacks(std::string("subgroup operation ") + kSubgroupOperations[bit] + " in compute shaders");
      continue;
    }
    auto feature = kFeatureOf.find(capability);
    if (feature == kFeatureOf.end())
      refuse(ErrorCode::kUnsupported, where + ": shader '" + shader + "' declares SPIR-V capability " + num(capability) +
                                          ", which vktrain's runtime does not enable");
    if (!caps.features.count(feature->second))
      lacks(std::string("the ") + feature->second + " feature" +
            (capability == 6022 ? " (VK_KHR_cooperative_matrix, tensor cores)" : ""));
  }
}

// The bytes a constant widens to (constant_data.cc), without widening it.
uint64_t widened_size(const Constant& c) {
  if (c.synthetic) return c.nbytes;  // generated as its tensors read it (graph_validate.cc checked they match)
  if (!c.narrow) return c.data.size;
  if (c.stored_form == "gguf_q8_0") return c.data.size / 34 * 32 * 4;
  return c.data.size / 2 * 4;
}

void check_requirements(const Schedule& schedule, const DeviceCaps& caps) {
  // schedule.py ScheduleRequirements.unmet_by, against this device.
  const auto& q = schedule.requirements;
  std::vector<std::string> missing;
  if (q.api != "vulkan") missing.push_back("the schedule is for the " + q.api + " runtime, the device is vulkan");
  auto at_least = [&](const char* name, uint64_t want, uint64_t have) {
    if (have < want) missing.push_back(std::string(name) + " " + num(want) + " (the device has " + num(have) + ")");
  };
  at_least("max_storage_buffer_range", q.max_storage_buffer_range, caps.max_storage_buffer_range);
  at_least("max_shared_memory_bytes", q.max_shared_memory_bytes, caps.max_shared_memory_bytes);
  at_least("max_workgroup_invocations", q.max_workgroup_invocations, caps.max_workgroup_invocations);
  at_least("max_workgroup_size_x", q.max_workgroup_size_x, caps.max_workgroup_size[0]);
  uint64_t alignment = caps.min_storage_buffer_offset_alignment;
  if (!alignment || q.min_storage_buffer_offset_alignment % alignment)
    missing.push_back("a min_storage_buffer_offset_alignment dividing " + num(q.min_storage_buffer_offset_alignment) +
                      " (the device's is " + num(alignment) + ")");
  if (q.subgroup_size && q.subgroup_size != caps.subgroup_size)
    missing.push_back("subgroups of " + num(q.subgroup_size) + " lanes (the device's have " + num(caps.subgroup_size) + ")");
  for (const auto& op : q.subgroup_operations) {
    bool have = false;
    for (int bit = 0; bit < 8; ++bit)
      if (op == kSubgroupOperations[bit]) have = caps.subgroup_operations & (1u << bit);
    if (!have) missing.push_back("subgroup operation " + op);
  }
  if (q.float16 && !caps.float16) missing.push_back("float16");
  if (q.int64 && !caps.int64) missing.push_back("int64");
  if (!q.cooperative_matrix.empty()) {
    bool have = q.cooperative_matrix.size() == 3 &&
                std::any_of(caps.coopmat_f16.begin(), caps.coopmat_f16.end(), [&](const std::array<int64_t, 3>& s) {
                  return uint64_t(s[0]) == q.cooperative_matrix[0] && uint64_t(s[1]) == q.cooperative_matrix[1] &&
                         uint64_t(s[2]) == q.cooperative_matrix[2];
                });
    if (!have)
      missing.push_back(list(std::vector<int64_t>(q.cooperative_matrix.begin(), q.cooperative_matrix.end())) +
                        " float16 x float16 + float32 cooperative matrices (VK_KHR_cooperative_matrix" +
                        (caps.features.count("cooperativeMatrix") ? " has no such shape here)" : " is not enabled on this device)"));
  }
  if (missing.empty()) return;
  std::string all;
  for (const auto& m : missing) all += (all.empty() ? "" : "; ") + m;
  refuse(ErrorCode::kUnsupported, schedule.source + ": the schedule does not fit " + caps.name + ": it relies on " + all);
}

PlannedDispatch plan_dispatch(StepPlan& plan, const StepSource& source, const DeviceCaps& caps, size_t i) {
  const ScheduleDispatch& d = plan.schedule->dispatches[i];
  const std::string where = plan.schedule->source + ": dispatch #" + num(i) + " '" + d.name() + "'";
  auto found = plan.modules.find(d.shader);
  if (found == plan.modules.end()) {
    std::vector<uint32_t> code;
    ShaderInterface interface;
    try {
      code = source.module(d.shader);
      interface = reflect_spirv(code, "shader '" + d.shader + "'");
    } catch (const LoadError& e) {  // named by the dispatch that wants it
      throw LoadError(e.code(), where + ": " + e.what());
    }
    for (size_t k = 0; k < interface.bindings.size(); ++k) {
      const auto& b = interface.bindings[k];
      if (b.set != 0) refuse(ErrorCode::kShaderModule, where + ": shader '" + d.shader + "' uses descriptor set " + num(b.set) + "; vktrain shaders bind every buffer in set 0");
      if (b.uniform) refuse(ErrorCode::kShaderModule, where + ": shader '" + d.shader + "' declares a uniform block at binding " + num(b.binding) + "; vktrain binds storage buffers only");
      if (b.binding != k) refuse(ErrorCode::kShaderModule, where + ": shader '" + d.shader + "' does not number its bindings 0..n-1");
    }
    check_shader_needs(where, d.shader, interface, caps);
    found = plan.modules.emplace(d.shader, ShaderModuleCode{std::move(code), std::move(interface)}).first;
  }
  const ShaderInterface& interface = found->second.interface;
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, where + ": " + why); };
  if (d.bindings.size() != interface.bindings.size())
    bad("shader '" + d.shader + "' declares " + num(interface.bindings.size()) + " storage buffers but the Dispatch binds " +
        num(d.bindings.size()));
  PlannedDispatch p;
  p.dispatch = &d;
  p.header = interface.has_group_offset_header;
  for (size_t k = 0; k < d.bindings.size(); ++k) {
    const ScheduleBinding& b = d.bindings[k];
    if (b.buffer >= plan.buffer_sizes.size()) refuse(ErrorCode::kInternal, where + ": binding " + num(k) + " names no buffer");
    uint64_t size = plan.buffer_sizes[b.buffer];
    const std::string which = where + ": binding " + num(k) + " ('" + plan.schedule->buffers[b.buffer].key + "')";
    if (b.offset % caps.min_storage_buffer_offset_alignment)
      refuse(ErrorCode::kVerification, which + " offset " + num(b.offset) + " is not a multiple of the device's "
             "minStorageBufferOffsetAlignment (" + num(caps.min_storage_buffer_offset_alignment) + ")");
    uint64_t range = b.size_bytes ? b.size_bytes : (b.offset < size ? size - b.offset : 0);
    if (range == 0 || b.offset >= size || range > size - b.offset)
      refuse(ErrorCode::kVerification, which + " range [" + num(b.offset) + ", " + sum(b.offset, range) +
                                           ") is outside the buffer's " + num(size) + " bytes");
    if (range > caps.max_storage_buffer_range)
      refuse(ErrorCode::kUnsupported, which + " spans " + num(range) + " bytes, more than the device's maxStorageBufferRange of " +
                                          num(caps.max_storage_buffer_range));
    bool reads = b.access == kDeclared ? !interface.bindings[k].writeonly : (b.access & kRead) != 0;
    bool writes = b.access == kDeclared ? !interface.bindings[k].readonly : (b.access & kWrite) != 0;
    p.bindings.push_back({b.buffer, b.offset, range, reads, writes});
  }
  p.push_size = (p.header ? kPushHeaderBytes : 0) + uint32_t(d.push_constants.size());
  if (interface.push_constant_size >= 0 && int64_t(p.push_size) != interface.push_constant_size)
    bad("shader '" + d.shader + "' expects " + num(interface.push_constant_size - (p.header ? kPushHeaderBytes : 0)) +
        " bytes of push constants" + (p.header ? " after the 16-byte group-offset header" : "") + ", the Dispatch gives " +
        num(d.push_constants.size()));
  if (p.push_size > caps.max_push_constants_size)
    refuse(ErrorCode::kUnsupported, where + ": " + num(p.push_size) + " push-constant bytes exceed the device's "
                                        "maxPushConstantsSize of " + num(caps.max_push_constants_size));
  std::map<uint32_t, uint32_t> words;  // Dispatch.specialization(): its constants and the local size, by id
  for (const auto& s : d.spec_constants) words[s.id] = spec_word(where, s.id, s.kind, s.int_value, s.float_value, interface);
  if (!d.local_size.empty()) {
    if (d.local_size.size() != 3) bad("local_size must be 3 ints");
    uint64_t invocations = 1;
    for (uint32_t axis = 0; axis < 3; ++axis) {
      bool declared = interface.spec_types.count(axis) > 0;
      if (!declared && d.local_size[axis] != 1)
        bad("local_size " + list(d.local_size) + " but the shader does not take its local size " + "xyz"[axis] +
            " from specialization constant " + num(axis));
      if (d.local_size[axis] > caps.max_workgroup_size[axis])
        refuse(ErrorCode::kUnsupported, where + ": local_size " + list(d.local_size) + " exceeds the device's maxComputeWorkGroupSize");
      invocations *= d.local_size[axis];
      if (declared) words[axis] = spec_word(where, axis, SpecKind::kInt, d.local_size[axis], 0, interface);
    }
    if (invocations > caps.max_workgroup_invocations)
      refuse(ErrorCode::kUnsupported, where + ": local_size " + list(d.local_size) + " exceeds the device's maxComputeWorkGroupInvocations");
  }
  p.specialization.assign(words.begin(), words.end());
  p.chunks = split_groups(d.groups, caps.max_group_count, where);
  if (p.chunks.size() > 1 && !p.header)
    bad("its work groups exceed the device's per-axis limit and shader '" + d.shader + "' cannot be split (its "
        "push-constant block does not start with VKTRAIN_PUSH_HEADER)");
  return p;
}

}  // namespace

namespace {

constexpr const char* kSharedPrefix = "shared:";  // schedule.py SHARED_PREFIX

// The owner's tensor a shared buffer entry names; its size in this plan is the owner's buffer's.
uint64_t bind_shared(StepPlan& plan, const ScheduleBuffer& b, const SharedTensors& shared) {
  const std::string prefix = kSharedPrefix;
  const std::string name = b.key.compare(0, prefix.size(), prefix) == 0 ? b.key.substr(prefix.size()) : "";
  if (name.empty())
    refuse(ErrorCode::kVerification, plan.schedule->source + ": buffer '" + b.key + "' has the role shared, but its key "
                                         "names no tensor (expected " + prefix + "<tensor name>)");
  auto it = shared.find(name);
  if (it == shared.end())
    refuse(ErrorCode::kUnsupported, plan.schedule->source + ": buffer '" + b.key + "' binds tensor '" + name + "' of another "
           "method's executor (the training step's), which " + (shared.empty() ? "no training step gives this method"
                                                                          : "the training step bound to this method does not hold"));
  if (b.size_bytes > it->second.buffer_bytes)
    refuse(ErrorCode::kVerification, plan.schedule->source + ": shared buffer '" + b.key + "' has " + num(b.size_bytes) +
                                         " bytes, the training step's buffer holding it " + num(it->second.buffer_bytes));
  plan.borrowed[uint32_t(plan.buffer_sizes.size())] = it->second.buffer;
  return it->second.buffer_bytes;
}

// executor.py _check_schedule and planner.py _shared_key: a tensor placed in a shared buffer is the owner's, at its offset.
void check_shared_placements(const StepPlan& plan, const SharedTensors& shared) {
  const std::string prefix = kSharedPrefix;
  for (const auto& [value_id, p] : plan.placements) {
    if (!plan.borrowed.count(p.buffer)) continue;
    const std::string& key = plan.schedule->buffers.at(p.buffer).key;
    const SharedTensor& owner = shared.at(key.substr(prefix.size()));
    const TensorValue& mine = plan.tensor(value_id);
    if (mine.storage_of >= 0) continue;  // a view into it: bounds checked with every binding
    const std::string what = plan.where + ": tensor '" + key.substr(prefix.size()) + "'";
    if (p.offset != owner.offset)
      refuse(ErrorCode::kVerification, what + " is bound at byte " + num(p.offset) + ", the training step holds it at byte " + num(owner.offset));
    if (mine.shape != owner.tensor->shape || mine.storage_dtype() != owner.tensor->storage_dtype() ||
        mine.layout != owner.tensor->layout)
      refuse(ErrorCode::kVerification, what + " is " + data_type_name(mine.storage_dtype()) + list(mine.shape) +
                                           " here and " + data_type_name(owner.tensor->storage_dtype()) +
                                           list(owner.tensor->shape) + " (or another layout) in the training step");
    if (owner.constant != nullptr) {  // the frozen base: the same bytes, else this is another program's method
      if (mine.constant_id < 0)
        refuse(ErrorCode::kVerification, what + " is no constant here but a constant in the training step");
      const Constant& c = plan.graph->constants.at(mine.constant_id);
      if (c.data.size != owner.constant->data.size || c.stored_form != owner.constant->stored_form ||
          (c.data.size && std::memcmp(c.data.data, owner.constant->data.data, c.data.size) != 0))
        refuse(ErrorCode::kVerification, what + " holds other bytes than the training step's constant of that name: the "
                                                "method is not of the program whose training step it would bind");
    }
  }
}

}  // namespace

DeviceCaps lavapipe_caps() {
  DeviceCaps c;
  c.name = "llvmpipe (the sanitizer runs' reference caps)";
  c.max_storage_buffer_range = 134217728;
  c.min_storage_buffer_offset_alignment = 16;
  c.max_group_count = {65535, 65535, 65535};
  c.max_workgroup_size = {1024, 1024, 1024};
  c.max_workgroup_invocations = 1024;
  c.max_shared_memory_bytes = 32768;
  c.max_push_constants_size = 128;
  c.subgroup_size = 8;
  c.subgroup_operations = 0xFF;
  c.float16 = c.int64 = true;
  c.memory_bytes = uint64_t(2) << 30;
  c.api_version = (1u << 22) | (3u << 12);  // Vulkan 1.3
  c.features = {"bufferDeviceAddress", "scalarBlockLayout", "shaderFloat16", "shaderFloat64", "shaderInt16", "shaderInt64",
                "shaderInt8", "storageBuffer16BitAccess", "storageBuffer8BitAccess", "uniformAndStorageBuffer16BitAccess",
                "uniformAndStorageBuffer8BitAccess", "vulkanMemoryModel", "vulkanMemoryModelDeviceScope"};
  return c;
}

std::vector<std::string> StepPlan::input_names() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < graph->inputs.size(); ++i) {
    const std::string& n = tensor(graph->inputs[i]).name;
    names.push_back(n.empty() ? "input" + num(i) : n);
  }
  return names;
}

const TensorValue& StepPlan::tensor(int32_t value_id) const {
  if (value_id < 0 || size_t(value_id) >= graph->values.size() || graph->values[value_id].kind != kValueTensor)
    refuse(ErrorCode::kVerification, where + ": value " + num(value_id) + " is not a tensor of the graph");
  return graph->values[value_id].tensor;
}

StepPlan plan_step(const Program& program, const StepSource& source, const DeviceCaps& caps) {
  const Method& method = program.main_method();
  const std::string where = program.source() + ": method '" + method.name + "'";
  const Graph& graph = *method.graph;
  for (size_t i = 0; i < method.instructions.size(); ++i)
    if (method.instructions[i].kind != kDelegateCall)
      refuse(ErrorCode::kUnsupported, where + ": instruction " + num(i) + " runs outside the delegate; the native "
                                              "runtime runs plans that are one vktrain delegate call");
  size_t n_inputs = graph.inputs.size();
  if (method.inputs.size() != n_inputs || method.delegate_args.size() < n_inputs ||
      !std::equal(method.inputs.begin(), method.inputs.end(), method.delegate_args.begin()))
    refuse(ErrorCode::kUnsupported, where + ": the plan's inputs are not the delegate's inputs in order");
  return plan_graph_step(graph, where, source, caps);
}

StepPlan plan_graph_step(const Graph& graph, const std::string& where, const StepSource& source, const DeviceCaps& caps,
                         const SharedTensors& shared) {
  StepPlan plan;
  plan.graph = &graph;
  plan.schedule = &source.schedule();
  plan.where = where;
  const Schedule& schedule = *plan.schedule;
  size_t n_inputs = graph.inputs.size();
  verify_schedule(schedule, &graph);
  check_requirements(schedule, caps);

  uint64_t total = 0;
  for (const auto& b : schedule.buffers) {
    if (b.role == kRoleShared) {  // another interpreter's tensor: bound, not allocated
      plan.buffer_sizes.push_back(bind_shared(plan, b, shared));
      continue;
    }
    if (b.size_bytes == 0) refuse(ErrorCode::kVerification, schedule.source + ": buffer '" + b.key + "' has 0 bytes");
    if (b.size_bytes > caps.memory_bytes || caps.memory_bytes - b.size_bytes < total)
      refuse(ErrorCode::kLimit, schedule.source + ": the buffer table needs more than the " + num(caps.memory_bytes) +
                                    " bytes of " + caps.name + "'s largest memory heap (buffer '" + b.key + "': " + num(b.size_bytes) + ")");
    total += b.size_bytes;
    plan.buffer_sizes.push_back((b.size_bytes + 3) / 4 * 4);  // device_objects.py check_buffer_size: whole words
  }
  for (const auto& p : schedule.placements) plan.placements[p.value_id] = {p.buffer, p.offset};
  check_shared_placements(plan, shared);
  // Every value the host writes or reads lies inside its buffer.
  auto check_host_range = [&](int32_t value_id, const std::string& what) {
    auto it = plan.placements.find(value_id);
    if (it == plan.placements.end())
      refuse(ErrorCode::kVerification, schedule.source + ": " + what + " (value " + num(value_id) + ") has no placement");
    uint64_t size = plan.buffer_sizes.at(it->second.buffer), bytes = plan.tensor(value_id).stored_nbytes();
    if (it->second.offset > size || bytes > size - it->second.offset)
      refuse(ErrorCode::kVerification, schedule.source + ": " + what + " (value " + num(value_id) + ") is placed at [" +
                                           num(it->second.offset) + ", " + sum(it->second.offset, bytes) + ") of buffer '" +
                                           schedule.buffers[it->second.buffer].key + "', which has " + num(size) + " bytes");
  };
  for (const auto& [value_id, placement] : plan.placements) {
    const Value& v = graph.values.at(value_id);
    if (v.kind != kValueTensor || v.tensor.constant_id < 0) continue;
    const std::string what = "constant " + (v.tensor.name.empty() ? num(value_id) : v.tensor.name);
    const Constant& c = graph.constants.at(v.tensor.constant_id);
    if (widened_size(c) < v.tensor.nbytes())
      refuse(ErrorCode::kVerification, plan.where + ": " + what + " holds " + num(widened_size(c)) + " bytes, its tensor reads " + num(v.tensor.nbytes()));
    check_host_range(value_id, what);
  }
  for (const auto& s : graph.mutable_state) {
    std::string name = plan.tensor(s.state_id).name.empty() ? "state" + num(s.state_id) : plan.tensor(s.state_id).name;
    for (const auto& other : plan.states)
      if (other.first == name) refuse(ErrorCode::kVerification, plan.where + ": two mutable state tensors are named '" + name + "'");
    if (s.initial_constant_id >= 0) {
      const Constant& c = graph.constants.at(s.initial_constant_id);
      if (c.synthetic || widened_size(c) < plan.tensor(s.state_id).nbytes())
        refuse(ErrorCode::kUnsupported, plan.where + ": the initial value of state '" + name + "' is synthetic or shorter than the state");
    }
    check_host_range(s.state_id, "state '" + name + "'");
    plan.states.push_back({name, s});
  }
  auto names = plan.input_names();
  for (size_t i = 0; i < n_inputs; ++i) check_host_range(graph.inputs[i], "input '" + names[i] + "'");
  for (int32_t id : graph.outputs) check_host_range(id, "output " + num(id));

  // executor.py _find_index_limits: inputs used as indices, followed through views.
  std::set<int32_t> inputs(graph.inputs.begin(), graph.inputs.end());
  for (size_t index = 0; index < graph.ops.size(); ++index) {
    const OpCall& op = graph.ops[index];
    int32_t indices = -1;
    IndexLimit limit{};
    auto emb = kEmbeddingIndexArg.find(op.name);
    if (emb != kEmbeddingIndexArg.end() && op.args.size() > size_t(emb->second) && !plan.tensor(op.args[0]).shape.empty()) {
      limit = {true, 0, plan.tensor(op.args[0]).shape[0], ""};
      limit.what = "row of the " + num(limit.bound) + "-row embedding of op " + num(index);
      indices = op.args[emb->second];
    } else if (op.name == kFusedCe && op.args.size() > 1 && !plan.tensor(op.args[0]).shape.empty()) {
      limit = {false, 0, plan.tensor(op.args[0]).shape.back(), ""};
      limit.what = "class of the " + num(limit.bound) + "-wide logits of op " + num(index) + " (fused_ce)";
      indices = op.args[1];
    }
    if (indices < 0) continue;
    if (plan.tensor(indices).is_view) indices = plan.tensor(indices).storage_of;
    if (inputs.count(indices)) plan.index_limits[indices].push_back(limit);
  }

  if (schedule.dispatches.empty()) refuse(ErrorCode::kVerification, schedule.source + ": the schedule has no dispatches");
  for (size_t i = 0; i < schedule.dispatches.size(); ++i) plan.dispatches.push_back(plan_dispatch(plan, source, caps, i));
  plan_barriers(&plan.dispatches);
  return plan;
}

}  // namespace vktrain
