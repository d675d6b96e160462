// Quantized block formats: layouts against hand-built blocks, reconstruction error bounds of every
// quantizer, and the activation quantizers (Q8_0 / Q8_K) including their rounding of ties.
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_formats.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::kernels;
using namespace merlin::kernels::quant;

namespace {

std::vector<float> gaussian(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// Gaussian data with a few exact zeros, duplicates of the extreme, and an all-zero block.
std::vector<float> awkward(size_t n, uint32_t seed) {
  auto v = gaussian(n, seed);
  for (size_t i = 0; i < n; i += 37) v[i] = 0.0f;
  if (n >= 64) {
    v[5] = 4.0f;
    v[6] = -4.0f;  // same magnitude, opposite sign: the first one sets the sign
  }
  if (n >= 512)
    for (size_t i = 256; i < 288; ++i) v[i] = 0.0f;
  return v;
}

template <class Block>
std::vector<Block> quantize(DType type, const std::vector<float>& x) {
  std::vector<Block> b(x.size() / dtype_info(type).block_size);
  EXPECT_TRUE(quant_quantize_row(type, x.data(), b.data(), (int64_t)x.size()));
  return b;
}

std::vector<float> dequantize(DType type, const void* blocks, size_t n) {
  std::vector<float> y(n);
  dequantize_row(type, blocks, y.data(), (int64_t)n);
  return y;
}

constexpr float kHalfUlp = 1.0f / 2048.0f;  // fp16's relative rounding bound (2^-11)

}  // namespace

TEST(QuantFormat, BlockSizesMatchDtypeTable) {
  EXPECT_EQ(sizeof(BlockQ8_0), dtype_info(DType::Q8_0).block_bytes);
  EXPECT_EQ(sizeof(BlockQ4_0), dtype_info(DType::Q4_0).block_bytes);
  EXPECT_EQ(sizeof(BlockMxfp4), dtype_info(DType::MXFP4).block_bytes);
  EXPECT_EQ(sizeof(BlockQ4_K), dtype_info(DType::Q4_K).block_bytes);
  EXPECT_EQ(sizeof(BlockTQ1_0), dtype_info(DType::TQ1_0).block_bytes);
  EXPECT_EQ(sizeof(BlockTQ2_0), dtype_info(DType::TQ2_0).block_bytes);
  EXPECT_EQ(sizeof(BlockQ8_K), dtype_info(DType::Q8_K).block_bytes);
  EXPECT_EQ(offsetof(BlockTQ1_0, qh), 48u);
  EXPECT_EQ(offsetof(BlockTQ1_0, d), 52u);
  EXPECT_EQ(offsetof(BlockTQ2_0, d), 64u);
  EXPECT_EQ(offsetof(BlockQ4_K, scales), 4u);
  EXPECT_EQ(offsetof(BlockQ4_K, qs), 16u);
}

// ---- layouts from hand-built blocks ----

TEST(QuantFormat, Q4_0NibbleOrder) {
  BlockQ4_0 b{};
  b.d = f32_to_fp16(0.5f);
  for (int j = 0; j < 16; ++j) b.qs[j] = (uint8_t)(j | ((15 - j) << 4));
  const auto y = dequantize(DType::Q4_0, &b, 32);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], (float)(j - 8) * 0.5f) << j;
    EXPECT_EQ(y[j + 16], (float)(7 - j) * 0.5f) << j;
  }
}

TEST(QuantFormat, Mxfp4ValuesAndScale) {
  EXPECT_EQ(e8m0_to_f32_half(128), 1.0f);
  EXPECT_EQ(e8m0_to_f32_half(127), 0.5f);
  EXPECT_EQ(e8m0_to_f32_half(254), std::ldexp(1.0f, 126));
  EXPECT_EQ(e8m0_to_f32_half(1), std::ldexp(1.0f, -127));  // subnormal results, as ggml
  EXPECT_EQ(e8m0_to_f32_half(0), std::ldexp(1.0f, -128));
  BlockMxfp4 b{};
  b.e = 128;  // halved table values times 1: the E2M1 grid itself, doubled
  for (int j = 0; j < 16; ++j) b.qs[j] = (uint8_t)(j | ((15 - j) << 4));
  const auto y = dequantize(DType::MXFP4, &b, 32);
  const float grid[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(y[j], grid[j]);
    EXPECT_EQ(y[j + 16], grid[15 - j]);
  }
}

