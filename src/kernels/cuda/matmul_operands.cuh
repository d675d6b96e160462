// Device code of the batched products (matmul.cu describes the design), first part: the launch arguments,
// a warp's rounds of fragment-ordered weights, the int8 / half tensor-core steps and the staging of the
// activations. matmul_epilogues.cuh adds the reductions and epilogues, matmul_kernels.cuh the kernels; all
// three are included by matmul.cu only (their anonymous namespace is that translation unit's).
#pragma once
#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/sys.h"
#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/raw_formats.cuh"
#include "kernels/cuda/rope_kv.cuh"

namespace merlin::cuda {
namespace {


constexpr int kWarps = 8;
constexpr int kRound = 4;  // chunks per round of a warp (see Round below); 2 for short rows (short_rounds_fmt)
static_assert(kWarps * 32 == kPrepThreads, "a product CTA runs the fused preparation with prep_kernel's CTA size");

// ---------------------------------------------------------------------------------------------------------
// Products.

struct MmArgs {
  const uint8_t* q;
  const uint8_t* s;
  int64_t k, n_steps, n_chunks, n_super;
  const int8_t* xfq;  // quantized activations in fragment order (ActBuf::fq, fs, fsum)
  const float* xfs;
  const int32_t* xfsum;
  const uint16_t* xfhi;  // half activations in fragment order (ActBuf::fhi, flo)
  const uint16_t* xflo;
  const float* xf;
  int n;
  float* y;
  int64_t ldy, n_out, rows;
  int accumulate;
  int64_t tiles;
  int stage_x;    // 1: the CTA copies its tokens' activations to shared memory first (mm_kernel)
  int fuse_prep;  // 1: the CTA computes its tokens' activations from prep (RMSNorm / SwiGLU / plain) itself
  PrepArgs prep;
  int split;  // warps sharing a tile's k (1, 2, 4 or 8): a CTA works on kWarps / split tiles at once
  int round = kRound;  // chunks per round (mm_kernel's R)
  int rope_on;  // 1: y is the stacked QKV product, finished by rope_store (matmul_rope_kv)
  RopeKvArgs rope;
  int rope_early = 0;  // rope_on: the tokens' rope_target looked up per element (0), or once per CTA by the
                       // last warp before the wait (1) or after it (2): rope_mode
  int ctx_l2 = 0;      // rope_on, rope_early != 0: each token's latest ctx_l2 K/V positions asked into L2
                       // before the wait (prefetch_token_context); 0 = none
  int ctx_l2_blocks = 0;  // the most cache blocks such a window spans
  const double* rms_part = nullptr;  // staged rows with a deferred RMSNorm (ActBuf::rms_part): [n][rms_blocks]
  float rms_eps = 0;
  int rms_blocks = 0;                // sums of squares per token: k / 32, or k / 16 (ActBuf::rms_block)
  int norm_on = 0;  // the epilogue also writes the next RMSNorm's input (matmul_norm): 1 Q8_0 rows, 2 half plane
  const float* norm_w = nullptr;     // its weight per output row
  ActBuf norm_out{};                 // its Q8_0 codes and unnormalised block scales (fragment planes)
  double* norm_part = nullptr;  // per token and block of 32 outputs (16: norm_on 2), the sum of y^2
  unsigned long long* argmax = nullptr;  // matmul_argmax: per token, the largest output's key; y is not written
  int argmax_pairs = 1;  // with split <= 2, the argmax straight from the accumulators (reduce_argmax_pair)
  int glu_on = 0;       // matmul_swiglu: a tile set pairs gate tiles with the same tiles of up; y is not written
  int glu_up_tile = 0;  // first tile of the up rows
  int glu_tiles = 0;    // tiles of gate rows (ffn / 16)
  ActBuf glu_out{};     // silu(gate) * up per token: the down product's input (Q8_0, F16, BF16 or F32)
  const uint16_t* xfh = nullptr;  // Q8_0 activations as halves (ActBuf::fh): read by the H kernels (half_x)
  int half_x = 0;       // 1: an H kernel (matmul_half_pays): int8 weights dequantized to half, x from xfh
  // The item walk (Items), set by the launch (set_items) so that no kernel divides by a runtime value:
  int split_log2 = 3;  // log2(split)
  int rounds = 0;      // rounds per tile: ceil(n_chunks / (split * round))
  int sets_q = 0, sets_r = 0;  // tile sets per CTA: sets_q, one more for blockIdx.x < sets_r
};

// The activations a CTA reads: the global buffers, or the CTA's own tokens staged in shared memory (from
// token tok0 on, a multiple of 8). Generic pointers serve both, so the product code is the same. Both read
// the fragment-ordered planes (groups of 8 tokens: a warp's B operand is contiguous).
struct XView {
  const int8_t* fq;
  const float* fs;
  const int32_t* fsum;
  const uint16_t* fhi;
  const uint16_t* flo;
  const uint16_t* fh;
  int tok0;
};

// ---------------------------------------------------------------------------------------------------------
// One "round" of a warp: kRound consecutive 16-byte chunks per lane plus the raw block scales their k-steps
// need, all loaded before any of them is used. A warp keeps two rounds in flight (the next one loads while
// the current one computes), so every lane has 128 bytes of weights outstanding and the scales arrive with
// the weights instead of costing a second memory round trip inside the compute loop.

static_assert(kRound % 2 == 0, "half matrices load their chunks in (row g, row g + 8) pairs");

// 32-bit scale words per round: one per k-step (Q8_0, Q4_0: half2 of rows g and g + 8), one per two k-steps
// (MXFP4: rows g and g + 8's e8m0 bytes of each), one per super-block of 8 steps (TQ2_0), none (half formats;
// Q4_K keeps 16-byte headers).
__host__ __device__ constexpr int round_scales(int f, int r = kRound) {
  return f == kQ8_0 || f == kQ4_0 ? r * steps_per_chunk(f) : f == kMXFP4 ? r : f == kTQ2 ? r * 4 / 8 : 1;
}

// Rounds of 2 chunks (R = 2) for rows too short to give every warp a round of 4 (base's k = 768 in Q4_0 is 12
// chunks: 3 of 8 warps busy with rounds of 4, 6 with rounds of 2), for the int8 formats whose scales a half
// round still loads whole (not Q4_K: its header is per 8 k-steps); 32-token CTAs only (round_for).
__host__ __device__ constexpr bool short_rounds_fmt(int f) { return f == kQ8_0 || f == kQ4_0 || f == kMXFP4 || f == kTQ2; }

template <int F, int R = kRound>
struct Round {
  uint4 w[R];
  uint32_t s[round_scales(F, R)];
  uint4 h[F == kQ4_K ? 2 : 1];  // Q4_K: the round's super-block header of rows g and g + 8
};

// Rounds start at chunk (warp + kWarps * r) * kRound, so a Q4_K round (8 k-steps) is exactly one
// super-block and a TQ2_0 round (16 k-steps) exactly two: scale indices inside a round are constants.
// X (exact): every round that starts is whole (exact_rounds), so the chunks and scales need no predicates and
// the chunks load from one address at immediate offsets.
template <int F, int R, bool X>
__device__ __forceinline__ void load_round(const MmArgs& p, int64_t tile, int64_t c0, int lane, Round<F, R>& r) {
  const int g = lane >> 2;
  if constexpr (half_fmt(F)) {  // row-major (matrix_layout.cuh): chunk c is row g + 8 (c & 1), column 32 (c >> 1) + 8t
    const int64_t ld = p.n_steps * 16;
    const uint16_t* base = reinterpret_cast<const uint16_t*>(p.q) + (tile * 16 + g) * ld + 8 * (lane & 3);
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int64_t c = c0 + u;
      if (c < p.n_chunks)
        r.w[u] = load_stream(reinterpret_cast<const uint4*>(base + (c & 1) * 8 * ld + (c >> 1) * 32));
    }
    return;
  }
  if constexpr (X) {
    const uint4* qp = reinterpret_cast<const uint4*>(p.q) + (tile * p.n_chunks + c0) * 32 + lane;
#pragma unroll
    for (int u = 0; u < R; ++u) r.w[u] = load_stream(qp + u * 32);
  } else {
    const uint4* qp = reinterpret_cast<const uint4*>(p.q) + tile * p.n_chunks * 32 + lane;
#pragma unroll
    for (int u = 0; u < R; ++u)
      if (c0 + u < p.n_chunks) r.w[u] = load_stream(qp + (c0 + u) * 32);
  }
  const int64_t step0 = c0 * steps_per_chunk(F);
  if constexpr (F == kQ8_0) {
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(p.s) + tile * p.n_steps * 8 + g;
#pragma unroll
    for (int j = 0; j < round_scales(F, R); ++j)
      if (X || step0 + j < p.n_steps) r.s[j] = __ldg(sp + (step0 + j) * 8);
  } else if constexpr (F == kQ4_0 || F == kMXFP4) {
    // A round is 8 k-steps from a multiple of 8: one scale group (matrix_layout.cuh), 32 / 16 bytes per lane;
    // a half round (R = 2) the group's first or second half. A warp whose round lies past the end of k loads
    // none (its group does not exist).
    const uint8_t* sb = p.s + grouped_scale_index(tile, p.n_steps, step0, g) * (F == kQ4_0 ? 2 : 1);
    if constexpr (round_scales(F, R) % 4 == 0) {
#pragma unroll
      for (int j = 0; j < round_scales(F, R) / 4 && (X || step0 < p.n_steps); ++j) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(sb) + j);
        r.s[4 * j] = v.x, r.s[4 * j + 1] = v.y, r.s[4 * j + 2] = v.z, r.s[4 * j + 3] = v.w;
      }
    } else {
      static_assert(round_scales(F, R) == 2, "MXFP4 half rounds: two scale words");
      if (X || step0 < p.n_steps) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(sb));
        r.s[0] = v.x, r.s[1] = v.y;
      }
    }
  } else if constexpr (F == kTQ2) {
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(p.s) + tile * p.n_super * 8 + g;
#pragma unroll
    for (int j = 0; j < round_scales(F, R); ++j)
      if (X || step0 / 8 + j < p.n_super) r.s[j] = __ldg(sp + (step0 / 8 + j) * 8);
  } else if constexpr (F == kQ4_K) {
    if (X || step0 / 8 < p.n_super) {
      const uint4* hdr = reinterpret_cast<const uint4*>(p.s) + (tile * p.n_super + step0 / 8) * 16;
      r.h[0] = __ldg(hdr + g);
      r.h[1] = __ldg(hdr + g + 8);
    }
  }
}

