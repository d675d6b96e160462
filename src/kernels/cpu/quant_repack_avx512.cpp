// Row-interleaved ("repacked") Q8_0, Q4_0 and MXFP4 weights for AVX-512 VNNI, made once at load by the
// backend (Q4_K: quant_repack_k_avx512.cpp).
//
// Layout: quant_repack.h (shared with the AVX2 kernels of quant_repack_avx2.cpp).
//
// Why: one vpdpbusd of a chunk against 4 activation bytes broadcast from memory gives 16 rows' partial dot
// products in 16 lanes, so a block's integer sums need no horizontal reduction and the 16 scales arrive
// with one vcvtph2ps. Decode and prefill run the same tiles (16 rows x 1..8 tokens), and per (row, token)
// they compute acc = fma(float(S_b), w_scale * x_scale, acc) block by block with S_b the block's exact
// integer dot product: the operations of the row-major tiles and GEMM, so results are bitwise identical to
// the unrepacked kernels and independent of the number of tokens (batch invariance).
#define MERLIN_QUANT_LEVEL avx512
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_repack.h"
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::avx512 {
namespace {

// The 16 rows' block scales of a group-block, widened to float: fp16 (Q8_0, Q4_0), or E8M0 (MXFP4) as
// e8m0_to_f32_half, bit for bit the table kE8m0Half the row-major tiles read.
template <class F>
__m512 scales(const uint8_t* gb) {
  if constexpr (F::kE8m0) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i sub = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, sub));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
  }
}

// acc += dot(u, 4 signed bytes at p broadcast to every lane), with the broadcast folded into the
// instruction ({1to16}); GCC would emit a separate vpbroadcastd per product.
typedef int32_t AliasedI32 __attribute__((may_alias, aligned(1)));
inline __m512i dot_bcast(__m512i acc, __m512i u, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const AliasedI32*>(p)));
  return acc;
}

// 16 rows (group g) x T tokens; e0: the first token's entry of block 0 in the ActInfo, cl: its chunk's length
// (the entry stride between blocks).
template <class F, int T>
void tile(const uint8_t* gw, int64_t nb, const ActInfo& ai, int64_t e0, int64_t cl, float* y, int64_t ldy,
          __mmask16 keep) {
  __m512 acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, gw += group_block_bytes<F>()) {
    const __m512 wd = scales<F>(gw);
    const float* d = ai.d + e0 + b * cl;
    const int32_t* st = ai.start + e0 + b * cl;
    const int8_t* xq = ai.qs + (e0 + b * cl) * 32;  // token t's quants at xq + 32 t
    __m512i s[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) s[t] = _mm512_set1_epi32(st[t]);
    const uint8_t* q = gw + F::kScaleBytes;
    if constexpr (F::kChunks == 8) {
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512i wv = _mm512_loadu_si512(q + 64 * u);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) s[t] = dot_bcast(s[t], wv, xq + 32 * t + 4 * u);
      }
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      const __m512i table = _mm512_add_epi8(
          _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))),
          _mm512_set1_epi8(F::kBias));
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i raw = _mm512_loadu_si512(q + 64 * u);
        __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        if constexpr (F::kTable) {
          lo = _mm512_shuffle_epi8(table, lo);
          hi = _mm512_shuffle_epi8(table, hi);
        }
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          s[t] = dot_bcast(s[t], lo, xq + 32 * t + 4 * u);
          s[t] = dot_bcast(s[t], hi, xq + 32 * t + 16 + 4 * u);
        }
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      const __m512 sc = _mm512_mul_ps(wd, _mm512_set1_ps(d[t]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), sc, acc[t]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * ldy, keep, acc[t]);
}

// Tokens per tile: 12 accumulators and 12 sums in registers (29 of the 32 zmm with the weights' scales and
// nibbles), so each 64-byte weight chunk and its unpacking serve 12 tokens. Against 8 (one thread, 2026-12-01,
// quant_bench 32 x 4096 x 768 / 512 x 768 x 768): Q4_0 541-549 -> 586-592 / 509-513 -> 545-551 GOP/s, Q8_0
// +7 % / +5 %, MXFP4 +7 % / +8 %; 13 tokens gave the same.
constexpr int kTmax = 12;

template <class F>
void rows_packed(MERLIN_MATMUL_ARGS) {
  (void)w_row_bytes;
  using TileFn = void (*)(const uint8_t*, int64_t, const ActInfo&, int64_t, int64_t, float*, int64_t, __mmask16);
  static constexpr TileFn kTiles[kTmax] = {&tile<F, 1>, &tile<F, 2>, &tile<F, 3>,  &tile<F, 4>,
                                           &tile<F, 5>, &tile<F, 6>, &tile<F, 7>,  &tile<F, 8>,
                                           &tile<F, 9>, &tile<F, 10>, &tile<F, 11>, &tile<F, 12>};
  const int64_t nb = k / kQK32;
  const auto* xc = static_cast<const char*>(x);
  const ActInfo ai = act_info<F>(xc, x_row_bytes, n_tokens, nb);
  const auto* packed = static_cast<const uint8_t*>(w);
  for (int64_t c0 = 0; c0 < n_tokens; c0 += kTokenChunk) {
    const int64_t c1 = n_tokens - c0 < kTokenChunk ? n_tokens : c0 + kTokenChunk;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t left = r1 - r;
      const __mmask16 keep = left >= kRows ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      const uint8_t* gw = packed + (r / kRows) * nb * group_block_bytes<F>();
      for (int64_t t = c0; t < c1;) {
        const int64_t nt = c1 - t < kTmax ? c1 - t : kTmax;
        kTiles[nt - 1](gw, nb, ai, c0 * nb + (t - c0), c1 - c0, y + t * ldy + r, ldy, keep);
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

}  // namespace merlin::kernels::quant::avx512
