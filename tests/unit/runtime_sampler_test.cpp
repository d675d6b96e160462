#include <cmath>
#include <map>

#include "runtime/sampler.h"
#include "test_util.h"

using namespace merlin;

namespace {
std::vector<float> logits_of(std::initializer_list<float> l) { return std::vector<float>(l); }
}  // namespace

TEST(Sampler, GreedyPicksArgmax) {
  SamplerOptions o;
  o.temperature = 0;
  Sampler s(o);
  const auto l = logits_of({0.1f, 3.0f, -1.0f, 2.9f});
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  SamplerOptions o;
  o.temperature = 1.0f;
  o.top_k = 0;
  o.top_p = 1.0f;
  o.min_p = 0;
  o.seed = 7;
  std::vector<float> l(100);
  for (int i = 0; i < 100; ++i) l[i] = std::sin((float)i);
  Sampler a(o), b(o);
  std::vector<int32_t> ta, tb;
  for (int i = 0; i < 200; ++i) {
    ta.push_back(a.sample(l.data(), 100));
    tb.push_back(b.sample(l.data(), 100));
  }
  EXPECT_EQ(ta, tb);
  o.seed = 8;
  Sampler c(o);
  std::vector<int32_t> tc;
  for (int i = 0; i < 200; ++i) tc.push_back(c.sample(l.data(), 100));
  EXPECT_NE(ta, tc);
}

TEST(Sampler, TemperatureFollowsSoftmax) {
  SamplerOptions o;
  o.temperature = 1.0f;
  o.top_k = 0;
  o.top_p = 1.0f;
  o.min_p = 0;
  o.seed = 1;
  Sampler s(o);
  const auto l = logits_of({0.0f, std::log(3.0f)});  // p = 0.25, 0.75
  int ones = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ones += s.sample(l.data(), 2);
  EXPECT_NEAR(ones / (double)n, 0.75, 0.015);
}

TEST(Sampler, TopKTopPMinPRestrictCandidates) {
  const auto l = logits_of({5.0f, 4.0f, 3.0f, 2.0f, 1.0f});
  auto draw_set = [&](SamplerOptions o) {
    o.temperature = 5.0f;  // flatten so every allowed token shows up
    std::map<int, int> seen;
    Sampler s(o);
    for (int i = 0; i < 3000; ++i) seen[s.sample(l.data(), 5)]++;
    return seen;
  };
  SamplerOptions o;
  o.top_p = 1.0f;
  o.min_p = 0;
  o.top_k = 2;
  EXPECT_EQ(draw_set(o).size(), 2u);
  o.top_k = 0;
  o.top_p = 0.7f;  // p(5)=0.64, p(4)=0.24 -> cumulative 0.88 >= 0.7 keeps 2
  EXPECT_EQ(draw_set(o).size(), 2u);
  o.top_p = 1.0f;
  o.min_p = 0.3f;  // keeps tokens with p >= 0.3 * p_max: exp(-1)=0.37 yes, exp(-2)=0.135 no
  EXPECT_EQ(draw_set(o).size(), 2u);
}

TEST(Sampler, RepetitionPenaltyDemotesSeenTokens) {
  SamplerOptions o;
  o.temperature = 0;
  o.repeat_penalty = 2.0f;
  Sampler s(o);
  const auto l = logits_of({2.0f, 1.5f, -1.0f});
  EXPECT_EQ(s.sample(l.data(), 3), 0);
  s.accept(0);  // 2.0 -> 1.0 < 1.5
  EXPECT_EQ(s.sample(l.data(), 3), 1);
}
