// Portable inner loops of training and the run-time choice between them and the AVX2 / AVX-512 ones.
#include <algorithm>
#include <cmath>

#include "core/cpu_features.h"
#include "train/train_kernels.h"

namespace merlin::train::kern {

namespace portable {

void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add) {
  float acc[kMR][kNR] = {};
  for (int64_t k = 0; k < kc; ++k, ap += kMR, bp += kNR)
    for (int i = 0; i < kMR; ++i)
      for (int j = 0; j < kNR; ++j) acc[i][j] += ap[i] * bp[j];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) c[i * ldc + j] = add ? c[i * ldc + j] + acc[i][j] : acc[i][j];
}

namespace {
void pack_t(const float* src, int64_t ld, int lines, int width, int64_t kc, float* dst) {
  for (int i = 0; i < width; ++i) {
    const float* line = src + i * ld;
    for (int64_t k = 0; k < kc; ++k) dst[k * width + i] = i < lines ? line[k] : 0.0f;
  }
}
}  // namespace

void pack_a_t(const float* a, int64_t lda, int rows, int64_t kc, float* dst) { pack_t(a, lda, rows, kMR, kc, dst); }
void pack_b_t(const float* b, int64_t ldb, int cols, int64_t kc, float* dst) { pack_t(b, ldb, cols, kNR, kc, dst); }

float xent_row(float* row, int64_t n, int32_t target, float scale) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, row[i]);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp((double)(row[i] - mx));
  const float lse = mx + (float)std::log(sum);
  const float loss = lse - row[target];
  if (scale == 0.0f) return loss;
  for (int64_t i = 0; i < n; ++i) row[i] = std::exp(row[i] - lse) * scale;
  row[target] -= scale;
  return loss;
}

float softmax_lse(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - mx));
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
  return mx + std::log(sum);
}

void exp_shift(float* x, int64_t n, float shift) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i] - shift);
}

void swiglu(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-g[i]));
    dg[i] = dh[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
    du[i] = dh[i] * (g[i] * s);
  }
}

}  // namespace portable

const Table& table() {
  static const Table portable_table{portable::micro, portable::pack_a_t, portable::pack_b_t, portable::xent_row, portable::softmax_lse,
                                             portable::exp_shift, portable::swiglu, portable::swiglu_backward};
  static const Table avx512_table{avx512::micro, avx512::pack_a_t, avx512::pack_b_t, avx512::xent_row, avx512::softmax_lse, avx512::exp_shift,
                                           avx512::swiglu, avx512::swiglu_backward};
  static const Table avx2_table{avx2::micro,       portable::pack_a_t, portable::pack_b_t, avx2::xent_row,
                                avx2::softmax_lse, avx2::exp_shift,    avx2::swiglu,       avx2::swiglu_backward};
  const KernelLevel level = active_kernel_level();
  return level == KernelLevel::Avx512 ? avx512_table : level == KernelLevel::Avx2 ? avx2_table : portable_table;
}

}  // namespace merlin::train::kern
