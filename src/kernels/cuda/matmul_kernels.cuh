// Device code of the batched products (matmul.cu describes the design): the launch arguments, a warp's rounds
// of fragment-ordered weights, the int8 / half tensor-core steps, staging of the activations, the reductions
// and epilogues, and the kernels. Included by matmul.cu only.
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
  const double* rms_part = nullptr;  // staged rows with a deferred RMSNorm (ActBuf::rms_part): [n][k / 32]
  float rms_eps = 0;
  int norm_on = 0;                   // 1: the epilogue also writes the next RMSNorm's input (matmul_norm)
  const float* norm_w = nullptr;     // its weight per output row
  ActBuf norm_out{};                 // its Q8_0 codes and unnormalised block scales (fragment planes)
  double* norm_part = nullptr;       // per token and block of 32 outputs, the sum of y^2: [n][n_out / 32]
  unsigned long long* argmax = nullptr;  // matmul_argmax: per token, the largest output's key; y is not written
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

// Sum of a tile's partials (warps grp * split .. + split - 1) of element (i, ln), in warp order: every
// epilogue sums a tile in this order, so they all see the bits the plain product writes to y. The partials
// load four at a time and add in order: one at a time (a chain of dependent shared loads) cost iphone q4_0
// x32, whose tiles have 8 partials, 5.4 % (H200, 2026-12-02). One code path for every split, not instances
// per split: the epilogues run while the next round's loads are in flight, and inlining one per split (or
// eight loads at once) took those registers (ptxas -v: spills at the 128-register cap).
template <int NT>
__device__ __forceinline__ float tile_sum(const MmArgs& p, const float (*red)[NT * 4][32], int grp, int i, int ln) {
  constexpr int kStride = NT * 4 * 32;  // floats between two warps' partials of one element
  const float* a = &red[grp << p.split_log2][i][ln];
  float v = 0.f;
  if (p.split_log2 >= 2) {
#pragma unroll 1
    for (int s = 0; s < p.split; s += 4) {  // four at a time, as the compiler unrolled the old loop
      const float t0 = a[s * kStride], t1 = a[(s + 1) * kStride], t2 = a[(s + 2) * kStride], t3 = a[(s + 3) * kStride];
      v += t0;
      v += t1;
      v += t2;
      v += t3;
    }
  } else {
    const float t0 = a[0], t1 = p.split_log2 == 1 ? a[kStride] : 0.f;
    v += t0;
    if (p.split_log2 == 1) v += t1;
  }
  return v;
}

// The Norm epilogue (matmul_norm) of a tile set: a warp per (token, block of 32 rows), lane = row, sums the
// row's partials in reduce_tiles' order (the same y bits), adds it to the residual and writes the next
// RMSNorm's input with a deferred scale (norm_block). split <= 4 (the host sees to it), so a set holds whole
// blocks: kWarps / split >= 2 tiles from an even tile (kWarps / split / 2 blocks: a power of two, so the
// (token, block) pairs are shifts and masks); n_out % 32 == 0, so a warp's rows are all valid or not.
template <int NT>
__device__ __forceinline__ void reduce_norm(const MmArgs& p, int64_t tile0, int tb, int warp, int lane,
                                            float (*red)[NT * 4][32]) {
  const int blocks_log2 = 2 - p.split_log2, rr = lane & 15, grp_in = lane >> 4;
  const int kb = (int)(p.n_out / 32), pairs = 8 * NT << blocks_log2;
  for (int pr = warp; pr < pairs; pr += kWarps) {
    const int tl = pr >> blocks_log2, b = pr & ((1 << blocks_log2) - 1), grp = 2 * b + grp_in, tk = tl & 7;
    const int64_t r = (tile0 + grp) * 16 + rr;
    const int tok = tb + tl;
    if (tok >= p.n || (tile0 + 2 * b) * 16 >= p.n_out) continue;  // warp-uniform
    const int i = (tl >> 3) * 4 + 2 * (rr >> 3) + (tk & 1), ln = (rr & 7) * 4 + (tk >> 1);
    const float v = tile_sum<NT>(p, red, grp, i, ln);
    float* dst = p.y + (int64_t)tok * p.ldy + r;
    const float y = p.accumulate ? *dst + v : v;
    *dst = y;
    const float w = __ldg(p.norm_w + r);
    const NormBlock nb = norm_block(y, w);
    p.norm_out.fq[frag_code_index(tok, r, p.n_out)] = (int8_t)nb.q;
    if (p.norm_out.fh)  // y * w, without the row's 1 / rms: an H reader scales its sums (reduce_tiles)
      p.norm_out.fh[frag_h_index(tok, r, p.n_out)] = __half_as_ushort(__float2half_rn(__fmul_rn(y, w)));
    if (lane == 0) {
      const int64_t f = frag_scale_index(tok, r / 32, p.n_out);
      p.norm_out.fs[f] = nb.scale;
      p.norm_out.fsum[f] = nb.sum;
      p.norm_part[(int64_t)tok * kb + r / 32] = nb.sum_sq;
    }
  }
}

