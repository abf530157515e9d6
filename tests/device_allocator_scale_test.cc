// The expandable backing at scale: host memory and work proportional to what
// is mapped, never to the device's capacity; an OOM report whose figures are
// physical (mapped) bytes; capacities no device has refused with a clear
// error.
#include <malloc.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/replay.h"
#include "ctxpool/trace/trace.h"
#include "device_allocator_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kTiB = std::size_t{1} << 40;

class ExpandableScaleTest : public test::DeviceAllocatorFixture {
 protected:
  void Init(std::size_t capacity, std::size_t chunk_units = 16) {
    DeviceAllocatorOptions o;
    o.backing = BackingMode::kExpandable;
    o.vmm_chunk_units = chunk_units;
    InitAllocator(capacity, std::move(o));
  }
};

// Heap bytes in use (glibc); the sanitizers replace malloc, so the figure
// means nothing there.
std::size_t HeapInUse() { return mallinfo2().uordblks; }

bool Sanitized() { return std::getenv("CTXPOOL_SANITIZER") != nullptr; }

// Eight streams on the largest simulated device each reserve a range of twice
// its capacity in both pools; the host memory that costs must follow the few
// granules mapped, not the 16 M granules of virtual space per range.
TEST_F(ExpandableScaleTest, HostMemoryFollowsMappedBytesNotCapacity) {
  Init(kSimMaxCapacityBytes);  // first: TearDown checks the device
  if (Sanitized()) GTEST_SKIP() << "mallinfo2 is meaningless under sanitizers";
  std::vector<StreamHandle> streams;
  for (int i = 0; i < 8; ++i) {
    streams.push_back(*sim_->StreamCreate(kStreamNonBlocking, 0));
  }
  const std::size_t before = HeapInUse();
  std::vector<DevicePtr> live;
  for (StreamHandle s : streams) {
    live.push_back(Alloc(4096, s));      // small pool
    live.push_back(Alloc(6 * kMiB, s));  // large pool
  }
  const std::size_t grown = HeapInUse() - before;
  EXPECT_LT(grown, std::size_t{4} << 20) << grown << " heap bytes";
  // Snapshot and Trim walk the mapped granules only; both stay exact.
  const AllocatorSnapshot snap = alloc_->Snapshot();
  std::size_t mapped = 0;
  for (const SegmentInfo& seg : snap.segments) mapped += seg.mapped_bytes;
  // The large request maps ahead to 16 MiB: its pool's 20 MiB segment size
  // rounded down to a power of two granules (the device is roomy).
  EXPECT_EQ(mapped, 8 * (2 * kMiB + 16 * kMiB));
  for (DevicePtr p : live) Free(p);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 8 * (2 * kMiB + 16 * kMiB));
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// Trim(0) of a large granule cache releases every physical allocation,
// oldest first, in one pass (the figure for its cost is in
// ctxpool_bench_hotpath's BM_TrimGranuleCache).
TEST_F(ExpandableScaleTest, TrimReleasesTheWholeGranuleCache) {
  Init(64 * kGiB, /*chunk_units=*/1);  // a physical allocation per unit
  std::vector<DevicePtr> live;
  for (int i = 0; i < 8; ++i) live.push_back(Alloc(1 * kGiB, a1_));
  for (DevicePtr p : live) Free(p);
  // Unmap into the cache first (keep the granules), then drop the cache.
  absl::StatusOr<TrimResult> t = alloc_->Trim(8 * kGiB);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 8 * kGiB);
  const std::uint64_t releases = sim_->call_count(SimCall::kMemRelease);
  t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 8 * kGiB);
  // Each physical allocation once: on this 64 GiB device a 1 GiB tensor is
  // a huge run, mapped in units of 1/8 of itself (128 MiB, within 8/1024
  // of the headroom), 8 per tensor.
  EXPECT_EQ(releases, 0u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease),
            sim_->call_count(SimCall::kMemCreate));
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 8u * 8u);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// A release that fails part way keeps the rest of the cache, and the next
// Trim finishes the job.
TEST_F(ExpandableScaleTest, TrimKeepsTheCacheAfterAFailedRelease) {
  Init(1 * kGiB);
  Free(Alloc(64 * kMiB, a1_));
  ASSERT_TRUE(alloc_->Trim(64 * kMiB).ok());
  ASSERT_EQ(alloc_->Stats().granule_cache_bytes, 64 * kMiB);
  sim_->InjectFault(SimCall::kMemRelease, 1, 999);
  EXPECT_FALSE(alloc_->Trim(0).ok());
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 64 * kMiB);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// The OOM report counts physical memory: the largest free block is the
// largest run of mapped free bytes (the virtual range's unmapped tail is no
// free memory), so the fragmentation lies in [0, 1].
TEST_F(ExpandableScaleTest, OomReportFragmentationIsPhysical) {
  OomReport seen;
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  o.on_oom = [&](const OomReport& r) {
    seen = r;
    return false;
  };
  InitAllocator(64 * kMiB, std::move(o));
  // Live, free, live, free ... on a1 (the free holes stay mapped), then a
  // request on a2 that needs more than the device has left.
  std::vector<DevicePtr> keep;
  std::vector<DevicePtr> holes;
  for (int i = 0; i < 6; ++i) {
    keep.push_back(Alloc(4 * kMiB, a1_));
    holes.push_back(Alloc(4 * kMiB, a1_));
  }
  for (DevicePtr p : holes) Free(p);
  sim_->Hold(a1_);  // a1 busy: its free granules cannot move to a2 unwaited
  absl::StatusOr<DevicePtr> big = alloc_->Allocate(60 * kMiB, a2_);
  sim_->Release(a1_);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_GE(seen.fragmentation, 0.0);
  EXPECT_LE(seen.fragmentation, 1.0);
  EXPECT_LE(seen.largest_free_bytes, seen.reserved_bytes - seen.live_bytes);
  // No free block holds more mapped bytes than the report's largest run can
  // be (the snapshot counts them independently); the unmapped tail of each
  // range is not free memory.
  std::size_t most_mapped = 0;
  for (const SegmentInfo& seg : alloc_->Snapshot().segments) {
    for (const BlockInfo& b : seg.blocks) {
      if (b.state == BlockState::kFree) {
        most_mapped = std::max(most_mapped, b.mapped_bytes);
      }
    }
  }
  EXPECT_GT(seen.largest_free_bytes, 0u) << seen.ToString();
  EXPECT_LE(seen.largest_free_bytes, most_mapped) << seen.ToString();
  EXPECT_THAT(seen.ToString(), ::testing::Not(::testing::HasSubstr("-")));
  for (DevicePtr p : keep) Free(p);
}

// A capacity no device has is refused with a clear error, by the replay and
// by the simulated driver's spec, instead of exhausting host memory.
TEST(SimCapacityLimit, RefusesCapacitiesNoDeviceHas) {
  absl::StatusOr<std::unique_ptr<SimDriver>> sim =
      SimDriver::CreateFromSpec("sim:4096TiB");
  ASSERT_FALSE(sim.ok());
  EXPECT_EQ(sim.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(sim.status().message()),
              ::testing::HasSubstr("largest simulated device"));
  EXPECT_TRUE(SimDriver::CreateFromSpec("sim:16TiB").ok());

  Trace trace;
  ReplayConfig config;
  config.capacity_bytes = 4096 * kTiB;
  absl::StatusOr<ReplayResult> r = Replay(trace, config);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::HasSubstr("largest simulated device"));
}

}  // namespace
}  // namespace ctxpool
