// Per-request sampling for the server: OpenAI logit biases and presence/frequency penalties over the
// generated tokens, then the chain of runtime's Sampler (top-k -> top-p -> min-p at temperature 1, then
// temperature) with the request's own RNG, so a seeded request draws the same tokens whatever else runs. The
// draw itself is runtime's sample_row (row_sampling.h), which a backend can run where the logits are.
// Log-probabilities are of the unmodified logits, as OpenAI reports them.
#pragma once
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "runtime/row_sampling.h"
#include "serve/engine.h"

namespace merlin::serve {

class RequestSampler {
 public:
  RequestSampler(const SamplingParams& params, uint64_t seed);
  // Picks the next token from a row of logits (the row is not modified).
  int32_t sample(const float* logits, int64_t n_vocab);
  // Records a generated token for the penalties.
  void accept(int32_t token);
  // The request's next token as a RowSampling for a backend (Backend::forward_sample): appends its logit
  // biases and penalties to `adjust` and draws the uniform. sample() is row_sampling() + sample_row() on
  // the host, so both paths pick the same token from the same logits and leave the RNG in the same state.
  RowSampling row_sampling(std::vector<LogitAdjust>& adjust);

 private:
  SamplingParams params_;
  Rng rng_;
  std::unordered_map<int32_t, int> counts_;
  std::unordered_map<int32_t, size_t> bias_at_;  // token -> its index in params_.logit_bias
  std::vector<LogitAdjust> adjust_;
  SampleScratch scratch_;
};

// The token runtime's argmax() picks (the first index of the largest value; NaNs never win, and a NaN in
// front gives 0), vectorized: greedy decoding of 32 sequences runs it over 32 x 50K logits per step on the
// engine thread while the worker threads wait.
int32_t greedy_token(const float* logits, int64_t n);

// log_softmax(logits)[token], and the `top_n` most likely tokens with theirs (most likely first, ties by id).
float token_logprob(const float* logits, int64_t n_vocab, int32_t token, int top_n,
                    std::vector<std::pair<int32_t, float>>* top);

}  // namespace merlin::serve
