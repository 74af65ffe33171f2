// The C API (native/include/vktrain.h): each call converts its arguments, calls the Session (session.h) and
// turns an exception into a status code and a message kept on the handle. Nothing else is decided here.
#include "vktrain.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "session.h"
#include "status.h"
#include "text.h"

using vktrain::ErrorCode;
using vktrain::HostTensor;
using vktrain::LoadError;

static_assert(int(VKTRAIN_ERROR_IO) == int(ErrorCode::kIo) && int(VKTRAIN_ERROR_DEVICE) == int(ErrorCode::kDevice) &&
              int(VKTRAIN_ERROR_VERIFICATION) == int(ErrorCode::kVerification) &&
              int(VKTRAIN_ERROR_INTERNAL) == int(ErrorCode::kInternal), "vktrain.h's codes are status.h's");
static_assert(int(VKTRAIN_INT64) == int(vktrain::kInt64) && int(VKTRAIN_BFLOAT16) == int(vktrain::kBfloat16),
              "vktrain.h's dtypes are graph.h's");

struct vktrain_session {
  std::unique_ptr<vktrain::Session> session;
  std::string error;
  std::string program;
  std::vector<std::string> input_names, state_names;
  std::vector<const vktrain::TensorValue*> inputs, states;
};

namespace {

thread_local std::string open_error;  // vktrain_last_error(NULL)
constexpr ErrorCode kArgument = ErrorCode(VKTRAIN_ERROR_ARGUMENT);

[[noreturn]] void argument(const std::string& message) { throw LoadError(kArgument, message); }

// Runs `body`, returning VKTRAIN_OK, or the error's status with its message kept in `*error`.
template <typename Body> vktrain_status guarded(std::string* error, Body&& body) {
  try {
    return body();
  } catch (const LoadError& e) {
    *error = e.what();
    return vktrain_status(int(e.code()));
  } catch (const std::bad_alloc&) {
    *error = "out of host memory";
    return VKTRAIN_ERROR_LIMIT;
  } catch (const std::exception& e) {
    *error = std::string("internal error: ") + e.what();
    return VKTRAIN_ERROR_INTERNAL;
  } catch (...) {
    *error = "internal error: an unknown exception";
    return VKTRAIN_ERROR_INTERNAL;
  }
}

template <typename Body> vktrain_status call(vktrain_session* s, Body&& body) {
  if (!s) {
    open_error = "the session is NULL";
    return VKTRAIN_ERROR_ARGUMENT;
  }
  return guarded(&s->error, [&] { body(*s->session); return VKTRAIN_OK; });
}

void need(const void* p, const char* what) {
  if (!p) argument(std::string(what) + " is NULL");
}

uint32_t option_bytes(uint32_t size, size_t full, const char* what) {  // how much of an option struct the caller has
  if (size < sizeof(uint32_t)) argument(std::string(what) + ".size is " + std::to_string(size) + "; call " + what + "_init first");
  return uint32_t(std::min<size_t>(size, full));
}

// An output struct: `full` copied into the caller's `out` up to the size it declares (vktrain.h: a smaller, older
// struct gets its fields; a larger, unknown one or one below the first version's is refused, nothing written).
template <typename T> void deliver(T* out, T full, size_t first_version_bytes, const char* what) {
  need(out, what);
  const uint32_t size = out->size;
  if (size < first_version_bytes || size > sizeof(T))
    argument(std::string(what) + "->size is " + std::to_string(size) + "; set it to sizeof the struct (this library's is " +
             std::to_string(sizeof(T)) + (size > sizeof(T) ? " bytes: the caller's header is newer than the library)"
                                                           : " bytes; VKTRAIN_OUTPUT declares one so)"));
  full.size = size;
  std::memcpy(static_cast<void*>(out), &full, size);
}
// The first version's sizes (VKTRAIN_API_VERSION 2), through its last fields: fields appended later leave them be.
constexpr size_t kTensorInfoV2 = offsetof(vktrain_tensor_info, nbytes) + sizeof(uint64_t),
                 kSessionInfoV2 = offsetof(vktrain_session_info, lora_alpha) + sizeof(double),
                 kStepResultV2 = offsetof(vktrain_step_result, gpu_seconds) + sizeof(double);

void fill_info(const vktrain::TensorValue& t, const std::string& name, vktrain_tensor_info* out) {
  vktrain_tensor_info info{};
  info.name = name.c_str();
  info.dtype = vktrain_dtype(t.dtype);
  info.ndim = t.shape.size();
  info.shape = t.shape.data();
  info.nbytes = t.nbytes();
  deliver(out, info, kTensorInfoV2, "info");
}

vktrain_step_result step_result(const vktrain::CheckpointRecord& r, double gpu_seconds) {
  vktrain_step_result out{};
  out.step = r.step;
  out.loss = float(r.loss);
  out.lr = r.lr;
  out.seconds = r.seconds;
  out.gpu_seconds = gpu_seconds;
  return out;
}

size_t find(const std::vector<std::string>& names, const char* name, const char* what) {
  need(name, what);
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return i;
  argument(std::string("the program has no ") + what + " named '" + name + "'");
}

HostTensor host_tensor(const vktrain::TensorValue& t, const std::string& name, vktrain_dtype dtype, const void* data,
                       size_t nbytes) {
  if (int(dtype) != t.dtype)
    argument(name + " is " + vktrain::data_type_name(t.dtype) + " in the program, given " + vktrain::data_type_name(int(dtype)));
  if (nbytes != t.nbytes())
    argument(name + " is " + vktrain::list(t.shape) + " " + vktrain::data_type_name(t.dtype) + " (" + std::to_string(t.nbytes()) +
             " bytes), given " + std::to_string(nbytes) + " bytes");
  need(data, (name + "'s data").c_str());
  HostTensor h{t.dtype, t.shape, std::vector<uint8_t>(nbytes)};
  std::memcpy(h.data.data(), data, nbytes);
  return h;
}

vktrain_status open_session(std::unique_ptr<vktrain::Program> (*load)(const void*, size_t, const char*),
                            const void* data, size_t size, const char* name, const vktrain_open_options* options,
                            vktrain_session** out) {
  if (out) *out = nullptr;
  return guarded(&open_error, [&] {
    need(out, "the session pointer");
    vktrain_open_options o;
    vktrain_open_options_init(&o);
    if (options) std::memcpy(&o, options, option_bytes(options->size, sizeof o, "vktrain_open_options"));
    vktrain::SessionOptions so;
    so.device = o.device_name ? o.device_name : o.device_index >= 0 ? std::to_string(o.device_index) : "";
    so.staging = o.staging != 0;
    so.schedule_file = o.schedule_file ? o.schedule_file : "";
    so.spirv_dir = o.spirv_dir ? o.spirv_dir : "";
    so.schedule_profile = o.schedule_profile ? o.schedule_profile : "";
    auto handle = std::make_unique<vktrain_session>();
    handle->session = std::make_unique<vktrain::Session>(load(data, size, name), so);
    const vktrain::StepInterpreter& step = handle->session->interpreter();
    handle->program = handle->session->program().source();
    handle->input_names = step.input_names();
    for (size_t i = 0; i < handle->input_names.size(); ++i) handle->inputs.push_back(&step.input(i));
    handle->state_names = step.state_names();
    for (size_t i = 0; i < handle->state_names.size(); ++i) handle->states.push_back(&step.state_value(i));
    *out = handle.release();
    return VKTRAIN_OK;
  });
}

}  // namespace

