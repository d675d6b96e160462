// SentencePiece-style tokenizer ("llama") on the stories260K vocabulary (shared/data SOURCES.md 2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "format/gguf.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace merlin {
namespace {

using Ids = std::vector<int32_t>;

constexpr const char* kStoriesGguf = "models/stories260K/stories260K.gguf";
constexpr const char* kTok512 = "models/stories260K/tok512.bin";

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const Tokenizer* stories_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    const std::string path = test::data_file(kStoriesGguf);
    return path.empty() ? nullptr : Tokenizer::from_gguf(gguf::File::open(path)->metadata());
  }();
  return tok.get();
}

#define REQUIRE_STORIES(var)                      \
  MERLIN_REQUIRE_DATA(var##_path_, kStoriesGguf); \
  const Tokenizer& var = *stories_tokenizer()

// llama2.c's encode() (run.c), written out independently as a reference: tok512.bin's pieces use real
// spaces, a dummy " " token starts non-empty text, characters without a token become byte tokens
// (id = byte + 3) at once, then the adjacent pair with the best score merges, leftmost first.
class Llama2cReference {
 public:
  explicit Llama2cReference(const std::string& path) {
    const std::string raw = slurp(path);
    size_t off = 4;
    for (int32_t id = 0; off + 8 <= raw.size(); ++id) {
      float score;
      int32_t len;
      std::memcpy(&score, raw.data() + off, 4);
      std::memcpy(&len, raw.data() + off + 4, 4);
      pieces_.emplace(raw.substr(off + 8, len), std::make_pair(id, score));
      off += 8 + len;
    }
  }
  Ids encode(const std::string& text) const {
    std::vector<std::string> syms;
    Ids ids;
    if (!text.empty()) add(" ", syms, ids);
    for (size_t i = 0; i < text.size();) {
      size_t len = 1;
      while (i + len < text.size() && (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80) ++len;
      const std::string ch = text.substr(i, len);
      if (pieces_.count(ch)) {
        add(ch, syms, ids);
      } else {
        for (char c : ch) {
          syms.push_back(std::string(1, c));
          ids.push_back(static_cast<unsigned char>(c) + 3);
        }
      }
      i += len;
    }
    for (;;) {
      float best = -1e10f;
      int best_i = -1;
      for (size_t i = 0; i + 1 < syms.size(); ++i) {
        const auto it = pieces_.find(syms[i] + syms[i + 1]);
        if (ids[i] >= 3 && ids[i] < 259) continue;  // a byte token's piece is "<0xNN>", not the byte
        if (ids[i + 1] >= 3 && ids[i + 1] < 259) continue;
        if (it != pieces_.end() && it->second.second > best) best = it->second.second, best_i = static_cast<int>(i);
      }
      if (best_i < 0) break;
      syms[best_i] += syms[best_i + 1];
      ids[best_i] = pieces_.at(syms[best_i]).first;
      syms.erase(syms.begin() + best_i + 1);
      ids.erase(ids.begin() + best_i + 1);
    }
    return ids;
  }

 private:
  void add(const std::string& piece, std::vector<std::string>& syms, Ids& ids) const {
    syms.push_back(piece);
    ids.push_back(pieces_.at(piece).first);
  }
  std::map<std::string, std::pair<int32_t, float>> pieces_;
};

TEST(LlamaTokenizer, Properties) {
  REQUIRE_STORIES(tok);
  EXPECT_EQ(tok.model_name(), "llama");
  EXPECT_EQ(tok.vocab_size(), 512);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_TRUE(tok.add_bos());
}

TEST(LlamaTokenizer, OnceUponATimeMatchesLlama2c) {
  REQUIRE_STORIES(tok);
  // llama2.c run.c -i "Once upon a time" and llama.cpp both give BOS 403 407 261 378.
  EXPECT_EQ(tok.encode("Once upon a time"), (Ids{403, 407, 261, 378}));
  EXPECT_EQ(tok.decode({1, 403, 407, 261, 378}), "Once upon a time");
  EXPECT_EQ(tok.decode_token(403, 1), "Once");
  EXPECT_EQ(tok.decode_token(403, -1), "Once");
  EXPECT_EQ(tok.decode_token(407, 403), " upon");
  EXPECT_EQ(tok.decode_token(1), "");
  EXPECT_EQ(tok.decode_token(2, 378), "");
}

TEST(LlamaTokenizer, MatchesLlama2cReferenceLineByLine) {
  REQUIRE_STORIES(tok);
  MERLIN_REQUIRE_DATA(tok512, kTok512);
  MERLIN_REQUIRE_DATA(txt, "text/tinystories/TinyStories-valid.head201.txt");
  const Llama2cReference ref(tok512);
  std::istringstream lines(slurp(txt));
  std::string line;
  int n = 0;
  while (n < 400 && std::getline(lines, line)) {
    ASSERT_EQ(tok.encode(line, false), ref.encode(line)) << "line " << n << ": " << line;
    ++n;
  }
  EXPECT_EQ(n, 400);
  for (const std::string s : {"F\xC3\xBChrer \xF0\x9F\xA6\x99 \xE6\x88\x91", "  two  spaces ", "\ttab\n", "x"}) {
    EXPECT_EQ(tok.encode(s, false), ref.encode(s)) << s;
  }
}

TEST(LlamaTokenizer, ByteFallbackAndRoundTrip) {
  REQUIRE_STORIES(tok);
  const std::string text = "F\xC3\xBChrer \xF0\x9F\xA6\x99 \xE6\x88\x91\n\tdone.";
  const Ids ids = tok.encode(text);
  EXPECT_NE(std::find(ids.begin(), ids.end(), 3 + 0xF0), ids.end());  // <0xF0>, first byte of 🦙
  EXPECT_EQ(tok.decode_token(3 + 0xF0), "\xF0");
  EXPECT_EQ(tok.decode(ids), text);
  for (const std::string s : {"", " ", "  leading", "trailing  ", "\n", "a\n\nb"}) {
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << ::testing::PrintToString(s);
  }
  EXPECT_EQ(tok.encode(""), Ids{});
}

TEST(LlamaTokenizer, TextRoundTrip) {
  REQUIRE_STORIES(tok);
  for (const char* rel : {"text/tinystories/TinyStories-valid.head201.txt", "text/tinyshakespeare/input.txt"}) {
    MERLIN_REQUIRE_DATA(txt, rel);
    const std::string text = slurp(txt);
    const Ids ids = tok.encode(text, false);
    EXPECT_LT(ids.size(), text.size()) << rel;
    EXPECT_TRUE(tok.decode(ids) == text) << rel;
  }
}

TEST(LlamaTokenizer, SpecialTokens) {
  REQUIRE_STORIES(tok);
  // As llama.cpp with parse_special: the special token splits the text and each following fragment
  // gets its own space prefix.
  EXPECT_EQ(tok.encode("Once<s>Once", true), (Ids{403, 1, 403}));
  EXPECT_EQ(tok.encode("</s>", true), (Ids{2}));
  const Ids plain = tok.encode("<s>", false);
  EXPECT_EQ(std::find(plain.begin(), plain.end(), 1), plain.end());
  EXPECT_EQ(tok.decode(plain), "<s>");
}

TEST(LlamaTokenizer, RejectsInvalidUtf8) {
  REQUIRE_STORIES(tok);
  EXPECT_THROW(tok.encode("Once \xFF"), Error);
  EXPECT_THROW(tok.encode("\xED\xA0\x80"), Error);
  EXPECT_THROW(tok.decode_token(512), Error);
}

TEST(LlamaTokenizer, GgufMetadataRoundTrip) {
  REQUIRE_STORIES(tok);
  gguf::Metadata md;
  tok.write_gguf(md);
  EXPECT_EQ(md.at("tokenizer.ggml.model").as_string(), "llama");
  EXPECT_EQ(md.at("tokenizer.ggml.scores").as_array().type, gguf::ValueType::F32);
  EXPECT_EQ(md.at("tokenizer.ggml.unknown_token_id").as_int(), 0);
  const auto back = Tokenizer::from_gguf(md);
  EXPECT_EQ(back->bos_id(), 1);
  EXPECT_EQ(back->eos_id(), 2);
  EXPECT_TRUE(back->add_bos());
  MERLIN_REQUIRE_DATA(txt, "text/tinystories/TinyStories-valid.head201.txt");
  const std::string text = slurp(txt).substr(0, 20000) + " F\xC3\xBChrer <s>";
  EXPECT_EQ(back->encode(text, true), tok.encode(text, true));
}

TEST(LlamaTokenizer, AddSpacePrefixOff) {
  REQUIRE_STORIES(tok);
  gguf::Metadata md;
  tok.write_gguf(md);
  md.set("tokenizer.ggml.add_space_prefix", false);
  const auto raw = Tokenizer::from_gguf(md);
  const Ids ids = raw->encode("Once upon");
  EXPECT_NE(ids.front(), 403);  // "Once" without the "▁"
  EXPECT_EQ(raw->decode(ids), "Once upon");
}

// Encoding word by word is only an optimisation: a vocabulary with a "▁" inside a token turns it off, and
// both ways must agree on text that cannot reach that token.
TEST(LlamaTokenizer, WordSplittingIsExact) {
  REQUIRE_STORIES(tok);
  MERLIN_REQUIRE_DATA(txt, "text/tinystories/TinyStories-valid.head201.txt");
  gguf::Metadata md;
  tok.write_gguf(md);
  std::vector<std::string> tokens;
  for (const gguf::Value& v : md.at("tokenizer.ggml.tokens").as_array().items) tokens.push_back(v.as_string());
  std::vector<float> scores(tokens.size(), 0.0f);
  for (size_t i = 0; i < scores.size(); ++i) {
    scores[i] = static_cast<float>(md.at("tokenizer.ggml.scores").as_array().items[i].as_double());
  }
  std::vector<int32_t> types;
  for (const gguf::Value& v : md.at("tokenizer.ggml.token_type").as_array().items) {
    types.push_back(static_cast<int32_t>(v.as_int()));
  }
  tokens.push_back("\x01\xE2\x96\x81\x01");  // unreachable: "\x01" is no token, so nothing merges into it
  scores.push_back(-1e9f);
  types.push_back(1);
  md.set("tokenizer.ggml.tokens", gguf::make_array(tokens));
  md.set("tokenizer.ggml.scores", gguf::make_array(scores));
  md.set("tokenizer.ggml.token_type", gguf::make_array(types));
  const auto whole = Tokenizer::from_gguf(md);
  const std::string text = slurp(txt) + "  two  spaces   three F\xC3\xBChrer \xF0\x9F\xA6\x99\n\n end ";
  EXPECT_TRUE(whole->encode(text) == tok.encode(text));
}

TEST(LlamaTokenizer, ConformanceModelHasTheSameVocabulary) {
  REQUIRE_STORIES(tok);
  MERLIN_REQUIRE_DATA(path, "models/tiny-llama-conformance/tiny-f32.gguf");
  const auto other = Tokenizer::from_gguf(gguf::File::open(path)->metadata());
  EXPECT_EQ(other->encode("Once upon a time"), (Ids{403, 407, 261, 378}));
  EXPECT_EQ(other->encode("Lily's mom said, \"Let's go.\""), tok.encode("Lily's mom said, \"Let's go.\""));
  EXPECT_TRUE(other->add_bos());
}

}  // namespace
}  // namespace merlin
