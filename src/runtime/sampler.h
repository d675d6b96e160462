// Token sampling from logits. Order of operations follows llama.cpp's default chain: repetition penalty,
// top-k, top-p, min-p, temperature, then a draw from the seeded RNG. temperature <= 0 means greedy.
#pragma once
#include <cstdint>
#include <deque>
#include <vector>

#include "core/rng.h"
#include "runtime/row_sampling.h"

namespace merlin {

struct SamplerOptions {
  float temperature = 0.8f;
  int top_k = 40;             // <= 0: disabled
  float top_p = 0.95f;        // >= 1: disabled
  float min_p = 0.05f;        // <= 0: disabled
  float repeat_penalty = 1.0f;  // 1: disabled
  int repeat_last_n = 64;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& opts);
  int32_t sample(const float* logits, int64_t n_vocab);
  // The next token's draw as a RowSampling (row_sampling.h), what generate() hands Backend::forward_sample:
  // the same filters and temperature and the one uniform sample() would draw. False (nothing drawn) with an
  // active repetition penalty, which RowSampling does not carry (generate() then calls sample()). The token
  // can differ from sample()'s for the same uniform: sample_row draws an unfiltered row in id order,
  // sample() in logit order.
  bool row_sampling(RowSampling& out);
  void accept(int32_t token);  // records a token (prompt or generated) for the repetition penalty
  void reset();
  const SamplerOptions& options() const { return opts_; }

 private:
  struct Candidate {
    int32_t id;
    float logit;
  };
  void apply_repeat_penalty(std::vector<Candidate>& c) const;
  void top_k(std::vector<Candidate>& c) const;
  void top_p_min_p(std::vector<Candidate>& c) const;

  SamplerOptions opts_;
  Rng rng_;
  std::deque<int32_t> recent_;
  std::vector<Candidate> cand_;
};

// The first index of the largest of logits[0, n) (NaNs never win; 0 for n <= 0): KernelTable::argmax.
int32_t argmax(const float* logits, int64_t n);

}  // namespace merlin
