#include "ctxpool/options.h"

#include <array>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace ctxpool {
namespace {

// The table. Keep it in OptionId order; options_test checks that it is.
constexpr std::array<OptionSpec, kOptionCount> kOptions = {{
    {OptionId::kDriver, "driver", "CTXPOOL_DRIVER", OptionKind::kString, "auto",
     "Driver for Runtime::Create: 'auto' (the CUDA driver when a driver and "
     "a device are present, else the simulated GPU), 'cuda', or a SimDriver "
     "spec such as 'sim', 'sim:h100-80gb', 'sim:2xa10-24gb', 'sim:24GiB'."},
    {OptionId::kDevices, "devices", "CTXPOOL_DEVICES", OptionKind::kString, "",
     "Device ordinals to open, comma separated ('0,2'); empty: all."},
    {OptionId::kBacking, "backing", "CTXPOOL_BACKING", OptionKind::kString,
     "auto",
     "How the device allocator gets memory: 'classic' (one cuMemAlloc per "
     "segment), 'expandable' (VMM: 2 MiB granules mapped on demand), or "
     "'auto' (expandable where the device supports VMM)."},
    {OptionId::kTrace, "trace", "CTXPOOL_TRACE", OptionKind::kBool, "false",
     "Record every allocation event in the trace ring buffer."},
    {OptionId::kTraceCapacity, "trace_capacity", "CTXPOOL_TRACE_CAPACITY",
     OptionKind::kInt, "65536", "Events the trace ring buffer keeps."},
    {OptionId::kSessionStreams, "session_streams", "CTXPOOL_SESSION_STREAMS",
     OptionKind::kInt, "1",
     "Streams a model session leases when SessionOptions does not say."},
    {OptionId::kSessionMinBytes, "session_min_bytes",
     "CTXPOOL_SESSION_MIN_BYTES", OptionKind::kBytes, "0",
     "Default budget 'min' of a session: memory protected from reclaim."},
    {OptionId::kSessionHighBytes, "session_high_bytes",
     "CTXPOOL_SESSION_HIGH_BYTES", OptionKind::kBytes, "0",
     "Default budget 'high' of a session: above it frees give memory back "
     "instead of caching it. 0: no limit."},
    {OptionId::kSessionMaxBytes, "session_max_bytes",
     "CTXPOOL_SESSION_MAX_BYTES", OptionKind::kBytes, "0",
     "Default budget 'max' of a session: allocations beyond it fail with "
     "RESOURCE_EXHAUSTED naming the model. 0: no limit."},
    {OptionId::kSessionTimes, "session_times", "CTXPOOL_SESSION_TIMES",
     OptionKind::kBool, "false",
     "Stamp every session allocation with its time, so that leak reports and "
     "LiveAllocations give ages (one coarse clock read per allocation, ~4 "
     "ns), when SessionOptions does not say."},
    {OptionId::kMaxSplitBytes, "max_split_bytes", "CTXPOOL_MAX_SPLIT_BYTES",
     OptionKind::kBytes, "0",
     "Free blocks larger than this are never split (PyTorch's "
     "max_split_size_mb). 0: no limit."},
    {OptionId::kMemoryLimit, "memory_limit", "CTXPOOL_MEMORY_LIMIT",
     OptionKind::kBytes, "0",
     "Device memory each device allocator may hold (like PyTorch's "
     "set_per_process_memory_fraction): growth beyond it first reclaims "
     "cached memory, then fails with RESOURCE_EXHAUSTED. 0: the device's "
     "capacity."},
    {OptionId::kSimCosts, "sim_costs", "CTXPOOL_SIM_COSTS", OptionKind::kString,
     "",
     "A JSON cost table (scripts/gpu-check writes one from a GPU) that "
     "SimDriver's realistic cost model loads over its built-in estimates."},
    {OptionId::kStreamPoolReserve, "stream_pool_reserve",
     "CTXPOOL_STREAM_POOL_RESERVE", OptionKind::kInt, "0",
     "Streams of each priority a device context creates up front; more are "
     "created on demand and all are reused across sessions."},
    {OptionId::kVerbose, "verbose", "CTXPOOL_VERBOSE", OptionKind::kBool,
     "false",
     "Print the driver choice and context reports to stderr at startup."},
    {OptionId::kHostBudget, "host_budget", "CTXPOOL_HOST_BUDGET",
     OptionKind::kString, "auto",
     "Pinned host bytes each device's host allocator may hold: a size, "
     "'unlimited', or 'auto' (half of the lower of the process's cgroup v2 "
     "memory.high and memory.max, shared by the devices opened; unlimited "
     "when neither is known)."},
    {OptionId::kCtxSched, "ctx_sched", "CTXPOOL_CTX_SCHED", OptionKind::kString,
     "",
     "Scheduling flag for the primary context, set before the first retain "
     "and read back: 'auto', 'spin', 'yield' or 'blocking_sync'; empty: "
     "leave the flags as they are. A driver that does not apply it is "
     "reported (context report, a warning, a counter)."},
    {OptionId::kSysfsRoot, "sysfs_root", "CTXPOOL_SYSFS_ROOT",
     OptionKind::kString, "",
     "A directory standing for / when reading /proc/self/cgroup and "
     "/sys/fs/cgroup (tests use a fake tree)."},
}};

struct OptionValues {
  absl::Mutex mu;
  bool loaded ABSL_GUARDED_BY(mu) = false;
  std::array<std::optional<std::string>, kOptionCount> env ABSL_GUARDED_BY(mu);
  std::array<std::optional<std::string>, kOptionCount> set ABSL_GUARDED_BY(mu);
};

OptionValues& Values() {
  static OptionValues* values = new OptionValues();
  return *values;
}

void LoadEnvironmentLocked(OptionValues& v)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(v.mu) {
  if (v.loaded) return;
  for (const OptionSpec& spec : kOptions) {
    const char* text = std::getenv(std::string(spec.env).c_str());
    if (text != nullptr) {
      v.env[static_cast<int>(spec.id)] = std::string(text);
    } else {
      v.env[static_cast<int>(spec.id)].reset();
    }
  }
  v.loaded = true;
}

absl::Status CheckParses(const OptionSpec& spec, absl::string_view value) {
  switch (spec.kind) {
    case OptionKind::kString:
      return absl::OkStatus();
    case OptionKind::kBool:
      return ParseBool(value).status();
    case OptionKind::kInt: {
      std::int64_t n = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(value), &n)) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(
          absl::StrCat("'", value, "' is not an integer"));
    }
    case OptionKind::kBytes:
      return ParseBytes(value).status();
  }
  return absl::OkStatus();
}

