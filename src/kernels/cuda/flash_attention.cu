// Tiled tensor-core attention for prefill-sized steps over an f16 (or Q8_0, dequantized to f16 as the rows
// are staged) paged K/V cache (ops.h, flash_attention).
//
// One CTA of 4 warps takes a tile of up to 64 query tokens that belong to one sequence at consecutive
// positions (a run of a prompt, cut by make_attention_tiles) and one query head. It walks the sequence's
// cached positions in blocks of 64: the block's K and V rows are copied to shared memory once for all 64
// queries (instead of once per query, as the per-token kernel in attention.cu reads them), each warp computes
// its 16 queries' scores with mma.sync m16n8k16 (f16 inputs, f32 accumulation), keeps a running maximum and
// sum per query (online softmax, FlashAttention-2's recurrence), and accumulates P V with a second mma whose
// A operand is the score accumulator re-packed to f16 in registers. Blocks that lie entirely after a warp's
// last query are skipped (causal mask).
//
// Numerics follow the per-token kernel: q is rounded to f16 (the CPU's and llama.cpp's f16-cache path does
// the same), scores are scaled by 1/sqrt(head size) in f32, and the softmax weights are rounded to f16 before
// they multiply V. They differ in that the weights are exp(s - running max) rounded to f16 and divided by
// the sum at the end, instead of the normalised weight rounded to f16: a relative difference of order 2^-11.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

constexpr int kQTile = 64;   // queries per CTA (16 per warp)
constexpr int kKBlock = 64;  // cached positions per block
constexpr int kFaWarps = kQTile / 16;

