// Tests of CachingDeviceAllocator's tenants (models): budgets after cgroup
// v2's memory.min/high/max on the physical bytes a tenant's streams map, and
// cross-tenant reclaim under device pressure, on SimDriver.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using test::SyncCalls;

class TenantTest : public test::TenantAllocatorTest {};

TEST_P(TenantTest, BadBudgetsAndBindingsAreInvalidArguments) {
  EXPECT_EQ(
      alloc_->RegisterTenant("x", Budget{.min = 10, .max = 5}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->RegisterTenant("", Budget{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  TenantId a = Register("a", Budget{});
  EXPECT_EQ(alloc_->RegisterTenant("a", Budget{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->BindStream(a1_, 99).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  EXPECT_EQ(alloc_->BindStream(a1_, a).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->SetBudget(99, Budget{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->SetBudget(a, Budget{.min = 2, .max = 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->GetTenantStats(99).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Stats(a).num_streams, 1);
  EXPECT_EQ(Stats(kDefaultTenant).name, "default");
}

TEST_P(TenantTest, MaxIsEnforcedPerTenantWhileAnotherKeepsAllocating) {
  TenantId a = Register("model-a", Budget{.max = 24 * kMiB});
  TenantId b = Register("model-b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, b).ok());
  DevicePtr p = Alloc(12 * kMiB, a1_);
  DevicePtr q = Alloc(12 * kMiB, a1_);
  absl::StatusOr<DevicePtr> r = alloc_->Allocate(12 * kMiB, a1_);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(r.status().message().find("model-a"), std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("max is 25165824"), std::string::npos)
      << r.status();
  EXPECT_EQ(Stats(a).num_ooms, 1);
  // The other tenant is unaffected.
  DevicePtr s = Alloc(24 * kMiB, b1_);
  EXPECT_EQ(Stats(b).num_ooms, 0);
  EXPECT_EQ(Stats(b).live_bytes, 24 * kMiB);
  EXPECT_LE(Stats(a).mapped_bytes, 24 * kMiB);
  EXPECT_EQ(Stats(a).peak_mapped_bytes, 24 * kMiB);
  Free(p);
  Free(q);
  Free(s);
}

// An on_oom callback makes room below the tenant's max and retries, and the
// retry fails on the device: its report is the device's, filled afresh, not
// the first attempt's tenant report.
TEST_P(TenantTest, RetryReportsItsOwnFailureNotTheFirstAttempts) {
  std::vector<OomReport> seen;
  DevicePtr held, filler;
  DeviceAllocatorOptions o;
  o.on_oom = [&](const OomReport& r) {
    seen.push_back(r);
    if (seen.size() > 1) return false;
    // The tenant's block goes (it is under its max now), and the default
    // tenant fills the device.
    EXPECT_TRUE(alloc_->Deallocate(held).ok());
    EXPECT_TRUE(alloc_->Trim(0).ok());
    absl::StatusOr<DevicePtr> f =
        alloc_->Allocate(sim_->MemGetInfo()->free_bytes, b1_);
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) filler = *f;
    return true;
  };
  Init(64 * kMiB, std::move(o));
  TenantId a = Register("a", Budget{.max = 30 * kMiB});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  held = Alloc(24 * kMiB, a1_);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(26 * kMiB, a1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_EQ(seen.size(), 1u);  // on_oom is called once per failed Allocate
  EXPECT_TRUE(seen[0].tenant_limit);
  const std::string message(q.status().message());
  EXPECT_EQ(message.find("for tenant"), std::string::npos) << message;
  EXPECT_EQ(message.rfind("out of memory: requested 27262976 bytes", 0), 0u)
      << message;
  EXPECT_NE(message.find(absl::StrCat("device free ",
                                      sim_->MemGetInfo()->free_bytes, " of")),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("bytes of new device memory"), std::string::npos)
      << message;
  Free(filler);
}

TEST_P(TenantTest, MaxTrimsTheTenantsOwnFreeMemoryFirst) {
  TenantId a = Register("a", Budget{.max = 24 * kMiB});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(a2_, a).ok());
  Free(Alloc(20 * kMiB, a1_));  // stays cached on a1
  EXPECT_EQ(Stats(a).cached_bytes, 20 * kMiB);
  DevicePtr p = Alloc(20 * kMiB, a2_);  // needs a1's memory
  EXPECT_LE(Stats(a).mapped_bytes, 24 * kMiB);
  EXPECT_EQ(Stats(a).num_ooms, 0);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
  Free(p);
}

TEST_P(TenantTest, PressureReclaimsOtherTenantsButNeverBelowMin) {
  if (!expandable()) GTEST_SKIP() << "granule reclaim needs kExpandable";
  TenantId a = Register("a", Budget{.min = 16 * kMiB});
  TenantId b = Register("b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  ASSERT_TRUE(alloc_->BindStream(b1_, b).ok());
  Free(Alloc(48 * kMiB, a1_));  // a holds 48 MiB mapped, all free
  // b needs 40 MiB: 16 MiB are free on the device, 24 MiB come from a's
  // free granules; a keeps 24 MiB >= its min.
  DevicePtr p = Alloc(40 * kMiB, b1_);
  EXPECT_EQ(Stats(a).mapped_bytes, 24 * kMiB);
  EXPECT_EQ(Stats(a).reclaimed_from_bytes, 24 * kMiB);
  EXPECT_EQ(Stats(b).reclaimed_by_bytes, 24 * kMiB);
  EXPECT_EQ(SyncCalls(*sim_), 0u);  // no host sync of a's stream
  Free(p);
  // b now asks for more than a can give above its min: a keeps its min.
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(56 * kMiB, b1_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GE(Stats(a).mapped_bytes, 16 * kMiB);
  EXPECT_EQ(Stats(b).num_ooms, 1);
  EXPECT_EQ(Stats(a).num_ooms, 0);
}

TEST_P(TenantTest, HighReturnsGranulesOnFree) {
  if (!expandable()) {
    GTEST_SKIP() << "classic high sheds at check points, not on free: see "
                    "device_allocator_decay_test";
  }
  TenantId a = Register("a", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  Free(Alloc(8 * kMiB, a1_));
  EXPECT_EQ(Stats(a).mapped_bytes, 8 * kMiB);  // kept mapped (cached)
  ASSERT_TRUE(alloc_->SetBudget(a, Budget{.high = 4 * kMiB}).ok());
  DevicePtr keep = Alloc(2 * kMiB, a1_);
  Free(Alloc(6 * kMiB, a1_));
  // Above high: the free gave the free granules back to the device cache.
  EXPECT_EQ(Stats(a).mapped_bytes, 2 * kMiB);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 6 * kMiB);
  Free(keep);
}

TEST_P(TenantTest, LoweringMaxTrimsWhatItCanAndReportsTheRest) {
  TenantId a = Register("a", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  DevicePtr live = Alloc(expandable() ? 8 * kMiB : 20 * kMiB, a1_);
  Free(Alloc(30 * kMiB, a1_));
  const std::size_t live_bytes = Stats(a).live_bytes;
  absl::StatusOr<TrimResult> t = alloc_->SetBudget(a, Budget{.max = 4 * kMiB});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->remaining_bytes, Stats(a).mapped_bytes);
  EXPECT_GE(t->remaining_bytes, live_bytes);
  EXPECT_LT(t->remaining_bytes, live_bytes + 2 * kMiB + 1);
  EXPECT_EQ(t->busy_bytes, t->remaining_bytes - 4 * kMiB);
  EXPECT_GT(t->freed_bytes, 0u);
  absl::StatusOr<DevicePtr> more = alloc_->Allocate(4 * kMiB, a1_);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  Free(live);
}

TEST_P(TenantTest, UnbindMovesWhatTheStreamHoldsToTheDefaultTenant) {
  TenantId a = Register("a", Budget{});
  EXPECT_EQ(alloc_->UnbindStream(a1_).code(),
            absl::StatusCode::kInvalidArgument);  // never bound
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  DevicePtr p = Alloc(1 * kMiB, a1_);
  DevicePtr q = Alloc(1 * kMiB, a1_);
  Free(p);
  const TenantStats held = Stats(a);
  EXPECT_EQ(held.live_bytes, 1 * kMiB);
  EXPECT_GT(held.mapped_bytes, held.live_bytes);
  const TenantStats def = Stats(kDefaultTenant);
  ASSERT_TRUE(alloc_->UnbindStream(a1_).ok());
  EXPECT_EQ(Stats(a).num_streams, 0);
  EXPECT_EQ(Stats(a).mapped_bytes, 0u);
  EXPECT_EQ(Stats(a).live_bytes, 0u);
  EXPECT_EQ(Stats(kDefaultTenant).mapped_bytes,
            def.mapped_bytes + held.mapped_bytes);
  EXPECT_EQ(Stats(kDefaultTenant).live_bytes, def.live_bytes + 1 * kMiB);
  EXPECT_EQ(alloc_->UnbindStream(a1_).code(),
            absl::StatusCode::kInvalidArgument);  // not bound any more
  // The stream can serve another tenant, with what it holds.
  TenantId b = Register("b", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, b).ok());
  EXPECT_EQ(Stats(b).mapped_bytes, held.mapped_bytes);
  Free(q);
  ASSERT_TRUE(alloc_->UnbindStream(a1_).ok());
  // "default" names the default tenant but is not reserved.
  EXPECT_TRUE(alloc_->RegisterTenant("default", Budget{}).ok());
}

TEST_P(TenantTest, UnregisterFreesTheNameAndNeedsNoBoundStream) {
  TenantId a = Register("a", Budget{.max = 8 * kMiB});
  EXPECT_EQ(alloc_->UnregisterTenant(kDefaultTenant).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->UnregisterTenant(99).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
  EXPECT_EQ(alloc_->UnregisterTenant(a).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(alloc_->UnbindStream(a1_).ok());
  ASSERT_TRUE(alloc_->UnregisterTenant(a).ok());
  EXPECT_EQ(alloc_->UnregisterTenant(a).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->GetTenantStats(a).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(alloc_->BindStream(a1_, a).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->SetBudget(a, Budget{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The name is free again, with a fresh budget and fresh counters.
  TenantId again = Register("a", Budget{.min = 1 * kMiB});
  TenantStats st = Stats(again);
  EXPECT_EQ(st.name, "a");
  EXPECT_EQ(st.budget.min, 1 * kMiB);
  EXPECT_EQ(st.budget.max, kNoLimit);
  EXPECT_EQ(st.num_ooms, 0);
  EXPECT_EQ(st.peak_mapped_bytes, 0u);
  ASSERT_TRUE(alloc_->BindStream(a1_, again).ok());
  Free(Alloc(1 * kMiB, a1_));
  EXPECT_GT(Stats(again).mapped_bytes, 0u);
}

// Streams moving between many tenants: each tenant's figures are the sums
// over the streams bound to it now (the per-tenant stream lists, I14, which
// TearDown's CheckInvariants verifies).
TEST_P(TenantTest, ManyTenantsCountTheirOwnStreamsAsTheyMove) {
  Init(1024 * kMiB);  // classic: a 20 MiB segment per stream
  constexpr int kTenants = 12;
  std::vector<TenantId> tenants;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kTenants; ++i) {
    tenants.push_back(Register("t" + std::to_string(i), Budget{}));
    for (int k = 0; k < 2; ++k) {
      streams.push_back(*sim_->StreamCreate(kStreamNonBlocking, 0));
      ASSERT_TRUE(alloc_->BindStream(streams.back(), tenants.back()).ok());
    }
  }
  std::vector<DevicePtr> held;
  for (StreamHandle s : streams) held.push_back(Alloc(3 * kMiB, s));
  // Move the first stream of every even tenant to the next tenant.
  for (int i = 0; i < kTenants; i += 2) {
    ASSERT_TRUE(alloc_->UnbindStream(streams[2 * i]).ok());
    ASSERT_TRUE(alloc_->BindStream(streams[2 * i], tenants[i + 1]).ok());
  }
  std::size_t mapped_sum = 0;
  for (int i = 0; i < kTenants; ++i) {
    const TenantStats st = Stats(tenants[i]);
    const int bound = i % 2 == 0 ? 1 : 3;
    EXPECT_EQ(st.num_streams, bound) << st.name;
    EXPECT_EQ(st.live_bytes, bound * 3 * kMiB) << st.name;
    std::size_t reserved = 0;
    for (int k = 0; k < 2 * kTenants; ++k) {
      const int owner = k / 2;
      const int now = (owner % 2 == 0 && k % 2 == 0) ? owner + 1 : owner;
      if (now == i) reserved += StreamReserved(streams[k]);
    }
    EXPECT_EQ(st.mapped_bytes, reserved) << st.name;
    // The budget path counts the same bytes (SetBudget reports what the
    // tenant holds after trimming to its max; no max here: nothing moves).
    absl::StatusOr<TrimResult> set = alloc_->SetBudget(tenants[i], Budget{});
    ASSERT_TRUE(set.ok()) << set.status();
    EXPECT_EQ(set->remaining_bytes, reserved) << st.name;
    mapped_sum += st.mapped_bytes;
  }
  ASSERT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  EXPECT_EQ(mapped_sum + Stats(kDefaultTenant).mapped_bytes,
            static_cast<std::size_t>(
                alloc_->Stats().total.reserved_bytes[0].current));
  for (DevicePtr p : held) Free(p);
  for (StreamHandle s : streams) ASSERT_TRUE(alloc_->UnbindStream(s).ok());
  for (TenantId t : tenants) EXPECT_TRUE(alloc_->UnregisterTenant(t).ok());
}

INSTANTIATE_TEST_SUITE_P(Backings, TenantTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
