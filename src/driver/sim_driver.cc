// SimDriver: the simulated GPU. See include/ctxpool/driver/sim_driver.h.
//
// Everything lives in State, behind one absl::Mutex. Streams are FIFOs of
// operations; an operation completes when its stream is not held (or is
// being advanced) and the operations it depends on (a waited event, a legacy
// default stream barrier) are complete. Because only a Hold keeps work
// pending, completion is eager: an operation enqueued on an idle, unheld
// stream completes inside the call, and only Advance/Release can unblock
// queued work (they pump every stream with pending work).
//
// Address space: device addresses come from one bump pointer per SimDriver
// starting at 2^52 (far from any host address); they are never reused within
// one SimDriver, so a stale pointer is always detected. Handles are
// deterministic counters with a distinct base per kind.
#include "ctxpool/driver/sim_driver.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/btree_set.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/driver/internal/sim_race_detector.h"
#include "ctxpool/driver/sim_costs.h"
#include "ctxpool/options.h"
#include "sim_driver_state.h"

namespace ctxpool {
namespace {

SimDeviceSpec MakeSpec(absl::string_view name, std::size_t gib, int major,
                       int minor, int sms, std::size_t overhead_mib) {
  SimDeviceSpec spec;
  spec.name = std::string(name);
  spec.capacity_bytes = gib * kGiB;
  spec.compute_capability_major = major;
  spec.compute_capability_minor = minor;
  spec.multiprocessor_count = sms;
  spec.context_overhead_bytes = overhead_mib * kMiB;
  return spec;
}

struct Preset {
  const char* key;
  SimDeviceSpec spec;
};

const std::vector<Preset>& Presets() {
  static const auto* presets = new std::vector<Preset>{
      {"h100-80gb", MakeSpec("NVIDIA H100 80GB HBM3", 80, 9, 0, 132, 500)},
      {"h200-141gb", MakeSpec("NVIDIA H200", 141, 9, 0, 132, 500)},
      {"a100-80gb", MakeSpec("NVIDIA A100-SXM4-80GB", 80, 8, 0, 108, 400)},
      {"a100-40gb", MakeSpec("NVIDIA A100-SXM4-40GB", 40, 8, 0, 108, 400)},
      {"a10-24gb", MakeSpec("NVIDIA A10", 24, 8, 6, 72, 300)},
      {"l4-24gb", MakeSpec("NVIDIA L4", 24, 8, 9, 58, 300)},
      {"t4-16gb", MakeSpec("Tesla T4", 16, 7, 5, 40, 300)},
      {"v100-32gb", MakeSpec("Tesla V100-SXM2-32GB", 32, 7, 0, 80, 300)},
      {"rtx4090-24gb", MakeSpec("NVIDIA GeForce RTX 4090", 24, 8, 9, 128, 300)},
  };
  return *presets;
}

// Parses "24GiB", "24GB" (10^9), "512MiB", "512MB", "1TiB"; bytes otherwise.
std::optional<std::size_t> ParseCapacity(absl::string_view text) {
  struct Unit {
    const char* suffix;
    double scale;
  };
  static constexpr Unit kUnits[] = {
      {"tib", 1099511627776.0},
      {"gib", 1073741824.0},
      {"mib", 1048576.0},
      {"kib", 1024.0},
      {"tb", 1e12},
      {"gb", 1e9},
      {"mb", 1e6},
      {"kb", 1e3},
      {"b", 1.0},
  };
  for (const Unit& unit : kUnits) {
    if (!absl::EndsWith(text, unit.suffix)) continue;
    absl::string_view number =
        text.substr(0, text.size() - strlen(unit.suffix));
    double value = 0;
    if (number.empty() || !absl::SimpleAtod(number, &value) || !(value > 0) ||
        value > 1e15) {
      return std::nullopt;
    }
    // The product may exceed size_t (844373354775820mb); such a capacity is
    // refused, not converted (undefined behaviour).
    const double bytes = value * unit.scale;
    if (!(bytes < 18446744073709551616.0)) return std::nullopt;
    return static_cast<std::size_t>(bytes);
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<SimDeviceSpec> SimDevicePreset(absl::string_view name) {
  const std::string key = absl::AsciiStrToLower(name);
  for (const Preset& preset : Presets()) {
    if (key == preset.key) return preset.spec;
  }
  return absl::NotFoundError(absl::StrCat(
      "unknown simulated device preset '", name,
      "'; known presets: ", absl::StrJoin(SimDevicePresetNames(), ", ")));
}

std::vector<std::string> SimDevicePresetNames() {
  std::vector<std::string> names;
  for (const Preset& preset : Presets()) names.emplace_back(preset.key);
  return names;
}

absl::string_view SimCallName(SimCall call) {
  static constexpr absl::string_view kNames[kSimCallCount] = {
      "cuMemAlloc",
      "cuMemFree",
      "cuMemCreate",
      "cuMemRelease",
      "cuMemMap",
      "cuMemUnmap",
      "cuMemSetAccess",
      "cuMemAddressReserve",
      "cuMemAddressFree",
      "cuMemHostAlloc",
      "cuMemFreeHost",
      "cuMemHostRegister",
      "cuMemHostUnregister",
      "cuStreamCreateWithPriority",
      "cuStreamDestroy",
      "cuStreamQuery",
      "cuStreamSynchronize",
      "cuStreamWaitEvent",
      "cuLaunchHostFunc",
      "cuEventCreate",
      "cuEventDestroy",
      "cuEventRecord",
      "cuEventQuery",
      "cuEventSynchronize",
      "cuDevicePrimaryCtxRetain",
      "cuDevicePrimaryCtxRelease",
      "cuCtxCreate",
      "cuCtxDestroy",
      "cuCtxSynchronize",
      "cuMemsetD8Async",
      "cuMemcpyAsync",
  };
  const int i = static_cast<int>(call);
  if (i < 0 || i >= kSimCallCount) return "unknown";
  return kNames[i];
}

// ---------------------------------------------------------------------------
// Construction

SimDriver::SimDriver(SimOptions options)
    : state_(std::make_unique<State>(std::move(options))) {}

SimDriver::~SimDriver() = default;

std::unique_ptr<SimDriver> SimDriver::Create(SimOptions options) {
  return std::unique_ptr<SimDriver>(new SimDriver(std::move(options)));
}

absl::StatusOr<std::unique_ptr<SimDriver>> SimDriver::CreateFromSpec(
    absl::string_view spec) {
  const std::string lower =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(spec));
  absl::string_view rest = lower;
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad simulated driver spec '", spec, "': ", why,
        "; expected 'sim', 'sim:<preset>', 'sim:<N>x<preset>' or "
        "'sim:<capacity>' (e.g. 24GiB, 24GB = 24e9 bytes); presets: ",
        absl::StrJoin(SimDevicePresetNames(), ", ")));
  };
  if (rest == "sim") return Create();
  if (!absl::ConsumePrefix(&rest, "sim:") || rest.empty()) {
    return bad("it does not start with 'sim'");
  }
  int count = 1;
  const std::size_t x = rest.find('x');
  if (x != absl::string_view::npos && x > 0) {
    int n = 0;
    if (absl::SimpleAtoi(rest.substr(0, x), &n)) {
      if (n < 1 || n > 64) return bad("the device count must be 1..64");
      count = n;
      rest.remove_prefix(x + 1);
    }
  }
  SimDeviceSpec device;
  absl::StatusOr<SimDeviceSpec> preset = SimDevicePreset(rest);
  if (preset.ok()) {
    device = *preset;
  } else if (std::optional<std::size_t> capacity = ParseCapacity(rest)) {
    if (*capacity > kSimMaxCapacityBytes) {
      return bad(absl::StrCat("'", rest,
                              "' is more than the largest simulated device (",
                              kSimMaxCapacityBytes >> 40, " TiB)"));
    }
    if (*capacity < 2 * device.context_overhead_bytes) {
      device.context_overhead_bytes = *capacity / 8;
    }
    device.capacity_bytes = *capacity;
    device.name = absl::StrCat("ctxpool simulated GPU (", rest, ")");
  } else {
    return bad(absl::StrCat("'", rest, "' is neither a preset nor a capacity"));
  }
  SimOptions options;
  options.devices.assign(count, device);
  return Create(std::move(options));
}

