// Run-time CPU feature detection and the kernel-level choice. MERLIN_KERNELS=scalar|avx2|avx512 forces a
// level (it is capped by what the CPU supports); without it the best supported level is used.
#pragma once
#include <string>

namespace merlin {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx_vnni = false;
};

enum class KernelLevel { Scalar = 0, Avx2 = 1, Avx512 = 2 };

const CpuFeatures& cpu_features();
KernelLevel best_kernel_level();       // from CPU features only
KernelLevel active_kernel_level();     // best_kernel_level() capped by MERLIN_KERNELS (read once)
void set_kernel_level(KernelLevel l);  // for tests: overrides the active level (capped by the CPU)
const char* kernel_level_name(KernelLevel l);
std::string cpu_features_string();

}  // namespace merlin
