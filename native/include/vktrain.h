/* vktrain's C API (issue 26): train a vktrain training-step .pte on a Vulkan device from C, C++, Java (JNI),
 * Swift or Objective-C, with no Python. A thin layer over the native runtime in native/src (the .pte loader
 * and verifier, the schedule interpreter): the same steps, bit for bit, as `vktrain train` and vktrain-train.
 *
 *   vktrain_session* s;
 *   if (vktrain_open("step.pte", NULL, &s) != VKTRAIN_OK) { fprintf(stderr, "%s\n", vktrain_last_error(NULL)); ... }
 *   vktrain_run_config run;
 *   vktrain_run_config_init(&run);                        (vktrain train's defaults)
 *   run.lr = 2e-3f; run.total_steps = 100;
 *   vktrain_start_run(s, tokens, n_tokens, &run);          (the token stream, batched as vktrain train batches it)
 *   for (int t = 0; t < 100; ++t) { vktrain_step_result r; vktrain_train_step(s, &r); ... r.loss ... }
 *   vktrain_save_adapters(s, "adapters", NULL);            (PEFT: adapter_model.safetensors + adapter_config.json)
 *   vktrain_close(s);
 *
 * Every call returns a vktrain_status; on failure vktrain_last_error(session) is the message (what was refused
 * and why: the file, the input, the name). A session is used by one thread at a time; different sessions are
 * independent. Strings and tensor shapes the API returns stay valid until vktrain_close.
 * Option structs carry their own size (set by their _init function): always call it first, so a program
 * compiled against this header keeps working when later versions append fields.
 * Output structs (vktrain_session_info, vktrain_tensor_info, vktrain_step_result) carry one too: set `size` to
 * sizeof the struct before the call (VKTRAIN_OUTPUT(type, name) declares one so). The library fills that many
 * bytes: a program built against an older header (a smaller size) gets the fields it knows; a size larger than
 * this library's struct (a newer header than the library) or smaller than the first version's is refused with
 * VKTRAIN_ERROR_ARGUMENT, nothing written past what the caller declared. */
#ifndef VKTRAIN_H_
#define VKTRAIN_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define VKTRAIN_API __attribute__((visibility("default")))
#else
#define VKTRAIN_API
#endif

/* 2: output structs start with `size`; vktrain_step_result.gpu_seconds. */
#define VKTRAIN_API_VERSION 2

/* Declares an output struct with its size set: VKTRAIN_OUTPUT(vktrain_step_result, r); vktrain_train_step(s, &r); */
#ifdef __cplusplus
#define VKTRAIN_OUTPUT(type, name) \
  type name{};                     \
  name.size = sizeof(type)
#else
#define VKTRAIN_OUTPUT(type, name) type name = {.size = sizeof(type)}
#endif

typedef struct vktrain_session vktrain_session; /* opaque */

/* 0 is success; 10..20 refuse bad input (the same codes as `vktrain-native-inspect` prints); 70 is a bug. */
typedef enum vktrain_status {
  VKTRAIN_OK = 0,
  VKTRAIN_DIVERGED = 1,              /* the step's loss is not finite (the state holds its update: reload a checkpoint) */
  VKTRAIN_ERROR_IO = 10,             /* a file cannot be opened, read or written */
  VKTRAIN_ERROR_PTE_FORMAT = 11,     /* not a readable .pte */
  VKTRAIN_ERROR_BLOB_FORMAT = 12,    /* the vktrain delegate blob is malformed */
  VKTRAIN_ERROR_BLOB_CHECKSUM = 13,  /* a CRC-32 of the blob does not match */
  VKTRAIN_ERROR_VERIFICATION = 14,   /* inconsistent: the program, or an input, state or checkpoint that does not fit it */
  VKTRAIN_ERROR_UNSUPPORTED = 15,    /* well formed, but not a program (or device) this runtime runs */
  VKTRAIN_ERROR_LIMIT = 16,          /* asks for more memory than there is */
  VKTRAIN_ERROR_SCHEDULE_FORMAT = 17,/* not a readable dispatch schedule */
  VKTRAIN_ERROR_SHADER_MODULE = 18,  /* a shader module is missing, or does not match its dispatches */
  VKTRAIN_ERROR_DEVICE = 19,         /* no usable Vulkan device, or a Vulkan call failed (out of memory, device lost) */
  VKTRAIN_ERROR_ARGUMENT = 20,       /* a call's argument: a NULL pointer, an unknown name, a wrong size, a wrong order */
  VKTRAIN_ERROR_INTERNAL = 70
} vktrain_status;

/* The graph's dtypes (vktrain/serialization/schema.fbs DataType). */
typedef enum vktrain_dtype {
  VKTRAIN_FLOAT32 = 0, VKTRAIN_FLOAT16 = 1, VKTRAIN_INT32 = 2, VKTRAIN_INT64 = 3, VKTRAIN_UINT8 = 4,
  VKTRAIN_UINT32 = 5, VKTRAIN_BOOL = 6, VKTRAIN_INT8 = 7, VKTRAIN_BFLOAT16 = 8
} vktrain_dtype;

