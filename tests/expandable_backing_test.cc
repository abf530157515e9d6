// Tests of the expandable backing on its own (src/alloc/expandable_backing.h):
// runs, chunks, pieces, the cache, release, decay, the limit and the
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

// A large run: single granules at both ends, chunks between; one mapping
// per granule; a chunk is released only once none of it is mapped.
TEST_F(ExpandableBackingTest, LargeRunsComeInChunksReleasedWhole) {
  Init({.chunk_bytes = 16 * kMiB});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 40, /*small=*/false, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), 1u + 5u + 1u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap), 40u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemSetAccess), 1u);
  EXPECT_EQ(vmm_->mapped_bytes(), 40 * kGranule);
  EXPECT_EQ(Physical(), 40 * kGranule);
  std::size_t n = 0;
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 5, &n).ok());
  EXPECT_EQ(n, 1u);
  EXPECT_EQ(vmm_->cache_bytes(), kGranule);
  std::size_t freed = 0;
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 0u);  // its chunk is still mapped elsewhere
  EXPECT_EQ(vmm_->cache_bytes(), kGranule);
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, &freed).ok());
  EXPECT_EQ(freed, 40 * kGranule);
  EXPECT_EQ(sim_->call_count(SimCall::kMemRelease), 7u);
  EXPECT_EQ(Physical(), 0u);
  ASSERT_TRUE(vmm_->Unreserve(r_).ok());
  vmm_.reset();
}

// Cached pieces serve a new run before any create, split when larger.
TEST_F(ExpandableBackingTest, CachedPiecesServeFirstAndSplit) {
  Init({.chunk_bytes = 16 * kMiB});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 10, false, &stuck_).ok());
  UnmapAll();
  const std::uint64_t creates = sim_->call_count(SimCall::kMemCreate);
  ASSERT_TRUE(vmm_->MapRun(r_, 100, 3, false, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemCreate), creates);
  EXPECT_EQ(vmm_->cache_bytes(), 7 * kGranule);
  EXPECT_TRUE(vmm_->CheckInvariants(vmm_->mapped_bytes()).ok());
}

// map_whole_chunks: one cuMemMap per piece, and a piece unmaps whole.
TEST_F(ExpandableBackingTest, WholeChunksMapAndUnmapAsOne) {
  Init({.chunk_bytes = 16 * kMiB, .map_whole_chunks = true});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 10, false, &stuck_).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemMap),
            sim_->call_count(SimCall::kMemCreate));
  std::size_t n = 0;
  ASSERT_TRUE(vmm_->UnmapPiece(r_, 1, &n).ok());
  EXPECT_EQ(n, 8u);                                // granules 1-8: one chunk
  EXPECT_FALSE(vmm_->UnmapPiece(r_, 2, &n).ok());  // no mapping starts there
  UnmapAll();
  ASSERT_TRUE(vmm_->Release(0, nullptr).ok());
  EXPECT_EQ(Physical(), 0u);
}

// Growth past memory_limit_bytes fails as the driver's out-of-memory would,
// and changes nothing.
TEST_F(ExpandableBackingTest, LimitFailsLikeOutOfMemory) {
  Init({.memory_limit_bytes = 8 * kGranule});
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 6, false, &stuck_).ok());
  absl::Status s = vmm_->MapRun(r_, 10, 3, false, &stuck_);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory) << s;
  EXPECT_EQ(vmm_->mapped_bytes(), 6 * kGranule);
  EXPECT_EQ(vmm_->cache_bytes(), 0u);
  EXPECT_TRUE(stuck_.empty());
  ASSERT_TRUE(vmm_->MapRun(r_, 10, 2, false, &stuck_).ok());  // fits
}

// A chunk the device cannot supply whole falls back to single granules:
// the run takes what the device has before reporting out of memory.
TEST_F(ExpandableBackingTest, ChunkThatDoesNotFitFallsBackToGranules) {
  Init({.chunk_bytes = 16 * kMiB}, /*free_bytes=*/12 * kMiB);
  // 10 granules: a single, a 16 MiB chunk (does not fit), then singles.
  absl::Status s = vmm_->MapRun(r_, 0, 10, false, &stuck_);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory) << s;
  EXPECT_EQ(vmm_->mapped_bytes(), 0u);
  EXPECT_EQ(vmm_->cache_bytes(), 12 * kMiB);  // all the device had
  EXPECT_EQ(Physical(), 12 * kMiB);
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 6, false, &stuck_).ok());  // from the cache
  EXPECT_EQ(vmm_->cache_bytes(), 0u);
}

// A failed access rolls the run back into the cache; a piece that can be
// neither given access nor unmapped is reported stuck and stays booked.
TEST_F(ExpandableBackingTest, FailedMapRollsBackOrReportsStuckPieces) {
  Init({});
  sim_->InjectFault(SimCall::kMemSetAccess, 1, cu::kErrorOutOfMemory);
  EXPECT_FALSE(vmm_->MapRun(r_, 0, 4, false, &stuck_).ok());
  EXPECT_TRUE(stuck_.empty());
  EXPECT_EQ(vmm_->mapped_bytes(), 0u);
  EXPECT_EQ(vmm_->cache_bytes(), 4 * kGranule);
  EXPECT_TRUE(vmm_->CheckInvariants(0).ok());
  // Access fails, and so does every unmap: all four stay mapped, stuck.
  sim_->InjectFault(SimCall::kMemSetAccess, 1, cu::kErrorOutOfMemory);
  sim_->InjectFault(SimCall::kMemUnmap, 100, 999);
  EXPECT_FALSE(vmm_->MapRun(r_, 10, 4, false, &stuck_).ok());
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
  ASSERT_TRUE(vmm_->MapRun(r_, 0, 2, true, &stuck_).ok());  // 2 granules
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
