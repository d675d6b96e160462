// The head screen's products with AVX-512 VNNI (head_screen.h): 16 rows in the lanes of a zmm, one vpdpbusd per
// 4 columns and token with the token's 4 int8 values broadcast from memory, so no horizontal sums; then each
// lane's exact integer sum, less 128 x the token's sum (the weights' bias), is scaled by row and token scale.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cpu/simd_avx512.h"

namespace merlin::kernels::detail {
namespace {

constexpr int64_t kGroup = 16;
constexpr int kMaxT = 16;  // tokens per tile: 16 accumulators and the weight vector

typedef int32_t AliasedI32 __attribute__((may_alias, aligned(1)));
// acc += the lanes' 4 unsigned bytes times the 4 signed bytes at p broadcast to every lane.
inline __m512i dot_bcast(__m512i acc, __m512i w, const uint32_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const AliasedI32*>(p)));
  return acc;
}

// xt: the tokens' 4-byte groups by column group, kMaxT per group (one base address for every broadcast).
template <int T>
void tile(const uint8_t* gw, int64_t kq, const uint32_t* xt, const float* scale, const float* x_scale,
          const int32_t* x_sum, float* y, int64_t ldy, __mmask16 keep) {
  __m512i acc[T];
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_si512();
  for (int64_t j = 0; j < kq; ++j, xt += kMaxT) {
    const __m512i wv = _mm512_loadu_si512(gw + 64 * j);
#pragma GCC unroll 16
    for (int t = 0; t < T; ++t) acc[t] = dot_bcast(acc[t], wv, xt + t);
  }
  const __m512 ws = _mm512_maskz_loadu_ps(keep, scale);
#pragma GCC unroll 16
  for (int t = 0; t < T; ++t) {
    const __m512i s = _mm512_sub_epi32(acc[t], _mm512_set1_epi32(128 * x_sum[t]));
    _mm512_mask_storeu_ps(y + t * ldy, keep,
                          _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_set1_ps(x_scale[t]))));
  }
}

}  // namespace

void head_screen_rows_avx512(const void* packed, const float* scale, int64_t r0, int64_t r1, const int8_t* x,
                             size_t x_stride, const float* x_scale, const int32_t* x_sum, int64_t n_tokens, int64_t k,
                             float* y, int64_t ldy) {
  using Fn = void (*)(const uint8_t*, int64_t, const uint32_t*, const float*, const float*, const int32_t*, float*,
                      int64_t, __mmask16);
  static constexpr Fn kTiles[kMaxT] = {&tile<1>,  &tile<2>,  &tile<3>,  &tile<4>,  &tile<5>,  &tile<6>,
                                       &tile<7>,  &tile<8>,  &tile<9>,  &tile<10>, &tile<11>, &tile<12>,
                                       &tile<13>, &tile<14>, &tile<15>, &tile<16>};
  const int64_t kq = k / 4;
  const auto* p = static_cast<const uint8_t*>(packed);
  // Token groups as even as possible (32 tokens: two of 16), their bytes transposed once per call.
  const int64_t groups = (n_tokens + kMaxT - 1) / kMaxT;
  thread_local std::vector<uint32_t> xt;
  xt.resize((size_t)(groups * kq * kMaxT));
  for (int64_t g = 0, t = 0; g < groups; ++g) {
    const int64_t nt = n_tokens / groups + (g < n_tokens % groups ? 1 : 0);
    for (int64_t i = 0; i < nt; ++i)
      for (int64_t j = 0; j < kq; ++j) {
        uint32_t v;
        __builtin_memcpy(&v, x + (t + i) * x_stride + 4 * j, 4);
        xt[(size_t)((g * kq + j) * kMaxT + i)] = v;
      }
    t += nt;
  }
  for (int64_t r = r0; r < r1; r += kGroup) {
    const __mmask16 keep = simd512::tail_mask(r1 - r);
    const uint8_t* gw = p + (r / kGroup) * kq * 64;
    for (int64_t g = 0, t = 0; g < groups; ++g) {
      const int64_t nt = n_tokens / groups + (g < n_tokens % groups ? 1 : 0);
      kTiles[nt - 1](gw, kq, xt.data() + g * kq * kMaxT, scale + r, x_scale + t, x_sum + t, y + t * ldy + r, ldy, keep);
      t += nt;
    }
  }
}

float head_screen_lower_max_avx512(const float* a, const float* err, const float* hull, float ex, float ey, int64_t n) {
  const __m512 xv = _mm512_set1_ps(ex), yv = _mm512_set1_ps(ey);
  __m512 lo = _mm512_set1_ps(-__builtin_inff());
  __mmask16 nan = 0;
  for (int64_t r = 0; r < n; r += 16) {
    const __mmask16 m = simd512::tail_mask(n - r);
    const __m512 av = _mm512_maskz_loadu_ps(m, a + r);
    nan |= _mm512_mask_cmp_ps_mask(m, av, av, _CMP_UNORD_Q);
    const __m512 e =
        _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, err + r), _mm512_mul_ps(yv, _mm512_maskz_loadu_ps(m, hull + r)));
    lo = _mm512_mask_max_ps(lo, m, lo, _mm512_sub_ps(av, e));
  }
  return nan ? __builtin_nanf("") : _mm512_reduce_max_ps(lo);
}

int64_t head_screen_candidates_avx512(const float* a, const float* err, const float* hull, float ex, float ey, float lo,
                                      int64_t n, int32_t* out, int64_t cap) {
  const __m512 xv = _mm512_set1_ps(ex), yv = _mm512_set1_ps(ey), lv = _mm512_set1_ps(lo);
  int64_t c = 0;
  for (int64_t r = 0; r < n; r += 16) {
    const __mmask16 m = simd512::tail_mask(n - r);
    const __m512 e =
        _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, err + r), _mm512_mul_ps(yv, _mm512_maskz_loadu_ps(m, hull + r)));
    const __m512 up = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + r), e);
    unsigned hit = _mm512_mask_cmp_ps_mask(m, up, lv, _CMP_GE_OQ);
    while (hit != 0) {
      if (c == cap) return cap + 1;
      out[c++] = (int32_t)(r + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
  return c;
}

}  // namespace merlin::kernels::detail
