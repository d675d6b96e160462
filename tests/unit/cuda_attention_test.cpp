// The tiled tensor-core attention (flash_attention.cu) against the per-token kernel (attention.cu) on random
// queries and a random f16 paged cache: several sequences in one batch, runs longer than one 64-query tile,
// single tokens, positions that do not start at 0, shuffled block tables, GQA, head sizes 32, 64 and 128.
// Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/ops.h"
#include "quant_test_util.h"
#include "test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;

namespace {

#define REQUIRE_GPU()                                                              \
  do {                                                                             \
    std::string why_;                                                              \
    if (!cu::gpu_available(&why_)) GTEST_SKIP() << "no usable CUDA GPU: " << why_; \
  } while (0)

template <class T>
T* upload(const std::vector<T>& v) {
  T* d = static_cast<T*>(cu::dev_alloc(std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) cu::copy_to_device(d, v.data(), v.size() * sizeof(T));
  return d;
}

struct Token {
  int seq, pos;
};

// Runs both kernels on the same batch and cache; returns max |flash - reference| / max |reference|.
float compare_kernels(int hd, int n_heads, int n_kv_heads, const std::vector<Token>& batch, uint32_t seed) {
  const int n = (int)batch.size(), block = 16, n_seq = 3, n_ctx = 256, max_blocks = n_ctx / block;
  const int n_blocks = n_seq * max_blocks;
  const int64_t kv_dim = (int64_t)n_kv_heads * hd, ld = (int64_t)n_heads * hd;
  std::mt19937 rng(seed);
  // Shuffled block tables: sequence s's block b lives at a random physical block.
  std::vector<int32_t> perm(n_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<uint16_t> k((size_t)n_blocks * block * kv_dim), v(k.size());
  const std::vector<float> kf = test::gaussian(k.size(), seed + 1), vf = test::gaussian(v.size(), seed + 2);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = f32_to_fp16(kf[i]);
    v[i] = f32_to_fp16(vf[i]);
  }
  const std::vector<float> q = test::gaussian((size_t)n * ld, seed + 3, 1.5f);  // peaky softmax too
  std::vector<int32_t> pos(n), seq(n);
  for (int i = 0; i < n; ++i) {
    pos[i] = batch[i].pos;
    seq[i] = batch[i].seq;
  }
  int32_t* d_table = upload(perm);
  uint16_t* d_k = upload(k);
  uint16_t* d_v = upload(v);
  float* d_q = upload(q);
  int32_t* d_pos = upload(pos);
  int32_t* d_seq = upload(seq);
  float* d_ref = upload(std::vector<float>((size_t)n * ld, 0.f));
  float* d_out = upload(std::vector<float>((size_t)n * ld, 0.f));
  std::vector<cu::AttnTile> tiles(n);
  const int n_tiles = cu::make_attention_tiles(pos.data(), seq.data(), n, tiles.data());
  tiles.resize(n_tiles);
  cu::AttnTile* d_tiles = upload(tiles);

  cu::KvArgs kv;
  kv.d_k = d_k;
  kv.d_v = d_v;
  kv.f16 = true;
  kv.block_size = block;
  kv.max_blocks = max_blocks;
  kv.d_table = d_table;
  cu::attention_prepare(n_ctx);
  cu::attention(d_q, ld, 0, n, d_pos, d_seq, n_heads, n_kv_heads, hd, n_ctx, kv, d_ref, nullptr);
  cu::flash_attention(d_q, ld, d_tiles, n_tiles, n_heads, n_kv_heads, hd, kv, d_out, nullptr);
  cu::sync_device();
  std::vector<float> ref((size_t)n * ld), out(ref.size());
  cu::copy_to_host(ref.data(), d_ref, ref.size() * 4);
  cu::copy_to_host(out.data(), d_out, out.size() * 4);
  float worst = 0, amax = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(std::isfinite(out[i])) << "element " << i;
    worst = std::max(worst, std::fabs(out[i] - ref[i]));
    amax = std::max(amax, std::fabs(ref[i]));
  }
  for (void* p : {(void*)d_table, (void*)d_k, (void*)d_v, (void*)d_q, (void*)d_pos, (void*)d_seq, (void*)d_ref,
                  (void*)d_out, (void*)d_tiles})
    cu::dev_free(p);
  return worst / amax;
}

}  // namespace

