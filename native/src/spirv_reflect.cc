#include "spirv_reflect.h"

#include <algorithm>
#include <functional>
#include <set>

#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr uint32_t kMagic = 0x07230203;
enum Op : uint32_t {
  kOpName = 5, kOpCapability = 17, kOpMemberName = 6, kOpTypeBool = 20, kOpTypeInt = 21, kOpTypeFloat = 22, kOpTypeVector = 23,
  kOpTypeMatrix = 24, kOpTypeArray = 28, kOpTypeRuntimeArray = 29, kOpTypeStruct = 30, kOpTypePointer = 32,
  kOpConstant = 43, kOpSpecConstantTrue = 48, kOpSpecConstantFalse = 49, kOpSpecConstant = 50, kOpVariable = 59,
  kOpDecorate = 71, kOpMemberDecorate = 72,
};
enum Decoration : uint32_t {
  kSpecId = 1, kBufferBlock = 3, kArrayStride = 6, kMatrixStride = 7, kNonWritable = 24, kNonReadable = 25,
  kBinding = 33, kDescriptorSet = 34, kOffset = 35,
};
enum StorageClass : uint32_t { kUniform = 2, kPushConstant = 9, kStorageBuffer = 12 };
constexpr const char* kGroupOffsetMember = "vktrain_group_offset";  // reflect.py GROUP_OFFSET_MEMBER

using Operands = std::vector<uint32_t>;
using Decorations = std::map<uint32_t, Operands>;  // decoration -> its operands (the last one wins)

std::string literal_string(const uint32_t* w, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i)
    for (int b = 0; b < 4; ++b) {
      char c = char((w[i] >> (8 * b)) & 0xFF);
      if (!c) return out;
      out += c;
    }
  return out;
}

}  // namespace

