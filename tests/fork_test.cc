// fork() after initialisation: the child must get FAILED_PRECONDITION from
// every call and make no driver call, even from destructors; a Runtime made
// in the child after the fork (the post_fork pattern) works.
//
// The child runs plain code (no gtest assertions) and reports the first
// failed check as its exit code; the process is single-threaded at fork().
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

bool IsForkError(const absl::Status& s) {
  return s.code() == absl::StatusCode::kFailedPrecondition &&
         s.message().find("forked") != absl::string_view::npos &&
         s.message().find("post_fork") != absl::string_view::npos;
}

// Runs in the child. Returns 0, or the number of the first failed check.
int ChildChecks(std::unique_ptr<Runtime> rt, SimDriver* sim,
                std::unique_ptr<ModelSession> session, DevicePtr live) {
  const std::uint64_t calls = sim->total_call_count();
  const std::uint64_t misuse = sim->misuse_count();
  DeviceContext* dc = nullptr;
  if (!rt->InForkedChild()) return 1;
  if (!IsForkError(rt->device(0).status())) return 2;
  if (!rt->devices().empty()) return 3;
  if (!IsForkError(session->Allocate(1 << 20, session->stream(0)).status())) {
    return 4;
  }
  if (!IsForkError(session->Deallocate(live))) return 5;
  if (!IsForkError(session->AcquireEvent().status())) return 6;
  if (!IsForkError(session->Warmup({}))) return 7;
  if (!IsForkError(session->RecordStream(live, session->stream(0)))) {
    return 8;
  }
  if (!IsForkError(session->device_allocator().Allocate(1, {}).status())) {
    return 9;
  }
  dc = &session->device();
  if (!IsForkError(dc->OpenSession("other", {}).status())) return 10;
  if (!IsForkError(dc->MakeCurrent())) return 11;
  if (!IsForkError(dc->CheckCurrentContext())) return 12;
  if (!IsForkError(dc->GetContextReport().status())) return 13;
  if (!IsForkError(dc->SetContextLimits({}).status())) return 14;
  if (!IsForkError(session->Close())) return 15;
  if (sim->total_call_count() != calls) return 16;
  // Destructors: no driver call. The Runtime leaks the driver in the child,
  // so `sim` stays readable after the Runtime is gone.
  session.reset();
  rt.reset();
  if (sim->total_call_count() != calls) return 17;
  if (sim->misuse_count() != misuse) return 18;
  if (sim->primary_ctx_refcount(0) != 1) return 19;  // never released here
  // The fix the error message recommends: a Runtime created in the worker.
  auto fresh = Runtime::Create({.driver = "sim:a10-24gb"});
  if (!fresh.ok()) return 20;
  auto d0 = (*fresh)->device(0);
  if (!d0.ok()) return 21;
  auto s = (*d0)->OpenSession("worker", {.streams = 1});
  if (!s.ok()) return 22;
  auto p = (*s)->Allocate(1 << 20, (*s)->stream(0));
  if (!p.ok()) return 23;
  if (!(*s)->Deallocate(*p).ok()) return 24;
  if (!(*s)->Close().ok()) return 25;
  return 0;
}

TEST(Fork, ChildGetsFailedPreconditionAndMakesNoDriverCall) {
  auto owned = SimDriver::Create();
  SimDriver* sim = owned.get();
  auto rt = Runtime::Create(std::move(owned));
  ASSERT_TRUE(rt.ok()) << rt.status();
  auto dc = (*rt)->device(0);
  ASSERT_TRUE(dc.ok());
  auto session = (*dc)->OpenSession("bert", {.streams = 1});
  ASSERT_TRUE(session.ok());
  auto live = (*session)->Allocate(4 << 20, (*session)->stream(0), "weights");
  ASSERT_TRUE(live.ok());
  const std::uint64_t parent_calls = sim->total_call_count();

  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << "fork failed";
  if (pid == 0) {
    _exit(ChildChecks(std::move(*rt), sim, std::move(*session), *live));
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "child died, status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "check " << WEXITSTATUS(status) << " failed in the child";

  // The parent is untouched by the child's attempts.
  EXPECT_FALSE((*rt)->InForkedChild());
  EXPECT_EQ(sim->total_call_count(), parent_calls);
  EXPECT_TRUE((*session)->Deallocate(*live).ok());
  EXPECT_TRUE((*session)->Close().ok());
  EXPECT_EQ(sim->misuse_count(), 0u);
}

TEST(Fork, TheErrorExplainsPerWorkerInitialisation) {
  ForkGuard guard;
  EXPECT_TRUE(guard.Check("x").ok());
  EXPECT_EQ(guard.pid(), getpid());
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    absl::Status s = guard.Check("ModelSession::Allocate");
    int code = 0;
    if (!guard.InForkedChild())
      code = 1;
    else if (s.code() != absl::StatusCode::kFailedPrecondition)
      code = 2;
    else if (s.message().find("ModelSession::Allocate") ==
             absl::string_view::npos)
      code = 3;
    else if (s.message().find("Runtime in each worker") ==
             absl::string_view::npos)
      code = 4;
    else if (s.message().find(std::to_string(guard.pid())) ==
             absl::string_view::npos)
      code = 5;
    else if (!ForkGuard().Check("new").ok())
      code = 6;  // a guard made after
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(guard.Check("x").ok());  // still fine in the parent
}

}  // namespace
}  // namespace ctxpool