__device__ __forceinline__ int64_t slot_of(const KvArgs& kv, int seq, int pos) {
  return (int64_t)kv.d_table[(int64_t)seq * kv.max_blocks + pos / kv.block_size] * kv.block_size + pos % kv.block_size;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B operand (k16 x n8) of m16n8k16 from a row-major [n][k] tile in shared memory (K: [position][dim]).
// Elements off .. off + 7 of a Q8_0 cache (codes, f16 scale per 32) as 8 halves of scale x code.
__device__ __forceinline__ uint4 q8_halves(const void* codes, const void* scales, int64_t off) {
  const uint2 c = *reinterpret_cast<const uint2*>(static_cast<const int8_t*>(codes) + off);
  const float d = __half2float(static_cast<const __half*>(scales)[off >> 5]);
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t word = j < 2 ? c.x : c.y;
    const float a = (float)(int8_t)((word >> (16 * (j & 1))) & 0xFF) * d;
    const float b = (float)(int8_t)((word >> (16 * (j & 1) + 8)) & 0xFF) * d;
    const __half2 h = __floats2half2_rn(a, b);
    w[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ void ldmatrix_x2(uint32_t& b0, uint32_t& b1, const __half* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(a));
}
// The same from a row-major [k][n] tile (V: [position][dim]), transposed on the way.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& b0, uint32_t& b1, const __half* p) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(a));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <int D>
__global__ void __launch_bounds__(kFaWarps * 32) flash_attention_kernel(const float* qkv, int64_t ld,
                                                                        const AttnTile* tiles, int n_heads,
                                                                        int n_kv_heads, KvArgs kv, float* out) {
  constexpr int kStride = D + 8;  // padded rows: 16-byte aligned and free of ldmatrix bank conflicts
  __shared__ __align__(16) __half ks[kKBlock * kStride];
  __shared__ __align__(16) __half vs[kKBlock * kStride];
  pdl_trigger();
  pdl_wait();
  const AttnTile tile = tiles[blockIdx.x];
  const int h = blockIdx.y, kvh = h / (n_heads / n_kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t kv_dim = (int64_t)n_kv_heads * D, head_off = (int64_t)kvh * D;
  const int last_pos = tile.pos0 + tile.count - 1;
  // Rows r0 = 16 warp + g and r1 = r0 + 8 of the tile. Rows past the tile's count compute as its last query
  // (finite results, never written).
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  const int q0 = tile.pos0 + min(r0, tile.count - 1), q1 = tile.pos0 + min(r1, tile.count - 1);
  const int warp_last = tile.pos0 + min(warp * 16 + 15, tile.count - 1);
  const bool idle = warp * 16 >= tile.count;  // a short tile's spare warps only help with the copies

  // q rows as A operands, rounded to f16.
  uint32_t qa[D / 16][4];
  {
    const float* qr0 = qkv + (int64_t)(tile.first + min(r0, tile.count - 1)) * ld + (int64_t)h * D;
    const float* qr1 = qkv + (int64_t)(tile.first + min(r1, tile.count - 1)) * ld + (int64_t)h * D;
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const int c = s * 16 + 2 * t;
      qa[s][0] = pack_half2(qr0[c], qr0[c + 1]);
      qa[s][1] = pack_half2(qr1[c], qr1[c + 1]);
      qa[s][2] = pack_half2(qr0[c + 8], qr0[c + 9]);
      qa[s][3] = pack_half2(qr1[c + 8], qr1[c + 9]);
    }
  }
  const float scale = 1.0f / sqrtf((float)D);
  float o[D / 8][4];
#pragma unroll
  for (int d = 0; d < D / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  for (int kb = 0; kb * kKBlock <= last_pos; ++kb) {
    const int p_base = kb * kKBlock;
    __syncthreads();  // the previous block's K/V are no longer read
    for (int c = threadIdx.x; c < kKBlock * (D / 8); c += kFaWarps * 32) {
      const int r = c / (D / 8), cc = c % (D / 8), p = p_base + r;
      uint4 kval = make_uint4(0, 0, 0, 0), vval = kval;
      if (p <= last_pos) {  // positions past the tile's last query may lie in unmapped blocks
        const int64_t off = slot_of(kv, tile.seq, p) * kv_dim + head_off + cc * 8;
        if (kv.q8) {
          kval = q8_halves(kv.d_k, kv.d_ks, off);
          vval = q8_halves(kv.d_v, kv.d_vs, off);
        } else {
          kval = *reinterpret_cast<const uint4*>(static_cast<const __half*>(kv.d_k) + off);
          vval = *reinterpret_cast<const uint4*>(static_cast<const __half*>(kv.d_v) + off);
        }
      }
      *reinterpret_cast<uint4*>(ks + r * kStride + cc * 8) = kval;
      *reinterpret_cast<uint4*>(vs + r * kStride + cc * 8) = vval;
    }
    __syncthreads();
    if (idle || p_base > warp_last) continue;  // every query of this warp precedes the block

    // Scores of the warp's 16 queries against the block's 64 positions: 8 tiles of 8 positions.
    float sc[kKBlock / 8][4];
#pragma unroll
    for (int nt = 0; nt < kKBlock / 8; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.f;
      const int row = nt * 8 + (lane & 7);
#pragma unroll
      for (int s = 0; s < D / 16; ++s) {
        uint32_t b0, b1;
        ldmatrix_x2(b0, b1, ks + row * kStride + s * 16 + ((lane >> 3) & 1) * 8);
        mma_f16(sc[nt], qa[s], b0, b1);
      }
    }
    // Scale, causal mask, running maximum of rows r0 (values 0, 1) and r1 (values 2, 3).
    float bm0 = -INFINITY, bm1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKBlock / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int p = p_base + nt * 8 + 2 * t + (i & 1);
        const float v = (p <= (i < 2 ? q0 : q1)) ? sc[nt][i] * scale : -INFINITY;
        sc[nt][i] = v;
        if (i < 2) bm0 = fmaxf(bm0, v);
        else bm1 = fmaxf(bm1, v);
      }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      bm0 = fmaxf(bm0, __shfl_xor_sync(0xffffffffu, bm0, off));
      bm1 = fmaxf(bm1, __shfl_xor_sync(0xffffffffu, bm1, off));
    }
    // Position 0 is in every row's first block, so the running maximum is finite from the first block on.
    const float nm0 = fmaxf(m0, bm0), nm1 = fmaxf(m1, bm1);
    const float c0 = expf(m0 - nm0), c1 = expf(m1 - nm1);
    m0 = nm0;
    m1 = nm1;
    l0 *= c0;
    l1 *= c1;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d][0] *= c0;
      o[d][1] *= c0;
      o[d][2] *= c1;
      o[d][3] *= c1;
    }
    // P = exp(s - m) rounded to f16 (the sum uses the rounded values, so the final division normalises
    // exactly the weights that multiplied V), then O += P V in 16-position k-steps.
#pragma unroll
    for (int j = 0; j < kKBlock / 16; ++j) {
      uint32_t pa[4];
      float e[2][4];
#pragma unroll
      for (int u = 0; u < 2; ++u)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float x = expf(sc[2 * j + u][i] - (i < 2 ? m0 : m1));
          e[u][i] = __half2float(__float2half_rn(x));
        }
      l0 += e[0][0] + e[0][1] + e[1][0] + e[1][1];
      l1 += e[0][2] + e[0][3] + e[1][2] + e[1][3];
      pa[0] = pack_half2(e[0][0], e[0][1]);
      pa[1] = pack_half2(e[0][2], e[0][3]);
      pa[2] = pack_half2(e[1][0], e[1][1]);
      pa[3] = pack_half2(e[1][2], e[1][3]);
      const int vrow = j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        uint32_t b0, b1;
        ldmatrix_x2_trans(b0, b1, vs + vrow * kStride + d * 8);
        mma_f16(o[d], pa, b0, b1);
      }
    }
  }
  // Each lane summed its own columns: the row sums meet across the quad.
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const float i0 = 1.0f / l0, i1 = 1.0f / l1;
  const int64_t out_ld = (int64_t)n_heads * D;
