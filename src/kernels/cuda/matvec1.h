// Single-token (batch-1 decode) products: a dedicated kernel for the formats where the general tensor-core
// product (matmul.cu) is instruction-bound rather than memory-bound at one token. matmul() calls it first for
// n == 1; it returns false when it does not handle the matrix (format without a dedicated kernel, or
// MERLIN_CUDA_MV1=0), and the general product runs instead.
#pragma once
#include <cstdint>

#include "kernels/cuda/ops.h"

namespace merlin::cuda {

// y[r] (= or +=) sum_i W[r][i] x[0][i] for r < n_out_rows; same contract as matmul() with n == 1.
bool matvec1(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream);

// matmul_rope_kv (ops.h) for one token; false where the single-token kernels do not apply.
bool matvec1_rope_kv(const Matrix& w, const ActBuf& x, float* d_qkv, const RopeKvArgs& r, Stream stream);

// F16/BF16 rows (matvec1_half.cu); false when the row is too long for its staged activations. With glu_out
// (matvec1_swiglu: F16, BF16 or F32 outputs) w is a stacked [gate; up] matrix, n_out the gate rows.
bool matvec1_half(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, Stream stream,
                  const RopeKvArgs* rope = nullptr, const ActBuf* glu_out = nullptr, int64_t glu_up_row = 0);
bool matvec1_half_fits(const Matrix& w);  // the row fits the staged activations
void init_matvec1_half_kernels();

// Whether a single-token product of w can take a SwiGLU row (ActBuf::glu_src) and compute it while it stages
// its input, instead of a prep_act(SwiGlu) kernel before it: quantized rows that read Q8_0 (Q8_0, Q4_0, MXFP4).
bool matvec1_glu_fits(const Matrix& w);

// y = W x for one token (as matvec1) and its argmax in the same kernel: every CTA raises *d_key (zero before the
// launch) to its largest row's key with atomicMax, and argmax_key_row(key) is the index argmax_rows gives
// (the first largest value; 0 when every row is NaN). Quantized rows only (matvec1_argmax_fits); false
// (nothing queued) otherwise.
bool matvec1_argmax_fits(const Matrix& w);
bool matvec1_argmax(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, unsigned long long* d_key,
                    Stream stream);
#ifdef __CUDACC__
__host__ __device__
#endif
inline int32_t argmax_key_row(unsigned long long key) {
  return key == 0ull ? 0 : (int32_t)(0xFFFFFFFFu - (uint32_t)key);
}
#ifdef __CUDACC__
// A row's value and index as one 64-bit key whose unsigned order is the order argmax_rows picks by: larger
// values first, then the smaller index; NaN rows get 0 and never win (a row of NaN only leaves 0: index 0,
// as argmax_rows returns). matvec1_argmax and matmul_argmax raise keys with atomicMax.
__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t row) {
  if (isnan(v)) return 0ull;
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (0xFFFFFFFFu - (uint32_t)row);
}
#endif

// Tests: the pooled walk of a one-token RoPE product (pooled_walk in matvec1_kernel.cuh): -1 the rule
// (plan_pool), 0 never, 1 wherever it fits; and whether the last one-token RoPE launch took it.
void set_matvec1_pool(int mode);
int matvec1_last_pool();

// Called once by init_matmul_kernels (never inside a graph capture): kernel attributes and occupancy.
void init_matvec1_kernels();

}  // namespace merlin::cuda
