// Activation preparation (RMSNorm / SwiGLU / plain, then the matrix's input format) and embedding lookup.
// A grid of (token rows) x (256-element chunks), so a single decode row still spreads over many CTAs; for
// RMSNorm each CTA re-reads the whole row for its sum of squares (same order everywhere: same scale). The
// quantizers reproduce the CPU's: Q8_0 as llama.cpp's x86 quantize_row_q8_0 (id = 127 / amax, round half to
// even), Q8_K as quantize_row_q8_k (scale from the signed value of largest magnitude, first one on ties), so
// the int8 codes are the CPU's codes. The per-element functions live in act_impl.cuh (shared with matmul.cu);
// they write the rows and the fragment-ordered copy the batched products read.
#include "kernels/cuda/act_impl.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matvec1.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/raw_formats.cuh"

namespace merlin::cuda {
namespace {

// A decode loop's step (PrepArgs::chain): the step's token, the previous step's id, which every CTA reads
// alike; one thread of the first CTA does the bookkeeping, touching nothing another CTA or a later kernel of
// this step reads (ChainState: the next step's position and key slot).
__device__ int32_t chain_step_token(const PrepArgs& p) {
  ChainState* st = p.chain;
  const int32_t prev = st->fused ? argmax_key_row(st->key[p.chain_slot ^ 1]) : st->token;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    const int i = st->i;
    if (i > 0) {
      st->ids[i - 1] = prev;
      if (prev < 0) st->stopped = 1;
    }
    st->pos[p.chain_slot ^ 1] = st->pos[p.chain_slot] + 1;
    st->key[p.chain_slot] = 0ull;
    st->cur = st->rows[i];
    st->i = i + 1;
    cudaGraphSetConditional(static_cast<cudaGraphConditionalHandle>(p.chain_handle),
                            i + 1 < st->k && !st->stopped ? 1u : 0u);
  }
  return prev;
}

// A batched decode loop's step (PrepArgs::bchain): row t's first CTA records the row's previous id (this
// step's token) and its next position; row 0's also counts the step and sets the loop's condition. Nothing it
// writes is read by this step's kernels (BatchChainState: the other parity, and ids only the host reads).
__device__ void batch_chain_step(const PrepArgs& p, int t) {
  if (blockIdx.y != 0 || threadIdx.x != 0) return;
  BatchChainState* st = p.bchain;
  const int slot = p.chain_slot, i = st->i_[slot];
  if (i > 0) st->ids[i - 1][t] = st->tokens[t];
  st->pos[slot ^ 1][t] = st->pos[slot][t] + 1;
  if (t == 0) {
    st->i_[slot ^ 1] = i + 1;
    cudaGraphSetConditional(static_cast<cudaGraphConditionalHandle>(p.chain_handle), i + 1 < st->k ? 1u : 0u);
  }
}

template <int Kind, int Mode>
__global__ void __launch_bounds__(kPrepThreads) prep_kernel(PrepArgs p, ActBuf o) {
  __shared__ double sh[kPrepThreads / 32];
  const int t = blockIdx.x;
  const int64_t k = o.k, base = (int64_t)blockIdx.y * kPrepThreads;
  const int64_t i = base + threadIdx.x;
  const bool valid = i < k;
  // The RMSNorm weight is immutable: loaded before the wait, it does not add a memory round trip after the
  // row's reduction (a decode row's preparation is a chain of such round trips).
  const float w = Mode == (int)Prep::RmsNorm && valid ? p.d_w[i] : 0.0f;
  pdl_trigger();
  pdl_wait();
  if constexpr (Mode == (int)Prep::RmsNorm) {
    if (p.d_tokens) {  // the first layer: x is the token's embedding row, written here too (embed_kernel's values)
      if (p.bchain) batch_chain_step(p, t);
      int32_t token = p.chain ? chain_step_token(p) : p.d_tokens[t];
      if (token < 0 || token >= p.embd_rows) token = 0;
      const uint8_t* row = p.embd + (size_t)token * p.embd_row_bytes;
      double ss = 0.0;  // row_scale's sum, over the same values in the same order
      for (int64_t j = threadIdx.x; j < k; j += kPrepThreads) {
        const float v = raw_value(p.embd_type, row, j);
        ss += (double)v * (double)v;
      }
      const float scale = inv_rms(block_sum_double(ss, sh), k, p.eps);
      const float v = valid ? raw_value(p.embd_type, row, i) : 0.0f;
      if (valid) p.d_embed_x[t * p.ld + i] = v;
      emit<Kind>(valid ? __fmul_rn(__fmul_rn(v, scale), w) : 0.0f, valid, t, i, o);
      return;
    }
  }
  const int64_t src = p.d_rows ? p.d_rows[t] : t;
  const float* x = p.d_x + src * p.ld;
  const float scale = row_scale<Mode>(p, x, k, sh);
  emit<Kind>(valid ? prep_value<Mode>(p, x, i, scale, w) : 0.0f, valid, t, i, o);
}

template <int Kind>
void launch_prep(const PrepArgs& p, int n, ActBuf& o, Stream s) {
  const dim3 grid((unsigned)n, (unsigned)((o.k + kPrepThreads - 1) / kPrepThreads));
  switch (p.mode) {
    case Prep::Plain: launch_pdl(prep_kernel<Kind, 0>, grid, kPrepThreads, 0, s, p, o); break;
    case Prep::RmsNorm: launch_pdl(prep_kernel<Kind, 1>, grid, kPrepThreads, 0, s, p, o); break;
    case Prep::SwiGlu: launch_pdl(prep_kernel<Kind, 2>, grid, kPrepThreads, 0, s, p, o); break;
  }
}

__global__ void embed_kernel(DType type, const uint8_t* table, size_t row_bytes, int64_t dim, const int32_t* tokens,
                             float* x) {
  const int t = blockIdx.x;
  pdl_trigger();
  pdl_wait();
  const uint8_t* row = table + (size_t)tokens[t] * row_bytes;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) x[t * dim + i] = raw_value(type, row, i);
}

}  // namespace

