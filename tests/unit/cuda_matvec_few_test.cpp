// Steps of 2-4 tokens through the single-token kernels' multi-token instances (matvec_few, matvec1.cu with
// NT = n) against the one-token kernels run on each token alone: at the same split the sums are the same, so
// every output must be the same bits — plain and accumulating products, the QKV product's RoPE and K/V cache
// write, the RMSNorm fold (residual rows, codes, scales and sums of squares of each token), the SwiGLU staging of
// the down product's input, a reader of a folded row, and the fused argmax. At the chosen split (which may
// differ from one token's) the products must match the scalar CPU. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
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
using test::download;
using test::gaussian;
using test::max_abs;
using test::random_matrix;

const DType kFormats[] = {DType::Q8_0, DType::Q4_0, DType::MXFP4};

cu::Matrix upload_one(DType t, const std::vector<uint8_t>& w, int64_t rows, int64_t k) {
  const cu::MatrixPart part{t, w.data(), rows, k, dtype_row_bytes(t, (uint64_t)k)};
  return cu::upload_matrix(&part, 1, nullptr);
}

// n rows of k Gaussian activations in Q8_0 (a Plain preparation: both row and fragment planes).
cu::ActBuf q8_rows(int64_t k, int n, uint32_t seed) {
  DevFloats dx(gaussian((size_t)n * k, seed, 2.0f));
  cu::ActBuf a = cu::act_alloc(cu::ActKind::Q8_0, k, n);
  cu::PrepArgs plain;
  plain.d_x = dx.p;
  plain.ld = k;
  cu::prep_act(plain, n, a, nullptr);
  cu::sync_device();
  return a;
}

// Token t's row of a Q8_0 buffer as a one-token buffer (row planes only: what the single-token kernels read).
cu::ActBuf row_view(const cu::ActBuf& a, int t) {
  cu::ActBuf v{};
  v.kind = a.kind;
  v.k = a.k;
  v.n_cap = 1;
  v.q = a.q + (int64_t)t * a.k;
  v.scale = a.scale + (int64_t)t * (a.k / 32);
  v.sum = a.sum + (int64_t)t * (a.k / 32);
  return v;
}

template <class T>
void expect_same(const std::vector<T>& want, const std::vector<T>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(T)), 0) << what;
}

// Every test below runs the multi-token instances wherever they fit (matmul() takes them by the rule only).
struct ForceFew {
  ForceFew() { cu::set_matvec_few(1); }
  ~ForceFew() { cu::set_matvec_few(-1); }
  ForceFew(const ForceFew&) = delete;
  ForceFew& operator=(const ForceFew&) = delete;
};

struct Shape { int64_t rows, k; };
// Short rows (base: a warp per tile or several per CTA), long ones (k split over 8 warps, several rounds),
// many tiles (several groups per CTA), an odd number of k-steps for the 4-bit formats, a tiny matrix.
const Shape kShapes[] = {{2304, 768}, {5003, 800}, {301, 16384}, {9601, 2080}, {3, 32}};

}  // namespace

