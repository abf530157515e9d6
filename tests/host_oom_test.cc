// Host memory running out (std::bad_alloc) in the middle of an allocator
// call: a sweep fails each host allocation of a call in turn, and after every
// one of them the books still match the driver, no device memory is lost
// (freeing what the test holds and Trim(0) give every byte back), and the
// allocator serves the same request again.
//
// The call may throw std::bad_alloc or return an error; either is fine, as
// long as it loses nothing.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

class HostOomTest : public test::DeviceAllocatorFixture,
                    public ::testing::WithParamInterface<BackingMode> {
 protected:
  void SetUp() override {
#ifdef CTXPOOL_TEST_TSAN
    GTEST_SKIP() << "TSan replaces operator new, so no allocation can fail";
#endif
  }

  void TearDown() override {
    if (sim_ != nullptr) DeviceAllocatorFixture::TearDown();  // not skipped
  }

  void Init(std::size_t capacity) {
    DeviceAllocatorOptions o;
    o.backing = GetParam();
    InitAllocator(capacity, std::move(o));
    held_.clear();
    held_.reserve(1024);
  }
  void Hold(std::size_t bytes, StreamHandle s) {
    const DevicePtr p = Alloc(bytes, s);
    if (!p.is_null()) held_.push_back(p);
  }
  // Holds `keep` bytes, then makes `bytes` a free block after it.
  void HoldThenFree(std::size_t keep, std::size_t bytes, StreamHandle s) {
    Hold(keep, s);
    Free(Alloc(bytes, s));
  }
  void FreeHeld() {
    for (DevicePtr p : held_) Free(p);
    held_.clear();
  }

  // For k = 0, 1, ...: a fresh device of `capacity` bytes, `setup`, then
  // `op` with the k-th host allocation from then on failing, until `op`
  // completes before the k-th. Returns how many allocations op made.
  int Sweep(std::size_t capacity, const std::function<void()>& setup,
            const std::function<void()>& op) {
    for (int k = 0; k < 4000; ++k) {
      SCOPED_TRACE(testing::Message() << "host allocation " << k << " fails");
      Init(capacity);
      setup();
      if (HasFatalFailure()) return k;
      bool threw = false;
      g_fail_after = k;
      try {
        op();
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      const bool fired = g_fail_after == -1;
      g_fail_after = -1;
      (void)threw;
      absl::Status books = CheckBooks();
      EXPECT_TRUE(books.ok()) << books;
      EXPECT_EQ(alloc_->Stats().leaked_bytes, 0u);
      // Nothing lost: all of it comes back.
      FreeHeld();
      absl::StatusOr<TrimResult> t = alloc_->Trim(0);
      EXPECT_TRUE(t.ok()) << t.status();
      EXPECT_EQ(Physical(), 0u);
      books = CheckBooks();
      EXPECT_TRUE(books.ok()) << books;
      // And the allocator still works: the same request again.
      setup();
      op();
      FreeHeld();
      books = CheckBooks();
      EXPECT_TRUE(books.ok()) << books;
      if (HasFailure() || !fired) return k;
    }
    ADD_FAILURE() << "op made over 4000 host allocations";
    return 4000;
  }

  std::vector<DevicePtr> held_;
};

constexpr std::size_t kGiB = std::size_t{1} << 30;

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
  EXPECT_GE(n, 2);  // the arena's refill and the live map's growth
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

INSTANTIATE_TEST_SUITE_P(Backings, HostOomTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
