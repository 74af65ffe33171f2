#include "train_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "file_map.h"
#include "status.h"
#include "text.h"

namespace vktrain {

std::vector<int64_t> load_npy_tokens(const std::string& path) {
  FileMap map(path);
  Bytes b = map.bytes();
  auto bad = [&](const std::string& why) { refuse(ErrorCode::kVerification, path + ": " + why); };
  if (b.size < 10 || std::memcmp(b.data, "\x93NUMPY", 6) != 0) bad("not a .npy file (no \\x93NUMPY magic)");
  uint8_t major = b.data[6];
  size_t header_len, start;
  if (major == 1) { header_len = size_t(b.data[8] | b.data[9] << 8); start = 10; }
  else if (major == 2 || major == 3) {
    if (b.size < 12) bad("truncated .npy header");
    header_len = le32(b.data + 8); start = 12;
  } else bad("unknown .npy format version " + num(int(major)));
  if (header_len > b.size - start) bad("truncated .npy header");
  std::string header(reinterpret_cast<const char*>(b.data + start), header_len);
  auto field = [&](const std::string& key) {
    size_t at = header.find("'" + key + "'");
    if (at == std::string::npos) bad("the .npy header has no '" + key + "'");
    size_t colon = header.find(':', at);
    if (colon == std::string::npos) bad("malformed .npy header");
    size_t v = header.find_first_not_of(' ', colon + 1);
    return v == std::string::npos ? std::string() : header.substr(v);
  };
  std::string descr = field("descr"), order = field("fortran_order"), shape = field("shape");
  if (descr.size() < 5 || descr[0] != '\'') bad("malformed dtype in the .npy header");
  std::string dtype = descr.substr(1, descr.find('\'', 1) - 1);
  if (order.rfind("False", 0) != 0) bad("token ids must be a C-order array");
  if (dtype.size() < 3 || (dtype[0] != '<' && dtype[0] != '|') || (dtype[1] != 'i' && dtype[1] != 'u'))
    bad("token ids must be a little-endian integer array, got dtype '" + dtype + "'");
  int width = std::atoi(dtype.c_str() + 2);
  if (width != 1 && width != 2 && width != 4 && width != 8) bad("unsupported integer width in dtype '" + dtype + "'");
  bool is_signed = dtype[1] == 'i';
  // shape "(N,)": one dimension
  size_t open = shape.find('('), close = shape.find(')');
  std::string dims = open == std::string::npos || close == std::string::npos ? "" : shape.substr(open + 1, close - open - 1);
  if (dims.empty() || dims.find(',') == std::string::npos || dims.find_first_of("0123456789") == std::string::npos ||
      dims.find(',', dims.find(',') + 1) != std::string::npos ||
      dims.find_first_of("0123456789", dims.find(',')) != std::string::npos)
    bad("token ids must be a 1-D array (one stream), got shape (" + dims + ")");
  uint64_t n = std::strtoull(dims.c_str(), nullptr, 10);
  size_t data_start = start + header_len;
  if (n > (b.size - data_start) / width) bad("the file holds fewer than the " + num(n) + " tokens its header declares");
  std::vector<int64_t> out(n);
  const uint8_t* p = b.data + data_start;
  for (uint64_t i = 0; i < n; ++i, p += width) {
    uint64_t raw = 0;
    for (int k = 0; k < width; ++k) raw |= uint64_t(p[k]) << (8 * k);
    if (is_signed && width < 8 && (raw >> (8 * width - 1)) & 1) raw |= ~uint64_t(0) << (8 * width);
    if (!is_signed && width == 8 && raw > uint64_t(INT64_MAX)) bad("token id " + num(raw) + " at position " + num(i) + " does not fit int64");
    out[i] = int64_t(raw);
  }
  return out;
}

uint64_t splitmix64(uint64_t z) {  // data.py _splitmix64 (wrapping arithmetic)
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::vector<uint64_t> epoch_order(uint64_t n_windows, uint32_t seed, uint64_t epoch) {
  uint64_t base = splitmix64(uint64_t(seed) << 32 | (epoch & 0xFFFFFFFFull));
  std::vector<uint64_t> keys(n_windows), order(n_windows);
  for (uint64_t i = 0; i < n_windows; ++i) keys[i] = splitmix64(i ^ base);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return keys[a] < keys[b]; });
  return order;
}

TokenBatcher::TokenBatcher(std::vector<int64_t> tokens, uint64_t batch, uint64_t seq, uint32_t seed, bool shuffle,
                           const std::string& source)
    : tokens_(std::move(tokens)), batch_(batch), seq_(seq), seed_(seed), shuffle_(shuffle) {
  if (!batch || !seq) refuse(ErrorCode::kVerification, "batch size and sequence length must be positive");
  n_windows_ = tokens_.empty() ? 0 : (tokens_.size() - 1) / seq;
  if (n_windows_ < batch)
    refuse(ErrorCode::kVerification, source + " is too short for one batch: " + num(tokens_.size()) + " tokens make " +
                                         num(n_windows_) + " window(s) of " + num(seq) + " + 1 tokens, a batch of " + num(batch) +
                                         " x " + num(seq) + " needs " + num(batch) + " windows (at least " + num(batch * seq + 1) + " tokens)");
}

void TokenBatcher::batch(uint64_t position, std::vector<int64_t>* tokens, std::vector<int64_t>* labels) {
  tokens->resize(batch_ * seq_);
  labels->resize(batch_ * seq_);
  for (uint64_t row = 0; row < batch_; ++row) {
    uint64_t flat = position * batch_ + row, epoch = flat / n_windows_, within = flat % n_windows_;
    uint64_t window = within;
    if (shuffle_) {
      if (cached_epoch_ != int64_t(epoch)) {
        order_ = epoch_order(n_windows_, seed_, epoch);
        cached_epoch_ = int64_t(epoch);
      }
      window = order_[within];
    }
    const int64_t* w = &tokens_[window * seq_];
    for (uint64_t s = 0; s < seq_; ++s) {
      (*tokens)[row * seq_ + s] = w[s];
      (*labels)[row * seq_ + s] = w[s + 1];
    }
  }
}

double LRSchedule::lr(int64_t step) const {  // lr_schedule.py LRSchedule.lr, in double
  if (step <= warmup_steps) return base_lr * double(step) / double(warmup_steps);
  if (kind == "constant") return base_lr;
  double floor = base_lr * min_lr_ratio;
  double progress = std::min(1.0, double(step - warmup_steps) / double(total_steps + 1 - warmup_steps));
  return floor + (base_lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

std::string LRSchedule::check() const {
  float lr32 = float(base_lr);
  if (kind != "constant" && kind != "cosine") return "the learning-rate schedule must be constant or cosine, got '" + kind + "'";
  if (!(std::isfinite(lr32) && lr32 > 0)) return "the learning rate must be a positive finite float32, got " + real(base_lr);
  if (total_steps <= 0) return "the number of steps must be positive, got " + num(total_steps);
  if (warmup_steps < 0) return "warmup steps must be >= 0, got " + num(warmup_steps);
  if (kind == "cosine" && warmup_steps >= total_steps)
    return "cosine schedule: warmup (" + num(warmup_steps) + " steps) must be shorter than the run (" + num(total_steps) + " steps)";
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1)) return "min LR ratio must lie in [0, 1], got " + real(min_lr_ratio);
  return "";
}

}  // namespace vktrain
