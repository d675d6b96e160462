// Device code of the single-token products (matvec1.cu describes the design): the kernel, its epilogues and
// its work walk, for one token or, with NT > 1, for 2-4 tokens of a decode step at once (matvec1_few.cu).
// With NT tokens the weights of a round are loaded once and multiplied by each token's staged row (NT dp4a
// sums per weight word), so a step of a few tokens streams the weights once, as a one-token step does. Token
// t's rows: input at x + t * k (row planes), output at y + t * ldy, deferred norm sums at rms_part + t * k / 32,
// SwiGLU source at glu_src + t * glu_ld, staged at smem + t * x_stride. NT = 1 is the original kernel (every
// per-token loop has one trip and every token offset is 0). Included by matvec1.cu only.
#pragma once
#include <cstdint>

#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/matvec1_rounds.cuh"
#include "kernels/cuda/matvec1_stage.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope_kv.cuh"

namespace merlin::cuda {
namespace {


// Where a warp is in its (tile group, round) sequence; every warp of the CTA walks the same number of items,
// so the per-group reduction (a CTA barrier) comes at the same item for all.
struct Cursor {
  int grp, r;  // group index (global) and round
};

// The next RMSNorm's input from 32 consecutive final rows y (one per lane, row = the lane's row), with a
// deferred scale (norm_block); a single-token reader completes it in stage_x (deferred_rms).
// Token tt's rows follow token 0's (norm_out.k codes, norm_out.k / 32 blocks each).
__device__ __forceinline__ void emit_norm(const Mv1Args& p, int tt, int64_t row, float y, float w) {
  const NormBlock b = norm_block(y, w);
  const int64_t kb = p.norm_out.k / 32, blk = tt * kb + row / 32;
  p.norm_out.q[tt * p.norm_out.k + row] = (int8_t)b.q;
  if ((threadIdx.x & 31) == 0) {
    p.norm_out.scale[blk] = b.scale;
    p.norm_out.sum[blk] = b.sum;
    p.norm_part[blk] = b.sum_sq;
  }
}

template <int R>
__device__ __forceinline__ bool rope_rows(const Mv1Args& p) { return R == 1 || (R == 2 && p.rope_on); }

// The 4 lanes of a row: xor shuffles give every lane the same sum (float addition is commutative).
template <int NT>
__device__ __forceinline__ void quad_sums(float (&acc0)[NT], float (&acc1)[NT]) {
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    acc0[tt] += __shfl_xor_sync(0xffffffffu, acc0[tt], 1);
    acc1[tt] += __shfl_xor_sync(0xffffffffu, acc1[tt], 1);
    acc0[tt] += __shfl_xor_sync(0xffffffffu, acc0[tt], 2);
    acc1[tt] += __shfl_xor_sync(0xffffffffu, acc1[tt], 2);
  }
}

// Each token's row sums of the warp into its slots of the (per-group) reduction buffer, then a CTA barrier.
template <int NT>
__device__ __forceinline__ void sums_to_red(int warp, int lane, const float (&acc0)[NT], const float (&acc1)[NT],
                                            float (*red)[16]) {
  if ((lane & 3) == 0) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      red[warp * NT + tt][lane >> 2] = acc0[tt];
      red[warp * NT + tt][(lane >> 2) + 8] = acc1[tt];
    }
  }
  __syncthreads();
}

