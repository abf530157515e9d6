// src/alloc/expandable_backing.h — the expandable (VMM) backing of
// CachingDeviceAllocator: virtual ranges, their granules' mappings, the
// physical allocations behind them and the cache of unmapped pieces
// (internal; not installed).
//
// A classic segment gets its memory in one piece (ClassicBacking, behind
// segment_backing.h). An expandable segment is a virtual range of a
// (stream, pool) (its first, or one of up to three more) whose 2 MiB granules
// are mapped and unmapped one run at a time, so this backing's interface is the
// range and its runs: Reserve a range, MapRun granules into it (cached pieces
// first, then new physical allocations), UnmapPiece one mapping back into the
// cache, Release or Decay the cache. The allocator keeps the block logic (which
// free block a run serves, what to reclaim) and the stats.
//
// Units and chunks. New memory is mapped in units of at most a power of two
// granules, one cuMemMap each. A unit is also the smallest amount that can
// move later: a mapping unmaps only whole. UnitGranules() sizes it from the
// headroom: at most 1/unit_divisor of the memory still free (capacity_bytes,
// or memory_limit_bytes when set, less what the backing holds). Far from the
// limit, units are large and a cold run costs a few maps (a 512 MiB tensor
// on an empty 80 GB device: 8; a huge run, 1 GiB or more, may use units up
// to 8 times coarser but at most 1/8 of itself); near it, units are single
// granules, huge runs' too, which is what lets every free granule move to
// where it is needed (the OOM frontier at the physical limit). Physical
// memory is created in chunks of up to chunk_units units (that tensor: one
// cuMemCreate; single granules stay single). Moving memory does not need a
// chunk to be whole: a unmapped unit is a cached piece (allocation, offset,
// count), mapped again anywhere, in the unit of the moment. Only giving memory
// back to the driver does: a chunk is released once none of it is mapped, so
// Trim and decay are as precise as the chunks.
//
//   ExpandableBacking vmm(driver, device, granule, options, now);
//   VmmRange* r = *vmm.Reserve(2 * device_bytes);
//   std::vector<StuckPiece> stuck;
//   CTXPOOL_RETURN_IF_ERROR(vmm.MapRun(r, 0, 3, &stuck));
//   std::size_t n = 0;
//   CTXPOOL_RETURN_IF_ERROR(vmm.UnmapPiece(r, 0, &n));  // one mapping cached
//   vmm.Release(/*keep_bytes=*/0, nullptr);              // what is whole
//
// Invariant (CheckInvariants, the allocator's I12): every physical
// allocation's granules are mapped, cached or leaked (dropped from the books
// while mapped after a forced Reset); the mapped ones are those of the
// ranges. Thread-compatible: the allocator's global lock (mu_) guards every
// call, with its context current for the driver calls.
#ifndef CTXPOOL_SRC_ALLOC_EXPANDABLE_BACKING_H_
#define CTXPOOL_SRC_ALLOC_EXPANDABLE_BACKING_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {
namespace alloc_internal {

// Expandable mode: the virtual range behind a segment and its mappings,
// by first granule. A mapping (a piece) maps `count` granules from granule
// `offset` of one physical allocation; the books cost one entry per piece,
// whatever its size, so host memory and every walk follow the number of
// mappings, not the granules mapped nor the range's size (twice the
// device's capacity). Nothing on the allocator's hot path reads it.
struct VmmRange {
  struct Piece {
    std::size_t count = 0;
    PhysicalMemHandle handle;
    std::uint32_t offset = 0;  // granule of `handle` mapped at the start
  };

  std::uint64_t base = 0;
  std::size_t size = 0;
  std::size_t mapped = 0;  // bytes
  // std::map, not absl::btree_map: an insert that throws std::bad_alloc
  // must leave it intact (absl's btree can leak or keep an empty root).
  std::map<std::size_t, Piece> pieces;

