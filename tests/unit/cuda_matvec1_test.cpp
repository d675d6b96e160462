// The decode products' epilogues against the separate kernels they replace: SwiGLU of a stacked gate/up
// product (matvec1.cu, bit-identical), and the next RMSNorm's input written by the product that adds to the
// residual row (matvec1_norm for one token, matmul_norm for 2-32: a deferred scale, equal up to float
// rounding), SwiGLU computed by the down product while it stages its input (bit-identical), and SwiGLU in the
// batched gate/up product's epilogue (matmul_swiglu, bit-identical at the same warps per tile). Skips without
// a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "cuda_test_util.h"
#include "quant_test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;

namespace {

#define REQUIRE_GPU() MERLIN_REQUIRE_GPU()

using test::DevFloats;
using test::gaussian;
using test::max_abs;
using test::max_diff;
using test::random_matrix;

cu::Matrix upload_one(DType t, const std::vector<uint8_t>& w, int64_t rows, int64_t k) {
  const cu::MatrixPart part{t, w.data(), rows, k, dtype_row_bytes(t, (uint64_t)k)};
  return cu::upload_matrix(&part, 1, nullptr);
}

float half_round(float v) { return fp16_to_f32(f32_to_fp16(v)); }

// The first n rows of d_x (rows of m.k floats on the device) in m's input format (a Plain preparation).
cu::ActBuf prepared_rows(const cu::Matrix& m, const float* d_x, int n) {
  cu::ActBuf a = cu::act_alloc(m.act(), m.k, n);
  cu::PrepArgs plain;
  plain.d_x = d_x;
  plain.ld = m.k;
  cu::prep_act(plain, n, a, nullptr);
  return a;
}

// n rows of k Gaussian activations in m's input format (a Plain preparation).
cu::ActBuf plain_rows(const cu::Matrix& m, int64_t k, int n, uint32_t seed) {
  DevFloats dx(gaussian((size_t)n * k, seed, 2.0f));
  cu::ActBuf a = prepared_rows(m, dx.p, n);
  cu::sync_device();
  return a;
}

// RMSNorm weights near 1.
std::vector<float> norm_weights(int64_t n, uint32_t seed) {
  std::vector<float> w = gaussian((size_t)n, seed, 0.3f);
  for (float& v : w) v += 1.0f;
  return w;
}

// A reader's outputs for n tokens of x (rows of r.k elements).
std::vector<float> reader_out(const cu::Matrix& r, const cu::ActBuf& x, int n) {
  DevFloats z(std::vector<float>((size_t)n * r.rows, 0.0f));
  cu::matmul(r, x, n, z.p, r.rows, r.rows, false, nullptr);
  return test::download(z.p, (size_t)n * r.rows);
}

// A producer's n-token output added to residual rows y0 (n_out each) two ways: matmul() then
// prep_act(RmsNorm) into `want`, and matmul_norm() into `got` with its per-block sums of squares in `part`
// (its scales still lack 1 / rms); `folded` is the copy of got a reader takes. yw / yg: the residual rows.
struct FoldedRows {
  cu::ActBuf want{}, got{}, folded{};
  double* part = nullptr;
  std::vector<float> yw, yg;
  FoldedRows(const cu::Matrix& prod, const cu::ActBuf& x, int n, int64_t n_out, const std::vector<float>& y0,
             const float* d_norm_w, float eps) {
    DevFloats want_y(y0), got_y(y0);
    part = static_cast<double*>(cu::dev_alloc((size_t)n * (n_out / 32) * sizeof(double)));
    want = cu::act_alloc(cu::ActKind::Q8_0, n_out, n);
    got = cu::act_alloc(cu::ActKind::Q8_0, n_out, n);
    cu::matmul(prod, x, n, want_y.p, n_out, n_out, true, nullptr);
    const cu::PrepArgs norm{cu::Prep::RmsNorm, want_y.p, n_out, d_norm_w, eps, 0, nullptr};
    cu::prep_act(norm, n, want, nullptr);
    EXPECT_TRUE(cu::matmul_norm(prod, x, n, got_y.p, n_out, n_out, true, d_norm_w, got, part, nullptr));
    cu::sync_device();
    yw = test::download(want_y.p, y0.size());
    yg = test::download(got_y.p, y0.size());
    folded = got;
    folded.rms_part = part;
    folded.rms_eps = eps;
    folded.rms_rows = n;
  }
  ~FoldedRows() {
    cu::act_free(want);
    cu::act_free(got);
    cu::dev_free(part);
  }
  FoldedRows(const FoldedRows&) = delete;
  FoldedRows& operator=(const FoldedRows&) = delete;
};

// Where element i / block b of row t lies in an ActBuf's fragment planes (act_impl.cuh's frag_code_index and
// frag_scale_index, written out again here as the test's own reading of the layout).
size_t frag_code(int t, int64_t i, int64_t k) {
  const int j = (int)(i & 31), lane = (t & 7) * 4 + ((j & 15) >> 2);
  return (size_t)((((int64_t)(t >> 3) * (k >> 5) + (i >> 5)) * 32 + lane) * 8 + (j >> 4) * 4 + (j & 3));
}
size_t frag_scale(int t, int64_t b, int64_t k) { return (size_t)(((int64_t)(t >> 3) * (k >> 5) + b) * 8 + (t & 7)); }

// Every plane of two activation buffers holding n rows of k elements, byte for byte (fragment planes in whole
// groups of 8 rows and, for halves, rows padded to 32 columns: the padding is zero in both).
void expect_same_planes(const cu::ActBuf& want, const cu::ActBuf& got, int n, int64_t k) {
  auto same = [&](const auto* w, const auto* g, size_t cnt, const char* plane) {
    if (!w) return;
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    const auto hw = test::download(w, cnt), hg = test::download(g, cnt);
    EXPECT_EQ(std::memcmp(hw.data(), hg.data(), cnt * sizeof(T)), 0) << plane;
  };
  const size_t ne = (size_t)n * k, nf = (size_t)(n + 7) / 8 * 8 * (size_t)((k + 31) / 32 * 32);
  same(want.f, got.f, ne, "f");
  same(want.q, got.q, ne, "q");
  same(want.scale, got.scale, ne / 32, "scale");
  same(want.sum, got.sum, ne / 32, "sum");
  same(want.fq, got.fq, nf, "fq");
  same(want.fs, got.fs, nf / 32, "fs");
  same(want.fsum, got.fsum, nf / 32, "fsum");
  same(want.fh, got.fh, nf, "fh");
  same(want.hi, got.hi, ne, "hi");
  same(want.lo, got.lo, ne, "lo");
  same(want.fhi, got.fhi, nf, "fhi");
  same(want.flo, got.flo, nf, "flo");
}

}  // namespace

