#include "runtime/generate.h"

#include <algorithm>

#include "core/error.h"
#include "core/sys.h"
#include "runtime/backend.h"
#include "runtime/model.h"
#include "runtime/sampler.h"

namespace merlin {

std::vector<float> prefill(const Model& model, Backend& backend, const std::vector<int32_t>& tokens, int seq,
                           int start, bool all_logits) {
  const int64_t vocab = model.config().vocab_size;
  const int n = (int)tokens.size();
  MERLIN_CHECK(n > 0, "nothing to evaluate: the prompt is empty");
  MERLIN_CHECK(start + n <= backend.n_ctx(), "prompt of ", n, " tokens does not fit in the context of ",
               backend.n_ctx(), " tokens");
  std::vector<float> logits((size_t)(all_logits ? n : 1) * vocab);
  Batch batch;
  int written = 0;
  for (int i0 = 0; i0 < n; i0 += backend.max_batch()) {
    const int i1 = std::min(n, i0 + backend.max_batch());
    batch.clear();
    for (int i = i0; i < i1; ++i) batch.add(tokens[i], start + i, seq, all_logits || i == n - 1);
    backend.forward(batch, logits.data() + (size_t)written * vocab);
    written += (int)batch.n_logits();
  }
  return logits;
}

namespace {

// How a step's one logits row becomes the next token: the backend's argmax when sampling is plain greedy;
// otherwise the sampler's draw as a RowSampling through Backend::forward_sample (sample_row, the server's
// definition: a GPU samples where its logits are and only the id comes back, the CPU backend samples its
// logits on the host), so every backend and the server give the same tokens for the same logits and seed.
// Only a repetition penalty, which RowSampling does not carry, has the logits come back for
// Sampler::sample.
class TokenPicker {
 public:
  TokenPicker(Backend& backend, Sampler& sampler, int64_t vocab)
      : backend_(backend), sampler_(sampler), vocab_(vocab),
        greedy_(sampler.options().temperature <= 0.0f && sampler.options().repeat_penalty == 1.0f) {}

  bool greedy() const { return greedy_; }

  int32_t pick(const Batch& batch) {
    int32_t token = 0;
    if (greedy_) {  // Sampler::sample() reduces to argmax() for these options (sampler.cpp)
      backend_.forward_greedy(batch, vocab_, &token);
      return token;
    }
    RowSampling row;
    if (sampler_.row_sampling(row)) {
      backend_.forward_sample(batch, vocab_, std::span<const RowSampling>(&row, 1), {}, &token);
      return token;
    }
    logits_.resize((size_t)vocab_);
    backend_.forward(batch, logits_.data());
    return sampler_.sample(logits_.data(), vocab_);
  }

 private:
  Backend& backend_;
  Sampler& sampler_;
  int64_t vocab_;
  bool greedy_;
  std::vector<float> logits_;
};

// The prompt's next token: the prompt runs like prefill(), and only the last chunk asks for its row.
int32_t prefill_pick(Backend& backend, const std::vector<int32_t>& tokens, int seq, TokenPicker& picker) {
  const int n = (int)tokens.size();
  MERLIN_CHECK(n > 0, "nothing to evaluate: the prompt is empty");
  MERLIN_CHECK(n <= backend.n_ctx(), "prompt of ", n, " tokens does not fit in the context of ", backend.n_ctx(),
               " tokens");
  Batch batch;
  int32_t next = 0;
  for (int i0 = 0; i0 < n; i0 += backend.max_batch()) {
    const int i1 = std::min(n, i0 + backend.max_batch());
    batch.clear();
    for (int i = i0; i < i1; ++i) batch.add(tokens[i], i, seq, i == n - 1);
    if (i1 == n)
      next = picker.pick(batch);
    else
      backend.forward(batch, nullptr);
  }
  return next;
}

}  // namespace

GenerateStats generate(const Model& model, Backend& backend, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opts, const std::function<bool(int32_t)>& on_token) {
  GenerateStats st;
  st.n_prompt = (int)prompt.size();
  const int64_t vocab = model.config().vocab_size;
  const int32_t eos = model.tokenizer().eos_id();
  Sampler sampler(opts.sampling);
  for (int32_t t : prompt) sampler.accept(t);
  TokenPicker picker(backend, sampler, vocab);

  backend.clear_sequence(opts.seq);
  double t0 = now_seconds();
  int32_t tok = prefill_pick(backend, prompt, opts.seq, picker);
  std::vector<int32_t> seq_tokens = prompt;
  // A generated token: the sampler sees it, the sequence keeps it, the callback gets it; false: stop here.
  const auto take = [&](int32_t t) {
    sampler.accept(t);
    seq_tokens.push_back(t);
    if (opts.stop_at_eos && t == eos) {
      st.stop_reason = "eos";
      return false;
    }
    ++st.n_generated;
    if (!on_token(t)) {
      st.stop_reason = "callback";
      return false;
    }
    return true;
  };
  st.stop_reason = "length";
  if (opts.n_predict <= 0) return st;
  st.prompt_seconds = now_seconds() - t0;
  t0 = now_seconds();
  bool go = take(tok);
  // With the cache, each step feeds the previous token at the next position while the context has room, and
  // the backend may run several steps per round trip: plain greedy (decode_greedy), or draws a RowSampling
  // carries (decode_sample; 64 at a time, each taking the sampler's next uniform as a step-by-step run would).
  const int want = opts.n_predict - 1, room = backend.n_ctx() - (int)seq_tokens.size();
  const auto next = [&](int32_t t) { return go = take(t); };
  if (go && opts.use_kv_cache && picker.greedy()) {
    backend.decode_greedy(seq_tokens.back(), (int)seq_tokens.size() - 1, opts.seq, std::min(want, room), vocab, next);
    if (go && want > room) st.stop_reason = "context";
  } else if (go && opts.use_kv_cache && opts.sampling.repeat_penalty == 1.0f) {
    std::vector<RowSampling> rows;
    for (int left = std::min(want, room); go && left > 0; left -= (int)rows.size()) {
      rows.resize((size_t)std::min(left, 64));
      for (RowSampling& r : rows) sampler.row_sampling(r);  // always true without a repetition penalty
      backend.decode_sample(seq_tokens.back(), (int)seq_tokens.size() - 1, opts.seq, rows, vocab, next);
    }
    if (go && want > room) st.stop_reason = "context";
  } else {
    Batch batch;
    for (int i = 1; go && i < opts.n_predict; ++i) {
      if ((int)seq_tokens.size() >= backend.n_ctx()) {
        st.stop_reason = "context";
        break;
      }
      if (opts.use_kv_cache) {
        batch.clear();
        batch.add(seq_tokens.back(), (int)seq_tokens.size() - 1, opts.seq, true);
        tok = picker.pick(batch);
      } else {
        backend.clear_sequence(opts.seq);
        tok = prefill_pick(backend, seq_tokens, opts.seq, picker);
      }
      go = take(tok);
    }
  }
  if (st.n_generated > 0 || st.stop_reason != "length") st.gen_seconds = now_seconds() - t0;
  return st;
}

}  // namespace merlin
