// src/alloc/segment_backing.h — where a CachingDeviceAllocator's segments get
// their memory (internal; not installed).
//
// The allocator's block logic does not care how a segment's range was
// obtained. A SegmentBacking hides it: ClassicBacking (classic_backing.h)
// makes one cuMemAlloc per segment and one cuMemFree to return it. The
// expandable backing (expandable_backing.h) is different in kind: a
// virtual range per (stream, pool) (a few when live blocks split them)
// whose granules are mapped and unmapped run by run, so its interface is
// the range and its runs.
//
// The caller holds the allocator's global lock (mu_) and has made its context
// current.
#ifndef CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_
#define CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace alloc_internal {

// One range a backing handed out.
struct BackedRange {
  DevicePtr base;
  std::size_t size = 0;
  std::uint64_t handle = 0;  // backing-specific (unused by ClassicBacking)
};

// Growth of `need` bytes on top of the `held` bytes an allocator holds
// against its DeviceAllocatorOptions::memory_limit_bytes `limit` (0: none):
// OK, or the driver's out-of-memory error for `call` naming the limit, so
// that the allocator reclaims and reports as when the device runs out.
inline absl::Status CheckMemoryLimit(absl::string_view call, std::size_t limit,
                                     std::size_t held, std::size_t need) {
  if (limit == 0 || held + need <= limit) return absl::OkStatus();
  return DriverError(cu::kErrorOutOfMemory, call,
                     core_internal::Format(
                         "memory_limit_bytes (%d) reached: the allocator holds "
                         "%d bytes and needs %d more",
                         limit, held, need));
}

class SegmentBacking {
 public:
  virtual ~SegmentBacking() = default;
  // A new range of exactly `bytes`. The driver's error (e.g.
  // CUDA_ERROR_OUT_OF_MEMORY) is returned as is.
  // REQUIRES: the allocator's context is current.
  virtual absl::StatusOr<BackedRange> Allocate(std::size_t bytes) = 0;
  // Returns a range from Allocate. REQUIRES: no stream work still uses it.
  virtual absl::Status Free(const BackedRange& range) = 0;
};

}  // namespace alloc_internal
}  // namespace ctxpool

#endif  // CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_
