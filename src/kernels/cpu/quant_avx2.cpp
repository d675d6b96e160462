// AVX2 quantized matmuls. Few tokens: the 256-bit tiles of quant_simd_*.h with maddubs/madd integer dot
// products (16 vector registers allow 4 rows x 2 tokens of accumulators). Many tokens: the repacked GEMM of
// quant_gemm_avx2.cpp, except for Q8_0. Every type but TQ1_0 also has a load-time layout
// (quant_repack_avx2.cpp, quant_repack_k_avx2.cpp), which the runtime uses instead of both.
#define MERLIN_QUANT_LEVEL avx2
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_simd_k.h"
#include "kernels/cpu/quant_simd_q32.h"

namespace merlin::kernels::quant::avx2 {
namespace {

// Batch invariance (see quant_avx512.cpp): only the 32-element block types accumulate in the GEMM exactly
// as in the tiles; the super-block types run their tiles for every token count.
constexpr bool gemm_matches_tiles(DType type) {
  return type == DType::Q8_0 || type == DType::Q4_0 || type == DType::MXFP4;
}

template <DType Type, template <int, int> class Tile>
void matmul(MERLIN_MATMUL_ARGS) {
  if (gemm_matches_tiles(Type) && n_tokens >= gemm_min_tokens(Type, false) &&
      gemm(Type, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy))
    return;
  const Args a{static_cast<const char*>(w), w_row_bytes, static_cast<const char*>(x), x_row_bytes, k, y, ldy};
  run_tiles<Tile, 4, 2>(a, r0, r1, n_tokens);
}

const MatmulKernel kQ8_0{DType::Q8_0, &quantize_rows_q8_0, &matmul<DType::Q8_0, TileQ8_0>, &kPackedQ8_0};
const MatmulKernel kQ4_0{DType::Q8_0, &quantize_rows_q8_0, &matmul<DType::Q4_0, TileQ4_0>, &kPackedQ4_0};
const MatmulKernel kMxfp4{DType::Q8_0, &quantize_rows_q8_0, &matmul<DType::MXFP4, TileMxfp4>, &kPackedMxfp4};
const MatmulKernel kQ4_K{DType::Q8_K, &quantize_rows_q8_k, &matmul<DType::Q4_K, TileQ4_K>, &kPackedQ4_K};
const MatmulKernel kTQ1_0{DType::Q8_K, &quantize_rows_q8_k, &matmul<DType::TQ1_0, TileTQ1_0>};
const MatmulKernel kTQ2_0{DType::Q8_K, &quantize_rows_q8_k, &matmul<DType::TQ2_0, TileTQ2_0>, &kPackedTQ2_0};

}  // namespace

const MatmulKernel* matmul_kernel(DType type) {
  switch (type) {
    case DType::Q8_0: return &kQ8_0;
    case DType::Q4_0: return &kQ4_0;
    case DType::MXFP4: return &kMxfp4;
    case DType::Q4_K: return &kQ4_K;
    case DType::TQ1_0: return &kTQ1_0;
    case DType::TQ2_0: return &kTQ2_0;
    default: return nullptr;
  }
}

}  // namespace merlin::kernels::quant::avx2
