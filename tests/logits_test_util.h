// Logit comparisons shared by the CPU and CUDA backend tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "runtime/backend.h"

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

}  // namespace merlin::test
