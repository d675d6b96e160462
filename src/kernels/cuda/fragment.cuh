// Device helpers shared by the product kernels (matmul.cu, matvec1.cu) and the dequantization for prefill
// GEMMs (gemm.cu): streaming loads of fragment-ordered weights, the tensor-core instructions, and the
// mapping from a 16-byte chunk of codes to the int8 A operand of one k-step.
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/raw_formats.cuh"

namespace merlin::cuda {

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <bool Bf16>
__device__ __forceinline__ void mma_half(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (Bf16)
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// MXFP4 codes (one per byte) to their int8 values {0, 1, 2, 3, 4, 6, 8, 12} with the sign in bit 3: two
// table lookups (positive and negative table, selected by the code's low 3 bits) and a byte mask made by
// prmt's sign-replicating mode from bit 3 moved to each byte's top bit.
__device__ __forceinline__ uint32_t mxfp4_values(uint32_t c) {
  const uint32_t mag = c & 0x07070707u;
  uint32_t sel = mag | (mag >> 4);
  sel = (sel & 0xFFu) | ((sel >> 8) & 0xFF00u);
  const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, sel);
  const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);
  uint32_t mask;  // prmt with selector bit 3 set replicates the selected byte's sign bit (PTX ISA, prmt)
  asm("prmt.b32 %0, %1, 0, 0xBA98;" : "=r"(mask) : "r"(c << 4));
  return (pos & ~mask) | (neg & mask);
}

__device__ __forceinline__ uint32_t byte_of(const uint4& v, int i) {
  const uint32_t w = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
  return (w >> ((i & 3) * 8)) & 0xFFu;
}

// Q4_K sub-block j's scale d * sc and min dmin * m from a 16-byte block header.
__device__ __forceinline__ float2 q4k_scale_min(const uint4& h, int j) {
  int sc, m;
  if (j < 4) {
    sc = byte_of(h, 4 + j) & 63;
    m = byte_of(h, 8 + j) & 63;
  } else {
    sc = (byte_of(h, 8 + j) & 0xF) | ((byte_of(h, j) >> 6) << 4);
    m = (byte_of(h, 8 + j) >> 4) | ((byte_of(h, 4 + j) >> 6) << 4);
  }
  const float d = __half2float(__ushort_as_half((uint16_t)(h.x & 0xFFFF)));
  const float dmin = __half2float(__ushort_as_half((uint16_t)(h.x >> 16)));
  return make_float2(d * (float)sc, dmin * (float)m);
}

// Each byte b of v (every byte below 128 - 8 + m, so no carry crosses a byte) minus m (m <= 8), as int8: an add
// and an xor, where __vsub4 is a longer emulated sequence on sm_90. b + 128 - m flips to b - m by the xor.
__device__ __forceinline__ uint32_t bytes_minus(uint32_t v, uint32_t m) {
  return (v + (128u - m) * 0x01010101u) ^ 0x80808080u;
}

// Starting value of an integer sum (an mma.sync s32 accumulator, a dp4a chain) whose result d (|d| < 2^22)
// is then read as a float, exactly, with one float add (biased_to_float): the bits of 1.5 * 2^23, so d
// lands in the mantissa. It replaces I2F, whose throughput on sm_90 is an eighth of a float add's, in every
// per-block epilogue, and costs no integer add since the sum starts from it.
constexpr int kIntBias = 0x4B400000;
__device__ __forceinline__ float biased_to_float(int biased) { return __int_as_float(biased) - 12582912.0f; }

// The int8 operand of k-step j of a chunk, after the format's code-to-value mapping.
template <int F>
__device__ __forceinline__ void int8_operand(const uint4& w, int j, uint32_t (&a)[4]) {
  if constexpr (F == kQ8_0) {
    a[0] = w.x; a[1] = w.y; a[2] = w.z; a[3] = w.w;
  } else if constexpr (F == kTQ2) {
    const uint32_t x = j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
#pragma unroll
    for (int r = 0; r < 4; ++r) a[r] = bytes_minus((x >> (2 * r)) & 0x03030303u, 1);
  } else {
    const uint32_t w0 = j == 0 ? w.x : w.z, w1 = j == 0 ? w.y : w.w;
    a[0] = w0 & 0x0F0F0F0Fu;
    a[1] = w1 & 0x0F0F0F0Fu;
    a[2] = (w0 >> 4) & 0x0F0F0F0Fu;
    a[3] = (w1 >> 4) & 0x0F0F0F0Fu;
    if constexpr (F == kQ4_0) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = bytes_minus(a[r], 8);
    } else if constexpr (F == kMXFP4) {
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = mxfp4_values(a[r]);
    }
  }
}

}  // namespace merlin::cuda