TEST(QuantFormat, Q4_KScalesAndNibbleOrder) {
  BlockQ4_K b{};
  b.d = f32_to_fp16(1.0f);
  b.dmin = f32_to_fp16(0.5f);
  // Sub-block j: scale j + 1, min 2j + 1 (6 bits each, the upper four split as get_scale_min_k4 reads).
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 8; ++j) sc[j] = (uint8_t)(j + 1 + (j >= 4 ? 32 : 0)), mn[j] = (uint8_t)(2 * j + 1 + (j >= 6 ? 16 : 0));
  for (int j = 0; j < 4; ++j) {
    b.scales[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
    b.scales[j + 4] = (uint8_t)(mn[j] | ((mn[j + 4] >> 4) << 6));
    b.scales[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  for (int j = 0; j < 8; ++j) {
    uint8_t s, m;
    q4k_scale_min(j, b.scales, &s, &m);
    EXPECT_EQ(s, sc[j]);
    EXPECT_EQ(m, mn[j]);
  }
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) b.qs[32 * c + l] = (uint8_t)((l % 16) | ((15 - l % 16) << 4));
  const auto y = dequantize(DType::Q4_K, &b, 256);
  for (int j = 0; j < 8; ++j)
    for (int l = 0; l < 32; ++l) {
      const int q = j % 2 == 0 ? l % 16 : 15 - l % 16;
      EXPECT_EQ(y[32 * j + l], 1.0f * sc[j] * (float)q - 0.5f * mn[j]) << j << " " << l;
    }
}

TEST(QuantFormat, TernaryElementOrder) {
  // One +1 at each position in turn, everything else 0, through both packings.
  for (int pos = 0; pos < 256; ++pos) {
    std::vector<float> x(256, 0.0f);
    x[pos] = 1.0f;
    const auto b1 = quantize<BlockTQ1_0>(DType::TQ1_0, x);
    const auto b2 = quantize<BlockTQ2_0>(DType::TQ2_0, x);
    EXPECT_EQ(dequantize(DType::TQ1_0, b1.data(), 256), x) << pos;
    EXPECT_EQ(dequantize(DType::TQ2_0, b2.data(), 256), x) << pos;
  }
  // TQ2_0 by hand: byte 32 + m holds elements 128 + 32l + m in bits 2l.
  BlockTQ2_0 b{};
  for (uint8_t& q : b.qs) q = 0x55;  // every trit 1 (value 0)
  b.qs[32 + 3] = (uint8_t)(0x55 & ~(3 << 4)) | (2 << 4);  // element 128 + 64 + 3 = +1
  b.d = f32_to_fp16(1.0f);
  const auto y = dequantize(DType::TQ2_0, &b, 256);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(y[i], i == 195 ? 1.0f : 0.0f) << i;
}

// ---- reconstruction bounds ----

TEST(QuantFormat, Q8_0ErrorWithinHalfStep) {
  const auto x = awkward(32 * 64, 1);
  const auto b = quantize<BlockQ8_0>(DType::Q8_0, x);
  const auto y = dequantize(DType::Q8_0, b.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float d = fp16_to_f32(b[i / 32].d);
    EXPECT_LE(std::fabs(x[i] - y[i]), d * (0.5f + 127 * kHalfUlp) + 1e-30f) << i;
  }
  EXPECT_EQ(b[256 / 32].d, 0);  // the all-zero block
}

TEST(QuantFormat, Q4_0ErrorWithinHalfStep) {
  const auto x = awkward(32 * 64, 2);
  const auto b = quantize<BlockQ4_0>(DType::Q4_0, x);
  const auto y = dequantize(DType::Q4_0, b.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float d = std::fabs(fp16_to_f32(b[i / 32].d));
    // The extreme maps to -8 exactly; values of the other sign beyond 7.5 steps clamp at +7 (error <= d).
    const float bound = std::fabs(x[i]) > 7.5f * d ? d : 0.5f * d;
    EXPECT_LE(std::fabs(x[i] - y[i]), bound + 8 * d * kHalfUlp + 1e-30f) << i;
  }
  // The block's extreme is reproduced (up to fp16 rounding of d) with the sign it had.
  EXPECT_NEAR(y[5], 4.0f, 4.0f * kHalfUlp);
}

TEST(QuantFormat, Mxfp4PicksNearestGridValue) {
  const auto x = awkward(32 * 64, 3);
  const auto b = quantize<BlockMxfp4>(DType::MXFP4, x);
  const auto y = dequantize(DType::MXFP4, b.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float s = e8m0_to_f32_half(b[i / 32].e);
    float best = INFINITY;
    for (int v : kMxfp4Values) best = std::fmin(best, std::fabs((float)v * s - x[i]));
    EXPECT_EQ(std::fabs(y[i] - x[i]), best) << i;
  }
}

TEST(QuantFormat, Q4_KErrorWithinHalfStepUnlessClamped) {
  const auto x = awkward(256 * 16, 4);
  const auto b = quantize<BlockQ4_K>(DType::Q4_K, x);
  const auto y = dequantize(DType::Q4_K, b.data(), x.size());
  double err2 = 0, x2 = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const BlockQ4_K& blk = b[i / 256];
    const int j = (int)(i % 256) / 32;
    uint8_t sc, m;
    q4k_scale_min(j, blk.scales, &sc, &m);
    const float step = fp16_to_f32(blk.d) * sc, lo = -fp16_to_f32(blk.dmin) * m;
    const float hi = lo + 15 * step;
    if (x[i] >= lo && x[i] <= hi) {
      EXPECT_LE(std::fabs(x[i] - y[i]), 0.5f * step * 1.0001f + 1e-6f) << i;
    }
    err2 += (x[i] - y[i]) * (x[i] - y[i]);
    x2 += x[i] * x[i];
  }
  EXPECT_LT(std::sqrt(err2 / x2), 0.1);
}

