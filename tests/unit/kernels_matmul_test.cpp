// Float-weight matmuls at every kernel level against a double-precision reference and against the scalar
// level, on awkward shapes: k not a multiple of the vector width, row and token counts that leave tails in
// every tile, padded strides, a row sub-range, and ldy > rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"

namespace merlin {
// Readable parameter names in gtest failure messages.
inline void PrintTo(KernelLevel l, std::ostream* os) { *os << kernel_level_name(l); }
}  // namespace merlin

namespace merlin::kernels {
namespace {

bool level_available(KernelLevel l) { return l <= best_kernel_level(); }

#define SKIP_IF_UNAVAILABLE(level)                                                                       \
  if (!level_available(level))                                                                          \
  GTEST_SKIP() << "CPU lacks " << kernel_level_name(level) << " (has: " << cpu_features_string() << ")"

// Weights stored in their element type, plus the exact f32 values they represent.
struct Weights {
  DType type;
  int64_t rows, k;
  size_t row_bytes;              // may exceed k * element size (padded rows)
  std::vector<uint8_t> bytes;
  std::vector<float> values;     // rows x k, dequantized
};

Weights make_weights(DType type, int64_t rows, int64_t k, int64_t pad, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const size_t elem = type == DType::F32 ? 4 : 2;
  Weights w{type, rows, k, (size_t)(k + pad) * elem, {}, {}};
  w.bytes.assign(w.row_bytes * rows, 0xA5);  // padding is garbage on purpose
  w.values.resize((size_t)(rows * k));
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = w.bytes.data() + r * w.row_bytes;
    for (int64_t i = 0; i < k; ++i) {
      const float v = dist(rng);
      float stored = v;
      if (type == DType::F32) {
        std::memcpy(row + 4 * i, &v, 4);
      } else {
        const uint16_t h = type == DType::F16 ? f32_to_fp16(v) : f32_to_bf16(v);
        std::memcpy(row + 2 * i, &h, 2);
        stored = type == DType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
      }
      w.values[(size_t)(r * k + i)] = stored;
    }
  }
  return w;
}

struct Case {
  int64_t rows, k, n_tokens;
  int64_t r0 = 0, r1 = -1;  // -1: all rows
  int64_t x_pad = 0, w_pad = 0, y_pad = 0;
};

std::string describe(DType t, const Case& c) {
  return std::string(dtype_name(t)) + " rows=" + std::to_string(c.rows) + " k=" + std::to_string(c.k) +
         " tokens=" + std::to_string(c.n_tokens) + " r=[" + std::to_string(c.r0) + "," + std::to_string(c.r1) + ")";
}

// Runs the level's kernel and checks it against the exact product and against the scalar level.
void check_case(KernelLevel level, DType type, Case c, std::mt19937& rng) {
  if (c.r1 < 0) c.r1 = c.rows;
  SCOPED_TRACE(describe(type, c) + " level=" + kernel_level_name(level));
  const Weights w = make_weights(type, c.rows, c.k, c.w_pad, rng);
  const int64_t x_stride = c.k + c.x_pad;
  std::vector<float> x((size_t)(c.n_tokens * x_stride));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& v : x) v = dist(rng);
  const int64_t ldy = c.rows + c.y_pad;
  const float sentinel = -12345.0f;

  auto run = [&](KernelLevel l) {
    const MatmulKernel* mk = kernels_for(l).matmul(type);
    EXPECT_EQ(mk->act_type, DType::F32);
    EXPECT_EQ(mk->quantize_act, nullptr);
    std::vector<float> y((size_t)(c.n_tokens * ldy), sentinel);
    mk->rows(w.bytes.data(), w.row_bytes, c.r0, c.r1, x.data(), (size_t)x_stride * 4, c.n_tokens, c.k, y.data(), ldy);
    return y;
  };
  const std::vector<float> got = run(level);
  const std::vector<float> scalar = run(KernelLevel::Scalar);

