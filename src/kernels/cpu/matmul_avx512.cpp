// AVX-512 float-weight matmuls (F32, F16, BF16 weights; f32 activations and accumulation).
//
// Batch invariance: every output y[t][r] is computed by the same sequence of floating-point operations
// whatever the number of tokens and wherever token t sits in the batch, so a sequence's logits do not
// depend on what else the server batches with it (and prefill in one chunk or many gives the same bits).
// That fixed recipe is the decode one: four zmm accumulators per (row, token) over 64-element steps of k
// (a masked tail goes to the first), summed ((a0 + a1) + a2) + a3, then one fixed horizontal-reduction tree.
//  - few tokens (decode, < 8): each weight row is streamed once against a group of tokens, widening
//    F16/BF16 on the fly. Memory bound.
//  - many tokens (a server's decode step over many sequences, short prefill chunks, k % 64 != 0): 2- or
//    4-row x up-to-6-token tiles run the same per-(row, token) recipe one accumulator chain at a time
//    (pass_tile) over a block of rows that stays in L2, each loaded vector feeding several FMAs.
//  - prefill (64+ tokens, k a multiple of 64, k >= 512): packed panels, one zmm per chain lane of 16 rows,
//    reduced vertically in the same order (panel_tile).

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

// Lane i of the result is the sum of all lanes of the i-th argument. This tree is THE horizontal reduction of
// every output (batch invariance): a lane's result depends only on its own argument, so a row reduced here
// together with any other three rows (or zeros) always gives the same bits.
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

// The fixed number of accumulators per (row, token); 4 gives a lone decode token four independent FMA chains.
constexpr int kU = 4;

// out[t] = lane-wise partial sums of dot(row, x[t]), in the fixed order described at the top.
template <class W, int T>
__attribute__((always_inline)) inline void row_dots(const typename W::Elem* wr, const float* const* xt, int64_t k,
                                                    __m512* out) {
  __m512 acc[kU][T];
  MERLIN_UNROLL
  for (int u = 0; u < kU; ++u)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) acc[u][t] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 * kU <= k; j += 16 * kU) {
    MERLIN_UNROLL
    for (int u = 0; u < kU; ++u) {
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
    for (int u = 1; u < kU; ++u) out[t] = _mm512_add_ps(out[t], acc[u][t]);
  }
}

// R consecutive rows (R <= 4) x T tokens; rows past R reduce as zeros, which does not change the others.
template <class W, int R, int T>
void dot_tile(const TileArgs& a, int64_t r, int64_t t0) {
  const float* xt[T];
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) xt[t] = token_row(a.x, a.x_row_bytes, t0 + t);
  __m512 sums[4][T];
  MERLIN_UNROLL
  for (int i = 0; i < R; ++i) row_dots<W, T>(weight_row<W>(a.w, a.w_row_bytes, r + i), xt, a.k, sums[i]);
  MERLIN_UNROLL
  for (int i = R; i < 4; ++i)
    MERLIN_UNROLL
    for (int t = 0; t < T; ++t) sums[i][t] = _mm512_setzero_ps();
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

constexpr int kMaxT = 6;  // tokens per tile: 24 accumulators + weight vectors fit the 32 zmm

// Indexed by [rows - 1][tokens - 1].
#define MERLIN_DOT_TILES(R)                                                                   \
  {                                                                                           \
    &dot_tile<W, R, 1>, &dot_tile<W, R, 2>, &dot_tile<W, R, 3>, &dot_tile<W, R, 4>,           \
        &dot_tile<W, R, 5>, &dot_tile<W, R, 6>                                                \
  }
template <class W>
constexpr TileFn kDotTiles[4][kMaxT] = {MERLIN_DOT_TILES(1), MERLIN_DOT_TILES(2), MERLIN_DOT_TILES(3),
                                        MERLIN_DOT_TILES(4)};
#undef MERLIN_DOT_TILES

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
// Many tokens: the same recipe in 2- or 4-row x up to 6-token tiles over a block of rows that stays in L2, with
// token groups outer so a group's activations stay in L1 while the block's rows pass. F16/BF16 weights are
// widened in registers as they are loaded: the conversion is cheap next to the T FMAs each vector feeds, and
// a separate widening pass into an f32 copy cost more (extra store and L2 traffic) than it saved.

