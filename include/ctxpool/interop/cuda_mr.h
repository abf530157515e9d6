// ctxpool/interop/cuda_mr.h — ctxpool as a CCCL memory resource (cuda::mr).
//
// MemoryResource satisfies CCCL's stream-ordered memory-resource concept with
// the device_accessible property, so code written against cuda::mr (RMM 26
// resources and their upstreams, cuDF's async_resource_ref, CCCL containers)
// takes its memory from a CachingDeviceAllocator, or from a ModelSession with
// every byte charged to the model:
//
//   interop::MemoryResource bert_mr(*bert);          // a ModelSession
//   interop::device_resource_ref ref = bert_mr;      // what cuDF & co. take
//   void* p = ref.allocate_async(1 << 20, 256, cuda::stream_ref{raw_stream});
//   ... kernels on raw_stream ...
//   ref.deallocate_async(p, 1 << 20, 256, cuda::stream_ref{raw_stream});
//
// Both spellings of the concept are members, so the class works with either
// CCCL: up to 3.0, allocate(bytes, align) is synchronous and
// allocate_async(bytes, align, stream) stream-ordered; from 3.1 (CCCL PR
// 5313), allocate(stream, bytes, align) is stream-ordered and
// allocate_sync(bytes, align) synchronous. The concept names and
// device_resource_ref follow CCCL_VERSION.
//
// Streams: cuda::stream_ref::get() is the CUstream whose bits are ctxpool's
// StreamHandle (ToStreamHandle / ToStreamRef). A stream-ordered allocation
// may be used by work enqueued on its stream after the call; a
// stream-ordered deallocation is ordered after the work enqueued on the
// allocation stream and on the stream it names (FreeCheck::order_after_stream),
// with no host synchronise.
//
// Synchronous calls use the resource's sync stream (the legacy default
// stream unless given): allocate_sync allocates on it and then waits for it
// (cuStreamSynchronize, so the memory may be used on any stream at once: a
// host synchronise per call — prefer the stream-ordered calls on hot paths);
// deallocate_sync frees ordered after the sync stream's and the allocation
// stream's work (the caller has finished any other stream's use, as with
// cudaFree).
//
// Errors: the concept has no Status channel. allocate* throws
// interop::BadAlloc (a std::bad_alloc; what() is ctxpool's message, for an
// out-of-memory the full OomReport, for a model the budget it hit) and
// status() the Status. An alignment that is not a power of two or exceeds
// max_alignment() (256 B; see MemoryRef::max_alignment) throws BadAlloc with
// INVALID_ARGUMENT (so a resource over an allocator with round_bytes 128
// refuses the default 256). deallocate* is noexcept: a free ctxpool refuses
// (foreign pointer, double free, wrong size, another model's block, a model's
// block through a plain resource) frees nothing and is counted in
// invalid_frees (the session's or the device allocator's Stats; see
// memory_ref.h for a free after Close); last_error() keeps its Status for the
// thread that saw it. The stream a deallocation names must be alive.
//
// Cost: a copy is 24 bytes (two pointers and the sync stream);
// equality is identity (the same allocator
// and the same owner); a stream-ordered allocate/deallocate pair is the
// session's (or allocator's) pair plus a branch — no heap allocation, no
// driver call once warm.
//
// Needs CCCL's headers (the CUDA toolkit's include/cccl, or CCCL from
// GitHub) and cuda_runtime_api.h on the include path; nothing to link.
// Include this header before any other CCCL header, or define
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE yourself.
#ifndef CTXPOOL_INTEROP_CUDA_MR_H_
#define CTXPOOL_INTEROP_CUDA_MR_H_

#if defined(_CUDA_MEMORY_RESOURCE) && \
    !defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE)
#error \
    "ctxpool/interop/cuda_mr.h: include it before <cuda/memory_resource>, or define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE"
#endif
#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <cstddef>
#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda/version>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/interop/memory_ref.h"

namespace ctxpool::interop {

// CCCL 3.1 renamed the stream-ordered concept to cuda::mr::resource.
#if CCCL_VERSION >= 3001000
#define CTXPOOL_CCCL_STREAM_ORDERED_NAMES 1
using device_resource_ref = cuda::mr::resource_ref<cuda::mr::device_accessible>;
#else
#define CTXPOOL_CCCL_STREAM_ORDERED_NAMES 0
using device_resource_ref =
    cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
#endif

inline StreamHandle ToStreamHandle(cuda::stream_ref stream) noexcept {
  return StreamHandle::From(stream.get());
}
inline cuda::stream_ref ToStreamRef(StreamHandle stream) noexcept {
  return cuda::stream_ref(stream.as<cudaStream_t>());
}

class MemoryResource {
 public:
  static constexpr std::size_t kDefaultAlignment =
      cuda::mr::default_cuda_malloc_alignment;

