// ctxpool/alloc/device_allocator.h — the caching, stream-ordered device
// allocator.
//
// CachingDeviceAllocator keeps device memory it got from the driver (segments)
// and hands out blocks carved from them, so the steady state of a server
// makes no driver call per tensor. It follows PyTorch's CUDACachingAllocator
// and RMM's pool resource where they are right and fixes where they are not:
//
//   * Requests round up to 512 B. Requests <= 1 MiB come from the small pool
//     (2 MiB segments); larger ones from the large pool (20 MiB segments, or
//     for requests >= 10 MiB a segment of their own, rounded up to 2 MiB).
//     A split leaves no tiny remainder: the small pool splits when >= 512 B
//     remain, the large pool when > 1 MiB remain (the rules are in
//     ctxpool/core/size_classes.h).
//   * Free blocks are indexed by (size, address) per (stream, pool): best fit
//     in O(log n) with an intrusive index (ctxpool/core/free_index.h), so
//     inserting and erasing never allocates. Blocks are split on allocate and
//     coalesced with free neighbours on free. Blocks larger than
//     max_split_size are not split.
//   * Stream order: a block freed with Deallocate is reusable at once by later
//     work on the stream it was allocated on. A block also used on other
//     streams (RecordStream) returns to the cache only when events recorded on
//     those streams complete; they are polled (cuEventQuery) when an Allocate
//     misses the cache and by Trim, never waited on by Allocate. Events come
//     from a pool: no event is created per free.
//   * A wholly free segment of one stream may be reused by another: the
//     allocator records an event on the owner stream and makes the new stream
//     wait on it (cuStreamWaitEvent) — ordering without a host synchronise
//     (counted in num_stream_waits).
//   * Destroyed streams: a block whose allocation stream was destroyed before
//     Deallocate is freed as usual. When the allocator later needs that
//     stream (to reuse or release its memory) the driver answers
//     CUDA_ERROR_INVALID_HANDLE; the allocator then waits once for the
//     context's work (cuCtxSynchronize, counted in num_host_syncs and
//     destroyed_streams) and treats the stream's memory as idle.
//   * Out of memory: free the cached blocks of the requesting stream, then all
//     cached memory (waiting only on the streams concerned), retry once; then
//     call the user's OOM callback, which may free memory and ask for one more
//     retry; then fail with RESOURCE_EXHAUSTED and a report.
//
// Example:
//
//   CTXPOOL_ASSIGN_OR_RETURN(auto alloc,
//                            CachingDeviceAllocator::Create(driver, 0));
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, alloc->Allocate(1 << 20, stream));
//   ... enqueue work using p on `stream` ...
//   alloc->Deallocate(p);            // stream-ordered: no synchronise needed
//   alloc->Trim(/*keep_bytes=*/0);   // give cached memory back to the driver
//
// Size 0: Allocate(0, s) returns a valid, unique pointer (a 512 B block) that
// must be deallocated like any other; this keeps "every successful Allocate
// has one Deallocate" true for callers such as PyTorch that ask for 0 bytes.
//
// Thread-safety: all methods are thread-safe. The pool is sharded by
// stream: the cached path of Allocate and Deallocate finds its stream's
// shard without a lock and takes that shard's spin lock once, makes no
// driver call and no heap allocation; so do the owned calls (Owners, below),
// which the session and the PyTorch plugin use. Threads on different
// streams share no lock and no written cache line on the cached path. Slow
// paths take a global lock and every shard's; they make the allocator's
// context current around their driver calls (ScopedContext) and restore the
// caller's. See docs/architecture.md, "Front end, pool, backing".
//
// Peaks: with one thread, whatever its streams, every peak is exact. With
// several threads on different streams, a device-wide (total) or owner's
// peak of allocation counts, allocated, active or requested bytes may miss
// or add what a stream changed within a short window (at most 1023 of its
// operations); it is never below the largest per-stream peak nor above the
// sum of the per-stream peaks. Reserved bytes and segment counts (changed
// only by slow paths), per-stream peaks and every current value are always
// exact.
//
// Owners: RegisterOwner names who allocates (a ModelSession, a plugin's
// model); an owned Allocate keeps the owner and a label (and the time, for
// an owner that records times) in the block and charges the owner's live bytes
// against its max under the same shard lock, and an owned Deallocate refuses
// blocks of another owner (or of another size, FreeCheck) before it frees
// anything. No side table.
//
// Expandable segments (BackingMode::kExpandable, needs a device with VMM):
// each (stream, pool) reserves one virtual range twice the size of the device's
// memory on its first allocation (and up to four at once when live blocks
// split them so that no place is left; Trim gives the empty ones back); its
// blocks split and coalesce inside the range as in a classic segment, and
// 2 MiB physical granules (cuMemCreate) are mapped under a block when it is
// handed out. Trim unmaps every granule wholly covered by free blocks (once
// the owner stream's queued work is done) into a per-device granule cache;
// growth on any stream maps a cached granule before it calls cuMemCreate, so
// physical memory moves between streams and models without a host
// synchronise of unrelated streams. In this mode the
// reserved_bytes statistics count MAPPED physical bytes (the operator's
// "reserved"); cached granules are reported separately (granule_cache_bytes).
// max_split_size does not apply (the range is one segment).
//
// Tenants (models), after cgroup v2's memory controller, on the physical
// bytes mapped (expandable) or reserved (classic) by the streams bound to
// them:
//
//   CTXPOOL_ASSIGN_OR_RETURN(TenantId llm, alloc->RegisterTenant(
//       "llm", Budget{.min = 4 << 30, .high = 20ull << 30, .max = 24ull <<
//       30}));
//   CTXPOOL_RETURN_IF_ERROR(alloc->BindStream(llm_stream, llm));
//
//   * max: growth beyond it first unmaps the tenant's own free granules, then
//     fails with RESOURCE_EXHAUSTED naming the tenant; others are unaffected.
//   * high: above it the tenant gives cached memory back. Expandable: each
//     Deallocate returns its free granules to the granule cache (no driver
//     call but cuMemUnmap). Classic: its wholly free segments go back to the
//     driver at the next check point (TrimIdle or a slow-path Allocate), not
//     in Deallocate, because cuMemFree synchronises the device; until then
//     they stay cached. Neither waits for a stream with queued work.
//   * min: under device pressure (cuMemCreate fails) free granules of other
//     tenants are reclaimed, most over budget first, never below their min.
// Unbound streams belong to the default tenant (kDefaultTenant, no limits).
//
// Decay (options.idle_release_after): cached memory unused that long is
// released at the next check point — the slow path of Allocate (after it
// served the request) or TrimIdle — never on the cached hot path, which does
// not read the clock. Expandable: a stream that took or freed no block for
// idle_release_after has its free mapped granules unmapped into the granule
// cache (once its queued work is done: a busy stream is skipped, not waited
// for), and cached granules unused that long are released to the driver.
// Classic: wholly free segments unused that long are returned to the driver
// (again skipping owners with queued work). Idleness is measured between
// check points: a stream or segment is stamped at the first check that sees
// it idle, so memory is released between idle_release_after and
// idle_release_after plus the gap between two checks after its last use;
// never earlier. Partly used segments of classic mode and min do not stop
// decay (it releases only a tenant's own idle cache).
//
// fork(): CUDA state does not survive fork. In a process forked after Create
// every call that returns a Status fails with FAILED_PRECONDITION naming the
// call and both pids (ForkGuard's message, as DeviceContext's and
// ModelSession's: create the allocator in each worker after the fork) and
// makes no driver call; the check is one relaxed atomic load before the
// lock. Stats, Fragmentation, Snapshot and ResetPeakStats still work on the
// (copied) bookkeeping. The destructor in the child makes no driver call: it
// leaks the parent's segments, granules, events and context reference.
//
// Invariants (checked by CheckInvariants(), listed in device_allocator.cc):
// segments are tiled exactly by coalesced blocks; every free block is in
// exactly one free index; reserved == allocated + pending_free + free; every
// statistic equals its sum over blocks, per stream and in total.
#ifndef CTXPOOL_ALLOC_DEVICE_ALLOCATOR_H_
#define CTXPOOL_ALLOC_DEVICE_ALLOCATOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "ctxpool/core/block.h"
#include "ctxpool/core/fragmentation.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/trace/recorder.h"

