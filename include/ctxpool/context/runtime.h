// ctxpool/context/runtime.h — the process's entry point to ctxpool.
//
// A Runtime picks the driver, opens one DeviceContext per device and is the
// root of everything else: one per process (per worker, in pre-fork
// servers), created once at startup and destroyed at shutdown.
//
//   CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::Create());
//   std::cerr << rt->driver_note() << "\n";  // which driver, and why
//   CTXPOOL_ASSIGN_OR_RETURN(DeviceContext* gpu0, rt->device(0));
//   CTXPOOL_ASSIGN_OR_RETURN(auto session, gpu0->OpenSession("bert", {}));
//
// Driver choice (RuntimeOptions::driver, default CTXPOOL_DRIVER, "auto"):
//   * "auto": the CUDA driver when libcuda loads and reports a device;
//     otherwise SimDriver "sim:h100-80gb". driver_note() says which and why.
//   * "cuda": the CUDA driver or the error why not (UNAVAILABLE).
//   * "sim", "sim:a10-24gb", "sim:2xh100-80gb", "sim:24GiB": a SimDriver.
//
// fork(): the Runtime records its process at creation. In a child forked
// after that, every call on the Runtime, its DeviceContexts, their sessions
// and allocator handles returns FAILED_PRECONDITION explaining that CUDA
// must be initialised per worker (create the Runtime in the worker, e.g. in
// gunicorn's post_fork hook), and destructors make no driver call.
//
// Thread-safety: all methods are thread-safe. The Runtime must outlive its
// DeviceContexts' sessions.
#ifndef CTXPOOL_CONTEXT_RUNTIME_H_
#define CTXPOOL_CONTEXT_RUNTIME_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/core/cgroup.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

struct RuntimeOptions {
  // Driver spec (see the file comment); empty: CTXPOOL_DRIVER ("auto").
  std::string driver;
  // Device ordinals to open; empty: CTXPOOL_DEVICES, and when that is
  // empty too, every device of the driver.
  std::vector<int> devices;
  // Options for each DeviceContext.
  DeviceContextOptions device_options;
};

class Runtime {
 public:
  // Chooses and loads the driver, then opens the devices. INVALID_ARGUMENT
  // for a bad spec or device list; the driver's error for "cuda" without a
  // GPU (UNAVAILABLE); FAILED_PRECONDITION when the driver has no device.
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(
      RuntimeOptions options = {});
  // As Create, with a driver the caller built (a configured SimDriver, a
  // wrapped driver). `options.driver` is ignored.
  // REQUIRES: driver != nullptr.
  static absl::StatusOr<std::unique_ptr<Runtime>> Create(
      std::unique_ptr<Driver> driver, RuntimeOptions options = {});

  // Destroys the DeviceContexts (each releases its primary context), then
  // the driver. In a forked child it makes no driver call and leaks both.
  // REQUIRES: every session was destroyed.
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Driver& driver() const { return *driver_; }
  // "cuda" or "sim".
  absl::string_view driver_kind() const { return driver_->Kind(); }
  // One or two lines: the driver in use and why it was chosen (e.g. why
  // "auto" fell back to the simulator).
  const std::string& driver_note() const { return driver_note_; }

  // The opened device `ordinal`. NOT_FOUND when it was not opened;
  // FAILED_PRECONDITION in a forked child.
  absl::StatusOr<DeviceContext*> device(int ordinal) const;
  // The opened devices, by ordinal. Empty in a forked child.
  std::vector<DeviceContext*> devices() const;

  // OK, or FAILED_PRECONDITION in a process forked after Create.
  absl::Status CheckFork(absl::string_view call) const {
    return fork_guard_.Check(call);
  }
  bool InForkedChild() const { return fork_guard_.InForkedChild(); }
  pid_t pid() const { return fork_guard_.pid(); }

  // The process's cgroup v2 memory state (ctxpool/core/cgroup.h), read now
  // (memory.current moves) under CTXPOOL_SYSFS_ROOT; never fails.
  CgroupMemory ReadCgroup() const;
  // The pinned-host budget each opened device got from it, as
  // DeriveHostBudget (context/device_context.h) worked it out at Create.
  const DerivedHostBudget& host_budget() const { return host_budget_; }

 private:
  Runtime(std::unique_ptr<Driver> driver, std::string note);

  const ForkGuard fork_guard_;
  std::unique_ptr<Driver> driver_;
  std::string driver_note_;
  DerivedHostBudget host_budget_;
  std::vector<std::unique_ptr<DeviceContext>> devices_;  // by ordinal
};

}  // namespace ctxpool

#endif  // CTXPOOL_CONTEXT_RUNTIME_H_
