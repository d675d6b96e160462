// AVX-512 helpers shared by the inference and training kernels. Include only from *_avx512.cpp files (built with
// the AVX-512 flags). Everything is in an anonymous namespace, so each such file gets its own internal copy and
// no AVX-512 code can be picked by the linker for a baseline caller (see kernels_impl.h).
#pragma once
// GCC 12's AVX-512 headers seed results with a self-initialized "undefined" vector and then warn about it
// wherever an intrinsic is inlined (fixed in GCC 13); the warning's location is inside the header.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

namespace merlin::simd512 {
namespace {

inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// exp(x) within ~1 ulp: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact reduction), a degree-6
// polynomial (Cephes expf) for e^r, and vscalefps for 2^n, which saturates to inf / 0 by itself. Results
// below the smallest normal float are flushed to 0, so -inf maps to exactly 0.
inline __m512 exp_ps(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512 out = _mm512_scalef_ps(e, n);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654475f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(out, tiny, _mm512_setzero_ps());
}

}  // namespace
}  // namespace merlin::simd512
