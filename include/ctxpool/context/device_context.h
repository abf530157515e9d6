// ctxpool/context/device_context.h — one CUDA context per device.
//
// A DeviceContext is a process's single handle on one GPU. It retains the
// device's *primary* context exactly once (the context the CUDA runtime,
// cuBLAS and PyTorch also use, so ctxpool adds no context of its own) and
// releases it at destruction. It owns what every model on the device shares:
//
//   * the caching allocators — device, pinned host and slab (small device
//     objects carved from the device allocator) — created with the primary
//     context so none of them retains it a second time;
//   * a stream pool: non-blocking streams of high and low priority, created
//     once and leased to model sessions, returned (not destroyed) at Close;
//   * an event pool for the sessions;
//   * the context report: how much device memory the context took, its
//     limits (stack, malloc heap, printf FIFO) and a call to lower them.
//
// Every driver call it makes runs under a ScopedContext guard that makes the
// primary context current on the calling thread and restores what was there.
//
//   CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<DeviceContext> gpu0,
//                            DeviceContext::Create(driver, 0));
//   std::cout << gpu0->context_report().ToString();
//   CTXPOOL_ASSIGN_OR_RETURN(auto bert, gpu0->OpenSession("bert", {}));
//   CTXPOOL_ASSIGN_OR_RETURN(auto t5, gpu0->OpenSession("t5", {}));
//   // two models, one context, one allocator, disjoint streams
//
// Most programs get their DeviceContexts from a Runtime (runtime.h).
//
// Lifetime: sessions must be destroyed before their DeviceContext; the
// Driver must outlive it. In a process forked after Create, every call
// fails with FAILED_PRECONDITION and the destructor makes no driver call.
//
// Thread-safety: all methods are thread-safe.
#ifndef CTXPOOL_CONTEXT_DEVICE_CONTEXT_H_
#define CTXPOOL_CONTEXT_DEVICE_CONTEXT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

// The context's resource limits (cuCtxGetLimit / cuCtxSetLimit). Part of
// what a context costs in device memory scales with them (the stack with
// the number of resident threads).
struct ContextLimits {
  std::size_t stack_size = 0;        // bytes per thread
  std::size_t malloc_heap_size = 0;  // device-side malloc heap
  std::size_t printf_fifo_size = 0;  // device-side printf buffer
};

// What the primary context costs and how it is configured.
struct ContextReport {
  int device = 0;
  std::string device_name;
  std::string driver;  // Driver::Describe()
  std::size_t total_bytes = 0;
  // Free device memory before and after this process's first retain of the
  // primary context. Before the retain no context exists to ask, so
  // `free_before` is the device's total: on an idle device the difference
  // is exactly the context's cost; memory other processes use is counted in
  // it too. When the primary context was already active (someone in the
  // process retained it first) both are the free memory after, and
  // context_bytes is 0: the cost was paid by whoever created it.
  std::size_t free_before_retain_bytes = 0;
  std::size_t free_after_retain_bytes = 0;
  std::size_t context_bytes = 0;
  bool primary_was_active = false;
  ContextLimits limits;
  StreamPriorityRange priorities;
  // When this DeviceContext retained the context (absl::GetCurrentTimeNanos).
  std::int64_t created_at_ns = 0;
  // Scheduling flags (kCtxSched*): what was asked (DeviceContextOptions::
  // sched_flags) and what the driver reports after the retain. A driver
  // that accepted the flags but runs with others (as under some constrained
  // cgroups) sets sched_flags_mismatch.
  bool sched_flags_requested = false;
  unsigned requested_sched_flags = 0;
  unsigned effective_sched_flags = 0;
  bool sched_flags_mismatch = false;
  // A few lines for humans.
  std::string ToString() const;
};

// "auto", "spin", "yield", "blocking_sync" (or the number) for kCtxSched*.
std::string SchedFlagsName(unsigned flags);

