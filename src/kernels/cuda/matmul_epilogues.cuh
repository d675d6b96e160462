// Device code of the batched products, second part (matmul_operands.cuh is the first): the sum of a tile's
// partials and the epilogues after a tile set's last round (plain / RoPE / argmax, Norm, half-plane Norm,
// Glu, the argmax pairs), dispatched by reduce_tiles. Included through matmul_kernels.cuh by matmul.cu only.
#pragma once
#include "kernels/cuda/matmul_operands.cuh"

namespace merlin::cuda {
namespace {

// The epilogues a kernel instance can run (mm_kernel's E): kEpAny decides from MmArgs at run time (rope_on,
// argmax, norm_on); the others are built for one kind of product, so that the dead epilogues take no code
// from the instance (40-60 % of kEpAny's SASS; a kernel also gets registers for its most demanding path, the
// k-loop's rounds in flight included: docs/GPU.md, "Epilogue instances"). kEpStore: y = or y += the product,
// with or without the next RMSNorm's input (norm_on, still read at run time); with G, the Glu epilogue. Only
// kEpAny instances hold the fused preparation (stage_prep, MmArgs::fuse_prep).
enum Ep : int { kEpAny = 0, kEpRope = 1, kEpArgmax = 2, kEpStore = 3 };
template <int E>
__device__ __forceinline__ bool ep_rope(const MmArgs& p) { return E == kEpAny ? p.rope_on != 0 : E == kEpRope; }
template <int E>
__device__ __forceinline__ bool ep_argmax(const MmArgs& p) { return E == kEpAny ? p.argmax != nullptr : E == kEpArgmax; }
template <int E>
__device__ __forceinline__ int ep_norm(const MmArgs& p) { return E == kEpAny || E == kEpStore ? p.norm_on : 0; }

// Sum of a tile's partials (warps grp * split .. + split - 1) of element (i, ln), in warp order: every
// epilogue sums a tile in this order, so they all see the bits the plain product writes to y. The partials
// load four at a time and add in order: one at a time (a chain of dependent shared loads) cost iphone q4_0
// x32, whose tiles have 8 partials, 5.4 % (H200, 2026-12-02). One code path for every split, not instances
// per split: the epilogues run while the next round's loads are in flight, and inlining one per split (or
// eight loads at once) took those registers (ptxas -v: spills at the 128-register cap).
template <int NT>
__device__ __forceinline__ float tile_sum(const MmArgs& p, const float (*red)[NT * 4][32], int grp, int i, int ln) {
  constexpr int kStride = NT * 4 * 32;  // floats between two warps' partials of one element
  const float* a = &red[grp << p.split_log2][i][ln];
  float v = 0.f;
  if (p.split_log2 >= 2) {
#pragma unroll 1
    for (int s = 0; s < p.split; s += 4) {  // four at a time, as the compiler unrolled the old loop
      const float t0 = a[s * kStride], t1 = a[(s + 1) * kStride], t2 = a[(s + 2) * kStride], t3 = a[(s + 3) * kStride];
      v += t0;
      v += t1;
      v += t2;
      v += t3;
    }
  } else {
    const float t0 = a[0], t1 = p.split_log2 == 1 ? a[kStride] : 0.f;
    v += t0;
    if (p.split_log2 == 1) v += t1;
  }
  return v;
}

// The Norm epilogue (matmul_norm) of a tile set: a warp per (token, block of 32 rows), lane = row, sums the
// row's partials in reduce_tiles' order (the same y bits), adds it to the residual and writes the next
// RMSNorm's input with a deferred scale (norm_block). split <= 4 (the host sees to it), so a set holds whole
// blocks: kWarps / split >= 2 tiles from an even tile (kWarps / split / 2 blocks: a power of two, so the
// (token, block) pairs are shifts and masks); n_out % 32 == 0, so a warp's rows are all valid or not.
template <int NT>
__device__ __forceinline__ void reduce_norm(const MmArgs& p, int64_t tile0, int tb, int warp, int lane,
                                            float (*red)[NT * 4][32]) {
  const int blocks_log2 = 2 - p.split_log2, rr = lane & 15, grp_in = lane >> 4;
  const int kb = (int)(p.n_out / 32), pairs = 8 * NT << blocks_log2;
  for (int pr = warp; pr < pairs; pr += kWarps) {
    const int tl = pr >> blocks_log2, b = pr & ((1 << blocks_log2) - 1), grp = 2 * b + grp_in, tk = tl & 7;
    const int64_t r = (tile0 + grp) * 16 + rr;
    const int tok = tb + tl;
    if (tok >= p.n || (tile0 + 2 * b) * 16 >= p.n_out) continue;  // warp-uniform
    const int i = (tl >> 3) * 4 + 2 * (rr >> 3) + (tk & 1), ln = (rr & 7) * 4 + (tk >> 1);
    const float v = tile_sum<NT>(p, red, grp, i, ln);
    float* dst = p.y + (int64_t)tok * p.ldy + r;
    const float y = p.accumulate ? *dst + v : v;
    *dst = y;
    const float w = __ldg(p.norm_w + r);
    const NormBlock nb = norm_block(y, w);
    p.norm_out.fq[frag_code_index(tok, r, p.n_out)] = (int8_t)nb.q;
    if (p.norm_out.fh)  // y * w, without the row's 1 / rms: an H reader scales its sums (reduce_tiles)
      p.norm_out.fh[frag_h_index(tok, r, p.n_out)] = __half_as_ushort(__float2half_rn(__fmul_rn(y, w)));
    if (lane == 0) {
      const int64_t f = frag_scale_index(tok, r / 32, p.n_out);
      p.norm_out.fs[f] = nb.scale;
      p.norm_out.fsum[f] = nb.sum;
      p.norm_part[(int64_t)tok * kb + r / 32] = nb.sum_sq;
    }
  }
}

// The half-plane Norm epilogue (matmul_norm's half_only, norm_on 2) of a tile set, for readers that take the
// half plane and scale their sums by 1 / rms (the H kernels): per (tile, two tokens) a warp, lane = row of
// the tile (lane & 15) for token lane >> 4, sums the row's partials in reduce_tiles' order (the same y bits),
// adds it to the residual, writes y * w to the half plane (as reduce_norm does) and the sum of y^2 over the
// tile's 16 rows to norm_part[tok][tile]. No block of 32 outputs, so any split: the product keeps its shape.
// n_out % 16 == 0, so a tile's rows are all valid or not.
template <int NT>
__device__ __forceinline__ void reduce_norm_half(const MmArgs& p, int64_t tile0, int tb, int warp, int lane,
                                                 float (*red)[NT * 4][32]) {
  const int rr = lane & 15, th = lane >> 4, tiles_log2 = 3 - p.split_log2;
  const int units = 4 * NT << tiles_log2;  // (token pair, tile) pairs
  const int64_t tiles_out = p.n_out >> 4;
  for (int u = warp; u < units; u += kWarps) {
    const int grp = u & ((1 << tiles_log2) - 1), tl = 2 * (u >> tiles_log2) + th, tk = tl & 7;
    const int64_t tile = tile0 + grp;
    if (tile >= tiles_out || tb + 2 * (u >> tiles_log2) >= p.n) continue;  // warp-uniform
    const bool valid = tb + tl < p.n;
    const int i = (tl >> 3) * 4 + 2 * (rr >> 3) + (tk & 1), ln = (rr & 7) * 4 + (tk >> 1);
    const float v = tile_sum<NT>(p, red, grp, i, ln);
    const int64_t r = tile * 16 + rr;
    const int tok = tb + tl;
    double ss = 0.0;
    if (valid) {
      float* dst = p.y + (int64_t)tok * p.ldy + r;
      const float y = p.accumulate ? *dst + v : v;
      *dst = y;
      const float w = __ldg(p.norm_w + r);
      p.norm_out.fh[frag_h_index(tok, r, p.n_out)] = __half_as_ushort(__float2half_rn(__fmul_rn(y, w)));
      ss = (double)y * (double)y;
    }
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);  // within each half-warp
    if (valid && rr == 0) p.norm_part[(int64_t)tok * tiles_out + tile] = ss;
  }
}

// The Glu epilogue (matmul_swiglu) of tile set `set`: groups 0 .. half - 1 hold gate tiles set * half + j,
// groups half .. the same tiles of up. A warp per (token, block of 32 gate rows), lane = row, sums each row's
// gate and up partials in reduce_tiles' order (the bits the product would write to y), then writes
// silu(gate) * up with act_impl.cuh's swiglu() and emit(), as prep_act(SwiGlu) would from those rows. split
// <= 2 (the host sees to it), so a set holds whole blocks: kWarps / split / 2 >= 2 gate tiles from an even
// tile; ffn % 32 == 0, so a warp's rows are all valid or not.
template <int NT>
__device__ __forceinline__ void reduce_glu(const MmArgs& p, int set, int tb, int warp, int lane,
                                           float (*red)[NT * 4][32]) {
  const int half = 4 >> p.split_log2, blocks_log2 = 1 - p.split_log2, rr = lane & 15, sub = lane >> 4;
  const int pairs = 8 * NT << blocks_log2;
  for (int pr = warp; pr < pairs; pr += kWarps) {
    const int tl = pr >> blocks_log2, b = pr & ((1 << blocks_log2) - 1), grp = 2 * b + sub, tk = tl & 7;
    const int tok = tb + tl;
    if (tok >= p.n || set * half + 2 * b >= p.glu_tiles) continue;  // warp-uniform
    const int i = (tl >> 3) * 4 + 2 * (rr >> 3) + (tk & 1), ln = (rr & 7) * 4 + (tk >> 1);
    const float g = tile_sum<NT>(p, red, grp, i, ln), u = tile_sum<NT>(p, red, half + grp, i, ln);
    const float v = swiglu(g, u);
    const int64_t o = (int64_t)(set * half + grp) * 16 + rr;
    ActBuf out = p.glu_out;
    switch (out.kind) {
      case ActKind::Q8_0: emit<(int)ActKind::Q8_0>(v, true, tok, o, out); break;
      case ActKind::F16: emit<(int)ActKind::F16>(v, true, tok, o, out); break;
      case ActKind::BF16: emit<(int)ActKind::BF16>(v, true, tok, o, out); break;
      default: emit<(int)ActKind::F32>(v, true, tok, o, out); break;
    }
  }
}

// The larger of two argmax keys (64-bit unsigned order).
__device__ __forceinline__ unsigned long long key_max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

// Element q of a plain epilogue's tile set (reduce_plain): tile grp = q / (NT * 4), fragment index i = q %
// (NT * 4) of lane `lane`, i.e. output row r and token tok (shifts and masks: NT * 4 is a power of two).
struct SetElem {
  int grp, i, tok;
  int64_t r;
};
template <int NT>
__device__ __forceinline__ SetElem set_elem(int q, int64_t tile0, int tb, int lane) {
  SetElem e;
  e.grp = q / (NT * 4);
  e.i = q % (NT * 4);
  const int ci = e.i & 3;
  e.r = (tile0 + e.grp) * 16 + (lane >> 2) + 8 * (ci >> 1);
  e.tok = tb + (e.i >> 2) * 8 + 2 * (lane & 3) + (ci & 1);
  return e;
}

// A token's rope_target in shared memory (a plain aggregate: __shared__ takes no initializers).
struct RopeSlot {
  int64_t slot;
  const float* cs;
};

// The plain epilogue of a tile set: y (or y +=), the RoPE / K/V store of the stacked QKV product
// (rope_store), or the per-token argmax. Thread 32 w + ln takes elements q = w, w + 8, ... of the set's
// kWarps / split * NT * 4 (set_elem), the order reduce_tiles has always used. A thread's tokens repeat with
// period 16 / (NT * 4) passes, so its argmax keys stay in registers (two slots at most) and reach the CTA's
// best once per set, after a shuffle over the 8 lanes of each token, instead of a contended 64-bit shared
// atomic (a CAS loop) per element. One loop per epilogue kind (uniform): the keys are live only in the
// argmax loop. (Before: ~130 instructions per element in the head, half of its 13.4M; ncu, BENCHMARKS.md.)
template <int NT, int E>
__device__ __forceinline__ void reduce_plain(const MmArgs& p, int64_t tile0, int tb, int warp, int lane,
                                             float (*red)[NT * 4][32], unsigned long long* best,
                                             const RopeSlot* targets) {
  constexpr bool kTwoSlots = NT * 4 > kWarps;  // NT = 4: i = warp on even passes, warp + 8 on odd ones
  static_assert(NT * 4 <= 2 * kWarps, "reduce_plain: at most two argmax slots per thread");
  const int elems = (kWarps >> p.split_log2) * NT * 4, gg = lane >> 2, tt = lane & 3;
  if (ep_rope<E>(p)) {  // the RoPE partner r ^ 1 is the same element of lane ln ^ 4, summed in the same order
    for (int q = warp; q < elems; q += kWarps) {
      const SetElem e = set_elem<NT>(q, tile0, tb, lane);
      if (e.r >= p.n_out || e.tok >= p.n) continue;
      const float v = tile_sum<NT>(p, red, e.grp, e.i, lane), w = tile_sum<NT>(p, red, e.grp, e.i, lane ^ 4);
      RopeTarget at;
      if (p.rope_early) {
        const RopeSlot& t = targets[e.tok - tb];
        at = RopeTarget{t.slot, t.cs};
      } else {
        at = rope_target(p.rope, e.tok);
      }
      rope_store(p.rope, p.y + (int64_t)e.tok * p.ldy, e.r, v, w, at);
    }
    return;
  }
  if (!ep_argmax<E>(p)) {
    for (int q = warp; q < elems; q += kWarps) {
      const SetElem e = set_elem<NT>(q, tile0, tb, lane);
      if (e.r >= p.n_out || e.tok >= p.n) continue;
      const float v = tile_sum<NT>(p, red, e.grp, e.i, lane);
      float* dst = p.y + (int64_t)e.tok * p.ldy + e.r;
      *dst = p.accumulate ? *dst + v : v;
    }
    return;
  }
  unsigned long long key0 = 0ull, key1 = 0ull;
  int j = 0;
  for (int q = warp; q < elems; q += kWarps, ++j) {
    const SetElem e = set_elem<NT>(q, tile0, tb, lane);
    if (e.r >= p.n_out || e.tok >= p.n) continue;
    const unsigned long long k = argmax_key(tile_sum<NT>(p, red, e.grp, e.i, lane), e.r);
    if (kTwoSlots && (j & 1)) key1 = key_max(key1, k);
    else key0 = key_max(key0, k);
  }
#pragma unroll
  for (int m = 0; m < (kTwoSlots ? 2 : 1); ++m) {  // lanes 4 gg + tt hold the same token for every gg
    unsigned long long k = m ? key1 : key0;
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) k = key_max(k, __shfl_xor_sync(0xffffffffu, k, o));
    const int i = (warp + kWarps * m) % (NT * 4), tl = (i >> 2) * 8 + 2 * tt + (i & 1);
    if (gg == 0 && k != 0ull) atomicMax(best + tl, k);  // the CTA's best per token, raised into p.argmax at the end
  }
}

