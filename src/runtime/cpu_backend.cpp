// The CPU forward pass (fp32 activations, any supported weight type).
//
// Per layer and batch:   xn = rmsnorm(x); q,k,v = xn·Wq, xn·Wk, xn·Wv; rope(q,k); cache <- k,v;
//                        a = softmax(q·Kᵀ/√d)·V per head; x += a·Wo; xn = rmsnorm(x);
//                        x += (silu(xn·Wg) * xn·Wu)·Wd
// Matrix products are split over threads by output rows; the three projections sharing one input
// (q/k/v, gate/up) run in one parallel section to keep synchronisation points per token low. Every parallel
// section hands out its work in chunks (ThreadPool::for_chunks): each thread starts on its static share and
// takes over the rest of another's when done, so neither uneven work (sequences of different lengths, the
// later tokens of a prompt) nor a thread the OS preempted holds the others up. Which thread computes an output
// never changes its bits.
//
// The K/V cache stores rows of kv_dim elements in F32, F16 or Q8_0, in fixed-size blocks of kv_block_size
// positions; a block table per sequence maps its logical blocks to physical ones (paged attention). Without
// an explicit block count every sequence owns a contiguous range of blocks (identity tables). Attention
// scores for one head are matrix-vector products of the cached K rows of each block (a strided view: head
// offset, full-row stride) with q, done by the same matmul kernel as the weights. With an F16 cache, q and
// the softmax weights are rounded to f16 first, which is what llama.cpp's CPU path computes, so greedy output
// matches it token for token. Every step of a token's computation is independent of the other tokens in the
// batch (the kernels are batch invariant), so a sequence's logits do not depend on what it is batched with.
#include "runtime/cpu_backend_impl.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/huge_pages.h"
#include "core/sys.h"

