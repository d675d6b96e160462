// The pooled twins of the lean one-token RoPE instance (matvec1_pool.h). Their own translation unit keeps
// matvec1.cu's module, and so the placement of every other single-token kernel, as it was without them:
// in matvec1.cu they cost base q4_k 1.2-1.7 % at batch 1 without ever running there (the PTX of every other
// instance unchanged), here nothing (H200 tg128, same call: 4,034 t/s before them, 3,984-3,987 with them in
// matvec1.cu, 4,056 here; iphone unchanged between the two). Every kernel added to a module can move the
// others: measure a step's speed, not only the new kernel's.
#include "kernels/cuda/matvec1_pool.h"

#include "kernels/cuda/matvec1_kernel.cuh"

namespace merlin::cuda {
namespace {

int g_pool_resident[8][2][kBuckets] = {};

template <int F, bool X>
constexpr auto kTwin = mv1_kernel<F, 2, kEpiRope, X, false, kRunPool>;

template <int F, bool X>
const void* twin() {
  return reinterpret_cast<const void*>(kTwin<F, X>);
}

template <int F, bool X>
void prepare_twin() {
  const auto kernel = kTwin<F, X>;
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem_bytes_glu<F>(kMaxK, 1)));
  for (int b = 0; b < kBuckets; ++b)
    MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_pool_resident[F][X ? 1 : 0][b], kernel,
                                                                     kWarps * 32, smem_rows<F>((b + 1) * kKBucket, 1)));
}

template <int F>
void prepare_twins() {
  prepare_twin<F, false>();
  prepare_twin<F, true>();
}

}  // namespace

void init_matvec1_pool_kernels() {
  prepare_twins<kQ8_0>();
  prepare_twins<kQ4_0>();
  prepare_twins<kMXFP4>();
  prepare_twins<kQ4_K>();
}

const void* matvec1_pool_kernel(int f, bool exact) {
  switch (f) {
    case kQ8_0: return exact ? twin<kQ8_0, true>() : twin<kQ8_0, false>();
    case kQ4_0: return exact ? twin<kQ4_0, true>() : twin<kQ4_0, false>();
    case kMXFP4: return exact ? twin<kMXFP4, true>() : twin<kMXFP4, false>();
    case kQ4_K: return exact ? twin<kQ4_K, true>() : twin<kQ4_K, false>();
    default: return nullptr;
  }
}

int matvec1_pool_resident(int f, bool exact, int64_t k) {
  if (f < 0 || f >= 8 || k <= 0 || k > kMaxK) return 0;
  return g_pool_resident[f][exact ? 1 : 0][(k - 1) / kKBucket];
}

}  // namespace merlin::cuda