// Adds the S warps' row sums of the tile group in a fixed order and writes (or adds) the outputs.
// With rope_on, row r goes through rope_store with its pair partner r ^ 1 (same tile): lane ^ 4 holds it
// when a warp owns the tile, thread ^ 1 after the shared-memory reduction.
// With `early`, res0 / res1 hold the rows' previous values (prefetch_residual), read before the group's
// work instead of after it: the same sums, one memory round trip less at the end of a decode step's kernel.
// Norm: S >= 2 (the host sees to it), so whole warps hold 32 consecutive rows, one Q8_0 block of the next
// RMSNorm's input, which emit_norm writes from the rows' final values (nw: the thread's row's norm weight).
// Argmax: `best` is the largest key of the rows this thread wrote. R: the rows go through rope_store never
// (0), always (1, the RoPE instance) or when p.rope_on says so (2, instances with kRunRope).
template <bool Norm, int W, bool Argmax, int R, int NT>
__device__ __forceinline__ void finish_group(const Mv1Args& p, int grp, int warp, int lane, float (&acc0)[NT],
                                             float (&acc1)[NT], float (*red)[16], const RopeTarget (&at)[NT],
                                             bool early, const float (&res0)[NT], const float (&res1)[NT], float nw,
                                             unsigned long long (&best)[NT]) {
  quad_sums(acc0, acc1);
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
  constexpr bool kStore = !Argmax || NT == 1;  // the 2-4-token head keeps only its keys (matmul_argmax's contract)
  if (!Norm && S == 1) {  // a warp owns its tile: no barrier needed
    const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      float* y = p.y + tt * p.ldy;
      if (rope_rows<R>(p)) {
        const float w0 = __shfl_xor_sync(0xffffffffu, acc0[tt], 4), w1 = __shfl_xor_sync(0xffffffffu, acc1[tt], 4);
        if ((lane & 3) == 0 && r0 < p.n_out) rope_store(p.rope, y, r0, acc0[tt], w0, at[tt]);
        if ((lane & 3) == 0 && r0 + 8 < p.n_out) rope_store(p.rope, y, r0 + 8, acc1[tt], w1, at[tt]);
        continue;
      }
      if ((lane & 3) == 0) {
        if (kStore && r0 < p.n_out) y[r0] = p.accumulate ? (early ? res0[tt] : y[r0]) + acc0[tt] : acc0[tt];
        if (kStore && r0 + 8 < p.n_out) y[r0 + 8] = p.accumulate ? (early ? res1[tt] : y[r0 + 8]) + acc1[tt] : acc1[tt];
        if constexpr (Argmax) {  // not accumulating (the host sees to it)
          if (r0 < p.n_out) best[tt] = max(best[tt], argmax_key(acc0[tt], r0));
          if (r0 + 8 < p.n_out) best[tt] = max(best[tt], argmax_key(acc1[tt], r0 + 8));
        }
      }
    }
    return;
  }
  sums_to_red(warp, lane, acc0, acc1, red);
  const int n_act = tpg * 16;
  if ((int)threadIdx.x < ((n_act + 31) & ~31)) {  // whole warps, for the partner shuffle
    const bool act = (int)threadIdx.x < n_act;
    const int ts = threadIdx.x >> 4, rr = threadIdx.x & 15;
    const int64_t row = ((int64_t)grp * tpg + ts) * 16 + rr;
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      float v = 0.f;
      if (act)
        for (int s = 0; s < S; ++s) v += red[(ts * S + s) * NT + tt][rr];
      float* y = p.y + tt * p.ldy;
      if (rope_rows<R>(p)) {
        const float w = __shfl_xor_sync(0xffffffffu, v, 1);
        if (act && row < p.n_out) rope_store(p.rope, y, row, v, w, at[tt]);
      } else if (Norm) {
        const bool valid = act && row < p.n_out;  // n_out % 32 == 0: whole warps valid or not
        if (valid) {
          const float yv = p.accumulate ? (early ? res0[tt] : y[row]) + v : v;
          y[row] = yv;
          emit_norm(p, tt, row, yv, nw);
        }
      } else if (act && row < p.n_out) {
        if (kStore) y[row] = p.accumulate ? (early ? res0[tt] : y[row]) + v : v;
        if constexpr (Argmax) best[tt] = max(best[tt], argmax_key(v, row));
      }
    }
  }
  // No second barrier: the next group uses the other half of the (double) red buffer, and a warp can only
  // write that half again after the next group's barrier, which every reader of this half has passed.
}

