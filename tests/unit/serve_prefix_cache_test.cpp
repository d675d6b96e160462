// serve::PrefixCache: chained block hashes, longest-prefix lookup, reference counts, idle blocks kept
// cached, LRU eviction.
#include "serve/prefix_cache.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::serve;

namespace {

constexpr int B = 4;

std::vector<int32_t> seq(std::initializer_list<int32_t> l) { return l; }

// Allocates blocks for the full blocks of `tokens` and registers them, as the scheduler does after computing.
std::vector<int32_t> compute_and_cache(PrefixCache& c, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> blocks;
  uint64_t h = PrefixCache::kRootHash;
  for (size_t i = 0; i + B <= tokens.size(); i += B) {
    const std::span<const int32_t> blk(tokens.data() + i, B);
    h = PrefixCache::block_hash(h, blk);
    const int32_t b = *c.allocate();
    c.insert(h, blk, b);
    blocks.push_back(b);
  }
  return blocks;
}

}  // namespace

TEST(PrefixCache, ChainedHashesDependOnThePrefix) {
  const std::vector<int32_t> x = {1, 2, 3, 4};
  const uint64_t a = PrefixCache::block_hash(PrefixCache::kRootHash, x);
  EXPECT_EQ(a, PrefixCache::block_hash(PrefixCache::kRootHash, x));
  EXPECT_NE(a, PrefixCache::block_hash(PrefixCache::block_hash(PrefixCache::kRootHash, seq({9, 9, 9, 9})), x));
  EXPECT_NE(a, PrefixCache::block_hash(PrefixCache::kRootHash, seq({1, 2, 4, 3})));
}

TEST(PrefixCache, LongestPrefixOfFullBlocks) {
  PrefixCache c(16, B);
  const std::vector<int32_t> p = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
  EXPECT_TRUE(c.match(p, 10).empty());  // cold
  const std::vector<int32_t> blocks = compute_and_cache(c, p);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(c.n_cached(), 3);

  std::vector<int32_t> hit = c.match(p, 10);
  EXPECT_EQ(hit, blocks);
  for (int32_t b : hit) EXPECT_EQ(c.refcount(b), 2);
  for (int32_t b : hit) c.release(b);

  // Same first block, different second: only the first matches, even though block 3 is equal.
  const std::vector<int32_t> q = {1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12};
  hit = c.match(q, 10);
  EXPECT_EQ(hit, std::vector<int32_t>{blocks[0]});
  for (int32_t b : hit) c.release(b);

  // max_blocks caps the match (the scheduler keeps the last prompt token to recompute).
  hit = c.match(p, 2);
  EXPECT_EQ(hit, std::vector<int32_t>(blocks.begin(), blocks.begin() + 2));
  for (int32_t b : hit) c.release(b);

  // A different first block matches nothing.
  EXPECT_TRUE(c.match(seq({0, 2, 3, 4, 5, 6, 7, 8}), 10).empty());
}

TEST(PrefixCache, IdleBlocksStayCachedAndAreEvictedLeastRecentlyUsedFirst) {
  PrefixCache c(4, B);
  const std::vector<int32_t> a = {1, 1, 1, 1}, b = {2, 2, 2, 2}, d = {3, 3, 3, 3};
  const int32_t ba = compute_and_cache(c, a)[0];
  const int32_t bb = compute_and_cache(c, b)[0];
  const int32_t bd = compute_and_cache(c, d)[0];
  c.release(ba);
  c.release(bb);
  c.release(bd);
  EXPECT_EQ(c.n_idle_cached(), 3);
  EXPECT_EQ(c.n_free(), 1);
  EXPECT_EQ(c.n_available(), 4);
  // Touch `a`: it becomes the most recently used.
  auto hit = c.match(a, 1);
  ASSERT_EQ(hit, std::vector<int32_t>{ba});
  EXPECT_EQ(c.n_idle_cached(), 2);
  c.release(ba);

  const int32_t f1 = *c.allocate();  // the free list first: nothing evicted
  EXPECT_EQ(c.evictions(), 0u);
  const int32_t f2 = *c.allocate();  // evicts b, the least recently used
  EXPECT_EQ(f2, bb);
  EXPECT_EQ(c.evictions(), 1u);
  EXPECT_TRUE(c.match(b, 1).empty());
  const int32_t f3 = *c.allocate();  // then d
  EXPECT_EQ(f3, bd);
  hit = c.match(a, 1);  // a survived
  EXPECT_EQ(hit, std::vector<int32_t>{ba});
  EXPECT_FALSE(c.allocate().has_value());  // a is in use, nothing left: exhaustion, no crash
  c.release(ba);
  for (int32_t x : {f1, f2, f3}) c.release(x);
  EXPECT_EQ(c.n_available(), 4);
}

TEST(PrefixCache, UsedBlocksAreNeverEvicted) {
  PrefixCache c(2, B);
  const int32_t ba = compute_and_cache(c, {5, 5, 5, 5})[0];
  const int32_t other = *c.allocate();
  EXPECT_FALSE(c.allocate().has_value());
  EXPECT_EQ(c.refcount(ba), 1);
  c.release(other);  // never cached: straight back to the free list
  EXPECT_EQ(c.n_free(), 1);
  EXPECT_EQ(c.n_idle_cached(), 0);
}

TEST(PrefixCache, DuplicatePrefixKeepsTheFirstBlock) {
  PrefixCache c(4, B);
  const std::vector<int32_t> p = {7, 7, 7, 7};
  const int32_t first = compute_and_cache(c, p)[0];
  const int32_t second = compute_and_cache(c, p)[0];  // a concurrent request computed the same block
  EXPECT_NE(first, second);
  EXPECT_EQ(c.n_cached(), 1);
  c.release(second);  // not cached: freed
  EXPECT_EQ(c.n_free(), 3);
  auto hit = c.match(p, 1);
  EXPECT_EQ(hit, std::vector<int32_t>{first});
}

TEST(PrefixCache, DisabledCacheIsAPlainAllocator) {
  PrefixCache c(3, B, false);
  const std::vector<int32_t> p = {1, 2, 3, 4};
  const int32_t b = compute_and_cache(c, p)[0];
  EXPECT_EQ(c.n_cached(), 0);
  EXPECT_TRUE(c.match(p, 1).empty());
  c.release(b);
  EXPECT_EQ(c.n_free(), 3);
}
