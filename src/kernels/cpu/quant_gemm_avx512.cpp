// AVX-512 VNNI GEMM for many tokens (prefill), shared by every quantized type.
//
// The 16 lanes of a zmm hold 16 tokens. Activations are repacked once per call so that one 64-byte load
// gives 4 consecutive quants of one 32-element block for 16 tokens (biased to unsigned by +128); weights are
// unpacked, a chunk of rows at a time, to plain int8 per 32-element block with a float scale (and a float
// min for Q4_K). Then one vpdpbusd with a broadcast 4-byte weight group does 64 multiply-adds, and the
// per-block scaling costs one convert and one multiply-add per 16 tokens and 32 elements, so the inner loop
// is almost pure vpdpbusd. The +128 bias comes back as -128 * sum(w) per block, the accumulator's start.
#define MERLIN_QUANT_LEVEL avx512
#include "kernels/cpu/quant_gemm.h"
#include "kernels/cpu/quant_impl.h"

namespace merlin::kernels::quant::avx512 {
namespace {

constexpr int kLanes = 16;  // tokens per group
constexpr int kGroupBlockBytes = 8 * 64;  // one 32-element block of a token group

struct PackedX {
  const uint8_t* q;  // [group][block][8][16 tokens x 4 bytes], unsigned (x + 128)
  const float* d;    // [group][block][16]: the token's scale for the block
  const float* s;    // [group][block][16]: d * sum of the block's quants (Q8_K only)
  int64_t n_groups, n_blocks;
};

inline void put_block(uint8_t* q, int t, const int8_t* src) {
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    uint32_t w;
    __builtin_memcpy(&w, src + 4 * i, 4);
    w ^= 0x80808080u;
    __builtin_memcpy(q + 64 * i + 4 * t, &w, 4);
  }
}

PackedX pack_x(const void* x, size_t x_row_bytes, int64_t n_tokens, int64_t k, bool q8k) {
  const int64_t n_groups = (n_tokens + kLanes - 1) / kLanes, n_blocks = k / 32;
  const size_t blocks = (size_t)(n_groups * n_blocks);
  float* mem = detail::scratch_floats(detail::kScratchWeightRow, blocks * (kGroupBlockBytes / 4 + 2 * kLanes));
  auto* q = reinterpret_cast<uint8_t*>(mem);
  float* d = mem + blocks * kGroupBlockBytes / 4;
  float* s = d + blocks * kLanes;
  const int8_t zeros[32] = {};
  for (int64_t g = 0; g < n_groups; ++g)
    for (int t = 0; t < kLanes; ++t) {
      const int64_t tok = g * kLanes + t;
      const char* row = static_cast<const char*>(x) + tok * x_row_bytes;
      for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t gb = g * n_blocks + b;
        const XBlock xb = tok < n_tokens ? x_block(row, b, q8k) : XBlock{zeros, 0.0f, 0.0f, 0};
        put_block(q + gb * kGroupBlockBytes, t, xb.q);
        d[gb * kLanes + t] = xb.d;
        s[gb * kLanes + t] = xb.s;
      }
    }
  return {q, d, s, n_groups, n_blocks};
}

// ---- micro-kernel: R rows x G groups of 16 tokens over blocks [b0, b1) ----

// out[g][i] holds 16 tokens' partial sums of row i; they start at zero when b0 == 0, else where the
// previous range of blocks left them.
template <int R, int G, bool kMin>
void micro(const WTile<R>& w, const PackedX& x, int64_t g0, int64_t b0, int64_t b1, float (*out)[R][kLanes]) {
  __m512 acc[R][G];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) acc[i][g] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out[g][i]);
  const int64_t nb = x.n_blocks;
  for (int64_t b = b0; b < b1; ++b) {
    __m512i sum[R][G];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) sum[i][g] = _mm512_set1_epi32(w.start[b * R + i]);
    const int8_t* wq = w.q + b * R * 32;
