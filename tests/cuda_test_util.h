// Shared by the CUDA tests (tests/unit/cuda_*_test.cpp): the skip without a GPU, and device copies of host
// vectors. Only included by tests that exist in MERLIN_CUDA builds.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"

// Skips the test, with the reason, when no usable CUDA GPU is present (what CI sees).
#define MERLIN_REQUIRE_GPU()                                                                  \
  do {                                                                                        \
    std::string why_;                                                                         \
    if (!::merlin::cuda::gpu_available(&why_)) GTEST_SKIP() << "no usable CUDA GPU: " << why_; \
  } while (0)

namespace merlin::test {

// A device copy of v (at least one element allocated); free with cuda::dev_free.
template <class T>
T* upload(const std::vector<T>& v) {
  T* d = static_cast<T*>(cuda::dev_alloc(std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) cuda::copy_to_device(d, v.data(), v.size() * sizeof(T));
  return d;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> h(n);
  cuda::copy_to_host(h.data(), d, n * sizeof(T));
  return h;
}

// Device copy of host floats, freed at scope exit.
struct DevFloats {
  float* p;
  explicit DevFloats(const std::vector<float>& v) : p(upload(v)) {}
  DevFloats(const DevFloats&) = delete;
  DevFloats& operator=(const DevFloats&) = delete;
  ~DevFloats() { cuda::dev_free(p); }
};

}  // namespace merlin::test
