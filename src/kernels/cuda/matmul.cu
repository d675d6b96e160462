// The matrix product kernels over fragment-ordered weights (ops.h; repacking in repack.cu).
//
// One CTA of 8 warps works through tiles of 16 output rows for up to 8 * NT tokens; the grid is persistent
// (as many CTAs as fit on the GPU at once), so a CTA walks several tiles and its weight stream never drains
// between them. The warps split each tile's k dimension in rounds of 4 chunks (16 bytes per lane each, the
// block scales loaded alongside); two rounds alternate in registers, so 128 bytes of weights per lane stay
// in flight while the previous round computes. Activations are read in fragment order too (ActBuf::fq /
// fhi, written by every producer next to the rows): a warp's B operand for 8 tokens is 256 contiguous bytes;
// decode-sized batches stage theirs once per CTA in shared memory. Partial sums meet in shared memory in a
// fixed order, which keeps results deterministic (a replayed CUDA graph gives the eager bits). Per k-step a
// warp issues one tensor-core instruction per 8 tokens: int8 (m16n8k32) for the quantized types, whose int32
// result is one block's exact integer dot product and is scaled like the CPU's scalar reference; f16/bf16
// (m16n8k16) for half weights, with the activations split into hi + lo halves (two products) so the result
// keeps about 16 significant bits of the f32 activation instead of 8 or 11.
#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "core/sys.h"
#include "kernels/cuda/matmul_kernels.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

// Shared memory a CTA may use for staged activations: two CTAs per SM below NT = 4, one at NT = 4.
constexpr size_t kStageMax[3] = {64 << 10, 64 << 10, 160 << 10};
int g_sm_count = 0;
// Resident CTAs per SM of mm_kernel<F, NT> without / with staged activations (sizes the persistent grid);
// index 3 is the register-capped 32-token variant; then the exact-rounds (X) kernel and rounds of 2 chunks.
int g_resident[8][4][2][2][2] = {};  // [F][nt index, 3 = capped 32-token][staged][exact][R == 2]

bool nt4_capped() {
  static const bool on = !env_is("MERLIN_CUDA_NT4_CAP", "0");
  return on;
}

// Chunks per round of an NT-group product: 2 for 32-token CTAs (NT = 4) where rounds of 4 leave warps of a
// tile idle (short_rounds_fmt). Measured on the H200 (base, tg128 x32 / x16 / x8, rounds of 2 for every NT
// against 4): q4_0 +8 % / -1 % / -9 %, q8_0 +2 % / -6 % / -13 %, mxfp4 +13 % / +1 % / -7 %: the 4 token groups
// of a round give a warp enough work to hide its loads, one group does not. So a short row's 17..32-token
// sums run in another order than its 2..16-token ones (float rounding apart; docs/GPU.md). Built capped
// only (MERLIN_CUDA_NT4_CAP=0 keeps 4). MERLIN_CUDA_MM_ROUND=4 keeps 4 everywhere (A/B timing).
int round_for(int f, int nt, int64_t n_chunks) {
  static const bool on = !env_is("MERLIN_CUDA_MM_ROUND", "4");
  return on && nt == 4 && nt4_capped() && short_rounds_fmt(f) && n_chunks < (int64_t)kWarps * kRound ? 2 : kRound;
}

constexpr int nt_index(int nt) { return nt == 1 ? 0 : nt == 2 ? 1 : 2; }

// MERLIN_CUDA_MANY_SPLIT=0 (read once): warps_per_tile's rule for many-tile short rows off (A/B timing).
bool many_tiles_split() {
  static const bool on = !env_is("MERLIN_CUDA_MANY_SPLIT", "0");
  return on;
}

// Warps per tile. A CTA works on kWarps / split tiles at once when k is short (its rounds cover k with fewer
// than 8 warps) and the matrix has enough tiles that the persistent grid stays full: base's output head at
// 32 tokens (3,141 tiles of k = 768 in Q4_0: 3 of 8 warps busy). Splitting smaller matrices that way left
// SMs idle (base q4_0 tg128 x32 45.8k t/s against 47.9k with every matrix grouped). Any split whose rounds
// cover k in one pass sums in the same order as split = 8, so results do not depend on it.
// MERLIN_CUDA_MM_SPLIT=0 keeps 8 for A/B timing.
// A matrix of at least 8 tiles per resident CTA in rounds of 2 (the 32-token kernel on short rows: base's
// head, 3,142 tiles of k = 768) takes 2 warps per tile even though one pass would need more: each warp then
// walks its tile's k in several rounds, and a CTA's 4 tiles share one reduction (two barriers and the
// argmax's shared atomics) where 8 warps per tile paid one per tile. H200 tg128 x32 (2026-11-30, two rounds,
// 8 / 2 warps per tile): base q4_0 69,280 / 70,910 t/s, q8_0 66,540 / 67,590, mxfp4 61,460 / 63,590 (q4_0 with
// 4 warps 69,940, with 1 warp 69,570: 393 sets of 8 tiles over 264 CTAs are uneven). Such rows' 17..32-token
// sums already run in their own order (round_for): this changes that order, not batch invariance
// (BatchedVariantsAreBitIdentical, ManyTilesMatchScalarCpu).
int warps_per_tile(int64_t n_chunks, int64_t tiles, int64_t resident, int round) {
  static const bool on = !env_is("MERLIN_CUDA_MM_SPLIT", "0");
  int s_min = 1;
  while (s_min < kWarps && (int64_t)s_min * round < n_chunks) s_min *= 2;
  int groups = 1;
  while (on && groups * 2 <= kWarps / s_min && tiles / (groups * 2) >= resident) groups *= 2;
  if (many_tiles_split() && round == 2 && tiles >= 8 * resident) return std::min(2, kWarps / groups);
  return kWarps / groups;
}

// Test hook (set_matmul_shape): warps per tile and tokens per CTA (NT) forced on every product, 0 = chosen.
int g_split_force = 0, g_nt_force = 0;
bool g_half_off = false;  // test hook (set_matmul_half)
bool g_ep_off = false;    // test hook (set_matmul_epilogues)

