// Single-token products (matvec1.h) over the fragment-ordered weights of repack.cu.
//
// At one token the general product's m16n8k32 runs 7 zero token columns and a full float epilogue per
// k-step, which makes the 4-bit formats instruction-bound. Here each lane does the one live column with
// __dp4a: its 16-byte chunk holds rows g and g + 8 of a tile (g = lane / 4) for the columns 4t..4t+3 and
// 16+4t..16+4t+3 (t = lane % 4) of one or more k-steps, so two dp4a per row and step consume the matching
// 8 activation bytes, which every CTA stages once in shared memory, permuted so that lane t reads them
// with one 8-byte load. Lanes keep per-row partial sums over their columns; the 4 lanes of a row meet by
// shuffles at the end of a tile.
//
// Integer sums stay per k-step (Q4_K, TQ2_0: per super-block) and are scaled once, like the CPU reference.
//
// Work split: a CTA of 8 warps handles 8 / S tiles at a time, S warps per tile splitting its chunks in
// rounds of 4 chunks (S in 1, 2, 4, 8, chosen on the host for the best balance over the resident CTAs: a
// 4096 x 16384 matrix has only 256 tiles, so 8 warps share each). As in matmul.cu the grid is persistent,
// two rounds alternate in registers (the loop is unrolled by two: a register copy would wait on the loads
// in flight), the first round is requested before pdl_wait, and the S partial sums of a row are added in
// shared memory in a fixed order: results are deterministic.
//
// F16/BF16 rows have their own kernel (matvec1_half.cu). With rope_on (matmul_rope_kv) the epilogue of a
// stacked QKV product applies RoPE and writes K/V to the cache itself (rope_kv.cuh).
//
// The Glu variant (matvec1_swiglu) multiplies a stacked [gate; up] matrix and writes silu(gate) * up in the
// down product's input format, so one-token steps need no SwiGLU kernel: a tile group takes its first half
// of tiles from the gate rows and the second half from the same rows of up (S <= 2, so a group holds at
// least 32 outputs, a whole Q8_0 block), and after the group's reduction its first warps run act_impl.cuh's
// swiglu() and emit() on them, the functions prep_kernel runs, on the same row sums: the same bits.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/sys.h"
#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/matvec1_rounds.cuh"
#include "kernels/cuda/matvec1_stage.cuh"
#include "kernels/cuda/rope_kv.cuh"

