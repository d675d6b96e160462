// Quantized weight types (Q8_0, Q4_0, Q4_K, MXFP4, TQ1_0, TQ2_0) in ggml's exact block layouts: the hooks
// through which kernels.cpp, the runtime and tools reach them. Block structs and per-format reference
// functions are in quant_formats.h.
#pragma once
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"

namespace merlin::kernels {

// Matmul kernel for a quantized weight type at a level, or nullptr when the type is not quantized or not
// supported. Never called for F32/F16/BF16.
const MatmulKernel* quant_matmul_kernel(DType type, KernelLevel level);

// Dequantizes n elements (a whole number of blocks) of a quantized row; false when the type is unsupported.
bool quant_dequantize_row(DType type, const void* src, float* dst, int64_t n);

// Quantizes n floats (a whole number of blocks) with the scalar reference quantizer (byte-identical to
// llama-quantize without an importance matrix for Q8_0 and Q4_0); false when the type is unsupported.
// Q8_K, the activation type of the K and ternary kernels, is accepted too.
bool quant_quantize_row(DType type, const float* src, void* dst, int64_t n);

}  // namespace merlin::kernels