// Runs completed host funcs in completion order, one thread at a time, with
// the mutex released (a host func may call back into the driver).
void SimDriver::RunHostFuncs() {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    const CallScope scope;
    if (s.callbacks_running || s.callbacks.empty()) return;
    s.callbacks_running = true;
  }
  for (;;) {
    std::pair<HostFn, void*> callback;
    {
      absl::MutexLock lock(&s.mu);
      const CallScope scope;
      if (s.callbacks.empty()) {
        s.callbacks_running = false;
        return;
      }
      callback = s.callbacks.front();
      s.callbacks.pop_front();
    }
    callback.first(callback.second);
  }
}

// ---------------------------------------------------------------------------
// Stream clock

void SimDriver::Hold(StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  absl::StatusOr<std::uint32_t> index = s.ResolveStream("Hold", stream, true);
  if (index.ok()) s.streams[*index].held = true;
}

std::size_t SimDriver::Advance(StreamHandle stream, std::size_t ops) {
  State& s = *state_;
  std::size_t done = 0;
  {
    absl::MutexLock lock(&s.mu);
    const CallScope scope;
    absl::StatusOr<std::uint32_t> index =
        s.ResolveStream("Advance", stream, true);
    if (!index.ok()) return 0;
    done = s.Drain(*index, ops, /*force=*/true);
    s.Pump();
  }
  RunHostFuncs();
  return done;
}

