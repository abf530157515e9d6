#include "ctxpool/alloc/host_allocator.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "alloc_test_support.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

class HostAllocatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_ = SimDriver::Create();
    absl::StatusOr<ContextHandle> ctx = sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *ctx;
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    s1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    s2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    // Stands for a copy engine's target: work that keeps a stream busy.
    dev_ = *sim_->MemAlloc(4096);
  }

  void TearDown() override {
    if (sim_ == nullptr) return;
    sim_->Release(s1_);
    sim_->Release(s2_);
    alloc_.reset();
    EXPECT_TRUE(sim_->MemFree(dev_).ok());
    EXPECT_EQ(sim_->misuse_count(), 0u);
    for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
    EXPECT_EQ(sim_->race_count(), 0u);
  }

  void Make(HostAllocatorOptions options = {}) {
    options.context = ctx_;
    auto a = CachingHostAllocator::Create(*sim_, options);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(*a);
  }

  // Simulates an async copy that uses the pinned buffer on `stream`.
  void Copy(StreamHandle stream) {
    ASSERT_TRUE(sim_->Touch(stream, dev_, 256).ok());
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle s1_, s2_;
  DevicePtr dev_;
  std::unique_ptr<CachingHostAllocator> alloc_;
};

TEST_F(HostAllocatorTest, CachedBufferIsReused) {
  Make();
  void* p = *alloc_->Allocate(1000, s1_);
  std::memset(p, 0xab, 1000);  // real memory
  EXPECT_TRUE(alloc_->Deallocate(p).ok());
  HostAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.cached_count, 1u);
  EXPECT_EQ(st.cached_bytes, 1024u);
  EXPECT_EQ(st.events_recorded, 0);  // the stream was idle
  void* q = *alloc_->Allocate(1000, s1_);
  EXPECT_EQ(q, p);
  st = alloc_->Stats();
  EXPECT_EQ(st.cache_hits, 1);
  EXPECT_EQ(st.upstream_allocs, 1);
  EXPECT_EQ(st.live_bytes, 1024u);
  EXPECT_EQ(st.requested_bytes, 1000u);
  EXPECT_EQ(sim_->call_count(SimCall::kMemHostAlloc), 1u);
  // Another class does not take the cached buffer.
  void* r = *alloc_->Allocate(5000, s1_);
  EXPECT_NE(r, p);
  EXPECT_TRUE(alloc_->Deallocate(q).ok());
  EXPECT_TRUE(alloc_->Deallocate(r).ok());
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

