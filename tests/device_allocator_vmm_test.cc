// Tests of CachingDeviceAllocator's expandable (VMM) backing on SimDriver:
// granules mapped on demand, the granule cache, Trim, decay and the trace
// recorder hook.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/recorder.h"
#include "device_allocator_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kGranule = 2 * kMiB;

using test::SyncCalls;
using ::testing::HasSubstr;
using ::testing::Not;

class VmmTest : public test::DeviceAllocatorFixture {
 protected:
  void SetUp() override { Init(); }

  void Init(DeviceAllocatorOptions options = {},
            std::size_t capacity = 1 * kGiB) {
    options.backing = BackingMode::kExpandable;
    InitAllocator(capacity, std::move(options));
  }

  std::size_t Reserved() {
    return static_cast<std::size_t>(
        alloc_->Stats().total.reserved_bytes[0].current);
  }
  // cuMemCreate, cuMemMap and cuMemSetAccess calls so far.
  void ExpectVmmCalls(std::uint64_t creates, std::uint64_t maps,
                      std::uint64_t access) {
    EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
    EXPECT_EQ(sim_->call_count(SimCall::kMemMap), maps);
    EXPECT_EQ(sim_->call_count(SimCall::kMemSetAccess), access);
  }
  std::size_t Live() {
    return static_cast<std::size_t>(
        alloc_->Stats().total.allocated_bytes[0].current);
  }
  // Init with an on_oom that keeps the last report in oom_ and declines.
  void InitKeepingOoms(std::size_t capacity, DeviceAllocatorOptions o = {}) {
    o.on_oom = [this](const OomReport& r) {
      oom_ = r;
      return false;
    };
    Init(std::move(o), capacity);
  }
  std::optional<OomReport> oom_;
};

TEST_F(VmmTest, MapsGranulesOnDemandAndReusesFreedBlocks) {
  DevicePtr a = Alloc(1000, a1_);
  EXPECT_EQ(Reserved(), kGranule);  // reserved counts mapped bytes
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 1u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 1u);
  DevicePtr b = Alloc(1000, a1_);  // same granule
  EXPECT_EQ(b, a + 1024);
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 1u);
  DevicePtr big = Alloc(5 * kMiB, a1_);  // large pool: its own range
  EXPECT_EQ(Reserved(), kGranule + 6 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 2u);
  Free(big);
  DevicePtr again = Alloc(5 * kMiB, a1_);
  EXPECT_EQ(again, big);
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 4u);
  Free(again);
  Free(a);
  Free(b);
  // Blocks coalesce inside the range by kind: one mapped free block (kept
  // mapped: no unmap without pressure), then the unmapped rest.
  AllocatorSnapshot snap = alloc_->Snapshot();
  ASSERT_EQ(snap.segments.size(), 2u);
  for (const SegmentInfo& seg : snap.segments) {
    ASSERT_EQ(seg.blocks.size(), 2u);
    EXPECT_EQ(seg.stream, a1_);
    EXPECT_EQ(seg.blocks[0].state, BlockState::kFree);
    EXPECT_EQ(seg.blocks[0].mapped_bytes, seg.blocks[0].size);
    EXPECT_EQ(seg.blocks[1].state, BlockState::kFree);
    EXPECT_EQ(seg.blocks[1].mapped_bytes, 0u);
  }
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), 0u);
}

TEST_F(VmmTest, TrimUnmapsFreeGranulesIntoCacheThenReleasesThem) {
  DevicePtr keep = Alloc(3 * kMiB, a1_);
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(Alloc(4 * kMiB, a1_));
  for (DevicePtr p : ps) Free(p);
  ASSERT_EQ(Reserved(), 20 * kMiB);
  absl::StatusOr<TrimResult> t = alloc_->Trim(/*keep_bytes=*/64 * kMiB);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 0u);    // all kept in the granule cache
  EXPECT_EQ(Reserved(), 4 * kMiB);  // the granules under `keep`
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 16 * kMiB);
  EXPECT_EQ(t->remaining_bytes, 20 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 0u);
  // Growth maps cached granules before calling cuMemCreate.
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  DevicePtr p = Alloc(8 * kMiB, a2_);
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 8 * kMiB);
  Free(p);
  t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, 16 * kMiB);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  EXPECT_EQ(Reserved(), 4 * kMiB);
  // After Trim, reserved − live is at most one granule per active stream.
  EXPECT_LE(Reserved() - Live(), kGranule);
  Free(keep);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease),
            sim_->call_count(SimCall::kMemCreate));
}

TEST_F(VmmTest, GranuleMovesBetweenStreamsWithoutHostSync) {
  DevicePtr p = Alloc(6 * kMiB, a1_);
  Free(p);
  ASSERT_TRUE(alloc_->Trim(/*keep_bytes=*/kGiB).ok());
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  DevicePtr q = Alloc(6 * kMiB, a2_);  // s2 writes the granules s1 used
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
  Free(q);
}

TEST_F(VmmTest, HeldStreamKeepsItsGranulesUntilItsWorkCompletes) {
  DeviceAllocatorOptions o;
  Init(o);
  absl::StatusOr<TenantId> t = alloc_->RegisterTenant("m", Budget{.high = 0});
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(alloc_->BindStream(a1_, *t).ok());
  sim_->Hold(a1_);
  DevicePtr p = Alloc(4 * kMiB, a1_);
  Free(p);  // above high: wants to give the granules back, but s1 is busy
  EXPECT_EQ(Reserved(), 4 * kMiB);
  EXPECT_EQ(alloc_->Stats().granule_unmaps, 0);
  ASSERT_TRUE(alloc_->TrimIdle().ok());  // never waits
  EXPECT_EQ(Reserved(), 4 * kMiB);
  // Another stream's growth cannot take them either: it creates its own.
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  DevicePtr q = Alloc(2 * kMiB, a2_);
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates + 1);
  sim_->Release(a1_);
  ASSERT_TRUE(alloc_->TrimIdle().ok());
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 4 * kMiB);
  DevicePtr r = Alloc(4 * kMiB, a2_);  // from the cache, after s1's work
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates + 1);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
  Free(q);
  Free(r);
}

