// RoPE + K/V cache write, and attention over the paged K/V cache.
//
// Attention runs one CTA of 256 threads per (query head, token). A group of lanes (one lane per 8 elements
// of the head, rounded up to a power of two) works on one cached position at a time with 16-byte loads, four
// positions per group requested before the first is used. Pass 1 scores the positions (group shuffle
// reduction), the softmax is normalised exactly as the CPU backend does it (with an F16 cache, q and the
// weights are rounded to f16 like llama.cpp's CPU path), pass 2 accumulates V with the same grouping and
// the groups' partial sums meet in shared memory in a fixed order. The scores live in shared memory (4 bytes
// per position of context), so prefill and decode are the same kernel.
//
// Decode batches leave most SMs idle on long contexts (one CTA per head and token walks every position), so
// with an AttnScratch the positions are also split into chunks, one CTA each ("flash-decoding"). The split
// count comes from n_ctx alone, so a captured graph's grid stays valid as positions grow; splits past a
// token's last position exit at once, and a token whose context fits one chunk is done whole by split 0 with
// the unsplit numerics. Otherwise each split leaves its max, sum of exponentials and unnormalised V sum in
// the scratch and the last split to finish combines them in split order (deterministic).
#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/sys.h"
#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope_kv.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

// rope_kv: one CTA per token. A decode token's kernel is a chain of dependent memory round trips (position,
// table, row, cache), one per loop iteration of a thread, so the CTA is wide enough that each thread does
// about one element per loop for the base model (768 rotated q/k elements, 768 v elements).
constexpr int kThreads = 512;
constexpr int kAttnThreads = 256;  // attention


__global__ void __launch_bounds__(kThreads) rope_kv_kernel(float* __restrict__ qkv, int64_t ld, int64_t k_off,
                                                           int64_t v_off, const int32_t* d_pos, const int32_t* d_seq,
                                                           const float* __restrict__ cos_sin, int n_heads,
                                                           int n_kv_heads, int hd, int n_rot, KvArgs kv) {
  const int t = blockIdx.x;
  pdl_trigger();
  pdl_wait();
  const int pos = d_pos[t], seq = d_seq[t];
  const int64_t kv_dim = (int64_t)n_kv_heads * hd, slot = kv_slot(kv, seq, pos);  // the table load overlaps
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
  extern __shared__ float staged[];  // Q8_0 cache: the rotated K row, then the V row
  for (int e = threadIdx.x; e < n_kv_heads * half_hd; e += blockDim.x) {
    const int h = e / half_hd, i = e % half_hd;
    const float* kr = row + k_off + h * hd + 2 * i;
    float2 r = make_float2(kr[0], kr[1]);
    if (i < half_rot) r = rotate(r.x, r.y, cs[2 * i], cs[2 * i + 1]);
    if (kv.q8) {
      staged[h * hd + 2 * i] = r.x;
      staged[h * hd + 2 * i + 1] = r.y;
      continue;
    }
    store_kv(kv, kv.d_k, slot * kv_dim + h * hd + 2 * i, r.x);
    store_kv(kv, kv.d_k, slot * kv_dim + h * hd + 2 * i + 1, r.y);
  }
  if (!kv.q8) {
    for (int e = threadIdx.x; e < kv_dim; e += blockDim.x) store_kv(kv, kv.d_v, slot * kv_dim + e, row[v_off + e]);
    return;
  }
  for (int e = threadIdx.x; e < kv_dim; e += blockDim.x) staged[kv_dim + e] = row[v_off + e];
  __syncthreads();
  // Q8_0 blocks of 32, one warp each, as the CPU's quantize_row_q8_0 (ggml's reference): d = amax / 127,
  // codes round(x / d) (half away from zero), d stored as f16.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_blocks = (int)(2 * kv_dim / 32);
  for (int b = warp; b < n_blocks; b += kThreads / 32) {
    const bool is_v = b >= n_blocks / 2;
    const int64_t e = (int64_t)(is_v ? b - n_blocks / 2 : b) * 32 + lane;
    const float x = staged[b * 32 + lane];
    const float d = warp_max(fabsf(x)) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    static_cast<int8_t*>(is_v ? kv.d_v : kv.d_k)[slot * kv_dim + e] = (int8_t)roundf(x * id);
    if (lane == 0) static_cast<__half*>(is_v ? kv.d_vs : kv.d_ks)[(slot * kv_dim + e) / 32] = __float2half_rn(d);
  }
}

// Shared memory of rope_kv_kernel for a Q8_0 cache: two rows of kv_dim floats.
constexpr size_t kRopeKvSmemMax = 2 * 16384 * sizeof(float);

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

// Cache element kinds (KvArgs): f32, f16, or Q8_0 (int8 codes, one half scale per block of 32 in d_ks / d_vs).
constexpr int kKvF32 = 0, kKvF16 = 1, kKvQ8 = 2;

