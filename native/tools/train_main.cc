// vktrain-native-train: `vktrain train`'s loop on the native runtime (issue 26's first trainer; the final
// vktrain-train grows from it). Per step t (1-based): lr = the LR schedule's lr(t) in double, the program gets
// it as float32; hparams = float32 [lr, beta1, beta2, eps, weight_decay]; batch t - 1 of the TokenBatcher;
// n_valid = the count of labels >= 0; one replay of the recorded step; a progress line.
//
// The dispatch schedule and the SPIR-V come from the .pte: the blob's embedded schedule for this device
// (`vktrain export --target`; chosen by embedded.py's matching rule, src/embedded.h), or, explicitly, from a
// schedule file and a SPIR-V directory (--schedule-file S.vks --spirv-dir D).
//
//   vktrain-native-train STEP.pte --data TOKENS.npy --steps N --lr X [--schedule cosine|constant] [--json OUT]
//                        [--schedule-file S.vks --spirv-dir D]
//                        [--state-out DIR]   (after the last step: every state tensor as DIR/<name>.npy)
//                        [--staging]         (host access through staging copies: a discrete GPU's path, anywhere)
//                        [--checkpoint CK --checkpoint-every K] [--resume CK]  (vktrain train's checkpoint file,
//                                            src/checkpoint.h: a checkpoint of either trainer resumes in the other)
//
// Exit codes (the project's): 0 ok, 1 diverged (a non-finite loss), 2 bad input or a device that cannot run
// the program ("vktrain-native-train: error: ..."), 70 internal.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "embedded.h"
#include "interpreter.h"
#include "npy.h"
#include "pte.h"
#include "status.h"
#include "step_source.h"
#include "text.h"
#include "train_data.h"
#include "vk_device.h"

using namespace vktrain;

namespace {

const char* const kUsage =
    "usage: vktrain-native-train STEP.pte --data TOKENS.npy --steps N --lr X [--schedule-file S.vks --spirv-dir DIR]\n"
    "                            [--schedule constant|cosine] [--warmup W] [--min-lr-ratio R] [--beta1 B1]\n"
    "                            [--beta2 B2] [--eps E] [--weight-decay WD] [--seed S] [--no-shuffle] [--json OUT]\n"
    "                            [--state-out DIR] [--device INDEX|NAME] [--staging]\n"
    "                            [--checkpoint CK.safetensors] [--checkpoint-every K] [--resume CK.safetensors]\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "%svktrain-native-train: error: %s\n", kUsage, message.c_str());
  std::exit(2);
}

double parse_real(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end) usage_error(flag + " takes a number, got '" + text + "'");
  return v;
}

int64_t parse_int(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end) usage_error(flag + " takes an integer, got '" + text + "'");
  return v;
}

std::string float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return hex8(bits);
}

// The JSON log, written whole to a temporary file and renamed over OUT (a reader never sees half of it).
void write_json(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) refuse(ErrorCode::kIo, "--json " + path + ": cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    refuse(ErrorCode::kIo, "--json " + path + ": cannot rename " + tmp + " over it: " + std::strerror(errno));
  }
}

HostTensor make(int dtype, std::vector<int64_t> shape, const void* data, size_t bytes) {
  HostTensor t{dtype, std::move(shape), std::vector<uint8_t>(bytes)};
  std::memcpy(t.data.data(), data, bytes);
  return t;
}

