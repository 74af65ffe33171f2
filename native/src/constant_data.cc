#include "constant_data.h"

#include <cstring>

#include "status.h"

namespace vktrain {

float half_to_float(uint16_t h) {  // exact: every float16 is a float32
  uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (!mantissa) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { ++e; mantissa <<= 1; } while (!(mantissa & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | (mantissa & 0x3FF) << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<uint8_t> constant_bytes(const Constant& c, const std::string& what) {
  if (c.synthetic)
    refuse(ErrorCode::kUnsupported, what + " is a synthetic constant (a benchmark blob's, generated at load by the "
                                           "Python runtime); the native runtime runs programs with stored constants");
  const uint8_t* p = c.data.data;
  size_t n = c.data.size;
  if (!c.narrow) return std::vector<uint8_t>(p, p + n);
  std::vector<float> out;
  if (c.stored_form == "bfloat16") {
    out.resize(n / 2);
    for (size_t i = 0; i < out.size(); ++i) {
      uint32_t bits = uint32_t(p[2 * i] | p[2 * i + 1] << 8) << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  } else if (c.stored_form == "float16") {
    out.resize(n / 2);
    for (size_t i = 0; i < out.size(); ++i) out[i] = half_to_float(uint16_t(p[2 * i] | p[2 * i + 1] << 8));
  } else if (c.stored_form == "gguf_q8_0") {  // per 34-byte block: float16 d, 32 int8 q; value = float32(d) * q
    out.resize(n / 34 * 32);
    for (size_t b = 0; b < n / 34; ++b) {
      const uint8_t* block = p + 34 * b;
      float d = half_to_float(uint16_t(block[0] | block[1] << 8));
      for (int k = 0; k < 32; ++k) out[32 * b + k] = d * float(int8_t(block[2 + k]));
    }
  } else {
    refuse(ErrorCode::kInternal, what + ": narrow constant stored as '" + c.stored_form + "'");
  }
  std::vector<uint8_t> bytes(out.size() * 4);
  std::memcpy(bytes.data(), out.data(), bytes.size());
  return bytes;
}

}  // namespace vktrain