// Elements 8c .. 8c + 7 of a cached row (off: the first one's index), as floats; a Q8_0 element is
// scale * code, as dequantize_row_q8_0 forms it.
template <int KV>
__device__ __forceinline__ void load8(const void* base, const void* scales, int64_t off, float (&v)[8]) {
  if constexpr (KV == kKvF16) {
    const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const __half*>(base) + off);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
  } else if constexpr (KV == kKvQ8) {
    const uint2 c = *reinterpret_cast<const uint2*>(static_cast<const int8_t*>(base) + off);
    const float d = __half2float(static_cast<const __half*>(scales)[off >> 5]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (float)(int8_t)(((j < 4 ? c.x : c.y) >> (8 * (j & 3))) & 0xFF) * d;
  } else {
    (void)scales;
    const float4* f = reinterpret_cast<const float4*>(static_cast<const float*>(base) + off);
    const float4 a = f[0], b = f[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
}

// Positions handled per group and pass: their K (or V) chunks are all requested before the first is used.
// A Q8_0 cache's 8 elements are 8 bytes, so it takes twice the positions to keep as many bytes in flight.
template <int KV>
constexpr int pos_unroll() { return KV == kKvQ8 ? 8 : 4; }

// Where a CTA's K/V rows lie (besides the KvArgs) and how its lanes share them: a group of G lanes works on
// one position at a time, lane gi owning dims 8gi .. 8gi + 7.
struct Rows {
  int seq;
  int64_t kv_dim, head_off;
  int G, gi, group, n_groups;
  bool active;
};

__device__ __forceinline__ Rows make_rows(int seq, int kvh, int n_kv_heads, int hd) {
  Rows r;
  r.seq = seq;
  r.kv_dim = (int64_t)n_kv_heads * hd;
  r.head_off = (int64_t)kvh * hd;
  r.G = group_lanes(hd);  // a power of two: shifts and masks, not runtime divisions, before the first loads
  const int lg = __ffs(r.G) - 1;
  r.gi = threadIdx.x & (r.G - 1);
  r.group = threadIdx.x >> lg;
  r.n_groups = kAttnThreads >> lg;
  r.active = r.gi < hd / 8;
  return r;
}

// Pass 1: scores[p - p0] for positions p0 .. p1 - 1; returns this thread's running max. The trip count is the
// same for every thread, so the group shuffles see full warps.
// Cache slots of this thread's positions in a pass's first iteration (p0 + u * n_groups + group), looked up
// before pdl_wait: block tables are written before a step's first kernel, never by a kernel, so the K and V
// loads after the wait no longer sit behind a table load.
template <int U>
struct FirstSlots {
  int64_t s[U];
};

template <int U>
__device__ __forceinline__ FirstSlots<U> first_slots(const KvArgs& kv, const Rows& r, int p0, int p1) {
  FirstSlots<U> f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = p0 + u * r.n_groups + r.group;
    f.s[u] = r.active && p < p1 ? kv_slot(kv, r.seq, p) : 0;
  }
  return f;
}

template <int U>
__device__ __forceinline__ int64_t slot_at(const KvArgs& kv, const Rows& r, const FirstSlots<U>& f, int base, int p0,
                                           int u, int p) {
  return base == p0 ? f.s[u] : kv_slot(kv, r.seq, p);
}

// With Hoist, the V rows of pass 2's first iteration are requested with pass 1's first K rows: in a short
// context (one iteration, up to 128 positions for 64-dim heads) pass 2 then waits on no memory round trip of
// its own.
// An f16 cache keeps them as the loaded 16 bytes (half the registers of floats), a Q8_0 one as its 8 codes
// and the block's scale bits.
template <int KV>
struct FirstValues {
  uint4 raw[pos_unroll<KV>()][KV == kKvF32 ? 2 : 1];
};

template <int KV>
__device__ __forceinline__ void load_raw(const void* base, const void* scales, int64_t off,
                                         uint4 (&raw)[KV == kKvF32 ? 2 : 1]) {
  if constexpr (KV == kKvF16) {
    raw[0] = *reinterpret_cast<const uint4*>(static_cast<const __half*>(base) + off);
  } else if constexpr (KV == kKvQ8) {
    const uint2 c = *reinterpret_cast<const uint2*>(static_cast<const int8_t*>(base) + off);
    raw[0] = make_uint4(c.x, c.y, static_cast<const uint16_t*>(scales)[off >> 5], 0u);
  } else {
    (void)scales;
    const uint4* f = reinterpret_cast<const uint4*>(static_cast<const float*>(base) + off);
    raw[0] = f[0];
    raw[1] = f[1];
  }
}

// load8's conversion of a loaded row chunk.
template <int KV>
__device__ __forceinline__ void unpack8(const uint4 (&raw)[KV == kKvF32 ? 2 : 1], float (&v)[8]) {
  if constexpr (KV == kKvQ8) {
    const float d = __half2float(__ushort_as_half((unsigned short)raw[0].z));
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = (float)(int8_t)(((j < 4 ? raw[0].x : raw[0].y) >> (8 * (j & 3))) & 0xFF) * d;
  } else if constexpr (KV == kKvF16) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw[0]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(h[j]);
      v[2 * j] = f.x;
      v[2 * j + 1] = f.y;
    }
  } else {
    v[0] = __uint_as_float(raw[0].x); v[1] = __uint_as_float(raw[0].y);
    v[2] = __uint_as_float(raw[0].z); v[3] = __uint_as_float(raw[0].w);
    v[4] = __uint_as_float(raw[1].x); v[5] = __uint_as_float(raw[1].y);
    v[6] = __uint_as_float(raw[1].z); v[7] = __uint_as_float(raw[1].w);
  }
}

