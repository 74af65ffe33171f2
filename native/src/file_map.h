// A read-only memory map of a whole file: payloads (blobs, constants) are spans into it, never copied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace vktrain {

struct Bytes {  // a span of the mapped file
  const uint8_t* data = nullptr;
  size_t size = 0;
  Bytes sub(size_t offset, size_t length) const { return {data + offset, length}; }
};

// Little-endian integers of the file formats, read byte by byte (no alignment assumed).
inline uint32_t le32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
inline uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | uint64_t(le32(p + 4)) << 32; }

class FileMap {
 public:
  explicit FileMap(const std::string& path);  // LoadError(kIo) naming the path
  // A copy of `size` bytes in memory (a .pte handed over as bytes: an app's asset); `name` names it in errors.
  FileMap(const void* data, size_t size, const std::string& name);
  ~FileMap();
  FileMap(const FileMap&) = delete;
  FileMap& operator=(const FileMap&) = delete;
  Bytes bytes() const { return {static_cast<const uint8_t*>(data_), size_}; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owned_ = false;  // a copy (freed), not a mapping (unmapped)
};

}  // namespace vktrain
