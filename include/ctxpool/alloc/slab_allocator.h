// ctxpool/alloc/slab_allocator.h — size-class slabs for small device objects.
//
// Inference allocates many small device objects (scalars, indices, shape
// buffers). Giving each its own block of the device allocator costs a 512 B
// block, a best-fit search and a split/merge per object. SlabAllocator carves
// slabs (`slab_bytes`, 256 KiB by default) from a CachingDeviceAllocator and
// cuts each slab into equal slots of one size class:
//
//   * 14 classes, the powers of two from 8 B to 64 KiB. A request rounds up
//     to its class (waste < 50 % of the object, 25 % on average for
//     log-uniform sizes); every object is aligned to min(class, 512 B).
//   * One bitmap per slab (1 = slot in use), and per (stream, class) a list
//     of partly filled slabs: Allocate takes the first slab of the list and
//     the first zero bit from a search hint — O(1) in the common case.
//   * Stream order, as in the device allocator: a slab belongs to the stream
//     it was carved for; an object freed with Deallocate is reusable at once
//     by later work on that stream. An object also used on other streams
//     (RecordStream) keeps its slot until events recorded on those streams
//     complete (polled on later calls, never waited for).
//   * Empty slabs stay with their stream for reuse by any class, and go back
//     to the device allocator on Trim(), or once they have been empty longer
//     than `decay` (checked on Allocate/Deallocate calls, never by a
//     background thread).
//
// Example:
//
//   CTXPOOL_ASSIGN_OR_RETURN(auto slabs, SlabAllocator::Create(device_alloc));
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, slabs->Allocate(64, stream));
//   ... kernels on `stream` use the 64 bytes at p ...
//   slabs->Deallocate(p);   // stream-ordered: reusable at once on `stream`
//   slabs->Trim();          // empty slabs back to the device allocator
//
// Size 0: Allocate(0, s) returns a valid, unique 8 B object. Requests above
// 64 KiB are INVALID_ARGUMENT: use the device allocator for them.
//
// fork(): CUDA state does not survive fork. In a process forked after Create
// every call that returns a Status fails with FAILED_PRECONDITION (as
// DeviceContext's do: create the allocators in each worker after the fork)
// and neither the driver nor the device allocator is called; Stats and
// Fragmentation still read the (copied) bookkeeping. The destructor in the
// child returns no slab and destroys no event: it leaks the parent's state.
//
// Thread-safety: all methods are thread-safe (one absl::Mutex). The cached
// path of Allocate and Deallocate takes the lock once, makes no driver call
// and no heap allocation. The device allocator is called without the lock
// for new slabs; it may be shared with other users.
#ifndef CTXPOOL_ALLOC_SLAB_ALLOCATOR_H_
#define CTXPOOL_ALLOC_SLAB_ALLOCATOR_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

inline constexpr std::size_t kSlabMinObjectBytes = 8;
inline constexpr std::size_t kSlabMaxObjectBytes = 64 << 10;
inline constexpr int kNumSlabClasses = 14;  // 8 B, 16 B, ..., 64 KiB

// The class of a request (0 for 0..8 B). REQUIRES: bytes <= 64 KiB.
int SlabClassIndex(std::size_t bytes);
// 8 << index.
constexpr std::size_t SlabClassBytes(int index) {
  return kSlabMinObjectBytes << index;
}

struct SlabAllocatorOptions {
  // Bytes of each slab: a power of two in [64 KiB, 64 MiB]. The default
  // fits the device allocator's small pool (eight slabs per 2 MiB segment).
  std::size_t slab_bytes = 256 << 10;
  // Empty slabs idle longer than this go back to the device allocator;
  // absl::InfiniteDuration(): only on Trim.
  absl::Duration decay = absl::Seconds(10);
  // Clock for the decay (tests inject one); null means absl::Now.
  std::function<absl::Time()> clock;
  // Context for event calls; null: retain the device allocator's device's
  // primary context (released at destruction).
  ContextHandle context;
};

