// Element-wise kernels at every level against the scalar reference, RoPE against a double-precision formula,
// dequantize_row, and the level selection itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <limits>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"

namespace merlin {
// Readable parameter names in gtest failure messages.
inline void PrintTo(KernelLevel l, std::ostream* os) { *os << kernel_level_name(l); }
}  // namespace merlin

namespace merlin::kernels {
namespace {

#define SKIP_IF_UNAVAILABLE(level)                                                                       \
  if ((level) > best_kernel_level())                                                                    \
  GTEST_SKIP() << "CPU lacks " << kernel_level_name(level) << " (has: " << cpu_features_string() << ")"

const int64_t kSizes[] = {1, 7, 15, 17, 64, 100, 768, 1000, 4099};

std::vector<float> random_vec(int64_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v((size_t)n);
  for (float& f : v) f = dist(rng);
  return v;
}

class OpsLevelTest : public ::testing::TestWithParam<KernelLevel> {
 protected:
  const KernelTable& table() { return kernels_for(GetParam()); }
  const KernelTable& ref() { return kernels_for(KernelLevel::Scalar); }
  std::mt19937 rng{42};
};

TEST_P(OpsLevelTest, TableLevel) {
  SKIP_IF_UNAVAILABLE(GetParam());
  EXPECT_EQ(table().level, GetParam());
}

TEST_P(OpsLevelTest, Rmsnorm) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> x = random_vec(n, -3, 3, rng), w = random_vec(n, 0.5f, 1.5f, rng);
    std::vector<float> want((size_t)n), got((size_t)n);
    ref().rmsnorm(x.data(), w.data(), n, 1e-5f, want.data());
    table().rmsnorm(x.data(), w.data(), n, 1e-5f, got.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], want[i], 1e-5 * std::fabs(want[i]) + 1e-7) << i;
    table().rmsnorm(x.data(), w.data(), n, 1e-5f, x.data());  // in place
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[i], got[i]) << i;
  }
}

TEST_P(OpsLevelTest, Swiglu) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> g = random_vec(n, -20, 20, rng), u = random_vec(n, -2, 2, rng);
    const float specials[] = {0.0f, -0.0f, 100.0f, -100.0f, 88.0f, -88.0f, 89.0f, -89.0f, 1e-8f, -1e-30f};
    for (size_t i = 0; i < sizeof(specials) / sizeof(float) && (int64_t)i < n; ++i) g[i] = specials[i];
    std::vector<float> want((size_t)n), got((size_t)n);
    ref().swiglu(g.data(), u.data(), n, want.data());
    table().swiglu(g.data(), u.data(), n, got.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-30) << "gate " << g[i];
    table().swiglu(g.data(), u.data(), n, g.data());  // out aliases gate
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(g[i], got[i]) << i;
  }
}

TEST_P(OpsLevelTest, DotAxpyAdd) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> a = random_vec(n, -1, 1, rng), b = random_vec(n, -1, 1, rng);
    double exact = 0.0, mag = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      exact += (double)a[i] * b[i];
      mag += std::fabs((double)a[i] * b[i]);
    }
    EXPECT_NEAR(table().dot(a.data(), b.data(), n), exact, 1e-5 * mag + 1e-6);
    EXPECT_NEAR(table().dot(a.data(), b.data(), n), ref().dot(a.data(), b.data(), n), 1e-5 * mag + 1e-6);

    std::vector<float> y1 = b, y2 = b;
    ref().axpy(0.75f, a.data(), y1.data(), n);
    table().axpy(0.75f, a.data(), y2.data(), n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(y2[i], y1[i], 1e-6 * (std::fabs(b[i]) + std::fabs(a[i]))) << i;

    std::vector<float> s1((size_t)n), s2 = a;
    ref().add(a.data(), b.data(), s1.data(), n);
    table().add(s2.data(), b.data(), s2.data(), n);  // out aliases a
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(s2[i], s1[i]) << i;
  }
}

