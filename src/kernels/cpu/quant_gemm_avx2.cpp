// AVX2 GEMM for many tokens (prefill) of the types whose unpacked weights are small unsigned bytes
// (Q4_0, MXFP4, Q4_K, TQ1_0, TQ2_0; Q8_0 keeps the dot-product tiles).
//
// The 8 lanes of a ymm hold 8 tokens. Activations are repacked once per call so that one 32-byte load gives
// 4 consecutive signed quants of one block for 8 tokens; the weights, unpacked to unsigned bytes w + bias,
// are broadcast 4 at a time, and maddubs multiplies them in. Weights of at most 15 keep 8 steps of maddubs
// sums inside int16 (2 * 15 * 127 * 8 < 2^15), so a block costs one madd per (row, 8 tokens) besides the
// maddubs; the bias comes back as -bias * sum(x) per token and block, the accumulator's start.
#define MERLIN_QUANT_LEVEL avx2
#include "kernels/cpu/quant_gemm.h"
#include "kernels/cpu/quant_impl.h"

namespace merlin::kernels::quant::avx2 {
namespace {

constexpr int kLanes = 8;
constexpr int kGroupBlockBytes = 8 * 32;

struct PackedX {
  const int8_t* q;       // [group][block][8][8 tokens x 4 bytes]
  const int32_t* start;  // [group][block][8]: -bias * sum of the token's block quants
  const float* d;        // [group][block][8]
  const float* s;        // [group][block][8]: d * sum (Q8_K only)
  int64_t n_groups, n_blocks;
};

PackedX pack_x(const void* x, size_t x_row_bytes, int64_t n_tokens, int64_t k, const GemmFormat& f) {
  const int64_t n_groups = (n_tokens + kLanes - 1) / kLanes, n_blocks = k / 32;
  const size_t blocks = (size_t)(n_groups * n_blocks);
  float* mem = detail::scratch_floats(detail::kScratchWeightRow, blocks * (kGroupBlockBytes / 4 + 3 * kLanes));
  auto* q = reinterpret_cast<int8_t*>(mem);
  auto* start = reinterpret_cast<int32_t*>(mem + blocks * kGroupBlockBytes / 4);
  float* d = mem + blocks * (kGroupBlockBytes / 4 + kLanes);
  float* s = d + blocks * kLanes;
  const int8_t zeros[32] = {};
  for (int64_t g = 0; g < n_groups; ++g)
    for (int t = 0; t < kLanes; ++t) {
      const int64_t tok = g * kLanes + t;
      const char* row = static_cast<const char*>(x) + tok * x_row_bytes;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t gb = g * n_blocks + b;
        const XBlock xb = tok < n_tokens ? x_block(row, b, f.q8k) : XBlock{zeros, 0.0f, 0.0f, 0};
        for (int i = 0; i < 8; ++i) __builtin_memcpy(q + gb * kGroupBlockBytes + 32 * i + 4 * t, xb.q + 4 * i, 4);
        start[gb * kLanes + t] = -f.bias * xb.sum;
        d[gb * kLanes + t] = xb.d;
        s[gb * kLanes + t] = xb.s;
      }
    }
  return {q, start, d, s, n_groups, n_blocks};
}

// R rows x 8 tokens over blocks [b0, b1), continuing from out when b0 > 0. kSplit: weights up to 24
// (MXFP4) widen the int16 sums after 4 steps instead of 8.
template <int R, bool kMin, bool kSplit>
void micro(const WTile<R>& w, const PackedX& x, int64_t g, int64_t b0, int64_t b1, float (*out)[kLanes]) {
  __m256 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = b0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out[i]);
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t nb = x.n_blocks;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t gb = g * nb + b;
    const int8_t* xq = x.q + gb * kGroupBlockBytes;
    const int8_t* wq = w.q + b * R * 32;
    __m256i s32[R], s16[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) s32[i] = loadu(x.start + gb * kLanes), s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      if (kSplit && u == 4) {
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          s32[i] = _mm256_add_epi32(s32[i], _mm256_madd_epi16(s16[i], ones));
          s16[i] = _mm256_setzero_si256();
        }
      }
      const __m256i xv = loadu(xq + 32 * u);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        int32_t word;
        __builtin_memcpy(&word, wq + i * 32 + 4 * u, 4);
        s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(_mm256_set1_epi32(word), xv));
      }
    }
    const __m256 dx = _mm256_loadu_ps(x.d + gb * kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m256i sum = _mm256_add_epi32(s32[i], _mm256_madd_epi16(s16[i], ones));
      const __m256 sc = _mm256_mul_ps(dx, _mm256_set1_ps(w.scale[b * R + i]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, acc[i]);
    }
    if constexpr (kMin) {
      const __m256 xs = _mm256_loadu_ps(x.s + gb * kLanes);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = _mm256_fnmadd_ps(_mm256_set1_ps(w.min[b * R + i]), xs, acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(out[i], acc[i]);
}

// Blocks per k-step: a group's 8 tokens x 64 blocks of activations (16 KB) stay in L1.
constexpr int64_t kKBlocks = 64;

template <int R, bool kMin, bool kSplit>
void gemm_impl(const GemmFormat& f, MERLIN_MATMUL_ARGS) {
  const PackedX px = pack_x(x, x_row_bytes, n_tokens, k, f);
  const int64_t nb = k / 32, ng = px.n_groups;
  const int64_t chunk = rows_per_chunk<R>(k), tiles_per_chunk = chunk / R;
  const size_t tile_floats = WTile<R>::floats(nb), res_floats = (size_t)(tiles_per_chunk * ng) * R * kLanes;
  float* mem = detail::scratch_floats(detail::kScratchPackedW, tile_floats * (size_t)tiles_per_chunk + res_floats);
  auto* res = reinterpret_cast<float(*)[R][kLanes]>(mem + tile_floats * (size_t)tiles_per_chunk);  // [tile][group]
  auto tile = [&](int64_t ti) { return WTile<R>::at(mem + ti * tile_floats, nb); };
  for (int64_t rc = r0; rc < r1; rc += chunk) {
    const int64_t n_tiles = ((r1 - rc < chunk ? r1 - rc : chunk) + R - 1) / R;
    for (int64_t ti = 0; ti < n_tiles; ++ti)
      fill_tile<R, false>(f, static_cast<const char*>(w), w_row_bytes, rc + ti * R, r1, nb, tile(ti));
    for (int64_t b0 = 0; b0 < nb; b0 += kKBlocks) {
      const int64_t b1 = nb - b0 < kKBlocks ? nb : b0 + kKBlocks;
      for (int64_t g = 0; g < ng; ++g)
        for (int64_t ti = 0; ti < n_tiles; ++ti) micro<R, kMin, kSplit>(tile(ti), px, g, b0, b1, res[ti * ng + g]);
    }
    for (int64_t ti = 0; ti < n_tiles; ++ti)
      for (int64_t g = 0; g < ng; ++g) store_group<R, kLanes>(res[ti * ng + g], y, ldy, n_tokens, rc + ti * R, r1, g);
  }
}

constexpr int kR = 4;

}  // namespace

bool gemm(DType type, MERLIN_MATMUL_ARGS) {
  const GemmFormat f = gemm_format(type);
  if (f.unpack == nullptr || f.max_byte > 24) return false;  // Q8_0's biased bytes would saturate maddubs
  if (f.min) {
    gemm_impl<kR, true, false>(f, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
  } else if (f.max_byte > 15) {
    gemm_impl<kR, false, true>(f, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
  } else {
    gemm_impl<kR, false, false>(f, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
  }
  return true;
}

}  // namespace merlin::kernels::quant::avx2
