// Device code of the single-token products (matvec1.cu, which describes the design): the launch arguments,
// and how a warp loads a round of fragment-ordered weight chunks and multiplies it by the staged row.
// Included by matvec1.cu only.
#pragma once
#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

constexpr int kWarps = 8;       // a CTA of the plain and Glu variants
constexpr int kNormWarps = 16;  // a CTA of the Norm variant (see warps_of)
constexpr int kRound = 4;              // chunks per round: one Q4_K super-block, two TQ2_0 super-blocks
constexpr int64_t kMaxK = 65536;       // longest row whose activations fit the staged shared memory
constexpr int64_t kKBucket = 4096;     // occupancy is tabulated per bucket of k (shared memory grows with k)
constexpr int kBuckets = (int)(kMaxK / kKBucket);
constexpr int kFewMax = 4;             // most tokens of a step the kernels take at once (matvec_few)
constexpr int64_t kFewMaxK = 16384;    // longest row they take: 4 staged Q4_0 rows of 16,384 are 128 KiB

struct Mv1Args {
  const uint8_t* q;
  const uint8_t* s;
  int64_t k;
  int n_steps, n_chunks, n_super, tiles;
  int lsplit;        // log2 S: warps per tile
  int rounds;        // rounds per warp per tile: ceil(n_chunks / (kRound * S))
  int groups;        // tile groups of 8 / S tiles
  int groups_q, groups_r;  // groups per CTA: groups_q, one more for blockIdx.x < groups_r (set by the launch)
  const int8_t* xq;
  const float* xs;
  float* y;
  int64_t n_out;
  int accumulate;
  int resid_early;  // accumulate: the CTA's first group reads its residual rows right after pdl_wait
  int x_early;      // stage_x requests the thread's first step before the deferred norm's sums
  int rope_on;      // 1: y is the stacked QKV product, finished by rope_store (kEpiRope, or an instance with kRunRope)
  RopeKvArgs rope;
  int rope_cs;      // rope_on: each warp copies the token's cos / sin row to shared memory before pdl_wait
  int glu_up_tile;  // Glu variant: first tile of the up rows
  int glu_tiles;    // Glu variant: tiles of outputs (ffn / 16) in each half
  ActBuf glu_out;   // Glu variant: the down product's input (Q8_0, F16, BF16 or F32), row 0
  const double* rms_part;  // deferred RMSNorm of the staged row (ActBuf::rms_part), or null
  float rms_eps;
  const float* norm_w;     // Norm variant: the next RMSNorm's weight of each output row
  ActBuf norm_out;         // Norm variant: Q8_0 codes of y * norm_w, unnormalised block scales (row 0)
  double* norm_part;       // Norm variant: per block of 32 outputs, the sum of y^2
  const float* glu_src;    // the row is SwiGLU(gate/up) computed while staging (ActBuf::glu_src), or null
  int64_t glu_offset;
  int64_t glu_scratch;     // byte offset of its Q8_0 row (k codes, k / 32 scales) in the dynamic shared memory
  unsigned long long* argmax;  // Argmax variant: the largest row's key (argmax_key), raised with atomicMax
  int l2_items;      // items after the first whose weights and scales a warp prefetches into L2 before pdl_wait
  // 2-4 tokens (mv1_kernel's NT): token t's output row at y + t * ldy, SwiGLU source at glu_src + t * glu_ld,
  // staged row at t * x_stride bytes into the dynamic shared memory (its input rows are the row planes').
  int64_t ldy;
  int64_t glu_ld;
  int64_t x_stride;
};

// Epilogues of the kernel: plain rows, SwiGLU of stacked gate/up rows, plain rows plus the next RMSNorm's
// input with a deferred scale (matvec1_norm), plain rows plus their argmax, or RoPE + K/V write of a stacked
// QKV product (rope_on). Each has a lean kernel instance that carries no other's code (matvec1.cu also builds
// mid and general instances, which decide RoPE and / or the SwiGLU staging at run time: pick_instance).
enum Epi : int { kEpiPlain = 0, kEpiGlu = 1, kEpiNorm = 2, kEpiArgmax = 3, kEpiRope = 4 };
constexpr int kEpis = 5;

