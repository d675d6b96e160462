// The trainable model: parameters, gradients and the cached activations of one micro-batch, with the
// forward and backward passes built from the layer functions in layers.h.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/thread_pool.h"
#include "model/config.h"
#include "train/layers.h"
#include "train/params.h"

namespace merlin::train {

class Network {
 public:
  // Activations are sized for `batch` rows of `seq` tokens; the pool is shared with the caller.
  Network(const ModelConfig& c, int64_t batch, int64_t seq, ThreadPool& pool);
  ~Network();
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  const ModelConfig& config() const { return c_; }
  const ParamLayout& layout() const { return layout_; }
  int64_t batch() const { return batch_; }
  int64_t seq() const { return seq_; }
  std::vector<float>& params() { return params_; }
  const std::vector<float>& params() const { return params_; }
  std::vector<float>& grads() { return grads_; }
  const std::vector<float>& grads() const { return grads_; }
  ThreadPool& pool() { return pool_; }

  void zero_grads();
  // tokens: `rows` (<= batch) windows of seq+1 ids; inputs are ids [0, seq), targets [1, seq].
  // Adds grad_scale * d(sum of token losses)/dθ to grads() and returns that sum (before scaling).
  double forward_backward(const int32_t* tokens, int64_t rows, float grad_scale);
  double forward_loss(const int32_t* tokens, int64_t rows);  // no gradients
  // Residual dropout for the passes that follow (layers.h): each layer's attention and MLP outputs are
  // dropped with probability p, with masks drawn from `key` (the trainer's: seed, step, micro-batch). p = 0
  // (the default) turns it off, as evaluation needs.
  void set_dropout(float p, uint64_t key);

 private:
  struct Acts;
  void set_tokens(const int32_t* tokens, int64_t rows);
  double forward(int64_t n, float grad_scale);
  void attention_block(int l, int64_t n);
  void ffn_block(int l, int64_t n);
  void backward(int64_t n);
  void ffn_block_backward(int l, int64_t n);
  void attention_block_backward(int l, int64_t n);
  const float* branch_grad(int l, int branch, int64_t n);
  const float* w(size_t offset) const { return params_.data() + offset; }
  float* g(size_t offset) { return grads_.data() + offset; }

  ModelConfig c_;
  ParamLayout layout_;
  int64_t batch_, seq_;
  ThreadPool& pool_;
  AttnShape shape_;
  RopeTable rope_;
  std::vector<float> params_, grads_;
  std::unique_ptr<Acts> a_;
  HeadScratch head_;
  std::vector<int32_t> inputs_, targets_;
  float drop_p_ = 0.0f;
  uint64_t drop_key_ = 0;
  uint64_t branch_key(int layer, int branch) const;  // branch 0: attention, 1: MLP
};

}  // namespace merlin::train
