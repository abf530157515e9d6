#include "ctxpool/alloc/slab_allocator.h"

#include <cstdint>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "alloc_test_support.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_) = absl::UnixEpoch();
};

class SlabAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_ = SimDriver::Create();
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    s1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    s2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    DeviceAllocatorOptions dopt;
    dopt.context = ctx_;
    auto d = CachingDeviceAllocator::Create(*sim_, 0, dopt);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
  }

  void TearDown() override {
    if (sim_ == nullptr) return;
    sim_->Release(s1_);
    sim_->Release(s2_);
    slabs_.reset();
    device_.reset();
    EXPECT_EQ(sim_->misuse_count(), 0u);
    for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
    EXPECT_EQ(sim_->race_count(), 0u);
    for (const SimRace& r : sim_->Races()) ADD_FAILURE() << r.description;
  }

  void Make(SlabAllocatorOptions options = {}) {
    options.context = ctx_;
    if (!options.clock) options.clock = [this] { return clock_.Now(); };
    auto s = SlabAllocator::Create(*device_, options);
    ASSERT_TRUE(s.ok()) << s.status();
    slabs_ = std::move(*s);
  }

  std::int64_t DeviceAllocatedBytes() const {
    return device_->Stats()
        .total.allocated_bytes[static_cast<int>(StatPool::kAggregate)]
        .current;
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle s1_, s2_;
  FakeClock clock_;
  std::unique_ptr<CachingDeviceAllocator> device_;
  std::unique_ptr<SlabAllocator> slabs_;
};

TEST(SlabClasses, PowersOfTwoFrom8BTo64KiB) {
  EXPECT_EQ(SlabClassIndex(0), 0);
  EXPECT_EQ(SlabClassIndex(8), 0);
  EXPECT_EQ(SlabClassIndex(9), 1);
  EXPECT_EQ(SlabClassIndex(64), 3);
  EXPECT_EQ(SlabClassIndex(65), 4);
  EXPECT_EQ(SlabClassIndex(64 << 10), kNumSlabClasses - 1);
  EXPECT_EQ(SlabClassBytes(kNumSlabClasses - 1), kSlabMaxObjectBytes);
}

TEST_F(SlabAllocatorTest, ObjectsShareOneSlabAndAreAligned) {
  Make();
  std::set<std::uint64_t> seen;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<DevicePtr> p = slabs_->Allocate(64, s1_);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->address() % 64, 0u);
    EXPECT_TRUE(seen.insert(p->address()).second);
    ASSERT_TRUE(sim_->Touch(s1_, *p, 64).ok());
  }
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.slabs_held, 1u);
  EXPECT_EQ(st.slabs_allocated, 1);
  EXPECT_EQ(st.live_objects, 100u);
  EXPECT_EQ(st.classes[3].live_objects, 100u);
  EXPECT_EQ(st.classes[3].capacity, (256u << 10) / 64);
  EXPECT_EQ(DeviceAllocatedBytes(), 256 << 10);
  for (std::uint64_t a : seen)
    ASSERT_TRUE(slabs_->Deallocate(DevicePtr(a)).ok());
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
}

