#include "interpreter.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "constant_data.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr uint32_t kPushHeaderBytes = 16;  // dispatch.py PUSH_HEADER_BYTES
enum Access { kDeclared = 0, kRead = 1, kWrite = 2, kReadWrite = 3 };  // schema.fbs BindingAccess
const std::map<std::string, int> kEmbeddingIndexArg = {{"aten.embedding.default", 1},  // executor.py EMBEDDING_INDEX_ARG
                                                       {"vktrain.embedding_q8_0.default", 2}};
constexpr const char* kFusedCe = "vktrain.fused_ce.default";
const char* const kSubgroupOperations[] = {"basic", "vote", "arithmetic", "ballot", "shuffle", "shuffle_relative",
                                           "clustered", "quad"};  // device_profile.py, in VkSubgroupFeatureFlagBits order

std::string shape_text(const std::vector<int64_t>& shape) { return list(shape); }

[[noreturn]] void bad_input(const std::string& message) { refuse(ErrorCode::kVerification, message); }

// executor.py _to_stored_array: `array` (of the graph dtype) as the bytes stored for `t` (int64 -> int32, checked).
std::vector<uint8_t> to_stored(const uint8_t* data, uint64_t numel, const TensorValue& t, const std::string& what) {
  int stored = t.storage_dtype();
  if (stored == t.dtype) return std::vector<uint8_t>(data, data + numel * data_type_size(t.dtype));
  if (!(t.dtype == kInt64 && stored == kInt32))
    refuse(ErrorCode::kUnsupported, what + ": storing " + data_type_name(t.dtype) + " as " + data_type_name(stored) +
                                        " is not supported (only int64 as int32)");
  std::vector<uint8_t> out(numel * 4);
  int64_t low = INT64_MAX, high = INT64_MIN;
  for (uint64_t i = 0; i < numel; ++i) {
    int64_t v;
    std::memcpy(&v, data + 8 * i, 8);
    low = std::min(low, v);
    high = std::max(high, v);
    int32_t w = int32_t(v);
    std::memcpy(&out[4 * i], &w, 4);
  }
  if (numel && (low < INT32_MIN || high > INT32_MAX))
    bad_input(what + " holds values in [" + num(low) + ", " + num(high) + "]; int64 tensors are int32 on the GPU, so "
              "values must lie in [-2147483648, 2147483647]");
  return out;
}

// vk/schedule.py split_groups: (group offset, group count) chunks in x-fastest order.
std::vector<std::pair<std::array<uint32_t, 3>, std::array<uint32_t, 3>>> split_groups(
    const std::array<uint32_t, 3>& groups, const uint32_t max_counts[3], const std::string& where) {
  uint64_t pieces = 1;
  for (int a = 0; a < 3; ++a) pieces *= (uint64_t(groups[a]) + max_counts[a] - 1) / max_counts[a];
  if (pieces > kMaxSplitDispatches)
    refuse(ErrorCode::kVerification, where + ": its work groups would be split into " + num(pieces) +
                                         " dispatches; at most " + num(kMaxSplitDispatches) + " are recorded for one Dispatch");
  std::vector<std::pair<std::array<uint32_t, 3>, std::array<uint32_t, 3>>> chunks;
  for (uint64_t z = 0; z < groups[2]; z += max_counts[2])
    for (uint64_t y = 0; y < groups[1]; y += max_counts[1])
      for (uint64_t x = 0; x < groups[0]; x += max_counts[0])
        chunks.push_back({{uint32_t(x), uint32_t(y), uint32_t(z)},
                          {uint32_t(std::min<uint64_t>(max_counts[0], groups[0] - x)),
                           uint32_t(std::min<uint64_t>(max_counts[1], groups[1] - y)),
                           uint32_t(std::min<uint64_t>(max_counts[2], groups[2] - z))}});
  return chunks;
}

struct Access3 { uint32_t buffer; uint64_t start, end; bool reads, writes; };

