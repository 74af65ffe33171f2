// safetensors files as the Python `safetensors` package (0.8) writes them, and the atomic file write every
// output of the native runtime goes through (a reader never sees half a file; the old one stays until the
// rename). One writer for the checkpoint (checkpoint.h) and the PEFT adapter file (adapters.h).
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "interpreter.h"

namespace vktrain {

// Writes `bytes` to a temporary file beside `path`, fsyncs it and renames it over `path`; LoadError kIo
// "WHAT PATH: ..." (what: the flag or role the path came from, e.g. "--json").
void write_file_atomically(const std::string& path, const std::string& bytes, const std::string& what);

// safetensors' "F32", "I64", ...; LoadError kUnsupported for a dtype it cannot hold.
const char* safetensors_dtype(int dtype);

// The file's bytes: the header (compact JSON: "__metadata__" first, then the tensors in safetensors' order,
// alignment-descending dtype then name, padded with spaces to 8 bytes), then the data in that order.
std::string safetensors_bytes(const std::map<std::string, std::string>& metadata,
                              const std::vector<std::pair<std::string, const HostTensor*>>& tensors);

}  // namespace vktrain
