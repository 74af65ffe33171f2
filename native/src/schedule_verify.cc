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

// verify_schedule.py _check_binding; `sizes` by buffer index (the guard's three after the table), `limit` 0: none.
void check_binding(const Schedule& s, const std::string& where, const ScheduleBinding& binding,
                   const std::vector<uint64_t>& sizes, uint64_t alignment, uint64_t limit) {
  const uint64_t buffer_size = sizes[binding.buffer];
  // size: as planned, else the rest of the buffer (negative past its end: Python's ints, here __int128)
  __int128 size = binding.size_bytes ? __int128(binding.size_bytes) : __int128(buffer_size) - binding.offset;
  if (binding.offset % alignment)
    refuse_at(s, where + ": offset " + num(binding.offset) + " is not a multiple of the planned alignment " +
                 num(alignment));
  if (size <= 0 || binding.offset + size > __int128(buffer_size)) {
    std::string end = size > 0 ? sum(binding.offset, uint64_t(size)) : num(buffer_size);
    refuse_at(s, where + ": range [" + num(binding.offset) + ", " + end + ") is outside the buffer's " +
                 num(buffer_size) + " bytes");
  }
  if (limit && uint64_t(size) > limit)
    refuse_at(s, where + ": binds " + num(uint64_t(size)) + " bytes, more than the planned max storage binding "
                 "size " + num(limit));
}

std::vector<uint64_t> buffer_sizes(const Schedule& s) {
  std::vector<uint64_t> sizes;
  for (const auto& b : s.buffers) sizes.push_back(b.size_bytes);
  return sizes;
}

std::string buffer_key(const Schedule& s, uint32_t index) {  // schedule.py GUARD_KEYS past the table
  static const char* const guard_keys[] = {"guard:slot", "guard:flags", "guard:result"};
  return index < s.buffers.size() ? s.buffers[index].key : guard_keys[index - s.buffers.size()];
}

void check_bindings(const Schedule& s) {
  const uint64_t alignment = s.requirements.min_storage_buffer_offset_alignment;
  if (alignment < 1 || (alignment & (alignment - 1)))
    refuse_at(s, "min_storage_buffer_offset_alignment " + num(alignment) + " is not a power of two");
  const std::vector<uint64_t> sizes = buffer_sizes(s);
  for (size_t index = 0; index < s.dispatches.size(); ++index) {
    const ScheduleDispatch& d = s.dispatches[index];
    for (size_t slot = 0; slot < d.bindings.size(); ++slot)
      check_binding(s, "dispatch " + num(index) + " (" + d.name() + ") binding " + num(slot) + " (buffer " +
                       quoted(buffer_key(s, d.bindings[slot].buffer)) + ")",
                    d.bindings[slot], sizes, alignment, s.requirements.max_storage_buffer_range);
  }
}

// verify_schedule.py _check_dispatch.
void check_dispatch(const Schedule& s, const std::string& where, const ScheduleDispatch& d,
                    const std::vector<std::string>* sources) {
  const auto& needs = s.requirements;
  const std::string base = d.shader.substr(0, d.shader.find('@'));
  if (sources ? std::find(sources->begin(), sources->end(), base) == sources->end() : !is_known_shader(base))
    refuse_at(s, where + ": shader " + quoted(d.shader) + " has no kernel source here (" +
                 num(sources ? std::set<std::string>(sources->begin(), sources->end()).size() : kKnownShaderCount) +
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

void check_dispatches(const Schedule& s, const std::vector<std::string>* sources) {
  for (size_t index = 0; index < s.dispatches.size(); ++index)
    check_dispatch(s, "dispatch " + num(index) + " (" + s.dispatches[index].name() + ")", s.dispatches[index], sources);
}

// verify_schedule.py check_schedule_guard: the guard's tensors inside a slot, its dispatches and their bindings
// (no binding-range limit: the device layer refuses a state tensor over its own).
void check_guard(const Schedule& s, const std::vector<std::string>* sources) {
  const StateGuardPlan& guard = s.state_guard;
  if (!guard.present) return;
  for (size_t index = 0; index < guard.tensors.size(); ++index) {
    const GuardedTensor& t = guard.tensors[index];
    if (t.size_bytes == 0 || __int128(t.slot_offset) + t.size_bytes > __int128(guard.slot_bytes))
      refuse_at(s, "state guard tensor " + num(index) + " (" + quoted(t.name) + ") at [" + num(t.slot_offset) + ", " +
                   sum(t.slot_offset, t.size_bytes) + ") is outside the slot's " + num(guard.slot_bytes) + " bytes");
  }
  std::vector<uint64_t> sizes = buffer_sizes(s);
  sizes.insert(sizes.end(), {guard.slot_bytes, guard.flags_bytes, 4});
  for (auto [part, list] : {std::make_pair("save", &guard.save), std::make_pair("restore", &guard.restore)})
    for (size_t index = 0; index < list->size(); ++index) {
      const ScheduleDispatch& d = (*list)[index];
      const std::string where = std::string("state guard ") + part + " dispatch " + num(index) + " (" + d.name() + ")";
      check_dispatch(s, where, d, sources);
      for (size_t slot = 0; slot < d.bindings.size(); ++slot)
        check_binding(s, where + " binding " + num(slot) + " (buffer " + quoted(buffer_key(s, d.bindings[slot].buffer)) +
                         ")", d.bindings[slot], sizes, s.requirements.min_storage_buffer_offset_alignment, 0);
    }
}

}  // namespace

void verify_schedule(const Schedule& schedule, const Graph* graph, const std::vector<std::string>* shader_sources) {
  if (graph) check_graph(schedule, *graph);
  check_bindings(schedule);
  check_dispatches(schedule, shader_sources);
  check_guard(schedule, shader_sources);
}

}  // namespace vktrain
