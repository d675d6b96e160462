// Single-token products for F16/BF16 matrices (matvec1.h), over their row-major storage (matrix_layout.cuh).
//
// The tensor-core product (matmul.cu) needs rows g and g + 8 in every lane, so each of its loads touches 16
// rows at 64 bytes each; that streamed 70 % of the copy bandwidth at one token, against 93 % for the same
// kernel on the earlier fragment-ordered copy. Here a warp owns two whole rows and reads each 512 bytes at a
// time (16 bytes per lane), in items of 4 such loads per row, the next item in flight while the current one
// computes (as in matmul.cu). Weights are widened to f32 and multiplied with the token's activation, staged
// once per CTA in shared memory as hi + lo (the same value the tensor-core product sees), in f32 FMAs; the
// row's 32 lane sums meet in a fixed shuffle order, so results are deterministic.
//
// With glu_on (matvec1_swiglu) a warp's pair is gate row j and up row j of a stacked [gate; up] matrix, and
// its lane 0 writes silu(gate) * up as element j of the down product's input (F16, BF16 or F32: formats
// emitted element by element) with act_impl.cuh's swiglu() and emit(): the bits of the product followed by
// prep_act(SwiGlu), one kernel less per layer.
#include <algorithm>

#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fragment.cuh"
#include "kernels/cuda/matrix_layout.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/rope_kv.cuh"

namespace merlin::cuda {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRows = 2;                       // rows per warp
constexpr int kLoads = 4;                      // 16-byte loads per row and item
constexpr int64_t kItemCols = 32 * 8 * kLoads;  // 1024 columns per item
constexpr int64_t kMaxK = 16384;               // staged activations: ld floats (64 KiB)

struct HalfArgs {
  const uint16_t* w;
  int64_t ld, k;
  int64_t groups;     // row pairs (rows are padded to 16)
  int items;          // items per row pair: ceil(ld / kItemCols)
  const uint16_t* xhi;
  const uint16_t* xlo;
  float* y;
  int64_t n_out;
  int accumulate;
  int rope_on;  // rows 2j and 2j + 1 (one warp's pair) go through rope_store (matmul_rope_kv)
  RopeKvArgs rope;
  int rope_cs;  // rope_on: each warp copies the token's cos / sin row to shared memory before pdl_wait
  int glu_on;          // pair j = rows j and glu_up_row + j; the output goes to glu_out
  int64_t glu_up_row;
  ActBuf glu_out;
};

// The two rows of pair `grp`: consecutive, or gate row grp and its up row.
__device__ __forceinline__ int64_t pair_row(const HalfArgs& p, int64_t grp, int i) {
  return p.glu_on ? grp + i * p.glu_up_row : grp * kRows + i;
}

struct HalfRound {
  uint4 w[kRows][kLoads];
};

__device__ __forceinline__ void load_item(const HalfArgs& p, int64_t grp, int it, int lane, HalfRound& r) {
  const int64_t col0 = it * kItemCols + 8 * lane;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const uint16_t* base = p.w + pair_row(p, grp, i) * p.ld + col0;
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (col0 + 256 * u < p.ld) r.w[i][u] = load_stream(reinterpret_cast<const uint4*>(base + 256 * u));
  }
}

// Element j of the down product's input: silu(gate) * up in glu_out's format (lane 0 of the pair's warp).
__device__ __forceinline__ void emit_glu(const HalfArgs& p, int64_t j, float g, float u) {
  ActBuf o = p.glu_out;
  const float v = swiglu(g, u);
  switch (o.kind) {
    case ActKind::F16: emit<(int)ActKind::F16>(v, true, 0, j, o); break;
    case ActKind::BF16: emit<(int)ActKind::BF16>(v, true, 0, j, o); break;
    default: emit<(int)ActKind::F32>(v, true, 0, j, o); break;
  }
}