struct SlabClassStats {
  std::size_t object_bytes = 0;
  std::size_t live_objects = 0;     // allocated and not freed
  std::size_t pending_objects = 0;  // freed, waiting for another stream
  std::size_t capacity = 0;         // slots in the class's slabs
  std::size_t slabs = 0;            // slabs formatted for the class
};

// Invariants (checked by CheckInvariants):
//   slabs_held == empty_slabs + sum(classes[i].slabs)
//   sum over slabs of popcount(bitmap) == live_objects + pending_objects
//   fragmentation_bytes == sum over partly filled slabs of free slots × class
struct SlabAllocatorStats {
  std::array<SlabClassStats, kNumSlabClasses> classes;
  std::size_t slabs_held = 0;  // taken from the device allocator
  std::size_t empty_slabs = 0;
  std::size_t slab_bytes_held = 0;
  std::size_t live_objects = 0;
  std::size_t live_bytes = 0;  // class bytes of live objects
  std::size_t pending_objects = 0;
  // Free slots in partly filled slabs (bytes no live object uses).
  std::size_t fragmentation_bytes = 0;
  std::int64_t num_allocs = 0;
  std::int64_t num_frees = 0;
  std::int64_t slabs_allocated = 0;  // device allocator Allocate calls
  std::int64_t slabs_returned = 0;   // device allocator Deallocate calls
  std::int64_t decay_returns = 0;    // of which by the decay
  std::int64_t num_trims = 0;
  std::int64_t events_recorded = 0;
  std::int64_t invalid_frees = 0;     // foreign, interior, double frees
  std::int64_t invalid_requests = 0;  // bad sizes, bad RecordStream
};

class SlabAllocator {
 public:
  // Creates a slab allocator over `device`, which must outlive it.
  // INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<SlabAllocator>> Create(
      CachingDeviceAllocator& device, SlabAllocatorOptions options = {});

  // Returns every slab to the device allocator (as Reset(/*force=*/true)).
  // In a forked child: returns nothing, makes no driver call.
  ~SlabAllocator();

  SlabAllocator(const SlabAllocator&) = delete;
  SlabAllocator& operator=(const SlabAllocator&) = delete;

  // Returns an object of at least `bytes` usable by work on `stream` in
  // stream order. INVALID_ARGUMENT when bytes > 64 KiB; the device
  // allocator's error when a new slab cannot be had (after returning this
  // allocator's empty slabs and retrying once).
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream);

  // Frees the object at `ptr`, ordered after the work enqueued on its slab's
  // stream (and on RecordStream'd streams). Never crashes: INVALID_ARGUMENT
  // (and invalid_frees += 1) for a pointer that is not the start of a live
  // object: foreign, inside an object, or a double free.
  absl::Status Deallocate(DevicePtr ptr) noexcept;

  // Marks that work on `stream` uses the object at `ptr`: after Deallocate
  // its slot is not reused until that work completes.
  // REQUIRES: ptr is a live object (else INVALID_ARGUMENT).
  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream);

  // Returns every empty slab to the device allocator (after polling pending
  // objects). freed_bytes: slab bytes returned; busy_bytes: bytes of objects
  // still waiting for another stream.
  absl::StatusOr<TrimResult> Trim();

  // Returns every slab. With live objects it fails with FAILED_PRECONDITION
  // unless `force`; pending objects are waited for (a host synchronise).
  absl::Status Reset(bool force = false);

  SlabAllocatorStats Stats() const;
  // free_bytes: free slots of partly filled slabs plus empty slabs;
  // largest_free_bytes: a slab if one is empty, else the largest class with
  // a free slot. Object sizes are not stored, so rounding waste is 0.
  FragmentationStats Fragmentation() const;
  // Checks the invariants; OK or INTERNAL naming the first broken one.
  absl::Status CheckInvariants() const;
  // (Every Status-returning method above: FAILED_PRECONDITION in a process
  // forked after Create; see the header comment.)

  CachingDeviceAllocator& device_allocator() const;
  const SlabAllocatorOptions& options() const;

 private:
  class Impl;
  explicit SlabAllocator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_ALLOC_SLAB_ALLOCATOR_H_
