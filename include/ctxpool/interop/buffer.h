// ctxpool/interop/buffer.h — stream-ordered RAII over ctxpool memory.
//
// DeviceBuffer: untyped device memory that frees itself, stream-ordered,
// when it goes out of scope, so a tensor's memory cannot leak on an early
// return (after rmm::device_buffer). UniqueDevicePtr<T>: a typed, owning
// pointer to `count` Ts. StlAllocator<T>: a standard allocator of device
// memory bound to a stream, for containers that never touch their elements
// on the host and for Thrust (thrust::cuda::par(StlAllocator<char>{...})).
// Each takes its memory from a MemoryRef: a CachingDeviceAllocator, or a
// ModelSession (charged to the model, in its leak report under the label).
//
//   CTXPOOL_ASSIGN_OR_RETURN(auto buf, interop::DeviceBuffer::Create(
//       interop::MemoryRef(*bert), 64 << 20, s, "activations"));
//   launch(buf.data(), buf.size(), s);
//   CTXPOOL_RETURN_IF_ERROR(buf.Resize(128 << 20));  // copies on s
//   return OkStatus();       // freed on s, after the work enqueued there
//
// Stream order: the buffer is usable by work on stream() from its creation;
// Resize copies the contents on stream(); set_stream moves later uses (and
// the free) to another stream: the free then waits for both streams' work.
// The caller orders the new stream after the old one, as with any
// cross-stream use.
//
// Thread-safety: none of its own (like std::vector); the memory calls are
// the pool's. Needs no CUDA header.
#ifndef CTXPOOL_INTEROP_BUFFER_H_
#define CTXPOOL_INTEROP_BUFFER_H_

#include <cstddef>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/interop/memory_ref.h"

namespace ctxpool::interop {

class DeviceBuffer {
 public:
  // An empty buffer: no memory, data() null.
  DeviceBuffer() = default;

  // A buffer of `bytes` on `stream` (0 bytes: an empty buffer, no call).
  // Errors: as MemoryRef::Allocate (RESOURCE_EXHAUSTED with the OOM report
  // or the model's budget).
  static absl::StatusOr<DeviceBuffer> Create(MemoryRef mr, std::size_t bytes,
                                             StreamHandle stream,
                                             const char* label = nullptr) {
    DeviceBuffer b(mr, stream, label);
    if (bytes > 0) {
      absl::StatusOr<DevicePtr> p = mr.Allocate(bytes, stream, label);
      if (!p.ok()) return std::move(p).status();
      b.ptr_ = *p;
      b.size_ = b.capacity_ = bytes;
    }
    return b;
  }