// A named barrier for the 64 threads of warps 2 g and 2 g + 1 (ids 1 .. 4; 0 is __syncthreads').
// Immediate ids: a register id makes ptxas reserve all 16 barriers.
__device__ __forceinline__ void pair_barrier(int grp) {
  switch (grp) {
    case 0: asm volatile("bar.sync 1, 64;" ::: "memory"); break;
    case 1: asm volatile("bar.sync 2, 64;" ::: "memory"); break;
    case 2: asm volatile("bar.sync 3, 64;" ::: "memory"); break;
    default: asm volatile("bar.sync 4, 64;" ::: "memory"); break;
  }
}

// The argmax epilogue of products with split <= 2 (the batched head: 2 warps per tile), straight from the
// accumulators: no CTA barrier and no element walk. With split 2 the odd warp of a tile hands its partials
// to the even one through red[odd] between two pair barriers, and the even warp sums them in reduce_tiles'
// order ((0 + even) + odd: the bits tile_sum would give). The owning warp keeps, per lane, the best key of
// each of its 2 NT token columns in red[own] (lane-private slots, argmax_slots) across the CTA's tile sets;
// finish_argmax_slots reduces them over the lanes once, at the end. (The element walk of reduce_plain cost
// ~60 instructions per element and two CTA barriers per set; ncu, docs/BENCHMARKS.md.)
template <int NT>
__device__ __forceinline__ unsigned long long* argmax_slots(float (*red)[NT * 4][32], int warp) {
  return reinterpret_cast<unsigned long long*>(&red[warp][0][0]);  // [2 NT][32]: NT * 4 * 32 floats
}

