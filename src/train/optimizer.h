// AdamW with decoupled weight decay (PyTorch's formulation, so a reference run can follow it step by
// step), global-norm gradient clipping and the learning-rate schedule: linear warm-up, then cosine decay
// to min_lr.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "train/params.h"

namespace merlin {
class ThreadPool;
}

namespace merlin::train {

struct OptimConfig {
  double lr = 6e-4, min_lr = 6e-5;
  int64_t warmup = 100;
  int64_t steps = 1000;  // length of the schedule
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;  // 0: no clipping
  bool decay_embeddings = false;
};

// Learning rate of 0-based step `step`: lr * (step+1)/warmup during warm-up, then cosine from lr to min_lr
// over the remaining steps.
double lr_at(const OptimConfig& o, int64_t step);

// L2 norm of n floats, summed in fixed chunks in double: the same for any thread count.
double global_norm(ThreadPool& pool, const float* g, size_t n);
// Scales the gradient by clip / (norm + 1e-6) when that is below 1 (torch.nn.utils.clip_grad_norm_);
// returns the factor applied (1 when none).
float clip_gradient(ThreadPool& pool, float* g, size_t n, double norm, double clip);

class AdamW {
 public:
  AdamW(const ParamLayout& layout, const OptimConfig& o);
  // One update; t is the 1-based step count (for bias correction).
  void step(ThreadPool& pool, float* params, const float* grads, int64_t t, double lr);
  std::vector<float>& m() { return m_; }
  std::vector<float>& v() { return v_; }
  const std::vector<float>& m() const { return m_; }
  const std::vector<float>& v() const { return v_; }

 private:
  struct Range {
    size_t begin, end;
    bool decay;
  };
  OptimConfig o_;
  std::vector<Range> ranges_;  // one per tensor
  std::vector<float> m_, v_;
};

}  // namespace merlin::train
