// ctxpool/driver/internal/sim_race_detector.h — SimDriver's shadow memory for
// the stream-race detector. Not API: only sim_driver.cc and its tests use it.
//
// Happens-before between operations on simulated streams is tracked with
// vector clocks: stream i's clock C has C[i] = the number of operations
// enqueued on stream i, and C[j] = the last operation of stream j that is
// ordered before stream i's next operation (by an event wait, a legacy
// default stream barrier, or a host synchronisation). An access A by stream t
// at epoch e = A's C[t] is ordered before an access B with clock C exactly
// when e <= C[t].
//
// RaceShadow keeps, for disjoint address segments, the last access of each
// stream that is not yet known to be ordered before everything that follows:
//
//   RaceShadow shadow;
//   std::vector<RaceShadow::Conflict> conflicts;
//   shadow.Access(0x1000, 0x2000, /*stream=*/0, clock_a, host, &conflicts);
//   shadow.Access(0x1800, 0x1900, /*stream=*/1, clock_b, host, &conflicts);
//   // conflicts holds stream 0's access unless clock_b[0] >= clock_a[0].
//
// Dropping an earlier access A once a later access B is ordered after it
// loses no race: any later X unordered with A is unordered with B too (else
// A -> B -> X). So each segment holds at most one entry per stream, and
// segments fully overwritten by one ordered access collapse into one. Entries
// the host has synchronised past are pruned when the map grows.
//
// Thread-compatible: SimDriver calls it with its mutex held.
#ifndef CTXPOOL_DRIVER_INTERNAL_SIM_RACE_DETECTOR_H_
#define CTXPOOL_DRIVER_INTERNAL_SIM_RACE_DETECTOR_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/btree_map.h"
#include "absl/container/inlined_vector.h"

namespace ctxpool {
namespace sim_internal {

using VectorClock = std::vector<std::uint64_t>;

// Component `i` of `clock` (missing components are 0).
inline std::uint64_t ClockAt(const VectorClock& clock, std::uint32_t i) {
  return i < clock.size() ? clock[i] : 0;
}

// into = max(into, from) component-wise. Returns true when `into` changed.
bool JoinClock(VectorClock& into, const VectorClock& from);

class RaceShadow {
 public:
  // An earlier access found unordered with the current one.
  struct Conflict {
    std::uint64_t lo = 0;
    std::uint64_t hi = 0;
    std::uint32_t stream = 0;
    std::uint64_t epoch = 0;
  };

  // Records an access to [lo, hi) by `stream` whose clock is `clock` (which
  // already includes `host`), and appends each earlier access of another
  // stream to an overlapping range that is not ordered before it to
  // `*conflicts` (once per earlier access).
  // REQUIRES: lo <= hi.
  void Access(std::uint64_t lo, std::uint64_t hi, std::uint32_t stream,
              const VectorClock& clock, const VectorClock& host,
              std::vector<Conflict>* conflicts);
  // Forgets every access to [lo, hi) (the memory was freed or unmapped).
  void Forget(std::uint64_t lo, std::uint64_t hi);
  // Drops the accesses the host has synchronised past (epoch <= host).
  void Prune(const VectorClock& host);

  std::size_t segment_count() const { return segments_.size(); }
  std::size_t entry_count() const;

 private:
  struct Entry {
    std::uint32_t stream;
    std::uint64_t epoch;
    std::uint64_t lo;  // the whole original access, for reports
    std::uint64_t hi;
  };
  struct Segment {
    std::uint64_t hi;
    absl::InlinedVector<Entry, 2> entries;
  };
  // Splits the segment that strictly contains `x` into [lo, x) and [x, hi).
  void SplitAt(std::uint64_t x);

  absl::btree_map<std::uint64_t, Segment> segments_;  // keyed by lo
  std::vector<std::pair<std::uint64_t, Segment>> scratch_;
  std::size_t prune_threshold_ = 4096;
};

}  // namespace sim_internal
}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_INTERNAL_SIM_RACE_DETECTOR_H_