namespace merlin::cuda {
namespace {

// Where a warp is in its (tile group, round) sequence; every warp of the CTA walks the same number of items,
// so the per-group reduction (a CTA barrier) comes at the same item for all.
struct Cursor {
  int grp, r;  // group index (global) and round
};

// The next RMSNorm's input from 32 consecutive final rows y (one per lane, row = the lane's row), with a
// deferred scale (norm_block); a single-token reader completes it in stage_x (deferred_rms).
__device__ __forceinline__ void emit_norm(const Mv1Args& p, int64_t row, float y, float w) {
  const NormBlock b = norm_block(y, w);
  p.norm_out.q[row] = (int8_t)b.q;
  if ((threadIdx.x & 31) == 0) {
    p.norm_out.scale[row / 32] = b.scale;
    p.norm_out.sum[row / 32] = b.sum;
    p.norm_part[row / 32] = b.sum_sq;
  }
}

// Adds the S warps' row sums of the tile group in a fixed order and writes (or adds) the outputs.
// With rope_on, row r goes through rope_store with its pair partner r ^ 1 (same tile): lane ^ 4 holds it
// when a warp owns the tile, thread ^ 1 after the shared-memory reduction.
// With `early`, res0 / res1 hold the rows' previous values (prefetch_residual), read before the group's
// work instead of after it: the same sums, one memory round trip less at the end of a decode step's kernel.
// Norm: S >= 2 (the host sees to it), so whole warps hold 32 consecutive rows, one Q8_0 block of the next
// RMSNorm's input, which emit_norm writes from the rows' final values (nw: the thread's row's norm weight).
// Argmax: `best` is the largest key of the rows this thread wrote. R: the rows go through rope_store never
// (0), always (1, the RoPE instance) or when p.rope_on says so (2, instances with kRunRope).
template <int R>
__device__ __forceinline__ bool rope_rows(const Mv1Args& p) { return R == 1 || (R == 2 && p.rope_on); }

template <bool Norm, int W, bool Argmax, int R>
__device__ __forceinline__ void finish_group(const Mv1Args& p, int grp, int warp, int lane, float acc0, float acc1,
                                             float (*red)[16], const RopeTarget& at, bool early, float res0,
                                             float res1, float nw, unsigned long long& best) {
  // The 4 lanes of a row: xor shuffles give every lane the same sum (float addition is commutative).
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
  if (!Norm && S == 1) {  // a warp owns its tile: no barrier needed
    if (rope_rows<R>(p)) {
      const float w0 = __shfl_xor_sync(0xffffffffu, acc0, 4), w1 = __shfl_xor_sync(0xffffffffu, acc1, 4);
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if ((lane & 3) == 0 && r0 < p.n_out) rope_store(p.rope, p.y, r0, acc0, w0, at);
      if ((lane & 3) == 0 && r0 + 8 < p.n_out) rope_store(p.rope, p.y, r0 + 8, acc1, w1, at);
      return;
    }
    if ((lane & 3) == 0) {
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if (r0 < p.n_out) p.y[r0] = p.accumulate ? (early ? res0 : p.y[r0]) + acc0 : acc0;
      if (r0 + 8 < p.n_out) p.y[r0 + 8] = p.accumulate ? (early ? res1 : p.y[r0 + 8]) + acc1 : acc1;
      if constexpr (Argmax) {  // not accumulating (the host sees to it)
        if (r0 < p.n_out) best = max(best, argmax_key(acc0, r0));
        if (r0 + 8 < p.n_out) best = max(best, argmax_key(acc1, r0 + 8));
      }
    }
    return;
  }
  if ((lane & 3) == 0) {
    red[warp][lane >> 2] = acc0;
    red[warp][(lane >> 2) + 8] = acc1;
  }
  __syncthreads();
  const int n_act = tpg * 16;
  if ((int)threadIdx.x < ((n_act + 31) & ~31)) {  // whole warps, for the partner shuffle
    const bool act = (int)threadIdx.x < n_act;
    const int ts = threadIdx.x >> 4, rr = threadIdx.x & 15;
    float v = 0.f;
    if (act)
      for (int s = 0; s < S; ++s) v += red[ts * S + s][rr];
    const int64_t row = ((int64_t)grp * tpg + ts) * 16 + rr;
    if (rope_rows<R>(p)) {
      const float w = __shfl_xor_sync(0xffffffffu, v, 1);
      if (act && row < p.n_out) rope_store(p.rope, p.y, row, v, w, at);
    } else if (Norm) {
      const bool valid = act && row < p.n_out;  // n_out % 32 == 0: whole warps valid or not
      if (valid) {
        const float y = p.accumulate ? (early ? res0 : p.y[row]) + v : v;
        p.y[row] = y;
        emit_norm(p, row, y, nw);
      }
    } else if (act && row < p.n_out) {
      p.y[row] = p.accumulate ? (early ? res0 : p.y[row]) + v : v;
      if constexpr (Argmax) best = max(best, argmax_key(v, row));
    }
  }
  // No second barrier: the next group uses the other half of the (double) red buffer, and a warp can only
  // write that half again after the next group's barrier, which every reader of this half has passed.
}

// Glu variant: the group's gate tiles are slots 0 .. tpg/2 - 1, the matching up tiles the others. Output o of
// the group (gate row and up row o) is summed in the order finish_group sums a row, then emitted by whole
// warps (32 consecutive outputs: one Q8_0 block).
__device__ __forceinline__ void finish_glu(const Mv1Args& p, int grp, int warp, int lane, float acc0, float acc1,
                                           float (*red)[16]) {
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
  acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
  acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
  if ((lane & 3) == 0) {
    red[warp][lane >> 2] = acc0;
    red[warp][(lane >> 2) + 8] = acc1;
  }
  __syncthreads();
  const int S = 1 << p.lsplit, half = (kWarps >> p.lsplit) >> 1;
  if ((int)threadIdx.x >= half * 16) return;  // 32 or 64 threads: whole warps
  const int ts = threadIdx.x >> 4, rr = threadIdx.x & 15;
  float g, u;
  if (S == 1) {  // finish_group takes a lone warp's sum as it is
    g = red[ts][rr];
    u = red[ts + half][rr];
  } else {
    g = 0.f, u = 0.f;
    for (int s = 0; s < S; ++s) g += red[ts * S + s][rr];
    for (int s = 0; s < S; ++s) u += red[(ts + half) * S + s][rr];
  }
  const int64_t o = ((int64_t)grp * half + ts) * 16 + rr;
  const bool valid = o < (int64_t)p.glu_tiles * 16;  // whole blocks of 32: ffn % 32 == 0
  const float v = valid ? swiglu(g, u) : 0.f;
  ActBuf out = p.glu_out;
  switch (out.kind) {
    case ActKind::Q8_0: emit<(int)ActKind::Q8_0>(v, valid, 0, o, out); break;
    case ActKind::F16: emit<(int)ActKind::F16>(v, valid, 0, o, out); break;
    case ActKind::BF16: emit<(int)ActKind::BF16>(v, valid, 0, o, out); break;
    default: emit<(int)ActKind::F32>(v, valid, 0, o, out); break;
  }
}

// The previous values of the rows finish_group writes for tile group grp, in the threads that write them.
template <int W>
__device__ __forceinline__ void prefetch_residual(const Mv1Args& p, int grp, int warp, int lane, float& res0,
                                                  float& res1) {
  const int S = 1 << p.lsplit, tpg = W >> p.lsplit;
  if (S == 1) {
    if ((lane & 3) == 0) {
      const int64_t r0 = ((int64_t)grp * tpg + warp) * 16 + (lane >> 2);
      if (r0 < p.n_out) res0 = p.y[r0];
      if (r0 + 8 < p.n_out) res1 = p.y[r0 + 8];
    }
  } else if ((int)threadIdx.x < tpg * 16) {
    const int64_t row = ((int64_t)grp * tpg + (threadIdx.x >> 4)) * 16 + (threadIdx.x & 15);
    if (row < p.n_out) res0 = p.y[row];
  }
}

__device__ __forceinline__ void advance(const Mv1Args& p, Cursor& c) {
  if (++c.r == p.rounds) {
    c.r = 0;
    c.grp += gridDim.x;
  }
}

// CTAs per SM the register budget must allow (MB): 2 (128 registers) for every format. Measured on the H200
// (cuda_matvec, 2026-11-29), 3 CTAs at 80 registers streamed less for each 4-bit format, e.g. 4096 x 16384:
// Q4_0 55 % against 69 %, Q4_K 64 % / 76 %, MXFP4 40 % / 53 % of the copy bandwidth, and Q8_0 spills at 80.
// Both variants are compiled so that MERLIN_CUDA_MV1=2 or =3 can force one for timing.
__host__ __device__ constexpr int min_blocks(int) { return 2; }

// The norm weight of the row this thread finishes in tile group grp (finish_group's thread-per-row order).
template <int W>
__device__ __forceinline__ float norm_weight(const Mv1Args& p, int grp) {
  const int tpg = W >> p.lsplit;
  if ((int)threadIdx.x >= tpg * 16) return 0.0f;
  const int64_t row = ((int64_t)grp * tpg + (threadIdx.x >> 4)) * 16 + (threadIdx.x & 15);
  return row < p.n_out ? __ldg(p.norm_w + row) : 0.0f;
}

// Warps per CTA: the Norm variant's groups must hold whole Q8_0 blocks (2 tiles, S <= W / 2); 16 warps let
// it split each tile over 8 warps as the plain product does for short rows (base) and small matrices that
// cover the SMs once (macbook's Wo and down), at 1 CTA per SM instead of 2.
__host__ __device__ constexpr int warps_of(int epi) { return epi == kEpiNorm ? kNormWarps : kWarps; }

// Argmax: the CTA's largest key (a warp shuffle tree, then warp 0 over the warps), one atomicMax per CTA.
template <int W>
__device__ __forceinline__ void publish_argmax(const Mv1Args& p, unsigned long long best) {
  __shared__ unsigned long long warp_best[W];
  for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < W; ++w) best = max(best, warp_best[w]);
    if (best != 0ull) atomicMax(p.argmax, best);
  }
}

