// The native generator of synthetic constants (native/src/synthetic.h) on its own, driven by
// tests/test_native_synthetic.py, which compares each output with numpy's:
//   native_synthetic_check normal SEED COUNT      COUNT float32 standard normals (raw, little-endian)
//   native_synthetic_check half < FLOATS          each float32 of stdin cast to float16
//   native_synthetic_check stream KIND SEED DTYPE STD VALUE NBYTES   a record's bytes, generated 4,096 at a time
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "synthetic.h"

using namespace vktrain;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "normal" && argc == 4) {
    Pcg64 rng(std::strtoull(argv[2], nullptr, 10));
    std::vector<float> out(std::strtoul(argv[3], nullptr, 10));
    for (float& v : out) v = standard_normal_f(rng);
    return std::fwrite(out.data(), 4, out.size(), stdout) == out.size() ? 0 : 1;
  }
  if (mode == "half" && argc == 2) {
    float f;
    while (std::fread(&f, 4, 1, stdin) == 1) {
      const uint16_t h = float_to_half(f);
      std::fwrite(&h, 2, 1, stdout);
    }
    return 0;
  }
  if (mode == "stream" && argc == 8) {
    SyntheticRecord r;
    r.kind = std::atoi(argv[2]);
    r.seed = std::strtoull(argv[3], nullptr, 10);
    r.dtype = std::atoi(argv[4]);
    r.std = std::atof(argv[5]);
    r.value = std::atof(argv[6]);
    r.nbytes = std::strtoull(argv[7], nullptr, 10);
    SyntheticStream stream(r);
    std::vector<uint8_t> out(r.nbytes);
    for (uint64_t done = 0; done < r.nbytes;) {
      const uint64_t n = std::min<uint64_t>(r.nbytes - done, 4096);
      stream.next(out.data() + done, n);
      done += n;
    }
    return std::fwrite(out.data(), 1, out.size(), stdout) == out.size() ? 0 : 1;
  }
  std::fprintf(stderr, "usage: native_synthetic_check normal SEED COUNT | half | stream KIND SEED DTYPE STD VALUE NBYTES\n");
  return 2;
}
