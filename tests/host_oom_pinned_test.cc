// Host memory running out (std::bad_alloc) in the middle of a call of the
// pinned-host allocator (CachingHostAllocator): a sweep fails each host
// allocation of a call in turn (SimDriver's own are left alone). After every
// one of them the allocator's invariants hold, no pinned byte is lost
// (freeing what the test holds and Reset(true) give every pinned byte back to
// the driver), no event is lost, and the same call then succeeds. The call
// may throw std::bad_alloc or return an error, except Deallocate, which is
// noexcept: it returns an error (the buffer stays live) or frees.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"
#include "heap_counter.h"
#include "host_oom_sweep.h"

namespace ctxpool {
namespace {

class PinnedHostOomTest : public test::HostOomSweepTest {
 protected:
  void TearDown() override { Teardown(); }

  void Init(HostAllocatorOptions options = {}) {
    Teardown();
    StartSim();
    dev_ = *sim_->MemAlloc(4096);
    options.context = ctx_;
    absl::StatusOr<std::unique_ptr<CachingHostAllocator>> a =
        CachingHostAllocator::Create(*sim_, options);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(*a);
    held_.clear();
    held_.reserve(1024);
    user_.assign(4, std::vector<char>(1 << 16));
  }
  void Teardown() {
    if (sim_ == nullptr) return;
    Idle();
    alloc_.reset();
    EXPECT_EQ(sim_->host_bytes(), 0u) << "pinned bytes lost";
    EXPECT_TRUE(sim_->MemFree(dev_).ok());
    StopSim();
  }

  // Work on stream i that keeps it busy (a copy into the pinned buffer).
  void Busy(int i) {
    sim_->Hold(S(i));
    ASSERT_TRUE(sim_->Touch(S(i), dev_, 256).ok());
  }
  void Hold(std::size_t bytes, int stream = 0) {
    absl::StatusOr<void*> p = alloc_->Allocate(bytes, S(stream));
    if (in_op_) {
      if (p.ok()) held_.push_back(*p);
      return;
    }
    ASSERT_TRUE(p.ok()) << p.status();
    held_.push_back(*p);
  }
  // Frees every held buffer that is still live (a Deallocate under the
  // countdown may have returned an error and kept it live).
  void FreeHeld() {
    test::FreeAll(held_, [&](void* p) { return alloc_->Deallocate(p); });
  }

  // Sweeps k = 0, 1, ...: `setup` on a fresh allocator, then `op` with the
  // k-th host allocation failing, then the checks; stops at the first k at
  // which the countdown does not fire. Returns that k.
  int Sweep(const std::function<void()>& setup, const std::function<void()>& op,
            HostAllocatorOptions options = {}) {
    return test::SweepHostAllocations({
        .fresh = [&] { Init(options); },
        .setup = setup,
        .op = op,
        .give_back =
            [&] {
              if (alloc_ == nullptr) {  // the op destroyed it
                held_.clear();
                EXPECT_EQ(sim_->host_bytes(), 0u) << "pinned bytes lost";
                return;
              }
              absl::Status inv = alloc_->CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after op: " << inv;
              FreeHeld();
              Idle();
              const absl::Status r = alloc_->Reset(/*force=*/true);
              EXPECT_TRUE(r.ok()) << r;
              inv = alloc_->CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after reset: " << inv;
              const HostAllocatorStats st = alloc_->Stats();
              EXPECT_EQ(st.pinned_bytes, 0u);
              EXPECT_EQ(sim_->host_bytes(), st.registered_bytes)
                  << "pinned bytes off the books";
              if (options.host_budget_bytes != 0) {
                // The whole budget is free again (nothing counted twice).
                absl::StatusOr<void*> all =
                    alloc_->Allocate(options.host_budget_bytes, S(0));
                EXPECT_TRUE(all.ok()) << all.status();
                if (all.ok()) {
                  EXPECT_TRUE(alloc_->Deallocate(*all).ok());
                }
              }
            },
        .in_op = &in_op_,
    });
  }

  DevicePtr dev_;
  std::unique_ptr<CachingHostAllocator> alloc_;
  std::vector<void*> held_;
  std::vector<std::vector<char>> user_;  // memory for Register
};

TEST_F(PinnedHostOomTest, FirstAllocate) {
  EXPECT_GT(Sweep([] {}, [&] { Hold(1000); }), 0);
}

TEST_F(PinnedHostOomTest, ManyClassesGrowTheTables) {
  EXPECT_GT(Sweep([] {},
                  [&] {
                    for (std::size_t b = 64; b <= (std::size_t{1} << 22);
                         b += b / 3) {
                      Hold(b);
                    }
                  }),
            10);
}

TEST_F(PinnedHostOomTest, CachedAllocate) {
  // The cached path takes no host memory.
  EXPECT_EQ(Sweep(
                [&] {
                  Hold(1000);
                  FreeHeld();
                },
                [&] { Hold(1000); }),
            0);
}

TEST_F(PinnedHostOomTest, DeallocateOnBusyStreams) {
  // Used by four busy streams: more events than a buffer keeps inline.
  void* p = nullptr;
  EXPECT_GT(Sweep(
                [&] {
                  Hold(1000);
                  p = held_.back();
                  for (int i = 1; i < 4; ++i) {
                    ASSERT_TRUE(alloc_->RecordStream(p, S(i)).ok());
                  }
                  for (int i = 0; i < 4; ++i) Busy(i);
                },
                [&] { test::ExpectFreedOrKeptLive(alloc_->Deallocate(p)); }),
            0);
}

TEST_F(PinnedHostOomTest, DeallocateManyPending) {
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 40; ++i) Hold(4096 + 512 * i, i % 4);
                  for (int i = 0; i < 4; ++i) Busy(i);
                },
                [&] {
                  std::vector<void*> live = held_;
                  for (void* p : live) {
                    test::ExpectFreedOrKeptLive(alloc_->Deallocate(p));
                  }
                }),
            0);
}

