#include "safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

// safetensors' Dtype enum order (BOOL < U8 < I8 < F16 < I32 < U32 < F32 < I64 among these): it writes the
// tensors of the larger dtype first.
struct SafetensorsDtype { int dtype; const char* name; int rank; };
const SafetensorsDtype kDtypes[] = {{kBool, "BOOL", 0}, {kUint8, "U8", 1},   {kInt8, "I8", 2},    {kFloat16, "F16", 3},
                                    {kInt32, "I32", 4}, {kUint32, "U32", 5}, {kFloat32, "F32", 6}, {kInt64, "I64", 7}};

const SafetensorsDtype& dtype_of(int dtype) {
  for (const auto& d : kDtypes)
    if (d.dtype == dtype) return d;
  refuse(ErrorCode::kUnsupported, std::string("a safetensors file of this runtime cannot hold ") + data_type_name(dtype) + " tensors");
}

std::string compact_list(const std::vector<int64_t>& items) {  // serde_json's [4,32]
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? "," : "") + num(items[i]);
  return out + "]";
}

}  // namespace

const char* safetensors_dtype(int dtype) { return dtype_of(dtype).name; }

void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what) {
  const std::string where = what.empty() ? path : what + " " + path;
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) refuse(ErrorCode::kIo, where + ": cannot create " + tmp + ": " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      std::remove(tmp.c_str());
      refuse(ErrorCode::kIo, where + ": cannot write " + tmp + ": " + std::strerror(err));
    }
    done += size_t(n);
  }
  bool synced = ::fsync(fd) == 0;
  int err = errno;
  if (::close(fd) != 0 || !synced) {
    std::remove(tmp.c_str());
    refuse(ErrorCode::kIo, where + ": cannot write " + tmp + ": " + std::strerror(synced ? errno : err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    std::remove(tmp.c_str());
    refuse(ErrorCode::kIo, where + ": cannot rename " + tmp + " over it: " + std::strerror(err));
  }
}

std::string safetensors_bytes(const std::map<std::string, std::string>& metadata,
                              const std::vector<std::pair<std::string, const HostTensor*>>& tensors) {
  auto ordered = tensors;
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    int ra = dtype_of(a.second->dtype).rank, rb = dtype_of(b.second->dtype).rank;
    return ra != rb ? ra > rb : a.first < b.first;
  });
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {  // sorted keys (the Python side's order is its hash map's)
      header += std::string(first ? "" : ",") + json_quote(k) + ":" + json_quote(v);
      first = false;
    }
    header += "}";
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : ordered) {
    header += std::string(header.size() > 1 ? "," : "") + json_quote(name) + ":{\"dtype\":\"" + dtype_of(t->dtype).name +
              "\",\"shape\":" + compact_list(t->shape) + ",\"data_offsets\":[" + num(offset) + "," + num(offset + t->data.size()) + "]}";
    offset += t->data.size();
  }
  header += "}";
  while (header.size() % 8) header += ' ';
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint8_t(uint64_t(header.size()) >> (8 * i)));
  out.reserve(8 + header.size() + offset);
  out += header;
  for (const auto& [name, t] : ordered) out.append(reinterpret_cast<const char*>(t->data.data()), t->data.size());
  return out;
}

}  // namespace vktrain
