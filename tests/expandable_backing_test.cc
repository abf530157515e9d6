// Tests of the expandable backing on its own (src/alloc/expandable_backing.h):
// runs, units, pieces, the cache, release, decay, the limit and the
// rollback of a failed map. The allocator on top is tested in
// device_allocator_vmm_test.cc.
#include "../src/alloc/expandable_backing.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace alloc_internal {
namespace {

constexpr std::size_t kMiB = 1 << 20;
constexpr std::size_t kGranule = 2 * kMiB;

class ExpandableBackingTest : public ::testing::Test {
 protected:
  // `free_bytes`: the device's memory beside its context (0: 80 GiB).
  void Init(ExpandableOptions o, std::size_t free_bytes = 0) {
    SimDeviceSpec spec = *SimDevicePreset("h100-80gb");
    if (free_bytes != 0) {
      spec.capacity_bytes = spec.context_overhead_bytes + free_bytes;
    }
    sim_ = SimDriver::Create({.devices = {spec}});
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    vmm_ = std::make_unique<ExpandableBacking>(*sim_, 0, kGranule, o,
                                               [this] { return now_; });
    absl::StatusOr<VmmRange*> r = vmm_->Reserve(1024 * kGranule);
    ASSERT_TRUE(r.ok()) << r.status();
    r_ = *r;
  }
  void TearDown() override {
    if (vmm_ == nullptr) return;
    EXPECT_TRUE(vmm_->CheckInvariants(vmm_->mapped_bytes()).ok())
        << vmm_->CheckInvariants(vmm_->mapped_bytes());
    EXPECT_EQ(sim_->misuse_count(), 0u);
  }
  // Unmaps every mapping of the range.
  void UnmapAll() {
    std::vector<std::size_t> starts;
    r_->ForEachMapped(0, r_->size / kGranule,
                      [&](std::size_t i, PhysicalMemHandle) {
                        if (r_->IsStart(i)) starts.push_back(i);
                        return true;
                      });
    for (std::size_t i : starts) {
      std::size_t n = 0;
      ASSERT_TRUE(vmm_->UnmapPiece(r_, i, &n).ok());
    }
  }
  std::size_t Physical() {
    return sim_->used_bytes(0) - sim_->context_bytes(0);
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  absl::Time now_ = absl::UnixEpoch();
  std::unique_ptr<ExpandableBacking> vmm_;
  VmmRange* r_ = nullptr;
  std::vector<StuckPiece> stuck_;
};

// Units follow the headroom: 1/unit_divisor of what is left, a power of two
// granules, single granules when little is left or with unit_divisor 0.
TEST_F(ExpandableBackingTest, UnitsFollowTheHeadroom) {
  Init({.unit_divisor = 4, .capacity_bytes = 256 * kMiB});
  EXPECT_EQ(vmm_->UnitGranules(0), 32u);   // 64 MiB of 256
  EXPECT_EQ(vmm_->UnitGranules(1), 16u);   // 254 / 4 = 63.5 MiB: 31 -> 16
  EXPECT_EQ(vmm_->UnitGranules(96), 8u);   // 64 / 4 = 16 MiB
  EXPECT_EQ(vmm_->UnitGranules(124), 1u);  // 8 / 4 = 2 MiB
  EXPECT_EQ(vmm_->UnitGranules(200), 1u);  // past the capacity
  vmm_.reset();
  Init({.unit_divisor = 0, .capacity_bytes = 256 * kMiB});
  EXPECT_EQ(vmm_->UnitGranules(0), 1u);
  vmm_.reset();
  // A limit replaces the capacity.
  Init({.unit_divisor = 1,
        .memory_limit_bytes = 32 * kMiB,
        .capacity_bytes = 256 * kMiB});
  EXPECT_EQ(vmm_->UnitGranules(0), 16u);
  vmm_.reset();
}

// A huge run (1 GiB or more) may use units 8 times coarser, at most 1/8 of
// itself; units and chunks never pass 2^31 granules (a piece counts them
// in 32 bits), however large the device.
TEST_F(ExpandableBackingTest, HugeRunsUseCoarserUnitsWithinBounds) {
  const std::size_t kGiB = 1024 * kMiB;
  Init({.unit_divisor = 1024, .capacity_bytes = 80 * kGiB});
  EXPECT_EQ(vmm_->UnitGranules(256), 32u);    // 512 MiB: 79.5 GiB / 1024
  EXPECT_EQ(vmm_->UnitGranules(512), 64u);    // 1 GiB: huge, 1/8 of it
  EXPECT_EQ(vmm_->UnitGranules(3584), 256u);  // 7 GiB: 8/1024 of 73 GiB
  EXPECT_EQ(vmm_->ChunkGranules(256), 16u * 256u);
  vmm_.reset();
  Init({.unit_divisor = 1,
        .chunk_units = 65536,
        .capacity_bytes = std::size_t{1} << 62});
  EXPECT_EQ(vmm_->UnitGranules(0), ExpandableBacking::kMaxPieceGranules);
  EXPECT_EQ(vmm_->UnitGranules(std::size_t{1} << 35),
            ExpandableBacking::kMaxPieceGranules);
  EXPECT_EQ(vmm_->ChunkGranules(ExpandableBacking::kMaxPieceGranules),
            ExpandableBacking::kMaxPieceGranules);
  EXPECT_EQ(vmm_->ChunkGranules(1u << 20),
            ExpandableBacking::kMaxPieceGranules);
  vmm_.reset();
}

// A run comes in units from its start: with a chunk per unit, one
// cuMemCreate and one cuMemMap per unit (the last one what is left), one
// cuMemSetAccess for the run; each unit unmaps and is released on its own.
TEST_F(ExpandableBackingTest, RunsComeInUnits) {
  // 80 GiB capacity, divisor 1280: a unit is at most 64 MiB less a bit,
  // 31.9 granules: 16 (a power of two).
  Init({.unit_divisor = 1280,
        .chunk_units = 1,
        .capacity_bytes = 80 * 1024 * kMiB});
  ASSERT_EQ(vmm_->UnitGranules(70), 16u);
  // Granules [8, 78): [8, 24) [24, 40) [40, 56) [56, 72) [72, 78).
  ASSERT_TRUE(vmm_->MapRun(r_, 8, 70, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 5u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 5u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemSetAccess), 1u);
  EXPECT_EQ(vmm_->mapped_bytes(), 70 * kGranule);
  EXPECT_EQ(Physical(), 70 * kGranule);
  EXPECT_TRUE(r_->IsStart(8));
  EXPECT_TRUE(r_->IsStart(24));
  EXPECT_FALSE(r_->IsStart(16));
  EXPECT_EQ(r_->PieceEnd(20, 1000), 24u);
  EXPECT_EQ(r_->PieceEnd(74, 76), 76u);
  EXPECT_EQ(r_->CountMapped(0, 20), 12u);
  EXPECT_EQ(r_->Offset(30), 6u);
  std::size_t n = 0;
  EXPECT_FALSE(vmm_->UnmapPiece(r_, 17, &n).ok());  // not a mapping's start
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 24, &n).ok());
  EXPECT_EQ(n, 16u);
  EXPECT_FALSE(r_->IsMapped(30));
  EXPECT_EQ(vmm_->cache_bytes(), 16 * kGranule);
  std::size_t freed = 0;
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 16 * kGranule);  // a unit is its own allocation
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 70 * kGranule);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 5u);
  EXPECT_EQ(Physical(), 0u);
  ASSERT_TRUE(vmm_->Unreserve(r_).ok());
  vmm_.reset();
}

