// Forward: x = embed(tokens); per layer x += Wo·attn(rope(q), rope(k), v) over rmsnorm(x), then
// x += Wdown·(silu(Wgate·h) * Wup·h) over h = rmsnorm(x); loss = xent(rmsnorm(x)·Eᵀ).
// Every intermediate the backward pass reads is kept per layer (residual inputs, normalised inputs and
// their rstd, post-RoPE q|k|v, attention log-sum-exps and outputs, gate|up and the SwiGLU output).
#include "train/network.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "train/gemm.h"

namespace merlin::train {

struct Network::Acts {
  int64_t n, d, q, qkv, f, h;
  std::vector<float> res;               // [L+1][n][d]: input of layer l; res[L] feeds the final norm
  std::vector<float> xn1, rstd1, qkv_;  // [L][n][d], [L][n], [L][n][qkv]
  std::vector<float> lse, att, mid;     // [L][n][heads], [L][n][q], [L][n][d]
  std::vector<float> xn2, rstd2, gu, hs;  // [L][n][d], [L][n], [L][n][2f], [L][n][f]
  std::vector<float> xnf, rstdf;        // [n][d], [n]
  // Gradient scratch shared by all layers; br / dbr: a dropped branch's output and its gradient.
  std::vector<float> dres, dxn, dqkv, datt, dgu, dh, br, dbr;