template <bool BF>
__device__ __forceinline__ float2 widen(uint32_t v) {
  if constexpr (BF) return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
  else return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <bool BF>
__device__ __forceinline__ void compute_item(const HalfArgs& p, const HalfRound& r, int it, int lane, const float* xs,
                                             float (&acc)[kRows]) {
  const int64_t col0 = it * kItemCols + 8 * lane;
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int64_t col = col0 + 256 * u;
    if (col >= p.ld) break;
    const float4 xa = *reinterpret_cast<const float4*>(xs + col), xb = *reinterpret_cast<const float4*>(xs + col + 4);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const uint4 w = r.w[i][u];
      const float2 w0 = widen<BF>(w.x), w1 = widen<BF>(w.y), w2 = widen<BF>(w.z), w3 = widen<BF>(w.w);
      float s = acc[i];
      s = fmaf(w0.x, xa.x, s);
      s = fmaf(w0.y, xa.y, s);
      s = fmaf(w1.x, xa.z, s);
      s = fmaf(w1.y, xa.w, s);
      s = fmaf(w2.x, xb.x, s);
      s = fmaf(w2.y, xb.y, s);
      s = fmaf(w3.x, xb.z, s);
      s = fmaf(w3.y, xb.w, s);
      acc[i] = s;
    }
  }
}