// Chunks of 4 units: the run of 70 granules is two physical allocations
// ([8, 72) and [72, 78)) mapped in the same 5 units. A unit unmaps on its
// own into the cache, but its chunk is released only once none of it is
// mapped; its cached unit is mapped again before any create.
TEST_F(ExpandableBackingTest, ChunksHoldUnitsAndAreReleasedWhole) {
  Init({.unit_divisor = 1280,
        .chunk_units = 4,
        .capacity_bytes = 80 * 1024 * kMiB});
  ASSERT_EQ(vmm_->UnitGranules(70), 16u);
  ASSERT_EQ(vmm_->ChunkGranules(16), 64u);
  ASSERT_EQ(vmm_->ChunkGranules(1), 1u);  // single granules stay single
  ASSERT_TRUE(vmm_->MapRun(r_, 8, 70, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 2u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 5u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemSetAccess), 1u);
  EXPECT_EQ(Physical(), 70 * kGranule);
  EXPECT_EQ(r_->Handle(8), r_->Handle(71));
  EXPECT_NE(r_->Handle(71), r_->Handle(72));
  EXPECT_EQ(r_->Offset(40), 32u);
  std::size_t n = 0;
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 24, &n).ok());
  EXPECT_EQ(n, 16u);
  std::size_t freed = 0;
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 0u);  // the rest of its chunk is mapped
  EXPECT_EQ(vmm_->cache_bytes(), 16 * kGranule);
  ASSERT_TRUE(vmm_->MapRun(r_, 200, 16, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 2u);  // the cached unit
  EXPECT_EQ(vmm_->cache_bytes(), 0u);
  ASSERT_TRUE(vmm_->CheckInvariants(vmm_->mapped_bytes()).ok());
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 70 * kGranule);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 2u);
  EXPECT_EQ(Physical(), 0u);
}