// Glu variant: the group's gate tiles are slots 0 .. tpg/2 - 1, the matching up tiles the others. Output o of
// the group (gate row and up row o) is summed in the order finish_group sums a row, then emitted by whole
// warps (32 consecutive outputs: one Q8_0 block).
__device__ __forceinline__ void finish_glu(const Mv1Args& p, int grp, int warp, int lane, float acc0, float acc1,
                                           float (*red)[16]) {  // one token (NT = 1)
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
  if ((lane & 3) == 0) {
    red[warp][lane >> 2] = acc0;
    red[warp][(lane >> 2) + 8] = acc1;
  }
  __syncthreads();
  const int S = 1 << p.lsplit, half = (kWarps >> p.lsplit) >> 1;
  if ((int)threadIdx.x >= half * 16) return;  // 32 or 64 threads: whole warps
  const int ts = threadIdx.x >> 4, rr = threadIdx.x & 15;
  float g, u;
  if (S == 1) {  // finish_group takes a lone warp's sum as it is
    g = red[ts][rr];
    u = red[ts + half][rr];
  } else {
    g = 0.f, u = 0.f;
    for (int s = 0; s < S; ++s) g += red[ts * S + s][rr];
    for (int s = 0; s < S; ++s) u += red[(ts + half) * S + s][rr];
  }
  const int64_t o = ((int64_t)grp * half + ts) * 16 + rr;
  const bool valid = o < (int64_t)p.glu_tiles * 16;  // whole blocks of 32: ffn % 32 == 0
  const float v = valid ? swiglu(g, u) : 0.f;
  ActBuf out = p.glu_out;
  switch (out.kind) {
    case ActKind::Q8_0: emit<(int)ActKind::Q8_0>(v, valid, 0, o, out); break;
    case ActKind::F16: emit<(int)ActKind::F16>(v, valid, 0, o, out); break;
    case ActKind::BF16: emit<(int)ActKind::BF16>(v, valid, 0, o, out); break;
    default: emit<(int)ActKind::F32>(v, valid, 0, o, out); break;
  }
}

// The previous values of the rows finish_group writes for tile group grp, in the threads that write them.
template <int W, int NT>
__device__ __forceinline__ void prefetch_residual(const Mv1Args& p, int grp, int warp, int lane, float (&res0)[NT],
                                                  float (&res1)[NT]) {
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    const float* y = p.y + tt * p.ldy;
    if (S == 1) {
      if ((lane & 3) == 0) {
        const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
        if (r0 < p.n_out) res0[tt] = y[r0];
        if (r0 + 8 < p.n_out) res1[tt] = y[r0 + 8];
      }
    } else if ((int)threadIdx.x < tpg * 16) {
      const int64_t row = ((int64_t)grp * tpg + (threadIdx.x >> 4)) * 16 + (threadIdx.x & 15);
      if (row < p.n_out) res0[tt] = y[row];
    }
  }
}

__device__ __forceinline__ void advance(const Mv1Args& p, Cursor& c) {
  if (++c.r == p.rounds) {
    c.r = 0;
    c.grp += gridDim.x;
  }
}

// CTAs per SM the register budget must allow (MB): 2 (128 registers) for every format. Measured on the H200
// (cuda_matvec, 2026-11-29), 3 CTAs at 80 registers streamed less for each 4-bit format, e.g. 4096 x 16384:
// Q4_0 55 % against 69 %, Q4_K 64 % / 76 %, MXFP4 40 % / 53 % of the copy bandwidth, and Q8_0 spills at 80.
// Both variants are compiled so that MERLIN_CUDA_MV1=2 or =3 can force one for timing.
__host__ __device__ constexpr int min_blocks(int) { return 2; }

// The norm weight of the row this thread finishes in tile group grp (finish_group's thread-per-row order).
template <int W>
__device__ __forceinline__ float norm_weight(const Mv1Args& p, int grp) {
  const int tpg = W >> p.lsplit;
  if ((int)threadIdx.x >= tpg * 16) return 0.0f;
  const int64_t row = ((int64_t)grp * tpg + (threadIdx.x >> 4)) * 16 + (threadIdx.x & 15);
  return row < p.n_out ? __ldg(p.norm_w + row) : 0.0f;
}

// Warps per CTA: the Norm variant's groups must hold whole Q8_0 blocks (2 tiles, S <= W / 2); 16 warps let
// it split each tile over 8 warps as the plain product does for short rows (base) and small matrices that
// cover the SMs once (macbook's Wo and down), at 1 CTA per SM instead of 2.
__host__ __device__ constexpr int warps_of(int epi) { return epi == kEpiNorm ? kNormWarps : kWarps; }

