// ctxpool/alloc/host_allocator.h — the caching allocator for pinned host
// memory.
//
// cuMemHostAlloc costs milliseconds per GiB and cuMemFreeHost can stall the
// device, so servers keep pinned staging buffers in a cache.
// CachingHostAllocator keeps every buffer it pinned and hands it out again
// for later requests of the same size class:
//
//   * Size classes: HostSizeClasses (core/host_size_classes.h) with
//     `classes_per_doubling` steps per power of two, 8 by default, so no
//     request larger than 512 B wastes more than 12.5 % of its size (PyTorch
//     rounds to the next power of two: a 4 GiB + 1 B pin takes 8 GiB). Each
//     cached buffer is its own cuMemHostAlloc; a free buffer is reused only
//     for requests of its own class.
//   * Stream safety: the host writes a pinned buffer without stream order,
//     so a buffer is reused only after the copies that read or write it have
//     completed. Deallocate checks each stream that used the buffer (the
//     allocation stream, where the async copies are enqueued, and streams
//     named by RecordStream): an idle stream (cuStreamQuery) needs nothing;
//     on a busy one it records a pooled event. The buffer stays "pending"
//     until those events complete; pending buffers are polled with
//     cuEventQuery on later calls, never waited for.
//   * Register / Unregister pin memory the caller already owns (model
//     weights in shared memory) with cuMemHostRegister. Registrations are
//     accounted apart from the cache; duplicate and overlapping ranges are
//     refused before the driver is called.
//   * Host budget: `host_budget_bytes` caps pinned bytes held by the
//     allocator, *including registered bytes*, because pinned memory is
//     invisible to page-cache reclaim. A request over the budget first frees
//     cached buffers, then fails with RESOURCE_EXHAUSTED naming the budget and
//     the usage.
//
// Why size classes and not best fit in large segments. Measured with
// ctxpool_bench_host (BM_HostWaste: 100000 sizes, log-uniform 1 KiB..4 GiB,
// waste = (rounded − requested) / rounded over all bytes): 4.2 % with 8
// classes per doubling, 8.2 % with 4, 27.7 % with powers of two. Best fit
// inside large pinned segments was not built: (a) cuMemHostAlloc's cost grows
// with the size, so carving saves little time for the large buffers whose
// waste matters; (b) a segment can be unpinned only when all of it is free,
// so Trim and the host budget would strand pinned memory behind one live
// buffer, where classes give back every free buffer; (c) one buffer per pin
// keeps Deallocate a hash lookup. 8 classes per doubling bound the waste of
// every request (< 12.5 % above 512 B), 4 only on average, so 8 is the
// default; the price is that a cached buffer serves a narrower size range.
//
// Example:
//
//   CTXPOOL_ASSIGN_OR_RETURN(auto host, CachingHostAllocator::Create(driver));
//   CTXPOOL_ASSIGN_OR_RETURN(void* buf, host->Allocate(64 << 20, stream));
//   ... fill buf; enqueue cuMemcpyAsync(device, buf, ..., stream) ...
//   host->Deallocate(buf);   // reused once the copy on `stream` completes
//   host->Trim();            // give cached pinned memory back
//
// Size 0: Allocate(0, s) returns a valid, unique 64 B buffer that must be
// deallocated like any other.
//
// fork(): CUDA state does not survive fork. In a process forked after Create
// every call that returns a Status fails with FAILED_PRECONDITION (as
// DeviceContext's do: create the allocator in each worker after the fork)
// and makes no driver call; IsRegistered is false there. Stats, Fragmentation
// and RoundedSize still read the (copied) bookkeeping. The destructor in the
// child frees nothing through the driver: it leaks the parent's pinned
// buffers, events and context reference. Do not touch the parent's buffers
// in the child: pinned pages may not be mapped there.
//
// Thread-safety: all methods are thread-safe (one absl::Mutex). A cache hit
// in Allocate takes the lock once and makes no driver call unless buffers are
// pending (then cuEventQuery on the oldest). Deallocate makes one cuStreamQuery
// per stream that used the buffer (and a cuEventRecord on a busy one):
// without it the allocator cannot know that the copy finished. Pinning and
// unpinning (cuMemHostAlloc / cuMemFreeHost / cuMemHostRegister) run without
// the lock held.
#ifndef CTXPOOL_ALLOC_HOST_ALLOCATOR_H_
#define CTXPOOL_ALLOC_HOST_ALLOCATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/host_size_classes.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

struct HostAllocatorOptions {
  // Device whose primary context is retained for driver calls when `context`
  // is null (released at destruction).
  int device = 0;
  // The context to make current for driver calls; null: see `device`.
  ContextHandle context;
  // Steps per power of two (a power of two in [1, 64]); see the header
  // comment for the measurement behind the default.
  int classes_per_doubling = 8;
  // Pinned bytes (cached + live + pending + registered) the allocator may
  // hold; 0 = unlimited. DeviceContext derives it from the process's cgroup
  // when the user sets none (CTXPOOL_HOST_BUDGET, ctxpool/core/cgroup.h).
  std::size_t host_budget_bytes = 0;
  // Where the budget comes from, named in its RESOURCE_EXHAUSTED errors
  // (e.g. "half of cgroup /kubepods/x memory.high (512 MiB)"); "" for none.
  std::string host_budget_source;
  // cuMemHostAlloc flags (kHostAllocPortable: usable from every context).
  unsigned host_alloc_flags = kHostAllocPortable;
  // cuMemHostRegister flags for Register.
  unsigned host_register_flags = kHostRegisterPortable;
  // Requests larger than this are INVALID_ARGUMENT; 0 = the host's physical
  // memory.
  std::size_t max_request_bytes = 0;
};

