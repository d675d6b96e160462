// Shared by the CUDA tests (tests/unit/cuda_*_test.cpp): the skip without a GPU, and device copies of host
// vectors. Only included by tests that exist in MERLIN_CUDA builds.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"
#include "logits_test_util.h"  // max_abs
#include "quant_test_util.h"

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

// A rows x k matrix of `type` in GGUF layout.
inline std::vector<uint8_t> random_matrix(DType type, int64_t rows, int64_t k, uint32_t seed) {
  const size_t row_bytes = dtype_row_bytes(type, (uint64_t)k);
  std::vector<uint8_t> m((size_t)rows * row_bytes);
  if (type == DType::F32 || type == DType::F16 || type == DType::BF16) {
    const std::vector<float> v = gaussian((size_t)rows * k, seed, 0.1f);
    for (size_t i = 0; i < v.size(); ++i) {
      if (type == DType::F32) std::memcpy(&m[4 * i], &v[i], 4);
      else {
        const uint16_t h = type == DType::F16 ? f32_to_fp16(v[i]) : f32_to_bf16(v[i]);
        std::memcpy(&m[2 * i], &h, 2);
      }
    }
  } else {
    randomize_blocks(type, m.data(), m.size() / dtype_info(type).block_bytes, seed);
  }
  return m;
}

}  // namespace merlin::test
