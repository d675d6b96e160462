// Tokenizer throughput on TinyStories (shared/data): GPT-2 encode with a warm and a cold piece cache,
// GPT-2 decode, and the SentencePiece tokenizer. Target: GPT-2 encode >= 5 MB/s on one core.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace {

std::string data_path(const std::string& rel) {
  const char* env = std::getenv("MERLIN_DATA");
#ifdef MERLIN_DEFAULT_DATA_DIR
  const std::string dir = env != nullptr && *env ? env : MERLIN_DEFAULT_DATA_DIR;
#else
  const std::string dir = env != nullptr && *env ? env : "../shared/data";
#endif
  return dir + "/" + rel;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::string& stories() {
  static const std::string text = slurp(data_path("text/tinystories/TinyStories-train.head2MiB.txt"));
  return text;
}

std::unique_ptr<merlin::Tokenizer> load_gpt2() {
  return merlin::Tokenizer::from_gpt2_files(data_path("tokenizer/gpt2/encoder.json"),
                                            data_path("tokenizer/gpt2/vocab.bpe"));
}

bool have_data(benchmark::State& state, const std::string& rel) {
  if (std::filesystem::exists(data_path(rel))) return true;
  state.SkipWithError(("missing " + data_path(rel) + " (set MERLIN_DATA)").c_str());
  return false;
}

// Steady state: the piece cache is warm after the first pass, as when encoding a whole corpus.
void BM_Gpt2Encode(benchmark::State& state) {
  if (!have_data(state, "tokenizer/gpt2/encoder.json")) return;
  const auto tok = load_gpt2();
  const std::string& text = stories();
  size_t n_tokens = 0;
  for (auto _ : state) {
    const auto ids = tok->encode(text, true);
    n_tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(n_tokens);
}
BENCHMARK(BM_Gpt2Encode)->Unit(benchmark::kMillisecond)->UseRealTime();

// Every iteration starts from a fresh tokenizer, so the cache fills while the 2 MiB are encoded.
void BM_Gpt2EncodeColdCache(benchmark::State& state) {
  if (!have_data(state, "tokenizer/gpt2/encoder.json")) return;
  const std::string& text = stories();
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = load_gpt2();
    state.ResumeTiming();
    const auto ids = tok->encode(text, true);
    benchmark::DoNotOptimize(ids.data());
    state.PauseTiming();
    tok.reset();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_Gpt2EncodeColdCache)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Gpt2Decode(benchmark::State& state) {
  if (!have_data(state, "tokenizer/gpt2/encoder.json")) return;
  const auto tok = load_gpt2();
  const std::string& text = stories();
  const auto ids = tok->encode(text, false);
  for (auto _ : state) {
    const std::string out = tok->decode(ids);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_Gpt2Decode)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_LlamaEncode(benchmark::State& state) {
  if (!have_data(state, "models/stories260K/stories260K.gguf")) return;
  const auto file = merlin::gguf::File::open(data_path("models/stories260K/stories260K.gguf"));
  const auto tok = merlin::Tokenizer::from_gguf(file->metadata());
  const std::string& text = stories();
  for (auto _ : state) {
    const auto ids = tok->encode(text, true);
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}
BENCHMARK(BM_LlamaEncode)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
