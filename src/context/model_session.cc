#include "ctxpool/context/model_session.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

// Leaks listed in a Close status before "... and N more".
constexpr std::size_t kMaxLeaksListed = 32;

// Prefixes a status message with the model, keeping code and payloads (the
// CUDA error number rides along).
absl::Status ForModel(absl::string_view model, const absl::Status& s) {
  absl::Status out(s.code(),
                   absl::StrCat("model '", model, "': ", s.message()));
  s.ForEachPayload([&out](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

}  // namespace

std::string LiveAllocation::ToString(absl::string_view model,
                                     std::int64_t now_ns) const {
  std::string out = absl::StrCat(model, ": ", bytes, " B");
  if (label != nullptr) absl::StrAppend(&out, " '", label, "'");
  absl::StrAppendFormat(
      &out, " at 0x%x on stream 0x%x, age %s", ptr.address(), stream.value(),
      absl::FormatDuration(absl::Nanoseconds(now_ns - allocated_at_ns)));
  return out;
}

// ---- SessionDeviceAllocator -------------------------------------------------

absl::StatusOr<DevicePtr> SessionDeviceAllocator::Allocate(
    std::size_t bytes, StreamHandle stream, const char* label) const {
  return session_->Allocate(bytes, stream, label);
}
absl::Status SessionDeviceAllocator::Deallocate(DevicePtr ptr) const noexcept {
  return session_->Deallocate(ptr);
}
absl::Status SessionDeviceAllocator::RecordStream(DevicePtr ptr,
                                                  StreamHandle stream) const {
  return session_->RecordStream(ptr, stream);
}

// ---- ModelSession -----------------------------------------------------------

ModelSession::ModelSession(DeviceContext* device, std::string name,
                           std::vector<StreamHandle> streams, Budget budget,
                           TenantId tenant)
    : device_(device),
      allocator_(device->device_allocator()),
      name_(std::move(name)),
      streams_(std::move(streams)),
      budget_(budget),
      tenant_(tenant),
      round_bytes_(std::max<std::size_t>(
          1, device->device_allocator().options().round_bytes)) {
  absl::MutexLock lock(&mu_);
  stats_.min_bytes = budget_.min_bytes;
  stats_.high_bytes = budget_.high_bytes;
  stats_.max_bytes = budget_.max_bytes;
  stats_.streams = static_cast<int>(streams_.size());
}

ModelSession::~ModelSession() {
  if (fork_guard_.InForkedChild()) return;  // no driver call: leak
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return;
  }
  absl::Status s = CloseImpl(/*from_destructor=*/true);
  if (!s.ok()) {
    std::fprintf(stderr, "ctxpool: session destroyed without Close: %s\n",
                 std::string(s.message()).c_str());
  }
}

int ModelSession::device_ordinal() const { return device_->device(); }

absl::Status ModelSession::CheckUsable(absl::string_view call) const {
  if (closed_) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": the session of model '", name_, "' is closed"));
  }
  return absl::OkStatus();
}

absl::Status ModelSession::OverBudget(std::size_t bytes,
                                      std::size_t charge) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("model '", name_, "' is over its memory budget on device ",
                   device_->device(), ": requested ", bytes, " B (", charge,
                   " B charged), live ", stats_.live_bytes, " B, max ",
                   budget_.max_bytes, " B"));
}

absl::StatusOr<DevicePtr> ModelSession::Allocate(std::size_t bytes,
                                                 StreamHandle stream,
                                                 const char* label) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Allocate"));
  absl::MutexLock lock(&mu_);
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::Allocate"));
  constexpr std::size_t kMax = std::numeric_limits<std::size_t>::max();
  std::size_t charge = round_bytes_;
  if (bytes > kMax - round_bytes_) {
    charge = kMax;
  } else if (bytes > 0) {
    charge = (bytes + round_bytes_ - 1) / round_bytes_ * round_bytes_;
  }
  // The max is checked here on live bytes, not by the allocator's tenant
  // (which counts the mapped or reserved bytes of the model's streams; see
  // the header). The tenant's errors are passed through with the model name.
  if (budget_.max_bytes != 0 &&
      (charge > budget_.max_bytes ||
       stats_.live_bytes > budget_.max_bytes - charge)) {
    ++stats_.num_budget_rejections;
    return OverBudget(bytes, charge);
  }
  absl::StatusOr<DevicePtr> ptr = allocator_.Allocate(bytes, stream);
  if (!ptr.ok()) {
    if (absl::IsResourceExhausted(ptr.status())) ++stats_.num_ooms;
    return ForModel(name_, ptr.status());
  }
  LiveAllocation& a = live_[*ptr];
  a.ptr = *ptr;
  a.bytes = bytes;
  a.charged = charge;
  a.stream = stream;
  a.allocated_at_ns = absl::GetCurrentTimeNanos();
  a.label = label;
  stats_.live_bytes += charge;
  stats_.requested_bytes += bytes;
  stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
  ++stats_.live_allocations;
  ++stats_.num_allocs;
  return *ptr;
}