// The Glu epilogue (matmul_swiglu) of tile set `set`: groups 0 .. half - 1 hold gate tiles set * half + j,
// groups half .. the same tiles of up. A warp per (token, block of 32 gate rows), lane = row, sums each row's
// gate and up partials in reduce_tiles' order (the bits the product would write to y), then writes
// silu(gate) * up with act_impl.cuh's swiglu() and emit(), as prep_act(SwiGlu) would from those rows. split
// <= 2 (the host sees to it), so a set holds whole blocks: kWarps / split / 2 >= 2 gate tiles from an even
// tile; ffn % 32 == 0, so a warp's rows are all valid or not.
template <int NT>
__device__ __forceinline__ void reduce_glu(const MmArgs& p, int set, int tb, int warp, int lane,
                                           float (*red)[NT * 4][32]) {
  const int half = 4 >> p.split_log2, blocks_log2 = 1 - p.split_log2, rr = lane & 15, sub = lane >> 4;
  const int pairs = 8 * NT << blocks_log2;
  for (int pr = warp; pr < pairs; pr += kWarps) {
    const int tl = pr >> blocks_log2, b = pr & ((1 << blocks_log2) - 1), grp = 2 * b + sub, tk = tl & 7;
    const int tok = tb + tl;
    if (tok >= p.n || set * half + 2 * b >= p.glu_tiles) continue;  // warp-uniform
    const int i = (tl >> 3) * 4 + 2 * (rr >> 3) + (tk & 1), ln = (rr & 7) * 4 + (tk >> 1);
    const float g = tile_sum<NT>(p, red, grp, i, ln), u = tile_sum<NT>(p, red, half + grp, i, ln);
    const float v = swiglu(g, u);
    const int64_t o = (int64_t)(set * half + grp) * 16 + rr;
    ActBuf out = p.glu_out;
    switch (out.kind) {
      case ActKind::Q8_0: emit<(int)ActKind::Q8_0>(v, true, tok, o, out); break;
      case ActKind::F16: emit<(int)ActKind::F16>(v, true, tok, o, out); break;
      case ActKind::BF16: emit<(int)ActKind::BF16>(v, true, tok, o, out); break;
      default: emit<(int)ActKind::F32>(v, true, tok, o, out); break;
    }
  }
}

// The larger of two argmax keys (64-bit unsigned order).
__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// Element q of a plain epilogue's tile set (reduce_plain): tile grp = q / (NT * 4), fragment index i = q %
// (NT * 4) of lane `lane`, i.e. output row r and token tok (shifts and masks: NT * 4 is a power of two).
struct SetElem {
  int grp, i, tok;
  int64_t r;
};
template <int NT>
__device__ __forceinline__ SetElem set_elem(int q, int64_t tile0, int tb, int lane) {
  SetElem e;
  e.grp = q / (NT * 4);
  e.i = q % (NT * 4);
  const int ci = e.i & 3;
  e.r = (tile0 + e.grp) * 16 + (lane >> 2) + 8 * (ci >> 1);
  e.tok = tb + (e.i >> 2) * 8 + 2 * (lane & 3) + (ci & 1);
  return e;
}