  int failures = 0;
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    for (int64_t r = 0; r < ldy; ++r) {
      const size_t at = (size_t)(t * ldy + r);
      if (r < c.r0 || r >= c.r1) {  // outside the range: untouched
        ASSERT_EQ(got[at], sentinel) << "wrote outside [r0, r1) at t=" << t << " r=" << r;
        continue;
      }
      double exact = 0.0, mag = 0.0;
      for (int64_t i = 0; i < c.k; ++i) {
        const double p = (double)w.values[(size_t)(r * c.k + i)] * x[(size_t)(t * x_stride + i)];
        exact += p;
        mag += std::fabs(p);
      }
      const double tol = 1e-5 * mag + 1e-6;
      if (std::fabs(got[at] - exact) > tol || std::fabs(got[at] - scalar[at]) > tol ||
          std::fabs(scalar[at] - exact) > tol) {
        ADD_FAILURE() << "t=" << t << " r=" << r << " got " << got[at] << " scalar " << scalar[at] << " exact "
                      << exact;
        if (++failures > 5) return;
      }
    }
  }
}

class MatmulLevelTest : public ::testing::TestWithParam<KernelLevel> {};

TEST_P(MatmulLevelTest, AwkwardShapes) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(1234);
  for (DType type : {DType::F32, DType::F16, DType::BF16})
    for (int64_t k : {1, 7, 15, 17, 100, 768, 1000, 4099})
      for (int64_t rows : {1, 3, 17, 64})
        for (int64_t nt : {1, 2, 5, 8, 9, 33}) {
          check_case(GetParam(), type, Case{rows, k, nt, 0, -1, 0, 0, 3}, rng);
          if (HasFatalFailure()) return;
        }
}

// Padded weight/activation strides and a row sub-range that starts and ends mid-tile.
TEST_P(MatmulLevelTest, StridesAndRowRange) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(99);
  for (DType type : {DType::F32, DType::F16, DType::BF16})
    for (int64_t nt : {1, 3, 4, 6, 7, 13}) {
      check_case(GetParam(), type, Case{37, 131, nt, 5, 30, 9, 5, 11}, rng);
      if (HasFatalFailure()) return;
    }
}

// Larger than one packed block in both rows and k, so block edges and k accumulation are exercised.
TEST_P(MatmulLevelTest, SpansPackedBlocks) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(7);
  for (DType type : {DType::F32, DType::F16, DType::BF16}) {
    check_case(GetParam(), type, Case{600, 700, 50, 3, 597, 0, 2, 1}, rng);
    check_case(GetParam(), type, Case{300, 1030, 64, 0, -1, 1, 0, 0}, rng);
    if (HasFatalFailure()) return;
  }
}

// Prefill-sized products (k a multiple of 64, 64+ tokens, 64+ rows), which the AVX-512 level runs through
// packed panels with a vertical reduction: against the exact product, with row tails, a sub-range and padding.
TEST_P(MatmulLevelTest, PrefillPanels) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(31);
  for (DType type : {DType::F32, DType::F16, DType::BF16}) {
    check_case(GetParam(), type, Case{100, 512, 64, 0, -1, 0, 0, 0}, rng);
    check_case(GetParam(), type, Case{150, 768, 71, 5, 147, 16, 3, 2}, rng);
    check_case(GetParam(), type, Case{64, 1024, 130, 0, -1, 0, 0, 5}, rng);
    if (HasFatalFailure()) return;
  }
}

TEST_P(MatmulLevelTest, ZeroK) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::vector<float> w(4), x(4), y(8, 7.0f);
  kernels_for(GetParam()).matmul(DType::F32)->rows(w.data(), 0, 0, 4, x.data(), 0, 2, 0, y.data(), 4);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST_P(MatmulLevelTest, UnsupportedTypeHasNoRows) {
  SKIP_IF_UNAVAILABLE(GetParam());
  const MatmulKernel* mk = kernels_for(GetParam()).matmul(DType::I32);
  ASSERT_NE(mk, nullptr);
  EXPECT_EQ(mk->rows, nullptr);
}