// Scale (and Q4_K min) of rows g and g + 8 for k-step i (0 .. kRound * steps_per_chunk - 1) of a round.
template <int F, int R>
__device__ __forceinline__ void step_scales(const Round<F, R>& r, int i, float2& ws, float2& wm) {
  if constexpr (F == kQ4_K) {
    const float2 r0 = q4k_scale_min(r.h[0], i), r1 = q4k_scale_min(r.h[1], i);
    ws = make_float2(r0.x, r1.x);
    wm = make_float2(r0.y, r1.y);
  } else if constexpr (F == kMXFP4) {  // step i's bytes (rows g, g + 8) are half-word i of the group
    const uint32_t b = r.s[i >> 1] >> (16 * (i & 1));
    ws = make_float2(e8m0_half((uint8_t)(b & 0xFF)), e8m0_half((uint8_t)((b >> 8) & 0xFF)));
  } else {
    const uint32_t bits = F == kTQ2 ? r.s[i / 8] : r.s[i];
    ws = __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
}

// The view's group of tokens tb + 8 nt .. + 7, or for a group past the step's tokens the CTA's first group.
__device__ __forceinline__ int group_or_first(const MmArgs& p, const XView& x, int tb, int nt) {
  const int first = (tb - x.tok0) / 8;
  return tb + nt * 8 < p.n ? first + nt : first;
}

template <int F, int NT>
__device__ __forceinline__ void int8_step(const MmArgs& p, const XView& x, const uint32_t (&a)[4], float2 ws,
                                          float2 wm, int64_t step, int tb, int g, int t, float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    // Block `step` of this 8-token group: lane 4g + t's B operand, then the scales of tokens 2t and 2t + 1.
    // Slots of tokens past n in a group hold finite values of earlier steps (their outputs are never
    // written); groups past n are neither allocated nor staged, so they read the CTA's first group instead
    // (a select, not a branch: with a branch the compiler no longer batched the groups' loads, and 32-token
    // products fell from 27 to 15 % of the copy bandwidth).
    const int64_t f = (int64_t)group_or_first(p, x, tb, nt) * p.n_steps + step;
    const uint2 b = *reinterpret_cast<const uint2*>(x.fq + (f * 32 + 4 * g + t) * 8);
    int c[4] = {0, 0, 0, 0};  // a zero accumulator is the zero register; block sums stay below 2^20
    mma_s8(c, a, b.x, b.y);
    const float c0 = biased_to_float(c[0] + kIntBias), c1 = biased_to_float(c[1] + kIntBias),
                c2 = biased_to_float(c[2] + kIntBias), c3 = biased_to_float(c[3] + kIntBias);
    const float2 xs = *reinterpret_cast<const float2*>(x.fs + f * 8 + 2 * t);
    const float xs0 = xs.x, xs1 = xs.y;
    if constexpr (F == kQ4_K) {
      const int2 sums = *reinterpret_cast<const int2*>(x.fsum + f * 8 + 2 * t);
      const float m0 = (float)sums.x, m1 = (float)sums.y;
      acc[nt][0] += xs0 * (ws.x * c0 - wm.x * m0);
      acc[nt][1] += xs1 * (ws.x * c1 - wm.x * m1);
      acc[nt][2] += xs0 * (ws.y * c2 - wm.y * m0);
      acc[nt][3] += xs1 * (ws.y * c3 - wm.y * m1);
    } else {
      acc[nt][0] += c0 * (ws.x * xs0);
      acc[nt][1] += c1 * (ws.x * xs1);
      acc[nt][2] += c2 * (ws.y * xs0);
      acc[nt][3] += c3 * (ws.y * xs1);
    }
  }
}