// The plain epilogue of a tile set: y (or y +=), the RoPE / K/V store of the stacked QKV product
// (rope_store), or the per-token argmax. Thread 32 w + ln takes elements q = w, w + 8, ... of the set's
// kWarps / split * NT * 4 (set_elem), the order reduce_tiles has always used. A thread's tokens repeat with
// period 16 / (NT * 4) passes, so its argmax keys stay in registers (two slots at most) and reach the CTA's
// best once per set, after a shuffle over the 8 lanes of each token, instead of a contended 64-bit shared
// atomic (a CAS loop) per element. One loop per epilogue kind (uniform): the keys are live only in the
// argmax loop. (Before: ~130 instructions per element in the head, half of its 13.4M; ncu, BENCHMARKS.md.)
template <int NT>
__device__ __forceinline__ void reduce_plain(const MmArgs& p, int64_t tile0, int tb, int warp, int lane,
                                             float (*red)[NT * 4][32], unsigned long long* best) {
  constexpr bool kTwoSlots = NT * 4 > kWarps;  // NT = 4: i = warp on even passes, warp + 8 on odd ones
  static_assert(NT * 4 <= 2 * kWarps, "reduce_plain: at most two argmax slots per thread");
  const int elems = (kWarps >> p.split_log2) * NT * 4, gg = lane >> 2, tt = lane & 3;
  if (p.rope_on) {  // the RoPE partner r ^ 1 is the same element of lane ln ^ 4, summed in the same order
    for (int q = warp; q < elems; q += kWarps) {
      const SetElem e = set_elem<NT>(q, tile0, tb, lane);
      if (e.r >= p.n_out || e.tok >= p.n) continue;
      const float v = tile_sum<NT>(p, red, e.grp, e.i, lane), w = tile_sum<NT>(p, red, e.grp, e.i, lane ^ 4);
      rope_store(p.rope, p.y + (int64_t)e.tok * p.ldy, e.r, v, w, rope_target(p.rope, e.tok));
    }
    return;
  }
  if (!p.argmax) {
    for (int q = warp; q < elems; q += kWarps) {
      const SetElem e = set_elem<NT>(q, tile0, tb, lane);
      if (e.r >= p.n_out || e.tok >= p.n) continue;
      const float v = tile_sum<NT>(p, red, e.grp, e.i, lane);
      float* dst = p.y + (int64_t)e.tok * p.ldy + e.r;
      *dst = p.accumulate ? *dst + v : v;
    }
    return;
  }
  unsigned long long key0 = 0ull, key1 = 0ull;
  int j = 0;
  for (int q = warp; q < elems; q += kWarps, ++j) {
    const SetElem e = set_elem<NT>(q, tile0, tb, lane);
    if (e.r >= p.n_out || e.tok >= p.n) continue;
    const unsigned long long k = argmax_key(tile_sum<NT>(p, red, e.grp, e.i, lane), e.r);
    if (kTwoSlots && (j & 1)) key1 = key_max(key1, k);
    else key0 = key_max(key0, k);
  }
#pragma unroll
  for (int m = 0; m < (kTwoSlots ? 2 : 1); ++m) {  // lanes 4 gg + tt hold the same token for every gg
    unsigned long long k = m ? key1 : key0;
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) k = key_max(k, __shfl_xor_sync(0xffffffffu, k, o));
    const int i = (warp + kWarps * m) % (NT * 4), tl = (i >> 2) * 8 + 2 * tt + (i & 1);
    if (gg == 0 && k != 0ull) atomicMax(best + tl, k);  // the CTA's best per token, raised into p.argmax at the end
  }
}

// Sums each group's partial tiles (split warps each) in a fixed order (deterministic) and writes (or adds)
// the outputs; group j of the CTA holds tile tile0 + j (with glu_on, reduce_glu's tiles of set `set`).
// tok_scale (H kernels reading a deferred RMSNorm, else null): per token of the CTA, the factor 1 / rms
// that its staged halves still lack; the partial sums take it before they meet (the sum is linear in x).
template <int NT, bool G>
__device__ __forceinline__ void reduce_tiles(const MmArgs& p, int set, int64_t tile0, int tb, int warp, int lane,
                                             const float (&acc)[NT][4], float (*red)[NT * 4][32],
                                             unsigned long long* best, const float* tok_scale) {
  if (tok_scale) {  // lane 4 g + t's tokens: 8 nt + 2 t and 8 nt + 2 t + 1
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float s0 = tok_scale[nt * 8 + 2 * (lane & 3)], s1 = tok_scale[nt * 8 + 2 * (lane & 3) + 1];
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i] * (i & 1 ? s1 : s0);
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i];
  }
  __syncthreads();
  if constexpr (G) reduce_glu<NT>(p, set, tb, warp, lane, red);
  else if (p.norm_on) reduce_norm<NT>(p, tile0, tb, warp, lane, red);
  else reduce_plain<NT>(p, tile0, tb, warp, lane, red, best);
  __syncthreads();  // red is reused by the next tiles
}