// One token through a stacked [gate; up] matrix with the SwiGLU in the product's epilogue (matvec1_swiglu)
// gives exactly the bits of the product followed by prep_act(SwiGlu), in every output format, for both
// group sizes of the quantized kernel (16 or 8 warps' worth of tiles: S = 1, 2), with a partial last group
// (ffn = 96: 6 output tiles) and rows long enough for several rounds per warp; F16/BF16 matrices (a warp
// per gate/up row pair) also with a padded ffn (40 rows of 48).
TEST(CudaMatvec1, SwiGluEpilogueMatchesSeparateKernel) {
  REQUIRE_GPU();
  struct Shape { int64_t ffn, k; };
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0, DType::F16, DType::BF16})
  for (const Shape s : {Shape{96, 768}, Shape{2048, 768}, Shape{1056, 4096}, Shape{40, 256}}) {
    const bool half = t == DType::F16 || t == DType::BF16;
    if (!half && s.ffn % 32 != 0) continue;
    const int64_t up = cu::padded_rows(s.ffn);
    const std::vector<uint8_t> g = random_matrix(t, s.ffn, s.k, 31), u = random_matrix(t, s.ffn, s.k, 32);
    const size_t rb = dtype_row_bytes(t, (uint64_t)s.k);
    const cu::MatrixPart parts[2] = {{t, g.data(), s.ffn, s.k, rb}, {t, u.data(), s.ffn, s.k, rb}};
    cu::Matrix m = cu::upload_matrix(parts, 2, nullptr);
    cu::ActBuf a = cu::act_alloc(m.act(), s.k, 1);
    DevFloats dx(gaussian((size_t)s.k, 33, 2.0f)), dy(std::vector<float>((size_t)m.rows, 0.0f));
    cu::PrepArgs p;
    p.d_x = dx.p;
    p.ld = s.k;
    cu::prep_act(p, 1, a, nullptr);
    for (cu::ActKind kind : {cu::ActKind::Q8_0, cu::ActKind::F16, cu::ActKind::BF16, cu::ActKind::F32})
    for (int ls : {0, 1}) {
      if (half && (kind == cu::ActKind::Q8_0 || ls == 1)) continue;  // halves emit element by element
      SCOPED_TRACE(std::string(dtype_name(t)) + " ffn " + std::to_string(s.ffn) + " k " + std::to_string(s.k) +
                   " kind " + std::to_string((int)kind) + " lsplit " + std::to_string(ls));
      cu::set_matvec1_split(ls);
      ASSERT_TRUE(cu::swiglu_fuses(m, s.ffn, up, kind));
      cu::ActBuf want = cu::act_alloc(kind, s.ffn, 1), got = cu::act_alloc(kind, s.ffn, 1);
      cu::matmul(m, a, 1, dy.p, m.rows, m.rows, false, nullptr);
      const cu::PrepArgs glu{cu::Prep::SwiGlu, dy.p, m.rows, nullptr, 0, up, nullptr};
      cu::prep_act(glu, 1, want, nullptr);
      ASSERT_TRUE(cu::matvec1_swiglu(m, a, s.ffn, up, got, nullptr));
      cu::sync_device();
      cu::set_matvec1_split(-1);
      expect_same_planes(want, got, 1, s.ffn);
      const size_t n = (size_t)s.ffn;
      if (kind == cu::ActKind::F32) {
        EXPECT_GT(max_abs(test::download(got.f, n)), 0.0f);
      }
      cu::act_free(want);
      cu::act_free(got);
    }
    EXPECT_FALSE(cu::swiglu_fuses(m, s.ffn, up, cu::ActKind::Q8_K));
    if (half) {
      EXPECT_FALSE(cu::swiglu_fuses(m, s.ffn, up, cu::ActKind::Q8_0));
    }
    cu::act_free(a);
    cu::free_matrix(m);
  }
}

// One token through a product that adds to the residual row (Wo, down) with the next RMSNorm's input written
// in its epilogue (matvec1_norm), against the same product followed by prep_act(RmsNorm), for each producer
// format and every split the epilogue allows (S = 2, 4, 8 warps per tile), on base- and macbook-shaped matrices and
// partial-group shapes (96 rows; an odd tile count with fewer rows written than the matrix has; 512 tiles, so
// several groups per CTA). The residual rows are bit-identical (same split, same sums). The folded row holds the codes of
// y * w with a block scale lacking 1 / rms(y): after the reader's correction (scale * 1 / rms, rounded to
// half) the block scales must equal prep_act's (but for one just at a rounding boundary) and the codes may differ only at a rounding tie (by 1, in at
// most 1 of 1,000 elements); a reader of each Q8_0-input format must then agree with the separate path to
// 1e-3 of its largest output (a flipped code moves one element by 1/127 of its block's largest value).
TEST(CudaMatvec1, NormEpilogueMatchesSeparateKernel) {
  REQUIRE_GPU();
  struct Shape { int64_t n, k, out; };  // out: the rows written (a multiple of 32, at most n)
  const float eps = 1e-5f;
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0})
  for (const Shape s : {Shape{768, 768, 768}, Shape{768, 2048, 768}, Shape{4096, 4096, 4096}, Shape{96, 256, 96},
                        Shape{80, 256, 64}, Shape{8192, 256, 8192}}) {
    const std::vector<uint8_t> w = random_matrix(t, s.n, s.k, 41);
    cu::Matrix m = upload_one(t, w, s.n, s.k);
    const int64_t o = s.out;
    ASSERT_TRUE(cu::norm_fold_fits(m, o));
    cu::ActBuf a = plain_rows(m, s.k, 1, 42);
    const std::vector<float> y0 = gaussian((size_t)o, 43, 3.0f);
    DevFloats dnw(norm_weights(o, 44));
    double* part = static_cast<double*>(cu::dev_alloc((size_t)o / 32 * sizeof(double)));
    for (int ls : {1, 2, 3}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " n " + std::to_string(s.n) + " out " + std::to_string(o) + " k " +
                   std::to_string(s.k) + " lsplit " + std::to_string(ls));
      cu::set_matvec1_split(ls);
      DevFloats want_y(y0), got_y(y0);
      // got has room for 2 rows, so that the 2-token read below fails on the deferred norm, not the row count.
      cu::ActBuf want = cu::act_alloc(cu::ActKind::Q8_0, o, 1), got = cu::act_alloc(cu::ActKind::Q8_0, o, 2);
      cu::matmul(m, a, 1, want_y.p, o, o, true, nullptr);
      const cu::PrepArgs norm{cu::Prep::RmsNorm, want_y.p, o, dnw.p, eps, 0, nullptr};
      cu::prep_act(norm, 1, want, nullptr);
      ASSERT_TRUE(cu::matvec1_norm(m, a, got_y.p, o, true, dnw.p, got, part, nullptr));
      cu::sync_device();
      cu::set_matvec1_split(-1);
      const std::vector<float> yw = test::download(want_y.p, (size_t)o), yg = test::download(got_y.p, (size_t)o);
      EXPECT_EQ(std::memcmp(yw.data(), yg.data(), yw.size() * sizeof(float)), 0) << "residual rows";

      // The folded row on the host: the reader's scale correction, then codes and scales against prep_act's.
      const std::vector<double> ss = test::download(part, (size_t)o / 32);
      double sum = 0, host = 0;
      for (double v : ss) sum += v;
      for (float v : yw) host += (double)v * v;
      EXPECT_NEAR(sum, host, 1e-12 * host);
      const float inv_rms = 1.0f / std::sqrt((float)(sum / (double)o) + eps);
      const std::vector<float> ws = test::download(want.scale, (size_t)o / 32), gs = test::download(got.scale, (size_t)o / 32);
      int scale_diff = 0;
      for (size_t b = 0; b < ws.size(); ++b) scale_diff += half_round(gs[b] * inv_rms) != ws[b];
      EXPECT_LE(scale_diff, 1);  // a scale within an ulp of a half rounding boundary
      const std::vector<int8_t> wq = test::download(want.q, (size_t)o), gq = test::download(got.q, (size_t)o);
      int code_diff = 0, worst = 0;
      for (size_t i = 0; i < wq.size(); ++i) {
        code_diff += wq[i] != gq[i];
        worst = std::max(worst, std::abs(wq[i] - gq[i]));
      }
      EXPECT_LE(worst, 1);
      EXPECT_LE(code_diff, (int)(o / 1000));

      // Readers of the folded row against readers of prep_act's.
      cu::ActBuf folded = got;
      folded.rms_part = part;
      folded.rms_eps = eps;
      folded.rms_rows = 1;
      for (DType rt : {DType::Q8_0, DType::Q4_0, DType::MXFP4}) {
        const int64_t rows = 272;
        const std::vector<uint8_t> rw = random_matrix(rt, rows, o, 45);
        cu::Matrix r = upload_one(rt, rw, rows, o);
        const std::vector<float> hw = reader_out(r, want, 1), hg = reader_out(r, folded, 1);
        const float diff = max_diff(hw, hg);
        EXPECT_GT(max_abs(hw), 0.0f);
        EXPECT_LE(diff, 1e-3f * max_abs(hw)) << "reader " << dtype_name(rt);
        if (code_diff == 0 && scale_diff == 0) {
          EXPECT_LE(diff, 1e-6f * max_abs(hw)) << "reader " << dtype_name(rt);
        }
        // A deferred row is for single-token products only.
        if (rt == DType::Q4_0) {
          EXPECT_THROW(reader_out(r, folded, 2), Error);
        }
        cu::free_matrix(r);
      }
      cu::act_free(want);
      cu::act_free(got);
    }
    cu::dev_free(part);
    cu::act_free(a);
    cu::free_matrix(m);
  }
}