TEST_P(OpsLevelTest, AxpyF16) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> a = random_vec(n, -1, 1, rng), y0 = random_vec(n, -1, 1, rng);
    std::vector<uint16_t> h((size_t)n);
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(a[i]);
    std::vector<float> y1 = y0, y2 = y0;
    ref().axpy_f16(-0.5f, h.data(), y1.data(), n);
    table().axpy_f16(-0.5f, h.data(), y2.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(y1[i], y0[i] - 0.5f * fp16_to_f32(h[i]), 1e-6f) << i;
      ASSERT_NEAR(y2[i], y1[i], 1e-6f) << i;
    }
  }
}

// The fused rows version must equal, bit for bit, one axpy_f16 call per (output, row) at the same level
// (the runtime swapped one for the other), for widths around the 64-column chunk, a row stride wider than
// the row, and output counts around the 6-output tile.
TEST_P(OpsLevelTest, AxpyF16RowsEqualsRepeatedAxpyF16) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : {1, 15, 64, 65, 100, 200})
    for (int64_t rows : {0, 1, 3, 37})
      for (int64_t n_vec : {1, 5, 6, 7, 13}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " rows=" + std::to_string(rows) + " vectors=" + std::to_string(n_vec));
        const size_t ldx = (size_t)n + 5, lda = (size_t)rows + 3, ldy = (size_t)n + 2;
        std::vector<float> xf = random_vec((int64_t)ldx * std::max<int64_t>(rows, 1), -2, 2, rng);
        std::vector<uint16_t> x(xf.size());
        for (size_t i = 0; i < x.size(); ++i) x[i] = f32_to_fp16(xf[i]);
        std::vector<float> a = random_vec((int64_t)lda * n_vec, 0, 1, rng);
        std::vector<float> y1 = random_vec((int64_t)ldy * n_vec, -1, 1, rng), y2 = y1;
        for (int64_t v = 0; v < n_vec; ++v)
          for (int64_t p = 0; p < rows; ++p) table().axpy_f16(a[v * lda + p], x.data() + p * ldx, &y1[v * ldy], n);
        table().axpy_f16_rows(a.data(), lda, n_vec, x.data(), ldx, rows, y2.data(), ldy, n);
        for (size_t i = 0; i < y1.size(); ++i) ASSERT_EQ(y1[i], y2[i]) << i;
      }
}

// argmax: the scalar loop's index (first of the largest, NaNs never win, a NaN at 0 gives 0) for lengths around
// the 16-lane vectors and 256-element blocks, ties inside and across blocks, signed zeros and infinities.
TEST_P(OpsLevelTest, ArgmaxEqualsScalar) {
  SKIP_IF_UNAVAILABLE(GetParam());
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {0, 1, 2, 15, 16, 17, 255, 256, 257, 1000, 50257}) {
    for (int variant = 0; variant < 9; ++variant) {
      SCOPED_TRACE("n=" + std::to_string(n) + " variant=" + std::to_string(variant));
      std::vector<float> x = random_vec(std::max<int64_t>(n, 1), -3, 3, rng);
      const int64_t a = n > 0 ? (int64_t)(rng() % (uint32_t)n) : 0;
      const int64_t b = n > 0 ? (int64_t)(rng() % (uint32_t)n) : 0;
      switch (variant) {
        case 1: x[a] = x[b] = 9.0f; break;                                  // a tie
        case 2: x[0] = nan; break;                                          // NaN in front
        case 3: x[a] = nan; x[b] = 5.0f; break;                            // NaN elsewhere
        case 4: std::fill(x.begin(), x.end(), -inf); break;                 // nothing above -inf
        case 5: std::fill(x.begin(), x.end(), nan); break;
        case 6: for (float& v : x) v = -std::fabs(v); x[a] = -0.0f; x[b] = 0.0f; break;  // signed zeros
        case 7: x[a] = inf; x[b] = inf; break;
        case 8: std::fill(x.begin(), x.end(), 1.0f); break;                 // all equal
        default: break;
      }
      ASSERT_EQ(table().argmax(x.data(), n), ref().argmax(x.data(), n));
    }
  }
}