// y (+)= W x for 2-4 tokens, token t's row ldy apart, against each token through the one-token kernel at
// every split (bit for bit; rows past n_out untouched), and at the chosen split against the scalar CPU.
TEST(CudaMatvecFew, ProductsMatchOneTokenBits) {
  REQUIRE_GPU();
  const ForceFew force;
  const auto& scalar = kernels::kernels_for(KernelLevel::Scalar);
  for (DType t : kFormats)
    for (const Shape s : kShapes)
      for (int n : {2, 3, 4}) {
        const std::string where = std::string(dtype_name(t)) + " rows " + std::to_string(s.rows) + " k " +
                                  std::to_string(s.k) + " tokens " + std::to_string(n);
        SCOPED_TRACE(where);
        const std::vector<uint8_t> w = random_matrix(t, s.rows, s.k, (uint32_t)(s.rows + s.k + n));
        cu::Matrix m = upload_one(t, w, s.rows, s.k);
        ASSERT_TRUE(cu::matvec_few_fits(m, n));
        const std::vector<float> x = gaussian((size_t)n * s.k, (uint32_t)(n + 5), 2.0f);
        DevFloats dx(x);
        cu::ActBuf a = cu::act_alloc(m.act(), s.k, n);
        cu::PrepArgs plain;
        plain.d_x = dx.p;
        plain.ld = s.k;
        cu::prep_act(plain, n, a, nullptr);
        const int64_t ldy = s.rows + 7, n_out = std::max<int64_t>(1, s.rows - 5);
        const std::vector<float> ones((size_t)n * ldy, 1.0f);
        for (int ls : {0, 1, 2, 3}) {
          SCOPED_TRACE("lsplit " + std::to_string(ls));
          cu::set_matvec1_split(ls);
          DevFloats few_y(ones), one_y(ones);
          cu::matmul(m, a, n, few_y.p, ldy, n_out, true, nullptr);
          for (int tok = 0; tok < n; ++tok)
            cu::matmul(m, row_view(a, tok), 1, one_y.p + tok * ldy, ldy, n_out, true, nullptr);
          cu::sync_device();
          cu::set_matvec1_split(-1);
          const std::vector<float> fy = download(few_y.p, ones.size()), oy = download(one_y.p, ones.size());
          expect_same(oy, fy, "accumulated rows");
          for (int tok = 0; tok < n; ++tok)
            for (int64_t r = n_out; r < ldy; ++r) EXPECT_EQ(fy[tok * ldy + r], 1.0f) << "token " << tok << " row " << r;
        }
        // The chosen split against the CPU (which quantizes x the same way).
        const kernels::MatmulKernel* mk = scalar.matmul(t);
        const size_t rb = dtype_row_bytes(t, (uint64_t)s.k), xb = dtype_row_bytes(mk->act_type, (uint64_t)s.k);
        std::vector<uint8_t> xq(xb * n);
        mk->quantize_act(x.data(), n, s.k, xq.data());
        std::vector<float> want((size_t)n * s.rows);
        mk->rows(w.data(), rb, 0, s.rows, xq.data(), xb, n, s.k, want.data(), s.rows);
        DevFloats y(std::vector<float>((size_t)n * ldy, 0.0f));
        cu::matmul(m, a, n, y.p, ldy, s.rows, false, nullptr);
        cu::sync_device();
        const std::vector<float> got = download(y.p, (size_t)n * ldy);
        const float tol = 2e-5f * max_abs(want) + 1e-6f;
        float worst = 0;
        for (int tok = 0; tok < n; ++tok)
          for (int64_t r = 0; r < s.rows; ++r)
            worst = std::max(worst, std::fabs(got[tok * ldy + r] - want[tok * s.rows + r]));
        EXPECT_LE(worst, tol);
        cu::act_free(a);
        cu::free_matrix(m);
      }
}

