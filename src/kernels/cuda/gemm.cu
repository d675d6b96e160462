// Prefill-sized products through cuBLAS (ops.h, GemmRunner). F16/BF16 matrices are stored row-major
// (matrix_layout.cuh) and multiplied in place. Quantized fragment-ordered weights (repack.cu) are expanded
// chunk by chunk of rows into a row-major f16 scratch matrix, then one cublasGemmEx per chunk multiplies it
// with the activations rounded to f16 (bf16 for BF16 weights), accumulating in f32. Chunks are 256 MiB by default (MERLIN_CUDA_GEMM_CHUNK_MB): the whole matrix for every shape up to the
// 7.19B model's stacked gate/up (32768 x 4096), because large GEMMs fill the GPU better than L2-sized chunks
// help (macbook bf16 pp512 on the H200: 19.0k t/s with 32 MiB chunks, 21.0k with 256 MiB; docs/GPU.md).
//
// cuBLAS is opened with dlopen at the first prefill, not linked: CPU-only commands and decode-only runs never
// load its ~600 MB of libraries, and a machine without libcublas still runs everything on the tensor-core
// kernels of matmul.cu.
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "core/sys.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/ops.h"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define MERLIN_HAVE_CUBLAS_HEADERS 1
#else
#define MERLIN_HAVE_CUBLAS_HEADERS 0
#endif

namespace merlin::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------------
// Expansion of fragment-ordered weights to row-major halves.

struct ExpandArgs {
  const uint8_t* q;
  const uint8_t* s;
  int64_t k, n_steps, n_chunks, n_super;
  int64_t tile0, n_tiles;  // tiles [tile0, tile0 + n_tiles) of the matrix
  uint16_t* out;           // [n_tiles * 16][k]
};

__device__ __forceinline__ uint16_t to_half_bits(float v) { return __half_as_ushort(__float2half_rn(v)); }

// Scale of row rr of tile `tile` for k-step `step` (value = code * scale - min).
template <int F>
__device__ __forceinline__ float2 row_scale_min(const ExpandArgs& a, int64_t tile, int rr, int64_t step) {
  if constexpr (F == kQ8_0) {
    const uint16_t b = reinterpret_cast<const uint16_t*>(a.s)[(tile * a.n_steps + step) * 16 + pair_pos(rr)];
    return make_float2(half_bits_to_f32(b), 0.f);
  } else if constexpr (F == kQ4_0) {
    const uint16_t b = reinterpret_cast<const uint16_t*>(a.s)[grouped_scale_index(tile, a.n_steps, step, rr)];
    return make_float2(half_bits_to_f32(b), 0.f);
  } else if constexpr (F == kMXFP4) {
    return make_float2(e8m0_half(a.s[grouped_scale_index(tile, a.n_steps, step, rr)]), 0.f);
  } else if constexpr (F == kTQ2) {
    const uint16_t b = reinterpret_cast<const uint16_t*>(a.s)[(tile * a.n_super + step / 8) * 16 + pair_pos(rr)];
    return make_float2(half_bits_to_f32(b), 0.f);
  } else {  // kQ4_K
    const uint4 h = *reinterpret_cast<const uint4*>(a.s + ((tile * a.n_super + step / 8) * 16 + rr) * 16);
    return q4k_scale_min(h, (int)(step % 8));
  }
}

// One thread per (tile, chunk, lane) of a quantized matrix: the lane's 16 bytes hold, per k-step, the A
// operand of the tensor-core instruction (fragment.cuh), i.e. known (row, column) positions; each value is
// scaled and stored in place.
template <int F>
__global__ void expand_kernel(ExpandArgs a) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= a.n_tiles * a.n_chunks * 32) return;
  const int lane = (int)(id % 32), g = lane >> 2, t = lane & 3;
  const int64_t chunk = (id / 32) % a.n_chunks, lt = id / 32 / a.n_chunks, tile = a.tile0 + lt;
  const uint4 w = reinterpret_cast<const uint4*>(a.q)[(tile * a.n_chunks + chunk) * 32 + lane];
  uint16_t* out = a.out + lt * 16 * a.k;
