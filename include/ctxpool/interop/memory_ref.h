// ctxpool/interop/memory_ref.h — who an interop adaptor allocates from.
//
// The interop headers (cuda_mr.h, buffer.h, cub.h) take their memory from a
// MemoryRef: a non-owning, trivially copyable reference to either a
// CachingDeviceAllocator (plain allocations) or a ModelSession (allocations
// charged to the model, checked against its max_bytes, listed in its leak
// report under the label). Two refs are equal when they name the same
// allocator and the same owner, i.e. when memory from one may be returned
// through the other.
//
//   interop::MemoryRef bert(*session);          // charged to "bert"
//   interop::MemoryRef pool(ctx->device_allocator());
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, bert.Allocate(4096, s, "scratch"));
//   bert.Deallocate(p, 4096, s).IgnoreError();
//
// Deallocate checks what the adaptors know and a caller can get wrong: the
// block must be the owner's (a plain ref's: a block of no owner, so it
// cannot free a model's memory) and have been requested with `bytes` (as
// PyTorch's free does); a refused free frees nothing, returns
// INVALID_ARGUMENT naming the model and is counted (the session's or the
// allocator's invalid_frees; after the session's Close its figures are
// final and a late free is refused uncounted). `stream` orders the free
// after that stream's work as well as after the allocation stream's
// (FreeCheck::order_after_stream), so memory allocated on one stream and
// last used on another is safe to free there; it must be alive (not yet
// destroyed) at the free. One critical section in the pool either way.
//
// Adaptors whose free cannot return a Status (destructors, noexcept
// deallocate) keep the last failure of the calling thread in
// LastFreeError(). A free that fails on a driver error (ordering after the
// other stream) leaves the block live: the session's Close reports it.
//
// The adaptors whose interface has no Status channel (cuda::mr resources,
// StlAllocator) throw BadAlloc, a std::bad_alloc whose what() is ctxpool's
// message (the OOM report for RESOURCE_EXHAUSTED) and whose status() is the
// full absl::Status.
#ifndef CTXPOOL_INTEROP_MEMORY_REF_H_
#define CTXPOOL_INTEROP_MEMORY_REF_H_

#include <cstddef>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/types.h"

namespace ctxpool::interop {

// std::bad_alloc with ctxpool's Status (an OOM report, a budget rejection, an
// invalid size or alignment).
class BadAlloc : public std::bad_alloc {
 public:
  explicit BadAlloc(absl::Status status)
      : status_(std::make_shared<const absl::Status>(std::move(status))),
        what_(std::make_shared<const std::string>(status_->ToString())) {}
  const char* what() const noexcept override { return what_->c_str(); }
  const absl::Status& status() const noexcept { return *status_; }

 private:
  // Shared, so that copying an exception (which must not throw) is cheap.
  std::shared_ptr<const absl::Status> status_;
  std::shared_ptr<const std::string> what_;
};

// The calling thread's last failed adaptor free (OK if none).
inline absl::Status& LastFreeError() noexcept {
  thread_local absl::Status last;
  return last;
}

// Throws BadAlloc for a failed allocation; returns the pointer otherwise.
inline DevicePtr ValueOrThrow(absl::StatusOr<DevicePtr> p) {
  if (ABSL_PREDICT_FALSE(!p.ok())) throw BadAlloc(std::move(p).status());
  return *p;
}

class MemoryRef {
 public:
  // Plain allocations of `allocator` (no owner). REQUIRES: it outlives the ref.
  explicit MemoryRef(CachingDeviceAllocator& allocator) noexcept
      : allocator_(&allocator) {}
  // Allocations charged to `session`'s model. REQUIRES: the session outlives
  // the ref and every block allocated through it is freed before Close (a
  // block still live at Close is reported as a leak and reclaimed).
  explicit MemoryRef(ModelSession& session) noexcept
      : allocator_(&session.device().device_allocator()), session_(&session) {}

  // As CachingDeviceAllocator::Allocate / ModelSession::Allocate (whose
  // errors name the model). `label`: null or a string that outlives the block.
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream,
                                     const char* label = nullptr) const {
    if (session_ != nullptr) return session_->Allocate(bytes, stream, label);
    return allocator_->Allocate(bytes, stream);
  }

  // Frees `ptr`, requested with `bytes`, after the work enqueued on its
  // allocation stream and on `stream` (see the file comment).
  absl::Status Deallocate(DevicePtr ptr, std::size_t bytes,
                          StreamHandle stream) const noexcept {
    absl::Status s =
        session_ != nullptr
            ? session_->Deallocate(ptr, bytes, stream)
            : allocator_->Deallocate(ptr, FreeCheck{.owner = kNoOwner,
                                                    .check_size = true,
                                                    .requested_bytes = bytes,
                                                    .order_after_stream = true,
                                                    .stream = stream});
    if (ABSL_PREDICT_FALSE(!s.ok())) LastFreeError() = s;
    return s;
  }

  // The alignment every block has: a block starts at a multiple of the
  // allocator's rounding unit (a power of two: its options check it) from its
  // segment's base, and a base is aligned to at least the 256 B that
  // cuMemAlloc guarantees. So: round_bytes, at most 256.
  std::size_t max_alignment() const noexcept {
    const std::size_t unit = allocator_->options().round_bytes;
    return unit < 256 ? unit : 256;
  }
  // OK when every block satisfies `alignment`: a power of two up to
  // max_alignment(). INVALID_ARGUMENT naming `who` otherwise.
  absl::Status CheckAlignment(std::size_t alignment, const char* who) const {
    if (ABSL_PREDICT_TRUE(alignment != 0 &&
                          (alignment & (alignment - 1)) == 0 &&
                          alignment <= max_alignment())) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: alignment %u is not a power of two up to %u (ctxpool's block "
        "alignment)",
        who, alignment, max_alignment()));
  }

  CachingDeviceAllocator& allocator() const noexcept { return *allocator_; }
  // The session, or null for a plain ref.
  ModelSession* session() const noexcept { return session_; }

  // The same allocator and the same session (one owner each), or both plain.
  friend bool operator==(const MemoryRef& a, const MemoryRef& b) noexcept {
    return a.allocator_ == b.allocator_ && a.session_ == b.session_;
  }

 private:
  CachingDeviceAllocator* allocator_;
  ModelSession* session_ = nullptr;
};

}  // namespace ctxpool::interop

#endif  // CTXPOOL_INTEROP_MEMORY_REF_H_
