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
// holds half a chunk: rows 0..7 of the group in its first 32 bytes, rows 8..15 in the second.
#pragma once
#ifndef MERLIN_QUANT_LEVEL
#error "define MERLIN_QUANT_LEVEL before including quant_repack.h"
#endif
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant_formats.h"

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

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
