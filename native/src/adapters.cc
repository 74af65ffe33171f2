#include "adapters.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "constant_data.h"
#include "json.h"
#include "safetensors.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr const char* kStatePrefix = "model.";      // contract.py MODEL_PREFIX
constexpr const char* kPeftPrefix = "base_model.model.";  // peft_adapters.py PEFT_PREFIX
const char* const kParts[] = {"lora_A", "lora_B"};

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// json.dumps's string (ensure_ascii): \" \\ \n \r \t \b \f, other controls and every non-ASCII code point as
// \uXXXX (UTF-16, surrogate pairs past U+FFFF).
std::string py_json_string(const std::string& s) {
  std::string out = "\"";
  auto u = [&](uint32_t c) { char b[12]; std::snprintf(b, sizeof b, "\\u%04x", c & 0xFFFF); out += b; };
  for (size_t i = 0; i < s.size();) {
    unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      if (c == '"') out += "\\\"";
      else if (c == '\\') out += "\\\\";
      else if (c == '\n') out += "\\n";
      else if (c == '\r') out += "\\r";
      else if (c == '\t') out += "\\t";
      else if (c == '\b') out += "\\b";
      else if (c == '\f') out += "\\f";
      else if (c < 0x20) u(c);
      else out += char(c);
      continue;
    }
    int extra = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
    uint32_t cp = c & (0x3F >> extra);
    for (int k = 1; k <= extra && i + k < s.size(); ++k) cp = cp << 6 | (uint8_t(s[i + k]) & 0x3F);
    i += size_t(extra) + 1;
    if (cp >= 0x10000) { cp -= 0x10000; u(0xD800 + (cp >> 10)); u(0xDC00 + (cp & 0x3FF)); }
    else u(cp);
  }
  return out + "\"";
}

std::string json_list(const std::vector<std::string>& items, const std::string& indent) {  // indent=1, nested once
  if (items.empty()) return "[]";
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += std::string(i ? "," : "") + "\n" + indent + " " + py_json_string(items[i]);
  return out + "\n" + indent + "]";
}

struct Recorded {  // adapters.py ProgramAdapters: what the export recorded (absent: std::nullopt)
  std::optional<double> lora_alpha;
  std::optional<std::string> base_model, source_model;
  std::optional<std::vector<std::string>> target_modules, layers;
};

Recorded recorded_metadata(const Graph& graph, const std::string& where) {
  Recorded r;
  auto bad = [&](const char* key, const std::string& value, const char* expected) {
    refuse(ErrorCode::kVerification, where + ": metadata '" + key + "' is '" + value + "'; expected " + expected);
  };
  if (const std::string* v = graph.metadata_value("lora_alpha")) {
    char* end = nullptr;
    double alpha = std::strtod(v->c_str(), &end);
    while (end && *end == ' ') ++end;
    if (v->empty() || *end || !std::isfinite(alpha) || !(alpha > 0)) bad("lora_alpha", *v, "a positive number");
    r.lora_alpha = alpha;
  }
  if (const std::string* v = graph.metadata_value("base_model_name_or_path")) r.base_model = *v;
  if (const std::string* v = graph.metadata_value("source_model")) r.source_model = *v;
  for (auto [key, field] : {std::pair{"lora_target_modules", &r.target_modules}, std::pair{"lora_layers", &r.layers}}) {
    const std::string* v = graph.metadata_value(key);
    if (!v) continue;
    Json names = Json::parse(*v, where + ": metadata '" + key + "'", ErrorCode::kVerification);
    std::vector<std::string> list;
    for (const Json& n : names.items) {
      if (n.kind != Json::kString || n.text.empty()) bad(key, *v, "a JSON list of module names");
      list.push_back(n.text);
    }
    if (names.kind != Json::kArray || list.empty()) bad(key, *v, "a JSON list of module names");
    *field = list;
  }
  return r;
}

}  // namespace