TEST_F(HostAllocatorTest, SizeZeroGivesUniqueBuffers) {
  Make();
  void* a = *alloc_->Allocate(0, s1_);
  void* b = *alloc_->Allocate(0, s1_);
  ASSERT_NE(a, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(alloc_->Stats().live_bytes, 2 * HostSizeClasses::kGranuleBytes);
  EXPECT_TRUE(alloc_->Deallocate(a).ok());
  EXPECT_TRUE(alloc_->Deallocate(b).ok());
}

TEST_F(HostAllocatorTest, HugeSizesAreInvalidArgument) {
  Make();
  for (std::size_t bytes : {std::numeric_limits<std::size_t>::max(),
                            std::size_t{1} << 60, std::size_t{1} << 49}) {
    absl::StatusOr<void*> p = alloc_->Allocate(bytes, s1_);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bytes;
  }
  EXPECT_EQ(alloc_->Stats().invalid_requests, 3);
  EXPECT_EQ(sim_->call_count(SimCall::kMemHostAlloc), 0u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

TEST_F(HostAllocatorTest, RoundingWasteIsAtMostOneEighth) {
  Make();
  EXPECT_EQ(alloc_->RoundedSize(4 * kGiB + 1), 4 * kGiB + kGiB / 2);
  void* p = *alloc_->Allocate(9 * kKiB + 1, s1_);
  EXPECT_EQ(alloc_->Stats().live_bytes, 10 * kKiB);
  FragmentationStats f = alloc_->Fragmentation();
  EXPECT_EQ(f.rounding_waste_bytes, kKiB - 1);
  EXPECT_LE(f.rounding_waste, 0.125);
  EXPECT_TRUE(alloc_->Deallocate(p).ok());
}

TEST_F(HostAllocatorTest, ReuseOnlyAfterCopyStreamEvent) {
  Make();
  sim_->Hold(s1_);
  void* p = *alloc_->Allocate(64 * kKiB, s1_);
  Copy(s1_);  // cuMemcpyAsync(dev, p) is pending on s1
  ASSERT_TRUE(alloc_->Deallocate(p).ok());
  HostAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.pending_count, 1u);
  EXPECT_EQ(st.events_recorded, 1);
  // Not reused while the copy may still read it.
  void* q = *alloc_->Allocate(64 * kKiB, s1_);
  EXPECT_NE(q, p);
  void* r = *alloc_->Allocate(64 * kKiB, s1_);
  EXPECT_NE(r, p);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  sim_->Release(s1_);
  ASSERT_TRUE(alloc_->Deallocate(q).ok());  // s1 idle now: cached at once
  std::set<void*> got = {*alloc_->Allocate(64 * kKiB, s1_),
                         *alloc_->Allocate(64 * kKiB, s1_)};
  EXPECT_EQ(got, (std::set<void*>{p, q}));
  EXPECT_EQ(alloc_->Stats().upstream_allocs, 3);
  EXPECT_EQ(alloc_->Stats().pending_count, 0u);
  for (void* x : got) EXPECT_TRUE(alloc_->Deallocate(x).ok());
  EXPECT_TRUE(alloc_->Deallocate(r).ok());
}

TEST_F(HostAllocatorTest, RecordStreamDelaysReuseUntilThatStream) {
  Make();
  void* p = *alloc_->Allocate(4096, s1_);
  sim_->Hold(s2_);
  ASSERT_TRUE(alloc_->RecordStream(p, s2_).ok());
  Copy(s2_);
  ASSERT_TRUE(alloc_->Deallocate(p).ok());
  EXPECT_EQ(alloc_->Stats().pending_count, 1u);
  void* q = *alloc_->Allocate(4096, s1_);
  EXPECT_NE(q, p);
  sim_->Release(s2_);
  void* r = *alloc_->Allocate(4096, s1_);
  EXPECT_EQ(r, p);
  EXPECT_TRUE(alloc_->Deallocate(q).ok());
  EXPECT_TRUE(alloc_->Deallocate(r).ok());
  EXPECT_EQ(alloc_->RecordStream(r, s2_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

TEST_F(HostAllocatorTest, BadFreesAreInvalidArgumentAndHarmless) {
  Make();
  void* p = *alloc_->Allocate(1000, s1_);
  int on_stack = 0;
  EXPECT_EQ(alloc_->Deallocate(nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Deallocate(&on_stack).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(alloc_->Deallocate(static_cast<char*>(p) + 8).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Deallocate(p).ok());
  absl::Status twice = alloc_->Deallocate(p);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.message(), "double free")) << twice;
  EXPECT_EQ(alloc_->Stats().invalid_frees, 4);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_EQ(*alloc_->Allocate(1000, s1_), p);
  EXPECT_TRUE(alloc_->Deallocate(p).ok());
}

TEST_F(HostAllocatorTest, RegistrationErrors) {
  Make();
  constexpr std::size_t kBytes = 256 * kKiB;
  char* mem = static_cast<char*>(std::aligned_alloc(4096, kBytes));
  ASSERT_NE(mem, nullptr);
  char* weights = mem + 64 * kKiB;  // [64 KiB, 128 KiB) of mem
  ASSERT_TRUE(alloc_->Register(weights, 64 * kKiB).ok());
  EXPECT_TRUE(alloc_->IsRegistered(weights + 100, 100));
  EXPECT_FALSE(alloc_->IsRegistered(weights + 64 * kKiB - 8, 16));
  HostAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.registered_bytes, 64 * kKiB);
  EXPECT_EQ(st.registered_count, 1u);
  EXPECT_EQ(st.pinned_bytes, 0u);  // accounted apart from the cache

  auto invalid = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(invalid(alloc_->Register(weights, 64 * kKiB)));    // duplicate
  EXPECT_TRUE(invalid(alloc_->Register(weights + 4096, 4096)));  // inside
  EXPECT_TRUE(invalid(alloc_->Register(mem, 64 * kKiB + 1)));    // tail overlap
  EXPECT_TRUE(invalid(alloc_->Register(weights + 60 * kKiB, 64 * kKiB)));
  EXPECT_TRUE(invalid(alloc_->Register(mem, kBytes)));  // covers it
  EXPECT_TRUE(invalid(alloc_->Register(nullptr, 4096)));
  EXPECT_TRUE(invalid(alloc_->Register(mem, 0)));
  // Overlapping one of the allocator's own pinned buffers.
  void* p = *alloc_->Allocate(8192, s1_);
  EXPECT_TRUE(invalid(alloc_->Register(static_cast<char*>(p) + 4096, 4096)));
  // Adjacent ranges are fine.
  ASSERT_TRUE(alloc_->Register(mem, 64 * kKiB).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemHostRegister), 2u);

  EXPECT_TRUE(invalid(alloc_->Unregister(weights + 4096)));    // not a start
  EXPECT_TRUE(invalid(alloc_->Unregister(mem + 200 * kKiB)));  // unknown
  EXPECT_TRUE(alloc_->Unregister(weights).ok());
  EXPECT_TRUE(invalid(alloc_->Unregister(weights)));  // twice
  EXPECT_EQ(alloc_->Stats().registered_bytes, 64 * kKiB);
  EXPECT_EQ(alloc_->Stats().invalid_requests, 11);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Unregister(mem).ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemHostUnregister), 2u);
  EXPECT_TRUE(alloc_->Deallocate(p).ok());
  std::free(mem);
}

TEST_F(HostAllocatorTest, DriverRegisterErrorIsReturnedAndNothingRecorded) {
  Make();
  char* mem = static_cast<char*>(std::aligned_alloc(4096, 8192));
  sim_->InjectFault(SimCall::kMemHostRegister, 1, cu::kErrorOutOfMemory);
  absl::Status s = alloc_->Register(mem, 8192);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory);
  EXPECT_EQ(alloc_->Stats().registered_bytes, 0u);
  EXPECT_TRUE(alloc_->Register(mem, 8192).ok());
  alloc_.reset();  // the destructor unregisters
  EXPECT_EQ(sim_->call_count(SimCall::kMemHostUnregister), 1u);
  std::free(mem);
}

