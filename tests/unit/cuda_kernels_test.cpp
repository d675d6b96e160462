// CUDA kernels against the CPU scalar references on random data with awkward sizes: activation quantizers
// (codes and scales bit-identical), RMSNorm and SwiGLU, embedding lookup (bit-identical for every weight
// type), and the matrix products of every weight type for 1..70 tokens. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_formats.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "cuda_test_util.h"
#include "quant_test_util.h"
#include "test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;

namespace {

#define REQUIRE_GPU() MERLIN_REQUIRE_GPU()

using test::gaussian;
using test::randomize_blocks;
using test::DevFloats;
using test::download;


using test::max_abs;
using test::random_matrix;

}  // namespace

TEST(CudaKernels, ActivationQuantizersMatchCpuBits) {
  REQUIRE_GPU();
  const int n = 5;
  const int64_t k = 768;
  std::vector<float> x = gaussian((size_t)n * k, 7);
  x[3] = 0;  // a zero, and a whole zero block for the amax == 0 path
  for (int i = 256; i < 288; ++i) x[i] = 0;
  x[k + 5] = -x[k + 9] - 0.0f;
  DevFloats dx(x);
  for (cu::ActKind kind : {cu::ActKind::Q8_0, cu::ActKind::Q8_K}) {
    SCOPED_TRACE(kind == cu::ActKind::Q8_0 ? "q8_0" : "q8_k");
    cu::ActBuf a = cu::act_alloc(kind, k, n);
    cu::PrepArgs p;
    p.d_x = dx.p;
    p.ld = k;
    cu::prep_act(p, n, a, nullptr);
    cu::sync_device();
    const auto q = download(a.q, (size_t)n * k);
    const auto sc = download(a.scale, (size_t)n * k / 32);
    const auto sum = download(a.sum, (size_t)n * k / 32);
    const DType t = kind == cu::ActKind::Q8_0 ? DType::Q8_0 : DType::Q8_K;
    std::vector<uint8_t> ref(dtype_row_bytes(t, (uint64_t)k));
    int mismatches = 0;
    for (int r = 0; r < n; ++r) {
      if (kind == cu::ActKind::Q8_0) {
        kernels::quant::quantize_act_row_q8_0(&x[(size_t)r * k], ref.data(), k);
        const auto* b = reinterpret_cast<const kernels::quant::BlockQ8_0*>(ref.data());
        for (int64_t j = 0; j < k / 32; ++j) {
          mismatches += sc[r * k / 32 + j] != fp16_to_f32(b[j].d);
          int s = 0;
          for (int i = 0; i < 32; ++i) {
            mismatches += q[r * k + 32 * j + i] != b[j].qs[i];
            s += b[j].qs[i];
          }
          mismatches += sum[r * k / 32 + j] != s;
        }
      } else {
        ASSERT_TRUE(kernels::quant_quantize_row(DType::Q8_K, &x[(size_t)r * k], ref.data(), k));
        const auto* b = reinterpret_cast<const kernels::quant::BlockQ8_K*>(ref.data());
        for (int64_t j = 0; j < k / 32; ++j) {
          mismatches += sc[r * k / 32 + j] != b[j / 8].d;
          mismatches += sum[r * k / 32 + j] != b[j / 8].bsums[2 * (j % 8)] + b[j / 8].bsums[2 * (j % 8) + 1];
          for (int i = 0; i < 32; ++i) mismatches += q[r * k + 32 * j + i] != b[j / 8].qs[32 * (j % 8) + i];
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
    // The fragment-ordered copy the batched products read: per group of 8 rows and block of 32, lane
    // L = 4 g + c finds row g's elements 4c..4c+3 and 16+4c..16+4c+3 at bytes 8 L .. 8 L + 7; the group's
    // 8 scales (sums) of a block are consecutive.
    const size_t padded = (size_t)(n + 7) / 8 * 8;
    const auto fq = download(a.fq, padded * k);
    const auto fs = download(a.fs, padded * k / 32);
    const auto fsum = download(a.fsum, padded * k / 32);
    int frag_mismatches = 0;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < k; ++i) {
        const int64_t blk = ((int64_t)(r / 8) * (k / 32) + i / 32), j = i % 32;
        const int64_t lane = (r % 8) * 4 + (j % 16) / 4;
        frag_mismatches += fq[(blk * 32 + lane) * 8 + (j / 16) * 4 + j % 4] != q[r * k + i];
        if (j == 0) {
          frag_mismatches += fs[blk * 8 + r % 8] != sc[r * k / 32 + i / 32];
          frag_mismatches += fsum[blk * 8 + r % 8] != sum[r * k / 32 + i / 32];
        }
      }
    EXPECT_EQ(frag_mismatches, 0);
    cu::act_free(a);
  }
}

// The F16/BF16 fragment planes the batched half products read: per group of 8 rows and 32 columns (rows
// padded to 32), lane L = 4 g + c holds row g's columns 8c..8c+7 at halves 8 L .. 8 L + 7; the padding and
// the rows past n of the last group stay zero. 11 rows of 48 columns: a partial group and a half block.
TEST(CudaKernels, HalfFragmentPlanesHoldTheRows) {
  REQUIRE_GPU();
  const int n = 11;
  const int64_t k = 48, kp = 64;
  DevFloats dx(gaussian((size_t)n * k, 9));
  for (cu::ActKind kind : {cu::ActKind::F16, cu::ActKind::BF16}) {
    cu::ActBuf a = cu::act_alloc(kind, k, n);
    cu::PrepArgs p;
    p.d_x = dx.p;
    p.ld = k;
    cu::prep_act(p, n, a, nullptr);
    cu::sync_device();
    const auto hi = download(a.hi, (size_t)n * k), lo = download(a.lo, (size_t)n * k);
    const auto fhi = download(a.fhi, (size_t)16 * kp), flo = download(a.flo, (size_t)16 * kp);
    std::vector<int> seen(fhi.size(), 0);
    int mismatches = 0;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = i % 32, lane = (r % 8) * 4 + j / 8;
        const size_t f = (size_t)((((r / 8) * (kp / 32) + i / 32) * 32 + lane) * 8 + j % 8);
        mismatches += fhi[f] != hi[r * k + i] || flo[f] != lo[r * k + i];
        seen[f] = 1;
      }
    EXPECT_EQ(mismatches, 0);
    int nonzero_padding = 0;
    for (size_t f = 0; f < fhi.size(); ++f) nonzero_padding += !seen[f] && (fhi[f] != 0 || flo[f] != 0);
    EXPECT_EQ(nonzero_padding, 0);
    cu::act_free(a);
  }
}

TEST(CudaKernels, RmsNormAndSwiGluMatchCpu) {
  REQUIRE_GPU();
  const auto& ref = kernels::kernels_for(KernelLevel::Scalar);
  const int n = 3;
  for (int64_t k : {32, 200, 768, 1000}) {
    SCOPED_TRACE(k);
    const std::vector<float> x = gaussian((size_t)n * 2 * k, 11 + (uint32_t)k, 3.0f), w = gaussian((size_t)k, 3);
    DevFloats dx(x), dw(w);
    cu::ActBuf a = cu::act_alloc(cu::ActKind::F32, k, n);
    cu::PrepArgs p{cu::Prep::RmsNorm, dx.p, 2 * k, dw.p, 1e-5f, 0, nullptr};
    cu::prep_act(p, n, a, nullptr);
    cu::sync_device();
    std::vector<float> got = download(a.f, (size_t)n * k), want((size_t)n * k);
    for (int r = 0; r < n; ++r) ref.rmsnorm(&x[(size_t)r * 2 * k], w.data(), k, 1e-5f, &want[(size_t)r * k]);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-6f * std::fabs(want[i]) + 1e-30f) << i;

    p = cu::PrepArgs{cu::Prep::SwiGlu, dx.p, 2 * k, nullptr, 0, k, nullptr};
    cu::prep_act(p, n, a, nullptr);
    cu::sync_device();
    got = download(a.f, (size_t)n * k);
    for (int r = 0; r < n; ++r) ref.swiglu(&x[(size_t)r * 2 * k], &x[(size_t)r * 2 * k + k], k, &want[(size_t)r * k]);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 4e-6f * std::fabs(want[i]) + 1e-30f) << i;
    cu::act_free(a);
  }
}

