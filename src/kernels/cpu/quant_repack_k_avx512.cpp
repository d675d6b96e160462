// Row-interleaved ("repacked") layouts of the 256-element super-block types Q4_K and TQ2_0 for AVX-512
// VNNI, made once at load by the backend (the counterpart of quant_repack_avx512.cpp, which explains the
// idea). Rows in groups of kRepackRows = 16 (the last group padded with zero rows); per group and
// super-block one "group-block", whose quants sit in 64-byte chunks with 32-bit lane i holding 4 bytes of
// row i, so one vpdpbusd with 4 activation bytes broadcast from memory feeds 16 rows.
//
// Q4_K, 2368 bytes per group-block (2.8% more than the file's 16 x 144, for scales that arrive with one
// vpmovzx):
//     0  the 16 rows' fp16 d                        (32 bytes)
//    32  the 16 rows' fp16 dmin                     (32 bytes)
//    64  scales: [sub-block j][row] bytes           (128 bytes, the 6-bit values unpacked)
//   192  mins:   [pair p][row][m(2p), m(2p+1)] bytes (128 bytes)
//   320  quants: [c][u][row][4 bytes], chunk (c, u) = the file's qs[32c + 4u .. +3] of each row: low
//        nibbles are elements 4u.. of sub-block 2c, high nibbles those of sub-block 2c + 1.
// Per (row, token) and super-block the kernel forms the exact integers S = sum_j sc_j * dot_j(q, x) and
// M = sum_j m_j * sum_j(x) (the scalar reference's sumi and summ), then
//     acc = fma(float(S), d * xd, acc);  acc = fma(-float(M), dmin * xd, acc).
// dot_j is 8 vpdpbusd; the 16 rows' scales multiply it with one vpmulld, and M takes 4 vpdpwssd against
// the token's sub-block sums as int16 pairs.
//
// TQ2_0, 1056 bytes per group-block (exactly 16 file blocks): the 16 fp16 d (32 bytes), then chunks
// [h][u][row][4 bytes] = the file's qs[32h + 4u .. +3]; bits 2l..2l+1 of those bytes are elements
// 128h + 32l + 4u.. as trits 0..2. Per (row, token) and super-block S = sum(trit * x) - sum(x) exactly,
// then acc = fma(float(S), d * xd, acc).
//
// Every token count runs the same tiles with the same operations per (row, token), so results do not
// depend on the batch. They differ in the last bits from the row-major tiles of quant_simd_k.h (which
// convert partial sums to float per lane), so the runtime uses one layout or the other for a weight.
#define MERLIN_QUANT_LEVEL avx512
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_repack_k.h"
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::avx512 {
namespace {

// acc += dot(u, 4 bytes at p broadcast to every lane), the broadcast folded into the instruction.
typedef int32_t AliasedI32 __attribute__((may_alias, aligned(1)));
inline __m512i dot_bcast(__m512i acc, __m512i u, const void* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*static_cast<const AliasedI32*>(p)));
  return acc;
}
inline __m512i dot_s16_bcast(__m512i acc, __m512i a, const void* p) {
  asm("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*static_cast<const AliasedI32*>(p)));
  return acc;
}

namespace q4k {

// 16 rows (one group) x T tokens from t0.
template <int T>
void tile(const uint8_t* gw, int64_t nsb, const char* x, size_t x_row_bytes, const void* sums, int64_t t0, float* y,
          int64_t ldy, __mmask16 keep) {
  const auto* xsums = static_cast<const int16_t*>(sums);
  const BlockQ8_K* xr[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) xr[t] = reinterpret_cast<const BlockQ8_K*>(x + (t0 + t) * x_row_bytes);
  __m512 acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nsb; ++b, gw += kGroupBlockBytes) {
    __m512i s[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_si512();
    const uint8_t* q = gw + kOffQuants;
    // Sub-block by sub-block (each chunk is loaded twice, for its low and high nibbles) keeps the
    // registers at 3T: acc, s and the sub-block's sums.
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      const uint8_t* qc = q + 512 * c;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        __m512i dj[T];
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) dj[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          const __m512i raw = _mm512_loadu_si512(qc + 64 * u);
          const __m512i v = _mm512_and_si512(h ? _mm512_srli_epi16(raw, 4) : raw, low);
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) dj[t] = dot_bcast(dj[t], v, xr[t][b].qs + 32 * j + 4 * u);
        }
        const __m512i sc =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gw + kOffScales + 16 * j)));
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) s[t] = _mm512_add_epi32(s[t], _mm512_mullo_epi32(dj[t], sc));
      }
    }
    __m512i mins[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p)
      mins[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gw + kOffMins + 32 * p)));
    const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gw)));
    const __m512 wdmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gw + kOffDmin)));
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const int16_t* xs = xsums + ((t0 + t) * nsb + b) * 8;
      __m512i m = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) m = dot_s16_bcast(m, mins[p], xs + 2 * p);
      const __m512 xd = _mm512_set1_ps(xr[t][b].d);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(wd, xd), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(wdmin, xd), acc[t]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy, keep, acc[t]);
}

}  // namespace q4k

