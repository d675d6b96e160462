// What the rest of Merlin sees of the CUDA module (plain C++, no CUDA headers): the backend factory and a
// few device queries for `merlin bench`. Only declared in builds with MERLIN_CUDA (MERLIN_HAVE_CUDA).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace merlin {

class Backend;
class Model;
struct BackendOptions;

// Throws merlin::Error with the reason when no usable GPU is present.
std::unique_ptr<Backend> make_cuda_backend(const Model& model, const BackendOptions& opts);

namespace cuda {

// Programmatic dependent launch (common.cuh) applies to the kernels launched on this thread while a PdlScope
// lives (CudaBackend: while it captures a graph), or to every launch with MERLIN_CUDA_EAGER_PDL=1. Why not to
// eager launches: after a single eager step launched with it, every later graph replay in the process ran
// ~2.5 % slower on the H200 (base q4_0 tg128 after a 512-token prefill: 4,848-4,877 t/s, 4,964-4,997 with
// eager launches plain, as with no prefill at all; streams and capture streams made no difference), while
// eager prefill gains only ~3.5 % from it (pp512 ~410k -> ~395k t/s). docs/GPU.md.
class PdlScope {
 public:
  PdlScope();
  ~PdlScope();
  PdlScope(const PdlScope&) = delete;
  PdlScope& operator=(const PdlScope&) = delete;

 private:
  bool prev_;
};

// True when a CUDA device can be used; otherwise `why` (if given) says what is missing.
bool gpu_available(std::string* why = nullptr);
std::string device_name();
// Device-to-device copy bandwidth (bytes read + bytes written per second, GB/s) of a 2 GiB copy kernel,
// median of several runs: the ceiling decode's roofline is measured against.
double copy_bandwidth_gbps();
// Bytes of device memory in use on the current device (total - free), CUDA context included.
uint64_t device_memory_in_use();
// True when cuBLAS could be loaded (dlopen of libcublas.so.13), so prefill-sized steps use it (gemm.cu).
bool gemm_available(std::string* why = nullptr);

}  // namespace cuda
}  // namespace merlin
