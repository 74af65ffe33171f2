// The delegate graph as read from a vktrain blob (vktrain/serialization/schema.fbs, graph.py): only what
// the loader checks and the inspector reports. Every id in it has been checked against its table.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "file_map.h"
#include "synthetic.h"

namespace vktrain {

// schema.fbs DataType / TensorLayout values.
enum DataType : int { kFloat32 = 0, kFloat16, kInt32, kInt64, kUint8, kUint32, kBool, kInt8, kBfloat16, kNumDataTypes };
enum Layout : int { kPlain = 0, kQ4gswFlat = 1, kQ4gswW4x8 = 2, kNumLayouts };
const char* data_type_name(int dtype);  // "FLOAT32"...; "UNKNOWN" outside the enum
int data_type_size(int dtype);

struct TensorValue {
  int dtype = 0;
  std::vector<int64_t> shape;
  int layout = kPlain;
  int32_t constant_id = -1;
  int32_t mem_obj_id = -1;
  std::string name;
  uint64_t mem_offset = 0;
  int32_t storage_of = -1;
  bool is_view = false;
  std::vector<int64_t> view_strides;
  int64_t view_offset = 0;
  int stored_dtype = -1;  // -1: the same as dtype
  uint64_t numel = 0;     // checked: no overflow
  uint64_t nbytes() const { return numel * data_type_size(dtype); }
  int storage_dtype() const { return stored_dtype < 0 ? dtype : stored_dtype; }
  uint64_t stored_nbytes() const { return numel * data_type_size(storage_dtype()); }
};

// schema.fbs ValueKind (union type codes).
enum ValueKind : int {
  kValueNone = 0, kValueNull, kValueInt, kValueDouble, kValueBool, kValueString, kValueTensor, kValueIntList,
  kValueDoubleList, kValueBoolList, kValueList
};

struct Value {
  int kind = kValueNull;
  TensorValue tensor;          // kind == kValueTensor
  std::vector<int32_t> items;  // kind == kValueList
};

struct OpCall {
  std::string name;
  std::vector<int32_t> args, outputs;
};

struct MutableState {
  int32_t state_id, update_id, initial_constant_id;
};

struct Constant {
  bool synthetic = false;
  int synthetic_dtype = 0;  // synthetic only: what it is generated as
  std::vector<int64_t> synthetic_shape;
  SyntheticRecord synthetic_record;  // synthetic only: how it is generated (synthetic.h)
  bool narrow = false;        // stored_dtype or stored_encoding set: widened to float32 on load
  std::string stored_form;    // "as read", "bfloat16", "float16", "gguf_q8_0", "synthetic"
  uint64_t nbytes = 0;        // bytes as its tensors read them
  uint64_t stored_nbytes = 0; // bytes in the file
  Bytes data;                 // the stored bytes (empty for a synthetic constant)
  std::string named_key;      // non-empty: in the .pte's named data
};

struct MemoryObject {
  int32_t id;
  uint64_t size_bytes;
};

// schema.fbs ShaderModule and EmbeddedSchedule as read (serialization/embedded.py); the byte spans point into the
// mapped .pte. Their contents are checked by verify_embedded (embedded.h), not by the blob reader.
enum ShaderCodeKind : int { kSpirv = 0, kWgsl = 1 };
struct ShaderModuleRecord {
  std::string name;
  int kind = kSpirv;
  Bytes code;
  std::vector<std::pair<uint32_t, int>> bindings;  // binding number, BindingAccess
  uint32_t push_constant_bytes = 0;
  bool push_header = false;
  std::vector<uint32_t> spec_ids;
  std::vector<std::string> features;
  std::vector<uint32_t> local_size;
  std::vector<int32_t> local_size_spec_ids;
  int64_t kernel_push_bytes() const { return int64_t(push_constant_bytes) - (push_header ? 16 : 0); }  // the Dispatch part
};
struct EmbeddedScheduleRecord {
  std::string profile_json;
  Bytes schedule;
  std::vector<uint32_t> dispatch_modules;
};

struct Graph {
  int format_version = 0;
  bool checksummed = false;
  std::vector<Value> values;
  std::vector<OpCall> ops;
  std::vector<int32_t> inputs, outputs;
  std::vector<MutableState> mutable_state;
  std::vector<Constant> constants;
  std::vector<MemoryObject> memory_objects;
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<EmbeddedScheduleRecord> schedules;
  std::vector<ShaderModuleRecord> shader_modules;
  const std::string* metadata_value(const std::string& key) const;
};

}  // namespace vktrain
