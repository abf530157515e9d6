// Attack tests of the expandable backing's chunks and huge-run units
// (DeviceAllocatorOptions::vmm_chunk_units, ExpandableBacking::kHugeRunBytes)
// and of "requests of 10 MiB and more never map ahead": after every sequence
// the allocator's books match the simulated driver's (physical bytes in use
// == mapped + cached + leaked), every cuMemCreate is released once all is
// freed and trimmed, driver faults in the middle of a chunked run lose
// nothing, chunks split across streams and tenants move under pressure,
// Trim and decay report what they give back, concurrent huge and small
// allocations keep the invariants, and chunking is invisible to everything
// but giving memory back (vmm_chunk_units = 1 and 16 behave alike).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../src/alloc/expandable_backing.h"
#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "alloc_test_support.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/replay.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kGranule = 2 * kMiB;
constexpr int kOutOfMemory = 2;   // CUDA_ERROR_OUT_OF_MEMORY
constexpr int kInvalidValue = 1;  // CUDA_ERROR_INVALID_VALUE

class VmmChunksAttackTest : public test::DeviceAllocatorFixture {
 protected:
  // A fresh device and an expandable allocator (clock: now_), four streams.
  void Init(DeviceAllocatorOptions o, std::size_t capacity,
            std::size_t context_bytes = 0, std::size_t granularity = 2 * kMiB) {
    o.backing = BackingMode::kExpandable;
    InitAllocator(capacity, std::move(o), context_bytes, granularity);
    streams_ = {a1_, a2_, b1_, *sim_->StreamCreate(kStreamNonBlocking, 0)};
  }

  void TearDown() override {
    for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
    DeviceAllocatorFixture::TearDown();
  }

  StreamHandle s(int i) const { return streams_[static_cast<std::size_t>(i)]; }

  std::size_t Reserved() const {
    return static_cast<std::size_t>(
        alloc_->Stats().total.reserved_bytes[0].current);
  }
  std::size_t Cache() const { return alloc_->Stats().granule_cache_bytes; }
  absl::Status Books() const { return CheckBooks(); }

  // After everything was freed: Trim(0) gives every byte back and every
  // successful cuMemCreate has its cuMemRelease.
  void ExpectAllReturned() {
    absl::StatusOr<TrimResult> t = alloc_->Trim(0);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(Books().ok()) << Books();
    const DeviceAllocatorStats st = alloc_->Stats();
    EXPECT_EQ(st.total.allocated_bytes[0].current, 0);
    EXPECT_EQ(st.total.reserved_bytes[0].current, 0);
    EXPECT_EQ(st.granule_cache_bytes, 0u);
    EXPECT_EQ(st.leaked_bytes, 0u);
    EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
    EXPECT_EQ(st.upstream_allocs, st.upstream_frees);
    EXPECT_EQ(t->remaining_bytes, 0u);
  }

  std::uint64_t Calls(SimCall c) const { return sim_->call_count(c); }

  std::vector<StreamHandle> streams_;
};

// The unit a cold run of `n` granules gets on an empty device of `cap`
// granules (the documented rule, written out independently): a power of two
// at most headroom/divisor; a run of 1 GiB or more may take up to 8 times
// that where it is 2 or more, but at most n/8; capped at 2^31.
std::size_t ModelUnit(std::size_t cap, std::size_t n, std::size_t divisor,
                      std::size_t granule) {
  if (divisor == 0 || n >= cap) return 1;
  const std::size_t headroom = cap - n;
  std::size_t u = headroom / divisor;
  if (u >= 2 && n * granule >= kGiB) u = std::max(u, std::min(u * 8, n / 8));
  if (u <= 1) return 1;
  return std::min<std::size_t>(absl::bit_floor(u), std::size_t{1} << 31);
}

// Exact sizes around the 1 GiB huge-run threshold (and odd, non-granule
// sizes) on a cold 80 GiB device: mappings and creates follow the rule, the
// whole block is mapped with access (Touch), and all of it goes back.
TEST_F(VmmChunksAttackTest, HugeThresholdSizesMapAsDocumented) {
  const std::size_t cap = 80 * kGiB / kGranule;
  for (std::size_t bytes :
       {kGiB - 2 * kMiB, kGiB - 2 * kMiB + 1, kGiB - 1, kGiB, kGiB + 1,
        2 * kGiB + 3 * kMiB + 17, 7 * kGiB, 31 * kGiB + 1}) {
    SCOPED_TRACE(bytes);
    Init({}, 80 * kGiB);
    DevicePtr p = Alloc(bytes, s(0));
    const std::size_t n = (bytes + kGranule - 1) / kGranule;
    const std::size_t unit = ModelUnit(cap, n, 1024, kGranule);
    EXPECT_EQ(Calls(SimCall::kMemMap), (n + unit - 1) / unit);
    EXPECT_EQ(Calls(SimCall::kMemCreate), (n + 16 * unit - 1) / (16 * unit));
    EXPECT_EQ(Calls(SimCall::kMemSetAccess), 1u);
    EXPECT_EQ(Reserved(), n * kGranule);
    EXPECT_TRUE(Books().ok()) << Books();
    Free(p);
    ExpectAllReturned();
  }
}

