// The training GEMM against a double-precision reference, for every operand layout, ragged shapes
// (edges of the register tile and of the packing blocks) and accumulation; and its thread-count
// independence.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/cpu_features.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "train/gemm.h"

namespace merlin::train {
namespace {

std::vector<float> random_vec(size_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<float> v(n);
  for (float& x : v) x = r.normal();
  return v;
}

// C = (acc ? C : 0) + op(A) op(B) with op chosen by the transposition flags.
void check(ThreadPool& pool, int64_t M, int64_t N, int64_t K, bool ta, bool tb, bool acc) {
  const std::vector<float> a = random_vec(M * K, 1), b = random_vec(K * N, 2);
  const MatRef A = ta ? MatRef{a.data(), 1, M} : MatRef{a.data(), K, 1};
  const MatRef B = tb ? MatRef{b.data(), 1, K} : MatRef{b.data(), N, 1};
  const int64_t ldc = N + 3;  // a leading dimension wider than the row
  std::vector<float> c = random_vec(M * ldc, 3);
  const std::vector<float> c0 = c;
  gemm(pool, M, N, K, A, B, c.data(), ldc, acc);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double want = acc ? c0[i * ldc + j] : 0.0, mag = std::abs(want);
      for (int64_t k = 0; k < K; ++k) {
        const double p = (double)A.p[i * A.rs + k * A.cs] * B.p[k * B.rs + j * B.cs];
        want += p;
        mag += std::abs(p);
      }
      ASSERT_NEAR(c[i * ldc + j], want, 1e-5 * mag + 1e-6)
          << "M" << M << " N" << N << " K" << K << " ta" << ta << " tb" << tb << " acc" << acc << " at " << i << "," << j;
    }
  for (int64_t i = 0; i < M; ++i)  // the padding between rows is never written
    for (int64_t j = N; j < ldc; ++j) ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]);
}

class TrainGemm : public ::testing::TestWithParam<KernelLevel> {
 protected:
  void SetUp() override {
    if (GetParam() > best_kernel_level()) GTEST_SKIP() << "CPU lacks " << kernel_level_name(GetParam());
    set_kernel_level(GetParam());
  }
  void TearDown() override { set_kernel_level(best_kernel_level()); }
};

TEST_P(TrainGemm, MatchesReferenceForAllLayouts) {
  ThreadPool pool(2);
  const int64_t shapes[][3] = {{1, 1, 1}, {12, 32, 16}, {13, 33, 17}, {5, 70, 300}, {130, 31, 257}, {37, 129, 600}, {3, 2100, 5}};
  for (const auto& s : shapes)
    for (int layout = 0; layout < 4; ++layout)
      for (bool acc : {false, true}) check(pool, s[0], s[1], s[2], layout & 1, layout & 2, acc);
}

TEST_P(TrainGemm, ZeroDepth) {
  ThreadPool pool(2);
  std::vector<float> c(6, 5.0f), a(1), b(1);
  gemm(pool, 2, 3, 0, MatRef{a.data(), 0, 1}, MatRef{b.data(), 3, 1}, c.data(), 3, /*accumulate=*/true);
  EXPECT_EQ(c, std::vector<float>(6, 5.0f));
  gemm(pool, 2, 3, 0, MatRef{a.data(), 0, 1}, MatRef{b.data(), 3, 1}, c.data(), 3, /*accumulate=*/false);
  EXPECT_EQ(c, std::vector<float>(6, 0.0f));
}

INSTANTIATE_TEST_SUITE_P(Levels, TrainGemm, ::testing::Values(KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512),
                         [](const auto& info) { return std::string(kernel_level_name(info.param)); });

TEST(TrainGemmThreads, BitIdenticalForAnyThreadCount) {
  const int64_t n = 150, in = 70, out = 300;
  const std::vector<float> x = random_vec(n * in, 4), w = random_vec(out * in, 5), dy = random_vec(n * out, 6);
  std::vector<std::vector<float>> ys, dxs, dws;
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    std::vector<float> y(n * out), dx(n * in), dw(out * in, 1.0f);
    linear_forward(pool, x.data(), w.data(), n, in, out, y.data());
    linear_backward_input(pool, dy.data(), w.data(), n, in, out, dx.data(), false);
    linear_backward_weight(pool, dy.data(), x.data(), n, in, out, dw.data());
    ys.push_back(y);
    dxs.push_back(dx);
    dws.push_back(dw);
  }
  for (size_t i = 1; i < ys.size(); ++i) {
    EXPECT_EQ(ys[0], ys[i]);
    EXPECT_EQ(dxs[0], dxs[i]);
    EXPECT_EQ(dws[0], dws[i]);
  }
}

}  // namespace
}  // namespace merlin::train
