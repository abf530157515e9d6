#include "ctxpool/context/device_context.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ctxpool/core/cgroup.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/internal/table_room.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

int PriorityIndex(StreamPriority p) {
  return p == StreamPriority::kHigh ? 1 : 0;
}

std::string Mib(std::size_t bytes) {
  return core_internal::Format("%.1f MiB",
                               static_cast<double>(bytes) / (1 << 20));
}

// Applies CTXPOOL_BACKING, CTXPOOL_MAX_SPLIT_BYTES and CTXPOOL_MEMORY_LIMIT
// to `options`.
absl::Status ApplyOptionTable(Driver& driver, int device,
                              DeviceAllocatorOptions& options) {
  const std::string backing =
      absl::AsciiStrToLower(GetOption(OptionId::kBacking));
  if (backing == "classic") {
    options.backing = BackingMode::kClassic;
  } else if (backing == "expandable") {
    options.backing = BackingMode::kExpandable;
  } else if (backing == "auto") {
    absl::StatusOr<int> vmm = driver.DeviceGetAttribute(
        DeviceAttribute::kVirtualMemoryManagementSupported, device);
    options.backing = vmm.ok() && *vmm != 0 ? BackingMode::kExpandable
                                            : BackingMode::kClassic;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("CTXPOOL_BACKING: '", backing,
                     "' is not one of classic, expandable, auto"));
  }
  CTXPOOL_ASSIGN_OR_RETURN(std::size_t max_split,
                           GetOptionBytes(OptionId::kMaxSplitBytes));
  if (max_split != 0) options.max_split_size = max_split;
  CTXPOOL_ASSIGN_OR_RETURN(std::size_t limit,
                           GetOptionBytes(OptionId::kMemoryLimit));
  if (limit != 0) options.memory_limit_bytes = limit;
  return absl::OkStatus();
}

// CTXPOOL_CTX_SCHED: nullopt when empty (leave the flags alone).
absl::StatusOr<std::optional<unsigned>> SchedFromOptionTable() {
  const std::string v = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(GetOption(OptionId::kCtxSched)));
  if (v.empty()) return std::optional<unsigned>();
  for (unsigned f :
       {kCtxSchedAuto, kCtxSchedSpin, kCtxSchedYield, kCtxSchedBlockingSync}) {
    if (v == SchedFlagsName(f)) return std::optional<unsigned>(f);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("CTXPOOL_CTX_SCHED: '", v,
                   "' is not one of auto, spin, yield, blocking_sync"));
}

