// Blocked GEMM in the BLIS style: for each block of kNC columns and kKC depth, B is packed into k-major
// panels of kNR columns, then for each block of kMC rows A is packed into k-major panels of kMR rows, and
// the register-tile micro-kernel sweeps the block. Packing turns every operand layout (plain or
// transposed) into the one layout the micro-kernel reads, so the three products of a linear layer share it.
#include "train/gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "core/thread_pool.h"
#include "train/train_kernels.h"

namespace merlin::train {
namespace {

using kern::kMR;
using kern::kNR;
constexpr int64_t kKC = 256;   // depth of a block: fixes the summation order, so never tuned at run time
constexpr int64_t kMC = 120;   // rows of A per packed block (a multiple of kMR), ~120 KiB: stays in L2
constexpr int64_t kNC = 2048;  // columns of B per packed block (a multiple of kNR)

// Per-thread packing buffers, 64-byte aligned for the micro-kernel's aligned loads.
struct PackBuffers {
  float* a = nullptr;
  float* b = nullptr;
  PackBuffers() {
    a = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kMC * kKC));
    b = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kNC * kKC));
    if (!a || !b) throw std::bad_alloc();
  }
  ~PackBuffers() {
    std::free(a);
    std::free(b);
  }
};

PackBuffers& buffers() {
  thread_local PackBuffers b;
  return b;
}

// Rows [i0, i0+mc) x depth [k0, k0+kc) of A into panels of kMR rows: panel p, element (i, k) at
// dst[p*kMR*kc + k*kMR + i]; rows past mc are zero.
void pack_a(const kern::Table& kt, MatRef A, int64_t i0, int64_t k0, int64_t mc, int64_t kc, float* dst) {
  if (A.rs == 1) {  // columns of A run along i: for each k, one contiguous read spread over the panels
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = A.p + (k0 + k) * A.cs + i0;
      for (int64_t ip = 0; ip < mc; ip += kMR) {
        float* d = dst + ip * kc + k * kMR;
        if (mc - ip >= kMR) {
          std::memcpy(d, src + ip, sizeof(float) * kMR);  // constant size: inlined as vector moves
        } else {
          for (int i = 0; i < kMR; ++i) d[i] = i < mc - ip ? src[ip + i] : 0.0f;
        }
      }
    }
    return;
  }
  for (int64_t ip = 0; ip < mc; ip += kMR, dst += kMR * kc) {
    const int rows = (int)std::min<int64_t>(kMR, mc - ip);
    if (A.cs == 1) {  // rows of A run along k: transpose blocks in registers
      kt.pack_a_t(A.p + (i0 + ip) * A.rs + k0, A.rs, rows, kc, dst);
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int i = 0; i < kMR; ++i) dst[k * kMR + i] = i < rows ? A.p[(i0 + ip + i) * A.rs + (k0 + k) * A.cs] : 0.0f;
    }
  }
}

// Depth [k0, k0+kc) x columns [j0, j0+nc) of B into panels of kNR columns: panel p, element (k, j) at
// dst[p*kNR*kc + k*kNR + j]; columns past nc are zero.
void pack_b(const kern::Table& kt, MatRef B, int64_t k0, int64_t j0, int64_t kc, int64_t nc, float* dst) {
  if (B.cs == 1) {  // rows of B run along j: for each k, one contiguous read spread over the panels
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = B.p + (k0 + k) * B.rs + j0;
      for (int64_t jp = 0; jp < nc; jp += kNR) {
        float* d = dst + jp * kc + k * kNR;
        if (nc - jp >= kNR) {
          std::memcpy(d, src + jp, sizeof(float) * kNR);
        } else {
          for (int j = 0; j < kNR; ++j) d[j] = j < nc - jp ? src[jp + j] : 0.0f;
        }
      }
    }
    return;
  }
  for (int64_t jp = 0; jp < nc; jp += kNR, dst += kNR * kc) {
    const int cols = (int)std::min<int64_t>(kNR, nc - jp);
    if (B.rs == 1) {  // columns of B run along k: transpose blocks in registers
      kt.pack_b_t(B.p + (j0 + jp) * B.cs + k0, B.cs, cols, kc, dst);
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int j = 0; j < kNR; ++j) dst[k * kNR + j] = j < cols ? B.p[(k0 + k) * B.rs + (j0 + jp + j) * B.cs] : 0.0f;
    }
  }
}

