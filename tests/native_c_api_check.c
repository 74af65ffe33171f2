/* A C program on libvktrain.so (native/include/vktrain.h), driven by tests/test_native_api.py:
 *
 *   native_c_api_check STEP.pte TOKENS.i64 BATCHES.i64 STEPS OUT_DIR
 *
 * TOKENS.i64: the token stream (raw little-endian int64); BATCHES.i64: vktrain train's batches 1..STEPS of it
 * (token_ids then labels, [batch * seq] int64 each), made by the Python TokenBatcher. It prints one line per
 * result for the test to compare with the Python runtime (`vktrain train`):
 *   run T LOSS_BITS LR      a run (vktrain_start_run + vktrain_train_step) from the path
 *   manual T LOSS_BITS      the same steps from the .pte's bytes (device 0, staging copies), batches and float32
 *                           hparams given by the caller
 *   state NAME DTYPE NBYTES OFFSET   the run's final state, in OUT_DIR/state.bin at OFFSET
 * and writes OUT_DIR/checkpoint.safetensors and OUT_DIR/adapters/. What it checks itself (exit 1 naming it):
 * the manual session ends in the run's state bit for bit; a fresh session given that state by
 * vktrain_write_state takes the manual session's next step, and one resumed from the checkpoint the run's; bad calls are refused
 * with their status and a message naming what is wrong; an output struct's size is honoured: a larger (unknown) one, an
 * unset one and one below the first version's are refused with nothing written, and no more than its bytes are written. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "vktrain.h"

static int failures = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAILED line %d: ", __LINE__);       \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      failures++;                                          \
    }                                                      \
  } while (0)

static void must(vktrain_status status, const vktrain_session* s, const char* what) {
  if (status != VKTRAIN_OK) {
    fprintf(stderr, "%s: %s: %s\n", what, vktrain_status_name(status), vktrain_last_error(s));
    exit(2);
  }
}

static void* read_file(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  void* data;
  long n;
  if (!f || fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
    fprintf(stderr, "cannot read %s\n", path);
    exit(2);
  }
  data = malloc((size_t)n + 1);
  if (!data || fread(data, 1, (size_t)n, f) != (size_t)n) {
    fprintf(stderr, "cannot read %s\n", path);
    exit(2);
  }
  fclose(f);
  *size = (size_t)n;
  return data;
}

static unsigned bits(float f) {
  unsigned u;
  memcpy(&u, &f, 4);
  return u;
}

/* Every state tensor of `s`, concatenated in state order (malloc'ed; *size its bytes). */
static unsigned char* all_state(vktrain_session* s, size_t* size) {
  size_t i, total = 0, at = 0;
  unsigned char* out;
  VKTRAIN_OUTPUT(vktrain_tensor_info, info);
  for (i = 0; i < vktrain_state_count(s); ++i) {
    must(vktrain_state_info(s, i, &info), s, "vktrain_state_info");
    total += (size_t)info.nbytes;
  }
  out = malloc(total + 1);
  for (i = 0; i < vktrain_state_count(s); ++i) {
    must(vktrain_state_info(s, i, &info), s, "vktrain_state_info");
    must(vktrain_read_state(s, info.name, out + at, (size_t)info.nbytes), s, "vktrain_read_state");
    at += (size_t)info.nbytes;
  }
  *size = total;
  return out;
}