// The user's budget stays; else DeriveHostBudget's.
absl::Status ApplyHostBudget(HostAllocatorOptions& host, int devices) {
  if (host.host_budget_bytes != 0) return absl::OkStatus();
  CTXPOOL_ASSIGN_OR_RETURN(DerivedHostBudget b, DeriveHostBudget(devices));
  host.host_budget_bytes = b.bytes;
  host.host_budget_source = b.bytes == 0 ? "" : b.source;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DerivedHostBudget> DeriveHostBudget(int devices) {
  DerivedHostBudget out;
  const std::string v = absl::AsciiStrToLower(
      absl::StripAsciiWhitespace(GetOption(OptionId::kHostBudget)));
  if (v == "unlimited" || v == "0") {
    out.source = "CTXPOOL_HOST_BUDGET=unlimited";
    return out;
  }
  if (v != "auto" && !v.empty()) {  // empty: as unset
    absl::StatusOr<std::size_t> bytes = ParseBytes(v);
    if (!bytes.ok() || *bytes == 0) {  // "0.4" would silently be unlimited
      return absl::InvalidArgumentError(
          absl::StrCat("CTXPOOL_HOST_BUDGET: '", v,
                       "' is not a size of at least 1 byte, 'auto' or "
                       "'unlimited' (or 0)"));
    }
    out.bytes = *bytes;
    out.source = "CTXPOOL_HOST_BUDGET";
    return out;
  }
  const CgroupMemory cg = ReadCgroupMemory(GetOption(OptionId::kSysfsRoot));
  // The lower of high and max binds (a high above the leaf's max must not
  // lift the budget past the hard limit).
  const std::optional<std::uint64_t> limit = cg.limit();
  if (limit.has_value() && *limit != kCgroupNoLimit) {
    const bool high =
        cg.effective_high.has_value() && *cg.effective_high == *limit;
    const std::string& from = high ? cg.high_from : cg.max_from;
    const std::uint64_t n = static_cast<std::uint64_t>(std::max(devices, 1));
    // Never 0 (which means unlimited): the strictest cgroups need the
    // guard most.
    out.bytes =
        static_cast<std::size_t>(std::max<std::uint64_t>(1, *limit / 2 / n));
    out.source = absl::StrCat(
        "half of cgroup ", from, " ", high ? "memory.high" : "memory.max", " (",
        *limit, " bytes)",
        n > 1 ? absl::StrCat(" shared by ", n, " devices") : "",
        "; CTXPOOL_HOST_BUDGET overrides");
    return out;
  }
  out.source = cg.version == 2
                   ? absl::StrCat("no memory limit on cgroup ", cg.path)
                   : absl::StrCat("cgroup limits unknown: ", cg.note);
  return out;
}

std::string SchedFlagsName(unsigned flags) {
  switch (flags & kCtxSchedMask) {
    case kCtxSchedAuto:
      return "auto";
    case kCtxSchedSpin:
      return "spin";
    case kCtxSchedYield:
      return "yield";
    case kCtxSchedBlockingSync:
      return "blocking_sync";
    default:
      return absl::StrCat(flags & kCtxSchedMask);
  }
}

std::string ContextReport::ToString() const {
  std::string out =
      core_internal::Format("device %d: %s (%s), %s total\n", device,
                            device_name, driver, Mib(total_bytes));
  if (primary_was_active) {
    absl::StrAppend(&out,
                    "  primary context: already active (retained first by "
                    "another component of this process); free ",
                    Mib(free_after_retain_bytes), "\n");
  } else {
    absl::StrAppend(&out, "  primary context: ", Mib(context_bytes), " (free ",
                    Mib(free_before_retain_bytes), " before, ",
                    Mib(free_after_retain_bytes), " after the first retain)\n");
  }
  core_internal::AppendFormat(
      &out,
      "  limits: stack %d B/thread, malloc heap %s, printf FIFO %s; stream "
      "priorities %d (low) .. %d (high)\n",
      limits.stack_size, Mib(limits.malloc_heap_size),
      Mib(limits.printf_fifo_size), priorities.least, priorities.greatest);
  absl::StrAppend(&out,
                  "  scheduling: ", SchedFlagsName(effective_sched_flags));
  if (sched_flags_requested) {
    absl::StrAppend(&out, " (asked for ", SchedFlagsName(requested_sched_flags),
                    ")");
  }
  if (sched_flags_mismatch) {
    absl::StrAppend(&out,
                    "; WARNING: the driver does not run the context with "
                    "the flags it accepted");
  }
  absl::StrAppend(&out, "\n");
  return out;
}

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::Create(
    Driver& driver, int device, DeviceContextOptions options) {
  CTXPOOL_ASSIGN_OR_RETURN(int count, driver.DeviceCount());
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceContext::Create: device ", device, " does not exist (the ",
        driver.Kind(), " driver has ", count, " device(s))"));
  }
  DeviceAllocatorOptions alloc_options = options.allocator;
  HostAllocatorOptions host_options = options.host;
  std::optional<unsigned> sched = options.sched_flags;
  if (sched.has_value() && *sched != kCtxSchedAuto && *sched != kCtxSchedSpin &&
      *sched != kCtxSchedYield && *sched != kCtxSchedBlockingSync) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceContext::Create: sched_flags ", *sched,
        " is not one of kCtxSchedAuto, kCtxSchedSpin, kCtxSchedYield, "
        "kCtxSchedBlockingSync"));
  }
  if (options.use_option_table) {
    CTXPOOL_RETURN_IF_ERROR(ApplyOptionTable(driver, device, alloc_options));
    CTXPOOL_RETURN_IF_ERROR(ApplyHostBudget(
        host_options,
        options.host_budget_devices > 0 ? options.host_budget_devices : count));
    if (!sched.has_value()) {
      CTXPOOL_ASSIGN_OR_RETURN(sched, SchedFromOptionTable());
    }
  }
  int reserve = options.stream_pool_reserve;
  if (reserve < 0) {
    CTXPOOL_ASSIGN_OR_RETURN(std::int64_t r,
                             GetOptionInt(OptionId::kStreamPoolReserve));
    reserve = static_cast<int>(std::clamp<std::int64_t>(r, 0, 1024));
  }

  ContextReport report;
  report.device = device;
  report.driver = driver.Describe();
  CTXPOOL_ASSIGN_OR_RETURN(report.device_name, driver.DeviceName(device));
  CTXPOOL_ASSIGN_OR_RETURN(report.total_bytes, driver.DeviceTotalMem(device));
  CTXPOOL_ASSIGN_OR_RETURN(PrimaryContextState state,
                           driver.PrimaryCtxGetState(device));
  report.primary_was_active = state.active;
  if (sched.has_value()) {
    // Before the first retain, while the flags can still take effect.
    report.sched_flags_requested = true;
    report.requested_sched_flags = *sched & kCtxSchedMask;
    if (!state.active) {
      absl::Status set =
          driver.PrimaryCtxSetFlags(device, (state.flags & ~kCtxSchedMask) |
                                                report.requested_sched_flags);
      if (!set.ok()) {
        return absl::Status(
            set.code(),
            absl::StrCat("DeviceContext::Create: setting the "
                         "primary context's scheduling flag '",
                         SchedFlagsName(*sched), "': ", set.message()));
      }
    }
  }

  // The one retain of the process's lifetime of this object.
  CTXPOOL_ASSIGN_OR_RETURN(ContextHandle ctx, driver.PrimaryCtxRetain(device));
  report.created_at_ns = absl::GetCurrentTimeNanos();
  // What the driver runs the context with, read back: a driver may accept
  // flags and ignore them.
  if (absl::StatusOr<PrimaryContextState> after =
          driver.PrimaryCtxGetState(device);
      after.ok()) {
    report.effective_sched_flags = after->flags & kCtxSchedMask;
  }
  report.sched_flags_mismatch =
      report.sched_flags_requested &&
      report.effective_sched_flags != report.requested_sched_flags;
  if (report.sched_flags_mismatch) {
    std::fprintf(stderr,
                 "ctxpool: device %d: the primary context runs with "
                 "scheduling flag '%s', not the '%s' that was set%s\n",
                 device, SchedFlagsName(report.effective_sched_flags).c_str(),
                 SchedFlagsName(report.requested_sched_flags).c_str(),
                 report.primary_was_active
                     ? " (it was active already: set it before the first "
                       "CUDA call)"
                     : " (the driver ignored it)");
  }
  absl::Status s = [&]() -> absl::Status {
    ScopedContext guard(driver, ctx);
    CTXPOOL_RETURN_IF_ERROR(guard.status());
    CTXPOOL_ASSIGN_OR_RETURN(MemInfo info, driver.MemGetInfo());
    report.free_after_retain_bytes = info.free_bytes;
    if (report.primary_was_active) {
      report.free_before_retain_bytes = info.free_bytes;
      report.context_bytes = 0;
    } else {
      report.free_before_retain_bytes = report.total_bytes;
      report.context_bytes = report.total_bytes > info.free_bytes
                                 ? report.total_bytes - info.free_bytes
                                 : 0;
    }
    CTXPOOL_ASSIGN_OR_RETURN(report.priorities,
                             driver.StreamGetPriorityRange());
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    driver.PrimaryCtxRelease(device).IgnoreError();
    return s;
  }

  std::unique_ptr<DeviceContext> dc(
      new DeviceContext(driver, device, ctx, std::move(report)));
  absl::StatusOr<ContextLimits> limits = dc->ReadLimits();
  if (limits.ok()) {
    dc->report_.limits = *limits;
  }
  // A driver may not support every limit query; the report then shows 0.
  alloc_options.context = ctx;
  absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> allocator =
      CachingDeviceAllocator::Create(driver, device, alloc_options);
  if (!allocator.ok()) return allocator.status();  // ~DeviceContext releases
  dc->allocator_ = std::move(allocator).value();
  host_options.device = device;
  host_options.context = ctx;
  CTXPOOL_ASSIGN_OR_RETURN(dc->host_,
                           CachingHostAllocator::Create(driver, host_options));
  SlabAllocatorOptions slab_options = options.slab;
  slab_options.context = ctx;
  CTXPOOL_ASSIGN_OR_RETURN(
      dc->slab_, SlabAllocator::Create(*dc->allocator_, slab_options));

  if (reserve > 0) {
    for (StreamPriority p : {StreamPriority::kLow, StreamPriority::kHigh}) {
      CTXPOOL_ASSIGN_OR_RETURN(std::vector<StreamHandle> streams,
                               dc->LeaseStreams(reserve, p));
      dc->ReturnStreams(streams);
      absl::MutexLock lock(&dc->mu_);
      dc->stats_.stream_leases -= reserve;  // not a lease to anyone
    }
  }
  return dc;
}

