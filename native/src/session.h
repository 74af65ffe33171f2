// A training session: what the C API (native/include/vktrain.h) wraps. The .pte loaded and verified, the
// device, the step's schedule (the embedded one this device runs, or files), the interpreter; then `vktrain
// train`'s run on top: the token batcher, the LR schedule and AdamW settings, the step counter and records,
// checkpoints (checkpoint.h) and PEFT adapters (adapters.h). Every error is a LoadError naming what is wrong.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "adapters.h"
#include "checkpoint.h"
#include "interpreter.h"
#include "pte.h"
#include "step_source.h"
#include "train_data.h"
#include "vk_device.h"

namespace vktrain {

struct SessionOptions {
  std::string device;  // Device's selector: an index or a name substring; "": $VKTRAIN_DEVICE, else the best
  bool staging = false;
  std::string schedule_file, spirv_dir;  // both or neither (neither: the .pte's embedded schedule)
  std::string schedule_profile;          // non-empty: the embedded schedule for this profile (else the matching rule's)
};

struct RunSettings {  // what vktrain train's run_config records, and the batch order
  LRSchedule lr;
  double adamw[4] = {0.9, 0.999, 1e-8, 1e-2};  // beta1, beta2, eps, weight_decay (contract.py ADAMW_DEFAULTS)
  uint32_t seed = 0;
  bool shuffle = true;
  std::string data_name = "tokens";
};

class Session {
 public:
  // `program` is loaded already (Program::load or load_bytes).
  Session(std::unique_ptr<Program> program, const SessionOptions& options);
  ~Session();

  const Program& program() const { return *program_; }
  const StepInterpreter& interpreter() const { return *step_; }
  StepInterpreter& interpreter() { return *step_; }
  const std::string& device_name() const { return device_->name(); }
  const std::string& origin() const { return origin_; }
  int64_t batch_size() const { return batch_; }
  int64_t seq_len() const { return seq_; }
  int64_t vocab_size() const { return vocab_; }
  int64_t steps_done() const { return int64_t(records_.size()); }
  const std::vector<CheckpointRecord>& records() const { return records_; }
  // The GPU's time for step `step`'s commands (timestamps); 0 without timestamps or for a restored step.
  double gpu_seconds(int64_t step) const {
    return step >= 1 && size_t(step) <= gpu_seconds_.size() ? gpu_seconds_[size_t(step - 1)] : 0.0;
  }
  uint64_t n_windows() const { return batcher_ ? batcher_->n_windows() : 0; }

  // One optimizer step on named inputs (hparams and n_valid filled in unless given); the loss. A non-finite
  // loss is returned and not recorded.
  float step(std::map<std::string, HostTensor> inputs, const float hparams[5], double lr_recorded);
  void start_run(std::vector<int64_t> tokens, const RunSettings& settings);
  bool running() const { return batcher_ != nullptr; }
  // The run's next step; returns its record (loss non-finite: not recorded).
  CheckpointRecord train_step();

  void save_checkpoint(const std::string& path);
  void load_checkpoint(const std::string& path);
  void save_adapters(const std::string& directory, const AdapterOptions& options) const;

 private:
  HostTensor token_tensor(const std::string& input, const std::vector<int64_t>& values) const;
  const std::string& program_sha256();

  std::unique_ptr<Program> program_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<StepSource> source_;
  std::string origin_;
  std::unique_ptr<StepInterpreter> step_;
  std::vector<std::string> inputs_;
  int64_t batch_ = 0, seq_ = 0, vocab_ = 0;
  std::vector<CheckpointRecord> records_;
  std::vector<double> gpu_seconds_;  // per record
  std::string sha256_;
  // The run (start_run).
  RunSettings run_;
  std::unique_ptr<TokenBatcher> batcher_;
  std::string fingerprint_;
};

}  // namespace vktrain