#pragma unroll
  for (int d = 0; d < D / 8; ++d) {
    const int col = h * D + d * 8 + 2 * t;
    if (r0 < tile.count)
      *reinterpret_cast<float2*>(out + (int64_t)(tile.first + r0) * out_ld + col) = make_float2(o[d][0] * i0, o[d][1] * i0);
    if (r1 < tile.count)
      *reinterpret_cast<float2*>(out + (int64_t)(tile.first + r1) * out_ld + col) = make_float2(o[d][2] * i1, o[d][3] * i1);
  }
}

}  // namespace

int make_attention_tiles(const int32_t* pos, const int32_t* seq, int n, AttnTile* out) {
  int n_tiles = 0;
  for (int i = 0; i < n;) {
    int j = i + 1;
    while (j < n && j - i < kQTile && seq[j] == seq[i] && pos[j] == pos[j - 1] + 1) ++j;
    out[n_tiles++] = AttnTile{i, j - i, seq[i], pos[i]};
    i = j;
  }
  return n_tiles;
}

bool flash_attention_supported(int head_dim, const KvArgs& kv) {
  return (kv.f16 || kv.q8) && (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

void flash_attention(const float* d_qkv, int64_t ld, const AttnTile* d_tiles, int n_tiles, int n_heads, int n_kv_heads,
                     int head_dim, const KvArgs& kv, float* d_out, Stream stream) {
  if (n_tiles <= 0) return;
  MERLIN_CHECK(flash_attention_supported(head_dim, kv), "flash attention: unsupported head size or K/V type");
  const dim3 grid((unsigned)n_tiles, (unsigned)n_heads);
  switch (head_dim) {
    case 32: launch_pdl(flash_attention_kernel<32>, grid, kFaWarps * 32, 0, stream, d_qkv, ld, d_tiles, n_heads, n_kv_heads, kv, d_out); break;
    case 64: launch_pdl(flash_attention_kernel<64>, grid, kFaWarps * 32, 0, stream, d_qkv, ld, d_tiles, n_heads, n_kv_heads, kv, d_out); break;
    default: launch_pdl(flash_attention_kernel<128>, grid, kFaWarps * 32, 0, stream, d_qkv, ld, d_tiles, n_heads, n_kv_heads, kv, d_out); break;
  }
  check_launch("flash attention");
}

}  // namespace merlin::cuda