int train(int argc, char** argv) {
  std::string pte, schedule_file, spirv_dir, data, json, device, state_out, checkpoint_path, resume;
  int64_t checkpoint_every = 0;
  int64_t steps = 0, seed = 0;
  bool have_lr = false, shuffle = true, staging = false;
  LRSchedule lr;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;  // contract.py ADAMW_DEFAULTS
  std::map<std::string, std::string*> texts = {{"--schedule-file", &schedule_file}, {"--spirv-dir", &spirv_dir},
                                               {"--data", &data}, {"--json", &json}, {"--schedule", &lr.kind},
                                               {"--device", &device}, {"--state-out", &state_out},
                                               {"--checkpoint", &checkpoint_path}, {"--resume", &resume}};
  std::map<std::string, double*> reals = {{"--lr", &lr.base_lr}, {"--min-lr-ratio", &lr.min_lr_ratio}, {"--beta1", &beta1},
                                          {"--beta2", &beta2}, {"--eps", &eps}, {"--weight-decay", &weight_decay}};
  std::map<std::string, int64_t*> ints = {{"--steps", &steps}, {"--warmup", &lr.warmup_steps}, {"--seed", &seed},
                                          {"--checkpoint-every", &checkpoint_every}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") { std::fputs(kUsage, stdout); return 0; }
    if (arg == "--no-shuffle") { shuffle = false; continue; }
    if (arg == "--staging") { staging = true; continue; }
    bool known = texts.count(arg) || reals.count(arg) || ints.count(arg);
    if (known) {
      if (i + 1 >= argc) usage_error(arg + " takes a value");
      std::string value = argv[++i];
      if (texts.count(arg)) *texts[arg] = value;
      else if (reals.count(arg)) *reals[arg] = parse_real(arg, value);
      else *ints[arg] = parse_int(arg, value);
      have_lr = have_lr || arg == "--lr";
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else if (pte.empty()) {
      pte = arg;
    } else {
      usage_error("one STEP.pte, got a second: " + arg);
    }
  }
  if (pte.empty()) usage_error("the training step STEP.pte is required");
  if (data.empty()) usage_error("--data is required");
  if (schedule_file.empty() != spirv_dir.empty())
    usage_error(std::string(schedule_file.empty() ? "--spirv-dir" : "--schedule-file") + " needs " +
                (schedule_file.empty() ? "--schedule-file S.vks" : "--spirv-dir DIR") +
                " too (or neither: the .pte's embedded schedule)");
  if (steps <= 0) usage_error("--steps N is required and must be positive, got " + num(steps));
  if (!have_lr) usage_error("--lr is required");
  if (checkpoint_every < 0) usage_error("--checkpoint-every K must be >= 1, got " + num(checkpoint_every));
  if (checkpoint_path.empty()) checkpoint_path = resume;  // vktrain train's default: continue the resumed file
  if (!checkpoint_path.empty() && checkpoint_path != resume && access(checkpoint_path.c_str(), F_OK) == 0)
    usage_error("--checkpoint " + checkpoint_path + " exists; continue it with --resume " + checkpoint_path +
                " or choose another file (a run never replaces another's checkpoint)");
  if (seed < 0 || seed >= (int64_t(1) << 32)) usage_error("--seed must be in [0, 2**32), got " + num(seed));
  lr.total_steps = steps;
  std::string unusable = lr.check();
  if (!unusable.empty()) usage_error(unusable);

  std::unique_ptr<Program> program = Program::load(pte);
  Device gpu(device);
  gpu.force_staging(staging);
  std::unique_ptr<StepSource> source;
  std::string origin;
  if (!schedule_file.empty()) {
    source = files_step_source(schedule_file, spirv_dir);
    origin = schedule_file;
  } else {
    const Method& method = program->main_method();
    if (method.embedded.empty())
      refuse(ErrorCode::kUnsupported, pte + " embeds no dispatch schedules (exported without --target): export it "
                                            "with vktrain export --target NAME, or give --schedule-file S.vks and "
                                            "--spirv-dir DIR");
    size_t chosen = select_schedule(method.embedded, method.graph->shader_modules, device_profile_of(gpu), gpu.name(), pte);
    origin = "the embedded schedule for profile '" + method.embedded[chosen].profile.name + "'";
    source = embedded_step_source(*method.graph, method.embedded[chosen]);
  }
  StepInterpreter step(*program, *source, gpu);

  std::vector<std::string> names = step.input_names();
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < names.size(); ++i) index[names[i]] = i;
  for (const auto& n : names)
    if (n != "token_ids" && n != "labels" && n != "hparams" && n != "n_valid")
      refuse(ErrorCode::kUnsupported, pte + ": input '" + n + "' is not one of a token model's step (token_ids, labels, "
                                            "hparams, n_valid); this trainer runs token steps");
  if (!index.count("token_ids") || !index.count("labels") || !index.count("hparams")) {
    std::string all;
    for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
    refuse(ErrorCode::kUnsupported, pte + ": a token step takes token_ids, labels and hparams; its inputs are " + all);
  }
  const TensorValue& ids = step.input(index["token_ids"]);
  if (ids.shape.size() != 2) refuse(ErrorCode::kUnsupported, pte + ": token_ids must be [batch, seq]");
  const TensorValue& hp = step.input(index["hparams"]);
  if (hp.dtype != kFloat32 || hp.shape != std::vector<int64_t>{5})
    refuse(ErrorCode::kUnsupported, pte + ": hparams must be float32 [5] = [lr, beta1, beta2, eps, weight_decay]");
  int64_t vocab = std::min(step.index_bound("token_ids") ? step.index_bound("token_ids") : INT64_MAX,
                           step.index_bound("labels") ? step.index_bound("labels") : INT64_MAX);

  std::vector<int64_t> tokens = load_npy_tokens(data);
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      refuse(ErrorCode::kVerification, data + ": token id " + num(tokens[i]) + " at position " + num(i) +
                                           " is outside the model's vocabulary [0, " + num(vocab) + ")");
  const double adamw[4] = {beta1, beta2, eps, weight_decay};
  std::string program_sha256, fingerprint;
  if (!checkpoint_path.empty()) {
    program_sha256 = sha256_file(pte);
    fingerprint = batcher_fingerprint(tokens, ids.shape[0], ids.shape[1], shuffle);
  }
  std::vector<CheckpointRecord> history;  // every step's record since step 1 (a resumed run's included)
  int64_t first_done = 0;  // steps a resumed checkpoint holds
  if (!resume.empty()) {
    // checkpoint.py restore_state's checks, then the state written; the run continues at step + 1.
    Checkpoint c = load_checkpoint(resume);
    if (c.program_sha256 != program_sha256)
      refuse(ErrorCode::kVerification, resume + " was written for a different program (.pte sha256 " +
                                           c.program_sha256.substr(0, 16) + "...), this program's sha256 is " +
                                           program_sha256.substr(0, 16) + "...; a checkpoint resumes only onto the .pte it came from");
    if (c.data_sha256 != fingerprint)
      refuse(ErrorCode::kVerification, resume + " was trained on other data or batching (data fingerprint " +
                                           c.data_sha256.substr(0, 16) + "..., " + data + " gives " +
                                           fingerprint.substr(0, 16) + "...); resume with the same --data and --no-shuffle setting");
    if (c.step > steps)
      usage_error("the run is already at step " + num(c.step) + "; asked to train up to step " + num(steps) +
                  ", which is behind it");
    std::vector<std::string> state = step.state_names();
    for (const auto& name : state)
      if (!c.tensors.count(name)) refuse(ErrorCode::kVerification, resume + " does not hold state '" + name + "'");
    if (c.tensors.size() != state.size())
      refuse(ErrorCode::kVerification, resume + " holds tensors that are not the program's state");
    for (const auto& name : state) {
      HostTensor now = step.read_state(name);
      if (now.dtype != c.tensors[name].dtype || now.shape != c.tensors[name].shape)
        refuse(ErrorCode::kVerification, resume + ": state '" + name + "' has another dtype or shape than the program's");
    }
    auto counter = c.tensors.find("optimizer.step");
    if (counter != c.tensors.end() && counter->second.dtype == kFloat32 && counter->second.item<float>() != float(c.step))
      refuse(ErrorCode::kVerification, resume + ": the optimizer's step counter disagrees with its recorded step " + num(c.step));
    for (const auto& name : state) step.write_state(name, c.tensors[name]);
    seed = c.data_seed;  // a resumed run keeps its data order
    first_done = c.step;
    history = c.records;
  }
  auto save = [&](int64_t done) {
    Checkpoint c;
    c.step = c.data_position = done;
    c.data_seed = seed;
    c.program_sha256 = program_sha256;
    c.data_sha256 = fingerprint;
    c.config_json = run_config_json(lr, adamw, ids.shape[0], ids.shape[1], shuffle);
    c.records = history;
    for (const auto& name : step.state_names()) c.tensors[name] = step.read_state(name);
    save_checkpoint(checkpoint_path, c);
  };
  TokenBatcher batches(std::move(tokens), uint64_t(ids.shape[0]), uint64_t(ids.shape[1]), uint32_t(seed), shuffle, data);
  std::printf("vktrain-native-train: %s (%s) on %s: %llu dispatches, %llu barriers, %.1f MiB of buffers; batch %lld x %lld, "
              "%llu windows\n", pte.c_str(), origin.c_str(), gpu.name().c_str(), (unsigned long long)step.recorded_dispatches(),
              (unsigned long long)step.barrier_count(), step.allocated_bytes() / 1048576.0, (long long)ids.shape[0],
              (long long)ids.shape[1], (unsigned long long)batches.n_windows());
  std::fflush(stdout);

  std::string records;
  for (const auto& r : history)
    records += std::string(records.empty() ? "" : ",\n") + "  {\"step\": " + num(r.step) + ", \"loss\": " +
               real(r.loss) + ", \"loss_bits\": \"" + float_bits(float(r.loss)) + "\", \"lr\": " + real(r.lr) +
               ", \"seconds\": " + real(r.seconds) + "}";
  int status = 0;
  std::vector<int64_t> batch_tokens, batch_labels;
  for (int64_t t = first_done + 1; t <= steps; ++t) {
    auto start = std::chrono::steady_clock::now();
    double rate = lr.lr(t);
    float hparams[5] = {float(rate), float(beta1), float(beta2), float(eps), float(weight_decay)};
    batches.batch(uint64_t(t - 1), &batch_tokens, &batch_labels);
    float n_valid = 0;
    for (int64_t l : batch_labels) n_valid += l >= 0 ? 1.0f : 0.0f;
    std::vector<HostTensor> inputs(names.size());
    inputs[index["token_ids"]] = make(kInt64, ids.shape, batch_tokens.data(), batch_tokens.size() * 8);
    inputs[index["labels"]] = make(kInt64, step.input(index["labels"]).shape, batch_labels.data(), batch_labels.size() * 8);
    inputs[index["hparams"]] = make(kFloat32, {5}, hparams, sizeof hparams);
    if (index.count("n_valid")) inputs[index["n_valid"]] = make(kFloat32, {}, &n_valid, 4);
    std::vector<HostTensor> outputs = step.run(inputs);
    if (outputs.empty() || outputs[0].dtype != kFloat32 || outputs[0].numel() != 1)
      refuse(ErrorCode::kUnsupported, pte + ": the step's first output is not a float32 loss");
    float loss = outputs[0].item<float>();
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("step %lld/%lld  loss %.6f  lr %.6g  %.1f ms\n", (long long)t, (long long)steps, loss, rate, seconds * 1e3);
    std::fflush(stdout);
    records += std::string(records.empty() ? "" : ",\n") + "  {\"step\": " + num(t) + ", \"loss\": " +
               (std::isfinite(loss) ? real(loss) : "null") + ", \"loss_bits\": \"" + float_bits(loss) + "\", \"lr\": " +
               real(rate) + ", \"seconds\": " + real(seconds) + "}";
    if (!std::isfinite(loss)) {
      std::fprintf(stderr, "vktrain-native-train: the loss became %f at step %lld (lr %.6g); training stopped\n", loss,
                   (long long)t, rate);
      status = 1;
      break;  // the last checkpoint written stays the last good one
    }
    history.push_back({t, double(loss), rate, seconds});
    if (!checkpoint_path.empty() && ((checkpoint_every && t % checkpoint_every == 0) || t == steps)) save(t);
  }
  if (!json.empty()) write_json(json, "[\n" + records + "\n]\n");
  if (!state_out.empty() && status == 0) {
    struct stat st;
    if (stat(state_out.c_str(), &st) != 0 && mkdir(state_out.c_str(), 0777) != 0)
      refuse(ErrorCode::kIo, "--state-out " + state_out + ": cannot create it: " + std::strerror(errno));
    for (const std::string& name : step.state_names()) {
      if (name.find('/') != std::string::npos || name.empty() || name[0] == '.')
        refuse(ErrorCode::kUnsupported, "--state-out: state '" + name + "' is no file name");
      HostTensor t = step.read_state(name);
      save_npy(state_out + "/" + name + ".npy", t.dtype, t.shape, t.data);
    }
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const LoadError& e) {
    std::fprintf(stderr, "vktrain-native-train: error: %s\n", e.what());
    return e.code() == ErrorCode::kInternal ? 70 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vktrain-native-train: internal error: %s\n", e.what());
    return 70;
  }
}
