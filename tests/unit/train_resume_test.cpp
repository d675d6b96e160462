// The training loop end to end on a tiny model: resumed runs reproduce uninterrupted ones bit for bit,
// and bad checkpoints, too little data and divergence fail with clear errors.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/tokens.h"
#include "train/trainer.h"

namespace merlin::train {
namespace {

namespace fs = std::filesystem;

// Token data with some structure (a noisy cycle) so the loss actually falls.
void write_tokens(const std::string& path, uint64_t n, uint64_t seed) {
  Rng r(seed);
  std::vector<uint16_t> t(n);
  for (uint64_t i = 0; i < n; ++i) t[i] = (uint16_t)(r.below(4) == 0 ? r.below(64) : (i * 7) % 64);
  write_shard(path, ShardHeader{n, 1, n * 4, 64, "gpt2"}, t.data(), n);
}

TrainOptions tiny_options(const test::TempDir& dir, const std::string& out) {
  TrainOptions o;
  o.model.dim = 16;
  o.model.n_layers = 2;
  o.model.n_heads = 4;
  o.model.n_kv_heads = 2;
  o.model.ffn_dim = 32;
  o.model.vocab_size = 64;
  o.model.context_length = 16;
  o.data = dir.file("data");
  o.out_dir = dir.file(out);
  o.batch = 4;
  o.seq = 16;
  o.accum = 2;
  o.optim.steps = 8;
  o.optim.warmup = 2;
  o.optim.lr = 1e-2;
  o.optim.min_lr = 1e-3;
  o.optim.grad_clip = 0.5;
  o.eval_every = 2;
  o.eval_tokens = 64;
  o.ckpt_every = 4;
  o.keep_checkpoints = 0;
  o.seed = 5;
  o.threads = 2;
  o.progress = false;
  return o;
}

class TrainRun : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(dir_.file("data"));
    write_tokens(dir_.file("data/train-00000.tok"), 5000, 1);
    write_tokens(dir_.file("data/val-00000.tok"), 600, 2);
  }
  // Records without the wall-clock fields, which legitimately differ between runs.
  static std::vector<std::string> records(const std::string& path, uint64_t after_step = 0) {
    std::vector<std::string> out;
    for (nlohmann::ordered_json j : read_metrics(path)) {
      if (j["step"].get<uint64_t>() <= after_step && after_step > 0) continue;
      j.erase("elapsed");
      j.erase("tokens_per_s");
      out.push_back(j.dump());
    }
    return out;
  }
  test::TempDir dir_;
};

TEST_F(TrainRun, LossFallsAndCheckpointsAreWritten) {
  TrainOptions o = tiny_options(dir_, "run");
  o.optim.steps = 30;
  o.ckpt_every = 10;
  o.keep_checkpoints = 2;
  const TrainResult r = train_model(o);
  EXPECT_EQ(r.steps_done, 30u);
  const std::vector<nlohmann::ordered_json> m = read_metrics(o.out_dir + "/metrics.jsonl");
  ASSERT_TRUE(m.front().contains("val_loss"));  // step 0 is evaluated before training
  EXPECT_LT(r.last_val_loss, m.front()["val_loss"].get<double>() - 0.5);
  EXPECT_TRUE(fs::exists(o.out_dir + "/ckpt-000030.ckpt"));
  EXPECT_TRUE(fs::exists(o.out_dir + "/ckpt-000020.ckpt"));
  EXPECT_FALSE(fs::exists(o.out_dir + "/ckpt-000010.ckpt"));  // only the newest two are kept
  EXPECT_EQ(latest_checkpoint(o.out_dir), o.out_dir + "/ckpt-000030.ckpt");
}

TEST_F(TrainRun, ResumeReproducesTheUninterruptedRunBitForBit) {
  const TrainOptions full = tiny_options(dir_, "full");
  train_model(full);
  TrainOptions half = tiny_options(dir_, "resumed");
  half.resume = full.out_dir + "/ckpt-000004.ckpt";
  train_model(half);
  EXPECT_EQ(records(full.out_dir + "/metrics.jsonl", 4), records(half.out_dir + "/metrics.jsonl"));
  const Checkpoint a = load_checkpoint(full.out_dir + "/ckpt-000008.ckpt");
  const Checkpoint b = load_checkpoint(half.out_dir + "/ckpt-000008.ckpt");
  EXPECT_TRUE(a.params == b.params);
  EXPECT_TRUE(a.m == b.m);
  EXPECT_TRUE(a.v == b.v);
  EXPECT_EQ(std::memcmp(&a.state.data_rng, &b.state.data_rng, sizeof a.state.data_rng), 0);
}

