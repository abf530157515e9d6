// ctxpool/context/model_session.h — one model's share of a device.
//
// A ModelSession is what a model gets from the device it runs on: streams
// leased from the device's pool (created once for the process, reused across
// sessions), a memory budget, and an allocator handle whose allocations are
// charged to the model and tracked by it. When the model is unloaded, Close()
// synchronises its streams, reports every allocation still live as a leak,
// takes all of its memory back and returns the streams to the pool, so the
// next model can use both.
//
//   CTXPOOL_ASSIGN_OR_RETURN(
//       std::unique_ptr<ModelSession> bert,
//       device->OpenSession("bert", {.streams = 2, .max_bytes = 8 * kGiB}));
//   CTXPOOL_RETURN_IF_ERROR(bert->Warmup({.items = {{0, 64 << 20, 4}}}));
//   StreamHandle s = bert->stream(0);
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr act, bert->Allocate(64 << 20, s,
//   "act"));
//   ... enqueue work on s ...
//   bert->Deallocate(act);                 // stream-ordered, no sync
//   absl::Status leaks = bert->Close();    // OK, or lists what is still live
//
// Budget: the session registers the model as a tenant of the device
// allocator (the tenant's name is the model's; see
// ctxpool/alloc/device_allocator.h) with `min_bytes` and `high_bytes` (unset:
// 0 and no limit) and binds its leased streams to it, so that the allocator
// protects `min_bytes` of the model's memory from reclaim by other models and
// returns its free granules above `high_bytes`; GetTenantStats(tenant())
// shows them. `max_bytes` is hard and is enforced on LIVE bytes, by the
// allocator's owner record of the model (owner(); exact under concurrency,
// whichever streams the threads use): an allocation that would take
// the model's live bytes (each request rounded up to the allocator's 512 B
// unit) above it fails with RESOURCE_EXHAUSTED naming the model; other
// models are unaffected. It is not
// the tenant's max, because the allocator's tenant max counts physical bytes
// the model's streams hold (mapped 2 MiB granules in expandable mode,
// reserved segments in classic mode, both including free cached memory), so
// a max below one granule or segment could not be met at all; the tenant is
// registered with no max. Allocator errors (device out of memory) are passed
// through with the model's name.
//
// Lifetime: the DeviceContext must outlive its sessions. Destroying a session
// that was not closed closes it (and counts its leaks in the device's
// stats). In a process forked after the session was opened every call fails
// with FAILED_PRECONDITION and the destructor makes no driver call.
//
// Thread-safety: all methods are thread-safe; a session may serve requests
// from several threads. Allocate and Deallocate take no lock of the
// session's: they are inline front ends over the device allocator's owned
// calls (CachingDeviceAllocator::RegisterOwner), which keep the model's
// label, time and charge in the block and check `max_bytes` under the lock
// of the stream's shard of the allocator — one critical section per call,
// no heap allocation, no side table, and threads on different leased
// streams share no lock (docs/architecture.md, "Front end, pool,
// backing"). The session's own mutex guards its event pool and, with Close,
// the hand-over of its figures from the allocator's owner to the session;
// it is taken before the allocator's locks, never while holding one.
#ifndef CTXPOOL_CONTEXT_MODEL_SESSION_H_
#define CTXPOOL_CONTEXT_MODEL_SESSION_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/driver/types.h"

namespace ctxpool {

class DeviceContext;

// Stream priority in the device's pool. kHigh is the driver's greatest
// priority, kLow its least (the default for new streams).
enum class StreamPriority { kLow, kHigh };

struct SessionOptions {
  // Streams to lease; nullopt: CTXPOOL_SESSION_STREAMS (default 1).
  // REQUIRES: >= 1 when set.
  std::optional<int> streams;
  StreamPriority priority = StreamPriority::kLow;
  // Budget, after cgroup v2's memory controller. nullopt: the option table
  // (CTXPOOL_SESSION_{MIN,HIGH,MAX}_BYTES); 0 for high and max: no limit.
  std::optional<std::size_t> min_bytes;
  std::optional<std::size_t> high_bytes;
  std::optional<std::size_t> max_bytes;
  // Stamp each allocation with its time, so that LiveAllocations and the
  // leak report at Close give ages; one coarse clock read per Allocate
  // (~4 ns, a third of what a session adds to a cached pair). nullopt:
  // CTXPOOL_SESSION_TIMES (default off).
  std::optional<bool> record_times;
};

// What a session reports for an allocation still live.
struct LiveAllocation {
  DevicePtr ptr;
  std::size_t bytes = 0;    // as requested
  std::size_t charged = 0;  // counted against the budget
  StreamHandle stream;
  // With SessionOptions::record_times (else 0): absl::GetCurrentTimeNanos()
  // clock, 0 to a few kernel ticks early.
  std::int64_t allocated_at_ns = 0;
  const char* label = nullptr;  // the caller's name for it, or null
  // "bert: 4096 B 'kv_cache' at 0x7f0000200000 on stream 0x1, age 1.2ms";
  // no age when the time was not recorded (allocated_at_ns 0). The age is
  // now_ns - allocated_at_ns, at least 0.
  // absl::GetCurrentTimeNanos() works; the stamp trails it by up to a few
  // ticks, which then shows in a fresh allocation's age (Close reads the
  // stamps' own coarse clock).
  std::string ToString(absl::string_view model, std::int64_t now_ns) const;
};

// The expected request mix of a model: for each item, `count` blocks of
// `bytes` live at once on the session's stream `stream_index`.
struct WarmupPlan {
  struct Item {
    int stream_index = 0;
    std::size_t bytes = 0;
    int count = 1;
  };
  std::vector<Item> items;
  // Events to create ahead of time for AcquireEvent.
  int events = 0;
};

struct SessionStats {
  std::size_t live_bytes = 0;  // charged bytes of live allocations
  std::size_t peak_bytes = 0;
  std::size_t requested_bytes = 0;  // as asked, of live allocations
  std::int64_t live_allocations = 0;
  std::int64_t num_allocs = 0;
  std::int64_t num_frees = 0;
  std::int64_t num_ooms = 0;               // device out of memory
  std::int64_t num_budget_rejections = 0;  // over max_bytes
  std::int64_t invalid_frees = 0;
  std::int64_t leaked_allocations = 0;  // found by Close
  std::size_t leaked_bytes = 0;
  // The device allocator's memory on this session's streams.
  std::size_t mapped_bytes = 0;  // reserved from the driver
  std::size_t cached_bytes = 0;  // mapped - allocated
  double fragmentation = 0.0;    // 1 - largest free / free, on the streams
  std::size_t min_bytes = 0;
  std::size_t high_bytes = 0;  // 0: none
  std::size_t max_bytes = 0;   // 0: none
  int streams = 0;
  int idle_events = 0;  // created, ready for AcquireEvent
  bool closed = false;
};

class ModelSession;

// A borrowed handle on a session's device allocations, for code that takes
// an allocator rather than a session (a framework's allocator hook). Copyable;
// valid while the session lives.
class SessionDeviceAllocator {
 public:
  explicit SessionDeviceAllocator(ModelSession* session) : session_(session) {}
  // As ModelSession::Allocate / Deallocate / RecordStream.
  // (Inline: the session's front end, below.)
  inline absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                            StreamHandle stream,
                                            const char* label = nullptr) const;
  inline absl::Status Deallocate(DevicePtr ptr) const noexcept;
  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream) const;
  ModelSession& session() const { return *session_; }

 private:
  ModelSession* session_;
};

