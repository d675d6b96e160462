// Whole-model tests of the CPU forward pass and generation: llama2.c's own outputs for stories260K,
// and agreement between the prefill, decode and no-cache paths and between batched sequences.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/quantize_model.h"
#include "runtime/row_sampling.h"
#include "runtime/sampler.h"
#include "logits_test_util.h"
#include "test_util.h"

using namespace merlin;
using test::max_abs;
using test::max_diff;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Greedy generation the way llama2.c's run.c does it: `steps` positions in total, stop at BOS (id 1).
std::string llama2c_greedy(const Model& m, const std::string& prompt, int steps) {
  BackendOptions bo;
  bo.n_threads = 2;
  bo.kv_type = DType::F32;  // llama2.c computes attention in fp32
  auto backend = make_cpu_backend(m, bo);
  const Tokenizer& tok = m.tokenizer();
  std::vector<int32_t> ids = {tok.bos_id()};
  for (int32_t id : tok.encode(prompt, false)) ids.push_back(id);
  std::string text;
  int32_t prev = -1;
  for (int32_t id : ids) {
    text += tok.decode_token(id, prev);
    prev = id;
  }
  GenerateOptions go;
  go.n_predict = steps - (int)ids.size() + 1;
  go.stop_at_eos = false;
  go.sampling.temperature = 0;
  generate(m, *backend, ids, go, [&](int32_t id) {
    if (id == 1) return false;
    text += tok.decode_token(id, prev);
    prev = id;
    return true;
  });
  return text + "\n";
}

}  // namespace

TEST(Stories260K, GreedyMatchesLlama2cWithPrompt) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  MERLIN_REQUIRE_DATA(expected, "models/stories260K/llama2c_run_t0.0_prompt_once_n100.out.txt");
  auto m = Model::load(model_path);
  EXPECT_EQ(llama2c_greedy(*m, "Once upon a time", 100), read_text(expected));
}

TEST(Stories260K, GreedyMatchesLlama2cEmptyPrompt) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  MERLIN_REQUIRE_DATA(expected, "models/stories260K/llama2c_run_t0.0.out.txt");
  auto m = Model::load(model_path);
  EXPECT_EQ(llama2c_greedy(*m, "", 256), read_text(expected));
}

// Prefill (GEMM kernels, chunked), decode (GEMV, one token at a time) and no-cache recomputation must give the
// same logits: exactly up to fp32 reordering with an F32 cache; with F16/Q8_0 caches the rounding of cached
// values and of q can flip on reordered sums, so the bound is that format's precision.
void expect_paths_agree(DType kv_type, float rel_tol) {
  SCOPED_TRACE(dtype_name(kv_type));
  const std::string model_path = test::data_file("models/tiny-llama-conformance/tiny-f32.gguf");
  auto m = Model::load(model_path);
  BackendOptions bo;
  bo.n_threads = 2;
  bo.max_batch = 7;  // forces chunked prefill
  bo.kv_type = kv_type;
  auto backend = make_cpu_backend(*m, bo);
  const std::vector<int32_t> ids = {1, 403, 407, 261, 378, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120};
  const size_t vocab = (size_t)m->config().vocab_size;
  const std::vector<float> all = prefill(*m, *backend, ids, 0, 0, true);
  ASSERT_EQ(all.size(), ids.size() * vocab);
  const float tol = rel_tol * max_abs(all);
  std::vector<float> decode, nocache;
  for (size_t i = 0; i < ids.size(); ++i) {
    auto row = prefill(*m, *backend, {ids[i]}, 0, (int)i, false);
    decode.insert(decode.end(), row.begin(), row.end());
  }
  EXPECT_LE(max_diff(all, decode), tol);
  for (size_t i = 0; i < ids.size(); ++i) {
    backend->clear_sequence(0);
    auto row = prefill(*m, *backend, std::vector<int32_t>(ids.begin(), ids.begin() + (ptrdiff_t)i + 1), 0, 0, false);
    nocache.insert(nocache.end(), row.begin(), row.end());
  }
  EXPECT_LE(max_diff(all, nocache), tol);
}