DeviceContext::DeviceContext(Driver& driver, int device, ContextHandle context,
                             ContextReport report)
    : driver_(driver),
      device_(device),
      context_(context),
      report_(std::move(report)),
      high_priority_(report_.priorities.greatest),
      low_priority_(report_.priorities.least) {
  stats_.primary_retains = 1;
  stats_.sched_flag_mismatches = report_.sched_flags_mismatch ? 1 : 0;
}

DeviceContext::~DeviceContext() {
  if (fork_guard_.InForkedChild()) {
    // The driver state belongs to the parent: touch nothing, leak it all.
    (void)slab_.release();
    (void)host_.release();
    (void)allocator_.release();
    return;
  }
  // Swapped out, not copied: a destructor must not allocate.
  std::vector<StreamHandle> streams[2];
  std::vector<EventHandle> events;
  {
    absl::MutexLock lock(&mu_);
    if (!sessions_.empty()) {
      std::fprintf(stderr,
                   "ctxpool: DeviceContext for device %d destroyed with %d "
                   "open session(s); destroy sessions first\n",
                   device_, static_cast<int>(sessions_.size()));
    }
    for (int i = 0; i < 2; ++i) streams[i].swap(idle_streams_[i]);
    events.swap(idle_events_);
  }
  {
    ScopedContext guard(driver_, context_);
    if (guard.status().ok()) {
      slab_.reset();  // its slabs go back to the device allocator
      host_.reset();
      allocator_.reset();  // returns its memory to the driver
      for (EventHandle e : events) driver_.EventDestroy(e).IgnoreError();
      for (const auto& pool : streams) {
        for (StreamHandle s : pool) driver_.StreamDestroy(s).IgnoreError();
      }
    } else {
      (void)slab_.release();
      (void)host_.release();
      (void)allocator_.release();
    }
  }
  driver_.PrimaryCtxRelease(device_).IgnoreError();
}

