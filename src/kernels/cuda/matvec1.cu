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
#include "kernels/cuda/matvec1_kernel.cuh"
#include "kernels/cuda/matvec1_pool.h"

namespace merlin::cuda {
namespace {

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
//
// Steps of 2-4 tokens (mv1_kernel's NT, matvec_few) take three instances per format and token count: the
// general plain one (RoPE and the SwiGLU staging at run time: QKV, gate/up, and a down product without the
// fold), the general Norm one (Wo, down) and the lean argmax one (the head): three kernels per layer, as the
// mid family runs at one token.
struct Key {  // the instance a launch takes (kernel_of)
  int mb, epi;
  bool x, g;
  int run;
  int nt = 1;  // tokens
};
constexpr int kVariants = 2 * kEpis * 2 * 2 * 4 * kFewMax;
constexpr int variant_of(const Key& k) {
  return (((((k.mb == 3 ? 1 : 0) * kEpis + k.epi) * 2 + (k.x ? 1 : 0)) * 2 + (k.g ? 1 : 0)) * 4 + k.run) * kFewMax +
         k.nt - 1;
}

using Mv1Kernel = void (*)(Mv1Args);

// CTAs per SM of each variant for rows up to (bucket + 1) * kKBucket, [F][variant][bucket].
int g_resident[8][kVariants][kBuckets] = {};

template <int F, int MB, int E, bool X, bool G, int Run, int NT = 1>
void prepare_one() {
  const auto kernel = mv1_kernel<F, MB, E, X, G, Run, NT>;
  const int64_t max_k = NT == 1 ? kMaxK : kFewMaxK;
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem_bytes_glu<F>(max_k, NT)));
  const int v = variant_of(Key{MB, E, X, G, Run, NT});
  for (int b = 0; b < kBuckets && (b + 1) * kKBucket <= max_k; ++b)
    MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[F][v][b], kernel, warps_of(E) * 32,
                                                                     smem_rows<F>((b + 1) * kKBucket, NT)));
}

// The 2-4-token instances of format F (see Key).
template <int F, int NT>
void prepare_few_nt() {
  prepare_one<F, 2, kEpiPlain, false, false, kRunAll, NT>();
  prepare_one<F, 2, kEpiPlain, true, false, kRunAll, NT>();
  prepare_one<F, 1, kEpiNorm, false, false, kRunAll, NT>();
  prepare_one<F, 1, kEpiNorm, true, false, kRunAll, NT>();
  prepare_one<F, 2, kEpiArgmax, false, false, kRunNone, NT>();
  prepare_one<F, 2, kEpiArgmax, true, false, kRunNone, NT>();
}
template <int F>
void prepare_few() {
  prepare_few_nt<F, 2>();
  prepare_few_nt<F, 3>();
  prepare_few_nt<F, 4>();
}

template <int F, int NT>
Mv1Kernel few_kernel_nt(int epi, bool x) {
  if (epi == kEpiNorm) return x ? mv1_kernel<F, 1, kEpiNorm, true, false, kRunAll, NT> : mv1_kernel<F, 1, kEpiNorm, false, false, kRunAll, NT>;
  if (epi == kEpiArgmax)
    return x ? mv1_kernel<F, 2, kEpiArgmax, true, false, kRunNone, NT> : mv1_kernel<F, 2, kEpiArgmax, false, false, kRunNone, NT>;
  return x ? mv1_kernel<F, 2, kEpiPlain, true, false, kRunAll, NT> : mv1_kernel<F, 2, kEpiPlain, false, false, kRunAll, NT>;
}
// The instance prepare_few() built for a launch of nt tokens with epilogue epi (the RoPE epilogue is the
// plain instance's run-time branch).
template <int F>
Mv1Kernel few_kernel(int epi, bool x, int nt) {
  if constexpr (reads_q8_0<F>()) {
    switch (nt) {
      case 2: return few_kernel_nt<F, 2>(epi, x);
      case 3: return few_kernel_nt<F, 3>(epi, x);
      default: return few_kernel_nt<F, 4>(epi, x);
    }
  }
  fail("matvec_few: no 2-4-token kernel for this format");
}
Key few_key(int epi, bool x, int nt) {
  if (epi == kEpiNorm) return Key{1, kEpiNorm, x, false, kRunAll, nt};
  if (epi == kEpiArgmax) return Key{2, kEpiArgmax, x, false, kRunNone, nt};
  return Key{2, kEpiPlain, x, false, kRunAll, nt};
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
  if constexpr (reads_q8_0<F>()) prepare_few<F>();
}

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