// A run longer than a chunk: chunks of 1, 3, 16 and 65536 units (the last
// capped by the run) all map the same units, create ceil(n / chunk)
// allocations, and give everything back.
TEST_F(VmmChunksAttackTest, RunsLongerThanAChunkForEveryChunkSize) {
  // 20 GiB cold on 80 GiB: unit 128 granules (256 MiB), 80 mappings.
  const std::size_t n = 20 * kGiB / kGranule;
  const std::size_t unit = ModelUnit(80 * kGiB / kGranule, n, 1024, kGranule);
  ASSERT_EQ(unit, 128u);
  for (std::size_t chunk_units :
       {std::size_t{1}, std::size_t{3}, std::size_t{16}, std::size_t{65536}}) {
    SCOPED_TRACE(chunk_units);
    DeviceAllocatorOptions o;
    o.vmm_chunk_units = chunk_units;
    Init(o, 80 * kGiB);
    DevicePtr p = Alloc(20 * kGiB, s(0));
    const std::size_t chunk = unit * chunk_units;
    EXPECT_EQ(Calls(SimCall::kMemCreate), (n + chunk - 1) / chunk);
    EXPECT_EQ(Calls(SimCall::kMemMap), n / unit);
    DevicePtr q = Alloc(5 * kMiB, s(1));
    EXPECT_TRUE(Books().ok()) << Books();
    Free(p);
    // Half the huge block again on another stream: from the cache after a
    // trim, whatever the chunk size.
    ASSERT_TRUE(alloc_->Trim(80 * kGiB).ok());
    const std::uint64_t creates = Calls(SimCall::kMemCreate);
    DevicePtr r = Alloc(10 * kGiB, s(2));
    EXPECT_EQ(Calls(SimCall::kMemCreate), creates);
    EXPECT_TRUE(Books().ok()) << Books();
    Free(r);
    Free(q);
    ExpectAllReturned();
  }
}

// cuMemCreate out of memory in a chunked run: a chunk falls back to units,
// a unit to granules; a granule that fails goes through Reclaim and the
// retry. A non-OOM error fails the request. Nothing leaks either way.
TEST_F(VmmChunksAttackTest, CreateFailuresFallBackAndLoseNothing) {
  // 512 MiB cold on 80 GiB: unit 32 granules, one chunk of 256 granules.
  struct Case {
    int faults;
    int error;
    bool ok;
    std::uint64_t creates;  // calls, failed ones included
    std::uint64_t maps;
  };
  for (const Case& c : {Case{1, kOutOfMemory, true, 1 + 8, 8},
                        Case{2, kOutOfMemory, true, 2 + 256, 256},
                        Case{3, kOutOfMemory, true, 3 + 1, 8},
                        Case{1, kInvalidValue, false, 1, 0}}) {
    SCOPED_TRACE(c.faults);
    SCOPED_TRACE(c.error);
    Init({}, 80 * kGiB);
    sim_->InjectFault(SimCall::kMemCreate, c.faults, c.error);
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(512 * kMiB, s(0));
    EXPECT_EQ(p.ok(), c.ok) << p.status();
    EXPECT_EQ(Calls(SimCall::kMemCreate), c.creates);
    EXPECT_EQ(Calls(SimCall::kMemMap), c.maps);
    EXPECT_TRUE(Books().ok()) << Books();
    if (p.ok()) {
      EXPECT_TRUE(sim_->Touch(s(0), *p, 512 * kMiB).ok());
      Free(*p);
    }
    Free(Alloc(700 * kMiB, s(1)));  // later allocations work
    EXPECT_TRUE(Books().ok()) << Books();
    ExpectAllReturned();
  }
}

// cuMemMap or cuMemSetAccess failing in a chunked 1 GiB run: every unit is
// rolled back into the cache (the chunk stays whole), the next growth of
// another stream maps it without a create, and Trim returns it.
TEST_F(VmmChunksAttackTest, MapAndAccessFaultsRollBackWholeChunks) {
  for (SimCall call : {SimCall::kMemMap, SimCall::kMemSetAccess}) {
    SCOPED_TRACE(SimCallName(call));
    Init({}, 80 * kGiB);
    DevicePtr keep = Alloc(3 * kMiB, s(2));
    sim_->InjectFault(call, 1, kInvalidValue);
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(kGiB, s(0));
    EXPECT_FALSE(p.ok());
    EXPECT_TRUE(Books().ok()) << Books();
    EXPECT_EQ(Cache(), kGiB);
    const std::uint64_t creates = Calls(SimCall::kMemCreate);
    DevicePtr q = Alloc(kGiB, s(1));
    EXPECT_EQ(Calls(SimCall::kMemCreate), creates);
    EXPECT_EQ(Cache(), 0u);
    EXPECT_TRUE(Books().ok()) << Books();
    Free(q);
    Free(keep);
    ExpectAllReturned();
  }
}

