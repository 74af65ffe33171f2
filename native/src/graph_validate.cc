// graph.py VkGraph.validate, check for check: every cross reference of a blob's graph, sizes that match.
#include <map>
#include <set>

#include "graph.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

[[noreturn]] void inconsistent(const std::string& message) {
  refuse(ErrorCode::kBlobFormat, "blob holds an inconsistent graph: " + message);
}

std::string describe(int dtype, const std::vector<int64_t>& shape) { return data_type_name(dtype) + list(shape); }

const Value& value_at(const Graph& g, int64_t id, const std::string& what) {
  if (id < 0 || uint64_t(id) >= g.values.size())
    inconsistent(what + " " + num(id) + " is out of range: the graph has " + num(g.values.size()) + " values");
  return g.values[size_t(id)];
}

void check_narrow_reader(const TensorValue& t, const std::string& where) {
  if (t.dtype != kFloat32 || t.layout != kPlain)
    inconsistent(where + " is " + data_type_name(t.dtype) + " but reads a narrow constant (stored as "
                 "float16/bfloat16/GGUF Q8_0), which only PLAIN FLOAT32 tensors may read");
}

void check_synthetic_reader(const Constant& c, const TensorValue& t, const std::string& where) {
  if (c.synthetic_dtype != t.dtype || c.synthetic_shape != t.shape)
    inconsistent(where + " is " + describe(t.dtype, t.shape) + " but reads a synthetic constant generated as " +
                 describe(c.synthetic_dtype, c.synthetic_shape) + "; they must match exactly");
}

}  // namespace

