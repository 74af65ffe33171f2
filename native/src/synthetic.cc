#include "synthetic.h"

#include <cmath>
#include <cstring>

#include "graph.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

// numpy's SeedSequence (bit_generator.pyx) constants.
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875, kInitB = 0x8b51f9dd, kMultB = 0x58f38ded,
                   kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715, kXShift = 16, kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t* hash_const) {
  value ^= *hash_const;
  *hash_const *= kMultA;
  value *= *hash_const;
  return value ^ (value >> kXShift);
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  return result ^ (result >> kXShift);
}

// SeedSequence(seed).generate_state(4, uint64): the entropy is the seed's 32-bit words, least significant first
// (one word for seeds below 2**32; [0] for 0), mixed into a pool of four words, then hashed out.
void seed_sequence_state(uint64_t seed, uint64_t out[4]) {
  std::vector<uint32_t> entropy;
  if (seed == 0) entropy.push_back(0);
  for (uint64_t s = seed; s; s >>= 32) entropy.push_back(uint32_t(s));
  uint32_t pool[kPoolSize];
  uint32_t hash_const = kInitA;
  for (uint32_t i = 0; i < kPoolSize; ++i) pool[i] = hashmix(i < entropy.size() ? entropy[i] : 0, &hash_const);
  for (uint32_t src = 0; src < kPoolSize; ++src)
    for (uint32_t dst = 0; dst < kPoolSize; ++dst)
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], &hash_const));
  // (entropy beyond the pool's four words cannot occur: a seed has at most two)
  uint32_t words[8];
  hash_const = kInitB;
  for (uint32_t i = 0; i < 8; ++i) {
    uint32_t v = pool[i % kPoolSize] ^ hash_const;
    hash_const *= kMultB;
    v *= hash_const;
    words[i] = v ^ (v >> kXShift);
  }
  for (int i = 0; i < 4; ++i) out[i] = uint64_t(words[2 * i]) | uint64_t(words[2 * i + 1]) << 32;
}

constexpr unsigned __int128 kPcgMultiplier =
    (unsigned __int128)(2549297995355413924ULL) << 64 | 4865540595714422341ULL;

// The float32 ziggurat's 256 boxes (Marsaglia & Tsang's construction with numpy's r and box area v): ki[i] the
// integer threshold on 23 random bits, wi[i] the width per bit, fi[i] = f(x_i). Computed in double and rounded
// as numpy's tables are (ki to the nearest integer, wi and fi to float).
struct Ziggurat {
  static constexpr double kR = 3.6541528853610088, kV = 0.00492867323399;
  uint32_t ki[256];
  float wi[256], fi[256];
  Ziggurat() {
    const double m1 = 8388608.0;  // 2**23
    double dn = kR, tn = kR;
    const double q = kV / std::exp(-0.5 * dn * dn);
    fi[0] = 1.0f;
    fi[255] = float(std::exp(-0.5 * dn * dn));
    wi[0] = float(q / m1);
    wi[255] = float(dn / m1);
    ki[0] = uint32_t(std::llround(dn / q * m1));
    ki[1] = 0;
    for (int i = 254; i >= 1; --i) {
      dn = std::sqrt(-2.0 * std::log(kV / dn + std::exp(-0.5 * dn * dn)));
      ki[i + 1] = uint32_t(std::llround(dn / tn * m1));
      tn = dn;
      fi[i] = float(std::exp(-0.5 * dn * dn));
      wi[i] = float(dn / m1);
    }
  }
};

const Ziggurat& ziggurat() {
  static const Ziggurat z;
  return z;
}

}  // namespace

Pcg64::Pcg64(uint64_t seed) {
  uint64_t s[4];
  seed_sequence_state(seed, s);
  const unsigned __int128 initstate = (unsigned __int128)s[0] << 64 | s[1];
  const unsigned __int128 initseq = (unsigned __int128)s[2] << 64 | s[3];
  inc_ = initseq << 1 | 1;
  state_ = 0;
  state_ = state_ * kPcgMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kPcgMultiplier + inc_;
}

uint64_t Pcg64::next64() {
  state_ = state_ * kPcgMultiplier + inc_;
  const uint64_t high = uint64_t(state_ >> 64), low = uint64_t(state_);
  const unsigned rot = unsigned(high >> 58);
  const uint64_t v = high ^ low;
  return rot ? (v >> rot) | (v << (64 - rot)) : v;
}

uint32_t Pcg64::next32() {  // the low half of a draw first, its high half on the next call
  if (has_low_) {
    has_low_ = false;
    return low_;
  }
  const uint64_t v = next64();
  has_low_ = true;
  low_ = uint32_t(v >> 32);
  return uint32_t(v);
}

float standard_normal_f(Pcg64& rng) {
  // Each operation is its own rounding step, as numpy's C (compiled without FP contraction: -std=c++17 sets
  // -ffp-contract=off, so no fused multiply-add changes a bit).
  const Ziggurat& z = ziggurat();
  const float r = float(Ziggurat::kR), inv_r = float(1.0 / Ziggurat::kR);
  for (;;) {
    const uint32_t bits = rng.next32();
    const int idx = int(bits & 0xff);
    const uint32_t rabs = (bits >> 9) & 0x007fffff;
    float x = float(rabs) * z.wi[idx];
    if ((bits >> 8) & 1) x = -x;
    if (rabs < z.ki[idx]) return x;
    if (idx == 0) {
      for (;;) {  // the tail beyond r
        const float xx = -inv_r * std::log1p(-rng.next_float());
        const float yy = -std::log1p(-rng.next_float());
        if (yy + yy > xx * xx) return ((rabs >> 8) & 1) ? -(r + xx) : r + xx;
      }
    }
    const float u = rng.next_float();
    const float below = (z.fi[idx - 1] - z.fi[idx]) * u;
    if (below + z.fi[idx] < std::exp(-0.5 * double(x) * double(x))) return x;
  }
}

