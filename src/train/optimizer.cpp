#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/thread_pool.h"

namespace merlin::train {
namespace {
constexpr size_t kNormChunk = 1 << 14;
}

double lr_at(const OptimConfig& o, int64_t step) {
  if (o.warmup > 0 && step < o.warmup) return o.lr * (double)(step + 1) / (double)o.warmup;
  const int64_t decay_steps = std::max<int64_t>(1, o.steps - o.warmup);
  const double progress = std::min(1.0, (double)(step - o.warmup) / (double)decay_steps);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

double global_norm(ThreadPool& pool, const float* g, size_t n) {
  const size_t chunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<double> part(chunks);
  pool.parallel_for((int64_t)chunks, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      double s = 0;
      for (size_t i = c * kNormChunk; i < std::min(n, (c + 1) * kNormChunk); ++i) s += (double)g[i] * g[i];
      part[c] = s;
    }
  });
  double total = 0;
  for (double s : part) total += s;
  return std::sqrt(total);
}

float clip_gradient(ThreadPool& pool, float* g, size_t n, double norm, double clip) {
  if (clip <= 0) return 1.0f;
  const float coef = (float)(clip / (norm + 1e-6));
  if (coef >= 1.0f) return 1.0f;
  pool.parallel_for((int64_t)n, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) g[i] *= coef;
  });
  return coef;
}

AdamW::AdamW(const ParamLayout& layout, const OptimConfig& o) : o_(o), m_(layout.total()), v_(layout.total()) {
  for (const ParamTensor& t : layout.tensors()) {
    // Decaying norm gains towards 0 (rather than 1) or embeddings towards 0 only hurts small models.
    const bool decay = !t.is_norm() && (o.decay_embeddings || !t.is_embedding());
    ranges_.push_back({t.offset, t.offset + t.size, decay});
  }
}

void AdamW::step(ThreadPool& pool, float* params, const float* grads, int64_t t, double lr) {
  const float b1 = (float)o_.beta1, b2 = (float)o_.beta2;
  const float one_minus_b1 = (float)(1.0 - o_.beta1), one_minus_b2 = (float)(1.0 - o_.beta2);
  const double bc1 = 1.0 - std::pow(o_.beta1, (double)t), bc2 = 1.0 - std::pow(o_.beta2, (double)t);
  const float step_size = (float)(lr / bc1), bc2_sqrt = (float)std::sqrt(bc2), eps = (float)o_.eps;
  const float decay = (float)(1.0 - lr * o_.weight_decay);
  for (const Range& r : ranges_) {
    const float keep = r.decay ? decay : 1.0f;
    pool.parallel_for((int64_t)(r.end - r.begin), [&](int64_t b, int64_t e) {
      for (size_t i = r.begin + b; i < r.begin + e; ++i) {
        const float g = grads[i];
        const float m = m_[i] * b1 + g * one_minus_b1;
        const float v = v_[i] * b2 + g * g * one_minus_b2;
        m_[i] = m;
        v_[i] = v;
        params[i] = params[i] * keep - step_size * m / (std::sqrt(v) / bc2_sqrt + eps);
      }
    });
  }
}

}  // namespace merlin::train