ActBuf act_alloc(ActKind kind, int64_t k, int n_cap) {
  ActBuf a;
  a.kind = kind;
  a.k = k;
  a.n_cap = n_cap;
  const size_t n = (size_t)n_cap * k;
  switch (kind) {
    case ActKind::F32: a.f = static_cast<float*>(dev_alloc(n * 4)); break;
    case ActKind::F16:
    case ActKind::BF16: {
      a.hi = static_cast<uint16_t*>(dev_alloc(n * 2));
      a.lo = static_cast<uint16_t*>(dev_alloc(n * 2));
      const size_t nf = (size_t)(n_cap + 7) / 8 * 8 * (size_t)((k + 31) / 32 * 32);  // padding stays zero
      a.fhi = static_cast<uint16_t*>(dev_alloc(nf * 2));
      a.flo = static_cast<uint16_t*>(dev_alloc(nf * 2));
      break;
    }
    case ActKind::Q8_0:
    case ActKind::Q8_K: {
      MERLIN_CHECK(k % (kind == ActKind::Q8_K ? 256 : 32) == 0, "quantized activations of ", k, " elements");
      a.q = static_cast<int8_t*>(dev_alloc(n));
      a.scale = static_cast<float*>(dev_alloc(n / 32 * 4));
      a.sum = static_cast<int32_t*>(dev_alloc(n / 32 * 4));
      const size_t nf = (size_t)(n_cap + 7) / 8 * 8 * k;
      a.fq = static_cast<int8_t*>(dev_alloc(nf));
      a.fs = static_cast<float*>(dev_alloc(nf / 32 * 4));
      a.fsum = static_cast<int32_t*>(dev_alloc(nf / 32 * 4));
      if (kind == ActKind::Q8_0) a.fh = static_cast<uint16_t*>(dev_alloc(nf * 2));
      break;
    }
  }
  return a;
}

void act_free(ActBuf& a) {
  dev_free(a.f);
  dev_free(a.q);
  dev_free(a.scale);
  dev_free(a.sum);
  dev_free(a.hi);
  dev_free(a.lo);
  dev_free(a.fq);
  dev_free(a.fs);
  dev_free(a.fsum);
  dev_free(a.fh);
  dev_free(a.fhi);
  dev_free(a.flo);
  a = ActBuf{};
}

void prep_act(const PrepArgs& p, int n, ActBuf& out, Stream s) {
  if (n <= 0) return;
  MERLIN_CHECK(!p.d_tokens || (p.mode == Prep::RmsNorm && !p.d_rows && p.embd && p.d_embed_x && p.ld >= out.k &&
                               p.embd_rows > 0),
               "prep_act: embedding rows need an RmsNorm of rows t, the table and the residual rows");
  MERLIN_CHECK(n <= out.n_cap, "prep_act: ", n, " rows exceed the buffer's ", out.n_cap);
  MERLIN_CHECK(!p.chain || (p.d_tokens && n == 1), "prep_act: a decode loop's step is one embedding row");
  MERLIN_CHECK(!p.bchain || (p.d_tokens && !p.chain && n <= kBatchChainRows),
               "prep_act: a batched decode loop's step is up to ", kBatchChainRows, " embedding rows");
  switch (out.kind) {
    case ActKind::F32: launch_prep<0>(p, n, out, s); break;
    case ActKind::Q8_0: launch_prep<1>(p, n, out, s); break;
    case ActKind::Q8_K: launch_prep<2>(p, n, out, s); break;
    case ActKind::F16: launch_prep<3>(p, n, out, s); break;
    case ActKind::BF16: launch_prep<4>(p, n, out, s); break;
  }
  check_launch("prep_act");
}

void embed(DType type, const void* d_table, size_t row_bytes, int64_t dim, const int32_t* d_tokens, int n, float* d_x,
           Stream s) {
  if (n <= 0) return;
  launch_pdl(embed_kernel, n, 256, 0, s, type, static_cast<const uint8_t*>(d_table), row_bytes, dim, d_tokens, d_x);
  check_launch("embed");
}

}  // namespace merlin::cuda
