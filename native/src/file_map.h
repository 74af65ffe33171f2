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

class FileMap {
 public:
  explicit FileMap(const std::string& path);  // LoadError(kIo) naming the path
  ~FileMap();
  FileMap(const FileMap&) = delete;
  FileMap& operator=(const FileMap&) = delete;
  Bytes bytes() const { return {static_cast<const uint8_t*>(data_), size_}; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace vktrain
