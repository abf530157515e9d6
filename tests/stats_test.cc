#include "ctxpool/core/stats.h"

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

TEST(Stat, TracksCurrentPeakAndTotals) {
  Stat s;
  s.Add(10);
  s.Add(5);
  s.Sub(12);
  EXPECT_EQ(s.current, 3);
  EXPECT_EQ(s.peak, 15);
  EXPECT_EQ(s.allocated, 15);
  EXPECT_EQ(s.freed, 12);
  s.ResetPeak();
  EXPECT_EQ(s.peak, 3);
}

TEST(StatArray, AddStatUpdatesAggregateAndPool) {
  PoolStats stats;
  AddStat(stats.allocated_bytes, /*small=*/true, 512);
  AddStat(stats.allocated_bytes, /*small=*/false, 4096);
  AddStat(stats.allocated_bytes, /*small=*/true, -512);
  const StatArray& a = stats.allocated_bytes;
  EXPECT_EQ(a[StatIndex(StatPool::kAggregate)].current, 4096);
  EXPECT_EQ(a[StatIndex(StatPool::kAggregate)].peak, 4608);
  EXPECT_EQ(a[StatIndex(StatPool::kSmall)].current, 0);
  EXPECT_EQ(a[StatIndex(StatPool::kSmall)].freed, 512);
  EXPECT_EQ(a[StatIndex(StatPool::kLarge)].current, 4096);
  int arrays = 0;
  stats.ForEach([&](StatArray&) { ++arrays; });
  EXPECT_EQ(arrays, 9);
  stats.ResetPeaks();
  EXPECT_EQ(a[StatIndex(StatPool::kAggregate)].peak, 4096);
}

}  // namespace
}  // namespace ctxpool