// The rollback's unmap fails twice: that unit stays mapped (stuck) and pins
// its 16-unit chunk. With access it is a mapped free block: the next Trim
// unmaps it and releases the whole chunk. Without access it is quarantined:
// the books still match the driver, and the rest of its chunk stays cached.
TEST_F(VmmChunksAttackTest, StuckUnitPinsItsChunkButBooksHold) {
  for (int access_faults : {1, 2}) {
    SCOPED_TRACE(access_faults);
    Init({}, 80 * kGiB);
    sim_->InjectFault(SimCall::kMemSetAccess, access_faults, kInvalidValue);
    sim_->InjectFault(SimCall::kMemUnmap, 2, kInvalidValue);
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(kGiB, s(0));
    EXPECT_FALSE(p.ok());
    EXPECT_TRUE(Books().ok()) << Books();
    EXPECT_EQ(Reserved(), 128 * kMiB);  // the stuck unit
    EXPECT_EQ(Cache(), 7 * 128 * kMiB);
    absl::StatusOr<TrimResult> t = alloc_->Trim(0);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(Books().ok()) << Books();
    if (access_faults == 1) {
      EXPECT_EQ(t->freed_bytes, kGiB);
      EXPECT_EQ(Physical(), 0u);
    } else {
      EXPECT_EQ(t->freed_bytes, 0u);  // the chunk is pinned by quarantine
      EXPECT_EQ(Physical(), kGiB);
    }
    // The cached rest still serves growth before any create.
    const std::uint64_t creates = Calls(SimCall::kMemCreate);
    DevicePtr q = Alloc(access_faults == 1 ? 64 * kMiB : 7 * 128 * kMiB, s(1));
    EXPECT_EQ(Calls(SimCall::kMemCreate),
              creates + (access_faults == 1 ? 1u : 0u));
    EXPECT_TRUE(Books().ok()) << Books();
    Free(q);
  }
}

// cuMemRelease failing in Trim: the error is returned, the books hold, and
// the next Trim gives everything back once.
TEST_F(VmmChunksAttackTest, ReleaseFaultInTrimIsRetriedByTheNextTrim) {
  Init({}, 80 * kGiB);
  DevicePtr a = Alloc(3 * kGiB, s(0));
  DevicePtr b = Alloc(700 * kMiB, s(1));
  Free(a);
  Free(b);
  sim_->InjectFault(SimCall::kMemRelease, 1, kInvalidValue);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  EXPECT_FALSE(t.ok());
  EXPECT_TRUE(Books().ok()) << Books();
  EXPECT_GT(Cache(), 0u);
  ExpectAllReturned();
}

// Trim with part of a chunk mapped by another stream: the chunk stays (its
// other units cached), freed_bytes is exactly what the driver got back,
// remaining_bytes is mapped + cached; once the last unit is free it goes.
TEST_F(VmmChunksAttackTest, TrimReportsExactlyWhatTheDriverGotBack) {
  Init({}, 80 * kGiB);
  DevicePtr big = Alloc(kGiB, s(0));          // one chunk, 8 units of 128 MiB
  DevicePtr other = Alloc(300 * kMiB, s(1));  // its own chunk
  Free(big);
  ASSERT_TRUE(alloc_->Trim(80 * kGiB).ok());  // unmap only: all cached
  EXPECT_EQ(Cache(), kGiB);
  EXPECT_EQ(Calls(SimCall::kMemRelease), 0u);
  DevicePtr piece = Alloc(100 * kMiB, s(2));  // a part of the cached chunk
  EXPECT_EQ(Calls(SimCall::kMemCreate), 2u);
  Free(other);
  std::size_t before = Physical();
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, before - Physical());
  EXPECT_EQ(t->freed_bytes, 300 * kMiB);  // `other`'s chunk
  EXPECT_EQ(t->remaining_bytes, Reserved() + Cache());
  EXPECT_EQ(Physical(), kGiB);  // the pinned chunk, mapped or cached
  EXPECT_TRUE(Books().ok()) << Books();
  Free(piece);
  before = Physical();
  t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->freed_bytes, before - Physical());
  ExpectAllReturned();
}

