// The CPU forward pass (fp32 activations, any supported weight type).
//
// Per layer and batch:   xn = rmsnorm(x); q,k,v = xn·Wq, xn·Wk, xn·Wv; rope(q,k); cache <- k,v;
//                        a = softmax(q·Kᵀ/√d)·V per head; x += a·Wo; xn = rmsnorm(x);
//                        x += (silu(xn·Wg) * xn·Wu)·Wd
// Matrix products are split over threads by output rows; the three projections sharing one input
// (q/k/v, gate/up) run in one parallel section to keep synchronisation points per token low.
//
// The K/V cache stores rows of kv_dim elements in F32, F16 or Q8_0. Attention scores for one head are a
// matrix-vector product of the cached K rows (a strided view: head offset, full-row stride) with q, done by
// the same matmul kernel as the weights. With an F16 cache, q and the softmax weights are rounded to f16
// first, which is what llama.cpp's CPU path computes, so greedy output matches it token for token.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/quant.h"
#include "runtime/backend.h"
#include "runtime/model.h"

namespace merlin {
namespace {

// Activation scratch sized for the largest batch. Left uninitialised: large allocations come from fresh pages,
// so a decode step that uses one row of a 512-row buffer keeps the rest out of the resident set.
class Scratch {
 public:
  void resize(size_t n) {
    p_.reset(new float[n]);
    n_ = n;
  }
  float* data() { return p_.get(); }
  float& operator[](size_t i) { return p_[i]; }
  size_t size() const { return n_; }

 private:
  std::unique_ptr<float[]> p_;
  size_t n_ = 0;
};

struct MatmulJob {
  const Weight* w;
  float* y;  // [n_tokens][w->rows]
};

class CpuBackend final : public Backend {
 public:
  CpuBackend(const Model& model, const BackendOptions& opts);
  std::string name() const override { return std::string("cpu-") + kernel_level_name(kt_.level); }
  int n_ctx() const override { return n_ctx_; }
  int max_batch() const override { return max_batch_; }
  int n_seq() const override { return n_seq_; }
  void forward(const Batch& batch, float* logits) override;
  void clear_sequence(int /*seq*/) override {}  // positions are overwritten; nothing to free
  // Until the paged cache lands, each sequence owns one block spanning the whole context.
  int kv_block_size() const override { return n_ctx_; }
  int n_kv_blocks() const override { return n_seq_; }
  void set_block_table(int, std::span<const int32_t>) override { fail("the CPU backend has no paged KV cache yet"); }
  size_t kv_block_bytes() const override { return 2 * (size_t)c_.n_layers * n_ctx_ * kv_row_bytes_; }

 private:
  void validate(const Batch& batch) const;
  void embed(const Batch& batch);
  void attention_block(int layer, const Batch& batch);
  void ffn_block(int layer, int64_t n);
  void output_head(const Batch& batch, float* logits);
  void rmsnorm_rows(const float* x, const std::vector<float>& w, int64_t n, float* y);
  void matmul(const float* x, int64_t n_tokens, int64_t k, std::initializer_list<MatmulJob> jobs);
  void attend(int layer, const Batch& batch, int64_t t, int64_t head, int thread);
  void store_kv_row(const float* src, uint8_t* dst);
  uint8_t* k_at(int layer, int seq, int pos) { return k_cache_[layer].get() + ((size_t)seq * n_ctx_ + pos) * kv_row_bytes_; }
  uint8_t* v_at(int layer, int seq, int pos) { return v_cache_[layer].get() + ((size_t)seq * n_ctx_ + pos) * kv_row_bytes_; }

