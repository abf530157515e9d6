// Driver faults and tenant protection in CachingDeviceAllocator, in both
// backings: an event query that fails must never count as "the other stream
// is done"; a failed free must never drop memory from the books; a tenant's
// min must hold against other tenants' cross-stream reuse, and what is taken
// under pressure is counted.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

class DeviceAllocatorFaultTest : public test::TenantAllocatorTest {
 protected:
  // Orders `to`'s later work after `from`'s work so far, as a program that
  // hands a tensor from one stream to another does.
  void Order(StreamHandle from, StreamHandle to) {
    absl::StatusOr<EventHandle> e = sim_->EventCreate(0);
    ASSERT_TRUE(e.ok()) << e.status();
    ASSERT_TRUE(sim_->EventRecord(*e, from).ok());
    ASSERT_TRUE(sim_->StreamWaitEvent(to, *e).ok());
    ASSERT_TRUE(sim_->EventDestroy(*e).ok());
  }
  // The call that gives a cached segment's memory back in this backing.
  SimCall FreeCall() const {
    return expandable() ? SimCall::kMemUnmap : SimCall::kMemFree;
  }
};

// A block freed while another (held) stream still uses it must not be handed
// out again when the query of that stream's event fails: an error is not a
// completion. The race detector would see the reuse.
TEST_P(DeviceAllocatorFaultTest, EventQueryErrorKeepsBlockPending) {
  Init(1 * kGiB);
  const DevicePtr p = Alloc(12 * kMiB, a1_);
  Order(a1_, b1_);
  sim_->Hold(b1_);
  ASSERT_TRUE(sim_->Touch(b1_, p, 12 * kMiB).ok());
  ASSERT_TRUE(alloc_->RecordStream(p, b1_).ok());
  Free(p);
  sim_->InjectFault(SimCall::kEventQuery, 1, cu::kErrorLaunchFailed);
  const DevicePtr q = Alloc(12 * kMiB, a1_);
  EXPECT_NE(q.address(), p.address());
  EXPECT_GE(alloc_->Stats().driver_errors, 1);
  EXPECT_EQ(sim_->race_count(), 0u);
  sim_->Release(b1_);
  Free(q);
  // Once the event completes the block is reusable again.
  const DevicePtr r = Alloc(12 * kMiB, a1_);
  Free(r);
  EXPECT_TRUE(alloc_->Reset(false).ok());
}

// A persistent query error never frees the block; Reset(force) drops it and
// nothing leaks.
TEST_P(DeviceAllocatorFaultTest, PersistentEventQueryErrorLeaksNothing) {
  Init(1 * kGiB);
  const DevicePtr p = Alloc(4 * kMiB, a1_);
  Order(a1_, b1_);
  sim_->Hold(b1_);
  ASSERT_TRUE(sim_->Touch(b1_, p, 4 * kMiB).ok());
  ASSERT_TRUE(alloc_->RecordStream(p, b1_).ok());
  Free(p);
  sim_->InjectFault(SimCall::kEventQuery, 1000, cu::kErrorLaunchFailed);
  const DevicePtr q = Alloc(4 * kMiB, a1_);
  EXPECT_NE(q.address(), p.address());
  Free(q);
  EXPECT_EQ(sim_->race_count(), 0u);
  sim_->InjectFault(SimCall::kEventQuery, 0, 0);
  sim_->Release(b1_);
  EXPECT_TRUE(alloc_->Reset(true).ok());
  alloc_.reset();
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// Reset(false) whose free fails keeps the memory on the books; the next
// Reset gives it back.
TEST_P(DeviceAllocatorFaultTest, ResetKeepsSegmentWhoseFreeFailed) {
  Init(1 * kGiB);
  Free(Alloc(64 * kMiB, a1_));
  const SimCall free_call = FreeCall();
  sim_->InjectFault(free_call, 1, cu::kErrorLaunchFailed);
  EXPECT_FALSE(alloc_->Reset(false).ok());
  ASSERT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Reset(false).ok());
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 0);
  EXPECT_EQ(alloc_->Stats().leaked_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// Reset(force) cannot keep what it cannot free: the loss is counted.
TEST_P(DeviceAllocatorFaultTest, ForcedResetCountsWhatItCouldNotFree) {
  Init(1 * kGiB);
  Free(Alloc(64 * kMiB, a1_));
  const SimCall free_call = FreeCall();
  sim_->InjectFault(free_call, 1000, cu::kErrorLaunchFailed);
  EXPECT_FALSE(alloc_->Reset(true).ok());
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 0);
  EXPECT_EQ(alloc_->Stats().leaked_bytes, sim_->used_bytes(0));
  EXPECT_GE(alloc_->Stats().leaked_bytes, 64 * kMiB);
  sim_->InjectFault(free_call, 0, 0);
}

