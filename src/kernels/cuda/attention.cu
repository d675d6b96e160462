// RoPE + K/V cache write, and attention over the paged K/V cache.
//
// Attention runs one CTA of 256 threads per (query head, token). A group of lanes (one lane per 8 elements
// of the head, rounded up to a power of two) works on one cached position at a time with 16-byte loads, four
// positions per group requested before the first is used. Pass 1 scores the positions (group shuffle
// reduction), the softmax is normalised exactly as the CPU backend does it (with an F16 cache, q and the
// weights are rounded to f16 like llama.cpp's CPU path), pass 2 accumulates V with the same grouping and
// the groups' partial sums meet in shared memory in a fixed order. The scores live in shared memory (4 bytes
// per position of context), so prefill and decode are the same kernel.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

constexpr int kThreads = 128;      // rope_kv
constexpr int kAttnThreads = 256;  // attention

__device__ __forceinline__ int64_t kv_slot(const KvArgs& kv, int seq, int pos) {
  return (int64_t)kv.d_table[(int64_t)seq * kv.max_blocks + pos / kv.block_size] * kv.block_size + pos % kv.block_size;
}

__device__ __forceinline__ void store_kv(const KvArgs& kv, void* base, int64_t idx, float v) {
  if (kv.f16) static_cast<__half*>(base)[idx] = __float2half_rn(v);
  else static_cast<float*>(base)[idx] = v;
}

// Rotates pair (x0, x1) by the table's angle with the CPU's exact operation order (no fused multiply-add).
__device__ __forceinline__ float2 rotate(float x0, float x1, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

__global__ void rope_kv_kernel(float* qkv, int64_t ld, int64_t k_off, int64_t v_off, const int32_t* d_pos,
                               const int32_t* d_seq, const float* cos_sin, int n_heads, int n_kv_heads, int hd,
                               int n_rot, KvArgs kv) {
  const int t = blockIdx.x;
  pdl_trigger();
  pdl_wait();
  const int pos = d_pos[t], seq = d_seq[t];
  float* row = qkv + (int64_t)t * ld;
  const float* cs = cos_sin + (int64_t)pos * n_rot;
  const int half_hd = hd / 2, half_rot = n_rot / 2;
  for (int e = threadIdx.x; e < n_heads * half_hd; e += blockDim.x) {
    const int h = e / half_hd, i = e % half_hd;
    if (i >= half_rot) continue;
    float* v = row + h * hd + 2 * i;
    const float2 r = rotate(v[0], v[1], cs[2 * i], cs[2 * i + 1]);
    v[0] = r.x;
    v[1] = r.y;
  }
  const int64_t kv_dim = (int64_t)n_kv_heads * hd, slot = kv_slot(kv, seq, pos);
  for (int e = threadIdx.x; e < n_kv_heads * half_hd; e += blockDim.x) {
    const int h = e / half_hd, i = e % half_hd;
    const float* kr = row + k_off + h * hd + 2 * i;
    float2 r = make_float2(kr[0], kr[1]);
    if (i < half_rot) r = rotate(r.x, r.y, cs[2 * i], cs[2 * i + 1]);
    store_kv(kv, kv.d_k, slot * kv_dim + h * hd + 2 * i, r.x);
    store_kv(kv, kv.d_k, slot * kv_dim + h * hd + 2 * i + 1, r.y);
  }
  for (int e = threadIdx.x; e < kv_dim; e += blockDim.x) store_kv(kv, kv.d_v, slot * kv_dim + e, row[v_off + e]);
}

__device__ float block_reduce(float v, float* sh, bool is_max) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, w) : v + w;
  }
  const int w = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) sh[w] = v;
  __syncthreads();
  float r = sh[0];
  for (int i = 1; i < kAttnThreads / 32; ++i) r = is_max ? fmaxf(r, sh[i]) : r + sh[i];
  __syncthreads();
  return r;
}

// Lanes that share one cached position: one lane per 8-element chunk of the head, rounded up to a power of
// two (at most 32 for head sizes up to 256), so a warp covers 32 / G positions with 16-byte loads.
__host__ __device__ constexpr int group_lanes(int hd) {
  int g = 1;
  while (g < hd / 8) g <<= 1;
  return g;
}