// G: the row is staged as SwiGLU of the gate/up row (stage_x). Run: what the instance decides at run time,
// kRunRope (RoPE by p.rope_on) and kRunGlu (the SwiGLU staging by p.glu_src); kRunAll is the general instance
// every launch took before the thirty-first session (instance families: pick_instance).
enum Run : int { kRunNone = 0, kRunRope = 1, kRunGlu = 2, kRunAll = 3 };
template <int F, int MB, int E, bool X, bool G, int Run>
__global__ void __launch_bounds__(warps_of(E) * 32, MB) mv1_kernel(Mv1Args p) {
  constexpr bool Glu = E == kEpiGlu, Norm = E == kEpiNorm, Argmax = E == kEpiArgmax;
  constexpr int R = E == kEpiRope ? 1 : (Run & kRunRope) ? 2 : 0;
  unsigned long long best = 0ull;
  constexpr int W = warps_of(E);
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[2][W][16];
  constexpr bool kCs = R != 0 && MB < 3;  // not at 3 CTAs per SM (80 registers): the copy made it spill
  __shared__ __align__(16) float cs_rows[kCs ? W : 1][kCs ? kRopeCsMax : 1];  // rope_cs: each warp's copy of the row
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int S = 1 << p.lsplit;
  const int slot = warp >> p.lsplit, sub = warp & (S - 1);
  const int tpg = W >> p.lsplit;
  // Items of this CTA: groups blockIdx.x, + gridDim.x, ...; rounds 0 .. rounds - 1 of each.
  // (grid <= groups, so every CTA has a group; the launch divides, not each CTA before its first load)
  const int my_groups = p.groups_q + ((int)blockIdx.x < p.groups_r ? 1 : 0);
  const int n_items = my_groups * p.rounds;
  const int half = tpg >> 1;
  auto tile_of = [&](const Cursor& c) {
    if constexpr (Glu) return slot < half ? c.grp * half + slot : p.glu_up_tile + c.grp * half + slot - half;
    return c.grp * tpg + slot;
  };
  auto chunk_of = [&](const Cursor& c) { return (sub + c.r * S) * kRound; };
  auto nc_of = [&](const Cursor& c) {
    if constexpr (Glu) return c.grp * half + (slot < half ? slot : slot - half) < p.glu_tiles ? p.n_chunks : 0;
    return tile_of(c) < p.tiles ? p.n_chunks : 0;
  };

  // The first round is requested before pdl_wait (weights do not depend on earlier kernels). Requesting
  // the second one there too made ptxas spill in every variant.
  Round<F> ra{}, rb{};
  Cursor cur{(int)blockIdx.x, 0};
  if (n_items > 0) load_round<F, X>(p, tile_of(cur), chunk_of(cur), nc_of(cur), lane, ra);
  RopeTarget at{};
  if (rope_rows<R>(p)) {
    at = rope_target(p.rope);
    if (warp == W - 1) prefetch_kv_context(p.rope, lane);
    if constexpr (kCs) {
      if (p.rope_cs) copy_cs_row(at, p.rope.n_rot, cs_rows[warp], lane);
    }
  }
  float nw = Norm && n_items > 0 ? norm_weight<W>(p, (int)blockIdx.x) : 0.0f;  // the first group's, like its first round
  // L2 prefetch (lane 0) of the items after the first, which are loaded into registers only one ahead.
  if (p.l2_items > 0 && lane == 0) {
    Cursor c = cur;
    for (int i = 1; i < n_items && i <= p.l2_items; ++i) {
      advance(p, c);
      prefetch_round<F>(p, tile_of(c), chunk_of(c), nc_of(c));
    }
  }
  pdl_trigger();
  pdl_wait();
  bool early = !Glu && p.accumulate && p.resid_early && n_items > 0;
  float res0 = 0.f, res1 = 0.f;
  if (early) prefetch_residual<W>(p, (int)blockIdx.x, warp, lane, res0, res1);
  stage_x<F, W, G, (Run & kRunGlu) != 0>(p, smem);
  const uint2* xq = reinterpret_cast<const uint2*>(smem);
  const float* xs = reinterpret_cast<const float*>(smem + p.k);
  float acc0 = 0.f, acc1 = 0.f;
  int parity = 0;
  // Item i: request item i + 1 into `next`, compute `now`, finish the tile group after its last round.
  auto item = [&](int i, const Round<F>& now, Round<F>& next) {
    Cursor nx = cur;
    advance(p, nx);
    if (i + 1 < n_items) load_round<F, X>(p, tile_of(nx), chunk_of(nx), nc_of(nx), lane, next);
    compute_round<F, X>(p, now, chunk_of(cur), nc_of(cur), xq, xs, t, acc0, acc1);
    if (cur.r == p.rounds - 1) {
      if constexpr (Glu) finish_glu(p, cur.grp, warp, lane, acc0, acc1, red[parity]);
      else finish_group<Norm, W, Argmax, R>(p, cur.grp, warp, lane, acc0, acc1, red[parity], at, early, res0, res1, nw, best);
      early = false;
      if constexpr (Norm) {
        if (i + 1 < n_items) nw = norm_weight<W>(p, nx.grp);  // requested before the next group's rounds
      }
      parity ^= 1;
      acc0 = acc1 = 0.f;
    }
    cur = nx;
  };
  for (int i = 0; i < n_items; i += 2) {
    item(i, ra, rb);
    if (i + 1 < n_items) item(i + 1, rb, ra);
  }
  if constexpr (Argmax) publish_argmax<W>(p, best);
}

