// Activation preparation shared by prep_kernel (act.cu) and the matrix products that prepare their own
// input in shared memory (matmul.cu): the RMSNorm scale, the per-element value (RMSNorm / SwiGLU / plain),
// and emit(), which writes an element in the matrix's input format. Both paths run these same functions
// with the same CTA size, so the codes and scales are bit-identical whichever path produced them.
#pragma once
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {

constexpr int kPrepThreads = 256;  // one CTA of prep_kernel, and the CTA of a matrix product

__device__ inline double block_sum_double(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[w] = v;
  __syncthreads();
  double s = 0;
  for (int i = 0; i < kPrepThreads / 32; ++i) s += sh[i];  // fixed order: deterministic
  __syncthreads();
  return s;
}

// Where element i (block i / 32) of row t lies in the fragment-ordered planes (ActBuf::fq, fs, fsum): per
// group of 8 rows and block of 32, 256 bytes in which lane L = 4 g + c of an m16n8k32 B operand finds its 8
// bytes at 8 L (row g of the group: elements 4c..4c+3, then 16+4c..16+4c+3), followed by nothing else; the
// group's 8 scales (and sums) of a block are 8 consecutive words.
__host__ __device__ __forceinline__ int64_t frag_code_index(int t, int64_t i, int64_t k) {
  const int j = (int)(i & 31);
  const int lane = (t & 7) * 4 + ((j & 15) >> 2);
  return (((int64_t)(t >> 3) * (k >> 5) + (i >> 5)) * 32 + lane) * 8 + (j >> 4) * 4 + (j & 3);
}
__host__ __device__ __forceinline__ int64_t frag_scale_index(int t, int64_t block, int64_t k) {
  return ((int64_t)(t >> 3) * (k >> 5) + block) * 8 + (t & 7);
}

// Where element i of row t lies in the half plane of Q8_0 activations (ActBuf::fh): the same groups, blocks
// and lanes as frag_code_index, 8 halves per lane, but each 4 elements of a lane in the order 0, 2, 1, 3. A
// lane's weights of k-step elements 4c..4c+3 dequantize cheapest in the pairs (4c, 4c + 2) and (4c + 1,
// 4c + 3) (a nibble or byte mask keeps every other byte), and an m16n8k16 product only needs its A and B
// operands to pair the same columns (matmul_operands.cuh, half_act_step).
__host__ __device__ __forceinline__ int64_t frag_h_index(int t, int64_t i, int64_t k) {
  const int j = (int)(i & 31);
  const int lane = (t & 7) * 4 + ((j & 15) >> 2);
  return (((int64_t)(t >> 3) * (k >> 5) + (i >> 5)) * 32 + lane) * 8 + (j >> 4) * 4 + ((j & 1) << 1) + ((j >> 1) & 1);
}

// The same for F16/BF16 halves (ActBuf::fhi, flo): per group of 8 rows and 32 columns (rows padded to a
// multiple of 32), lane L = 4 g + c finds row g's columns 8c..8c+7 at halves 8 L .. 8 L + 7 (the batched
// half product's k-steps 2p and 2p + 1 read columns 8c..8c+3 and 8c+4..8c+7 of block p, matrix_layout.cuh).
__host__ __device__ __forceinline__ int64_t frag_half_index(int t, int64_t i, int64_t k) {
  const int j = (int)(i & 31);
  const int lane = (t & 7) * 4 + (j >> 3);
  return (((int64_t)(t >> 3) * ((k + 31) >> 5) + (i >> 5)) * 32 + lane) * 8 + (j & 7);
}

__device__ __forceinline__ void put_half(ActBuf& o, int t, int64_t i, uint16_t hi, uint16_t lo) {
  if (o.hi) {
    o.hi[t * o.k + i] = hi;
    o.lo[t * o.k + i] = lo;
  }
  if (o.fhi) {
    const int64_t f = frag_half_index(t, i, o.k);
    o.fhi[f] = hi;
    o.flo[f] = lo;
  }
}

// Codes, scale and sum of a Q8 element / block in both layouts (the row planes are null in buffers staged
// for the batched products, the fragment planes null where only single-token products read).
__device__ __forceinline__ void put_code(ActBuf& o, int t, int64_t i, int q) {
  if (o.q) o.q[t * o.k + i] = (int8_t)q;
  if (o.fq) o.fq[frag_code_index(t, i, o.k)] = (int8_t)q;
}
__device__ __forceinline__ void put_block(ActBuf& o, int t, int64_t block, float d, int s) {
  if (o.scale) {
    o.scale[t * (o.k / 32) + block] = d;
    o.sum[t * (o.k / 32) + block] = s;
  }
  if (o.fs) {
    o.fs[frag_scale_index(t, block, o.k)] = d;
    o.fsum[frag_scale_index(t, block, o.k)] = s;
  }
}

// Q8_0 of one block of 32 held one element per lane: the block's max |v| (amax) and this lane's code, as the CPU
// quantizes (shared with matvec1.cu's RMSNorm epilogue, which scales the block differently afterwards).
__device__ __forceinline__ int q8_0_code(float v, float amax) {  // v's code in a block whose max |v| is amax
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  return __float2int_rn(v * id);
}
__device__ __forceinline__ int warp_q8_0(float v, float& amax) {
  amax = warp_max(fabsf(v));
  return q8_0_code(v, amax);
}

// 1 / rms of a row of k elements from its sum of squares (in double, as the CPU reference sums).
__device__ __forceinline__ float inv_rms(double sum_sq, int64_t k, float eps) {
  const float mean = (float)(sum_sq / (double)k);
  return 1.0f / sqrtf(mean + eps);
}

// The next RMSNorm's input written by the product that adds to the residual row (matvec1_norm, matmul_norm),
// for a block of 32 final rows y held one per lane, w the norm weight of the lane's row: the Q8_0 code of
// y * w as emit() quantizes a block, but the block scale of y * w (amax / 127, unrounded), not of
// y / rms(y) * w (the row's rms is not known until every block is done), plus the block's sum of code and
// sum of y^2 (double). A reader multiplies the scale by deferred_inv_rms and rounds it to half when it stages
// the row: up to rounding, what prep_act's RMSNorm gives (the codes are those of the same values times a
// common factor). Warp-collective.
struct NormBlock {
  int q;         // this lane's code
  float scale;   // the block's unnormalised scale
  int sum;       // sum of the block's codes
  double sum_sq; // sum of y^2 over the block
};
__device__ __forceinline__ NormBlock norm_block(float y, float w) {
  NormBlock b;
  float amax;
  b.q = warp_q8_0(__fmul_rn(y, w), amax);
  b.scale = amax / 127.0f;
  b.sum = warp_sum_int(b.q);
  double ss = (double)y * (double)y;
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  b.sum_sq = ss;
  return b;
}

// 1 / rms of a row written with deferred scales, from its kb per-block sums of squares (norm_block's
// sum_sq), summed in a fixed order (lane-strided, then a shuffle tree): every lane gets the same value.
// Warp-collective.
__device__ __forceinline__ float deferred_inv_rms(const double* part, int kb, int64_t k, float eps) {
  const int lane = threadIdx.x & 31;
  double ss = 0.0;
  for (int i = lane; i < kb; i += 32) ss += part[i];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return inv_rms(ss, k, eps);
}

// Writes element i (valid: i < k) of row t in the buffer's format. All threads of the CTA call it together.
template <int Kind>
__device__ void emit(float v, bool valid, int t, int64_t i, ActBuf& o) {
  const int64_t k = o.k;
  if constexpr (Kind == (int)ActKind::F32) {
    if (valid) o.f[t * k + i] = v;
  } else if constexpr (Kind == (int)ActKind::F16) {
    if (valid) {
      const __half h = __float2half_rn(v);
      put_half(o, t, i, __half_as_ushort(h), __half_as_ushort(__float2half_rn(v - __half2float(h))));
    }
  } else if constexpr (Kind == (int)ActKind::BF16) {
    if (valid) {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      const __nv_bfloat16 l = __float2bfloat16_rn(v - __bfloat162float(h));
      put_half(o, t, i, __bfloat16_as_ushort(h), __bfloat16_as_ushort(l));
    }
  } else if constexpr (Kind == (int)ActKind::Q8_0) {
    if (valid) {  // k % 32 == 0, so a warp is all valid or all not
      float amax;
      const int q = warp_q8_0(v, amax);
      put_code(o, t, i, q);
      if (o.fh) o.fh[frag_h_index(t, i, k)] = __half_as_ushort(__float2half_rn(v));
      const int s = warp_sum_int(q);
      if ((threadIdx.x & 31) == 0) put_block(o, t, i / 32, round_to_half(amax / 127.0f), s);
    }
  } else {  // Q8_K: the CTA's 256 elements are one super-block (k % 256 == 0)
    __shared__ float s_abs[kPrepThreads / 32], s_val[kPrepThreads / 32];
    __shared__ int s_idx[kPrepThreads / 32];
    float a = fabsf(v), val = v;
    int idx = threadIdx.x;
    for (int off = 16; off > 0; off >>= 1) {
      const float a2 = __shfl_xor_sync(0xffffffffu, a, off), v2 = __shfl_xor_sync(0xffffffffu, val, off);
      const int i2 = __shfl_xor_sync(0xffffffffu, idx, off);
      if (a2 > a || (a2 == a && i2 < idx)) { a = a2; val = v2; idx = i2; }
    }
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) { s_abs[w] = a; s_val[w] = val; s_idx[w] = idx; }
    __syncthreads();
    float best_a = s_abs[0], best_v = s_val[0];
    int best_i = s_idx[0];
    for (int j = 1; j < kPrepThreads / 32; ++j)
      if (s_abs[j] > best_a || (s_abs[j] == best_a && s_idx[j] < best_i)) { best_a = s_abs[j]; best_v = s_val[j]; best_i = s_idx[j]; }
    __syncthreads();
    int q = 0;
    float d = 0.0f;
    if (best_a != 0.0f) {
      const float iscale = -127.0f / best_v;
      q = min(__float2int_rn(iscale * v), 127);
      d = 1.0f / iscale;
    }
    if (valid) put_code(o, t, i, q);
    const int s = warp_sum_int(q);
    if (valid && (threadIdx.x & 31) == 0) put_block(o, t, i / 32, d, s);
  }
}