namespace merlin {
namespace cpu_backend_detail {

CpuBackend::CpuBackend(const Model& model, const BackendOptions& opts)
    : m_(model), c_(model.config()), kt_(kernels::kernels()),
      pool_(opts.n_threads > 0 ? opts.n_threads : ThreadPool::default_threads()) {
  n_ctx_ = opts.n_ctx > 0 ? opts.n_ctx : (int)c_.context_length;
  MERLIN_CHECK(n_ctx_ <= c_.context_length, "context size ", n_ctx_, " exceeds the model's context length ",
               c_.context_length);
  n_seq_ = std::max(1, opts.n_seq);
  max_batch_ = std::max(1, opts.max_batch);
  q_dim_ = c_.n_heads * c_.head_dim();
  kv_type_ = opts.kv_type;
  MERLIN_CHECK(kv_type_ == DType::F32 || kv_type_ == DType::F16 || kv_type_ == DType::Q8_0,
               "KV cache type must be f32, f16 or q8_0");
  MERLIN_CHECK(kv_type_ != DType::Q8_0 || c_.head_dim() % 32 == 0, "a q8_0 KV cache needs a head size that is a "
               "multiple of 32 (this model's is ", c_.head_dim(), "); use --kv-type f16");
  kv_row_bytes_ = dtype_row_bytes(kv_type_, (uint64_t)c_.kv_dim());
  kv_head_bytes_ = dtype_row_bytes(kv_type_, (uint64_t)c_.head_dim());
  score_kernel_ = kt_.matmul(kv_type_);
  MERLIN_CHECK(score_kernel_ && score_kernel_->rows, "no kernel for a ", dtype_name(kv_type_), " KV cache");
  block_size_ = opts.kv_block_size;
  MERLIN_CHECK(block_size_ >= 1 && block_size_ <= 4096, "KV block size must be 1..4096 (got ", block_size_, ")");
  MERLIN_CHECK(opts.n_kv_blocks >= 0, "negative KV block count ", opts.n_kv_blocks);
  blocks_per_seq_ = (n_ctx_ + block_size_ - 1) / block_size_;
  identity_tables_ = opts.n_kv_blocks == 0;
  n_blocks_ = identity_tables_ ? n_seq_ * blocks_per_seq_ : opts.n_kv_blocks;
  tables_.resize((size_t)n_seq_);
  for (int s = 0; s < n_seq_; ++s) identity_table(s);
  allocate_kv_cache((size_t)n_blocks_ * block_size_ * kv_row_bytes_, resident_kv(opts));
  const size_t B = (size_t)max_batch_;
  x_.resize(B * c_.dim);
  xn_.resize(B * c_.dim);
  tmp_.resize(B * c_.dim);
  q_.resize(B * q_dim_);
  att_.resize(B * q_dim_);
  k_.resize(B * c_.kv_dim());
  v_.resize(B * c_.kv_dim());
  gate_.resize(B * c_.ffn_dim);
  up_.resize(B * c_.ffn_dim);
  const size_t nt = (size_t)pool_.size();
  // An attention item is up to kAttnGroup tokens of one head or one token of up to n_heads heads.
  attn_slots_ = std::max<int64_t>(kAttnGroup, c_.n_heads);
  scores_.resize(nt * attn_slots_ * n_ctx_);
  qconv_.resize(nt * attn_slots_ * c_.head_dim());
  vrow_.resize(nt * c_.head_dim());
  qact_.resize(nt * attn_slots_ * dtype_row_bytes(DType::Q8_0, 32) * (size_t)((c_.head_dim() + 31) / 32));
  row_.resize(nt * (size_t)std::max(c_.dim, c_.ffn_dim));
  rope_cs_.resize(nt * ((size_t)c_.rot_dims() + 2));
  const char* fuse = std::getenv("MERLIN_FUSE");
  fuse_ = fuse == nullptr || std::strcmp(fuse, "0") != 0;
  const char* prefetch = std::getenv("MERLIN_KV_PREFETCH");
  prefetch_ = prefetch == nullptr || std::strcmp(prefetch, "0") != 0;
  // The screen costs an int8 copy of the head (vocab x dim bytes: half an F16 head again), so only backends that
  // decode many sequences at once (a server) make one; MERLIN_HEAD_SCREEN=0 turns it off (A/B runs). Float heads
  // only: a quantized head's kernel is already int8 (VNNI), and a Q4_0 screen measured no faster than it.
  const char* screen = std::getenv("MERLIN_HEAD_SCREEN");
  const Weight& out = m_.output();
  if (n_seq_ >= kScreenMinRows && (screen == nullptr || std::strcmp(screen, "0") != 0) && out.cols == c_.dim &&
      out.rows == c_.vocab_size && c_.dim % 4 == 0 && c_.dim <= 1024 && c_.vocab_size >= 4096 &&
      kt_.matmul(out.type)->rows != nullptr && kt_.matmul(out.type)->act_type == DType::F32) {
    if (const kernels::HeadScreen* hs = kernels::head_screen()) {
      screen_w_ = aligned_array<uint8_t>(hs->bytes(out.rows, out.cols));
      screen_scale_.resize((size_t)out.rows);
      screen_err_.resize((size_t)out.rows);
      screen_hull_.resize((size_t)out.rows);
      hs->prepare(screen_w_.get(), out.rows, out.cols);
      std::vector<float> row((size_t)out.cols);
      bool ok = true;
      for (int64_t r = 0; r < out.rows && ok; ++r) {
        kernels::dequantize_row(out.type, out.row(r), row.data(), out.cols);
        ok = hs->pack_row(row.data(), r, out.cols, screen_w_.get(), screen_scale_.data(), screen_err_.data(),
                          screen_hull_.data());
      }
      if (ok) {
        screen_ = hs;
        screen_exact_.resize(nt * (size_t)out.rows);
        screen_cand_.resize(nt * (size_t)kScreenMaxCandidates);
      } else {
        screen_w_.reset();
      }
    }
  }
}

// A resident cache is one huge-page region, faulted in ahead by idle_work() (a server's engine thread while no
// request runs: ~3 s for base's 1.1 GiB on this machine). A server's block allocator and prefix cache end up
// writing every block, and each first write to a 4 KiB page had cost a fault and a page clear on the decode
// path; huge pages also spare attention's K/V reads a TLB miss per 4 KiB. base Q4_0 behind `merlin serve`:
// +17 % at 32 clients, +27 % at one (docs/BENCHMARKS.md). Not a thread of its own: faulting in holds the
// process's memory-map lock, and a low-priority thread preempted while holding it stalled every mmap of a
// loaded machine's server start (the default model's startup from ~1.3 s to 1.5-7 s). Only while the cache
// fits in half of the available memory; otherwise it is faulted in as it is written.
void CpuBackend::allocate_kv_cache(size_t layer_bytes, bool resident) {
  const size_t stride = (layer_bytes + 63) / 64 * 64, total = 2 * (size_t)c_.n_layers * stride;
  const size_t mapped = (total + kPageBytes - 1) / kPageBytes * kPageBytes;
  if (resident && mapped > 0 && mapped <= mem_available_bytes() / 2) {
    if (uint8_t* p = map_huge_page_aligned(mapped)) {
      kv_region_ = std::unique_ptr<uint8_t, HugePageUnmap>(p, HugePageUnmap{mapped});
      for (int l = 0; l < c_.n_layers; ++l) {
        k_cache_.push_back(p + (size_t)(2 * l) * stride);
        v_cache_.push_back(p + (size_t)(2 * l + 1) * stride);
      }
      return;
    }
  }
  for (int l = 0; l < 2 * c_.n_layers; ++l) {
    kv_arrays_.push_back(aligned_array<uint8_t>(layer_bytes));
    (l % 2 == 0 ? k_cache_ : v_cache_).push_back(kv_arrays_.back().get());
  }
}

bool CpuBackend::idle_work() {
  const size_t mapped = kv_region_.get_deleter().bytes;
  if (!kv_region_ || kv_populated_ >= mapped) return false;
  const size_t n = std::min(kHugePageBytes, mapped - kv_populated_);
  // A kernel without MADV_POPULATE_WRITE (before 5.14) leaves the rest to the first writes.
  kv_populated_ = populate_pages(kv_region_.get() + kv_populated_, n) ? kv_populated_ + n : mapped;
  return kv_populated_ < mapped;
}

void CpuBackend::identity_table(int seq) {
  std::vector<int32_t>& t = tables_[(size_t)seq];
  t.clear();
  if (!identity_tables_) return;  // paged: the owner maps blocks with set_block_table
  for (int b = 0; b < blocks_per_seq_; ++b) t.push_back(seq * blocks_per_seq_ + b);
}

void CpuBackend::clear_sequence(int seq) {
  MERLIN_CHECK(seq >= 0 && seq < n_seq_, "sequence ", seq, " out of range");
  // Identity tables stay (positions are simply overwritten); a paged sequence gives up its blocks, so a
  // stale table can never write into blocks that now belong to someone else.
  identity_table(seq);
}

void CpuBackend::set_block_table(int seq, std::span<const int32_t> blocks) {
  MERLIN_CHECK(seq >= 0 && seq < n_seq_, "sequence ", seq, " out of range");
  MERLIN_CHECK((int64_t)blocks.size() <= blocks_per_seq_, "block table of ", blocks.size(),
               " blocks is longer than the context (", blocks_per_seq_, " blocks)");
  for (int32_t b : blocks)
    MERLIN_CHECK(b >= 0 && b < n_blocks_, "KV block ", b, " out of range (0..", n_blocks_ - 1, ")");
  tables_[(size_t)seq].assign(blocks.begin(), blocks.end());
}

void CpuBackend::validate(const Batch& batch) const {
  MERLIN_CHECK(batch.size() > 0 && batch.size() <= (size_t)max_batch_, "batch of ", batch.size(),
               " tokens (1..", max_batch_, " allowed)");
  for (size_t i = 0; i < batch.size(); ++i) {
    MERLIN_CHECK(batch.tokens[i] >= 0 && batch.tokens[i] < c_.vocab_size, "token id ", batch.tokens[i],
                 " is outside the vocabulary (0..", c_.vocab_size - 1, ")");
    MERLIN_CHECK(batch.pos[i] >= 0 && batch.pos[i] < n_ctx_, "position ", batch.pos[i],
                 " is outside the context (", n_ctx_, " tokens)");
    MERLIN_CHECK(batch.seq[i] >= 0 && batch.seq[i] < n_seq_, "sequence ", batch.seq[i], " out of range");
    // Attention reads every position up to pos, so all blocks up to pos's must be mapped; tables are
    // dense, so checking the last one suffices.
    MERLIN_CHECK((size_t)(batch.pos[i] / block_size_) < tables_[(size_t)batch.seq[i]].size(), "position ",
                 batch.pos[i], " of sequence ", batch.seq[i], " is beyond its mapped KV blocks (",
                 tables_[(size_t)batch.seq[i]].size(), " blocks of ", block_size_, ")");
  }
}

void CpuBackend::run_layers(const Batch& batch) {
  validate(batch);
  const int64_t n = (int64_t)batch.size();
  embed(batch);
  for (int l = 0; l < c_.n_layers; ++l) {
    attention_block(l, batch);
    ffn_block(l, n);
  }
}

void CpuBackend::forward(const Batch& batch, float* logits) {
  run_layers(batch);
  output_head(batch, logits);
}

// Logits into a buffer kept between calls (the default allocated and zeroed a fresh vocab-sized vector per
// token), then the rows' argmaxes spread over the threads: a 32-sequence server step has 32 x 50K logits to
// scan, which on the calling thread alone left the other cores waiting. With a head screen (a backend of many
// sequences, a float head, AVX-512) a step of kScreenMinRows or more rows picks its tokens through it instead:
// the same ids in a fraction of the head's time.
float* CpuBackend::step_logits(size_t n_rows, int64_t n_vocab) {
  const size_t need = n_rows * (size_t)n_vocab;
  if (greedy_logits_size_ < need) {
    greedy_logits_ = aligned_array<float>(need);
    greedy_logits_size_ = need;
  }
  return greedy_logits_.get();
}

void CpuBackend::forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens) {
  const size_t n = batch.n_logits();
  float* logits = step_logits(n, n_vocab);
  if (screen_ != nullptr && n >= (size_t)kScreenMinRows && n_vocab == c_.vocab_size) {
    run_layers(batch);
    if (greedy_screened(batch, tokens)) return;
    output_head(batch, logits);  // not reached for finite inputs; the exact path as a safety net
  } else {
    forward(batch, logits);
  }
  if (n == 1) {
    tokens[0] = kt_.argmax(logits, n_vocab);
    return;
  }
  pool_.for_chunks((int64_t)n, 1, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) tokens[r] = kt_.argmax(logits + (size_t)r * n_vocab, n_vocab);
  });
}

