// Internal weight formats of the CUDA matrix products and the geometry of their fragment-ordered layout
// (ops.h): shared by the repacking (repack.cu) and the product kernels (matmul.cu).
#pragma once
#include <cstdint>
#include <cstddef>

#include "core/dtype.h"

namespace merlin::cuda {

enum Fmt : int { kF32 = 0, kQ8_0, kQ4_0, kMXFP4, kQ4_K, kTQ2, kF16, kBF16 };


// k-steps covered by one 16-byte chunk per lane, and elements per k-step.
__host__ __device__ constexpr int steps_per_chunk(int f) {
  return f == kQ4_0 || f == kMXFP4 || f == kQ4_K ? 2 : f == kTQ2 ? 4 : 1;
}
__host__ __device__ constexpr int step_k(int f) { return f == kF16 || f == kBF16 ? 16 : 32; }

// F16/BF16 matrices are stored row-major, not in fragment order: rows padded to 16, each row to a multiple of
// 32 elements (zeros), so cuBLAS multiplies them in place (gemm.cu: no expansion) while the decode products
// still stream them with one 16-byte load per lane. Chunk c of a tile is, for lane 4g + t, the 8 elements of
// row g + 8 (c & 1) from column 32 (c >> 1) + 8t: chunks 2p and 2p + 1 together hold the A operands of
// k-steps 2p and 2p + 1 for a fixed permutation of the 32 columns, which the activations follow (matmul.cu).
__host__ __device__ constexpr bool half_fmt(int f) { return f == kF16 || f == kBF16; }
__host__ __device__ constexpr int64_t half_ld(int64_t k) { return (k + 31) / 32 * 32; }

inline int fmt_of(DType t) {
  switch (t) {
    case DType::F32: return kF32;
    case DType::F16: return kF16;
    case DType::BF16: return kBF16;
    case DType::Q8_0: return kQ8_0;
    case DType::Q4_0: return kQ4_0;
    case DType::MXFP4: return kMXFP4;
    case DType::Q4_K: return kQ4_K;
    case DType::TQ2_0:
    case DType::TQ1_0: return kTQ2;  // TQ1_0 holds the same trits and scale: stored as TQ2_0
    default: return -1;
  }
}

// Position of row rr (0..15) of a tile in the per-tile scale arrays: rows g and g + 8 sit side by side, so
// the lane that needs both reads one 2-element vector.
__host__ __device__ constexpr int pair_pos(int rr) { return (rr & 7) * 2 + (rr >> 3); }

// Q4_0 and MXFP4 block scales are grouped by 8 k-steps (one round of 4 chunks in the products): per tile and
// group, row pair g's 8 steps sit together (16 halves, resp. bytes: step j's rows g and g + 8 at 2j, 2j + 1),
// so a lane loads its round's scales with two (one) 16-byte loads instead of eight small ones. Groups are
// padded to 8 steps with zero scales. Index in elements (halves for Q4_0, bytes for MXFP4).
__host__ __device__ constexpr bool grouped_scales(int f) { return f == kQ4_0 || f == kMXFP4; }
__host__ __device__ constexpr int64_t scale_groups(int64_t n_steps) { return (n_steps + 7) / 8; }
__host__ __device__ constexpr int64_t grouped_scale_index(int64_t tile, int64_t n_steps, int64_t step, int rr) {
  return ((tile * scale_groups(n_steps) + step / 8) * 8 + (rr & 7)) * 16 + (step % 8) * 2 + (rr >> 3);
}

struct Geometry {
  int64_t tiles, n_steps, n_chunks, n_super;
  size_t q_bytes, s_bytes;
};

inline Geometry geometry(int f, int64_t rows_pad, int64_t k) {
  Geometry g{};
  g.tiles = rows_pad / 16;
  if (f == kF32) {
    g.q_bytes = (size_t)rows_pad * k * 4;
    return g;
  }
  g.n_steps = half_fmt(f) ? half_ld(k) / 16 : k / step_k(f);
  g.n_chunks = (g.n_steps + steps_per_chunk(f) - 1) / steps_per_chunk(f);
  g.n_super = k / 256;
  g.q_bytes = (size_t)g.tiles * g.n_chunks * 512;
  switch (f) {
    case kQ8_0:
    case kQ4_0: g.s_bytes = (size_t)g.tiles * scale_groups(g.n_steps) * 128 * 2; break;
    case kMXFP4: g.s_bytes = (size_t)g.tiles * scale_groups(g.n_steps) * 128; break;
    case kTQ2: g.s_bytes = (size_t)g.tiles * g.n_super * 16 * 2; break;
    case kQ4_K: g.s_bytes = (size_t)g.tiles * g.n_super * 16 * 16; break;
    default: break;
  }
  return g;
}

// Whether rounds of `round` chunks tile k exactly (whole rounds of whole chunks): the product kernels' exact
// variants, which load and compute a round without per-chunk checks, apply (matvec1.cu, matmul.cu).
inline bool whole_rounds(int f, int64_t n_chunks, int64_t n_steps, int round) {
  return !half_fmt(f) && f != kF32 && n_chunks % round == 0 && n_steps == n_chunks * steps_per_chunk(f);
}

// Sets the product kernels' shared-memory limits and reads the SM count that sizes their persistent grids;
// upload_matrix calls it, so it runs before any product is launched (never inside a graph capture).
void init_matmul_kernels();

}  // namespace merlin::cuda
