// CachingDeviceAllocator: the implementation.
//
// Data structures (all guarded by Impl::mu_):
//
//   segments_     every Segment, by base address (owns them).
//   streams_      one StreamState per stream seen: its free index per pool
//                 (small, large) keyed by (size, address), and its stats;
//                 expandable mode adds an index of unmapped free blocks.
//   whole_free_   per pool, the wholly free segments of all streams, by
//                 (size, base): for cross-stream reuse and for Trim.
//   live_         allocated block by address (the pointer -> block lookup).
//   pending_      (block, event) pairs of blocks freed while other streams
//                 still use them (RecordStream); polled with cuEventQuery.
//   event_pool_   idle events, reused so no free creates an event.
//   blocks_       the recycling arena of Block objects.
//
// Invariants (CheckInvariants checks each one):
//   I1  the blocks of each segment tile it exactly and are coalesced
//       (no two neighbours free): see CheckSegmentTiling.
//   I2  every free block is in exactly one index, its owner stream's index
//       for its pool, under key (size, address); no other block is indexed.
//   I3  a segment is in whole_free_[pool] <=> its only block is free.
//   I4  live_ holds exactly the allocated blocks, keyed by their address.
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
//   I8  blocks_.live() == number of blocks in all segments.
//   Expandable mode (one segment per (stream, pool) over a virtual range):
//   I7 is replaced by
//   I9  a segment's reserved bytes == its mapped granules × granule, and
//       every block but the unmapped ones lies on mapped granules;
//   I10 no expandable segment is in whole_free_, and inactive_split counts
//       nothing (the unmapped tail is not cached memory);
//   I12 every physical allocation (the backing's) is mapped granules + cached
//       pieces + leaked granules (dropped while mapped by a forced Reset):
//       sum(granules) == mapped + cached + leaked, sum(mapped) × granule ==
//       reserved, and each cached piece lies inside its allocation;
//   I11 an unmapped block is free, granule aligned, has no mapped granule,
//       and sits in its stream's `unmapped` index (the mapped free blocks in
//       `free`); I1's coalescing is per kind: a mapped and an unmapped free
//       block may be neighbours. A quarantined block (mapped, no access:
//       a failed cuMemSetAccess whose rollback failed) is free, mapped and
//       in no index, and never coalesces.
//   I13 an owner's live charge and live count equal the sums over the
//       allocated blocks tagged with it, never above its max; only
//       registered owners tag blocks.
//   I14 every stream is in exactly one tenant's stream list, its own.
//
// Hot path: Allocate looks up the stream's free index (one LowerBound), and
// TakeBlock unlinks the block (and links a split remainder), inserts into
// live_ (capacity reserved), and updates stats: no driver call, no heap
// allocation once the block arena and live_ are warm. Deallocate is the
// mirror image. For decay it only bumps the stream's operation counter (and
// clears a classic segment's idle stamp); the clock is read by the check
// points (DecayIdle), never here. Everything else (event polling, cross-stream
// reuse, new segments, the OOM path) is the slow path, which makes the
// allocator's context current with ScopedContext.
#include "ctxpool/alloc/device_allocator.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/container/inlined_vector.h"
#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "classic_backing.h"
#include "ctxpool/core/block.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/core/fragmentation.h"
#include "ctxpool/core/free_index.h"
#include "ctxpool/core/internal/coarse_clock.h"
#include "ctxpool/core/internal/spin_lock.h"
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
using alloc_internal::SegmentBacking;
using alloc_internal::StuckPiece;
using alloc_internal::VmmRange;

constexpr std::size_t kInitialLiveCapacity = 4096;

int PoolIndex(bool small) { return small ? 0 : 1; }

// The cached state of one stream: a free index per pool and its stats.
struct StreamState {
  explicit StreamState(std::uint64_t s) : stream(s) {}
  std::uint64_t stream;
  FreeIndex<Block> free[2];  // [0] small pool, [1] large pool
  // Expandable mode: `free` holds only free blocks on mapped granules (the
  // hot path takes them as they are); the free blocks over unmapped
  // granules of the stream's ranges sit here, by (size, address).
  FreeIndex<Block> unmapped[2];
  PoolStats stats;
  // Found destroyed (CUDA_ERROR_INVALID_HANDLE) and its work waited for:
  // nothing can be enqueued on it any more, so its memory is idle.
  bool destroyed = false;
  // RetireStream: the handle is dead to the allocator; `retire_event`,
  // recorded on it before it was destroyed, orders all its work.
  bool retired = false;
  EventHandle retire_event;
  TenantId tenant = kDefaultTenant;
  // Expandable mode: the stream's range segment per pool (null until used).
  Segment* range[2] = {nullptr, nullptr};
  // Decay (expandable mode). `ops` counts the blocks taken and freed on the
  // stream: a plain increment on the hot path, which never reads the clock.
  // Each decay check compares it with `ops_seen`; when it moved (or at the
  // first check) `active_at` becomes the check's time, so idleness is
  // measured between checks. `decayed_ops` is `ops` when the stream's free
  // granules were last unmapped by decay: nothing to do until it moves.
  std::uint64_t ops = 0;
  std::uint64_t ops_seen = 0;
  absl::Time active_at = absl::InfinitePast();
  std::uint64_t decayed_ops = std::numeric_limits<std::uint64_t>::max();
};

// Orders streams by handle, so that loops over them (Trim, decay, a tenant's
// streams) act in the same order in every run.
void SortByStream(std::vector<StreamState*>* v) {
  std::sort(v->begin(), v->end(),
            [](const StreamState* a, const StreamState* b) {
              return a->stream < b->stream;
            });
}

// The allocator's segment: a core Segment plus the decay stamp of classic
// mode. `free_since` is InfinitePast while the segment is in use or not yet
// seen wholly free by a decay check; the first check that finds it wholly
// free stamps it (lazily, so the hot path never reads the clock) and
// indexing it wholly free again resets the stamp.
struct DeviceSegment : Segment {
  absl::Time free_since = absl::InfinitePast();
};

struct Tenant {
  std::string name;
  Budget budget;
  // The streams bound to it (every stream is some tenant's: unbound ones
  // the default's), so that the per-tenant sums the reclaim and budget
  // paths take cost O(the tenant's streams), not O(every stream).
  std::vector<StreamState*> streams;
  std::size_t peak = 0;
  std::size_t reclaimed_from = 0;
  std::size_t reclaimed_by = 0;
  std::int64_t ooms = 0;
  bool bound_any = false;
  // False once unregistered: the slot (and its id) may be reused by a later
  // RegisterTenant.
  bool registered = true;
};

// An owner of allocations (RegisterOwner): its live charge and counters,
// updated under the allocator's lock by TakeBlock and RemoveAllocatedStats.
struct alignas(64) OwnerRec {  // written on every owned call: a line of its own
  std::string name;
  std::size_t max = 0;  // 0: none
  std::size_t live = 0;
  std::size_t peak = 0;
  std::size_t requested = 0;
  std::int64_t allocs = 0;
  std::int64_t frees = 0;
  std::int64_t reclaimed = 0;  // freed by CloseOwner or a forced Reset
  std::int64_t ooms = 0;
  std::int64_t rejections = 0;
  std::int64_t invalid_frees = 0;
  bool closed = false;
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
    return absl::InvalidArgumentError(absl::StrFormat(
        "inconsistent segment sizes: round %d, small limit %d, small segment "
        "%d, large segment %d, large round %d",
        o.round_bytes, o.small_size_limit, o.small_segment_bytes,
        o.large_segment_bytes, o.large_round_bytes));
  }
  return absl::OkStatus();
}

