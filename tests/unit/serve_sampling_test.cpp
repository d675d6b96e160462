// serve::RequestSampler (penalties, top-k / top-p / min-p without a vocabulary sort, per-request seeds) and
// serve::token_logprob.
#include <cmath>
#include <limits>
#include <string>
#include <vector>
#include <map>
#include <set>

#include "core/rng.h"
#include "runtime/row_sampling.h"
#include "runtime/sampler.h"
#include "serve/sampling.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::serve;

namespace {

SamplingParams params(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

std::map<int32_t, int> histogram(const SamplingParams& p, const std::vector<float>& logits, int n, uint64_t seed = 1) {
  RequestSampler s(p, seed);
  std::map<int32_t, int> h;
  for (int i = 0; i < n; ++i) ++h[s.sample(logits.data(), (int64_t)logits.size())];
  return h;
}

// Probabilities 0.5, 0.3, 0.1, 0.1 then a long tail of tiny ones.
std::vector<float> peaked(int vocab = 1000) {
  std::vector<float> l((size_t)vocab, -30.0f);
  l[10] = std::log(0.5f);
  l[20] = std::log(0.3f);
  l[30] = std::log(0.1f);
  l[40] = std::log(0.1f);
  return l;
}

}  // namespace

TEST(RequestSampler, GreedyIsArgmax) {
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 2.9f};
  RequestSampler s(params(0.0f), 5);
  EXPECT_EQ(s.sample(l.data(), 4), 1);
  RequestSampler neg(params(-1.0f), 5);
  EXPECT_EQ(neg.sample(l.data(), 4), 1);
}

// greedy_token is runtime's argmax, vectorized: same index on ties (first wins, across and inside blocks and
// in the tail), -inf, NaNs anywhere, and every length around the block size.
TEST(GreedyToken, MatchesArgmax) {
  Rng rng(5);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t n : {1, 2, 15, 16, 255, 256, 257, 511, 512, 1000, 50257}) {
    for (int trial = 0; trial < 12; ++trial) {
      std::vector<float> x((size_t)n);
      for (float& v : x) v = (float)(int)(rng.uniform() * 8) - 4.0f;  // few distinct values: many ties
      if (trial == 1) std::fill(x.begin(), x.end(), -inf);
      if (trial == 2) x[0] = nan;
      if (trial == 3) x[(size_t)(n - 1)] = 100.0f;
      if (trial == 4) x[(size_t)(n / 2)] = nan;
      if (trial == 5) std::fill(x.begin(), x.end(), nan);
      if (trial == 6 && n > 1) x[0] = -inf, std::fill(x.begin() + 1, x.end(), nan);
      if (trial == 7) x[(size_t)(n / 3)] = inf;
      SCOPED_TRACE("n=" + std::to_string(n) + " trial=" + std::to_string(trial));
      EXPECT_EQ(greedy_token(x.data(), n), argmax(x.data(), n));
    }
  }
}

TEST(RequestSampler, TopKOneIsArgmax) {
  const auto h = histogram(params(1.5f, 1), peaked(), 200);
  EXPECT_EQ(h.size(), 1u);
  EXPECT_EQ(h.begin()->first, 10);
}

TEST(RequestSampler, TopPKeepsTheSmallestNucleus) {
  const auto h = histogram(params(1.0f, 0, 0.75f), peaked(), 2000);
  EXPECT_EQ(std::set<int32_t>({10, 20}), [&] {
    std::set<int32_t> s;
    for (auto& [id, n] : h) s.insert(id);
    return s;
  }());
  // Renormalised 0.5 : 0.3.
  EXPECT_NEAR(h.at(10) / 2000.0, 0.625, 0.04);
}