void SimDriver::Release(StreamHandle stream) {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    const CallScope scope;
    absl::StatusOr<std::uint32_t> index =
        s.ResolveStream("Release", stream, true);
    if (!index.ok()) return;
    s.streams[*index].held = false;
    s.Pump();
  }
  RunHostFuncs();
}

std::size_t SimDriver::PendingOps(StreamHandle stream) const {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  absl::StatusOr<std::uint32_t> index =
      s.ResolveStream("PendingOps", stream, true);
  if (!index.ok()) return 0;
  return s.streams[*index].queue.size();
}

// ---------------------------------------------------------------------------
// Work and the race detector

absl::Status SimDriver::Touch(StreamHandle stream, DevicePtr ptr,
                              std::size_t bytes) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Current("Touch").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("Touch", stream, false));
  if (bytes == 0) return absl::OkStatus();
  const std::uint64_t lo = ptr.address();
  const std::uint64_t hi = lo + bytes;
  std::string why;
  if (hi < lo || !s.Accessible(lo, hi, &why)) {
    return s.Misuse("Touch", cu::kErrorIllegalAddress, why);
  }
  s.EnqueueWork(index, lo, hi);
  return absl::OkStatus();
}

std::vector<SimRace> SimDriver::Races() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->races;
}

std::uint64_t SimDriver::race_count() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->race_count;
}

void SimDriver::SetRaceDetection(bool enabled) {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  state_->race_detection = enabled;
}

void SimDriver::SetIgnorePrimaryCtxFlags(bool ignore) {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  state_->ignore_primary_flags = ignore;
}

// ---------------------------------------------------------------------------
// Misuse, faults, costs, counters

std::uint64_t SimDriver::misuse_count() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->misuse_count;
}

std::vector<std::string> SimDriver::misuse_log() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return {state_->misuse_log.begin(), state_->misuse_log.end()};
}

void SimDriver::InjectFault(SimCall call, int count, int cuda_error) {
  const int i = static_cast<int>(call);
  if (i < 0 || i >= kSimCallCount) return;
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  state_->faults[i] = {std::max(count, 0), cuda_error};
}

void SimDriver::SetCost(SimCall call, std::int64_t nanoseconds) {
  const int i = static_cast<int>(call);
  if (i < 0 || i >= kSimCallCount) return;
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  state_->costs[i] = nanoseconds;
}

void SimDriver::SetWorkCost(std::int64_t nanoseconds) {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  state_->work_cost = nanoseconds;
}

absl::Status SimDriver::UseRealisticCosts() {
  SimCostTable table = RealisticSimCosts();
  absl::Status status;
  const std::string path = GetOption(OptionId::kSimCosts);
  if (!path.empty()) {
    absl::StatusOr<SimCostTable> loaded = LoadSimCostTable(path, table);
    if (loaded.ok()) {
      table = *loaded;
    } else {
      status = loaded.status();
    }
  }
  SetCostTable(table);
  return status;
}

void SimDriver::SetCostTable(const SimCostTable& table) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  for (int i = 0; i < kSimCallCount; ++i) {
    s.costs[i] = table.calls[i].ns;
    s.costs_per_mib[i] = table.calls[i].ns_per_mib;
  }
  s.work_cost = table.work_ns;
  s.context_create_cost = table.context_create_ns;
}

std::int64_t SimDriver::simulated_time_ns() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->simulated_ns;
}

std::int64_t SimDriver::thread_simulated_time_ns() { return t_simulated_ns; }
bool SimDriver::InCall() { return sim_internal::t_call_depth > 0; }

std::uint64_t SimDriver::call_count(SimCall call) const {
  const int i = static_cast<int>(call);
  if (i < 0 || i >= kSimCallCount) return 0;
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->calls[i];
}

std::array<std::uint64_t, kSimCallCount> SimDriver::call_counts() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->calls;
}

std::uint64_t SimDriver::total_call_count() const {
  std::uint64_t n = 0;
  for (std::uint64_t c : call_counts()) n += c;
  return n;
}

std::size_t SimDriver::used_bytes(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  if (device < 0 || device >= static_cast<int>(state_->devices.size()))
    return 0;
  return state_->devices[device].used;
}

std::size_t SimDriver::host_bytes() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  std::size_t n = 0;
  for (const auto& [address, range] : state_->host_ranges) n += range.bytes;
  return n;
}

std::size_t SimDriver::peak_used_bytes(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  if (device < 0 || device >= static_cast<int>(state_->devices.size()))
    return 0;
  return state_->devices[device].peak;
}

int SimDriver::primary_ctx_refcount(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  if (device < 0 || device >= static_cast<int>(state_->devices.size()))
    return 0;
  return state_->devices[device].primary_refcount;
}

int SimDriver::contexts_created(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  if (device < 0 || device >= static_cast<int>(state_->devices.size()))
    return 0;
  return state_->devices[device].contexts_created;
}

