// What `vktrain-native-inspect --schedule` prints: the buffer table by role, the dispatches by shader variant,
// the requirements (text, or --json with the same fields tests compare with the Python Schedule's).
#include <map>

#include "schedule.h"
#include "text.h"

namespace vktrain {
namespace {

struct RoleTotal { size_t count = 0; uint64_t bytes = 0; };

std::map<int, RoleTotal> by_role(const Schedule& s) {
  std::map<int, RoleTotal> out;
  for (const auto& b : s.buffers) { out[b.role].count++; out[b.role].bytes += b.size_bytes; }
  return out;
}

std::map<std::string, size_t> variants(const Schedule& s) {
  std::map<std::string, size_t> out;
  for (const auto& d : s.dispatches) out[d.shader]++;
  return out;
}

std::string json_strings(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + json_quote(v[i]);
  return out + "]";
}

const char* boolean(bool b) { return b ? "true" : "false"; }

}  // namespace

std::string schedule_summary_json(const Schedule& s) {
  const auto& q = s.requirements;
  std::string out = "{\"format_version\": " + num(s.format_version) + ", \"graph_digest\": " + json_quote(s.graph_digest) +
                    ", \"buffers\": {";
  bool first = true;
  for (const auto& [role, total] : by_role(s)) {
    out += std::string(first ? "" : ", ") + json_quote(buffer_role_name(role)) + ": {\"count\": " + num(total.count) +
           ", \"bytes\": " + num(total.bytes) + "}";
    first = false;
  }
  out += "}, \"placements\": " + num(s.placements.size()) + ", \"dispatches\": " + num(s.dispatches.size()) +
         ", \"shader_variants\": {";
  first = true;
  for (const auto& [shader, count] : variants(s)) {
    out += std::string(first ? "" : ", ") + json_quote(shader) + ": " + num(count);
    first = false;
  }
  out += "}, \"requirements\": {\"api\": " + json_quote(q.api) + ", \"max_storage_buffer_range\": " +
         num(q.max_storage_buffer_range) + ", \"min_storage_buffer_offset_alignment\": " +
         num(q.min_storage_buffer_offset_alignment) + ", \"max_shared_memory_bytes\": " + num(q.max_shared_memory_bytes) +
         ", \"max_workgroup_invocations\": " + num(q.max_workgroup_invocations) + ", \"max_workgroup_size_x\": " +
         num(q.max_workgroup_size_x) + ", \"subgroup_size\": " + num(q.subgroup_size) + ", \"subgroup_operations\": " +
         json_strings(q.subgroup_operations) + ", \"float16\": " + boolean(q.float16) + ", \"int64\": " +
         boolean(q.int64) + ", \"cooperative_matrix\": " + list(q.cooperative_matrix) + "}, \"gemm\": {\"precision\": " +
         json_quote(s.gemm_precision) + ", \"tensor_cores\": " + boolean(s.gemm_tensor_cores) +
         "}, \"max_binding_bytes\": " + num(s.max_binding_bytes) + ", \"tensor_core_ops\": " +
         num(s.tensor_core_ops.size()) + "}\n";
  return out;
}

std::string schedule_summary_text(const Schedule& s) {
  const auto& q = s.requirements;
  std::string out = s.source + ": schedule format " + num(s.format_version) + ", graph " + s.graph_digest.substr(0, 16) +
                    "..., " + num(s.placements.size()) + " placements\nbuffers:\n";
  for (const auto& [role, total] : by_role(s))
    out += "  " + std::string(buffer_role_name(role)) + ": " + num(total.count) + " (" + num(total.bytes) + " bytes)\n";
  out += "dispatches: " + num(s.dispatches.size()) + " (" + num(variants(s).size()) + " shader variants)\n";
  for (const auto& [shader, count] : variants(s)) out += "  " + shader + ": " + num(count) + "\n";
  out += "requires: " + q.api + ", bindings up to " + num(q.max_storage_buffer_range) + " bytes aligned to " +
         num(q.min_storage_buffer_offset_alignment) + ", " + num(q.max_shared_memory_bytes) + " bytes shared memory, " +
         num(q.max_workgroup_invocations) + " invocations (" + num(q.max_workgroup_size_x) + " in x)";
  if (q.subgroup_size) out += ", subgroups of " + num(q.subgroup_size);
  for (const auto& op : q.subgroup_operations) out += ", subgroup " + op;
  if (q.float16) out += ", float16";
  if (q.int64) out += ", int64";
  if (!q.cooperative_matrix.empty()) out += ", cooperative matrix " + list(q.cooperative_matrix);
  out += "\ngemm: " + s.gemm_precision + (s.gemm_tensor_cores ? " on tensor cores" : "") + ", " +
         num(s.tensor_core_ops.size()) + " tensor-core ops\n";
  return out;
}

}  // namespace vktrain