// Dropout masks come from (seed, step, micro-batch): a resumed run draws the same ones. They also change the
// run (the training losses differ from a run without dropout).
TEST_F(TrainRun, ResumeWithDropoutReproducesTheRun) {
  TrainOptions full = tiny_options(dir_, "drop_full");
  full.dropout = 0.2f;
  train_model(full);
  TrainOptions half = tiny_options(dir_, "drop_resumed");
  half.dropout = 0.2f;
  half.resume = full.out_dir + "/ckpt-000004.ckpt";
  train_model(half);
  EXPECT_EQ(records(full.out_dir + "/metrics.jsonl", 4), records(half.out_dir + "/metrics.jsonl"));
  EXPECT_TRUE(load_checkpoint(full.out_dir + "/ckpt-000008.ckpt").params ==
              load_checkpoint(half.out_dir + "/ckpt-000008.ckpt").params);
  const TrainOptions plain = tiny_options(dir_, "no_drop");
  train_model(plain);
  EXPECT_NE(records(full.out_dir + "/metrics.jsonl"), records(plain.out_dir + "/metrics.jsonl"));
}

TEST_F(TrainRun, ResumeInPlaceRewritesTheMetricsTail) {
  const TrainOptions full = tiny_options(dir_, "full");
  train_model(full);
  const std::vector<std::string> want = records(full.out_dir + "/metrics.jsonl");
  // As if the run had crashed after step 8 and is resumed from its step-4 checkpoint: the lines of steps
  // 5..8 are replaced, not duplicated. A different thread count must not matter either.
  TrainOptions again = full;
  again.resume = full.out_dir + "/ckpt-000004.ckpt";
  again.threads = 3;
  train_model(again);
  EXPECT_EQ(records(full.out_dir + "/metrics.jsonl"), want);
}

TEST_F(TrainRun, ResumeFromDirectoryPicksTheLatestCheckpoint) {
  TrainOptions o = tiny_options(dir_, "run");
  train_model(o);
  o.resume = o.out_dir;
  o.optim.steps = 8;
  const TrainResult r = train_model(o);  // nothing left to do
  EXPECT_EQ(r.last_checkpoint, o.out_dir + "/ckpt-000008.ckpt");
}

TEST_F(TrainRun, CheckpointOfAnotherModelIsRefused) {
  TrainOptions o = tiny_options(dir_, "run");
  train_model(o);
  TrainOptions other = tiny_options(dir_, "other");
  other.model.dim = 32;
  other.resume = o.out_dir + "/ckpt-000004.ckpt";
  try {
    train_model(other);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different model"), std::string::npos) << e.what();
  }
}

TEST_F(TrainRun, CorruptCheckpointsAreRefused) {
  TrainOptions o = tiny_options(dir_, "run");
  train_model(o);
  const std::string good = o.out_dir + "/ckpt-000008.ckpt";
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto expect_refused = [&](const std::string& content, const char* what, const char* needle) {
    const std::string path = dir_.file(std::string("bad-") + what + ".ckpt");
    std::ofstream(path, std::ios::binary) << content;
    try {
      load_checkpoint(path);
      ADD_FAILURE() << what << ": loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
  };
  std::string flipped = bytes;
  flipped[bytes.size() - 100] ^= 0x10;  // a bit of the last AdamW moment
  expect_refused(flipped, "flipped", "checksum");
  expect_refused(bytes.substr(0, bytes.size() / 2), "truncated", "not a valid checkpoint");
  expect_refused("not a checkpoint at all", "garbage", "not a valid checkpoint");
  expect_refused("", "empty", "not a valid checkpoint");
}

TEST_F(TrainRun, DataSmallerThanOneBatchIsRefused) {
  write_tokens(dir_.file("tiny.tok"), 40, 3);  // one batch needs 4 x 16 + 1 tokens
  TrainOptions o = tiny_options(dir_, "run");
  o.data = dir_.file("tiny.tok");
  o.val = dir_.file("data/val-00000.tok");
  try {
    train_model(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("smaller than one batch"), std::string::npos) << e.what();
  }
}

TEST_F(TrainRun, TokensOutsideTheVocabularyAreRefused) {
  TrainOptions o = tiny_options(dir_, "run");
  o.model.vocab_size = 32;  // the data uses ids up to 63
  EXPECT_THROW(train_model(o), Error);
}

TEST_F(TrainRun, DivergenceStopsAndKeepsTheLastGoodCheckpoint) {
  TrainOptions o = tiny_options(dir_, "run");
  o.optim.steps = 50;
  o.optim.lr = 1e30;  // the first update already blows the weights up
  o.optim.min_lr = 1e30;
  o.optim.warmup = 0;
  o.optim.grad_clip = 0;
  o.ckpt_every = 1;
  o.eval_every = 0;
  try {
    train_model(o);
    FAIL() << "expected divergence";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("diverged"), std::string::npos) << msg;
    EXPECT_NE(msg.find("ckpt-0000"), std::string::npos) << msg;
  }
  const std::string last = latest_checkpoint(o.out_dir);
  ASSERT_FALSE(last.empty());
  const Checkpoint ck = load_checkpoint(last);  // intact and loadable
  EXPECT_GE(ck.state.step, 1u);
}

}  // namespace
}  // namespace merlin::train
