// Host memory running out (std::bad_alloc) in the middle of a call of the
// slab allocator: a sweep fails each host allocation of a call in turn
// (SimDriver's own are left alone). After every one of them the slab and
// device allocators' invariants hold, no slab is lost (freeing what the test
// holds and Reset(true) give every slab back to the device allocator), no
// event is lost, and the same call then succeeds. The call may throw
// std::bad_alloc or return an error, except Deallocate, which is noexcept:
// it returns an error (the object stays live) or frees.
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
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"
#include "heap_counter.h"
#include "host_oom_sweep.h"

namespace ctxpool {
namespace {

class SlabHostOomTest : public test::HostOomSweepTest {
 protected:
  void TearDown() override { Teardown(); }

  void Init(SlabAllocatorOptions options = {}) {
    Teardown();
    StartSim();
    DeviceAllocatorOptions dopt;
    dopt.context = ctx_;
    absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> d =
        CachingDeviceAllocator::Create(*sim_, 0, dopt);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
    options.context = ctx_;
    now_ = absl::FromUnixSeconds(1000);
    options.clock = [this] { return now_; };
    absl::StatusOr<std::unique_ptr<SlabAllocator>> a =
        SlabAllocator::Create(*device_, options);
    ASSERT_TRUE(a.ok()) << a.status();
    slabs_ = std::move(*a);
    held_.clear();
    held_.reserve(4096);
  }
  void Teardown() {
    if (sim_ == nullptr) return;
    Idle();
    slabs_.reset();
    device_.reset();
    StopSim();
  }

  void Hold(std::size_t bytes, int stream = 0) {
    absl::StatusOr<DevicePtr> p = slabs_->Allocate(bytes, S(stream));
    if (in_op_) {
      if (p.ok()) held_.push_back(*p);
      return;
    }
    ASSERT_TRUE(p.ok()) << p.status();
    held_.push_back(*p);
  }
  void FreeHeld() {
    test::FreeAll(held_, [&](DevicePtr p) { return slabs_->Deallocate(p); });
  }
  // 16 live objects of 8 classes on 4 streams; the first 8, used on another
  // stream each (RecordStream) whose work is held, freed: pending.
  void MakePending() {
    for (int i = 0; i < 16; ++i) Hold(64 << (i % 8), i % 4);
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(slabs_->RecordStream(held_[i], S((i + 1) % 4)).ok());
    }
    for (int i = 0; i < 4; ++i) sim_->Hold(S(i));
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(sim_->Touch(S((i + 1) % 4), held_[i], 64).ok());
    }
    for (int i = 0; i < 8; ++i) {
      ASSERT_TRUE(slabs_->Deallocate(held_[i]).ok());
    }
    held_.erase(held_.begin(), held_.begin() + 8);
  }
  std::int64_t DeviceLiveBytes() const {
    return device_->Stats()
        .total.allocated_bytes[static_cast<int>(StatPool::kAggregate)]
        .current;
  }

  int Sweep(const std::function<void()>& setup, const std::function<void()>& op,
            SlabAllocatorOptions options = {}) {
    return test::SweepHostAllocations({
        .fresh = [&] { Init(options); },
        .setup = setup,
        .op = op,
        .give_back =
            [&] {
              if (slabs_ == nullptr) {  // the op destroyed it
                held_.clear();
                EXPECT_EQ(DeviceLiveBytes(), 0) << "slabs lost";
                return;
              }
              absl::Status inv = slabs_->CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after op: " << inv;
              inv = device_->CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "device after op: " << inv;
              FreeHeld();
              Idle();
              const absl::Status r = slabs_->Reset(/*force=*/false);
              EXPECT_TRUE(r.ok()) << r;
              inv = slabs_->CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after reset: " << inv;
              EXPECT_EQ(slabs_->Stats().slabs_held, 0u);
              EXPECT_EQ(DeviceLiveBytes(), 0) << "slabs lost";
            },
        .in_op = &in_op_,
    });
  }

  std::unique_ptr<CachingDeviceAllocator> device_;
  std::unique_ptr<SlabAllocator> slabs_;
  std::vector<DevicePtr> held_;
  absl::Time now_;
};

TEST_F(SlabHostOomTest, FirstAllocateOfAStream) {
  EXPECT_GT(Sweep([] {}, [&] { Hold(100); }), 0);
}

TEST_F(SlabHostOomTest, ManyStreamsAndClasses) {
  EXPECT_GT(Sweep([] {},
                  [&] {
                    for (int i = 0; i < 4; ++i) {
                      for (std::size_t b = 8; b <= (64 << 10); b *= 2) {
                        Hold(b, i);
                      }
                    }
                  }),
            0);
}

TEST_F(SlabHostOomTest, CachedAllocate) {
  // The cached path takes no host memory.
  EXPECT_EQ(Sweep(
                [&] {
                  Hold(100);
                  Hold(100);
                },
                [&] { Hold(100); }),
            0);
}

