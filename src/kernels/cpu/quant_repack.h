// The row-interleaved ("repacked") layout of Q8_0, Q4_0 and MXFP4 weights, shared by the packed kernels of
// quant_repack_avx512.cpp and quant_repack_avx2.cpp (included like quant_simd.h, after MERLIN_QUANT_LEVEL, so
// each level gets its own copy compiled with its own flags: a copy built with -mavx512f could be
// auto-vectorized into instructions an AVX2 machine lacks). Both levels use the same bytes.
//
// Layout: rows in groups of kRepackRows = 16 (the last group padded with zero rows); per group, per
// 32-element block, the 16 rows' scales (fp16, 32 bytes; MXFP4: the E8M0 bytes, 16 bytes) followed by the
// quants in 64-byte chunks whose 32-bit lane i holds 4 bytes of row i:
//   Q8_0: 8 chunks, chunk u = quants 4u..4u+3, biased to unsigned (xor 0x80);
//   Q4_0, MXFP4: 4 chunks, chunk u = the file's nibble bytes 4u..4u+3 (low nibbles: elements 4u.., high:
//   16 + 4u..); MXFP4's nibbles index the E2M1 table biased by +12 (vpshufb per 128-bit lane).
// A group-block is exactly 16 of the file's blocks, so the copy costs no extra memory. An AVX2 register
// holds half a chunk: rows 0..7 of the group in its first 32 bytes, rows 8..15 in the second. Below the
// layout: the activations as the 32-element-block tiles of both levels read them, and small AVX2 helpers.
#pragma once
#ifndef MERLIN_QUANT_LEVEL
#error "define MERLIN_QUANT_LEVEL before including quant_repack.h"
#endif
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant_formats.h"
#include "kernels/cpu/quant_simd.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

constexpr int kRows = kRepackRows;

// The fp16 scale of Q8_0 and Q4_0.
struct ScaleFp16 {
  static constexpr int kScaleBytes = kRows * 2;
  static constexpr bool kE8m0 = false;
  template <class Block>
  static void put_scale(const Block& b, int row, uint8_t* gb) { __builtin_memcpy(gb + 2 * row, &b.d, 2); }
  template <class Block>
  static void get_scale(const uint8_t* gb, int row, Block& b) { __builtin_memcpy(&b.d, gb + 2 * row, 2); }
};

struct FmtQ8_0 : ScaleFp16 {
  using Block = BlockQ8_0;
  static constexpr int kChunks = 8;
  static constexpr int kBias = 128;
  static constexpr bool kTable = false;
  static void put(const Block& b, int row, uint8_t* gb) {
    put_scale(b, row, gb);
    for (int u = 0; u < kChunks; ++u) {
      uint32_t v;
      __builtin_memcpy(&v, b.qs + 4 * u, 4);
      v ^= 0x80808080u;
      __builtin_memcpy(gb + kScaleBytes + 64 * u + 4 * row, &v, 4);
    }
  }
};

struct FmtQ4_0 : ScaleFp16 {
  using Block = BlockQ4_0;
  static constexpr int kChunks = 4;
  static constexpr int kBias = 8;
  static constexpr bool kTable = false;
  static void put(const Block& b, int row, uint8_t* gb) {
    put_scale(b, row, gb);
    for (int u = 0; u < kChunks; ++u) __builtin_memcpy(gb + kScaleBytes + 64 * u + 4 * row, b.qs + 4 * u, 4);
  }
};

struct FmtMxfp4 {
  using Block = BlockMxfp4;
  static constexpr int kScaleBytes = kRows;
  static constexpr bool kE8m0 = true;
  static constexpr int kChunks = 4;
  static constexpr int kBias = 12;  // kMxfp4Values + 12 is 0..24
  static constexpr bool kTable = true;
  static void put_scale(const Block& b, int row, uint8_t* gb) { gb[row] = b.e; }
  static void get_scale(const uint8_t* gb, int row, Block& b) { b.e = gb[row]; }
  static void put(const Block& b, int row, uint8_t* gb) {
    put_scale(b, row, gb);
    for (int u = 0; u < kChunks; ++u) __builtin_memcpy(gb + kScaleBytes + 64 * u + 4 * row, b.qs + 4 * u, 4);
  }
};

template <class F>
constexpr size_t group_block_bytes() { return F::kScaleBytes + 64 * F::kChunks; }

// Inverse of F::put: row `row` of a group-block back to a file block (Q8_0 quants lose their bias).
template <class F>
void get(const uint8_t* gb, int row, typename F::Block& b) {
  F::get_scale(gb, row, b);
  for (int u = 0; u < F::kChunks; ++u) {
    uint32_t v;
    __builtin_memcpy(&v, gb + F::kScaleBytes + 64 * u + 4 * row, 4);
    if (F::kBias == 128) v ^= 0x80808080u;
    __builtin_memcpy(b.qs + 4 * u, &v, 4);
  }
}
static_assert(group_block_bytes<FmtQ8_0>() == kRows * sizeof(BlockQ8_0));
static_assert(group_block_bytes<FmtQ4_0>() == kRows * sizeof(BlockQ4_0));
static_assert(group_block_bytes<FmtMxfp4>() == kRows * sizeof(BlockMxfp4));

template <class F>
size_t packed_bytes(int64_t rows, int64_t k) {
  return (size_t)((rows + kRows - 1) / kRows) * (size_t)(k / kQK32) * group_block_bytes<F>();
}

