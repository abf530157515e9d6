// ctxpool/core/stats.h — PyTorch-shaped allocator statistics.
//
// Every allocator reports the same shapes: a `Stat` is a counter with its
// current value, its peak, and the running totals of increments and
// decrements; a `StatArray` holds one Stat for the aggregate and one per pool
// (small, large); `PoolStats` groups the StatArrays that PyTorch's
// torch.cuda.memory_stats() reports, so dashboards built for PyTorch read
// ctxpool unchanged.
//
//   PoolStats stats;
//   AddStat(stats.allocated_bytes, /*small=*/true, 512);   // a 512 B block
//   stats.allocated_bytes[StatIndex(StatPool::kSmall)].current;  // 512
//   stats.allocated_bytes[StatIndex(StatPool::kAggregate)].peak; // 512
//
// Invariants (for every Stat s): s.current == s.allocated − s.freed,
// s.peak >= s.current, and for every StatArray a:
// a[kAggregate].current == a[kSmall].current + a[kLarge].current.
//
// Thread-compatible: callers serialise access (the allocators hold their
// lock).
#ifndef CTXPOOL_CORE_STATS_H_
#define CTXPOOL_CORE_STATS_H_

#include <array>
#include <cstdint>

#include "absl/base/attributes.h"

namespace ctxpool {

// One PyTorch-shaped statistic.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total increments
  std::int64_t freed = 0;      // total decrements
  // REQUIRES: n >= 0.
  void Add(std::int64_t n) {
    current += n;
    allocated += n;
    if (current > peak) peak = current;
  }
  // REQUIRES: 0 <= n <= current.
  void Sub(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void ResetPeak() { peak = current; }
};

// Index into StatArray: aggregate, small pool, large pool.
enum class StatPool : int { kAggregate = 0, kSmall = 1, kLarge = 2 };
using StatArray = std::array<Stat, 3>;

constexpr int StatIndex(StatPool pool) { return static_cast<int>(pool); }

// Adds `n` (may be negative) to the aggregate and to the small or large pool.
// (Always inlined: the allocators' cached paths make a dozen of these.)
ABSL_ATTRIBUTE_ALWAYS_INLINE inline void AddStat(StatArray& stats, bool small,
                                                 std::int64_t n) {
  Stat& pool = stats[small ? 1 : 2];
  if (n >= 0) {
    stats[0].Add(n);
    pool.Add(n);
  } else {
    stats[0].Sub(-n);
    pool.Sub(-n);
  }
}

// The statistics of one pool set (a whole allocator, or one stream).
struct PoolStats {
  StatArray allocation;       // live blocks (count)
  StatArray segment;          // segments (count)
  StatArray active;           // allocated or pending-free blocks (count)
  StatArray inactive_split;   // free blocks inside partly used segments
  StatArray allocated_bytes;  // bytes of live blocks (rounded)
  StatArray requested_bytes;  // bytes callers asked for
  StatArray reserved_bytes;   // bytes of segments
  StatArray active_bytes;
  StatArray inactive_split_bytes;

  // Calls f(StatArray&) (or f(const StatArray&)) for every member, in
  // declaration order.
  template <typename F>
  void ForEach(F&& f) {
    f(allocation);
    f(segment);
    f(active);
    f(inactive_split);
    f(allocated_bytes);
    f(requested_bytes);
    f(reserved_bytes);
    f(active_bytes);
    f(inactive_split_bytes);
  }
  template <typename F>
  void ForEach(F&& f) const {
    f(allocation);
    f(segment);
    f(active);
    f(inactive_split);
    f(allocated_bytes);
    f(requested_bytes);
    f(reserved_bytes);
    f(active_bytes);
    f(inactive_split_bytes);
  }
  // Sets every peak to its current value.
  void ResetPeaks() {
    ForEach([](StatArray& a) {
      for (Stat& s : a) s.ResetPeak();
    });
  }
};

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_STATS_H_
