// tests/host_oom_sweep.h — the loop of a host-memory sweep: for k = 0, 1,
// ... a fresh allocator runs `setup`, then `op` with its k-th host
// allocation failing (heap_counter.h's g_fail_after), then `give_back`
// (checks the books, frees everything, checks nothing was lost); then the
// same op again with host memory. Stops at the first k at which the
// countdown did not fire (the op made k host allocations), or at a failure.
//
// Include it after heap_counter.h, in the one translation unit that
// includes that.
#ifndef CTXPOOL_TESTS_HOST_OOM_SWEEP_H_
#define CTXPOOL_TESTS_HOST_OOM_SWEEP_H_

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace test {

struct SweepSteps {
  std::function<void()> fresh;      // a new allocator, nothing held
  std::function<void()> setup;      // with host memory
  std::function<void()> op;         // the call under the countdown
  std::function<void()> give_back;  // after op: check, free all, check
  bool* in_op = nullptr;            // true while `op` runs under it
  int max_allocations = 2000;
};

// Returns the number of host allocations the op made (the k at which the
// countdown did not fire), or the k of the first failure.
inline int SweepHostAllocations(const SweepSteps& s) {
  for (int k = 0; k < s.max_allocations; ++k) {
    SCOPED_TRACE(testing::Message() << "host allocation " << k << " fails");
    s.fresh();
    s.setup();
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "setup failed";
      return k;
    }
    g_fail_after = k;
    *s.in_op = true;
    try {
      s.op();
    } catch (const std::bad_alloc&) {
    }
    *s.in_op = false;
    const bool fired = g_fail_after == -1;
    g_fail_after = -1;
    s.give_back();
    // Same op again, now with host memory.
    s.fresh();
    s.setup();
    s.op();
    s.give_back();
    if (::testing::Test::HasFailure() || !fired) {
      if (std::getenv("SWEEP_VERBOSE") != nullptr) {
        std::fprintf(stderr, "swept %d host allocations\n", k);
      }
      return k;
    }
  }
  ADD_FAILURE() << "op made over " << s.max_allocations << " host allocations";
  return s.max_allocations;
}

// The answer of a noexcept Deallocate under the countdown: freed, or
// RESOURCE_EXHAUSTED with the object still live.
inline void ExpectFreedOrKeptLive(const absl::Status& s) {
  EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kResourceExhausted) << s;
}

// Frees every pointer in `held` with `free`; one a Deallocate under the
// countdown kept live is freed now, one it freed is refused
// (INVALID_ARGUMENT).
template <typename Ptr, typename Free>
void FreeAll(std::vector<Ptr>& held, Free free) {
  for (Ptr p : held) {
    const absl::Status s = free(p);
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kInvalidArgument) << s;
  }
  held.clear();
}

// Frees the last pointer of `held` with `free`; once freed, a second free
// of it must be refused.
template <typename Ptr, typename Free>
void ExpectDoubleFreeRefused(std::vector<Ptr>& held, Free free) {
  const Ptr p = held.back();
  if (free(p).ok()) {
    held.pop_back();
    EXPECT_FALSE(free(p).ok());
  }
}

// A fixture's common part: a SimDriver with a current context and four
// streams, made anew for every run of a sweep. Skips under TSan, whose
// runtime owns operator new.
class HostOomSweepTest : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef CTXPOOL_TEST_TSAN
    GTEST_SKIP() << "TSan replaces operator new, so no allocation can fail";
#endif
  }

  // A new simulator, context and streams.
  void StartSim() {
    sim_ = SimDriver::Create();
    absl::StatusOr<ContextHandle> ctx = sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *ctx;
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    for (StreamHandle& s : streams_) {
      s = *sim_->StreamCreate(kStreamNonBlocking, 0);
    }
  }
  // Checks that the simulator saw no misuse and every event came back, and
  // drops it. REQUIRES: the allocators on it are gone.
  void StopSim() {
    EXPECT_EQ(sim_->call_count(SimCall::kEventCreate),
              sim_->call_count(SimCall::kEventDestroy))
        << "events lost";
    EXPECT_EQ(sim_->misuse_count(), 0u);
    for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
    sim_.reset();
  }

  StreamHandle S(int i) const { return streams_[static_cast<std::size_t>(i)]; }
  // Completes the work of every stream (SimDriver::Hold keeps it pending).
  void Idle() {
    for (StreamHandle s : streams_) sim_->Release(s);
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  StreamHandle streams_[4];
  bool in_op_ = false;  // true while a sweep's op runs under the countdown
};

}  // namespace test
}  // namespace ctxpool

#endif  // CTXPOOL_TESTS_HOST_OOM_SWEEP_H_
