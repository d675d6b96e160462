// Process helpers of core/sys.h: byte formatting and the environment switches the kernels read.
#include <cstdlib>

#include <gtest/gtest.h>

#include "core/sys.h"

using namespace merlin;

TEST(Sys, EnvIsMatchesTheWholeValue) {
  ::unsetenv("MERLIN_TEST_SWITCH");
  EXPECT_FALSE(env_is("MERLIN_TEST_SWITCH", "0"));
  ::setenv("MERLIN_TEST_SWITCH", "0", 1);
  EXPECT_TRUE(env_is("MERLIN_TEST_SWITCH", "0"));
  EXPECT_FALSE(env_is("MERLIN_TEST_SWITCH", "1"));
  ::setenv("MERLIN_TEST_SWITCH", "00", 1);
  EXPECT_FALSE(env_is("MERLIN_TEST_SWITCH", "0"));
  ::setenv("MERLIN_TEST_SWITCH", "", 1);
  EXPECT_FALSE(env_is("MERLIN_TEST_SWITCH", "0"));
  EXPECT_TRUE(env_is("MERLIN_TEST_SWITCH", ""));
  ::unsetenv("MERLIN_TEST_SWITCH");
}

TEST(Sys, FormatBytesPicksAUnit) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(3ull << 20), "3.0 MiB");
  EXPECT_EQ(format_bytes(5ull << 30), "5.0 GiB");
}
