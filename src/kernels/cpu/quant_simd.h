// 256-bit building blocks of the quantized matmuls, shared by the *_avx2.cpp and *_avx512.cpp quant files:
// each defines MERLIN_QUANT_LEVEL to its level's namespace and includes this header (directly or through
// quant_simd_*.h / quant_gemm.h), getting its own internal-linkage copy compiled with its own -m flags.
// Under AVX512-VNNI the integer dot products are single vpdpbusd / vpdpwssd instructions; under plain AVX2
// they are maddubs + madd.
//
// Everything sits in an anonymous namespace and avoids <cmath>/<algorithm> (see kernels_impl.h).
#pragma once
#ifndef MERLIN_QUANT_LEVEL
#error "define MERLIN_QUANT_LEVEL before including quant_simd.h"
#endif
// GCC 12's AVX-512 intrinsics pass _mm*_undefined_*() through and trip -W(maybe-)uninitialized where
// they are inlined; the warnings are located in the header, so silencing them around the include suffices.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels_impl.h"
#include "kernels/cpu/quant_formats.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

// ---- integer dot products: lane i of the result adds the products of bytes 4i..4i+3 ----

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// u: unsigned bytes, s: signed bytes.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
// a, b: int16 pairs.
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#else
// maddubs saturates int16 pair sums, so callers keep u <= 128 and |s| <= 127.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline __m256i dot_s16(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif

// Signed x signed through |w| and x carrying w's sign; x must avoid -128 (activations are in [-127, 127]).
inline __m256i dot_s8s8(__m256i acc, __m256i w, __m256i x) {
  return dot_u8s8(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half(uint16_t h) { return _cvtsh_ss(h); }

inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 16 bytes of nibbles to 32 bytes: low nibbles first (elements 0..15), then high (16..31).
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// ---- activation quantization, bit-identical to the scalar reference ----

// Four vectors of 8 int32 (elements 0..31 in order) to 32 int8 in order.
inline __m256i pack_i32_to_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

// quantize_act_row_q8_0: id = 127 / amax, cvtps rounding half to even.
[[maybe_unused]] void quantize_rows_q8_0(const float* x, int64_t n_tokens, int64_t k, void* out) {
  auto* y = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n_tokens * (k / kQK32); ++b, x += kQK32) {
    __m256 v[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(abs_ps(v[0]), abs_ps(v[1])), _mm256_max_ps(abs_ps(v[2]), abs_ps(v[3])));
    const float amax = hmax(m);
    y[b].d = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
    const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), pack_i32_to_i8(q[0], q[1], q[2], q[3]));
  }
}

// The element of largest magnitude, first occurrence winning (its sign sets the scale's sign, as ggml).
float signed_absmax(const float* x) {
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < kQK_K; j += 8) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + j)));
  const float amax = hmax(m);
  for (int j = 0; j < kQK_K; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + j)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
    if (hit) return x[j + __builtin_ctz((unsigned)hit)];
  }
  return 0.0f;
}

[[maybe_unused]] void quantize_rows_q8_k(const float* x, int64_t n_tokens, int64_t k, void* out) {
  auto* y = static_cast<BlockQ8_K*>(out);
  for (int64_t b = 0; b < n_tokens * (k / kQK_K); ++b, x += kQK_K) {
    const float max = signed_absmax(x);
    if (max == 0.0f) {
      __builtin_memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    const float iscale = -127.0f / max;
    const __m256 s = _mm256_set1_ps(iscale);
    for (int j = 0; j < kQK_K; j += 32) {
      __m256i q[4];  // cvtps rounds half to even, as ggml's nearest_int
#pragma GCC unroll 16
      for (int u = 0; u < 4; ++u) q[u] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * u), s));
      const __m256i q8 = pack_i32_to_i8(q[0], q[1], q[2], q[3]);  // saturation is ggml's MIN(127, v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs + j), q8);
      // Sums of 16: bytes -> pairs -> quads, then two groups of four quads.
      const __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
      const __m256i s8 = _mm256_hadd_epi32(s4, s4);
      const __m256i s16 = _mm256_hadd_epi32(s8, s8);
      y[b].bsums[j / 16] = (int16_t)_mm256_extract_epi32(s16, 0);
      y[b].bsums[j / 16 + 1] = (int16_t)_mm256_extract_epi32(s16, 4);
    }
    y[b].d = 1 / iscale;
  }
}

// ---- tiles: R weight rows x T tokens of dot products, each weight block unpacked once per tile ----

struct Args {
  const char* w;
  size_t w_row_bytes;
  const char* x;
  size_t x_row_bytes;
  int64_t k;
  float* y;
  int64_t ldy;

  template <class B>
  const B* wrow(int64_t r) const { return reinterpret_cast<const B*>(w + r * w_row_bytes); }
  template <class B>
  const B* xrow(int64_t t) const { return reinterpret_cast<const B*>(x + t * x_row_bytes); }
};

using TileFn = void (*)(const Args&, int64_t r, int64_t t0);

// Rows outer, tokens inner: a tile of R weight rows stays in L1/L2 while every token passes over it, and for
// one token each weight byte is read exactly once, streaming. Tile<R, T>::run is called with R in {Rmax, 1}
// and T in 1..Tmax.
template <template <int, int> class Tile, int Rmax, int Tmax>
void run_tiles(const Args& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  static_assert(Tmax >= 1 && Tmax <= 4);
  static constexpr TileFn kWide[4] = {&Tile<Rmax, 1>::run, &Tile<Rmax, (Tmax > 1 ? 2 : 1)>::run,
                                      &Tile<Rmax, (Tmax > 2 ? 3 : 1)>::run, &Tile<Rmax, (Tmax > 3 ? 4 : 1)>::run};
  static constexpr TileFn kNarrow[4] = {&Tile<1, 1>::run, &Tile<1, (Tmax > 1 ? 2 : 1)>::run,
                                        &Tile<1, (Tmax > 2 ? 3 : 1)>::run, &Tile<1, (Tmax > 3 ? 4 : 1)>::run};
  for (int64_t r = r0; r < r1;) {
    const bool wide = r1 - r >= Rmax;
    for (int64_t t = 0; t < n_tokens;) {
      const int64_t nt = n_tokens - t < Tmax ? n_tokens - t : Tmax;
      (wide ? kWide : kNarrow)[nt - 1](a, r, t);
      t += nt;
    }
    r += wide ? Rmax : 1;
  }
}

template <int R, int T>
void store_tile(const Args& a, int64_t r, int64_t t0, const __m256 (&acc)[R][T]) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.ldy + r + i] = hsum(acc[i][t]);
}

template <int R, int T>
void zero_tile(__m256 (&acc)[R][T]) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[i][t] = _mm256_setzero_ps();
}

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