// Argmax: each token's largest key in the CTA (a warp shuffle tree, then thread 0 over the warps), one
// atomicMax per CTA and token (token tt's key at argmax[tt]).
template <int W, int NT>
__device__ __forceinline__ void publish_argmax(const Mv1Args& p, unsigned long long (&best)[NT]) {
  __shared__ unsigned long long warp_best[NT][W];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    for (int o = 16; o > 0; o >>= 1) best[tt] = max(best[tt], __shfl_xor_sync(0xffffffffu, best[tt], o));
    if ((threadIdx.x & 31) == 0) warp_best[tt][threadIdx.x >> 5] = best[tt];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      unsigned long long b = best[tt];
      for (int w = 1; w < W; ++w) b = max(b, warp_best[tt][w]);
      if (b != 0ull) atomicMax(p.argmax + tt, b);
    }
  }
}

// 2-4 tokens (NT > 1). A one-token epilogue walks a group's rows with one thread per row; walking NT tokens
// in each thread made the step's kernels charge ~2 us more per token (H200, base q4_0, fortieth session:
// every kernel of the layer was latency-bound in its epilogue, not in its weight rounds). So every token's
// row sums go through shared memory and thread i finishes row i % FR of token i / FR (FR: the group's rows
// rounded up to whole warps, so that a warp holds 32 rows of one token: whole Q8_0 blocks for the Norm
// epilogue, RoPE partners for the RoPE one). The token's RoPE target and cos / sin row, its residual and
// its argmax key then live in shared memory or one register instead of per-token register arrays.
template <int W, int NT>
struct FewShared {
  int64_t slot[NT];                   // each token's cache slot (RopeTarget; plain members: shared memory
  const float* csp[NT];               // has no initializers), and its cos / sin row: cs (n_rot <= kRopeCsMax)
  float cs[NT][kRopeCsMax];           // each token's cos / sin row
  unsigned long long best[NT];        // each token's largest argmax key in the CTA
};
template <int W>
struct FewShared<W, 1> {  // never used at one token: nothing to allocate
  int64_t slot[1];
  const float* csp[1];
  float cs[1][1];
  unsigned long long best[1];
};

// Rows of a group as the few-token epilogue walks them (whole warps).
template <int W>
__device__ __forceinline__ int few_rows(const Mv1Args& p) { return (((W >> p.lsplit) * 16) + 31) & ~31; }

// Before pdl_wait (positions, tables and the cos / sin table are the host's): each token's RoPE target and
// cos / sin row into shared memory, the argmax keys cleared. Visible after stage_x's barrier.
template <int W, int NT>
__device__ __forceinline__ void few_prologue(const Mv1Args& p, FewShared<W, NT>& fs, bool rope, int warp, int lane) {
  const bool copy = p.rope.n_rot <= kRopeCsMax;  // else the epilogue reads the table in global memory
  if (warp == 0 && lane < NT) {
    fs.best[lane] = 0ull;
    if (rope) {
      const RopeTarget t = rope_target(p.rope, lane);
      fs.slot[lane] = t.slot;
      fs.csp[lane] = copy ? fs.cs[lane] : t.cs;
    }
  }
  if (rope && copy && warp == 1) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      const float* cs = p.rope.d_cos_sin + (int64_t)p.rope.d_pos[tt] * p.rope.n_rot;
      for (int i = lane; i < p.rope.n_rot; i += 32) fs.cs[tt][i] = __ldg(cs + i);
    }
  }
}

// The thread's (token, row) in pass 0 of group grp's epilogue, and its row's norm weight (Norm: one pass,
// FR * NT <= 16 warps' threads).
template <int W, int NT>
__device__ __forceinline__ float few_norm_weight(const Mv1Args& p, int grp) {
  const int fr = few_rows<W>(p), n_act = (W >> p.lsplit) * 16;
  const int i = threadIdx.x, r = i % fr;
  if (i >= fr * NT || r >= n_act) return 0.0f;
  const int64_t row = (int64_t)grp * (W >> p.lsplit) * 16 + r;
  return row < p.n_out ? __ldg(p.norm_w + row) : 0.0f;
}
// The residual of the thread's pass-0 row (accumulating products), read before the group's rounds.
template <int W, int NT>
__device__ __forceinline__ float few_residual(const Mv1Args& p, int grp) {
  const int fr = few_rows<W>(p), n_act = (W >> p.lsplit) * 16;
  const int i = threadIdx.x, r = i % fr, tt = i / fr;
  if (i >= fr * NT || r >= n_act) return 0.0f;
  const int64_t row = (int64_t)grp * (W >> p.lsplit) * 16 + r;
  return row < p.n_out ? p.y[tt * p.ldy + row] : 0.0f;
}