template <int KV, bool Hoist, int N>
__device__ __forceinline__ float score_pass(const KvArgs& kv, const Rows& r, const FirstSlots<N>& fs,
                                            const float (&qr)[8],
                                            float scale, int p0, int p1, float* scores, FirstValues<KV>& fv) {
  float mx = -INFINITY;
  for (int base = p0; base < p1; base += r.n_groups * pos_unroll<KV>()) {
    constexpr bool kRaw = KV == kKvQ8;  // Q8_0: rows stay as loaded (codes + scale) until used
    float kr[kRaw ? 1 : pos_unroll<KV>()][8];
    uint4 kq[kRaw ? pos_unroll<KV>() : 1][1];
#pragma unroll
    for (int u = 0; u < pos_unroll<KV>(); ++u) {
      const int p = base + u * r.n_groups + r.group;
      if (r.active && p < p1) {
        const int64_t off = slot_at(kv, r, fs, base, p0, u, p) * r.kv_dim + r.head_off + 8 * r.gi;
        if constexpr (kRaw) load_raw<KV>(kv.d_k, kv.d_ks, off, kq[u]);
        else load8<KV>(kv.d_k, kv.d_ks, off, kr[u]);
        if (Hoist && base == p0) load_raw<KV>(kv.d_v, kv.d_vs, off, fv.raw[u]);
      } else if constexpr (kRaw) {
        kq[u][0] = make_uint4(0u, 0u, 0u, 0u);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) kr[u][j] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < pos_unroll<KV>(); ++u) {
      float k8[8];
      if constexpr (kRaw) {
        unpack8<KV>(kq[u], k8);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) k8[j] = kr[u][j];
      }
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += qr[j] * k8[j];
      for (int o = r.G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      const int p = base + u * r.n_groups + r.group;
      if (p < p1) {
        s *= scale;
        if (r.gi == 0) scores[p - p0] = s;
        mx = fmaxf(mx, s);
      }
    }
  }
  return mx;
}

// The whole context's weights, normalised exactly as the CPU backend does (rounded to f16 with an F16 cache).
template <int KV>
__device__ __forceinline__ void normalise(float* scores, int n, float mx, float* red) {
  float sum = 0.f;
  for (int p = threadIdx.x; p < n; p += kAttnThreads) {
    const float e = expf(scores[p] - mx);
    scores[p] = e;
    sum += e;
  }
  sum = block_reduce(sum, red, false);
  const float inv = 1.0f / sum;
  for (int p = threadIdx.x; p < n; p += kAttnThreads) {
    const float w = scores[p] * inv;
    scores[p] = KV == kKvF16 ? round_to_half(w) : w;
  }
  __syncthreads();
}

// One split's unnormalised weights exp(s - mx) (rounded like the normalised ones); returns their sum.
template <int KV>
__device__ __forceinline__ float exp_weights(float* scores, int n, float mx, float* red) {
  float sum = 0.f;
  for (int p = threadIdx.x; p < n; p += kAttnThreads) {
    const float e = expf(scores[p] - mx);
    scores[p] = KV == kKvF16 ? round_to_half(e) : e;
    sum += e;
  }
  return block_reduce(sum, red, false);  // its barriers also publish the weights to pass 2
}

