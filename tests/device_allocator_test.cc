#include "ctxpool/alloc/device_allocator.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <new>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ctxpool/driver/sim_driver.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr std::size_t kSmallSeg = 2 * kMiB;

std::uint64_t SyncCalls(const SimDriver& sim) {
  return sim.call_count(SimCall::kEventSynchronize) +
         sim.call_count(SimCall::kStreamSynchronize) +
         sim.call_count(SimCall::kCtxSynchronize);
}

class DeviceAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Init(*SimDevicePreset("a10-24gb")); }

  void Init(SimDeviceSpec spec, DeviceAllocatorOptions options = {}) {
    alloc_.reset();
    sim_ = SimDriver::Create({.devices = {spec}});
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    s1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    s2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    auto a = CachingDeviceAllocator::Create(*sim_, 0, std::move(options));
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(*a);
  }
  // The a10-24gb device, with the allocator's memory_limit_bytes.
  void InitWithLimit(std::size_t limit) {
    DeviceAllocatorOptions o;
    o.memory_limit_bytes = limit;
    Init(*SimDevicePreset("a10-24gb"), std::move(o));
  }

  void TearDown() override {
    if (alloc_ != nullptr) {
      EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
    }
    alloc_.reset();
    EXPECT_EQ(sim_->race_count(), 0u);
    for (const SimRace& race : sim_->Races()) ADD_FAILURE() << race.description;
  }

  DevicePtr Alloc(std::size_t bytes, StreamHandle s) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : DevicePtr();
  }
  void Free(DevicePtr p) {
    absl::Status s = alloc_->Deallocate(p);
    EXPECT_TRUE(s.ok()) << s;
  }
  void ExpectInvariants() {
    absl::Status s = alloc_->CheckInvariants();
    EXPECT_TRUE(s.ok()) << s;
  }
  // Later work on `later` waits for the work now on `earlier` (what a caller
  // does before using a block on a second stream).
  void OrderAfter(StreamHandle later, StreamHandle earlier) {
    EventHandle e = *sim_->EventCreate(kEventDisableTiming);
    ASSERT_TRUE(sim_->EventRecord(e, earlier).ok());
    ASSERT_TRUE(sim_->StreamWaitEvent(later, e).ok());
    ASSERT_TRUE(sim_->EventDestroy(e).ok());
  }
  std::int64_t Cur(const StatArray& a, StatPool p = StatPool::kAggregate) {
    return a[StatIndex(p)].current;
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle s1_, s2_;
  std::unique_ptr<CachingDeviceAllocator> alloc_;
};

TEST_F(DeviceAllocatorTest, CachedBlockIsReusedWithoutDriverCalls) {
  DevicePtr p = Alloc(1000, s1_);
  ASSERT_TRUE(sim_->Touch(s1_, p, 1000).ok());
  absl::StatusOr<BlockInfo> info = alloc_->Lookup(p);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->size, 1024u);
  EXPECT_EQ(info->requested_bytes, 1000u);
  EXPECT_EQ(info->stream, s1_);
  EXPECT_EQ(info->state, BlockState::kAllocated);
  Free(p);
  const std::uint64_t calls = sim_->total_call_count();
  for (int i = 0; i < 100; ++i) {
    DevicePtr q = Alloc(1000, s1_);
    EXPECT_EQ(q, p);
    Free(q);
  }
  EXPECT_EQ(sim_->total_call_count(), calls);  // the hot path calls no driver
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.upstream_allocs, 1);
  EXPECT_EQ(st.cache_hits, 100);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAlloc), 1u);
  EXPECT_EQ(Cur(st.total.reserved_bytes), static_cast<std::int64_t>(kSmallSeg));
  EXPECT_EQ(Cur(st.total.allocation), 0);
  EXPECT_EQ(st.total.allocation[0].allocated, 101);
}

TEST_F(DeviceAllocatorTest, CachedPathDoesNotAllocateHeapMemory) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "operator new cannot be replaced under TSan";
#endif
  std::vector<DevicePtr> warm;
  for (int i = 0; i < 64; ++i) warm.push_back(Alloc(512 * (1 + i % 7), s1_));
  for (DevicePtr p : warm) Free(p);
  g_allocations = 0;
  g_count_allocations = true;
  for (int i = 0; i < 1000; ++i) {
    absl::StatusOr<DevicePtr> a = alloc_->Allocate(512 * (1 + i % 7), s1_);
    absl::StatusOr<DevicePtr> b = alloc_->Allocate(300, s1_);
    if (a.ok()) alloc_->Deallocate(*a).IgnoreError();
    if (b.ok()) alloc_->Deallocate(*b).IgnoreError();
  }
  g_count_allocations = false;
  EXPECT_EQ(g_allocations, 0);
}