absl::StatusOr<std::unique_ptr<ModelSession>> DeviceContext::OpenSession(
    absl::string_view name, SessionOptions options) {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("DeviceContext::OpenSession"));
  if (name.empty()) {
    return absl::InvalidArgumentError(
        "DeviceContext::OpenSession: the model name is empty");
  }
  int streams = 0;
  if (options.streams.has_value()) {
    streams = *options.streams;
  } else {
    CTXPOOL_ASSIGN_OR_RETURN(std::int64_t n,
                             GetOptionInt(OptionId::kSessionStreams));
    streams = static_cast<int>(std::clamp<std::int64_t>(n, 0, 1024));
  }
  if (streams < 1 || streams > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceContext::OpenSession('", name, "'): ", streams,
                     " streams; a session needs 1 to 1024"));
  }
  ModelSession::Budget budget;
  auto resolve = [](const std::optional<std::size_t>& v,
                    OptionId id) -> absl::StatusOr<std::size_t> {
    if (v.has_value()) return *v;
    return GetOptionBytes(id);
  };
  CTXPOOL_ASSIGN_OR_RETURN(
      budget.min_bytes, resolve(options.min_bytes, OptionId::kSessionMinBytes));
  CTXPOOL_ASSIGN_OR_RETURN(
      budget.high_bytes,
      resolve(options.high_bytes, OptionId::kSessionHighBytes));
  CTXPOOL_ASSIGN_OR_RETURN(
      budget.max_bytes, resolve(options.max_bytes, OptionId::kSessionMaxBytes));
  bool record_times = false;
  if (options.record_times.has_value()) {
    record_times = *options.record_times;
  } else {
    CTXPOOL_ASSIGN_OR_RETURN(record_times,
                             GetOptionBool(OptionId::kSessionTimes));
  }
  if (budget.max_bytes != 0 && budget.min_bytes > budget.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceContext::OpenSession('", name, "'): budget min ",
        budget.min_bytes, " B exceeds max ", budget.max_bytes, " B"));
  }
  auto name_taken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const ModelSession* s : sessions_) {
      if (s->name() == name) return true;
    }
    return false;
  };
  auto duplicate = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceContext::OpenSession: model '", name,
                     "' already has an open session on device ", device_));
  };
  {
    absl::MutexLock lock(&mu_);
    if (name_taken()) return duplicate();
  }
  CTXPOOL_ASSIGN_OR_RETURN(std::vector<StreamHandle> leased,
                           LeaseStreams(streams, options.priority));
  // The model is a tenant of the allocator with the session's min and high;
  // its max is on live bytes, the owner's (below; see model_session.h). The
  // name is unique among tenants, so a concurrent OpenSession of the same
  // model fails here.
  CachingDeviceAllocator& alloc = device_allocator();
  // Host memory running out (std::bad_alloc) anywhere below gives back what
  // was registered and leased, and the caller sees the exception.
  absl::StatusOr<TenantId> tenant;  // UNKNOWN: none yet (no allocation)
  absl::StatusOr<OwnerId> owner;
  std::size_t num_bound = 0;  // streams bound to the tenant
  std::unique_ptr<ModelSession> session;
  bool lost_race = false;
  // Gives back what this call registered and leased; a session made for it
  // is marked closed (nothing to close: never registered).
  auto give_back = [&] {
    for (std::size_t i = 0; i < num_bound; ++i) {
      alloc.UnbindStream(leased[i]).IgnoreError();
    }
    if (tenant.ok()) alloc.UnregisterTenant(*tenant).IgnoreError();
    if (owner.ok()) alloc.UnregisterOwner(*owner).IgnoreError();
    ReturnStreams(leased);
    if (session != nullptr) {
      session->closing_.store(true, std::memory_order_release);
      session->closed_.store(true, std::memory_order_release);
    }
  };
  try {
    tenant = alloc.RegisterTenant(
        name, ctxpool::Budget{
                  .min = budget.min_bytes,
                  .high = budget.high_bytes == 0 ? kNoLimit : budget.high_bytes,
                  .max = kNoLimit});
    absl::Status bound = tenant.status();
    while (bound.ok() && num_bound < leased.size()) {
      bound = alloc.BindStream(leased[num_bound], *tenant);
      if (bound.ok()) ++num_bound;
    }
    if (!bound.ok()) {
      give_back();
      {
        absl::MutexLock lock(&mu_);
        if (name_taken()) return duplicate();
      }
      return absl::Status(bound.code(),
                          absl::StrCat("DeviceContext::OpenSession('", name,
                                       "'): ", bound.message()));
    }
    // The model's allocations carry it as their owner, which enforces the
    // session's max on live bytes, exactly, in the allocator's shards.
    owner = alloc.RegisterOwner(name,
                                OwnerOptions{.max_live_bytes = budget.max_bytes,
                                             .record_times = record_times});
    if (!owner.ok()) {
      give_back();
      return owner.status();
    }
    std::string key(name);
    session.reset(new ModelSession(this, std::string(name), leased, budget,
                                   *tenant, *owner));
    absl::MutexLock lock(&mu_);
    lost_race = name_taken();
    if (!lost_race) {
      core_internal::MakeVectorRoom(sessions_, 1);
      if (!core_internal::TableHasRoom(model_totals_, 1)) {
        core_internal::MakeRoom(model_totals_, 1);
      }
      ModelLeakTotals& totals = model_totals_[std::move(key)];
      ++totals.sessions;
      sessions_.push_back(session.get());
      ++stats_.sessions_opened;
      stats_.open_sessions = static_cast<int>(sessions_.size());
    }
  } catch (const std::bad_alloc&) {
    give_back();
    throw;
  }
  if (lost_race) {  // another OpenSession of the same name registered first
    give_back();
    return duplicate();
  }
  return session;
}