template <int NT>
__device__ __forceinline__ void reduce_argmax_pair(const MmArgs& p, int64_t tile0, int warp, int lane,
                                                   const float (&acc)[NT][4], float (*red)[NT * 4][32],
                                                   const float* tok_scale) {
  const bool pair = p.split_log2 == 1;
  const int grp = warp >> p.split_log2;
  float v[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float s0 = tok_scale ? tok_scale[nt * 8 + 2 * (lane & 3)] : 1.f;
    const float s1 = tok_scale ? tok_scale[nt * 8 + 2 * (lane & 3) + 1] : 1.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[nt][i] = tok_scale ? acc[nt][i] * (i & 1 ? s1 : s0) : acc[nt][i];
  }
  if (pair && (warp & 1)) {  // the odd warp: hand over the partials, wait until they are read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = v[nt][i];
    pair_barrier(grp);
    pair_barrier(grp);
    return;
  }
  if (pair) {
    pair_barrier(grp);
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[nt][i] = red[warp + 1][nt * 4 + i][lane];
    pair_barrier(grp);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[nt][i] = (0.f + v[nt][i]) + o[nt][i];
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) v[nt][i] = 0.f + v[nt][i];
  }
  const int64_t r0 = (tile0 + grp) * 16 + (lane >> 2), r1 = r0 + 8;
  unsigned long long* slots = argmax_slots<NT>(red, warp);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // token column c of group nt: rows r0 (i = c) and r1 (i = c + 2)
      unsigned long long k = r0 < p.n_out ? argmax_key(v[nt][c], r0) : 0ull;
      if (r1 < p.n_out) k = key_max(k, argmax_key(v[nt][c + 2], r1));
      unsigned long long& s = slots[(nt * 2 + c) * 32 + lane];
      s = key_max(s, k);
    }
}