// MERLIN_CUDA_MV1_POOL=0 (read once; A/B timing): one-token RoPE products never take the pooled walk;
// set_matvec1_pool (tests) overrides it.
int g_pool_override = -1;
int g_last_pool = 0;
bool pool_off() {
  static const bool off = env_is("MERLIN_CUDA_MV1_POOL", "0");
  return g_pool_override == 0 || (g_pool_override < 0 && off);
}

// Whether the one-token RoPE product p (choose_split done, `ctas` resident CTAs) takes the pooled walk
// (pooled_walk, the kRunPool instance): where its tiles outnumber the CTAs, every warp gets a round of every
// tile of its CTA (rounds per tile >= warps) and the busiest warp walks fewer rounds than in choose_split's
// groups (iphone's Q4_0 / MXFP4 / Q4_K QKV, 576 tiles of 12 rounds over 264 CTAs: 5 against 6; a Q8_0 row's
// 24 rounds, or macbook's 16 at S = 8, divide evenly either way, so they keep the groups). Sets p.rounds (one
// warp's rounds per tile) and the grid where it does; pool_ctas (the twin's resident CTAs) must be ctas.
// The caller has checked that the format has a twin (matvec1_pool_kernel).
// H200 tg128 (docs/BENCHMARKS.md, forty-first session), groups / pooled: iphone q4_0 1,302-1,310 / 1,322-1,331
// t/s, mxfp4 1,016 / 1,037, q4_k 1,137 / 1,162.
bool plan_pool(Mv1Args& p, int64_t ctas, int64_t pool_ctas, unsigned& grid) {
  if (pool_off() || pool_ctas != ctas) return false;
  const int64_t r1 = (p.n_chunks + kRound - 1) / kRound, per = (p.tiles + ctas - 1) / ctas;
  if (p.tiles <= ctas || r1 < kWarps || per > kPoolTiles) return false;
  const int64_t pooled = (per * r1 + kWarps - 1) / kWarps, grouped = (p.groups + ctas - 1) / ctas * p.rounds;
  if (g_pool_override < 0 && pooled >= grouped) return false;
  p.rounds = (int)r1;
  grid = (unsigned)ctas;
  return true;
}