// Warps per tile of the Glu epilogue (matmul_swiglu): a set must hold a whole block of 32 gate rows and the
// same rows of up (4 tiles), so at most 2. MERLIN_CUDA_GLU_MM_SPLIT=1 (read once) takes 1 (A/B timing).
int glu_split() {
  static const int s = env_int("MERLIN_CUDA_GLU_MM_SPLIT", 2) == 1 ? 1 : 2;
  return s;
}

using KernelFn = void (*)(MmArgs);

// Whether the X kernels of the int8 formats apply: every round that starts is whole (whole_rounds). The
// 32-token X kernels with rounds of 4 spill at their register cap (ptxas -v) except Q4_K's, which spills less
// than its checked kernel, so other 32-token steps with rounds of 4 keep the checked one (rounds of 2 fit).
// MERLIN_CUDA_MM_EXACT=0 keeps the checked kernels everywhere (A/B timing; same results).
template <int NT, int R>
constexpr bool x_built(int f) { return !half_fmt(f) && (NT < 4 || f == kQ4_K || R == 2); }
bool exact_rounds(int f, int nt, const MmArgs& p) {
  static const bool on = !env_is("MERLIN_CUDA_MM_EXACT", "0");
  return on && (nt < 4 || f == kQ4_K || p.round == 2) && whole_rounds(f, p.n_chunks, p.n_steps, p.round);
}

// Most shared memory a CTA of the NT kernel may stage its activations in.
size_t stage_limit(int nt) { return nt == 4 && nt4_capped() ? kStageMax[0] : kStageMax[nt_index(nt)]; }

// The instances built for one epilogue kind (mm_kernel's E, Ep): the H kernels (base's QKV and head at 32
// tokens, iphone's products) and the 8-token kernels of Q8_0 / Q4_0 (base's Wo, gate/up and down at 32
// tokens); everything else runs kEpAny. They are 40-60 % of kEpAny's code (scripts/ptxas_regs.sh), and each
// kernel of a step starts with a cold instruction cache. MERLIN_CUDA_MM_EP (read once) is a mask of where
// they run (A/B timing; the same code paths, so the same bits): 1 RoPE, 2 argmax, 4 store (H kernels), 8
// store (8-token kernels), 16 also the H kernels with rounds of 4 (long rows), 32 / 64 the 8-token Glu
// kernels of Q4_0 / Q8_0; 0 keeps kEpAny everywhere. A fused preparation (opt-in) always takes kEpAny.
// H200, base tg128 x32 (2026-12-02, docs/BENCHMARKS.md, thirtieth session): q4_0 87.3-88.4k t/s with 0,
// 91.7-93.1k with 15, 93.5-94.3k with 47; q8_0 84.1-85.0k with 0, 89.5-90.8k with 15, 89.2-89.8k with
// 15 | 64; iphone q4_0 x32 -3.1 % with 16 | 4 (its Wo / down), -0.7 % with 16 | 1: hence the default 47.
constexpr bool ep_built(int f) { return f == kQ8_0 || f == kQ4_0; }
int pick_epilogue(const MmArgs& p, int f) {
  static const int mask = (int)env_int("MERLIN_CUDA_MM_EP", 47);
  if (p.fuse_prep || g_ep_off) return kEpAny;
  if (p.glu_on) return mask & (f == kQ4_0 ? 32 : 64) ? kEpStore : kEpAny;
  const int e = p.rope_on ? kEpRope : p.argmax ? kEpArgmax : kEpStore;
  const int bit = e == kEpRope ? 1 : e == kEpArgmax ? 2 : p.half_x ? 4 : 8;
  if (!(mask & bit) || (p.half_x && p.round != 2 && !(mask & 16))) return kEpAny;
  return e;
}

// The kernel variant of a launch: rounds of 2 (round_for: the capped 32-token kernel), exact rounds (X),
// the register-capped 32-token kernel; G (the Glu epilogue) exists capped only (matmul_swiglu_fits); e:
// pick_epilogue's choice.
template <int F, int NT, bool G>
KernelFn pick_kernel(bool capped, bool x, int round, int e) {
  if constexpr (ep_built(F) && NT == 1) {
    if (e == kEpStore) return x ? mm_kernel<F, 1, 2, true, kRound, G, 0, kEpStore>
                                : mm_kernel<F, 1, 2, false, kRound, G, 0, kEpStore>;
  }
  if constexpr (short_rounds_fmt(F) && NT == 4) {
    if (round == 2) return x ? mm_kernel<F, 4, 2, true, 2, G> : mm_kernel<F, 4, 2, false, 2, G>;
  }
  constexpr bool kX = x_built<NT, kRound>(F);  // X kernels built (exact_rounds)
  constexpr int kMinBlocks = NT == 4 && !G ? 1 : 2;
  KernelFn kernel = mm_kernel<F, NT, kMinBlocks, false, kRound, G>;
  if constexpr (kX)
    if (x) kernel = mm_kernel<F, NT, kMinBlocks, true, kRound, G>;
  if constexpr (NT == 4) {
    if (capped) kernel = mm_kernel<F, 4, 2, false, kRound, G>;
    if constexpr (kX)
      if (capped && x) kernel = mm_kernel<F, 4, 2, true, kRound, G>;
  }
  return kernel;
}

// Where the H kernels stage the half plane in shared memory (the H = 2 instances, which load it with
// ld.shared) instead of reading it from global memory (L2, then L1): by default (-1) only where it fits and
// a CTA walks several tile sets (base's head: 3), which amortizes the stage's L2 round trip and barrier;
// MERLIN_CUDA_HALF_STAGE=1 wherever it fits, =0 never (read once; A/B timing). H200 (2026-12-02, base, tg128
// x32, two rounds of one call, this rule / never / wherever it fits): q4_0 81,688 and 81,398 / 81,318 and
// 81,237 / 80,130 and 80,601 t/s, q8_0 78,993 and 79,435 / 79,309 and 78,927 / 77,735 and 78,340 (QKV has
// one tile set per CTA: its stage is a bare round trip); the head's product alone (cuda_matvec 50304 768,
// 32 tokens, q4_0) 24.3 µs staged, 26.9 with generic loads of the staged plane, 30.8 on the int8 kernel.
int half_staging() {
  static const int mode = (int)env_int("MERLIN_CUDA_HALF_STAGE", -1);
  return mode;
}

