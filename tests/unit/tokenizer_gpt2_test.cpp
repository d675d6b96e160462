// GPT-2 byte-level BPE against tiktoken's and llama.cpp's reference encodings (shared/data SOURCES.md 1).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "format/gguf.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace merlin {
namespace {

using Ids = std::vector<int32_t>;

constexpr const char* kEncoderJson = "tokenizer/gpt2/encoder.json";
constexpr const char* kVocabBpe = "tokenizer/gpt2/vocab.bpe";
constexpr const char* kVocabGguf = "tokenizer/llama.cpp-ggml-vocab-gpt-2/ggml-vocab-gpt-2.gguf";
constexpr const char* kStories[] = {
    "text/tinystories/TinyStories-train.head2MiB",
    "text/tinystories/TinyStoriesV2-GPT4-train.head10klines",
    "text/tinystories/TinyStories-valid.head1000.hfsplit",
    "text/tinystories/TinyStories-valid.head201",
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Ids read_u16le(const std::string& path) {
  const std::string raw = slurp(path);
  Ids ids(raw.size() / 2);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = static_cast<uint8_t>(raw[2 * i]) | (static_cast<uint8_t>(raw[2 * i + 1]) << 8);
  }
  return ids;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) s.replace(p, from.size(), to);
  return s;
}

// The tokenizer from encoder.json + vocab.bpe, built once for the whole file (it takes ~0.1 s).
const Tokenizer* gpt2_from_files() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    const std::string enc = test::data_file(kEncoderJson), bpe = test::data_file(kVocabBpe);
    return enc.empty() || bpe.empty() ? nullptr : Tokenizer::from_gpt2_files(enc, bpe);
  }();
  return tok.get();
}

