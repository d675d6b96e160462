// Single-token products (matvec1.h) over the fragment-ordered weights of repack.cu.
//
// At one token the general product's m16n8k32 runs 7 zero token columns and a full float epilogue per
// k-step, which makes the 4-bit formats instruction-bound. Here each lane does the one live column with
// __dp4a: its 16-byte chunk holds rows g and g + 8 of a tile (g = lane / 4) for the columns 4t..4t+3 and
// 16+4t..16+4t+3 (t = lane % 4) of one or more k-steps, so two dp4a per row and step consume the matching
// 8 activation bytes, which every CTA stages once in shared memory, permuted so that lane t reads them
// with one 8-byte load. Lanes keep per-row partial sums over their columns; the 4 lanes of a row meet by
// shuffles at the end of a tile.
//
// Integer sums stay per k-step (Q4_K, TQ2_0: per super-block) and are scaled once, like the CPU reference.
//
// Work split: a CTA of 8 warps handles 8 / S tiles at a time, S warps per tile splitting its chunks in
// rounds of 4 chunks (S in 1, 2, 4, 8, chosen on the host for the best balance over the resident CTAs: a
// 4096 x 16384 matrix has only 256 tiles, so 8 warps share each). As in matmul.cu the grid is persistent,
// two rounds alternate in registers (the loop is unrolled by two: a register copy would wait on the loads
// in flight), the first round is requested before pdl_wait, and the S partial sums of a row are added in
// shared memory in a fixed order: results are deterministic.
//
// F16/BF16 rows have their own kernel (matvec1_half.cu). With rope_on (matmul_rope_kv) the epilogue of a
// stacked QKV product applies RoPE and writes K/V to the cache itself (rope_kv.cuh).
//
// The Glu variant (matvec1_swiglu) multiplies a stacked [gate; up] matrix and writes silu(gate) * up in the
// down product's input format, so one-token steps need no SwiGLU kernel: a tile group takes its first half
// of tiles from the gate rows and the second half from the same rows of up (S <= 2, so a group holds at
// least 32 outputs, a whole Q8_0 block), and after the group's reduction its first warps run act_impl.cuh's
// swiglu() and emit() on them, the functions prep_kernel runs, on the same row sums: the same bits.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/sys.h"
#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/rope_kv.cuh"