// Whether reduce_argmax_pair runs the argmax epilogue (uniform over the CTA).
template <int E>
__device__ __forceinline__ bool argmax_in_pairs(const MmArgs& p) {
  return ep_argmax<E>(p) && p.argmax_pairs && p.split_log2 <= 1;
}

// The owning warps' slots at the end of the CTA's sets: each token column's best over the 8 lanes that hold
// it, into the CTA's best per token (best was zeroed before the caller's barrier).
template <int NT>
__device__ __forceinline__ void finish_argmax_slots(const MmArgs& p, int warp, int lane, float (*red)[NT * 4][32],
                                                    unsigned long long* best) {
  if (p.split_log2 == 1 && (warp & 1)) return;
  const unsigned long long* slots = argmax_slots<NT>(red, warp);
#pragma unroll
  for (int s = 0; s < 2 * NT; ++s) {
    unsigned long long k = slots[s * 32 + lane];
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) k = key_max(k, __shfl_xor_sync(0xffffffffu, k, o));
    const int tl = (s >> 1) * 8 + 2 * (lane & 3) + (s & 1);
    if ((lane >> 2) == 0 && k != 0ull) atomicMax(best + tl, k);
  }
}

// Sums each group's partial tiles (split warps each) in a fixed order (deterministic) and writes (or adds)
// the outputs; group j of the CTA holds tile tile0 + j (with glu_on, reduce_glu's tiles of set `set`).
// tok_scale (H kernels reading a deferred RMSNorm, else null): per token of the CTA, the factor 1 / rms
// that its staged halves still lack; the partial sums take it before they meet (the sum is linear in x).
template <int NT, bool G, int E>
__device__ __forceinline__ void reduce_tiles(const MmArgs& p, int set, int64_t tile0, int tb, int warp, int lane,
                                             const float (&acc)[NT][4], float (*red)[NT * 4][32],
                                             unsigned long long* best, const float* tok_scale,
                                             const RopeSlot* targets) {
  if constexpr (!G) {
    if (argmax_in_pairs<E>(p)) return reduce_argmax_pair<NT>(p, tile0, warp, lane, acc, red, tok_scale);
  }
  if (tok_scale) {  // lane 4 g + t's tokens: 8 nt + 2 t and 8 nt + 2 t + 1
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float s0 = tok_scale[nt * 8 + 2 * (lane & 3)], s1 = tok_scale[nt * 8 + 2 * (lane & 3) + 1];
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i] * (i & 1 ? s1 : s0);
    }
  } else {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][nt * 4 + i][lane] = acc[nt][i];
  }
  __syncthreads();
  if constexpr (G) reduce_glu<NT>(p, set, tb, warp, lane, red);
  else if (ep_norm<E>(p) == 2) reduce_norm_half<NT>(p, tile0, tb, warp, lane, red);
  else if (ep_norm<E>(p)) reduce_norm<NT>(p, tile0, tb, warp, lane, red);
  else reduce_plain<NT, E>(p, tile0, tb, warp, lane, red, best, targets);
  __syncthreads();  // red is reused by the next tiles
}

}  // namespace
}  // namespace merlin::cuda