TEST(Forward, PrefillDecodeAndNoCacheAgree) {
  MERLIN_REQUIRE_DATA(model_path, "models/tiny-llama-conformance/tiny-f32.gguf");
  expect_paths_agree(DType::F32, 1e-5f);
  expect_paths_agree(DType::F16, 1e-3f);
  expect_paths_agree(DType::Q8_0, 1e-2f);
}

TEST(Forward, KvCacheTypesStayCloseToF32) {
  MERLIN_REQUIRE_DATA(model_path, "models/tiny-llama-conformance/tiny-f32.gguf");
  auto m = Model::load(model_path);
  const std::vector<int32_t> ids = {1, 403, 407, 261, 378, 10, 20, 30, 40, 50, 60, 70};
  std::vector<float> ref;
  for (DType kv : {DType::F32, DType::F16, DType::Q8_0}) {
    BackendOptions bo;
    bo.kv_type = kv;
    auto backend = make_cpu_backend(*m, bo);
    const std::vector<float> got = prefill(*m, *backend, ids, 0, 0, true);
    if (kv == DType::F32) ref = got;
    // Bounds: f16 keeps 11 significant bits, q8_0 about 8 per 32-element block.
    const float rel = kv == DType::F32 ? 0.0f : kv == DType::F16 ? 2e-3f : 3e-2f;
    EXPECT_LE(max_diff(got, ref), rel * max_abs(ref)) << dtype_name(kv);
  }
}

TEST(Forward, SequencesInOneBatchMatchSeparateRuns) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = Model::load(model_path);
  BackendOptions bo;
  bo.n_threads = 2;
  bo.n_seq = 3;
  auto backend = make_cpu_backend(*m, bo);
  const size_t vocab = (size_t)m->config().vocab_size;
  const std::vector<std::vector<int32_t>> seqs = {{1, 403, 407}, {1, 50, 60, 70, 80}, {1, 9}};
  std::vector<std::vector<float>> alone;
  for (const auto& s : seqs) alone.push_back(prefill(*m, *backend, s, 0, 0, true));
  test::expect_batch_matches_alone(*backend, seqs, alone, vocab, 1e-5f);
}

// A server's resident K/V cache (one huge-page region, faulted in by idle_work between steps, after some of it
// was written) holds the same rows as the lazily faulted one: the same logits, bit for bit.
TEST(Forward, ResidentKvCacheGivesSameLogits) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = Model::load(model_path);
  std::vector<std::vector<float>> runs;
  for (bool resident : {false, true}) {
    BackendOptions bo;
    bo.n_threads = 2;
    bo.n_seq = 4;  // 5 MiB of cache: several idle_work pieces
    bo.resident_kv = resident;
    auto backend = make_cpu_backend(*m, bo);
    EXPECT_EQ(resident, backend->idle_work());  // a 2 MiB piece of many
    std::vector<float> all = prefill(*m, *backend, {1, 403, 407, 261}, 0, 0, true);
    const std::vector<float> other = prefill(*m, *backend, {1, 50, 60}, 1, 0, true);
    all.insert(all.end(), other.begin(), other.end());
    while (backend->idle_work()) {
    }
    std::vector<float> logits(2 * (size_t)m->config().vocab_size);
    for (int step = 0; step < 6; ++step) {
      Batch b;
      b.add(100 + step, 4 + step, 0, true);
      b.add(200 + step, 3 + step, 1, true);
      backend->forward(b, logits.data());
      all.insert(all.end(), logits.begin(), logits.end());
    }
    runs.push_back(std::move(all));
  }
  ASSERT_EQ(runs[0].size(), runs[1].size());
  EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)));
}