TEST_F(PinnedHostOomTest, AllocatePollsPending) {
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 20; ++i) Hold(1000 + 4096 * i, i % 4);
                  for (int i = 0; i < 4; ++i) Busy(i);
                  FreeHeld();
                  Idle();
                },
                [&] {
                  Hold(1000 + 4096 * 19);
                  Hold(1 << 20);
                }),
            0);
}

TEST_F(PinnedHostOomTest, RecordStream) {
  void* p = nullptr;
  EXPECT_GT(Sweep(
                [&] {
                  Hold(1000);
                  p = held_.back();
                },
                [&] {
                  for (int i = 1; i < 4; ++i) {
                    const absl::Status s = alloc_->RecordStream(p, S(i));
                    if (!in_op_) {
                      EXPECT_TRUE(s.ok()) << s;
                    }
                  }
                }),
            0);
}

TEST_F(PinnedHostOomTest, TrimCachedAndPending) {
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 30; ++i) Hold(2048 * (i + 1), i % 4);
                  Busy(1);
                  FreeHeld();
                },
                [&] {
                  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
                  if (!in_op_) {
                    EXPECT_TRUE(t.ok()) << t.status();
                  }
                }),
            0);
}

TEST_F(PinnedHostOomTest, ResetWithLiveBuffers) {
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 12; ++i) Hold(1000 * (i + 1));
                },
                [&] {
                  const absl::Status s = alloc_->Reset(/*force=*/false);
                  EXPECT_FALSE(s.ok());
                }),
            0);
}

TEST_F(PinnedHostOomTest, ResetForcedWithLiveAndPending) {
  EXPECT_GT(
      Sweep(
          [&] {
            for (int i = 0; i < 24; ++i) Hold(1000 * (i + 1), i % 4);
            std::vector<void*> half(held_.begin(), held_.begin() + 12);
            held_.erase(held_.begin(), held_.begin() + 12);
            for (int i = 0; i < 4; ++i) Busy(i);
            for (void* p : half) ASSERT_TRUE(alloc_->Deallocate(p).ok());
          },
          [&] {
            Idle();  // the events still wait on the pending buffers' lists
            const absl::Status s = alloc_->Reset(/*force=*/true);
            if (!in_op_) {
              EXPECT_TRUE(s.ok()) << s;
            }
          }),
      0);
}

TEST_F(PinnedHostOomTest, RegisterAndUnregister) {
  EXPECT_GT(Sweep([&] { Hold(4096); },
                  [&] {
                    for (auto& u : user_) {
                      const absl::Status s =
                          alloc_->Register(u.data(), u.size());
                      if (!in_op_) {
                        EXPECT_TRUE(s.ok()) << s;
                      }
                    }
                    const absl::Status s = alloc_->Unregister(user_[0].data());
                    if (!in_op_) {
                      EXPECT_TRUE(s.ok()) << s;
                    }
                  }),
            0);
}

TEST_F(PinnedHostOomTest, OverBudgetFreesTheCacheFirst) {
  HostAllocatorOptions o;
  o.host_budget_bytes = 1 << 20;
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 8; ++i) Hold(64 << 10);
                  FreeHeld();
                },
                [&] {
                  Hold(700 << 10);
                  // Over the budget: an error, nothing lost.
                  const absl::StatusOr<void*> p =
                      alloc_->Allocate(700 << 10, S(0));
                  if (!in_op_) {
                    EXPECT_EQ(p.status().code(),
                              absl::StatusCode::kResourceExhausted);
                  }
                },
                o),
            0);
}

TEST_F(PinnedHostOomTest, DriverOutOfMemoryThenHostOutOfMemory) {
  // cuMemHostAlloc fails once: the retry frees the cache first, and host
  // memory can run out there too.
  HostAllocatorOptions o;
  o.host_budget_bytes = 1 << 20;
  EXPECT_GT(Sweep(
                [&] {
                  Hold(64 << 10);
                  FreeHeld();
                  sim_->InjectFault(SimCall::kMemHostAlloc, 1,
                                    cu::kErrorOutOfMemory);
                },
                [&] { Hold(256 << 10); }, o),
            0);
}

TEST_F(PinnedHostOomTest, DestructorWithCachedPendingAndLiveBuffers) {
  // The destructor must not throw; without host memory for Reset's lists it
  // frees every buffer in place.
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 24; ++i) Hold(1000 * (i + 1), i % 4);
                  for (int i = 0; i < 4; ++i) Busy(i);
                  for (int i = 0; i < 16; ++i) {
                    ASSERT_TRUE(alloc_->Deallocate(held_[i]).ok());
                  }
                  held_.erase(held_.begin(), held_.begin() + 16);
                  Idle();  // the pending buffers' events complete, unpolled
                },
                [&] { alloc_.reset(); }),
            0);
}

TEST_F(PinnedHostOomTest, InvalidFreesNeverThrow) {
  EXPECT_GT(Sweep([&] { Hold(1000); },
                  [&] {
                    // A foreign pointer, then a double free: errors, never a
                    // throw (Deallocate is noexcept).
                    int local = 0;
                    EXPECT_FALSE(alloc_->Deallocate(&local).ok());
                    test::ExpectDoubleFreeRefused(
                        held_, [&](void* q) { return alloc_->Deallocate(q); });
                  }),
            0);
}

}  // namespace
}  // namespace ctxpool
