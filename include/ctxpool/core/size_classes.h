// ctxpool/core/size_classes.h — request rounding, pools, segment sizes and
// split rules of the caching device allocator.
//
// The rules are PyTorch's CUDACachingAllocator's, with its constants as
// defaults and every one configurable:
//
//   * Requests round up to `round_bytes` (512 B); 0 B becomes 512 B.
//   * Rounded sizes <= `small_size_limit` (1 MiB) use the small pool, whose
//     segments are `small_segment_bytes` (2 MiB). Larger ones use the large
//     pool: below `large_own_segment_bytes` (10 MiB) they share
//     `large_segment_bytes` (20 MiB) segments; from 10 MiB on each gets its
//     own segment, rounded up to `large_round_bytes` (2 MiB).
//   * Split: a free block serving a smaller request is split when the
//     remainder is worth keeping: >= round_bytes in the small pool,
//     > small_size_limit in the large pool (and only for requests below
//     max_split_size).
//   * max_split_size: blocks at least that large are never split, serve only
//     requests at least that large, and not ones more than
//     large_segment_bytes smaller than the block.
//
//   SizeClasses classes{SizeClassConfig{}};
//   classes.Round(1000);              // 1024
//   classes.IsSmall(1024);            // true
//   classes.SegmentBytes(3 << 20);    // 20 MiB (shared large segment)
//   classes.SegmentBytes(13 << 20);   // 14 MiB (own segment)
//   classes.ShouldSplit(2 << 20, 1024, /*small=*/true);  // true
//
// Pure functions of the config; thread-compatible (const methods are safe).
#ifndef CTXPOOL_CORE_SIZE_CLASSES_H_
#define CTXPOOL_CORE_SIZE_CLASSES_H_

#include <cstddef>
#include <limits>

namespace ctxpool {

struct SizeClassConfig {
  std::size_t round_bytes = 512;  // a power of two
  std::size_t small_size_limit = std::size_t{1} << 20;
  std::size_t small_segment_bytes = std::size_t{2} << 20;
  std::size_t large_segment_bytes = std::size_t{20} << 20;
  std::size_t large_round_bytes = std::size_t{2} << 20;  // a power of two
  std::size_t large_own_segment_bytes = std::size_t{10} << 20;
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
};

class SizeClasses {
 public:
  explicit SizeClasses(const SizeClassConfig& config) : c_(config) {}

  const SizeClassConfig& config() const { return c_; }

  // The block size for a request of `bytes`.
  // REQUIRES: bytes <= max() − round_bytes (callers reject larger ones).
  std::size_t Round(std::size_t bytes) const {
    if (bytes == 0) return c_.round_bytes;
    return RoundUpPow2(bytes, c_.round_bytes);  // a mask: no division
  }
  // Whether a rounded size belongs to the small pool.
  bool IsSmall(std::size_t rounded) const {
    return rounded <= c_.small_size_limit;
  }
  // Whether a rounded request gets a segment of its own (a large one of
  // large_own_segment_bytes or more, or too big to share a large segment).
  bool OwnsSegment(std::size_t rounded) const {
    return !IsSmall(rounded) && (rounded >= c_.large_own_segment_bytes ||
                                 rounded > c_.large_segment_bytes);
  }
  // The size of a new segment for a rounded request.
  std::size_t SegmentBytes(std::size_t rounded) const {
    if (IsSmall(rounded)) return c_.small_segment_bytes;
    if (!OwnsSegment(rounded)) return c_.large_segment_bytes;
    return RoundUpPow2(rounded, c_.large_round_bytes);
  }
  // Whether a free block of `block_size` may serve a rounded request
  // (max_split_size rules; size is checked by the caller).
  bool CanServe(std::size_t block_size, std::size_t rounded) const {
    if (c_.max_split_size == std::numeric_limits<std::size_t>::max()) {
      return true;
    }
    if (rounded < c_.max_split_size && block_size >= c_.max_split_size) {
      return false;
    }
    if (rounded >= c_.max_split_size &&
        block_size - rounded >= c_.large_segment_bytes) {
      return false;
    }
    return true;
  }
  // Whether serving `rounded` from a block of `block_size` splits it.
  // REQUIRES: block_size >= rounded.
  bool ShouldSplit(std::size_t block_size, std::size_t rounded,
                   bool small) const {
    const std::size_t remaining = block_size - rounded;
    if (small) return remaining >= c_.round_bytes;
    return rounded < c_.max_split_size && remaining > c_.small_size_limit;
  }

  static constexpr std::size_t RoundUp(std::size_t n, std::size_t to) {
    return (n + to - 1) / to * to;
  }
  // RoundUp for a power of two `to` (the config's units; the allocator's
  // options check them).
  static constexpr std::size_t RoundUpPow2(std::size_t n, std::size_t to) {
    return (n + to - 1) & ~(to - 1);
  }

 private:
  SizeClassConfig c_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_SIZE_CLASSES_H_
