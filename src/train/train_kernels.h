// Private to src/train: the inner loops that have an AVX-512 version (train_kernels_avx512.cpp, compiled
// with -mavx512*) and a portable one (train_kernels.cpp). As in src/kernels/cpu, the AVX-512 file keeps its
// helpers in an anonymous namespace and avoids <cmath>/<algorithm>, so no wide instruction leaks into code
// that runs on other CPUs.
#pragma once
#include <cstdint>

namespace merlin::train::kern {

// GEMM register tile: kMR rows of A (broadcast) times kNR columns of B (two 16-float vectors).
inline constexpr int kMR = 12;
inline constexpr int kNR = 32;

struct Table {
  // C[0..mr)[0..nr) (=|+=) Ap·Bp over kc, with Ap k-major panels of kMR and Bp k-major panels of kNR.
  void (*micro)(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add);
  // Transposing packs for operands whose rows run along k: row i of A (i < rows <= kMR) at a + i*lda
  // goes to dst[k*kMR + i]; column j of B (j < cols <= kNR) at b + j*ldb goes to dst[k*kNR + j]. Rows and
  // columns past `rows`/`cols` are zero-filled.
  void (*pack_a_t)(const float* a, int64_t lda, int rows, int64_t kc, float* dst);
  void (*pack_b_t)(const float* b, int64_t ldb, int cols, int64_t kc, float* dst);
  // Softmax cross-entropy of one row of logits: returns log-sum-exp(row) - row[target]; when `scale` is
  // non-zero, row is overwritten with scale * (softmax(row) - onehot(target)).
  float (*xent_row)(float* row, int64_t n, int32_t target, float scale);
  // In-place softmax of x[0..n); returns log(sum(exp(x))) of the input.
  float (*softmax_lse)(float* x, int64_t n);
  // x[i] = exp(x[i] - shift)
  void (*exp_shift)(float* x, int64_t n, float shift);
  // out[i] = silu(g[i]) * u[i]
  void (*swiglu)(const float* g, const float* u, float* out, int64_t n);
  // dg[i], du[i] from dh[i] for h = silu(g) * u
  void (*swiglu_backward)(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n);
};

// AVX-512 when the CPU (and MERLIN_KERNELS) allow, else AVX2 (with the portable packs), else portable.
const Table& table();

namespace portable {
void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add);
void pack_a_t(const float* a, int64_t lda, int rows, int64_t kc, float* dst);
void pack_b_t(const float* b, int64_t ldb, int cols, int64_t kc, float* dst);
float xent_row(float* row, int64_t n, int32_t target, float scale);
float softmax_lse(float* x, int64_t n);
void exp_shift(float* x, int64_t n, float shift);
void swiglu(const float* g, const float* u, float* out, int64_t n);
void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n);
}  // namespace portable

namespace avx2 {  // the packs are the portable ones
void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add);
float xent_row(float* row, int64_t n, int32_t target, float scale);
float softmax_lse(float* x, int64_t n);
void exp_shift(float* x, int64_t n, float shift);
void swiglu(const float* g, const float* u, float* out, int64_t n);
void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n);
}  // namespace avx2

namespace avx512 {
void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add);
void pack_a_t(const float* a, int64_t lda, int rows, int64_t kc, float* dst);
void pack_b_t(const float* b, int64_t ldb, int cols, int64_t kc, float* dst);
float xent_row(float* row, int64_t n, int32_t target, float scale);
float softmax_lse(float* x, int64_t n);
void exp_shift(float* x, int64_t n, float shift);
void swiglu(const float* g, const float* u, float* out, int64_t n);
void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n);
}  // namespace avx512

}  // namespace merlin::train::kern