template <class F>
void repack(const void* w, size_t w_row_bytes, int64_t rows, int64_t k, void* out) {
  const int64_t nb = k / kQK32, groups = (rows + kRows - 1) / kRows;
  auto* o = static_cast<uint8_t*>(out);
  __builtin_memset(o, 0, packed_bytes<F>(rows, k));  // padded rows: zero scales and quants
  for (int64_t g = 0; g < groups; ++g)
    for (int i = 0; i < kRows && g * kRows + i < rows; ++i) {
      const auto* row = reinterpret_cast<const typename F::Block*>(static_cast<const char*>(w) +
                                                                    (g * kRows + i) * w_row_bytes);
      for (int64_t b = 0; b < nb; ++b) F::put(row[b], i, o + (g * nb + b) * group_block_bytes<F>());
    }
}

template <class F>
void unpack_row(const void* packed, int64_t r, int64_t k, void* out) {
  const int64_t nb = k / kQK32;
  const auto* g = static_cast<const uint8_t*>(packed) + (r / kRows) * nb * group_block_bytes<F>();
  auto* blocks = static_cast<typename F::Block*>(out);
  for (int64_t b = 0; b < nb; ++b) get<F>(g + b * group_block_bytes<F>(), (int)(r % kRows), blocks[b]);
}

// ---- activations, as every 32-element-block tile of both levels reads them ----

// Per block and token: the activation scale, the integer start value -bias * sum(quants), which turns the
// dot product with unsigned (biased) weights back into the signed one, and the block's 32 quants. Block-major
// within each chunk of kTokenChunk tokens ([chunk][block][token of the chunk]), so a tile reaches its tokens'
// values at constant offsets from one pointer per block (with a pointer per token row a 12-token AVX-512 tile
// ran out of general registers) and a chunk's values stay contiguous.
constexpr int64_t kTokenChunk = 64;  // tokens per pass over the row groups: their activations stay in L2

struct ActInfo {
  const float* d;
  const int32_t* start;
  const int8_t* qs;  // 32 per entry
  // Entry of (block b, token t) in a chunk of cl tokens from c0 = t - t % kTokenChunk: c0 * nb + b * cl + t - c0.
};

template <class F>
ActInfo act_info(const char* x, size_t x_row_bytes, int64_t n_tokens, int64_t nb) {
  // Floats: d and start (2 per block and token), then 8 for the 32 quants.
  float* mem = detail::scratch_floats(detail::kScratchWeightRow, (size_t)(10 * n_tokens * nb));
  int32_t* start = reinterpret_cast<int32_t*>(mem + n_tokens * nb);
  int8_t* qs = reinterpret_cast<int8_t*>(mem + 2 * n_tokens * nb);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t c0 = t - t % kTokenChunk, cl = n_tokens - c0 < kTokenChunk ? n_tokens - c0 : kTokenChunk;
    const auto* xb = reinterpret_cast<const BlockQ8_0*>(x + t * x_row_bytes);
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i q = loadu(xb[b].qs);
      const __m256i s8 = dot_u8s8(_mm256_setzero_si256(), ones, q);
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
      const int64_t e = c0 * nb + b * cl + (t - c0);
      mem[e] = half(xb[b].d);
      start[e] = -F::kBias * sum;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qs + e * 32), q);
    }
  }
  return {mem, start, qs};
}

// ---- what the AVX2 tiles share: a ymm holds half a chunk, rows 0..7 or 8..15 of a group ----

constexpr int kHalf = kRows / 2;

inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Both nibbles of 32 bytes as bytes 0..15: low and high.
inline void split_nibbles(__m256i raw, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(raw, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
}

template <int H, int T>
inline void zero_halves(__m256 (&acc)[H][T]) {
#pragma GCC unroll 2
  for (int hh = 0; hh < H; ++hh)
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[hh][t] = _mm256_setzero_ps();
}

// The Q8_K rows of tokens t0 .. t0 + T - 1 (the super-block types' activations).
template <int T>
inline void q8k_rows(const char* x, size_t x_row_bytes, int64_t t0, const BlockQ8_K* (&xr)[T]) {
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) xr[t] = reinterpret_cast<const BlockQ8_K*>(x + (t0 + t) * x_row_bytes);
}

inline __m256i bcast4(const void* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The lines of the group-block `ahead` group-blocks after gw (the hardware prefetcher alone was late for one
// token: quant_repack_avx2.cpp).
template <size_t kBytes, int ahead>
inline void prefetch_ahead(const uint8_t* gw) {
  for (size_t l = 0; l < kBytes; l += 64)
    _mm_prefetch(reinterpret_cast<const char*>(gw) + ahead * kBytes + l, _MM_HINT_T0);
}

// A tile's results, acc[h][t] for rows 8h.. of the tile and token t; left = rows that exist from the tile's
// first row (fewer than 8H only in a matrix's last group).
template <int H, int T>
void store_halves(const __m256 (&acc)[H][T], float* y, int64_t ldy, int64_t left) {
#pragma GCC unroll 2
  for (int hh = 0; hh < H; ++hh) {
    const int64_t n = left - kHalf * hh;
    if (n <= 0) break;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < kHalf ? n : kHalf)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) {
      float* out = y + t * ldy + kHalf * hh;
      if (n >= kHalf)
        _mm256_storeu_ps(out, acc[hh][t]);
      else
        _mm256_maskstore_ps(out, keep, acc[hh][t]);
    }
  }
}

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