absl::Status DeviceContext::MakeCurrent() {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("DeviceContext::MakeCurrent"));
  return driver_.CtxSetCurrent(context_);
}

absl::StatusOr<ContextLimits> DeviceContext::ReadLimits() const {
  ScopedContext guard(driver_, context_);
  CTXPOOL_RETURN_IF_ERROR(guard.status());
  ContextLimits limits;
  CTXPOOL_ASSIGN_OR_RETURN(limits.stack_size,
                           driver_.CtxGetLimit(ContextLimit::kStackSize));
  CTXPOOL_ASSIGN_OR_RETURN(limits.malloc_heap_size,
                           driver_.CtxGetLimit(ContextLimit::kMallocHeapSize));
  CTXPOOL_ASSIGN_OR_RETURN(limits.printf_fifo_size,
                           driver_.CtxGetLimit(ContextLimit::kPrintfFifoSize));
  return limits;
}

absl::StatusOr<ContextReport> DeviceContext::GetContextReport() const {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("DeviceContext::GetContextReport"));
  ContextReport report = report_;
  CTXPOOL_ASSIGN_OR_RETURN(report.limits, ReadLimits());
  return report;
}

absl::StatusOr<ContextLimits> DeviceContext::SetContextLimits(
    const ContextLimits& limits) {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("DeviceContext::SetContextLimits"));
  {
    ScopedContext guard(driver_, context_);
    CTXPOOL_RETURN_IF_ERROR(guard.status());
    if (limits.stack_size != 0) {
      CTXPOOL_RETURN_IF_ERROR(
          driver_.CtxSetLimit(ContextLimit::kStackSize, limits.stack_size));
    }
    if (limits.malloc_heap_size != 0) {
      CTXPOOL_RETURN_IF_ERROR(driver_.CtxSetLimit(ContextLimit::kMallocHeapSize,
                                                  limits.malloc_heap_size));
    }
    if (limits.printf_fifo_size != 0) {
      CTXPOOL_RETURN_IF_ERROR(driver_.CtxSetLimit(ContextLimit::kPrintfFifoSize,
                                                  limits.printf_fifo_size));
    }
  }
  return ReadLimits();
}