  // The piece that maps granule i (its first granule in *start), or null.
  const Piece* PieceAt(std::size_t i, std::size_t* start = nullptr) const {
    auto it = pieces.upper_bound(i);
    if (it == pieces.begin()) return nullptr;
    --it;
    if (it->first + it->second.count <= i) return nullptr;
    if (start != nullptr) *start = it->first;
    return &it->second;
  }
  bool IsMapped(std::size_t i) const { return PieceAt(i) != nullptr; }
  // Whether a mapping starts at granule i.
  bool IsStart(std::size_t i) const { return pieces.contains(i); }
  // The granule of the physical allocation mapped at granule i (REQUIRES:
  // mapped), and the allocation.
  std::uint32_t Offset(std::size_t i) const {
    std::size_t start = 0;
    const Piece* p = PieceAt(i, &start);
    return p == nullptr ? 0 : p->offset + static_cast<std::uint32_t>(i - start);
  }
  PhysicalMemHandle Handle(std::size_t i) const {
    const Piece* p = PieceAt(i);
    return p == nullptr ? PhysicalMemHandle() : p->handle;
  }
  // The end of the mapping that maps granule i, at most `limit`.
  // REQUIRES: i is mapped.
  std::size_t PieceEnd(std::size_t i, std::size_t limit) const {
    std::size_t start = 0;
    const Piece* p = PieceAt(i, &start);
    return p == nullptr ? i + 1 : std::min(start + p->count, limit);
  }
  // Granules [i, i + n) map granules [offset, offset + n) of `h`, as one
  // mapping. REQUIRES: they are unmapped.
  void SetRun(std::size_t i, std::size_t n, PhysicalMemHandle h,
              std::uint32_t offset) {
    pieces.emplace(i, Piece{n, h, offset});
  }
  // Forgets the mapping that starts at granule i and returns it.
  // REQUIRES: IsStart(i).
  Piece TakeRun(std::size_t i) {
    auto it = pieces.find(i);
    const Piece p = it->second;
    pieces.erase(it);
    return p;
  }
  // Calls fn(start, piece) for each mapping that overlaps granules [lo, hi),
  // in order; stops when fn returns false.
  template <typename Fn>
  void ForEachPiece(std::size_t lo, std::size_t hi, Fn fn) const {
    if (lo >= hi) return;
    auto it = pieces.upper_bound(lo);
    if (it != pieces.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second.count > lo) it = prev;
    }
    for (; it != pieces.end() && it->first < hi; ++it) {
      if (!fn(it->first, it->second)) return;
    }
  }
  // Calls fn(start, piece) for each mapping wholly inside [lo, hi), in
  // order (what can be unmapped there without touching granules outside).
  template <typename Fn>
  void ForEachPieceWithin(std::size_t lo, std::size_t hi, Fn fn) const {
    ForEachPiece(lo, hi, [&](std::size_t start, const Piece& p) {
      return start >= lo && start + p.count <= hi ? fn(start, p) : true;
    });
  }
  // Calls fn(i, handle) for each mapped granule i in [lo, hi), in order;
  // stops when fn returns false. Linear in the granules: for checks and
  // error paths.
  template <typename Fn>
  void ForEachMapped(std::size_t lo, std::size_t hi, Fn fn) const {
    bool go = true;
    ForEachPiece(lo, hi, [&](std::size_t start, const Piece& p) {
      const std::size_t a = std::max(lo, start);
      const std::size_t b = std::min(hi, start + p.count);
      for (std::size_t i = a; i < b && go; ++i) go = fn(i, p.handle);
      return go;
    });
  }
  // Mapped granules among [lo, hi).
  std::size_t CountMapped(std::size_t lo, std::size_t hi) const {
    std::size_t n = 0;
    ForEachPiece(lo, hi, [&](std::size_t start, const Piece& p) {
      n += std::min(hi, start + p.count) - std::max(lo, start);
      return true;
    });
    return n;
  }
  // Whether every granule in [lo, hi) is mapped.
  bool AllMapped(std::size_t lo, std::size_t hi) const {
    return lo >= hi || CountMapped(lo, hi) == hi - lo;
  }
};

// Expandable mode: granules [offset, offset + count) of physical
// allocation `handle`, mapped nowhere, kept for reuse (mapped anywhere as
// one cuMemMap with that offset, whole or in part).
struct CachedPiece {
  PhysicalMemHandle handle;
  std::uint32_t offset = 0;
  std::uint32_t count = 1;
  absl::Time since;
};

