// src/alloc/classic_backing.h — the classic backing of
// CachingDeviceAllocator: one cuMemAlloc per segment, one cuMemFree to
// return it (internal; not installed). See segment_backing.h.
#ifndef CTXPOOL_SRC_ALLOC_CLASSIC_BACKING_H_
#define CTXPOOL_SRC_ALLOC_CLASSIC_BACKING_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/status.h"
#include "segment_backing.h"

namespace ctxpool {
namespace alloc_internal {

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

#endif  // CTXPOOL_SRC_ALLOC_CLASSIC_BACKING_H_