// A single-token product whose input is SwiGLU of the gate/up row, computed while it stages the row
// (ActBuf::glu_src), gives exactly the bits of prep_act(SwiGlu) followed by the product: for each format that
// reads Q8_0, with the plain epilogue (every split) and the RMSNorm one, for rows of one pass of a CTA's warps
// and of several (k = 5,632: 176 blocks), and a gate/up buffer whose up half starts past padding.
TEST(CudaMatvec1, SwiGluInputMatchesSeparateKernel) {
  REQUIRE_GPU();
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4})
    for (int64_t k : {256, 2048, 5632}) {
      const int64_t n = 768, off = k + 64;  // the up rows start 64 elements past the gate rows' end
      const std::vector<uint8_t> w = random_matrix(t, n, k, 51);
      cu::Matrix m = upload_one(t, w, n, k);
      ASSERT_TRUE(cu::matvec1_glu_fits(m));
      DevFloats gu(gaussian((size_t)(off + k), 52, 2.0f));
      cu::ActBuf want_x = cu::act_alloc(cu::ActKind::Q8_0, k, 1);
      const cu::PrepArgs glu{cu::Prep::SwiGlu, gu.p, off + k, nullptr, 0, off, nullptr};
      cu::prep_act(glu, 1, want_x, nullptr);
      cu::ActBuf got_x = cu::act_alloc(cu::ActKind::Q8_0, k, 1);  // its planes are never written
      got_x.glu_src = gu.p;
      got_x.glu_offset = off;
      const std::vector<float> y0 = gaussian((size_t)n, 53, 3.0f);
      for (int ls : {-1, 0, 1, 2, 3}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " k " + std::to_string(k) + " lsplit " + std::to_string(ls));
        cu::set_matvec1_split(ls);
        DevFloats want_y(y0), got_y(y0);
        cu::matmul(m, want_x, 1, want_y.p, n, n, true, nullptr);
        cu::matmul(m, got_x, 1, got_y.p, n, n, true, nullptr);
        cu::sync_device();
        const auto yw = test::download(want_y.p, (size_t)n), yg = test::download(got_y.p, (size_t)n);
        EXPECT_EQ(std::memcmp(yw.data(), yg.data(), yw.size() * sizeof(float)), 0) << "plain";
        EXPECT_GT(max_abs(yw), 0.0f);
      }
      cu::set_matvec1_split(-1);
      // The RMSNorm epilogue (down's usual launch): outputs and the next norm's input, bit for bit.
      DevFloats dnw(norm_weights(n, 54)), want_y(y0), got_y(y0);
      double* part_w = static_cast<double*>(cu::dev_alloc((size_t)n / 32 * sizeof(double)));
      double* part_g = static_cast<double*>(cu::dev_alloc((size_t)n / 32 * sizeof(double)));
      cu::ActBuf want = cu::act_alloc(cu::ActKind::Q8_0, n, 1), got = cu::act_alloc(cu::ActKind::Q8_0, n, 1);
      ASSERT_TRUE(cu::matvec1_norm(m, want_x, want_y.p, n, true, dnw.p, want, part_w, nullptr));
      ASSERT_TRUE(cu::matvec1_norm(m, got_x, got_y.p, n, true, dnw.p, got, part_g, nullptr));
      cu::sync_device();
      EXPECT_EQ(test::download(want_y.p, (size_t)n), test::download(got_y.p, (size_t)n)) << "norm: rows";
      EXPECT_EQ(test::download(want.q, (size_t)n), test::download(got.q, (size_t)n)) << "norm: codes";
      EXPECT_EQ(test::download(want.scale, (size_t)n / 32), test::download(got.scale, (size_t)n / 32));
      EXPECT_EQ(test::download(part_w, (size_t)n / 32), test::download(part_g, (size_t)n / 32));
      // A SwiGLU row is for single-token products only.
      DevFloats y2(std::vector<float>((size_t)2 * n, 0.f));
      EXPECT_THROW(cu::matmul(m, got_x, 2, y2.p, n, n, false, nullptr), Error);
      cu::dev_free(part_w);
      cu::dev_free(part_g);
      cu::act_free(want);
      cu::act_free(got);
      got_x.glu_src = nullptr;
      cu::act_free(got_x);
      cu::act_free(want_x);
      cu::free_matrix(m);
    }
  // Formats that read Q8_K rows, and half rows, cannot.
  const std::vector<uint8_t> q4k = random_matrix(DType::Q4_K, 64, 256, 55), f16 = random_matrix(DType::F16, 64, 256, 56);
  cu::Matrix mk = upload_one(DType::Q4_K, q4k, 64, 256), mh = upload_one(DType::F16, f16, 64, 256);
  EXPECT_FALSE(cu::matvec1_glu_fits(mk));
  EXPECT_FALSE(cu::matvec1_glu_fits(mh));
  cu::free_matrix(mk);
  cu::free_matrix(mh);
}

