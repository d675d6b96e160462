// AVX-512 element-wise kernels. Tails use masked loads and stores, so short vectors (a 64-wide attention head)
// take the same path as long ones.
#include "kernels/cpu/simd_avx512.h"

#include <cstdint>

#include "kernels/cpu/kernels_impl.h"

namespace merlin::kernels::avx512 {
namespace {

using simd512::tail_mask;
using simd512::exp_ps;

inline __m512 silu_ps(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

inline float hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

}  // namespace

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    MERLIN_UNROLL
    for (int u = 0; u < 4; ++u) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * u);
      s[u] = _mm512_fmadd_ps(v, v, s[u]);
    }
  for (; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
    s[0] = _mm512_fmadd_ps(v, v, s[0]);
  }
  const float mean = hsum4(s[0], s[1], s[2], s[3]) / (float)n;
  const __m512 scale = _mm512_set1_ps(1.0f / _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(mean + eps))));
  for (i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), scale);
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
  }
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu_ps(g), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    MERLIN_UNROLL
    for (int u = 0; u < 4; ++u)
      s[u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * u), _mm512_loadu_ps(b + i + 16 * u), s[u]);
  for (; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    s[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s[0]);
  }
  return hsum4(s[0], s[1], s[2], s[3]);
}

void axpy(float a, const float* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 r = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
    _mm512_mask_storeu_ps(y + i, m, r);
  }
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 xv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x + i));
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(av, xv, _mm512_maskz_loadu_ps(m, y + i)));
  }
}

