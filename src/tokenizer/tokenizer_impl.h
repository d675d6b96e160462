// Private to the tokenizer: what the GPT-2 and SentencePiece implementations share.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace merlin::tok {

// tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
enum TokenType : int32_t {
  kTypeUndefined = 0,
  kTypeNormal = 1,
  kTypeUnknown = 2,
  kTypeControl = 3,
  kTypeUserDefined = 4,
  kTypeUnused = 5,
  kTypeByte = 6,
};

// Lets unordered_map<std::string, V> be searched with a string_view without building a std::string.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// The vocabulary part common to both models, as read from GGUF or built from GPT-2's files.
struct Vocab {
  std::vector<std::string> tokens;  // GGUF spelling (GPT-2: byte-to-unicode mapped; SPM: "▁" for space)
  std::vector<int32_t> types;       // one TokenType per token
  int32_t bos = -1;
  int32_t eos = -1;
  bool add_bos = false;

  // Throws merlin::Error on an empty vocabulary, size mismatches, ids out of range or duplicate tokens.
  void validate(const char* model) const;
  StringMap<int32_t> index() const;  // token text -> id
};

// Finds literal special-token strings in text: the leftmost occurrence wins, the longest at equal
// positions. Each token's next occurrence is remembered, so one pass costs O(text * tokens) at worst,
// not O(text * matches * tokens).
class SpecialMatcher {
 public:
  struct Special {
    std::string text;
    int32_t id;
  };
  SpecialMatcher() = default;
  explicit SpecialMatcher(std::vector<Special> specials);
  bool empty() const { return specials_.empty(); }

  // Calls on_text for each non-empty stretch of ordinary text and on_special for each match, in order.
  void split(std::string_view text, const std::function<void(std::string_view)>& on_text,
             const std::function<void(int32_t)>& on_special) const;

 private:
  std::vector<Special> specials_;
};

// Control and user-defined tokens of `v`: the strings encode(text, allow_special=true) recognizes.
SpecialMatcher special_tokens_of(const Vocab& v);

// Throws merlin::Error("invalid UTF-8 in input: ...") unless `text` is valid UTF-8.
void check_utf8_input(std::string_view text);

std::unique_ptr<Tokenizer> make_gpt2(Vocab v, const std::vector<std::string>& merges);
std::unique_ptr<Tokenizer> make_spm(Vocab v, std::vector<float> scores, int32_t unk, bool add_space_prefix);

}  // namespace merlin::tok