class ModelSession {
 public:
  // Closes the session if Close was not called (see the file comment).
  ~ModelSession();
  ModelSession(const ModelSession&) = delete;
  ModelSession& operator=(const ModelSession&) = delete;

  const std::string& name() const { return name_; }
  // The model's tenant in device().device_allocator(), registered under
  // name() from OpenSession until Close (then the id may be reused).
  TenantId tenant() const { return tenant_; }
  // The model's owner in device().device_allocator(): its blocks carry it.
  // Unregistered by Close (owner ids are never reused).
  OwnerId owner() const { return owner_; }
  DeviceContext& device() const { return *device_; }
  int device_ordinal() const;

  // The leased streams (non-blocking, of the requested priority). Valid
  // until Close.
  absl::Span<const StreamHandle> streams() const { return streams_; }
  // REQUIRES: 0 <= i < streams().size().
  StreamHandle stream(int i) const { return streams_[i]; }

  // A block of at least `bytes` for work on `stream`, charged to this model.
  // `label` names the allocation in leak reports.
  // REQUIRES: `label` is null or outlives the allocation (a string literal).
  // Stream order: as CachingDeviceAllocator::Allocate; any stream of the
  // device may be used, usually one of streams().
  // Errors: RESOURCE_EXHAUSTED naming the model when the budget's max or the
  // device is exhausted; FAILED_PRECONDITION after Close or in a forked child.
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream,
                                     const char* label = nullptr);
  // Returns a block of this session, stream-ordered after the work enqueued
  // on its stream. INVALID_ARGUMENT (counted) for a pointer this session does
  // not own. Never crashes.
  absl::Status Deallocate(DevicePtr ptr) noexcept;
  // The sized, two-stream free of adaptors that know both (cuda::mr,
  // std::allocator, CUB; ctxpool/interop): as Deallocate, but also refuses
  // (INVALID_ARGUMENT, counted, nothing freed) a block requested with another
  // size than `requested_bytes`, and orders the free after the work enqueued
  // on `stream` as well as on the allocation stream (FreeCheck::
  // order_after_stream). REQUIRES: `stream` is alive (not yet destroyed).
  absl::Status Deallocate(DevicePtr ptr, std::size_t requested_bytes,
                          StreamHandle stream) noexcept;
  // As CachingDeviceAllocator::RecordStream, for a block of this session.
  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream);

  // The handle to pass to code that takes an allocator.
  SessionDeviceAllocator device_allocator() {
    return SessionDeviceAllocator(this);
  }

  // An event for the caller's own stream ordering (cuEventRecord /
  // cuStreamWaitEvent), from the session's pool; a driver call only when the
  // pool is empty. Return it with ReleaseEvent.
  absl::StatusOr<EventHandle> AcquireEvent();
  // REQUIRES: `event` came from AcquireEvent of this session.
  absl::Status ReleaseEvent(EventHandle event);

  // Prepares for the first request of `plan`: allocates every item (all live
  // at once) and frees them again so that the device allocator keeps the
  // segments cached for these streams, creates `plan.events` events and
  // sizes the session's bookkeeping, so that serving that mix afterwards
  // makes no driver call. REQUIRES: stream indexes are < streams().size().
  // Stream order: the warm-up blocks are freed in stream order; no work is
  // enqueued.
  absl::Status Warmup(const WarmupPlan& plan);

  // Synchronises the session's streams, reports every live allocation as a
  // leak, frees them, unbinds the streams from the model's tenant and
  // unregisters it, destroys nothing but returns the streams and events to
  // the device's pools. OK when nothing leaked; FAILED_PRECONDITION listing
  // each leak (size, label, address, stream, and its age with
  // SessionOptions::record_times) otherwise — the memory is
  // reclaimed either way. A second Close returns FAILED_PRECONDITION.
  absl::Status Close();

  // Live allocations, by address.
  std::vector<LiveAllocation> LiveAllocations() const;
  SessionStats Stats() const;
  bool closed() const;

 private:
  friend class DeviceContext;
  struct Budget {
    std::size_t min_bytes = 0;
    std::size_t high_bytes = 0;
    std::size_t max_bytes = 0;
  };
  ModelSession(DeviceContext* device, std::string name,
               std::vector<StreamHandle> streams, Budget budget,
               TenantId tenant, OwnerId owner);

  absl::Status CheckUsable(absl::string_view call) const;
  // The slow ends of Allocate / Deallocate / RecordStream: the error with
  // the model's name (or the closed session's).
  absl::Status AllocateFailed(const absl::Status& s) const;
  absl::Status DeallocateFailed(const absl::Status& s) const;
  // The same, rewriting the result in place (out of line, so that the
  // inline front end stays a call and a test).
  void NameAllocateError(absl::StatusOr<DevicePtr>& p) const;
  void NameDeallocateError(absl::Status& s) const;
  // Close's body; `from_destructor` counts the session as not closed.
  absl::Status CloseImpl(bool from_destructor) ABSL_LOCKS_EXCLUDED(mu_);

  DeviceContext* const device_;
  CachingDeviceAllocator& allocator_;
  const std::string name_;
  const std::vector<StreamHandle> streams_;
  const Budget budget_;
  const TenantId tenant_;
  const OwnerId owner_;
  const FreeCheck owned_free_;  // what Deallocate(ptr) checks: the owner
  const ForkGuard fork_guard_;

  // Set once each, by Close (or by OpenSession for a session that lost a
  // race): closing_ first (a second Close fails, errors name the closed
  // session), closed_ once the allocator refuses the owner's allocations.
  std::atomic<bool> closing_{false};
  std::atomic<bool> closed_{false};
  mutable absl::Mutex mu_;
  std::vector<EventHandle> idle_events_ ABSL_GUARDED_BY(mu_);
  // The owner's last stats, kept by Close, and what Close found leaked.
  std::optional<OwnerStats> final_ ABSL_GUARDED_BY(mu_);
  std::int64_t leaked_allocations_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t leaked_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// The front end: inline, one call into the pool (which checks fork(), the
