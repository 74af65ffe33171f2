// Error codes and the error every loader step raises: what was refused, and why, in one message.
#pragma once

#include <stdexcept>
#include <string>

namespace vktrain {

// Stable codes (the C API and `vktrain-native-inspect --fuzz-dir` print them). 0 is success; every
// refusal of bad input is 10..19; 70 is a bug in this code (never a property of the input).
enum class ErrorCode : int {
  kOk = 0,
  kIo = 10,            // the file cannot be opened, mapped or read
  kPteFormat = 11,     // not a readable .pte: truncated, corrupt, unknown schema
  kBlobFormat = 12,    // the vktrain delegate blob is malformed
  kBlobChecksum = 13,  // a CRC-32 of the blob (graph or constant) does not match
  kVerification = 14,  // the program or graph is inconsistent (a check of verify.py refused it)
  kUnsupported = 15,   // well formed, but not a program this runtime runs
  kLimit = 16,         // asks for more memory than the caps allow
  kScheduleFormat = 17,  // not a readable schedule (.vks): truncated, corrupt, another format version
  kShaderModule = 18,  // a shader module is missing, is not SPIR-V, or does not match a dispatch of the schedule
  kDevice = 19,        // no usable Vulkan device, or a Vulkan call failed (out of memory, device lost)
  kInternal = 70,
};

const char* error_code_name(ErrorCode code);

// `message` with each control byte as \xNN (what Python's repr shows): names quoted from a hostile file
// may hold NULs (which would cut what() short), newlines (one message per line in --fuzz-dir) or escapes.
inline std::string printable(const std::string& message) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(message.size());
  for (unsigned char c : message) {
    if (c >= 0x20 && c != 0x7f) {
      out += char(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

class LoadError : public std::runtime_error {
 public:
  LoadError(ErrorCode code, const std::string& message) : std::runtime_error(printable(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] inline void refuse(ErrorCode code, const std::string& message) { throw LoadError(code, message); }

}  // namespace vktrain