// The H kernels (half activations, matmul_half_pays): the capped 32-token kernel of Q8_0 and Q4_0, rounds
// of 2 (exact or checked) and of 4 (checked), with and without the Glu epilogue.
constexpr bool h_built(int f) { return f == kQ8_0 || f == kQ4_0; }

template <int F, bool G, int H, int E>
KernelFn half_kernel_of(bool x, int round) {
  if (round == 2) return x ? mm_kernel<F, 4, 2, true, 2, G, H, E> : mm_kernel<F, 4, 2, false, 2, G, H, E>;
  return mm_kernel<F, 4, 2, false, kRound, G, H, E>;
}

template <int F, bool G, int H>
KernelFn pick_half_kernel(bool x, int round, int e) {
  if constexpr (h_built(F)) {
    if constexpr (!G) {
      if (e == kEpRope) return half_kernel_of<F, G, H, kEpRope>(x, round);
      if (e == kEpArgmax) return half_kernel_of<F, G, H, kEpArgmax>(x, round);
      if (e == kEpStore) return half_kernel_of<F, G, H, kEpStore>(x, round);
    }
    return half_kernel_of<F, G, H, kEpAny>(x, round);
  }
  fail("matmul: no half-activation kernel for this format");
}

template <int F, bool G>
KernelFn pick_half_kernel(bool x, int round, bool staged, int e) {
  return staged ? pick_half_kernel<F, G, 2>(x, round, e) : pick_half_kernel<F, G, 1>(x, round, e);
}

// How the RoPE epilogue finds each token's K/V slot and cos / sin row (MmArgs::rope_early) when the CTA's
// last warp has no chunks of k (last_idle: base's QKV at 32 tokens) or has. MERLIN_CUDA_ROPE_EARLY (read
// once) = 0, 1 or 2 forces one mode everywhere (A/B timing; the same results).
int rope_mode(bool last_idle) {
  static const int forced = (int)env_int("MERLIN_CUDA_ROPE_EARLY", -1);
  if (forced >= 0 && forced <= 2) return forced;
  return last_idle ? 1 : 2;
}

// How much of a batched step's contexts, all its tokens together, the QKV product asks into L2 for the
// attention kernel after it (MmArgs::ctx_l2): each token's newest positions, 16 MiB / tokens of K and V rows,
// in steps of 17 to 32 tokens, before pdl_wait. H200 tg128 x32 (docs/BENCHMARKS.md, thirty-ninth session, two
// rounds each), on / off: base q4_0 97,839 · 98,041 / 97,669 · 97,292 t/s, q8_0 +0.3 %, mxfp4 +1.4 %, q4_k
// +0.6 %, iphone q4_0 +0.3 % (the attention kernel's charge ~4.7 -> ~4.4 us per layer); at 8 tokens it lost
// 0.3-0.5 %, hence the floor. Asked after the wait it cost the QKV product what the attention gained (6.40 ->
// 6.83 us), and every block asked by the first CTAs (1.5 MiB per SM) 3.4 us per QKV product (base q4_0 x32
// -8 %): the requests queue ahead of the product's own weights in DRAM. MERLIN_CUDA_MM_KV_L2_MB=N (read once;
// 0 = off) and MERLIN_CUDA_MM_KV_L2_MIN=N (the fewest tokens) are the A/B switches.
constexpr int kDecodeMaxTokens = 32;
void set_ctx_l2(MmArgs& p) {
  static const long mb = std::clamp(env_int("MERLIN_CUDA_MM_KV_L2_MB", 16), 0L, 40L);
  static const long min_n = std::max(2L, env_int("MERLIN_CUDA_MM_KV_L2_MIN", 17));
  const RopeKvArgs& r = p.rope;
  const int64_t row = r.kv_dim * (r.kv.f16 ? 2 : 4);
  // Decode-sized steps only: a prefill chunk's tokens would ask for rows this product itself writes.
  if (mb == 0 || r.kv.q8 || row % 16 != 0 || p.n < min_n || p.n > kDecodeMaxTokens || p.rope_early == 0 ||
      r.kv.block_size <= 0)
    return;
  p.ctx_l2 = (int)std::min<int64_t>(mb * (1 << 20) / (2 * row * p.n), 1 << 30);
  p.ctx_l2_blocks = (int)std::min<int64_t>((p.ctx_l2 + r.kv.block_size - 1) / r.kv.block_size + 1, 1 << 20);
}

// The item walk's constants (MmArgs::split_log2 .. sets_r) of a launch of `ctas` CTAs over `sets` tile sets:
// computed here once, so that no CTA spends its first instructions on runtime divisions (Items).
void set_items(MmArgs& p, int64_t sets, int64_t ctas) {
  p.split_log2 = p.split == 1 ? 0 : p.split == 2 ? 1 : p.split == 4 ? 2 : 3;
  MERLIN_CHECK((1 << p.split_log2) == p.split && ctas > 0, "internal: warps per tile must be 1, 2, 4 or 8");
  const int64_t stride = (int64_t)p.split * p.round;
  p.rounds = (int)((p.n_chunks + stride - 1) / stride);
  p.sets_q = (int)(sets / ctas);
  p.sets_r = (int)(sets % ctas);
}

