#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <unordered_set>

#include "kernels/cpu/kernels.h"

namespace merlin {

// The kernel table's argmax (AVX-512 block maxima at that level): the first index of the largest, NaNs never
// win, as the scalar loop.
int32_t argmax(const float* logits, int64_t n) { return kernels::kernels().argmax(logits, n); }

Sampler::Sampler(const SamplerOptions& opts) : opts_(opts), rng_(opts.seed) {}

void Sampler::reset() {
  rng_.reseed(opts_.seed);
  recent_.clear();
}

void Sampler::accept(int32_t token) {
  if (opts_.repeat_last_n <= 0) return;
  recent_.push_back(token);
  while ((int)recent_.size() > opts_.repeat_last_n) recent_.pop_front();
}

void Sampler::apply_repeat_penalty(std::vector<Candidate>& c) const {
  if (opts_.repeat_penalty == 1.0f || recent_.empty()) return;
  std::unordered_set<int32_t> seen(recent_.begin(), recent_.end());
  for (Candidate& x : c) {
    if (!seen.count(x.id)) continue;
    // As llama.cpp (and CTRL): shrink positive logits, push negative ones further down.
    x.logit = x.logit > 0 ? x.logit / opts_.repeat_penalty : x.logit * opts_.repeat_penalty;
  }
}

void Sampler::top_k(std::vector<Candidate>& c) const {
  const auto by_logit = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  const size_t k = opts_.top_k > 0 ? std::min<size_t>((size_t)opts_.top_k, c.size()) : c.size();
  std::partial_sort(c.begin(), c.begin() + (std::ptrdiff_t)k, c.end(), by_logit);
  c.resize(k);
}

void Sampler::top_p_min_p(std::vector<Candidate>& c) const {
  // c is sorted by logit, descending. Probabilities at temperature 1, as llama.cpp does.
  const float max_logit = c[0].logit;
  std::vector<double> p(c.size());
  double sum = 0;
  for (size_t i = 0; i < c.size(); ++i) sum += p[i] = std::exp((double)(c[i].logit - max_logit));
  size_t keep = c.size();
  if (opts_.top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      cum += p[i] / sum;
      if (cum >= opts_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  if (opts_.min_p > 0.0f) {
    size_t i = 1;
    while (i < keep && p[i] >= opts_.min_p * p[0]) ++i;  // p[0] is the largest
    keep = i;
  }
  c.resize(std::max<size_t>(1, keep));
}

bool Sampler::row_sampling(RowSampling& out) {
  if (opts_.repeat_penalty != 1.0f && !recent_.empty()) return false;
  out = RowSampling{};
  out.temperature = opts_.temperature;
  out.top_k = opts_.top_k;
  out.top_p = opts_.top_p;
  out.min_p = opts_.min_p;
  if (opts_.temperature > 0.0f) out.u = rng_.uniform_double();
  return true;
}

int32_t Sampler::sample(const float* logits, int64_t n_vocab) {
  if (opts_.temperature <= 0.0f && opts_.repeat_penalty == 1.0f) return argmax(logits, n_vocab);
  cand_.resize((size_t)n_vocab);
  for (int64_t i = 0; i < n_vocab; ++i) cand_[i] = {(int32_t)i, logits[i]};
  apply_repeat_penalty(cand_);
  if (opts_.temperature <= 0.0f) {
    return std::max_element(cand_.begin(), cand_.end(),
                            [](const Candidate& a, const Candidate& b) { return a.logit < b.logit; })->id;
  }
  top_k(cand_);
  top_p_min_p(cand_);
  const float max_logit = cand_[0].logit;
  std::vector<double> w(cand_.size());
  double sum = 0;
  for (size_t i = 0; i < cand_.size(); ++i) sum += w[i] = std::exp((double)(cand_[i].logit - max_logit) / opts_.temperature);
  double r = rng_.uniform_double() * sum;
  for (size_t i = 0; i < cand_.size(); ++i) {
    r -= w[i];
    if (r < 0) return cand_[i].id;
  }
  return cand_.back().id;
}

}  // namespace merlin