// k-step `step` of a half matrix: A holds rows g, g + 8 at physical columns 32 (step >> 1) + 8t + 4 (step & 1)
// + {0, 1} (logical 2t, 2t + 1) and + {2, 3} (logical 2t + 8, 2t + 9), so the token's B operand is the same
// four columns: halves 4 (step & 1) .. + 3 of lane 4g + t's 8 in the fragment planes. Columns past k (row
// padding) are zero there.
template <int F, int NT>
__device__ __forceinline__ void half_step(const MmArgs& p, const XView& x, const uint32_t (&a)[4], int64_t step,
                                          int tb, int g, int t, float (&acc)[NT][4]) {
  const int64_t blocks = (p.k + 31) / 32;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int64_t f = (int64_t)group_or_first(p, x, tb, nt) * blocks + (step >> 1);
    const int64_t o = (f * 32 + 4 * g + t) * 8 + 4 * (step & 1);
    const uint2 h = *reinterpret_cast<const uint2*>(x.fhi + o), l = *reinterpret_cast<const uint2*>(x.flo + o);
    mma_half<F == kBF16>(acc[nt], a, l.x, l.y);
    mma_half<F == kBF16>(acc[nt], a, h.x, h.y);
  }
}

// (x & mask) | bits in one instruction: written as C, the two immediates make the compiler emit two.
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
  return r;
}

