#include "serve/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>

#include "core/error.h"
#include "core/sys.h"
#include "runtime/model.h"

namespace merlin::serve {

// ---------------------------------------------------------------------------------------------------------
// StreamState

StreamState::StreamState(GenerationRequest request, std::function<void()> on_cancel)
    : request_(std::move(request)), on_cancel_(std::move(on_cancel)) {}

bool StreamState::next(TokenEvent& event, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  event = std::move(events_.front());
  events_.pop_front();
  return true;
}

void StreamState::cancel() {
  if (cancelled_.exchange(true)) return;
  if (on_cancel_) on_cancel_();  // wakes an idle engine so the blocks go back now
}

bool StreamState::push(TokenEvent event, size_t wake_at, double min_hold) {
  bool wake = event.finish != FinishReason::None || (wake_at <= 1 && min_hold <= 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.empty()) held_since_ = 0;  // the consumer took everything: nothing is held any more
    events_.push_back(std::move(event));
    if (!wake) {
      const double now = now_seconds();
      if (held_since_ == 0) held_since_ = now;
      const double held = now - held_since_;
      wake = (events_.size() >= wake_at && held >= min_hold) || held >= kMaxHoldSeconds;
    }
    if (wake) held_since_ = 0;
  }
  if (wake) {
    wakeups_.fetch_add(1, std::memory_order_relaxed);
    cv_.notify_all();
  }
  return wake;
}

void StreamState::flush() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.empty() || held_since_ == 0) return;
    held_since_ = 0;
  }
  wakeups_.fetch_add(1, std::memory_order_relaxed);
  cv_.notify_all();
}

// ---------------------------------------------------------------------------------------------------------
// Sequence: one request inside the scheduler.

struct Scheduler::Sequence {
  std::shared_ptr<StreamState> stream;
  uint64_t arrival = 0;
  int slot = -1;
  std::vector<int32_t> tokens;  // prompt, then every sampled token; K/V exist for tokens[0 .. n_computed)
  int n_prompt = 0;
  int n_computed = 0;
  int n_scored = 1;             // prompt_logprobs: prompt tokens [1, n_scored) have had their event
  int n_generated = 0;
  std::vector<int32_t> blocks;  // block table: logical block i -> physical block
  int n_registered = 0;         // leading full blocks already offered to the prefix cache
  uint64_t chain_hash = PrefixCache::kRootHash;
  RequestSampler sampler;
  bool admitted_once = false;
  bool in_batch = false;  // has a row in the batch being built
  bool done = false;      // finished or cancelled; removed from running_ at the end of the step

  Sequence(std::shared_ptr<StreamState> st, uint64_t arr, uint64_t seed)
      : stream(std::move(st)), arrival(arr), sampler(stream->request().sampling, seed) {
    tokens = stream->request().prompt;
    n_prompt = (int)tokens.size();
  }
  const GenerationRequest& request() const { return stream->request(); }
  int remaining() const { return (int)tokens.size() - n_computed; }
};

namespace {

int blocks_for(int positions, int block_size) { return (positions + block_size - 1) / block_size; }

}  // namespace

Scheduler::Scheduler(const Model& model, Backend& backend, const EngineOptions& opts)
    : model_(model), backend_(backend), opts_(opts), block_size_(backend.kv_block_size()),
      n_ctx_(backend.n_ctx()), vocab_(model.config().vocab_size), eos_(model.tokenizer().eos_id()),
      cache_(backend.n_kv_blocks(), backend.kv_block_size(), opts.prefix_cache) {
  MERLIN_CHECK(opts_.max_sequences >= 1, "max_sequences must be at least 1");
  MERLIN_CHECK(backend.n_seq() >= opts_.max_sequences, "the backend has ", backend.n_seq(),
               " sequence slots, the engine needs ", opts_.max_sequences);
  MERLIN_CHECK(opts_.prefill_chunk >= 1, "prefill_chunk must be at least 1");
  MERLIN_CHECK(opts_.max_batch_tokens >= 1, "max_batch_tokens must be at least 1");
  MERLIN_CHECK(opts_.max_queue >= 0, "max_queue must not be negative");
  opts_.max_batch_tokens = std::min(opts_.max_batch_tokens, backend.max_batch());
  slot_used_.assign((size_t)opts_.max_sequences, 0);
  logits_.resize((size_t)std::min(opts_.max_sequences, opts_.max_batch_tokens) * (size_t)vocab_);
  greedy_tokens_.resize((size_t)std::min(opts_.max_sequences, opts_.max_batch_tokens));
  seed_counter_ = std::random_device{}();
  seed_counter_ = (seed_counter_ << 32) ^ std::random_device{}();
  // Every slot starts unmapped: only blocks this scheduler hands out are ever written.
  for (int s = 0; s < opts_.max_sequences; ++s) backend_.set_block_table(s, {});
  stats_.kv_blocks_total = cache_.n_blocks();
  stats_.kv_block_size = block_size_;
  loop_steps_ = opts_.decode_loop >= 0 ? opts_.decode_loop
                                       : (int)env_int("MERLIN_SERVE_DECODE_LOOP", backend.loops_decode() ? 16 : 0);
}

