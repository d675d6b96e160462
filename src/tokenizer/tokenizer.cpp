// What both tokenizers share: vocabulary checks, special-token splitting, Tokenizer::decode.
#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "core/error.h"
#include "tokenizer/tokenizer_impl.h"

namespace merlin {

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += decode_token(ids[i], i == 0 ? -1 : ids[i - 1]);
  return out;
}

namespace tok {

void Vocab::validate(const char* model) const {
  const size_t n = tokens.size();
  MERLIN_CHECK(n > 0, model, " tokenizer: the vocabulary is empty");
  MERLIN_CHECK(n < (size_t{1} << 31), model, " tokenizer: ", n, " tokens is too many");
  MERLIN_CHECK(types.size() == n, model, " tokenizer: ", types.size(), " token types for ", n, " tokens");
  for (const int32_t id : {bos, eos}) {
    MERLIN_CHECK(id >= -1 && id < static_cast<int64_t>(n), model, " tokenizer: special token id ", id,
                 " is outside the vocabulary of ", n, " tokens");
  }
}

StringMap<int32_t> Vocab::index() const {
  StringMap<int32_t> m;
  m.reserve(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) {
    const auto [it, fresh] = m.emplace(tokens[id], static_cast<int32_t>(id));
    // Two ids for one string would make encoding ambiguous; llama.cpp refuses such files too.
    MERLIN_CHECK(fresh, "tokenizer: duplicate token '", tokens[id], "' has ids ", it->second, " and ", id);
  }
  return m;
}

SpecialMatcher::SpecialMatcher(std::vector<Special> specials) : specials_(std::move(specials)) {
  std::erase_if(specials_, [](const Special& s) { return s.text.empty(); });
}

void SpecialMatcher::split(std::string_view text, const std::function<void(std::string_view)>& on_text,
                           const std::function<void(int32_t)>& on_special) const {
  constexpr size_t npos = std::string_view::npos;
  std::vector<size_t> next(specials_.size(), 0);  // next occurrence at or after `from`, or npos
  for (size_t k = 0; k < specials_.size(); ++k) next[k] = text.find(specials_[k].text);
  size_t from = 0;
  for (;;) {
    size_t best = npos, best_len = 0;
    int32_t best_id = -1;
    for (size_t k = 0; k < specials_.size(); ++k) {
      if (next[k] != npos && next[k] < from) next[k] = text.find(specials_[k].text, from);
      const size_t len = specials_[k].text.size();
      if (next[k] < best || (next[k] == best && next[k] != npos && len > best_len)) {
        best = next[k], best_len = len, best_id = specials_[k].id;
      }
    }
    if (best == npos) break;
    if (best > from) on_text(text.substr(from, best - from));
    on_special(best_id);
    from = best + best_len;
  }
  if (from < text.size()) on_text(text.substr(from));
}

SpecialMatcher special_tokens_of(const Vocab& v) {
  std::vector<SpecialMatcher::Special> specials;
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    const int32_t t = v.types[id];
    if (t == kTypeControl || t == kTypeUserDefined || t == kTypeUnknown) {
      specials.push_back({v.tokens[id], static_cast<int32_t>(id)});
    }
  }
  return SpecialMatcher(std::move(specials));
}

void check_utf8_input(std::string_view text) {
  const std::string err = utf8_error(text);
  if (!err.empty()) fail("invalid UTF-8 in input: ", err);
}

}  // namespace tok
}  // namespace merlin
