// Row-interleaved ("repacked") Q8_0, Q4_0 and MXFP4 weights for AVX2, made once at load by the backend: the
// layout of quant_repack.h, the same bytes as the AVX-512 kernels read.
//
// Why: the row-major AVX2 tiles (quant_simd_q32.h) reduce each (row, block) product horizontally (maddubs,
// madd, then hadd across rows) and widen every pair sum with a multiply, so one token ran at ~5 GB/s of
// Q4_0 weights per core, a quarter of what the cores could multiply. Here one maddubs of half a chunk (8
// rows x 4 weight bytes) against 4 activation bytes broadcast to every lane gives 8 rows' partial sums in
// 8 lanes; a block's 8 maddubs accumulate in int16 (Q4_0: 16 products of at most 15 * 127 per lane, 30,480;
// MXFP4's biased values reach 24, so they widen after 4) and one madd per block widens them, so no
// horizontal reduction is left. Per (row, token) the result is still acc = fma(float(S_b), w_scale *
// x_scale, acc) block by block with S_b the block's exact integer dot product: bit for bit the row-major
// tiles and GEMM of this level, for any number of tokens (batch invariance).
//
// Q8_0's biased bytes (up to 255) would saturate maddubs, so each is split into its nibbles, 16 hi + lo:
// two maddubs per byte quad, each summing in int16 over a block like Q4_0's, and S = 16 * sum(x * hi) +
// sum(x * lo) - 128 * sum(x). Against the sign trick of the row-major tiles (abs, sign, then a madd per
// maddubs) the multiplies are the same, but nothing is reduced across lanes.
#define MERLIN_QUANT_LEVEL avx2
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_repack.h"
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::avx2 {
namespace {

// The block scales of rows 8h..8h+7 of a group-block, widened to float: fp16 (Q8_0, Q4_0), or E8M0 (MXFP4) as
// e8m0_to_f32_half, bit for bit the table kE8m0Half the row-major tiles read.
template <class F>
__m256 scales8(const uint8_t* gb, int h) {
  if constexpr (F::kE8m0) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + kHalf * h)));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, small));
  } else {
    return fp16x8(gb + 2 * kHalf * h);
  }
}

// Rows 8h0 .. 8(h0 + H) - 1 of a group (H = 1 or 2 halves, sharing each broadcast activation) x T tokens;
// e0: the first token's entry of block 0 in the ActInfo, cl: its chunk's length (the entry stride between
// blocks); left: rows of the group that exist from row 8h0 on (fewer than 8H only in the last group).
template <class F, int H, int T>
void tile(const uint8_t* gw, int64_t nb, int h0, const ActInfo& ai, int64_t e0, int64_t cl, float* y, int64_t ldy,
          int64_t left) {
  constexpr bool kWiden = F::kTable;  // MXFP4's values up to 24: int16 sums widen after 4 maddubs
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 acc[H][T];
  zero_halves(acc);
  for (int64_t b = 0; b < nb; ++b, gw += group_block_bytes<F>()) {
    const float* d = ai.d + e0 + b * cl;
    const int32_t* st = ai.start + e0 + b * cl;
    const int8_t* xq = ai.qs + (e0 + b * cl) * 32;  // token t's quants at xq + 32 t
    const uint8_t* q = gw + F::kScaleBytes + 32 * h0;
    // Four group-blocks ahead: base Q4_0 tg128 202 -> 231-236 t/s on two cores, against 231 at two blocks
    // and 219 at eight.
    prefetch_ahead<group_block_bytes<F>(), 4>(gw);
    __m256i s16[H][T], s32[H][T];
#pragma GCC unroll 16
    for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) s16[hh][t] = s32[hh][t] = _mm256_setzero_si256();
    if constexpr (F::kChunks == 8) {
      // Q8_0's biased byte w + 128 = 16 hi + lo with both nibbles 0..15: s16 sums x * lo, s32 (as int16) x * hi.
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        __m256i lo[H], hi[H];
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          split_nibbles(loadu(q + 64 * u + 32 * hh), lo[hh], hi[hh]);
        }
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m256i xv = bcast4(xq + 32 * t + 4 * u);
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh) {
            s16[hh][t] = _mm256_add_epi16(s16[hh][t], _mm256_maddubs_epi16(lo[hh], xv));
            s32[hh][t] = _mm256_add_epi16(s32[hh][t], _mm256_maddubs_epi16(hi[hh], xv));
          }
        }
      }
    } else {
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        __m256i lo[H], hi[H];
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          split_nibbles(loadu(q + 64 * u + 32 * hh), lo[hh], hi[hh]);
          if constexpr (F::kTable) {
            const __m256i table = _mm256_add_epi8(
                _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))),
                _mm256_set1_epi8(F::kBias));
            lo[hh] = _mm256_shuffle_epi8(table, lo[hh]);
            hi[hh] = _mm256_shuffle_epi8(table, hi[hh]);
          }
        }
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m256i xl = bcast4(xq + 32 * t + 4 * u), xh = bcast4(xq + 32 * t + 16 + 4 * u);
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh) {
            s16[hh][t] = _mm256_add_epi16(s16[hh][t], _mm256_maddubs_epi16(lo[hh], xl));
            s16[hh][t] = _mm256_add_epi16(s16[hh][t], _mm256_maddubs_epi16(hi[hh], xh));
          }
        }
        if (kWiden && u == 1) {
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
            for (int t = 0; t < T; ++t) {
              s32[hh][t] = _mm256_madd_epi16(s16[hh][t], ones);
              s16[hh][t] = _mm256_setzero_si256();
            }
        }
      }
    }
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh) {
      const __m256 wd = scales8<F>(gw, h0 + hh);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const __m256i part = F::kChunks == 8 ? _mm256_madd_epi16(s32[hh][t], sixteen) : s32[hh][t];
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_set1_epi32(st[t]), part),
                                           _mm256_madd_epi16(s16[hh][t], ones));
        const __m256 sc = _mm256_mul_ps(wd, _mm256_set1_ps(d[t]));
        acc[hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc[hh][t]);
      }
    }
  }
  store_halves<H, T>(acc, y, ldy, left);
}