namespace ctxpool {

// How segments get their memory.
enum class BackingMode {
  kClassic,     // one cuMemAlloc per segment
  kExpandable,  // VMM: per-stream virtual range, 2 MiB granules mapped on
                // demand (see docs/architecture.md)
  kAuto,        // kExpandable where the device supports VMM, else kClassic
                // (resolved by Create: options().backing is never kAuto)
};

// What the OOM path tells the user callback and puts in the error message.
struct OomReport {
  std::size_t requested_bytes = 0;  // as asked
  std::size_t rounded_bytes = 0;    // after rounding
  StreamHandle stream;
  std::size_t live_bytes = 0;      // allocated to callers
  std::size_t reserved_bytes = 0;  // held from the driver
  std::size_t largest_free_bytes = 0;
  double fragmentation = 0.0;         // 1 − largest_free / total_free
  std::size_t device_free_bytes = 0;  // cuMemGetInfo
  std::size_t device_total_bytes = 0;
  // Expandable mode: physical memory the allocator holds unmapped in its
  // granule cache (not in reserved_bytes), ready to map anywhere; it was not
  // enough. Classic: 0.
  std::size_t cached_bytes = 0;
  // DeviceAllocatorOptions::memory_limit_bytes (0: none); with a limit the
  // allocator may run out with device memory to spare.
  std::size_t memory_limit_bytes = 0;
  // The stream's tenant ("default" when unbound) and what it holds.
  std::string tenant;
  std::size_t tenant_bytes = 0;  // reserved (classic) / mapped (expandable)
  std::size_t tenant_live_bytes = 0;
  // True when the tenant's max refused the growth (the device may have had
  // room).
  bool tenant_limit = false;
  // The new device memory the request needed (0 when not known, as for a
  // virtual range exhausted): classic, the segment it could not get;
  // expandable, the granules its placement had to map, more than the
  // granule cache and the device (or memory_limit_bytes) could supply.
  std::size_t growth_bytes = 0;
  std::size_t tenant_max_bytes = 0;
  // Free bytes (in reserved_bytes) that no trim or reclaim can give back
  // while the live blocks beside them live: expandable, those on a mapping
  // (a granule, or a unit of them) that a live or pending block shares;
  // classic, those in segments that hold a live or pending block. What
  // stands between live_bytes and the device's capacity when the granule
  // cache and the device are spent. Device-wide, in a tenant's OOM too
  // (whose text gives the tenant's figures only).
  std::size_t stranded_free_bytes = 0;
  // Expandable mode: none of the stream's virtual ranges for the pool (each
  // twice the device's memory; a fourth is the most) had a place for the
  // request, whatever the device had: live blocks spread over them split
  // them. virtual_range_bytes is their size in all.
  bool virtual_range_exhausted = false;
  std::size_t virtual_range_bytes = 0;
  std::string ToString() const;
};

// Called once per failed allocation after the allocator's own retry, for the
// device running out and for a tenant's max alike (report.tenant_limit tells
// which), as PyTorch calls its OOM observers for every OOM. Return true to
// have the allocator retry one more time (after the callback freed
// something), false to fail. Called without the allocator's lock held: it may
// call Deallocate and Trim.
using OomCallback = std::function<bool(const OomReport&)>;

// The most units DeviceAllocatorOptions::vmm_chunk_units may name, so that a
// chunk's granule count (unit * units) cannot overflow.
inline constexpr std::size_t kMaxVmmChunkUnits = 65536;

struct DeviceAllocatorOptions {
  std::size_t round_bytes = 512;
  std::size_t small_size_limit = 1 << 20;  // <= goes to the small pool
  std::size_t small_segment_bytes = 2 << 20;
  std::size_t large_segment_bytes = 20 << 20;
  std::size_t large_round_bytes = 2 << 20;  // larger requests round to this
  // Large requests at least this big get a segment of their own (rounded to
  // large_round_bytes); smaller ones share large_segment_bytes segments.
  std::size_t large_own_segment_bytes = 10 << 20;
  // Free blocks larger than this are never split, and are used only for
  // requests larger than it (PyTorch's max_split_size_mb). Default: no limit.
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  // DeviceContext picks the backing from CTXPOOL_BACKING (default "auto":
  // kExpandable where the device supports VMM); a direct user chooses here.
  BackingMode backing = BackingMode::kClassic;
  // The device memory this allocator may hold (mapped, cached granules and
  // segments alike), like PyTorch's set_per_process_memory_fraction: growth
  // past it is treated as the device running out (cached memory is
  // reclaimed and the request retried, then RESOURCE_EXHAUSTED with the
  // OOM report). 0: the device's capacity. DeviceContext reads
  // CTXPOOL_MEMORY_LIMIT.
  std::size_t memory_limit_bytes = 0;
  // Expandable backing: new memory is mapped in units of a power of two
  // granules (one cuMemMap each), and a unit is also the least that can
  // move later: a mapping unmaps only whole. A unit is at most
  // 1/vmm_unit_divisor of the memory still free (the device's total memory,
  // or memory_limit_bytes, less what the allocator holds): large while
  // memory is plentiful (a cold 512 MiB tensor on an empty 80 GB device is 8
  // mappings, and a cold stream maps ahead like a classic segment), single
  // granules near the limit, where every free granule must be able to move
  // to where it is needed. A run of 1 GiB or more may use units up to 8
  // times coarser, at most 1/8 of itself, where units are not single
  // granules (a cold 7 GiB tensor: 14 mappings). 0: always single granules.
  std::size_t vmm_unit_divisor = 1024;
  // Expandable backing: new physical memory is created in chunks of up to
  // this many units (one cuMemCreate each; single granules stay single), so
  // the 1 GiB tensor above costs one cuMemCreate. The driver frees a
  // physical allocation only whole: Trim and decay give a chunk back once
  // none of it is mapped, so a live block keeps its chunk's cached rest
  // (reused by any stream before new memory is created). 1: a chunk per
  // unit, as precise as the units. Between 1 and kMaxVmmChunkUnits.
  std::size_t vmm_chunk_units = 16;
  // The context to make current for driver calls; null means retain the
  // device's primary context (released at destruction).
  ContextHandle context;
  OomCallback on_oom;
  // Decay (see the banner): cached memory unused for this long — free mapped
  // granules of an idle stream and cached granules (expandable), wholly free
  // segments (classic) — is released at the next slow-path Allocate or
  // TrimIdle() (never on the cached hot path). InfiniteDuration() keeps it
  // until Trim.
  absl::Duration idle_release_after = absl::InfiniteDuration();
  // The clock for idle_release_after; null means absl::Now (tests inject).
  std::function<absl::Time()> clock;
};

// What CachingDeviceAllocator::Create checks of the size options (powers of
// two, consistent segment sizes): INVALID_ARGUMENT naming the problem. The
// tools call it on a parsed --config, so bad values are bad input.
absl::Status ValidateDeviceAllocatorOptions(const DeviceAllocatorOptions& o);

// A tenant (model) of the allocator; see the banner.
using TenantId = std::uint32_t;
inline constexpr TenantId kDefaultTenant = 0;
inline constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();

// Budget of a tenant in bytes of physical memory. REQUIRES: min <= max.
struct Budget {
  std::size_t min = 0;          // protected from reclaim by other tenants
  std::size_t high = kNoLimit;  // above it cached memory is given back
  std::size_t max = kNoLimit;   // hard limit
};

struct TenantStats {
  std::string name;
  Budget budget;
  std::size_t live_bytes = 0;    // allocated to callers on its streams
  std::size_t mapped_bytes = 0;  // physical bytes its streams hold
  std::size_t cached_bytes = 0;  // mapped − live (free, kept mapped)
  std::size_t peak_mapped_bytes = 0;
  std::size_t reclaimed_from_bytes = 0;  // taken from it under pressure
  std::size_t reclaimed_by_bytes = 0;    // it took from others
  std::int64_t num_ooms = 0;             // its RESOURCE_EXHAUSTED results
  std::int64_t num_streams = 0;          // streams bound to it
};

// Stat, StatPool, StatArray and PoolStats live in ctxpool/core/stats.h;
// FragmentationStats in ctxpool/core/fragmentation.h; BlockState in
// ctxpool/core/block.h (shared with the other allocators).

struct DeviceAllocatorStats {
  PoolStats total;
  std::vector<std::pair<StreamHandle, PoolStats>> per_stream;
  std::int64_t num_alloc_retries = 0;  // OOM path taken
  std::int64_t num_ooms = 0;           // RESOURCE_EXHAUSTED returned
  std::int64_t cache_hits = 0;         // allocations served without driver
  std::int64_t upstream_allocs = 0;    // cuMemAlloc / cuMemCreate calls
  std::int64_t upstream_frees = 0;     // cuMemFree / cuMemRelease calls
  std::int64_t num_trims = 0;
  std::int64_t num_stream_waits = 0;  // cross-stream reuses ordered by events
  std::int64_t num_host_syncs = 0;    // event/stream synchronises (OOM, Trim)
  std::int64_t invalid_frees = 0;     // foreign pointer, double free
  // Of those, frees refused because FreeCheck::requested_bytes differed
  // from the allocation's size.
  std::int64_t mismatched_frees = 0;
  std::int64_t invalid_requests = 0;  // bad sizes, bad streams
  // Streams found destroyed while the allocator still cached their memory;
  // their work was waited for (a context synchronise) before reuse.
  std::int64_t destroyed_streams = 0;
  // Driver calls that failed on paths that cannot return the error to a
  // caller (an event query while polling pending frees, a free while
  // trimming): the allocator kept its state and will ask again.
  std::int64_t driver_errors = 0;
  // Device memory the allocator stopped tracking because the driver refused
  // to free it (a forced Reset or the destructor under a persistent
  // cuMemFree / cuMemUnmap / cuMemRelease fault). Never silent: see the
  // failure model in docs/architecture.md.
  std::size_t leaked_bytes = 0;
  // Expandable mode: granules mapped and unmapped (cuMemMap / cuMemUnmap),
  // and the bytes of unmapped granules kept in the per-device cache.
  std::int64_t granule_maps = 0;
  std::int64_t granule_unmaps = 0;
  std::size_t granule_cache_bytes = 0;
};

// An owner of allocations (see "Owners" in the banner): 0 is none.
using OwnerId = std::uint32_t;
inline constexpr OwnerId kNoOwner = 0;
// For Deallocate / RecordStream: whatever owns the block.
inline constexpr OwnerId kAnyOwner = std::numeric_limits<OwnerId>::max();

// What Deallocate checks before it frees anything.
struct FreeCheck {
  OwnerId owner = kAnyOwner;  // the block must belong to this owner
  // With check_size, the block must have been requested with exactly
  // `requested_bytes` (PyTorch's free passes the size; every value, SIZE_MAX
  // included, is compared): a mismatch is refused and counted.
  bool check_size = false;
  std::size_t requested_bytes = 0;
  // With owner == kAnyOwner: refuse a block that has no owner (memory the
  // caller's layer did not hand out, e.g. taken from the allocator bare).
  bool owned_only = false;
  // With order_after_stream: the free is also ordered after the work already
  // enqueued on `stream` (as RecordStream(ptr, stream) then Deallocate, in
  // one critical section; nothing extra for the allocation stream). This is
  // cuda::mr's deallocate(stream, ...) for a block used on another stream.
  bool order_after_stream = false;
  StreamHandle stream{};
};

struct OwnerStats {
  std::string name;
  std::size_t max_live_bytes = 0;  // 0: no limit
  std::size_t live_bytes = 0;      // charged (see RegisterOwner)
  std::size_t peak_live_bytes = 0;
  std::size_t requested_bytes = 0;  // as asked, of live allocations
  std::int64_t live_allocations = 0;
  std::int64_t num_allocs = 0;
  std::int64_t num_frees = 0;
  std::int64_t num_ooms = 0;               // device (or tenant) exhausted
  std::int64_t num_budget_rejections = 0;  // over max_live_bytes
  std::int64_t invalid_frees = 0;          // not a live block of the owner
  bool closed = false;
};

// How an owner is registered (RegisterOwner).
struct OwnerOptions {
  // A hard limit on the owner's charged live bytes; 0: none.
  std::size_t max_live_bytes = 0;
  // Stamp each of its allocations with the time (OwnedBlock::
  // allocated_at_ns, the ages of a session's leak report). One coarse clock
  // read per allocation, ~4 ns, which is a third of what an owner adds to a
  // cached pair: off unless asked for, as PyTorch records allocation times
  // only while its memory history is on.
  bool record_times = false;
};

// A live block of an owner.
struct OwnedBlock {
  DevicePtr ptr;
  std::size_t requested_bytes = 0;
  std::size_t charged_bytes = 0;
  StreamHandle stream;          // allocation stream
  const char* label = nullptr;  // as given to Allocate
  // When it was allocated, if its owner records times (else 0):
  // absl::GetCurrentTimeNanos() clock, read coarsely: 0 to a few kernel
  // ticks (milliseconds) early, never late.
  std::int64_t allocated_at_ns = 0;
};

struct BlockInfo {
  DevicePtr ptr;
  std::size_t size = 0;             // rounded size of the block
  std::size_t requested_bytes = 0;  // 0 unless allocated
  StreamHandle stream;              // allocation stream (owner)
  BlockState state = BlockState::kFree;
  // Bytes of the block backed by physical memory: `size` in classic mode and
  // for blocks in use; in expandable mode a free block may lie partly or
  // wholly on unmapped granules (virtual space only).
  std::size_t mapped_bytes = 0;
  OwnerId owner = kNoOwner;     // allocated blocks: their owner
  const char* label = nullptr;  // allocated blocks: their label
};

struct SegmentInfo {
  DevicePtr base;
  std::size_t size = 0;
  StreamHandle stream;
  bool small_pool = false;
  // Expandable mode: the segment is a stream's virtual range and only
  // `mapped_bytes` of it are backed; classic: mapped_bytes == size.
  bool expandable = false;
  std::size_t mapped_bytes = 0;
  std::vector<BlockInfo> blocks;  // by address, covering [base, base+size)
};

struct AllocatorSnapshot {
  std::vector<SegmentInfo> segments;  // by address
};

struct TrimResult {
  std::size_t freed_bytes = 0;  // returned to the driver
  // Still reserved after the trim (expandable: mapped + cached granules; for
  // SetBudget: the tenant's mapped bytes).
  std::size_t remaining_bytes = 0;
  std::size_t busy_bytes = 0;  // free but kept: a stream still uses it
  int event_waits = 0;         // pending events it had to wait for
};

class CachingDeviceAllocator {
 public:
  // Creates an allocator for `device`. The driver must outlive it. Retains
  // the device's primary context unless options.context is set.
  // INVALID_ARGUMENT for inconsistent options, FAILED_PRECONDITION for
  // BackingMode::kExpandable on a device without VMM support or a driver
  // that reports more than 2^62 bytes of device memory, or the driver's
  // error.
  static absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> Create(
      Driver& driver, int device, DeviceAllocatorOptions options = {});

