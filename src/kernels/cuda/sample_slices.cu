// sample_rows with a row's slices on many CTAs (ops.h; the design is at the top of this file's kernels).
#include "kernels/cuda/sample_impl.cuh"

namespace merlin::cuda {
namespace {

// ---- Split sampling: a row's slices on many CTAs ----
// One CTA per row (sample.cu) walks 50K logits in a chain of dependent L2 round trips and spends most of a
// microsecond per element group on double exps: tens of microseconds a token. Here a row is cut into slices
// of kSlice logits, each on its own CTA: slice_kernel applies the slice's adjustments and finds its maximum
// and, for filtered rows, its best tokens (radix select); slice_sums_kernel, once the row's maximum is
// known, sums the slice's weights (unfiltered draws, top-p without top-k) and counts min-p's survivors;
// finish_kernel (one CTA per row) combines the slices in slice order: the draw's slice and the token inside
// it, or the row's best tokens merged from the slices' (draw_filtered_split), falling back to the one-CTA
// radix select (draw_filtered) when the slices' candidates do not cover what the filters keep.
// How many candidates each slice of a filtered row hands over: what top-k needs, else kSliceCand.
__device__ __forceinline__ int slice_depth(const RowSampling& rs, int64_t n) {
  return rs.top_k > 0 && rs.top_k < n ? min(rs.top_k, kSliceCand) : kSliceCand;
}

// The threshold code of the `want` best among the CTA's codes (4 per thread, 0 = none, at least `want`
// valid): radix select over the 64-bit codes, 8 bits a pass from the top, until the bin that holds the
// want-th best is taken whole. The `want` best are then exactly the codes >= the result. Lanes of a warp
// that hit the same bin add once (match_any): the first passes' bins are few and crowded.
template <int N>
__device__ unsigned long long select_codes(const unsigned long long (&code)[4], int want) {
  __shared__ int hist[256];
  __shared__ int s_bin, s_want, s_count;
  unsigned long long prefix = 0, mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += N) hist[b] = 0;
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const bool in = code[q] != 0 && (code[q] & mask) == prefix;
      const unsigned int bin = in ? (unsigned int)(code[q] >> shift) & 255u : 256u;
      const unsigned int same = __match_any_sync(0xffffffffu, bin);
      if (in && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) find_bin_from_top(hist, want, &s_bin, &s_want, &s_count);
    __syncthreads();
    prefix |= (unsigned long long)s_bin << shift;
    const bool whole = s_count == s_want;
    want = s_want;
    mask |= 255ull << shift;
    __syncthreads();  // the next pass rewrites the shared values
    if (whole) break;
  }
  return prefix;
}


template <int N>
__device__ Best block_best(Best b) {
  __shared__ Best warps[N / 32];
  b = warp_best(b);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[w] = b;
  __syncthreads();
  if (w == 0) {
    b = warp_best(lane < N / 32 ? warps[lane] : Best{-INFINITY, INT_MAX});
    if (lane == 0) warps[0] = b;
  }
  __syncthreads();
  b = warps[0];
  __syncthreads();  // a next call may overwrite warps[]
  return b;
}

// Sum over the CTA in a fixed tree (thread order inside warps, then warp order): deterministic.
template <int N>
__device__ double block_sum(double v) {
  __shared__ double warps[N / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) warps[w] = v;
  __syncthreads();
  if (w == 0) {
    v = lane < N / 32 ? warps[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) warps[0] = v;
  }
  __syncthreads();
  v = warps[0];
  __syncthreads();  // a next call may overwrite warps[]
  return v;
}

__device__ __forceinline__ bool row_filtered(const RowSampling& rs) {
  return rs.top_k > 0 || rs.top_p < 1.0f || rs.min_p > 0;
}