double recorded_lora_alpha(const Graph& graph, const std::string& program) {
  return recorded_metadata(graph, program).lora_alpha.value_or(0);
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  char b[64];
  auto r = std::to_chars(b, b + sizeof b, value, std::chars_format::scientific);  // shortest round-trip digits
  std::string sci(b, r.ptr);  // "-1.25e-05"
  std::string sign = sci[0] == '-' ? "-" : "";
  if (!sign.empty()) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = std::atoi(sci.c_str() + e + 1);
  if (exponent >= -4 && exponent < 16) {  // float_repr_style 'short': fixed notation here
    std::string out;
    if (exponent < 0) out = "0." + std::string(size_t(-exponent - 1), '0') + digits;
    else if (size_t(exponent) + 1 >= digits.size()) out = digits + std::string(size_t(exponent) + 1 - digits.size(), '0') + ".0";
    else out = digits.substr(0, size_t(exponent) + 1) + "." + digits.substr(size_t(exponent) + 1);
    return sign + out;
  }
  std::string mantissa = digits.size() > 1 ? digits.substr(0, 1) + "." + digits.substr(1) : digits;
  char x[16];
  std::snprintf(x, sizeof x, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return sign + mantissa + x;
}

void save_peft_adapters(const std::string& directory, const Graph& graph, const StepInterpreter& step,
                        const AdapterOptions& options, const std::string& program) {
  const std::string where = "--out-adapters " + directory;
  // {**frozen lora constants, **lora state} in that order (adapters.py runner_frozen_lora + the state).
  std::vector<std::pair<std::string, HostTensor>> lora;
  auto is_lora = [](const std::string& name) { return ends_with(name, ".lora_A") || ends_with(name, ".lora_B"); };
  for (const Value& v : graph.values) {
    if (v.kind != kValueTensor || v.tensor.constant_id < 0 || !is_lora(v.tensor.name)) continue;
    HostTensor t{v.tensor.dtype, v.tensor.shape,
                 constant_bytes(graph.constants.at(size_t(v.tensor.constant_id)), "constant " + v.tensor.name)};
    lora.emplace_back(v.tensor.name, std::move(t));
  }
  for (const std::string& name : step.state_names()) {
    if (!is_lora(name)) continue;
    auto same = std::find_if(lora.begin(), lora.end(), [&](const auto& kv) { return kv.first == name; });
    if (same != lora.end()) same->second = step.read_state(name);
    else lora.emplace_back(name, step.read_state(name));
  }
  // adapters_from_state: {module: (A, B)} in order of first appearance.
  std::vector<std::string> modules;
  std::map<std::string, std::map<std::string, const HostTensor*>> parts;
  for (const auto& [name, t] : lora) {
    if (name.rfind(kStatePrefix, 0) != 0) continue;
    std::string rest = name.substr(std::strlen(kStatePrefix));
    size_t dot = rest.rfind('.');
    std::string module = rest.substr(0, dot), part = rest.substr(dot + 1);
    if (module.empty()) continue;
    if (!parts.count(module)) modules.push_back(module);
    parts[module][part] = &t;
  }
  if (modules.empty())
    refuse(ErrorCode::kUnsupported, program + ": no LoRA tensors (model.<module>.lora_A / .lora_B) in the program's state");
  std::map<std::string, int64_t> ranks;
  std::vector<std::pair<std::string, const HostTensor*>> tensors;
  for (const std::string& module : modules) {
    const auto& pair = parts[module];
    for (const char* part : kParts)
      if (!pair.count(part))
        refuse(ErrorCode::kVerification, program + ": module '" + module + "' has " + (pair.count("lora_A") ? "lora_A" : "lora_B") +
                                             " but no " + part + " in the program's state");
    const HostTensor &a = *pair.at("lora_A"), &b = *pair.at("lora_B");
    if (a.shape.size() != 2 || b.shape.size() != 2 || a.shape[0] != b.shape[1] || a.dtype != kFloat32 || b.dtype != kFloat32)
      refuse(ErrorCode::kVerification, program + ": " + module + ": lora_A is [r, in] and lora_B is [out, r] with the same r, "
                                           "float32; got " + list(a.shape) + " and " + list(b.shape));
    ranks[module] = a.shape[0];
    tensors.emplace_back(kPeftPrefix + module + ".lora_A.weight", &a);
    tensors.emplace_back(kPeftPrefix + module + ".lora_B.weight", &b);
  }
  Recorded recorded = recorded_metadata(graph, program);
  std::vector<std::string> sorted_modules = modules;
  std::sort(sorted_modules.begin(), sorted_modules.end());
  if (recorded.layers) {  // ProgramAdapters.check_layers
    std::vector<std::string> layers = *recorded.layers;
    std::sort(layers.begin(), layers.end());
    if (layers != sorted_modules)
      refuse(ErrorCode::kVerification, program + ": the state holds adapters of " + std::to_string(sorted_modules.size()) +
                                           " modules that are not the adapted layers its metadata records (" +
                                           std::to_string(layers.size()) + ")");
  }
  double alpha = options.lora_alpha > 0 ? options.lora_alpha : recorded.lora_alpha.value_or(0);
  if (!(options.lora_alpha >= 0) || !std::isfinite(options.lora_alpha))
    refuse(ErrorCode::kVerification, where + ": lora_alpha must be a positive number, got " + real(options.lora_alpha));
  if (!(alpha > 0))
    refuse(ErrorCode::kUnsupported, where + ": " + program + " does not record the LoRA alpha it was exported with; give "
                                        "it (vktrain-train --lora-alpha: the value given to vktrain export --lora-alpha, default 16)");
  std::optional<std::string> base = options.base_model ? std::optional<std::string>(options.base_model)
                                    : recorded.base_model ? recorded.base_model : recorded.source_model;
  // adapter_config: the most common rank is r (the first of equally common ones), the others rank_pattern.
  std::map<int64_t, int> counts;
  for (const auto& m : modules) ++counts[ranks[m]];
  int64_t rank = ranks[modules[0]];
  for (const auto& m : modules)
    if (counts[ranks[m]] > counts[rank]) rank = ranks[m];
  std::vector<std::string> targets = recorded.target_modules ? *recorded.target_modules : modules;
  std::sort(targets.begin(), targets.end());
  std::string pattern;
  for (const auto& m : sorted_modules)
    if (ranks[m] != rank) pattern += std::string(pattern.empty() ? "" : ",") + "\n  " + py_json_string(m) + ": " + num(ranks[m]);
  std::string config = "{\n \"peft_type\": \"LORA\",\n \"task_type\": \"CAUSAL_LM\",\n \"base_model_name_or_path\": " +
                       (base ? py_json_string(*base) : "null") + ",\n \"r\": " + num(rank) + ",\n \"lora_alpha\": " +
                       python_float_repr(alpha) + ",\n \"target_modules\": " + json_list(targets, " ") +
                       ",\n \"rank_pattern\": " + (pattern.empty() ? "{}" : "{" + pattern + "\n }") +
                       ",\n \"alpha_pattern\": {},\n \"lora_dropout\": 0.0,\n \"bias\": \"none\",\n \"fan_in_fan_out\": false,\n"
                       " \"use_rslora\": false,\n \"modules_to_save\": null,\n \"inference_mode\": true\n}\n";

  // directory.mkdir(parents=True, exist_ok=True)
  for (size_t at = 1; at <= directory.size(); ++at) {
    if (at < directory.size() && directory[at] != '/') continue;
    std::string prefix = directory.substr(0, at);
    struct stat st;
    if (stat(prefix.c_str(), &st) == 0) {
      if (!S_ISDIR(st.st_mode)) refuse(ErrorCode::kIo, where + ": " + prefix + " exists and is not a directory");
    } else if (mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) {
      refuse(ErrorCode::kIo, where + ": cannot create " + prefix + ": " + std::strerror(errno));
    }
  }
  write_file_atomically(directory + "/adapter_model.safetensors", safetensors_bytes({{"format", "pt"}}, tensors), "--out-adapters");
  write_file_atomically(directory + "/adapter_config.json", config, "--out-adapters");
}

}  // namespace vktrain
