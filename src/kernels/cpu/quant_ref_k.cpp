// Scalar reference quantizers and dequantizers of the 256-element super-block types (Q4_K, TQ1_0, TQ2_0)
// and of Q8_K, the activation format their dot products use. Algorithms follow ggml-quants.c.
#include <cmath>

#include "core/dtype.h"
#include "kernels/cpu/quant_formats.h"

namespace merlin::kernels::quant {
namespace {

// Round half to even via the float mantissa, as ggml's nearest_int (valid for |v| < 2^22).
int nearest_int(float v) {
  const float biased = v + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &biased, 4);
  return (i & 0x007fffff) - 0x00400000;
}

// ggml's make_qkx2_quants: fits x ~ scale * L - min with L in [0, nmax] by weighted least squares over a
// small sweep of candidate scales. Returns the scale and stores the (positive) min in *the_min.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0];
  float sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += weights[i];
    sum_x += weights[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.0f;
  }
  float iscale = (float)nmax / (max - min);
  float scale = 1 / iscale;
  float best_mad = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
    const float diff = scale * L[i] + min - x[i];
    best_mad += weights[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = l < 0 ? 0 : l > nmax ? nmax : l;
      Laux[i] = (uint8_t)l;
      const float w = weights[i];
      sum_l += w * (float)l;
      sum_l2 += w * (float)l * (float)l;
      sum_xl += w * (float)l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float mad = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * Laux[i] + this_min - x[i];
        mad += weights[i] * (diff * diff);
      }
      if (mad < best_mad) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_mad = mad;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// Packs eight 6-bit scales and mins into the 12 bytes that q4k_scale_min reads back.
void pack_q4k_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* s) {
  for (int j = 0; j < 12; ++j) s[j] = 0;
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s[j] = ls[j];
      s[j + 4] = lm[j];
    } else {
      s[j + 4] = (uint8_t)((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      s[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
      s[j] |= (uint8_t)((lm[j] >> 4) << 6);
    }
  }
}

void quantize_block_q4_k(const float* x, BlockQ4_K& y) {
  uint8_t L[kQK_K], Laux[32];
  float weights[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = make_qkx2_quants(32, 15, xs, weights, L + 32 * j, &mins[j], Laux, -1.0f, 0.1f, 20);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    const int a = nearest_int(inv_scale * scales[j]), b = nearest_int(inv_min * mins[j]);
    ls[j] = (uint8_t)(a > 63 ? 63 : a);
    lm[j] = (uint8_t)(b > 63 ? 63 : b);
  }
  pack_q4k_scales(ls, lm, y.scales);
  y.d = f32_to_fp16(max_scale / 63.0f);
  y.dmin = f32_to_fp16(max_min / 63.0f);
  // Requantize against the rounded scales actually stored.
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    q4k_scale_min(j, y.scales, &sc, &m);
    const float d = fp16_to_f32(y.d) * sc;
    if (d == 0.0f) continue;
    const float dm = fp16_to_f32(y.dmin) * m;
    for (int i = 0; i < 32; ++i) {
      const int l = nearest_int((x[32 * j + i] + dm) / d);
      L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > 15 ? 15 : l);
    }
  }
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) y.qs[32 * c + l] = (uint8_t)(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
}

}  // namespace

void quantize_row_q4_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ4_K*>(out);
  for (int64_t b = 0; b < n / kQK_K; ++b) quantize_block_q4_k(x + b * kQK_K, y[b]);
}

