// AVX2+FMA element-wise kernels. Tails use maskload/maskstore, so short vectors take the vector path and
// give the same numbers as long ones.
#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/kernels_impl.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/simd_avx2.h"

namespace merlin::kernels::avx2 {
namespace {

inline __m256i tail_mask(int64_t n) {
  const int c = n < 0 ? 0 : n > 8 ? 8 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 load(const float* p, int64_t n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n)); }

inline void store(float* p, int64_t n, __m256 v) {
  if (n >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, tail_mask(n), v);
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

using simd256::exp_ps;

}  // namespace

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    MERLIN_UNROLL
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      s[u] = _mm256_fmadd_ps(v, v, s[u]);
    }
  for (; i < n; i += 8) {
    const __m256 v = load(x + i, n - i);
    s[0] = _mm256_fmadd_ps(v, v, s[0]);
  }
  const float mean = hsum(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3]))) / (float)n;
  const __m256 scale = _mm256_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps))));
  for (i = 0; i < n; i += 8) {
    const __m256 v = _mm256_mul_ps(load(x + i, n - i), scale);
    store(y + i, n - i, _mm256_mul_ps(v, load(w + i, n - i)));
  }
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 g = load(gate + i, n - i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    store(out + i, n - i, _mm256_mul_ps(silu, load(up + i, n - i)));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    MERLIN_UNROLL
    for (int u = 0; u < 4; ++u)
      s[u] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * u), _mm256_loadu_ps(b + i + 8 * u), s[u]);
  for (; i < n; i += 8) s[0] = _mm256_fmadd_ps(load(a + i, n - i), load(b + i, n - i), s[0]);
  return hsum(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
}

void axpy(float a, const float* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t i = 0; i < n; i += 8) store(y + i, n - i, _mm256_fmadd_ps(av, load(x + i, n - i), load(y + i, n - i)));
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, xv, _mm256_loadu_ps(y + i)));
  }
  if (i < n) {
    alignas(16) uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t j = i; j < n; ++j) tail[j - i] = x[j];
    const __m256 xv = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
    store(y + i, n - i, _mm256_fmadd_ps(av, xv, load(y + i, n - i)));
  }
}

void axpy_f16_rows(const float* a, size_t lda, int64_t n_vec, const uint16_t* x, size_t ldx, int64_t n_rows, float* y,
                   size_t ldy, int64_t n) {
  for (int64_t v = 0; v < n_vec; ++v)
    for (int64_t p = 0; p < n_rows; ++p) axpy_f16(a[v * lda + p], x + (size_t)p * ldx, y + v * ldy, n);
}

// One axpy_f16_rows call per head.
void axpy_f16_heads(const float* a, size_t lda, int64_t n_heads, const uint16_t* x, size_t ldx, int64_t n_rows,
                    float* y, int64_t hd) {
  for (int64_t j = 0; j < n_heads; ++j) axpy_f16_rows(a + j * lda, 0, 1, x + j * hd, ldx, n_rows, y + j * hd, 0, hd);
}

void quantize_q8_0(const float* x, uint8_t* y, int64_t n) { quant_quantize_row(DType::Q8_0, x, y, n); }

// Each row dequantized once (the reference dequantize_row), then axpy into every output.
void axpy_q8_0_rows(const float* a, size_t lda, int64_t n_vec, const uint8_t* x, size_t ldx, int64_t n_rows, float* y,
                    size_t ldy, int64_t n) {
  float* row = detail::scratch_floats(detail::kScratchWeightRow, (size_t)n);
  for (int64_t p = 0; p < n_rows; ++p) {
    dequantize_row(DType::Q8_0, x + (size_t)p * ldx, row, n);
    for (int64_t v = 0; v < n_vec; ++v) axpy(a[v * lda + p], row, y + v * ldy, n);
  }
}

// F16C conversions; the tail goes through a zero-padded 8-element buffer.
void to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  if (i < n) {
    alignas(16) uint16_t tail[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tail), _mm256_cvtps_ph(load(x + i, n - i), _MM_FROUND_TO_NEAREST_INT));
    for (int64_t j = i; j < n; ++j) y[j] = tail[j - i];
  }
}

// As the AVX-512 version: a = x * (c, c), b = swap(x) * (s, s); a - b in even lanes, a + b in odd ones. The
// empty asm keeps GCC from contracting the products into FMAs (-ffp-contract=fast), which the scalar code has not.
void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs, uint16_t* f16) {
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < n_rot; i += 8) {
      const __m256 xv = load(v + i, n_rot - i), t = load(cs + i, n_rot - i);
      __m256 a = _mm256_mul_ps(xv, _mm256_moveldup_ps(t));
      __m256 b = _mm256_mul_ps(_mm256_permute_ps(xv, 0xB1), _mm256_movehdup_ps(t));
      asm("" : "+x"(a), "+x"(b));
      store(v + i, n_rot - i, _mm256_blend_ps(_mm256_sub_ps(a, b), _mm256_add_ps(a, b), 0xAA));
    }
    if (f16 != nullptr) to_f16(v, f16 + h * head_dim, head_dim);
  }
}

void round_f16(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    store(y + i, n - i, _mm256_cvtph_ps(_mm256_cvtps_ph(load(x + i, n - i), _MM_FROUND_TO_NEAREST_INT)));
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) store(out + i, n - i, _mm256_add_ps(load(a + i, n - i), load(b + i, n - i)));
}

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
  const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
  __m256 mx = neg_inf;
  for (int64_t i = 0; i < n; i += 8) {  // masked-off lanes contribute -inf, not 0
    const __m256 v = _mm256_blendv_ps(neg_inf, load(x + i, n - i), _mm256_castsi256_ps(tail_mask(n - i)));
    mx = _mm256_max_ps(mx, v);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float maxv = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
  if (maxv == -__builtin_inff()) {  // same convention as the scalar reference: no finite entry -> all zero
    for (int64_t i = 0; i < n; i += 8) store(x + i, n - i, _mm256_setzero_ps());
    return;
  }
  const __m256 mv = _mm256_set1_ps(maxv);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(load(x + i, n - i), mv)), _mm256_castsi256_ps(tail_mask(n - i)));
    store(x + i, n - i, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / hsum(sum));
  for (int64_t i = 0; i < n; i += 8) store(x + i, n - i, _mm256_mul_ps(load(x + i, n - i), inv));
}

void scores_f16(MERLIN_MATMUL_ARGS) { matmul_f16(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy); }

int32_t argmax(const float* x, int64_t n) { return scalar::argmax(x, n); }
double exp_weights(const float* x, int64_t n, float max, double scale, double* w) {
  return scalar::exp_weights(x, n, max, scale, w);
}

}  // namespace merlin::kernels::avx2