// The rows' draws (sample_row) spread over the threads, as forward_greedy's argmaxes: a draw without top-k
// takes a few hundred microseconds of exps over 50K logits, so a 32-sequence step's draws on the calling
// thread alone cost as much as a third of the step.
void CpuBackend::forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                                std::span<const LogitAdjust> adjust, int32_t* tokens) {
  const size_t n = batch.n_logits();
  MERLIN_CHECK(rows.size() == n, "forward_sample: ", rows.size(), " sampling rows for ", n, " logits rows");
  float* logits = step_logits(n, n_vocab);
  forward(batch, logits);
  sample_scratch_.resize((size_t)pool_.size());
  pool_.for_chunks((int64_t)n, 1, [&](int thread, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      tokens[r] = sample_row(logits + (size_t)r * n_vocab, n_vocab, rows[(size_t)r], adjust.data(),
                             sample_scratch_[(size_t)thread]);
  });
}

// The output head through the screen: approximate logits for every row (int8 products), then per token the
// exact logits (the head kernel's, the same bits as output_head's) of the rows whose bound reaches the largest
// lower bound; every other row's exact logit is below some candidate's, so it can be neither the maximum nor
// tied with it. False (nothing decided) when a hidden state is not finite.
bool CpuBackend::greedy_screened(const Batch& batch, int32_t* tokens) {
  const int64_t k = c_.dim, V = c_.vocab_size;
  int64_t n_out = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch.want_logits[i]) continue;
    kt_.rmsnorm(&x_[i * k], m_.output_norm().data(), k, c_.norm_eps, &xn_[n_out * k]);
    ++n_out;
  }
  screen_x_.resize((size_t)(n_out * k));
  screen_tok_.resize((size_t)n_out);
  screen_x_scale_.resize((size_t)n_out);
  screen_x_sum_.resize((size_t)n_out);
  for (int64_t t = 0; t < n_out; ++t) {
    // The head kernel multiplies x itself (float activations): no activation error to add.
    if (!kernels::screen_quantize(&xn_[t * k], k, 0.0, &screen_x_[(size_t)(t * k)], &screen_tok_[(size_t)t]))
      return false;
    screen_x_scale_[(size_t)t] = screen_tok_[(size_t)t].scale;
    screen_x_sum_[(size_t)t] = screen_tok_[(size_t)t].sum;
  }
  float* screen = greedy_logits_.get();
  const int64_t groups = (V + 15) / 16;
  pool_.for_chunks(groups, std::max<int64_t>(1, groups / (8 * pool_.size())), [&](int, int64_t g0, int64_t g1) {
    screen_->rows(screen_w_.get(), screen_scale_.data(), g0 * 16, std::min(V, g1 * 16), screen_x_.data(), (size_t)k,
                  screen_x_scale_.data(), screen_x_sum_.data(), n_out, k, screen, V);
  });
  pool_.for_chunks(n_out, 1, [&](int thread, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) tokens[t] = screened_token(t, screen + t * V, thread);
  });
  return true;
}

