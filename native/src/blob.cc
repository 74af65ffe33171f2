#include "blob.h"

#include <cmath>
#include <cstring>
#include <set>
#include <unordered_map>

#include "crc32.h"
#include "schema_generated.h"
#include "flatbuffer_vectors.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr uint64_t kAlignment = 16;
constexpr uint32_t kHeaderFields = 48;       // bytes graph_crc32 covers
constexpr uint32_t kChecksummedHeader = 56;  // + graph_crc32 + 4 zero bytes
constexpr uint32_t kFlagChecksums = 1, kFlagNamedData = 2;
constexpr uint32_t kPlainVersion = 1, kSyntheticVersion = 2;
constexpr uint64_t kQ8_0Block = 34, kQ8_0Values = 32;

[[noreturn]] void bad(const std::string& message) { refuse(ErrorCode::kBlobFormat, message); }


struct Header {
  uint32_t size, version, flags;
  uint64_t fb_offset, fb_size, seg_offset, seg_size;
  bool checksummed;
  uint32_t graph_crc32;
};

// blob_header.py BlobHeader.parse, check for check. Sums are compared without overflow.
Header parse_header(Bytes blob) {
  const uint64_t total = blob.size;
  if (total < kHeaderFields)
    bad("blob is " + num(total) + " bytes, shorter than the 48-byte header (truncated?)");
  const uint8_t* p = blob.data;
  if (std::memcmp(p, "VKTB", 4) != 0)
    bad("blob magic is " + bytes_repr(p, 4) + ", expected b'VKTB' (not a vktrain delegate blob)");
  Header h{};
  h.size = le32(p + 4);
  h.version = le32(p + 8);
  h.flags = le32(p + 12);
  h.fb_offset = le64(p + 16);
  h.fb_size = le64(p + 24);
  h.seg_offset = le64(p + 32);
  h.seg_size = le64(p + 40);
  if (h.version < 1 || h.version > kSyntheticVersion)
    bad("blob format version is " + num(h.version) + "; this vktrain reads versions 1 to 2 (blob from a newer vktrain?)");
  if (h.flags & ~(kFlagChecksums | kFlagNamedData))
    bad("header flags are " + hex(h.flags) + "; the flags defined are CHECKSUMS (0x1) and NAMED_DATA (0x2) "
        "(blob from a newer vktrain?)");
  h.checksummed = h.flags & kFlagChecksums;
  const uint32_t expected = h.checksummed ? kChecksummedHeader : kHeaderFields;
  if (h.size != expected)
    bad("header_size field is " + num(h.size) + ", expected " + num(expected) + " with header flags " + hex(h.flags));
  if (total < h.size) bad("blob is " + num(total) + " bytes, shorter than its " + num(h.size) + "-byte header (truncated?)");
  h.graph_crc32 = h.checksummed ? le32(p + kHeaderFields) : 0;
  if (h.fb_offset < h.size || h.fb_offset % kAlignment)
    bad("flatbuffer_offset " + num(h.fb_offset) + " must be >= the header size " + num(h.size) + " and a multiple of 16");
  if (h.fb_size < 8) bad("flatbuffer_size " + num(h.fb_size) + " is too small for a flatbuffer (>= 8 bytes)");
  if (h.fb_offset > total || h.fb_size > total - h.fb_offset)
    bad("flatbuffer [" + num(h.fb_offset) + ", " + sum(h.fb_offset, h.fb_size) + ") extends past the end of the " +
        num(total) + "-byte blob (truncated?)");
  const uint64_t fb_end = h.fb_offset + h.fb_size;
  if (h.seg_offset < fb_end || h.seg_offset % kAlignment)
    bad("segment_offset " + num(h.seg_offset) + " must be >= the flatbuffer end " + num(fb_end) + " and a multiple of 16");
  if (h.seg_offset > total || h.seg_size > total - h.seg_offset)
    bad("segment area [" + num(h.seg_offset) + ", " + sum(h.seg_offset, h.seg_size) + ") extends past the end of the " +
        num(total) + "-byte blob (truncated?)");
  return h;
}