// The embedding lookup against the CPU's dequantization, and the first layer's RMSNorm that does the lookup
// itself against embed() followed by prep_act.
TEST(CudaKernels, EmbeddingRowsAreBitExact) {
  REQUIRE_GPU();
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K,
                  DType::TQ1_0, DType::TQ2_0}) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t rows = 37, dim = 512;
    const std::vector<uint8_t> m = random_matrix(t, rows, dim, 5);
    const size_t row_bytes = dtype_row_bytes(t, (uint64_t)dim);
    void* dm = cu::dev_alloc(m.size());
    cu::copy_to_device(dm, m.data(), m.size());
    const std::vector<int32_t> toks = {0, 36, 17, 17, 3};
    auto* dt = static_cast<int32_t*>(cu::dev_alloc(toks.size() * 4));
    cu::copy_to_device(dt, toks.data(), toks.size() * 4);
    auto* dx = static_cast<float*>(cu::dev_alloc(toks.size() * dim * 4));
    cu::embed(t, dm, row_bytes, dim, dt, (int)toks.size(), dx, nullptr);
    cu::sync_device();
    const std::vector<float> got = download(dx, toks.size() * dim);
    std::vector<float> want(dim);
    for (size_t i = 0; i < toks.size(); ++i) {
      kernels::dequantize_row(t, m.data() + toks[i] * row_bytes, want.data(), dim);
      EXPECT_EQ(std::memcmp(&got[i * dim], want.data(), dim * 4), 0) << "row " << i;
    }
    // The first layer's RMSNorm reading the embedding rows itself (PrepArgs::d_tokens): the residual rows and
    // the prepared input equal embed() followed by prep_act, bit for bit, in every input format.
    const std::vector<float> nw = gaussian((size_t)dim, 6);
    DevFloats dw(nw);
    for (cu::ActKind kind : {cu::ActKind::Q8_0, cu::ActKind::Q8_K, cu::ActKind::F16, cu::ActKind::F32}) {
      const int n = (int)toks.size();
      cu::ActBuf want = cu::act_alloc(kind, dim, n), got = cu::act_alloc(kind, dim, n);
      const cu::PrepArgs norm{cu::Prep::RmsNorm, dx, dim, dw.p, 1e-5f, 0, nullptr};
      cu::prep_act(norm, n, want, nullptr);
      auto* dx2 = static_cast<float*>(cu::dev_alloc(toks.size() * dim * 4));
      cu::PrepArgs fused = norm;
      fused.d_x = dx2;
      fused.d_tokens = dt;
      fused.embd = static_cast<const uint8_t*>(dm);
      fused.embd_type = t;
      fused.embd_row_bytes = row_bytes;
      fused.d_embed_x = dx2;
      fused.embd_rows = rows;
      cu::prep_act(fused, n, got, nullptr);
      cu::sync_device();
      EXPECT_EQ(download(dx2, toks.size() * dim), download(dx, toks.size() * dim)) << "residual rows";
      const size_t e = (size_t)n * dim;
      if (kind == cu::ActKind::F32) {
        EXPECT_EQ(download(got.f, e), download(want.f, e));
      } else if (kind == cu::ActKind::F16) {
        EXPECT_EQ(download(got.hi, e), download(want.hi, e));
        EXPECT_EQ(download(got.lo, e), download(want.lo, e));
      } else {
        EXPECT_EQ(download(got.q, e), download(want.q, e)) << "codes";
        EXPECT_EQ(download(got.scale, e / 32), download(want.scale, e / 32)) << "scales";
        EXPECT_EQ(download(got.fq, e), download(want.fq, e)) << "fragment codes";
      }
      cu::dev_free(dx2);
      cu::act_free(want);
      cu::act_free(got);
    }
    cu::dev_free(dm);
    cu::dev_free(dt);
    cu::dev_free(dx);
  }
}