namespace {

// Up to V outputs x 64 columns (a typical head) held in registers while every row passes: a lone output is
// bound by the FMA latency of its four chains, six give 24 independent chains. Per element the fmadd
// sequence of axpy_f16.
template <int V>
void axpy_f16_rows_tile(const float* a, size_t lda, const uint16_t* x, size_t ldx, int64_t n_rows, float* y,
                        size_t ldy, int64_t n) {
  for (int64_t c = 0; c < n; c += 64) {
    __mmask16 m[4];
    __m512 acc[V][4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      m[j] = tail_mask(n - c - 16 * j);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[v][j] = _mm512_maskz_loadu_ps(m[j], y + v * ldy + c + 16 * j);
    }
    for (int64_t p = 0; p < n_rows; ++p) {
      const uint16_t* xp = x + (size_t)p * ldx + c;
      __m512 xv[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) xv[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m[j], xp + 16 * j));
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __m512 av = _mm512_set1_ps(a[v * lda + p]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[v][j] = _mm512_fmadd_ps(av, xv[j], acc[v][j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(y + v * ldy + c + 16 * j, m[j], acc[v][j]);
  }
}

}  // namespace

void axpy_f16_rows(const float* a, size_t lda, int64_t n_vec, const uint16_t* x, size_t ldx, int64_t n_rows, float* y,
                   size_t ldy, int64_t n) {
  using Fn = void (*)(const float*, size_t, const uint16_t*, size_t, int64_t, float*, size_t, int64_t);
  static constexpr Fn kTiles[6] = {&axpy_f16_rows_tile<1>, &axpy_f16_rows_tile<2>, &axpy_f16_rows_tile<3>,
                                   &axpy_f16_rows_tile<4>, &axpy_f16_rows_tile<5>, &axpy_f16_rows_tile<6>};
  for (int64_t v = 0; v < n_vec; v += 6) {
    const int64_t nv = n_vec - v < 6 ? n_vec - v : 6;
    kTiles[nv - 1](a + v * lda, lda, x, ldx, n_rows, y + v * ldy, ldy, n);
  }
}

namespace {

// NV vectors of 16 columns of the heads' concatenated outputs (a head of hd % 16 == 0 columns spans hd / 16 of
// them), every row's weights broadcast from its head's row of a: NV independent FMA chains.
template <int NV>
void axpy_f16_heads_tile(const float* a, size_t lda, const uint16_t* x, size_t ldx, int64_t n_rows, float* y,
                         int64_t hd, int64_t c0) {
  const float* ap[NV];
  __m512 acc[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    ap[v] = a + ((c0 + 16 * v) / hd) * lda;
    acc[v] = _mm512_loadu_ps(y + c0 + 16 * v);
  }
  for (int64_t p = 0; p < n_rows; ++p) {
    const uint16_t* xp = x + (size_t)p * ldx + c0;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      const __m512 xv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + 16 * v)));
      acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(ap[v][p]), xv, acc[v]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(y + c0 + 16 * v, acc[v]);
}

}  // namespace

void axpy_f16_heads(const float* a, size_t lda, int64_t n_heads, const uint16_t* x, size_t ldx, int64_t n_rows,
                    float* y, int64_t hd) {
  if (hd % 16 != 0) {
    for (int64_t j = 0; j < n_heads; ++j) axpy_f16_rows(a + j * lda, 0, 1, x + j * hd, ldx, n_rows, y + j * hd, 0, hd);
    return;
  }
  using Fn = void (*)(const float*, size_t, const uint16_t*, size_t, int64_t, float*, int64_t, int64_t);
  static constexpr Fn kTiles[8] = {&axpy_f16_heads_tile<1>, &axpy_f16_heads_tile<2>, &axpy_f16_heads_tile<3>,
                                   &axpy_f16_heads_tile<4>, &axpy_f16_heads_tile<5>, &axpy_f16_heads_tile<6>,
                                   &axpy_f16_heads_tile<7>, &axpy_f16_heads_tile<8>};
  const int64_t n_vecs = n_heads * hd / 16;
  for (int64_t v = 0; v < n_vecs; v += 8) {
    const int64_t nv = n_vecs - v < 8 ? n_vecs - v : 8;
    kTiles[nv - 1](a, lda, x, ldx, n_rows, y, hd, 16 * v);
  }
}

namespace {

// Q8_0 rows (34-byte blocks: fp16 scale d, 32 int8 q), CW vectors (CW / 2 blocks) of columns [c, c + 16 CW) for
// V outputs held in registers. Each row's values d * q are formed once (dequantize_row's product; int8 -> float
// is exact), then every output takes axpy's fmadd(a, x, y): per element the bits of dequantize_row + axpy.
// One or two outputs (decode) take eight vectors at a time, so eight independent FMA chains hide the latency.
template <int V, int CW>
void axpy_q8_0_rows_tile(const float* a, size_t lda, const uint8_t* x, size_t ldx, int64_t n_rows, float* y,
                         size_t ldy, int64_t c) {
  __m512 acc[V][CW];
#pragma GCC unroll 8
  for (int j = 0; j < CW; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[v][j] = _mm512_loadu_ps(y + v * ldy + c + 16 * j);
  const uint8_t* xc = x + (size_t)(c / 32) * 34;
  for (int64_t p = 0; p < n_rows; ++p) {
    const uint8_t* xp = xc + (size_t)p * ldx;
    __m512 xv[CW];
#pragma GCC unroll 4
    for (int b = 0; b < CW / 2; ++b) {
      const uint8_t* blk = xp + 34 * b;
      uint16_t h;
      __builtin_memcpy(&h, blk, sizeof h);
      const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
      xv[2 * b] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
      xv[2 * b + 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const __m512 av = _mm512_set1_ps(a[v * lda + p]);
#pragma GCC unroll 8
      for (int j = 0; j < CW; ++j) acc[v][j] = _mm512_fmadd_ps(av, xv[j], acc[v][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < CW; ++j)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + v * ldy + c + 16 * j, acc[v][j]);
}

}  // namespace

void axpy_q8_0_rows(const float* a, size_t lda, int64_t n_vec, const uint8_t* x, size_t ldx, int64_t n_rows, float* y,
                    size_t ldy, int64_t n) {
  using Fn = void (*)(const float*, size_t, const uint8_t*, size_t, int64_t, float*, size_t, int64_t);
  // [outputs - 1][0: 32 columns, 1: 64, 2: 128]
  static constexpr Fn kTiles[6][3] = {
      {&axpy_q8_0_rows_tile<1, 2>, &axpy_q8_0_rows_tile<1, 4>, &axpy_q8_0_rows_tile<1, 8>},
      {&axpy_q8_0_rows_tile<2, 2>, &axpy_q8_0_rows_tile<2, 4>, &axpy_q8_0_rows_tile<2, 8>},
      {&axpy_q8_0_rows_tile<3, 2>, &axpy_q8_0_rows_tile<3, 4>, nullptr},
      {&axpy_q8_0_rows_tile<4, 2>, &axpy_q8_0_rows_tile<4, 4>, nullptr},
      {&axpy_q8_0_rows_tile<5, 2>, &axpy_q8_0_rows_tile<5, 4>, nullptr},
      {&axpy_q8_0_rows_tile<6, 2>, &axpy_q8_0_rows_tile<6, 4>, nullptr}};
  if (n_rows <= 0) return;
  for (int64_t v = 0; v < n_vec; v += 6) {
    const int64_t nv = n_vec - v < 6 ? n_vec - v : 6;
    for (int64_t c = 0; c < n;) {
      const int w = nv <= 2 && n - c >= 128 ? 2 : n - c >= 64 ? 1 : 0;
      kTiles[nv - 1][w](a + v * lda, lda, x, ldx, n_rows, y + v * ldy, ldy, c);
      c += (int64_t)32 << w;
    }
  }
}

// The reference quantizer's operations per block: amax by max of |x| (exact), d = amax / 127 and id = 1 / d in
// float, the fp16 scale rounded to nearest even (vcvtps2ph, as f32_to_fp16), and roundf's half-away-from-zero
// rounding of x * id as truncation plus a step of one away from zero where the dropped fraction (exact:
// x * id - trunc(x * id) needs no rounding) is at least one half.
void quantize_q8_0(const float* x, uint8_t* y, int64_t n) {
  const __m512 sign = _mm512_set1_ps(-0.0f), one = _mm512_set1_ps(1.0f), half = _mm512_set1_ps(0.5f);
  for (int64_t b = 0; b < n / 32; ++b, x += 32, y += 34) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t h = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(d), _MM_FROUND_TO_NEAREST_INT), 0);
    __builtin_memcpy(y, &h, sizeof h);
    const __m512 idv = _mm512_set1_ps(id);
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const __m512 v = _mm512_mul_ps(j == 0 ? v0 : v1, idv);
      const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), half, _CMP_GE_OQ);
      const __m512 r = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(v, sign)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y + 2 + 16 * j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(r)));
    }
  }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm256_mask_storeu_epi16(y + i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT));
  }
}