  DeviceBuffer(DeviceBuffer&& other) noexcept
      : mr_(other.mr_),
        stream_(other.stream_),
        label_(other.label_),
        ptr_(std::exchange(other.ptr_, DevicePtr())),
        size_(std::exchange(other.size_, 0)),
        capacity_(std::exchange(other.capacity_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Free();
      mr_ = other.mr_;
      stream_ = other.stream_;
      label_ = other.label_;
      ptr_ = std::exchange(other.ptr_, DevicePtr());
      size_ = std::exchange(other.size_, 0);
      capacity_ = std::exchange(other.capacity_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Frees the memory, ordered after the work enqueued on stream().
  ~DeviceBuffer() { Free(); }

  void* data() const noexcept { return ptr_.get(); }
  DevicePtr ptr() const noexcept { return ptr_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t capacity() const noexcept { return capacity_; }
  bool empty() const noexcept { return size_ == 0; }
  StreamHandle stream() const noexcept { return stream_; }
  // Null for a default-constructed buffer.
  const MemoryRef* memory_ref() const noexcept {
    return mr_.has_value() ? &*mr_ : nullptr;
  }

  // Later uses and the free are ordered on `stream` (see the file comment).
  void set_stream(StreamHandle stream) noexcept { stream_ = stream; }

  // Sets the size to `bytes`, keeping the first min(size, bytes) bytes. Within
  // capacity() nothing is allocated; otherwise a new block is allocated on
  // stream(), the contents copied there (cuMemcpyAsync) and the old block
  // freed after the copy. On error the buffer is unchanged.
  // FAILED_PRECONDITION for a default-constructed buffer.
  absl::Status Resize(std::size_t bytes) {
    if (bytes <= capacity_) {
      size_ = bytes;
      return absl::OkStatus();
    }
    return Reallocate(bytes);
  }
  // Frees the spare capacity (a copy, as Resize) so that capacity() == size().
  absl::Status ShrinkToFit() {
    if (capacity_ == size_) return absl::OkStatus();
    if (size_ == 0) {
      Free();
      return absl::OkStatus();
    }
    return Reallocate(size_);
  }

  // Gives up ownership: returns the block (requested with capacity() bytes)
  // and leaves the buffer empty. The caller frees it through the same
  // MemoryRef: mr.Deallocate(ptr, capacity, stream).
  DevicePtr release() noexcept {
    size_ = capacity_ = 0;
    return std::exchange(ptr_, DevicePtr());
  }

 private:
  DeviceBuffer(MemoryRef mr, StreamHandle stream, const char* label)
      : mr_(mr), stream_(stream), label_(label) {}

  absl::Status Reallocate(std::size_t bytes) {
    if (!mr_.has_value()) {
      return absl::FailedPreconditionError(
          "DeviceBuffer: a default-constructed buffer has no memory resource");
    }
    absl::StatusOr<DevicePtr> p = mr_->Allocate(bytes, stream_, label_);
    if (!p.ok()) return std::move(p).status();
    const std::size_t keep = size_ < bytes ? size_ : bytes;
    if (keep > 0) {
      CachingDeviceAllocator& a = mr_->allocator();
      absl::Status s;
      {
        ScopedContext ctx(a.driver(), a.context());
        s = ctx.status();
        if (s.ok()) s = a.driver().MemcpyAsync(*p, ptr_, keep, stream_);
      }
      if (!s.ok()) {
        mr_->Deallocate(*p, bytes, stream_).IgnoreError();
        return s;
      }
    }
    Free();
    ptr_ = *p;
    size_ = capacity_ = bytes;
    return absl::OkStatus();
  }

  void Free() noexcept {
    if (!ptr_.is_null()) {
      // The checks cannot refuse a block this buffer allocated (live, of this
      // owner and size). Ordering after a stream set by set_stream can fail
      // on a driver error: the block then stays live (the session's Close
      // reports it) and the error is in LastFreeError().
      mr_->Deallocate(ptr_, capacity_, stream_).IgnoreError();
    }
    ptr_ = DevicePtr();
    size_ = capacity_ = 0;
  }

  std::optional<MemoryRef> mr_;
  StreamHandle stream_;
  const char* label_ = nullptr;
  DevicePtr ptr_;
  std::size_t size_ = 0;
  std::size_t capacity_ = 0;
};

// An owning pointer to `count` Ts of device memory (uninitialised: T must
// be trivially copyable, since nothing on the host constructs it).
template <typename T>
class UniqueDevicePtr {
  static_assert(std::is_trivially_copyable_v<T>,
                "UniqueDevicePtr<T>: device memory is never constructed on "
                "the host, so T must be trivially copyable");
  static_assert(alignof(T) <= 256,
                "UniqueDevicePtr<T>: ctxpool's blocks are aligned to 256 B");

 public:
  UniqueDevicePtr() = default;
  // Errors: INVALID_ARGUMENT when count * sizeof(T) overflows; else as
  // DeviceBuffer::Create.
  static absl::StatusOr<UniqueDevicePtr> Create(MemoryRef mr, std::size_t count,
                                                StreamHandle stream,
                                                const char* label = nullptr) {
    if (count > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "UniqueDevicePtr: %u elements of %u B overflow size_t", count,
          sizeof(T)));
    }
    if (absl::Status s = mr.CheckAlignment(alignof(T), "UniqueDevicePtr");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<DeviceBuffer> b =
        DeviceBuffer::Create(mr, count * sizeof(T), stream, label);
    if (!b.ok()) return std::move(b).status();
    return UniqueDevicePtr(*std::move(b), count);
  }

  T* get() const noexcept { return static_cast<T*>(buffer_.data()); }
  std::size_t count() const noexcept { return count_; }
  explicit operator bool() const noexcept { return get() != nullptr; }
  StreamHandle stream() const noexcept { return buffer_.stream(); }
  // Frees now (stream-ordered) and becomes null.
  void reset() noexcept {
    buffer_ = DeviceBuffer();
    count_ = 0;
  }
  // Gives up ownership (see DeviceBuffer::release; the block was requested
  // with count() * sizeof(T) bytes).
  T* release() noexcept {
    count_ = 0;
    return static_cast<T*>(buffer_.release().get());
  }

 private:
  UniqueDevicePtr(DeviceBuffer b, std::size_t count)
      : buffer_(std::move(b)), count_(count) {}
  DeviceBuffer buffer_;
  std::size_t count_ = 0;
};

// A standard allocator (Allocator named requirement) of device memory on one
// stream. allocate throws BadAlloc; deallocate frees stream-ordered on the
// allocator's stream. Equal when the memory ref and the stream are equal
// (memory from one may be freed through the other). Containers that
// construct elements on the host (std::vector's resize) must not be used
// with it: only their allocation calls are device-safe. thrust::cuda::par
// takes StlAllocator<char>.
template <typename T>
class StlAllocator {
  static_assert(alignof(T) <= 256,
                "StlAllocator<T>: ctxpool's blocks are aligned to 256 B");

 public:
  using value_type = T;
  using propagate_on_container_move_assignment = std::true_type;
  using propagate_on_container_swap = std::true_type;
  using propagate_on_container_copy_assignment = std::true_type;
  using is_always_equal = std::false_type;

  StlAllocator(MemoryRef mr, StreamHandle stream) noexcept
      : mr_(mr), stream_(stream) {}
  template <typename U>
  StlAllocator(const StlAllocator<U>& other) noexcept  // NOLINT: rebind
      : mr_(other.memory_ref()), stream_(other.stream()) {}

  T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
      throw BadAlloc(absl::InvalidArgumentError(absl::StrFormat(
          "StlAllocator: %u elements of %u B overflow size_t", n, sizeof(T))));
    }
    if (absl::Status s = mr_.CheckAlignment(alignof(T), "StlAllocator");
        !s.ok()) {
      throw BadAlloc(std::move(s));
    }
    return static_cast<T*>(
        ValueOrThrow(mr_.Allocate(n * sizeof(T), stream_)).get());
  }
  void deallocate(T* p, std::size_t n) noexcept {
    mr_.Deallocate(DevicePtr::From(p), n * sizeof(T), stream_).IgnoreError();
  }

  const MemoryRef& memory_ref() const noexcept { return mr_; }
  StreamHandle stream() const noexcept { return stream_; }

  template <typename U>
  friend bool operator==(const StlAllocator& a,
                         const StlAllocator<U>& b) noexcept {
    return a.memory_ref() == b.memory_ref() && a.stream() == b.stream();
  }

 private:
  MemoryRef mr_;
  StreamHandle stream_;
};

}  // namespace ctxpool::interop

#endif  // CTXPOOL_INTEROP_BUFFER_H_
