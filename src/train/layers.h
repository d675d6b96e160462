// Forward and backward of every layer of the model, as free functions on flat float buffers (llm.c style).
// Activations are rows of tokens: [n_tokens][width], token t of sequence b at row b*seq + t.
//
// Conventions: backward functions *accumulate* into parameter gradients (so micro-batches add up) and
// into the residual-stream gradient; other input gradients are overwritten unless stated. Every parallel
// loop gives each output element to exactly one thread and sums in a fixed order, so results do not
// depend on the thread count.
#pragma once
#include <cstdint>
#include <vector>

namespace merlin {
class ThreadPool;
}

namespace merlin::train {

// ---- embedding: out[t] = table[tokens[t]] ----
void embedding_forward(ThreadPool& pool, const int32_t* tokens, int64_t n, const float* table, int64_t d, float* out);
// dtable[tokens[t]] += dout[t], rows added in token order.
void embedding_backward(ThreadPool& pool, const int32_t* tokens, int64_t n, const float* dout, int64_t d,
                        int64_t vocab, float* dtable);

// ---- RMSNorm: y = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps); rstd [n] is kept for backward ----
void rmsnorm_forward(ThreadPool& pool, const float* x, const float* w, int64_t n, int64_t d, float eps, float* y,
                     float* rstd);
// dx += d(y)/dx · dy (accumulates: x is the residual stream); dw += sum over tokens.
void rmsnorm_backward(ThreadPool& pool, const float* dy, const float* x, const float* w, const float* rstd, int64_t n,
                      int64_t d, float* dx, float* dw);

// ---- RoPE (llama.cpp "normal": adjacent pairs of the first n_rot dims of each head) ----
struct RopeTable {
  int64_t n_rot = 0;
  std::vector<float> cos, sin;  // [pos][n_rot/2], angles computed in double
  RopeTable(int64_t seq, int64_t n_rot, float theta);
};
// Rotates heads [h0, h0+n_heads) of every row in place; the row of token i sits at position i % seq.
// Backward applies the inverse rotation (the transpose) to the gradient.
void rope_forward(ThreadPool& pool, float* x, int64_t n, int64_t seq, int64_t row_stride, int64_t n_heads,
                  int64_t head_dim, const RopeTable& rt);
void rope_backward(ThreadPool& pool, float* dx, int64_t n, int64_t seq, int64_t row_stride, int64_t n_heads,
                   int64_t head_dim, const RopeTable& rt);

// ---- SwiGLU on fused gate|up rows gu [n][2f]: h = silu(gate) * up ----
void swiglu_forward(ThreadPool& pool, const float* gu, int64_t n, int64_t f, float* h);
void swiglu_backward(ThreadPool& pool, const float* dh, const float* gu, int64_t n, int64_t f, float* dgu);

// ---- residual dropout (training only) ----
// A branch output joins the residual stream as out[i] += keep(i) ? branch[i] / (1 - p) : 0. keep(i) is a hash
// of (key, i), not a draw from a stream: the backward pass regenerates the mask, nothing needs storing, and a
// step's masks follow from its key alone (resumed runs repeat them). Each keeps a fraction 1 - p, to 2^-24.
bool dropout_keep(uint64_t key, int64_t i, float p);
void dropout_add(ThreadPool& pool, float p, uint64_t key, const float* branch, int64_t n, float* out);
// dbranch (overwritten) = keep(i) ? dout[i] / (1 - p) : 0.
void dropout_backward(ThreadPool& pool, float p, uint64_t key, const float* dout, int64_t n, float* dbranch);

// ---- causal self-attention with GQA on fused q|k|v rows [n][q_dim + 2 kv_dim] ----
struct AttnShape {
  int64_t batch, seq, n_heads, n_kv_heads, head_dim;
  int64_t q_dim() const { return n_heads * head_dim; }
  int64_t kv_dim() const { return n_kv_heads * head_dim; }
  int64_t qkv_dim() const { return q_dim() + 2 * kv_dim(); }
};
// out [n][q_dim]; lse [n][n_heads] keeps each softmax row's log-sum-exp so backward can rebuild the
// probabilities from q and k instead of storing batch*heads*seq^2 of them.
void attention_forward(ThreadPool& pool, const AttnShape& s, const float* qkv, float* out, float* lse);
// dqkv (overwritten) from dout.
void attention_backward(ThreadPool& pool, const AttnShape& s, const float* qkv, const float* lse, const float* dout,
                        float* dqkv);

// ---- tied (or separate) output head + softmax cross-entropy, in chunks of rows ----
struct HeadScratch {
  std::vector<float> logits;  // [chunk][vocab]
  std::vector<float> losses;  // [n]
  int64_t chunk = 0;
  HeadScratch(int64_t n, int64_t vocab);
};
// Returns the sum over rows of -log softmax(x·Wᵀ)[target]. With grad_scale != 0 also writes
// dx = grad_scale * d(sum)/dx and adds grad_scale * d(sum)/dW to dw.
double head_loss(ThreadPool& pool, const float* x, const float* w, const int32_t* targets, int64_t n, int64_t d,
                 int64_t vocab, float grad_scale, HeadScratch& scratch, float* dx, float* dw);

}  // namespace merlin::train
