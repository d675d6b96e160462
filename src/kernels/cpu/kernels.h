// CPU kernels: pure functions on buffers. They know shapes and element types, never models, and never
// spawn threads: the runtime splits work (usually over output rows) and calls them per thread.
//
// Every kernel exists as a scalar reference and, where it pays, AVX2 and AVX-512 variants compiled in
// their own translation units with the matching -m flags. kernels_for(level) returns the table for a
// level; kernels() returns the table for active_kernel_level() (MERLIN_KERNELS can force it down).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/cpu_features.h"
#include "core/dtype.h"

namespace merlin::kernels {

// Matrix product of a weight matrix (rows = output features, each row `k` elements of type w_type stored in
// `w_row_bytes`) with n_tokens activation rows:
//   y[t * ldy + r] = sum_i W[r][i] * x[t][i]    for r in [r0, r1), t in [0, n_tokens)
// `x` is in the kernel's activation format (act_type): plain float rows of length k for float weights,
// or rows quantized by quantize_act (x_row_bytes apart).
// Optional load-time layout of a weight type at a level (AVX-512 Q8_0 and Q4_0: 16 rows interleaved per
// block, see quant_repack_avx512.cpp). repack() converts a whole rows x k weight into bytes(rows, k) bytes;
// rows() then takes that buffer as `w` (w_row_bytes unused; r0 a multiple of kRepackRows) and gives, bit
// for bit, what MatmulKernel::rows gives on the original.
constexpr int64_t kRepackRows = 16;
struct PackedMatmul {
  size_t (*bytes)(int64_t rows, int64_t k);
  void (*repack)(const void* w, size_t w_row_bytes, int64_t rows, int64_t k, void* out);
  // Row r back in the file's block layout (a tied embedding table is looked up in the packed copy).
  void (*unpack_row)(const void* packed, int64_t r, int64_t k, void* out);
  void (*rows)(const void* w, size_t w_row_bytes, int64_t r0, int64_t r1, const void* x, size_t x_row_bytes,
               int64_t n_tokens, int64_t k, float* y, int64_t ldy);
};

struct MatmulKernel {
  DType act_type = DType::F32;
  // Converts n_tokens float rows of length k into act_type rows (x_row_bytes apart). Null for F32.
  void (*quantize_act)(const float* x, int64_t n_tokens, int64_t k, void* out) = nullptr;
  void (*rows)(const void* w, size_t w_row_bytes, int64_t r0, int64_t r1, const void* x, size_t x_row_bytes,
               int64_t n_tokens, int64_t k, float* y, int64_t ldy) = nullptr;
  const PackedMatmul* packed = nullptr;  // null: no repacked layout at this level
};

struct KernelTable {
  KernelLevel level;
  // Matrix products, indexed by weight type; rows == nullptr when the type is unsupported.
  const MatmulKernel* (*matmul)(DType weight_type);