std::string text_of(const flatbuffers::String* s, const std::string& field) {
  if (!s) return "";
  if (!valid_utf8(reinterpret_cast<const uint8_t*>(s->data()), s->size()))
    bad("flatbuffer is corrupt at " + field + " (UnicodeDecodeError: invalid utf-8)");
  return copy_string(s);
}

// numel of a shape; GraphError-style message when a dimension is negative or the bytes overflow 64 bits.
bool checked_numel(const std::vector<int64_t>& shape, int itemsize, uint64_t* numel) {
  unsigned __int128 n = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    n *= static_cast<uint64_t>(d);
    if (n * itemsize > (unsigned __int128)INT64_MAX) return false;
  }
  *numel = static_cast<uint64_t>(n);
  return true;
}

std::string shape_text(int dtype, const std::vector<int64_t>& shape) { return data_type_name(dtype) + list(shape); }

uint64_t padded_k(int64_t k) { return (uint64_t(k) + 7) / 8 * 8; }

// synthetic.py SyntheticConstant._check (what a reader refuses of a generated constant's record).
void check_synthetic(const vkt_blob::SyntheticConstant* s, int constant_id, Constant* out) {
  const int kind = int(s->kind()), dtype = int(s->dtype()), layout = int(s->layout());
  const std::string at = "constant " + num(constant_id) + ": ";
  if (kind > 2 || dtype >= kNumDataTypes || layout >= kNumLayouts)
    bad(at + "synthetic constant: kind " + num(kind) + " / dtype " + num(dtype) + " / layout " + num(layout) +
        " is not a value of SyntheticKind / DataType / TensorLayout");
  static const char* kinds[] = {"RANDOM_BITS", "NORMAL", "FILL"};
  auto shape = vec<int64_t>(s->shape());
  auto q4 = vec<int64_t>(s->q4gsw_shape());
  const std::string what = at + "synthetic " + kinds[kind] + " constant " + shape_text(dtype, shape);
  for (int64_t d : shape)
    if (d < 0) bad(what + ": negative dimension in shape");
  if (kind == 0 && !(dtype == kUint8 || dtype == kUint32 || dtype == kInt8 || dtype == kInt32))
    bad(what + ": random bits need an integer dtype whose every bit pattern is valid, one of "
        "['UINT8', 'UINT32', 'INT8', 'INT32']");
  if (kind == 1) {
    if (dtype != kFloat32 && dtype != kFloat16) bad(what + ": a normal distribution needs a float dtype, one of ['FLOAT32', 'FLOAT16']");
    if (!(std::isfinite(s->std()) && s->std() >= 0)) bad(what + ": std " + real(s->std()) + " must be finite and >= 0");
  }
  if (kind == 2) {
    const double v = s->value();
    if (!std::isfinite(v)) bad(what + ": fill value " + real(v) + " must be finite");
    if (dtype == kFloat32 || dtype == kFloat16) {
      if (std::fabs(v) > (dtype == kFloat32 ? 3.4028234663852886e38 : 65504.0)) bad(what + ": fill value " + real(v) + " overflows " + data_type_name(dtype));
    } else {
      bool ok;
      switch (dtype) {
        case kBool: ok = v == 0.0 || v == 1.0; break;
        case kUint8: ok = v == std::floor(v) && v >= 0 && v <= 255; break;
        case kInt8: ok = v == std::floor(v) && v >= -128 && v <= 127; break;
        case kInt32: ok = v == std::floor(v) && v >= -2147483648.0 && v <= 2147483647.0; break;
        case kUint32: ok = v == std::floor(v) && v >= 0 && v <= 4294967295.0; break;
        case kInt64: ok = v == std::floor(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0; break;
        default: ok = false;  // BFLOAT16 has no fill (numpy has no such dtype)
      }
      if (!ok) bad(what + ": fill value " + real(v) + " is not representable");
    }
  }
  if (layout != kPlain) {
    if (kind != 0) bad(what + ": layout " + num(layout) + " is only meaningful for RANDOM_BITS q4gsw codes");
    if (q4.size() != 2 || q4[0] <= 0 || q4[1] <= 0)
      bad(what + ": a q4gsw layout needs q4gsw_shape = the logical weight [N, K] (positive), got " + list(q4));
    const int64_t N = q4[0], K = q4[1];
    std::vector<int64_t> expected;
    int expected_dtype;
    if (layout == kQ4gswFlat) {
      expected_dtype = kUint8;
      expected = {N, int64_t(padded_k(K) / 2)};
    } else {
      if (N % 4) bad(what + ": W_4X8 needs N % 4 == 0, got N=" + num(N));
      const uint64_t k4 = padded_k(K) / 4, n8 = (uint64_t(N) / 4 + 1) / 2;
      expected_dtype = kUint32;
      expected = {int64_t(k4 * n8 * 4)};
    }
    if (dtype != expected_dtype || shape != expected)
      bad(what + ": a q4gsw weight [N=" + num(N) + ", K=" + num(K) + "] is stored as " + shape_text(expected_dtype, expected));
  } else if (!q4.empty()) {
    bad(what + ": q4gsw_shape " + list(q4) + " given but layout is PLAIN");
  }
  if (!checked_numel(shape, data_type_size(dtype), &out->nbytes)) bad(what + ": more than 2^63 bytes");
  out->nbytes *= data_type_size(dtype);
  out->synthetic = true;
  out->synthetic_dtype = dtype;
  out->synthetic_shape = shape;
  out->stored_form = "synthetic";
  out->synthetic_record = {kind, s->seed(), dtype, shape, s->std(), s->value(), layout, q4, out->nbytes};
}

std::string constant_reader(const Graph& graph, const vkt_blob::VkGraph* root, int constant_id) {
  (void)graph;
  if (root->values())
    for (flatbuffers::uoffset_t i = 0; i < root->values()->size(); ++i) {
      auto t = root->values()->Get(i)->value_as_Tensor();
      if (t && t->constant_id() == constant_id)
        return "tensor value " + num(i) + " (" + (t->name() && t->name()->size() ? t->name()->str().substr(0, 200) : "unnamed") + ")";
    }
  return "no tensor: a state's initial value, or unused";
}

void read_constants(const vkt_blob::VkGraph* root, Bytes segment_area, bool verify, const NamedData* named, Graph* graph) {
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> hashed;  // deduplicated constants share a range
  const auto* records = root->constants();
  const flatbuffers::uoffset_t count = records ? records->size() : 0;
  for (flatbuffers::uoffset_t i = 0; i < count; ++i) {
    const auto* r = records->Get(i);
    Constant c;
    const uint64_t offset = r->offset(), length = r->length();
    const auto stored_dtype = r->stored_dtype();
    const int encoding = int(r->stored_encoding());
    c.named_key = text_of(r->named_key(), "VkGraph.constants[" + num(i) + "]");
    if (r->synthetic()) {
      if (stored_dtype.has_value() || encoding != 0)
        bad("constant " + num(i) + " is synthetic but has stored_dtype " +
            (stored_dtype.has_value() ? num(int(*stored_dtype)) : "None") + " / stored_encoding " + num(encoding) +
            " (expected neither: it has no stored bytes)");
      if (offset || length)
        bad("constant " + num(i) + " is synthetic but also has segment bytes (offset " + num(offset) + ", length " +
            num(length) + "; expected 0, 0)");
      check_synthetic(r->synthetic(), int(i), &c);
      graph->constants.push_back(std::move(c));
      continue;
    }
    if (!c.named_key.empty()) {
      if (!named)
        bad("constant " + num(i) + " lives in the .pte's named data (key '" + c.named_key +
            "'), but no named data was given: read the blob with the .pte around it");
      if (offset) bad("constant " + num(i) + " is named data '" + c.named_key + "' but has segment offset " + num(offset) + " (expected 0)");
      auto found = named->find(c.named_key);
      if (found == named->end())
        bad("constant " + num(i) + " names data '" + c.named_key + "', which the .pte does not hold (" +
            num(named->size()) + " named data entries)");
      if (found->second.size < length)
        bad("constant " + num(i) + ": named data '" + c.named_key + "' has " + num(found->second.size) +
            " bytes, its record says " + num(length));
      c.data = found->second.sub(0, length);
    } else {
      if (offset % kAlignment) bad("constant " + num(i) + " offset " + num(offset) + " is not a multiple of 16");
      if (offset > segment_area.size || length > segment_area.size - offset)
        bad("constant " + num(i) + " [" + num(offset) + ", " + sum(offset, length) + ") extends past the " +
            num(segment_area.size) + "-byte segment area");
      c.data = segment_area.sub(offset, length);
    }
    if (verify) {
      uint32_t actual;
      auto key = std::make_pair(offset, length);
      auto cached = hashed.find(key);
      if (c.named_key.empty() && cached != hashed.end()) {
        actual = cached->second;
      } else {
        actual = crc32(c.data.data, c.data.size);
        if (c.named_key.empty()) hashed[key] = actual;
      }
      if (actual != r->crc32())
        refuse(ErrorCode::kBlobChecksum, "constant " + num(i) + " (read by " + constant_reader(*graph, root, int(i)) +
               "): crc32 of its " + num(length) + " bytes is " + hex8(actual) + ", its record says " + hex8(r->crc32()) +
               " (the constant data was modified or corrupted)");
    }
    c.stored_nbytes = length;
    c.nbytes = length;
    c.stored_form = "as read";
    if (stored_dtype.has_value() || encoding != 0) {  // narrow_constant.py stored_constant / NarrowConstant
      const std::string at = "constant " + num(i) + " (read by " + constant_reader(*graph, root, int(i)) + "): ";
      const int sd = stored_dtype.has_value() ? int(*stored_dtype) : -1;
      if (sd >= kNumDataTypes) bad(at + "stored_dtype " + num(sd) + " is no DataType; a narrow constant is stored as one of ['BFLOAT16 (8)', 'FLOAT16 (1)']");
      if (encoding > 1) bad(at + "narrow constant has stored_encoding " + num(encoding) + "; expected one of ['ELEMENTS (0)', 'GGUF_Q8_0 (1)']");
      if (encoding == 1) {
        if (sd >= 0) bad(at + "narrow constant stored as GGUF_Q8_0 blocks also has stored_dtype " + std::string(data_type_name(sd)) + " (expected none)");
        if (length % kQ8_0Block) bad(at + "narrow constant (GGUF_Q8_0) has " + num(length) + " bytes, not a whole number of 34-byte blocks");
        c.nbytes = length / kQ8_0Block * kQ8_0Values * 4;
        c.stored_form = "gguf_q8_0";
      } else {
        if (sd != kBfloat16 && sd != kFloat16)
          bad(at + "a narrow constant is stored as one of ['BFLOAT16', 'FLOAT16'] or as GGUF_Q8_0 blocks, got " + std::string(data_type_name(sd)));
        if (length % 2) bad(at + "narrow constant (" + data_type_name(sd) + ") has " + num(length) + " bytes, not a whole number of 2-byte elements");
        c.nbytes = length / 2 * 4;
        c.stored_form = sd == kBfloat16 ? "bfloat16" : "float16";
      }
      c.narrow = true;
    }
    graph->constants.push_back(std::move(c));
  }
}

Value read_value(const vkt_blob::Value* v, flatbuffers::uoffset_t id) {
  Value out;
  const std::string at = "value " + num(id);
  out.kind = int(v->value_type());
  if (!v->value()) bad(at + " has no payload (union type " + num(out.kind) + ")");
  if (out.kind < kValueNull || out.kind > kValueList) bad(at + " has unknown union type " + num(out.kind) + " (blob from a newer vktrain?)");
  if (out.kind == kValueString) text_of(v->value_as_String()->value(), "VkGraph.values[" + num(id) + "]");
  if (out.kind == kValueList) out.items = vec<int32_t>(v->value_as_ValueList()->items());
  if (out.kind != kValueTensor) return out;
  const auto* t = v->value_as_Tensor();
  TensorValue& tv = out.tensor;
  tv.name = text_of(t->name(), "VkGraph.values[" + num(id) + "]");
  tv.dtype = int(t->dtype());
  tv.layout = int(t->layout());
  tv.stored_dtype = t->stored_dtype().has_value() ? int(*t->stored_dtype()) : -1;
  if (tv.dtype >= kNumDataTypes || tv.layout >= kNumLayouts || tv.stored_dtype >= kNumDataTypes)
    bad(at + ": tensor " + (tv.name.empty() ? "unnamed" : tv.name) + ": dtype " + num(tv.dtype) + " / layout " +
        num(tv.layout) + " / stored_dtype " + num(tv.stored_dtype) + " is not a value of DataType / TensorLayout");
  tv.shape = vec<int64_t>(t->shape());
  tv.constant_id = t->constant_id();
  tv.mem_obj_id = t->mem_obj_id();
  tv.mem_offset = t->mem_offset();
  tv.storage_of = t->storage_of();
  tv.is_view = t->is_view();
  tv.view_strides = vec<int64_t>(t->view_strides());
  tv.view_offset = t->view_offset();
  return out;
}

}  // namespace