// A chunk the device cannot supply whole falls back to a unit, then to
// single granules, before the run fails.
TEST_F(ExpandableBackingTest, ChunkTheDeviceCannotSupplyFallsBackToUnits) {
  Init({.unit_divisor = 1280,
        .chunk_units = 4,
        .capacity_bytes = 80 * 1024 * kMiB});
  sim_->InjectFault(SimCall::kMemCreate, 1, /*CUDA_ERROR_OUT_OF_MEMORY=*/2);
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 40, &stuck_).ok());
  // The failed chunk of 40, then units of 16, 16 and what is left, 8.
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 1u + 3u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 3u);
  EXPECT_EQ(Physical(), 40 * kGranule);
  ASSERT_TRUE(vmm_->CheckInvariants(vmm_->mapped_bytes()).ok());
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, nullptr).ok());
  EXPECT_EQ(Physical(), 0u);
}

// Single granules (unit_divisor 0): one create and one map per granule.
TEST_F(ExpandableBackingTest, SingleGranulesWithoutUnits) {
  Init({.unit_divisor = 0, .capacity_bytes = 80 * 1024 * kMiB});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 5, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 5u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 5u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemSetAccess), 1u);
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, nullptr).ok());
  EXPECT_EQ(Physical(), 0u);
}

// Cached pieces serve a new run before any create, split when larger; a
// piece larger than the unit is mapped in units, and its allocation is
// released only once none of it is mapped.
TEST_F(ExpandableBackingTest, CachedPiecesServeFirstAndSplit) {
  Init({.unit_divisor = 1280, .capacity_bytes = 80 * 1024 * kMiB});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 16, &stuck_).ok());  // one unit
  UnmapAll();
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  ASSERT_TRUE(vmm_->MapRun(r_, 100, 3, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
  EXPECT_EQ(vmm_->cache_bytes(), 13 * kGranule);
  std::size_t freed = 0;
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 0u);  // part of it is mapped
}

// A cached piece is mapped in the unit of the moment: a unit cached while
// there was room comes back in single granules near the limit.
TEST_F(ExpandableBackingTest, CachedPieceMapsInTheUnitOfTheMoment) {
  Init({.unit_divisor = 1,
        .memory_limit_bytes = 32 * kMiB,
        .capacity_bytes = 80 * 1024 * kMiB});
  ASSERT_EQ(vmm_->UnitGranules(8), 8u);
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 8, &stuck_).ok());  // one unit of 8
  ASSERT_EQ(sim_->call_count(SimCall::kMemMap), 1u);
  ASSERT_EQ(vmm_->UnitGranules(7), 1u);                // 2 MiB would be left
  ASSERT_TRUE(vmm_->MapRun(r_, 50, 7, &stuck_).ok());  // 7 new granules
  ASSERT_EQ(sim_->call_count(SimCall::kMemCreate), 1u + 7u);
  std::size_t n = 0;
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 0, &n).ok());  // the unit of 8, cached
  ASSERT_EQ(n, 8u);
  // 7 of the cached 8 granules leave 2 MiB of the limit, as before: held
  // are 7 mapped and 8 cached, none new.
  ASSERT_EQ(vmm_->UnitGranules(7), 1u);
  ASSERT_TRUE(vmm_->MapRun(r_, 200, 7, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 1u + 7u);  // no new one
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 1u + 7u + 7u);
  EXPECT_EQ(vmm_->cache_bytes(), kGranule);
  UnmapAll();
  // All 15 granules cached: 7 of them still leave 2 MiB (the cache is held
  // memory), but once it is released 7 new ones leave 18 MiB.
  EXPECT_EQ(vmm_->UnitGranules(7), 1u);
  ASSERT_TRUE(vmm_->Release(0, nullptr).ok());
  EXPECT_EQ(Physical(), 0u);
  EXPECT_EQ(vmm_->UnitGranules(7), 8u);
}

