// Host memory running out (std::bad_alloc) in the middle of a call of the
// context layer: DeviceContext::OpenSession and the ModelSession calls
// (Allocate, Deallocate, RecordStream, events, Warmup, Close, destruction).
// A sweep fails each host allocation of a call in turn (SimDriver's own are
// left alone). After every one of them the device allocator's invariants
// hold, closing the sessions and destroying the context give every device
// byte back (SimDriver's used bytes are 0, with no context overhead), the
// simulator saw no misuse, and the same call then succeeds. The call may
// throw std::bad_alloc or return an error, except the noexcept Deallocate
// and the destructor.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"
#include "heap_counter.h"
#include "host_oom_sweep.h"

namespace ctxpool {
namespace {

class SessionHostOomTest : public test::HostOomSweepTest,
                           public ::testing::WithParamInterface<BackingMode> {
 protected:
  void TearDown() override { Teardown(); }

  void Init() {
    Teardown();
    SimDeviceSpec spec;
    spec.capacity_bytes = std::size_t{1} << 30;
    spec.context_overhead_bytes = 0;
    sim_ = SimDriver::Create({.devices = {spec}});
    absl::StatusOr<std::unique_ptr<DeviceContext>> dc = CreateContext(0);
    ASSERT_TRUE(dc.ok()) << dc.status();
    dc_ = std::move(*dc);
    sessions_.clear();
    sessions_.reserve(16);
    held_.clear();
    held_.reserve(1024);
  }
  // A context on the simulator, in this test's backing.
  absl::StatusOr<std::unique_ptr<DeviceContext>> CreateContext(
      int stream_pool_reserve) {
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = stream_pool_reserve;
    o.allocator.backing = GetParam();
    return DeviceContext::Create(*sim_, 0, o);
  }
  void Teardown() {
    if (sim_ == nullptr) return;
    sessions_.clear();
    if (dc_ != nullptr) {
      const absl::Status inv = dc_->device_allocator().CheckInvariants();
      EXPECT_TRUE(inv.ok()) << inv;
    }
    dc_.reset();
    EXPECT_EQ(sim_->used_bytes(0), 0u) << "device bytes lost";
    EXPECT_EQ(sim_->misuse_count(), 0u);
    for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
    sim_.reset();
  }

  // Opens a session (under the countdown an error or a throw is allowed).
  ModelSession* Open(const char* name, int streams = 2,
                     std::size_t max_bytes = 0) {
    SessionOptions o;
    o.streams = streams;
    o.min_bytes = 0;
    o.high_bytes = 0;
    o.max_bytes = max_bytes;
    o.record_times = true;
    absl::StatusOr<std::unique_ptr<ModelSession>> s = dc_->OpenSession(name, o);
    if (!s.ok()) {
      EXPECT_TRUE(in_op_) << s.status();
      return nullptr;
    }
    sessions_.push_back(std::move(*s));
    return sessions_.back().get();
  }
  void Hold(ModelSession* s, std::size_t bytes, int stream = 0) {
    absl::StatusOr<DevicePtr> p =
        s->Allocate(bytes, s->stream(stream), "tensor");
    if (!p.ok()) {
      EXPECT_TRUE(in_op_) << p.status();
      return;
    }
    held_.push_back({s, *p});
  }

  int Sweep(const std::function<void()>& setup,
            const std::function<void()>& op) {
    return test::SweepHostAllocations({
        .fresh = [&] { Init(); },
        .setup = setup,
        .op = op,
        .give_back =
            [&] {
              if (dc_ == nullptr) {  // the op did not make one
                EXPECT_EQ(sim_->used_bytes(0), 0u) << "device bytes lost";
                EXPECT_EQ(sim_->call_count(SimCall::kStreamCreate),
                          sim_->call_count(SimCall::kStreamDestroy))
                    << "streams lost";
                return;
              }
              absl::Status inv = dc_->device_allocator().CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after op: " << inv;
              for (const auto& [s, p] : held_) {
                if (!s->closed()) (void)s->Deallocate(p);
              }
              held_.clear();
              sessions_.clear();  // closes what is open
              inv = dc_->device_allocator().CheckInvariants();
              EXPECT_TRUE(inv.ok()) << "after close: " << inv;
              // Every block freed, every stream back in the pool; but a
              // session destroyed (not closed) while host memory ran out is
              // abandoned: its memory returns with the context (the
              // used-bytes check below).
              const DeviceContextStats st = dc_->Stats();
              EXPECT_EQ(st.open_sessions, 0);
              if (st.sessions_abandoned == 0) {
                EXPECT_EQ(st.streams_leased, 0) << "streams lost";
                EXPECT_EQ(
                    dc_->device_allocator()
                        .Stats()
                        .total
                        .allocated_bytes[static_cast<int>(StatPool::kAggregate)]
                        .current,
                    0)
                    << "blocks left live";
              } else {
                EXPECT_TRUE(in_destroy_op_) << "abandoned outside a destroy";
              }
              dc_.reset();
              EXPECT_EQ(sim_->used_bytes(0), 0u) << "device bytes lost";
            },
        .in_op = &in_op_,
    });
  }

  std::unique_ptr<DeviceContext> dc_;
  std::vector<std::unique_ptr<ModelSession>> sessions_;
  struct Held {
    ModelSession* session;
    DevicePtr ptr;
  };
  std::vector<Held> held_;
  bool in_destroy_op_ = false;  // the op destroyed sessions under countdown
};

TEST_P(SessionHostOomTest, OpenSession) {
  EXPECT_GT(Sweep([] {}, [&] { Open("bert"); }), 0);
}

TEST_P(SessionHostOomTest, ManySessions) {
  EXPECT_GT(Sweep([] {},
                  [&] {
                    static const char* const kNames[] = {
                        "a", "b", "c", "d", "e", "f", "g", "h", "i", "j"};
                    for (const char* n : kNames) {
                      if (ModelSession* s = Open(n, 1)) Hold(s, 3 << 20);
                    }
                  }),
            0);
}

TEST_P(SessionHostOomTest, FirstAndCachedAllocations) {
  ModelSession* s = nullptr;
  EXPECT_GT(Sweep([&] { s = Open("bert"); },
                  [&] {
                    for (int i = 0; i < 200; ++i) {
                      Hold(s, (i % 7 + 1) * 4096, i % 2);
                    }
                    for (int i = 0; i < 200; ++i) Hold(s, 300 << 10, i % 2);
                    Hold(s, 64 << 20);
                  }),
            0);
}

TEST_P(SessionHostOomTest, DeallocateAfterRecordStream) {
  ModelSession* s = nullptr;
  Sweep(
      [&] {
        s = Open("bert");
        for (int i = 0; i < 50; ++i) Hold(s, 1 << 20);
        for (int i = 0; i < 50; ++i) {
          ASSERT_TRUE(s->RecordStream(held_[i].ptr, s->stream(1)).ok());
        }
      },
      [&] {
        std::vector<Held> live = held_;
        held_.clear();
        for (const Held& h : live) {
          const absl::Status st = h.session->Deallocate(h.ptr);
          if (!st.ok()) {
            EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
            held_.push_back(h);
          }
        }
      });
}

TEST_P(SessionHostOomTest, OverMaxIsAnError) {
  ModelSession* s = nullptr;
  Sweep([&] { s = Open("bert", 1, 8 << 20); },
        [&] {
          Hold(s, 4 << 20);
          const absl::StatusOr<DevicePtr> p =
              s->Allocate(16 << 20, s->stream(0));
          EXPECT_FALSE(p.ok());
        });
}

TEST_P(SessionHostOomTest, EventsAndWarmup) {
  ModelSession* s = nullptr;
  EXPECT_GT(Sweep([&] { s = Open("bert"); },
                  [&] {
                    WarmupPlan plan;
                    plan.items = {{0, 1 << 20, 8}, {1, 64 << 10, 32}};
                    plan.events = 6;
                    const absl::Status w = s->Warmup(plan);
                    if (!in_op_) {
                      EXPECT_TRUE(w.ok()) << w;
                    }
                    std::vector<EventHandle> events;
                    for (int i = 0; i < 8; ++i) {
                      absl::StatusOr<EventHandle> e = s->AcquireEvent();
                      if (e.ok()) {
                        events.push_back(*e);
                      } else {
                        EXPECT_TRUE(in_op_) << e.status();
                      }
                    }
                    for (EventHandle e : events) {
                      const absl::Status r = s->ReleaseEvent(e);
                      EXPECT_TRUE(r.ok() || in_op_) << r;
                    }
                  }),
            0);
}

TEST_P(SessionHostOomTest, CloseWithLeaks) {
  ModelSession* s = nullptr;
  EXPECT_GT(Sweep(
                [&] {
                  s = Open("bert");
                  for (int i = 0; i < 40; ++i) Hold(s, (i + 1) << 16, i % 2);
                },
                [&] {
                  const absl::Status c = s->Close();
                  EXPECT_FALSE(c.ok());  // leaks, or out of host memory
                  if (!in_op_) {
                    EXPECT_EQ(c.code(), absl::StatusCode::kFailedPrecondition);
                  }
                }),
            0);
}

TEST_P(SessionHostOomTest, DestroyWithLeaks) {
  Sweep(
      [&] {
        ModelSession* s = Open("bert");
        for (int i = 0; i < 40; ++i) Hold(s, (i + 1) << 16, i % 2);
      },
      [&] {
        held_.clear();
        in_destroy_op_ = in_op_;
        sessions_.clear();  // the destructor closes: must not throw
      });
}

TEST_P(SessionHostOomTest, CreateContext) {
  // DeviceContext::Create with its allocators and pooled streams: throws
  // std::bad_alloc or fails, and a context it did not return leaves nothing.
  EXPECT_GT(Sweep(
                [&] {
                  dc_.reset();
                  EXPECT_EQ(sim_->used_bytes(0), 0u);
                },
                [&] {
                  absl::StatusOr<std::unique_ptr<DeviceContext>> dc =
                      CreateContext(2);
                  if (dc.ok()) {
                    dc_ = std::move(*dc);
                  } else {
                    EXPECT_TRUE(in_op_) << dc.status();
                  }
                }),
            0);
}

INSTANTIATE_TEST_SUITE_P(Backings, SessionHostOomTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