// H kernels: k-step `step` of an int8-format weight with half activations (ActBuf::fh). The lane's A values
// (rows g and g + 8, columns 4t..4t+3 and 16+4t..16+4t+3 of the step) are dequantized to halves, scale
// included (value * scale rounded once, as gemm.cu expands weights for cuBLAS), in the column pairs (4t,
// 4t + 2), (4t + 1, 4t + 3) that a mask of every other byte gives; the activations' plane stores each
// token's columns in that same order (frag_h_index), so two m16n8k16 products (columns 4t.. and 16+4t..)
// pair every weight with its element. One dequantization per k-step serves all NT token groups: per group a
// 16-byte load and two products, against the int8 path's product, two loads and 12 scaling instructions.
// h[0..3]: the first product's A operand (row g even, row g + 8 even, row g odd, row g + 8 odd), h[4..7] the
// second's.
template <int F>
__device__ __forceinline__ void half_operand(const uint4& w, int j, uint32_t bits, uint32_t (&h)[8]) {
  const __half2 sc = *reinterpret_cast<const __half2*>(&bits);
  const __half2 s0 = __low2half2(sc), s1 = __high2half2(sc);
  auto put = [](uint32_t v, __half2 bias, __half2 s) {
    const __half2 r = __hmul2(__hadd2(*reinterpret_cast<const __half2*>(&v), bias), s);
    return *reinterpret_cast<const uint32_t*>(&r);
  };
  if constexpr (F == kQ4_0) {
    // Nibble n of an even byte, under 0x6400 (1024) in a half's low bits, reads 1024 + n; the high nibble
    // under 0x5400 (64, steps of 1 / 16) reads 64 + n. Codes are n - 8.
    const uint32_t w0 = j == 0 ? w.x : w.z, w1 = j == 0 ? w.y : w.w;
    const __half2 b_lo = __float2half2_rn(-1032.f), b_hi = __float2half2_rn(-72.f);
    const uint32_t o0 = w0 >> 8, o1 = w1 >> 8;
    constexpr uint32_t lo = 0x000F000Fu, hi = 0x00F000F0u, m_lo = 0x64006400u, m_hi = 0x54005400u;
    h[0] = put(and_or(w0, lo, m_lo), b_lo, s0);
    h[1] = put(and_or(w1, lo, m_lo), b_lo, s1);
    h[2] = put(and_or(o0, lo, m_lo), b_lo, s0);
    h[3] = put(and_or(o1, lo, m_lo), b_lo, s1);
    h[4] = put(and_or(w0, hi, m_hi), b_hi, s0);
    h[5] = put(and_or(w1, hi, m_hi), b_hi, s1);
    h[6] = put(and_or(o0, hi, m_hi), b_hi, s0);
    h[7] = put(and_or(o1, hi, m_hi), b_hi, s1);
  } else {
    static_assert(F == kQ8_0, "half activations: Q8_0 and Q4_0 weights");
    // Byte b + 128 under 0x64 in a half's high byte reads 1024 + b + 128.
    const __half2 bias = __float2half2_rn(-1152.f);
    const uint32_t u0 = w.x ^ 0x80808080u, u1 = w.y ^ 0x80808080u, u2 = w.z ^ 0x80808080u, u3 = w.w ^ 0x80808080u;
    h[0] = put(__byte_perm(u0, 0x64646464u, 0x4240), bias, s0);
    h[1] = put(__byte_perm(u1, 0x64646464u, 0x4240), bias, s1);
    h[2] = put(__byte_perm(u0, 0x64646464u, 0x4341), bias, s0);
    h[3] = put(__byte_perm(u1, 0x64646464u, 0x4341), bias, s1);
    h[4] = put(__byte_perm(u2, 0x64646464u, 0x4240), bias, s0);
    h[5] = put(__byte_perm(u3, 0x64646464u, 0x4240), bias, s1);
    h[6] = put(__byte_perm(u2, 0x64646464u, 0x4341), bias, s0);
    h[7] = put(__byte_perm(u3, 0x64646464u, 0x4341), bias, s1);
  }
}