// Pass 2: each lane's sums of weights[p - p0] * V over positions p0 .. p1 - 1 (same grouping as pass 1),
// left in part[threadIdx.x][8] for group_total.
template <int KV, bool Hoist, int N>
__device__ __forceinline__ void value_pass(const KvArgs& kv, const Rows& r, const FirstSlots<N>& fs,
                                           const FirstValues<KV>& fv, const float* weights, int p0, int p1,
                                           float* part) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (r.active) {
    for (int base = p0; base < p1; base += r.n_groups * pos_unroll<KV>()) {
      constexpr bool kRaw = KV == kKvQ8;
      float vr[kRaw ? 1 : pos_unroll<KV>()][8];
      uint4 vq[kRaw ? pos_unroll<KV>() : 1][1];
#pragma unroll
      for (int u = 0; u < pos_unroll<KV>(); ++u) {
        const int p = base + u * r.n_groups + r.group;
        if (p >= p1) continue;
        const int64_t off = kv_slot(kv, r.seq, p) * r.kv_dim + r.head_off + 8 * r.gi;
        if constexpr (kRaw) {
          if (Hoist && base == p0) vq[u][0] = fv.raw[u][0];
          else load_raw<KV>(kv.d_v, kv.d_vs, off, vq[u]);
        } else if (Hoist && base == p0) {
          unpack8<KV>(fv.raw[u], vr[u]);
        } else {
          load8<KV>(kv.d_v, kv.d_vs, off, vr[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < pos_unroll<KV>(); ++u) {
        const int p = base + u * r.n_groups + r.group;
        if (p < p1) {
          float v8[8];
          if constexpr (kRaw) {
            unpack8<KV>(vq[u], v8);
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) v8[j] = vr[u][j];
          }
          const float w = weights[p - p0];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] += w * v8[j];
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) part[threadIdx.x * 8 + j] = acc[j];
  __syncthreads();
}

// Dim d of the V sum: the groups' partial sums added in a fixed order (deterministic).
__device__ __forceinline__ float group_total(const float* part, const Rows& r, int d) {
  float s = 0.f;
  for (int g = 0; g < r.n_groups; ++g) s += part[(g * r.G + d / 8) * 8 + d % 8];
  return s;
}

// A context that one pass of the CTA's groups covers (n_pos <= n_groups * pos_unroll: 128 positions for 64-dim
// heads): each group loads its positions' K and V rows at once, and the scores, weights and V sums stay in
// registers, so the softmax costs two block reductions and the groups' sums one exchange (three barriers,
// where the general passes take seven and a serial sum over the 32 groups; base tg128 on the H200 4,534 ->
// 4,842 t/s, docs/BENCHMARKS.md). The weights are the general path's (exp(s - max) times 1 / sum, rounded to
// f16 with an F16 cache); the sums run in another order (per group, then across groups), which moves results
// by float rounding only.
template <int KV>
__device__ __forceinline__ bool fits_one_pass(const Rows& r, int n_pos) { return n_pos <= r.n_groups * pos_unroll<KV>(); }

// Positions per group of the widest one-pass attention of an instance, and the cache slots it looks up before
// pdl_wait: twice pos_unroll for the hoisted F16 instance (decode grids of one wave, whose CTAs are a chain of
// round trips: 128 positions of a 128-dim head in one pass instead of the general passes' seven barriers;
// H200 tg128, 2026-11-30: iphone q4_0 +3.6 %, macbook q4_0 +2.8 %), one pass's worth otherwise. It costs the
// instance 13 registers (105 -> 118, still two CTAs per SM); in the other F16 instances it would cost 50 (75 ->
// 125: two CTAs per SM instead of three for batched decode). So which pass a context of 65..128 positions
// (128-dim heads) takes depends on the grid, like the products' kernels do (float rounding apart).
template <int KV, bool Hoist>
constexpr int one_pass_slots() { return Hoist && KV == kKvF16 ? 2 * pos_unroll<KV>() : pos_unroll<KV>(); }

// Returns dim threadIdx.x (< hd) of the head's output. red: 2 * kAttnThreads / 32 floats; part: kAttnThreads /
// 32 * hd floats.
template <int KV, int U, int N>
__device__ __forceinline__ float attend_one_pass(const KvArgs& kv, const Rows& r, const FirstSlots<N>& fs,
                                                 const float (&qr)[8], float scale, int n_pos, int hd, float* red,
                                                 float* part) {
  static_assert(U <= N, "one slot per position of the pass");
  constexpr int W = kAttnThreads / 32, kRaw = KV == kKvF32 ? 2 : 1;
  uint4 kq[U][kRaw], vq[U][kRaw];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int p = u * r.n_groups + r.group;
    if (r.active && p < n_pos) {
      const int64_t off = fs.s[u] * r.kv_dim + r.head_off + 8 * r.gi;
      load_raw<KV>(kv.d_k, kv.d_ks, off, kq[u]);
      load_raw<KV>(kv.d_v, kv.d_vs, off, vq[u]);
    } else {
#pragma unroll
      for (int i = 0; i < kRaw; ++i) kq[u][i] = vq[u][i] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  float sc[U], m = -INFINITY;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float k8[8];
    unpack8<KV>(kq[u], k8);
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) d += qr[j] * k8[j];
    for (int o = r.G / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    sc[u] = u * r.n_groups + r.group < n_pos ? d * scale : -INFINITY;
    m = fmaxf(m, sc[u]);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  m = warp_max(m);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  float mx = red[0];
#pragma unroll
  for (int i = 1; i < W; ++i) mx = fmaxf(mx, red[i]);
  float e[U], l = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    e[u] = expf(sc[u] - mx);  // 0 for positions past the context
    l += e[u];
  }
  l = warp_sum(r.gi == 0 ? l : 0.f);  // a group's lanes hold the same sums: count each group once
  if (lane == 0) red[W + warp] = l;
  __syncthreads();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < W; ++i) sum += red[W + i];
  const float inv = 1.0f / sum;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float w = KV == kKvF16 ? round_to_half(e[u] * inv) : e[u] * inv;
    float v8[8];
    unpack8<KV>(vq[u], v8);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += w * v8[j];
  }
  for (int o = r.G; o < 32; o <<= 1)  // the warp's groups: lanes gi, gi + G, ... hold the same dims
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  if (lane < r.G && r.active)
#pragma unroll
    for (int j = 0; j < 8; ++j) part[warp * hd + 8 * r.gi + j] = acc[j];
  __syncthreads();
  float out = 0.f;
  if ((int)threadIdx.x < hd)
#pragma unroll
    for (int i = 0; i < W; ++i) out += part[i * hd + threadIdx.x];
  return out;
}

// Split-K bookkeeping (AttnScratch's device side; partial, counter and chunk are unused by the unsplit
// instance) and the decode switches every instance reads.
struct SplitArgs {
  float* partial;  // [token][head][gridDim.z][hd + 2]
  int* counter;    // [token][head]
  int chunk;
  int l2 = 0;      // 1: prefetch the CTA's K/V rows into L2 before pdl_wait (prefetch_context)
  int wide = 0;    // 1: contexts of up to one_pass_slots positions per group in one pass (hoisted F16 instance)
};

// Asks L2 for the head's K and V rows of the positions whose cache slots first_slots looked up (those of a
// pass's first iteration; one bulk prefetch per row and lane group) before pdl_wait. The rows themselves are
// not read until after the wait, so a row the previous kernel is still writing (the current position's) is
// read fresh: a prefetch only moves lines into L2, where every write lands. In decode the older rows were
// evicted by the step's weight stream, so the loads after the wait find them in L2 instead of going to HBM.
// Only slots already in registers: a table lookup per position here would put a chain of L2 round trips
// before the wait, which the kernel's start pays in full.
template <int KV, int N>
__device__ __forceinline__ void prefetch_context(const KvArgs& kv, const Rows& r, const FirstSlots<N>& fs, int p0,
                                                 int p1, int hd) {
  if (r.gi != 0) return;
  constexpr int64_t es = KV == kKvF32 ? 4 : KV == kKvF16 ? 2 : 1;
  const uint32_t n = (uint32_t)(hd * es);
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (p0 + u * r.n_groups + r.group >= p1) break;
    const int64_t off = (fs.s[u] * r.kv_dim + r.head_off) * es;
    prefetch_l2(static_cast<const char*>(kv.d_k) + off, n);
    prefetch_l2(static_cast<const char*>(kv.d_v) + off, n);
  }
}