  const Model& m_;
  const ModelConfig& c_;
  const kernels::KernelTable& kt_;
  ThreadPool pool_;
  int n_ctx_, n_seq_, max_batch_;
  int64_t q_dim_;
  DType kv_type_;
  size_t kv_row_bytes_, kv_head_bytes_;
  const kernels::MatmulKernel* score_kernel_;  // q · K rows for the cache type
  // K/V cache per layer: [seq][pos][kv row], allocated untouched so unused context costs no RSS.
  std::vector<std::unique_ptr<uint8_t[]>> k_cache_, v_cache_;
  Scratch x_, xn_, q_, k_, v_, att_, gate_, up_, tmp_;
  std::vector<float> scores_, qconv_, vrow_;     // per-thread attention scratch
  std::vector<uint8_t> act_buf_, qact_;         // qact_: per-thread q in the score kernel's format
};

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
  const size_t cache_bytes = (size_t)n_seq_ * n_ctx_ * kv_row_bytes_;
  for (int l = 0; l < c_.n_layers; ++l) {
    k_cache_.emplace_back(new uint8_t[cache_bytes]);
    v_cache_.emplace_back(new uint8_t[cache_bytes]);
  }
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
  scores_.resize(nt * n_ctx_);
  qconv_.resize(nt * c_.head_dim());
  vrow_.resize(nt * c_.head_dim());
  qact_.resize(nt * std::max<size_t>(dtype_row_bytes(DType::Q8_0, 32) * ((c_.head_dim() + 31) / 32), 64));
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
  }
}

void CpuBackend::forward(const Batch& batch, float* logits) {
  validate(batch);
  const int64_t n = (int64_t)batch.size();
  embed(batch);
  for (int l = 0; l < c_.n_layers; ++l) {
    attention_block(l, batch);
    ffn_block(l, n);
  }
  output_head(batch, logits);
}

void CpuBackend::embed(const Batch& batch) {
  const Weight& e = m_.token_embd();
  for (size_t i = 0; i < batch.size(); ++i)
    kernels::dequantize_row(e.type, e.row(batch.tokens[i]), &x_[i * c_.dim], c_.dim);
}

void CpuBackend::rmsnorm_rows(const float* x, const std::vector<float>& w, int64_t n, float* y) {
  for (int64_t t = 0; t < n; ++t) kt_.rmsnorm(x + t * c_.dim, w.data(), c_.dim, c_.norm_eps, y + t * c_.dim);
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
      void* dst = act_buf_.data() + act_offset;
      kern[j]->quantize_act(x, n_tokens, k, dst);
      xin[j] = dst;
      act_offset += x_row_bytes[j] * n_tokens;
    }
    ++j;
  }
  pool_.run([&](int ti, int nt) {
    size_t jj = 0;
    for (const MatmulJob& job : jobs) {
      const int64_t rows = job.w->rows;
      // Split rows in multiples of 16 so threads never share a cache line of the output.
      const int64_t units = (rows + 15) / 16;
      const int64_t r0 = std::min(rows, units * ti / nt * 16), r1 = std::min(rows, units * (ti + 1) / nt * 16);
      if (r0 < r1)
        kern[jj]->rows(job.w->data, job.w->row_bytes, r0, r1, xin[jj], x_row_bytes[jj], n_tokens, k, job.y, rows);
      ++jj;
    }
  });
}

void CpuBackend::attention_block(int layer, const Batch& batch) {
  const LayerWeights& w = m_.layer(layer);
  const int64_t n = (int64_t)batch.size(), kv_dim = c_.kv_dim(), hd = c_.head_dim();
  rmsnorm_rows(x_.data(), w.attn_norm, n, xn_.data());
  matmul(xn_.data(), n, c_.dim, {{&w.wq, q_.data()}, {&w.wk, k_.data()}, {&w.wv, v_.data()}});
  for (int64_t t = 0; t < n; ++t) {
    float* q = &q_[t * q_dim_];
    float* k = &k_[t * kv_dim];
    kernels::rope_inplace(q, c_.n_heads, hd, c_.rot_dims(), batch.pos[t], c_.rope_theta);
    kernels::rope_inplace(k, c_.n_kv_heads, hd, c_.rot_dims(), batch.pos[t], c_.rope_theta);
    store_kv_row(k, k_at(layer, batch.seq[t], batch.pos[t]));
    store_kv_row(&v_[t * kv_dim], v_at(layer, batch.seq[t], batch.pos[t]));
  }
  const int64_t work = n * c_.n_heads;
  pool_.run([&](int ti, int nt) {
    for (int64_t i = work * ti / nt; i < work * (ti + 1) / nt; ++i) attend(layer, batch, i / c_.n_heads, i % c_.n_heads, ti);
  });
  matmul(att_.data(), n, q_dim_, {{&w.wo, tmp_.data()}});
  kt_.add(x_.data(), tmp_.data(), x_.data(), n * c_.dim);
}