// Decay with a partly mapped chunk: TrimIdle's freed_bytes is what the
// driver got back; a chunk with a unit mapped elsewhere is not released; it
// is once everything is idle long enough.
TEST_F(VmmChunksAttackTest, DecayReleasesChunksOnlyWhenWhollyIdle) {
  DeviceAllocatorOptions o;
  o.idle_release_after = absl::Seconds(5);
  Init(o, 80 * kGiB);
  DevicePtr big = Alloc(2 * kGiB, s(0));
  Free(big);
  auto idle = [&] {
    const std::size_t before = Physical();
    absl::StatusOr<TrimResult> t = alloc_->TrimIdle();
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) {
      EXPECT_EQ(t->freed_bytes, before - Physical());
    }
    EXPECT_TRUE(Books().ok()) << Books();
  };
  idle();  // stamps s(0)
  now_ += absl::Seconds(6);
  idle();  // s(0) idle: its units go to the cache
  EXPECT_EQ(Reserved(), 0u);
  EXPECT_EQ(Cache(), 2 * kGiB);
  DevicePtr p = Alloc(200 * kMiB, s(1));  // from the cached chunk
  EXPECT_EQ(Calls(SimCall::kMemCreate), 1u);
  now_ += absl::Seconds(6);
  idle();
  idle();
  EXPECT_EQ(Physical(), 2 * kGiB);  // pinned by s(1)'s unit(s)
  Free(p);
  for (int i = 0; i < 4; ++i) {
    now_ += absl::Seconds(6);
    idle();
  }
  EXPECT_EQ(Physical(), 0u);
  ExpectAllReturned();
}

// Tenants on a 2 GiB device with coarse units (vmm_unit_divisor 16) share
// chunks; a request that needs another tenant's free memory above its min
// gets it through the cache, never below the min.
TEST_F(VmmChunksAttackTest, ChunksMoveBetweenTenantsUnderPressure) {
  DeviceAllocatorOptions o;
  o.vmm_unit_divisor = 16;
  Init(o, 2 * kGiB);
  absl::StatusOr<TenantId> a =
      alloc_->RegisterTenant("a", Budget{.min = 256 * kMiB});
  absl::StatusOr<TenantId> b = alloc_->RegisterTenant("b", Budget{});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(alloc_->BindStream(s(0), *a).ok());
  ASSERT_TRUE(alloc_->BindStream(s(1), *b).ok());
  DevicePtr x = Alloc(1536 * kMiB, s(0));
  EXPECT_TRUE(Books().ok()) << Books();
  Free(x);
  // 512 MiB free on the device, 1280 MiB of a's above its min.
  DevicePtr y = Alloc(1792 * kMiB, s(1));
  EXPECT_TRUE(Books().ok()) << Books();
  absl::StatusOr<TenantStats> as = alloc_->GetTenantStats(*a);
  ASSERT_TRUE(as.ok());
  EXPECT_GE(as->mapped_bytes, 256 * kMiB);
  // More than the device can give without going below a's min: refused.
  absl::StatusOr<DevicePtr> z = alloc_->Allocate(130 * kMiB, s(1));
  EXPECT_FALSE(z.ok());
  EXPECT_TRUE(Books().ok()) << Books();
  Free(y);
  ExpectAllReturned();
}

// A random mix with Trim, TrimIdle and decay on a small device with coarse
// units, three streams over two tenants: books checked after every step,
// everything back at the end.
TEST_F(VmmChunksAttackTest, RandomPressureKeepsTheBooks) {
  for (std::size_t chunk_units : {std::size_t{1}, std::size_t{5}}) {
    SCOPED_TRACE(chunk_units);
    DeviceAllocatorOptions o;
    o.vmm_unit_divisor = 8;
    o.vmm_chunk_units = chunk_units;
    o.idle_release_after = absl::Seconds(3);
    Init(o, 1 * kGiB, 64 * kMiB);
    absl::StatusOr<TenantId> t =
        alloc_->RegisterTenant("t", Budget{.min = 64 * kMiB});
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(alloc_->BindStream(s(2), *t).ok());
    std::mt19937_64 rng(11 + chunk_units);
    std::vector<DevicePtr> live;
    int failures = 0;
    for (int i = 0; i < 400; ++i) {
      const int op = static_cast<int>(rng() % 20);
      if (op < 9 || live.empty()) {
        const std::size_t bytes =
            op % 3 == 0 ? 1 + rng() % kMiB : 1 + rng() % (300 * kMiB);
        absl::StatusOr<DevicePtr> p =
            alloc_->Allocate(bytes, s(static_cast<int>(rng() % 3)));
        if (p.ok()) {
          live.push_back(*p);
        } else {
          ++failures;
          EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
        }
      } else if (op < 17) {
        const std::size_t k = rng() % live.size();
        Free(live[k]);
        live[k] = live.back();
        live.pop_back();
      } else if (op == 17) {
        EXPECT_TRUE(alloc_->Trim(rng() % (256 * kMiB)).ok());
      } else {
        now_ += absl::Seconds(static_cast<int>(rng() % 3));
        EXPECT_TRUE(alloc_->TrimIdle().ok());
      }
      absl::Status books = Books();
      ASSERT_TRUE(books.ok()) << "step " << i << ": " << books;
    }
    EXPECT_GT(failures, 0);  // it did run out now and then
    for (DevicePtr p : live) Free(p);
    ExpectAllReturned();
  }
}