Scheduler::~Scheduler() = default;

void Scheduler::validate(const GenerationRequest& r) const {
  MERLIN_CHECK(!r.prompt.empty(), "the prompt is empty");
  for (int32_t t : r.prompt)
    MERLIN_CHECK(t >= 0 && t < vocab_, "token id ", t, " is outside the vocabulary (0..", vocab_ - 1, ")");
  MERLIN_CHECK(r.max_tokens >= 0, "max_tokens must not be negative (got ", r.max_tokens, ")");
  MERLIN_CHECK((int64_t)r.prompt.size() + r.max_tokens <= n_ctx_, "prompt of ", r.prompt.size(), " tokens plus ",
               r.max_tokens, " new tokens does not fit in the context of ", n_ctx_, " tokens");
  MERLIN_CHECK(blocks_for((int)r.prompt.size() + r.max_tokens, block_size_) <= cache_.n_blocks(), "prompt of ",
               r.prompt.size(), " tokens plus ", r.max_tokens, " new tokens needs more K/V blocks than the cache has (",
               cache_.n_blocks(), " of ", block_size_, " positions)");
  const SamplingParams& p = r.sampling;
  MERLIN_CHECK(std::isfinite(p.temperature) && std::isfinite(p.top_p) && std::isfinite(p.min_p) &&
                   std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty),
               "sampling parameters must be finite numbers");
  MERLIN_CHECK(p.top_logprobs <= 20, "top_logprobs must be at most 20 (got ", p.top_logprobs, ")");
}

void Scheduler::enqueue(std::shared_ptr<StreamState> stream) {
  const std::optional<uint64_t> seed = stream->request().sampling.seed;
  const uint64_t s = seed ? *seed : (seed_counter_ += 0x9e3779b97f4a7c15ull);
  waiting_.push_back(std::make_unique<Sequence>(std::move(stream), next_arrival_++, s));
}

// ---------------------------------------------------------------------------------------------------------
// One step

bool Scheduler::step() {
  drop_cancelled();
  admit();
  remove_finished();
  if (running_.empty()) {
    stats_.running = 0;
    stats_.waiting = n_waiting();
    return false;
  }
  if (!decode_loop() && build_batch()) run_batch();
  remove_finished();
  ++stats_.steps;
  return true;
}

