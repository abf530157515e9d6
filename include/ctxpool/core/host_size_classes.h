// ctxpool/core/host_size_classes.h — the size classes of the pinned host
// cache.
//
// Pinned host buffers are cached by size class: a freed buffer is reused for
// any later request that rounds to the same class. PyTorch rounds pinned
// requests to the next power of two, so a 4 GiB + 1 B pin takes 8 GiB
// (pytorch issue 95823). HostSizeClasses splits every doubling into
// `classes_per_doubling` (D, a power of two) equal steps instead:
//
//   HostSizeClasses classes(/*classes_per_doubling=*/8);
//   classes.RoundUp(1000);          // 1024
//   classes.RoundUp(4 * kGiB + 1);  // 4.5 GiB, not 8 GiB
//   int i = classes.Index(4 * kGiB + 1);
//   classes.ClassSize(i);           // 4.5 GiB
//
// The rule, for a request of b bytes:
//   * b <= 64 * D: round up to a multiple of kGranuleBytes (64 B);
//   * otherwise, with 2^k < b <= 2^(k+1): round up to a multiple of 2^k / D.
// So the waste (rounded − requested) is below b / D for every request larger
// than 64 * D bytes (below 12.5 % of the request for D = 8, 25 % for D = 4),
// and below 64 B for smaller ones. Class sizes are multiples of 64 B, so every
// class is 64-byte aligned inside a page-aligned pin.
//
// Classes are numbered densely from 0 (64 B) upward; Index and ClassSize are
// inverse. Everything is constexpr, CUDA-free and thread-compatible.
#ifndef CTXPOOL_CORE_HOST_SIZE_CLASSES_H_
#define CTXPOOL_CORE_HOST_SIZE_CLASSES_H_

#include <bit>
#include <cstddef>
#include <cstdint>

namespace ctxpool {

class HostSizeClasses {
 public:
  // Smallest class and the step of the small classes.
  static constexpr std::size_t kGranuleBytes = 64;
  // Largest request the classes cover (256 TiB).
  static constexpr std::size_t kMaxBytes = std::size_t{1} << 48;
  static constexpr int kMaxClassesPerDoubling = 64;

  // REQUIRES: classes_per_doubling is a power of two in [1, 64]. Other
  // values are clamped to the nearest valid one at or below.
  constexpr explicit HostSizeClasses(int classes_per_doubling = 8)
      : log2_d_(Log2Clamped(classes_per_doubling)) {}

  constexpr int classes_per_doubling() const { return 1 << log2_d_; }

  // Number of classes: Index(kMaxBytes) + 1.
  constexpr int num_classes() const {
    const int d = classes_per_doubling();
    return d + (48 - (kGranuleLog2 + log2_d_)) * d;
  }

  // The class size a request of `bytes` is served with (>= bytes; 0 gives the
  // smallest class). REQUIRES: bytes <= kMaxBytes.
  constexpr std::size_t RoundUp(std::size_t bytes) const {
    if (bytes <= SmallLimit()) {
      if (bytes == 0) return kGranuleBytes;
      return (bytes + kGranuleBytes - 1) & ~(kGranuleBytes - 1);
    }
    const int k = std::bit_width(bytes - 1) - 1;  // 2^k < bytes <= 2^(k+1)
    const std::size_t step = (std::size_t{1} << k) >> log2_d_;
    return (bytes + step - 1) & ~(step - 1);
  }

  // The index of RoundUp(bytes)'s class. REQUIRES: bytes <= kMaxBytes.
  constexpr int Index(std::size_t bytes) const {
    const int d = classes_per_doubling();
    if (bytes <= SmallLimit()) {
      if (bytes == 0) return 0;
      return static_cast<int>((bytes + kGranuleBytes - 1) / kGranuleBytes) - 1;
    }
    const int k = std::bit_width(bytes - 1) - 1;
    const std::size_t base = std::size_t{1} << k;
    const std::size_t step = base >> log2_d_;
    const int j = static_cast<int>((bytes - base + step - 1) / step);  // 1..d
    return d + (k - (kGranuleLog2 + log2_d_)) * d + (j - 1);
  }

  // The size of class `index`. REQUIRES: 0 <= index < num_classes().
  constexpr std::size_t ClassSize(int index) const {
    const int d = classes_per_doubling();
    if (index < d) return static_cast<std::size_t>(index + 1) * kGranuleBytes;
    const int rel = index - d;
    const int k = kGranuleLog2 + log2_d_ + rel / d;
    const std::size_t base = std::size_t{1} << k;
    return base + static_cast<std::size_t>(rel % d + 1) * (base >> log2_d_);
  }

  // Largest request whose waste is bounded by 64 B instead of 1/D.
  constexpr std::size_t SmallLimit() const { return kGranuleBytes << log2_d_; }

  // Upper bound of (RoundUp(b) − b) / b for b > SmallLimit(): 1 / D.
  constexpr double MaxWasteFraction() const {
    return 1.0 / classes_per_doubling();
  }

 private:
  static constexpr int kGranuleLog2 = 6;
  static constexpr int Log2Clamped(int d) {
    if (d < 1) return 0;
    if (d > kMaxClassesPerDoubling) d = kMaxClassesPerDoubling;
    return std::bit_width(static_cast<unsigned>(d)) - 1;
  }
  int log2_d_;
};

// PyTorch's pinned-memory rounding, for comparison: the next power of two,
// at least kGranuleBytes. REQUIRES: bytes <= HostSizeClasses::kMaxBytes.
constexpr std::size_t RoundUpPowerOfTwo(std::size_t bytes) {
  if (bytes <= HostSizeClasses::kGranuleBytes) {
    return HostSizeClasses::kGranuleBytes;
  }
  return std::bit_ceil(bytes);
}

}  // namespace ctxpool

#endif  // CTXPOOL_CORE_HOST_SIZE_CLASSES_H_
