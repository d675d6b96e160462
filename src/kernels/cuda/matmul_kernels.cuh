// Device code of the batched products, last part: the item walk of a persistent CTA and the kernels
// (matmul_operands.cuh: arguments, rounds, staging; matmul_epilogues.cuh: reductions and epilogues).
// Included by matmul.cu only.
#pragma once
#include "kernels/cuda/matmul_epilogues.cuh"

namespace merlin::cuda {
namespace {

// The work items of a CTA: (tile set, round) pairs. A tile set is kWarps / split consecutive tiles, one per
// group of `split` warps; the CTA takes sets blockIdx.x, + gridDim.x, ..., each set's rounds in order, and the
// warps of a group split their tile's k. Every warp walks the same sequence (a warp whose chunks lie past
// the end of k, or whose tile lies past the last, loads and computes nothing), so the reduction, which
// synchronizes the CTA, comes at the same item for all warps. With split = 8 (long k) this is one tile per
// CTA at a time; short k (k = 768 in Q4_0 is 12 chunks: 3 rounds) gets split = 4 and two tiles at once, and
// because a round's chunks go to the same warp position either way, the sums are bit-identical.
// With G (matmul_swiglu) a set is half gate tiles (set * half + j) and half the same tiles of up (from
// glu_up_tile); its kernels are separate instances, so the plain products keep their registers.
template <bool G>
struct Items {  // 32-bit and division-free: the 32-token kernel is short of registers
  int rounds, n, c_first, stride, groups, group;
  __device__ Items(const MmArgs& p, int warp) {
    groups = kWarps >> p.split_log2;
    group = warp >> p.split_log2;
    stride = p.split * p.round;
    rounds = p.rounds;
    n = rounds * (p.sets_q + ((int)blockIdx.x < p.sets_r ? 1 : 0));
    c_first = (warp & (p.split - 1)) * p.round;
  }
};

// Where a warp is in its item sequence: tile set and round.
struct Cursor {
  int set, r;
  template <bool G>
  __device__ int tile(const MmArgs& p, const Items<G>& it) const {
    if constexpr (!G) return set * it.groups + it.group;
    const int half = it.groups >> 1, j = it.group & (half - 1);
    return set * half + j + (it.group < half ? 0 : p.glu_up_tile);
  }
  template <bool G>
  __device__ bool live(const MmArgs& p, const Items<G>& it) const {
    if constexpr (!G) return set * it.groups + it.group < (int)p.tiles;
    const int half = it.groups >> 1;
    return set * half + (it.group & (half - 1)) < p.glu_tiles;
  }
  template <bool G>
  __device__ int chunk(const Items<G>& it) const { return it.c_first + r * it.stride; }
  template <bool G>
  __device__ Cursor next(const Items<G>& it) const {
    return r + 1 == it.rounds ? Cursor{set + (int)gridDim.x, 0} : Cursor{set, r + 1};
  }
};

// Item i at cursor c: requests item i + 1 into `next`, computes `cur`, reduces the tiles after their last
// round, and moves c on.
// With X a round past the end of k (a warp whose share of a short row ends early) is skipped whole.
template <int F, int R, int NT, bool X, bool G, int H, int E>
__device__ __forceinline__ void run_item(const MmArgs& p, const XView& x, const Items<G>& it, int i, Cursor& c,
                                         const Round<F, R>& cur, Round<F, R>& next, int tb, int warp, int lane,
                                         float (&acc)[NT][4], float (*red)[NT * 4][32], unsigned long long* best,
                                         const float* tok_scale, const RopeSlot* targets) {
  const Cursor nx = c.next(it);
  if (i + 1 < it.n && nx.live(p, it) && (!X || nx.chunk(it) < p.n_chunks))
    load_round<F, R, X>(p, nx.tile(p, it), nx.chunk(it), lane, next);
  if (c.live(p, it) && (!X || c.chunk(it) < p.n_chunks))
    compute_round<F, R, NT, X, H>(p, x, cur, c.chunk(it), tb, lane >> 2, lane & 3, acc);
  if (c.r == it.rounds - 1) {
    reduce_tiles<NT, G, E>(p, c.set, (int64_t)c.set * it.groups, tb, warp, lane, acc, red, best, tok_scale, targets);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  }
  c = nx;
}

// The H kernels' 1 / rms per token of the CTA from a deferred RMSNorm's sums of squares (tokens past n get 1:
// their outputs are never written): a warp per token (token warp + 8 j), each summed as deferred_inv_rms sums
// (lane-strided, then a shuffle tree: the same bits), but with the loads of all of a warp's tokens issued
// together, so the prologue waits for one L2 round trip per 32 sums, not one per token (4 in a row at 32
// tokens, before the first product could start, when each warp took its tokens one after another). The
// prologue's barrier orders the writes. (Measured and dropped, twenty-ninth session: the last warp alone
// computing them where it has no chunks, the others passing a named barrier at their first reduction: base
// q4_0 x32 -22 %, perhaps from the register pressure of its 16 double accumulators; not checked.)
template <int NT>
__device__ __forceinline__ void tok_scales(const MmArgs& p, int tb, int warp, int lane, float* tok_scale) {
  constexpr int kPer = 8 * NT / kWarps > 0 ? 8 * NT / kWarps : 1;
  static_assert(8 * NT <= kWarps * kPer, "tok_scales: a warp's tokens");
  const int kb = p.rms_blocks;
  double ss[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) ss[j] = 0.0;
  for (int i = lane; i < kb; i += 32) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int tl = warp + kWarps * j;
      if (tl < 8 * NT && tb + tl < p.n) ss[j] += p.rms_part[(int64_t)(tb + tl) * kb + i];
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int tl = warp + kWarps * j;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], o);
    if (lane == 0 && tl < 8 * NT) tok_scale[tl] = tb + tl < p.n ? inv_rms(ss[j], p.k, p.rms_eps) : 1.f;
  }
}