// The (token t, head h) pair's partials, split by split.
__device__ __forceinline__ float* split_partials(const SplitArgs& sp, int t, int h, int n_heads, int hd) {
  return sp.partial + ((int64_t)t * n_heads + h) * gridDim.z * (hd + 2);
}

// The threadfence-reduction handshake: every thread fences its partial stores, and after the barrier thread 0
// fences again (cumulative over what the barrier made it observe) before counting the arrival, so the CTA
// that brings the count to n_act sees every partial once its own fence after the atomic has run. That CTA
// resets the counter for the next launch (later kernels see it after their pdl_wait).
__device__ __forceinline__ bool arrive_last(int* counter, int n_act) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const int prev = atomicAdd(counter, 1);
    __threadfence();
    last = prev == n_act - 1;
    if (last) atomicExch(counter, 0);
  }
  __syncthreads();
  return last;
}

// Dim d (< hd) of out = sum_s e^(m_s - M) O_s / sum_s e^(m_s - M) l_s, summed in split order so the result
// does not depend on which CTA finished last. Volatile loads: the partials were written by other CTAs, so
// bypass L1.
__device__ __forceinline__ float combine_splits(const float* partials, int n_act, int hd, int d) {
  const volatile float* pv = partials;
  const int stride = hd + 2;
  float m = -INFINITY;
  for (int s = 0; s < n_act; ++s) m = fmaxf(m, pv[s * stride]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < n_act; ++s) {
    const float c = expf(pv[s * stride] - m);
    num += c * pv[s * stride + 2 + d];
    den += c * pv[s * stride + 1];
  }
  return num / den;
}

// Writes dim d of head h's output (thread d; hd <= kAttnThreads): the float, and when the Wo product's input
// buffer is given, its element in that format with prep_kernel's own emit(), so the codes are those a
// separate Plain preparation would write (a Q8_0 block of 32 is one warp: hd % 32 == 0).
__device__ __forceinline__ void write_out(float* o, ActBuf qo, int t, int h, int hd, float v) {
  const int d = threadIdx.x;
  if (d < hd) o[d] = v;
  const int64_t i = (int64_t)h * hd + d;
  if (qo.kind == ActKind::Q8_0) {
    if ((threadIdx.x & ~31) < hd) emit<(int)ActKind::Q8_0>(v, d < hd, t, i, qo);
  } else if (qo.kind == ActKind::F16) {
    emit<(int)ActKind::F16>(v, d < hd, t, i, qo);
  } else if (qo.kind == ActKind::BF16) {
    emit<(int)ActKind::BF16>(v, d < hd, t, i, qo);
  }
}