bool valid_utf8(const uint8_t* s, size_t n) {  // as Python's strict decoder: no overlongs, no surrogates
  size_t i = 0;
  while (i < n) {
    const uint8_t c = s[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

void validate_graph(Graph& g);  // graph_validate.cc

Graph read_blob(Bytes blob, const NamedData* named_data, bool verify_constants) {
  const Header h = parse_header(blob);
  const Bytes fb = blob.sub(h.fb_offset, h.fb_size);
  if (h.checksummed) {
    const uint32_t actual = crc32(fb.data, fb.size, crc32(blob.data, kHeaderFields));
    if (actual != h.graph_crc32)
      refuse(ErrorCode::kBlobChecksum, "graph checksum mismatch: header graph_crc32 is " + hex8(h.graph_crc32) +
             ", the header fields and the " + num(fb.size) + "-byte graph flatbuffer give " + hex8(actual) +
             " (the graph was modified or corrupted)");
  }
  if (std::memcmp(fb.data + 4, "VKT1", 4) != 0)
    bad("flatbuffer file identifier is " + bytes_repr(fb.data + 4, 4) + ", expected b'VKT1' "
        "(graph written with an incompatible schema version)");
  if (fb.size >= FLATBUFFERS_MAX_BUFFER_SIZE)
    refuse(ErrorCode::kLimit, "graph flatbuffer is " + num(fb.size) + " bytes, over the flatbuffers limit of 2 GiB");
  flatbuffers::Verifier verifier(fb.data, fb.size);
  if (!verifier.VerifyBuffer<vkt_blob::VkGraph>(nullptr))
    bad("graph flatbuffer fails the flatbuffers Verifier (an offset, length or table lies outside its " +
        num(fb.size) + " bytes, or is misaligned)");
  const auto* root = flatbuffers::GetRoot<vkt_blob::VkGraph>(fb.data);
  ScopedCopyBudget budget(fb.size, "graph flatbuffer");
  Graph graph;
  graph.format_version = int(h.version);
  graph.checksummed = h.checksummed;
  read_constants(root, blob.sub(h.seg_offset, h.seg_size), verify_constants && h.checksummed, named_data, &graph);
  if (root->values())
    for (flatbuffers::uoffset_t i = 0; i < root->values()->size(); ++i) graph.values.push_back(read_value(root->values()->Get(i), i));
  if (root->chain())
    for (flatbuffers::uoffset_t i = 0; i < root->chain()->size(); ++i) {
      const auto* op = root->chain()->Get(i);
      graph.ops.push_back({text_of(op->name(), "VkGraph.chain[" + num(i) + "]"), vec<int32_t>(op->args()), vec<int32_t>(op->outputs())});
    }
  graph.inputs = vec<int32_t>(root->input_ids());
  graph.outputs = vec<int32_t>(root->output_ids());
  if (root->mutable_state())
    for (const auto* s : *root->mutable_state()) graph.mutable_state.push_back({s->state_id(), s->update_id(), s->initial_constant_id()});
  if (root->memory_objects())
    for (const auto* m : *root->memory_objects()) graph.memory_objects.push_back({m->id(), m->size_bytes()});
  if (root->metadata()) {
    std::set<std::string> keys;
    for (flatbuffers::uoffset_t i = 0; i < root->metadata()->size(); ++i) {
      const auto* e = root->metadata()->Get(i);
      const std::string field = "VkGraph.metadata[" + num(i) + "]";
      std::string key = text_of(e->key(), field), value = text_of(e->value(), field);
      if (!keys.insert(key).second) bad("metadata key '" + key + "' appears twice");
      graph.metadata.emplace_back(std::move(key), std::move(value));
    }
  }
  if (root->shader_modules())
    for (flatbuffers::uoffset_t i = 0; i < root->shader_modules()->size(); ++i) {
      const auto* m = root->shader_modules()->Get(i);
      const std::string field = "VkGraph.shader_modules[" + num(i) + "]";
      ShaderModuleRecord r;
      r.name = text_of(m->name(), field + ".name");
      r.kind = int(m->kind());
      if (r.kind != kSpirv && r.kind != kWgsl) bad(field + " has unknown code kind " + num(r.kind));
      if (m->code()) r.code = {m->code()->data(), m->code()->size()};
      if (m->bindings())
        for (const auto* b : *m->bindings()) {
          if (int(b->access()) > int(vkt_blob::BindingAccess::READ_WRITE))
            bad(field + " binding " + num(b->binding()) + " has unknown access " + num(int(b->access())));
          r.bindings.emplace_back(b->binding(), int(b->access()));
        }
      r.push_constant_bytes = m->push_constant_bytes();
      r.push_header = m->push_header();
      r.spec_ids = vec<uint32_t>(m->spec_ids());
      if (m->features())
        for (flatbuffers::uoffset_t k = 0; k < m->features()->size(); ++k)
          r.features.push_back(text_of(m->features()->Get(k), field + ".features"));
      r.local_size = vec<uint32_t>(m->local_size());
      r.local_size_spec_ids = vec<int32_t>(m->local_size_spec_ids());
      graph.shader_modules.push_back(std::move(r));
    }
  if (root->schedules())
    for (flatbuffers::uoffset_t i = 0; i < root->schedules()->size(); ++i) {
      const auto* e = root->schedules()->Get(i);
      EmbeddedScheduleRecord r;
      r.profile_json = text_of(e->profile(), "VkGraph.schedules[" + num(i) + "].profile");
      if (e->schedule()) r.schedule = {e->schedule()->data(), e->schedule()->size()};
      r.dispatch_modules = vec<uint32_t>(e->dispatch_modules());
      graph.schedules.push_back(std::move(r));
    }
  bool any_synthetic = false;
  for (const auto& c : graph.constants) any_synthetic |= c.synthetic;
  if (any_synthetic && h.version < kSyntheticVersion)
    bad("blob format version " + num(h.version) + " cannot hold synthetic constants (expected version 2)");
  if (!any_synthetic && h.version == kSyntheticVersion)
    bad("blob format version 2 is written only for graphs with synthetic constants, and this one has none (header corrupt?)");
  validate_graph(graph);
  return graph;
}

}  // namespace vktrain
