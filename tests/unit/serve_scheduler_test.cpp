// serve::Scheduler driven one step at a time (no engine thread, so nothing depends on timing): chunked
// prefill, requests joining a running batch, cancellation, preemption under block pressure, block accounting.
#include <map>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/rng.h"
#include "core/sys.h"
#include "serve/scheduler.h"
#include "serve_test_util.h"

using namespace merlin;
using namespace merlin::serve;
using test::greedy;
using test::prompt_of;

namespace {

class ServeScheduler : public test::ServeFixture {
 protected:
  void make(int n_seq, int n_blocks, EngineOptions eo = {}) {
    eo.max_sequences = n_seq;
    backend_ = paged_backend(n_seq, n_blocks);
    sched_ = std::make_unique<Scheduler>(*model_, *backend_, eo);
  }
  std::shared_ptr<StreamState> submit(GenerationRequest r) {
    sched_->validate(r);
    auto s = std::make_shared<StreamState>(std::move(r), nullptr);
    sched_->enqueue(s);
    return s;
  }
  int run_until_idle(int max_steps = 100000) {
    int steps = 0;
    while (!sched_->idle() && steps < max_steps) {
      sched_->step();
      ++steps;
    }
    EXPECT_TRUE(sched_->idle()) << "scheduler did not finish";
    return steps;
  }
  // Rows of the last batch that belong to backend sequence slot `slot`.
  int rows_of(int slot) const {
    int n = 0;
    for (int32_t s : sched_->last_batch().seq) n += s == slot;
    return n;
  }
  void expect_all_blocks_back() const {
    EXPECT_EQ(sched_->cache().n_available(), sched_->cache().n_blocks());
    const EngineStats st = sched_->stats();
    EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
    EXPECT_EQ(st.running, 0);
    EXPECT_EQ(st.waiting, 0);
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Scheduler> sched_;
};

}  // namespace

TEST_F(ServeScheduler, ChunkedPrefillThenOneTokenPerStep) {
  EngineOptions eo;
  eo.prefill_chunk = 16;
  make(2, 32, eo);
  const auto prompt = prompt_of(100, 1);
  auto s = submit(greedy(prompt, 5));
  for (int step = 0; step < 6; ++step) {  // 6 chunks of 16 tokens, no token yet
    ASSERT_TRUE(sched_->step());
    EXPECT_EQ(sched_->last_batch().size(), 16u);
    EXPECT_EQ(sched_->last_batch().n_logits(), 0u);
  }
  EXPECT_TRUE(test::take(*s).tokens.empty());
  sched_->step();  // last 4 prompt tokens, with logits: the first token
  EXPECT_EQ(sched_->last_batch().size(), 4u);
  EXPECT_EQ(test::take(*s).tokens.size(), 1u);
  sched_->step();  // decode: one token
  EXPECT_EQ(sched_->last_batch().size(), 1u);
  run_until_idle();
  EXPECT_EQ(sched_->stats().steps, 11u);
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, NewRequestsJoinARunningBatch) {
  EngineOptions eo;
  eo.prefill_chunk = 8;
  make(4, 64, eo);
  const auto pa = prompt_of(10, 2), pb = prompt_of(30, 3);
  auto a = submit(greedy(pa, 20));
  for (int i = 0; i < 4; ++i) sched_->step();  // a: 2 prefill steps, then decoding
  ASSERT_EQ(test::take(*a).tokens.size(), 3u);
  auto b = submit(greedy(pb, 20));  // joins between steps
  sched_->step();
  // One forward call held a's decode token and b's first prefill chunk.
  EXPECT_EQ(sched_->last_batch().size(), 1u + 8u);
  EXPECT_EQ(sched_->stats().running, 2);
  run_until_idle();
  const auto out_a = test::take(*a), out_b = test::take(*b);
  EXPECT_EQ(out_b.finish, FinishReason::Length);
  EXPECT_EQ(out_b.tokens, reference(pb, 20));
  EXPECT_EQ(out_a.finish, FinishReason::Length);
  auto all_a = reference(pa, 20);
  EXPECT_EQ(out_a.tokens, std::vector<int32_t>(all_a.begin() + 3, all_a.end()));
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, BatchTokenBudgetIsRespected) {
  EngineOptions eo;
  eo.prefill_chunk = 64;
  eo.max_batch_tokens = 40;
  make(4, 64, eo);
  std::vector<std::shared_ptr<StreamState>> s;
  for (int i = 0; i < 3; ++i) s.push_back(submit(greedy(prompt_of(50, 10 + i), 4)));
  while (!sched_->idle()) {
    sched_->step();
    EXPECT_LE(sched_->last_batch().size(), 40u);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(test::take(*s[(size_t)i]).tokens, reference(prompt_of(50, 10 + i), 4));
}

TEST_F(ServeScheduler, CancelFreesBlocksBeforeTheNextStep) {
  make(2, 32);
  auto a = submit(greedy(prompt_of(40, 4), 100));
  auto b = submit(greedy(prompt_of(20, 5), 100));
  auto waiting = submit(greedy(prompt_of(20, 6), 100));  // no slot: stays queued
  sched_->step();
  sched_->step();
  EXPECT_EQ(sched_->n_running(), 2);
  EXPECT_EQ(sched_->n_waiting(), 1);
  const int held = sched_->cache().n_blocks() - sched_->cache().n_available();
  EXPECT_GE(held, 3 + 2);
  a->cancel();
  waiting->cancel();
  sched_->step();
  const auto out_a = test::take(*a);
  EXPECT_EQ(out_a.finish, FinishReason::Cancelled);
  EXPECT_EQ(test::take(*waiting).finish, FinishReason::Cancelled);
  // a's blocks went back before that step ran (b alone was in the batch).
  EXPECT_EQ(sched_->last_batch().size(), 1u);
  EXPECT_EQ(sched_->n_running(), 1);
  b->cancel();
  sched_->step();
  EXPECT_TRUE(sched_->idle());
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, PreemptionUnderBlockPressureCompletesEveryRequest) {
  // 12 blocks of 16 positions; 6 requests that each grow to 20 + 60 = 80 positions (5 blocks): they cannot all
  // hold their blocks at once, so younger ones are preempted and recomputed.
  EngineOptions eo;
  eo.prefix_cache = false;
  make(6, 12, eo);
  std::vector<std::shared_ptr<StreamState>> s;
  for (int i = 0; i < 6; ++i) s.push_back(submit(greedy(prompt_of(20, 20 + i), 60)));
  run_until_idle();
  EXPECT_GT(sched_->stats().preemptions, 0u);
  for (int i = 0; i < 6; ++i) {
    const auto out = test::take(*s[(size_t)i]);
    EXPECT_EQ(out.finish, FinishReason::Length) << i;
    EXPECT_EQ(out.tokens, reference(prompt_of(20, 20 + i), 60)) << "request " << i;
  }
  EXPECT_EQ(sched_->stats().requests_finished, 6u);
  expect_all_blocks_back();
}

// Requests scoring their prompts (prompt_logprobs) among others under block pressure, with a prefill chunk
// small enough that preemption can strike between chunks: each prompt token is scored exactly once, in
// order, and the generated tokens are still the reference's.
TEST_F(ServeScheduler, PromptScoringSurvivesPreemption) {
  EngineOptions eo;
  eo.prefill_chunk = 8;
  make(6, 12, eo);
  std::vector<std::shared_ptr<StreamState>> s;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r = greedy(prompt_of(20, 30 + i), 60);
    r.prompt_logprobs = i % 2 == 1;
    r.sampling.top_logprobs = 1;  // greedy still: top_logprobs only adds alternatives
    s.push_back(submit(r));
  }
  run_until_idle();
  EXPECT_GT(sched_->stats().preemptions, 0u);
  for (int i = 0; i < 6; ++i) {
    const auto out = test::take(*s[(size_t)i]);
    const auto prompt = prompt_of(20, 30 + i);
    std::vector<int32_t> scored, generated;
    for (const TokenEvent& ev : out.events)
      if (ev.token >= 0) (ev.prompt ? scored : generated).push_back(ev.token);
    EXPECT_EQ(generated, reference(prompt, 60)) << "request " << i;
    EXPECT_EQ(scored, i % 2 == 1 ? std::vector<int32_t>(prompt.begin() + 1, prompt.end()) : std::vector<int32_t>{})
        << "request " << i;
  }
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, PreemptionWithPrefixCacheAndSharedPrompts) {
  make(4, 14);
  std::vector<std::shared_ptr<StreamState>> s;
  const auto shared = prompt_of(40, 7);
  for (int i = 0; i < 4; ++i) {
    auto p = shared;
    p.push_back(100 + i);
    s.push_back(submit(greedy(p, 50)));
  }
  run_until_idle();
  for (int i = 0; i < 4; ++i) {
    auto p = shared;
    p.push_back(100 + i);
    EXPECT_EQ(test::take(*s[(size_t)i]).tokens, reference(p, 50)) << "request " << i;
  }
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, PrefixCacheHitSkipsCachedBlocks) {
  make(2, 32);
  const auto prompt = prompt_of(50, 8);
  auto cold = submit(greedy(prompt, 10));
  run_until_idle();
  EXPECT_EQ(cold->n_cached_prompt(), 0);
  auto warm = submit(greedy(prompt, 10));
  sched_->step();
  EXPECT_EQ(warm->n_cached_prompt(), 48);  // 3 full blocks; the last block is partial anyway
  EXPECT_EQ(sched_->last_batch().size(), 2u);  // only tokens 48 and 49 were computed
  run_until_idle();
  EXPECT_EQ(test::take(*warm).tokens, test::take(*cold).tokens);
  EXPECT_EQ(sched_->stats().cached_prompt_tokens, 48u);
  EXPECT_GT(sched_->stats().kv_blocks_cached, 0);
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, FullyCachedPromptStillRecomputesItsLastToken) {
  make(2, 32);
  const auto prompt = prompt_of(32, 9);  // exactly two blocks
  auto cold = submit(greedy(prompt, 6));
  run_until_idle();
  auto warm = submit(greedy(prompt, 6));
  sched_->step();
  EXPECT_EQ(warm->n_cached_prompt(), 16);  // block 2 holds the last token, whose logits are needed
  run_until_idle();
  EXPECT_EQ(test::take(*warm).tokens, test::take(*cold).tokens);
}

TEST_F(ServeScheduler, ZeroMaxTokensFinishesWithoutRunning) {
  make(1, 8);
  auto s = submit(greedy(prompt_of(5, 1), 0));
  sched_->step();
  const auto out = test::take(*s);
  EXPECT_EQ(out.finish, FinishReason::Length);
  EXPECT_TRUE(out.tokens.empty());
  EXPECT_TRUE(sched_->idle());
}

// echo with logprobs (GenerationRequest::prompt_logprobs): every prompt token after the first gets an event, in
// order and before the generated tokens, with token_logprob over a whole-prompt forward pass on a fresh
// backend; with chunked prefill, with the prompt's blocks in the prefix cache (not reused: their rows are
// needed), alongside an ordinary request, and with max_tokens 0 (scored, then finished).
TEST_F(ServeScheduler, PromptLogprobsScoreEveryPromptToken) {
  EngineOptions eo;
  eo.prefill_chunk = 16;
  make(2, 32, eo);
  const auto prompt = prompt_of(40, 3);
  BackendOptions bo;
  bo.n_threads = 1;
  auto fresh = make_cpu_backend(*model_, bo);
  const std::vector<float> logits = prefill(*model_, *fresh, prompt, 0, 0, true);
  const int64_t vocab = model_->config().vocab_size;
  auto cold = submit(greedy(prompt, 3));
  run_until_idle();
  const std::vector<int32_t> cold_tokens = test::take(*cold).tokens;  // and its blocks are cached now
  ASSERT_EQ(cold_tokens.size(), 3u);
  for (int max_tokens : {3, 0}) {
    SCOPED_TRACE(max_tokens);
    GenerationRequest r = greedy(prompt, max_tokens);
    r.prompt_logprobs = true;
    r.sampling.top_logprobs = 2;
    auto other = submit(greedy(prompt_of(20, 4), 4));
    auto s = submit(r);
    run_until_idle();
    const auto out = test::take(*s);
    EXPECT_EQ(s->n_cached_prompt(), 0);
    std::vector<const TokenEvent*> scored, generated;
    for (const TokenEvent& ev : out.events)
      if (ev.token >= 0) (ev.prompt ? scored : generated).push_back(&ev);
    ASSERT_EQ(scored.size(), prompt.size() - 1);
    for (size_t i = 0; i < scored.size(); ++i) {
      EXPECT_EQ(scored[i]->token, prompt[i + 1]);
      std::vector<std::pair<int32_t, float>> top;
      const float want = token_logprob(logits.data() + i * (size_t)vocab, vocab, prompt[i + 1], 2, &top);
      EXPECT_NEAR(scored[i]->logprob, want, 1e-5f) << "prompt token " << i + 1;
      ASSERT_EQ(scored[i]->top_logprobs.size(), 2u);
      EXPECT_EQ(scored[i]->top_logprobs[0].first, top[0].first);
    }
    EXPECT_EQ(generated.size(), (size_t)max_tokens);
    if (max_tokens > 0) {
      EXPECT_EQ(out.events.front().prompt, true);  // scored tokens come first
      std::vector<int32_t> gen;
      for (const TokenEvent* ev : generated) gen.push_back(ev->token);
      EXPECT_EQ(gen, cold_tokens);
    }
    EXPECT_EQ(out.finish, FinishReason::Length);
    EXPECT_EQ(test::take(*other).tokens.size(), 4u);
  }
  expect_all_blocks_back();
}

TEST_F(ServeScheduler, RejectsRequestsThatCanNeverRun) {
  make(1, 8);  // 8 blocks of 16 = 128 positions, context 256
  EXPECT_THROW(sched_->validate(greedy({}, 4)), Error);
  EXPECT_THROW(sched_->validate(greedy({1, 2, 100000}, 4)), Error);
  EXPECT_THROW(sched_->validate(greedy({1, 2, -1}, 4)), Error);
  EXPECT_THROW(sched_->validate(greedy(prompt_of(10, 1), -1)), Error);
  EXPECT_THROW(sched_->validate(greedy(prompt_of(250, 1), 7)), Error);   // beyond the context
  EXPECT_THROW(sched_->validate(greedy(prompt_of(100, 1), 40)), Error);  // beyond the cache
  auto r = greedy(prompt_of(10, 1), 4);
  r.sampling.top_logprobs = 21;
  EXPECT_THROW(sched_->validate(r), Error);
  r.sampling.top_logprobs = 5;
  r.sampling.temperature = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(sched_->validate(r), Error);
  EXPECT_NO_THROW(sched_->validate(greedy(prompt_of(100, 1), 28)));
}

TEST_F(ServeScheduler, BackendMustHaveEnoughSlots) {
  backend_ = paged_backend(2, 8);
  EngineOptions eo;
  eo.max_sequences = 4;
  EXPECT_THROW(Scheduler(*model_, *backend_, eo), Error);
}

// A seeded random mix of submissions, cancellations, shared prefixes and steps under heavy block pressure:
// never a leak, a crash or a hang, and every request that was not cancelled gives generate()'s text.
// A random workload (arrivals, cancellations, preemption, shared prompts), with and without decode loops for
// a lone sequence (EngineOptions::decode_loop; the CPU backend runs a loop's steps one by one).
class ServeSchedulerWorkload : public ServeScheduler, public ::testing::WithParamInterface<int> {};
INSTANTIATE_TEST_SUITE_P(DecodeLoop, ServeSchedulerWorkload, ::testing::Values(0, 4));

TEST_P(ServeSchedulerWorkload, RandomWorkloadKeepsOutputsAndBlocksRight) {
  EngineOptions eo;
  eo.prefill_chunk = 12;
  eo.max_batch_tokens = 40;
  eo.decode_loop = GetParam();
  make(5, 16, eo);
  Rng rng(2024);
  struct Req {
    std::vector<int32_t> prompt;
    int max_tokens;
    std::shared_ptr<StreamState> stream;
    test::StreamOutput out;
    bool cancelled = false;
  };
  std::vector<Req> reqs;
  const auto common = prompt_of(20, 99);
  for (int step = 0; step < 400 || !sched_->idle(); ++step) {
    ASSERT_LT(step, 20000) << "scheduler did not finish";
    if (step < 400 && rng.below(4) == 0) {
      Req r;
      r.prompt = rng.below(2) ? common : prompt_of(5 + (int)rng.below(30), (int)rng.below(1000));
      for (uint64_t i = rng.below(10); i > 0; --i) r.prompt.push_back((int32_t)(3 + rng.below(500)));
      r.max_tokens = 1 + (int)rng.below(60);
      r.stream = submit(greedy(r.prompt, r.max_tokens));
      reqs.push_back(std::move(r));
    }
    if (!reqs.empty() && rng.below(25) == 0) {
      Req& victim = reqs[rng.below(reqs.size())];
      victim.stream->cancel();
      victim.cancelled = true;
    }
    sched_->step();
    for (Req& r : reqs) r.out = test::take(*r.stream, std::move(r.out));
  }
  std::map<std::vector<int32_t>, std::vector<int32_t>> refs;  // greedy text of a prompt, 60 tokens
  int checked = 0;
  for (Req& r : reqs) {
    ASSERT_NE(r.out.finish, FinishReason::None);
    if (r.out.finish == FinishReason::Cancelled) {
      EXPECT_TRUE(r.cancelled);
      continue;
    }
    EXPECT_EQ(r.out.finish, FinishReason::Length);
    auto [it, fresh] = refs.try_emplace(r.prompt);
    if (fresh) it->second = reference(r.prompt, 60);
    EXPECT_EQ(r.out.tokens, std::vector<int32_t>(it->second.begin(), it->second.begin() + r.max_tokens));
    ++checked;
  }
  EXPECT_GT(checked, 20);
  EXPECT_GT(sched_->stats().preemptions, 0u);
  EXPECT_GT(sched_->stats().cached_prompt_tokens, 0u);
  expect_all_blocks_back();
}

// A lone decoding sequence runs up to decode_loop tokens per step: the same tokens as single steps (greedy, and
// sampled with a seed: one draw per token either way), max_tokens exact, every block back. A second request
// ends the loops while both run, and they resume when it is done.
TEST_F(ServeScheduler, DecodeLoopsGiveTheSameTokensInFewerSteps) {
  EngineOptions eo;
  eo.decode_loop = 8;
  make(2, 32, eo);
  const auto prompt = prompt_of(20, 3);
  auto s = submit(greedy(prompt, 30));
  run_until_idle();
  EXPECT_EQ(test::take(*s).tokens, reference(prompt, 30));
  EXPECT_EQ(sched_->stats().steps, 5u);  // the prompt (first token), then loops of 8, 8, 8 and 5
  expect_all_blocks_back();

  auto sampled = [&](int loop) {
    EngineOptions o;
    o.decode_loop = loop;
    make(2, 32, o);
    GenerationRequest r = greedy(prompt, 40);
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 20;
    r.sampling.seed = 7;
    auto st = submit(r);
    run_until_idle();
    expect_all_blocks_back();
    return test::take(*st).tokens;
  };
  const std::vector<int32_t> looped = sampled(8), stepped = sampled(0);
  EXPECT_EQ(looped.size(), 40u);
  EXPECT_EQ(looped, stepped);

  make(2, 32, eo);
  const auto other = prompt_of(9, 5);
  auto a = submit(greedy(prompt, 40));
  for (int i = 0; i < 3; ++i) sched_->step();  // the prompt, then two loops
  auto b = submit(greedy(other, 10));
  run_until_idle();
  EXPECT_EQ(test::take(*a).tokens, reference(prompt, 40));
  EXPECT_EQ(test::take(*b).tokens, reference(other, 10));
  expect_all_blocks_back();
}

// GenerationRequest::wake_every: a consumer that drains its stream only when woken (as a connection thread
// does) is woken for the first token, then once per wake_every tokens, and for the end; the tokens are the same.
TEST_F(ServeScheduler, WakeEveryGroupsAConsumersWakeups) {
  std::vector<int32_t> first;
  for (int every : {0, 8, 1 << 30}) {
    make(2, 32);
    GenerationRequest r = greedy(prompt_of(10, 3), 20);
    r.wake_every = every;
    auto s = submit(std::move(r));
    test::StreamOutput out;
    int seen = 0;
    while (!sched_->idle()) {
      sched_->step();
      if (s->wakeups() == seen) continue;
      seen = s->wakeups();
      out = test::take(*s, std::move(out));
    }
    EXPECT_EQ(out.finish, FinishReason::Length) << "wake_every " << every;
    EXPECT_EQ(out.tokens.size(), 20u) << "wake_every " << every;
    if (first.empty()) first = out.tokens;
    EXPECT_EQ(out.tokens, first) << "wake_every " << every;
    // 0 with one running sequence: every token. 8: tokens 1, 9 and 17, then the end (token 20). Never:
    // the first token and the end. (A step stalled past kMaxHoldSeconds on a loaded machine adds one.)
    const int want = every == 0 ? 20 : every == 8 ? 4 : 2;
    EXPECT_GE(s->wakeups(), want) << "wake_every " << every;
    EXPECT_LE(s->wakeups(), every == 0 ? want : want + 2) << "wake_every " << every;
  }
}

// EngineOptions::stream_interval_ms at the bound (kMaxHoldSeconds): a lone streaming request whose 20 tokens
// take less than that wakes its consumer for the first token and the end only; the tokens are unchanged.
TEST_F(ServeScheduler, StreamIntervalHoldsTokensOfALoneSequence) {
  std::vector<int32_t> first;
  for (double interval : {0.0, StreamState::kMaxHoldSeconds * 1000}) {
    EngineOptions eo;
    eo.stream_interval_ms = interval;
    make(2, 32, eo);
    auto s = submit(greedy(prompt_of(10, 3), 20));
    test::StreamOutput out;
    int seen = 0;
    const double t0 = now_seconds();
    while (!sched_->idle()) {
      sched_->step();
      if (s->wakeups() == seen) continue;
      seen = s->wakeups();
      out = test::take(*s, std::move(out));
    }
    const bool slow = now_seconds() - t0 >= StreamState::kMaxHoldSeconds;  // a loaded machine: the bound applies
    EXPECT_EQ(out.tokens.size(), 20u) << "interval " << interval;
    if (first.empty()) first = out.tokens;
    EXPECT_EQ(out.tokens, first) << "interval " << interval;
    if (interval == 0) {
      EXPECT_EQ(s->wakeups(), 20);
    } else if (!slow) {
      EXPECT_EQ(s->wakeups(), 2);
    }
  }
}

static TokenEvent token(int32_t id) {
  TokenEvent e;
  e.token = id;
  return e;
}

// With many sequences running the engine wakes a consumer once per group of tokens; whatever is queued is
// still there for next(), and the end of a request, a group's last token or a held token's age wakes it.
TEST(ServeStreamState, WakesTheConsumerPerGroupOfTokens) {
  StreamState s(greedy({1, 2, 3}, 8), nullptr);
  EXPECT_TRUE(s.push(token(10)));  // wake_at 1: every token
  EXPECT_FALSE(s.push(token(11), 3));
  EXPECT_TRUE(s.push(token(12), 3));  // three queued
  EXPECT_TRUE(s.push(token(13), 3));  // not taken yet: still three or more
  test::StreamOutput out = test::take(s);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{10, 11, 12, 13}));
  EXPECT_FALSE(s.push(token(14), 3));  // the queue was emptied: a new group
  out = test::take(s, std::move(out));  // taken without a wake-up
  EXPECT_FALSE(s.push(token(15), 3));
  std::this_thread::sleep_for(std::chrono::duration<double>(StreamState::kMaxHoldSeconds * 1.2));
  EXPECT_TRUE(s.push(token(16), 100));  // token 15 waited long enough
  EXPECT_FALSE(s.push(token(17), 100));
  TokenEvent last = token(18);
  last.finish = FinishReason::Length;
  EXPECT_TRUE(s.push(last, 100));
  out = test::take(s, std::move(out));
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{10, 11, 12, 13, 14, 15, 16, 17, 18}));
  EXPECT_EQ(out.finish, FinishReason::Length);
}

