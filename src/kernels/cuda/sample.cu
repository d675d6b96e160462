// Sampling on the device: the index of each logits row's maximum (greedy), and sample_row's draw with biases
// and penalties (sample_rows), so a decode step copies back one int32 per sequence instead of a row of
// vocab_size floats.
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int i;
};

// argmax() in sampler.h keeps the first maximum; `b` replaces `a` only when larger, or equal at a lower index,
// so every reduction order gives the host's answer. NaN never wins (undefined on the host as well).
__device__ __forceinline__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }

__device__ __forceinline__ Best warp_best(Best x) {
  for (int o = 16; o > 0; o >>= 1) {
    Best y{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
    x = better(x, y);
  }
  return x;
}

// One CTA per row. Each thread walks its strided slice in increasing index order (coalesced loads).
__global__ void argmax_rows_kernel(const float* __restrict__ logits, int64_t ld, int64_t n, int32_t* __restrict__ out) {
  const float* row = logits + (int64_t)blockIdx.x * ld;
  pdl_trigger();
  pdl_wait();
  Best b{-INFINITY, INT_MAX};
  for (int64_t i = threadIdx.x; i < n; i += kThreads) b = better(b, Best{__ldg(row + i), (int)i});
  b = warp_best(b);
  __shared__ Best warps[kThreads / 32];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[w] = b;
  __syncthreads();
  if (w == 0) {
    b = warp_best(warps[lane]);
    // A row of NaN only: index 0, as the host's loop would return.
    if (lane == 0) out[blockIdx.x] = b.i == INT_MAX ? 0 : b.i;
  }
}

// The row's first largest value (argmax_rows_kernel's loop and reductions); every thread gets the index.
__device__ int block_argmax(const float* row, int64_t n) {
  Best b{-INFINITY, INT_MAX};
  for (int64_t i = threadIdx.x; i < n; i += kThreads) b = better(b, Best{row[i], (int)i});
  b = warp_best(b);
  __shared__ Best warps[kThreads / 32];
  __shared__ int result;
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[w] = b;
  __syncthreads();
  if (w == 0) {
    b = warp_best(warps[lane]);
    if (lane == 0) result = b.i == INT_MAX ? 0 : b.i;
  }
  __syncthreads();
  return result;
}

__device__ float block_max(float v) {
  __shared__ float warps[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[w] = v;
  __syncthreads();
  v = warps[lane];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;  // the barrier of the next block reduction keeps warps[] from being overwritten early
}

// Exclusive prefix sum of v over the CTA's threads in thread order, and the total (fixed order: deterministic).
// One thread writes *total before the scan's last barrier: it must point to shared memory.
__device__ double block_exclusive_scan(double v, double* total) {
  __shared__ double warps[kThreads / 32];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  double incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) warps[w] = incl;
  __syncthreads();
  if (w == 0) {
    double t = warps[lane], ti = t;
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, ti, o);
      if (lane >= o) ti += up;
    }
    warps[lane] = ti - t;  // exclusive prefix of the warp totals
    if (lane == 31) *total = ti;
  }
  __syncthreads();
  return warps[w] + (incl - v);
}

// sample_row's draw over the whole row (no filter). Each thread takes a contiguous slice of the row: the
// slices' weight sums, scanned in thread order, say which slice holds u * total, and that thread walks its
// slice like the host loop.
__device__ int32_t draw_whole_row(const float* row, int64_t n, float m, double inv_t, double u) {
  const int64_t per = (n + kThreads - 1) / kThreads, b = min(n, (int64_t)threadIdx.x * per), e = min(n, b + per);
  double s = 0;
  for (int64_t i = b; i < e; ++i) s += exp((double)(row[i] - m) * inv_t);
  __shared__ double total;
  __shared__ int32_t pick;
  if (threadIdx.x == 0) pick = (int32_t)(n - 1);  // the host loop's answer when rounding leaves r >= 0
  const double prefix = block_exclusive_scan(s, &total);
  const double r = u * total;
  if (b < e && r >= prefix && r < prefix + s) {
    double left = r - prefix;
    int64_t i = b;
    for (; i < e - 1; ++i) {
      left -= exp((double)(row[i] - m) * inv_t);
      if (left < 0) break;
    }
    pick = (int32_t)i;
  }
  __syncthreads();
  return pick;
}

// Candidates of a filtered draw: the kCand best tokens at most, found on the device. A row whose filters
// keep more (top-k above kCand, or a top-p / min-p set that does not fit) is left to the host.
constexpr int kCand = kThreads;

// Float order as unsigned order (NaN lowest: it never wins on the host either).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = __float_as_uint(v);
  if (v != v) return 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// Candidate order: key descending, then id ascending, as one descending 64-bit value (0: no candidate).
