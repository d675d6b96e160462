#include "core/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace merlin {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave) return f;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_ok = (xlo & 0x6) == 0x6;
  const bool zmm_ok = (xlo & 0xe6) == 0xe6;
  if (!ymm_ok) f.fma = f.f16c = false;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = ymm_ok && (b & (1u << 5));
  if (zmm_ok) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vnni = c & (1u << 11);
  }
  __cpuid_count(7, 1, a, b, c, d);
  f.avx_vnni = ymm_ok && (a & (1u << 4));
  f.avx512_bf16 = zmm_ok && (a & (1u << 5));
#endif
  return f;
}

KernelLevel level_from_env(KernelLevel best) {
  const char* env = std::getenv("MERLIN_KERNELS");
  if (env == nullptr || *env == 0) return best;
  KernelLevel want;
  if (std::strcmp(env, "scalar") == 0) want = KernelLevel::Scalar;
  else if (std::strcmp(env, "avx2") == 0) want = KernelLevel::Avx2;
  else if (std::strcmp(env, "avx512") == 0) want = KernelLevel::Avx512;
  else fail("MERLIN_KERNELS must be scalar, avx2 or avx512 (got '", env, "')");
  return want < best ? want : best;
}

std::atomic<int>& active_level_slot() {
  static std::atomic<int> slot{(int)level_from_env(best_kernel_level())};
  return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

KernelLevel best_kernel_level() {
  const CpuFeatures& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512_vnni && f.fma && f.f16c)
    return KernelLevel::Avx512;
  if (f.avx2 && f.fma && f.f16c) return KernelLevel::Avx2;
  return KernelLevel::Scalar;
}

KernelLevel active_kernel_level() { return (KernelLevel)active_level_slot().load(std::memory_order_relaxed); }

void set_kernel_level(KernelLevel l) {
  const KernelLevel best = best_kernel_level();
  active_level_slot().store((int)(l < best ? l : best));
}

const char* kernel_level_name(KernelLevel l) {
  switch (l) {
    case KernelLevel::Scalar: return "scalar";
    case KernelLevel::Avx2: return "avx2";
    case KernelLevel::Avx512: return "avx512";
  }
  return "?";
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (on) s += (s.empty() ? "" : " ") + std::string(name);
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512_vnni, "avx512_vnni");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx_vnni, "avx_vnni");
  return s;
}

}  // namespace merlin
