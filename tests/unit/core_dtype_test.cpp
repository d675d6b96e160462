#include <cmath>

#include "core/dtype.h"
#include "core/rng.h"
#include "core/thread_pool.h"
#include "test_util.h"

using namespace merlin;

TEST(DType, Fp16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_f32((uint16_t)h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_fp16(f), h) << h;
  }
}

TEST(DType, Fp16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_fp16(1.0f + 1.0f / 2048), 0x3c00);           // tie -> even (down)
  EXPECT_EQ(f32_to_fp16(1.0f + 3.0f / 2048), 0x3c02);           // tie -> even (up)
  EXPECT_EQ(f32_to_fp16(65520.0f), 0x7c00);                     // overflow to inf
  EXPECT_EQ(f32_to_fp16(5.9604645e-08f), 0x0001);               // smallest subnormal
  EXPECT_EQ(fp16_to_f32(0x0001), 5.9604645e-08f);
}

TEST(DType, Bf16) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
}

TEST(DType, Table) {
  EXPECT_EQ(dtype_row_bytes(DType::Q4_0, 64), 36u);
  EXPECT_EQ(dtype_row_bytes(DType::Q4_K, 256), 144u);
  EXPECT_EQ(dtype_from_name("tq2_0"), DType::TQ2_0);
  EXPECT_EQ(dtype_info(12345u), nullptr);
}

TEST(Rng, DeterministicAndNormal) {
  Rng a(42), b(42);
  double sum = 0, sq = 0;
  for (int i = 0; i < 100000; ++i) {
    const float x = a.normal();
    EXPECT_EQ(x, b.normal());
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / 100000, 0.0, 0.02);
  EXPECT_NEAR(sq / 100000, 1.0, 0.02);
}

TEST(ThreadPool, ParallelForCoversRangeOnce) {
  ThreadPool pool(2);
  for (int64_t n : {1, 2, 3, 17, 1000}) {
    std::vector<int> hits((size_t)n, 0);
    pool.parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[(size_t)i]++;
    }, 4);
    for (int h : hits) EXPECT_EQ(h, 1);
  }
  for (int rep = 0; rep < 10000; ++rep) {
    std::atomic<int> count{0};
    pool.run([&](int, int) { count++; });
    ASSERT_EQ(count.load(), 2);
  }
}
