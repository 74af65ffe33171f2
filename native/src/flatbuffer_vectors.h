// Copying verified flatbuffers vectors and strings out of the file, within a byte budget.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <flatbuffers/flatbuffers.h>

#include "status.h"

namespace vktrain {

static_assert(FLATBUFFERS_LITTLEENDIAN, "the .pte and the blob are little-endian; a big-endian host must swap");

// The bytes a reader may copy out of one flatbuffer. The Verifier bounds every vector and string by the buffer,
// but not how often one is referenced: a hostile file can point a million tables at one 1 GB vector. Written
// files reference each vector once (and share only short strings), so twice the buffer plus 1 MiB is ample.
// One budget is current per thread while a reader runs (ScopedCopyBudget); copies outside any are not capped.
class ScopedCopyBudget {
 public:
  ScopedCopyBudget(uint64_t flatbuffer_bytes, const char* what)
        : left_(2 * flatbuffer_bytes + (1u << 20)), what_(what), outer_(current()) { current() = this; }
  ~ScopedCopyBudget() { current() = outer_; }
  ScopedCopyBudget(const ScopedCopyBudget&) = delete;
  ScopedCopyBudget& operator=(const ScopedCopyBudget&) = delete;

  static void take(uint64_t bytes) {
    ScopedCopyBudget* budget = current();
    if (!budget) return;
    if (bytes > budget->left_)
      refuse(ErrorCode::kLimit, std::string(budget->what_) + " references more data than it holds (the same vectors "
             "or strings again and again: over twice its size copied); refused before it exhausts memory");
    budget->left_ -= bytes;
  }

 private:
  uint64_t left_;
  const char* what_;
  ScopedCopyBudget* outer_;
  static ScopedCopyBudget*& current() {
    static thread_local ScopedCopyBudget* budget = nullptr;
    return budget;
  }
};

// The flatbuffers Verifier checks a vector's length field for 4-byte alignment but not its elements: an
// int64 vector may sit at 4 mod 8 in a hostile file. memcpy reads it without a misaligned load.
template <typename T, typename U>
std::vector<T> vec(const flatbuffers::Vector<U>* v) {
  if (!v || v->size() == 0) return {};
  ScopedCopyBudget::take(uint64_t(v->size()) * sizeof(U));
  std::vector<U> raw(v->size());
  std::memcpy(raw.data(), v->Data(), raw.size() * sizeof(U));
  return std::vector<T>(raw.begin(), raw.end());
}

inline std::string copy_string(const flatbuffers::String* s) {
  ScopedCopyBudget::take(s->size());
  return std::string(s->data(), s->size());
}

}  // namespace vktrain