uint16_t float_to_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000);
  const uint32_t exponent = (bits >> 23) & 0xff, mantissa = bits & 0x7fffff;
  if (exponent == 0xff) return uint16_t(sign | 0x7c00 | (mantissa ? 0x200 | (mantissa >> 13) : 0));  // inf, nan
  const int e = int(exponent) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00);  // overflow
  if (e <= 0) {  // a float16 subnormal (or zero): shift the full mantissa, round half to even
    if (e < -10) return sign;
    const uint32_t m = mantissa | 0x800000;
    const int shift = 14 - e;
    uint32_t half = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t half = uint32_t(e) << 10 | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry into the exponent is still right
  return uint16_t(sign | half);
}

SyntheticStream::SyntheticStream(const SyntheticRecord& record) : r_(record), rng_(record.seed) {}

void SyntheticStream::next(uint8_t* out, uint64_t bytes) {
  if (bytes > r_.nbytes - position_ || (bytes % 4 && position_ + bytes != r_.nbytes))
    refuse(ErrorCode::kInternal, "synthetic constant: a chunk of " + num(bytes) + " bytes at " + num(position_) +
                                     " of " + num(r_.nbytes));
  const uint64_t begin = position_;
  const size_t size = data_type_size(r_.dtype);
  if (r_.kind == kRandomBits) {  // rng.bytes: little-endian uint32 draws, the last one cut
    for (uint64_t i = 0; i < bytes; i += 4) {
      const uint32_t word = rng_.next32();
      const uint8_t le[4] = {uint8_t(word), uint8_t(word >> 8), uint8_t(word >> 16), uint8_t(word >> 24)};
      std::memcpy(out + i, le, std::min<uint64_t>(4, bytes - i));
    }
    if (r_.layout != kPlain) reset_q4gsw_padding(out, begin, bytes);
  } else if (r_.kind == kNormal) {  // standard_normal(float32) * float32(std), cast to the dtype
    const float std_f = float(r_.std);
    for (uint64_t i = 0; i < bytes; i += size) {
      const float v = standard_normal_f(rng_) * std_f;
      if (r_.dtype == kFloat16) {
        const uint16_t h = float_to_half(v);
        std::memcpy(out + i, &h, 2);
      } else {
        std::memcpy(out + i, &v, 4);
      }
    }
  } else {  // np.full(value): the double cast to the dtype (blob.cc checked it is representable)
    uint8_t element[8] = {};
    switch (r_.dtype) {
      case kFloat32: { const float v = float(r_.value); std::memcpy(element, &v, 4); break; }
      case kFloat16: {
        // numpy casts the double straight to float16; through float32 first rounds twice, so round the double
        // to float32 towards zero with a sticky bit, which then rounds to float16 as the double would.
        float v = float(r_.value);
        if (double(v) != r_.value) {
          uint32_t b;
          std::memcpy(&b, &v, 4);
          if (std::fabs(double(v)) > std::fabs(r_.value)) --b;  // truncate towards zero
          b |= 1;                                               // sticky: not exactly representable
          std::memcpy(&v, &b, 4);
        }
        const uint16_t h = float_to_half(v);
        std::memcpy(element, &h, 2);
        break;
      }
      case kInt32: { const int32_t v = int32_t(r_.value); std::memcpy(element, &v, 4); break; }
      case kUint32: { const uint32_t v = uint32_t(r_.value); std::memcpy(element, &v, 4); break; }
      case kInt64: { const int64_t v = int64_t(r_.value); std::memcpy(element, &v, 8); break; }
      case kInt8: { const int8_t v = int8_t(r_.value); std::memcpy(element, &v, 1); break; }
      case kUint8: case kBool: element[0] = uint8_t(r_.value); break;
      default: refuse(ErrorCode::kInternal, std::string("synthetic FILL of dtype ") + data_type_name(r_.dtype));
    }
    for (uint64_t i = 0; i < bytes; ++i) out[i] = element[(begin + i) % size];
  }
  position_ += bytes;
}

void SyntheticStream::reset_q4gsw_padding(uint8_t* out, uint64_t begin, uint64_t bytes) const {
  // docs/spec/w4x8.md: every code of a row n >= N or a column k >= K decodes to zero: code 8.
  const uint64_t N = uint64_t(r_.q4gsw_shape[0]), K = uint64_t(r_.q4gsw_shape[1]), kp = (K + 7) / 8 * 8;
  for (uint64_t i = 0; i < bytes; ++i) {
    const uint64_t at = begin + i;
    uint64_t n_low, n_high, k_low, k_high;
    if (r_.layout == kQ4gswFlat) {  // uint8 [N, Kp/2]: byte j of row n holds k = 2j (low nibble), 2j + 1
      n_low = n_high = at / (kp / 2);
      k_low = 2 * (at % (kp / 2));
      k_high = k_low + 1;
    } else {  // W_4X8: word w = 4 * (k4 * N8 + n8) + j; its byte t holds k = 4 k4 + t of rows 8 n8 + 2j (+1)
      const uint64_t n8s = (N / 4 + 1) / 2, word = at / 4, t = at % 4, block = word / 4, j = word % 4;
      n_low = 8 * (block % n8s) + 2 * j;
      n_high = n_low + 1;
      k_low = k_high = 4 * (block / n8s) + t;
    }
    uint8_t b = out[i];
    if (n_low >= N || k_low >= K) b = uint8_t((b & 0xf0) | 0x08);
    if (n_high >= N || k_high >= K) b = uint8_t((b & 0x0f) | 0x80);
    out[i] = b;
  }
}

}  // namespace vktrain
