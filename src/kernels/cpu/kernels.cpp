// Kernel tables per level, and the kernels that need no SIMD variants (row dequantization, RoPE).
#include "kernels/cpu/kernels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/error.h"
#include "kernels/cpu/kernels_impl.h"
#include "kernels/cpu/quant.h"

namespace merlin::kernels {

namespace detail {

float* scratch_floats(int slot, size_t n) {
  struct Buffer {
    std::unique_ptr<float, decltype(&std::free)> data{nullptr, &std::free};
    size_t size = 0;
  };
  constexpr int kSlots = 3;
  static thread_local Buffer buffers[kSlots];
  if (slot < 0 || slot >= kSlots) std::abort();
  Buffer& b = buffers[slot];
  if (b.size < n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) throw std::bad_alloc();
    b.data.reset(static_cast<float*>(p));
    b.size = bytes / sizeof(float);
  }
  return b.data.get();
}

}  // namespace detail

namespace {

// Returned for unsupported weight types, so callers can test `->rows` without a null check first.
const MatmulKernel kUnsupported{};

template <KernelLevel L>
const MatmulKernel* matmul_at(DType type) {
  using namespace detail;
  static const MatmulKernel f32{DType::F32, nullptr,
                                L == KernelLevel::Avx512 ? &avx512::matmul_f32
                                : L == KernelLevel::Avx2 ? &avx2::matmul_f32
                                                         : &scalar::matmul_f32};
  static const MatmulKernel f16{DType::F32, nullptr,
                                L == KernelLevel::Avx512 ? &avx512::matmul_f16
                                : L == KernelLevel::Avx2 ? &avx2::matmul_f16
                                                         : &scalar::matmul_f16};
  static const MatmulKernel bf16{DType::F32, nullptr,
                                 L == KernelLevel::Avx512 ? &avx512::matmul_bf16
                                 : L == KernelLevel::Avx2 ? &avx2::matmul_bf16
                                                          : &scalar::matmul_bf16};
  switch (type) {
    case DType::F32: return &f32;
    case DType::F16: return &f16;
    case DType::BF16: return &bf16;
    default: break;
  }
  const MatmulKernel* q = quant_matmul_kernel(type, L);
  return q != nullptr ? q : &kUnsupported;
}

#define MERLIN_TABLE(L, ns) \
  KernelTable { L, &matmul_at<L>, &ns::rmsnorm, &ns::swiglu, &ns::dot, &ns::axpy, &ns::add, &ns::softmax, &ns::axpy_f16, \
              &ns::axpy_f16_rows, &ns::axpy_f16_heads, &ns::axpy_q8_0_rows, &ns::quantize_q8_0, &ns::round_f16, \
              &ns::to_f16, &ns::rope, &ns::scores_f16, &ns::argmax, &ns::exp_weights }

const KernelTable kTables[] = {
    MERLIN_TABLE(KernelLevel::Scalar, scalar),
    MERLIN_TABLE(KernelLevel::Avx2, avx2),
    MERLIN_TABLE(KernelLevel::Avx512, avx512),
};

}  // namespace

// Capped by the CPU so a table can never hand out instructions the machine lacks.
const KernelTable& kernels_for(KernelLevel level) {
  const KernelLevel best = best_kernel_level();
  return kTables[(int)(level < best ? level : best)];
}

const KernelTable& kernels() { return kernels_for(active_kernel_level()); }

void dequantize_row(DType type, const void* src, float* dst, int64_t n) {
  switch (type) {
    case DType::F32:
      std::memcpy(dst, src, (size_t)n * sizeof(float));
      return;
    case DType::F16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(h[i]);
      return;
    }
    case DType::BF16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
      return;
    }
    default:
      if (quant_dequantize_row(type, src, dst, n)) return;
      fail("unsupported tensor type ", dtype_name(type), " for dequantize_row");
  }
}

// The angle recurrence (float theta *= theta_scale, starting at pos) and cosf/sinf follow ggml's rope cache,
// so the angles carry llama.cpp's rounding; a more exact angle would drift from it at large positions.
void rope_angles(int64_t n_rot, int64_t pos, float theta, float* cs) {
  MERLIN_CHECK(n_rot >= 0 && n_rot % 2 == 0, "rope: n_rot ", n_rot, " must be even");
  const float theta_scale = std::pow(theta, -2.0f / (float)n_rot);
  float angle = (float)pos;
  for (int64_t i = 0; i < n_rot / 2; ++i) {
    cs[2 * i] = std::cos(angle);
    cs[2 * i + 1] = std::sin(angle);
    angle *= theta_scale;
  }
}

void rope_apply(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs) {
  MERLIN_CHECK(n_rot >= 0 && n_rot <= head_dim && n_rot % 2 == 0, "rope: n_rot ", n_rot,
               " must be even and at most head_dim ", head_dim);
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < n_rot / 2; ++i) {
      const float c = cs[2 * i], s = cs[2 * i + 1];
      const float x0 = v[2 * i], x1 = v[2 * i + 1];
      v[2 * i] = x0 * c - x1 * s;
      v[2 * i + 1] = x0 * s + x1 * c;
    }
  }
}

void rope_inplace(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, int64_t pos, float theta) {
  MERLIN_CHECK(n_rot >= 0 && n_rot <= head_dim && n_rot % 2 == 0, "rope: n_rot ", n_rot,
               " must be even and at most head_dim ", head_dim);
  if (n_rot == 0 || n_heads <= 0) return;
  float* cs = detail::scratch_floats(detail::kScratchRope, (size_t)n_rot);
  rope_angles(n_rot, pos, theta, cs);
  rope_apply(x, n_heads, head_dim, n_rot, cs);
}

}  // namespace merlin::kernels
