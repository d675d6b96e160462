// AVX2+FMA+F16C float-weight matmuls (F32, F16, BF16 weights; f32 activations and accumulation), for CPUs
// without AVX-512. Batch invariant like matmul_avx512.cpp: every output y[t][r] is four ymm accumulators per
// (row, token) over 32-element steps of k (a partial tail goes to the first), summed ((a0 + a1) + a2) + a3,
// then one fixed reduction tree, whatever the number of tokens.
//  - few tokens: 4 rows x 1-2 tokens, weights widened on the fly;
//  - many tokens: a block of rows widened to f32 once (F16/BF16) and kept in L2, the same tiles over it.
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

// Lane i of the result is the sum of all lanes of the i-th argument: THE reduction of every output (a lane
// depends only on its own argument, so rows reduced with zeros or with other rows give the same bits).
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
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

constexpr int kU = 4;  // accumulators per (row, token): four FMA chains for a lone decode token

// out[t] = lane-wise partial sums of dot(row, x[t]), in the fixed order described at the top.
template <class W, int T>
__attribute__((always_inline)) inline void row_dots(const typename W::Elem* wr, const float* const* xt, int64_t k,
                                                    __m256* out) {
  __m256 acc[kU][T];
  MERLIN_UNROLL
  for (int u = 0; u < kU; ++u)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) acc[u][t] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 * kU <= k; j += 8 * kU) {
    MERLIN_UNROLL
    for (int u = 0; u < kU; ++u) {
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
    for (int u = 1; u < kU; ++u) out[t] = _mm256_add_ps(out[t], acc[u][t]);
  }
}

// R consecutive rows (R <= 4) x T tokens; missing rows reduce as zeros.
template <class W, int R, int T>
void dot_tile(const TileArgs& a, int64_t r, int64_t t0) {
  const float* xt[T];
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) xt[t] = token_row(a.x, a.x_row_bytes, t0 + t);
  __m256 sums[4][T];
  MERLIN_UNROLL
  for (int i = 0; i < R; ++i) row_dots<W, T>(weight_row<W>(a.w, a.w_row_bytes, r + i), xt, a.k, sums[i]);
  MERLIN_UNROLL
  for (int i = R; i < 4; ++i)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) sums[i][t] = _mm256_setzero_ps();
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) {
    float* yt = a.y + (t0 + t) * a.ldy + r;
    const __m128 v = reduce4(sums[0][t], sums[1][t], sums[2][t], sums[3][t]);
    if constexpr (R == 4) {
      _mm_storeu_ps(yt, v);
    } else {
      alignas(16) float out[4];
      _mm_store_ps(out, v);
      MERLIN_UNROLL
      for (int i = 0; i < R; ++i) yt[i] = out[i];
    }
  }
}

using TileFn = void (*)(const TileArgs&, int64_t, int64_t);

constexpr int kMaxT = 2;  // 4 chains x 2 tokens of accumulators fit the 16 ymm registers

// Indexed by [rows - 1][tokens - 1].
template <class W>
constexpr TileFn kDotTiles[4][kMaxT] = {
    {&dot_tile<W, 1, 1>, &dot_tile<W, 1, 2>},
    {&dot_tile<W, 2, 1>, &dot_tile<W, 2, 2>},
    {&dot_tile<W, 3, 1>, &dot_tile<W, 3, 2>},
    {&dot_tile<W, 4, 1>, &dot_tile<W, 4, 2>},
};

// Rows outer, tokens inner: a 4-row group stays in L1 while every token visits it.
template <class W>
void dot_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = r1 - r < 4 ? r1 - r : 4;
    for (int64_t t = 0; t < n_tokens; t += kMaxT) {
      const int64_t nt = n_tokens - t < kMaxT ? n_tokens - t : kMaxT;
      kDotTiles<W>[nr - 1][nt - 1](a, r, t);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Many tokens: the same tiles over a block of rows widened to f32 once, token pairs outer.

template <class W>
void widen_rows(const TileArgs& a, int64_t r, int64_t nr, float* dst) {
  for (int64_t i = 0; i < nr; ++i) {
    const typename W::Elem* src = weight_row<W>(a.w, a.w_row_bytes, r + i);
    float* d = dst + i * a.k;
    int64_t j = 0;
    for (; j + 8 <= a.k; j += 8) _mm256_storeu_ps(d + j, W::load(src + j));
    if (j < a.k) _mm256_maskstore_ps(d + j, tail_mask(a.k - j), W::load_part(src + j, a.k - j));
  }
}

template <class W>
void blocked_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  int64_t rows = (128 * 1024 / 4) / a.k;  // ~128 KB of f32 weights, a multiple of 4 rows
  rows = rows < 4 ? 4 : rows > 256 ? 256 : rows / 4 * 4;
  constexpr bool kWiden = !__is_same(W, F32W);
  float* wide = kWiden ? detail::scratch_floats(detail::kScratchPackedW, (size_t)(rows * a.k)) : nullptr;
  for (int64_t rb = r0; rb < r1; rb += rows) {
    const int64_t nr = r1 - rb < rows ? r1 - rb : rows;
    TileArgs b = a;
    int64_t base = rb;
    if constexpr (kWiden) {
      widen_rows<W>(a, rb, nr, wide);
      b.w = wide;
      b.w_row_bytes = (size_t)a.k * sizeof(float);
      b.y = a.y + rb;
      base = 0;
    }
    for (int64_t t = 0; t < n_tokens; t += kMaxT) {
      const int64_t nt = n_tokens - t < kMaxT ? n_tokens - t : kMaxT;
      for (int64_t r = 0; r < nr; r += 4) {
        const int64_t n4 = nr - r < 4 ? nr - r : 4;
        kDotTiles<F32W>[n4 - 1][nt - 1](b, base + r, t);
      }
    }
  }
}

// Below this many tokens, widening a block of weights costs more than the reuse it buys.
constexpr int64_t kBlockedMinTokens = 6;

template <class W>
void matmul(MERLIN_MATMUL_ARGS) {
  if (r1 <= r0 || n_tokens <= 0) return;
  const TileArgs a{w, w_row_bytes, x, x_row_bytes, k, y, ldy};
  if (k <= 0) {
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t r = r0; r < r1; ++r) y[t * ldy + r] = 0.0f;
  } else if (n_tokens >= kBlockedMinTokens) {
    blocked_path<W>(a, r0, r1, n_tokens);
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
