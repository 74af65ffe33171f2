// What `vktrain train` feeds a step, natively: a token stream's position-addressed batches (TokenBatcher: windows of S + 1 tokens every S tokens, each epoch's order a
// stable sort of splitmix64 keys of (seed, epoch)), and the learning rate of each step (lr_schedule.py
// LRSchedule). Pure functions of their arguments, bit for bit those of the Python code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vktrain {

uint64_t splitmix64(uint64_t value);
std::vector<uint64_t> epoch_order(uint64_t n_windows, uint32_t seed, uint64_t epoch);

class TokenBatcher {
 public:
  TokenBatcher(std::vector<int64_t> tokens, uint64_t batch, uint64_t seq, uint32_t seed, bool shuffle,
               const std::string& source);
  // (tokens, labels), both int64 [B * S] in C order, of batch number `position`.
  void batch(uint64_t position, std::vector<int64_t>* tokens, std::vector<int64_t>* labels);
  uint64_t n_windows() const { return n_windows_; }
  void reseed(uint32_t seed) { seed_ = seed; cached_epoch_ = -1; }  // a resumed run's data order

 private:
  std::vector<int64_t> tokens_;
  uint64_t batch_, seq_, n_windows_;
  uint32_t seed_;
  bool shuffle_;
  int64_t cached_epoch_ = -1;
  std::vector<uint64_t> order_;
};

struct LRSchedule {
  std::string kind = "cosine";  // "constant" or "cosine"
  double base_lr = 1e-3;
  int64_t total_steps = 1, warmup_steps = 0;
  double min_lr_ratio = 0;
  double lr(int64_t step) const;  // 1-based
  std::string check() const;      // "" when usable, else what is wrong
};

}  // namespace vktrain
