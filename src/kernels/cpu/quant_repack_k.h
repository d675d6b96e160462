// The row-interleaved layouts of the super-block types Q4_K and TQ2_0 (quant_repack_k_avx512.cpp describes
// them and their kernels; quant_repack_avx2.cpp has AVX2 kernels for the same bytes), included like
// quant_repack.h so that each level compiles its own copy.
#pragma once
#include "kernels/cpu/quant_repack.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

namespace q4k {

constexpr size_t kOffDmin = 32, kOffScales = 64, kOffMins = 192, kOffQuants = 320;
constexpr size_t kGroupBlockBytes = kOffQuants + 4 * 8 * 64;
static_assert(kGroupBlockBytes == 2368);

inline void put(const BlockQ4_K& b, int row, uint8_t* gb) {
  __builtin_memcpy(gb + 2 * row, &b.d, 2);
  __builtin_memcpy(gb + kOffDmin + 2 * row, &b.dmin, 2);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    q4k_scale_min(j, b.scales, &sc, &m);
    gb[kOffScales + 16 * j + row] = sc;
    gb[kOffMins + 32 * (j / 2) + 2 * row + (j % 2)] = m;
  }
  for (int c = 0; c < 4; ++c)
    for (int u = 0; u < 8; ++u)
      __builtin_memcpy(gb + kOffQuants + 512 * c + 64 * u + 4 * row, b.qs + 32 * c + 4 * u, 4);
}

// Inverse of put: the twelve scale bytes are a bijection of the sixteen 6-bit values (see q4k_scale_min).
inline void get(const uint8_t* gb, int row, BlockQ4_K& b) {
  __builtin_memcpy(&b.d, gb + 2 * row, 2);
  __builtin_memcpy(&b.dmin, gb + kOffDmin + 2 * row, 2);
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = gb[kOffScales + 16 * j + row];
    m[j] = gb[kOffMins + 32 * (j / 2) + 2 * row + (j % 2)];
  }
  for (int j = 0; j < 4; ++j) {
    b.scales[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
    b.scales[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
    b.scales[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4));
  }
  for (int c = 0; c < 4; ++c)
    for (int u = 0; u < 8; ++u)
      __builtin_memcpy(b.qs + 32 * c + 4 * u, gb + kOffQuants + 512 * c + 64 * u + 4 * row, 4);
}

// Per token and super-block, the eight 32-element sums of the activation as int16 (|sum| <= 32 * 127).
const void* act_sums(const char* x, size_t x_row_bytes, int64_t n_tokens, int64_t nsb) {
  auto* out = reinterpret_cast<int16_t*>(detail::scratch_floats(detail::kScratchWeightRow, (size_t)(4 * n_tokens * nsb)));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const auto* xb = reinterpret_cast<const BlockQ8_K*>(x + t * x_row_bytes);
    for (int64_t b = 0; b < nsb; ++b) {
      const __m256i bs = loadu(xb[b].bsums);
      const __m128i s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (t * nsb + b) * 8), s);
    }
  }
  return out;
}

}  // namespace q4k

namespace tq2 {

constexpr size_t kGroupBlockBytes = 32 + 16 * 64;
static_assert(kGroupBlockBytes == kRows * sizeof(BlockTQ2_0));

inline void put(const BlockTQ2_0& b, int row, uint8_t* gb) {
  __builtin_memcpy(gb + 2 * row, &b.d, 2);
  for (int c = 0; c < 16; ++c) __builtin_memcpy(gb + 32 + 64 * c + 4 * row, b.qs + 4 * c, 4);
}

inline void get(const uint8_t* gb, int row, BlockTQ2_0& b) {
  __builtin_memcpy(&b.d, gb + 2 * row, 2);
  for (int c = 0; c < 16; ++c) __builtin_memcpy(b.qs + 4 * c, gb + 32 + 64 * c + 4 * row, 4);
}

// Per token and super-block, minus the sum of the activation's quants: the start value that turns the
// dot product with trits 0..2 into the one with -1..1.
const void* act_sums(const char* x, size_t x_row_bytes, int64_t n_tokens, int64_t nsb) {
  auto* out = reinterpret_cast<int32_t*>(detail::scratch_floats(detail::kScratchWeightRow, (size_t)(n_tokens * nsb)));
  for (int64_t t = 0; t < n_tokens; ++t) {
    const auto* xb = reinterpret_cast<const BlockQ8_K*>(x + t * x_row_bytes);
    for (int64_t b = 0; b < nsb; ++b) {
      const __m256i s8 = _mm256_madd_epi16(loadu(xb[b].bsums), _mm256_set1_epi16(1));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      out[t * nsb + b] = -_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
    }
  }
  return out;
}

}  // namespace tq2

// PackedMatmul's layout functions from a type's put/get (one row of one group-block).
template <class Block, size_t kGroupBlockBytes, void (*Put)(const Block&, int, uint8_t*),
          void (*Get)(const uint8_t*, int, Block&)>
struct Layout {
  static size_t bytes(int64_t rows, int64_t k) {
    return (size_t)((rows + kRows - 1) / kRows) * (size_t)(k / kQK_K) * kGroupBlockBytes;
  }
  static void repack(const void* w, size_t w_row_bytes, int64_t rows, int64_t k, void* out) {
    const int64_t nsb = k / kQK_K, groups = (rows + kRows - 1) / kRows;
    auto* o = static_cast<uint8_t*>(out);
    __builtin_memset(o, 0, bytes(rows, k));  // padded rows: zero scales and quants
    for (int64_t g = 0; g < groups; ++g)
      for (int i = 0; i < kRows && g * kRows + i < rows; ++i) {
        const auto* row = reinterpret_cast<const Block*>(static_cast<const char*>(w) + (g * kRows + i) * w_row_bytes);
        for (int64_t b = 0; b < nsb; ++b) Put(row[b], i, o + (size_t)(g * nsb + b) * kGroupBlockBytes);
      }
  }
  static void unpack_row(const void* packed, int64_t r, int64_t k, void* out) {
    const int64_t nsb = k / kQK_K;
    const auto* g = static_cast<const uint8_t*>(packed) + (size_t)((r / kRows) * nsb) * kGroupBlockBytes;
    auto* blocks = static_cast<Block*>(out);
    for (int64_t b = 0; b < nsb; ++b) Get(g + (size_t)b * kGroupBlockBytes, (int)(r % kRows), blocks[b]);
  }
};

using LayoutQ4_K = Layout<BlockQ4_K, q4k::kGroupBlockBytes, &q4k::put, &q4k::get>;
using LayoutTQ2_0 = Layout<BlockTQ2_0, tq2::kGroupBlockBytes, &tq2::put, &tq2::get>;

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