// exp_weights: each weight within 2 ulp of the scalar level's std::exp (exactly equal at the scalar level),
// the sum within 1e-13 relative, for differences from 0 down past exp's underflow (-745: subnormal and zero
// weights), scales around 1, lengths around the 16-float step.
TEST_P(OpsLevelTest, ExpWeightsMatchScalar) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : {1, 15, 16, 17, 100, 50257}) {
    for (double scale : {1.0, 1.0 / 0.7, 1.0 / 1.3, 0.1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " scale=" + std::to_string(scale));
      std::vector<float> x = random_vec(n, -12, 4, rng);
      if (n > 20) {
        x[3] = -700.0f, x[5] = -745.0f, x[7] = -760.0f, x[9] = -1e30f;
        x[11] = -7.0f * 1024.0f;  // far below: 0
      }
      const float mx = *std::max_element(x.begin(), x.end());
      std::vector<double> w1((size_t)n), w2((size_t)n);
      const double s1 = ref().exp_weights(x.data(), n, mx, scale, w1.data());
      const double s2 = table().exp_weights(x.data(), n, mx, scale, w2.data());
      for (int64_t i = 0; i < n; ++i) {
        if (GetParam() == KernelLevel::Scalar) {
          ASSERT_EQ(w1[(size_t)i], w2[(size_t)i]) << i;
        } else if (w1[(size_t)i] >= std::numeric_limits<double>::min()) {
          ASSERT_NEAR(w2[(size_t)i] / w1[(size_t)i], 1.0, 4.5e-16) << i << " x " << x[(size_t)i];
        } else {
          ASSERT_NEAR(w2[(size_t)i], w1[(size_t)i], 1e-320) << i;  // subnormal or zero: absolute
        }
      }
      ASSERT_NEAR(s2 / s1, 1.0, 1e-13);
    }
  }
}

// The several-heads version must equal, bit for bit, one axpy_f16 call per (head, row) at the same level, for
// head sizes on and off its 16-column vectors, head counts around its 8-vector tile, a row stride wider than
// the heads, and a head's weights a stride apart.
TEST_P(OpsLevelTest, AxpyF16HeadsEqualsRepeatedAxpyF16) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t hd : {16, 20, 32, 64, 128})
    for (int64_t rows : {0, 1, 5, 16})
      for (int64_t heads : {1, 3, 8, 12}) {
        SCOPED_TRACE("hd=" + std::to_string(hd) + " rows=" + std::to_string(rows) + " heads=" + std::to_string(heads));
        const size_t ldx = (size_t)(heads * hd) + 24, lda = (size_t)rows + 7;
        std::vector<float> xf = random_vec((int64_t)ldx * std::max<int64_t>(rows, 1), -2, 2, rng);
        std::vector<uint16_t> x(xf.size());
        for (size_t i = 0; i < x.size(); ++i) x[i] = f32_to_fp16(xf[i]);
        std::vector<float> a = random_vec((int64_t)lda * heads, 0, 1, rng);
        std::vector<float> y1 = random_vec(heads * hd + 3, -1, 1, rng), y2 = y1;
        for (int64_t j = 0; j < heads; ++j)
          for (int64_t p = 0; p < rows; ++p)
            table().axpy_f16(a[j * lda + p], x.data() + p * ldx + j * hd, &y1[(size_t)(j * hd)], hd);
        table().axpy_f16_heads(a.data(), lda, heads, x.data(), ldx, rows, y2.data(), hd);
        for (size_t i = 0; i < y1.size(); ++i) ASSERT_EQ(y1[i], y2[i]) << i;
      }
}

