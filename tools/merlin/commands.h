// Subcommands of the `merlin` CLI. Each registers its flags on a CLI11 subcommand and returns the
// function that runs it; main() turns merlin::Error into "error: ..." and exit code 1.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/config.h"

namespace merlin::cli {

using Action = std::function<int()>;

Action add_run(CLI::App& app);
Action add_info(CLI::App& app);
Action add_init(CLI::App& app);
Action add_logits(CLI::App& app);
Action add_tokenize(CLI::App& app);
Action add_prepare(CLI::App& app);  // training: cmd_prepare/train/export/plot.cpp
Action add_train(CLI::App& app);
Action add_export(CLI::App& app);
Action add_plot(CLI::App& app);
Action add_quantize(CLI::App& app);  // quantization tools: cmd_quantize/perplexity/bench.cpp
Action add_perplexity(CLI::App& app);
Action add_bench(CLI::App& app);
Action add_serve(CLI::App& app);  // cmd_serve.cpp: the OpenAI-compatible HTTP server

// Model shape flags shared by `init` and `train`: a preset plus optional overrides.
struct ModelFlags {
  std::string preset = "sanity";
  int64_t dim = 0, layers = 0, heads = 0, kv_heads = 0, ffn = 0, ctx = 0;
  bool untied = false;
};
void add_model_flags(CLI::App& app, ModelFlags& f);
ModelConfig model_from_flags(const ModelFlags& f);  // throws merlin::Error on an unknown preset

// "1,2,3" -> {1,2,3}; throws merlin::Error on anything else.
std::vector<int32_t> parse_id_list(const std::string& s);
// Directory holding encoder.json + vocab.bpe: the flag, $MERLIN_VOCAB_DIR, the setup script's cache,
// or ../shared/data/tokenizer/gpt2.
std::string find_gpt2_vocab_dir(const std::string& flag);

}  // namespace merlin::cli
