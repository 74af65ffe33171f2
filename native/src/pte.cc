#include "pte.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <unistd.h>

#include "program_generated.h"
#include "flatbuffer_vectors.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

namespace et = executorch_flatbuffer;
constexpr uint64_t kExtendedHeaderOffset = 8, kExtendedMin = 24, kExtendedFull = 32;
static_assert(kPlanTensor == int(et::KernelTypes::Tensor) && kKernelCall == int(et::InstructionArguments::KernelCall) &&
              kFreeCall == int(et::InstructionArguments::FreeCall), "pte.h's codes are program.fbs's");
[[noreturn]] void bad(const std::string& m) { refuse(ErrorCode::kPteFormat, m); }


std::string text(const flatbuffers::String* s, const std::string& field) {
  if (!s) return "";
  if (!valid_utf8(reinterpret_cast<const uint8_t*>(s->data()), s->size()))
    bad("Program flatbuffer is corrupt at " + field + " (UnicodeDecodeError: invalid utf-8)");
  return copy_string(s);
}

void check_index(int64_t index, uint64_t count, const std::string& what) {
  if (index < 0 || uint64_t(index) >= count)
    bad(count ? what + " " + num(index) + " is out of range (0.." + num(count - 1) + ")" : what + " " + num(index) + " refers to an empty list");
}

}  // namespace

uint64_t host_memory_bytes() {
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : (uint64_t(1) << 48);
}

Bytes Program::segment(uint32_t index) const {
  check_index(index, segments_.size(), "segment index");
  const auto& s = segments_[index];
  return Bytes{map_->bytes().data + segment_base_ + s.first, s.second};  // bounds checked in parse()
}

const Method& Program::main_method() const {
  if (methods_.size() == 1) return methods_[0];
  for (const auto& m : methods_)
    if (m.name == kTrainMethod) return m;
  refuse(ErrorCode::kUnsupported, source_ + ": expected a .pte with one method or a 'forward' method, found " + num(methods_.size()));
}

std::unique_ptr<Program> Program::load(const std::string& path, const Limits& limits) {
  return load_from(std::make_unique<FileMap>(path), path, limits);  // its errors name the path
}

std::unique_ptr<Program> Program::load_bytes(const void* data, size_t size, const std::string& name, const Limits& limits) {
  return load_from(std::make_unique<FileMap>(data, size, name), name, limits);
}

std::unique_ptr<Program> Program::load_from(std::unique_ptr<FileMap> map, const std::string& path, const Limits& limits) {
  std::unique_ptr<Program> p(new Program());
  p->source_ = path;
  p->map_ = std::move(map);
  try {
    p->parse(p->map_->bytes());
    p->verify(limits);
  } catch (const LoadError& e) {
    const std::string message = e.what();
    if (message.rfind(path + ":", 0) == 0 || e.code() == ErrorCode::kIo) throw;
    throw LoadError(e.code(), path + ": " + message);
  }
  return p;
}

