// AVX-512 quantized matmuls. Few tokens (decode): the 256-bit tiles of quant_simd_*.h with VNNI dot products.
// Many tokens (prefill): the repacked token-parallel GEMM of quant_gemm_avx512.cpp.
#define MERLIN_QUANT_LEVEL avx512
#include "kernels/cpu/quant_impl.h"
#include "kernels/cpu/quant_simd_k.h"
#include "kernels/cpu/quant_simd_q32.h"

namespace merlin::kernels::quant::avx512 {
namespace {

// Batch invariance: an output must not depend on how many tokens share the call. The GEMM accumulates per
// 32-element block exactly as the TileQ32 decode tiles do; the super-block tiles of Q4_K and the ternary
// types sum a whole 256-element super-block in integers first, which the GEMM cannot reproduce, so those
// types run their tiles for every token count. (Q8_0, Q4_0, MXFP4, Q4_K and TQ2_0 weights normally run the
// repacked tiles of quant_repack*_avx512.cpp instead; these paths serve MERLIN_REPACK=0, mapped weights and
// TQ1_0.)
constexpr bool gemm_matches_tiles(DType type) {
  return type == DType::Q8_0 || type == DType::Q4_0 || type == DType::MXFP4;
}

template <DType Type, template <int, int> class Tile>
void matmul(MERLIN_MATMUL_ARGS) {
  if (gemm_matches_tiles(Type) && n_tokens >= gemm_min_tokens(Type, true)) {
    gemm(Type, w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
    return;
  }
  const Args a{static_cast<const char*>(w), w_row_bytes, static_cast<const char*>(x), x_row_bytes, k, y, ldy};
  run_tiles<Tile, 4, 4>(a, r0, r1, n_tokens);
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

}  // namespace merlin::kernels::quant::avx512