// x = hi + lo as f32, zero past k up to ld; all of a thread's loads are issued before its first store.
template <bool BF>
__device__ __forceinline__ void stage_x(const HalfArgs& p, float* xs) {
  constexpr int kBatch = 8;
  const int64_t n4 = p.ld / 4;
  for (int64_t b = 0; b < n4; b += (int64_t)kThreads * kBatch) {
    uint2 h[kBatch], l[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = b + j * kThreads + threadIdx.x;
      h[j] = l[j] = make_uint2(0, 0);
      if (i * 4 < p.k) {
        h[j] = *reinterpret_cast<const uint2*>(p.xhi + i * 4);
        l[j] = *reinterpret_cast<const uint2*>(p.xlo + i * 4);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t i = b + j * kThreads + threadIdx.x;
      if (i >= n4) break;
      const float2 h0 = widen<BF>(h[j].x), h1 = widen<BF>(h[j].y), l0 = widen<BF>(l[j].x), l1 = widen<BF>(l[j].y);
      reinterpret_cast<float4*>(xs)[i] = make_float4(h0.x + l0.x, h0.y + l0.y, h1.x + l1.x, h1.y + l1.y);
    }
  }
  __syncthreads();
}

// Persistent: warp w of CTA b takes row pairs b * kWarps + w, + gridDim.x * kWarps, ...; its items are those
// pairs' column ranges in order. The first item is requested before pdl_wait (weights are immutable).
template <bool BF>
__global__ void __launch_bounds__(kThreads, 2) mv1_half_kernel(HalfArgs p) {
  extern __shared__ __align__(16) float xs[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t gw = (int64_t)blockIdx.x * kWarps + warp, nw = (int64_t)gridDim.x * kWarps;
  const int64_t my_groups = gw < p.groups ? (p.groups - gw + nw - 1) / nw : 0;
  const int64_t n_items = my_groups * p.items;
  auto group_of = [&](int64_t i) { return gw + i / p.items * nw; };
  HalfRound ra{}, rb{};
  if (n_items > 0) load_item(p, group_of(0), 0, lane, ra);
  RopeTarget at = p.rope_on ? rope_target(p.rope) : RopeTarget{};
  if (p.rope_on && warp == kWarps - 1) prefetch_kv_context(p.rope, lane);
  __shared__ __align__(16) float cs_rows[kWarps][kRopeCsMax];  // rope_cs: each warp's copy of the row
  if (p.rope_cs) copy_cs_row(at, p.rope.n_rot, cs_rows[warp], lane);
  pdl_trigger();
  pdl_wait();
  stage_x<BF>(p, xs);
  float acc[kRows] = {};
  auto item = [&](int64_t i, const HalfRound& now, HalfRound& next) {
    if (i + 1 < n_items) load_item(p, group_of(i + 1), (int)((i + 1) % p.items), lane, next);
    const int it = (int)(i % p.items);
    compute_item<BF>(p, now, it, lane, xs, acc);
    if (it == p.items - 1) {
      float v[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        v[r] = warp_sum(acc[r]);
        acc[r] = 0.f;
      }
      static_assert(kRows == 2, "a warp's rows are one RoPE pair");
      if (p.glu_on) {
        if (lane == 0 && group_of(i) < p.n_out) emit_glu(p, group_of(i), v[0], v[1]);
        return;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = group_of(i) * kRows + r;
        if (lane != 0 || row >= p.n_out) continue;
        if (p.rope_on) rope_store(p.rope, p.y, row, v[r], v[r ^ 1], at);
        else p.y[row] = p.accumulate ? p.y[row] + v[r] : v[r];
      }
    }
  };
  for (int64_t i = 0; i < n_items; i += 2) {
    item(i, ra, rb);
    if (i + 1 < n_items) item(i + 1, rb, ra);
  }
}

int g_sm_count = 0;
int g_resident[2] = {};  // CTAs per SM at the largest staging (F16, BF16)

}  // namespace

bool matvec1_half(const Matrix& w, const ActBuf& x, float* d_y, int64_t n_out, bool accumulate, Stream stream,
                  const RopeKvArgs* rope, const ActBuf* glu_out, int64_t glu_up_row) {
  const int64_t ld = half_ld(w.k);
  if (!half_fmt(w.fmt) || ld > kMaxK || g_sm_count == 0) return false;
  HalfArgs p{};
  p.w = reinterpret_cast<const uint16_t*>(w.q);
  p.ld = ld;
  p.k = w.k;
  p.groups = glu_out ? n_out : w.rows / kRows;
  if (glu_out) {
    p.glu_on = 1;
    p.glu_up_row = glu_up_row;
    p.glu_out = *glu_out;
  }
  p.items = (int)((ld + kItemCols - 1) / kItemCols);
  p.xhi = x.hi;
  p.xlo = x.lo;
  p.y = d_y;
  p.n_out = n_out;
  p.accumulate = accumulate ? 1 : 0;
  p.rope_on = rope ? 1 : 0;
  if (rope) p.rope = *rope;
  p.rope_cs = rope && rope_cs_pays(*rope) ? 1 : 0;
  const bool bf = w.fmt == kBF16;
  const int64_t ctas = (int64_t)g_sm_count * std::max(1, g_resident[bf ? 1 : 0]);
  const unsigned grid = (unsigned)std::min<int64_t>((p.groups + kWarps - 1) / kWarps, ctas);
  const size_t smem = (size_t)ld * 4;
  // The driver's carveout unless MERLIN_CUDA_CARVEOUT_MV1 sets one (A/B timing). H200 tg128, the driver's
  // choice / 100 %: the default model (f16) 7,584-7,602 / 7,604-7,638 t/s, iphone bf16 539.1-539.3 / 503.4-503.7,
  // macbook bf16 269.0 / 256.0 (docs/BENCHMARKS.md, thirty-seventh session).
  const auto kernel = bf ? mv1_half_kernel<true> : mv1_half_kernel<false>;
  apply_carveout(reinterpret_cast<const void*>(kernel), carveout_mv1_pct());
  launch_pdl(kernel, dim3(grid), dim3(kThreads), smem, stream, p);
  check_launch("matvec1 half");
  return true;
}

bool matvec1_half_fits(const Matrix& w) { return half_fmt(w.fmt) && half_ld(w.k) <= kMaxK; }

void init_matvec1_half_kernels() {
  int dev = 0;
  MERLIN_CUDA_CHECK(cudaGetDevice(&dev));
  MERLIN_CUDA_CHECK(cudaDeviceGetAttribute(&g_sm_count, cudaDevAttrMultiProcessorCount, dev));
  const int smem = (int)(kMaxK * 4);
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(mv1_half_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MERLIN_CUDA_CHECK(cudaFuncSetAttribute(mv1_half_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[0], mv1_half_kernel<false>, kThreads, smem));
  MERLIN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&g_resident[1], mv1_half_kernel<true>, kThreads, smem));
}

}  // namespace merlin::cuda
