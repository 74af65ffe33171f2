// verify.py and runner.py verify_training_program, for every method of the .pte: what the Python runtime
// checks before it allocates anything, in its order (except the op-shape re-inference, not yet ported).
#include <algorithm>
#include <map>
#include <set>

#include "pte.h"
#include "status.h"
#include "text.h"

namespace vktrain {
namespace {

constexpr int kScalarFloat = 6;
const std::set<std::string> kCpuKernels = {  // runner.py CPU_KERNELS
    "dim_order_ops::_to_dim_order_copy.out", "dim_order_ops::_clone_dim_order.out", "aten::_to_copy.out",
    "aten::clone.out", "aten::view_copy.out"};
constexpr const char* kEtView = "executorch_prim::et_view.default";

int element_size(int t, bool* supported) {  // pte_objects.py _ELEMENT_SIZE / NUMPY_SCALAR_TYPES
  *supported = (t >= 0 && t <= 7) || t == 11 || t == 28;  // a hostile int8 may be negative
  switch (t) {
    case 0: case 1: case 11: case 12: case 13: case 16: case 17: case 23: case 24: case 25: case 26: return 1;
    case 2: case 5: case 15: case 22: case 27: return 2;
    case 3: case 6: case 14: case 28: return 4;
    case 4: case 7: case 29: return 8;
    default: return 0;
  }
}

const char* scalar_name(int t) {
  static const std::map<int, const char*> names = {
      {0, "BYTE"}, {1, "CHAR"}, {2, "SHORT"}, {3, "INT"}, {4, "LONG"}, {5, "HALF"}, {6, "FLOAT"}, {7, "DOUBLE"},
      {11, "BOOL"}, {12, "QINT8"}, {13, "QUINT8"}, {14, "QINT32"}, {15, "BFLOAT16"}, {16, "QUINT4X2"},
      {17, "QUINT2X4"}, {22, "BITS16"}, {23, "FLOAT8E5M2"}, {24, "FLOAT8E4M3FN"}, {25, "FLOAT8E5M2FNUZ"},
      {26, "FLOAT8E4M3FNUZ"}, {27, "UINT16"}, {28, "UINT32"}, {29, "UINT64"}};
  auto found = names.find(t);
  return found == names.end() ? "UNKNOWN" : found->second;
}

int scalar_type_of(int dtype) {  // the ExecuTorch ScalarType of a blob DataType; -1: none
  static const int map[] = {6, 5, 3, 4, 0, 28, 11, 1, -1};
  return dtype >= 0 && dtype < kNumDataTypes ? map[dtype] : -1;
}

std::string describe(const PlanTensor& t) { return std::string(scalar_name(t.scalar_type)) + list(t.sizes); }

[[noreturn]] void refuse_check(const std::string& source, const char* check, const std::string& message,
                               ErrorCode code = ErrorCode::kVerification) {
  refuse(code, source + ": " + message + " [" + check + "]");
}

}  // namespace

void Program::verify(const Limits& limits) {
  const uint64_t host_limit = limits.host_memory_bytes ? limits.host_memory_bytes : host_memory_bytes();
  // A training step's .pte (runner.py verify_training_program reads its 'forward' method).
  if (std::none_of(methods_.begin(), methods_.end(), [](const Method& m) { return m.name == kTrainMethod; })) {
    std::string names;
    for (const Method& m : methods_) names += (names.empty() ? "'" : ", '") + m.name + "'";
    refuse(ErrorCode::kPteFormat, "no execution plan 'forward' (a training step); it has [" + names + "]");
  }
  for (Method& m : methods_) {
    const std::string plan = "plan '" + m.name + "'";
    // check_instructions_supported
    for (size_t i = 0; i < m.instructions.size(); ++i) {
      const Instruction& ins = m.instructions[i];
      if (ins.kind == kKernelCall) {
        const std::string& name = m.operators[size_t(ins.index)];
        if (!kCpuKernels.count(name) && name != kEtView)
          refuse(ErrorCode::kUnsupported, source_ + ": unsupported instruction " + name + " (instruction " + num(i) +
                 " of " + plan + "): vktrain runs only the vktrain delegate and a few CPU copy ops");
      } else if (ins.kind != kDelegateCall && ins.kind != kMoveCall && ins.kind != kFreeCall) {
        refuse(ErrorCode::kUnsupported, source_ + ": unsupported instruction (instruction " + num(i) + " of " + plan +
               "): control flow is not supported");
      }
    }
    // check_storageless_tensors
    std::set<int32_t> views;
    for (const Instruction& ins : m.instructions)
      if (ins.kind == kKernelCall && m.operators[size_t(ins.index)] == kEtView && ins.args.size() >= 3) views.insert(ins.args[2]);
    for (size_t i = 0; i < m.values.size(); ++i) {
      const PlanValue& v = m.values[i];
      if (v.kind == kPlanTensor && !v.tensor.planned && v.tensor.data_buffer_idx == 0 && !views.count(int32_t(i)))
        refuse_check(source_, "check_storageless_tensors", plan + " value " + num(i) + " (" + describe(v.tensor) +
                     ") has neither allocation_info nor data (data_buffer_idx 0); only the output of " + kEtView + " may");
    }
    // check_tensor_records (and every tensor's size, checked for overflow)
    for (size_t i = 0; i < m.values.size(); ++i) {
      PlanTensor& t = m.values[i].tensor;
      if (m.values[i].kind != kPlanTensor) continue;
      const std::string where = plan + " value " + num(i) + " (" + describe(t) + ")";
      bool supported;
      const int size = element_size(t.scalar_type, &supported);
      if (!supported) refuse_check(source_, "check_tensor_records", where + ": scalar type " + scalar_name(t.scalar_type) + " is not supported");
      unsigned __int128 n = size;
      for (int32_t d : t.sizes) {
        if (d < 0) refuse_check(source_, "check_tensor_records", where + ": sizes " + list(t.sizes) + " has a negative dimension");
        n *= uint64_t(d);
        if (n > (unsigned __int128)INT64_MAX) refuse_check(source_, "check_tensor_records", where + ": more than 2^63 bytes", ErrorCode::kLimit);
      }
      t.nbytes = uint64_t(n);
      bool contiguous = t.dim_order.size() == t.sizes.size();
      for (size_t k = 0; contiguous && k < t.dim_order.size(); ++k) contiguous = t.dim_order[k] == k;
      if (!contiguous) refuse_check(source_, "check_tensor_records", where + ": dim_order is " + list(std::vector<int>(t.dim_order.begin(), t.dim_order.end())) + " (only contiguous tensors are supported)");
      if (t.storage_offset != 0) refuse_check(source_, "check_tensor_records", where + ": storage_offset is " + num(t.storage_offset) + ", expected 0");
      if (t.shape_dynamism != 0) refuse_check(source_, "check_tensor_records", where + ": shape_dynamism is " + num(t.shape_dynamism) + ", expected 0");
      if (t.layout != 0) refuse_check(source_, "check_tensor_records", where + ": layout is " + num(t.layout) + ", expected 0");
      if (t.planned && t.data_buffer_idx != 0)
        refuse_check(source_, "check_tensor_records", where + ": a planned tensor with initial data (data_buffer_idx " + num(t.data_buffer_idx) + "); the interpreter supports none");
    }
    // check_arenas: tensors inside their arenas; the declared arenas fit in the host's memory
    m.arena_needs.assign(m.arena_sizes.size(), 0);
    for (size_t i = 0; i < m.values.size(); ++i) {
      const PlanTensor& t = m.values[i].tensor;
      if (m.values[i].kind != kPlanTensor || !t.planned) continue;
      const std::string where = plan + " value " + num(i) + " (" + describe(t) + ")";
      if (t.memory_id >= m.arena_sizes.size())
        refuse_check(source_, "check_arenas", where + ": allocation_info.memory_id is " + num(t.memory_id) + ", expected 0.." +
                     (m.arena_sizes.empty() ? std::string("-1") : num(m.arena_sizes.size() - 1)));
      bool unused;
      const int size = element_size(t.scalar_type, &unused);
      if (t.memory_offset % uint64_t(size))
        refuse_check(source_, "check_arenas", where + ": allocation_info memory offset " + num(t.memory_offset) + " is not a multiple of its " + num(size) + "-byte element size");
      const unsigned __int128 end = (unsigned __int128)t.memory_offset + t.nbytes;
      const int64_t declared = m.arena_sizes[t.memory_id];
      if (declared < 0 || end > (unsigned __int128)declared)
        refuse_check(source_, "check_arenas", where + ": bytes [" + num(t.memory_offset) + ", " + sum(t.memory_offset, t.nbytes) +
                     ") lie past the end of arena " + num(t.memory_id) + ", whose non_const_buffer_sizes entry is " + num(declared));
      m.arena_needs[t.memory_id] = std::max<uint64_t>(m.arena_needs[t.memory_id], uint64_t(end));
    }
    __int128 declared_total = 0;
    for (int64_t s : m.arena_sizes) declared_total += s;
    if (declared_total > (__int128)host_limit)
      refuse_check(source_, "check_arenas", plan + " non_const_buffer_sizes ask for more bytes of host memory than this machine has (" +
                   num(host_limit) + ")", ErrorCode::kLimit);
    // check_planned_storage_disjoint
    std::vector<std::pair<std::string, std::vector<int32_t>>> groups = {{"the plan inputs", m.inputs}};
    for (size_t i = 0; i < m.instructions.size(); ++i)
      if (m.instructions[i].kind == kKernelCall || m.instructions[i].kind == kDelegateCall)
        groups.emplace_back("instruction " + num(i), m.instructions[i].args);
    for (const auto& group : groups) {
      std::vector<std::tuple<uint32_t, uint64_t, uint64_t, int32_t>> placed;
      for (int32_t id : std::set<int32_t>(group.second.begin(), group.second.end())) {
        const PlanValue& v = m.values[size_t(id)];
        if (v.kind == kPlanTensor && v.tensor.planned && v.tensor.nbytes)
          placed.emplace_back(v.tensor.memory_id, v.tensor.memory_offset, v.tensor.memory_offset + v.tensor.nbytes, id);
      }
      std::sort(placed.begin(), placed.end());
      for (size_t k = 1; k < placed.size(); ++k) {
        const auto &a = placed[k - 1], &b = placed[k];
        if (std::get<0>(a) == std::get<0>(b) && std::get<1>(b) < std::get<2>(a))
          refuse_check(source_, "check_planned_storage_disjoint", plan + ": values " + num(std::get<3>(a)) + " and " +
                       num(std::get<3>(b)) + ", both used by " + group.first + ", have overlapping bytes in arena " +
                       num(std::get<0>(a)) + "; tensors live at the same time need disjoint memory");
      }
    }
    // check_constant_tensors: every constant's bytes are in the file (pte.py tensor_data)
    for (size_t i = 0; i < m.values.size(); ++i) {
      const PlanTensor& t = m.values[i].tensor;
      if (m.values[i].kind != kPlanTensor || t.planned || t.data_buffer_idx == 0) continue;
      const std::string where = plan + " value " + num(i) + ": ";
      if (t.has_extra && t.external) refuse_check(source_, "check_constant_tensors", where + "tensor has external data (a .ptd file), not in this .pte");
      if (t.data_buffer_idx >= constants_.size())
        refuse_check(source_, "check_constant_tensors", where + "constant data_buffer_idx " + num(t.data_buffer_idx) + " is out of range (" + num(constants_.size()) + " constants)");
      if (t.nbytes > constants_[t.data_buffer_idx].size)
        refuse_check(source_, "check_constant_tensors", where + "constant " + num(t.data_buffer_idx) + " has " +
                     num(constants_[t.data_buffer_idx].size) + " bytes, tensor " + describe(t) + " needs " + num(t.nbytes));
    }
    // check_single_delegate_call, the blob, check_delegate_io
    if (m.delegate_ids.size() != 1 || m.delegate_ids[0] != kBackendId)
      refuse(ErrorCode::kUnsupported, source_ + ": expected exactly one " + kBackendId + " delegate in " + plan + ", found " +
             num(m.delegate_ids.size()) + " (was the program lowered with VktrainPartitioner?)");
    const Instruction* call = nullptr;
    size_t calls = 0;
    for (const Instruction& ins : m.instructions)
      if (ins.kind == kDelegateCall) { call = &ins; ++calls; }
    if (calls != 1) refuse(ErrorCode::kUnsupported, source_ + ": the delegate is called " + num(calls) + " times; expected once");
    m.delegate_index = call->index;
    m.delegate_args = call->args;
    try {
      m.graph.reset(new Graph(read_blob(m.delegate_data[size_t(call->index)], &named_data_)));
      m.embedded = verify_embedded(*m.graph, "");  // the catch below names the blob
    } catch (const LoadError& e) {
      refuse(e.code(), source_ + ": " + plan + " delegate " + num(call->index) + " blob: " + e.what());
    }
    const Graph& g = *m.graph;
    if (call->args.size() != g.inputs.size() + g.outputs.size())
      refuse_check(source_, "check_delegate_io", plan + ": the delegate call passes " + num(call->args.size()) + " values, its graph has " +
                   num(g.inputs.size()) + " inputs and " + num(g.outputs.size()) + " outputs");
    for (size_t k = 0; k < call->args.size(); ++k) {
      const bool input = k < g.inputs.size();
      const int32_t value_id = input ? g.inputs[k] : g.outputs[k - g.inputs.size()];
      const char* kind = input ? "input" : "output";
      const size_t position = input ? k : k - g.inputs.size();
      const Value& want = g.values[size_t(value_id)];
      if (want.kind != kValueTensor)
        refuse_check(source_, "check_delegate_io", plan + ": delegate graph " + kind + " " + num(position) + " is value " + num(value_id) + ", not a tensor; graph inputs and outputs must be tensors");
      const std::string want_text = data_type_name(want.tensor.dtype) + list(want.tensor.shape);
      const PlanValue& have = m.values[size_t(call->args[k])];
      const std::string where = plan + ": delegate " + kind + " " + num(position) + " (" + (want.tensor.name.empty() ? "unnamed" : want.tensor.name) + ") is plan value " + num(call->args[k]);
      if (have.kind != kPlanTensor) refuse_check(source_, "check_delegate_io", where + ", not a tensor; expected a tensor " + want_text);
      const std::vector<int64_t> sizes(have.tensor.sizes.begin(), have.tensor.sizes.end());
      if (scalar_type_of(want.tensor.dtype) != have.tensor.scalar_type || sizes != want.tensor.shape)
        refuse_check(source_, "check_delegate_io", where + ", " + describe(have.tensor) + "; the delegate graph declares " + want_text);
    }
    // check_delegate_inputs_written: each delegate input is a plan input, a constant or an earlier instruction's output
    // (a kernel's last argument, a move's destination); anything else is arena bytes nothing wrote
    std::set<int32_t> written(m.inputs.begin(), m.inputs.end());
    for (const Instruction& ins : m.instructions) {
      if (&ins == call) break;
      if ((ins.kind == kKernelCall || ins.kind == kMoveCall) && !ins.args.empty()) written.insert(ins.args.back());
    }
    for (size_t k = 0; k < g.inputs.size(); ++k) {
      const PlanTensor& t = m.values[size_t(call->args[k])].tensor;
      if (written.count(call->args[k]) || (!t.planned && t.data_buffer_idx != 0)) continue;
      const std::string& name = g.values[size_t(g.inputs[k])].tensor.name;
      std::string inputs;
      for (size_t i = 0; i < m.inputs.size(); ++i) inputs += (i ? ", " : "") + num(m.inputs[i]);
      refuse_check(source_, "check_delegate_inputs_written", plan + ": delegate input " + num(k) + " (" +
                   (name.empty() ? "unnamed" : name) + ") is plan value " + num(call->args[k]) + ", which nothing writes " +
                   "before the call: not one of the plan's inputs [" + inputs + "], not a constant, not an earlier instruction's output");
    }
    // check_loss_output: the method returns one value, a float32 [] the delegate computes
    if (m.outputs.size() != 1)
      refuse(ErrorCode::kUnsupported, source_ + ": a training step returns the loss only; " + plan + " has " + num(m.outputs.size()) + " outputs");
    const int32_t output = m.outputs[0];
    const bool from_delegate = std::find(call->args.begin() + long(g.inputs.size()), call->args.end(), output) != call->args.end();
    const PlanValue& loss = m.values[size_t(output)];
    if (!from_delegate || loss.kind != kPlanTensor || !loss.tensor.sizes.empty() || loss.tensor.scalar_type != kScalarFloat)
      refuse_check(source_, "check_loss_output", plan + " output is value " + num(output) + "; expected the loss, a FLOAT[] the delegate returns");
    // plan_input_names: each plan input feeds a delegate input, once; hparams is float32[5]
    std::map<int32_t, std::string> graph_inputs;
    for (size_t k = 0; k < g.inputs.size() && k < call->args.size(); ++k) graph_inputs[call->args[k]] = g.values[size_t(g.inputs[k])].tensor.name;
    std::set<std::string> names;
    for (size_t position = 0; position < m.inputs.size(); ++position) {
      auto found = graph_inputs.find(m.inputs[position]);
      if (found == graph_inputs.end())
        refuse(ErrorCode::kUnsupported, source_ + ": " + plan + " input " + num(position) + " (value " + num(m.inputs[position]) + ") does not feed the delegate directly");
      if (!names.insert(found->second).second)
        refuse(ErrorCode::kUnsupported, source_ + ": two plan inputs of " + plan + " both feed '" + found->second + "'");
      const PlanTensor& t = m.values[size_t(m.inputs[position])].tensor;
      if (found->second == "hparams" && (t.sizes != std::vector<int32_t>{5} || t.scalar_type != kScalarFloat))
        refuse(ErrorCode::kUnsupported, source_ + ": " + plan + " input 'hparams' is " + describe(t) + "; expected float32[5] (lr, beta1, beta2, eps, weight_decay)");
    }
  }
}

}  // namespace vktrain