TEST(Forward, RejectsBadTokensAndPositions) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = Model::load(model_path);
  BackendOptions bo;
  bo.n_ctx = 16;
  auto backend = make_cpu_backend(*m, bo);
  std::vector<float> logits(m->config().vocab_size);
  Batch b;
  b.add(512, 0, 0, true);
  EXPECT_THROW(backend->forward(b, logits.data()), Error);
  b.clear();
  b.add(1, 16, 0, true);
  EXPECT_THROW(backend->forward(b, logits.data()), Error);
  EXPECT_THROW(prefill(*m, *backend, std::vector<int32_t>(17, 1), 0, 0, false), Error);
}

TEST(Generate, KvCacheAndNoCacheGiveSameTokens) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = Model::load(model_path);
  auto backend = make_cpu_backend(*m, BackendOptions{});
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 378};
  std::vector<int32_t> with, without;
  GenerateOptions go;
  go.n_predict = 40;
  go.sampling.temperature = 0.8f;
  go.sampling.seed = 3;
  generate(*m, *backend, prompt, go, [&](int32_t id) { with.push_back(id); return true; });
  go.use_kv_cache = false;
  generate(*m, *backend, prompt, go, [&](int32_t id) { without.push_back(id); return true; });
  EXPECT_EQ(with, without);
  EXPECT_FALSE(with.empty());
}

// Greedy generation with the cache goes through Backend::decode_greedy: the same tokens as the no-cache path,
// and the same stops (a full context after 16 - 5 positions' worth of tokens, a callback saying stop).
TEST(Generate, GreedyStopsAtContextAndCallback) {
  MERLIN_REQUIRE_DATA(model_path, "models/stories260K/stories260K.gguf");
  auto m = Model::load(model_path);
  BackendOptions bo;
  bo.n_ctx = 16;
  auto backend = make_cpu_backend(*m, bo);
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 378};
  GenerateOptions go;
  go.n_predict = 40;
  go.stop_at_eos = false;
  go.sampling.temperature = 0;
  std::vector<int32_t> with, without;
  GenerateStats a = generate(*m, *backend, prompt, go, [&](int32_t id) { with.push_back(id); return true; });
  go.use_kv_cache = false;
  GenerateStats b = generate(*m, *backend, prompt, go, [&](int32_t id) { without.push_back(id); return true; });
  EXPECT_EQ(with, without);
  EXPECT_EQ(a.n_generated, 11);
  EXPECT_EQ(a.stop_reason, "context");
  EXPECT_EQ(b.stop_reason, "context");
  go.use_kv_cache = true;
  std::vector<int32_t> three;
  GenerateStats c = generate(*m, *backend, prompt, go, [&](int32_t id) {
    three.push_back(id);
    return three.size() < 3;
  });
  EXPECT_EQ(c.n_generated, 3);
  EXPECT_EQ(c.stop_reason, "callback");
  EXPECT_EQ(three, std::vector<int32_t>(with.begin(), with.begin() + 3));
}

