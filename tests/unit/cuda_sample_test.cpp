// Sampling kernels (sample.cu, sample_slices.cu, sample_nucleus.cu) against the host: greedy argmax against
// sampler.h's first-maximum loop, and every filtered and unfiltered draw against runtime/row_sampling.h's
// sample_row on peaked, flat, crowded and tied rows, at slice borders and with large candidate sets and
// nuclei. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"
#include "cuda_test_util.h"
#include "quant_test_util.h"
#include "runtime/row_sampling.h"
#include "test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;

namespace {

#define REQUIRE_GPU() MERLIN_REQUIRE_GPU()

using test::gaussian;
using test::DevFloats;
using test::download;

}  // namespace

// Greedy argmax on the device against the host loop of sampler.h's argmax (first maximum wins): rows with
// the maximum repeated at several places, all-equal and all -inf rows, lengths around the CTA's 1024 threads.
TEST(CudaSample, ArgmaxRowsMatchesHostFirstMaximum) {
  REQUIRE_GPU();
  for (int64_t n : {1, 31, 1023, 1025, 50257}) {
    SCOPED_TRACE(n);
    const int rows = 6;
    const int64_t ld = n + 3;  // rows not packed: exercises the stride
    std::vector<float> h = gaussian((size_t)rows * ld, (uint32_t)n);
    for (int64_t i = 0; i < n; ++i) {
      h[(size_t)(1 * ld + i)] = std::round(h[(size_t)(1 * ld + i)]);  // many exact ties at the maximum
      h[(size_t)(2 * ld + i)] = 0.5f;                                  // all equal: index 0
      h[(size_t)(3 * ld + i)] = -INFINITY;                             // all -inf: index 0
    }
    h[(size_t)(4 * ld + n - 1)] = 100.0f;                              // maximum at the very end
    if (n > 2) h[(size_t)(5 * ld + n / 2)] = h[(size_t)(5 * ld + n - 1)] = 100.0f;  // tie: the first one
    DevFloats d(h);
    auto* out = static_cast<int32_t*>(cu::dev_alloc(rows * sizeof(int32_t)));
    cu::argmax_rows(d.p, ld, rows, n, out, nullptr);
    cu::sync_device();
    std::vector<int32_t> got(rows);
    cu::copy_to_host(got.data(), out, rows * sizeof(int32_t));
    cu::dev_free(out);
    for (int r = 0; r < rows; ++r) {
      int64_t best = 0;
      for (int64_t i = 1; i < n; ++i)
        if (h[(size_t)(r * ld + i)] > h[(size_t)(r * ld + best)]) best = i;
      EXPECT_EQ(got[r], best) << "row " << r;
    }
  }
}

// sample_rows, then sample_rows_more for the rows it leaves as kSampleMore (as CudaBackend::forward_sample
// does); *n_more counts those rows.
std::vector<int32_t> run_sample_rows(float* d_logits, int64_t ld, int rows, int64_t n, const RowSampling* d_spec,
                                     const LogitAdjust* d_adj, int32_t* d_out, void* d_work, int* n_more = nullptr) {
  cu::sample_rows(d_logits, ld, rows, n, d_spec, d_adj, d_out, nullptr, d_work);
  cu::sync_device();
  std::vector<int32_t> got(rows);
  cu::copy_to_host(got.data(), d_out, rows * sizeof(int32_t));
  const int more = (int)std::count(got.begin(), got.end(), cu::kSampleMore);
  if (n_more) *n_more = more;
  if (more > 0) {
    cu::sample_rows_more(d_logits, ld, rows, n, d_spec, d_out, nullptr, d_work);
    cu::sync_device();
    cu::copy_to_host(got.data(), d_out, rows * sizeof(int32_t));
  }
  return got;
}

// The host rows h (rows x n) sampled on the device with slices (d_work), spec and optional adjustments uploaded
// for the call and freed after it; n_more: the rows sample_rows left to sample_rows_more.
std::vector<int32_t> sample_on_device(const std::vector<float>& h, int64_t n, int rows,
                                      const std::vector<RowSampling>& spec, const std::vector<LogitAdjust>* adjust,
                                      int* n_more) {
  auto* d_spec = test::upload(spec);
  auto* d_adj = adjust ? test::upload(*adjust) : nullptr;
  auto* d_out = static_cast<int32_t*>(cu::dev_alloc(rows * sizeof(int32_t)));
  void* d_work = cu::dev_alloc(cu::sample_rows_work_bytes(rows, n));
  DevFloats d_logits(h);
  const std::vector<int32_t> got = run_sample_rows(d_logits.p, n, rows, n, d_spec, d_adj, d_out, d_work, n_more);
  for (void* p : {static_cast<void*>(d_spec), static_cast<void*>(d_adj), static_cast<void*>(d_out), d_work})
    cu::dev_free(p);
  return got;
}

