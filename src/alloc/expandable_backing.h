// src/alloc/expandable_backing.h — the expandable (VMM) backing of
// CachingDeviceAllocator: virtual ranges, their granules' mappings, the
// physical allocations behind them and the cache of unmapped pieces
// (internal; not installed).
//
// A classic segment gets its memory in one piece (ClassicBacking, behind
// segment_backing.h). An expandable segment is one virtual range per
// (stream, pool) whose 2 MiB granules are mapped and unmapped one run at a
// time, so this backing's interface is the range and its runs: Reserve a
// range, MapRun granules into it (cached pieces first, then new physical
// allocations: chunks for large runs), UnmapPiece one mapping back into the
// cache, Release or Decay the cache. The allocator keeps the block logic
// (which free block a run serves, what to reclaim) and the stats.
//
//   ExpandableBacking vmm(driver, device, granule, options, now);
//   VmmRange* r = *vmm.Reserve(2 * device_bytes);
//   std::vector<StuckPiece> stuck;
//   CTXPOOL_RETURN_IF_ERROR(vmm.MapRun(r, 0, 3, /*small=*/false, &stuck));
//   std::size_t n = 0;
//   CTXPOOL_RETURN_IF_ERROR(vmm.UnmapPiece(r, 0, &n));  // granule 0 cached
//   vmm.Release(/*keep_bytes=*/0, nullptr);              // what is whole
//
// Invariant (CheckInvariants, the allocator's I12): every physical
// allocation's granules are mapped, cached or leaked (dropped from the books
// while mapped after a forced Reset); the mapped ones are those of the
// ranges. Thread-compatible: the allocator's lock guards every call, with
// its context current for the driver calls.
#ifndef CTXPOOL_SRC_ALLOC_EXPANDABLE_BACKING_H_
#define CTXPOOL_SRC_ALLOC_EXPANDABLE_BACKING_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/container/btree_map.h"
#include "absl/container/flat_hash_map.h"
#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {
namespace alloc_internal {

// Expandable mode: the virtual range behind a segment and its granules.
// The granules' physical handles sit in a sparse two-level table: chunks of
// 64 granules (a bit mask and the handles), only for chunks with a mapped
// granule, so host memory and every walk follow the mapped bytes, not the
// range's size (twice the device's capacity). A one-chunk hint keeps the
// hot path's "is this block mapped" check O(1).
struct VmmRange {
  static constexpr std::size_t kChunk = 64;
  struct Chunk {
    std::uint64_t bits = 0;    // bit k: granule chunk * 64 + k is mapped
    std::uint64_t starts = 0;  // bit k: ... and starts a mapping (a piece)
    std::array<PhysicalMemHandle, kChunk> handles;
    std::array<std::uint32_t, kChunk> offsets = {};  // granule in the handle
  };

  std::uint64_t base = 0;
  std::size_t size = 0;
  std::size_t mapped = 0;  // bytes
  absl::btree_map<std::size_t, std::unique_ptr<Chunk>> chunks;

  bool IsMapped(std::size_t i) const {
    const Chunk* c = Find(i / kChunk);
    return c != nullptr && ((c->bits >> (i % kChunk)) & 1) != 0;
  }
  // Granule i maps granule `offset` of `h`; `start`: it begins a mapping.
  void Set(std::size_t i, PhysicalMemHandle h, std::uint32_t offset,
           bool start) {
    std::unique_ptr<Chunk>& c = chunks[i / kChunk];
    if (c == nullptr) c = std::make_unique<Chunk>();
    const std::uint64_t bit = std::uint64_t{1} << (i % kChunk);
    c->bits |= bit;
    if (start) c->starts |= bit;
    c->handles[i % kChunk] = h;
    c->offsets[i % kChunk] = offset;
  }
  bool IsStart(std::size_t i) const {
    const Chunk* c = Find(i / kChunk);
    return c != nullptr && ((c->starts >> (i % kChunk)) & 1) != 0;
  }
  std::uint32_t Offset(std::size_t i) const {
    const Chunk* c = Find(i / kChunk);
    return c == nullptr ? 0 : c->offsets[i % kChunk];
  }
  // The end of the mapping that starts at granule i: the next start or
  // unmapped granule, at most `limit`.
  std::size_t PieceEnd(std::size_t i, std::size_t limit) const {
    std::size_t j = i + 1;
    while (j < limit && IsMapped(j) && !IsStart(j)) ++j;
    return j;
  }
  // Removes granule i's entry and returns its handle (null if unmapped).
  PhysicalMemHandle Take(std::size_t i) {
    auto it = chunks.find(i / kChunk);
    if (it == chunks.end()) return PhysicalMemHandle();
    Chunk& c = *it->second;
    const std::uint64_t bit = std::uint64_t{1} << (i % kChunk);
    if ((c.bits & bit) == 0) return PhysicalMemHandle();
    const PhysicalMemHandle h = c.handles[i % kChunk];
    c.bits &= ~bit;
    c.starts &= ~bit;
    c.handles[i % kChunk] = PhysicalMemHandle();
    c.offsets[i % kChunk] = 0;
    if (c.bits == 0) {
      if (hint_ == it->second.get()) hint_ = nullptr;
      chunks.erase(it);
    }
    return h;
  }
  // Calls fn(i, handle) for each mapped granule i in [lo, hi), in order;
  // stops when fn returns false.
  template <typename Fn>
  void ForEachMapped(std::size_t lo, std::size_t hi, Fn fn) const {
    if (lo >= hi) return;
    for (auto it = chunks.lower_bound(lo / kChunk);
         it != chunks.end() && it->first * kChunk < hi; ++it) {
      std::uint64_t bits = it->second->bits;
      while (bits != 0) {
        const int k = absl::countr_zero(bits);
        bits &= bits - 1;
        const std::size_t i = it->first * kChunk + static_cast<std::size_t>(k);
        if (i < lo) continue;
        if (i >= hi) return;
        if (!fn(i, it->second->handles[static_cast<std::size_t>(k)])) return;
      }
    }
  }
  // Whether every granule in [lo, hi) is mapped: the hot path's check, a
  // mask test when the range lies in one chunk (the common case).
  bool AllMapped(std::size_t lo, std::size_t hi) const {
    if (lo >= hi) return true;
    if (ABSL_PREDICT_TRUE(lo / kChunk == (hi - 1) / kChunk)) {
      const Chunk* c = Find(lo / kChunk);
      if (c == nullptr) return false;
      const std::uint64_t mask = MaskOf(lo, hi);
      return (c->bits & mask) == mask;
    }
    return CountMapped(lo, hi) == hi - lo;
  }
  // Mapped granules among [lo, hi).
  std::size_t CountMapped(std::size_t lo, std::size_t hi) const {
    if (lo >= hi) return 0;
    if (lo / kChunk == (hi - 1) / kChunk) {  // one chunk: the hot path
      const Chunk* c = Find(lo / kChunk);
      if (c == nullptr) return 0;
      return static_cast<std::size_t>(absl::popcount(c->bits & MaskOf(lo, hi)));
    }
    std::size_t n = 0;
    ForEachMapped(lo, hi, [&n](std::size_t, PhysicalMemHandle) {
      ++n;
      return true;
    });
    return n;
  }

