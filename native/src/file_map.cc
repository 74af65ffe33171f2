#include "file_map.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

namespace vktrain {

FileMap::FileMap(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) refuse(ErrorCode::kIo, "cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    int err = errno;
    ::close(fd);
    refuse(ErrorCode::kIo, path + ": not a regular file" + (err ? std::string(" (") + std::strerror(err) + ")" : ""));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    refuse(ErrorCode::kPteFormat, path + ": file is empty, not a .pte");
  }
  data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (data_ == MAP_FAILED) {
    data_ = nullptr;
    refuse(ErrorCode::kIo, "cannot map " + path + ": " + std::strerror(err));
  }
}

FileMap::FileMap(const void* data, size_t size, const std::string& name) {
  if (!data || size == 0) refuse(ErrorCode::kPteFormat, name + ": no bytes, not a .pte");
  data_ = std::aligned_alloc(64, (size + 63) / 64 * 64);  // aligned as a mapping would be, for the readers
  if (!data_) refuse(ErrorCode::kLimit, name + ": cannot allocate " + std::to_string(size) + " bytes for a copy");
  std::memcpy(data_, data, size);
  size_ = size;
  owned_ = true;
}

FileMap::~FileMap() {
  if (data_ && owned_) std::free(data_);
  else if (data_) ::munmap(data_, size_);
}

}  // namespace vktrain
