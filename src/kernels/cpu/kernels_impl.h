// Private to src/kernels/cpu: the per-level entry points that kernels.cpp assembles into KernelTables.
//
// *_avx2.cpp / *_avx512.cpp are compiled with wider -m flags. An inline function or template with external
// linkage that such a file instantiates (a std:: helper, a dtype.h conversion) may be the copy the linker
// keeps for the whole program, and would then run wide instructions on any CPU. So those files keep every
// helper in an anonymous namespace, use intrinsics rather than <cmath>/<algorithm>, and get shared
// services (scratch memory) from baseline code declared here.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/kernels.h"

namespace merlin::kernels::detail {

// Loops over register tiles must be fully unrolled or GCC keeps the accumulator arrays in memory; -O2 alone
// does not unroll them.
#define MERLIN_UNROLL _Pragma("GCC unroll 32")

// Per-thread buffer of at least n floats, 64-byte aligned, contents unspecified. Distinct slots are
// distinct buffers; a slot's pointer stays valid until the same thread asks that slot for more. Kernels
// never call each other while holding a slot, so any kernel may use any slot.
float* scratch_floats(int slot, size_t n);
enum ScratchSlot : int { kScratchPackedW = 0, kScratchWeightRow = 1, kScratchRope = 2 };

#define MERLIN_MATMUL_ARGS                                                                              \
  const void *w, size_t w_row_bytes, int64_t r0, int64_t r1, const void *x, size_t x_row_bytes,        \
      int64_t n_tokens, int64_t k, float *y, int64_t ldy

#define MERLIN_LEVEL_FUNCTIONS                                                     \
  void matmul_f32(MERLIN_MATMUL_ARGS);                                             \
  void matmul_f16(MERLIN_MATMUL_ARGS);                                             \
  void matmul_bf16(MERLIN_MATMUL_ARGS);                                            \
  void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y);    \
  void swiglu(const float* gate, const float* up, int64_t n, float* out);          \
  float dot(const float* a, const float* b, int64_t n);                            \
  void axpy(float a, const float* x, float* y, int64_t n);                         \
  void add(const float* a, const float* b, float* out, int64_t n);                 \
  void softmax(float* x, int64_t n);                                               \
  void axpy_f16(float a, const uint16_t* x, float* y, int64_t n);                 \
  void axpy_f16_rows(const float* a, size_t lda, int64_t n_vec, const uint16_t* x, size_t ldx, int64_t n_rows,     \
                     float* y, size_t ldy, int64_t n);                                                             \
  void axpy_f16_heads(const float* a, size_t lda, int64_t n_heads, const uint16_t* x, size_t ldx, int64_t n_rows,  \
                      float* y, int64_t hd);                                                                       \
  void axpy_q8_0_rows(const float* a, size_t lda, int64_t n_vec, const uint8_t* x, size_t ldx, int64_t n_rows,     \
                      float* y, size_t ldy, int64_t n);                                                            \
  void quantize_q8_0(const float* x, uint8_t* y, int64_t n);                      \
  void round_f16(const float* x, float* y, int64_t n);                             \
  void to_f16(const float* x, uint16_t* y, int64_t n);                             \
  void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs, uint16_t* f16);  \
  void scores_f16(MERLIN_MATMUL_ARGS);                                             \
  int32_t argmax(const float* x, int64_t n);                                      \
  double exp_weights(const float* x, int64_t n, float max, double scale, double* w);

}  // namespace merlin::kernels::detail

namespace merlin::kernels::scalar { MERLIN_LEVEL_FUNCTIONS }
namespace merlin::kernels::avx2 { MERLIN_LEVEL_FUNCTIONS }
namespace merlin::kernels::avx512 { MERLIN_LEVEL_FUNCTIONS }
