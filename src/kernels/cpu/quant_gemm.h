// Shared by the token-parallel GEMMs (quant_gemm_avx2.cpp, quant_gemm_avx512.cpp; included like
// quant_simd.h): weights unpacked a tile of rows at a time into plain bytes per 32-element block with a
// float scale (and a float min for Q4_K), so one micro-kernel serves every type, and access to the
// activation blocks those kernels repack.
#pragma once
#include "kernels/cpu/quant_simd_k.h"

namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL {
namespace {

// ---- activations ----

// One 32-element block of a token's activation row: its quants, its scale, and (Q8_K, for Q4_K's mins)
// scale * sum of the quants.
struct XBlock {
  const int8_t* q;
  float d, s;
  int32_t sum;
};

inline XBlock x_block(const char* row, int64_t b, bool q8k) {
  if (q8k) {
    const auto& xb = reinterpret_cast<const BlockQ8_K*>(row)[b / 8];
    const int j = (int)(b % 8);
    const int32_t sum = xb.bsums[2 * j] + xb.bsums[2 * j + 1];
    return {xb.qs + 32 * j, xb.d, xb.d * (float)sum, sum};
  }
  const auto& xb = reinterpret_cast<const BlockQ8_0*>(row)[b];
  const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), loadu(xb.qs)), _mm256_set1_epi16(1));
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return {xb.qs, half(xb.d), 0.0f, hsum_epi32(s4)};
}

// ---- weights ----

// One row's 32-element blocks as bytes: q advances by `stride` bytes per block, scale and min by `mstride`.
struct RowOut {
  int8_t* q;
  float* scale;
  float* min;
  int64_t stride, mstride;
  void put(int64_t b, __m256i v, float sc, float mn = 0.0f) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * stride), v);
    scale[b * mstride] = sc;
    min[b * mstride] = mn;
  }
};

// Unpackers write each weight w as the unsigned byte w + bias (GemmFormat::bias).
void unpack_q8_0(const char* row, int64_t n_blocks, const RowOut& o) {
  const auto* w = reinterpret_cast<const BlockQ8_0*>(row);
  for (int64_t b = 0; b < n_blocks; ++b)
    o.put(b, _mm256_xor_si256(loadu(w[b].qs), _mm256_set1_epi8((char)0x80)), half(w[b].d));
}

void unpack_q4_0(const char* row, int64_t n_blocks, const RowOut& o) {
  const auto* w = reinterpret_cast<const BlockQ4_0*>(row);
  for (int64_t b = 0; b < n_blocks; ++b) o.put(b, unpack_nibbles(w[b].qs), half(w[b].d));
}

void unpack_mxfp4(const char* row, int64_t n_blocks, const RowOut& o) {
  const auto* w = reinterpret_cast<const BlockMxfp4*>(row);
  const __m256i table = _mm256_add_epi8(
      _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kMxfp4Values))), _mm256_set1_epi8(12));
  for (int64_t b = 0; b < n_blocks; ++b)
    o.put(b, _mm256_shuffle_epi8(table, unpack_nibbles(w[b].qs)), e8m0_to_f32_half(w[b].e));
}

// Scales and mins multiplied out in float exactly as the dequantizer does (d * sc, dmin * m).
void unpack_q4_k(const char* row, int64_t n_blocks, const RowOut& o) {
  const auto* w = reinterpret_cast<const BlockQ4_K*>(row);
  for (int64_t sb = 0; sb < n_blocks / 8; ++sb) {
    const float d = half(w[sb].d), dmin = half(w[sb].dmin);
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = loadu(w[sb].qs + 32 * c);
#pragma GCC unroll 16
      for (int h = 0; h < 2; ++h) {
        uint8_t sc, m;
        q4k_scale_min(2 * c + h, w[sb].scales, &sc, &m);
        const __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
        o.put(sb * 8 + 2 * c + h, q, d * (float)sc, dmin * (float)m);
      }
    }
  }
}

template <class Block, void (*Unpack)(const Block&, Trits&)>
void unpack_ternary(const char* row, int64_t n_blocks, const RowOut& o) {
  const auto* w = reinterpret_cast<const Block*>(row);
  for (int64_t sb = 0; sb < n_blocks / 8; ++sb) {
    Trits t;
    Unpack(w[sb], t);
    const float d = half(w[sb].d);
#pragma GCC unroll 16
    for (int j = 0; j < 8; ++j) o.put(sb * 8 + j, t.v[j], d);
  }
}

