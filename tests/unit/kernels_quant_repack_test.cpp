// Load-time repacked layouts (kernels::PackedMatmul: AVX-512 Q8_0, Q4_0, MXFP4, Q4_K and TQ2_0; AVX2 the same
// types in the same bytes): rows must read back
// exactly, and on awkward shapes (rows not a multiple of the 16-row group, one row, huge k, row sub-ranges,
// ldy > rows) the packed kernel must be independent of the number of tokens per call and stay close to the
// scalar oracle. Q8_0, Q4_0 and MXFP4 must also give bit for bit what the row-major kernel of the same level gives;
// the packed kernels of the super-block types (Q4_K, TQ2_0) sum each super-block exactly in integers where
// their row-major tiles convert partial sums per lane, so they only have to be close (the runtime uses one
// layout or the other for a weight).
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

struct Case {
  int64_t rows, k, n_tokens;
  int64_t r0, r1;  // r0 a multiple of kRepackRows
  int64_t ldy;
};

std::string describe(DType type, KernelLevel level, const Case& c, bool raw) {
  return cat(kernel_level_name(level), " ", dtype_name(type), " rows ", c.rows, " k ", c.k, " tokens ", c.n_tokens,
             " range [", c.r0, ",", c.r1, ") ldy ", c.ldy, raw ? " raw" : " quantized");
}

// Weights from the quantizer, or raw random bytes with finite scales (reaches Q8_0's -128, any Q4_K scale).
std::vector<uint8_t> make_weights(DType type, const Case& c, bool raw, uint32_t seed) {
  const size_t w_row = dtype_row_bytes(type, (uint64_t)c.k);
  std::vector<uint8_t> w(w_row * c.rows);
  std::mt19937 rng(seed);
  if (raw) {
    test::randomize_blocks(type, w.data(), w.size() / dtype_info(type).block_bytes, seed);
  } else {
    std::normal_distribution<float> dist(0.0f, 0.05f);
    std::vector<float> wf((size_t)c.k);
    for (int64_t r = 0; r < c.rows; ++r) {
      for (float& f : wf) f = dist(rng);
      quant_quantize_row(type, wf.data(), &w[r * w_row], c.k);
    }
  }
  return w;
}

void check_case(DType type, KernelLevel level, const Case& c, bool raw, uint32_t seed) {
  const MatmulKernel* ref = quant_matmul_kernel(type, KernelLevel::Scalar);
  const MatmulKernel* simd = quant_matmul_kernel(type, level);
  ASSERT_NE(simd->packed, nullptr);
  const PackedMatmul& pm = *simd->packed;
  const size_t w_row = dtype_row_bytes(type, (uint64_t)c.k), x_row = dtype_row_bytes(simd->act_type, (uint64_t)c.k);
  const std::vector<uint8_t> w = make_weights(type, c, raw, seed);
  std::vector<uint8_t> packed(pm.bytes(c.rows, c.k));
  pm.repack(w.data(), w_row, c.rows, c.k, packed.data());
  std::vector<uint8_t> row(w_row);
  for (int64_t r = 0; r < c.rows; ++r) {  // rows read back (tied embedding lookups)
    pm.unpack_row(packed.data(), r, c.k, row.data());
    ASSERT_EQ(0, std::memcmp(row.data(), &w[r * w_row], w_row)) << describe(type, level, c, raw) << ": row " << r;
  }

  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> xf((size_t)(c.n_tokens * c.k));
  for (float& f : xf) f = dist(rng);
  std::vector<uint8_t> x(x_row * c.n_tokens);
  simd->quantize_act(xf.data(), c.n_tokens, c.k, x.data());

  const float kSentinel = 1234.5f;
  std::vector<float> y_rows(c.n_tokens * c.ldy, kSentinel), y_packed(y_rows), y_one(y_rows), y_ref(y_rows);
  simd->rows(w.data(), w_row, c.r0, c.r1, x.data(), x_row, c.n_tokens, c.k, y_rows.data(), c.ldy);
  ref->rows(w.data(), w_row, c.r0, c.r1, x.data(), x_row, c.n_tokens, c.k, y_ref.data(), c.ldy);
  pm.rows(packed.data(), 0, c.r0, c.r1, x.data(), x_row, c.n_tokens, c.k, y_packed.data(), c.ldy);
  for (int64_t t = 0; t < c.n_tokens; ++t)  // one token per call: batch invariance
    pm.rows(packed.data(), 0, c.r0, c.r1, &x[t * x_row], x_row, 1, c.k, &y_one[t * c.ldy], c.ldy);

  const bool matches_rows = dtype_info(type).block_size == 32;
  int bad = 0;
  for (int64_t t = 0; t < c.n_tokens; ++t)
    for (int64_t i = 0; i < c.ldy; ++i) {
      const size_t at = (size_t)(t * c.ldy + i);
      if (i < c.r0 || i >= c.r1) {
        if ((y_packed[at] != kSentinel || y_one[at] != kSentinel) && bad++ < 5)
          ADD_FAILURE() << describe(type, level, c, raw) << ": wrote outside its rows at token " << t << " row " << i;
        continue;
      }
      const bool same = std::memcmp(&y_one[at], &y_packed[at], 4) == 0 &&
                        (!matches_rows || std::memcmp(&y_packed[at], &y_rows[at], 4) == 0);
      const double tol = 1e-4 * (std::fabs((double)y_ref[at]) + 1.0);
      if ((!same || !(std::fabs((double)y_ref[at] - y_packed[at]) <= tol)) && bad++ < 5)
        ADD_FAILURE() << describe(type, level, c, raw) << ": token " << t << " row " << i << " rows " << y_rows[at]
                      << " packed " << y_packed[at] << " one-token " << y_one[at] << " scalar " << y_ref[at];
    }
}