// Threads, each on its own stream, allocate small, large and huge blocks at
// once (one also trims) on a roomy device: no failure, books hold, all back.
TEST_F(VmmChunksAttackTest, ConcurrentHugeAndSmallAllocations) {
  Init({}, 80 * kGiB);
  testing_internal::RunOnThreads(
      *sim_, ctx_, /*num_threads=*/4, [&](int w, StreamHandle st) {
        std::mt19937_64 rng(100 + w);
        std::vector<std::pair<DevicePtr, std::size_t>> live;
        for (int i = 0; i < 120; ++i) {
          if (live.size() < 4 && rng() % 2 == 0) {
            static constexpr std::size_t kSizes[] = {
                4096,     700 * kKiB, 12 * kMiB,       300 * kMiB,
                kGiB - 1, kGiB,       kGiB + 5 * kMiB, 3 * kGiB};
            const std::size_t bytes = kSizes[rng() % 8] + rng() % 4096;
            absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, st);
            EXPECT_TRUE(p.ok()) << p.status();
            if (!p.ok()) continue;
            EXPECT_TRUE(sim_->Touch(st, *p, bytes).ok());
            live.emplace_back(*p, bytes);
          } else if (!live.empty()) {
            const std::size_t k = rng() % live.size();
            EXPECT_TRUE(alloc_->Deallocate(live[k].first).ok());
            live[k] = live.back();
            live.pop_back();
          }
          if (w == 0 && i % 15 == 0) {
            EXPECT_TRUE(alloc_->Trim(i % 2 == 0 ? 0 : kGiB).ok());
            EXPECT_TRUE(alloc_->TrimIdle().ok());
          }
        }
        for (const auto& [p, bytes] : live) {
          EXPECT_TRUE(alloc_->Deallocate(p).ok());
        }
      });
  EXPECT_TRUE(Books().ok()) << Books();
  ExpectAllReturned();
}

// The same, on a device too small for all of them (memory_limit_bytes):
// failures are RESOURCE_EXHAUSTED only, the limit is never passed, all back.
TEST_F(VmmChunksAttackTest, ConcurrentHugeAllocationsUnderALimit) {
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 6 * kGiB;
  Init(o, 64 * kGiB);
  testing_internal::RunOnThreads(
      *sim_, ctx_, /*num_threads=*/4, [&](int w, StreamHandle st) {
        std::mt19937_64 rng(200 + w);
        std::vector<DevicePtr> live;
        for (int i = 0; i < 80; ++i) {
          if (live.size() < 3 && rng() % 2 == 0) {
            static constexpr std::size_t kSizes[] = {
                64 * kKiB, 24 * kMiB, 500 * kMiB, kGiB, 1536 * kMiB};
            absl::StatusOr<DevicePtr> p =
                alloc_->Allocate(kSizes[rng() % 5], st);
            if (p.ok()) {
              live.push_back(*p);
            } else {
              EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
                  << p.status();
            }
            EXPECT_LE(alloc_->PhysicalBytes(), 6 * kGiB);
          } else if (!live.empty()) {
            const std::size_t k = rng() % live.size();
            EXPECT_TRUE(alloc_->Deallocate(live[k]).ok());
            live[k] = live.back();
            live.pop_back();
          }
        }
        for (DevicePtr p : live) EXPECT_TRUE(alloc_->Deallocate(p).ok());
      });
  EXPECT_TRUE(Books().ok()) << Books();
  ExpectAllReturned();
}

// One random trace (three streams, small to huge, frees, trims) replayed
// with a chunk per unit and with 16 units per chunk.
struct TraceOutcome {
  std::vector<bool> ok;
  std::vector<std::size_t> held;  // reserved + cached after each step
};

TraceOutcome RunTrace(
    bool trims, int steps, std::size_t huge_limit,
    const std::function<absl::StatusOr<DevicePtr>(std::size_t, int)>& alloc,
    const std::function<void(DevicePtr)>& free,
    const std::function<void()>& trim,
    const std::function<std::size_t()>& held) {
  TraceOutcome out;
  std::mt19937_64 rng(4242);
  std::vector<DevicePtr> live;
  for (int i = 0; i < steps; ++i) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 5 && live.size() < 16) {
      const int band = static_cast<int>(rng() % 10);
      const std::size_t bytes =
          band < 4 ? 1 + rng() % kMiB
                   : (band < 8 ? kMiB + rng() % (40 * kMiB)
                               : (band < 9 ? 40 * kMiB + rng() % (600 * kMiB)
                                           : kGiB + rng() % huge_limit));
      absl::StatusOr<DevicePtr> p = alloc(bytes, static_cast<int>(rng() % 3));
      out.ok.push_back(p.ok());
      if (p.ok()) live.push_back(*p);
    } else if (op < 9 && !live.empty()) {
      const std::size_t k = rng() % live.size();
      free(live[k]);
      live[k] = live.back();
      live.pop_back();
    } else if (trims) {
      trim();
    }
    out.held.push_back(held());
  }
  for (DevicePtr p : live) free(p);
  return out;
}

