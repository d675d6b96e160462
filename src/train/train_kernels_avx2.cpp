// AVX2 + FMA register tile of the training GEMM (see train_kernels.h for the rules this file follows). The
// packed panels are the AVX-512 tile's (kMR = 12 rows of A, kNR = 32 columns of B per k), which needs 48 ymm
// of accumulators; with 16 registers the tile is swept as four 6 x 16 sub-tiles (12 accumulators, two B
// vectors and a broadcast), each over the whole kc, so every k step issues 12 FMAs for 2 loads and 6
// broadcasts. The exponentials (cross-entropy, softmax, SwiGLU) use the inference kernels' exp_ps, as the
// AVX-512 file does with its own; the transposing packs stay portable.
#include "kernels/cpu/simd_avx2.h"

#include "train/train_kernels.h"

namespace merlin::train::kern::avx2 {
namespace {

constexpr int kSubRows = 6, kSubCols = 16;

using simd256::exp_ps;
using simd256::tail_mask;

inline __m256 load(const float* p, __m256i m) { return _mm256_maskload_ps(p, m); }

// Lanes of v outside m replaced by fill.
inline __m256 masked(__m256 v, __m256i m, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(m));
}

inline __m256 sigmoid_ps(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// The largest of x[0, n).
float max_of(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    mx = _mm256_max_ps(mx, masked(load(x + i, m), m, -__builtin_inff()));
  }
  return simd256::hmax(mx);
}

// Rows i0 .. i0 + 5 and columns j0 .. j0 + 15 of the tile; mr, nr: what exists of the whole tile.
void sub_tile(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add, int i0,
              int j0) {
  __m256 acc[kSubRows][2];
#pragma GCC unroll 8
  for (int i = 0; i < kSubRows; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  ap += i0;
  bp += j0;
  for (int64_t k = 0; k < kc; ++k, ap += kMR, bp += kNR) {
    const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
#pragma GCC unroll 8
    for (int i = 0; i < kSubRows; ++i) {
      const __m256 a = _mm256_broadcast_ss(ap + i);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  const __m256i m0 = tail_mask(nr - j0), m1 = tail_mask(nr - j0 - 8);
#pragma GCC unroll 8
  for (int i = 0; i < kSubRows; ++i) {
    if (i0 + i >= mr) break;
    float* ci = c + (i0 + i) * ldc + j0;
    __m256 v0 = acc[i][0], v1 = acc[i][1];
    if (add) {
      v0 = _mm256_add_ps(_mm256_maskload_ps(ci, m0), v0);
      v1 = _mm256_add_ps(_mm256_maskload_ps(ci + 8, m1), v1);
    }
    _mm256_maskstore_ps(ci, m0, v0);
    _mm256_maskstore_ps(ci + 8, m1, v1);
  }
}

}  // namespace

void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add) {
  static_assert(kMR % kSubRows == 0 && kNR % kSubCols == 0);
  for (int i0 = 0; i0 < mr; i0 += kSubRows)
    for (int j0 = 0; j0 < nr; j0 += kSubCols) sub_tile(kc, ap, bp, c, ldc, mr, nr, add, i0, j0);
}

float xent_row(float* row, int64_t n, int32_t target, float scale) {
  const __m256 mv = _mm256_set1_ps(max_of(row, n));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    sum = _mm256_add_ps(sum, masked(exp_ps(_mm256_sub_ps(load(row + i, m), mv)), m, 0.0f));
  }
  const float lse = _mm256_cvtss_f32(mv) + __builtin_logf(simd256::hsum(sum));
  const float loss = lse - row[target];
  if (scale == 0.0f) return loss;
  const __m256 lv = _mm256_set1_ps(lse), sv = _mm256_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(row + i, m, _mm256_mul_ps(exp_ps(_mm256_sub_ps(load(row + i, m), lv)), sv));
  }
  row[target] -= scale;
  return loss;
}

float softmax_lse(float* x, int64_t n) {
  const float maxv = max_of(x, n);
  const __m256 mv = _mm256_set1_ps(maxv);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    const __m256 e = masked(exp_ps(_mm256_sub_ps(load(x + i, m), mv)), m, 0.0f);
    _mm256_maskstore_ps(x + i, m, e);
    sum = _mm256_add_ps(sum, e);
  }
  const float total = simd256::hsum(sum);
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(x + i, m, _mm256_mul_ps(load(x + i, m), inv));
  }
  return maxv + __builtin_logf(total);
}

void exp_shift(float* x, int64_t n, float shift) {
  const __m256 sv = _mm256_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    _mm256_maskstore_ps(x + i, m, exp_ps(_mm256_sub_ps(load(x + i, m), sv)));
  }
}

void swiglu(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    const __m256 gv = load(g + i, m);
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid_ps(gv)), load(u + i, m)));
  }
}

void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i m = tail_mask(n - i);
    const __m256 gv = load(g + i, m), uv = load(u + i, m), dv = load(dh + i, m);
    const __m256 s = sigmoid_ps(gv);
    // d silu / dg = s * (1 + g * (1 - s))
    const __m256 dsilu = _mm256_mul_ps(s, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, s), one));
    _mm256_maskstore_ps(dg + i, m, _mm256_mul_ps(_mm256_mul_ps(dv, uv), dsilu));
    _mm256_maskstore_ps(du + i, m, _mm256_mul_ps(dv, _mm256_mul_ps(gv, s)));
  }
}

}  // namespace merlin::train::kern::avx2