// The stacked QKV product with RoPE and the K/V write in its epilogue for 2-4 tokens of three sequences in a
// paged cache (f16 and f32), against each token through the one-token kernel: Q rows and both caches bit
// for bit, with GQA and a partial rotary dimension, for a warp per tile (k = 256) and shared tiles (k = 4096).
TEST(CudaMatvecFew, RopeKvMatchesOneTokenBits) {
  REQUIRE_GPU();
  const ForceFew force;
  const int n_ctx = 64, block = 16, max_blocks = n_ctx / block, n_seq = 3, hd = 64, n_heads = 4, n_kv = 2;
  std::vector<int32_t> table(n_seq * max_blocks), pos(4), seq(4);
  for (int i = 0; i < n_seq * max_blocks; ++i) table[i] = (i * 5) % (n_seq * max_blocks);
  for (int t = 0; t < 4; ++t) seq[t] = t % n_seq, pos[t] = 9 + 7 * t;  // distinct slots, contexts to prefetch
  int32_t *d_table = test::upload(table), *d_pos = test::upload(pos), *d_seq = test::upload(seq);
  const int64_t q_dim = n_heads * hd, kv_dim = n_kv * hd;
  const int64_t k_off = cu::padded_rows(q_dim), v_off = k_off + cu::padded_rows(kv_dim);
  for (int n_rot : {hd, 32}) {
    DevFloats d_cs(gaussian((size_t)n_ctx * n_rot, 11));
    for (bool f16 : {true, false})
      for (int64_t k : {256, 4096})
        for (DType t : kFormats)
          for (int n : {2, 3, 4}) {
            SCOPED_TRACE(std::string(dtype_name(t)) + " k " + std::to_string(k) + " tokens " + std::to_string(n) +
                         " n_rot " + std::to_string(n_rot) + (f16 ? " f16" : " f32"));
            const size_t rb = dtype_row_bytes(t, (uint64_t)k);
            const auto wq = random_matrix(t, q_dim, k, 1), wk = random_matrix(t, kv_dim, k, 2),
                       wv = random_matrix(t, kv_dim, k, 3);
            const cu::MatrixPart parts[3] = {{t, wq.data(), q_dim, k, rb}, {t, wk.data(), kv_dim, k, rb},
                                             {t, wv.data(), kv_dim, k, rb}};
            cu::Matrix m = cu::upload_matrix(parts, 3, nullptr);
            cu::ActBuf a = q8_rows(k, n, 5);
            const size_t cache = (size_t)n_seq * max_blocks * block * kv_dim * (f16 ? 2 : 4);
            auto zeros = [&] { return test::upload(std::vector<uint8_t>(cache, 0)); };
            cu::KvArgs kv_one{zeros(), zeros(), f16, block, max_blocks, d_table};
            cu::KvArgs kv_few{zeros(), zeros(), f16, block, max_blocks, d_table};
            const std::vector<float> zero_y((size_t)n * m.rows, 0.f);
            DevFloats y_one(zero_y), y_few(zero_y);
            auto args = [&](const cu::KvArgs& kv, int tok) {
              cu::RopeKvArgs r;
              r.d_pos = d_pos + tok;
              r.d_seq = d_seq + tok;
              r.d_cos_sin = d_cs.p;
              r.q_dim = q_dim, r.kv_dim = kv_dim, r.k_off = k_off, r.v_off = v_off;
              r.hd = hd, r.n_rot = n_rot;
              r.kv = kv;
              r.l2_positions = 8;
              return r;
            };
            cu::set_matvec1_split(k == 256 ? 0 : 2);
            for (int tok = 0; tok < n; ++tok)
              ASSERT_TRUE(cu::matmul_rope_kv(m, row_view(a, tok), 1, y_one.p + tok * m.rows, m.rows,
                                             args(kv_one, tok), nullptr));
            ASSERT_TRUE(cu::matmul_rope_kv(m, a, n, y_few.p, m.rows, args(kv_few, 0), nullptr));
            cu::sync_device();
            cu::set_matvec1_split(-1);
            const auto yo = download(y_one.p, zero_y.size()), yf = download(y_few.p, zero_y.size());
            for (int tok = 0; tok < n; ++tok)
              expect_same(std::vector<float>(yo.begin() + tok * m.rows, yo.begin() + tok * m.rows + q_dim),
                          std::vector<float>(yf.begin() + tok * m.rows, yf.begin() + tok * m.rows + q_dim),
                          "Q rows of token " + std::to_string(tok));
            expect_same(download(static_cast<const uint8_t*>(kv_one.d_k), cache),
                        download(static_cast<const uint8_t*>(kv_few.d_k), cache), "K cache");
            expect_same(download(static_cast<const uint8_t*>(kv_one.d_v), cache),
                        download(static_cast<const uint8_t*>(kv_few.d_v), cache), "V cache");
            for (void* b : {kv_one.d_k, kv_one.d_v, kv_few.d_k, kv_few.d_v}) cu::dev_free(b);
            cu::act_free(a);
            cu::free_matrix(m);
          }
  }
  for (void* b : {static_cast<void*>(d_table), static_cast<void*>(d_pos), static_cast<void*>(d_seq)}) cu::dev_free(b);
}

