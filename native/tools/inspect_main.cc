// vktrain-native-inspect: read and verify a .pte with the native loader, print what it holds.
//
//   vktrain-native-inspect PTE [--json]   exit 0, or 2 with "vktrain-native-inspect: error: ..." (refused)
//   vktrain-native-inspect --schedule VKS [--pte PTE] [--json]
//                                         read and verify a dispatch schedule (with --pte: its placements
//                                         against that program's graph); exit 0, or 2 refused
//   vktrain-native-inspect PTE --constant NAME --out FILE.npy
//                                         the values of the constant tensor NAME of the training step, as the
//                                         runtime uploads them (narrow ones widened, synthetic ones generated)
//   vktrain-native-inspect --devices      the Vulkan devices and their limits
//   vktrain-native-inspect --fuzz-dir DIR every file in DIR, one line each: "NAME<TAB>CODE<TAB>MESSAGE"
//                                         (CODE 0 = loaded, 10..19 = refused: src/status.h); exit 0
//   vktrain-native-inspect --schedule-fuzz-dir DIR [--pte PTE]   the same for schedules
//   ... --schedule VKS | --schedule-fuzz-dir DIR, with --pte PTE --spirv-dir SPV: also plan the step as the
//                                         schedule interpreter does (src/step_plan.h) against lavapipe's caps,
//                                         without opening a device: every dispatch checked against its SPIR-V
// Exit 70: a bug here (an exception outside the loader's refusals).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <new>
#include <string>
#include <vector>

#include "constant_data.h"
#include "devices.h"
#include "npy.h"
#include "pte.h"
#include "schedule.h"
#include "status.h"
#include "step_plan.h"
#include "step_source.h"
#include "summary.h"

