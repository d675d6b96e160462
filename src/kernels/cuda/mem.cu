// Device memory, launch checks and the device queries of cuda_api.h.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/sys.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {
std::atomic<size_t> g_allocated{0};
// Size of each allocation, stored in front of it so dev_free can account for it.
constexpr size_t kHeader = 256;
}  // namespace

void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes + kHeader);
  if (e != cudaSuccess) {
    cudaGetLastError();
    fail("out of GPU memory: cannot allocate ", bytes, " bytes (", cudaGetErrorString(e), ")");
  }
  MERLIN_CUDA_CHECK(cudaMemset(p, 0, bytes + kHeader));
  MERLIN_CUDA_CHECK(cudaMemcpy(p, &bytes, sizeof bytes, cudaMemcpyHostToDevice));
  g_allocated += bytes;
  return static_cast<uint8_t*>(p) + kHeader;
}

void dev_free(void* p) {
  if (p == nullptr) return;
  uint8_t* base = static_cast<uint8_t*>(p) - kHeader;
  size_t bytes = 0;
  if (cudaMemcpy(&bytes, base, sizeof bytes, cudaMemcpyDeviceToHost) == cudaSuccess) g_allocated -= bytes;
  cudaFree(base);
}

// Fully synchronous: a cudaMemcpy from pageable memory may return before its DMA lands, and kernels on the
// backend's non-blocking stream do not wait for the legacy stream, so without the device sync a repack
// kernel could read a half-written staging buffer.
void copy_to_device(void* d_dst, const void* src, size_t bytes) {
  MERLIN_CUDA_CHECK(cudaMemcpy(d_dst, src, bytes, cudaMemcpyHostToDevice));
  MERLIN_CUDA_CHECK(cudaDeviceSynchronize());
}
void copy_to_host(void* dst, const void* d_src, size_t bytes) {
  MERLIN_CUDA_CHECK(cudaDeviceSynchronize());
  MERLIN_CUDA_CHECK(cudaMemcpy(dst, d_src, bytes, cudaMemcpyDeviceToHost));
}
void sync_device() { MERLIN_CUDA_CHECK(cudaDeviceSynchronize()); }
size_t allocated_bytes() { return g_allocated.load(); }

namespace {
bool& pdl_scoped() {
  thread_local bool on = false;
  return on;
}
}  // namespace

PdlScope::PdlScope() : prev_(pdl_scoped()) { pdl_scoped() = true; }
PdlScope::~PdlScope() { pdl_scoped() = prev_; }

bool pdl_enabled() {
  static const bool on = !env_is("MERLIN_CUDA_PDL", "0"), eager = env_is("MERLIN_CUDA_EAGER_PDL", "1");
  return on && (eager || pdl_scoped());
}

namespace {
// A carveout switch's value: -1 .. 100, kCarveoutUnset when the variable is not set.
int env_carveout(const char* name) {
  return std::getenv(name) ? (int)std::clamp(env_int(name, -1), -1L, 100L) : kCarveoutUnset;
}
}  // namespace

int carveout_pct() {
  static const int pct = env_carveout("MERLIN_CUDA_CARVEOUT");
  return pct;
}
int carveout_mv1_pct() {
  static const int pct = env_carveout("MERLIN_CUDA_CARVEOUT_MV1");
  return pct;
}
int carveout_attn_pct() {
  static const int pct = env_carveout("MERLIN_CUDA_CARVEOUT_ATTN");
  return pct;
}

void apply_carveout(const void* kernel, int pct) {
  if (pct < 0) return;  // the driver's choice (or unset)
  static std::mutex mu;
  static std::vector<const void*> done;
  const std::lock_guard<std::mutex> lock(mu);
  if (std::find(done.begin(), done.end(), kernel) != done.end()) return;
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, pct));
  done.push_back(kernel);
}

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("CUDA kernel launch failed (", what, "): ", cudaGetErrorString(e));
}

bool gpu_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why) *why = e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::string("no CUDA device found");
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp p{};
  MERLIN_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  if (p.major < 9) {
    if (why) *why = cat("device ", p.name, " is compute capability ", p.major, ".", p.minor, "; this build needs sm_90a");
    return false;
  }
  return true;
}

std::string device_name() {
  cudaDeviceProp p{};
  MERLIN_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  return p.name;
}

uint64_t device_memory_in_use() {
  size_t free_b = 0, total_b = 0;
  MERLIN_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return total_b - free_b;
}

namespace {
__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
}  // namespace

double copy_bandwidth_gbps() {
  const size_t bytes = size_t{1} << 30;  // 1 GiB each way: far beyond the 60 MB L2
  void* a = dev_alloc(bytes);
  void* b = dev_alloc(bytes);
  cudaDeviceProp p{};
  MERLIN_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  cudaEvent_t e0, e1;
  MERLIN_CUDA_CHECK(cudaEventCreate(&e0));
  MERLIN_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> gbps;
  for (int r = 0; r < 7; ++r) {
    MERLIN_CUDA_CHECK(cudaEventRecord(e0));
    copy_kernel<<<p.multiProcessorCount * 8, 512>>>(static_cast<const uint4*>(a), static_cast<uint4*>(b), bytes / 16);
    MERLIN_CUDA_CHECK(cudaEventRecord(e1));
    MERLIN_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MERLIN_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r > 0) gbps.push_back(2.0 * (double)bytes / (ms * 1e-3) / 1e9);  // the first run warms up
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  dev_free(a);
  dev_free(b);
  std::sort(gbps.begin(), gbps.end());
  return gbps[gbps.size() / 2];
}

}  // namespace merlin::cuda