#pragma unroll
  for (int j = 0; j < steps_per_chunk(F); ++j) {
    const int64_t step = chunk * steps_per_chunk(F) + j;
    if (step >= a.n_steps) break;
    uint32_t regs[4];
    int8_operand<F>(w, j, regs);
    const float2 s0 = row_scale_min<F>(a, tile, g, step), s1 = row_scale_min<F>(a, tile, g + 8, step);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 sm = (r & 1) ? s1 : s0;
      const int64_t row = g + 8 * (r & 1), col = step * 32 + 4 * t + 16 * (r >> 1);
      uint16_t h[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float code = F == kQ4_K ? (float)((regs[r] >> (8 * b)) & 0xFF) : (float)(int8_t)(regs[r] >> (8 * b));
        h[b] = to_half_bits(F == kQ4_K ? sm.x * code - sm.y : code * sm.x);
      }
      *reinterpret_cast<uint2*>(out + row * a.k + col) =
          make_uint2((uint32_t)h[0] | ((uint32_t)h[1] << 16), (uint32_t)h[2] | ((uint32_t)h[3] << 16));
    }
  }
}

void launch_expand(int fmt, const ExpandArgs& a, Stream stream) {
  const int64_t threads = a.n_tiles * a.n_chunks * 32;
  const unsigned blocks = (unsigned)((threads + 255) / 256);
  switch (fmt) {
    case kQ8_0: expand_kernel<kQ8_0><<<blocks, 256, 0, stream>>>(a); break;
    case kQ4_0: expand_kernel<kQ4_0><<<blocks, 256, 0, stream>>>(a); break;
    case kMXFP4: expand_kernel<kMXFP4><<<blocks, 256, 0, stream>>>(a); break;
    case kQ4_K: expand_kernel<kQ4_K><<<blocks, 256, 0, stream>>>(a); break;
    case kTQ2: expand_kernel<kTQ2><<<blocks, 256, 0, stream>>>(a); break;
    default: fail("gemm: no expansion for this matrix format");
  }
  check_launch("gemm expand");
}

// ---------------------------------------------------------------------------------------------------------
// cuBLAS, loaded at run time.

#if MERLIN_HAVE_CUBLAS_HEADERS
struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  // cublasGemmEx is overloaded in C++ (a 64-bit-index variant), so the 32-bit signature is spelled out.
  using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                    const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                    cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
  GemmEx gemm = nullptr;
  std::string error;
};

const Cublas& cublas() {
  static const Cublas lib = [] {
    Cublas c;
    void* h = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so"})
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    if (h == nullptr) {
      const char* e = dlerror();
      c.error = std::string("cannot load libcublas.so.13: ") + (e ? e : "not found");
      return c;
    }
    c.create = reinterpret_cast<decltype(c.create)>(dlsym(h, "cublasCreate_v2"));
    c.destroy = reinterpret_cast<decltype(c.destroy)>(dlsym(h, "cublasDestroy_v2"));
    c.set_stream = reinterpret_cast<decltype(c.set_stream)>(dlsym(h, "cublasSetStream_v2"));
    c.gemm = reinterpret_cast<decltype(c.gemm)>(dlsym(h, "cublasGemmEx"));
    if (!c.create || !c.destroy || !c.set_stream || !c.gemm) {
      c.error = "libcublas lacks cublasCreate_v2/cublasGemmEx";
      c.create = nullptr;
    }
    return c;
  }();
  return lib;
}
#endif

bool gemm_fmt(int f) { return f != kF32; }

size_t chunk_bytes_limit() {
  static const size_t bytes = [] {
    const long mb = env_int("MERLIN_CUDA_GEMM_CHUNK_MB", 256);
    return (size_t)std::max(1L, mb) << 20;
  }();
  return bytes;
}

}  // namespace

bool gemm_available(std::string* why) {
#if MERLIN_HAVE_CUBLAS_HEADERS
  const Cublas& c = cublas();
  if (c.create == nullptr && why) *why = c.error;
  return c.create != nullptr;
#else
  if (why) *why = "built without cuBLAS headers";
  return false;
#endif
}