// min_hold (EngineOptions::stream_interval_ms): a token waits for the ones after it until the oldest held one
// has waited min_hold, even when each alone would wake the consumer; the end of the request and flush() (a
// preempted sequence) do not wait.
TEST(ServeStreamState, MinHoldGroupsTokensByAge) {
  StreamState s(greedy({1, 2, 3}, 8), nullptr);
  const double hold = StreamState::kMaxHoldSeconds / 2;
  EXPECT_FALSE(s.push(token(10), 1, hold));
  EXPECT_FALSE(s.push(token(11), 1, hold));
  std::this_thread::sleep_for(std::chrono::duration<double>(hold * 1.2));
  EXPECT_TRUE(s.push(token(12), 1, hold));  // token 10 has waited min_hold
  test::StreamOutput out = test::take(s);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{10, 11, 12}));
  EXPECT_FALSE(s.push(token(13), 1, hold));  // a new group
  std::this_thread::sleep_for(std::chrono::duration<double>(hold * 1.2));
  EXPECT_FALSE(s.push(token(14), 4, hold));  // old enough, but wake_at is not reached either
  const int woken = s.wakeups();
  s.flush();
  EXPECT_EQ(s.wakeups(), woken + 1);
  out = test::take(s, std::move(out));
  s.flush();  // nothing held: no wake-up
  EXPECT_EQ(s.wakeups(), woken + 1);
  EXPECT_FALSE(s.push(token(15), 1, hold));
  TokenEvent last = token(16);
  last.finish = FinishReason::Length;
  EXPECT_TRUE(s.push(last, 1, hold));
  out = test::take(s, std::move(out));
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{10, 11, 12, 13, 14, 15, 16}));
  EXPECT_EQ(out.finish, FinishReason::Length);
}

// A consumer asleep in next() is woken by a group's last token, not left to its timeout (an hour: past
// ctest's limit, so a missing wake-up fails the test instead of passing late).
TEST(ServeStreamState, GroupWakesASleepingConsumer) {
  StreamState s(greedy({1, 2, 3}, 8), nullptr);
  TokenEvent got;
  bool ok = false;
  std::thread consumer([&] { ok = s.next(got, std::chrono::hours(1)); });
  TokenEvent e;
  e.token = 7;
  s.push(e, 2);
  e.token = 8;
  s.push(e, 2);
  consumer.join();
  EXPECT_TRUE(ok);
  EXPECT_EQ(got.token, 7);
}
