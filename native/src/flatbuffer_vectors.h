// Copying a verified flatbuffers vector of scalars out of the file.
#pragma once

#include <cstring>
#include <vector>

#include <flatbuffers/flatbuffers.h>

namespace vktrain {

static_assert(FLATBUFFERS_LITTLEENDIAN, "the .pte and the blob are little-endian; a big-endian host must swap");

// The flatbuffers Verifier checks a vector's length field for 4-byte alignment but not its elements: an
// int64 vector may sit at 4 mod 8 in a hostile file. memcpy reads it without a misaligned load.
template <typename T, typename U>
std::vector<T> vec(const flatbuffers::Vector<U>* v) {
  if (!v || v->size() == 0) return {};
  std::vector<U> raw(v->size());
  std::memcpy(raw.data(), v->Data(), raw.size() * sizeof(U));
  return std::vector<T>(raw.begin(), raw.end());
}

}  // namespace vktrain