int32_t CpuBackend::screened_token(int64_t t, const float* a, int thread) {
  const int64_t k = c_.dim, V = c_.vocab_size;
  const Weight& w = m_.output();
  const kernels::MatmulKernel* kern = kt_.matmul(w.type);
  const float* x = &xn_[t * k];
  float* exact = &screen_exact_[(size_t)thread * (size_t)V];
  auto exact_rows = [&](int64_t r0, int64_t r1) {  // exact[r0, r1): the head kernel on this token alone
    if (w.packed != nullptr && w.packed_kernel == kern->packed)
      w.packed_kernel->rows(w.packed, 0, r0, r1, x, (size_t)k * sizeof(float), 1, k, exact, V);
    else
      kern->rows(w.data, w.row_bytes, r0, r1, x, (size_t)k * sizeof(float), 1, k, exact, V);
  };
  const float ex = screen_tok_[(size_t)t].bound_x, ey = screen_tok_[(size_t)t].bound_y;
  // The largest lower bound, then the rows whose upper bound reaches it; a NaN screen value (not expected for
  // finite inputs) or too many candidates send the token to the exact path.
  const float lo = screen_->lower_max(a, screen_err_.data(), screen_hull_.data(), ex, ey, V);
  int32_t* cand = &screen_cand_[(size_t)(thread * kScreenMaxCandidates)];
  const int64_t n_cand =
      std::isfinite(lo)
          ? screen_->candidates(a, screen_err_.data(), screen_hull_.data(), ex, ey, lo, V, cand, kScreenMaxCandidates)
          : -1;
  const bool fits = n_cand >= 1 && n_cand <= kScreenMaxCandidates;
  if (fits) {
    int32_t best = -1;
    int64_t done = -1;  // the 16-row unit computed last (a packed layout's rows come in groups of 16)
    for (int64_t i = 0; i < n_cand; ++i) {
      const int32_t r = cand[i];
      if (r / 16 != done) {
        done = r / 16;
        exact_rows(done * 16, std::min(V, done * 16 + 16));
      }
      if (exact[r] != exact[r]) {
        best = -1;
        break;
      }
      if (best < 0 || exact[r] > exact[best]) best = r;  // candidates ascend: ties keep the lowest id
    }
    if (best >= 0) return best;
  }
  exact_rows(0, V);  // the whole row, exactly, then argmax() as usual
  return kt_.argmax(exact, V);
}

