#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "runtime/row_sampling.h"
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

namespace {

// row_sampling.h's definition of sample_row, written the plain way: the whole row sorted by (logit
// descending, id), sums in the order the definition states. sample_row avoids that sort (partial sorts, a
// histogram for top-p's prefix) and must give the same token.
int32_t reference_sample_row(const float* logits, int64_t n, const RowSampling& r, const LogitAdjust* adjust) {
  std::vector<float> row(logits, logits + n);
  for (int a = r.first; a < r.first + r.n_adjust; ++a) {
    const LogitAdjust& e = adjust[a];
    if (e.token < 0 || e.token >= n) continue;
    if (e.flags & LogitAdjust::kBias) row[(size_t)e.token] += e.bias;
    if (e.flags & LogitAdjust::kPenalty) row[(size_t)e.token] -= e.penalty;
  }
  if (r.temperature <= 0) return argmax(row.data(), n);
  float mx = row[0];
  for (float v : row) mx = std::max(mx, v);
  const double inv_t = 1.0 / r.temperature;
  std::vector<int32_t> order((size_t)n);
  for (int64_t i = 0; i < n; ++i) order[(size_t)i] = (int32_t)i;
  size_t n_kept = (size_t)n;
  if (r.filtered()) {
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return row[(size_t)a] > row[(size_t)b] || (row[(size_t)a] == row[(size_t)b] && a < b);
    });
    const bool top_k_on = r.top_k > 0 && r.top_k < n;
    const size_t k = top_k_on ? (size_t)r.top_k : (size_t)n;
    double total = 0;
    if (top_k_on)
      for (size_t i = 0; i < k; ++i) total += std::exp((double)(row[(size_t)order[i]] - mx));
    else
      for (int64_t i = 0; i < n; ++i) total += std::exp((double)(row[(size_t)i] - mx));
    size_t bound = k;
    if (r.min_p > 0) {
      size_t c = 0;
      for (int64_t i = 0; i < n; ++i) c += std::exp((double)(row[(size_t)i] - mx)) >= r.min_p;
      bound = std::min(bound, std::max<size_t>(c, 1));
    }
    n_kept = bound;
    if (r.top_p < 1.0f) {
      double cum = 0;
      for (size_t i = 0; i < bound; ++i) {
        cum += std::exp((double)(row[(size_t)order[i]] - mx)) / total;
        if (cum >= r.top_p) {
          n_kept = i + 1;
          break;
        }
      }
    }
  }
  std::vector<double> w(n_kept);
  double sum = 0;
  for (size_t i = 0; i < n_kept; ++i) sum += w[i] = std::exp((double)(row[(size_t)order[i]] - mx) * inv_t);
  double left = r.u * sum;
  for (size_t i = 0; i < n_kept; ++i) {
    left -= w[i];
    if (left < 0) return order[i];
  }
  return order[n_kept - 1];
}

}  // namespace

// sample_row against the plain definition on rows of the GPT-2 vocabulary's size and small ones: peaked rows,
// flat ones (nuclei of tens of thousands: the histogram prefix), exact ties, every filter alone and chained,
// biases and penalties, temperatures around 1, uniforms at 0, near 1 and random.
TEST(SampleRow, MatchesThePlainDefinition) {
  std::mt19937 gen(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  struct Filter { int top_k; float top_p, min_p; };
  const Filter filters[] = {{0, 1.0f, 0.0f}, {40, 1.0f, 0.0f}, {0, 0.9f, 0.0f}, {0, 0.5f, 0.0f},
                            {0, 0.99f, 0.0f}, {0, 1.0f, 0.05f}, {40, 0.95f, 0.05f}, {0, 0.95f, 1e-4f},
                            {300, 0.8f, 0.0f}, {1, 1.0f, 0.0f}};
  SampleScratch scratch;
  int rows = 0;
  for (int64_t n : {(int64_t)7, (int64_t)1000, (int64_t)50257}) {
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> l((size_t)n);
      for (float& v : l) v = normal(gen) * (shape == 0 ? 3.0f : 1.0f);
      if (shape == 1)  // peaked: a few likely tokens
        for (int b = 0; b < 5; ++b) l[(size_t)((b * 7919) % n)] += 10.0f + (float)b;
      if (shape == 2)  // exact ties everywhere
        for (float& v : l) v = std::round(v * 4.0f) / 4.0f;
      for (const Filter& f : filters) {
        for (float t : {0.0f, 0.7f, 1.0f, 1.3f}) {
          RowSampling r;
          r.temperature = t;
          r.top_k = f.top_k;
          r.top_p = f.top_p;
          r.min_p = f.min_p;
          r.u = rows % 7 == 0 ? 0.0 : rows % 7 == 1 ? 0.999999999 : uni(gen);
          std::vector<LogitAdjust> adjust;
          if (rows % 3 == 0) {
            adjust.push_back({(int32_t)(rows % n), 2.5f, 0.0f, LogitAdjust::kBias});
            adjust.push_back({(int32_t)((rows * 31 + 1) % n), 0.0f, 0.7f, LogitAdjust::kPenalty});
            if (adjust[1].token == adjust[0].token) adjust.pop_back();
            r.n_adjust = (int32_t)adjust.size();
          }
          EXPECT_EQ(sample_row(l.data(), n, r, adjust.data(), scratch),
                    reference_sample_row(l.data(), n, r, adjust.data()))
              << "n " << n << " shape " << shape << " top_k " << f.top_k << " top_p " << f.top_p << " min_p "
              << f.min_p << " temperature " << t << " u " << r.u;
          ++rows;
        }
      }
    }
  }
  EXPECT_EQ(rows, 3 * 3 * 10 * 4);
}
