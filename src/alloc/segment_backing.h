// src/alloc/segment_backing.h — where a CachingDeviceAllocator's segments get
// their memory (internal; not installed).
//
// The allocator's block logic does not care how a segment's range was
// obtained. A SegmentBacking hides it: ClassicBacking makes one cuMemAlloc per
// segment and one cuMemFree to return it. An expandable VMM backing (a
// per-stream virtual reservation with 2 MiB granules mapped on demand and a
// per-device granule cache) implements the same interface.
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

// cuMemAlloc / cuMemFree per segment.
class ClassicBacking final : public SegmentBacking {
 public:
  explicit ClassicBacking(Driver& driver) : driver_(driver) {}
  absl::StatusOr<BackedRange> Allocate(std::size_t bytes) override {
    CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, driver_.MemAlloc(bytes));
    return BackedRange{p, bytes, 0};
  }
  absl::Status Free(const BackedRange& range) override {
    return driver_.MemFree(range.base);
  }

 private:
  Driver& driver_;
};

}  // namespace alloc_internal
}  // namespace ctxpool

#endif  // CTXPOOL_SRC_ALLOC_SEGMENT_BACKING_H_