// y = W x for every weight type against the scalar CPU kernel (which quantizes x the same way), with rows
// that are not a multiple of the 16-row tile, k that leaves partial 16-byte chunks (or, for f16/bf16, half a
// 32-column pair), short k that lets a CTA work on several tiles at once, and 1..70 tokens
// (one, two and four mma column groups, several token tiles). Also checks the accumulate epilogue.
TEST(CudaKernels, MatmulMatchesScalarCpu) {
  REQUIRE_GPU();
  const auto& scalar = kernels::kernels_for(KernelLevel::Scalar);
  struct Shape { int64_t rows, k; };
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K,
                  DType::TQ1_0, DType::TQ2_0}) {
    const bool super = t == DType::Q4_K || t == DType::TQ1_0 || t == DType::TQ2_0;
    std::vector<Shape> shapes = super ? std::vector<Shape>{{1, 256}, {37, 768}, {130, 1280}}
                                      : std::vector<Shape>{{1, 32}, {37, 96}, {130, 800}, {17, 4096}};
    // Half rows are stored padded to 32 columns (matrix_layout.cuh): k = 16 mod 32 leaves a half-empty pair.
    if (t == DType::F16 || t == DType::BF16) {
      shapes.push_back({23, 48});
      shapes.push_back({40, 272});
    }
    for (const Shape& s : shapes) {
      for (int n : {1, 5, 8, 9, 17, 33, 70}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(s.rows) + " k " + std::to_string(s.k) +
                     " tokens " + std::to_string(n));
        const std::vector<uint8_t> w = random_matrix(t, s.rows, s.k, (uint32_t)(s.rows * 7 + s.k + n));
        const size_t row_bytes = dtype_row_bytes(t, (uint64_t)s.k);
        const std::vector<float> x = gaussian((size_t)n * s.k, (uint32_t)n + 100);
        // CPU reference.
        const kernels::MatmulKernel* mk = scalar.matmul(t);
        std::vector<float> want((size_t)n * s.rows);
        if (mk->act_type == DType::F32) {
          mk->rows(w.data(), row_bytes, 0, s.rows, x.data(), (size_t)s.k * 4, n, s.k, want.data(), s.rows);
        } else {
          const size_t xb = dtype_row_bytes(mk->act_type, (uint64_t)s.k);
          std::vector<uint8_t> xq(xb * n);
          mk->quantize_act(x.data(), n, s.k, xq.data());
          mk->rows(w.data(), row_bytes, 0, s.rows, xq.data(), xb, n, s.k, want.data(), s.rows);
        }
        // GPU, accumulating onto y = 1 so the epilogue's += is checked too.
        const cu::MatrixPart part{t, w.data(), s.rows, s.k, row_bytes};
        cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
        cu::ActBuf a = cu::act_alloc(m.act(), s.k, n);
        DevFloats dx(x), dy(std::vector<float>((size_t)n * s.rows, 1.0f));
        cu::PrepArgs p;
        p.d_x = dx.p;
        p.ld = s.k;
        cu::prep_act(p, n, a, nullptr);
        cu::matmul(m, a, n, dy.p, s.rows, s.rows, true, nullptr);
        cu::sync_device();
        const std::vector<float> got = download(dy.p, (size_t)n * s.rows);
        // Integer block sums are exact on both sides; what differs is the float summation order (and, for
        // f16/bf16, the hi + lo split of x, ~2^-17 relative per element).
        const float tol = 2e-5f * max_abs(want) + 1e-6f;
        float worst = 0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - 1.0f - want[i]));
        EXPECT_LE(worst, tol);
        cu::act_free(a);
        cu::free_matrix(m);
      }
    }
  }
}

// Single-token products (matvec1.cu, unless MERLIN_CUDA_MV1=0) on decode-sized shapes: long rows (k split
// over 8 warps, several rounds per warp), many tiles (several tile groups per CTA, each k-split), an odd
// number of k-steps for the 4-bit formats; rows past n_out_rows stay untouched, two calls give the same bits.
TEST(CudaKernels, SingleTokenProductMatchesScalarCpu) {
  REQUIRE_GPU();
  const auto& scalar = kernels::kernels_for(KernelLevel::Scalar);
  struct Shape { int64_t rows, k; };
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ1_0, DType::TQ2_0}) {
    const bool super = t == DType::Q4_K || t == DType::TQ1_0 || t == DType::TQ2_0;
    const std::vector<Shape> shapes =
        super ? std::vector<Shape>{{301, 16384}, {16383, 4096}, {9601, 2048}, {5003, 768}, {3, 256}}
              : std::vector<Shape>{{301, 16384}, {16383, 4096}, {9601, 2080}, {5003, 800}, {3, 32}};
    for (const Shape& s : shapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(s.rows) + " k " + std::to_string(s.k));
      const std::vector<uint8_t> w = random_matrix(t, s.rows, s.k, (uint32_t)(s.rows * 3 + s.k));
      const size_t row_bytes = dtype_row_bytes(t, (uint64_t)s.k);
      const std::vector<float> x = gaussian((size_t)s.k, (uint32_t)s.k + 7);
      const kernels::MatmulKernel* mk = scalar.matmul(t);
      std::vector<float> want((size_t)s.rows);
      const size_t xb = dtype_row_bytes(mk->act_type, (uint64_t)s.k);
      std::vector<uint8_t> xq(xb);
      mk->quantize_act(x.data(), 1, s.k, xq.data());
      mk->rows(w.data(), row_bytes, 0, s.rows, xq.data(), xb, 1, s.k, want.data(), s.rows);
      const cu::MatrixPart part{t, w.data(), s.rows, s.k, row_bytes};
      cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
      cu::ActBuf a = cu::act_alloc(m.act(), s.k, 1);
      const int64_t n_out = std::max<int64_t>(1, s.rows - 5);  // the last rows must not be written
      DevFloats dx(x), dy(std::vector<float>((size_t)s.rows, 1.0f)), dz(std::vector<float>((size_t)s.rows, 0.0f)),
          dz2(std::vector<float>((size_t)s.rows, 0.0f));
      cu::PrepArgs p;
      p.d_x = dx.p;
      p.ld = s.k;
      cu::prep_act(p, 1, a, nullptr);
      cu::matmul(m, a, 1, dy.p, s.rows, n_out, true, nullptr);
      cu::matmul(m, a, 1, dz.p, s.rows, s.rows, false, nullptr);
      cu::matmul(m, a, 1, dz2.p, s.rows, s.rows, false, nullptr);
      cu::sync_device();
      const std::vector<float> got = download(dy.p, (size_t)s.rows), z = download(dz.p, (size_t)s.rows),
                               z2 = download(dz2.p, (size_t)s.rows);
      const float tol = 2e-5f * max_abs(want) + 1e-6f;
      float worst = 0;
      for (int64_t r = 0; r < n_out; ++r) worst = std::max(worst, std::fabs(got[r] - 1.0f - want[r]));
      EXPECT_LE(worst, tol);
      for (int64_t r = n_out; r < s.rows; ++r) EXPECT_EQ(got[r], 1.0f) << "row " << r;
      worst = 0;
      for (int64_t r = 0; r < s.rows; ++r) worst = std::max(worst, std::fabs(z[r] - want[r]));
      EXPECT_LE(worst, tol);
      EXPECT_EQ(std::memcmp(z.data(), z2.data(), z.size() * 4), 0);
      cu::act_free(a);
      cu::free_matrix(m);
    }
  }
}

