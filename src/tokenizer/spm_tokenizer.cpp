// SentencePiece-style BPE with byte fallback (tokenizer.ggml.model = "llama"), as llama.cpp's SPM
// tokenizer: scores decide merges, and characters that no token covers become <0xNN> byte tokens.
#include <algorithm>
#include <array>
#include <cmath>

#include "core/error.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace merlin::tok {

namespace {

constexpr std::string_view kSpaceMark = "\xE2\x96\x81";  // U+2581 "▁", SentencePiece's visible space

// Candidate merge of two adjacent symbols. The highest score wins, the leftmost among equal scores,
// as in llama.cpp (llm_bigram_spm).
struct Bigram {
  int32_t left, right;
  float score;
  size_t size;  // bytes of the merged text; a stale candidate no longer adds up to it
};
bool lower_priority(const Bigram& x, const Bigram& y) {
  return x.score != y.score ? x.score < y.score : x.left > y.left;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

struct Symbol {
  int32_t prev, next;
  uint32_t start, len;  // byte range in the chunk; len 0 once merged into its left neighbour
};

// Buffers reused for every chunk of one encode() call.
struct Session {
  std::vector<Symbol> syms;
  std::vector<Bigram> heap;
};

// Whether `token` has a "▁" preceded by something other than "▁".
bool has_inner_space_mark(std::string_view token) {
  for (size_t p = token.find(kSpaceMark, 1); p != std::string_view::npos; p = token.find(kSpaceMark, p + 1)) {
    if (p < kSpaceMark.size() || token.compare(p - kSpaceMark.size(), kSpaceMark.size(), kSpaceMark) != 0) {
      return true;
    }
  }
  return false;
}

class SpmTokenizer final : public Tokenizer {
 public:
  SpmTokenizer(Vocab v, std::vector<float> scores, int32_t unk, bool add_space_prefix);

  std::vector<int32_t> encode(std::string_view text, bool allow_special) const override;
  std::string decode_token(int32_t id, int32_t prev) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(v_.tokens.size()); }
  int32_t bos_id() const override { return v_.bos; }
  int32_t eos_id() const override { return v_.eos; }
  bool add_bos() const override { return v_.add_bos; }
  std::string model_name() const override { return "llama"; }
  void write_gguf(gguf::Metadata& md) const override;

 private:
  void encode_fragment(std::string_view text, bool space_prefix, std::vector<int32_t>& out) const;
  void encode_chunk(std::string_view text, Session& s, std::vector<int32_t>& out) const;
  void try_add_bigram(std::string_view text, Session& s, int32_t left) const;
  void emit_symbol(std::string_view piece, std::vector<int32_t>& out) const;

  Vocab v_;
  std::vector<float> scores_;
  int32_t unk_;
  bool add_space_prefix_;
  StringMap<int32_t> index_;
  std::array<int32_t, 256> byte_token_{};  // -1 where the vocabulary has no <0xNN>
  std::vector<int16_t> token_byte_;        // the byte of each byte token, -1 for others
  SpecialMatcher specials_;
  // No token has a "▁" right after another character, so no merge crosses the start of a word (a "▁"
  // run after other text) and each word can be merged on its own: the same result as merging the whole
  // fragment at once, with work and memory bounded by the word instead of the text.
  bool split_words_ = false;
};

SpmTokenizer::SpmTokenizer(Vocab v, std::vector<float> scores, int32_t unk, bool add_space_prefix)
    : v_(std::move(v)), scores_(std::move(scores)), unk_(unk), add_space_prefix_(add_space_prefix) {
  v_.validate("llama");
  const auto n = static_cast<int32_t>(v_.tokens.size());
  MERLIN_CHECK(scores_.size() == v_.tokens.size(), "llama tokenizer: ", scores_.size(), " scores for ", n, " tokens");
  MERLIN_CHECK(unk_ >= -1 && unk_ < n, "llama tokenizer: unknown token id ", unk_, " is out of range");
  // A NaN would break the merge queue's ordering.
  MERLIN_CHECK(std::none_of(scores_.begin(), scores_.end(), [](float x) { return std::isnan(x); }),
               "llama tokenizer: tokenizer.ggml.scores contains NaN");
  index_ = v_.index();
  byte_token_.fill(-1);
  token_byte_.assign(n, -1);
  for (int32_t id = 0; id < n; ++id) {
    if (v_.types[id] != kTypeByte) continue;
    const std::string& t = v_.tokens[id];
    const int hi = t.size() == 6 ? hex_digit(t[3]) : -1, lo = t.size() == 6 ? hex_digit(t[4]) : -1;
    if (t.compare(0, 3, "<0x") != 0 || hi < 0 || lo < 0 || t[5] != '>') {
      fail("llama tokenizer: byte token ", id, " '", t, "' is not spelled <0xNN>");
    }
    const int value = hi * 16 + lo;
    token_byte_[id] = static_cast<int16_t>(value);
    if (byte_token_[value] < 0) byte_token_[value] = id;
  }
  specials_ = special_tokens_of(v_);
  split_words_ = std::none_of(v_.tokens.begin(), v_.tokens.end(), has_inner_space_mark);
}

std::vector<int32_t> SpmTokenizer::encode(std::string_view text, bool allow_special) const {
  check_utf8_input(text);
  std::vector<int32_t> out;
  if (!allow_special || specials_.empty()) {
    if (!text.empty()) encode_fragment(text, add_space_prefix_, out);
    return out;
  }
  // llama.cpp prefixes a space to the first fragment and to every fragment that follows a special token.
  bool after_special = true;
  specials_.split(
      text,
      [&](std::string_view part) {
        encode_fragment(part, add_space_prefix_ && after_special, out);
        after_special = false;
      },
      [&](int32_t id) {
        out.push_back(id);
        after_special = true;
      });
  return out;
}

void SpmTokenizer::encode_fragment(std::string_view raw, bool space_prefix, std::vector<int32_t>& out) const {
  std::string text;
  text.reserve(raw.size() + raw.size() / 2 + 3);
  if (space_prefix) text += kSpaceMark;
  for (char c : raw) {
    if (c == ' ') {
      text += kSpaceMark;
    } else {
      text += c;
    }
  }
  Session s;
  const std::string_view all(text);
  if (!split_words_) {
    encode_chunk(all, s, out);
    return;
  }
  size_t start = 0;
  for (size_t p = all.find(kSpaceMark, 1); p != std::string_view::npos; p = all.find(kSpaceMark, p + 1)) {
    const bool after_mark =
        p >= kSpaceMark.size() && all.substr(p - kSpaceMark.size(), kSpaceMark.size()) == kSpaceMark;
    if (after_mark || p == start) continue;
    encode_chunk(all.substr(start, p - start), s, out);
    start = p;
  }
  encode_chunk(all.substr(start), s, out);
}

void SpmTokenizer::encode_chunk(std::string_view text, Session& s, std::vector<int32_t>& out) const {
  MERLIN_CHECK(text.size() < (size_t{1} << 31), "llama tokenizer: a word of ", text.size(), " bytes is too long");
  std::vector<Symbol>& syms = s.syms;
  syms.clear();
  s.heap.clear();
  for (size_t i = 0; i < text.size();) {
    const size_t len = std::min<size_t>(utf8_len(static_cast<unsigned char>(text[i])), text.size() - i);
    const auto idx = static_cast<int32_t>(syms.size());
    syms.push_back(
        {idx - 1, i + len < text.size() ? idx + 1 : -1, static_cast<uint32_t>(i), static_cast<uint32_t>(len)});
    i += len;
  }
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) try_add_bigram(text, s, i);
  while (!s.heap.empty()) {
    std::pop_heap(s.heap.begin(), s.heap.end(), lower_priority);
    const Bigram b = s.heap.back();
    s.heap.pop_back();
    Symbol& l = syms[b.left];
    Symbol& r = syms[b.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.size) continue;  // a side merged since
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = b.left;
    if (l.prev >= 0) try_add_bigram(text, s, l.prev);
    try_add_bigram(text, s, b.left);
  }
  for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) {
    emit_symbol(text.substr(syms[i].start, syms[i].len), out);
  }
}