// Sampling on the device (sample_rows) against runtime's sample_row on the host for the same logits and
// uniforms, with one CTA per row and with rows cut into slices (the backend's default): greedy and tempered
// rows, top-k / top-p / min-p alone and chained, biases and penalties (entries of other rows in between, ids
// outside the row ignored), rows shorter than the CTA, one slice plus one token and the GPT-2 vocabulary, ties
// at the candidate threshold, uniforms near 0 and 1, and rows whose likely tokens crowd into one slice. A
// top-k above one CTA's 1024 candidates is left to the host (-1); the sliced path keeps it.
TEST(CudaSample, SampleRowsMatchesHostSampleRow) {
  REQUIRE_GPU();
  std::mt19937 gen(3);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  struct Filter { int top_k; float top_p, min_p; };
  const Filter filters[] = {{0, 1.0f, 0.0f}, {40, 1.0f, 0.0f}, {0, 0.9f, 0.0f}, {0, 1.0f, 0.05f},
                            {40, 0.95f, 0.05f}, {1, 1.0f, 0.0f}, {300, 0.5f, 0.0f}, {2000, 1.0f, 0.0f},
                            {0, 0.9f, 0.0f}, {100, 1.0f, 0.001f}};
  const int n_filters = (int)(sizeof(filters) / sizeof(filters[0]));
  for (int64_t n : {37, 1025, 4097, 50257}) {
    SCOPED_TRACE(n);
    const int rows = 60;
    const int64_t ld = n + 5;
    std::vector<float> h = gaussian((size_t)rows * ld, (uint32_t)n, 2.0f);
    for (int r = 0; r < rows; ++r) {
      float* row = h.data() + (size_t)r * ld;
      // A few likely tokens, except in rows whose filters keep at most 300 candidates anyway: those stay flat,
      // so their draws spread over dozens of kept tokens.
      const int f = r % n_filters;
      if (f != 1 && f != 4 && f != 6 && f < 8)
        for (int b = 0; b < 6; ++b) row[(b * 131 + r * 17) % n] += 14.0f + 1.5f * (float)b;
      if (f >= 8)  // 150 likely tokens side by side: most of the kept ones in one slice of 2048
        for (int b = 0; b < 150; ++b) row[(r * 7 + b) % n] += 12.0f + 0.01f * (float)b;
      if (r % 4 == 3)  // exact ties around the candidate threshold: many copies of a few values
        for (int64_t i = 0; i < n; ++i) row[i] = std::round(row[i] * 2.0f) / 2.0f;
    }
    std::vector<RowSampling> spec(rows);
    std::vector<LogitAdjust> adjust;
    const float temps[] = {0.0f, 0.5f, 0.8f, 1.0f, 1.0f, 1.6f};
    for (int r = 0; r < rows; ++r) {
      spec[r].temperature = temps[r % 6];
      const Filter& f = filters[r % n_filters];
      spec[r].top_k = f.top_k;
      spec[r].top_p = f.top_p;
      spec[r].min_p = f.min_p;
      spec[r].u = r == 1 ? 0.0 : r == 2 ? 0.999999999 : uni(gen);
      spec[r].first = (int32_t)adjust.size();
      for (int a = 0; a < r % 5 * 7; ++a) {
        LogitAdjust e;
        e.token = a == 3 ? (int32_t)(n + 9) : (int32_t)((a * 7919 + r) % n);
        e.flags = 1 + a % 3;
        e.bias = (float)(a % 2 ? 5.5 : -2.25);
        e.penalty = 0.3f * (float)(a % 4);
        if (std::any_of(adjust.begin() + spec[r].first, adjust.end(),
                        [&](const LogitAdjust& x) { return x.token == e.token; }))
          continue;  // one entry per token, as RequestSampler builds them
        adjust.push_back(e);
      }
      spec[r].n_adjust = (int32_t)adjust.size() - spec[r].first;
    }
    auto* d_spec = test::upload(spec);
    auto* d_adj = adjust.empty() ? nullptr : test::upload(adjust);
    auto* d_out = static_cast<int32_t*>(cu::dev_alloc(rows * sizeof(int32_t)));
    void* d_work = cu::dev_alloc(cu::sample_rows_work_bytes(rows, n));
    for (bool sliced : {false, true}) {
      SCOPED_TRACE(sliced ? "sliced rows" : "one CTA per row");
      DevFloats d_logits(h);  // the adjustments apply in place: fresh logits for each run
      const std::vector<int32_t> got =
          run_sample_rows(d_logits.p, ld, rows, n, d_spec, d_adj, d_out, sliced ? d_work : nullptr);
      SampleScratch work;
      int filtered_on_device = 0;
      for (int r = 0; r < rows; ++r) {
        // One CTA per row keeps 1024 candidates: a top-k of 2000 is left to the host. The sliced path keeps
        // the 256 best of each slice of 2048 (4096 in all), so it covers the top 2000 of the GPT-2
        // vocabulary's 25 slices, but not of 4097 tokens' 3 slices: the host's again. (With 1025 tokens a
        // top-k of 2000 is off: the whole row, which sample_rows_more draws from.)
        const bool too_many = spec[r].temperature > 0 && spec[r].top_k == 2000 &&
                              (sliced ? n > 2000 && n < 50000 : n > 1024);
        if (too_many) {
          EXPECT_EQ(got[r], -1) << "row " << r;
          continue;
        }
        filtered_on_device += spec[r].temperature > 0 && spec[r].filtered();
        EXPECT_EQ(got[r], sample_row(h.data() + (size_t)r * ld, n, spec[r], adjust.data(), work))
            << "row " << r << " temperature " << spec[r].temperature << " top_k " << spec[r].top_k << " top_p "
            << spec[r].top_p << " min_p " << spec[r].min_p << " u " << spec[r].u;
      }
      EXPECT_GT(filtered_on_device, 20);
      // The flat rows' draws land on many different candidates (a draw stuck on the first one would not).
      std::set<int32_t> flat_picks;
      for (int r = 0; r < rows; ++r)
        if (spec[r].temperature > 0 && (r % n_filters == 1 || r % n_filters == 6)) flat_picks.insert(got[r]);
      EXPECT_GE(flat_picks.size(), 6u);
    }
    for (void* p : {static_cast<void*>(d_spec), static_cast<void*>(d_adj), static_cast<void*>(d_out), d_work})
      cu::dev_free(p);
  }
}

