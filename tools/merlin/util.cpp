#include <cstdlib>
#include <filesystem>

#include "commands.h"
#include "core/error.h"

namespace merlin::cli {

void add_model_flags(CLI::App& app, ModelFlags& f) {
  app.add_option("--preset", f.preset, "model: sanity | experiment | base | iphone | macbook");
  app.add_option("--dim", f.dim, "override: embedding size");
  app.add_option("--layers", f.layers, "override: layers");
  app.add_option("--heads", f.heads, "override: attention heads");
  app.add_option("--kv-heads", f.kv_heads, "override: KV heads (GQA)");
  app.add_option("--ffn", f.ffn, "override: feed-forward size");
  app.add_option("--ctx", f.ctx, "override: context length");
  app.add_flag("--untied", f.untied, "separate output head instead of tied embeddings");
}

ModelConfig model_from_flags(const ModelFlags& f) {
  std::optional<ModelConfig> c = preset(f.preset);
  MERLIN_CHECK(c.has_value(), "unknown preset '", f.preset, "' (sanity, experiment, base, iphone, macbook)");
  if (f.dim) c->dim = f.dim;
  if (f.layers) c->n_layers = f.layers;
  if (f.heads) c->n_heads = c->n_kv_heads = f.heads;
  if (f.kv_heads) c->n_kv_heads = f.kv_heads;
  if (f.ffn) c->ffn_dim = f.ffn;
  if (f.ctx) c->context_length = f.ctx;
  c->tied_embeddings = !f.untied;
  return *c;
}

std::vector<int32_t> parse_id_list(const std::string& s) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find_first_of(", ", i);
    if (j == std::string::npos) j = s.size();
    if (j > i) {
      const std::string part = s.substr(i, j - i);
      char* end = nullptr;
      const long v = std::strtol(part.c_str(), &end, 10);
      MERLIN_CHECK(end && *end == 0 && v >= 0 && v <= INT32_MAX, "'", part, "' is not a token id");
      ids.push_back((int32_t)v);
    }
    i = j + 1;
  }
  return ids;
}

std::string find_gpt2_vocab_dir(const std::string& flag) {
  namespace fs = std::filesystem;
  if (!flag.empty()) {
    MERLIN_CHECK(fs::exists(flag + "/encoder.json") && fs::exists(flag + "/vocab.bpe"), "--vocab-dir '", flag,
                 "' has no encoder.json + vocab.bpe");
    return flag;
  }
  std::vector<std::string> candidates;
  if (const char* e = std::getenv("MERLIN_VOCAB_DIR")) candidates.push_back(e);
  if (const char* e = std::getenv("MERLIN_CACHE")) candidates.push_back(std::string(e) + "/gpt2");
  if (const char* h = std::getenv("HOME")) candidates.push_back(std::string(h) + "/.cache/merlin/gpt2");
  if (const char* d = std::getenv("MERLIN_DATA")) candidates.push_back(std::string(d) + "/tokenizer/gpt2");
  candidates.push_back("../shared/data/tokenizer/gpt2");
  for (const std::string& c : candidates)
    if (fs::exists(c + "/encoder.json") && fs::exists(c + "/vocab.bpe")) return c;
  fail("GPT-2 vocabulary not found: run 'bash scripts/setup.sh vocab' or pass --vocab-dir DIR");
}

}  // namespace merlin::cli
