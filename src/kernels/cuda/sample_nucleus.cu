// The rows finish_kernel leaves as kNucleus (sample_impl.cuh): filters without top-k that keep more tokens
// than the merged candidates hold. sample_row's order is the candidate codes' (logit descending, then id),
// so "the first tokens of the order whose probabilities reach top_p" is "the codes at or above the code
// where the cumulative mass, from the top, reaches top_p × total": a radix select over the codes in which
// each bin carries the mass of its tokens instead of their count. Phase 0 finds that cut (each pass: every
// slice adds its tokens' masses into the row's 256 bins of the next 8 bits of the code, among the tokens
// whose code matches the prefix found so far; the last slice to finish picks the bin where the mass from
// the top crosses the target); phase 1 runs the same search over the kept tokens with the draw's tempered
// weights and target u × their sum, which lands on the drawn token. A bin holding one token ends a phase,
// so each phase takes at most 8 passes (usually 3–5) and the host launches 16.
#include "kernels/cuda/sample_impl.cuh"

namespace merlin::cuda {
namespace {

constexpr double kFixedScale = 17592186044416.0;  // 2^44: a weight <= 1 in fixed point; 2^18 tokens fit in 62 bits

__device__ __forceinline__ unsigned long long fixed(double w) { return (unsigned long long)(w * kFixedScale + 0.5); }

// One CTA per row: the rows left as kNucleus start phase 0 (phase 1 when top-p is off: a large min-p set).
__global__ void nucleus_init_kernel(const RowSampling* __restrict__ rows, const SlicePart* __restrict__ parts,
                                    int n_slices, const int32_t* __restrict__ out, NucleusRow* __restrict__ nuc) {
  const int r = blockIdx.x;
  NucleusRow* s = nuc + r;
  const bool on = out[r] == kNucleus;
  if (threadIdx.x == 0) s->active = on;
  if (!on) return;
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    s->mass[b] = 0;
    s->count[b] = 0;
    s->max_code[b] = 0;
    s->min_code[b] = ~0ull;
  }
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int q = 0; q < n_slices; ++q) m = fmaxf(m, parts[(int64_t)r * n_slices + q].best.v);
    s->mx = m;
    s->phase = rows[r].top_p < 1.0f ? 0 : 1;
    s->shift = 56;
    s->prefix = s->mask = s->above = s->total = s->cut = 0;
    s->arrivals = 0;
  }
}

// After the last slice of a pass: the bin where the mass from the top crosses the phase's target. Runs in
// one thread over the bins staged in shared memory.
__device__ void nucleus_step(NucleusRow* s, const RowSampling& rs, const int* count, const unsigned long long* mass,
                             const unsigned long long* max_code, const unsigned long long* min_code, int32_t* out) {
  const bool first = s->prefix == 0 && s->mask == 0;
  if (first) {
    unsigned long long all = 0;
    for (int b = 0; b < 256; ++b) all += mass[b];
    // Phase 0: top_p of the whole row's mass (s->total, every token counted); phase 1: u of the kept mass.
    s->target = s->phase == 0 ? (double)rs.top_p * (double)s->total : rs.u * (double)all;
  }
  unsigned long long acc = s->above, lowest = ~0ull;
  int at = -1;
  for (int b = 255; b >= 0; --b) {
    if (count[b] == 0) continue;
    lowest = min(lowest, min_code[b]);
    const double reached = (double)(acc + mass[b]);
    if (s->phase == 0 ? reached >= s->target : reached > s->target) {  // cum >= top_p; left = r - cum < 0
      at = b;
      break;
    }
    acc += mass[b];
  }
  const bool last_pass = at >= 0 && (count[at] == 1 || s->shift == 0);
  if (s->phase == 0 && (at < 0 || last_pass)) {
    // The cut: the crossing token, or none (rounding, or min-p's set ended first): every kept token.
    s->cut = at < 0 ? 0 : max_code[at];
    s->phase = 1;
    s->shift = 56;
    s->prefix = s->mask = s->above = 0;
  } else if (s->phase == 1 && (at < 0 || last_pass)) {
    // The drawn token; none when rounding leaves u × sum at or past the end: the last kept, as the host.
    out[blockIdx.y] = cand_id(at < 0 ? lowest : max_code[at]);
    s->active = 0;
  } else {
    s->prefix |= (unsigned long long)at << s->shift;
    s->mask |= 255ull << s->shift;
    s->above = acc;
    s->shift -= 8;
  }
}