__device__ __forceinline__ unsigned long long cand_code(uint32_t key, int64_t id) {
  return ((unsigned long long)key << 32) | (0xFFFFFFFFu - (uint32_t)id);
}
__device__ __forceinline__ int32_t cand_id(unsigned long long c) { return (int32_t)(0xFFFFFFFFu - (uint32_t)c); }

// Radix select (8 bits a pass, from the top): the key T of the kCand-th best element, and how many of the
// elements equal to T belong to the kCand best (the lowest ids). Lanes of a warp that hit the same bin add
// once (match_any): the first pass's bins are few and crowded.
__device__ void select_threshold(const float* row, int64_t n, uint32_t& threshold, int& n_equal) {
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_want;
  uint32_t prefix = 0, mask = 0;
  int want = kCand;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t base = 0; base < n; base += kThreads) {  // whole warps each round, for match_any
      const int64_t i = base + threadIdx.x;
      const uint32_t k = i < n ? order_key(row[i]) : 0u;
      const bool in = i < n && (k & mask) == prefix;
      const unsigned int bin = in ? (k >> shift) & 255u : 256u;
      const unsigned int same = __match_any_sync(0xffffffffu, bin);
      if (in && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane L: bins 255 - 8L .. 248 - 8L
      const int lane = threadIdx.x;
      int c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += c[j] = hist[255 - (lane * 8 + j)];
      int incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
      }
      int acc = incl - sum;
      if (acc < want && want <= incl) {
        for (int j = 0; j < 8; ++j) {
          if (acc + c[j] >= want) {
            s_prefix = prefix | ((uint32_t)(255 - (lane * 8 + j)) << shift);
            s_want = want - acc;
            break;
          }
          acc += c[j];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    want = s_want;
    mask |= 255u << shift;
  }
  threshold = prefix;
  n_equal = want;
}

// cand[0 .. min(n, kCand)) = the best tokens, sorted (key descending, then id); the rest 0.
__device__ void best_candidates(const float* row, int64_t n, unsigned long long* cand) {
  for (int j = threadIdx.x; j < kCand; j += kThreads) cand[j] = 0;
  __syncthreads();
  if (n <= kCand) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) cand[i] = cand_code(order_key(row[i]), i);
  } else {
    uint32_t t;
    int n_equal;
    select_threshold(row, n, t, n_equal);
    __shared__ int n_above;
    if (threadIdx.x == 0) n_above = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = order_key(row[i]);
      if (k > t) cand[atomicAdd(&n_above, 1)] = cand_code(k, i);  // exactly kCand - n_equal of them
    }
    // The elements equal to t, lowest ids first: contiguous slices, ranked by a scan in thread order.
    const int64_t per = (n + kThreads - 1) / kThreads, b = min(n, (int64_t)threadIdx.x * per), e = min(n, b + per);
    int count = 0;
    for (int64_t i = b; i < e; ++i) count += order_key(row[i]) == t;
    double unused;
    int rank = (int)block_exclusive_scan((double)count, &unused);
    for (int64_t i = b; i < e && rank < n_equal; ++i)
      if (order_key(row[i]) == t) cand[kCand - n_equal + rank++] = cand_code(t, i);
  }
  __syncthreads();
  for (int k = 2; k <= kCand; k <<= 1) {  // bitonic sort, descending
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int i = threadIdx.x, p = i ^ j;
      if (p > i) {
        const unsigned long long a = cand[i], c = cand[p];
        if ((i & k) == 0 ? a < c : a > c) {
          cand[i] = c;
          cand[p] = a;
        }
      }
      __syncthreads();
    }
  }
}

__device__ double block_total(double v) {
  __shared__ double total;
  block_exclusive_scan(v, &total);
  __syncthreads();  // total is written by warp 0 inside the scan, before its second barrier
  return total;
}