void CpuBackend::embed(const Batch& batch) {
  const Weight& e = m_.token_embd();
  for (size_t i = 0; i < batch.size(); ++i) {
    const void* row = e.row(batch.tokens[i]);
    if (e.packed != nullptr) {  // the tied table, packed at load (AVX2 or AVX-512)
      if (embd_row_.size() < e.row_bytes) embd_row_.resize(e.row_bytes);
      e.packed_kernel->unpack_row(e.packed, batch.tokens[i], c_.dim, embd_row_.data());
      row = embd_row_.data();
    }
    kernels::dequantize_row(e.type, row, &x_[i * c_.dim], c_.dim);
  }
}

void CpuBackend::matmul(const float* x, int64_t n_tokens, int64_t k, std::initializer_list<MatmulJob> jobs) {
  // Quantized kernels read activations in their own format: convert once, before the parallel section.
  const kernels::MatmulKernel* kern[4];
  const void* xin[4];
  size_t x_row_bytes[4];
  size_t j = 0, act_offset = 0;
  for (const MatmulJob& job : jobs) {
    kern[j] = kt_.matmul(job.w->type);
    if (kern[j]->act_type == DType::F32) {
      xin[j] = x;
      x_row_bytes[j] = (size_t)k * sizeof(float);
    } else {
      x_row_bytes[j] = dtype_row_bytes(kern[j]->act_type, (uint64_t)k);
      const size_t need = act_offset + x_row_bytes[j] * n_tokens;
      if (act_buf_.size() < need) act_buf_.resize(need);
      xin[j] = nullptr;  // filled below, after act_buf_ stops growing
      act_offset = need;
    }
    ++j;
  }
  act_offset = 0;
  j = 0;
  for (const MatmulJob& job : jobs) {
    (void)job;
    if (kern[j]->act_type != DType::F32) {
      // Projections of one input in the same format (q/k/v, gate/up of one type) share one conversion.
      size_t same = 0;
      while (same < j && kern[same]->quantize_act != kern[j]->quantize_act) ++same;
      if (same < j) {
        xin[j] = xin[same];
      } else {
        void* dst = act_buf_.data() + act_offset;
        kern[j]->quantize_act(x, n_tokens, k, dst);
        xin[j] = dst;
        act_offset += x_row_bytes[j] * n_tokens;
      }
    }
    ++j;
  }
  matmul_prepared(kern, xin, x_row_bytes, n_tokens, k, jobs);
}