// C[m0..m1) x [n0..n1) on the calling thread.
void gemm_range(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K, MatRef A, MatRef B, float* C, int64_t ldc,
                bool accumulate) {
  const kern::Table& kt = kern::table();
  PackBuffers& buf = buffers();
  for (int64_t jc = n0; jc < n1; jc += kNC) {
    const int64_t nc = std::min(kNC, n1 - jc);
    for (int64_t pc = 0; pc < K; pc += kKC) {
      const int64_t kc = std::min(kKC, K - pc);
      const bool add = accumulate || pc > 0;
      pack_b(kt, B, pc, jc, kc, nc, buf.b);
      for (int64_t ic = m0; ic < m1; ic += kMC) {
        const int64_t mc = std::min(kMC, m1 - ic);
        pack_a(kt, A, ic, pc, mc, kc, buf.a);
        for (int64_t jr = 0; jr < nc; jr += kNR)
          for (int64_t ir = 0; ir < mc; ir += kMR)
            kt.micro(kc, buf.a + ir * kc, buf.b + jr * kc, C + (ic + ir) * ldc + jc + jr, ldc,
                     (int)std::min<int64_t>(kMR, mc - ir), (int)std::min<int64_t>(kNR, nc - jr), add);
      }
    }
  }
}

}  // namespace

void gemm(ThreadPool& pool, int64_t M, int64_t N, int64_t K, MatRef A, MatRef B, float* C, int64_t ldc,
          bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    gemm_serial(M, N, K, A, B, C, ldc, accumulate);
    return;
  }
  // Each thread packs what it reads, so splitting M duplicates B's packing and splitting N duplicates
  // A's: split the dimension whose duplicate is cheaper, unless it has too few tiles to go round.
  const int nt = pool.size();
  const bool split_m = (M >= N && M / kMR >= nt) || N / kNR < nt;
  pool.run([&](int ti, int n_threads) {
    if (split_m) {
      const int64_t units = (M + kMR - 1) / kMR;
      const int64_t b = std::min(M, units * ti / n_threads * kMR), e = std::min(M, units * (ti + 1) / n_threads * kMR);
      if (b < e) gemm_range(b, e, 0, N, K, A, B, C, ldc, accumulate);
    } else {
      const int64_t units = (N + kNR - 1) / kNR;
      const int64_t b = std::min(N, units * ti / n_threads * kNR), e = std::min(N, units * (ti + 1) / n_threads * kNR);
      if (b < e) gemm_range(0, M, b, e, K, A, B, C, ldc, accumulate);
    }
  });
}

void gemm_serial(int64_t M, int64_t N, int64_t K, MatRef A, MatRef B, float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(C + i * ldc, C + i * ldc + N, 0.0f);
    return;
  }
  gemm_range(0, M, 0, N, K, A, B, C, ldc, accumulate);
}

void linear_forward(ThreadPool& pool, const float* x, const float* w, int64_t n, int64_t in, int64_t out, float* y,
                    bool accumulate) {
  gemm(pool, n, out, in, MatRef{x, in, 1}, MatRef{w, 1, in}, y, out, accumulate);
}

void linear_backward_input(ThreadPool& pool, const float* dy, const float* w, int64_t n, int64_t in, int64_t out,
                           float* dx, bool accumulate) {
  gemm(pool, n, in, out, MatRef{dy, out, 1}, MatRef{w, in, 1}, dx, in, accumulate);
}

void linear_backward_weight(ThreadPool& pool, const float* dy, const float* x, int64_t n, int64_t in, int64_t out,
                            float* dw) {
  gemm(pool, out, in, n, MatRef{dy, 1, out}, MatRef{x, in, 1}, dw, in, /*accumulate=*/true);
}

}  // namespace merlin::train
