// Quantized matmuls: every SIMD level against the scalar oracle on awkward shapes (few rows, odd token
// counts, huge k, row sub-ranges, ldy > rows), with weights from the quantizers and from raw random bytes.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_formats.h"
#include "quant_test_util.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::kernels;

namespace {

using test::gaussian;
using test::randomize_blocks;

const DType kTypes[] = {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ1_0, DType::TQ2_0};

std::vector<KernelLevel> simd_levels() {
  std::vector<KernelLevel> out;
  for (KernelLevel l : {KernelLevel::Avx2, KernelLevel::Avx512})
    if (l <= best_kernel_level()) out.push_back(l);
  return out;
}


struct Case {
  int64_t rows, k, n_tokens;
  int64_t r0, r1;  // the sub-range computed
  int64_t ldy;
};

std::string describe(DType type, KernelLevel level, const Case& c, bool raw) {
  return cat(dtype_name(type), " level ", kernel_level_name(level), " rows ", c.rows, " k ", c.k, " tokens ",
             c.n_tokens, " range [", c.r0, ",", c.r1, ") ldy ", c.ldy, raw ? " raw weights" : " quantized weights");
}

// Runs the scalar kernel and `level`'s on the same inputs and compares. The tolerance is relative to
// sum |w_i x_i| (with dequantized operands), so cancellation in the result cannot make it meaningless.
void check_case(DType type, KernelLevel level, const Case& c, bool raw, uint32_t seed) {
  const MatmulKernel* ref = quant_matmul_kernel(type, KernelLevel::Scalar);
  const MatmulKernel* simd = quant_matmul_kernel(type, level);
  ASSERT_NE(ref, nullptr);
  ASSERT_NE(simd, nullptr);
  ASSERT_EQ(ref->act_type, simd->act_type);
  const size_t w_row = dtype_row_bytes(type, (uint64_t)c.k);
  const size_t x_row = dtype_row_bytes(ref->act_type, (uint64_t)c.k);
  const DTypeInfo& info = dtype_info(type);

  std::vector<uint8_t> w(w_row * c.rows);
  if (raw) {
    randomize_blocks(type, w.data(), w.size() / info.block_bytes, seed);
  } else {
    const auto wf = gaussian((size_t)(c.rows * c.k), seed, 0.05f);
    for (int64_t r = 0; r < c.rows; ++r) quant_quantize_row(type, &wf[r * c.k], &w[r * w_row], c.k);
  }
  const auto xf = gaussian((size_t)(c.n_tokens * c.k), seed + 1);
  std::vector<uint8_t> xr(x_row * c.n_tokens), xs(x_row * c.n_tokens);
  ref->quantize_act(xf.data(), c.n_tokens, c.k, xr.data());
  simd->quantize_act(xf.data(), c.n_tokens, c.k, xs.data());
  ASSERT_EQ(0, std::memcmp(xr.data(), xs.data(), xr.size())) << "quantize_act differs: " << describe(type, level, c, raw);

  const float kSentinel = 1234.5f;
  std::vector<float> yr(c.n_tokens * c.ldy, kSentinel), ys(c.n_tokens * c.ldy, kSentinel);
  ref->rows(w.data(), w_row, c.r0, c.r1, xr.data(), x_row, c.n_tokens, c.k, yr.data(), c.ldy);
  simd->rows(w.data(), w_row, c.r0, c.r1, xs.data(), x_row, c.n_tokens, c.k, ys.data(), c.ldy);

  std::vector<float> wd(c.k), xd(c.k);
  int bad = 0;
  for (int64_t t = 0; t < c.n_tokens; ++t) {
    dequantize_row(ref->act_type, &xr[t * x_row], xd.data(), c.k);
    for (int64_t i = 0; i < c.ldy; ++i) {
      const float a = yr[t * c.ldy + i], b = ys[t * c.ldy + i];
      if (i < c.r0 || i >= c.r1) {
        if (b != kSentinel && bad++ < 5) ADD_FAILURE() << "wrote outside its rows at token " << t << " row " << i;
        continue;
      }
      dequantize_row(type, &w[i * w_row], wd.data(), c.k);
      double mag = 0;
      for (int64_t j = 0; j < c.k; ++j) mag += std::fabs((double)wd[j] * xd[j]);
      const double tol = 1e-5 * mag + 1e-30;
      if (!(std::fabs((double)a - b) <= tol) && bad++ < 5)
        ADD_FAILURE() << describe(type, level, c, raw) << ": token " << t << " row " << i << " scalar " << a
                      << " simd " << b << " tol " << tol;
    }
  }
}

std::vector<Case> cases_for(DType type) {
  const int64_t B = dtype_info(type).block_size;
  std::vector<Case> out;
  for (int64_t rows : {1, 3, 17, 64})
    for (int64_t n_tokens : {1, 2, 5, 9, 33}) {
      const int64_t k = B == 32 ? 96 : 512;
      out.push_back({rows, k, n_tokens, 0, rows, rows});
    }
  // Longer rows, a row sub-range, ldy beyond the rows.
  out.push_back({40, 24 * B, 7, 3, 37, 45});
  out.push_back({21, 3 * B, 16, 5, 21, 29});
  out.push_back({70, B, 40, 0, 70, 71});
  // Huge k: integer sums over many blocks.
  out.push_back({5, 16384, 1, 0, 5, 5});
  out.push_back({9, 16384, 12, 1, 9, 9});
  // Long rows with an odd number of blocks: the GEMMs' row chunks shrink and their buffers lose alignment.
  out.push_back({10, B == 32 ? 16416 : 16640, 12, 0, 10, 10});
  return out;
}

}  // namespace

