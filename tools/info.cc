// `ctxpool info [--json]`: what this build of ctxpool can use here.
//
// Lists the build (version, CUDA compiled in), the CUDA driver (loaded with
// its version, or why it is unavailable), the GPUs it sees and, when no GPU is
// usable, the simulated device ctxpool falls back to ($CTXPOOL_DRIVER, default
// "sim:h100-80gb") and the simulated presets. Exits 0 whenever it could report,
// 1 when the simulated fallback spec is invalid, 2 on a usage error.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/core/cgroup.h"
#include "ctxpool/core/json_string.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "tools/commands.h"

#ifndef CTXPOOL_VERSION
#define CTXPOOL_VERSION "unknown"
#endif

namespace ctxpool::tool {
namespace {

constexpr absl::string_view kDefaultSimSpec = "sim:h100-80gb";

struct DeviceInfo {
  int index = 0;
  std::string name;
  std::size_t total_bytes = 0;
  int cc_major = 0;
  int cc_minor = 0;
  int multiprocessors = 0;
  bool vmm = false;
  std::string error;  // non-empty when a query failed
};

struct BackendInfo {
  std::string kind;      // "cuda" or "sim"
  std::string describe;  // Driver::Describe()
  std::vector<DeviceInfo> devices;
  std::string error;  // non-empty when the device count failed
};

struct Info {
  bool cuda_compiled_in = false;
  absl::Status driver_status;  // CudaDriver::Load()
  std::optional<BackendInfo> cuda;
  std::string fallback_spec;     // empty when a GPU is usable
  absl::Status fallback_status;  // SimDriver::CreateFromSpec()
  std::optional<BackendInfo> sim;
  std::vector<std::string> presets;
  CgroupMemory cgroup;
  absl::StatusOr<DerivedHostBudget> host_budget;
  int devices = 1;  // of the driver ctxpool would use
};

BackendInfo Describe(Driver& driver) {
  BackendInfo info;
  info.kind = std::string(driver.Kind());
  info.describe = driver.Describe();
  absl::StatusOr<int> count = driver.DeviceCount();
  if (!count.ok()) {
    info.error = std::string(count.status().message());
    return info;
  }
  for (int d = 0; d < *count; ++d) {
    DeviceInfo dev;
    dev.index = d;
    absl::Status status;
    auto note = [&status](const absl::Status& s) {
      if (status.ok()) status = s;
    };
    if (auto v = driver.DeviceName(d); v.ok()) {
      dev.name = *v;
    } else {
      note(v.status());
    }
    if (auto v = driver.DeviceTotalMem(d); v.ok()) {
      dev.total_bytes = *v;
    } else {
      note(v.status());
    }
    auto attribute = [&](DeviceAttribute a) {
      absl::StatusOr<int> v = driver.DeviceGetAttribute(a, d);
      if (!v.ok()) {
        note(v.status());
        return 0;
      }
      return *v;
    };
    dev.cc_major = attribute(DeviceAttribute::kComputeCapabilityMajor);
    dev.cc_minor = attribute(DeviceAttribute::kComputeCapabilityMinor);
    dev.multiprocessors = attribute(DeviceAttribute::kMultiprocessorCount);
    dev.vmm =
        attribute(DeviceAttribute::kVirtualMemoryManagementSupported) != 0;
    if (!status.ok()) dev.error = std::string(status.message());
    info.devices.push_back(std::move(dev));
  }
  return info;
}

Info Gather() {
  Info info;
  info.cuda_compiled_in = CudaDriver::CompiledIn();
  absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
  info.driver_status = cuda.status();
  bool gpu_usable = false;
  if (cuda.ok()) {
    info.cuda = Describe(**cuda);
    gpu_usable = info.cuda->error.empty() && !info.cuda->devices.empty();
  }
  if (!gpu_usable) {
    const char* env = std::getenv("CTXPOOL_DRIVER");
    info.fallback_spec = env != nullptr && absl::StartsWith(env, "sim")
                             ? std::string(env)
                             : std::string(kDefaultSimSpec);
    absl::StatusOr<std::unique_ptr<SimDriver>> sim =
        SimDriver::CreateFromSpec(info.fallback_spec);
    info.fallback_status = sim.status();
    if (sim.ok()) info.sim = Describe(**sim);
  }
  info.presets = SimDevicePresetNames();
  const BackendInfo* used = gpu_usable             ? &*info.cuda
                            : info.sim.has_value() ? &*info.sim
                                                   : nullptr;
  if (used != nullptr && !used->devices.empty()) {
    info.devices = static_cast<int>(used->devices.size());
  }
  info.cgroup = ReadCgroupMemory(GetOption(OptionId::kSysfsRoot));
  info.host_budget = DeriveHostBudget(info.devices);
  return info;
}

std::string Gib(std::size_t bytes) {
  return absl::StrFormat(
      "%.1f GiB", static_cast<double>(bytes) / static_cast<double>(1ull << 30));
}

void PrintDevices(const BackendInfo& backend, absl::string_view prefix) {
  if (!backend.error.empty()) {
    std::printf("  device count failed: %s\n", backend.error.c_str());
    return;
  }
  for (const DeviceInfo& d : backend.devices) {
    std::printf("  %s%d: %s, %s (%zu bytes), compute %d.%d, %d SMs, VMM %s\n",
                std::string(prefix).c_str(), d.index, d.name.c_str(),
                Gib(d.total_bytes).c_str(), d.total_bytes, d.cc_major,
                d.cc_minor, d.multiprocessors, d.vmm ? "yes" : "no");
    if (!d.error.empty())
      std::printf("    query failed: %s\n", d.error.c_str());
  }
}

void PrintText(const Info& info) {
  std::printf("ctxpool %s (CUDA %s)\n", CTXPOOL_VERSION,
              info.cuda_compiled_in ? "compiled in" : "not compiled in");
  if (info.cuda.has_value()) {
    std::printf("driver: %s\n", info.cuda->describe.c_str());
    std::printf("devices: %zu\n", info.cuda->devices.size());
    PrintDevices(*info.cuda, "cuda:");
  } else {
    std::printf("driver: unavailable: %s\n",
                std::string(info.driver_status.message()).c_str());
    std::printf("devices: none\n");
  }
  if (!info.fallback_spec.empty()) {
    std::printf(
        "no GPU is usable: falling back to the simulated device \"%s\" "
        "(set CTXPOOL_DRIVER to change it)\n",
        info.fallback_spec.c_str());
    if (info.sim.has_value()) {
      std::printf("simulated: %s\n", info.sim->describe.c_str());
      PrintDevices(*info.sim, "sim:");
    } else {
      std::printf("simulated device unavailable: %s\n",
                  info.fallback_status.ToString().c_str());
    }
  }
  std::printf("simulated presets: %s\n",
              absl::StrJoin(info.presets, ", ").c_str());
  std::printf("%s\n", info.cgroup.ToString().c_str());
  if (info.host_budget.ok()) {
    if (info.host_budget->bytes == 0) {
      std::printf("pinned host budget: unlimited (%s)\n",
                  info.host_budget->source.c_str());
    } else {
      const std::size_t b = info.host_budget->bytes;
      const std::string amount = b >= (std::size_t{1} << 20)
                                     ? absl::StrCat(b >> 20, " MiB")
                                     : absl::StrCat(b, " B");
      std::printf("pinned host budget: %s per device (%s)\n", amount.c_str(),
                  info.host_budget->source.c_str());
    }
  } else {
    std::printf("pinned host budget: %s\n",
                std::string(info.host_budget.status().message()).c_str());
  }
}

std::string BackendJson(const BackendInfo& backend) {
  std::vector<std::string> devices;
  for (const DeviceInfo& d : backend.devices) {
    devices.push_back(absl::StrCat(
        "{\"index\": ", d.index, ", \"name\": ", JsonString(d.name),
        ", \"total_bytes\": ", d.total_bytes, ", \"compute_capability\": \"",
        d.cc_major, ".", d.cc_minor, "\", \"multiprocessors\": ",
        d.multiprocessors, ", \"vmm\": ", d.vmm ? "true" : "false",
        d.error.empty() ? ""
                        : absl::StrCat(", \"error\": ", JsonString(d.error)),
        "}"));
  }
  return absl::StrCat(
      "{\"kind\": ", JsonString(backend.kind),
      ", \"describe\": ", JsonString(backend.describe),
      backend.error.empty()
          ? ""
          : absl::StrCat(", \"error\": ", JsonString(backend.error)),
      ", \"devices\": [", absl::StrJoin(devices, ", "), "]}");
}

void PrintJson(const Info& info) {
  std::string out = absl::StrCat(
      "{\n  \"version\": ", JsonString(CTXPOOL_VERSION),
      ",\n  \"cuda_compiled_in\": ", info.cuda_compiled_in ? "true" : "false",
      ",\n  \"driver\": {\"status\": ",
      JsonString(absl::StatusCodeToString(info.driver_status.code())),
      ", \"message\": ", JsonString(info.driver_status.message()), "}");
  absl::StrAppend(&out, ",\n  \"cuda\": ",
                  info.cuda.has_value() ? BackendJson(*info.cuda) : "null");
  absl::StrAppend(&out, ",\n  \"gpu_usable\": ",
                  info.fallback_spec.empty() ? "true" : "false");
  if (info.fallback_spec.empty()) {
    absl::StrAppend(&out, ",\n  \"fallback\": null");
  } else {
    absl::StrAppend(
        &out, ",\n  \"fallback\": {\"spec\": ", JsonString(info.fallback_spec),
        ", \"status\": ",
        JsonString(absl::StatusCodeToString(info.fallback_status.code())),
        ", \"message\": ", JsonString(info.fallback_status.message()),
        ", \"driver\": ",
        info.sim.has_value() ? BackendJson(*info.sim) : "null", "}");
  }
  std::vector<std::string> presets;
  for (const std::string& p : info.presets) presets.push_back(JsonString(p));
  absl::StrAppend(&out, ",\n  \"presets\": [", absl::StrJoin(presets, ", "),
                  "]");
  const CgroupMemory& cg = info.cgroup;
  auto opt = [](const std::optional<std::uint64_t>& v) {
    if (!v.has_value()) return std::string("null");
    return *v == kCgroupNoLimit ? std::string("\"max\"") : absl::StrCat(*v);
  };
  absl::StrAppend(&out, ",\n  \"cgroup\": {\"version\": ", cg.version,
                  ", \"path\": ", JsonString(cg.path),
                  ", \"memory_max\": ", opt(cg.effective_max),
                  ", \"memory_high\": ", opt(cg.effective_high),
                  ", \"memory_current\": ", opt(cg.current),
                  ", \"reclaimable\": ", opt(cg.reclaimable),
                  ", \"note\": ", JsonString(cg.note), "}");
  if (info.host_budget.ok()) {
    absl::StrAppend(&out, ",\n  \"host_budget\": {\"bytes_per_device\": ",
                    info.host_budget->bytes,
                    ", \"source\": ", JsonString(info.host_budget->source),
                    "}");
  } else {
    absl::StrAppend(&out, ",\n  \"host_budget\": {\"error\": ",
                    JsonString(info.host_budget.status().message()), "}");
  }
  absl::StrAppend(&out, "\n}\n");
  std::fputs(out.c_str(), stdout);
}

void PrintInfoUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: ctxpool info [--json]\n\n"
               "Shows the build, the CUDA driver and the GPUs it sees; when "
               "no GPU is usable,\nthe simulated device ctxpool falls back to "
               "($CTXPOOL_DRIVER, default %s)\nand the simulated presets.\n",
               std::string(kDefaultSimSpec).c_str());
}

}  // namespace

int RunInfo(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "--help") == 0 ||
               std::strcmp(argv[i], "-h") == 0) {
      PrintInfoUsage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "ctxpool info: unknown argument '%s'\n\n", argv[i]);
      PrintInfoUsage(stderr);
      return 2;
    }
  }
  Info info = Gather();
  if (json) {
    PrintJson(info);
  } else {
    PrintText(info);
  }
  return info.fallback_spec.empty() || info.sim.has_value() ? 0 : 1;
}

}  // namespace ctxpool::tool