// The work items of a CTA: (tile set, round) pairs. A tile set is kWarps / split consecutive tiles, one per
// group of `split` warps; the CTA takes sets blockIdx.x, + gridDim.x, ..., each set's rounds in order, and the
// warps of a group split their tile's k. Every warp walks the same sequence (a warp whose chunks lie past
// the end of k, or whose tile lies past the last, loads and computes nothing), so the reduction, which
// synchronizes the CTA, comes at the same item for all warps. With split = 8 (long k) this is one tile per
// CTA at a time; short k (k = 768 in Q4_0 is 12 chunks: 3 rounds) gets split = 4 and two tiles at once, and
// because a round's chunks go to the same warp position either way, the sums are bit-identical.
// With G (matmul_swiglu) a set is half gate tiles (set * half + j) and half the same tiles of up (from
// glu_up_tile); its kernels are separate instances, so the plain products keep their registers.
template <bool G>
struct Items {  // 32-bit and division-free: the 32-token kernel is short of registers
  int rounds, n, c_first, stride, groups, group;
  __device__ Items(const MmArgs& p, int warp) {
    groups = kWarps >> p.split_log2;
    group = warp >> p.split_log2;
    stride = p.split * p.round;
    rounds = p.rounds;
    n = rounds * (p.sets_q + ((int)blockIdx.x < p.sets_r ? 1 : 0));
    c_first = (warp & (p.split - 1)) * p.round;
  }
};

// Where a warp is in its item sequence: tile set and round.
struct Cursor {
  int set, r;
  template <bool G>
  __device__ int tile(const MmArgs& p, const Items<G>& it) const {
    if constexpr (!G) return set * it.groups + it.group;
    const int half = it.groups >> 1, j = it.group & (half - 1);
    return set * half + j + (it.group < half ? 0 : p.glu_up_tile);
  }
  template <bool G>
  __device__ bool live(const MmArgs& p, const Items<G>& it) const {
    if constexpr (!G) return set * it.groups + it.group < (int)p.tiles;
    const int half = it.groups >> 1;
    return set * half + (it.group & (half - 1)) < p.glu_tiles;
  }
  template <bool G>
  __device__ int chunk(const Items<G>& it) const { return it.c_first + r * it.stride; }
  template <bool G>
  __device__ Cursor next(const Items<G>& it) const {
    return r + 1 == it.rounds ? Cursor{set + (int)gridDim.x, 0} : Cursor{set, r + 1};
  }
};

// Item i at cursor c: requests item i + 1 into `next`, computes `cur`, reduces the tiles after their last
// round, and moves c on.
// With X a round past the end of k (a warp whose share of a short row ends early) is skipped whole.
template <int F, int R, int NT, bool X, bool G, int H>
__device__ __forceinline__ void run_item(const MmArgs& p, const XView& x, const Items<G>& it, int i, Cursor& c,
                                         const Round<F, R>& cur, Round<F, R>& next, int tb, int warp, int lane,
                                         float (&acc)[NT][4], float (*red)[NT * 4][32], unsigned long long* best,
                                         const float* tok_scale) {
  const Cursor nx = c.next(it);
  if (i + 1 < it.n && nx.live(p, it) && (!X || nx.chunk(it) < p.n_chunks))
    load_round<F, R, X>(p, nx.tile(p, it), nx.chunk(it), lane, next);
  if (c.live(p, it) && (!X || c.chunk(it) < p.n_chunks))
    compute_round<F, R, NT, X, H>(p, x, cur, c.chunk(it), tb, lane >> 2, lane & 3, acc);
  if (c.r == it.rounds - 1) {
    reduce_tiles<NT, G>(p, c.set, (int64_t)c.set * it.groups, tb, warp, lane, acc, red, best, tok_scale);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  }
  c = nx;
}