// vk/schedule.py plan_barriers: whether a compute -> compute barrier must precede each dispatch.
std::vector<bool> plan_barriers(const std::vector<std::vector<Access3>>& accesses) {
  std::vector<bool> needed;
  std::map<uint32_t, std::vector<Access3>> pending_writes, pending_reads;
  auto overlaps = [](const Access3& a, const Access3& b) { return a.start < b.end && b.start < a.end; };
  for (const auto& current : accesses) {
    bool hazard = false;
    for (const auto& now : current) {
      auto check = [&](const std::map<uint32_t, std::vector<Access3>>& pending) {
        auto it = pending.find(now.buffer);
        if (it == pending.end()) return false;
        return std::any_of(it->second.begin(), it->second.end(), [&](const Access3& b) { return overlaps(now, b); });
      };
      if (check(pending_writes) || (now.writes && check(pending_reads))) { hazard = true; break; }
    }
    needed.push_back(hazard);
    if (hazard) { pending_writes.clear(); pending_reads.clear(); }
    for (const auto& now : current) {
      if (now.writes) pending_writes[now.buffer].push_back(now);
      if (now.reads) pending_reads[now.buffer].push_back(now);
    }
  }
  return needed;
}

// vk/pipelines.py pack_specialization: a value packed as the type the shader declares.
uint32_t spec_word(const std::string& where, uint32_t id, SpecKind kind, int64_t int_value, double float_value,
                   const ShaderInterface& interface) {
  auto it = interface.spec_types.find(id);
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, where + ": " + why); };
  if (it == interface.spec_types.end()) bad("the shader has no specialization constant with id " + num(id));
  uint32_t word = 0;
  switch (it->second) {
    case SpecType::kFloat: {
      if (kind == SpecKind::kBool) bad("spec constant " + num(id) + " is float, got a bool");
      float f = kind == SpecKind::kFloat ? float(float_value) : float(double(int_value));
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

}  // namespace

uint64_t HostTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

template <typename T> T HostTensor::item(size_t i) const {
  T v;
  std::memcpy(&v, data.data() + i * sizeof(T), sizeof(T));
  return v;
}
template float HostTensor::item<float>(size_t) const;
template int64_t HostTensor::item<int64_t>(size_t) const;
template int32_t HostTensor::item<int32_t>(size_t) const;

StepInterpreter::StepInterpreter(const Program& program, const StepSource& source, Device& device)
    : schedule_(source.schedule()), source_(source), device_(device) {
  const Method& method = program.main_method();
  graph_ = method.graph.get();
  const std::string where = program.source() + ": method '" + method.name + "'";
  if (!graph_) refuse(ErrorCode::kUnsupported, where + " has no vktrain delegate");
  for (size_t i = 0; i < method.instructions.size(); ++i)
    if (method.instructions[i].kind != kDelegateCall)
      refuse(ErrorCode::kUnsupported, where + ": instruction " + num(i) + " runs outside the delegate; the native runtime "
                                              "runs plans that are one vktrain delegate call");
  size_t n_inputs = graph_->inputs.size();
  if (method.inputs.size() != n_inputs || method.delegate_args.size() < n_inputs ||
      !std::equal(method.inputs.begin(), method.inputs.end(), method.delegate_args.begin()))
    refuse(ErrorCode::kUnsupported, where + ": the plan's inputs are not the delegate's inputs in order");
  verify_schedule(schedule_, graph_);
  check_requirements();

  for (const auto& p : schedule_.placements) placements_[p.value_id] = {p.buffer, p.offset};
  for (const auto& s : graph_->mutable_state) {
    std::string name = tensor(s.state_id).name.empty() ? "state" + num(s.state_id) : tensor(s.state_id).name;
    for (const auto& [other, _] : states_)
      if (other == name) refuse(ErrorCode::kVerification, where + ": two mutable state tensors are named '" + name + "'");
    if (!placements_.count(s.state_id))
      refuse(ErrorCode::kVerification, schedule_.source + ": state '" + name + "' (value " + num(s.state_id) + ") has no placement");
    states_.push_back({name, s});
  }
  // executor.py _find_index_limits: inputs used as indices, followed through views.
  std::set<int32_t> inputs(graph_->inputs.begin(), graph_->inputs.end());
  for (size_t index = 0; index < graph_->ops.size(); ++index) {
    const OpCall& op = graph_->ops[index];
    int32_t indices = -1;
    IndexLimit limit{};
    auto emb = kEmbeddingIndexArg.find(op.name);
    if (emb != kEmbeddingIndexArg.end() && op.args.size() > size_t(emb->second) && !tensor(op.args[0]).shape.empty()) {
      limit = {true, 0, tensor(op.args[0]).shape[0], ""};
      limit.what = "row of the " + num(limit.bound) + "-row embedding of op " + num(index);
      indices = op.args[emb->second];
    } else if (op.name == kFusedCe && op.args.size() > 1 && !tensor(op.args[0]).shape.empty()) {
      limit = {false, 0, tensor(op.args[0]).shape.back(), ""};
      limit.what = "class of the " + num(limit.bound) + "-wide logits of op " + num(index) + " (fused_ce)";
      indices = op.args[1];
    }
    if (indices < 0) continue;
    if (tensor(indices).is_view) indices = tensor(indices).storage_of;
    if (inputs.count(indices)) index_limits_[indices].push_back(limit);
  }

  try {
    for (const auto& b : schedule_.buffers) {
      if (b.role == 2)  // SHARED: another executor's tensor; this step runs alone
        refuse(ErrorCode::kUnsupported, schedule_.source + ": buffer '" + b.key + "' is shared with another method's "
                                                           "executor; the native runtime runs one training step");
      buffers_.push_back(std::make_unique<Buffer>(device_, b.size_bytes, b.key));
    }
    upload_constants();
    reset_state();
    pipelines_ = std::make_unique<PipelineCache>(device_);
    record();
    device_.check_validation("while loading " + program.source());
  } catch (...) {
    release();
    throw;
  }
}

StepInterpreter::~StepInterpreter() { release(); }

void StepInterpreter::release() {
  VkDevice d = device_.handle();
  if (d) vkDeviceWaitIdle(d);
  if (fence_) vkDestroyFence(d, fence_, nullptr);
  if (command_buffer_) vkFreeCommandBuffers(d, device_.command_pool(), 1, &command_buffer_);
  if (descriptor_pool_) vkDestroyDescriptorPool(d, descriptor_pool_, nullptr);
  fence_ = VK_NULL_HANDLE;
  command_buffer_ = VK_NULL_HANDLE;
  descriptor_pool_ = VK_NULL_HANDLE;
  pipelines_.reset();
  buffers_.clear();
}

const TensorValue& StepInterpreter::tensor(int32_t value_id) const {
  if (value_id < 0 || size_t(value_id) >= graph_->values.size() || graph_->values[value_id].kind != kValueTensor)
    refuse(ErrorCode::kVerification, "value " + num(value_id) + " is not a tensor of the graph");
  return graph_->values[value_id].tensor;
}

void StepInterpreter::check_requirements() const {
  // schedule.py ScheduleRequirements.unmet_by, against this device.
  const auto& q = schedule_.requirements;
  const auto& l = device_.limits();
  std::vector<std::string> missing;
  if (q.api != "vulkan") missing.push_back("the schedule is for the " + q.api + " runtime, the device is vulkan");
  auto at_least = [&](const char* name, uint64_t want, uint64_t have) {
    if (have < want) missing.push_back(std::string(name) + " " + num(want) + " (the device has " + num(have) + ")");
  };
  at_least("max_storage_buffer_range", q.max_storage_buffer_range, l.maxStorageBufferRange);
  at_least("max_shared_memory_bytes", q.max_shared_memory_bytes, l.maxComputeSharedMemorySize);
  at_least("max_workgroup_invocations", q.max_workgroup_invocations, l.maxComputeWorkGroupInvocations);
  at_least("max_workgroup_size_x", q.max_workgroup_size_x, l.maxComputeWorkGroupSize[0]);
  uint64_t alignment = l.minStorageBufferOffsetAlignment;
  if (alignment == 0 || q.min_storage_buffer_offset_alignment % alignment)
    missing.push_back("a min_storage_buffer_offset_alignment dividing " + num(q.min_storage_buffer_offset_alignment) +
                      " (the device's is " + num(alignment) + ")");
  if (q.subgroup_size && q.subgroup_size != device_.subgroup_size())
    missing.push_back("subgroups of " + num(q.subgroup_size) + " lanes (the device's have " + num(device_.subgroup_size()) + ")");
  for (const auto& op : q.subgroup_operations) {
    bool have = false;
    for (int bit = 0; bit < 8; ++bit)
      if (op == kSubgroupOperations[bit]) have = device_.subgroup_operations() & (1u << bit);
    if (!have) missing.push_back("subgroup operation " + op);
  }
  if (q.float16 && !device_.has_feature("shaderFloat16")) missing.push_back("float16");
  if (q.int64 && !device_.has_feature("shaderInt64")) missing.push_back("int64");
  if (!q.cooperative_matrix.empty()) missing.push_back("cooperative matrices (the native runtime does not enable them yet)");
  if (missing.empty()) return;
  std::string all;
  for (const auto& m : missing) all += (all.empty() ? "" : "; ") + m;
  refuse(ErrorCode::kUnsupported, schedule_.source + ": the schedule does not fit " + device_.name() + ": it relies on " + all);
}

void StepInterpreter::upload_constants() {
  // executor.py _upload_constants: the first constant placed in each buffer, in value-id order.
  std::set<uint32_t> uploaded;
  for (const auto& [value_id, placement] : placements_) {
    const Value& v = graph_->values.at(value_id);
    if (v.kind != kValueTensor || v.tensor.constant_id < 0 || uploaded.count(placement.buffer)) continue;
    const TensorValue& t = v.tensor;
    const std::string what = "constant " + (t.name.empty() ? num(value_id) : t.name);
    std::vector<uint8_t> bytes = constant_bytes(graph_->constants.at(t.constant_id), what);
    if (bytes.size() < t.nbytes())
      refuse(ErrorCode::kVerification, what + " has " + num(bytes.size()) + " bytes, its tensor reads " + num(t.nbytes()));
    std::vector<uint8_t> stored = to_stored(bytes.data(), t.numel, t, what);
    buffers_[placement.buffer]->write(placement.offset, stored.data(), stored.size());
    uploaded.insert(placement.buffer);
  }
}

void StepInterpreter::reset_state() {
  // executor.py reset_state / initial_state: zeros, or the initial constant's values.
  for (const auto& [name, s] : states_) {
    const TensorValue& t = tensor(s.state_id);
    HostTensor initial{t.dtype, t.shape, std::vector<uint8_t>(t.nbytes(), 0)};
    if (s.initial_constant_id >= 0) {
      std::vector<uint8_t> bytes = constant_bytes(graph_->constants.at(s.initial_constant_id), "the initial value of state '" + name + "'");
      if (bytes.size() < t.nbytes())
        refuse(ErrorCode::kVerification, "state '" + name + "': its initial constant has " + num(bytes.size()) +
                                             " bytes, the tensor " + num(t.nbytes()));
      std::memcpy(initial.data.data(), bytes.data(), t.nbytes());
    }
    write_value(s.state_id, initial, "state '" + name + "'");
  }
}

void StepInterpreter::write_value(int32_t value_id, const HostTensor& array, const std::string& what) {
  const TensorValue& t = tensor(value_id);
  if (array.shape != t.shape)
    bad_input(what + " has shape " + shape_text(array.shape) + ", expected " + shape_text(t.shape));
  if (array.dtype != t.dtype)
    bad_input(what + " holds " + data_type_name(array.dtype) + ", the graph expects " + data_type_name(t.dtype));
  if (array.data.size() != t.nbytes()) refuse(ErrorCode::kInternal, what + ": " + num(array.data.size()) + " bytes for " + num(t.nbytes()));
  std::vector<uint8_t> stored = to_stored(array.data.data(), t.numel, t, what);
  auto it = placements_.find(value_id);
  if (it == placements_.end()) refuse(ErrorCode::kVerification, what + " (value " + num(value_id) + ") has no placement in the schedule");
  auto limits = index_limits_.find(value_id);
  if (limits != index_limits_.end() && t.numel) {
    for (uint64_t i = 0; i < t.numel; ++i) {
      int64_t v = t.storage_dtype() == kInt32 ? int64_t(reinterpret_cast<const int32_t*>(stored.data())[i])
                                              : array.item<int64_t>(i);
      for (const auto& limit : limits->second)
        if (v >= limit.bound || (limit.has_low && v < limit.low))
          bad_input(what + " holds " + num(v) + " at flat position " + num(i) + ", but it must be a " + limit.what + " (" +
                    (limit.has_low ? "[" + num(limit.low) + ", " + num(limit.bound) + ")" : "< " + num(limit.bound)) + ")");
    }
  }
  buffers_[it->second.buffer]->write(it->second.offset, stored.data(), stored.size());
}

HostTensor StepInterpreter::read_value(int32_t value_id) const {
  const TensorValue& t = tensor(value_id);
  const Placement& p = placements_.at(value_id);
  HostTensor out{t.dtype, t.shape, std::vector<uint8_t>(t.nbytes())};
  if (t.storage_dtype() == t.dtype) {
    buffers_[p.buffer]->read(p.offset, out.data.data(), out.data.size());
  } else {  // int32 on the device -> int64
    std::vector<int32_t> stored(t.numel);
    buffers_[p.buffer]->read(p.offset, stored.data(), stored.size() * 4);
    for (uint64_t i = 0; i < t.numel; ++i) {
      int64_t v = stored[i];
      std::memcpy(&out.data[8 * i], &v, 8);
    }
  }
  return out;
}

std::vector<std::string> StepInterpreter::input_names() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < graph_->inputs.size(); ++i)
    names.push_back(input(i).name.empty() ? "input" + num(i) : input(i).name);
  return names;
}

