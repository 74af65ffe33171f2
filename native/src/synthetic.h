// BENCHMARK ONLY: synthetic constants (vktrain/serialization/synthetic.py), generated at load instead of stored,
// bit for bit as the Python runtime generates them: numpy's default_rng(seed) (SeedSequence -> PCG64), its
// rng.bytes, its float32 ziggurat standard_normal, numpy's float32 -> float16 cast, and the q4gsw padding codes
// reset to 8. A stream, so a constant of gigabytes is generated and uploaded a chunk at a time.
#pragma once

#include <cstdint>
#include <vector>

namespace vktrain {

enum SyntheticKind { kRandomBits = 0, kNormal = 1, kFill = 2 };  // schema.fbs SyntheticKind

// The record blob.cc read and checked (synthetic.py SyntheticConstant._check).
struct SyntheticRecord {
  int kind = kRandomBits;
  uint64_t seed = 0;
  int dtype = 0;
  std::vector<int64_t> shape;
  double std = 0, value = 0;
  int layout = 0;                    // TensorLayout: PLAIN, or a q4gsw layout of RANDOM_BITS codes
  std::vector<int64_t> q4gsw_shape;  // the logical weight [N, K] of a q4gsw layout
  uint64_t nbytes = 0;               // numel * dtype size
};

// numpy.random.PCG64 seeded as default_rng(seed) seeds it; next32 is its buffered next_uint32.
class Pcg64 {
 public:
  explicit Pcg64(uint64_t seed);
  uint64_t next64();
  uint32_t next32();
  float next_float() { return float(next32() >> 8) * (1.0f / 16777216.0f); }  // distributions.c next_float

 private:
  unsigned __int128 state_ = 0, inc_ = 0;
  bool has_low_ = false;
  uint32_t low_ = 0;
};

// numpy's random_standard_normal_f (the float32 ziggurat; its tables computed as numpy's were).
float standard_normal_f(Pcg64& rng);
// numpy's float32 -> float16 cast (round half to even; overflow -> inf).
uint16_t float_to_half(float f);

// The constant's bytes, in order, a chunk at a time.
class SyntheticStream {
 public:
  explicit SyntheticStream(const SyntheticRecord& record);
  // The next `bytes` bytes (a multiple of 4, or the rest of the constant).
  void next(uint8_t* out, uint64_t bytes);
  uint64_t position() const { return position_; }

 private:
  void reset_q4gsw_padding(uint8_t* out, uint64_t begin, uint64_t bytes) const;

  SyntheticRecord r_;
  Pcg64 rng_;
  uint64_t position_ = 0;
};

}  // namespace vktrain
