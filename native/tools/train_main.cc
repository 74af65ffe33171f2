// vktrain-train: `vktrain train`'s loop with no Python, on the C API (native/include/vktrain.h): the session
// opens the .pte (its embedded schedule for this device, or --schedule-file S.vks --spirv-dir D), starts the run
// on the token file (vktrain train's batches, LR schedule and AdamW), steps, writes checkpoints, and at the end
// the PEFT adapter directory. Per step t (1-based): lr = the schedule's lr(t) in double, the program gets it as
// float32; hparams = float32 [lr, beta1, beta2, eps, weight_decay]; batch t - 1; n_valid = the count of
// labels >= 0. (vktrain-native-train, its first name, is a link to it.)
//
//   vktrain-train STEP.pte --data TOKENS.npy|FILE.tokens.txt --steps N --lr X [--schedule cosine|constant]
//                 [--warmup W] [--weight-decay WD] ... [--json OUT] [--summary-json OUT] [--log-every N] [--no-progress]
//                 [--checkpoint CK --checkpoint-every K] [--resume CK] [--out-adapters DIR [--lora-alpha A]
//                 [--base-model NAME]] [--state-out DIR] [--schedule-file S.vks --spirv-dir D] [--staging]
//                 [--schedule-profile NAME]   (the schedule embedded for that profile, not the matching rule's)
//
// Exit codes (the project's): 0 ok, 1 diverged (a non-finite loss), 2 bad input or a device that cannot run
// the program ("vktrain-train: error: ..."), 70 internal.
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "npy.h"
#include "resident.h"
#include "safetensors.h"
#include "status.h"
#include "text.h"
#include "token_file.h"
#include "vktrain.h"

using namespace vktrain;

namespace {

const char* const kName = "vktrain-train";
const char* const kUsage =
    "usage: vktrain-train STEP.pte --data TOKENS.npy|FILE.tokens.txt --steps N --lr X [--schedule constant|cosine]\n"
    "                     [--warmup W] [--min-lr-ratio R] [--beta1 B1] [--beta2 B2] [--eps E] [--weight-decay WD]\n"
    "                     [--seed S] [--no-shuffle] [--json OUT] [--summary-json OUT] [--log-every N] [--no-progress]\n"
    "                     [--checkpoint CK.safetensors] [--checkpoint-every K] [--resume CK.safetensors]\n"
    "                     [--out-adapters DIR] [--lora-alpha A] [--base-model NAME] [--state-out DIR]\n"
    "                     [--device INDEX|NAME] [--staging] [--schedule-file S.vks --spirv-dir DIR]\n"
    "                     [--schedule-profile NAME]\n";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "%s%s: error: %s\n", kUsage, kName, message.c_str());
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

// A failed API call: its message and status, as the trainer's error and exit code.
struct ApiError {
  vktrain_status status;
  std::string message;
};

void check(vktrain_status status, const vktrain_session* session) {
  if (status != VKTRAIN_OK) throw ApiError{status, vktrain_last_error(session)};
}

std::string record_json(const vktrain_step_result& r) {
  uint32_t bits;
  std::memcpy(&bits, &r.loss, 4);
  return "  {\"step\": " + num(r.step) + ", \"loss\": " + (std::isfinite(r.loss) ? real(r.loss) : "null") +
         ", \"loss_bits\": \"" + hex8(bits) + "\", \"lr\": " + real(r.lr) + ", \"seconds\": " + real(r.seconds) +
         ", \"gpu_seconds\": " + real(r.gpu_seconds) + "}";
}

double median(std::vector<double> v) {  // of a non-empty list: the middle one, or the mean of the middle two
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// The peak resident set of this process so far, in bytes (getrusage's ru_maxrss is KiB on Linux).
uint64_t peak_rss_bytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return uint64_t(usage.ru_maxrss) * 1024;
}

// The resident set at one point of the run, split into the .pte's mapped pages, device memory mapped into the
// process, and the rest: host memory. VmHWM/ru_maxrss is a high-water mark of the total only, so the split is
// sampled where the total peaks (after loading, after the last step) and the largest host part reported.
struct RssSample {
  std::string at;
  ResidentBytes bytes;
};