// Grid (head, token, split). A context of at most sp.chunk positions (or an unsplit launch) is done whole by
// split 0, exactly as without splits; a longer one is cut into chunks of sp.chunk positions, one per split,
// and splits starting past its end exit. n_scores: the shared score buffer's length. The unsplit launch has
// its own instance (Split = false) so that the split bookkeeping costs it no registers. OnePass: an unsplit,
// unhoisted instance for steps whose every context fits one pass (the host's one_pass): only the one pass and
// the output, without the general passes' code (the same bits: a one-pass context is whole and takes the one
// pass in the other instances too). Copy: a second, identical one-pass instance for steps of 4 or more tokens,
// so that it can ask for another shared-memory carveout than the 1-3-token steps' (attention_carveout).
template <int KV, bool Split, bool Hoist, bool OnePass = false, int Copy = 0>
__global__ void __launch_bounds__(kAttnThreads) attention_kernel(const float* qkv, int64_t ld, const int32_t* d_pos,
                                                                 const int32_t* d_seq, int n_heads, int n_kv_heads,
                                                                 int hd, int n_scores, KvArgs kv, float* out,
                                                                 SplitArgs sp, ActBuf qo) {
  extern __shared__ float sm[];
  float* scores = sm;             // [n_scores]
  float* part = sm + n_scores + hd;  // [kAttnThreads][8]: each lane's partial V sums of its 8 dims
  __shared__ float red[2 * kAttnThreads / 32];
  // Positions, sequences and block tables are written before the step's first kernel, never by a kernel, so
  // everything up to the cache slots is looked up before the wait; after it, q and the first K rows load
  // together. (Splits without work exit without waiting: they read nothing.)
  const int h = blockIdx.x, t = blockIdx.y, split = blockIdx.z, pos = d_pos[t], seq = d_seq[t], n_pos = pos + 1;
  // Splits with work on this token; one: the whole context in split 0, the unsplit numerics.
  const int n_act = Split ? (n_pos + sp.chunk - 1) / sp.chunk : 1;
  const bool whole = n_act == 1;
  const int p0 = whole ? 0 : split * sp.chunk;
  pdl_trigger();
  if (whole ? split != 0 : p0 >= n_pos) return;
  const int p1 = whole ? n_pos : min(p0 + sp.chunk, n_pos);
  const int kvh = n_kv_heads == n_heads ? h : h / (n_heads / n_kv_heads);  // no division without GQA
  const Rows r = make_rows(seq, kvh, n_kv_heads, hd);
  constexpr int kSlots = one_pass_slots<KV, Hoist>();
  const FirstSlots<kSlots> fs = first_slots<kSlots>(kv, r, p0, p1);
  if (!OnePass && sp.l2) prefetch_context<KV>(kv, r, fs, p0, p1, hd);
  pdl_wait();
  float qr[8];
  if (r.active) {  // this lane's 8 dims of q, straight from the QKV product's output (16-byte aligned rows)
    const float4* qp = reinterpret_cast<const float4*>(qkv + (int64_t)t * ld + h * hd + 8 * r.gi);
    const float4 a = qp[0], b = qp[1];
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[j] = KV == kKvF16 ? round_to_half(v[j]) : v[j];
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[j] = 0.f;
  }
  const float scale = 1.0f / sqrtf((float)hd);
  if constexpr (OnePass) {
    static_assert(!Split && !Hoist, "the one-pass instance is unsplit and unhoisted");
    if (!fits_one_pass<KV>(r, n_pos)) __trap();  // the host launches it for one-pass contexts only
    const float v = attend_one_pass<KV, pos_unroll<KV>()>(kv, r, fs, qr, scale, n_pos, hd, red, part);
    write_out(out + (int64_t)t * n_heads * hd + h * hd, qo, t, h, hd, v);
    return;
  }
  if (whole && fits_one_pass<KV>(r, n_pos)) {
    const float v = attend_one_pass<KV, pos_unroll<KV>()>(kv, r, fs, qr, scale, n_pos, hd, red, part);
    write_out(out + (int64_t)t * n_heads * hd + h * hd, qo, t, h, hd, v);
    return;
  }
  if constexpr (kSlots > pos_unroll<KV>()) {  // the wider pass of the hoisted F16 instance
    if (whole && sp.wide && n_pos <= r.n_groups * kSlots) {
      const float v = attend_one_pass<KV, kSlots>(kv, r, fs, qr, scale, n_pos, hd, red, part);
      write_out(out + (int64_t)t * n_heads * hd + h * hd, qo, t, h, hd, v);
      return;
    }
  }
  FirstValues<KV> fv;
  float mx = score_pass<KV, Hoist>(kv, r, fs, qr, scale, p0, p1, scores, fv);
  mx = block_reduce(mx, red, true);  // also orders the score writes before the reads below
  // A split's partial: [max, sum of exp, V sum of hd]. Max and sum are stored before pass 2 so that they do
  // not hold registers through it.
  if (whole) {
    normalise<KV>(scores, n_pos, mx, red);
  } else {
    const float l = exp_weights<KV>(scores, p1 - p0, mx, red);
    float* mine = split_partials(sp, t, h, n_heads, hd) + (int64_t)split * (hd + 2);
    if (threadIdx.x == 0) {
      mine[0] = mx;
      mine[1] = l;
    }
  }
  value_pass<KV, Hoist>(kv, r, fs, fv, scores, p0, p1, part);
  float* o = out + (int64_t)t * n_heads * hd + h * hd;
  const int d = threadIdx.x;  // hd <= kAttnThreads: one dim per thread
  if (whole) {
    write_out(o, qo, t, h, hd, d < hd ? group_total(part, r, d) : 0.f);
    return;
  }
  float* partials = split_partials(sp, t, h, n_heads, hd);
  float* mine = partials + (int64_t)split * (hd + 2);
  if (d < hd) mine[2 + d] = group_total(part, r, d);
  if (arrive_last(sp.counter + (int64_t)t * n_heads + h, n_act))
    write_out(o, qo, t, h, hd, d < hd ? combine_splits(partials, n_act, hd, d) : 0.f);
}

size_t attention_smem(int n_scores, int hd) { return ((size_t)n_scores + hd + 8 * kAttnThreads) * sizeof(float); }

// Split-K chunk length for a context of n_ctx positions: about an eighth of it, rounded up to a multiple of 64
// (whole pass iterations for head sizes of 128 and up), but at least 256 positions, so that contexts of up to
// 256 are never split and a split's fixed costs (q load, reductions, partial write) stay small next to its
// K/V reads.
constexpr int kSplitsTarget = 8, kMinChunk = 256;
int split_chunk(int n_ctx) {
  const int per = (n_ctx + kSplitsTarget - 1) / kSplitsTarget;
  return std::max(kMinChunk, (per + 63) / 64 * 64);
}

// [cache kind][split][hoist]
using AttentionKernel = decltype(&attention_kernel<kKvF16, true, true>);
template <int KV>
constexpr AttentionKernel kernel_for(bool split, bool hoist) {
  return split ? (hoist ? attention_kernel<KV, true, true> : attention_kernel<KV, true, false>)
               : (hoist ? attention_kernel<KV, false, true> : attention_kernel<KV, false, false>);
}
const AttentionKernel kAttentionKernels[3][2][2] = {
    {{kernel_for<kKvF32>(false, false), kernel_for<kKvF32>(false, true)},
     {kernel_for<kKvF32>(true, false), kernel_for<kKvF32>(true, true)}},
    {{kernel_for<kKvF16>(false, false), kernel_for<kKvF16>(false, true)},
     {kernel_for<kKvF16>(true, false), kernel_for<kKvF16>(true, true)}},
    {{kernel_for<kKvQ8>(false, false), kernel_for<kKvQ8>(false, true)},
     {kernel_for<kKvQ8>(true, false), kernel_for<kKvQ8>(true, true)}}};