// A persistent CTA over its items, groups of warps splitting each tile's k. Two rounds of registers alternate
// (the loop is unrolled by two, so no round is ever copied: a register copy would wait for the loads in
// flight and undo the overlap): the next round, possibly of the next tile, is always in flight while the
// current one computes, and the HBM latency is paid once per CTA, not once per tile. The first round is
// requested before pdl_wait (weights do not depend on the previous kernel), so under programmatic
// dependent launch the weight stream starts while the producer of x is still finishing. Activations come
// from shared memory when they fit.
// MinBlocks = 2 caps the kernel at 128 registers so two CTAs share an SM. The 32-token kernel (NT = 4)
// needs 136-182 registers uncapped and is built both ways: capped by default (batch-32 decode on the H200:
// base f16 24.4k -> 37.0k t/s, q4_0 37.0k -> 42.0k, macbook q4_0 2.89k -> 3.29k; docs/GPU.md), uncapped
// with MERLIN_CUDA_NT4_CAP=0 for A/B timing. R: chunks per round (p.round), 4 or 2 (short_rounds_fmt).
// G: the Glu epilogue (matmul_swiglu, reduce_glu); y is not written. H: half activations (half_operand), 1
// read from global memory, 2 staged in shared memory: a template value rather than p.stage_x, so that the
// compiler sees the staged plane's pointer come from shared memory only and loads it with ld.shared. E: the
// epilogues built in (Ep: any, or one kind; pick_epilogue in matmul.cu).
template <int F, int NT, int MinBlocks = NT == 4 ? 1 : 2, bool X = false, int R = kRound, bool G = false,
          int H = 0, int E = kEpAny>