TEST_F(SlabAllocatorTest, SizeZeroAndTooLarge) {
  Make();
  DevicePtr a = *slabs_->Allocate(0, s1_);
  DevicePtr b = *slabs_->Allocate(0, s1_);
  EXPECT_NE(a, b);
  EXPECT_EQ(slabs_->Stats().classes[0].live_objects, 2u);
  EXPECT_EQ(slabs_->Allocate(kSlabMaxObjectBytes + 1, s1_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(slabs_->Stats().invalid_requests, 1);
  EXPECT_TRUE(slabs_->Deallocate(a).ok());
  EXPECT_TRUE(slabs_->Deallocate(b).ok());
}

TEST_F(SlabAllocatorTest, FreedObjectIsReusableAtOnceOnItsStream) {
  Make();
  DevicePtr p = *slabs_->Allocate(100, s1_);
  sim_->Hold(s1_);
  ASSERT_TRUE(sim_->Touch(s1_, p, 100).ok());
  ASSERT_TRUE(slabs_->Deallocate(p).ok());
  DevicePtr q = *slabs_->Allocate(100, s1_);
  EXPECT_EQ(q, p);  // stream-ordered: later work on s1 runs after the touch
  ASSERT_TRUE(sim_->Touch(s1_, q, 100).ok());
  sim_->Release(s1_);
  EXPECT_TRUE(slabs_->Deallocate(q).ok());
}

TEST_F(SlabAllocatorTest, StreamsHaveTheirOwnSlabs) {
  Make();
  DevicePtr a = *slabs_->Allocate(64, s1_);
  DevicePtr b = *slabs_->Allocate(64, s2_);
  ASSERT_TRUE(sim_->Touch(s1_, a, 64).ok());
  ASSERT_TRUE(sim_->Touch(s2_, b, 64).ok());
  EXPECT_EQ(slabs_->Stats().slabs_held, 2u);
  EXPECT_TRUE(slabs_->Deallocate(a).ok());
  EXPECT_TRUE(slabs_->Deallocate(b).ok());
}

TEST_F(SlabAllocatorTest, RecordStreamDelaysReuseUntilThatStream) {
  Make();
  DevicePtr p = *slabs_->Allocate(256, s1_);
  sim_->Hold(s2_);
  ASSERT_TRUE(slabs_->RecordStream(p, s2_).ok());
  ASSERT_TRUE(sim_->Touch(s2_, p, 256).ok());
  ASSERT_TRUE(slabs_->Deallocate(p).ok());
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.pending_objects, 1u);
  EXPECT_EQ(st.live_objects, 0u);
  EXPECT_EQ(st.events_recorded, 1);
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
  DevicePtr q = *slabs_->Allocate(256, s1_);
  EXPECT_NE(q, p);
  sim_->Release(s2_);
  DevicePtr r = *slabs_->Allocate(256, s1_);
  EXPECT_EQ(r, p);
  ASSERT_TRUE(sim_->Touch(s1_, r, 256).ok());
  EXPECT_EQ(slabs_->Stats().pending_objects, 0u);
  EXPECT_TRUE(slabs_->Deallocate(q).ok());
  EXPECT_TRUE(slabs_->Deallocate(r).ok());
  EXPECT_EQ(slabs_->RecordStream(r, s2_).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SlabAllocatorTest, BadFreesAreInvalidArgumentAndHarmless) {
  Make();
  DevicePtr p = *slabs_->Allocate(64, s1_);
  DevicePtr q = *slabs_->Allocate(64, s1_);
  auto invalid = [&](DevicePtr x) {
    return slabs_->Deallocate(x).code() == absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(invalid(DevicePtr()));
  EXPECT_TRUE(invalid(DevicePtr(0x1234)));
  EXPECT_TRUE(invalid(p + 8));  // inside an object
  absl::Status inside = slabs_->Deallocate(p + 8);
  EXPECT_TRUE(absl::StrContains(inside.message(), "8 bytes into")) << inside;
  EXPECT_TRUE(invalid(p + 64 * 100));  // a free slot
  EXPECT_TRUE(slabs_->Deallocate(p).ok());
  absl::Status twice = slabs_->Deallocate(p);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.message(), "double free")) << twice;
  EXPECT_TRUE(slabs_->Deallocate(q).ok());
  EXPECT_TRUE(invalid(q));  // the slab is empty now
  EXPECT_EQ(slabs_->Stats().invalid_frees, 7);
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
  // Still works.
  DevicePtr r = *slabs_->Allocate(64, s1_);
  EXPECT_TRUE(slabs_->Deallocate(r).ok());
}

TEST_F(SlabAllocatorTest, PendingObjectDoubleFreeIsRefused) {
  Make();
  DevicePtr p = *slabs_->Allocate(64, s1_);
  DevicePtr keep = *slabs_->Allocate(64, s1_);
  sim_->Hold(s2_);
  ASSERT_TRUE(slabs_->RecordStream(p, s2_).ok());
  ASSERT_TRUE(sim_->Touch(s2_, p, 64).ok());
  ASSERT_TRUE(slabs_->Deallocate(p).ok());
  EXPECT_EQ(slabs_->Deallocate(p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
  sim_->Release(s2_);
  EXPECT_TRUE(slabs_->Deallocate(keep).ok());
}

TEST_F(SlabAllocatorTest, TrimReturnsEmptySlabsToTheDeviceAllocator) {
  Make();
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 10; ++i) ps.push_back(*slabs_->Allocate(4096, s1_));
  EXPECT_EQ(DeviceAllocatedBytes(), 256 << 10);
  for (DevicePtr p : ps) ASSERT_TRUE(slabs_->Deallocate(p).ok());
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.empty_slabs, 1u);
  EXPECT_EQ(st.slabs_held, 1u);
  EXPECT_EQ(DeviceAllocatedBytes(), 256 << 10);  // kept for reuse
  absl::StatusOr<TrimResult> t = slabs_->Trim();
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_bytes, 256u << 10);
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(DeviceAllocatedBytes(), 0);
  st = slabs_->Stats();
  EXPECT_EQ(st.slabs_held, 0u);
  EXPECT_EQ(st.slabs_returned, 1);
  EXPECT_TRUE(slabs_->CheckInvariants().ok());
}

