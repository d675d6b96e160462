#include "runtime/perplexity.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/sys.h"
#include "runtime/backend.h"
#include "runtime/model.h"

namespace merlin {
namespace {

// llama-perplexity's log_softmax: float max, exp in float, sum in double.
double log_prob(const float* logits, int64_t n_vocab, int32_t tok) {
  float max_logit = logits[0];
  for (int64_t i = 1; i < n_vocab; ++i) max_logit = std::max(max_logit, logits[i]);
  double sum_exp = 0;
  for (int64_t i = 0; i < n_vocab; ++i) sum_exp += std::exp(logits[i] - max_logit);
  return logits[tok] - max_logit - std::log(sum_exp);
}

// KL(p || q) of the softmaxes of two logit rows, in double, and whether their argmaxes agree.
struct KlPoint {
  double kl;
  bool same_top1;
};
KlPoint kl_divergence(const float* base, const float* model, int64_t n_vocab) {
  const int64_t ib = std::max_element(base, base + n_vocab) - base;
  const int64_t im = std::max_element(model, model + n_vocab) - model;
  double zb = 0, zm = 0;
  for (int64_t i = 0; i < n_vocab; ++i) {
    zb += std::exp((double)base[i] - base[ib]);
    zm += std::exp((double)model[i] - model[im]);
  }
  const double lzb = std::log(zb), lzm = std::log(zm);
  double kl = 0;
  for (int64_t i = 0; i < n_vocab; ++i) {
    const double lb = (double)base[i] - base[ib] - lzb, lm = (double)model[i] - model[im] - lzm;
    kl += std::exp(lb) * (lb - lm);
  }
  return {std::max(0.0, kl), ib == im};
}

// Running sums of a sample, for mean and standard error.
struct Moments {
  double sum = 0, sum2 = 0;
  int64_t n = 0;
  void add(double x) { sum += x; sum2 += x * x; ++n; }
  double mean() const { return n ? sum / (double)n : 0; }
  double stderr_of_mean() const {
    if (n < 2) return 0;
    const double var = sum2 / (double)n - mean() * mean();
    return var > 0 ? std::sqrt(var / (double)(n - 1)) : 0;
  }
};

// Evaluates a group of chunks on one backend: chunk `first_chunk + s` runs as sequence s. Returns the
// logits of the scored positions, [s][pos - n_ctx/2][vocab].
class ChunkRunner {
 public:
  ChunkRunner(const Model& model, const PerplexityOptions& o, int n_seq) : model_(model), o_(o), n_seq_(n_seq) {
    BackendOptions bo;
    bo.n_threads = o.n_threads;
    bo.n_ctx = o.n_ctx;
    bo.n_seq = n_seq;
    bo.max_batch = n_seq > 1 ? n_seq * o.n_ctx : std::min(o.n_ctx, o.n_batch);
    bo.kv_type = o.kv_type;
    backend_ = make_backend(o.device, model, bo);
  }

  const std::vector<float>& run(const std::vector<int32_t>& tokens, int first_chunk, int n_seq_used) {
    const int n_ctx = o_.n_ctx, first = n_ctx / 2, n_scored = n_ctx - first - 1;
    const int64_t vocab = model_.config().vocab_size;
    logits_.resize((size_t)n_seq_used * n_scored * vocab);
    const int32_t bos = model_.tokenizer().bos_id();
    const bool add_bos = model_.tokenizer().add_bos() && bos >= 0;
    // Scored rows come out in batch order, which is (seq, pos) order, so they land in place.
    size_t written = 0;
    Batch batch;
    auto flush = [&] {
      if (batch.size() == 0) return;
      backend_->forward(batch, logits_.data() + written * vocab);
      written += batch.n_logits();
      batch.clear();
    };
    for (int s = 0; s < n_seq_used; ++s) {
      backend_->clear_sequence(s);
      const size_t start = (size_t)(first_chunk + s) * n_ctx;
      for (int p = 0; p < n_ctx; ++p) {
        const int32_t t = p == 0 && add_bos ? bos : tokens[start + p];
        batch.add(t, p, s, p >= first && p < n_ctx - 1);
        if ((int)batch.size() == backend_->max_batch()) flush();
      }
    }
    flush();
    return logits_;
  }

