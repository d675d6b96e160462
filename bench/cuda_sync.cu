// What a dependency between two phases of a decode step costs on this GPU, without any work in them
// (docs/GPU.md, "Left to do": is a persistent decode kernel worth it?). Three ways to order P phases, each
// phase a grid of G CTAs of 256 threads in which every CTA reads a word another CTA wrote in the phase
// before and writes its own:
//   kernels     one kernel per phase, plain stream order, captured in a CUDA graph;
//   pdl         the same with programmatic dependent launch (griddepcontrol), as every kernel of a step runs;
//   barrier     one persistent kernel whose phases meet at a grid-wide barrier (an atomic counter in global
//               memory, release / acquire), as a persistent decode kernel would.
// Prints the median time per phase over several replays.
//
//   cuda_sync [PHASES]        (default 512)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

constexpr int kThreads = 256;

// One phase: CTA b reads what CTA b + 1 wrote into `in` and writes into `out`.
__device__ __forceinline__ void phase_body(const unsigned* in, unsigned* out) {
  if (threadIdx.x == 0) {
    const unsigned next = (blockIdx.x + 1) % gridDim.x;
    out[blockIdx.x] = *((volatile const unsigned*)in + next) + 1;
  }
}

__global__ void phase_kernel(const unsigned* in, unsigned* out, int pdl) {
  if (pdl) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  phase_body(in, out);
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All phases in one kernel: after phase p every CTA adds 1 to *count (release) and waits until it reads
// (p + 1) * G (acquire). bufs holds phases + 1 rows of G words.
__global__ void persistent_kernel(unsigned* bufs, unsigned* count, int phases) {
  for (int p = 0; p < phases; ++p) {
    phase_body(bufs + (size_t)p * gridDim.x, bufs + (size_t)(p + 1) * gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
      const unsigned target = (unsigned)(p + 1) * gridDim.x;
      while (load_acquire(count) < target) {
      }
    }
    __syncthreads();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median microseconds per phase of `launch` (queues `phases` phases on s) over 8 timed repetitions after one
// warm-up.
template <class Launch>
double time_phases(int phases, cudaStream_t s, Launch launch) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<double> us;
  for (int rep = 0; rep < 9; ++rep) {
    check(cudaEventRecord(e0, s), "record");
    launch();
    check(cudaEventRecord(e1, s), "record");
    check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (rep > 0) us.push_back(1000.0 * ms / phases);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return median(us);
}

// A captured graph of `phases` phase kernels, with or without programmatic dependent launch.
double time_chain(int grid, int phases, bool pdl, unsigned* bufs, cudaStream_t s) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
  for (int p = 0; p < phases; ++p) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl ? 1 : 0;
    const unsigned* in = bufs + (size_t)p * grid;
    unsigned* out = bufs + (size_t)(p + 1) * grid;
    check(cudaLaunchKernelEx(&cfg, phase_kernel, in, out, pdl ? 1 : 0), "launch");
  }
  check(cudaStreamEndCapture(s, &graph), "end capture");
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  const double us = time_phases(phases, s, [&] { check(cudaGraphLaunch(exec, s), "graph launch"); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return us;
}

// One cooperative launch of the persistent kernel (the runtime refuses a grid that cannot be resident at once,
// where the barrier would hang).
double time_persistent(int grid, int phases, unsigned* bufs, unsigned* count, cudaStream_t s) {
  return time_phases(phases, s, [&] {
    check(cudaMemsetAsync(count, 0, sizeof(unsigned), s), "memset");
    void* args[] = {&bufs, &count, &phases};
    check(cudaLaunchCooperativeKernel((const void*)persistent_kernel, dim3(grid), dim3(kThreads), args, 0, s),
          "cooperative launch");
  });
}

}  // namespace

int main(int argc, char** argv) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("no usable CUDA GPU\n");
    return 0;
  }
  const int phases = argc > 1 ? std::max(1, std::atoi(argv[1])) : 512;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kThreads, 0), "occupancy");
  const int sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, %d phases\n", prop.name, sms, phases);
  std::printf("| CTAs | kernels (graph) us/phase | pdl (graph) us/phase | barrier (one kernel) us/phase |\n");
  std::printf("| ---: | ---: | ---: | ---: |\n");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  for (int grid : {sms / 4, sms, 2 * sms}) {
    if (grid > sms * per_sm) continue;
    unsigned *bufs = nullptr, *count = nullptr;
    check(cudaMalloc(&bufs, (size_t)(phases + 1) * grid * sizeof(unsigned)), "malloc");
    check(cudaMalloc(&count, sizeof(unsigned)), "malloc");
    check(cudaMemset(bufs, 0, (size_t)(phases + 1) * grid * sizeof(unsigned)), "memset");
    const double plain = time_chain(grid, phases, false, bufs, s);
    const double pdl = time_chain(grid, phases, true, bufs, s);
    const double bar = time_persistent(grid, phases, bufs, count, s);
    // Every phase adds 1 along a chain: the last row must hold `phases` everywhere.
    std::vector<unsigned> last(grid);
    check(cudaMemcpy(last.data(), bufs + (size_t)phases * grid, grid * sizeof(unsigned), cudaMemcpyDeviceToHost),
          "copy");
    const bool ok = std::all_of(last.begin(), last.end(), [&](unsigned v) { return v == (unsigned)phases; });
    std::printf("| %d | %.2f | %.2f | %.2f |%s\n", grid, plain, pdl, bar, ok ? "" : " (WRONG RESULT)");
    cudaFree(bufs);
    cudaFree(count);
  }
  cudaStreamDestroy(s);
  return 0;
}