TEST_F(DeviceAllocatorTest, ZeroBytesGivesUniqueValidBlocks) {
  DevicePtr a = Alloc(0, s1_);
  DevicePtr b = Alloc(0, s1_);
  EXPECT_FALSE(a.is_null());
  EXPECT_NE(a, b);
  EXPECT_EQ(alloc_->Lookup(a)->size, 512u);
  EXPECT_EQ(alloc_->Lookup(a)->requested_bytes, 0u);
  EXPECT_TRUE(sim_->Touch(s1_, a, 512).ok());
  Free(a);
  Free(b);
}

TEST_F(DeviceAllocatorTest, PoolsAndSegmentSizes) {
  // Largest first, so no request fits in an earlier segment's remainder.
  DevicePtr own = Alloc(12 * kMiB, s1_);
  DevicePtr odd = Alloc(13 * kMiB + 5, s1_);
  DevicePtr large = Alloc(kMiB + 1, s1_);
  DevicePtr small = Alloc(kMiB, s1_);
  AllocatorSnapshot snap = alloc_->Snapshot();
  std::multiset<std::size_t> sizes;
  for (const SegmentInfo& seg : snap.segments) {
    sizes.insert(seg.size);
    EXPECT_EQ(seg.small_pool, seg.size == kSmallSeg);
    EXPECT_EQ(seg.stream, s1_);
  }
  EXPECT_EQ(sizes, (std::multiset<std::size_t>{2 * kMiB, 12 * kMiB, 14 * kMiB,
                                               20 * kMiB}));
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(Cur(st.total.segment, StatPool::kSmall), 1);
  EXPECT_EQ(Cur(st.total.segment, StatPool::kLarge), 3);
  // A 13 MiB + 5 B request in a 14 MiB segment: remainder <= 1 MiB stays in
  // the block (large pool does not keep tiny remainders).
  EXPECT_EQ(alloc_->Lookup(odd)->size, 14 * kMiB);
  EXPECT_EQ(alloc_->Lookup(large)->size, kMiB + 512);
  for (DevicePtr p : {small, large, own, odd}) Free(p);
}

TEST_F(DeviceAllocatorTest, SplitCoalesceAndBestFit) {
  // Six 4 KiB blocks, then holes of 4, 8 (two adjacent) and 4 KiB.
  std::vector<DevicePtr> p;
  for (int i = 0; i < 6; ++i) p.push_back(Alloc(4096, s1_));
  for (int i = 1; i < 6; ++i) EXPECT_EQ(p[i] - p[i - 1], 4096u);
  Free(p[1]);
  Free(p[3]);
  Free(p[4]);  // coalesces with p[3]
  ExpectInvariants();
  DeviceAllocatorStats st = alloc_->Stats();
  // Free blocks: p[1] (4K), p[3..4] (8K), tail after p[5].
  EXPECT_EQ(Cur(st.total.inactive_split), 3);
  FragmentationStats f = alloc_->Fragmentation();
  EXPECT_EQ(f.free_blocks, 3u);
  EXPECT_EQ(f.largest_free_bytes, kSmallSeg - 6 * 4096);
  EXPECT_EQ(f.free_bytes, kSmallSeg - 3 * 4096);
  // Best fit: 8 KiB goes to the 8 KiB hole, not the tail.
  DevicePtr eight = Alloc(8192, s1_);
  EXPECT_EQ(eight, p[3]);
  // 2 KiB goes to the 4 KiB hole (smallest fit), splitting it.
  DevicePtr two = Alloc(2048, s1_);
  EXPECT_EQ(two, p[1]);
  ExpectInvariants();
  for (DevicePtr q : {p[0], p[2], p[5], eight, two}) Free(q);
  AllocatorSnapshot snap = alloc_->Snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  ASSERT_EQ(snap.segments[0].blocks.size(), 1u);  // all coalesced
  EXPECT_EQ(snap.segments[0].blocks[0].state, BlockState::kFree);
  EXPECT_EQ(Cur(alloc_->Stats().total.inactive_split), 0);
}

// Classic backing under memory_limit_bytes: growth past the limit first
// returns the stream's cached segments, then fails naming the limit.
TEST_F(DeviceAllocatorTest, MemoryLimitReleasesCachedSegmentsFirst) {
  InitWithLimit(60 * kMiB);
  DevicePtr a = Alloc(24 * kMiB, s1_);  // a segment of its own each
  DevicePtr b = Alloc(24 * kMiB, s1_);
  Free(a);
  Free(b);
  ASSERT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 48 * kMiB);
  DevicePtr c = Alloc(30 * kMiB, s1_);  // 48 + 30 > 60: the cache goes first
  EXPECT_LE(alloc_->Stats().total.reserved_bytes[0].current, 60 * kMiB);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  absl::StatusOr<DevicePtr> d = alloc_->Allocate(40 * kMiB, s1_);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("memory_limit_bytes is 62914560"),
            std::string::npos)
      << d.status();
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(c);
}

