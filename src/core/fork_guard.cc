#include "ctxpool/core/fork_guard.h"

#include <pthread.h>
#include <unistd.h>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"

namespace ctxpool {
namespace fork_internal {

std::atomic<std::uint64_t> g_fork_generation{0};

namespace {
void OnForkChild() {
  g_fork_generation.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

}  // namespace fork_internal

ForkGuard::ForkGuard() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    pthread_atfork(nullptr, nullptr, &fork_internal::OnForkChild);
  });
  pid_ = getpid();
  generation_ = CurrentGeneration();
}

absl::Status ForkGuard::ForkedError(absl::string_view call) const {
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": this process (pid ", getpid(),
      ") was forked from the process that initialised ctxpool and CUDA (pid ",
      pid_,
      "); a CUDA context cannot be used in a forked child. Initialise CUDA "
      "per worker: create the ctxpool::Runtime in each worker after the fork "
      "(e.g. in gunicorn's post_fork hook, or use the 'spawn' start method), "
      "and not in the parent before forking."));
}

}  // namespace ctxpool
