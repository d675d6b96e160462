// The output-head screen (kernels/cpu/head_screen.h): its int8 products stay within the bound the greedy
// selection relies on, the AVX-512 products equal the reference's, and the selection helpers find exactly the
// rows the bound allows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/head_screen.h"

using namespace merlin;
using namespace merlin::kernels;

namespace {

// Every screened product is within err_r * X_t + hull_r * Y_t of the exact dot product (the bound also covers
// a float evaluation's rounding, so a double one is well inside), rows outside [r0, r1) are untouched, and the
// AVX-512 version gives the reference's bits.
TEST(HeadScreen, ProductsWithinTheBound) {
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const HeadScreen& ref = head_screen_reference();
  const HeadScreen* fast = head_screen();
  for (int64_t k : {4, 64, 256, 1024})
    for (int64_t rows : {1, 16, 37})
      for (int64_t nt : {1, 8, 16, 17, 32}) {
        SCOPED_TRACE("k=" + std::to_string(k) + " rows=" + std::to_string(rows) + " tokens=" + std::to_string(nt));
        const size_t row_elems = (size_t)k + 6;
        std::vector<uint16_t> w(row_elems * (size_t)rows);
        for (auto& h : w) h = f32_to_fp16(0.05f * d(rng));
        if (rows > 16) std::fill(w.begin() + 3 * (long)row_elems, w.begin() + 4 * (long)row_elems, 0);  // a zero row
        std::vector<float> x((size_t)(nt * k));
        for (auto& v : x) v = 3.0f * d(rng);
        if (nt > 1) x[(size_t)k + 1] = 40.0f;  // an outlier: a coarse token scale
        std::vector<uint8_t> packed(ref.bytes(rows, k));
        std::vector<float> scale((size_t)rows), err((size_t)rows), hull((size_t)rows);
        ref.prepare(packed.data(), rows, k);
        for (int64_t r = 0; r < rows; ++r) {
          std::vector<float> row((size_t)k);
          for (int64_t j = 0; j < k; ++j) row[(size_t)j] = fp16_to_f32(w[(size_t)r * row_elems + j]);
          ASSERT_TRUE(ref.pack_row(row.data(), r, k, packed.data(), scale.data(), err.data(), hull.data()));
        }
        // A quantized head kernel multiplies its own activations x~ (here: x rounded to bf16) instead of x.
        const bool act = k % 64 == 0 && nt % 2 == 0;
        std::vector<float> xa(x.size());
        for (size_t i = 0; i < x.size(); ++i) xa[i] = act ? bf16_to_f32(f32_to_bf16(x[i])) : x[i];
        std::vector<int8_t> q((size_t)(nt * k));
        std::vector<ScreenToken> tok((size_t)nt);
        std::vector<float> xs((size_t)nt);
        std::vector<int32_t> xsum((size_t)nt);
        for (int64_t t = 0; t < nt; ++t) {
          double d2 = 0;
          for (int64_t j = 0; j < k; ++j) d2 += std::pow((double)x[(size_t)(t * k + j)] - xa[(size_t)(t * k + j)], 2);
          ASSERT_TRUE(screen_quantize(&x[(size_t)(t * k)], k, std::sqrt(d2), &q[(size_t)(t * k)], &tok[(size_t)t]));
          xs[(size_t)t] = tok[(size_t)t].scale;
          xsum[(size_t)t] = tok[(size_t)t].sum;
        }
        const int64_t r0 = rows > 16 ? 16 : 0;
        std::vector<float> y1((size_t)(nt * rows), 7.0f), y2 = y1;
        ref.rows(packed.data(), scale.data(), r0, rows, q.data(), (size_t)k, xs.data(), xsum.data(), nt, k, y1.data(),
                 rows);
        if (fast) {
          fast->rows(packed.data(), scale.data(), r0, rows, q.data(), (size_t)k, xs.data(), xsum.data(), nt, k,
                     y2.data(), rows);
          for (size_t i = 0; i < y1.size(); ++i) ASSERT_EQ(y1[i], y2[i]) << i;
        }
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            const float got = y1[(size_t)(t * rows + r)];
            if (r < r0) {
              ASSERT_EQ(got, 7.0f);
              continue;
            }
            double dot = 0;
            for (int64_t j = 0; j < k; ++j)
              dot += (double)fp16_to_f32(w[(size_t)r * row_elems + j]) * xa[(size_t)(t * k + j)];
            const double bound =
                (double)err[(size_t)r] * tok[(size_t)t].bound_x + (double)hull[(size_t)r] * tok[(size_t)t].bound_y;
            ASSERT_LE(std::fabs(got - dot), bound) << r << " " << t;
            ASSERT_LT(bound, 0.1 * hull[(size_t)r] * tok[(size_t)t].bound_x + 1e-30) << r << " " << t;  // and useful
          }
      }
}

