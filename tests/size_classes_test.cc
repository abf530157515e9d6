#include "ctxpool/core/size_classes.h"

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST(SizeClasses, RoundsTo512AndZeroToOneUnit) {
  SizeClasses c{SizeClassConfig{}};
  EXPECT_EQ(c.Round(0), 512u);
  EXPECT_EQ(c.Round(1), 512u);
  EXPECT_EQ(c.Round(512), 512u);
  EXPECT_EQ(c.Round(513), 1024u);
  EXPECT_EQ(c.Round(kMiB + 1), kMiB + 512);
}

TEST(SizeClasses, PoolsAndSegmentSizesFollowPyTorch) {
  SizeClasses c{SizeClassConfig{}};
  EXPECT_TRUE(c.IsSmall(kMiB));
  EXPECT_FALSE(c.IsSmall(kMiB + 512));
  EXPECT_EQ(c.SegmentBytes(512), 2 * kMiB);
  EXPECT_EQ(c.SegmentBytes(kMiB), 2 * kMiB);
  EXPECT_EQ(c.SegmentBytes(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(c.SegmentBytes(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(c.SegmentBytes(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(c.SegmentBytes(13 * kMiB), 14 * kMiB);
  EXPECT_EQ(c.SegmentBytes(64 * kMiB + 512), 66 * kMiB);
}

TEST(SizeClasses, SplitRules) {
  SizeClasses c{SizeClassConfig{}};
  EXPECT_TRUE(c.ShouldSplit(2 * kMiB, 2 * kMiB - 512, /*small=*/true));
  EXPECT_FALSE(c.ShouldSplit(1024, 1024, /*small=*/true));
  // Large pool keeps remainders of at most 1 MiB inside the block.
  EXPECT_FALSE(c.ShouldSplit(3 * kMiB, 2 * kMiB, /*small=*/false));
  EXPECT_TRUE(c.ShouldSplit(3 * kMiB + 512, 2 * kMiB, /*small=*/false));
}

TEST(SizeClasses, MaxSplitSize) {
  SizeClassConfig config;
  config.max_split_size = 32 * kMiB;
  SizeClasses c{config};
  EXPECT_TRUE(c.CanServe(8 * kMiB, 4 * kMiB));
  EXPECT_FALSE(c.CanServe(40 * kMiB, 4 * kMiB));   // oversize block
  EXPECT_TRUE(c.CanServe(40 * kMiB, 34 * kMiB));   // oversize request
  EXPECT_FALSE(c.CanServe(60 * kMiB, 34 * kMiB));  // wastes >= 20 MiB
  EXPECT_FALSE(c.ShouldSplit(40 * kMiB, 34 * kMiB, /*small=*/false));
  SizeClasses unlimited{SizeClassConfig{}};
  EXPECT_TRUE(unlimited.CanServe(1024 * kMiB, 2 * kMiB));
}

}  // namespace
}  // namespace ctxpool