TEST_F(VmmChunksAttackTest, ChunkUnitsOneAndSixteenAgree) {
  // Roomy, with trims: every request succeeds in both.
  // Pressured (a limit), no trims: same outcomes and the same memory held
  // after every step, since chunks only change what can be released.
  for (bool pressured : {false, true}) {
    SCOPED_TRACE(pressured);
    TraceOutcome outcome[2];
    for (int k = 0; k < 2; ++k) {
      DeviceAllocatorOptions o;
      o.vmm_chunk_units = k == 0 ? 1 : 16;
      if (pressured) {
        o.memory_limit_bytes = 5 * kGiB;
        o.vmm_unit_divisor = 64;
      }
      Init(o, 80 * kGiB);
      outcome[k] = RunTrace(
          /*trims=*/!pressured, 400, pressured ? 2 * kGiB : 3 * kGiB,
          [&](std::size_t bytes, int st) {
            return alloc_->Allocate(bytes, s(st));
          },
          [&](DevicePtr p) { Free(p); },
          [&] { EXPECT_TRUE(alloc_->Trim(kGiB / 2).ok()); },
          [&] { return alloc_->PhysicalBytes(); });
      EXPECT_TRUE(Books().ok()) << Books();
      ExpectAllReturned();
    }
    ASSERT_EQ(outcome[0].ok.size(), outcome[1].ok.size());
    for (std::size_t i = 0; i < outcome[0].ok.size(); ++i) {
      ASSERT_EQ(outcome[0].ok[i], outcome[1].ok[i]) << "request " << i;
      if (!pressured) {
        EXPECT_TRUE(outcome[0].ok[i]) << "request " << i;
      }
    }
    if (pressured) {
      EXPECT_EQ(outcome[0].held, outcome[1].held);
      EXPECT_TRUE(
          std::count(outcome[0].ok.begin(), outcome[0].ok.end(), false) > 0);
    }
  }
}

// Odd requests: size 0, more than the device (INVALID_ARGUMENT), exactly
// the device (RESOURCE_EXHAUSTED after creating what fits): the books hold,
// the memory made for the failed request is cached, not leaked, and serves
// the next request.
TEST_F(VmmChunksAttackTest, OddRequestsLoseNothing) {
  Init({}, 8 * kGiB, 500 * kMiB);
  DevicePtr zero = Alloc(0, s(0));
  EXPECT_FALSE(zero.is_null());
  absl::StatusOr<DevicePtr> too_big = alloc_->Allocate(8 * kGiB + 1, s(1));
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<DevicePtr> whole = alloc_->Allocate(8 * kGiB, s(1));
  EXPECT_EQ(whole.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Books().ok()) << Books();
  const std::uint64_t creates = Calls(SimCall::kMemCreate);
  DevicePtr most = Alloc(7 * kGiB, s(1));
  EXPECT_EQ(Calls(SimCall::kMemCreate), creates);  // all from the cache
  EXPECT_TRUE(Books().ok()) << Books();
  Free(most);
  Free(zero);
  ExpectAllReturned();
}

// vmm_unit_divisor 1 with chunks of 1, 16 and 65536 units, and 0 and 2^40
// (single granules, so single-granule chunks): a cold huge tensor and small
// ones, memory moving between streams, then all back.
TEST_F(VmmChunksAttackTest, ExtremeDivisorsAndChunkSizes) {
  struct Case {
    std::size_t divisor;
    std::size_t chunk_units;
  };
  for (const Case& c : {Case{1, 1}, Case{1, 16}, Case{1, 65536}, Case{0, 16},
                        Case{std::size_t{1} << 40, 65536}}) {
    SCOPED_TRACE(
        absl::StrFormat("divisor %d chunk %d", c.divisor, c.chunk_units));
    DeviceAllocatorOptions o;
    o.vmm_unit_divisor = c.divisor;
    o.vmm_chunk_units = c.chunk_units;
    Init(o, 6 * kGiB);
    DevicePtr a = Alloc(kGiB, s(0));
    const std::size_t unit =
        ModelUnit(6 * kGiB / kGranule, 512, c.divisor, kGranule);
    EXPECT_EQ(Calls(SimCall::kMemMap), (512 + unit - 1) / unit);
    if (unit == 1) {
      EXPECT_EQ(Calls(SimCall::kMemCreate), 512u);
    }
    DevicePtr b = Alloc(5000, s(1));
    DevicePtr d3 = Alloc(3 * kGiB, s(2));
    EXPECT_TRUE(Books().ok()) << Books();
    Free(a);
    DevicePtr d = Alloc(2 * kGiB + 512 * kMiB, s(3));  // needs a's memory
    EXPECT_TRUE(Books().ok()) << Books();
    Free(b);
    Free(d3);
    Free(d);
    ExpectAllReturned();
  }
}