// The head's product with its argmax in the same kernel (matvec1_argmax) writes the plain product's bits and
// picks argmax_rows' index: on random rows, on a tie (the largest row copied to a later and to an earlier
// index: the first one wins) and past a NaN row (a NaN block scale), for every quantized format and both
// short (base's head: k = 768) and long rows.
TEST(CudaMatvec1, ArgmaxMatchesArgmaxRows) {
  REQUIRE_GPU();
  struct Shape { int64_t n, k; };
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0})
    for (const Shape sh : {Shape{50257, 768}, Shape{3000, 4096}}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " n " + std::to_string(sh.n) + " k " + std::to_string(sh.k));
      std::vector<uint8_t> w = random_matrix(t, sh.n, sh.k, 61);
      const size_t rb = dtype_row_bytes(t, (uint64_t)sh.k);
      auto* key = static_cast<unsigned long long*>(cu::dev_alloc(sizeof(unsigned long long)));
      auto* ids = static_cast<int32_t*>(cu::dev_alloc(sizeof(int32_t)));
      int64_t want_first = -1;
      const int rounds = t == DType::MXFP4 ? 3 : 4;  // an e8m0 scale has no NaN (0xFF is 2^127 here)
      for (int round = 0; round < rounds; ++round) {
        cu::Matrix m = upload_one(t, w, sh.n, sh.k);
        ASSERT_TRUE(cu::matvec1_argmax_fits(m));
        cu::ActBuf x = plain_rows(m, sh.k, 1, 62);
        DevFloats want_y(std::vector<float>((size_t)sh.n, 0.f)), got_y(std::vector<float>((size_t)sh.n, 0.f));
        cu::matmul(m, x, 1, want_y.p, sh.n, sh.n, false, nullptr);
        cu::argmax_rows(want_y.p, sh.n, 1, sh.n, ids, nullptr);
        cu::copy_to_device(key, std::vector<unsigned long long>{0ull}.data(), sizeof(unsigned long long));
        ASSERT_TRUE(cu::matvec1_argmax(m, x, got_y.p, sh.n, key, nullptr));
        cu::sync_device();
        const auto yw = test::download(want_y.p, (size_t)sh.n), yg = test::download(got_y.p, (size_t)sh.n);
        EXPECT_EQ(std::memcmp(yw.data(), yg.data(), yw.size() * sizeof(float)), 0) << "round " << round;
        const int32_t want = test::download(ids, 1)[0];
        const int32_t got = cu::argmax_key_row(test::download(key, 1)[0]);
        EXPECT_EQ(got, want) << "round " << round;
        if (round == 0) want_first = want;
        if (round == 1) {
          EXPECT_EQ(want, want_first) << "a later copy of the largest row does not win the tie";
        } else if (round == 2) {
          EXPECT_EQ(want, 5) << "an earlier copy does";
        } else if (round == 3) {
          EXPECT_NE(want, 5) << "a NaN row never wins";
        }
        // Next round's matrix: the largest row copied to a later row, then to row 5, then row 5 made NaN.
        const int64_t src = want;
        if (round == 0) std::memcpy(&w[(size_t)(sh.n - 1) * rb], &w[(size_t)src * rb], rb);
        if (round == 1) std::memcpy(&w[5 * rb], &w[(size_t)src * rb], rb);
        if (round == 2) {  // a NaN half scale in row 5's first block (Q8_0, Q4_0, Q4_K: d first; TQ2_0: after qs)
          if (t == DType::Q8_0 || t == DType::Q4_0 || t == DType::Q4_K) {
            w[5 * rb] = 0x00;
            w[5 * rb + 1] = 0x7E;
          } else if (t == DType::TQ2_0) {
            w[5 * rb + 64] = 0x00;
            w[5 * rb + 65] = 0x7E;
          }
        }
        cu::act_free(x);
        cu::free_matrix(m);
      }
      cu::dev_free(key);
      cu::dev_free(ids);
    }
}

// The batched greedy head (matmul_argmax, then argmax_keys_to_ids) picks, for every token, argmax_rows'
// index over matmul's logits of the same tokens, also when the largest row is copied to an earlier row (the
// first one wins), for 2..32 tokens (8-, 16- and 32-token CTAs) and every format the batched products take,
// at the chosen shape and at 1 and 2 warps per tile (reduce_argmax_pair: the batched head's shape, which
// needs more tiles than a test matrix to be chosen); the keys are zero again afterwards.
TEST(CudaMatmul, ArgmaxMatchesArgmaxRows) {
  REQUIRE_GPU();
  const int64_t rows = 16 * 300 + 5, k = 768;
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0, DType::F16, DType::BF16})
    for (int n : {2, 13, 32}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " tokens " + std::to_string(n));
      std::vector<uint8_t> w = random_matrix(t, rows, k, 71);
      const size_t rb = dtype_row_bytes(t, (uint64_t)k);
      auto* keys = static_cast<unsigned long long*>(cu::dev_alloc((size_t)n * sizeof(unsigned long long)));
      auto* want_ids = static_cast<int32_t*>(cu::dev_alloc((size_t)n * sizeof(int32_t)));
      auto* got_ids = static_cast<int32_t*>(cu::dev_alloc((size_t)n * sizeof(int32_t)));
      for (int round = 0; round < 2; ++round) {
        cu::Matrix m = upload_one(t, w, rows, k);
        ASSERT_TRUE(cu::matmul_argmax_fits(m, n));
        cu::ActBuf x = plain_rows(m, k, n, 72);
        DevFloats y(std::vector<float>((size_t)n * rows, 0.f));
        std::vector<int32_t> want;
        for (int split : {0, 1, 2}) {  // the chosen shape (8 warps per tile here), then the pair epilogue's
          cu::set_matmul_shape(split, 0);
          cu::matmul(m, x, n, y.p, rows, rows, false, nullptr);
          cu::argmax_rows(y.p, rows, n, rows, want_ids, nullptr);
          cu::matmul_argmax(m, x, n, rows, keys, nullptr);
          cu::argmax_keys_to_ids(keys, n, got_ids, nullptr);
          cu::sync_device();
          cu::set_matmul_shape(0, 0);
          want = test::download(want_ids, (size_t)n);
          EXPECT_EQ(test::download(got_ids, (size_t)n), want) << "round " << round << " split " << split;
          for (unsigned long long key : test::download(keys, (size_t)n)) EXPECT_EQ(key, 0ull);
        }
        if (round == 0) {  // token 0's largest row copied to row 3: row 3 must win for it now
          EXPECT_GT(want[0], 3);
          std::memcpy(&w[3 * rb], &w[(size_t)want[0] * rb], rb);
        } else {
          EXPECT_EQ(want[0], 3);
        }
        cu::act_free(x);
        cu::free_matrix(m);
      }
      cu::dev_free(keys);
      cu::dev_free(want_ids);
      cu::dev_free(got_ids);
    }
  cu::Matrix f32{};
  f32.fmt = 0;
  EXPECT_FALSE(cu::matmul_argmax_fits(f32, 4));
}

