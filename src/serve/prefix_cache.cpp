#include "serve/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace merlin::serve {

PrefixCache::PrefixCache(int n_blocks, int block_size, bool enabled)
    : alloc_(n_blocks), block_size_(block_size), enabled_(enabled), entries_((size_t)n_blocks) {
  MERLIN_CHECK(block_size > 0, "KV block size must be positive (got ", block_size, ")");
}

uint64_t PrefixCache::block_hash(uint64_t prev, std::span<const int32_t> tokens) {
  // FNV-1a style mixing per token with a splitmix finaliser: cheap, and every token moves every bit.
  uint64_t h = prev ^ 0x9e3779b97f4a7c15ull;
  for (int32_t t : tokens) {
    h ^= (uint64_t)(uint32_t)t + 0x632be59bd9b4e019ull;
    h *= 0x100000001b3ull;
    h ^= h >> 29;
  }
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  return h ^ (h >> 31);
}

std::vector<int32_t> PrefixCache::match(std::span<const int32_t> tokens, int max_blocks) {
  std::vector<int32_t> out;
  if (!enabled_) return out;
  const int n_full = std::min<int>(max_blocks, (int)(tokens.size() / (size_t)block_size_));
  uint64_t h = kRootHash;
  for (int i = 0; i < n_full; ++i) {
    const std::span<const int32_t> blk = tokens.subspan((size_t)i * block_size_, (size_t)block_size_);
    h = block_hash(h, blk);
    const auto it = by_hash_.find(h);
    if (it == by_hash_.end()) break;
    const Entry& e = entries_[(size_t)it->second];
    if (!std::equal(blk.begin(), blk.end(), e.tokens.begin(), e.tokens.end())) break;
    retain(it->second);
    out.push_back(it->second);
  }
  return out;
}

void PrefixCache::insert(uint64_t hash, std::span<const int32_t> tokens, int32_t block) {
  if (!enabled_) return;
  MERLIN_CHECK(alloc_.refcount(block) > 0, "only a block in use can be cached");
  MERLIN_CHECK((int)tokens.size() == block_size_, "only full blocks are cached");
  Entry& e = entries_[(size_t)block];
  if (e.cached || by_hash_.count(hash)) return;
  e.cached = true;
  e.hash = hash;
  e.tokens.assign(tokens.begin(), tokens.end());
  by_hash_.emplace(hash, block);
}

std::optional<int32_t> PrefixCache::allocate() {
  if (alloc_.n_free() == 0 && !lru_.empty()) evict(lru_.front());
  return alloc_.allocate();
}

void PrefixCache::evict(int32_t block) {
  Entry& e = entries_[(size_t)block];
  lru_.erase(e.lru_pos);
  e.idle = false;
  by_hash_.erase(e.hash);
  e.cached = false;
  e.tokens.clear();
  alloc_.free(block);
  ++evictions_;
}

void PrefixCache::retain(int32_t block) {
  (void)alloc_.refcount(block);  // range check before indexing
  Entry& e = entries_[(size_t)block];
  if (e.idle) {
    lru_.erase(e.lru_pos);
    e.idle = false;
  }
  alloc_.retain(block);
}

void PrefixCache::release(int32_t block) {
  if (!alloc_.release(block)) return;
  Entry& e = entries_[(size_t)block];
  if (e.cached) {
    e.idle = true;
    e.lru_pos = lru_.insert(lru_.end(), block);
  } else {
    alloc_.free(block);
  }
}

}  // namespace merlin::serve