__global__ void __launch_bounds__(kWarps * 32, MinBlocks) mm_kernel(MmArgs p) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ __align__(16) float red[kWarps][NT * 4][32];
  __shared__ unsigned long long best[8 * NT];  // matmul_argmax (the first reduction's barrier orders the zeros)
  __shared__ float tok_scale[H ? 8 * NT : 1];  // H with a deferred RMSNorm: its 1 / rms per token
  __shared__ RopeSlot targets[G ? 1 : 8 * NT];  // rope_on: each token's K/V slot and cos / sin row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tb = blockIdx.y * 8 * NT;
  if (threadIdx.x < 8 * NT) best[threadIdx.x] = 0ull;
  if (!G && argmax_in_pairs<E>(p)) {  // each owning lane's slots (reduce_argmax_pair); nothing else uses red yet
    unsigned long long* slots = argmax_slots<NT>(red, warp);
    for (int s = 0; s < 2 * NT; ++s) slots[s * 32 + lane] = 0ull;
  }
  const Items<G> it(p, warp);
  Round<F, R> ra{}, rb{};
  Cursor c{(int)blockIdx.x, 0};
  if (it.n > 0 && c.live(p, it) && (!X || c.chunk(it) < p.n_chunks))
    load_round<F, R, X>(p, c.tile(p, it), c.chunk(it), lane, ra);
  pdl_trigger();
  // The RoPE epilogue's per-token lookups (position, sequence, block table: two dependent loads), asked once
  // by the last warp, not per element after the k-loop (MmArgs::rope_early). Positions, sequences and block
  // tables are written before the step's first kernel, never by a kernel (as the attention kernel relies on
  // too), so they may be read before the wait; the first reduction's barrier orders the shared writes.
  const bool rope_warp = !G && ep_rope<E>(p) && warp == kWarps - 1 && lane < 8 * NT && tb + lane < p.n;
  auto look_up_rope = [&] {
    const RopeTarget t = rope_target(p.rope, tb + lane);
    targets[lane] = RopeSlot{t.slot, t.cs};
  };
  if (rope_warp && p.rope_early == 1) look_up_rope();
  if (rope_warp && p.ctx_l2 > 0) prefetch_token_context(p.rope, tb + lane, p.ctx_l2, p.ctx_l2_blocks);
  pdl_wait();
  if (rope_warp && p.rope_early == 2) look_up_rope();
  XView x{p.xfq, p.xfs, p.xfsum, p.xfhi, p.xflo, p.xfh, 0};
  const float* scale = nullptr;
  if constexpr (H) {
    if (p.rms_part) {
      tok_scales<NT>(p, tb, warp, lane, tok_scale);
      scale = tok_scale;  // the staging's barrier (or the first reduction's) orders these
    }
    if constexpr (H == 2) x = stage_x<F, true>(p, tb, min(8 * NT, p.n - tb), smem);
    else __syncthreads();
  } else {
    if (E == kEpAny && p.fuse_prep) x = stage_prep<F>(p, tb, min(8 * NT, p.n - tb), smem);
    else if (p.stage_x) x = stage_x<F>(p, tb, min(8 * NT, p.n - tb), smem);
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  for (int i = 0; i < it.n; i += 2) {
    run_item<F, R, NT, X, G, H, E>(p, x, it, i, c, ra, rb, tb, warp, lane, acc, red, best, scale, targets);
    if (i + 1 < it.n)
      run_item<F, R, NT, X, G, H, E>(p, x, it, i + 1, c, rb, ra, tb, warp, lane, acc, red, best, scale, targets);
  }
  if (!G && argmax_in_pairs<E>(p)) {  // no CTA barrier since the zeros of best: one before, one after
    __syncthreads();
    finish_argmax_slots<NT>(p, warp, lane, red, best);
    __syncthreads();
  }
  if (ep_argmax<E>(p) && threadIdx.x < 8 * NT && tb + (int)threadIdx.x < p.n && best[threadIdx.x] != 0ull)
    atomicMax(p.argmax + tb + threadIdx.x, best[threadIdx.x]);  // reduce_tiles ended with a barrier
}

// F32 weights (test models): a warp per row, up to 8 tokens per CTA row.
__global__ void mm_f32_kernel(MmArgs p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = blockIdx.x * (int64_t)kWarps + warp;
  const int tb = blockIdx.y * 8;
  pdl_trigger();
  pdl_wait();
  if (r >= p.n_out) return;
  const float* w = reinterpret_cast<const float*>(p.q) + r * p.k;
  for (int tok = tb; tok < min(tb + 8, p.n); ++tok) {
    const float* x = p.xf + (int64_t)tok * p.k;
    float s = 0.f;
    for (int64_t i = lane; i < p.k; i += 32) s += w[i] * x[i];
    s = warp_sum(s);
    if (lane == 0) {
      float* dst = p.y + (int64_t)tok * p.ldy + r;
      *dst = p.accumulate ? *dst + s : s;
    }
  }
}

}  // namespace
}  // namespace merlin::cuda