TEST_F(VmmTest, CachedGranulesDecay) {
  absl::Time now = absl::FromUnixSeconds(1000);
  DeviceAllocatorOptions o;
  o.idle_release_after = absl::Seconds(5);
  o.clock = [&now] { return now; };
  Init(o);
  DevicePtr p = Alloc(8 * kMiB, a1_);
  Free(p);
  ASSERT_TRUE(alloc_->Trim(kGiB).ok());
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 8 * kMiB);
  now += absl::Seconds(4);
  absl::StatusOr<TrimResult> t = alloc_->TrimIdle();
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_bytes, 0u);
  now += absl::Seconds(2);
  t = alloc_->TrimIdle();
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_bytes, 8 * kMiB);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
}

TEST_F(VmmTest, NoVmmDeviceIsAPreconditionError) {
  SimDeviceSpec spec;
  spec.vmm_supported = false;
  auto sim = SimDriver::Create({.devices = {spec}});
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  EXPECT_EQ(CachingDeviceAllocator::Create(*sim, 0, o).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A chunk holds at least one unit and at most 65536: anything else is
// refused by name before a driver call.
TEST_F(VmmTest, ChunkUnitsOutOfRangeAreRefused) {
  for (std::size_t units : {std::size_t{0}, std::size_t{65537},
                            std::numeric_limits<std::size_t>::max()}) {
    DeviceAllocatorOptions o;
    o.backing = BackingMode::kExpandable;
    o.vmm_chunk_units = units;
    absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> a =
        CachingDeviceAllocator::Create(*sim_, 0, o);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(a.status().message(), HasSubstr("vmm_chunk_units"));
  }
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  o.vmm_chunk_units = 65536;
  EXPECT_TRUE(CachingDeviceAllocator::Create(*sim_, 0, o).ok());
}

TEST_F(VmmTest, ResetUnmapsAndFreesTheRanges) {
  DevicePtr p = Alloc(3 * kMiB, a1_);
  Alloc(100, a2_);
  EXPECT_EQ(alloc_->Reset().code(), absl::StatusCode::kFailedPrecondition);
  Free(p);
  ASSERT_TRUE(alloc_->Reset(/*force=*/true).ok());
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), 2u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease),
            sim_->call_count(SimCall::kMemCreate));
  Alloc(100, a2_);  // usable again
}

TEST_F(VmmTest, DeviceOomReportsAndRecovers) {
  Init({}, 16 * kMiB);
  DevicePtr p = Alloc(12 * kMiB, a1_);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(8 * kMiB, a2_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  Free(p);
  // s1's free granules go to s2 (s1 is idle: no wait needed).
  DevicePtr r = Alloc(14 * kMiB, a2_);
  EXPECT_EQ(SyncCalls(*sim_), 0u);
  Free(r);
}

// A device OOM accounts for all the memory the allocator holds: the mapped
// bytes (reserved) and the physical memory unmapped in its granule cache,
// which reserved does not count. It says how much new memory the request
// needed: more than the cache and the device had between them.
TEST_F(VmmTest, DeviceOomReportCountsTheGranuleCache) {
  std::optional<OomReport> seen;
  std::size_t cache_then = 0;
  DeviceAllocatorOptions o;
  o.on_oom = [&](const OomReport& r) {
    seen = r;
    cache_then = alloc_->Stats().granule_cache_bytes;
    return false;
  };
  Init(std::move(o), 16 * kMiB);  // 8 granules, no context
  // Four 3 MiB blocks, each its own partly shared granules; freeing the
  // second and the fourth leaves a whole free granule in each.
  DevicePtr p[4];
  for (DevicePtr& x : p) x = Alloc(3 * kMiB, a1_);
  Free(p[1]);
  Free(p[3]);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(11 * kMiB, a1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(seen->tenant_limit);
  EXPECT_GT(seen->cached_bytes, 0u);
  EXPECT_EQ(seen->cached_bytes, cache_then);
  EXPECT_EQ(seen->reserved_bytes + seen->cached_bytes + seen->device_free_bytes,
            16 * kMiB);
  EXPECT_EQ(seen->growth_bytes % kGranule, 0u);
  EXPECT_GT(seen->growth_bytes, seen->cached_bytes + seen->device_free_bytes);
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr(absl::StrCat("granule cache held ", seen->cached_bytes,
                                     " bytes")));
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr(absl::StrCat("needed ", seen->growth_bytes,
                                     " bytes of new device memory")));
  Free(p[0]);
  Free(p[2]);
  Free(Alloc(11 * kMiB, a1_));  // fits once the rest is free
}