TEST(RequestSampler, TopPNeedingManyCandidatesWidensTheSort) {
  std::vector<float> flat(5000, 0.0f);  // uniform: top_p 0.9 keeps 4500 tokens
  const auto h = histogram(params(1.0f, 0, 0.9f), flat, 2000);
  int32_t highest = 0;
  for (auto& [id, n] : h) highest = std::max(highest, id);
  EXPECT_LT(highest, 4500);  // ties are broken by id, so the nucleus is ids 0..4499
  EXPECT_GT(h.size(), 1200u);  // ~1600 distinct ids expected from 2000 draws of 4500
}

TEST(RequestSampler, MinPDropsUnlikelyTokens) {
  const auto h = histogram(params(1.0f, 0, 1.0f, 0.25f), peaked(), 2000);  // keeps p >= 0.125
  for (auto& [id, n] : h) EXPECT_TRUE(id == 10 || id == 20) << id;
  const auto h2 = histogram(params(1.0f, 3, 1.0f, 0.0f), peaked(), 2000);
  for (auto& [id, n] : h2) EXPECT_TRUE(id == 10 || id == 20 || id == 30) << id;
}

TEST(RequestSampler, TemperatureFollowsSoftmax) {
  std::vector<float> l = {0.0f, std::log(3.0f)};  // 1 : 3 at temperature 1, 1 : 9 at 0.5
  auto h = histogram(params(1.0f), l, 20000);
  EXPECT_NEAR(h[1] / 20000.0, 0.75, 0.02);
  h = histogram(params(0.5f), l, 20000);
  EXPECT_NEAR(h[1] / 20000.0, 0.9, 0.02);
}

TEST(RequestSampler, SeedsAreReproducible) {
  Rng rng(3);
  std::vector<float> l(300);
  for (float& x : l) x = rng.normal();
  for (const SamplingParams& p : {params(1.0f), params(0.8f, 40, 0.95f, 0.05f)}) {
    auto run = [&](uint64_t seed) {
      RequestSampler s(p, seed);
      std::vector<int32_t> out;
      for (int i = 0; i < 100; ++i) out.push_back(s.sample(l.data(), 300));
      return out;
    };
    EXPECT_EQ(run(7), run(7));
    EXPECT_NE(run(7), run(8));
  }
}

TEST(RequestSampler, PresenceAndFrequencyPenalties) {
  std::vector<float> l = {5.0f, 4.5f, 0.0f};
  SamplingParams p = params(0.0f);
  p.presence_penalty = 0.4f;
  RequestSampler s(p, 1);
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  s.accept(0);  // 5.0 - 0.4 = 4.6 still wins
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  s.accept(0);  // presence does not grow with the count
  EXPECT_EQ(s.sample(l.data(), 3), 0);

  SamplingParams f = params(0.0f);
  f.frequency_penalty = 0.3f;
  RequestSampler t(f, 1);
  t.accept(0);  // 4.7
  EXPECT_EQ(t.sample(l.data(), 3), 0);
  t.accept(0);  // 4.4 < 4.5
  EXPECT_EQ(t.sample(l.data(), 3), 1);
  EXPECT_EQ(l[0], 5.0f);  // the caller's row is untouched
}

// OpenAI's logit_bias: added to the logits before sampling (ids outside the row are ignored here; the request
// parser rejects them), the caller's row untouched.
TEST(RequestSampler, LogitBias) {
  std::vector<float> l = {5.0f, 4.5f, 0.0f, -3.0f};
  SamplingParams p = params(0.0f);
  p.logit_bias = {{0, -100.0f}};  // bans the argmax
  EXPECT_EQ(RequestSampler(p, 1).sample(l.data(), 4), 1);
  p.logit_bias = {{3, 8.5f}, {99, 100.0f}};  // -3 + 8.5 = 5.5 > 5
  EXPECT_EQ(RequestSampler(p, 1).sample(l.data(), 4), 3);
  // +100 forces a token at any temperature, with or without filters.
  for (const SamplingParams& base : {params(1.0f), params(2.0f, 2, 0.9f, 0.1f)}) {
    SamplingParams q = base;
    q.logit_bias = {{2, 100.0f}};
    RequestSampler s(q, 5);
    for (int i = 0; i < 50; ++i) EXPECT_EQ(s.sample(l.data(), 4), 2);
  }
  // Biases and penalties add up.
  SamplingParams both = params(0.0f);
  both.logit_bias = {{1, 0.3f}};  // 4.8 against 5.0
  both.presence_penalty = 0.5f;
  RequestSampler b(both, 1);
  EXPECT_EQ(b.sample(l.data(), 4), 0);
  b.accept(0);  // 4.5 against 4.8
  EXPECT_EQ(b.sample(l.data(), 4), 1);
  EXPECT_EQ(l[0], 5.0f);
}

