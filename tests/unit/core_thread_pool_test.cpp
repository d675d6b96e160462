// ThreadPool::for_chunks, through which the CPU backend hands out every parallel section.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/thread_pool.h"

using namespace merlin;

// The backend hands every parallel section out through for_chunks: each chunk exactly once, for any grain,
// however slowly one thread goes (here the caller stalls in its first chunk, so the worker takes the rest).
TEST(ThreadPoolChunks, EveryChunkRunsOnceWhoeverRunsIt) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 2, 7, 64, 1000})
      for (int64_t grain : {1, 3, 16, 2000}) {
        std::vector<std::atomic<int>> hits((size_t)n);
        std::atomic<bool> busy[4] = {};
        std::atomic<int> overlaps{0};
        pool.for_chunks(n, grain, [&](int thread, int64_t b, int64_t e) {
          if (busy[thread].exchange(true)) overlaps++;
          EXPECT_EQ(b % grain, 0);
          EXPECT_EQ(e, std::min(n, b + grain));
          if (thread == 0 && b == 0 && threads > 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
          for (int64_t i = b; i < e; ++i) hits[(size_t)i]++;
          busy[thread] = false;
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[(size_t)i].load(), 1) << "n " << n << " grain " << grain;
        EXPECT_EQ(overlaps.load(), 0);
      }
    // Sections in quick succession, mixed with run(): a worker late for one must never run a stale one.
    for (int rep = 0; rep < 2000; ++rep) {
      std::atomic<int64_t> sum{0};
      pool.for_chunks(10, 1, [&](int, int64_t b, int64_t) { sum += b; });
      ASSERT_EQ(sum.load(), 45);
      std::atomic<int> count{0};
      pool.run([&](int, int) { count++; });
      ASSERT_EQ(count.load(), threads);
    }
  }
}
