// Block layouts of the quantized types, byte for byte those of ggml (ggml-common.h), so GGUF files move
// between llama.cpp and Merlin unchanged, plus the scalar reference quantizers and dequantizers.
//
// Helpers here are `static inline` on purpose: the SIMD translation units include this header, and an
// inline function with external linkage compiled there could become the program-wide copy (see
// kernels_impl.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace merlin::kernels::quant {

inline constexpr int kQK32 = 32;   // elements per block of Q8_0, Q4_0, MXFP4
inline constexpr int kQK_K = 256;  // elements per super-block of the K and ternary types

struct BlockQ8_0 {
  uint16_t d;  // fp16 scale
  int8_t qs[kQK32];
};

// Nibble j holds element j (low) and element j + 16 (high); x = (q - 8) * d.
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQK32 / 2];
};

// x = kMxfp4Values[q] * 2^(e - 128): the table is twice the E2M1 values, so the scale is halved.
struct BlockMxfp4 {
  uint8_t e;  // E8M0 shared exponent
  uint8_t qs[kQK32 / 2];
};

// Eight sub-blocks of 32: x = d * sc[j] * q - dmin * m[j], with 6-bit sc/m packed in `scales`
// (see q4k_scale_min). Each 32 bytes of qs hold two sub-blocks: low nibbles the first, high the second.
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[kQK_K / 2];
};

// Ternary, five trits per byte in qs and four per byte in qh, most significant trit first, stored as
// ceil(value * 256 / 243) so that trit n is the top bits of (byte * 3^n) * 3.
struct BlockTQ1_0 {
  uint8_t qs[(kQK_K - 4 * kQK_K / 64) / 5];
  uint8_t qh[kQK_K / 64];
  uint16_t d;
};

// Ternary, 2 bits per value (0, 1, 2 meaning -1, 0, +1). Byte j + m of each 32-byte half (j = 0, 32) holds
// element 4j + 32l + m in bits 2l..2l+1.
struct BlockTQ2_0 {
  uint8_t qs[kQK_K / 4];
  uint16_t d;
};

// Activation format of the K and ternary dot products (never stored in files).
struct BlockQ8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];  // sums of each 16 consecutive qs
};

static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockMxfp4) == 17);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockTQ1_0) == 54);
static_assert(sizeof(BlockTQ2_0) == 66);
static_assert(sizeof(BlockQ8_K) == 292);

// ggml's kvalues_mxfp4.
alignas(16) static constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as ggml's GGML_E8M0_TO_FP32_HALF, including its subnormal results for e < 2.
static inline float e8m0_to_f32_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e8m0_to_f32_half for every exponent byte, so SIMD code can broadcast a scale straight from memory.
struct E8m0HalfTable {
  float v[256];
};
static constexpr E8m0HalfTable make_e8m0_half_table() {
  E8m0HalfTable t{};
  for (int e = 0; e < 256; ++e) t.v[e] = __builtin_bit_cast(float, e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
  return t;
}
alignas(64) static constexpr E8m0HalfTable kE8m0Half = make_e8m0_half_table();

// Sub-block j's 6-bit scale and min, as ggml's get_scale_min_k4.
static inline void q4k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Scalar reference quantizers and dequantizers (quant_ref*.cpp); n is a multiple of the block size.
// The Q8_0 and Q4_0 quantizers give llama-quantize's bytes exactly; the others follow ggml's reference
// algorithms.
void quantize_row_q8_0(const float* x, void* y, int64_t n);
void quantize_row_q4_0(const float* x, void* y, int64_t n);
void quantize_row_mxfp4(const float* x, void* y, int64_t n);
void quantize_row_q4_k(const float* x, void* y, int64_t n);
void quantize_row_tq1_0(const float* x, void* y, int64_t n);
void quantize_row_tq2_0(const float* x, void* y, int64_t n);
void quantize_row_q8_k(const float* x, void* y, int64_t n);

// Q8_0 activations as llama.cpp's x86 build quantizes them at run time (its SIMD quantize_row_q8_0, not
// the reference): id = 127 / amax rather than 1 / d, and rounding half to even. Following it keeps our
// logits closer to llama.cpp's. (Q8_K activations use quantize_row_q8_k, as llama.cpp does on x86.)
void quantize_act_row_q8_0(const float* x, void* y, int64_t n);

void dequantize_row_q8_0(const void* x, float* y, int64_t n);
void dequantize_row_q4_0(const void* x, float* y, int64_t n);
void dequantize_row_mxfp4(const void* x, float* y, int64_t n);
void dequantize_row_q4_k(const void* x, float* y, int64_t n);
void dequantize_row_tq1_0(const void* x, float* y, int64_t n);
void dequantize_row_tq2_0(const void* x, float* y, int64_t n);
void dequantize_row_q8_k(const void* x, float* y, int64_t n);

// Unpacks one ternary block into 256 values in {-1, 0, 1} (element order), shared by the dequantizer,
// the scalar dot product and the tests that compare TQ1_0 with TQ2_0.
void tq1_0_trits(const BlockTQ1_0& b, int8_t* out);
void tq2_0_trits(const BlockTQ2_0& b, int8_t* out);

}  // namespace merlin::kernels::quant
