// ctxpool/core/internal/coarse_clock.h — the clock of allocation stamps. Not
// API.
//
// Blocks of owners that record times (OwnerOptions::record_times) are
// stamped on every allocation, cached ones included, so the stamp must be
// cheap. CoarseNowNs() is absl's clock (ns since the Unix epoch) read
// coarsely: the kernel's coarse real-time clock is one load from the vDSO page
// with no time-stamp-counter read (~4 ns where rdtsc costs ~11 ns on a virtual
// machine's TSC). It trails absl::GetCurrentTimeNanos() by 0 to a few kernel
// ticks (milliseconds) and never leads it. Anything that compares a stamp with
// "now" (a leak report's age) reads "now" from this clock too, so a fresh
// allocation's age is 0 to one tick rather than the lag between the clocks.
#ifndef CTXPOOL_CORE_INTERNAL_COARSE_CLOCK_H_
#define CTXPOOL_CORE_INTERNAL_COARSE_CLOCK_H_

#include <time.h>

#include <cstdint>

#include "absl/base/attributes.h"
#include "absl/base/optimization.h"
#include "absl/time/clock.h"

namespace ctxpool {
namespace core_internal {

ABSL_ATTRIBUTE_ALWAYS_INLINE inline std::int64_t CoarseNowNs() {
#if defined(__linux__) && defined(CLOCK_REALTIME_COARSE)
  timespec ts;
  if (ABSL_PREDICT_TRUE(clock_gettime(CLOCK_REALTIME_COARSE, &ts) == 0)) {
    return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  }
#endif
  return absl::GetCurrentTimeNanos();
}

}  // namespace core_internal
}  // namespace ctxpool

#endif  // CTXPOOL_CORE_INTERNAL_COARSE_CLOCK_H_
