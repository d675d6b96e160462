#include "runtime/row_sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/kernels.h"
#include "runtime/sampler.h"

namespace merlin {
namespace {

using Candidate = std::pair<int32_t, float>;  // id, logit

bool better(const Candidate& a, const Candidate& b) {
  return a.second > b.second || (a.second == b.second && a.first < b.first);
}

// The row's largest value, in eight independent running maxima: std::max_element's one running value
// kept every compare waiting on the previous one (about 100 µs for 50K logits, a third of a draw).
float row_max(const float* x, int64_t n) {
  float m[8];
  for (float& v : m) v = x[0];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  for (; i < n; ++i) m[0] = x[i] > m[0] ? x[i] : m[0];
  for (int j = 1; j < 8; ++j) m[0] = m[j] > m[0] ? m[j] : m[0];
  return m[0];
}

// cand = the n best tokens, sorted. For few of many (top-k 40 of 50K), only the tokens at or above the least
// of n chunk maxima enter the sort: those are n tokens, so the n-th best is at least that value, and a few
// hundred tokens pass instead of 50K (a draw's 90 µs were mostly this function).
void sort_best(const float* logits, int64_t n_vocab, size_t n, std::vector<Candidate>& cand) {
  const auto by_order = [](const Candidate& a, const Candidate& b) { return better(a, b); };
  if (n > 0 && n * 16 <= (size_t)n_vocab) {
    const int64_t chunk = n_vocab / (int64_t)n;
    float floor_v = row_max(logits, chunk);
    for (size_t c = 1; c < n; ++c) floor_v = std::min(floor_v, row_max(logits + (int64_t)c * chunk, chunk));
    cand.clear();
    for (int64_t i = 0; i < n_vocab; ++i)
      if (logits[i] >= floor_v) cand.push_back({(int32_t)i, logits[i]});
    n = std::min(n, cand.size());
    std::partial_sort(cand.begin(), cand.begin() + (std::ptrdiff_t)n, cand.end(), by_order);
    cand.resize(n);
    return;
  }
  cand.resize((size_t)n_vocab);
  for (int64_t i = 0; i < n_vocab; ++i) cand[(size_t)i] = {(int32_t)i, logits[i]};
  n = std::min(n, cand.size());
  // A lambda, not the function's name: a function pointer is not inlined into the sort (3x slower).
  std::partial_sort(cand.begin(), cand.begin() + (std::ptrdiff_t)n, cand.end(), by_order);
  cand.resize(n);
}

// The sequential top-p loop over the sorted candidates cand[0 .. n): the count that reaches top_p, or 0.
size_t top_p_count(const std::vector<Candidate>& cand, size_t n, float max_logit, double total, float top_p) {
  double cum = 0;
  for (size_t i = 0; i < n; ++i) {
    cum += std::exp((double)(cand[i].second - max_logit)) / total;
    if (cum >= top_p) return i + 1;
  }
  return 0;
}

// Sorts s.cand into better() order: logit descending, then id. The candidates arrive in id order, so a stable
// sort by logit alone is that order; four stable 8-bit passes (LSD radix) over the logit's order-preserving
// bits, descending (-0 taken as +0, as better() compares them equal). A flat row's nucleus is ~45,000 tokens,
// which std::sort took ~4.5 ms to order (a draw ~6 ms); the passes take a small fraction of that.
void sort_candidates_by_logit(SampleScratch& s) {
  const size_t n = s.cand.size();
  s.keys.resize(n);
  s.keys_tmp.resize(n);
  s.cand_tmp.resize(n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &s.cand[i].second, sizeof u);
    if (u == 0x80000000u) u = 0;
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
    s.keys[i] = ~u;                                  // descending
  }
  for (int shift = 0; shift < 32; shift += 8) {
    size_t count[257] = {};
    for (size_t i = 0; i < n; ++i) ++count[((s.keys[i] >> shift) & 0xFF) + 1];
    for (int b = 0; b < 256; ++b) count[b + 1] += count[b];
    for (size_t i = 0; i < n; ++i) {
      const size_t to = count[(s.keys[i] >> shift) & 0xFF]++;
      s.keys_tmp[to] = s.keys[i];
      s.cand_tmp[to] = s.cand[i];
    }
    s.keys.swap(s.keys_tmp);
    s.cand.swap(s.cand_tmp);
  }
}

// Without top-k, top-p's prefix: the tokens at or above a logit threshold taken from a histogram of p1 (the
// row's exp(l - max), bins of 1/64 nat below the maximum) where the mass from the top passes top_p × total
// with a margin for the histogram's different summation order; those are exactly the first tokens of the
// order (ties fall in one bin), sorted into cand; 0 when the margin did not cover the loop's cut (rounding).
// One pass and a sort of about the prefix, where growing partial sorts of the whole row cost ~18 ms for the
// flat rows of an untrained model (nuclei of 45,000 tokens).
size_t top_p_prefix(const float* logits, int64_t n_vocab, float max_logit, double total, size_t bound, float top_p,
                    SampleScratch& s) {
  constexpr int kBins = 2048;
  constexpr float kPerNat = 64.0f;
  const auto bin_of = [&](float l) {
    const float d = (max_logit - l) * kPerNat;
    return d < (float)(kBins - 1) ? (int)d : kBins - 1;  // NaN and the far tail: the last bin
  };
  s.bucket.assign(kBins, 0.0);
  for (int64_t i = 0; i < n_vocab; ++i) s.bucket[(size_t)bin_of(logits[i])] += s.p1[(size_t)i];
  const double target = (double)top_p * total * (1.0 + 1e-9);
  int last = kBins - 1;
  double acc = 0;
  for (int b = 0; b < kBins; ++b) {
    acc += s.bucket[(size_t)b];
    if (acc >= target) {
      last = b;
      break;
    }
  }
  s.cand.clear();
  for (int64_t i = 0; i < n_vocab; ++i)
    if (bin_of(logits[i]) <= last) s.cand.push_back({(int32_t)i, logits[i]});
  sort_candidates_by_logit(s);
  const size_t n = std::min(bound, s.cand.size());
  if (const size_t kept = top_p_count(s.cand, n, max_logit, total, top_p)) return kept;
  return s.cand.size() >= bound ? bound : 0;
}

// How many of the best candidates survive top-k, then top-p, then min-p, with probabilities at temperature 1
// over the top-k set. Leaves at least that many sorted in s.cand. Never sorts the whole vocabulary (a 50K-entry
// sort per token and request would dominate a 32-request step) unless the filters keep about all of it.
size_t nucleus(const float* logits, int64_t n_vocab, float max_logit, const RowSampling& r, SampleScratch& s) {
  std::vector<Candidate>& cand = s.cand;
  const bool top_k_on = r.top_k > 0 && r.top_k < n_vocab;
  const size_t k = top_k_on ? (size_t)r.top_k : (size_t)n_vocab;
  double total = 0;  // the normaliser over the top-k set
  if (top_k_on) {
    sort_best(logits, n_vocab, k, cand);
    for (const Candidate& c : cand) total += std::exp((double)(c.second - max_logit));
  } else if (r.top_p < 1.0f || r.min_p > 0) {
    s.p1.resize((size_t)n_vocab);
    total = kernels::kernels().exp_weights(logits, n_vocab, max_logit, 1.0, s.p1.data());
  }
  // min-p keeps the candidates with p >= min_p * p_max: a count, no sort needed. It keeps a prefix of the
  // order, so with top-k on the count among the k best is min(k, the row's count).
  size_t bound = k;
  if (r.min_p > 0) {
    size_t n = 0;
    if (top_k_on) {
      for (const Candidate& c : cand) n += std::exp((double)(c.second - max_logit)) >= r.min_p;
    } else {
      for (int64_t i = 0; i < n_vocab; ++i) n += s.p1[(size_t)i] >= r.min_p;
    }
    bound = std::min(bound, std::max<size_t>(n, 1));
  }
  if (r.top_p >= 1.0f) {
    if (!top_k_on) sort_best(logits, n_vocab, bound, cand);
    return bound;
  }
  if (!top_k_on)
    if (const size_t kept = top_p_prefix(logits, n_vocab, max_logit, total, bound, r.top_p, s)) return kept;
  // The top-p prefix: sort the best 64, then 512, ... until the cumulative probability reaches top_p.
  for (size_t n = std::min<size_t>(bound, 64);; n = std::min(bound, n * 8)) {
    if (!top_k_on) sort_best(logits, n_vocab, n, cand);
    if (const size_t kept = top_p_count(cand, n, max_logit, total, r.top_p)) return kept;
    if (n == bound) return bound;
  }
}

// Draws from the first n_kept candidates of cand (or the whole row, in id order, when n_kept == 0) with
// weights exp((logit - max) / temperature).
int32_t draw(const float* logits, int64_t n_vocab, float max_logit, const RowSampling& r, size_t n_kept,
             SampleScratch& s) {
  const double inv_t = 1.0 / r.temperature;
  const size_t n = n_kept ? n_kept : (size_t)n_vocab;
  s.weights.resize(n);
  double sum = 0;
  if (n_kept == 0) {  // the whole row: the kernel's weights (vectorised exp; scalar level: the loop below)
    sum = kernels::kernels().exp_weights(logits, n_vocab, max_logit, inv_t, s.weights.data());
  } else {
    for (size_t i = 0; i < n; ++i) sum += s.weights[i] = std::exp((double)(s.cand[i].second - max_logit) * inv_t);
  }
  double left = r.u * sum;
  size_t i = 0;
  if (n_kept == 0) {
    // Whole blocks first: a block's sum (four chains) says whether the token lies in it, so the walk waits on
    // one subtraction per 64 weights instead of one per weight (~30 of a whole-row draw's ~50 µs).
    constexpr size_t kBlock = 64;
    for (; i + kBlock <= n; i += kBlock) {
      double b[4] = {0, 0, 0, 0};
      for (size_t j = 0; j < kBlock; j += 4)
        for (int q = 0; q < 4; ++q) b[q] += s.weights[i + j + (size_t)q];
      const double block = (b[0] + b[1]) + (b[2] + b[3]);
      if (left - block < 0) break;
      left -= block;
    }
  }
  for (; i < n; ++i) {
    left -= s.weights[i];
    if (left < 0) return n_kept ? s.cand[i].first : (int32_t)i;
  }
  return n_kept ? s.cand[n - 1].first : (int32_t)(n - 1);
}

}  // namespace

int32_t sample_row(const float* logits, int64_t n_vocab, const RowSampling& r, const LogitAdjust* adjust,
                   SampleScratch& s) {
  const float* row = logits;
  if (r.n_adjust > 0) {
    s.work.assign(logits, logits + n_vocab);
    for (const LogitAdjust* a = adjust + r.first; a != adjust + r.first + r.n_adjust; ++a) {
      if (a->token < 0 || a->token >= n_vocab) continue;
      float l = s.work[(size_t)a->token];
      if (a->flags & LogitAdjust::kBias) l += a->bias;
      if (a->flags & LogitAdjust::kPenalty) l -= a->penalty;
      s.work[(size_t)a->token] = l;
    }
    row = s.work.data();
  }
  if (r.temperature <= 0) return argmax(row, n_vocab);
  const float max_logit = row_max(row, n_vocab);
  if (!r.filtered()) return draw(row, n_vocab, max_logit, r, 0, s);  // the whole vocabulary, in id order
  return draw(row, n_vocab, max_logit, r, std::max<size_t>(1, nucleus(row, n_vocab, max_logit, r, s)), s);
}

}  // namespace merlin