extern "C" {

const char* vktrain_status_name(vktrain_status status) {
  switch (status) {
    case VKTRAIN_OK: return "VKTRAIN_OK";
    case VKTRAIN_DIVERGED: return "VKTRAIN_DIVERGED";
    case VKTRAIN_ERROR_IO: return "VKTRAIN_ERROR_IO";
    case VKTRAIN_ERROR_PTE_FORMAT: return "VKTRAIN_ERROR_PTE_FORMAT";
    case VKTRAIN_ERROR_BLOB_FORMAT: return "VKTRAIN_ERROR_BLOB_FORMAT";
    case VKTRAIN_ERROR_BLOB_CHECKSUM: return "VKTRAIN_ERROR_BLOB_CHECKSUM";
    case VKTRAIN_ERROR_VERIFICATION: return "VKTRAIN_ERROR_VERIFICATION";
    case VKTRAIN_ERROR_UNSUPPORTED: return "VKTRAIN_ERROR_UNSUPPORTED";
    case VKTRAIN_ERROR_LIMIT: return "VKTRAIN_ERROR_LIMIT";
    case VKTRAIN_ERROR_SCHEDULE_FORMAT: return "VKTRAIN_ERROR_SCHEDULE_FORMAT";
    case VKTRAIN_ERROR_SHADER_MODULE: return "VKTRAIN_ERROR_SHADER_MODULE";
    case VKTRAIN_ERROR_DEVICE: return "VKTRAIN_ERROR_DEVICE";
    case VKTRAIN_ERROR_ARGUMENT: return "VKTRAIN_ERROR_ARGUMENT";
    case VKTRAIN_ERROR_INTERNAL: return "VKTRAIN_ERROR_INTERNAL";
  }
  return "VKTRAIN_ERROR_UNKNOWN";
}

const char* vktrain_last_error(const vktrain_session* session) {
  return session ? session->error.c_str() : open_error.c_str();
}

void vktrain_open_options_init(vktrain_open_options* options) {
  if (!options) return;
  std::memset(options, 0, sizeof *options);
  options->size = sizeof *options;
  options->device_index = -1;
}

vktrain_status vktrain_open(const char* pte_path, const vktrain_open_options* options, vktrain_session** session) {
  return open_session([](const void*, size_t, const char* path) {
    need(path, "the .pte path");
    return vktrain::Program::load(path);
  }, nullptr, 0, pte_path, options, session);
}

vktrain_status vktrain_open_bytes(const void* data, size_t size, const char* name, const vktrain_open_options* options,
                                  vktrain_session** session) {
  return open_session([](const void* d, size_t n, const char* label) {
    need(d, "the .pte bytes");
    return vktrain::Program::load_bytes(d, n, label ? label : "<.pte bytes>");
  }, data, size, name, options, session);
}

void vktrain_close(vktrain_session* session) { delete session; }

vktrain_status vktrain_get_info(vktrain_session* s, vktrain_session_info* out) {
  return call(s, [&](vktrain::Session& session) {
    need(out, "info");
    const vktrain::StepInterpreter& step = session.interpreter();
    vktrain_session_info info{};
    info.program = s->program.c_str();
    info.device_name = session.device_name().c_str();
    info.schedule = session.origin().c_str();
    info.dispatches = step.recorded_dispatches();
    info.barriers = step.barrier_count();
    info.buffer_bytes = step.allocated_bytes();
    info.batch_size = session.batch_size();
    info.seq_len = session.seq_len();
    info.vocab_size = session.vocab_size();
    info.step = session.steps_done();
    info.n_windows = session.n_windows();
    info.lora_alpha = vktrain::recorded_lora_alpha(*session.program().main_method().graph, s->program);
    deliver(out, info, kSessionInfoV2, "info");
  });
}

size_t vktrain_input_count(const vktrain_session* s) { return s ? s->inputs.size() : 0; }

vktrain_status vktrain_input_info(vktrain_session* s, size_t index, vktrain_tensor_info* info) {
  return call(s, [&](vktrain::Session&) {
    need(info, "info");
    if (index >= s->inputs.size()) argument("input index " + std::to_string(index) + " is past the program's " + std::to_string(s->inputs.size()) + " inputs");
    fill_info(*s->inputs[index], s->input_names[index], info);
  });
}

void vktrain_hparams_init(vktrain_hparams* h) {
  if (h) *h = vktrain_hparams{1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f};
}

vktrain_status vktrain_step(vktrain_session* s, const vktrain_input* inputs, size_t count, const vktrain_hparams* hparams,
                            float* loss) {
  vktrain_status status = call(s, [&](vktrain::Session& session) {
    need(loss, "loss");
    if (count) need(inputs, "inputs");
    if (!hparams && std::count(s->input_names.begin(), s->input_names.end(), "hparams"))
      argument("hparams is NULL; the program takes them (its hyper-parameters are not baked in)");
    const vktrain_hparams none{};
    std::map<std::string, HostTensor> given;
    for (size_t i = 0; i < count; ++i) {
      size_t at = find(s->input_names, inputs[i].name, "input");
      if (given.count(inputs[i].name)) argument(std::string("input '") + inputs[i].name + "' is given twice");
      given[inputs[i].name] = host_tensor(*s->inputs[at], "input '" + s->input_names[at] + "'", inputs[i].dtype,
                                          inputs[i].data, inputs[i].nbytes);
    }
    const vktrain_hparams& p = hparams ? *hparams : none;
    const float h[5] = {p.lr, p.beta1, p.beta2, p.eps, p.weight_decay};
    *loss = session.step(std::move(given), h, double(p.lr));
  });
  if (status == VKTRAIN_OK && !std::isfinite(*loss)) {
    s->error = "the loss is " + std::string(std::isnan(*loss) ? "NaN" : "infinite") + " (step not recorded)";
    return VKTRAIN_DIVERGED;
  }
  return status;
}

vktrain_status vktrain_step_tokens(vktrain_session* s, const int64_t* token_ids, const int64_t* labels,
                                   const vktrain_hparams* hparams, float* loss) {
  if (!s) return vktrain_step(s, nullptr, 0, hparams, loss);
  const size_t n = size_t(s->session->batch_size() * s->session->seq_len());
  if (!n) {
    s->error = s->program + " is not a token step (token_ids [batch, seq]); give its inputs to vktrain_step";
    return VKTRAIN_ERROR_UNSUPPORTED;
  }
  const vktrain_input inputs[2] = {{"token_ids", VKTRAIN_INT64, token_ids, n * 8}, {"labels", VKTRAIN_INT64, labels, n * 8}};
  return vktrain_step(s, inputs, 2, hparams, loss);
}

void vktrain_run_config_init(vktrain_run_config* c) {
  if (!c) return;
  std::memset(c, 0, sizeof *c);
  c->size = sizeof *c;
  c->schedule = "cosine";
  c->lr = 1e-3;
  c->beta1 = 0.9;
  c->beta2 = 0.999;
  c->eps = 1e-8;
  c->weight_decay = 1e-2;
  c->shuffle = 1;
  c->data_name = "tokens";
}

}  // extern "C"