// Tenant A caches 4 GiB with min 4 GiB; tenant B allocating 2 GiB on a device
// with plenty of free memory must not take A's cache.
TEST_P(DeviceAllocatorFaultTest, MinProtectedFromReuseWithoutPressure) {
  Init(24 * kGiB);
  const TenantId a = Register("a", Budget{.min = 4 * kGiB});
  const TenantId b = Register("b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, b).ok());
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(Alloc(1 * kGiB, a1_));
  for (DevicePtr p : ps) Free(p);
  ps.clear();
  for (int i = 0; i < 2; ++i) ps.push_back(Alloc(1 * kGiB, b1_));
  EXPECT_EQ(Stats(a).mapped_bytes, 4 * kGiB);
  EXPECT_EQ(Stats(a).reclaimed_from_bytes, 0u);
  EXPECT_EQ(Stats(b).reclaimed_by_bytes, 0u);
  for (DevicePtr p : ps) Free(p);
}

// Under pressure B takes A's cache down to A's min and no further, and both
// sides count it.
TEST_P(DeviceAllocatorFaultTest, PressureReclaimsDownToMinAndCountsIt) {
  Init(8 * kGiB);
  const TenantId a = Register("a", Budget{.min = 2 * kGiB});
  const TenantId b = Register("b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, b).ok());
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(Alloc(1 * kGiB, a1_));
  for (DevicePtr p : ps) Free(p);
  ps.clear();
  for (int i = 0; i < 6; ++i) ps.push_back(Alloc(1 * kGiB, b1_));
  EXPECT_GE(Stats(a).mapped_bytes, 2 * kGiB);
  EXPECT_GE(Stats(a).reclaimed_from_bytes, 2 * kGiB);
  EXPECT_EQ(Stats(a).reclaimed_from_bytes, Stats(b).reclaimed_by_bytes);
  // A's min is all that is left: the next one fails.
  absl::StatusOr<DevicePtr> more = alloc_->Allocate(1 * kGiB, b1_);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GE(Stats(a).mapped_bytes, 2 * kGiB);
  for (DevicePtr p : ps) Free(p);
}

// A stream retired before its destruction: its memory is reused by other
// streams after the retire event, and the dead handle never reaches the
// driver again (a recycled handle could name another stream).
TEST_P(DeviceAllocatorFaultTest, RetiredStreamHandleIsNeverUsedAgain) {
  Init(1 * kGiB);
  StreamHandle s3 = *sim_->StreamCreate(kStreamNonBlocking, 0);
  sim_->Hold(s3);
  const DevicePtr p = Alloc(4 * kMiB, s3);  // touched on s3, still pending
  Free(p);
  ASSERT_TRUE(alloc_->RetireStream(s3).ok());
  sim_->Release(s3);
  ASSERT_TRUE(sim_->StreamDestroy(s3).ok());
  const std::uint64_t records = sim_->call_count(SimCall::kEventRecord);
  // Under pressure (or Trim) the memory moves on; with no misuse (no call
  // with the dead handle) and no race.
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  Free(Alloc(4 * kMiB, a1_));
  EXPECT_EQ(sim_->call_count(SimCall::kEventRecord), records);
  EXPECT_EQ(sim_->misuse_count(), 0u);
  EXPECT_EQ(alloc_->Stats().destroyed_streams, 0);
  // Retiring twice, or a stream never seen, is fine.
  EXPECT_TRUE(alloc_->RetireStream(s3).ok());
  StreamHandle unseen = *sim_->StreamCreate(kStreamNonBlocking, 0);
  EXPECT_TRUE(alloc_->RetireStream(unseen).ok());
}

// Classic: another stream takes a retired stream's wholly free segment,
// ordered by the retire event (a stream wait, no host synchronise).
TEST_P(DeviceAllocatorFaultTest, RetiredStreamSegmentMovesByItsEvent) {
  Init(1 * kGiB);
  StreamHandle s3 = *sim_->StreamCreate(kStreamNonBlocking, 0);
  sim_->Hold(s3);
  const DevicePtr p = Alloc(4 * kMiB, s3);
  Free(p);
  ASSERT_TRUE(alloc_->RetireStream(s3).ok());
  const std::uint64_t syncs = test::SyncCalls(*sim_);
  const DevicePtr q = Alloc(4 * kMiB, a1_);  // ordered after s3's kernel
  if (!expandable()) {
    EXPECT_EQ(q, p);
  }
  EXPECT_EQ(test::SyncCalls(*sim_), syncs);
  sim_->Release(s3);
  ASSERT_TRUE(sim_->StreamDestroy(s3).ok());
  Free(q);
  EXPECT_EQ(sim_->race_count(), 0u);
}

// A retired handle that comes back (the same stream kept, in this test)
// orders its first new work after the retire event, once.
TEST_P(DeviceAllocatorFaultTest, RetiredHandleInUseAgainWaitsOnce) {
  Init(1 * kGiB);
  const DevicePtr p = Alloc(4 * kMiB, a2_);
  Free(p);
  ASSERT_TRUE(alloc_->RetireStream(a2_).ok());
  const std::uint64_t waits = sim_->call_count(SimCall::kStreamWaitEvent);
  Free(Alloc(4 * kMiB, a2_));
  Free(Alloc(4 * kMiB, a2_));
  EXPECT_EQ(sim_->call_count(SimCall::kStreamWaitEvent), waits + 1);
}

// A stream the allocator saw only through RecordStream is retired too: the
// block's free later records nothing on the dead handle.
TEST_P(DeviceAllocatorFaultTest, RetireCoversAStreamSeenOnlyByRecordStream) {
  Init(1 * kGiB);
  const DevicePtr p = Alloc(1000, a1_);
  ASSERT_TRUE(alloc_->RecordStream(p, a2_).ok());
  ASSERT_TRUE(alloc_->RetireStream(a2_).ok());
  ASSERT_TRUE(sim_->StreamDestroy(a2_).ok());
  Free(p);
  EXPECT_EQ(sim_->misuse_count(), 0u)
      << (sim_->misuse_count() != 0 ? sim_->misuse_log().back() : "");
}

// Expandable: a granule whose access failed and whose rollback unmap failed
// once is unmapped on the retry, so its address is never mapped twice.
TEST_P(DeviceAllocatorFaultTest, FailedSetAccessRollsTheMapBack) {
  Init(1 * kGiB);
  sim_->InjectFault(SimCall::kMemSetAccess, 1, cu::kErrorUnknown);
  sim_->InjectFault(SimCall::kMemUnmap, 1, cu::kErrorUnknown);
  const std::size_t small = 1000;
  absl::StatusOr<DevicePtr> failed = alloc_->Allocate(small, a1_);
  if (expandable()) {
    EXPECT_FALSE(failed.ok());
  }
  if (failed.ok()) Free(*failed);
  sim_->InjectFault(SimCall::kMemSetAccess, 0, 0);
  sim_->InjectFault(SimCall::kMemUnmap, 0, 0);
  const DevicePtr q = Alloc(small, a1_);
  const DevicePtr r = Alloc(3 * kMiB, a1_);
  EXPECT_EQ(sim_->misuse_count(), 0u)
      << (sim_->misuse_count() != 0 ? sim_->misuse_log().back() : "");
  Free(q);
  Free(r);
}

// Decided: on_oom is called for a tenant's max as for the device (PyTorch
// calls its OOM observers for every OOM); the report says which, and a
// callback that frees the tenant's memory gets the retry.
TEST_P(DeviceAllocatorFaultTest, OnOomSeesTenantMaxFailures) {
  std::vector<OomReport> reports;
  std::vector<DevicePtr>* held = nullptr;
  DeviceAllocatorOptions o;
  o.on_oom = [&](const OomReport& r) {
    reports.push_back(r);
    if (held == nullptr || held->empty()) return false;
    EXPECT_TRUE(alloc_->Deallocate(held->back()).ok());
    held->pop_back();
    return true;
  };
  Init(1 * kGiB, std::move(o));
  const TenantId a = Register("capped", Budget{.max = 64 * kMiB});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 2; ++i) ps.push_back(Alloc(32 * kMiB, a1_));
  absl::StatusOr<DevicePtr> over = alloc_->Allocate(32 * kMiB, a1_);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()),
              ::testing::HasSubstr("tenant 'capped'"));
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_TRUE(reports[0].tenant_limit);
  EXPECT_EQ(reports[0].tenant, "capped");
  EXPECT_EQ(reports[0].tenant_max_bytes, 64 * kMiB);
  EXPECT_EQ(Stats(a).num_ooms, 1);
  EXPECT_EQ(alloc_->Stats().num_ooms, 1);
  // The callback frees one of the tenant's blocks: the retry succeeds.
  held = &ps;
  absl::StatusOr<DevicePtr> retried = alloc_->Allocate(32 * kMiB, a1_);
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(reports.size(), 2u);
  EXPECT_EQ(Stats(a).num_ooms, 1);
  ps.push_back(*retried);
  for (DevicePtr p : ps) Free(p);
}