// Where the epilogue cannot apply it says so and queues nothing: F16/BF16 rows, outputs not in whole blocks.
TEST(CudaMatvec1, NormEpilogueRefusesWhatItCannotDo) {
  REQUIRE_GPU();
  const std::vector<uint8_t> h = random_matrix(DType::F16, 64, 64, 1), q = random_matrix(DType::Q4_0, 80, 64, 2);
  cu::Matrix mh = upload_one(DType::F16, h, 64, 64), mq = upload_one(DType::Q4_0, q, 80, 64);
  EXPECT_FALSE(cu::norm_fold_fits(mh, 64));
  EXPECT_FALSE(cu::norm_fold_fits(mq, 80));  // 80 % 32 != 0
  EXPECT_TRUE(cu::norm_fold_fits(mq, 64));
  cu::free_matrix(mh);
  cu::free_matrix(mq);
}

// The same fold for decode-sized steps (matmul_norm): n tokens through the batched products, each token's
// codes and unnormalised block scales in the fragment planes and its per-block sums of squares, for each
// producer format (F16 too: the epilogue is the batched products' common one), token counts that take each
// kernel (8, 16 and 32 tokens per CTA, partial groups of 8) and shapes of base, macbook and a partial tile
// set. The producer keeps at most 4 warps per tile, so its residual rows may differ from matmul()'s in the
// order of a row's partial sums (1e-5 of the largest); the corrected scales must equal prep_act's but for
// those at a rounding boundary, codes differ at most by 1 at ties, and every batched reader that stages its
// input (reads_deferred_norm) agrees with reading prep_act's rows to 2e-3 of its largest output (1e-3 for
// one token: with 32 tokens two flipped codes can meet in one output, and MXFP4's random block scales make
// a single weight dominate it).
TEST(CudaMatmulNorm, EpilogueMatchesSeparateKernel) {
  REQUIRE_GPU();
  struct Shape { int64_t n, k; };
  const float eps = 1e-5f;
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::F16})
  for (const Shape s : {Shape{768, 768}, Shape{768, 2048}, Shape{4096, 4096}, Shape{96, 256}})
  for (int n : {2, 8, 13, 32}) {
    if (s.n == 4096 && n == 13) continue;  // the large shape at the counts that pick distinct kernels only
    SCOPED_TRACE(std::string(dtype_name(t)) + " n_out " + std::to_string(s.n) + " k " + std::to_string(s.k) +
                 " tokens " + std::to_string(n));
    const std::vector<uint8_t> w = random_matrix(t, s.n, s.k, 51);
    cu::Matrix m = upload_one(t, w, s.n, s.k);
    ASSERT_TRUE(cu::matmul_norm_fits(m, s.n, n));
    cu::ActBuf a = plain_rows(m, s.k, n, 52);
    DevFloats dnw(norm_weights(s.n, 54));
    const int64_t kb = s.n / 32;
    const FoldedRows fr(m, a, n, s.n, gaussian((size_t)n * s.n, 53, 3.0f), dnw.p, eps);
    const cu::ActBuf &want = fr.want, &got = fr.got, &folded = fr.folded;
    const std::vector<float> &yw = fr.yw, &yg = fr.yg;
    double* part = fr.part;
    EXPECT_LE(max_diff(yw, yg), 1e-5f * max_abs(yw)) << "residual rows";

    const std::vector<double> ss = test::download(part, (size_t)n * kb);
    const size_t nf = (size_t)(n + 7) / 8 * 8 * s.n;
    const std::vector<float> ws = test::download(want.fs, nf / 32), gs = test::download(got.fs, nf / 32);
    const std::vector<int8_t> wq = test::download(want.fq, nf), gq = test::download(got.fq, nf);
    int scale_diff = 0, code_diff = 0, worst = 0;
    for (int tok = 0; tok < n; ++tok) {
      double sum = 0, host = 0;
      for (int64_t b = 0; b < kb; ++b) sum += ss[tok * kb + b];
      for (int64_t i = 0; i < s.n; ++i) host += (double)yg[tok * s.n + i] * yg[tok * s.n + i];
      EXPECT_NEAR(sum, host, 1e-12 * host) << "token " << tok;
      const float inv_rms = 1.0f / std::sqrt((float)(sum / (double)s.n) + eps);
      for (int64_t b = 0; b < kb; ++b)
        scale_diff += half_round(gs[frag_scale(tok, b, s.n)] * inv_rms) != ws[frag_scale(tok, b, s.n)];
      for (int64_t i = 0; i < s.n; ++i) {
        const int d = std::abs(wq[frag_code(tok, i, s.n)] - gq[frag_code(tok, i, s.n)]);
        code_diff += d != 0;
        worst = std::max(worst, d);
      }
    }
    EXPECT_LE(scale_diff, 1 + n * kb / 1000);
    EXPECT_LE(worst, 1);
    EXPECT_LE(code_diff, 1 + n * s.n / 1000);

    for (DType rt : {DType::Q8_0, DType::Q4_0, DType::MXFP4}) {
      const int64_t rows = 272;
      const std::vector<uint8_t> rw = random_matrix(rt, rows, s.n, 55);
      cu::Matrix r = upload_one(rt, rw, rows, s.n);
      if (!cu::reads_deferred_norm(r, n)) {  // its CTAs would read the unscaled rows from global memory
        EXPECT_THROW(reader_out(r, folded, n), Error) << dtype_name(rt);
        cu::free_matrix(r);
        continue;
      }
      EXPECT_THROW(reader_out(r, folded, n - 1), Error) << "a different token count";
      const std::vector<float> hw = reader_out(r, want, n), hg = reader_out(r, folded, n);
      const float diff = max_diff(hw, hg);
      EXPECT_GT(max_abs(hw), 0.0f);
      EXPECT_LE(diff, 2e-3f * max_abs(hw)) << "reader " << dtype_name(rt);
      cu::free_matrix(r);
    }
    cu::act_free(a);
    cu::free_matrix(m);
  }
}