// The pinned-host budget a DeviceContext gives its host allocator when the
// user set none (HostAllocatorOptions::host_budget_bytes == 0 and
// use_option_table): CTXPOOL_HOST_BUDGET, a size or 'unlimited'; by default
// ('auto') half of the process's cgroup v2 memory.high, else half of its
// memory.max, whichever is lower (ctxpool/core/cgroup.h), divided by the
// `devices` that share it, never below 1 byte while a limit is known —
// pinned pages are never reclaimed or swapped, and the rest of the
// container (the interpreter, weights staged in host memory, page cache)
// needs the other half. bytes 0: unlimited (no limit known). Where the
// driver leaves pinned pages out of the cgroup's accounting, this budget is
// the only guard against them. INVALID_ARGUMENT for a bad option value.
struct DerivedHostBudget {
  std::size_t bytes = 0;
  std::string source;  // for humans and error messages
};
absl::StatusOr<DerivedHostBudget> DeriveHostBudget(int devices);

struct DeviceContextOptions {
  // Options of the device allocator. `allocator.context` is ignored: the
  // allocator always uses the context's primary context.
  DeviceAllocatorOptions allocator;
  // Options of the pinned host and slab allocators; their `context` (and
  // the host allocator's `device`) are set by the DeviceContext.
  HostAllocatorOptions host;
  SlabAllocatorOptions slab;
  // Take the allocator's backing mode (CTXPOOL_BACKING), max_split_size
  // (CTXPOOL_MAX_SPLIT_BYTES) and memory_limit_bytes (CTXPOOL_MEMORY_LIMIT)
  // from the option table, overriding `allocator`.
  bool use_option_table = true;
  // Streams of each priority to create up front; -1: the option table
  // (CTXPOOL_STREAM_POOL_RESERVE).
  int stream_pool_reserve = -1;
  // Scheduling flag (kCtxSched*) to set on the primary context before the
  // first retain, then verified; nullopt: leave the flags alone (with
  // use_option_table: CTXPOOL_CTX_SCHED decides).
  std::optional<unsigned> sched_flags;
  // How many host allocators share the cgroup-derived pinned budget
  // (DeriveHostBudget); 0: the driver's device count. Runtime sets the
  // number of devices it opens.
  int host_budget_devices = 0;
};

struct DeviceContextStats {
  int primary_retains = 0;  // by this object: 1 while it lives
  int open_sessions = 0;
  std::int64_t sessions_opened = 0;
  std::int64_t sessions_closed = 0;
  std::int64_t sessions_destroyed_unclosed = 0;
  // Destroyed without Close while host memory ran out (std::bad_alloc)
  // before their memory could be reclaimed: their blocks, streams and
  // tenant come back only when this DeviceContext is destroyed.
  std::int64_t sessions_abandoned = 0;
  int streams_created = 0;         // ever, both priorities
  int streams_idle = 0;            // in the pool
  int streams_leased = 0;          // held by sessions
  std::int64_t stream_leases = 0;  // streams handed out, reuses included
  int events_created = 0;
  int events_idle = 0;
  // The primary context runs with other scheduling flags than requested.
  int sched_flag_mismatches = 0;
  std::int64_t leaked_allocations = 0;  // found by session Close, all models
  std::size_t leaked_bytes = 0;
  std::int64_t foreign_context_warnings = 0;
};

// Leaks counted per model name across the sessions it had (for metrics).
struct ModelLeakTotals {
  std::int64_t sessions = 0;
  std::int64_t leaked_allocations = 0;
  std::size_t leaked_bytes = 0;
};

class DeviceContext {
 public:
  // Retains `device`'s primary context, reads the context report, creates
  // the device allocator and the reserved streams. The driver must outlive
  // the DeviceContext. Errors: the driver's (UNAVAILABLE, INVALID_ARGUMENT
  // for a bad ordinal, ...), nothing retained on failure.
  static absl::StatusOr<std::unique_ptr<DeviceContext>> Create(
      Driver& driver, int device, DeviceContextOptions options = {});

  // Destroys the pooled streams and events, the allocator (its memory goes
  // back to the driver) and releases the primary context once.
  // REQUIRES: every session of this context was destroyed.
  ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const { return device_; }
  Driver& driver() const { return driver_; }
  // The retained primary context.
  ContextHandle context() const { return context_; }
  // The shared device allocator. Memory taken from it directly is charged
  // to no model; prefer a session's allocator.
  CachingDeviceAllocator& device_allocator() const { return *allocator_; }
  // The shared pinned host allocator (staging buffers for this device).
  CachingHostAllocator& host_allocator() const { return *host_; }
  // The shared slab allocator for small device objects (<= 64 KiB).
  SlabAllocator& slab_allocator() const { return *slab_; }