bool gemm_supports(const Matrix& w) { return gemm_fmt(w.fmt); }

ActKind gemm_act_kind(const Matrix& w) { return w.fmt == kBF16 ? ActKind::BF16 : ActKind::F16; }

GemmRunner::~GemmRunner() {
#if MERLIN_HAVE_CUBLAS_HEADERS
  if (handle_) cublas().destroy(static_cast<cublasHandle_t>(handle_));
#endif
  dev_free(scratch_);
}

void GemmRunner::run(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows,
                     bool accumulate, Stream stream) {
#if MERLIN_HAVE_CUBLAS_HEADERS
  if (n <= 0) return;
  MERLIN_CHECK(gemm_supports(w) && x.kind == gemm_act_kind(w) && x.k == w.k && n <= x.n_cap,
               "gemm: activation buffer does not fit the matrix");
  const Cublas& cb = cublas();
  MERLIN_CHECK(cb.create != nullptr, "gemm: ", cb.error);
  if (handle_ == nullptr) {
    cublasHandle_t h = nullptr;
    MERLIN_CHECK(cb.create(&h) == CUBLAS_STATUS_SUCCESS, "gemm: cublasCreate failed");
    handle_ = h;
  }
  const auto h = static_cast<cublasHandle_t>(handle_);
  MERLIN_CHECK(cb.set_stream(h, stream) == CUBLAS_STATUS_SUCCESS, "gemm: cublasSetStream failed");
  const int64_t out_rows = std::min(n_out_rows, w.rows);
  const cudaDataType_t half_type = w.fmt == kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  // Row-major W (rows x k) is column-major k x rows; row-major x (n x k) is column-major k x n; row-major
  // y (n x ldy) is column-major ldy x n. So y^T = W^T-as-stored times x: op(A) = T, op(B) = N.
  const auto gemm = [&](const void* a, int64_t lda, int64_t row0, int64_t m) {
    const cublasStatus_t st = cb.gemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, n, (int)w.k, &one, a, half_type, (int)lda,
                                      x.hi, half_type, (int)w.k, &beta, d_y + row0, CUDA_R_32F, (int)ldy,
                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    MERLIN_CHECK(st == CUBLAS_STATUS_SUCCESS, "gemm: cublasGemmEx failed (status ", (int)st, ")");
  };
  if (half_fmt(w.fmt)) {  // stored row-major (matrix_layout.cuh): multiplied in place
    gemm(w.q, half_ld(w.k), 0, out_rows);
    return;
  }
  const Geometry geo = geometry(w.fmt, w.rows, w.k);
  const size_t chunk_bytes = chunk_bytes_ ? chunk_bytes_ : chunk_bytes_limit();
  const int64_t chunk_tiles = std::max<int64_t>(1, (int64_t)(chunk_bytes / ((size_t)w.k * 2 * 16)));
  const size_t need = (size_t)std::min(chunk_tiles, geo.tiles) * 16 * w.k * 2;
  if (need > scratch_bytes_) {
    dev_free(scratch_);  // cudaFree waits for the GEMMs still reading it
    scratch_ = static_cast<uint16_t*>(dev_alloc(need));
    scratch_bytes_ = need;
  }
  for (int64_t t0 = 0; t0 * 16 < out_rows; t0 += chunk_tiles) {
    const int64_t nt = std::min(chunk_tiles, geo.tiles - t0);
    launch_expand(w.fmt, ExpandArgs{w.q, w.s, w.k, geo.n_steps, geo.n_chunks, geo.n_super, t0, nt, scratch_}, stream);
    gemm(scratch_, w.k, t0 * 16, std::min(nt * 16, out_rows - t0 * 16));
  }
#else
  (void)w, (void)x, (void)n, (void)d_y, (void)ldy, (void)n_out_rows, (void)accumulate, (void)stream;
  fail("gemm: built without cuBLAS headers");
#endif
}

}  // namespace merlin::cuda