// Scale words per round: per k-step (Q8_0, Q4_0: half2 of rows g, g + 8; MXFP4: their e8m0 bytes), per
// super-block (TQ2_0: half2), none (Q4_K: two 16-byte headers instead).
__host__ __device__ constexpr int round_scales(int f) {
  return f == kQ8_0 ? kRound : f == kTQ2 ? 2 : 1;
}

template <int F>
struct Round {
  uint4 w[kRound];
  uint32_t s[round_scales(F)];
  uint4 h[F == kQ4_K ? 2 : 1];
  uint4 sv[F == kQ4_0 ? 2 : 1];  // Q4_0 / MXFP4: the round's grouped scales (matrix_layout.cuh)
};

// Scale word of k-step j (0..7) of a round, rows g and g + 8: Q4_0 a half2, MXFP4 two e8m0 bytes.
template <int F>
__device__ __forceinline__ uint32_t scale_word(const Round<F>& r, int j) {
  if constexpr (F == kQ4_0) {
    const uint4& v = r.sv[j >> 2];
    const int w = j & 3;
    return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
  } else {
    const uint4& v = r.sv[0];
    const int w = j >> 1;
    const uint32_t b = w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
    return (j & 1) ? b >> 16 : b & 0xFFFFu;
  }
}

// Loads round (tile, chunks c0 .. c0 + 3); nc is 0 for a tile past the end, so nothing is loaded. X (exact):
// every round that starts is whole (n_chunks % kRound == 0, and for Q4_0 / MXFP4 an even n_steps), so the
// chunks need no predicate and load from one address at immediate offsets.
template <int F, bool X>
__device__ __forceinline__ void load_round(const Mv1Args& p, int tile, int c0, int nc, int lane, Round<F>& r) {
  const int g = lane >> 2;
  if constexpr (X) {
    if (c0 >= nc) return;
    const uint4* qp = reinterpret_cast<const uint4*>(p.q) + ((int64_t)tile * p.n_chunks + c0) * 32 + lane;
#pragma unroll
    for (int u = 0; u < kRound; ++u) r.w[u] = load_stream(qp + u * 32);
  } else {
    const uint4* qp = reinterpret_cast<const uint4*>(p.q) + (int64_t)tile * p.n_chunks * 32 + lane;
#pragma unroll
    for (int u = 0; u < kRound; ++u)
      if (c0 + u < nc) r.w[u] = load_stream(qp + (int64_t)(c0 + u) * 32);
    if (c0 >= nc) return;
  }
  const int step0 = c0 * steps_per_chunk(F);
  // Scale indices past the end are clamped rather than predicated (those scales are never used): with
  // unpredicated loads ptxas fits Q4_0 in 80 registers without spills; Q8_0 is the opposite (it spills with
  // clamping, and at 128 registers does not with predication). Found with -Xptxas -v, not by reasoning.
  if constexpr (F == kQ8_0) {
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(p.s) + ((int64_t)tile * p.n_steps + step0) * 8 + g;
#pragma unroll
    for (int j = 0; j < round_scales(F); ++j)
      if (X || step0 + j < p.n_steps) r.s[j] = __ldg(sp + j * 8);
  } else if constexpr (F == kQ4_0) {  // rounds start at multiples of 8 steps: one scale group
    const uint4* sp = reinterpret_cast<const uint4*>(
        reinterpret_cast<const uint16_t*>(p.s) + grouped_scale_index(tile, p.n_steps, step0, g));
    r.sv[0] = __ldg(sp);
    r.sv[1] = __ldg(sp + 1);
  } else if constexpr (F == kMXFP4) {
    r.sv[0] = __ldg(reinterpret_cast<const uint4*>(p.s + grouped_scale_index(tile, p.n_steps, step0, g)));
  } else if constexpr (F == kTQ2) {  // n_steps % 8 == 0: a round's chunks cover whole super-blocks
    const uint32_t* sp = reinterpret_cast<const uint32_t*>(p.s) + (int64_t)tile * p.n_super * 8 + g;
#pragma unroll
    for (int j = 0; j < 2; ++j) r.s[j] = __ldg(sp + (int64_t)min(step0 / 8 + j, p.n_super - 1) * 8);
  } else {  // Q4_K: n_chunks % 4 == 0, so a started round is a whole super-block
    const uint4* hp = reinterpret_cast<const uint4*>(p.s) + ((int64_t)tile * p.n_super + step0 / 8) * 16;
    r.h[0] = __ldg(hp + g);
    r.h[1] = __ldg(hp + g + 8);
  }
}