VKTRAIN_API const char* vktrain_status_name(vktrain_status status); /* "VKTRAIN_ERROR_IO", ... */
/* The message of the last failed call on `session` ("" when none failed); with NULL, of the calling thread's
 * last failed call without a session (vktrain_open, vktrain_open_bytes, vktrain_schedule_lr). */
VKTRAIN_API const char* vktrain_last_error(const vktrain_session* session);

/* ---- open, close ------------------------------------------------------------------------------------ */
typedef struct vktrain_open_options {
  uint32_t size;             /* sizeof(vktrain_open_options), set by vktrain_open_options_init */
  int32_t device_index;      /* the Vulkan physical device's index; -1: $VKTRAIN_DEVICE, else the best one */
  const char* device_name;   /* non-NULL: the device whose name contains it (instead of device_index) */
  int32_t staging;           /* nonzero: host access through staging copies (a discrete GPU's path) everywhere */
  const char* schedule_file; /* non-NULL (with spirv_dir): a dispatch schedule file instead of the embedded one */
  const char* spirv_dir;
  const char* schedule_profile; /* non-NULL: the schedule embedded for this device profile (`vktrain export --target`),
                                   refused where the device does not satisfy it; NULL: the matching rule's choice */
} vktrain_open_options;
VKTRAIN_API void vktrain_open_options_init(vktrain_open_options* options);

/* Loads and verifies the .pte, opens the device, chooses the embedded schedule that fits it (`vktrain export
 * --target`), allocates, uploads the constants and records the step once. `options` may be NULL. On failure
 * *session is NULL and vktrain_last_error(NULL) says why. */
VKTRAIN_API vktrain_status vktrain_open(const char* pte_path, const vktrain_open_options* options, vktrain_session** session);
/* The same from `size` bytes in memory (an app's asset; copied); `name` stands for the file in messages. */
VKTRAIN_API vktrain_status vktrain_open_bytes(const void* data, size_t size, const char* name,
                                              const vktrain_open_options* options, vktrain_session** session);
VKTRAIN_API void vktrain_close(vktrain_session* session); /* NULL is ignored */

/* ---- what the program is -------------------------------------------------------------------------- */
typedef struct vktrain_tensor_info {
  uint32_t size;        /* sizeof(vktrain_tensor_info), set by the caller */
  const char* name;
  vktrain_dtype dtype;
  size_t ndim;
  const int64_t* shape; /* ndim sizes */
  uint64_t nbytes;      /* bytes of the whole tensor in `dtype`, C order */
} vktrain_tensor_info;

typedef struct vktrain_session_info {
  uint32_t size;               /* sizeof(vktrain_session_info), set by the caller */
  const char* program;         /* the .pte as given */
  const char* device_name;
  const char* schedule;        /* where the dispatch schedule came from */
  uint64_t dispatches, barriers, buffer_bytes;
  int64_t batch_size, seq_len; /* of a token step's token_ids [batch, seq]; 0 for other programs */
  int64_t vocab_size;          /* token ids must lie in [0, vocab_size); 0: no bound */
  int64_t step;                /* optimizer steps done (vktrain_step, vktrain_train_step, a loaded checkpoint) */
  uint64_t n_windows;          /* windows of the run's token stream (vktrain_start_run); 0 before */
  double lora_alpha;           /* the LoRA alpha the .pte records (vktrain export); 0: none */
} vktrain_session_info;
VKTRAIN_API vktrain_status vktrain_get_info(vktrain_session* session, vktrain_session_info* info);

VKTRAIN_API size_t vktrain_input_count(const vktrain_session* session);
VKTRAIN_API vktrain_status vktrain_input_info(vktrain_session* session, size_t index, vktrain_tensor_info* info);

/* ---- one step ----------------------------------------------------------------------------------------- */
/* The step's hyper-parameters, as the program takes them: float32 [lr, beta1, beta2, eps, weight_decay]. */
typedef struct vktrain_hparams {
  float lr, beta1, beta2, eps, weight_decay;
} vktrain_hparams;
VKTRAIN_API void vktrain_hparams_init(vktrain_hparams* hparams); /* lr 1e-3 and AdamW's defaults (0.9, 0.999, 1e-8, 0.01) */

typedef struct vktrain_input {
  const char* name;    /* an input of the program (vktrain_input_info) */
  vktrain_dtype dtype; /* the input's dtype */
  const void* data;    /* C order */
  size_t nbytes;       /* the input's whole size */
} vktrain_input;

/* One optimizer step on named inputs. "hparams" is taken from `hparams` (NULL only for a program without that
 * input: its hyper-parameters baked in) and "n_valid" is the count of labels >= 0 unless given among `inputs`;
 * every other input must be given. *loss: the step's loss. */
VKTRAIN_API vktrain_status vktrain_step(vktrain_session* session, const vktrain_input* inputs, size_t count,
                                        const vktrain_hparams* hparams, float* loss);
/* One step of a token program: token_ids and labels int64 [batch * seq] (labels < 0 train nothing). */
VKTRAIN_API vktrain_status vktrain_step_tokens(vktrain_session* session, const int64_t* token_ids, const int64_t* labels,
                                               const vktrain_hparams* hparams, float* loss);

