#include "constant_data.h"

#include <algorithm>
#include <cstring>

#include "status.h"
#include "text.h"

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

namespace {

// Elements [first, first + count) of a narrow constant, widened to float32.
void widen(const Constant& c, uint64_t first, uint64_t count, float* out, const std::string& what) {
  const uint8_t* p = c.data.data;
  if (c.stored_form == "bfloat16") {
    for (uint64_t i = 0; i < count; ++i) {
      const uint8_t* e = p + 2 * (first + i);
      uint32_t bits = uint32_t(e[0] | e[1] << 8) << 16;
      std::memcpy(&out[i], &bits, 4);
    }
  } else if (c.stored_form == "float16") {
    for (uint64_t i = 0; i < count; ++i) {
      const uint8_t* e = p + 2 * (first + i);
      out[i] = half_to_float(uint16_t(e[0] | e[1] << 8));
    }
  } else if (c.stored_form == "gguf_q8_0") {  // per 34-byte block: float16 d, 32 int8 q; value = float32(d) * q
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t element = first + i;
      const uint8_t* block = p + 34 * (element / 32);
      float d = half_to_float(uint16_t(block[0] | block[1] << 8));
      out[i] = d * float(int8_t(block[2 + element % 32]));
    }
  } else {
    refuse(ErrorCode::kInternal, what + ": narrow constant stored as '" + c.stored_form + "'");
  }
}

}  // namespace

void stream_constant(const Constant& c, uint64_t nbytes, const std::string& what,
                     const std::function<void(const uint8_t*, uint64_t)>& take) {
  if (c.synthetic) {
    if (nbytes > c.nbytes) refuse(ErrorCode::kInternal, what + ": " + num(nbytes) + " bytes of a " + num(c.nbytes) + "-byte constant");
    SyntheticStream stream(c.synthetic_record);
    std::vector<uint8_t> piece(std::min(nbytes, kConstantPieceBytes));
    for (uint64_t done = 0; done < nbytes;) {
      const uint64_t n = std::min(nbytes - done, kConstantPieceBytes);
      stream.next(piece.data(), n);
      take(piece.data(), n);
      done += n;
    }
    return;
  }
  if (!c.narrow) {  // straight from the mapped file
    if (nbytes > c.data.size) refuse(ErrorCode::kInternal, what + ": " + num(nbytes) + " bytes of " + num(c.data.size));
    for (uint64_t done = 0; done < nbytes; done += kConstantPieceBytes)
      take(c.data.data + done, std::min(nbytes - done, kConstantPieceBytes));
    return;
  }
  const uint64_t elements = c.stored_form == "gguf_q8_0" ? c.data.size / 34 * 32 : c.data.size / 2;
  if (nbytes % 4 || nbytes / 4 > elements) refuse(ErrorCode::kInternal, what + ": " + num(nbytes) + " bytes of " + num(elements) + " floats");
  std::vector<float> piece(std::min(nbytes, kConstantPieceBytes) / 4);
  for (uint64_t done = 0; done < nbytes;) {
    const uint64_t n = std::min(nbytes - done, kConstantPieceBytes);
    widen(c, done / 4, n / 4, piece.data(), what);
    take(reinterpret_cast<const uint8_t*>(piece.data()), n);
    done += n;
  }
}

std::vector<uint8_t> constant_bytes(const Constant& c, const std::string& what) {
  const uint64_t total = c.synthetic ? c.nbytes : !c.narrow ? c.data.size
                         : (c.stored_form == "gguf_q8_0" ? c.data.size / 34 * 32 : c.data.size / 2) * 4;
  if (total > (uint64_t(4) << 30))  // one vector: small constants only (uploads stream); a hostile size stops here
    refuse(ErrorCode::kLimit, what + " has " + num(total) + " bytes, more than the 4 GiB read whole on the host");
  std::vector<uint8_t> out;
  out.reserve(total);
  stream_constant(c, total, what, [&](const uint8_t* p, uint64_t n) { out.insert(out.end(), p, p + n); });
  return out;
}

}  // namespace vktrain