INSTANTIATE_TEST_SUITE_P(Backings, DeviceAllocatorFaultTest,
                         test::kBothBackings, test::BackingName);

// Expandable: a piece that can be neither given access nor unmapped stays
// mapped on the books but is never handed out (nor extended), since touching
// it would fault.
class StuckPieceTest : public test::DeviceAllocatorFixture {};

TEST_F(StuckPieceTest, GranuleWithoutAccessIsNeverHandedOut) {
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  InitAllocator(64 * kMiB, o);
  sim_->InjectFault(SimCall::kMemSetAccess, 2, cu::kErrorOutOfMemory);
  sim_->InjectFault(SimCall::kMemUnmap, 2, cu::kErrorOutOfMemory);
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(8 * kMiB, a1_);
  sim_->InjectFault(SimCall::kMemSetAccess, 0, 0);
  sim_->InjectFault(SimCall::kMemUnmap, 0, 0);
  if (p.ok()) {
    EXPECT_TRUE(sim_->Touch(a1_, *p, 8 * kMiB).ok());
    Free(*p);
  }
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<DevicePtr> q = alloc_->Allocate(1 * kMiB, a1_);
    ASSERT_TRUE(q.ok()) << q.status();
    EXPECT_TRUE(sim_->Touch(a1_, *q, 1 * kMiB).ok());
  }
  EXPECT_EQ(sim_->misuse_count(), 0u) << sim_->misuse_log().back();
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  EXPECT_TRUE(alloc_->Reset(true).ok());
}