RssSample sample_rss(const std::string& at, const std::string& pte) {
  struct stat st {};
  if (stat(pte.c_str(), &st) != 0) return {at, {}};
  return {at, resident_bytes(st.st_dev, st.st_ino)};
}

const RssSample* most_host(const std::vector<RssSample>& samples) {  // null where none could be taken
  const RssSample* worst = nullptr;
  for (const RssSample& s : samples)
    if (s.bytes.known && (!worst || s.bytes.host() > worst->bytes.host())) worst = &s;
  return worst;
}

std::string rss_json(const std::vector<RssSample>& samples) {
  const RssSample* worst = most_host(samples);
  std::string list;
  for (const RssSample& s : samples) {
    if (!s.bytes.known) continue;
    list += std::string(list.empty() ? "" : ",\n") + "    {\"at\": " + json_quote(s.at) + ", \"rss_bytes\": " +
            num(s.bytes.total) + ", \"pte_resident_bytes\": " + num(s.bytes.file) + ", \"device_resident_bytes\": " +
            num(s.bytes.device) + ", \"host_rss_bytes\": " + num(s.bytes.host()) + "}";
  }
  if (!worst) return ",\n  \"host_rss_bytes\": null,\n  \"rss_samples\": []";
  return ",\n  \"host_rss_bytes\": " + num(worst->bytes.host()) + ",\n  \"host_rss_at\": " + json_quote(worst->at) +
         ",\n  \"pte_resident_bytes\": " + num(worst->bytes.file) + ",\n  \"device_resident_bytes\": " +
         num(worst->bytes.device) + ",\n  \"rss_samples\": [\n" + list + "\n  ]";
}

struct Args {
  std::string pte, schedule_file, spirv_dir, schedule_profile, data, json, summary_json, device, state_out, checkpoint, resume, out_adapters,
      base_model;
  int64_t steps = 0, seed = 0, checkpoint_every = 0, log_every = 1;
  double lora_alpha = 0;
  bool have_lr = false, shuffle = true, staging = false, progress = true, have_base_model = false;
  vktrain_run_config run;
  std::string schedule = "cosine";
};