// Pieces count granules in 32 bits; units and chunks are capped at 2^31
// granules. A 16 TiB device with 4 KiB granules (2^32 granules) and
// vmm_unit_divisor 1: a cold 15 TiB tensor is two chunks (2^31 granules,
// then the rest) mapped in 1 TiB units; all of it goes back.
TEST_F(VmmChunksAttackTest, ChunksAtTheTwoToTheThirtyOneCap) {
  DeviceAllocatorOptions o;
  o.vmm_unit_divisor = 1;
  o.vmm_chunk_units = 65536;
  Init(o, kSimMaxCapacityBytes, 0, 4 * kKiB);
  DevicePtr p = Alloc(15 * (std::size_t{1} << 40), s(0));
  EXPECT_EQ(Calls(SimCall::kMemCreate), 2u);
  EXPECT_EQ(Calls(SimCall::kMemMap), 15u);
  EXPECT_TRUE(Books().ok()) << Books();
  DevicePtr q = Alloc(512 * kGiB, s(1));
  EXPECT_EQ(Calls(SimCall::kMemCreate), 3u);
  EXPECT_TRUE(Books().ok()) << Books();
  Free(p);
  Free(q);
  ExpectAllReturned();
}

// "A cached piece is mapped again in the unit of the moment" — the unit for
// the headroom left after the run (ExpandableBacking::UnitGranules). A run
// served wholly from the cache takes no new memory, so its headroom is what
// is left beside the mapped and cached memory. On an 8 GiB device a cold
// 4 GiB tensor is 128 mappings of 32 MiB; the same 4 GiB moved through the
// cache to another stream (no cuMemCreate) should not need more mappings
// than that. (UnitGranules used to count the cached granules twice, as
// cache and as the run, so the unit was a single granule and the run 2048
// cuMemMap calls; on 80 GiB, 40 GiB took 20480 instead of 160.)
TEST_F(VmmChunksAttackTest, RunFromTheCacheMapsInTheUnitOfItsHeadroom) {
  Init({}, 8 * kGiB);
  Free(Alloc(4 * kGiB, s(0)));
  const std::uint64_t creates = Calls(SimCall::kMemCreate);
  const std::uint64_t cold_maps = Calls(SimCall::kMemMap);
  EXPECT_EQ(cold_maps, 128u);
  ASSERT_TRUE(alloc_->Trim(8 * kGiB).ok());  // unmap into the cache
  ASSERT_EQ(Cache(), 4 * kGiB);
  DevicePtr p = Alloc(4 * kGiB, s(1));
  EXPECT_EQ(Calls(SimCall::kMemCreate), creates);
  EXPECT_LE(Calls(SimCall::kMemMap) - cold_maps, cold_maps);
  EXPECT_TRUE(Books().ok()) << Books();
  Free(p);
  ExpectAllReturned();
}

// The MapAhead boundary: after a 4 MiB request mapped 16 MiB, a request
// rounded to exactly 10 MiB (10 MiB - 1 rounds to it) maps only the
// granules it lacks; one 512 B smaller shares a segment and maps ahead to
// the next 16 MiB.
TEST_F(VmmChunksAttackTest, TenMiBBoundaryOfMapAhead) {
  struct Case {
    std::size_t bytes;
    std::size_t reserved;
  };
  for (const Case& c :
       {Case{10 * kMiB, 20 * kMiB}, Case{10 * kMiB - 1, 20 * kMiB},
        Case{10 * kMiB - 512, 32 * kMiB}, Case{23 * kMiB, 34 * kMiB}}) {
    SCOPED_TRACE(c.bytes);
    Init({}, 80 * kGiB);
    DevicePtr a = Alloc(4 * kMiB, s(0));
    DevicePtr x = Alloc(6 * kMiB, s(0));  // 6 MiB of mapped rest remains
    ASSERT_EQ(Reserved(), 16 * kMiB);
    DevicePtr b = Alloc(c.bytes, s(0));
    EXPECT_EQ(b, x + 6 * kMiB);
    // 10 MiB: 6 free + 4 new; 23 MiB: 6 free + 18 new (9 granules).
    EXPECT_EQ(Reserved(), c.reserved);
    Free(a);
    Free(x);
    Free(b);
    ExpectAllReturned();
  }
}

// "Within 4 GiB of the limit units are single granules, so every free
// granule can move to where it is needed" (docs/architecture.md; the
// public vmm_unit_divisor comment: "single granules near the limit, where
// every free granule must be able to move"). On a 4 GiB device a tensor
// leaves 3 GiB of headroom; its memory is then reused by 2 MiB blocks every
// 16 MiB and the 14 MiB between them freed. Another stream then needs
// 512 MiB of those free granules. With a 1 GiB - 2 MiB tensor (single
// granules) it gets them; so it must with a 1 GiB tensor, a huge run (which
// once had units of 8 granules there, 8/1024 of the headroom, so that none
// of the 14 MiB holes held a whole unit and the request failed).
TEST_F(VmmChunksAttackTest, NearTheLimitFreeGranulesOfAHugeRunCanMove) {
  for (std::size_t tensor : {kGiB - 2 * kMiB, kGiB}) {
    SCOPED_TRACE(tensor);
    Init({}, 4 * kGiB);
    Free(Alloc(tensor, s(0)));
    const std::size_t pairs = tensor / (16 * kMiB);
    std::vector<DevicePtr> pins, holes;
    for (std::size_t i = 0; i < pairs; ++i) {
      pins.push_back(Alloc(2 * kMiB, s(0)));
      holes.push_back(Alloc(14 * kMiB, s(0)));
    }
    for (std::size_t i = 1; i < pairs; ++i) {
      ASSERT_EQ(pins[i], pins[0] + i * 16 * kMiB);
    }
    EXPECT_EQ(Reserved(), tensor);  // nothing new mapped
    for (DevicePtr h : holes) Free(h);
    // The device's free memory plus 512 MiB of s(0)'s free granules.
    const std::size_t want = 4 * kGiB - tensor + 512 * kMiB;
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(want, s(1));
    EXPECT_TRUE(p.ok()) << p.status();
    EXPECT_TRUE(Books().ok()) << Books();
    if (p.ok()) Free(*p);
    for (DevicePtr q : pins) Free(q);
    ExpectAllReturned();
  }
}