namespace {

constexpr const char* kProg = "vktrain-native-inspect";
constexpr int kExitBadInput = 2, kExitInternal = 70;

int usage(const char* why) {
  std::fprintf(stderr, "usage: %s PTE [--json] | PTE --constant NAME --out FILE.npy | --schedule VKS [--pte PTE] [--json] | --devices | --fuzz-dir DIR | "
               "--schedule-fuzz-dir DIR [--pte PTE [--spirv-dir SPV]]\n%s: error: %s\n", kProg, kProg, why);
  return kExitBadInput;
}

// (code, message) of loading one file; bad_alloc is a cap this code failed to apply: reported, never hidden.
std::pair<int, std::string> try_load(const std::string& path, std::unique_ptr<vktrain::Program>* out) {
  try {
    auto program = vktrain::Program::load(path);
    if (out) *out = std::move(program);
    return {0, "ok"};
  } catch (const vktrain::LoadError& e) {
    return {int(e.code()), e.what()};
  } catch (const std::bad_alloc&) {
    return {kExitInternal, path + ": out of memory while loading (an allocation cap is missing)"};
  }
}

// (code, message) of reading and verifying one schedule against `graph` (nullptr: none).
std::pair<int, std::string> try_schedule(const std::string& path, const vktrain::Program* program,
                                         const std::string& spirv_dir, std::string* summary, bool json) {
  try {
    const vktrain::Graph* graph = program ? program->main_method().graph.get() : nullptr;
    std::unique_ptr<vktrain::StepSource> source;
    vktrain::Schedule loaded;
    if (!spirv_dir.empty()) source = vktrain::files_step_source(path, spirv_dir);
    else loaded = vktrain::Schedule::load(path);
    const vktrain::Schedule& schedule = source ? source->schedule() : loaded;
    vktrain::verify_schedule(schedule, graph);
    if (summary) *summary = json ? vktrain::schedule_summary_json(schedule) : vktrain::schedule_summary_text(schedule);
    if (source) vktrain::plan_step(*program, *source, vktrain::lavapipe_caps());
    return {0, "ok"};
  } catch (const vktrain::LoadError& e) {
    return {int(e.code()), e.what()};
  } catch (const std::bad_alloc&) {
    return {kExitInternal, path + ": out of memory while reading the schedule (an allocation cap is missing)"};
  }
}

// The training graph of `pte` (loaded and verified), or a refusal.
const vktrain::Graph* graph_of(const std::string& pte, std::unique_ptr<vktrain::Program>* program, std::string* error) {
  auto result = try_load(pte, program);
  if (result.first) { *error = result.second; return nullptr; }
  return (*program)->main_method().graph.get();
}

int fuzz_dir(const std::string& dir, bool schedules, const vktrain::Program* program, const std::string& spirv_dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return usage(("cannot open directory " + dir + ": " + std::strerror(errno)).c_str());
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') names.push_back(e->d_name);
  ::closedir(d);
  std::sort(names.begin(), names.end());
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a sanitizer abort loses no line: the last one names the file before it
  int worst = 0;
  for (const std::string& name : names) {
    auto result = schedules ? try_schedule(dir + "/" + name, program, spirv_dir, nullptr, false) : try_load(dir + "/" + name, nullptr);
    std::string message = result.second;
    std::replace(message.begin(), message.end(), '\n', ' ');
    std::printf("%s\t%d\t%s\n", name.c_str(), result.first, message.c_str());
    if (result.first == kExitInternal) worst = kExitInternal;
  }
  return worst;
}

// The constant tensor `name` of the training step's graph, written as .npy (its dtype and shape).
int dump_constant(const vktrain::Program& program, const std::string& name, const std::string& out) {
  const vktrain::Graph& graph = *program.main_method().graph;
  for (const auto& v : graph.values) {
    if (v.kind != vktrain::kValueTensor || v.tensor.constant_id < 0 || v.tensor.name != name || v.tensor.is_view) continue;
    std::vector<uint8_t> bytes = vktrain::constant_bytes(graph.constants.at(v.tensor.constant_id), "constant " + name);
    if (bytes.size() < v.tensor.nbytes())
      vktrain::refuse(vktrain::ErrorCode::kVerification, "constant " + name + " holds fewer bytes than its tensor reads");
    bytes.resize(v.tensor.nbytes());
    vktrain::save_npy(out, v.tensor.dtype, v.tensor.shape, bytes);
    return 0;
  }
  vktrain::refuse(vktrain::ErrorCode::kVerification, program.source() + ": no constant tensor named '" + name + "'");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 1 && args[0] == "--devices") {
      std::fputs(vktrain::describe_vulkan_devices().c_str(), stdout);
      return 0;
    }
    if (args.size() == 2 && args[0] == "--fuzz-dir") return fuzz_dir(args[1], false, nullptr, "");
    bool json = false;
    std::string path, schedule, schedule_fuzz, pte, spirv_dir, constant, out;
    for (size_t i = 0; i < args.size(); ++i) {
      const std::string& a = args[i];
      if (a == "--schedule" || a == "--pte" || a == "--schedule-fuzz-dir" || a == "--spirv-dir" || a == "--constant" ||
          a == "--out") {
        if (i + 1 == args.size()) return usage((a + " takes a value").c_str());
        (a == "--schedule" ? schedule : a == "--pte" ? pte : a == "--spirv-dir" ? spirv_dir : a == "--constant" ? constant
         : a == "--out" ? out : schedule_fuzz) = args[++i];
        continue;
      }
      if (a == "--json") json = true;
      else if (a.rfind("--", 0) == 0) return usage(("unknown option " + a).c_str());
      else if (path.empty()) path = a;
      else return usage("expected one PTE file");
    }
    if (!schedule.empty() || !schedule_fuzz.empty()) {
      if (!path.empty() || (!schedule.empty() && !schedule_fuzz.empty()))
        return usage("--schedule and --schedule-fuzz-dir take no PTE argument (use --pte PTE) and not each other");
      std::unique_ptr<vktrain::Program> program;
      const vktrain::Graph* graph = nullptr;
      if (!pte.empty()) {
        std::string error;
        if (!(graph = graph_of(pte, &program, &error))) {
          std::fprintf(stderr, "%s: error: --pte: %s\n", kProg, error.c_str());
          return kExitBadInput;
        }
      }
      if (!spirv_dir.empty() && !program) return usage("--spirv-dir goes with --pte (the step to plan)");
      if (!schedule_fuzz.empty()) return fuzz_dir(schedule_fuzz, true, program.get(), spirv_dir);
      std::string summary;
      auto result = try_schedule(schedule, program.get(), spirv_dir, &summary, json);
      if (result.first) {
        std::fprintf(stderr, "%s: error: %s\n", kProg, result.second.c_str());
        return result.first == kExitInternal ? kExitInternal : kExitBadInput;
      }
      std::fputs(summary.c_str(), stdout);
      return 0;
    }
    if (!pte.empty() || !spirv_dir.empty()) return usage("--pte and --spirv-dir go with --schedule");
    if (path.empty()) return usage("expected a PTE file");
    std::unique_ptr<vktrain::Program> program;
    auto result = try_load(path, &program);
    if (result.first) {
      std::fprintf(stderr, "%s: error: %s\n", kProg, result.second.c_str());
      return result.first == kExitInternal ? kExitInternal : kExitBadInput;
    }
    if (constant.empty() != out.empty()) return usage("--constant NAME and --out FILE.npy go together");
    if (!constant.empty()) return dump_constant(*program, constant, out);
    std::fputs((json ? vktrain::summary_json(*program) : vktrain::summary_text(*program)).c_str(), stdout);
    return 0;
  } catch (const vktrain::LoadError& e) {
    std::fprintf(stderr, "%s: error: %s\n", kProg, e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", kProg, e.what());
    return kExitInternal;
  }
}
