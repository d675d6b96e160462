// Device helpers shared by the sampling kernels (sample.cu: argmax and one CTA per row; sample_slices.cu: a
// row's slices on many CTAs): block reductions and scans in a fixed order, candidate codes that sort like
// sample_row's order (logit descending, then id), sorts, the radix select of one CTA and the filtered pick
// every path ends in. Included by those two files only (anonymous namespace: one copy each).
#pragma once
#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"

namespace merlin::cuda {
namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int i;
};

// argmax() in sampler.h keeps the first maximum; `b` replaces `a` only when larger, or equal at a lower index,
// so every reduction order gives the host's answer. NaN never wins (undefined on the host as well).
__device__ __forceinline__ Best better(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }

__device__ __forceinline__ Best warp_best(Best x) {
  for (int o = 16; o > 0; o >>= 1) {
    Best y{__shfl_xor_sync(0xffffffffu, x.v, o), __shfl_xor_sync(0xffffffffu, x.i, o)};
    x = better(x, y);
  }
  return x;
}

// Exclusive prefix sum of v over the CTA's threads in thread order, and the total (fixed order: deterministic).
// One thread writes *total before the scan's last barrier: it must point to shared memory.
__device__ double block_exclusive_scan(double v, double* total) {
  __shared__ double warps[kThreads / 32];
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  double incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const double up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) warps[w] = incl;
  __syncthreads();
  if (w == 0) {
    double t = warps[lane], ti = t;
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, ti, o);
      if (lane >= o) ti += up;
    }
    warps[lane] = ti - t;  // exclusive prefix of the warp totals
    if (lane == 31) *total = ti;
  }
  __syncthreads();
  return warps[w] + (incl - v);
}

// Candidates of a filtered draw: the kCand best tokens at most, found on the device. A row whose filters
// keep more (top-k above kCand, or a top-p / min-p set that does not fit) is left to the host.
constexpr int kCand = kThreads;

