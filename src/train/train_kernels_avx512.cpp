// AVX-512 inner loops of training (see train_kernels.h for the rules this file follows).
#include "kernels/cpu/simd_avx512.h"

#include "train/train_kernels.h"

#define MERLIN_TRAIN_UNROLL _Pragma("GCC unroll 32")

namespace merlin::train::kern::avx512 {
namespace {

using simd512::tail_mask;
using simd512::exp_ps;

inline __m512 sigmoid_ps(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

// In-register transpose of 16 vectors: afterwards r[j] holds element j of every input, in input order.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  // Now lane L of r[4q + s] holds element 4L + s of rows 4q..4q+3: transpose the 4x4 grid of lanes.
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// Lines [0, lines) of 16 floats starting at k (masked to `kn` values) into r; missing lines are zero.
inline void load_lines(const float* src, int64_t ld, int lines, int64_t k, __mmask16 km, __m512 r[16]) {
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = i < lines ? _mm512_maskz_loadu_ps(km, src + i * ld + k) : _mm512_setzero_ps();
}

}  // namespace

void pack_a_t(const float* a, int64_t lda, int rows, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; k += 16) {
    const int64_t kn = kc - k < 16 ? kc - k : 16;
    __m512 r[16];
    load_lines(a, lda, rows, k, tail_mask(kn), r);
    transpose16(r);
    for (int64_t j = 0; j < kn; ++j) _mm512_mask_storeu_ps(dst + (k + j) * kMR, (__mmask16)0x0fff, r[j]);
  }
}

void pack_b_t(const float* b, int64_t ldb, int cols, int64_t kc, float* dst) {
  for (int64_t k = 0; k < kc; k += 16) {
    const int64_t kn = kc - k < 16 ? kc - k : 16;
    for (int half = 0; half < 2; ++half) {
      __m512 r[16];
      load_lines(b + half * 16 * ldb, ldb, cols - half * 16, k, tail_mask(kn), r);
      transpose16(r);
      for (int64_t j = 0; j < kn; ++j) _mm512_storeu_ps(dst + (k + j) * kNR + half * 16, r[j]);
    }
  }
}

// The accumulators stay in 24 registers for the whole k loop; C is touched once per call.
void micro(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc, int mr, int nr, bool add) {
  __m512 c0[kMR], c1[kMR];
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < kMR; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);
    MERLIN_TRAIN_UNROLL
    for (int i = 0; i < kMR; ++i) {
      const __m512 a = _mm512_set1_ps(ap[i]);
      c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
    }
    ap += kMR;
    bp += kNR;
  }
  const __mmask16 m0 = tail_mask(nr), m1 = tail_mask(nr - 16);
  MERLIN_TRAIN_UNROLL
  for (int i = 0; i < kMR; ++i) {
    if (i >= mr) break;
    float* ci = c + i * ldc;
    __m512 v0 = c0[i], v1 = c1[i];
    if (add) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, ci), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, ci + 16), v1);
    }
    _mm512_mask_storeu_ps(ci, m0, v0);
    _mm512_mask_storeu_ps(ci + 16, m1, v1);
  }
}

float xent_row(float* row, int64_t n, int32_t target, float scale) {
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, row + i));
  }
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), mv))));
  }
  const float lse = _mm512_cvtss_f32(mv) + __builtin_logf(_mm512_reduce_add_ps(sum));
  const float loss = lse - row[target];
  if (scale == 0.0f) return loss;
  const __m512 lv = _mm512_set1_ps(lse), sv = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), lv));
    _mm512_mask_storeu_ps(row + i, m, _mm512_mul_ps(p, sv));
  }
  row[target] -= scale;
  return loss;
}

float softmax_lse(float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, x + i));
  }
  const float maxv = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(maxv);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mv)));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
  const __m512 inv = _mm512_set1_ps(1.0f / total);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
  return maxv + __builtin_logf(total);
}

void exp_shift(float* x, int64_t n, float shift) {
  const __m512 sv = _mm512_set1_ps(shift);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), sv)));
  }
}

void swiglu(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
    const __m512 silu = _mm512_mul_ps(gv, sigmoid_ps(gv));
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

void swiglu_backward(const float* dh, const float* g, const float* u, float* dg, float* du, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
    const __m512 dv = _mm512_maskz_loadu_ps(m, dh + i);
    const __m512 s = sigmoid_ps(gv);
    const __m512 silu = _mm512_mul_ps(gv, s);
    // d silu / dg = s * (1 + g * (1 - s))
    const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(gv, _mm512_sub_ps(one, s), one));
    _mm512_mask_storeu_ps(dg + i, m, _mm512_mul_ps(_mm512_mul_ps(dv, uv), dsilu));
    _mm512_mask_storeu_ps(du + i, m, _mm512_mul_ps(dv, silu));
  }
}

}  // namespace merlin::train::kern::avx512