// Elements 8c .. 8c + 7 of a cached row, as floats.
template <bool F16>
__device__ __forceinline__ void load8(const void* base, int64_t off, float (&v)[8]) {
  if constexpr (F16) {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const __half*>(base) + off);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
  } else {
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(base) + off);
    const float4 a = f[0], b = f[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

// Positions handled per group and pass: their K (or V) chunks are all requested before the first is used.
constexpr int kPosUnroll = 4;

template <bool F16>
__global__ void __launch_bounds__(kAttnThreads) attention_kernel(const float* qkv, int64_t ld, const int32_t* d_pos,
                                                                 const int32_t* d_seq, int n_heads, int n_kv_heads,
                                                                 int hd, int n_ctx, KvArgs kv, float* out) {
  extern __shared__ float sm[];
  float* scores = sm;     // [n_ctx]
  float* q = sm + n_ctx;  // [hd]
  float* part = q + hd;   // [kAttnThreads][8]: each lane's partial V sums of its 8 dims
  __shared__ float red[kAttnThreads / 32];
  pdl_trigger();
  pdl_wait();
  const int h = blockIdx.x, t = blockIdx.y, pos = d_pos[t], seq = d_seq[t], n_pos = pos + 1;
  const int kvh = h / (n_heads / n_kv_heads);
  const int64_t kv_dim = (int64_t)n_kv_heads * hd, head_off = (int64_t)kvh * hd;
  for (int d = threadIdx.x; d < hd; d += kAttnThreads) {
    const float v = qkv[(int64_t)t * ld + h * hd + d];
    q[d] = F16 ? round_to_half(v) : v;
  }
  __syncthreads();
  // A group of G lanes works on one position at a time; lane gi owns dims 8gi .. 8gi + 7.
  const int G = group_lanes(hd), gi = threadIdx.x % G, group = threadIdx.x / G, n_groups = kAttnThreads / G;
  const bool active = gi < hd / 8;
  float qr[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) qr[j] = active ? q[8 * gi + j] : 0.f;
  const float scale = 1.0f / sqrtf((float)hd);
  float mx = -INFINITY;
  // Pass 1: scores. The trip count is the same for every thread, so the group shuffles see full warps.
  for (int base = 0; base < n_pos; base += n_groups * kPosUnroll) {
    float kr[kPosUnroll][8];
#pragma unroll
    for (int u = 0; u < kPosUnroll; ++u) {
      const int p = base + u * n_groups + group;
      if (active && p < n_pos) load8<F16>(kv.d_k, kv_slot(kv, seq, p) * kv_dim + head_off + 8 * gi, kr[u]);
      else
#pragma unroll
        for (int j = 0; j < 8; ++j) kr[u][j] = 0.f;
    }
#pragma unroll
    for (int u = 0; u < kPosUnroll; ++u) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += qr[j] * kr[u][j];
      for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const int p = base + u * n_groups + group;
      if (p < n_pos) {
        s *= scale;
        if (gi == 0) scores[p] = s;
        mx = fmaxf(mx, s);
      }
    }
  }
  mx = block_reduce(mx, red, true);  // also orders the score writes before the reads below
  float sum = 0.f;
  for (int p = threadIdx.x; p < n_pos; p += kAttnThreads) {
    const float e = expf(scores[p] - mx);
    scores[p] = e;
    sum += e;
  }
  sum = block_reduce(sum, red, false);
  const float inv = 1.0f / sum;
  for (int p = threadIdx.x; p < n_pos; p += kAttnThreads) {
    const float w = scores[p] * inv;
    scores[p] = F16 ? round_to_half(w) : w;
  }
  __syncthreads();
  // Pass 2: V weighted by the scores, same grouping.
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (active) {
    for (int base = 0; base < n_pos; base += n_groups * kPosUnroll) {
      float vr[kPosUnroll][8];
#pragma unroll
      for (int u = 0; u < kPosUnroll; ++u) {
        const int p = base + u * n_groups + group;
        if (p < n_pos) load8<F16>(kv.d_v, kv_slot(kv, seq, p) * kv_dim + head_off + 8 * gi, vr[u]);
      }
#pragma unroll
      for (int u = 0; u < kPosUnroll; ++u) {
        const int p = base + u * n_groups + group;
        if (p < n_pos) {
          const float w = scores[p];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += w * vr[u][j];
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) part[threadIdx.x * 8 + j] = acc[j];
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += kAttnThreads) {
    float s = 0.f;
    for (int g = 0; g < n_groups; ++g) s += part[(g * G + d / 8) * 8 + d % 8];  // fixed order: deterministic
    out[(int64_t)t * n_heads * hd + h * hd + d] = s;
  }
}

size_t attention_smem(int n_ctx, int hd) { return ((size_t)n_ctx + hd + 8 * kAttnThreads) * sizeof(float); }

}  // namespace

void attention_prepare(int n_ctx) {
  const int bytes = (int)attention_smem(n_ctx, 256);
  MERLIN_CHECK(bytes <= 227 * 1024, "context of ", n_ctx, " positions is too long for the attention kernel");
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(attention_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

void rope_kv(float* d_qkv, int64_t ld, int64_t k_off, int64_t v_off, int n, const int32_t* d_pos, const int32_t* d_seq,
             const float* d_cos_sin, int n_heads, int n_kv_heads, int head_dim, int n_rot, const KvArgs& kv,
             Stream stream) {
  if (n <= 0) return;
  launch_pdl(rope_kv_kernel, n, kThreads, 0, stream, d_qkv, ld, k_off, v_off, d_pos, d_seq, d_cos_sin, n_heads,
             n_kv_heads, head_dim, n_rot, kv);
  check_launch("rope_kv");
}

void attention(const float* d_qkv, int64_t ld, int64_t k_off, int n, const int32_t* d_pos, const int32_t* d_seq,
               int n_heads, int n_kv_heads, int head_dim, int n_ctx, const KvArgs& kv, float* d_out, Stream stream) {
  if (n <= 0) return;
  (void)k_off;
  MERLIN_CHECK(head_dim % 8 == 0 && head_dim <= 256, "the CUDA attention kernel needs a head size that is a multiple "
               "of 8 and at most 256 (this model's is ", head_dim, ")");
  const dim3 grid((unsigned)n_heads, (unsigned)n);
  const size_t smem = attention_smem(n_ctx, head_dim);
  if (kv.f16)
    launch_pdl(attention_kernel<true>, grid, kAttnThreads, smem, stream, d_qkv, ld, d_pos, d_seq, n_heads, n_kv_heads,
               head_dim, n_ctx, kv, d_out);
  else
    launch_pdl(attention_kernel<false>, grid, kAttnThreads, smem, stream, d_qkv, ld, d_pos, d_seq, n_heads,
               n_kv_heads, head_dim, n_ctx, kv, d_out);
  check_launch("attention");
}

}  // namespace merlin::cuda
