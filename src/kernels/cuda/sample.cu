// Sampling on the device: the index of each logits row's maximum (greedy), and sample_row's draw with biases
// and penalties (sample_rows), so a decode step copies back one int32 per sequence instead of a row of
// vocab_size floats. This file: argmax and sample_rows by one CTA per row (the fallback and the reference of
// the sliced path in sample_slices.cu).
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/sample_impl.cuh"

namespace merlin::cuda {
namespace {

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

__global__ void keys_to_ids_kernel(unsigned long long* keys, int n, int32_t* ids) {
  pdl_trigger();
  pdl_wait();
  const int t = threadIdx.x;
  if (t < n) {
    ids[t] = argmax_key_row(keys[t]);
    keys[t] = 0ull;
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
                 const LogitAdjust* d_adjust, int32_t* d_out, Stream stream, void* d_work) {
  if (n_rows <= 0) return;
  if (d_work && n <= sliced_vocab_max()) {
    sample_rows_sliced(d_logits, ld, n_rows, n, d_rows, d_adjust, d_out, stream, d_work);
    return;
  }
  sample_rows_kernel<<<n_rows, kThreads, 0, stream>>>(d_logits, ld, n, d_rows, d_adjust, d_out);
  check_launch("sample_rows");
}

void argmax_rows(const float* d_logits, int64_t ld, int n_rows, int64_t n, int32_t* d_out, Stream stream) {
  if (n_rows <= 0) return;
  launch_pdl(argmax_rows_kernel, n_rows, kThreads, 0, stream, d_logits, ld, n, d_out);
  check_launch("argmax_rows");
}

void argmax_keys_to_ids(unsigned long long* d_keys, int n, int32_t* d_ids, Stream stream) {
  if (n <= 0) return;
  MERLIN_CHECK(n <= 1024, "argmax_keys_to_ids: ", n, " keys (1024 at most)");
  launch_pdl(keys_to_ids_kernel, 1, ((n + 31) / 32) * 32, 0, stream, d_keys, n, d_ids);
  check_launch("argmax_keys_to_ids");
}

}  // namespace merlin::cuda