// A stream that needs a segment takes another stream's wholly free one only
// when it is about the size the request would get new (a large segment more
// at most): a 4 MiB request does not pin a 100 MiB segment, which Trim can
// then give back; a 90 MiB request takes it without a cuMemAlloc.
TEST_F(DeviceAllocatorTest, TakesAnotherStreamsFreeSegmentOnlyOfAboutItsSize) {
  auto reserved = [&] {
    return static_cast<std::size_t>(
        alloc_->Stats().total.reserved_bytes[0].current);
  };
  Free(Alloc(100 * kMiB, s1_));  // s1: a wholly free 100 MiB segment
  DevicePtr small = Alloc(4 * kMiB, s2_);
  EXPECT_EQ(reserved(), 120 * kMiB);  // s2: a 20 MiB segment of its own
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 100 * kMiB);
  Free(small);

  Free(Alloc(100 * kMiB, s1_));
  const std::uint64_t allocs = sim_->call_count(SimCall::kMemAlloc);
  DevicePtr big = Alloc(90 * kMiB, s2_);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAlloc), allocs);  // s1's, moved
  EXPECT_EQ(reserved(), 120 * kMiB);
  Free(big);
}

// The same under a memory limit: what a small request would have pinned is
// what a large one needs next.
TEST_F(DeviceAllocatorTest, MemoryLimitFitsALargeRequestAfterSmallOnes) {
  InitWithLimit(256 * kMiB);
  StreamHandle s3 = *sim_->StreamCreate(kStreamNonBlocking, 0);
  DevicePtr h1 = Alloc(4 * kMiB, s1_);
  Free(Alloc(100 * kMiB, s1_));
  DevicePtr h2 = Alloc(4 * kMiB, s2_);
  Free(Alloc(100 * kMiB, s2_));
  DevicePtr big = Alloc(180 * kMiB, s3);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  EXPECT_LE(alloc_->Stats().total.reserved_bytes[0].current, 256 * kMiB);
  Free(big);
  Free(h1);
  Free(h2);
  ASSERT_TRUE(sim_->StreamDestroy(s3).ok());
}

// Under pressure a larger free segment is still taken as a last resort,
// rather than an OOM: here the only free memory is a 100 MiB segment of the
// requester's own tenant, which its min keeps from being released.
TEST_F(DeviceAllocatorTest, OversizeSegmentIsTheLastResortUnderPressure) {
  InitWithLimit(110 * kMiB);
  absl::StatusOr<TenantId> a =
      alloc_->RegisterTenant("a", Budget{.min = 200 * kMiB});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(alloc_->BindStream(s1_, *a).ok());
  ASSERT_TRUE(alloc_->BindStream(s2_, *a).ok());
  Free(Alloc(100 * kMiB, s1_));  // s1: a wholly free 100 MiB segment
  DevicePtr p = Alloc(4 * kMiB, s2_);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 100 * kMiB);
  Free(p);
}

// ... and when the larger segment's stream still has work queued, it is
// handed over with a stream wait, not waited for on the host.
TEST_F(DeviceAllocatorTest, BusyLargerSegmentIsHandedOverWithoutAHostWait) {
  InitWithLimit(110 * kMiB);
  DevicePtr big = Alloc(100 * kMiB, s1_);
  sim_->Hold(s1_);  // s1's work never completes until released
  ASSERT_TRUE(sim_->Touch(s1_, big, 100 * kMiB).ok());
  Free(big);
  DevicePtr p = Alloc(4 * kMiB, s2_);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  sim_->Release(s1_);
  Free(p);
}

// A huge large_segment_bytes does not wrap the cap to nothing: a request
// still takes another stream's free segment it fits.
TEST_F(DeviceAllocatorTest, HugeLargeSegmentBytesStillLetsStreamsShare) {
  DeviceAllocatorOptions o;
  o.large_segment_bytes = std::size_t{1} << 63;
  ASSERT_TRUE(ValidateDeviceAllocatorOptions(o).ok());
  Init(*SimDevicePreset("a10-24gb"), o);
  Free(Alloc(12 * kMiB, s1_));  // a segment of its own: 12 MiB
  const std::uint64_t allocs = sim_->call_count(SimCall::kMemAlloc);
  DevicePtr p = Alloc(4 * kMiB, s2_);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAlloc), allocs);  // s1's, moved
  Free(p);
}