std::size_t SimDriver::context_bytes(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  if (device < 0 || device >= static_cast<int>(state_->devices.size()))
    return 0;
  return state_->devices[device].context_bytes;
}

const SimDeviceSpec& SimDriver::device_spec(int device) const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  // Specs never change after construction, so the reference stays valid.
  return state_->devices[device].spec;
}

absl::Status SimDriver::CheckInvariants() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return state_->CheckInvariants();
}

// ---------------------------------------------------------------------------
// Devices

absl::string_view SimDriver::Kind() const { return "sim"; }

std::string SimDriver::Describe() const {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  std::vector<std::string> parts;
  for (const State::Device& d : state_->devices) {
    parts.push_back(absl::StrFormat("%s (%.1f GiB)", d.spec.name,
                                    static_cast<double>(d.spec.capacity_bytes) /
                                        static_cast<double>(kGiB)));
  }
  return absl::StrCat("SimDriver: ", parts.size(),
                      " simulated device(s): ", absl::StrJoin(parts, ", "));
}

absl::StatusOr<int> SimDriver::DeviceCount() {
  absl::MutexLock lock(&state_->mu);
  const CallScope scope;
  return static_cast<int>(state_->devices.size());
}

absl::StatusOr<std::string> SimDriver::DeviceName(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDeviceGetName", device));
  return s.devices[device].spec.name;
}

absl::StatusOr<std::size_t> SimDriver::DeviceTotalMem(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDeviceTotalMem", device));
  return s.devices[device].spec.capacity_bytes;
}

absl::StatusOr<int> SimDriver::DeviceGetAttribute(DeviceAttribute attribute,
                                                  int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDeviceGetAttribute", device));
  const SimDeviceSpec& spec = s.devices[device].spec;
  switch (attribute) {
    case DeviceAttribute::kComputeCapabilityMajor:
      return spec.compute_capability_major;
    case DeviceAttribute::kComputeCapabilityMinor:
      return spec.compute_capability_minor;
    case DeviceAttribute::kMultiprocessorCount:
      return spec.multiprocessor_count;
    case DeviceAttribute::kVirtualMemoryManagementSupported:
      return spec.vmm_supported ? 1 : 0;
    case DeviceAttribute::kMemoryPoolsSupported:
    case DeviceAttribute::kUnifiedAddressing:
    case DeviceAttribute::kCanMapHostMemory:
      return 1;
    case DeviceAttribute::kIntegrated:
      return 0;
    case DeviceAttribute::kPciBusId:
      return 0x10 + device;
  }
  return s.Misuse("cuDeviceGetAttribute", cu::kErrorInvalidValue,
                  "unknown attribute");
}

// ---------------------------------------------------------------------------
// Contexts

absl::StatusOr<ContextHandle> SimDriver::PrimaryCtxRetain(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kPrimaryCtxRetain));
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDevicePrimaryCtxRetain", device));
  State::Device& d = s.devices[device];
  State::Context& ctx = s.contexts.at(d.primary_ctx);
  if (d.primary_refcount == 0) {
    if (!s.Fits(d, d.spec.context_overhead_bytes)) {
      return s.OutOfMemory("cuDevicePrimaryCtxRetain", d,
                           d.spec.context_overhead_bytes);
    }
    s.ActivateContext(ctx);
  }
  ++d.primary_refcount;
  return ctx.handle;
}

absl::Status SimDriver::PrimaryCtxRelease(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kPrimaryCtxRelease));
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDevicePrimaryCtxRelease", device));
  State::Device& d = s.devices[device];
  if (d.primary_refcount == 0) {
    return s.Misuse("cuDevicePrimaryCtxRelease", cu::kErrorInvalidContext,
                    "the primary context is not retained");
  }
  if (--d.primary_refcount == 0)
    s.DeactivateContext(s.contexts.at(d.primary_ctx));
  return absl::OkStatus();
}

absl::Status SimDriver::PrimaryCtxSetFlags(int device, unsigned flags) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDevicePrimaryCtxSetFlags", device));
  if (!s.ignore_primary_flags) s.devices[device].primary_flags = flags;
  return absl::OkStatus();
}

absl::StatusOr<PrimaryContextState> SimDriver::PrimaryCtxGetState(int device) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuDevicePrimaryCtxGetState", device));
  PrimaryContextState state;
  state.flags = s.devices[device].primary_flags;
  state.active = s.devices[device].primary_refcount > 0;
  return state;
}

absl::StatusOr<ContextHandle> SimDriver::CtxCreate(int device, unsigned flags) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kCtxCreate));
  CTXPOOL_RETURN_IF_ERROR(s.CheckDevice("cuCtxCreate", device));
  State::Device& d = s.devices[device];
  if (!s.Fits(d, d.spec.context_overhead_bytes)) {
    return s.OutOfMemory("cuCtxCreate", d, d.spec.context_overhead_bytes);
  }
  const std::uint64_t handle = s.NextHandle(kContextBase);
  State::Context ctx;
  ctx.handle = ContextHandle(handle);
  ctx.device = device;
  State::Context& inserted =
      s.contexts.emplace(handle, std::move(ctx)).first->second;
  s.ActivateContext(inserted);
  ThreadCtxStack(s.driver_id).push_back(handle);
  return ContextHandle(handle);
}