// Grid (slices, rows). Not launched with programmatic dependent launch: it follows a graph replay.
__global__ void __launch_bounds__(kSliceThreads) slice_kernel(float* __restrict__ logits, int64_t ld, int64_t n,
                                                              const RowSampling* __restrict__ rows,
                                                              const LogitAdjust* __restrict__ adjust,
                                                              SlicePart* __restrict__ parts,
                                                              unsigned long long* __restrict__ cands) {
  pdl_trigger();
  const int c = blockIdx.x, r = blockIdx.y, n_slices = gridDim.x;
  float* row = logits + (int64_t)r * ld;
  const RowSampling rs = rows[r];
  const int64_t b = (int64_t)c * kSlice, e = min(n, b + kSlice);
  for (int a = threadIdx.x; a < rs.n_adjust; a += kSliceThreads) {  // this slice's entries (one per token)
    const LogitAdjust x = adjust[rs.first + a];
    if (x.token < b || x.token >= e) continue;
    float l = row[x.token];
    if (x.flags & LogitAdjust::kBias) l = __fadd_rn(l, x.bias);
    if (x.flags & LogitAdjust::kPenalty) l = __fsub_rn(l, x.penalty);
    row[x.token] = l;
  }
  __syncthreads();  // orders the adjusted logits (global memory) before the reads below
  float v[4];
  Best best{-INFINITY, INT_MAX};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t i = b + threadIdx.x + q * kSliceThreads;
    v[q] = i < e ? row[i] : 0.0f;
    if (i < e) best = better(best, Best{v[q], (int)i});
  }
  best = block_best<kSliceThreads>(best);
  SlicePart* part = parts + (int64_t)r * n_slices + c;
  if (threadIdx.x == 0) part->best = best;
  if (!(rs.temperature > 0 && row_filtered(rs))) return;
  // The slice's `depth` best codes, in no particular order, and the worst of them.
  unsigned long long code[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t i = b + threadIdx.x + q * kSliceThreads;
    code[q] = i < e ? cand_code(order_key(v[q]), i) : 0ull;
  }
  const int depth = (int)min((int64_t)slice_depth(rs, n), e - b);
  const unsigned long long threshold = depth < e - b ? select_codes<kSliceThreads>(code, depth) : 1ull;
  __shared__ int n_out;
  __shared__ unsigned long long worst;
  if (threadIdx.x == 0) n_out = 0, worst = ~0ull;
  __syncthreads();
  unsigned long long* out = cands + ((int64_t)r * n_slices + c) * kSliceCand;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (code[q] == 0 || code[q] < threshold) continue;
    out[atomicAdd(&n_out, 1)] = code[q];
    atomicMin(&worst, code[q]);
  }
  __syncthreads();
  if (threadIdx.x == 0) part->last = worst, part->n_cand = n_out;
}

// Grid (slices, rows): the sums that need the row's maximum. Rows that need none return at once.
__global__ void __launch_bounds__(kSliceThreads) slice_sums_kernel(const float* __restrict__ logits, int64_t ld,
                                                                   int64_t n, const RowSampling* __restrict__ rows,
                                                                   SlicePart* __restrict__ parts) {
  pdl_trigger();
  const int c = blockIdx.x, r = blockIdx.y, n_slices = gridDim.x;
  const RowSampling rs = rows[r];  // written before slice_kernel started
  const bool filtered = row_filtered(rs), top_k_on = rs.top_k > 0 && rs.top_k < n;
  const bool want_sum = !filtered || (!top_k_on && rs.top_p < 1.0f);
  const bool want_count = filtered && !top_k_on && rs.min_p > 0;
  pdl_wait();  // even when returning: finish_kernel's wait covers slice_kernel only through this one
  if (rs.temperature <= 0 || !(want_sum || want_count)) return;
  const float* row = logits + (int64_t)r * ld;
  // The row's maximum from the slices' (each thread one slice: the loads overlap, unlike one thread's loop).
  float m = -INFINITY;
  for (int q = threadIdx.x; q < n_slices; q += kSliceThreads) m = fmaxf(m, parts[(int64_t)r * n_slices + q].best.v);
  const float mx = block_best<kSliceThreads>(Best{m, 0}).v;
  // sample_row's weights: exp((l - max) / T) for an unfiltered draw, exp(l - max) for top-p and min-p.
  const double inv_t = filtered ? 1.0 : 1.0 / (double)rs.temperature;
  const int64_t b = (int64_t)c * kSlice, e = min(n, b + kSlice);
  double sum = 0, count = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t i = b + threadIdx.x + q * kSliceThreads;
    if (i >= e) continue;
    const double w = exp((double)(row[i] - mx) * inv_t);
    sum += w;
    count += w >= rs.min_p ? 1.0 : 0.0;
  }
  sum = block_sum<kSliceThreads>(sum);
  count = block_sum<kSliceThreads>(count);
  if (threadIdx.x == 0) {
    parts[(int64_t)r * n_slices + c].sum = sum;
    parts[(int64_t)r * n_slices + c].count = (long long)count;
  }
}