template <int NT>
__device__ __forceinline__ void half_act_step(const MmArgs& p, const XView& x, const uint32_t (&h)[8], int64_t step,
                                              int tb, int g, int t, float (&acc)[NT][4]) {
  const uint32_t a0[4] = {h[0], h[1], h[2], h[3]}, a1[4] = {h[4], h[5], h[6], h[7]};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int64_t f = (int64_t)group_or_first(p, x, tb, nt) * p.n_steps + step;
    const uint4 b = *reinterpret_cast<const uint4*>(x.fh + (f * 32 + 4 * g + t) * 8);
    mma_half<false>(acc[nt], a0, b.x, b.y);
    mma_half<false>(acc[nt], a1, b.z, b.w);
  }
}

template <int F, int R, int NT, bool X, int H = 0>
__device__ __forceinline__ void compute_round(const MmArgs& p, const XView& x, const Round<F, R>& r, int64_t c0, int tb,
                                              int g, int t, float (&acc)[NT][4]) {
#pragma unroll
  for (int u = 0; u < R; ++u) {
    if (!X && c0 + u >= p.n_chunks) break;
    if constexpr (half_fmt(F)) {
      // Chunks come in (row g, row g + 8) pairs: R and every round's first chunk are even, and so is
      // n_chunks (rows padded to 32 columns).
      if (u & 1) continue;
      const uint4 lo = r.w[u], hi = r.w[u + 1];
      const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
      half_step<F, NT>(p, x, a0, c0 + u, tb, g, t, acc);
      half_step<F, NT>(p, x, a1, c0 + u + 1, tb, g, t, acc);
    } else if constexpr (H) {
#pragma unroll
      for (int j = 0; j < steps_per_chunk(F); ++j) {
        const int64_t step = (c0 + u) * steps_per_chunk(F) + j;
        if (!X && step >= p.n_steps) break;
        uint32_t h[8];
        half_operand<F>(r.w[u], j, r.s[u * steps_per_chunk(F) + j], h);
        half_act_step<NT>(p, x, h, step, tb, g, t, acc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < steps_per_chunk(F); ++j) {
        const int64_t step = (c0 + u) * steps_per_chunk(F) + j;
        if (!X && step >= p.n_steps) break;
        uint32_t a[4];
        int8_operand<F>(r.w[u], j, a);
        float2 ws, wm = make_float2(0.f, 0.f);
        step_scales<F>(r, u * steps_per_chunk(F) + j, ws, wm);
        int8_step<F, NT>(p, x, a, ws, wm, step, tb, g, t, acc);
      }
    }
  }
}

__host__ __device__ constexpr int token_groups(int nt) { return (nt + 7) / 8; }
__host__ __device__ constexpr int64_t padded_k(int64_t k) { return (k + 31) / 32 * 32; }

// Shared-memory bytes for `nt` tokens of staged activations: whole groups of 8 tokens of the fragment
// planes (hi and lo halves of rows padded to 32 columns, or codes, block scales and block sums).
// H: the half plane only (ActBuf::fh).
__host__ __device__ constexpr size_t staged_bytes(int f, int64_t k, int nt, bool h = false) {
  return (size_t)token_groups(nt) * 8 * (h ? k * 2 : half_fmt(f) ? padded_k(k) * 4 : k + k / 32 * 8);
}

// The ActKind (as int) a weight format reads its input in.
__host__ __device__ constexpr int act_kind_of(int f) {
  return f == kF16 ? (int)ActKind::F16 : f == kBF16 ? (int)ActKind::BF16
       : f == kQ4_K || f == kTQ2 ? (int)ActKind::Q8_K : (int)ActKind::Q8_0;
}

// Shared-memory bytes for the per-block sums of squares of nt staged tokens with a deferred RMSNorm.
__host__ __device__ constexpr size_t deferred_part_bytes(int64_t k, int nt) { return (size_t)nt * (k / 32) * 8; }

// Shared-memory views of the staged activations, laid out as the fragment planes of an ActBuf of nt rows
// (what emit() writes).
template <int F>
__device__ ActBuf staged_buf(int64_t k, int nt, uint8_t* sm) {
  ActBuf o;
  o.kind = (ActKind)act_kind_of(F);
  o.k = k;
  o.n_cap = nt;
  const int64_t rows = token_groups(nt) * 8;
  if constexpr (half_fmt(F)) {
    o.fhi = reinterpret_cast<uint16_t*>(sm);
    o.flo = o.fhi + rows * padded_k(k);
  } else {
    o.fq = reinterpret_cast<int8_t*>(sm);
    o.fs = reinterpret_cast<float*>(sm + rows * k);
    o.fsum = reinterpret_cast<int32_t*>(o.fs + rows * (k / 32));
  }
  return o;
}

__device__ __forceinline__ XView view_of(const ActBuf& o, int tok0) {
  return XView{o.fq, o.fs, o.fsum, o.fhi, o.flo, o.fh, tok0};
}

// Fused preparation: the CTA computes RMSNorm / SwiGLU / plain of its tokens and quantizes them into shared
// memory with the same functions (and CTA size) as prep_kernel, so the codes equal the unfused path's.
template <int F>
__device__ XView stage_prep(const MmArgs& p, int tb, int nt, uint8_t* sm) {
  ActBuf o = staged_buf<F>(p.k, nt, sm);
  if constexpr (half_fmt(F)) {  // the row padding must read as zero (emit writes columns < k only)
    if (p.k % 32 != 0)
      for (int64_t i = threadIdx.x; i < staged_bytes(F, p.k, nt) / 2; i += blockDim.x) o.fhi[i] = 0;
    __syncthreads();
  }
  constexpr int kind = act_kind_of(F);
  switch (p.prep.mode) {
    case Prep::Plain: prep_rows<kind, (int)Prep::Plain>(p.prep, tb, nt, o); break;
    case Prep::RmsNorm: prep_rows<kind, (int)Prep::RmsNorm>(p.prep, tb, nt, o); break;
    case Prep::SwiGlu: prep_rows<kind, (int)Prep::SwiGlu>(p.prep, tb, nt, o); break;
  }
  __syncthreads();
  return view_of(o, tb);
}

// Staged rows written with a deferred RMSNorm (matmul_norm, ActBuf::rms_part): each block scale times the
// token's 1 / rms, rounded to half as prep_act rounds a block scale. A warp per token computes the factor
// from the per-block sums of squares, which stage_x copied after the codes (`part`).
__device__ void complete_deferred_norm(const MmArgs& p, int nt, const double* part, ActBuf& o) {
  __shared__ float inv[32];  // tokens of a CTA: at most 8 * 4
  const int kb = (int)(p.k / 32), warp = threadIdx.x >> 5;
  for (int tl = warp; tl < nt; tl += kWarps) {
    const float r = deferred_inv_rms(part + tl * kb, kb, p.k, p.rms_eps);
    if ((threadIdx.x & 31) == 0) inv[tl] = r;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nt * kb; i += blockDim.x) {
    const int tl = i / kb;
    float& d = o.fs[frag_scale_index(tl, i % kb, p.k)];
    d = round_to_half(d * inv[tl]);
  }
  __syncthreads();
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}

// Copies the CTA's tokens [tb, tb + nt) of the activation buffers to shared memory: the whole 8-token groups
// of the fragment planes, which are contiguous. Every copy is issued before the CTA waits for any
// (cp.async), so staging costs one L2 round trip, not one per loop iteration: 32 tokens of k = 768 are 30
// KiB, 8 rounds of 16 bytes per thread. Everything moves 16 bytes at a time (group offsets are multiples of
// 256 bytes and the buffers are 256-byte aligned).
template <int F, bool H = false>
__device__ XView stage_x(const MmArgs& p, int tb, int nt, uint8_t* sm) {
  const int64_t rows = token_groups(nt) * 8;  // tb is a multiple of 8: group tb / 8 starts at row tb
  if constexpr (H) {  // the half plane only; a deferred RMSNorm scales the sums instead (reduce_tiles' tok_scale)
    uint16_t* fh = reinterpret_cast<uint16_t*>(sm);
    const uint16_t* src = p.xfh + tb * p.k;
    for (int64_t i = threadIdx.x; i < rows * p.k / 8; i += blockDim.x) cp_async16(fh + 8 * i, src + 8 * i);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    return XView{nullptr, nullptr, nullptr, nullptr, nullptr, fh, tb};
  }
  ActBuf o = staged_buf<F>(p.k, nt, sm);
  if constexpr (half_fmt(F)) {
    const int64_t kp = padded_k(p.k);
    const uint16_t* shi = p.xfhi + tb * kp;
    const uint16_t* slo = p.xflo + tb * kp;
    for (int64_t i = threadIdx.x; i < rows * kp / 8; i += blockDim.x) {
      cp_async16(o.fhi + 8 * i, shi + 8 * i);
      cp_async16(o.flo + 8 * i, slo + 8 * i);
    }
  } else {
    const int64_t k = p.k, kb = k / 32;
    const int8_t* sq = p.xfq + tb * k;
    for (int64_t i = threadIdx.x; i < rows * k / 16; i += blockDim.x) cp_async16(o.fq + 16 * i, sq + 16 * i);
    for (int64_t i = threadIdx.x; i < rows * kb / 4; i += blockDim.x) {
      cp_async16(o.fs + 4 * i, p.xfs + tb * kb + 4 * i);
      if constexpr (F == kQ4_K) cp_async16(o.fsum + 4 * i, p.xfsum + tb * kb + 4 * i);
    }
    if (p.rms_part) {  // the tokens' sums of squares, after the staged planes (deferred_part_bytes)
      double* part = reinterpret_cast<double*>(sm + staged_bytes(F, k, nt));
      for (int64_t i = threadIdx.x; i < nt * kb; i += blockDim.x) cp_async8(part + i, p.rms_part + tb * kb + i);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if constexpr (F == kQ8_0 || F == kQ4_0 || F == kMXFP4) {  // the formats that read Q8_0 rows
    if (p.rms_part) complete_deferred_norm(p, nt, reinterpret_cast<const double*>(sm + staged_bytes(F, p.k, nt)), o);
  }
  return view_of(o, tb);
}

}  // namespace
}  // namespace merlin::cuda
