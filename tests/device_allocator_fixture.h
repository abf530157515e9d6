// device_allocator_fixture.h — the test fixtures of CachingDeviceAllocator's
// tenant, VMM and decay tests: a SimDriver device, three streams (a1 and a2
// for one model, b1 for another), an allocator and a clock the test moves by
// hand. DeviceAllocatorFixture takes the backing from the options given to
// Init; TenantAllocatorTest makes it the test parameter.
//
//   class MyTest : public test::TenantAllocatorTest {};
//   TEST_P(MyTest, Works) {
//     TenantId a = Register("a", Budget{.high = 4 * kMiB});
//     ASSERT_TRUE(alloc_->BindStream(a1_, a).ok());
//     Free(Alloc(8 * kMiB, a1_));
//     now_ += absl::Seconds(10);
//   }
//   INSTANTIATE_TEST_SUITE_P(Backings, MyTest, kBothBackings,
//                            BackingName);
//
// TearDown checks the allocator's invariants and that the simulated GPU saw
// no race and no misuse.
#ifndef CTXPOOL_TESTS_DEVICE_ALLOCATOR_FIXTURE_H_
#define CTXPOOL_TESTS_DEVICE_ALLOCATOR_FIXTURE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace test {

// Host synchronises of any kind the allocator made on the simulated GPU.
inline std::uint64_t SyncCalls(const SimDriver& sim) {
  return sim.call_count(SimCall::kEventSynchronize) +
         sim.call_count(SimCall::kStreamSynchronize) +
         sim.call_count(SimCall::kCtxSynchronize);
}

inline const auto kBothBackings =
    ::testing::Values(BackingMode::kClassic, BackingMode::kExpandable);

inline std::string BackingName(
    const ::testing::TestParamInfo<BackingMode>& info) {
  return info.param == BackingMode::kClassic ? "Classic" : "Expandable";
}

class DeviceAllocatorFixture : public ::testing::Test {
 protected:
  // A fresh device of `capacity` bytes (its context `context_bytes` of it;
  // VMM granularity `granularity`, 0: the spec's default) and allocator;
  // options.clock, unless set, reads now_.
  void InitAllocator(std::size_t capacity, DeviceAllocatorOptions o,
                     std::size_t context_bytes = 0,
                     std::size_t granularity = 0) {
    alloc_.reset();
    SimDeviceSpec spec;
    spec.capacity_bytes = capacity;
    spec.context_overhead_bytes = context_bytes;
    if (granularity != 0) spec.vmm_granularity = granularity;
    sim_ = SimDriver::Create({.devices = {spec}});
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    a1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    a2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    b1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    if (!o.clock) {
      o.clock = [this] {
        ++clock_reads_;
        return now_;
      };
    }
    auto a = CachingDeviceAllocator::Create(*sim_, 0, std::move(o));
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
    for (const SimRace& race : sim_->Races()) ADD_FAILURE() << race.description;
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
    EXPECT_TRUE(sim_->Touch(s, *p, bytes == 0 ? 1 : bytes).ok());
    return *p;
  }
  void Free(DevicePtr p) { EXPECT_TRUE(alloc_->Deallocate(p).ok()); }
  TenantStats Stats(TenantId t) {
    absl::StatusOr<TenantStats> s = alloc_->GetTenantStats(t);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : TenantStats();
  }
  // Physical bytes `s` holds (mapped granules or segments).
  std::size_t StreamReserved(StreamHandle s) {
    for (const auto& [stream, st] : alloc_->Stats().per_stream) {
      if (stream == s) {
        return static_cast<std::size_t>(st.reserved_bytes[0].current);
      }
    }
    return 0;
  }
  bool expandable() const {
    return alloc_->options().backing == BackingMode::kExpandable;
  }
  // Device bytes held beyond the context.
  std::size_t Physical() const {
    return sim_->used_bytes(0) - sim_->context_bytes(0);
  }
  // The books against the driver: physical bytes == reserved + cached +
  // leaked (+ `outside_bytes` a test took from the driver itself); both
  // sides' invariants; no misuse.
  absl::Status CheckBooks(std::size_t outside_bytes = 0) const {
    absl::Status inv = alloc_->CheckInvariants();
    if (!inv.ok()) return inv;
    absl::Status sinv = sim_->CheckInvariants();
    if (!sinv.ok()) return sinv;
    const DeviceAllocatorStats st = alloc_->Stats();
    const std::size_t books =
        static_cast<std::size_t>(st.total.reserved_bytes[0].current) +
        st.granule_cache_bytes + st.leaked_bytes;
    if (Physical() != books + outside_bytes) {
      return absl::InternalError(absl::StrFormat(
          "driver holds %d bytes, books say %d (reserved %d, cache %d, "
          "leaked %d) + %d outside the allocator",
          Physical(), books, st.total.reserved_bytes[0].current,
          st.granule_cache_bytes, st.leaked_bytes, outside_bytes));
    }
    if (sim_->misuse_count() != 0) {
      return absl::InternalError(sim_->misuse_log().back());
    }
    return absl::OkStatus();
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle a1_, a2_, b1_;
  std::unique_ptr<CachingDeviceAllocator> alloc_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
  int clock_reads_ = 0;
};

// The fixture with the backing as the test parameter (kBothBackings).
class TenantAllocatorTest : public DeviceAllocatorFixture,
                            public ::testing::WithParamInterface<BackingMode> {
 protected:
  void SetUp() override { Init(64 * kMiB); }
  void Init(std::size_t capacity, DeviceAllocatorOptions o = {}) {
    o.backing = GetParam();
    InitAllocator(capacity, std::move(o));
  }
};

}  // namespace test
}  // namespace ctxpool

#endif  // CTXPOOL_TESTS_DEVICE_ALLOCATOR_FIXTURE_H_