// The producer that adds to the residual rows and writes the next RMSNorm's input (matvec_few_norm) for 2-4
// tokens against matvec1_norm on each token: residual rows, codes, block scales, code sums and sums of squares
// bit for bit at every split the epilogue allows; then a reader of the folded rows (2-4 tokens, rms_in_rows)
// against the same reader of each token's folded row; the batched kernels refuse the folded rows.
TEST(CudaMatvecFew, NormFoldMatchesOneTokenBits) {
  REQUIRE_GPU();
  const ForceFew force;
  const float eps = 1e-5f;
  for (DType t : kFormats)
    for (const Shape s : {Shape{768, 768}, Shape{768, 2048}, Shape{4096, 4096}, Shape{96, 256}})
      for (int n : {2, 3, 4}) {
        const int64_t o = s.rows, kb = o / 32;
        const std::vector<uint8_t> w = random_matrix(t, o, s.k, 41);
        cu::Matrix m = upload_one(t, w, o, s.k);
        cu::ActBuf a = q8_rows(s.k, n, 42);
        const std::vector<float> y0 = gaussian((size_t)n * o, 43, 3.0f);
        std::vector<float> nw = gaussian((size_t)o, 44, 0.3f);
        for (float& v : nw) v += 1.0f;
        DevFloats dnw(nw);
        double* part_one = static_cast<double*>(cu::dev_alloc((size_t)n * kb * sizeof(double)));
        double* part_few = static_cast<double*>(cu::dev_alloc((size_t)n * kb * sizeof(double)));
        cu::ActBuf one = cu::act_alloc(cu::ActKind::Q8_0, o, n), few = cu::act_alloc(cu::ActKind::Q8_0, o, n);
        for (int ls : {1, 2, 3}) {
          SCOPED_TRACE(std::string(dtype_name(t)) + " rows " + std::to_string(o) + " k " + std::to_string(s.k) +
                       " tokens " + std::to_string(n) + " lsplit " + std::to_string(ls));
          cu::set_matvec1_split(ls);
          DevFloats y_one(y0), y_few(y0);
          for (int tok = 0; tok < n; ++tok) {
            cu::ActBuf out = row_view(one, tok);
            out.k = o;
            ASSERT_TRUE(cu::matvec1_norm(m, row_view(a, tok), y_one.p + tok * o, o, true, dnw.p, out,
                                         part_one + tok * kb, nullptr));
          }
          ASSERT_TRUE(cu::matvec_few_norm(m, a, n, y_few.p, o, o, true, dnw.p, few, part_few, nullptr));
          cu::sync_device();
          cu::set_matvec1_split(-1);
          const size_t ne = (size_t)n * o;
          expect_same(download(y_one.p, ne), download(y_few.p, ne), "residual rows");
          expect_same(download(one.q, ne), download(few.q, ne), "codes");
          expect_same(download(one.scale, ne / 32), download(few.scale, ne / 32), "scales");
          expect_same(download(one.sum, ne / 32), download(few.sum, ne / 32), "code sums");
          expect_same(download(part_one, (size_t)n * kb), download(part_few, (size_t)n * kb), "sums of squares");
        }
        // Readers of the folded rows: n tokens at once against each token's row with its own sums.
        cu::ActBuf folded = few;
        folded.rms_part = part_few;
        folded.rms_eps = eps;
        folded.rms_rows = n;
        folded.rms_in_rows = true;
        for (DType rt : kFormats) {
          SCOPED_TRACE(std::string("reader ") + dtype_name(rt));
          const int64_t rows = 272;
          const std::vector<uint8_t> rw = random_matrix(rt, rows, o, 45);
          cu::Matrix r = upload_one(rt, rw, rows, o);
          DevFloats z_few(std::vector<float>((size_t)n * rows, 0.f)), z_one(std::vector<float>((size_t)n * rows, 0.f));
          cu::set_matvec1_split(1);
          cu::matmul(r, folded, n, z_few.p, rows, rows, false, nullptr);
          for (int tok = 0; tok < n; ++tok) {
            cu::ActBuf v = row_view(few, tok);
            v.rms_part = part_few + tok * kb;
            v.rms_eps = eps;
            v.rms_rows = 1;
            v.rms_in_rows = true;
            cu::matmul(r, v, 1, z_one.p + tok * rows, rows, rows, false, nullptr);
          }
          cu::sync_device();
          cu::set_matvec1_split(-1);
          const auto zf = download(z_few.p, (size_t)n * rows);
          expect_same(download(z_one.p, (size_t)n * rows), zf, "reader outputs");
          EXPECT_GT(max_abs(zf), 0.0f);
          // Only the few-token kernels read such rows: off by the rule, they still take them.
          cu::set_matvec_few(0);
          DevFloats z_off(std::vector<float>((size_t)n * rows, 0.f));
          cu::set_matvec1_split(1);
          cu::matmul(r, folded, n, z_off.p, rows, rows, false, nullptr);
          cu::sync_device();
          cu::set_matvec1_split(-1);
          cu::set_matvec_few(1);
          expect_same(zf, download(z_off.p, (size_t)n * rows), "reader outputs, path off");
          cu::free_matrix(r);
        }
        cu::act_free(one);
        cu::act_free(few);
        cu::dev_free(part_one);
        cu::dev_free(part_few);
        cu::act_free(a);
        cu::free_matrix(m);
      }
}

