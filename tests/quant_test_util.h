// Random inputs for kernel tests (CPU and CUDA): gaussian activations and raw quantized blocks.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/quant_formats.h"

namespace merlin::test {

inline std::vector<float> gaussian(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& f : v) f = dist(rng);
  return v;
}

// A finite fp16 scale of moderate size and random sign.
inline uint16_t random_scale(std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  return f32_to_fp16(d(rng));
}

// Raw random bytes with the scale fields made finite: reaches quant values the quantizers never emit
// (Q8_0's -128, arbitrary Q4_K scales and mins, every MXFP4 code).
inline void randomize_blocks(DType type, uint8_t* p, size_t n_blocks, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t bytes = n_blocks * dtype_info(type).block_bytes;
  for (size_t i = 0; i < bytes; ++i) p[i] = (uint8_t)rng();
  using namespace kernels::quant;
  for (size_t b = 0; b < n_blocks; ++b) {
    switch (type) {
      case DType::Q8_0: reinterpret_cast<BlockQ8_0*>(p)[b].d = random_scale(rng); break;
      case DType::Q4_0: reinterpret_cast<BlockQ4_0*>(p)[b].d = random_scale(rng); break;
      case DType::MXFP4: reinterpret_cast<BlockMxfp4*>(p)[b].e = (uint8_t)(110 + rng() % 30); break;
      case DType::Q4_K:
        reinterpret_cast<BlockQ4_K*>(p)[b].d = random_scale(rng);
        reinterpret_cast<BlockQ4_K*>(p)[b].dmin = random_scale(rng);
        break;
      case DType::TQ1_0: {
        auto& blk = reinterpret_cast<BlockTQ1_0*>(p)[b];
        blk.d = random_scale(rng);
        // Bytes above 242 (qs) or 80*3 (qh) are not valid base-3 packings; keep them in range.
        for (uint8_t& q : blk.qs) q = (uint8_t)((q % 243 * 256 + 242) / 243);
        for (uint8_t& q : blk.qh) q = (uint8_t)((q % 81 * 3 * 256 + 242) / 243);
        break;
      }
      case DType::TQ2_0: {
        auto& blk = reinterpret_cast<BlockTQ2_0*>(p)[b];
        blk.d = random_scale(rng);
        for (uint8_t& q : blk.qs) {  // code 3 is not a valid trit
          for (int l = 0; l < 4; ++l)
            if (((q >> (2 * l)) & 3) == 3) q = (uint8_t)(q & ~(1 << (2 * l)));
        }
        break;
      }
      default: break;
    }
  }
}

}  // namespace merlin::test