class QuantMatmul : public ::testing::TestWithParam<DType> {};

TEST_P(QuantMatmul, EveryLevelMatchesScalar) {
  const DType type = GetParam();
  const auto levels = simd_levels();
  if (levels.empty()) GTEST_SKIP() << "no SIMD level on this CPU";
  uint32_t seed = 1;
  for (KernelLevel level : levels)
    for (const Case& c : cases_for(type))
      for (bool raw : {false, true}) {
        check_case(type, level, c, raw, seed++);
        if (HasFatalFailure()) return;
      }
}

TEST_P(QuantMatmul, EveryLevelHasAKernel) {
  for (KernelLevel level : {KernelLevel::Scalar, KernelLevel::Avx2, KernelLevel::Avx512}) {
    const MatmulKernel* k = quant_matmul_kernel(GetParam(), level);
    ASSERT_NE(k, nullptr);
    EXPECT_NE(k->rows, nullptr);
    EXPECT_NE(k->quantize_act, nullptr);
    EXPECT_TRUE(k->act_type == DType::Q8_0 || k->act_type == DType::Q8_K);
  }
}

// The scalar kernel against a float dot product of the dequantized operands: guards the oracle itself.
TEST_P(QuantMatmul, ScalarMatchesDequantizedDot) {
  const DType type = GetParam();
  const MatmulKernel* ref = quant_matmul_kernel(type, KernelLevel::Scalar);
  const int64_t k = 1024, rows = 5, n_tokens = 3;
  const size_t w_row = dtype_row_bytes(type, k), x_row = dtype_row_bytes(ref->act_type, k);
  const auto wf = gaussian(rows * k, 7, 0.05f), xf = gaussian(n_tokens * k, 8);
  std::vector<uint8_t> w(w_row * rows), x(x_row * n_tokens);
  for (int64_t r = 0; r < rows; ++r) quant_quantize_row(type, &wf[r * k], &w[r * w_row], k);
  ref->quantize_act(xf.data(), n_tokens, k, x.data());
  std::vector<float> y(rows * n_tokens);
  ref->rows(w.data(), w_row, 0, rows, x.data(), x_row, n_tokens, k, y.data(), rows);
  std::vector<float> wd(k), xd(k);
  for (int64_t t = 0; t < n_tokens; ++t) {
    dequantize_row(ref->act_type, &x[t * x_row], xd.data(), k);
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(type, &w[r * w_row], wd.data(), k);
      double s = 0, mag = 0;
      for (int64_t j = 0; j < k; ++j) {
        s += (double)wd[j] * xd[j];
        mag += std::fabs((double)wd[j] * xd[j]);
      }
      EXPECT_NEAR(y[t * rows + r], s, 1e-5 * mag) << dtype_name(type) << " token " << t << " row " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantMatmul, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

// Through the public kernel tables too (what the runtime calls).
TEST(QuantMatmulTables, KernelTablesExposeQuantizedTypes) {
  for (DType t : kTypes) {
    EXPECT_NE(kernels_for(KernelLevel::Scalar).matmul(t)->rows, nullptr) << dtype_name(t);
    EXPECT_NE(merlin::kernels::kernels().matmul(t)->rows, nullptr) << dtype_name(t);
  }
}