absl::Status ModelSession::Deallocate(DevicePtr ptr) noexcept {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Deallocate"));
  absl::MutexLock lock(&mu_);
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::Deallocate"));
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    ++stats_.invalid_frees;
    return absl::InvalidArgumentError(absl::StrFormat(
        "model '%s': 0x%x is not a live allocation of this session (double "
        "free, or memory of another session or allocator)",
        name_, ptr.address()));
  }
  const std::size_t charged = it->second.charged;
  const std::size_t bytes = it->second.bytes;
  live_.erase(it);
  stats_.live_bytes -= charged;
  stats_.requested_bytes -= bytes;
  --stats_.live_allocations;
  ++stats_.num_frees;
  absl::Status s = allocator_.Deallocate(ptr);
  if (!s.ok()) return ForModel(name_, s);
  return absl::OkStatus();
}

absl::Status ModelSession::RecordStream(DevicePtr ptr, StreamHandle stream) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::RecordStream"));
  absl::MutexLock lock(&mu_);
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::RecordStream"));
  if (!live_.contains(ptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "model '%s': RecordStream of 0x%x, not a live allocation of this "
        "session",
        name_, ptr.address()));
  }
  return allocator_.RecordStream(ptr, stream);
}

absl::StatusOr<EventHandle> ModelSession::AcquireEvent() {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::AcquireEvent"));
  {
    absl::MutexLock lock(&mu_);
    CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::AcquireEvent"));
    if (!idle_events_.empty()) {
      EventHandle e = idle_events_.back();
      idle_events_.pop_back();
      return e;
    }
  }
  return device_->AcquireEvent();
}

absl::Status ModelSession::ReleaseEvent(EventHandle event) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::ReleaseEvent"));
  bool closed = false;
  {
    absl::MutexLock lock(&mu_);
    closed = closed_;
    if (!closed) idle_events_.push_back(event);
  }
  if (closed) device_->ReturnEvents({event});
  return absl::OkStatus();
}

absl::Status ModelSession::Warmup(const WarmupPlan& plan) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Warmup"));
  std::size_t total = 0;
  for (const WarmupPlan::Item& item : plan.items) {
    if (item.stream_index < 0 ||
        item.stream_index >= static_cast<int>(streams_.size()) ||
        item.count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model '", name_, "': Warmup item on stream index ",
                       item.stream_index, " x", item.count,
                       "; the session has ", streams_.size(), " stream(s)"));
    }
    total += static_cast<std::size_t>(item.count);
  }
  if (plan.events < 0) {
    return absl::InvalidArgumentError("Warmup: negative event count");
  }
  {
    absl::MutexLock lock(&mu_);
    CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::Warmup"));
    live_.reserve(live_.size() + total);
    idle_events_.reserve(idle_events_.size() +
                         static_cast<std::size_t>(plan.events) + 16);
  }
  // Everything of the mix live at once, then freed: the allocator keeps
  // the segments cached on these streams.
  std::vector<DevicePtr> blocks;
  blocks.reserve(total);
  absl::Status status;
  for (const WarmupPlan::Item& item : plan.items) {
    for (int i = 0; i < item.count && status.ok(); ++i) {
      absl::StatusOr<DevicePtr> p =
          Allocate(item.bytes, streams_[item.stream_index], "warmup");
      if (p.ok()) {
        blocks.push_back(*p);
      } else {
        status = p.status();
      }
    }
  }
  for (DevicePtr p : blocks) {
    absl::Status s = Deallocate(p);
    if (status.ok() && !s.ok()) status = s;
  }
  CTXPOOL_RETURN_IF_ERROR(status);
  // Events: top the session's pool up to `plan.events`.
  int have = 0;
  {
    absl::MutexLock lock(&mu_);
    have = static_cast<int>(idle_events_.size());
  }
  for (int i = have; i < plan.events; ++i) {
    CTXPOOL_ASSIGN_OR_RETURN(EventHandle e, device_->AcquireEvent());
    absl::MutexLock lock(&mu_);
    idle_events_.push_back(e);
  }
  return absl::OkStatus();
}

absl::Status ModelSession::Close() { return CloseImpl(false); }