// RMSNorm + quantization and SwiGLU + quantization: when every product of the input wants the same int8
// format, each token's float row is produced into an L1-sized buffer and quantized at once, so the
// [n_tokens][k] float activations are never written and read back. Per token these are the same kernel calls
// on the same values as the unfused path (rmsnorm/swiglu are per token, quantize_act per block), so the bits
// are unchanged. Otherwise the rows are materialised in `x` and matmul() runs as usual.
void CpuBackend::matmul_rows(const RowFn& produce, float* x, int64_t n_tokens, int64_t k,
                             std::initializer_list<MatmulJob> jobs) {
  const kernels::MatmulKernel* kern[4];
  size_t j = 0;
  bool fusable = fuse_;
  for (const MatmulJob& job : jobs) {
    kern[j] = kt_.matmul(job.w->type);
    fusable = fusable && kern[j]->act_type != DType::F32 && kern[j]->quantize_act == kern[0]->quantize_act;
    ++j;
  }
  // Rows are produced in parallel once there are enough of them to pay for a section (prefill, a server's
  // many-sequence step).
  const int64_t grain = std::max<int64_t>(8, (n_tokens + 2 * pool_.size() - 1) / (2 * pool_.size()));
  if (!fusable) {
    pool_.for_chunks(n_tokens, grain, [&](int, int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) produce(t, x + t * k);
    });
    matmul(x, n_tokens, k, jobs);
    return;
  }
  const size_t row_bytes = dtype_row_bytes(kern[0]->act_type, (uint64_t)k);
  if (act_buf_.size() < row_bytes * n_tokens) act_buf_.resize(row_bytes * n_tokens);
  const size_t row_len = row_.size() / pool_.size();
  pool_.for_chunks(n_tokens, grain, [&](int thread, int64_t t0, int64_t t1) {
    float* row = &row_[(size_t)thread * row_len];
    for (int64_t t = t0; t < t1; ++t) {
      produce(t, row);
      kern[0]->quantize_act(row, 1, k, act_buf_.data() + row_bytes * t);
    }
  });
  const void* xin[4];
  size_t x_row_bytes[4];
  for (size_t i = 0; i < j; ++i) {
    xin[i] = act_buf_.data();
    x_row_bytes[i] = row_bytes;
  }
  matmul_prepared(kern, xin, x_row_bytes, n_tokens, k, jobs);
}

