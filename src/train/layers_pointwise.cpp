// Embedding, RMSNorm, RoPE and SwiGLU: the layers that work token by token.
#include <algorithm>
#include <cmath>

#include "core/rng.h"
#include "core/thread_pool.h"
#include "train/layers.h"
#include "train/train_kernels.h"

namespace merlin::train {

void embedding_forward(ThreadPool& pool, const int32_t* tokens, int64_t n, const float* table, int64_t d, float* out) {
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) std::copy(table + tokens[t] * d, table + (tokens[t] + 1) * d, out + t * d);
  });
}

void embedding_backward(ThreadPool& pool, const int32_t* tokens, int64_t n, const float* dout, int64_t d,
                        int64_t vocab, float* dtable) {
  // Threads own ranges of vocabulary rows, so a row shared by several tokens is summed by one thread,
  // in token order.
  pool.parallel_for(vocab, [&](int64_t v0, int64_t v1) {
    for (int64_t t = 0; t < n; ++t) {
      if (tokens[t] < v0 || tokens[t] >= v1) continue;
      float* row = dtable + tokens[t] * d;
      const float* g = dout + t * d;
      for (int64_t i = 0; i < d; ++i) row[i] += g[i];
    }
  });
}

void rmsnorm_forward(ThreadPool& pool, const float* x, const float* w, int64_t n, int64_t d, float eps, float* y,
                     float* rstd) {
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* xt = x + t * d;
      float ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += xt[i] * xt[i];
      const float r = 1.0f / std::sqrt(ss / (float)d + eps);
      rstd[t] = r;
      float* yt = y + t * d;
      for (int64_t i = 0; i < d; ++i) yt[i] = xt[i] * r * w[i];
    }
  });
}

void rmsnorm_backward(ThreadPool& pool, const float* dy, const float* x, const float* w, const float* rstd, int64_t n,
                      int64_t d, float* dx, float* dw) {
  // dx_j = r w_j dy_j - r^3 x_j / d * sum_i(dy_i w_i x_i)
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float *dyt = dy + t * d, *xt = x + t * d;
      const float r = rstd[t];
      float dot = 0;
      for (int64_t i = 0; i < d; ++i) dot += dyt[i] * w[i] * xt[i];
      const float c = r * r * r * dot / (float)d;
      float* dxt = dx + t * d;
      for (int64_t i = 0; i < d; ++i) dxt[i] += r * w[i] * dyt[i] - c * xt[i];
    }
  });
  // The weight gradient sums over tokens: split by column so each element has one owner.
  pool.parallel_for(d, [&](int64_t i0, int64_t i1) {
    for (int64_t t = 0; t < n; ++t) {
      const float *dyt = dy + t * d, *xt = x + t * d;
      const float r = rstd[t];
      for (int64_t i = i0; i < i1; ++i) dw[i] += dyt[i] * xt[i] * r;
    }
  }, 16);
}

RopeTable::RopeTable(int64_t seq, int64_t rot, float theta) : n_rot(rot) {
  const int64_t half = rot / 2;
  cos.resize(seq * half);
  sin.resize(seq * half);
  for (int64_t p = 0; p < seq; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double ang = (double)p * std::pow((double)theta, -2.0 * (double)i / (double)rot);
      cos[p * half + i] = (float)std::cos(ang);
      sin[p * half + i] = (float)std::sin(ang);
    }
}

namespace {

// sign +1 rotates by the position's angle, -1 by its negative (the inverse, used for gradients).
void rope_apply(ThreadPool& pool, float* x, int64_t n, int64_t seq, int64_t row_stride, int64_t n_heads,
                int64_t head_dim, const RopeTable& rt, float sign) {
  const int64_t half = rt.n_rot / 2;
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = rt.cos.data() + (t % seq) * half;
      const float* s = rt.sin.data() + (t % seq) * half;
      for (int64_t h = 0; h < n_heads; ++h) {
        float* v = x + t * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = v[2 * i], x1 = v[2 * i + 1], si = sign * s[i];
          v[2 * i] = x0 * c[i] - x1 * si;
          v[2 * i + 1] = x0 * si + x1 * c[i];
        }
      }
    }
  });
}

}  // namespace

void rope_forward(ThreadPool& pool, float* x, int64_t n, int64_t seq, int64_t row_stride, int64_t n_heads,
                  int64_t head_dim, const RopeTable& rt) {
  rope_apply(pool, x, n, seq, row_stride, n_heads, head_dim, rt, 1.0f);
}

void rope_backward(ThreadPool& pool, float* dx, int64_t n, int64_t seq, int64_t row_stride, int64_t n_heads,
                   int64_t head_dim, const RopeTable& rt) {
  rope_apply(pool, dx, n, seq, row_stride, n_heads, head_dim, rt, -1.0f);
}

void swiglu_forward(ThreadPool& pool, const float* gu, int64_t n, int64_t f, float* h) {
  const kern::Table& kt = kern::table();
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) kt.swiglu(gu + t * 2 * f, gu + t * 2 * f + f, h + t * f, f);
  });
}

void swiglu_backward(ThreadPool& pool, const float* dh, const float* gu, int64_t n, int64_t f, float* dgu) {
  const kern::Table& kt = kern::table();
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* g = gu + t * 2 * f;
      kt.swiglu_backward(dh + t * f, g, g + f, dgu + t * 2 * f, dgu + t * 2 * f + f, f);
    }
  });
}

bool dropout_keep(uint64_t key, int64_t i, float p) {
  const uint64_t threshold = (uint64_t)((double)p * 16777216.0);  // p in units of 2^-24
  return (mix64(key + (uint64_t)i * 0x9e3779b97f4a7c15ull) >> 40) >= threshold;
}

void dropout_add(ThreadPool& pool, float p, uint64_t key, const float* branch, int64_t n, float* out) {
  const float scale = 1.0f / (1.0f - p);
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (dropout_keep(key, i, p)) out[i] += branch[i] * scale;
  });
}

void dropout_backward(ThreadPool& pool, float p, uint64_t key, const float* dout, int64_t n, float* dbranch) {
  const float scale = 1.0f / (1.0f - p);
  pool.parallel_for(n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dbranch[i] = dropout_keep(key, i, p) ? dout[i] * scale : 0.0f;
  });
}

}  // namespace merlin::train