  // y = x / rms(x) * w   (n elements; y may alias x)
  void (*rmsnorm)(const float* x, const float* w, int64_t n, float eps, float* y);
  // out[i] = silu(gate[i]) * up[i]  (out may alias gate)
  void (*swiglu)(const float* gate, const float* up, int64_t n, float* out);
  float (*dot)(const float* a, const float* b, int64_t n);
  void (*axpy)(float a, const float* x, float* y, int64_t n);  // y += a * x
  void (*add)(const float* a, const float* b, float* out, int64_t n);  // out may alias a
  // In-place softmax over n values; returns nothing, input must be finite or -inf.
  void (*softmax)(float* x, int64_t n);
  void (*axpy_f16)(float a, const uint16_t* x, float* y, int64_t n);  // y += a * x, x in IEEE half
  // For v < n_vec: y[v * ldy ...] += a[v * lda + p] * x[p * ldx ...] for p = 0..n_rows-1 in order: per
  // element the same operations as n_rows axpy_f16 calls, with the n_vec outputs kept in registers while
  // each x row is widened once (attention's weighted sums of an F16 V cache for a group of tokens).
  void (*axpy_f16_rows)(const float* a, size_t lda, int64_t n_vec, const uint16_t* x, size_t ldx, int64_t n_rows,
                        float* y, size_t ldy, int64_t n);
  // Several heads of one token: for j < n_heads, y[j * hd + c] += a[j * lda + p] * x[p * ldx + j * hd + c] for
  // c < hd and p = 0..n_rows-1 in order, per element the operations of axpy_f16 (so the bits of one
  // axpy_f16_rows call per head). A decode token's weighted sum of an F16 V block for all its heads at once: a
  // head of 32 or 64 values alone has two or four FMA chains, each row's FMA waiting on the previous one's.
  void (*axpy_f16_heads)(const float* a, size_t lda, int64_t n_heads, const uint16_t* x, size_t ldx, int64_t n_rows,
                         float* y, int64_t hd);
  // axpy_f16_rows for a Q8_0 x: rows of n elements (a whole number of 34-byte blocks) ldx bytes apart. Per
  // element the operations of dequantize_row (d * q) followed by axpy, row by row in order, so the same bits
  // as n_rows (dequantize_row, axpy) pairs; each row is dequantized once for all n_vec outputs.
  void (*axpy_q8_0_rows)(const float* a, size_t lda, int64_t n_vec, const uint8_t* x, size_t ldx, int64_t n_rows,
                         float* y, size_t ldy, int64_t n);
  // n floats (a whole number of 32-element blocks) to Q8_0 blocks, the bytes of quant_quantize_row's reference
  // quantizer (d = amax / 127, q = round-half-away(x * (1 / d))): the K/V cache write.
  void (*quantize_q8_0)(const float* x, uint8_t* y, int64_t n);
  // y = x rounded to IEEE half and back (round to nearest even); y may alias x.
  void (*round_f16)(const float* x, float* y, int64_t n);
  void (*to_f16)(const float* x, uint16_t* y, int64_t n);  // round to nearest even
  // RoPE fused with the K/V cache write: rope_apply's rotation of the first n_rot dims of each of n_heads heads
  // of x, in place, with rope_angles' table cs (the same operations, so the same bits), and, when f16 is not
  // null, the rotated row rounded to IEEE half into f16 (to_f16's bits) in the same pass.
  void (*rope)(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs, uint16_t* f16);
  // Attention scores over an F16 K cache: matmul(F16)->rows' arguments and, per output, its exact bits (the
  // fixed four-chain recipe and reduction tree), built for short blocks of rows (a 16-position K block times a
  // few tokens, k = head_dim): rows are widened once per call and 16 rows' horizontal sums share one
  // in-register transpose-and-add tree instead of one reduction per four outputs.
  void (*scores_f16)(const void* w, size_t w_row_bytes, int64_t r0, int64_t r1, const void* x, size_t x_row_bytes,
                     int64_t n_tokens, int64_t k, float* y, int64_t ldy);
  // The first index of the largest of x[0, n) (greedy sampling): runtime's argmax(), NaNs never win and a NaN
  // at index 0 gives 0; 0 for n <= 0.
  int32_t (*argmax)(const float* x, int64_t n);
  // Sampling weights: w[i] = exp((double)(x[i] - max) * scale) for i < n (x[i] <= max), and their sum. The
  // scalar level is sample_row's definition (std::exp, summed in index order); the others compute each
  // weight within 2 ulp of it and sum in lanes, so the sum can differ in its last bits.
  double (*exp_weights)(const float* x, int64_t n, float max, double scale, double* w);
};

const KernelTable& kernels_for(KernelLevel level);
const KernelTable& kernels();  // active level

// Row of n floats from any float weight type (used for embedding lookups and tests).
void dequantize_row(DType type, const void* src, float* dst, int64_t n);

// RoPE as llama.cpp's LLAMA architecture applies it ("normal" mode): rotate adjacent pairs (x[2i], x[2i+1])
// of the first n_rot dims of each head by angle pos * theta^(-2i/n_rot).
void rope_inplace(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, int64_t pos, float theta);
// rope_inplace in two steps, so the q and k rows of one position share one table: cs[2i], cs[2i+1] = cos, sin
// of pair i's angle (n_rot floats), then the rotation of each head with it. Same operations, same bits.
void rope_angles(int64_t n_rot, int64_t pos, float theta, float* cs);
void rope_apply(float* x, int64_t n_heads, int64_t head_dim, int64_t n_rot, const float* cs);

}  // namespace merlin::kernels