// Staged activation bytes (stage_x): codes and scales, for Q4_0 16 bytes per 8 codes.
template <int F>
size_t smem_bytes(int64_t k) { return F == kQ4_0 ? (size_t)k * 2 : (size_t)k + (size_t)(k / 32) * 4; }
// With a SwiGLU row (stage_glu): the scratch Q8_0 row after the staged bytes, 16-byte aligned.
template <int F>
size_t glu_scratch_off(int64_t k) { return (smem_bytes<F>(k) + 15) / 16 * 16; }
template <int F>
size_t smem_bytes_glu(int64_t k) { return glu_scratch_off<F>(k) + (size_t)k + (size_t)(k / 32) * 4; }

int g_sm_count = 0;
int g_split_override = -1;  // set_matvec1_split (tests): log2 of the warps per tile, -1 = chosen per matrix
// The kernels built per format (mv1_kernel's parameters): the register budget MB (3 only for non-exact plain
// products, forced by MERLIN_CUDA_MV1=3; 1 for the Norm epilogue's 16 warps, 2 otherwise), the epilogue E,
// exact rounds X, G: the row staged as SwiGLU of the gate/up row (the plain and Norm products of the formats
// that read Q8_0 rows: the down product), and Run.
//
// Which instances a decode step runs matters more than what each costs alone: the H200 keeps the code of only
// a few such kernels hot, so each distinct kernel a layer runs adds instruction fetches to every kernel of the
// layer (thirty-second session, base q4_0 tg128: the QKV product on an identical copy of the kernel its
// gate/up product runs, 4,988 -> 4,228 t/s; the Wo product on a copy of the down product's, 4,371). Three
// families (pick_instance, docs/GPU.md "Instance families"):
//  - lean: one instance per epilogue and staging (RoPE, plain, Norm, Norm SwiGLU-staged, ...): the least code
//    per kernel, the most kernels per layer (base: 4);
//  - mid: the QKV and the plain gate/up products share one instance (RoPE at run time), the Wo and down
//    products another (the SwiGLU staging at run time): 2 per layer, each smaller than a general one;
//  - general (kRunAll): RoPE and the staging at run time in every instance.
struct Key {  // the instance a launch takes (kernel_of)
  int mb, epi;
  bool x, g;
  int run;
};
constexpr int kVariants = 2 * kEpis * 2 * 2 * 4;
constexpr int variant_of(const Key& k) {
  return ((((k.mb == 3 ? 1 : 0) * kEpis + k.epi) * 2 + (k.x ? 1 : 0)) * 2 + (k.g ? 1 : 0)) * 4 + k.run;
}

// CTAs per SM of each variant for rows up to (bucket + 1) * kKBucket, [F][variant][bucket].
int g_resident[8][kVariants][kBuckets] = {};

template <int F, int MB, int E, bool X, bool G, int Run>
void prepare_one() {
  const auto kernel = mv1_kernel<F, MB, E, X, G, Run>;
  MERLIN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes_glu<F>(kMaxK)));
  const int v = variant_of(Key{MB, E, X, G, Run});
  for (int b = 0; b < kBuckets; ++b)
    MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[F][v][b], kernel, warps_of(E) * 32,
                                                                     smem_bytes<F>((b + 1) * kKBucket)));
}

// Whether an instance of epilogue e and run-time set run is also built with MB = 3: the plain ones, not
// kRunRope (pick_instance sends MB = 3 launches of the mid family to the general instance).
constexpr bool builds_mb3(int e, int run) { return e == kEpiPlain && run != kRunRope; }

// An instance with both X, and its MB = 3 one where builds_mb3.
template <int F, int E, bool G, int Run>
void prepare_instance() {
  constexpr int MB = E == kEpiNorm ? 1 : 2;
  prepare_one<F, MB, E, false, G, Run>();
  prepare_one<F, MB, E, true, G, Run>();
  if constexpr (builds_mb3(E, Run)) prepare_one<F, 3, kEpiPlain, false, G, Run>();
}

template <int F>
void prepare() {
  prepare_instance<F, kEpiPlain, false, kRunNone>();  // lean
  prepare_instance<F, kEpiRope, false, kRunNone>();
  prepare_instance<F, kEpiGlu, false, kRunNone>();
  prepare_instance<F, kEpiArgmax, false, kRunNone>();
  prepare_instance<F, kEpiNorm, false, kRunNone>();
  if constexpr (reads_q8_0<F>()) {
    prepare_instance<F, kEpiPlain, true, kRunNone>();
    prepare_instance<F, kEpiNorm, true, kRunNone>();
  }
  prepare_instance<F, kEpiPlain, false, kRunRope>();  // mid
  prepare_instance<F, kEpiNorm, false, kRunGlu>();
  prepare_instance<F, kEpiPlain, false, kRunAll>();  // general
  prepare_instance<F, kEpiGlu, false, kRunAll>();
  prepare_instance<F, kEpiArgmax, false, kRunAll>();
  prepare_instance<F, kEpiNorm, false, kRunAll>();
}

using Mv1Kernel = void (*)(Mv1Args);

template <int F, int E, bool G, int Run>
Mv1Kernel instance(int mb, bool x) {
  constexpr int MB = E == kEpiNorm ? 1 : 2;
  if constexpr (builds_mb3(E, Run)) {
    if (mb == 3) return mv1_kernel<F, 3, kEpiPlain, false, G, Run>;
  }
  return x ? mv1_kernel<F, MB, E, true, G, Run> : mv1_kernel<F, MB, E, false, G, Run>;
}