/* ---- a training run, as `vktrain train` runs it --------------------------------------------------------- */
typedef struct vktrain_run_config {
  uint32_t size;         /* sizeof(vktrain_run_config), set by vktrain_run_config_init */
  const char* schedule;  /* "cosine" (default) or "constant" */
  double lr;             /* the base learning rate (1e-3) */
  int64_t total_steps;   /* the run's length: the cosine schedule ends here (required, > 0) */
  int64_t warmup_steps;  /* linear warmup from 0 (0) */
  double min_lr_ratio;   /* the cosine floor as a fraction of lr (0) */
  double beta1, beta2, eps, weight_decay; /* AdamW (0.9, 0.999, 1e-8, 0.01) */
  uint32_t seed;         /* the batch order's seed (0) */
  int32_t shuffle;       /* nonzero (default): each epoch in splitmix64 order; 0: file order */
  const char* data_name; /* names the token stream in messages ("tokens") */
} vktrain_run_config;
VKTRAIN_API void vktrain_run_config_init(vktrain_run_config* config);

/* The learning rate of step `step` (1-based) of the schedule in `config` (vktrain train's, in double). It takes
 * no session: on failure vktrain_last_error(NULL) says why. */
VKTRAIN_API vktrain_status vktrain_schedule_lr(const vktrain_run_config* config, int64_t step, double* lr);

/* Starts a run on a token stream (copied; every id must lie in the vocabulary): batch p is windows p*B..p*B+B-1
 * of vktrain train's TokenBatcher. The next vktrain_train_step is step info.step + 1. */
VKTRAIN_API vktrain_status vktrain_start_run(vktrain_session* session, const int64_t* tokens, size_t count,
                                             const vktrain_run_config* config);

typedef struct vktrain_step_result {
  uint32_t size;      /* sizeof(vktrain_step_result), set by the caller */
  int64_t step;       /* 1-based */
  float loss;
  double lr;          /* the schedule's (the program got it as float32) */
  double seconds;     /* wall time of the step (inputs written, the GPU's work, outputs read) */
  double gpu_seconds; /* the GPU's time for the step's commands (timestamps); 0 where the queue has none, and for
                         steps restored from a checkpoint */
} vktrain_step_result;
/* The run's next step: its batch, its learning rate, one optimizer step. VKTRAIN_DIVERGED when the loss is not
 * finite (nothing is recorded; the last checkpoint is the last good state). */
VKTRAIN_API vktrain_status vktrain_train_step(vktrain_session* session, vktrain_step_result* result);
/* The record of step `step` (1..info.step) of this run, a resumed checkpoint's included. */
VKTRAIN_API vktrain_status vktrain_get_record(vktrain_session* session, int64_t step, vktrain_step_result* result);

/* ---- state ------------------------------------------------------------------------------------------- */
/* The program's mutable state (LoRA adapters "model.<module>.lora_A", AdamW moments, "optimizer.step"). */
VKTRAIN_API size_t vktrain_state_count(const vktrain_session* session);
VKTRAIN_API vktrain_status vktrain_state_info(vktrain_session* session, size_t index, vktrain_tensor_info* info);
VKTRAIN_API vktrain_status vktrain_find_state(vktrain_session* session, const char* name, vktrain_tensor_info* info);
/* Copy out / in, `nbytes` must be the tensor's (vktrain_tensor_info.nbytes). */
VKTRAIN_API vktrain_status vktrain_read_state(vktrain_session* session, const char* name, void* data, size_t nbytes);
VKTRAIN_API vktrain_status vktrain_write_state(vktrain_session* session, const char* name, const void* data, size_t nbytes);

/* ---- files -------------------------------------------------------------------------------------------- */
/* vktrain train's checkpoint (safetensors, "vktrain-checkpoint" version 2), written atomically: the state, the
 * step, the run's records, data order and settings. A checkpoint of either runtime resumes in the other. */
VKTRAIN_API vktrain_status vktrain_save_checkpoint(vktrain_session* session, const char* path);
/* Restores state, step and records after checking the checkpoint (checksums; the same program; with a started
 * run, the same token stream and batching; the run continues in the checkpoint's data order). */
VKTRAIN_API vktrain_status vktrain_load_checkpoint(vktrain_session* session, const char* path);

typedef struct vktrain_adapter_options {
  uint32_t size;          /* sizeof(vktrain_adapter_options), set by vktrain_adapter_options_init */
  double lora_alpha;      /* 0: the alpha the .pte recorded at export */
  const char* base_model; /* NULL: the recorded base_model_name_or_path (else the source model, else null) */
} vktrain_adapter_options;
VKTRAIN_API void vktrain_adapter_options_init(vktrain_adapter_options* options);
/* The PEFT adapter directory `vktrain train --out-adapters` writes (adapter_model.safetensors,
 * adapter_config.json), created if needed. `options` may be NULL. */
VKTRAIN_API vktrain_status vktrain_save_adapters(vktrain_session* session, const char* directory,
                                                 const vktrain_adapter_options* options);

#ifdef __cplusplus
}
#endif

#endif /* VKTRAIN_H_ */