// Pairs (x0, x1) sit in adjacent lanes: a = x * (c, c) and b = swap(x) * (s, s) give x0 c - x1 s = a - b in
// even lanes and x0 s + x1 c = b + a in odd ones, the scalar expressions' roundings. The empty asm keeps GCC
// from contracting the products into FMAs (-ffp-contract=fast), which the scalar code has not.
void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs, uint16_t* f16) {
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < head_dim; i += 16) {
      const __mmask16 m = tail_mask(head_dim - i);
      __m512 xv = _mm512_maskz_loadu_ps(m, v + i);
      if (i < n_rot) {
        const __mmask16 mr = tail_mask(n_rot - i);
        const __m512 t = _mm512_maskz_loadu_ps(mr, cs + i);
        __m512 a = _mm512_mul_ps(xv, _mm512_moveldup_ps(t));
        __m512 b = _mm512_mul_ps(_mm512_permute_ps(xv, 0xB1), _mm512_movehdup_ps(t));
        asm("" : "+v"(a), "+v"(b));
        const __m512 r = _mm512_mask_add_ps(_mm512_sub_ps(a, b), (__mmask16)0xAAAA, a, b);
        xv = _mm512_mask_mov_ps(xv, mr, r);
        _mm512_mask_storeu_ps(v + i, mr, xv);
      }
      if (f16 != nullptr)
        _mm256_mask_storeu_epi16(f16 + h * head_dim + i, m, _mm512_cvtps_ph(xv, _MM_FROUND_TO_NEAREST_INT));
    }
  }
}

void round_f16(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm512_mask_storeu_ps(y + i, m, _mm512_cvtph_ps(h));
  }
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)));
  }
}

void softmax(float* x, int64_t n) {
  if (n <= 0) return;
  __m512 mx = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, x + i));
  }
  const float maxv = _mm512_reduce_max_ps(mx);
  if (maxv == -__builtin_inff()) {  // same convention as the scalar reference: no finite entry -> all zero
    for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(x + i, tail_mask(n - i), _mm512_setzero_ps());
    return;
  }
  const __m512 mv = _mm512_set1_ps(maxv);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), mv)));
    _mm512_mask_storeu_ps(x + i, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv));
  }
}