void Scheduler::drop_cancelled() {
  for (auto& s : running_)
    if (s->stream->cancelled()) finish(*s, final_event(FinishReason::Cancelled));
  remove_finished();
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->stream->cancelled()) {
      finish(**it, final_event(FinishReason::Cancelled));
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

void Scheduler::admit() {
  while (!waiting_.empty()) {
    Sequence& s = *waiting_.front();
    if (s.request().max_tokens == 0 && !s.request().prompt_logprobs) {  // nothing to generate or score
      finish(s, final_event(FinishReason::Length));
      waiting_.pop_front();
      continue;
    }
    if (try_admit(s)) {
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      std::sort(running_.begin(), running_.end(),
                [](const SeqPtr& a, const SeqPtr& b) { return a->arrival < b->arrival; });
      continue;
    }
    // Nothing runs and the oldest request still cannot start: it never will (validate() should have
    // caught it). End it rather than wait forever.
    if (!running_.empty()) break;  // first come, first served: a big request is not overtaken forever
    finish(s, final_event(FinishReason::Error, "not enough K/V cache blocks for this request"));
    waiting_.pop_front();
  }
}

// Takes a slot and blocks for every token the sequence has so far (cached prefix blocks first); false,
// with nothing held, when they are not available.
bool Scheduler::try_admit(Sequence& s) {
  const auto slot = std::find(slot_used_.begin(), slot_used_.end(), 0);
  if (slot == slot_used_.end()) return false;
  const int n = (int)s.tokens.size();
  // At least the last token is computed again: its logits give the next token. A prompt still to be scored
  // is computed whole: cached blocks would skip the rows that score it.
  const bool scoring = s.request().prompt_logprobs && s.n_scored < s.n_prompt;
  std::vector<int32_t> hit = cache_.match(s.tokens, scoring ? 0 : (n - 1) / block_size_);
  const int need = blocks_for(n, block_size_) - (int)hit.size();
  if (cache_.n_available() < need) {
    for (int32_t b : hit) cache_.release(b);
    return false;
  }
  s.blocks = std::move(hit);
  s.n_registered = (int)s.blocks.size();
  s.chain_hash = PrefixCache::kRootHash;
  const std::span<const int32_t> toks(s.tokens);
  for (int i = 0; i < s.n_registered; ++i)
    s.chain_hash = PrefixCache::block_hash(s.chain_hash, toks.subspan((size_t)i * block_size_, (size_t)block_size_));
  s.n_computed = s.n_registered * block_size_;
  while ((int)s.blocks.size() < blocks_for(n, block_size_)) s.blocks.push_back(*cache_.allocate());
  s.slot = (int)(slot - slot_used_.begin());
  *slot = 1;
  backend_.set_block_table(s.slot, s.blocks);
  if (!s.admitted_once) {
    s.admitted_once = true;
    const int cached = std::min(s.n_computed, s.n_prompt);
    s.stream->set_cached_prompt(cached);
    stats_.prompt_tokens += (uint64_t)s.n_prompt;
    stats_.cached_prompt_tokens += (uint64_t)cached;
  }
  return true;
}

bool Scheduler::build_batch() {
  batch_.clear();
  rows_.clear();
  int budget = opts_.max_batch_tokens;
  for (auto& s : running_) s->in_batch = false;
  // Decode tokens first, oldest sequence first: the oldest one always gets its block, preempting younger
  // ones. Indexing (not iterators): a preemption removes the youngest sequence, never one before i.
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence& s = *running_[i];
    if (s.done || s.remaining() != 1 || s.n_computed < s.n_prompt) continue;
    if (!ensure_blocks(s, s.n_computed + 1)) break;  // s itself was preempted: it was the youngest
    add_tokens(s, 1);
    --budget;
  }
  for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
    Sequence& s = *running_[i];
    if (s.done || s.in_batch || s.remaining() <= 0) continue;
    const int n = std::min({s.remaining(), opts_.prefill_chunk, budget});
    if (!ensure_blocks(s, s.n_computed + n)) break;
    add_tokens(s, n);
    budget -= n;
  }
  return batch_.size() > 0;
}

bool Scheduler::ensure_blocks(Sequence& s, int n_positions) {
  const int need = blocks_for(n_positions, block_size_);
  bool changed = false;
  while ((int)s.blocks.size() < need) {
    if (std::optional<int32_t> b = cache_.allocate()) {
      s.blocks.push_back(*b);
      changed = true;
      continue;
    }
    // Out of blocks: the youngest running sequence gives its blocks back and is recomputed later. Work is
    // batched oldest first, so that is s or one younger than s; sequences already in this step's batch
    // are never touched.
    Sequence* victim = nullptr;
    for (auto it = running_.rbegin(); it != running_.rend() && victim == nullptr; ++it)
      if (it->get() == &s || (!(*it)->done && !(*it)->in_batch)) victim = it->get();
    if (victim == nullptr) return false;  // cannot happen (s itself qualifies); never loop forever
    preempt(*victim);
    if (victim == &s) return false;
  }
  if (changed) backend_.set_block_table(s.slot, s.blocks);
  return true;
}

void Scheduler::preempt(Sequence& s) {
  release_blocks(s);
  s.stream->flush();  // what it made so far goes out now, not when it runs again
  s.n_computed = 0;
  ++stats_.preemptions;
  // Back to the waiting queue at its arrival place, ahead of younger requests. The object does not move
  // (only its owner changes), so pointers to it stay valid.
  const auto it = std::find_if(running_.begin(), running_.end(), [&](const SeqPtr& p) { return p.get() == &s; });
  SeqPtr owned = std::move(*it);
  running_.erase(it);
  const auto pos =
      std::find_if(waiting_.begin(), waiting_.end(), [&](const SeqPtr& w) { return w->arrival > s.arrival; });
  waiting_.insert(pos, std::move(owned));
}