namespace {

vktrain::RunSettings run_settings(const vktrain_run_config* config) {
  need(config, "the run config");
  vktrain_run_config c;
  vktrain_run_config_init(&c);
  std::memcpy(&c, config, option_bytes(config->size, sizeof c, "vktrain_run_config"));
  vktrain::RunSettings r;
  r.lr.kind = c.schedule ? c.schedule : "";
  r.lr.base_lr = c.lr;
  r.lr.total_steps = c.total_steps;
  r.lr.warmup_steps = c.warmup_steps;
  r.lr.min_lr_ratio = c.min_lr_ratio;
  const double adamw[4] = {c.beta1, c.beta2, c.eps, c.weight_decay};
  std::copy(adamw, adamw + 4, r.adamw);
  r.seed = c.seed;
  r.shuffle = c.shuffle != 0;
  r.data_name = c.data_name ? c.data_name : "tokens";
  return r;
}

}  // namespace

extern "C" {

vktrain_status vktrain_schedule_lr(const vktrain_run_config* config, int64_t step, double* lr) {
  return guarded(&open_error, [&] {  // no session: its message is vktrain_last_error(NULL)
    need(lr, "lr");
    vktrain::RunSettings r = run_settings(config);
    std::string unusable = r.lr.check();
    if (!unusable.empty()) argument(unusable);
    if (step < 1) argument("steps are numbered from 1, got " + std::to_string(step));
    *lr = r.lr.lr(step);
    return VKTRAIN_OK;
  });
}

vktrain_status vktrain_start_run(vktrain_session* s, const int64_t* tokens, size_t count, const vktrain_run_config* config) {
  return call(s, [&](vktrain::Session& session) {
    if (count) need(tokens, "tokens");
    session.start_run(std::vector<int64_t>(tokens, tokens + count), run_settings(config));
  });
}

vktrain_status vktrain_train_step(vktrain_session* s, vktrain_step_result* result) {
  vktrain::CheckpointRecord r;
  vktrain_status status = call(s, [&](vktrain::Session& session) {
    need(result, "result");
    if (result->size < kStepResultV2 || result->size > sizeof *result) deliver(result, vktrain_step_result{}, kStepResultV2, "result");
    r = session.train_step();
    deliver(result, step_result(r, session.gpu_seconds(r.step)), kStepResultV2, "result");
  });
  if (status == VKTRAIN_OK && !std::isfinite(r.loss)) {
    s->error = "the loss became " + std::string(std::isnan(r.loss) ? "nan" : "inf") + " at step " + std::to_string(r.step) +
               " (lr " + vktrain::real(r.lr) + ")";
    return VKTRAIN_DIVERGED;
  }
  return status;
}

vktrain_status vktrain_get_record(vktrain_session* s, int64_t step, vktrain_step_result* result) {
  return call(s, [&](vktrain::Session& session) {
    need(result, "result");
    if (step < 1 || step > session.steps_done())
      argument("step " + std::to_string(step) + " is not one of the run's steps 1.." + std::to_string(session.steps_done()));
    const vktrain::CheckpointRecord& r = session.records()[size_t(step - 1)];
    deliver(result, step_result(r, session.gpu_seconds(step)), kStepResultV2, "result");
  });
}

size_t vktrain_state_count(const vktrain_session* s) { return s ? s->states.size() : 0; }

vktrain_status vktrain_state_info(vktrain_session* s, size_t index, vktrain_tensor_info* info) {
  return call(s, [&](vktrain::Session&) {
    need(info, "info");
    if (index >= s->states.size()) argument("state index " + std::to_string(index) + " is past the program's " + std::to_string(s->states.size()) + " state tensors");
    fill_info(*s->states[index], s->state_names[index], info);
  });
}

vktrain_status vktrain_find_state(vktrain_session* s, const char* name, vktrain_tensor_info* info) {
  return call(s, [&](vktrain::Session&) {
    need(info, "info");
    size_t at = find(s->state_names, name, "state");
    fill_info(*s->states[at], s->state_names[at], info);
  });
}

vktrain_status vktrain_read_state(vktrain_session* s, const char* name, void* data, size_t nbytes) {
  return call(s, [&](vktrain::Session& session) {
    size_t at = find(s->state_names, name, "state");
    const vktrain::TensorValue& t = *s->states[at];
    if (nbytes != t.nbytes())
      argument("state '" + s->state_names[at] + "' is " + std::to_string(t.nbytes()) + " bytes, the buffer " + std::to_string(nbytes));
    need(data, "data");
    HostTensor value = session.interpreter().read_state(s->state_names[at]);
    std::memcpy(data, value.data.data(), nbytes);
  });
}

vktrain_status vktrain_write_state(vktrain_session* s, const char* name, const void* data, size_t nbytes) {
  return call(s, [&](vktrain::Session& session) {
    size_t at = find(s->state_names, name, "state");
    HostTensor value = host_tensor(*s->states[at], "state '" + s->state_names[at] + "'", vktrain_dtype(s->states[at]->dtype),
                                   data, nbytes);
    session.interpreter().write_state(s->state_names[at], value);
  });
}

vktrain_status vktrain_save_checkpoint(vktrain_session* s, const char* path) {
  return call(s, [&](vktrain::Session& session) {
    need(path, "path");
    session.save_checkpoint(path);
  });
}

vktrain_status vktrain_load_checkpoint(vktrain_session* s, const char* path) {
  return call(s, [&](vktrain::Session& session) {
    need(path, "path");
    session.load_checkpoint(path);
  });
}

void vktrain_adapter_options_init(vktrain_adapter_options* options) {
  if (!options) return;
  std::memset(options, 0, sizeof *options);
  options->size = sizeof *options;
}

vktrain_status vktrain_save_adapters(vktrain_session* s, const char* directory, const vktrain_adapter_options* options) {
  return call(s, [&](vktrain::Session& session) {
    need(directory, "directory");
    vktrain_adapter_options o;
    vktrain_adapter_options_init(&o);
    if (options) std::memcpy(&o, options, option_bytes(options->size, sizeof o, "vktrain_adapter_options"));
    vktrain::AdapterOptions a;
    a.lora_alpha = o.lora_alpha;
    a.base_model = o.base_model;
    session.save_adapters(directory, a);
  });
}

}  // extern "C"
