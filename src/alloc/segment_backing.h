// src/alloc/segment_backing.h — where a CachingDeviceAllocator's segments get
// their memory (internal; not installed).
//
// The allocator's block logic does not care how a segment's range was
// obtained. A SegmentBacking hides it: ClassicBacking (classic_backing.h)
// makes one cuMemAlloc per segment and one cuMemFree to return it. The
// expandable backing (expandable_backing.h) is different in kind: one
// virtual range per (stream, pool) whose granules are mapped and unmapped
// run by run, so its interface is the range and its runs.
//
// The caller holds the allocator's lock and has made its context current.
#ifndef CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_
#define CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {
namespace alloc_internal {

// One range a backing handed out.
struct BackedRange {
  DevicePtr base;
  std::size_t size = 0;
  std::uint64_t handle = 0;  // backing-specific (unused by ClassicBacking)
};

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
