// Attention kernels on random queries and a random paged cache (shuffled 16-position blocks, GQA):
// - the tiled tensor-core prefill kernel (flash_attention.cu) against the per-token kernel (attention.cu): several
//   sequences in one batch, runs longer than one 64-query tile, single tokens, positions that do not start at 0,
//   head sizes 32, 64 and 128;
// - split-K decode attention against the unsplit kernel at long positions, f16 and f32 caches;
// - the per-token kernel's second output (Wo's input in Q8_0 / F16 / BF16) against prep_act on its float output;
// - a Q8_0 cache against an f32 cache of its dequantized values;
// - the one-pass launch (plain instance) bit for bit against the default (hoisted) one for decode grids.
// Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/quant_formats.h"
#include "cuda_test_util.h"
#include "quant_test_util.h"
#include "test_util.h"

using namespace merlin;
namespace cu = merlin::cuda;
using test::download;
using test::upload;

namespace {

#define REQUIRE_GPU() MERLIN_REQUIRE_GPU()
// gtest's ASSERT_* cannot return from a constructor.
#define ASSERT_TRUE_CTOR(x) \
  if (!(x)) throw std::runtime_error(#x " failed")

struct Token {
  int seq, pos;
};

// Three sequences of n_ctx positions in a paged cache of random K/V (f16 or f32) whose blocks are shuffled,
// random queries for a batch of tokens, and the batch's positions and sequences, all on the device.
struct RandomAttention {
  static constexpr int kBlock = 16, kSeqs = 3;
  int n, n_heads, n_kv_heads, hd, n_ctx;
  int64_t ld;  // query row length: n_heads * hd
  std::vector<int32_t> pos, seq;
  cu::KvArgs kv;
  float* d_q;
  int32_t *d_pos, *d_seq;

  // q8: a Q8_0 cache of the same random values (quantized as the CPU does); q8_values: an f32 cache holding
  // exactly what that Q8_0 cache dequantizes to.
  RandomAttention(int hd_, int n_heads_, int n_kv_heads_, bool f16, const std::vector<Token>& batch, int n_ctx_,
                  uint32_t seed, bool q8 = false, bool q8_values = false)
      : n((int)batch.size()), n_heads(n_heads_), n_kv_heads(n_kv_heads_), hd(hd_), n_ctx(n_ctx_),
        ld((int64_t)n_heads_ * hd_) {
    const int max_blocks = n_ctx / kBlock, n_blocks = kSeqs * max_blocks;
    std::mt19937 rng(seed);
    std::vector<int32_t> perm(n_blocks);  // sequence s's block b lives at a random physical block
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const size_t cache_len = (size_t)n_blocks * kBlock * n_kv_heads * hd;
    std::vector<float> kf = test::gaussian(cache_len, seed + 1), vf = test::gaussian(cache_len, seed + 2);
    if (q8 || q8_values) {
      std::vector<int8_t> codes[2];
      std::vector<uint16_t> scales[2];
      std::vector<float>* rows[2] = {&kf, &vf};
      for (int c = 0; c < 2; ++c) {
        std::vector<kernels::quant::BlockQ8_0> blocks(cache_len / 32);
        ASSERT_TRUE_CTOR(kernels::quant_quantize_row(DType::Q8_0, rows[c]->data(), blocks.data(), (int64_t)cache_len));
        for (size_t b = 0; b < blocks.size(); ++b) {
          scales[c].push_back(blocks[b].d);
          for (int j = 0; j < 32; ++j) {
            codes[c].push_back(blocks[b].qs[j]);
            (*rows[c])[b * 32 + j] = (float)blocks[b].qs[j] * fp16_to_f32(blocks[b].d);
          }
        }
      }
      if (q8) {
        kv.d_k = upload(codes[0]);
        kv.d_v = upload(codes[1]);
        kv.d_ks = upload(scales[0]);
        kv.d_vs = upload(scales[1]);
        kv.q8 = true;
        f16 = false;
      }
    }
    if (kv.q8) {
    } else if (f16) {
      std::vector<uint16_t> k(cache_len), v(cache_len);
      for (size_t i = 0; i < cache_len; ++i) {
        k[i] = f32_to_fp16(kf[i]);
        v[i] = f32_to_fp16(vf[i]);
      }
      kv.d_k = upload(k);
      kv.d_v = upload(v);
    } else {
      kv.d_k = upload(kf);
      kv.d_v = upload(vf);
    }
    kv.f16 = f16;
    kv.block_size = kBlock;
    kv.max_blocks = max_blocks;
    kv.d_table = upload(perm);
    d_q = upload(test::gaussian((size_t)n * ld, seed + 3, 1.5f));  // peaky softmax too
    for (const Token& t : batch) {
      pos.push_back(t.pos);
      seq.push_back(t.seq);
    }
    d_pos = upload(pos);
    d_seq = upload(seq);
    cu::attention_prepare(n_ctx);
  }
  RandomAttention(const RandomAttention&) = delete;
  RandomAttention& operator=(const RandomAttention&) = delete;
  ~RandomAttention() {
    for (void* p : {kv.d_k, kv.d_v, kv.d_ks, kv.d_vs, static_cast<void*>(const_cast<int32_t*>(kv.d_table)),
                    static_cast<void*>(d_q), static_cast<void*>(d_pos), static_cast<void*>(d_seq)})
      cu::dev_free(p);
  }

  // The per-token kernel's output (split-K with `scratch`, unsplit without; also written to `emit` if given).
  // one_pass: the plain instance (cuda::attention's one_pass; every position below the one-pass bound).
  std::vector<float> per_token(const cu::AttnScratch* scratch = nullptr, cu::ActBuf* emit = nullptr,
                               bool one_pass = false) const {
    test::DevFloats out(std::vector<float>((size_t)n * ld, 0.f));
    cu::attention(d_q, ld, 0, n, d_pos, d_seq, n_heads, n_kv_heads, hd, n_ctx, kv, out.p, nullptr, scratch, emit,
                  false, one_pass);
    cu::sync_device();
    return download(out.p, (size_t)n * ld);
  }

  std::vector<float> tiled() const {
    std::vector<cu::AttnTile> tiles(n);
    tiles.resize(cu::make_attention_tiles(pos.data(), seq.data(), n, tiles.data()));
    cu::AttnTile* d_tiles = upload(tiles);
    test::DevFloats out(std::vector<float>((size_t)n * ld, 0.f));
    cu::flash_attention(d_q, ld, d_tiles, (int)tiles.size(), n_heads, n_kv_heads, hd, kv, out.p, nullptr);
    cu::sync_device();
    cu::dev_free(d_tiles);
    return download(out.p, (size_t)n * ld);
  }
};

// max |flash - reference| / max |reference| over the batch (flash's outputs all finite).
float compare_kernels(int hd, int n_heads, int n_kv_heads, const std::vector<Token>& batch, uint32_t seed) {
  const RandomAttention a(hd, n_heads, n_kv_heads, true, batch, 256, seed);
  const std::vector<float> ref = a.per_token(), out = a.tiled();
  float worst = 0, amax = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(std::isfinite(out[i])) << "element " << i;
    worst = std::max(worst, std::fabs(out[i] - ref[i]));
    amax = std::max(amax, std::fabs(ref[i]));
  }
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

// A decode-sized grid (a few tokens) runs the hoisted instance, whose F16 cache takes contexts of up to twice
// pos_unroll positions per lane group in one pass (128 positions for 128-dim heads, 256 for 64-dim ones),
// and longer ones through the general passes: both within the same bound of the tiled kernel.
TEST(CudaFlashAttention, MatchesDecodeOnePass) {
  REQUIRE_GPU();
  const std::vector<Token> decode = {{0, 70}, {1, 127}, {2, 200}, {0, 255}};
  for (int hd : {64, 128}) {
    for (auto [nh, nkv] : {std::pair{4, 4}, std::pair{8, 2}}) {
      SCOPED_TRACE("head size " + std::to_string(hd) + " heads " + std::to_string(nh) + "/" + std::to_string(nkv));
      const float rel = compare_kernels(hd, nh, nkv, decode, (uint32_t)(hd * 7 + nh));
      std::printf("[ decode ] head %3d, %d/%d heads: max |flash - per-token| = %.3g of max |out|\n", hd, nh, nkv, rel);
      EXPECT_LE(rel, 3e-3f);
    }
  }
}

// ---- split-K attention (AttnScratch) against the unsplit kernel ----

namespace {

struct SplitRun {
  float rel_err = 0;    // max |split - unsplit| over tokens that were split, / max |unsplit|
  int n_split = 0, chunk = 0;
};

// Decode batch of single tokens over one random paged cache of n_ctx positions per sequence (f16 or f32),
// run unsplit (null scratch), split twice, and split with a scratch too small for the batch.
SplitRun compare_split(int hd, int n_heads, int n_kv_heads, bool f16, const std::vector<Token>& batch, int n_ctx,
                       uint32_t seed) {
  const RandomAttention a(hd, n_heads, n_kv_heads, f16, batch, n_ctx, seed);
  const int n = a.n;
  const int64_t ld = a.ld;
  cu::AttnScratch scratch = cu::attention_scratch_alloc(32, n_heads, hd, n_ctx);
  EXPECT_GT(scratch.n_split, 1);
  const std::vector<float> ref = a.per_token(), split1 = a.per_token(&scratch), split2 = a.per_token(&scratch);
  cu::AttnScratch small = scratch;  // a batch larger than the scratch runs unsplit
  small.max_tokens = n - 1;
  const std::vector<float> unsplit = a.per_token(&small);
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
    const float* x = split1.data() + (size_t)i * ld;
    const float* y = ref.data() + (size_t)i * ld;
    for (int64_t e = 0; e < ld; ++e) EXPECT_TRUE(std::isfinite(x[e])) << "token " << i << " element " << e;
    if (a.pos[i] + 1 <= scratch.chunk) {
      EXPECT_EQ(std::memcmp(x, y, row_bytes), 0) << "token at position " << a.pos[i] << " (one chunk) differs";
      continue;
    }
    for (int64_t e = 0; e < ld; ++e) {
      worst = std::max(worst, std::fabs(x[e] - y[e]));
      amax = std::max(amax, std::fabs(y[e]));
    }
  }
  cu::attention_scratch_free(scratch);
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

// The per-token kernel writes Wo's input itself (one kernel less per layer): its codes and scales (Q8_0) or
// halves (F16, BF16) must be exactly those prep_act(Plain) writes from the float output, split or not.
// max |a - b| / max |b|.
float rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float worst = 0, amax = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
    amax = std::max(amax, std::fabs(b[i]));
  }
  return worst / amax;
}

// A Q8_0 cache gives what an f32 cache holding its dequantized values (scale x code, as the CPU's
// dequantize_row) gives, up to float summation order (it walks 8 positions per lane group and pass, the f32
// cache 4): decode tokens (V rows hoisted), a batch (not hoisted), long positions split and unsplit; the
// tiled prefill kernel over the same cache agrees within f16 rounding.
TEST(CudaAttention, Q8CacheMatchesF32CacheOfItsValues) {
  REQUIRE_GPU();
  const std::vector<Token> decode = {{0, 37}, {1, 200}, {2, 5}};
  std::vector<Token> batch;
  for (int i = 0; i < 40; ++i) batch.push_back({i % 3, 60 + i});
  const std::vector<Token> longer = {{0, 1500}, {1, 700}, {2, 2047}};
  for (const std::vector<Token>* tokens : {&decode, static_cast<const std::vector<Token>*>(&batch), &longer}) {
    for (int hd : {64, 128}) {
      SCOPED_TRACE(std::to_string(tokens->size()) + " tokens, head " + std::to_string(hd));
      const int n_ctx = tokens == &longer ? 2048 : 256;
      const RandomAttention q8(hd, 8, 2, false, *tokens, n_ctx, 31, true, false);
      const RandomAttention ref(hd, 8, 2, false, *tokens, n_ctx, 31, false, true);
      const std::vector<float> a = q8.per_token(), b = ref.per_token();
      EXPECT_LE(rel_diff(a, b), 2e-6f);
      EXPECT_GT(*std::max_element(b.begin(), b.end()), 0.0f);
      if (tokens == &batch) {  // the tiled prefill kernel stages the Q8_0 rows as f16
        const float d = rel_diff(q8.tiled(), a);
        EXPECT_LE(d, 2e-3f) << "tiled kernel on the Q8_0 cache";
        std::printf("[ flash ] head %3d, Q8_0 cache: max |flash - per-token| = %.3g of max |out|\n", hd, d);
      }
      if (tokens == &longer) {
        cu::AttnScratch scratch = cu::attention_scratch_alloc(3, 8, hd, n_ctx);
        const std::vector<float> sa = q8.per_token(&scratch), sb = ref.per_token(&scratch);
        EXPECT_LE(rel_diff(sa, sb), 2e-6f) << "split";
        cu::attention_scratch_free(scratch);
      }
    }
  }
}

TEST(CudaAttention, EmitsTheProductInputOfAPlainPreparation) {
  REQUIRE_GPU();
  const int n_ctx = 2048;
  const std::vector<Token> batch = {{0, 3}, {1, 700}, {2, 2047}, {0, 1500}};
  for (int hd : {64, 128}) {
    const RandomAttention a(hd, 8, 2, true, batch, n_ctx, (uint32_t)hd);
    cu::AttnScratch scratch = cu::attention_scratch_alloc(a.n, 8, hd, n_ctx);
    ASSERT_GT(scratch.n_split, 1);
    for (const cu::AttnScratch* sc : {static_cast<const cu::AttnScratch*>(nullptr),
                                      static_cast<const cu::AttnScratch*>(&scratch)}) {
      for (cu::ActKind kind : {cu::ActKind::Q8_0, cu::ActKind::F16, cu::ActKind::BF16}) {
        SCOPED_TRACE("head size " + std::to_string(hd) + (sc ? ", split-K" : ", unsplit") + ", kind " +
                     std::to_string((int)kind));
        ASSERT_TRUE(cu::attention_emits(kind, hd));
        cu::ActBuf got = cu::act_alloc(kind, a.ld, a.n), want = cu::act_alloc(kind, a.ld, a.n);
        const std::vector<float> out = a.per_token(sc, &got);
        test::DevFloats d_out(out);
        cu::PrepArgs p;
        p.d_x = d_out.p;
        p.ld = a.ld;
        cu::prep_act(p, a.n, want, nullptr);
        cu::sync_device();
        const size_t elems = (size_t)a.n * a.ld;
        if (kind == cu::ActKind::Q8_0) {
          EXPECT_EQ(download(got.q, elems), download(want.q, elems));
          EXPECT_EQ(download(got.scale, elems / 32), download(want.scale, elems / 32));
          EXPECT_EQ(download(got.sum, elems / 32), download(want.sum, elems / 32));
          // the batched products' fragment-ordered copy, whole groups of 8 tokens
          const size_t felems = (size_t)(a.n + 7) / 8 * 8 * a.ld;
          EXPECT_EQ(download(got.fq, felems), download(want.fq, felems));
          EXPECT_EQ(download(got.fs, felems / 32), download(want.fs, felems / 32));
          EXPECT_EQ(download(got.fsum, felems / 32), download(want.fsum, felems / 32));
        } else {
          EXPECT_EQ(download(got.hi, elems), download(want.hi, elems));
          EXPECT_EQ(download(got.lo, elems), download(want.lo, elems));
          const size_t felems = (size_t)(a.n + 7) / 8 * 8 * ((a.ld + 31) / 32 * 32);
          EXPECT_EQ(download(got.fhi, felems), download(want.fhi, felems));
          EXPECT_EQ(download(got.flo, felems), download(want.flo, felems));
        }
        cu::act_free(got);
        cu::act_free(want);
      }
    }
    cu::attention_scratch_free(scratch);
  }
  EXPECT_FALSE(cu::attention_emits(cu::ActKind::Q8_0, 48));  // a Q8_0 block must not straddle two heads
  EXPECT_FALSE(cu::attention_emits(cu::ActKind::Q8_K, 64));
}

// Decode steps whose positions all lie below attention_one_pass_positions launch the kernel's one-pass
// instance (cuda::attention's one_pass, the backend's kAttnOnePass graphs; its copy for 4+ tokens, which asks
// for another carveout; the plain instance with MERLIN_CUDA_ATTN_LEAN=0); a decode grid otherwise gets the
// hoisted one. Both must give the same bits, or a sequence's tokens would depend on the longest context beside it.
TEST(CudaAttention, OnePassLaunchMatchesTheHoistedOne) {
  REQUIRE_GPU();
  for (int kind : {0, 1, 2}) {  // f16, f32, Q8_0 cache
    for (int hd : {32, 64, 128}) {
      cu::KvArgs probe;
      probe.q8 = kind == 2;
      const int bound = cu::attention_one_pass_positions(hd, probe);
      ASSERT_GE(bound, 32);
      // Four tokens (the one-pass copy of 4+-token steps) and one (the single-token instance).
      const std::vector<std::vector<Token>> batches = {{{0, 0}, {1, bound / 2}, {2, bound - 1}, {0, bound - 2}},
                                                       {{2, bound - 1}}};
      for (const std::vector<Token>& batch : batches) {
        SCOPED_TRACE("cache kind " + std::to_string(kind) + ", head size " + std::to_string(hd) + ", bound " +
                     std::to_string(bound) + ", tokens " + std::to_string(batch.size()));
        const int n_ctx = std::max(256, (bound + 15) / 16 * 16);
        const RandomAttention a(hd, 4, 2, kind == 0, batch, n_ctx, (uint32_t)(kind * 100 + hd), kind == 2);
        const std::vector<float> hoisted = a.per_token(), plain = a.per_token(nullptr, nullptr, true);
        ASSERT_EQ(hoisted.size(), plain.size());
        EXPECT_EQ(std::memcmp(hoisted.data(), plain.data(), plain.size() * sizeof(float)), 0);
        for (float v : plain) ASSERT_TRUE(std::isfinite(v));
      }
    }
  }
}