std::vector<std::string> StepInterpreter::state_names() const {
  std::vector<std::string> names;
  for (const auto& [name, _] : states_) names.push_back(name);
  return names;
}

int64_t StepInterpreter::index_bound(const std::string& input_name) const {
  auto names = input_names();
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = index_limits_.find(graph_->inputs[i]);
    if (names[i] != input_name || it == index_limits_.end()) continue;
    int64_t bound = INT64_MAX;
    for (const auto& l : it->second) bound = std::min(bound, l.bound);
    return bound;
  }
  return 0;
}

uint64_t StepInterpreter::allocated_bytes() const {
  uint64_t total = 0;
  for (const auto& b : buffers_) total += b->size();
  return total;
}

HostTensor StepInterpreter::read_state(const std::string& name) const {
  for (const auto& [n, s] : states_)
    if (n == name) return read_value(s.state_id);
  refuse(ErrorCode::kVerification, "no mutable state named '" + name + "'");
}

std::vector<HostTensor> StepInterpreter::run(const std::vector<HostTensor>& inputs) {
  auto names = input_names();
  if (inputs.size() != names.size())
    bad_input("the graph takes " + num(names.size()) + " inputs, got " + num(inputs.size()));
  for (size_t i = 0; i < inputs.size(); ++i) write_value(graph_->inputs[i], inputs[i], "input '" + names[i] + "'");
  device_.submit_and_wait(command_buffer_, fence_);
  device_.check_validation("while running the step");
  std::vector<HostTensor> outputs;
  for (int32_t id : graph_->outputs) outputs.push_back(read_value(id));
  return outputs;
}