// A persistent CTA over its items, groups of warps splitting each tile's k. Two rounds of registers alternate
// (the loop is unrolled by two, so no round is ever copied: a register copy would wait for the loads in
// flight and undo the overlap): the next round, possibly of the next tile, is always in flight while the
// current one computes, and the HBM latency is paid once per CTA, not once per tile. The first round is
// requested before pdl_wait (weights do not depend on the previous kernel), so under programmatic
// dependent launch the weight stream starts while the producer of x is still finishing. Activations come
// from shared memory when they fit.
// MinBlocks = 2 caps the kernel at 128 registers so two CTAs share an SM. The 32-token kernel (NT = 4)
// needs 136-182 registers uncapped and is built both ways: capped by default (batch-32 decode on the H200:
// base f16 24.4k -> 37.0k t/s, q4_0 37.0k -> 42.0k, macbook q4_0 2.89k -> 3.29k; docs/GPU.md), uncapped
// with MERLIN_CUDA_NT4_CAP=0 for A/B timing. R: chunks per round (p.round), 4 or 2 (short_rounds_fmt).
// G: the Glu epilogue (matmul_swiglu, reduce_glu); y is not written. H: half activations (half_operand), 1
// read from global memory, 2 staged in shared memory: a template value rather than p.stage_x, so that the
// compiler sees the staged plane's pointer come from shared memory only and loads it with ld.shared.
template <int F, int NT, int MinBlocks = NT == 4 ? 1 : 2, bool X = false, int R = kRound, bool G = false,
          int H = 0>
__global__ void __launch_bounds__(kWarps * 32, MinBlocks) mm_kernel(MmArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[kWarps][NT * 4][32];
  __shared__ unsigned long long best[8 * NT];  // matmul_argmax (the first reduction's barrier orders the zeros)
  __shared__ float tok_scale[H ? 8 * NT : 1];  // H with a deferred RMSNorm: its 1 / rms per token
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tb = blockIdx.y * 8 * NT;
  if (threadIdx.x < 8 * NT) best[threadIdx.x] = 0ull;
  const Items<G> it(p, warp);
  Round<F, R> ra{}, rb{};
  Cursor c{(int)blockIdx.x, 0};
  if (it.n > 0 && c.live(p, it) && (!X || c.chunk(it) < p.n_chunks))
    load_round<F, R, X>(p, c.tile(p, it), c.chunk(it), lane, ra);
  pdl_trigger();
  pdl_wait();
  XView x{p.xfq, p.xfs, p.xfsum, p.xfhi, p.xflo, p.xfh, 0};
  const float* scale = nullptr;
  if constexpr (H) {
    if (p.rms_part) {  // a warp per token (tokens past n get 1: their outputs are never written)
      const int kb = (int)(p.k / 32);
      for (int tl = warp; tl < 8 * NT; tl += kWarps) {
        float r = 1.f;  // warp-uniform condition: deferred_inv_rms is warp-collective
        if (tb + tl < p.n) r = deferred_inv_rms(p.rms_part + (int64_t)(tb + tl) * kb, kb, p.k, p.rms_eps);
        if (lane == 0) tok_scale[tl] = r;
      }
      scale = tok_scale;  // the staging's barrier (or the first reduction's) orders these
    }
    if constexpr (H == 2) x = stage_x<F, true>(p, tb, min(8 * NT, p.n - tb), smem);
    else __syncthreads();
  } else {
    if (p.fuse_prep) x = stage_prep<F>(p, tb, min(8 * NT, p.n - tb), smem);
    else if (p.stage_x) x = stage_x<F>(p, tb, min(8 * NT, p.n - tb), smem);
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int i = 0; i < it.n; i += 2) {
    run_item<F, R, NT, X, G, H>(p, x, it, i, c, ra, rb, tb, warp, lane, acc, red, best, scale);
    if (i + 1 < it.n) run_item<F, R, NT, X, G, H>(p, x, it, i + 1, c, rb, ra, tb, warp, lane, acc, red, best, scale);
  }
  if (p.argmax && threadIdx.x < 8 * NT && tb + (int)threadIdx.x < p.n && best[threadIdx.x] != 0ull)
    atomicMax(p.argmax + tb + threadIdx.x, best[threadIdx.x]);  // reduce_tiles ended with a barrier
}

// F32 weights (test models): a warp per row, up to 8 tokens per CTA row.
__global__ void mm_f32_kernel(MmArgs p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * (int64_t)kWarps + warp;
  const int tb = blockIdx.y * 8;
  pdl_trigger();
  pdl_wait();
  if (r >= p.n_out) return;
  const float* w = reinterpret_cast<const float*>(p.q) + r * p.k;
  for (int tok = tb; tok < min(tb + 8, p.n); ++tok) {
    const float* x = p.xf + (int64_t)tok * p.k;
    float s = 0.f;
    for (int64_t i = lane; i < p.k; i += 32) s += w[i] * x[i];
    s = warp_sum(s);
    if (lane == 0) {
      float* dst = p.y + (int64_t)tok * p.ldy + r;
      *dst = p.accumulate ? *dst + s : s;
    }
  }
}

}  // namespace
}  // namespace merlin::cuda
