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

// The prompt's next token under greedy sampling: the prompt runs like prefill(), and only the last chunk asks
// for its row, through forward_greedy, so logits never leave the backend.
int32_t prefill_greedy(const Model& model, Backend& backend, const std::vector<int32_t>& tokens, int seq) {
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
      backend.forward_greedy(batch, model.config().vocab_size, &next);
    else
      backend.forward(batch, nullptr);
  }
  return next;
}

// Sampler::sample() reduces to argmax() for these options (sampler.cpp), so the backend may pick the token.
bool is_plain_greedy(const SamplerOptions& o) { return o.temperature <= 0.0f && o.repeat_penalty == 1.0f; }

}  // namespace

GenerateStats generate(const Model& model, Backend& backend, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opts, const std::function<bool(int32_t)>& on_token) {
  GenerateStats st;
  st.n_prompt = (int)prompt.size();
  const int64_t vocab = model.config().vocab_size;
  const int32_t eos = model.tokenizer().eos_id();
  Sampler sampler(opts.sampling);
  for (int32_t t : prompt) sampler.accept(t);

  const bool greedy = is_plain_greedy(opts.sampling);
  backend.clear_sequence(opts.seq);
  double t0 = now_seconds();
  std::vector<float> logits;
  int32_t greedy_tok = 0;
  if (greedy)
    greedy_tok = prefill_greedy(model, backend, prompt, opts.seq);
  else
    logits = prefill(model, backend, prompt, opts.seq, 0, false);
  std::vector<int32_t> seq_tokens = prompt;
  Batch batch;
  st.stop_reason = "length";
  for (int i = 0; i < opts.n_predict; ++i) {
    if (i > 0) {
      if ((int)seq_tokens.size() >= backend.n_ctx()) {
        st.stop_reason = "context";
        break;
      }
      if (opts.use_kv_cache) {
        batch.clear();
        batch.add(seq_tokens.back(), (int)seq_tokens.size() - 1, opts.seq, true);
        if (greedy)
          backend.forward_greedy(batch, vocab, &greedy_tok);
        else
          backend.forward(batch, logits.data());
      } else {
        backend.clear_sequence(opts.seq);
        if (greedy)
          greedy_tok = prefill_greedy(model, backend, seq_tokens, opts.seq);
        else
          logits = prefill(model, backend, seq_tokens, opts.seq, 0, false);
      }
    }
    const int32_t tok = greedy ? greedy_tok : sampler.sample(logits.data(), vocab);
    if (i == 0) {
      st.prompt_seconds = now_seconds() - t0;
      t0 = now_seconds();
    }
    sampler.accept(tok);
    seq_tokens.push_back(tok);
    if (opts.stop_at_eos && tok == eos) {
      st.stop_reason = "eos";
      break;
    }
    ++st.n_generated;
    if (!on_token(tok)) {
      st.stop_reason = "callback";
      break;
    }
  }
  if (st.n_generated > 0 || st.stop_reason != "length") st.gen_seconds = now_seconds() - t0;
  return st;
}

}  // namespace merlin