// Unfiltered draws with the sliced path at uniforms that land at the slices' borders: the token must be the
// host loop's, including the first and last token of a slice and the row's last token.
TEST(CudaSample, SampleRowsSlicedDrawsAtSliceBorders) {
  REQUIRE_GPU();
  const int64_t n = 3 * 2048 + 7;
  const int rows = 64;
  std::vector<float> h((size_t)rows * n, -30.0f);
  std::vector<RowSampling> spec(rows);
  for (int r = 0; r < rows; ++r) {
    float* row = h.data() + (size_t)r * n;
    // Four tokens carry the mass: a slice's last and the next slice's first, the last token, one inside.
    for (int64_t i : {(int64_t)2047, (int64_t)2048, n - 1, (int64_t)5000}) row[i] = 0.0f;
    spec[r].temperature = 1.0f;
    spec[r].u = (r + 0.5) / rows;  // not at a border of the four tokens' mass
  }
  auto* d_spec = test::upload(spec);
  auto* d_out = static_cast<int32_t*>(cu::dev_alloc(rows * sizeof(int32_t)));
  void* d_work = cu::dev_alloc(cu::sample_rows_work_bytes(rows, n));
  DevFloats d_logits(h);
  cu::sample_rows(d_logits.p, n, rows, n, d_spec, nullptr, d_out, nullptr, d_work);
  cu::sync_device();
  std::vector<int32_t> got(rows);
  cu::copy_to_host(got.data(), d_out, rows * sizeof(int32_t));
  SampleScratch work;
  std::set<int32_t> seen;
  for (int r = 0; r < rows; ++r) {
    EXPECT_EQ(got[r], sample_row(h.data() + (size_t)r * n, n, spec[r], nullptr, work)) << "u " << spec[r].u;
    seen.insert(got[r]);
  }
  EXPECT_EQ(seen, (std::set<int32_t>{2047, 2048, 5000, (int32_t)(n - 1)}));
}

