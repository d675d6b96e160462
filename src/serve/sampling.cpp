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

bool RequestSampler::backend_samplable() const {
  return params_.top_k <= 0 && params_.top_p >= 1.0f && params_.min_p <= 0;
}

RowSampling RequestSampler::row_sampling(std::vector<LogitAdjust>& adjust) {
  RowSampling r;
  r.temperature = params_.temperature;
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
  if (params_.temperature > 0) r.u = rng_.uniform_double();
  return r;
}

int32_t RequestSampler::sample(const float* logits, int64_t n_vocab) {
  const float* row = logits;
  const bool penalised = !counts_.empty() && (params_.presence_penalty != 0 || params_.frequency_penalty != 0);
  if (penalised || !params_.logit_bias.empty()) {
    work_.assign(logits, logits + n_vocab);
    for (const auto& [token, bias] : params_.logit_bias)
      if (token >= 0 && token < n_vocab) work_[(size_t)token] += bias;
    for (const auto& [token, count] : counts_) {
      if (!penalised || token < 0 || token >= n_vocab) continue;
      work_[(size_t)token] -= params_.presence_penalty + params_.frequency_penalty * (float)count;
    }
    row = work_.data();
  }
  if (params_.temperature <= 0) return greedy_token(row, n_vocab);
  const float max_logit = *std::max_element(row, row + n_vocab);
  const bool filtered = params_.top_k > 0 || params_.top_p < 1.0f || params_.min_p > 0;
  if (!filtered) return draw(row, n_vocab, max_logit, 0);  // the whole vocabulary, in id order
  return draw(row, n_vocab, max_logit, std::max<size_t>(1, nucleus(row, n_vocab, max_logit)));
}

// cand_ = the n best tokens, sorted.
void RequestSampler::sort_best(const float* logits, int64_t n_vocab, size_t n) {
  cand_.resize((size_t)n_vocab);
  for (int64_t i = 0; i < n_vocab; ++i) cand_[(size_t)i] = {(int32_t)i, logits[i]};
  const auto by = [](const Candidate& a, const Candidate& b) { return better(a.logit, a.id, b.logit, b.id); };
  n = std::min(n, cand_.size());
  std::partial_sort(cand_.begin(), cand_.begin() + (std::ptrdiff_t)n, cand_.end(), by);
  cand_.resize(n);
}

// How many of the best candidates survive top-k, then top-p, then min-p, with probabilities at temperature 1
// over the top-k set (as llama.cpp and runtime's Sampler). Leaves at least that many sorted in cand_.
size_t RequestSampler::nucleus(const float* logits, int64_t n_vocab, float max_logit) {
  const bool top_k_on = params_.top_k > 0 && params_.top_k < n_vocab;
  const size_t k = top_k_on ? (size_t)params_.top_k : (size_t)n_vocab;
  double total = 0;  // the normaliser over the top-k set
  if (top_k_on) {
    sort_best(logits, n_vocab, k);
    for (const Candidate& c : cand_) total += std::exp((double)(c.logit - max_logit));
  } else if (params_.top_p < 1.0f) {
    for (int64_t i = 0; i < n_vocab; ++i) total += std::exp((double)(logits[i] - max_logit));
  }
  // min-p keeps the candidates with p >= min_p * p_max: a count, no sort needed.
  size_t bound = k;
  if (params_.min_p > 0) {
    size_t n = 0;
    for (int64_t i = 0; i < n_vocab; ++i) n += std::exp((double)(logits[i] - max_logit)) >= params_.min_p;
    bound = std::min(bound, std::max<size_t>(n, 1));
  }
  if (params_.top_p >= 1.0f) {
    if (!top_k_on) sort_best(logits, n_vocab, bound);
    return bound;
  }
  // The top-p prefix: sort the best 64, then 512, ... until the cumulative probability reaches top_p.
  for (size_t n = std::min<size_t>(bound, 64);; n = std::min(bound, n * 8)) {
    if (!top_k_on) sort_best(logits, n_vocab, n);
    double cum = 0;
    for (size_t i = 0; i < n; ++i) {
      cum += std::exp((double)(cand_[i].logit - max_logit)) / total;
      if (cum >= params_.top_p) return i + 1;
    }
    if (n == bound) return bound;
  }
}

// Draws from the first n_kept candidates of cand_ (or the whole row, in id order, when n_kept == 0) with
// weights exp((logit - max) / temperature).
int32_t RequestSampler::draw(const float* logits, int64_t n_vocab, float max_logit, size_t n_kept) {
  const double inv_t = 1.0 / params_.temperature;
  const size_t n = n_kept ? n_kept : (size_t)n_vocab;
  weights_.resize(n);
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const float l = n_kept ? cand_[i].logit : logits[i];
    sum += weights_[i] = std::exp((double)(l - max_logit) * inv_t);
  }
  double r = rng_.uniform_double() * sum;
  for (size_t i = 0; i < n; ++i) {
    r -= weights_[i];
    if (r < 0) return n_kept ? cand_[i].id : (int32_t)i;
  }
  return n_kept ? cand_[n - 1].id : (int32_t)(n - 1);
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