// Invariants (checked by CheckInvariants):
//   pinned_bytes == live_bytes + cached_bytes + pending_bytes
//   pinned_bytes + registered_bytes + in_flight <= host_budget_bytes (if set)
struct HostAllocatorStats {
  std::size_t live_bytes = 0;  // class bytes of buffers handed out
  std::size_t live_count = 0;
  std::size_t requested_bytes = 0;  // bytes callers asked for (live)
  std::size_t cached_bytes = 0;     // free, reusable now
  std::size_t cached_count = 0;
  std::size_t pending_bytes = 0;  // freed, waiting for a stream's event
  std::size_t pending_count = 0;
  std::size_t pinned_bytes = 0;  // live + cached + pending
  std::size_t peak_pinned_bytes = 0;
  std::size_t registered_bytes = 0;  // Register()ed, accounted apart
  std::size_t registered_count = 0;
  std::size_t host_budget_bytes = 0;  // 0 = unlimited
  std::int64_t num_allocs = 0;
  std::int64_t cache_hits = 0;
  std::int64_t upstream_allocs = 0;  // cuMemHostAlloc calls that succeeded
  std::int64_t upstream_frees = 0;   // cuMemFreeHost calls
  std::int64_t events_recorded = 0;  // Deallocate found a busy stream
  std::int64_t num_trims = 0;
  std::int64_t num_budget_failures = 0;  // RESOURCE_EXHAUSTED: budget
  std::int64_t num_ooms = 0;             // RESOURCE_EXHAUSTED: driver
  std::int64_t invalid_frees = 0;        // foreign pointer, double free
  std::int64_t invalid_requests = 0;     // bad sizes, bad registrations
};

class CachingHostAllocator {
 public:
  // Creates the allocator; retains the primary context of options.device
  // unless options.context is set. The driver must outlive the allocator.
  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<CachingHostAllocator>> Create(
      Driver& driver, HostAllocatorOptions options = {});

  // Frees every pinned buffer (live ones too; it waits for pending events)
  // and unregisters every registration. In a forked child: no driver call.
  ~CachingHostAllocator();

  CachingHostAllocator(const CachingHostAllocator&) = delete;
  CachingHostAllocator& operator=(const CachingHostAllocator&) = delete;

  // Returns a pinned buffer of at least `bytes` whose async copies are
  // enqueued on `stream` (used to order its reuse). A cached buffer of the
  // same class is reused when its previous streams are done with it.
  // INVALID_ARGUMENT when bytes > max_request_bytes; RESOURCE_EXHAUSTED when
  // the host budget or the driver's pinned memory is exhausted (after freeing
  // cached buffers).
  absl::StatusOr<void*> Allocate(std::size_t bytes, StreamHandle stream);

  // Returns `ptr` to the cache. It becomes reusable once the work already
  // enqueued on its allocation stream and on RecordStream'd streams has
  // completed. Never crashes: INVALID_ARGUMENT (and invalid_frees += 1) for a
  // pointer that is not the start of a live buffer of this allocator,
  // including a double free. A failing stream query or event record, or host
  // memory running out for the buffer's event list, makes the buffer wait
  // for the host synchronise of Reset instead (Trim, which never blocks,
  // counts it as busy).
  absl::Status Deallocate(void* ptr) noexcept;

  // Marks that work on `stream` uses `ptr` (e.g. a copy on a second stream).
  // REQUIRES: ptr is a live buffer of this allocator (else INVALID_ARGUMENT).
  absl::Status RecordStream(void* ptr, StreamHandle stream);

  // Frees cached buffers (largest first) until at most `keep_bytes` stay
  // cached. Pending buffers are polled first; those still pending are kept
  // and reported as busy_bytes (Trim never blocks on a stream).
  absl::StatusOr<TrimResult> Trim(std::size_t keep_bytes = 0);

  // Frees every cached and pending buffer (waiting for pending events, a
  // host synchronise). With live buffers it fails with FAILED_PRECONDITION
  // listing them, unless `force`, which frees them too. Registrations stay.
  absl::Status Reset(bool force = false);

  // Pins [ptr, ptr + bytes), memory the caller owns, with cuMemHostRegister.
  // The bytes count against the host budget. INVALID_ARGUMENT for a null or
  // empty range, and for a range that overlaps a registration or a buffer of
  // this allocator (checked before the driver is called);
  // RESOURCE_EXHAUSTED over the budget. Driver errors are returned as is.
  absl::Status Register(void* ptr, std::size_t bytes);
  // Unpins a range given to Register. INVALID_ARGUMENT unless `ptr` is the
  // start of a registration.
  absl::Status Unregister(void* ptr);
  // True when [ptr, ptr + bytes) lies inside one registration.
  bool IsRegistered(const void* ptr, std::size_t bytes = 1) const;

  HostAllocatorStats Stats() const;
  // free_bytes/free_blocks/largest_free_bytes describe cached buffers;
  // rounding waste is live class bytes − requested bytes.
  FragmentationStats Fragmentation() const;
  // The class size a request of `bytes` would take.
  std::size_t RoundedSize(std::size_t bytes) const;
  // Checks the invariants; OK or INTERNAL naming the first broken one.
  absl::Status CheckInvariants() const;
  // (Every Status-returning method above: FAILED_PRECONDITION in a process
  // forked after Create; see the header comment.)

  Driver& driver() const;
  const HostAllocatorOptions& options() const;

 private:
  class Impl;
  explicit CachingHostAllocator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_ALLOC_HOST_ALLOCATOR_H_
