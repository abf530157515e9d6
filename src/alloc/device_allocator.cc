// CachingDeviceAllocator: the implementation.
//
// The pool is sharded by stream (docs/architecture.md, "Front end, pool,
// backing"). Each stream's StreamState, its *shard*, has its own spin lock
// and everything a cached Allocate or Deallocate touches: its free indexes,
// its live blocks by address, its Block arena, its stats and the owners'
// sub-accounts. A cached call finds its shard without taking a lock
// (address_map.h: the stream table for Allocate; the segment page map or
// the range table for Deallocate) and takes that shard's lock only, once.
// Everything else is under the global lock mu_: segments, the backings,
// tenants, the owners' records, pending events, the event pool. A slow path
// takes mu_ and then every shard's lock (AllShards), so it may read and
// change any shard as the single-lock allocator did.
//
// Lock order: mu_, then shard locks in any order (only the holder of mu_
// takes more than one, and a cached call holds one and waits for no other),
// then the trace recorder's mutex. A cached call that needs the slow path
// releases its shard lock before it takes mu_.
//
// Data structures:
//   mu_          segments_ (every segment, by base), streams_ (every shard),
//                pending_, event_pool_, vmm_, tenants_, owners_, counters.
//   lock-free    stream_table_ (handle -> shard), pages_ (classic: address
//                -> segment), ranges_ (expandable: address -> range), and a
//                segment's `shard` (its owner).
//   ss->mu       free[2] / unmapped[2] (free indexes), whole_free[2] (classic:
//                the stream's wholly free segments), live (allocated blocks
//                by address), blocks (the Block arena), stats, pending,
//                subs (owners' sub-accounts), cache_hits, ops.
//
// Device totals (Stats().total) and owners' live bytes are sums over shards
// whose peaks must be those of the sum. Each is kept by one shard at a
// time, the *holder*, which adds to it under its own lock; another shard
// keeps its changes pending (deltas and their running maximum, a PoolStats
// of deltas whose peaks are the prefix maxima) and takes the sum over by
// try-locking the holder's lock and folding its pending changes in
// (TakeHolder). A shard takes over at once from one last used by the same
// thread, so with one thread, whatever its streams, totals and peaks are
// exact. A shard that took the sum from another thread, or found it busy,
// backs off (tries again after 2^k - 1 of its operations, up to
// kMaxBackoff) and shares no cache line in between; with several threads a
// peak may then be off by what the shards that do not hold the sum changed
// within their current window (reported peaks are clamped to the sum of the
// per-stream peaks). Reserved bytes change only under AllShards, which
// folds every shard: their peaks stay exact. Readers fold every shard under
// AllShards, so current values are always exact.
//
// Owners' budgets (max) stay exact with no shared write on the cached path:
// an owner's record hands its max out as credit to sub-accounts (one per
// stream the owner allocates on); an owned Allocate takes its charge from
// its sub-account's credit and a Deallocate gives it back, so only refills
// and returns of whole chunks write the record's atomic `reserved`, and
// reserved == sum(live + credit) <= max at every moment. When neither the
// credit nor the record can cover a charge, the slow path takes every
// shard, pulls all of the owner's credit back and decides on its exact live
// bytes.
//
// Invariants (CheckInvariants checks each one):
//   I1  the blocks of each segment tile it exactly and are coalesced
//       (no two neighbours free): see CheckSegmentTiling.
//   I2  every free block is in exactly one index, its owner stream's index
//       for its pool, under key (size, address); no other block is indexed.
//   I3  a segment is in its stream's whole_free[pool] <=> its only block is
//       free.
//   I4  each stream's `live` holds exactly its allocated blocks, keyed by
//       their address.
//   I5  a pending-free block has pending_events > 0, and pending_ holds
//       exactly sum(pending_events) entries, all for pending-free blocks.
//   I6  every stat's current value equals the sum over blocks/segments, per
//       stream and in total:
//         allocation     == #allocated blocks
//         active         == #allocated + #pending-free blocks
//         inactive_split == #free blocks in segments with more than one block
//         segment        == #segments;  reserved_bytes == sum(segment sizes)
//         (and the same for the *_bytes sums; requested_bytes sums the sizes
//         callers asked for).
//   I7  reserved == allocated + pending_free + free  (bytes, in total).
//   I8  each stream's arena has handed out exactly the blocks of its
//       segments.
//   Expandable mode (a segment per virtual range; a (stream, pool) holds
//   one, and up to kMaxRanges when live blocks split them):
//   I7 is replaced by
//   I9  a segment's reserved bytes == its mapped granules × granule, and
//       every block but the unmapped ones lies on mapped granules;
//   I10 no expandable segment is wholly free-indexed, and inactive_split
//       counts nothing (the unmapped tail is not cached memory);
//   I11 an unmapped block is free, granule aligned, has no mapped granule,
//       and sits in its stream's `unmapped` index (the mapped free blocks in
//       `free`); I1's coalescing is per kind: a mapped and an unmapped free
//       block may be neighbours. A quarantined block (mapped, no access:
//       a failed cuMemSetAccess whose rollback failed) is free, mapped and
//       in no index, and never coalesces.
//   I12 every physical allocation (the backing's) is mapped granules + cached
//       pieces + leaked granules (dropped while mapped by a forced Reset):
//       sum(granules) == mapped + cached + leaked, sum(mapped) × granule ==
//       reserved, and each cached piece lies inside its allocation;
//   I13 an owner's live charge and count equal the sums over the allocated
//       blocks tagged with it (each on the sub-account of its block's
//       stream), its reserved == sum(live + credit) over its sub-accounts,
//       never above its max; only registered owners tag blocks.
//   I14 every stream is in exactly one tenant's stream list, its own; a
//       tenant's `mapped` is the sum of its streams' reserved bytes.
//   I15 the lock-free maps agree with the books: the stream table finds
//       every stream, the page map (classic) or the range table
//       (expandable) finds every segment at its base and last byte, and a
//       segment's `shard` is the state of its stream.
//
// Hot path: Allocate finds its shard, locks it, looks up the free index
// (one LowerBound) and TakeBlock unlinks the block (and links a split
// remainder), inserts it into the shard's `live` (capacity reserved) and
// updates the shard's stats and the device totals (or the shard's pending
// changes); an owned call also charges its sub-account: no driver call, no
// heap allocation once the shard is warm. Deallocate is the mirror image.
// For decay it only bumps the stream's operation counter (and clears a
// classic segment's idle stamp); the clock is read by the check points
// (DecayIdle), never here. Everything else (a stream's first use, event
// polling, cross-stream reuse, new segments, the OOM path, errors) is the
// slow path.
#include "ctxpool/alloc/device_allocator.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "address_map.h"
#include "classic_backing.h"
#include "ctxpool/core/block.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/core/fragmentation.h"
#include "ctxpool/core/free_index.h"
#include "ctxpool/core/internal/coarse_clock.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/internal/spin_lock.h"
#include "ctxpool/core/internal/table_room.h"
#include "ctxpool/core/segment.h"
#include "ctxpool/core/size_classes.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/status.h"
#include "expandable_backing.h"
#include "segment_backing.h"

namespace ctxpool {
namespace {

using alloc_internal::BackedRange;
using alloc_internal::ClassicBacking;
using alloc_internal::ExpandableBacking;
using alloc_internal::ExpandableOptions;
using alloc_internal::RangeTable;
using alloc_internal::SegmentBacking;
using alloc_internal::SegmentPageMap;
using alloc_internal::StreamTable;
using alloc_internal::StuckPiece;
using alloc_internal::VmmRange;
using core_internal::SpinLock;
using core_internal::SpinLockHolder;

// The most operations a shard defers its share of a sum while another
// thread holds it (TakeHolder).
constexpr std::uint32_t kMaxBackoff = 1023;

// True while this thread holds every shard lock of an allocator (AllShards):
// then no other thread can touch a sum, and a shard takes it at once.
thread_local bool tls_all_shards_held = false;

// The largest device memory the allocator accepts (CachingDeviceAllocator::
// Create refuses a driver that reports more): requests are at most the
// device's total, so sizes, charges and rounding stay far from overflow.
constexpr std::size_t kMaxDeviceBytes = std::size_t{1} << 62;

// A shard's live map starts with room for this many blocks.
constexpr std::size_t kInitialLiveCapacity = 256;

int PoolIndex(bool small) { return small ? 0 : 1; }

// Expandable mode: the most virtual ranges a (stream, pool) may hold, each
// twice the device's memory. The first is reserved on first use; another
// only when no earlier one has a place for a request (live blocks split
// them), as PyTorch opens another expandable segment.
constexpr int kMaxRanges = 4;

// Which mapped free blocks a walk over a stream's free granules visits:
// those of `pool` (a PoolIndex; -1: both) inside [lo, hi).
struct Within {
  int pool = -1;
  std::uint64_t lo = 0;
  std::uint64_t hi = std::numeric_limits<std::uint64_t>::max();
};

struct StreamState;
struct OwnerRec;

// How a shard takes part in a sum kept by a holder shard (TakeHolder): the
// operations to wait before it tries to take the sum over again, and the
// next wait, doubled while other threads keep it.
struct FoldCtl {
  std::uint32_t countdown = 0;
  std::uint32_t backoff = 0;
};

// An owner's share on one stream: guarded by that stream's shard lock
// (the shard owns it; blocks of the owner on the stream point at it). Its
// own cache line: sub-accounts of one owner on two streams are written by
// two threads.
struct alignas(64) SubAccount {
  OwnerId owner = kNoOwner;
  OwnerRec* rec = nullptr;
  std::size_t max = 0;        // the owner's max (0: none)
  std::size_t chunk = 0;      // credit taken from the record at a time
  bool closed = false;        // the owner refuses allocations
  bool record_times = false;  // its blocks are stamped with their time
  std::size_t credit = 0;     // reserved from the record, not charged yet
  std::size_t live = 0;       // charged bytes of its live blocks
  std::size_t peak = 0;       // of `live`
  std::size_t requested = 0;
  std::int64_t allocs = 0;
  std::int64_t frees = 0;
  std::int64_t reclaimed = 0;  // freed by CloseOwner or a forced Reset
  // Changes of `live` not yet in the owner's sum (delta, its running max).
  std::int64_t pending_live = 0;
  std::int64_t pending_peak = 0;
  FoldCtl fold;
};

// The cached state of one stream: a shard of the pool (see the file
// comment). Its own cache line, so that threads on different streams share
// none on the cached path.
struct alignas(64) StreamState {
  explicit StreamState(std::uint64_t s) : stream(s) {
    core_internal::MakeRoom(live, kInitialLiveCapacity);
  }
  mutable SpinLock mu;
  const std::uint64_t stream;
  FreeIndex<Block> free[2] ABSL_GUARDED_BY(mu);  // [0] small, [1] large
  // Expandable mode: `free` holds only free blocks on mapped granules (the
  // hot path takes them as they are); the free blocks over unmapped
  // granules of the stream's ranges sit here, by (size, address).
  FreeIndex<Block> unmapped[2] ABSL_GUARDED_BY(mu);
  // Classic mode: the stream's wholly free segments, by (size, base).
  FreeIndex<Segment> whole_free[2] ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::uint64_t, Block*> live ABSL_GUARDED_BY(mu);
  BlockPool blocks ABSL_GUARDED_BY(mu);
  PoolStats stats ABSL_GUARDED_BY(mu);
  // Changes not yet in the device totals (see the file comment).
  PoolStats pending ABSL_GUARDED_BY(mu);
  FoldCtl totals_fold ABSL_GUARDED_BY(mu);
  std::int64_t cache_hits ABSL_GUARDED_BY(mu) = 0;
  absl::InlinedVector<std::unique_ptr<SubAccount>, 2> subs ABSL_GUARDED_BY(mu);
  // Found destroyed (CUDA_ERROR_INVALID_HANDLE) and its work waited for:
  // nothing can be enqueued on it any more, so its memory is idle.
  bool destroyed ABSL_GUARDED_BY(mu) = false;
  // RetireStream: the handle is dead to the allocator; `retire_event`,
  // recorded on it before it was destroyed, orders all its work.
  bool retired ABSL_GUARDED_BY(mu) = false;
  EventHandle retire_event ABSL_GUARDED_BY(mu);
  TenantId tenant ABSL_GUARDED_BY(mu) = kDefaultTenant;
  // The tenant's high and its mapped bytes (expandable: a free above high
  // sheds on the slow path).
  std::size_t tenant_high ABSL_GUARDED_BY(mu) = kNoLimit;
  const std::atomic<std::size_t>* tenant_mapped ABSL_GUARDED_BY(mu) = nullptr;
  // Expandable mode: the stream's range segments per pool, in the order
  // they were reserved (null until used; see kMaxRanges).
  Segment* range[2][kMaxRanges] ABSL_GUARDED_BY(mu) = {};
  // Decay. `ops` counts the blocks taken and freed on the stream: a plain
  // increment on the hot path, which never reads the clock. Each decay
  // check compares it with `ops_seen`; when it moved (or at the first
  // check) `active_at` becomes the check's time, so idleness is measured
  // between checks. `decayed_ops` is `ops` when the stream's free granules
  // were last unmapped by decay: nothing to do until it moves.
  std::uint64_t ops ABSL_GUARDED_BY(mu) = 0;
  std::uint64_t ops_seen ABSL_GUARDED_BY(mu) = 0;
  absl::Time active_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  std::uint64_t decayed_ops ABSL_GUARDED_BY(mu) =
      std::numeric_limits<std::uint64_t>::max();

  SubAccount* FindSub(OwnerId owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& s : subs) {
      if (s->owner == owner) return s.get();
    }
    return nullptr;
  }
};

// Orders streams by handle, so that loops over them (Trim, decay, a tenant's
// streams) act in the same order in every run.
void SortByStream(std::vector<StreamState*>* v) {
  std::sort(v->begin(), v->end(),
            [](const StreamState* a, const StreamState* b) {
              return a->stream < b->stream;
            });
}

// The allocator's segment: a core Segment plus its shard (read without a
// lock by Deallocate after the address maps found the segment) and the
// decay stamp of classic mode. `free_since` is InfinitePast while the
// segment is in use or not yet seen wholly free by a decay check; the first
// check that finds it wholly free stamps it (lazily, so the hot path never
// reads the clock) and indexing it wholly free again resets the stamp.
// Segments are recycled, never deleted before the allocator, so a reader
// holding a stale one reads a valid object.
struct DeviceSegment : Segment {
  std::atomic<StreamState*> shard{nullptr};
  absl::Time free_since = absl::InfinitePast();
};

struct Tenant {
  std::string name;
  Budget budget;
  // The streams bound to it (every stream is some tenant's: unbound ones
  // the default's), so that the per-tenant sums the reclaim and budget
  // paths take cost O(the tenant's streams), not O(every stream).
  std::vector<StreamState*> streams;
  // The reserved bytes of its streams (read without the lock by the free
  // path of a tenant with a high).
  std::atomic<std::size_t> mapped{0};
  std::size_t peak = 0;
  std::size_t reclaimed_from = 0;
  std::size_t reclaimed_by = 0;
  std::int64_t ooms = 0;
  bool bound_any = false;
  // False once unregistered: the slot (and its id) may be reused by a later
  // RegisterTenant.
  bool registered = true;
};

// An owner of allocations (RegisterOwner). Its live bytes are the sum of its
// sub-accounts'; `reserved` is what it has handed out as credit plus charged
// (see the file comment).
struct OwnerRec {
  std::string name;
  std::size_t max = 0;  // 0: none
  std::size_t chunk = 0;
  bool record_times = false;
  std::atomic<std::size_t> reserved{0};
  std::atomic<bool> closed{false};
  // Counters of the slow paths (mu_).
  std::int64_t ooms = 0;
  std::int64_t rejections = 0;
  std::int64_t invalid_frees = 0;
  // The shards where it has a sub-account (mu_).
  std::vector<StreamState*> shards;
  // The sum of its sub-accounts' live bytes and its peak, kept by a holder
  // shard (under that shard's lock; every shard's under AllShards).
  // `holder` is read on every owned call: a line of its own, apart from
  // what the holder writes.
  // `holder` and `holder_thread` are read on every owned call and written
  // only at take-overs: a line of their own, apart from what the holder
  // writes on every call.
  struct alignas(64) Sum {
    std::atomic<StreamState*> holder{nullptr};
    std::atomic<pthread_t> holder_thread{};
    alignas(64) std::int64_t live = 0;
    std::int64_t peak = 0;
  } sum;
};

// One event a pending-free block waits for.
struct PendingEvent {
  Block* block;
  EventHandle event;
};

bool IsInvalidHandle(const absl::Status& s) {
  std::optional<int> code = DriverErrorCode(s);
  return code.has_value() && (*code == cu::kErrorInvalidHandle ||
                              *code == cu::kErrorContextIsDestroyed);
}

bool IsOutOfMemory(const absl::Status& s) {
  std::optional<int> code = DriverErrorCode(s);
  return code.has_value() && *code == cu::kErrorOutOfMemory;
}

StreamState* ShardOf(const Segment* seg) {
  return static_cast<const DeviceSegment*>(seg)->shard.load(
      std::memory_order_relaxed);
}

BlockInfo ToInfo(const Block& b) {
  BlockInfo info;
  info.ptr = DevicePtr(b.address);
  info.size = b.size;
  info.requested_bytes = b.state == BlockState::kAllocated ? b.requested : 0;
  info.stream = StreamHandle(b.segment->stream);
  info.state = b.state;
  info.mapped_bytes = b.size;
  if (b.state == BlockState::kAllocated) {
    info.owner = b.owner;
    info.label = b.label;
  }
  return info;
}

SizeClassConfig ToSizeConfig(const DeviceAllocatorOptions& o) {
  SizeClassConfig c;
  const bool expandable = o.backing == BackingMode::kExpandable;
  c.round_bytes = o.round_bytes;
  c.small_size_limit = o.small_size_limit;
  c.small_segment_bytes = o.small_segment_bytes;
  c.large_segment_bytes = o.large_segment_bytes;
  c.large_round_bytes = o.large_round_bytes;
  c.large_own_segment_bytes = o.large_own_segment_bytes;
  c.max_split_size =
      expandable ? std::numeric_limits<std::size_t>::max() : o.max_split_size;
  return c;
}

bool IsPowerOfTwo(std::size_t n) { return n != 0 && (n & (n - 1)) == 0; }

// The page of the classic segment map: a power of two no larger than the
// smallest segment, so that at most one segment starts inside a page; at
// most 2 MiB.
int PageShift(const DeviceAllocatorOptions& o) {
  std::size_t smallest = std::min(
      {o.small_segment_bytes, o.large_segment_bytes, o.large_round_bytes});
  smallest = std::min<std::size_t>(absl::bit_floor(smallest), 2u << 20);
  return absl::countr_zero(smallest);
}

// Folds the pending changes `p` (deltas whose peaks are their prefix maxima)
// into the sum `s`, and clears them.
void FoldStat(Stat& s, Stat& p) {
  s.peak = std::max(s.peak, s.current + p.peak);
  s.current += p.current;
  s.allocated += p.allocated;
  s.freed += p.freed;
  p = Stat();
}
void FoldPoolStats(PoolStats& into, PoolStats& pending) {
  std::array<StatArray*, 9> dst;
  std::array<StatArray*, 9> src;
  std::size_t n = 0;
  into.ForEach([&](StatArray& a) { dst[n++] = &a; });
  n = 0;
  pending.ForEach([&](StatArray& a) { src[n++] = &a; });
  for (std::size_t i = 0; i < n; ++i) {
    for (int p = 0; p < 3; ++p) FoldStat((*dst[i])[p], (*src[i])[p]);
  }
}

}  // namespace

absl::Status ValidateDeviceAllocatorOptions(const DeviceAllocatorOptions& o) {
  if (!IsPowerOfTwo(o.round_bytes) || !IsPowerOfTwo(o.large_round_bytes)) {
    return absl::InvalidArgumentError(
        "round_bytes and large_round_bytes must be powers of two");
  }
  if (o.small_size_limit < o.round_bytes ||
      o.small_segment_bytes < o.small_size_limit ||
      o.small_segment_bytes % o.round_bytes != 0 ||
      o.large_segment_bytes <= o.small_size_limit ||
      o.large_segment_bytes % o.round_bytes != 0 ||
      o.large_round_bytes % o.round_bytes != 0) {
    return absl::InvalidArgumentError(core_internal::Format(
        "inconsistent segment sizes: round %d, small limit %d, small segment "
        "%d, large segment %d, large round %d",
        o.round_bytes, o.small_size_limit, o.small_segment_bytes,
        o.large_segment_bytes, o.large_round_bytes));
  }
  if (o.vmm_chunk_units < 1 || o.vmm_chunk_units > kMaxVmmChunkUnits) {
    return absl::InvalidArgumentError(core_internal::Format(
        "vmm_chunk_units must be between 1 and %d, not %d", kMaxVmmChunkUnits,
        o.vmm_chunk_units));
  }
  return absl::OkStatus();
}

std::string OomReport::ToString() const {
  if (tenant_limit) {
    return core_internal::Format(
        "out of memory for tenant '%s': requested %d bytes on stream 0x%x "
        "needs %d more bytes of physical memory; the tenant holds %d bytes "
        "(%d live) and its max is %d bytes",
        tenant, requested_bytes, stream.value(), growth_bytes, tenant_bytes,
        tenant_live_bytes, tenant_max_bytes);
  }
  std::string out = core_internal::Format(
      "out of memory: requested %d bytes (%d rounded) on stream 0x%x; live "
      "%d bytes, reserved %d bytes, largest free block %d bytes, "
      "fragmentation %.3f; device free %d of %d bytes",
      requested_bytes, rounded_bytes, stream.value(), live_bytes,
      reserved_bytes, largest_free_bytes, fragmentation, device_free_bytes,
      device_total_bytes);
  if (growth_bytes != 0) {
    core_internal::AppendFormat(
        &out, "; it needed %d bytes of new device memory", growth_bytes);
  }
  if (cached_bytes != 0) {
    core_internal::AppendFormat(
        &out,
        "%s the allocator's granule cache held %d bytes (unmapped, not in "
        "reserved)",
        growth_bytes != 0 ? ", and" : ";", cached_bytes);
  }
  if (stranded_free_bytes != 0) {
    core_internal::AppendFormat(
        &out,
        "; %d of the free bytes are stranded beside live blocks (on memory "
        "they share: no trim frees them while those live)",
        stranded_free_bytes);
  }
  if (memory_limit_bytes != 0) {
    core_internal::AppendFormat(
        &out, "; the allocator's memory_limit_bytes is %d", memory_limit_bytes);
  }
  if (virtual_range_exhausted) {
    core_internal::AppendFormat(
        &out,
        "; the stream's virtual ranges (%d bytes in all) had no place for %d "
        "bytes (live blocks split them)",
        virtual_range_bytes, rounded_bytes);
  }
  return out;
}

class CachingDeviceAllocator::Impl {
 public:
  Impl(Driver& driver, int device, DeviceAllocatorOptions options,
       ContextHandle ctx, bool owns_ctx, std::size_t device_total,
       std::size_t granule)
      : driver_(driver),
        device_(device),
        options_(std::move(options)),
        classes_(ToSizeConfig(options_)),
        ctx_(ctx),
        owns_ctx_(owns_ctx),
        device_total_(device_total),
        expandable_(options_.backing == BackingMode::kExpandable),
        granule_(granule),
        backing_(std::make_unique<ClassicBacking>(driver)),
        pages_(PageShift(options_)),
        vmm_(driver, device, granule,
             ExpandableOptions{options_.vmm_unit_divisor,
                               options_.vmm_chunk_units,
                               options_.memory_limit_bytes, device_total},
             options_.clock) {
    auto t = std::make_unique<Tenant>();
    t->name = "default";
    tenants_.push_back(std::move(t));
  }