void Scheduler::add_tokens(Sequence& s, int n) {
  // The last chunk's last row samples the next token (none when max_tokens is 0); with prompt_logprobs, the
  // row of position p also scores prompt token p + 1 (those not scored before a preemption).
  const bool last_chunk = n == s.remaining();
  const bool sample = last_chunk && s.request().max_tokens > 0;
  int n_score = 0;
  for (int i = 0; i < n; ++i) {
    const int p = s.n_computed + i;
    const bool score = s.request().prompt_logprobs && p + 1 < s.n_prompt && p + 1 >= s.n_scored;
    n_score += score;
    batch_.add(s.tokens[(size_t)p], p, s.slot, score || (sample && i == n - 1));
  }
  rows_.push_back(Row{&s, n, sample, n_score});
  s.in_batch = true;
}

// Every row that samples takes the plain argmax (temperature 0, no penalties or biases, no logprobs): then the backend
// picks the tokens itself (forward_greedy: the CPU backend screens its output head and spreads the argmaxes
// over its threads, a GPU copies back ids instead of logits). The same token as RequestSampler's
// greedy_token: the first index of the largest logit.
bool Scheduler::greedy_step() const {
  for (const Row& r : rows_) {
    if (r.n_score > 0) return false;  // scoring needs the logits rows
    if (!r.logits) continue;
    const SamplingParams& p = r.seq->request().sampling;
    if (p.temperature > 0 || p.presence_penalty != 0 || p.frequency_penalty != 0 || p.top_logprobs >= 0 ||
        !p.logit_bias.empty())
      return false;
  }
  return true;
}

// MERLIN_SERVE_BACKEND_SAMPLING=0 (read once): sample every such step here (A/B timing), decode loops included.
static bool backend_sampling_enabled() {
  static const bool enabled = !env_is("MERLIN_SERVE_BACKEND_SAMPLING", "0");
  return enabled;
}

// Otherwise, when no row asks for log-probabilities, the backend samples (forward_sample) with what each
// request's sampler decides (biases, penalties, filters, the draw's uniform): the same tokens as sampling the
// logits here, which only log-probabilities still need.
bool Scheduler::backend_sample_step() const {
  if (!backend_sampling_enabled()) return false;
  for (const Row& r : rows_) {
    if (r.n_score > 0) return false;
    if (!r.logits) continue;
    if (r.seq->request().sampling.top_logprobs >= 0) return false;
  }
  return true;
}

void Scheduler::build_row_sampling() {
  sample_rows_.clear();
  sample_adjust_.clear();
  for (const Row& r : rows_)
    if (r.logits) sample_rows_.push_back(r.seq->sampler.row_sampling(sample_adjust_));
}

void Scheduler::run_batch() {
  const bool greedy = greedy_step();
  const bool on_backend = !greedy && backend_sample_step();
  try {
    if (greedy) {
      backend_.forward_greedy(batch_, vocab_, greedy_tokens_.data());
    } else if (on_backend) {
      build_row_sampling();
      backend_.forward_sample(batch_, vocab_, sample_rows_, sample_adjust_, greedy_tokens_.data());
    } else {
      // Scoring rows (prompt_logprobs) give a sequence more than one row.
      logits_.resize(std::max(logits_.size(), batch_.n_logits() * (size_t)vocab_));
      backend_.forward(batch_, logits_.data());
    }
  } catch (const std::exception& e) {
    fail_batch(e.what());
    return;
  }
  const float* row = logits_.data();
  const int32_t* token = greedy_tokens_.data();
  for (const Row& r : rows_) {
    if (greedy || on_backend) {
      after_forward(*r.seq, r.n_fed, nullptr, r.logits ? *token++ : -1);
      continue;
    }
    if (r.n_score > 0) {
      score_prompt(*r.seq, row, r.n_score);
      row += (size_t)r.n_score * vocab_;
    }
    after_forward(*r.seq, r.n_fed, r.logits ? row : nullptr);
    if (r.logits) row += vocab_;
  }
  note_rate();
}

