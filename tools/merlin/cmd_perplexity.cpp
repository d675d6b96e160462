// merlin perplexity: llama-perplexity's measurement (see runtime/perplexity.h). Per-chunk running PPL on
// stderr as llama-perplexity prints it ([1]x,[2]y,...); the results on stdout.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "commands.h"
#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/model.h"
#include "runtime/perplexity.h"

namespace merlin::cli {
namespace {

struct PerplexityArgs {
  std::string model, text, kl_base, kv_type = "f16", device = "cpu";
  int ctx = 512, batch = 2048, threads = 0, chunks = -1;
  bool quiet = false, special = false;
};

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MERLIN_CHECK(f.good(), "cannot open text file '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void print_result(const PerplexityResult& r, int64_t n_tokens) {
  std::printf("Final estimate: PPL = %.4f +/- %.5f\n", r.ppl, r.ppl_err);
  std::printf("ln(PPL) = %.6f +/- %.6f\n", r.nll, r.nll_err);
  std::printf("bits per byte = %.6f (%llu bytes in %lld scored tokens)\n", r.bits_per_byte,
              (unsigned long long)r.scored_bytes, (long long)r.n_scored);
  if (r.has_base) {
    std::printf("KL(base || model) = %.6f +/- %.6f nats\n", r.kl, r.kl_err);
    std::printf("top-1 agreement = %.3f %%\n", 100.0 * r.top1);
  }
  std::printf("tokens/s = %.1f (%lld tokens of %lld: %d chunks of %d, %.2f s)\n",
              r.seconds > 0 ? (double)r.n_evaluated / r.seconds : 0.0, (long long)r.n_evaluated,
              (long long)n_tokens, r.n_chunks, r.n_ctx, r.seconds);
}

int perplexity(const PerplexityArgs& a) {
  auto model = Model::load(a.model);
  std::unique_ptr<Model> base;
  if (!a.kl_base.empty()) base = Model::load(a.kl_base);
  const std::vector<int32_t> tokens = perplexity_tokens(model->tokenizer(), read_text(a.text), a.special);
  PerplexityOptions o;
  o.n_ctx = a.ctx;
  o.n_batch = a.batch;
  o.n_threads = a.threads;
  o.kv_type = parse_kv_type(a.kv_type);
  o.device = a.device;
  o.max_chunks = a.chunks;
  std::fprintf(stderr, "perplexity: %zu tokens, chunks of %d, scoring the second half of each%s\n", tokens.size(),
               a.ctx, base ? ", KL against the base model" : "");
  const PerplexityResult r = compute_perplexity(*model, tokens, o, base.get(), [&](int i, double ppl) {
    if (a.quiet) return;
    std::fprintf(stderr, "[%d]%.4f,", i + 1, ppl);
    std::fflush(stderr);
  });
  if (!a.quiet) std::fprintf(stderr, "\n");
  print_result(r, (int64_t)tokens.size());
  return 0;
}

}  // namespace

Action add_perplexity(CLI::App& app) {
  auto a = std::make_shared<PerplexityArgs>();
  app.add_option("-m,--model", a->model, "GGUF model file")->required();
  app.add_option("-f,--file", a->text, "text file to score")->required();
  app.add_option("-c,--ctx", a->ctx, "tokens per chunk")->check(CLI::Range(4, 1 << 20));
  app.add_option("-b,--batch", a->batch, "tokens per forward pass (several chunks at once when larger than -c)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("-t,--threads", a->threads, "threads (default: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--chunks", a->chunks, "score only the first N chunks (-1: all)")->check(CLI::Range(-1, 1 << 30));
  app.add_option("--kl-base", a->kl_base, "reference model (e.g. the f32 original): report KL(base || model)");
  app.add_option("--kv-type", a->kv_type, "KV cache type: f32 | f16 | q8_0");
  app.add_option("--device", a->device, "cpu (default) | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("-q,--quiet", a->quiet, "no per-chunk progress");
  app.add_flag("--special", a->special, "parse special-token text such as <|endoftext|> (llama-perplexity does not)");
  return [a] { return perplexity(*a); };
}

}  // namespace merlin::cli