TEST_F(SlabAllocatorTest, EmptySlabIsReformattedForAnotherClass) {
  Make();
  DevicePtr p = *slabs_->Allocate(16, s1_);
  ASSERT_TRUE(slabs_->Deallocate(p).ok());
  DevicePtr q = *slabs_->Allocate(2048, s1_);
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.slabs_allocated, 1);
  EXPECT_EQ(st.classes[1].slabs, 0u);
  EXPECT_EQ(st.classes[8].slabs, 1u);
  EXPECT_TRUE(slabs_->Deallocate(q).ok());
}

TEST_F(SlabAllocatorTest, DecayReturnsSlabsEmptyForLong) {
  Make({.decay = absl::Seconds(1)});
  DevicePtr p = *slabs_->Allocate(64, s1_);
  DevicePtr q = *slabs_->Allocate(8192, s1_);
  ASSERT_TRUE(slabs_->Deallocate(p).ok());  // slab A empty at t = 0
  clock_.Advance(absl::Milliseconds(500));
  DevicePtr r = *slabs_->Allocate(512, s2_);  // checks: A is not old enough
  EXPECT_EQ(slabs_->Stats().decay_returns, 0);
  clock_.Advance(absl::Seconds(1));
  DevicePtr t = *slabs_->Allocate(1024, s2_);  // a new slab: checks the decay
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.decay_returns, 1);
  EXPECT_EQ(st.empty_slabs, 0u);
  EXPECT_EQ(st.slabs_held, 3u);
  EXPECT_EQ(DeviceAllocatedBytes(), 3 * (256 << 10));
  for (DevicePtr x : {q, r, t}) EXPECT_TRUE(slabs_->Deallocate(x).ok());
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
}

TEST_F(SlabAllocatorTest, FullSlabsAndFragmentationStats) {
  Make();
  // 64 KiB objects: four per 256 KiB slab.
  std::vector<DevicePtr> big;
  for (int i = 0; i < 5; ++i) big.push_back(*slabs_->Allocate(64 << 10, s1_));
  SlabAllocatorStats st = slabs_->Stats();
  EXPECT_EQ(st.classes[13].slabs, 2u);
  EXPECT_EQ(st.classes[13].capacity, 8u);
  EXPECT_EQ(st.fragmentation_bytes, 3u * (64 << 10));
  ASSERT_TRUE(slabs_->Deallocate(big[0]).ok());  // the full slab is partial
  st = slabs_->Stats();
  EXPECT_EQ(st.fragmentation_bytes, 4u * (64 << 10));
  DevicePtr again = *slabs_->Allocate(60 << 10, s1_);
  EXPECT_EQ(slabs_->Stats().slabs_held, 2u);
  FragmentationStats f = slabs_->Fragmentation();
  EXPECT_EQ(f.free_bytes, 3u * (64 << 10));
  EXPECT_EQ(f.largest_free_bytes, 64u << 10);
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
  ASSERT_TRUE(slabs_->Deallocate(again).ok());
  for (int i = 1; i < 5; ++i) ASSERT_TRUE(slabs_->Deallocate(big[i]).ok());
  EXPECT_EQ(slabs_->Stats().empty_slabs, 2u);
}

