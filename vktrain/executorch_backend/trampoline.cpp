// The vktrain delegate for ExecuTorch's C++ runtime: a BackendInterface whose init / execute / destroy
// call vktrain's Python runtime (VKTRAIN_BRIDGE_MODULE: init, execute, destroy) through the Python C API.
// It is loaded into a Python process (vktrain.executorch_backend), so there is no interpreter to embed:
// each call takes the GIL with PyGILState_Ensure.
//
// Built by vktrain/executorch_backend/build.py with -DVKTRAIN_BACKEND_ID (vktrain.contract.BACKEND_ID) and
// -DVKTRAIN_BRIDGE_MODULE; registration happens when the library is loaded (a static initializer).
#include <Python.h>

#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>
#include <executorch/runtime/platform/log.h>

#include <cstring>
#include <string>
#include <vector>

#ifndef VKTRAIN_BACKEND_ID
#error "build with -DVKTRAIN_BACKEND_ID=\"...\" (vktrain.contract.BACKEND_ID)"
#endif
#ifndef VKTRAIN_BRIDGE_MODULE
#error "build with -DVKTRAIN_BRIDGE_MODULE=\"...\""
#endif

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

// What one initialized delegate owns. The graph vktrain builds holds views into the blob and the named
// data it read, so both stay alive (unfreed) until destroy.
struct Delegate {
  explicit Delegate(FreeableBuffer&& blob) : processed(std::move(blob)) {}
  PyObject* executor = nullptr;  // the bridge's handle (a strong reference)
  size_t num_inputs = 0;
  size_t num_outputs = 0;
  FreeableBuffer processed;
  std::vector<FreeableBuffer> named_data;
};

// Context of the named-data callbacks handed to Python during init; `map` is cleared when init returns,
// so a callback kept past init raises instead of touching a dead map.
struct NamedDataScope {
  const NamedDataMap* map = nullptr;
  Delegate* delegate = nullptr;
};

constexpr const char* kScopeCapsule = "vktrain.executorch_backend.NamedDataScope";

NamedDataScope* scope_of(PyObject* capsule) {
  auto* scope = static_cast<NamedDataScope*>(PyCapsule_GetPointer(capsule, kScopeCapsule));
  if (scope != nullptr && scope->map == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the .pte's named data is readable only while the delegate initializes");
    return nullptr;
  }
  return scope;
}

// get(key) -> read-only memoryview of the named data, or None when the .pte has no such key.
PyObject* named_data_get(PyObject* capsule, PyObject* key) {
  NamedDataScope* scope = scope_of(capsule);
  if (scope == nullptr) return nullptr;
  Py_ssize_t length = 0;
  const char* text = PyUnicode_AsUTF8AndSize(key, &length);
  if (text == nullptr) return nullptr;
  Result<FreeableBuffer> data = scope->map->get_data(std::string_view(text, static_cast<size_t>(length)));
  if (!data.ok()) {
    if (data.error() == Error::NotFound) Py_RETURN_NONE;
    PyErr_Format(PyExc_RuntimeError, "reading named data %R failed with ExecuTorch error 0x%x", key,
                 static_cast<unsigned>(data.error()));
    return nullptr;
  }
  scope->delegate->named_data.push_back(std::move(data.get()));
  const FreeableBuffer& kept = scope->delegate->named_data.back();
  return PyMemoryView_FromMemory(static_cast<char*>(const_cast<void*>(kept.data())),
                                 static_cast<Py_ssize_t>(kept.size()), PyBUF_READ);
}

// keys() -> list of the .pte's named data keys.
PyObject* named_data_keys(PyObject* capsule, PyObject*) {
  NamedDataScope* scope = scope_of(capsule);
  if (scope == nullptr) return nullptr;
  Result<uint32_t> count = scope->map->get_num_keys();
  if (!count.ok()) {
    PyErr_Format(PyExc_RuntimeError, "counting named data failed with ExecuTorch error 0x%x",
                 static_cast<unsigned>(count.error()));
    return nullptr;
  }
  PyObject* keys = PyList_New(0);
  for (uint32_t i = 0; keys != nullptr && i < count.get(); ++i) {
    Result<const char*> key = scope->map->get_key(i);
    PyObject* item = key.ok() ? PyUnicode_FromString(key.get()) : nullptr;
    if (item == nullptr || PyList_Append(keys, item) != 0) {
      if (!key.ok()) PyErr_Format(PyExc_RuntimeError, "named data key %u is unreadable", i);
      Py_XDECREF(item);
      Py_CLEAR(keys);
      break;
    }
    Py_DECREF(item);
  }
  return keys;
}

PyMethodDef kNamedDataMethods[] = {
    {"get", named_data_get, METH_O, "get(key) -> memoryview of the .pte's named data, or None"},
    {"keys", named_data_keys, METH_NOARGS, "keys() -> the .pte's named data keys"},
};

void delete_scope(PyObject* capsule) {
  delete static_cast<NamedDataScope*>(PyCapsule_GetPointer(capsule, kScopeCapsule));
}