  ~Impl() {
    // In a forked child the segments, granules, events and context belong to
    // the parent's driver state: touch none of it, leak it.
    if (fork_guard_.InForkedChild()) return;
    try {
      Reset(/*force=*/true).IgnoreError();
    } catch (const std::bad_alloc&) {
      // No host memory for Reset's lists (it keeps the books whole and has
      // dropped some segments): what is left goes back without them.
      AllShards lock(this);
      TearDownInPlace();
    }
    AllShards lock(this);
    {
      ScopedContext ctx(driver_, ctx_);
      if (ctx.status().ok()) {
        for (auto& [stream, ss] : streams_) {
          ss->mu.AssertHeld();
          if (ss->retired) PutEvent(ss->retire_event);
        }
        for (EventHandle e : event_pool_) driver_.EventDestroy(e).IgnoreError();
        vmm_.ReleaseAll();
      } else {
        vmm_.LeakAll();
      }
      event_pool_.clear();
    }
    if (owns_ctx_) driver_.PrimaryCtxRelease(device_).IgnoreError();
  }

  // The destructor's way out when Reset finds no host memory: the device
  // memory of every segment still on the books goes back to the driver
  // without them (the allocator is going away), and the events of pending
  // frees go back to the pool (which keeps room for every event). Allocates
  // nothing.
  void TearDownInPlace() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ScopedContext ctx(driver_, ctx_);
    if (!ctx.status().ok()) return;  // the destructor leaks the rest
    for (const PendingEvent& p : pending_) PutEvent(p.event);
    pending_.clear();
    if (expandable_) {
      vmm_.TearDownInPlace();
      return;
    }
    for (const auto& [base, seg] : segments_) {
      backing_
          ->Free(
              BackedRange{DevicePtr(seg->base), seg->size, seg->backing_handle})
          .IgnoreError();
    }
  }

  Driver& driver() const { return driver_; }
  ContextHandle context() const { return ctx_; }
  int device() const { return device_; }
  std::size_t device_total_bytes() const { return device_total_; }
  const DeviceAllocatorOptions& options() const { return options_; }
  TraceRecorder& recorder() { return recorder_; }

 private:
  // The slow paths' lock: mu_, then every shard's lock (see the file
  // comment). Shards made while it is held are locked by GetStream before
  // they are published, and unlocked here with the others. With every
  // shard held it folds their pending changes in and leaves the sums
  // without a holder, so that the slow path (and the next cached call of
  // any shard) takes them over without a wait.
  class ABSL_SCOPED_LOCKABLE AllShards {
   public:
    explicit AllShards(const Impl* impl)
        ABSL_EXCLUSIVE_LOCK_FUNCTION(impl->mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS
        : impl_(impl) {
      impl_->mu_.Lock();
      for (const auto& [stream, ss] : impl_->streams_) ss->mu.Lock();
      impl_->FoldAll(/*release=*/true);
      tls_all_shards_held = true;
    }
    ~AllShards() ABSL_UNLOCK_FUNCTION() ABSL_NO_THREAD_SAFETY_ANALYSIS {
      tls_all_shards_held = false;
      for (const auto& [stream, ss] : impl_->streams_) ss->mu.Unlock();
      impl_->mu_.Unlock();
    }
    AllShards(const AllShards&) = delete;
    AllShards& operator=(const AllShards&) = delete;

   private:
    const Impl* const impl_;
  };

  // Who an allocation is for: the owner, its sub-account on the allocation
  // stream (charged `charge` bytes) and the caller's label.
  struct Tag {
    OwnerId owner = kNoOwner;
    SubAccount* sub = nullptr;
    const char* label = nullptr;
    std::size_t charge = 0;
  };

 public:
  // ---- Allocate / Deallocate ----------------------------------------------

  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream,
                                     OwnerId owner, const char* label)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::Allocate"));
    if (ABSL_PREDICT_FALSE(bytes > device_total_)) {
      return TooLarge(bytes, owner);
    }
    const std::size_t rounded = classes_.Round(bytes);
    const bool small = classes_.IsSmall(rounded);
    if (StreamState* ss = stream_table_.Find(stream.value())) {
      SpinLockHolder lock(&ss->mu);
      Tag tag;
      if (Block* b = CachedFit(ss, rounded, bytes, small, owner, &tag)) {
        ++ss->cache_hits;
        tag.label = label;
        return Traced(ss, TakeBlock(ss, b, rounded, bytes, tag), bytes);
      }
    }
    return AllocateSlowPath(bytes, stream, rounded, small, owner, label);
  }

  // kChecked: `check` may refuse the free (the plain Deallocate passes
  // none, and pays nothing for it).
  template <bool kChecked>
  absl::Status Deallocate(DevicePtr ptr, const FreeCheck& check)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::Deallocate"));
    if (StreamState* ss = ShardOfAddress(ptr.address())) {
      bool shed = false;
      bool freed = false;
      {
        SpinLockHolder lock(&ss->mu);
        auto it = ss->live.find(ptr.address());
        if (ABSL_PREDICT_TRUE(it != ss->live.end()) &&
            ABSL_PREDICT_TRUE(it->second->stream_uses.empty()) &&
            (!kChecked || FreeIsPlain(*it->second, check))) {
          FreePlain(ss, it);
          freed = true;
          shed = ABSL_PREDICT_FALSE(ss->tenant_high != kNoLimit) &&
                 MappedAboveHigh(ss);
        }
      }
      if (ABSL_PREDICT_TRUE(freed)) {
        if (ABSL_PREDICT_FALSE(shed)) ShedSlowPath(ptr);
        return absl::OkStatus();
      }
    }
    return DeallocateSlowPath<kChecked>(ptr, check);
  }

  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream, OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RecordStream"));
    if (StreamState* ss = ShardOfAddress(ptr.address())) {
      SpinLockHolder lock(&ss->mu);
      auto it = ss->live.find(ptr.address());
      if (it != ss->live.end() &&
          (owner == kAnyOwner || it->second->owner == owner)) {
        return AddStreamUse(it->second, stream);
      }
    }
    AllShards lock(this);
    ++invalid_requests_;
    return absl::InvalidArgumentError(  // StrCat: see CheckFree
        absl::StrCat("RecordStream(0x", absl::Hex(ptr.address()),
                     "): not the start of a live block",
                     owner != kAnyOwner ? " of this owner" : ""));
  }

 private:
  // The cached path's fit for a request on `ss`: a mapped free block that
  // serves it, its owner able to pay (sub-account open, credit available).
  // Null when the slow path must decide.
  // Sets *tag's owner, sub-account and charge.
  ABSL_ATTRIBUTE_ALWAYS_INLINE Block* CachedFit(StreamState* ss,
                                                std::size_t rounded,
                                                std::size_t bytes, bool small,
                                                OwnerId owner, Tag* tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    if (ABSL_PREDICT_FALSE(ss->retired | ss->destroyed)) return nullptr;
    if (ABSL_PREDICT_FALSE(owner != kNoOwner)) {
      SubAccount* sub = ss->FindSub(owner);
      const std::size_t charge = ChargeInRange(bytes);
      if (sub == nullptr || sub->closed || !TakeCredit(*sub, charge)) {
        return nullptr;
      }
      *tag = Tag{owner, sub, nullptr, charge};
    }
    return FindFree(ss, rounded, small);
  }

  // Deallocate's checks when they let the cached path free the block (one
  // no other stream used): the check passes and nothing orders the free
  // after another stream.
  static bool FreeIsPlain(const Block& b, const FreeCheck& check) {
    return OwnerPasses(b, check) && SizePasses(b, check) &&
           (!check.order_after_stream ||
            check.stream.value() == b.segment->stream);
  }
  // `check`'s owner rule: the block is the checked owner's (any with
  // kAnyOwner) and owned when only owned blocks may be freed.
  static bool OwnerPasses(const Block& b, const FreeCheck& check) {
    return (check.owner == kAnyOwner || b.owner == check.owner) &&
           (!check.owned_only || b.owner != kNoOwner);
  }
  // `check`'s size rule, when it has one.
  static bool SizePasses(const Block& b, const FreeCheck& check) {
    return !check.check_size || b.requested == check.requested_bytes;
  }

  // Expandable mode: the tenant of `ss` holds more than its high.
  bool MappedAboveHigh(StreamState* ss) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    return expandable_ && ss->tenant_mapped != nullptr &&
           ss->tenant_mapped->load(std::memory_order_relaxed) > ss->tenant_high;
  }

  // A request larger than the device: INVALID_ARGUMENT, unless an owner's
  // budget (or its being closed) speaks first.
  absl::Status TooLarge(std::size_t bytes, OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    if (owner != kNoOwner) {
      CTXPOOL_RETURN_IF_ERROR(CheckOwner("Allocate", owner, bytes));
    }
    ++invalid_requests_;
    return absl::InvalidArgumentError(core_internal::Format(
        "Allocate(%d bytes): larger than device %d's total memory (%d "
        "bytes)",
        bytes, device_, device_total_));
  }

  absl::StatusOr<DevicePtr> AllocateSlowPath(std::size_t bytes,
                                             StreamHandle stream,
                                             std::size_t rounded, bool small,
                                             OwnerId owner, const char* label)
      ABSL_LOCKS_EXCLUDED(mu_) {
    OomReport report;
    {
      AllShards lock(this);
      if (auto p = TryAllocateSlow(bytes, stream, rounded, small, owner, label,
                                   &report)) {
        return *std::move(p);
      }
    }
    if (options_.on_oom && options_.on_oom(report)) {
      AllShards lock(this);
      // The locks were dropped: the owner may have been closed or charged.
      if (auto p = TryAllocateSlow(bytes, stream, rounded, small, owner, label,
                                   &report)) {
        return *std::move(p);
      }
    }
    AllShards lock(this);
    ++num_ooms_;
    if (OwnerRec* o = FindOwner(owner)) ++o->ooms;
    StreamState* ss = GetStream(stream.value());
    ss->mu.AssertHeld();
    ++tenants_[ss->tenant]->ooms;
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kOom, 0, bytes, ss->stream, ss->tenant);
    }
    return absl::ResourceExhaustedError(report.ToString());
  }

  // One attempt of the slow path: the owner's checks and charge, then the
  // cached fit, then new memory and the allocator's own retry. std::nullopt
  // when it ran out of memory; `report` then says why.
  std::optional<absl::StatusOr<DevicePtr>> TryAllocateSlow(
      std::size_t bytes, StreamHandle stream, std::size_t rounded, bool small,
      OwnerId owner, const char* label, OomReport* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Each attempt reports its own failure: nothing of an earlier one (its
    // tenant_limit, growth or figures) may stand for this one's.
    *report = OomReport{};
    StreamState* ss = GetStream(stream.value());
    ss->mu.AssertHeld();
    Tag tag;
    tag.owner = owner;
    tag.label = label;
    if (owner != kNoOwner) {
      absl::Status charged = ChargeSlow(owner, bytes, ss, &tag);
      if (!charged.ok()) return absl::StatusOr<DevicePtr>(charged);
    }
    if (Block* b = FindFree(ss, rounded, small)) {
      ++ss->cache_hits;
      return Traced(ss, TakeBlock(ss, b, rounded, bytes, tag), bytes);
    }
    bool oom = false;
    absl::StatusOr<DevicePtr> p =
        AllocateSlow(ss, rounded, bytes, small, report, &oom, tag);
    if (oom) return std::nullopt;
    return Traced(ss, std::move(p), bytes);
  }

  // The slow end of Deallocate: errors, blocks other streams used, and the
  // free of a tenant above its high (expandable: it sheds).
  template <bool kChecked>
  absl::Status DeallocateSlowPath(DevicePtr ptr, const FreeCheck& check)
      ABSL_LOCKS_EXCLUDED(mu_) {
    // Deallocate is noexcept: host memory running out is an error here,
    // with the block still live (each step takes its memory first).
    try {
      return DeallocateSlowPathImpl<kChecked>(ptr, check);
    } catch (const std::bad_alloc&) {
      return host_oom_;  // a copy shares the message: no allocation
    }
  }
  template <bool kChecked>
  absl::Status DeallocateSlowPathImpl(DevicePtr ptr, const FreeCheck& check)
      ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    StreamState* ss = ShardOfAddress(ptr.address());
    Block* b = nullptr;
    if (ss != nullptr) {
      ss->mu.AssertHeld();
      auto it = ss->live.find(ptr.address());
      if (it != ss->live.end()) b = it->second;
    }
    if (ABSL_PREDICT_FALSE(b == nullptr)) {
      CountInvalidFree(check.owner);
      return absl::InvalidArgumentError(
          absl::StrCat("Deallocate(0x", absl::Hex(ptr.address()),
                       "): not the start of a live block of this allocator "
                       "(foreign pointer or double free)"));
    }
    ss->mu.AssertHeld();
    if constexpr (kChecked) {
      CTXPOOL_RETURN_IF_ERROR(CheckFree(*b, ptr, check));
      if (check.order_after_stream) {
        CTXPOOL_RETURN_IF_ERROR(AddStreamUse(b, check.stream));
      }
    }
    CTXPOOL_RETURN_IF_ERROR(FreeLive(ss, ss->live.find(ptr.address())));
    if (expandable_ && tenants_[ss->tenant]->budget.high != kNoLimit) {
      ShedAboveHigh(ss->tenant);
    }
    return absl::OkStatus();
  }

  // After a cached free left a tenant above its high: shed (expandable).
  void ShedSlowPath(DevicePtr ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    if (StreamState* ss = ShardOfAddress(ptr.address())) {
      ss->mu.AssertHeld();
      ShedAboveHigh(ss->tenant);
    }
  }

  // Frees the live block at `it` of `ss` (Deallocate after its checks).
  // REQUIRES: AllShards when other streams used the block.
  absl::Status FreeLive(StreamState* ss,
                        absl::flat_hash_map<std::uint64_t, Block*>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Block* b = it->second;
    if (ABSL_PREDICT_FALSE(!b->stream_uses.empty())) {
      mu_.AssertHeld();  // only the slow path frees a block with uses
      return DeallocateWithUses(ss, b);
    }
    FreePlain(ss, it);
    return absl::OkStatus();
  }
  // FreeLive of a block no other stream used.
  void FreePlain(StreamState* ss,
                 absl::flat_hash_map<std::uint64_t, Block*>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Block* b = it->second;
    ss->live.erase(it);
    if (ABSL_PREDICT_FALSE(recorder_.enabled())) {
      recorder_.Record(TraceOp::kFree, b->address, b->requested, ss->stream,
                       ss->tenant);
      recorder_.Record(TraceOp::kFreeCompleted, b->address, b->size, ss->stream,
                       ss->tenant);
    }
    RemoveAllocatedStats(ss, b);
    FreeToIndex(ss, b);
  }

  // Orders the free of the live block `b` after `stream`'s work too (a
  // no-op for its allocation stream). RESOURCE_EXHAUSTED, nothing changed,
  // when the host is out of memory.
  absl::Status AddStreamUse(Block* b, StreamHandle stream) {
    if (stream.value() == b->segment->stream) return absl::OkStatus();
    for (std::uint64_t s : b->stream_uses) {
      if (s == stream.value()) return absl::OkStatus();
    }
    try {
      b->stream_uses.push_back(stream.value());
    } catch (const std::bad_alloc&) {
      return absl::ResourceExhaustedError(
          "RecordStream: out of host memory for the block's stream uses");
    }
    return absl::OkStatus();
  }

 public:
  // ---- Owners ----------------------------------------------------------

  absl::StatusOr<OwnerId> RegisterOwner(absl::string_view name,
                                        const OwnerOptions& options)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RegisterOwner"));
    if (name.empty()) {
      return absl::InvalidArgumentError("RegisterOwner: empty name");
    }
    auto o = std::make_unique<OwnerRec>();
    o->name = std::string(name);
    o->max = options.max_live_bytes;
    o->chunk = CreditChunk(options.max_live_bytes);
    o->record_times = options.record_times;
    SpinLockHolder lock(&mu_);
    if (owners_.size() >= kAnyOwner - 1) {
      return absl::ResourceExhaustedError("RegisterOwner: out of owner ids");
    }
    owners_.push_back(std::move(o));
    return static_cast<OwnerId>(owners_.size());
  }

  absl::StatusOr<OwnerStats> GetOwnerStats(OwnerId owner) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("GetOwnerStats", owner);
    return ToStats(owner, *o);
  }

  absl::StatusOr<std::vector<OwnedBlock>> OwnedBlocks(OwnerId owner) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    if (FindOwner(owner) == nullptr) return UnknownOwner("OwnedBlocks", owner);
    return ListOwned(owner);
  }

  absl::Status CloseOwner(OwnerId owner, std::vector<OwnedBlock>* freed)
      ABSL_LOCKS_EXCLUDED(mu_) {
    freed->clear();
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::CloseOwner"));
    AllShards lock(this);
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("CloseOwner", owner);
    // Host memory first: a std::bad_alloc leaves the owner open.
    std::vector<OwnedBlock> live = ListOwned(owner);
    freed->reserve(live.size());
    // Every shard is locked: an allocation of the owner either came before
    // (its block is listed above) or will see it closed.
    o->closed.store(true, std::memory_order_relaxed);
    for (StreamState* ss : o->shards) {
      ss->mu.AssertHeld();
      ss->FindSub(owner)->closed = true;
    }
    absl::Status first_error;
    for (const OwnedBlock& ob : live) {
      StreamState* ss = ShardOfAddress(ob.ptr.address());
      ss->mu.AssertHeld();
      auto it = ss->live.find(ob.ptr.address());
      if (it == ss->live.end()) continue;  // cannot be: listed under the lock
      auto* sub = static_cast<SubAccount*>(it->second->owner_data);
      absl::Status s = FreeLive(ss, it);
      if (s.ok()) {
        --sub->frees;  // a reclaim, not the owner's free
        ++sub->reclaimed;
        freed->push_back(ob);
      } else if (first_error.ok()) {
        first_error = s;
      }
    }
    DrainCredit(owner, *o);
    return first_error;
  }

  absl::StatusOr<OwnerStats> UnregisterOwner(OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("UnregisterOwner", owner);
    OwnerStats st = ToStats(owner, *o);
    for (StreamState* ss : o->shards) {
      ss->mu.AssertHeld();
      SubAccount* sub = ss->FindSub(owner);
      if (sub->allocs != sub->frees + sub->reclaimed) {
        for (auto& [address, b] : ss->live) {
          if (b->owner_data == sub) {
            b->owner = kNoOwner;
            b->owner_data = nullptr;
            b->label = nullptr;  // it may point into the owner's memory
          }
        }
      }
      ss->subs.erase(std::find_if(ss->subs.begin(), ss->subs.end(),
                                  [&](const std::unique_ptr<SubAccount>& s) {
                                    return s.get() == sub;
                                  }));
    }
    owners_[owner - 1].reset();
    return st;
  }

  absl::StatusOr<TrimResult> Trim(std::size_t keep_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("CachingDeviceAllocator::Trim"));
    AllShards lock(this);
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    ++num_trims_;
    TrimResult result;
    SyncPending(&result.event_waits);
    std::size_t busy_segments = 0;
    absl::Status status;
    if (expandable_) {
      for (StreamState* ss : SortedStreams()) {
        ss->mu.AssertHeld();
        bool busy = false;
        status.Update(UnmapFreeGranules(ss, kNoLimit, /*wait=*/true,
                                        &result.event_waits, &busy, nullptr));
        if (busy) busy_segments += FreeMappedBytes(ss);
      }
      status.Update(DropEmptyRanges());
      status.Update(ReleaseGranuleCache(keep_bytes, &result.freed_bytes));
      result.remaining_bytes = Reserved() + CacheBytes();
    } else {
      status = ReleaseCached(nullptr, keep_bytes, &result, &busy_segments);
      result.remaining_bytes = Reserved();
    }
    result.busy_bytes = busy_segments + PendingBytes();
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kTrim, 0, result.freed_bytes, 0);
    }
    if (!status.ok()) return status;
    return result;
  }

  absl::StatusOr<TrimResult> TrimIdle() ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::TrimIdle"));
    AllShards lock(this);
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    PollPending();
    TrimResult result;
    std::size_t busy = 0;
    absl::Status s = ShedAllAboveHigh(&result, &busy);
    s.Update(DecayIdle(&result, &busy));
    result.remaining_bytes = Reserved() + CacheBytes();
    result.busy_bytes = busy;
    if (!s.ok()) return s;
    return result;
  }

  // ---- Tenants -------------------------------------------------------------

  static absl::Status ValidateBudget(const Budget& b) {
    if (b.min > b.max) {
      return absl::InvalidArgumentError(
          core_internal::Format("budget min %d > max %d bytes", b.min, b.max));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TenantId> RegisterTenant(absl::string_view name, Budget budget)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RegisterTenant"));
    CTXPOOL_RETURN_IF_ERROR(ValidateBudget(budget));
    SpinLockHolder lock(&mu_);
    if (name.empty()) {
      return absl::InvalidArgumentError("RegisterTenant: empty name");
    }
    // The default tenant's name ("default") is not reserved: a model may be
    // called that.
    for (std::size_t i = 1; i < tenants_.size(); ++i) {
      const auto& t = tenants_[i];
      if (t->registered && t->name == name) {
        return absl::InvalidArgumentError(
            absl::StrCat("RegisterTenant: '", name, "' is registered"));
      }
    }
    auto t = std::make_unique<Tenant>();
    t->name = std::string(name);
    t->budget = budget;
    // Reuse the slot of an unregistered tenant (never the default's), so
    // that the per-tenant loops stay O(live tenants) on a server that opens
    // and closes sessions forever.
    for (std::size_t i = 1; i < tenants_.size(); ++i) {
      if (!tenants_[i]->registered) {
        tenants_[i] = std::move(t);
        return static_cast<TenantId>(i);
      }
    }
    tenants_.push_back(std::move(t));
    return static_cast<TenantId>(tenants_.size() - 1);
  }

  bool KnownTenant(TenantId tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return tenant < tenants_.size() && tenants_[tenant]->registered;
  }

  absl::Status UnregisterTenant(TenantId tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::UnregisterTenant"));
    SpinLockHolder lock(&mu_);
    if (tenant == kDefaultTenant || !KnownTenant(tenant)) {
      return absl::InvalidArgumentError(core_internal::Format(
          "UnregisterTenant: unknown or default tenant %d", tenant));
    }
    if (const std::vector<StreamState*>& bound = tenants_[tenant]->streams;
        !bound.empty()) {
      return absl::FailedPreconditionError(core_internal::Format(
          "UnregisterTenant: tenant '%s' still has stream 0x%x bound",
          tenants_[tenant]->name, bound.front()->stream));
    }
    tenants_[tenant]->registered = false;
    return absl::OkStatus();
  }

  absl::Status UnbindStream(StreamHandle stream) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::UnbindStream"));
    AllShards lock(this);
    if (!bound_.contains(stream.value())) {
      return absl::InvalidArgumentError(core_internal::Format(
          "UnbindStream: stream 0x%x is not bound", stream.value()));
    }
    StreamState* ss = GetStream(stream.value());
    ss->mu.AssertHeld();
    // What the stream holds (live blocks, e.g. a slab another component
    // keeps on it, and cached memory) now counts against the default tenant.
    NotePeak(ss->tenant);
    SetTenant(ss, kDefaultTenant);
    bound_.erase(stream.value());
    return absl::OkStatus();
  }

  absl::Status BindStream(StreamHandle stream, TenantId tenant)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::BindStream"));
    AllShards lock(this);
    if (!KnownTenant(tenant)) {
      return absl::InvalidArgumentError(
          core_internal::Format("BindStream: unknown tenant %d", tenant));
    }
    if (bound_.contains(stream.value())) {
      return absl::InvalidArgumentError(core_internal::Format(
          "BindStream: stream 0x%x is already bound", stream.value()));
    }
    // Host memory first (table_room.h): a std::bad_alloc binds nothing.
    core_internal::MakeRoom(bound_, 1);
    StreamState* ss = GetStream(stream.value());
    ss->mu.AssertHeld();
    SetTenant(ss, tenant);  // takes its memory before it changes anything
    bound_.insert(stream.value());  // cannot allocate now
    return absl::OkStatus();
  }

  absl::StatusOr<TrimResult> SetBudget(TenantId tenant, Budget budget)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::SetBudget"));
    CTXPOOL_RETURN_IF_ERROR(ValidateBudget(budget));
    AllShards lock(this);
    if (!KnownTenant(tenant)) {
      return absl::InvalidArgumentError(
          core_internal::Format("SetBudget: unknown tenant %d", tenant));
    }
    tenants_[tenant]->budget = budget;
    for (StreamState* ss : tenants_[tenant]->streams) {
      ss->mu.AssertHeld();
      ss->tenant_high = budget.high;
    }
    TrimResult result;
    if (TenantMapped(tenant) > budget.max) {
      ScopedContext ctx(driver_, ctx_);
      CTXPOOL_RETURN_IF_ERROR(ctx.status());
      const std::size_t before = TenantMapped(tenant);
      if (expandable_) {
        for (StreamState* ss : TenantStreams(tenant)) {
          ss->mu.AssertHeld();
          const std::size_t over =
              TenantMapped(tenant) - std::min(TenantMapped(tenant), budget.max);
          if (over == 0) break;
          bool busy = false;
          UnmapFreeGranules(ss, over, /*wait=*/true, &result.event_waits, &busy,
                            nullptr)
              .IgnoreError();
        }
      } else {
        for (StreamState* ss : TenantStreams(tenant)) {
          ss->mu.AssertHeld();
          std::size_t busy = 0;
          ReleaseCached(ss, 0, &result, &busy).IgnoreError();
        }
      }
      result.freed_bytes = before - TenantMapped(tenant);
    }
    result.remaining_bytes = TenantMapped(tenant);
    result.busy_bytes = result.remaining_bytes > budget.max
                            ? result.remaining_bytes - budget.max
                            : 0;
    return result;
  }

  absl::StatusOr<TenantStats> GetTenantStats(TenantId tenant) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::GetTenantStats"));
    AllShards lock(this);
    if (!KnownTenant(tenant)) {
      return absl::NotFoundError(
          core_internal::Format("unknown tenant %d", tenant));
    }
    const Tenant& t = *tenants_[tenant];
    TenantStats st;
    st.name = t.name;
    st.budget = t.budget;
    st.live_bytes = TenantLive(tenant);
    st.mapped_bytes = TenantMapped(tenant);
    for (const StreamState* ss : t.streams) {
      if (bound_.contains(ss->stream)) ++st.num_streams;
    }
    st.cached_bytes = st.mapped_bytes - st.live_bytes;
    st.peak_mapped_bytes = std::max(t.peak, st.mapped_bytes);
    st.reclaimed_from_bytes = t.reclaimed_from;
    st.reclaimed_by_bytes = t.reclaimed_by;
    st.num_ooms = t.ooms;
    return st;
  }

  absl::Status Reset(bool force) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("CachingDeviceAllocator::Reset"));
    AllShards lock(this);
    std::vector<const Block*> blocks;
    for (const auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      for (const auto& [address, b] : ss->live) blocks.push_back(b);
    }
    if (!blocks.empty() && !force) {
      std::sort(blocks.begin(), blocks.end(),
                [](const Block* a, const Block* b) {
                  return a->address < b->address;
                });
      std::string msg = core_internal::Format(
          "Reset: %d allocations are live (pass force=true to drop them):",
          blocks.size());
      constexpr std::size_t kMaxListed = 32;
      for (std::size_t i = 0; i < blocks.size() && i < kMaxListed; ++i) {
        core_internal::AppendFormat(&msg, " [ptr 0x%x, %d bytes, stream 0x%x]",
                                    blocks[i]->address, blocks[i]->size,
                                    blocks[i]->segment->stream);
      }
      if (blocks.size() > kMaxListed) {
        absl::StrAppend(&msg, " ...");
      }
      return absl::FailedPreconditionError(msg);
    }
    ScopedContext ctx(driver_, ctx_);
    if (!ctx.status().ok() && !force) return ctx.status();
    absl::Status first_error = ctx.status();
    auto note = [&first_error](const absl::Status& s) {
      if (first_error.ok()) first_error = s;
    };
    if (ctx.status().ok()) {
      int waits = 0;
      SyncPending(&waits);
      if (!force && !pending_.empty()) {
        return absl::FailedPreconditionError(core_internal::Format(
            "Reset: %d freed blocks are still in use by streams that cannot "
            "be waited for",
            pending_.size()));
      }
      absl::flat_hash_set<std::uint64_t> idle;
      core_internal::MakeRoom(idle, streams_.size());  // see DropWholeFree
      for (const auto& [base, seg] : segments_) {
        StreamState* owner = ShardOf(seg);
        owner->mu.AssertHeld();
        if (!idle.insert(owner->stream).second) continue;
        absl::Status s = EnsureIdle(owner, &waits);
        if (!s.ok()) {
          if (!force) return s;
          note(s);
        }
      }
    }
    for (const PendingEvent& p : pending_) PutEvent(p.event);
    pending_.clear();
    // Without force a segment whose free fails stays on the books (wholly
    // free: Reset refused above while anything was live) so that the next
    // Reset or Trim returns it; with force it is dropped and counted in
    // leaked_bytes.
    std::vector<Segment*> all;
    all.reserve(segments_.size());
    for (const auto& [base, seg] : segments_) all.push_back(seg);
    for (Segment* seg : all) {
      absl::Status s = DropSegment(seg, /*free_memory=*/ctx.status().ok(),
                                   /*keep_on_error=*/!force);
      if (!s.ok()) note(s);
    }
    if (ctx.status().ok()) note(ReleaseGranuleCache(0, nullptr));
    return first_error;
  }

  // ---- Introspection -------------------------------------------------------

  DeviceAllocatorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    FoldAll();
    DeviceAllocatorStats s;
    s.total = totals_.agg;
    s.per_stream.reserve(streams_.size());
    s.cache_hits = 0;
    for (const auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      s.per_stream.emplace_back(StreamHandle(stream), ss->stats);
      s.cache_hits += ss->cache_hits;
    }
    std::sort(s.per_stream.begin(), s.per_stream.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    ClampPeaks(s);
    s.num_alloc_retries = num_alloc_retries_;
    s.num_ooms = num_ooms_;
    const alloc_internal::ExpandableCounters& vc = vmm_.counters();
    s.upstream_allocs = upstream_allocs_ + vc.creates;
    s.upstream_frees = upstream_frees_ + vc.releases;
    s.num_trims = num_trims_;
    s.num_stream_waits = num_stream_waits_;
    s.num_host_syncs = num_host_syncs_;
    s.invalid_frees = invalid_frees_;
    s.mismatched_frees = mismatched_frees_;
    s.invalid_requests = invalid_requests_;
    s.destroyed_streams = destroyed_streams_;
    s.driver_errors = driver_errors_ + vc.driver_errors;
    s.leaked_bytes = leaked_bytes_ + vc.leaked_bytes;
    s.granule_maps = vc.granule_maps;
    s.granule_unmaps = vc.granule_unmaps;
    s.granule_cache_bytes = CacheBytes();
    return s;
  }

  // The device totals' peaks are exact unless threads on different streams
  // ran at the same moment (see the file comment); then no peak is above
  // the sum of the streams' own (exact) peaks.
  static void ClampPeaks(DeviceAllocatorStats& s) {
    std::vector<Stat*> total;
    s.total.ForEach([&](StatArray& a) {
      for (Stat& st : a) total.push_back(&st);
    });
    std::vector<std::int64_t> bound(total.size(), 0);
    for (auto& [stream, st] : s.per_stream) {
      std::size_t i = 0;
      st.ForEach([&](StatArray& a) {
        for (Stat& x : a) bound[i++] += x.peak;
      });
    }
    for (std::size_t i = 0; i < total.size(); ++i) {
      total[i]->peak =
          std::max(total[i]->current, std::min(total[i]->peak, bound[i]));
    }
  }

  std::size_t PhysicalBytes() const ABSL_LOCKS_EXCLUDED(mu_) {
    SpinLockHolder lock(&mu_);
    return Reserved() + CacheBytes();
  }

  FragmentationStats Fragmentation() const ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    FoldAll();
    FragmentationInputs in;
    for (const auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      for (const FreeIndex<Block>& index : ss->free) {
        in.free_blocks += index.size();
        if (const Block* last = index.Last()) {
          in.largest_free_bytes = std::max(in.largest_free_bytes, last->size);
        }
      }
    }
    in.reserved_bytes = Reserved();
    in.free_bytes = in.reserved_bytes - Current(totals_.agg.active_bytes);
    // Expandable: free blocks include the unmapped rest of the ranges.
    in.largest_free_bytes = std::min(in.largest_free_bytes, in.free_bytes);
    in.allocated_bytes = Current(totals_.agg.allocated_bytes);
    in.requested_bytes = Current(totals_.agg.requested_bytes);
    return ComputeFragmentation(in);
  }

  AllocatorSnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    AllocatorSnapshot snap;
    snap.segments.reserve(segments_.size());
    for (const auto& [base, seg] : segments_) {
      SegmentInfo info;
      info.base = DevicePtr(seg->base);
      info.size = seg->size;
      info.stream = StreamHandle(seg->stream);
      info.small_pool = seg->small;
      info.expandable = expandable_;
      for (const Block* b = seg->first; b != nullptr; b = b->next) {
        BlockInfo bi = ToInfo(*b);
        if (expandable_ && b->state == BlockState::kFree) {
          bi.mapped_bytes = MappedBytes(seg, b->address, b->size);
        }
        info.mapped_bytes += bi.mapped_bytes;
        info.blocks.push_back(bi);
      }
      snap.segments.push_back(std::move(info));
    }
    return snap;
  }

  absl::StatusOr<BlockInfo> Lookup(DevicePtr ptr) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::Lookup"));
    if (StreamState* ss = ShardOfAddress(ptr.address())) {
      SpinLockHolder lock(&ss->mu);
      auto it = ss->live.find(ptr.address());
      if (it != ss->live.end()) return ToInfo(*it->second);
    }
    return absl::NotFoundError(core_internal::Format(
        "0x%x is not the start of a live block", ptr.address()));
  }

  void ResetPeakStats() ABSL_LOCKS_EXCLUDED(mu_) {
    AllShards lock(this);
    FoldAll();
    totals_.agg.ResetPeaks();
    for (auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      ss->stats.ResetPeaks();
      for (auto& sub : ss->subs) sub->peak = sub->live;
    }
    for (auto& o : owners_) {
      if (o != nullptr) o->sum.peak = o->sum.live;
    }
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      if (tenants_[t]->registered) {
        tenants_[t]->peak = TenantMapped(static_cast<TenantId>(t));
      }
    }
  }

  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // ---- Helpers on the stats ------------------------------------------------

  static std::size_t Current(const StatArray& a) {
    return static_cast<std::size_t>(a[0].current);
  }
  std::size_t Reserved() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return reserved_now_;
  }
  // Bytes of blocks freed but still in use by other streams.
  // REQUIRES: AllShards.
  std::size_t PendingBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FoldAll();
    return Current(totals_.agg.active_bytes) -
           Current(totals_.agg.allocated_bytes);
  }

  // Makes `ss` the holder of a sum (the device totals, an owner's live
  // bytes) when it can; true when it holds it afterwards, so that it may add
  // to the sum directly (see the file comment). `fold` moves ss's pending
  // changes into the sum; it runs with the old holder's lock held. (The
  // analysis cannot follow a lock taken only when a try-lock succeeds on
  // one branch; the protocol is the file comment's.)
  template <typename Fold>
  ABSL_ATTRIBUTE_ALWAYS_INLINE static bool TakeHolder(
      std::atomic<StreamState*>& holder, std::atomic<pthread_t>& holder_thread,
      StreamState* ss, FoldCtl& ctl, Fold fold)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    if (ABSL_PREDICT_TRUE(holder.load(std::memory_order_acquire) == ss)) {
      return true;
    }
    return TakeHolderSlow(holder, holder_thread, ss, ctl, fold);
  }
  template <typename Fold>
  ABSL_ATTRIBUTE_NOINLINE static bool TakeHolderSlow(
      std::atomic<StreamState*>& holder, std::atomic<pthread_t>& holder_thread,
      StreamState* ss, FoldCtl& ctl, Fold fold)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    StreamState* h = holder.load(std::memory_order_acquire);
    if (h == ss) return true;
    const pthread_t self = pthread_self();
    if (tls_all_shards_held) {
      // A slow path holds every shard's lock: the sum is ours to take.
      fold();
      holder_thread.store(self, std::memory_order_relaxed);
      holder.store(ss, std::memory_order_release);
      ctl = FoldCtl{};
      return true;
    }
    // This thread made the sum's last take-over (or a slow path left it
    // free): no other thread is using it, take it at once. Otherwise
    // respect the back-off.
    if (h != nullptr &&
        !pthread_equal(holder_thread.load(std::memory_order_relaxed), self) &&
        ctl.countdown != 0) {
      --ctl.countdown;
      return false;
    }
    bool same_thread = true;
    if (h == nullptr) {
      if (!holder.compare_exchange_strong(h, ss, std::memory_order_acq_rel)) {
        Backoff(ctl);
        return false;
      }
    } else {
      // The holder's lock guards the sum: while we hold it, no one else can
      // change the holder either.
      if (!h->mu.TryLock()) {
        Backoff(ctl);
        return false;
      }
      if (holder.load(std::memory_order_relaxed) != h) {
        h->mu.Unlock();
        Backoff(ctl);
        return false;
      }
      same_thread = pthread_equal(holder_thread.load(std::memory_order_relaxed),
                                  self) != 0;
    }
    fold();
    holder_thread.store(self, std::memory_order_relaxed);
    holder.store(ss, std::memory_order_release);
    if (h != nullptr) h->mu.Unlock();
    if (same_thread) {
      ctl = FoldCtl{};
    } else {
      Backoff(ctl);  // another thread had it: it may want it back
    }
    return true;
  }
  static void Backoff(FoldCtl& ctl) {
    ctl.backoff = std::min<std::uint32_t>(2 * ctl.backoff + 1, kMaxBackoff);
    ctl.countdown = ctl.backoff;
  }

  // The device totals: whether `ss` may add to them directly now.
  ABSL_ATTRIBUTE_ALWAYS_INLINE bool HoldTotals(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    return TakeHolder(totals_.holder, totals_.holder_thread, ss,
                      ss->totals_fold, [&]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
                        FoldPoolStats(totals_.agg, ss->pending);
                      });
  }

  // Where `ss`'s changes to the device totals go now: the totals when it
  // holds them, else its pending changes.
  ABSL_ATTRIBUTE_ALWAYS_INLINE PoolStats& TotalsSide(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    return ABSL_PREDICT_TRUE(HoldTotals(ss)) ? totals_.agg : ss->pending;
  }
  // Adds `n` to a statistic of `ss` and to `totals` (TotalsSide(ss)).
  ABSL_ATTRIBUTE_ALWAYS_INLINE static void Bump(StreamState* ss,
                                                PoolStats& totals,
                                                StatArray PoolStats::*field,
                                                bool small, std::int64_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    AddStat(ss->stats.*field, small, n);
    AddStat(totals.*field, small, n);
  }
  void Bump(StreamState* ss, StatArray PoolStats::*field, bool small,
            std::int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Bump(ss, TotalsSide(ss), field, small, n);
  }
  // The same for reserved bytes, which also count for the stream's tenant
  // and for PhysicalBytes. REQUIRES: mu_ (every change of reserved memory is
  // a slow path).
  void BumpReserved(StreamState* ss, bool small, std::int64_t n)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    Bump(ss, &PoolStats::reserved_bytes, small, n);
    tenants_[ss->tenant]->mapped.fetch_add(static_cast<std::size_t>(n),
                                           std::memory_order_relaxed);
    reserved_now_ += static_cast<std::size_t>(n);
  }

  // Folds every shard's pending changes into the device totals and into
  // their owners' sums; with `release`, leaves the sums without a holder.
  // REQUIRES: AllShards.
  void FoldAll(bool release = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      FoldPoolStats(totals_.agg, ss->pending);
      if (release) ss->totals_fold = FoldCtl{};
      for (auto& sub : ss->subs) {
        FoldOwner(*sub);
        if (release) {
          sub->rec->sum.holder.store(nullptr, std::memory_order_relaxed);
          sub->fold = FoldCtl{};
        }
      }
    }
    if (release) totals_.holder.store(nullptr, std::memory_order_relaxed);
  }

  // The shards, by handle. REQUIRES: AllShards.
  std::vector<StreamState*> SortedStreams() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<StreamState*> all;
    all.reserve(streams_.size());
    for (const auto& [stream, ss] : streams_) all.push_back(ss.get());
    SortByStream(&all);
    return all;
  }

  // The shard of the segment that holds `address` (no lock: see
  // address_map.h), or null.
  StreamState* ShardOfAddress(std::uint64_t address) const {
    const Segment* seg =
        expandable_ ? ranges_.Find(address) : pages_.Find(address);
    return seg == nullptr ? nullptr
                          : static_cast<const DeviceSegment*>(seg)->shard.load(
                                std::memory_order_acquire);
  }

  // The state of `stream`, made on first use (locked: AllShards unlocks it
  // with the others) and published to the stream table; a retired handle
  // in use again is revived, a destroyed one is alive again.
  // REQUIRES: AllShards.
  StreamState* GetStream(std::uint64_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = streams_.find(stream);
    if (it == streams_.end()) {
      // Host memory first: a std::bad_alloc leaves every table as it was.
      auto made = std::make_unique<StreamState>(stream);
      core_internal::MakeRoom(streams_, 1);
      core_internal::MakeVectorRoom(tenants_[kDefaultTenant]->streams, 1);
      stream_table_.Reserve();
      StreamState* ss = made.get();
      LockForAllShards(ss);
      ss->mu.AssertHeld();
      SetTenantFields(ss, kDefaultTenant);
      it = streams_.emplace(stream, std::move(made)).first;
      tenants_[kDefaultTenant]->streams.push_back(ss);
      stream_table_.Insert(stream, ss);
    }
    StreamState* ss = it->second.get();
    ss->mu.AssertHeld();
    // Work is being enqueued on it, so the handle is alive (again).
    ss->destroyed = false;
    if (ABSL_PREDICT_FALSE(ss->retired)) Revive(ss);
    return ss;
  }

  // Takes the lock of a shard made while AllShards is held (it unlocks it
  // with the others).
  static void LockForAllShards(StreamState* ss) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ss->mu.Lock();
  }

  // Binds `ss` to tenant `t` on both sides' books: the tenant's stream
  // list, its mapped bytes and the shard's copy of its high.
  void SetTenantFields(StreamState* ss, TenantId t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    ss->tenant = t;
    ss->tenant_high = tenants_[t]->budget.high;
    ss->tenant_mapped = &tenants_[t]->mapped;
  }

  // A retired handle is in use again (a new stream got it): order the new
  // stream after the old one's work once, then treat it as any stream.
  void Revive(StreamState* ss) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    ScopedContext ctx(driver_, ctx_);
    absl::Status s = ctx.status();
    if (s.ok()) {
      s = driver_.StreamWaitEvent(StreamHandle(ss->stream), ss->retire_event);
    }
    if (s.ok()) {
      ++num_stream_waits_;
    } else {
      ++driver_errors_;
      ++num_host_syncs_;
      if (!driver_.EventSynchronize(ss->retire_event).ok()) {
        // Nothing orders the old work any more: wait for the context.
        driver_.CtxSynchronize().IgnoreError();
      }
    }
    PutEvent(ss->retire_event);
    ss->retire_event = EventHandle();
    ss->retired = false;
  }

  // Whether the retire event of `ss` completed, waiting for it with `wait`
  // (counted in *waits). A query or wait that fails is not a completion.
  bool RetiredIdle(StreamState* ss, bool wait, int* waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    absl::StatusOr<bool> done = driver_.EventQuery(ss->retire_event);
    if (done.ok() && *done) return true;
    if (!done.ok()) ++driver_errors_;
    if (!wait) return false;
    ++num_host_syncs_;
    if (waits != nullptr) ++*waits;
    if (driver_.EventSynchronize(ss->retire_event).ok()) return true;
    ++driver_errors_;
    return false;
  }

 public:
  absl::Status RetireStream(StreamHandle stream) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RetireStream"));
    AllShards lock(this);
    auto it = streams_.find(stream.value());
    if (it == streams_.end()) {
      // Known only through RecordStream (a live block's uses): it must be
      // retired too, or that block's free would record on the dead handle.
      bool used = false;
      for (const auto& [handle, ss] : streams_) {
        ss->mu.AssertHeld();
        for (const auto& [address, b] : ss->live) {
          for (std::uint64_t u : b->stream_uses) {
            used = used || u == stream.value();
          }
          if (used) break;
        }
        if (used) break;
      }
      if (!used) return absl::OkStatus();
      GetStream(stream.value());
      it = streams_.find(stream.value());
    }
    StreamState* ss = it->second.get();
    ss->mu.AssertHeld();
    if (ss->retired || ss->destroyed) return absl::OkStatus();
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    CTXPOOL_ASSIGN_OR_RETURN(EventHandle e, GetEvent());
    absl::Status s = driver_.EventRecord(e, stream);
    if (!s.ok()) {
      PutEvent(e);
      if (IsInvalidHandle(s)) return HandleDestroyed(ss);
      return s;
    }
    ss->retired = true;
    ss->retire_event = e;
    return absl::OkStatus();
  }

 private:
  // ---- Free index maintenance ----------------------------------------------

  // Links a free block of `ss` into its index (and a wholly free segment
  // into the stream's whole_free), keeping inactive_split current.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Index(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Segment* seg = b->segment;
    if (ABSL_PREDICT_FALSE(b->unmapped | b->quarantined)) {
      if (b->unmapped) {
        ss->unmapped[PoolIndex(seg->small)].Insert(b, b->size, b->address);
      }
      return;  // a quarantined block is in no index
    }
    ss->free[PoolIndex(seg->small)].Insert(b, b->size, b->address);
    if (expandable_) return;  // I10
    if (b->is_split()) {
      Bump(ss, &PoolStats::inactive_split, seg->small, 1);
      Bump(ss, &PoolStats::inactive_split_bytes, seg->small,
           static_cast<std::int64_t>(b->size));
    } else {
      ss->whole_free[PoolIndex(seg->small)].Insert(seg, seg->size, seg->base);
      static_cast<DeviceSegment*>(seg)->free_since = absl::InfinitePast();
    }
  }

  ABSL_ATTRIBUTE_ALWAYS_INLINE void Unindex(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Segment* seg = b->segment;
    if (ABSL_PREDICT_FALSE(b->unmapped | b->quarantined)) {
      if (b->unmapped) ss->unmapped[PoolIndex(seg->small)].Erase(b);
      return;
    }
    ss->free[PoolIndex(seg->small)].Erase(b);
    if (expandable_) return;  // I10
    if (b->is_split()) {
      Bump(ss, &PoolStats::inactive_split, seg->small, -1);
      Bump(ss, &PoolStats::inactive_split_bytes, seg->small,
           -static_cast<std::int64_t>(b->size));
    } else {
      ss->whole_free[PoolIndex(seg->small)].Erase(seg);
    }
  }

  Block* FindFree(StreamState* ss, std::size_t rounded, bool small) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Block* b = ss->free[PoolIndex(small)].LowerBound(rounded);
    if (b == nullptr || !classes_.CanServe(b->size, rounded)) return nullptr;
    return b;
  }

  // Allocates from free block `b` of `ss` for `tag` (splitting it when
  // worthwhile, or whenever something remains with `split_any`).
  DevicePtr TakeBlock(StreamState* ss, Block* b, std::size_t rounded,
                      std::size_t requested, const Tag& tag,
                      bool split_any = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    // Host memory first (a block for the split, room in the live map), so
    // that a std::bad_alloc leaves everything as it was (table_room.h).
    ss->blocks.Reserve();
    if (ABSL_PREDICT_FALSE(!core_internal::TableHasRoom(ss->live, 1))) {
      core_internal::MakeRoom(ss->live, 1);
    }
    Segment* seg = b->segment;
    const bool small = seg->small;
    Unindex(ss, b);
    if (split_any ? b->size > rounded
                  : classes_.ShouldSplit(b->size, rounded, small)) {
      Index(ss, SplitBlock(b, rounded, ss->blocks));
    }
    ++ss->ops;
    b->state = BlockState::kAllocated;
    b->requested = requested;
    b->owner = tag.owner;
    b->owner_data = tag.sub;
    b->label = tag.label;
    if (tag.sub != nullptr) {
      SubAccount& s = *tag.sub;
      b->born_ns =
          ABSL_PREDICT_FALSE(s.record_times) ? core_internal::CoarseNowNs() : 0;
      if (s.max != 0) s.credit -= tag.charge;
      s.live += tag.charge;
      s.peak = std::max(s.peak, s.live);
      s.requested += requested;
      ++s.allocs;
      OwnerLive(ss, s, static_cast<std::int64_t>(tag.charge));
    }
    ss->live.emplace(b->address, b);
    const auto size = static_cast<std::int64_t>(b->size);
    PoolStats& totals = TotalsSide(ss);
    Bump(ss, totals, &PoolStats::allocation, small, 1);
    Bump(ss, totals, &PoolStats::active, small, 1);
    Bump(ss, totals, &PoolStats::allocated_bytes, small, size);
    Bump(ss, totals, &PoolStats::active_bytes, small, size);
    Bump(ss, totals, &PoolStats::requested_bytes, small,
         static_cast<std::int64_t>(requested));
    return DevicePtr(b->address);
  }

  // An allocated block of `ss` stops being live (it becomes pending or
  // free).
  void RemoveAllocatedStats(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Segment* seg = b->segment;
    PoolStats& totals = TotalsSide(ss);
    Bump(ss, totals, &PoolStats::allocation, seg->small, -1);
    Bump(ss, totals, &PoolStats::allocated_bytes, seg->small,
         -static_cast<std::int64_t>(b->size));
    Bump(ss, totals, &PoolStats::requested_bytes, seg->small,
         -static_cast<std::int64_t>(b->requested));
    if (b->owner_data != nullptr) {
      SubAccount& s = *static_cast<SubAccount*>(b->owner_data);
      const std::size_t charge = ChargeInRange(b->requested);
      s.live -= charge;
      s.requested -= b->requested;
      ++s.frees;
      OwnerLive(ss, s, -static_cast<std::int64_t>(charge));
      ReturnCredit(s, charge);
      b->owner_data = nullptr;
    }
    b->owner = kNoOwner;
    b->label = nullptr;
    b->requested = 0;
  }

  // ---- Owners: helpers -----------------------------------------------------

  // What an owner is charged for a request: `bytes` rounded up to
  // round_bytes, at least round_bytes; saturates near 2^64.
  std::size_t Charge(std::size_t bytes) const {
    if (ABSL_PREDICT_FALSE(bytes > device_total_)) {
      const std::size_t r = options_.round_bytes;
      if (bytes > std::numeric_limits<std::size_t>::max() - r) {
        return std::numeric_limits<std::size_t>::max();
      }
    }
    return ChargeInRange(bytes);
  }
  // Charge of a request no larger than the device (every live block's, and
  // the cached path's, whose caller refused larger ones): the device is at
  // most kMaxDeviceBytes (Create), so no overflow to guard, and no branch.
  std::size_t ChargeInRange(std::size_t bytes) const {
    const std::size_t mask = options_.round_bytes - 1;  // a power of two
    return ((std::max<std::size_t>(bytes, 1) - 1) | mask) + 1;
  }

  // The credit an owner's sub-account takes at a time: 1/64 of its max
  // (whole 512 B units), between 64 KiB and 64 MiB; 0 without a max.
  std::size_t CreditChunk(std::size_t max) const {
    if (max == 0) return 0;
    const std::size_t chunk = std::clamp<std::size_t>(
        max / 64, std::size_t{64} << 10, std::size_t{64} << 20);
    return Charge(chunk);
  }

  // Makes sure `s` has credit for `charge` more bytes (nothing to do
  // without a max), refilling from its owner's record; false when the
  // record cannot cover it without pulling other sub-accounts' credit back.
  static bool TakeCredit(SubAccount& s, std::size_t charge) {
    if (ABSL_PREDICT_TRUE(s.max == 0 || s.credit >= charge)) return true;
    const std::size_t need = charge - s.credit;
    std::atomic<std::size_t>& reserved = s.rec->reserved;
    std::size_t r = reserved.load(std::memory_order_relaxed);
    while (true) {
      if (need > s.max || r > s.max - need) return false;
      const std::size_t grant =
          std::min(std::max(need, s.chunk), s.max - r);  // >= need
      if (reserved.compare_exchange_weak(r, r + grant,
                                         std::memory_order_relaxed)) {
        s.credit += grant;
        return true;
      }
    }
  }

  // A free returns `charge` to `s`'s credit; beyond two chunks (or two of
  // the charge, so that a loop of one size keeps what it needs) the rest
  // goes back to the record.
  static void ReturnCredit(SubAccount& s, std::size_t charge) {
    if (s.max == 0) return;
    s.credit += charge;
    const std::size_t keep = std::max(s.chunk, charge);
    if (ABSL_PREDICT_FALSE(s.credit > 2 * keep)) {
      s.rec->reserved.fetch_sub(s.credit - keep, std::memory_order_relaxed);
      s.credit = keep;
    }
  }

  // Adds `delta` to the owner's live bytes through the holder scheme.
  ABSL_ATTRIBUTE_ALWAYS_INLINE static void OwnerLive(StreamState* ss,
                                                     SubAccount& s,
                                                     std::int64_t delta)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    OwnerRec::Sum& sum = s.rec->sum;
    if (TakeHolder(sum.holder, sum.holder_thread, ss, s.fold,
                   [&] { FoldOwner(s); })) {
      sum.live += delta;
      sum.peak = std::max(sum.peak, sum.live);
    } else {
      s.pending_live += delta;
      s.pending_peak = std::max(s.pending_peak, s.pending_live);
    }
  }
  static void FoldOwner(SubAccount& s) {
    OwnerRec::Sum& sum = s.rec->sum;
    sum.peak = std::max(sum.peak, sum.live + s.pending_peak);
    sum.live += s.pending_live;
    s.pending_live = 0;
    s.pending_peak = 0;
  }

  // `owner`'s sub-account on `ss`, made (and listed on its record) if new.
  SubAccount* SubOf(StreamState* ss, OwnerId owner, OwnerRec* o)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    if (SubAccount* s = ss->FindSub(owner)) return s;
    // Host allocations first (each may throw std::bad_alloc), then the two
    // links, so that a sub-account is never on a shard without its shard
    // on the record (UnregisterOwner finds sub-accounts from the record).
    if (o->shards.size() == o->shards.capacity()) {
      o->shards.reserve(std::max<std::size_t>(4, 2 * o->shards.size()));
    }
    auto s = std::make_unique<SubAccount>();
    s->owner = owner;
    s->rec = o;
    s->max = o->max;
    s->chunk = o->chunk;
    s->record_times = o->record_times;
    s->closed = o->closed.load(std::memory_order_relaxed);
    ss->subs.push_back(std::move(s));
    o->shards.push_back(ss);
    return ss->subs.back().get();
  }

  // Pulls all of `o`'s credit back, so that its reserved bytes are its live
  // bytes. REQUIRES: AllShards.
  void DrainCredit(OwnerId owner, OwnerRec& o)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (StreamState* ss : o.shards) {
      ss->mu.AssertHeld();
      SubAccount* s = ss->FindSub(owner);
      o.reserved.fetch_sub(s->credit, std::memory_order_relaxed);
      s->credit = 0;
    }
  }

  // The live bytes of `o`: the sum over its sub-accounts.
  // REQUIRES: AllShards.
  std::size_t OwnerLiveBytes(OwnerId owner, const OwnerRec& o) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t n = 0;
    for (StreamState* ss : o.shards) {
      ss->mu.AssertHeld();
      n += ss->FindSub(owner)->live;
    }
    return n;
  }

  OwnerRec* FindOwner(OwnerId owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (owner == kNoOwner || owner > owners_.size()) return nullptr;
    return owners_[owner - 1].get();
  }

  static absl::Status UnknownOwner(absl::string_view call, OwnerId owner) {
    return absl::NotFoundError(
        core_internal::Format("%s: owner %d is not registered", call, owner));
  }

  // OK when `owner` may be charged for `bytes` more: registered, open and
  // within its max. REQUIRES: AllShards.
  absl::Status CheckOwner(absl::string_view call, OwnerId owner,
                          std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    OwnerRec* o = FindOwner(owner);
    if (ABSL_PREDICT_FALSE(o == nullptr)) {
      ++invalid_requests_;
      return absl::InvalidArgumentError(core_internal::Format(
          "%s: owner %d is not registered with this allocator", call, owner));
    }
    if (ABSL_PREDICT_FALSE(o->closed.load(std::memory_order_relaxed))) {
      return absl::FailedPreconditionError(
          core_internal::Format("%s: owner '%s' is closed", call, o->name));
    }
    const std::size_t charge = Charge(bytes);
    const std::size_t live = OwnerLiveBytes(owner, *o);
    if (o->max != 0 && (charge > o->max || live > o->max - charge)) {
      return OverBudget(*o, bytes, charge, live);
    }
    return absl::OkStatus();
  }
  absl::Status OverBudget(OwnerRec& o, std::size_t bytes, std::size_t charge,
                          std::size_t live) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++o.rejections;
    return absl::ResourceExhaustedError(core_internal::Format(
        "'%s' is over its memory budget on device %d: requested %d B (%d B "
        "charged), live %d B, max %d B",
        o.name, device_, bytes, charge, live, o.max));
  }

  // The slow path's charge of `owner` on `ss`: its checks, then credit for
  // the charge, pulling the owner's credit back from every sub-account
  // when the record cannot cover it (so that the decision is made on its
  // exact live bytes). Sets tag's sub-account and charge.
  // REQUIRES: AllShards.
  absl::Status ChargeSlow(OwnerId owner, std::size_t bytes, StreamState* ss,
                          Tag* tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr || o->closed.load(std::memory_order_relaxed)) {
      return CheckOwner("Allocate", owner, bytes);
    }
    SubAccount* sub = SubOf(ss, owner, o);
    const std::size_t charge = Charge(bytes);
    if (!TakeCredit(*sub, charge)) {
      DrainCredit(owner, *o);
      const std::size_t live = o->reserved.load(std::memory_order_relaxed);
      if (charge > o->max || live > o->max - charge) {
        return OverBudget(*o, bytes, charge, live);
      }
      o->reserved.fetch_add(charge, std::memory_order_relaxed);
      sub->credit += charge;
    }
    tag->sub = sub;
    tag->charge = charge;
    return absl::OkStatus();
  }

  // An owned call counts in its owner (none once it is closed or
  // unregistered: its caller reports the closed session), a plain one in
  // the allocator.
  void CountInvalidFree(OwnerId owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (owner == kAnyOwner || owner == kNoOwner) {
      ++invalid_frees_;
    } else if (OwnerRec* o = FindOwner(owner);
               o != nullptr && !o->closed.load(std::memory_order_relaxed)) {
      // A closed owner's figures are final: a free that lost the race with
      // CloseOwner (the block was reclaimed) counts nowhere, as one after
      // UnregisterOwner does.
      ++o->invalid_frees;
    }
  }

  // Deallocate's FreeCheck on live block `b` (the slow path).
  absl::Status CheckFree(const Block& b, DevicePtr ptr, const FreeCheck& check)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!OwnerPasses(b, check)) {
      CountInvalidFree(check.owner);
      const OwnerRec* mine = FindOwner(check.owner);
      const OwnerRec* theirs = FindOwner(b.owner);
      // StrCat, not StrFormat, on Deallocate's paths: StrFormat flushes in a
      // destructor, where a std::bad_alloc terminates the process.
      return absl::InvalidArgumentError(
          absl::StrCat("Deallocate(0x", absl::Hex(ptr.address()),
                       "): not a live allocation of ",
                       check.owner == kAnyOwner ? "any owner"
                       : mine != nullptr ? absl::StrCat("'", mine->name, "'")
                                         : std::string("an unknown owner"),
                       " (it belongs to ",
                       theirs != nullptr ? absl::StrCat("'", theirs->name, "'")
                                         : std::string("no owner"),
                       "); nothing freed"));
    }
    if (!SizePasses(b, check)) {
      CountInvalidFree(check.owner);
      ++mismatched_frees_;
      return absl::InvalidArgumentError(absl::StrCat(
          "Deallocate(0x", absl::Hex(ptr.address()), ", ",
          check.requested_bytes, " bytes): the allocation was ", b.requested,
          " bytes; refused, the block stays allocated"));
    }
    return absl::OkStatus();
  }

  // REQUIRES: AllShards.
  OwnerStats ToStats(OwnerId owner, OwnerRec& o) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    OwnerStats st;
    st.name = o.name;
    st.max_live_bytes = o.max;
    std::int64_t reclaimed = 0;
    std::size_t peaks = 0;  // the sum of the streams' peaks: an upper bound
    for (StreamState* ss : o.shards) {
      ss->mu.AssertHeld();
      SubAccount& s = *ss->FindSub(owner);
      FoldOwner(s);
      peaks += s.peak;
      st.live_bytes += s.live;
      st.requested_bytes += s.requested;
      st.num_allocs += s.allocs;
      st.num_frees += s.frees;
      reclaimed += s.reclaimed;
    }
    // Exact unless threads used the owner's streams at the same moment;
    // then bounded by the streams' peaks and the max (file comment).
    std::size_t bound = peaks;
    if (o.max != 0) bound = std::min(bound, o.max);
    st.peak_live_bytes = std::max<std::size_t>(
        std::min<std::size_t>(static_cast<std::size_t>(o.sum.peak), bound),
        st.live_bytes);
    st.live_allocations = st.num_allocs - st.num_frees - reclaimed;
    st.num_ooms = o.ooms;
    st.num_budget_rejections = o.rejections;
    st.invalid_frees = o.invalid_frees;
    st.closed = o.closed.load(std::memory_order_relaxed);
    return st;
  }

  // The live blocks of `owner`, by address. REQUIRES: AllShards.
  std::vector<OwnedBlock> ListOwned(OwnerId owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<OwnedBlock> out;
    const OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return out;
    for (StreamState* ss : o->shards) {
      ss->mu.AssertHeld();
      for (const auto& [address, b] : ss->live) {
        if (b->owner != owner) continue;
        OwnedBlock ob;
        ob.ptr = DevicePtr(b->address);
        ob.requested_bytes = b->requested;
        ob.charged_bytes = Charge(b->requested);
        ob.stream = StreamHandle(b->segment->stream);
        ob.label = b->label;
        ob.allocated_at_ns = b->born_ns;
        out.push_back(ob);
      }
    }
    std::sort(
        out.begin(), out.end(),
        [](const OwnedBlock& a, const OwnedBlock& b) { return a.ptr < b.ptr; });
    return out;
  }

  // An allocated-or-pending block of `ss` (already out of `live`) becomes
  // free: coalesce with free neighbours and index the result.
  void FreeToIndex(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    Segment* seg = b->segment;
    PoolStats& totals = TotalsSide(ss);
    Bump(ss, totals, &PoolStats::active, seg->small, -1);
    Bump(ss, totals, &PoolStats::active_bytes, seg->small,
         -static_cast<std::int64_t>(b->size));
    ++ss->ops;
    b->state = BlockState::kFree;
    b->pending_events = 0;
    if (!b->stream_uses.empty()) b->stream_uses.clear();
    Index(ss, Coalesce(ss, b));
  }

  // Merges unindexed free block `b` of `ss` with its free neighbours of the
  // same kind (mapped or not) and returns the result, still unindexed.
  ABSL_ATTRIBUTE_ALWAYS_INLINE Block* Coalesce(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    if (b->prev != nullptr && b->prev->state == BlockState::kFree &&
        b->prev->unmapped == b->unmapped && !b->prev->quarantined) {
      Block* prev = b->prev;
      Unindex(ss, prev);
      MergeNext(prev, ss->blocks);
      b = prev;
    }
    if (b->next != nullptr && b->next->state == BlockState::kFree &&
        b->next->unmapped == b->unmapped && !b->next->quarantined) {
      Unindex(ss, b->next);
      MergeNext(b, ss->blocks);
    }
    return b;
  }

  // ---- Events --------------------------------------------------------------

  // The pool keeps room for every event this allocator created, so that
  // PutEvent never allocates: GetEvent makes the room before it creates one
  // (a std::bad_alloc then comes before the event exists).
  absl::StatusOr<EventHandle> GetEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!event_pool_.empty()) {
      EventHandle e = event_pool_.back();
      event_pool_.pop_back();
      return e;
    }
    core_internal::MakeVectorRoom(event_pool_, events_created_ + 1);
    absl::StatusOr<EventHandle> e = driver_.EventCreate(kEventDisableTiming);
    if (e.ok()) ++events_created_;
    return e;
  }
  void PutEvent(EventHandle e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    event_pool_.push_back(e);
  }

  // The stream was destroyed: its queued work still runs, so wait for all
  // work of the context once; after that nothing can use its memory.
  absl::Status HandleDestroyed(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    ++num_host_syncs_;
    CTXPOOL_RETURN_IF_ERROR(driver_.CtxSynchronize());
    if (!ss->destroyed) {
      ss->destroyed = true;
      ++destroyed_streams_;
    }
    return absl::OkStatus();
  }

  // Makes sure no work queued so far on `ss`'s stream is still running:
  // records an event, and waits for it only if it is not already complete.
  absl::Status EnsureIdle(StreamState* ss, int* waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    if (ss->destroyed) return absl::OkStatus();
    if (ss->retired) {
      if (RetiredIdle(ss, /*wait=*/true, waits)) return absl::OkStatus();
      return absl::InternalError(core_internal::Format(
          "cannot wait for the work of retired stream 0x%x", ss->stream));
    }
    CTXPOOL_ASSIGN_OR_RETURN(EventHandle e, GetEvent());
    absl::Status s = driver_.EventRecord(e, StreamHandle(ss->stream));
    if (!s.ok()) {
      PutEvent(e);
      if (IsInvalidHandle(s)) return HandleDestroyed(ss);
      return s;
    }
    absl::StatusOr<bool> done = driver_.EventQuery(e);
    if (done.ok() && !*done) {
      ++num_host_syncs_;
      ++*waits;
      s = driver_.EventSynchronize(e);
    } else {
      s = done.status();
    }
    PutEvent(e);
    return s;
  }

  // Frees a block of `ss` that other streams used: one event per such
  // stream, the block stays pending until all complete (PollPending).
  // REQUIRES: AllShards.
  absl::Status DeallocateWithUses(StreamState* ss, Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    absl::InlinedVector<EventHandle, 4> events;
    // Host memory first: the events and the pending entries cannot throw
    // std::bad_alloc once events are recorded (their way back to the pool
    // cannot either: GetEvent keeps room there).
    const std::size_t uses = b->stream_uses.size();
    events.reserve(uses);
    core_internal::MakeVectorRoom(pending_, uses);
    bool need_sync = false;
    for (std::uint64_t s : b->stream_uses) {
      auto it = streams_.find(s);
      StreamState* used = it == streams_.end() ? nullptr : it->second.get();
      if (used != nullptr) {
        used->mu.AssertHeld();
        if (used->retired) {
          // Its work is ordered by the retire event: no record on the dead
          // handle; the block waits for that event here (rare: a stream
          // retired while a block it used is still live).
          if (!RetiredIdle(used, /*wait=*/true, nullptr)) {
            need_sync = true;
            break;
          }
          continue;
        }
      }
      absl::StatusOr<EventHandle> e = GetEvent();
      if (!e.ok()) {
        need_sync = true;
        break;
      }
      absl::Status st = driver_.EventRecord(*e, StreamHandle(s));
      if (!st.ok()) {
        PutEvent(*e);
        need_sync = true;
        if (IsInvalidHandle(st)) {
          if (used == nullptr) {
            ++destroyed_streams_;
          } else {
            used->mu.AssertHeld();
            if (!used->destroyed) {
              used->destroyed = true;
              ++destroyed_streams_;
            }
          }
        }
        break;
      }
      events.push_back(*e);
    }
    if (need_sync) {
      // A stream could not take an event (destroyed, or the driver failed):
      // wait for all work of the context instead.
      ++num_host_syncs_;
      absl::Status st = driver_.CtxSynchronize();
      if (!st.ok()) {
        for (EventHandle e : events) PutEvent(e);
        return st;  // the block stays live; the caller may retry
      }
      for (EventHandle e : events) PutEvent(e);
      events.clear();
    }
    ss->live.erase(b->address);
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kFree, b->address, b->requested, ss->stream,
                       ss->tenant);
      if (events.empty()) {
        recorder_.Record(TraceOp::kFreeCompleted, b->address, b->size,
                         ss->stream, ss->tenant);
      }
    }
    RemoveAllocatedStats(ss, b);
    if (events.empty()) {
      FreeToIndex(ss, b);
      return absl::OkStatus();
    }
    b->state = BlockState::kPendingFree;
    b->pending_events = static_cast<int>(events.size());
    for (EventHandle e : events) pending_.push_back({b, e});
    return absl::OkStatus();
  }

  // Frees the pending blocks whose events completed; with `waits` non-null,
  // waits for incomplete ones (counting each wait). REQUIRES: AllShards,
  // context set.
  void ProcessPending(int* waits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t i = 0;
    while (i < pending_.size()) {
      PendingEvent p = pending_[i];
      // A failed query is not a completion: the other stream may still use
      // the block. It stays pending (counted) until a query or a wait
      // succeeds, or Reset(force) drops it.
      absl::StatusOr<bool> done = driver_.EventQuery(p.event);
      if (!done.ok()) ++driver_errors_;
      bool complete = done.ok() && *done;
      if (!complete && waits != nullptr) {
        ++num_host_syncs_;
        ++*waits;
        absl::Status synced = driver_.EventSynchronize(p.event);
        if (!synced.ok()) ++driver_errors_;
        complete = synced.ok();
      }
      if (!complete) {
        ++i;
        continue;
      }
      PutEvent(p.event);
      pending_[i] = pending_.back();
      pending_.pop_back();
      if (--p.block->pending_events == 0) {
        StreamState* ss = ShardOf(p.block->segment);
        ss->mu.AssertHeld();
        if (recorder_.enabled()) {
          recorder_.Record(TraceOp::kFreeCompleted, p.block->address,
                           p.block->size, ss->stream, ss->tenant);
        }
        FreeToIndex(ss, p.block);
      }
    }
  }
  void PollPending() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ProcessPending(nullptr);
  }
  void SyncPending(int* waits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ProcessPending(waits);
  }

  // ---- Segments
  // -------------------------------------------------------------- (All of this
  // section is slow path: REQUIRES AllShards.)

  // A segment object: recycled, never deleted before the allocator (the
  // address maps' readers may hold a stale one).
  DeviceSegment* NewSegmentObject() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!free_segments_.empty()) {
      DeviceSegment* seg = free_segments_.back();
      free_segments_.pop_back();
      return seg;
    }
    // Room to recycle every object first, so that RecycleSegmentObject
    // cannot throw std::bad_alloc (it runs after the driver freed memory).
    if (free_segments_.capacity() <= segment_store_.size()) {
      free_segments_.reserve(2 * segment_store_.size() + 8);
    }
    segment_store_.push_back(std::make_unique<DeviceSegment>());
    return segment_store_.back().get();
  }
  void RecycleSegmentObject(DeviceSegment* seg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    seg->shard.store(nullptr, std::memory_order_release);
    seg->owner = nullptr;
    seg->first = nullptr;
    seg->base = 0;
    seg->size = 0;
    seg->stream = 0;
    seg->backing_handle = 0;
    seg->free_since = absl::InfinitePast();
    free_segments_.push_back(seg);
  }
  // Records `seg` as the segment of `ss`, for the books and the maps.
  void Own(Segment* seg, StreamState* ss) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    seg->owner = ss;
    seg->stream = ss->stream;
    static_cast<DeviceSegment*>(seg)->shard.store(ss,
                                                  std::memory_order_release);
  }

  // The largest wholly free segment of another stream that a request takes
  // without pressure: the segment it would get new plus a large segment
  // (PyTorch's slack for an oversize block). A small request that took a
  // larger one would pin it (a 4 MiB block in a 100 MiB segment), out of
  // reach of Trim and of the next large request, which matters most under
  // memory_limit_bytes. Saturates (large_segment_bytes may be huge).
  std::size_t TakeCap(std::size_t rounded) const {
    const std::size_t segment = classes_.SegmentBytes(rounded);
    const std::size_t slack = options_.large_segment_bytes;
    return slack > kNoLimit - segment ? kNoLimit : segment + slack;
  }

  // The smallest wholly free segment of another stream that can serve the
  // request, is at most `most` bytes, and that allow(seg) accepts.
  template <typename Allow>
  Segment* FindStealable(StreamState* ss, std::size_t rounded, bool small,
                         std::size_t most, Allow allow)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* best = nullptr;
    for (StreamState* other : SortedStreams()) {
      other->mu.AssertHeld();
      if (other == ss) continue;
      const FreeIndex<Segment>& index = other->whole_free[PoolIndex(small)];
      for (Segment* seg = index.LowerBound(rounded); seg != nullptr;
           seg = FreeIndex<Segment>::Next(seg)) {
        if (seg->size > most ||
            (best != nullptr &&
             (seg->size > best->size ||
              (seg->size == best->size && seg->base > best->base)))) {
          break;  // the rest of this index is larger
        }
        if (classes_.CanServe(seg->size, rounded) && allow(seg)) {
          best = seg;
          break;
        }
      }
    }
    return best;
  }

  // Classic mode under device pressure: takes another stream's wholly free
  // segment of at most `most` bytes that can serve the request, of its own
  // tenant or of another never below that tenant's min nor above the
  // requester's max, and counts it as reclaimed on both sides.
  absl::StatusOr<Segment*> ReclaimSegment(StreamState* ss, std::size_t rounded,
                                          bool small, std::size_t most)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    const TenantId tenant = ss->tenant;
    const Budget& mine = tenants_[tenant]->budget;
    Segment* seg =
        FindStealable(ss, rounded, small, most,
                      [&](Segment* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                        StreamState* from = ShardOf(s);
                        from->mu.AssertHeld();
                        const TenantId owner = from->tenant;
                        if (owner == tenant) return true;
                        const std::size_t min = tenants_[owner]->budget.min;
                        return TenantMapped(owner) >= min + s->size &&
                               (mine.max == kNoLimit ||
                                TenantMapped(tenant) + s->size <= mine.max);
                      });
    if (seg == nullptr) return nullptr;
    StreamState* from = ShardOf(seg);
    from->mu.AssertHeld();
    const TenantId owner = from->tenant;
    CTXPOOL_RETURN_IF_ERROR(MoveSegment(seg, ss));
    if (owner != ss->tenant) {
      tenants_[owner]->reclaimed_from += seg->size;
      tenants_[ss->tenant]->reclaimed_by += seg->size;
    }
    return seg;
  }

  // Per tenant, the bytes it holds (the OOM path's before/after count).
  std::vector<std::size_t> MappedByTenant() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::size_t> v(tenants_.size(), 0);
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      v[t] = TenantMapped(static_cast<TenantId>(t));
    }
    return v;
  }

  // Hands wholly free `seg` to stream `to`, ordering `to`'s later work after
  // the owner's queued work with an event: no host synchronise. Its one
  // block moves to `to`'s arena.
  absl::Status MoveSegment(Segment* seg, StreamState* to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, to->mu) {
    StreamState* from = ShardOf(seg);
    from->mu.AssertHeld();
    to->blocks.Reserve();  // std::bad_alloc before anything changes
    if (from->retired) {
      absl::Status s =
          driver_.StreamWaitEvent(StreamHandle(to->stream), from->retire_event);
      if (!s.ok()) {
        if (IsInvalidHandle(s)) ++invalid_requests_;
        return s;
      }
      ++num_stream_waits_;
    } else if (!from->destroyed) {
      CTXPOOL_ASSIGN_OR_RETURN(EventHandle e, GetEvent());
      absl::Status s = driver_.EventRecord(e, StreamHandle(from->stream));
      if (!s.ok()) {
        PutEvent(e);
        if (!IsInvalidHandle(s)) return s;
        CTXPOOL_RETURN_IF_ERROR(HandleDestroyed(from));
      } else {
        s = driver_.StreamWaitEvent(StreamHandle(to->stream), e);
        PutEvent(e);
        if (!s.ok()) {
          if (IsInvalidHandle(s)) ++invalid_requests_;
          return s;
        }
        ++num_stream_waits_;
      }
    }
    Block* old = seg->first;
    Unindex(from, old);
    const auto size = static_cast<std::int64_t>(seg->size);
    Bump(from, &PoolStats::segment, seg->small, -1);
    BumpReserved(from, seg->small, -size);
    from->blocks.Delete(old);
    Block* b = to->blocks.New();
    b->address = seg->base;
    b->size = seg->size;
    b->segment = seg;
    b->state = BlockState::kFree;
    seg->first = b;
    Own(seg, to);
    Bump(to, &PoolStats::segment, seg->small, 1);
    BumpReserved(to, seg->small, size);
    Index(to, b);
    return absl::OkStatus();
  }

  // A new segment from the backing, indexed as one free block of `ss`.
  absl::StatusOr<Block*> NewSegment(StreamState* ss, std::size_t bytes,
                                    bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    CTXPOOL_RETURN_IF_ERROR(alloc_internal::CheckMemoryLimit(
        "cuMemAlloc", options_.memory_limit_bytes, Reserved(), bytes));
    // Host bookkeeping first and the books last, so that host memory
    // running out (std::bad_alloc) loses no device memory and leaves the
    // books as they were.
    DeviceSegment* seg = NewSegmentObject();
    Block* b = ss->blocks.New();
    absl::StatusOr<BackedRange> range = backing_->Allocate(bytes);
    if (!range.ok()) {
      ss->blocks.Delete(b);
      RecycleSegmentObject(seg);
      return range.status();
    }
    ++upstream_allocs_;
    seg->base = range->base.address();
    seg->size = range->size;
    seg->small = small;
    seg->backing_handle = range->handle;
    b->address = seg->base;
    b->size = seg->size;
    b->segment = seg;
    b->state = BlockState::kFree;
    seg->first = b;
    try {
      pages_.Prepare(seg);
      segments_.emplace(seg->base, seg);
    } catch (...) {
      if (backing_->Free(*range).ok()) ++upstream_frees_;
      ss->blocks.Delete(b);
      RecycleSegmentObject(seg);
      throw;
    }
    Own(seg, ss);
    pages_.Insert(seg);
    Bump(ss, &PoolStats::segment, small, 1);
    BumpReserved(ss, small, static_cast<std::int64_t>(seg->size));
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kSegmentMap, seg->base, seg->size, ss->stream,
                       ss->tenant);
    }
    Index(ss, b);
    NotePeak(ss->tenant);
    return b;
  }

  // With `free_memory`, returns `seg`'s range to the backing; then removes
  // it and its blocks from the books (live blocks are dropped). When the
  // backing fails and `keep_on_error`, the segment stays as it was.
  // REQUIRES: no pending_ entry refers to its blocks.
  absl::Status DropSegment(Segment* seg, bool free_memory, bool keep_on_error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status s;
    StreamState* ss = ShardOf(seg);
    ss->mu.AssertHeld();
    const bool small = seg->small;
    if (expandable_) {
      // Unmap every piece (to the cache), then give the range back.
      VmmRange* r = RangeOf(seg);
      bool unreserved = false;
      // Host memory first: the range table's next version.
      RangeTable::Prepared erased = ranges_.PrepareErase(seg);
      if (free_memory) {
        std::vector<std::size_t> starts;
        starts.reserve(r->pieces.size());
        for (const auto& [start, piece] : r->pieces) starts.push_back(start);
        vmm_.ReserveCache(starts.size());  // no std::bad_alloc once unmapping
        for (std::size_t i : starts) {
          std::size_t n = 0;
          absl::Status u = UnmapPiece(seg, i, &n);
          if (!u.ok() && s.ok()) s = u;
        }
        // The pieces unmapped so far are in the cache; the rest stay
        // mapped under free blocks, and the range stays, for a retry.
        if (!s.ok() && keep_on_error) {
          MarkUnmappedRuns(seg);
          return s;
        }
        if (s.ok()) {
          s = vmm_.Unreserve(r);
          if (s.ok()) {
            unreserved = true;
          } else if (keep_on_error) {
            MarkUnmappedRuns(seg);
            return s;
          }
        }
      }
      if (!unreserved) {
        // Whatever could not be unmapped is dropped from the books: leaked.
        BumpReserved(ss, small, -static_cast<std::int64_t>(r->mapped));
        vmm_.Forget(r);
      }
      for (Segment*& slot : ss->range[PoolIndex(small)]) {
        if (slot == seg) slot = nullptr;
      }
      ranges_.CommitErase(std::move(erased));
    } else {
      if (free_memory) {
        s = backing_->Free(
            BackedRange{DevicePtr(seg->base), seg->size, seg->backing_handle});
        if (s.ok()) {
          ++upstream_frees_;
          if (recorder_.enabled()) {
            recorder_.Record(TraceOp::kSegmentUnmap, seg->base, seg->size,
                             seg->stream, ss->tenant);
          }
        } else if (keep_on_error) {
          return s;
        } else {
          leaked_bytes_ += seg->size;
        }
      } else {
        leaked_bytes_ += seg->size;  // never freed: no context to free it in
      }
      pages_.Erase(seg);
    }
    for (Block* b = seg->first; b != nullptr;) {
      Block* next = b->next;
      switch (b->state) {
        case BlockState::kAllocated: {
          ss->live.erase(b->address);
          auto* sub = static_cast<SubAccount*>(b->owner_data);
          RemoveAllocatedStats(ss, b);
          if (sub != nullptr) {  // dropped by a forced Reset: a reclaim
            --sub->frees;
            ++sub->reclaimed;
          }
        }
          [[fallthrough]];
        case BlockState::kPendingFree:
          Bump(ss, &PoolStats::active, small, -1);
          Bump(ss, &PoolStats::active_bytes, small,
               -static_cast<std::int64_t>(b->size));
          break;
        case BlockState::kFree:
          Unindex(ss, b);
          break;
      }
      ss->blocks.Delete(b);
      b = next;
    }
    Bump(ss, &PoolStats::segment, small, -1);
    if (!expandable_) {
      BumpReserved(ss, small, -static_cast<std::int64_t>(seg->size));
    }
    segments_.erase(seg->base);
    RecycleSegmentObject(static_cast<DeviceSegment*>(seg));
    return s;
  }

  // Expandable mode, after unmapping failed part way: carves the unmapped
  // granule runs under `seg`'s mapped free blocks into unmapped blocks, so
  // that the blocks say again what is mapped (I9, I11). Error path only:
  // linear in the segment's blocks and granules.
  void MarkUnmappedRuns(Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const VmmRange* r = RangeOf(seg);
    std::vector<Block*> mapped_free;
    for (Block* b = seg->first; b != nullptr; b = b->next) {
      if (MappedFree(b)) mapped_free.push_back(b);
    }
    for (Block* b : mapped_free) {
      const auto [lo, hi] = WholeGranules(b);
      // Highest run first, so that `b` stays the block below it.
      for (std::size_t i = hi; i > lo;) {
        if (r->IsMapped(i - 1)) {
          --i;
          continue;
        }
        const std::size_t run_hi = i;
        while (i > lo && !r->IsMapped(i - 1)) --i;
        Carve(b, r->base + i * granule_, r->base + run_hi * granule_,
              /*to_unmapped=*/true);
      }
    }
  }

  // The wholly free segments (both pools, every stream) for which keep(seg)
  // is true.
  template <typename Keep>
  std::vector<Segment*> WholeFreeWhere(Keep keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Segment*> out;
    for (StreamState* ss : SortedStreams()) {
      ss->mu.AssertHeld();
      for (const FreeIndex<Segment>& index : ss->whole_free) {
        for (Segment* seg = index.First(); seg != nullptr;
             seg = FreeIndex<Segment>::Next(seg)) {
          if (keep(seg)) out.push_back(seg);
        }
      }
    }
    return out;
  }

  // Returns wholly free segments (of `only`, or of every stream when null) to
  // the driver, largest first, until reserved − allocated <= keep_bytes.
  // Waits (counted in result->event_waits) for owner streams with queued
  // work; segments whose owner cannot be waited for are skipped and counted
  // in *busy_bytes. REQUIRES: context set.
  absl::Status ReleaseCached(StreamState* only, std::size_t keep_bytes,
                             TrimResult* result, std::size_t* busy_bytes,
                             bool protect_min = false, bool wait = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Segment*> candidates =
        WholeFreeWhere([&](Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return only == nullptr || ShardOf(seg) == only;
        });
    FoldAll();
    const std::size_t allocated = Current(totals_.agg.allocated_bytes);
    return DropWholeFree(
        std::move(candidates), wait, protect_min,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return Reserved() - allocated <= keep_bytes;
        },
        result, busy_bytes);
  }

  // Returns the wholly free `candidates` to the driver, largest first, until
  // done(). With `wait`, waits for owner streams with queued work (counted in
  // result->event_waits); without, skips them (no host synchronise). Skipped
  // segments are counted in *busy_bytes. With `protect_min`, never takes a
  // tenant below its min. REQUIRES: context set; candidates wholly free.
  template <typename Done>
  absl::Status DropWholeFree(std::vector<Segment*> candidates, bool wait,
                             bool protect_min, Done done, TrimResult* result,
                             std::size_t* busy_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::sort(candidates.begin(), candidates.end(),
              [](const Segment* a, const Segment* b) {
                return a->size != b->size ? a->size > b->size
                                          : a->base < b->base;
              });
    absl::flat_hash_set<std::uint64_t> idle;
    absl::flat_hash_set<std::uint64_t> busy;
    // Room first: a set that grows during a std::bad_alloc is left corrupt.
    core_internal::MakeRoom(idle, candidates.size());
    core_internal::MakeRoom(busy, candidates.size());
    absl::Status first_error;
    for (Segment* seg : candidates) {
      if (done()) break;
      StreamState* owner = ShardOf(seg);
      owner->mu.AssertHeld();
      if (protect_min) {  // never below another tenant's min
        const std::size_t min = tenants_[owner->tenant]->budget.min;
        if (min != 0 && TenantMapped(owner->tenant) < min + seg->size) continue;
      }
      if (busy.contains(owner->stream)) {
        *busy_bytes += seg->size;
        continue;
      }
      if (!idle.contains(owner->stream)) {
        const bool now_idle = wait
                                  ? EnsureIdle(owner, &result->event_waits).ok()
                                  : StreamIdleNow(owner);
        if (!now_idle) {
          busy.insert(owner->stream);
          *busy_bytes += seg->size;
          continue;
        }
        idle.insert(owner->stream);
      }
      const std::size_t size = seg->size;
      absl::Status s =
          DropSegment(seg, /*free_memory=*/true, /*keep_on_error=*/true);
      if (!s.ok()) {
        if (first_error.ok()) first_error = s;
        continue;
      }
      result->freed_bytes += size;
    }
    return first_error;
  }

  // Classic mode's high: a tenant above it returns its wholly free segments
  // to the driver, from streams whose queued work is done (no wait), until
  // it is at or below high. Runs at the check points (TrimIdle and the slow
  // path of Allocate), never in Deallocate: cuMemFree synchronises the
  // device. REQUIRES: context set.
  absl::Status ShedSegmentsAboveHigh(TenantId t, TrimResult* result,
                                     std::size_t* busy_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::size_t high = tenants_[t]->budget.high;
    if (TenantMapped(t) <= high) return absl::OkStatus();
    std::vector<Segment*> candidates =
        WholeFreeWhere([&](Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          StreamState* owner = ShardOf(seg);
          owner->mu.AssertHeld();
          return owner->tenant == t;
        });
    return DropWholeFree(
        std::move(candidates), /*wait=*/false, /*protect_min=*/false,
        [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return TenantMapped(t) <= high;
        },
        result, busy_bytes);
  }

  // Every tenant above its high sheds: expandable, free granules to the
  // cache (ShedAboveHigh); classic, wholly free segments to the driver.
  // Never waits. REQUIRES: context set.
  absl::Status ShedAllAboveHigh(TrimResult* result, std::size_t* busy_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status status;
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      if (tenants_[t]->budget.high == kNoLimit) continue;
      const auto id = static_cast<TenantId>(t);
      if (expandable_) {
        ShedAboveHigh(id);
      } else {
        status.Update(ShedSegmentsAboveHigh(id, result, busy_bytes));
      }
    }
    return status;
  }

  // The decay check (options_.idle_release_after), run by TrimIdle and at
  // the end of Allocate's slow path; it reads the clock once and never
  // waits. Expandable: a stream with no block taken or freed for
  // idle_release_after (measured between checks, see StreamState) has its
  // free mapped granules unmapped into the cache once its queued work is
  // done; then cached granules unused that long are released. Classic:
  // wholly free segments first seen free by a check at least
  // idle_release_after ago are returned to the driver, skipping owners with
  // queued work. Freed bytes add to result->freed_bytes, skipped ones to
  // *busy_bytes. REQUIRES: context set.
  absl::Status DecayIdle(TrimResult* result, std::size_t* busy_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (options_.idle_release_after == absl::InfiniteDuration()) {
      return absl::OkStatus();
    }
    const absl::Time now = Now();
    const absl::Time cutoff = now - options_.idle_release_after;
    absl::Status status;
    if (expandable_) {
      std::vector<StreamState*> stale;
      for (StreamState* ss : SortedStreams()) {
        ss->mu.AssertHeld();
        if (ss->ops != ss->ops_seen || ss->active_at == absl::InfinitePast()) {
          ss->ops_seen = ss->ops;
          ss->active_at = now;
        } else if (ss->active_at <= cutoff && ss->decayed_ops != ss->ops) {
          stale.push_back(ss);
        }
      }
      for (StreamState* ss : stale) {
        ss->mu.AssertHeld();
        bool busy = false;
        absl::Status s = UnmapFreeGranules(ss, kNoLimit, /*wait=*/false,
                                           nullptr, &busy, nullptr);
        status.Update(s);
        if (busy) {
          *busy_bytes += FreeMappedBytes(ss);
        } else if (s.ok()) {
          ss->decayed_ops = ss->ops;
        }
      }
    } else {
      // Stamps segments seen wholly free for the first time; takes the stale.
      std::vector<Segment*> stale = WholeFreeWhere([&](Segment* seg) {
        auto* d = static_cast<DeviceSegment*>(seg);
        if (d->free_since != absl::InfinitePast()) {
          return d->free_since <= cutoff;
        }
        d->free_since = now;
        return false;
      });
      status.Update(DropWholeFree(
          std::move(stale), /*wait=*/false, /*protect_min=*/false,
          [] { return false; }, result, busy_bytes));
    }
    status.Update(DecayCache(now, &result->freed_bytes));
    return status;
  }

  // ---- Tenants (helpers) ---------------------------------------------------

  std::size_t TenantMapped(TenantId t) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return tenants_[t]->mapped.load(std::memory_order_relaxed);
  }
  // REQUIRES: AllShards.
  std::size_t TenantLive(TenantId t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t n = 0;
    for (const StreamState* ss : tenants_[t]->streams) {
      ss->mu.AssertHeld();
      n += Current(ss->stats.allocated_bytes);
    }
    return n;
  }
  // The tenant's streams, by handle (deterministic order).
  std::vector<StreamState*> TenantStreams(TenantId t) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<StreamState*> v = tenants_[t]->streams;
    SortByStream(&v);
    return v;
  }
  // Moves `ss` (and the memory it holds) from its tenant to `t`.
  void SetTenant(StreamState* ss, TenantId t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    std::vector<StreamState*>& to = tenants_[t]->streams;
    core_internal::MakeVectorRoom(to, 1);  // first
    std::vector<StreamState*>& from = tenants_[ss->tenant]->streams;
    from.erase(std::find(from.begin(), from.end(), ss));
    const std::size_t held = Current(ss->stats.reserved_bytes);
    tenants_[ss->tenant]->mapped.fetch_sub(held, std::memory_order_relaxed);
    tenants_[t]->streams.push_back(ss);
    tenants_[t]->mapped.fetch_add(held, std::memory_order_relaxed);
    SetTenantFields(ss, t);
  }
  void NotePeak(TenantId t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Tenant& tn = *tenants_[t];
    tn.peak = std::max(tn.peak, TenantMapped(t));
  }
  // A tenant's max refused `growth` more bytes: fills the report (the
  // device part too) and sets *oom, so that Allocate calls on_oom and counts
  // the failure as for a device OOM.
  absl::Status TenantOom(StreamState* ss, std::size_t rounded,
                         std::size_t requested, std::size_t growth,
                         OomReport* report, bool* oom)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    const Tenant& t = *tenants_[ss->tenant];
    FillReport(ss, rounded, requested, report);
    report->tenant_limit = true;
    report->growth_bytes = growth;
    report->tenant_max_bytes = t.budget.max;
    *oom = true;
    return absl::ResourceExhaustedError(report->ToString());
  }

  // ---- Expandable segments (granules) -------------------------------------

  static VmmRange* RangeOf(const Segment* seg) {
    return reinterpret_cast<VmmRange*>(
        static_cast<std::uintptr_t>(seg->backing_handle));
  }
  absl::Time Now() const {
    return options_.clock ? options_.clock() : absl::Now();
  }
  std::size_t CacheBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return vmm_.cache_bytes();
  }
  // The bytes of [address, address + bytes) that lie on mapped granules.
  std::size_t MappedBytes(const Segment* seg, std::uint64_t address,
                          std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const VmmRange* r = RangeOf(seg);
    const std::uint64_t end = address + bytes;
    std::size_t n = 0;
    r->ForEachMapped((address - r->base) / granule_,
                     (end - r->base + granule_ - 1) / granule_,
                     [&](std::size_t i, PhysicalMemHandle) {
                       const std::uint64_t lo = std::max<std::uint64_t>(
                           address, r->base + i * granule_);
                       const std::uint64_t hi = std::min<std::uint64_t>(
                           end, r->base + (i + 1) * granule_);
                       n += hi - lo;
                       return true;
                     });
    return n;
  }
  std::size_t UnmappedBytes(const Segment* seg, std::uint64_t address,
                            std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const VmmRange* r = RangeOf(seg);
    const std::size_t lo = (address - r->base) / granule_;
    const std::size_t hi = (address + bytes - 1 - r->base) / granule_;
    return (hi + 1 - lo - r->CountMapped(lo, hi + 1)) * granule_;
  }

  // Trim's last step over the ranges: each one that maps no granule goes
  // back to the driver, except a (stream, pool)'s last one (its next growth
  // goes there). Extra ranges (kMaxRanges) come when live blocks split the
  // first; once those are freed the address space is given back, and the
  // slot is free for the next. Only address space: no physical memory. A
  // range the driver keeps stays as it was, for the next Trim.
  absl::Status DropEmptyRanges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::Status status;
    for (StreamState* ss : SortedStreams()) {
      ss->mu.AssertHeld();
      for (auto& slots : ss->range) {
        int held = 0;
        for (const Segment* r : slots) held += r != nullptr ? 1 : 0;
        for (Segment* r : slots) {
          if (held <= 1) break;
          // No mapped granule: one unmapped free block (I9, I11), so no
          // live, pending or quarantined block and no pending_ entry.
          if (r == nullptr || RangeOf(r)->mapped != 0) continue;
          absl::Status s =
              DropSegment(r, /*free_memory=*/true, /*keep_on_error=*/true);
          if (s.ok()) {
            --held;
          } else {
            status.Update(s);
          }
        }
      }
    }
    return status;
  }

  // Whether no placement could serve `rounded`: with the bytes allocated
  // (all mapped) it passes the device's memory or memory_limit_bytes
  // (DeviceCannotHold), or the max of `ss`'s tenant. Another virtual range
  // would not help such a request.
  bool DeviceCannotHold(std::size_t rounded) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    FoldAll();
    std::size_t cap = device_total_;
    if (options_.memory_limit_bytes != 0) {
      cap = std::min(cap, options_.memory_limit_bytes);
    }
    const std::size_t live = Current(totals_.agg.allocated_bytes);
    return live > cap || rounded > cap - live;
  }
  bool TenantCannotHold(StreamState* ss, std::size_t rounded) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    const std::size_t max = tenants_[ss->tenant]->budget.max;
    if (max == kNoLimit) return false;
    const std::size_t live = TenantLive(ss->tenant);
    return live > max || rounded > max - live;
  }

  // Reserves the stream's first range for a pool on first use.
  absl::Status EnsureRange(StreamState* ss, bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    for (Segment*& slot : ss->range[PoolIndex(small)]) {
      if (slot != nullptr) return absl::OkStatus();
    }
    return ReserveRange(ss, small, &ss->range[PoolIndex(small)][0]).status();
  }

  // Reserves a range for the stream's pool into the empty `slot`, one
  // unmapped free block.
  absl::StatusOr<Segment*> ReserveRange(StreamState* ss, bool small,
                                        Segment** slot)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    // Twice the device's memory: virtual space is cheap, and the slack keeps
    // address-space fragmentation from failing a request that physical
    // memory could serve.
    const std::size_t size = 2 * SizeClasses::RoundUp(device_total_, granule_);
    // Host memory first, undone when a later step throws std::bad_alloc.
    DeviceSegment* seg = NewSegmentObject();
    absl::StatusOr<VmmRange*> reserved;
    try {
      ss->blocks.Reserve();
      reserved = vmm_.Reserve(size);
    } catch (...) {
      RecycleSegmentObject(seg);
      throw;
    }
    if (!reserved.ok()) {
      RecycleSegmentObject(seg);
      return reserved.status();
    }
    VmmRange* r = *reserved;
    seg->base = r->base;
    seg->size = size;
    seg->small = small;
    seg->backing_handle =
        static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(r));
    Own(seg, ss);  // before the lock-free range table publishes it
    try {
      segments_.emplace(r->base, seg);
      ranges_.Insert(seg);
    } catch (...) {
      segments_.erase(r->base);
      (void)vmm_.Unreserve(r);
      RecycleSegmentObject(seg);
      throw;
    }
    Block* b = ss->blocks.New();
    b->address = seg->base;
    b->size = seg->size;
    b->segment = seg;
    b->state = BlockState::kFree;
    b->unmapped = true;
    seg->first = b;
    Bump(ss, &PoolStats::segment, small, 1);
    *slot = seg;
    Index(ss, b);
    return seg;
  }

  // Maps the granules of [lo, hi) (granule aligned, inside unmapped free
  // block `u` of `seg`) through the backing (ExpandableBacking::MapRun:
  // cached pieces first, then new allocations, in units sized by the
  // headroom; one cuMemMap per unit and one cuMemSetAccess for the run).
  // Returns the mapped free block (coalesced with its mapped neighbours) that
  // now covers [lo, hi). On failure the run is rolled back into the cache, but
  // for pieces that could be neither given access nor unmapped: those stay
  // mapped on the books (never mapped twice) as mapped free blocks.
  absl::StatusOr<Block*> MapRun(Segment* seg, Block* u, std::uint64_t lo,
                                std::uint64_t hi)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    VmmRange* r = RangeOf(seg);
    // Host memory first: the blocks Carve and the TakeBlock after it make,
    // and room in the live map (a std::bad_alloc after the driver mapped
    // would strand the mapping off the books).
    StreamState* ss = ShardOf(seg);
    ss->mu.AssertHeld();
    ss->blocks.Reserve(3);
    core_internal::MakeRoom(ss->live, 1);
    std::vector<StuckPiece> stuck;
    absl::Status s =
        vmm_.MapRun(r, (lo - r->base) / granule_, (hi - lo) / granule_, &stuck);
    if (s.ok()) {
      NoteMapped(seg, lo, hi - lo);
      return Carve(u, lo, hi, /*to_unmapped=*/false);
    }
    // Highest first, so that `u` still starts the unmapped rest below. A
    // piece without access is quarantined: touching it would fault.
    for (auto it = stuck.rbegin(); it != stuck.rend(); ++it) {
      const std::uint64_t where = r->base + it->granule * granule_;
      NoteMapped(seg, where, it->count * granule_);
      if (it->access) {
        Carve(u, where, where + it->count * granule_, /*to_unmapped=*/false);
      } else {
        Quarantine(u, where, where + it->count * granule_);
      }
    }
    return s;
  }

  // Makes [lo, hi) of unmapped block `u` (granule aligned) a quarantined
  // block: mapped on the books, in no index, never coalesced.
  void Quarantine(Block* u, std::uint64_t lo, std::uint64_t hi)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Block* b = SplitOut(u, lo, hi);
    b->unmapped = false;
    b->quarantined = true;
  }

  // Splits [lo, hi) out of free block `b`: the parts outside stay as they
  // were (indexed); the returned block covering [lo, hi) is unindexed.
  Block* SplitOut(Block* b, std::uint64_t lo, std::uint64_t hi)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = ShardOf(b->segment);
    ss->mu.AssertHeld();
    Unindex(ss, b);
    if (lo > b->address) {
      Block* mid = SplitBlock(b, lo - b->address, ss->blocks);
      Index(ss, b);
      b = mid;
    }
    if (hi < b->end()) Index(ss, SplitBlock(b, hi - b->address, ss->blocks));
    return b;
  }

  // Books [address, +bytes) of `seg` as newly mapped: stats and trace.
  void NoteMapped(Segment* seg, std::uint64_t address, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = ShardOf(seg);
    ss->mu.AssertHeld();
    BumpReserved(ss, seg->small, static_cast<std::int64_t>(bytes));
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kSegmentMap, address, bytes, ss->stream,
                       ss->tenant);
    }
  }

  // Turns [lo, hi) of free block `b` (granule aligned when it changes the
  // mapping) into a free block of the other kind: mapped when !to_unmapped,
  // else unmapped. The parts of `b` outside stay as they were. Returns the
  // new block, coalesced with its neighbours of the same kind and indexed.
  Block* Carve(Block* b, std::uint64_t lo, std::uint64_t hi, bool to_unmapped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = ShardOf(b->segment);
    ss->mu.AssertHeld();
    b = SplitOut(b, lo, hi);
    b->unmapped = to_unmapped;
    b = Coalesce(ss, b);
    Index(ss, b);
    return b;
  }

  // Unmaps the mapping that starts at granule `i` of `seg` into the cache;
  // returns its granules in *count. REQUIRES: no queued work uses it (its
  // stream was found idle).
  absl::Status UnmapPiece(Segment* seg, std::size_t i, std::size_t* count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    VmmRange* r = RangeOf(seg);
    CTXPOOL_RETURN_IF_ERROR(vmm_.UnmapPiece(r, i, count));
    const std::size_t bytes = *count * granule_;
    StreamState* ss = ShardOf(seg);
    ss->mu.AssertHeld();
    BumpReserved(ss, seg->small, -static_cast<std::int64_t>(bytes));
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kSegmentUnmap, r->base + i * granule_, bytes,
                       ss->stream, ss->tenant);
    }
    return absl::OkStatus();
  }

  // A run of whole granules [lo, hi) (indexes in the range) under the mapped
  // free block `block`.
  struct GranuleRun {
    Block* block;
    std::size_t lo;
    std::size_t hi;
  };
  // The whole granules under block `b` of an expandable range: [lo, hi),
  // range-relative (empty when lo >= hi).
  std::pair<std::size_t, std::size_t> WholeGranules(const Block* b) const {
    const VmmRange* r = RangeOf(b->segment);
    return {(b->address - r->base + granule_ - 1) / granule_,
            (b->end() - r->base) / granule_};
  }

  // Calls fn(run) for the whole granules under each mapped free block of
  // `ss` (large pool first, largest block first) that does not overlap
  // [skip_lo, skip_hi), until fn returns false. Walks the free indexes only
  // (never the allocated blocks), and stops at blocks under a granule. With
  // `within`, only the blocks of its pool inside its addresses.
  template <typename Fn>
  void ForFreeGranuleRuns(StreamState* ss, std::uint64_t skip_lo,
                          std::uint64_t skip_hi, Fn fn, Within within = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    for (int pool : {1, 0}) {
      if (within.pool >= 0 && pool != within.pool) continue;
      bool mapped = false;
      for (const Segment* seg : ss->range[pool]) {
        mapped = mapped || (seg != nullptr && RangeOf(seg)->mapped != 0);
      }
      if (!mapped) continue;
      for (Block* b = ss->free[pool].Last();
           b != nullptr && b->size >= granule_; b = FreeIndex<Block>::Prev(b)) {
        if (b->address < skip_hi && b->end() > skip_lo) continue;
        if (b->address < within.lo || b->end() > within.hi) continue;
        const auto [lo, hi] = WholeGranules(b);
        if (lo >= hi) continue;
        if (!fn(GranuleRun{b, lo, hi})) return;
      }
    }
  }
  std::size_t FreeMappedBytes(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    std::size_t n = 0;
    ForFreeGranuleRuns(ss, 0, 0, [&](const GranuleRun& run) {
      n += (run.hi - run.lo) * granule_;
      return true;
    });
    return n;
  }

  // Whether the work queued on `ss` so far is done, without waiting.
  bool StreamIdleNow(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    if (ss->destroyed) return true;
    if (ss->retired) return RetiredIdle(ss, /*wait=*/false, nullptr);
    absl::StatusOr<EventHandle> e = GetEvent();
    if (!e.ok()) return false;
    absl::Status s = driver_.EventRecord(*e, StreamHandle(ss->stream));
    if (!s.ok()) {
      PutEvent(*e);
      return IsInvalidHandle(s) && HandleDestroyed(ss).ok();
    }
    absl::StatusOr<bool> done = driver_.EventQuery(*e);
    PutEvent(*e);
    return done.ok() && *done;
  }

  // Unmaps up to `want` bytes (rounded up to whole mappings) of `ss`'s free
  // mapped granules (the pieces wholly under mapped free blocks outside the
  // skip range, the top of a block first) into the cache once its queued
  // work is done: with `wait`, waits for it (counted in *waits); else sets
  // *busy and unmaps nothing. Never more than `cap` bytes in all (a piece
  // that would pass it stays). With `within`, only its blocks' granules.
  absl::Status UnmapFreeGranules(StreamState* ss, std::size_t want, bool wait,
                                 int* waits, bool* busy, std::size_t* unmapped,
                                 std::uint64_t skip_lo = 0,
                                 std::uint64_t skip_hi = 0,
                                 std::size_t cap = kNoLimit, Within within = {})
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    // Per block, the pieces to unmap: a contiguous span [lo, hi) of granules.
    absl::InlinedVector<GranuleRun, 8> todo;
    std::size_t bytes = 0;
    std::size_t npieces = 0;
    ForFreeGranuleRuns(
        ss, skip_lo, skip_hi,
        [&](const GranuleRun& run) {
          if (bytes >= want) return false;
          const VmmRange* r = RangeOf(run.block->segment);
          // The pieces wholly inside [run.lo, run.hi), in order.
          absl::InlinedVector<std::pair<std::size_t, std::size_t>, 8> pieces;
          r->ForEachPieceWithin(
              run.lo, run.hi, [&](std::size_t start, const VmmRange::Piece& p) {
                pieces.emplace_back(start, start + p.count);
                return true;
              });
          // From the top down while contiguous and wanted.
          GranuleRun take{run.block, 0, 0};
          for (auto it = pieces.rbegin(); it != pieces.rend() && bytes < want;
               ++it) {
            if (take.hi != 0 && it->second != take.lo) break;
            const std::size_t piece = (it->second - it->first) * granule_;
            if (piece > cap - bytes) break;
            if (take.hi == 0) take.hi = it->second;
            take.lo = it->first;
            bytes += (it->second - it->first) * granule_;
            ++npieces;
          }
          if (take.hi != 0) todo.push_back(take);
          return true;
        },
        within);
    if (todo.empty()) return absl::OkStatus();
    // Host memory first: the cache's room for the pieces and the blocks
    // each Carve makes, so that no std::bad_alloc follows an unmap.
    vmm_.ReserveCache(npieces);
    ss->blocks.Reserve(2 * todo.size());
    if (wait) {
      int w = 0;
      absl::Status s = EnsureIdle(ss, &w);
      if (waits != nullptr) *waits += w;
      if (!s.ok()) {
        *busy = true;
        return s;
      }
    } else if (!StreamIdleNow(ss)) {
      *busy = true;
      return absl::OkStatus();
    }
    // Carving one block touches only that block and its unmapped
    // neighbours, so the other blocks in `todo` stay valid. A block's pieces
    // are unmapped from the top down; a failure keeps the rest mapped.
    absl::Status first;
    for (const GranuleRun& take : todo) {
      Segment* seg = take.block->segment;
      const VmmRange* r = RangeOf(seg);
      std::size_t low = take.hi;
      while (low > take.lo) {
        std::size_t start = low - 1;  // the piece that ends at `low`
        r->PieceAt(low - 1, &start);
        std::size_t n = 0;
        absl::Status s = UnmapPiece(seg, start, &n);
        if (!s.ok()) {
          first.Update(s);
          break;
        }
        low = start;
      }
      if (low == take.hi) continue;
      Carve(take.block, r->base + low * granule_, r->base + take.hi * granule_,
            /*to_unmapped=*/true);
      if (unmapped != nullptr) *unmapped += (take.hi - low) * granule_;
    }
    return first;
  }

  // Releases cached physical allocations to the driver, oldest first, until
  // at most `keep_bytes` stay cached (ExpandableBacking::Release: only what
  // is wholly unmapped).
  absl::Status ReleaseGranuleCache(std::size_t keep_bytes, std::size_t* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!expandable_) return absl::OkStatus();
    return vmm_.Release(keep_bytes, freed);
  }

  // Releases cached physical allocations unmapped at least
  // options_.idle_release_after before `now`.
  absl::Status DecayCache(absl::Time now, std::size_t* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!expandable_ ||
        options_.idle_release_after == absl::InfiniteDuration()) {
      return absl::OkStatus();
    }
    return vmm_.Decay(now - options_.idle_release_after, freed);
  }

  // A tenant above its high returns its streams' free granules to the
  // cache, from streams whose queued work is done (no wait).
  void ShedAboveHigh(TenantId t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const std::size_t high = tenants_[t]->budget.high;
    std::size_t mapped = TenantMapped(t);
    if (mapped <= high) return;
    ScopedContext ctx(driver_, ctx_);
    if (!ctx.status().ok()) return;
    for (StreamState* ss : TenantStreams(t)) {
      ss->mu.AssertHeld();
      if (mapped <= high) break;
      bool busy = false;
      std::size_t got = 0;
      UnmapFreeGranules(ss, kNoLimit, /*wait=*/false, nullptr, &busy, &got)
          .IgnoreError();
      mapped -= std::min(mapped, got);
    }
  }

  // Device pressure: move free granules to the cache — the requesting
  // tenant's first, then other tenants' above their min, most over budget
  // first — without waiting for any stream. Returns the bytes moved.
  std::size_t Reclaim(StreamState* ss, std::size_t want, std::uint64_t skip_lo,
                      std::uint64_t skip_hi)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    std::size_t got = 0;
    for (StreamState* x : TenantStreams(ss->tenant)) {
      x->mu.AssertHeld();
      if (got >= want) return got;
      bool busy = false;
      UnmapFreeGranules(x, kNoLimit, /*wait=*/false, nullptr, &busy, &got,
                        x == ss ? skip_lo : 0, x == ss ? skip_hi : 0)
          .IgnoreError();
    }
    std::vector<std::pair<std::size_t, TenantId>> victims;  // (excess, id)
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      if (t == ss->tenant) continue;
      const std::size_t mapped = TenantMapped(static_cast<TenantId>(t));
      const Budget& b = tenants_[t]->budget;
      if (mapped <= b.min) continue;
      // Less than a granule beyond its allocated bytes: no whole free
      // granule to take (an OOM storm across many tenants skips them here,
      // before the sort and the per-stream walks).
      if (mapped - std::min(mapped, TenantLive(static_cast<TenantId>(t))) <
          granule_) {
        continue;
      }
      const std::size_t over_high = mapped > b.high ? mapped - b.high : 0;
      victims.emplace_back(over_high != 0 ? over_high : mapped - b.min,
                           static_cast<TenantId>(t));
      if (over_high != 0) victims.back().first += device_total_;
    }
    std::sort(victims.begin(), victims.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& [excess, t] : victims) {
      if (got >= want) break;
      const std::size_t min = tenants_[t]->budget.min;
      for (StreamState* x : TenantStreams(t)) {
        x->mu.AssertHeld();
        const std::size_t mapped = TenantMapped(t);
        if (got >= want || mapped <= min) break;
        const std::size_t allow = (mapped - min) / granule_ * granule_;
        if (allow == 0) break;
        bool busy = false;
        std::size_t moved = 0;
        UnmapFreeGranules(
            x, std::min(allow, want - got + granule_ - 1) / granule_ * granule_,
            /*wait=*/false, nullptr, &busy, &moved, 0, 0, /*cap=*/allow)
            .IgnoreError();
        tenants_[t]->reclaimed_from += moved;
        tenants_[ss->tenant]->reclaimed_by += moved;
        got += moved;
      }
    }
    return got;
  }

  // Where a request that no mapped free block serves goes: the run [lo, hi)
  // (granule aligned) of unmapped free block `u` to map. A free hole is an
  // unmapped block with, possibly, a mapped free block on either side (the
  // partial granules a reclaim leaves); a placement maps the fewest new
  // bytes that make one free block of at least `rounded`. Candidates: the
  // range's tail (the largest unmapped block), up to kProbes unmapped
  // blocks from the smallest that could serve with both neighbours (4
  // granules under the request) upward, and the unmapped neighbours of up
  // to kVisits mapped free blocks from the largest down: O(log n + kProbes
  // + kVisits).
  struct Placement {
    Block* u = nullptr;
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
    std::size_t bytes() const { return hi - lo; }
  };
  static bool MappedFree(const Block* b) {
    return b != nullptr && b->state == BlockState::kFree && !b->unmapped &&
           !b->quarantined;
  }
  static bool UnmappedFree(const Block* b) {
    return b != nullptr && b->state == BlockState::kFree && b->unmapped &&
           !b->quarantined;
  }
  // The mapped free blocks a placement extends. Its span keeps them out of
  // a reclaim, so after one the same placement can be offered again.
  struct Anchors {
    Block* prev;
    Block* next;
  };
  static Anchors AnchorsOf(const Placement& at) {
    Anchors a{nullptr, nullptr};
    if (at.lo == at.u->address && MappedFree(at.u->prev)) a.prev = at.u->prev;
    if (at.hi == at.u->end() && MappedFree(at.u->next)) a.next = at.u->next;
    return a;
  }
  // `keep`: the anchors of an earlier placement, whose holes are candidates
  // too (a reclaim in between adds holes and free remnants that could push
  // them out of the probes, and must not make the placement worse).
  // `exhaustive`: no bound on the probes and visits (O(n); for the request
  // that would otherwise fail).
  Placement Place(StreamState* ss, std::size_t rounded, bool small,
                  Anchors keep = {nullptr, nullptr},
                  bool exhaustive = false) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    const int kProbes = exhaustive ? std::numeric_limits<int>::max() : 16;
    const FreeIndex<Block>& index = ss->unmapped[PoolIndex(small)];
    const std::size_t whole = SizeClasses::RoundUp(rounded, granule_);
    Placement best;
    auto offer = [&](Block* u, std::uint64_t lo, std::uint64_t hi) {
      if (best.u == nullptr || hi - lo < best.bytes()) best = {u, lo, hi};
    };
    auto consider = [&](Block* u) {
      const std::size_t p = MappedFree(u->prev) ? u->prev->size : 0;
      const std::size_t n = MappedFree(u->next) ? u->next->size : 0;
      if (p + u->size + n < rounded) return;
      if (u->size >= whole) offer(u, u->address, u->address + whole);
      if (p != 0) {  // extend the block before u
        const std::size_t m = SizeClasses::RoundUp(rounded - p, granule_);
        if (m <= u->size) offer(u, u->address, u->address + m);
      }
      if (n != 0) {  // extend the block after u
        const std::size_t m = SizeClasses::RoundUp(rounded - n, granule_);
        if (m <= u->size) offer(u, u->end() - m, u->end());
      }
      if (p != 0 && n != 0) offer(u, u->address, u->end());  // join both
    };
    // The holes beside mapped free block `m`.
    auto consider_beside = [&](const Block* m) {
      if (UnmappedFree(m->prev)) consider(m->prev);
      if (UnmappedFree(m->next)) consider(m->next);
    };
    const std::size_t from =
        whole > 4 * granule_ ? whole - 4 * granule_ : granule_;
    int probes = 0;
    for (Block* u = index.LowerBound(from); u != nullptr && probes < kProbes;
         u = FreeIndex<Block>::Next(u), ++probes) {
      consider(u);
      if (best.u != nullptr && best.bytes() <= u->size && u->size >= whole) {
        break;  // larger blocks alone cannot map less
      }
    }
    if (Block* tail = index.Last()) consider(tail);
    // The probes stop at the first block that holds the whole request, but a
    // larger hole beside a mapped free block may map less. So the holes
    // beside the kVisits largest mapped free blocks are candidates too, down
    // to blocks too small to beat the best (a hole's neighbours met later
    // are no larger than the block met, or were seen with it). Most of them
    // lie between live blocks or beside holes too small to serve, so every
    // one is looked at, not a first few: O(kVisits) pointer checks.
    const int kVisits = exhaustive ? std::numeric_limits<int>::max() : 256;
    int visits = 0;
    for (Block* m = ss->free[PoolIndex(small)].Last();
         m != nullptr && visits < kVisits;
         m = FreeIndex<Block>::Prev(m), ++visits) {
      if (best.u != nullptr) {
        const std::size_t floor =
            2 * m->size < rounded
                ? SizeClasses::RoundUp(rounded - 2 * m->size, granule_)
                : granule_;
        if (best.bytes() <= floor) break;
      }
      consider_beside(m);
    }
    for (Block* m : {keep.prev, keep.next}) {
      if (MappedFree(m)) consider_beside(m);
    }
    return best;
  }
  // Whether `seg` holds a run of free blocks (mapped or not, no live,
  // pending or quarantined block between them) of at least `rounded` bytes;
  // if so, [*lo, *hi) is the first. O(blocks in the range): for the request
  // that would otherwise fail.
  static bool HasFreeRun(const Segment* seg, std::size_t rounded,
                         std::uint64_t* lo, std::uint64_t* hi) {
    std::size_t run = 0;
    for (const Block* b = seg->first; b != nullptr; b = b->next) {
      if (b->state != BlockState::kFree || b->quarantined) {
        run = 0;
        continue;
      }
      if (run == 0) *lo = b->address;
      run += b->size;
      if (run >= rounded) {
        *hi = b->end();
        return true;
      }
    }
    return false;
  }

  // The addresses a placement uses: its run and the mapped free neighbours
  // it extends (Reclaim leaves them mapped).
  static std::pair<std::uint64_t, std::uint64_t> Span(const Placement& at) {
    const Anchors a = AnchorsOf(at);
    return {a.prev != nullptr ? a.prev->address : at.lo,
            a.next != nullptr ? a.next->end() : at.hi};
  }

  // Where a placement's run ends when there is room to map ahead: a cold
  // stream then grows in steps of the pool's segment size (20 MiB for
  // large-pool requests under 10 MiB, as a classic segment) rounded down to
  // a power of two granules, the run ending on a multiple of the step; at
  // most one unit (so nothing near the limit), never past the unmapped
  // block nor the tenant's max. The
  // rest stays a mapped free block for the stream's next requests.
  std::uint64_t MapAhead(const Placement& at, std::size_t rounded) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // A request that gets a segment of its own in classic mode (>= 10 MiB)
    // maps only itself, even when it extends a mapped free block (so maps
    // less than a segment); and nothing goes past the next block.
    if (at.hi == at.u->end() || classes_.OwnsSegment(rounded) ||
        classes_.SegmentBytes(rounded) <= at.bytes()) {
      return at.hi;
    }
    const std::size_t unit = vmm_.UnitGranules(at.bytes() / granule_);
    const std::size_t segment =
        classes_.SegmentBytes(rounded) / granule_;  // whole granules
    const std::size_t step = std::min(
        unit, segment <= 1 ? std::size_t{1} : absl::bit_floor(segment));
    if (step <= 1) return at.hi;
    const VmmRange* r = RangeOf(at.u->segment);
    const std::size_t end_granule = (at.hi - r->base) / granule_;
    const std::size_t want = (end_granule + step - 1) / step * step;
    const std::uint64_t hi =
        std::min<std::uint64_t>(at.u->end(), r->base + want * granule_);
    if (hi <= at.hi) return at.hi;
    const StreamState* ss = ShardOf(at.u->segment);
    ss->mu.AssertHeld();
    const Budget& budget = tenants_[ss->tenant]->budget;
    if (budget.max != kNoLimit &&
        TenantMapped(ss->tenant) + (hi - at.lo) > budget.max) {
      return at.hi;
    }
    return hi;
  }

  // The slow path of Allocate in expandable mode: no mapped free block of
  // the stream fits, so map granules at the cheapest place (Place), cached
  // granules first. Mapped memory is never unmapped here except under
  // pressure: the tenant's max, or the device (or memory_limit_bytes) out of
  // memory, when free granules move through the cache (Reclaim).
  // REQUIRES: context set.
  absl::StatusOr<DevicePtr> AllocateExpandable(StreamState* ss,
                                               std::size_t rounded,
                                               std::size_t requested,
                                               bool small, OomReport* report,
                                               bool* oom, const Tag& tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    CTXPOOL_RETURN_IF_ERROR(EnsureRange(ss, small));
    // Where the request goes. Place looks at a bounded number of candidates,
    // each one hole with its two mapped free neighbours. When none serves,
    // before the ranges are called full: every candidate; then, when a run
    // of free blocks (holes and mapped free blocks between them) could hold
    // the request, the run's free granules go to the granule cache if the
    // stream's queued work is done, which joins it into one hole, and every
    // candidate again; then another range (kMaxRanges; a failure to reserve
    // is kept in range_error); only then a wait for the stream, and the join.
    absl::Status range_error;
    auto place = [&](Anchors anchors) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_,
                                                                    ss->mu) {
      Placement p = Place(ss, rounded, small, anchors);
      if (p.u != nullptr) return p;
      p = Place(ss, rounded, small, anchors, /*exhaustive=*/true);
      if (p.u != nullptr) return p;
      Segment** empty = nullptr;
      bool run = false;
      Within within{PoolIndex(small)};
      for (Segment*& r : ss->range[PoolIndex(small)]) {
        if (r == nullptr && empty == nullptr) empty = &r;
        run = run ||
              (r != nullptr && HasFreeRun(r, rounded, &within.lo, &within.hi));
      }
      // The run's free granules (only those) to the cache, so it becomes
      // one hole; with `wait`, after the stream's queued work.
      bool busy = false;
      auto join = [&](bool wait) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
        busy = false;
        std::size_t got = 0;
        UnmapFreeGranules(ss, kNoLimit, wait, nullptr, &busy, &got, 0, 0,
                          kNoLimit, within)
            .IgnoreError();
        if (got != 0) {
          p = Place(ss, rounded, small, {nullptr, nullptr},
                    /*exhaustive=*/true);
        }
        return p.u != nullptr;
      };
      if (run && join(/*wait=*/false)) return p;
      // Another range, while there is a slot for one, before any wait (none
      // for a request no place could serve).
      if (empty != nullptr && !DeviceCannotHold(rounded) &&
          !TenantCannotHold(ss, rounded)) {
        absl::StatusOr<Segment*> more = ReserveRange(ss, small, empty);
        if (more.ok()) {
          return Place(ss, rounded, small, {nullptr, nullptr},
                       /*exhaustive=*/true);
        }
        range_error = more.status();
      }
      if (run && busy) join(/*wait=*/true);
      return p;
    };
    Placement at = place({nullptr, nullptr});
    // No range has a place for the request and no other can be reserved
    // (FillReport adds the rest; AllocateMiss turns this into the report's
    // text). A reservation that failed other than for memory is returned.
    auto exhausted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
      if (!range_error.ok() && !IsOutOfMemory(range_error)) {
        return range_error;
      }
      // No place, but none could serve: the device's (or the tenant's) OOM,
      // with the growth a place of its own would need.
      const std::size_t whole = SizeClasses::RoundUp(rounded, granule_);
      if (TenantCannotHold(ss, rounded)) {
        return TenantOom(ss, rounded, requested, whole, report, oom);
      }
      ++num_alloc_retries_;
      *oom = true;
      if (DeviceCannotHold(rounded)) {
        report->growth_bytes = whole;
        return absl::ResourceExhaustedError("out of memory");
      }
      report->virtual_range_exhausted = true;
      report->virtual_range_bytes = 0;
      for (const Segment* r : ss->range[PoolIndex(small)]) {
        if (r != nullptr) report->virtual_range_bytes += r->size;
      }
      return absl::ResourceExhaustedError("virtual range exhausted");
    };
    if (at.u == nullptr) return exhausted();
    const Tenant& t = *tenants_[ss->tenant];
    if (t.budget.max != kNoLimit &&
        TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
      // Over max: the tenant's own free granules move here first.
      std::size_t over = TenantMapped(ss->tenant) + at.bytes() - t.budget.max;
      const auto [skip_lo, skip_hi] = Span(at);
      const Anchors anchors = AnchorsOf(at);
      for (StreamState* x : TenantStreams(ss->tenant)) {
        x->mu.AssertHeld();
        bool busy = false;
        std::size_t got = 0;
        UnmapFreeGranules(x, over, /*wait=*/false, nullptr, &busy, &got,
                          x == ss ? skip_lo : 0, x == ss ? skip_hi : 0)
            .IgnoreError();
        over -= std::min(over, got);
        if (over == 0) break;
      }
      at = place(anchors);
      if (at.u == nullptr) return exhausted();
      if (TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
        return TenantOom(ss, rounded, requested, at.bytes(), report, oom);
      }
    }
    absl::StatusOr<Block*> b =
        MapRun(at.u->segment, at.u, at.lo, MapAhead(at, rounded));
    if (!b.ok() && IsOutOfMemory(b.status())) {
      ++num_alloc_retries_;
      const std::size_t cached = CacheBytes();
      const auto [skip_lo, skip_hi] = Span(at);
      const Anchors anchors = AnchorsOf(at);
      Reclaim(ss, at.bytes() > cached ? at.bytes() - cached : 0, skip_lo,
              skip_hi);
      // Reclaim reshaped the blocks; the first placement stays a candidate.
      at = place(anchors);
      if (at.u == nullptr) return exhausted();
      if (t.budget.max != kNoLimit &&
          TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
        return TenantOom(ss, rounded, requested, at.bytes(), report, oom);
      }
      b = MapRun(at.u->segment, at.u, at.lo, at.hi);
    }
    if (!b.ok()) {
      if (IsOutOfMemory(b.status())) {
        *oom = true;
        report->growth_bytes = at.bytes();
      }
      return b.status();
    }
    NotePeak(ss->tenant);
    // The remnant of a fresh mapping is kept apart even when small: the next
    // growth extends it (Place) instead of mapping a granule beside it.
    return TakeBlock(ss, *b, rounded, requested, tag, /*split_any=*/true);
  }

  absl::StatusOr<DevicePtr> Traced(StreamState* ss, absl::StatusOr<DevicePtr> p,
                                   std::size_t requested)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ss->mu) {
    if (recorder_.enabled() && p.ok()) {
      recorder_.Record(TraceOp::kAlloc, p->address(), requested, ss->stream,
                       ss->tenant);
    }
    return p;
  }

  // Everything after a cache miss (AllocateMiss), then the check point of
  // decay and of classic mode's high: what they find to release goes after
  // the request is served, so it never releases memory the request could
  // have reused. Sets *oom (and fills *report) when memory ran out.
  absl::StatusOr<DevicePtr> AllocateSlow(StreamState* ss, std::size_t rounded,
                                         std::size_t requested, bool small,
                                         OomReport* report, bool* oom,
                                         const Tag& tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    absl::StatusOr<DevicePtr> p =
        AllocateMiss(ss, rounded, requested, small, report, oom, tag);
    TrimResult scratch;
    std::size_t busy = 0;
    // Housekeeping after the request is served: a std::bad_alloc in it must
    // not lose the block served (each step keeps the books whole on its own).
    try {
      if (!expandable_) ShedAllAboveHigh(&scratch, &busy).IgnoreError();
      DecayIdle(&scratch, &busy).IgnoreError();
    } catch (const std::bad_alloc&) {
      if (!p.ok()) throw;
    }
    return p;
  }

  // Poll events, reuse another stream's wholly free segment, get a new
  // segment, or go through the OOM path. REQUIRES: context set.
  absl::StatusOr<DevicePtr> AllocateMiss(StreamState* ss, std::size_t rounded,
                                         std::size_t requested, bool small,
                                         OomReport* report, bool* oom,
                                         const Tag& tag)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    if (!pending_.empty()) {
      PollPending();
      Block* b = FindFree(ss, rounded, small);
      if (b != nullptr) {
        ++ss->cache_hits;
        return TakeBlock(ss, b, rounded, requested, tag);
      }
    }
    if (expandable_) {
      absl::StatusOr<DevicePtr> p =
          AllocateExpandable(ss, rounded, requested, small, report, oom, tag);
      if (*oom && !report->tenant_limit) {
        FillReport(ss, rounded, requested, report);
      }
      if (!p.ok() && *oom)
        return absl::ResourceExhaustedError(report->ToString());
      return p;
    }
    const std::size_t segment_bytes = classes_.SegmentBytes(rounded);
    const Budget& budget = tenants_[ss->tenant]->budget;
    if (budget.max != kNoLimit &&
        TenantMapped(ss->tenant) + segment_bytes > budget.max) {
      for (StreamState* x : TenantStreams(ss->tenant)) {
        TrimResult scratch;
        std::size_t busy = 0;
        ReleaseCached(x, 0, &scratch, &busy).IgnoreError();
      }
      if (Block* fit = FindFree(ss, rounded, small)) {
        return TakeBlock(ss, fit, rounded, requested, tag);
      }
      if (TenantMapped(ss->tenant) + segment_bytes > budget.max) {
        return TenantOom(ss, rounded, requested, segment_bytes, report, oom);
      }
    }
    // Without pressure a stream reuses only its own tenant's cached
    // segments: another tenant's cache is its own until the device runs out
    // (cgroup-like: reclaim happens under pressure, never below min).
    const TenantId tenant = ss->tenant;
    if (Segment* seg =
            FindStealable(ss, rounded, small, TakeCap(rounded),
                          [&](Segment* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                            StreamState* from = ShardOf(s);
                            from->mu.AssertHeld();
                            return from->tenant == tenant;
                          })) {
      CTXPOOL_RETURN_IF_ERROR(MoveSegment(seg, ss));
      return TakeBlock(ss, seg->first, rounded, requested, tag);
    }
    absl::StatusOr<Block*> b = NewSegment(ss, segment_bytes, small);
    if (b.ok()) return TakeBlock(ss, *b, rounded, requested, tag);
    if (!IsOutOfMemory(b.status())) return b.status();

    // Out of memory: give back this stream's cached segments, wait for
    // pending frees, take another stream's free segment of about the size
    // needed (another tenant's above its min), else give back everyone's
    // idle ones above their min and retry; else take a larger free segment
    // that could not be given back (its stream busy: a stream wait, no host
    // synchronise; or a min kept it) rather than fail; else wait for the
    // busy ones, give them back and retry once more.
    ++num_alloc_retries_;
    TrimResult scratch;
    std::size_t busy = 0;
    ReleaseCached(ss, 0, &scratch, &busy).IgnoreError();
    SyncPending(&scratch.event_waits);
    if (Block* fit = FindFree(ss, rounded, small)) {
      return TakeBlock(ss, fit, rounded, requested, tag);
    }
    CTXPOOL_ASSIGN_OR_RETURN(
        Segment * taken, ReclaimSegment(ss, rounded, small, TakeCap(rounded)));
    if (taken != nullptr) {
      NotePeak(ss->tenant);
      return TakeBlock(ss, taken->first, rounded, requested, tag);
    }
    // Everyone's cached segments above their tenants' min go back to the
    // driver, counted as reclaimed; without `wait` those whose streams still
    // have work queued are skipped (their bytes in *skipped).
    auto sweep = [&](bool wait, std::size_t* skipped)
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                       const std::vector<std::size_t> before = MappedByTenant();
                       ReleaseCached(nullptr, 0, &scratch, skipped,
                                     /*protect_min=*/true, wait)
                           .IgnoreError();
                       const std::vector<std::size_t> after = MappedByTenant();
                       for (std::size_t t = 0; t < before.size(); ++t) {
                         if (t == tenant || after[t] >= before[t]) continue;
                         tenants_[t]->reclaimed_from += before[t] - after[t];
                         tenants_[tenant]->reclaimed_by += before[t] - after[t];
                       }
                     };
    std::size_t skipped = 0;
    sweep(/*wait=*/false, &skipped);
    b = NewSegment(ss, segment_bytes, small);
    if (b.ok()) return TakeBlock(ss, *b, rounded, requested, tag);
    if (!IsOutOfMemory(b.status())) return b.status();
    CTXPOOL_ASSIGN_OR_RETURN(taken,
                             ReclaimSegment(ss, rounded, small, kNoLimit));
    if (taken != nullptr) {
      NotePeak(ss->tenant);
      return TakeBlock(ss, taken->first, rounded, requested, tag);
    }
    if (skipped != 0) {
      sweep(/*wait=*/true, &busy);
      b = NewSegment(ss, segment_bytes, small);
      if (b.ok()) return TakeBlock(ss, *b, rounded, requested, tag);
      if (!IsOutOfMemory(b.status())) return b.status();
    }

    *oom = true;
    report->growth_bytes = segment_bytes;
    FillReport(ss, rounded, requested, report);
    return absl::ResourceExhaustedError(report->ToString());
  }

  // Expandable: the free bytes of mapped free blocks outside every mapping
  // wholly under the block (a granule, or a unit of them, that a live,
  // pending or quarantined neighbour shares): what no trim or reclaim can
  // unmap while those blocks stay. O(free blocks): for an OOM report.
  std::size_t StrandedFreeBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t n = 0;
    for (const auto& [stream, state] : streams_) {
      state->mu.AssertHeld();
      for (const FreeIndex<Block>& index : state->free) {
        for (const Block* b = index.Last(); b != nullptr;
             b = FreeIndex<Block>::Prev(b)) {
          const auto [lo, hi] = WholeGranules(b);
          std::size_t whole = 0;
          RangeOf(b->segment)
              ->ForEachPieceWithin(lo, hi,
                                   [&](std::size_t, const VmmRange::Piece& p) {
                                     whole += p.count * granule_;
                                     return true;
                                   });
          n += b->size - std::min(whole, b->size);
        }
      }
    }
    return n;
  }

  void FillReport(StreamState* ss, std::size_t rounded, std::size_t requested,
                  OomReport* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_, ss->mu) {
    FoldAll();
    report->requested_bytes = requested;
    report->rounded_bytes = rounded;
    report->tenant = tenants_[ss->tenant]->name;
    report->tenant_bytes = TenantMapped(ss->tenant);
    report->tenant_live_bytes = TenantLive(ss->tenant);
    report->stream = StreamHandle(ss->stream);
    report->live_bytes = Current(totals_.agg.allocated_bytes);
    report->reserved_bytes = Reserved();
    report->cached_bytes = expandable_ ? CacheBytes() : 0;
    report->memory_limit_bytes = options_.memory_limit_bytes;
    // The free indexes hold mapped blocks only (unmapped virtual space is
    // not free memory), so the fragmentation stays in [0, 1].
    std::size_t largest = 0;
    for (const auto& [stream, state] : streams_) {
      state->mu.AssertHeld();
      for (const FreeIndex<Block>& index : state->free) {
        if (const Block* last = index.Last()) {
          largest = std::max(largest, last->size);
        }
      }
    }
    const std::size_t free_bytes =
        Reserved() - Current(totals_.agg.active_bytes);
    largest = std::min(largest, free_bytes);
    report->largest_free_bytes = largest;
    report->stranded_free_bytes =
        expandable_ ? StrandedFreeBytes()
                    : Current(totals_.agg.inactive_split_bytes);
    report->fragmentation = free_bytes == 0
                                ? 0.0
                                : 1.0 - static_cast<double>(largest) /
                                            static_cast<double>(free_bytes);
    absl::StatusOr<MemInfo> info = driver_.MemGetInfo();
    if (info.ok()) {
      report->device_free_bytes = info->free_bytes;
      report->device_total_bytes = info->total_bytes;
    } else {
      report->device_total_bytes = device_total_;
    }
  }

  Driver& driver_;
  const int device_;
  const DeviceAllocatorOptions options_;
  const SizeClasses classes_;
  const ContextHandle ctx_;
  const bool owns_ctx_;
  const std::size_t device_total_;
  const bool expandable_;
  const std::size_t granule_;  // VMM granularity (expandable mode)
  const std::unique_ptr<SegmentBacking> backing_;
  TraceRecorder recorder_;
  const ForkGuard fork_guard_;  // after fork(): every call fails
  // What a Deallocate returns when host memory runs out, made up front.
  const absl::Status host_oom_ = absl::ResourceExhaustedError(
      "Deallocate: out of host memory; the block stays live");

  mutable SpinLock mu_;
  // The lock-free maps of the cached paths (address_map.h), written under
  // mu_: handle -> shard, and address -> segment (pages_ in classic mode,
  // ranges_ in expandable mode).
  StreamTable<StreamState> stream_table_;
  SegmentPageMap pages_;
  RangeTable ranges_;
  // Every segment by base; the objects live in segment_store_ and are
  // recycled through free_segments_, never deleted before the allocator.
  // std::map: an insert that throws std::bad_alloc leaves it intact (absl's
  // btree gives no such guarantee).
  std::map<std::uint64_t, DeviceSegment*> segments_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<DeviceSegment>> segment_store_
      ABSL_GUARDED_BY(mu_);
  std::vector<DeviceSegment*> free_segments_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, std::unique_ptr<StreamState>> streams_
      ABSL_GUARDED_BY(mu_);
  std::vector<PendingEvent> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<EventHandle> event_pool_ ABSL_GUARDED_BY(mu_);
  // Events ever created; the pool keeps room for all of them.
  std::size_t events_created_ ABSL_GUARDED_BY(mu_) = 0;
  // The device totals (see the file comment): `agg` is guarded by the lock
  // of the shard in `holder` (every shard's under AllShards).
  // `holder` and `holder_thread` are read on every cached call and written
  // only at take-overs: a line of their own, apart from what the holder
  // writes on every call.
  struct alignas(64) Totals {
    std::atomic<StreamState*> holder{nullptr};
    std::atomic<pthread_t> holder_thread{};
    alignas(64) PoolStats agg;
  };
  mutable Totals totals_;
  std::size_t reserved_now_ ABSL_GUARDED_BY(mu_) = 0;  // sum of reserved

  std::int64_t num_alloc_retries_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_ooms_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t upstream_allocs_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t upstream_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_stream_waits_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_host_syncs_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t mismatched_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_requests_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t destroyed_streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t driver_errors_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t leaked_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Expandable mode's ranges, mappings, physical allocations and cache.
  ExpandableBacking vmm_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Tenant>> tenants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::uint64_t> bound_ ABSL_GUARDED_BY(mu_);
  // By id - 1; a null slot was unregistered (ids are never reused).
  std::vector<std::unique_ptr<OwnerRec>> owners_ ABSL_GUARDED_BY(mu_);
};