// Float order as unsigned order (NaN lowest: it never wins on the host either).
__device__ __forceinline__ uint32_t order_key(float v) {
  const uint32_t b = v == 0.0f ? 0u : __float_as_uint(v);  // -0 ties with +0, as on the host
  if (v != v) return 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
// Candidate order: key descending, then id ascending, as one descending 64-bit value (0: no candidate).
__device__ __forceinline__ unsigned long long cand_code(uint32_t key, int64_t id) {
  return ((unsigned long long)key << 32) | (0xFFFFFFFFu - (uint32_t)id);
}
__device__ __forceinline__ int32_t cand_id(unsigned long long c) { return (int32_t)(0xFFFFFFFFu - (uint32_t)c); }
// The logit a candidate code was made of (order_key inverted; NaN stays NaN).
__device__ __forceinline__ float cand_value(unsigned long long c) {
  const uint32_t k = (uint32_t)(c >> 32);
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// Sorts a[0 .. len) descending (len a power of two, a in shared memory, written before the call by any thread
// of the CTA); N threads, each taking pairs (i, i + j) of every step.
template <int N>
__device__ void bitonic_sort_desc(unsigned long long* a, int len) {
  __syncthreads();
  for (int k = 2; k <= len; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int q = threadIdx.x; q < len / 2; q += N) {
        const int i = ((q & ~(j - 1)) << 1) | (q & (j - 1)), p = i | j;
        const unsigned long long x = a[i], y = a[p];
        if ((i & k) == 0 ? x < y : x > y) {
          a[i] = y;
          a[p] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Sorts a[0 .. len) descending (distinct codes, len <= the CTA's threads, shared memory written before the
// call) by rank: thread j counts the codes above its own, reading them all in the same order (broadcasts).
// Two barriers instead of a bitonic network's dozens.
__device__ void rank_sort_desc(unsigned long long* a, int len) {
  __syncthreads();
  const int j = threadIdx.x;
  const unsigned long long x = j < len ? a[j] : 0ull;
  int rank = 0;
  if (j < len)
    for (int i = 0; i < len; ++i) rank += a[i] > x;
  __syncthreads();
  if (j < len) a[rank] = x;
  __syncthreads();
}

// Warp 0 of a radix-select pass: the bin (counted from 255 down) holding the want-th largest element
// counted in hist, written to *s_bin, with the rank it leaves inside that bin (*s_want) and, when s_count is
// not null, the bin's size. Lane L scans bins 255 - 8L .. 248 - 8L after a prefix sum of the lanes' totals.
__device__ __forceinline__ void find_bin_from_top(const int* hist, int want, int* s_bin, int* s_want, int* s_count) {
  const int lane = threadIdx.x & 31;
  int c[8], sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += c[j] = hist[255 - (lane * 8 + j)];
  int incl = sum;
  for (int o = 1; o < 32; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  int acc = incl - sum;
  if (acc < want && want <= incl) {
    for (int j = 0; j < 8; ++j) {
      if (acc + c[j] >= want) {
        *s_bin = 255 - (lane * 8 + j);
        *s_want = want - acc;
        if (s_count) *s_count = c[j];
        break;
      }
      acc += c[j];
    }
  }
}

// Radix select (8 bits a pass, from the top): the key T of the kCand-th best element, and how many of the
// elements equal to T belong to the kCand best (the lowest ids). Lanes of a warp that hit the same bin add
// once (match_any): the first pass's bins are few and crowded.
__device__ void select_threshold(const float* row, int64_t n, uint32_t& threshold, int& n_equal) {
  __shared__ int hist[256];
  __shared__ int s_bin, s_want;
  uint32_t prefix = 0, mask = 0;
  int want = kCand;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t base = 0; base < n; base += kThreads) {  // whole warps each round, for match_any
      const int64_t i = base + threadIdx.x;
      const uint32_t k = i < n ? order_key(row[i]) : 0u;
      const bool in = i < n && (k & mask) == prefix;
      const unsigned int bin = in ? (k >> shift) & 255u : 256u;
      const unsigned int same = __match_any_sync(0xffffffffu, bin);
      if (in && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) find_bin_from_top(hist, want, &s_bin, &s_want, nullptr);
    __syncthreads();
    prefix |= (uint32_t)s_bin << shift;
    want = s_want;
    mask |= 255u << shift;
  }
  threshold = prefix;
  n_equal = want;
}

// cand[0 .. min(n, kCand)) = the best tokens, sorted (key descending, then id); the rest 0.
__device__ void best_candidates(const float* row, int64_t n, unsigned long long* cand) {
  for (int j = threadIdx.x; j < kCand; j += kThreads) cand[j] = 0;
  __syncthreads();
  if (n <= kCand) {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) cand[i] = cand_code(order_key(row[i]), i);
  } else {
    uint32_t t;
    int n_equal;
    select_threshold(row, n, t, n_equal);
    __shared__ int n_above;
    if (threadIdx.x == 0) n_above = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t k = order_key(row[i]);
      if (k > t) cand[atomicAdd(&n_above, 1)] = cand_code(k, i);  // exactly kCand - n_equal of them
    }
    // The elements equal to t, lowest ids first: contiguous slices, ranked by a scan in thread order.
    const int64_t per = (n + kThreads - 1) / kThreads, b = min(n, (int64_t)threadIdx.x * per), e = min(n, b + per);
    int count = 0;
    for (int64_t i = b; i < e; ++i) count += order_key(row[i]) == t;
    double unused;
    int rank = (int)block_exclusive_scan((double)count, &unused);
    for (int64_t i = b; i < e && rank < n_equal; ++i)
      if (order_key(row[i]) == t) cand[kCand - n_equal + rank++] = cand_code(t, i);
  }
  bitonic_sort_desc<kThreads>(cand, kCand);
}

__device__ double block_total(double v) {
  __shared__ double total;
  block_exclusive_scan(v, &total);
  __syncthreads();  // total is written by warp 0 inside the scan, before its second barrier
  return total;
}

// What a filtered draw needs from the whole row when top-k is off: the normaliser of top-p (sum of
// exp(l - max) in double) and the number of tokens min-p keeps (exp(l - max) >= min_p).
struct RowStats {
  double total = 0;
  long long count = 0;
};

// sample_row's filtered draw over cand[0 .. n_valid), the n_valid (<= kPickMax) best tokens of a row of n,
// sorted (shared memory): top-k, then top-p, then min-p at temperature 1, then the tempered draw over the
// kept ones in candidate order. -1 when the filters may keep more than n_valid. Thread t owns candidates
// kPer * t .. kPer * t + kPer - 1, so the scans run in candidate order. Every thread gets the answer.
constexpr int kPer = 4;
constexpr int kPickMax = kPer * kThreads;
__device__ int32_t pick_filtered(const unsigned long long* cand, int64_t n_valid, int64_t n, const RowSampling& rs,
                                 const RowStats& st) {
  const int64_t j0 = (int64_t)kPer * threadIdx.x;
  const bool top_k_on = rs.top_k > 0 && rs.top_k < n;
  const int64_t k = top_k_on ? rs.top_k : n;
  if (top_k_on && k > n_valid) return -1;
  const float mx = cand_value(cand[0]);  // the best candidate: the row's maximum
  float l[kPer];
  double p1[kPer];  // probabilities at temperature 1, unnormalised
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    l[q] = j0 + q < n_valid ? cand_value(cand[j0 + q]) : -INFINITY;
    p1[q] = j0 + q < n_valid ? exp((double)(l[q] - mx)) : 0.0;
  }
  double total = st.total;
  if (top_k_on) {
    double s = 0;
    for (int q = 0; q < kPer; ++q) s += j0 + q < k ? p1[q] : 0.0;
    total = block_total(s);
  }
  int64_t bound = k;
  if (rs.min_p > 0) {
    // With top-k on, the count among the k best is min(k, the row's count): min-p keeps a prefix of the order.
    long long c = st.count;
    if (top_k_on) {
      double s = 0;
      for (int q = 0; q < kPer; ++q) s += j0 + q < k && p1[q] >= rs.min_p ? 1.0 : 0.0;
      c = (long long)block_total(s);
    }
    bound = min(bound, max((int64_t)c, (int64_t)1));
  }
  int64_t n_kept = bound;
  if (rs.top_p < 1.0f) {
    const int64_t lim = min(bound, n_valid);
    double p[kPer], s = 0;
    for (int q = 0; q < kPer; ++q) s += p[q] = j0 + q < lim ? p1[q] / total : 0.0;
    double unused;
    double cum = block_exclusive_scan(s, &unused);
    __shared__ int first_reached;
    if (threadIdx.x == 0) first_reached = INT_MAX;
    __syncthreads();
    for (int q = 0; q < kPer; ++q) {
      cum += p[q];
      if (j0 + q < lim && cum >= rs.top_p) {
        atomicMin(&first_reached, (int)(j0 + q));
        break;
      }
    }
    __syncthreads();
    if (first_reached != INT_MAX) n_kept = first_reached + 1;
  }
  if (n_kept > n_valid) return -1;
  n_kept = max(n_kept, (int64_t)1);
  const double inv_t = 1.0 / (double)rs.temperature;
  double w[kPer], s = 0;
  for (int q = 0; q < kPer; ++q) s += w[q] = j0 + q < n_kept ? exp((double)(l[q] - mx) * inv_t) : 0.0;
  __shared__ double sum;  // written by one thread of the scan: shared, or the others read garbage
  double before = block_exclusive_scan(s, &sum);
  __shared__ int pick;
  if (threadIdx.x == 0) pick = (int)(n_kept - 1);  // the host loop's answer when rounding leaves r >= 0
  __syncthreads();
  const double r = rs.u * sum;
  for (int q = 0; q < kPer; ++q) {
    if (j0 + q < n_kept && r >= before && r < before + w[q]) {
      atomicMin(&pick, (int)(j0 + q));  // the first, should rounding make two threads' ranges overlap
      break;
    }
    before += w[q];
  }
  __syncthreads();
  return cand_id(cand[pick]);
}

// The filtered draw by one CTA alone: the kCand best tokens by radix select over the row, the row's sums.
__device__ int32_t draw_filtered(const float* row, int64_t n, const RowSampling& rs) {
  __shared__ unsigned long long cand[kCand];
  best_candidates(row, n, cand);
  const float mx = cand_value(cand[0]);
  const bool top_k_on = rs.top_k > 0 && rs.top_k < n;
  RowStats st;
  if (!top_k_on && rs.top_p < 1.0f) {
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) s += exp((double)(row[i] - mx));
    st.total = block_total(s);
  }
  if (!top_k_on && rs.min_p > 0) {
    double c = 0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) c += exp((double)(row[i] - mx)) >= rs.min_p ? 1.0 : 0.0;
    st.count = (long long)block_total(c);
  }
  return pick_filtered(cand, min(n, (int64_t)kCand), n, rs, st);
}

// ---- The sliced path's layout (sample_slices.cu, sample_nucleus.cu) ----
constexpr int kSliceThreads = 512;
constexpr int kSlice = 4 * kSliceThreads;
constexpr int kSliceCand = 256;
constexpr int kMergeMax = 8192;  // merged candidates (64 KiB): every slice's kSliceCand of the GPT-2 vocabulary
constexpr int kMaxSlices = 128;  // vocabularies up to 262,144 tokens (larger ones: one CTA per row)

struct SlicePart {
  Best best;                // the slice's first largest logit (after adjustments)
  double sum;               // its weights' sum (slice order, fixed reduction tree)
  long long count;          // its min-p survivors
  unsigned long long last;  // the worst of its candidates (filtered rows)
  int n_cand;               // how many candidates it handed over: min(depth, slice length)
};

inline int64_t slice_count(int64_t n) { return (n + kSlice - 1) / kSlice; }

// Rows whose filters keep more than the merged candidates cover (top-p alone on a flat row, min-p keeping
// thousands) leave finish_kernel as kNucleus; sample_nucleus.cu then finds the top-p cut and the draw by
// radix selects over the row's codes weighted by probability mass, in fixed point so that sums do not
// depend on the order the CTAs add them (2^-44 per weight: the cut can differ from the host's double sums
// only where top-p or the uniform lands within ~1e-9 of a boundary).
constexpr int32_t kNucleus = kSampleMore;
struct NucleusRow {
  unsigned long long mass[256], max_code[256], min_code[256];  // this pass's bins (row-wide, atomics)
  int count[256];
  unsigned long long prefix, mask, above, total, cut;
  double target;
  float mx;
  int shift, phase, active;
  unsigned int arrivals;
};

// d_work: parts [n_rows][n_slices], then candidates [n_rows][n_slices][kSliceCand], then NucleusRow[n_rows].
inline SlicePart* work_parts(void* d_work) { return static_cast<SlicePart*>(d_work); }
inline unsigned long long* work_cands(void* d_work, int n_rows, int64_t n) {
  return reinterpret_cast<unsigned long long*>(work_parts(d_work) + (size_t)n_rows * slice_count(n));
}
inline NucleusRow* work_nucleus(void* d_work, int n_rows, int64_t n) {
  return reinterpret_cast<NucleusRow*>(work_cands(d_work, n_rows, n) + (size_t)n_rows * slice_count(n) * kSliceCand);
}

}  // namespace

// The sliced path (sample_slices.cu): sample_rows with d_work, for vocabularies of at most
// sliced_vocab_max() tokens.
int64_t sliced_vocab_max();
void sample_rows_sliced(float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                        const LogitAdjust* d_adjust, int32_t* d_out, Stream stream, void* d_work);

}  // namespace merlin::cuda