// scores_f16 must equal, bit for bit, the F16 matmul at the same level (and so the scalar reference, which
// MatmulLevel ties to it) for attention's shapes: K blocks of up to 16 rows and beyond, row strides wider
// than the row, head sizes on and off its 64-multiple fast path, up to and past the 6-token group.
TEST_P(OpsLevelTest, ScoresF16EqualsMatmulF16) {
  SKIP_IF_UNAVAILABLE(GetParam());
  const MatmulKernel* mm = table().matmul(DType::F16);
  for (int64_t k : {32, 64, 96, 128, 192, 256, 320})
    for (int64_t rows : {1, 5, 15, 16, 17, 40})
      for (int64_t nt : {1, 2, 5, 6, 7, 9}) {
        SCOPED_TRACE("k=" + std::to_string(k) + " rows=" + std::to_string(rows) + " tokens=" + std::to_string(nt));
        const size_t ldw = (size_t)k * 3 + 8, ldx = (size_t)k + 5;
        const int64_t ldy = rows + 11;
        std::vector<uint16_t> w(ldw * (size_t)rows);
        const std::vector<float> wv = random_vec((int64_t)w.size(), -2, 2, rng);
        for (size_t i = 0; i < w.size(); ++i) w[i] = f32_to_fp16(wv[i]);
        const std::vector<float> x = random_vec((int64_t)ldx * nt, -1, 1, rng);
        std::vector<float> y1((size_t)(ldy * nt), 7.0f), y2 = y1;
        mm->rows(w.data(), ldw * 2, 0, rows, x.data(), ldx * 4, nt, k, y1.data(), ldy);
        table().scores_f16(w.data(), ldw * 2, 0, rows, x.data(), ldx * 4, nt, k, y2.data(), ldy);
        for (size_t i = 0; i < y1.size(); ++i) ASSERT_EQ(y1[i], y2[i]) << i;
        // A sub-range of rows writes only its own outputs.
        std::vector<float> y3((size_t)(ldy * nt), 7.0f);
        table().scores_f16(w.data(), ldw * 2, rows / 2, rows, x.data(), ldx * 4, nt, k, y3.data(), ldy);
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t r = 0; r < ldy; ++r)
            ASSERT_EQ(y3[(size_t)(t * ldy + r)], r >= rows / 2 && r < rows ? y1[(size_t)(t * ldy + r)] : 7.0f) << r;
      }
}

// The fused Q8_0 version must equal, bit for bit, the scalar reference dequantize_row followed by one axpy per
// (output, row) at the same level (what the runtime called before), for widths around its 32/64/128-column
// tiles, a row stride wider than the row, and output counts around the 6-output tile.
TEST_P(OpsLevelTest, AxpyQ8_0RowsEqualsDequantizeThenAxpy) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::uniform_int_distribution<int> qdist(-128, 127);
  for (int64_t n : {32, 64, 96, 128, 160, 256})
    for (int64_t rows : {0, 1, 3, 37})
      for (int64_t n_vec : {1, 2, 3, 5, 6, 7, 13}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " rows=" + std::to_string(rows) + " vectors=" + std::to_string(n_vec));
        const size_t row_bytes = (size_t)n / 32 * 34, ldx = row_bytes + 7, lda = (size_t)rows + 3,
                     ldy = (size_t)n + 2;
        std::vector<uint8_t> x(ldx * (size_t)std::max<int64_t>(rows, 1));
        for (int64_t p = 0; p < rows; ++p)
          for (int64_t b = 0; b < n / 32; ++b) {
            uint8_t* blk = x.data() + (size_t)p * ldx + (size_t)b * 34;
            const uint16_t d = f32_to_fp16(random_vec(1, 1e-3f, 0.05f, rng)[0]);
            std::memcpy(blk, &d, 2);
            for (int j = 0; j < 32; ++j) blk[2 + j] = (uint8_t)(int8_t)qdist(rng);
          }
        std::vector<float> a = random_vec((int64_t)lda * n_vec, 0, 1, rng);
        std::vector<float> y1 = random_vec((int64_t)ldy * n_vec, -1, 1, rng), y2 = y1, row((size_t)n);
        for (int64_t v = 0; v < n_vec; ++v)
          for (int64_t p = 0; p < rows; ++p) {
            dequantize_row(DType::Q8_0, x.data() + (size_t)p * ldx, row.data(), n);
            table().axpy(a[v * lda + p], row.data(), &y1[v * ldy], n);
          }
        table().axpy_q8_0_rows(a.data(), lda, n_vec, x.data(), ldx, rows, y2.data(), ldy, n);
        for (size_t i = 0; i < y1.size(); ++i) ASSERT_EQ(y1[i], y2[i]) << i;
      }
}

