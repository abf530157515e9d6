#include "ctxpool/context/model_session.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/core/internal/coarse_clock.h"
#include "ctxpool/core/internal/format.h"
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

// The session's view of a block the allocator lists for its owner.
LiveAllocation ToLiveAllocation(const OwnedBlock& b) {
  return LiveAllocation{b.ptr,    b.requested_bytes, b.charged_bytes,
                        b.stream, b.allocated_at_ns, b.label};
}

}  // namespace

std::string LiveAllocation::ToString(absl::string_view model,
                                     std::int64_t now_ns) const {
  std::string out = absl::StrCat(model, ": ", bytes, " B");
  if (label != nullptr) absl::StrAppend(&out, " '", label, "'");
  core_internal::AppendFormat(&out, " at 0x%x on stream 0x%x", ptr.address(),
                              stream.value());
  if (allocated_at_ns != 0) {
    // A wall-clock step back can put `now_ns` before the stamp: age 0.
    absl::StrAppend(&out, ", age ",
                    absl::FormatDuration(absl::Nanoseconds(
                        std::max<std::int64_t>(0, now_ns - allocated_at_ns))));
  }
  return out;
}

// ---- SessionDeviceAllocator -------------------------------------------------

absl::Status SessionDeviceAllocator::RecordStream(DevicePtr ptr,
                                                  StreamHandle stream) const {
  return session_->RecordStream(ptr, stream);
}

// ---- ModelSession -----------------------------------------------------------

ModelSession::ModelSession(DeviceContext* device, std::string name,
                           std::vector<StreamHandle> streams, Budget budget,
                           TenantId tenant, OwnerId owner)
    : device_(device),
      allocator_(device->device_allocator()),
      name_(std::move(name)),
      streams_(std::move(streams)),
      budget_(budget),
      tenant_(tenant),
      owner_(owner),
      owned_free_{.owner = owner} {}

ModelSession::~ModelSession() {
  if (fork_guard_.InForkedChild()) return;  // no driver call: leak
  if (closing_.load(std::memory_order_acquire)) return;
  // A destructor must not throw: host memory running out while closing
  // leaves what was not reclaimed to the DeviceContext's destruction.
  try {
    absl::Status s = CloseImpl(/*from_destructor=*/true);
    if (!s.ok()) {
      std::fprintf(stderr, "ctxpool: session destroyed without Close: %s\n",
                   std::string(s.message()).c_str());
    }
  } catch (const std::bad_alloc&) {
    // After the reclaim (closed_) everything went back and only the message
    // ran out of memory. Before it, the reclaim threw with nothing changed
    // (CloseImpl): the session is abandoned. The DeviceContext forgets it
    // (no dangling pointer); its blocks, streams and tenant come back only
    // when the DeviceContext is destroyed.
    if (!closed_.load(std::memory_order_acquire)) {
      closing_.store(true, std::memory_order_release);
      closed_.store(true, std::memory_order_release);
      device_->OnSessionAbandoned(this);
      std::fprintf(stderr,
                   "ctxpool: session destroyed without Close while host "
                   "memory ran out; its memory and streams return with the "
                   "DeviceContext\n");
    } else {
      std::fprintf(stderr,
                   "ctxpool: session destroyed without Close (out of host "
                   "memory for the leak report)\n");
    }
  }
}

int ModelSession::device_ordinal() const { return device_->device(); }

absl::Status ModelSession::CheckUsable(absl::string_view call) const {
  if (closing_.load(std::memory_order_acquire)) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": the session of model '", name_, "' is closed"));
  }
  return absl::OkStatus();
}

absl::Status ModelSession::AllocateFailed(const absl::Status& s) const {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Allocate"));
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::Allocate"));
  return ForModel(name_, s);
}

void ModelSession::NameAllocateError(absl::StatusOr<DevicePtr>& p) const {
  p = AllocateFailed(p.status());
}
void ModelSession::NameDeallocateError(absl::Status& s) const {
  s = DeallocateFailed(s);
}

absl::Status ModelSession::DeallocateFailed(const absl::Status& s) const {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::Deallocate"));
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::Deallocate"));
  if (absl::IsInvalidArgument(s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", name_, "': ", s.message(),
        " (double free, or memory of another session or allocator)"));
  }
  return ForModel(name_, s);
}

