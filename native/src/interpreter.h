// The schedule interpreter (issue 26): one training step of a verified .pte on the native Vulkan layer,
// carrying out its Schedule as vktrain/runtime/delegate/executor.py GraphExecutor and vk/commands.py Program
// do, deciding nothing. Load: the schedule is verified against the graph and the device; one Buffer per
// entry of its buffer table; constants uploaded once as the Python runtime uploads them (widened narrow
// constants, W_4X8 weights packed as stored, int64 as range-checked int32); mutable state set to its initial
// value; every Dispatch checked against its shader's reflected interface and recorded ONCE into one command
// buffer (barriers where plan_barriers puts them, split dispatches with the group-offset header). Per run:
// the inputs written (converted and index-checked), the command buffer replayed, the outputs read.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "graph.h"
#include "pte.h"
#include "schedule.h"
#include "step_source.h"
#include "vk_device.h"

namespace vktrain {

// An array on the host in a graph dtype (DataType), C order.
struct HostTensor {
  int dtype = kFloat32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
  uint64_t numel() const;
  template <typename T> T item(size_t i = 0) const;  // element i (T must match dtype's size)
};

// LoadError kVerification naming what an input or state array gets wrong (shape, dtype, range).
class StepInterpreter {
 public:
  // `program` and `source` must outlive the interpreter (constants and the schedule are read in place).
  StepInterpreter(const Program& program, const StepSource& source, Device& device);
  ~StepInterpreter();
  StepInterpreter(const StepInterpreter&) = delete;
  StepInterpreter& operator=(const StepInterpreter&) = delete;

  const Graph& graph() const { return *graph_; }
  std::vector<std::string> input_names() const;
  const TensorValue& input(size_t index) const { return graph_->values[graph_->inputs[index]].tensor; }
  std::vector<std::string> state_names() const;
  // Exclusive upper bound of an input used as an index (embedding rows, logits classes); 0: not an index.
  int64_t index_bound(const std::string& input_name) const;

  // Inputs in input_names() order, in their graph dtypes; returns the outputs in graph order.
  std::vector<HostTensor> run(const std::vector<HostTensor>& inputs);
  HostTensor read_state(const std::string& name) const;
  void reset_state();
  uint64_t dispatch_count() const { return dispatch_count_; }
  uint64_t barrier_count() const { return barrier_count_; }
  uint64_t allocated_bytes() const;

 private:
  struct Placement { uint32_t buffer; uint64_t offset; };
  struct IndexLimit { bool has_low; int64_t low, bound; std::string what; };
  void release();
  void check_requirements() const;
  void upload_constants();
  void record();
  void write_value(int32_t value_id, const HostTensor& array, const std::string& what);
  HostTensor read_value(int32_t value_id) const;
  const TensorValue& tensor(int32_t value_id) const;

  const Graph* graph_;
  const Schedule& schedule_;
  const StepSource& source_;
  Device& device_;
  std::map<int32_t, Placement> placements_;
  std::vector<std::pair<std::string, MutableState>> states_;  // by name, graph order
  std::map<int32_t, std::vector<IndexLimit>> index_limits_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::unique_ptr<PipelineCache> pipelines_;
  VkDescriptorPool descriptor_pool_ = VK_NULL_HANDLE;
  VkCommandBuffer command_buffer_ = VK_NULL_HANDLE;
  VkFence fence_ = VK_NULL_HANDLE;
  uint64_t dispatch_count_ = 0, barrier_count_ = 0;
};

}  // namespace vktrain