absl::Status SimDriver::CtxDestroy(ContextHandle ctx) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kCtxDestroy));
  auto it = s.contexts.find(ctx.value());
  if (it == s.contexts.end()) {
    return s.Misuse("cuCtxDestroy", cu::kErrorInvalidContext,
                    "not a context of this driver");
  }
  if (it->second.primary) {
    return s.Misuse("cuCtxDestroy", cu::kErrorInvalidContext,
                    "a primary context is released with "
                    "cuDevicePrimaryCtxRelease, not destroyed");
  }
  if (!it->second.alive) {
    return s.Misuse("cuCtxDestroy", cu::kErrorContextIsDestroyed,
                    "the context was already destroyed");
  }
  s.DeactivateContext(it->second);
  std::vector<std::uint64_t>& stack = ThreadCtxStack(s.driver_id);
  if (!stack.empty() && stack.back() == ctx.value()) stack.pop_back();
  return absl::OkStatus();
}

absl::Status SimDriver::CtxPushCurrent(ContextHandle ctx) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  auto it = s.contexts.find(ctx.value());
  if (it == s.contexts.end()) {
    return s.Misuse("cuCtxPushCurrent", cu::kErrorInvalidContext,
                    "not a context of this driver");
  }
  if (!it->second.alive) {
    return s.Misuse("cuCtxPushCurrent", cu::kErrorContextIsDestroyed,
                    "the context was destroyed");
  }
  ThreadCtxStack(s.driver_id).push_back(ctx.value());
  return absl::OkStatus();
}

absl::StatusOr<ContextHandle> SimDriver::CtxPopCurrent() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  std::vector<std::uint64_t>& stack = ThreadCtxStack(s.driver_id);
  if (stack.empty()) {
    return s.Misuse("cuCtxPopCurrent", cu::kErrorInvalidContext,
                    "the context stack of this thread is empty");
  }
  const ContextHandle top(stack.back());
  stack.pop_back();
  return top;
}

absl::StatusOr<ContextHandle> SimDriver::CtxGetCurrent() {
  const std::vector<std::uint64_t>& stack = ThreadCtxStack(state_->driver_id);
  if (stack.empty()) return ContextHandle();
  return ContextHandle(stack.back());
}

absl::Status SimDriver::CtxSetCurrent(ContextHandle ctx) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  std::vector<std::uint64_t>& stack = ThreadCtxStack(s.driver_id);
  if (ctx.is_null()) {
    if (!stack.empty()) stack.pop_back();
    return absl::OkStatus();
  }
  auto it = s.contexts.find(ctx.value());
  if (it == s.contexts.end()) {
    return s.Misuse("cuCtxSetCurrent", cu::kErrorInvalidContext,
                    "not a context of this driver");
  }
  if (!it->second.alive) {
    return s.Misuse("cuCtxSetCurrent", cu::kErrorContextIsDestroyed,
                    "the context was destroyed (or its primary context "
                    "released)");
  }
  if (stack.empty()) {
    stack.push_back(ctx.value());
  } else {
    stack.back() = ctx.value();
  }
  return absl::OkStatus();
}

absl::StatusOr<int> SimDriver::CtxGetDevice() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuCtxGetDevice"));
  return ctx->device;
}

absl::Status SimDriver::CtxSynchronize() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kCtxSynchronize));
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuCtxSynchronize"));
  std::vector<std::uint32_t> all = ctx->streams;
  all.push_back(ctx->legacy_stream);
  // A destroyed stream's queued work still runs; cuCtxSynchronize waits for
  // it too (as CUDA does).
  for (std::uint32_t i = 0; i < s.streams.size(); ++i) {
    if (s.streams[i].destroyed && s.streams[i].ctx == ctx->handle.value()) {
      all.push_back(i);
    }
  }
  for (std::uint32_t index : all) {
    const State::Stream& stream = s.streams[index];
    if (stream.completed != stream.enqueued) {
      return s.Misuse(
          "cuCtxSynchronize", cu::kErrorNotReady,
          absl::StrFormat("would block forever: stream 0x%x has %u pending "
                          "operations held back by SimDriver::Hold",
                          stream.handle.value(), stream.queue.size()));
    }
  }
  for (std::uint32_t index : all) s.HostSynced(index);
  return absl::OkStatus();
}

absl::StatusOr<std::size_t> SimDriver::CtxGetLimit(ContextLimit limit) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuCtxGetLimit"));
  const int i = static_cast<int>(limit);
  if (i < 0 || i >= 3) {
    return s.Misuse("cuCtxGetLimit", cu::kErrorUnsupportedLimit,
                    "unknown limit");
  }
  return ctx->limits[i];
}

