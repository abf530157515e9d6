// ctxpool/driver/types.h — ctxpool's own handle types for CUDA objects.
//
// Public headers never include cuda.h. Instead, every CUDA object that crosses
// the Driver seam travels as one of these small value types: a tagged integer
// that is the CUDA handle's bits (a CUstream, CUevent, CUcontext pointer, a
// CUdeviceptr, a CUmemGenericAllocationHandle). CudaDriver converts them with
// a cast; SimDriver hands out its own deterministic values.
//
//   StreamHandle s = ...;          // from Driver::StreamCreate
//   cudaStream_t raw = s.as<cudaStream_t>();   // plugin code that has cuda.h
//   StreamHandle back = StreamHandle::From(raw);
//
// A value of 0 is the null handle. For streams, the null handle is the
// legacy default stream, a valid stream to order work on (PyTorch passes it).
#ifndef CTXPOOL_DRIVER_TYPES_H_
#define CTXPOOL_DRIVER_TYPES_H_

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>

namespace ctxpool {

// A strongly typed, trivially copyable wrapper of a driver handle's bits.
template <typename Tag>
class Handle {
 public:
  constexpr Handle() = default;
  constexpr explicit Handle(std::uint64_t value) : value_(value) {}

  // Wraps a raw driver handle (a pointer or an integer).
  template <typename T>
  static Handle From(T raw) {
    if constexpr (std::is_pointer_v<T>) {
      return Handle(reinterpret_cast<std::uintptr_t>(raw));
    } else {
      return Handle(static_cast<std::uint64_t>(raw));
    }
  }
  // Returns the raw driver handle.
  template <typename T>
  T as() const {
    if constexpr (std::is_pointer_v<T>) {
      return reinterpret_cast<T>(static_cast<std::uintptr_t>(value_));
    } else {
      return static_cast<T>(value_);
    }
  }

  constexpr std::uint64_t value() const { return value_; }
  constexpr bool is_null() const { return value_ == 0; }

  friend constexpr auto operator<=>(Handle, Handle) = default;
  template <typename H>
  friend H AbslHashValue(H h, Handle x) {
    return H::combine(std::move(h), x.value_);
  }

 private:
  std::uint64_t value_ = 0;
};

struct StreamTag {};
struct EventTag {};
struct ContextTag {};
struct PhysicalMemTag {};

using StreamHandle = Handle<StreamTag>;    // CUstream
using EventHandle = Handle<EventTag>;      // CUevent
using ContextHandle = Handle<ContextTag>;  // CUcontext
using PhysicalMemHandle =
    Handle<PhysicalMemTag>;  // CUmemGenericAllocationHandle

// A device virtual address (CUdeviceptr). Arithmetic is explicit: `ptr + n`
// is the address n bytes further. The null address is 0.
class DevicePtr {
 public:
  constexpr DevicePtr() = default;
  constexpr explicit DevicePtr(std::uint64_t address) : address_(address) {}
  template <typename T>
  static DevicePtr From(T* p) {
    return DevicePtr(reinterpret_cast<std::uintptr_t>(p));
  }

  constexpr std::uint64_t address() const { return address_; }
  constexpr bool is_null() const { return address_ == 0; }
  void* get() const {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(address_));
  }

  friend constexpr DevicePtr operator+(DevicePtr p, std::uint64_t n) {
    return DevicePtr(p.address_ + n);
  }
  friend constexpr std::uint64_t operator-(DevicePtr a, DevicePtr b) {
    return a.address_ - b.address_;
  }
  friend constexpr auto operator<=>(DevicePtr, DevicePtr) = default;
  template <typename H>
  friend H AbslHashValue(H h, DevicePtr p) {
    return H::combine(std::move(h), p.address_);
  }

 private:
  std::uint64_t address_ = 0;
};

// Host function enqueued on a stream (cuLaunchHostFunc).
using HostFn = void (*)(void* user_data);

// Flags with the values the CUDA driver uses, so CudaDriver passes them on.
inline constexpr unsigned kStreamDefault = 0x0;
inline constexpr unsigned kStreamNonBlocking = 0x1;
inline constexpr unsigned kEventDefault = 0x0;
inline constexpr unsigned kEventBlockingSync = 0x1;
inline constexpr unsigned kEventDisableTiming = 0x2;
inline constexpr unsigned kHostAllocPortable = 0x1;
inline constexpr unsigned kHostAllocDeviceMap = 0x2;
inline constexpr unsigned kHostAllocWriteCombined = 0x4;
inline constexpr unsigned kHostRegisterPortable = 0x1;
// Context scheduling flags (CU_CTX_SCHED_*) and their mask.
inline constexpr unsigned kCtxSchedAuto = 0x0;
inline constexpr unsigned kCtxSchedSpin = 0x1;
inline constexpr unsigned kCtxSchedYield = 0x2;
inline constexpr unsigned kCtxSchedBlockingSync = 0x4;
inline constexpr unsigned kCtxSchedMask = 0x7;
inline constexpr unsigned kHostRegisterDeviceMap = 0x2;

// Device attributes ctxpool asks for (a subset of CUdevice_attribute).
enum class DeviceAttribute {
  kComputeCapabilityMajor,
  kComputeCapabilityMinor,
  kMultiprocessorCount,
  kVirtualMemoryManagementSupported,
  kMemoryPoolsSupported,
  kUnifiedAddressing,
  kCanMapHostMemory,
  kIntegrated,
  kPciBusId,
};

// Context limits (a subset of CUlimit).
enum class ContextLimit {
  kStackSize,
  kPrintfFifoSize,
  kMallocHeapSize,
};

// cuMemGetInfo's answer.
struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// cuCtxGetStreamPriorityRange's answer. Lower numbers are higher priority,
// so `greatest` <= `least` (e.g. least 0, greatest -5).
struct StreamPriorityRange {
  int least = 0;
  int greatest = 0;
};

// cuDevicePrimaryCtxGetState's answer.
struct PrimaryContextState {
  unsigned flags = 0;
  bool active = false;
};

}  // namespace ctxpool

template <typename Tag>
struct std::hash<ctxpool::Handle<Tag>> {
  std::size_t operator()(ctxpool::Handle<Tag> h) const noexcept {
    return std::hash<std::uint64_t>()(h.value());
  }
};
template <>
struct std::hash<ctxpool::DevicePtr> {
  std::size_t operator()(ctxpool::DevicePtr p) const noexcept {
    return std::hash<std::uint64_t>()(p.address());
  }
};

#endif  // CTXPOOL_DRIVER_TYPES_H_
