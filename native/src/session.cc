#include "session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "embedded.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

HostTensor int64_tensor(const std::vector<int64_t>& shape, const std::vector<int64_t>& values) {
  HostTensor t{kInt64, shape, std::vector<uint8_t>(values.size() * 8)};
  std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

[[noreturn]] void bad_call(const std::string& message) { refuse(ErrorCode::kVerification, message); }

}  // namespace

Session::Session(std::unique_ptr<Program> program, const SessionOptions& options) : program_(std::move(program)) {
  const std::string& pte = program_->source();
  if (options.schedule_file.empty() != options.spirv_dir.empty())
    refuse(ErrorCode::kVerification, std::string(options.schedule_file.empty() ? "spirv_dir" : "schedule_file") +
                                         " is given without " + (options.schedule_file.empty() ? "schedule_file" : "spirv_dir") +
                                         ": give both, or neither (the .pte's embedded schedule)");
  if (!options.schedule_file.empty() && !options.schedule_profile.empty())
    refuse(ErrorCode::kVerification, "schedule_profile picks an embedded schedule; it does not go with schedule_file");
  device_ = std::make_unique<Device>(options.device);
  device_->force_staging(options.staging);
  if (!options.schedule_file.empty()) {
    source_ = files_step_source(options.schedule_file, options.spirv_dir);
    origin_ = options.schedule_file;
  } else {
    const Method& method = program_->main_method();
    if (method.embedded.empty())
      refuse(ErrorCode::kUnsupported, pte + " embeds no dispatch schedules (exported without --target): export it "
                                            "with vktrain export --target NAME, or give --schedule-file S.vks and "
                                            "--spirv-dir DIR");
    size_t chosen = select_schedule(method.embedded, method.graph->shader_modules, device_profile_of(*device_),
                                    device_->name(), pte, options.schedule_profile);
    origin_ = "the embedded schedule for profile '" + method.embedded[chosen].profile.name + "'";
    source_ = embedded_step_source(*method.graph, method.embedded[chosen]);
  }
  step_ = std::make_unique<StepInterpreter>(*program_, *source_, *device_);
  inputs_ = step_->input_names();
  for (size_t i = 0; i < inputs_.size(); ++i) {
    if (inputs_[i] == "hparams") {
      const TensorValue& hp = step_->input(i);
      if (hp.dtype != kFloat32 || hp.shape != std::vector<int64_t>{5})
        refuse(ErrorCode::kUnsupported, pte + ": hparams must be float32 [5] = [lr, beta1, beta2, eps, weight_decay]");
    }
    if (inputs_[i] == "token_ids" && step_->input(i).shape.size() == 2) {
      batch_ = step_->input(i).shape[0];
      seq_ = step_->input(i).shape[1];
    }
  }
  int64_t ids = step_->index_bound("token_ids"), labels = step_->index_bound("labels");
  vocab_ = ids && labels ? std::min(ids, labels) : ids ? ids : labels;
}

Session::~Session() {
  step_.reset();  // before the device it lives on
  source_.reset();
  device_.reset();
}

const std::string& Session::program_sha256() {
  if (sha256_.empty()) sha256_ = sha256_bytes(program_->bytes().data, program_->bytes().size);
  return sha256_;
}

HostTensor Session::token_tensor(const std::string& input, const std::vector<int64_t>& values) const {
  for (size_t i = 0; i < inputs_.size(); ++i)
    if (inputs_[i] == input) return int64_tensor(step_->input(i).shape, values);
  refuse(ErrorCode::kUnsupported, program_->source() + " takes no input '" + input + "'");
}

float Session::step(std::map<std::string, HostTensor> given, const float hparams[5], double lr_recorded) {
  const auto start = std::chrono::steady_clock::now();
  for (const auto& [name, _] : given)
    if (std::find(inputs_.begin(), inputs_.end(), name) == inputs_.end()) {
      std::string all;
      for (const auto& n : inputs_) all += (all.empty() ? "" : ", ") + n;
      bad_call("the program takes no input '" + name + "' (its inputs: " + all + ")");
    }
  // train_loop: n_valid = the count of labels >= 0, as float32 (exact below 2**24 labels).
  float n_valid = 0;
  auto labels = given.find("labels");
  if (labels != given.end() && labels->second.dtype == kInt64)
    for (uint64_t k = 0; k < labels->second.numel(); ++k) n_valid += labels->second.item<int64_t>(k) >= 0 ? 1.0f : 0.0f;
  std::vector<HostTensor> inputs(inputs_.size());
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const std::string& name = inputs_[i];
    auto it = given.find(name);
    if (it != given.end()) {
      inputs[i] = std::move(it->second);
    } else if (name == "hparams") {
      inputs[i] = HostTensor{kFloat32, {5}, std::vector<uint8_t>(20)};
      std::memcpy(inputs[i].data.data(), hparams, 20);
    } else if (name == "n_valid" && labels != given.end()) {
      inputs[i] = HostTensor{kFloat32, {}, std::vector<uint8_t>(4)};
      std::memcpy(inputs[i].data.data(), &n_valid, 4);
    } else {
      bad_call("input '" + name + "' is not given");
    }
  }
  std::vector<HostTensor> outputs = step_->run(inputs);
  if (outputs.empty() || outputs[0].dtype != kFloat32 || outputs[0].numel() != 1)
    refuse(ErrorCode::kUnsupported, program_->source() + ": the step's first output is not a float32 loss");
  float loss = outputs[0].item<float>();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (std::isfinite(loss)) {
    gpu_seconds_.resize(records_.size());
    gpu_seconds_.push_back(step_->last_gpu_seconds());
    records_.push_back({steps_done() + 1, double(loss), lr_recorded, seconds});
  }
  return loss;
}