namespace {

absl::Status CompareStats(const PoolStats& want, const PoolStats& got,
                          absl::string_view who) {
  static constexpr const char* kNames[] = {
      "allocation",     "segment",         "active",
      "inactive_split", "allocated_bytes", "requested_bytes",
      "reserved_bytes", "active_bytes",    "inactive_split_bytes"};
  std::vector<const StatArray*> w;
  std::vector<const StatArray*> g;
  want.ForEach([&](const StatArray& a) { w.push_back(&a); });
  got.ForEach([&](const StatArray& a) { g.push_back(&a); });
  for (std::size_t i = 0; i < w.size(); ++i) {
    for (int p = 0; p < 3; ++p) {
      const Stat& ws = (*w[i])[p];
      const Stat& gs = (*g[i])[p];
      if (ws.current != gs.current) {
        return absl::InternalError(core_internal::Format(
            "I6: %s stat %s[%d].current is %d but the blocks sum to %d", who,
            kNames[i], p, gs.current, ws.current));
      }
      if (gs.current < 0 || gs.peak < gs.current ||
          gs.current != gs.allocated - gs.freed) {
        return absl::InternalError(core_internal::Format(
            "%s stat %s[%d]: current %d, peak %d, allocated %d, freed %d", who,
            kNames[i], p, gs.current, gs.peak, gs.allocated, gs.freed));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CachingDeviceAllocator::Impl::CheckInvariants() const {
  CTXPOOL_RETURN_IF_ERROR(
      fork_guard_.Check("CachingDeviceAllocator::CheckInvariants"));
  AllShards lock(this);
  FoldAll();
  PoolStats total;
  absl::flat_hash_map<std::uint64_t, PoolStats> per_stream;
  std::size_t free_blocks = 0;
  std::size_t whole_free_segments = 0;
  std::size_t blocks = 0;
  std::size_t allocated_blocks = 0;
  absl::flat_hash_map<const StreamState*, std::size_t> blocks_of;
  std::size_t pending_events = 0;
  std::size_t free_bytes = 0;
  std::size_t pending_bytes = 0;
  auto add = [&](std::uint64_t stream, StatArray PoolStats::*field, bool small,
                 std::int64_t n) {
    AddStat(total.*field, small, n);
    AddStat(per_stream[stream].*field, small, n);
  };
  // I9: every range slot names a live range of its stream and pool, once.
  for (const auto& [stream, state] : streams_) {
    const StreamState* ss = state.get();
    ss->mu.AssertHeld();
    for (int pool = 0; pool < 2; ++pool) {
      const Segment* const* slots = ss->range[pool];
      for (int i = 0; i < kMaxRanges; ++i) {
        const Segment* r = slots[i];
        if (r == nullptr) continue;
        const auto it = segments_.find(r->base);
        if (!expandable_ || it == segments_.end() || it->second != r ||
            ShardOf(r) != ss || PoolIndex(r->small) != pool ||
            std::find(slots, slots + i, r) != slots + i) {
          return absl::InternalError(core_internal::Format(
              "I9: stream 0x%x's range slot %d of pool %d names no range of "
              "its own",
              stream, i, pool));
        }
      }
    }
  }
  for (const auto& [base, seg_ptr] : segments_) {
    const Segment& seg = *seg_ptr;
    if (seg.base != base) {
      return absl::InternalError(core_internal::Format(
          "segment keyed 0x%x has base 0x%x", base, seg.base));
    }
    CTXPOOL_RETURN_IF_ERROR(CheckSegmentTiling(seg));  // I1
    const StreamState* ss = ShardOf(&seg);
    auto sit = streams_.find(seg.stream);
    if (ss == nullptr || sit == streams_.end() || sit->second.get() != ss ||
        seg.owner != ss) {
      return absl::InternalError(core_internal::Format(
          "segment 0x%x: owner is not the state of stream 0x%x", seg.base,
          seg.stream));
    }
    ss->mu.AssertHeld();
    // I15: the lock-free maps find the segment at its first and last byte.
    const Segment* at_base =
        expandable_ ? ranges_.Find(seg.base) : pages_.Find(seg.base);
    const Segment* at_end =
        expandable_ ? ranges_.Find(seg.end() - 1) : pages_.Find(seg.end() - 1);
    if (at_base != &seg || at_end != &seg) {
      return absl::InternalError(core_internal::Format(
          "I15: the address map does not find segment 0x%x (+%d)", seg.base,
          seg.size));
    }
    const std::uint64_t s = seg.stream;
    add(s, &PoolStats::segment, seg.small, 1);
    const VmmRange* range = expandable_ ? RangeOf(&seg) : nullptr;
    if (range != nullptr) {  // I9
      std::size_t mapped = 0;
      std::size_t next = 0;  // the pieces are disjoint and inside the range
      bool bad = false;
      for (const auto& [start, piece] : range->pieces) {
        bad = bad || piece.handle.is_null() || piece.count == 0 ||
              start < next || start + piece.count > range->size / granule_;
        next = start + piece.count;
        mapped += piece.count * granule_;
      }
      if (bad) {
        return absl::InternalError(core_internal::Format(
            "I9: range 0x%x has a bad or overlapping mapping", seg.base));
      }
      const auto& slots = ss->range[PoolIndex(seg.small)];
      if (mapped != range->mapped || range->base != seg.base ||
          range->size != seg.size ||
          std::find(std::begin(slots), std::end(slots), &seg) ==
              std::end(slots)) {
        return absl::InternalError(
            core_internal::Format("I9: range 0x%x maps %d bytes, books say %d",
                                  seg.base, mapped, range->mapped));
      }
    }
    add(s, &PoolStats::reserved_bytes, seg.small,
        static_cast<std::int64_t>(range != nullptr ? range->mapped : seg.size));
    const bool whole = seg.wholly_free() && !expandable_;                // I10
    if (whole != ss->whole_free[PoolIndex(seg.small)].Contains(&seg)) {  // I3
      return absl::InternalError(core_internal::Format(
          "I3: segment 0x%x wholly free = %d but whole-free index says %d",
          seg.base, whole, !whole));
    }
    if (whole) {
      ++whole_free_segments;
      if (seg.key_size() != seg.size || seg.key_address() != seg.base) {
        return absl::InternalError("I3: whole-free segment key mismatch");
      }
    }
    const FreeIndex<Block>& index = ss->free[PoolIndex(seg.small)];
    for (const Block* b = seg.first; b != nullptr; b = b->next) {
      ++blocks;
      ++blocks_of[ss];
      const auto size = static_cast<std::int64_t>(b->size);
      if (range != nullptr && !b->unmapped &&
          UnmappedBytes(&seg, b->address, b->size) != 0) {  // I9
        return absl::InternalError(core_internal::Format(
            "I9: block 0x%x (%d bytes, state %d) is not unmapped yet lies on "
            "unmapped granules",
            b->address, b->size, static_cast<int>(b->state)));
      }
      if (b->unmapped &&
          (range == nullptr || b->state != BlockState::kFree ||
           (b->address - seg.base) % granule_ != 0 || b->size % granule_ != 0 ||
           MappedBytes(&seg, b->address, b->size) != 0)) {  // I11
        return absl::InternalError(core_internal::Format(
            "I11: unmapped block 0x%x (%d bytes) is not free, not granule "
            "aligned or has mapped granules",
            b->address, b->size));
      }
      switch (b->state) {
        case BlockState::kAllocated: {
          ++allocated_blocks;
          auto it = ss->live.find(b->address);
          if (it == ss->live.end() || it->second != b || b->linked() ||
              b->requested > b->size || b->pending_events != 0) {  // I4
            return absl::InternalError(core_internal::Format(
                "I4: allocated block 0x%x not live, indexed or oversized",
                b->address));
          }
          add(s, &PoolStats::allocation, seg.small, 1);
          add(s, &PoolStats::allocated_bytes, seg.small, size);
          add(s, &PoolStats::requested_bytes, seg.small,
              static_cast<std::int64_t>(b->requested));
          add(s, &PoolStats::active, seg.small, 1);
          add(s, &PoolStats::active_bytes, seg.small, size);
          break;
        }
        case BlockState::kPendingFree:
          if (b->pending_events <= 0 || b->linked() ||
              ss->live.contains(b->address)) {  // I5
            return absl::InternalError(core_internal::Format(
                "I5: pending block 0x%x has %d events, linked %d", b->address,
                b->pending_events, b->linked()));
          }
          pending_events += static_cast<std::size_t>(b->pending_events);
          pending_bytes += b->size;
          add(s, &PoolStats::active, seg.small, 1);
          add(s, &PoolStats::active_bytes, seg.small, size);
          break;
        case BlockState::kFree:
          if (b->quarantined) {
            if (b->linked() || b->unmapped || range == nullptr) {  // I11
              return absl::InternalError(core_internal::Format(
                  "I11: quarantined block 0x%x is indexed or unmapped",
                  b->address));
            }
            break;
          }
          ++free_blocks;
          if (range == nullptr) free_bytes += b->size;
          if (!(b->unmapped ? ss->unmapped[PoolIndex(seg.small)] : index)
                   .Contains(b) ||
              b->key_size() != b->size ||
              b->key_address() != b->address) {  // I2
            return absl::InternalError(core_internal::Format(
                "I2: free block 0x%x (%d bytes) is not in its stream's index "
                "under its key",
                b->address, b->size));
          }
          if (ss->live.contains(b->address)) {
            return absl::InternalError(core_internal::Format(
                "I4: free block 0x%x is live", b->address));
          }
          if (range == nullptr && b->is_split()) {
            add(s, &PoolStats::inactive_split, seg.small, 1);
            add(s, &PoolStats::inactive_split_bytes, seg.small, size);
          }
          break;
      }
    }
  }
  std::size_t indexed = 0;
  std::size_t whole_indexed = 0;
  std::size_t live_entries = 0;
  for (const auto& [stream, ss] : streams_) {
    ss->mu.AssertHeld();
    if (stream_table_.Find(stream) != ss.get()) {  // I15
      return absl::InternalError(core_internal::Format(
          "I15: the stream table does not find stream 0x%x", stream));
    }
    live_entries += ss->live.size();
    if (static_cast<std::size_t>(ss->blocks.live()) != blocks_of[ss.get()]) {
      return absl::InternalError(  // I8
          core_internal::Format(
              "I8: stream 0x%x's arena has %d blocks out, its "
              "segments %d",
              stream, ss->blocks.live(), blocks_of[ss.get()]));
    }
    for (const FreeIndex<Segment>& index : ss->whole_free) {
      whole_indexed += index.size();
      std::string error = index.Validate();
      if (!error.empty()) {
        return absl::InternalError(
            core_internal::Format("I3: whole-free index: %s", error));
      }
    }
    for (const FreeIndex<Block>* index :
         {&ss->free[0], &ss->free[1], &ss->unmapped[0], &ss->unmapped[1]}) {
      indexed += index->size();
      std::string error = index->Validate();
      if (!error.empty()) {
        return absl::InternalError(core_internal::Format(
            "I2: free index of stream 0x%x: %s", stream, error));
      }
    }
    auto it = per_stream.find(stream);
    CTXPOOL_RETURN_IF_ERROR(
        CompareStats(it == per_stream.end() ? PoolStats() : it->second,
                     ss->stats, core_internal::Format("stream 0x%x", stream)));
  }
  if (indexed != free_blocks) {  // I2: nothing else is indexed
    return absl::InternalError(core_internal::Format(
        "I2: %d blocks indexed but %d free blocks", indexed, free_blocks));
  }
  if (whole_indexed != whole_free_segments) {
    return absl::InternalError(
        core_internal::Format("I3: %d segments indexed as wholly free, %d are",
                              whole_indexed, whole_free_segments));
  }
  if (live_entries != allocated_blocks) {  // I4
    return absl::InternalError(
        core_internal::Format("I4: %d live entries but %d allocated blocks",
                              live_entries, allocated_blocks));
  }
  if (pending_.size() != pending_events) {  // I5
    return absl::InternalError(
        core_internal::Format("I5: %d pending events queued, blocks expect %d",
                              pending_.size(), pending_events));
  }
  if (expandable_) {  // I12
    CTXPOOL_RETURN_IF_ERROR(vmm_.CheckInvariants(Reserved()));
  }
  for (const PendingEvent& p : pending_) {
    if (p.block->state != BlockState::kPendingFree) {
      return absl::InternalError(core_internal::Format(
          "I5: pending event for block 0x%x that is not pending",
          p.block->address));
    }
  }
  CTXPOOL_RETURN_IF_ERROR(CompareStats(total, totals_.agg, "total"));  // I6
  const std::size_t reserved = Current(totals_.agg.reserved_bytes);
  const std::size_t allocated = Current(totals_.agg.allocated_bytes);
  if (reserved != reserved_now_) {
    return absl::InternalError(
        core_internal::Format("I6: reserved %d but the running count is %d",
                              reserved, reserved_now_));
  }
  if (!expandable_ &&
      reserved != allocated + pending_bytes + free_bytes) {  // I7
    return absl::InternalError(core_internal::Format(
        "I7: reserved %d != allocated %d + pending %d + free %d", reserved,
        allocated, pending_bytes, free_bytes));
  }
  (void)blocks;
  // I13: each owner's live charge and count are the sums over its blocks
  // (each on its stream's sub-account), reserved is live + credit over its
  // sub-accounts and within max, and only allocated blocks carry an owner
  // of a registered slot.
  {
    absl::flat_hash_map<const SubAccount*, std::pair<std::size_t, std::int64_t>>
        sums;
    for (const auto& [stream, ss] : streams_) {
      ss->mu.AssertHeld();
      for (const auto& [address, b] : ss->live) {
        if (b->owner == kNoOwner) continue;
        if (b->owner > owners_.size() || owners_[b->owner - 1] == nullptr) {
          return absl::InternalError(core_internal::Format(
              "I13: block 0x%x has unregistered owner %d", address, b->owner));
        }
        const SubAccount* sub = ss->FindSub(b->owner);
        if (b->owner_data != sub || sub == nullptr) {
          return absl::InternalError(core_internal::Format(
              "I13: block 0x%x: not on owner %d's sub-account of its stream",
              address, b->owner));
        }
        sums[sub].first += Charge(b->requested);
        ++sums[sub].second;
      }
    }
    for (std::size_t i = 0; i < owners_.size(); ++i) {
      const OwnerRec* o = owners_[i].get();
      if (o == nullptr) continue;
      const auto id = static_cast<OwnerId>(i + 1);
      std::size_t live = 0;
      std::size_t credit = 0;
      for (StreamState* ss : o->shards) {
        ss->mu.AssertHeld();
        const SubAccount* sub = ss->FindSub(id);
        if (sub == nullptr || sub->rec != o) {
          return absl::InternalError(core_internal::Format(
              "I13: owner '%s' lists stream 0x%x without a sub-account",
              o->name, ss->stream));
        }
        const auto [want_live, want_count] = sums[sub];
        if (sub->live != want_live ||
            sub->allocs - sub->frees - sub->reclaimed != want_count) {
          return absl::InternalError(core_internal::Format(
              "I13: owner '%s' books %d B in %d blocks on stream 0x%x, its "
              "blocks hold %d B in %d",
              o->name, sub->live, sub->allocs - sub->frees - sub->reclaimed,
              ss->stream, want_live, want_count));
        }
        live += sub->live;
        credit += sub->credit;
      }
      const std::size_t reserved_now =
          o->reserved.load(std::memory_order_relaxed);
      if ((o->max != 0 &&
           (reserved_now != live + credit || reserved_now > o->max)) ||
          o->sum.live != static_cast<std::int64_t>(live) ||
          o->sum.peak < o->sum.live) {
        return absl::InternalError(core_internal::Format(
            "I13: owner '%s': live %d + credit %d, reserved %d, max %d; sum "
            "%d, peak %d",
            o->name, live, credit, reserved_now, o->max, o->sum.live,
            o->sum.peak));
      }
    }
  }
  // I14: the tenants' stream lists partition the streams by ss->tenant.
  {
    absl::flat_hash_set<const StreamState*> listed;
    core_internal::MakeRoom(listed, streams_.size());  // see DropWholeFree
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      std::size_t mapped = 0;
      for (const StreamState* ss : tenants_[t]->streams) {
        ss->mu.AssertHeld();
        mapped += Current(ss->stats.reserved_bytes);
        if (!listed.insert(ss).second || ss->tenant != t ||
            !streams_.contains(ss->stream) ||
            streams_.at(ss->stream).get() != ss) {
          return absl::InternalError(core_internal::Format(
              "I14: stream 0x%x is listed under tenant %d, bound to %d",
              ss->stream, t, ss->tenant));
        }
      }
      if (mapped != tenants_[t]->mapped.load(std::memory_order_relaxed)) {
        return absl::InternalError(core_internal::Format(
            "I14: tenant %d's streams hold %d bytes, its count says %d", t,
            mapped, tenants_[t]->mapped.load(std::memory_order_relaxed)));
      }
    }
    if (listed.size() != streams_.size()) {
      return absl::InternalError(core_internal::Format(
          "I14: %d streams listed under tenants, %d known", listed.size(),
          streams_.size()));
    }
  }
  return absl::OkStatus();
}

// ---- CachingDeviceAllocator ------------------------------------------------

absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>>
CachingDeviceAllocator::Create(Driver& driver, int device,
                               DeviceAllocatorOptions options) {
  CTXPOOL_RETURN_IF_ERROR(ValidateDeviceAllocatorOptions(options));
  CTXPOOL_ASSIGN_OR_RETURN(std::size_t total, driver.DeviceTotalMem(device));
  // Every size computation (rounding, charges, a range twice the device)
  // assumes requests, which are at most the device's total, are far from
  // 2^64; no device comes near 2^62 bytes, so a driver that says so is
  // broken and nothing is created on it.
  if (total > kMaxDeviceBytes) {
    return absl::FailedPreconditionError(core_internal::Format(
        "device %d reports %d bytes of memory; ctxpool supports devices of "
        "up to 2^62 bytes (the driver's figure cannot be right)",
        device, total));
  }
  if (options.backing == BackingMode::kAuto) {
    absl::StatusOr<int> vmm = driver.DeviceGetAttribute(
        DeviceAttribute::kVirtualMemoryManagementSupported, device);
    options.backing = vmm.ok() && *vmm != 0 ? BackingMode::kExpandable
                                            : BackingMode::kClassic;
  }
  std::size_t granule = 0;
  if (options.backing == BackingMode::kExpandable) {
    absl::StatusOr<int> vmm = driver.DeviceGetAttribute(
        DeviceAttribute::kVirtualMemoryManagementSupported, device);
    if (!vmm.ok() || *vmm == 0) {
      return absl::FailedPreconditionError(core_internal::Format(
          "BackingMode::kExpandable: device %d does not support virtual "
          "memory management; use BackingMode::kClassic",
          device));
    }
    CTXPOOL_ASSIGN_OR_RETURN(granule,
                             driver.MemGetAllocationGranularity(device));
    if (granule == 0 || !IsPowerOfTwo(granule)) {
      return absl::FailedPreconditionError(
          core_internal::Format("bad VMM granularity %d", granule));
    }
  }
  ContextHandle ctx = options.context;
  bool owns_ctx = false;
  if (ctx.is_null()) {
    CTXPOOL_ASSIGN_OR_RETURN(ctx, driver.PrimaryCtxRetain(device));
    owns_ctx = true;
  }
  auto impl = std::make_unique<Impl>(driver, device, std::move(options), ctx,
                                     owns_ctx, total, granule);
  return std::unique_ptr<CachingDeviceAllocator>(
      new CachingDeviceAllocator(std::move(impl)));
}

CachingDeviceAllocator::CachingDeviceAllocator(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

CachingDeviceAllocator::~CachingDeviceAllocator() = default;

absl::StatusOr<DevicePtr> CachingDeviceAllocator::Allocate(
    std::size_t bytes, StreamHandle stream) {
  return impl_->Allocate(bytes, stream, kNoOwner, nullptr);
}
absl::StatusOr<DevicePtr> CachingDeviceAllocator::Allocate(std::size_t bytes,
                                                           StreamHandle stream,
                                                           OwnerId owner,
                                                           const char* label) {
  return impl_->Allocate(bytes, stream, owner, label);
}
absl::Status CachingDeviceAllocator::Deallocate(DevicePtr ptr) noexcept {
  return impl_->Deallocate<false>(ptr, FreeCheck{});
}
absl::Status CachingDeviceAllocator::Deallocate(
    DevicePtr ptr, const FreeCheck& check) noexcept {
  return impl_->Deallocate<true>(ptr, check);
}
absl::Status CachingDeviceAllocator::RecordStream(DevicePtr ptr,
                                                  StreamHandle stream) {
  return impl_->RecordStream(ptr, stream, kAnyOwner);
}
absl::Status CachingDeviceAllocator::RecordStream(DevicePtr ptr,
                                                  StreamHandle stream,
                                                  OwnerId owner) {
  return impl_->RecordStream(ptr, stream, owner);
}
absl::StatusOr<OwnerId> CachingDeviceAllocator::RegisterOwner(
    absl::string_view name, std::size_t max_live_bytes) {
  return impl_->RegisterOwner(name,
                              OwnerOptions{.max_live_bytes = max_live_bytes});
}
absl::StatusOr<OwnerId> CachingDeviceAllocator::RegisterOwner(
    absl::string_view name, const OwnerOptions& options) {
  return impl_->RegisterOwner(name, options);
}
absl::StatusOr<OwnerStats> CachingDeviceAllocator::GetOwnerStats(
    OwnerId owner) const {
  return impl_->GetOwnerStats(owner);
}
absl::StatusOr<std::vector<OwnedBlock>> CachingDeviceAllocator::OwnedBlocks(
    OwnerId owner) const {
  return impl_->OwnedBlocks(owner);
}
absl::Status CachingDeviceAllocator::CloseOwner(
    OwnerId owner, std::vector<OwnedBlock>* freed) {
  return impl_->CloseOwner(owner, freed);
}
absl::StatusOr<OwnerStats> CachingDeviceAllocator::UnregisterOwner(
    OwnerId owner) {
  return impl_->UnregisterOwner(owner);
}
absl::StatusOr<TrimResult> CachingDeviceAllocator::Trim(
    std::size_t keep_bytes) {
  return impl_->Trim(keep_bytes);
}
absl::StatusOr<TrimResult> CachingDeviceAllocator::TrimIdle() {
  return impl_->TrimIdle();
}
absl::StatusOr<TenantId> CachingDeviceAllocator::RegisterTenant(
    absl::string_view name, Budget budget) {
  return impl_->RegisterTenant(name, budget);
}
absl::Status CachingDeviceAllocator::BindStream(StreamHandle stream,
                                                TenantId tenant) {
  return impl_->BindStream(stream, tenant);
}
absl::Status CachingDeviceAllocator::UnbindStream(StreamHandle stream) {
  return impl_->UnbindStream(stream);
}
absl::Status CachingDeviceAllocator::UnregisterTenant(TenantId tenant) {
  return impl_->UnregisterTenant(tenant);
}
absl::StatusOr<TrimResult> CachingDeviceAllocator::SetBudget(TenantId tenant,
                                                             Budget budget) {
  return impl_->SetBudget(tenant, budget);
}
absl::StatusOr<TenantStats> CachingDeviceAllocator::GetTenantStats(
    TenantId tenant) const {
  return impl_->GetTenantStats(tenant);
}
TraceRecorder& CachingDeviceAllocator::trace_recorder() {
  return impl_->recorder();
}
absl::Status CachingDeviceAllocator::RetireStream(StreamHandle stream) {
  return impl_->RetireStream(stream);
}

absl::Status CachingDeviceAllocator::Reset(bool force) {
  return impl_->Reset(force);
}
DeviceAllocatorStats CachingDeviceAllocator::Stats() const {
  return impl_->Stats();
}
std::size_t CachingDeviceAllocator::PhysicalBytes() const {
  return impl_->PhysicalBytes();
}
FragmentationStats CachingDeviceAllocator::Fragmentation() const {
  return impl_->Fragmentation();
}
AllocatorSnapshot CachingDeviceAllocator::Snapshot() const {
  return impl_->Snapshot();
}
absl::StatusOr<BlockInfo> CachingDeviceAllocator::Lookup(DevicePtr ptr) const {
  return impl_->Lookup(ptr);
}
void CachingDeviceAllocator::ResetPeakStats() { impl_->ResetPeakStats(); }
absl::Status CachingDeviceAllocator::CheckInvariants() const {
  return impl_->CheckInvariants();
}
int CachingDeviceAllocator::device() const { return impl_->device(); }
std::size_t CachingDeviceAllocator::device_total_bytes() const {
  return impl_->device_total_bytes();
}
Driver& CachingDeviceAllocator::driver() const { return impl_->driver(); }
ContextHandle CachingDeviceAllocator::context() const {
  return impl_->context();
}
const DeviceAllocatorOptions& CachingDeviceAllocator::options() const {
  return impl_->options();
}

}  // namespace ctxpool
