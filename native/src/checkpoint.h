// `vktrain train`'s checkpoint file (vktrain/train/checkpoint.py; format "vktrain-checkpoint" version 2): one
// safetensors file, every mutable state tensor by name, and the metadata a resume checks (step, data_position,
// program_sha256, data_sha256, data_seed, config, records, per-tensor checksums). Written here and read back
// in the same format, so a checkpoint of one runtime resumes in the other.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "interpreter.h"
#include "train_data.h"

namespace vktrain {

std::string sha256_file(const std::string& path);
std::string sha256_bytes(const uint8_t* data, size_t size);
// TokenBatcher.fingerprint: sha256 of the batching parameters and the tokens as little-endian int64.
std::string batcher_fingerprint(const std::vector<int64_t>& tokens, int64_t batch, int64_t seq, bool shuffle);

struct CheckpointRecord { int64_t step = 0; double loss = 0, lr = 0, seconds = 0; };

struct Checkpoint {
  int64_t step = 0, data_position = 0, data_seed = 0;
  std::string program_sha256, data_sha256, config_json;
  std::vector<CheckpointRecord> records;
  std::map<std::string, HostTensor> tensors;
};

// checkpoint.py tensor_checksum: sha256 of "<numpy dtype str>:<shape as a Python list>:" and the bytes.
std::string tensor_checksum(const HostTensor& t);
// train_loop.py run_config as JSON (sorted keys): the LR schedule, AdamW (as given) and the batching.
std::string run_config_json(const LRSchedule& lr, const double adamw[4], int64_t batch, int64_t seq, bool shuffle);
// Atomic write (temporary file in the same directory, fsync, rename).
void save_checkpoint(const std::string& path, const Checkpoint& checkpoint);
// checkpoint.py load_checkpoint's checks; LoadError kVerification / kIo naming `path`.
Checkpoint load_checkpoint(const std::string& path);

}  // namespace vktrain
