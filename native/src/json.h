// A small strict JSON reader (RFC 8259) for the device profiles an embedded schedule carries (device_profile.py
// to_json). Hostile input: nesting is capped, every error is a LoadError naming `where` and the offset.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "status.h"

namespace vktrain {

struct Json {
  enum Kind { kNull, kBool, kInt, kReal, kString, kArray, kObject } kind = kNull;
  bool boolean = false;
  int64_t integer = 0;   // kInt: a number written without fraction or exponent that fits int64
  double real = 0;       // kReal
  std::string text;      // kString
  std::vector<Json> items;                 // kArray
  std::map<std::string, Json> fields;      // kObject (a repeated key keeps its last value, as Python's json does)

  // Throws LoadError(code, where + ": ...") for text that is not one JSON value.
  static Json parse(const std::string& text, const std::string& where, ErrorCode code);
};

}  // namespace vktrain
