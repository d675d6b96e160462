// Scalar reference kernels: plain loops, the oracle the SIMD levels are tested against, and the fallback
// for CPUs without AVX2.
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/kernels_impl.h"
#include "kernels/cpu/quant.h"

namespace merlin::kernels::scalar {
namespace {

// One weight row against every token.
void row_times_tokens(const float* wr, int64_t r, const void* x, size_t x_row_bytes, int64_t n_tokens,
                      int64_t k, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    const auto* xt = reinterpret_cast<const float*>(static_cast<const char*>(x) + t * x_row_bytes);
    float s = 0.0f;
    for (int64_t i = 0; i < k; ++i) s += wr[i] * xt[i];
    y[t * ldy + r] = s;
  }
}

// Half-precision rows are widened once into scratch and then reused by every token.
template <float (*Widen)(uint16_t)>
void matmul_half(MERLIN_MATMUL_ARGS) {
  float* row = detail::scratch_floats(detail::kScratchWeightRow, (size_t)k);
  for (int64_t r = r0; r < r1; ++r) {
    const auto* h = reinterpret_cast<const uint16_t*>(static_cast<const char*>(w) + r * w_row_bytes);
    for (int64_t i = 0; i < k; ++i) row[i] = Widen(h[i]);
    row_times_tokens(row, r, x, x_row_bytes, n_tokens, k, y, ldy);
  }
}

}  // namespace

void matmul_f32(MERLIN_MATMUL_ARGS) {
  for (int64_t r = r0; r < r1; ++r) {
    const auto* row = reinterpret_cast<const float*>(static_cast<const char*>(w) + r * w_row_bytes);
    row_times_tokens(row, r, x, x_row_bytes, n_tokens, k, y, ldy);
  }
}

void matmul_f16(MERLIN_MATMUL_ARGS) {
  matmul_half<fp16_to_f32>(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}

// The reference: the matmul itself.
void scores_f16(MERLIN_MATMUL_ARGS) { matmul_f16(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy); }

void matmul_bf16(MERLIN_MATMUL_ARGS) {
  matmul_half<bf16_to_f32>(w, w_row_bytes, r0, r1, x, x_row_bytes, n_tokens, k, y, ldy);
}

// Sum of squares in double, as ggml does; the product order (x * scale) * w matches ggml's rms_norm + mul.
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += (double)x[i] * x[i];
  const float mean = (float)(sum / (double)n);
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * fp16_to_f32(x[i]);
}

void axpy_f16_rows(const float* a, size_t lda, int64_t n_vec, const uint16_t* x, size_t ldx, int64_t n_rows, float* y,
                   size_t ldy, int64_t n) {
  for (int64_t v = 0; v < n_vec; ++v)
    for (int64_t p = 0; p < n_rows; ++p) axpy_f16(a[v * lda + p], x + (size_t)p * ldx, y + v * ldy, n);
}

// One axpy_f16_rows call per head.
void axpy_f16_heads(const float* a, size_t lda, int64_t n_heads, const uint16_t* x, size_t ldx, int64_t n_rows,
                    float* y, int64_t hd) {
  for (int64_t j = 0; j < n_heads; ++j) axpy_f16_rows(a + j * lda, 0, 1, x + j * hd, ldx, n_rows, y + j * hd, 0, hd);
}

void quantize_q8_0(const float* x, uint8_t* y, int64_t n) { quant_quantize_row(DType::Q8_0, x, y, n); }

// Each row dequantized once (dequantize_row's d * q), then axpy into every output.
void axpy_q8_0_rows(const float* a, size_t lda, int64_t n_vec, const uint8_t* x, size_t ldx, int64_t n_rows, float* y,
                    size_t ldy, int64_t n) {
  float* row = detail::scratch_floats(detail::kScratchWeightRow, (size_t)n);
  for (int64_t p = 0; p < n_rows; ++p) {
    dequantize_row(DType::Q8_0, x + (size_t)p * ldx, row, n);
    for (int64_t v = 0; v < n_vec; ++v) axpy(a[v * lda + p], row, y + v * ldy, n);
  }
}

void round_f16(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_f32(f32_to_fp16(x[i]));
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = f32_to_fp16(x[i]);
}

// The reference of the fused kernel is the unfused pair.
void rope(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs, uint16_t* f16) {
  rope_apply(x, n_heads, head_dim, n_rot, cs);
  if (f16 != nullptr) to_f16(x, f16, n_heads * head_dim);
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// An all -inf row has no defined distribution; it becomes all zeros rather than NaN.
void softmax(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  if (mx == -INFINITY) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.0f;
    return;
  }
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = (float)(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

int32_t argmax(const float* x, int64_t n) {
  if (n <= 0) return 0;
  int64_t best = 0;
  float best_v = x[0];  // in a register: comparing against x[best] reloaded it every element
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > best_v) best_v = x[i], best = i;
  return (int32_t)best;
}

double exp_weights(const float* x, int64_t n, float max, double scale, double* w) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += w[i] = std::exp((double)(x[i] - max) * scale);
  return sum;
}

}  // namespace merlin::kernels::scalar
