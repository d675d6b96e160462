// Automatic prefix caching over a BlockAllocator. A full block of K/V is identified by a hash of its tokens
// chained with the hash of the block before it, so equal hashes mean equal whole prefixes (the tokens are
// kept and compared too, so a hash collision can never serve wrong K/V). Blocks are reference counted;
// a cached block whose count drops to zero stays cached ("idle") and is evicted least recently used first
// when a new block is needed and the free list is empty.
//
// All block traffic of the engine goes through this class (allocate / release), so with caching disabled
// it is a plain allocator.
#pragma once
#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "serve/block_allocator.h"

namespace merlin::serve {

class PrefixCache {
 public:
  PrefixCache(int n_blocks, int block_size, bool enabled = true);

  static constexpr uint64_t kRootHash = 0x6d65726c696e2121ull;  // the "previous block" of a prompt's first block
  // Hash of one full block of tokens after a block whose hash is `prev`.
  static uint64_t block_hash(uint64_t prev, std::span<const int32_t> tokens);

  // The longest run of cached full blocks that starts `tokens` (at most max_blocks), each retained for the
  // caller, in order. Empty when disabled.
  std::vector<int32_t> match(std::span<const int32_t> tokens, int max_blocks);
  // Registers a full block the caller has computed, under hash `hash` = block_hash(prev, tokens). No-op when
  // disabled, when the block is already registered, or when another block already holds that prefix.
  void insert(uint64_t hash, std::span<const int32_t> tokens, int32_t block);

  // A block with count 1: from the free list, else by evicting the least recently used idle cached block.
  std::optional<int32_t> allocate();
  void retain(int32_t block);
  // Drops one reference. At zero a cached block becomes idle (evictable), any other block is freed.
  void release(int32_t block);

  int block_size() const { return block_size_; }
  int n_blocks() const { return alloc_.n_blocks(); }
  int n_free() const { return alloc_.n_free(); }
  int n_idle_cached() const { return (int)lru_.size(); }
  int n_available() const { return n_free() + n_idle_cached(); }  // what allocate() can still hand out
  int n_cached() const { return (int)by_hash_.size(); }           // registered blocks, used or idle
  int refcount(int32_t block) const { return alloc_.refcount(block); }
  bool is_cached(int32_t block) const { return alloc_.refcount(block) >= 0 && entries_[(size_t)block].cached; }
  uint64_t evictions() const { return evictions_; }

 private:
  struct Entry {
    bool cached = false;
    uint64_t hash = 0;
    std::vector<int32_t> tokens;
    std::list<int32_t>::iterator lru_pos;  // valid while idle
    bool idle = false;
  };
  void evict(int32_t block);

  BlockAllocator alloc_;
  int block_size_;
  bool enabled_;
  std::vector<Entry> entries_;
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> lru_;  // idle cached blocks, least recently used first
  uint64_t evictions_ = 0;
};

}  // namespace merlin::serve
