// verify_schedule.py ported: check_schedule_graph (its placement checks), check_schedule_bindings and
// check_schedule_dispatches, in order, each refusal "SOURCE: ..." with the Python message.
//
// The graph digest is not compared: schedule.py graph_digest is the sha256 of the Python reprs of the graph's
// dataclasses, which only the Python reader can reproduce. What the digest protects natively is what the
// placement checks below check against the graph itself: every used tensor placed once, with its bytes.
#include <algorithm>
#include <set>

#include "known_shaders.h"
#include "schedule.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

[[noreturn]] void refuse_at(const Schedule& s, const std::string& message) {
  refuse(ErrorCode::kVerification, s.source + ": " + message);
}

uint64_t round4(uint64_t nbytes) { return std::max<uint64_t>(4, (nbytes + 3) / 4 * 4); }

std::string quoted(const std::string& s) { return "'" + s + "'"; }  // Python's repr of a plain string

std::string tuple3(const std::vector<uint32_t>& v) {
  std::string out = "(";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + num(v[i]);
  return out + (v.size() == 1 ? ",)" : ")");
}

// graph.py used_tensor_ids: inputs, outputs, state and updates, every op's arguments and outputs (a list's
// items), and the storage those view; tensors only, ascending. Ids were checked against the value table.
std::vector<int32_t> used_tensor_ids(const Graph& g) {
  std::set<int32_t> used(g.inputs.begin(), g.inputs.end());
  used.insert(g.outputs.begin(), g.outputs.end());
  for (const auto& s : g.mutable_state) used.insert({s.state_id, s.update_id});
  for (const auto& op : g.ops)
    for (const auto* ids : {&op.args, &op.outputs})
      for (int32_t id : *ids) {
        const Value& v = g.values[size_t(id)];
        if (v.kind == kValueList) used.insert(v.items.begin(), v.items.end());
        else used.insert(id);
      }
  std::set<int32_t> storage;
  for (int32_t id : used) {
    const Value& v = g.values[size_t(id)];
    if (v.kind == kValueTensor && v.tensor.storage_of >= 0) storage.insert(v.tensor.storage_of);
  }
  used.insert(storage.begin(), storage.end());
  std::vector<int32_t> out;
  for (int32_t id : used)
    if (g.values[size_t(id)].kind == kValueTensor) out.push_back(id);
  return out;
}

void check_graph(const Schedule& s, const Graph& g) {
  std::set<int32_t> placed;
  for (const auto& p : s.placements) {
    const std::string value = "value " + num(p.value_id);
    if (!placed.insert(p.value_id).second) refuse_at(s, value + " is placed twice");
    if (p.value_id < 0 || size_t(p.value_id) >= g.values.size() || g.values[size_t(p.value_id)].kind != kValueTensor)
      refuse_at(s, "a placement names " + value + ", which is not a tensor of the graph");
    uint64_t expected = round4(g.values[size_t(p.value_id)].tensor.stored_nbytes());
    if (p.size_bytes != expected)
      refuse_at(s, value + " is placed with " + num(p.size_bytes) + " bytes, the graph records " + num(expected));
    const ScheduleBuffer& b = s.buffers[p.buffer];
    if ((unsigned __int128)p.offset + p.size_bytes > b.size_bytes)
      refuse_at(s, value + " at [" + num(p.offset) + ", " + sum(p.offset, p.size_bytes) + ") is outside buffer " +
                   quoted(b.key) + " of " + num(b.size_bytes) + " bytes");
  }
  std::vector<int32_t> missing;
  for (int32_t id : used_tensor_ids(g))
    if (!placed.count(id) && missing.size() < 10) missing.push_back(id);
  if (!missing.empty()) refuse_at(s, "tensor values " + list(missing) + " of the graph have no placement");
}

void check_bindings(const Schedule& s) {
  const uint64_t alignment = s.requirements.min_storage_buffer_offset_alignment;
  const uint64_t limit = s.requirements.max_storage_buffer_range;
  if (alignment < 1 || (alignment & (alignment - 1)))
    refuse_at(s, "min_storage_buffer_offset_alignment " + num(alignment) + " is not a power of two");
  for (size_t index = 0; index < s.dispatches.size(); ++index) {
    const ScheduleDispatch& d = s.dispatches[index];
    for (size_t slot = 0; slot < d.bindings.size(); ++slot) {
      const ScheduleBinding& binding = d.bindings[slot];
      const ScheduleBuffer& buffer = s.buffers[binding.buffer];
      const std::string where = "dispatch " + num(index) + " (" + d.name() + ") binding " + num(slot) + " (buffer " +
                                quoted(buffer.key) + ")";
      // size: as planned, else the rest of the buffer (negative past its end: Python's ints, here __int128)
      __int128 size = binding.size_bytes ? __int128(binding.size_bytes) : __int128(buffer.size_bytes) - binding.offset;
      if (binding.offset % alignment)
        refuse_at(s, where + ": offset " + num(binding.offset) + " is not a multiple of the planned alignment " +
                     num(alignment));
      if (size <= 0 || binding.offset + size > __int128(buffer.size_bytes)) {
        std::string end = size > 0 ? sum(binding.offset, uint64_t(size)) : num(buffer.size_bytes);
        refuse_at(s, where + ": range [" + num(binding.offset) + ", " + end + ") is outside the buffer's " +
                     num(buffer.size_bytes) + " bytes");
      }
      if (uint64_t(size) > limit)
        refuse_at(s, where + ": binds " + num(uint64_t(size)) + " bytes, more than the planned max storage binding "
                     "size " + num(limit));
    }
  }
}

void check_dispatches(const Schedule& s) {
  const auto& needs = s.requirements;
  for (size_t index = 0; index < s.dispatches.size(); ++index) {
    const ScheduleDispatch& d = s.dispatches[index];
    const std::string where = "dispatch " + num(index) + " (" + d.name() + ")";
    if (!is_known_shader(d.shader.substr(0, d.shader.find('@'))))
      refuse_at(s, where + ": shader " + quoted(d.shader) + " has no kernel source here (" + num(kKnownShaderCount) +
                   " known)");
    if (d.push_bytes > kMaxPushBytes)
      refuse_at(s, where + ": pushes " + num(d.push_bytes) + " bytes, more than the " + num(kMaxPushBytes) +
                   " every device takes");
    if (!d.local_size.empty()) {
      unsigned __int128 invocations = 1;
      for (uint32_t v : d.local_size) invocations *= v;  // at most 2^96: no overflow
      if (invocations > needs.max_workgroup_invocations || d.local_size[0] > needs.max_workgroup_size_x)
        refuse_at(s, where + ": local size " + tuple3(d.local_size) + " is over the planned workgroup limits (" +
                     num(needs.max_workgroup_invocations) + " invocations, " + num(needs.max_workgroup_size_x) +
                     " in x)");
    }
    unsigned __int128 pieces = 1;
    for (uint32_t count : d.groups) pieces *= (count + kGuaranteedGroupCount - 1) / kGuaranteedGroupCount;
    if (pieces > kMaxSplitDispatches)
      refuse_at(s, where + ": " + tuple3({d.groups.begin(), d.groups.end()}) + " work groups would be split into " +
                   sum(uint64_t(pieces), 0) + " dispatches, more than " + num(kMaxSplitDispatches));
  }
}

}  // namespace

void verify_schedule(const Schedule& schedule, const Graph* graph) {
  if (graph) check_graph(schedule, *graph);
  check_bindings(schedule);
  check_dispatches(schedule);
}

}  // namespace vktrain