void Scheduler::note_rate() {
  const double now = now_seconds();
  rate_window_.emplace_back(now, stats_.generated_tokens);
  while (rate_window_.size() > 2 && rate_window_.front().first < now - kRateWindowSeconds) rate_window_.pop_front();
  const double dt = now - rate_window_.front().first;
  stats_.generated_tokens_per_second =
      dt > 0 ? (double)(stats_.generated_tokens - rate_window_.front().second) / dt : 0.0;
}

// One sequence running, decoding, and nothing waiting: up to loop_steps_ tokens in one backend call, which a
// backend that loops on the device runs without a host round trip (and a scheduler iteration) per token. The
// same tokens as single steps: greedy, or the sampler's draws one per step, as generate() hands them over
// (requests whose draws need the logits on the host, for penalties, biases or log-probabilities, take single
// steps). The blocks for every position are taken first; steps run past a finish (EOS, max_tokens, a
// cancellation seen at the next iteration) write K/V rows no one reads, in blocks released with the rest.
bool Scheduler::decode_loop() {
  if (loop_steps_ < 2 || running_.size() != 1 || !waiting_.empty()) return false;
  Sequence& s = *running_.front();
  const GenerationRequest& req = s.request();
  const SamplingParams& sp = req.sampling;
  if (s.done || s.remaining() != 1 || s.n_computed < s.n_prompt || sp.presence_penalty != 0 ||
      sp.frequency_penalty != 0 || sp.top_logprobs >= 0 || !sp.logit_bias.empty() ||
      (sp.temperature > 0 && !backend_sampling_enabled()))
    return false;
  const int pos = s.n_computed;
  const int n = std::min({loop_steps_, req.max_tokens - s.n_generated, n_ctx_ - pos});
  const int more = blocks_for(pos + n, block_size_) - (int)s.blocks.size();
  if (n < 2 || cache_.n_available() < more || !ensure_blocks(s, pos + n)) return false;
  const auto on_token = [&](int32_t t) {
    after_forward(s, 1, nullptr, t);
    return !s.done && !s.stream->cancelled();
  };
  try {
    if (sp.temperature <= 0) {
      backend_.decode_greedy(s.tokens[(size_t)pos], pos, s.slot, n, vocab_, on_token);
    } else {
      loop_rows_.resize((size_t)n);
      for (RowSampling& r : loop_rows_) {
        sample_adjust_.clear();
        r = s.sampler.row_sampling(sample_adjust_);  // no biases or penalties: nothing to adjust
      }
      backend_.decode_sample(s.tokens[(size_t)pos], pos, s.slot, loop_rows_, vocab_, on_token);
    }
  } catch (const std::exception& e) {
    finish(s, final_event(FinishReason::Error, e.what()));
  }
  note_rate();
  return true;
}

void Scheduler::after_forward(Sequence& s, int n_fed, const float* logits, int32_t token) {
  s.n_computed += n_fed;
  register_full_blocks(s);
  if (s.request().max_tokens == 0) {  // only scoring the prompt: done once it is computed
    if (s.n_computed >= s.n_prompt) finish(s, final_event(FinishReason::Length));
    return;
  }
  if (logits) {
    sample(s, logits);
  } else if (token >= 0) {
    TokenEvent ev;
    ev.token = token;
    emit(s, std::move(ev));
  }
}

void Scheduler::register_full_blocks(Sequence& s) {
  const std::span<const int32_t> toks(s.tokens);
  while ((s.n_registered + 1) * block_size_ <= s.n_computed) {
    const auto blk = toks.subspan((size_t)s.n_registered * block_size_, (size_t)block_size_);
    s.chain_hash = PrefixCache::block_hash(s.chain_hash, blk);
    cache_.insert(s.chain_hash, blk, s.blocks[(size_t)s.n_registered]);
    ++s.n_registered;
  }
}

// How many tokens a stream collects before its consumer is woken. Each wake-up costs a connection thread
// a context switch, a JSON chunk and a socket write, and its client a read, all on the cores the forward
// pass runs on: with a wake-up per token, 32 streams took ~1.5 ms after each ~13 ms step on two cores and
// slowed the forward itself, 10-15 % of the aggregate rate. So with many sequences running, tokens go out
// in groups (the first token always at once, a group never held longer than kMaxHoldSeconds); with a
// few, every token goes out when it is made.
size_t Scheduler::events_per_wakeup() const {
  return std::max<size_t>(1, running_.size() / 4);  // 32 running: a wake-up every 8 tokens (or 100 ms)
}