TEST_F(HostAllocatorTest, HostBudgetExhaustion) {
  Make({.host_budget_bytes = 1 * kMiB});
  void* a = *alloc_->Allocate(512 * kKiB, s1_);
  void* b = *alloc_->Allocate(512 * kKiB, s1_);
  absl::StatusOr<void*> c = alloc_->Allocate(1, s1_);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(c.status().message(), "host budget of 1048576"))
      << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "1048576 in use"))
      << c.status();
  EXPECT_EQ(alloc_->Stats().num_budget_failures, 1);
  // A cached buffer of another class is freed to make room.
  ASSERT_TRUE(alloc_->Deallocate(b).ok());
  void* d = *alloc_->Allocate(96 * kKiB, s1_);
  HostAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.cached_bytes, 0u);
  EXPECT_EQ(st.upstream_frees, 1);
  EXPECT_EQ(st.pinned_bytes, 608 * kKiB);
  // Registered memory counts against the budget too.
  char* mem = static_cast<char*>(std::aligned_alloc(4096, 512 * kKiB));
  absl::Status r = alloc_->Register(mem, 512 * kKiB);
  EXPECT_EQ(r.code(), absl::StatusCode::kResourceExhausted) << r;
  ASSERT_TRUE(alloc_->Register(mem, 256 * kKiB).ok());
  EXPECT_EQ(alloc_->Allocate(200 * kKiB, s1_).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Deallocate(a).ok());
  EXPECT_TRUE(alloc_->Deallocate(d).ok());
  EXPECT_TRUE(alloc_->Unregister(mem).ok());
  std::free(mem);
}

TEST_F(HostAllocatorTest, DriverOutOfMemoryTrimsCacheAndRetries) {
  Make();
  void* a = *alloc_->Allocate(kMiB, s1_);
  ASSERT_TRUE(alloc_->Deallocate(a).ok());
  sim_->InjectFault(SimCall::kMemHostAlloc, 1, cu::kErrorOutOfMemory);
  absl::StatusOr<void*> b = alloc_->Allocate(2 * kMiB, s1_);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(alloc_->Stats().cached_bytes, 0u);
  sim_->InjectFault(SimCall::kMemHostAlloc, 2, cu::kErrorOutOfMemory);
  absl::StatusOr<void*> c = alloc_->Allocate(2 * kMiB, s1_);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(DriverErrorCode(c.status()), cu::kErrorOutOfMemory);
  EXPECT_EQ(alloc_->Stats().num_ooms, 1);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Deallocate(*b).ok());
}