namespace {

// scores_f16 for k = 64 NS + 16 TL: rows [r, r + 16) (nr of them real), then per token each row's four chains
// (acc_u = fma over s of w[64 s + 16 u ..] * x[..], from zero; then the TL 16-wide tail chunks into acc_0, as
// matmul_f16's row_dots does) summed ((a0 + a1) + a2) + a3 as row_dots does, and the 16 sums reduced together:
// lane i of the result is, for its row, h_l = s[l] + s[l + 8], then ((h0 + h1) + (h2 + h3)) + ((h4 + h5) +
// (h6 + h7)), matmul's reduce4 tree (each add is the same pair of values, so the same bits). Rows 0-3 / 4-7
// are paired so the lanes come out in order. Several tokens: the rows are widened once into wf and reused by
// every token; a lone token (decode) widens each vector in the register that feeds its FMA.
template <int NS, int TL>
void scores_f16_block(const uint16_t* w, size_t w_row_bytes, int64_t nr, const void* x, size_t x_row_bytes,
                      int64_t n_tokens, float* y, int64_t ldy) {
  constexpr int K = 64 * NS + 16 * TL;
  auto wrow = [&](int i) {
    return reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(w) + i * w_row_bytes);
  };
  auto pair = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  };
  auto adjacent = [](__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  };
  // One row's four chains from 16-float vectors ld(j) (j = chunk index), summed as row_dots does.
  auto chains = [](auto ld, const __m512* xv) {
    const __m512 z = _mm512_setzero_ps();
    __m512 acc[4] = {z, z, z, z};
#pragma GCC unroll 4
    for (int s = 0; s < NS; ++s)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[u] = _mm512_fmadd_ps(ld(4 * s + u), xv[4 * s + u], acc[u]);
#pragma GCC unroll 4
    for (int j = 0; j < TL; ++j) acc[0] = _mm512_fmadd_ps(ld(4 * NS + j), xv[4 * NS + j], acc[0]);
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), acc[2]), acc[3]);
  };
  auto reduce16 = [&](auto row_sum) {
    __m512 e[2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int b = 8 * h;
      const __m512 d0 = adjacent(pair(row_sum(b), row_sum(b + 4)), pair(row_sum(b + 1), row_sum(b + 5)));
      const __m512 d1 = adjacent(pair(row_sum(b + 2), row_sum(b + 6)), pair(row_sum(b + 3), row_sum(b + 7)));
      e[h] = adjacent(d0, d1);
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
  };
  const __mmask16 m = tail_mask(nr);
  if (n_tokens == 1) {
    const float* xt = static_cast<const float*>(x);
    __m512 xv[4 * NS + TL];
#pragma GCC unroll 16
    for (int j = 0; j < 4 * NS + TL; ++j) xv[j] = _mm512_loadu_ps(xt + 16 * j);
    auto row_sum = [&](int i) {
      if (i >= nr) return _mm512_setzero_ps();  // as a widened zero row: all chains stay +0
      const uint16_t* wi = wrow(i);
      return chains([&](int j) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wi + 16 * j))); }, xv);
    };
    _mm512_mask_storeu_ps(y, m, reduce16(row_sum));
    return;
  }
  alignas(64) float wf[16 * K];
  for (int i = 0; i < 16; ++i) {
    const uint16_t* wr = wrow(i);
#pragma GCC unroll 16
    for (int j = 0; j < K; j += 16)
      _mm512_store_ps(wf + i * K + j, i < nr ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(wr + j)))
                                             : _mm512_setzero_ps());
  }
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* xt = reinterpret_cast<const float*>(static_cast<const char*>(x) + t * x_row_bytes);
    __m512 xv[4 * NS + TL];
#pragma GCC unroll 16
    for (int j = 0; j < 4 * NS + TL; ++j) xv[j] = _mm512_loadu_ps(xt + 16 * j);
    auto row_sum = [&](int i) {
      const float* wi = wf + i * K;
      return chains([&](int j) { return _mm512_load_ps(wi + 16 * j); }, xv);
    };
    _mm512_mask_storeu_ps(y + t * ldy, m, reduce16(row_sum));
  }
}

}  // namespace