absl::Status DeviceContext::CheckCurrentContext() {
  CTXPOOL_RETURN_IF_ERROR(CheckFork("DeviceContext::CheckCurrentContext"));
  CTXPOOL_ASSIGN_OR_RETURN(ContextHandle current, driver_.CtxGetCurrent());
  if (current.is_null() || current == context_) return absl::OkStatus();
  absl::StatusOr<int> other_device = driver_.CtxGetDevice();
  {
    absl::MutexLock lock(&mu_);
    ++stats_.foreign_context_warnings;
  }
  return absl::FailedPreconditionError(core_internal::Format(
      "context explosion: context 0x%x (device %s) is current on this "
      "thread, not device %d's primary context 0x%x. Each extra context "
      "costs its own device memory (%s for the primary one here) and does "
      "not share allocations. Use the primary context "
      "(cuDevicePrimaryCtxRetain / cudaSetDevice, or "
      "DeviceContext::MakeCurrent) instead of cuCtxCreate.",
      current.value(),
      other_device.ok() ? absl::StrCat(*other_device) : "unknown", device_,
      context_.value(), Mib(report_.context_bytes)));
}

DeviceContextStats DeviceContext::Stats() const {
  absl::MutexLock lock(&mu_);
  DeviceContextStats s = stats_;
  s.streams_idle =
      static_cast<int>(idle_streams_[0].size() + idle_streams_[1].size());
  s.events_idle = static_cast<int>(idle_events_.size());
  s.open_sessions = static_cast<int>(sessions_.size());
  return s;
}

std::vector<std::pair<std::string, ModelLeakTotals>>
DeviceContext::ModelTotals() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, ModelLeakTotals>> out(
      model_totals_.begin(), model_totals_.end());
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

void DeviceContext::ForEachSession(
    const std::function<void(const ModelSession&)>& fn) const {
  absl::MutexLock lock(&mu_);
  std::vector<const ModelSession*> sorted(sessions_.begin(), sessions_.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const ModelSession* a, const ModelSession* b) {
              return a->name() < b->name();
            });
  for (const ModelSession* s : sorted) fn(*s);
}