namespace tq2 {

template <int T>
void tile(const uint8_t* gw, int64_t nsb, const char* x, size_t x_row_bytes, const void* sums, int64_t t0, float* y,
          int64_t ldy, __mmask16 keep) {
  const auto* start = static_cast<const int32_t*>(sums);
  const BlockQ8_K* xr[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) xr[t] = reinterpret_cast<const BlockQ8_K*>(x + (t0 + t) * x_row_bytes);
  __m512 acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i three = _mm512_set1_epi8(3);
  for (int64_t b = 0; b < nsb; ++b, gw += kGroupBlockBytes) {
    __m512i s[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) s[t] = _mm512_set1_epi32(start[(t0 + t) * nsb + b]);
#pragma GCC unroll 1
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512i raw = _mm512_loadu_si512(gw + 32 + 64 * (8 * h + u));
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          const __m512i v = _mm512_and_si512(l ? _mm512_srli_epi16(raw, 2 * l) : raw, three);
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) s[t] = dot_bcast(s[t], v, xr[t][b].qs + 128 * h + 32 * l + 4 * u);
        }
      }
    const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gw)));
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(wd, _mm512_set1_ps(xr[t][b].d)), acc[t]);
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy, keep, acc[t]);
}

}  // namespace tq2

using PackedTileFn = void (*)(const uint8_t*, int64_t, const char*, size_t, const void*, int64_t, float*, int64_t, __mmask16);
using SumsFn = const void* (*)(const char*, size_t, int64_t, int64_t);

constexpr int kTmax = 8;

// Tiles of one type (tile<T>: 16 rows x T tokens) over rows [r0, r1) and all tokens; act_sums prepares
// what the tiles need of each token's activation sums.
void drive(const PackedTileFn (&tiles)[kTmax], SumsFn act_sums, size_t group_block_bytes, MERLIN_MATMUL_ARGS) {
  (void)w_row_bytes;
  const int64_t nsb = k / kQK_K;
  const auto* xc = static_cast<const char*>(x);
  const void* sums = act_sums(xc, x_row_bytes, n_tokens, nsb);
  const auto* packed = static_cast<const uint8_t*>(w);
  for (int64_t c0 = 0; c0 < n_tokens; c0 += kTokenChunk) {
    const int64_t c1 = n_tokens - c0 < kTokenChunk ? n_tokens : c0 + kTokenChunk;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t left = r1 - r;
      const __mmask16 keep = left >= kRows ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      const uint8_t* gw = packed + (size_t)((r / kRows) * nsb) * group_block_bytes;
      for (int64_t t = c0; t < c1;) {
        const int64_t nt = c1 - t < kTmax ? c1 - t : kTmax;
        tiles[nt - 1](gw, nsb, xc, x_row_bytes, sums, t, y + r, ldy, keep);
        t += nt;
      }
    }
  }
}

#define MERLIN_TILES(ns) \
  { &ns::tile<1>, &ns::tile<2>, &ns::tile<3>, &ns::tile<4>, &ns::tile<5>, &ns::tile<6>, &ns::tile<7>, &ns::tile<8> }

void rows_q4_k(MERLIN_MATMUL_ARGS) {
  static constexpr PackedTileFn kTiles[kTmax] = MERLIN_TILES(q4k);
  drive(kTiles, &q4k::act_sums, q4k::kGroupBlockBytes, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}
void rows_tq2_0(MERLIN_MATMUL_ARGS) {
  static constexpr PackedTileFn kTiles[kTmax] = MERLIN_TILES(tq2);
  drive(kTiles, &tq2::act_sums, tq2::kGroupBlockBytes, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}
#undef MERLIN_TILES

}  // namespace

const PackedMatmul kPackedQ4_K{&LayoutQ4_K::bytes, &LayoutQ4_K::repack, &LayoutQ4_K::unpack_row, &rows_q4_k};
const PackedMatmul kPackedTQ2_0{&LayoutTQ2_0::bytes, &LayoutTQ2_0::repack, &LayoutTQ2_0::unpack_row, &rows_tq2_0};

}  // namespace merlin::kernels::quant::avx512