  // Returns all memory to the driver (as Reset(/*force=*/true)). In a
  // forked child: no driver call (see "fork()" in the banner).
  ~CachingDeviceAllocator();

  CachingDeviceAllocator(const CachingDeviceAllocator&) = delete;
  CachingDeviceAllocator& operator=(const CachingDeviceAllocator&) = delete;

  // Returns a block of at least `bytes` usable by work on `stream` in stream
  // order: work enqueued on `stream` after this call may use it at once.
  // INVALID_ARGUMENT (invalid_requests += 1) for sizes no device could hold
  // (> the device's total memory); RESOURCE_EXHAUSTED with the OomReport in
  // the message when memory runs out (after the OOM path in the banner).
  // REQUIRES: `stream` is a live stream of the allocator's context (or the
  // null stream). Calls options.on_oom, if set, without the lock.
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream);

  // Returns `ptr` to the cache, ordered after the work already enqueued on its
  // allocation stream (and on streams named by RecordStream). Never crashes:
  // INVALID_ARGUMENT (and invalid_frees += 1) for a pointer that is not the
  // start of a live block of this allocator, including a double free.
  absl::Status Deallocate(DevicePtr ptr) noexcept;

  // Marks that work on `stream` uses `ptr`: after Deallocate the block is not
  // reused until the work enqueued on `stream` before the Deallocate
  // completes. The caller orders `stream`'s use after the allocation
  // stream's (as with any cross-stream use). A no-op for the allocation
  // stream. INVALID_ARGUMENT for a pointer that is not a live block.
  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream);

  // ---- Owners --------------------------------------------------------------
  // An owner is who allocated a block (a ModelSession, a plugin's model):
  // the allocator keeps the owner, a label (and, when the owner asks, the
  // allocation time) in the block itself and charges the owner's live bytes
  // under the same lock that serves the block, so an owned Allocate or
  // Deallocate is one critical section with no side table and no heap
  // allocation. A charge is the request rounded up to options().round_bytes
  // (round_bytes for size 0). Owners are not tenants: a tenant is charged the
  // physical memory its streams hold, an owner the live bytes it asked for, on
  // any stream.
  //
  // Registers an owner; `max_live_bytes` (0: none) is a hard limit on its
  // charged live bytes, exact under concurrency: an Allocate that would
  // pass it fails with RESOURCE_EXHAUSTED and counts a budget rejection.
  // Ids are never reused. INVALID_ARGUMENT for an empty name.
  absl::StatusOr<OwnerId> RegisterOwner(absl::string_view name,
                                        std::size_t max_live_bytes = 0);
  // As above, with OwnerOptions (its max, and whether its allocations are
  // stamped with their time).
  absl::StatusOr<OwnerId> RegisterOwner(absl::string_view name,
                                        const OwnerOptions& options);
  // RegisterOwner(name, true) would be a max of 1 byte: say OwnerOptions.
  absl::StatusOr<OwnerId> RegisterOwner(absl::string_view name,
                                        bool record_times) = delete;
  // Allocate, charged to `owner` (kNoOwner: as the plain Allocate) and
  // labelled `label` (REQUIRES: null or outlives the block). Also
  // INVALID_ARGUMENT for an unknown owner, FAILED_PRECONDITION for a closed
  // one.
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream,
                                     OwnerId owner,
                                     const char* label = nullptr);
  // Deallocate after `check`: INVALID_ARGUMENT, with nothing freed, for a
  // block of another owner or of another size. Counted in the owner's
  // invalid_frees when check.owner names one, else in the allocator's.
  absl::Status Deallocate(DevicePtr ptr, const FreeCheck& check) noexcept;
  // RecordStream for a block of `owner` (INVALID_ARGUMENT otherwise).
  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream, OwnerId owner);
  // NOT_FOUND for an unknown (or unregistered) owner.
  absl::StatusOr<OwnerStats> GetOwnerStats(OwnerId owner) const;
  // The owner's live blocks, by address.
  absl::StatusOr<std::vector<OwnedBlock>> OwnedBlocks(OwnerId owner) const;
  // Refuses the owner's further allocations (FAILED_PRECONDITION) and, in
  // the same critical section, frees every block it still has (stream-
  // ordered, as Deallocate): a free racing with it either came first or
  // finds nothing. Puts the blocks it freed in `*freed`, by address (a leak
  // report); a block whose free failed (a driver error ordering a
  // RecordStream use) stays live, is left out and its error returned.
  // NOT_FOUND for an unknown owner.
  absl::Status CloseOwner(OwnerId owner, std::vector<OwnedBlock>* freed);
  // Forgets the owner and returns its final stats; blocks still live stay
  // allocated and are owned by nobody from then on.
  absl::StatusOr<OwnerStats> UnregisterOwner(OwnerId owner);

  // Returns cached memory to the driver until at most `keep_bytes` stay
  // reserved beyond live blocks, largest wholly free segments first
  // (expandable: unmaps every granule wholly covered by free blocks into the
  // granule cache, gives back every virtual range left mapping nothing but a
  // stream's last one for each pool, then releases cached granules down to
  // `keep_bytes`). First waits for the events of pending frees. Never
  // releases memory a pending stream may still touch: waits on that stream's
  // event (counted in the result and in num_host_syncs); memory it cannot
  // wait for stays (busy_bytes). A driver error leaves the segment cached
  // and is returned.
  absl::StatusOr<TrimResult> Trim(std::size_t keep_bytes = 0);

  // The explicit check point (see "high" and "Decay" in the banner): polls
  // pending frees; tenants above their high shed (expandable: free granules
  // to the cache; classic: wholly free segments to the driver); then decay
  // runs. Never waits: memory of a stream with queued work stays and is
  // counted in busy_bytes. freed_bytes counts what went back to the driver
  // (not granules moved to the cache); remaining_bytes is reserved plus
  // cached bytes. A server calls it between requests. Thread-safe; makes the
  // allocator's context current around its driver calls.
  absl::StatusOr<TrimResult> TrimIdle();

  // ---- Tenants -------------------------------------------------------------
  // Registers a tenant. INVALID_ARGUMENT for an empty name, the name of a
  // registered tenant (the default tenant's "default" is not reserved) or
  // budget.min > budget.max.
  absl::StatusOr<TenantId> RegisterTenant(absl::string_view name,
                                          Budget budget);
  // Charges later allocations on `stream` (and the memory it holds now) to
  // `tenant`. INVALID_ARGUMENT for an unknown tenant or a stream bound
  // before.
  absl::Status BindStream(StreamHandle stream, TenantId tenant);
  // Returns `stream` to the default tenant with everything it holds, so a
  // pooled stream can serve the next tenant: its cached memory and any block
  // still live on it (the caller frees the tenant's own blocks first; what
  // remains, e.g. a slab another component keeps on the stream, is charged
  // to the default tenant from then on, as BindStream charges what a stream
  // holds). INVALID_ARGUMENT for a stream that is not bound. Thread-safe; no
  // driver call, no stream-order effect.
  absl::Status UnbindStream(StreamHandle stream);
  // Call before destroying `stream` (cuStreamDestroy) while the allocator may
  // still hold memory for it. Records one event on it now, while the handle
  // is valid; from then on the allocator never passes the handle to the
  // driver (a real driver recycles stream handles, so a dead one may name
  // another stream): other streams reuse its memory after that event
  // (cuStreamWaitEvent, no host synchronise), Trim and Reset wait for that
  // event. Blocks still live on it may be freed later as usual. If the
  // handle comes back (a new stream with the same handle), its first
  // Allocate waits for the event once. OK (nothing recorded) for a stream
  // the allocator never saw or already retired.
  // REQUIRES: no work is enqueued on `stream` after this call.
  absl::Status RetireStream(StreamHandle stream);
  // Forgets `tenant`: its name may be registered again and its id may be
  // returned by a later RegisterTenant (so a stale id must not be used).
  // INVALID_ARGUMENT for the default or an unknown tenant;
  // FAILED_PRECONDITION while a stream is bound to it (UnbindStream first).
  absl::Status UnregisterTenant(TenantId tenant);
  // Changes a budget at run time. When max drops below the tenant's mapped
  // bytes, unmaps its free granules (waiting for its streams' queued work,
  // counted in event_waits) and reports what remains in remaining_bytes;
  // busy_bytes is what stays above max. INVALID_ARGUMENT as RegisterTenant.
  absl::StatusOr<TrimResult> SetBudget(TenantId tenant, Budget budget);
  // NOT_FOUND for an unknown tenant.
  absl::StatusOr<TenantStats> GetTenantStats(TenantId tenant) const;

  // The allocator's trace recorder (off until Enable): allocations, frees,
  // free completions, segment/granule maps and unmaps, trims and OOMs.
  TraceRecorder& trace_recorder();

  // Drops everything: waits for the owner streams' queued work, then frees
  // every segment. With live allocations it fails with FAILED_PRECONDITION
  // listing them (pointer, size, stream) and changes nothing, unless `force`
  // (their pointers become invalid). Counters and peaks are kept.
  absl::Status Reset(bool force = false);

  // Copies of the statistics (PyTorch-shaped, per pool and per stream), the
  // fragmentation figures, and every segment with its blocks. O(streams) for
  // Stats, O(blocks) for Snapshot; each is consistent (taken under the lock).
  DeviceAllocatorStats Stats() const;
  FragmentationStats Fragmentation() const;
  AllocatorSnapshot Snapshot() const;
  // The device memory the allocator holds now: reserved bytes (classic:
  // segments; expandable: mapped granules) plus the granule cache. O(1), one
  // short critical section: for a caller that polls after every operation
  // (a planner tracking a device's peak), where Stats() would copy every
  // stream's counters.
  std::size_t PhysicalBytes() const;
  // The live block that starts at `ptr`, or NOT_FOUND.
  absl::StatusOr<BlockInfo> Lookup(DevicePtr ptr) const;
  // Sets every peak to its current value: the device totals, each stream,
  // each owner (OwnerStats::peak_live_bytes) and each tenant.
  void ResetPeakStats();

  // Checks the invariants (see device_allocator.cc); OK or INTERNAL naming
  // the first broken one.
  absl::Status CheckInvariants() const;
  // (Every Status-returning method above: FAILED_PRECONDITION in a process
  // forked after Create; see "fork()" in the banner.)

  int device() const;
  Driver& driver() const;
  // The context the allocator's memory lives in (the device's primary
  // context unless options().context was set): current it (ScopedContext)
  // to enqueue work on the allocator's memory from another thread.
  ContextHandle context() const;
  const DeviceAllocatorOptions& options() const;
  // The device's total memory: Allocate refuses anything larger.
  std::size_t device_total_bytes() const;

 private:
  class Impl;
  explicit CachingDeviceAllocator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_ALLOC_DEVICE_ALLOCATOR_H_
