#include "serve/http_generation.h"

#include <algorithm>

#include "core/error.h"
#include "core/sys.h"
#include "tokenizer/tokenizer.h"

namespace merlin::serve {

ChoiceRun::ChoiceRun(int index, std::shared_ptr<RequestStream> stream, const Tokenizer& tok, const PreparedPrompts& prepared,
                     int32_t last_prompt_token, bool logprobs, const std::vector<int32_t>* echo)
    : index_(index),
      stream_(std::move(stream)),
      tok_(tok),
      stop_tokens_(prepared.stop_tokens),
      eos_stops_(prepared.stop_at_eos),
      want_logprobs_(logprobs),
      text_(prepared.stop_strings),
      prev_(last_prompt_token) {
  output_.index = index;
  if (!echo) return;
  // The prompt's text in the same token-by-token decoding as generated text; generated tokens' offsets
  // follow it.
  echo_pending_ = true;
  echo_tokens_ = *echo;
  int32_t prev = -1;
  for (int32_t id : *echo) {
    const std::string bytes = tok_.decode_token(id, prev);
    if (want_logprobs_) prompt_logprobs_.push_back(TokenLogprob{bytes, 0.0f, {}, echo_text_.size(), true});
    echo_text_ += bytes;
    prev = id;
  }
  if (!prompt_logprobs_.empty()) prompt_logprobs_[0].has_logprob = false;
  raw_offset_ = echo_text_.size();
}

// The echoed prompt goes out first: its text at once, its log-probabilities once every token is scored.
void ChoiceRun::release_echo(ChoiceDelta& delta) {
  if (!echo_pending_) return;
  if (!echo_text_.empty()) {
    delta.text += echo_text_;
    output_.text += echo_text_;
    echo_text_.clear();
  }
  if (n_prompt_scored_ < prompt_logprobs_.size()) return;
  delta.logprobs.insert(delta.logprobs.end(), prompt_logprobs_.begin(), prompt_logprobs_.end());
  output_.logprobs.insert(output_.logprobs.end(), prompt_logprobs_.begin(), prompt_logprobs_.end());
  prompt_logprobs_.clear();
  echo_pending_ = false;
}

void ChoiceRun::on_prompt_token(const TokenEvent& ev, ChoiceDelta& delta) {
  if (n_prompt_scored_ < prompt_logprobs_.size()) {
    const int32_t prev = echo_tokens_[n_prompt_scored_ - 1];  // alternatives decode after the token before
    TokenLogprob& lp = prompt_logprobs_[n_prompt_scored_++];
    lp.logprob = ev.logprob;
    for (const auto& [id, p] : ev.top_logprobs) lp.top.emplace_back(tok_.decode_token(id, prev), p);
  }
  release_echo(delta);
}

bool ChoiceRun::poll(std::chrono::milliseconds wait, ChoiceDelta& delta) {
  if (done_) return false;
  TokenEvent ev;
  if (!stream_->next(ev, wait)) return false;
  release_echo(delta);
  if (ev.prompt) on_prompt_token(ev, delta);
  else if (ev.token >= 0) on_token(ev, delta);
  if (!done_ && ev.finish != FinishReason::None) on_finish(ev.finish, ev.error, delta);
  return true;
}

void ChoiceRun::cancel() {
  if (!done_) stream_->cancel();
  done_ = true;
}

bool ChoiceRun::is_stop_token(int32_t id) const {
  return (eos_stops_ && id == tok_.eos_id()) || std::find(stop_tokens_.begin(), stop_tokens_.end(), id) != stop_tokens_.end();
}

void ChoiceRun::on_token(const TokenEvent& ev, ChoiceDelta& delta) {
  ++n_generated_;
  if (is_stop_token(ev.token)) {
    // End of text or end of turn: not part of the answer. The engine may not know the chat template's
    // end-of-turn token, so stop it here.
    if (ev.finish == FinishReason::None) stream_->cancel();
    finish("stop", delta);
    return;
  }
  const std::string bytes = tok_.decode_token(ev.token, prev_);
  if (want_logprobs_) {
    TokenLogprob lp{bytes, ev.logprob, {}, raw_offset_};
    for (const auto& [id, p] : ev.top_logprobs) lp.top.emplace_back(tok_.decode_token(id, prev_), p);
    held_logprobs_.push_back(std::move(lp));
  }
  prev_ = ev.token;
  raw_offset_ += bytes.size();
  const std::string piece = text_.push(bytes);
  delta.text += piece;
  output_.text += piece;
  if (!piece.empty() || text_.stopped()) {
    delta.logprobs.insert(delta.logprobs.end(), held_logprobs_.begin(), held_logprobs_.end());
    output_.logprobs.insert(output_.logprobs.end(), held_logprobs_.begin(), held_logprobs_.end());
    held_logprobs_.clear();
  }
  if (text_.stopped()) {
    // The stop string ends the answer: the engine drops the sequence now rather than after max_tokens.
    if (ev.finish == FinishReason::None) stream_->cancel();
    finish("stop", delta);
  }
}

void ChoiceRun::on_finish(FinishReason reason, const std::string& error, ChoiceDelta& delta) {
  const std::string rest = text_.finish();
  delta.text += rest;
  output_.text += rest;
  delta.logprobs.insert(delta.logprobs.end(), held_logprobs_.begin(), held_logprobs_.end());
  output_.logprobs.insert(output_.logprobs.end(), held_logprobs_.begin(), held_logprobs_.end());
  held_logprobs_.clear();
  if (reason == FinishReason::Error) error_ = error.empty() ? "generation failed" : error;
  // Cancelled without our asking means the engine is shutting down; OpenAI has no such reason.
  finish(reason == FinishReason::Length ? "length" : "stop", delta);
}

void ChoiceRun::finish(const std::string& reason, ChoiceDelta& delta) {
  done_ = true;
  delta.finish_reason = reason;
  output_.finish_reason = reason;
}

// A streaming client gets every token when it is made. A non-streaming one needs the answer only at the end,
// unless a stop string or token must be spotted here (the engine sees only EOS): then every 8 tokens, so the
// engine runs at most 7 tokens past the stop before the cancel reaches it.
int Generation::wake_every(const CompletionParams& params, const PreparedPrompts& prepared) {
  if (params.stream) return 0;
  return prepared.stop_strings.empty() && prepared.stop_tokens.empty() ? kNoWake : 8;
}

Generation::Generation(Engine& engine, const Tokenizer& tok, const CompletionParams& params, PreparedPrompts prepared,
                       const std::string& request_id)
    : prepared_(std::move(prepared)), n_per_prompt_(params.n) {
  for (size_t p = 0; p < prepared_.prompts.size(); ++p) {
    for (int i = 0; i < params.n; ++i) {
      const int index = (int)p * params.n + i;
      GenerationRequest req;
      req.id = params.n * prepared_.prompts.size() > 1 ? cat(request_id, "/", index) : request_id;
      req.prompt = prepared_.prompts[p];
      req.max_tokens = prepared_.max_tokens;
      req.sampling = params.sampling;
      req.stop_at_eos = prepared_.stop_at_eos;
      req.prompt_logprobs = params.echo && params.logprobs();
      req.wake_every = wake_every(params, prepared_);
      // Same seed for every choice would give n identical answers; choice i uses seed + i.
      if (req.sampling.seed) req.sampling.seed = *req.sampling.seed + (uint64_t)index;
      std::shared_ptr<RequestStream> stream;
      try {
        stream = engine.submit(std::move(req));
      } catch (const QueueFull&) {
        cancel_all();
        throw ApiError(503, "The server is busy: the request queue is full. Retry shortly.", "", "queue_full", "server_error");
      } catch (const Error& e) {
        cancel_all();
        throw ApiError(400, e.what(), "", "invalid_value");
      }
      runs_.push_back(std::make_unique<ChoiceRun>(index, std::move(stream), tok, prepared_, prepared_.prompts[p].back(),
                                                  params.logprobs(), params.echo ? &prepared_.prompts[p] : nullptr));
    }
  }
}

Generation::~Generation() { cancel_all(); }

void Generation::cancel_all() {
  for (auto& run : runs_) run->cancel();
}

bool Generation::done() const {
  return std::all_of(runs_.begin(), runs_.end(), [](const auto& r) { return r->done(); });
}

// Folds every event the run has ready (waiting up to `wait` for the first) into one delta.
bool Generation::drain(ChoiceRun& run, std::chrono::milliseconds wait, std::vector<std::pair<int, ChoiceDelta>>& out) {
  ChoiceDelta delta;
  bool any = false;
  while (run.poll(any ? std::chrono::milliseconds(0) : wait, delta)) any = true;
  if (any && t_first_token_ == 0 && run.has_token()) t_first_token_ = now_seconds();
  if (!delta.empty()) out.emplace_back(run.index(), std::move(delta));
  return any;
}

bool Generation::pump(std::chrono::milliseconds wait, std::vector<std::pair<int, ChoiceDelta>>& out) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    bool any = false;
    for (auto& run : runs_)
      if (!run->done()) any = drain(*run, std::chrono::milliseconds(0), out) || any;
    if (any || done()) return done();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    // One choice: sleep on its stream. Several: wake often so that one quiet stream does not delay the rest.
    auto it = std::find_if(runs_.begin(), runs_.end(), [](const auto& r) { return !r->done(); });
    const auto nap = runs_.size() == 1 ? left : std::min(left, std::chrono::milliseconds(2));
    if (drain(**it, nap, out)) return done();
  }
}

Usage Generation::usage() const {
  Usage u;
  for (const auto& run : runs_) {
    u.completion_tokens += run->n_generated();
    // A prompt counts once however many choices share it; the first choice's cache hits are its own.
    if (run->index() % n_per_prompt_ == 0) {
      u.prompt_tokens += run->stream().n_prompt();
      u.cached_tokens += run->stream().n_cached_prompt();
    }
  }
  return u;
}

std::string Generation::error() const {
  for (const auto& run : runs_)
    if (!run->error().empty()) return run->error();
  return "";
}

}  // namespace merlin::serve