void StepInterpreter::record() {
  // vk/commands.py Program._plan for every dispatch, then _record.
  struct Planned {
    const Pipeline* pipeline;
    std::vector<VkDescriptorBufferInfo> buffers;
    std::vector<std::pair<std::array<uint32_t, 3>, std::array<uint32_t, 3>>> chunks;
    bool header;
    const ScheduleDispatch* dispatch;
  };
  const auto& limits = device_.limits();
  std::map<std::string, std::pair<std::vector<uint32_t>, ShaderInterface>> shaders;
  std::vector<Planned> planned;
  std::vector<std::vector<Access3>> accesses;
  uint32_t total_bindings = 0;
  for (size_t i = 0; i < schedule_.dispatches.size(); ++i) {
    const ScheduleDispatch& d = schedule_.dispatches[i];
    const std::string where = schedule_.source + ": dispatch #" + num(i) + " '" + d.name() + "'";
    auto found = shaders.find(d.shader);
    if (found == shaders.end()) {
      std::vector<uint32_t> code = source_.module(d.shader);
      ShaderInterface interface = reflect_spirv(code, "shader '" + d.shader + "'");
      for (const auto& b : interface.bindings) {
        if (b.set != 0) refuse(ErrorCode::kShaderModule, "shader '" + d.shader + "' uses descriptor set " + num(b.set) + "; vktrain shaders bind every buffer in set 0");
        if (b.uniform) refuse(ErrorCode::kShaderModule, "shader '" + d.shader + "' declares a uniform block at binding " + num(b.binding) + "; vktrain binds storage buffers only");
      }
      for (size_t k = 0; k < interface.bindings.size(); ++k)
        if (interface.bindings[k].binding != k)
          refuse(ErrorCode::kShaderModule, "shader '" + d.shader + "' does not number its bindings 0..n-1");
      found = shaders.emplace(d.shader, std::make_pair(std::move(code), std::move(interface))).first;
    }
    const ShaderInterface& interface = found->second.second;
    auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, where + ": " + why); };
    if (d.bindings.size() != interface.bindings.size())
      bad("shader '" + d.shader + "' declares " + num(interface.bindings.size()) + " storage buffers but the Dispatch binds " + num(d.bindings.size()));
    Planned p{nullptr, {}, {}, interface.has_group_offset_header, &d};
    std::vector<Access3> access;
    for (size_t k = 0; k < d.bindings.size(); ++k) {
      const ScheduleBinding& b = d.bindings[k];
      const Buffer& buffer = *buffers_.at(b.buffer);  // the reader checked the index
      const std::string which = where + ": binding " + num(k) + " ('" + buffer.name() + "')";
      if (b.offset >= buffer.size())
        refuse(ErrorCode::kVerification, which + " offset " + num(b.offset) + " is outside the buffer's " + num(buffer.size()) + " bytes");
      uint64_t size = b.size_bytes ? b.size_bytes : buffer.size() - b.offset;
      if (b.offset % limits.minStorageBufferOffsetAlignment)
        refuse(ErrorCode::kVerification, which + " offset " + num(b.offset) + " is not a multiple of the device's minStorageBufferOffsetAlignment (" + num(limits.minStorageBufferOffsetAlignment) + ")");
      if (size > buffer.size() - b.offset)
        refuse(ErrorCode::kVerification, which + " range [" + num(b.offset) + ", " + sum(b.offset, size) + ") is outside the buffer's " + num(buffer.size()) + " bytes");
      if (size > limits.maxStorageBufferRange)
        refuse(ErrorCode::kUnsupported, which + " spans " + num(size) + " bytes, more than the device's maxStorageBufferRange of " + num(limits.maxStorageBufferRange));
      bool reads = b.access == kDeclared ? !interface.bindings[k].writeonly : (b.access & kRead) != 0;
      bool writes = b.access == kDeclared ? !interface.bindings[k].readonly : (b.access & kWrite) != 0;
      p.buffers.push_back({buffer.handle(), b.offset, size});
      access.push_back({b.buffer, b.offset, b.offset + size, reads, writes});
    }
    uint32_t push_size = (p.header ? kPushHeaderBytes : 0) + uint32_t(d.push_constants.size());
    if (interface.push_constant_size >= 0 && int64_t(push_size) != interface.push_constant_size)
      bad("shader '" + d.shader + "' expects " + num(interface.push_constant_size - (p.header ? kPushHeaderBytes : 0)) +
          " bytes of push constants" + (p.header ? " after the 16-byte group-offset header" : "") + ", the Dispatch gives " +
          num(d.push_constants.size()));
    std::vector<std::pair<uint32_t, uint32_t>> specialization;  // Dispatch.specialization(), sorted by id
    std::map<uint32_t, uint32_t> words;
    for (const auto& s : d.spec_constants)
      words[s.id] = spec_word(where, s.id, s.kind, s.int_value, s.float_value, interface);
    if (!d.local_size.empty()) {
      uint64_t invocations = 1;
      for (uint32_t axis = 0; axis < 3; ++axis) {
        bool declared = interface.spec_types.count(axis) > 0;
        if (!declared && d.local_size[axis] != 1)
          bad("local_size " + list(d.local_size) + " but the shader does not take its local size " + "xyz"[axis] +
              " from specialization constant " + num(axis));
        if (d.local_size[axis] > limits.maxComputeWorkGroupSize[axis])
          refuse(ErrorCode::kUnsupported, where + ": local_size " + list(d.local_size) + " exceeds the device's maxComputeWorkGroupSize");
        invocations *= d.local_size[axis];
        if (declared) words[axis] = spec_word(where, axis, SpecKind::kInt, d.local_size[axis], 0, interface);
      }
      if (invocations > limits.maxComputeWorkGroupInvocations)
        refuse(ErrorCode::kUnsupported, where + ": local_size " + list(d.local_size) + " exceeds the device's maxComputeWorkGroupInvocations");
    }
    for (const auto& [id, word] : words) specialization.push_back({id, word});
    p.chunks = split_groups(d.groups, limits.maxComputeWorkGroupCount, where);
    if (p.chunks.size() > 1 && !p.header)
      bad("its work groups exceed the device's per-axis limit and shader '" + d.shader + "' cannot be split (its "
          "push-constant block does not start with VKTRAIN_PUSH_HEADER)");
    p.pipeline = &pipelines_->get(d.shader, found->second.first, interface, specialization, push_size);
    total_bindings += uint32_t(p.buffers.size());
    planned.push_back(std::move(p));
    accesses.push_back(std::move(access));
  }
  if (planned.empty()) refuse(ErrorCode::kVerification, schedule_.source + ": the schedule has no dispatches");
  std::vector<bool> barriers = plan_barriers(accesses);

  VkDevice dev = device_.handle();
  VkDescriptorPoolSize pool_size{VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, std::max<uint32_t>(total_bindings, 1)};
  VkDescriptorPoolCreateInfo pool_info{VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
  pool_info.maxSets = uint32_t(planned.size());
  pool_info.poolSizeCount = 1;
  pool_info.pPoolSizes = &pool_size;
  vk_check(vkCreateDescriptorPool(dev, &pool_info, nullptr, &descriptor_pool_), "vkCreateDescriptorPool");
  std::vector<VkDescriptorSetLayout> layouts;
  for (const auto& p : planned) layouts.push_back(p.pipeline->set_layout);
  std::vector<VkDescriptorSet> sets(planned.size());
  VkDescriptorSetAllocateInfo alloc{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
  alloc.descriptorPool = descriptor_pool_;
  alloc.descriptorSetCount = uint32_t(layouts.size());
  alloc.pSetLayouts = layouts.data();
  vk_check(vkAllocateDescriptorSets(dev, &alloc, sets.data()), "vkAllocateDescriptorSets");
  for (size_t i = 0; i < planned.size(); ++i) {
    std::vector<VkWriteDescriptorSet> writes;
    for (uint32_t b = 0; b < planned[i].buffers.size(); ++b) {
      VkWriteDescriptorSet w{VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET};
      w.dstSet = sets[i];
      w.dstBinding = b;
      w.descriptorCount = 1;
      w.descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
      w.pBufferInfo = &planned[i].buffers[b];
      writes.push_back(w);
    }
    if (!writes.empty()) vkUpdateDescriptorSets(dev, uint32_t(writes.size()), writes.data(), 0, nullptr);
  }

  command_buffer_ = allocate_command_buffer(device_);
  begin_command_buffer(command_buffer_);
  VkCommandBuffer cb = command_buffer_;
  const VkAccessFlags compute_rw = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT;
  // Host writes, staging copies and the previous replay must be visible to this one.
  memory_barrier(cb, VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                 VK_ACCESS_HOST_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_SHADER_WRITE_BIT,
                 VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw);
  const Pipeline* bound = nullptr;
  for (size_t i = 0; i < planned.size(); ++i) {
    const Planned& p = planned[i];
    if (barriers[i]) {
      memory_barrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw);
      ++barrier_count_;
    }
    if (p.pipeline != bound) {
      vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, p.pipeline->handle);
      bound = p.pipeline;
    }
    vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, p.pipeline->layout, 0, 1, &sets[i], 0, nullptr);
    for (const auto& [offset, counts] : p.chunks) {
      std::vector<uint8_t> push;
      if (p.header) {
        uint32_t header[4] = {offset[0], offset[1], offset[2], 0};
        push.resize(kPushHeaderBytes);
        std::memcpy(push.data(), header, kPushHeaderBytes);
      }
      push.insert(push.end(), p.dispatch->push_constants.begin(), p.dispatch->push_constants.end());
      if (!push.empty())
        vkCmdPushConstants(cb, p.pipeline->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, uint32_t(push.size()), push.data());
      vkCmdDispatch(cb, counts[0], counts[1], counts[2]);
      ++dispatch_count_;
    }
  }
  // Results must be visible to the host (mapped reads) and to transfers (staging downloads).
  memory_barrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, VK_ACCESS_SHADER_WRITE_BIT,
                 VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
                 VK_ACCESS_HOST_READ_BIT | VK_ACCESS_TRANSFER_READ_BIT | VK_ACCESS_TRANSFER_WRITE_BIT);
  vk_check(vkEndCommandBuffer(cb), "vkEndCommandBuffer");
  fence_ = create_fence(device_);
}

}  // namespace vktrain