// A request may ask for fewer wake-ups (GenerationRequest::wake_every): a non-streaming one needs its tokens
// only at the end. At one client on two cores that took `base` Q4_0 from ~510 to ~710 tok/s (merlin bench
// ~830): the connection thread's wake-up per token preempted one of the two forward-pass threads.
size_t Scheduler::wake_at(const Sequence& s) const {
  return std::max<size_t>(events_per_wakeup(), (size_t)std::max(s.request().wake_every, 0));
}

// EngineOptions::stream_interval_ms: a token waits for the ones after it for up to that long, so that the
// connection thread is woken once per group rather than once per token. Its wake-up costs a context switch
// on the cores the forward pass runs on: one streaming client on two cores decoded `base` Q4_0 ~17 % slower
// than a non-streaming one (docs/BENCHMARKS.md). With many sequences the groups of events_per_wakeup()
// are already longer than that.
double Scheduler::min_hold() const {
  return opts_.stream_interval_ms / 1000.0;
}

void Scheduler::sample(Sequence& s, const float* logits) {
  const GenerationRequest& req = s.request();
  TokenEvent ev;
  ev.token = s.sampler.sample(logits, vocab_);
  if (req.sampling.top_logprobs >= 0)
    ev.logprob = token_logprob(logits, vocab_, ev.token, req.sampling.top_logprobs, &ev.top_logprobs);
  emit(s, std::move(ev));
}

// Rows of positions n_scored - 1, n_scored, ...: prompt token p + 1's log-probability given tokens 0..p.
void Scheduler::score_prompt(Sequence& s, const float* rows, int n_rows) {
  const int top_n = std::max(s.request().sampling.top_logprobs, 0);
  for (int i = 0; i < n_rows; ++i) {
    TokenEvent ev;
    ev.prompt = true;
    ev.token = s.tokens[(size_t)s.n_scored];
    ev.logprob = token_logprob(rows + (size_t)i * vocab_, vocab_, ev.token, top_n, &ev.top_logprobs);
    s.stream->push(std::move(ev), wake_at(s), min_hold());
    ++s.n_scored;
  }
}

void Scheduler::emit(Sequence& s, TokenEvent ev) {
  const GenerationRequest& req = s.request();
  if (req.stop_at_eos && ev.token == eos_) {
    finish(s, final_event(FinishReason::Stop));  // EOS ends the text; it is not part of it
    return;
  }
  s.tokens.push_back(ev.token);
  s.sampler.accept(ev.token);
  ++s.n_generated;
  ++stats_.generated_tokens;
  if (s.n_generated >= req.max_tokens) {
    ev.finish = FinishReason::Length;
    finish(s, std::move(ev));
  } else {
    if (s.n_generated == 1) s.stream->push(std::move(ev));  // the first token at once (time to first token)
    else s.stream->push(std::move(ev), wake_at(s), min_hold());
  }
}

void Scheduler::finish(Sequence& s, TokenEvent last) {
  if (s.done) return;
  release_blocks(s);
  s.done = true;
  if (last.finish != FinishReason::Cancelled && last.finish != FinishReason::Error) ++stats_.requests_finished;
  s.stream->push(std::move(last));
}

void Scheduler::release_blocks(Sequence& s) {
  for (int32_t b : s.blocks) cache_.release(b);
  s.blocks.clear();
  s.n_registered = 0;
  s.chain_hash = PrefixCache::kRootHash;
  if (s.slot >= 0) {
    backend_.clear_sequence(s.slot);
    slot_used_[(size_t)s.slot] = 0;
    s.slot = -1;
  }
}

void Scheduler::remove_finished() {
  running_.erase(std::remove_if(running_.begin(), running_.end(), [](const SeqPtr& s) { return s->done; }),
                 running_.end());
  stats_.running = n_running();
  stats_.waiting = n_waiting();
  stats_.kv_blocks_free = cache_.n_available();
  stats_.kv_blocks_cached = cache_.n_idle_cached();
}

void Scheduler::fail_batch(const std::string& message) {
  for (const Row& r : rows_) finish(*r.seq, final_event(FinishReason::Error, message));
}

void Scheduler::cancel_all() {
  for (auto& s : running_) finish(*s, final_event(FinishReason::Cancelled));
  for (auto& s : waiting_) finish(*s, final_event(FinishReason::Cancelled));
  waiting_.clear();
  remove_finished();
}

EngineStats Scheduler::stats() const { return stats_; }

}  // namespace merlin::serve
