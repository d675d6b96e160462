// Weight repacking into fragment order (ops.h): codes and block scales of each 16-row tile laid out so that a
// warp streams them with one coalesced 16-byte load per lane per tensor-core k-step (matmul.cu).
#include <algorithm>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/raw_formats.cuh"

namespace merlin::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------------
// Repacking (one part of a stacked matrix, starting at tile t0).

struct RepackArgs {
  DType type;
  int f;
  const uint8_t* src;
  size_t row_bytes;
  int64_t rows, k, t0, part_tiles;
  Geometry geo;
  uint8_t* q;
  uint8_t* s;
};

__device__ int code_at(const RepackArgs& a, int64_t row, int64_t col) {
  if (row >= a.rows || col >= a.k) return 0;
  return raw_code(a.type, a.src + row * a.row_bytes, col);
}

// Quantized types: lane L = 4g + t of a k-step of 32 holds, as four 4-byte registers, rows (g, g+8, g, g+8) and columns
// (4t.., 4t.., 16+4t.., 16+4t..): value v of 16 is row g + 8 * ((v >> 2) & 1), column 4t + (v & 3) + 16 * (v >> 3).
__global__ void repack_codes_kernel(RepackArgs a) {
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t total = a.part_tiles * a.geo.n_chunks * 32;
  if (id >= total) return;
  const int lane = (int)(id % 32), gq = lane >> 2, tq = lane & 3;
  const int64_t chunk = (id / 32) % a.geo.n_chunks, tile = id / 32 / a.geo.n_chunks;
  if (half_fmt(a.f)) {
    // Row-major (matrix_layout.cuh): this thread's 16 bytes are row g + 8 (chunk & 1) of the tile, columns
    // 32 (chunk >> 1) + 8t .. + 7, written at their row-major place; columns past k are zero.
    const int64_t row = tile * 16 + gq + 8 * (chunk & 1), col0 = (chunk >> 1) * 32 + 8 * tq;
    uint16_t* dst = reinterpret_cast<uint16_t*>(a.q) + (a.t0 * 16 + row) * half_ld(a.k) + col0;
    for (int v = 0; v < 8; ++v) {
      const int64_t col = col0 + v;
      dst[v] = row < a.rows && col < a.k ? load_u16(a.src + row * a.row_bytes + 2 * col) : 0;
    }
    return;
  }
  uint8_t out[16] = {};
  const int spc = steps_per_chunk(a.f);
  for (int j = 0; j < spc; ++j) {
    const int64_t step = chunk * spc + j;
    if (step >= a.geo.n_steps) break;
    int code[16];
    for (int v = 0; v < 16; ++v)
      code[v] = code_at(a, tile * 16 + gq + 8 * ((v >> 2) & 1), step * 32 + 4 * tq + (v & 3) + 16 * (v >> 3));
    if (spc == 1) {
      for (int v = 0; v < 16; ++v) out[v] = (uint8_t)code[v];
    } else if (spc == 2) {  // byte i: value i low, value i + 8 high
      for (int i = 0; i < 8; ++i) out[8 * j + i] = (uint8_t)(code[i] | (code[i + 8] << 4));
    } else {  // byte i: values i, i + 4, i + 8, i + 12 in bit pairs
      for (int i = 0; i < 4; ++i)
        out[4 * j + i] = (uint8_t)(code[i] | (code[i + 4] << 2) | (code[i + 8] << 4) | (code[i + 12] << 6));
    }
  }
  uint8_t* dst = a.q + (((a.t0 + tile) * a.geo.n_chunks + chunk) * 32 + lane) * 16;
  for (int i = 0; i < 16; ++i) dst[i] = out[i];
}

__global__ void repack_scales_kernel(RepackArgs a) {
  const int64_t per_tile = (a.f == kTQ2 || a.f == kQ4_K) ? a.geo.n_super : a.geo.n_steps;
  const int64_t id = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (id >= a.part_tiles * per_tile * 16) return;
  const int rr = (int)(id % 16);
  const int64_t blk = (id / 16) % per_tile, tile = id / 16 / per_tile;
  const int64_t row = tile * 16 + rr, gt = a.t0 + tile;
  if (row >= a.rows) return;  // padding rows keep zero scales
  const uint8_t* r = a.src + row * a.row_bytes;
  switch (a.type) {
    case DType::Q8_0:
      reinterpret_cast<uint16_t*>(a.s)[(gt * per_tile + blk) * 16 + pair_pos(rr)] = load_u16(r + blk * 34);
      break;
    case DType::Q4_0:
      reinterpret_cast<uint16_t*>(a.s)[grouped_scale_index(gt, per_tile, blk, rr)] = load_u16(r + blk * 18);
      break;
    case DType::MXFP4: a.s[grouped_scale_index(gt, per_tile, blk, rr)] = r[blk * 17]; break;
    case DType::TQ2_0:
      reinterpret_cast<uint16_t*>(a.s)[(gt * per_tile + blk) * 16 + pair_pos(rr)] = load_u16(r + blk * 66 + 64);
      break;
    case DType::TQ1_0:
      reinterpret_cast<uint16_t*>(a.s)[(gt * per_tile + blk) * 16 + pair_pos(rr)] = load_u16(r + blk * 54 + 52);
      break;
    case DType::Q4_K:
      for (int i = 0; i < 16; ++i) a.s[((gt * per_tile + blk) * 16 + rr) * 16 + i] = r[blk * 144 + i];
      break;
    default: break;
  }
}

}  // namespace


