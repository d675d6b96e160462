// Logit comparisons shared by the CPU and CUDA backend tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "runtime/backend.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/row_sampling.h"
#include "runtime/sampler.h"

namespace merlin::test {

inline float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

inline float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

// One forward of all sequences' tokens in one batch (sequence si at positions 0.., every row's logits);
// each sequence's rows must equal `alone[si]` (the same tokens run by themselves) within rel_tol of its
// largest logit.
inline void expect_batch_matches_alone(Backend& backend, const std::vector<std::vector<int32_t>>& seqs,
                                       const std::vector<std::vector<float>>& alone, size_t vocab, float rel_tol) {
  Batch b;
  for (size_t si = 0; si < seqs.size(); ++si)
    for (size_t i = 0; i < seqs[si].size(); ++i) b.add(seqs[si][i], (int)i, (int)si, true);
  std::vector<float> mixed(b.n_logits() * vocab);
  backend.forward(b, mixed.data());
  size_t row = 0;
  for (size_t si = 0; si < seqs.size(); ++si) {
    std::vector<float> got(mixed.begin() + (ptrdiff_t)(row * vocab),
                           mixed.begin() + (ptrdiff_t)((row + seqs[si].size()) * vocab));
    EXPECT_LE(max_diff(got, alone[si]), rel_tol * max_abs(alone[si])) << "sequence " << si;
    row += seqs[si].size();
  }
}

// What generate() must sample: a host loop over `twin`'s forward() logits (a fresh backend of the same model)
// with sample_row and a Sampler's uniforms, Sampler::sample where row_sampling declines (repetition penalty).
inline std::vector<int32_t> host_sampled_tokens(const Model& m, Backend& twin, const std::vector<int32_t>& prompt,
                                                const SamplerOptions& so, int n_predict) {
  const int64_t vocab = m.config().vocab_size;
  Sampler sampler(so);
  for (int32_t t : prompt) sampler.accept(t);
  std::vector<float> logits = prefill(m, twin, prompt, 0, 0, false);
  std::vector<int32_t> want;
  SampleScratch scratch;
  for (int i = 0; i < n_predict; ++i) {
    if (i > 0) {
      Batch b;
      b.add(want.back(), (int)(prompt.size() + want.size()) - 1, 0, true);
      twin.forward(b, logits.data());
    }
    RowSampling r;
    const int32_t tok = sampler.row_sampling(r) ? sample_row(logits.data(), vocab, r, nullptr, scratch)
                                                : sampler.sample(logits.data(), vocab);
    sampler.accept(tok);
    want.push_back(tok);
  }
  return want;
}

}  // namespace merlin::test
