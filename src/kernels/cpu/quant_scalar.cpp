// Scalar quantized matmuls: the oracle the SIMD levels are tested against. Each dot product follows ggml's
// generic vec_dot for the pair of types: exact integer sums per block, then one float scaling per block.
#include "core/dtype.h"
#include "kernels/cpu/kernels_impl.h"
#include "kernels/cpu/quant_formats.h"
#include "kernels/cpu/quant_impl.h"

namespace merlin::kernels::quant::scalar {
namespace {

float dot_q8_0(const void* w, const void* x, int64_t k) {
  const auto* a = static_cast<const BlockQ8_0*>(w);
  const auto* b = static_cast<const BlockQ8_0*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k / kQK32; ++i) {
    int s = 0;
    for (int j = 0; j < kQK32; ++j) s += a[i].qs[j] * b[i].qs[j];
    sum += (float)s * (fp16_to_f32(a[i].d) * fp16_to_f32(b[i].d));
  }
  return sum;
}

float dot_q4_0(const void* w, const void* x, int64_t k) {
  const auto* a = static_cast<const BlockQ4_0*>(w);
  const auto* b = static_cast<const BlockQ8_0*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k / kQK32; ++i) {
    int s = 0;
    for (int j = 0; j < kQK32 / 2; ++j)
      s += ((a[i].qs[j] & 0xF) - 8) * b[i].qs[j] + ((a[i].qs[j] >> 4) - 8) * b[i].qs[j + kQK32 / 2];
    sum += (float)s * (fp16_to_f32(a[i].d) * fp16_to_f32(b[i].d));
  }
  return sum;
}

float dot_mxfp4(const void* w, const void* x, int64_t k) {
  const auto* a = static_cast<const BlockMxfp4*>(w);
  const auto* b = static_cast<const BlockQ8_0*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k / kQK32; ++i) {
    int s = 0;
    for (int j = 0; j < kQK32 / 2; ++j)
      s += kMxfp4Values[a[i].qs[j] & 0xF] * b[i].qs[j] + kMxfp4Values[a[i].qs[j] >> 4] * b[i].qs[j + kQK32 / 2];
    sum += (float)s * (e8m0_to_f32_half(a[i].e) * fp16_to_f32(b[i].d));
  }
  return sum;
}

// Integer sums with the 6-bit scales, the mins applied through the activation's 16-element sums.
float dot_q4_k(const void* w, const void* x, int64_t k) {
  const auto* a = static_cast<const BlockQ4_K*>(w);
  const auto* b = static_cast<const BlockQ8_K*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k / kQK_K; ++i) {
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; ++j) {
      uint8_t sc, m;
      q4k_scale_min(j, a[i].scales, &sc, &m);
      const uint8_t* q = a[i].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      const int8_t* xq = b[i].qs + 32 * j;
      int s = 0;
      for (int l = 0; l < 32; ++l) s += ((q[l] >> shift) & 0xF) * xq[l];
      sumi += sc * s;
      summ += m * (b[i].bsums[2 * j] + b[i].bsums[2 * j + 1]);
    }
    sum += b[i].d * fp16_to_f32(a[i].d) * (float)sumi - b[i].d * fp16_to_f32(a[i].dmin) * (float)summ;
  }
  return sum;
}

template <class Block, void (*Trits)(const Block&, int8_t*)>
float dot_ternary(const void* w, const void* x, int64_t k) {
  const auto* a = static_cast<const Block*>(w);
  const auto* b = static_cast<const BlockQ8_K*>(x);
  float sum = 0.0f;
  int8_t t[kQK_K];
  for (int64_t i = 0; i < k / kQK_K; ++i) {
    Trits(a[i], t);
    int s = 0;
    for (int j = 0; j < kQK_K; ++j) s += t[j] * b[i].qs[j];
    sum += (float)s * (b[i].d * fp16_to_f32(a[i].d));
  }
  return sum;
}

template <float (*Dot)(const void*, const void*, int64_t)>
void matmul(MERLIN_MATMUL_ARGS) {
  for (int64_t r = r0; r < r1; ++r) {
    const char* wr = static_cast<const char*>(w) + r * w_row_bytes;
    for (int64_t t = 0; t < n_tokens; ++t) y[t * ldy + r] = Dot(wr, static_cast<const char*>(x) + t * x_row_bytes, k);
  }
}

template <void (*Quantize)(const float*, void*, int64_t), DType Act>
void quantize_act(const float* x, int64_t n_tokens, int64_t k, void* out) {
  const size_t row_bytes = dtype_row_bytes(Act, (uint64_t)k);
  for (int64_t t = 0; t < n_tokens; ++t) Quantize(x + t * k, static_cast<char*>(out) + t * row_bytes, k);
}

constexpr auto kActQ8_0 = &quantize_act<quantize_act_row_q8_0, DType::Q8_0>;
constexpr auto kActQ8_K = &quantize_act<quantize_row_q8_k, DType::Q8_K>;

const MatmulKernel kQ8_0{DType::Q8_0, kActQ8_0, &matmul<dot_q8_0>};
const MatmulKernel kQ4_0{DType::Q8_0, kActQ8_0, &matmul<dot_q4_0>};
const MatmulKernel kMxfp4{DType::Q8_0, kActQ8_0, &matmul<dot_mxfp4>};
const MatmulKernel kQ4_K{DType::Q8_K, kActQ8_K, &matmul<dot_q4_k>};
const MatmulKernel kTQ1_0{DType::Q8_K, kActQ8_K, &matmul<dot_ternary<BlockTQ1_0, tq1_0_trits>>};
const MatmulKernel kTQ2_0{DType::Q8_K, kActQ8_K, &matmul<dot_ternary<BlockTQ2_0, tq2_0_trits>>};

}  // namespace

const MatmulKernel* matmul_kernel(DType type) {
  switch (type) {
    case DType::Q8_0: return &kQ8_0;
    case DType::Q4_0: return &kQ4_0;
    case DType::MXFP4: return &kMxfp4;
    case DType::Q4_K: return &kQ4_K;
    case DType::TQ1_0: return &kTQ1_0;
    case DType::TQ2_0: return &kTQ2_0;
    default: return nullptr;
  }
}

}  // namespace merlin::kernels::quant::scalar
