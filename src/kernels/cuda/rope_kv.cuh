// RoPE and the K/V cache write, shared by rope_kv_kernel (attention.cu) and the products that apply them in
// their epilogue (matvec1.cu, matvec1_half.cu, matmul.cu): the same operations in the same order, so the
// fused path writes the bits the separate kernel would.
#pragma once
#include "core/sys.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {

// A power-of-two block size (the default 16) takes a shift and a mask: a runtime division is ~20 dependent
// instructions, and these lookups sit in kernel prologues (the attention's first slots) and epilogues.
__device__ __forceinline__ int64_t kv_slot(const KvArgs& kv, int seq, int pos) {
  const int bs = kv.block_size;
  int blk, off;
  if ((bs & (bs - 1)) == 0) {
    blk = pos >> (__ffs(bs) - 1);
    off = pos & (bs - 1);
  } else {
    blk = pos / bs;
    off = pos % bs;
  }
  return (int64_t)kv.d_table[(int64_t)seq * kv.max_blocks + blk] * bs + off;
}

__device__ __forceinline__ void store_kv(const KvArgs& kv, void* base, int64_t idx, float v) {
  if (kv.f16) static_cast<__half*>(base)[idx] = __float2half_rn(v);
  else static_cast<float*>(base)[idx] = v;
}

