#include "runtime/row_sampling.h"

#include <algorithm>
#include <cmath>

#include "runtime/sampler.h"

namespace merlin {

int32_t sample_row(const float* logits, int64_t n_vocab, const RowSampling& r, const LogitAdjust* adjust,
                   std::vector<float>& work) {
  const float* row = logits;
  if (r.n_adjust > 0) {
    work.assign(logits, logits + n_vocab);
    for (const LogitAdjust* a = adjust + r.first; a != adjust + r.first + r.n_adjust; ++a) {
      if (a->token < 0 || a->token >= n_vocab) continue;
      float l = work[(size_t)a->token];
      if (a->flags & LogitAdjust::kBias) l += a->bias;
      if (a->flags & LogitAdjust::kPenalty) l -= a->penalty;
      work[(size_t)a->token] = l;
    }
    row = work.data();
  }
  if (r.temperature <= 0) return argmax(row, n_vocab);
  thread_local std::vector<double> weights;
  return draw_row(row, n_vocab, *std::max_element(row, row + n_vocab), r.temperature, r.u, weights);
}

int32_t draw_row(const float* logits, int64_t n_vocab, float max_logit, float temperature, double u,
                 std::vector<double>& weights) {
  const double inv_t = 1.0 / temperature;
  weights.resize((size_t)n_vocab);
  double sum = 0;
  for (int64_t i = 0; i < n_vocab; ++i) sum += weights[(size_t)i] = std::exp((double)(logits[i] - max_logit) * inv_t);
  double r = u * sum;
  for (int64_t i = 0; i < n_vocab; ++i) {
    r -= weights[(size_t)i];
    if (r < 0) return (int32_t)i;
  }
  return (int32_t)(n_vocab - 1);
}

}  // namespace merlin