// The instance prepare() built for k (pick_instance only asks for those).
template <int F>
Mv1Kernel kernel_of(const Key& k) {
  switch (k.run) {
    case kRunRope: return instance<F, kEpiPlain, false, kRunRope>(k.mb, k.x);
    case kRunGlu: return instance<F, kEpiNorm, false, kRunGlu>(k.mb, k.x);
    case kRunAll:
      switch (k.epi) {
        case kEpiGlu: return instance<F, kEpiGlu, false, kRunAll>(k.mb, k.x);
        case kEpiNorm: return instance<F, kEpiNorm, false, kRunAll>(k.mb, k.x);
        case kEpiArgmax: return instance<F, kEpiArgmax, false, kRunAll>(k.mb, k.x);
        default: return instance<F, kEpiPlain, false, kRunAll>(k.mb, k.x);
      }
    default: break;
  }
  if constexpr (reads_q8_0<F>()) {
    if (k.g) return k.epi == kEpiNorm ? instance<F, kEpiNorm, true, kRunNone>(k.mb, k.x)
                                      : instance<F, kEpiPlain, true, kRunNone>(k.mb, k.x);
  }
  switch (k.epi) {
    case kEpiGlu: return instance<F, kEpiGlu, false, kRunNone>(k.mb, k.x);
    case kEpiNorm: return instance<F, kEpiNorm, false, kRunNone>(k.mb, k.x);
    case kEpiArgmax: return instance<F, kEpiArgmax, false, kRunNone>(k.mb, k.x);
    case kEpiRope: return instance<F, kEpiRope, false, kRunNone>(k.mb, k.x);
    default: return instance<F, kEpiPlain, false, kRunNone>(k.mb, k.x);
  }
}

// The family every single-token product of weights of format f over rows of length k takes (k < 3,072: base's
// rows). H200 tg128 at batch 1, lean / mid / general (docs/BENCHMARKS.md, "thirty-second session"): base q4_0
// 4,600 / 5,517 / 4,953 t/s, q8_0 4,847 / 5,011 / 4,525, mxfp4 3,723 / 4,386 / 4,231, q4_k 3,821 / 3,792 /
// 3,786, tq2_0 3,899 / 4,009 / 4,005; iphone q4_0 1,287 / 1,234 / 1,212, q8_0 869 / 855 / 844, q4_k 1,068 /
// 1,047 / 1,047, mxfp4 1,004 / 978 / 986, tq2_0 1,381 / 1,399 / 1,399; macbook q4_0 762 / 756 / 743, q8_0 466 /
// 464 / 462. On macbook the gate/up product runs the SwiGLU epilogue, so the lean family already has three
// product kernels per layer, the Wo and down products sharing the lean Norm instance; iphone's gate/up (S = 4,
// too many warps per tile for the epilogue) is a plain product followed by a SwiGLU kernel, where the mid
// family's sharing of the plain instance with QKV lost all the same.
enum Family : int { kLean = 0, kMid = 1, kGeneral = 2 };
int family_default(int f, int64_t k) {
  if (f == kQ4_0 || f == kQ8_0 || f == kMXFP4) return k < 3072 ? kMid : kLean;
  if (f == kQ4_K) return kLean;
  return kGeneral;
}
// MERLIN_CUDA_MV1_FAMILY=lean|mid|general (read once) overrides family_default for every product.
int g_family_override = -1;  // set_matvec1_instances (tests)
int family_of(int f, int64_t k) {
  static const int env = env_is("MERLIN_CUDA_MV1_FAMILY", "lean")      ? kLean
                         : env_is("MERLIN_CUDA_MV1_FAMILY", "mid")     ? kMid
                         : env_is("MERLIN_CUDA_MV1_FAMILY", "general") ? kGeneral
                                                                       : -1;
  return g_family_override >= 0 ? g_family_override : env >= 0 ? env : family_default(f, k);
}

// The instance for a launch with register budget mb, epilogue epi, exact rounds x and a SwiGLU-staged row g.
// A general or mid instance's RoPE epilogue is its plain one's run-time branch; the mid family's other
// launches (argmax, the SwiGLU epilogue, a staged plain product, MB = 3) take the lean or general ones.
Key pick_instance(int f, int mb, int epi, bool x, bool g, int64_t k) {
  const int fam = family_of(f, k);
  const bool plain_like = epi == kEpiRope || (epi == kEpiPlain && !g);
  if (fam == kGeneral || (fam == kMid && plain_like && mb == 3))
    return Key{mb, epi == kEpiRope ? kEpiPlain : epi, x, false, kRunAll};
  if (fam == kMid && plain_like) return Key{mb, kEpiPlain, x, false, kRunRope};
  if (fam == kMid && epi == kEpiNorm) return Key{mb, kEpiNorm, x, false, kRunGlu};
  return Key{mb, epi, x, g, kRunNone};
}

// The quantized formats the dp4a kernels take (F16/BF16 rows have matvec1_half.cu).
constexpr bool has_mv1_kernel(int f) { return f == kQ8_0 || f == kQ4_0 || f == kMXFP4 || f == kQ4_K || f == kTQ2; }

// MERLIN_CUDA_MV1 (read once): 0 = off (the general product runs), 2 / 3 = force that register budget
// (CTAs per SM), unset or anything else = on with the per-format default.
int mv1_mode() {
  static const int mode = env_is("MERLIN_CUDA_MV1", "0")   ? 0
                          : env_is("MERLIN_CUDA_MV1", "2") ? 2
                          : env_is("MERLIN_CUDA_MV1", "3") ? 3
                                                           : 1;
  return mode;
}

// Whether the X kernels apply: every round that starts is whole. Q8_0 and TQ2_0 keep the checked kernel: their
// exact ones spilled until the eleventh session's staging change and, spill-free since, won and lost by shape
// (H200 tg128, checked / exact: base q8_0 4,420-4,443 / 4,486-4,501, macbook q8_0 445 / 433, base tq2_0 3,737 /
// 3,506-3,524, macbook tq2_0 777 / 793).
bool exact_all() {  // MERLIN_CUDA_MV1_EXACT_ALL=1 (read once): Q8_0 and TQ2_0 too (A/B timing)
  static const bool on = env_is("MERLIN_CUDA_MV1_EXACT_ALL", "1");
  return on;
}
bool exact_rounds(int f, const Geometry& geo) {
  return (exact_all() || (f != kQ8_0 && f != kTQ2)) && whole_rounds(f, geo.n_chunks, geo.n_steps, kRound);
}