absl::Status NameVariable(const OptionSpec& spec, const absl::Status& s) {
  return absl::InvalidArgumentError(
      absl::StrCat(spec.env, ": ", s.message(), " (", spec.description, ")"));
}

}  // namespace

absl::Span<const OptionSpec> AllOptions() { return kOptions; }

const OptionSpec& GetOptionSpec(OptionId id) {
  return kOptions[static_cast<int>(id)];
}

absl::StatusOr<OptionId> FindOption(absl::string_view name_or_env) {
  for (const OptionSpec& spec : kOptions) {
    if (spec.name == name_or_env || spec.env == name_or_env) return spec.id;
  }
  return absl::NotFoundError(
      absl::StrCat("no ctxpool option named '", name_or_env, "'"));
}

std::string GetOption(OptionId id) {
  OptionValues& v = Values();
  absl::MutexLock lock(&v.mu);
  LoadEnvironmentLocked(v);
  const int i = static_cast<int>(id);
  if (v.set[i].has_value()) return *v.set[i];
  if (v.env[i].has_value()) return *v.env[i];
  return std::string(kOptions[i].default_value);
}

bool IsOptionOverridden(OptionId id) {
  OptionValues& v = Values();
  absl::MutexLock lock(&v.mu);
  LoadEnvironmentLocked(v);
  const int i = static_cast<int>(id);
  return v.set[i].has_value() || v.env[i].has_value();
}

