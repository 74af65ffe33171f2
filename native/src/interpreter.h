// The schedule interpreter (issue 26): one training step of a verified .pte on the native Vulkan layer,
// carrying out its Schedule as vktrain/runtime/delegate/executor.py GraphExecutor and vk/commands.py Program
// do, deciding nothing. Load: the step planned against the device (step_plan.h: every check, no Vulkan);
// one Buffer per entry of the schedule's buffer table; constants uploaded once as the Python runtime uploads
// them (narrow constants widened, W_4X8 weights packed as stored, int64 as range-checked int32); mutable state
// set to its initial value; every Dispatch recorded ONCE into one command buffer. Per run: the inputs written
// (converted and index-checked), the command buffer replayed under a fence, the outputs read.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "graph.h"
#include "pte.h"
#include "step_plan.h"
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

DeviceCaps caps_of(const Device& device);

class StepInterpreter {
 public:
  // `program` and `source` must outlive the interpreter (constants and the schedule are read in place).
  StepInterpreter(const Program& program, const StepSource& source, Device& device);
  // A delegate graph alone, the program around it checked by its caller (an ExecuTorch backend: step_plan.h
  // plan_graph_step). `owner`: the interpreter whose tensors this one binds where its schedule marks them shared (an
  // eval method's, bound to the training step's state and frozen constants); it must outlive this one. `graph` and
  // `source` must outlive the interpreter.
  StepInterpreter(const Graph& graph, const std::string& where, const StepSource& source, Device& device,
                  const StepInterpreter* owner = nullptr);
  ~StepInterpreter();
  StepInterpreter(const StepInterpreter&) = delete;
  StepInterpreter& operator=(const StepInterpreter&) = delete;

  std::vector<std::string> input_names() const { return plan_.input_names(); }
  const TensorValue& input(size_t index) const { return plan_.tensor(plan_.graph->inputs.at(index)); }
  std::vector<std::string> state_names() const;
  // The graph tensor (dtype, shape) of state_names()[index].
  const TensorValue& state_value(size_t index) const { return plan_.tensor(plan_.states.at(index).second.state_id); }
  // Exclusive upper bound of an input used as an index (embedding rows, logits classes); 0: not an index.
  int64_t index_bound(const std::string& input_name) const;

  // Inputs in input_names() order, in their graph dtypes; returns the outputs in graph order. A wrong input
  // is a LoadError kVerification naming it and what was expected (shape, dtype, range).
  std::vector<HostTensor> run(const std::vector<HostTensor>& inputs);
  HostTensor read_state(const std::string& name) const;
  void write_state(const std::string& name, const HostTensor& value);  // shape and dtype must match
  void reset_state();
  uint64_t recorded_dispatches() const { return recorded_dispatches_; }
  // The GPU's time for the last run's commands, from timestamps around them; 0 where the queue has none.
  double last_gpu_seconds() const { return last_gpu_seconds_; }
  uint64_t barrier_count() const;
  uint64_t allocated_bytes() const;
  // What another interpreter of the program may bind (executor.py shared_state + shared_constants): every mutable
  // state tensor by name, then every named constant this interpreter uploaded once under its name.
  SharedTensors shared_tensors() const;

 private:
  void load(const std::string& what, const StepInterpreter* owner);
  void release();
  void upload_constants();
  void record();
  void write_value(int32_t value_id, const HostTensor& array, const std::string& what);
  HostTensor read_value(int32_t value_id) const;

  StepPlan plan_;
  Device& device_;
  std::vector<std::unique_ptr<Buffer>> buffers_;  // the ones this interpreter allocated (null: bound, the owner's)
  std::vector<Buffer*> bound_;                     // every buffer of the schedule's table, by index
  std::unique_ptr<PipelineCache> pipelines_;
  VkDescriptorPool descriptor_pool_ = VK_NULL_HANDLE;
  VkCommandBuffer command_buffer_ = VK_NULL_HANDLE;
  VkFence fence_ = VK_NULL_HANDLE;
  VkQueryPool timestamps_ = VK_NULL_HANDLE;  // 2 queries: before and after the step's commands
  double last_gpu_seconds_ = 0;
  uint64_t recorded_dispatches_ = 0;
};

}  // namespace vktrain