// The OOM report says how much of the free memory lies on granules that
// live blocks share: no trim or reclaim can unmap it while they live, so it
// is what stands between live bytes and the device's capacity.
TEST_F(VmmTest, DeviceOomReportCountsFreeBytesOnSharedGranules) {
  InitKeepingOoms(64 * kMiB);
  // 11 MiB blocks map only themselves: A on granules 0-5 (its last 1 MiB
  // free), B on [11, 22) MiB, C on granules 11-16 (its last 1 MiB free).
  const DevicePtr a = Alloc(11 * kMiB, a1_);
  const DevicePtr b = Alloc(11 * kMiB, a1_);
  const DevicePtr c = Alloc(11 * kMiB, a1_);
  ASSERT_EQ(b.address(), a.address() + 11 * kMiB);
  ASSERT_EQ(c.address(), b.address() + 11 * kMiB);
  ASSERT_EQ(Reserved(), 34 * kMiB);
  Free(b);  // 1 MiB on A's last granule, then five whole granules
  // 45 MiB extends C's free MiB by 22 granules: the reclaim unmaps B's five
  // whole granules, and those 10 MiB with the 30 the device had are short
  // of 44 MiB.
  absl::StatusOr<DevicePtr> d = alloc_->Allocate(45 * kMiB, a1_);
  ASSERT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(oom_.has_value());
  EXPECT_EQ(oom_->growth_bytes, 44 * kMiB);
  EXPECT_EQ(oom_->reserved_bytes, 24 * kMiB);
  EXPECT_EQ(oom_->cached_bytes, 40 * kMiB);  // with what it created
  EXPECT_EQ(oom_->device_free_bytes, 0u);
  EXPECT_EQ(oom_->live_bytes, 22 * kMiB);
  EXPECT_EQ(oom_->stranded_free_bytes, 2 * kMiB);
  EXPECT_THAT(std::string(d.status().message()),
              HasSubstr("; 2097152 of the free bytes are stranded beside "
                        "live blocks"));
  // Once A goes, its granule's free MiB is a whole free granule; only C's
  // stays shared.
  Free(a);
  oom_.reset();
  d = alloc_->Allocate(57 * kMiB, a1_);
  ASSERT_FALSE(d.ok());
  ASSERT_TRUE(oom_.has_value());
  EXPECT_EQ(oom_->stranded_free_bytes, 1 * kMiB);
  Free(c);
  oom_.reset();
  Free(Alloc(45 * kMiB, a1_));
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

// A hole of `granules` followed by a live one-granule block: a tensor one
// granule larger than any hole goes to the end of what the stream's ranges
// use, is freed, and the hole and the block are carved from it. Returns
// the block, or the error of the tensor that found no place.
absl::StatusOr<DevicePtr> HoleThenBlock(CachingDeviceAllocator& alloc,
                                        StreamHandle s, std::size_t granules) {
  absl::StatusOr<DevicePtr> x = alloc.Allocate((granules + 1) * kGranule, s);
  if (!x.ok()) return x.status();
  EXPECT_TRUE(alloc.Deallocate(*x).ok());
  absl::StatusOr<DevicePtr> hole = alloc.Allocate(granules * kGranule, s);
  absl::StatusOr<DevicePtr> block = alloc.Allocate(kGranule, s);
  EXPECT_TRUE(hole.ok() && block.ok());
  EXPECT_TRUE(alloc.Deallocate(*hole).ok());
  EXPECT_TRUE(alloc.Trim(0).ok());
  return block;
}

// Growing tensors, each followed by a small block that stays, walk along a
// stream's range (128 MiB on a 64 MiB device) and leave holes of 14, 15
// and 16 granules and a 16-granule tail. Returns the three blocks.
std::vector<DevicePtr> HolesOfGrowingTensors(CachingDeviceAllocator& alloc,
                                             StreamHandle s) {
  std::vector<DevicePtr> live;
  for (std::size_t granules : {14, 15, 16}) {
    absl::StatusOr<DevicePtr> block = HoleThenBlock(alloc, s, granules);
    EXPECT_TRUE(block.ok()) << block.status();
    if (block.ok()) live.push_back(*block);
  }
  return live;
}

// The blocks of `s`'s large-pool ranges, one range per "|": live (L), free
// and mapped (M) or free and unmapped (U), with their sizes in granules.
std::string RangePicture(CachingDeviceAllocator& alloc, StreamHandle s) {
  std::string out;
  for (const SegmentInfo& seg : alloc.Snapshot().segments) {
    if (seg.stream != s || seg.small_pool) continue;
    if (!out.empty()) out += " |";
    for (const BlockInfo& b : seg.blocks) {
      const char c = b.state != BlockState::kFree ? 'L'
                     : b.mapped_bytes == 0        ? 'U'
                                                  : 'M';
      absl::StrAppend(&out, out.empty() ? "" : " ", std::string(1, c),
                      b.size / kGranule);
    }
  }
  return out;
}

// When live blocks split a stream's range so that no place is left for a
// request, the stream gets another range (as PyTorch opens another
// expandable segment) rather than an OOM with the device mostly free.
TEST_F(VmmTest, RangeWithNoPlaceOpensAnother) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  ASSERT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16");
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  const DevicePtr q = Alloc(17 * kGranule, a1_);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16 | L17 U47");
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // Both ranges serve and give back as one.
  Free(q);
  for (DevicePtr p : live) Free(p);
  Free(Alloc(30 * kGranule, a1_));
  EXPECT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  EXPECT_TRUE(alloc_->Reset().ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), reserves + 1);
}

// A request that no place could serve, because it and what is live pass
// the device (or memory_limit_bytes), reserves no further range on its way
// to the OOM: the report is the device's, with the growth it needed.
TEST_F(VmmTest, RequestPastTheDeviceReservesNoRange) {
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 48 * kMiB;
  InitKeepingOoms(64 * kMiB, std::move(o));
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  ASSERT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16");
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  // 23 granules fit the 24-granule limit, but not beside the 3 live.
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(23 * kGranule, a1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(oom_.has_value());
  EXPECT_FALSE(oom_->virtual_range_exhausted);
  EXPECT_EQ(oom_->growth_bytes, 23 * kGranule);
  EXPECT_EQ(oom_->memory_limit_bytes, 48 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves);
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr("it needed 48234496 bytes of new device memory"));
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // 3 + 20 fit the limit: the stream gets its second range and is served.
  oom_.reset();
  const DevicePtr r = Alloc(20 * kGranule, a1_);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  Free(r);
  for (DevicePtr p : live) Free(p);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

// The same for a tenant's max: its OOM, and no further range.
TEST_F(VmmTest, RequestPastTheTenantsMaxReservesNoRange) {
  InitKeepingOoms(64 * kMiB);
  absl::StatusOr<TenantId> t =
      alloc_->RegisterTenant("m", Budget{.max = 24 * kGranule});
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(alloc_->BindStream(a1_, *t).ok());
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  ASSERT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16");
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(22 * kGranule, a1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(oom_.has_value());
  EXPECT_TRUE(oom_->tenant_limit);
  EXPECT_FALSE(oom_->virtual_range_exhausted);
  EXPECT_EQ(oom_->growth_bytes, 22 * kGranule);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves);
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr("out of memory for tenant 'm'"));
  // Within the max, the range comes.
  oom_.reset();
  const DevicePtr r = Alloc(20 * kGranule, a1_);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  Free(r);
  for (DevicePtr p : live) Free(p);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

// With no place in its ranges and no further range, the OOM says so (not a
// device OOM that does not know what it needed) and loses nothing.
TEST_F(VmmTest, NoPlaceAndNoFurtherRangeSaysSo) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  sim_->InjectFault(SimCall::kMemAddressReserve, 1, cu::kErrorOutOfMemory);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(17 * kGranule, a1_);
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(oom_.has_value());
  EXPECT_TRUE(oom_->virtual_range_exhausted);
  EXPECT_FALSE(oom_->tenant_limit);
  EXPECT_EQ(oom_->virtual_range_bytes, 128 * kMiB);
  EXPECT_EQ(oom_->growth_bytes, 0u);  // nothing was placed
  EXPECT_EQ(oom_->live_bytes, 3 * kGranule);
  EXPECT_EQ(oom_->reserved_bytes + oom_->cached_bytes + oom_->device_free_bytes,
            64 * kMiB);
  EXPECT_THAT(std::string(q.status().message()),
              HasSubstr("; the stream's virtual ranges (134217728 bytes in "
                        "all) had no place for 35651584 bytes (live blocks "
                        "split them)"));
  EXPECT_EQ(alloc_->Stats().num_ooms, 1);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // A driver error other than memory is returned as it is, not an OOM.
  sim_->InjectFault(SimCall::kMemAddressReserve, 1, cu::kErrorInvalidValue);
  oom_.reset();
  q = alloc_->Allocate(17 * kGranule, a1_);
  EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument)
      << q.status();
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(alloc_->Stats().num_ooms, 1);
  // A device OOM afterwards does not carry the flag.
  q = alloc_->Allocate(30 * kGranule, a2_);
  ASSERT_FALSE(q.ok());
  ASSERT_TRUE(oom_.has_value());
  EXPECT_FALSE(oom_->virtual_range_exhausted);
  EXPECT_THAT(std::string(q.status().message()), Not(HasSubstr("no place")));
  // Nothing was lost: the next try gets its range.
  Free(Alloc(17 * kGranule, a1_));
  for (DevicePtr p : live) Free(p);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

