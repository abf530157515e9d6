// Tests of CachingDeviceAllocator's decay (options.idle_release_after) and of
// a tenant's high in both backings, on SimDriver with a clock the test moves:
// what decays (an idle stream's free mapped granules, cached granules,
// wholly free classic segments), when (TrimIdle and the slow path of
// Allocate, never the hot path), and that nothing waits for queued work.
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using test::SyncCalls;

constexpr absl::Duration kIdle = absl::Seconds(5);

class DecayTest : public test::TenantAllocatorTest {
 protected:
  void SetUp() override {
    DeviceAllocatorOptions o;
    o.idle_release_after = kIdle;
    Init(64 * kMiB, o);
  }

  TrimResult TrimIdle() {
    absl::StatusOr<TrimResult> t = alloc_->TrimIdle();
    EXPECT_TRUE(t.ok()) << t.status();
    absl::Status inv = alloc_->CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv;
    return t.ok() ? *t : TrimResult();
  }
  // What one free cached block of `bytes` holds: its granules (expandable)
  // or its segment (classic: requests of 4 MiB share 20 MiB segments).
  std::size_t Held(std::size_t bytes) const {
    return expandable() ? bytes : 20 * kMiB;
  }
};

class ClassicDecayTest : public DecayTest {};

TEST_P(DecayTest, TheHotPathNeverReadsTheClock) {
  Free(Alloc(4 * kMiB, a1_));
  TrimIdle();
  const int reads = clock_reads_;
  for (int i = 0; i < 100; ++i) Free(Alloc(4 * kMiB, a1_));
  EXPECT_EQ(clock_reads_, reads);
  TrimIdle();
  EXPECT_GT(clock_reads_, reads);  // a check point reads it
}

TEST_P(DecayTest, IdleMemoryDecaysWhileABusyStreamKeepsItsOwn) {
  DevicePtr p = Alloc(4 * kMiB, a1_);
  DevicePtr q = Alloc(4 * kMiB, b1_);
  Free(p);
  Free(q);
  TrimResult t = TrimIdle();  // first check: stamps, releases nothing
  EXPECT_EQ(t.freed_bytes, 0u);
  EXPECT_EQ(StreamReserved(a1_), Held(4 * kMiB));
  EXPECT_EQ(StreamReserved(b1_), Held(4 * kMiB));
  for (int i = 0; i < 2; ++i) {  // 4 s: not idle long enough
    now_ += absl::Seconds(2);
    Free(Alloc(4 * kMiB, b1_));  // b1 stays busy (cached hot path)
    EXPECT_EQ(TrimIdle().freed_bytes, 0u);
    EXPECT_EQ(StreamReserved(a1_), Held(4 * kMiB));
  }
  now_ += absl::Seconds(2);  // a1 idle for 6 s
  Free(Alloc(4 * kMiB, b1_));
  t = TrimIdle();
  EXPECT_EQ(StreamReserved(a1_), 0u);
  EXPECT_EQ(StreamReserved(b1_), Held(4 * kMiB));
  if (expandable()) {
    // Unmapped into the granule cache, which decays in turn.
    EXPECT_EQ(t.freed_bytes, 0u);
    EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 4 * kMiB);
    EXPECT_EQ(t.remaining_bytes, 8 * kMiB);
    now_ += absl::Seconds(6);
    Free(Alloc(4 * kMiB, b1_));
    t = TrimIdle();
    EXPECT_EQ(t.freed_bytes, 4 * kMiB);
    EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
    EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 2u);
  } else {
    EXPECT_EQ(t.freed_bytes, 20 * kMiB);
    EXPECT_EQ(sim_->call_count(SimCall::kMemFree), 1u);
  }
  EXPECT_EQ(t.remaining_bytes, Held(4 * kMiB));
  EXPECT_EQ(StreamReserved(b1_), Held(4 * kMiB));
  // Once b1 rests too, its memory decays as well.
  now_ += absl::Seconds(6);
  TrimIdle();
  now_ += absl::Seconds(6);
  TrimIdle();
  EXPECT_EQ(StreamReserved(b1_), 0u);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 0);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
}

TEST_P(DecayTest, QueuedWorkDelaysDecayUntilItFinishes) {
  sim_->Hold(a1_);
  Free(Alloc(4 * kMiB, a1_));  // the work touching it is still queued
  TrimIdle();
  now_ += absl::Seconds(6);
  TrimResult t = TrimIdle();
  EXPECT_EQ(t.freed_bytes, 0u);
  EXPECT_EQ(t.busy_bytes, Held(4 * kMiB));
  EXPECT_EQ(StreamReserved(a1_), Held(4 * kMiB));
  EXPECT_EQ(SyncCalls(*sim_), 0u);  // skipped, not waited for
  sim_->Release(a1_);
  t = TrimIdle();
  EXPECT_EQ(t.busy_bytes, 0u);
  EXPECT_EQ(StreamReserved(a1_), 0u);
  EXPECT_EQ(t.freed_bytes, expandable() ? 0u : 20 * kMiB);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
}