// Grid (slices, rows): one pass for every active row.
__global__ void __launch_bounds__(kSliceThreads) nucleus_pass_kernel(const float* __restrict__ logits, int64_t ld,
                                                                     int64_t n, const RowSampling* __restrict__ rows,
                                                                     NucleusRow* __restrict__ nuc,
                                                                     int32_t* __restrict__ out) {
  const int c = blockIdx.x, r = blockIdx.y;
  NucleusRow* s = nuc + r;
  if (!s->active) return;
  const RowSampling rs = rows[r];
  const int phase = s->phase, shift = s->shift;
  const unsigned long long prefix = s->prefix, mask = s->mask, cut = s->cut;
  const bool count_total = phase == 0 && prefix == 0 && mask == 0;
  const float mx = s->mx;
  __shared__ int count[256];
  __shared__ unsigned long long mass[256], max_code[256], min_code[256], total;
  for (int b = threadIdx.x; b < 256; b += kSliceThreads) count[b] = 0, mass[b] = 0, max_code[b] = 0, min_code[b] = ~0ull;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  const float* row = logits + (int64_t)r * ld;
  const int64_t b0 = (int64_t)c * kSlice, e = min(n, b0 + kSlice);
  const double inv_t = 1.0 / (double)rs.temperature;
  unsigned long long my_total = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t i = b0 + threadIdx.x + q * kSliceThreads;
    if (i >= e) continue;
    const float l = row[i];
    const double p1 = exp((double)(l - mx));  // sample_row's probability at temperature 1, unnormalised
    if (count_total) my_total += fixed(p1);
    const unsigned long long code = cand_code(order_key(l), i);
    if ((rs.min_p > 0 && p1 < rs.min_p) || (phase == 1 && code < cut) || (code & mask) != prefix) continue;
    const unsigned int bin = (unsigned int)(code >> shift) & 255u;
    atomicAdd(&count[bin], 1);
    atomicAdd(&mass[bin], fixed(phase == 0 ? p1 : exp((double)(l - mx) * inv_t)));
    atomicMax(&max_code[bin], code);
    atomicMin(&min_code[bin], code);
  }
  if (count_total && my_total) atomicAdd(&total, my_total);
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += kSliceThreads) {
    if (count[b] == 0) continue;
    atomicAdd(&s->count[b], count[b]);
    atomicAdd(&s->mass[b], mass[b]);
    atomicMax(&s->max_code[b], max_code[b]);
    atomicMin(&s->min_code[b], min_code[b]);
  }
  if (threadIdx.x == 0 && count_total) atomicAdd(&s->total, total);
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(&s->arrivals, 1) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The last slice: the row's bins (read past L1: other CTAs' atomics), reset for the next pass.
  for (int b = threadIdx.x; b < 256; b += kSliceThreads) {
    count[b] = __ldcg(&s->count[b]);
    mass[b] = __ldcg(&s->mass[b]);
    max_code[b] = __ldcg(&s->max_code[b]);
    min_code[b] = __ldcg(&s->min_code[b]);
    s->count[b] = 0;
    s->mass[b] = 0;
    s->max_code[b] = 0;
    s->min_code[b] = ~0ull;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (count_total) s->total = __ldcg(&s->total);
    nucleus_step(s, rs, count, mass, max_code, min_code, out);
    s->arrivals = 0;
  }
}

}  // namespace

void sample_rows_more(const float* d_logits, int64_t ld, int n_rows, int64_t n, const RowSampling* d_rows,
                         int32_t* d_out, Stream stream, void* d_work) {
  if (n_rows <= 0 || !d_work || n > sliced_vocab_max()) return;
  const int n_slices = (int)slice_count(n);
  NucleusRow* nuc = work_nucleus(d_work, n_rows, n);
  nucleus_init_kernel<<<n_rows, 256, 0, stream>>>(d_rows, work_parts(d_work), n_slices, d_out, nuc);
  check_launch("sample_rows_more (init)");
  for (int pass = 0; pass < 16; ++pass) {
    nucleus_pass_kernel<<<dim3(n_slices, n_rows), kSliceThreads, 0, stream>>>(d_logits, ld, n, d_rows, nuc, d_out);
    check_launch("sample_rows_more (pass)");
  }
}

}  // namespace merlin::cuda