// Tokens per tile: both halves of a group share each broadcast for 1-2 tokens (14 of the 16 ymm at 2); from
// 3 tokens a half at a time, its weights unpacked once for up to kTmax tokens. Q8_0 keeps a second int16 sum
// per token and runs 3 (one thread, 32 x 4096 x 768: 25.4 GOP/s against 24.8 at 4); MXFP4's widened sums
// spill a little at 4 and still gain (46.3 against 44.6 at 3).
template <class F>
constexpr int kTmax = F::kChunks == 8 ? 3 : 4;

template <class F>
void rows_packed(MERLIN_MATMUL_ARGS) {
  (void)w_row_bytes;
  using TileFn = void (*)(const uint8_t*, int64_t, int, const ActInfo&, int64_t, int64_t, float*, int64_t, int64_t);
  static constexpr TileFn kBoth[2] = {&tile<F, 2, 1>, &tile<F, 2, 2>};
  static constexpr TileFn kOne[4] = {&tile<F, 1, 1>, &tile<F, 1, 2>, &tile<F, 1, 3>,
                                     &tile<F, 1, (kTmax<F> >= 4 ? 4 : 3)>};
  const int64_t nb = k / kQK32, tmax = kTmax<F>;
  const ActInfo ai = act_info<F>(static_cast<const char*>(x), x_row_bytes, n_tokens, nb);
  const auto* packed = static_cast<const uint8_t*>(w);
  for (int64_t c0 = 0; c0 < n_tokens; c0 += kTokenChunk) {
    const int64_t c1 = n_tokens - c0 < kTokenChunk ? n_tokens : c0 + kTokenChunk;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t left = r1 - r < kRows ? r1 - r : kRows;
      const uint8_t* gw = packed + (r / kRows) * nb * group_block_bytes<F>();
      if (c1 - c0 <= 2 && left > kHalf) {
        kBoth[c1 - c0 - 1](gw, nb, 0, ai, c0 * nb, c1 - c0, y + c0 * ldy + r, ldy, left);
        continue;
      }
      for (int h = 0; h < 2 && kHalf * h < left; ++h)
        for (int64_t t = c0; t < c1;) {
          const int64_t nt = c1 - t < tmax ? c1 - t : tmax;
          kOne[nt - 1](gw, nb, h, ai, c0 * nb + (t - c0), c1 - c0, y + t * ldy + r + kHalf * h, ldy, left - kHalf * h);
          t += nt;
        }
    }
  }
}

}  // namespace

const PackedMatmul kPackedQ8_0{&packed_bytes<FmtQ8_0>, &repack<FmtQ8_0>, &unpack_row<FmtQ8_0>, &rows_packed<FmtQ8_0>};
const PackedMatmul kPackedQ4_0{&packed_bytes<FmtQ4_0>, &repack<FmtQ4_0>, &unpack_row<FmtQ4_0>, &rows_packed<FmtQ4_0>};
const PackedMatmul kPackedMxfp4{&packed_bytes<FmtMxfp4>, &repack<FmtMxfp4>, &unpack_row<FmtMxfp4>,
                                &rows_packed<FmtMxfp4>};

}  // namespace merlin::kernels::quant::avx2
