// Device readers of GGUF (ggml) block layouts, element by element: the integer code of element c of a row
// (what repacking keeps) and its dequantized value (what the embedding lookup produces). They follow the
// scalar references in src/kernels/cpu/quant_ref*.cpp operation for operation, so values match bit for bit.
#pragma once
#include "kernels/cuda/common.cuh"

#include "core/dtype.h"

namespace merlin::cuda {

__device__ __forceinline__ uint16_t load_u16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

// Trit n (0..4) of a TQ1_0 byte, as a code 0..2 (meaning -1, 0, +1).
__device__ __forceinline__ int tq1_code(uint8_t byte, int n) {
  const uint8_t pow3[5] = {1, 3, 9, 27, 81};
  const uint8_t q = (uint8_t)(byte * pow3[n]);
  return ((int)q * 3) >> 8;
}

// Integer code of element c: Q8_0 -> int8 value; Q4_0/MXFP4/Q4_K -> nibble; TQ2_0/TQ1_0 -> trit + 1.
__device__ __forceinline__ int raw_code(DType t, const uint8_t* row, int64_t c) {
  switch (t) {
    case DType::Q8_0: return (int8_t)row[(c / 32) * 34 + 2 + c % 32];
    case DType::Q4_0:
    case DType::MXFP4: {
      const int bb = t == DType::Q4_0 ? 18 : 17, off = t == DType::Q4_0 ? 2 : 1;
      const int j = (int)(c % 32);
      const uint8_t b = row[(c / 32) * bb + off + (j % 16)];
      return j < 16 ? (b & 0xF) : (b >> 4);
    }
    case DType::Q4_K: {
      const int r = (int)(c % 256), chunk = r / 64, within = r % 64;
      const uint8_t b = row[(c / 256) * 144 + 16 + 32 * chunk + within % 32];
      return within < 32 ? (b & 0xF) : (b >> 4);
    }
    case DType::TQ2_0: {
      const int r = (int)(c % 256), h = r / 128, l = (r % 128) / 32, m = r % 32;
      return (row[(c / 256) * 66 + 32 * h + m] >> (2 * l)) & 3;
    }
    case DType::TQ1_0: {
      const uint8_t* b = row + (c / 256) * 54;
      const int r = (int)(c % 256);
      if (r < 160) return tq1_code(b[r % 32], r / 32);
      if (r < 240) return tq1_code(b[32 + (r - 160) % 16], (r - 160) / 16);
      return tq1_code(b[48 + (r - 240) % 4], (r - 240) / 4);
    }
    default: return 0;
  }
}

__device__ __forceinline__ float raw_value(DType t, const uint8_t* row, int64_t c) {
  switch (t) {
    case DType::F32: return reinterpret_cast<const float*>(row)[c];
    case DType::F16: return half_bits_to_f32(load_u16(row + 2 * c));
    case DType::BF16: return bf16_bits_to_f32(load_u16(row + 2 * c));
    case DType::Q8_0: return __fmul_rn((float)raw_code(t, row, c), half_bits_to_f32(load_u16(row + (c / 32) * 34)));
    case DType::Q4_0:
      return __fmul_rn((float)(raw_code(t, row, c) - 8), half_bits_to_f32(load_u16(row + (c / 32) * 18)));
    case DType::MXFP4: {
      const int8_t lut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
      return __fmul_rn((float)lut[raw_code(t, row, c)], e8m0_half(row[(c / 32) * 17]));
    }
    case DType::Q4_K: {
      const uint8_t* b = row + (c / 256) * 144;
      const int j = (int)(c % 256) / 32;  // sub-block
      const uint8_t* s = b + 4;
      int sc, m;
      if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      const float d1 = __fmul_rn(half_bits_to_f32(load_u16(b)), (float)sc);
      const float m1 = __fmul_rn(half_bits_to_f32(load_u16(b + 2)), (float)m);
      return __fsub_rn(__fmul_rn(d1, (float)raw_code(t, row, c)), m1);
    }
    case DType::TQ2_0:
      return __fmul_rn((float)(raw_code(t, row, c) - 1), half_bits_to_f32(load_u16(row + (c / 256) * 66 + 64)));
    case DType::TQ1_0:
      return __fmul_rn((float)(raw_code(t, row, c) - 1), half_bits_to_f32(load_u16(row + (c / 256) * 54 + 52)));
    default: return 0.0f;
  }
}

}  // namespace merlin::cuda
