// tests/alloc_test_support.h — scaffolding shared by the allocator tests
// (pinned host and slab): environment knobs, a model of held streams for the
// differential tests, a threaded smoke runner and fork() checks.
//
// StreamModel tracks which streams are held (SimDriver::Hold) with work
// pending, and an epoch per stream that Release bumps. A buffer freed while a
// stream that used it was busy records (stream, epoch); reusing it is safe
// once that stream's epoch moved on:
//
//   StreamModel model(*sim, /*num_streams=*/4);
//   model.ToggleHold(0);                      // stream 0 keeps its work
//   ... Touch on model.stream(0); model.MarkUsed(0) ...
//   Waits waits = model.BusyAmong({0});       // at Deallocate
//   ... later, when the allocator hands the address out again ...
//   ASSERT_TRUE(model.ReuseIsSafe(waits));
//
// Forked children run plain code and report the first failed check as
// their exit code (RunInForkedChild), as tests/fork_test.cc does; the
// process must be single-threaded at fork().
#ifndef CTXPOOL_TESTS_ALLOC_TEST_SUPPORT_H_
#define CTXPOOL_TESTS_ALLOC_TEST_SUPPORT_H_

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace testing_internal {

// The unsigned value of environment variable `name`, or `fallback`.
inline std::uint64_t EnvOr(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 10);
}

// One step of a 64-bit LCG (Knuth's MMIX constants): cheap per-thread
// randomness for stress loops.
inline std::uint64_t NextLcg(std::uint64_t x) {
  return x * 6364136223846793005ULL + 1442695040888963407ULL;
}

// The common start of a seeded differential test: the number of operations
// (CTXPOOL_DIFF_OPS) and the seed (CTXPOOL_DIFF_SEED) from the environment,
// the generator, and a SimDriver with device 0's primary context current.
struct DifferentialSetup {
  DifferentialSetup(std::uint64_t default_ops, std::uint64_t default_seed)
      : ops(EnvOr("CTXPOOL_DIFF_OPS", default_ops)),
        seed(EnvOr("CTXPOOL_DIFF_SEED", default_seed)),
        rng(seed),
        sim(SimDriver::Create()),
        ctx(*sim->PrimaryCtxRetain(0)) {
    EXPECT_TRUE(sim->CtxSetCurrent(ctx).ok());
  }
  // For SCOPED_TRACE: how to rerun the same test.
  std::string Trace() const {
    return "CTXPOOL_DIFF_SEED=" + std::to_string(seed) +
           " CTXPOOL_DIFF_OPS=" + std::to_string(ops);
  }

  std::uint64_t ops;
  std::uint64_t seed;
  std::mt19937_64 rng;
  std::unique_ptr<SimDriver> sim;
  ContextHandle ctx;
};

// Streams a freed buffer waits for: (stream index, epoch at free time).
using Waits = std::vector<std::pair<int, std::uint64_t>>;

// Held streams and their epochs; see the file comment.
class StreamModel {
 public:
  StreamModel(SimDriver& sim, int num_streams)
      : sim_(sim),
        held_(num_streams, false),
        busy_(num_streams, false),
        epoch_(num_streams, 0) {
    for (int i = 0; i < num_streams; ++i) {
      streams_.push_back(*sim.StreamCreate(kStreamNonBlocking, 0));
    }
  }

  int size() const { return static_cast<int>(streams_.size()); }
  StreamHandle stream(int s) const { return streams_[s]; }

  // Work was enqueued on stream `s`: pending while the stream is held.
  void MarkUsed(int s) {
    if (held_[s]) busy_[s] = true;
  }
  bool held(int s) const { return held_[s]; }

  // Holds stream `s`, or releases it (its work completes) when held.
  void ToggleHold(int s) {
    if (held_[s]) {
      Release(s);
    } else {
      sim_.Hold(streams_[s]);
      held_[s] = true;
    }
  }
  void Release(int s) {
    sim_.Release(streams_[s]);
    held_[s] = false;
    busy_[s] = false;
    ++epoch_[s];
  }
  void ReleaseAll() {
    for (int s = 0; s < size(); ++s) Release(s);
  }

  // The busy streams among `used` (duplicates allowed), at their epochs.
  template <typename Streams>
  Waits BusyAmong(const Streams& used) const {
    Waits waits;
    for (int s : used) {
      if (busy_[s]) waits.emplace_back(s, epoch_[s]);
    }
    return waits;
  }
  Waits BusyAmong(std::initializer_list<int> used) const {
    return BusyAmong<std::initializer_list<int>>(used);
  }

  // Success when every stream in `waits` was released since.
  ::testing::AssertionResult ReuseIsSafe(const Waits& waits) const {
    for (const auto& [s, e] : waits) {
      if (epoch_[s] <= e) {
        return ::testing::AssertionFailure()
               << "reused while stream " << s << " may still use it";
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  SimDriver& sim_;
  std::vector<StreamHandle> streams_;
  std::vector<bool> held_;
  std::vector<bool> busy_;  // held with pending work
  std::vector<std::uint64_t> epoch_;
};

// Runs body(t, stream) on `num_threads` threads, each with its own new
// non-blocking stream and `ctx` current; returns the streams (the caller
// destroys them when its allocator no longer needs them).
inline std::vector<StreamHandle> RunOnThreads(
    SimDriver& sim, ContextHandle ctx, int num_threads,
    const std::function<void(int, StreamHandle)>& body) {
  std::vector<StreamHandle> streams;
  for (int t = 0; t < num_threads; ++t) {
    streams.push_back(*sim.StreamCreate(kStreamNonBlocking, 0));
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < num_threads; ++t) {
    threads.emplace_back([&, t] {
      ASSERT_TRUE(sim.CtxSetCurrent(ctx).ok());
      body(t, streams[t]);
    });
  }
  for (auto& th : threads) th.join();
  return streams;
}

// Every call the simulator has seen (SimDriver counts each kind).
inline std::uint64_t TotalDriverCalls(const SimDriver& sim) {
  return sim.total_call_count();
}

// The error of ForkGuard::Check for `call` in a forked child.
inline bool IsForkError(const absl::Status& s, absl::string_view call) {
  return s.code() == absl::StatusCode::kFailedPrecondition &&
         s.message().find(call) != absl::string_view::npos &&
         s.message().find("forked") != absl::string_view::npos;
}

// For a child's checks: 0 when every status is the fork error of its call,
// else the 1-based position of the first that is not.
inline int FirstNonForkError(
    std::initializer_list<std::pair<absl::Status, absl::string_view>> calls) {
  int i = 0;
  for (const auto& [status, call] : calls) {
    ++i;
    if (!IsForkError(status, call)) return i;
  }
  return 0;
}

// For a child's checks: 0 when the simulator saw no call since it counted
// `calls`, `destroy` makes none and device 0's primary context still has
// `refs` references (the parent's state is leaked); else 1, 2 or 3.
inline int NoDriverCallThroughDestruction(
    SimDriver& sim, std::uint64_t calls, int refs,
    const std::function<void()>& destroy) {
  if (TotalDriverCalls(sim) != calls) return 1;
  destroy();
  if (TotalDriverCalls(sim) != calls) return 2;
  if (sim.primary_ctx_refcount(0) != refs) return 3;
  return 0;
}

// Forks; the child runs `child` and exits with its result. Returns the
// child's exit code, or -1 when fork failed or the child did not exit.
inline int RunInForkedChild(const std::function<int()>& child) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) _exit(child());
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

}  // namespace testing_internal
}  // namespace ctxpool

#endif  // CTXPOOL_TESTS_ALLOC_TEST_SUPPORT_H_