#define REQUIRE_GPT2(var)                        \
  MERLIN_REQUIRE_DATA(var##_enc_, kEncoderJson); \
  MERLIN_REQUIRE_DATA(var##_bpe_, kVocabBpe);    \
  const Tokenizer& var = *gpt2_from_files()

struct VocabCase {
  std::string text;
  Ids ids;
};

// llama.cpp's test-tokenizer-0 files: inputs separated by "\n__ggml_vocab_test__\n", one output line each.
std::vector<VocabCase> read_vocab_cases(const std::string& inp_path, const std::string& out_path) {
  const std::string inp = slurp(inp_path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<VocabCase> cases;
  for (size_t pos = 0, next; (next = inp.find(sep, pos)) != std::string::npos; pos = next + sep.size()) {
    cases.push_back({inp.substr(pos, next - pos), {}});
  }
  std::istringstream out(slurp(out_path));
  std::string line;
  for (VocabCase& c : cases) {
    if (!std::getline(out, line)) break;
    std::istringstream ids(line);
    for (int32_t id; ids >> id;) c.ids.push_back(id);
  }
  return cases;
}

void expect_vocab_cases(const Tokenizer& tok) {
  MERLIN_REQUIRE_DATA(inp, std::string(kVocabGguf) + ".inp");
  MERLIN_REQUIRE_DATA(out, std::string(kVocabGguf) + ".out");
  const std::vector<VocabCase> cases = read_vocab_cases(inp, out);
  ASSERT_EQ(cases.size(), 46u);
  for (const VocabCase& c : cases) {
    const Ids ids = tok.encode(c.text, false);
    EXPECT_EQ(ids, c.ids) << "text: " << ::testing::PrintToString(c.text);
    EXPECT_EQ(tok.decode(ids), c.text);
  }
}

std::unique_ptr<Tokenizer> gpt2_from_vocab_gguf(const std::string& path) {
  const auto file = gguf::File::open(path);
  return Tokenizer::from_gguf(file->metadata());
}

TEST(Gpt2Tokenizer, Properties) {
  REQUIRE_GPT2(tok);
  EXPECT_EQ(tok.model_name(), "gpt2");
  EXPECT_EQ(tok.vocab_size(), 50257);
  EXPECT_EQ(tok.bos_id(), 50256);
  EXPECT_EQ(tok.eos_id(), 50256);
  EXPECT_FALSE(tok.add_bos());
}

TEST(Gpt2Tokenizer, LlamaCppVocabCasesFromOpenAiFiles) {
  REQUIRE_GPT2(tok);
  expect_vocab_cases(tok);
}

TEST(Gpt2Tokenizer, LlamaCppVocabCasesFromGguf) {
  MERLIN_REQUIRE_DATA(path, kVocabGguf);
  const auto tok = gpt2_from_vocab_gguf(path);
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->bos_id(), 50256);
  EXPECT_FALSE(tok->add_bos());
  expect_vocab_cases(*tok);
}

TEST(Gpt2Tokenizer, TinyStoriesMatchTiktoken) {
  REQUIRE_GPT2(tok);
  for (const char* stem : kStories) {
    MERLIN_REQUIRE_DATA(txt, std::string(stem) + ".txt");
    MERLIN_REQUIRE_DATA(bin, std::string(stem) + ".gpt2.u16le.bin");
    const std::string text = slurp(txt);
    const Ids want = read_u16le(bin);
    const Ids got = tok.encode(text, true);
    ASSERT_EQ(got.size(), want.size()) << stem;
    size_t first_diff = 0;
    while (first_diff < got.size() && got[first_diff] == want[first_diff]) ++first_diff;
    EXPECT_EQ(first_diff, got.size()) << stem << ": first difference at token " << first_diff;
  }
}

TEST(Gpt2Tokenizer, TinyStoriesFromGgufMatchTiktoken) {
  MERLIN_REQUIRE_DATA(path, kVocabGguf);
  const auto tok = gpt2_from_vocab_gguf(path);
  for (const char* stem : {kStories[2], kStories[3]}) {
    MERLIN_REQUIRE_DATA(txt, std::string(stem) + ".txt");
    MERLIN_REQUIRE_DATA(bin, std::string(stem) + ".gpt2.u16le.bin");
    EXPECT_TRUE(tok->encode(slurp(txt), true) == read_u16le(bin)) << stem;
  }
}

TEST(Gpt2Tokenizer, TinyStoriesRoundTrip) {
  REQUIRE_GPT2(tok);
  for (const char* stem : kStories) {
    MERLIN_REQUIRE_DATA(txt, std::string(stem) + ".txt");
    const std::string text = slurp(txt);
    EXPECT_TRUE(tok.decode(tok.encode(text, false)) == text) << stem;
    // With allow_special, "<|endoftext|>" becomes the control token, which decodes to nothing.
    EXPECT_TRUE(tok.decode(tok.encode(text, true)) == replace_all(text, "<|endoftext|>", "")) << stem;
  }
}

TEST(Gpt2Tokenizer, SpecialTokens) {
  REQUIRE_GPT2(tok);
  EXPECT_EQ(tok.encode("a<|endoftext|>b", true), (Ids{64, 50256, 65}));
  EXPECT_EQ(tok.encode("<|endoftext|><|endoftext|>", true), (Ids{50256, 50256}));
  // Ordinary text: "<", "|", "end", "of", "text", "|", ">" as tiktoken encode_ordinary gives.
  EXPECT_EQ(tok.encode("<|endoftext|>", false), (Ids{27, 91, 437, 1659, 5239, 91, 29}));
  // The regex runs on each side separately: the trailing "\n " is not split against the special token.
  EXPECT_EQ(tok.encode("x \n<|endoftext|>", true), (Ids{87, 220, 198, 50256}));
  EXPECT_EQ(tok.decode_token(50256), "");
  EXPECT_EQ(tok.decode_token(220), " ");
  EXPECT_EQ(tok.encode("", true), Ids{});
}

TEST(Gpt2Tokenizer, RejectsInvalidUtf8) {
  REQUIRE_GPT2(tok);
  for (const std::string bad : {"abc\xFF", "\xC0\x80", "\xED\xA0\x80", "caf\xC3"}) {
    try {
      tok.encode(bad);
      ADD_FAILURE() << "accepted " << ::testing::PrintToString(bad);
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("invalid UTF-8 in input: ", 0), 0u) << e.what();
    }
  }
  EXPECT_THROW(tok.decode_token(50257), Error);
  EXPECT_THROW(tok.decode_token(-1), Error);
}

TEST(Gpt2Tokenizer, DecodesPartialUtf8PerToken) {
  REQUIRE_GPT2(tok);
  // 🦙 is four bytes split over tokens; decode_token may return incomplete UTF-8, decode() joins them.
  const std::string llama = "\xF0\x9F\xA6\x99";
  const Ids ids = tok.encode(llama);
  ASSERT_GT(ids.size(), 1u);
  EXPECT_NE(utf8_error(tok.decode_token(ids[0])), "");
  EXPECT_EQ(tok.decode(ids), llama);
}

TEST(Gpt2Tokenizer, LongPiecesStayFast) {
  REQUIRE_GPT2(tok);
  // Single regex pieces of a megabyte: the merge loop must not be quadratic.
  for (const std::string& text : {std::string(1 << 20, '7'), std::string(1 << 20, ' ') + "x", std::string(1 << 19, '!'),
                                  std::string(1 << 18, 'a')}) {
    const Ids ids = tok.encode(text);
    EXPECT_LT(ids.size(), text.size());
    EXPECT_TRUE(tok.decode(ids) == text);
  }
}

TEST(Gpt2Tokenizer, ConcurrentEncodesAgree) {
  REQUIRE_GPT2(tok);
  MERLIN_REQUIRE_DATA(txt, std::string(kStories[3]) + ".txt");
  const std::string text = slurp(txt);
  const Ids want = tok.encode(text);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (Ids& g : got) threads.emplace_back([&] { g = tok.encode(text); });
  for (std::thread& t : threads) t.join();
  for (const Ids& g : got) EXPECT_TRUE(g == want);
}

TEST(Gpt2Tokenizer, GgufMetadataRoundTrip) {
  REQUIRE_GPT2(tok);
  gguf::Metadata md;
  tok.write_gguf(md);
  EXPECT_EQ(md.at("tokenizer.ggml.model").as_string(), "gpt2");
  EXPECT_EQ(md.at("tokenizer.ggml.pre").as_string(), "gpt-2");
  EXPECT_EQ(md.at("tokenizer.ggml.merges").as_array().items.size(), 50000u);
  EXPECT_EQ(md.at("tokenizer.ggml.token_type").as_array().items[50256].as_int(), 3);
  EXPECT_EQ(md.at("tokenizer.ggml.token_type").as_array().items[0].as_int(), 1);
  EXPECT_EQ(md.at("tokenizer.ggml.bos_token_id").type(), gguf::ValueType::U32);
  const auto back = Tokenizer::from_gguf(md);
  EXPECT_EQ(back->vocab_size(), tok.vocab_size());
  EXPECT_EQ(back->bos_id(), tok.bos_id());
  EXPECT_EQ(back->eos_id(), tok.eos_id());
  EXPECT_EQ(back->add_bos(), tok.add_bos());
  const std::string text = "Hello, y'all! <|endoftext|> How are you \xF0\x9F\x98\x81 ?\xE6\x88\x91\n\n  x";
  EXPECT_EQ(back->encode(text, true), tok.encode(text, true));
  EXPECT_EQ(back->encode(text, false), tok.encode(text, false));
  MERLIN_REQUIRE_DATA(txt, std::string(kStories[3]) + ".txt");
  const std::string story = slurp(txt);
  EXPECT_TRUE(back->encode(story) == tok.encode(story));
}

TEST(Gpt2Tokenizer, GgufFileRoundTrip) {
  REQUIRE_GPT2(tok);
  test::TempDir dir;
  const std::string path = dir.file("vocab.gguf");
  {
    gguf::Writer w(path);
    tok.write_gguf(w.metadata());
    w.finish();
  }
  const auto back = gpt2_from_vocab_gguf(path);
  const std::string text = "The quick brown fox<|endoftext|> jumps  over\tthe lazy dog 1234567.";
  EXPECT_EQ(back->encode(text, true), tok.encode(text, true));
}

TEST(Gpt2Tokenizer, RejectsBadMetadata) {
  REQUIRE_GPT2(tok);
  gguf::Metadata md;
  tok.write_gguf(md);
  gguf::Metadata other_pre = md;
  other_pre.set("tokenizer.ggml.pre", "llama-bpe");
  EXPECT_THROW(Tokenizer::from_gguf(other_pre), Error);
  gguf::Metadata bad_bos = md;
  bad_bos.set("tokenizer.ggml.bos_token_id", uint32_t{60000});
  EXPECT_THROW(Tokenizer::from_gguf(bad_bos), Error);
  gguf::Metadata bad_merge = md;
  bad_merge.set("tokenizer.ggml.merges", gguf::make_array(std::vector<std::string>{"Ġ t", "nosuch token"}));
  EXPECT_THROW(Tokenizer::from_gguf(bad_merge), Error);
  gguf::Metadata no_model = md;
  no_model.set("tokenizer.ggml.model", "bert");
  EXPECT_THROW(Tokenizer::from_gguf(no_model), Error);
  EXPECT_THROW(Tokenizer::from_gguf(gguf::Metadata{}), Error);
  EXPECT_THROW(Tokenizer::from_gpt2_files("/nonexistent/encoder.json", "/nonexistent/vocab.bpe"), Error);
}

}  // namespace
}  // namespace merlin
