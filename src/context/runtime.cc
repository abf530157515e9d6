#include "ctxpool/context/runtime.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "ctxpool/core/cgroup.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

constexpr absl::string_view kFallbackSpec = "sim:h100-80gb";

absl::StatusOr<std::unique_ptr<Driver>> LoadSim(absl::string_view spec) {
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<SimDriver> sim,
                           SimDriver::CreateFromSpec(spec));
  return std::unique_ptr<Driver>(std::move(sim));
}

// Loads the driver `spec` names; `note` says which and why.
absl::StatusOr<std::unique_ptr<Driver>> ChooseDriver(absl::string_view spec,
                                                     std::string& note) {
  const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(spec));
  if (s == "auto" || s.empty()) {
    std::string why;
    absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
    if (cuda.ok()) {
      absl::StatusOr<int> count = (*cuda)->DeviceCount();
      if (count.ok() && *count > 0) {
        note = absl::StrCat("driver: cuda (", (*cuda)->Describe(), "), ",
                            *count, " device(s); chosen by 'auto'");
        return std::move(cuda).value();
      }
      why = count.ok() ? std::string("the CUDA driver reports no device")
                       : std::string(count.status().message());
    } else {
      why = std::string(cuda.status().message());
    }
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Driver> sim,
                             LoadSim(kFallbackSpec));
    note = absl::StrCat(
        "driver: sim (", sim->Describe(),
        "), chosen by 'auto' because no "
        "GPU is usable: ",
        why,
        ". Set CTXPOOL_DRIVER=cuda to require a GPU, or CTXPOOL_DRIVER=sim:"
        "<preset> to choose the simulated device.");
    return sim;
  }
  if (s == "cuda") {
    absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
    if (!cuda.ok()) {
      return absl::Status(
          cuda.status().code(),
          absl::StrCat("Runtime::Create: driver 'cuda' was requested: ",
                       cuda.status().message()));
    }
    note = absl::StrCat("driver: cuda (", (*cuda)->Describe(), "); requested");
    return std::move(cuda).value();
  }
  if (absl::StartsWith(s, "sim")) {
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Driver> sim, LoadSim(s));
    note = absl::StrCat("driver: sim (", sim->Describe(), "); requested as '",
                        s, "'");
    return sim;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "Runtime::Create: driver '", spec,
      "' is not 'auto', 'cuda' or a SimDriver spec ('sim', 'sim:h100-80gb', "
      "'sim:2xa10-24gb', 'sim:24GiB')"));
}

absl::StatusOr<std::vector<int>> ParseDevices(absl::string_view text) {
  std::vector<int> out;
  for (absl::string_view part :
       absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int d = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(part), &d) || d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("CTXPOOL_DEVICES: '", text,
                       "' is not a comma separated list of device ordinals"));
    }
    out.push_back(d);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(
    RuntimeOptions options) {
  const std::string spec =
      options.driver.empty() ? GetOption(OptionId::kDriver) : options.driver;
  std::string note;
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Driver> driver,
                           ChooseDriver(spec, note));
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt,
                           Create(std::move(driver), std::move(options)));
  rt->driver_note_ = std::move(note);
  return rt;
}

absl::StatusOr<std::unique_ptr<Runtime>> Runtime::Create(
    std::unique_ptr<Driver> driver, RuntimeOptions options) {
  if (driver == nullptr) {
    return absl::InvalidArgumentError("Runtime::Create: null driver");
  }
  CTXPOOL_ASSIGN_OR_RETURN(int count, driver->DeviceCount());
  if (count <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Runtime::Create: the ", driver->Kind(), " driver has no device"));
  }
  std::vector<int> devices = options.devices;
  if (devices.empty()) {
    CTXPOOL_ASSIGN_OR_RETURN(devices,
                             ParseDevices(GetOption(OptionId::kDevices)));
  }
  if (devices.empty()) {
    for (int d = 0; d < count; ++d) devices.push_back(d);
  }
  std::sort(devices.begin(), devices.end());
  if (std::adjacent_find(devices.begin(), devices.end()) != devices.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Runtime::Create: device list [",
                     absl::StrJoin(devices, ","), "] repeats a device"));
  }
  std::string note = absl::StrCat("driver: ", driver->Kind(), " (",
                                  driver->Describe(), "); given by caller");
  std::unique_ptr<Runtime> rt(new Runtime(std::move(driver), std::move(note)));
  DeviceContextOptions device_options = options.device_options;
  if (device_options.host_budget_devices == 0) {
    // The cgroup-derived pinned budget is shared by the devices opened.
    device_options.host_budget_devices = static_cast<int>(devices.size());
  }
  if (device_options.use_option_table) {
    CTXPOOL_ASSIGN_OR_RETURN(
        rt->host_budget_, DeriveHostBudget(device_options.host_budget_devices));
    // A known budget goes to every device from this one reading of the
    // cgroup (rather than one reading each, which could differ), unless
    // the caller set one; with none known each device looks again.
    if (device_options.host.host_budget_bytes == 0) {
      device_options.host.host_budget_bytes = rt->host_budget_.bytes;
      device_options.host.host_budget_source =
          rt->host_budget_.bytes == 0 ? "" : rt->host_budget_.source;
    }
  }
  for (int d : devices) {
    CTXPOOL_ASSIGN_OR_RETURN(
        std::unique_ptr<DeviceContext> dc,
        DeviceContext::Create(*rt->driver_, d, device_options));
    rt->devices_.push_back(std::move(dc));
  }
  return rt;
}

CgroupMemory Runtime::ReadCgroup() const {
  return ReadCgroupMemory(GetOption(OptionId::kSysfsRoot));
}

Runtime::Runtime(std::unique_ptr<Driver> driver, std::string note)
    : driver_(std::move(driver)), driver_note_(std::move(note)) {}

Runtime::~Runtime() {
  if (fork_guard_.InForkedChild()) {
    // The driver's state is the parent's: no driver call, leak it all.
    for (auto& dc : devices_) (void)dc.release();
    (void)driver_.release();
    return;
  }
  while (!devices_.empty()) devices_.pop_back();
  driver_.reset();
}

absl::StatusOr<DeviceContext*> Runtime::device(int ordinal) const {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("Runtime::device"));
  for (const auto& dc : devices_) {
    if (dc->device() == ordinal) return dc.get();
  }
  return absl::NotFoundError(absl::StrCat(
      "Runtime::device: device ", ordinal, " was not opened (", devices_.size(),
      " device(s) open; see RuntimeOptions::devices and CTXPOOL_DEVICES)"));
}

std::vector<DeviceContext*> Runtime::devices() const {
  std::vector<DeviceContext*> out;
  if (InForkedChild()) return out;
  for (const auto& dc : devices_) out.push_back(dc.get());
  return out;
}

}  // namespace ctxpool