// matmul_norm's half-plane mode (half_only, for readers on the H kernels): the residual rows bit-identical
// to matmul()'s (the product keeps its warps per tile), the half plane y * w rounded to half at every
// element (frag_h_index, written out here), the sums of squares per token and 16 outputs to 1e-12, and a
// reader that takes the half plane (reads_half_norm: 2,400 rows, 32-token CTAs) agreeing with one reading
// prep_act's RMSNorm rows to 2e-3 of its largest output; a reader of the wrong token count or one on the
// int8 kernels (272 rows: 8-token CTAs) refuses the buffer. Shapes of base (Wo, down) and a partial tile set.
TEST(CudaMatmulNorm, HalfPlaneMatchesSeparateKernel) {
  REQUIRE_GPU();
  struct Shape { int64_t n, k; };
  const float eps = 1e-5f;
  auto frag_h = [](int t, int64_t i, int64_t k) {
    const int j = (int)(i & 31), lane = (t & 7) * 4 + ((j & 15) >> 2);
    return (size_t)((((int64_t)(t >> 3) * (k >> 5) + (i >> 5)) * 32 + lane) * 8 + (j >> 4) * 4 + ((j & 1) << 1) +
                    ((j >> 1) & 1));
  };
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::F16})
  for (const Shape s : {Shape{768, 768}, Shape{768, 2048}, Shape{160, 256}})
  for (int n : {17, 32}) {
    SCOPED_TRACE(std::string(dtype_name(t)) + " n_out " + std::to_string(s.n) + " k " + std::to_string(s.k) +
                 " tokens " + std::to_string(n));
    cu::Matrix m = upload_one(t, random_matrix(t, s.n, s.k, 51), s.n, s.k);
    ASSERT_TRUE(cu::matmul_norm_half_fits(m, s.n, n));
    cu::ActBuf a = plain_rows(m, s.k, n, 52);
    const std::vector<float> nw = norm_weights(s.n, 54), y0 = gaussian((size_t)n * s.n, 53, 3.0f);
    DevFloats dnw(nw), want_y(y0), got_y(y0);
    const int64_t tiles = s.n / 16;
    auto* part = static_cast<double*>(cu::dev_alloc((size_t)n * tiles * sizeof(double)));
    cu::ActBuf want = cu::act_alloc(cu::ActKind::Q8_0, s.n, n), got = cu::act_alloc(cu::ActKind::Q8_0, s.n, n);
    cu::matmul(m, a, n, want_y.p, s.n, s.n, true, nullptr);
    const cu::PrepArgs norm{cu::Prep::RmsNorm, want_y.p, s.n, dnw.p, eps, 0, nullptr};
    cu::prep_act(norm, n, want, nullptr);
    ASSERT_TRUE(cu::matmul_norm(m, a, n, got_y.p, s.n, s.n, true, dnw.p, got, part, nullptr, true));
    cu::sync_device();
    const std::vector<float> yw = test::download(want_y.p, y0.size()), yg = test::download(got_y.p, y0.size());
    ASSERT_EQ(std::memcmp(yw.data(), yg.data(), yw.size() * sizeof(float)), 0) << "residual rows, bit for bit";
    const std::vector<double> ss = test::download(part, (size_t)n * tiles);
    const std::vector<uint16_t> fh = test::download(got.fh, (size_t)(n + 7) / 8 * 8 * s.n);
    int half_diff = 0;
    for (int tok = 0; tok < n; ++tok)
      for (int64_t b = 0; b < tiles; ++b) {
        double host = 0;
        for (int64_t i = b * 16; i < b * 16 + 16; ++i) {
          const float y = yg[(size_t)tok * s.n + i];
          host += (double)y * y;
          half_diff += fh[frag_h(tok, i, s.n)] != f32_to_fp16(y * nw[(size_t)i]);
        }
        EXPECT_NEAR(ss[(size_t)tok * tiles + b], host, 1e-12 * host) << "token " << tok << " tile " << b;
      }
    EXPECT_EQ(half_diff, 0) << "half plane";
    cu::ActBuf folded = got;
    folded.rms_part = part;
    folded.rms_eps = eps;
    folded.rms_rows = n;
    folded.rms_block = 16;
    for (DType rt : {DType::Q8_0, DType::Q4_0}) {
      cu::Matrix r = upload_one(rt, random_matrix(rt, 16 * 150, s.n, 55), 16 * 150, s.n);
      ASSERT_TRUE(cu::reads_half_norm(r, n)) << dtype_name(rt);
      const std::vector<float> hw = reader_out(r, want, n), hg = reader_out(r, folded, n);
      EXPECT_GT(max_abs(hw), 0.0f);
      EXPECT_LE(max_diff(hw, hg), 2e-3f * max_abs(hw)) << "reader " << dtype_name(rt);
      EXPECT_THROW(reader_out(r, folded, n - 1), Error) << "a different token count";
      cu::free_matrix(r);
      cu::Matrix small = upload_one(rt, random_matrix(rt, 272, s.n, 56), 272, s.n);
      EXPECT_FALSE(cu::reads_half_norm(small, n));
      EXPECT_THROW(reader_out(small, folded, n), Error) << "a reader on the int8 kernels";
      cu::free_matrix(small);
    }
    cu::act_free(want);
    cu::act_free(got);
    cu::act_free(a);
    cu::dev_free(part);
    cu::free_matrix(m);
  }
}

