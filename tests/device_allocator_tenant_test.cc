// Tests of CachingDeviceAllocator's tenants (models): budgets after cgroup
// v2's memory.min/high/max on the physical bytes a tenant's streams map, and
// cross-tenant reclaim under device pressure, on SimDriver.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

std::uint64_t SyncCalls(const SimDriver& sim) {
  return sim.call_count(SimCall::kEventSynchronize) +
         sim.call_count(SimCall::kStreamSynchronize) +
         sim.call_count(SimCall::kCtxSynchronize);
}

class TenantTest : public ::testing::TestWithParam<BackingMode> {
 protected:
  void SetUp() override { Init(64 * kMiB); }

  void Init(std::size_t capacity) {
    alloc_.reset();
    SimDeviceSpec spec;
    spec.capacity_bytes = capacity;
    spec.context_overhead_bytes = 0;
    sim_ = SimDriver::Create({.devices = {spec}});
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    a1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    a2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    b1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    DeviceAllocatorOptions o;
    o.backing = GetParam();
    auto a = CachingDeviceAllocator::Create(*sim_, 0, o);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(*a);
  }

  void TearDown() override {
    if (alloc_ != nullptr) {
      absl::Status inv = alloc_->CheckInvariants();
      EXPECT_TRUE(inv.ok()) << inv;
    }
    alloc_.reset();
    EXPECT_EQ(sim_->race_count(), 0u);
    EXPECT_EQ(sim_->misuse_count(), 0u);
  }

  TenantId Register(const std::string& name, Budget b) {
    absl::StatusOr<TenantId> t = alloc_->RegisterTenant(name, b);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : kDefaultTenant;
  }
  DevicePtr Alloc(std::size_t bytes, StreamHandle s) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return DevicePtr();
    EXPECT_TRUE(sim_->Touch(s, *p, bytes).ok());
    return *p;
  }
  void Free(DevicePtr p) { EXPECT_TRUE(alloc_->Deallocate(p).ok()); }
  TenantStats Stats(TenantId t) {
    absl::StatusOr<TenantStats> s = alloc_->GetTenantStats(t);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : TenantStats();
  }
  bool expandable() const { return GetParam() == BackingMode::kExpandable; }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle a1_, a2_, b1_;
  std::unique_ptr<CachingDeviceAllocator> alloc_;
};

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
  if (!expandable()) GTEST_SKIP() << "high applies to kExpandable";
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

INSTANTIATE_TEST_SUITE_P(Backings, TenantTest,
                         ::testing::Values(BackingMode::kClassic,
                                           BackingMode::kExpandable),
                         [](const auto& info) {
                           return info.param == BackingMode::kClassic
                                      ? std::string("Classic")
                                      : std::string("Expandable");
                         });

}  // namespace
}  // namespace ctxpool