// generate() on the CPU draws through Backend::forward_sample (sample_row, as the server and the GPU do):
// the same tokens as a host loop over forward()'s logits with sample_row and a twin Sampler's uniforms, for
// temperature alone (a draw over the whole row in id order) and the CLI's default filters; with a
// repetition penalty it keeps Sampler::sample.
TEST(Generate, SamplingOnTheCpuIsSampleRow) {
  auto m = Model::load(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf");
  const std::vector<int32_t> prompt = m->tokenizer().encode("Once upon a time", false);
  const SamplerOptions cases[] = {{1.0f, 0, 1.0f, 0.0f, 1.0f, 64, 5}, {0.8f, 40, 0.95f, 0.05f, 1.0f, 64, 6},
                                  {0.8f, 40, 0.95f, 0.05f, 1.3f, 64, 7}};
  for (const SamplerOptions& so : cases) {
    SCOPED_TRACE(so.repeat_penalty);
    GenerateOptions go;
    go.n_predict = 24;
    go.stop_at_eos = false;
    go.sampling = so;
    auto backend = make_cpu_backend(*m, BackendOptions{});
    std::vector<int32_t> got;
    generate(*m, *backend, prompt, go, [&](int32_t id) { got.push_back(id); return true; });
    auto twin = make_cpu_backend(*m, BackendOptions{});
    const std::vector<int32_t> want = test::host_sampled_tokens(*m, *twin, prompt, so, go.n_predict);
    EXPECT_EQ(got, want);
  }
}

// A CPU backend of two sequences on two threads (the step tests below: rows of both sequences in one batch).
static std::unique_ptr<Backend> two_sequence_cpu_backend(const Model& m) {
  BackendOptions bo;
  bo.n_threads = 2;
  bo.n_seq = 2;
  return make_cpu_backend(m, bo);
}

// Backend::forward_greedy (the CPU backend's, for few rows): the argmax of each logits row forward() gives,
// in batch order, for the rows that want logits only.
TEST(Generate, ForwardGreedyDefaultIsArgmaxOfLogits) {
  auto m = Model::load(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf");
  auto backend = two_sequence_cpu_backend(*m);
  const int64_t vocab = m->config().vocab_size;
  Batch b;
  for (int i = 0; i < 9; ++i) b.add(100 + 17 * i, i / 2, i % 2, i % 3 != 1);
  std::vector<float> logits(b.n_logits() * (size_t)vocab);
  backend->forward(b, logits.data());
  std::vector<int32_t> ids(b.n_logits(), -1);
  backend->forward_greedy(b, vocab, ids.data());  // same positions again: overwrites the same K/V rows
  for (size_t r = 0; r < ids.size(); ++r) EXPECT_EQ(ids[r], argmax(logits.data() + r * (size_t)vocab, vocab));
}

// Backend::forward_sample on the CPU backend (rows spread over its threads): each row's token is sample_row
// of forward()'s logits with that row's RowSampling and adjustments: greedy, unfiltered, filtered rows.
TEST(Generate, CpuForwardSampleIsSampleRowOfLogits) {
  auto m = Model::load(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf");
  auto backend = two_sequence_cpu_backend(*m);
  const int64_t vocab = m->config().vocab_size;
  Batch b;
  for (int i = 0; i < 12; ++i) b.add(100 + 17 * i, i / 2, i % 2, i % 4 != 1);
  std::vector<float> logits(b.n_logits() * (size_t)vocab);
  backend->forward(b, logits.data());
  std::vector<RowSampling> rows(b.n_logits());
  std::vector<LogitAdjust> adjust;
  for (size_t r = 0; r < rows.size(); ++r) {
    rows[r].temperature = r % 3 == 0 ? 0.0f : 0.6f + 0.2f * (float)r;
    rows[r].top_k = r % 4 == 1 ? 40 : 0;
    rows[r].top_p = r % 3 == 2 ? 0.9f : 1.0f;
    rows[r].min_p = r % 5 == 3 ? 0.05f : 0.0f;
    rows[r].u = (double)(r + 1) / (double)(rows.size() + 2);
    rows[r].first = (int32_t)adjust.size();
    adjust.push_back({(int32_t)(r * 131 % vocab), 3.0f, 0.5f, LogitAdjust::kBias | LogitAdjust::kPenalty});
    rows[r].n_adjust = 1;
  }
  std::vector<int32_t> ids(rows.size(), -1);
  backend->forward_sample(b, vocab, rows, adjust, ids.data());  // same positions: overwrites the same K/V
  SampleScratch work;
  for (size_t r = 0; r < ids.size(); ++r)
    EXPECT_EQ(ids[r], sample_row(logits.data() + r * (size_t)vocab, vocab, rows[r], adjust.data(), work)) << "row " << r;
}

// A backend of many sequences picks the ids of a many-row step through the output-head screen (on an AVX-512
// CPU; elsewhere the exact path): still the argmax of forward()'s logits, row for row, over several decode steps
// of 32 sequences (the server's greedy step), with some rows not asking for logits. The default model's F16 head
// (screened) and the same model in Q4_0 (a tied, repacked head: the exact product, then the parallel argmax).
static void check_greedy_of_many_sequences(const std::string& path) {
  auto m = Model::load(path);
  BackendOptions bo;
  bo.n_threads = 2;
  bo.n_seq = 32;
  auto backend = make_cpu_backend(*m, bo);
  const int64_t vocab = m->config().vocab_size;
  std::vector<int32_t> next(32);
  for (int s = 0; s < 32; ++s) next[(size_t)s] = 50 + 31 * s;
  for (int step = 0; step < 6; ++step) {
    Batch b;
    for (int s = 0; s < 32; ++s) b.add(next[(size_t)s], step, s, step != 2 || s % 5 != 0);
    std::vector<float> logits(b.n_logits() * (size_t)vocab);
    backend->forward(b, logits.data());
    std::vector<int32_t> ids(b.n_logits(), -1);
    backend->forward_greedy(b, vocab, ids.data());  // same positions again: overwrites the same K/V rows
    size_t row = 0;
    for (int s = 0; s < 32; ++s) {
      if (!b.want_logits[(size_t)s]) continue;
      const int32_t want = argmax(logits.data() + row * (size_t)vocab, vocab);
      ASSERT_EQ(ids[row], want) << "step " << step << " sequence " << s;
      next[(size_t)s] = want;
      ++row;
    }
  }
}

TEST(Generate, ForwardGreedyOfManySequencesIsArgmaxOfLogits) {
  check_greedy_of_many_sequences(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf");
}

TEST(Generate, ForwardGreedyOfManySequencesIsArgmaxOfLogitsQuantizedHead) {
  test::TempDir dir;
  const std::string q4 = dir.file("default-q4_0.gguf");
  QuantizeOptions qo;
  qo.type = DType::Q4_0;
  qo.n_threads = 2;
  qo.progress = false;
  quantize_model(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf", q4, qo);
  check_greedy_of_many_sequences(q4);
}

// Backend::decode_greedy_batch (the CPU backend's default): rows at different positions decode together, each
// step feeding the row's previous id, the same ids as forward_greedy of the same rows step by step; mismatched
// row counts are refused.
TEST(Generate, DecodeGreedyBatchDefaultIsForwardGreedyPerStep) {
  auto m = Model::load(std::string(MERLIN_SOURCE_DIR) + "/models/merlin-default.gguf");
  BackendOptions bo;
  bo.n_threads = 2;
  bo.n_seq = 3;
  auto a = make_cpu_backend(*m, bo), b = make_cpu_backend(*m, bo);
  const int64_t vocab = m->config().vocab_size;
  const std::vector<int32_t> first{11, 222, 3333}, pos{0, 4, 9}, seqs{0, 1, 2};
  for (Backend* be : {a.get(), b.get()})  // rows 1 and 2 start after a few cached positions
    for (int s = 1; s < 3; ++s)
      for (int p = 0; p < pos[(size_t)s]; ++p) {
        Batch pre;
        pre.add(50 + p, p, s, false);
        std::vector<float> none;
        be->forward(pre, none.data());
      }
  const int steps = 5;
  std::vector<int32_t> want((size_t)steps * 3), got((size_t)steps * 3, -1), cur = first;
  for (int i = 0; i < steps; ++i) {
    Batch batch;
    for (int r = 0; r < 3; ++r) batch.add(cur[(size_t)r], pos[(size_t)r] + i, seqs[(size_t)r], true);
    a->forward_greedy(batch, vocab, want.data() + (size_t)i * 3);
    std::copy(want.begin() + i * 3, want.begin() + (i + 1) * 3, cur.begin());
  }
  b->decode_greedy_batch(first, pos, seqs, steps, vocab, got.data());
  EXPECT_EQ(got, want);
  EXPECT_THROW(b->decode_greedy_batch(first, std::vector<int32_t>{0, 1}, seqs, steps, vocab, got.data()), Error);
}