template <bool Norm, int W, bool Argmax, int R, int NT>
__device__ __forceinline__ void finish_group_few(const Mv1Args& p, int grp, int warp, int lane, float (&acc0)[NT],
                                                 float (&acc1)[NT], float (*red)[16], FewShared<W, NT>& fs,
                                                 bool early, float res, float nw) {
  quad_sums(acc0, acc1);
  sums_to_red(warp, lane, acc0, acc1, red);
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit, n_act = tpg * 16, fr = few_rows<W>(p);
#pragma unroll 1
  for (int i = threadIdx.x; i < fr * NT; i += W * 32) {  // whole warps: fr % 32 == 0
    const int tt = i / fr, r = i % fr;
    const bool act = r < n_act;
    const int ts = r >> 4, rr = r & 15;
    float v = 0.f;
    if (act)
      for (int s = 0; s < S; ++s) v += red[(ts * S + s) * NT + tt][rr];
    const int64_t row = (int64_t)grp * tpg * 16 + r;
    float* y = p.y + tt * p.ldy;
    const bool first = i == (int)threadIdx.x;  // pass 0: res and nw are this (token, row)'s
    if (rope_rows<R>(p)) {
      const float w = __shfl_xor_sync(0xffffffffu, v, 1);
      if (act && row < p.n_out) rope_store(p.rope, y, row, v, w, RopeTarget{fs.slot[tt], fs.csp[tt]});
    } else if (Norm) {
      const bool valid = act && row < p.n_out;  // n_out % 32 == 0: whole warps valid or not
      if (valid) {
        const float yv = p.accumulate ? (early && first ? res : y[row]) + v : v;
        y[row] = yv;
        emit_norm(p, tt, row, yv, first ? nw : __ldg(p.norm_w + row));
      }
    } else if (Argmax) {
      unsigned long long key = act && row < p.n_out ? argmax_key(v, row) : 0ull;
      for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xffffffffu, key, o));
      if (lane == 0 && key != 0ull) atomicMax(&fs.best[tt], key);
    } else if (act && row < p.n_out) {
      y[row] = p.accumulate ? (early && first ? res : y[row]) + v : v;
    }
  }
  // No second barrier, as in finish_group.
}

// Argmax with 2-4 tokens: the CTA's keys (fs.best, raised by every warp) to the global slots.
template <int W, int NT>
__device__ __forceinline__ void publish_argmax_few(const Mv1Args& p, FewShared<W, NT>& fs) {
  __syncthreads();
  if ((int)threadIdx.x < NT && fs.best[threadIdx.x] != 0ull) atomicMax(p.argmax + threadIdx.x, fs.best[threadIdx.x]);
}