// MERLIN_CUDA_MV1_RESID=0 (read once): accumulating products read the residual after their work (A/B timing).
bool resid_early() {
  static const bool on = !env_is("MERLIN_CUDA_MV1_RESID", "0");
  return on;
}

// MERLIN_CUDA_MV1_STAGE=0 (read once): stage_x sums the deferred norm before it requests the row (A/B timing).
bool x_early() {
  static const bool on = !env_is("MERLIN_CUDA_MV1_STAGE", "0");
  return on;
}

// MERLIN_CUDA_MV1_EXACT=0 (read once): always the predicated kernels (A/B timing; same results).
bool exact_off() {
  static const bool off = env_is("MERLIN_CUDA_MV1_EXACT", "0");
  return off;
}

// MERLIN_CUDA_MV1_L2=N (read once, default 2): rounds after the first that each warp of a single-token
// product prefetches into L2 before pdl_wait (prefetch_round); 0 turns it off. Measured on the H200 (tg128,
// 2026-11-30): 2 gains 2 % on macbook q4_0 and 2.4 % on iphone q4_0 (base: within noise), 1 a little less, 4
// nothing, 8 and 16 lose 4-9 %; prefetching a fixed 2-4 items ahead inside the loop instead lost 7-12 %
// (one bulk request per round or per-lane prefetch instructions alike). docs/GPU.md, "L2 prefetch".
int l2_items(const Matrix& w) {
  static const int n = (int)std::clamp(env_int("MERLIN_CUDA_MV1_L2", 2), 0L, 64L);
  // The bulk prefetch needs 16-byte aligned addresses; weights and scales are allocated so, but check.
  const bool aligned = reinterpret_cast<uintptr_t>(w.q) % 16 == 0 && reinterpret_cast<uintptr_t>(w.s) % 16 == 0;
  return aligned ? n : 0;
}

// Whether ties go to the split that keeps more warps busy, for weights of format f and the Glu variant or
// not: not for TQ2_0, whose rounds are short, nor for the Glu variant (macbook's gate/up: S = 2 against 1).
// H200 tg128, 2026-12-01, with the rule / without: iphone tq2_0 1,370-1,372 / 1,413-1,415 t/s, macbook tq2_0
// 851-852 / 852-853, base tq2_0 3,988-3,990 / 3,984; for the Glu variant macbook q4_0 750.1-751.3 /
// 752.8-753.4, q4_k 587.9-588.0 / 588.4-589.1 (iphone unchanged). It pays for iphone's QKV (S = 4 against
// 2): q4_0 1,228 against 1,213, q4_k 1,049 against 1,031. MERLIN_CUDA_MV1_TIE=0 / =1 (read once): never /
// every format and variant (A/B timing).
bool tie_by_warps(int f, bool glu) {
  static const int mode = env_is("MERLIN_CUDA_MV1_TIE", "0") ? 0 : env_is("MERLIN_CUDA_MV1_TIE", "1") ? 1 : 2;
  return mode == 1 || (mode == 2 && f != kTQ2 && !glu);
}

// Warps per tile S = 2^lsplit: the one that minimizes the busiest CTA's work, (tile groups per CTA) x
// (rounds per warp and tile); ties go to the split that keeps more warps streaming at once (iphone's QKV:
// 144 CTAs at S = 2 or 264 at S = 4, both 6 rounds per warp), then to the smaller S (fewer reductions and
// barriers). The Glu variant's groups cover tpg / 2 output tiles (and as many up tiles), and S <= 2; the
// Norm variant's CTAs have 16 warps and 2 <= S <= 8 (a group is 32 to 128 rows, whole Q8_0 blocks in whole
// warps of finish_group). H200 tg128 (2026-11-30): the busy-warps tie gains iphone q4_0 0.3-0.6 %; base,
// macbook and the Q8_0 models choose as before.
void choose_split(Mv1Args& p, int64_t ctas, bool tie, bool glu, bool norm = false) {
  const int W = norm ? kNormWarps : kWarps, lo = norm ? 1 : 0, hi = glu ? 1 : 3;
  auto per_group = [&](int l) { return glu ? (W >> l) / 2 : W >> l; };
  const int64_t tiles = glu ? p.glu_tiles : p.tiles;
  int ls = lo;
  int64_t best = INT64_MAX, best_busy = 0;
  for (int l = lo; l <= hi; ++l) {
    const int64_t groups = (tiles + per_group(l) - 1) / per_group(l);
    const int64_t rounds = (p.n_chunks + (kRound << l) - 1) / (kRound << l);
    const int64_t cost = (groups + ctas - 1) / ctas * rounds;
    // Warps with chunks to stream at once: resident CTAs x tiles per group x warps per tile that get a round.
    const int64_t busy = std::min(groups, ctas) * (W >> l) *
                         std::min<int64_t>(1 << l, (p.n_chunks + kRound - 1) / kRound);
    if (cost < best || (tie && cost == best && busy > best_busy)) best = cost, best_busy = busy, ls = l;
  }
  if (g_split_override >= 0) ls = std::clamp(g_split_override, lo, hi);
  p.lsplit = ls;
  p.rounds = (p.n_chunks + (kRound << ls) - 1) / (kRound << ls);
  p.groups = (int)((tiles + per_group(ls) - 1) / per_group(ls));
}

// The shared-memory carveout (percent) a single-token kernel of format f over rows of length k asks for, -1
// for the driver's choice (MERLIN_CUDA_CARVEOUT_MV1 overrides it: -1 restores the driver's choice). Q8_0 rows
// shorter than 3,072 (base's, the mid family's instances: family_default) take 50 % (114 KB). H200 tg128
// (docs/BENCHMARKS.md, thirty-seventh session), driver's choice / 50 %: base q8_0 4,989-4,993 / 5,368-5,370
// (+7.5 %; 14-100 % all gain, with programmatic launch off none does: the gain is the kernels' overlap with
// their neighbours), iphone q8_0 878.5-879.1 / 864.5-868.3 (-1.4 %), macbook q8_0 464.4 / 464.7; base q4_0
// loses at 14 % and 0 % costs iphone q4_0 9.5 %. Q4_K's short rows take 50 % too (thirty-eighth session, driver
// / 50 / 100 %: base q4_k 3,848 / 4,017 / 3,909 t/s); MXFP4 and TQ2_0 do not care (base mxfp4 4,451 / 4,446 /
// 4,450, tq2_0 4,185 / 4,181 / 4,188), so they and Q4_0 keep the driver's choice. The attribute belongs to the
// kernel, so the first launch of an instance sets it for all.
int mv1_carveout(int f, int64_t k) {
  const int env = carveout_mv1_pct();
  if (env != kCarveoutUnset) return env;
  return (f == kQ8_0 || f == kQ4_K) && k < 3072 ? 50 : -1;
}

