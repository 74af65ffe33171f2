#include "status.h"

namespace vktrain {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kPteFormat: return "pte format";
    case ErrorCode::kBlobFormat: return "blob format";
    case ErrorCode::kBlobChecksum: return "blob checksum";
    case ErrorCode::kVerification: return "verification";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kLimit: return "limit";
    case ErrorCode::kScheduleFormat: return "schedule format";
    case ErrorCode::kShaderModule: return "shader module";
    case ErrorCode::kDevice: return "device";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

}  // namespace vktrain