void Program::parse(Bytes file) {
  // pte.py _read_header
  const uint64_t size = file.size;
  if (size < 8) bad("file is " + num(size) + " bytes, too short for a .pte (>= 8 bytes: root offset + identifier)");
  if (std::memcmp(file.data + 4, "ET12", 4) != 0) {
    if (file.data[4] == 'E' && file.data[5] == 'T')
      bad(".pte schema identifier is " + bytes_repr(file.data + 4, 4) + "; this reader supports b'ET12'");
    bad("file identifier is " + bytes_repr(file.data + 4, 4) + ", expected b'ET12' (not a .pte file)");
  }
  program_size_ = size;
  const uint8_t* eh = file.data + kExtendedHeaderOffset;
  if (size >= kExtendedHeaderOffset + kExtendedMin && std::memcmp(eh, "eh00", 4) == 0) {
    const uint64_t length = le32(eh + 4), program_size = le64(eh + 8), base = le64(eh + 16);
    if (length < kExtendedMin) bad("extended header length " + num(length) + " < 24");
    if (size < kExtendedHeaderOffset + length) bad("file (" + num(size) + " bytes) ends inside the " + num(length) + "-byte extended header (truncated)");
    const uint64_t data_size = length >= kExtendedFull ? le64(eh + 24) : 0;
    if (program_size < kExtendedHeaderOffset + length || program_size > size)
      bad("extended header program_size " + num(program_size) + " is outside [" + num(kExtendedHeaderOffset + length) +
          ", " + num(size) + "] (file is " + num(size) + " bytes: truncated?)");
    if (base) {
      if (base < program_size) bad("segment_base_offset " + num(base) + " lies inside the program (program_size " + num(program_size) + ")");
      if (base > size || data_size > size - base)
        bad("segment data [" + num(base) + ", " + sum(base, data_size) + ") extends past the end of the " + num(size) + "-byte file (truncated)");
    } else if (data_size) {
      bad("segment_data_size " + num(data_size) + " with segment_base_offset 0");
    }
    program_size_ = program_size;
    segment_base_ = base;
    segment_data_size_ = data_size;
  }
  if (program_size_ >= FLATBUFFERS_MAX_BUFFER_SIZE)
    refuse(ErrorCode::kLimit, "Program flatbuffer is " + num(program_size_) + " bytes, over the flatbuffers limit of 2 GiB");
  flatbuffers::Verifier verifier(file.data, program_size_);
  if (!verifier.VerifyBuffer<et::Program>(nullptr))
    bad("Program flatbuffer fails the flatbuffers Verifier (an offset, length or table lies outside its " +
        num(program_size_) + " bytes, or is misaligned): corrupt or truncated");
  const et::Program* program = flatbuffers::GetRoot<et::Program>(file.data);
  ScopedCopyBudget budget(program_size_, "Program flatbuffer");

  if (program->segments())
    for (flatbuffers::uoffset_t i = 0; i < program->segments()->size(); ++i) {
      const auto* s = program->segments()->Get(i);
      const uint64_t offset = s->offset(), length = s->size();
      if (length) {  // executorch writes an empty constant segment even when the file has no segment data
        if (!segment_base_) bad("segment " + num(i) + " has " + num(length) + " bytes but the file has no extended header giving the segment base offset");
        const unsigned __int128 end = (unsigned __int128)segment_base_ + offset + length;
        if (end > size) bad("segment " + num(i) + " (offset " + num(offset) + ", size " + num(length) + ") ends past the end of the " + num(size) + "-byte file (truncated)");
        if (segment_data_size_ && (unsigned __int128)offset + length > segment_data_size_)
          bad("segment " + num(i) + " (offset " + num(offset) + ", size " + num(length) + ") extends past segment_data_size " + num(segment_data_size_));
        segments_.emplace_back(offset, length);
      } else {
        segments_.emplace_back(0, 0);
      }
    }
  if (program->backend_delegate_data())
    for (const auto* d : *program->backend_delegate_data())
      inline_data_.push_back(d->data() ? Bytes{d->data()->data(), d->data()->size()} : Bytes{});

  const auto* sub = program->constant_segment();
  const auto offsets = sub ? vec<uint64_t>(sub->offsets()) : std::vector<uint64_t>{};
  const size_t legacy = program->constant_buffer() ? program->constant_buffer()->size() : 0;
  if (!offsets.empty() && legacy) bad("the program has both constant_segment offsets and a legacy constant_buffer");
  if (legacy) {
    for (const auto* b : *program->constant_buffer())
      constants_.push_back(b->storage() ? Bytes{b->storage()->data(), b->storage()->size()} : Bytes{});
  } else if (!offsets.empty()) {
    check_index(sub->segment_index(), segments_.size(), "constant_segment segment index");
    const Bytes base = segment(sub->segment_index());
    for (size_t i = 0; i < offsets.size(); ++i) {
      const uint64_t end = i + 1 < offsets.size() ? offsets[i + 1] : base.size;
      if (!(offsets[i] <= end && end <= base.size))
        bad("constant_segment offset " + num(i) + " spans [" + num(offsets[i]) + ", " + num(end) + "), outside the " +
            num(base.size) + "-byte constant segment " + num(sub->segment_index()) + " or not ascending");
      constants_.push_back(base.sub(offsets[i], end - offsets[i]));
    }
  }
  if (program->mutable_data_segments())
    for (flatbuffers::uoffset_t i = 0; i < program->mutable_data_segments()->size(); ++i) {
      const auto* m = program->mutable_data_segments()->Get(i);
      check_index(m->segment_index(), segments_.size(), "mutable_data_segments[" + num(i) + "] segment index");
      const uint64_t limit = segments_[m->segment_index()].second;
      auto offs = vec<uint64_t>(m->offsets());
      for (size_t j = 0; j < offs.size(); ++j)
        if (offs[j] > limit) bad("mutable_data_segments[" + num(i) + "] offset " + num(j) + " = " + num(offs[j]) + " lies past its " + num(limit) + "-byte segment");
      mutable_segments_.emplace_back(m->segment_index(), std::move(offs));
    }
  if (program->named_data())
    for (flatbuffers::uoffset_t i = 0; i < program->named_data()->size(); ++i) {
      const auto* n = program->named_data()->Get(i);
      std::string key = text(n->key(), "Program.named_data[" + num(i) + "]");
      if (named_data_.count(key)) bad("named data key '" + key + "' appears twice");
      named_data_[key] = segment(n->segment_index());
    }

  if (!program->execution_plan()) return;
  std::set<std::string> names;
  for (flatbuffers::uoffset_t p = 0; p < program->execution_plan()->size(); ++p) {
    const auto* plan = program->execution_plan()->Get(p);
    Method m;
    m.name = text(plan->name(), "Program.execution_plan[" + num(p) + "]");
    const std::string where = "execution plan " + (m.name.empty() ? num(p) : "'" + m.name + "'");
    if (plan->values())
      for (flatbuffers::uoffset_t i = 0; i < plan->values()->size(); ++i) {
        const auto* v = plan->values()->Get(i);
        PlanValue pv;
        pv.kind = int(v->val_type());
        if (pv.kind == 0 || pv.kind == int(et::KernelTypes::Null)) { pv.kind = int(et::KernelTypes::Null); m.values.push_back(pv); continue; }
        if (!v->val()) bad(where + " value " + num(i) + " has union type " + num(pv.kind) + " but no payload");
        if (pv.kind > int(et::KernelTypes::MAX)) bad(where + " value " + num(i) + " has unknown value type " + num(pv.kind));
        if (pv.kind == int(et::KernelTypes::String)) text(v->val_as_String()->string_val(), where + " value " + num(i));
        if (pv.kind == int(et::KernelTypes::TensorList)) pv.items = vec<int32_t>(v->val_as_TensorList()->items());
        if (pv.kind == int(et::KernelTypes::OptionalTensorList)) pv.items = vec<int32_t>(v->val_as_OptionalTensorList()->items());
        if (pv.kind == kPlanTensor) {
          const auto* t = v->val_as_Tensor();
          PlanTensor& pt = pv.tensor;
          pt.scalar_type = int(t->scalar_type());
          pt.storage_offset = t->storage_offset();
          pt.sizes = vec<int32_t>(t->sizes());
          pt.dim_order = vec<uint8_t>(t->dim_order());
          pt.data_buffer_idx = t->data_buffer_idx();
          if (const auto* a = t->allocation_info()) {
            pt.planned = true;
            pt.memory_id = a->memory_id();
            pt.memory_offset = uint64_t(a->memory_offset_low()) | uint64_t(a->memory_offset_high()) << 32;
          }
          pt.layout = t->layout();
          pt.shape_dynamism = int(t->shape_dynamism());
          if (const auto* e = t->extra_tensor_info()) {
            pt.has_extra = true;
            pt.external = int(e->location()) == 1;
            pt.mutable_data_segments_idx = e->mutable_data_segments_idx();
            text(e->fully_qualified_name(), where + " value " + num(i));
          }
        }
        m.values.push_back(std::move(pv));
      }
    if (plan->operators())
      for (flatbuffers::uoffset_t i = 0; i < plan->operators()->size(); ++i) {
        const auto* op = plan->operators()->Get(i);
        const std::string at = where + " operator " + num(i);
        std::string name = text(op->name(), at), overload = text(op->overload(), at);
        m.operators.push_back(overload.empty() ? name : name + "." + overload);
      }
    if (plan->delegates())
      for (flatbuffers::uoffset_t i = 0; i < plan->delegates()->size(); ++i) {
        const auto* d = plan->delegates()->Get(i);
        const std::string at = where + " delegate " + num(i);
        const auto* ref = d->processed();
        if (!ref) bad(at + " has no processed data reference");
        const int location = int(ref->location());
        if (location == int(et::DataLocation::INLINE)) {
          check_index(ref->index(), inline_data_.size(), at + " inline data index");
          m.delegate_data.push_back(inline_data_[ref->index()]);
        } else if (location == int(et::DataLocation::SEGMENT)) {
          check_index(ref->index(), segments_.size(), at + " segment index");
          m.delegate_data.push_back(segment(ref->index()));
        } else {
          bad(at + " has unknown data location " + num(location));
        }
        if (d->compile_specs())
          for (const auto* spec : *d->compile_specs()) text(spec->key(), at);
        m.delegate_ids.push_back(text(d->id(), at));
      }
    if (plan->chains())
      for (flatbuffers::uoffset_t c = 0; c < plan->chains()->size(); ++c) {
        const auto* chain = plan->chains()->Get(c);
        const std::string cw = where + " chain " + num(c);
        const size_t count = chain->instructions() ? chain->instructions()->size() : 0;
        for (size_t i = 0; i < count; ++i) {
          const auto* ins = chain->instructions()->Get(flatbuffers::uoffset_t(i));
          const std::string at = cw + " instruction " + num(i);
          Instruction out{int(ins->instr_args_type()), -1, {}};
          if (!ins->instr_args()) bad(at + " has no arguments (type " + num(out.kind) + ")");
          if (out.kind == kKernelCall) {
            out.index = ins->instr_args_as_KernelCall()->op_index();
            out.args = vec<int32_t>(ins->instr_args_as_KernelCall()->args());
            check_index(out.index, m.operators.size(), at + " operator index");
          } else if (out.kind == kDelegateCall) {
            out.index = ins->instr_args_as_DelegateCall()->delegate_index();
            out.args = vec<int32_t>(ins->instr_args_as_DelegateCall()->args());
            check_index(out.index, m.delegate_data.size(), at + " delegate index");
          } else if (out.kind == kMoveCall) {
            out.args = {ins->instr_args_as_MoveCall()->move_from(), ins->instr_args_as_MoveCall()->move_to()};
          } else if (out.kind == kJumpFalseCall) {
            check_index(ins->instr_args_as_JumpFalseCall()->destination_instruction(), count, at + " jump destination");
            out.args = {ins->instr_args_as_JumpFalseCall()->cond_value_index()};
          } else if (out.kind == kFreeCall) {
            out.args = {ins->instr_args_as_FreeCall()->value_index()};
          } else {
            bad(at + " has unknown instruction type " + num(out.kind));
          }
          for (int32_t v : out.args) check_index(v, m.values.size(), at + " value index");
          m.instructions.push_back(std::move(out));
        }
        for (auto ids : {vec<int32_t>(chain->inputs()), vec<int32_t>(chain->outputs())})
          for (int32_t v : ids) check_index(v, m.values.size(), cw + " input/output value index");
      }
    m.inputs = vec<int32_t>(plan->inputs());
    m.outputs = vec<int32_t>(plan->outputs());
    for (int32_t v : m.inputs) check_index(v, m.values.size(), where + " input value index");
    for (int32_t v : m.outputs) check_index(v, m.values.size(), where + " output value index");
    for (size_t i = 0; i < m.values.size(); ++i)
      for (int32_t item : m.values[i].items)
        if (!(m.values[i].kind == int(et::KernelTypes::OptionalTensorList) && item == -1))
          check_index(item, m.values.size(), where + " value " + num(i) + " list item");
    if (plan->container_meta_type()) {
      text(plan->container_meta_type()->encoded_inp_str(), where + " container_meta_type");
      text(plan->container_meta_type()->encoded_out_str(), where + " container_meta_type");
    }
    m.arena_sizes = vec<int64_t>(plan->non_const_buffer_sizes());
    if (!names.insert(m.name).second) bad("execution plan names are not unique: '" + m.name + "' appears twice");
    methods_.push_back(std::move(m));
  }
}

}  // namespace vktrain
