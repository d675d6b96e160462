// Dispatch from (quantized type, kernel level) to the kernels of quant_*.cpp, and row (de)quantization by
// type for embedding lookups, tests and tools.
#include "kernels/cpu/quant.h"

#include "kernels/cpu/quant_formats.h"
#include "kernels/cpu/quant_impl.h"

namespace merlin::kernels {

// Levels above what the CPU supports are capped, so a caller can never reach instructions it lacks.
const MatmulKernel* quant_matmul_kernel(DType type, KernelLevel level) {
  const KernelLevel best = best_kernel_level();
  if (level > best) level = best;
  const MatmulKernel* k = nullptr;
  if (level >= KernelLevel::Avx512) k = quant::avx512::matmul_kernel(type);
  if (k == nullptr && level >= KernelLevel::Avx2) k = quant::avx2::matmul_kernel(type);
  if (k == nullptr) k = quant::scalar::matmul_kernel(type);
  return k;
}

bool quant_dequantize_row(DType type, const void* src, float* dst, int64_t n) {
  using namespace quant;
  switch (type) {
    case DType::Q8_0: dequantize_row_q8_0(src, dst, n); return true;
    case DType::Q4_0: dequantize_row_q4_0(src, dst, n); return true;
    case DType::MXFP4: dequantize_row_mxfp4(src, dst, n); return true;
    case DType::Q4_K: dequantize_row_q4_k(src, dst, n); return true;
    case DType::TQ1_0: dequantize_row_tq1_0(src, dst, n); return true;
    case DType::TQ2_0: dequantize_row_tq2_0(src, dst, n); return true;
    case DType::Q8_K: dequantize_row_q8_k(src, dst, n); return true;
    default: return false;
  }
}

bool quant_quantize_row(DType type, const float* src, void* dst, int64_t n) {
  using namespace quant;
  switch (type) {
    case DType::Q8_0: quantize_row_q8_0(src, dst, n); return true;
    case DType::Q4_0: quantize_row_q4_0(src, dst, n); return true;
    case DType::MXFP4: quantize_row_mxfp4(src, dst, n); return true;
    case DType::Q4_K: quantize_row_q4_k(src, dst, n); return true;
    case DType::TQ1_0: quantize_row_tq1_0(src, dst, n); return true;
    case DType::TQ2_0: quantize_row_tq2_0(src, dst, n); return true;
    case DType::Q8_K: quantize_row_q8_k(src, dst, n); return true;
    default: return false;
  }
}

}  // namespace merlin::kernels
