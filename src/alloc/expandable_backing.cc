// The expandable (VMM) backing: see expandable_backing.h.
#include "expandable_backing.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/numeric/bits.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/internal/table_room.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/status.h"
#include "segment_backing.h"

namespace ctxpool {
namespace alloc_internal {
namespace {

bool IsOutOfMemory(const absl::Status& s) {
  std::optional<int> code = DriverErrorCode(s);
  return code.has_value() && *code == cu::kErrorOutOfMemory;
}

}  // namespace

absl::StatusOr<VmmRange*> ExpandableBacking::Reserve(std::size_t bytes) {
  auto r = std::make_unique<VmmRange>();
  CTXPOOL_ASSIGN_OR_RETURN(DevicePtr base,
                           driver_.MemAddressReserve(bytes, granule_));
  r->base = base.address();
  r->size = bytes;
  VmmRange* out = r.get();
  try {
    ranges_.emplace(r->base, std::move(r));
  } catch (...) {  // std::bad_alloc: the reservation is given back
    (void)driver_.MemAddressFree(base, bytes);
    throw;
  }
  return out;
}

absl::Status ExpandableBacking::Unreserve(VmmRange* r) {
  CTXPOOL_RETURN_IF_ERROR(driver_.MemAddressFree(DevicePtr(r->base), r->size));
  ranges_.erase(r->base);
  return absl::OkStatus();
}

void ExpandableBacking::Forget(VmmRange* r) {
  for (const auto& [start, p] : r->pieces) {
    PhysChunk& c = phys_[p.handle.value()];
    c.mapped -= static_cast<std::uint32_t>(p.count);
    c.leaked += static_cast<std::uint32_t>(p.count);
  }
  mapped_granules_ -= r->mapped / granule_;
  counters_.leaked_bytes += r->mapped;
  ranges_.erase(r->base);
}

std::size_t ExpandableBacking::UnitGranules(std::size_t n) const {
  if (options_.unit_divisor == 0) return 1;
  const std::size_t cap = options_.memory_limit_bytes != 0
                              ? options_.memory_limit_bytes
                              : options_.capacity_bytes;
  // What the backing holds after the run: what it maps and caches now, and
  // what the run needs beyond the cache (cached granules it maps are held
  // already, not again).
  const std::size_t fresh = n > cache_granules_ ? n - cache_granules_ : 0;
  const std::size_t held =
      (mapped_granules_ + cache_granules_ + fresh) * granule_;
  if (held >= cap) return 1;
  const std::size_t headroom = (cap - held) / granule_;
  std::size_t u = headroom / options_.unit_divisor;
  // A huge run goes coarser only where units are already coarse: near the
  // limit, where they are single granules, they stay so (every free granule
  // of the huge run must be able to move later).
  if (u >= 2 && n * granule_ >= kHugeRunBytes) {
    u = std::max(u, std::min(u * kHugeFactor, n / kHugeFactor));
  }
  return u <= 1 ? 1 : std::min(absl::bit_floor(u), kMaxPieceGranules);
}

absl::Status ExpandableBacking::AcquirePieces(
    std::size_t n, std::size_t unit, std::vector<CachedPiece>* pieces) {
  // Before each piece, room for it in `pieces` and, in the cache, for all
  // of them and a split's rest: the caller can always give them back
  // without allocating (std::bad_alloc, see MapRun).
  auto room = [&] {
    core_internal::MakeVectorRoom(*pieces, 1);
    ReserveCache(pieces->size() + 2);
  };
  std::size_t got = 0;
  while (got < n && !cache_.empty()) {
    room();
    CachedPiece p = cache_.back();
    cache_.pop_back();
    cache_granules_ -= p.count;
    if (p.count > n - got) {  // keep the rest cached
      const auto use = static_cast<std::uint32_t>(n - got);
      CachePiece({p.handle, p.offset + use, p.count - use, p.since});
      p.count = use;
    }
    got += p.count;
    pieces->push_back(p);
  }
  if (got == n) return absl::OkStatus();
  const std::size_t cached = got;
  CTXPOOL_RETURN_IF_ERROR(
      CheckMemoryLimit("cuMemCreate", options_.memory_limit_bytes,
                       (mapped_granules_ + cache_granules_ + got) * granule_,
                       (n - got) * granule_));
  // One allocation per chunk, counted from the run's start.
  std::size_t chunk = ChunkGranules(unit);
  while (got < n) {
    const auto count = static_cast<std::uint32_t>(
        std::min(chunk - (got - cached) % chunk, n - got));
    room();
    core_internal::MakeRoom(phys_, 1);  // before the driver holds anything
    absl::StatusOr<PhysicalMemHandle> created =
        driver_.MemCreate(count * granule_, device_);
    if (!created.ok()) {
      // A chunk the device cannot supply in one piece may still fit in
      // units, and a unit in granules: the rest goes smaller before the
      // caller reclaims.
      if (count > 1 && IsOutOfMemory(created.status())) {
        chunk = count > unit ? unit : 1;
        continue;
      }
      return created.status();
    }
    ++counters_.creates;
    phys_.emplace(created->value(), PhysChunk{count, 0, 0});
    pieces->push_back({*created, 0, count, Now()});
    got += count;
  }
  return absl::OkStatus();
}

void ExpandableBacking::NotePiece(VmmRange* r, const CachedPiece& p) {
  r->mapped += p.count * granule_;
  mapped_granules_ += p.count;
  counters_.granule_maps += p.count;
  phys_.find(p.handle.value())->second.mapped += p.count;
}

void ExpandableBacking::ReserveCache(std::size_t n) {
  core_internal::MakeVectorRoom(cache_, n);
}

absl::Status ExpandableBacking::MapRun(VmmRange* r, std::size_t i0,
                                       std::size_t n,
                                       std::vector<StuckPiece>* stuck) {
  const std::uint64_t lo = r->base + i0 * granule_;
  const std::uint64_t bytes = n * granule_;
  const std::size_t unit = UnitGranules(n);
  // Host memory before the driver maps anything: a std::bad_alloc gives
  // the pieces taken back to the cache (AcquirePieces made room for them)
  // and leaves the books as they were.
  std::vector<CachedPiece> pieces;
  std::vector<CachedPiece> maps;
  absl::Status s;
  try {
    s = AcquirePieces(n, unit, &pieces);
    if (s.ok()) {
      maps.reserve(pieces.size() + n / unit + 1);
      stuck->reserve(stuck->size() + maps.capacity());
      ReserveCache(maps.capacity());  // a rollback caches mappings
    }
  } catch (...) {
    for (const CachedPiece& p : pieces) CachePiece(p);
    throw;
  }
  if (!s.ok()) {
    for (const CachedPiece& p : pieces) CachePiece(p);
    return s;
  }
  // One mapping per piece, a cached piece larger than the unit of the
  // moment cut into units.
  for (const CachedPiece& p : pieces) {
    for (std::uint32_t k = 0; k < p.count;) {
      const auto c =
          static_cast<std::uint32_t>(std::min<std::size_t>(unit, p.count - k));
      maps.push_back({p.handle, p.offset + k, c, p.since});
      k += c;
    }
  }
  // The range's entries before the driver maps anything.
  std::size_t entered = 0;
  try {
    for (std::size_t i = i0; entered < maps.size(); ++entered) {
      const CachedPiece& p = maps[entered];
      r->SetRun(i, p.count, p.handle, p.offset);
      i += p.count;
    }
  } catch (...) {
    for (std::size_t k = 0, i = i0; k < entered; ++k) {
      r->TakeRun(i);
      i += maps[k].count;
    }
    for (const CachedPiece& p : pieces) CachePiece(p);
    throw;
  }
  std::size_t done = 0;  // mappings made
  std::uint64_t at = lo;
  for (; done < maps.size(); ++done) {
    const CachedPiece& p = maps[done];
    s = driver_.MemMap(DevicePtr(at), p.count * granule_, p.offset * granule_,
                       p.handle);
    if (!s.ok()) break;
    at += p.count * granule_;
  }
  if (s.ok()) {
    s = driver_.MemSetAccess(DevicePtr(lo), bytes, device_);
    if (!s.ok()) ++counters_.driver_errors;
  }
  if (s.ok()) {
    for (const CachedPiece& p : maps) NotePiece(r, p);
    return absl::OkStatus();
  }
  // Roll back (one retry per unmap); keep the pieces for the next growth.
  at = lo;
  for (std::size_t k = 0; k < maps.size(); ++k) {
    const CachedPiece& p = maps[k];
    const DevicePtr where(at);
    const std::size_t g = (at - r->base) / granule_;
    at += p.count * granule_;
    if (k >= done || driver_.MemUnmap(where, p.count * granule_).ok() ||
        driver_.MemUnmap(where, p.count * granule_).ok()) {
      r->TakeRun(g);
      CachePiece(p);
      continue;
    }
    ++counters_.driver_errors;
    const bool access =
        driver_.MemSetAccess(where, p.count * granule_, device_).ok();
    if (!access) ++counters_.driver_errors;
    NotePiece(r, p);
    stuck->push_back({g, p.count, access});
  }
  return s;
}

absl::Status ExpandableBacking::UnmapPiece(VmmRange* r, std::size_t i,
                                           std::size_t* n) {
  if (!r->IsMapped(i) || !r->IsStart(i)) {
    return absl::InternalError(core_internal::Format(
        "granule %d of range 0x%x does not start a mapping", i, r->base));
  }
  const std::size_t end = r->PieceEnd(i, r->size / granule_);
  const std::size_t count = end - i;
  ReserveCache(1);  // std::bad_alloc before the driver call, not after
  CTXPOOL_RETURN_IF_ERROR(
      driver_.MemUnmap(DevicePtr(r->base + i * granule_), count * granule_));
  const VmmRange::Piece p = r->TakeRun(i);
  CachePiece({p.handle, p.offset, static_cast<std::uint32_t>(count), Now()});
  phys_.find(p.handle.value())->second.mapped -=
      static_cast<std::uint32_t>(count);
  r->mapped -= count * granule_;
  mapped_granules_ -= count;
  counters_.granule_unmaps += static_cast<std::int64_t>(count);
  *n = count;
  return absl::OkStatus();
}

template <typename Pick>
absl::Status ExpandableBacking::ReleaseWhere(std::size_t keep_bytes,
                                             std::size_t* freed, Pick pick) {
  absl::Status first;
  if (cache_.empty()) return first;
  const std::size_t keep = keep_bytes / granule_;
  // Room for every handle first: an insert that grew the set after a
  // release could throw and leave it corrupt (table_room.h).
  absl::flat_hash_set<std::uint64_t> released;
  core_internal::MakeRoom(released, cache_.size());
  std::size_t left = cache_granules_;
  for (const CachedPiece& p : cache_) {
    if (left <= keep) break;
    if (released.contains(p.handle.value()) || !pick(p.handle.value())) {
      continue;
    }
    auto it = phys_.find(p.handle.value());
    if (it == phys_.end() || it->second.mapped != 0) continue;
    absl::Status st = driver_.MemRelease(p.handle);
    if (!st.ok()) {
      first.Update(st);
      break;
    }
    released.insert(p.handle.value());
    const std::size_t cached = it->second.granules - it->second.leaked;
    left -= std::min(left, cached);
    ++counters_.releases;
    if (it->second.leaked != 0) {
      // Granules stuck mapped keep the whole allocation alive: what was
      // cached is leaked with them, not freed.
      counters_.leaked_bytes += cached * granule_;
    } else if (freed != nullptr) {
      *freed += cached * granule_;
    }
    phys_.erase(it);
  }
  if (released.empty()) return first;
  // One pass drops every piece of what was released.
  std::size_t kept = 0;
  cache_granules_ = 0;
  for (const CachedPiece& p : cache_) {
    if (released.contains(p.handle.value())) continue;
    cache_[kept++] = p;
    cache_granules_ += p.count;
  }
  cache_.resize(kept);
  return first;
}

absl::Status ExpandableBacking::Release(std::size_t keep_bytes,
                                        std::size_t* freed) {
  return ReleaseWhere(keep_bytes, freed, [](std::uint64_t) { return true; });
}

absl::Status ExpandableBacking::Decay(absl::Time cutoff, std::size_t* freed) {
  if (cache_.empty()) return absl::OkStatus();
  absl::flat_hash_set<std::uint64_t> fresh;  // a piece newer than cutoff
  core_internal::MakeRoom(fresh, cache_.size());
  for (const CachedPiece& p : cache_) {
    if (p.since > cutoff) fresh.insert(p.handle.value());
  }
  // Only the stale: a stale allocation that cannot go (part of it mapped)
  // is no reason to release a fresh one.
  return ReleaseWhere(
      0, freed, [&](std::uint64_t handle) { return !fresh.contains(handle); });
}

void ExpandableBacking::ReleaseAll() {
  for (const auto& [handle, chunk] : phys_) {
    const std::size_t cached = chunk.granules - chunk.mapped - chunk.leaked;
    if (driver_.MemRelease(PhysicalMemHandle(handle)).ok()) {
      ++counters_.releases;
      // One with granules stuck mapped is not freed by its release either.
      if (chunk.leaked != 0) counters_.leaked_bytes += cached * granule_;
    } else {
      counters_.leaked_bytes += cached * granule_;
    }
  }
  phys_.clear();
  cache_.clear();
  cache_granules_ = 0;
}

void ExpandableBacking::TearDownInPlace() {
  for (const auto& [base, r] : ranges_) {
    for (const auto& [start, piece] : r->pieces) {
      driver_
          .MemUnmap(DevicePtr(r->base + start * granule_),
                    piece.count * granule_)
          .IgnoreError();
    }
    driver_.MemAddressFree(DevicePtr(r->base), r->size).IgnoreError();
  }
  ranges_.clear();
  mapped_granules_ = 0;
  ReleaseAll();
}

void ExpandableBacking::LeakAll() {
  counters_.leaked_bytes += cache_bytes();
  phys_.clear();
  cache_.clear();
  cache_granules_ = 0;
}

absl::Status ExpandableBacking::CheckInvariants(
    std::size_t reserved_bytes) const {
  std::size_t cached = 0;
  for (const CachedPiece& p : cache_) {
    auto it = phys_.find(p.handle.value());
    if (p.count == 0 || it == phys_.end() ||
        p.offset + p.count > it->second.granules) {
      return absl::InternalError(core_internal::Format(
          "I12: cached piece of 0x%x [%d, +%d) is not inside a live "
          "physical allocation",
          p.handle.value(), p.offset, p.count));
    }
    cached += p.count;
  }
  std::size_t total = 0, mapped = 0, leaked = 0;
  for (const auto& [handle, chunk] : phys_) {
    total += chunk.granules;
    mapped += chunk.mapped;
    leaked += chunk.leaked;
  }
  std::size_t in_ranges = 0;
  for (const auto& [base, r] : ranges_) {
    in_ranges += r->mapped;
    for (const auto& [start, p] : r->pieces) {
      auto it = phys_.find(p.handle.value());
      if (it == phys_.end() || p.offset + p.count > it->second.granules) {
        return absl::InternalError(core_internal::Format(
            "I12: the mapping at granule %d of range 0x%x is not inside a "
            "live physical allocation",
            start, base));
      }
    }
  }
  if (cached != cache_granules_ || mapped != mapped_granules_ ||
      mapped * granule_ != reserved_bytes || in_ranges != reserved_bytes ||
      total != mapped + cached + leaked) {
    return absl::InternalError(core_internal::Format(
        "I12: physical allocations hold %d granules, %d mapped (books: %d "
        "bytes, ranges: %d) and %d cached (books: %d), %d leaked",
        total, mapped, reserved_bytes, in_ranges, cached, cache_granules_,
        leaked));
  }
  return absl::OkStatus();
}

}  // namespace alloc_internal
}  // namespace ctxpool