TEST_F(StuckPieceTest, UnknownErrorsToo) {
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  InitAllocator(64 * kMiB, o);
  sim_->InjectFault(SimCall::kMemSetAccess, 2, 999);
  sim_->InjectFault(SimCall::kMemUnmap, 2, 999);
  EXPECT_FALSE(alloc_->Allocate(1 * kMiB, a1_).ok());
  sim_->InjectFault(SimCall::kMemSetAccess, 0, 0);
  sim_->InjectFault(SimCall::kMemUnmap, 0, 0);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(1 * kMiB, a1_);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(sim_->Touch(a1_, *q, 1 * kMiB).ok());
  EXPECT_EQ(sim_->misuse_count(), 0u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  Free(*q);
  // Trim tries the stuck granule again; Reset gives everything back.
  EXPECT_TRUE(alloc_->Reset(false).ok());
  alloc_.reset();
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// Decay releases only what has been cached for idle_release_after: a stale
// physical allocation pinned by a mapped granule stays, and fresh ones are
// not released in its place.
class DecayPinnedTest : public test::DeviceAllocatorFixture {};

TEST_F(DecayPinnedTest, DecayNeverReleasesFreshAllocations) {
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  o.idle_release_after = absl::Seconds(10);
  // 80 GiB: units of 32 granules (64 MiB, 1/1024 of the headroom).
  InitAllocator(80 * kGiB, o);
  DevicePtr e = Alloc(128 * kMiB, a2_);  // two units
  DevicePtr a = Alloc(64 * kMiB, a1_);   // one unit, A
  Free(a);
  ASSERT_TRUE(alloc_->Trim(kGiB).ok());  // A cached whole at t=0
  ASSERT_EQ(alloc_->Stats().granule_cache_bytes, 64 * kMiB);
  DevicePtr b = Alloc(4 * kMiB, a1_);  // maps 8 granules of A (16 MiB ahead)
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 48 * kMiB);
  now_ += absl::Seconds(20);
  Free(e);
  ASSERT_TRUE(alloc_->Trim(kGiB).ok());  // e's units cached at t=20
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 176 * kMiB);
  now_ += absl::Seconds(5);  // t=25: only A's rest is stale, and A is pinned
  absl::StatusOr<TrimResult> r = alloc_->TrimIdle();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->freed_bytes, 0u);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 176 * kMiB);
  now_ += absl::Seconds(10);  // t=35: e's units are stale too
  r = alloc_->TrimIdle();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->freed_bytes, 128 * kMiB);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 48 * kMiB);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(b);
}

}  // namespace
}  // namespace ctxpool
