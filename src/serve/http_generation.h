// One completions / chat completions request in flight: its choices submitted to the engine, their token
// events turned into text (UTF-8-safe, stop strings cut out) and log-probabilities, and its usage. The HTTP
// handlers drain it either into one response body or into SSE chunks as tokens arrive.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "serve/engine.h"
#include "serve/openai_request.h"
#include "serve/openai_response.h"
#include "serve/text_assembler.h"

namespace merlin {
class Tokenizer;
}

namespace merlin::serve {

// What one choice produced since the last time it was asked.
struct ChoiceDelta {
  std::string text;
  std::vector<TokenLogprob> logprobs;
  std::optional<std::string> finish_reason;  // set once, when the choice is over
  bool empty() const { return text.empty() && logprobs.empty() && !finish_reason; }
};

class ChoiceRun {
 public:
  // echo (completions' echo, null otherwise): the prompt's tokens, whose text comes first in the output and,
  // with logprobs, whose log-probabilities the engine sends as prompt events (GenerationRequest::prompt_logprobs).
  ChoiceRun(int index, std::shared_ptr<RequestStream> stream, const Tokenizer& tok, const PreparedPrompts& prepared,
            int32_t last_prompt_token, bool logprobs, const std::vector<int32_t>* echo = nullptr);

  // Waits up to `wait` for the next token event and folds it into `delta`; false when none came.
  bool poll(std::chrono::milliseconds wait, ChoiceDelta& delta);
  void cancel();

  int index() const { return index_; }
  bool done() const { return done_; }
  int n_generated() const { return n_generated_; }
  bool has_token() const { return n_generated_ > 0; }
  const RequestStream& stream() const { return *stream_; }
  const std::string& error() const { return error_; }
  // The whole output so far (for non-streaming responses).
  const ChoiceOutput& output() const { return output_; }

 private:
  void on_token(const TokenEvent& ev, ChoiceDelta& delta);
  void on_prompt_token(const TokenEvent& ev, ChoiceDelta& delta);
  void release_echo(ChoiceDelta& delta);
  void on_finish(FinishReason reason, const std::string& error, ChoiceDelta& delta);
  void finish(const std::string& reason, ChoiceDelta& delta);
  bool is_stop_token(int32_t id) const;

  int index_;
  std::shared_ptr<RequestStream> stream_;
  const Tokenizer& tok_;
  std::vector<int32_t> stop_tokens_;
  bool eos_stops_;
  bool want_logprobs_;
  TextAssembler text_;
  int32_t prev_;  // the token before the next one, for decoding in context
  size_t raw_offset_ = 0;  // bytes of token text decoded so far
  std::vector<TokenLogprob> held_logprobs_;  // of tokens whose text is still held back
  // Echo: the prompt's text, not yet in the output, and its tokens' log-probability entries (the first has
  // none), released once the engine has scored the last of them.
  std::vector<int32_t> echo_tokens_;
  std::string echo_text_;
  bool echo_pending_ = false;
  std::vector<TokenLogprob> prompt_logprobs_;
  size_t n_prompt_scored_ = 1;
  int n_generated_ = 0;
  bool done_ = false;
  std::string error_;
  ChoiceOutput output_;
};

class Generation {
 public:
  // Submits prompts × n choices. If the engine refuses one (queue full, bad request) the ones already
  // submitted are cancelled and the error is rethrown as an ApiError (503 with Retry-After, or 400).
  Generation(Engine& engine, const Tokenizer& tok, const CompletionParams& params, PreparedPrompts prepared,
             const std::string& request_id);
  ~Generation();  // cancels whatever is unfinished (a client that went away)
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Gathers token events for up to `wait` (returning early once something arrived); appends one delta per
  // choice that produced something. True when every choice is over.
  bool pump(std::chrono::milliseconds wait, std::vector<std::pair<int, ChoiceDelta>>& out);
  bool done() const;
  void cancel_all();

  const std::vector<std::unique_ptr<ChoiceRun>>& choices() const { return runs_; }
  Usage usage() const;
  // Seconds (steady clock, as now_seconds()) when the first token of any choice arrived; 0 if none did.
  double first_token_time() const { return t_first_token_; }
  std::string error() const;  // the first choice error, if any

  // GenerationRequest::wake_every for a request with these parameters.
  static int wake_every(const CompletionParams& params, const PreparedPrompts& prepared);
  static constexpr int kNoWake = 1 << 30;  // only the first token, the end and RequestStream's time bound

 private:
  bool drain(ChoiceRun& run, std::chrono::milliseconds wait, std::vector<std::pair<int, ChoiceDelta>>& out);

  PreparedPrompts prepared_;
  int n_per_prompt_;
  std::vector<std::unique_ptr<ChoiceRun>> runs_;
  double t_first_token_ = 0;
};

}  // namespace merlin::serve
