// Fixed-size K/V cache blocks: a free list and a reference count per block. A block is in one of three
// states: free (on the free list), used (count > 0) or idle (count 0 but kept out of the free list by its
// owner, the prefix cache, because it still holds reusable K/V). The allocator itself knows nothing about
// tokens; PrefixCache builds on it.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

namespace merlin::serve {

class BlockAllocator {
 public:
  explicit BlockAllocator(int n_blocks);

  // A free block with count 1, or nothing when the free list is empty.
  std::optional<int32_t> allocate();
  // count + 1; the block must be used or idle (an idle block becomes used again).
  void retain(int32_t block);
  // count - 1; returns true when it reached 0. The block is then idle: the caller either keeps it (cache)
  // or hands it back with free().
  bool release(int32_t block);
  // Puts an idle block on the free list.
  void free(int32_t block);

  int refcount(int32_t block) const;
  bool is_free(int32_t block) const;
  int n_blocks() const { return (int)refs_.size(); }
  int n_free() const { return (int)free_.size(); }

 private:
  void check(int32_t block) const;

  std::vector<int32_t> free_;       // LIFO: a just-freed block is still warm in cache
  std::vector<int32_t> refs_;
  std::vector<uint8_t> on_free_list_;
};

}  // namespace merlin::serve
