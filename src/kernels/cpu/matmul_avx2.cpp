// AVX2+FMA+F16C float-weight matmuls (F32, F16, BF16 weights; f32 activations and accumulation), for CPUs
// without AVX-512. Same two regimes as matmul_avx512.cpp, sized for 16 ymm registers:
//  - few tokens: 4 rows x 1-2 tokens of dot-product accumulators, weights widened on the fly;
//  - many tokens: weights repacked into k-major f32 panels of 16 rows, and a 6-token x 16-row register tile
//    (12 accumulators, 2 weight vectors, 1 broadcast) accumulates outer products.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels_impl.h"

namespace merlin::kernels::avx2 {
namespace {

// Lanes below n (clamped to 0..8) set, for maskload/maskstore.
inline __m256i tail_mask(int64_t n) {
  const int c = n < 0 ? 0 : n > 8 ? 8 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Weight loaders: 8 consecutive weights widened to f32; load_part reads only n < 8 and zero-fills the rest.
struct F32W {
  using Elem = float;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load_part(const float* p, int64_t n) { return _mm256_maskload_ps(p, tail_mask(n)); }
};

template <class Derived>
struct HalfW {
  using Elem = uint16_t;
  static __m256 load(const uint16_t* p) { return Derived::widen(_mm_loadu_si128((const __m128i*)p)); }
  static __m256 load_part(const uint16_t* p, int64_t n) {
    uint16_t buf[8] = {};
    for (int64_t i = 0; i < n && i < 8; ++i) buf[i] = p[i];
    return load(buf);
  }
};

struct F16W : HalfW<F16W> {
  static __m256 widen(__m128i h) { return _mm256_cvtph_ps(h); }
};

// bf16 is the top half of an f32, so widening is a zero-extend and a 16-bit shift.
struct BF16W : HalfW<BF16W> {
  static __m256 widen(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
};

template <class W>
const typename W::Elem* weight_row(const void* w, size_t row_bytes, int64_t r) {
  return reinterpret_cast<const typename W::Elem*>(static_cast<const char*>(w) + r * row_bytes);
}

inline const float* token_row(const void* x, size_t row_bytes, int64_t t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(x) + t * row_bytes);
}

// Lane i of the result is the sum of all lanes of the i-th argument.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

inline float reduce1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// ---------------------------------------------------------------------------------------------------------
// Few tokens: weight rows are streamed one at a time against up to 2 tokens (one sequential stream per
// thread gets far more DRAM bandwidth than interleaved row streams); k is unrolled U times so a lone token
// still has 4 independent FMA chains.

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
                                                    __m256* out) {
  __m256 acc[U][T];
  MERLIN_UNROLL
  for (int u = 0; u < U; ++u)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) acc[u][t] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 * U <= k; j += 8 * U) {
    MERLIN_UNROLL
    for (int u = 0; u < U; ++u) {
      const __m256 wv = W::load(wr + j + 8 * u);
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) acc[u][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xt[t] + j + 8 * u), acc[u][t]);
    }
  }
  for (; j < k; j += 8) {  // a partial vector loads as zero past k in both operands
    const bool full = j + 8 <= k;
    const __m256 wv = full ? W::load(wr + j) : W::load_part(wr + j, k - j);
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) {
      const __m256 xv = full ? _mm256_loadu_ps(xt[t] + j) : _mm256_maskload_ps(xt[t] + j, tail_mask(k - j));
      acc[0][t] = _mm256_fmadd_ps(wv, xv, acc[0][t]);
    }
  }
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) {
    out[t] = acc[0][t];
    MERLIN_UNROLL
    for (int u = 1; u < U; ++u) out[t] = _mm256_add_ps(out[t], acc[u][t]);
  }
}

// R consecutive rows x T tokens; four rows' sums are reduced together into one 4-float store per token.
template <class W, int R, int T, int U>
void dot_tile(const TileArgs& a, int64_t r, int64_t t0) {
  const float* xt[T];
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) xt[t] = token_row(a.x, a.x_row_bytes, t0 + t);
  __m256 sums[R][T];
  MERLIN_UNROLL
  for (int i = 0; i < R; ++i) row_dots<W, T, U>(weight_row<W>(a.w, a.w_row_bytes, r + i), xt, a.k, sums[i]);
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) {
    float* yt = a.y + (t0 + t) * a.ldy + r;
    if constexpr (R == 4) {
      _mm_storeu_ps(yt, reduce4(sums[0][t], sums[1][t], sums[2][t], sums[3][t]));
    } else {
      MERLIN_UNROLL
      for (int i = 0; i < R; ++i) yt[i] = reduce1(sums[i][t]);
    }
  }
}

using TileFn = void (*)(const TileArgs&, int64_t, int64_t);

