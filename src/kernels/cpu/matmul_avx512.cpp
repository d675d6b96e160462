// AVX-512 float-weight matmuls (F32, F16, BF16 weights; f32 activations and accumulation). Two regimes:
//  - few tokens (decode, < 8): each weight row is streamed once against all tokens of a group, widening
//    F16/BF16 on the fly, with zmm accumulators reduced horizontally at the end. Memory bound.
//  - many tokens (prefill): a block of weights is repacked into k-major f32 panels of 64 rows (so F16/BF16
//    are widened once per call, not once per token), then a 6-token x 64-row register tile accumulates
//    outer products of weight vectors and broadcast activations. Each weight load feeds 6 FMAs and there are
//    no horizontal reductions. Compute bound: ~95% of the FMA peak on Zen 4.

// GCC 12's AVX-512 headers seed results with a self-initialized "undefined" vector and then warn about it
// wherever an intrinsic is inlined (fixed in GCC 13); the warning's location is inside the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels_impl.h"

namespace merlin::kernels::avx512 {
namespace {

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// Weight loaders: 16 consecutive weights widened to f32; the masked form zero-fills lanes past the mask.
struct F32W {
  using Elem = float;
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};

struct F16W {
  using Elem = uint16_t;
  static __m512 load(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static __m512 load(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
};

// bf16 is the top half of an f32, so widening is a zero-extend and a 16-bit shift.
struct BF16W {
  using Elem = uint16_t;
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load(const uint16_t* p) { return widen(_mm256_loadu_si256((const __m256i*)p)); }
  static __m512 load(const uint16_t* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
};

template <class W>
const typename W::Elem* weight_row(const void* w, size_t row_bytes, int64_t r) {
  return reinterpret_cast<const typename W::Elem*>(static_cast<const char*>(w) + r * row_bytes);
}

inline const float* token_row(const void* x, size_t row_bytes, int64_t t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(x) + t * row_bytes);
}

// Lane i of the result is the sum of all lanes of the i-th argument.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto halve = [](__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); };
  const __m256 ab = _mm256_hadd_ps(halve(a), halve(b));
  const __m256 cd = _mm256_hadd_ps(halve(c), halve(d));
  const __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// ---------------------------------------------------------------------------------------------------------
// Few tokens: weight rows are streamed one at a time against up to 8 tokens. One sequential stream per
// thread reaches about twice the DRAM bandwidth of 4 interleaved row streams on Zen 4, so rows are not
// interleaved; k is unrolled U times so a lone token still has 4 independent FMA chains.

struct TileArgs {
  const void* w;
  size_t w_row_bytes;
  const void* x;
  size_t x_row_bytes;
  int64_t k;
  float* y;
  int64_t ldy;
};

// out[t] = lane-wise partial sums of dot(row, x[t]).
template <class W, int T, int U>
__attribute__((always_inline)) inline void row_dots(const typename W::Elem* wr, const float* const* xt, int64_t k,
                                                    __m512* out) {
  __m512 acc[U][T];
  MERLIN_UNROLL
  for (int u = 0; u < U; ++u)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) acc[u][t] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 * U <= k; j += 16 * U) {
    MERLIN_UNROLL
    for (int u = 0; u < U; ++u) {
      const __m512 wv = W::load(wr + j + 16 * u);
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) acc[u][t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xt[t] + j + 16 * u), acc[u][t]);
    }
  }
  for (; j < k; j += 16) {  // masked lanes load as zero in both operands
    const __mmask16 m = tail_mask(k - j);
    const __m512 wv = W::load(wr + j, m);
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) acc[0][t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, xt[t] + j), acc[0][t]);
  }
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) {
    out[t] = acc[0][t];
    MERLIN_UNROLL
    for (int u = 1; u < U; ++u) out[t] = _mm512_add_ps(out[t], acc[u][t]);
  }
}

// Lane t of the result is the sum of all lanes of v[t].
inline __m256 reduce8(const __m512 v[8]) {
  __m256 h[8];
  MERLIN_UNROLL
  for (int t = 0; t < 8; ++t) h[t] = _mm256_add_ps(_mm512_castps512_ps256(v[t]), _mm512_extractf32x8_ps(v[t], 1));
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 efgh = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(abcd, efgh, 0x20), _mm256_permute2f128_ps(abcd, efgh, 0x31));
}

