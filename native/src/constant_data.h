// A constant's values as its tensors read them (graph.py constant_bytes): the stored bytes, or a narrow
// constant widened back to float32 bit for bit (narrow_constant.py: bfloat16, float16, GGUF Q8_0 blocks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph.h"

namespace vktrain {

// LoadError kUnsupported for a synthetic constant (benchmark blobs; generated only by the Python runtime).
std::vector<uint8_t> constant_bytes(const Constant& constant, const std::string& what);

float half_to_float(uint16_t h);

}  // namespace vktrain