TEST(QuantFormat, TernaryExactOnTernaryInput) {
  const float d = 0.375f;  // exact in fp16
  std::mt19937 rng(5);
  std::vector<float> x(256 * 8);
  for (float& v : x) v = d * (float)((int)(rng() % 3) - 1);
  for (size_t i = 0; i < x.size(); i += 256) x[i] = d;  // every block reaches d
  EXPECT_EQ(dequantize(DType::TQ1_0, quantize<BlockTQ1_0>(DType::TQ1_0, x).data(), x.size()), x);
  EXPECT_EQ(dequantize(DType::TQ2_0, quantize<BlockTQ2_0>(DType::TQ2_0, x).data(), x.size()), x);
}

TEST(QuantFormat, TernaryErrorWithinHalfScale) {
  const auto x = awkward(256 * 8, 6);
  for (DType t : {DType::TQ1_0, DType::TQ2_0}) {
    std::vector<uint8_t> b(dtype_row_bytes(t, x.size()));
    quant_quantize_row(t, x.data(), b.data(), (int64_t)x.size());
    const auto y = dequantize(t, b.data(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float amax = 0;
      for (size_t j = i / 256 * 256; j < i / 256 * 256 + 256; ++j) amax = std::fmax(amax, std::fabs(x[j]));
      EXPECT_LE(std::fabs(x[i] - y[i]), amax * (0.5f + kHalfUlp) + 1e-30f) << dtype_name(t) << " " << i;
    }
  }
}

// ---- activation quantizers: every level byte-identical to the scalar reference ----

namespace {

void expect_act_identical(DType weight_type, const std::vector<float>& x, int64_t n_tokens) {
  const int64_t k = (int64_t)x.size() / n_tokens;
  const MatmulKernel* ref = quant_matmul_kernel(weight_type, KernelLevel::Scalar);
  const size_t bytes = dtype_row_bytes(ref->act_type, (uint64_t)k) * n_tokens;
  std::vector<uint8_t> a(bytes);
  ref->quantize_act(x.data(), n_tokens, k, a.data());
  for (KernelLevel l : {KernelLevel::Avx2, KernelLevel::Avx512}) {
    if (l > best_kernel_level()) continue;
    std::vector<uint8_t> b(bytes, 0xAA);
    quant_matmul_kernel(weight_type, l)->quantize_act(x.data(), n_tokens, k, b.data());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), bytes)) << dtype_name(ref->act_type) << " " << kernel_level_name(l);
  }
}


// amax 127 gives 1 / d = 127 / amax = 1, so x * id lands exactly on the .5 ties.
std::vector<float> q8_0_ties() {
  std::vector<float> x(64);
  for (int i = 0; i < 32; ++i) x[i] = (float)(i - 16) + 0.5f;
  x[31] = 127.0f;
  for (int i = 32; i < 64; ++i) x[i] = -x[i - 32];
  return x;
}

}  // namespace