// 1 / rms(x) for RmsNorm rows, 1 otherwise. All threads of the CTA call it together.
template <int Mode>
__device__ __forceinline__ float row_scale(const PrepArgs& p, const float* x, int64_t k, double* sh) {
  if constexpr (Mode == (int)Prep::RmsNorm) {
    double ss = 0.0;  // in double, as the CPU reference (ggml) sums
    for (int64_t i = threadIdx.x; i < k; i += kPrepThreads) ss += (double)x[i] * (double)x[i];
    return inv_rms(block_sum_double(ss, sh), k, p.eps);
  } else {
    return 1.0f;
  }
}

// silu(g) * u, rounded step by step as the CPU does (shared with matvec1.cu's fused SwiGLU epilogue).
__device__ __forceinline__ float swiglu(float g, float u) {
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// w: the RMSNorm weight of element i (RmsNorm only).
template <int Mode>
__device__ __forceinline__ float prep_value(const PrepArgs& p, const float* x, int64_t i, float scale, float w) {
  if constexpr (Mode == (int)Prep::RmsNorm) {
    return __fmul_rn(__fmul_rn(x[i], scale), w);
  } else if constexpr (Mode == (int)Prep::SwiGlu) {
    return swiglu(x[i], x[i + p.glu_offset]);
  } else {
    (void)scale, (void)w;
    return x[i];
  }
}

// Prepares rows tb .. tb + nt - 1 into o (row tl of o = token tb + tl), one CTA of kPrepThreads doing it all.
template <int Kind, int Mode>
__device__ void prep_rows(const PrepArgs& p, int tb, int nt, ActBuf& o) {
  __shared__ double sh[kPrepThreads / 32];
  for (int tl = 0; tl < nt; ++tl) {
    const int t = tb + tl;
    const int64_t src = p.d_rows ? p.d_rows[t] : t;
    const float* x = p.d_x + src * p.ld;
    const float scale = row_scale<Mode>(p, x, o.k, sh);
    for (int64_t base = 0; base < o.k; base += kPrepThreads) {
      const int64_t i = base + threadIdx.x;
      const bool valid = i < o.k;
      const float w = Mode == (int)Prep::RmsNorm && valid ? p.d_w[i] : 0.0f;
      emit<Kind>(valid ? prep_value<Mode>(p, x, i, scale, w) : 0.0f, valid, tl, i, o);
    }
  }
}

}  // namespace merlin::cuda