TEST(CudaFlashAttention, TilesFollowRunsOfOneSequence) {
  // seq 0 at 5..74 (70 tokens: a 64-tile and a 6-tile), seq 1 at 0, seq 0 at 90 (a new run), seq 2 at 3..4.
  std::vector<int32_t> pos, seq;
  for (int p = 5; p < 75; ++p) pos.push_back(p), seq.push_back(0);
  pos.push_back(0), seq.push_back(1);
  pos.push_back(90), seq.push_back(0);
  pos.push_back(3), seq.push_back(2);
  pos.push_back(4), seq.push_back(2);
  std::vector<cu::AttnTile> t(pos.size());
  const int n = cu::make_attention_tiles(pos.data(), seq.data(), (int)pos.size(), t.data());
  ASSERT_EQ(n, 5);
  EXPECT_EQ((std::vector<int>{t[0].first, t[0].count, t[0].seq, t[0].pos0}), (std::vector<int>{0, 64, 0, 5}));
  EXPECT_EQ((std::vector<int>{t[1].first, t[1].count, t[1].seq, t[1].pos0}), (std::vector<int>{64, 6, 0, 69}));
  EXPECT_EQ((std::vector<int>{t[2].first, t[2].count, t[2].seq, t[2].pos0}), (std::vector<int>{70, 1, 1, 0}));
  EXPECT_EQ((std::vector<int>{t[3].first, t[3].count, t[3].seq, t[3].pos0}), (std::vector<int>{71, 1, 0, 90}));
  EXPECT_EQ((std::vector<int>{t[4].first, t[4].count, t[4].seq, t[4].pos0}), (std::vector<int>{72, 2, 2, 3}));
}

// The weights differ from the per-token kernel's only by f16 rounding of exp(s - running max) instead of the
// normalised weight (2^-11 relative each), so outputs agree to a small fraction of max |out|; a wrong
// position, block, head or mask moves them by O(1).
TEST(CudaFlashAttention, MatchesPerTokenKernel) {
  REQUIRE_GPU();
  std::vector<Token> batch;
  for (int p = 37; p < 37 + 150; ++p) batch.push_back({0, p});  // three tiles, starting mid-cache
  for (int p = 0; p < 70; ++p) batch.push_back({1, p});         // from position 0
  batch.push_back({2, 200});                                    // one token, long context
  for (int p = 10; p < 13; ++p) batch.push_back({2, p});        // a short run
  for (int hd : {32, 64, 128}) {
    for (auto [nh, nkv] : {std::pair{4, 4}, std::pair{8, 2}}) {
      SCOPED_TRACE("head size " + std::to_string(hd) + " heads " + std::to_string(nh) + "/" + std::to_string(nkv));
      const float rel = compare_kernels(hd, nh, nkv, batch, (uint32_t)(hd * 10 + nh));
      std::printf("[ flash ] head %3d, %d/%d heads: max |flash - per-token| = %.3g of max |out|\n", hd, nh, nkv, rel);
      EXPECT_LE(rel, 3e-3f);
    }
  }
}

// ---- split-K attention (AttnScratch) against the unsplit kernel ----
#include <cstring>