// The unfiltered draw from the slices' sums: the slice holding u * total (slice order), then its weights
// scanned in order to find the token, as draw_whole_row does inside one thread's slice.
__device__ int32_t draw_split(const float* row, int64_t n, const SlicePart* parts, int n_slices, double inv_t,
                              double u) {
  __shared__ int s_slice;
  __shared__ double s_left;
  __shared__ float s_max;
  if (threadIdx.x == 0) {
    double total = 0;
    float m = -INFINITY;
    for (int q = 0; q < n_slices; ++q) total += parts[q].sum, m = fmaxf(m, parts[q].best.v);
    const double r = u * total;
    double prefix = 0;
    int at = -1;
    for (int q = 0; q < n_slices && at < 0; ++q) {
      if (r < prefix + parts[q].sum) at = q;
      else prefix += parts[q].sum;
    }
    s_slice = at;
    s_left = r - prefix;
    s_max = m;
  }
  __syncthreads();
  if (s_slice < 0) return (int32_t)(n - 1);  // the host loop's answer when rounding leaves r >= total
  const int64_t b = (int64_t)s_slice * kSlice, e = min(n, b + kSlice);
  static_assert(kSlice == 2 * kThreads, "two weights per thread");
  const int64_t i0 = b + 2 * threadIdx.x, i1 = i0 + 1;
  const double w0 = i0 < e ? exp((double)(row[i0] - s_max) * inv_t) : 0.0;
  const double w1 = i1 < e ? exp((double)(row[i1] - s_max) * inv_t) : 0.0;
  double unused;
  const double before = block_exclusive_scan(w0 + w1, &unused);
  __shared__ int pick;
  if (threadIdx.x == 0) pick = (int)(e - 1);  // rounding left nothing below zero in the slice
  __syncthreads();
  if (i0 < e && s_left - (before + w0) < 0) atomicMin(&pick, (int)i0);
  else if (i1 < e && s_left - (before + w0 + w1) < 0) atomicMin(&pick, (int)i1);
  __syncthreads();
  return pick;
}

constexpr int32_t kMore = -3;  // draw_filtered_split: more candidates needed than merged, with top-k

// The filtered draw from the slices' candidates, when they cover what the filters keep: else kMore (top-k
// on: draw_filtered's 1024 candidates may do) or kNucleus (no top-k: sample_nucleus.cu).
// Each slice handed over its `depth` best (slice_depth); those at or above the best of the full slices'
// worst candidates are exactly the row's best (a slice's tokens at or above that bound are among its depth
// best). The kPickMax best of them go to pick_filtered.
__device__ int32_t draw_filtered_split(const float* row, int64_t n, const RowSampling& rs, const SlicePart* parts,
                                       const unsigned long long* cands, int n_slices) {
  extern __shared__ unsigned long long merged[];  // kMergeMax (dynamic shared memory)
  __shared__ unsigned long long s_bound;
  __shared__ int s_count;
  __shared__ RowStats s_stats;
  const bool top_k_on = rs.top_k > 0 && rs.top_k < n;
  const int depth = slice_depth(rs, n);
  if (threadIdx.x == 0) {
    RowStats st;  // what slice_sums_kernel summed for this row
    unsigned long long bound = 0;
    for (int q = 0; q < n_slices; ++q) {
      if (!top_k_on && rs.top_p < 1.0f) st.total += parts[q].sum;
      if (!top_k_on && rs.min_p > 0) st.count += parts[q].count;
      if (min(n, (int64_t)(q + 1) * kSlice) - (int64_t)q * kSlice > depth) bound = max(bound, parts[q].last);
    }
    s_stats = st;
    s_bound = bound;
    s_count = 0;
  }
  __syncthreads();
  const RowStats st = s_stats;
  const unsigned long long bound = s_bound;
  const int64_t need = top_k_on ? rs.top_k : rs.min_p > 0 ? max(st.count, 1ll) : 0;  // 0: unknown (top-p)
  // Without top-k, a set larger than the merged candidates goes to the mass-weighted radix selects
  // (sample_nucleus.cu); a top-k above them to one CTA's 1024 candidates.
  const int32_t more = top_k_on ? kMore : kNucleus;
  if (need > kPickMax) return more;
  for (int q = threadIdx.x; q < n_slices * depth; q += kThreads) {
    const int slice = q / depth, j = q - slice * depth;
    if (j >= parts[slice].n_cand) continue;
    const unsigned long long x = cands[(int64_t)slice * kSliceCand + j];
    if (x < bound) continue;
    const int at = atomicAdd(&s_count, 1);
    if (at < kMergeMax) merged[at] = x;
  }
  __syncthreads();
  const int count = s_count;
  if (count > kMergeMax || count < need) return more;
  if (count <= kThreads) {
    rank_sort_desc(merged, count);
  } else {
    int len = 1;
    while (len < count) len <<= 1;
    for (int q = count + threadIdx.x; q < len; q += kThreads) merged[q] = 0;
    bitonic_sort_desc<kThreads>(merged, len);
  }
  const int32_t token = pick_filtered(merged, min(count, kPickMax), n, rs, st);
  return token >= 0 ? token : more;
}