// d1 * q - m1 in this order (no fused multiply-add in baseline code), exactly as ggml.
void dequantize_row_q4_k(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockQ4_K*>(in);
  for (int64_t b = 0; b < n / kQK_K; ++b) {
    const float d = fp16_to_f32(x[b].d), dmin = fp16_to_f32(x[b].dmin);
    const uint8_t* q = x[b].qs;
    for (int c = 0; c < 4; ++c, q += 32) {
      uint8_t sc, m;
      q4k_scale_min(2 * c, x[b].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      q4k_scale_min(2 * c + 1, x[b].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (float)(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
  }
}

void quantize_row_q8_k(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockQ8_K*>(out);
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    float max = 0, amax = 0;
    for (int j = 0; j < kQK_K; ++j) {
      if (std::fabs(x[j]) > amax) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&y[b], 0, sizeof(BlockQ8_K));
      continue;
    }
    // -127 rather than -128 (as ggml) keeps every quant in [-127, 127], so sign tricks never overflow.
    const float iscale = -127.0f / max;
    for (int j = 0; j < kQK_K; ++j) {
      const int v = nearest_int(iscale * x[j]);
      y[b].qs[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int g = 0; g < kQK_K / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += y[b].qs[16 * g + j];
      y[b].bsums[g] = (int16_t)s;
    }
    y[b].d = 1 / iscale;
  }
}

void dequantize_row_q8_k(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockQ8_K*>(in);
  for (int64_t b = 0; b < n / kQK_K; ++b)
    for (int j = 0; j < kQK_K; ++j) *y++ = x[b].d * (float)x[b].qs[j];
}

// ---- ternary ----

namespace {

// Maps x / d to {0, 1, 2} (meaning -1, 0, +1) with lroundf, as ggml.
int ternary_digit(float v, float id) {
  const long q = std::lround(v * id);
  return (int)(q < -1 ? -1 : q > 1 ? 1 : q) + 1;
}

// Five (or four, then shifted up a trit) base-3 digits, most significant first, stored as
// ceil(value * 256 / 243) so decoding is a multiply and a shift.
uint8_t pack_trits(const float* x, int stride, int count, float id) {
  int q = 0;
  for (int n = 0; n < count; ++n) q = q * 3 + ternary_digit(x[n * stride], id);
  for (int n = count; n < 5; ++n) q *= 3;
  return (uint8_t)((q * 256 + 242) / 243);
}

// Trit n of a packed byte: the top bits of (byte * 3^n mod 256) * 3.
int unpack_trit(uint8_t byte, int n) {
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  const uint8_t q = (uint8_t)(byte * kPow3[n]);
  return ((int)q * 3 >> 8) - 1;
}

float block_amax(const float* x) {
  float amax = 0.0f;
  for (int j = 0; j < kQK_K; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  return amax;
}

}  // namespace

void quantize_row_tq1_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockTQ1_0*>(out);
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    const float d = block_amax(x);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int m = 0; m < 32; ++m) y[b].qs[m] = pack_trits(x + m, 32, 5, id);             // elements 0..159
    for (int m = 0; m < 16; ++m) y[b].qs[32 + m] = pack_trits(x + 160 + m, 16, 5, id);  // 160..239
    for (int j = 0; j < 4; ++j) y[b].qh[j] = pack_trits(x + 240 + j, 4, 4, id);         // 240..255
  }
}

void tq1_0_trits(const BlockTQ1_0& b, int8_t* out) {
  for (int n = 0; n < 5; ++n)
    for (int m = 0; m < 32; ++m) out[32 * n + m] = (int8_t)unpack_trit(b.qs[m], n);
  for (int n = 0; n < 5; ++n)
    for (int m = 0; m < 16; ++m) out[160 + 16 * n + m] = (int8_t)unpack_trit(b.qs[32 + m], n);
  for (int n = 0; n < 4; ++n)
    for (int j = 0; j < 4; ++j) out[240 + 4 * n + j] = (int8_t)unpack_trit(b.qh[j], n);
}

void dequantize_row_tq1_0(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockTQ1_0*>(in);
  int8_t t[kQK_K];
  for (int64_t b = 0; b < n / kQK_K; ++b, y += kQK_K) {
    const float d = fp16_to_f32(x[b].d);
    tq1_0_trits(x[b], t);
    for (int j = 0; j < kQK_K; ++j) y[j] = (float)t[j] * d;
  }
}

void quantize_row_tq2_0(const float* x, void* out, int64_t n) {
  auto* y = static_cast<BlockTQ2_0*>(out);
  for (int64_t b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    const float d = block_amax(x);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < 32; ++m) {
        int q = 0;
        for (int l = 0; l < 4; ++l) q |= ternary_digit(x[128 * h + 32 * l + m], id) << (2 * l);
        y[b].qs[32 * h + m] = (uint8_t)q;
      }
  }
}

void tq2_0_trits(const BlockTQ2_0& b, int8_t* out) {
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 4; ++l)
      for (int m = 0; m < 32; ++m) out[128 * h + 32 * l + m] = (int8_t)(((b.qs[32 * h + m] >> (2 * l)) & 3) - 1);
}

void dequantize_row_tq2_0(const void* in, float* y, int64_t n) {
  const auto* x = static_cast<const BlockTQ2_0*>(in);
  int8_t t[kQK_K];
  for (int64_t b = 0; b < n / kQK_K; ++b, y += kQK_K) {
    const float d = fp16_to_f32(x[b].d);
    tq2_0_trits(x[b], t);
    for (int j = 0; j < kQK_K; ++j) y[j] = (float)t[j] * d;
  }
}

}  // namespace merlin::kernels::quant