// n >= 2 tokens through a stacked [gate; up] matrix with the SwiGLU in the batched product's epilogue
// (matmul_swiglu) give exactly the bits of matmul() then prep_act(SwiGlu) at the same kernel shape
// (set_matmul_shape: 1 or 2 warps per tile, 8, 16 or 32 tokens per CTA), in every plane of every output
// format, for each weight format, token counts with partial groups of 8, shapes of base (short rows: rounds
// of 2 at 32 tokens per CTA), a long row (several rounds per warp), an odd number of blocks of 32 (a
// partial last tile set) and a small matrix. Then, at the epilogue's own choice of shape, a down product
// reading its output agrees with one reading the separate path's to 2e-3 of its largest output (the choice
// may sum a row in another order than matmul(), which can move a code by one), wherever the random weights
// keep the outputs finite (MXFP4's random e8m0 block scales never do: its down check is left out; the
// planes still match).
TEST(CudaMatmulSwiGlu, EpilogueMatchesSeparateKernel) {
  REQUIRE_GPU();
  cu::set_matvec_few(0);  // the batched kernels at 2 tokens too (matmul() may take matvec_few)
  struct Shape { int64_t ffn, k; };
  struct Run { cu::ActKind kind; int split, nt; };
  std::vector<Run> runs;
  for (int split : {1, 2})
    for (int nt : {1, 2, 4}) runs.push_back({cu::ActKind::Q8_0, split, nt});
  for (cu::ActKind kind : {cu::ActKind::F16, cu::ActKind::BF16, cu::ActKind::F32}) runs.push_back({kind, 2, 1});
  runs.push_back({cu::ActKind::F16, 1, 4});
  int readers_checked[64] = {};  // per DType: down checks whose outputs were finite (random Q4_K scales over
                                 // k = 4096 overflow float)
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0, DType::F16, DType::BF16})
  for (const Shape s : {Shape{2048, 768}, Shape{1056, 4096}, Shape{96, 768}, Shape{64, 256}})
  for (int n : {2, 13, 32}) {
    const int64_t up = cu::padded_rows(s.ffn);
    const std::vector<uint8_t> g = random_matrix(t, s.ffn, s.k, 61), u = random_matrix(t, s.ffn, s.k, 62);
    const size_t rb = dtype_row_bytes(t, (uint64_t)s.k);
    const cu::MatrixPart parts[2] = {{t, g.data(), s.ffn, s.k, rb}, {t, u.data(), s.ffn, s.k, rb}};
    cu::Matrix m = cu::upload_matrix(parts, 2, nullptr);
    cu::ActBuf a = plain_rows(m, s.k, n, 63);
    DevFloats dy(std::vector<float>((size_t)n * m.rows, 0.0f));
    const cu::PrepArgs glu{cu::Prep::SwiGlu, dy.p, m.rows, nullptr, 0, up, nullptr};
    const std::string where = std::string(dtype_name(t)) + " ffn " + std::to_string(s.ffn) + " k " +
                              std::to_string(s.k) + " tokens " + std::to_string(n);
    for (const Run r : runs) {
      SCOPED_TRACE(where + " kind " + std::to_string((int)r.kind) + " split " + std::to_string(r.split) + " nt " +
                   std::to_string(r.nt));
      ASSERT_TRUE(cu::matmul_swiglu_fits(m, n, s.ffn, up, r.kind));
      cu::ActBuf want = cu::act_alloc(r.kind, s.ffn, n), got = cu::act_alloc(r.kind, s.ffn, n);
      cu::set_matmul_shape(r.split, r.nt);
      cu::matmul(m, a, n, dy.p, m.rows, m.rows, false, nullptr);
      cu::prep_act(glu, n, want, nullptr);
      ASSERT_TRUE(cu::matmul_swiglu(m, a, n, s.ffn, up, got, nullptr));
      cu::sync_device();
      cu::set_matmul_shape(0, 0);
      expect_same_planes(want, got, n, s.ffn);
      const size_t ne = (size_t)n * s.ffn;
      if (r.kind == cu::ActKind::F32) {
        EXPECT_GT(max_abs(test::download(got.f, ne)), 0.0f);
      }
      cu::act_free(want);
      cu::act_free(got);
    }
    const bool half = t == DType::F16 || t == DType::BF16;
    if (!half && t != DType::MXFP4) {  // the default shape, read by a down product of a Q8_0-input format
      SCOPED_TRACE(where + " down reader");
      cu::ActBuf want = cu::act_alloc(cu::ActKind::Q8_0, s.ffn, n), got = cu::act_alloc(cu::ActKind::Q8_0, s.ffn, n);
      // The int8 kernels on both paths: at 32 tokens matmul() of a Q8_0 / Q4_0 matrix this size would take an
      // H kernel (half activations: another rounding of x than the epilogue's int8 codes).
      cu::set_matmul_half(false);
      cu::matmul(m, a, n, dy.p, m.rows, m.rows, false, nullptr);
      cu::prep_act(glu, n, want, nullptr);
      ASSERT_TRUE(cu::matmul_swiglu(m, a, n, s.ffn, up, got, nullptr));
      cu::sync_device();
      cu::set_matmul_half(true);
      const DType dt = t == DType::Q4_K || t == DType::TQ2_0 ? DType::Q4_0 : t;
      const std::vector<uint8_t> dw = random_matrix(dt, 272, s.ffn, 64);
      cu::Matrix d = upload_one(dt, dw, 272, s.ffn);
      const std::vector<float> hw = reader_out(d, want, n), hg = reader_out(d, got, n);
      if (std::all_of(hw.begin(), hw.end(), [](float v) { return std::isfinite(v); })) {
        EXPECT_GT(max_abs(hw), 0.0f);
        EXPECT_LE(max_diff(hw, hg), 2e-3f * max_abs(hw)) << "down reader " << dtype_name(dt);
        ++readers_checked[(int)t];
      }
      cu::free_matrix(d);
      cu::act_free(want);
      cu::act_free(got);
    }
    EXPECT_FALSE(cu::matmul_swiglu_fits(m, 1, s.ffn, up, cu::ActKind::Q8_0));  // one token: matvec1_swiglu
    EXPECT_FALSE(cu::matmul_swiglu_fits(m, n, s.ffn, up, cu::ActKind::Q8_K));
    cu::act_free(a);
    cu::free_matrix(m);
  }
  cu::set_matvec_few(-1);
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::TQ2_0})
    EXPECT_GT(readers_checked[(int)t], 0) << dtype_name(t) << ": no down check had finite outputs";
}

// Where the batched epilogue or its readers cannot apply they say so: F32 rows, one token, outputs not in
// whole blocks; readers of Q8_K rows or of rows too long to stage.
TEST(CudaMatmulNorm, RefusesWhatItCannotDo) {
  REQUIRE_GPU();
  const std::vector<uint8_t> f = random_matrix(DType::F32, 64, 64, 1), q = random_matrix(DType::Q4_0, 80, 64, 2),
                             qk = random_matrix(DType::Q4_K, 64, 256, 3), big = random_matrix(DType::Q4_0, 2304, 4096, 4);
  cu::Matrix mf = upload_one(DType::F32, f, 64, 64), mq = upload_one(DType::Q4_0, q, 80, 64),
             mk = upload_one(DType::Q4_K, qk, 64, 256), mb = upload_one(DType::Q4_0, big, 2304, 4096);
  EXPECT_FALSE(cu::matmul_norm_fits(mf, 64, 8));
  EXPECT_FALSE(cu::matmul_norm_fits(mq, 80, 8));  // 80 % 32 != 0
  EXPECT_FALSE(cu::matmul_norm_fits(mq, 64, 1));  // one token: matvec1_norm
  EXPECT_TRUE(cu::matmul_norm_fits(mq, 64, 2));
  EXPECT_TRUE(cu::reads_deferred_norm(mq, 32));
  EXPECT_FALSE(cu::reads_deferred_norm(mq, 1));
  EXPECT_FALSE(cu::reads_deferred_norm(mk, 8));   // reads Q8_K rows
  EXPECT_TRUE(cu::reads_deferred_norm(mb, 8));
  EXPECT_FALSE(cu::reads_deferred_norm(mb, 16));  // 16 or 32 rows of 4096 per CTA (144 tiles) do not fit
  EXPECT_FALSE(cu::reads_deferred_norm(mb, 32));
  for (cu::Matrix* m : {&mf, &mq, &mk, &mb}) cu::free_matrix(*m);
}