__global__ void __launch_bounds__(kThreads, 1) finish_kernel(float* __restrict__ logits, int64_t ld, int64_t n,
                                                             const RowSampling* __restrict__ rows,
                                                             const SlicePart* __restrict__ parts,
                                                             const unsigned long long* __restrict__ cands,
                                                             int n_slices, int32_t* __restrict__ out) {
  const int r = blockIdx.x;
  const RowSampling rs = rows[r];
  pdl_wait();
  const float* row = logits + (int64_t)r * ld;
  // The row's slice records in shared memory, loaded by one thread each (the combining loops below run in
  // one thread, in slice order: from global memory each step would wait for its own round trip).
  __shared__ SlicePart row_parts[kMaxSlices];
  for (int q = threadIdx.x; q < n_slices; q += kThreads) row_parts[q] = parts[(int64_t)r * n_slices + q];
  __syncthreads();
  int32_t token;
  if (rs.temperature <= 0) {
    Best b{-INFINITY, INT_MAX};
    for (int q = 0; q < n_slices; ++q) b = better(b, row_parts[q].best);  // slice order: the first maximum
    token = b.i == INT_MAX ? 0 : b.i;
  } else if (row_filtered(rs)) {
    token = draw_filtered_split(row, n, rs, row_parts, cands + (int64_t)r * n_slices * kSliceCand, n_slices);
    if (token == kMore) token = draw_filtered(row, n, rs);
  } else {
    token = draw_split(row, n, row_parts, n_slices, 1.0 / (double)rs.temperature, rs.u);
  }
  if (threadIdx.x == 0) out[r] = token;
}

}  // namespace

size_t sample_rows_work_bytes(int n_rows, int64_t n) {
  return (size_t)n_rows * ((size_t)slice_count(n) * (sizeof(SlicePart) + kSliceCand * sizeof(unsigned long long)) +
                           sizeof(NucleusRow));
}

int64_t sliced_vocab_max() { return (int64_t)kMaxSlices * kSlice; }

void sample_rows_sliced(float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                        const LogitAdjust* d_adjust, int32_t* d_out, Stream stream, void* d_work) {
  const int n_slices = (int)slice_count(n);
  SlicePart* parts = work_parts(d_work);
  unsigned long long* cands = work_cands(d_work, n_rows, n);
  const dim3 grid(n_slices, n_rows);
  slice_kernel<<<grid, kSliceThreads, 0, stream>>>(d_logits, ld, n, d_rows, d_adjust, parts, cands);
  check_launch("sample_rows (slices)");
  launch_pdl(slice_sums_kernel, grid, kSliceThreads, 0, stream, (const float*)d_logits, ld, n, d_rows, parts);
  check_launch("sample_rows (sums)");
  static const bool smem_set = [] {
    MERLIN_CUDA_CHECK(cudaFuncSetAttribute(finish_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kMergeMax * (int)sizeof(unsigned long long)));
    return true;
  }();
  (void)smem_set;
  launch_pdl(finish_kernel, n_rows, kThreads, kMergeMax * sizeof(unsigned long long), stream, d_logits, ld, n,
             d_rows, (const SlicePart*)parts, (const unsigned long long*)cands, n_slices, d_out);
  check_launch("sample_rows (finish)");
}

}  // namespace merlin::cuda