// y[t * ldy + i] = horizontal sum of sums[i][t]. reduce4 gives each lane from its own argument alone, so the
// R x T outputs are reduced four at a time in any grouping (fewer reductions than one call per token).
template <int R, int T>
__attribute__((always_inline)) inline void store_sums(const __m512 (&sums)[R][T], float* y, int64_t ldy) {
  constexpr int kN = R * T, kGroups = (kN + 3) / 4;
  alignas(16) float out[kGroups * 4];
  const __m512 z = _mm512_setzero_ps();
  auto at = [&](int n) { return n < kN ? sums[n % R][n / R] : z; };
  MERLIN_UNROLL
  for (int g = 0; g < kGroups; ++g)
    _mm_store_ps(out + 4 * g, reduce4(at(4 * g), at(4 * g + 1), at(4 * g + 2), at(4 * g + 3)));
  MERLIN_UNROLL
  for (int n = 0; n < kN; ++n) y[(n / R) * ldy + n % R] = out[n];
}

// Many tokens: each of row_dots' four accumulator chains (chunk u of every 64-element step) is independent,
// so they are computed one after the other, in four passes over k. A pass needs one register per
// (row, token) plus the running chain sums, which makes room for 2 x 6 tiles (4 x 6 when k is long enough
// to amortize spilling the sums): 8 loads per 12 FMAs, where 2 x 3 tiles with all four chains live need 5
// loads per 6. Per (row, token) each chain sees the same FMAs in the same order (the masked tail last, into
// chain 0), and the chains are summed and reduced as in row_dots and dot_tile, so the bits are unchanged.
template <class W, int R, int T>
void pass_tile(const TileArgs& a, int64_t r, int64_t t0) {
  const float* xt[T];
  MERLIN_UNROLL
  for (int t = 0; t < T; ++t) xt[t] = token_row(a.x, a.x_row_bytes, t0 + t);
  const typename W::Elem* wr[R];
  MERLIN_UNROLL
  for (int i = 0; i < R; ++i) wr[i] = weight_row<W>(a.w, a.w_row_bytes, r + i);
  const int64_t k = a.k, k_main = k / (16 * kU) * (16 * kU);
  __m512 sums[R][T];
  MERLIN_UNROLL
  for (int u = 0; u < kU; ++u) {
    __m512 acc[R][T];
    MERLIN_UNROLL
    for (int i = 0; i < R; ++i)
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
    for (int64_t j = 16 * u; j < k_main; j += 16 * kU) {
      __m512 xv[T];
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) {
        xv[t] = _mm512_loadu_ps(xt[t] + j);
        asm("" : "+v"(xv[t]));  // keep loads in registers: GCC would fold them into every FMA as memory operands
      }
      MERLIN_UNROLL
      for (int i = 0; i < R; ++i) {
        __m512 wv = W::load(wr[i] + j);
        asm("" : "+v"(wv));
        MERLIN_UNROLL
        for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
      }
    }
    if (u == 0) {
      for (int64_t j = k_main; j < k; j += 16) {
        const __mmask16 m = tail_mask(k - j);
        MERLIN_UNROLL
        for (int i = 0; i < R; ++i) {
          const __m512 wv = W::load(wr[i] + j, m);
          MERLIN_UNROLL
          for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, xt[t] + j), acc[i][t]);
        }
      }
    }
    MERLIN_UNROLL
    for (int i = 0; i < R; ++i)
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) sums[i][t] = u == 0 ? acc[i][t] : _mm512_add_ps(sums[i][t], acc[i][t]);
  }
  store_sums<R, T>(sums, a.y + t0 * a.ldy + r, a.ldy);
}

constexpr int kWideR = 4, kWideT = 6;
// Indexed by [rows - 1][tokens - 1].
#define MERLIN_PASS_TILES(R)                                                                     \
  {                                                                                              \
    &pass_tile<W, R, 1>, &pass_tile<W, R, 2>, &pass_tile<W, R, 3>, &pass_tile<W, R, 4>,          \
        &pass_tile<W, R, 5>, &pass_tile<W, R, 6>                                                 \
  }
template <class W>
constexpr TileFn kWideTiles[kWideR][kWideT] = {MERLIN_PASS_TILES(1), MERLIN_PASS_TILES(2), MERLIN_PASS_TILES(3),
                                               MERLIN_PASS_TILES(4)};
#undef MERLIN_PASS_TILES

// Rows per tile. A pass keeps R x T accumulators and R x T chain sums live; 4 x 6 spills the sums, which
// short passes (k = 256: four 64-element steps) cannot amortize, while 2 x 6 fits the 32 registers.
inline int64_t tile_rows(int64_t k) { return k < 1024 ? 2 : kWideR; }