// The backing's rules on their own, over a sweep (2 MiB and 4 KiB granules,
// so that the 2^31 cap is reached): a unit is a power of two of at most 2^31
// granules; a run under 1 GiB gets at most 1/divisor of the headroom; a
// huge run at most 8 times that and, when it exceeds the base, at most 1/8
// of itself; a chunk is a whole number of units, at most 2^31 granules, and
// a single granule when the unit is.
TEST(ExpandableRulesAttackTest, UnitAndChunkBounds) {
  auto sim = SimDriver::Create({});
  constexpr std::size_t kCap31 = std::size_t{1} << 31;
  for (std::size_t granule : {2 * kMiB, 4 * kKiB}) {
    for (std::size_t capacity :
         {std::size_t{4} * kGiB, 80 * kGiB, kSimMaxCapacityBytes}) {
      for (std::size_t divisor :
           {std::size_t{1}, std::size_t{7}, std::size_t{1024}}) {
        for (std::size_t chunk_units :
             {std::size_t{1}, std::size_t{3}, std::size_t{65536}}) {
          alloc_internal::ExpandableBacking vmm(
              *sim, 0, granule,
              alloc_internal::ExpandableOptions{divisor, chunk_units, 0,
                                                capacity},
              [] { return absl::UnixEpoch(); });
          const std::size_t cap = capacity / granule;
          bool saw_cap = false;
          for (std::size_t n = 1; n <= cap; n = n * 3 / 2 + 1) {
            const std::size_t u = vmm.UnitGranules(n);
            SCOPED_TRACE(absl::StrFormat("granule %d cap %d div %d n %d u %d",
                                         granule, cap, divisor, n, u));
            ASSERT_TRUE(absl::has_single_bit(u));
            ASSERT_LE(u, kCap31);
            saw_cap |= u == kCap31;
            const std::size_t base = n >= cap ? 0 : (cap - n) / divisor;
            if (n * granule < kGiB) {
              ASSERT_LE(u, std::max<std::size_t>(base, 1));
            } else {
              ASSERT_LE(u, std::max<std::size_t>(8 * base, 1));
              if (u > std::max<std::size_t>(base, 1)) {
                ASSERT_LE(u, n / 8);
              }
            }
            const std::size_t chunk = vmm.ChunkGranules(u);
            ASSERT_EQ(chunk % u, 0u);
            ASSERT_LE(chunk, kCap31);
            if (u == 1) {
              ASSERT_EQ(chunk, 1u);
            } else {
              ASSERT_EQ(chunk, std::min(u * chunk_units, kCap31));
            }
          }
          if (granule == 4 * kKiB && capacity == kSimMaxCapacityBytes &&
              divisor == 1) {
            EXPECT_TRUE(saw_cap);
          }
        }
      }
    }
  }
}

// `--config vmm_chunk_units=N`: 1 to 65536, a whole number; what it accepts
// Create accepts.
TEST(ReplayConfigAttackTest, ChunkUnitsRange) {
  auto sim = SimDriver::Create({});
  for (const char* ok : {"vmm_chunk_units=1", "vmm_chunk_units=65536",
                         "vmm_chunk_units=7,vmm_unit_divisor=3"}) {
    DeviceAllocatorOptions o;
    ASSERT_TRUE(ParseAllocatorConfig(ok, &o).ok()) << ok;
    o.backing = BackingMode::kExpandable;
    EXPECT_TRUE(CachingDeviceAllocator::Create(*sim, 0, o).ok()) << ok;
  }
  for (const char* bad :
       {"vmm_chunk_units=0", "vmm_chunk_units=65537", "vmm_chunk_units=-1",
        "vmm_chunk_units=", "vmm_chunk_units=16x", "vmm_chunk_units=1e3",
        "vmm_chunk_units=18446744073709551617"}) {
    DeviceAllocatorOptions o;
    const std::size_t before = o.vmm_chunk_units;
    absl::Status st = ParseAllocatorConfig(bad, &o);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(o.vmm_chunk_units, before) << bad;
  }
}

}  // namespace
}  // namespace ctxpool