// The K/V cache's Q8_0 writes must be the reference quantizer's bytes: random blocks of several magnitudes, an
// all-zero block, and a block with amax 127 (d = 1, id = 1) whose values sit exactly on and next to halves.
TEST_P(OpsLevelTest, QuantizeQ8_0MatchesReference) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::vector<float> x;
  for (float scale : {1e-6f, 0.01f, 1.0f, 300.0f})
    for (int b = 0; b < 256; ++b) {
      const std::vector<float> v = random_vec(32, -scale, scale, rng);
      x.insert(x.end(), v.begin(), v.end());
    }
  x.insert(x.end(), 32, 0.0f);
  for (int j = 0; j < 32; ++j) {
    const float f = j == 0 ? 127.0f : (float)(j % 16) - 7.5f;
    x.push_back(j % 3 == 2 ? std::nextafter(f, 0.0f) : j % 5 == 4 ? std::nextafter(f, 200.0f) : f);
  }
  x.push_back(-127.0f);
  for (int j = 1; j < 32; ++j) x.push_back(j % 2 ? 0.5f * (float)j : -0.5f * (float)j);
  const int64_t n = (int64_t)x.size();
  const size_t bytes = (size_t)n / 32 * 34;
  std::vector<uint8_t> want(bytes), got(bytes, 0xAB);
  ASSERT_TRUE(quant_quantize_row(DType::Q8_0, x.data(), want.data(), n));
  table().quantize_q8_0(x.data(), got.data(), n);
  for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(want[i], got[i]) << "byte " << i << " (block " << i / 34 << ")";
}

// Hardware conversions against the software ones: round to nearest even, halfway cases, overflow to
// infinity, subnormal halves, signed zero.
TEST_P(OpsLevelTest, F16RoundingMatchesSoftware) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::vector<float> x = random_vec(1000, -70000, 70000, rng);
  for (float f : {0.0f, -0.0f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, 65504.0f, 65519.0f, 65520.0f, 1e-7f, -3e-6f,
                  6.1e-5f, 1e30f, -1e30f})
    x.push_back(f);
  const std::vector<float> small = random_vec(1000, -1e-4f, 1e-4f, rng);
  x.insert(x.end(), small.begin(), small.end());
  for (int64_t n : {(int64_t)x.size(), (int64_t)7, (int64_t)1}) {
    std::vector<float> r((size_t)n);
    std::vector<uint16_t> h((size_t)n);
    table().round_f16(x.data(), r.data(), n);
    table().to_f16(x.data(), h.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(h[i], f32_to_fp16(x[i])) << x[i];
      const float want = fp16_to_f32(f32_to_fp16(x[i]));
      ASSERT_EQ(0, std::memcmp(&r[i], &want, 4)) << x[i];
    }
  }
}

TEST_P(OpsLevelTest, Softmax) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t n : kSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    std::vector<float> x = random_vec(n, -30, 30, rng);
    for (int64_t i = 1; i < n; i += 3) x[i] = -INFINITY;  // masked positions
    std::vector<float> want = x, got = x;
    ref().softmax(want.data(), n);
    table().softmax(got.data(), n);
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] == -INFINITY) {
        ASSERT_EQ(got[i], 0.0f) << i;
      }
      ASSERT_NEAR(got[i], want[i], 1e-5 * want[i] + 1e-7) << i;
      total += got[i];
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
  }
}

