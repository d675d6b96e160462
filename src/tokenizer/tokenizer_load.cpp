// Building tokenizers from GGUF metadata (tokenizer.ggml.*) and from OpenAI's GPT-2 files.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_impl.h"

namespace merlin {

namespace {

using tok::Vocab;

const gguf::Array& array_of(const gguf::Metadata& md, const std::string& key) {
  const gguf::Value* v = md.find(key);
  MERLIN_CHECK(v != nullptr, "tokenizer: missing metadata key '", key, "'");
  return v->as_array(key);
}

std::vector<std::string> strings_of(const gguf::Metadata& md, const std::string& key) {
  const gguf::Array& a = array_of(md, key);
  std::vector<std::string> out;
  out.reserve(a.items.size());
  for (const gguf::Value& item : a.items) out.push_back(item.as_string(key));
  return out;
}

// An optional per-token array; absent means every token gets `dflt`.
template <typename T, typename Convert>
std::vector<T> per_token(const gguf::Metadata& md, const std::string& key, size_t n, T dflt, Convert convert) {
  if (!md.contains(key)) return std::vector<T>(n, dflt);
  const gguf::Array& a = array_of(md, key);
  MERLIN_CHECK(a.items.size() == n, "tokenizer: ", key, " has ", a.items.size(), " entries for ", n, " tokens");
  std::vector<T> out;
  out.reserve(n);
  for (const gguf::Value& item : a.items) out.push_back(convert(item));
  return out;
}

// A token id key; absent gives `dflt`, and 0xFFFFFFFF (what converters write for "none") gives -1.
int32_t token_id_of(const gguf::Metadata& md, const std::string& key, size_t n, int32_t dflt) {
  const gguf::Value* v = md.find(key);
  if (v == nullptr) return dflt < static_cast<int64_t>(n) ? dflt : -1;
  const int64_t id = v->as_int(key);
  if (id == -1 || id == 0xFFFFFFFF) return -1;
  MERLIN_CHECK(id >= 0 && id < static_cast<int64_t>(n), "tokenizer: ", key, " = ", id, " is outside the vocabulary of ",
               n, " tokens");
  return static_cast<int32_t>(id);
}

bool bool_of(const gguf::Metadata& md, const std::string& key, bool dflt) {
  const gguf::Value* v = md.find(key);
  return v == nullptr ? dflt : v->as_bool(key);
}

Vocab vocab_of(const gguf::Metadata& md) {
  Vocab v;
  v.tokens = strings_of(md, "tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  v.types = per_token<int32_t>(md, "tokenizer.ggml.token_type", n, tok::kTypeNormal, [](const gguf::Value& x) {
    return static_cast<int32_t>(x.as_int("tokenizer.ggml.token_type"));
  });
  return v;
}

std::unique_ptr<Tokenizer> gpt2_from_gguf(const gguf::Metadata& md) {
  // Other "gpt2"-model vocabularies (Llama 3, Qwen, ...) use other pre-tokenizer regexes; encoding them
  // with GPT-2's would silently give wrong ids, so refuse them.
  const std::string pre = md.get_string("tokenizer.ggml.pre", "gpt-2");
  MERLIN_CHECK(pre == "gpt-2", "tokenizer: unsupported tokenizer.ggml.pre '", pre,
               "' (only the GPT-2 pre-tokenizer, 'gpt-2', is implemented)");
  Vocab v = vocab_of(md);
  const size_t n = v.tokens.size();
  v.bos = token_id_of(md, "tokenizer.ggml.bos_token_id", n, -1);
  v.eos = token_id_of(md, "tokenizer.ggml.eos_token_id", n, -1);
  v.add_bos = bool_of(md, "tokenizer.ggml.add_bos_token", false);
  return tok::make_gpt2(std::move(v), strings_of(md, "tokenizer.ggml.merges"));
}

std::unique_ptr<Tokenizer> spm_from_gguf(const gguf::Metadata& md) {
  Vocab v = vocab_of(md);
  const size_t n = v.tokens.size();
  // Defaults are llama.cpp's for SPM vocabularies: <unk> 0, <s> 1, </s> 2.
  v.bos = token_id_of(md, "tokenizer.ggml.bos_token_id", n, 1);
  v.eos = token_id_of(md, "tokenizer.ggml.eos_token_id", n, 2);
  v.add_bos = bool_of(md, "tokenizer.ggml.add_bos_token", true);
  const int32_t unk = token_id_of(md, "tokenizer.ggml.unknown_token_id", n, 0);
  std::vector<float> scores = per_token<float>(md, "tokenizer.ggml.scores", n, 0.0f, [](const gguf::Value& x) {
    return static_cast<float>(x.as_double("tokenizer.ggml.scores"));
  });
  const bool space_prefix = bool_of(md, "tokenizer.ggml.add_space_prefix", true);
  return tok::make_spm(std::move(v), std::move(scores), unk, space_prefix);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MERLIN_CHECK(in, "cannot open '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  MERLIN_CHECK(!in.bad(), "cannot read '", path, "'");
  return ss.str();
}

std::vector<std::string> tokens_from_encoder_json(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("'", path, "' is not valid JSON: ", e.what());
  }
  MERLIN_CHECK(j.is_object() && !j.empty(), "'", path, "' is not a JSON object of token -> id");
  std::vector<std::string> tokens(j.size());
  std::vector<bool> seen(j.size(), false);
  for (const auto& [text, id] : j.items()) {
    MERLIN_CHECK(id.is_number_integer(), "'", path, "': the id of '", text, "' is not an integer");
    const auto i = id.get<int64_t>();
    MERLIN_CHECK(i >= 0 && i < static_cast<int64_t>(tokens.size()) && !seen[i], "'", path, "': ids are not 0..",
                 tokens.size() - 1, " each used once (at '", text, "' = ", i, ")");
    seen[i] = true;
    tokens[i] = text;
  }
  return tokens;
}

std::vector<std::string> merges_from_vocab_bpe(const std::string& path) {
  std::istringstream in(read_file(path));
  std::vector<std::string> merges;
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const bool header = first && line.rfind("#version", 0) == 0;
    first = false;
    if (!header && !line.empty()) merges.push_back(line);
  }
  return merges;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::Metadata& md) {
  const gguf::Value* model = md.find("tokenizer.ggml.model");
  MERLIN_CHECK(model != nullptr, "tokenizer: the file has no tokenizer (no tokenizer.ggml.model key)");
  const std::string& name = model->as_string("tokenizer.ggml.model");
  if (name == "gpt2") return gpt2_from_gguf(md);
  if (name == "llama") return spm_from_gguf(md);
  fail("tokenizer: unsupported tokenizer.ggml.model '", name, "' (supported: gpt2, llama)");
}

std::unique_ptr<Tokenizer> Tokenizer::from_gpt2_files(const std::string& encoder_json_path,
                                                      const std::string& vocab_bpe_path) {
  Vocab v;
  v.tokens = tokens_from_encoder_json(encoder_json_path);
  v.types.assign(v.tokens.size(), tok::kTypeNormal);
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    if (v.tokens[id] == "<|endoftext|>") {
      v.types[id] = tok::kTypeControl;
      v.bos = v.eos = static_cast<int32_t>(id);
    }
  }
  return tok::make_gpt2(std::move(v), merges_from_vocab_bpe(vocab_bpe_path));
}

}  // namespace merlin
