// The .pte reader (ExecuTorch's Program flatbuffer, vktrain/runtime/program/pte.py) and the load-time checks
// of vktrain/runtime/program/verify.py and runner.py verify_training_program: the file's header and
// segments, the flatbuffers Verifier over the program, every index, the plan's tensors and arenas (capped
// by the host's memory), the one vktrain delegate call, its blob and its I/O.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "blob.h"
#include "embedded.h"
#include "file_map.h"
#include "graph.h"

namespace vktrain {

constexpr const char* kBackendId = "VktrainVulkanBackend";
constexpr const char* kTrainMethod = "forward";

// program.fbs union codes: KernelTypes.Tensor, and the InstructionArguments (pte.cc checks them).
constexpr int kPlanTensor = 5;
enum InstructionKind : int { kKernelCall = 1, kDelegateCall, kMoveCall, kJumpFalseCall, kFreeCall };

struct PlanTensor {  // an ExecuTorch Tensor record of a plan
  int scalar_type = 0;
  std::vector<int32_t> sizes;
  std::vector<uint8_t> dim_order;
  int32_t storage_offset = 0;
  uint32_t data_buffer_idx = 0;
  bool planned = false;  // has allocation_info
  uint32_t memory_id = 0;
  uint64_t memory_offset = 0;
  int layout = 0, shape_dynamism = 0;
  bool has_extra = false, external = false;
  uint64_t mutable_data_segments_idx = 0;
  uint64_t nbytes = 0;  // checked
};

struct PlanValue {
  int kind = 0;  // executorch KernelTypes; kPlanTensor = Tensor
  PlanTensor tensor;
  std::vector<int32_t> items;  // TensorList / OptionalTensorList
};

struct Instruction {
  int kind;  // InstructionKind
  int32_t index;  // op_index / delegate_index
  std::vector<int32_t> args;
};

struct Method {
  std::string name;
  std::vector<PlanValue> values;
  std::vector<int32_t> inputs, outputs;
  std::vector<Instruction> instructions;
  std::vector<std::string> operators;  // "name.overload"
  std::vector<std::string> delegate_ids;
  std::vector<Bytes> delegate_data;
  std::vector<int64_t> arena_sizes;  // non_const_buffer_sizes
  // Filled by verification: the vktrain delegate's graph, and what each arena needs.
  int delegate_index = -1;
  std::vector<int32_t> delegate_args;
  std::unique_ptr<Graph> graph;
  std::vector<EmbeddedSchedule> embedded;  // the blob's schedules, read and verified (empty: plan-at-load blob)
  std::vector<uint64_t> arena_needs;
};

struct Limits {
  uint64_t host_memory_bytes = 0;  // 0: this machine's RAM
};

class Program {
 public:
  // Reads and verifies `path`; throws LoadError naming the file and what is wrong.
  static std::unique_ptr<Program> load(const std::string& path, const Limits& limits = {});
  // The same from a copy of `size` bytes (a .pte held in memory); `name` stands for the path in messages.
  static std::unique_ptr<Program> load_bytes(const void* data, size_t size, const std::string& name,
                                             const Limits& limits = {});

  const std::string& source() const { return source_; }
  uint64_t file_bytes() const { return map_->bytes().size; }
  Bytes bytes() const { return map_->bytes(); }  // the whole file (its sha256 identifies the program)
  const std::vector<Method>& methods() const { return methods_; }
  const Method& main_method() const;  // the only one, else the training step
  const NamedData& named_data() const { return named_data_; }

 private:
  static std::unique_ptr<Program> load_from(std::unique_ptr<FileMap> map, const std::string& name, const Limits& limits);
  void parse(Bytes file);
  void verify(const Limits& limits);
  Bytes segment(uint32_t index) const;

  std::string source_;
  std::unique_ptr<FileMap> map_;
  uint64_t program_size_ = 0, segment_base_ = 0, segment_data_size_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> segments_;  // (offset, size)
  std::vector<Bytes> inline_data_, constants_;
  std::vector<std::pair<uint32_t, std::vector<uint64_t>>> mutable_segments_;
  NamedData named_data_;
  std::vector<Method> methods_;
};

uint64_t host_memory_bytes();

}  // namespace vktrain