absl::Status SimDriver::CtxSetLimit(ContextLimit limit, std::size_t value) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuCtxSetLimit"));
  const int i = static_cast<int>(limit);
  if (i < 0 || i >= 3) {
    return s.Misuse("cuCtxSetLimit", cu::kErrorUnsupportedLimit,
                    "unknown limit");
  }
  ctx->limits[i] = value;
  return absl::OkStatus();
}

absl::StatusOr<MemInfo> SimDriver::MemGetInfo() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuMemGetInfo"));
  const State::Device& d = s.devices[ctx->device];
  MemInfo info;
  info.total_bytes = d.spec.capacity_bytes;
  info.free_bytes =
      d.used >= d.spec.capacity_bytes ? 0 : d.spec.capacity_bytes - d.used;
  return info;
}

// ---------------------------------------------------------------------------
// Streams

absl::StatusOr<StreamHandle> SimDriver::StreamCreate(unsigned flags,
                                                     int priority) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kStreamCreate));
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx,
                           s.Current("cuStreamCreateWithPriority"));
  if ((flags & ~kStreamNonBlocking) != 0) {
    return s.Misuse("cuStreamCreateWithPriority", cu::kErrorInvalidValue,
                    absl::StrFormat("unknown stream flags 0x%x", flags));
  }
  // The driver clamps priorities into the range.
  priority = std::clamp(priority, kPriorityGreatest, kPriorityLeast);
  const std::uint64_t ctx_id = ctx->handle.value();
  const std::uint32_t index = s.NewStream(ctx_id, flags, priority, false);
  s.contexts.at(ctx_id).streams.push_back(index);
  return s.streams[index].handle;
}

absl::Status SimDriver::StreamDestroy(StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kStreamDestroy));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuStreamDestroy").status());
  if (stream.is_null()) {
    return s.Misuse("cuStreamDestroy", cu::kErrorInvalidHandle,
                    "the legacy default stream cannot be destroyed");
  }
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuStreamDestroy", stream, false));
  State::Stream& st = s.streams[index];
  st.destroyed = true;  // pending work still completes
  auto ctx = s.contexts.find(st.ctx);
  if (ctx != s.contexts.end()) {
    auto& list = ctx->second.streams;
    list.erase(std::remove(list.begin(), list.end(), index), list.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> SimDriver::StreamQuery(StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kStreamQuery));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuStreamQuery").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuStreamQuery", stream, false));
  const State::Stream& st = s.streams[index];
  if (st.completed != st.enqueued) return false;
  s.HostJoin(st.clock);
  return true;
}

absl::Status SimDriver::StreamSynchronize(StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kStreamSynchronize));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuStreamSynchronize").status());
  CTXPOOL_ASSIGN_OR_RETURN(
      std::uint32_t index,
      s.ResolveStream("cuStreamSynchronize", stream, false));
  const State::Stream& st = s.streams[index];
  if (st.completed != st.enqueued) {
    return s.Misuse(
        "cuStreamSynchronize", cu::kErrorNotReady,
        absl::StrFormat("would block forever: %u operations of stream 0x%x "
                        "are held back (SimDriver::Hold); Release it first",
                        st.queue.size(), st.handle.value()));
  }
  s.HostSynced(index);
  return absl::OkStatus();
}

absl::StatusOr<StreamPriorityRange> SimDriver::StreamGetPriorityRange() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuCtxGetStreamPriorityRange").status());
  StreamPriorityRange range;
  range.least = kPriorityLeast;
  range.greatest = kPriorityGreatest;
  return range;
}

absl::Status SimDriver::StreamWaitEvent(StreamHandle stream,
                                        EventHandle event) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kStreamWaitEvent));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuStreamWaitEvent").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuStreamWaitEvent", stream, false));
  CTXPOOL_ASSIGN_OR_RETURN(State::Event * e,
                           s.ResolveEvent("cuStreamWaitEvent", event));
  State::Op op;
  op.kind = State::Op::kWait;
  if (e->recorded) {
    if (s.streams[e->stream].completed < e->seq) {
      op.deps.emplace_back(e->stream, e->seq);
    }
    JoinClock(s.streams[index].clock, e->snapshot);
  }
  s.Prepare(index, op);
  s.Submit(index, std::move(op));
  return absl::OkStatus();
}

absl::Status SimDriver::LaunchHostFunc(StreamHandle stream, HostFn fn,
                                       void* user_data) {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    const CallScope scope;
    CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kLaunchHostFunc));
    CTXPOOL_RETURN_IF_ERROR(s.Current("cuLaunchHostFunc").status());
    CTXPOOL_ASSIGN_OR_RETURN(
        std::uint32_t index,
        s.ResolveStream("cuLaunchHostFunc", stream, false));
    if (fn == nullptr) {
      return s.Misuse("cuLaunchHostFunc", cu::kErrorInvalidValue,
                      "null host function");
    }
    State::Op op;
    op.kind = State::Op::kHostFn;
    op.fn = fn;
    op.user_data = user_data;
    s.Prepare(index, op);
    s.Submit(index, std::move(op));
  }
  RunHostFuncs();
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Events