void Session::start_run(std::vector<int64_t> tokens, const RunSettings& settings) {
  const std::string& pte = program_->source();
  for (const auto& n : inputs_)
    if (n != "token_ids" && n != "labels" && n != "hparams" && n != "n_valid")
      refuse(ErrorCode::kUnsupported, pte + ": input '" + n + "' is not one of a token model's step (token_ids, labels, "
                                            "hparams, n_valid); a run feeds token steps (give other inputs to vktrain_step)");
  if (!batch_ || !seq_ || !std::count(inputs_.begin(), inputs_.end(), "labels") ||
      !std::count(inputs_.begin(), inputs_.end(), "hparams")) {
    std::string all;
    for (const auto& n : inputs_) all += (all.empty() ? "" : ", ") + n;
    refuse(ErrorCode::kUnsupported, pte + ": a token step takes token_ids [batch, seq], labels and hparams; its inputs are " + all);
  }
  std::string unusable = settings.lr.check();
  if (!unusable.empty()) bad_call(unusable);
  for (double v : settings.adamw)
    if (!std::isfinite(v)) bad_call("AdamW settings must be finite numbers, got " + real(v));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || (vocab_ && tokens[i] >= vocab_))
      refuse(ErrorCode::kVerification, settings.data_name + ": token id " + num(tokens[i]) + " at position " + num(i) +
                                           " is outside the model's vocabulary [0, " + num(vocab_) + ")");
  fingerprint_ = batcher_fingerprint(tokens, batch_, seq_, settings.shuffle);
  batcher_ = std::make_unique<TokenBatcher>(std::move(tokens), uint64_t(batch_), uint64_t(seq_), settings.seed,
                                            settings.shuffle, settings.data_name);
  run_ = settings;
}

CheckpointRecord Session::train_step() {
  if (!batcher_) bad_call("no run is started (vktrain_start_run)");
  const int64_t t = steps_done() + 1;  // the data position is the step count (one batch a step)
  const double rate = run_.lr.lr(t);
  const float hparams[5] = {float(rate), float(run_.adamw[0]), float(run_.adamw[1]), float(run_.adamw[2]), float(run_.adamw[3])};
  std::vector<int64_t> tokens, labels;
  batcher_->batch(uint64_t(t - 1), &tokens, &labels);
  std::map<std::string, HostTensor> inputs;
  inputs["token_ids"] = token_tensor("token_ids", tokens);
  inputs["labels"] = token_tensor("labels", labels);
  float loss = step(std::move(inputs), hparams, rate);
  if (std::isfinite(loss)) return records_.back();
  return {t, double(loss), rate, 0};
}

void Session::save_checkpoint(const std::string& path) {
  Checkpoint c;
  c.step = c.data_position = steps_done();
  c.data_seed = run_.seed;
  c.program_sha256 = program_sha256();
  c.data_sha256 = fingerprint_;
  c.config_json = batcher_ ? run_config_json(run_.lr, run_.adamw, batch_, seq_, run_.shuffle) : "{}";
  c.records = records_;
  const std::vector<std::string> names = step_->state_names();
  for (const auto& name : names) c.tensors[name] = step_->read_state(name);
  vktrain::save_checkpoint(path, c);
}

void Session::load_checkpoint(const std::string& resume) {
  // checkpoint.py restore_state's checks (and vktrain train's data check with a run started), then the state.
  Checkpoint c = vktrain::load_checkpoint(resume);
  if (c.program_sha256 != program_sha256())
    refuse(ErrorCode::kVerification, resume + " was written for a different program (.pte sha256 " +
                                         c.program_sha256.substr(0, 16) + "...), this program's sha256 is " +
                                         program_sha256().substr(0, 16) + "...; a checkpoint resumes only onto the .pte it came from");
  if (batcher_ && c.data_sha256 != fingerprint_)
    refuse(ErrorCode::kVerification, resume + " was trained on other data or batching (data fingerprint " +
                                         c.data_sha256.substr(0, 16) + "..., " + run_.data_name + " gives " +
                                         fingerprint_.substr(0, 16) + "...); resume with the same data and shuffle setting");
  const std::vector<std::string> state = step_->state_names();
  for (const auto& name : state)
    if (!c.tensors.count(name)) refuse(ErrorCode::kVerification, resume + " does not hold state '" + name + "'");
  if (c.tensors.size() != state.size())
    refuse(ErrorCode::kVerification, resume + " holds tensors that are not the program's state");
  for (size_t i = 0; i < state.size(); ++i) {
    const TensorValue& v = step_->state_value(i);
    if (v.dtype != c.tensors[state[i]].dtype || v.shape != c.tensors[state[i]].shape)
      refuse(ErrorCode::kVerification, resume + ": state '" + state[i] + "' has another dtype or shape than the program's");
  }
  auto counter = c.tensors.find("optimizer.step");
  if (counter != c.tensors.end() && counter->second.dtype == kFloat32 && counter->second.item<float>() != float(c.step))
    refuse(ErrorCode::kVerification, resume + ": the optimizer's step counter disagrees with its recorded step " + num(c.step));
  for (const auto& name : state) step_->write_state(name, c.tensors[name]);
  records_ = c.records;
  gpu_seconds_.assign(records_.size(), 0.0);  // not recorded in a checkpoint
  run_.seed = uint32_t(c.data_seed);  // a resumed run keeps its data order
  if (batcher_) batcher_->reseed(run_.seed);
}

void Session::save_adapters(const std::string& directory, const AdapterOptions& options) const {
  save_peft_adapters(directory, *program_->main_method().graph, *step_, options, program_->source());
}

}  // namespace vktrain
