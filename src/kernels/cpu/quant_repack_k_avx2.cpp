// AVX2 kernels for the row-interleaved Q4_K and TQ2_0 layouts of quant_repack_k.h (the bytes the AVX-512
// kernels of quant_repack_k_avx512.cpp read, which describes them). A ymm holds half a 64-byte chunk: rows
// 0..7 of the group, or 8..15. Per (row, token) and super-block they form the same exact integers as the
// AVX-512 kernels and then the same float operations, so both levels give the same bits, for any number of
// tokens (batch invariance); like those they differ in the last bits from the row-major tiles, so the
// runtime uses one layout or the other for a weight.
//
// Q4_K: a sub-block's dot product with one 32-byte activation quad per step is 8 vpmaddubsw of nibbles
// (0..15) added in int16 (at most 8 * 2 * 15 * 127 = 30,480 per lane), and one vpmaddwd against the rows'
// 6-bit scales as int16 pairs both widens it and multiplies it by the scale (sc * dot_j, exact); the mins
// term takes 4 vpmaddwd against the token's sub-block sums. TQ2_0: trits 0..2, so a whole super-block's 64
// vpmaddubsw per lane stay within int16 (64 * 2 * 2 * 127 = 32,512) and one vpmaddwd widens them.
#define MERLIN_QUANT_LEVEL avx2
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_repack_k.h"
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::avx2 {
namespace {

namespace q4k {

// Rows 8h0 .. 8(h0 + H) - 1 of a group x T tokens from t0.
template <int H, int T>
void tile(const uint8_t* gw, int64_t nsb, int h0, const char* x, size_t x_row_bytes, const void* sums, int64_t t0,
          float* y, int64_t ldy, int64_t left) {
  const auto* xsums = static_cast<const int16_t*>(sums);
  const BlockQ8_K* xr[T];
  q8k_rows(x, x_row_bytes, t0, xr);
  __m256 acc[H][T];
  zero_halves(acc);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nsb; ++b, gw += kGroupBlockBytes) {
    prefetch_ahead<kGroupBlockBytes, 1>(gw);
    __m256i s[H][T];
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) s[hh][t] = _mm256_setzero_si256();
    const uint8_t* q = gw + kOffQuants + 32 * h0;
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {
      const uint8_t* qc = q + 512 * c;
#pragma GCC unroll 2
      for (int odd = 0; odd < 2; ++odd) {  // sub-block j = 2c + odd: the chunks' low nibbles, then the high
        const int j = 2 * c + odd;
        __m256i dj[H][T];
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) dj[hh][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u) {
          __m256i v[H];
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh) {
            const __m256i raw = loadu(qc + 64 * u + 32 * hh);
            v[hh] = _mm256_and_si256(odd ? _mm256_srli_epi16(raw, 4) : raw, low);
          }
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const __m256i xv = bcast4(xr[t][b].qs + 32 * j + 4 * u);
#pragma GCC unroll 2
            for (int hh = 0; hh < H; ++hh) dj[hh][t] = _mm256_add_epi16(dj[hh][t], _mm256_maddubs_epi16(v[hh], xv));
          }
        }
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          // The 8 rows' scales in both int16 halves of their lane: madd then gives sc * (pair sum + pair sum).
          const __m256i sc = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gw + kOffScales + 16 * j + kHalf * (h0 + hh))));
          const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) s[hh][t] = _mm256_add_epi32(s[hh][t], _mm256_madd_epi16(dj[hh][t], sc2));
        }
      }
    }
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh) {
      const int h = h0 + hh;
      __m256i mins[4];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
        mins[p] = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(gw + kOffMins + 32 * p + 2 * kHalf * h)));
      const __m256 wd = fp16x8(gw + 2 * kHalf * h), wdmin = fp16x8(gw + kOffDmin + 2 * kHalf * h);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const int16_t* xs = xsums + ((t0 + t) * nsb + b) * 8;
        __m256i m = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) m = _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], bcast4(xs + 2 * p)));
        const __m256 xd = _mm256_set1_ps(xr[t][b].d);
        acc[hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[hh][t]), _mm256_mul_ps(wd, xd), acc[hh][t]);
        acc[hh][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(wdmin, xd), acc[hh][t]);
      }
    }
  }
  store_halves<H, T>(acc, y, ldy, left);
}

}  // namespace q4k