ShaderInterface reflect_spirv(const std::vector<uint32_t>& words, const std::string& source) {
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kShaderModule, source + ": " + why); };
  if (words.size() < 5) bad("not SPIR-V: " + num(words.size() * 4) + " bytes (want at least 20)");
  if (words[0] != kMagic) bad("not SPIR-V: magic " + hex8(words[0]) + ", expected 0x07230203");

  std::map<std::pair<uint32_t, uint32_t>, std::string> member_names;
  std::map<uint32_t, Decorations> decorations;
  std::map<std::pair<uint32_t, uint32_t>, Decorations> member_decorations;
  std::map<uint32_t, std::pair<uint32_t, Operands>> types;  // id -> (opcode, operands after the result id)
  std::map<uint32_t, uint32_t> constants;
  std::vector<std::array<uint32_t, 3>> variables;  // (pointer type, id, storage class)
  std::map<uint32_t, int64_t> spec_constants;       // result id -> result type (-1: boolean)

  std::vector<uint32_t> capabilities;
  size_t position = 5;
  while (position < words.size()) {
    uint32_t count = words[position] >> 16, opcode = words[position] & 0xFFFF;
    if (count == 0) bad("malformed SPIR-V: zero-length instruction at word " + num(position));
    if (position + count > words.size())
      bad("malformed SPIR-V: the instruction at word " + num(position) + " runs past the end");
    const uint32_t* o = &words[position + 1];
    size_t n = count - 1;
    auto need = [&](size_t k) {
      if (n < k) bad("malformed SPIR-V: opcode " + num(opcode) + " at word " + num(position) + " has " + num(n) +
                     " operands, needs " + num(k));
    };
    switch (opcode) {
      case kOpCapability: need(1); capabilities.push_back(o[0]); break;
      case kOpMemberName: need(2); member_names[{o[0], o[1]}] = literal_string(o + 2, n - 2); break;
      case kOpDecorate: need(2); decorations[o[0]][o[1]] = Operands(o + 2, o + n); break;
      case kOpMemberDecorate: need(3); member_decorations[{o[0], o[1]}][o[2]] = Operands(o + 3, o + n); break;
      case kOpTypeBool: case kOpTypeInt: case kOpTypeFloat: case kOpTypeVector: case kOpTypeMatrix:
      case kOpTypeArray: case kOpTypeRuntimeArray: case kOpTypeStruct: case kOpTypePointer:
        need(1); types[o[0]] = {opcode, Operands(o + 1, o + n)}; break;
      case kOpConstant: case kOpSpecConstant:
        if (n >= 3) {
          constants[o[1]] = o[2];
          if (opcode == kOpSpecConstant) spec_constants[o[1]] = o[0];
        }
        break;
      case kOpSpecConstantTrue: case kOpSpecConstantFalse: need(2); spec_constants[o[1]] = -1; break;
      case kOpVariable: need(3); variables.push_back({o[0], o[1], o[2]}); break;
      default: break;
    }
    position += count;
  }

  auto type_of = [&](uint32_t id) -> const std::pair<uint32_t, Operands>* {
    auto it = types.find(id);
    return it == types.end() ? nullptr : &it->second;
  };
  auto decoration = [&](const Decorations* d, uint32_t which) -> const Operands* {
    if (!d) return nullptr;
    auto it = d->find(which);
    return it == d->end() ? nullptr : &it->second;
  };
  auto decos_of = [&](uint32_t id) -> const Decorations* {
    auto it = decorations.find(id);
    return it == decorations.end() ? nullptr : &it->second;
  };
  auto member_decos = [&](uint32_t id, uint32_t member) -> const Decorations* {
    auto it = member_decorations.find({id, member});
    return it == member_decorations.end() ? nullptr : &it->second;
  };
  auto pointee = [&](uint32_t pointer_type) -> int64_t {
    const auto* t = type_of(pointer_type);
    if (!t || t->first != kOpTypePointer || t->second.size() < 2) return -1;
    return t->second[1];
  };
  // reflect.py size_of; -1 where it returns None. Depth-bounded: a hostile module may nest types in a cycle.
  std::function<int64_t(uint32_t, int64_t, int)> size_of = [&](uint32_t id, int64_t stride_hint, int depth) -> int64_t {
    const auto* t = type_of(id);
    if (!t || depth > 64) return -1;
    const Operands& rest = t->second;
    switch (t->first) {
      case kOpTypeInt: case kOpTypeFloat: return rest.empty() ? -1 : rest[0] / 8;
      case kOpTypeBool: return 4;
      case kOpTypeVector: {
        if (rest.size() < 2) return -1;
        int64_t component = size_of(rest[0], -1, depth + 1);
        return component < 0 ? -1 : component * rest[1];
      }
      case kOpTypeMatrix: return stride_hint < 0 || rest.size() < 2 ? -1 : stride_hint * rest[1];
      case kOpTypeArray: {
        const Operands* stride = decoration(decos_of(id), kArrayStride);
        auto length = rest.size() < 2 ? constants.end() : constants.find(rest[1]);
        if (!stride || stride->empty() || length == constants.end()) return -1;
        return int64_t((*stride)[0]) * length->second;
      }
      case kOpTypeStruct: {
        int64_t end = 0;
        for (uint32_t index = 0; index < rest.size(); ++index) {
          const Decorations* member = member_decos(id, index);
          const Operands* offset = decoration(member, kOffset);
          const Operands* matrix_stride = decoration(member, kMatrixStride);
          int64_t size = size_of(rest[index], matrix_stride && !matrix_stride->empty() ? (*matrix_stride)[0] : -1,
                                 depth + 1);
          if (!offset || offset->empty() || size < 0) return -1;
          end = std::max<int64_t>(end, (*offset)[0] + size);
        }
        return end;
      }
      default: return -1;
    }
  };
  auto all_members = [&](uint32_t struct_id, uint32_t which) {
    const auto* t = type_of(struct_id);
    if (!t || t->second.empty()) return false;
    for (uint32_t i = 0; i < t->second.size(); ++i)
      if (!decoration(member_decos(struct_id, i), which)) return false;
    return true;
  };

  ShaderInterface out;
  out.spirv_version = words[1];
  out.capabilities = capabilities;
  for (const auto& v : variables) {
    uint32_t pointer_type = v[0], variable = v[1], storage_class = v[2];
    if (storage_class == kStorageBuffer || storage_class == kUniform) {
      const Decorations* decos = decos_of(variable);
      const Operands* binding = decoration(decos, kBinding);
      if (!binding) continue;
      int64_t block = pointee(pointer_type);
      const auto* bt = block < 0 ? nullptr : type_of(uint32_t(block));
      if (!bt || bt->first != kOpTypeStruct) continue;
      ShaderBinding b;
      const Operands* set = decoration(decos, kDescriptorSet);
      b.set = set && !set->empty() ? (*set)[0] : 0;
      if (binding->empty()) bad("malformed SPIR-V: a Binding decoration without its number");
      b.binding = (*binding)[0];
      b.uniform = storage_class == kUniform && !decoration(decos_of(uint32_t(block)), kBufferBlock);
      b.readonly = decoration(decos, kNonWritable) || all_members(uint32_t(block), kNonWritable);
      b.writeonly = decoration(decos, kNonReadable) || all_members(uint32_t(block), kNonReadable);
      out.bindings.push_back(b);
    } else if (storage_class == kPushConstant) {
      int64_t block = pointee(pointer_type);
      if (block < 0) { out.push_constant_size = -1; continue; }
      out.push_constant_size = size_of(uint32_t(block), -1, 0);
      const Operands* first_offset = decoration(member_decos(uint32_t(block), 0), kOffset);
      auto name = member_names.find({uint32_t(block), 0});
      out.has_group_offset_header = name != member_names.end() && name->second == kGroupOffsetMember &&
                                    first_offset && !first_offset->empty() && (*first_offset)[0] == 0;
    }
  }
  std::sort(out.bindings.begin(), out.bindings.end(), [](const ShaderBinding& a, const ShaderBinding& b) {
    return std::make_pair(a.set, a.binding) < std::make_pair(b.set, b.binding);
  });
  for (const auto& [result_id, result_type] : spec_constants) {
    const Operands* spec_id = decoration(decos_of(result_id), kSpecId);
    if (!spec_id || spec_id->empty()) continue;
    SpecType kind = SpecType::kOther;
    if (result_type < 0) {
      kind = SpecType::kBool;
    } else if (const auto* t = type_of(uint32_t(result_type))) {
      if (t->first == kOpTypeFloat && !t->second.empty() && t->second[0] == 32) kind = SpecType::kFloat;
      else if (t->first == kOpTypeInt && t->second.size() >= 2 && t->second[0] == 32)
        kind = t->second[1] ? SpecType::kInt : SpecType::kUint;
    }
    out.spec_types[(*spec_id)[0]] = kind;
  }
  return out;
}

}  // namespace vktrain