// [cache kind]
const AttentionKernel kOnePassKernels[3] = {attention_kernel<kKvF32, false, false, true>,
                                            attention_kernel<kKvF16, false, false, true>,
                                            attention_kernel<kKvQ8, false, false, true>};
// [cache kind]: the copies for one-pass steps of one_pass_copy_min() or more tokens
const AttentionKernel kOnePassBatchKernels[3] = {attention_kernel<kKvF32, false, false, true, 1>,
                                                 attention_kernel<kKvF16, false, false, true, 1>,
                                                 attention_kernel<kKvQ8, false, false, true, 1>};

// The shared-memory carveout (percent, -1 = the driver's choice) the attention kernel asks for:
// MERLIN_CUDA_CARVEOUT_ATTN=P where set (A/B timing), else 0 % (the most L1) for the one-pass copy that steps
// of 3 to 8 tokens run, the driver's choice otherwise. H200 tg128, base (docs/BENCHMARKS.md, thirty-eighth
// session), driver / 0 %: x8 q4_0 26,091 / 27,969 (+7.2 %), q8_0 +1.0 %, mxfp4 +4.3 %, q4_k +4.0 %, f16 +1.1 %,
// default model +4.4 %; x4 +1.0 to +6.1 %; but x2 q4_0 -2.1 %, mxfp4 -5.2 %, one token q4_0 -1.8 % (hence the
// copy, and its floor), x32 (the plain instance) q4_0 -16 %. Thirty-ninth session, copy / original instance:
// x3 q4_0 +1.1 %, mxfp4 +5.5 %, q4_k +2.8 %, q8_0 and the default model 0; x2 again q4_0 -2.5 %, mxfp4 -4.2 %.
// MERLIN_CUDA_ATTN_COPY_MIN=N (read once, default 3): the fewest tokens a step runs the copy for (A/B timing;
// the same bits either way).
int one_pass_copy_min() {
  static const int n = (int)env_int("MERLIN_CUDA_ATTN_COPY_MIN", 3);
  return n;
}
int attention_carveout(bool one_pass_copy) {
  const int env = carveout_attn_pct();
  return env != kCarveoutUnset ? env : one_pass_copy ? 0 : -1;
}

}  // namespace

void attention_prepare(int n_ctx) {
  const int bytes = (int)attention_smem(n_ctx, 256);
  MERLIN_CHECK(bytes <= 227 * 1024, "context of ", n_ctx, " positions is too long for the attention kernel");
  for (const auto& by_split : kAttentionKernels)
    for (const auto& by_hoist : by_split)
      for (auto kernel : by_hoist)
        MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  for (const auto& one_pass : {kOnePassKernels, kOnePassBatchKernels})
    for (int kind = 0; kind < 3; ++kind)
      MERLIN_CUDA_CHECK(cudaFuncSetAttribute(one_pass[kind], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(rope_kv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)kRopeKvSmemMax));
}

void rope_kv(float* d_qkv, int64_t ld, int64_t k_off, int64_t v_off, int n, const int32_t* d_pos, const int32_t* d_seq,
             const float* d_cos_sin, int n_heads, int n_kv_heads, int head_dim, int n_rot, const KvArgs& kv,
             Stream stream) {
  if (n <= 0) return;
  const size_t smem = kv.q8 ? 2 * (size_t)n_kv_heads * head_dim * sizeof(float) : 0;
  MERLIN_CHECK(!kv.q8 || ((int64_t)n_kv_heads * head_dim % 32 == 0 && head_dim % 8 == 0 && smem <= kRopeKvSmemMax),
               "rope_kv: a Q8_0 cache needs K/V rows of at most 16384 elements in blocks of 32");
  launch_pdl(rope_kv_kernel, n, kThreads, smem, stream, d_qkv, ld, k_off, v_off, d_pos, d_seq, d_cos_sin, n_heads,
             n_kv_heads, head_dim, n_rot, kv);
  check_launch("rope_kv");
}

AttnScratch attention_scratch_alloc(int max_tokens, int n_heads, int head_dim, int n_ctx) {
  AttnScratch s;
  s.chunk = split_chunk(n_ctx);
  s.n_split = (n_ctx + s.chunk - 1) / s.chunk;
  if (s.n_split <= 1 || max_tokens <= 0) return AttnScratch{};
  s.max_tokens = max_tokens;
  s.n_heads = n_heads;
  s.head_dim = head_dim;
  s.n_ctx = n_ctx;
  const size_t pairs = (size_t)max_tokens * n_heads;
  s.partial = static_cast<float*>(dev_alloc(pairs * s.n_split * (head_dim + 2) * sizeof(float)));
  s.counter = static_cast<int*>(dev_alloc(pairs * sizeof(int)));  // zero-filled
  return s;
}

void attention_scratch_free(AttnScratch& s) {
  dev_free(s.partial);
  dev_free(s.counter);
  s = AttnScratch{};
}

int attention_one_pass_positions(int head_dim, const KvArgs& kv) {
  return kAttnThreads / group_lanes(head_dim) * (kv.q8 ? pos_unroll<kKvQ8>() : pos_unroll<kKvF16>());
}

bool attention_emits(ActKind kind, int head_dim) {
  return (kind == ActKind::Q8_0 && head_dim % 32 == 0) || kind == ActKind::F16 || kind == ActKind::BF16;
}

