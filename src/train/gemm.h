// Matrix products for training: one packed, blocked GEMM (AVX-512 micro-kernel, scalar fallback) that
// serves the three products of every linear layer through strided operand views.
//
// Determinism: each element of C is computed by exactly one thread, summing over k in a fixed order
// (blocks of kKC in increasing order, then C += block sum), so results are bit-identical for any thread
// count. Resumed training relies on this.
#pragma once
#include <cstdint>

namespace merlin {
class ThreadPool;
}

namespace merlin::train {

// A read-only matrix given by strides: element (i, j) is p[i * rs + j * cs].
struct MatRef {
  const float* p;
  int64_t rs, cs;
};

// C[M][N] (row-major, leading dimension ldc) = (accumulate ? C : 0) + A[M][K] · B[K][N].
void gemm(ThreadPool& pool, int64_t M, int64_t N, int64_t K, MatRef A, MatRef B, float* C, int64_t ldc,
          bool accumulate);

// The same on the calling thread only (for callers that parallelise over many small products).
void gemm_serial(int64_t M, int64_t N, int64_t K, MatRef A, MatRef B, float* C, int64_t ldc, bool accumulate);

// The products of a linear layer y = x·Wᵀ, x [n][in], W [out][in] (GGUF layout), y [n][out]:
//   forward       y  (+)= x · Wᵀ
//   input grad    dx (+)= dy · W
//   weight grad   dW  += dyᵀ · x
void linear_forward(ThreadPool& pool, const float* x, const float* w, int64_t n, int64_t in, int64_t out, float* y,
                    bool accumulate = false);
void linear_backward_input(ThreadPool& pool, const float* dy, const float* w, int64_t n, int64_t in, int64_t out,
                           float* dx, bool accumulate);
void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, int64_t n, int64_t in, int64_t out,
                            float* dw);

}  // namespace merlin::train
