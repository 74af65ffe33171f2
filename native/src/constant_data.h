// A constant's values as its tensors read them (graph.py constant_bytes): the stored bytes, a narrow constant
// widened back to float32 bit for bit (narrow_constant.py: bfloat16, float16, GGUF Q8_0 blocks), or a synthetic
// one generated (synthetic.h; benchmark blobs). Streamed a piece at a time, so uploading a constant of gigabytes
// holds one piece in host memory, not the constant.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "graph.h"

namespace vktrain {

constexpr uint64_t kConstantPieceBytes = uint64_t(16) << 20;  // a multiple of every element and Q8_0 block (128 B)

// Calls take(data, size) with the first `nbytes` bytes of the constant's values, in order, in pieces of at most
// kConstantPieceBytes (whole elements). `nbytes` must not exceed what the constant holds (step_plan.cc checks).
void stream_constant(const Constant& constant, uint64_t nbytes, const std::string& what,
                     const std::function<void(const uint8_t*, uint64_t)>& take);

// The whole of it in one vector (small constants: a state's initial value).
std::vector<uint8_t> constant_bytes(const Constant& constant, const std::string& what);

float half_to_float(uint16_t h);

}  // namespace vktrain
