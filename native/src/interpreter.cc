#include "interpreter.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "constant_data.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr uint32_t kPushHeaderBytes = 16;  // dispatch.py PUSH_HEADER_BYTES

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

DeviceCaps caps_of(const Device& device) {
  const VkPhysicalDeviceLimits& l = device.limits();
  DeviceCaps c;
  c.name = device.name();
  c.max_storage_buffer_range = l.maxStorageBufferRange;
  c.min_storage_buffer_offset_alignment = uint32_t(l.minStorageBufferOffsetAlignment);
  for (int a = 0; a < 3; ++a) {
    c.max_group_count[a] = l.maxComputeWorkGroupCount[a];
    c.max_workgroup_size[a] = l.maxComputeWorkGroupSize[a];
  }
  c.max_workgroup_invocations = l.maxComputeWorkGroupInvocations;
  c.max_shared_memory_bytes = l.maxComputeSharedMemorySize;
  c.max_push_constants_size = l.maxPushConstantsSize;
  c.subgroup_size = device.subgroup_size();
  c.subgroup_operations = device.subgroup_operations();
  c.float16 = device.has_feature("shaderFloat16");
  c.int64 = device.has_feature("shaderInt64");
  c.memory_bytes = device.largest_heap_bytes();
  c.api_version = device.api_version();
  for (const char* f : {"shaderInt64", "shaderInt16", "shaderFloat64", "robustBufferAccess", "storageBuffer16BitAccess",
                        "uniformAndStorageBuffer16BitAccess", "storageBuffer8BitAccess", "uniformAndStorageBuffer8BitAccess",
                        "shaderFloat16", "shaderInt8", "bufferDeviceAddress", "scalarBlockLayout", "vulkanMemoryModel",
                        "vulkanMemoryModelDeviceScope", "cooperativeMatrix"})
    if (device.has_feature(f)) c.features.insert(f);
  for (const CoopmatProperty& p : device.cooperative_matrix())  // float16 (0) x float16 + float32 (1) -> float32, subgroup (3)
    if (p.a_type == 0 && p.b_type == 0 && p.c_type == 1 && p.result_type == 1 && p.scope == 3)
      c.coopmat_f16.push_back({int64_t(p.m), int64_t(p.n), int64_t(p.k)});
  return c;
}

StepInterpreter::StepInterpreter(const Program& program, const StepSource& source, Device& device)
    : plan_(plan_step(program, source, caps_of(device))), device_(device) {
  load(program.source(), nullptr);
}

StepInterpreter::StepInterpreter(const Graph& graph, const std::string& where, const StepSource& source, Device& device,
                                 const StepInterpreter* owner)
    : plan_(plan_graph_step(graph, where, source, caps_of(device), owner ? owner->shared_tensors() : SharedTensors{})),
      device_(device) {
  if (owner && &owner->device_ != &device) refuse(ErrorCode::kInternal, where + ": bound to an interpreter on another device");
  load(where, owner);
}