// Batches of 9..32 tokens on a matrix with at least as many 16-row tiles as the GPU has SMs run the 16- and
// 32-token kernels; smaller matrices run 8-token CTAs (see launch_fmt). A token's arithmetic is the same in
// every variant, so each token's outputs must equal, bit for bit, those of a 5-token call (8-token kernel)
// on the same rows, and match the scalar CPU. The second shape (3,001 tiles of k = 256) has enough short
// tiles that a CTA works on 2-8 of them at once (warps_per_tile in matmul.cu). One exception: the 32-token
// kernel splits short rows of the int8 formats other than Q4_K into rounds of 2 chunks (round_for), so
// there a 17..32-token call sums in another order than a 5-token one: within float rounding of it, and bit
// for bit equal to another 17..32-token call. The int8 kernels throughout: the H kernels that Q8_0 / Q4_0 take
// from 17 tokens on (matmul_half_pays) have their own test (CudaMatmulHalf.*).
TEST(CudaKernels, BatchedVariantsAreBitIdentical) {
  REQUIRE_GPU();
  cu::set_matmul_half(false);
  const auto& scalar = kernels::kernels_for(KernelLevel::Scalar);
  struct Shape { int64_t rows, k; };
  // 301 tiles: more than any current GPU's SM count. k = 768 in the 4-bit formats is 12 chunks: rounds of 2
  // chunks on 6 of a tile's 8 warps (matmul.cu, round_for).
  for (const Shape s : {Shape{16 * 300 + 5, 512}, Shape{16 * 3000 + 5, 256}, Shape{16 * 150 + 5, 768}})
  for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0}) {
    const int64_t rows = s.rows, k = s.k;
    SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(rows));
    const std::vector<uint8_t> w = random_matrix(t, rows, k, 77);
    const size_t row_bytes = dtype_row_bytes(t, (uint64_t)k);
    const cu::MatrixPart part{t, w.data(), rows, k, row_bytes};
    cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
    auto run = [&](const std::vector<float>& x, int n) {
      cu::ActBuf a = cu::act_alloc(m.act(), k, n);
      DevFloats dx(x), dy(std::vector<float>((size_t)n * rows, 0.0f));
      cu::PrepArgs p;
      p.d_x = dx.p;
      p.ld = k;
      cu::prep_act(p, n, a, nullptr);
      cu::matmul(m, a, n, dy.p, rows, rows, false, nullptr);
      cu::sync_device();
      cu::act_free(a);
      return download(dy.p, (size_t)n * rows);
    };
    const bool other_order = t == DType::Q8_0 || t == DType::Q4_0 || t == DType::MXFP4 || t == DType::TQ2_0;
    std::vector<float> all32;
    for (int n : {32, 17}) {
      const std::vector<float> x = gaussian((size_t)32 * k, 37);  // the 17-token call: the first 17 rows
      const std::vector<float> all = run(x, n);
      if (n == 32) {
        all32 = all;
      } else {
        for (size_t i = 0; i < all.size(); ++i) ASSERT_EQ(all[i], all32[i]) << "17 tokens against 32, element " << i;
      }
      for (int t0 = 0; t0 + 5 <= n; t0 += 5) {
        const std::vector<float> some = run(std::vector<float>(x.begin() + t0 * k, x.begin() + (t0 + 5) * k), 5);
        float worst = 0, big = 0;
        for (int i = 0; i < 5; ++i)
          for (int64_t r = 0; r < rows; ++r) {
            const float a = all[(size_t)(t0 + i) * rows + r], b = some[(size_t)i * rows + r];
            if (!other_order) {
              ASSERT_EQ(a, b) << "token " << t0 + i << " row " << r;
            }
            worst = std::max(worst, std::fabs(a - b));
            big = std::max(big, std::fabs(b));
          }
        EXPECT_LE(worst, 1e-5f * big) << "tokens " << t0 << ".. against a 5-token call";
      }
      const kernels::MatmulKernel* mk = scalar.matmul(t);
      std::vector<float> want((size_t)n * rows);
      if (mk->act_type == DType::F32) {
        mk->rows(w.data(), row_bytes, 0, rows, x.data(), (size_t)k * 4, n, k, want.data(), rows);
      } else {
        const size_t xb = dtype_row_bytes(mk->act_type, (uint64_t)k);
        std::vector<uint8_t> xq(xb * n);
        mk->quantize_act(x.data(), n, k, xq.data());
        mk->rows(w.data(), row_bytes, 0, rows, xq.data(), xb, n, k, want.data(), rows);
      }
      float worst = 0;
      for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(all[i] - want[i]));
      EXPECT_LE(worst, 2e-5f * max_abs(want) + 1e-6f) << n << " tokens";
    }
    cu::free_matrix(m);
  }
  cu::set_matmul_half(true);
}