// Warps per tile of a 32-token product over rows too long to stage (one tile per CTA at a time:
// warps_per_tile's 8; the H kernels of iphone's Q4_0 products, the int8 ones of MXFP4 / Q4_K), chosen as
// matvec1's choose_split does: the split whose busiest CTA walks the fewest rounds, (tile sets per CTA) x
// (rounds per set); ties keep the larger split. Such a kernel's time is its rounds per warp (~3.5 us each
// for iphone's k = 3,072 in Q4_0), and at 8 warps per tile half of them idle in a set's second round (48
// chunks over 2 rounds of 32). H200, 32 tokens, cuda_matvec (forty-second session, docs/BENCHMARKS.md),
// 24,576 x 3,072 (iphone's gate/up, 1,536 tiles): 8 / 4 / 2 / 1 warps per tile 12 / 9 / 12 / 12 rounds per
// CTA, Q4_0 41.6 / 33.8 / 42.3 / 41.9 us, MXFP4 57.2 / 52.1 at 8 / 4, Q4_K 60.9 / 55.0; 9,216 x 3,072 (QKV)
// 6 / 6 / 6 / 12 rounds, 21.0 / 22.0 / 21.6 / 39.1 us (hence ties keep 8); Wo and down (192 tiles) are best
// at 8. iphone tg64 x32: q4_0 13,018-13,033 -> 13,963-13,964 t/s, mxfp4 9,912-9,961 -> 10,396-10,432, q4_k
// 9,198-9,212 -> 9,556-9,581 (gate/up takes 4, and a head of that format); Q8_0 (96 chunks) ties, base's rows
// are staged, macbook's tie. Results depend on the split (the partial sums meet in another order), not on
// the number of tokens: batch invariance holds within 17-32 tokens. MERLIN_CUDA_MM_LONG_SPLIT=S (read once)
// forces S warps per tile on such products (A/B timing), =0 keeps warps_per_tile's choice.
int long_row_split(int64_t n_chunks, int64_t tiles, int64_t resident, int round, int current) {
  static const int forced = [] {
    const int v = (int)env_int("MERLIN_CUDA_MM_LONG_SPLIT", -1);
    return v == 0 || v == 1 || v == 2 || v == 4 || v == 8 ? v : -1;
  }();
  if (forced >= 0) return forced == 0 ? current : forced;
  if (current != kWarps || round != kRound) return current;
  auto cost = [&](int s) {
    const int64_t per_set = kWarps / s, sets = (tiles + per_set - 1) / per_set;
    return (sets + resident - 1) / resident * ((n_chunks + (int64_t)s * round - 1) / ((int64_t)s * round));
  };
  int best = current;
  for (int s = kWarps / 2; s >= 1; s /= 2)
    if (cost(s) < cost(best)) best = s;
  return best;
}

template <int F, int NT>
void launch_nt(MmArgs p, Stream stream, int64_t tiles) {
  constexpr int ni = nt_index(NT);
  const bool capped = NT == 4 && nt4_capped();
  const bool h = p.half_x != 0;
  MERLIN_CHECK(!h || (NT == 4 && capped && h_built(F) && !p.fuse_prep), "internal: no H kernel for this launch");
  const size_t staged = staged_bytes(F, p.k, std::min(8 * NT, p.n), h) +
                        (p.rms_part && !h ? deferred_part_bytes(p.k, std::min(8 * NT, p.n)) : 0);
  p.stage_x = staged <= stage_limit(NT) && (!h || half_staging() != 0) ? 1 : 0;
  MERLIN_CHECK(p.stage_x || !p.fuse_prep, "matmul: a fused preparation needs the activations in shared memory");
  MERLIN_CHECK(p.stage_x || h || !p.rms_part, "matmul: a deferred RMSNorm needs the activations in shared memory");
  MERLIN_CHECK(h || !p.rms_part || p.rms_blocks == p.k / 32,
               "matmul: sums of squares per 16 outputs (matmul_norm's half plane) are read by the H kernels only");
  p.round = round_for(F, NT, p.n_chunks);
  const bool x = exact_rounds(F, NT, p);
  const int64_t resident =
      (int64_t)g_sm_count * std::max(1, g_resident[F][capped ? 3 : ni][p.stage_x][x][p.round == 2]);
  p.split = warps_per_tile(p.n_chunks, tiles, resident, p.round);
  if (p.glu_on) p.split = glu_split();
  if (NT == 4 && !p.stage_x && !p.glu_on) p.split = long_row_split(p.n_chunks, tiles, resident, p.round, p.split);
  if (g_split_force > 0) p.split = g_split_force;
  if (p.norm_on == 1) p.split = std::min(p.split, 4);  // a tile set of >= 2 tiles holds whole blocks of 32 rows
  if (p.glu_on) p.split = std::min(p.split, 2);   // a set of >= 2 gate and 2 up tiles: whole blocks
  const int64_t per_set = kWarps / p.split / (p.glu_on ? 2 : 1);
  const int64_t sets = ((p.glu_on ? p.glu_tiles : tiles) + per_set - 1) / per_set;
  const dim3 grid((unsigned)std::min(sets, resident), (unsigned)((p.n + 8 * NT - 1) / (8 * NT)));
  set_items(p, sets, grid.x);
  if (h && half_staging() == -1 && sets <= resident) p.stage_x = 0;  // one tile set per CTA: not worth a stage
  if (p.rope_on) p.rope_early = rope_mode(((kWarps - 1) & (p.split - 1)) * p.round >= p.n_chunks);
  if (p.rope_on) set_ctx_l2(p);
  const bool in_smem = p.stage_x != 0;
  const int e = pick_epilogue(p, F);
  KernelFn kernel = p.glu_on ? pick_kernel<F, NT, true>(capped, x, p.round, e)  //
                             : pick_kernel<F, NT, false>(capped, x, p.round, e);
  if (h)
    kernel = p.glu_on ? pick_half_kernel<F, true>(x, p.round, in_smem, e)  //
                      : pick_half_kernel<F, false>(x, p.round, in_smem, e);
  launch_pdl(kernel, grid, kWarps * 32, p.stage_x ? staged : 0, stream, p);
}

// Matrices with fewer 16-row tiles than SMs (base's 768-row Wo and down projection: 48 tiles) give a
// 16- or 32-token launch fewer CTAs than SMs, each with a few busy warps (k = 768 in Q4_0 is 12 chunks: 3 of 8
// warps). Those run as 8-token CTAs instead, one per (tile, 8 tokens): more CTAs at a quarter of the work
// each, weights re-read from L2. The per-token arithmetic and its order are the same in every NT, so
// results are bit-identical.
// MERLIN_CUDA_SMALL_SPLIT=N moves the bound to N tiles per SM (0: off).
int64_t small_split_tiles() {
  static const int64_t per_sm = env_int("MERLIN_CUDA_SMALL_SPLIT", 1);
  return per_sm * g_sm_count;
}