// Batch invariance at the kernel level: a token's outputs are bit for bit the same whether it is computed
// alone (the decode path) or at any position of a batch (the tiled paths: 2-row tiles for k < 1024, 4-row
// tiles beyond, token groups of uneven sizes), for every row sub-range start.
TEST_P(MatmulLevelTest, TokenAloneEqualsTokenInBatch) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(2024);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (DType type : {DType::F32, DType::F16, DType::BF16})
    for (int64_t k : {100, 256, 1024, 1030})
      for (int64_t nt : {8, 13, 32, 33}) {
        const int64_t rows = 37, r0 = 3;
        SCOPED_TRACE(describe(type, Case{rows, k, nt, r0}) + " level=" + kernel_level_name(GetParam()));
        const Weights w = make_weights(type, rows, k, 0, rng);
        std::vector<float> x((size_t)(nt * k));
        for (float& v : x) v = dist(rng);
        const MatmulKernel* mk = kernels_for(GetParam()).matmul(type);
        std::vector<float> batch((size_t)(nt * rows)), alone((size_t)rows);
        mk->rows(w.bytes.data(), w.row_bytes, r0, rows, x.data(), (size_t)k * 4, nt, k, batch.data(), rows);
        for (int64_t t = 0; t < nt; ++t) {
          mk->rows(w.bytes.data(), w.row_bytes, r0, rows, x.data() + t * k, (size_t)k * 4, 1, k, alone.data(), rows);
          for (int64_t r = r0; r < rows; ++r)
            ASSERT_EQ(std::memcmp(&alone[(size_t)r], &batch[(size_t)(t * rows + r)], 4), 0) << "t=" << t << " r=" << r;
        }
      }
}

// The same for prefill-sized batches: each token of a 64+ token batch (the panel path) against itself alone
// (the decode path), over rows that leave a partial 64-row tile, with signed zeros among the weights.
TEST_P(MatmulLevelTest, TokenAloneEqualsTokenInPrefillBatch) {
  SKIP_IF_UNAVAILABLE(GetParam());
  std::mt19937 rng(77);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (DType type : {DType::F32, DType::F16, DType::BF16})
    for (int64_t k : {512, 768, 2048})
      for (int64_t nt : {64, 77}) {
        const int64_t rows = 150, r0 = 3;
        SCOPED_TRACE(describe(type, Case{rows, k, nt, r0}) + " level=" + kernel_level_name(GetParam()));
        Weights w = make_weights(type, rows, k, 0, rng);
        const size_t elem = type == DType::F32 ? 4 : 2;
        for (size_t i = 0; i < w.bytes.size(); i += 97 * elem) {  // +0 and -0 weights
          std::memset(&w.bytes[i], 0, elem);
          w.bytes[i + elem - 1] = (i / 97) % 2 ? 0x80 : 0x00;
        }
        std::vector<float> x((size_t)(nt * k));
        for (float& v : x) v = dist(rng);
        const MatmulKernel* mk = kernels_for(GetParam()).matmul(type);
        std::vector<float> batch((size_t)(nt * rows)), alone((size_t)rows);
        mk->rows(w.bytes.data(), w.row_bytes, r0, rows, x.data(), (size_t)k * 4, nt, k, batch.data(), rows);
        for (int64_t t = 0; t < nt; ++t) {
          mk->rows(w.bytes.data(), w.row_bytes, r0, rows, x.data() + t * k, (size_t)k * 4, 1, k, alone.data(), rows);
          for (int64_t r = r0; r < rows; ++r)
            ASSERT_EQ(std::memcmp(&alone[(size_t)r], &batch[(size_t)(t * rows + r)], 4), 0) << "t=" << t << " r=" << r;
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Levels, MatmulLevelTest,
                         ::testing::Values(KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512),
                         [](const auto& info) { return std::string(kernel_level_name(info.param)); });

}  // namespace
}  // namespace merlin::kernels
