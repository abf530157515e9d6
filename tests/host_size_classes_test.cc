#include "ctxpool/core/host_size_classes.h"

#include <cstddef>
#include <cstdint>
#include <random>

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;

TEST(HostSizeClasses, SmallRequestsRoundToGranule) {
  HostSizeClasses c(8);
  EXPECT_EQ(c.RoundUp(0), 64u);
  EXPECT_EQ(c.RoundUp(1), 64u);
  EXPECT_EQ(c.RoundUp(64), 64u);
  EXPECT_EQ(c.RoundUp(65), 128u);
  EXPECT_EQ(c.RoundUp(512), 512u);
  EXPECT_EQ(c.Index(0), 0);
  EXPECT_EQ(c.Index(64), 0);
  EXPECT_EQ(c.Index(65), 1);
}

TEST(HostSizeClasses, LargeRequestsUseEighthSteps) {
  HostSizeClasses c(8);
  EXPECT_EQ(c.RoundUp(513), 576u);
  EXPECT_EQ(c.RoundUp(1000), 1024u);
  EXPECT_EQ(c.RoundUp(1025), 1024u + 128u);
  EXPECT_EQ(c.RoundUp(4 * kGiB), 4 * kGiB);
  EXPECT_EQ(c.RoundUp(4 * kGiB + 1), 4 * kGiB + kGiB / 2);
  EXPECT_EQ(RoundUpPowerOfTwo(4 * kGiB + 1), 8 * kGiB);
}

TEST(HostSizeClasses, FourPerDoubling) {
  HostSizeClasses c(4);
  EXPECT_EQ(c.classes_per_doubling(), 4);
  EXPECT_EQ(c.SmallLimit(), 256u);
  EXPECT_EQ(c.RoundUp(257), 320u);
  EXPECT_EQ(c.RoundUp(4 * kGiB + 1), 5 * kGiB);
}

TEST(HostSizeClasses, InvalidDivisionsAreClamped) {
  EXPECT_EQ(HostSizeClasses(0).classes_per_doubling(), 1);
  EXPECT_EQ(HostSizeClasses(6).classes_per_doubling(), 4);
  EXPECT_EQ(HostSizeClasses(1000).classes_per_doubling(), 64);
}

TEST(HostSizeClasses, IndexAndClassSizeAreInverse) {
  for (int d : {1, 2, 4, 8, 16, 64}) {
    HostSizeClasses c(d);
    std::size_t previous = 0;
    for (int i = 0; i < c.num_classes(); ++i) {
      const std::size_t size = c.ClassSize(i);
      ASSERT_GT(size, previous) << "d=" << d << " i=" << i;
      ASSERT_EQ(size % HostSizeClasses::kGranuleBytes, 0u);
      ASSERT_EQ(c.Index(size), i) << "d=" << d << " size=" << size;
      ASSERT_EQ(c.RoundUp(size), size);
      ASSERT_EQ(c.Index(previous + 1), i) << "d=" << d;
      ASSERT_EQ(c.RoundUp(previous + 1), size);
      previous = size;
    }
    EXPECT_EQ(previous, HostSizeClasses::kMaxBytes) << "d=" << d;
    EXPECT_EQ(c.Index(HostSizeClasses::kMaxBytes), c.num_classes() - 1);
  }
}

TEST(HostSizeClasses, WasteIsBoundedByOneOverD) {
  std::mt19937_64 rng(42);
  for (int d : {4, 8, 16}) {
    HostSizeClasses c(d);
    for (int n = 0; n < 200000; ++n) {
      const int shift = static_cast<int>(rng() % 47);
      const std::size_t b =
          (std::size_t{1} << shift) + rng() % (std::size_t{1} << shift);
      const std::size_t r = c.RoundUp(b);
      ASSERT_GE(r, b);
      ASSERT_EQ(c.ClassSize(c.Index(b)), r);
      if (b > c.SmallLimit()) {
        ASSERT_LT(static_cast<double>(r - b) / static_cast<double>(b),
                  c.MaxWasteFraction())
            << "b=" << b << " d=" << d;
      } else {
        ASSERT_LT(r - b, HostSizeClasses::kGranuleBytes);
      }
    }
  }
}

TEST(HostSizeClasses, IsConstexpr) {
  constexpr HostSizeClasses c(8);
  static_assert(c.RoundUp(1000) == 1024);
  static_assert(c.ClassSize(c.Index(3000)) == c.RoundUp(3000));
  static_assert(RoundUpPowerOfTwo(3000) == 4096);
  SUCCEED();
}

}  // namespace
}  // namespace ctxpool