// k in units of the type's block (32 elements, or 256 for the super-block types).
std::vector<Case> cases(DType type) {
  const int64_t kb = (int64_t)dtype_info(type).block_size;
  std::vector<Case> out;
  for (int64_t rows : {1, 15, 16, 17, 50})
    for (int64_t n_tokens : {1, 3, 8, 9, 12, 13, 32, 70, 130}) out.push_back({rows, 3 * kb, n_tokens, 0, rows, rows});
  out.push_back({40, kb, 5, 16, 37, 45});           // sub-range starting at a group, ending inside one
  out.push_back({70, 768, 20, 32, 70, 71});         // ldy beyond the rows
  out.push_back({33, 16384, 2, 0, 33, 33});         // huge k
  out.push_back({18, 16384 + kb, 11, 16, 18, 18});  // odd number of blocks, last group of two rows
  return out;
}

}  // namespace

class QuantRepack : public ::testing::TestWithParam<DType> {};

// The levels this CPU runs that have a packed layout for the type.
std::vector<KernelLevel> packed_levels(DType type) {
  std::vector<KernelLevel> out;
  for (KernelLevel l : {KernelLevel::Avx2, KernelLevel::Avx512})
    if (best_kernel_level() >= l && quant_matmul_kernel(type, l)->packed != nullptr) out.push_back(l);
  return out;
}

TEST_P(QuantRepack, PackedMatchesRowMajorBitwise) {
  const std::vector<KernelLevel> levels = packed_levels(GetParam());
  if (levels.empty()) GTEST_SKIP() << "no packed layout for this type at the levels this CPU runs";
  for (KernelLevel level : levels) {
    uint32_t seed = 1;
    for (const Case& c : cases(GetParam()))
      for (bool raw : {false, true}) {
        check_case(GetParam(), level, c, raw, seed++);
        if (HasFatalFailure()) return;
      }
  }
}

