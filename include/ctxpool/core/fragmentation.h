// ctxpool/core/fragmentation.h — how much cached memory is unusable.
//
// Fragmentation() of every allocator reports the same numbers, computed here
// from a few sums the allocator keeps:
//
//   * external = 1 − largest_free / free: 0 when all cached memory is one
//     block, near 1 when it is scattered in many small holes (a request
//     larger than the largest hole fails although free memory suffices);
//   * rounding_waste = (allocated − requested) / allocated: internal
//     fragmentation from size rounding;
//   * reserved_over_live = reserved / allocated: the memory held per byte in
//     use (1.0 is perfect).
//
//   FragmentationInputs in{.free_bytes = 3 << 20,
//                          .largest_free_bytes = 2 << 20, ...};
//   ComputeFragmentation(in).external;  // 1 − 2/3 = 0.333
//
// Pure function; thread-safe.
#ifndef CTXPOOL_CORE_FRAGMENTATION_H_
#define CTXPOOL_CORE_FRAGMENTATION_H_

#include <cstddef>

namespace ctxpool {

// External fragmentation and overheads at one moment.
struct FragmentationStats {
  std::size_t free_bytes = 0;  // cached, in free blocks
  std::size_t largest_free_bytes = 0;
  std::size_t free_blocks = 0;
  double external = 0.0;  // 1 − largest_free / free (0 if none)
  std::size_t rounding_waste_bytes = 0;  // allocated − requested
  double rounding_waste = 0.0;           // rounding_waste_bytes / allocated
  double reserved_over_live = 0.0;       // reserved / allocated (0 if none)
};

struct FragmentationInputs {
  std::size_t free_bytes = 0;
  std::size_t largest_free_bytes = 0;
  std::size_t free_blocks = 0;
  std::size_t allocated_bytes = 0;  // rounded sizes of live blocks
  std::size_t requested_bytes = 0;  // what callers asked for
  std::size_t reserved_bytes = 0;   // held from the driver
};

// REQUIRES: largest_free_bytes <= free_bytes, requested <= allocated.
inline FragmentationStats ComputeFragmentation(const FragmentationInputs& in) {
  FragmentationStats f;
  f.free_bytes = in.free_bytes;
  f.largest_free_bytes = in.largest_free_bytes;
  f.free_blocks = in.free_blocks;
  if (in.free_bytes > 0) {
    f.external = 1.0 - static_cast<double>(in.largest_free_bytes) /
                           static_cast<double>(in.free_bytes);
  }
  f.rounding_waste_bytes = in.allocated_bytes - in.requested_bytes;
  if (in.allocated_bytes > 0) {
    f.rounding_waste = static_cast<double>(f.rounding_waste_bytes) /
                       static_cast<double>(in.allocated_bytes);
    f.reserved_over_live = static_cast<double>(in.reserved_bytes) /
                           static_cast<double>(in.allocated_bytes);
  }
  return f;
}

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_FRAGMENTATION_H_