absl::Status ModelSession::RecordStream(DevicePtr ptr, StreamHandle stream) {
  CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("ModelSession::RecordStream"));
  CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::RecordStream"));
  absl::Status s = allocator_.RecordStream(ptr, stream, owner_);
  if (!s.ok()) {
    CTXPOOL_RETURN_IF_ERROR(CheckUsable("ModelSession::RecordStream"));
    return ForModel(name_, s);
  }
  return s;
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
    closed = closing_.load(std::memory_order_acquire);
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
  if (closing_.exchange(true, std::memory_order_acq_rel)) {
    return absl::FailedPreconditionError(
        absl::StrCat("ModelSession::Close: the session of model '", name_,
                     "' is closed already"));
  }
  // One critical section of the allocator refuses the model's allocations
  // from now on and frees what is still live: that is the leak list (a free
  // racing with Close came first or found nothing). The frees are stream
  // ordered; the synchronise below is for the streams' next owner.
  // Under mu_, so that Stats() sees the session open with its blocks or
  // closed without them, never open without them.
  std::vector<OwnedBlock> leaks;
  absl::Status reclaim;
  std::vector<EventHandle> events;
  {
    absl::MutexLock lock(&mu_);
    try {
      reclaim = allocator_.CloseOwner(owner_, &leaks);
    } catch (const std::bad_alloc&) {
      // Nothing was freed: the session stays open, to be closed again.
      closing_.store(false, std::memory_order_release);
      throw;
    }
    closed_.store(true, std::memory_order_release);
    events.swap(idle_events_);
  }

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
  for (const OwnedBlock& a : leaks) leaked_bytes += a.charged_bytes;
  {
    // Under mu_, so that Stats() sees the owner registered or final_ set,
    // never neither.
    absl::MutexLock lock(&mu_);
    // From here on the memory is reclaimed: host memory running out only
    // leaves the owner registered (its final stats unknown), never the
    // streams or events out of their pools.
    try {
      absl::StatusOr<OwnerStats> final_stats =
          allocator_.UnregisterOwner(owner_);
      if (final_stats.ok()) final_ = *std::move(final_stats);
    } catch (const std::bad_alloc&) {
    }
    leaked_allocations_ += static_cast<std::int64_t>(leaks.size());
    leaked_bytes_ += leaked_bytes;
  }
  // The memory is back in the allocator: give the streams back to the
  // default tenant (with what they cache) and forget the model's tenant, so
  // that the pooled streams and the name can serve the next session.
  absl::Status untenant;
  try {
    for (StreamHandle s : streams_) {
      absl::Status u = allocator_.UnbindStream(s);
      if (untenant.ok() && !u.ok()) untenant = u;
    }
    if (untenant.ok()) untenant = allocator_.UnregisterTenant(tenant_);
  } catch (const std::bad_alloc&) {
    // A code without a message: making it takes no host memory.
    untenant = absl::Status(absl::StatusCode::kResourceExhausted, "");
  }
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
    // The clock of the stamps, so a fresh leak's age is not the lag between
    // the coarse and the fine clock.
    const std::int64_t now = core_internal::CoarseNowNs();
    for (std::size_t i = 0; i < leaks.size() && i < kMaxLeaksListed; ++i) {
      absl::StrAppend(
          &msg, "\n  leak: ", ToLiveAllocation(leaks[i]).ToString(name_, now));
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
  if (closed() || fork_guard_.InForkedChild()) return out;
  absl::StatusOr<std::vector<OwnedBlock>> owned =
      allocator_.OwnedBlocks(owner_);
  if (!owned.ok()) return out;
  out.reserve(owned->size());
  for (const OwnedBlock& b : *owned) out.push_back(ToLiveAllocation(b));
  return out;
}

bool ModelSession::closed() const {
  return closed_.load(std::memory_order_acquire);
}

SessionStats ModelSession::Stats() const {
  SessionStats s;
  s.min_bytes = budget_.min_bytes;
  s.high_bytes = budget_.high_bytes;
  s.max_bytes = budget_.max_bytes;
  s.streams = static_cast<int>(streams_.size());
  std::optional<OwnerStats> owner;
  {
    // Close sets final_ and unregisters the owner under mu_: one of the two
    // answers here.
    absl::MutexLock lock(&mu_);
    s.idle_events = static_cast<int>(idle_events_.size());
    s.leaked_allocations = leaked_allocations_;
    s.leaked_bytes = leaked_bytes_;
    owner = final_;
    s.closed = closed() || final_.has_value();
    if (!owner.has_value() && !fork_guard_.InForkedChild()) {
      absl::StatusOr<OwnerStats> o = allocator_.GetOwnerStats(owner_);
      if (o.ok()) owner = *std::move(o);
    }
  }
  if (owner.has_value()) {
    s.peak_bytes = owner->peak_live_bytes;
    s.num_allocs = owner->num_allocs;
    s.num_frees = owner->num_frees;
    s.num_ooms = owner->num_ooms;
    s.num_budget_rejections = owner->num_budget_rejections;
    s.invalid_frees = owner->invalid_frees;
    if (!s.closed) {
      s.live_bytes = owner->live_bytes;
      s.requested_bytes = owner->requested_bytes;
      s.live_allocations = owner->live_allocations;
    }
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