absl::StatusOr<std::vector<StreamHandle>> DeviceContext::LeaseStreams(
    int n, StreamPriority p) {
  std::vector<StreamHandle> out;
  out.reserve(n);
  {
    absl::MutexLock lock(&mu_);
    std::vector<StreamHandle>& pool = idle_streams_[PriorityIndex(p)];
    while (static_cast<int>(out.size()) < n && !pool.empty()) {
      out.push_back(pool.back());
      pool.pop_back();
    }
    stats_.streams_leased += static_cast<int>(out.size());
    stats_.stream_leases += static_cast<std::int64_t>(out.size());
  }
  const int missing = n - static_cast<int>(out.size());
  if (missing == 0) return out;
  std::vector<StreamHandle> created;
  try {
    created.reserve(static_cast<std::size_t>(missing));
  } catch (const std::bad_alloc&) {
    ReturnStreams(out);
    throw;
  }
  absl::Status s = [&]() -> absl::Status {
    ScopedContext guard(driver_, context_);
    CTXPOOL_RETURN_IF_ERROR(guard.status());
    const int priority =
        p == StreamPriority::kHigh ? high_priority_ : low_priority_;
    for (int i = 0; i < missing; ++i) {
      CTXPOOL_ASSIGN_OR_RETURN(
          StreamHandle stream,
          driver_.StreamCreate(kStreamNonBlocking, priority));
      created.push_back(stream);
    }
    return absl::OkStatus();
  }();
  try {
    absl::MutexLock lock(&mu_);
    // Room first: the priority of each new stream, and a place in either
    // pool for every stream there is (ReturnStreams must not allocate).
    if (!core_internal::TableHasRoom(stream_priority_, created.size())) {
      core_internal::MakeRoom(stream_priority_, created.size());
    }
    const std::size_t total = stream_priority_.size() + created.size();
    for (auto& pool : idle_streams_) {
      core_internal::MakeVectorRoom(pool, total - pool.size());
    }
    for (StreamHandle stream : created) {
      stream_priority_[stream] = p;
      ++stats_.streams_created;
    }
    stats_.streams_leased += static_cast<int>(created.size());
    stats_.stream_leases += static_cast<std::int64_t>(created.size());
  } catch (const std::bad_alloc&) {
    {
      ScopedContext guard(driver_, context_);
      for (StreamHandle stream : created) {
        driver_.StreamDestroy(stream).IgnoreError();
      }
    }
    ReturnStreams(out);
    throw;
  }
  out.insert(out.end(), created.begin(), created.end());
  if (!s.ok()) {
    ReturnStreams(out);
    return s;
  }
  return out;
}

void DeviceContext::ReturnStreams(absl::Span<const StreamHandle> streams) {
  absl::MutexLock lock(&mu_);
  for (StreamHandle stream : streams) {
    auto it = stream_priority_.find(stream);
    const StreamPriority p =
        it == stream_priority_.end() ? StreamPriority::kLow : it->second;
    idle_streams_[PriorityIndex(p)].push_back(stream);
  }
  stats_.streams_leased -= static_cast<int>(streams.size());
}

absl::StatusOr<EventHandle> DeviceContext::AcquireEvent() {
  {
    absl::MutexLock lock(&mu_);
    if (!idle_events_.empty()) {
      EventHandle e = idle_events_.back();
      idle_events_.pop_back();
      return e;
    }
    // Room in the pool for every event created (ReturnEvents must not
    // allocate); may throw std::bad_alloc before the event exists.
    core_internal::MakeVectorRoom(
        idle_events_, static_cast<std::size_t>(stats_.events_created) + 1 -
                          idle_events_.size());
  }
  ScopedContext guard(driver_, context_);
  CTXPOOL_RETURN_IF_ERROR(guard.status());
  CTXPOOL_ASSIGN_OR_RETURN(EventHandle e,
                           driver_.EventCreate(kEventDisableTiming));
  absl::MutexLock lock(&mu_);
  ++stats_.events_created;
  return e;
}

void DeviceContext::ReturnEvents(absl::Span<const EventHandle> events) {
  absl::MutexLock lock(&mu_);
  idle_events_.insert(idle_events_.end(), events.begin(), events.end());
}

void DeviceContext::ForgetSession(ModelSession* session) {
  sessions_.erase(std::remove(sessions_.begin(), sessions_.end(), session),
                  sessions_.end());
  stats_.open_sessions = static_cast<int>(sessions_.size());
}

void DeviceContext::OnSessionAbandoned(ModelSession* session) {
  absl::MutexLock lock(&mu_);
  ForgetSession(session);
  ++stats_.sessions_abandoned;
}

void DeviceContext::OnSessionClosed(ModelSession* session, bool from_destructor,
                                    std::int64_t leaked_allocations,
                                    std::size_t leaked_bytes) {
  absl::MutexLock lock(&mu_);
  ForgetSession(session);
  ++stats_.sessions_closed;
  if (from_destructor) ++stats_.sessions_destroyed_unclosed;
  stats_.leaked_allocations += leaked_allocations;
  stats_.leaked_bytes += leaked_bytes;
  ModelLeakTotals& totals = model_totals_[session->name()];
  totals.leaked_allocations += leaked_allocations;
  totals.leaked_bytes += leaked_bytes;
}

}  // namespace ctxpool