TEST_F(DeviceAllocatorTest, MaxSplitSizeKeepsOversizeBlocksWhole) {
  DeviceAllocatorOptions o;
  o.max_split_size = 32 * kMiB;
  Init(*SimDevicePreset("a10-24gb"), o);
  DevicePtr big = Alloc(40 * kMiB, s1_);
  Free(big);
  // A small large-pool request does not carve the 40 MiB block.
  DevicePtr mid = Alloc(4 * kMiB, s1_);
  EXPECT_NE(mid, big);
  // An oversize request within 20 MiB of it reuses it whole.
  DevicePtr again = Alloc(36 * kMiB, s1_);
  EXPECT_EQ(again, big);
  EXPECT_EQ(alloc_->Lookup(again)->size, 40 * kMiB);
  Free(mid);
  Free(again);
}

TEST_F(DeviceAllocatorTest, BadInputsAreReportedNotFatal) {
  DevicePtr p = Alloc(4096, s1_);
  // Foreign pointer.
  absl::Status s = alloc_->Deallocate(DevicePtr(0x1234));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // Interior pointer.
  EXPECT_EQ(alloc_->Deallocate(p + 512).code(),
            absl::StatusCode::kInvalidArgument);
  ExpectInvariants();
  Free(p);
  // Double free.
  s = alloc_->Deallocate(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("double free"));
  ExpectInvariants();
  // Sizes no device could hold.
  EXPECT_EQ(alloc_->Allocate(std::size_t{1} << 63, s1_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Allocate(25 * kGiB, s1_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Allocate(~std::size_t{0}, s1_).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->RecordStream(DevicePtr(0x1234), s2_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Lookup(p).status().code(), absl::StatusCode::kNotFound);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.invalid_frees, 3);
  EXPECT_EQ(st.invalid_requests, 4);
  EXPECT_EQ(st.num_ooms, 0);
  ExpectInvariants();
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, RecordStreamDelaysReuseUntilOtherStreamFinishes) {
  // 1 MiB small segments: each 1 MiB block fills one, so every allocation
  // below misses the cache and polls the pending block's event.
  DeviceAllocatorOptions o;
  o.small_segment_bytes = kMiB;
  Init(*SimDevicePreset("a10-24gb"), o);
  sim_->Hold(s2_);
  DevicePtr p = Alloc(kMiB, s1_);
  ASSERT_TRUE(sim_->Touch(s1_, p, kMiB).ok());
  ASSERT_TRUE(alloc_->RecordStream(p, s2_).ok());
  OrderAfter(s2_, s1_);
  ASSERT_TRUE(sim_->Touch(s2_, p, kMiB).ok());  // pending: s2 is held
  Free(p);
  EXPECT_EQ(alloc_->Snapshot().segments[0].blocks[0].state,
            BlockState::kPendingFree);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(Cur(st.total.allocation), 0);
  EXPECT_EQ(Cur(st.total.active), 1);  // pending blocks stay active
  ExpectInvariants();

  const std::uint64_t syncs = SyncCalls(*sim_);
  DevicePtr q = Alloc(kMiB, s1_);
  EXPECT_NE(q, p);  // not reused while s2's work is pending
  ASSERT_TRUE(sim_->Touch(s1_, q, kMiB).ok());
  EXPECT_EQ(alloc_->Stats().upstream_allocs, 2);

  sim_->Release(s2_);
  DevicePtr u = Alloc(kMiB, s1_);  // miss: polls, p is free again
  EXPECT_EQ(u, p);
  ASSERT_TRUE(sim_->Touch(s1_, u, kMiB).ok());
  EXPECT_EQ(SyncCalls(*sim_), syncs);  // polled, never waited
  EXPECT_EQ(alloc_->Stats().upstream_allocs, 2);
  Free(q);
  Free(u);
  EXPECT_EQ(sim_->race_count(), 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, CrossStreamSegmentReuseWaitsOnEventNotHost) {
  sim_->Hold(s1_);
  DevicePtr a = Alloc(4096, s1_);
  ASSERT_TRUE(sim_->Touch(s1_, a, 4096).ok());  // pending on held s1
  Free(a);  // s1's segment is wholly free, its work still queued
  const std::uint64_t waits = sim_->call_count(SimCall::kStreamWaitEvent);
  const std::uint64_t syncs = SyncCalls(*sim_);
  DevicePtr b = Alloc(4096, s2_);
  EXPECT_EQ(b, a);  // s2 took s1's segment
  EXPECT_EQ(sim_->call_count(SimCall::kStreamWaitEvent), waits + 1);
  EXPECT_EQ(SyncCalls(*sim_), syncs);
  ASSERT_TRUE(sim_->Touch(s2_, b, 4096).ok());  // ordered after s1's touch
  sim_->Release(s1_);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.num_stream_waits, 1);
  EXPECT_EQ(st.num_host_syncs, 0);
  EXPECT_EQ(st.upstream_allocs, 1);
  AllocatorSnapshot snap = alloc_->Snapshot();
  ASSERT_EQ(snap.segments.size(), 1u);
  EXPECT_EQ(snap.segments[0].stream, s2_);
  // Per-stream stats moved with the segment.
  for (const auto& [stream, ps] : st.per_stream) {
    EXPECT_EQ(Cur(ps.segment), stream == s2_ ? 1 : 0);
  }
  Free(b);
  EXPECT_EQ(sim_->race_count(), 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, FreeAfterStreamDestroyedIsReclaimedSafely) {
  StreamHandle s3 = *sim_->StreamCreate(kStreamNonBlocking, 0);
  DevicePtr p = Alloc(4096, s3);
  ASSERT_TRUE(sim_->Touch(s3, p, 4096).ok());
  ASSERT_TRUE(sim_->StreamDestroy(s3).ok());
  Free(p);  // no driver call: the block returns to s3's pool
  ExpectInvariants();
  // Another stream takes s3's wholly free segment: the event record on s3
  // fails with CUDA_ERROR_INVALID_HANDLE (the one misuse the simulator
  // counts), so the allocator waits for the context instead.
  DevicePtr q = Alloc(4096, s1_);
  EXPECT_EQ(q, p);
  ASSERT_TRUE(sim_->Touch(s1_, q, 4096).ok());
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.destroyed_streams, 1);
  EXPECT_EQ(st.num_host_syncs, 1);
  EXPECT_EQ(sim_->misuse_count(), 1u);
  ExpectInvariants();
  Free(q);
  // RecordStream on a stream destroyed before the free.
  StreamHandle s4 = *sim_->StreamCreate(kStreamNonBlocking, 0);
  DevicePtr r = Alloc(8192, s1_);
  ASSERT_TRUE(alloc_->RecordStream(r, s4).ok());
  OrderAfter(s4, s1_);  // the caller orders s4's use after s1's
  ASSERT_TRUE(sim_->Touch(s4, r, 8192).ok());
  ASSERT_TRUE(sim_->StreamDestroy(s4).ok());
  Free(r);
  EXPECT_FALSE(alloc_->Lookup(r).ok());
  EXPECT_EQ(alloc_->Snapshot().segments[0].blocks[0].state, BlockState::kFree);
  ExpectInvariants();
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
}

SimDeviceSpec SmallDevice(std::size_t capacity) {
  SimDeviceSpec spec;
  spec.name = "small";
  spec.capacity_bytes = capacity;
  spec.context_overhead_bytes = 0;
  return spec;
}

TEST_F(DeviceAllocatorTest, OomFreesOtherStreamsCacheAndRetries) {
  Init(SmallDevice(64 * kMiB));
  DevicePtr a = Alloc(30 * kMiB, s1_);
  ASSERT_TRUE(sim_->Touch(s1_, a, 30 * kMiB).ok());
  Free(a);  // 30 MiB cached on s1: too small for 40 MiB, must be released
  DevicePtr b = Alloc(40 * kMiB, s2_);
  ASSERT_TRUE(sim_->Touch(s2_, b, 40 * kMiB).ok());
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.num_alloc_retries, 1);
  EXPECT_EQ(st.num_ooms, 0);
  EXPECT_EQ(st.upstream_frees, 1);
  EXPECT_EQ(Cur(st.total.reserved_bytes), static_cast<std::int64_t>(40 * kMiB));
  // Now really out of memory: a clear error with the report.
  absl::StatusOr<DevicePtr> c = alloc_->Allocate(40 * kMiB, s1_);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(c.status().message(), HasSubstr("requested 41943040 bytes"));
  EXPECT_THAT(c.status().message(), HasSubstr("live 41943040 bytes"));
  EXPECT_THAT(c.status().message(), HasSubstr("device free"));
  st = alloc_->Stats();
  EXPECT_EQ(st.num_ooms, 1);
  EXPECT_EQ(st.num_alloc_retries, 2);
  ExpectInvariants();
  Free(b);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, InjectedFaults) {
  sim_->InjectFault(SimCall::kMemAlloc, 1, cu::kErrorOutOfMemory);
  DevicePtr p = Alloc(4096, s1_);  // OOM path: retry succeeds
  EXPECT_EQ(alloc_->Stats().num_alloc_retries, 1);
  sim_->InjectFault(SimCall::kMemAlloc, 1, cu::kErrorInvalidValue);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(4 * kMiB, s1_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DriverErrorCode(q.status()), cu::kErrorInvalidValue);
  sim_->InjectFault(SimCall::kMemAlloc, 2, cu::kErrorOutOfMemory);
  q = alloc_->Allocate(4 * kMiB, s1_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.num_ooms, 1);
  EXPECT_EQ(st.num_alloc_retries, 2);
  ExpectInvariants();
  // A failing cuMemFree in Trim is reported and leaves consistent books.
  Free(p);
  sim_->InjectFault(SimCall::kMemFree, 1, cu::kErrorUnknown);
  EXPECT_FALSE(alloc_->Trim(0).ok());  // the segment stays cached
  ExpectInvariants();
  EXPECT_EQ(Cur(alloc_->Stats().total.reserved_bytes),
            static_cast<std::int64_t>(kSmallSeg));
  EXPECT_EQ(alloc_->Trim(0)->remaining_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
}

// The report's text gives every figure it has: the granule cache also when
// the growth is unknown (a virtual range exhausted), and no growth then.
TEST(OomReportTest, TextGivesTheCacheWhateverTheGrowth) {
  OomReport r;
  r.requested_bytes = 8 * kMiB;
  r.rounded_bytes = 8 * kMiB;
  r.reserved_bytes = 18 * kMiB;
  r.device_total_bytes = 24 * kMiB;
  r.cached_bytes = 6 * kMiB;
  EXPECT_THAT(r.ToString(),
              HasSubstr("; the allocator's granule cache held 6291456 bytes "
                        "(unmapped, not in reserved)"));
  EXPECT_THAT(r.ToString(), Not(HasSubstr("needed")));
  r.growth_bytes = 8 * kMiB;
  EXPECT_THAT(r.ToString(),
              HasSubstr("; it needed 8388608 bytes of new device memory, and "
                        "the allocator's granule cache held 6291456 bytes"));
  r.cached_bytes = 0;
  EXPECT_THAT(r.ToString(), Not(HasSubstr("granule cache")));
}

// The report says how much of the free memory is stranded beside live
// blocks: classic, the free part of segments that hold a live block, which
// no sweep or trim can give back while it lives.
TEST_F(DeviceAllocatorTest, OomReportCountsFreeBytesStrandedBesideLiveBlocks) {
  std::optional<OomReport> seen;
  DeviceAllocatorOptions o;
  o.on_oom = [&](const OomReport& report) {
    seen = report;
    return false;
  };
  Init(SmallDevice(64 * kMiB), std::move(o));
  const DevicePtr a = Alloc(3 * kMiB, s1_);  // a 20 MiB segment
  const DevicePtr b = Alloc(3 * kMiB, s1_);
  DevicePtr c = Alloc(12 * kMiB, s2_);  // its own segment, wholly free after
  Free(b);
  Free(c);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(50 * kMiB, s1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->reserved_bytes, 20 * kMiB);  // the sweep gave c's back
  EXPECT_EQ(seen->stranded_free_bytes, 17 * kMiB);
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr("; 17825792 of the free bytes are stranded beside "
                        "live blocks"));
  Free(a);
  c = Alloc(50 * kMiB, s1_);
  Free(c);
}

TEST(OomReportTest, TextGivesStrandedBytesOnlyWhenThereAreSome) {
  OomReport r;
  r.requested_bytes = 8 * kMiB;
  r.rounded_bytes = 8 * kMiB;
  EXPECT_THAT(r.ToString(), Not(HasSubstr("stranded")));
  r.stranded_free_bytes = 3 * kMiB;
  EXPECT_THAT(r.ToString(),
              HasSubstr("; 3145728 of the free bytes are stranded beside live "
                        "blocks (on memory they share: no trim frees them "
                        "while those live)"));
}

TEST_F(DeviceAllocatorTest, OomCallbackMayFreeAndRetry) {
  int calls = 0;
  DevicePtr held;
  DeviceAllocatorOptions o;
  o.on_oom = [&](const OomReport& report) {
    ++calls;
    EXPECT_EQ(report.requested_bytes, 40 * kMiB);
    EXPECT_EQ(report.live_bytes, 40 * kMiB);
    EXPECT_EQ(report.device_total_bytes, 64 * kMiB);
    // Classic: the segment it could not get; no granule cache.
    EXPECT_EQ(report.growth_bytes, 40 * kMiB);
    EXPECT_EQ(report.cached_bytes, 0u);
    if (held.is_null()) return false;
    // Called without the allocator's lock: it may free and trim.
    EXPECT_TRUE(alloc_->Deallocate(held).ok());
    held = DevicePtr();
    return true;
  };
  Init(SmallDevice(64 * kMiB), std::move(o));
  held = Alloc(40 * kMiB, s1_);
  DevicePtr p = Alloc(40 * kMiB, s2_);
  EXPECT_FALSE(p.is_null());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  // The callback declines: RESOURCE_EXHAUSTED.
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(40 * kMiB, s1_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(alloc_->Stats().num_ooms, 1);
  Free(p);
}

TEST_F(DeviceAllocatorTest, TrimReturnsCachedMemory) {
  std::vector<DevicePtr> ps;
  for (std::size_t bytes :
       {kMiB / 2, 3 * kMiB, 12 * kMiB, std::size_t{100}, kMiB}) {
    ps.push_back(Alloc(bytes, s1_));
    ps.push_back(Alloc(bytes, s2_));
  }
  for (DevicePtr p : ps) {
    ASSERT_TRUE(sim_->Touch(alloc_->Lookup(p)->stream, p, 100).ok());
  }
  DevicePtr keep = ps.back();
  ps.pop_back();
  for (DevicePtr p : ps) Free(p);
  const std::size_t reserved = Cur(alloc_->Stats().total.reserved_bytes);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok());
  // Only `keep`'s segment stays (2 MiB small segment of s2).
  EXPECT_EQ(t->remaining_bytes, kSmallSeg);
  EXPECT_EQ(t->freed_bytes, reserved - kSmallSeg);
  EXPECT_EQ(t->busy_bytes, 0u);
  Free(keep);
  t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.num_trims, 2);
  EXPECT_EQ(st.upstream_frees, st.upstream_allocs);
  EXPECT_EQ(Cur(st.total.reserved_bytes), 0);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, TrimKeepsRequestedBytes) {
  for (int i = 0; i < 4; ++i) Free(Alloc(12 * kMiB + i * 2 * kMiB, s1_));
  // Nothing matches (each segment is the request's own) so 4 segments of 12,
  // 14, 16 and 18 MiB are cached: keep 30 MiB, give back the largest first.
  EXPECT_EQ(alloc_->Snapshot().segments.size(), 4u);
  absl::StatusOr<TrimResult> t = alloc_->Trim(30 * kMiB);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_bytes, 34 * kMiB);  // 18 + 16
  EXPECT_EQ(t->remaining_bytes, 26 * kMiB);
}