TEST_F(SlabHostOomTest, EmptySlabReformatted) {
  // An empty slab of 8-byte objects (the largest bitmap) becomes one of
  // another class, and back.
  Sweep(
      [&] {
        Hold(4 << 10);
        FreeHeld();
      },
      [&] {
        Hold(8);
        FreeHeld();
        Hold(4 << 10);
      });
}

TEST_F(SlabHostOomTest, RecordStreamThenDeallocate) {
  DevicePtr p;
  EXPECT_GT(Sweep(
                [&] {
                  Hold(256);
                  p = held_.back();
                },
                [&] {
                  for (int i = 1; i < 4; ++i) {
                    const absl::Status s = slabs_->RecordStream(p, S(i));
                    if (!in_op_) {
                      EXPECT_TRUE(s.ok()) << s;
                    }
                  }
                  for (int i = 0; i < 4; ++i) sim_->Hold(S(i));
                  for (int i = 0; i < 4; ++i) {
                    ASSERT_TRUE(sim_->Touch(S(i), p, 256).ok());
                  }
                  const absl::Status s = slabs_->Deallocate(p);
                  test::ExpectFreedOrKeptLive(s);
                  if (s.ok()) held_.clear();
                }),
            0);
}

TEST_F(SlabHostOomTest, ManyPendingThenPolled) {
  EXPECT_GT(Sweep(
                [&] {
                  for (int i = 0; i < 64; ++i) Hold(512, i % 2);
                  for (DevicePtr p : held_) {
                    ASSERT_TRUE(slabs_->RecordStream(p, S(3)).ok());
                  }
                  sim_->Hold(S(3));
                  ASSERT_TRUE(sim_->Touch(S(3), held_[0], 512).ok());
                },
                [&] {
                  std::vector<DevicePtr> live = held_;
                  for (DevicePtr p : live) {
                    test::ExpectFreedOrKeptLive(slabs_->Deallocate(p));
                  }
                  Idle();
                  Hold(512);  // polls the pending objects
                  absl::StatusOr<TrimResult> t = slabs_->Trim();
                  if (!in_op_) {
                    EXPECT_TRUE(t.ok()) << t.status();
                  }
                }),
            0);
}

TEST_F(SlabHostOomTest, DecayReturnsEmptySlabs) {
  SlabAllocatorOptions o;
  o.decay = absl::Seconds(10);
  Sweep(
      [&] {
        for (int i = 0; i < 4; ++i) {
          for (std::size_t b = 8; b <= (64 << 10); b *= 4) Hold(b, i);
        }
        FreeHeld();
        now_ += absl::Seconds(60);
      },
      [&] {
        Hold(64, 1);  // a slow path: the decay check returns the old slabs
        Hold(64 << 10, 2);
        FreeHeld();
      },
      o);
}

TEST_F(SlabHostOomTest, TrimReturnsEmptySlabs) {
  Sweep(
      [&] {
        for (int i = 0; i < 4; ++i) {
          for (std::size_t b = 8; b <= (64 << 10); b *= 4) Hold(b, i);
        }
        FreeHeld();
      },
      [&] {
        absl::StatusOr<TrimResult> t = slabs_->Trim();
        if (!in_op_) {
          EXPECT_TRUE(t.ok()) << t.status();
        }
      });
}

TEST_F(SlabHostOomTest, ResetWithLiveObjects) {
  Sweep(
      [&] {
        for (int i = 0; i < 8; ++i) Hold(64 << i);
      },
      [&] {
        const absl::Status s = slabs_->Reset(/*force=*/false);
        EXPECT_FALSE(s.ok());
      });
}

TEST_F(SlabHostOomTest, ResetForcedWithPending) {
  Sweep([&] { MakePending(); },
        [&] {
          Idle();
          const absl::Status s = slabs_->Reset(/*force=*/true);
          if (!in_op_) {
            EXPECT_TRUE(s.ok()) << s;
          }
          if (s.ok()) held_.clear();
        });
}

TEST_F(SlabHostOomTest, DestructorWithPendingObjects) {
  // The destructor must not throw; without host memory for Reset's lists it
  // waits for the pending objects' events and returns every slab in place.
  EXPECT_GT(Sweep(
                [&] {
                  MakePending();
                  Idle();
                },
                [&] { slabs_.reset(); }),
            0);
}

TEST_F(SlabHostOomTest, InvalidFreesNeverThrow) {
  EXPECT_GT(Sweep([&] { Hold(100); },
                  [&] {
                    // A foreign pointer, an interior pointer, then a double
                    // free: errors, never a throw (Deallocate is noexcept).
                    EXPECT_FALSE(slabs_->Deallocate(DevicePtr(0x1000)).ok());
                    const DevicePtr p = held_.back();
                    EXPECT_FALSE(slabs_->Deallocate(p + 8).ok());
                    test::ExpectDoubleFreeRefused(held_, [&](DevicePtr q) {
                      return slabs_->Deallocate(q);
                    });
                  }),
            0);
}

}  // namespace
}  // namespace ctxpool