void scores_f16(MERLIN_MATMUL_ARGS) {
  using Fn = void (*)(const uint16_t*, size_t, int64_t, const void*, size_t, int64_t, float*, int64_t);
  // [k / 16 - 1]: 16 .. 256 in steps of 16.
  static constexpr Fn kBlocks[16] = {
      &scores_f16_block<0, 1>, &scores_f16_block<0, 2>, &scores_f16_block<0, 3>, &scores_f16_block<1, 0>,
      &scores_f16_block<1, 1>, &scores_f16_block<1, 2>, &scores_f16_block<1, 3>, &scores_f16_block<2, 0>,
      &scores_f16_block<2, 1>, &scores_f16_block<2, 2>, &scores_f16_block<2, 3>, &scores_f16_block<3, 0>,
      &scores_f16_block<3, 1>, &scores_f16_block<3, 2>, &scores_f16_block<3, 3>, &scores_f16_block<4, 0>};
  if (k <= 0 || k % 16 != 0 || k > 256 || r1 <= r0 || n_tokens <= 0) {
    matmul_f16(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
    return;
  }
  for (int64_t r = r0; r < r1; r += 16) {
    const int64_t nr = r1 - r < 16 ? r1 - r : 16;
    kBlocks[k / 16 - 1](reinterpret_cast<const uint16_t*>(static_cast<const char*>(w) + r * w_row_bytes), w_row_bytes,
                        nr, x, x_row_bytes, n_tokens, y + r, ldy);
  }
}

// Maxima of 256-element blocks (max is exact and maxps(x, m) keeps m when x is NaN, so NaNs never win), then
// the first index of the largest in the first block that holds it: the scalar loop's index, ties to the lowest.
int32_t argmax(const float* x, int64_t n) {
  if (n <= 0 || x[0] != x[0]) return 0;  // a NaN at 0: nothing compares greater than it
  constexpr int64_t kBlock = 256;
  float best = -__builtin_inff();
  int64_t best_block = -1;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = n - b < kBlock ? n - b : kBlock;
    __m512 m[4];
    for (__m512& v : m) v = _mm512_set1_ps(-__builtin_inff());
    int64_t i = 0;
    for (; i + 64 <= e; i += 64)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) m[j] = _mm512_max_ps(_mm512_loadu_ps(x + b + i + 16 * j), m[j]);
    for (; i < e; i += 16) {
      const __mmask16 mk = tail_mask(e - i);
      m[0] = _mm512_mask_max_ps(m[0], mk, _mm512_maskz_loadu_ps(mk, x + b + i), m[0]);
    }
    const float bm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3])));
    if (bm > best) best = bm, best_block = b;
  }
  if (best_block < 0) return 0;  // nothing above -inf: the scalar loop keeps index 0
  for (int64_t i = best_block;; ++i)
    if (x[i] == best) return (int32_t)i;
}

namespace {

// exp of 8 doubles <= 0: x = n ln2 + r with n = round(x / ln2) (Cody-Waite: ln2 in two parts, n ln2_hi exact),
// e^r by its Taylor polynomial of degree 13 on |r| <= ln2 / 2 (truncation below 1e-17), 2^n by vscalefpd,
// which rounds subnormal results and gives 0 below about -745 as libm does. Within 2 ulp of std::exp. NaN
// (a NaN logit) gives 0, not NaN.
inline __m512d exp_pd(__m512d x) {
  x = _mm512_max_pd(x, _mm512_set1_pd(-746.0));
  const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, _mm512_set1_pd(1.4426950408889634)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512d r = _mm512_fnmadd_pd(n, _mm512_set1_pd(6.93147180369123816490e-01), x);
  r = _mm512_fnmadd_pd(n, _mm512_set1_pd(1.90821492927058770002e-10), r);
  static constexpr double kInvFact[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                        1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,      1.0 / 720.0,
                                        1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,         0.5,
                                        1.0,                1.0};
  __m512d p = _mm512_set1_pd(kInvFact[0]);
  for (int k = 1; k < 14; ++k) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(kInvFact[k]));
  return _mm512_scalef_pd(p, n);
}

}  // namespace

// Sixteen weights an iteration: the float difference as the scalar code, widened, scaled, exp_pd; two vector
// sums (the order differs from the scalar loop's in the last bits).
double exp_weights(const float* x, int64_t n, float max, double scale, double* w) {
  const __m512 mx = _mm512_set1_ps(max);
  const __m512d sc = _mm512_set1_pd(scale);
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), mx);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
    const __m512d e0 = exp_pd(_mm512_mul_pd(lo, sc)), e1 = exp_pd(_mm512_mul_pd(hi, sc));
    _mm512_storeu_pd(w + i, e0);
    _mm512_storeu_pd(w + i + 8, e1);
    s0 = _mm512_add_pd(s0, e0);
    s1 = _mm512_add_pd(s1, e1);
  }
  double sum = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
  for (; i < n; ++i) {
    const __m512d e = exp_pd(_mm512_set1_pd((double)(x[i] - max) * scale));
    sum += w[i] = _mm512_cvtsd_f64(e);
  }
  return sum;
}

}  // namespace merlin::kernels::avx512
