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

// Round and SegmentBytes use a mask for their power-of-two units: the same
// results as the division for every unit the allocator's options accept.
TEST(SizeClasses, MaskRoundingEqualsDivision) {
  for (std::size_t unit : {1u, 2u, 256u, 512u, 4096u, 1u << 21}) {
    SizeClassConfig config;
    config.round_bytes = unit;
    SizeClasses c{config};
    for (std::size_t n :
         {std::size_t{1}, unit - 1, unit, unit + 1, 3 * unit + 7, kMiB - 1,
          kMiB, kMiB + 1, std::size_t{1} << 40, (std::size_t{1} << 62) + 3}) {
      if (n == 0) continue;
      EXPECT_EQ(c.Round(n), SizeClasses::RoundUp(n, unit)) << unit << " " << n;
    }
  }
  SizeClasses c{SizeClassConfig{}};
  for (std::size_t r = 10 * kMiB; r < 80 * kMiB; r += 512 * 37) {
    EXPECT_EQ(c.SegmentBytes(r), SizeClasses::RoundUp(r, 2 * kMiB)) << r;
  }
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