// What a launch adds to the plain product: RoPE + K/V write, the SwiGLU output, or the next RMSNorm's input.
struct Extra {
  const RopeKvArgs* rope = nullptr;
  const ActBuf* glu_out = nullptr;
  int64_t glu_up_row = 0;
  const float* norm_w = nullptr;
  const ActBuf* norm_out = nullptr;
  double* norm_part = nullptr;
  unsigned long long* argmax = nullptr;
};

template <int F>
void launch(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, Stream stream,
            const Extra& e) {
  const Geometry geo = geometry(F, w.rows, w.k);
  Mv1Args p{};
  p.q = w.q;
  p.s = w.s;
  p.k = w.k;
  p.n_steps = (int)geo.n_steps;
  p.n_chunks = (int)geo.n_chunks;
  p.n_super = (int)geo.n_super;
  p.tiles = (int)geo.tiles;
  p.xq = x.q;
  p.xs = x.scale;
  p.rms_part = x.rms_part;
  p.rms_eps = x.rms_eps;
  p.glu_src = x.glu_src;
  p.glu_offset = x.glu_offset;
  p.glu_scratch = (int64_t)glu_scratch_off<F>(w.k);
  p.y = d_y;
  p.n_out = n_out;
  p.accumulate = accumulate ? 1 : 0;
  p.resid_early = resid_early() ? 1 : 0;
  p.x_early = x_early() ? 1 : 0;
  p.rope_on = e.rope ? 1 : 0;
  if (e.rope) p.rope = *e.rope;
  p.rope_cs = e.rope && rope_cs_pays(*e.rope) ? 1 : 0;
  if (e.glu_out) {
    p.glu_out = *e.glu_out;
    p.glu_up_tile = (int)(e.glu_up_row / 16);
    p.glu_tiles = (int)(n_out / 16);
  }
  if (e.norm_out) {
    p.norm_w = e.norm_w;
    p.norm_out = *e.norm_out;
    p.norm_part = e.norm_part;
  }
  p.argmax = e.argmax;
  p.l2_items = l2_items(w);
  const int epi = e.glu_out ? kEpiGlu : e.norm_out ? kEpiNorm : e.argmax ? kEpiArgmax : e.rope ? kEpiRope : kEpiPlain;
  const int mb = epi == kEpiNorm ? 1 : epi != kEpiPlain || mv1_mode() < 2 ? min_blocks(F) : mv1_mode();
  const bool exact = mb != 3 && exact_rounds(F, geo) && !exact_off();
  const Key key = pick_instance(F, mb, epi, exact, x.glu_src != nullptr, w.k);
  const int per_sm = std::max(1, g_resident[F][variant_of(key)][(w.k - 1) / kKBucket]);
  const int64_t ctas = (int64_t)g_sm_count * per_sm;
  choose_split(p, ctas, tie_by_warps(F, epi == kEpiGlu), epi == kEpiGlu, epi == kEpiNorm);
  const unsigned grid = (unsigned)std::min<int64_t>(p.groups, ctas);
  p.groups_q = p.groups / (int)grid;
  p.groups_r = p.groups % (int)grid;
  const size_t smem = x.glu_src ? smem_bytes_glu<F>(w.k) : smem_bytes<F>(w.k);
  const Mv1Kernel kernel = kernel_of<F>(key);
  apply_carveout(reinterpret_cast<const void*>(kernel), mv1_carveout(F, w.k));
  launch_pdl(kernel, dim3(grid), dim3(warps_of(epi) * 32), smem, stream, p);
  check_launch("matvec1");
}

}  // namespace

namespace {

bool dispatch(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream,
              const Extra& e = {}) {
  if (mv1_mode() == 0 || w.k > kMaxK || w.k <= 0 || g_sm_count == 0) {
    MERLIN_CHECK(!x.rms_part && !x.glu_src, "matvec1: a row with a deferred RMSNorm or SwiGLU needs the single-token kernels");
    return false;
  }
  MERLIN_CHECK(!x.rms_part || (x.kind == ActKind::Q8_0 && x.rms_block == 32),
               "matvec1: deferred RMSNorm on a non-Q8_0 row, or in sums per 16 outputs");
  MERLIN_CHECK(!x.glu_src || (matvec1_glu_fits(w) && !x.rms_part && !e.glu_out && !e.argmax && !e.rope),
               "matvec1: a SwiGLU row for a product that cannot compute it while staging");
  MERLIN_CHECK(!e.rope || (!e.glu_out && !e.norm_out && !e.argmax && !accumulate),
               "matvec1: RoPE is the stacked QKV product's only epilogue");
  const int64_t n_out = std::min(n_out_rows, w.rows);
  if (n_out <= 0) return true;
  switch (w.fmt) {
    case kQ8_0: launch<kQ8_0>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kQ4_0: launch<kQ4_0>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kMXFP4: launch<kMXFP4>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kQ4_K: launch<kQ4_K>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kTQ2: launch<kTQ2>(w, x, d_y, n_out, accumulate, stream, e); return true;
    case kF16:
    case kBF16:
      MERLIN_CHECK(!e.norm_out, "matvec1: no RMSNorm epilogue for F16/BF16 rows");
      return matvec1_half(w, x, d_y, n_out, accumulate, stream, e.rope, e.glu_out, e.glu_up_row);
    default: return false;
  }
}

}  // namespace