// Size of token group g when n tokens are split into `groups` groups of at most kWideT, as evenly as possible
// (32 tokens: 6, 6, 5, 5, 5, 5 rather than five 6s and a 2, whose tiles load as much per FMA).
inline int64_t token_group_size(int64_t n, int64_t groups, int64_t g) {
  return n / groups + (g < n % groups ? 1 : 0);
}

template <class W>
void blocked_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  // Rows per block: ~128 KB of f32 weights (64 KB of F16/BF16).
  int64_t rows = (128 * 1024 / 4) / a.k;
  rows = rows < kWideR ? kWideR : rows > 256 ? 256 : rows / kWideR * kWideR;
  const int64_t tile_r = tile_rows(a.k);
  const int64_t groups = (n_tokens + kWideT - 1) / kWideT;
  for (int64_t rb = r0; rb < r1; rb += rows) {
    const int64_t nr = r1 - rb < rows ? r1 - rb : rows;
    for (int64_t g = 0, t = 0; g < groups; ++g) {
      const int64_t nt = token_group_size(n_tokens, groups, g);
      for (int64_t r = rb; r < rb + nr; r += tile_r) {
        const int64_t n2 = rb + nr - r < tile_r ? rb + nr - r : tile_r;
        kWideTiles<W>[n2 - 1][nt - 1](a, r, t);
      }
      t += nt;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Many tokens, k a multiple of 64 (prefill): the recipe seen from the side. Lane l of chain u of (row, token)
// is a scalar FMA chain over s of w[64 s + c] * x[64 s + c], c = 16 u + l. Here a zmm holds that chain for
// 16 rows at once: weights are packed into 16-row vectors per (c, s) and activations into (c, s, token)
// scalars that are broadcast, so a 32-row x 6-token call runs 12 FMAs per 2 vector loads and 6 broadcasts
// (which leave the FMA pipes alone), with no horizontal reduction. Each (row, token) output sees exactly
// row_dots' FMAs (zero start, s in order), and the 64 chain results are then combined vertically in
// reduce4's order: s_l = ((a0 + a1) + a2) + a3, h_i = s_i + s_(i+8), ((h0 + h1) + (h2 + h3)) + ((h4 + h5) +
// (h6 + h7)). So the bits are those of the other paths; only k % 64 != 0 (whose masked tail would need zero
// activations past k) stays on them.
// The inner loop runs at the FMA peak; what is left is packing (every call packs all of its tokens: ~6% of
// the product at 512 tokens) and the reduction's stores. Against pass_tile with 64-byte aligned activations:
// about equal for k = 768, 15-20% faster for k = 2048 (where 4 x 6 tiles spill their chain sums); and it does
// not care whether activation rows are aligned.

constexpr int kPanelRv = 4;                  // zmm row vectors per packed tile
constexpr int kPanelRows = 16 * kPanelRv;    // rows per packed tile: L2-resident while all tokens pass
constexpr int kHalfRows = kPanelRows / 2;    // rows per kernel call
constexpr int kPanelT = 6;  // tokens per call: 12 accumulators, 12 running sums, 2 weights, a broadcast

// Chains are stored and run in the order the reduction tree consumes them, so that both packed operands are
// read strictly sequentially: position p = 4 li + u holds chain c = 16 u + l with l = 0, 8, 1, 9, ... (li).
constexpr int chain_position(int c) {
  const int u = c / 16, l = c % 16, li = l < 8 ? 2 * l : 2 * (l - 8) + 1;
  return 4 * li + u;
}

// In-register transpose: r[j] lane i becomes r[i] lane j.
__attribute__((always_inline)) inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  MERLIN_UNROLL
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];  // u[4q + e], 128-bit lane L: rows 4q..4q+3 of element 4L + e
  MERLIN_UNROLL
  for (int q = 0; q < 4; ++q) {
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * q + 1]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  MERLIN_UNROLL
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xdd);
    r[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    r[8 + e] = _mm512_shuffle_f32x4(a, c, 0xdd);
    r[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
    r[12 + e] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
}

// Rows [r, r + 64) as two 32-row halves, each [chain position p][s][32 rows]:
// wp[h * 32 k + (p * ns + s) * 32 + i] = w[r + 32 h + i][64 s + c] widened to f32; rows past nr are zero.
template <class W>
void pack_panel_w(const TileArgs& a, int64_t r, int64_t nr, float* wp) {
  const int64_t ns = a.k / 64;
  for (int64_t q = 0; q < kPanelRv; ++q) {
    const typename W::Elem* wr[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t row = r + 16 * q + i;
      wr[i] = row < r + nr ? weight_row<W>(a.w, a.w_row_bytes, row) : nullptr;
    }
    for (int64_t j = 0; j < a.k; j += 16) {
      __m512 v[16];
      MERLIN_UNROLL
      for (int i = 0; i < 16; ++i) v[i] = wr[i] ? W::load(wr[i] + j) : _mm512_setzero_ps();
      transpose16(v);
      const int64_t s = j / 64, c0 = j % 64;
      MERLIN_UNROLL
      for (int e = 0; e < 16; ++e) {
        const int64_t at = (q / 2) * kHalfRows * a.k + (chain_position((int)c0 + e) * ns + s) * kHalfRows;
        _mm512_store_ps(wp + at + 16 * (q % 2), v[e]);
      }
    }
  }
}

// xp[(p * ns + s) * nt + t] = x[t0 + t][64 s + c] for nt <= 16 tokens, p the position of chain c.
inline void pack_panel_x(const TileArgs& a, int64_t t0, int64_t nt, float* xp) {
  const int64_t ns = a.k / 64;
  const __mmask16 m = (__mmask16)((1u << nt) - 1);
  const float* xt[16];
  for (int t = 0; t < 16; ++t) xt[t] = t < nt ? token_row(a.x, a.x_row_bytes, t0 + t) : nullptr;
  for (int64_t j = 0; j < a.k; j += 16) {
    __m512 v[16];
    MERLIN_UNROLL
    for (int t = 0; t < 16; ++t) v[t] = xt[t] ? _mm512_loadu_ps(xt[t] + j) : _mm512_setzero_ps();
    transpose16(v);
    const int64_t s = j / 64, c0 = j % 64;
    MERLIN_UNROLL
    for (int e = 0; e < 16; ++e) _mm512_mask_storeu_ps(xp + (chain_position((int)c0 + e) * ns + s) * nt, m, v[e]);
  }
}

// A 16 Rv-row x T-token tile over all 64 chains, l-major (l = 0, 8, 1, 9, ...): the four chains of one l
// add into a running sum held in registers, and the rest of the vertical reduction tree keeps a small stack
// of partial results in memory (s_l waiting for s_(l+8), h, q and o). Both operands are read sequentially.
template <int Rv, int T>
void panel_tile(const float* wp, const float* xp, int64_t ns, float* y, int64_t ldy, int64_t nr) {
  __m512 s_lo[Rv][T], h_even[Rv][T], q_first[Rv][T], o_first[Rv][T];
  for (int li = 0; li < 16; ++li) {
    __m512 run[Rv][T];
    MERLIN_UNROLL
    for (int u = 0; u < kU; ++u) {
      const int p = 4 * li + u;
      const float* wc = wp + p * ns * kHalfRows;
      const float* xc = xp + p * ns * T;
      __m512 acc[Rv][T];
      MERLIN_UNROLL
      for (int i = 0; i < Rv; ++i)
        MERLIN_UNROLL
        for (int t = 0; t < T; ++t) acc[i][t] = _mm512_setzero_ps();
      for (int64_t s = 0; s < ns; ++s) {
        __m512 wv[Rv];
        MERLIN_UNROLL
        for (int i = 0; i < Rv; ++i) {
          wv[i] = _mm512_load_ps(wc + s * kHalfRows + 16 * i);
          asm("" : "+v"(wv[i]));
        }
        MERLIN_UNROLL
        for (int t = 0; t < T; ++t) {
          __m512 b = _mm512_set1_ps(xc[s * T + t]);
          asm("" : "+v"(b));  // one broadcast load feeding Rv FMAs, not Rv folded {1to16} loads
          MERLIN_UNROLL
          for (int i = 0; i < Rv; ++i) acc[i][t] = _mm512_fmadd_ps(wv[i], b, acc[i][t]);
        }
      }
      MERLIN_UNROLL
      for (int i = 0; i < Rv; ++i)
        MERLIN_UNROLL
        for (int t = 0; t < T; ++t) run[i][t] = u == 0 ? acc[i][t] : _mm512_add_ps(run[i][t], acc[i][t]);
    }
    const int hi = li / 2;  // h index once s_(l+8) is done
    MERLIN_UNROLL
    for (int i = 0; i < Rv; ++i)
      MERLIN_UNROLL
      for (int t = 0; t < T; ++t) {
        if (!(li & 1)) {
          s_lo[i][t] = run[i][t];
          continue;
        }
        const __m512 h = _mm512_add_ps(s_lo[i][t], run[i][t]);
        if (!(hi & 1)) {
          h_even[i][t] = h;
          continue;
        }
        const __m512 q = _mm512_add_ps(h_even[i][t], h);
        if (hi == 1 || hi == 5) {
          q_first[i][t] = q;
          continue;
        }
        const __m512 o = _mm512_add_ps(q_first[i][t], q);
        if (hi == 3) {
          o_first[i][t] = o;
          continue;
        }
        _mm512_mask_storeu_ps(y + t * ldy + 16 * i, tail_mask(nr - 16 * i), _mm512_add_ps(o_first[i][t], o));
      }
  }
}

constexpr int kPanelCallRv = kHalfRows / 16;
using PanelFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t);
constexpr PanelFn kPanelTiles[kPanelT] = {&panel_tile<kPanelCallRv, 1>, &panel_tile<kPanelCallRv, 2>,
                                          &panel_tile<kPanelCallRv, 3>, &panel_tile<kPanelCallRv, 4>,
                                          &panel_tile<kPanelCallRv, 5>, &panel_tile<kPanelCallRv, 6>};

