// merlin init: a randomly initialised model of a preset (or explicit dimensions) with the GPT-2 vocabulary.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "model/init.h"
#include "tokenizer/tokenizer.h"

namespace merlin::cli {
namespace {

struct InitArgs {
  ModelFlags model;
  std::string out, type = "f32", vocab_dir;
  uint64_t seed = 0;
  int threads = 0;
};

int init(const InitArgs& a) {
  std::optional<ModelConfig> c = model_from_flags(a.model);
  const std::optional<DType> type = dtype_from_name(a.type);
  MERLIN_CHECK(type && (*type == DType::F32 || *type == DType::F16 || *type == DType::BF16), "--type must be f32, f16 or bf16");
  const std::string dir = find_gpt2_vocab_dir(a.vocab_dir);
  auto tok = Tokenizer::from_gpt2_files(dir + "/encoder.json", dir + "/vocab.bpe");
  c->vocab_size = tok->vocab_size();
  InitOptions o;
  o.seed = a.seed;
  o.type = *type;
  o.n_threads = a.threads;
  std::fprintf(stderr, "init: %s, %.2f M parameters, %s, seed %llu -> %s\n", a.model.preset.c_str(), c->n_params() / 1e6,
               a.type.c_str(), (unsigned long long)a.seed, a.out.c_str());
  write_random_model(*c, *tok, o, a.out);
  // Streaming: memory stays at a few buffers whatever the model size; print it so that is checkable.
  std::fprintf(stderr, "init: wrote %s, peak RSS %s\n", a.out.c_str(), format_bytes(peak_rss_bytes()).c_str());
  return 0;
}

}  // namespace

Action add_init(CLI::App& app) {
  auto a = std::make_shared<InitArgs>();
  add_model_flags(app, a->model);
  app.add_option("--seed", a->seed, "random seed");
  app.add_option("-o,--output", a->out, "output GGUF file")->required();
  app.add_option("--type", a->type, "weight type: f32 | f16 | bf16");
  app.add_option("--vocab-dir", a->vocab_dir, "directory with GPT-2 encoder.json and vocab.bpe");
  app.add_option("-t,--threads", a->threads, "threads");
  return [a] { return init(*a); };
}

}  // namespace merlin::cli