// sample_row's filtered draw: top-k, then top-p, then min-p at temperature 1 over the kCand best tokens, then
// the tempered draw over the kept ones in candidate order. -1 when the filters may keep more than kCand.
__device__ int32_t draw_filtered(const float* row, int64_t n, const RowSampling& rs) {
  __shared__ unsigned long long cand[kCand];
  best_candidates(row, n, cand);
  const int j = threadIdx.x;
  const int64_t n_valid = min(n, (int64_t)kCand);
  const int32_t id = j < n_valid ? cand_id(cand[j]) : 0;
  const float l = j < n_valid ? row[id] : -INFINITY;
  __shared__ float s_max;
  if (j == 0) s_max = l;  // the best candidate: the row's maximum
  __syncthreads();
  const float mx = s_max;
  const bool top_k_on = rs.top_k > 0 && rs.top_k < n;
  const int64_t k = top_k_on ? rs.top_k : n;
  if (top_k_on && k > n_valid) return -1;
  const double p1 = j < n_valid ? exp((double)(l - mx)) : 0.0;  // probability at temperature 1, unnormalised
  double total = 0;
  if (top_k_on) {
    total = block_total(j < k ? p1 : 0.0);
  } else if (rs.top_p < 1.0f) {
    double s = 0;
    for (int64_t i = j; i < n; i += kThreads) s += exp((double)(row[i] - mx));
    total = block_total(s);
  }
  int64_t bound = k;
  if (rs.min_p > 0) {
    double c = 0;
    for (int64_t i = j; i < n; i += kThreads) c += exp((double)(row[i] - mx)) >= rs.min_p ? 1.0 : 0.0;
    bound = min(bound, max((int64_t)block_total(c), (int64_t)1));
  }
  int64_t n_kept = bound;
  if (rs.top_p < 1.0f) {
    const int64_t lim = min(bound, n_valid);
    const double p = j < lim ? p1 / total : 0.0;
    double unused;
    const double cum = block_exclusive_scan(p, &unused) + p;
    __shared__ int first_reached;
    if (j == 0) first_reached = INT_MAX;
    __syncthreads();
    if (j < lim && cum >= rs.top_p) atomicMin(&first_reached, j);
    __syncthreads();
    if (first_reached != INT_MAX) n_kept = first_reached + 1;
  }
  if (n_kept > n_valid) return -1;
  n_kept = max(n_kept, (int64_t)1);
  const double w = j < n_kept ? exp((double)(l - mx) * (1.0 / (double)rs.temperature)) : 0.0;
  __shared__ double sum;  // written by one thread of the scan: shared, or the others read garbage
  const double before = block_exclusive_scan(w, &sum);
  __shared__ int32_t pick;
  if (j == 0) pick = cand_id(cand[n_kept - 1]);  // the host loop's answer when rounding leaves r >= 0
  __syncthreads();
  const double r = rs.u * sum;
  if (j < n_kept && r >= before && r < before + w) pick = id;
  __syncthreads();
  return pick;
}

// One CTA per row: sample_row (runtime/row_sampling.h) on the device, the adjustments applied to the row in
// place; -1 where the host must finish (draw_filtered).
__global__ void __launch_bounds__(kThreads, 1) sample_rows_kernel(float* __restrict__ logits, int64_t ld, int64_t n,
                                                             const RowSampling* __restrict__ rows,
                                                             const LogitAdjust* __restrict__ adjust,
                                                             int32_t* __restrict__ out) {
  float* row = logits + (int64_t)blockIdx.x * ld;
  const RowSampling rs = rows[blockIdx.x];
  for (int a = threadIdx.x; a < rs.n_adjust; a += kThreads) {  // one entry per token: no two threads collide
    const LogitAdjust e = adjust[rs.first + a];
    if (e.token < 0 || e.token >= n) continue;
    float l = row[e.token];
    if (e.flags & LogitAdjust::kBias) l = __fadd_rn(l, e.bias);
    if (e.flags & LogitAdjust::kPenalty) l = __fsub_rn(l, e.penalty);
    row[e.token] = l;
  }
  __syncthreads();  // also orders the adjusted logits (global memory) before the reads below
  int32_t token;
  if (rs.temperature <= 0) {
    token = block_argmax(row, n);
  } else if (rs.top_k > 0 || rs.top_p < 1.0f || rs.min_p > 0) {
    token = draw_filtered(row, n, rs);
  } else {
    float m = -INFINITY;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) m = fmaxf(m, row[i]);
    token = draw_whole_row(row, n, block_max(m), 1.0 / (double)rs.temperature, rs.u);
  }
  if (threadIdx.x == 0) out[blockIdx.x] = token;
}

}  // namespace

void sample_rows(float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                 const LogitAdjust* d_adjust, int32_t* d_out, Stream stream) {
  if (n_rows <= 0) return;
  sample_rows_kernel<<<n_rows, kThreads, 0, stream>>>(d_logits, ld, n, d_rows, d_adjust, d_out);
  check_launch("sample_rows");
}

void argmax_rows(const float* d_logits, int64_t ld, int n_rows, int64_t n, int32_t* d_out, Stream stream) {
  if (n_rows <= 0) return;
  launch_pdl(argmax_rows_kernel, n_rows, kThreads, 0, stream, d_logits, ld, n, d_out);
  check_launch("argmax_rows");
}

}  // namespace merlin::cuda
