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

template <class W, int R, int T>
struct TileQ32 {
  static void run(const Args& a, int64_t r, int64_t t0) {
    using Act = ActQ8_0<W::kBias>;
    const typename W::Block* w[R];
    const BlockQ8_0* x[T];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) w[i] = a.wrow<typename W::Block>(r + i);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) x[t] = a.xrow<BlockQ8_0>(t0 + t);
    __m256 acc[R][T];
    zero_tile(acc);
    for (int64_t b = 0; b < a.k / kQK32; ++b) {
      Act xb[T];
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) xb[t] = Act::load(x[t][b]);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m256i wq = W::quants(w[i][b]);
        const __m256 wd = W::scale(w[i][b]);
#pragma GCC unroll 16
        for (int t = 0; t < T; ++t) {
          const __m256i p = W::kUnsigned ? dot_u8s8(xb[t].start, wq, xb[t].q) : dot_s8s8(xb[t].start, wq, xb[t].q);
          acc[i][t] = _mm256_fmadd_ps(_mm256_mul_ps(wd, xb[t].d), _mm256_cvtepi32_ps(p), acc[i][t]);
        }
      }
    }
    store_tile(a, r, t0, acc);
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
