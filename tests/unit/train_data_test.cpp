// `merlin prepare` and the token shards: document splitting in every format, bad inputs, the shard
// format, and the batch sampler.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"
#include "train/prepare.h"
#include "train/tokens.h"

namespace merlin::train {
namespace {

using Docs = std::vector<std::string>;

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TrainSplit, EndOfTextSeparatedStripsWhitespaceAndSkipsEmptyDocuments) {
  const std::string text = "One day.\nThe end.\n<|endoftext|>\n  Second  \n<|endoftext|>\n\n<|endoftext|>\n";
  EXPECT_EQ(split_documents(text, TextFormat::Eot, "x"), (Docs{"One day.\nThe end.", "Second"}));
  EXPECT_EQ(detect_text_format(text), TextFormat::Eot);
}

TEST(TrainSplit, JsonLines) {
  const std::string text = "{\"text\": \"first \\u00e9\"}\n\n{\"story\": \"second\", \"id\": 3}\r\n";
  EXPECT_EQ(detect_text_format(text), TextFormat::Jsonl);
  EXPECT_EQ(split_documents(text, TextFormat::Auto, "x"), (Docs{"first \xc3\xa9", "second"}));
  EXPECT_NE(error_of([] { split_documents("{\"text\": \"a\"}\n{\"title\": 1}\n", TextFormat::Jsonl, "f.jsonl"); })
                .find("f.jsonl line 2"),
            std::string::npos);
  // A lone surrogate escape is invalid JSON (it could not become UTF-8).
  EXPECT_NE(error_of([] { split_documents("{\"text\": \"\\ud800\"}\n", TextFormat::Jsonl, "f"); }).find("f line 1"),
            std::string::npos);
}

TEST(TrainSplit, OneDocumentPerLine) {
  const std::string text = "first line\n\nsecond line\n";
  EXPECT_EQ(detect_text_format(text), TextFormat::Lines);
  EXPECT_EQ(split_documents(text, TextFormat::Auto, "x"), (Docs{"first line", "second line"}));
  EXPECT_EQ(split_documents("a<|endoftext|>b\nc", TextFormat::Lines, "x"), (Docs{"a<|endoftext|>b", "c"}));
}

TEST(TrainSplit, InvalidUtf8IsRefusedWithItsOffset) {
  const std::string msg = error_of([] { split_documents("ok \xc3\x28 no", TextFormat::Auto, "bad.txt"); });
  EXPECT_NE(msg.find("bad.txt: invalid UTF-8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("offset 3"), std::string::npos) << msg;
}

TEST(TrainSplit, FormatNames) {
  EXPECT_EQ(parse_text_format("jsonl"), TextFormat::Jsonl);
  EXPECT_THROW(parse_text_format("csv"), Error);
}

class TrainPrepare : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string vocab = test::data_file("tokenizer/gpt2/encoder.json");
    if (vocab.empty()) GTEST_SKIP() << "GPT-2 vocabulary not found under " << test::data_dir();
    const std::string d = test::data_dir() + "/tokenizer/gpt2/";
    tok_ = Tokenizer::from_gpt2_files(d + "encoder.json", d + "vocab.bpe");
  }
  PrepareOptions options(std::vector<std::string> inputs) const {
    PrepareOptions o;
    o.inputs = std::move(inputs);
    o.out_dir = dir_.file("out");
    o.progress = false;
    o.threads = 2;
    return o;
  }
  std::vector<uint16_t> expected_tokens(const Docs& docs) const {
    std::vector<uint16_t> out;
    for (const std::string& d : docs) {
      out.push_back(kGpt2EndOfText);
      for (int32_t id : tok_->encode(d, false)) out.push_back((uint16_t)id);
    }
    return out;
  }
  static std::vector<uint16_t> shard_tokens(const std::string& path) {
    const TokenShard s(path);
    return std::vector<uint16_t>(s.tokens(), s.tokens() + s.size());
  }
  test::TempDir dir_;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(TrainPrepare, WritesTrainAndValidationShards) {
  write_file(dir_.file("a.txt"), "Once upon a time.\n<|endoftext|>\nThe cat sat.\n<|endoftext|>\n");
  write_file(dir_.file("b.jsonl"), "{\"text\": \"Lily found a needle.\"}\n{\"text\": \"Tom ran \\u2014 fast.\"}\n");
  PrepareOptions o = options({dir_.file("a.txt"), dir_.file("b.jsonl")});
  o.val_fraction = 0.25;
  const PrepareSummary s = prepare_data(o, *tok_);
  EXPECT_EQ(s.train.documents, 3u);
  EXPECT_EQ(s.val.documents, 1u);
  ASSERT_EQ(s.train.files.size(), 1u);
  EXPECT_EQ(shard_tokens(s.train.files[0]),
            expected_tokens({"Once upon a time.", "The cat sat.", "Lily found a needle."}));
  EXPECT_EQ(shard_tokens(s.val.files[0]), expected_tokens({"Tom ran \xe2\x80\x94 fast."}));
  const TokenShard shard(s.train.files[0]);
  EXPECT_EQ(shard.header().tokenizer, "gpt2");
  EXPECT_EQ(shard.header().vocab_size, 50257u);
  EXPECT_EQ(shard.header().n_documents, 3u);
  EXPECT_EQ(shard.header().n_text_bytes, std::string("Once upon a time.The cat sat.Lily found a needle.").size());
  EXPECT_EQ(s.train.tokens, shard.size());
}

TEST_F(TrainPrepare, SeparateValidationFileAndSmallShards) {
  std::string text;
  for (int i = 0; i < 40; ++i) text += "Story number " + std::to_string(i) + " is short.\n";
  write_file(dir_.file("train.txt"), text);
  write_file(dir_.file("val.txt"), "A held-out story.\n");
  PrepareOptions o = options({dir_.file("train.txt")});
  o.val_input = dir_.file("val.txt");
  o.shard_tokens = 50;
  const PrepareSummary s = prepare_data(o, *tok_);
  EXPECT_EQ(s.train.documents, 40u);
  EXPECT_GT(s.train.files.size(), 3u);
  EXPECT_EQ(s.val.documents, 1u);
  const TokenDataset train = TokenDataset::open(o.out_dir, "train");
  EXPECT_EQ(train.shards().size(), s.train.files.size());
  EXPECT_EQ(train.n_tokens(), s.train.tokens);
  EXPECT_NEAR(train.bytes_per_token(), (double)s.train.bytes / (double)s.train.tokens, 1e-12);
  // Running again replaces the old shards instead of mixing with them.
  o.shard_tokens = 1 << 20;
  prepare_data(o, *tok_);
  EXPECT_EQ(TokenDataset::open(o.out_dir, "train").shards().size(), 1u);
}

TEST_F(TrainPrepare, BadInputsGiveClearErrors) {
  write_file(dir_.file("empty.txt"), "");
  write_file(dir_.file("blank.txt"), "\n \n<|endoftext|>\n");
  write_file(dir_.file("latin1.txt"), "caf\xe9\n");
  write_file(dir_.file("one.txt"), "just one document\n");
  auto err = [&](const std::string& file) { return error_of([&] { prepare_data(options({dir_.file(file)}), *tok_); }); };
  EXPECT_NE(err("empty.txt").find("empty"), std::string::npos) << err("empty.txt");
  EXPECT_NE(err("blank.txt").find("no documents"), std::string::npos) << err("blank.txt");
  EXPECT_NE(err("latin1.txt").find("invalid UTF-8"), std::string::npos) << err("latin1.txt");
  EXPECT_NE(err("missing.txt").find("no such file"), std::string::npos) << err("missing.txt");
  EXPECT_NE(err("one.txt").find("only one document"), std::string::npos) << err("one.txt");
}

TEST(TrainShard, CorruptShardsAreRefused) {
  test::TempDir dir;
  const std::vector<uint16_t> t = {1, 2, 3, 4};
  write_shard(dir.file("ok.tok"), ShardHeader{4, 1, 10, 50257, "gpt2"}, t.data(), t.size());
  std::string bytes;
  {
    std::ifstream in(dir.file("ok.tok"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  write_file(dir.file("short.tok"), bytes.substr(0, bytes.size() - 1));
  write_file(dir.file("magic.tok"), "XXXXXXXX" + bytes.substr(8));
  EXPECT_EQ(TokenShard(dir.file("ok.tok")).size(), 4u);
  EXPECT_NE(error_of([&] { TokenShard s(dir.file("short.tok")); }).find("truncated"), std::string::npos);
  EXPECT_NE(error_of([&] { TokenShard s(dir.file("magic.tok")); }).find("not a token shard"), std::string::npos);
  EXPECT_NE(error_of([&] { TokenDataset::open(dir.path(), "train"); }).find("no train-*.tok"), std::string::npos);
}

TEST(TrainShard, SamplerIsSeededAndResumable) {
  test::TempDir dir;
  std::vector<uint16_t> a(300), b(50);
  for (size_t i = 0; i < a.size(); ++i) a[i] = (uint16_t)i;
  for (size_t i = 0; i < b.size(); ++i) b[i] = (uint16_t)(1000 + i);
  write_shard(dir.file("train-00000.tok"), ShardHeader{300, 1, 0, 2000, "gpt2"}, a.data(), a.size());
  write_shard(dir.file("train-00001.tok"), ShardHeader{50, 1, 0, 2000, "gpt2"}, b.data(), b.size());
  const TokenDataset d = TokenDataset::open(dir.path(), "train");
  const int64_t seq = 16, batch = 4;
  BatchSampler s1(d, seq, batch, 2000, 7), s2(d, seq, batch, 2000, 7);
  std::vector<int32_t> x(batch * (seq + 1)), y(x.size());
  for (int i = 0; i < 20; ++i) {
    s1.next(x.data());
    s2.next(y.data());
    ASSERT_EQ(x, y);
    for (int64_t r = 0; r < batch; ++r)  // windows are consecutive tokens of one shard
      for (int64_t t = 1; t <= seq; ++t) ASSERT_EQ(x[r * (seq + 1) + t], x[r * (seq + 1) + t - 1] + 1);
  }
  const Rng::State st = s1.state();
  s1.next(x.data());
  s2.set_state(st);
  s2.next(y.data());
  EXPECT_EQ(x, y);
  EXPECT_EQ(eval_windows(d, seq), (uint64_t)(299 / 16 + 49 / 16));
  copy_eval_window(d, seq, 299 / 16, 2000, x.data());  // the first window of the second shard
  EXPECT_EQ(x[0], 1000);
}

}  // namespace
}  // namespace merlin::train
