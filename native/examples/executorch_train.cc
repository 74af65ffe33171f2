// Training a vktrain .pte with ExecuTorch's own C++ runtime (Program / Method API) and vktrain's native backend:
// no Python anywhere. The program links libexecutorch.so (the executorch wheel's) and
// libvktrain_executorch_backend.so, which registers vktrain's backend when it is loaded.
//
//   vktrain-executorch-train STEP.pte BATCHES.bin STEPS
//
// BATCHES.bin holds STEPS records, each: token_ids, then labels (int64, the method's [batch, seq] each), then
// hparams (float32 [lr, beta1, beta2, eps, weight_decay]). Step t feeds record t to `forward` (n_valid: the count of
// labels >= 0) and prints its loss; then `eval` (if the .pte has it) gets record 0 with n_valid 1 and prints the
// loss summed over its labels, as the trained adapters give it. Losses are printed as %.9g (exact for float32).
// Exits 0, 1 on an ExecuTorch error (named), 2 on bad arguments.
#include <executorch/extension/data_loader/file_data_loader.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/core/hierarchical_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

extern "C" int vktrain_executorch_backend_registration();
extern "C" const char* vktrain_executorch_last_error();

namespace et = ::executorch::runtime;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;

namespace {

[[noreturn]] void fail(const std::string& what, et::Error error) {
  std::fprintf(stderr, "vktrain-executorch-train: %s failed with ExecuTorch error 0x%x (%s)\n", what.c_str(),
               static_cast<unsigned>(error), vktrain_executorch_last_error());
  std::exit(1);
}

// One loaded method and the memory ExecuTorch plans for it.
struct LoadedMethod {
  std::vector<std::vector<uint8_t>> planned;
  std::vector<et::Span<uint8_t>> spans;
  std::unique_ptr<et::HierarchicalAllocator> planned_allocator;
  executorch::extension::MallocMemoryAllocator method_allocator;
  std::unique_ptr<et::MemoryManager> memory;
  std::unique_ptr<et::Method> method;

  LoadedMethod(et::Program& program, const char* name) {
    et::Result<et::MethodMeta> meta = program.method_meta(name);
    if (!meta.ok()) fail(std::string("method_meta('") + name + "')", meta.error());
    for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i)
      planned.emplace_back(static_cast<size_t>(meta->memory_planned_buffer_size(i).get()));
    for (auto& buffer : planned) spans.emplace_back(buffer.data(), buffer.size());
    planned_allocator = std::make_unique<et::HierarchicalAllocator>(et::Span<et::Span<uint8_t>>(spans.data(), spans.size()));
    memory = std::make_unique<et::MemoryManager>(&method_allocator, planned_allocator.get());
    et::Result<et::Method> loaded = program.load_method(name, memory.get());  // the backend's init runs here
    if (!loaded.ok()) fail(std::string("load_method('") + name + "')", loaded.error());
    method = std::make_unique<et::Method>(std::move(loaded.get()));
  }

  // Sets input `index` to `data` (the method's dtype and shape, contiguous); ExecuTorch copies it into its plan.
  void set_input(size_t index, const void* data) {
    et::MethodMeta meta = method->method_meta();
    et::TensorInfo info = meta.input_tensor_meta(index).get();
    std::vector<TensorImpl::SizesType> sizes(info.sizes().begin(), info.sizes().end());
    std::vector<TensorImpl::DimOrderType> dim_order(info.dim_order().begin(), info.dim_order().end());
    TensorImpl impl(info.scalar_type(), ssize_t(sizes.size()), sizes.data(), const_cast<void*>(data), dim_order.data());
    et::Error error = method->set_input(et::EValue(Tensor(&impl)), index);
    if (error != et::Error::Ok) fail("set_input(" + std::to_string(index) + ")", error);
  }

  float run() {
    et::Error error = method->execute();
    if (error != et::Error::Ok) fail("execute", error);
    return method->get_output(0).toTensor().const_data_ptr<float>()[0];
  }

  size_t numel(size_t index) const {
    size_t n = 1;
    for (auto d : method->method_meta().input_tensor_meta(index)->sizes()) n *= size_t(d);
    return n;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: vktrain-executorch-train STEP.pte BATCHES.bin STEPS\n");
    return 2;
  }
  et::runtime_init();
  if (vktrain_executorch_backend_registration() != 0) {
    std::fprintf(stderr, "vktrain-executorch-train: registering vktrain's backend failed (0x%x)\n",
                 vktrain_executorch_backend_registration());
    return 1;
  }
  auto loader = executorch::extension::FileDataLoader::from(argv[1]);
  if (!loader.ok()) fail(std::string("opening ") + argv[1], loader.error());
  et::Result<et::Program> program = et::Program::load(&loader.get());
  if (!program.ok()) fail(std::string("Program::load(") + argv[1] + ")", program.error());

  LoadedMethod forward(*program, "forward");
  const size_t tokens = forward.numel(0);  // token_ids and labels: [batch, seq] each
  const long steps = std::strtol(argv[3], nullptr, 10);
  std::ifstream batches(argv[2], std::ios::binary);
  std::vector<int64_t> token_ids(tokens), labels(tokens), first_ids, first_labels;
  float hparams[5];
  for (long t = 0; t < steps; ++t) {
    batches.read(reinterpret_cast<char*>(token_ids.data()), std::streamsize(tokens * 8));
    batches.read(reinterpret_cast<char*>(labels.data()), std::streamsize(tokens * 8));
    batches.read(reinterpret_cast<char*>(hparams), sizeof hparams);
    if (!batches) {
      std::fprintf(stderr, "vktrain-executorch-train: %s ends before record %ld\n", argv[2], t);
      return 2;
    }
    if (t == 0) {
      first_ids = token_ids;
      first_labels = labels;
    }
    float n_valid = 0;
    for (int64_t l : labels) n_valid += l >= 0 ? 1.0f : 0.0f;
    forward.set_input(0, token_ids.data());
    forward.set_input(1, labels.data());
    forward.set_input(2, hparams);
    forward.set_input(3, &n_valid);
    std::printf("step %ld loss %.9g\n", t + 1, forward.run());
  }
  if (program->method_meta("eval").ok()) {  // bound to forward's state: it sees the trained adapters
    LoadedMethod eval(*program, "eval");
    float one = 1.0f;
    eval.set_input(0, first_ids.data());
    eval.set_input(1, first_labels.data());
    eval.set_input(2, &one);
    std::printf("eval loss_sum %.9g\n", eval.run());
  }
  return 0;
}
