// ctxpool/core/fork_guard.h — refusing to use CUDA in a forked child.
//
// A CUDA context does not survive fork(): the child inherits the parent's
// handles and memory map but not the driver's state, and any driver call in
// it fails or hangs. Pre-fork servers (gunicorn, uWSGI, multiprocessing with
// 'fork') hit this when the master initialises CUDA before forking workers.
//
// ForkGuard is how ctxpool turns that into a clear error. It records the
// process id and a fork generation when the object holding it (a Runtime,
// DeviceContext, ModelSession or allocator) is created; a pthread_atfork
// child handler bumps the generation in every forked child, so the check on
// each public call is one relaxed atomic load and a compare. It needs only
// libc and Abseil, so it lives in core and every layer may use it:
//
//   ForkGuard guard;                       // at initialisation
//   ...
//   CTXPOOL_RETURN_IF_ERROR(guard.Check("ModelSession::Allocate"));
//
// In a forked child Check() returns FAILED_PRECONDITION telling the user to
// create the Runtime in each worker after the fork, and destructors use
// InForkedChild() to skip every driver call (they leak the driver's state
// rather than touch it). A Runtime created in the child after the fork has
// a new guard and works.
//
// Thread-safety: all methods are thread-safe.
#ifndef CTXPOOL_CORE_FORK_GUARD_H_
#define CTXPOOL_CORE_FORK_GUARD_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ctxpool {

namespace fork_internal {
// Bumped by the pthread_atfork child handler. Not API.
extern std::atomic<std::uint64_t> g_fork_generation;
}  // namespace fork_internal

class ForkGuard {
 public:
  // Records the calling process and installs the atfork handler (once per
  // process).
  ForkGuard();

  // True in a process forked after this guard was created.
  bool InForkedChild() const {
    return ABSL_PREDICT_FALSE(fork_internal::g_fork_generation.load(
                                  std::memory_order_relaxed) != generation_);
  }

  // OK in the process that created the guard; FAILED_PRECONDITION naming
  // `call`, both process ids and what to do in a forked child.
  absl::Status Check(absl::string_view call) const {
    if (ABSL_PREDICT_TRUE(!InForkedChild())) return absl::OkStatus();
    return ForkedError(call);
  }

  // The process that created the guard.
  pid_t pid() const { return pid_; }

  // Forks seen by this process's atfork handler so far (in the child).
  static std::uint64_t CurrentGeneration() {
    return fork_internal::g_fork_generation.load(std::memory_order_relaxed);
  }

 private:
  absl::Status ForkedError(absl::string_view call) const;

  pid_t pid_;
  std::uint64_t generation_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_FORK_GUARD_H_