// Rotates pair (x0, x1) by the table's angle with the CPU's exact operation order (no fused multiply-add).
__device__ __forceinline__ float2 rotate(float x0, float x1, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// Where an epilogue writes token t's rows: its cache slot and cos/sin row (a one-token product looks them up
// once per CTA). Positions, sequences and block tables are written before a step's first kernel starts,
// never by a kernel, so the lookup may run before pdl_wait.
struct RopeTarget {
  int64_t slot = 0;
  const float* cs = nullptr;
};
__device__ __forceinline__ RopeTarget rope_target(const RopeKvArgs& a, int t = 0) {
  const int pos = a.d_pos[t];
  return RopeTarget{kv_slot(a.kv, a.d_seq[t], pos), a.d_cos_sin + (int64_t)pos * a.n_rot};
}

// The single-token RoPE products (matvec1, matvec1_half) copy the token's cos / sin row (n_rot floats, at
// most kRopeCsMax) to a per-warp slot in shared memory before pdl_wait, so that the rotation after the
// reduction waits on no L2 round trip (the table is the host's, read-only). rope_cs_pays: whether a launch
// takes the copy; MERLIN_CUDA_ROPE_CS=0 (read once) never (A/B timing; the same bits).
constexpr int kRopeCsMax = 128;
inline bool rope_cs_pays(const RopeKvArgs& a) {
  static const bool on = !env_is("MERLIN_CUDA_ROPE_CS", "0");
  return on && a.n_rot % 4 == 0 && a.n_rot <= kRopeCsMax;
}
// One 16-byte load per lane into the warp's slot; at.cs then points there. Warp-collective.
__device__ __forceinline__ void copy_cs_row(RopeTarget& at, int n_rot, float* slot, int lane) {
  if (4 * lane < n_rot) *reinterpret_cast<float4*>(slot + 4 * lane) = __ldg(reinterpret_cast<const float4*>(at.cs) + lane);
  __syncwarp();
  at.cs = slot;
}

// Asks L2 for the K and V rows of token 0's latest a.l2_positions positions before its own (one bulk prefetch
// per row, rows spread over the grid's CTAs and the calling warp's lanes). The attention kernel after the
// product reads them: in decode the step's weight stream has evicted them from L2 since the last step, and
// the attention kernel's own prefetch (prefetch_context) starts only when the product's CTAs leave the SMs,
// a microsecond or two before it needs them, while the product itself runs for several. Hints only: the
// rows are those of earlier steps (this product writes only the current position's) and the table entries
// of earlier positions are valid, so the addresses are too. H200 tg128 (2026-11-30, MERLIN_CUDA_KV_L2_MB=0 / 8):
// macbook q4_0 742.7 / 746.6 t/s, iphone q4_0 1,220.8 / 1,226.5, base unchanged; the attention kernel's charge
// at contexts 96-127 drops from 5.7 to 4.9 us per layer (macbook), below 32 positions it stays 3.8.
// A 2-4-token product (matvec1_few) calls it for each token t.
__device__ __forceinline__ void prefetch_kv_context(const RopeKvArgs& a, int lane, int t = 0) {
  if (a.l2_positions <= 0) return;
  const int pos = a.d_pos[t], seq = a.d_seq[t], lo = max(0, pos - a.l2_positions), rows = 2 * (pos - lo);
  const int64_t es = a.kv.f16 ? 2 : 4;
  for (int r = (int)blockIdx.x + lane * (int)gridDim.x; r < rows; r += 32 * (int)gridDim.x) {
    const int64_t off = kv_slot(a.kv, seq, lo + r / 2) * a.kv_dim * es;
    prefetch_l2(static_cast<const char*>((r & 1) ? a.kv.d_v : a.kv.d_k) + off, (uint32_t)(a.kv_dim * es));
  }
}

// The batched QKV products' counterpart (MmArgs::ctx_l2): token t's latest `lim` positions before its own,
// one bulk prefetch of K and one of V per cache block (a block's slots are contiguous), asked by the lane of
// the last warp that looks token t's RoPE target up. A 32-token step's attention reads 32 contexts, which
// the weight stream has evicted from L2 since the last step, and its grid is too large to prefetch them itself
// before its own wait (prefetch_context, one-wave grids only). Block j of token t goes to CTA (t * nbm + j)
// mod gridDim.x (nbm: the most blocks a token's window spans), so that no SM issues much more than another.
__device__ __forceinline__ void prefetch_token_context(const RopeKvArgs& a, int t, int lim, int nbm) {
  const int pos = a.d_pos[t], seq = a.d_seq[t], lo = max(0, pos - lim), bs = a.kv.block_size;
  const int64_t row = a.kv_dim * (a.kv.f16 ? 2 : 4);
  const int g = (int)gridDim.x;
  const int first = (((int)blockIdx.x - t * nbm) % g + g) % g;
  for (int b = lo / bs + first; b * bs < pos; b += g) {
    const int p0 = max(lo, b * bs), p1 = min(pos, (b + 1) * bs);
    const int64_t off = kv_slot(a.kv, seq, p0) * row;
    const uint32_t n = (uint32_t)((p1 - p0) * row);
    prefetch_l2(static_cast<const char*>(a.kv.d_k) + off, n);
    prefetch_l2(static_cast<const char*>(a.kv.d_v) + off, n);
  }
}

// Where a QKV product's epilogue sends row r of a token (value v, its RoPE partner r ^ 1 has w): Q rows,
// rotated, to the qkv buffer; K rows, rotated, and V rows to the cache slot of (seq, pos). The row indices of
// a stacked QKV product (q_dim + 2 kv_dim rows) fit 32 bits: 32-bit remainders, where the 64-bit ones were
// ~100 instructions each in an epilogue that a single-token kernel inlines up to six times.
__device__ __forceinline__ void rope_store(const RopeKvArgs& a, float* y, int64_t row, float v, float w,
                                           const RopeTarget& at) {
  const int64_t slot = at.slot;
  const float* cs = at.cs;
  const int half_rot = a.n_rot / 2, r = (int)row, q_dim = (int)a.q_dim, k_off = (int)a.k_off,
            v_off = (int)a.v_off, kv_dim = (int)a.kv_dim;
  if (r < q_dim) {
    const int i = (r % a.hd) / 2;
    if (i < half_rot) v = (r & 1) ? rotate(w, v, cs[2 * i], cs[2 * i + 1]).y : rotate(v, w, cs[2 * i], cs[2 * i + 1]).x;
    y[r] = v;
  } else if (r >= k_off && r < k_off + kv_dim) {
    const int e = r - k_off;
    const int i = (e % a.hd) / 2;
    if (i < half_rot) v = (e & 1) ? rotate(w, v, cs[2 * i], cs[2 * i + 1]).y : rotate(v, w, cs[2 * i], cs[2 * i + 1]).x;
    store_kv(a.kv, a.kv.d_k, slot * a.kv_dim + e, v);
  } else if (r >= v_off && r < v_off + kv_dim) {
    store_kv(a.kv, a.kv.d_v, slot * a.kv_dim + (r - v_off), v);
  }
}

}  // namespace merlin::cuda