void CpuBackend::store_kv_row(const float* src, uint8_t* dst) {
  const int64_t n = c_.kv_dim();
  switch (kv_type_) {
    case DType::F32: std::memcpy(dst, src, (size_t)n * sizeof(float)); break;
    case DType::F16: {
      uint16_t* h = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = f32_to_fp16(src[i]);
      break;
    }
    default: kernels::quant_quantize_row(kv_type_, src, dst, n); break;
  }
}

void CpuBackend::attend(int layer, const Batch& batch, int64_t t, int64_t head, int thread) {
  const int64_t hd = c_.head_dim();
  const int64_t kv_head = head / (c_.n_heads / c_.n_kv_heads);
  const int seq = batch.seq[t], n_pos = batch.pos[t] + 1;
  float* scores = &scores_[(size_t)thread * n_ctx_];
  const float* q = &q_[t * q_dim_ + head * hd];

  // Scores: the cached K rows of this head form a (n_pos × hd) matrix with a full-row stride.
  const void* x = q;
  size_t x_bytes = (size_t)hd * sizeof(float);
  if (kv_type_ == DType::F16) {
    float* qr = &qconv_[(size_t)thread * hd];
    for (int64_t i = 0; i < hd; ++i) qr[i] = fp16_to_f32(f32_to_fp16(q[i]));
    x = qr;
  } else if (kv_type_ != DType::F32) {
    uint8_t* qa = &qact_[(size_t)thread * (qact_.size() / pool_.size())];
    score_kernel_->quantize_act(q, 1, hd, qa);
    x = qa;
    x_bytes = dtype_row_bytes(score_kernel_->act_type, (uint64_t)hd);
  }
  const uint8_t* k0 = k_at(layer, seq, 0) + (size_t)kv_head * kv_head_bytes_;
  score_kernel_->rows(k0, kv_row_bytes_, 0, n_pos, x, x_bytes, 1, hd, scores, n_pos);
  const float scale = 1.0f / std::sqrt((float)hd);
  for (int p = 0; p < n_pos; ++p) scores[p] *= scale;
  kt_.softmax(scores, n_pos);

  float* out = &att_[t * q_dim_ + head * hd];
  std::fill(out, out + hd, 0.0f);
  for (int p = 0; p < n_pos; ++p) {
    const uint8_t* v = v_at(layer, seq, p) + (size_t)kv_head * kv_head_bytes_;
    switch (kv_type_) {
      case DType::F32: kt_.axpy(scores[p], reinterpret_cast<const float*>(v), out, hd); break;
      case DType::F16:
        kt_.axpy_f16(fp16_to_f32(f32_to_fp16(scores[p])), reinterpret_cast<const uint16_t*>(v), out, hd);
        break;
      default: {
        float* row = &vrow_[(size_t)thread * hd];
        kernels::dequantize_row(kv_type_, v, row, hd);
        kt_.axpy(scores[p], row, out, hd);
      }
    }
  }
}

void CpuBackend::ffn_block(int layer, int64_t n) {
  const LayerWeights& w = m_.layer(layer);
  rmsnorm_rows(x_.data(), w.ffn_norm, n, xn_.data());
  matmul(xn_.data(), n, c_.dim, {{&w.gate, gate_.data()}, {&w.up, up_.data()}});
  kt_.swiglu(gate_.data(), up_.data(), n * c_.ffn_dim, gate_.data());
  matmul(gate_.data(), n, c_.ffn_dim, {{&w.down, tmp_.data()}});
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

}  // namespace

DType parse_kv_type(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "f16") return DType::F16;
  if (name == "q8_0") return DType::Q8_0;
  fail("KV cache type must be f32, f16 or q8_0 (got '", name, "')");
}

std::unique_ptr<Backend> make_cpu_backend(const Model& model, const BackendOptions& opts) {
  return std::make_unique<CpuBackend>(model, opts);
}

}  // namespace merlin
