// NumPy .npy files: a token stream read (train/data.py load_tokens' .npy case) and arrays written (the state).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vktrain {

// A 1-D integer .npy array as int64; LoadError kIo / kVerification naming the file and what is wrong.
std::vector<int64_t> load_npy_tokens(const std::string& path);

// Writes `data` (C order, DataType `dtype`, `shape`) as a version 1.0 .npy file, atomically (a temporary file
// renamed over `path`); LoadError kIo naming the path, kUnsupported for a dtype numpy has no name for.
void save_npy(const std::string& path, int dtype, const std::vector<int64_t>& shape, const std::vector<uint8_t>& data);

}  // namespace vktrain
