// Tests of CachingDeviceAllocator after fork(), in both backings, on
// SimDriver: in a process forked after Create every Status-returning call
// fails with ForkGuard's FAILED_PRECONDITION and makes no driver call, the
// destructor leaks the parent's driver objects, and an allocator created in
// the child after the fork works. The child runs plain code and exits with
// the number of its first failed check (see tests/alloc_test_support.h).
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "alloc_test_support.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using testing_internal::FirstNonForkError;
using testing_internal::NoDriverCallThroughDestruction;
using testing_internal::RunInForkedChild;
using testing_internal::TotalDriverCalls;

constexpr int kAgg = static_cast<int>(StatPool::kAggregate);

class DeviceAllocatorForkTest : public test::TenantAllocatorTest {};

// What the child sees: `live` is a live block on `stream`, `tenant` a
// registered tenant bound to `stream`, `idle` a stream bound to nothing.
int ChildChecks(SimDriver& sim, std::unique_ptr<CachingDeviceAllocator> alloc,
                DevicePtr live, StreamHandle stream, StreamHandle idle,
                TenantId tenant) {
  const std::uint64_t calls = TotalDriverCalls(sim);
  const int refs = sim.primary_ctx_refcount(0);
  const DeviceAllocatorStats before = alloc->Stats();
  if (int bad = FirstNonForkError({
          {alloc->Allocate(4096, stream).status(),
           "CachingDeviceAllocator::Allocate"},
          {alloc->Allocate(64 * kMiB, stream).status(),  // a slow-path size
           "CachingDeviceAllocator::Allocate"},
          {alloc->Deallocate(live), "CachingDeviceAllocator::Deallocate"},
          {alloc->RecordStream(live, idle),
           "CachingDeviceAllocator::RecordStream"},
          {alloc->Trim().status(), "CachingDeviceAllocator::Trim"},
          {alloc->TrimIdle().status(), "CachingDeviceAllocator::TrimIdle"},
          {alloc->RegisterTenant("child", Budget{}).status(),
           "CachingDeviceAllocator::RegisterTenant"},
          {alloc->BindStream(idle, tenant),
           "CachingDeviceAllocator::BindStream"},
          {alloc->UnbindStream(stream), "CachingDeviceAllocator::UnbindStream"},
          {alloc->UnregisterTenant(tenant),
           "CachingDeviceAllocator::UnregisterTenant"},
          {alloc->SetBudget(tenant, Budget{.max = 0}).status(),
           "CachingDeviceAllocator::SetBudget"},
          {alloc->GetTenantStats(tenant).status(),
           "CachingDeviceAllocator::GetTenantStats"},
          {alloc->Lookup(live).status(), "CachingDeviceAllocator::Lookup"},
          {alloc->Reset(/*force=*/true), "CachingDeviceAllocator::Reset"},
          {alloc->CheckInvariants(), "CachingDeviceAllocator::CheckInvariants"},
      });
      bad != 0) {
    return bad;  // 1..15
  }
  // The refused calls changed no bookkeeping; Stats still reads it.
  const DeviceAllocatorStats after = alloc->Stats();
  if (after.total.allocation[kAgg].current !=
          before.total.allocation[kAgg].current ||
      after.total.reserved_bytes[kAgg].current !=
          before.total.reserved_bytes[kAgg].current ||
      after.invalid_frees != 0 || after.invalid_requests != 0 ||
      after.num_trims != before.num_trims) {
    return 20;
  }
  // The destructor would Reset (synchronise, free segments or unmap
  // granules), destroy pooled events and release the primary context: in
  // the child it leaks all of it.
  if (int bad = NoDriverCallThroughDestruction(sim, calls, refs,
                                               [&] { alloc.reset(); });
      bad != 0) {
    return 20 + bad;  // 21..23
  }
  if (sim.misuse_count() != 0) return 24;
  // The post-fork pattern: an allocator created in the child works.
  absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> fresh =
      CachingDeviceAllocator::Create(sim, 0);
  if (!fresh.ok()) return 30;
  absl::StatusOr<DevicePtr> p = (*fresh)->Allocate(4096, stream);
  if (!p.ok()) return 31;
  if (!(*fresh)->Deallocate(*p).ok()) return 32;
  if (!(*fresh)->CheckInvariants().ok()) return 33;
  return 0;
}

TEST_P(DeviceAllocatorForkTest, ForkedChildGetsFailedPreconditionAndLeaks) {
  TenantId a = Register("a", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  DevicePtr live = Alloc(1 * kMiB, a1_);
  // Cached memory, and a pending free: used on a held stream with work on
  // it, so the destructor's Reset would have to wait for it.
  Free(Alloc(4 * kMiB, a1_));
  DevicePtr pending = Alloc(8192, a1_);
  ASSERT_TRUE(alloc_->RecordStream(pending, b1_).ok());
  // The caller orders b1's use after a1's, as with any cross-stream use.
  absl::StatusOr<EventHandle> ordered = sim_->EventCreate(0);
  ASSERT_TRUE(ordered.ok()) << ordered.status();
  ASSERT_TRUE(sim_->EventRecord(*ordered, a1_).ok());
  ASSERT_TRUE(sim_->StreamWaitEvent(b1_, *ordered).ok());
  ASSERT_TRUE(sim_->EventDestroy(*ordered).ok());
  sim_->Hold(b1_);
  ASSERT_TRUE(sim_->Touch(b1_, pending, 8192).ok());
  Free(pending);
  const std::uint64_t parent_calls = TotalDriverCalls(*sim_);
  const int parent_refs = sim_->primary_ctx_refcount(0);

  const int code = RunInForkedChild(
      [&] { return ChildChecks(*sim_, std::move(alloc_), live, a1_, a2_, a); });
  EXPECT_EQ(code, 0) << "check " << code << " failed in the child";

  // The parent's allocator is untouched and keeps working.
  ASSERT_NE(alloc_, nullptr);
  EXPECT_EQ(TotalDriverCalls(*sim_), parent_calls);
  EXPECT_EQ(sim_->primary_ctx_refcount(0), parent_refs);
  absl::StatusOr<BlockInfo> info = alloc_->Lookup(live);
  ASSERT_TRUE(info.ok()) << info.status();
  Free(live);
  sim_->Release(b1_);
  absl::StatusOr<TrimResult> trimmed = alloc_->Trim();
  ASSERT_TRUE(trimmed.ok()) << trimmed.status();
  EXPECT_EQ(StreamReserved(a1_), 0u);
  ASSERT_TRUE(alloc_->UnbindStream(a1_).ok());
  ASSERT_TRUE(alloc_->UnregisterTenant(a).ok());
}

INSTANTIATE_TEST_SUITE_P(Backings, DeviceAllocatorForkTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
