// serve::BlockAllocator: free list, reference counts, exhaustion, misuse.
#include <set>

#include "core/error.h"
#include "serve/block_allocator.h"
#include "test_util.h"

using namespace merlin;
using namespace merlin::serve;

TEST(BlockAllocator, AllocatesEveryBlockOnceThenRunsOut) {
  BlockAllocator a(5);
  std::set<int32_t> got;
  for (int i = 0; i < 5; ++i) {
    const auto b = a.allocate();
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(a.refcount(*b), 1);
    got.insert(*b);
  }
  EXPECT_EQ(got, (std::set<int32_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(a.n_free(), 0);
  EXPECT_FALSE(a.allocate().has_value());  // exhaustion is a value, not a crash
  EXPECT_TRUE(a.release(2));
  a.free(2);
  EXPECT_EQ(a.n_free(), 1);
  EXPECT_EQ(a.allocate(), 2);
}

TEST(BlockAllocator, ReferenceCounts) {
  BlockAllocator a(2);
  const int32_t b = *a.allocate();
  a.retain(b);
  a.retain(b);
  EXPECT_EQ(a.refcount(b), 3);
  EXPECT_FALSE(a.release(b));
  EXPECT_FALSE(a.release(b));
  EXPECT_TRUE(a.release(b));  // idle now: neither used nor on the free list
  EXPECT_FALSE(a.is_free(b));
  EXPECT_EQ(a.n_free(), 1);
  a.retain(b);  // an idle block can be used again (the prefix cache does this)
  EXPECT_EQ(a.refcount(b), 1);
  EXPECT_TRUE(a.release(b));
  a.free(b);
  EXPECT_TRUE(a.is_free(b));
  EXPECT_EQ(a.n_free(), 2);
}

TEST(BlockAllocator, MisuseIsAnErrorNotACrash) {
  EXPECT_THROW(BlockAllocator(0), Error);
  BlockAllocator a(2);
  EXPECT_THROW(a.retain(0), Error);   // free block
  EXPECT_THROW(a.release(1), Error);  // no references
  EXPECT_THROW(a.free(0), Error);     // already free
  EXPECT_THROW(a.retain(7), Error);
  EXPECT_THROW(a.refcount(-1), Error);
  const int32_t b = *a.allocate();
  EXPECT_THROW(a.free(b), Error);  // still referenced
}
