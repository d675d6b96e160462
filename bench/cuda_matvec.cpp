// Standalone timing of the CUDA matrix products on one large matrix per weight type (docs/GPU.md,
// "Benchmarks"): the achieved weight-streaming bandwidth for 1, 8 and 32 tokens, against the device copy
// bandwidth. Several copies of the matrix rotate so that no launch finds its weights in the 60 MB L2.
//
//   cuda_matvec [ROWS K [TYPES]]   (default 16384 4096 and 4096 16384, the 7.19B model's gate/up and down;
//                                   TYPES: comma-separated type names, e.g. q4_0,q8_0; default all six)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"

using namespace merlin;
namespace cu = merlin::cuda;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Random bytes: the products' speed does not depend on the values (the data are never zeros, METHOD.md).
std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = (uint8_t)rng();
  return v;
}

// Median time in microseconds of one product over `copies` rotating matrices.
double time_matmul(const std::vector<cu::Matrix>& mats, const cu::ActBuf& x, int n, float* y, int64_t rows,
                   cudaStream_t s) {
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  const int per_rep = 24;
  // Launched as in a decode step's graph: each product may start while the one before it finishes.
  const cu::PdlScope pdl;
  std::vector<double> us;
  for (int rep = 0; rep < 7; ++rep) {
    check(cudaEventRecord(e0, s), "record");
    for (int i = 0; i < per_rep; ++i)
      cu::matmul(mats[i % mats.size()], x, n, y, rows, rows, false, s);
    check(cudaEventRecord(e1, s), "record");
    check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (rep > 0) us.push_back(1000.0 * ms / per_rep);  // the first repetition warms up
  }
  std::sort(us.begin(), us.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return us[us.size() / 2];
}

void run_shape(int64_t rows, int64_t k, double copy_gbps, cudaStream_t s, const std::string& only = "") {
  const DType types[] = {DType::Q4_0, DType::Q4_K, DType::MXFP4, DType::Q8_0, DType::TQ2_0, DType::BF16};
  float* y = static_cast<float*>(cu::dev_alloc((size_t)32 * rows * sizeof(float)));
  std::vector<float> xs = [&] {
    std::mt19937 rng(7);
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> v((size_t)32 * k);
    for (float& f : v) f = d(rng);
    return v;
  }();
  float* d_xf = static_cast<float*>(cu::dev_alloc(xs.size() * sizeof(float)));
  cu::copy_to_device(d_xf, xs.data(), xs.size() * sizeof(float));
  for (DType t : types) {
    if (k % dtype_info(t).block_size != 0) continue;
    if (!only.empty() && ("," + only + ",").find("," + std::string(dtype_name(t)) + ",") == std::string::npos) continue;
    const size_t row_bytes = dtype_row_bytes(t, (uint64_t)k);
    const std::vector<uint8_t> raw = random_bytes(row_bytes * rows, 11);
    const cu::MatrixPart part{t, raw.data(), rows, k, row_bytes};
    std::vector<cu::Matrix> mats;
    size_t bytes = 0;
    while (bytes < ((size_t)256 << 20)) {  // > 4x the L2
      mats.push_back(cu::upload_matrix(&part, 1, nullptr));
      bytes += mats.back().bytes;
    }
    cu::ActBuf x = cu::act_alloc(cu::act_kind_for(t), k, 32);
    cu::PrepArgs plain{cu::Prep::Plain, d_xf, k, nullptr, 0, 0, nullptr};
    cu::prep_act(plain, 32, x, nullptr);
    cu::sync_device();
    for (int n : {1, 8, 32}) {
      const double us = time_matmul(mats, x, n, y, rows, s);
      const double gbps = (double)mats[0].bytes / (us * 1e-6) / 1e9;
      std::printf("| %s | %lld x %lld | %d | %.2f | %.0f | %.0f %% |\n", dtype_name(t), (long long)rows, (long long)k,
                  n, us, gbps, 100.0 * gbps / copy_gbps);
    }
    cu::act_free(x);
    for (cu::Matrix& m : mats) cu::free_matrix(m);
  }
  cu::dev_free(y);
  cu::dev_free(d_xf);
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (!cu::gpu_available(&why)) {
    std::printf("no usable CUDA GPU: %s\n", why.c_str());
    return 0;
  }
  const double copy = cu::copy_bandwidth_gbps();
  std::printf("device %s, copy bandwidth %.0f GB/s (read + write)\n", cu::device_name().c_str(), copy);
  std::printf("| type | rows x k | tokens | us | weight GB/s | of copy bw |\n");
  std::printf("| --- | --- | ---: | ---: | ---: | ---: |\n");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  if (argc == 3 || argc == 4) {
    run_shape(std::atoll(argv[1]), std::atoll(argv[2]), copy, s, argc == 4 ? argv[3] : "");
  } else {
    run_shape(16384, 4096, copy, s);
    run_shape(4096, 16384, copy, s);
  }
  cudaStreamDestroy(s);
  return 0;
}