// The packed MXFP4 kernel widens E8M0 exponents itself rather than reading kE8m0Half: one row per exponent
// (one block each, so every output is a single product, infinities included) must match the row-major bits.
TEST(QuantRepackMxfp4, EveryExponentMatchesRowMajor) {
  const std::vector<KernelLevel> levels = packed_levels(DType::MXFP4);
  if (levels.empty()) GTEST_SKIP() << "no packed MXFP4 layout at the levels this CPU runs";
  for (KernelLevel level : levels) {
  SCOPED_TRACE(kernel_level_name(level));
  const MatmulKernel* simd = quant_matmul_kernel(DType::MXFP4, level);
  const PackedMatmul& pm = *simd->packed;
  const int64_t rows = 256, k = 32;
  std::vector<quant::BlockMxfp4> w((size_t)rows);
  std::mt19937 rng(7);
  for (int64_t r = 0; r < rows; ++r) {
    w[(size_t)r].e = (uint8_t)r;
    for (uint8_t& q : w[(size_t)r].qs) q = (uint8_t)rng();
  }
  std::vector<uint8_t> packed(pm.bytes(rows, k));
  pm.repack(w.data(), sizeof(quant::BlockMxfp4), rows, k, packed.data());
  const std::vector<float> xf = test::gaussian(3 * k, 8);
  std::vector<uint8_t> x(3 * dtype_row_bytes(simd->act_type, k));
  simd->quantize_act(xf.data(), 3, k, x.data());
  std::vector<float> y_rows(3 * rows), y_packed(3 * rows);
  simd->rows(w.data(), sizeof(quant::BlockMxfp4), 0, rows, x.data(), x.size() / 3, 3, k, y_rows.data(), rows);
  pm.rows(packed.data(), 0, 0, rows, x.data(), x.size() / 3, 3, k, y_packed.data(), rows);
  for (int64_t i = 0; i < 3 * rows; ++i)
    ASSERT_EQ(0, std::memcmp(&y_rows[(size_t)i], &y_packed[(size_t)i], 4))
        << "token " << i / rows << " exponent " << i % rows << ": " << y_rows[(size_t)i] << " vs " << y_packed[(size_t)i];
  }
}

// AVX2 reads the AVX-512 layouts' bytes and, per (row, token), forms the same exact integers and the same float
// operations, so on a CPU with both levels the two packed kernels must agree bit for bit (the super-block types
// too, whose packed kernels differ from their row-major tiles).
TEST_P(QuantRepack, Avx2PackedMatchesAvx512Packed) {
  const DType type = GetParam();
  if (best_kernel_level() < KernelLevel::Avx512) GTEST_SKIP() << "no AVX-512 VNNI on this CPU";
  const MatmulKernel* a2 = quant_matmul_kernel(type, KernelLevel::Avx2);
  const MatmulKernel* a5 = quant_matmul_kernel(type, KernelLevel::Avx512);
  if (a2->packed == nullptr) GTEST_SKIP() << "no AVX2 packed layout for " << dtype_name(type);
  ASSERT_NE(a5->packed, nullptr);
  const Case c{50, 4 * (int64_t)dtype_info(type).block_size * 3, 13, 0, 50, 50};
  const std::vector<uint8_t> w = make_weights(type, c, true, 11);
  const size_t w_row = dtype_row_bytes(type, (uint64_t)c.k), x_row = dtype_row_bytes(a2->act_type, (uint64_t)c.k);
  std::vector<uint8_t> p2(a2->packed->bytes(c.rows, c.k)), p5(a5->packed->bytes(c.rows, c.k));
  ASSERT_EQ(p2.size(), p5.size());
  a2->packed->repack(w.data(), w_row, c.rows, c.k, p2.data());
  a5->packed->repack(w.data(), w_row, c.rows, c.k, p5.data());
  ASSERT_EQ(0, std::memcmp(p2.data(), p5.data(), p2.size())) << dtype_name(type) << ": packed bytes differ";
  const std::vector<float> xf = test::gaussian((size_t)(c.n_tokens * c.k), 12);
  std::vector<uint8_t> x(x_row * c.n_tokens);
  a2->quantize_act(xf.data(), c.n_tokens, c.k, x.data());
  for (int64_t n : {(int64_t)1, c.n_tokens}) {
    std::vector<float> y2(n * c.rows), y5(n * c.rows);
    a2->packed->rows(p2.data(), 0, 0, c.rows, x.data(), x_row, n, c.k, y2.data(), c.rows);
    a5->packed->rows(p5.data(), 0, 0, c.rows, x.data(), x_row, n, c.k, y5.data(), c.rows);
    for (size_t i = 0; i < y2.size(); ++i)
      ASSERT_EQ(0, std::memcmp(&y2[i], &y5[i], 4))
          << dtype_name(type) << " tokens " << n << " output " << i << ": avx2 " << y2[i] << " avx512 " << y5[i];
  }
}

// The scalar level has no packed layout (the runtime then keeps the file's rows); AVX2 has every one AVX-512 has.
TEST_P(QuantRepack, PackedLayoutsPerLevel) {
  EXPECT_EQ(quant_matmul_kernel(GetParam(), KernelLevel::Scalar)->packed, nullptr);
  if (best_kernel_level() >= KernelLevel::Avx2) {
    EXPECT_NE(quant_matmul_kernel(GetParam(), KernelLevel::Avx2)->packed, nullptr);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, QuantRepack, ::testing::Values(DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });
