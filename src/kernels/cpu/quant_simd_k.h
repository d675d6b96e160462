// 256-bit tiles of the 256-element super-block types (Q4_K, TQ1_0, TQ2_0) against Q8_K activations (see
// quant_simd.h for how this is included). Weights are unpacked to unsigned bytes once per tile; offsets
// (Q4_K's mins, the ternary -1) come back through the activation's 16-element sums.
#pragma once
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

// ---- Q4_K ----

// The twelve scale bytes as eight 6-bit scales (bytes 0..7) then eight mins (8..15), as ggml's utmp dance.
inline __m128i q4k_scales_mins(const uint8_t* s) {
  uint32_t u[4];
  __builtin_memcpy(u, s, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins_lo = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins_lo;
  u[0] &= kLow6;
  return _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]);
}

// Shuffle that spreads int16 scale j (of eight in each 128-bit half) over all 16 lanes.
inline __m256i spread_scale(__m256i scales, int j) {
  return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8))));
}

struct WeightQ4_K {
  __m256i q[8];  // sub-block j's 32 quants (0..15)
  __m256i sc[8];  // sub-block j's scale, int16 in every lane
  __m128i mins;  // eight int16 mins
  float d, dmin;

  void load(const BlockQ4_K& b) {
    const __m256i sm = _mm256_cvtepu8_epi16(q4k_scales_mins(b.scales));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm));
    mins = _mm256_extracti128_si256(sm, 1);
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = loadu(b.qs + 32 * c);
      q[2 * c] = _mm256_and_si256(raw, _mm256_set1_epi8(0x0F));
      q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
    }
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) sc[j] = spread_scale(scales, j);
    d = half(b.d);
    dmin = half(b.dmin);
  }
};

// Sums of the activation's eight 32-element sub-blocks, as int16.
inline __m128i q8k_subblock_sums(const BlockQ8_K& x) {
  const __m256i bs = loadu(x.bsums);
  return _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
}

inline int hsum_epi32(__m128i v) {
  v = _mm_add_epi32(v, _mm_unpackhi_epi64(v, v));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 1));
  return _mm_cvtsi128_si32(v);
}

template <int R, int T>
struct TileQ4_K {
  static void run(const Args& a, int64_t r, int64_t t0) {
    const BlockQ4_K* w[R];
    const BlockQ8_K* x[T];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) w[i] = a.wrow<BlockQ4_K>(r + i);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) x[t] = a.xrow<BlockQ8_K>(t0 + t);
    __m256 acc[R][T];
    zero_tile(acc);
    float min_acc[R][T] = {};
    for (int64_t b = 0; b < a.k / kQK_K; ++b) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        WeightQ4_K wb;
        wb.load(w[i][b]);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const BlockQ8_K& xb = x[t][b];
          __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 16
          for (int j = 0; j < 8; ++j)
            sum = dot_s16(sum, wb.sc[j], _mm256_maddubs_epi16(wb.q[j], loadu(xb.qs + 32 * j)));
          acc[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(xb.d * wb.d), _mm256_cvtepi32_ps(sum), acc[i][t]);
          const int summ = hsum_epi32(_mm_madd_epi16(wb.mins, q8k_subblock_sums(xb)));
          min_acc[i][t] += xb.d * wb.dmin * (float)summ;
        }
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) a.y[(t0 + t) * a.ldy + r + i] = hsum(acc[i][t]) - min_acc[i][t];
  }
};

// ---- ternary ----

// Minus the sum of a Q8_K block's quants, spread over the lanes of an accumulator: the ternary dot
// products use trits 0..2 unsigned and subtract sum(x) once for the -1 offset.
inline __m256i neg_q8k_sum(const BlockQ8_K& x) {
  return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(loadu(x.bsums), _mm256_set1_epi16(1)));
}

// Ternary weights as 8 vectors of 32 trits (0..2) in element order.
struct Trits {
  __m256i v[8];
};

inline void unpack_tq2_0(const BlockTQ2_0& b, Trits& t) {
#pragma GCC unroll 16
  for (int h = 0; h < 2; ++h) {
    const __m256i raw = loadu(b.qs + 32 * h);
#pragma GCC unroll 16
    for (int l = 0; l < 4; ++l)
      t.v[4 * h + l] = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * l), _mm256_set1_epi8(3));
  }
}