// Expandable mode: one cuMemCreate of `granules` granules. Its granules are
// mapped (in pieces, each its own cuMemMap) or in the cache; the driver
// frees it only when none is mapped and it is released, so Trim releases it
// whole once all of it is cached.
struct PhysChunk {
  std::uint32_t granules = 0;
  std::uint32_t mapped = 0;
  std::uint32_t leaked = 0;  // dropped from the books while mapped
};

// A piece a failed MapRun could neither give access to nor unmap: it stays
// mapped on the books at granules [granule, granule + count) of the range.
struct StuckPiece {
  std::size_t granule = 0;
  std::size_t count = 0;
  bool access = false;  // a retried cuMemSetAccess succeeded: usable
};

// What the backing did, for the allocator's Stats.
struct ExpandableCounters {
  std::int64_t creates = 0;   // cuMemCreate calls that succeeded
  std::int64_t releases = 0;  // cuMemRelease calls that succeeded
  std::int64_t granule_maps = 0;
  std::int64_t granule_unmaps = 0;
  std::int64_t driver_errors = 0;  // failures it recovered from
  std::size_t leaked_bytes = 0;
};

struct ExpandableOptions {
  // DeviceAllocatorOptions::vmm_unit_divisor: a unit is at most this
  // fraction of the headroom (0: always single granules).
  std::size_t unit_divisor = 1024;
  // DeviceAllocatorOptions::vmm_chunk_units: a new physical allocation is
  // at most this many units (single granules stay single).
  std::size_t chunk_units = 16;
  std::size_t memory_limit_bytes = 0;  // ...::memory_limit_bytes (0: none)
  // The memory the headroom is measured against when there is no limit:
  // the device's total memory.
  std::size_t capacity_bytes = 0;
};

class ExpandableBacking {
 public:
  ExpandableBacking(Driver& driver, int device, std::size_t granule,
                    ExpandableOptions options, std::function<absl::Time()> now)
      : driver_(driver),
        device_(device),
        granule_(granule),
        options_(options),
        now_(std::move(now)) {}
  ExpandableBacking(const ExpandableBacking&) = delete;
  ExpandableBacking& operator=(const ExpandableBacking&) = delete;

  std::size_t granule() const { return granule_; }
  const ExpandableCounters& counters() const { return counters_; }
  // Bytes of granules mapped in all ranges, and in the cache.
  std::size_t mapped_bytes() const { return mapped_granules_ * granule_; }
  std::size_t cache_bytes() const { return cache_granules_ * granule_; }

  // A new virtual range of `bytes` (a multiple of the granule), nothing
  // mapped. The backing owns it until Unreserve or Forget.
  absl::StatusOr<VmmRange*> Reserve(std::size_t bytes);
  // Gives the range's address space back. REQUIRES: nothing mapped in it.
  // On success `r` is gone; on failure it stays.
  absl::Status Unreserve(VmmRange* r);
  // Drops `r` from the books without a driver call: what it still maps is
  // counted as leaked (its physical allocations keep those granules).
  void Forget(VmmRange* r);

  // A run of at least kHugeRunBytes may map in units kHugeFactor times
  // coarser (at most kHugeFactor/unit_divisor of the headroom), but at most
  // 1/kHugeFactor of the run, where units are not single granules. See the
  // banner.
  static constexpr std::size_t kHugeRunBytes = std::size_t{1} << 30;
  static constexpr std::size_t kHugeFactor = 8;
  // Units and chunks are at most this many granules (pieces count granules
  // in 32 bits).
  static constexpr std::size_t kMaxPieceGranules = std::size_t{1} << 31;

  // The unit, in granules, for mapping `n` more granules now: the largest
  // power of two at most 1/unit_divisor of the headroom left after them
  // (those the cache supplies are held already; a huge run: see
  // kHugeRunBytes), at least 1. See the banner.
  std::size_t UnitGranules(std::size_t n) const;
  // The most granules one new physical allocation holds when the unit is
  // `unit`: chunk_units units, or one granule when units are single.
  std::size_t ChunkGranules(std::size_t unit) const {
    return unit <= 1 ? 1
                     : std::min(unit * options_.chunk_units, kMaxPieceGranules);
  }