// 32-token products over many tiles of short rows (warps_per_tile's rule for base's output head: 2 warps per
// tile, each walking k in several rounds): against the scalar CPU, 17 tokens bit-identical to the same rows
// of 32, and the fused argmax head picking argmax_rows' index over those logits. The int8 kernels (as above).
TEST(CudaKernels, ManyTilesMatchScalarCpu) {
  REQUIRE_GPU();
  cu::set_matmul_half(false);
  const auto& scalar = kernels::kernels_for(KernelLevel::Scalar);
  const int64_t rows = 16 * 3200 + 5, k = 768;  // 3,201 tiles: past 8 per resident CTA on the H200
  for (DType t : {DType::Q4_0, DType::Q8_0}) {
    SCOPED_TRACE(dtype_name(t));
    const std::vector<uint8_t> w = random_matrix(t, rows, k, 91);
    const size_t row_bytes = dtype_row_bytes(t, (uint64_t)k);
    const cu::MatrixPart part{t, w.data(), rows, k, row_bytes};
    cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
    const std::vector<float> x = gaussian((size_t)32 * k, 92);
    DevFloats dx(x);
    auto* keys = static_cast<unsigned long long*>(cu::dev_alloc(32 * sizeof(unsigned long long)));
    auto* ids = static_cast<int32_t*>(cu::dev_alloc(2 * 32 * sizeof(int32_t)));
    std::vector<float> all32;
    for (int n : {32, 17}) {
      cu::ActBuf a = cu::act_alloc(m.act(), k, n);
      cu::PrepArgs p;
      p.d_x = dx.p;
      p.ld = k;
      cu::prep_act(p, n, a, nullptr);
      DevFloats dy(std::vector<float>((size_t)n * rows, 0.0f));
      cu::matmul(m, a, n, dy.p, rows, rows, false, nullptr);
      ASSERT_TRUE(cu::matmul_argmax_fits(m, n));
      cu::argmax_rows(dy.p, rows, n, rows, ids, nullptr);
      cu::matmul_argmax(m, a, n, rows, keys, nullptr);
      cu::argmax_keys_to_ids(keys, n, ids + 32, nullptr);
      cu::sync_device();
      const std::vector<float> got = download(dy.p, (size_t)n * rows);
      EXPECT_EQ(download(ids + 32, (size_t)n), download(ids, (size_t)n)) << n << " tokens: fused argmax head";
      cu::act_free(a);
      if (n == 17) {
        for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], all32[i]) << "17 tokens against 32, element " << i;
        continue;
      }
      all32 = got;
      const kernels::MatmulKernel* mk = scalar.matmul(t);
      const size_t xb = dtype_row_bytes(mk->act_type, (uint64_t)k);
      std::vector<uint8_t> xq(xb * 32);
      mk->quantize_act(x.data(), 32, k, xq.data());
      std::vector<float> want((size_t)32 * rows);
      mk->rows(w.data(), row_bytes, 0, rows, xq.data(), xb, 32, k, want.data(), rows);
      float worst = 0;
      for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
      EXPECT_LE(worst, 2e-5f * max_abs(want) + 1e-6f);
    }
    cu::dev_free(keys);
    cu::dev_free(ids);
    cu::free_matrix(m);
  }
  cu::set_matmul_half(true);
}

TEST(CudaKernels, StackedMatricesKeepTheirRows) {
  REQUIRE_GPU();
  const DType t = DType::Q4_0;
  const int64_t k = 256, r0 = 20, r1 = 7;
  const auto w0 = random_matrix(t, r0, k, 1), w1 = random_matrix(t, r1, k, 2);
  const size_t rb = dtype_row_bytes(t, k);
  const cu::MatrixPart parts[2] = {{t, w0.data(), r0, k, rb}, {t, w1.data(), r1, k, rb}};
  cu::Matrix both = cu::upload_matrix(parts, 2, nullptr), a0 = cu::upload_matrix(&parts[0], 1, nullptr),
             a1 = cu::upload_matrix(&parts[1], 1, nullptr);
  ASSERT_EQ(both.rows, cu::padded_rows(r0) + cu::padded_rows(r1));
  const int n = 3;
  const std::vector<float> x = gaussian((size_t)n * k, 9);
  DevFloats dx(x), y(std::vector<float>((size_t)n * both.rows)), y0(std::vector<float>((size_t)n * r0)),
      y1(std::vector<float>((size_t)n * r1));
  cu::ActBuf a = cu::act_alloc(both.act(), k, n);
  cu::PrepArgs p;
  p.d_x = dx.p;
  p.ld = k;
  cu::prep_act(p, n, a, nullptr);
  cu::matmul(both, a, n, y.p, both.rows, both.rows, false, nullptr);
  cu::matmul(a0, a, n, y0.p, r0, r0, false, nullptr);
  cu::matmul(a1, a, n, y1.p, r1, r1, false, nullptr);
  cu::sync_device();
  const auto gy = download(y.p, (size_t)n * both.rows), g0 = download(y0.p, (size_t)n * r0),
             g1 = download(y1.p, (size_t)n * r1);
  for (int t2 = 0; t2 < n; ++t2) {
    for (int64_t r = 0; r < r0; ++r) EXPECT_EQ(gy[t2 * both.rows + r], g0[t2 * r0 + r]);
    for (int64_t r = 0; r < r1; ++r) EXPECT_EQ(gy[t2 * both.rows + cu::padded_rows(r0) + r], g1[t2 * r1 + r]);
  }
  cu::act_free(a);
  cu::free_matrix(both);
  cu::free_matrix(a0);
  cu::free_matrix(a1);
}