TEST_P(DecayTest, TheSlowPathOfAllocateIsACheckPoint) {
  // Two tenants, so that b's growth does not compact a's memory itself.
  ASSERT_TRUE(alloc_->BindStream(a1_, Register("a", Budget{})).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, Register("b", Budget{})).ok());
  Free(Alloc(4 * kMiB, a1_));
  DevicePtr keep = Alloc(1 * kMiB, b1_);
  TrimIdle();
  now_ += absl::Seconds(6);
  // A cache miss on b1 (a size nothing cached serves) runs the check after
  // it is served.
  DevicePtr big = Alloc(30 * kMiB, b1_);
  ASSERT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_EQ(StreamReserved(a1_), 0u);
  if (expandable()) {
    EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 4 * kMiB);
  } else {
    EXPECT_EQ(sim_->call_count(SimCall::kMemFree), 1u);
  }
  Free(big);
  Free(keep);
}

TEST_P(DecayTest, MemoryTakenAgainStartsIdleAfresh) {
  Free(Alloc(4 * kMiB, a1_));
  TrimIdle();
  now_ += absl::Seconds(4);
  Free(Alloc(4 * kMiB, a1_));  // used again just before the deadline
  now_ += absl::Seconds(2);
  TrimIdle();  // 6 s after the first stamp, 2 s after the use
  EXPECT_EQ(StreamReserved(a1_), Held(4 * kMiB));
  now_ += absl::Seconds(4);
  TrimIdle();  // 4 s after the check that saw the use
  EXPECT_EQ(StreamReserved(a1_), Held(4 * kMiB));
  now_ += absl::Seconds(2);
  TrimIdle();
  EXPECT_EQ(StreamReserved(a1_), 0u);
}

TEST_P(ClassicDecayTest, PartlyUsedSegmentsDoNotDecay) {
  DevicePtr p = Alloc(2 * kMiB, a1_);
  Free(Alloc(3 * kMiB, a1_));  // same 20 MiB segment as p
  TrimIdle();
  now_ += absl::Seconds(60);
  EXPECT_EQ(TrimIdle().freed_bytes, 0u);
  EXPECT_EQ(StreamReserved(a1_), 20 * kMiB);
  Free(p);  // wholly free from now on
  TrimIdle();
  now_ += absl::Seconds(6);
  EXPECT_EQ(TrimIdle().freed_bytes, 20 * kMiB);
}

TEST_P(ClassicDecayTest, HighShedsWholeFreeSegmentsAtCheckPointsNotOnFree) {
  TenantId a = Register("a", Budget{.high = 16 * kMiB});
  TenantId b = Register("b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(a2_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, b).ok());
  // Requests >= 10 MiB get segments of their own.
  DevicePtr p = Alloc(12 * kMiB, a1_);
  DevicePtr q = Alloc(12 * kMiB, a1_);
  DevicePtr r = Alloc(12 * kMiB, a2_);
  Free(Alloc(12 * kMiB, b1_));
  Free(q);
  Free(r);
  // Deallocate makes no driver call (cuMemFree synchronises the device).
  EXPECT_EQ(sim_->call_count(SimCall::kMemFree), 0u);
  EXPECT_EQ(Stats(a).mapped_bytes, 36 * kMiB);
  TrimResult t = TrimIdle();
  // a sheds its wholly free segments down to high; p stays (live), and b,
  // without a high, keeps its cached segment.
  EXPECT_EQ(t.freed_bytes, 24 * kMiB);
  EXPECT_EQ(t.remaining_bytes, 24 * kMiB);
  EXPECT_EQ(Stats(a).mapped_bytes, 12 * kMiB);
  EXPECT_EQ(Stats(b).mapped_bytes, 12 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemFree), 2u);
  ASSERT_TRUE(alloc_->Trim(0).ok());  // b's cached segment goes too
  // The slow path of Allocate is a check point too; a stream with queued
  // work is skipped, not waited for.
  sim_->Hold(a1_);
  Free(Alloc(12 * kMiB, a1_));  // a holds 24 MiB, 12 MiB of them cached
  EXPECT_EQ(Stats(a).mapped_bytes, 24 * kMiB);
  DevicePtr u = Alloc(14 * kMiB, a2_);  // a miss: a new segment, a check
  ASSERT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_EQ(Stats(a).mapped_bytes, 38 * kMiB);  // a1's is busy: kept
  const std::uint64_t frees = sim_->call_count(SimCall::kMemFree);
  sim_->Release(a1_);
  t = TrimIdle();
  EXPECT_EQ(t.freed_bytes, 12 * kMiB);
  EXPECT_EQ(Stats(a).mapped_bytes, 26 * kMiB);  // live, above high
  // Largest first, and only down to high.
  Free(u);
  Free(p);
  t = TrimIdle();
  EXPECT_EQ(t.freed_bytes, 14 * kMiB);
  EXPECT_EQ(Stats(a).mapped_bytes, 12 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemFree), frees + 2);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
}

INSTANTIATE_TEST_SUITE_P(Backings, DecayTest, test::kBothBackings,
                         test::BackingName);
INSTANTIATE_TEST_SUITE_P(Backings, ClassicDecayTest,
                         ::testing::Values(BackingMode::kClassic),
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