void StepInterpreter::load(const std::string& what, const StepInterpreter* owner) {
  try {
    for (size_t i = 0; i < plan_.schedule->buffers.size(); ++i) {
      auto borrowed = plan_.borrowed.find(uint32_t(i));
      if (borrowed != plan_.borrowed.end()) {
        buffers_.push_back(nullptr);
        bound_.push_back(owner->bound_.at(borrowed->second));
        continue;
      }
      buffers_.push_back(std::make_unique<Buffer>(device_, plan_.buffer_sizes[i], plan_.schedule->buffers[i].key));
      bound_.push_back(buffers_.back().get());
    }
    upload_constants();
    reset_state();
    pipelines_ = std::make_unique<PipelineCache>(device_);
    record();
    device_.check_validation("while loading " + what);
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
  if (timestamps_) vkDestroyQueryPool(d, timestamps_, nullptr);
  timestamps_ = VK_NULL_HANDLE;
  if (command_buffer_) vkFreeCommandBuffers(d, device_.command_pool(), 1, &command_buffer_);
  if (descriptor_pool_) vkDestroyDescriptorPool(d, descriptor_pool_, nullptr);
  fence_ = VK_NULL_HANDLE;
  command_buffer_ = VK_NULL_HANDLE;
  descriptor_pool_ = VK_NULL_HANDLE;
  pipelines_.reset();
  bound_.clear();
  buffers_.clear();
}

void StepInterpreter::upload_constants() {
  // executor.py _upload_constants: the first constant placed in each buffer, in value-id order.
  std::set<uint32_t> uploaded;
  for (const auto& [value_id, placement] : plan_.placements) {
    const Value& v = plan_.graph->values.at(value_id);
    if (v.kind != kValueTensor || v.tensor.constant_id < 0 || uploaded.count(placement.buffer) ||
        plan_.borrowed.count(placement.buffer))  // the owner's: uploaded by it (and the state, trained)
      continue;
    const TensorValue& t = v.tensor;
    const std::string what = "constant " + (t.name.empty() ? num(value_id) : t.name);
    // A piece at a time (stream_constant): the host holds one piece of a constant, never all of it.
    const size_t element = size_t(data_type_size(t.dtype));
    uint64_t offset = placement.offset;
    Buffer& buffer = *bound_[placement.buffer];
    stream_constant(plan_.graph->constants.at(t.constant_id), t.nbytes(), what, [&](const uint8_t* p, uint64_t n) {
      if (t.storage_dtype() == t.dtype) {
        buffer.write(offset, p, n);
        offset += n;
      } else {
        std::vector<uint8_t> stored = to_stored(p, n / element, t, what);
        buffer.write(offset, stored.data(), stored.size());
        offset += stored.size();
      }
    });
    uploaded.insert(placement.buffer);
  }
}

void StepInterpreter::reset_state() {
  // executor.py reset_state / initial_state: zeros, or the initial constant's values.
  for (const auto& [name, s] : plan_.states) {
    if (plan_.borrowed.count(plan_.placements.at(s.state_id).buffer)) continue;  // the owner's state
    const TensorValue& t = plan_.tensor(s.state_id);
    HostTensor initial{t.dtype, t.shape, std::vector<uint8_t>(t.nbytes(), 0)};
    if (s.initial_constant_id >= 0) {
      std::vector<uint8_t> bytes = constant_bytes(plan_.graph->constants.at(s.initial_constant_id), "the initial value of state '" + name + "'");
      if (bytes.size() < t.nbytes())
        refuse(ErrorCode::kVerification, "state '" + name + "': its initial constant has " + num(bytes.size()) +
                                             " bytes, the tensor " + num(t.nbytes()));
      std::memcpy(initial.data.data(), bytes.data(), t.nbytes());
    }
    write_value(s.state_id, initial, "state '" + name + "'");
  }
}

void StepInterpreter::write_value(int32_t value_id, const HostTensor& array, const std::string& what) {
  const TensorValue& t = plan_.tensor(value_id);
  if (array.shape != t.shape)
    bad_input(what + " has shape " + shape_text(array.shape) + ", expected " + shape_text(t.shape));
  if (array.dtype != t.dtype)
    bad_input(what + " holds " + data_type_name(array.dtype) + ", the graph expects " + data_type_name(t.dtype));
  if (array.data.size() != t.nbytes()) refuse(ErrorCode::kInternal, what + ": " + num(array.data.size()) + " bytes for " + num(t.nbytes()));
  std::vector<uint8_t> stored = to_stored(array.data.data(), t.numel, t, what);
  auto it = plan_.placements.find(value_id);
  if (it == plan_.placements.end()) refuse(ErrorCode::kVerification, what + " (value " + num(value_id) + ") has no placement in the schedule");
  auto limits = plan_.index_limits.find(value_id);
  int stored_dtype = t.storage_dtype();
  if (limits != plan_.index_limits.end() && (stored_dtype == kInt32 || stored_dtype == kInt64)) {
    for (uint64_t i = 0; i < t.numel; ++i) {
      int64_t v;
      if (stored_dtype == kInt32) {
        int32_t w;
        std::memcpy(&w, stored.data() + 4 * i, 4);
        v = w;
      } else {
        std::memcpy(&v, stored.data() + 8 * i, 8);
      }
      for (const auto& limit : limits->second)
        if (v >= limit.bound || (limit.has_low && v < limit.low))
          bad_input(what + " holds " + num(v) + " at flat position " + num(i) + ", but it must be a " + limit.what + " (" +
                    (limit.has_low ? "[" + num(limit.low) + ", " + num(limit.bound) + ")" : "< " + num(limit.bound)) + ")");
    }
  }
  bound_[it->second.buffer]->write(it->second.offset, stored.data(), stored.size());
}

HostTensor StepInterpreter::read_value(int32_t value_id) const {
  const TensorValue& t = plan_.tensor(value_id);
  const Placement& p = plan_.placements.at(value_id);
  HostTensor out{t.dtype, t.shape, std::vector<uint8_t>(t.nbytes())};
  if (t.storage_dtype() == t.dtype) {
    bound_[p.buffer]->read(p.offset, out.data.data(), out.data.size());
  } else {  // int32 on the device -> int64
    std::vector<int32_t> stored(t.numel);
    bound_[p.buffer]->read(p.offset, stored.data(), stored.size() * 4);
    for (uint64_t i = 0; i < t.numel; ++i) {
      int64_t v = stored[i];
      std::memcpy(&out.data[8 * i], &v, 8);
    }
  }
  return out;
}

std::vector<std::string> StepInterpreter::state_names() const {
  std::vector<std::string> names;
  for (const auto& [name, _] : plan_.states) names.push_back(name);
  return names;
}

int64_t StepInterpreter::index_bound(const std::string& input_name) const {
  auto names = input_names();
  for (size_t i = 0; i < names.size(); ++i) {
    auto it = plan_.index_limits.find(plan_.graph->inputs[i]);
    if (names[i] != input_name || it == plan_.index_limits.end()) continue;
    int64_t bound = INT64_MAX;
    for (const auto& l : it->second) bound = std::min(bound, l.bound);
    return bound;
  }
  return 0;
}

uint64_t StepInterpreter::barrier_count() const {
  return std::count_if(plan_.dispatches.begin(), plan_.dispatches.end(), [](const PlannedDispatch& d) { return d.barrier; });
}

uint64_t StepInterpreter::allocated_bytes() const {
  uint64_t total = 0;
  for (const auto& b : buffers_)
    if (b) total += b->size();
  return total;
}

SharedTensors StepInterpreter::shared_tensors() const {
  SharedTensors shared;
  for (const auto& [name, s] : plan_.states) {
    const Placement& p = plan_.placements.at(s.state_id);
    shared[name] = {p.buffer, p.offset, plan_.buffer_sizes.at(p.buffer), &plan_.tensor(s.state_id), nullptr};
  }
  std::map<std::string, int> seen;  // a name two constants carry is left out (executor.py shared_constants)
  for (const auto& [value_id, p] : plan_.placements) {
    const TensorValue& t = plan_.tensor(value_id);
    if (t.constant_id >= 0 && !t.name.empty() && t.storage_of < 0 && !plan_.borrowed.count(p.buffer)) ++seen[t.name];
  }
  for (const auto& [value_id, p] : plan_.placements) {
    const TensorValue& t = plan_.tensor(value_id);
    if (t.constant_id < 0 || t.name.empty() || t.storage_of >= 0 || plan_.borrowed.count(p.buffer) || seen[t.name] != 1 ||
        shared.count(t.name))
      continue;
    shared[t.name] = {p.buffer, p.offset, plan_.buffer_sizes.at(p.buffer), &t, &plan_.graph->constants.at(t.constant_id)};
  }
  return shared;
}

HostTensor StepInterpreter::read_state(const std::string& name) const {
  for (const auto& [n, s] : plan_.states)
    if (n == name) return read_value(s.state_id);
  refuse(ErrorCode::kVerification, "no mutable state named '" + name + "'");
}

void StepInterpreter::write_state(const std::string& name, const HostTensor& value) {
  for (const auto& [n, s] : plan_.states)
    if (n == name) return write_value(s.state_id, value, "state '" + name + "'");
  refuse(ErrorCode::kVerification, "no mutable state named '" + name + "'");
}

std::vector<HostTensor> StepInterpreter::run(const std::vector<HostTensor>& inputs) {
  auto names = input_names();
  if (inputs.size() != names.size())
    bad_input("the graph takes " + num(names.size()) + " inputs, got " + num(inputs.size()));
  for (size_t i = 0; i < inputs.size(); ++i) write_value(plan_.graph->inputs[i], inputs[i], "input '" + names[i] + "'");
  device_.submit_and_wait(command_buffer_, fence_);
  device_.check_validation("while running the step");
  if (timestamps_) {
    uint64_t ticks[2] = {0, 0};
    vk_check(vkGetQueryPoolResults(device_.handle(), timestamps_, 0, 2, sizeof ticks, ticks, 8,
                                   VK_QUERY_RESULT_64_BIT | VK_QUERY_RESULT_WAIT_BIT), "vkGetQueryPoolResults");
    const uint32_t bits = device_.timestamp_valid_bits();
    const uint64_t mask = bits >= 64 ? ~uint64_t(0) : (uint64_t(1) << bits) - 1;
    last_gpu_seconds_ = double((ticks[1] - ticks[0]) & mask) * device_.timestamp_period_ns() * 1e-9;
  }
  std::vector<HostTensor> outputs;
  for (int32_t id : plan_.graph->outputs) outputs.push_back(read_value(id));
  return outputs;
}

void StepInterpreter::record() {
  // vk/commands.py Program._record, from the checked plan.
  uint32_t total_bindings = 0;
  std::vector<const Pipeline*> pipelines;
  for (const auto& p : plan_.dispatches) {
    const ShaderModuleCode& module = plan_.modules.at(p.dispatch->shader);
    pipelines.push_back(&pipelines_->get(p.dispatch->shader, module.code, module.interface, p.specialization, p.push_size));
    total_bindings += uint32_t(p.bindings.size());
  }
  VkDevice dev = device_.handle();
  VkDescriptorPoolSize pool_size{VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, std::max<uint32_t>(total_bindings, 1)};
  VkDescriptorPoolCreateInfo pool_info{VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO};
  pool_info.maxSets = uint32_t(plan_.dispatches.size());
  pool_info.poolSizeCount = 1;
  pool_info.pPoolSizes = &pool_size;
  vk_check(vkCreateDescriptorPool(dev, &pool_info, nullptr, &descriptor_pool_), "vkCreateDescriptorPool");
  std::vector<VkDescriptorSetLayout> layouts;
  for (const Pipeline* p : pipelines) layouts.push_back(p->set_layout);
  std::vector<VkDescriptorSet> sets(plan_.dispatches.size());
  VkDescriptorSetAllocateInfo alloc{VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO};
  alloc.descriptorPool = descriptor_pool_;
  alloc.descriptorSetCount = uint32_t(layouts.size());
  alloc.pSetLayouts = layouts.data();
  vk_check(vkAllocateDescriptorSets(dev, &alloc, sets.data()), "vkAllocateDescriptorSets");
  for (size_t i = 0; i < plan_.dispatches.size(); ++i) {
    std::vector<VkDescriptorBufferInfo> infos;
    for (const auto& b : plan_.dispatches[i].bindings) infos.push_back({bound_[b.buffer]->handle(), b.offset, b.range});
    std::vector<VkWriteDescriptorSet> writes;
    for (uint32_t b = 0; b < infos.size(); ++b) {
      VkWriteDescriptorSet w{VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET};
      w.dstSet = sets[i];
      w.dstBinding = b;
      w.descriptorCount = 1;
      w.descriptorType = VK_DESCRIPTOR_TYPE_STORAGE_BUFFER;
      w.pBufferInfo = &infos[b];
      writes.push_back(w);
    }
    if (!writes.empty()) vkUpdateDescriptorSets(dev, uint32_t(writes.size()), writes.data(), 0, nullptr);
  }

  if (device_.timestamp_valid_bits()) {
    VkQueryPoolCreateInfo query{VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO};
    query.queryType = VK_QUERY_TYPE_TIMESTAMP;
    query.queryCount = 2;
    vk_check(vkCreateQueryPool(dev, &query, nullptr, &timestamps_), "vkCreateQueryPool");
  }
  command_buffer_ = allocate_command_buffer(device_);
  begin_command_buffer(command_buffer_);
  VkCommandBuffer cb = command_buffer_;
  if (timestamps_) {
    vkCmdResetQueryPool(cb, timestamps_, 0, 2);
    vkCmdWriteTimestamp(cb, VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, timestamps_, 0);
  }
  const VkAccessFlags compute_rw = VK_ACCESS_SHADER_READ_BIT | VK_ACCESS_SHADER_WRITE_BIT;
  // Host writes, staging copies and the previous replay must be visible to this one.
  memory_barrier(cb, VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT | VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                 VK_ACCESS_HOST_WRITE_BIT | VK_ACCESS_TRANSFER_WRITE_BIT | VK_ACCESS_SHADER_WRITE_BIT,
                 VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw);
  const Pipeline* bound = nullptr;
  for (size_t i = 0; i < plan_.dispatches.size(); ++i) {
    const PlannedDispatch& p = plan_.dispatches[i];
    const Pipeline* pipeline = pipelines[i];
    if (p.barrier)
      memory_barrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, compute_rw);
    if (pipeline != bound) {
      vkCmdBindPipeline(cb, VK_PIPELINE_BIND_POINT_COMPUTE, pipeline->handle);
      bound = pipeline;
    }
    vkCmdBindDescriptorSets(cb, VK_PIPELINE_BIND_POINT_COMPUTE, pipeline->layout, 0, 1, &sets[i], 0, nullptr);
    for (const auto& [offset, counts] : p.chunks) {
      std::vector<uint8_t> push;
      if (p.header) {
        uint32_t header[4] = {offset[0], offset[1], offset[2], 0};
        push.resize(kPushHeaderBytes);
        std::memcpy(push.data(), header, kPushHeaderBytes);
      }
      push.insert(push.end(), p.dispatch->push_constants.begin(), p.dispatch->push_constants.end());
      if (!push.empty())
        vkCmdPushConstants(cb, pipeline->layout, VK_SHADER_STAGE_COMPUTE_BIT, 0, uint32_t(push.size()), push.data());
      vkCmdDispatch(cb, counts[0], counts[1], counts[2]);
      ++recorded_dispatches_;
    }
  }
  // Results must be visible to the host (mapped reads) and to transfers (staging downloads).
  memory_barrier(cb, VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, VK_ACCESS_SHADER_WRITE_BIT,
                 VK_PIPELINE_STAGE_HOST_BIT | VK_PIPELINE_STAGE_TRANSFER_BIT,
                 VK_ACCESS_HOST_READ_BIT | VK_ACCESS_TRANSFER_READ_BIT | VK_ACCESS_TRANSFER_WRITE_BIT);
  if (timestamps_) vkCmdWriteTimestamp(cb, VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, timestamps_, 1);
  vk_check(vkEndCommandBuffer(cb), "vkEndCommandBuffer");
  fence_ = create_fence(device_);
}

}  // namespace vktrain