// Tokens per CTA (8 * NT) of an n-token product over a matrix of `tiles` tiles.
int nt_for(int n, int64_t tiles) { return n <= 8 || tiles < small_split_tiles() ? 1 : n <= 16 ? 2 : 4; }

// Token groups per CTA (NT) of the Glu epilogue: 1 (8-token CTAs), or MERLIN_CUDA_GLU_MM_NT=2 or 4 (read once;
// A/B timing). Its sets are 4 tiles at 2 warps per tile, so base's gate/up (256 tiles) has only 64 sets:
// 8-token CTAs give the step 4 x 64 of them, each staging a quarter of the tokens. H200, base tg128 x32
// (2026-12-01, one call): q4_0 69,706 t/s without the epilogue, 63,119 / 71,453 / 78,171 with NT = 4 / 2 / 1;
// q8_0 68,236, then 59,515 / 69,388 / 74,995.
int glu_nt(int n) {
  static const int forced = (int)env_int("MERLIN_CUDA_GLU_MM_NT", 1);
  const int nt = forced == 2 || forced == 4 ? forced : 1;
  return std::min(nt, n <= 8 ? 1 : n <= 16 ? 2 : 4);
}

// MERLIN_CUDA_ARGMAX_PAIRS=0 (read once): the batched head's argmax through reduce_plain's element walk even
// at 1 or 2 warps per tile (A/B timing; the same ids).
bool argmax_pairs() {
  static const bool on = !env_is("MERLIN_CUDA_ARGMAX_PAIRS", "0");
  return on;
}

// MERLIN_CUDA_HALF_MM (read once): 0 = never, 1 (default) = the products that run 32-token CTAs anyway
// (more than 16 tokens over enough tiles: base's QKV and head), 2 = every product of more than 16 tokens,
// as 32-token CTAs (A/B timing).
int half_mode() {
  static const int mode = (int)env_int("MERLIN_CUDA_HALF_MM", 1);
  return mode;
}

// Whether an n-token product of format f may take an H kernel (matmul_half_pays), and whether a launch of
// nt token groups per CTA does.
bool half_allowed(int f, int n) { return half_mode() != 0 && !g_half_off && nt4_capped() && h_built(f) && n > 16; }
bool half_kernel(int f, int nt, int n) { return half_allowed(f, n) && (half_mode() == 2 || nt == 4); }

// Token groups per CTA of a launch over `tiles` tiles (the test hook's forced value first).
int launch_groups(int n, int64_t tiles, bool glu) {
  if (g_nt_force > 0) return g_nt_force;
  return glu ? glu_nt(n) : nt_for(n, tiles);
}

template <int F>
void launch_fmt(const MmArgs& p, Stream stream, int64_t tiles) {
  const int nt = launch_groups(p.n, tiles, p.glu_on != 0);
  if (p.xfh && !p.fuse_prep && half_kernel(F, nt, p.n)) {
    MmArgs h = p;
    h.half_x = 1;
    launch_nt<F, 4>(h, stream, tiles);
    return;
  }
  switch (nt) {
    case 1: launch_nt<F, 1>(p, stream, tiles); break;
    case 2: launch_nt<F, 2>(p, stream, tiles); break;
    default: launch_nt<F, 4>(p, stream, tiles); break;
  }
}

// The most dynamic shared memory each of `kernels` may take.
void allow_smem(std::initializer_list<KernelFn> kernels, size_t bytes) {
  for (const KernelFn k : kernels)
    MERLIN_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

// Shared-memory limit and resident CTAs per SM of one kernel variant (index: nt index, or 3 = capped).
template <int F, int NT, int MinBlocks, bool X, int R = kRound>
void prepare_variant(int index, size_t stage_max) {
  const auto kernel = mm_kernel<F, NT, MinBlocks, X, R>;
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stage_max));
  for (int staged = 0; staged < 2; ++staged)
    MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[F][index][staged][X][R == 2], kernel,
                                                                     kWarps * 32, staged ? stage_max : 0));
}

template <int F, int NT>
void prepare_kernel() {
  constexpr int ni = nt_index(NT);
  prepare_variant<F, NT, NT == 4 ? 1 : 2, false>(ni, kStageMax[ni]);
  if constexpr (x_built<NT, kRound>(F)) prepare_variant<F, NT, NT == 4 ? 1 : 2, true>(ni, kStageMax[ni]);
}

// pick_kernel's 8-token kEpStore instances, plain and Glu: their shared-memory limits (their residency is
// taken as the kEpAny instance's, which has the same register cap).
template <int F>
void allow_store_instances() {
  if constexpr (ep_built(F))
    allow_smem({mm_kernel<F, 1, 2, false, kRound, false, 0, kEpStore>,
                mm_kernel<F, 1, 2, true, kRound, false, 0, kEpStore>,
                mm_kernel<F, 1, 2, false, kRound, true, 0, kEpStore>,
                mm_kernel<F, 1, 2, true, kRound, true, 0, kEpStore>},
               kStageMax[nt_index(1)]);
}

// The Glu epilogue's variants (pick_kernel with G): their shared-memory limits; their residency is taken as
// the plain variant's (the same register cap).
template <int F, int NT, int MinBlocks, bool X, int R = kRound>
void allow_glu_variant(size_t stage_max) {
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(mm_kernel<F, NT, MinBlocks, X, R, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, (int)stage_max));
}

template <int F>
void allow_glu() {
  allow_glu_variant<F, 1, 2, false>(kStageMax[0]);
  allow_glu_variant<F, 2, 2, false>(kStageMax[1]);
  allow_glu_variant<F, 4, 2, false>(kStageMax[0]);
  if constexpr (x_built<1, kRound>(F)) {
    allow_glu_variant<F, 1, 2, true>(kStageMax[0]);
    allow_glu_variant<F, 2, 2, true>(kStageMax[1]);
  }
  if constexpr (x_built<4, kRound>(F)) allow_glu_variant<F, 4, 2, true>(kStageMax[0]);
  if constexpr (short_rounds_fmt(F)) {
    allow_glu_variant<F, 4, 2, false, 2>(kStageMax[0]);
    if constexpr (x_built<4, 2>(F)) allow_glu_variant<F, 4, 2, true, 2>(kStageMax[0]);
  }
}