// A (stream, pool) holds at most four ranges: growing tensors that leave a
// hole and a live block each fill four, and the next has no place, with
// the device able to serve it.
TEST_F(VmmTest, RangesStopAtFour) {
  InitKeepingOoms(128 * kMiB);  // ranges of 256 MiB
  std::vector<DevicePtr> live;
  std::size_t granules = 30;
  for (;; ++granules) {
    ASSERT_LT(granules, 60u) << "never ran out";
    absl::StatusOr<DevicePtr> block = HoleThenBlock(*alloc_, a1_, granules);
    if (!block.ok()) break;
    live.push_back(*block);
  }
  ASSERT_TRUE(oom_.has_value());
  EXPECT_TRUE(oom_->virtual_range_exhausted);
  EXPECT_EQ(oom_->virtual_range_bytes, 4 * 256 * kMiB);
  EXPECT_GE(oom_->device_free_bytes + oom_->cached_bytes,
            (granules + 1) * kGranule);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 4u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  for (DevicePtr p : live) Free(p);
  Free(Alloc((granules + 1) * kGranule, a1_));
}

// Trim gives back a range that holds no mapped granule, whichever slot it
// sits in, and keeps the (stream, pool)'s last one: extra ranges are
// address space the stream no longer needs. A range it gave back leaves a
// slot for the next that live blocks make necessary.
TEST_F(VmmTest, TrimGivesBackRangesThatMapNothing) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  const std::uint64_t frees = sim_->call_count(SimCall::kMemAddressFree);
  const std::int64_t segments = alloc_->Stats().total.segment[0].current;
  // The second range (slot 1) serves a request, which is then freed.
  Free(Alloc(17 * kGranule, a1_));
  ASSERT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  ASSERT_EQ(alloc_->Stats().total.segment[0].current, segments + 1);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), frees + 1);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16");
  EXPECT_EQ(alloc_->Stats().total.segment[0].current, segments);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // A second Trim finds nothing more to give back.
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), frees + 1);
  // Now the first range (slot 0) empties while the second holds a block.
  const DevicePtr q = Alloc(17 * kGranule, a1_);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 2);
  for (DevicePtr p : live) Free(p);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), frees + 2);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "L17 U47");
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // Growth goes on in the range that is left, and a request with no place
  // in it takes the freed slot.
  Free(q);
  live = HolesOfGrowingTensors(*alloc_, a1_);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16");
  const DevicePtr r = Alloc(17 * kGranule, a1_);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 3);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(r);
  for (DevicePtr p : live) Free(p);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(Reserved(), 0u);
  // Every range but one is given back, and nothing maps twice.
  const std::uint64_t reserved_now =
      sim_->call_count(SimCall::kMemAddressReserve) -
      sim_->call_count(SimCall::kMemAddressFree);
  EXPECT_EQ(reserved_now, 1u);
  EXPECT_EQ(alloc_->Snapshot().segments.size(), 1u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Reset().ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree),
            sim_->call_count(SimCall::kMemAddressReserve));
}

// The cap of four is on ranges held at once: once Trim gives the empty
// ones back, a stream whose live blocks spread again gets four again.
TEST_F(VmmTest, TrimmedRangesMakeRoomUnderTheCap) {
  InitKeepingOoms(128 * kMiB);
  auto fill = [&](std::vector<DevicePtr>* live) {
    for (std::size_t granules = 30;; ++granules) {
      if (granules >= 60) return false;
      absl::StatusOr<DevicePtr> block = HoleThenBlock(*alloc_, a1_, granules);
      if (!block.ok()) return true;
      live->push_back(*block);
    }
  };
  std::vector<DevicePtr> live;
  ASSERT_TRUE(fill(&live));
  ASSERT_TRUE(oom_.has_value() && oom_->virtual_range_exhausted);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 4u);
  for (DevicePtr p : live) Free(p);
  live.clear();
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), 3u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  oom_.reset();
  ASSERT_TRUE(fill(&live));
  ASSERT_TRUE(oom_.has_value() && oom_->virtual_range_exhausted);
  EXPECT_EQ(oom_->virtual_range_bytes, 4 * 256 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 7u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  for (DevicePtr p : live) Free(p);
}

// A range whose address space the driver will not free stays on the books
// as it was; Trim says so, and the next Trim gives it back.
TEST_F(VmmTest, RangeTheDriverKeepsStaysForTheNextTrim) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  Free(Alloc(17 * kGranule, a1_));
  const std::uint64_t frees = sim_->call_count(SimCall::kMemAddressFree);
  const std::int64_t segments = alloc_->Stats().total.segment[0].current;
  sim_->InjectFault(SimCall::kMemAddressFree, 1, cu::kErrorInvalidValue);
  EXPECT_FALSE(alloc_->Trim(0).ok());
  EXPECT_EQ(alloc_->Stats().total.segment[0].current, segments);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U16 L1 U16 | U64");
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // The range still serves.
  Free(Alloc(17 * kGranule, a1_));
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  ASSERT_TRUE(alloc_->Trim(0).ok());
  // The refused call and the one that freed the range.
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree), frees + 2);
  EXPECT_EQ(alloc_->Stats().total.segment[0].current, segments - 1);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  for (DevicePtr p : live) Free(p);
}