void CpuBackend::matmul_prepared(const kernels::MatmulKernel* const* kern, const void* const* xin,
                                 const size_t* x_row_bytes, int64_t n_tokens, int64_t k,
                                 std::initializer_list<MatmulJob> jobs) {
  // Work units of 16 rows (threads never share a cache line of the output; packed layouts start at multiples
  // of 16), numbered through the jobs one after the other. Few tokens: four chunks per thread, each still a
  // long run of weight rows to stream. Many tokens: one per thread, since a tiled call first packs its
  // activations and more calls measured slower (pp512 -10% with four); a thread that has not started its share
  // by the time another is done still has it taken over.
  int64_t units = 0;
  for (const MatmulJob& job : jobs) units += (job.w->rows + 15) / 16;
  const int64_t per_thread = n_tokens >= 8 ? 1 : 4, parts = per_thread * pool_.size();
  const int64_t grain = std::max<int64_t>(1, (units + parts - 1) / parts);
  pool_.for_chunks(units, grain, [&](int, int64_t u0, int64_t u1) {
    size_t jj = 0;
    int64_t first = 0;  // the job's first unit
    for (const MatmulJob& job : jobs) {
      const int64_t rows = job.w->rows, n_units = (rows + 15) / 16;
      const int64_t r0 = std::clamp(u0 - first, (int64_t)0, n_units) * 16;
      const int64_t r1 = std::min(rows, std::clamp(u1 - first, (int64_t)0, n_units) * 16);
      if (r0 < r1) {
        // The model's load-time layout, when it was made for this kernel level (bit-identical results).
        const Weight& w = *job.w;
        if (w.packed != nullptr && w.packed_kernel == kern[jj]->packed)
          w.packed_kernel->rows(w.packed, 0, r0, r1, xin[jj], x_row_bytes[jj], n_tokens, k, job.y, rows);
        else
          kern[jj]->rows(job.w->data, job.w->row_bytes, r0, r1, xin[jj], x_row_bytes[jj], n_tokens, k, job.y, rows);
      }
      first += n_units;
      ++jj;
    }
  });
}

void CpuBackend::ffn_block(int layer, int64_t n) {
  const LayerWeights& w = m_.layer(layer);
  const int64_t f = c_.ffn_dim;
  matmul_rows([&](int64_t t, float* out) { kt_.rmsnorm(&x_[t * c_.dim], w.ffn_norm.data(), c_.dim, c_.norm_eps, out); },
              xn_.data(), n, c_.dim, {{&w.gate, gate_.data()}, {&w.up, up_.data()}});
  // In place into gate_ when not fused, as before.
  matmul_rows([&](int64_t t, float* out) { kt_.swiglu(&gate_[t * f], &up_[t * f], f, out); }, gate_.data(), n, f,
              {{&w.down, tmp_.data()}});
  kt_.add(x_.data(), tmp_.data(), x_.data(), n * c_.dim);
}

void CpuBackend::output_head(const Batch& batch, float* logits) {
  // Only rows that want logits pay for the (vocab × dim) product.
  int64_t n_out = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!batch.want_logits[i]) continue;
    kt_.rmsnorm(&x_[i * c_.dim], m_.output_norm().data(), c_.dim, c_.norm_eps, &xn_[n_out * c_.dim]);
    ++n_out;
  }
  if (n_out > 0) matmul(xn_.data(), n_out, c_.dim, {{&m_.output(), logits}});
}

}  // namespace cpu_backend_detail

DType parse_kv_type(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "f16") return DType::F16;
  if (name == "q8_0") return DType::Q8_0;
  fail("KV cache type must be f32, f16 or q8_0 (got '", name, "')");
}

std::unique_ptr<Backend> make_cpu_backend(const Model& model, const BackendOptions& opts) {
  return std::make_unique<cpu_backend_detail::CpuBackend>(model, opts);
}

}  // namespace merlin