// The sliced path keeps up to 4096 candidates on the device, where one CTA per row stops at 1024 (-1, the
// host finishes): nuclei, min-p sets and top-k of about 3,000 tokens spread over every slice of the GPT-2
// vocabulary, against the host.
TEST(CudaSample, SampleRowsSlicedKeepsLargeCandidateSets) {
  REQUIRE_GPU();
  const int64_t n = 50257;
  const int rows = 12;
  std::vector<float> h = gaussian((size_t)rows * n, 77, 1.0f);
  std::vector<RowSampling> spec(rows);
  std::mt19937 gen(5);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int r = 0; r < rows; ++r) {
    float* row = h.data() + (size_t)r * n;
    for (int b = 0; b < 3000; ++b) row[((int64_t)b * 16 + r) % n] += 10.0f;  // 3,000 likely tokens, every slice
    spec[r].temperature = r % 2 ? 0.7f : 1.0f;
    spec[r].u = uni(gen);
    switch (r % 3) {
      case 0: spec[r].top_p = 0.9f; break;      // a nucleus of about 2,700
      case 1: spec[r].min_p = 0.001f; break;    // about 3,000 survive
      default: spec[r].top_k = 3000; break;     // above one CTA's 1024 candidates
    }
  }
  int n_more = 0;
  const std::vector<int32_t> got = sample_on_device(h, n, rows, spec, nullptr, &n_more);
  EXPECT_EQ(n_more, 0);  // merged candidates suffice
  SampleScratch work;
  for (int r = 0; r < rows; ++r)
    EXPECT_EQ(got[r], sample_row(h.data() + (size_t)r * n, n, spec[r], nullptr, work))
        << "row " << r << " top_k " << spec[r].top_k << " top_p " << spec[r].top_p << " min_p " << spec[r].min_p;
}

// Filters without top-k that keep more tokens than the merged candidates (top-p alone and min-p on flat
// rows: nuclei of thousands to tens of thousands): sample_rows leaves them as kSampleMore and
// sample_rows_more finds the cut and the draw by mass-weighted radix selects. Same tokens as the host for
// every uniform tried, with biases, temperatures below and above 1, and a vocabulary of one slice plus one.
TEST(CudaSample, SampleRowsMoreDrawsFromLargeNuclei) {
  REQUIRE_GPU();
  struct Filter { float top_p, min_p; };
  const Filter filters[] = {{0.3f, 0.0f}, {0.5f, 0.0f}, {0.9f, 0.0f}, {0.99f, 0.0f},
                            {1.0f, 1e-4f}, {1.0f, 1e-3f}, {0.8f, 1e-3f}, {0.95f, 0.02f}};
  const float temps[] = {0.7f, 1.0f, 1.5f};
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int64_t n : {(int64_t)2049, (int64_t)50257}) {
    SCOPED_TRACE(n);
    const int rows = 48;
    std::vector<float> h = gaussian((size_t)rows * n, (uint32_t)(n + 1), 1.5f);
    std::vector<RowSampling> spec(rows);
    std::vector<LogitAdjust> adjust;
    for (int r = 0; r < rows; ++r) {
      spec[r].temperature = temps[r % 3];
      spec[r].top_p = filters[r % 8].top_p;
      spec[r].min_p = filters[r % 8].min_p;
      spec[r].u = r == 0 ? 0.0 : r == 1 ? 0.999999999 : uni(gen);
      spec[r].first = (int32_t)adjust.size();
      for (int a = 0; a < r % 3 * 5; ++a) {
        LogitAdjust e;
        e.token = (int32_t)((a * 977 + r * 31) % n);
        e.flags = LogitAdjust::kBias;
        e.bias = a % 2 ? 3.0f : -1.0f;
        adjust.push_back(e);
      }
      spec[r].n_adjust = (int32_t)adjust.size() - spec[r].first;
    }
    int n_more = 0;
    const std::vector<int32_t> got = sample_on_device(h, n, rows, spec, &adjust, &n_more);
    if (n > 10000) {
      EXPECT_GE(n_more, rows / 2);  // the path under test ran
    }
    SampleScratch work;
    std::set<int32_t> picks;
    for (int r = 0; r < rows; ++r) {
      EXPECT_EQ(got[r], sample_row(h.data() + (size_t)r * n, n, spec[r], adjust.data(), work))
          << "row " << r << " temperature " << spec[r].temperature << " top_p " << spec[r].top_p << " min_p "
          << spec[r].min_p << " u " << spec[r].u;
      picks.insert(got[r]);
    }
    EXPECT_GE(picks.size(), (size_t)rows - 4);  // flat rows: the draws spread
  }
}
