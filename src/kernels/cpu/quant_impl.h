// Private to src/kernels/cpu: the per-level quantized matmul tables that quant_registry.cpp dispatches to.
// Each level returns nullptr for a type it does not implement, and the registry falls back a level.
#pragma once
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/kernels_impl.h"

namespace merlin::kernels::quant {

// Tokens at or above which a level switches from row-streaming dot products (decode) to its repacked
// token-parallel GEMM (prefill). The GEMMs compute tokens in groups (16 for AVX-512, 8 for AVX2) and unpack
// every weight once per call, so for few tokens the dot products win. Crossovers measured on Zen 4 with
// 768 x 768 weights; TQ2_0's dot products are cheap enough to win up to 16 tokens at both levels.
constexpr int64_t gemm_min_tokens(DType type, bool avx512) {
  return type == DType::TQ2_0 ? 16 : avx512 ? 10 : 6;
}

namespace scalar {
const MatmulKernel* matmul_kernel(DType type);
}
namespace avx2 {
const MatmulKernel* matmul_kernel(DType type);
// The token-parallel GEMM of quant_gemm_avx2.cpp; false for types it does not cover (Q8_0).
bool gemm(DType type, MERLIN_MATMUL_ARGS);
// The repacked layouts of quant_repack_avx2.cpp and quant_repack_k_avx2.cpp (the bytes of the AVX-512 ones).
extern const PackedMatmul kPackedQ8_0, kPackedQ4_0, kPackedMxfp4, kPackedQ4_K, kPackedTQ2_0;
}
namespace avx512 {
const MatmulKernel* matmul_kernel(DType type);
// The token-parallel GEMM of quant_gemm_avx512.cpp for any quantized type; false for other types.
bool gemm(DType type, MERLIN_MATMUL_ARGS);
// The repacked layouts of quant_repack_avx512.cpp and quant_repack_k_avx512.cpp (constant-initialized: no
// AVX-512 code runs at start-up).
extern const PackedMatmul kPackedQ8_0, kPackedQ4_0, kPackedMxfp4, kPackedQ4_K, kPackedTQ2_0;
}

}  // namespace merlin::kernels::quant
