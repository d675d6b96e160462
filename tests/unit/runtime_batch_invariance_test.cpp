// Batch invariance of the CPU forward pass: a sequence's logits are bitwise identical whether its tokens
// run alone or among other sequences' tokens (any batch size, any row position), whether its prompt is
// prefilled in one chunk or several, and whatever physical K/V blocks its block table maps. The server's
// promise that a greedy request gives the same text alone or among 31 others rests on this.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "random_model.h"
#include "runtime/backend.h"

using namespace merlin;

namespace {

constexpr int kBlock = 16;

std::vector<int32_t> tokens_of(int n, uint64_t seed, int vocab) {
  Rng rng(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((int32_t)rng.below((uint64_t)vocab));
  return t;
}

struct Setup {
  std::unique_ptr<Model> model;
  std::unique_ptr<Backend> backend;
  int vocab() const { return (int)model->config().vocab_size; }
};

// Paged backends get tables of shuffled physical blocks, so no sequence's blocks are contiguous or ordered.
std::unique_ptr<Backend> make(const Model& m, DType kv, int n_seq, bool paged, uint64_t shuffle_seed) {
  BackendOptions bo;
  bo.n_threads = 2;
  bo.n_seq = n_seq;
  bo.kv_type = kv;
  bo.kv_block_size = kBlock;
  const int per_seq = (int)m.config().context_length / kBlock;
  bo.n_kv_blocks = paged ? n_seq * per_seq + 3 : 0;
  auto b = make_cpu_backend(m, bo);
  if (paged) {
    std::vector<int32_t> all(bo.n_kv_blocks);
    std::iota(all.begin(), all.end(), 0);
    Rng rng(shuffle_seed);
    for (size_t i = all.size() - 1; i > 0; --i) std::swap(all[i], all[rng.below(i + 1)]);
    for (int s = 0; s < n_seq; ++s)
      b->set_block_table(s, std::span<const int32_t>(all).subspan((size_t)s * per_seq, (size_t)per_seq));
  }
  return b;
}

// Logits of every token of `seq_tokens` for sequence 0 of a fresh backend, fed in chunks of `chunk`; each chunk is mixed with
// `filler` tokens of other sequences (1..n_seq-1, continuing their own prompts) at pseudo-random rows.
std::vector<float> run(Backend& b, int vocab, const std::vector<int32_t>& seq_tokens, int chunk, int filler,
                       bool filler_logits, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> out;
  std::vector<int> other_pos((size_t)b.n_seq(), 0);
  std::vector<float> logits;
  for (size_t i0 = 0; i0 < seq_tokens.size(); i0 += (size_t)chunk) {
    const size_t i1 = std::min(seq_tokens.size(), i0 + (size_t)chunk);
    // Rows: ours in order, fillers inserted at random places (each filler sequence in position order).
    std::vector<int> owner;  // 0 = ours, else filler sequence
    for (size_t i = i0; i < i1; ++i) owner.push_back(0);
    for (int f = 0; f < filler; ++f) {
      const int s = 1 + (int)rng.below((uint64_t)b.n_seq() - 1);
      if (other_pos[(size_t)s] >= b.n_ctx() - 1) continue;
      owner.insert(owner.begin() + (ptrdiff_t)rng.below(owner.size() + 1), s);
      ++other_pos[(size_t)s];
    }
    std::vector<int> next_pos = other_pos;
    for (int s = 1; s < b.n_seq(); ++s)
      next_pos[(size_t)s] -= (int)std::count(owner.begin(), owner.end(), s);
    Batch batch;
    size_t ours = i0;
    std::vector<int> our_rows;
    for (int o : owner) {
      if (o == 0) {
        our_rows.push_back((int)batch.n_logits());
        batch.add(seq_tokens[ours], (int)ours, 0, true);
        ++ours;
      } else {
        const int p = next_pos[(size_t)o]++;
        batch.add((int32_t)((p * 7 + o * 13) % vocab), p, o, filler_logits);
      }
    }
    logits.resize(batch.n_logits() * (size_t)vocab);
    b.forward(batch, logits.data());
    for (int r : our_rows) out.insert(out.end(), logits.begin() + (ptrdiff_t)r * vocab, logits.begin() + (ptrdiff_t)(r + 1) * vocab);
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The super-block types need rows that are a multiple of 256.
ModelConfig wide_config() {
  ModelConfig c = test::small_config();
  c.dim = 256;
  c.n_heads = 8;
  c.n_kv_heads = 2;
  c.ffn_dim = 512;
  c.n_layers = 1;
  return c;
}

void expect_invariant(DType weights, DType kv, const ModelConfig& config = test::small_config()) {
  SCOPED_TRACE(std::string("weights ") + dtype_name(weights) + ", kv " + dtype_name(kv));
  test::TempDir dir;
  const std::string path = test::write_small_model(dir, weights, 1, config);
  if (path.empty()) GTEST_SKIP() << "shared data file '" << test::kTokenizerModel << "' not found";
  auto m = Model::load(path);
  ASSERT_EQ(m->weight_type(), weights);
  const int vocab = (int)m->config().vocab_size;
  const std::vector<int32_t> toks = tokens_of(70, 5, vocab);
  auto alone = make(*m, kv, 6, false, 0);
  const std::vector<float> ref = run(*alone, vocab, toks, (int)toks.size(), 0, false, 1);
  struct Case {
    int chunk, filler;
    bool filler_logits, paged;
  };
  const Case cases[] = {{1, 0, false, false},   {1, 0, false, true},   {7, 0, false, false},  {13, 5, true, true},
                        {1, 31, true, false},   {1, 31, false, true},  {70, 442, true, false}, {70, 442, false, true},
                        {16, 200, true, true},  {3, 509, false, false}, {5, 3, true, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "chunk " << c.chunk << ", filler " << c.filler << (c.paged ? ", paged" : ""));
    auto b = make(*m, kv, 6, c.paged, 99);
    EXPECT_TRUE(same_bits(run(*b, vocab, toks, c.chunk, c.filler, c.filler_logits, 7 + c.chunk), ref));
  }
}

// RMSNorm/SwiGLU fused with the activation quantization (the default) against the materialised inputs
// (MERLIN_FUSE=0, read when a backend is made): the same bits, for prefill and decode.
void expect_fusion_exact(DType weights, const ModelConfig& config = test::small_config()) {
  SCOPED_TRACE(std::string("weights ") + dtype_name(weights));
  test::TempDir dir;
  const std::string path = test::write_small_model(dir, weights, 1, config);
  if (path.empty()) GTEST_SKIP() << "shared data file '" << test::kTokenizerModel << "' not found";
  auto m = Model::load(path);
  const int vocab = (int)m->config().vocab_size;
  const std::vector<int32_t> toks = tokens_of(40, 11, vocab);
  for (int chunk : {1, 40}) {
    ::setenv("MERLIN_FUSE", "0", 1);
    auto plain = make(*m, DType::F16, 2, false, 0);
    ::unsetenv("MERLIN_FUSE");
    auto fused = make(*m, DType::F16, 2, false, 0);
    EXPECT_TRUE(same_bits(run(*plain, vocab, toks, chunk, 0, false, 1), run(*fused, vocab, toks, chunk, 0, false, 1)))
        << "chunk " << chunk;
  }
}

// Decode steps in which each of 20 sequences has one token, in shuffled batch order (a server's many-sequence
// step, where attention work items cover all heads of a token): sequence 0's logits must equal its logits
// alone, with identity or shuffled paged tables.
void expect_decode_steps_invariant(DType weights, DType kv, const ModelConfig& config = test::small_config()) {
  SCOPED_TRACE(std::string("weights ") + dtype_name(weights) + ", kv " + dtype_name(kv));
  test::TempDir dir;
  const std::string path = test::write_small_model(dir, weights, 1, config);
  if (path.empty()) GTEST_SKIP() << "shared data file '" << test::kTokenizerModel << "' not found";
  auto m = Model::load(path);
  const int vocab = (int)m->config().vocab_size, n_seq = 20;
  const std::vector<int32_t> toks = tokens_of(40, 5, vocab);
  auto alone = make(*m, kv, 1, false, 0);
  const std::vector<float> ref = run(*alone, vocab, toks, 1, 0, false, 1);
  for (bool paged : {false, true}) {
    auto b = make(*m, kv, n_seq, paged, 99);
    Rng rng(3);
    std::vector<int> order((size_t)n_seq);
    std::iota(order.begin(), order.end(), 0);
    std::vector<float> got, logits((size_t)n_seq * vocab);
    for (size_t i = 0; i < toks.size(); ++i) {
      for (size_t j = order.size() - 1; j > 0; --j) std::swap(order[j], order[rng.below(j + 1)]);
      Batch batch;
      size_t ours = 0;
      for (size_t r = 0; r < order.size(); ++r) {
        const int s = order[r];
        if (s == 0) ours = r;
        batch.add(s == 0 ? toks[i] : (int32_t)((i * 7 + (size_t)s * 13) % (size_t)vocab), (int)i, s, true);
      }
      b->forward(batch, logits.data());
      got.insert(got.end(), logits.begin() + (ptrdiff_t)(ours * vocab), logits.begin() + (ptrdiff_t)((ours + 1) * vocab));
    }
    EXPECT_TRUE(same_bits(got, ref)) << (paged ? "paged" : "identity tables");
  }
}

}  // namespace

TEST(BatchInvariance, DecodeStepOfManySequences) {
  expect_decode_steps_invariant(DType::F16, DType::F16);
  expect_decode_steps_invariant(DType::F32, DType::F32);
  expect_decode_steps_invariant(DType::Q8_0, DType::Q8_0);
  expect_decode_steps_invariant(DType::Q4_0, DType::F16, wide_config());
}

TEST(BatchInvariance, FusedInputsGiveUnfusedBits) {
  expect_fusion_exact(DType::Q8_0);
  expect_fusion_exact(DType::Q4_0);
  expect_fusion_exact(DType::Q4_K, wide_config());
  expect_fusion_exact(DType::F32);
}

TEST(BatchInvariance, F32Weights) { expect_invariant(DType::F32, DType::F16); }
TEST(BatchInvariance, F16Weights) { expect_invariant(DType::F16, DType::F16); }
TEST(BatchInvariance, Q8_0Weights) { expect_invariant(DType::Q8_0, DType::F16); }
TEST(BatchInvariance, Q4_0Weights) { expect_invariant(DType::Q4_0, DType::F16); }
TEST(BatchInvariance, OtherQuantizedWeights) {
  for (DType t : {DType::MXFP4, DType::Q4_K, DType::TQ1_0, DType::TQ2_0}) expect_invariant(t, DType::F16, wide_config());
}
TEST(BatchInvariance, BF16Weights) { expect_invariant(DType::BF16, DType::F16); }
TEST(BatchInvariance, F32AndQ8_0KvCache) {
  expect_invariant(DType::F16, DType::F32);
  expect_invariant(DType::Q4_0, DType::Q8_0);
}

TEST(PagedKvCache, UnmappedPositionsAreErrors) {
  test::TempDir dir;
  const std::string path = test::write_small_model(dir, DType::F32);
  if (path.empty()) GTEST_SKIP() << "shared data file '" << test::kTokenizerModel << "' not found";
  auto m = Model::load(path);
  BackendOptions bo;
  bo.n_threads = 1;
  bo.n_seq = 2;
  bo.kv_block_size = kBlock;
  bo.n_kv_blocks = 4;
  auto b = make_cpu_backend(*m, bo);
  EXPECT_EQ(b->n_kv_blocks(), 4);
  EXPECT_EQ(b->kv_block_size(), kBlock);
  std::vector<float> logits((size_t)m->config().vocab_size);
  Batch batch;
  batch.add(1, 0, 0, true);
  EXPECT_THROW(b->forward(batch, logits.data()), Error);  // nothing mapped yet
  const int32_t table[] = {2, 0};
  b->set_block_table(0, table);
  b->forward(batch, logits.data());
  batch.clear();
  batch.add(1, 2 * kBlock, 0, true);  // third block: unmapped
  EXPECT_THROW(b->forward(batch, logits.data()), Error);
  const int32_t bad[] = {4};
  EXPECT_THROW(b->set_block_table(1, bad), Error);
  const int32_t negative[] = {-1};
  EXPECT_THROW(b->set_block_table(1, negative), Error);
  EXPECT_THROW(b->set_block_table(2, table), Error);
  b->clear_sequence(0);  // a paged sequence gives its blocks up
  batch.clear();
  batch.add(1, 0, 0, true);
  EXPECT_THROW(b->forward(batch, logits.data()), Error);
}

TEST(PagedKvCache, IdentityTablesByDefault) {
  test::TempDir dir;
  const std::string path = test::write_small_model(dir, DType::F32);
  if (path.empty()) GTEST_SKIP() << "shared data file '" << test::kTokenizerModel << "' not found";
  auto m = Model::load(path);
  BackendOptions bo;
  bo.n_threads = 1;
  bo.n_seq = 3;
  bo.n_ctx = 100;
  bo.kv_block_size = 16;
  auto b = make_cpu_backend(*m, bo);
  EXPECT_EQ(b->n_kv_blocks(), 3 * 7);  // ceil(100 / 16) blocks per sequence
  EXPECT_EQ(b->kv_block_bytes(), 2 * (size_t)m->config().n_layers * 16 * dtype_row_bytes(DType::F16, (uint64_t)m->config().kv_dim()));
}