  // Maps granules [i0, i0 + n) of `r` (all unmapped): cached pieces first
  // (most recently unmapped; the last one split if larger than what is
  // left), then new physical allocations of one chunk each
  // (ChunkGranules(UnitGranules(n)), the last one what is left; one the
  // device cannot supply whole falls back to a unit, then to single
  // granules). One cuMemMap per unit of each piece and one cuMemSetAccess
  // for the run.
  // Growth past memory_limit_bytes fails as the driver's out-of-memory
  // would. On failure everything is rolled back into the cache except the
  // pieces in *stuck, which could be neither given access nor unmapped and
  // stay mapped on the books (so that their addresses are never mapped
  // twice). A std::bad_alloc (host memory) leaves the books as they were:
  // the host memory is taken before the driver maps anything.
  absl::Status MapRun(VmmRange* r, std::size_t i0, std::size_t n,
                      std::vector<StuckPiece>* stuck);
  // Unmaps the mapping that starts at granule `i` of `r` into the cache;
  // *n = its granules. REQUIRES: no queued work uses it.
  absl::Status UnmapPiece(VmmRange* r, std::size_t i, std::size_t* n);
  // Room in the cache for `n` more pieces, so that caching them cannot
  // throw std::bad_alloc. Throws it with nothing changed.
  void ReserveCache(std::size_t n);

  // Releases cached physical allocations, oldest piece first, until at
  // most `keep_bytes` stay cached (adds the bytes freed to *freed). Only an
  // allocation none of which is mapped can be released — whole: the driver
  // frees nothing less. Linear in the cache.
  absl::Status Release(std::size_t keep_bytes, std::size_t* freed);
  // Releases the cached allocations all of whose cached pieces were
  // unmapped at or before `cutoff` (and none of which is mapped).
  absl::Status Decay(absl::Time cutoff, std::size_t* freed);
  // At destruction, context current: releases every physical allocation
  // once; what the driver refuses, or cannot free because part of it stays
  // mapped, is counted as leaked.
  void ReleaseAll();
  // At destruction without a context: the cache is leaked.
  void LeakAll();
  // At destruction, context current, when the allocator has no host memory
  // to drop its segments through the books: unmaps every mapping of every
  // range, frees the ranges' addresses and releases every physical
  // allocation, then forgets them all. Allocates nothing; what the driver
  // refuses is left to it.
  void TearDownInPlace();

  // I12; `reserved_bytes` is what the allocator books as mapped.
  absl::Status CheckInvariants(std::size_t reserved_bytes) const;

 private:
  void CachePiece(const CachedPiece& p) {
    cache_.push_back(p);
    cache_granules_ += p.count;
  }
  // Cached pieces, then new allocations of up to a chunk (the last one what
  // is left), for a run of `n` granules mapped in units of `unit`, in order.
  absl::Status AcquirePieces(std::size_t n, std::size_t unit,
                             std::vector<CachedPiece>* pieces);
  // Release's loop over the allocations `pick(handle)` accepts.
  template <typename Pick>
  absl::Status ReleaseWhere(std::size_t keep_bytes, std::size_t* freed,
                            Pick pick);
  // Books a mapping whose entry is in `r`: mapped counts and its chunk's.
  void NotePiece(VmmRange* r, const CachedPiece& p);

  absl::Time Now() const { return now_ ? now_() : absl::Now(); }

  Driver& driver_;
  const int device_;
  const std::size_t granule_;
  const ExpandableOptions options_;
  const std::function<absl::Time()> now_;
  std::map<std::uint64_t, std::unique_ptr<VmmRange>> ranges_;  // see pieces
  std::vector<CachedPiece> cache_;
  std::size_t cache_granules_ = 0;  // in cache_
  std::size_t mapped_granules_ = 0;
  // Every physical allocation not yet released, by handle.
  absl::flat_hash_map<std::uint64_t, PhysChunk> phys_;
  ExpandableCounters counters_;
};

}  // namespace alloc_internal
}  // namespace ctxpool

#endif  // CTXPOOL_SRC_ALLOC_EXPANDABLE_BACKING_H_