TEST_P(OpsLevelTest, SoftmaxEdgeCases) {
  SKIP_IF_UNAVAILABLE(GetParam());
  float one = 3.5f;
  table().softmax(&one, 1);
  EXPECT_EQ(one, 1.0f);
  std::vector<float> all_masked(19, -INFINITY);
  table().softmax(all_masked.data(), 19);
  for (float v : all_masked) EXPECT_EQ(v, 0.0f);
  std::vector<float> equal(23, 2.0f);
  table().softmax(equal.data(), 23);
  for (float v : equal) EXPECT_NEAR(v, 1.0f / 23, 1e-7);
}

// The fused RoPE + K/V write replaced rope_apply followed by to_f16 in the backend: at every level it must give
// their bits exactly (rotated row and half row), for head sizes around the vector widths, partial rotation
// (n_rot < head_dim, including 0) and with or without the half output.
TEST_P(OpsLevelTest, RopeFusedWithF16WriteEqualsApplyThenConvert) {
  SKIP_IF_UNAVAILABLE(GetParam());
  for (int64_t head_dim : {2, 6, 16, 30, 32, 64, 100, 128})
    for (int64_t n_rot : {(int64_t)0, (int64_t)2, head_dim / 4 * 2, head_dim - 2, head_dim})
      for (int64_t pos : {0, 17, 1000})
        for (bool half : {true, false}) {
          if (n_rot < 0) continue;
          SCOPED_TRACE("head_dim=" + std::to_string(head_dim) + " n_rot=" + std::to_string(n_rot) +
                       " pos=" + std::to_string(pos) + (half ? " f16" : ""));
          const int64_t n_heads = 3, n = n_heads * head_dim;
          const std::vector<float> x0 = random_vec(n, -4, 4, rng);
          std::vector<float> cs((size_t)n_rot + 2);
          rope_angles(n_rot, pos, 10000.0f, cs.data());
          std::vector<float> want = x0, got = x0, ref_x = x0;
          std::vector<uint16_t> want16((size_t)n, 0x7e00), got16((size_t)n, 0x7e00), ref16((size_t)n, 0x7e00);
          rope_apply(want.data(), n_heads, head_dim, n_rot, cs.data());
          if (half) ref().to_f16(want.data(), want16.data(), n);
          table().rope(got.data(), n_heads, head_dim, n_rot, cs.data(), half ? got16.data() : nullptr);
          ref().rope(ref_x.data(), n_heads, head_dim, n_rot, cs.data(), half ? ref16.data() : nullptr);
          ASSERT_EQ(0, std::memcmp(want.data(), got.data(), (size_t)n * sizeof(float)));
          ASSERT_EQ(0, std::memcmp(want.data(), ref_x.data(), (size_t)n * sizeof(float)));
          ASSERT_EQ(want16, got16);
          ASSERT_EQ(want16, ref16);
        }
}

INSTANTIATE_TEST_SUITE_P(Levels, OpsLevelTest,
                         ::testing::Values(KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512),
                         [](const auto& info) { return std::string(kernel_level_name(info.param)); });

// theta_i = pos * base^(-2i/n_rot) on pairs (2i, 2i+1); dims past n_rot unchanged. The kernel follows ggml's
// float recurrence, whose angle error grows with pos, hence the pos-dependent tolerance.
TEST(Rope, MatchesDoubleFormula) {
  std::mt19937 rng(5);
  for (int64_t head_dim : {64, 128})
    for (int64_t n_rot : {head_dim, head_dim / 2, (int64_t)2})
      for (float base : {10000.0f, 500000.0f})
        for (int64_t pos : {0, 1, 7, 100, 1000, 4095}) {
          SCOPED_TRACE("head_dim=" + std::to_string(head_dim) + " n_rot=" + std::to_string(n_rot) +
                       " pos=" + std::to_string(pos));
          const int64_t n_heads = 3;
          std::vector<float> x = random_vec(n_heads * head_dim, -2, 2, rng), y = x;
          rope_inplace(y.data(), n_heads, head_dim, n_rot, pos, base);
          for (int64_t h = 0; h < n_heads; ++h)
            for (int64_t i = 0; i < head_dim; i += 2) {
              const float* in = &x[(size_t)(h * head_dim + i)];
              const float* out = &y[(size_t)(h * head_dim + i)];
              if (i >= n_rot) {
                ASSERT_EQ(out[0], in[0]);
                ASSERT_EQ(out[1], in[1]);
                continue;
              }
              const double th = (double)pos * std::pow((double)base, -(double)i / (double)n_rot);
              const double want0 = in[0] * std::cos(th) - in[1] * std::sin(th);
              const double want1 = in[0] * std::sin(th) + in[1] * std::cos(th);
              const double tol = (std::fabs(in[0]) + std::fabs(in[1])) * (4e-7 * (double)pos + 1e-6) + 1e-6;
              ASSERT_NEAR(out[0], want0, tol) << "pair " << i / 2;
              ASSERT_NEAR(out[1], want1, tol) << "pair " << i / 2;
            }
        }
}