// Requests into L2 what load_round(tile, c0, nc) will read: the round's chunks (contiguous, 512 bytes each)
// and its scales (contiguous per round in every layout). One lane per warp calls it, before pdl_wait, for
// the rounds after the first: the weight stream then keeps DRAM busy through the previous kernel's tail and
// this kernel's staging, when the register-held first round is all a warp would otherwise have in flight.
template <int F>
__device__ __forceinline__ void prefetch_round(const Mv1Args& p, int tile, int c0, int nc) {
  if (c0 >= nc) return;
  prefetch_l2(p.q + ((int64_t)tile * p.n_chunks + c0) * 512, (uint32_t)min(kRound, nc - c0) * 512u);
  const int step0 = c0 * steps_per_chunk(F);
  if constexpr (F == kQ4_0) {
    prefetch_l2(p.s + grouped_scale_index(tile, p.n_steps, step0, 0) * 2, 256u);
  } else if constexpr (F == kMXFP4) {
    prefetch_l2(p.s + grouped_scale_index(tile, p.n_steps, step0, 0), 128u);
  } else if constexpr (F == kQ8_0) {
    prefetch_l2(p.s + ((int64_t)tile * p.n_steps + step0) * 32, (uint32_t)min(kRound, p.n_steps - step0) * 32u);
  } else if constexpr (F == kTQ2) {
    prefetch_l2(p.s + ((int64_t)tile * p.n_super + step0 / 8) * 32, (uint32_t)min(2, p.n_super - step0 / 8) * 32u);
  } else {  // Q4_K
    prefetch_l2(p.s + ((int64_t)tile * p.n_super + step0 / 8) * 256, 256u);
  }
}

// The two halves of a 32-bit scale word (rows g and g + 8) as floats.
__device__ __forceinline__ float2 half2_bits(uint32_t b) {
  return make_float2(half_bits_to_f32((uint16_t)(b & 0xFFFFu)), half_bits_to_f32((uint16_t)(b >> 16)));
}