TEST_F(SlabAllocatorTest, ResetRefusesLiveObjectsUnlessForced) {
  Make();
  DevicePtr p = *slabs_->Allocate(64, s1_);
  absl::Status s = slabs_->Reset();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "1 live objects")) << s;
  EXPECT_TRUE(slabs_->Reset(/*force=*/true).ok());
  EXPECT_EQ(DeviceAllocatedBytes(), 0);
  EXPECT_EQ(slabs_->Deallocate(p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(slabs_->CheckInvariants().ok());
}

TEST_F(SlabAllocatorTest, RejectsBadOptions) {
  EXPECT_EQ(
      SlabAllocator::Create(*device_, {.slab_bytes = 100000}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      SlabAllocator::Create(*device_, {.slab_bytes = 32 << 10}).status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(SlabAllocatorTest, DestructorReturnsEverything) {
  Make();
  for (int i = 0; i < 3; ++i) (void)*slabs_->Allocate(8 << i, s1_);
  slabs_.reset();
  EXPECT_EQ(DeviceAllocatedBytes(), 0);
}

TEST_F(SlabAllocatorTest, MultithreadedSmoke) {
  Make();
  testing_internal::RunOnThreads(
      *sim_, ctx_, /*num_threads=*/4, [&](int t, StreamHandle stream) {
        std::vector<DevicePtr> mine;
        std::uint64_t x = 777 + t;
        for (int i = 0; i < 5000; ++i) {
          x = testing_internal::NextLcg(x);
          if (mine.size() < 64 && (x >> 60) < 9) {
            const std::size_t bytes = 8 << ((x >> 40) % 12);
            absl::StatusOr<DevicePtr> p = slabs_->Allocate(bytes, stream);
            ASSERT_TRUE(p.ok()) << p.status();
            ASSERT_TRUE(sim_->Touch(stream, *p, bytes).ok());
            mine.push_back(*p);
          } else if (!mine.empty()) {
            ASSERT_TRUE(slabs_->Deallocate(mine.back()).ok());
            mine.pop_back();
          }
        }
        for (DevicePtr p : mine) ASSERT_TRUE(slabs_->Deallocate(p).ok());
      });
  EXPECT_TRUE(slabs_->CheckInvariants().ok()) << slabs_->CheckInvariants();
  EXPECT_EQ(slabs_->Stats().live_objects, 0u);
  ASSERT_TRUE(slabs_->Trim().ok());
  EXPECT_EQ(DeviceAllocatedBytes(), 0);
}

// Runs in the forked child: every call fails with the fork error, calls
// neither the driver nor the device allocator, and destruction returns no
// slab. Returns 0 or the number of the first failed check.
int SlabChildChecks(SimDriver& sim, const CachingDeviceAllocator& device,
                    std::unique_ptr<SlabAllocator> slabs, DevicePtr live,
                    StreamHandle stream) {
  const std::uint64_t calls = testing_internal::TotalDriverCalls(sim);
  const int refs = sim.primary_ctx_refcount(0);
  const int agg = static_cast<int>(StatPool::kAggregate);
  const PoolStats device_before = device.Stats().total;
  const SlabAllocatorStats before = slabs->Stats();
  if (int bad = testing_internal::FirstNonForkError({
          {slabs->Allocate(64, stream).status(), "SlabAllocator::Allocate"},
          {slabs->Deallocate(live), "SlabAllocator::Deallocate"},
          {slabs->RecordStream(live, stream), "SlabAllocator::RecordStream"},
          {slabs->Trim().status(), "SlabAllocator::Trim"},
          {slabs->Reset(/*force=*/true), "SlabAllocator::Reset"},
          {slabs->CheckInvariants(), "SlabAllocator::CheckInvariants"},
      });
      bad != 0) {
    return bad;  // 1..6
  }
  if (slabs->Stats().live_objects != before.live_objects ||
      slabs->Stats().pending_objects != before.pending_objects ||
      slabs->Stats().slabs_held != before.slabs_held) {
    return 7;  // a refused call changed the bookkeeping
  }
  // Leaks: no slab returned, no cuEventDestroy, no context release.
  if (int bad = testing_internal::NoDriverCallThroughDestruction(
          sim, calls, refs, [&] { slabs.reset(); });
      bad != 0) {
    return 7 + bad;  // 8..10
  }
  const PoolStats device_after = device.Stats().total;
  if (device_after.allocated_bytes[agg].current !=
          device_before.allocated_bytes[agg].current ||
      device_after.allocation[agg].current !=
          device_before.allocation[agg].current) {
    return 11;  // the device allocator was called
  }
  return 0;
}

TEST_F(SlabAllocatorTest, ForkedChildGetsFailedPreconditionAndLeaks) {
  // Retains device 0's primary context, so a release would show.
  slabs_ = *SlabAllocator::Create(*device_);
  DevicePtr live = *slabs_->Allocate(64, s1_);
  // A pending object: recorded on a held stream with work on it.
  DevicePtr pending = *slabs_->Allocate(128, s1_);
  ASSERT_TRUE(slabs_->RecordStream(pending, s2_).ok());
  sim_->Hold(s2_);
  ASSERT_TRUE(sim_->Touch(s2_, pending, 128).ok());
  ASSERT_TRUE(slabs_->Deallocate(pending).ok());
  ASSERT_EQ(slabs_->Stats().pending_objects, 1u);
  const std::uint64_t parent_calls = testing_internal::TotalDriverCalls(*sim_);

  const int code = testing_internal::RunInForkedChild([&] {
    return SlabChildChecks(*sim_, *device_, std::move(slabs_), live, s1_);
  });
  EXPECT_EQ(code, 0) << "check " << code << " failed in the child";

  // The parent's allocator is untouched and keeps working.
  ASSERT_NE(slabs_, nullptr);
  EXPECT_EQ(testing_internal::TotalDriverCalls(*sim_), parent_calls);
  EXPECT_TRUE(slabs_->Deallocate(live).ok());
  sim_->Release(s2_);
  EXPECT_TRUE(slabs_->Reset().ok());
  EXPECT_TRUE(slabs_->CheckInvariants().ok());
  EXPECT_EQ(DeviceAllocatedBytes(), 0);
}

}  // namespace
}  // namespace ctxpool
