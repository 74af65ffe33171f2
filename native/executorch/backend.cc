// vktrain's ExecuTorch backend on the native runtime (issue 26): a BackendInterface registered under
// vktrain's backend id (kBackendId) when this shared library is loaded, whose init reads the delegate blob
// ExecuTorch hands it with the native blob reader and verifier, picks the blob's embedded schedule for the
// device and uploads the constants (StepInterpreter), and whose execute is one replay of the recorded step:
// no Python and no Vulkan binding in the loop. The state (LoRA tensors, AdamW moments, step) stays resident
// on the device between execute calls.
//
// A method whose schedule binds another method's tensors (an eval method: buffers "shared:<name>", planned by
// `vktrain export --target` against the training step) binds the most recently loaded training step (a delegate
// with mutable state) whose state and frozen constants it matches: it reads the adapters as trained, and the base
// is on the device once. It keeps that step's resident state alive while it lives.
//
// One Vulkan device per process ($VKTRAIN_DEVICE picks it, as for vktrain), opened by the first init and closed
// with the last delegate. Failures reach ExecuTorch as a non-Ok Error; the reason is logged (ET_LOG) and kept for
// vktrain_executorch_last_error().
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>
#include <executorch/runtime/platform/log.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "blob.h"
#include "embedded.h"
#include "interpreter.h"
#include "pte.h"
#include "status.h"
#include "text.h"
#include "vk_device.h"

