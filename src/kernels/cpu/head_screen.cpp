// The head screen's packing and token quantization, its scalar reference, and the selection of the AVX-512 one.
#include "kernels/cpu/head_screen.h"

#include <algorithm>
#include <cmath>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "kernels/cpu/kernels.h"

namespace merlin::kernels {
namespace detail {
void head_screen_rows_avx512(const void* packed, const float* scale, int64_t r0, int64_t r1, const int8_t* x,
                             size_t x_stride, const float* x_scale, const int32_t* x_sum, int64_t n_tokens, int64_t k,
                             float* y, int64_t ldy);
float head_screen_lower_max_avx512(const float* a, const float* err, const float* hull, float ex, float ey, int64_t n);
int64_t head_screen_candidates_avx512(const float* a, const float* err, const float* hull, float ex, float ey, float lo,
                                      int64_t n, int32_t* out, int64_t cap);
}  // namespace detail

namespace {

constexpr int64_t kGroup = 16;
constexpr double kUp = 1 + 1e-5;  // rounds a bound computed in double up past its float conversion

size_t screen_bytes(int64_t rows, int64_t k) { return (size_t)((rows + kGroup - 1) / kGroup) * kGroup * (size_t)k; }

// Byte of row r, column j in the packed layout.
size_t at(int64_t r, int64_t j, int64_t k) {
  return (size_t)((((r / kGroup) * (k / 4) + j / 4) * kGroup + r % kGroup) * 4 + j % 4);
}

// Symmetric int8 quantization of k values with one scale max |v| / 127, as the screen uses for head rows and
// tokens: store(j, q) receives each code. Returns false (nothing stored) when a value is not finite.
struct Int8Stats {
  float scale = 0;
  double err2 = 0, norm2 = 0;  // ||v - scale q||^2 and ||v||^2, in double
  int32_t sum = 0;             // sum of the codes
};
template <class Store>
bool quantize_int8(const float* v, int64_t k, Store store, Int8Stats* st) {
  float amax = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (!std::isfinite(v[j])) return false;
    amax = std::max(amax, std::fabs(v[j]));
  }
  st->scale = amax / 127.0f;
  for (int64_t j = 0; j < k; ++j) {
    const int q = st->scale > 0 ? std::clamp((int)std::lround(v[j] / st->scale), -127, 127) : 0;
    store(j, q);
    st->sum += q;
    const double d = (double)v[j] - (double)st->scale * q;
    st->err2 += d * d;
    st->norm2 += (double)v[j] * v[j];
  }
  return true;
}

void prepare(void* out, int64_t rows, int64_t k) {
  auto* o = static_cast<uint8_t*>(out);
  std::fill(o, o + screen_bytes(rows, k), (uint8_t)128);
}

bool pack_row(const float* w, int64_t r, int64_t k, void* out, float* scale, float* err, float* hull) {
  auto* o = static_cast<uint8_t*>(out);
  Int8Stats st;
  if (!quantize_int8(w, k, [&](int64_t j, int q) { o[at(r, j, k)] = (uint8_t)(q + 128); }, &st)) return false;
  scale[r] = st.scale;
  err[r] = (float)(std::sqrt(st.err2) * kUp);
  hull[r] = (float)((std::sqrt(st.norm2) + std::sqrt(st.err2)) * kUp);
  return true;
}

void rows_reference(const void* packed, const float* scale, int64_t r0, int64_t r1, const int8_t* x, size_t x_stride,
                    const float* x_scale, const int32_t* x_sum, int64_t n_tokens, int64_t k, float* y, int64_t ldy) {
  const auto* p = static_cast<const uint8_t*>(packed);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t t = 0; t < n_tokens; ++t) {
      int32_t s = 0;
      for (int64_t j = 0; j < k; ++j) s += (int32_t)p[at(r, j, k)] * x[t * x_stride + j];
      y[t * ldy + r] = (float)(s - 128 * x_sum[t]) * (scale[r] * x_scale[t]);
    }
}

float lower_max_reference(const float* a, const float* err, const float* hull, float ex, float ey, int64_t n) {
  float lo = -INFINITY;
  for (int64_t r = 0; r < n; ++r) {
    if (std::isnan(a[r])) return NAN;
    lo = std::max(lo, a[r] - (ex * err[r] + ey * hull[r]));
  }
  return lo;
}

int64_t candidates_reference(const float* a, const float* err, const float* hull, float ex, float ey, float lo,
                             int64_t n, int32_t* out, int64_t cap) {
  int64_t m = 0;
  for (int64_t r = 0; r < n; ++r)
    if (a[r] + (ex * err[r] + ey * hull[r]) >= lo) {
      if (m == cap) return cap + 1;
      out[m++] = (int32_t)r;
    }
  return m;
}

const HeadScreen kReference{&screen_bytes, &prepare, &pack_row, &rows_reference, &lower_max_reference,
                            &candidates_reference};
const HeadScreen kAvx512{&screen_bytes, &prepare, &pack_row, &detail::head_screen_rows_avx512,
                         &detail::head_screen_lower_max_avx512, &detail::head_screen_candidates_avx512};

}  // namespace

const HeadScreen* head_screen() { return active_kernel_level() >= KernelLevel::Avx512 ? &kAvx512 : nullptr; }

const HeadScreen& head_screen_reference() { return kReference; }

bool screen_quantize(const float* x, int64_t k, double act_err, int8_t* q, ScreenToken* out) {
  Int8Stats st;
  if (!quantize_int8(x, k, [&](int64_t j, int v) { q[j] = (int8_t)v; }, &st)) return false;
  const double nx = std::sqrt(st.norm2), ex = std::sqrt(st.err2) + act_err, gamma = 1.1 * (double)k * 0x1p-24;
  out->scale = st.scale;
  out->sum = st.sum;
  out->bound_x = (float)(nx * kUp);
  // The last 2^-21 covers the float roundings of a -/+ bound (|a| <= hull (||x|| + ||x - x^||)).
  out->bound_y = (float)((ex + (0x1p-23 + 2 * gamma + 0x1p-21) * (nx + ex)) * kUp);
  return true;
}

}  // namespace merlin::kernels