// The H kernels (matmul_half_pays): 17..32-token products of Q8_0 / Q4_0 rows that dequantize each k-step's
// weights to half (value * scale, rounded once) and multiply them with the activations' half plane
// (ActBuf::fh) in m16n8k16 products with f32 sums. Against a CPU reference of exactly that arithmetic
// (dequantize_row rounded to half, x rounded to half, sums in double), to 1e-5 of each output's sum of
// |terms|, on shapes that take rounds of 2 (exact and checked: an odd number of Q4_0 k-steps), rounds of 4,
// rows too long to stage (k = 4,096: the plane is read from global memory), a partial tile and many tiles,
// and for Q4_0 a long-row matrix of 1,600 tiles (k = 3,072), where long_row_split takes 4 warps per tile on
// the H200 (7 x 2 rounds per CTA at 8 against 4 x 3; iphone's gate/up has 1,536 tiles);
// 32-token CTAs forced where the rule would give a small matrix 8-token ones. Also: 17 tokens bit-identical
// to the same rows of 32, the accumulate epilogue, the fused argmax head against argmax_rows over the same
// products, and a reader of a deferred RMSNorm (matmul_norm's output: the kernel scales its sums by 1 / rms)
// against one reading prep_act's rows, to 2e-3 of its largest output.
TEST(CudaMatmulHalf, ProductsMatchHalfReference) {
  REQUIRE_GPU();
  struct Shape { int64_t rows, k; };
  for (DType t : {DType::Q8_0, DType::Q4_0})
  for (const Shape s : {Shape{130, 800}, Shape{16 * 150 + 5, 768}, Shape{16 * 300 + 5, 512}, Shape{301, 4096},
                        Shape{16 * 40, 2048}, Shape{16 * 1600, 3072}}) {
    if (s.rows == 16 * 1600 && t != DType::Q4_0) continue;  // Q8_0's 96 chunks tie at 8 and 4 warps: as before
    SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(s.rows) + " k " + std::to_string(s.k));
    const std::vector<uint8_t> w = random_matrix(t, s.rows, s.k, 81);
    const size_t rb = dtype_row_bytes(t, (uint64_t)s.k);
    cu::Matrix m = upload_one(t, w, s.rows, s.k);
    ASSERT_TRUE(cu::matmul_half_pays(m, 17));
    ASSERT_FALSE(cu::matmul_half_pays(m, 16));
    std::vector<float> wh((size_t)s.rows * s.k);
    for (int64_t r = 0; r < s.rows; ++r) kernels::dequantize_row(t, &w[r * rb], &wh[r * s.k], s.k);
    for (float& v : wh) v = half_round(v);
    const std::vector<float> x = gaussian((size_t)32 * s.k, 82, 2.0f);
    DevFloats dx(x);
    cu::set_matmul_shape(0, 4);
    std::vector<float> all32;
    for (int n : {32, 17}) {
      cu::ActBuf a = prepared_rows(m, dx.p, n);
      DevFloats dy(std::vector<float>((size_t)n * s.rows, 1.0f));
      cu::matmul(m, a, n, dy.p, s.rows, s.rows, true, nullptr);
      cu::sync_device();
      const std::vector<float> got = test::download(dy.p, (size_t)n * s.rows);
      cu::act_free(a);
      if (n == 17) {
        for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], all32[i]) << "17 tokens against 32, element " << i;
        continue;
      }
      all32 = got;
      float worst = 0;  // in units of each output's bound
      for (int tok = 0; tok < n; ++tok)
        for (int64_t r = 0; r < s.rows; ++r) {
          double sum = 0, mag = 0;
          for (int64_t i = 0; i < s.k; ++i) {
            const double term = (double)wh[r * s.k + i] * half_round(x[(size_t)tok * s.k + i]);
            sum += term;
            mag += std::fabs(term);
          }
          const double err = std::fabs((double)got[(size_t)tok * s.rows + r] - 1.0 - sum);
          worst = std::max(worst, (float)(err / (1e-5 * mag + 1e-6 * (1.0 + std::fabs(sum)))));
        }
      EXPECT_LE(worst, 1.0f) << "against the half reference";
    }
    if (s.rows >= 16 * 150) {  // the fused argmax head over the same products
      const int n = 32;
      cu::ActBuf a = prepared_rows(m, dx.p, n);
      DevFloats dy(std::vector<float>((size_t)n * s.rows, 0.0f));
      auto* keys = static_cast<unsigned long long*>(cu::dev_alloc(n * sizeof(unsigned long long)));
      auto* ids = static_cast<int32_t*>(cu::dev_alloc(2 * n * sizeof(int32_t)));
      cu::matmul(m, a, n, dy.p, s.rows, s.rows, false, nullptr);
      cu::argmax_rows(dy.p, s.rows, n, s.rows, ids, nullptr);
      cu::matmul_argmax(m, a, n, s.rows, keys, nullptr);
      cu::argmax_keys_to_ids(keys, n, ids + n, nullptr);
      cu::sync_device();
      EXPECT_EQ(test::download(ids + n, (size_t)n), test::download(ids, (size_t)n)) << "fused argmax head";
      cu::dev_free(keys);
      cu::dev_free(ids);
      cu::act_free(a);
    }
    if (s.k == 768 || s.k == 2048) {  // a reader of a deferred RMSNorm: m reads what a producer of k rows wrote
      const int n = 32;
      const float eps = 1e-5f;
      const std::vector<uint8_t> pw = random_matrix(DType::Q8_0, s.k, 512, 83);
      cu::Matrix prod = upload_one(DType::Q8_0, pw, s.k, 512);
      cu::ActBuf px = plain_rows(prod, 512, n, 84);
      DevFloats dnw(norm_weights(s.k, 86));
      {
        const FoldedRows fr(prod, px, n, s.k, gaussian((size_t)n * s.k, 85, 3.0f), dnw.p, eps);
        const std::vector<float> hw = reader_out(m, fr.want, n), hg = reader_out(m, fr.folded, n);
        EXPECT_GT(max_abs(hw), 0.0f);
        EXPECT_LE(max_diff(hw, hg), 2e-3f * max_abs(hw)) << "reader of a deferred RMSNorm";
      }
      cu::act_free(px);
      cu::free_matrix(prod);
    }
    cu::set_matmul_shape(0, 0);
    cu::free_matrix(m);
  }
}

// The rule: Q8_0 and Q4_0 rows from 17 tokens on, never other formats; set_matmul_half(false) turns it off.
TEST(CudaMatmulHalf, RuleAndSwitch) {
  REQUIRE_GPU();
  for (DType t : {DType::Q8_0, DType::Q4_0, DType::MXFP4, DType::Q4_K, DType::TQ2_0, DType::F16}) {
    const std::vector<uint8_t> w = random_matrix(t, 64, 256, 87);
    cu::Matrix m = upload_one(t, w, 64, 256);
    const bool half = t == DType::Q8_0 || t == DType::Q4_0;
    EXPECT_EQ(cu::matmul_half_pays(m, 32), half) << dtype_name(t);
    EXPECT_FALSE(cu::matmul_half_pays(m, 8)) << dtype_name(t);
    cu::set_matmul_half(false);
    EXPECT_FALSE(cu::matmul_half_pays(m, 32)) << dtype_name(t);
    cu::set_matmul_half(true);
    cu::free_matrix(m);
  }
}