// The backend shares one angle table between the q and k rows of a position: the split functions must give
// rope_inplace's bits.
TEST(Rope, AnglesThenApplyEqualsInplace) {
  std::mt19937 rng(9);
  for (int64_t n_rot : {(int64_t)0, (int64_t)2, (int64_t)30, (int64_t)64})
    for (int64_t pos : {0, 3, 511, 4095}) {
      std::vector<float> x = random_vec(5 * 64, -3, 3, rng), y = x;
      rope_inplace(x.data(), 5, 64, n_rot, pos, 10000.0f);
      std::vector<float> cs((size_t)n_rot + 2);
      rope_angles(n_rot, pos, 10000.0f, cs.data());
      rope_apply(y.data(), 5, 64, n_rot, cs.data());
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << "n_rot " << n_rot << " pos " << pos;
    }
}

TEST(DequantizeRow, FloatTypes) {
  std::mt19937 rng(3);
  const std::vector<float> v = random_vec(37, -100, 100, rng);
  std::vector<float> out(v.size());
  dequantize_row(DType::F32, v.data(), out.data(), (int64_t)v.size());
  EXPECT_EQ(out, v);
  std::vector<uint16_t> h(v.size()), b(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    h[i] = f32_to_fp16(v[i]);
    b[i] = f32_to_bf16(v[i]);
  }
  dequantize_row(DType::F16, h.data(), out.data(), (int64_t)v.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(out[i], fp16_to_f32(h[i]));
  dequantize_row(DType::BF16, b.data(), out.data(), (int64_t)v.size());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(out[i], bf16_to_f32(b[i]));
}

TEST(DequantizeRow, UnsupportedTypeThrows) {
  int32_t src[4] = {};
  float dst[4];
  EXPECT_THROW(dequantize_row(DType::I32, src, dst, 4), Error);
}

TEST(KernelLevelSelection, SetKernelLevelSelectsScalarTable) {
  const KernelLevel before = active_kernel_level();
  set_kernel_level(KernelLevel::Scalar);
  EXPECT_EQ(kernels().level, KernelLevel::Scalar);
  EXPECT_EQ(kernels().dot, kernels_for(KernelLevel::Scalar).dot);
  EXPECT_EQ(kernels().matmul(DType::F32)->rows, kernels_for(KernelLevel::Scalar).matmul(DType::F32)->rows);
  set_kernel_level(best_kernel_level());
  EXPECT_EQ(kernels().level, best_kernel_level());
  set_kernel_level(before);
}

TEST(KernelLevelSelection, TablesAreCappedByCpu) {
  EXPECT_EQ(kernels_for(KernelLevel::Avx512).level, std::min(KernelLevel::Avx512, best_kernel_level()));
}

// MERLIN_KERNELS is read once per process, so check it in a fresh one (threadsafe death tests re-exec).
TEST(KernelLevelSelection, EnvironmentForcesScalar) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ::setenv("MERLIN_KERNELS", "scalar", 1);
  EXPECT_EXIT(std::exit(kernels().level == KernelLevel::Scalar ? 0 : 1), ::testing::ExitedWithCode(0), "");
  ::unsetenv("MERLIN_KERNELS");
}

}  // namespace
}  // namespace merlin::kernels
