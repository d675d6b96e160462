// Greedy screening of a large float output head. At a server step of many greedy sequences the vocabulary
// product (50K x 256 for the default model) is most of the step and runs at the F32 FMA peak. The screen
// computes every logit approximately with int8 weights and activations (one scale per row and per token;
// VNNI: 64 multiply-adds per instruction, four times the F32 FMA rate), bounds the error of each, and the
// caller recomputes exactly only the rows that can still be the largest. The chosen token is the argmax of the
// exact logits, bit for bit what the full product would give.
//
// The bound: with w^ = s_w q_w and x^ = s_x q_x the quantized row and token, the screen value a is w^ . x^
// (an exact integer sum, converted and scaled in float: two roundings, 2^-23 relative), and the head kernel's
// float evaluation L of w . x is within gamma_k ||w|| ||x|| of it (gamma_k ~ k 2^-24; a quantized head's kernel
// multiplies its own int8 activations x~, which adds ||w|| ||x - x~||: screen_quantize's act_err). So
//   |a - L| <= ||w - w^|| ||x|| + ||w^|| ||x - x^|| + (2^-23 + gamma_k) ||w^|| ||x^|| + gamma_k ||w|| ||x||
//           <= err_r * X + hull_r * Y
// with per row err_r = ||w - w^|| and hull_r = ||w|| + ||w - w^|| (>= ||w^||, >= ||w||), and per token
// X = ||x||, Y = ||x - x^|| + (2^-23 + 2 gamma_k)(||x|| + ||x - x^||) (screen_bound), all rounded up.
#pragma once
#include <cstddef>
#include <cstdint>

namespace merlin::kernels {

struct HeadScreen {
  // Bytes of the packed int8 copy of `rows` rows of k values (k a multiple of 4): groups of 16 rows (the last
  // padded with zero rows), per 4 columns 16 lanes of 4 bytes, q_w + 128 (unsigned).
  size_t (*bytes)(int64_t rows, int64_t k);
  // Fills the packed copy with zero rows (the padding of the last group keeps them).
  void (*prepare)(void* out, int64_t rows, int64_t k);
  // Quantizes row r of the head, w (k floats): scale[r] = max |w| / 127, q = round(w / scale); err[r] and
  // hull[r] as above (rounded up). False when a weight is not finite.
  bool (*pack_row)(const float* w, int64_t r, int64_t k, void* out, float* scale, float* err, float* hull);
  // y[t * ldy + r] = scale[r] * x_scale[t] * sum_j q_w[r][j] q_x[t][j] for rows [r0, r1), r0 a multiple of 16;
  // x holds n_tokens rows of k int8 values x_stride bytes apart, x_sum[t] = sum_j q_x[t][j].
  void (*rows)(const void* packed, const float* scale, int64_t r0, int64_t r1, const int8_t* x, size_t x_stride,
               const float* x_scale, const int32_t* x_sum, int64_t n_tokens, int64_t k, float* y, int64_t ldy);
  // The largest lower bound: max over r < n of a[r] - (ex * err[r] + ey * hull[r]); NaN when an a[r] is NaN.
  float (*lower_max)(const float* a, const float* err, const float* hull, float ex, float ey, int64_t n);
  // The rows whose upper bound a[r] + (ex * err[r] + ey * hull[r]) reaches lo, ascending, into out; their
  // count, or cap + 1 when there are more than cap.
  int64_t (*candidates)(const float* a, const float* err, const float* hull, float ex, float ey, float lo, int64_t n,
                        int32_t* out, int64_t cap);
};

// The AVX-512 VNNI screen, or null when MERLIN_KERNELS caps the level below avx512.
const HeadScreen* head_screen();
// Plain loops (the test oracle).
const HeadScreen& head_screen_reference();

// A token's int8 form for the screen: q (k values), its scale and sum, and the per-token bound factors X and Y
// (see above) for a product of length k. k must be at most 1024 (exact float conversion of the integer sums).
// act_err: ||x - x~|| when the head kernel multiplies not x but its own quantized activations x~ (0 for float
// activations); Y then grows by it (|w . x - w . x~| <= ||w|| ||x - x~||).
struct ScreenToken {
  float scale = 0, bound_x = 0, bound_y = 0;
  int32_t sum = 0;
};
// False when x is not finite.
bool screen_quantize(const float* x, int64_t k, double act_err, int8_t* q, ScreenToken* out);

}  // namespace merlin::kernels
