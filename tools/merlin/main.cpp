// merlin: the command-line front end. Every subcommand is a thin layer over the library API.
#include <cstdio>
#include <map>

#include "commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"Merlin: train, quantize, run and serve small language models", "merlin"};
  app.require_subcommand(1);
  std::map<CLI::App*, merlin::cli::Action> actions;
  auto add = [&](const char* name, const char* desc, merlin::cli::Action (*fn)(CLI::App&)) {
    CLI::App* sub = app.add_subcommand(name, desc);
    actions[sub] = fn(*sub);
  };
  add("run", "generate text from a prompt", merlin::cli::add_run);
  add("info", "print a GGUF file's metadata, tensors and parameter count", merlin::cli::add_info);
  add("init", "write a randomly initialised model", merlin::cli::add_init);
  add("logits", "write the logits of a token sequence (for testing against references)", merlin::cli::add_logits);
  add("tokenize", "print the token ids of a text", merlin::cli::add_tokenize);
  add("prepare", "tokenize text files into training shards", merlin::cli::add_prepare);
  add("train", "train a model from scratch (or resume a checkpoint)", merlin::cli::add_train);
  add("export", "convert a training checkpoint to a GGUF model", merlin::cli::add_export);
  add("plot", "plot train/validation loss from metrics.jsonl as SVG", merlin::cli::add_plot);
  add("quantize", "convert a model's weights to another type (q8_0, q4_0, q4_k, ...)", merlin::cli::add_quantize);
  add("perplexity", "perplexity of a model on a text file (llama-perplexity's method), optional KL to a base model", merlin::cli::add_perplexity);
  add("bench", "tokens/s of prompt processing and generation, peak memory, memory bandwidth", merlin::cli::add_bench);
  add("serve", "serve a model over an OpenAI-compatible HTTP API (continuous batching)", merlin::cli::add_serve);

  // CLI11 reports a misspelt command or a stray flag before the subcommand as "A subcommand is required";
  // name the real problem instead.
  if (argc > 1) {
    const std::string first = argv[1];
    const bool help = first == "-h" || first == "--help";
    if (!help && first[0] == '-') {
      std::fprintf(stderr, "error: unknown option '%s' (see 'merlin --help')\n", first.c_str());
      return 2;
    }
    bool known = false;
    for (const auto& [sub, action] : actions) known = known || sub->get_name() == first;
    if (!help && !known) {
      std::fprintf(stderr, "error: unknown command '%s' (see 'merlin --help')\n", first.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "error: %s (see 'merlin --help')\n", e.what());
    return 2;
  }
  try {
    for (auto& [sub, action] : actions)
      if (sub->parsed()) return action();
  } catch (const merlin::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