// Byte-wise multiplies modulo 256 (there is no 8-bit multiply instruction).
inline __m256i mul3(__m256i v) { return _mm256_add_epi8(v, _mm256_add_epi8(v, v)); }
inline __m256i mul9(__m256i v) {
  return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(v, 3), _mm256_set1_epi8((char)0xF8)), v);
}

// Top trit of each byte: (3 * q) >> 8 is 0 for q <= 85, 1 up to 170, 2 above (unsigned compares via a bias).
inline __m256i top_trit(__m256i q) {
  const __m256i s = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
  const __m256i ge1 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(85 - 128)));
  const __m256i ge2 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(170 - 128)));
  return _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_add_epi8(ge1, ge2));
}

inline __m256i pair(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

// qh's four bytes times 3^n at bytes 4n..4n+3 (byte-exact products via two 16-bit multiplies).
inline __m128i qh_powers(const uint8_t* qh) {
  uint32_t raw;
  __builtin_memcpy(&raw, qh, 4);
  const __m128i v = _mm_set1_epi32((int)raw);
  const __m128i p = _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27);
  const __m128i lo = _mm_and_si128(_mm_mullo_epi16(v, p), _mm_set1_epi16(0x00FF));
  const __m128i hi = _mm_mullo_epi16(_mm_and_si128(v, _mm_set1_epi16((short)0xFF00)), p);
  return _mm_or_si128(lo, hi);
}

// Elements 0..159 are trits 0..4 of qs[0..31]; 160..239 trits 0..4 of qs[32..47] (16 per trit); 240..255
// trits 0..3 of qh[0..3] (4 per trit).
inline void unpack_tq1_0(const BlockTQ1_0& b, Trits& t) {
  const __m256i q0 = loadu(b.qs);
  const __m256i q1 = mul3(q0), q2 = mul9(q0);
  t.v[0] = top_trit(q0);
  t.v[1] = top_trit(q1);
  t.v[2] = top_trit(q2);
  t.v[3] = top_trit(mul9(q1));
  t.v[4] = top_trit(mul9(q2));
  const __m256i r0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 32)));
  const __m256i r1 = mul3(r0), r2 = mul9(r0), r3 = mul9(r1), r4 = mul9(r2);
  t.v[5] = top_trit(_mm256_blend_epi32(r0, r1, 0xF0));
  t.v[6] = top_trit(_mm256_blend_epi32(r2, r3, 0xF0));
  t.v[7] = top_trit(pair(_mm256_castsi256_si128(r4), qh_powers(b.qh)));
}

template <int R, int T, class Block, void (*Unpack)(const Block&, Trits&)>
struct TileTernary {
  static void run(const Args& a, int64_t r, int64_t t0) {
    const Block* w[R];
    const BlockQ8_K* x[T];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) w[i] = a.wrow<Block>(r + i);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) x[t] = a.xrow<BlockQ8_K>(t0 + t);
    __m256 acc[R][T];
    zero_tile(acc);
    for (int64_t b = 0; b < a.k / kQK_K; ++b) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        Trits tr;
        Unpack(w[i][b], tr);
        const float wd = half(w[i][b].d);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const BlockQ8_K& xb = x[t][b];
          __m256i sum = neg_q8k_sum(xb);
#pragma GCC unroll 16
          for (int j = 0; j < 8; ++j) sum = dot_u8s8(sum, tr.v[j], loadu(xb.qs + 32 * j));
          acc[i][t] = _mm256_fmadd_ps(_mm256_set1_ps(xb.d * wd), _mm256_cvtepi32_ps(sum), acc[i][t]);
        }
      }
    }
    store_tile(a, r, t0, acc);
  }
};

template <int R, int T>
using TileTQ1_0 = TileTernary<R, T, BlockTQ1_0, unpack_tq1_0>;
template <int R, int T>
using TileTQ2_0 = TileTernary<R, T, BlockTQ2_0, unpack_tq2_0>;

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