template <int F, int MinBlocks, bool X, int R, bool G>
void allow_half_variant() {
  allow_smem({mm_kernel<F, 4, MinBlocks, X, R, G, 2>}, kStageMax[0]);
  if constexpr (!G)  // pick_half_kernel's one-epilogue instances
    allow_smem({mm_kernel<F, 4, MinBlocks, X, R, G, 2, kEpRope>, mm_kernel<F, 4, MinBlocks, X, R, G, 2, kEpArgmax>,
                mm_kernel<F, 4, MinBlocks, X, R, G, 2, kEpStore>},
               kStageMax[0]);
}

template <int F>
void allow_half() {
  if constexpr (h_built(F)) {
    allow_half_variant<F, 2, false, 2, false>();
    allow_half_variant<F, 2, true, 2, false>();
    allow_half_variant<F, 2, false, kRound, false>();
    allow_half_variant<F, 2, false, 2, true>();
    allow_half_variant<F, 2, true, 2, true>();
    allow_half_variant<F, 2, false, kRound, true>();
  }
}

template <int F>
void allow_staging() {
  allow_glu<F>();
  allow_store_instances<F>();
  allow_half<F>();
  prepare_kernel<F, 1>();
  prepare_kernel<F, 2>();
  prepare_kernel<F, 4>();
  // The capped 32-token variant: two CTAs per SM, so 64 KiB of staged activations each at most.
  prepare_variant<F, 4, 2, false>(3, kStageMax[0]);
  if constexpr (F == kQ4_K) prepare_variant<F, 4, 2, true>(3, kStageMax[0]);
  if constexpr (short_rounds_fmt(F)) {
    prepare_variant<F, 4, 2, false, 2>(3, kStageMax[0]);
    if constexpr (x_built<4, 2>(F)) prepare_variant<F, 4, 2, true, 2>(3, kStageMax[0]);
  }
}

}  // namespace

// Once per process, before any product can be launched (so never inside a graph capture): the kernels'
// shared-memory limits and the SM count that sizes the persistent grids.
void init_matmul_kernels() {
  static const bool done = [] {
    int dev = 0;
    MERLIN_CUDA_CHECK(cudaGetDevice(&dev));
    MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
    allow_staging<kQ8_0>();
    allow_staging<kQ4_0>();
    allow_staging<kMXFP4>();
    allow_staging<kQ4_K>();
    allow_staging<kTQ2>();
    allow_staging<kF16>();
    allow_staging<kBF16>();
    init_matvec1_kernels();
    return true;
  }();
  (void)done;
}

namespace {

MmArgs product_args(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows,
                    bool accumulate) {
  const Geometry geo = geometry(w.fmt, w.rows, w.k);
  MmArgs p{w.q, w.s, w.k, geo.n_steps, geo.n_chunks, geo.n_super, x.fq, x.fs, x.fsum, x.fhi, x.flo, x.f,
           n, d_y, ldy, std::min(n_out_rows, w.rows), w.rows, accumulate ? 1 : 0, geo.tiles, 0, 0, PrepArgs{}, 8,
           kRound, 0, RopeKvArgs{}};
  p.rms_part = x.rms_part;
  p.rms_eps = x.rms_eps;
  p.rms_blocks = x.rms_part ? (int)(w.k / x.rms_block) : 0;
  p.xfh = x.fh;
  return p;
}

void launch_product(int fmt, const MmArgs& p, Stream stream) {
  MERLIN_CHECK(fmt == kF32 || p.fuse_prep || (half_fmt(fmt) ? p.xfhi != nullptr : p.xfq != nullptr),
               "matmul: activations without their fragment planes (act_alloc makes them)");
  switch (fmt) {
    case kF32: {
      const dim3 grid((unsigned)((p.rows + kWarps - 1) / kWarps), (unsigned)((p.n + 7) / 8));
      launch_pdl(mm_f32_kernel, grid, kWarps * 32, 0, stream, p);
      break;
    }
    case kQ8_0: launch_fmt<kQ8_0>(p, stream, p.tiles); break;
    case kQ4_0: launch_fmt<kQ4_0>(p, stream, p.tiles); break;
    case kMXFP4: launch_fmt<kMXFP4>(p, stream, p.tiles); break;
    case kQ4_K: launch_fmt<kQ4_K>(p, stream, p.tiles); break;
    case kTQ2: launch_fmt<kTQ2>(p, stream, p.tiles); break;
    case kF16: launch_fmt<kF16>(p, stream, p.tiles); break;
    case kBF16: launch_fmt<kBF16>(p, stream, p.tiles); break;
    default: fail("matmul: bad matrix format");
  }
  check_launch("matmul");
}

// Most activation elements (tokens x k) a product prepares itself: every CTA repeats the preparation, so
// only short rows are worth it (the 7.19B model's 16384-wide down projection never qualifies).
constexpr int64_t kFuseMaxElems = 8192;

}  // namespace

bool reads_deferred_norm(const Matrix& w, int n) {
  if (n < 2 || (w.fmt != kQ8_0 && w.fmt != kQ4_0 && w.fmt != kMXFP4)) return false;
  const int nt = nt_for(n, geometry(w.fmt, w.rows, w.k).tiles);
  const int staged = std::min(8 * nt, n);
  return staged_bytes(w.fmt, w.k, staged) + deferred_part_bytes(w.k, staged) <= stage_limit(nt);
}

// Whether w at n tokens can read x's deferred RMSNorm, of either kind (rms_block).
static bool reads_norm_of(const ActBuf& x, const Matrix& w, int n) {
  return x.rms_block == 16 ? reads_half_norm(w, n) : reads_deferred_norm(w, n);
}