absl::Status ModelSession::CloseImpl(bool from_destructor) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Close"));
  std::vector<LiveAllocation> leaks;
  std::vector<EventHandle> events;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrCat("ModelSession::Close: the session of model '", name_,
                       "' is closed already"));
    }
    closed_ = true;
    leaks.reserve(live_.size());
    for (auto& [ptr, a] : live_) leaks.push_back(a);
    live_.clear();
    events.swap(idle_events_);
  }
  std::sort(leaks.begin(), leaks.end(),
            [](const LiveAllocation& a, const LiveAllocation& b) {
              return a.ptr < b.ptr;
            });

  // Wait for the model's work, so that nothing it enqueued still runs when
  // its memory and streams go to the next model.
  absl::Status sync;
  {
    ScopedContext guard(device_->driver(), device_->context());
    sync = guard.status();
    for (StreamHandle s : streams_) {
      if (!sync.ok()) break;
      sync = device_->driver().StreamSynchronize(s);
    }
  }
  std::size_t leaked_bytes = 0;
  absl::Status reclaim;
  for (const LiveAllocation& a : leaks) {
    leaked_bytes += a.charged;
    absl::Status s = allocator_.Deallocate(a.ptr);
    if (reclaim.ok() && !s.ok()) reclaim = s;
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.leaked_allocations += static_cast<std::int64_t>(leaks.size());
    stats_.leaked_bytes += leaked_bytes;
    stats_.live_bytes = 0;
    stats_.requested_bytes = 0;
    stats_.live_allocations = 0;
    stats_.closed = true;
  }
  // The memory is back in the allocator: give the streams back to the
  // default tenant (with what they cache) and forget the model's tenant, so
  // that the pooled streams and the name can serve the next session.
  absl::Status untenant;
  for (StreamHandle s : streams_) {
    absl::Status u = allocator_.UnbindStream(s);
    if (untenant.ok() && !u.ok()) untenant = u;
  }
  if (untenant.ok()) untenant = allocator_.UnregisterTenant(tenant_);
  device_->ReturnEvents(events);
  device_->ReturnStreams(streams_);
  device_->OnSessionClosed(this, from_destructor,
                           static_cast<std::int64_t>(leaks.size()),
                           leaked_bytes);

  if (leaks.empty() && sync.ok() && reclaim.ok() && untenant.ok()) {
    return absl::OkStatus();
  }
  std::string msg = absl::StrCat("model '", name_, "' session closed");
  if (!leaks.empty()) {
    absl::StrAppend(&msg, " with ", leaks.size(), " leaked allocation(s), ",
                    leaked_bytes, " B (reclaimed):");
    const std::int64_t now = absl::GetCurrentTimeNanos();
    for (std::size_t i = 0; i < leaks.size() && i < kMaxLeaksListed; ++i) {
      absl::StrAppend(&msg, "\n  leak: ", leaks[i].ToString(name_, now));
    }
    if (leaks.size() > kMaxLeaksListed) {
      absl::StrAppend(&msg, "\n  ... and ", leaks.size() - kMaxLeaksListed,
                      " more");
    }
  }
  if (!sync.ok()) {
    absl::StrAppend(&msg, "\n  stream synchronise failed: ", sync.message());
  }
  if (!reclaim.ok()) {
    absl::StrAppend(&msg, "\n  reclaiming failed: ", reclaim.message());
  }
  if (!untenant.ok()) {
    absl::StrAppend(&msg, "\n  releasing the allocator tenant failed: ",
                    untenant.message());
  }
  if (leaks.empty() && !sync.ok()) return ForModel(name_, sync);
  return absl::FailedPreconditionError(msg);
}

std::vector<LiveAllocation> ModelSession::LiveAllocations() const {
  std::vector<LiveAllocation> out;
  {
    absl::MutexLock lock(&mu_);
    out.reserve(live_.size());
    for (const auto& [ptr, a] : live_) out.push_back(a);
  }
  std::sort(out.begin(), out.end(),
            [](const LiveAllocation& a, const LiveAllocation& b) {
              return a.ptr < b.ptr;
            });
  return out;
}

bool ModelSession::closed() const {
  absl::MutexLock lock(&mu_);
  return closed_;
}

SessionStats ModelSession::Stats() const {
  SessionStats s;
  {
    absl::MutexLock lock(&mu_);
    s = stats_;
    s.idle_events = static_cast<int>(idle_events_.size());
  }
  if (s.closed || fork_guard_.InForkedChild()) return s;
  // The allocator's memory on this session's streams: its tenant's.
  absl::StatusOr<TenantStats> tenant = allocator_.GetTenantStats(tenant_);
  if (tenant.ok()) {
    s.mapped_bytes = tenant->mapped_bytes;
    s.cached_bytes = tenant->cached_bytes;
  }
  const AllocatorSnapshot snap = allocator_.Snapshot();
  std::size_t free_total = 0;
  std::size_t largest = 0;
  for (const SegmentInfo& seg : snap.segments) {
    if (std::find(streams_.begin(), streams_.end(), seg.stream) ==
        streams_.end()) {
      continue;
    }
    for (const BlockInfo& b : seg.blocks) {
      if (b.state != BlockState::kFree) continue;
      free_total += b.size;
      largest = std::max(largest, b.size);
    }
  }
  s.fragmentation = free_total == 0 ? 0.0
                                    : 1.0 - static_cast<double>(largest) /
                                                static_cast<double>(free_total);
  return s;
}

}  // namespace ctxpool
