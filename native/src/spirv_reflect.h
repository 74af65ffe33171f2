// What a compute shader expects from the host, read from its SPIR-V (runtime_shaders/reflect.py's
// reflect_spirv, instruction for instruction): set-0 storage buffers and their readonly / writeonly
// declarations, the push-constant block's size and whether it starts with the group-offset header of split
// dispatches, and the type of each specialization constant. Every word index is bounds-checked.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace vktrain {

struct ShaderBinding {
  uint32_t set = 0, binding = 0;
  bool readonly = false, writeonly = false, uniform = false;
};

enum class SpecType { kBool, kInt, kUint, kFloat, kOther };

struct ShaderInterface {
  std::vector<ShaderBinding> bindings;  // sorted by (set, binding)
  int64_t push_constant_size = 0;       // 0: no block; -1: not computable
  bool has_group_offset_header = false;
  std::map<uint32_t, SpecType> spec_types;
  uint32_t spirv_version = 0;          // the header's word 1 (0x00010300: SPIR-V 1.3)
  std::vector<uint32_t> capabilities;  // OpCapability operands, in order
};

// LoadError kShaderModule naming `source` (the file) when `words` is not SPIR-V or is malformed.
ShaderInterface reflect_spirv(const std::vector<uint32_t>& words, const std::string& source);

}  // namespace vktrain