// Indexed by [rows - 1][tokens - 1]; 4 rows x 2 tokens of sums plus the chains fit 16 registers.
template <class W>
constexpr TileFn kDotTiles[4][2] = {
    {&dot_tile<W, 1, 1, 4>, &dot_tile<W, 1, 2, 2>},
    {&dot_tile<W, 2, 1, 4>, &dot_tile<W, 2, 2, 2>},
    {&dot_tile<W, 3, 1, 4>, &dot_tile<W, 3, 2, 2>},
    {&dot_tile<W, 4, 1, 4>, &dot_tile<W, 4, 2, 2>},
};

// Rows outer, tokens inner: a 4-row group stays in L1 while every token visits it.
template <class W>
void dot_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = r1 - r < 4 ? r1 - r : 4;
    for (int64_t t = 0; t < n_tokens; t += 2) {
      const int64_t nt = n_tokens - t < 2 ? n_tokens - t : 2;
      kDotTiles<W>[nr - 1][nt - 1](a, r, t);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Many tokens: packed weight panels and a broadcast register tile.

constexpr int kNV = 2;               // ymm per tile row: a panel is 16 weight rows wide
constexpr int64_t kNR = 8 * kNV;
constexpr int kMR = 6;               // tokens per tile
constexpr int64_t kKC = 256;         // k per packed block
constexpr int64_t kNC = 16 * kNR;    // rows per packed block: 256 KB of panels

// In-place 8x8 transpose: afterwards v[j] lane i holds what v[i] lane j held.
__attribute__((always_inline)) inline void transpose8(__m256 v[8]) {
  __m256 t[8], s[8];
  MERLIN_UNROLL
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  MERLIN_UNROLL
  for (int h = 0; h < 2; ++h) {  // s[4h + c] lane L = column 4L + c of rows 4h..4h+3
    s[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
    s[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xee);
    s[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
    s[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xee);
  }
  MERLIN_UNROLL
  for (int c = 0; c < 4; ++c) {
    v[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    v[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// Panel layout: for each group of kNR rows, kc steps of kNR floats (row fastest); rows past nr are zero.
template <class W>
void pack_block(const TileArgs& a, int64_t rb, int64_t nr, int64_t kb, int64_t kc, float* dst) {
  for (int64_t p = 0; p * kNR < nr; ++p) {
    float* panel = dst + p * kc * kNR;
    for (int g = 0; g < kNV; ++g) {
      const int64_t first = p * kNR + g * 8;
      const int64_t valid = nr - first < 0 ? 0 : nr - first > 8 ? 8 : nr - first;
      for (int64_t kk = 0; kk < kc; kk += 8) {
        const int64_t steps = kc - kk < 8 ? kc - kk : 8;
        __m256 v[8];
        MERLIN_UNROLL
        for (int i = 0; i < 8; ++i) {
          const typename W::Elem* src = weight_row<W>(a.w, a.w_row_bytes, rb + first + i) + kb + kk;
          v[i] = i >= valid ? _mm256_setzero_ps() : steps == 8 ? W::load(src) : W::load_part(src, steps);
        }
        transpose8(v);
        MERLIN_UNROLL
        for (int j = 0; j < 8; ++j)  // constant indices keep v[] in registers
          if (j < steps) _mm256_store_ps(panel + (kk + j) * kNR + g * 8, v[j]);
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
  __m256 acc[MR][kNV];
  MERLIN_UNROLL
  for (int m = 0; m < MR; ++m)
    MERLIN_UNROLL
    for (int v = 0; v < kNV; ++v) acc[m][v] = _mm256_setzero_ps();
#pragma GCC unroll 2
  for (int64_t kk = 0; kk < kc; ++kk) {
    __m256 b[kNV];
    MERLIN_UNROLL
    for (int v = 0; v < kNV; ++v) b[v] = _mm256_load_ps(panel + kk * kNR + 8 * v);
    MERLIN_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xm[m] + kk);
      MERLIN_UNROLL
      for (int v = 0; v < kNV; ++v) acc[m][v] = _mm256_fmadd_ps(xv, b[v], acc[m][v]);
    }
  }
  MERLIN_UNROLL
  for (int v = 0; v < kNV; ++v) {
    const __m256i mask = tail_mask(nr - 8 * v);
    MERLIN_UNROLL
    for (int m = 0; m < MR; ++m) {
      float* cv = c + m * ldc + 8 * v;
      __m256 out = acc[m][v];
      if (accumulate) out = _mm256_add_ps(out, _mm256_maskload_ps(cv, mask));
      _mm256_maskstore_ps(cv, mask, out);
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

// Below this many tokens, repacking the weights costs more than the reuse it buys.
constexpr int64_t kPackedMinTokens = 6;

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

}  // namespace merlin::kernels::avx2
