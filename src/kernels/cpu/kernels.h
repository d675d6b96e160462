// CPU kernels: pure functions on buffers. They know shapes and element types, never models, and never
// spawn threads: the runtime splits work (usually over output rows) and calls them per thread.
//
// Every kernel exists as a scalar reference and, where it pays, AVX2 and AVX-512 variants compiled in
// their own translation units with the matching -m flags. kernels_for(level) returns the table for a
// level; kernels() returns the table for active_kernel_level() (MERLIN_KERNELS can force it down).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace merlin::kernels {

// Matrix product of a weight matrix (rows = output features, each row `k` elements of type w_type stored in
// `w_row_bytes`) with n_tokens activation rows:
//   y[t * ldy + r] = sum_i W[r][i] * x[t][i]    for r in [r0, r1), t in [0, n_tokens)
// `x` is in the kernel's activation format (act_type): plain float rows of length k for float weights,
// or rows quantized by quantize_act (x_row_bytes apart).
struct MatmulKernel {
  DType act_type = DType::F32;
  // Converts n_tokens float rows of length k into act_type rows (x_row_bytes apart). Null for F32.
  void (*quantize_act)(const float* x, int64_t n_tokens, int64_t k, void* out) = nullptr;
  void (*rows)(const void* w, size_t w_row_bytes, int64_t r0, int64_t r1, const void* x, size_t x_row_bytes,
               int64_t n_tokens, int64_t k, float* y, int64_t ldy) = nullptr;
};

struct KernelTable {
  KernelLevel level;
  // Matrix products, indexed by weight type; rows == nullptr when the type is unsupported.
  const MatmulKernel* (*matmul)(DType weight_type);

  // y = x / rms(x) * w   (n elements; y may alias x)
  void (*rmsnorm)(const float* x, const float* w, int64_t n, float eps, float* y);
  // out[i] = silu(gate[i]) * up[i]  (out may alias gate)
  void (*swiglu)(const float* gate, const float* up, int64_t n, float* out);
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);  // y += a * x
  void (*add)(const float* a, const float* b, float* out, int64_t n);  // out may alias a
  // In-place softmax over n values; returns nothing, input must be finite or -inf.
  void (*softmax)(float* x, int64_t n);
  void (*axpy_f16)(float a, const uint16_t* x, float* y, int64_t n);  // y += a * x, x in IEEE half
};

const KernelTable& kernels_for(KernelLevel level);
const KernelTable& kernels();  // active level

// Row of n floats from any float weight type (used for embedding lookups and tests).
void dequantize_row(DType type, const void* src, float* dst, int64_t n);

// RoPE as llama.cpp's LLAMA architecture applies it ("normal" mode): rotate adjacent pairs (x[2i], x[2i+1])
// of the first n_rot dims of each head by angle pos * theta^(-2i/n_rot).
void rope_inplace(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, int64_t pos, float theta);

}  // namespace merlin::kernels
