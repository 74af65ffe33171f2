#include "train_data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "status.h"
#include "text.h"

namespace vktrain {

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
  if (kind != "constant" && kind != "cosine") return "--schedule must be constant or cosine, got '" + kind + "'";
  if (!(std::isfinite(lr32) && lr32 > 0)) return "the learning rate must be a positive finite float32, got " + real(base_lr);
  if (total_steps <= 0) return "the number of steps must be positive, got " + num(total_steps);
  if (warmup_steps < 0) return "warmup steps must be >= 0, got " + num(warmup_steps);
  if (kind == "cosine" && warmup_steps >= total_steps)
    return "cosine schedule: warmup (" + num(warmup_steps) + " steps) must be shorter than the run (" + num(total_steps) + " steps)";
  if (!(min_lr_ratio >= 0 && min_lr_ratio <= 1)) return "min LR ratio must lie in [0, 1], got " + real(min_lr_ratio);
  return "";
}

}  // namespace vktrain