namespace {

struct SplitRun {
  float rel_err = 0;    // max |split - unsplit| over tokens that were split, / max |unsplit|
  int n_split = 0, chunk = 0;
};

// Decode batch of single tokens over one random paged cache of n_ctx positions per sequence (f16 or f32),
// run unsplit (null scratch), split twice, and split with a scratch too small for the batch.
SplitRun compare_split(int hd, int n_heads, int n_kv_heads, bool f16, const std::vector<Token>& batch, int n_ctx,
                       uint32_t seed) {
  const int n = (int)batch.size(), block = 16, n_seq = 3, max_blocks = n_ctx / block, n_blocks = n_seq * max_blocks;
  const int64_t kv_dim = (int64_t)n_kv_heads * hd, ld = (int64_t)n_heads * hd, out_len = (int64_t)n * ld;
  std::mt19937 rng(seed);
  std::vector<int32_t> perm(n_blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const size_t cache_len = (size_t)n_blocks * block * kv_dim;
  const std::vector<float> kf = test::gaussian(cache_len, seed + 1), vf = test::gaussian(cache_len, seed + 2);
  void *d_k = nullptr, *d_v = nullptr;
  if (f16) {
    std::vector<uint16_t> k(cache_len), v(cache_len);
    for (size_t i = 0; i < cache_len; ++i) {
      k[i] = f32_to_fp16(kf[i]);
      v[i] = f32_to_fp16(vf[i]);
    }
    d_k = upload(k);
    d_v = upload(v);
  } else {
    d_k = upload(kf);
    d_v = upload(vf);
  }
  const std::vector<float> q = test::gaussian((size_t)out_len, seed + 3, 1.5f);
  std::vector<int32_t> pos(n), seq(n);
  for (int i = 0; i < n; ++i) {
    pos[i] = batch[i].pos;
    seq[i] = batch[i].seq;
  }
  int32_t* d_table = upload(perm);
  float* d_q = upload(q);
  int32_t* d_pos = upload(pos);
  int32_t* d_seq = upload(seq);
  float* d_out = upload(std::vector<float>((size_t)out_len, 0.f));
  cu::KvArgs kv;
  kv.d_k = d_k;
  kv.d_v = d_v;
  kv.f16 = f16;
  kv.block_size = block;
  kv.max_blocks = max_blocks;
  kv.d_table = d_table;
  cu::attention_prepare(n_ctx);
  cu::AttnScratch scratch = cu::attention_scratch_alloc(32, n_heads, hd, n_ctx);
  EXPECT_GT(scratch.n_split, 1);
  auto run = [&](const cu::AttnScratch* s) {
    cu::attention(d_q, ld, 0, n, d_pos, d_seq, n_heads, n_kv_heads, hd, n_ctx, kv, d_out, nullptr, s);
    cu::sync_device();
    std::vector<float> out((size_t)out_len);
    cu::copy_to_host(out.data(), d_out, out.size() * 4);
    return out;
  };
  const std::vector<float> ref = run(nullptr), split1 = run(&scratch), split2 = run(&scratch);
  cu::AttnScratch small = scratch;  // a batch larger than the scratch runs unsplit
  small.max_tokens = n - 1;
  const std::vector<float> unsplit = run(&small);
  std::vector<int> counters((size_t)scratch.max_tokens * n_heads, -1);
  cu::copy_to_host(counters.data(), scratch.counter, counters.size() * sizeof(int));
  for (size_t i = 0; i < counters.size(); ++i) EXPECT_EQ(counters[i], 0) << "counter " << i << " not reset";

  SplitRun r;
  r.n_split = scratch.n_split;
  r.chunk = scratch.chunk;
  const size_t row_bytes = (size_t)ld * sizeof(float);
  EXPECT_EQ(std::memcmp(split1.data(), split2.data(), split1.size() * 4), 0) << "split attention is not deterministic";
  EXPECT_EQ(std::memcmp(unsplit.data(), ref.data(), ref.size() * 4), 0) << "oversized batch did not run unsplit";
  float worst = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float* a = split1.data() + (size_t)i * ld;
    const float* b = ref.data() + (size_t)i * ld;
    for (int64_t e = 0; e < ld; ++e) EXPECT_TRUE(std::isfinite(a[e])) << "token " << i << " element " << e;
    if (pos[i] + 1 <= scratch.chunk) {
      EXPECT_EQ(std::memcmp(a, b, row_bytes), 0) << "token at position " << pos[i] << " (one chunk) differs";
      continue;
    }
    for (int64_t e = 0; e < ld; ++e) {
      worst = std::max(worst, std::fabs(a[e] - b[e]));
      amax = std::max(amax, std::fabs(b[e]));
    }
  }
  cu::attention_scratch_free(scratch);
  for (void* p : {d_k, d_v, (void*)d_table, (void*)d_q, (void*)d_pos, (void*)d_seq, (void*)d_out}) cu::dev_free(p);
  r.rel_err = amax > 0 ? worst / amax : 0.f;
  return r;
}

}  // namespace

// Long decode positions are split into chunks whose partial softmax sums are combined; tokens whose context
// fits one chunk must come out bit for bit as unsplit, split ones differ only by the f16 rounding of
// exp(s - m_split) instead of the normalised weight (none with an f32 cache) and the summation order.
TEST(CudaSplitAttention, MatchesUnsplitKernel) {
  REQUIRE_GPU();
  const int n_ctx = 4096;
  cu::AttnScratch probe = cu::attention_scratch_alloc(1, 1, 64, n_ctx);
  const int L = probe.chunk;
  cu::attention_scratch_free(probe);
  ASSERT_GT(L, 0);
  ASSERT_LT(2 * L + 1, n_ctx);
  const std::vector<Token> batch = {{0, 1000}, {1, 2047}, {2, n_ctx - 1}, {0, 5},
                                    {1, L - 1},  {2, L},    {0, 2 * L - 1}, {1, 2 * L}};
  for (bool f16 : {true, false}) {
    for (int hd : {64, 128}) {
      for (auto [nh, nkv] : {std::pair{8, 2}, std::pair{4, 4}}) {
        const std::string what = std::string(f16 ? "f16" : "f32") + " cache, head size " + std::to_string(hd) +
                                 ", heads " + std::to_string(nh) + "/" + std::to_string(nkv);
        SCOPED_TRACE(what);
        const SplitRun r = compare_split(hd, nh, nkv, f16, batch, n_ctx, (uint32_t)(hd * 10 + nh + (f16 ? 0 : 5)));
        std::printf("[ split ] %s: %d splits of %d, max |split - unsplit| = %.3g of max |out|\n", what.c_str(),
                    r.n_split, r.chunk, r.rel_err);
        EXPECT_LE(r.rel_err, f16 ? 3e-3f : 1e-5f);
      }
    }
  }
}