Args parse(int argc, char** argv) {
  Args a;
  vktrain_run_config_init(&a.run);
  std::map<std::string, std::string*> texts = {
      {"--schedule-file", &a.schedule_file}, {"--schedule-profile", &a.schedule_profile}, {"--spirv-dir", &a.spirv_dir}, {"--data", &a.data}, {"--json", &a.json}, {"--summary-json", &a.summary_json},
      {"--schedule", &a.schedule}, {"--device", &a.device}, {"--state-out", &a.state_out},
      {"--checkpoint", &a.checkpoint}, {"--resume", &a.resume}, {"--out-adapters", &a.out_adapters},
      {"--base-model", &a.base_model}};
  std::map<std::string, double*> reals = {{"--lr", &a.run.lr}, {"--min-lr-ratio", &a.run.min_lr_ratio},
                                          {"--beta1", &a.run.beta1}, {"--beta2", &a.run.beta2}, {"--eps", &a.run.eps},
                                          {"--weight-decay", &a.run.weight_decay}, {"--lora-alpha", &a.lora_alpha}};
  std::map<std::string, int64_t*> ints = {{"--steps", &a.steps}, {"--warmup", &a.run.warmup_steps}, {"--seed", &a.seed},
                                          {"--checkpoint-every", &a.checkpoint_every}, {"--log-every", &a.log_every}};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") { std::fputs(kUsage, stdout); std::exit(0); }
    if (arg == "--no-shuffle") { a.shuffle = false; continue; }
    if (arg == "--staging") { a.staging = true; continue; }
    if (arg == "--no-progress") { a.progress = false; continue; }
    if (texts.count(arg) || reals.count(arg) || ints.count(arg)) {
      if (i + 1 >= argc) usage_error(arg + " takes a value");
      std::string value = argv[++i];
      if (texts.count(arg)) *texts[arg] = value;
      else if (reals.count(arg)) *reals[arg] = parse_real(arg, value);
      else *ints[arg] = parse_int(arg, value);
      a.have_lr = a.have_lr || arg == "--lr";
      a.have_base_model = a.have_base_model || arg == "--base-model";
    } else if (!arg.empty() && arg[0] == '-') {
      usage_error("unknown option " + arg);
    } else if (a.pte.empty()) {
      a.pte = arg;
    } else {
      usage_error("one STEP.pte, got a second: " + arg);
    }
  }
  if (a.pte.empty()) usage_error("the training step STEP.pte is required");
  if (a.data.empty()) usage_error("--data is required");
  if (a.schedule_file.empty() != a.spirv_dir.empty())
    usage_error(std::string(a.schedule_file.empty() ? "--spirv-dir" : "--schedule-file") + " needs " +
                (a.schedule_file.empty() ? "--schedule-file S.vks" : "--spirv-dir DIR") +
                " too (or neither: the .pte's embedded schedule)");
  if (!a.schedule_profile.empty() && !a.schedule_file.empty())
    usage_error("--schedule-profile picks a schedule embedded in the .pte; it does not go with --schedule-file");
  if (a.steps <= 0) usage_error("--steps N is required and must be positive, got " + num(a.steps));
  if (!a.have_lr) usage_error("--lr is required");
  if (a.checkpoint_every < 0) usage_error("--checkpoint-every K must be >= 1, got " + num(a.checkpoint_every));
  if (a.log_every < 0) usage_error("--log-every must be >= 0, got " + num(a.log_every));
  if (a.lora_alpha < 0 || !std::isfinite(a.lora_alpha)) usage_error("--lora-alpha must be a positive number, got " + real(a.lora_alpha));
  if (a.checkpoint.empty()) a.checkpoint = a.resume;  // vktrain train's default: continue the resumed file
  if (!a.checkpoint.empty() && a.checkpoint != a.resume && access(a.checkpoint.c_str(), F_OK) == 0)
    usage_error("--checkpoint " + a.checkpoint + " exists; continue it with --resume " + a.checkpoint +
                " or choose another file (a run never replaces another's checkpoint)");
  struct stat st;
  if (!a.out_adapters.empty() && stat(a.out_adapters.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    usage_error("--out-adapters " + a.out_adapters + " exists and is not a directory (a PEFT adapter directory goes there)");
  if (a.seed < 0 || a.seed >= (int64_t(1) << 32)) usage_error("--seed must be in [0, 2**32), got " + num(a.seed));
  if (a.schedule != "constant" && a.schedule != "cosine")
    usage_error("--schedule must be constant or cosine, got '" + a.schedule + "'");
  a.run.schedule = a.schedule.c_str();
  a.run.total_steps = a.steps;
  a.run.seed = uint32_t(a.seed);
  a.run.shuffle = a.shuffle;
  a.run.data_name = a.data.c_str();
  a.progress = a.progress && isatty(STDERR_FILENO);  // a bar only on a terminal: a log gets the --log-every lines
  return a;
}

int train(Args& a) {
  double lr;
  if (vktrain_schedule_lr(&a.run, 1, &lr) != VKTRAIN_OK) usage_error(vktrain_last_error(nullptr));
  std::vector<int64_t> tokens = load_token_file(a.data);

  vktrain_open_options options;
  vktrain_open_options_init(&options);
  options.device_name = a.device.empty() ? nullptr : a.device.c_str();
  options.staging = a.staging;
  options.schedule_file = a.schedule_file.empty() ? nullptr : a.schedule_file.c_str();
  options.spirv_dir = a.spirv_dir.empty() ? nullptr : a.spirv_dir.c_str();
  options.schedule_profile = a.schedule_profile.empty() ? nullptr : a.schedule_profile.c_str();
  vktrain_session* session = nullptr;
  check(vktrain_open(a.pte.c_str(), &options, &session), nullptr);
  struct Closer { vktrain_session* s; ~Closer() { vktrain_close(s); } } closer{session};
  std::vector<RssSample> rss{sample_rss("opened", a.pte)};
  VKTRAIN_OUTPUT(vktrain_session_info, info);
  check(vktrain_get_info(session, &info), session);
  if (!info.batch_size || !info.seq_len)
    throw ApiError{VKTRAIN_ERROR_UNSUPPORTED, a.pte + ": this trainer runs token steps (token_ids [batch, seq], labels, "
                                                      "hparams, n_valid)"};
  if (!a.out_adapters.empty() && a.lora_alpha == 0 && info.lora_alpha == 0)
    throw ApiError{VKTRAIN_ERROR_VERIFICATION, "--out-adapters: " + a.pte + " does not record the LoRA alpha it was "
                   "exported with; pass --lora-alpha (the value given to vktrain export --lora-alpha, default 16)"};
  check(vktrain_start_run(session, tokens.data(), tokens.size(), &a.run), session);
  tokens = std::vector<int64_t>();  // the session holds its copy
  rss.push_back(sample_rss("run started", a.pte));
  if (!a.resume.empty()) {
    check(vktrain_load_checkpoint(session, a.resume.c_str()), session);
    check(vktrain_get_info(session, &info), session);
    if (info.step > a.steps)
      throw ApiError{VKTRAIN_ERROR_VERIFICATION, "the run is already at step " + num(info.step) + "; asked to train up "
                     "to step " + num(a.steps) + ", which is behind it"};
  }
  check(vktrain_get_info(session, &info), session);
  std::printf("%s: %s (%s) on %s: %llu dispatches, %llu barriers, %.1f MiB of buffers; batch %lld x %lld, "
              "%llu windows\n", kName, a.pte.c_str(), info.schedule, info.device_name, (unsigned long long)info.dispatches,
              (unsigned long long)info.barriers, info.buffer_bytes / 1048576.0, (long long)info.batch_size,
              (long long)info.seq_len, (unsigned long long)info.n_windows);
  std::fflush(stdout);

  std::string records;
  for (int64_t t = 1; t <= info.step; ++t) {  // a resumed run's log starts with its checkpoint's steps
    VKTRAIN_OUTPUT(vktrain_step_result, r);
    check(vktrain_get_record(session, t, &r), session);
    records += (records.empty() ? "" : ",\n") + record_json(r);
  }
  int status = 0;
  double seconds = 0;
  int64_t done = 0;
  std::vector<double> walls, hosts;  // per step trained here: wall seconds, and wall minus the GPU's (host time)
  for (int64_t t = info.step + 1; t <= a.steps; ++t) {
    VKTRAIN_OUTPUT(vktrain_step_result, r);
    vktrain_status s = vktrain_train_step(session, &r);
    if (s == VKTRAIN_DIVERGED) {  // not recorded (vktrain train's --json lists the steps that trained)
      if (a.progress) std::fputs("\n", stderr);
      std::fprintf(stderr, "%s: %s; training stopped%s\n", kName, vktrain_last_error(session),
                   a.checkpoint.empty() ? "" : ("; the last checkpoint is " + a.checkpoint).c_str());
      status = 1;  // the last checkpoint written stays the last good one
      break;
    }
    check(s, session);
    records += (records.empty() ? "" : ",\n") + record_json(r);
    seconds += r.seconds;
    walls.push_back(r.seconds);
    if (r.gpu_seconds > 0) hosts.push_back(r.seconds - r.gpu_seconds);
    ++done;
    if (a.progress)
      std::fprintf(stderr, "\rtrain %lld/%lld  loss %.4f  lr %.3g  %.1f ms/step ", (long long)t, (long long)a.steps,
                   r.loss, r.lr, 1e3 * seconds / double(done));
    if (a.log_every && (t % a.log_every == 0 || t == a.steps)) {  // train_loop's line
      if (a.progress) std::fputs("\r\033[K", stderr);
      std::printf("step %6lld  loss %.6f  lr %.4g\n", (long long)t, r.loss, r.lr);
      std::fflush(stdout);
    }
    if (!a.checkpoint.empty() && ((a.checkpoint_every && t % a.checkpoint_every == 0) || t == a.steps))
      check(vktrain_save_checkpoint(session, a.checkpoint.c_str()), session);
  }
  if (a.progress && status == 0) std::fputs("\n", stderr);
  rss.push_back(sample_rss("last step", a.pte));
  if (!a.json.empty()) write_file_atomically(a.json, "[\n" + records + "\n]\n", "--json");
  if (status != 0) return status;
  if (!a.state_out.empty()) {
    struct stat st;
    if (stat(a.state_out.c_str(), &st) != 0 && mkdir(a.state_out.c_str(), 0777) != 0)
      refuse(ErrorCode::kIo, "--state-out " + a.state_out + ": cannot create it: " + std::strerror(errno));
    for (size_t i = 0; i < vktrain_state_count(session); ++i) {
      VKTRAIN_OUTPUT(vktrain_tensor_info, t);
      check(vktrain_state_info(session, i, &t), session);
      const std::string name = t.name;
      if (name.find('/') != std::string::npos || name.empty() || name[0] == '.')
        refuse(ErrorCode::kUnsupported, "--state-out: state '" + name + "' is no file name");
      std::vector<uint8_t> data(t.nbytes);
      check(vktrain_read_state(session, t.name, data.data(), data.size()), session);
      save_npy(a.state_out + "/" + name + ".npy", int(t.dtype), std::vector<int64_t>(t.shape, t.shape + t.ndim), data);
    }
  }
  if (!a.out_adapters.empty()) {
    vktrain_adapter_options adapters;
    vktrain_adapter_options_init(&adapters);
    adapters.lora_alpha = a.lora_alpha;
    adapters.base_model = a.have_base_model ? a.base_model.c_str() : nullptr;
    check(vktrain_save_adapters(session, a.out_adapters.c_str(), &adapters), session);
    std::printf("%s: wrote the adapters to %s\n", kName, a.out_adapters.c_str());
  }
  rss.push_back(sample_rss("end", a.pte));
  const uint64_t peak = peak_rss_bytes();
  std::printf("%s: %lld steps, %.1f ms/step, peak RSS %.1f MiB", kName, (long long)done,
              done ? 1e3 * seconds / double(done) : 0.0, peak / 1048576.0);
  if (const RssSample* worst = most_host(rss))
    std::printf(" (host memory at most %.1f MiB, at %s; then %.1f MiB of the .pte and %.1f MiB of device memory "
                "were resident)", worst->bytes.host() / 1048576.0, worst->at.c_str(), worst->bytes.file / 1048576.0,
                worst->bytes.device / 1048576.0);
  std::printf("\n");
  if (!a.summary_json.empty()) {
    struct stat st {};
    stat(a.pte.c_str(), &st);
    VKTRAIN_OUTPUT(vktrain_step_result, last);
    check(vktrain_get_info(session, &info), session);
    if (info.step) check(vktrain_get_record(session, info.step, &last), session);
    write_file_atomically(a.summary_json, "{\n  \"steps\": " + num(done) + ",\n  \"last_step\": " + num(info.step) +
                          ",\n  \"final_loss\": " + (info.step ? real(last.loss) : "null") + ",\n  \"ms_per_step\": " +
                          real(done ? 1e3 * seconds / double(done) : 0.0) + ",\n  \"ms_per_step_median\": " +
                          (walls.empty() ? "null" : real(1e3 * median(walls))) + ",\n  \"host_ms_per_step_median\": " +
                          (hosts.empty() ? "null" : real(1e3 * median(hosts))) + ",\n  \"peak_rss_bytes\": " + num(peak) + rss_json(rss) +
                          ",\n  \"pte_bytes\": " + num(uint64_t(st.st_size)) + ",\n  \"buffer_bytes\": " +
                          num(info.buffer_bytes) + ",\n  \"dispatches\": " + num(info.dispatches) + ",\n  \"barriers\": " +
                          num(info.barriers) + ",\n  \"device\": " + json_quote(info.device_name) + ",\n  \"schedule\": " +
                          json_quote(info.schedule) + "\n}\n", "--summary-json");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args args = parse(argc, argv);
    return train(args);
  } catch (const ApiError& e) {
    std::fprintf(stderr, "%s: error: %s\n", kName, e.message.c_str());
    return e.status == VKTRAIN_ERROR_INTERNAL ? 70 : 2;
  } catch (const LoadError& e) {
    std::fprintf(stderr, "%s: error: %s\n", kName, e.what());
    return e.code() == ErrorCode::kInternal ? 70 : 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", kName, e.what());
    return 70;
  }
}