  // REQUIRES: the allocator (session) and `sync_stream` outlive the resource.
  explicit MemoryResource(CachingDeviceAllocator& allocator,
                          StreamHandle sync_stream = {}) noexcept
      : ref_(allocator), sync_stream_(sync_stream) {}
  explicit MemoryResource(ModelSession& session,
                          StreamHandle sync_stream = {}) noexcept
      : ref_(session), sync_stream_(sync_stream) {}
  explicit MemoryResource(MemoryRef ref, StreamHandle sync_stream = {}) noexcept
      : ref_(ref), sync_stream_(sync_stream) {}

  // ---- Stream-ordered ------------------------------------------------------
  // CCCL >= 3.1.
  void* allocate(cuda::stream_ref stream, std::size_t bytes,
                 std::size_t alignment = kDefaultAlignment) {
    return Allocate(bytes, alignment, ToStreamHandle(stream));
  }
  void deallocate(cuda::stream_ref stream, void* ptr, std::size_t bytes,
                  std::size_t alignment = kDefaultAlignment) noexcept {
    (void)alignment;
    Deallocate(ptr, bytes, ToStreamHandle(stream));
  }
  // CCCL <= 3.0.
  void* allocate_async(std::size_t bytes, std::size_t alignment,
                       cuda::stream_ref stream) {
    return Allocate(bytes, alignment, ToStreamHandle(stream));
  }
  void* allocate_async(std::size_t bytes, cuda::stream_ref stream) {
    return Allocate(bytes, kDefaultAlignment, ToStreamHandle(stream));
  }
  void deallocate_async(void* ptr, std::size_t bytes, std::size_t alignment,
                        cuda::stream_ref stream) noexcept {
    (void)alignment;
    Deallocate(ptr, bytes, ToStreamHandle(stream));
  }
  void deallocate_async(void* ptr, std::size_t bytes,
                        cuda::stream_ref stream) noexcept {
    Deallocate(ptr, bytes, ToStreamHandle(stream));
  }

  // ---- Synchronous (the sync stream; see the file comment) ----------------
  // CCCL >= 3.1.
  void* allocate_sync(std::size_t bytes,
                      std::size_t alignment = kDefaultAlignment) {
    void* p = Allocate(bytes, alignment, sync_stream_);
    absl::Status s = SyncStream();
    if (!s.ok()) {
      Deallocate(p, bytes, sync_stream_);
      throw BadAlloc(std::move(s));
    }
    return p;
  }
  void deallocate_sync(void* ptr, std::size_t bytes,
                       std::size_t alignment = kDefaultAlignment) noexcept {
    (void)alignment;
    Deallocate(ptr, bytes, sync_stream_);
  }
  // CCCL <= 3.0.
  void* allocate(std::size_t bytes, std::size_t alignment = kDefaultAlignment) {
    return allocate_sync(bytes, alignment);
  }
  void deallocate(void* ptr, std::size_t bytes,
                  std::size_t alignment = kDefaultAlignment) noexcept {
    deallocate_sync(ptr, bytes, alignment);
  }

  // Identity: the same allocator and owner (the sync stream does not matter:
  // memory from one may be freed through the other).
  friend bool operator==(const MemoryResource& a,
                         const MemoryResource& b) noexcept {
    return a.ref_ == b.ref_;
  }
  friend bool operator!=(const MemoryResource& a,
                         const MemoryResource& b) noexcept {
    return !(a == b);
  }
  friend void get_property(const MemoryResource&,
                           cuda::mr::device_accessible) noexcept {}

  const MemoryRef& memory_ref() const noexcept { return ref_; }
  StreamHandle sync_stream() const noexcept { return sync_stream_; }
  std::size_t max_alignment() const noexcept { return ref_.max_alignment(); }

  // The last refused deallocation on this thread (OK if none), for
  // diagnostics: deallocate is noexcept. (interop::LastFreeError.)
  static const absl::Status& last_error() noexcept { return LastFreeError(); }

 private:
  void* Allocate(std::size_t bytes, std::size_t alignment,
                 StreamHandle stream) {
    absl::Status aligned = ref_.CheckAlignment(alignment, "MemoryResource");
    if (ABSL_PREDICT_FALSE(!aligned.ok())) throw BadAlloc(std::move(aligned));
    return ValueOrThrow(ref_.Allocate(bytes, stream)).get();
  }
  void Deallocate(void* ptr, std::size_t bytes, StreamHandle stream) noexcept {
    ref_.Deallocate(DevicePtr::From(ptr), bytes, stream).IgnoreError();
  }
  absl::Status SyncStream() const {
    CachingDeviceAllocator& a = ref_.allocator();
    ScopedContext ctx(a.driver(), a.context());
    if (!ctx.status().ok()) return ctx.status();
    return a.driver().StreamSynchronize(sync_stream_);
  }
  MemoryRef ref_;
  StreamHandle sync_stream_;
};

}  // namespace ctxpool::interop

#endif  // CTXPOOL_INTEROP_CUDA_MR_H_