TEST_F(DeviceAllocatorTest, TrimWaitsForPendingWork) {
  DevicePtr p = Alloc(4096, s1_);
  ASSERT_TRUE(alloc_->RecordStream(p, s2_).ok());
  ASSERT_TRUE(sim_->Touch(s2_, p, 4096).ok());
  Free(p);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, TrimKeepsMemoryAHeldStreamMayTouch) {
  sim_->Hold(s1_);
  DevicePtr p = Alloc(4096, s1_);
  ASSERT_TRUE(sim_->Touch(s1_, p, 4096).ok());  // still queued
  Free(p);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 0u);
  EXPECT_EQ(t->busy_bytes, kSmallSeg);
  EXPECT_EQ(t->remaining_bytes, kSmallSeg);
  EXPECT_EQ(t->event_waits, 1);
  // The simulator answers the wait on a held stream with NOT_READY ("would
  // block forever") and counts it: the one misuse here, by design.
  EXPECT_EQ(sim_->misuse_count(), 1u);
  ExpectInvariants();
  sim_->Release(s1_);
  t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
  EXPECT_EQ(sim_->misuse_count(), 1u);
}

TEST_F(DeviceAllocatorTest, ResetRefusesLiveBlocksUnlessForced) {
  DevicePtr p = Alloc(4096, s1_);
  DevicePtr q = Alloc(20 * kMiB, s2_);
  absl::Status s = alloc_->Reset();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrFormat("0x%x", p.address())));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrFormat("0x%x", q.address())));
  EXPECT_THAT(s.message(), HasSubstr("2 allocations"));
  ExpectInvariants();
  EXPECT_TRUE(alloc_->Lookup(p).ok());
  ASSERT_TRUE(alloc_->Reset(/*force=*/true).ok());
  EXPECT_FALSE(alloc_->Lookup(p).ok());
  EXPECT_EQ(alloc_->Deallocate(p).code(), absl::StatusCode::kInvalidArgument);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(Cur(st.total.reserved_bytes), 0);
  EXPECT_EQ(Cur(st.total.allocation), 0);
  EXPECT_EQ(Cur(st.total.active_bytes), 0);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
  ExpectInvariants();
  // Usable after a reset.
  Free(Alloc(4096, s1_));
  EXPECT_TRUE(alloc_->Reset().ok());
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, StatsPerPoolAndStream) {
  DevicePtr a = Alloc(1000, s1_);
  DevicePtr b = Alloc(3 * kMiB, s2_);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(Cur(st.total.allocation), 2);
  EXPECT_EQ(Cur(st.total.allocation, StatPool::kSmall), 1);
  EXPECT_EQ(Cur(st.total.allocation, StatPool::kLarge), 1);
  EXPECT_EQ(Cur(st.total.allocated_bytes), 1024 + 3 * 1048576);
  EXPECT_EQ(Cur(st.total.requested_bytes), 1000 + 3 * 1048576);
  EXPECT_EQ(Cur(st.total.reserved_bytes), 22 * 1048576);
  EXPECT_EQ(Cur(st.total.inactive_split), 2);
  ASSERT_EQ(st.per_stream.size(), 2u);
  for (const auto& [stream, ps] : st.per_stream) {
    EXPECT_EQ(Cur(ps.allocation), 1);
    EXPECT_EQ(Cur(ps.reserved_bytes),
              stream == s1_ ? 2 * 1048576 : 20 * 1048576);
  }
  FragmentationStats f = alloc_->Fragmentation();
  EXPECT_EQ(f.rounding_waste_bytes, 24u);
  EXPECT_EQ(f.free_bytes, 22 * kMiB - 1024 - 3 * kMiB);
  EXPECT_GT(f.external, 0.0);
  EXPECT_NEAR(f.reserved_over_live, 22.0 * kMiB / (1024 + 3 * kMiB), 1e-9);
  Free(a);
  Free(b);
  alloc_->ResetPeakStats();
  st = alloc_->Stats();
  EXPECT_EQ(st.total.allocated_bytes[0].peak, 0);
  EXPECT_EQ(st.total.allocated_bytes[0].allocated, 1024 + 3 * 1048576);
}