absl::StatusOr<EventHandle> SimDriver::EventCreate(unsigned flags) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kEventCreate));
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuEventCreate"));
  const std::uint64_t handle = s.NextHandle(kEventBase);
  State::Event event;
  event.ctx = ctx->handle.value();
  event.flags = flags;
  s.events.emplace(handle, std::move(event));
  return EventHandle(handle);
}

absl::Status SimDriver::EventDestroy(EventHandle event) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kEventDestroy));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuEventDestroy").status());
  CTXPOOL_RETURN_IF_ERROR(s.ResolveEvent("cuEventDestroy", event).status());
  s.events.erase(event.value());
  s.destroyed_events.emplace(event.value(), true);
  return absl::OkStatus();
}

absl::Status SimDriver::EventRecord(EventHandle event, StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kEventRecord));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuEventRecord").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuEventRecord", stream, false));
  CTXPOOL_ASSIGN_OR_RETURN(State::Event * e,
                           s.ResolveEvent("cuEventRecord", event));
  State::Op op;
  op.kind = State::Op::kRecord;
  s.Prepare(index, op);
  e->recorded = true;
  e->stream = index;
  e->seq = op.seq;
  e->snapshot = s.streams[index].clock;
  s.Submit(index, std::move(op));
  return absl::OkStatus();
}

absl::StatusOr<bool> SimDriver::EventQuery(EventHandle event) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kEventQuery));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuEventQuery").status());
  CTXPOOL_ASSIGN_OR_RETURN(State::Event * e,
                           s.ResolveEvent("cuEventQuery", event));
  if (!s.EventComplete(*e)) return false;
  if (e->recorded) s.HostJoin(e->snapshot);
  return true;
}

absl::Status SimDriver::EventSynchronize(EventHandle event) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kEventSynchronize));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuEventSynchronize").status());
  CTXPOOL_ASSIGN_OR_RETURN(State::Event * e,
                           s.ResolveEvent("cuEventSynchronize", event));
  if (!s.EventComplete(*e)) {
    return s.Misuse("cuEventSynchronize", cu::kErrorNotReady,
                    absl::StrFormat("would block forever: the event waits for "
                                    "stream 0x%x, held by SimDriver::Hold",
                                    s.streams[e->stream].handle.value()));
  }
  if (e->recorded) s.HostJoin(e->snapshot);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Classic device memory

absl::StatusOr<DevicePtr> SimDriver::MemAlloc(std::size_t bytes) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemAlloc, bytes));
  CTXPOOL_ASSIGN_OR_RETURN(State::Context * ctx, s.Current("cuMemAlloc"));
  if (bytes == 0) {
    return s.Misuse("cuMemAlloc", cu::kErrorInvalidValue, "zero bytes");
  }
  State::Device& d = s.devices[ctx->device];
  const std::size_t charged = RoundUp(bytes, d.spec.alloc_alignment);
  if (charged < bytes || !s.Fits(d, charged)) {
    return s.OutOfMemory("cuMemAlloc", d, bytes);
  }
  const std::uint64_t address = s.BumpAddress(bytes, d.spec.alloc_alignment);
  s.AddUsed(d, charged);
  s.allocs.emplace(
      address, State::Alloc{bytes, charged, ctx->device, ctx->handle.value()});
  return DevicePtr(address);
}

absl::Status SimDriver::MemFree(DevicePtr ptr) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemFree));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemFree").status());
  if (ptr.is_null()) return absl::OkStatus();
  auto it = s.allocs.find(ptr.address());
  if (it == s.allocs.end()) {
    return s.Misuse(
        "cuMemFree", cu::kErrorInvalidValue,
        absl::StrFormat("0x%x is not the start of a live cuMemAlloc allocation "
                        "(double free or foreign pointer)",
                        ptr.address()));
  }
  const std::uint64_t hi = it->first + it->second.bytes;
  std::string user = s.PendingUser(it->first, hi);
  if (!user.empty()) {
    s.Misuse("cuMemFree", cu::kErrorIllegalAddress, user).IgnoreError();
  }
  s.DeviceSync(it->second.device);
  s.devices[it->second.device].used -= it->second.charged;
  s.shadow.Forget(it->first, hi);
  s.allocs.erase(it);
  return absl::OkStatus();
}