// A product that prepares its own input (RMSNorm with a row selection, SwiGLU, plain; decode-sized batches)
// gives exactly the bits of the separate preparation kernel followed by the product.
TEST(CudaKernels, FusedPreparationMatchesSeparateKernels) {
  REQUIRE_GPU();
  for (const int64_t k : {768, 4096}) {  // base and 7.19B rows (at 4096 only n = 1 qualifies)
    const int64_t rows = 37;
    const std::vector<float> x = gaussian((size_t)10 * 2 * k, 21, 2.0f), w = gaussian((size_t)k, 22);
    const std::vector<int32_t> sel = {7, 2, 9, 0, 5, 1, 8, 3};
    DevFloats dx(x), dw(w);
    auto* d_sel = static_cast<int32_t*>(cu::dev_alloc(sel.size() * 4));
    cu::copy_to_device(d_sel, sel.data(), sel.size() * 4);
    const cu::PrepArgs modes[3] = {{cu::Prep::RmsNorm, dx.p, 2 * k, dw.p, 1e-5f, 0, d_sel},
                                   {cu::Prep::SwiGlu, dx.p, 2 * k, nullptr, 0, k, nullptr},
                                   {cu::Prep::Plain, dx.p, 2 * k, nullptr, 0, 0, nullptr}};
    for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0}) {
      const std::vector<uint8_t> wm = random_matrix(t, rows, k, 23);
      const cu::MatrixPart part{t, wm.data(), rows, k, dtype_row_bytes(t, (uint64_t)k)};
      cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
      cu::ActBuf a = cu::act_alloc(m.act(), k, 8);
      for (int mode = 0; mode < 3; ++mode) {
        for (int n : {1, 3, 8}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " mode " + std::to_string(mode) + " tokens " + std::to_string(n) +
                       " k " + std::to_string(k));
          if (n * k > 8192) {
            EXPECT_FALSE(cu::prep_fuses(m, n));  // matmul_prep then runs the two kernels
          }
          const std::vector<float> ones((size_t)n * rows, 1.0f);
          DevFloats y_sep(ones), y_fused(ones);
          cu::prep_act(modes[mode], n, a, nullptr);
          cu::matmul(m, a, n, y_sep.p, rows, rows, true, nullptr);
          cu::matmul_prep(m, modes[mode], a, n, y_fused.p, rows, rows, true, nullptr);
          cu::sync_device();
          const auto got = download(y_fused.p, (size_t)n * rows), want = download(y_sep.p, (size_t)n * rows);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0);
          EXPECT_GT(max_abs(want), 0.0f);
        }
      }
      cu::act_free(a);
      cu::free_matrix(m);
    }
    cu::dev_free(d_sel);
  }
}

namespace {

cu::RopeKvArgs rope_args(const int32_t* d_pos, const int32_t* d_seq, const float* d_cs, int64_t q_dim, int64_t kv_dim,
                         int64_t k_off, int64_t v_off, int hd, int n_rot, const cu::KvArgs& kv) {
  cu::RopeKvArgs r;
  r.d_pos = d_pos;
  r.d_seq = d_seq;
  r.d_cos_sin = d_cs;
  r.q_dim = q_dim;
  r.kv_dim = kv_dim;
  r.k_off = k_off;
  r.v_off = v_off;
  r.hd = hd;
  r.n_rot = n_rot;
  r.kv = kv;
  return r;
}

}  // namespace