TEST_F(HostAllocatorTest, TrimFreesCachedAndKeepsPending) {
  Make();
  std::vector<void*> ps;
  for (int i = 0; i < 4; ++i) ps.push_back(*alloc_->Allocate(kMiB, s1_));
  sim_->Hold(s2_);
  ASSERT_TRUE(alloc_->RecordStream(ps[0], s2_).ok());
  Copy(s2_);
  for (void* p : ps) ASSERT_TRUE(alloc_->Deallocate(p).ok());
  absl::StatusOr<TrimResult> t = alloc_->Trim(kMiB);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->freed_bytes, 2 * kMiB);
  EXPECT_EQ(t->busy_bytes, kMiB);
  EXPECT_EQ(t->remaining_bytes, 2 * kMiB);
  t = alloc_->Trim(0);
  EXPECT_EQ(t->freed_bytes, kMiB);
  EXPECT_EQ(alloc_->Stats().pending_bytes, kMiB);
  sim_->Release(s2_);
  t = alloc_->Trim(0);
  EXPECT_EQ(t->freed_bytes, kMiB);
  HostAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.pinned_bytes, 0u);
  EXPECT_EQ(st.upstream_frees, 4);
  EXPECT_EQ(st.num_trims, 3);
  EXPECT_EQ(st.peak_pinned_bytes, 4 * kMiB);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

