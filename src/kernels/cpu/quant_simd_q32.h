// 256-bit tiles of the 32-element block types against Q8_0 activations (see quant_simd.h for how this is
// included). Per block and (row, token): one integer dot product of 32 bytes, then one multiply-add by the
// product of the two scales. The scales are widened in vector registers (a broadcast fp16 load and one
// vcvtph2ps), which costs less than converting scalars and broadcasting them.
#pragma once
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline __m256 fp16_splat(uint16_t h) { return _mm256_cvtph_ps(_mm_set1_epi16((short)h)); }

// A token's block: its quants, its scale in all lanes, and -bias * sum(x) per lane for the weight formats
// whose bytes are biased to unsigned (kBias = 0 when unused).
template <int kBias>
struct ActQ8_0 {
  __m256i q;
  __m256 d;
  __m256i start;
  static ActQ8_0 load(const BlockQ8_0& b) {
    ActQ8_0 a;
    a.q = loadu(b.qs);
    a.d = fp16_splat(b.d);
    if constexpr (kBias != 0) {
      const __m256i sum = dot_u8s8(_mm256_setzero_si256(), _mm256_set1_epi8((char)kBias), a.q);
      a.start = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
    } else {
      a.start = _mm256_setzero_si256();
    }
    return a;
  }
};

// Weight policies: `quants` gives 32 bytes for dot_u8s8 (kUnsigned) or dot_s8s8, `scale` the block scale.
// Q8_0 under VNNI: bytes biased by +128 (one xor instead of abs + sign); under AVX2 maddubs could
// saturate on biased bytes, so the sign trick stays.
struct WQ8_0 {
  using Block = BlockQ8_0;
  static constexpr bool kUnsigned = kVnni;
  static constexpr int kBias = kVnni ? 128 : 0;
  static __m256i quants(const Block& b) {
    const __m256i q = loadu(b.qs);
    return kVnni ? _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)) : q;
  }
  static __m256 scale(const Block& b) { return fp16_splat(b.d); }
};

// Nibbles are used unsigned (0..15); the -8 offset comes back through the start value.
struct WQ4_0 {
  using Block = BlockQ4_0;
  static constexpr bool kUnsigned = true;
  static constexpr int kBias = 8;
  static __m256i quants(const Block& b) { return unpack_nibbles(b.qs); }
  static __m256 scale(const Block& b) { return fp16_splat(b.d); }
};

// Nibbles index the doubled E2M1 table (biased by +128 under VNNI); the scale is a 256-entry lookup.
struct WMxfp4 {
  using Block = BlockMxfp4;
  static constexpr bool kUnsigned = kVnni;
  static constexpr int kBias = kVnni ? 128 : 0;
  static __m256i quants(const Block& b) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values)));
    const __m256i v = _mm256_shuffle_epi8(table, unpack_nibbles(b.qs));
    return kVnni ? _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)) : v;
  }
  static __m256 scale(const Block& b) { return _mm256_broadcast_ss(&kE8m0Half.v[b.e]); }
};

// Block sums of up to four rows: lane i = the sum of all lanes of p[i] (integer adds: exact in any order).
template <int R>
inline __m128i block_sums(const __m256i (&p)[R]) {
  const __m256i z = _mm256_setzero_si256();
  const __m256i h01 = _mm256_hadd_epi32(p[0], R > 1 ? p[R > 1 ? 1 : 0] : z);
  const __m256i h23 = _mm256_hadd_epi32(R > 2 ? p[R > 2 ? 2 : 0] : z, R > 3 ? p[R > 3 ? 3 : 0] : z);
  const __m256i h = _mm256_hadd_epi32(h01, h23);
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Batch invariance: per (row, token) this computes acc = fma(float(S_b), w_scale * x_scale, acc) over the
// blocks b in order, with S_b the block's exact integer dot product: the same operations as the
// token-parallel GEMM (quant_gemm_avx512.cpp), so an output never depends on how many tokens ran together.
// Rows are processed four to an xmm (R <= 4; missing rows are zero lanes).
template <class W, int R, int T>
struct TileQ32 {
  static_assert(R >= 1 && R <= 4);
  static void run(const Args& a, int64_t r, int64_t t0) {
    using Act = ActQ8_0<W::kBias>;
    const typename W::Block* w[R];
    const BlockQ8_0* x[T];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) w[i] = a.wrow<typename W::Block>(r + i);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) x[t] = a.xrow<BlockQ8_0>(t0 + t);
    __m128 acc[T];
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t] = _mm_setzero_ps();
    for (int64_t b = 0; b < a.k / kQK32; ++b) {
      __m256i wq[R];
      alignas(16) float wd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        wq[i] = W::quants(w[i][b]);
        wd[i] = _mm256_cvtss_f32(W::scale(w[i][b]));
      }
      const __m128 wd4 = _mm_load_ps(wd);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const Act xb = Act::load(x[t][b]);
        __m256i p[R];
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i)
          p[i] = W::kUnsigned ? dot_u8s8(xb.start, wq[i], xb.q) : dot_s8s8(xb.start, wq[i], xb.q);
        const __m128 s = _mm_mul_ps(wd4, _mm256_castps256_ps128(xb.d));
        acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(block_sums<R>(p)), s, acc[t]);
      }
    }
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      alignas(16) float out[4];
      _mm_store_ps(out, acc[t]);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) a.y[(t0 + t) * a.ldy + r + i] = out[i];
    }
  }
};

template <int R, int T>
using TileQ8_0 = TileQ32<WQ8_0, R, T>;
template <int R, int T>
using TileQ4_0 = TileQ32<WQ4_0, R, T>;
template <int R, int T>
using TileMxfp4 = TileQ32<WMxfp4, R, T>;

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