// owner's budget and whether it is closed; the failure paths name the
// model).
inline absl::StatusOr<DevicePtr> ModelSession::Allocate(std::size_t bytes,
                                                        StreamHandle stream,
                                                        const char* label) {
  absl::StatusOr<DevicePtr> p =
      allocator_.Allocate(bytes, stream, owner_, label);
  if (ABSL_PREDICT_FALSE(!p.ok())) NameAllocateError(p);
  return p;  // one object, built in place: no copy on the hot path
}

inline absl::Status ModelSession::Deallocate(DevicePtr ptr) noexcept {
  absl::Status s = allocator_.Deallocate(ptr, owned_free_);
  if (ABSL_PREDICT_FALSE(!s.ok())) NameDeallocateError(s);
  return s;
}

inline absl::Status ModelSession::Deallocate(DevicePtr ptr,
                                             std::size_t requested_bytes,
                                             StreamHandle stream) noexcept {
  absl::Status s =
      allocator_.Deallocate(ptr, FreeCheck{.owner = owner_,
                                           .check_size = true,
                                           .requested_bytes = requested_bytes,
                                           .order_after_stream = true,
                                           .stream = stream});
  if (ABSL_PREDICT_FALSE(!s.ok())) NameDeallocateError(s);
  return s;
}

inline absl::StatusOr<DevicePtr> SessionDeviceAllocator::Allocate(
    std::size_t bytes, StreamHandle stream, const char* label) const {
  return session_->Allocate(bytes, stream, label);
}
inline absl::Status SessionDeviceAllocator::Deallocate(
    DevicePtr ptr) const noexcept {
  return session_->Deallocate(ptr);
}

}  // namespace ctxpool

#endif  // CTXPOOL_CONTEXT_MODEL_SESSION_H_