TEST_F(HostAllocatorTest, ResetRefusesLiveBuffersUnlessForced) {
  Make();
  void* p = *alloc_->Allocate(4096, s1_);
  void* q = *alloc_->Allocate(8192, s1_);
  ASSERT_TRUE(alloc_->Deallocate(q).ok());
  absl::Status s = alloc_->Reset();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "1 live buffers")) << s;
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_TRUE(alloc_->Reset(/*force=*/true).ok());
  EXPECT_EQ(alloc_->Stats().pinned_bytes, 0u);
  EXPECT_EQ(alloc_->Deallocate(p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim_->call_count(SimCall::kMemFreeHost), 2u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
}

TEST_F(HostAllocatorTest, FragmentationDescribesTheCache) {
  Make();
  void* a = *alloc_->Allocate(kMiB, s1_);
  void* b = *alloc_->Allocate(3 * kMiB, s1_);
  ASSERT_TRUE(alloc_->Deallocate(a).ok());
  ASSERT_TRUE(alloc_->Deallocate(b).ok());
  FragmentationStats f = alloc_->Fragmentation();
  EXPECT_EQ(f.free_bytes, 4 * kMiB);
  EXPECT_EQ(f.largest_free_bytes, 3 * kMiB);
  EXPECT_EQ(f.free_blocks, 2u);
  EXPECT_DOUBLE_EQ(f.external, 0.25);
}

TEST_F(HostAllocatorTest, RejectsBadOptions) {
  EXPECT_EQ(CachingHostAllocator::Create(*sim_, {.classes_per_doubling = 3})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(HostAllocatorTest, RetainsAndReleasesThePrimaryContext) {
  const int before = sim_->primary_ctx_refcount(0);
  {
    auto a = CachingHostAllocator::Create(*sim_);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(sim_->primary_ctx_refcount(0), before + 1);
    void* p = *(*a)->Allocate(100, s1_);
    EXPECT_TRUE((*a)->Deallocate(p).ok());
  }
  EXPECT_EQ(sim_->primary_ctx_refcount(0), before);
}

TEST_F(HostAllocatorTest, MultithreadedSmoke) {
  Make();
  std::vector<StreamHandle> streams = testing_internal::RunOnThreads(
      *sim_, ctx_, /*num_threads=*/4, [&](int t, StreamHandle stream) {
        std::vector<void*> mine;
        std::uint64_t x = 12345 + t;
        for (int i = 0; i < 2000; ++i) {
          x = testing_internal::NextLcg(x);
          if (mine.size() < 8 && (x >> 60) < 10) {
            const std::size_t bytes = 64 << ((x >> 40) % 10);
            absl::StatusOr<void*> p = alloc_->Allocate(bytes, stream);
            ASSERT_TRUE(p.ok()) << p.status();
            std::memset(*p, t, bytes);
            mine.push_back(*p);
          } else if (!mine.empty()) {
            void* p = mine.back();
            mine.pop_back();
            ASSERT_EQ(*static_cast<unsigned char*>(p), t);
            ASSERT_TRUE(alloc_->Deallocate(p).ok());
          }
        }
        for (void* p : mine) ASSERT_TRUE(alloc_->Deallocate(p).ok());
      });
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_EQ(alloc_->Stats().live_count, 0u);
  EXPECT_TRUE(alloc_->Trim(0).ok());
  EXPECT_EQ(alloc_->Stats().pinned_bytes, 0u);
  for (StreamHandle s : streams) EXPECT_TRUE(sim_->StreamDestroy(s).ok());
}

// Runs in the forked child: every call fails with the fork error and makes
// no driver call; destruction leaks the parent's pinned buffers, events and
// context reference. Returns 0 or the number of the first failed check.
int HostChildChecks(SimDriver& sim, ContextHandle ctx,
                    std::unique_ptr<CachingHostAllocator> alloc, void* live,
                    void* registered, StreamHandle stream) {
  const std::uint64_t calls = testing_internal::TotalDriverCalls(sim);
  const int refs = sim.primary_ctx_refcount(0);
  const HostAllocatorStats before = alloc->Stats();
  static char other[4096];
  if (int bad = testing_internal::FirstNonForkError({
          {alloc->Allocate(64, stream).status(),
           "CachingHostAllocator::Allocate"},
          {alloc->Deallocate(live), "CachingHostAllocator::Deallocate"},
          {alloc->RecordStream(live, stream),
           "CachingHostAllocator::RecordStream"},
          {alloc->Trim(0).status(), "CachingHostAllocator::Trim"},
          {alloc->Reset(/*force=*/true), "CachingHostAllocator::Reset"},
          {alloc->Register(other, sizeof(other)),
           "CachingHostAllocator::Register"},
          {alloc->Unregister(registered), "CachingHostAllocator::Unregister"},
          {alloc->CheckInvariants(), "CachingHostAllocator::CheckInvariants"},
      });
      bad != 0) {
    return bad;  // 1..8
  }
  if (alloc->IsRegistered(registered)) return 9;
  const HostAllocatorStats after = alloc->Stats();
  if (after.live_count != before.live_count ||
      after.pending_count != before.pending_count ||
      after.cached_count != before.cached_count ||
      after.num_allocs != before.num_allocs) {
    return 10;  // a refused call changed the bookkeeping
  }
  // Leaks: no cuMemFreeHost, cuEventDestroy or context release.
  if (int bad = testing_internal::NoDriverCallThroughDestruction(
          sim, calls, refs, [&] { alloc.reset(); });
      bad != 0) {
    return 10 + bad;  // 11..13
  }
  // An allocator created in the child (after the fork) works.
  auto fresh = CachingHostAllocator::Create(sim, {.context = ctx});
  if (!fresh.ok()) return 14;
  absl::StatusOr<void*> p = (*fresh)->Allocate(64, stream);
  if (!p.ok() || !(*fresh)->Deallocate(*p).ok()) return 15;
  return 0;
}

TEST_F(HostAllocatorTest, ForkedChildGetsFailedPreconditionAndLeaks) {
  // Retains device 0's primary context, so a release would show.
  alloc_ = *CachingHostAllocator::Create(*sim_);
  // A pooled event, so a cuEventDestroy at destruction would show.
  sim_->Hold(s2_);
  void* first = *alloc_->Allocate(4096, s2_);
  Copy(s2_);
  ASSERT_TRUE(alloc_->Deallocate(first).ok());
  sim_->Release(s2_);
  ASSERT_TRUE(alloc_->Trim(0).ok());  // polls: the event goes to the pool
  ASSERT_EQ(alloc_->Stats().events_recorded, 1);
  void* live = *alloc_->Allocate(1000, s1_);
  // A pending buffer (its event stays with the parent) and a cached one.
  sim_->Hold(s2_);
  void* pending = *alloc_->Allocate(4096, s2_);
  Copy(s2_);
  ASSERT_TRUE(alloc_->Deallocate(pending).ok());
  ASSERT_TRUE(alloc_->Deallocate(*alloc_->Allocate(64, s1_)).ok());
  static char weights[8192];
  ASSERT_TRUE(alloc_->Register(weights, sizeof(weights)).ok());
  ASSERT_EQ(alloc_->Stats().pending_count, 1u);
  const std::uint64_t parent_calls = testing_internal::TotalDriverCalls(*sim_);

  const int code = testing_internal::RunInForkedChild([&] {
    return HostChildChecks(*sim_, ctx_, std::move(alloc_), live, weights, s1_);
  });
  EXPECT_EQ(code, 0) << "check " << code << " failed in the child";

  // The parent's allocator is untouched and keeps working.
  ASSERT_NE(alloc_, nullptr);
  EXPECT_EQ(testing_internal::TotalDriverCalls(*sim_), parent_calls);
  EXPECT_TRUE(alloc_->IsRegistered(weights));
  EXPECT_TRUE(alloc_->Deallocate(live).ok());
  sim_->Release(s2_);
  EXPECT_TRUE(alloc_->Unregister(weights).ok());
  EXPECT_TRUE(alloc_->Reset().ok());
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  EXPECT_EQ(alloc_->Stats().pinned_bytes, 0u);
}

}  // namespace
}  // namespace ctxpool