 private:
  // The bits of granules [lo, hi) within their chunk. REQUIRES: one chunk.
  static std::uint64_t MaskOf(std::size_t lo, std::size_t hi) {
    const std::size_t width = hi - lo;
    return (width == kChunk ? ~std::uint64_t{0}
                            : ((std::uint64_t{1} << width) - 1))
           << (lo % kChunk);
  }
  const Chunk* Find(std::size_t chunk) const {
    if (hint_ != nullptr && hint_index_ == chunk) return hint_;
    auto it = chunks.find(chunk);
    if (it == chunks.end()) return nullptr;
    hint_index_ = chunk;
    hint_ = it->second.get();
    return hint_;
  }
  // The chunk last found (the allocator's lock guards the range, so the
  // const lookups may update it).
  mutable std::size_t hint_index_ = 0;
  mutable Chunk* hint_ = nullptr;
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
  std::size_t chunk_bytes = 64
                            << 20;  // DeviceAllocatorOptions::vmm_chunk_bytes
  bool map_whole_chunks = false;    // ...::vmm_map_whole_chunks
  std::size_t memory_limit_bytes = 0;  // ...::memory_limit_bytes (0: none)
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

  // Maps granules [i0, i0 + n) of `r` (all unmapped): cached pieces first
  // (most recently unmapped; the last one split if larger than what is
  // left), then new physical allocations — one granule each, except that a
  // large-pool (`!small`) rest of three granules or more gets chunks of up
  // to chunk_bytes in its interior (one cuMemCreate each), its first and
  // last granules single, and a chunk the device cannot supply falls back
  // to granules. One cuMemMap per granule (per piece with
  // map_whole_chunks) and one cuMemSetAccess for the run. Growth past
  // memory_limit_bytes fails as the driver's out-of-memory would. On
  // failure everything is rolled back into the cache except the pieces in
  // *stuck, which could be neither given access nor unmapped and stay
  // mapped on the books (so that their addresses are never mapped twice).
  absl::Status MapRun(VmmRange* r, std::size_t i0, std::size_t n, bool small,
                      std::vector<StuckPiece>* stuck);
  // Unmaps the mapping that starts at granule `i` of `r` into the cache;
  // *n = its granules. REQUIRES: no queued work uses it.
  absl::Status UnmapPiece(VmmRange* r, std::size_t i, std::size_t* n);

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

  // I12; `reserved_bytes` is what the allocator books as mapped.
  absl::Status CheckInvariants(std::size_t reserved_bytes) const;

 private:
  void CachePiece(const CachedPiece& p) {
    cache_.push_back(p);
    cache_granules_ += p.count;
  }
  absl::Status AcquirePieces(std::size_t n, bool small,
                             std::vector<CachedPiece>* pieces);
  // Release's loop over the allocations `pick(handle)` accepts.
  template <typename Pick>
  absl::Status ReleaseWhere(std::size_t keep_bytes, std::size_t* freed,
                            Pick pick);
  void NotePiece(VmmRange* r, std::size_t i, const CachedPiece& p);
  absl::Time Now() const { return now_ ? now_() : absl::Now(); }

  Driver& driver_;
  const int device_;
  const std::size_t granule_;
  const ExpandableOptions options_;
  const std::function<absl::Time()> now_;
  absl::btree_map<std::uint64_t, std::unique_ptr<VmmRange>> ranges_;
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