  // Opens a session for model `name`: leases its streams from the pool
  // (creating streams only when the pool has none of that priority).
  // INVALID_ARGUMENT for an empty name, fewer than 1 stream, or a name that
  // is open already on this device; FAILED_PRECONDITION in a forked child.
  absl::StatusOr<std::unique_ptr<ModelSession>> OpenSession(
      absl::string_view name, SessionOptions options = {});

  // Makes the primary context current on the calling thread (cuCtxSetCurrent,
  // like cudaSetDevice), for code that launches its own work.
  absl::Status MakeCurrent();

  // The report taken at Create (memory) with the limits as they are now.
  absl::StatusOr<ContextReport> GetContextReport() const;
  const ContextReport& initial_context_report() const { return report_; }
  // Lowers (or raises) the context limits to shrink the context; a field of
  // 0 leaves that limit unchanged. Returns the limits now in force.
  absl::StatusOr<ContextLimits> SetContextLimits(const ContextLimits& limits);

  // The "context explosion" check: OK when no context or this device's
  // primary context is current on the calling thread; FAILED_PRECONDITION
  // (and foreign_context_warnings += 1) when another context is current —
  // typically one made by cuCtxCreate, which costs its own memory.
  absl::Status CheckCurrentContext();

  DeviceContextStats Stats() const;
  // Per model leak totals, including models whose sessions were closed.
  std::vector<std::pair<std::string, ModelLeakTotals>> ModelTotals() const;
  // Calls `fn` on each open session while they cannot close. `fn` must not
  // call this DeviceContext's methods that take its lock (OpenSession,
  // Stats, ...); session methods are fine.
  void ForEachSession(const std::function<void(const ModelSession&)>& fn) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK, or FAILED_PRECONDITION in a process forked after Create.
  absl::Status CheckFork(absl::string_view call) const {
    return fork_guard_.Check(call);
  }
  bool InForkedChild() const { return fork_guard_.InForkedChild(); }

 private:
  friend class ModelSession;
  DeviceContext(Driver& driver, int device, ContextHandle context,
                ContextReport report);

  // The stream pool. Lease creates streams when the pool is short; it
  // throws std::bad_alloc (host memory) with the pool as it was. The pools
  // keep room for every stream and event this context created, so that
  // returning them (Close, a session's destructor) never allocates.
  absl::StatusOr<std::vector<StreamHandle>> LeaseStreams(int n,
                                                         StreamPriority p)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ReturnStreams(absl::Span<const StreamHandle> streams)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The event pool (kEventDisableTiming events).
  absl::StatusOr<EventHandle> AcquireEvent() ABSL_LOCKS_EXCLUDED(mu_);
  void ReturnEvents(absl::Span<const EventHandle> events)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Session bookkeeping.
  void OnSessionClosed(ModelSession* session, bool from_destructor,
                       std::int64_t leaked_allocations,
                       std::size_t leaked_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // A session destroyed without its memory reclaimed (sessions_abandoned).
  // Does not allocate.
  void OnSessionAbandoned(ModelSession* session) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops `session` from the open sessions.
  void ForgetSession(ModelSession* session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<ContextLimits> ReadLimits() const;

  Driver& driver_;
  const int device_;
  const ContextHandle context_;
  ContextReport report_;  // set in Create, then read-only
  const ForkGuard fork_guard_;
  // Destroyed in reverse: the slabs go back to the device allocator first.
  std::unique_ptr<CachingDeviceAllocator> allocator_;
  std::unique_ptr<CachingHostAllocator> host_;
  std::unique_ptr<SlabAllocator> slab_;
  int high_priority_ = 0;
  int low_priority_ = 0;

  mutable absl::Mutex mu_;
  std::vector<StreamHandle> idle_streams_[2] ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StreamHandle, StreamPriority> stream_priority_
      ABSL_GUARDED_BY(mu_);
  std::vector<EventHandle> idle_events_ ABSL_GUARDED_BY(mu_);
  std::vector<ModelSession*> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, ModelLeakTotals> model_totals_
      ABSL_GUARDED_BY(mu_);
  DeviceContextStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ctxpool

#endif  // CTXPOOL_CONTEXT_DEVICE_CONTEXT_H_
