// The engine's scheduler without its thread, so tests can drive it one step at a time. Each step():
//   1. drops cancelled requests (their blocks go back before anything else happens),
//   2. admits waiting requests (oldest first) while a sequence slot and enough K/V blocks are available,
//      reusing cached prefix blocks,
//   3. builds ONE batch: a decode token for every running sequence, then prompt chunks (at most
//      prefill_chunk per sequence, max_batch_tokens in all); a sequence that needs a new block when none
//      is left preempts the youngest running sequence (its blocks are freed, it is recomputed later),
//   4. runs Backend::forward once, samples a token for every sequence whose logits came back, and
//      finishes requests on EOS / max_tokens.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/backend.h"
#include "serve/engine.h"
#include "serve/prefix_cache.h"
#include "serve/sampling.h"

namespace merlin::serve {

// The last event of a request that carries no token.
inline TokenEvent final_event(FinishReason reason, std::string error = {}) {
  TokenEvent e;
  e.finish = reason;
  e.error = std::move(error);
  return e;
}

// The RequestStream the engine hands out. Engine side: push(); consumer side: next()/cancel().
class StreamState final : public RequestStream {
 public:
  // The longest push() holds a token back without waking the consumer (see push()).
  static constexpr double kMaxHoldSeconds = 0.1;

  StreamState(GenerationRequest request, std::function<void()> on_cancel);
  bool next(TokenEvent& event, std::chrono::milliseconds timeout) override;
  void cancel() override;
  int n_prompt() const override { return (int)request_.prompt.size(); }
  int n_cached_prompt() const override { return cached_.load(); }

  const GenerationRequest& request() const { return request_; }
  bool cancelled() const { return cancelled_.load(); }
  void set_cached_prompt(int n) { cached_.store(n); }
  // Queues an event. A consumer waiting in next() is woken once `wake_at` events are queued and the oldest
  // of them has waited `min_hold` seconds, once that one has waited kMaxHoldSeconds, or when the event ends
  // the request (next() returns whatever is queued, woken or not). Returns whether it woke the consumer.
  bool push(TokenEvent event, size_t wake_at = 1, double min_hold = 0);
  // Wakes the consumer if events are held (their sequence stops making tokens for a while: preempted).
  void flush();
  int wakeups() const { return wakeups_.load(); }  // push() calls that woke the consumer

 private:
  GenerationRequest request_;
  std::function<void()> on_cancel_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int> cached_{0};
  std::atomic<int> wakeups_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  double held_since_ = 0;  // when the oldest event queued without a wake-up arrived
};

class Scheduler {
 public:
  static constexpr double kRateWindowSeconds = 5.0;  // EngineStats::generated_tokens_per_second averages over it

  // The backend must have n_seq >= opts.max_sequences and a paged K/V cache.
  Scheduler(const Model& model, Backend& backend, const EngineOptions& opts);
  ~Scheduler();

  // Throws merlin::Error for a request that can never run.
  void validate(const GenerationRequest& request) const;
  // Queues a validated request behind the others (no bound here: Engine enforces max_queue).
  void enqueue(std::shared_ptr<StreamState> stream);
  // One iteration (see above). Returns false when there was nothing to run.
  bool step();
  // Ends every request with FinishReason::Cancelled and frees their blocks.
  void cancel_all();

  bool idle() const { return running_.empty() && waiting_.empty(); }
  int n_running() const { return (int)running_.size(); }
  int n_waiting() const { return (int)waiting_.size(); }
  EngineStats stats() const;
  const PrefixCache& cache() const { return cache_; }
  const Backend& backend() const { return backend_; }
  const Batch& last_batch() const { return batch_; }  // for tests: what the last step ran

 private:
  struct Sequence;
  using SeqPtr = std::unique_ptr<Sequence>;

  void drop_cancelled();
  void admit();
  bool try_admit(Sequence& s);
  bool build_batch();
  bool ensure_blocks(Sequence& s, int n_positions);
  void preempt(Sequence& s);
  void add_tokens(Sequence& s, int n);
  void run_batch();
  bool decode_loop();
  void note_rate();
  // logits: the row's logits, or null with `token` the backend's greedy pick (or -1: no row).
  void after_forward(Sequence& s, int n_fed, const float* logits, int32_t token = -1);
  void sample(Sequence& s, const float* logits);
  void score_prompt(Sequence& s, const float* rows, int n_rows);
  void emit(Sequence& s, TokenEvent ev);  // the sampled token: append, stream, finish
  size_t wake_at(const Sequence& s) const;  // push()'s wake_at for s's events
  double min_hold() const;                  // push()'s min_hold (EngineOptions::stream_interval_ms)
  bool greedy_step() const;
  bool backend_sample_step() const;
  void build_row_sampling();
  void register_full_blocks(Sequence& s);
  size_t events_per_wakeup() const;
  void finish(Sequence& s, TokenEvent last);
  void release_blocks(Sequence& s);
  void remove_finished();
  void fail_batch(const std::string& message);

  const Model& model_;
  Backend& backend_;
  EngineOptions opts_;
  int block_size_, n_ctx_;
  int64_t vocab_;
  int loop_steps_ = 0;  // EngineOptions::decode_loop, resolved
  std::vector<RowSampling> loop_rows_;
  int32_t eos_;
  PrefixCache cache_;
  std::deque<SeqPtr> waiting_;          // by arrival, preempted sequences back at their place
  std::vector<SeqPtr> running_;         // by arrival
  std::vector<uint8_t> slot_used_;
  uint64_t next_arrival_ = 0;
  uint64_t seed_counter_;
  Batch batch_;
  struct Row {
    Sequence* seq;
    int n_fed;
    bool logits;      // the last fed token's row samples the next token
    int n_score = 0;  // rows before it that score prompt tokens (prompt_logprobs)
  };
  std::vector<Row> rows_;
  std::vector<float> logits_;
  std::vector<int32_t> greedy_tokens_;  // the ids of forward_greedy / forward_sample
  std::vector<RowSampling> sample_rows_;  // forward_sample's rows and adjustments (backend_sample_step)
  std::vector<LogitAdjust> sample_adjust_;
  EngineStats stats_;
  std::deque<std::pair<double, uint64_t>> rate_window_;  // (time, generated tokens) per recent step
};

}  // namespace merlin::serve