  int n_seq() const { return n_seq_; }

 private:
  const Model& model_;
  const PerplexityOptions& o_;
  int n_seq_;
  std::unique_ptr<Backend> backend_;
  std::vector<float> logits_;
};

}  // namespace

std::vector<int32_t> perplexity_tokens(const Tokenizer& tok, const std::string& text, bool parse_special) {
  std::vector<int32_t> ids;
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const std::vector<int32_t> body = tok.encode(text, parse_special);  // llama.cpp: parse_special = false
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

PerplexityResult compute_perplexity(const Model& model, const std::vector<int32_t>& tokens,
                                    const PerplexityOptions& o, const Model* base,
                                    const std::function<void(int, double)>& on_chunk) {
  MERLIN_CHECK(o.n_ctx >= 4, "context of ", o.n_ctx, " tokens is too small to score (at least 4)");
  MERLIN_CHECK((int64_t)tokens.size() >= 2 * (int64_t)o.n_ctx, "the text has ", tokens.size(),
               " tokens; at least 2 * context = ", 2 * o.n_ctx, " are needed (use a smaller -c)");
  const int64_t vocab = model.config().vocab_size;
  if (base) {
    MERLIN_CHECK(base->config().vocab_size == vocab, "the base model's vocabulary (", base->config().vocab_size,
                 " tokens) differs from the model's (", vocab, ")");
  }
  PerplexityResult r;
  r.n_ctx = o.n_ctx;
  r.has_base = base != nullptr;
  const int n_chunk_max = (int)(tokens.size() / (size_t)o.n_ctx);
  r.n_chunks = o.max_chunks < 0 ? n_chunk_max : std::min(o.max_chunks, n_chunk_max);
  const int n_seq = std::max(1, std::min(o.n_batch / o.n_ctx, r.n_chunks));
  ChunkRunner runner(model, o, n_seq);
  std::unique_ptr<ChunkRunner> base_runner;
  if (base) base_runner = std::make_unique<ChunkRunner>(*base, o, n_seq);

  const int first = o.n_ctx / 2, n_scored = o.n_ctx - first - 1;
  const Tokenizer& tok = model.tokenizer();
  Moments nll, kl;
  int64_t top1 = 0;
  for (int c0 = 0; c0 < r.n_chunks; c0 += n_seq) {
    const int used = std::min(n_seq, r.n_chunks - c0);
    const double t0 = now_seconds();
    const std::vector<float>& lg = runner.run(tokens, c0, used);
    r.seconds += now_seconds() - t0;
    const std::vector<float>* blg = base_runner ? &base_runner->run(tokens, c0, used) : nullptr;
    for (int s = 0; s < used; ++s) {
      const size_t start = (size_t)(c0 + s) * o.n_ctx;
      for (int i = 0; i < n_scored; ++i) {
        const size_t row = ((size_t)s * n_scored + i) * vocab;
        const size_t pos = start + first + i;
        nll.add(-log_prob(&lg[row], vocab, tokens[pos + 1]));
        r.scored_bytes += tok.decode_token(tokens[pos + 1], tokens[pos]).size();
        if (blg) {
          const KlPoint k = kl_divergence(&(*blg)[row], &lg[row], vocab);
          kl.add(k.kl);
          top1 += k.same_top1;
        }
      }
      if (on_chunk) on_chunk(c0 + s, std::exp(nll.mean()));
    }
  }
  r.n_scored = nll.n;
  r.n_evaluated = (int64_t)r.n_chunks * o.n_ctx;
  r.nll = nll.mean();
  r.nll_err = nll.stderr_of_mean();
  r.ppl = std::exp(r.nll);
  r.ppl_err = r.ppl * r.nll_err;
  r.bits_per_byte = r.scored_bytes ? nll.sum / std::log(2.0) / (double)r.scored_bytes : 0;
  if (base) {
    r.kl = kl.mean();
    r.kl_err = kl.stderr_of_mean();
    r.top1 = nll.n ? (double)top1 / (double)nll.n : 0;
  }
  return r;
}

}  // namespace merlin