void attention(const float* d_qkv, int64_t ld, int64_t k_off, int n, const int32_t* d_pos, const int32_t* d_seq,
               int n_heads, int n_kv_heads, int head_dim, int n_ctx, const KvArgs& kv, float* d_out, Stream stream,
               const AttnScratch* scratch, ActBuf* out_act, bool context_l2, bool one_pass) {
  if (n <= 0) return;
  (void)k_off;
  MERLIN_CHECK(head_dim % 8 == 0 && head_dim <= 256, "the CUDA attention kernel needs a head size that is a multiple "
               "of 8 and at most 256 (this model's is ", head_dim, ")");
  MERLIN_CHECK(ld % 4 == 0 && reinterpret_cast<uintptr_t>(d_qkv) % 16 == 0,
               "attention: query rows must be 16-byte aligned (lanes load q 16 bytes at a time)");
  // Larger batches already give every SM work without splitting.
  const bool split = scratch && scratch->n_split > 1 && n <= scratch->max_tokens;
  if (split)
    MERLIN_CHECK(scratch->n_heads == n_heads && scratch->head_dim == head_dim && scratch->n_ctx == n_ctx,
                 "attention scratch sized for another shape");
  SplitArgs sp = split ? SplitArgs{scratch->partial, scratch->counter, scratch->chunk}
                       : SplitArgs{nullptr, nullptr, n_ctx};
  // One-pass steps of up to MERLIN_CUDA_ATTN_LEAN tokens (read once, default 8) take the one-pass instance,
  // larger ones the plain instance. H200 tg128 (2026-12-02), plain / one-pass instance: base q4_0 x1
  // 4,778 / 4,942 t/s, x8 24,440 / 25,400, x32 93.4k / 91.4-92.0k (hence not for 32 tokens); mxfp4 x1
  // 4,136 / 4,284; q8_0 x1 4,512 / 4,513.
  static const long lean_max = env_int("MERLIN_CUDA_ATTN_LEAN", 8);
  const bool lean = one_pass && !split && n <= lean_max;
  const int n_scores = lean ? 0 : split ? scratch->chunk : n_ctx;
  const dim3 grid((unsigned)n_heads, (unsigned)n, split ? (unsigned)scratch->n_split : 1u);
  const size_t smem = attention_smem(n_scores, head_dim);
  // Hoisting pass 2's first V rows costs about 40 registers (2 CTAs per SM instead of 3): only for grids that
  // fit one wave at 2 per SM (decode of a few tokens, where the kernel is a chain of round trips).
  static const int sm_count = [] {
    int dev = 0, n_sm = 0;
    MERLIN_CUDA_CHECK(cudaGetDevice(&dev));
    MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    return n_sm;
  }();
  // A/B switches, read once: MERLIN_CUDA_ATTN_HOIST=0 never hoists, MERLIN_CUDA_ATTN_L2=0 never prefetches,
  // MERLIN_CUDA_ATTN_WIDE=0 takes the general passes past one pass of pos_unroll positions.
  static const bool hoist_on = !env_is("MERLIN_CUDA_ATTN_HOIST", "0");
  static const bool l2_on = !env_is("MERLIN_CUDA_ATTN_L2", "0");
  static const bool wide_on = !env_is("MERLIN_CUDA_ATTN_WIDE", "0");
  const int kind = kv.q8 ? kKvQ8 : kv.f16 ? kKvF16 : kKvF32;
  const int per_sm = kind == kKvQ8 ? 1 : 2;  // the Q8_0 instance with hoisted rows needs ~190 registers
  // Contexts of one plain pass take the plain instance: its one pass gives the same bits as the hoisted
  // instance's, in shorter code (H200 base q4_0 tg128, 2026-12-01: 4,678-4,687 -> 4,758-4,762 t/s;
  // the backend uses it for heads of up to 64, cuda_backend.cpp).
  const bool hoist =
      hoist_on && !one_pass && (int64_t)grid.x * grid.y * grid.z <= per_sm * (int64_t)sm_count;
  // The prefetch needs rows of whole 16-byte units (a Q8_0 row of hd codes: hd % 16 == 0). Only where the grid
  // fits one wave (decode): a larger grid's later CTAs start after the wait anyway. Not after a QKV product
  // that prefetched the context itself, which began several microseconds earlier: the slot lookups here
  // then only delay the wait (H200 tg128, both prefetches / the product's alone: macbook q4_0 743.6 / 746.7 t/s,
  // iphone q4_0 1,222 / 1,227).
  sp.l2 = l2_on && hoist && !context_l2 && (kind != kKvQ8 || head_dim % 16 == 0) ? 1 : 0;
  sp.wide = wide_on ? 1 : 0;
  const bool copy = lean && n >= one_pass_copy_min();
  const auto kernel = copy   ? kOnePassBatchKernels[kind]
                      : lean ? kOnePassKernels[kind]
                             : kAttentionKernels[kind][split][hoist];
  ActBuf qo;  // kind F32: no second output
  if (out_act) {
    MERLIN_CHECK(attention_emits(out_act->kind, head_dim) && out_act->k == (int64_t)n_heads * head_dim &&
                     n <= out_act->n_cap,
                 "attention: the output activation buffer does not fit");
    qo = *out_act;
  }
  apply_carveout(reinterpret_cast<const void*>(kernel), attention_carveout(copy));
  launch_pdl(kernel, grid, kAttnThreads, smem, stream, d_qkv, ld, d_pos, d_seq, n_heads, n_kv_heads, head_dim, n_scores,
             kv, d_out, sp, qo);
  check_launch("attention");
}

}  // namespace merlin::cuda