// The down product staging each token's SwiGLU row (ActBuf::glu_src, glu_ld apart) for 2-4 tokens against
// the one-token kernel on each token's row: plain and RMSNorm-folded outputs, bit for bit.
TEST(CudaMatvecFew, SwiGluStagingMatchesOneTokenBits) {
  REQUIRE_GPU();
  const ForceFew force;
  for (DType t : kFormats)
    for (int64_t k : {256, 2048, 5632})
      for (int n : {2, 3, 4}) {
        SCOPED_TRACE(std::string(dtype_name(t)) + " k " + std::to_string(k) + " tokens " + std::to_string(n));
        const int64_t rows = 768, off = k + 64, ld = off + k + 32;  // up rows past padding; rows ld apart
        const std::vector<uint8_t> w = random_matrix(t, rows, k, 51);
        cu::Matrix m = upload_one(t, w, rows, k);
        DevFloats gu(gaussian((size_t)n * ld, 52, 2.0f));
        cu::ActBuf x = cu::act_alloc(cu::ActKind::Q8_0, k, n);  // its planes are never written
        x.glu_src = gu.p;
        x.glu_offset = off;
        x.glu_ld = ld;
        auto one_view = [&](int tok) {
          cu::ActBuf v = row_view(x, tok);
          v.glu_src = gu.p + tok * ld;
          v.glu_offset = off;
          return v;
        };
        const std::vector<float> y0 = gaussian((size_t)n * rows, 53, 3.0f);
        cu::set_matvec1_split(1);
        DevFloats y_one(y0), y_few(y0);
        for (int tok = 0; tok < n; ++tok) cu::matmul(m, one_view(tok), 1, y_one.p + tok * rows, rows, rows, true, nullptr);
        cu::matmul(m, x, n, y_few.p, rows, rows, true, nullptr);
        cu::sync_device();
        expect_same(download(y_one.p, y0.size()), download(y_few.p, y0.size()), "plain");
        // The RMSNorm fold (the down product's usual launch).
        std::vector<float> nw = gaussian((size_t)rows, 54, 0.3f);
        for (float& v : nw) v += 1.0f;
        DevFloats dnw(nw), z_one(y0), z_few(y0);
        const int64_t kb = rows / 32;
        double* part_one = static_cast<double*>(cu::dev_alloc((size_t)n * kb * sizeof(double)));
        double* part_few = static_cast<double*>(cu::dev_alloc((size_t)n * kb * sizeof(double)));
        cu::ActBuf one = cu::act_alloc(cu::ActKind::Q8_0, rows, n), few = cu::act_alloc(cu::ActKind::Q8_0, rows, n);
        for (int tok = 0; tok < n; ++tok) {
          cu::ActBuf out = row_view(one, tok);
          ASSERT_TRUE(cu::matvec1_norm(m, one_view(tok), z_one.p + tok * rows, rows, true, dnw.p, out,
                                       part_one + tok * kb, nullptr));
        }
        ASSERT_TRUE(cu::matvec_few_norm(m, x, n, z_few.p, rows, rows, true, dnw.p, few, part_few, nullptr));
        cu::sync_device();
        cu::set_matvec1_split(-1);
        const size_t ne = (size_t)n * rows;
        expect_same(download(z_one.p, ne), download(z_few.p, ne), "norm: rows");
        expect_same(download(one.q, ne), download(few.q, ne), "norm: codes");
        expect_same(download(one.scale, ne / 32), download(few.scale, ne / 32), "norm: scales");
        expect_same(download(part_one, (size_t)n * kb), download(part_few, (size_t)n * kb), "norm: sums");
        EXPECT_GT(max_abs(download(z_few.p, ne)), 0.0f);
        cu::dev_free(part_one);
        cu::dev_free(part_few);
        cu::act_free(one);
        cu::act_free(few);
        x.glu_src = nullptr;
        cu::act_free(x);
        cu::free_matrix(m);
      }
}

