// merlin prepare: text files to GPT-2 token shards for `merlin train`.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "tokenizer/tokenizer.h"
#include "train/prepare.h"

namespace merlin::cli {
namespace {

struct PrepareArgs {
  train::PrepareOptions o;
  std::string format = "auto", vocab_dir;
  bool quiet = false;
};

void print_split(const char* name, const train::SplitSummary& s) {
  if (s.documents == 0) return;
  std::fprintf(stderr, "prepare: %-5s %8llu documents %10llu tokens %10s  %.3f bytes/token  (%zu shard%s)\n", name,
               (unsigned long long)s.documents, (unsigned long long)s.tokens, format_bytes(s.bytes).c_str(),
               s.tokens ? (double)s.bytes / (double)s.tokens : 0.0, s.files.size(), s.files.size() == 1 ? "" : "s");
}

int run_prepare(PrepareArgs& a) {
  a.o.format = train::parse_text_format(a.format);
  a.o.progress = !a.quiet;
  const std::string dir = find_gpt2_vocab_dir(a.vocab_dir);
  auto tok = Tokenizer::from_gpt2_files(dir + "/encoder.json", dir + "/vocab.bpe");
  const double t0 = now_seconds();
  const train::PrepareSummary s = train::prepare_data(a.o, *tok);
  print_split("train", s.train);
  print_split("val", s.val);
  std::fprintf(stderr, "prepare: wrote %s in %.1f s\n", a.o.out_dir.c_str(), now_seconds() - t0);
  return 0;
}

}  // namespace

Action add_prepare(CLI::App& app) {
  auto a = std::make_shared<PrepareArgs>();
  app.add_option("-i,--input", a->o.inputs, "text files (training documents)")->required()->expected(1, -1);
  app.add_option("--val", a->o.val_input, "held-out text file for validation");
  app.add_option("--val-fraction", a->o.val_fraction, "without --val: fraction of the documents held out")
      ->capture_default_str();
  app.add_option("--format", a->format, "auto | eot (<|endoftext|> separated) | jsonl (\"text\"/\"story\") | lines")
      ->capture_default_str();
  app.add_option("-o,--output", a->o.out_dir, "output directory for train-*.tok / val-*.tok")->required();
  app.add_option("--shard-tokens", a->o.shard_tokens, "tokens per shard")->capture_default_str();
  app.add_option("--vocab-dir", a->vocab_dir, "directory with GPT-2 encoder.json and vocab.bpe");
  app.add_option("-t,--threads", a->o.threads, "threads (default: all cores)");
  app.add_flag("-q,--quiet", a->quiet, "no progress bar");
  return [a] { return run_prepare(*a); };
}

}  // namespace merlin::cli