absl::StatusOr<bool> GetOptionBool(OptionId id) {
  const OptionSpec& spec = GetOptionSpec(id);
  absl::StatusOr<bool> b = ParseBool(GetOption(id));
  if (!b.ok()) return NameVariable(spec, b.status());
  return *b;
}

absl::StatusOr<std::int64_t> GetOptionInt(OptionId id) {
  const OptionSpec& spec = GetOptionSpec(id);
  const std::string text = GetOption(id);
  std::int64_t n = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &n)) {
    return NameVariable(spec, absl::InvalidArgumentError(absl::StrCat(
                                  "'", text, "' is not an integer")));
  }
  return n;
}

absl::StatusOr<std::size_t> GetOptionBytes(OptionId id) {
  const OptionSpec& spec = GetOptionSpec(id);
  absl::StatusOr<std::size_t> n = ParseBytes(GetOption(id));
  if (!n.ok()) return NameVariable(spec, n.status());
  return *n;
}

absl::Status SetOption(OptionId id, absl::string_view value) {
  const OptionSpec& spec = GetOptionSpec(id);
  absl::Status parses = CheckParses(spec, value);
  if (!parses.ok()) return NameVariable(spec, parses);
  OptionValues& v = Values();
  absl::MutexLock lock(&v.mu);
  v.set[static_cast<int>(id)] = std::string(value);
  return absl::OkStatus();
}

void ReloadOptions() {
  OptionValues& v = Values();
  absl::MutexLock lock(&v.mu);
  for (auto& s : v.set) s.reset();
  v.loaded = false;
  LoadEnvironmentLocked(v);
}

std::string DescribeOptions() {
  std::string out;
  for (const OptionSpec& spec : kOptions) {
    const bool overridden = IsOptionOverridden(spec.id);
    absl::StrAppendFormat(
        &out, "%-28s = %-20s (default '%s')\n    %s\n", spec.env,
        absl::StrCat("'", GetOption(spec.id), "'", overridden ? " [set]" : ""),
        spec.default_value, spec.description);
  }
  return out;
}

absl::StatusOr<std::size_t> ParseBytes(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  std::size_t digits = 0;
  while (digits < t.size() &&
         (absl::ascii_isdigit(static_cast<unsigned char>(t[digits])) ||
          t[digits] == '.')) {
    ++digits;
  }
  absl::string_view number = t.substr(0, digits);
  const std::string unit =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(digits)));
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a byte count (e.g. 4096, 512KiB, 1.5GiB, 8G)"));
  };
  if (number.empty()) return bad();
  int shift = 0;
  if (unit.empty() || unit == "b") {
    shift = 0;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    shift = 10;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    shift = 20;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    shift = 30;
  } else if (unit == "t" || unit == "tb" || unit == "tib") {
    shift = 40;
  } else {
    return bad();
  }
  if (number.find('.') == absl::string_view::npos) {
    std::uint64_t n = 0;
    if (!absl::SimpleAtoi(number, &n)) return bad();
    if (shift > 0 && n > (~std::uint64_t{0} >> shift)) return bad();
    return static_cast<std::size_t>(n << shift);
  }
  double d = 0;
  if (!absl::SimpleAtod(number, &d) || !std::isfinite(d) || d < 0) {
    return bad();
  }
  const double bytes = std::ldexp(d, shift);
  if (bytes >= 9.0e18) return bad();
  return static_cast<std::size_t>(std::llround(bytes));
}

absl::StatusOr<bool> ParseBool(absl::string_view text) {
  const std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (t == "1" || t == "true" || t == "on" || t == "yes") return true;
  if (t == "0" || t == "false" || t == "off" || t == "no") {
    return false;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", text,
                   "' is not a boolean (1/0, true/false, on/off, "
                   "yes/no)"));
}

}  // namespace ctxpool
