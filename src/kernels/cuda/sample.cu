// Greedy sampling on the device: the index of each logits row's maximum, so a decode step copies back one
// int32 per sequence instead of a row of vocab_size floats.
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

}  // namespace

void argmax_rows(const float* d_logits, int64_t ld, int n_rows, int64_t n, int32_t* d_out, Stream stream) {
  if (n_rows <= 0) return;
  launch_pdl(argmax_rows_kernel, n_rows, kThreads, 0, stream, d_logits, ld, n, d_out);
  check_launch("argmax_rows");
}

}  // namespace merlin::cuda