namespace {

namespace et = ::executorch::runtime;
using et::ArrayRef;
using et::BackendExecutionContext;
using et::BackendInitContext;
using et::CompileSpec;
using et::DelegateHandle;
using et::Error;
using et::EValue;
using et::FreeableBuffer;
using et::NamedDataMap;
using et::Result;
using et::Span;
using vktrain::ErrorCode;
using vktrain::LoadError;
using vktrain::refuse;

// What one initialized delegate owns. The graph holds views into the blob and the named data, so both live
// as long as it. Members are destroyed in reverse order: the interpreter first, then the training step it binds
// (`owner`), then the device.
struct Resident {
  explicit Resident(FreeableBuffer&& processed) : blob(std::move(processed)) {}
  std::string where;
  FreeableBuffer blob;
  std::vector<FreeableBuffer> named_buffers;
  vktrain::NamedData named;
  std::shared_ptr<vktrain::Device> device;
  std::unique_ptr<vktrain::Graph> graph;
  std::string profile;  // the embedded schedule's device profile
  std::unique_ptr<vktrain::StepSource> source;
  std::shared_ptr<Resident> owner;
  std::unique_ptr<vktrain::StepInterpreter> step;
};

struct Handle {  // what ExecuTorch holds
  std::shared_ptr<Resident> resident;
};

// Process-wide, never destroyed: ExecuTorch may destroy its methods after static destructors ran.
struct Registry {
  std::mutex mutex;
  std::weak_ptr<vktrain::Device> device;
  std::vector<std::weak_ptr<Resident>> training;  // training steps, oldest first
  std::string last_error;
  int live = 0;
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

// ExecuTorch ScalarType codes (c10) of the graph dtypes a delegate's inputs and outputs have.
int graph_dtype(executorch::aten::ScalarType t) {
  switch (static_cast<int>(t)) {
    case 0: return vktrain::kUint8;
    case 1: return vktrain::kInt8;
    case 3: return vktrain::kInt32;
    case 4: return vktrain::kInt64;
    case 5: return vktrain::kFloat16;
    case 6: return vktrain::kFloat32;
    case 11: return vktrain::kBool;
    case 15: return vktrain::kBfloat16;
    default: return -1;
  }
}

Error report(const std::string& message, Error error) {
  ET_LOG(Error, "%s: %s", vktrain::kBackendId, message.c_str());
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().last_error = message;
  return error;
}

Error init_error(const LoadError& e) {
  switch (e.code()) {
    case ErrorCode::kLimit: return Error::MemoryAllocationFailed;
    case ErrorCode::kDevice: case ErrorCode::kInternal: case ErrorCode::kIo: return Error::Internal;
    default: return Error::InvalidProgram;  // the blob or its schedule: malformed, inconsistent or unsupported here
  }
}

std::shared_ptr<vktrain::Device> shared_device() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::shared_ptr<vktrain::Device> device = r.device.lock();
  if (!device) {
    device = std::make_shared<vktrain::Device>();  // $VKTRAIN_DEVICE, else the best by type
    r.device = device;
  }
  return device;
}

void read_named_data(const NamedDataMap* map, Resident* resident) {
  if (map == nullptr) return;
  Result<uint32_t> count = map->get_num_keys();
  if (!count.ok()) refuse(ErrorCode::kPteFormat, resident->where + ": the .pte's named data cannot be listed");
  for (uint32_t i = 0; i < count.get(); ++i) {
    Result<const char*> key = map->get_key(i);
    if (!key.ok()) refuse(ErrorCode::kPteFormat, resident->where + ": named data key " + vktrain::num(i) + " is unreadable");
    Result<FreeableBuffer> data = map->get_data(key.get());
    if (!data.ok())
      refuse(ErrorCode::kPteFormat, resident->where + ": reading named data '" + key.get() + "' failed (ExecuTorch error " +
                                        vktrain::num(static_cast<int>(data.error())) + ")");
    resident->named_buffers.push_back(std::move(data.get()));
    const FreeableBuffer& kept = resident->named_buffers.back();
    resident->named[key.get()] = {static_cast<const uint8_t*>(kept.data()), kept.size()};
  }
}

bool binds_shared(const vktrain::Schedule& schedule) {
  for (const auto& b : schedule.buffers)
    if (b.key.rfind("shared:", 0) == 0) return true;
  return false;
}

// The embedded schedule of `resident`'s graph for `profile` (a bound method runs its training step's), else by the
// matching rule for the device.
void choose_schedule(Resident* resident, const std::string& profile) {
  std::vector<vktrain::EmbeddedSchedule> embedded = vktrain::verify_embedded(*resident->graph, resident->where);
  if (embedded.empty())
    refuse(ErrorCode::kUnsupported, resident->where + " embeds no dispatch schedules (exported without --target): export "
                                    "it with `vktrain export --target NAME`, or run it on the Python runtime's backend "
                                    "(VKTRAIN_EXECUTORCH_BACKEND=python), which plans at load");
  size_t chosen = embedded.size();
  if (profile.empty()) {
    chosen = vktrain::select_schedule(embedded, resident->graph->shader_modules,
                                      vktrain::device_profile_of(*resident->device), resident->device->name(),
                                      resident->where);
  } else {
    for (size_t i = 0; i < embedded.size() && chosen == embedded.size(); ++i)
      if (embedded[i].profile.name == profile) chosen = i;
    if (chosen == embedded.size())
      refuse(ErrorCode::kUnsupported, resident->where + " embeds no schedule for profile '" + profile +
                                      "', the one its training step runs");
  }
  resident->profile = embedded[chosen].profile.name;
  resident->source = vktrain::embedded_step_source(*resident->graph, std::move(embedded[chosen]));
}

// Loads `resident` (its graph read): a training step or a method that runs alone, or a method bound to the
// newest live training step it matches.
void load(Resident* resident) {
  const vktrain::Graph& graph = *resident->graph;
  std::vector<std::shared_ptr<Resident>> owners;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.training.rbegin(); it != r.training.rend(); ++it)
      if (auto owner = it->lock()) owners.push_back(owner);
  }
  choose_schedule(resident, "");
  if (!graph.mutable_state.empty() || !binds_shared(resident->source->schedule())) {
    resident->step = std::make_unique<vktrain::StepInterpreter>(graph, resident->where, *resident->source, *resident->device);
    return;
  }
  if (owners.empty())
    refuse(ErrorCode::kUnsupported, resident->where + " binds the training step's state (it is an eval method): load the "
                                    "program's training method ('forward') first and keep it loaded");
  std::string first_error;
  for (const auto& owner : owners) {
    try {
      choose_schedule(resident, owner->profile);
      resident->step = std::make_unique<vktrain::StepInterpreter>(graph, resident->where, *resident->source,
                                                                  *resident->device, owner->step.get());
      resident->owner = owner;
      return;
    } catch (const LoadError& e) {
      if (e.code() != ErrorCode::kUnsupported && e.code() != ErrorCode::kVerification) throw;
      if (first_error.empty()) first_error = e.what();
    }
  }
  refuse(ErrorCode::kUnsupported, first_error + (owners.size() > 1 ? " (and no other loaded training step fits it)" : ""));
}

class NativeBackend final : public et::BackendInterface {
 public:
  bool is_available() const override { return true; }

