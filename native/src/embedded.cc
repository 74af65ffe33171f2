#include "embedded.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <tuple>

#include "blob.h"
#include "json.h"
#include "status.h"
#include "text.h"
#include "vk_device.h"

namespace vktrain {
namespace {

// device_profile.py's vocabularies.
const std::vector<std::string> kApis = {"vulkan", "webgpu"};
const std::vector<std::string> kDeviceTypes = {"cpu", "discrete", "integrated", "virtual", "other"};
const std::vector<std::string> kSubgroupOperations = {"basic", "vote", "arithmetic", "ballot", "shuffle",
                                                      "shuffle_relative", "clustered", "quad"};
const std::vector<std::string> kComponentTypes = {"float16", "float32", "float64", "bfloat16", "int8", "int16",
                                                  "int32", "int64", "uint8", "uint16", "uint32", "uint64"};
const std::vector<std::string> kScopes = {"subgroup", "workgroup", "device", "queue_family"};
const std::vector<std::string> kFields = {
    "name", "api", "device_type", "subgroup_size", "subgroup_operations", "float16", "int64", "cooperative_matrix",
    "max_shared_memory_bytes", "max_workgroup_invocations", "max_workgroup_size", "max_workgroup_count",
    "max_storage_buffer_range", "min_storage_buffer_offset_alignment", "max_allocation_bytes",
    "max_push_constants_bytes", "max_storage_buffers_per_stage", "min_workgroups", "split_k_target_workgroups",
    "fp32_target_workgroups", "max_dispatches_per_submit", "memory_budget_bytes", "prefers_fp16", "gemm_tiles",
    "source"};
const std::vector<std::string> kOptional = {"max_dispatches_per_submit", "memory_budget_bytes", "prefers_fp16",
                                            "gemm_tiles", "min_workgroups", "split_k_target_workgroups",
                                            "fp32_target_workgroups", "source"};
constexpr uint32_t kSpirvMagic = 0x07230203;
constexpr uint64_t kMaxSplitDispatches = 1u << 20;  // dispatch.py MAX_SPLIT_DISPATCHES

bool among(const std::vector<std::string>& names, const std::string& s) {
  return std::find(names.begin(), names.end(), s) != names.end();
}

std::string joined(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

std::string sizes_text(const std::vector<int64_t>& v, const char* sep = "x") {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + num(v[i]);
  return out;
}

// The workgroup size `d` runs `m` with (ShaderModule.workgroup_size), else the dispatch's own; empty: none.
std::vector<int64_t> workgroup_size(const ShaderModuleRecord& m, const ScheduleDispatch& d) {
  if (m.local_size.size() == 3) {
    std::vector<int64_t> out;
    for (int axis = 0; axis < 3; ++axis) {
      int32_t id = m.local_size_spec_ids.size() == 3 ? m.local_size_spec_ids[axis] : -1;
      int64_t v = m.local_size[axis];
      if (id >= 0) {
        // dispatch.py specialization(): the local size as spec ids 0-2 first, then the kernel's constants.
        if (!d.local_size.empty() && id < 3) v = d.local_size[size_t(id)];
        for (const auto& s : d.spec_constants)
          if (int64_t(s.id) == id) v = s.kind == SpecKind::kFloat ? int64_t(s.float_value) : s.int_value;
      }
      out.push_back(v);
    }
    return out;
  }
  return {d.local_size.begin(), d.local_size.end()};
}

uint64_t product(const std::vector<int64_t>& v) {
  unsigned __int128 p = 1;
  for (int64_t x : v) p *= uint64_t(x < 0 ? 0 : x);
  return p > ~uint64_t(0) ? ~uint64_t(0) : uint64_t(p);
}

[[noreturn]] void refuse_verify(const std::string& source, const std::string& check, const std::string& message) {
  refuse(ErrorCode::kVerification, (source.empty() ? "" : source + ": ") + message + " [" + check + "]");
}

// --- device profiles -------------------------------------------------------------------------------------

class ProfileReader {
 public:
  ProfileReader(const Json& j, const std::string& where, ErrorCode code) : j_(j), where_(where), code_(code) {}

  DeviceProfile read() {
    if (j_.kind != Json::kObject) fail("expected a JSON object with the fields " + joined(kFields, ", "));
    std::vector<std::string> unknown, missing;
    for (const auto& [key, _] : j_.fields)
      if (!among(kFields, key)) unknown.push_back(key);
    for (const auto& f : kFields)
      if (!j_.fields.count(f) && !among(kOptional, f)) missing.push_back(f);
    if (!unknown.empty() || !missing.empty())
      fail((unknown.empty() ? "" : "unknown field(s) " + joined(unknown, ", ")) +
           (!unknown.empty() && !missing.empty() ? "; " : "") +
           (missing.empty() ? "" : "missing field(s) " + joined(missing, ", ")));
    DeviceProfile p;
    p.name = text("name");
    if (p.name.empty()) fail("name must be a non-empty string");
    p.api = text("api");
    if (!among(kApis, p.api)) fail("api must be one of vulkan, webgpu, got '" + p.api + "'");
    p.device_type = text("device_type");
    if (!among(kDeviceTypes, p.device_type)) fail("device_type must be one of " + joined(kDeviceTypes, ", "));
    if (j_.fields.count("source")) p.source = text("source");
    p.subgroup_size = integer("subgroup_size", 0);
    if (p.subgroup_size & (p.subgroup_size - 1)) fail("subgroup_size must be a power of two (or 0: none promised)");
    p.float16 = boolean("float16");
    p.int64 = boolean("int64");
    if (j_.fields.count("prefers_fp16")) p.prefers_fp16 = boolean("prefers_fp16");
    for (const char* f : {"max_shared_memory_bytes", "max_workgroup_invocations", "max_storage_buffer_range",
                          "min_storage_buffer_offset_alignment", "max_allocation_bytes",
                          "max_storage_buffers_per_stage"})
      *int_field(p, f) = integer(f, 1);
    p.max_push_constants_bytes = integer("max_push_constants_bytes", 0);
    for (const char* f : {"min_workgroups", "split_k_target_workgroups", "fp32_target_workgroups"})
      if (j_.fields.count(f)) *int_field(p, f) = integer(f, 1);
    for (const char* f : {"max_dispatches_per_submit", "memory_budget_bytes"})
      if (j_.fields.count(f)) *int_field(p, f) = integer(f, 0);
    if (p.min_storage_buffer_offset_alignment & (p.min_storage_buffer_offset_alignment - 1))
      fail("min_storage_buffer_offset_alignment must be a power of two");
    for (auto [f, out] : {std::make_pair("max_workgroup_size", &p.max_workgroup_size),
                          std::make_pair("max_workgroup_count", &p.max_workgroup_count)}) {
      const Json& v = j_.fields.at(f);
      bool ok = v.kind == Json::kArray && v.items.size() == 3;
      for (size_t i = 0; ok && i < 3; ++i) ok = v.items[i].kind == Json::kInt && v.items[i].integer >= 1;
      if (!ok) fail(std::string(f) + " must be 3 integers >= 1 (x, y, z)");
      for (size_t i = 0; i < 3; ++i) (*out)[i] = v.items[i].integer;
    }
    const Json& ops = j_.fields.at("subgroup_operations");
    bool ops_ok = ops.kind == Json::kArray;
    for (const Json& op : ops.items) {
      ops_ok = ops_ok && op.kind == Json::kString && among(kSubgroupOperations, op.text) &&
               !among(p.subgroup_operations, op.text);
      if (ops_ok) p.subgroup_operations.push_back(op.text);
    }
    if (!ops_ok) fail("subgroup_operations must be a list of distinct names among " + joined(kSubgroupOperations, ", "));
    if (j_.fields.count("gemm_tiles")) {
      const Json& t = j_.fields.at("gemm_tiles");
      bool ok = t.kind == Json::kArray && (t.items.empty() || t.items.size() == 3);
      for (const Json& v : t.items) {
        ok = ok && v.kind == Json::kInt && v.integer >= 1;
        if (ok) p.gemm_tiles.push_back(v.integer);
      }
      ok = ok && (p.gemm_tiles.empty() || (p.gemm_tiles[2] % 8 == 0 &&
                                            product({p.gemm_tiles[0], p.gemm_tiles[1]}) <= uint64_t(p.max_workgroup_invocations)));
      if (!ok) fail("gemm_tiles must be empty (the default tiles) or 3 integers >= 1 (threads_x, threads_y, bk; bk a "
                    "multiple of 8) within max_workgroup_invocations");
    }
    const Json& shapes = j_.fields.at("cooperative_matrix");
    if (shapes.kind != Json::kArray) fail("cooperative_matrix must be a list of shapes");
    for (size_t index = 0; index < shapes.items.size(); ++index) {
      const Json& s = shapes.items[index];
      const std::string at = "cooperative_matrix[" + num(index) + "]";
      const std::vector<std::string> names = {"m", "n", "k", "a_type", "b_type", "c_type", "result_type", "scope"};
      bool exact = s.kind == Json::kObject && s.fields.size() == names.size();
      for (const auto& n : names) exact = exact && s.fields.count(n);
      if (!exact) fail(at + " must have exactly the fields " + joined(names, ", "));
      CoopmatShape c;
      for (auto [f, out] : {std::make_pair("m", &c.m), std::make_pair("n", &c.n), std::make_pair("k", &c.k)}) {
        const Json& v = s.fields.at(f);
        if (v.kind != Json::kInt || v.integer < 1) fail(at + " has an invalid " + f);
        *out = v.integer;
      }
      for (auto [f, out] : {std::make_pair("a_type", &c.a_type), std::make_pair("b_type", &c.b_type),
                            std::make_pair("c_type", &c.c_type), std::make_pair("result_type", &c.result_type),
                            std::make_pair("scope", &c.scope)}) {
        const Json& v = s.fields.at(f);
        if (v.kind != Json::kString || !among(std::string(f) == "scope" ? kScopes : kComponentTypes, v.text))
          fail(at + " has an invalid " + f);
        *out = v.text;
      }
      p.cooperative_matrix.push_back(c);
    }
    return p;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { refuse(code_, where_ + ": " + what); }
  std::string text(const char* f) const {
    const Json& v = j_.fields.at(f);
    if (v.kind != Json::kString) fail(std::string(f) + " must be a string");
    return v.text;
  }
  bool boolean(const char* f) const {
    const Json& v = j_.fields.at(f);
    if (v.kind != Json::kBool) fail(std::string(f) + " must be true or false");
    return v.boolean;
  }
  int64_t integer(const char* f, int64_t least) const {
    const Json& v = j_.fields.at(f);
    if (v.kind != Json::kInt || v.integer < least) fail(std::string(f) + " must be an integer >= " + num(least));
    return v.integer;
  }
  static int64_t* int_field(DeviceProfile& p, const std::string& f) {
    if (f == "max_shared_memory_bytes") return &p.max_shared_memory_bytes;
    if (f == "max_workgroup_invocations") return &p.max_workgroup_invocations;
    if (f == "max_storage_buffer_range") return &p.max_storage_buffer_range;
    if (f == "min_storage_buffer_offset_alignment") return &p.min_storage_buffer_offset_alignment;
    if (f == "max_allocation_bytes") return &p.max_allocation_bytes;
    if (f == "max_storage_buffers_per_stage") return &p.max_storage_buffers_per_stage;
    if (f == "min_workgroups") return &p.min_workgroups;
    if (f == "split_k_target_workgroups") return &p.split_k_target_workgroups;
    if (f == "fp32_target_workgroups") return &p.fp32_target_workgroups;
    if (f == "max_dispatches_per_submit") return &p.max_dispatches_per_submit;
    return &p.memory_budget_bytes;
  }

  const Json& j_;
  const std::string& where_;
  ErrorCode code_;
};

// --- verification (verify_schedule.py) ----------------------------------------------------------------------

void check_shader_modules(const std::vector<ShaderModuleRecord>& modules, const std::string& source) {
  for (size_t index = 0; index < modules.size(); ++index) {
    const ShaderModuleRecord& m = modules[index];
    const std::string where = "shader module " + num(index) + " ('" + m.name + "')";
    if (m.kind == kSpirv) {
      if (m.code.size < 20 || m.code.size % 4 || le32(m.code.data) != kSpirvMagic)
        refuse_verify(source, "check_shader_modules", where + ": its " + num(m.code.size) + " bytes are not SPIR-V (a "
                                                      "multiple of 4 bytes starting with the magic word)");
    } else if (!valid_utf8(m.code.data, m.code.size)) {
      refuse_verify(source, "check_shader_modules", where + ": its WGSL text is not UTF-8");
    }
    if (!m.local_size.empty()) {
      bool ok = m.local_size.size() == 3 && *std::min_element(m.local_size.begin(), m.local_size.end()) >= 1 &&
                (m.local_size_spec_ids.empty() || m.local_size_spec_ids.size() == 3);
      if (!ok)
        refuse_verify(source, "check_shader_modules", where + ": workgroup size " + list(m.local_size) + " (spec ids " +
                                                      list(m.local_size_spec_ids) + ") is not 3 sizes >= 1");
    }
    for (size_t i = 0; i < m.bindings.size(); ++i)
      if (m.bindings[i].first != i) {
        std::vector<uint32_t> numbers;
        for (const auto& b : m.bindings) numbers.push_back(b.first);
        refuse_verify(source, "check_shader_modules", where + ": declares bindings " + list(numbers) + "; expected 0..n-1");
      }
  }
}

void check_schedule_modules(const EmbeddedSchedule& e, const std::vector<ShaderModuleRecord>& modules,
                            const std::string& source) {
  const auto dispatches = e.schedule.module_dispatches();
  if (e.dispatch_modules.size() != dispatches.size())
    refuse_verify(source, "check_schedule_modules", num(e.dispatch_modules.size()) + " dispatch module ids for " +
                                                    num(dispatches.size()) + " dispatches");
  const int kind = e.profile.api == "vulkan" ? kSpirv : kWgsl;
  for (size_t index = 0; index < dispatches.size(); ++index) {
    const ScheduleDispatch& d = *dispatches[index];
    const uint32_t id = e.dispatch_modules[index];
    const std::string where = "dispatch " + num(index) + " (" + d.name() + ")";
    if (id >= modules.size())
      refuse_verify(source, "check_schedule_modules", where + ": module id " + num(id) + " is out of range (the blob has " +
                                                      num(modules.size()) + " shader modules)");
    const ShaderModuleRecord& m = modules[id];
    if (m.name != d.shader || m.kind != kind)
      refuse_verify(source, "check_schedule_modules",
                    where + ": runs shader '" + d.shader + "' but module " + num(id) + " is " +
                        (m.kind == kSpirv ? "spirv" : "wgsl") + " of '" + m.name + "' (expected " +
                        (kind == kSpirv ? "spirv" : "wgsl") + ": the profile is " + e.profile.api + ")");
    if (d.bindings.size() != m.bindings.size())
      refuse_verify(source, "check_schedule_modules", where + ": binds " + num(d.bindings.size()) +
                                                      " buffers, its module declares " + num(m.bindings.size()));
    if (int64_t(d.push_bytes) != m.kernel_push_bytes() && (d.push_bytes || m.kernel_push_bytes() > 0))
      refuse_verify(source, "check_schedule_modules", where + ": pushes " + num(d.push_bytes) +
                                                      " bytes, its module's push block takes " + num(m.kernel_push_bytes()));
    std::vector<uint32_t> undeclared;
    auto declared = [&](uint32_t spec) { return std::find(m.spec_ids.begin(), m.spec_ids.end(), spec) != m.spec_ids.end(); };
    for (const auto& s : d.spec_constants)
      if (!declared(s.id)) undeclared.push_back(s.id);
    for (uint32_t axis = 0; axis < d.local_size.size(); ++axis)
      if (d.local_size[axis] != 1 && !declared(axis)) undeclared.push_back(axis);
    if (!undeclared.empty()) {
      std::sort(undeclared.begin(), undeclared.end());
      refuse_verify(source, "check_schedule_modules", where + ": specializes ids " + list(undeclared) +
                                                      ", which its module does not declare (" + list(m.spec_ids) + ")");
    }
  }
}

void check_schedule_profile(const EmbeddedSchedule& e, const std::vector<ShaderModuleRecord>& modules,
                            const std::string& source) {
  const DeviceProfile& p = e.profile;
  std::vector<std::string> unmet = unmet_requirements(e.schedule.requirements, p);
  if (!unmet.empty())
    refuse_verify(source, "check_schedule_profile", "relies on what its own profile '" + p.name + "' lacks: " +
                                                    joined(unmet, "; "));
  const auto dispatches = e.schedule.module_dispatches();
  for (size_t index = 0; index < dispatches.size(); ++index) {
    const ScheduleDispatch& d = *dispatches[index];
    const ShaderModuleRecord& m = modules[e.dispatch_modules[index]];
    const std::string where = "dispatch " + num(index) + " (" + d.name() + ")";
    std::vector<int64_t> local = workgroup_size(m, d);
    bool over = product(local) > uint64_t(p.max_workgroup_invocations);
    for (size_t axis = 0; axis < local.size() && axis < 3; ++axis) over = over || local[axis] > p.max_workgroup_size[axis];
    if (!local.empty() && over)
      refuse_verify(source, "check_schedule_profile", where + ": local size " + sizes_text(local, ", ") +
                                                      " is over profile '" + p.name + "''s limits");
    bool split = false;
    unsigned __int128 pieces = 1;
    for (int axis = 0; axis < 3; ++axis) {
      split = split || d.groups[axis] > uint64_t(p.max_workgroup_count[axis]);
      pieces *= (d.groups[axis] + uint64_t(p.max_workgroup_count[axis]) - 1) / uint64_t(p.max_workgroup_count[axis]);
    }
    if (split && !m.push_header)
      refuse_verify(source, "check_schedule_profile", where + ": its work groups are over profile '" + p.name +
                                                      "''s max, and its module cannot be split (no group-offset header)");
    if (pieces > kMaxSplitDispatches)
      refuse_verify(source, "check_schedule_profile", where + ": its work groups split into more than " +
                                                      num(kMaxSplitDispatches) + " dispatches under profile '" + p.name + "'");
  }
}

// embedded.py unmet_needs.
std::vector<std::string> unmet_needs(const EmbeddedSchedule& e, const std::vector<ShaderModuleRecord>& modules,
                                     const DeviceProfile& device) {
  const Schedule& s = e.schedule;
  std::vector<std::string> missing = unmet_requirements(s.requirements, device);
  if (!missing.empty() && s.requirements.api != device.api) return missing;
  const ScheduleBuffer* largest = nullptr;
  for (const auto& b : s.buffers)
    if (!largest || b.size_bytes > largest->size_bytes) largest = &b;
  if (largest && largest->size_bytes > uint64_t(device.max_allocation_bytes))
    missing.push_back("allocations of " + num(largest->size_bytes) + " bytes (buffer '" + largest->key +
                      "'; the device's max allocation size is " + num(device.max_allocation_bytes) + ")");
  const auto dispatches = s.module_dispatches();
  size_t bindings = 0;
  for (const auto* d : dispatches) bindings = std::max(bindings, d->bindings.size());
  if (bindings > uint64_t(device.max_storage_buffers_per_stage))
    missing.push_back(num(bindings) + " storage buffers per dispatch (the device binds " +
                      num(device.max_storage_buffers_per_stage) + ")");
  if (device.api == "vulkan") {
    uint32_t push = 0;
    for (uint32_t id : e.dispatch_modules) push = std::max(push, modules[id].push_constant_bytes);
    if (push > uint64_t(device.max_push_constants_bytes))
      missing.push_back(num(push) + " bytes of push constants (the device takes " + num(device.max_push_constants_bytes) + ")");
  }
  for (size_t index = 0; index < dispatches.size(); ++index) {
    std::vector<int64_t> local = workgroup_size(modules[e.dispatch_modules[index]], *dispatches[index]);
    if (local.empty()) continue;
    bool over = product(local) > uint64_t(device.max_workgroup_invocations);
    for (size_t axis = 0; axis < local.size() && axis < 3; ++axis) over = over || local[axis] > device.max_workgroup_size[axis];
    if (over) {
      missing.push_back("workgroups of " + sizes_text(local) + " (" + dispatches[index]->name() + "; the device's max is " +
                        sizes_text({device.max_workgroup_size.begin(), device.max_workgroup_size.end()}) + ", " +
                        num(device.max_workgroup_invocations) + " invocations)");
      break;
    }
  }
  return missing;
}

class EmbeddedStepSource : public StepSource {
 public:
  EmbeddedStepSource(const Graph& graph, EmbeddedSchedule chosen) : graph_(graph), chosen_(std::move(chosen)) {}
  const Schedule& schedule() const override { return chosen_.schedule; }
  std::vector<uint32_t> module(const std::string& name) const override {
    for (uint32_t id : chosen_.dispatch_modules) {
      const ShaderModuleRecord& m = graph_.shader_modules[id];
      if (m.name != name) continue;
      std::vector<uint32_t> words(m.code.size / 4);
      for (size_t i = 0; i < words.size(); ++i) words[i] = le32(m.code.data + 4 * i);
      return words;
    }
    refuse(ErrorCode::kShaderModule, "shader '" + name + "': the embedded schedule for profile '" +
                                         chosen_.profile.name + "' has no module of it");
  }

 private:
  const Graph& graph_;
  EmbeddedSchedule chosen_;
};

}  // namespace

bool CoopmatShape::operator==(const CoopmatShape& o) const {
  return std::tie(m, n, k, a_type, b_type, c_type, result_type, scope) ==
         std::tie(o.m, o.n, o.k, o.a_type, o.b_type, o.c_type, o.result_type, o.scope);
}

DeviceProfile DeviceProfile::from_json(const std::string& text, const std::string& where, ErrorCode code) {
  Json j = Json::parse(text, where, code);
  return ProfileReader(j, where, code).read();
}

bool DeviceProfile::same_planning_fields(const DeviceProfile& o) const {
  auto fields = [](const DeviceProfile& p) {
    return std::tie(p.api, p.device_type, p.subgroup_size, p.subgroup_operations, p.float16, p.int64,
                    p.cooperative_matrix, p.max_shared_memory_bytes, p.max_workgroup_invocations, p.max_workgroup_size,
                    p.max_workgroup_count, p.max_storage_buffer_range, p.min_storage_buffer_offset_alignment,
                    p.max_allocation_bytes, p.max_push_constants_bytes, p.max_storage_buffers_per_stage,
                    p.min_workgroups, p.split_k_target_workgroups, p.fp32_target_workgroups,
                    p.max_dispatches_per_submit, p.memory_budget_bytes, p.prefers_fp16, p.gemm_tiles);
  };
  return fields(*this) == fields(o);
}

DeviceProfile device_profile_of(const Device& device) {
  const VkPhysicalDeviceLimits& l = device.limits();
  DeviceProfile p;
  p.name = device.name();
  p.api = "vulkan";
  p.device_type = device.device_type();
  p.subgroup_size = device.subgroup_size();
  for (size_t bit = 0; bit < kSubgroupOperations.size(); ++bit)
    if (device.subgroup_operations() >> bit & 1) p.subgroup_operations.push_back(kSubgroupOperations[bit]);
  p.float16 = device.has_feature("shaderFloat16");
  p.int64 = device.has_feature("shaderInt64");
  p.max_shared_memory_bytes = l.maxComputeSharedMemorySize;
  p.max_workgroup_invocations = l.maxComputeWorkGroupInvocations;
  for (int axis = 0; axis < 3; ++axis) {
    p.max_workgroup_size[axis] = l.maxComputeWorkGroupSize[axis];
    p.max_workgroup_count[axis] = l.maxComputeWorkGroupCount[axis];
  }
  p.max_storage_buffer_range = l.maxStorageBufferRange;
  p.min_storage_buffer_offset_alignment = int64_t(l.minStorageBufferOffsetAlignment);
  p.max_allocation_bytes = int64_t(device.max_allocation_bytes());
  p.max_push_constants_bytes = l.maxPushConstantsSize;
  p.max_storage_buffers_per_stage = l.maxPerStageDescriptorStorageBuffers;
  // device_profiles.py _coopmat_shapes: the combinations whose types and scope the profile vocabulary names.
  auto component = [](int32_t value) -> std::string {  // coopmat.py COMPONENT_TYPE_NAMES (VkComponentTypeKHR)
    static const char* const names[] = {"float16", "float32", "float64", "int8", "int16", "int32",
                                        "int64", "uint8", "uint16", "uint32", "uint64"};
    if (value >= 0 && value <= 10) return names[value];
    return value == 1000141000 ? "bfloat16" : "";
  };
  auto scope = [](int32_t value) -> std::string {  // coopmat.py SCOPE_NAMES (VkScopeKHR)
    return value == 1 ? "device" : value == 2 ? "workgroup" : value == 3 ? "subgroup" : value == 5 ? "queue_family" : "";
  };
  for (const CoopmatProperty& c : device.cooperative_matrix()) {
    CoopmatShape s{int64_t(c.m), int64_t(c.n), int64_t(c.k), component(c.a_type), component(c.b_type),
                   component(c.c_type), component(c.result_type), scope(c.scope)};
    if (among(kComponentTypes, s.a_type) && among(kComponentTypes, s.b_type) && among(kComponentTypes, s.c_type) &&
        among(kComponentTypes, s.result_type) && among(kScopes, s.scope))
      p.cooperative_matrix.push_back(s);
  }
  // device_profile.py VENDOR_GEMM_TUNING (by name), its tiles only where the device runs them.
  std::string lowered = p.name;
  std::transform(lowered.begin(), lowered.end(), lowered.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  std::vector<int64_t> tiles;
  if (lowered.find("adreno") != std::string::npos) tiles = {16, 8, 8};
  else if (lowered.find("mali") != std::string::npos) tiles = {8, 8, 8};
  if (!tiles.empty()) {
    p.prefers_fp16 = true;
    if (uint64_t(tiles[0] * tiles[1]) <= uint64_t(p.max_workgroup_invocations)) p.gemm_tiles = tiles;
  }
  p.source = "queried: " + p.name;
  return p;
}

std::vector<std::string> unmet_requirements(const ScheduleRequirements& q, const DeviceProfile& p) {
  std::vector<std::string> missing;
  if (p.api != q.api) missing.push_back("the schedule is for the " + q.api + " runtime, the device is " + p.api);
  for (auto [name, need, have] : {std::make_tuple("max_storage_buffer_range", uint64_t(q.max_storage_buffer_range), p.max_storage_buffer_range),
                                  std::make_tuple("max_shared_memory_bytes", uint64_t(q.max_shared_memory_bytes), p.max_shared_memory_bytes),
                                  std::make_tuple("max_workgroup_invocations", uint64_t(q.max_workgroup_invocations), p.max_workgroup_invocations),
                                  std::make_tuple("max_workgroup_size_x", uint64_t(q.max_workgroup_size_x), p.max_workgroup_size[0])})
    if (uint64_t(have) < need) missing.push_back(std::string(name) + " " + num(need) + " (the device has " + num(have) + ")");
  if (p.min_storage_buffer_offset_alignment > 0 && q.min_storage_buffer_offset_alignment % uint64_t(p.min_storage_buffer_offset_alignment))
    missing.push_back("a min_storage_buffer_offset_alignment dividing " + num(q.min_storage_buffer_offset_alignment) +
                      " (the device's is " + num(p.min_storage_buffer_offset_alignment) + ")");
  if (q.subgroup_size && p.subgroup_size != int64_t(q.subgroup_size))
    missing.push_back("subgroups of " + num(q.subgroup_size) + " lanes (the device's have " + num(p.subgroup_size) + ")");
  std::vector<std::string> absent;
  for (const auto& op : q.subgroup_operations)
    if (!among(p.subgroup_operations, op)) absent.push_back(op);
  if (!absent.empty()) missing.push_back("subgroup operations " + joined(absent, ", "));
  if (q.float16 && !p.float16) missing.push_back("float16");
  if (q.int64 && !p.int64) missing.push_back("int64");
  if (!q.cooperative_matrix.empty()) {
    bool found = false;
    for (const auto& s : p.cooperative_matrix)
      found = found || (q.cooperative_matrix.size() == 3 && s.m == q.cooperative_matrix[0] && s.n == q.cooperative_matrix[1] &&
                        s.k == q.cooperative_matrix[2] && s.a_type == "float16" && s.b_type == "float16" &&
                        s.c_type == "float32" && s.result_type == "float32" && s.scope == "subgroup");
    if (!found) {
      std::vector<int64_t> shape(q.cooperative_matrix.begin(), q.cooperative_matrix.end());
      missing.push_back(sizes_text(shape) + " float16 x float16 + float32 cooperative matrices");
    }
  }
  return missing;
}

std::vector<EmbeddedSchedule> verify_embedded(const Graph& graph, const std::string& source) {
  std::vector<EmbeddedSchedule> out;
  if (graph.schedules.empty() && graph.shader_modules.empty()) return out;
  // blob.py _read_embedded reads every profile before anything is verified.
  const std::string prefix = source.empty() ? "" : source + ": ";
  std::vector<DeviceProfile> profiles;
  for (size_t index = 0; index < graph.schedules.size(); ++index)
    profiles.push_back(DeviceProfile::from_json(graph.schedules[index].profile_json, prefix + "embedded schedule " +
                                                num(index) + "'s device profile", ErrorCode::kBlobFormat));
  check_shader_modules(graph.shader_modules, source);
  std::vector<std::string> sources;  // the kernels a dispatch may name: the blob's modules'
  for (const auto& m : graph.shader_modules) sources.push_back(m.name.substr(0, m.name.find('@')));
  for (size_t index = 0; index < graph.schedules.size(); ++index) {
    const EmbeddedScheduleRecord& r = graph.schedules[index];
    const std::string where = prefix + "embedded schedule " + num(index) + " (profile '" + profiles[index].name + "')";
    EmbeddedSchedule e{profiles[index], Schedule::parse(r.schedule, where), r.dispatch_modules};
    check_schedule_modules(e, graph.shader_modules, where);
    verify_schedule(e.schedule, &graph, &sources);
    check_schedule_profile(e, graph.shader_modules, where);
    out.push_back(std::move(e));
  }
  return out;
}

size_t select_schedule(const std::vector<EmbeddedSchedule>& schedules, const std::vector<ShaderModuleRecord>& modules,
                       const DeviceProfile& device, const std::string& device_name, const std::string& source,
                       const std::string& only_profile) {
  using Key = std::tuple<bool, bool, bool, uint64_t, uint64_t, uint64_t>;
  bool found = false;
  Key best{};
  size_t chosen = 0;
  std::vector<std::string> refusals, names;
  for (const auto& e : schedules) names.push_back(e.profile.name);
  if (!only_profile.empty() && !among(names, only_profile))
    refuse(ErrorCode::kUnsupported, source + " has no embedded schedule for profile '" + only_profile + "' (it has " +
                                        joined(names, ", ") + ")");
  names.clear();
  for (size_t index = 0; index < schedules.size(); ++index) {
    const EmbeddedSchedule& e = schedules[index];
    if (!only_profile.empty() && e.profile.name != only_profile) continue;
    names.push_back(e.profile.name);
    std::vector<std::string> missing = unmet_needs(e, modules, device);
    if (!missing.empty()) {
      refusals.push_back(e.profile.name + ": " + joined(missing, "; "));
      continue;
    }
    const ScheduleRequirements& q = e.schedule.requirements;
    Key key{e.profile.same_planning_fields(device), !q.cooperative_matrix.empty(), q.subgroup_size != 0,
            q.max_shared_memory_bytes, q.max_workgroup_invocations, q.max_storage_buffer_range};
    if (!found || key > best) {  // strictly larger: ties keep the first embedded
      found = true;
      best = key;
      chosen = index;
    }
  }
  if (!found)
    refuse(ErrorCode::kUnsupported,
           source + " embeds schedules for the device profiles " + joined(names, ", ") + ", and " + device_name +
               " (profile '" + device.name + "') runs none of them; it lacks, per profile: " + joined(refusals, " | ") +
               ". Export it again with a --target this device satisfies (its own profile: `vktrain devices --json`), "
               "or give --schedule-file and --spirv-dir");
  return chosen;
}

std::unique_ptr<StepSource> embedded_step_source(const Graph& graph, EmbeddedSchedule chosen) {
  return std::make_unique<EmbeddedStepSource>(graph, std::move(chosen));
}

}  // namespace vktrain