bool reads_half_norm(const Matrix& w, int n) {
  return n >= 2 && h_built(w.fmt) && half_kernel(w.fmt, launch_groups(n, geometry(w.fmt, w.rows, w.k).tiles, false), n);
}

bool matmul_norm_half_fits(const Matrix& w, int64_t n_out, int n) {
  return w.fmt != kF32 && n >= 2 && n_out > 0 && n_out % 16 == 0 && n_out <= w.rows;
}

bool matmul_norm_half_pays(const Matrix& w, int /*n*/) { return geometry(w.fmt, w.rows, w.k).n_chunks <= 64; }

bool matmul_norm_fits(const Matrix& w, int64_t n_out, int n) {
  return w.fmt != kF32 && n >= 2 && n_out > 0 && n_out % 32 == 0 && n_out <= w.rows;
}

bool matmul_norm_pays(const Matrix& w, int n) {
  const int64_t chunks = geometry(w.fmt, w.rows, w.k).n_chunks;
  if (w.fmt == kQ4_0) return chunks <= 4 * kRound || (chunks <= 8 * kRound && n <= 3);
  if (w.fmt == kMXFP4) return chunks <= 4 * kRound ? n <= 4 || n > 16 : chunks <= 32 && n > 16;
  return w.fmt == kQ8_0 && chunks <= 64;
}

bool matmul_norm(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out, bool accumulate,
                 const float* d_norm_w, ActBuf& out, double* d_part, Stream stream, bool half_only) {
  if (half_only ? !matmul_norm_half_fits(w, n_out, n) : !matmul_norm_fits(w, n_out, n)) return false;
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap, "matmul_norm: activation buffer does not fit the matrix");
  MERLIN_CHECK(out.kind == ActKind::Q8_0 && out.k == n_out && n <= out.n_cap &&
                   (half_only ? out.fh != nullptr : out.fq && out.fs && out.fsum),
               "matmul_norm: the output buffer does not fit");
  MERLIN_CHECK(!x.rms_part, "matmul_norm: the input has a deferred RMSNorm");
  MmArgs p = product_args(w, x, n, d_y, ldy, n_out, accumulate);
  p.norm_on = half_only ? 2 : 1;
  p.norm_w = d_norm_w;
  p.norm_out = out;
  p.norm_part = d_part;
  launch_product(w.fmt, p, stream);
  return true;
}

bool matmul_half_pays(const Matrix& w, int n) { return half_allowed(w.fmt, n); }

void set_matmul_half(bool on) { g_half_off = !on; }

void set_matmul_epilogues(bool on) { g_ep_off = !on; }

void set_matmul_shape(int split, int nt) {
  g_split_force = split == 1 || split == 2 || split == 4 || split == 8 ? split : 0;
  g_nt_force = nt == 1 || nt == 2 || nt == 4 ? nt : 0;
}

// MERLIN_CUDA_GLU_MM=0 (read once): no batched Glu epilogue (A/B timing; the SwiGLU kernel runs instead).
bool matmul_swiglu_fits(const Matrix& w, int n, int64_t ffn, int64_t up_row, ActKind out) {
  static const bool on = !env_is("MERLIN_CUDA_GLU_MM", "0");
  if (!nt4_capped()) return false;  // its 32-token kernels are built register-capped only
  const bool kind = out == ActKind::Q8_0 || out == ActKind::F16 || out == ActKind::BF16 || out == ActKind::F32;
  return on && kind && w.fmt != kF32 && n >= 2 && ffn > 0 && ffn % 32 == 0 && up_row % 16 == 0 && up_row >= ffn &&
         up_row + ffn <= w.rows;
}

// Measured on the H200 (tg128, 2026-12-01, against the product plus the SwiGLU kernel): base (k = 768) q4_0
// x8 23,806 / 26,317 t/s, x16 40,237 / 41,613, x32 78,970 / 70,393; q8_0 x32 74,995 / 68,236; iphone (k = 3,072)
// q4_0 x32 9,759 / 10,520. Fewer than 17 tokens give the 4-tile sets too few CTAs, and a long row gives each of
// a tile's 2 warps many rounds in a row (iphone q4_0: 6, against 2 at 8 warps per tile). MERLIN_CUDA_GLU_MM=1
// (read once) takes it wherever it fits (A/B timing).
bool matmul_swiglu_pays(const Matrix& w, int n) {
  static const bool always = env_is("MERLIN_CUDA_GLU_MM", "1");
  return always || (n > 16 && geometry(w.fmt, w.rows, w.k).n_chunks <= 24);
}

bool matmul_swiglu(const Matrix& w, const ActBuf& x, int n, int64_t ffn, int64_t up_row, ActBuf& out, Stream stream) {
  if (!matmul_swiglu_fits(w, n, ffn, up_row, out.kind)) return false;
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap, "matmul_swiglu: activation buffer does not fit the matrix");
  MERLIN_CHECK(out.k == ffn && n <= out.n_cap, "matmul_swiglu: output buffer of ", out.k, " elements for ", ffn);
  MERLIN_CHECK(out.kind == ActKind::Q8_0 ? out.fq != nullptr : out.kind == ActKind::F32 || out.fhi != nullptr,
               "matmul_swiglu: the output needs its fragment planes (act_alloc makes them)");
  MERLIN_CHECK(!x.rms_part || (n == x.rms_rows && reads_norm_of(x, w, n)),
               "matmul_swiglu: this product cannot read a deferred RMSNorm of ", x.rms_rows, " rows as ", n, " tokens");
  MERLIN_CHECK(!x.glu_src, "matmul_swiglu: a SwiGLU row (ActBuf::glu_src) is read by single-token products only");
  MmArgs p = product_args(w, x, n, nullptr, 0, w.rows, false);
  p.glu_on = 1;
  p.glu_up_tile = (int)(up_row / 16);
  p.glu_tiles = (int)(ffn / 16);
  p.glu_out = out;
  launch_product(w.fmt, p, stream);
  return true;
}

bool prep_fuses(const Matrix& w, int n) {
  return w.fmt != kF32 && n >= 1 && n <= 8 && (int64_t)n * w.k <= kFuseMaxElems &&
         staged_bytes(w.fmt, w.k, n) <= kStageMax[0];
}