// The pooled walk (the kRunPool RoPE instance at one token; the host's plan_pool): each CTA takes whole tiles,
// tiles / grid or one more, and its warps share the CTA's (tile, round) units, unit u being round u % rounds
// of the CTA's tile u / rounds (p.rounds: one warp's rounds per tile), warp w walking u = w, w + W, ... So a
// CTA of 3 tiles runs ceil(3 x 12 / 8) = 5 rounds per warp where groups of S warps per tile ran 6 (iphone's
// QKV: 576 tiles over 264 CTAs; 24 CTAs walked two groups of 2 tiles while the rest walked one). A warp's
// units of one tile are consecutive, so it leaves one partial sum per tile it touched (every warp touches
// every tile: rounds >= W, the host sees to it), and the epilogue adds a row's W partials in warp order.
constexpr int kPoolTiles = 4;  // tiles per CTA at most (plan_pool)
struct PoolWalk {
  int t0, units;  // the CTA's first tile and its units
  __device__ explicit PoolWalk(const Mv1Args& p) {
    const int b = (int)blockIdx.x, q = p.tiles / (int)gridDim.x, r = p.tiles % (int)gridDim.x;
    t0 = b * q + min(b, r);
    units = (q + (b < r ? 1 : 0)) * p.rounds;
  }
};
// Moves (tile, round) `step` units on.
__device__ __forceinline__ void pool_next(const Mv1Args& p, int& tile, int& rr, int step) {
  rr += step;
  while (rr >= p.rounds) {
    rr -= p.rounds;
    ++tile;
  }
}
// Before pdl_wait: the warp's first unit into `ra`, and L2 prefetches of the next p.l2_items.
template <int F, bool X, int W>
__device__ __forceinline__ void pool_first(const Mv1Args& p, int warp, int lane, Round<F>& ra) {
  const PoolWalk pw(p);
  int tile = pw.t0, rr = 0;
  pool_next(p, tile, rr, warp);
  if (warp >= pw.units) return;
  load_round<F, X>(p, tile, rr * kRound, p.n_chunks, lane, ra);
  if (lane == 0)
    for (int i = 1, u = warp + W; i <= p.l2_items && u < pw.units; ++i, u += W) {
      pool_next(p, tile, rr, W);
      prefetch_round<F>(p, tile, rr * kRound, p.n_chunks);
    }
}
template <int F, bool X, int W>
__device__ __forceinline__ void pooled_walk(const Mv1Args& p, Round<F>& ra, Round<F>& rb, const uint2* xq,
                                            const float* xs, int warp, int lane, const RopeTarget& at) {
  __shared__ float part[kPoolTiles][W][16];
  const PoolWalk pw(p);
  int tile = pw.t0, rr = 0, u = warp;
  pool_next(p, tile, rr, warp);
  float acc0[1] = {0.f}, acc1[1] = {0.f};
  // Unit u from `now` (loaded), unit u + W requested into `next`; the partial sum leaves at a tile's end.
  auto step = [&](const Round<F>& now, Round<F>& next) {
    int nt = tile, nr = rr;
    pool_next(p, nt, nr, W);
    const bool more = u + W < pw.units;
    if (more) load_round<F, X>(p, nt, nr * kRound, p.n_chunks, lane, next);
    compute_round<F, X, 1>(p, now, rr * kRound, p.n_chunks, xq, xs, lane & 3, acc0, acc1);
    if (!more || nt != tile) {
      quad_sums(acc0, acc1);
      if ((lane & 3) == 0) {
        part[tile - pw.t0][warp][lane >> 2] = acc0[0];
        part[tile - pw.t0][warp][(lane >> 2) + 8] = acc1[0];
      }
      acc0[0] = acc1[0] = 0.f;
    }
    tile = nt, rr = nr, u += W;
    return more;
  };
  if (u < pw.units)
    while (step(ra, rb) && step(rb, ra)) {
    }
  __syncthreads();
  const int n_rows = pw.units / p.rounds * 16;
  if ((int)threadIdx.x < ((n_rows + 31) & ~31)) {  // whole warps, for the partner shuffle
    const bool act = (int)threadIdx.x < n_rows;
    const int ts = threadIdx.x >> 4, r16 = threadIdx.x & 15;
    float v = 0.f;
    if (act)
      for (int w = 0; w < W; ++w) v += part[ts][w][r16];
    const int64_t row = (int64_t)(pw.t0 + ts) * 16 + r16;
    const float partner = __shfl_xor_sync(0xffffffffu, v, 1);
    if (act && row < p.n_out) rope_store(p.rope, p.y, row, v, partner, at);
  }
}

