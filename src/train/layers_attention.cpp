// Causal self-attention with grouped KV heads, one (sequence, head) at a time as small matrix products
// on the calling thread (gemm_serial), the pairs spread over the pool.
//
// Forward keeps only each softmax row's log-sum-exp; backward rebuilds the probabilities from Q·Kᵀ,
// which costs one extra product instead of storing batch × heads × seq² probabilities per layer.
// The products run over the full seq × seq square: the masked half is computed and discarded (its
// probabilities are exactly 0), which the GEMM still does faster than row-by-row dot products.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/thread_pool.h"
#include "train/gemm.h"
#include "train/layers.h"
#include "train/train_kernels.h"

namespace merlin::train {
namespace {

// Views of one head's rows inside the fused q|k|v activations of one sequence.
struct HeadViews {
  const float* rows;  // first row of the sequence
  int64_t W;          // row stride (q_dim + 2 kv_dim)
  int64_t q, k, v;    // column offsets of this head's q and of its KV head's k and v
  MatRef Q() const { return {rows + q, W, 1}; }
  MatRef K() const { return {rows + k, W, 1}; }
  MatRef Kt() const { return {rows + k, 1, W}; }
  MatRef V() const { return {rows + v, W, 1}; }
  MatRef Vt() const { return {rows + v, 1, W}; }
};

HeadViews views(const AttnShape& s, const float* qkv, int64_t b, int64_t h) {
  const int64_t W = s.qkv_dim(), kvh = h / (s.n_heads / s.n_kv_heads);
  return {qkv + b * s.seq * W, W, h * s.head_dim, s.q_dim() + kvh * s.head_dim, s.q_dim() + s.kv_dim() + kvh * s.head_dim};
}

// P = softmax rows of scale·Q·Kᵀ under the causal mask, rebuilt from the saved log-sum-exps (or, with
// lse_out, computing and saving them). Entries above the diagonal are exactly 0.
void probabilities(const AttnShape& s, const HeadViews& hv, float scale, float* P, const float* lse_in, float* lse_out,
                   int64_t lse_stride) {
  const kern::Table& kt = kern::table();
  const int64_t T = s.seq;
  gemm_serial(T, T, s.head_dim, hv.Q(), hv.Kt(), P, T, false);
  for (int64_t t = 0; t < T; ++t) {
    float* row = P + t * T;
    for (int64_t j = 0; j <= t; ++j) row[j] *= scale;
    if (lse_out) {
      lse_out[t * lse_stride] = kt.softmax_lse(row, t + 1);
    } else {
      kt.exp_shift(row, t + 1, lse_in[t * lse_stride]);
    }
    std::fill(row + t + 1, row + T, 0.0f);
  }
}

}  // namespace

void attention_forward(ThreadPool& pool, const AttnShape& s, const float* qkv, float* out, float* lse) {
  const int64_t T = s.seq, units = s.batch * s.n_heads;
  const float scale = 1.0f / std::sqrt((float)s.head_dim);
  pool.run([&](int ti, int nt) {
    std::vector<float> P(T * T);
    for (int64_t u = units * ti / nt; u < units * (ti + 1) / nt; ++u) {
      const int64_t b = u / s.n_heads, h = u % s.n_heads;
      const HeadViews hv = views(s, qkv, b, h);
      probabilities(s, hv, scale, P.data(), nullptr, lse + b * T * s.n_heads + h, s.n_heads);
      // O = P·V
      gemm_serial(T, s.head_dim, T, MatRef{P.data(), T, 1}, hv.V(), out + b * T * s.q_dim() + h * s.head_dim,
                  s.q_dim(), false);
    }
  });
}

// With S = scale·Q·Kᵀ, P = softmax(S) (causal), O = P·V:
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ⊙ (dP - rowsum(P ⊙ dP)),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q.
// A thread owns one (sequence, KV head) pair with every query head that reads it, so the dK/dV sums of
// a group are made by one thread in a fixed order.
void attention_backward(ThreadPool& pool, const AttnShape& s, const float* qkv, const float* lse, const float* dout,
                        float* dqkv) {
  const int64_t T = s.seq, W = s.qkv_dim(), hd = s.head_dim, group = s.n_heads / s.n_kv_heads;
  const int64_t units = s.batch * s.n_kv_heads;
  const float scale = 1.0f / std::sqrt((float)hd);
  pool.run([&](int ti, int nt) {
    std::vector<float> P(T * T), dP(T * T);
    for (int64_t u = units * ti / nt; u < units * (ti + 1) / nt; ++u) {
      const int64_t b = u / s.n_kv_heads, kvh = u % s.n_kv_heads;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        const HeadViews hv = views(s, qkv, b, h);
        float* drows = dqkv + b * T * W;
        const MatRef dO{dout + b * T * s.q_dim() + h * hd, s.q_dim(), 1};
        const bool first = h == kvh * group;  // the group's first head starts the dK/dV sums
        probabilities(s, hv, scale, P.data(), lse + b * T * s.n_heads + h, nullptr, s.n_heads);
        gemm_serial(T, hd, T, MatRef{P.data(), 1, T}, dO, drows + hv.v, W, !first);  // dV (+)= Pᵀ·dO
        gemm_serial(T, T, hd, dO, hv.Vt(), dP.data(), T, false);                      // dP = dO·Vᵀ
        for (int64_t t = 0; t < T; ++t) {
          float *p = P.data() + t * T, *dp = dP.data() + t * T;
          float sum = 0;
          for (int64_t j = 0; j <= t; ++j) sum += p[j] * dp[j];
          for (int64_t j = 0; j <= t; ++j) p[j] = p[j] * (dp[j] - sum) * scale;  // P now holds scale·dS
        }
        gemm_serial(T, hd, T, MatRef{P.data(), T, 1}, hv.K(), drows + hv.q, W, false);         // dQ
        gemm_serial(T, hd, T, MatRef{P.data(), 1, T}, hv.Q(), drows + hv.k, W, !first);         // dK (+)=
      }
    }
  });
}

}  // namespace merlin::train
