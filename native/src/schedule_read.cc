// Reading a schedule: schedule.py deserialize_schedule's checks (after the flatbuffers Verifier, which the
// Python reader has no equivalent of) in its order, each message naming the file, the field and what was expected.
#include <algorithm>
#include <cstring>
#include <map>

#include "flatbuffer_vectors.h"
#include "schedule.h"
#include "schema_generated.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

namespace fb = vkt_blob;

// Python decodes every string as strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    unsigned c = p[i];
    size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    if (!len || i + len > n) return false;
    for (size_t k = 1; k < len; ++k)
      if ((p[i + k] & 0xC0) != 0x80) return false;
    if (len == 3 && ((c == 0xE0 && p[i + 1] < 0xA0) || (c == 0xED && p[i + 1] >= 0xA0))) return false;
    if (len == 4 && ((c == 0xF0 && p[i + 1] < 0x90) || (c == 0xF4 && p[i + 1] >= 0x90))) return false;
    i += len;
  }
  return true;
}

class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void bad(const std::string& message) const { refuse(ErrorCode::kScheduleFormat, source_ + ": " + message); }

  std::string text(const flatbuffers::String* s, const char* field) const {
    if (!s) return "";
    std::string out = copy_string(s);
    if (!valid_utf8(out)) bad(std::string("flatbuffer is corrupt at ") + field + " (UnicodeDecodeError: not UTF-8)");
    return out;
  }

  std::vector<std::string> texts(const flatbuffers::Vector<flatbuffers::Offset<flatbuffers::String>>* v, const char* field) const {
    std::vector<std::string> out;
    if (v)
      for (flatbuffers::uoffset_t i = 0; i < v->size(); ++i) out.push_back(text(v->Get(i), field));
    return out;
  }

  uint32_t buffer_index(uint32_t index, size_t count, const std::string& where) const {
    if (index >= count) bad(where + " names buffer " + num(index) + "; the table has " + num(count));
    return index;
  }

  ScheduleDispatch dispatch(const fb::ScheduleDispatch* t, size_t buffers, size_t index) const {
    const std::string where = "dispatch " + num(index);
    ScheduleDispatch d;
    if (t->bindings())
      for (flatbuffers::uoffset_t i = 0; i < t->bindings()->size(); ++i) {
        const auto* b = t->bindings()->Get(i);
        if (int(b->access()) > int(fb::BindingAccess::READ_WRITE))
          bad(where + " binding " + num(i) + " has unknown access " + num(int(b->access())));
        d.bindings.push_back({buffer_index(b->buffer(), buffers, where + " binding " + num(i)), b->offset(),
                              b->size_bytes(), int(b->access())});
      }
    // dict(spec_constants): a repeated id keeps its first place and its last value.
    std::map<uint32_t, const fb::SpecConstant*> specs;
    std::vector<uint32_t> spec_order;
    if (t->spec_constants())
      for (flatbuffers::uoffset_t i = 0; i < t->spec_constants()->size(); ++i) {
        const auto* s = t->spec_constants()->Get(i);
        if (int(s->kind()) > int(fb::SpecKind::BOOL))
          bad("spec constant " + num(s->id()) + " has unknown kind " + num(int(s->kind())));
        if (!specs.count(s->id())) spec_order.push_back(s->id());
        specs[s->id()] = s;
      }
    d.shader = text(t->shader(), "Schedule.dispatches[].shader");
    d.label = text(t->label(), "Schedule.dispatches[].label");
    auto invalid = [&](const std::string& message) { bad(where + ": " + message); };
    if (d.shader.empty()) invalid("Dispatch.shader must be a non-empty shader name, got ''");
    std::vector<uint32_t> groups = vec<uint32_t>(t->groups());
    if (groups.empty() || groups.size() > 3)
      invalid("groups must have 1 to 3 axes, got " + num(groups.size()) + ": " + tuple(groups));
    for (uint32_t count : groups)
      if (count < 1) invalid("every group count must be an int >= 1, got " + tuple(groups));
    for (size_t axis = 0; axis < 3; ++axis) d.groups[axis] = axis < groups.size() ? groups[axis] : 1;
    d.push_bytes = t->push_constants() ? t->push_constants()->size() : 0;
    if (t->push_constants()) d.push_constants.assign(t->push_constants()->begin(), t->push_constants()->end());
    if (d.push_bytes % 4) invalid(d.name() + ": push_constants must be a multiple of 4 bytes, got " + num(d.push_bytes));
    for (uint32_t id : spec_order) {
      const auto* s = specs[id];
      if (s->kind() == fb::SpecKind::INT && (s->int_value() < -(int64_t(1) << 31) || s->int_value() >= (int64_t(1) << 32)))
        invalid("spec constant " + num(id) + " = " + num(s->int_value()) + " does not fit in 32 bits");
    }
    std::sort(spec_order.begin(), spec_order.end());  // Dispatch stores them sorted by id
    for (uint32_t id : spec_order) {
      const auto* s = specs[id];
      d.spec_constants.push_back({id, SpecKind(int(s->kind())), s->int_value(), s->float_value()});
    }
    d.local_size = vec<uint32_t>(t->local_size());
    if (!d.local_size.empty()) {
      bool ok = d.local_size.size() == 3;
      for (uint32_t v : d.local_size) ok = ok && v >= 1;
      if (!ok) invalid(d.name() + ": local_size must be 3 ints >= 1, got " + tuple(d.local_size));
      std::vector<uint32_t> clash;
      for (uint32_t id : {0u, 1u, 2u})
        if (specs.count(id)) clash.push_back(id);
      if (!clash.empty())
        invalid(d.name() + ": spec constant ids " + list(clash) + " are reserved for local_size; kernel constants "
                "start at id 3");
    }
    return d;
  }

  // A Python tuple's repr: (1,) for one item.
  static std::string tuple(const std::vector<uint32_t>& v) {
    std::string inner = list(v);
    inner = inner.substr(1, inner.size() - 2);
    return "(" + inner + (v.size() == 1 ? ",)" : ")");
  }

 private:
  std::string source_;
};

}  // namespace

