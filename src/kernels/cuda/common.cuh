// Shared by the .cu files of the CUDA module: error checks, half conversions and warp reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"

#define MERLIN_CUDA_CHECK(expr)                                                                      \
  do {                                                                                               \
    const cudaError_t err_ = (expr);                                                                 \
    if (err_ != cudaSuccess)                                                                         \
      ::merlin::fail("CUDA error: ", cudaGetErrorString(err_), " (", #expr, " at ", __FILE__, ":", \
                     __LINE__, ")");                                                                 \
  } while (0)

namespace merlin::cuda {

__device__ __forceinline__ float half_bits_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ float round_to_half(float x) { return __half2float(__float2half_rn(x)); }

// 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF (subnormal for e < 2).
__device__ __forceinline__ float e8m0_half(uint8_t e) {
  return __uint_as_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Programmatic dependent launch (sm_90). Every kernel of a forward step is launched with launch_pdl, so it
// may start while the kernel before it on the stream still runs; its prologue (weight loads, index math)
// then overlaps that kernel's tail instead of waiting behind a launch gap. The rule that keeps it correct:
// a kernel calls pdl_wait() before it reads anything an earlier kernel wrote or writes anything an earlier
// kernel reads; only immutable data (weights, scales, tables built at load) may be touched before. Since
// every kernel waits, completion is transitive: when pdl_wait returns, all earlier kernels have finished.
// pdl_trigger() lets the next kernel be scheduled as soon as all CTAs of this one are resident. Without
// the launch attribute both instructions are no-ops.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// L2 prefetch of n bytes (16-byte aligned, a multiple of 16) with one instruction and no registers held.
__device__ __forceinline__ void prefetch_l2(const void* a, uint32_t n) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(n) : "memory");
}

// Whether this launch gets the attribute: inside a PdlScope (graph capture) or with MERLIN_CUDA_EAGER_PDL=1
// (cuda_api.h says why not otherwise); MERLIN_CUDA_PDL=0 turns it off everywhere (for A/B timing).
bool pdl_enabled();

// MERLIN_CUDA_CARVEOUT=P (read once; A/B timing): every kernel launch_pdl starts first sets its preferred
// shared-memory carveout to P percent (cudaFuncAttributePreferredSharedMemoryCarveout), so that all kernels
// of a step ask for the same L1 / shared split. Each switch reads kCarveoutUnset when unset, and -1 means the
// driver's choice; apply_carveout ignores both. MERLIN_CUDA_CARVEOUT_MV1=P: the single-token products only
// (matvec1.cu, matvec1_half.cu), which otherwise take matvec1.cu's mv1_carveout (Q8_0 and Q4_K rows shorter
// than 3,072: 50 %; all else the driver's choice). MERLIN_CUDA_CARVEOUT_ATTN=P: the attention kernels only,
// which otherwise take attention.cu's attention_carveout (the one-pass copy of 4-8-token steps: 0 %; all else
// the driver's choice). A kernel keeps the first value it is given.
constexpr int kCarveoutUnset = -2;
int carveout_pct();
int carveout_mv1_pct();
int carveout_attn_pct();
void apply_carveout(const void* kernel, int pct);

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  if (carveout_pct() >= 0) apply_carveout(reinterpret_cast<const void*>(kernel), carveout_pct());  // A/B only
  MERLIN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...));
}

}  // namespace merlin::cuda
