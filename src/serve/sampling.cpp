#include "serve/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "runtime/sampler.h"

namespace merlin::serve {
namespace {

bool better(float la, int32_t a, float lb, int32_t b) { return la > lb || (la == lb && a < b); }

constexpr int64_t kArgmaxBlock = 256;

// The largest non-NaN value of x[0, n), n a multiple of 16; -inf when there is none. max is exact, so the
// lane order does not matter; maxps(x, m) returns m when x is NaN.
float block_max(const float* x, int64_t n) {
#if defined(__SSE2__)
  __m128 m[4];
  for (__m128& v : m) v = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16)
    for (int j = 0; j < 4; ++j) m[j] = _mm_max_ps(_mm_loadu_ps(x + i + 4 * j), m[j]);
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3])));
  return std::max({lanes[0], lanes[1], lanes[2], lanes[3]});
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i)
    if (x[i] > m) m = x[i];
  return m;
#endif
}

}  // namespace

// Block maxima first (vectorized), then the first index of the maximum inside the first block that holds it.
int32_t greedy_token(const float* logits, int64_t n) {
  if (n <= 0 || std::isnan(logits[0])) return 0;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = -1;
  const int64_t n_main = n / kArgmaxBlock * kArgmaxBlock;
  for (int64_t b = 0; b < n_main; b += kArgmaxBlock) {
    const float m = block_max(logits + b, kArgmaxBlock);
    if (m > best) best = m, best_block = b;
  }
  int64_t in_tail = -1;
  for (int64_t i = n_main; i < n; ++i)  // the tail comes after every block, so a tie keeps the block's index
    if (logits[i] > best) best = logits[i], in_tail = i;
  if (in_tail >= 0) return (int32_t)in_tail;
  if (best_block < 0) return 0;  // nothing above -inf: all -inf or NaN, and argmax() keeps index 0
  for (int64_t i = best_block;; ++i)
    if (logits[i] == best) return (int32_t)i;
}

RequestSampler::RequestSampler(const SamplingParams& params, uint64_t seed) : params_(params), rng_(seed) {
  for (size_t i = 0; i < params_.logit_bias.size(); ++i) bias_at_.emplace(params_.logit_bias[i].first, i);
}

void RequestSampler::accept(int32_t token) { ++counts_[token]; }

RowSampling RequestSampler::row_sampling(std::vector<LogitAdjust>& adjust) {
  RowSampling r;
  r.temperature = params_.temperature;
  r.top_k = params_.top_k;
  r.top_p = params_.top_p;
  r.min_p = params_.min_p;
  r.first = (int32_t)adjust.size();
  for (const auto& [token, bias] : params_.logit_bias) adjust.push_back({token, bias, 0.0f, LogitAdjust::kBias});
  const bool penalised = !counts_.empty() && (params_.presence_penalty != 0 || params_.frequency_penalty != 0);
  if (penalised) {
    for (const auto& [token, count] : counts_) {
      const float penalty = params_.presence_penalty + params_.frequency_penalty * (float)count;
      if (const auto b = bias_at_.find(token); b != bias_at_.end()) {  // one entry per token: bias, then penalty
        LogitAdjust& a = adjust[(size_t)r.first + b->second];
        a.penalty = penalty;
        a.flags |= LogitAdjust::kPenalty;
      } else {
        adjust.push_back({token, 0.0f, penalty, LogitAdjust::kPenalty});
      }
    }
  }
  r.n_adjust = (int32_t)adjust.size() - r.first;
  if (params_.temperature > 0) r.u = rng_.uniform_double();  // the draw's one uniform (greedy draws none)
  return r;
}

int32_t RequestSampler::sample(const float* logits, int64_t n_vocab) {
  adjust_.clear();
  const RowSampling r = row_sampling(adjust_);
  return sample_row(logits, n_vocab, r, adjust_.data(), scratch_);
}

float token_logprob(const float* logits, int64_t n_vocab, int32_t token, int top_n,
                    std::vector<std::pair<int32_t, float>>* top) {
  const float max_logit = *std::max_element(logits, logits + n_vocab);
  double sum = 0;
  for (int64_t i = 0; i < n_vocab; ++i) sum += std::exp((double)(logits[i] - max_logit));
  const double lse = (double)max_logit + std::log(sum);
  if (top) {
    top->clear();
    const int64_t n = std::min<int64_t>(std::max(top_n, 0), n_vocab);
    if (n > 0) {
      thread_local std::vector<int32_t> ids;  // the engine thread calls this for every token: no allocation
      ids.resize((size_t)n_vocab);
      for (int64_t i = 0; i < n_vocab; ++i) ids[(size_t)i] = (int32_t)i;
      std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                        [&](int32_t a, int32_t b) { return better(logits[a], a, logits[b], b); });
      for (int64_t i = 0; i < n; ++i) top->emplace_back(ids[(size_t)i], (float)(logits[ids[(size_t)i]] - lse));
    }
  }
  return token >= 0 && token < n_vocab ? (float)(logits[token] - lse) : 0.0f;
}

}  // namespace merlin::serve
