// Host memory running out (std::bad_alloc) in the middle of an allocator
// call: a sweep fails each host allocation of a call in turn (SimDriver's own
// are left alone), and after every one of them the books still match the
// driver, no device memory is lost (freeing what the test holds and Trim(0)
// give every byte back), and the same call then succeeds. The call may throw
// std::bad_alloc or return an error; either is fine, as long as it loses
// nothing. Both backings: first requests of a stream, cached requests, the
// slow paths, Trim; tenants, a memory limit, RecordStream and pending frees,
// decay, Reset, RetireStream, many streams, owners, and invalid frees.
//
//
// Error messages on these paths are built with core_internal::Format, not
// absl::StrFormat: StrFormat flushes its buffer in a destructor, where a
// std::bad_alloc terminates the process (the sweeps of a memory limit, an
// OOM report and Reset(false) with live blocks ended in std::terminate).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;

class HostOomTest : public test::DeviceAllocatorFixture,
                    public ::testing::WithParamInterface<BackingMode> {
 protected:
  void SetUp() override {
#ifdef CTXPOOL_TEST_TSAN
    GTEST_SKIP() << "TSan replaces operator new, so no allocation can fail";
#endif
  }
  void TearDown() override {
    if (sim_ != nullptr) DeviceAllocatorFixture::TearDown();
  }

  void Init(std::size_t capacity) {
    DeviceAllocatorOptions o = opts_;
    o.backing = GetParam();
    InitAllocator(capacity, std::move(o));
    held_.clear();
    held_.reserve(4096);
    extra_streams_.clear();
    extra_streams_.reserve(1024);
    now_ = absl::FromUnixSeconds(1000);
  }
  void Hold(std::size_t bytes, StreamHandle s) {
    if (g_fail_after >= 0 || in_op_) {
      // Under the countdown an error return is allowed (the claim: throw
      // or return an error); the rerun without it must succeed.
      absl::StatusOr<DevicePtr> r = alloc_->Allocate(bytes, s);
      if (r.ok()) held_.push_back(*r);
      return;
    }
    const DevicePtr p = Alloc(bytes, s);
    if (!p.is_null()) held_.push_back(p);
  }
  void HoldThenFree(std::size_t keep, std::size_t bytes, StreamHandle s) {
    Hold(keep, s);
    Free(Alloc(bytes, s));
  }
  void FreeHeld() {
    for (DevicePtr p : held_) Free(p);
    held_.clear();
  }
  StreamHandle NewStream() {
    absl::StatusOr<StreamHandle> s = sim_->StreamCreate(kStreamNonBlocking, 0);
    EXPECT_TRUE(s.ok());
    extra_streams_.push_back(*s);
    return *s;
  }

  // Returns the number of k's swept (k at which the countdown did not fire,
  // or the failing k). `fired_any` says whether the countdown fired at all.
  int Sweep(std::size_t capacity, const std::function<void()>& setup,
            const std::function<void()>& op,
            const std::function<void()>& cleanup = nullptr) {
    fired_any_ = false;
    for (int k = 0; k < 4000; ++k) {
      SCOPED_TRACE(testing::Message() << "host allocation " << k << " fails");
      last_k_ = k;
      Init(capacity);
      setup();
      if (HasFatalFailure() || HasFailure()) {
        ADD_FAILURE() << "setup failed";
        return k;
      }
      if (std::getenv("ATTACK_VERBOSE") != nullptr) {
        std::fprintf(stderr, "k=%d\n", k);
      }
      g_fail_after = k;
      bool threw = false;
      in_op_ = true;
      try {
        op();
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      in_op_ = false;
      const bool fired = g_fail_after == -1;
      g_fail_after = -1;
      (void)threw;
      if (fired) fired_any_ = true;
      absl::Status books = CheckBooks();
      EXPECT_TRUE(books.ok()) << "after op: " << books;
      EXPECT_EQ(alloc_->Stats().leaked_bytes, 0u);
      if (cleanup) cleanup();
      FreeHeld();
      absl::StatusOr<TrimResult> t = alloc_->Trim(0);
      EXPECT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(Physical(), 0u) << "device bytes lost";
      books = CheckBooks();
      EXPECT_TRUE(books.ok()) << "after trim: " << books;
      alloc_.reset();  // destroys the pooled events
      EXPECT_EQ(sim_->call_count(SimCall::kEventCreate),
                sim_->call_count(SimCall::kEventDestroy))
          << "events lost";
      // Same op again, now with host memory.
      Init(capacity);
      setup();
      op();
      if (cleanup) cleanup();
      FreeHeld();
      books = CheckBooks();
      EXPECT_TRUE(books.ok()) << "rerun: " << books;
      if (HasFailure() || !fired) return k;
    }
    ADD_FAILURE() << "op made over 4000 host allocations";
    return 4000;
  }

  DeviceAllocatorOptions opts_;
  std::vector<DevicePtr> held_;
  std::vector<StreamHandle> extra_streams_;
  bool fired_any_ = false;
  bool in_op_ = false;
  int last_k_ = 0;
};

// --- Allocate, Trim ---------------------------------------------------------

// A stream's first requests: the shard made (its live map sized, the stream
// tables grown), a segment or a range and its blocks. This is where an
// Abseil table that grew during a std::bad_alloc corrupted the heap.
TEST_P(HostOomTest, FirstRequestOfANewStream) {
  const int n = Sweep(
      8 * kGiB, [] {},
      [&] {
        Hold(4096, b1_);
        Hold(64 * kMiB, a1_);
      });
  EXPECT_GT(n, 0);
}

// Cached requests on a warm stream (one small granule or segment and a
// large one, free) that take and split free blocks, refill the block arena
// and grow the live map past its first size.
TEST_P(HostOomTest, ManyCachedRequests) {
  const int n = Sweep(
      8 * kGiB,
      [&] {
        Hold(4096, a1_);
        Hold(64 * kMiB, a1_);
        FreeHeld();
      },
      [&] {
        for (int i = 0; i < 400; ++i) Hold(4096, a1_);
        Hold(40 * kMiB, a1_);
      });
  EXPECT_GT(n, 0);  // the arena's refill, the live map's growth
}

// Slow paths: a cold large request (expandable: a range reserved, chunks
// created, mapped, set accessible, the block carved), one mapped from
// cached pieces (one split, the rest cached again), one that extends a
// mapped free block over the hole after it, and one the device holds only
// once another stream's free granules are unmapped and mapped again here.
TEST_P(HostOomTest, ColdLargeRequest) {
  EXPECT_GT(Sweep(
                8 * kGiB, [] {}, [&] { Hold(64 * kMiB + 3 * 1024, a1_); }),
            0);
}

TEST_P(HostOomTest, RequestFromCachedPieces) {
  const auto setup = [&] {
    HoldThenFree(10 * kMiB, 96 * kMiB, a1_);
    ASSERT_TRUE(alloc_->Trim(kGiB).ok());
  };
  EXPECT_GT(Sweep(8 * kGiB, setup, [&] { Hold(40 * kMiB + 4096, b1_); }), 0);
}

TEST_P(HostOomTest, RequestThatExtendsAFreeBlock) {
  const auto setup = [&] { HoldThenFree(6 * kMiB, 30 * kMiB, a1_); };
  EXPECT_GT(Sweep(8 * kGiB, setup, [&] { Hold(200 * kMiB, a1_); }), 0);
}

TEST_P(HostOomTest, RequestThatReclaimsAnotherStream) {
  const auto setup = [&] { HoldThenFree(8 * kMiB, 150 * kMiB, b1_); };
  EXPECT_GT(Sweep(256 * kMiB, setup, [&] { Hold(150 * kMiB, a1_); }), 0);
}

// Trim: granules unmapped into the cache (expandable), segments and chunks
// released.
TEST_P(HostOomTest, WholeFreeSegmentMovesToAnotherStream) {
  // Classic mode moves a wholly free cached segment to a new stream (an
  // event orders it after the old one's work; it goes back to the pool).
  Sweep(
      64 * kGiB,
      [&] {
        sim_->Hold(a1_);
        Free(Alloc(4096, a1_));
      },
      [&] { Hold(4096, b1_); }, [&] { sim_->Release(a1_); });
}

TEST_P(HostOomTest, Trim) {
  const int n = Sweep(
      8 * kGiB,
      [&] {
        HoldThenFree(6 * kMiB, 100 * kMiB, a1_);
        Hold(2 * kMiB, b1_);
      },
      [&] { (void)alloc_->Trim(0); });
  EXPECT_GT(n, 0);
}

// --- Tenants ---------------------------------------------------------------

// A request over the tenant's max: the tenant's own free granules/segments
// must be unmapped/released first, then the request served.
TEST_P(HostOomTest, TenantMaxReclaimsOwnFree) {
  const auto setup = [&] {
    TenantId t = Register("t", Budget{.max = 64 * kMiB});
    ASSERT_TRUE(alloc_->BindStream(a1_, t).ok());
    Hold(2 * kMiB, a1_);
    Free(Alloc(40 * kMiB, a1_));
  };
  const int n = Sweep(8 * kGiB, setup, [&] { Hold(42 * kMiB, a1_); });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// RegisterTenant / BindStream themselves under the countdown.
TEST_P(HostOomTest, RegisterAndBindTenant) {
  const auto setup = [&] { HoldThenFree(2 * kMiB, 30 * kMiB, a1_); };
  const int n = Sweep(8 * kGiB, setup, [&] {
    absl::StatusOr<TenantId> t =
        alloc_->RegisterTenant("tenant-with-a-long-name-xxxxxxxxxxxxxx",
                               Budget{.high = 8 * kMiB, .max = 512 * kMiB});
    if (!t.ok()) return;
    (void)alloc_->BindStream(a1_, *t);
    (void)alloc_->BindStream(b1_, *t);
    Hold(12 * kMiB, b1_);
  });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// A tenant above its high sheds at TrimIdle.
TEST_P(HostOomTest, TenantAboveHighTrimIdle) {
  const auto setup = [&] {
    TenantId t = Register("t", Budget{.high = 4 * kMiB});
    ASSERT_TRUE(alloc_->BindStream(a1_, t).ok());
    Hold(2 * kMiB, a1_);
    Free(Alloc(60 * kMiB, a1_));
    Free(Alloc(4096, a1_));
  };
  const int n = Sweep(8 * kGiB, setup, [&] { (void)alloc_->TrimIdle(); });
  // Expandable sheds to the cache without allocating: nothing to fail.
  if (!fired_any_)
    std::fprintf(stderr, "note: TrimIdle made no host allocation\n");
  (void)n;
}

// SetBudget lowering max below what the tenant holds.
TEST_P(HostOomTest, SetBudgetShrinks) {
  TenantId t = 0;
  const auto setup = [&] {
    t = Register("t", Budget{});
    ASSERT_TRUE(alloc_->BindStream(a1_, t).ok());
    Hold(2 * kMiB, a1_);
    Free(Alloc(60 * kMiB, a1_));
    Hold(4096, a1_);
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    (void)alloc_->SetBudget(t, Budget{.max = 8 * kMiB});
  });
  EXPECT_TRUE(fired_any_) << "SetBudget made no host allocation";
  (void)n;
}

// --- memory_limit_bytes -----------------------------------------------------

TEST_P(HostOomTest, MemoryLimitForcesReclaim) {
  opts_.memory_limit_bytes = 256 * kMiB;
  const auto setup = [&] {
    Hold(4 * kMiB, b1_);
    Free(Alloc(100 * kMiB, b1_));
    Hold(4 * kMiB, a2_);
    Free(Alloc(100 * kMiB, a2_));
  };
  const int n = Sweep(8 * kGiB, setup, [&] { Hold(180 * kMiB, a1_); });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// Memory limit with many small free pieces across streams: a large request.
TEST_P(HostOomTest, MemoryLimitFragmented) {
  if (GetParam() == BackingMode::kClassic) {
    // Classic's 2 MiB blocks hold the shared 20 MiB segments they sit in
    // (requests under 10 MiB share them), so the large request does not fit
    // under the limit even with host memory: a property of classic
    // placement, not of host memory.
    GTEST_SKIP() << "classic segments do not fit this layout under the limit";
  }
  opts_.memory_limit_bytes = 128 * kMiB;
  const auto setup = [&] {
    std::vector<DevicePtr> tmp;
    for (int i = 0; i < 10; ++i) {
      Hold(2 * kMiB, i % 2 ? a2_ : b1_);
      tmp.push_back(Alloc(8 * kMiB, i % 2 ? a2_ : b1_));
    }
    for (DevicePtr p : tmp) Free(p);
  };
  const int n = Sweep(8 * kGiB, setup, [&] { Hold(90 * kMiB, a1_); });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// --- RecordStream, pending frees -------------------------------------------

// RecordStream then Deallocate of a block used on another stream, then a
// request that wants that block.
TEST_P(HostOomTest, RecordStreamDeallocateReuse) {
  std::vector<DevicePtr> rec;
  const auto setup = [&] {
    rec.clear();
    for (int i = 0; i < 8; ++i) rec.push_back(Alloc(3 * kMiB, a1_));
  };
  const int n = Sweep(
      8 * kGiB, setup,
      [&] {
        while (!rec.empty()) {
          DevicePtr p = rec.back();
          absl::Status s = alloc_->RecordStream(p, b1_);
          s = alloc_->Deallocate(p);  // noexcept
          if (!s.ok()) {
            // Host memory ran out: an error, and the block stays live.
            EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
            EXPECT_TRUE(alloc_->Lookup(p).ok());
            return;
          }
          rec.pop_back();
        }
        Hold(3 * kMiB, a1_);
        Hold(24 * kMiB, a1_);
      },
      [&] {
        for (DevicePtr p : rec) Free(p);
        rec.clear();
      });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// Pending frees (recorded on other streams) polled by a slow-path request
// and by Trim.
TEST_P(HostOomTest, PendingFreesPolled) {
  const auto setup = [&] {
    for (int i = 0; i < 20; ++i) {
      DevicePtr p = Alloc(1 * kMiB + 4096 * i, a1_);
      ASSERT_TRUE(alloc_->RecordStream(p, i % 2 ? b1_ : a2_).ok());
      Free(p);
    }
    DevicePtr q = Alloc(30 * kMiB, a1_);
    ASSERT_TRUE(alloc_->RecordStream(q, b1_).ok());
    Free(q);
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    Hold(200 * kMiB, a1_);
    for (int i = 0; i < 20; ++i) Hold(1 * kMiB, a1_);
  });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// --- Decay -------------------------------------------------------------------

TEST_P(HostOomTest, DecayTrimIdle) {
  opts_.idle_release_after = absl::Seconds(1);
  const auto setup = [&] {
    HoldThenFree(6 * kMiB, 100 * kMiB, a1_);
    HoldThenFree(2 * kMiB, 40 * kMiB, b1_);
    Free(Alloc(4096, a2_));
    if (expandable()) {
      ASSERT_TRUE(alloc_->Trim(64 * kMiB).ok());
    }
    now_ += absl::Seconds(10);
  };
  const int n = Sweep(8 * kGiB, setup, [&] { (void)alloc_->TrimIdle(); });
  EXPECT_TRUE(fired_any_) << "TrimIdle made no host allocation";
  (void)n;
}

// Decay run from a slow-path Allocate.
TEST_P(HostOomTest, DecayOnSlowPathAllocate) {
  opts_.idle_release_after = absl::Seconds(1);
  const auto setup = [&] {
    HoldThenFree(6 * kMiB, 100 * kMiB, b1_);
    Free(Alloc(4096, a2_));
    if (expandable()) {
      ASSERT_TRUE(alloc_->Trim(64 * kMiB).ok());
    }
    now_ += absl::Seconds(10);
  };
  const int n = Sweep(8 * kGiB, setup, [&] { Hold(64 * kMiB, a1_); });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// --- Reset -------------------------------------------------------------------

TEST_P(HostOomTest, ResetNoForce) {
  const auto setup = [&] {
    for (int i = 0; i < 10; ++i) HoldThenFree(1 * kMiB, 30 * kMiB, a1_);
    Free(Alloc(4096, b1_));
    FreeHeld();
    if (expandable()) {
      ASSERT_TRUE(alloc_->Trim(64 * kMiB).ok());
    }
  };
  const int n = Sweep(8 * kGiB, setup, [&] { (void)alloc_->Reset(false); });
  EXPECT_TRUE(fired_any_) << "Reset made no host allocation";
  (void)n;
}

// Reset(false) with live blocks: FAILED_PRECONDITION listing them, nothing
// changed.
TEST_P(HostOomTest, ResetNoForceWithLive) {
  const auto setup = [&] {
    for (int i = 0; i < 10; ++i) HoldThenFree(1 * kMiB, 30 * kMiB, a1_);
    Hold(4096, b1_);
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    absl::Status s = alloc_->Reset(false);
    EXPECT_FALSE(s.ok());
  });
  EXPECT_TRUE(fired_any_);
  (void)n;
}

// Reset(true) with live blocks: they become invalid. After a throw they may
// or may not be live; free what is still live.
TEST_P(HostOomTest, ResetForceWithLive) {
  bool reset_done = false;
  const auto setup = [&] {
    reset_done = false;
    for (int i = 0; i < 10; ++i) HoldThenFree(1 * kMiB, 30 * kMiB, a1_);
    Hold(4096, b1_);
    Hold(64 * kMiB, a2_);
  };
  const int n = Sweep(
      8 * kGiB, setup,
      [&] {
        absl::Status s = alloc_->Reset(true);
        EXPECT_TRUE(s.ok()) << s;
        reset_done = true;
        held_.clear();
      },
      [&] {
        if (reset_done) return;
        // Reset(force) threw part-way: it may have dropped some segments
        // with their live blocks (what it was asked to do), and the books
        // still hold (the sweep checks them); a block it did not drop stays
        // live and freeable, and a second Reset finishes the job.
        std::vector<DevicePtr> kept;
        for (DevicePtr p : held_) {
          if (alloc_->Lookup(p).ok()) kept.push_back(p);
        }
        held_ = kept;
      });
  EXPECT_TRUE(fired_any_) << "Reset(true) made no host allocation";
  (void)n;
}

// Destroying the allocator with live blocks when host memory runs out: the
// destructor (noexcept) cannot let Reset's std::bad_alloc out, so it gives
// every remaining byte back without the books. Every byte and event goes
// back to the driver, with no misuse, whichever allocation fails.
TEST_P(HostOomTest, DestructionWithLiveBlocks) {
  int k = 0;
  for (; k < 4000; ++k) {
    SCOPED_TRACE(testing::Message() << "host allocation " << k << " fails");
    Init(8 * kGiB);
    for (int i = 0; i < 10; ++i) HoldThenFree(1 * kMiB, 30 * kMiB, a1_);
    Hold(4096, b1_);
    Hold(64 * kMiB, a2_);
    ASSERT_FALSE(HasFailure());
    g_fail_after = k;
    alloc_.reset();
    const bool fired = g_fail_after == -1;
    g_fail_after = -1;
    held_.clear();
    EXPECT_EQ(Physical(), 0u) << "device bytes lost";
    EXPECT_EQ(sim_->call_count(SimCall::kEventCreate),
              sim_->call_count(SimCall::kEventDestroy))
        << "events lost";
    EXPECT_EQ(sim_->misuse_count(), 0u)
        << (sim_->misuse_count() ? sim_->misuse_log().back() : "");
    if (HasFailure() || !fired) break;
  }
  EXPECT_GT(k, 0) << "the destructor made no host allocation";
}

// --- RetireStream
// --------------------------------------------------------------

TEST_P(HostOomTest, RetireStreamThenReuse) {
  StreamHandle s;
  const auto setup = [&] {
    s = NewStream();
    Hold(2 * kMiB, s);
    Free(Alloc(80 * kMiB, s));
    Free(Alloc(4096, s));
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    (void)alloc_->RetireStream(s);
    Hold(80 * kMiB, a1_);
    Hold(4096, a1_);
  });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// --- Small pool cold path, many streams
// ----------------------------------------

TEST_P(HostOomTest, SmallPoolColdManySizes) {
  const int n = Sweep(
      8 * kGiB, [] {},
      [&] {
        for (int i = 0; i < 700; ++i) Hold(512 * (1 + i % 7), a1_);
        for (int i = 0; i < 50; ++i) Hold(1 << 20, a1_);
      });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

TEST_P(HostOomTest, ManyStreams) {
  const auto setup = [&] {
    for (int i = 0; i < 100; ++i) NewStream();
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    for (StreamHandle s : extra_streams_) {
      Hold(4096, s);
      Hold(12 * kMiB, s);
    }
  });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// --- Owners
// ----------------------------------------------------------------------

TEST_P(HostOomTest, OwnersRegisterAllocateClose) {
  std::vector<OwnedBlock> freed;
  OwnerId o = kNoOwner;
  const auto setup = [&] {
    freed.clear();
    freed.reserve(4);  // force growth in CloseOwner
    o = kNoOwner;
    HoldThenFree(2 * kMiB, 30 * kMiB, a1_);
  };
  const int n = Sweep(
      8 * kGiB, setup,
      [&] {
        absl::StatusOr<OwnerId> id =
            alloc_->RegisterOwner("owner-name-long-enough-to-heap-allocate",
                                  OwnerOptions{.max_live_bytes = 1 * kGiB});
        if (!id.ok()) return;
        o = *id;
        for (int i = 0; i < 40; ++i) {
          absl::StatusOr<DevicePtr> p = alloc_->Allocate(
              i % 2 ? 4096 : 3 * kMiB, i % 3 ? a1_ : b1_, o, "label");
          EXPECT_TRUE(p.ok()) << p.status();
        }
        absl::Status s = alloc_->CloseOwner(o, &freed);
        EXPECT_TRUE(s.ok()) << s;
        absl::StatusOr<OwnerStats> st = alloc_->UnregisterOwner(o);
        EXPECT_TRUE(st.ok()) << st.status();
        o = kNoOwner;
      },
      [&] {
        if (o != kNoOwner) {
          std::vector<OwnedBlock> f;
          (void)alloc_->CloseOwner(o, &f);
          (void)alloc_->UnregisterOwner(o);
        }
      });
  EXPECT_TRUE(fired_any_);
  EXPECT_GT(n, 0);
}

// Owned blocks freed with a FreeCheck (noexcept) and OwnedBlocks listing.
TEST_P(HostOomTest, OwnedBlocksAndCheckedFree) {
  OwnerId o = kNoOwner;
  std::vector<DevicePtr> own;
  const auto setup = [&] {
    own.clear();
    absl::StatusOr<OwnerId> id = alloc_->RegisterOwner("o");
    ASSERT_TRUE(id.ok());
    o = *id;
    for (int i = 0; i < 30; ++i) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(8192, a1_, o);
      ASSERT_TRUE(p.ok());
      own.push_back(*p);
    }
  };
  const int n = Sweep(
      8 * kGiB, setup,
      [&] {
        absl::StatusOr<std::vector<OwnedBlock>> b = alloc_->OwnedBlocks(o);
        (void)b;
        // Wrong owner: refused (error Status built under the countdown).
        (void)alloc_->Deallocate(own.back(), FreeCheck{.owner = o + 1});
        while (!own.empty()) {
          absl::Status s = alloc_->Deallocate(
              own.back(),
              FreeCheck{
                  .owner = o, .check_size = true, .requested_bytes = 8192});
          EXPECT_TRUE(s.ok()) << s;
          own.pop_back();
        }
      },
      [&] {
        for (DevicePtr p : own) Free(p);
        own.clear();
      });
  EXPECT_TRUE(fired_any_);
  (void)n;
}

// --- Invalid frees
// -------------------------------------------------------------

TEST_P(HostOomTest, ForeignPointerAndDoubleFree) {
  DevicePtr p;
  const auto setup = [&] {
    p = Alloc(3 * kMiB, a1_);
    Free(p);
  };
  const int n = Sweep(8 * kGiB, setup, [&] {
    absl::Status s = alloc_->Deallocate(p);  // double free, noexcept
    EXPECT_FALSE(s.ok());
    s = alloc_->Deallocate(DevicePtr(0x1234));  // foreign
    EXPECT_FALSE(s.ok());
    s = alloc_->RecordStream(p, b1_);
    EXPECT_FALSE(s.ok());
  });
  EXPECT_TRUE(fired_any_);
  (void)n;
}

// Allocation errors built under the countdown: too large, and the device
// running out (OOM report string).
TEST_P(HostOomTest, OomReportUnderCountdown) {
  const auto setup = [&] { HoldThenFree(100 * kMiB, 60 * kMiB, b1_); };
  const int n = Sweep(256 * kMiB, setup, [&] {
    absl::StatusOr<DevicePtr> r = alloc_->Allocate(200 * kMiB, a1_);
    EXPECT_FALSE(r.ok());
    r = alloc_->Allocate(kGiB, a1_);
    EXPECT_FALSE(r.ok());
  });
  EXPECT_TRUE(fired_any_);
  (void)n;
}

INSTANTIATE_TEST_SUITE_P(Backings, HostOomTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
