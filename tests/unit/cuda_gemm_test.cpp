// The prefill products through cuBLAS (GemmRunner, gemm.cu) against a double-precision product of the
// exactly dequantized weights and the f32 activations, for every weight type the GPU supports, with rows
// that are not a multiple of the 16-row tile, a matrix larger than one expansion chunk, and the accumulate
// epilogue. Skips without a GPU or without libcublas.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/quant.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"
#include "cuda_test_util.h"
#include "quant_test_util.h"
#include "test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;
using test::DevFloats;

namespace {

#define REQUIRE_GEMM()                                                     \
  do {                                                                     \
    MERLIN_REQUIRE_GPU();                                                  \
    std::string why_;                                                      \
    if (!cu::gemm_available(&why_)) GTEST_SKIP() << "no cuBLAS: " << why_; \
  } while (0)

// A rows x k matrix of `type` in GGUF layout and its exact values as floats.
struct HostMatrix {
  std::vector<uint8_t> raw;
  std::vector<float> values;
  size_t row_bytes;
};

HostMatrix random_matrix(DType type, int64_t rows, int64_t k, uint32_t seed) {
  HostMatrix m;
  m.row_bytes = dtype_row_bytes(type, (uint64_t)k);
  m.raw.resize((size_t)rows * m.row_bytes);
  m.values.resize((size_t)rows * k);
  if (type == DType::F16 || type == DType::BF16) {
    const std::vector<float> v = test::gaussian((size_t)rows * k, seed, 0.1f);
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = type == DType::F16 ? f32_to_fp16(v[i]) : f32_to_bf16(v[i]);
      std::memcpy(&m.raw[2 * i], &h, 2);
      m.values[i] = type == DType::F16 ? fp16_to_f32(h) : bf16_to_f32(h);
    }
  } else {
    test::randomize_blocks(type, m.raw.data(), m.raw.size() / dtype_info(type).block_bytes, seed);
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_TRUE(kernels::quant_dequantize_row(type, m.raw.data() + r * m.row_bytes, &m.values[(size_t)r * k], k));
  }
  return m;
}


// y = 1 + W x through GemmRunner (accumulate), checked against the double product. The error allowed is the
// half rounding of weights (f16: 2^-11 relative; bf16 weights are exact) and of x (f16 2^-11, bf16 2^-8),
// summed over k with random signs: bounded here by a fraction of max |y| that a wrong row, column or scale
// (an O(1) error) cannot meet.
void check_gemm(DType t, int64_t rows, int64_t k, int n, cu::GemmRunner& runner) {
  SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(rows) + " k " + std::to_string(k) + " tokens " +
               std::to_string(n));
  const HostMatrix w = random_matrix(t, rows, k, (uint32_t)(rows * 3 + k + n));
  const std::vector<float> x = test::gaussian((size_t)n * k, (uint32_t)n + 7);
  std::vector<double> want((size_t)n * rows);
  double amax = 0;
  for (int tok = 0; tok < n; ++tok)
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t i = 0; i < k; ++i) s += (double)w.values[(size_t)r * k + i] * x[(size_t)tok * k + i];
      want[(size_t)tok * rows + r] = s;
      amax = std::max(amax, std::fabs(s));
    }
  const cu::MatrixPart part{t, w.raw.data(), rows, k, w.row_bytes};
  cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
  cu::ActBuf a = cu::act_alloc(cu::gemm_act_kind(m), k, n);
  DevFloats dx(x), dy(std::vector<float>((size_t)n * rows, 1.0f));
  cu::PrepArgs p;
  p.d_x = dx.p;
  p.ld = k;
  cu::prep_act(p, n, a, nullptr);
  runner.run(m, a, n, dy.p, rows, rows, true, nullptr);
  cu::sync_device();
  std::vector<float> got((size_t)n * rows);
  cu::copy_to_host(got.data(), dy.p, got.size() * 4);
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs((double)got[i] - 1.0 - want[i]));
  const double tol = (t == DType::BF16 ? 1e-2 : 2e-3) * amax;
  EXPECT_LE(worst, tol) << "max |y| " << amax;
  std::printf("[ gemm ] %-6s %5lld x %5lld, %3d tokens: max error %.3g of max |y|\n", dtype_name(t), (long long)rows,
              (long long)k, n, worst / amax);
  cu::act_free(a);
  cu::free_matrix(m);
}

}  // namespace

TEST(CudaGemm, MatchesDoubleProductForEveryType) {
  REQUIRE_GEMM();
  cu::GemmRunner runner;  // one runner for all: its scratch grows and is reused across shapes
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ1_0,
                  DType::TQ2_0}) {
    const bool super = t == DType::Q4_K || t == DType::TQ1_0 || t == DType::TQ2_0;
    check_gemm(t, 37, super ? 768 : 96, 64, runner);
    check_gemm(t, 130, super ? 1280 : 800, 100, runner);
  }
  // Half matrices are multiplied in place with rows padded to 32 columns (lda 64 for k = 48).
  check_gemm(DType::F16, 23, 48, 64, runner);
  check_gemm(DType::BF16, 23, 48, 64, runner);
}

// 4,100 rows of k = 4,096 are two expansion chunks of 32 MiB (4,096 rows each): the second chunk is a
// partial one and its output lands at row 4,096 (BF16 is multiplied in place, in one piece).
TEST(CudaGemm, MatrixLargerThanOneChunk) {
  REQUIRE_GEMM();
  cu::GemmRunner runner(32 << 20);
  check_gemm(DType::Q4_0, 4100, 4096, 65, runner);
  check_gemm(DType::BF16, 4100, 4096, 65, runner);
}

// Only the first n_out_rows rows are written (the output head's padded rows never reach y).
TEST(CudaGemm, WritesOnlyTheRowsAskedFor) {
  REQUIRE_GEMM();
  const int64_t rows = 40, k = 64;
  const int n = 70;
  const HostMatrix w = random_matrix(DType::Q8_0, rows, k, 5);
  const cu::MatrixPart part{DType::Q8_0, w.raw.data(), rows, k, w.row_bytes};
  cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
  cu::ActBuf a = cu::act_alloc(cu::gemm_act_kind(m), k, n);
  DevFloats dx(test::gaussian((size_t)n * k, 3)), dy(std::vector<float>((size_t)n * 48, -7.0f));
  cu::PrepArgs p;
  p.d_x = dx.p;
  p.ld = k;
  cu::prep_act(p, n, a, nullptr);
  cu::GemmRunner runner;
  runner.run(m, a, n, dy.p, 48, 33, false, nullptr);
  cu::sync_device();
  std::vector<float> got((size_t)n * 48);
  cu::copy_to_host(got.data(), dy.p, got.size() * 4);
  for (int tok = 0; tok < n; ++tok)
    for (int r = 33; r < 48; ++r) ASSERT_EQ(got[(size_t)tok * 48 + r], -7.0f) << "token " << tok << " row " << r;
  cu::act_free(a);
  cu::free_matrix(m);
}