std::string OomReport::ToString() const {
  if (tenant_limit) {
    return absl::StrFormat(
        "out of memory for tenant '%s': requested %d bytes on stream 0x%x "
        "needs %d more bytes of physical memory; the tenant holds %d bytes "
        "(%d live) and its max is %d bytes",
        tenant, requested_bytes, stream.value(), growth_bytes, tenant_bytes,
        tenant_live_bytes, tenant_max_bytes);
  }
  std::string out = absl::StrFormat(
      "out of memory: requested %d bytes (%d rounded) on stream 0x%x; live "
      "%d bytes, reserved %d bytes, largest free block %d bytes, "
      "fragmentation %.3f; device free %d of %d bytes",
      requested_bytes, rounded_bytes, stream.value(), live_bytes,
      reserved_bytes, largest_free_bytes, fragmentation, device_free_bytes,
      device_total_bytes);
  if (memory_limit_bytes != 0) {
    absl::StrAppendFormat(&out, "; the allocator's memory_limit_bytes is %d",
                          memory_limit_bytes);
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
        vmm_(driver, device, granule,
             ExpandableOptions{options_.vmm_unit_divisor,
                               options_.memory_limit_bytes, device_total},
             options_.clock) {
    live_.reserve(kInitialLiveCapacity);
    auto t = std::make_unique<Tenant>();
    t->name = "default";
    tenants_.push_back(std::move(t));
  }

  ~Impl() {
    // In a forked child the segments, granules, events and context belong to
    // the parent's driver state: touch none of it, leak it.
    if (fork_guard_.InForkedChild()) return;
    Reset(/*force=*/true).IgnoreError();
    core_internal::SpinLockHolder lock(&mu_);
    {
      ScopedContext ctx(driver_, ctx_);
      if (ctx.status().ok()) {
        for (auto& [stream, ss] : streams_) {
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

  Driver& driver() const { return driver_; }
  ContextHandle context() const { return ctx_; }
  int device() const { return device_; }
  std::size_t device_total_bytes() const { return device_total_; }
  const DeviceAllocatorOptions& options() const { return options_; }
  TraceRecorder& recorder() { return recorder_; }

  // ---- Allocate / Deallocate ----------------------------------------------

  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream,
                                     OwnerId owner, const char* label)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::Allocate"));
    if (ABSL_PREDICT_FALSE(bytes > device_total_)) {
      core_internal::SpinLockHolder lock(&mu_);
      // An owner's budget (or its being closed) speaks first.
      if (owner != kNoOwner) CTXPOOL_RETURN_IF_ERROR(CheckCharge(owner, bytes));
      ++invalid_requests_;
      return absl::InvalidArgumentError(absl::StrFormat(
          "Allocate(%d bytes): larger than device %d's total memory (%d "
          "bytes)",
          bytes, device_, device_total_));
    }
    const std::size_t rounded = classes_.Round(bytes);
    const bool small = classes_.IsSmall(rounded);
    OomReport report;
    {
      core_internal::SpinLockHolder lock(&mu_);
      if (ABSL_PREDICT_FALSE(owner != kNoOwner)) {
        CTXPOOL_RETURN_IF_ERROR(CheckCharge(owner, bytes));
      }
      if (auto p = TryAllocateTagged(stream, rounded, bytes, small, &report,
                                     owner, label)) {
        return *std::move(p);
      }
    }
    if (options_.on_oom && options_.on_oom(report)) {
      core_internal::SpinLockHolder lock(&mu_);
      // The lock was dropped: the owner may have been closed or charged.
      if (ABSL_PREDICT_FALSE(owner != kNoOwner)) {
        CTXPOOL_RETURN_IF_ERROR(CheckCharge(owner, bytes));
      }
      if (auto p = TryAllocateTagged(stream, rounded, bytes, small, &report,
                                     owner, label)) {
        return *std::move(p);
      }
    }
    core_internal::SpinLockHolder lock(&mu_);
    ++num_ooms_;
    if (OwnerRec* o = FindOwner(owner)) ++o->ooms;
    StreamState* ss = GetStream(stream.value());
    ++tenants_[ss->tenant]->ooms;
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kOom, 0, bytes, ss->stream, ss->tenant);
    }
    return absl::ResourceExhaustedError(report.ToString());
  }

  // TryAllocate with the block tagged for `owner` (TakeBlock reads the tag).
  std::optional<absl::StatusOr<DevicePtr>> TryAllocateTagged(
      StreamHandle stream, std::size_t rounded, std::size_t bytes, bool small,
      OomReport* report, OwnerId owner, const char* label)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (owner == kNoOwner) {  // next_owner_ is kNoOwner between calls
      return TryAllocate(stream, rounded, bytes, small, report);
    }
    // Cleared however TryAllocate leaves (a std::bad_alloc of a host
    // container included), so no later block inherits the tag.
    struct TagScope {
      Impl* impl;
      ~TagScope() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // mu_ is held
        impl->next_owner_ = kNoOwner;
        impl->next_owner_rec_ = nullptr;
        impl->next_label_ = nullptr;
      }
    } scope{this};
    next_owner_ = owner;
    next_owner_rec_ = owners_[owner - 1].get();  // CheckCharge found it
    next_label_ = label;
    return TryAllocate(stream, rounded, bytes, small, report);
  }

  // One attempt: the cached hot path, else the slow path (new memory, the
  // allocator's own retry). std::nullopt when it ran out of memory; `report`
  // then says why.
  std::optional<absl::StatusOr<DevicePtr>> TryAllocate(
      StreamHandle stream, std::size_t rounded, std::size_t bytes, bool small,
      OomReport* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = GetStream(stream.value());
    // The cached hot path. In expandable mode the index holds only blocks
    // on mapped granules, so a fit is served as it is: no driver call.
    if (Block* b = FindFree(ss, rounded, small)) {
      ++cache_hits_;
      return Traced(TakeBlock(b, rounded, bytes), bytes, ss);
    }
    bool oom = false;
    absl::StatusOr<DevicePtr> p =
        AllocateSlow(ss, rounded, bytes, small, report, &oom);
    if (oom) return std::nullopt;
    return Traced(p, bytes, ss);
  }

  // kChecked: `check` may refuse the free (the plain Deallocate passes
  // none, and pays nothing for it).
  template <bool kChecked>
  absl::Status Deallocate(DevicePtr ptr, const FreeCheck& check)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::Deallocate"));
    core_internal::SpinLockHolder lock(&mu_);
    auto it = live_.find(ptr.address());
    if (ABSL_PREDICT_FALSE(it == live_.end())) {
      CountInvalidFree(check.owner);
      return absl::InvalidArgumentError(absl::StrFormat(
          "Deallocate(0x%x): not the start of a live block of this allocator "
          "(foreign pointer or double free)",
          ptr.address()));
    }
    if constexpr (kChecked) {
      CTXPOOL_RETURN_IF_ERROR(CheckFree(*it->second, ptr, check));
      if (ABSL_PREDICT_FALSE(check.order_after_stream)) {
        CTXPOOL_RETURN_IF_ERROR(AddStreamUse(it->second, check.stream));
      }
    }
    return FreeLive(it);
  }

  // Frees the live block at `it` (Deallocate after its checks).
  ABSL_ATTRIBUTE_ALWAYS_INLINE absl::Status FreeLive(
      absl::flat_hash_map<std::uint64_t, Block*>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Block* b = it->second;
    if (ABSL_PREDICT_FALSE(!b->stream_uses.empty())) {
      return DeallocateWithUses(b);
    }
    live_.erase(it);
    StreamState* ss = Owner(b->segment);
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kFree, b->address, b->requested, ss->stream,
                       ss->tenant);
      recorder_.Record(TraceOp::kFreeCompleted, b->address, b->size, ss->stream,
                       ss->tenant);
    }
    RemoveAllocatedStats(b);
    FreeToIndex(b);
    if (ABSL_PREDICT_FALSE(expandable_ &&
                           tenants_[ss->tenant]->budget.high != kNoLimit)) {
      ShedAboveHigh(ss->tenant);
    }
    return absl::OkStatus();
  }

  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream, OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RecordStream"));
    core_internal::SpinLockHolder lock(&mu_);
    auto it = live_.find(ptr.address());
    if (it == live_.end() ||
        (owner != kAnyOwner && it->second->owner != owner)) {
      ++invalid_requests_;
      return absl::InvalidArgumentError(absl::StrFormat(
          "RecordStream(0x%x): not the start of a live block%s", ptr.address(),
          owner != kAnyOwner ? " of this owner" : ""));
    }
    return AddStreamUse(it->second, stream);
  }

  // Orders the free of the live block `b` after `stream`'s work too (a
  // no-op for its allocation stream). RESOURCE_EXHAUSTED, nothing changed,
  // when the host is out of memory.
  absl::Status AddStreamUse(Block* b, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // ---- Owners ----------------------------------------------------------

  absl::StatusOr<OwnerId> RegisterOwner(absl::string_view name,
                                        std::size_t max_live_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RegisterOwner"));
    if (name.empty()) {
      return absl::InvalidArgumentError("RegisterOwner: empty name");
    }
    auto o = std::make_unique<OwnerRec>();
    o->name = std::string(name);
    o->max = max_live_bytes;
    core_internal::SpinLockHolder lock(&mu_);
    if (owners_.size() >= kAnyOwner - 1) {
      return absl::ResourceExhaustedError("RegisterOwner: out of owner ids");
    }
    owners_.push_back(std::move(o));
    return static_cast<OwnerId>(owners_.size());
  }

  absl::StatusOr<OwnerStats> GetOwnerStats(OwnerId owner) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    const OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("GetOwnerStats", owner);
    return ToStats(*o);
  }

  absl::StatusOr<std::vector<OwnedBlock>> OwnedBlocks(OwnerId owner) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    if (FindOwner(owner) == nullptr) return UnknownOwner("OwnedBlocks", owner);
    return ListOwned(owner);
  }

  absl::Status CloseOwner(OwnerId owner, std::vector<OwnedBlock>* freed)
      ABSL_LOCKS_EXCLUDED(mu_) {
    freed->clear();
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::CloseOwner"));
    core_internal::SpinLockHolder lock(&mu_);
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("CloseOwner", owner);
    o->closed = true;
    std::vector<OwnedBlock> live = ListOwned(owner);
    freed->reserve(live.size());
    absl::Status first_error;
    for (const OwnedBlock& ob : live) {
      auto it = live_.find(ob.ptr.address());
      if (it == live_.end()) continue;  // cannot happen: listed under the lock
      absl::Status s = FreeLive(it);
      if (s.ok()) {
        --o->frees;  // a reclaim, not the owner's free
        ++o->reclaimed;
        freed->push_back(ob);
      } else if (first_error.ok()) {
        first_error = s;
      }
    }
    return first_error;
  }

  absl::StatusOr<OwnerStats> UnregisterOwner(OwnerId owner)
      ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    OwnerRec* o = FindOwner(owner);
    if (o == nullptr) return UnknownOwner("UnregisterOwner", owner);
    if (o->allocs != o->frees + o->reclaimed) {
      for (auto& [address, b] : live_) {
        if (b->owner == owner) {
          b->owner = kNoOwner;
          b->owner_data = nullptr;
          b->label = nullptr;  // it may point into the owner's memory
        }
      }
    }
    OwnerStats st = ToStats(*o);
    owners_[owner - 1].reset();
    return st;
  }

  // ---- Trim / Reset --------------------------------------------------------

  absl::StatusOr<TrimResult> Trim(std::size_t keep_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("CachingDeviceAllocator::Trim"));
    core_internal::SpinLockHolder lock(&mu_);
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    ++num_trims_;
    TrimResult result;
    SyncPending(&result.event_waits);
    std::size_t busy_segments = 0;
    absl::Status status;
    if (expandable_) {
      std::vector<StreamState*> all;
      for (auto& [stream, ss] : streams_) all.push_back(ss.get());
      SortByStream(&all);
      for (StreamState* ss : all) {
        bool busy = false;
        status.Update(UnmapFreeGranules(ss, kNoLimit, /*wait=*/true,
                                        &result.event_waits, &busy, nullptr));
        if (busy) busy_segments += FreeMappedBytes(ss);
      }
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
    core_internal::SpinLockHolder lock(&mu_);
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
          absl::StrFormat("budget min %d > max %d bytes", b.min, b.max));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TenantId> RegisterTenant(absl::string_view name, Budget budget)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::RegisterTenant"));
    CTXPOOL_RETURN_IF_ERROR(ValidateBudget(budget));
    core_internal::SpinLockHolder lock(&mu_);
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
    core_internal::SpinLockHolder lock(&mu_);
    if (tenant == kDefaultTenant || !KnownTenant(tenant)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "UnregisterTenant: unknown or default tenant %d", tenant));
    }
    if (const std::vector<StreamState*>& bound = tenants_[tenant]->streams;
        !bound.empty()) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "UnregisterTenant: tenant '%s' still has stream 0x%x bound",
          tenants_[tenant]->name, bound.front()->stream));
    }
    tenants_[tenant]->registered = false;
    return absl::OkStatus();
  }

  absl::Status UnbindStream(StreamHandle stream) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::UnbindStream"));
    core_internal::SpinLockHolder lock(&mu_);
    if (!bound_.contains(stream.value())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "UnbindStream: stream 0x%x is not bound", stream.value()));
    }
    StreamState* ss = GetStream(stream.value());
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
    core_internal::SpinLockHolder lock(&mu_);
    if (!KnownTenant(tenant)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("BindStream: unknown tenant %d", tenant));
    }
    if (!bound_.insert(stream.value()).second) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "BindStream: stream 0x%x is already bound", stream.value()));
    }
    SetTenant(GetStream(stream.value()), tenant);
    return absl::OkStatus();
  }

  absl::StatusOr<TrimResult> SetBudget(TenantId tenant, Budget budget)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingDeviceAllocator::SetBudget"));
    CTXPOOL_RETURN_IF_ERROR(ValidateBudget(budget));
    core_internal::SpinLockHolder lock(&mu_);
    if (!KnownTenant(tenant)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("SetBudget: unknown tenant %d", tenant));
    }
    tenants_[tenant]->budget = budget;
    TrimResult result;
    if (TenantMapped(tenant) > budget.max) {
      ScopedContext ctx(driver_, ctx_);
      CTXPOOL_RETURN_IF_ERROR(ctx.status());
      const std::size_t before = TenantMapped(tenant);
      if (expandable_) {
        for (StreamState* ss : TenantStreams(tenant)) {
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
    core_internal::SpinLockHolder lock(&mu_);
    if (!KnownTenant(tenant)) {
      return absl::NotFoundError(absl::StrFormat("unknown tenant %d", tenant));
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
    core_internal::SpinLockHolder lock(&mu_);
    if (!live_.empty() && !force) {
      std::vector<const Block*> blocks;
      for (const auto& [address, b] : live_) blocks.push_back(b);
      std::sort(blocks.begin(), blocks.end(),
                [](const Block* a, const Block* b) {
                  return a->address < b->address;
                });
      std::string msg = absl::StrFormat(
          "Reset: %d allocations are live (pass force=true to drop them):",
          blocks.size());
      constexpr std::size_t kMaxListed = 32;
      for (std::size_t i = 0; i < blocks.size() && i < kMaxListed; ++i) {
        absl::StrAppendFormat(&msg, " [ptr 0x%x, %d bytes, stream 0x%x]",
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
        return absl::FailedPreconditionError(absl::StrFormat(
            "Reset: %d freed blocks are still in use by streams that cannot "
            "be waited for",
            pending_.size()));
      }
      absl::flat_hash_set<std::uint64_t> idle;
      for (const auto& [base, seg] : segments_) {
        StreamState* owner = Owner(seg.get());
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
    for (const auto& [base, seg] : segments_) all.push_back(seg.get());
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
    core_internal::SpinLockHolder lock(&mu_);
    DeviceAllocatorStats s;
    s.total = total_;
    s.per_stream.reserve(streams_.size());
    for (const auto& [stream, ss] : streams_) {
      s.per_stream.emplace_back(StreamHandle(stream), ss->stats);
    }
    std::sort(s.per_stream.begin(), s.per_stream.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    s.num_alloc_retries = num_alloc_retries_;
    s.num_ooms = num_ooms_;
    s.cache_hits = cache_hits_;
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

  std::size_t PhysicalBytes() const ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    return static_cast<std::size_t>(
               total_.reserved_bytes[StatIndex(StatPool::kAggregate)].current) +
           CacheBytes();
  }

  FragmentationStats Fragmentation() const ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    FragmentationInputs in;
    for (const auto& [stream, ss] : streams_) {
      for (const FreeIndex<Block>& index : ss->free) {
        in.free_blocks += index.size();
        if (const Block* last = index.Last()) {
          in.largest_free_bytes = std::max(in.largest_free_bytes, last->size);
        }
      }
    }
    in.reserved_bytes = Reserved();
    in.free_bytes = in.reserved_bytes - Current(total_.active_bytes);
    // Expandable: free blocks include the unmapped rest of the ranges.
    in.largest_free_bytes = std::min(in.largest_free_bytes, in.free_bytes);
    in.allocated_bytes = Current(total_.allocated_bytes);
    in.requested_bytes = Current(total_.requested_bytes);
    return ComputeFragmentation(in);
  }

  AllocatorSnapshot Snapshot() const ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
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
          bi.mapped_bytes = MappedBytes(seg.get(), b->address, b->size);
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
    core_internal::SpinLockHolder lock(&mu_);
    auto it = live_.find(ptr.address());
    if (it == live_.end()) {
      return absl::NotFoundError(absl::StrFormat(
          "0x%x is not the start of a live block", ptr.address()));
    }
    return ToInfo(*it->second);
  }

  void ResetPeakStats() ABSL_LOCKS_EXCLUDED(mu_) {
    core_internal::SpinLockHolder lock(&mu_);
    total_.ResetPeaks();
    for (auto& [stream, ss] : streams_) ss->stats.ResetPeaks();
  }

  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // ---- Helpers on the stats ------------------------------------------------

  static std::size_t Current(const StatArray& a) {
    return static_cast<std::size_t>(a[0].current);
  }
  std::size_t Reserved() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Current(total_.reserved_bytes);
  }
  std::size_t PendingBytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return Current(total_.active_bytes) - Current(total_.allocated_bytes);
  }
  void Bump(StreamState* ss, StatArray PoolStats::*field, bool small,
            std::int64_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    AddStat(total_.*field, small, n);
    AddStat(ss->stats.*field, small, n);
  }
  static StreamState* Owner(const Segment* seg) {
    return static_cast<StreamState*>(seg->owner);
  }

  StreamState* GetStream(std::uint64_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = last_stream_;
    if (ABSL_PREDICT_FALSE(ss == nullptr || ss->stream != stream)) {
      auto it = streams_.find(stream);
      if (it == streams_.end()) {
        it = streams_.emplace(stream, std::make_unique<StreamState>(stream))
                 .first;
        tenants_[kDefaultTenant]->streams.push_back(it->second.get());
      }
      ss = it->second.get();
      last_stream_ = ss;
    }
    // Work is being enqueued on it, so the handle is alive (again).
    ss->destroyed = false;
    if (ABSL_PREDICT_FALSE(ss->retired)) Revive(ss);
    return ss;
  }

  // A retired handle is in use again (a new stream got it): order the new
  // stream after the old one's work once, then treat it as any stream.
  void Revive(StreamState* ss) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
    core_internal::SpinLockHolder lock(&mu_);
    auto it = streams_.find(stream.value());
    if (it == streams_.end()) {
      // Known only through RecordStream (a live block's uses): it must be
      // retired too, or that block's free would record on the dead handle.
      bool used = false;
      for (const auto& [address, b] : live_) {
        for (std::uint64_t u : b->stream_uses)
          used = used || u == stream.value();
        if (used) break;
      }
      if (!used) return absl::OkStatus();
      it = streams_
               .emplace(stream.value(),
                        std::make_unique<StreamState>(stream.value()))
               .first;
      tenants_[kDefaultTenant]->streams.push_back(it->second.get());
    }
    StreamState* ss = it->second.get();
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
    if (last_stream_ == ss) last_stream_ = nullptr;
    return absl::OkStatus();
  }

 private:
  // ---- Free index maintenance ----------------------------------------------

  // Links a free block into its owner's index (and a wholly free segment into
  // whole_free_), keeping inactive_split current.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Index(Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = b->segment;
    StreamState* ss = Owner(seg);
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
      whole_free_[PoolIndex(seg->small)].Insert(seg, seg->size, seg->base);
      static_cast<DeviceSegment*>(seg)->free_since = absl::InfinitePast();
    }
  }

  ABSL_ATTRIBUTE_ALWAYS_INLINE void Unindex(Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = b->segment;
    StreamState* ss = Owner(seg);
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
      whole_free_[PoolIndex(seg->small)].Erase(seg);
    }
  }

  Block* FindFree(StreamState* ss, std::size_t rounded, bool small) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Block* b = ss->free[PoolIndex(small)].LowerBound(rounded);
    if (b == nullptr || !classes_.CanServe(b->size, rounded)) return nullptr;
    return b;
  }

  // Allocates from free block `b` (splitting it when worthwhile, or
  // whenever something remains with `split_any`).
  DevicePtr TakeBlock(Block* b, std::size_t rounded, std::size_t requested,
                      bool split_any = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = b->segment;
    StreamState* ss = Owner(seg);
    const bool small = seg->small;
    Unindex(b);
    if (split_any ? b->size > rounded
                  : classes_.ShouldSplit(b->size, rounded, small)) {
      Index(SplitBlock(b, rounded, blocks_));
    }
    ++ss->ops;
    b->state = BlockState::kAllocated;
    b->requested = requested;
    b->owner = next_owner_;
    b->owner_data = next_owner_rec_;
    b->label = next_label_;
    if (next_owner_rec_ != nullptr) {
      b->born_ns = core_internal::CoarseNowNs();
      OwnerRec& o = *next_owner_rec_;
      o.live += Charge(requested);
      o.peak = std::max(o.peak, o.live);
      o.requested += requested;
      ++o.allocs;
    }
    live_.emplace(b->address, b);
    const auto size = static_cast<std::int64_t>(b->size);
    Bump(ss, &PoolStats::allocation, small, 1);
    Bump(ss, &PoolStats::active, small, 1);
    Bump(ss, &PoolStats::allocated_bytes, small, size);
    Bump(ss, &PoolStats::active_bytes, small, size);
    Bump(ss, &PoolStats::requested_bytes, small,
         static_cast<std::int64_t>(requested));
    return DevicePtr(b->address);
  }

  // An allocated block stops being live (it becomes pending or free).
  void RemoveAllocatedStats(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = b->segment;
    StreamState* ss = Owner(seg);
    Bump(ss, &PoolStats::allocation, seg->small, -1);
    Bump(ss, &PoolStats::allocated_bytes, seg->small,
         -static_cast<std::int64_t>(b->size));
    Bump(ss, &PoolStats::requested_bytes, seg->small,
         -static_cast<std::int64_t>(b->requested));
    if (b->owner_data != nullptr) {
      auto* o = static_cast<OwnerRec*>(b->owner_data);
      o->live -= Charge(b->requested);
      o->requested -= b->requested;
      ++o->frees;
      b->owner_data = nullptr;
    }
    b->owner = kNoOwner;
    b->label = nullptr;
    b->requested = 0;
  }

  // ---- Owners: helpers -----------------------------------------------------

  // What an owner is charged for a request.
  std::size_t Charge(std::size_t bytes) const {
    const std::size_t r = options_.round_bytes;  // a power of two
    if (ABSL_PREDICT_FALSE(bytes >
                           std::numeric_limits<std::size_t>::max() - r)) {
      return std::numeric_limits<std::size_t>::max();  // saturates
    }
    return bytes == 0 ? r : (bytes + r - 1) & ~(r - 1);
  }

  OwnerRec* FindOwner(OwnerId owner) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (owner == kNoOwner || owner > owners_.size()) return nullptr;
    return owners_[owner - 1].get();
  }

  static absl::Status UnknownOwner(absl::string_view call, OwnerId owner) {
    return absl::NotFoundError(
        absl::StrFormat("%s: owner %d is not registered", call, owner));
  }

  // OK when `owner` may be charged for `bytes` more.
  ABSL_ATTRIBUTE_ALWAYS_INLINE absl::Status CheckCharge(OwnerId owner,
                                                        std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const OwnerRec* o = FindOwner(owner);
    if (ABSL_PREDICT_TRUE(o != nullptr && !o->closed)) {
      if (o->max == 0) return absl::OkStatus();
      const std::size_t charge = Charge(bytes);
      if (charge <= o->max && o->live <= o->max - charge) {
        return absl::OkStatus();
      }
    }
    return ChargeRefused(owner, bytes);
  }
  ABSL_ATTRIBUTE_NOINLINE absl::Status ChargeRefused(OwnerId owner,
                                                     std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    OwnerRec* o = FindOwner(owner);
    if (ABSL_PREDICT_FALSE(o == nullptr)) {
      ++invalid_requests_;
      return absl::InvalidArgumentError(absl::StrFormat(
          "Allocate: owner %d is not registered with this allocator", owner));
    }
    if (ABSL_PREDICT_FALSE(o->closed)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("Allocate: owner '%s' is closed", o->name));
    }
    const std::size_t charge = Charge(bytes);
    if (o->max != 0 && (charge > o->max || o->live > o->max - charge)) {
      ++o->rejections;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "'%s' is over its memory budget on device %d: requested %d B (%d B "
          "charged), live %d B, max %d B",
          o->name, device_, bytes, charge, o->live, o->max));
    }
    return absl::OkStatus();
  }

  // An owned call counts in its owner (none once it is unregistered: its
  // caller reports the closed session), a plain one in the allocator.
  void CountInvalidFree(OwnerId owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (owner == kAnyOwner || owner == kNoOwner) {
      ++invalid_frees_;
    } else if (OwnerRec* o = FindOwner(owner); o != nullptr && !o->closed) {
      // A closed owner's figures are final: a free that lost the race with
      // CloseOwner (the block was reclaimed) counts nowhere, as one after
      // UnregisterOwner does.
      ++o->invalid_frees;
    }
  }

  // Deallocate's FreeCheck on live block `b`.
  ABSL_ATTRIBUTE_ALWAYS_INLINE absl::Status CheckFree(const Block& b,
                                                      DevicePtr ptr,
                                                      const FreeCheck& check)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ABSL_PREDICT_TRUE(
            (check.owner == kAnyOwner || b.owner == check.owner) &&
            (!check.owned_only || b.owner != kNoOwner) &&
            (!check.check_size || b.requested == check.requested_bytes))) {
      return absl::OkStatus();
    }
    return FreeRefused(b, ptr, check);
  }
  ABSL_ATTRIBUTE_NOINLINE absl::Status FreeRefused(const Block& b,
                                                   DevicePtr ptr,
                                                   const FreeCheck& check)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if ((check.owner != kAnyOwner && b.owner != check.owner) ||
        (check.owned_only && b.owner == kNoOwner)) {
      CountInvalidFree(check.owner);
      const OwnerRec* mine = FindOwner(check.owner);
      const OwnerRec* theirs = FindOwner(b.owner);
      return absl::InvalidArgumentError(absl::StrFormat(
          "Deallocate(0x%x): not a live allocation of %s (it belongs to "
          "%s); nothing freed",
          ptr.address(),
          check.owner == kAnyOwner ? "any owner"
          : mine != nullptr        ? absl::StrCat("'", mine->name, "'")
                                   : std::string("an unknown owner"),
          theirs != nullptr ? absl::StrCat("'", theirs->name, "'")
                            : std::string("no owner")));
    }
    if (check.check_size && b.requested != check.requested_bytes) {
      CountInvalidFree(check.owner);
      ++mismatched_frees_;
      return absl::InvalidArgumentError(absl::StrFormat(
          "Deallocate(0x%x, %d bytes): the allocation was %d bytes; refused, "
          "the block stays allocated",
          ptr.address(), check.requested_bytes, b.requested));
    }
    return absl::OkStatus();
  }

  OwnerStats ToStats(const OwnerRec& o) const {
    OwnerStats st;
    st.name = o.name;
    st.max_live_bytes = o.max;
    st.live_bytes = o.live;
    st.peak_live_bytes = o.peak;
    st.requested_bytes = o.requested;
    st.live_allocations = o.allocs - o.frees - o.reclaimed;
    st.num_allocs = o.allocs;
    st.num_frees = o.frees;
    st.num_ooms = o.ooms;
    st.num_budget_rejections = o.rejections;
    st.invalid_frees = o.invalid_frees;
    st.closed = o.closed;
    return st;
  }

  // The live blocks of `owner`, by address.
  std::vector<OwnedBlock> ListOwned(OwnerId owner) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<OwnedBlock> out;
    for (const auto& [address, b] : live_) {
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
    std::sort(
        out.begin(), out.end(),
        [](const OwnedBlock& a, const OwnedBlock& b) { return a.ptr < b.ptr; });
    return out;
  }

  // An allocated-or-pending block (already out of live_) becomes free:
  // coalesce with free neighbours and index the result.
  void FreeToIndex(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment* seg = b->segment;
    StreamState* ss = Owner(seg);
    Bump(ss, &PoolStats::active, seg->small, -1);
    Bump(ss, &PoolStats::active_bytes, seg->small,
         -static_cast<std::int64_t>(b->size));
    ++ss->ops;
    b->state = BlockState::kFree;
    b->pending_events = 0;
    if (!b->stream_uses.empty()) b->stream_uses.clear();
    Index(Coalesce(b));
  }

  // Merges unindexed free block `b` with its free neighbours of the same
  // kind (mapped or not) and returns the result, still unindexed.
  ABSL_ATTRIBUTE_ALWAYS_INLINE Block* Coalesce(Block* b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (b->prev != nullptr && b->prev->state == BlockState::kFree &&
        b->prev->unmapped == b->unmapped && !b->prev->quarantined) {
      Block* prev = b->prev;
      Unindex(prev);
      MergeNext(prev, blocks_);
      b = prev;
    }
    if (b->next != nullptr && b->next->state == BlockState::kFree &&
        b->next->unmapped == b->unmapped && !b->next->quarantined) {
      Unindex(b->next);
      MergeNext(b, blocks_);
    }
    return b;
  }

  // ---- Events --------------------------------------------------------------

  absl::StatusOr<EventHandle> GetEvent() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!event_pool_.empty()) {
      EventHandle e = event_pool_.back();
      event_pool_.pop_back();
      return e;
    }
    return driver_.EventCreate(kEventDisableTiming);
  }
  void PutEvent(EventHandle e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    event_pool_.push_back(e);
  }

  // The stream was destroyed: its queued work still runs, so wait for all
  // work of the context once; after that nothing can use its memory.
  absl::Status HandleDestroyed(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++num_host_syncs_;
    CTXPOOL_RETURN_IF_ERROR(driver_.CtxSynchronize());
    if (ss != nullptr && !ss->destroyed) {
      ss->destroyed = true;
      ++destroyed_streams_;
    }
    return absl::OkStatus();
  }

  // Makes sure no work queued so far on `ss`'s stream is still running:
  // records an event, and waits for it only if it is not already complete.
  absl::Status EnsureIdle(StreamState* ss, int* waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ss->destroyed) return absl::OkStatus();
    if (ss->retired) {
      if (RetiredIdle(ss, /*wait=*/true, waits)) return absl::OkStatus();
      return absl::InternalError(absl::StrFormat(
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

  // Frees a block that other streams used: one event per such stream, the
  // block stays pending until all complete (PollPending).
  absl::Status DeallocateWithUses(Block* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    absl::InlinedVector<EventHandle, 4> events;
    bool need_sync = false;
    for (std::uint64_t s : b->stream_uses) {
      if (auto it = streams_.find(s);
          it != streams_.end() && it->second->retired) {
        // Its work is ordered by the retire event: no record on the dead
        // handle; the block waits for that event here (rare: a stream
        // retired while a block it used is still live).
        if (!RetiredIdle(it->second.get(), /*wait=*/true, nullptr)) {
          need_sync = true;
          break;
        }
        continue;
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
          auto it = streams_.find(s);
          if (it != streams_.end() && !it->second->destroyed) {
            it->second->destroyed = true;
            ++destroyed_streams_;
          } else if (it == streams_.end()) {
            ++destroyed_streams_;
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
    live_.erase(b->address);
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kFree, b->address, b->requested,
                       b->segment->stream, Owner(b->segment)->tenant);
      if (events.empty()) {
        recorder_.Record(TraceOp::kFreeCompleted, b->address, b->size,
                         b->segment->stream, Owner(b->segment)->tenant);
      }
    }
    RemoveAllocatedStats(b);
    if (events.empty()) {
      FreeToIndex(b);
      return absl::OkStatus();
    }
    b->state = BlockState::kPendingFree;
    b->pending_events = static_cast<int>(events.size());
    for (EventHandle e : events) pending_.push_back({b, e});
    return absl::OkStatus();
  }

  // Frees the pending blocks whose events completed; with `waits` non-null,
  // waits for incomplete ones (counting each wait). REQUIRES: context set.
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
        if (recorder_.enabled()) {
          recorder_.Record(TraceOp::kFreeCompleted, p.block->address,
                           p.block->size, p.block->segment->stream,
                           Owner(p.block->segment)->tenant);
        }
        FreeToIndex(p.block);
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
  // --------------------------------------------------------------

  // The smallest wholly free segment of another stream that can serve the
  // request and that allow(seg) accepts.
  template <typename Allow>
  Segment* FindStealable(StreamState* ss, std::size_t rounded, bool small,
                         Allow allow) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const FreeIndex<Segment>& index = whole_free_[PoolIndex(small)];
    for (Segment* seg = index.LowerBound(rounded); seg != nullptr;
         seg = FreeIndex<Segment>::Next(seg)) {
      if (Owner(seg) != ss && classes_.CanServe(seg->size, rounded) &&
          allow(seg)) {
        return seg;
      }
    }
    return nullptr;
  }

  // Classic mode under device pressure: takes another tenant's wholly free
  // segment that can serve the request, never below that tenant's min nor
  // above the requester's max, and counts it as reclaimed on both sides.
  absl::StatusOr<Segment*> ReclaimSegment(StreamState* ss, std::size_t rounded,
                                          bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Budget& mine = tenants_[ss->tenant]->budget;
    Segment* seg = FindStealable(
        ss, rounded, small, [&](Segment* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          const TenantId owner = Owner(s)->tenant;
          if (owner == ss->tenant) return true;
          const std::size_t min = tenants_[owner]->budget.min;
          return TenantMapped(owner) >= min + s->size &&
                 (mine.max == kNoLimit ||
                  TenantMapped(ss->tenant) + s->size <= mine.max);
        });
    if (seg == nullptr) return nullptr;
    const TenantId owner = Owner(seg)->tenant;
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
    for (const auto& [stream, ss] : streams_) {
      v[ss->tenant] += Current(ss->stats.reserved_bytes);
    }
    return v;
  }

  // Hands wholly free `seg` to stream `to`, ordering `to`'s later work after
  // the owner's queued work with an event: no host synchronise.
  absl::Status MoveSegment(Segment* seg, StreamState* to)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* from = Owner(seg);
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
    Block* b = seg->first;
    Unindex(b);
    const auto size = static_cast<std::int64_t>(seg->size);
    AddStat(from->stats.segment, seg->small, -1);
    AddStat(from->stats.reserved_bytes, seg->small, -size);
    seg->owner = to;
    seg->stream = to->stream;
    AddStat(to->stats.segment, seg->small, 1);
    AddStat(to->stats.reserved_bytes, seg->small, size);
    Index(b);
    return absl::OkStatus();
  }

  // A new segment from the backing, indexed as one free block.
  absl::StatusOr<Block*> NewSegment(StreamState* ss, std::size_t bytes,
                                    bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(alloc_internal::CheckMemoryLimit(
        "cuMemAlloc", options_.memory_limit_bytes, Reserved(), bytes));
    // Host bookkeeping first and the books last, so that host memory
    // running out (std::bad_alloc) loses no device memory and leaves the
    // books as they were.
    auto seg = std::make_unique<DeviceSegment>();
    Block* b = blocks_.New();
    absl::StatusOr<BackedRange> range = backing_->Allocate(bytes);
    if (!range.ok()) {
      blocks_.Delete(b);
      return range.status();
    }
    ++upstream_allocs_;
    seg->base = range->base.address();
    seg->size = range->size;
    seg->stream = ss->stream;
    seg->small = small;
    seg->backing_handle = range->handle;
    seg->owner = ss;
    b->address = seg->base;
    b->size = seg->size;
    b->segment = seg.get();
    b->state = BlockState::kFree;
    seg->first = b;
    Segment* const raw = seg.get();
    try {
      segments_.emplace(raw->base, std::move(seg));
    } catch (...) {
      if (backing_->Free(*range).ok()) ++upstream_frees_;
      blocks_.Delete(b);
      throw;
    }
    Bump(ss, &PoolStats::segment, small, 1);
    Bump(ss, &PoolStats::reserved_bytes, small,
         static_cast<std::int64_t>(raw->size));
    if (recorder_.enabled()) {
      recorder_.Record(TraceOp::kSegmentMap, raw->base, raw->size, ss->stream,
                       ss->tenant);
    }
    Index(b);
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
    StreamState* ss = Owner(seg);
    const bool small = seg->small;
    if (expandable_) {
      // Unmap every piece (to the cache), then give the range back.
      VmmRange* r = RangeOf(seg);
      bool unreserved = false;
      if (free_memory) {
        std::vector<std::size_t> starts;
        for (const auto& [start, piece] : r->pieces) starts.push_back(start);
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
        Bump(ss, &PoolStats::reserved_bytes, small,
             -static_cast<std::int64_t>(r->mapped));
        vmm_.Forget(r);
      }
      ss->range[PoolIndex(small)] = nullptr;
    } else if (free_memory) {
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
    for (Block* b = seg->first; b != nullptr;) {
      Block* next = b->next;
      switch (b->state) {
        case BlockState::kAllocated: {
          live_.erase(b->address);
          auto* o = static_cast<OwnerRec*>(b->owner_data);
          RemoveAllocatedStats(b);
          if (o != nullptr) {  // dropped by a forced Reset: a reclaim
            --o->frees;
            ++o->reclaimed;
          }
        }
          [[fallthrough]];
        case BlockState::kPendingFree:
          Bump(ss, &PoolStats::active, small, -1);
          Bump(ss, &PoolStats::active_bytes, small,
               -static_cast<std::int64_t>(b->size));
          break;
        case BlockState::kFree:
          Unindex(b);
          break;
      }
      blocks_.Delete(b);
      b = next;
    }
    Bump(ss, &PoolStats::segment, small, -1);
    if (!expandable_) {
      Bump(ss, &PoolStats::reserved_bytes, small,
           -static_cast<std::int64_t>(seg->size));
    }
    segments_.erase(seg->base);
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
      const std::size_t lo = (b->address - r->base + granule_ - 1) / granule_;
      const std::size_t hi = (b->end() - r->base) / granule_;
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

  // The wholly free segments (both pools) for which keep(seg) is true, in
  // index order.
  template <typename Keep>
  std::vector<Segment*> WholeFreeWhere(Keep keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Segment*> out;
    for (const FreeIndex<Segment>& index : whole_free_) {
      for (Segment* seg = index.First(); seg != nullptr;
           seg = FreeIndex<Segment>::Next(seg)) {
        if (keep(seg)) out.push_back(seg);
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
                             bool protect_min = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Segment*> candidates =
        WholeFreeWhere([&](Segment* seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return only == nullptr || Owner(seg) == only;
        });
    const std::size_t allocated = Current(total_.allocated_bytes);
    return DropWholeFree(
        std::move(candidates), /*wait=*/true, protect_min,
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
    absl::Status first_error;
    for (Segment* seg : candidates) {
      if (done()) break;
      StreamState* owner = Owner(seg);
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
          return Owner(seg)->tenant == t;
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
      for (auto& [stream, ss] : streams_) {
        if (ss->ops != ss->ops_seen || ss->active_at == absl::InfinitePast()) {
          ss->ops_seen = ss->ops;
          ss->active_at = now;
        } else if (ss->active_at <= cutoff && ss->decayed_ops != ss->ops) {
          stale.push_back(ss.get());
        }
      }
      SortByStream(&stale);
      for (StreamState* ss : stale) {
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
    std::size_t n = 0;
    for (const StreamState* ss : tenants_[t]->streams) {
      n += Current(ss->stats.reserved_bytes);
    }
    return n;
  }
  std::size_t TenantLive(TenantId t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t n = 0;
    for (const StreamState* ss : tenants_[t]->streams) {
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
  // Moves `ss` from its tenant's stream list to `t`'s.
  void SetTenant(StreamState* ss, TenantId t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<StreamState*>& from = tenants_[ss->tenant]->streams;
    from.erase(std::find(from.begin(), from.end(), ss));
    tenants_[t]->streams.push_back(ss);
    ss->tenant = t;
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // The stream's range for a pool, reserved on first use.
  absl::StatusOr<Segment*> EnsureRange(StreamState* ss, bool small)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Segment*& slot = ss->range[PoolIndex(small)];
    if (slot != nullptr) return slot;
    // Twice the device's memory: virtual space is cheap, and the slack keeps
    // address-space fragmentation from failing a request that physical
    // memory could serve.
    const std::size_t size = 2 * SizeClasses::RoundUp(device_total_, granule_);
    CTXPOOL_ASSIGN_OR_RETURN(VmmRange * r, vmm_.Reserve(size));
    auto seg = std::make_unique<DeviceSegment>();
    seg->base = r->base;
    seg->size = size;
    seg->stream = ss->stream;
    seg->small = small;
    seg->backing_handle =
        static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(r));
    seg->owner = ss;
    Block* b = blocks_.New();
    b->address = seg->base;
    b->size = seg->size;
    b->segment = seg.get();
    b->state = BlockState::kFree;
    b->unmapped = true;
    seg->first = b;
    Bump(ss, &PoolStats::segment, small, 1);
    slot = seg.get();
    segments_.emplace(seg->base, std::move(seg));
    Index(b);
    return slot;
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
    Unindex(b);
    if (lo > b->address) {
      Block* mid = SplitBlock(b, lo - b->address, blocks_);
      Index(b);
      b = mid;
    }
    if (hi < b->end()) Index(SplitBlock(b, hi - b->address, blocks_));
    return b;
  }

  // Books [address, +bytes) of `seg` as newly mapped: stats and trace.
  void NoteMapped(Segment* seg, std::uint64_t address, std::size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    StreamState* ss = Owner(seg);
    Bump(ss, &PoolStats::reserved_bytes, seg->small,
         static_cast<std::int64_t>(bytes));
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
    b = SplitOut(b, lo, hi);
    b->unmapped = to_unmapped;
    b = Coalesce(b);
    Index(b);
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
    StreamState* ss = Owner(seg);
    Bump(ss, &PoolStats::reserved_bytes, seg->small,
         -static_cast<std::int64_t>(bytes));
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

  // Calls fn(run) for the whole granules under each mapped free block of
  // `ss` (large pool first, largest block first) that does not overlap
  // [skip_lo, skip_hi), until fn returns false. Walks the free indexes only
  // (never the allocated blocks), and stops at blocks under a granule.
  template <typename Fn>
  void ForFreeGranuleRuns(StreamState* ss, std::uint64_t skip_lo,
                          std::uint64_t skip_hi, Fn fn)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int pool : {1, 0}) {
      const Segment* seg = ss->range[pool];
      if (seg == nullptr) continue;
      const VmmRange* r = RangeOf(seg);
      if (r->mapped == 0) continue;
      for (Block* b = ss->free[pool].Last();
           b != nullptr && b->size >= granule_; b = FreeIndex<Block>::Prev(b)) {
        if (b->address < skip_hi && b->end() > skip_lo) continue;
        const std::size_t lo = (b->address - r->base + granule_ - 1) / granule_;
        const std::size_t hi = (b->end() - r->base) / granule_;
        if (lo >= hi) continue;
        if (!fn(GranuleRun{b, lo, hi})) return;
      }
    }
  }
  std::size_t FreeMappedBytes(StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t n = 0;
    ForFreeGranuleRuns(ss, 0, 0, [&](const GranuleRun& run) {
      n += (run.hi - run.lo) * granule_;
      return true;
    });
    return n;
  }

  // Whether the work queued on `ss` so far is done, without waiting.
  bool StreamIdleNow(StreamState* ss) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
  // that would pass it stays).
  absl::Status UnmapFreeGranules(StreamState* ss, std::size_t want, bool wait,
                                 int* waits, bool* busy, std::size_t* unmapped,
                                 std::uint64_t skip_lo = 0,
                                 std::uint64_t skip_hi = 0,
                                 std::size_t cap = kNoLimit)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Per block, the pieces to unmap: a contiguous span [lo, hi) of granules.
    absl::InlinedVector<GranuleRun, 8> todo;
    std::size_t bytes = 0;
    ForFreeGranuleRuns(ss, skip_lo, skip_hi, [&](const GranuleRun& run) {
      if (bytes >= want) return false;
      const VmmRange* r = RangeOf(run.block->segment);
      // The pieces wholly inside [run.lo, run.hi), in order.
      absl::InlinedVector<std::pair<std::size_t, std::size_t>, 8> pieces;
      r->ForEachPiece(run.lo, run.hi,
                      [&](std::size_t start, const VmmRange::Piece& p) {
                        if (start >= run.lo && start + p.count <= run.hi) {
                          pieces.emplace_back(start, start + p.count);
                        }
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
      }
      if (take.hi != 0) todo.push_back(take);
      return true;
    });
    if (todo.empty()) return absl::OkStatus();
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t got = 0;
    for (StreamState* x : TenantStreams(ss->tenant)) {
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
  // range's tail (the largest unmapped block) and up to kProbes unmapped
  // blocks from the smallest that could serve with both neighbours (4
  // granules under the request) upward: O(log n + kProbes).
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
  Placement Place(StreamState* ss, std::size_t rounded, bool small) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    constexpr int kProbes = 16;
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
    const std::size_t from =
        whole > 4 * granule_ ? whole - 4 * granule_ : granule_;
    int probes = 0;
    for (Block* u = index.LowerBound(from); u != nullptr && probes < kProbes;
         u = FreeIndex<Block>::Next(u), ++probes) {
      consider(u);
      if (best.u != nullptr && best.bytes() <= u->size && u->size >= whole) {
        break;  // larger blocks cannot map less
      }
    }
    if (Block* tail = index.Last()) consider(tail);
    return best;
  }
  // The addresses a placement uses: its run and the mapped free neighbours
  // it extends (Reclaim leaves them mapped).
  static std::pair<std::uint64_t, std::uint64_t> Span(const Placement& at) {
    std::uint64_t lo = at.lo, hi = at.hi;
    if (at.lo == at.u->address && MappedFree(at.u->prev)) {
      lo = at.u->prev->address;
    }
    if (at.hi == at.u->end() && MappedFree(at.u->next)) hi = at.u->next->end();
    return {lo, hi};
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
    // maps only itself; and nothing goes past the next block.
    if (at.hi == at.u->end() || classes_.SegmentBytes(rounded) <= at.bytes()) {
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
    const StreamState* ss = Owner(at.u->segment);
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
  absl::StatusOr<DevicePtr> AllocateExpandable(
      StreamState* ss, std::size_t rounded, std::size_t requested, bool small,
      OomReport* report, bool* oom) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    CTXPOOL_ASSIGN_OR_RETURN(Segment * seg, EnsureRange(ss, small));
    Placement at = Place(ss, rounded, small);
    auto exhausted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      ++num_alloc_retries_;
      *oom = true;
      return absl::ResourceExhaustedError("virtual range exhausted");
    };
    if (at.u == nullptr) return exhausted();
    const Tenant& t = *tenants_[ss->tenant];
    if (t.budget.max != kNoLimit &&
        TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
      // Over max: the tenant's own free granules move here first.
      std::size_t over = TenantMapped(ss->tenant) + at.bytes() - t.budget.max;
      const auto [skip_lo, skip_hi] = Span(at);
      for (StreamState* x : TenantStreams(ss->tenant)) {
        bool busy = false;
        std::size_t got = 0;
        UnmapFreeGranules(x, over, /*wait=*/false, nullptr, &busy, &got,
                          x == ss ? skip_lo : 0, x == ss ? skip_hi : 0)
            .IgnoreError();
        over -= std::min(over, got);
        if (over == 0) break;
      }
      at = Place(ss, rounded, small);
      if (at.u == nullptr) return exhausted();
      if (TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
        return TenantOom(ss, rounded, requested, at.bytes(), report, oom);
      }
    }
    absl::StatusOr<Block*> b = MapRun(seg, at.u, at.lo, MapAhead(at, rounded));
    if (!b.ok() && IsOutOfMemory(b.status())) {
      ++num_alloc_retries_;
      const std::size_t cached = CacheBytes();
      const auto [skip_lo, skip_hi] = Span(at);
      Reclaim(ss, at.bytes() > cached ? at.bytes() - cached : 0, skip_lo,
              skip_hi);
      at = Place(ss, rounded, small);  // Reclaim reshaped the blocks
      if (at.u == nullptr) return exhausted();
      if (t.budget.max != kNoLimit &&
          TenantMapped(ss->tenant) + at.bytes() > t.budget.max) {
        return TenantOom(ss, rounded, requested, at.bytes(), report, oom);
      }
      b = MapRun(seg, at.u, at.lo, at.hi);
    }
    if (!b.ok()) {
      if (IsOutOfMemory(b.status())) *oom = true;
      return b.status();
    }
    NotePeak(ss->tenant);
    // The remnant of a fresh mapping is kept apart even when small: the next
    // growth extends it (Place) instead of mapping a granule beside it.
    return TakeBlock(*b, rounded, requested, /*split_any=*/true);
  }

  absl::StatusOr<DevicePtr> Traced(absl::StatusOr<DevicePtr> p,
                                   std::size_t requested, StreamState* ss)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
                                         OomReport* report, bool* oom)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ScopedContext ctx(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(ctx.status());
    absl::StatusOr<DevicePtr> p =
        AllocateMiss(ss, rounded, requested, small, report, oom);
    TrimResult scratch;
    std::size_t busy = 0;
    if (!expandable_) ShedAllAboveHigh(&scratch, &busy).IgnoreError();
    DecayIdle(&scratch, &busy).IgnoreError();
    return p;
  }

  // Poll events, reuse another stream's wholly free segment, get a new
  // segment, or go through the OOM path. REQUIRES: context set.
  absl::StatusOr<DevicePtr> AllocateMiss(StreamState* ss, std::size_t rounded,
                                         std::size_t requested, bool small,
                                         OomReport* report, bool* oom)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!pending_.empty()) {
      PollPending();
      Block* b = FindFree(ss, rounded, small);
      if (b != nullptr) {
        ++cache_hits_;
        return TakeBlock(b, rounded, requested);
      }
    }
    if (expandable_) {
      absl::StatusOr<DevicePtr> p =
          AllocateExpandable(ss, rounded, requested, small, report, oom);
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
        return TakeBlock(fit, rounded, requested);
      }
      if (TenantMapped(ss->tenant) + segment_bytes > budget.max) {
        return TenantOom(ss, rounded, requested, segment_bytes, report, oom);
      }
    }
    // Without pressure a stream reuses only its own tenant's cached
    // segments: another tenant's cache is its own until the device runs out
    // (cgroup-like: reclaim happens under pressure, never below min).
    if (Segment* seg =
            FindStealable(ss, rounded, small,
                          [&](Segment* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                            return Owner(s)->tenant == ss->tenant;
                          })) {
      CTXPOOL_RETURN_IF_ERROR(MoveSegment(seg, ss));
      return TakeBlock(seg->first, rounded, requested);
    }
    absl::StatusOr<Block*> b = NewSegment(ss, segment_bytes, small);
    if (b.ok()) return TakeBlock(*b, rounded, requested);
    if (!IsOutOfMemory(b.status())) return b.status();

    // Out of memory: give back this stream's cached segments, wait for
    // pending frees, take another tenant's fitting free segment (above its
    // min), else give back everyone's above their min, and retry once.
    ++num_alloc_retries_;
    TrimResult scratch;
    std::size_t busy = 0;
    ReleaseCached(ss, 0, &scratch, &busy).IgnoreError();
    SyncPending(&scratch.event_waits);
    if (Block* fit = FindFree(ss, rounded, small)) {
      return TakeBlock(fit, rounded, requested);
    }
    CTXPOOL_ASSIGN_OR_RETURN(Segment * taken,
                             ReclaimSegment(ss, rounded, small));
    if (taken != nullptr) {
      NotePeak(ss->tenant);
      return TakeBlock(taken->first, rounded, requested);
    }
    const std::vector<std::size_t> before = MappedByTenant();
    ReleaseCached(nullptr, 0, &scratch, &busy, /*protect_min=*/true)
        .IgnoreError();
    const std::vector<std::size_t> after = MappedByTenant();
    for (std::size_t t = 0; t < before.size(); ++t) {
      if (t == ss->tenant || after[t] >= before[t]) continue;
      tenants_[t]->reclaimed_from += before[t] - after[t];
      tenants_[ss->tenant]->reclaimed_by += before[t] - after[t];
    }
    b = NewSegment(ss, segment_bytes, small);
    if (b.ok()) return TakeBlock(*b, rounded, requested);
    if (!IsOutOfMemory(b.status())) return b.status();

    *oom = true;
    FillReport(ss, rounded, requested, report);
    return absl::ResourceExhaustedError(report->ToString());
  }

  void FillReport(StreamState* ss, std::size_t rounded, std::size_t requested,
                  OomReport* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    report->requested_bytes = requested;
    report->rounded_bytes = rounded;
    report->tenant = tenants_[ss->tenant]->name;
    report->tenant_bytes = TenantMapped(ss->tenant);
    report->tenant_live_bytes = TenantLive(ss->tenant);
    report->stream = StreamHandle(ss->stream);
    report->live_bytes = Current(total_.allocated_bytes);
    report->reserved_bytes = Reserved();
    report->memory_limit_bytes = options_.memory_limit_bytes;
    // The free indexes hold mapped blocks only (unmapped virtual space is
    // not free memory), so the fragmentation stays in [0, 1].
    std::size_t largest = 0;
    for (const auto& [stream, state] : streams_) {
      for (const FreeIndex<Block>& index : state->free) {
        if (const Block* last = index.Last()) {
          largest = std::max(largest, last->size);
        }
      }
    }
    const std::size_t free_bytes = Reserved() - Current(total_.active_bytes);
    largest = std::min(largest, free_bytes);
    report->largest_free_bytes = largest;
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

  mutable core_internal::SpinLock mu_;
  BlockPool blocks_ ABSL_GUARDED_BY(mu_);
  absl::btree_map<std::uint64_t, std::unique_ptr<DeviceSegment>> segments_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, std::unique_ptr<StreamState>> streams_
      ABSL_GUARDED_BY(mu_);
  StreamState* last_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  FreeIndex<Segment> whole_free_[2] ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, Block*> live_ ABSL_GUARDED_BY(mu_);
  std::vector<PendingEvent> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<EventHandle> event_pool_ ABSL_GUARDED_BY(mu_);

  PoolStats total_ ABSL_GUARDED_BY(mu_);
  std::int64_t num_alloc_retries_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_ooms_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t cache_hits_ ABSL_GUARDED_BY(mu_) = 0;
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
  // The tag of the block TakeBlock hands out next (set by Allocate).
  OwnerId next_owner_ ABSL_GUARDED_BY(mu_) = kNoOwner;
  OwnerRec* next_owner_rec_ ABSL_GUARDED_BY(mu_) = nullptr;
  const char* next_label_ ABSL_GUARDED_BY(mu_) = nullptr;
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
        return absl::InternalError(absl::StrFormat(
            "I6: %s stat %s[%d].current is %d but the blocks sum to %d", who,
            kNames[i], p, gs.current, ws.current));
      }
      if (gs.current < 0 || gs.peak < gs.current ||
          gs.current != gs.allocated - gs.freed) {
        return absl::InternalError(absl::StrFormat(
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
  core_internal::SpinLockHolder lock(&mu_);
  PoolStats total;
  absl::flat_hash_map<std::uint64_t, PoolStats> per_stream;
  std::size_t free_blocks = 0;
  std::size_t whole_free_segments = 0;
  std::size_t blocks = 0;
  std::size_t allocated_blocks = 0;
  std::size_t pending_events = 0;
  std::size_t free_bytes = 0;
  std::size_t pending_bytes = 0;
  auto add = [&](std::uint64_t stream, StatArray PoolStats::*field, bool small,
                 std::int64_t n) {
    AddStat(total.*field, small, n);
    AddStat(per_stream[stream].*field, small, n);
  };
  for (const auto& [base, seg_ptr] : segments_) {
    const Segment& seg = *seg_ptr;
    if (seg.base != base) {
      return absl::InternalError(
          absl::StrFormat("segment keyed 0x%x has base 0x%x", base, seg.base));
    }
    CTXPOOL_RETURN_IF_ERROR(CheckSegmentTiling(seg));  // I1
    const StreamState* ss = Owner(&seg);
    auto sit = streams_.find(seg.stream);
    if (ss == nullptr || sit == streams_.end() || sit->second.get() != ss) {
      return absl::InternalError(
          absl::StrFormat("segment 0x%x: owner is not the state of stream 0x%x",
                          seg.base, seg.stream));
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
        return absl::InternalError(absl::StrFormat(
            "I9: range 0x%x has a bad or overlapping mapping", seg.base));
      }
      if (mapped != range->mapped || range->base != seg.base ||
          range->size != seg.size ||
          Owner(&seg)->range[PoolIndex(seg.small)] != &seg) {
        return absl::InternalError(
            absl::StrFormat("I9: range 0x%x maps %d bytes, books say %d",
                            seg.base, mapped, range->mapped));
      }
    }
    add(s, &PoolStats::reserved_bytes, seg.small,
        static_cast<std::int64_t>(range != nullptr ? range->mapped : seg.size));
    const bool whole = seg.wholly_free() && !expandable_;             // I10
    if (whole != whole_free_[PoolIndex(seg.small)].Contains(&seg)) {  // I3
      return absl::InternalError(absl::StrFormat(
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
      const auto size = static_cast<std::int64_t>(b->size);
      if (range != nullptr && !b->unmapped &&
          UnmappedBytes(&seg, b->address, b->size) != 0) {  // I9
        return absl::InternalError(absl::StrFormat(
            "I9: block 0x%x (%d bytes, state %d) is not unmapped yet lies on "
            "unmapped granules",
            b->address, b->size, static_cast<int>(b->state)));
      }
      if (b->unmapped &&
          (range == nullptr || b->state != BlockState::kFree ||
           (b->address - seg.base) % granule_ != 0 || b->size % granule_ != 0 ||
           MappedBytes(&seg, b->address, b->size) != 0)) {  // I11
        return absl::InternalError(absl::StrFormat(
            "I11: unmapped block 0x%x (%d bytes) is not free, not granule "
            "aligned or has mapped granules",
            b->address, b->size));
      }
      switch (b->state) {
        case BlockState::kAllocated: {
          ++allocated_blocks;
          auto it = live_.find(b->address);
          if (it == live_.end() || it->second != b || b->linked() ||
              b->requested > b->size || b->pending_events != 0) {  // I4
            return absl::InternalError(absl::StrFormat(
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
              live_.contains(b->address)) {  // I5
            return absl::InternalError(absl::StrFormat(
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
              return absl::InternalError(absl::StrFormat(
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
            return absl::InternalError(absl::StrFormat(
                "I2: free block 0x%x (%d bytes) is not in its stream's index "
                "under its key",
                b->address, b->size));
          }
          if (live_.contains(b->address)) {
            return absl::InternalError(
                absl::StrFormat("I4: free block 0x%x is live", b->address));
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
  for (const auto& [stream, ss] : streams_) {
    for (const FreeIndex<Block>* index :
         {&ss->free[0], &ss->free[1], &ss->unmapped[0], &ss->unmapped[1]}) {
      indexed += index->size();
      std::string error = index->Validate();
      if (!error.empty()) {
        return absl::InternalError(absl::StrFormat(
            "I2: free index of stream 0x%x: %s", stream, error));
      }
    }
    auto it = per_stream.find(stream);
    CTXPOOL_RETURN_IF_ERROR(
        CompareStats(it == per_stream.end() ? PoolStats() : it->second,
                     ss->stats, absl::StrFormat("stream 0x%x", stream)));
  }
  if (indexed != free_blocks) {  // I2: nothing else is indexed
    return absl::InternalError(absl::StrFormat(
        "I2: %d blocks indexed but %d free blocks", indexed, free_blocks));
  }
  std::size_t whole_indexed = 0;
  for (const FreeIndex<Segment>& index : whole_free_) {
    whole_indexed += index.size();
    std::string error = index.Validate();
    if (!error.empty()) {
      return absl::InternalError(
          absl::StrFormat("I3: whole-free index: %s", error));
    }
  }
  if (whole_indexed != whole_free_segments) {
    return absl::InternalError(
        absl::StrFormat("I3: %d segments indexed as wholly free, %d are",
                        whole_indexed, whole_free_segments));
  }
  if (live_.size() != allocated_blocks) {  // I4
    return absl::InternalError(
        absl::StrFormat("I4: %d live entries but %d allocated blocks",
                        live_.size(), allocated_blocks));
  }
  if (pending_.size() != pending_events) {  // I5
    return absl::InternalError(
        absl::StrFormat("I5: %d pending events queued, blocks expect %d",
                        pending_.size(), pending_events));
  }
  if (expandable_) {  // I12
    CTXPOOL_RETURN_IF_ERROR(vmm_.CheckInvariants(Reserved()));
  }
  for (const PendingEvent& p : pending_) {
    if (p.block->state != BlockState::kPendingFree) {
      return absl::InternalError(absl::StrFormat(
          "I5: pending event for block 0x%x that is not pending",
          p.block->address));
    }
  }
  CTXPOOL_RETURN_IF_ERROR(CompareStats(total, total_, "total"));  // I6
  const std::size_t reserved = Current(total_.reserved_bytes);
  const std::size_t allocated = Current(total_.allocated_bytes);
  if (!expandable_ &&
      reserved != allocated + pending_bytes + free_bytes) {  // I7
    return absl::InternalError(absl::StrFormat(
        "I7: reserved %d != allocated %d + pending %d + free %d", reserved,
        allocated, pending_bytes, free_bytes));
  }
  if (blocks_.live() != blocks) {  // I8
    return absl::InternalError(
        absl::StrFormat("I8: %d blocks from the arena, %d in segments",
                        blocks_.live(), blocks));
  }
  // I13: each owner's live charge and count are the sums over its blocks,
  // and only allocated blocks carry an owner of a registered slot.
  {
    std::vector<std::pair<std::size_t, std::int64_t>> sums(owners_.size());
    for (const auto& [address, b] : live_) {
      if (b->owner == kNoOwner) continue;
      if (b->owner > owners_.size() || owners_[b->owner - 1] == nullptr) {
        return absl::InternalError(absl::StrFormat(
            "I13: block 0x%x has unregistered owner %d", address, b->owner));
      }
      if (b->owner_data != owners_[b->owner - 1].get()) {
        return absl::InternalError(
            absl::StrFormat("I13: block 0x%x: owner record is not owner %d's",
                            address, b->owner));
      }
      sums[b->owner - 1].first += Charge(b->requested);
      ++sums[b->owner - 1].second;
    }
    for (std::size_t i = 0; i < owners_.size(); ++i) {
      const OwnerRec* o = owners_[i].get();
      if (o == nullptr) continue;
      if (o->live != sums[i].first ||
          o->allocs - o->frees - o->reclaimed != sums[i].second ||
          o->peak < o->live || (o->max != 0 && o->live > o->max)) {
        return absl::InternalError(absl::StrFormat(
            "I13: owner '%s' books %d B in %d blocks, its blocks hold %d B in "
            "%d (peak %d, max %d)",
            o->name, o->live, o->allocs - o->frees - o->reclaimed,
            sums[i].first, sums[i].second, o->peak, o->max));
      }
    }
  }
  // I14: the tenants' stream lists partition the streams by ss->tenant.
  {
    absl::flat_hash_set<const StreamState*> listed;
    for (std::size_t t = 0; t < tenants_.size(); ++t) {
      for (const StreamState* ss : tenants_[t]->streams) {
        if (!listed.insert(ss).second || ss->tenant != t ||
            !streams_.contains(ss->stream) ||
            streams_.at(ss->stream).get() != ss) {
          return absl::InternalError(absl::StrFormat(
              "I14: stream 0x%x is listed under tenant %d, bound to %d",
              ss->stream, t, ss->tenant));
        }
      }
    }
    if (listed.size() != streams_.size()) {
      return absl::InternalError(
          absl::StrFormat("I14: %d streams listed under tenants, %d known",
                          listed.size(), streams_.size()));
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
      return absl::FailedPreconditionError(absl::StrFormat(
          "BackingMode::kExpandable: device %d does not support virtual "
          "memory management; use BackingMode::kClassic",
          device));
    }
    CTXPOOL_ASSIGN_OR_RETURN(granule,
                             driver.MemGetAllocationGranularity(device));
    if (granule == 0 || !IsPowerOfTwo(granule)) {
      return absl::FailedPreconditionError(
          absl::StrFormat("bad VMM granularity %d", granule));
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
  return impl_->RegisterOwner(name, max_live_bytes);
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