// A mapping that fails for memory is retried at another place. When the
// failed run could be neither given access nor unmapped (quarantined), it
// splits the only place the request had: the retry looks further (every
// hole, a run to join, another range) rather than fail with the device
// mostly free, and the quarantined piece stays out of every index.
TEST_F(VmmTest, RetryAfterAQuarantinedRunFindsAnotherPlace) {
  InitKeepingOoms(64 * kMiB);  // single-granule mappings; a 64-granule range
  // Holes of 14, 15 and 15 granules, each followed by a live granule, leave
  // a 17-granule tail: the only place for 17 granules.
  std::vector<DevicePtr> live;
  for (std::size_t granules : {14, 15, 15}) {
    absl::StatusOr<DevicePtr> block = HoleThenBlock(*alloc_, a1_, granules);
    ASSERT_TRUE(block.ok()) << block.status();
    live.push_back(*block);
  }
  ASSERT_EQ(RangePicture(*alloc_, a1_), "U14 L1 U15 L1 U15 L1 U17");
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  const std::int64_t errors = alloc_->Stats().driver_errors;
  // The run's cuMemSetAccess fails for memory; its rollback can neither
  // unmap it (two tries) nor give it access.
  sim_->InjectFault(SimCall::kMemSetAccess, 2, cu::kErrorOutOfMemory);
  sim_->InjectFault(SimCall::kMemUnmap, 2, cu::kErrorUnknown);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(17 * kGranule, a1_);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  // The first granule of the tail is quarantined (mapped, in no index).
  EXPECT_EQ(RangePicture(*alloc_, a1_),
            "U14 L1 U15 L1 U15 L1 M1 U16 | L17 U47");
  EXPECT_GT(alloc_->Stats().driver_errors, errors);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // The quarantined piece serves nothing; Reset unmaps it with the rest.
  Free(*q);
  for (DevicePtr p : live) Free(p);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Reset().ok());
  EXPECT_EQ(alloc_->Stats().total.reserved_bytes[0].current, 0);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressFree),
            sim_->call_count(SimCall::kMemAddressReserve));
}

// A run of free blocks, holes with a mapped free block between them, holds
// the request: its free granules are unmapped into the cache so the run
// becomes one hole, before another range is reserved.
TEST_F(VmmTest, FreeRunOfSeveralHolesIsJoined) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  Free(live[0]);  // stays mapped: U14 M1 U15 is a run of 30 granules
  ASSERT_EQ(RangePicture(*alloc_, a1_), "U14 M1 U15 L1 U16 L1 U16");
  const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(17 * kGranule, a1_);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps + 1);  // the M1
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(*q);
  Free(live[1]);
  Free(live[2]);
}

// The join unmaps only the run it joins: without pressure the stream's
// other free granules stay mapped for it.
TEST_F(VmmTest, JoinUnmapsOnlyTheRun) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  const DevicePtr x = Alloc(4 * kGranule, a1_);
  const DevicePtr y = Alloc(kGranule, a1_);
  Free(x);
  Free(live[1]);
  ASSERT_EQ(RangePicture(*alloc_, a1_), "M4 L1 U9 L1 U15 M1 U16 L1 U16");
  const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
  const DevicePtr q = Alloc(18 * kGranule, a1_);
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps + 1);  // the M1
  const std::uint64_t maps = sim_->call_count(SimCall::kMemMap);
  Free(Alloc(4 * kGranule, a1_));  // the M4, still mapped
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), maps);
  EXPECT_FALSE(oom_.has_value());
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(q);
  Free(y);
  Free(live[0]);
  Free(live[2]);
}

// A stream with queued work: its free run is not joined with a host wait
// while another range can be reserved at once.
TEST_F(VmmTest, BusyStreamGetsAnotherRangeWithoutAHostWait) {
  InitKeepingOoms(64 * kMiB);
  std::vector<DevicePtr> live = HolesOfGrowingTensors(*alloc_, a1_);
  Free(live[0]);  // U14 M1 U15: a run of 30 granules
  sim_->Hold(a1_);
  ASSERT_TRUE(sim_->Touch(a1_, live[1], kGranule).ok());
  const std::uint64_t syncs = SyncCalls(*sim_);
  const std::uint64_t reserves = sim_->call_count(SimCall::kMemAddressReserve);
  const DevicePtr q = Alloc(17 * kGranule, a1_);
  EXPECT_EQ(SyncCalls(*sim_), syncs);
  EXPECT_EQ(sim_->misuse_count(), 0u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), reserves + 1);
  EXPECT_EQ(RangePicture(*alloc_, a1_), "U14 M1 U15 L1 U16 L1 U16 | L17 U47");
  sim_->Release(a1_);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(q);
  Free(live[1]);
  Free(live[2]);
}

