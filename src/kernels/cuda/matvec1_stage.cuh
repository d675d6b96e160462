// Device code of the single-token products (matvec1.cu, which describes the design): how a CTA stages the
// token's activation row in shared memory, as loaded (with a deferred RMSNorm completed on the way) or as
// SwiGLU of the gate/up row. Included by matvec1.cu only.
#pragma once
#include <cstdint>

#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1_rounds.cuh"

namespace merlin::cuda {
namespace {

// Copies the token's activation codes and block scales to shared memory. Step s's 32 codes become 4 groups
// of 8 bytes, group t = the bytes lane t multiplies: x[4t..4t+3], x[16+4t..16+4t+3], for MXFP4 interleaved
// (x[4t], x[16+4t], x[4t+1], x[16+4t+1], ...) like the nibbles of its code words.
// Q4_0 stages 16 bytes per step and lane group instead: the 8 bytes, then -8 times their sum and the
// block scale, so its inner loop reads one vector per step (stage_bytes).
// With a deferred RMSNorm (rms_part) the row's block scales lack 1 / rms(x): every warp sums the per-block
// sums of squares (in double, in a fixed order, like row_scale) and the staged scale is the product rounded
// to half, as prep_act rounds a block scale.
__device__ __forceinline__ float deferred_rms(const Mv1Args& p, int tt = 0) {
  const int kb = (int)(p.k / 32);
  return deferred_inv_rms(p.rms_part + (int64_t)tt * kb, kb, p.k, p.rms_eps);
}

// Only formats that read Q8_0 rows (Q4_K and TQ2_0 read Q8_K: the host never defers their norm, and the
// dead branch made ptxas spill in TQ2_0's kernel).
template <int F>
__host__ __device__ constexpr bool reads_q8_0() { return F == kQ8_0 || F == kQ4_0 || F == kMXFP4; }

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

// A row given as SwiGLU of the gate/up row (glu_src): a warp per block of 32, lane = element, quantized by
// warp_q8_0 as prep_act's emit quantizes it (the same codes and half-rounded scale), into a scratch row, then
// staged from there as a loaded row. The gate and up values of kU blocks per warp are requested before the
// first is used, so the L2 round trips overlap. With NT > 1 tokens the warps walk (token, block) pairs (token
// tt's row at glu_src + tt * glu_ld), so that the tokens' round trips overlap too, into NT scratch rows ([NT][k]
// codes, then [NT][k / 32] scales), and token tt's row is staged at tt * x_stride.
template <int F, int W, int NT = 1>
__device__ __forceinline__ void stage_glu(const Mv1Args& p, uint8_t* sm) {
  constexpr int kU = 4 * NT;  // per token, as many blocks in flight per warp as one token's staging has
  const int kb = (int)(p.k / 32), nb = kb * NT, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto token_of = [&](int bi) { return NT == 1 ? 0 : bi / kb; };
  int8_t* codes = reinterpret_cast<int8_t*>(sm + p.glu_scratch);
  float* scales = reinterpret_cast<float*>(sm + p.glu_scratch + NT * p.k);
  for (int b0 = warp; b0 < nb; b0 += W * kU) {
    float g[kU], u[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int bi = b0 + j * W, tt = token_of(bi);
      const float* src = p.glu_src + tt * p.glu_ld;
      const int64_t i = (int64_t)(bi - tt * kb) * 32 + lane;
      g[j] = bi < nb ? src[i] : 0.0f;
      u[j] = bi < nb ? src[i + p.glu_offset] : 0.0f;
    }
    // warp_q8_0 for kU blocks at once: their max shuffles interleave instead of following each other (max is
    // exact in any order, so the codes and scales are warp_q8_0's).
    float v[kU], amax[kU];
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      v[j] = swiglu(g[j], u[j]);
      amax[j] = fabsf(v[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
      for (int j = 0; j < kU; ++j) amax[j] = fmaxf(amax[j], __shfl_xor_sync(0xffffffffu, amax[j], o));
#pragma unroll
    for (int j = 0; j < kU; ++j) {
      const int bi = b0 + j * W;
      if (bi >= nb) break;  // warp-uniform
      codes[(int64_t)bi * 32 + lane] = (int8_t)q8_0_code(v[j], amax[j]);
      if (lane == 0) scales[bi] = round_to_half(amax[j] / 127.0f);
    }
  }
  __syncthreads();
  const uint4* src = reinterpret_cast<const uint4*>(codes);
  for (int s = threadIdx.x; s < nb; s += W * 32) {
    const int tt = token_of(s);
    stage_step<F>(sm + tt * (NT == 1 ? 0 : p.x_stride), p.k, s - tt * kb, src[2 * s], src[2 * s + 1], scales[s]);
  }
  __syncthreads();
}

// The thread's first step is requested before the deferred norm's sums of squares, so that the two L2 round
// trips overlap instead of following each other (rows of up to W * 32 blocks, every row here but the
// longest, have no other step). G: the row is SwiGLU of p.glu_src (stage_glu), in the instances built for it;
// Dyn: whichever p.glu_src says (the instances that decide the staging at run time, kRunGlu).
template <int F, int W, bool G, bool Dyn, int NT = 1>
__device__ __forceinline__ void stage_x(const Mv1Args& p, uint8_t* sm) {
  static_assert(!G || reads_q8_0<F>(), "SwiGLU staging writes a Q8_0 row");
  if constexpr (G || (Dyn && reads_q8_0<F>())) {
    if (G || p.glu_src) {
      stage_glu<F, W, NT>(p, sm);
      return;
    }
  }
  constexpr int kT = W * 32;
  const int kb = (int)(p.k / 32), s0 = threadIdx.x;
  // Token tt's row planes: codes at tt * k, block scales at tt * k / 32 (activation buffers are 256-byte
  // aligned, rows k % 32 == 0 apart: 16-byte aligned).
  auto src_of = [&](int tt) { return reinterpret_cast<const uint4*>(p.xq + tt * p.k); };
  auto xs_of = [&](int tt) { return p.xs + tt * kb; };
  auto dst_of = [&](int tt) { return sm + tt * (NT == 1 ? 0 : p.x_stride); };
  uint4 a0[NT], b0[NT];
  float x0[NT];
  auto first = [&] {
#pragma unroll
    for (int tt = 0; tt < NT; ++tt) {
      a0[tt] = uint4{};
      b0[tt] = uint4{};
      x0[tt] = 0.0f;
      if (s0 < kb) {
        a0[tt] = src_of(tt)[2 * s0];
        b0[tt] = src_of(tt)[2 * s0 + 1];
        x0[tt] = xs_of(tt)[s0];
      }
    }
  };
  if (p.x_early) first();
  float rms[NT];
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) rms[tt] = 1.0f;
  if constexpr (reads_q8_0<F>()) {
    if (p.rms_part) {
#pragma unroll
      for (int tt = 0; tt < NT; ++tt) rms[tt] = deferred_rms(p, tt);
    }
  }
  if (!p.x_early) first();  // A/B timing only (MERLIN_CUDA_MV1_STAGE=0): the sums first, then the row
#pragma unroll
  for (int tt = 0; tt < NT; ++tt) {
    if (s0 < kb) stage_step<F>(dst_of(tt), p.k, s0, a0[tt], b0[tt], staged_scale<F>(p, x0[tt], rms[tt]));
    for (int s = s0 + kT; s < kb; s += kT)
      stage_step<F>(dst_of(tt), p.k, s, src_of(tt)[2 * s], src_of(tt)[2 * s + 1], staged_scale<F>(p, xs_of(tt)[s], rms[tt]));
  }
  __syncthreads();
}

}  // namespace
}  // namespace merlin::cuda