// G: the row is staged as SwiGLU of the gate/up row (stage_x). Run: what the instance decides at run time,
// kRunRope (RoPE by p.rope_on) and kRunGlu (the SwiGLU staging by p.glu_src); kRunAll is the general instance
// every launch took before the thirty-first session (instance families: pick_instance).
// kRunPool: the lean RoPE instance's twin that walks whole tiles per CTA (pooled_walk; E = kEpiRope only),
// built in matvec1_pool.cu only. A separate instance because the walk's code inside the lean one cost the
// launches that never took it, and a separate translation unit because the twins in matvec1.cu's module cost
// kernels they do not touch (H200 tg128, forty-first session, base q4_k: 4,024-4,028 t/s before, 3,918 with
// the walk in the lean instance, 3,972-3,987 with the twins in matvec1.cu, 4,056 with them in their own unit;
// docs/BENCHMARKS.md).
enum Run : int { kRunNone = 0, kRunRope = 1, kRunGlu = 2, kRunAll = 3, kRunPool = 4 };
// In the kRunPool instance the tile groups' walk after pooled_walk's return is unreachable, by design: nvcc
// warns (#128) for that instance. Kept as one body rather than an else branch, whose different PTX
// (register numbering, instruction order; measured) would change every other instance's code.
#pragma nv_diag_suppress 128
template <int F, int MB, int E, bool X, bool G, int Run, int NT = 1>
__global__ void __launch_bounds__(warps_of(E) * 32, MB) mv1_kernel(Mv1Args p) {
  constexpr bool Glu = E == kEpiGlu, Norm = E == kEpiNorm, Argmax = E == kEpiArgmax;
  static_assert(NT == 1 || (!Glu && reads_q8_0<F>()), "2-4 tokens: Q8_0-reading formats, no SwiGLU epilogue");
  constexpr int R = E == kEpiRope ? 1 : (Run & kRunRope) ? 2 : 0;
  unsigned long long best[NT];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) best[tt] = 0ull;
  constexpr int W = warps_of(E);
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[2][W * NT][16];
  // Not at 3 CTAs per SM (80 registers: the copy made it spill), nor for several tokens (their epilogues read
  // the table from L2).
  constexpr bool kCs = R != 0 && MB < 3 && NT == 1;
  __shared__ __align__(16) float cs_rows[kCs ? W : 1][kCs ? kRopeCsMax : 1];  // rope_cs: each warp's copy of the row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int S = 1 << p.lsplit;
  const int slot = warp >> p.lsplit, sub = warp & (S - 1);
  const int tpg = W >> p.lsplit;
  // Items of this CTA: groups blockIdx.x, + gridDim.x, ...; rounds 0 .. rounds - 1 of each.
  // (grid <= groups, so every CTA has a group; the launch divides, not each CTA before its first load)
  const int my_groups = p.groups_q + ((int)blockIdx.x < p.groups_r ? 1 : 0);
  const int n_items = my_groups * p.rounds;
  const int half = tpg >> 1;
  auto tile_of = [&](const Cursor& c) {
    if constexpr (Glu) return slot < half ? c.grp * half + slot : p.glu_up_tile + c.grp * half + slot - half;
    return c.grp * tpg + slot;
  };
  auto chunk_of = [&](const Cursor& c) { return (sub + c.r * S) * kRound; };
  auto nc_of = [&](const Cursor& c) {
    if constexpr (Glu) return c.grp * half + (slot < half ? slot : slot - half) < p.glu_tiles ? p.n_chunks : 0;
    return tile_of(c) < p.tiles ? p.n_chunks : 0;
  };

  // The first round is requested before pdl_wait (weights do not depend on earlier kernels). Requesting
  // the second one there too made ptxas spill in every variant.
  Round<F> ra{}, rb{};
  Cursor cur{(int)blockIdx.x, 0};
  constexpr bool kPool = E == kEpiRope && Run == kRunPool && NT == 1;  // the pooled walk (pooled_walk)
  static_assert(Run != kRunPool || kPool, "the pooled walk: the one-token RoPE instance only");
  if (kPool) pool_first<F, X, W>(p, warp, lane, ra);
  else if (n_items > 0) load_round<F, X>(p, tile_of(cur), chunk_of(cur), nc_of(cur), lane, ra);
  RopeTarget at[NT];
  __shared__ FewShared<W, NT> fs_few;  // NT > 1 only (unused, and removed by the compiler, at one token)
  if constexpr (NT > 1) few_prologue<W, NT>(p, fs_few, rope_rows<R>(p), warp, lane);
  if (NT == 1 && rope_rows<R>(p)) {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) at[tt] = rope_target(p.rope, tt);
    if (warp == W - 1) {
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) prefetch_kv_context(p.rope, lane, tt);
    }
    if constexpr (kCs) {
      if (p.rope_cs) copy_cs_row(at[0], p.rope.n_rot, cs_rows[warp], lane);
    }
  }
  float nw = 0.0f;  // the first group's, like its first round
  if (Norm && n_items > 0) nw = NT == 1 ? norm_weight<W>(p, (int)blockIdx.x) : few_norm_weight<W, NT>(p, (int)blockIdx.x);
  // L2 prefetch (lane 0) of the items after the first, which are loaded into registers only one ahead.
  if (!kPool && p.l2_items > 0 && lane == 0) {
    Cursor c = cur;
    for (int i = 1; i < n_items && i <= p.l2_items; ++i) {
      advance(p, c);
      prefetch_round<F>(p, tile_of(c), chunk_of(c), nc_of(c));
    }
  }
  pdl_trigger();
  pdl_wait();
  bool early = !Glu && p.accumulate && p.resid_early && n_items > 0;
  float res0[NT], res1[NT];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) res0[tt] = res1[tt] = 0.f;
  float res_few = 0.f;
  if (early) {
    if constexpr (NT == 1) prefetch_residual<W, NT>(p, (int)blockIdx.x, warp, lane, res0, res1);
    else res_few = few_residual<W, NT>(p, (int)blockIdx.x);
  }
  stage_x<F, W, G, (Run & kRunGlu) != 0, NT>(p, smem);
  const uint2* xq = reinterpret_cast<const uint2*>(smem);
  const float* xs = reinterpret_cast<const float*>(smem + p.k);
  if constexpr (kPool) {
    pooled_walk<F, X, W>(p, ra, rb, xq, xs, warp, lane, at[0]);
    return;
  }
  float acc0[NT], acc1[NT];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) acc0[tt] = acc1[tt] = 0.f;
  int parity = 0;
  // Item i: request item i + 1 into `next`, compute `now`, finish the tile group after its last round.
  auto item = [&](int i, const Round<F>& now, Round<F>& next) {
    Cursor nx = cur;
    advance(p, nx);
    if (i + 1 < n_items) load_round<F, X>(p, tile_of(nx), chunk_of(nx), nc_of(nx), lane, next);
    compute_round<F, X, NT>(p, now, chunk_of(cur), nc_of(cur), xq, xs, t, acc0, acc1);
    if (cur.r == p.rounds - 1) {
      if constexpr (Glu) finish_glu(p, cur.grp, warp, lane, acc0[0], acc1[0], red[parity]);
      else if constexpr (NT > 1)
        finish_group_few<Norm, W, Argmax, R, NT>(p, cur.grp, warp, lane, acc0, acc1, red[parity], fs_few, early, res_few, nw);
      else finish_group<Norm, W, Argmax, R, NT>(p, cur.grp, warp, lane, acc0, acc1, red[parity], at, early, res0, res1, nw, best);
      early = false;
      if constexpr (Norm) {  // requested before the next group's rounds
        if (i + 1 < n_items) nw = NT == 1 ? norm_weight<W>(p, nx.grp) : few_norm_weight<W, NT>(p, nx.grp);
      }
      parity ^= 1;
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) acc0[tt] = acc1[tt] = 0.f;
    }
    cur = nx;
  };
  for (int i = 0; i < n_items; i += 2) {
    item(i, ra, rb);
    if (i + 1 < n_items) item(i + 1, rb, ra);
  }
  if constexpr (Argmax) {
    if constexpr (NT == 1) publish_argmax<W, NT>(p, best);
    else publish_argmax_few<W, NT>(p, fs_few);
  }
}
#pragma nv_diag_default 128

// Staged activation bytes of one token (stage_x): codes and scales, for Q4_0 16 bytes per 8 codes.
template <int F>
size_t smem_bytes(int64_t k) { return F == kQ4_0 ? (size_t)k * 2 : (size_t)k + (size_t)(k / 32) * 4; }
// Token t's staged row starts at t * staged_stride (16-byte aligned); nt tokens' rows take smem_rows bytes.
template <int F>
size_t staged_stride(int64_t k) { return (smem_bytes<F>(k) + 15) / 16 * 16; }
template <int F>
size_t smem_rows(int64_t k, int nt) { return nt == 1 ? smem_bytes<F>(k) : (size_t)nt * staged_stride<F>(k); }
// With a SwiGLU row (stage_glu): the scratch Q8_0 row after the staged rows, 16-byte aligned.
template <int F>
size_t glu_scratch_off(int64_t k, int nt = 1) { return (smem_rows<F>(k, nt) + 15) / 16 * 16; }
template <int F>
size_t smem_bytes_glu(int64_t k, int nt = 1) {  // nt scratch rows (stage_glu)
  return glu_scratch_off<F>(k, nt) + (size_t)nt * ((size_t)k + (size_t)(k / 32) * 4);
}

}  // namespace
}  // namespace merlin::cuda