// R consecutive rows x T tokens. Up to 4 tokens, four rows' sums are reduced together into one 4-float
// store per token; beyond that each row's T sums are reduced together and scattered down a column of y.
template <class W, int R, int T, int U>
void dot_tile(const TileArgs& a, int64_t r, int64_t t0) {
  const float* xt[T];
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) xt[t] = token_row(a.x, a.x_row_bytes, t0 + t);
  if constexpr (T <= 4) {
    __m512 sums[R][T];
    MERLIN_UNROLL
    for (int i = 0; i < R; ++i) row_dots<W, T, U>(weight_row<W>(a.w, a.w_row_bytes, r + i), xt, a.k, sums[i]);
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) {
      float* yt = a.y + (t0 + t) * a.ldy + r;
      if constexpr (R == 4) {
        _mm_storeu_ps(yt, reduce4(sums[0][t], sums[1][t], sums[2][t], sums[3][t]));
      } else {
        MERLIN_UNROLL
        for (int i = 0; i < R; ++i) yt[i] = _mm512_reduce_add_ps(sums[i][t]);
      }
    }
  } else {
    for (int i = 0; i < R; ++i) {
      __m512 sums[8];
      row_dots<W, T, U>(weight_row<W>(a.w, a.w_row_bytes, r + i), xt, a.k, sums);
      MERLIN_UNROLL
      for (int t = T; t < 8; ++t) sums[t] = _mm512_setzero_ps();
      alignas(32) float out[8];
      _mm256_store_ps(out, reduce8(sums));
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.ldy + r + i] = out[t];
    }
  }
}

using TileFn = void (*)(const TileArgs&, int64_t, int64_t);

// Indexed by [rows - 1][tokens - 1].
#define MERLIN_DOT_TILES(R)                                                                               \
  {                                                                                                       \
    &dot_tile<W, R, 1, 4>, &dot_tile<W, R, 2, 2>, &dot_tile<W, R, 3, 2>, &dot_tile<W, R, 4, 1>,            \
        &dot_tile<W, R, 5, 1>, &dot_tile<W, R, 6, 1>, &dot_tile<W, R, 7, 1>, &dot_tile<W, R, 8, 1>         \
  }
template <class W>
constexpr TileFn kDotTiles[4][8] = {MERLIN_DOT_TILES(1), MERLIN_DOT_TILES(2), MERLIN_DOT_TILES(3),
                                    MERLIN_DOT_TILES(4)};
#undef MERLIN_DOT_TILES

// Rows outer, tokens inner: a 4-row group stays in L1 while every token visits it.
template <class W>
void dot_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = r1 - r < 4 ? r1 - r : 4;
    for (int64_t t = 0; t < n_tokens; t += 8) {
      const int64_t nt = n_tokens - t < 8 ? n_tokens - t : 8;
      kDotTiles<W>[nr - 1][nt - 1](a, r, t);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Many tokens: packed weight panels and a broadcast register tile.

constexpr int kNV = 4;               // zmm per tile row: a panel is 64 weight rows wide
constexpr int64_t kNR = 16 * kNV;
constexpr int kMR = 6;               // tokens per tile: 24 accumulators + 4 weight vectors fit 32 zmm
constexpr int64_t kKC = 256;         // k per packed block: a 6-token activation slice is 6 KB of L1
constexpr int64_t kNC = 4 * kNR;     // rows per packed block: 256 KB of panels stay in L2

// In-place 16x16 transpose: afterwards v[j] lane i holds what v[i] lane j held.
__attribute__((always_inline)) inline void transpose16(__m512 v[16]) {
  __m512 t[16];
  MERLIN_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  // s[4g + c] lane L = column 4L + c of rows 4g..4g+3.
  __m512 s[16];
  MERLIN_UNROLL
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    s[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    s[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    s[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    s[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  MERLIN_UNROLL
  for (int c = 0; c < 4; ++c) {
    const __m512 u0 = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x44);
    const __m512 u1 = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xee);
    const __m512 u2 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x44);
    const __m512 u3 = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xee);
    v[0 + c] = _mm512_shuffle_f32x4(u0, u2, 0x88);
    v[4 + c] = _mm512_shuffle_f32x4(u0, u2, 0xdd);
    v[8 + c] = _mm512_shuffle_f32x4(u1, u3, 0x88);
    v[12 + c] = _mm512_shuffle_f32x4(u1, u3, 0xdd);
  }
}

// Transposes 16 weight rows x kc into kc vectors of 16 floats, kNR floats apart; rows from `valid` on read
// as zero (their loads are fully masked and aimed at row 0, which exists).
template <class W>
void pack_group(const void* row0, size_t row_bytes, int64_t valid, int64_t kc, float* out) {
  for (int64_t kk = 0; kk < kc; kk += 16) {
    const __mmask16 m = tail_mask(kc - kk);
    __m512 v[16];
    MERLIN_UNROLL
    for (int i = 0; i < 16; ++i) {
      const bool real = i < valid;
      v[i] = W::load(weight_row<W>(row0, row_bytes, real ? i : 0) + kk, real ? m : (__mmask16)0);
    }
    transpose16(v);
    MERLIN_UNROLL
    for (int j = 0; j < 16; ++j)  // constant indices keep v[] in registers
      if (kk + j < kc) _mm512_store_ps(out + (kk + j) * kNR, v[j]);
  }
}

// Panel layout: for each group of kNR rows, kc steps of kNR floats (row fastest); rows past nr are zero.
template <class W>
void pack_block(const TileArgs& a, int64_t rb, int64_t nr, int64_t kb, int64_t kc, float* dst) {
  for (int64_t p = 0; p * kNR < nr; ++p) {
    float* panel = dst + p * kc * kNR;
    for (int g = 0; g < kNV; ++g) {
      const int64_t first = p * kNR + g * 16;
      const int64_t valid = nr - first > 16 ? 16 : nr - first;
      if (valid > 0) {
        pack_group<W>(weight_row<W>(a.w, a.w_row_bytes, rb + first) + kb, a.w_row_bytes, valid, kc, panel + g * 16);
      } else {
        for (int64_t kk = 0; kk < kc; ++kk) _mm512_store_ps(panel + kk * kNR + g * 16, _mm512_setzero_ps());
      }
    }
  }
}

// c[m * ldc + j] (+)= sum_kk x[m][kk] * panel[kk][j] for m < MR tokens, j < nr rows of the panel.
template <int MR>
void panel_tile(const float* x, int64_t x_stride, const float* panel, int64_t kc, float* c, int64_t ldc,
                int64_t nr, bool accumulate) {
  const float* xm[MR];
  MERLIN_UNROLL
  for (int m = 0; m < MR; ++m) xm[m] = x + m * x_stride;
  __m512 acc[MR][kNV];
  MERLIN_UNROLL
  for (int m = 0; m < MR; ++m)
    MERLIN_UNROLL
    for (int v = 0; v < kNV; ++v) acc[m][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    __m512 b[kNV];
    MERLIN_UNROLL
    for (int v = 0; v < kNV; ++v) b[v] = _mm512_load_ps(panel + kk * kNR + 16 * v);
    MERLIN_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(xm[m][kk]);
      MERLIN_UNROLL
      for (int v = 0; v < kNV; ++v) acc[m][v] = _mm512_fmadd_ps(xv, b[v], acc[m][v]);
    }
  }
  MERLIN_UNROLL
  for (int m = 0; m < MR; ++m) {
    MERLIN_UNROLL
    for (int v = 0; v < kNV; ++v) {
      const __mmask16 mask = tail_mask(nr - 16 * v);
      float* cv = c + m * ldc + 16 * v;
      __m512 out = acc[m][v];
      if (accumulate) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, cv));
      _mm512_mask_storeu_ps(cv, mask, out);
    }
  }
}

using PanelFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, bool);
constexpr PanelFn kPanelTiles[kMR] = {&panel_tile<1>, &panel_tile<2>, &panel_tile<3>,
                                      &panel_tile<4>, &panel_tile<5>, &panel_tile<6>};

template <class W>
void packed_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  float* packed = detail::scratch_floats(detail::kScratchPackedW, (size_t)(kNC * kKC));
  const int64_t x_stride = (int64_t)(a.x_row_bytes / sizeof(float));
  for (int64_t nb = r0; nb < r1; nb += kNC) {
    const int64_t nc = r1 - nb < kNC ? r1 - nb : kNC;
    for (int64_t kb = 0; kb < a.k; kb += kKC) {
      const int64_t kc = a.k - kb < kKC ? a.k - kb : kKC;
      pack_block<W>(a, nb, nc, kb, kc, packed);
      for (int64_t t = 0; t < n_tokens; t += kMR) {
        const int64_t mr = n_tokens - t < kMR ? n_tokens - t : kMR;
        const float* xt = token_row(a.x, a.x_row_bytes, t) + kb;
        for (int64_t p = 0; p * kNR < nc; ++p) {
          const int64_t nr = nc - p * kNR < kNR ? nc - p * kNR : kNR;
          kPanelTiles[mr - 1](xt, x_stride, packed + p * kc * kNR, kc, a.y + t * a.ldy + nb + p * kNR, a.ldy,
                              nr, kb > 0);
        }
      }
    }
  }
}

// Below this many tokens, repacking the weights costs more than the reuse it buys (measured on Zen 4 with
// weights coming from DRAM: at 6 tokens the dot tiles win by ~25%, at 8 the packed path is ahead).
constexpr int64_t kPackedMinTokens = 8;

template <class W>
void matmul(MERLIN_MATMUL_ARGS) {
  if (r1 <= r0 || n_tokens <= 0) return;
  const TileArgs a{w, w_row_bytes, x, x_row_bytes, k, y, ldy};
  if (k <= 0) {
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t r = r0; r < r1; ++r) y[t * ldy + r] = 0.0f;
  } else if (n_tokens >= kPackedMinTokens) {
    packed_path<W>(a, r0, r1, n_tokens);
  } else {
    dot_path<W>(a, r0, r1, n_tokens);
  }
}

}  // namespace

void matmul_f32(MERLIN_MATMUL_ARGS) { matmul<F32W>(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy); }
void matmul_f16(MERLIN_MATMUL_ARGS) { matmul<F16W>(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy); }
void matmul_bf16(MERLIN_MATMUL_ARGS) {
  matmul<BF16W>(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}

}  // namespace merlin::kernels::avx512