const char* buffer_role_name(int role) {
  static const char* const names[kNumBufferRoles] = {"constant", "state", "shared", "input", "output", "intermediate",
                                                     "scratch"};
  return role >= 0 && role < kNumBufferRoles ? names[role] : nullptr;
}

std::vector<const ScheduleDispatch*> Schedule::module_dispatches() const {
  std::vector<const ScheduleDispatch*> out;
  for (const auto* list : {&dispatches, &state_guard.save, &state_guard.restore})
    for (const auto& d : *list) out.push_back(&d);
  return out;
}

Schedule Schedule::load(const std::string& path) {
  FileMap map(path);
  return parse(map.bytes(), path);
}

Schedule Schedule::parse(Bytes unaligned, const std::string& path) {
  // An embedded schedule sits anywhere in its blob's byte vector: read an 8-aligned copy (the generated
  // readers load scalars in place).
  std::vector<uint64_t> aligned((unaligned.size + 7) / 8);
  if (unaligned.size) std::memcpy(aligned.data(), unaligned.data, unaligned.size);
  Bytes data{reinterpret_cast<const uint8_t*>(aligned.data()), unaligned.size};
  Reader r(path);
  if (data.size < 8 || std::memcmp(data.data + 4, "VKS1", 4) != 0)
    r.bad("not a vktrain schedule: " + num(data.size) + " bytes without the VKS1 identifier");
  if (data.size >= FLATBUFFERS_MAX_BUFFER_SIZE)
    refuse(ErrorCode::kLimit, path + ": schedule is " + num(data.size) + " bytes, over the flatbuffers limit of 2 GiB");
  flatbuffers::Verifier verifier(data.data, data.size);
  if (!verifier.VerifyBuffer<fb::Schedule>("VKS1"))
    r.bad("schedule flatbuffer fails the flatbuffers Verifier (an offset, length or table lies outside its " +
          num(data.size) + " bytes, or is misaligned)");
  const auto* root = flatbuffers::GetRoot<fb::Schedule>(data.data);
  ScopedCopyBudget budget(data.size, "schedule flatbuffer");

  Schedule s;
  s.source = path;
  s.format_version = root->format_version();
  if (s.format_version != kScheduleFormatVersion)
    r.bad("schedule format version " + num(s.format_version) + "; this vktrain reads version " +
          num(kScheduleFormatVersion));
  if (root->buffers())
    for (flatbuffers::uoffset_t i = 0; i < root->buffers()->size(); ++i) {
      const auto* t = root->buffers()->Get(i);
      if (!buffer_role_name(int(t->role()))) r.bad("buffer " + num(i) + " has unknown role " + num(int(t->role())));
      s.buffers.push_back({r.text(t->key(), "Schedule.buffers[].key"), t->size_bytes(), int(t->role())});
    }
  if (root->placements())
    for (flatbuffers::uoffset_t i = 0; i < root->placements()->size(); ++i) {
      const auto* t = root->placements()->Get(i);
      s.placements.push_back({t->value_id(), r.buffer_index(t->buffer(), s.buffers.size(), "placement " + num(i)),
                              t->offset(), t->size_bytes()});
    }
  if (root->dispatches())
    for (flatbuffers::uoffset_t i = 0; i < root->dispatches()->size(); ++i)
      s.dispatches.push_back(r.dispatch(root->dispatches()->Get(i), s.buffers.size(), i));
  const auto* needs = root->requirements();
  if (!needs) r.bad("the schedule has no requirements table");
  auto& q = s.requirements;
  q.api = r.text(needs->api(), "Schedule.requirements.api");
  q.max_storage_buffer_range = needs->max_storage_buffer_range();
  q.min_storage_buffer_offset_alignment = needs->min_storage_buffer_offset_alignment();
  q.max_shared_memory_bytes = needs->max_shared_memory_bytes();
  q.max_workgroup_invocations = needs->max_workgroup_invocations();
  q.max_workgroup_size_x = needs->max_workgroup_size_x();
  q.subgroup_size = needs->subgroup_size();
  q.subgroup_operations = r.texts(needs->subgroup_operations(), "Schedule.requirements.subgroup_operations");
  q.float16 = needs->float16();
  q.int64 = needs->int64();
  q.cooperative_matrix = vec<uint32_t>(needs->cooperative_matrix());
  const auto* gemm = root->gemm();
  if (!gemm) r.bad("the schedule has no gemm table");
  s.gemm_precision = r.text(gemm->precision(), "Schedule.gemm.precision");
  s.gemm_tensor_cores = gemm->tensor_cores();
  r.text(gemm->reason(), "Schedule.gemm.reason");
  r.text(gemm->fp32_tuning(), "Schedule.gemm.fp32_tuning");
  s.graph_digest = r.text(root->graph_digest(), "Schedule.graph_digest");
  s.tensor_core_ops = r.texts(root->tensor_core_ops(), "Schedule.tensor_core_ops");
  s.max_binding_bytes = root->max_binding_bytes();
  if (const auto* guard = root->state_guard()) {
    // The guard's bindings may name the three guard buffers just past the table (schedule.py GUARD_KEYS).
    StateGuardPlan& g = s.state_guard;
    g.present = true;
    g.slot_bytes = guard->slot_bytes();
    g.flags_bytes = guard->flags_bytes();
    if (guard->tensors())
      for (flatbuffers::uoffset_t i = 0; i < guard->tensors()->size(); ++i) {
        const auto* t = guard->tensors()->Get(i);
        g.tensors.push_back({r.text(t->name(), "Schedule.state_guard.tensors[].name"), t->slot_offset(), t->size_bytes()});
      }
    for (auto [list, out] : {std::make_pair(guard->save(), &g.save), std::make_pair(guard->restore(), &g.restore)})
      if (list)
        for (flatbuffers::uoffset_t i = 0; i < list->size(); ++i)
          out->push_back(r.dispatch(list->Get(i), s.buffers.size() + 3, i));
  }
  std::map<std::string, int> seen;
  std::vector<std::string> twice;
  for (const auto& b : s.buffers)
    if (++seen[b.key] == 2) twice.push_back("'" + b.key + "'");
  if (!twice.empty()) {
    std::sort(twice.begin(), twice.end());
    std::string names;
    for (const auto& k : twice) names += (names.empty() ? "" : ", ") + k;
    r.bad("the buffer table names a buffer twice: [" + names + "]");
  }
  return s;
}

}  // namespace vktrain