template <class W>
void panel_path(const TileArgs& a, int64_t r0, int64_t r1, int64_t n_tokens) {
  const int64_t ns = a.k / 64;
  // Activations are packed a chunk of tokens at a time (at most ~4 MB); the weights of one 64-row tile are
  // packed once per chunk and stay in L2 while every token group of the chunk passes.
  int64_t chunk = (int64_t)(4u << 20) / (a.k * 4) / kPanelT * kPanelT;
  if (chunk < kPanelT) chunk = kPanelT;
  float* xp = detail::scratch_floats(detail::kScratchWeightRow, (size_t)((chunk < n_tokens ? chunk : n_tokens) * a.k));
  float* wp = detail::scratch_floats(detail::kScratchPackedW, (size_t)(kPanelRows * a.k));
  for (int64_t tc = 0; tc < n_tokens; tc += chunk) {
    const int64_t nc = n_tokens - tc < chunk ? n_tokens - tc : chunk;
    const int64_t groups = (nc + kPanelT - 1) / kPanelT;
    for (int64_t g = 0, t = 0; g < groups; ++g) {
      const int64_t nt = token_group_size(nc, groups, g);
      pack_panel_x(a, tc + t, nt, xp + t * a.k);
      t += nt;
    }
    for (int64_t r = r0; r < r1; r += kPanelRows) {
      const int64_t nr = r1 - r < kPanelRows ? r1 - r : kPanelRows;
      pack_panel_w<W>(a, r, nr, wp);
      for (int64_t g = 0, t = 0; g < groups; ++g) {
        const int64_t nt = token_group_size(nc, groups, g);
        for (int64_t h = 0; h < kPanelRows && h < nr; h += kHalfRows)
          kPanelTiles[nt - 1](wp + h * a.k, xp + t * a.k, ns, a.y + (tc + t) * a.ldy + r + h, a.ldy, nr - h);
        t += nt;
      }
    }
  }
}

// Below this many tokens the weight-streaming dot tiles win: each weight is used too few times to tile.
constexpr int64_t kBlockedMinTokens = 8;
// From this many tokens (and k % 64 == 0) the panel path's packing pays for itself.
constexpr int64_t kPanelMinTokens = 64;
// Packing costs about one pass over both operands: short k (attention scores, k = head_dim) or a narrow row
// range (a few positions of the K cache) would not amortize it.
constexpr int64_t kPanelMinK = 512;

template <class W>
void matmul(MERLIN_MATMUL_ARGS) {
  if (r1 <= r0 || n_tokens <= 0) return;
  const TileArgs a{w, w_row_bytes, x, x_row_bytes, k, y, ldy};
  if (k <= 0) {
    for (int64_t t = 0; t < n_tokens; ++t)
      for (int64_t r = r0; r < r1; ++r) y[t * ldy + r] = 0.0f;
  } else if (n_tokens >= kPanelMinTokens && k % 64 == 0 && k >= kPanelMinK && r1 - r0 >= kPanelRows) {
    panel_path<W>(a, r0, r1, n_tokens);
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

}  // namespace merlin::kernels::avx512