  // Compile specs are not read: vktrain's preprocess puts everything the runtime needs into the blob.
  Result<DelegateHandle*> init(BackendInitContext& context, FreeableBuffer* processed,
                               ArrayRef<CompileSpec>) const override {
    auto resident = std::make_shared<Resident>(std::move(*processed));
    const char* method = context.get_method_name();
    resident->where = std::string("the ExecuTorch delegate blob of method '") + (method ? method : "?") + "'";
    try {
      read_named_data(context.get_named_data_map(), resident.get());
      resident->device = shared_device();
      vktrain::Bytes bytes{static_cast<const uint8_t*>(resident->blob.data()), resident->blob.size()};
      resident->graph = std::make_unique<vktrain::Graph>(
          vktrain::read_blob(bytes, context.get_named_data_map() ? &resident->named : nullptr));
      load(resident.get());
    } catch (const LoadError& e) {
      return report(resident->where + ": init: " + e.what(), init_error(e));
    } catch (const std::exception& e) {
      return report(resident->where + ": init: internal error: " + e.what(), Error::Internal);
    }
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!resident->graph->mutable_state.empty()) r.training.push_back(resident);
    ++r.live;
    return new Handle{resident};
  }

  // args: the delegate's inputs, then its outputs (tensors the runtime allocated from the memory plan).
  Error execute(BackendExecutionContext&, DelegateHandle* handle, Span<EValue*> args) const override {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || !h->resident || !h->resident->step) return Error::DelegateInvalidHandle;
    Resident& resident = *h->resident;
    const vktrain::Graph& graph = *resident.graph;
    const size_t n_in = graph.inputs.size(), n_out = graph.outputs.size();
    const std::string where = resident.where + ": execute";
    if (args.size() != n_in + n_out)
      return report(where + ": the delegate call passes " + vktrain::num(args.size()) + " values; the delegate takes " +
                        vktrain::num(n_in) + " inputs and " + vktrain::num(n_out) + " outputs",
                    Error::InvalidArgument);
    try {
      std::vector<vktrain::HostTensor> inputs;
      for (size_t i = 0; i < n_in; ++i) {
        if (args[i] == nullptr || !args[i]->isTensor())
          refuse(ErrorCode::kVerification, "delegate input " + vktrain::num(i) + " is not a tensor");
        const auto& tensor = args[i]->toTensor();
        vktrain::HostTensor t;
        t.dtype = graph_dtype(tensor.scalar_type());
        if (t.dtype < 0)
          refuse(ErrorCode::kVerification, "delegate input " + vktrain::num(i) + " has ExecuTorch scalar type " +
                                               vktrain::num(static_cast<int>(tensor.scalar_type())) + ", which vktrain does not read");
        for (ssize_t d = 0; d < tensor.dim(); ++d) t.shape.push_back(tensor.size(d));
        const auto* data = static_cast<const uint8_t*>(tensor.const_data_ptr());
        if (data == nullptr && tensor.nbytes() != 0)
          refuse(ErrorCode::kVerification, "delegate input " + vktrain::num(i) + " has no data");
        t.data.assign(data, data + tensor.nbytes());
        inputs.push_back(std::move(t));
      }
      std::vector<vktrain::HostTensor> results = resident.step->run(inputs);
      for (size_t i = 0; i < n_out; ++i) {
        EValue* arg = args[n_in + i];
        if (arg == nullptr || !arg->isTensor()) refuse(ErrorCode::kVerification, "delegate output " + vktrain::num(i) + " is not a tensor");
        auto& tensor = arg->toTensor();
        const vktrain::HostTensor& r = results.at(i);
        std::vector<int64_t> shape;
        for (ssize_t d = 0; d < tensor.dim(); ++d) shape.push_back(tensor.size(d));
        if (graph_dtype(tensor.scalar_type()) != r.dtype || shape != r.shape || tensor.nbytes() != r.data.size())
          refuse(ErrorCode::kVerification, "delegate output " + vktrain::num(i) + " is " + vktrain::data_type_name(r.dtype) +
                                               vktrain::list(r.shape) + "; ExecuTorch allocated ExecuTorch type " +
                                               vktrain::num(static_cast<int>(tensor.scalar_type())) + vktrain::list(shape) + " for it");
        if (!r.data.empty()) std::memcpy(tensor.mutable_data_ptr(), r.data.data(), r.data.size());
      }
    } catch (const LoadError& e) {
      // A wrong input is refused before the step runs: the state is unchanged.
      return report(where + ": " + e.what(), e.code() == ErrorCode::kVerification ? Error::InvalidArgument : Error::Internal);
    } catch (const std::exception& e) {
      return report(where + ": internal error: " + e.what(), Error::Internal);
    }
    return Error::Ok;
  }

  void destroy(DelegateHandle* handle) const override {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(registry().mutex);
      --registry().live;
    }
    try {
      delete h;  // the interpreter, then (when no bound method holds them) the step's buffers and the device
    } catch (...) {
    }
  }
};

NativeBackend backend_instance;
const Error registration = et::register_backend({vktrain::kBackendId, &backend_instance});

}  // namespace

// For the loader (vktrain.executorch_backend) and C++ programs: whether the registration at load succeeded (an
// ExecuTorch Error code, 0 = Ok; 0x16 = a backend of that name was already registered). Calling it also keeps a
// program that links this library from having the linker drop it.
extern "C" __attribute__((visibility("default"))) int vktrain_executorch_backend_registration() {
  return static_cast<int>(registration);
}

// The message of the last failure reported to ExecuTorch ("" when none yet); valid until the next failure.
extern "C" __attribute__((visibility("default"))) const char* vktrain_executorch_last_error() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lock(registry().mutex);
  copy = registry().last_error;
  return copy.c_str();
}

// How many delegates ExecuTorch has initialized and not destroyed.
extern "C" __attribute__((visibility("default"))) int vktrain_executorch_live_delegates() {
  std::lock_guard<std::mutex> lock(registry().mutex);
  return registry().live;
}