template <int F>
void launch(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, Stream stream,
            const Extra& e, int nt, int64_t ldy) {
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
  p.glu_ld = x.glu_ld;
  p.glu_scratch = (int64_t)glu_scratch_off<F>(w.k, nt);
  p.ldy = ldy;
  p.x_stride = (int64_t)staged_stride<F>(w.k);
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
  const int mb = epi == kEpiNorm ? 1 : epi != kEpiPlain || mv1_mode() < 2 || nt > 1 ? min_blocks(F) : mv1_mode();
  const bool exact = mb != 3 && exact_rounds(F, geo) && !exact_off();
  Key key = nt > 1 ? few_key(epi, exact, nt) : pick_instance(F, mb, epi, exact, x.glu_src != nullptr, w.k);
  const int per_sm = std::max(1, g_resident[F][variant_of(key)][(w.k - 1) / kKBucket]);
  const int64_t ctas = (int64_t)g_sm_count * per_sm;
  choose_split(p, ctas, tie_by_warps(F, epi == kEpiGlu), epi == kEpiGlu, epi == kEpiNorm);
  unsigned grid = (unsigned)std::min<int64_t>(p.groups, ctas);
  p.groups_q = p.groups / (int)grid;
  p.groups_r = p.groups % (int)grid;
  if (epi == kEpiRope && nt == 1) {  // the lean RoPE instance may hand over to its pooled twin
    const int64_t pool_ctas = (int64_t)g_sm_count * std::max(1, matvec1_pool_resident(F, exact, w.k));
    if (key.epi == kEpiRope && matvec1_pool_kernel(F, exact) && plan_pool(p, ctas, pool_ctas, grid))
      key.run = kRunPool;
    g_last_pool = key.run == kRunPool ? 1 : 0;
  }
  const size_t smem = x.glu_src ? smem_bytes_glu<F>(w.k, nt) : smem_rows<F>(w.k, nt);
  // The twin lives in matvec1_pool.cu: the same kernel signature, its parameter struct from the same header.
  const Mv1Kernel kernel = nt > 1                  ? few_kernel<F>(epi, exact, nt)
                           : key.run == kRunPool ? reinterpret_cast<Mv1Kernel>(matvec1_pool_kernel(F, exact))
                                                 : kernel_of<F>(key);
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
    case kQ8_0: launch<kQ8_0>(w, x, d_y, n_out, accumulate, stream, e, 1, 0); return true;
    case kQ4_0: launch<kQ4_0>(w, x, d_y, n_out, accumulate, stream, e, 1, 0); return true;
    case kMXFP4: launch<kMXFP4>(w, x, d_y, n_out, accumulate, stream, e, 1, 0); return true;
    case kQ4_K: launch<kQ4_K>(w, x, d_y, n_out, accumulate, stream, e, 1, 0); return true;
    case kTQ2: launch<kTQ2>(w, x, d_y, n_out, accumulate, stream, e, 1, 0); return true;
    case kF16:
    case kBF16:
      MERLIN_CHECK(!e.norm_out, "matvec1: no RMSNorm epilogue for F16/BF16 rows");
      return matvec1_half(w, x, d_y, n_out, accumulate, stream, e.rope, e.glu_out, e.glu_up_row);
    default: return false;
  }
}

// 2-4 tokens (matvec_few_fits has said yes): the same checks as dispatch, then launch with NT = n.
void dispatch_few(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows,
                  bool accumulate, Stream stream, const Extra& e = {}) {
  MERLIN_CHECK(x.kind == w.act() && x.k == w.k && n <= x.n_cap && x.q && x.scale,
               "matvec_few: the activations' row planes do not fit the matrix");
  MERLIN_CHECK(!x.rms_part || (x.rms_in_rows && x.rms_rows == n && x.rms_block == 32),
               "matvec_few: a deferred RMSNorm that was not written in row planes for ", n, " tokens");
  MERLIN_CHECK(!x.glu_src || (matvec1_glu_fits(w) && !x.rms_part && !e.argmax && !e.rope),
               "matvec_few: a SwiGLU row for a product that cannot compute it while staging");
  MERLIN_CHECK(!e.rope || (!e.norm_out && !e.argmax && !accumulate), "matvec_few: RoPE is the QKV product's only epilogue");
  MERLIN_CHECK(!e.glu_out, "matvec_few: no SwiGLU epilogue for several tokens");
  const int64_t n_out = std::min(n_out_rows, w.rows);
  if (n_out <= 0) return;
  switch (w.fmt) {
    case kQ8_0: launch<kQ8_0>(w, x, d_y, n_out, accumulate, stream, e, n, ldy); return;
    case kQ4_0: launch<kQ4_0>(w, x, d_y, n_out, accumulate, stream, e, n, ldy); return;
    case kMXFP4: launch<kMXFP4>(w, x, d_y, n_out, accumulate, stream, e, n, ldy); return;
    default: fail("matvec_few: no 2-4-token kernel for this format");
  }
}

}  // namespace

bool matvec1(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out_rows, bool accumulate, Stream stream) {
  return dispatch(w, x, d_y, n_out_rows, accumulate, stream);
}

// MERLIN_CUDA_FEW (read once): 0 = 2-4-token steps always take the batched products, 1 = they take the
// multi-token instances wherever those fit, unset = where they measured faster (matvec_few_pays).
static int few_env() {
  static const int mode = env_is("MERLIN_CUDA_FEW", "0") ? 0 : env_is("MERLIN_CUDA_FEW", "1") ? 1 : 2;
  return mode;
}
static int g_few_mode = -1;  // set_matvec_few (tests)
static int few_mode() { return g_few_mode >= 0 ? g_few_mode : few_env(); }

