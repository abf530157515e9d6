// hello_ctxpool — the smallest ctxpool program.
//
// It makes a simulated A10 (24 GB) with SimDriver, retains the device's
// primary context (the one context per device that ctxpool shares between
// models), allocates and frees 64 MiB through the Driver seam, and prints
// one line. Swap SimDriver::Create for CudaDriver::Load() and the same code
// runs on a real GPU.
//
//   $ ./hello_ctxpool
//   hello_ctxpool: <driver description>: context ... MiB, allocated and
//   freed 64 MiB at 0x... (... of ... MiB free meanwhile)
#include <cstdio>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"

namespace {

using ::ctxpool::ContextHandle;
using ::ctxpool::DevicePtr;
using ::ctxpool::kMiB;

double ToMiB(std::size_t bytes) { return static_cast<double>(bytes) / kMiB; }

absl::Status Hello() {
  CTXPOOL_ASSIGN_OR_RETURN(ctxpool::SimDeviceSpec a10,
                           ctxpool::SimDevicePreset("a10-24gb"));
  std::unique_ptr<ctxpool::SimDriver> sim =
      ctxpool::SimDriver::Create({.devices = {a10}});
  ctxpool::Driver& driver = *sim;  // what allocators and contexts take

  CTXPOOL_ASSIGN_OR_RETURN(ContextHandle ctx, driver.PrimaryCtxRetain(0));
  CTXPOOL_RETURN_IF_ERROR(driver.CtxSetCurrent(ctx));
  const std::size_t context_bytes = sim->context_bytes(0);

  constexpr std::size_t kBytes = 64 * kMiB;
  CTXPOOL_ASSIGN_OR_RETURN(DevicePtr ptr, driver.MemAlloc(kBytes));
  CTXPOOL_ASSIGN_OR_RETURN(ctxpool::MemInfo info, driver.MemGetInfo());
  CTXPOOL_RETURN_IF_ERROR(driver.MemFree(ptr));
  CTXPOOL_RETURN_IF_ERROR(driver.PrimaryCtxRelease(0));

  if (sim->misuse_count() != 0) {
    return absl::InternalError(
        absl::StrCat("the simulated driver counted ", sim->misuse_count(),
                     " misuses: ", sim->misuse_log().front()));
  }
  absl::PrintF(
      "hello_ctxpool: %s: context %.0f MiB, allocated and freed %.0f MiB at "
      "0x%x (%.0f of %.0f MiB free meanwhile)\n",
      driver.Describe(), ToMiB(context_bytes), ToMiB(kBytes), ptr.address(),
      ToMiB(info.free_bytes), ToMiB(info.total_bytes));
  return absl::OkStatus();
}

}  // namespace

int main() {
  absl::Status status = Hello();
  if (!status.ok()) {
    std::fprintf(stderr, "hello_ctxpool: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
