// serve::Engine end to end (its own thread, submit() from the test thread): outputs equal generate()'s,
// batch invariance among 31 concurrent requests, prefix-cache hits, per-request seeds, EOS, logprobs,
// penalties, the queue bound, cancellation and shutdown. Assertions never depend on timing.
#include <cmath>
#include <set>
#include <thread>

#include "core/error.h"
#include "serve/engine.h"
#include "serve_test_util.h"

using namespace merlin;
using namespace merlin::serve;
using test::collect;
using test::greedy;
using test::prompt_of;

namespace {

class ServeEngine : public test::ServeFixture {
 protected:
  std::unique_ptr<Engine> engine(int max_sequences, int n_blocks, EngineOptions eo = {}) {
    eo.max_sequences = max_sequences;
    return std::make_unique<Engine>(*model_, paged_backend(max_sequences, n_blocks), eo);
  }
};

void expect_blocks_back(const Engine& e) {
  // The engine publishes stats after each step; the final event of the last request comes before that.
  for (int i = 0; i < 1000 && (e.stats().running > 0 || e.stats().kv_blocks_free != e.stats().kv_blocks_total); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const EngineStats st = e.stats();
  EXPECT_EQ(st.running, 0);
  EXPECT_EQ(st.waiting, 0);
  EXPECT_EQ(st.kv_blocks_free, st.kv_blocks_total);
}

}  // namespace

TEST_F(ServeEngine, GreedyMatchesGenerate) {
  auto e = engine(4, 64);
  const auto prompt = prompt_of(20, 1);
  auto s = e->submit(greedy(prompt, 24));
  const auto out = collect(*s);
  EXPECT_EQ(out.finish, FinishReason::Length);
  const auto ref = reference(prompt, 24);
  EXPECT_EQ(out.tokens, ref);
  EXPECT_GE(std::set<int32_t>(ref.begin(), ref.end()).size(), 5u) << "degenerate test model";
  EXPECT_EQ(s->n_prompt(), 20);
  expect_blocks_back(*e);
  const EngineStats st = e->stats();
  EXPECT_EQ(st.requests_finished, 1u);
  EXPECT_EQ(st.generated_tokens, 24u);
  EXPECT_EQ(st.prompt_tokens, 20u);
  EXPECT_EQ(st.kv_block_size, 16);
  EXPECT_EQ(e->n_ctx(), 256);
}

// Issue 5's batch invariance: a greedy request's output is identical alone and among 31 others (which
// start at different times, have different lengths and share the batch in every combination).
TEST_F(ServeEngine, GreedyOutputIsTheSameAloneAndAmong31Others) {
  const auto probe = prompt_of(37, 77);
  std::vector<int32_t> alone;
  {
    auto e = engine(32, 512);
    alone = collect(*e->submit(greedy(probe, 40))).tokens;
  }
  EngineOptions eo;
  eo.prefill_chunk = 24;  // chunked prefill interleaved with the others' decode steps
  auto e = engine(32, 512, eo);
  std::vector<std::shared_ptr<RequestStream>> others;
  for (int i = 0; i < 16; ++i) others.push_back(e->submit(greedy(prompt_of(5 + 7 * i, i), 20 + 3 * i)));
  auto s = e->submit(greedy(probe, 40));
  for (int i = 16; i < 31; ++i) others.push_back(e->submit(greedy(prompt_of(5 + 5 * i, i), 10 + 2 * i)));
  EXPECT_EQ(collect(*s).tokens, alone);
  for (auto& o : others) EXPECT_EQ(collect(*o).finish, FinishReason::Length);
  EXPECT_EQ(alone, reference(probe, 40));
  expect_blocks_back(*e);
}

TEST_F(ServeEngine, PrefixCacheHitGivesTheColdOutput) {
  auto e = engine(4, 64);
  const auto prompt = prompt_of(70, 3);
  auto cold = e->submit(greedy(prompt, 12));
  const auto cold_out = collect(*cold);
  EXPECT_EQ(cold->n_cached_prompt(), 0);
  auto warm = e->submit(greedy(prompt, 12));
  const auto warm_out = collect(*warm);
  EXPECT_EQ(warm->n_cached_prompt(), 64);
  EXPECT_EQ(warm_out.tokens, cold_out.tokens);
  // A prompt sharing only the first 40 tokens reuses two blocks.
  auto p2 = prompt;
  p2[40] = 1;
  auto partial = e->submit(greedy(p2, 12));
  const auto partial_out = collect(*partial);
  EXPECT_EQ(partial->n_cached_prompt(), 32);
  EXPECT_EQ(partial_out.tokens, reference(p2, 12));
  expect_blocks_back(*e);
  EXPECT_EQ(e->stats().cached_prompt_tokens, 96u);
  EXPECT_GT(e->stats().kv_blocks_cached, 0);
}

TEST_F(ServeEngine, SeededSamplingIsReproducibleWhateverElseRuns) {
  auto request = [](uint64_t seed) {
    GenerationRequest r;
    r.prompt = prompt_of(12, 4);
    r.max_tokens = 30;
    r.stop_at_eos = false;
    r.sampling.temperature = 1.0f;
    r.sampling.top_p = 0.9f;
    r.sampling.top_k = 50;
    r.sampling.seed = seed;
    return r;
  };
  std::vector<int32_t> alone;
  {
    auto e = engine(8, 128);
    alone = collect(*e->submit(request(42))).tokens;
  }
  auto e = engine(8, 128);
  std::vector<std::shared_ptr<RequestStream>> noise;
  for (int i = 0; i < 5; ++i) noise.push_back(e->submit(request(100 + i)));
  auto s = e->submit(request(42));
  auto other = e->submit(request(43));
  EXPECT_EQ(collect(*s).tokens, alone);
  EXPECT_NE(collect(*other).tokens, alone);
  for (auto& n : noise) collect(*n);
}

TEST_F(ServeEngine, EosEndsWithStopAndIsNotReturned) {
  auto e = engine(4, 64);
  const int32_t eos = model_->tokenizer().eos_id();
  // Near-uniform sampling over 512 tokens meets EOS within 200 tokens for most seeds; the outputs of a
  // seed are fixed, so finding one is deterministic.
  bool found = false;
  for (uint64_t seed = 0; seed < 20 && !found; ++seed) {
    GenerationRequest r;
    r.prompt = prompt_of(8, 5);
    r.max_tokens = 200;
    r.sampling.temperature = 50.0f;
    r.sampling.seed = seed;
    r.stop_at_eos = false;
    const auto free_run = collect(*e->submit(r)).tokens;
    const auto it = std::find(free_run.begin(), free_run.end(), eos);
    if (it == free_run.end()) continue;
    found = true;
    r.stop_at_eos = true;
    const auto out = collect(*e->submit(r));
    EXPECT_EQ(out.finish, FinishReason::Stop);
    EXPECT_EQ(out.tokens, std::vector<int32_t>(free_run.begin(), it));
    EXPECT_EQ(out.events.back().token, -1);
  }
  EXPECT_TRUE(found);
}

TEST_F(ServeEngine, LogprobsAreOfTheUnmodifiedDistribution) {
  auto e = engine(2, 32);
  auto r = greedy(prompt_of(10, 6), 8);
  r.sampling.top_logprobs = 5;
  const auto out = collect(*e->submit(r));
  ASSERT_EQ(out.events.size(), 8u);
  for (const TokenEvent& ev : out.events) {
    ASSERT_EQ(ev.top_logprobs.size(), 5u);
    EXPECT_EQ(ev.top_logprobs[0].first, ev.token);  // greedy takes the most likely token
    EXPECT_FLOAT_EQ(ev.top_logprobs[0].second, ev.logprob);
    EXPECT_LE(ev.logprob, 0.0f);
    double mass = 0;
    for (size_t i = 0; i < ev.top_logprobs.size(); ++i) {
      if (i > 0) {
        EXPECT_LE(ev.top_logprobs[i].second, ev.top_logprobs[i - 1].second);
      }
      mass += std::exp(ev.top_logprobs[i].second);
    }
    EXPECT_LE(mass, 1.0 + 1e-5);
  }
  r.sampling.top_logprobs = -1;
  const auto plain = collect(*e->submit(r));
  EXPECT_TRUE(plain.events[0].top_logprobs.empty());
  EXPECT_EQ(plain.tokens, out.tokens);
}

TEST_F(ServeEngine, PresencePenaltyStopsRepeats) {
  auto e = engine(2, 32);
  auto r = greedy(prompt_of(10, 7), 60);
  r.sampling.presence_penalty = 1000.0f;  // far beyond OpenAI's range: every used token is out
  const auto out = collect(*e->submit(r));
  EXPECT_EQ(std::set<int32_t>(out.tokens.begin(), out.tokens.end()).size(), out.tokens.size());
  auto f = greedy(prompt_of(10, 7), 60);
  f.sampling.frequency_penalty = 1000.0f;
  EXPECT_EQ(collect(*e->submit(f)).tokens, out.tokens);  // after one use both penalties are huge
}

TEST_F(ServeEngine, QueueFullAndValidationErrors) {
  {
    EngineOptions eo;
    eo.max_queue = 0;
    auto e = engine(1, 16, eo);
    EXPECT_THROW(e->submit(greedy(prompt_of(5, 1), 4)), QueueFull);
  }
  EngineOptions eo;
  eo.max_queue = 2;
  std::unique_ptr<Engine> e;
  std::vector<std::shared_ptr<RequestStream>> ok;
  int rejected = 0;
  // One slot: at most one request runs, so while none has finished a third waiting one cannot fit in a
  // queue of 2. Each runs for 200 steps, normally far longer than five submissions take; on a machine so
  // busy that one finished in between, the attempt proves nothing and is repeated with a fresh engine.
  for (int attempt = 0; attempt < 20; ++attempt) {
    for (auto& s : ok) s->cancel();
    ok.clear();
    rejected = 0;
    e = engine(1, 32, eo);
    for (int i = 0; i < 5; ++i) {
      try {
        ok.push_back(e->submit(greedy(prompt_of(5, i), 200)));
      } catch (const QueueFull&) {
        ++rejected;
      }
    }
    if (e->stats().requests_finished == 0) break;
  }
  ASSERT_EQ(e->stats().requests_finished, 0u) << "every attempt had a request finish during the submissions";
  EXPECT_GE(rejected, 2);
  EXPECT_GE(ok.size(), 2u);
  EXPECT_THROW(e->submit(greedy({}, 4)), Error);
  EXPECT_THROW(e->submit(greedy(prompt_of(200, 1), 100)), Error);
  EXPECT_THROW(e->submit(greedy(prompt_of(5, 1), -1)), Error);
  for (auto& s : ok) s->cancel();
  for (auto& s : ok) EXPECT_EQ(collect(*s).finish, FinishReason::Cancelled);
  expect_blocks_back(*e);
}

TEST_F(ServeEngine, CancelMidStreamFreesBlocks) {
  // The cancel comes after the first token; a 200-token run normally lasts far longer than that takes, but
  // on a machine so busy that the test thread slept through the whole run the attempt proves nothing and
  // is repeated with a fresh engine. A cancel that never works still fails every attempt.
  std::unique_ptr<Engine> e;
  test::StreamOutput out;
  for (int attempt = 0; attempt < 20; ++attempt) {
    e = engine(2, 32);
    auto s = e->submit(greedy(prompt_of(30, 2), 200));
    TokenEvent ev;
    while (!s->next(ev, std::chrono::milliseconds(100))) {
    }
    s->cancel();
    out = collect(*s);
    if (out.finish != FinishReason::Length) break;
  }
  EXPECT_EQ(out.finish, FinishReason::Cancelled);
  expect_blocks_back(*e);
  EXPECT_EQ(e->stats().requests_finished, 0u);
}

TEST_F(ServeEngine, ShutdownCancelsWhatIsLeft) {
  std::shared_ptr<RequestStream> a, b;
  {
    EngineOptions eo;
    auto e = engine(1, 32, eo);
    a = e->submit(greedy(prompt_of(10, 1), 240));
    b = e->submit(greedy(prompt_of(10, 2), 10));  // one slot: waits behind a
  }
  const FinishReason fa = collect(*a).finish;
  EXPECT_TRUE(fa == FinishReason::Cancelled || fa == FinishReason::Length);  // a 240-step run is not quicker than this
  EXPECT_EQ(collect(*b).finish, FinishReason::Cancelled);
}

TEST_F(ServeEngine, ManyConcurrentSubmittersUnderBlockPressure) {
  // 24 blocks for 8 slots: requests preempt each other, every one still finishes with the right text.
  EngineOptions eo;
  auto e = engine(8, 24, eo);
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> got(16);
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = t; i < 16; i += 4) got[(size_t)i] = collect(*e->submit(greedy(prompt_of(10 + i, 50 + i), 50))).tokens;
    });
  for (auto& th : threads) th.join();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got[(size_t)i], reference(prompt_of(10 + i, 50 + i), 50)) << i;
  expect_blocks_back(*e);
  EXPECT_EQ(e->stats().requests_finished, 16u);
}