void SpmTokenizer::try_add_bigram(std::string_view text, Session& s, int32_t left) const {
  const int32_t right = s.syms[left].next;
  if (right < 0) return;
  const size_t size = s.syms[left].len + s.syms[right].len;
  const auto it = index_.find(text.substr(s.syms[left].start, size));
  if (it == index_.end()) return;
  s.heap.push_back({left, right, scores_[it->second], size});
  std::push_heap(s.heap.begin(), s.heap.end(), lower_priority);
}

void SpmTokenizer::emit_symbol(std::string_view piece, std::vector<int32_t>& out) const {
  if (const auto it = index_.find(piece); it != index_.end()) {
    out.push_back(it->second);
    return;
  }
  for (char c : piece) {
    int32_t id = byte_token_[static_cast<unsigned char>(c)];
    if (id < 0) id = unk_;
    MERLIN_CHECK(id >= 0, "llama tokenizer: no byte token and no unknown token for byte ",
                 int(static_cast<unsigned char>(c)));
    out.push_back(id);
  }
}

std::string SpmTokenizer::decode_token(int32_t id, int32_t prev) const {
  MERLIN_CHECK(id >= 0 && id < vocab_size(), "token id ", id, " is outside the vocabulary (", vocab_size(), " tokens)");
  switch (v_.types[id]) {
    case kTypeNormal: {
      const std::string& t = v_.tokens[id];
      std::string piece;
      piece.reserve(t.size());
      for (size_t i = 0; i < t.size();) {
        if (t.compare(i, kSpaceMark.size(), kSpaceMark) == 0) {
          piece += ' ';
          i += kSpaceMark.size();
        } else {
          piece += t[i++];
        }
      }
      // The space encode() prefixed is not part of the text (llama2.c strips it after BOS).
      if (add_space_prefix_ && (prev == -1 || prev == v_.bos) && !piece.empty() && piece[0] == ' ') {
        piece.erase(0, 1);
      }
      return piece;
    }
    case kTypeByte:
      return std::string(1, static_cast<char>(token_byte_[id]));
    case kTypeUserDefined:
      return v_.tokens[id];
    default:  // control, unknown, unused: nothing in running text, as llama.cpp without `special`
      return {};
  }
}

void SpmTokenizer::write_gguf(gguf::Metadata& md) const {
  md.set("tokenizer.ggml.model", "llama");
  md.set("tokenizer.ggml.tokens", gguf::make_array(v_.tokens));
  md.set("tokenizer.ggml.scores", gguf::make_array(scores_));
  md.set("tokenizer.ggml.token_type", gguf::make_array(v_.types));
  if (v_.bos >= 0) md.set("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(v_.bos));
  if (v_.eos >= 0) md.set("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(v_.eos));
  if (unk_ >= 0) md.set("tokenizer.ggml.unknown_token_id", static_cast<uint32_t>(unk_));
  md.set("tokenizer.ggml.add_bos_token", v_.add_bos);
  md.set("tokenizer.ggml.add_space_prefix", add_space_prefix_);
}

}  // namespace

std::unique_ptr<Tokenizer> make_spm(Vocab v, std::vector<float> scores, int32_t unk, bool add_space_prefix) {
  return std::make_unique<SpmTokenizer>(std::move(v), std::move(scores), unk, add_space_prefix);
}

}  // namespace merlin::tok