// Whether a product of n >= 2 tokens takes the 2-4-token kernels (matvec_few): where they pay and the input
// is one they read (row planes: no deferred RMSNorm in the fragment planes). A deferred norm in row planes
// or a SwiGLU row must go there (the batched kernels cannot read them).
static bool few_input(const Matrix& w, const ActBuf& x, int n) {
  if (x.rms_part && !x.rms_in_rows) return false;
  if ((x.rms_part && x.rms_in_rows) || x.glu_src) {
    MERLIN_CHECK(matvec_few_fits(w, n), "matmul: a deferred RMSNorm in row planes or a SwiGLU row for ", n,
                 " tokens, which only the 2-4-token kernels read, for a product they do not take");
    return true;
  }
  return matvec_few_pays(w, n);
}

void matmul(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows, bool accumulate,
            Stream stream) {
  if (n <= 0) return;
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap, "matmul: activation buffer does not fit the matrix");
  MERLIN_CHECK(!x.rms_part || (n == x.rms_rows && (n == 1 || x.rms_in_rows ? x.rms_block == 32 : reads_norm_of(x, w, n))),
               "matmul: this product cannot read a deferred RMSNorm (ActBuf::rms_part) of ", x.rms_rows, " rows as ", n,
               " tokens");
  if (n >= 2 && few_input(w, x, n) && matvec_few(w, x, n, d_y, ldy, n_out_rows, accumulate, stream)) return;
  MERLIN_CHECK(!x.glu_src || n == 1, "matmul: a SwiGLU row (ActBuf::glu_src) is read by single-token products only");
  if (n == 1 && matvec1(w, x, d_y, n_out_rows, accumulate, stream)) return;
  MERLIN_CHECK(!x.glu_src, "matmul: no single-token kernel computes this SwiGLU row (ActBuf::glu_src)");
  launch_product(w.fmt, product_args(w, x, n, d_y, ldy, n_out_rows, accumulate), stream);
}

bool matmul_argmax_fits(const Matrix& w, int n) { return w.fmt != kF32 && n >= 2; }

void matmul_argmax(const Matrix& w, const ActBuf& x, int n, int64_t n_out, unsigned long long* d_keys,
                   Stream stream) {
  MERLIN_CHECK(matmul_argmax_fits(w, n), "matmul_argmax: F32 rows or fewer than two tokens");
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap, "matmul_argmax: activation buffer does not fit");
  if (few_input(w, x, n) && matvec_few_argmax(w, x, n, n_out, d_keys, stream)) return;
  MERLIN_CHECK(!x.rms_part || (n == x.rms_rows && !x.rms_in_rows && reads_norm_of(x, w, n)),
               "matmul_argmax: this product cannot read a deferred RMSNorm of ", x.rms_rows, " rows as ", n, " tokens");
  MERLIN_CHECK(!x.glu_src, "matmul_argmax: a SwiGLU row (ActBuf::glu_src) is read by single-token products only");
  MmArgs p = product_args(w, x, n, nullptr, 0, n_out, false);
  p.argmax = d_keys;
  p.argmax_pairs = argmax_pairs() ? 1 : 0;
  launch_product(w.fmt, p, stream);
}

bool matmul_rope_kv(const Matrix& w, const ActBuf& x, int n, float* d_qkv, int64_t ldy, const RopeKvArgs& r,
                    Stream stream, bool* context_l2) {
  if (context_l2) *context_l2 = false;
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n >= 1 && n <= x.n_cap,
               "matmul_rope_kv: activation buffer does not fit");
  MERLIN_CHECK(r.hd % 2 == 0 && r.n_rot <= r.hd && r.q_dim <= r.k_off && r.k_off + r.kv_dim <= r.v_off &&
                   r.v_off + r.kv_dim <= w.rows && ldy >= w.rows,
               "matmul_rope_kv: Q/K/V rows do not fit the matrix");
  if (w.fmt == kF32 || r.kv.q8) return false;
  MERLIN_CHECK(!x.rms_part || (n == x.rms_rows && (n == 1 || x.rms_in_rows ? x.rms_block == 32 : reads_norm_of(x, w, n))),
               "matmul_rope_kv: this product cannot read a deferred RMSNorm of ", x.rms_rows, " rows as ", n, " tokens");
  if (n == 1 && matvec1_rope_kv(w, x, d_qkv, r, stream)) {
    if (context_l2) *context_l2 = r.l2_positions > 0;
    return true;
  }
  if (n >= 2 && few_input(w, x, n) && matvec_few_rope_kv(w, x, n, d_qkv, ldy, r, stream)) {
    if (context_l2) *context_l2 = r.l2_positions > 0;
    return true;
  }
  MERLIN_CHECK(!x.glu_src, "matmul_rope_kv: a SwiGLU row (ActBuf::glu_src) is read by single-token products only");
  MmArgs p = product_args(w, x, n, d_qkv, ldy, w.rows, false);
  p.rope_on = 1;
  p.rope = r;
  launch_product(w.fmt, p, stream);
  return true;
}

void matmul_prep(const Matrix& w, const PrepArgs& prep, ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows,
                 bool accumulate, Stream stream) {
  if (n <= 0) return;
  // One token goes to the dedicated single-token kernel (matvec1.h), 2-4 tokens to its multi-token instances
  // where they fit (matvec_few): neither has a fused variant.
  if (!prep_fuses(w, n) || n == 1 || matvec_few_pays(w, n)) {
    prep_act(prep, n, x, stream);
    matmul(w, x, n, d_y, ldy, n_out_rows, accumulate, stream);
    return;
  }
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap, "matmul: activation buffer does not fit the matrix");
  MERLIN_CHECK(!prep.d_tokens, "matmul_prep: embedding rows are prepared by prep_act only");
  MmArgs p = product_args(w, x, n, d_y, ldy, n_out_rows, accumulate);
  p.fuse_prep = 1;
  p.prep = prep;
  launch_product(w.fmt, p, stream);
}

}  // namespace merlin::cuda