int main(int argc, char** argv) {
  vktrain_session *run, *manual, *written, *resumed, *none = NULL;
  VKTRAIN_OUTPUT(vktrain_session_info, info);
  VKTRAIN_OUTPUT(vktrain_tensor_info, tensor);
  vktrain_run_config config;
  VKTRAIN_OUTPUT(vktrain_step_result, result);
  VKTRAIN_OUTPUT(vktrain_step_result, next);
  vktrain_hparams hparams;
  vktrain_adapter_options adapter_options;
  vktrain_open_options options;
  size_t token_bytes, batch_bytes, pte_bytes, state_bytes, other_bytes, i, n, at;
  int64_t *tokens, *batches, t, steps;
  unsigned char *state, *other;
  void* pte;
  char path[4096];
  float loss, run_losses[64], next_loss, again;
  FILE* out;
  vktrain_status status;

  if (argc != 6) {
    fprintf(stderr, "usage: %s STEP.pte TOKENS.i64 BATCHES.i64 STEPS OUT_DIR\n", argv[0]);
    return 2;
  }
  tokens = read_file(argv[2], &token_bytes);
  batches = read_file(argv[3], &batch_bytes);
  steps = atoll(argv[4]);
  if (steps < 1 || steps > 63) return 2;

  /* A run, from the path: vktrain train's batches, schedule and AdamW. */
  must(vktrain_open(argv[1], NULL, &run), NULL, "vktrain_open");
  vktrain_run_config_init(&config);
  config.lr = 3e-3;
  config.total_steps = steps;
  config.warmup_steps = 2;
  config.min_lr_ratio = 0.1;
  config.beta1 = 0.85;
  config.weight_decay = 0.05;
  config.seed = 7;
  must(vktrain_start_run(run, tokens, token_bytes / 8, &config), run, "vktrain_start_run");
  must(vktrain_get_info(run, &info), run, "vktrain_get_info");
  printf("info %s %lld %lld %lld %llu\n", info.device_name, (long long)info.batch_size, (long long)info.seq_len,
         (long long)info.vocab_size, (unsigned long long)info.n_windows);
  CHECK(info.lora_alpha == 6.0 && info.step == 0, "info: lora_alpha %g, step %lld", info.lora_alpha, (long long)info.step);
  n = (size_t)(info.batch_size * info.seq_len);
  CHECK(batch_bytes == (size_t)steps * 2 * n * 8, "BATCHES holds %zu bytes", batch_bytes);
  for (t = 1; t <= steps; ++t) {
    must(vktrain_train_step(run, &result), run, "vktrain_train_step");
    CHECK(result.step == t, "step %lld numbered %lld", (long long)t, (long long)result.step);
    run_losses[t] = result.loss;
    printf("run %lld 0x%08x %.17g\n", (long long)t, bits(result.loss), result.lr);
  }
  must(vktrain_get_record(run, 2, &result), run, "vktrain_get_record");
  CHECK(result.step == 2 && bits(result.loss) == bits(run_losses[2]), "record 2 is not step 2's");
  snprintf(path, sizeof path, "%s/checkpoint.safetensors", argv[5]);
  must(vktrain_save_checkpoint(run, path), run, "vktrain_save_checkpoint");
  snprintf(path, sizeof path, "%s/adapters", argv[5]);
  vktrain_adapter_options_init(&adapter_options);  /* lora_alpha 0, base_model NULL: as the .pte records them */
  must(vktrain_save_adapters(run, path, &adapter_options), run, "vktrain_save_adapters");
  state = all_state(run, &state_bytes);
  snprintf(path, sizeof path, "%s/state.bin", argv[5]);
  out = fopen(path, "wb");
  if (!out || fwrite(state, 1, state_bytes, out) != state_bytes || fclose(out) != 0) return 2;
  for (i = 0, at = 0; i < vktrain_state_count(run); ++i) {
    must(vktrain_state_info(run, i, &tensor), run, "vktrain_state_info");
    printf("state %s %d %llu %zu\n", tensor.name, (int)tensor.dtype, (unsigned long long)tensor.nbytes, at);
    at += (size_t)tensor.nbytes;
  }

  /* The same steps from the .pte's bytes, inputs by name (labels first) and through vktrain_step_tokens. */
  pte = read_file(argv[1], &pte_bytes);
  vktrain_open_options_init(&options);  /* device 0 (the test's only one), host access through staging copies */
  options.device_index = 0;
  options.staging = 1;
  must(vktrain_open_bytes(pte, pte_bytes, "tiny.pte", &options, &manual), NULL, "vktrain_open_bytes");
  free(pte);
  for (t = 1; t <= steps; ++t) {
    const int64_t* ids = batches + (size_t)(t - 1) * 2 * n;
    const int64_t* labels = ids + n;
    double lr;
    must(vktrain_schedule_lr(&config, t, &lr), NULL, "vktrain_schedule_lr");
    hparams.lr = (float)lr;
    hparams.beta1 = (float)config.beta1;
    hparams.beta2 = (float)config.beta2;
    hparams.eps = (float)config.eps;
    hparams.weight_decay = (float)config.weight_decay;
    if (t % 2) {
      must(vktrain_step_tokens(manual, ids, labels, &hparams, &loss), manual, "vktrain_step_tokens");
    } else {
      vktrain_input inputs[2];
      inputs[0].name = "labels";
      inputs[0].dtype = VKTRAIN_INT64;
      inputs[0].data = labels;
      inputs[0].nbytes = n * 8;
      inputs[1].name = "token_ids";
      inputs[1].dtype = VKTRAIN_INT64;
      inputs[1].data = ids;
      inputs[1].nbytes = n * 8;
      must(vktrain_step(manual, inputs, 2, &hparams, &loss), manual, "vktrain_step");
    }
    printf("manual %lld 0x%08x\n", (long long)t, bits(loss));
  }
  other = all_state(manual, &other_bytes);
  CHECK(other_bytes == state_bytes && memcmp(state, other, state_bytes) == 0, "the manual session's state differs from the run's");
  free(other);

  /* State written by name into a fresh session, and the checkpoint loaded into another: one more step each
   * gives the run's next loss. */
  must(vktrain_open(argv[1], NULL, &written), NULL, "vktrain_open");
  for (i = 0, at = 0; i < vktrain_state_count(run); ++i) {
    must(vktrain_state_info(run, i, &tensor), run, "vktrain_state_info");
    must(vktrain_write_state(written, tensor.name, state + at, (size_t)tensor.nbytes), written, "vktrain_write_state");
    at += (size_t)tensor.nbytes;
  }
  other = all_state(written, &other_bytes);
  CHECK(memcmp(state, other, state_bytes) == 0, "state written by name does not read back the same");
  free(other);
  must(vktrain_open(argv[1], NULL, &resumed), NULL, "vktrain_open");
  snprintf(path, sizeof path, "%s/checkpoint.safetensors", argv[5]);
  must(vktrain_start_run(resumed, tokens, token_bytes / 8, &config), resumed, "vktrain_start_run");
  must(vktrain_load_checkpoint(resumed, path), resumed, "vktrain_load_checkpoint");
  must(vktrain_get_info(resumed, &info), resumed, "vktrain_get_info");
  CHECK(info.step == steps, "the checkpoint resumed at step %lld", (long long)info.step);
  must(vktrain_train_step(resumed, &result), resumed, "vktrain_train_step");
  CHECK(result.step == steps + 1, "the resumed step is %lld", (long long)result.step);
  must(vktrain_train_step(run, &next), run, "vktrain_train_step");
  CHECK(bits(result.loss) == bits(next.loss) && result.lr == next.lr, "resumed: 0x%08x, the run: 0x%08x",
        bits(result.loss), bits(next.loss));
  must(vktrain_step_tokens(manual, batches, batches + n, &hparams, &next_loss), manual, "vktrain_step_tokens");
  must(vktrain_step_tokens(written, batches, batches + n, &hparams, &again), written, "vktrain_step_tokens");
  CHECK(bits(again) == bits(next_loss) && isfinite(next_loss), "written state: 0x%08x, the run's: 0x%08x", bits(again), bits(next_loss));
  printf("resumed %lld 0x%08x\n", (long long)result.step, bits(result.loss));

  /* Refusals: a status and a message naming what is wrong. */
  status = vktrain_read_state(run, "model.no_such.lora_A", state, 4);
  CHECK(status == VKTRAIN_ERROR_ARGUMENT && strstr(vktrain_last_error(run), "'model.no_such.lora_A'"), "unknown state: %s %s",
        vktrain_status_name(status), vktrain_last_error(run));
  must(vktrain_state_info(run, 0, &tensor), run, "vktrain_state_info");
  status = vktrain_write_state(run, tensor.name, state, (size_t)tensor.nbytes + 4);
  CHECK(status == VKTRAIN_ERROR_ARGUMENT && strstr(vktrain_last_error(run), "bytes"), "wrong size: %s %s",
        vktrain_status_name(status), vktrain_last_error(run));
  {
    vktrain_input only_labels;
    only_labels.name = "labels";
    only_labels.dtype = VKTRAIN_INT32;
    only_labels.data = batches;
    only_labels.nbytes = n * 8;
    status = vktrain_step(run, &only_labels, 1, &hparams, &loss);
    CHECK(status == VKTRAIN_ERROR_ARGUMENT && strstr(vktrain_last_error(run), "INT64"), "wrong dtype: %s %s",
          vktrain_status_name(status), vktrain_last_error(run));
    only_labels.dtype = VKTRAIN_INT64;
    status = vktrain_step(run, &only_labels, 1, &hparams, &loss);
    CHECK(status == VKTRAIN_ERROR_VERIFICATION && strstr(vktrain_last_error(run), "'token_ids' is not given"),
          "missing input: %s %s", vktrain_status_name(status), vktrain_last_error(run));
  }
  {
    /* Output structs: a size larger than the library's (a newer header), unset or below the first version's is
     * refused, nothing written; a call writes no byte past the size the caller declares. */
    unsigned char bytes[sizeof(vktrain_step_result) + 16];
    vktrain_step_result* r = (vktrain_step_result*)bytes;
    vktrain_session_info before = info;
    memset(bytes, 0xAB, sizeof bytes);
    r->size = (uint32_t)sizeof(vktrain_step_result) + 8;
    status = vktrain_get_record(run, 1, r);
    CHECK(status == VKTRAIN_ERROR_ARGUMENT && strstr(vktrain_last_error(run), "newer than the library") && bytes[8] == 0xAB,
          "a larger result struct: %s %s", vktrain_status_name(status), vktrain_last_error(run));
    info.size = 0;
    status = vktrain_get_info(run, &info);
    CHECK(status == VKTRAIN_ERROR_ARGUMENT && strstr(vktrain_last_error(run), "info->size is 0") &&
          info.device_name == before.device_name, "an unset info size: %s %s", vktrain_status_name(status), vktrain_last_error(run));
    info.size = sizeof info;
    tensor.size = (uint32_t)sizeof tensor - 1;
    status = vktrain_state_info(run, 0, &tensor);
    CHECK(status == VKTRAIN_ERROR_ARGUMENT, "a tensor info smaller than the first version's: %s", vktrain_status_name(status));
    tensor.size = sizeof tensor;
    status = vktrain_train_step(run, r);  /* refused before the step runs: the run stays where it was */
    CHECK(status == VKTRAIN_ERROR_ARGUMENT, "a train step into a larger struct: %s", vktrain_status_name(status));
    must(vktrain_get_info(run, &info), run, "vktrain_get_info");
    CHECK(info.step == steps + 1, "a refused train step still stepped: step %lld", (long long)info.step);
    memset(bytes, 0xAB, sizeof bytes);
    r->size = (uint32_t)sizeof(vktrain_step_result);
    must(vktrain_get_record(run, 1, r), run, "vktrain_get_record");
    CHECK(r->step == 1 && bits(r->loss) == bits(run_losses[1]) && r->gpu_seconds >= 0 && bytes[sizeof(vktrain_step_result)] == 0xAB,
          "record 1 through a sized struct");
  }
  snprintf(path, sizeof path, "%s/absent.pte", argv[5]);
  status = vktrain_open(path, NULL, &none);
  CHECK(status == VKTRAIN_ERROR_IO && none == NULL && strstr(vktrain_last_error(NULL), path), "absent file: %s %s",
        vktrain_status_name(status), vktrain_last_error(NULL));
  status = vktrain_open_bytes("not a pte", 9, "junk.pte", NULL, &none);
  CHECK(status == VKTRAIN_ERROR_PTE_FORMAT && strstr(vktrain_last_error(NULL), "junk.pte"), "junk bytes: %s %s",
        vktrain_status_name(status), vktrain_last_error(NULL));

  vktrain_close(run);
  vktrain_close(manual);
  vktrain_close(written);
  vktrain_close(resumed);
  vktrain_close(NULL);
  free(state);
  free(tokens);
  free(batches);
  printf("failures %d\n", failures);
  return failures ? 1 : 0;
}