bool matvec1(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream) {
  return dispatch(w, x, d_y, n_out_rows, accumulate, stream);
}

bool matvec1_rope_kv(const Matrix& w, const ActBuf& x, float* d_qkv, const RopeKvArgs& r, Stream stream) {
  Extra e;
  e.rope = &r;
  return dispatch(w, x, d_qkv, w.rows, false, stream, e);
}

// The split the plain product of w picks (choose_split). The SwiGLU epilogue needs S <= 2; where the plain
// product splits k over more warps (short rows: base's k = 768), forcing S = 2 made the step slower than
// the separate SwiGLU kernel (H200, base q8_0 tg128 3,785 -> 3,438 t/s), so the epilogue is used only
// where it costs the product nothing. Keeping S = 4 in 16-warp CTAs (as the Norm variant does) was slower
// too: base q4_0 4,349 -> 3,977 t/s, mxfp4 3,591 -> 3,216 (half as many SMs busy; tenth session).
static int plain_split(const Matrix& w) {
  const Geometry geo = geometry(w.fmt, w.rows, w.k);
  Mv1Args p{};
  p.tiles = (int)geo.tiles;
  p.n_chunks = (int)geo.n_chunks;
  const int per_sm = std::max(1, g_resident[w.fmt][variant_of(Key{2, kEpiPlain, false, false, kRunNone})][(w.k - 1) / kKBucket]);
  choose_split(p, (int64_t)g_sm_count * per_sm, tie_by_warps(w.fmt, false), false);
  return p.lsplit;
}

// F16/BF16 rows (matvec1_half.cu) emit element by element: outputs in F16, BF16 or F32 only.
// MERLIN_CUDA_GLU_SHORT=1 (read once): the SwiGLU epilogue also for rows the plain product splits over more
// than 2 warps per tile (A/B timing).
bool glu_short() {
  static const bool on = env_is("MERLIN_CUDA_GLU_SHORT", "1");
  return on;
}

bool swiglu_fuses(const Matrix& w, int64_t ffn, int64_t up_row, ActKind out) {
  const bool shape = mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 && ffn > 0 && up_row % 16 == 0 &&
                     up_row >= ffn && up_row + ffn <= w.rows;
  if (w.fmt == kF16 || w.fmt == kBF16)
    return shape && matvec1_half_fits(w) && (out == ActKind::F16 || out == ActKind::BF16 || out == ActKind::F32);
  const bool fmt = has_mv1_kernel(w.fmt);
  return shape && fmt && out != ActKind::Q8_K && w.k <= kMaxK && ffn % 32 == 0 &&
         (g_split_override >= 0 || plain_split(w) <= 1 || glu_short());
}

bool matvec1_swiglu(const Matrix& w, const ActBuf& x, int64_t ffn, int64_t up_row, ActBuf& out, Stream stream) {
  if (!swiglu_fuses(w, ffn, up_row, out.kind)) return false;
  MERLIN_CHECK(out.k == ffn && out.n_cap >= 1, "matvec1_swiglu: output buffer of ", out.k, " elements for ", ffn);
  Extra e;
  e.glu_out = &out;
  e.glu_up_row = up_row;
  return dispatch(w, x, nullptr, ffn, false, stream, e);
}

// The Norm epilogue: quantized rows (F16/BF16 rows have their own kernel), whole blocks of 32 outputs, and
// a Q8_0 reader whose row of n_out elements is staged by the single-token kernels.
bool norm_fold_fits(const Matrix& w, int64_t n_out) {
  const bool fmt = has_mv1_kernel(w.fmt);
  return fmt && mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 && w.k <= kMaxK && n_out > 0 && n_out % 32 == 0 &&
         n_out <= w.rows && n_out <= kMaxK;
}

bool matvec1_norm(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, const float* d_norm_w,
                  ActBuf& out, double* d_part, Stream stream) {
  if (!norm_fold_fits(w, n_out)) return false;
  MERLIN_CHECK(out.kind == ActKind::Q8_0 && out.k == n_out && out.n_cap >= 1 && out.q && out.scale && d_part && d_norm_w,
               "matvec1_norm: the output must be a Q8_0 row of ", n_out, " elements");
  Extra e;
  e.norm_w = d_norm_w;
  e.norm_out = &out;
  e.norm_part = d_part;
  return dispatch(w, x, d_y, n_out, accumulate, stream, e);
}

void set_matvec1_split(int lsplit) { g_split_override = lsplit; }
void set_matvec1_instances(int family) { g_family_override = family; }

bool matvec1_argmax_fits(const Matrix& w) {
  const bool fmt = has_mv1_kernel(w.fmt);
  return fmt && mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 && w.k <= kMaxK && w.rows <= 0xFFFFFFFFll;
}

bool matvec1_argmax(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, unsigned long long* d_key,
                    Stream stream) {
  if (!matvec1_argmax_fits(w)) return false;
  MERLIN_CHECK(d_key && n_out > 0, "matvec1_argmax: no key slot or no rows");
  Extra e;
  e.argmax = d_key;
  return dispatch(w, x, d_y, n_out, false, stream, e);
}

bool matvec1_glu_fits(const Matrix& w) {
  return (w.fmt == kQ8_0 || w.fmt == kQ4_0 || w.fmt == kMXFP4) && mv1_mode() != 0 && g_sm_count > 0 && w.k > 0 &&
         w.k <= kMaxK && w.k % 32 == 0;
}

void init_matvec1_kernels() {
  // MERLIN_CUDA_MV1_SPLIT=L (A/B timing): log2 of the warps per tile for every single-token product (clamped to
  // what each epilogue allows), as set_matvec1_split does for the tests.
  g_split_override = (int)env_int("MERLIN_CUDA_MV1_SPLIT", g_split_override);
  int dev = 0;
  MERLIN_CUDA_CHECK(cudaGetDevice(&dev));
  prepare<kQ8_0>();
  prepare<kQ4_0>();
  init_matvec1_half_kernels();
  prepare<kMXFP4>();
  prepare<kQ4_K>();
  prepare<kTQ2>();
  MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
}

}  // namespace merlin::cuda
