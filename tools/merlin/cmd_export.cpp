// merlin export: a training checkpoint to a GGUF model that `merlin run` and llama.cpp load.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"
#include "train/export.h"

namespace merlin::cli {
namespace {

struct ExportArgs {
  std::string ckpt, out, type = "f32", vocab_dir;
};

int run_export(const ExportArgs& a) {
  const std::optional<DType> type = dtype_from_name(a.type);
  MERLIN_CHECK(type && (*type == DType::F32 || *type == DType::F16 || *type == DType::BF16),
               "--type must be f32, f16 or bf16");
  const std::string dir = find_gpt2_vocab_dir(a.vocab_dir);
  auto tok = Tokenizer::from_gpt2_files(dir + "/encoder.json", dir + "/vocab.bpe");
  const uint64_t step = train::export_checkpoint(a.ckpt, a.out, *type, *tok);
  std::fprintf(stderr, "export: %s (step %llu) -> %s (%s)\n", a.ckpt.c_str(), (unsigned long long)step, a.out.c_str(),
               a.type.c_str());
  return 0;
}

}  // namespace

Action add_export(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  app.add_option("checkpoint", a->ckpt, "checkpoint written by 'merlin train' (.ckpt)")->required();
  app.add_option("-o,--output", a->out, "output GGUF model")->required();
  app.add_option("--type", a->type, "matrix type: f32 | f16 | bf16 (norms stay f32)")->capture_default_str();
  app.add_option("--vocab-dir", a->vocab_dir, "directory with GPT-2 encoder.json and vocab.bpe");
  return [a] { return run_export(*a); };
}

}  // namespace merlin::cli
