// The serving engine: iteration-level (continuous) batching over one Backend. A single engine thread owns
// the backend; each step it advances every running sequence by one token and feeds chunks of waiting
// prompts, in one forward() call. Requests arrive from any thread through submit(); their tokens come back
// through a RequestStream that the HTTP handler (or a test) drains. The K/V cache is paged: a block
// allocator hands out fixed-size blocks, a per-sequence block table maps them, and full blocks are kept in
// a prefix cache keyed by their tokens so a repeated prompt prefix is not computed again.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace merlin {
class Backend;
class Model;
}  // namespace merlin

namespace merlin::serve {

struct SamplingParams {
  float temperature = 1.0f;  // <= 0: greedy (argmax)
  float top_p = 1.0f;        // >= 1: off
  int top_k = 0;             // <= 0: off
  float min_p = 0.0f;        // <= 0: off
  float presence_penalty = 0.0f, frequency_penalty = 0.0f;  // OpenAI semantics, over generated tokens
  std::optional<uint64_t> seed;  // absent: a random seed per request
  int top_logprobs = -1;     // < 0: no logprobs; 0..20: the sampled token's log-probability plus this many alternatives
  // OpenAI's logit_bias: (token id, bias in [-100, 100]) added to the logits before the penalties and sampling
  // (-100 bans a token in practice, +100 forces it); log-probabilities stay those of the unmodified logits.
  std::vector<std::pair<int32_t, float>> logit_bias;
};

enum class FinishReason { None, Stop, Length, Cancelled, Error };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

struct TokenEvent {
  int32_t token = -1;  // -1 on a final event that carries no token
  float logprob = 0.0f;  // log-softmax of the unmodified logits (as OpenAI reports)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // most likely first
  FinishReason finish = FinishReason::None;  // set on the last event of the request
  bool prompt = false;  // a scored prompt token (GenerationRequest::prompt_logprobs), not a generated one
  std::string error;  // with FinishReason::Error
};

struct GenerationRequest {
  std::string id;                 // for logs
  std::vector<int32_t> prompt;    // at least one token
  int max_tokens = 16;            // new tokens; submit() rejects prompt + max_tokens > n_ctx
  SamplingParams sampling;
  bool stop_at_eos = true;        // the model's EOS token ends the request with FinishReason::Stop
  // Also score the prompt (OpenAI completions' echo with logprobs): one event with `prompt` set per prompt
  // token after the first, before any generated token, with its log-probability given the tokens before it
  // and sampling.top_logprobs alternatives. The prompt is then computed whole (no prefix-cache reuse), and
  // max_tokens may be 0.
  bool prompt_logprobs = false;
  // Tokens per wake-up of a consumer waiting in next(), at least (0: the engine's choice, every token while
  // few sequences run). A consumer that only needs the whole answer (a non-streaming request) asks for more:
  // each wake-up is a context switch on the cores that run the forward pass. The first token, the final
  // event and any token held for RequestStream's ~100 ms still wake it.
  int wake_every = 0;
};

// One request's output. The engine thread pushes, one consumer pops; cancel() may be called from any thread.
// While many sequences run, a waiting consumer is woken once per few tokens (at most ~100 ms apart), not
// for every token: next() then returns them one after another without waiting.
class RequestStream {
 public:
  virtual ~RequestStream() = default;
  // Waits up to `timeout` for the next event; false when none arrived in time.
  virtual bool next(TokenEvent& event, std::chrono::milliseconds timeout) = 0;
  // The consumer is gone (client disconnected, stop string seen): the engine drops the sequence and frees
  // its blocks before its next step; a final event with FinishReason::Cancelled follows.
  virtual void cancel() = 0;
  virtual int n_prompt() const = 0;
  virtual int n_cached_prompt() const = 0;  // prompt tokens served from the prefix cache (valid once the first token arrived)
};

struct EngineOptions {
  int max_sequences = 32;      // sequences in flight at once (backend sequence slots)
  int max_queue = 256;         // requests waiting for a slot or blocks; beyond it submit() throws QueueFull
  int prefill_chunk = 256;     // most prompt tokens of one sequence in one step
  int max_batch_tokens = 512;  // most tokens in one forward step (decode tokens first, then prefill chunks)
  bool prefix_cache = true;
  // A lone sequence decoding with nothing waiting runs up to this many tokens per backend call
  // (Backend::decode_greedy / decode_sample) instead of one step per scheduler iteration; a request arriving
  // meanwhile waits for the call to end. -1: 16 where the backend loops on the device (loops_decode), else 0
  // (off); MERLIN_SERVE_DECODE_LOOP=N overrides the automatic choice.
  int decode_loop = -1;
  // A streamed token may be held this long (at most StreamState::kMaxHoldSeconds) so that it goes out with
  // the tokens after it: fewer wake-ups of the connection threads (Scheduler::min_hold). 0: every token as
  // soon as it is made. The first token of a request is never held.
  double stream_interval_ms = 0;
};

struct EngineStats {
  uint64_t requests_finished = 0, prompt_tokens = 0, cached_prompt_tokens = 0, generated_tokens = 0;
  uint64_t steps = 0, preemptions = 0;
  int running = 0, waiting = 0;
  // free: not held by any sequence (what new requests can get), including `cached`: free but holding a
  // reusable prefix (evicted least recently used first when blocks run short).
  int kv_blocks_total = 0, kv_blocks_free = 0, kv_blocks_cached = 0;
  int kv_block_size = 0;
  double generated_tokens_per_second = 0;  // over the last few seconds of steps
};

struct QueueFull : std::exception {
  const char* what() const noexcept override { return "the request queue is full"; }
};

class Engine {
 public:
  // The backend must have been made with n_seq >= opts.max_sequences and a paged cache (n_kv_blocks > 0).
  Engine(const Model& model, std::unique_ptr<Backend> backend, const EngineOptions& opts);
  ~Engine();  // stops the engine thread; unfinished requests end with FinishReason::Cancelled
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Thread-safe. Throws merlin::Error for a request that can never run (empty prompt, too long for the
  // context, max_tokens < 0) and QueueFull when the waiting queue is full.
  std::shared_ptr<RequestStream> submit(GenerationRequest request);
  EngineStats stats() const;
  // Lets the engine thread run the backend's work ahead (Backend::idle_work: faulting in the CPU backend's K/V
  // cache) whenever no request runs. A server calls it once it listens, so the work never delays its start.
  void start_idle_work();
  int n_ctx() const;
  const Model& model() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace merlin::serve