void validate_graph(Graph& g) {
  std::map<int32_t, uint64_t> memory_sizes;
  for (size_t i = 0; i < g.memory_objects.size(); ++i) {
    const auto& m = g.memory_objects[i];
    if (m.id < 0 || memory_sizes.count(m.id))
      inconsistent("memory_objects[" + num(i) + "] has id " + num(m.id) + ": ids must be unique and >= 0");
    memory_sizes[m.id] = m.size_bytes;
  }
  // Shapes first: every size below is then a checked product.
  for (size_t id = 0; id < g.values.size(); ++id) {
    TensorValue& t = g.values[id].tensor;
    if (g.values[id].kind != kValueTensor) continue;
    for (int64_t d : t.shape)
      if (d < 0) inconsistent("value " + num(id) + " has negative dimension in shape " + list(t.shape));
    unsigned __int128 n = 1;
    for (int64_t d : t.shape) {
      n *= uint64_t(d);
      if (n * 8 > (unsigned __int128)INT64_MAX)
        inconsistent("value " + num(id) + " has shape " + list(t.shape) + ", more than 2^63 bytes");
    }
    t.numel = uint64_t(n);
  }
  for (size_t id = 0; id < g.values.size(); ++id) {
    const Value& v = g.values[id];
    const std::string where = "value " + num(id);
    if (v.kind == kValueList) {
      for (int32_t item : v.items) value_at(g, item, where + " (ValueList) item");
      continue;
    }
    if (v.kind != kValueTensor) continue;
    const TensorValue& t = v.tensor;
    const std::string named = where + " (" + (t.name.empty() ? "unnamed" : t.name) + ")";
    if (t.layout == kQ4gswFlat && (t.dtype != kUint8 || t.shape.size() != 2))
      inconsistent(where + " has layout Q4GSW_FLAT with " + describe(t.dtype, t.shape) + "; that layout is stored as rank-2 UINT8");
    if (t.layout == kQ4gswW4x8 && (t.dtype != kUint32 || t.shape.size() != 1))
      inconsistent(where + " has layout Q4GSW_W4X8 with " + describe(t.dtype, t.shape) + "; that layout is stored as rank-1 UINT32");
    if (t.constant_id != -1) {
      if (t.constant_id < 0 || size_t(t.constant_id) >= g.constants.size())
        inconsistent(where + " has constant_id " + num(t.constant_id) + ", out of range (" + num(g.constants.size()) + " constants)");
      const Constant& c = g.constants[size_t(t.constant_id)];
      if (c.synthetic) check_synthetic_reader(c, t, named);
      if (c.narrow) check_narrow_reader(t, named);
      if (c.nbytes != t.nbytes())
        inconsistent(named + ": constant " + num(t.constant_id) + " has " + num(c.nbytes) + " bytes, but " +
                     describe(t.dtype, t.shape) + " needs " + num(t.nbytes()));
    }
    if (t.mem_obj_id != -1) {
      auto found = memory_sizes.find(t.mem_obj_id);
      if (found == memory_sizes.end()) inconsistent(where + " has mem_obj_id " + num(t.mem_obj_id) + ", which no memory object has");
      if (t.mem_offset > found->second || t.stored_nbytes() > found->second - t.mem_offset)
        inconsistent(where + " occupies bytes [" + num(t.mem_offset) + ", " + sum(t.mem_offset, t.stored_nbytes()) +
                     ") of memory object " + num(t.mem_obj_id) + ", which has " + num(found->second));
    }
    if (t.storage_of != -1) {
      const Value& s = value_at(g, t.storage_of, where + " storage_of");
      if (s.kind != kValueTensor || s.tensor.storage_of != -1)
        inconsistent(where + " uses the storage of value " + num(t.storage_of) + ", which must be a tensor with storage of its own");
      if (s.tensor.stored_nbytes() != t.stored_nbytes() || s.tensor.storage_dtype() != t.storage_dtype())
        inconsistent(where + " (" + data_type_name(t.storage_dtype()) + ", " + num(t.stored_nbytes()) +
                     " bytes) cannot use the storage of value " + num(t.storage_of) + " (" +
                     data_type_name(s.tensor.storage_dtype()) + ", " + num(s.tensor.stored_nbytes()) +
                     " bytes): it must have the same stored bytes");
    } else if (t.is_view) {
      inconsistent(where + " is a view but has no storage_of");
    }
    if (!t.view_strides.empty() && (!t.is_view || t.view_strides.size() != t.shape.size()))
      inconsistent(where + " has view strides " + list(t.view_strides) +
                   ": strides belong to a view and need one per dim of shape " + list(t.shape));
  }
  for (size_t i = 0; i < g.ops.size(); ++i) {
    const OpCall& op = g.ops[i];
    const std::string at = "ops[" + num(i) + "]";
    if (op.name.empty()) inconsistent(at + " has an empty name");
    for (int32_t a : op.args) value_at(g, a, at + " (" + op.name + ") argument");
    for (int32_t o : op.outputs) value_at(g, o, at + " (" + op.name + ") output");
  }
  for (int32_t id : g.inputs) value_at(g, id, "graph inputs entry");
  for (int32_t id : g.outputs) value_at(g, id, "graph outputs entry");
  std::set<int32_t> seen;
  for (size_t i = 0; i < g.mutable_state.size(); ++i) {
    const MutableState& s = g.mutable_state[i];
    const std::string where = "mutable_state[" + num(i) + "]";
    auto tensor_at = [&](int32_t id, const std::string& what) -> const TensorValue& {
      const Value& v = value_at(g, id, what);
      if (v.kind != kValueTensor) inconsistent(what + " " + num(id) + " is not a tensor, expected TensorValue");
      return v.tensor;
    };
    const TensorValue& target = tensor_at(s.state_id, where + " state_id");
    const TensorValue& update = tensor_at(s.update_id, where + " update_id");
    if (!seen.insert(s.state_id).second) inconsistent(where + ": value " + num(s.state_id) + " is listed as mutable state twice");
    if (update.dtype != target.dtype || update.shape != target.shape)
      inconsistent(where + ": update value " + num(s.update_id) + " is " + describe(update.dtype, update.shape) +
                   " but state value " + num(s.state_id) + " is " + describe(target.dtype, target.shape));
    if (s.initial_constant_id != -1) {
      if (s.initial_constant_id < 0 || size_t(s.initial_constant_id) >= g.constants.size())
        inconsistent(where + ": initial_constant_id " + num(s.initial_constant_id) + " is out of range (" +
                     num(g.constants.size()) + " constants)");
      const Constant& c = g.constants[size_t(s.initial_constant_id)];
      if (c.synthetic) check_synthetic_reader(c, target, where);
      if (c.narrow) check_narrow_reader(target, where);
      if (c.nbytes != target.nbytes())
        inconsistent(where + ": initial constant " + num(s.initial_constant_id) + " has " + num(c.nbytes) +
                     " bytes, state value " + num(s.state_id) + " needs " + num(target.nbytes()));
    }
  }
}

const char* data_type_name(int dtype) {
  static const char* names[] = {"FLOAT32", "FLOAT16", "INT32", "INT64", "UINT8", "UINT32", "BOOL", "INT8", "BFLOAT16"};
  return dtype >= 0 && dtype < kNumDataTypes ? names[dtype] : "UNKNOWN";
}

int data_type_size(int dtype) {
  static const int sizes[] = {4, 2, 4, 8, 1, 4, 1, 1, 2};
  return dtype >= 0 && dtype < kNumDataTypes ? sizes[dtype] : 0;
}

const std::string* Graph::metadata_value(const std::string& key) const {
  for (const auto& kv : metadata)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

}  // namespace vktrain