namespace tq2 {

template <int H, int T>
void tile(const uint8_t* gw, int64_t nsb, int h0, const char* x, size_t x_row_bytes, const void* sums, int64_t t0,
          float* y, int64_t ldy, int64_t left) {
  const auto* start = static_cast<const int32_t*>(sums);
  const BlockQ8_K* xr[T];
  q8k_rows(x, x_row_bytes, t0, xr);
  __m256 acc[H][T];
  zero_halves(acc);
  const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nsb; ++b, gw += kGroupBlockBytes) {
    prefetch_ahead<kGroupBlockBytes, 1>(gw);
    __m256i s16[H][T];
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) s16[hh][t] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int hq = 0; hq < 2; ++hq)
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        __m256i raw[H];
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) raw[hh] = loadu(gw + 32 + 64 * (8 * hq + u) + 32 * (h0 + hh));
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
          __m256i v[H];
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh)
            v[hh] = _mm256_and_si256(l ? _mm256_srli_epi16(raw[hh], 2 * l) : raw[hh], three);
#pragma GCC unroll 16
          for (int t = 0; t < T; ++t) {
            const __m256i xv = bcast4(xr[t][b].qs + 128 * hq + 32 * l + 4 * u);
#pragma GCC unroll 2
            for (int hh = 0; hh < H; ++hh) s16[hh][t] = _mm256_add_epi16(s16[hh][t], _mm256_maddubs_epi16(v[hh], xv));
          }
        }
      }
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh) {
      const __m256 wd = fp16x8(gw + 2 * kHalf * (h0 + hh));
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const __m256i s =
            _mm256_add_epi32(_mm256_set1_epi32(start[(t0 + t) * nsb + b]), _mm256_madd_epi16(s16[hh][t], ones));
        acc[hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(wd, _mm256_set1_ps(xr[t][b].d)), acc[hh][t]);
      }
    }
  }
  store_halves<H, T>(acc, y, ldy, left);
}

}  // namespace tq2

using PackedTileFn = void (*)(const uint8_t*, int64_t, int, const char*, size_t, const void*, int64_t, float*, int64_t,
                              int64_t);
using SumsFn = const void* (*)(const char*, size_t, int64_t, int64_t);

// One token runs both halves of a group at once; more tokens run a half at a time, up to tmax tokens per tile
// (kOne[n - 1]: n tokens).
struct Tiles {
  PackedTileFn both;
  PackedTileFn one[4];
  int64_t tmax;
};

void drive(const Tiles& tiles, SumsFn act_sums, size_t group_block_bytes, MERLIN_MATMUL_ARGS) {
  (void)w_row_bytes;
  const int64_t nsb = k / kQK_K;
  const auto* xc = static_cast<const char*>(x);
  const void* sums = act_sums(xc, x_row_bytes, n_tokens, nsb);
  const auto* packed = static_cast<const uint8_t*>(w);
  for (int64_t c0 = 0; c0 < n_tokens; c0 += kTokenChunk) {
    const int64_t c1 = n_tokens - c0 < kTokenChunk ? n_tokens : c0 + kTokenChunk;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t left = r1 - r < kRows ? r1 - r : kRows;
      const uint8_t* gw = packed + (size_t)((r / kRows) * nsb) * group_block_bytes;
      if (c1 - c0 == 1 && left > kHalf) {
        tiles.both(gw, nsb, 0, xc, x_row_bytes, sums, c0, y + c0 * ldy + r, ldy, left);
        continue;
      }
      for (int h = 0; h < 2 && kHalf * h < left; ++h)
        for (int64_t t = c0; t < c1;) {
          const int64_t nt = c1 - t < tiles.tmax ? c1 - t : tiles.tmax;
          tiles.one[nt - 1](gw, nsb, h, xc, x_row_bytes, sums, t, y + t * ldy + r + kHalf * h, ldy, left - kHalf * h);
          t += nt;
        }
    }
  }
}

// Q4_K keeps acc, s and a sub-block's sums per token (3T of the 16 ymm): 3 tokens per half-tile. TQ2_0 keeps
// two per token: 4.
void rows_q4_k(MERLIN_MATMUL_ARGS) {
  static constexpr Tiles kTiles{&q4k::tile<2, 1>,
                                {&q4k::tile<1, 1>, &q4k::tile<1, 2>, &q4k::tile<1, 3>, &q4k::tile<1, 3>},
                                3};
  drive(kTiles, &q4k::act_sums, q4k::kGroupBlockBytes, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}
void rows_tq2_0(MERLIN_MATMUL_ARGS) {
  static constexpr Tiles kTiles{&tq2::tile<2, 1>,
                                {&tq2::tile<1, 1>, &tq2::tile<1, 2>, &tq2::tile<1, 3>, &tq2::tile<1, 4>},
                                4};
  drive(kTiles, &tq2::act_sums, tq2::kGroupBlockBytes, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}

}  // namespace

const PackedMatmul kPackedQ4_K{&LayoutQ4_K::bytes, &LayoutQ4_K::repack, &LayoutQ4_K::unpack_row, &rows_q4_k};
const PackedMatmul kPackedTQ2_0{&LayoutTQ2_0::bytes, &LayoutTQ2_0::repack, &LayoutTQ2_0::unpack_row, &rows_tq2_0};

}  // namespace merlin::kernels::quant::avx2