// Place looks at a bounded number of candidates (16 holes from the
// request's size up, the holes beside the 256 largest mapped free blocks).
// When those hold no place it looks at every one before the range is
// called full: here the only place is an 18 MiB hole beside a 1.5 MiB
// mapped free block, after 407 smaller holes and 407 larger mapped free
// blocks, with a decoy 18 MiB hole (between live blocks) as the largest.
TEST_F(VmmTest, PlaceLooksAtEveryHoleBeforeTheRangeIsFull) {
  DeviceAllocatorOptions o;
  o.vmm_unit_divisor = 0;  // single-granule mappings: holes of any length
  InitKeepingOoms(4 * kGiB, std::move(o));
  std::vector<DevicePtr> live;
  std::vector<DevicePtr> mapped_free;
  // A mapped free block of `bytes` at the range's tail, to carve from.
  auto tail = [&](std::size_t bytes) {
    DevicePtr x = Alloc(bytes, a1_);
    Free(x);
    return x;
  };
  // The place: [live 2.5][1.5][hole 18][live 2] MiB.
  const DevicePtr start = tail(24 * kMiB);
  live.push_back(Alloc(5 * kMiB / 2, a1_));
  const DevicePtr beside = Alloc(3 * kMiB / 2, a1_);
  const DevicePtr hole = Alloc(18 * kMiB, a1_);
  live.push_back(Alloc(2 * kMiB, a1_));
  ASSERT_EQ(hole, start + 4 * kMiB);
  Free(hole);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  // 407 times [live 4][hole 12][mapped free 4] MiB.
  for (int done = 0; done < 407;) {
    const int n = std::min(20, 407 - done);
    tail(static_cast<std::size_t>(n) * 20 * kMiB);
    std::vector<DevicePtr> holes;
    for (int i = 0; i < n; ++i) {
      live.push_back(Alloc(4 * kMiB, a1_));
      holes.push_back(Alloc(12 * kMiB, a1_));
      mapped_free.push_back(Alloc(4 * kMiB, a1_));
    }
    for (DevicePtr h : holes) Free(h);
    ASSERT_TRUE(alloc_->Trim(0).ok());
    done += n;
  }
  // The decoy: [live 2][hole 18][live 2] MiB; 6 MiB of the range are left.
  tail(22 * kMiB);
  live.push_back(Alloc(2 * kMiB, a1_));
  const DevicePtr decoy = Alloc(18 * kMiB, a1_);
  live.push_back(Alloc(2 * kMiB, a1_));
  Free(decoy);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  for (DevicePtr m : mapped_free) Free(m);
  Free(beside);
  const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(19 * kMiB, a1_);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*q, beside);  // extends the 1.5 MiB block into the hole
  EXPECT_FALSE(oom_.has_value());
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps);  // nothing moved
  EXPECT_EQ(sim_->call_count(SimCall::kMemAddressReserve), 1u);  // no more
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(*q);
  for (DevicePtr p : live) Free(p);
}

TEST_F(VmmTest, TraceRecorderSeesAllocatorEvents) {
  TraceRecorder& rec = alloc_->trace_recorder();
  EXPECT_FALSE(rec.enabled());
  rec.Enable(1024);
  DevicePtr p = Alloc(3000, a1_);
  Free(p);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  Trace t = rec.Snapshot();
  std::vector<TraceOp> ops;
  for (const TraceEvent& e : t.events()) ops.push_back(e.op);
  ASSERT_GE(ops.size(), 6u);
  EXPECT_EQ(ops[0], TraceOp::kSegmentMap);
  EXPECT_EQ(ops[1], TraceOp::kAlloc);
  EXPECT_EQ(t.events()[1].size, 3000u);
  EXPECT_EQ(t.events()[1].ptr, p.address());
  EXPECT_EQ(ops[2], TraceOp::kFree);
  EXPECT_EQ(ops[3], TraceOp::kFreeCompleted);
  EXPECT_EQ(ops[4], TraceOp::kSegmentUnmap);
  EXPECT_EQ(ops.back(), TraceOp::kTrim);
  EXPECT_EQ(t.events().back().size, kGranule);
}

// A random mix of 512 B - 64 MiB blocks over two streams, at most 64 live.
class Mix {
 public:
  Mix(StreamHandle s1, StreamHandle s2) : streams_{s1, s2} {}
  template <typename AllocFn, typename FreeFn>
  void Step(AllocFn alloc, FreeFn free) {
    if (live_.size() < 64 && (rng_() % 2 == 0 || live_.empty())) {
      const int band = static_cast<int>(rng_() % 10);
      const std::size_t bytes =
          band < 6 ? 512 + rng_() % (256 * 1024)
                   : (band < 9 ? kMiB + rng_() % (16 * kMiB)
                               : 16 * kMiB + rng_() % (48 * kMiB));
      const StreamHandle s = streams_[rng_() % 2];
      live_.emplace_back(alloc(bytes, s), s);
    } else {
      const std::size_t i = rng_() % live_.size();
      free(live_[i].first);
      live_[i] = live_.back();
      live_.pop_back();
    }
  }
  std::vector<std::pair<DevicePtr, StreamHandle>>& live() { return live_; }

 private:
  StreamHandle streams_[2];
  std::mt19937_64 rng_{7};
  std::vector<std::pair<DevicePtr, StreamHandle>> live_;
};

// The steady state on an unconstrained device: once warm, almost no driver
// call of any kind (the cached path maps nothing and nothing is unmapped
// without pressure); after Trim(0), little mapped beyond live.
TEST_F(VmmTest, SteadyStateTargets) {
  Init({}, 8 * kGiB);
  Mix mix(a1_, a2_);
  auto alloc = [&](std::size_t b, StreamHandle s) { return Alloc(b, s); };
  auto free = [&](DevicePtr p) { Free(p); };
  for (int i = 0; i < 20000; ++i) mix.Step(alloc, free);
  alloc_->ResetPeakStats();
  const std::uint64_t before = sim_->total_call_count();
  constexpr int kOps = 20000;
  for (int i = 0; i < kOps; ++i) mix.Step(alloc, free);
  const std::uint64_t warm_calls = sim_->total_call_count() - before;
  // Without pressure nothing is unmapped, warm or cold.
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), 0u);
  DeviceAllocatorStats st = alloc_->Stats();
  const double ratio = static_cast<double>(st.total.reserved_bytes[0].peak) /
                       static_cast<double>(st.total.allocated_bytes[0].peak);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  const std::size_t residual = Reserved() - Live();
  std::printf(
      "warm driver calls per 1000 ops %.2f, peak reserved / peak live %.3f, "
      "after Trim reserved - live %.1f MiB\n",
      1000.0 * static_cast<double>(warm_calls) / kOps, ratio,
      static_cast<double>(residual) / kMiB);
  // A random mix keeps meeting new shapes, so it still grows now and then
  // (each growth: its granules' cuMemCreate and cuMemMap, one
  // cuMemSetAccess); a replayed trace's second pass makes none (replay_test).
  EXPECT_LE(warm_calls, 5u * kOps / 1000);
  // Only granules under live blocks stay mapped after Trim(0).
  EXPECT_LE(residual, 2 * kGranule * (mix.live().size() + 4));
  for (const auto& [p, s] : mix.live()) Free(p);
}