TEST(HeadScreen, RefusesNonFiniteValues) {
  const HeadScreen& ref = head_screen_reference();
  std::vector<float> w(32, 0.5f);
  w[17] = INFINITY;
  std::vector<uint8_t> packed(ref.bytes(2, 32));
  std::vector<float> s(2), e(2), h(2);
  ref.prepare(packed.data(), 2, 32);
  EXPECT_FALSE(ref.pack_row(w.data(), 1, 32, packed.data(), s.data(), e.data(), h.data()));
  std::vector<float> x(32, 1.0f);
  x[5] = NAN;
  std::vector<int8_t> q(32);
  ScreenToken tok;
  EXPECT_FALSE(screen_quantize(x.data(), 32, 0.0, q.data(), &tok));
}

// lower_max is the largest a - (ex err + ey hull) (NaN when an a is NaN); candidates lists, ascending, the rows
// whose a + (ex err + ey hull) reaches lo, and reports more than `cap` as cap + 1.
TEST(HeadScreen, SelectionHelpers) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-5.0f, 5.0f), un(0.5f, 2.0f);
  std::vector<const HeadScreen*> impls{&head_screen_reference()};
  if (const HeadScreen* fast = head_screen()) impls.push_back(fast);
  for (const HeadScreen* hs : impls)
    for (int64_t n : {1, 15, 16, 17, 1000, 50257}) {
      SCOPED_TRACE("n=" + std::to_string(n));
      std::vector<float> a((size_t)n), err((size_t)n), hull((size_t)n);
      for (auto& v : a) v = u(rng);
      for (auto& v : err) v = 0.01f * un(rng);
      for (auto& v : hull) v = un(rng);
      const float ex = 2.0f, ey = 0.01f;
      auto bound = [&](int64_t r) { return (double)ex * err[(size_t)r] + (double)ey * hull[(size_t)r]; };
      double want_lo = -INFINITY;
      for (int64_t r = 0; r < n; ++r) want_lo = std::max(want_lo, (double)a[(size_t)r] - bound(r));
      const float lo = hs->lower_max(a.data(), err.data(), hull.data(), ex, ey, n);
      ASSERT_NEAR(lo, want_lo, 1e-5);
      std::vector<int32_t> out((size_t)n + 1);
      const int64_t m = hs->candidates(a.data(), err.data(), hull.data(), ex, ey, lo, n, out.data(), n);
      ASSERT_GE(m, 1);
      ASSERT_LE(m, n);
      for (int64_t i = 1; i < m; ++i) ASSERT_LT(out[(size_t)i - 1], out[(size_t)i]);
      std::vector<char> listed((size_t)n, 0);
      for (int64_t i = 0; i < m; ++i) listed[(size_t)out[(size_t)i]] = 1;
      for (int64_t r = 0; r < n; ++r) {
        const double up = (double)a[(size_t)r] + bound(r);
        if (up >= (double)lo + 1e-5) {
          ASSERT_TRUE(listed[(size_t)r]) << r;
        }
        if (up < (double)lo - 1e-5) {
          ASSERT_FALSE(listed[(size_t)r]) << r;
        }
      }
      // Everything a candidate: more than the cap is reported as cap + 1.
      ASSERT_EQ(hs->candidates(a.data(), err.data(), hull.data(), ex, ey, -INFINITY, n, out.data(), n - 1), n);
      a[(size_t)(n / 2)] = NAN;
      ASSERT_TRUE(std::isnan(hs->lower_max(a.data(), err.data(), hull.data(), ex, ey, n)));
    }
}

}  // namespace