// rope_kv into a Q8_0 cache: the codes and f16 scales the CPU's quantize_row_q8_0 makes of the rows it writes
// into an f32 cache (GQA, a partial rotary dimension, shuffled blocks); the fused QKV epilogues refuse it.
TEST(CudaKernels, RopeKvQuantizesAQ8CacheAsTheCpu) {
  REQUIRE_GPU();
  const int n_ctx = 64, block = 16, max_blocks = n_ctx / block, n_seq = 2, n = 5, n_heads = 8, n_kv = 2, hd = 64;
  const int64_t q_dim = n_heads * hd, kv_dim = n_kv * hd, k_off = q_dim, v_off = q_dim + kv_dim, ld = q_dim + 2 * kv_dim;
  std::vector<int32_t> table(n_seq * max_blocks), pos(n), seq(n);
  for (int i = 0; i < n_seq * max_blocks; ++i) table[i] = (i * 3) % (n_seq * max_blocks);
  for (int t = 0; t < n; ++t) seq[t] = t % n_seq, pos[t] = 7 * t + 3;
  int32_t *d_table = test::upload(table), *d_pos = test::upload(pos), *d_seq = test::upload(seq);
  const std::vector<float> qkv = gaussian((size_t)n * ld, 41, 3.0f), cos_sin = gaussian((size_t)n_ctx * 32, 42);
  DevFloats d_cs(cos_sin), qkv_f32(qkv), qkv_q8(qkv);
  const size_t slots = (size_t)n_seq * max_blocks * block;
  cu::KvArgs f32{test::upload(std::vector<float>(slots * kv_dim, 0.f)), test::upload(std::vector<float>(slots * kv_dim, 0.f)),
                 false, block, max_blocks, d_table};
  cu::KvArgs q8{test::upload(std::vector<int8_t>(slots * kv_dim, 0)), test::upload(std::vector<int8_t>(slots * kv_dim, 0)),
                false, block, max_blocks, d_table, true,
                test::upload(std::vector<uint16_t>(slots * kv_dim / 32, 0)),
                test::upload(std::vector<uint16_t>(slots * kv_dim / 32, 0))};
  cu::rope_kv(qkv_f32.p, ld, k_off, v_off, n, d_pos, d_seq, d_cs.p, n_heads, n_kv, hd, 32, f32, nullptr);
  cu::rope_kv(qkv_q8.p, ld, k_off, v_off, n, d_pos, d_seq, d_cs.p, n_heads, n_kv, hd, 32, q8, nullptr);
  cu::sync_device();
  EXPECT_EQ(download(qkv_f32.p, qkv.size()), download(qkv_q8.p, qkv.size()));  // Q rotated alike
  int checked = 0;
  for (int c = 0; c < 2; ++c) {
    const auto rows = download(static_cast<const float*>(c ? f32.d_v : f32.d_k), slots * kv_dim);
    const auto codes = download(static_cast<const int8_t*>(c ? q8.d_v : q8.d_k), slots * kv_dim);
    const auto scales = download(static_cast<const uint16_t*>(c ? q8.d_vs : q8.d_ks), slots * kv_dim / 32);
    for (int t = 0; t < n; ++t) {
      const int64_t slot = (int64_t)table[seq[t] * max_blocks + pos[t] / block] * block + pos[t] % block;
      std::vector<kernels::quant::BlockQ8_0> want(kv_dim / 32);
      ASSERT_TRUE(kernels::quant_quantize_row(DType::Q8_0, rows.data() + slot * kv_dim, want.data(), kv_dim));
      for (int64_t b = 0; b < kv_dim / 32; ++b) {
        EXPECT_EQ(scales[(size_t)(slot * kv_dim / 32 + b)], want[b].d) << "token " << t << " block " << b;
        for (int j = 0; j < 32; ++j) EXPECT_EQ(codes[(size_t)(slot * kv_dim + b * 32 + j)], want[b].qs[j]);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 2 * n * kv_dim / 32);
  // A QKV product cannot write a Q8_0 cache in its epilogue: matmul_rope_kv declines (the caller runs rope_kv).
  const std::vector<uint8_t> wm = random_matrix(DType::Q4_0, ld, 256, 43);
  const cu::MatrixPart part{DType::Q4_0, wm.data(), ld, 256, dtype_row_bytes(DType::Q4_0, 256)};
  cu::Matrix m = cu::upload_matrix(&part, 1, nullptr);
  cu::ActBuf a = cu::act_alloc(m.act(), 256, 1);
  const int64_t pk = cu::padded_rows(q_dim);
  const cu::RopeKvArgs r = rope_args(d_pos, d_seq, d_cs.p, q_dim, kv_dim, pk, pk + cu::padded_rows(kv_dim), hd, 32, q8);
  DevFloats y(std::vector<float>((size_t)m.rows, 0.f));
  EXPECT_FALSE(cu::matmul_rope_kv(m, a, 1, y.p, m.rows, r, nullptr));
  cu::act_free(a);
  cu::free_matrix(m);
  for (void* p : {f32.d_k, f32.d_v, q8.d_k, q8.d_v, q8.d_ks, q8.d_vs, static_cast<void*>(d_table),
                  static_cast<void*>(d_pos), static_cast<void*>(d_seq)})
    cu::dev_free(p);
}

// QKV products with RoPE and the K/V cache write in their epilogue (matmul_rope_kv) against matmul()
// followed by rope_kv(): Q rows and both caches bit for bit, for every quantized and half format, with GQA, a
// partial rotary dimension, a paged cache (f16 and f32) shared by three sequences, for 1 token (the
// single-token kernels: k = 256, a warp owns a tile, and 4096, warps share a tile and partners meet after the
// shared-memory reduction) and 6 and 32 tokens (the batched kernels' reduction; the 144-head shape has enough
// tiles for the 16- and 32-token CTAs, the small one runs 8-token CTAs). The 32-token launches also ask their
// tokens' contexts into L2 (prefetch_token_context), which must change nothing.
TEST(CudaKernels, FusedRopeKvMatchesSeparateKernel) {
  REQUIRE_GPU();
  const int n_ctx = 64, block = 16, max_blocks = n_ctx / block, n_seq = 3;
  std::vector<int32_t> table(n_seq * max_blocks), pos(32), seq(32);
  for (int i = 0; i < n_seq * max_blocks; ++i) table[i] = (i * 5) % (n_seq * max_blocks);  // shuffled blocks
  for (int t = 0; t < 32; ++t) seq[t] = t % n_seq, pos[t] = (t / n_seq) * 5 + seq[t];  // distinct slots
  int32_t *d_table = test::upload(table), *d_pos = test::upload(pos), *d_seq = test::upload(seq);
  struct Shape { int n_heads, n_kv, n_tokens; std::vector<int64_t> ks; };
  const Shape shapes[] = {{4, 2, 1, {256, 4096}}, {4, 2, 6, {256}}, {4, 2, 32, {256}}, {36, 36, 32, {256}},
                          {36, 36, 12, {256}}};
  const int hd = 64;
  for (const Shape& sh : shapes) {
    const int64_t q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd;
    const int64_t k_off = cu::padded_rows(q_dim), v_off = k_off + cu::padded_rows(kv_dim);
    const int n = sh.n_tokens;
    for (int n_rot : {hd, 32}) {
      const std::vector<float> cos_sin = gaussian((size_t)n_ctx * n_rot, 11);
      DevFloats d_cs(cos_sin);
      for (bool f16 : {true, false}) {
        for (int64_t k : sh.ks) {
          for (DType t : {DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " heads " + std::to_string(sh.n_heads) + " tokens " +
                         std::to_string(n) + " k " + std::to_string(k) + " n_rot " + std::to_string(n_rot) +
                         (f16 ? " f16" : " f32") + " cache");
            const size_t rb = dtype_row_bytes(t, (uint64_t)k);
            const auto wq = random_matrix(t, q_dim, k, 1), wk = random_matrix(t, kv_dim, k, 2),
                       wv = random_matrix(t, kv_dim, k, 3);
            const cu::MatrixPart parts[3] = {{t, wq.data(), q_dim, k, rb}, {t, wk.data(), kv_dim, k, rb},
                                             {t, wv.data(), kv_dim, k, rb}};
            cu::Matrix m = cu::upload_matrix(parts, 3, nullptr);
            ASSERT_EQ(m.rows, v_off + cu::padded_rows(kv_dim));
            cu::ActBuf a = cu::act_alloc(m.act(), k, n);
            DevFloats dx(gaussian((size_t)n * k, 5));
            cu::PrepArgs p;
            p.d_x = dx.p;
            p.ld = k;
            cu::prep_act(p, n, a, nullptr);
            const size_t cache = (size_t)n_seq * max_blocks * block * kv_dim * (f16 ? 2 : 4);
            auto zeros = [&] { return test::upload(std::vector<uint8_t>(cache, 0)); };
            cu::KvArgs kv_ref{zeros(), zeros(), f16, block, max_blocks, d_table};
            cu::KvArgs kv_fused{zeros(), zeros(), f16, block, max_blocks, d_table};
            const std::vector<float> zero_y((size_t)n * m.rows, 0.f);
            DevFloats y_ref(zero_y), y_fused(zero_y);
            cu::matmul(m, a, n, y_ref.p, m.rows, m.rows, false, nullptr);
            cu::rope_kv(y_ref.p, m.rows, k_off, v_off, n, d_pos, d_seq, d_cs.p, sh.n_heads, sh.n_kv, hd, n_rot, kv_ref,
                        nullptr);
            cu::RopeKvArgs r = rope_args(d_pos, d_seq, d_cs.p, q_dim, kv_dim, k_off, v_off, hd, n_rot, kv_fused);
            ASSERT_TRUE(cu::matmul_rope_kv(m, a, n, y_fused.p, m.rows, r, nullptr));
            cu::sync_device();
            const auto y_r = download(y_ref.p, zero_y.size()), y_f = download(y_fused.p, zero_y.size());
            int q_mismatch = 0;
            for (int tok = 0; tok < n; ++tok)
              for (int64_t i = 0; i < q_dim; ++i) q_mismatch += y_r[tok * m.rows + i] != y_f[tok * m.rows + i];
            EXPECT_EQ(q_mismatch, 0);
            const auto* kr = static_cast<const uint8_t*>(kv_ref.d_k);
            EXPECT_EQ(download(kr, cache), download(static_cast<const uint8_t*>(kv_fused.d_k), cache));
            EXPECT_EQ(download(static_cast<const uint8_t*>(kv_ref.d_v), cache),
                      download(static_cast<const uint8_t*>(kv_fused.d_v), cache));
            for (void* b : {kv_ref.d_k, kv_ref.d_v, kv_fused.d_k, kv_fused.d_v}) cu::dev_free(b);
            cu::act_free(a);
            cu::free_matrix(m);
          }
        }
      }
    }
  }
  for (void* b : {static_cast<void*>(d_table), static_cast<void*>(d_pos), static_cast<void*>(d_seq)}) cu::dev_free(b);
}

// One-token QKV products whose tiles outnumber the resident CTAs (iphone's 9,216 x 3,072, and a GQA shape over
// 4,096-long rows, 2-3 tiles per CTA): on the pooled walk (pooled_walk: whole tiles per CTA, a row's partial
// sums added in another fixed order) the Q rows and both caches equal matmul() + rope_kv() up to float
// rounding, and on the tile groups bit for bit. matvec1_last_pool shows which walk ran.
TEST(CudaKernels, FusedRopeKvPooledWalkMatchesSeparateKernel) {
  REQUIRE_GPU();
  const int block = 16, max_blocks = 4;
  const std::vector<int32_t> table = {2, 0, 3, 1}, pos = {37}, seq = {0};
  int32_t *d_table = test::upload(table), *d_pos = test::upload(pos), *d_seq = test::upload(seq);
  struct Shape { int n_heads, n_kv; int64_t k; };
  for (const Shape& sh : {Shape{24, 24, 3072}, Shape{64, 8, 4096}}) {
    const int hd = 128;
    const int64_t q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd, k = sh.k;
    const int64_t k_off = cu::padded_rows(q_dim), v_off = k_off + cu::padded_rows(kv_dim);
    for (DType t : {DType::Q4_0, DType::Q8_0, DType::MXFP4, DType::Q4_K}) {
      const size_t rb = dtype_row_bytes(t, (uint64_t)k);
      const auto wq = random_matrix(t, q_dim, k, 1), wk = random_matrix(t, kv_dim, k, 2),
                 wv = random_matrix(t, kv_dim, k, 3);
      const cu::MatrixPart parts[3] = {{t, wq.data(), q_dim, k, rb}, {t, wk.data(), kv_dim, k, rb},
                                       {t, wv.data(), kv_dim, k, rb}};
      for (int n_rot : {hd, 64}) {
        DevFloats d_cs(gaussian((size_t)64 * n_rot, 11));
        cu::Matrix m = cu::upload_matrix(parts, 3, nullptr);
        cu::ActBuf a = cu::act_alloc(m.act(), k, 1);
        DevFloats dx(gaussian((size_t)k, 5));
        cu::PrepArgs p;
        p.d_x = dx.p;
        p.ld = k;
        cu::prep_act(p, 1, a, nullptr);
        const size_t cache = (size_t)max_blocks * block * kv_dim * 4;
        auto zeros = [&] { return test::upload(std::vector<uint8_t>(cache, 0)); };
        const std::vector<float> zero_y((size_t)m.rows, 0.f);
        cu::KvArgs kv_ref{zeros(), zeros(), false, block, max_blocks, d_table};
        DevFloats y_ref(zero_y);
        cu::matmul(m, a, 1, y_ref.p, m.rows, m.rows, false, nullptr);
        cu::rope_kv(y_ref.p, m.rows, k_off, v_off, 1, d_pos, d_seq, d_cs.p, sh.n_heads, sh.n_kv, hd, n_rot, kv_ref,
                    nullptr);
        cu::sync_device();
        const auto y_r = download(y_ref.p, zero_y.size());
        const auto k_r = download(static_cast<const float*>(kv_ref.d_k), cache / 4);
        const auto v_r = download(static_cast<const float*>(kv_ref.d_v), cache / 4);
        const float scale = std::max({max_abs(y_r), max_abs(k_r), max_abs(v_r)});
        for (int mode : {0, 1}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " heads " + std::to_string(sh.n_heads) + "/" +
                       std::to_string(sh.n_kv) + " k " + std::to_string(k) + " n_rot " + std::to_string(n_rot) +
                       " pooled " + std::to_string(mode));
          cu::KvArgs kv{zeros(), zeros(), false, block, max_blocks, d_table};
          DevFloats y(zero_y);
          cu::set_matvec1_pool(mode);
          const bool ok = cu::matmul_rope_kv(m, a, 1, y.p, m.rows,
                                             rope_args(d_pos, d_seq, d_cs.p, q_dim, kv_dim, k_off, v_off, hd, n_rot, kv),
                                             nullptr);
          const int used = cu::matvec1_last_pool();
          cu::set_matvec1_pool(-1);
          ASSERT_TRUE(ok);
          EXPECT_EQ(used, mode);
          cu::sync_device();
          const auto y_f = download(y.p, zero_y.size());
          const auto k_f = download(static_cast<const float*>(kv.d_k), cache / 4);
          const auto v_f = download(static_cast<const float*>(kv.d_v), cache / 4);
          const float tol = mode == 0 ? 0.f : 1e-5f * scale;
          int bad = 0;
          for (int64_t i = 0; i < q_dim; ++i) bad += !(std::fabs(y_f[i] - y_r[i]) <= tol);
          for (size_t i = 0; i < k_r.size(); ++i) bad += !(std::fabs(k_f[i] - k_r[i]) <= tol);
          for (size_t i = 0; i < v_r.size(); ++i) bad += !(std::fabs(v_f[i] - v_r[i]) <= tol);
          EXPECT_EQ(bad, 0) << "tolerance " << tol;
          cu::dev_free(kv.d_k);
          cu::dev_free(kv.d_v);
        }
        cu::dev_free(kv_ref.d_k);
        cu::dev_free(kv_ref.d_v);
        cu::act_free(a);
        cu::free_matrix(m);
      }
    }
  }
  for (void* b : {static_cast<void*>(d_table), static_cast<void*>(d_pos), static_cast<void*>(d_seq)}) cu::dev_free(b);
}