bool matrix_type_supported(DType t) { return fmt_of(t) >= 0; }
int64_t padded_rows(int64_t rows) { return (rows + 15) / 16 * 16; }

ActKind act_kind_for(DType t) {
  switch (fmt_of(t)) {
    case kF32: return ActKind::F32;
    case kF16: return ActKind::F16;
    case kBF16: return ActKind::BF16;
    case kQ8_0:
    case kQ4_0:
    case kMXFP4: return ActKind::Q8_0;
    default: return ActKind::Q8_K;
  }
}

ActKind Matrix::act() const { return act_kind_for(type); }

Matrix upload_matrix(const MatrixPart* parts, int n_parts, Stream stream) {
  MERLIN_CHECK(n_parts > 0, "upload_matrix: no parts");
  init_matmul_kernels();
  Matrix m;
  m.type = parts[0].type;
  m.k = parts[0].k;
  m.fmt = fmt_of(m.type);
  MERLIN_CHECK(m.fmt >= 0, "the CUDA backend has no kernels for ", dtype_name(m.type), " weights");
  size_t max_part = 0;
  for (int i = 0; i < n_parts; ++i) {
    MERLIN_CHECK(parts[i].type == m.type && parts[i].k == m.k, "upload_matrix: stacked parts differ in type or width");
    m.rows += padded_rows(parts[i].rows);
    max_part = std::max(max_part, (size_t)parts[i].rows * parts[i].row_bytes);
  }
  if (m.fmt == kF16 || m.fmt == kBF16)
    MERLIN_CHECK(m.k % 16 == 0, dtype_name(m.type), " rows of ", m.k, " elements: the CUDA backend needs a multiple of 16");
  const Geometry geo = geometry(m.fmt, m.rows, m.k);
  m.bytes = geo.q_bytes + geo.s_bytes;
  m.q = static_cast<uint8_t*>(dev_alloc(geo.q_bytes));
  if (geo.s_bytes) m.s = static_cast<uint8_t*>(dev_alloc(geo.s_bytes));
  uint8_t* staging = static_cast<uint8_t*>(dev_alloc(max_part));
  int64_t row0 = 0;
  for (int i = 0; i < n_parts; ++i) {
    const MatrixPart& pt = parts[i];
    const size_t bytes = (size_t)pt.rows * pt.row_bytes;
    if (m.fmt == kF32) {
      for (int64_t r = 0; r < pt.rows; ++r)
        copy_to_device(m.q + (size_t)(row0 + r) * m.k * 4, static_cast<const uint8_t*>(pt.data) + r * pt.row_bytes,
                       (size_t)m.k * 4);
    } else {
      copy_to_device(staging, pt.data, bytes);
      RepackArgs a{pt.type, m.fmt, staging, pt.row_bytes, pt.rows, pt.k, row0 / 16, padded_rows(pt.rows) / 16, geo, m.q, m.s};
      const int64_t nq = a.part_tiles * geo.n_chunks * 32;
      repack_codes_kernel<<<(unsigned)((nq + 255) / 256), 256, 0, stream>>>(a);
      check_launch("repack codes");
      if (geo.s_bytes) {
        const int64_t per_tile = (m.fmt == kTQ2 || m.fmt == kQ4_K) ? geo.n_super : geo.n_steps;
        const int64_t ns = a.part_tiles * per_tile * 16;
        repack_scales_kernel<<<(unsigned)((ns + 255) / 256), 256, 0, stream>>>(a);
        check_launch("repack scales");
      }
      MERLIN_CUDA_CHECK(cudaStreamSynchronize(stream));  // staging is reused by the next part
    }
    row0 += padded_rows(pt.rows);
  }
  dev_free(staging);
  return m;
}

void free_matrix(Matrix& m) {
  dev_free(m.q);
  dev_free(m.s);
  m.q = m.s = nullptr;
}

}  // namespace merlin::cuda