// What a backend receives for a row (row_sampling): the filters, one adjustment per token (bias, then
// penalty, appended after the entries already in the step's list), and the draw's uniform, taken from the
// request's RNG only when the row is not greedy.
TEST(RequestSampler, RowSamplingCarriesBiasesPenaltiesAndTheUniform) {
  SamplingParams p = params(0.8f, 40, 0.9f, 0.05f);
  p.presence_penalty = 0.7f;
  p.frequency_penalty = 0.45f;
  p.logit_bias = {{3, 2.5f}, {7, 30.0f}};
  RequestSampler s(p, 99);
  s.accept(7);
  s.accept(7);
  s.accept(9);
  std::vector<LogitAdjust> adjust = {{1234, 5.0f, 0.0f, LogitAdjust::kBias}};  // another row's entry
  const RowSampling r = s.row_sampling(adjust);
  EXPECT_EQ(r.first, 1);
  ASSERT_EQ(r.n_adjust, 3);
  EXPECT_EQ(r.temperature, 0.8f);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_EQ(r.top_p, 0.9f);
  EXPECT_EQ(r.min_p, 0.05f);
  std::map<int32_t, LogitAdjust> by_token;
  for (int i = 1; i < 4; ++i) by_token[adjust[(size_t)i].token] = adjust[(size_t)i];
  EXPECT_EQ(by_token[3].flags, LogitAdjust::kBias);
  EXPECT_EQ(by_token[3].bias, 2.5f);
  EXPECT_EQ(by_token[7].flags, LogitAdjust::kBias | LogitAdjust::kPenalty);
  EXPECT_EQ(by_token[7].bias, 30.0f);
  EXPECT_EQ(by_token[7].penalty, 0.7f + 0.45f * 2.0f);
  EXPECT_EQ(by_token[9].flags, LogitAdjust::kPenalty);
  EXPECT_EQ(by_token[9].penalty, 0.7f + 0.45f);
  Rng rng(99);
  EXPECT_EQ(r.u, rng.uniform_double());
  // A greedy row draws no uniform.
  RequestSampler g(params(0.0f), 5);
  std::vector<LogitAdjust> none;
  EXPECT_EQ(g.row_sampling(none).u, 0.0);
  EXPECT_TRUE(none.empty());
}

TEST(TokenLogprob, IsTheLogSoftmax) {
  std::vector<float> l = {1.0f, 3.0f, 3.0f, -2.0f};
  double z = 0;
  for (float x : l) z += std::exp((double)x);
  std::vector<std::pair<int32_t, float>> top;
  const float lp = token_logprob(l.data(), 4, 3, 3, &top);
  EXPECT_NEAR(lp, -2.0 - std::log(z), 1e-5);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].first, 1);  // ties by id
  EXPECT_EQ(top[1].first, 2);
  EXPECT_EQ(top[2].first, 0);
  EXPECT_NEAR(top[2].second, 1.0 - std::log(z), 1e-5);
  EXPECT_TRUE(token_logprob(l.data(), 4, 1, 0, &top) < 0 && top.empty());
  EXPECT_EQ(token_logprob(l.data(), 4, 1, 10, &top), top[0].second);
  EXPECT_EQ(top.size(), 4u);  // capped at the vocabulary
}