#pragma GCC unroll 16
    for (int u = 0; u < 8; ++u) {
      __m512i xv[G];
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) xv[g] = _mm512_loadu_si512(x.q + ((g0 + g) * nb + b) * kGroupBlockBytes + 64 * u);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        int32_t word;
        __builtin_memcpy(&word, wq + i * 32 + 4 * u, 4);
        const __m512i wv = _mm512_set1_epi32(word);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) sum[i][g] = _mm512_dpbusd_epi32(sum[i][g], xv[g], wv);
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const __m512 dx = _mm512_loadu_ps(x.d + ((g0 + g) * nb + b) * kLanes);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512 s = _mm512_mul_ps(dx, _mm512_set1_ps(w.scale[b * R + i]));
        acc[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i][g]), s, acc[i][g]);
      }
      if constexpr (kMin) {
        const __m512 xs = _mm512_loadu_ps(x.s + ((g0 + g) * nb + b) * kLanes);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) acc[i][g] = _mm512_fnmadd_ps(_mm512_set1_ps(w.min[b * R + i]), xs, acc[i][g]);
      }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) _mm512_storeu_ps(out[g][i], acc[i][g]);
}

// Blocks per k-step: a group's 16 tokens x 32 blocks of activations (16 KB) stay in L1 while every tile
// of the row chunk passes over them.
constexpr int64_t kKBlocks = 32;

template <int R, int G, bool kMin>
void gemm_impl(const GemmFormat& f, MERLIN_MATMUL_ARGS) {
  const PackedX px = pack_x(x, x_row_bytes, n_tokens, k, f.q8k);
  const int64_t nb = k / 32, ng = px.n_groups;
  const int64_t chunk = rows_per_chunk<R>(k), tiles_per_chunk = chunk / R;
  const size_t tile_floats = WTile<R>::floats(nb), res_floats = (size_t)(tiles_per_chunk * ng) * R * kLanes;
  float* mem = detail::scratch_floats(detail::kScratchPackedW, tile_floats * (size_t)tiles_per_chunk + res_floats);
  auto* res = reinterpret_cast<float(*)[R][kLanes]>(mem + tile_floats * (size_t)tiles_per_chunk);  // [tile][group]
  auto tile = [&](int64_t ti) { return WTile<R>::at(mem + ti * tile_floats, nb); };
  for (int64_t rc = r0; rc < r1; rc += chunk) {
    const int64_t n_tiles = ((r1 - rc < chunk ? r1 - rc : chunk) + R - 1) / R;
    for (int64_t ti = 0; ti < n_tiles; ++ti)
      fill_tile<R, true>(f, static_cast<const char*>(w), w_row_bytes, rc + ti * R, r1, nb, tile(ti));
    for (int64_t b0 = 0; b0 < nb; b0 += kKBlocks) {
      const int64_t b1 = nb - b0 < kKBlocks ? nb : b0 + kKBlocks;
      int64_t g0 = 0;
      for (; g0 + G <= ng; g0 += G)
        for (int64_t ti = 0; ti < n_tiles; ++ti) micro<R, G, kMin>(tile(ti), px, g0, b0, b1, res + ti * ng + g0);
      for (; g0 < ng; ++g0)
        for (int64_t ti = 0; ti < n_tiles; ++ti) micro<R, 1, kMin>(tile(ti), px, g0, b0, b1, res + ti * ng + g0);
    }
    for (int64_t ti = 0; ti < n_tiles; ++ti)
      for (int64_t g = 0; g < ng; ++g) store_group<R, kLanes>(res[ti * ng + g], y, ldy, n_tokens, rc + ti * R, r1, g);
  }
}

constexpr int kR = 8, kG = 1;

}  // namespace

bool gemm(DType type, MERLIN_MATMUL_ARGS) {
  const GemmFormat f = gemm_format(type);
  if (f.unpack == nullptr) return false;
  if (f.min) {
    gemm_impl<kR, kG, true>(f, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
  } else {
    gemm_impl<kR, kG, false>(f, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
  }
  return true;
}

}  // namespace merlin::kernels::quant::avx512