// An alloc/free loop of one size on a warm allocator makes no driver call
// at all, in both pools, with single granules (1 GiB device) and with
// multi-granule units (80 GiB).
TEST_F(VmmTest, WarmLoopMakesNoDriverCall) {
  for (std::size_t capacity : {1 * kGiB, 80 * kGiB}) {
    Init({}, capacity);
    for (std::size_t bytes : {std::size_t{4096}, 3 * kMiB, 100 * kMiB}) {
      Free(Alloc(bytes, a1_));
      const std::uint64_t before = sim_->total_call_count();
      for (int i = 0; i < 1000; ++i) Free(Alloc(bytes, a1_));
      EXPECT_EQ(sim_->total_call_count() - before, 0u)
          << bytes << " bytes on " << capacity << " bytes";
    }
    EXPECT_TRUE(alloc_->CheckInvariants().ok());
  }
}

// A new request that fits no mapped free block maps only the granules it
// lacks next to a mapped free block, and never unmaps one without pressure.
TEST_F(VmmTest, GrowthExtendsMappedFreeBlocksWithoutUnmapping) {
  DevicePtr a = Alloc(9 * kMiB, a1_);  // granules 0-4, 1 MiB free in the 5th
  DevicePtr b = Alloc(20 * kMiB, a1_);
  Free(a);  // 10 MiB mapped and free
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  DevicePtr c = Alloc(12 * kMiB, a1_);  // no mapped block fits 12 MiB
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), 0u);
  EXPECT_GT(sim_->call_count(SimCall::kMemCreate), creates);
  Free(b);
  Free(c);
  // The 12 MiB now fits in the mapped free memory: nothing new.
  const std::uint64_t before = sim_->total_call_count();
  Free(Alloc(12 * kMiB, a1_));
  Free(Alloc(25 * kMiB, a1_));
  EXPECT_EQ(sim_->total_call_count() - before, 0u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

// A request no mapped free block holds extends the largest mapped free
// block into the unmapped hole beside it when that maps less, even where a
// smaller hole elsewhere could hold the whole request.
TEST_F(VmmTest, GrowthExtendsAMappedFreeBlockBeforeAWholeHole) {
  // [l1 10][m 40][b 60][l2 10][a 56][l3 10] MiB, back to back.
  DevicePtr l1 = Alloc(10 * kMiB, a1_);
  DevicePtr m = Alloc(40 * kMiB, a1_);
  DevicePtr b = Alloc(60 * kMiB, a1_);
  DevicePtr l2 = Alloc(10 * kMiB, a1_);
  DevicePtr a = Alloc(56 * kMiB, a1_);
  DevicePtr l3 = Alloc(10 * kMiB, a1_);
  ASSERT_EQ(m, l1 + 10 * kMiB);
  ASSERT_EQ(b, m + 40 * kMiB);
  ASSERT_EQ(a, l2 + 10 * kMiB);
  ASSERT_EQ(l3, a + 56 * kMiB);
  // Holes of 60 and 56 MiB, unmapped, then m free and mapped beside b's.
  Free(b);
  Free(a);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  Free(m);
  ASSERT_EQ(Reserved(), 70 * kMiB);
  const std::uint64_t unmaps = sim_->call_count(SimCall::kMemUnmap);
  // 50 MiB: a whole hole maps 50 MiB; extending m maps 10.
  DevicePtr p = Alloc(50 * kMiB, a1_);
  EXPECT_EQ(p, m);
  EXPECT_EQ(Reserved(), 80 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), unmaps);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  for (DevicePtr q : {p, l1, l2, l3}) Free(q);
}

// Under memory_limit_bytes the allocator compacts (free granules of either
// stream move through the cache to where they are needed) instead of
// failing, and never holds more than the limit.
TEST_F(VmmTest, DeviceLimitCompactsInsteadOfFailing) {
  // The mix's peak live, measured unconstrained.
  std::size_t peak_live = 0;
  {
    Init({}, 8 * kGiB);
    Mix mix(a1_, a2_);
    auto alloc = [&](std::size_t b, StreamHandle s) { return Alloc(b, s); };
    auto free = [&](DevicePtr p) { Free(p); };
    for (int i = 0; i < 20000; ++i) mix.Step(alloc, free);
    peak_live =
        static_cast<std::size_t>(alloc_->Stats().total.allocated_bytes[0].peak);
    for (const auto& [p, s] : mix.live()) Free(p);
  }
  const std::size_t limit = (peak_live + peak_live / 8) / kGranule * kGranule;
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = limit;
  Init(o, 8 * kGiB);
  Mix mix(a1_, a2_);
  std::size_t most = 0;
  int failures = 0;
  auto alloc = [&](std::size_t b, StreamHandle s) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(b, s);
    if (!p.ok()) {
      ++failures;
      return DevicePtr();
    }
    const DeviceAllocatorStats st = alloc_->Stats();
    most = std::max<std::size_t>(
        most, static_cast<std::size_t>(st.total.reserved_bytes[0].current) +
                  st.granule_cache_bytes);
    return *p;
  };
  auto free = [&](DevicePtr p) {
    if (!p.is_null()) Free(p);
  };
  for (int i = 0; i < 20000; ++i) mix.Step(alloc, free);
  std::printf(
      "limit %.1f MiB (peak live %.1f MiB): most held %.1f MiB, %d "
      "failures, %lld unmaps\n",
      static_cast<double>(limit) / kMiB, static_cast<double>(peak_live) / kMiB,
      static_cast<double>(most) / kMiB, failures,
      static_cast<long long>(alloc_->Stats().granule_unmaps));
  EXPECT_EQ(failures, 0);
  EXPECT_LE(most, limit);
  EXPECT_GT(alloc_->Stats().granule_unmaps, 0);  // it did compact
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // A request beyond the limit fails with the OOM report, losing nothing.
  absl::StatusOr<DevicePtr> big = alloc_->Allocate(limit + kGranule, a1_);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  for (const auto& [p, s] : mix.live()) free(p);
}

// A 512 MiB tensor on a cold 80 GiB allocator is mapped in units of 64 MiB
// (a power of two granules at most 1/1024 of the headroom) from one
// physical allocation (a chunk of up to 16 units): one cuMemCreate, 8
// cuMemMap, one cuMemSetAccess. Trim unmaps unit by unit and releases the
// chunk once all of it is unmapped.
TEST_F(VmmTest, ColdTensorIsOneChunkMappedInUnits) {
  Init({}, 80 * kGiB);
  DevicePtr p = Alloc(512 * kMiB, a1_);
  ExpectVmmCalls(1u, 8u, 1u);
  EXPECT_EQ(Reserved(), 512 * kMiB);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(p);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), 8u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 1u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
}

