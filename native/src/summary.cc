#include "summary.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "text.h"

namespace vktrain {
namespace {

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A decimal metadata value (planned_memory_bytes, state_bytes), else `fallback`.
uint64_t metadata_number(const Graph& g, const char* key, uint64_t fallback) {
  const std::string* v = g.metadata_value(key);
  if (!v || v->empty() || v->size() > 19 || !std::all_of(v->begin(), v->end(), [](char c) { return c >= '0' && c <= '9'; })) return fallback;
  return std::strtoull(v->c_str(), nullptr, 10);
}

struct DelegateSummary {
  std::vector<std::pair<std::string, size_t>> histogram;  // most common first, ties in first-seen order
  uint64_t constant_bytes = 0, stored_bytes = 0, planned_bytes = 0, state_bytes = 0;
  std::vector<std::pair<std::string, size_t>> forms;
};

template <typename Key>
std::vector<std::pair<Key, size_t>> most_common(const std::vector<Key>& items) {
  std::vector<std::pair<Key, size_t>> counts;
  std::map<Key, size_t> index;
  for (const Key& k : items) {
    auto found = index.find(k);
    if (found == index.end()) { index[k] = counts.size(); counts.emplace_back(k, 1); }
    else ++counts[found->second].second;
  }
  std::stable_sort(counts.begin(), counts.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  return counts;
}

DelegateSummary summarize(const Graph& g) {
  DelegateSummary s;
  std::vector<std::string> names, forms;
  for (const OpCall& op : g.ops) names.push_back(op.name);
  s.histogram = most_common(names);
  for (const Constant& c : g.constants) {
    s.constant_bytes += c.nbytes;
    if (!c.synthetic) s.stored_bytes += c.stored_nbytes;
    forms.push_back(c.stored_form);
  }
  s.forms = most_common(forms);
  uint64_t objects = 0;
  for (const MemoryObject& m : g.memory_objects) objects += m.size_bytes;
  s.planned_bytes = metadata_number(g, "planned_memory_bytes", objects);
  s.state_bytes = metadata_number(g, "state_bytes", 0);
  return s;
}

std::string tensor_json(const Graph& g, int32_t id, const std::string& extra = "") {
  const TensorValue& t = g.values[size_t(id)].tensor;
  return "{\"name\": " + json_quote(t.name) + ", \"dtype\": " + json_quote(lower(data_type_name(t.dtype))) + ", \"shape\": " +
         list(t.shape) + ", \"bytes\": " + num(t.nbytes()) + extra + "}";
}

std::string initial_of(const MutableState& s) {
  return s.initial_constant_id < 0 ? "zeros" : "constant " + num(s.initial_constant_id);
}

template <typename T>
std::string join(const std::vector<T>& items, const std::string& sep, std::string (*f)(const T&)) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + f(items[i]);
  return out;
}

std::string human(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  double v = double(n);
  int u = 0;
  while (v >= 1024 && u < 3) { v /= 1024; ++u; }
  char b[32];
  if (u == 0) std::snprintf(b, sizeof b, "%llu B", (unsigned long long)n);
  else std::snprintf(b, sizeof b, "%.1f %s", v, units[u]);
  return b;
}

size_t count_kind(const Method& m, int kind) {
  return size_t(std::count_if(m.instructions.begin(), m.instructions.end(), [&](const Instruction& i) { return i.kind == kind; }));
}

}  // namespace

std::string summary_json(const Program& p) {
  uint64_t named = 0;
  for (const auto& kv : p.named_data()) named += kv.second.size;
  std::string out = "{\n  \"pte_bytes\": " + num(p.file_bytes()) + ",\n  \"named_data_bytes\": " + num(named) +
                    ",\n  \"main_method\": " + json_quote(p.main_method().name) + ",\n  \"methods\": {";
  for (size_t mi = 0; mi < p.methods().size(); ++mi) {
    const Method& m = p.methods()[mi];
    const Graph& g = *m.graph;
    const DelegateSummary s = summarize(g);
    out += std::string(mi ? "," : "") + "\n    " + json_quote(m.name) + ": {\n      \"delegate_calls\": " + num(count_kind(m, kDelegateCall)) +
           ", \"kernel_calls\": " + num(count_kind(m, kKernelCall)) + ", \"operators\": [";
    for (size_t i = 0; i < m.operators.size(); ++i) out += (i ? ", " : "") + json_quote(m.operators[i]);
    out += "],\n      \"delegate\": {\n        \"backend_id\": " + json_quote(m.delegate_ids[0]) + ", \"payload_bytes\": " +
           num(m.delegate_data[size_t(m.delegate_index)].size) + ", \"format_version\": " + num(g.format_version) +
           ", \"checksummed\": " + (g.checksummed ? "true" : "false") + ",\n        \"ops\": " + num(g.ops.size()) +
           ", \"op_histogram\": {";
    for (size_t i = 0; i < s.histogram.size(); ++i)
      out += (i ? ", " : "") + json_quote(s.histogram[i].first) + ": " + num(s.histogram[i].second);
    out += "},\n        \"constants\": {\"count\": " + num(g.constants.size()) + ", \"bytes\": " + num(s.constant_bytes) +
           ", \"stored_bytes\": " + num(s.stored_bytes) + ", \"stored_forms\": {";
    for (size_t i = 0; i < s.forms.size(); ++i) out += (i ? ", " : "") + json_quote(s.forms[i].first) + ": " + num(s.forms[i].second);
    out += "}},\n        \"memory\": {\"planned_bytes\": " + num(s.planned_bytes) + ", \"memory_objects\": " +
           num(g.memory_objects.size()) + ", \"state_bytes\": " + num(s.state_bytes) + "},\n        \"mutable_state\": [";
    for (size_t i = 0; i < g.mutable_state.size(); ++i)
      out += std::string(i ? ", " : "") + "\n          " +
             tensor_json(g, g.mutable_state[i].state_id, ", \"initial\": " + json_quote(initial_of(g.mutable_state[i])));
    out += "],\n        \"inputs\": [";
    for (size_t i = 0; i < g.inputs.size(); ++i) out += (i ? ", " : "") + tensor_json(g, g.inputs[i]);
    out += "],\n        \"outputs\": [";
    for (size_t i = 0; i < g.outputs.size(); ++i) out += (i ? ", " : "") + tensor_json(g, g.outputs[i]);
    out += "],\n        \"metadata_keys\": [";
    for (size_t i = 0; i < g.metadata.size(); ++i) out += (i ? ", " : "") + json_quote(g.metadata[i].first);
    out += "]\n      }\n    }";
  }
  return out + "\n  }\n}\n";
}

std::string summary_text(const Program& p) {
  uint64_t named = 0;
  for (const auto& kv : p.named_data()) named += kv.second.size;
  std::string out = p.source() + ": " + num(p.file_bytes()) + " bytes, verified\n";
  if (named) out += "named data (constants shared by the methods): " + human(named) + "\n";
  for (const Method& m : p.methods()) {
    const Graph& g = *m.graph;
    const DelegateSummary s = summarize(g);
    out += "method '" + m.name + "': " + num(count_kind(m, kDelegateCall)) + " delegate call(s), " + num(count_kind(m, kKernelCall)) + " kernel call(s)\n";
    out += "  delegate: " + m.delegate_ids[0] + ", payload " + human(m.delegate_data[size_t(m.delegate_index)].size) +
           ", blob format " + num(g.format_version) + (g.checksummed ? ", CRC-32 checked" : ", no checksums") + "\n";
    out += "  ops: " + num(g.ops.size()) + "\n";
    for (const auto& h : s.histogram) {
      char b[16];
      std::snprintf(b, sizeof b, "%5zu", h.second);
      out += "    " + std::string(b) + "  " + h.first + "\n";
    }
    std::string forms;
    for (size_t i = 0; i < s.forms.size(); ++i) forms += (i ? ", " : "") + num(s.forms[i].second) + " " + s.forms[i].first;
    out += "  constants: " + num(g.constants.size()) + ", " + human(s.constant_bytes) + " as read; stored in " +
           human(s.stored_bytes) + " (" + forms + ")\n";
    out += "  planned GPU memory: " + human(s.planned_bytes) + " in " + num(g.memory_objects.size()) + " object(s); state " +
           human(s.state_bytes) + "\n";
    auto io = [&](const std::vector<int32_t>& ids) {
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) {
        const TensorValue& t = g.values[size_t(ids[i])].tensor;
        line += (i ? ", " : "") + t.name + " " + lower(data_type_name(t.dtype)) + list(t.shape);
      }
      return line;
    };
    out += "  inputs: " + io(g.inputs) + "\n  outputs: " + io(g.outputs) + "\n";
    out += "  mutable state: " + num(g.mutable_state.size()) + " tensor(s)\n";
    for (const MutableState& st : g.mutable_state) {
      const TensorValue& t = g.values[size_t(st.state_id)].tensor;
      out += "    " + t.name + " " + lower(data_type_name(t.dtype)) + list(t.shape) + " (initial: " + initial_of(st) + ")\n";
    }
  }
  return out;
}

}  // namespace vktrain