// The batched greedy head for 2-4 tokens (matmul_argmax takes matvec_few_argmax) picks each token's
// argmax_rows index of the one-token product's logits, also after the largest row is copied to an earlier
// row (the first one wins); the keys are zero again after argmax_keys_to_ids.
TEST(CudaMatvecFew, ArgmaxMatchesOneToken) {
  REQUIRE_GPU();
  const ForceFew force;
  const int64_t rows = 16 * 300 + 5, k = 768;
  for (DType t : kFormats)
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " tokens " + std::to_string(n));
      std::vector<uint8_t> w = random_matrix(t, rows, k, 71);
      const size_t rb = dtype_row_bytes(t, (uint64_t)k);
      auto* keys = static_cast<unsigned long long*>(cu::dev_alloc((size_t)n * sizeof(unsigned long long)));
      auto* want_ids = static_cast<int32_t*>(cu::dev_alloc((size_t)n * sizeof(int32_t)));
      auto* got_ids = static_cast<int32_t*>(cu::dev_alloc((size_t)n * sizeof(int32_t)));
      for (int round = 0; round < 2; ++round) {
        cu::Matrix m = upload_one(t, w, rows, k);
        cu::ActBuf x = q8_rows(k, n, 72);
        DevFloats y(std::vector<float>((size_t)n * rows, 0.f));
        cu::set_matvec1_split(0);
        for (int tok = 0; tok < n; ++tok) cu::matmul(m, row_view(x, tok), 1, y.p + tok * rows, rows, rows, false, nullptr);
        cu::argmax_rows(y.p, rows, n, rows, want_ids, nullptr);
        cu::matmul_argmax(m, x, n, rows, keys, nullptr);
        cu::argmax_keys_to_ids(keys, n, got_ids, nullptr);
        cu::sync_device();
        cu::set_matvec1_split(-1);
        const std::vector<int32_t> want = download(want_ids, (size_t)n);
        EXPECT_EQ(download(got_ids, (size_t)n), want) << "round " << round;
        for (unsigned long long key : download(keys, (size_t)n)) EXPECT_EQ(key, 0ull);
        if (round == 0) {
          EXPECT_GT(want[n - 1], 3);
          std::memcpy(&w[3 * rb], &w[(size_t)want[n - 1] * rb], rb);  // the last token's largest row to row 3
        } else {
          EXPECT_EQ(want[n - 1], 3);
        }
        cu::act_free(x);
        cu::free_matrix(m);
      }
      cu::dev_free(keys);
      cu::dev_free(want_ids);
      cu::dev_free(got_ids);
    }
}

// What the path does not take: one or more than 4 tokens, other formats, rows longer than 16,384, the switch.
TEST(CudaMatvecFew, FitsOnlyWhatItTakes) {
  REQUIRE_GPU();
  const std::vector<uint8_t> q = random_matrix(DType::Q4_0, 64, 256, 1), qk = random_matrix(DType::Q4_K, 64, 256, 2),
                             h = random_matrix(DType::F16, 64, 256, 3), big = random_matrix(DType::Q8_0, 16, 32768, 4);
  cu::Matrix mq = upload_one(DType::Q4_0, q, 64, 256), mk = upload_one(DType::Q4_K, qk, 64, 256),
             mh = upload_one(DType::F16, h, 64, 256), mb = upload_one(DType::Q8_0, big, 16, 32768);
  EXPECT_FALSE(cu::matvec_few_fits(mq, 1));
  EXPECT_TRUE(cu::matvec_few_fits(mq, 2));
  EXPECT_TRUE(cu::matvec_few_fits(mq, 4));
  EXPECT_FALSE(cu::matvec_few_fits(mq, 5));
  EXPECT_FALSE(cu::matvec_few_fits(mk, 2));
  EXPECT_FALSE(cu::matvec_few_fits(mh, 2));
  EXPECT_FALSE(cu::matvec_few_fits(mb, 2));
  // Where it is taken: never (0), wherever it fits (1), the rule (2: 2 tokens, and 3 but for Q8_0, over rows
  // of 3,072 or more).
  const std::vector<uint8_t> lq = random_matrix(DType::Q4_0, 16, 3072, 5), l8 = random_matrix(DType::Q8_0, 16, 3072, 6);
  cu::Matrix ml = upload_one(DType::Q4_0, lq, 16, 3072), m8 = upload_one(DType::Q8_0, l8, 16, 3072);
  cu::set_matvec_few(0);
  EXPECT_FALSE(cu::matvec_few_pays(mq, 2));
  EXPECT_FALSE(cu::matvec_few_pays(ml, 2));
  EXPECT_TRUE(cu::matvec_few_fits(mq, 2));
  cu::set_matvec_few(1);
  EXPECT_TRUE(cu::matvec_few_pays(mq, 4));
  EXPECT_FALSE(cu::matvec_few_pays(mk, 2));
  cu::set_matvec_few(2);
  EXPECT_FALSE(cu::matvec_few_pays(mq, 2));
  EXPECT_TRUE(cu::matvec_few_pays(ml, 2));
  EXPECT_TRUE(cu::matvec_few_pays(ml, 3));
  EXPECT_FALSE(cu::matvec_few_pays(ml, 4));
  EXPECT_TRUE(cu::matvec_few_pays(m8, 2));
  EXPECT_FALSE(cu::matvec_few_pays(m8, 3));
  cu::set_matvec_few(-1);
  cu::free_matrix(ml);
  cu::free_matrix(m8);
  for (cu::Matrix* m : {&mq, &mk, &mh, &mb}) cu::free_matrix(*m);
}