// A cold stream maps ahead as a classic segment would: a 4 MiB request
// (which would share a 20 MiB segment) maps 16 MiB. A request of 10 MiB or
// more maps only itself, also when it extends that mapped free rest: 25 MiB
// after it maps 14 MiB more (the 12 MiB free rest + 7 granules), not up to
// the next 16 MiB.
TEST_F(VmmTest, OnlyRequestsThatShareASegmentMapAhead) {
  Init({}, 80 * kGiB);
  DevicePtr a = Alloc(4 * kMiB, a1_);
  EXPECT_EQ(Reserved(), 16 * kMiB);
  DevicePtr b = Alloc(25 * kMiB, a1_);
  EXPECT_EQ(b, a + 4 * kMiB);
  EXPECT_EQ(Reserved(), 30 * kMiB);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 2u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(a);
  Free(b);
}

// A huge run (1 GiB or more) maps in units up to 8 times coarser, at most
// 1/8 of itself: a 7 GiB tensor on a cold 80 GiB allocator is 14 mappings
// of 512 MiB (not 112 of 64 MiB) from one chunk; a 1 GiB one is 8 of
// 128 MiB. vmm_chunk_units = 1 creates a physical allocation per unit.
TEST_F(VmmTest, HugeTensorMapsInCoarserUnits) {
  Init({}, 80 * kGiB);
  DevicePtr p = Alloc(7 * kGiB, a1_);
  ExpectVmmCalls(1u, 14u, 1u);
  DevicePtr q = Alloc(1 * kGiB, a2_);
  ExpectVmmCalls(2u, 14u + 8u, 2u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  Free(p);
  Free(q);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 2u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));

  DeviceAllocatorOptions per_unit;
  per_unit.vmm_chunk_units = 1;
  Init(per_unit, 80 * kGiB);
  Free(Alloc(7 * kGiB, a1_));
  ExpectVmmCalls(14u, 14u, 1u);
}

// Near the limit (here memory_limit_bytes, 64 MiB above the tensor) units
// are single granules, so that each can move on its own under pressure; so
// they are with vmm_unit_divisor 0.
TEST_F(VmmTest, UnitsAreSingleGranulesNearTheLimit) {
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 1 * kGiB + 64 * kMiB;
  Init(o, 80 * kGiB);
  Free(Alloc(1 * kGiB, a1_));
  ExpectVmmCalls(512u, 512u, 1u);
  DeviceAllocatorOptions single;
  single.vmm_unit_divisor = 0;
  Init(single, 80 * kGiB);
  Free(Alloc(64 * kMiB, a1_));
  ExpectVmmCalls(32u, 32u, 1u);
}

// A unit is unmapped only whole and a chunk released only whole. A live
// block on part of a unit keeps the unit mapped (its free rest serves the
// stream without new memory); Trim unmaps the other units, and releases
// them only where no unit of their chunk stays mapped: with one chunk per
// unit (vmm_chunk_units = 1) they go back to the driver, with 16 units per
// chunk they stay cached and serve the next growth of any stream before a
// cuMemCreate.
TEST_F(VmmTest, TrimReleasesOnlyWhollyUnmappedChunks) {
  for (std::size_t chunk_units : {std::size_t{1}, std::size_t{16}}) {
    SCOPED_TRACE(chunk_units);
    DeviceAllocatorOptions o;
    o.vmm_chunk_units = chunk_units;
    Init(o, 80 * kGiB);
    Free(Alloc(1 * kGiB, a1_));  // 8 units of 128 MiB
    EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 8u);
    EXPECT_EQ(sim_->call_count(SimCall::kMemCreate),
              chunk_units == 1 ? 8u : 1u);
    DevicePtr small = Alloc(10 * kMiB, a1_);  // at the start of unit 0
    EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 8u);
    ASSERT_TRUE(alloc_->Trim(0).ok());
    EXPECT_EQ(Reserved(), 128 * kMiB);  // the pinned unit
    EXPECT_EQ(sim_->call_count(SimCall::kMemUnmap), 7u);
    if (chunk_units == 1) {
      EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
      EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 7u);
    } else {
      EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 7 * 128 * kMiB);
      EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 0u);
    }
    const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
    DevicePtr again = Alloc(40 * kMiB, a1_);  // in the unit's free rest
    EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
    // Another stream: 4 units of 64 MiB, new or from the cache.
    DevicePtr other = Alloc(256 * kMiB, a2_);
    EXPECT_EQ(sim_->call_count(SimCall::kMemCreate),
              creates + (chunk_units == 1 ? 4u : 0u));
    EXPECT_TRUE(alloc_->CheckInvariants().ok());
    Free(other);
    Free(again);
    Free(small);
    ASSERT_TRUE(alloc_->Trim(0).ok());
    EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
    EXPECT_EQ(Reserved(), 0u);
    EXPECT_EQ(sim_->call_count(SimCall::kMemRelease),
              sim_->call_count(SimCall::kMemCreate));
    EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
    EXPECT_TRUE(alloc_->CheckInvariants().ok());
  }
}

TEST_F(VmmTest, DriverFailuresLeaveTheBooksConsistent) {
  sim_->InjectFault(SimCall::kMemMap, 1, /*CUDA_ERROR_INVALID_VALUE=*/1);
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(4 * kMiB, a1_);
  EXPECT_FALSE(p.ok());
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  // Both granules created for the run are kept for the next growth.
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 2 * kGranule);
  sim_->InjectFault(SimCall::kMemCreate, 1, /*CUDA_ERROR_OUT_OF_MEMORY=*/2);
  // The two cached granules, then a create that fails, then the retry.
  DevicePtr q = Alloc(8 * kMiB, a1_);
  EXPECT_EQ(alloc_->Stats().granule_cache_bytes, 0u);
  Free(q);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease) + 0u,
            sim_->call_count(SimCall::kMemCreate) - 1u);  // one create failed
}

}  // namespace
}  // namespace ctxpool
