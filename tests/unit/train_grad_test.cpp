// Finite-difference check of the hand-written backward pass on tiny models, plus its determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "train/layers.h"
#include "train/network.h"

namespace merlin::train {
namespace {

ModelConfig tiny_config(bool tied, int64_t n_rot) {
  ModelConfig c;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA
  c.ffn_dim = 24;
  c.vocab_size = 64;
  c.context_length = 8;
  c.n_rot = n_rot;
  c.tied_embeddings = tied;
  return c;
}

// Larger than the training init, so that every path carries a gradient well above float noise.
void randomize(Network& net, uint64_t seed) {
  Rng rng(seed);
  for (const ParamTensor& t : net.layout().tensors())
    for (size_t i = 0; i < t.size; ++i)
      net.params()[t.offset + i] = t.is_norm() ? 1.0f + 0.2f * rng.normal() : 0.3f * rng.normal();
}

std::vector<int32_t> random_tokens(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(rows * (seq + 1));
  for (auto& v : t) v = (int32_t)rng.below(vocab);
  return t;
}

double mean_loss(Network& net, const std::vector<int32_t>& tokens, int64_t rows) {
  return net.forward_loss(tokens.data(), rows) / (double)(rows * net.seq());
}

// Central differences at h and h/2 combined (Richardson), accurate to O(h^4).
double numeric_grad(Network& net, const std::vector<int32_t>& tokens, int64_t rows, size_t idx) {
  float& p = net.params()[idx];
  const float orig = p;
  auto diff = [&](double h) {
    p = (float)(orig + h);
    const double hp = (double)p - orig;
    const double up = mean_loss(net, tokens, rows);
    p = (float)(orig - h);
    const double hm = orig - (double)p;
    const double down = mean_loss(net, tokens, rows);
    p = orig;
    return (up - down) / (hp + hm);
  };
  const double h = 1e-2;
  return (4 * diff(h / 2) - diff(h)) / 3;
}

void check_gradients(const ModelConfig& c, float dropout = 0.0f) {
  ThreadPool pool(2);
  const int64_t rows = 3, seq = 6;
  Network net(c, rows, seq, pool);
  randomize(net, 7);
  net.set_dropout(dropout, 12345);  // the numeric losses below see the same masks
  const std::vector<int32_t> tokens = random_tokens(rows, seq, c.vocab_size, 11);
  net.zero_grads();
  net.forward_backward(tokens.data(), rows, 1.0f / (float)(rows * seq));
  const std::vector<float> grads = net.grads();
  Rng pick(3);
  for (const ParamTensor& t : net.layout().tensors()) {
    float gmax = 0;
    for (size_t i = 0; i < t.size; ++i) gmax = std::max(gmax, std::abs(grads[t.offset + i]));
    ASSERT_GT(gmax, 1e-4f) << t.name << " has no gradient";
    double worst = 0;
    for (int k = 0; k < 8; ++k) {
      const size_t idx = t.offset + pick.below(t.size);
      const double num = numeric_grad(net, tokens, rows, idx), ana = grads[idx];
      const double err = std::abs(num - ana) / gmax;
      worst = std::max(worst, err);
      EXPECT_LT(err, 2e-3) << t.name << "[" << idx - t.offset << "]: analytic " << ana << ", numeric " << num
                           << ", tensor max |grad| " << gmax;
    }
    std::printf("  %-24s max|grad| %.3e  worst rel err %.2e\n", t.name.c_str(), gmax, worst);
  }
}

TEST(TrainGrad, FiniteDifferencesTiedGqa) { check_gradients(tiny_config(true, 0)); }

TEST(TrainGrad, FiniteDifferencesUntiedPartialRope) { check_gradients(tiny_config(false, 2)); }

TEST(TrainGrad, FiniteDifferencesWithDropout) { check_gradients(tiny_config(true, 0), 0.3f); }

TEST(TrainGrad, DropoutMasksKeepTheirFraction) {
  const int64_t n = 1 << 20;
  for (float p : {0.1f, 0.25f, 0.5f}) {
    int64_t kept = 0, same = 0;
    for (int64_t i = 0; i < n; ++i) {
      const bool k = dropout_keep(7, i, p);
      kept += k;
      same += k == dropout_keep(8, i, p);
    }
    EXPECT_NEAR((double)kept / n, 1.0 - p, 3e-3) << p;
    // Another key gives an independent mask: agreement p^2 + (1 - p)^2.
    EXPECT_NEAR((double)same / n, p * p + (1 - p) * (1 - p), 3e-3) << p;
  }
  for (int64_t i = 0; i < 1000; ++i) EXPECT_TRUE(dropout_keep(7, i, 0.0f));
}

// Dropout changes the loss while set, and p = 0 gives back the model's own loss, bit for bit.
TEST(TrainGrad, DropoutOffIsTheModel) {
  const ModelConfig c = tiny_config(true, 0);
  const int64_t rows = 2, seq = 8;
  const std::vector<int32_t> tokens = random_tokens(rows, seq, c.vocab_size, 4);
  ThreadPool pool(2);
  Network net(c, rows, seq, pool);
  randomize(net, 3);
  const double plain = net.forward_loss(tokens.data(), rows);
  net.set_dropout(0.5f, 99);
  const double dropped = net.forward_loss(tokens.data(), rows);
  EXPECT_NE(plain, dropped);
  EXPECT_EQ(dropped, net.forward_loss(tokens.data(), rows));  // same key, same masks
  net.set_dropout(0.0f, 0);
  EXPECT_EQ(plain, net.forward_loss(tokens.data(), rows));
  EXPECT_THROW(net.set_dropout(1.0f, 0), Error);
}

// Gradients are bit-identical for any thread count (each element summed by one thread in a fixed order),
// and accumulating two half batches adds up to the gradient of the whole batch.
TEST(TrainGrad, DeterministicAcrossThreadCounts) {
  const ModelConfig c = tiny_config(true, 0);
  const int64_t rows = 4, seq = 8;
  const std::vector<int32_t> tokens = random_tokens(rows, seq, c.vocab_size, 5);
  std::vector<std::vector<float>> results;
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    Network net(c, rows, seq, pool);
    randomize(net, 1);
    net.zero_grads();
    const double loss = net.forward_backward(tokens.data(), rows, 0.03f);
    results.push_back(net.grads());
    results.back().push_back((float)loss);
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

TEST(TrainGrad, AccumulationMatchesFullBatch) {
  const ModelConfig c = tiny_config(true, 0);
  const int64_t rows = 4, seq = 8;
  const std::vector<int32_t> tokens = random_tokens(rows, seq, c.vocab_size, 9);
  ThreadPool pool(2);
  Network full(c, rows, seq, pool), half(c, rows / 2, seq, pool);
  randomize(full, 2);
  randomize(half, 2);
  full.zero_grads();
  half.zero_grads();
  const float scale = 1.0f / (float)(rows * seq);
  const double l_full = full.forward_backward(tokens.data(), rows, scale);
  double l_half = half.forward_backward(tokens.data(), rows / 2, scale);
  l_half += half.forward_backward(tokens.data() + (rows / 2) * (seq + 1), rows / 2, scale);
  EXPECT_NEAR(l_full, l_half, 1e-9 * std::abs(l_full));
  float gmax = 0;
  for (float v : full.grads()) gmax = std::max(gmax, std::abs(v));
  for (size_t i = 0; i < full.grads().size(); ++i) ASSERT_NEAR(full.grads()[i], half.grads()[i], 1e-5f * gmax) << i;
}

}  // namespace
}  // namespace merlin::train