// The file quantizer is ggml's reference: roundf, half away from zero.
TEST(QuantFormat, Q8_0FileQuantizerRoundsHalfAwayFromZero) {
  const auto x = q8_0_ties();
  const auto b = quantize<BlockQ8_0>(DType::Q8_0, x);
  EXPECT_EQ(b[0].qs[0], -16);  // -15.5
  EXPECT_EQ(b[0].qs[16], 1);   // 0.5
  EXPECT_EQ(b[0].qs[17], 2);   // 1.5
  EXPECT_EQ(b[0].qs[18], 3);   // 2.5
  EXPECT_EQ(b[1].qs[16], -1);  // -0.5
}

// Activations follow llama.cpp's x86 run-time quantizer: half to even (and id = 127 / amax).
TEST(QuantAct, Q8_0RoundsHalfToEvenAtEveryLevel) {
  const auto x = q8_0_ties();
  const MatmulKernel* ref = quant_matmul_kernel(DType::Q8_0, KernelLevel::Scalar);
  std::vector<BlockQ8_0> b(2);
  ref->quantize_act(x.data(), 1, 64, b.data());
  EXPECT_EQ(b[0].qs[0], -16);  // -15.5
  EXPECT_EQ(b[0].qs[16], 0);   // 0.5
  EXPECT_EQ(b[0].qs[17], 2);   // 1.5
  EXPECT_EQ(b[0].qs[18], 2);   // 2.5
  EXPECT_EQ(b[1].qs[16], 0);   // -0.5
  EXPECT_EQ(fp16_to_f32(b[0].d), 1.0f);
  expect_act_identical(DType::Q8_0, x, 2);
}

TEST(QuantAct, Q8_KRoundsHalfToEvenAtEveryLevel) {
  std::vector<float> x(256);
  for (int i = 0; i < 256; ++i) x[i] = (float)(i % 64 - 32) + 0.5f;
  x[200] = -127.0f;  // max is negative: iscale = -127 / -127 = 1
  std::vector<uint8_t> b(dtype_row_bytes(DType::Q8_K, 256));
  quant_quantize_row(DType::Q8_K, x.data(), b.data(), 256);
  const auto* blk = reinterpret_cast<const BlockQ8_K*>(b.data());
  EXPECT_EQ(blk->d, 1.0f);
  EXPECT_EQ(blk->qs[32], 0);  // 0.5 -> 0
  EXPECT_EQ(blk->qs[33], 2);  // 1.5 -> 2
  EXPECT_EQ(blk->qs[34], 2);  // 2.5 -> 2
  expect_act_identical(DType::Q4_K, x, 1);
}

TEST(QuantAct, RandomRowsIdenticalAtEveryLevel) {
  for (int64_t n_tokens : {1, 3, 17}) {
    auto x = awkward(768 * n_tokens, 7 + (uint32_t)n_tokens);
    for (size_t i = 0; i < x.size(); i += 101) x[i] *= 1e-30f;  // tiny values next to ordinary ones
    expect_act_identical(DType::Q8_0, x, n_tokens);
    expect_act_identical(DType::Q4_K, x, n_tokens);
  }
}

TEST(QuantAct, RoundTripWithinHalfStep) {
  const auto x = awkward(1024, 8);
  for (DType weight : {DType::Q8_0, DType::Q4_K}) {
    const MatmulKernel* k = quant_matmul_kernel(weight, best_kernel_level());
    std::vector<uint8_t> a(dtype_row_bytes(k->act_type, x.size()));
    k->quantize_act(x.data(), 1, (int64_t)x.size(), a.data());
    const auto y = dequantize(k->act_type, a.data(), x.size());
    const int bs = (int)dtype_info(k->act_type).block_size;
    for (size_t i = 0; i < x.size(); ++i) {
      float d;
      if (k->act_type == DType::Q8_0) {
        d = fp16_to_f32(reinterpret_cast<const BlockQ8_0*>(a.data())[i / bs].d);
      } else {
        const auto& blk = reinterpret_cast<const BlockQ8_K*>(a.data())[i / bs];
        d = std::fabs(blk.d);
        int s = 0;  // bsums are the sums of 16 quants
        for (int j = 0; j < 16; ++j) s += blk.qs[(i % bs) / 16 * 16 + j];
        EXPECT_EQ(blk.bsums[(i % bs) / 16], s);
      }
      EXPECT_LE(std::fabs(x[i] - y[i]), d * (0.5f + 127 * kHalfUlp) + 1e-30f) << dtype_name(k->act_type) << " " << i;
    }
  }
}