// The current Python exception, as one line (the bridge logs its own errors; this is for a failure of
// the call itself, e.g. the bridge module missing).
std::string take_python_error() {
  PyObject *type = nullptr, *value = nullptr, *traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  std::string message = "unknown Python error";
  PyObject* text = value != nullptr ? PyObject_Str(value) : (type != nullptr ? PyObject_Str(type) : nullptr);
  if (text != nullptr) {
    const char* utf8 = PyUnicode_AsUTF8(text);
    if (utf8 != nullptr) message = utf8;
    Py_DECREF(text);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(traceback);
  return message;
}

// bridge.<name>(*args): a new reference, or nullptr with the error logged.
PyObject* call_bridge(const char* name, PyObject* args) {
  PyObject* module = PyImport_ImportModule(VKTRAIN_BRIDGE_MODULE);
  PyObject* function = module != nullptr ? PyObject_GetAttrString(module, name) : nullptr;
  PyObject* result = function != nullptr && args != nullptr ? PyObject_CallObject(function, args) : nullptr;
  Py_XDECREF(function);
  Py_XDECREF(module);
  if (result == nullptr) {
    std::string message = take_python_error();
    ET_LOG(Error, "%s: %s.%s failed: %s", VKTRAIN_BACKEND_ID, VKTRAIN_BRIDGE_MODULE, name, message.c_str());
  }
  return result;
}

// A bridge call's failure result: the name of an ExecuTorch error ("InvalidProgram", ...), the bridge
// having logged why.
Error error_named(PyObject* result) {
  const char* name = PyUnicode_Check(result) ? PyUnicode_AsUTF8(result) : nullptr;
  if (name != nullptr && std::strcmp(name, "InvalidProgram") == 0) return Error::InvalidProgram;
  if (name != nullptr && std::strcmp(name, "InvalidArgument") == 0) return Error::InvalidArgument;
  if (name != nullptr && std::strcmp(name, "MemoryAllocationFailed") == 0) return Error::DelegateMemoryAllocationFailed;
  PyErr_Clear();
  return Error::Internal;
}

bool python_usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

class VktrainBackend final : public et::BackendInterface {
 public:
  bool is_available() const override { return python_usable(); }

  // Compile specs are not read: vktrain's preprocess puts everything the runtime needs into the blob.
  Result<DelegateHandle*> init(BackendInitContext& context, FreeableBuffer* processed,
                               ArrayRef<CompileSpec>) const override {
    if (!python_usable()) return Error::InvalidState;
    auto* delegate = new Delegate(std::move(*processed));
    PyGILState_STATE gil = PyGILState_Ensure();
    Error error = Error::Ok;
    PyObject* named = Py_None;
    Py_INCREF(named);
    NamedDataScope* scope = nullptr;
    if (context.get_named_data_map() != nullptr) {
      scope = new NamedDataScope{context.get_named_data_map(), delegate};
      PyObject* capsule = PyCapsule_New(scope, kScopeCapsule, delete_scope);
      if (capsule == nullptr) delete scope;
      PyObject* get = capsule != nullptr ? PyCFunction_New(&kNamedDataMethods[0], capsule) : nullptr;
      PyObject* keys = capsule != nullptr ? PyCFunction_New(&kNamedDataMethods[1], capsule) : nullptr;
      Py_DECREF(named);
      named = get != nullptr && keys != nullptr ? PyTuple_Pack(2, get, keys) : nullptr;
      Py_XDECREF(get);
      Py_XDECREF(keys);
      Py_XDECREF(capsule);
      if (named == nullptr) scope = nullptr;  // freed with the capsule
    }
    PyObject* blob = PyMemoryView_FromMemory(static_cast<char*>(const_cast<void*>(delegate->processed.data())),
                                             static_cast<Py_ssize_t>(delegate->processed.size()), PyBUF_READ);
    PyObject* args = blob != nullptr && named != nullptr ? PyTuple_Pack(2, blob, named) : nullptr;
    PyObject* result = call_bridge("init", args);
    if (scope != nullptr) scope->map = nullptr;
    // init returns (executor, num_inputs, num_outputs), or an error name.
    if (result == nullptr) {
      error = Error::Internal;
    } else if (!PyTuple_Check(result)) {
      error = error_named(result);
    } else if (!PyArg_ParseTuple(result, "Onn", &delegate->executor, &delegate->num_inputs,
                                 &delegate->num_outputs)) {
      ET_LOG(Error, "%s: bridge init returned a malformed tuple: %s", VKTRAIN_BACKEND_ID, take_python_error().c_str());
      delegate->executor = nullptr;
      error = Error::Internal;
    } else {
      Py_INCREF(delegate->executor);
    }
    Py_XDECREF(result);
    Py_XDECREF(args);
    Py_XDECREF(blob);
    Py_XDECREF(named);
    if (error != Error::Ok) {
      release(delegate);
      PyGILState_Release(gil);
      return error;
    }
    PyGILState_Release(gil);
    return delegate;
  }

  // args: the delegate's inputs, then its outputs (tensors the runtime allocated from the memory plan).
  // Each goes to Python as (ExecuTorch scalar type, sizes, memoryview of its data): read-only for the
  // inputs, writable for the outputs, which the bridge fills in place.
  Error execute(BackendExecutionContext&, DelegateHandle* handle, Span<EValue*> args) const override {
    auto* delegate = static_cast<Delegate*>(handle);
    if (delegate == nullptr || delegate->executor == nullptr) return Error::DelegateInvalidHandle;
    if (args.size() != delegate->num_inputs + delegate->num_outputs) {
      ET_LOG(Error, "%s: the delegate call passes %zu values; the delegate takes %zu inputs and %zu outputs",
             VKTRAIN_BACKEND_ID, args.size(), delegate->num_inputs, delegate->num_outputs);
      return Error::InvalidArgument;
    }
    if (!python_usable()) return Error::InvalidState;
    PyGILState_STATE gil = PyGILState_Ensure();
    Error error = Error::Ok;
    PyObject* values = PyList_New(static_cast<Py_ssize_t>(args.size()));
    for (size_t i = 0; values != nullptr && i < args.size(); ++i) {
      if (args[i] == nullptr || !args[i]->isTensor()) {
        ET_LOG(Error, "%s: delegate argument %zu is not a tensor", VKTRAIN_BACKEND_ID, i);
        error = Error::InvalidArgument;
        break;
      }
      const auto& tensor = args[i]->toTensor();
      bool is_output = i >= delegate->num_inputs;
      void* data = is_output ? tensor.mutable_data_ptr() : const_cast<void*>(tensor.const_data_ptr());
      if (data == nullptr && tensor.nbytes() != 0) {
        ET_LOG(Error, "%s: delegate %s %zu has no data (not memory-planned and not set)", VKTRAIN_BACKEND_ID,
               is_output ? "output" : "input", is_output ? i - delegate->num_inputs : i);
        error = Error::InvalidArgument;
        break;
      }
      PyObject* sizes = PyTuple_New(tensor.dim());
      for (ssize_t d = 0; sizes != nullptr && d < tensor.dim(); ++d) {
        PyTuple_SET_ITEM(sizes, d, PyLong_FromLong(static_cast<long>(tensor.size(d))));
      }
      static char empty = 0;
      PyObject* view = PyMemoryView_FromMemory(data != nullptr ? static_cast<char*>(data) : &empty,
                                               static_cast<Py_ssize_t>(tensor.nbytes()),
                                               is_output ? PyBUF_WRITE : PyBUF_READ);
      PyObject* item = sizes != nullptr && view != nullptr
                           ? Py_BuildValue("(iOO)", static_cast<int>(tensor.scalar_type()), sizes, view)
                           : nullptr;
      Py_XDECREF(sizes);
      Py_XDECREF(view);
      if (item == nullptr) {
        ET_LOG(Error, "%s: passing delegate argument %zu failed: %s", VKTRAIN_BACKEND_ID, i,
               take_python_error().c_str());
        error = Error::Internal;
        break;
      }
      PyList_SET_ITEM(values, static_cast<Py_ssize_t>(i), item);
    }
    if (values == nullptr) error = Error::Internal;
    if (error == Error::Ok) {
      PyObject* call_args = Py_BuildValue("(OO)", delegate->executor, values);
      PyObject* result = call_bridge("execute", call_args);
      // execute returns None, or an error name.
      if (result == nullptr) {
        error = Error::Internal;
      } else if (result != Py_None) {
        error = error_named(result);
      }
      Py_XDECREF(result);
      Py_XDECREF(call_args);
    }
    Py_XDECREF(values);
    PyGILState_Release(gil);
    return error;
  }

  void destroy(DelegateHandle* handle) const override {
    auto* delegate = static_cast<Delegate*>(handle);
    if (delegate == nullptr) return;
    if (!python_usable()) return;  // interpreter shutdown: the process is exiting, leak rather than crash
    PyGILState_STATE gil = PyGILState_Ensure();
    release(delegate);
    PyGILState_Release(gil);
  }

 private:
  // Closes the bridge's executor and frees what init kept (GIL held).
  static void release(Delegate* delegate) {
    if (delegate->executor != nullptr) {
      PyObject* args = PyTuple_Pack(1, delegate->executor);
      Py_XDECREF(call_bridge("destroy", args));
      Py_XDECREF(args);
      Py_CLEAR(delegate->executor);
    }
    delete delegate;  // frees the blob and named data buffers
  }
};

VktrainBackend backend_instance;

const Error registration = et::register_backend({VKTRAIN_BACKEND_ID, &backend_instance});

}  // namespace

// For the loader: whether the static registration succeeded (an Error code, 0 = Ok).
extern "C" __attribute__((visibility("default"))) int vktrain_executorch_backend_registration() { return static_cast<int>(registration); }