// Growth past memory_limit_bytes fails as the driver's out-of-memory would,
// and changes nothing.
TEST_F(ExpandableBackingTest, LimitFailsLikeOutOfMemory) {
  Init({.memory_limit_bytes = 8 * kGranule});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 6, &stuck_).ok());
  absl::Status s = vmm_->MapRun(r_, 10, 3, &stuck_);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory) << s;
  EXPECT_EQ(vmm_->mapped_bytes(), 6 * kGranule);
  EXPECT_EQ(vmm_->cache_bytes(), 0u);
  EXPECT_TRUE(stuck_.empty());
  ASSERT_TRUE(vmm_->MapRun(r_, 10, 2, &stuck_).ok());  // fits
}

// A unit the device cannot supply whole falls back to single granules: the
// run takes what the device has before reporting out of memory.
TEST_F(ExpandableBackingTest, UnitThatDoesNotFitFallsBackToGranules) {
  // Units of 8 granules by the capacity; the device has 12 MiB.
  Init({.unit_divisor = 1, .capacity_bytes = 40 * kMiB},
       /*free_bytes=*/12 * kMiB);
  ASSERT_EQ(vmm_->UnitGranules(10), 8u);
  absl::Status s = vmm_->MapRun(r_, 0, 10, &stuck_);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory) << s;
  EXPECT_EQ(vmm_->mapped_bytes(), 0u);
  EXPECT_EQ(vmm_->cache_bytes(), 12 * kMiB);  // all the device had
  EXPECT_EQ(Physical(), 12 * kMiB);
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 6, &stuck_).ok());  // from the cache
  EXPECT_EQ(vmm_->cache_bytes(), 0u);
}

// A failed access rolls the run back into the cache; a piece that can be
// neither given access nor unmapped is reported stuck and stays booked.
TEST_F(ExpandableBackingTest, FailedMapRollsBackOrReportsStuckPieces) {
  Init({});
  sim_->InjectFault(SimCall::kMemSetAccess, 1, cu::kErrorOutOfMemory);
  EXPECT_FALSE(vmm_->MapRun(r_, 0, 4, &stuck_).ok());
  EXPECT_TRUE(stuck_.empty());
  EXPECT_EQ(vmm_->mapped_bytes(), 0u);
  EXPECT_EQ(vmm_->cache_bytes(), 4 * kGranule);
  EXPECT_TRUE(vmm_->CheckInvariants(0).ok());
  // Access fails, and so does every unmap: all four stay mapped, stuck.
  sim_->InjectFault(SimCall::kMemSetAccess, 1, cu::kErrorOutOfMemory);
  sim_->InjectFault(SimCall::kMemUnmap, 100, 999);
  EXPECT_FALSE(vmm_->MapRun(r_, 10, 4, &stuck_).ok());
  std::size_t stuck = 0;
  for (const StuckPiece& p : stuck_) stuck += p.count;
  EXPECT_EQ(stuck, 4u);
  EXPECT_EQ(vmm_->mapped_bytes(), 4 * kGranule);
  EXPECT_GT(vmm_->counters().driver_errors, 0);
  sim_->InjectFault(SimCall::kMemUnmap, 0, 0);
}

// Decay releases what has been cached since the cutoff, whole allocations
// only.
TEST_F(ExpandableBackingTest, DecayReleasesStaleAllocations) {
  Init({});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 2, &stuck_).ok());  // 2 granules
  std::size_t n = 0;
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 0, &n).ok());
  now_ += absl::Seconds(10);
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 1, &n).ok());
  std::size_t freed = 0;
  ASSERT_TRUE(vmm_->Decay(absl::UnixEpoch() + absl::Seconds(5), &freed).ok());
  EXPECT_EQ(freed, kGranule);  // the older one
  EXPECT_EQ(vmm_->cache_bytes(), kGranule);
  vmm_->ReleaseAll();
  EXPECT_EQ(Physical(), 0u);
}

}  // namespace
}  // namespace alloc_internal
}  // namespace ctxpool