  Acts(const ModelConfig& c, int64_t n_) : n(n_), d(c.dim), q(c.n_heads * c.head_dim()), qkv(q + 2 * c.kv_dim()),
                                           f(c.ffn_dim), h(c.n_heads) {
    const int64_t L = c.n_layers;
    res.resize((L + 1) * n * d);
    xn1.resize(L * n * d);
    rstd1.resize(L * n);
    qkv_.resize(L * n * qkv);
    lse.resize(L * n * h);
    att.resize(L * n * q);
    mid.resize(L * n * d);
    xn2.resize(L * n * d);
    rstd2.resize(L * n);
    gu.resize(L * n * 2 * f);
    hs.resize(L * n * f);
    xnf.resize(n * d);
    rstdf.resize(n);
    dres.resize(n * d);
    dxn.resize(n * d);
    dqkv.resize(n * qkv);
    datt.resize(n * q);
    dgu.resize(n * 2 * f);
    dh.resize(n * f);
    br.resize(n * d);
    dbr.resize(n * d);
  }
  float* res_at(int l) { return res.data() + l * n * d; }
  float* xn1_at(int l) { return xn1.data() + l * n * d; }
  float* rstd1_at(int l) { return rstd1.data() + l * n; }
  float* qkv_at(int l) { return qkv_.data() + l * n * qkv; }
  float* lse_at(int l) { return lse.data() + l * n * h; }
  float* att_at(int l) { return att.data() + l * n * q; }
  float* mid_at(int l) { return mid.data() + l * n * d; }
  float* xn2_at(int l) { return xn2.data() + l * n * d; }
  float* rstd2_at(int l) { return rstd2.data() + l * n; }
  float* gu_at(int l) { return gu.data() + l * n * 2 * f; }
  float* hs_at(int l) { return hs.data() + l * n * f; }
};

Network::Network(const ModelConfig& c, int64_t batch, int64_t seq, ThreadPool& pool)
    : c_(c), layout_(c), batch_(batch), seq_(seq), pool_(pool),
      shape_{batch, seq, c.n_heads, c.n_kv_heads, c.head_dim()}, rope_(seq, c.rot_dims(), c.rope_theta),
      params_(layout_.total()), grads_(layout_.total()), a_(std::make_unique<Acts>(c, batch * seq)),
      head_(batch * seq, c.vocab_size) {
  MERLIN_CHECK(batch > 0 && seq > 0, "batch and sequence length must be positive");
  MERLIN_CHECK(seq <= c.context_length, "sequence length ", seq, " exceeds the model's context length ",
               c.context_length);
  inputs_.resize(batch * seq);
  targets_.resize(batch * seq);
}

Network::~Network() = default;

void Network::zero_grads() { std::fill(grads_.begin(), grads_.end(), 0.0f); }

void Network::set_tokens(const int32_t* tokens, int64_t rows) {
  MERLIN_CHECK(rows > 0 && rows <= batch_, "internal: ", rows, " rows for a batch of ", batch_);
  for (int64_t b = 0; b < rows; ++b)
    for (int64_t t = 0; t < seq_; ++t) {
      const int32_t* row = tokens + b * (seq_ + 1);
      MERLIN_CHECK(row[t] >= 0 && row[t] < c_.vocab_size && row[t + 1] >= 0 && row[t + 1] < c_.vocab_size,
                   "token id outside the vocabulary of ", c_.vocab_size);
      inputs_[b * seq_ + t] = row[t];
      targets_[b * seq_ + t] = row[t + 1];
    }
}

void Network::set_dropout(float p, uint64_t key) {
  MERLIN_CHECK(p >= 0.0f && p < 1.0f, "dropout must be in [0, 1), got ", p);
  drop_p_ = p;
  drop_key_ = key;
}

uint64_t Network::branch_key(int layer, int branch) const {
  return drop_key_ ^ (((uint64_t)(2 * layer + branch) + 1) * 0xd1b54a32d192ed03ull);
}

double Network::forward_backward(const int32_t* tokens, int64_t rows, float grad_scale) {
  set_tokens(tokens, rows);
  const double loss = forward(rows * seq_, grad_scale);
  backward(rows * seq_);
  return loss;
}

double Network::forward_loss(const int32_t* tokens, int64_t rows) {
  set_tokens(tokens, rows);
  return forward(rows * seq_, 0.0f);
}

// Runs the layers and the head; with grad_scale != 0 the head's backward runs too (it is fused with the
// loss), leaving d(loss)/d(final norm output) in dxn.
double Network::forward(int64_t n, float grad_scale) {
  Acts& a = *a_;
  shape_.batch = n / seq_;
  embedding_forward(pool_, inputs_.data(), n, w(layout_.token_embd), c_.dim, a.res_at(0));
  for (int l = 0; l < c_.n_layers; ++l) {
    attention_block(l, n);
    ffn_block(l, n);
  }
  rmsnorm_forward(pool_, a.res_at(c_.n_layers), w(layout_.output_norm), n, c_.dim, c_.norm_eps, a.xnf.data(),
                  a.rstdf.data());
  return head_loss(pool_, a.xnf.data(), w(layout_.output), targets_.data(), n, c_.dim, c_.vocab_size, grad_scale,
                   head_, a.dxn.data(), g(layout_.output));
}

void Network::attention_block(int l, int64_t n) {
  Acts& a = *a_;
  const ParamLayout::Layer& L = layout_.layers[l];
  const int64_t d = c_.dim, hd = c_.head_dim();
  rmsnorm_forward(pool_, a.res_at(l), w(L.attn_norm), n, d, c_.norm_eps, a.xn1_at(l), a.rstd1_at(l));
  float* qkv = a.qkv_at(l);
  linear_forward(pool_, a.xn1_at(l), w(L.wqkv), n, d, a.qkv, qkv);
  rope_forward(pool_, qkv, n, seq_, a.qkv, c_.n_heads, hd, rope_);
  rope_forward(pool_, qkv + a.q, n, seq_, a.qkv, c_.n_kv_heads, hd, rope_);
  attention_forward(pool_, shape_, qkv, a.att_at(l), a.lse_at(l));
  std::memcpy(a.mid_at(l), a.res_at(l), sizeof(float) * n * d);
  if (drop_p_ > 0.0f) {
    linear_forward(pool_, a.att_at(l), w(L.wo), n, a.q, d, a.br.data());
    dropout_add(pool_, drop_p_, branch_key(l, 0), a.br.data(), n * d, a.mid_at(l));
  } else {
    linear_forward(pool_, a.att_at(l), w(L.wo), n, a.q, d, a.mid_at(l), /*accumulate=*/true);
  }
}

void Network::ffn_block(int l, int64_t n) {
  Acts& a = *a_;
  const ParamLayout::Layer& L = layout_.layers[l];
  const int64_t d = c_.dim, f = c_.ffn_dim;
  rmsnorm_forward(pool_, a.mid_at(l), w(L.ffn_norm), n, d, c_.norm_eps, a.xn2_at(l), a.rstd2_at(l));
  linear_forward(pool_, a.xn2_at(l), w(L.wgu), n, d, 2 * f, a.gu_at(l));
  swiglu_forward(pool_, a.gu_at(l), n, f, a.hs_at(l));
  std::memcpy(a.res_at(l + 1), a.mid_at(l), sizeof(float) * n * d);
  if (drop_p_ > 0.0f) {
    linear_forward(pool_, a.hs_at(l), w(L.wdown), n, f, d, a.br.data());
    dropout_add(pool_, drop_p_, branch_key(l, 1), a.br.data(), n * d, a.res_at(l + 1));
  } else {
    linear_forward(pool_, a.hs_at(l), w(L.wdown), n, f, d, a.res_at(l + 1), /*accumulate=*/true);
  }
}

// d(loss)/d(branch output) of layer l's branch: the residual's gradient, through the dropout mask if any.
const float* Network::branch_grad(int l, int branch, int64_t n) {
  Acts& a = *a_;
  if (drop_p_ <= 0.0f) return a.dres.data();
  dropout_backward(pool_, drop_p_, branch_key(l, branch), a.dres.data(), n * c_.dim, a.dbr.data());
  return a.dbr.data();
}

void Network::backward(int64_t n) {
  Acts& a = *a_;
  std::fill(a.dres.begin(), a.dres.begin() + n * c_.dim, 0.0f);
  rmsnorm_backward(pool_, a.dxn.data(), a.res_at(c_.n_layers), w(layout_.output_norm), a.rstdf.data(), n, c_.dim,
                   a.dres.data(), g(layout_.output_norm));
  for (int l = c_.n_layers - 1; l >= 0; --l) {
    ffn_block_backward(l, n);
    attention_block_backward(l, n);
  }
  embedding_backward(pool_, inputs_.data(), n, a.dres.data(), c_.dim, c_.vocab_size, g(layout_.token_embd));
}

void Network::ffn_block_backward(int l, int64_t n) {
  Acts& a = *a_;
  const ParamLayout::Layer& L = layout_.layers[l];
  const int64_t d = c_.dim, f = c_.ffn_dim;
  const float* dy = branch_grad(l, 1, n);
  linear_backward_input(pool_, dy, w(L.wdown), n, f, d, a.dh.data(), false);
  linear_backward_weight(pool_, dy, a.hs_at(l), n, f, d, g(L.wdown));
  swiglu_backward(pool_, a.dh.data(), a.gu_at(l), n, f, a.dgu.data());
  linear_backward_input(pool_, a.dgu.data(), w(L.wgu), n, d, 2 * f, a.dxn.data(), false);
  linear_backward_weight(pool_, a.dgu.data(), a.xn2_at(l), n, d, 2 * f, g(L.wgu));
  rmsnorm_backward(pool_, a.dxn.data(), a.mid_at(l), w(L.ffn_norm), a.rstd2_at(l), n, d, a.dres.data(),
                   g(L.ffn_norm));
}

void Network::attention_block_backward(int l, int64_t n) {
  Acts& a = *a_;
  const ParamLayout::Layer& L = layout_.layers[l];
  const int64_t d = c_.dim, hd = c_.head_dim();
  const float* dy = branch_grad(l, 0, n);
  linear_backward_input(pool_, dy, w(L.wo), n, a.q, d, a.datt.data(), false);
  linear_backward_weight(pool_, dy, a.att_at(l), n, a.q, d, g(L.wo));
  attention_backward(pool_, shape_, a.qkv_at(l), a.lse_at(l), a.datt.data(), a.dqkv.data());
  rope_backward(pool_, a.dqkv.data(), n, seq_, a.qkv, c_.n_heads, hd, rope_);
  rope_backward(pool_, a.dqkv.data() + a.q, n, seq_, a.qkv, c_.n_kv_heads, hd, rope_);
  linear_backward_input(pool_, a.dqkv.data(), w(L.wqkv), n, d, a.qkv, a.dxn.data(), false);
  linear_backward_weight(pool_, a.dqkv.data(), a.xn1_at(l), n, d, a.qkv, g(L.wqkv));
  rmsnorm_backward(pool_, a.dxn.data(), a.res_at(l), w(L.attn_norm), a.rstd1_at(l), n, d, a.dres.data(),
                   g(L.attn_norm));
}

}  // namespace merlin::train