TEST_F(DeviceAllocatorTest, PrimaryContextIsRetainedAndReleased) {
  EXPECT_EQ(sim_->primary_ctx_refcount(0), 2);  // the test's and ours
  Free(Alloc(4096, s1_));
  alloc_.reset();
  EXPECT_EQ(sim_->primary_ctx_refcount(0), 1);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
  DeviceAllocatorOptions o;
  o.context = ctx_;
  auto a = CachingDeviceAllocator::Create(*sim_, 0, o);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(sim_->primary_ctx_refcount(0), 1);
  EXPECT_EQ((*a)->device(), 0);
  EXPECT_EQ(&(*a)->driver(), sim_.get());
}

TEST_F(DeviceAllocatorTest, DriverCallsWorkWithoutACurrentContext) {
  ASSERT_TRUE(sim_->CtxSetCurrent(ContextHandle()).ok());
  DevicePtr p = Alloc(4096, s1_);
  Free(p);
  EXPECT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(*sim_->CtxGetCurrent(), ContextHandle());  // restored
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(DeviceAllocatorTest, RejectsBadOptions) {
  DeviceAllocatorOptions o;
  o.round_bytes = 500;
  EXPECT_EQ(CachingDeviceAllocator::Create(*sim_, 0, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  DeviceAllocatorOptions v;
  v.backing = BackingMode::kExpandable;
  EXPECT_TRUE(CachingDeviceAllocator::Create(*sim_, 0, v).ok());
  EXPECT_FALSE(CachingDeviceAllocator::Create(*sim_, 7).ok());
}

TEST_F(DeviceAllocatorTest, ThreadsOnTheirOwnStreams) {
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) {
    streams.push_back(*sim_->StreamCreate(kStreamNonBlocking, 0));
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (!sim_->CtxSetCurrent(ctx_).ok()) ++failures;
      std::vector<DevicePtr> live;
      for (int i = 0; i < 2000; ++i) {
        const std::size_t bytes = 512 * (1 + (i * 7 + t) % 300);
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, streams[t]);
        if (!p.ok() || !sim_->Touch(streams[t], *p, bytes).ok()) ++failures;
        if (p.ok()) live.push_back(*p);
        if (live.size() > 20) {
          if (!alloc_->Deallocate(live[i % live.size()]).ok()) ++failures;
          live.erase(live.begin() + i % live.size());
        }
      }
      for (DevicePtr p : live) {
        if (!alloc_->Deallocate(p).ok()) ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  ExpectInvariants();
  EXPECT_EQ(Cur(alloc_->Stats().total.allocation), 0);
  EXPECT_EQ(sim_->race_count(), 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

// Not a timing assertion: prints the cached Allocate+Deallocate cost.
TEST_F(DeviceAllocatorTest, ReportsHotPathCost) {
  Free(Alloc(4096, s1_));
  constexpr int kPairs = 200000;
  auto cpu_ns = [] {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
  };
  const absl::Time start = absl::Now();
  const double cpu_start = cpu_ns();
  for (int i = 0; i < kPairs; ++i) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(4096, s1_);
    alloc_->Deallocate(*p).IgnoreError();
  }
  const double cpu = (cpu_ns() - cpu_start) / kPairs;
  const double ns = absl::ToDoubleNanoseconds(absl::Now() - start) / kPairs;
  std::printf(
      "cached Allocate+Deallocate: %.1f ns wall, %.1f ns thread CPU "
      "per pair\n",
      ns, cpu);
  // Debian's Abseil is built without NDEBUG, so absl::Mutex runs its
  // deadlock detector on every Lock; servers turn it off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const double cpu_start2 = cpu_ns();
  for (int i = 0; i < kPairs; ++i) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(4096, s1_);
    alloc_->Deallocate(*p).IgnoreError();
  }
  std::printf("  with Mutex deadlock detection off: %.1f ns thread CPU\n",
              (cpu_ns() - cpu_start2) / kPairs);
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
  EXPECT_EQ(alloc_->Stats().upstream_allocs, 1);
}

}  // namespace
}  // namespace ctxpool