namespace merlin::cuda {
namespace {

constexpr int kWarps = 8;       // a CTA of the plain and Glu variants
constexpr int kNormWarps = 16;  // a CTA of the Norm variant (see warps_of)
constexpr int kRound = 4;              // chunks per round: one Q4_K super-block, two TQ2_0 super-blocks
constexpr int64_t kMaxK = 65536;       // longest row whose activations fit the staged shared memory
constexpr int64_t kKBucket = 4096;     // occupancy is tabulated per bucket of k (shared memory grows with k)
constexpr int kBuckets = (int)(kMaxK / kKBucket);

struct Mv1Args {
  const uint8_t* q;
  const uint8_t* s;
  int64_t k;
  int n_steps, n_chunks, n_super, tiles;
  int lsplit;        // log2 S: warps per tile
  int rounds;        // rounds per warp per tile: ceil(n_chunks / (kRound * S))
  int groups;        // tile groups of 8 / S tiles
  const int8_t* xq;
  const float* xs;
  float* y;
  int64_t n_out;
  int accumulate;
  int resid_early;  // accumulate: the CTA's first group reads its residual rows right after pdl_wait
  int x_early;      // stage_x requests the thread's first step before the deferred norm's sums
  int rope_on;      // 1: y is the stacked QKV product, finished by rope_store (matmul_rope_kv)
  RopeKvArgs rope;
  int glu_up_tile;  // Glu variant: first tile of the up rows
  int glu_tiles;    // Glu variant: tiles of outputs (ffn / 16) in each half
  ActBuf glu_out;   // Glu variant: the down product's input (Q8_0, F16, BF16 or F32), row 0
  const double* rms_part;  // deferred RMSNorm of the staged row (ActBuf::rms_part), or null
  float rms_eps;
  const float* norm_w;     // Norm variant: the next RMSNorm's weight of each output row
  ActBuf norm_out;         // Norm variant: Q8_0 codes of y * norm_w, unnormalised block scales (row 0)
  double* norm_part;       // Norm variant: per block of 32 outputs, the sum of y^2
};

// Epilogues of the kernel: plain rows, SwiGLU of stacked gate/up rows, or plain rows plus the next RMSNorm's
// input with a deferred scale (matvec1_norm).
enum Epi : int { kEpiPlain = 0, kEpiGlu = 1, kEpiNorm = 2 };

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

// One round of a warp: adds rows g and g + 8's partial sums over this lane's columns to acc0 / acc1.
template <int F, bool X>
__device__ __forceinline__ void compute_round(const Mv1Args& p, const Round<F>& r, int c0, int nc, const uint2* xq,
                                              const float* xs, int t, float& acc0, float& acc1) {
  if (c0 >= nc) return;
  constexpr uint32_t kLo = 0x0F0F0F0Fu;
  if constexpr (F == kQ8_0) {
#pragma unroll
    for (int u = 0; u < kRound; ++u) {
      const int step = c0 + u;
      if (!X && step >= nc) break;
      const uint2 x = x_at(xq, step, t);
      const int d0 = dp4a(r.w[u].x, x.x, dp4a(r.w[u].z, x.y, kIntBias));
      const int d1 = dp4a(r.w[u].y, x.x, dp4a(r.w[u].w, x.y, kIntBias));
      const float2 ws = half2_bits(r.s[u]);
      const float sx = xs[step];
      acc0 = fmaf(biased_to_float(d0), ws.x * sx, acc0);
      acc1 = fmaf(biased_to_float(d1), ws.y * sx, acc1);
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
          const uint4 xv = reinterpret_cast<const uint4*>(xq)[step * 4 + t];
          const int corr = (int)xv.z;  // includes kIntBias
          const float sx = __int_as_float((int)xv.w);
          const int d0 = dp4a(w0 & kLo, xv.x, dp4a((w0 >> 4) & kLo, xv.y, corr));
          const int d1 = dp4a(w1 & kLo, xv.x, dp4a((w1 >> 4) & kLo, xv.y, corr));
          const float2 ws = half2_bits(sw);
          acc0 = fmaf(biased_to_float(d0), ws.x * sx, acc0);
          acc1 = fmaf(biased_to_float(d1), ws.y * sx, acc1);
        } else {
          const uint2 x = x_at(xq, step, t);
          const float sx = xs[step];
          const int d0 = mxfp4_dot(w0, x.x, x.y, kIntBias), d1 = mxfp4_dot(w1, x.x, x.y, kIntBias);
          acc0 = fmaf(biased_to_float(d0), e8m0_half((uint8_t)(sw & 0xFF)) * sx, acc0);
          acc1 = fmaf(biased_to_float(d1), e8m0_half((uint8_t)((sw >> 8) & 0xFF)) * sx, acc1);
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
    acc0 = fmaf(sx, dm0.x * (float)s1[0] - dm0.y * (float)s2[0], acc0);
    acc1 = fmaf(sx, dm1.x * (float)s1[1] - dm1.y * (float)s2[1], acc1);
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
      acc0 = fmaf(biased_to_float(s0 + corr), ws.x * sx, acc0);
      acc1 = fmaf(biased_to_float(s1 + corr), ws.y * sx, acc1);
    }
  }
}

// Copies the token's activation codes and block scales to shared memory. Step s's 32 codes become 4 groups
// of 8 bytes, group t = the bytes lane t multiplies: x[4t..4t+3], x[16+4t..16+4t+3], for MXFP4 interleaved
// (x[4t], x[16+4t], x[4t+1], x[16+4t+1], ...) like the nibbles of its code words.
// Q4_0 stages 16 bytes per step and lane group instead: the 8 bytes, then -8 times their sum and the
// block scale, so its inner loop reads one vector per step (stage_bytes).
// With a deferred RMSNorm (rms_part) the row's block scales lack 1 / rms(x): every warp sums the per-block
// sums of squares (in double, in a fixed order, like row_scale) and the staged scale is the product rounded
// to half, as prep_act rounds a block scale.
__device__ __forceinline__ float deferred_rms(const Mv1Args& p) {
  return deferred_inv_rms(p.rms_part, (int)(p.k / 32), p.k, p.rms_eps);
}

// Only formats that read Q8_0 rows (Q4_K and TQ2_0 read Q8_K: the host never defers their norm, and the
// dead branch made ptxas spill in TQ2_0's kernel).
template <int F>
__device__ __forceinline__ constexpr bool reads_q8_0() { return F == kQ8_0 || F == kQ4_0 || F == kMXFP4; }

// A block scale as staged: with a deferred RMSNorm times 1 / rms, rounded to half.
template <int F>
__device__ __forceinline__ float staged_scale(const Mv1Args& p, float x, float rms) {
  if constexpr (reads_q8_0<F>()) return p.rms_part ? round_to_half(x * rms) : x;
  return x;
}

// Stages step s: its codes a (bytes 0..15) and b (16..31) and its staged block scale.
template <int F>
__device__ __forceinline__ void stage_step(uint8_t* sm, int64_t k, int s, uint4 a, uint4 b, float scale) {
  uint4* dst = reinterpret_cast<uint4*>(sm);
  if constexpr (F == kQ4_0) {
    const uint32_t sx = __float_as_uint(scale);
    const uint32_t lo[4] = {a.x, a.y, a.z, a.w}, hi[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int t = 0; t < 4; ++t)
      dst[4 * s + t] =
          make_uint4(lo[t], hi[t], (uint32_t)dp4a(0xF8F8F8F8u, lo[t], dp4a(0xF8F8F8F8u, hi[t], kIntBias)), sx);
    return;
  }
  if constexpr (F == kMXFP4) {
    dst[2 * s] = make_uint4(__byte_perm(a.x, b.x, 0x5140), __byte_perm(a.x, b.x, 0x7362),
                            __byte_perm(a.y, b.y, 0x5140), __byte_perm(a.y, b.y, 0x7362));
    dst[2 * s + 1] = make_uint4(__byte_perm(a.z, b.z, 0x5140), __byte_perm(a.z, b.z, 0x7362),
                                __byte_perm(a.w, b.w, 0x5140), __byte_perm(a.w, b.w, 0x7362));
  } else {
    dst[2 * s] = make_uint4(a.x, b.x, a.y, b.y);
    dst[2 * s + 1] = make_uint4(a.z, b.z, a.w, b.w);
  }
  reinterpret_cast<float*>(sm + k)[s] = scale;
}

// The thread's first step is requested before the deferred norm's sums of squares, so that the two L2 round
// trips overlap instead of following each other (rows of up to W * 32 blocks, every row here but the
// longest, have no other step).
template <int F, int W>
__device__ __forceinline__ void stage_x(const Mv1Args& p, uint8_t* sm) {
  constexpr int kT = W * 32;
  const int kb = (int)(p.k / 32), s0 = threadIdx.x;
  const uint4* src = reinterpret_cast<const uint4*>(p.xq);  // activation buffers are 256-byte aligned
  uint4 a0{}, b0{};
  float x0 = 0.0f;
  auto first = [&] {
    if (s0 < kb) {
      a0 = src[2 * s0];
      b0 = src[2 * s0 + 1];
      x0 = p.xs[s0];
    }
  };
  if (p.x_early) first();
  float rms = 1.0f;
  if constexpr (reads_q8_0<F>()) {
    if (p.rms_part) rms = deferred_rms(p);
  }
  if (!p.x_early) first();  // A/B timing only (MERLIN_CUDA_MV1_STAGE=0): the sums first, then the row
  if (s0 < kb) stage_step<F>(sm, p.k, s0, a0, b0, staged_scale<F>(p, x0, rms));
  for (int s = s0 + kT; s < kb; s += kT) stage_step<F>(sm, p.k, s, src[2 * s], src[2 * s + 1], staged_scale<F>(p, p.xs[s], rms));
  __syncthreads();
}

// Where a warp is in its (tile group, round) sequence; every warp of the CTA walks the same number of items,
// so the per-group reduction (a CTA barrier) comes at the same item for all.
struct Cursor {
  int grp, r;  // group index (global) and round
};

// The next RMSNorm's input from 32 consecutive final rows y (one per lane, row = the lane's row), with a
// deferred scale (norm_block); a single-token reader completes it in stage_x (deferred_rms).
__device__ __forceinline__ void emit_norm(const Mv1Args& p, int64_t row, float y, float w) {
  const NormBlock b = norm_block(y, w);
  p.norm_out.q[row] = (int8_t)b.q;
  if ((threadIdx.x & 31) == 0) {
    p.norm_out.scale[row / 32] = b.scale;
    p.norm_out.sum[row / 32] = b.sum;
    p.norm_part[row / 32] = b.sum_sq;
  }
}

// Adds the S warps' row sums of the tile group in a fixed order and writes (or adds) the outputs.
// With rope_on, row r goes through rope_store with its pair partner r ^ 1 (same tile): lane ^ 4 holds it
// when a warp owns the tile, thread ^ 1 after the shared-memory reduction.
// With `early`, res0 / res1 hold the rows' previous values (prefetch_residual), read before the group's
// work instead of after it: the same sums, one memory round trip less at the end of a decode step's kernel.
// Norm: S >= 2 (the host sees to it), so whole warps hold 32 consecutive rows, one Q8_0 block of the next
// RMSNorm's input, which emit_norm writes from the rows' final values (nw: the thread's row's norm weight).
template <bool Norm, int W>
__device__ __forceinline__ void finish_group(const Mv1Args& p, int grp, int warp, int lane, float acc0, float acc1,
                                             float (*red)[16], const RopeTarget& at, bool early, float res0,
                                             float res1, float nw) {
  // The 4 lanes of a row: xor shuffles give every lane the same sum (float addition is commutative).
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
  if (!Norm && S == 1) {  // a warp owns its tile: no barrier needed
    if (p.rope_on) {
      const float w0 = __shfl_xor_sync(0xffffffffu, acc0, 4), w1 = __shfl_xor_sync(0xffffffffu, acc1, 4);
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if ((lane & 3) == 0 && r0 < p.n_out) rope_store(p.rope, p.y, r0, acc0, w0, at);
      if ((lane & 3) == 0 && r0 + 8 < p.n_out) rope_store(p.rope, p.y, r0 + 8, acc1, w1, at);
      return;
    }
    if ((lane & 3) == 0) {
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if (r0 < p.n_out) p.y[r0] = p.accumulate ? (early ? res0 : p.y[r0]) + acc0 : acc0;
      if (r0 + 8 < p.n_out) p.y[r0 + 8] = p.accumulate ? (early ? res1 : p.y[r0 + 8]) + acc1 : acc1;
    }
    return;
  }
  if ((lane & 3) == 0) {
    red[warp][lane >> 2] = acc0;
    red[warp][(lane >> 2) + 8] = acc1;
  }
  __syncthreads();
  const int n_act = tpg * 16;
  if ((int)threadIdx.x < ((n_act + 31) & ~31)) {  // whole warps, for the partner shuffle
    const bool act = (int)threadIdx.x < n_act;
    const int ts = threadIdx.x >> 4, rr = threadIdx.x & 15;
    float v = 0.f;
    if (act)
      for (int s = 0; s < S; ++s) v += red[ts * S + s][rr];
    const int64_t row = ((int64_t)grp * tpg + ts) * 16 + rr;
    if (p.rope_on) {
      const float w = __shfl_xor_sync(0xffffffffu, v, 1);
      if (act && row < p.n_out) rope_store(p.rope, p.y, row, v, w, at);
    } else if (Norm) {
      const bool valid = act && row < p.n_out;  // n_out % 32 == 0: whole warps valid or not
      if (valid) {
        const float y = p.accumulate ? (early ? res0 : p.y[row]) + v : v;
        p.y[row] = y;
        emit_norm(p, row, y, nw);
      }
    } else if (act && row < p.n_out) {
      p.y[row] = p.accumulate ? (early ? res0 : p.y[row]) + v : v;
    }
  }
  // No second barrier: the next group uses the other half of the (double) red buffer, and a warp can only
  // write that half again after the next group's barrier, which every reader of this half has passed.
}

// Glu variant: the group's gate tiles are slots 0 .. tpg/2 - 1, the matching up tiles the others. Output o of
// the group (gate row and up row o) is summed in the order finish_group sums a row, then emitted by whole
// warps (32 consecutive outputs: one Q8_0 block).
__device__ __forceinline__ void finish_glu(const Mv1Args& p, int grp, int warp, int lane, float acc0, float acc1,
                                           float (*red)[16]) {
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
template <int W>
__device__ __forceinline__ void prefetch_residual(const Mv1Args& p, int grp, int warp, int lane, float& res0,
                                                  float& res1) {
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
  if (S == 1) {
    if ((lane & 3) == 0) {
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if (r0 < p.n_out) res0 = p.y[r0];
      if (r0 + 8 < p.n_out) res1 = p.y[r0 + 8];
    }
  } else if ((int)threadIdx.x < tpg * 16) {
    const int64_t row = ((int64_t)grp * tpg + (threadIdx.x >> 4)) * 16 + (threadIdx.x & 15);
    if (row < p.n_out) res0 = p.y[row];
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

template <int F, int MB, int E, bool X>
__global__ void __launch_bounds__(warps_of(E) * 32, MB) mv1_kernel(Mv1Args p) {
  constexpr bool Glu = E == kEpiGlu, Norm = E == kEpiNorm;
  constexpr int W = warps_of(E);
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[2][W][16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int S = 1 << p.lsplit;
  const int slot = warp >> p.lsplit, sub = warp & (S - 1);
  const int tpg = W >> p.lsplit;
  // Items of this CTA: groups blockIdx.x, + gridDim.x, ...; rounds 0 .. rounds - 1 of each.
  const int bx = (int)blockIdx.x, nb = (int)gridDim.x;
  const int my_groups = bx < p.groups ? (p.groups - bx + nb - 1) / nb : 0;
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
  if (n_items > 0) load_round<F, X>(p, tile_of(cur), chunk_of(cur), nc_of(cur), lane, ra);
  const RopeTarget at = p.rope_on ? rope_target(p.rope) : RopeTarget{};
  float nw = Norm && n_items > 0 ? norm_weight<W>(p, bx) : 0.0f;  // the first group's, like its first round
  pdl_trigger();
  pdl_wait();
  bool early = !Glu && p.accumulate && p.resid_early && n_items > 0;
  float res0 = 0.f, res1 = 0.f;
  if (early) prefetch_residual<W>(p, (int)blockIdx.x, warp, lane, res0, res1);
  stage_x<F, W>(p, smem);
  const uint2* xq = reinterpret_cast<const uint2*>(smem);
  const float* xs = reinterpret_cast<const float*>(smem + p.k);
  float acc0 = 0.f, acc1 = 0.f;
  int parity = 0;
  // Item i: request item i + 1 into `next`, compute `now`, finish the tile group after its last round.
  auto item = [&](int i, const Round<F>& now, Round<F>& next) {
    Cursor nx = cur;
    advance(p, nx);
    if (i + 1 < n_items) load_round<F, X>(p, tile_of(nx), chunk_of(nx), nc_of(nx), lane, next);
    compute_round<F, X>(p, now, chunk_of(cur), nc_of(cur), xq, xs, t, acc0, acc1);
    if (cur.r == p.rounds - 1) {
      if constexpr (Glu) finish_glu(p, cur.grp, warp, lane, acc0, acc1, red[parity]);
      else finish_group<Norm, W>(p, cur.grp, warp, lane, acc0, acc1, red[parity], at, early, res0, res1, nw);
      early = false;
      if constexpr (Norm) {
        if (i + 1 < n_items) nw = norm_weight<W>(p, nx.grp);  // requested before the next group's rounds
      }
      parity ^= 1;
      acc0 = acc1 = 0.f;
    }
    cur = nx;
  };
  for (int i = 0; i < n_items; i += 2) {
    item(i, ra, rb);
    if (i + 1 < n_items) item(i + 1, rb, ra);
  }
}

// Staged activation bytes (stage_x): codes and scales, for Q4_0 16 bytes per 8 codes.
template <int F>
size_t smem_bytes(int64_t k) { return F == kQ4_0 ? (size_t)k * 2 : (size_t)k + (size_t)(k / 32) * 4; }

int g_sm_count = 0;
int g_split_override = -1;  // set_matvec1_split (tests): log2 of the warps per tile, -1 = chosen per matrix
// The kernels built per format: the register budget MB (3 only for non-exact plain products, forced by
// MERLIN_CUDA_MV1=3), the epilogue (Epi) and exact rounds X.
enum Variant : int { kPlain2, kPlain3, kGlu, kPlainX, kGluX, kNorm, kNormX, kVariants };
constexpr int variant_of(int mb, int epi, bool x) {
  return epi == kEpiGlu    ? (x ? kGluX : kGlu)
         : epi == kEpiNorm ? (x ? kNormX : kNorm)
         : mb == 3         ? kPlain3
         : x               ? kPlainX
                           : kPlain2;
}

// CTAs per SM of each variant for rows up to (bucket + 1) * kKBucket, [F][variant][bucket].
int g_resident[8][kVariants][kBuckets] = {};

template <int F, int MB, int E, bool X>
void prepare_mb() {
  const auto kernel = mv1_kernel<F, MB, E, X>;
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes<F>(kMaxK)));
  for (int b = 0; b < kBuckets; ++b)
    MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[F][variant_of(MB, E, X)][b], kernel,
                                                                     warps_of(E) * 32, smem_bytes<F>((b + 1) * kKBucket)));
}


template <int F>
void prepare() {
  prepare_mb<F, 2, kEpiPlain, false>();
  prepare_mb<F, 3, kEpiPlain, false>();
  prepare_mb<F, 2, kEpiGlu, false>();
  prepare_mb<F, 2, kEpiPlain, true>();
  prepare_mb<F, 2, kEpiGlu, true>();
  prepare_mb<F, 1, kEpiNorm, false>();
  prepare_mb<F, 1, kEpiNorm, true>();
}

// MERLIN_CUDA_MV1 (read once): 0 = off (the general product runs), 2 / 3 = force that register budget
// (CTAs per SM), unset or anything else = on with the per-format default.
int mv1_mode() {
  static const int mode = env_is("MERLIN_CUDA_MV1", "0")   ? 0
                          : env_is("MERLIN_CUDA_MV1", "2") ? 2
                          : env_is("MERLIN_CUDA_MV1", "3") ? 3
                                                           : 1;
  return mode;
}

// Whether the X kernels apply: every round that starts is whole. Q8_0 and TQ2_0 keep the checked kernel: their
// exact ones spilled until the eleventh session's staging change and, spill-free since, won and lost by shape
// (H200 tg128, checked / exact: base q8_0 4,420-4,443 / 4,486-4,501, macbook q8_0 445 / 433, base tq2_0 3,737 /
// 3,506-3,524, macbook tq2_0 777 / 793).
bool exact_all() {  // MERLIN_CUDA_MV1_EXACT_ALL=1 (read once): Q8_0 and TQ2_0 too (A/B timing)
  static const bool on = env_is("MERLIN_CUDA_MV1_EXACT_ALL", "1");
  return on;
}
bool exact_rounds(int f, const Geometry& geo) {
  return (exact_all() || (f != kQ8_0 && f != kTQ2)) && whole_rounds(f, geo.n_chunks, geo.n_steps, kRound);
}

// MERLIN_CUDA_MV1_RESID=0 (read once): accumulating products read the residual after their work (A/B timing).
bool resid_early() {
  static const bool on = !env_is("MERLIN_CUDA_MV1_RESID", "0");
  return on;
}

// MERLIN_CUDA_MV1_STAGE=0 (read once): stage_x sums the deferred norm before it requests the row (A/B timing).
bool x_early() {
  static const bool on = !env_is("MERLIN_CUDA_MV1_STAGE", "0");
  return on;
}

// MERLIN_CUDA_MV1_EXACT=0 (read once): always the predicated kernels (A/B timing; same results).
bool exact_off() {
  static const bool off = env_is("MERLIN_CUDA_MV1_EXACT", "0");
  return off;
}

// Warps per tile S = 2^lsplit: the one that minimizes the busiest CTA's work, (tile groups per CTA) x
// (rounds per warp and tile); ties go to the smaller S (fewer reductions and barriers). The Glu variant's
// groups cover tpg / 2 output tiles (and as many up tiles), and S <= 2; the Norm variant's CTAs have 16
// warps and 2 <= S <= 8 (a group is 32 to 128 rows, whole Q8_0 blocks in whole warps of finish_group).
void choose_split(Mv1Args& p, int64_t ctas, bool glu, bool norm = false) {
  const int W = norm ? kNormWarps : kWarps, lo = norm ? 1 : 0, hi = glu ? 1 : 3;
  auto per_group = [&](int l) { return glu ? (W >> l) / 2 : W >> l; };
  const int64_t tiles = glu ? p.glu_tiles : p.tiles;
  int ls = lo;
  int64_t best = INT64_MAX;
  for (int l = lo; l <= hi; ++l) {
    const int64_t groups = (tiles + per_group(l) - 1) / per_group(l);
    const int64_t rounds = (p.n_chunks + (kRound << l) - 1) / (kRound << l);
    const int64_t cost = (groups + ctas - 1) / ctas * rounds;
    if (cost < best) best = cost, ls = l;
  }
  if (g_split_override >= 0) ls = std::clamp(g_split_override, lo, hi);
  p.lsplit = ls;
  p.rounds = (p.n_chunks + (kRound << ls) - 1) / (kRound << ls);
  p.groups = (int)((tiles + per_group(ls) - 1) / per_group(ls));
}

// What a launch adds to the plain product: RoPE + K/V write, the SwiGLU output, or the next RMSNorm's input.
struct Extra {
  const RopeKvArgs* rope = nullptr;
  const ActBuf* glu_out = nullptr;
  int64_t glu_up_row = 0;
  const float* norm_w = nullptr;
  const ActBuf* norm_out = nullptr;
  double* norm_part = nullptr;
};

template <int F>
void launch(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, Stream stream,
            const Extra& e) {
  const Geometry geo = geometry(F, w.rows, w.k);
  Mv1Args p{};
  p.q = w.q;
  p.s = w.s;
  p.k = w.k;
  p.n_steps = (int)geo.n_steps;
  p.n_chunks = (int)geo.n_chunks;
  p.n_super = (int)geo.n_super;
  p.tiles = (int)geo.tiles;
  p.xq = x.q;
  p.xs = x.scale;
  p.rms_part = x.rms_part;
  p.rms_eps = x.rms_eps;
  p.y = d_y;
  p.n_out = n_out;
  p.accumulate = accumulate ? 1 : 0;
  p.resid_early = resid_early() ? 1 : 0;
  p.x_early = x_early() ? 1 : 0;
  p.rope_on = e.rope ? 1 : 0;
  if (e.rope) p.rope = *e.rope;
  if (e.glu_out) {
    p.glu_out = *e.glu_out;
    p.glu_up_tile = (int)(e.glu_up_row / 16);
    p.glu_tiles = (int)(n_out / 16);
  }
  if (e.norm_out) {
    p.norm_w = e.norm_w;
    p.norm_out = *e.norm_out;
    p.norm_part = e.norm_part;
  }
  const int epi = e.glu_out ? kEpiGlu : e.norm_out ? kEpiNorm : kEpiPlain;
  const int mb = epi == kEpiNorm ? 1 : epi != kEpiPlain || mv1_mode() < 2 ? min_blocks(F) : mv1_mode();
  const bool exact = mb != 3 && exact_rounds(F, geo) && !exact_off();
  const int v = variant_of(mb, epi, exact);
  const int per_sm = std::max(1, g_resident[F][v][(w.k - 1) / kKBucket]);
  const int64_t ctas = (int64_t)g_sm_count * per_sm;
  choose_split(p, ctas, epi == kEpiGlu, epi == kEpiNorm);
  const unsigned grid = (unsigned)std::min<int64_t>(p.groups, ctas);
  const size_t smem = smem_bytes<F>(w.k);
  void (*kernel)(Mv1Args) = v == kGluX     ? mv1_kernel<F, 2, kEpiGlu, true>
                            : v == kGlu    ? mv1_kernel<F, 2, kEpiGlu, false>
                            : v == kNormX  ? mv1_kernel<F, 1, kEpiNorm, true>
                            : v == kNorm   ? mv1_kernel<F, 1, kEpiNorm, false>
                            : v == kPlainX ? mv1_kernel<F, 2, kEpiPlain, true>
                            : v == kPlain3 ? mv1_kernel<F, 3, kEpiPlain, false>
                                           : mv1_kernel<F, 2, kEpiPlain, false>;
  launch_pdl(kernel, dim3(grid), dim3(warps_of(epi) * 32), smem, stream, p);
  check_launch("matvec1");
}

}  // namespace

namespace {

bool dispatch(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream,
              const Extra& e = {}) {
  if (mv1_mode() == 0 || w.k > kMaxK || w.k <= 0 || g_sm_count == 0) {
    MERLIN_CHECK(!x.rms_part, "matvec1: a row with a deferred RMSNorm needs the single-token kernels");
    return false;
  }
  MERLIN_CHECK(!x.rms_part || x.kind == ActKind::Q8_0, "matvec1: deferred RMSNorm on a non-Q8_0 row");
  const int64_t n_out = std::min(n_out_rows, w.rows);
  if (n_out <= 0) return true;
  switch (w.fmt) {
    case kQ8_0: launch<kQ8_0>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kQ4_0: launch<kQ4_0>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kMXFP4: launch<kMXFP4>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kQ4_K: launch<kQ4_K>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kTQ2: launch<kTQ2>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kF16:
    case kBF16:
      MERLIN_CHECK(!e.norm_out, "matvec1: no RMSNorm epilogue for F16/BF16 rows");
      return matvec1_half(w, x, d_y, n_out, accumulate, stream, e.rope, e.glu_out, e.glu_up_row);
    default: return false;
  }
}

}  // namespace

bool matvec1(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream) {
  return dispatch(w, x, d_y, n_out_rows, accumulate, stream);
}

bool matvec1_rope_kv(const Matrix& w, const ActBuf& x, float* d_qkv, const RopeKvArgs& r, Stream stream) {
  Extra e;
  e.rope = &r;
  return dispatch(w, x, d_qkv, w.rows, false, stream, e);
}

// The split the plain product of w picks (choose_split). The SwiGLU epilogue needs S <= 2; where the plain
// product splits k over more warps (short rows: base's k = 768), forcing S = 2 made the step slower than
// the separate SwiGLU kernel (H200, base q8_0 tg128 3,785 -> 3,438 t/s), so the epilogue is used only
// where it costs the product nothing. Keeping S = 4 in 16-warp CTAs (as the Norm variant does) was slower
// too: base q4_0 4,349 -> 3,977 t/s, mxfp4 3,591 -> 3,216 (half as many SMs busy; tenth session).
static int plain_split(const Matrix& w) {
  const Geometry geo = geometry(w.fmt, w.rows, w.k);
  Mv1Args p{};
  p.tiles = (int)geo.tiles;
  p.n_chunks = (int)geo.n_chunks;
  const int per_sm = std::max(1, g_resident[w.fmt][kPlain2][(w.k - 1) / kKBucket]);
  choose_split(p, (int64_t)g_sm_count * per_sm, false);
  return p.lsplit;
}

// F16/BF16 rows (matvec1_half.cu) emit element by element: outputs in F16, BF16 or F32 only.
// MERLIN_CUDA_GLU_SHORT=1 (read once): the SwiGLU epilogue also for rows the plain product splits over more
// than 2 warps per tile (A/B timing).
bool glu_short() {
  static const bool on = env_is("MERLIN_CUDA_GLU_SHORT", "1");
  return on;
}

bool swiglu_fuses(const Matrix& w, int64_t ffn, int64_t up_row, ActKind out) {
  const bool shape = mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 && ffn > 0 && up_row % 16 == 0 &&
                     up_row >= ffn && up_row + ffn <= w.rows;
  if (w.fmt == kF16 || w.fmt == kBF16)
    return shape && matvec1_half_fits(w) && (out == ActKind::F16 || out == ActKind::BF16 || out == ActKind::F32);
  const bool fmt = w.fmt == kQ8_0 || w.fmt == kQ4_0 || w.fmt == kMXFP4 || w.fmt == kQ4_K || w.fmt == kTQ2;
  return shape && fmt && out != ActKind::Q8_K && w.k <= kMaxK && ffn % 32 == 0 &&
         (g_split_override >= 0 || plain_split(w) <= 1 || glu_short());
}

bool matvec1_swiglu(const Matrix& w, const ActBuf& x, int64_t ffn, int64_t up_row, ActBuf& out, Stream stream) {
  if (!swiglu_fuses(w, ffn, up_row, out.kind)) return false;
  MERLIN_CHECK(out.k == ffn && out.n_cap >= 1, "matvec1_swiglu: output buffer of ", out.k, " elements for ", ffn);
  Extra e;
  e.glu_out = &out;
  e.glu_up_row = up_row;
  return dispatch(w, x, nullptr, ffn, false, stream, e);
}

// The Norm epilogue: quantized rows (F16/BF16 rows have their own kernel), whole blocks of 32 outputs, and
// a Q8_0 reader whose row of n_out elements is staged by the single-token kernels.
bool norm_fold_fits(const Matrix& w, int64_t n_out) {
  const bool fmt = w.fmt == kQ8_0 || w.fmt == kQ4_0 || w.fmt == kMXFP4 || w.fmt == kQ4_K || w.fmt == kTQ2;
  return fmt && mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 && w.k <= kMaxK && n_out > 0 && n_out % 32 == 0 &&
         n_out <= w.rows && n_out <= kMaxK;
}

bool matvec1_norm(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, const float* d_norm_w,
                  ActBuf& out, double* d_part, Stream stream) {
  if (!norm_fold_fits(w, n_out)) return false;
  MERLIN_CHECK(out.kind == ActKind::Q8_0 && out.k == n_out && out.n_cap >= 1 && out.q && out.scale && d_part && d_norm_w,
               "matvec1_norm: the output must be a Q8_0 row of ", n_out, " elements");
  Extra e;
  e.norm_w = d_norm_w;
  e.norm_out = &out;
  e.norm_part = d_part;
  return dispatch(w, x, d_y, n_out, accumulate, stream, e);
}

void set_matvec1_split(int lsplit) { g_split_override = lsplit; }

void init_matvec1_kernels() {
  int dev = 0;
  MERLIN_CUDA_CHECK(cudaGetDevice(&dev));
  prepare<kQ8_0>();
  prepare<kQ4_0>();
  init_matvec1_half_kernels();
  prepare<kMXFP4>();
  prepare<kQ4_K>();
  prepare<kTQ2>();
  MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
}

}  // namespace merlin::cuda