__device__ __forceinline__ int dp4a(uint32_t a, uint32_t b, int c) { return __dp4a((int)a, (int)b, c); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// MXFP4: dot product of 8 codes (one 32-bit word of a chunk; nibbles in the order v0 v8 v1 v9 v2 v10 v3 v11)
// with the activations staged in that order (xa, xb). The codes index prmt directly (a selector nibble
// picks a byte, or with bit 3 set replicates that byte's sign): lookup P' with the code gives P[c] + 1 for
// c in 1..7, P[0] = 0 for c = 0 and 0 for c >= 8; lookup N with c ^ 8 gives N[c - 8] (the negative values)
// for c >= 8 and -1 for c in 1..7, 0 for c = 0. Their bytewise sum is the value; dp4a is linear, so the two
// lookups are dotted separately and no bytewise add (with its carries) is needed.
__device__ __forceinline__ int mxfp4_dot(uint32_t w, uint32_t xa, uint32_t xb, int acc) {
  constexpr uint32_t kPLo = 0x04030200u, kPHi = 0x0D090705u;  // P' = {0, 2, 3, 4, 5, 7, 9, 13}
  constexpr uint32_t kNLo = 0xFDFEFF00u, kNHi = 0xF4F8FAFCu;  // N = -{0, 1, 2, 3, 4, 6, 8, 12}
  const uint32_t wn = w ^ 0x88888888u;
  acc = dp4a(prmt(kPLo, kPHi, w), xa, acc);
  acc = dp4a(prmt(kNLo, kNHi, wn), xa, acc);
  acc = dp4a(prmt(kPLo, kPHi, w >> 16), xb, acc);
  return dp4a(prmt(kNLo, kNHi, wn >> 16), xb, acc);
}

// Staged activations of k-step `step` for lane column group t: Q8_0 layout x[4t..4t+3], x[16+4t..16+4t+3];
// MXFP4 the same bytes interleaved as the nibbles of a code word (see stage_x).
__device__ __forceinline__ uint2 x_at(const uint2* xq, int step, int t) { return xq[step * 4 + t]; }

// One round of a warp: adds rows g and g + 8's partial sums over this lane's columns to acc0 / acc1, for each
// of the NT tokens whose staged rows lie p.x_stride bytes apart (NT > 1: Q8_0, Q4_0, MXFP4 only). A weight
// word's masks, scales and lookups are computed once for all tokens.
template <int F, bool X, int NT>
__device__ __forceinline__ void compute_round(const Mv1Args& p, const Round<F>& r, int c0, int nc, const uint2* xq,
                                              const float* xs, int t, float (&acc0)[NT], float (&acc1)[NT]) {
  static_assert(NT == 1 || F == kQ8_0 || F == kQ4_0 || F == kMXFP4, "several tokens: Q8_0-reading formats only");
  if (c0 >= nc) return;
  constexpr uint32_t kLo = 0x0F0F0F0Fu;
  const int64_t ts = NT == 1 ? 0 : p.x_stride;  // bytes between two tokens' staged rows
  auto xq_of = [&](int tt) { return reinterpret_cast<const uint2*>(reinterpret_cast<const uint8_t*>(xq) + tt * ts); };
  auto xs_of = [&](int tt) { return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(xs) + tt * ts); };
  if constexpr (F == kQ8_0) {
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      const int step = c0 + u;
      if (!X && step >= nc) break;
      const float2 ws = half2_bits(r.s[u]);
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) {
        const uint2 x = x_at(xq_of(tt), step, t);
        const int d0 = dp4a(r.w[u].x, x.x, dp4a(r.w[u].z, x.y, kIntBias));
        const int d1 = dp4a(r.w[u].y, x.x, dp4a(r.w[u].w, x.y, kIntBias));
        const float sx = xs_of(tt)[step];
        acc0[tt] = fmaf(biased_to_float(d0), ws.x * sx, acc0[tt]);
        acc1[tt] = fmaf(biased_to_float(d1), ws.y * sx, acc1[tt]);
      }
    }
  } else if constexpr (F == kQ4_0 || F == kMXFP4) {
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      if (!X && c0 + u >= nc) break;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int step = (c0 + u) * 2 + j;
        if (!X && step >= p.n_steps) break;  // the last chunk of an odd n_steps has no second step
        const uint32_t w0 = j == 0 ? r.w[u].x : r.w[u].z, w1 = j == 0 ? r.w[u].y : r.w[u].w;  // rows g, g + 8
        const uint32_t sw = scale_word<F>(r, 2 * u + j);
        if constexpr (F == kQ4_0) {
          // Codes are value + 8: dot(code, x) - 8 * sum(x); the correction -8 * sum(x) of the lane's 8 bytes
          // and the block scale come staged with them (stage_x), one 16-byte shared load per step.
          const float2 ws = half2_bits(sw);
#pragma unroll
          for (int tt = 0; tt < NT; ++tt) {
            const uint4 xv = reinterpret_cast<const uint4*>(xq_of(tt))[step * 4 + t];
            const int corr = (int)xv.z;  // includes kIntBias
            const float sx = __int_as_float((int)xv.w);
            const int d0 = dp4a(w0 & kLo, xv.x, dp4a((w0 >> 4) & kLo, xv.y, corr));
            const int d1 = dp4a(w1 & kLo, xv.x, dp4a((w1 >> 4) & kLo, xv.y, corr));
            acc0[tt] = fmaf(biased_to_float(d0), ws.x * sx, acc0[tt]);
            acc1[tt] = fmaf(biased_to_float(d1), ws.y * sx, acc1[tt]);
          }
        } else {
          const float s0 = e8m0_half((uint8_t)(sw & 0xFF)), s1 = e8m0_half((uint8_t)((sw >> 8) & 0xFF));
#pragma unroll
          for (int tt = 0; tt < NT; ++tt) {
            const uint2 x = x_at(xq_of(tt), step, t);
            const float sx = xs_of(tt)[step];
            const int d0 = mxfp4_dot(w0, x.x, x.y, kIntBias), d1 = mxfp4_dot(w1, x.x, x.y, kIntBias);
            acc0[tt] = fmaf(biased_to_float(d0), s0 * sx, acc0[tt]);
            acc1[tt] = fmaf(biased_to_float(d1), s1 * sx, acc1[tt]);
          }
        }
      }
    }
  } else if constexpr (F == kQ4_K) {
    // The round is one super-block (8 sub-blocks of 32): value = d * sc_j * q - dmin * m_j, q in 0..15. Sums
    // stay integer over the super-block: S1 = sum_j sc_j dot(q, x), S2 = sum_j m_j sum(x) (dp4a with m_j in
    // every byte), then one float step with d, dmin and the activation's super-block scale.
    int s1[2] = {0, 0}, s2[2] = {0, 0};
    uint32_t sc[2][2], mn[2][2];  // [row][sub-blocks 0-3 / 4-7]: the 6-bit scales and mins, one per byte
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const uint4 h = r.h[rr];
      sc[rr][0] = h.y & 0x3F3F3F3Fu;
      mn[rr][0] = h.z & 0x3F3F3F3Fu;
      sc[rr][1] = (h.w & kLo) | ((h.y >> 2) & 0x30303030u);
      mn[rr][1] = ((h.w >> 4) & kLo) | ((h.z >> 2) & 0x30303030u);
    }
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int i = 2 * u + j, step = c0 * 2 + i;
        const uint32_t w0 = j == 0 ? r.w[u].x : r.w[u].z, w1 = j == 0 ? r.w[u].y : r.w[u].w;
        const uint2 x = x_at(xq, step, t);
        const uint32_t wr[2] = {w0, w1};
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int d = dp4a(wr[rr] & kLo, x.x, dp4a((wr[rr] >> 4) & kLo, x.y, 0));
          const int scj = (int)((sc[rr][i >> 2] >> (8 * (i & 3))) & 0xFF);
          const uint32_t m4 = prmt(mn[rr][i >> 2], 0, (uint32_t)(i & 3) * 0x1111u);  // m_j in all 4 bytes
          s1[rr] += scj * d;
          s2[rr] = dp4a(m4, x.x, dp4a(m4, x.y, s2[rr]));
        }
      }
    }
    const float sx = xs[c0 * 2];  // Q8_K: the super-block's d, repeated per block
    const float2 dm0 = half2_bits(r.h[0].x);
    const float2 dm1 = half2_bits(r.h[1].x);
    acc0[0] = fmaf(sx, dm0.x * (float)s1[0] - dm0.y * (float)s2[0], acc0[0]);
    acc1[0] = fmaf(sx, dm1.x * (float)s1[1] - dm1.y * (float)s2[1], acc1[0]);
  } else {  // kTQ2: 4 k-steps per chunk in bit pairs, value = code - 1; two chunks per super-block
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int cb = c0 + 2 * half;
      if (cb >= nc) break;  // n_chunks is even: super-blocks are whole
      int s0 = 0, s1 = 0, corr = kIntBias;  // super-block sums stay below 2^18
#pragma unroll
      for (int u = 2 * half; u < 2 * half + 2; ++u) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int step = (c0 + u) * 4 + j;
          const uint32_t c = j == 0 ? r.w[u].x : j == 1 ? r.w[u].y : j == 2 ? r.w[u].z : r.w[u].w;
          const uint2 x = x_at(xq, step, t);
          // bit pairs: row g cols 4t.. (bits 0-1 of each byte), row g + 8 (2-3), row g cols 16+4t.. (4-5),
          // row g + 8 (6-7)
          s0 = dp4a(c & 0x03030303u, x.x, dp4a((c >> 4) & 0x03030303u, x.y, s0));
          s1 = dp4a((c >> 2) & 0x03030303u, x.x, dp4a((c >> 6) & 0x03030303u, x.y, s1));
          corr = dp4a(0xFFFFFFFFu, x.x, dp4a(0xFFFFFFFFu, x.y, corr));  // - sum(x): the codes are value + 1
        }
      }
      const float sx = xs[cb * 4];
      const float2 ws = half2_bits(r.s[half]);
      acc0[0] = fmaf(biased_to_float(s0 + corr), ws.x * sx, acc0[0]);
      acc1[0] = fmaf(biased_to_float(s1 + corr), ws.y * sx, acc1[0]);
    }
  }
}

}  // namespace
}  // namespace merlin::cuda
