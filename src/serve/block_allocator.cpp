#include "serve/block_allocator.h"

#include "core/error.h"

namespace merlin::serve {

BlockAllocator::BlockAllocator(int n_blocks) {
  MERLIN_CHECK(n_blocks > 0, "the KV cache needs at least one block (got ", n_blocks, ")");
  refs_.assign((size_t)n_blocks, 0);
  on_free_list_.assign((size_t)n_blocks, 1);
  // Hand out low block numbers first (reverse order on a LIFO stack): easier to read in logs and tests.
  for (int32_t b = n_blocks - 1; b >= 0; --b) free_.push_back(b);
}

void BlockAllocator::check(int32_t block) const {
  MERLIN_CHECK(block >= 0 && block < n_blocks(), "KV block ", block, " out of range (0..", n_blocks() - 1, ")");
}

std::optional<int32_t> BlockAllocator::allocate() {
  if (free_.empty()) return std::nullopt;
  const int32_t b = free_.back();
  free_.pop_back();
  on_free_list_[(size_t)b] = 0;
  refs_[(size_t)b] = 1;
  return b;
}

void BlockAllocator::retain(int32_t block) {
  check(block);
  MERLIN_CHECK(!on_free_list_[(size_t)block], "retain of free KV block ", block);
  ++refs_[(size_t)block];
}

bool BlockAllocator::release(int32_t block) {
  check(block);
  MERLIN_CHECK(refs_[(size_t)block] > 0, "release of KV block ", block, " which has no references");
  return --refs_[(size_t)block] == 0;
}

void BlockAllocator::free(int32_t block) {
  check(block);
  MERLIN_CHECK(refs_[(size_t)block] == 0 && !on_free_list_[(size_t)block], "free of KV block ", block,
               " which is in use or already free");
  on_free_list_[(size_t)block] = 1;
  free_.push_back(block);
}

int BlockAllocator::refcount(int32_t block) const {
  check(block);
  return refs_[(size_t)block];
}

bool BlockAllocator::is_free(int32_t block) const {
  check(block);
  return on_free_list_[(size_t)block] != 0;
}

}  // namespace merlin::serve
