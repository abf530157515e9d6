#include "ctxpool/driver/internal/sim_race_detector.h"

#include <algorithm>

namespace ctxpool {
namespace sim_internal {

bool JoinClock(VectorClock& into, const VectorClock& from) {
  bool changed = false;
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (from[i] > into[i]) {
      into[i] = from[i];
      changed = true;
    }
  }
  return changed;
}

void RaceShadow::SplitAt(std::uint64_t x) {
  auto it = segments_.upper_bound(x);
  if (it == segments_.begin()) return;
  --it;
  if (it->first < x && it->second.hi > x) {
    Segment right{it->second.hi, it->second.entries};
    it->second.hi = x;
    segments_.emplace(x, std::move(right));
  }
}

void RaceShadow::Access(std::uint64_t lo, std::uint64_t hi,
                        std::uint32_t stream, const VectorClock& clock,
                        const VectorClock& host,
                        std::vector<Conflict>* conflicts) {
  if (lo >= hi) return;
  SplitAt(lo);
  SplitAt(hi);
  const std::size_t first_conflict = conflicts->size();
  bool clean = true;
  auto first = segments_.lower_bound(lo);
  auto it = first;
  for (; it != segments_.end() && it->first < hi; ++it) {
    auto& entries = it->second.entries;
    std::size_t keep = 0;
    for (std::size_t i = 0; i < entries.size(); ++i) {
      const Entry& e = entries[i];
      if (e.stream == stream || e.epoch <= ClockAt(clock, e.stream) ||
          e.epoch <= ClockAt(host, e.stream)) {
        continue;  // ordered before this access: superseded
      }
      bool seen = false;
      for (std::size_t c = first_conflict; c < conflicts->size(); ++c) {
        if ((*conflicts)[c].stream == e.stream &&
            (*conflicts)[c].epoch == e.epoch) {
          seen = true;
          break;
        }
      }
      if (!seen) conflicts->push_back({e.lo, e.hi, e.stream, e.epoch});
      entries[keep++] = e;
    }
    entries.resize(keep);
    if (keep != 0) clean = false;
  }
  const Entry mine{stream, ClockAt(clock, stream), lo, hi};
  if (clean) {
    segments_.erase(first, it);
    segments_.emplace(lo, Segment{hi, {mine}});
  } else {
    scratch_.clear();
    for (auto j = first; j != it; ++j) {
      scratch_.emplace_back(j->first, std::move(j->second));
    }
    segments_.erase(first, it);
    std::uint64_t cursor = lo;
    for (auto& [start, segment] : scratch_) {
      if (cursor < start) segments_.emplace(cursor, Segment{start, {mine}});
      segment.entries.push_back(mine);
      cursor = segment.hi;
      segments_.emplace(start, std::move(segment));
    }
    if (cursor < hi) segments_.emplace(cursor, Segment{hi, {mine}});
    scratch_.clear();
  }
  if (segments_.size() > prune_threshold_) {
    Prune(host);
    prune_threshold_ = std::max<std::size_t>(4096, 2 * segments_.size());
  }
}

void RaceShadow::Forget(std::uint64_t lo, std::uint64_t hi) {
  if (lo >= hi) return;
  SplitAt(lo);
  SplitAt(hi);
  segments_.erase(segments_.lower_bound(lo), segments_.lower_bound(hi));
}

void RaceShadow::Prune(const VectorClock& host) {
  for (auto it = segments_.begin(); it != segments_.end();) {
    auto& entries = it->second.entries;
    entries.erase(std::remove_if(entries.begin(), entries.end(),
                                 [&](const Entry& e) {
                                   return e.epoch <= ClockAt(host, e.stream);
                                 }),
                  entries.end());
    if (entries.empty()) {
      it = segments_.erase(it);
    } else {
      ++it;
    }
  }
}

std::size_t RaceShadow::entry_count() const {
  std::size_t n = 0;
  for (const auto& [lo, segment] : segments_) n += segment.entries.size();
  return n;
}

}  // namespace sim_internal
}  // namespace ctxpool