using UnpackFn = void (*)(const char*, int64_t, const RowOut&);

struct GemmFormat {
  UnpackFn unpack = nullptr;
  int bias = 0;      // unpacked byte = weight + bias
  int max_byte = 0;  // largest unpacked byte (bounds int16 accumulation in maddubs kernels)
  bool q8k = false;  // activations are Q8_K (else Q8_0)
  bool min = false;  // Q4_K: subtract min * (d * sum(x)) per block
};

inline GemmFormat gemm_format(DType type) {
  switch (type) {
    case DType::Q8_0: return {&unpack_q8_0, 128, 255, false, false};
    case DType::Q4_0: return {&unpack_q4_0, 8, 15, false, false};
    case DType::MXFP4: return {&unpack_mxfp4, 12, 24, false, false};
    case DType::Q4_K: return {&unpack_q4_k, 0, 15, true, true};
    case DType::TQ1_0: return {&unpack_ternary<BlockTQ1_0, unpack_tq1_0>, 1, 2, true, false};
    case DType::TQ2_0: return {&unpack_ternary<BlockTQ2_0, unpack_tq2_0>, 1, 2, true, false};
    default: return {};
  }
}

// R rows of one tile: per 32-element block, R x 32 bytes, then per row a start value, scale and min.
template <int R>
struct WTile {
  int8_t* q;       // [block][R][32]
  int32_t* start;  // [block][R] (kSigned tiles): -128 * sum of the block's signed weights
  float* scale;    // [block][R]
  float* min;      // [block][R]

  static size_t floats(int64_t n_blocks) { return (size_t)n_blocks * R * (32 / 4 + 3); }
  static WTile at(float* mem, int64_t n_blocks) {
    WTile t;
    t.q = reinterpret_cast<int8_t*>(mem);
    t.start = reinterpret_cast<int32_t*>(mem + n_blocks * R * 8);
    t.scale = mem + n_blocks * R * 9;
    t.min = mem + n_blocks * R * 10;
    return t;
  }
};

// Unpacks rows [r, r + R) (rows at or past r_end become zero weights). kSigned tiles hold the signed
// weights and their start values (for kernels that bias the activations instead); otherwise the tile keeps
// the unpacked unsigned bytes.
template <int R, bool kSigned>
void fill_tile(const GemmFormat& f, const char* w, size_t w_row_bytes, int64_t r, int64_t r_end, int64_t n_blocks,
               const WTile<R>& t) {
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    const RowOut o{t.q + 32 * i, t.scale + i, t.min + i, R * 32, R};
    if (r + i < r_end) {
      f.unpack(w + (r + i) * w_row_bytes, n_blocks, o);
    } else {
      for (int64_t b = 0; b < n_blocks; ++b) o.put(b, _mm256_set1_epi8((char)f.bias), 0.0f);
    }
  }
  if (!kSigned) return;
  for (int64_t b = 0; b < n_blocks; ++b)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      int8_t* q = t.q + (b * R + i) * 32;
      const __m256i v = _mm256_sub_epi8(loadu(q), _mm256_set1_epi8((char)f.bias));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v);
      // sum(v) from byte sums of v + 128 (sad against zero).
      const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)), _mm256_setzero_si256());
      const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      const int64_t sum = _mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1) - 32 * 128;
      t.start[b * R + i] = (int32_t)(-128 * sum);
    }
}

// Rows per chunk: a chunk's unpacked weights (~k bytes a row) stay in L2 while every token group passes.
template <int R>
int64_t rows_per_chunk(int64_t k) {
  const int64_t c = 256 * 1024 / k;
  return (c < R ? R : c > 64 ? 64 : c) / R * R;
}

// Copies one group's [R][lanes] result into y, skipping padded rows and tokens.
template <int R, int kLanes>
void store_group(const float (*res)[kLanes], float* y, int64_t ldy, int64_t n_tokens, int64_t r, int64_t r_end,
                 int64_t g) {
  for (int t = 0; t < kLanes; ++t) {
    const int64_t tok = g * kLanes + t;
    if (tok >= n_tokens) return;
    float* yt = y + tok * ldy + r;
    for (int i = 0; i < R && r + i < r_end; ++i) yt[i] = res[i][t];
  }
}

}  // namespace
}  // namespace merlin::kernels::quant::MERLIN_QUANT_LEVEL