bool matvec_few_fits(const Matrix& w, int n) {
  return mv1_mode() != 0 && g_sm_count > 0 && n >= 2 && n <= kFewMax &&
         (w.fmt == kQ8_0 || w.fmt == kQ4_0 || w.fmt == kMXFP4) && w.k > 0 && w.k <= kFewMaxK && w.k % 32 == 0;
}

// H200 tg128, fortieth session (docs/BENCHMARKS.md, same call), multi-token instances / batched products:
// iphone (rows of 3,072 and 12,288) q4_0 x2 2,017 / 1,616 t/s, x3 2,370 / 2,391 (2,502 / 2,363 in another
// call), x4 2,678 / 3,194; q8_0 x2 1,479 / 1,402, x3 1,922 / 2,082; mxfp4 x2 1,504 / 1,137, x3 1,858 /
// 1,696, x4 2,162 / 2,249; macbook q4_0 x2 1,199 / 933, x3 1,444 / 1,386; base (768, 2,048) q4_0 x2 7,035 /
// 7,723, x4 9,401 / 14,961. Each extra token costs every kernel ~1 us of staging, dp4a sums and epilogue
// (base's Wo 2.3 us at one token, 5.5 at four), which long rows amortize and short ones do not, while the
// batched kernels' 8-token tensor-core tiles take 2-8 tokens for about the price of one. So: 2 tokens, and 3
// for Q4_0 / MXFP4, over rows of 3,072 or more.
bool matvec_few_pays(const Matrix& w, int n) {
  const int mode = few_mode();
  return mode != 0 && matvec_few_fits(w, n) && (mode == 1 || ((n == 2 || (n == 3 && w.fmt != kQ8_0)) && w.k >= 3072));
}
void set_matvec_few(int mode) { g_few_mode = mode; }

bool matvec_few(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out_rows, bool accumulate,
                Stream stream) {
  if (!matvec_few_fits(w, n)) return false;
  dispatch_few(w, x, n, d_y, ldy, n_out_rows, accumulate, stream);
  return true;
}

bool matvec_few_rope_kv(const Matrix& w, const ActBuf& x, int n, float* d_qkv, int64_t ldy, const RopeKvArgs& r,
                        Stream stream) {
  if (!matvec_few_fits(w, n)) return false;
  // Each token asks its own context into L2: the budget is shared (n contexts of 1 / n of its positions).
  RopeKvArgs rn = r;
  rn.l2_positions = r.l2_positions / n;
  Extra e;
  e.rope = &rn;
  dispatch_few(w, x, n, d_qkv, ldy, w.rows, false, stream, e);
  return true;
}

bool matvec_few_norm(const Matrix& w, const ActBuf& x, int n, float* d_y, int64_t ldy, int64_t n_out, bool accumulate,
                     const float* d_norm_w, ActBuf& out, double* d_part, Stream stream) {
  if (!matvec_few_fits(w, n) || !norm_fold_fits(w, n_out)) return false;
  MERLIN_CHECK(out.kind == ActKind::Q8_0 && out.k == n_out && out.n_cap >= n && out.q && out.scale && d_part && d_norm_w,
               "matvec_few_norm: the output must be Q8_0 rows of ", n_out, " elements for ", n, " tokens");
  Extra e;
  e.norm_w = d_norm_w;
  e.norm_out = &out;
  e.norm_part = d_part;
  dispatch_few(w, x, n, d_y, ldy, n_out, accumulate, stream, e);
  return true;
}

bool matvec_few_argmax(const Matrix& w, const ActBuf& x, int n, int64_t n_out, unsigned long long* d_keys,
                       Stream stream) {
  if (!matvec_few_fits(w, n) || w.rows > 0xFFFFFFFFll) return false;
  MERLIN_CHECK(d_keys && n_out > 0, "matvec_few_argmax: no key slots or no rows");
  Extra e;
  e.argmax = d_keys;
  dispatch_few(w, x, n, nullptr, 0, n_out, false, stream, e);
  return true;
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
void set_matvec1_pool(int mode) { g_pool_override = mode; }
int matvec1_last_pool() { return g_last_pool; }
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
  init_matvec1_pool_kernels();
  MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
}

}  // namespace merlin::cuda
