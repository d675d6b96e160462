// Scalar reference quantizers and dequantizers of the 32-element block types (Q8_0, Q4_0, MXFP4). They
// follow ggml-quants.c operation for operation (same float expressions, same rounding functions), which is
// what makes our Q8_0 / Q4_0 files byte-identical to llama-quantize's.
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/quant_formats.h"

namespace merlin::kernels::quant {

void quantize_row_q8_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQK32; ++b, x += kQK32) {
    float amax = 0.0f;
    for (int j = 0; j < kQK32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    // roundf rounds half away from zero, as ggml's reference does.
    for (int j = 0; j < kQK32; ++j) y[b].qs[j] = (int8_t)std::round(x[j] * id);
  }
}

void quantize_act_row_q8_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQK32; ++b, x += kQK32) {
    float amax = 0.0f;
    for (int j = 0; j < kQK32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    y[b].d = f32_to_fp16(amax / 127.0f);
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < kQK32; ++j) y[b].qs[j] = (int8_t)std::nearbyint(x[j] * id);  // half to even
  }
}

void dequantize_row_q8_0(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockQ8_0*>(in);
  for (int64_t b = 0; b < n / kQK32; ++b) {
    const float d = fp16_to_f32(x[b].d);
    for (int j = 0; j < kQK32; ++j) *y++ = (float)x[b].qs[j] * d;
  }
}

void quantize_row_q4_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ4_0*>(out);
  for (int64_t b = 0; b < n / kQK32; ++b, x += kQK32) {
    // The signed value of largest magnitude maps to -8, so the asymmetric range [-8, 7] is fully used.
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int j = 0; j < kQK32 / 2; ++j) {
      // Truncation of (v + 8.5) is ggml's rounding; the cast to int8 first matters for v = 7.5+.
      const int q0 = (int8_t)(x[j] * id + 8.5f);
      const int q1 = (int8_t)(x[j + kQK32 / 2] * id + 8.5f);
      y[b].qs[j] = (uint8_t)((q0 < 15 ? q0 : 15) | ((q1 < 15 ? q1 : 15) << 4));
    }
  }
}

void dequantize_row_q4_0(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockQ4_0*>(in);
  for (int64_t b = 0; b < n / kQK32; ++b, y += kQK32) {
    const float d = fp16_to_f32(x[b].d);
    for (int j = 0; j < kQK32 / 2; ++j) {
      y[j] = (float)((x[b].qs[j] & 0xF) - 8) * d;
      y[j + kQK32 / 2] = (float)((x[b].qs[j] >> 4) - 8) * d;
    }
  }
}

namespace {

// Nearest table entry to v / scale; ties keep the lower index, as ggml's best_index_mxfp4.
int mxfp4_index(float v, float scale) {
  int best = 0;
  float best_err = std::fabs((float)kMxfp4Values[0] * scale - v);
  for (int i = 1; i < 16; ++i) {
    const float err = std::fabs((float)kMxfp4Values[i] * scale - v);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return best;
}

// ggml's shared exponent: floor(log2(amax)) - 2 + 127, clamped to the byte (ggml leaves it undefined
// outside [2^-127, 2^127]).
uint8_t mxfp4_exponent(float amax) {
  if (!(amax > 0.0f)) return 0;
  const float e = std::floor(std::log2(amax)) - 2.0f + 127.0f;
  return (uint8_t)(e < 0.0f ? 0.0f : e > 254.0f ? 254.0f : e);
}

}  // namespace

void quantize_row_mxfp4(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockMxfp4*>(out);
  for (int64_t b = 0; b < n / kQK32; ++b, x += kQK32) {
    float amax = 0.0f;
    for (int j = 0; j < kQK32; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const uint8_t e = mxfp4_exponent(amax);
    const float d = e8m0_to_f32_half(e);
    y[b].e = e;
    for (int j = 0; j < kQK32 / 2; ++j)
      y[b].qs[j] = (uint8_t)(mxfp4_index(x[j], d) | (mxfp4_index(x[j + kQK32 / 2], d) << 4));
  }
}

void dequantize_row_mxfp4(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockMxfp4*>(in);
  for (int64_t b = 0; b < n / kQK32; ++b, y += kQK32) {
    const float d = e8m0_to_f32_half(x[b].e);
    for (int j = 0; j < kQK32 / 2; ++j) {
      y[j] = (float)kMxfp4Values[x[b].qs[j] & 0xF] * d;
      y[j + kQK32 / 2] = (float)kMxfp4Values[x[b].qs[j] >> 4] * d;
    }
  }
}

}  // namespace merlin::kernels::quant