absl::Status SimDriver::MemsetD8Async(DevicePtr dst, unsigned char value,
                                      std::size_t bytes, StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemsetAsync));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemsetD8Async").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuMemsetD8Async", stream, false));
  if (bytes == 0) return absl::OkStatus();
  const std::uint64_t lo = dst.address();
  std::string why;
  if (lo + bytes < lo || !s.Accessible(lo, lo + bytes, &why)) {
    return s.Misuse("cuMemsetD8Async", cu::kErrorInvalidValue, why);
  }
  s.EnqueueWork(index, lo, lo + bytes);
  return absl::OkStatus();
}

absl::Status SimDriver::MemcpyAsync(DevicePtr dst, DevicePtr src,
                                    std::size_t bytes, StreamHandle stream) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemcpyAsync));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemcpyAsync").status());
  CTXPOOL_ASSIGN_OR_RETURN(std::uint32_t index,
                           s.ResolveStream("cuMemcpyAsync", stream, false));
  if (bytes == 0) return absl::OkStatus();
  std::string why;
  for (DevicePtr p : {dst, src}) {
    if (p.address() + bytes < p.address() ||
        !s.Accessible(p.address(), p.address() + bytes, &why)) {
      return s.Misuse("cuMemcpyAsync", cu::kErrorInvalidValue, why);
    }
  }
  s.EnqueueWork(index, dst.address(), dst.address() + bytes, src.address(),
                src.address() + bytes);
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// Pinned host memory

absl::StatusOr<void*> SimDriver::MemHostAlloc(std::size_t bytes,
                                              unsigned flags) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemHostAlloc, bytes));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemHostAlloc").status());
  if (bytes == 0) {
    return s.Misuse("cuMemHostAlloc", cu::kErrorInvalidValue, "zero bytes");
  }
  const std::size_t rounded = RoundUp(bytes, kHostPage);
  void* p = rounded < bytes ? nullptr : std::aligned_alloc(kHostPage, rounded);
  if (p == nullptr) {
    return DriverError(
        cu::kErrorOutOfMemory, "cuMemHostAlloc",
        absl::StrFormat("host allocation of %u bytes failed", bytes));
  }
  s.host_ranges.emplace(reinterpret_cast<std::uintptr_t>(p),
                        State::HostRange{bytes, true});
  return p;
}

absl::Status SimDriver::MemFreeHost(void* ptr) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemFreeHost));
  auto it = s.host_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == s.host_ranges.end() || !it->second.allocated) {
    return s.Misuse(
        "cuMemFreeHost", cu::kErrorInvalidValue,
        absl::StrFormat("%p is not memory from cuMemHostAlloc", ptr));
  }
  const std::uint64_t lo = it->first;
  const std::uint64_t hi = lo + it->second.bytes;
  std::string user = s.PendingUser(lo, hi);
  if (!user.empty()) {
    s.Misuse("cuMemFreeHost", cu::kErrorIllegalAddress, user).IgnoreError();
  }
  s.shadow.Forget(lo, hi);
  s.host_ranges.erase(it);
  std::free(ptr);
  return absl::OkStatus();
}

absl::Status SimDriver::MemHostRegister(void* ptr, std::size_t bytes,
                                        unsigned flags) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemHostRegister, bytes));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemHostRegister").status());
  const std::uint64_t lo = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uint64_t hi = lo + bytes;
  if (ptr == nullptr || bytes == 0 || hi < lo) {
    return s.Misuse("cuMemHostRegister", cu::kErrorInvalidValue,
                    "null pointer or zero bytes");
  }
  auto it = s.host_ranges.upper_bound(lo);
  if (it != s.host_ranges.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.bytes > lo) it = prev;
  }
  if (it != s.host_ranges.end() && it->first < hi) {
    return s.Misuse("cuMemHostRegister", cu::kErrorHostMemoryAlreadyRegistered,
                    absl::StrFormat("[%p, +%u) overlaps pinned memory at 0x%x",
                                    ptr, bytes, it->first));
  }
  s.host_ranges.emplace(lo, State::HostRange{bytes, false});
  return absl::OkStatus();
}

absl::Status SimDriver::MemHostUnregister(void* ptr) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const CallScope scope;
  CTXPOOL_RETURN_IF_ERROR(s.Enter(SimCall::kMemHostUnregister));
  CTXPOOL_RETURN_IF_ERROR(s.Current("cuMemHostUnregister").status());
  auto it = s.host_ranges.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == s.host_ranges.end() || it->second.allocated) {
    return s.Misuse("cuMemHostUnregister", cu::kErrorHostMemoryNotRegistered,
                    absl::StrFormat("%p was not registered with "
                                    "cuMemHostRegister",
                                    ptr));
  }
  const std::uint64_t lo = it->first;
  const std::uint64_t hi = lo + it->second.bytes;
  std::string user = s.PendingUser(lo, hi);
  if (!user.empty()) {
    s.Misuse("cuMemHostUnregister", cu::kErrorIllegalAddress, user)
        .IgnoreError();
  }
  s.shadow.Forget(lo, hi);
  s.host_ranges.erase(it);
  return absl::OkStatus();
}

}  // namespace ctxpool
