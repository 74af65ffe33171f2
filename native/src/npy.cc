#include "npy.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "file_map.h"
#include "graph.h"
#include "safetensors.h"
#include "status.h"
#include "text.h"

namespace vktrain {

std::vector<int64_t> load_npy_tokens(const std::string& path) {
  FileMap map(path);
  Bytes b = map.bytes();
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kVerification, path + ": " + why); };
  if (b.size < 10 || std::memcmp(b.data, "\x93NUMPY", 6) != 0) bad("not a .npy file (no \\x93NUMPY magic)");
  uint8_t major = b.data[6];
  size_t header_len, start;
  if (major == 1) { header_len = size_t(b.data[8] | b.data[9] << 8); start = 10; }
  else if (major == 2 || major == 3) {
    if (b.size < 12) bad("truncated .npy header");
    header_len = le32(b.data + 8); start = 12;
  } else bad("unknown .npy format version " + num(int(major)));
  if (header_len > b.size - start) bad("truncated .npy header");
  std::string header(reinterpret_cast<const char*>(b.data + start), header_len);
  auto field = [&](const std::string& key) {
    size_t at = header.find("'" + key + "'");
    if (at == std::string::npos) bad("the .npy header has no '" + key + "'");
    size_t colon = header.find(':', at);
    if (colon == std::string::npos) bad("malformed .npy header");
    size_t v = header.find_first_not_of(' ', colon + 1);
    return v == std::string::npos ? std::string() : header.substr(v);
  };
  std::string descr = field("descr"), order = field("fortran_order"), shape = field("shape");
  if (descr.size() < 5 || descr[0] != '\'') bad("malformed dtype in the .npy header");
  std::string dtype = descr.substr(1, descr.find('\'', 1) - 1);
  if (order.rfind("False", 0) != 0) bad("token ids must be a C-order array");
  if (dtype.size() < 3 || (dtype[0] != '<' && dtype[0] != '|') || (dtype[1] != 'i' && dtype[1] != 'u'))
    bad("token ids must be a little-endian integer array, got dtype '" + dtype + "'");
  int width = std::atoi(dtype.c_str() + 2);
  if (width != 1 && width != 2 && width != 4 && width != 8) bad("unsupported integer width in dtype '" + dtype + "'");
  bool is_signed = dtype[1] == 'i';
  // shape "(N,)": one dimension
  size_t open = shape.find('('), close = shape.find(')');
  std::string dims = open == std::string::npos || close == std::string::npos ? "" : shape.substr(open + 1, close - open - 1);
  if (dims.empty() || dims.find(',') == std::string::npos || dims.find_first_of("0123456789") == std::string::npos ||
      dims.find(',', dims.find(',') + 1) != std::string::npos ||
      dims.find_first_of("0123456789", dims.find(',')) != std::string::npos)
    bad("token ids must be a 1-D array (one stream), got shape (" + dims + ")");
  uint64_t n = std::strtoull(dims.c_str(), nullptr, 10);
  size_t data_start = start + header_len;
  if (n > (b.size - data_start) / width) bad("the file holds fewer than the " + num(n) + " tokens its header declares");
  std::vector<int64_t> out(n);
  const uint8_t* p = b.data + data_start;
  for (uint64_t i = 0; i < n; ++i, p += width) {
    uint64_t raw = 0;
    for (int k = 0; k < width; ++k) raw |= uint64_t(p[k]) << (8 * k);
    if (is_signed && width < 8 && (raw >> (8 * width - 1)) & 1) raw |= ~uint64_t(0) << (8 * width);
    if (!is_signed && width == 8 && raw > uint64_t(INT64_MAX)) bad("token id " + num(raw) + " at position " + num(i) + " does not fit int64");
    out[i] = int64_t(raw);
  }
  return out;
}

void save_npy(const std::string& path, int dtype, const std::vector<int64_t>& shape, const std::vector<uint8_t>& data) {
  static const char* const descr[] = {"<f4", "<f2", "<i4", "<i8", "|u1", "<u4", "|b1", "|i1", nullptr};  // DataType order
  if (dtype < 0 || dtype >= kNumDataTypes || !descr[dtype])
    refuse(ErrorCode::kUnsupported, path + ": numpy has no dtype for " + data_type_name(dtype));
  std::string dims;
  for (int64_t d : shape) dims += std::to_string(d) + ", ";
  if (shape.size() > 1) dims.erase(dims.size() - 2);  // (4, 128); a 1-D shape keeps its comma: (5,)
  else if (shape.size() == 1) dims.pop_back();
  std::string header = std::string("{'descr': '") + descr[dtype] + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  header.append(63 - (10 + header.size()) % 64, ' ');  // the data starts at a multiple of 64
  header += '\n';
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes += char(header.size() & 0xFF);
  bytes += char(header.size() >> 8);
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
  write_file_atomically(path, bytes, "");
}

}  // namespace vktrain
