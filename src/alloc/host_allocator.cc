#include "ctxpool/alloc/host_allocator.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/internal/table_room.h"
#include "pending_frees.h"

namespace ctxpool {
namespace {

enum class HostBlockState : std::uint8_t { kLive, kPending, kCached };

// One pinned buffer: one cuMemHostAlloc of a class size.
struct HostBlock {
  void* ptr = nullptr;
  std::size_t size = 0;       // class size (what was pinned)
  std::size_t requested = 0;  // while live
  int cls = 0;
  StreamHandle stream;  // allocation stream
  HostBlockState state = HostBlockState::kCached;
  // Deallocate could neither query nor record an event on a stream: the
  // buffer waits for a context synchronise at Reset.
  bool needs_sync = false;
  absl::InlinedVector<StreamHandle, 2> streams;  // RecordStream'd, not `stream`
  alloc_internal::EventList events;              // while pending
  HostBlock* next_free = nullptr;                // free list of its class
};

std::uintptr_t Addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

std::size_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return HostSizeClasses::kMaxBytes;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page_size);
}

}  // namespace

class CachingHostAllocator::Impl {
 public:
  Impl(Driver& driver, HostAllocatorOptions options, ContextHandle ctx,
       bool retained)
      : driver_(driver),
        options_(options),
        classes_(options.classes_per_doubling),
        ctx_(ctx),
        retained_(retained),
        free_heads_(static_cast<std::size_t>(classes_.num_classes()), nullptr),
        events_(driver) {}

  ~Impl() {
    // In a forked child the pinned buffers, events and context belong to the
    // parent's driver state: touch none of it, leak it.
    if (fork_guard_.InForkedChild()) return;
    // A buffer the driver refuses to free stays cached after Reset; one more
    // try, then it is leaked (the driver frees pinned memory at exit).
    try {
      if (!Reset(/*force=*/true).ok()) Reset(/*force=*/true).IgnoreError();
    } catch (const std::bad_alloc&) {
      ReleaseInPlace();  // Reset's lists found no host memory
    }
    // One registration at a time (no list to allocate: a destructor must
    // not throw std::bad_alloc); one the driver refuses to unpin is left.
    for (std::uintptr_t after = 0;;) {
      std::uintptr_t addr = 0;
      {
        absl::MutexLock lock(&mu_);
        auto it = registrations_.lower_bound(after);
        while (it != registrations_.end() && !it->second.active) ++it;
        if (it == registrations_.end()) break;
        addr = it->first;
      }
      Unregister(reinterpret_cast<void*>(addr)).IgnoreError();
      after = addr + 1;
    }
    ScopedContext guard(driver_, ctx_);
    events_.DestroyPooled();
    if (retained_) driver_.PrimaryCtxRelease(options_.device).IgnoreError();
  }

  Driver& driver() const { return driver_; }
  const HostAllocatorOptions& options() const { return options_; }
  std::size_t RoundedSize(std::size_t bytes) const {
    return classes_.RoundUp(std::min(bytes, HostSizeClasses::kMaxBytes));
  }

  absl::StatusOr<void*> Allocate(std::size_t bytes, StreamHandle stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::Allocate"));
    if (bytes > options_.max_request_bytes) {
      absl::MutexLock lock(&mu_);
      ++invalid_requests_;
      return absl::InvalidArgumentError(core_internal::Format(
          "CachingHostAllocator::Allocate: %d bytes is more than the largest "
          "pinned request allowed (%d bytes, the host's memory unless set)",
          bytes, options_.max_request_bytes));
    }
    const int cls = classes_.Index(bytes);
    const std::size_t size = classes_.ClassSize(cls);
    std::vector<std::unique_ptr<HostBlock>> to_free;
    absl::Status budget_error;
    {
      absl::MutexLock lock(&mu_);
      ++num_allocs_;
      if (!pending_.empty()) PollPending(/*all=*/false);
      if (free_heads_[cls] == nullptr && !pending_.empty()) {
        PollPending(/*all=*/true);
      }
      if (HostBlock* b = free_heads_[cls]; b != nullptr) {  // the hot path
        free_heads_[cls] = b->next_free;
        b->next_free = nullptr;
        cached_bytes_ -= size;
        --cached_count_;
        MakeLive(b, bytes, stream);
        ++cache_hits_;
        return b->ptr;
      }
      if (options_.host_budget_bytes != 0 &&
          Usage() + size > options_.host_budget_bytes) {
        TakeCached(/*keep_bytes=*/0, &to_free);
        if (Usage() + size > options_.host_budget_bytes) {
          ++num_budget_failures_;
          budget_error = BudgetError("Allocate", bytes, size);
        }
      }
      if (budget_error.ok()) in_flight_bytes_ += size;
    }
    if (!budget_error.ok()) {
      FreeBlocks(std::move(to_free)).IgnoreError();
      return budget_error;
    }
    FreeBlocks(std::move(to_free)).IgnoreError();
    absl::StatusOr<void*> p = PinNew(size);
    if (!p.ok() && p.status().code() == absl::StatusCode::kResourceExhausted) {
      {
        absl::MutexLock lock(&mu_);
        PollPending(/*all=*/true);
        try {
          TakeCached(/*keep_bytes=*/0, &to_free);
        } catch (const std::bad_alloc&) {
          in_flight_bytes_ -= size;  // nothing taken: as it was
          throw;
        }
      }
      if (!to_free.empty()) {
        FreeBlocks(std::move(to_free)).IgnoreError();
        p = PinNew(size);
      }
    }
    absl::ReleasableMutexLock lock(&mu_);
    in_flight_bytes_ -= size;
    if (!p.ok()) {
      if (p.status().code() == absl::StatusCode::kResourceExhausted) {
        ++num_ooms_;
      }
      absl::Status error(
          p.status().code(),
          core_internal::Format(
              "CachingHostAllocator::Allocate(%d bytes, class %d "
              "bytes): %s; pinned %d bytes, registered %d bytes",
              bytes, size, p.status().message(), pinned_bytes(),
              registered_bytes_));
      p.status().ForEachPayload(
          [&error](absl::string_view url, const absl::Cord& payload) {
            error.SetPayload(url, payload);
          });
      return error;
    }
    // Host memory before the books change: the block and its place on the
    // books (Admit). Without it the new buffer goes back to the driver.
    std::unique_ptr<HostBlock> block;
    try {
      block = std::make_unique<HostBlock>();
      Admit(*p, size);
    } catch (const std::bad_alloc&) {
      lock.Release();
      ScopedContext guard(driver_, ctx_);
      if (guard.status().ok()) driver_.MemFreeHost(*p).IgnoreError();
      throw;
    }
    ++upstream_allocs_;
    HostBlock* b = block.get();
    b->ptr = *p;
    b->size = size;
    b->cls = cls;
    blocks_.emplace(Addr(b->ptr), std::move(block));
    MakeLive(b, bytes, stream);
    peak_pinned_ = std::max(peak_pinned_, pinned_bytes());
    return b->ptr;
  }

  absl::Status Deallocate(void* ptr) noexcept ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::Deallocate"));
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(Addr(ptr));
    if (it == blocks_.end() || it->second->state != HostBlockState::kLive) {
      ++invalid_frees_;
      try {
        if (it != blocks_.end()) {
          return absl::InvalidArgumentError(core_internal::Format(
              "CachingHostAllocator::Deallocate(%p): double free (the buffer "
              "is already free)",
              ptr));
        }
        return absl::InvalidArgumentError(core_internal::Format(
            "CachingHostAllocator::Deallocate(%p): not the start of a live "
            "buffer of this allocator",
            ptr));
      } catch (const std::bad_alloc&) {
        return invalid_free_;  // a copy shares the message: no allocation
      }
    }
    // Room in the pending queue is kept for every block (Allocate), so
    // nothing below allocates but the events of a busy stream.
    if (ABSL_PREDICT_FALSE(pending_.size() == pending_.capacity())) {
      try {
        core_internal::MakeVectorRoom(pending_, 1);
      } catch (const std::bad_alloc&) {
        return host_oom_;  // the buffer stays live
      }
    }
    HostBlock* b = it->second.get();
    live_bytes_ -= b->size;
    requested_bytes_ -= b->requested;
    --live_count_;
    b->requested = 0;
    {
      ScopedContext guard(driver_, ctx_);
      if (!guard.status().ok()) {
        b->needs_sync = true;
      } else {
        // An event list that cannot grow (host memory) is a stream not
        // ordered: the buffer then waits for a synchronise, as when an event
        // record fails. The events recorded so far stay on the list.
        try {
          MarkStreamUse(b, b->stream);
          for (StreamHandle s : b->streams) MarkStreamUse(b, s);
        } catch (const std::bad_alloc&) {
          b->needs_sync = true;
        }
      }
    }
    b->streams.clear();
    if (b->events.empty() && !b->needs_sync) {
      PushFree(b);
    } else {
      b->state = HostBlockState::kPending;
      pending_bytes_ += b->size;
      ++pending_count_;
      pending_.push_back(b);
    }
    return absl::OkStatus();
  }

  absl::Status RecordStream(void* ptr, StreamHandle stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::RecordStream"));
    absl::MutexLock lock(&mu_);
    auto it = blocks_.find(Addr(ptr));
    if (it == blocks_.end() || it->second->state != HostBlockState::kLive) {
      ++invalid_requests_;
      return absl::InvalidArgumentError(core_internal::Format(
          "CachingHostAllocator::RecordStream(%p): not a live buffer of this "
          "allocator",
          ptr));
    }
    HostBlock* b = it->second.get();
    if (stream != b->stream && std::find(b->streams.begin(), b->streams.end(),
                                         stream) == b->streams.end()) {
      b->streams.push_back(stream);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TrimResult> Trim(std::size_t keep_bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("CachingHostAllocator::Trim"));
    std::vector<std::unique_ptr<HostBlock>> to_free;
    TrimResult result;
    {
      absl::MutexLock lock(&mu_);
      ++num_trims_;
      PollPending(/*all=*/true);
      TakeCached(keep_bytes, &to_free);
      for (const auto& b : to_free) result.freed_bytes += b->size;
      result.busy_bytes = pending_bytes_;
      result.remaining_bytes = pinned_bytes();
    }
    CTXPOOL_RETURN_IF_ERROR(FreeBlocks(std::move(to_free)));
    return result;
  }

  absl::Status Reset(bool force) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("CachingHostAllocator::Reset"));
    std::vector<std::unique_ptr<HostBlock>> taken;
    std::vector<std::unique_ptr<HostBlock>> keep;
    std::vector<std::unique_ptr<HostBlock>> to_free;
    bool any_needs_sync = false;
    {
      absl::MutexLock lock(&mu_);
      if (live_count_ > 0 && !force) {
        std::string list;
        int shown = 0;
        for (const auto& [addr, b] : blocks_) {
          if (b->state != HostBlockState::kLive) continue;
          if (shown++ == 8) {
            absl::StrAppend(&list, ", ...");
            break;
          }
          core_internal::AppendFormat(&list, "%s%p (%d bytes)",
                                      list.empty() ? "" : ", ", b->ptr,
                                      b->size);
        }
        return absl::FailedPreconditionError(core_internal::Format(
            "CachingHostAllocator::Reset: %d live buffers (%d bytes): %s; "
            "deallocate them or pass force=true",
            live_count_, live_bytes_, list));
      }
      // Host memory first: the lists every block may go to.
      taken.reserve(blocks_.size());
      keep.reserve(blocks_.size());
      to_free.reserve(blocks_.size());
      for (auto& [addr, b] : blocks_) {
        if (b->needs_sync) any_needs_sync = true;
        b->next_free = nullptr;
        taken.push_back(std::move(b));
      }
      ClearBooks();
    }
    absl::Status first_error;
    {
      ScopedContext guard(driver_, ctx_);
      if (any_needs_sync) first_error.Update(driver_.CtxSynchronize());
      for (auto& b : taken) {
        absl::Status s = b->needs_sync ? first_error : absl::OkStatus();
        for (EventHandle e : b->events) {
          if (s.ok()) s = driver_.EventSynchronize(e);
        }
        first_error.Update(s);
        (s.ok() ? to_free : keep).push_back(std::move(b));
      }
    }
    {
      absl::MutexLock lock(&mu_);
      for (auto& b : to_free) {
        events_.Recycle(&b->events);
      }
      for (auto& b : keep) {  // still in use by a stream: stays pending
        if (!Readmit(b)) continue;
        b->state = HostBlockState::kPending;
        pending_bytes_ += b->size;
        ++pending_count_;
        pending_.push_back(b.get());
        HostBlock* raw = b.get();
        blocks_.emplace(Addr(raw->ptr), std::move(b));
      }
    }
    first_error.Update(FreeBlocks(std::move(to_free)));
    return first_error;
  }

  absl::Status Register(void* ptr, std::size_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::Register"));
    std::vector<std::unique_ptr<HostBlock>> to_free;
    absl::Status budget_error;
    {
      absl::MutexLock lock(&mu_);
      if (ptr == nullptr || bytes == 0 || Addr(ptr) + bytes < Addr(ptr)) {
        ++invalid_requests_;
        return absl::InvalidArgumentError(core_internal::Format(
            "CachingHostAllocator::Register(%p, %d): null or empty range", ptr,
            bytes));
      }
      if (std::string what = Overlap(Addr(ptr), bytes); !what.empty()) {
        ++invalid_requests_;
        return absl::InvalidArgumentError(core_internal::Format(
            "CachingHostAllocator::Register(%p, %d bytes): overlaps %s", ptr,
            bytes, what));
      }
      if (options_.host_budget_bytes != 0 &&
          Usage() + bytes > options_.host_budget_bytes) {
        TakeCached(/*keep_bytes=*/0, &to_free);
        if (Usage() + bytes > options_.host_budget_bytes) {
          ++num_budget_failures_;
          budget_error = BudgetError("Register", bytes, bytes);
        }
      }
      if (budget_error.ok()) {
        // Reserve the range so a concurrent Register sees it. A std::map:
        // unchanged if the insert throws (then the cache freed above goes
        // back to the driver on the way out, see below).
        try {
          registrations_.emplace(Addr(ptr), Registration{bytes, false});
        } catch (const std::bad_alloc&) {
          budget_error = host_oom_;
        }
        if (budget_error.ok()) registering_bytes_ += bytes;
      }
    }
    FreeBlocks(std::move(to_free)).IgnoreError();
    if (!budget_error.ok()) return budget_error;
    absl::Status s;
    {
      ScopedContext guard(driver_, ctx_);
      s = guard.status();
      if (s.ok()) {
        s = driver_.MemHostRegister(ptr, bytes, options_.host_register_flags);
      }
    }
    absl::MutexLock lock(&mu_);
    registering_bytes_ -= bytes;
    if (!s.ok()) {
      registrations_.erase(Addr(ptr));
      return s;
    }
    registrations_.find(Addr(ptr))->second.active = true;
    registered_bytes_ += bytes;
    return absl::OkStatus();
  }

  absl::Status Unregister(void* ptr) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::Unregister"));
    std::size_t bytes = 0;
    {
      absl::MutexLock lock(&mu_);
      auto it = registrations_.find(Addr(ptr));
      if (it == registrations_.end() || !it->second.active) {
        ++invalid_requests_;
        return absl::InvalidArgumentError(core_internal::Format(
            "CachingHostAllocator::Unregister(%p): not the start of a "
            "registration",
            ptr));
      }
      it->second.active = false;  // reserved until the driver answers
      bytes = it->second.bytes;
    }
    absl::Status s;
    {
      ScopedContext guard(driver_, ctx_);
      s = guard.status();
      if (s.ok()) s = driver_.MemHostUnregister(ptr);
    }
    absl::MutexLock lock(&mu_);
    if (!s.ok()) {
      registrations_.find(Addr(ptr))->second.active = true;
      return s;
    }
    registrations_.erase(Addr(ptr));
    registered_bytes_ -= bytes;
    return absl::OkStatus();
  }

  bool IsRegistered(const void* ptr, std::size_t bytes) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (fork_guard_.InForkedChild()) return false;  // the parent's pins
    absl::MutexLock lock(&mu_);
    auto it = registrations_.upper_bound(Addr(ptr));
    if (it == registrations_.begin()) return false;
    --it;
    return it->second.active && Addr(ptr) >= it->first &&
           Addr(ptr) + bytes <= it->first + it->second.bytes;
  }

  HostAllocatorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    HostAllocatorStats s;
    s.live_bytes = live_bytes_;
    s.live_count = live_count_;
    s.requested_bytes = requested_bytes_;
    s.cached_bytes = cached_bytes_;
    s.cached_count = cached_count_;
    s.pending_bytes = pending_bytes_;
    s.pending_count = pending_count_;
    s.pinned_bytes = pinned_bytes();
    s.peak_pinned_bytes = peak_pinned_;
    s.registered_bytes = registered_bytes_;
    s.registered_count = 0;
    for (const auto& [a, r] : registrations_) s.registered_count += r.active;
    s.host_budget_bytes = options_.host_budget_bytes;
    s.num_allocs = num_allocs_;
    s.cache_hits = cache_hits_;
    s.upstream_allocs = upstream_allocs_;
    s.upstream_frees = upstream_frees_;
    s.events_recorded = events_.recorded();
    s.num_trims = num_trims_;
    s.num_budget_failures = num_budget_failures_;
    s.num_ooms = num_ooms_;
    s.invalid_frees = invalid_frees_;
    s.invalid_requests = invalid_requests_;
    return s;
  }

  FragmentationStats Fragmentation() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    FragmentationStats f;
    f.free_bytes = cached_bytes_;
    f.free_blocks = cached_count_;
    for (int c = classes_.num_classes() - 1; c >= 0; --c) {
      if (free_heads_[c] != nullptr) {
        f.largest_free_bytes = classes_.ClassSize(c);
        break;
      }
    }
    if (f.free_bytes > 0) {
      f.external = 1.0 - static_cast<double>(f.largest_free_bytes) /
                             static_cast<double>(f.free_bytes);
    }
    f.rounding_waste_bytes = live_bytes_ - requested_bytes_;
    if (live_bytes_ > 0) {
      f.rounding_waste = static_cast<double>(f.rounding_waste_bytes) /
                         static_cast<double>(live_bytes_);
      f.reserved_over_live = static_cast<double>(pinned_bytes()) /
                             static_cast<double>(live_bytes_);
    }
    return f;
  }

  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("CachingHostAllocator::CheckInvariants"));
    absl::MutexLock lock(&mu_);
    std::size_t live = 0, cached = 0, pending = 0, requested = 0;
    std::size_t nlive = 0, ncached = 0, npending = 0;
    for (const auto& [addr, b] : blocks_) {
      if (addr != Addr(b->ptr)) return Broken("block key != block ptr");
      if (b->size != classes_.ClassSize(b->cls)) {
        return Broken("block size != class size");
      }
      auto r = ranges_.find(addr);
      if (r == ranges_.end() || r->second != b->size) {
        return Broken("block missing from the address index");
      }
      switch (b->state) {
        case HostBlockState::kLive:
          live += b->size;
          requested += b->requested;
          ++nlive;
          if (b->requested > b->size) return Broken("requested > size");
          if (!b->events.empty()) return Broken("live block has events");
          break;
        case HostBlockState::kCached:
          cached += b->size;
          ++ncached;
          if (!b->events.empty()) return Broken("cached block has events");
          break;
        case HostBlockState::kPending:
          pending += b->size;
          ++npending;
          break;
      }
    }
    if (ranges_.size() != blocks_.size()) {
      return Broken("address index size != block count");
    }
    if (pending_.capacity() < blocks_.size()) {
      return Broken("no room in the pending queue for every block");
    }
    std::uintptr_t end = 0;
    for (const auto& [addr, size] : ranges_) {
      if (addr < end) return Broken("pinned buffers overlap");
      end = addr + size;
    }
    if (live != live_bytes_ || nlive != live_count_) {
      return Broken(
          core_internal::Format("live_bytes %d/%d != sum of live blocks "
                                "%d/%d",
                                live_bytes_, live_count_, live, nlive));
    }
    if (requested != requested_bytes_) return Broken("requested_bytes");
    if (cached != cached_bytes_ || ncached != cached_count_) {
      return Broken("cached_bytes != sum of cached blocks");
    }
    if (pending != pending_bytes_ || npending != pending_count_ ||
        pending_.size() != npending) {
      return Broken("pending_bytes != sum of pending blocks");
    }
    std::size_t listed = 0;
    for (int c = 0; c < classes_.num_classes(); ++c) {
      for (const HostBlock* b = free_heads_[c]; b != nullptr;
           b = b->next_free) {
        if (b->state != HostBlockState::kCached || b->cls != c) {
          return Broken("free list holds a block of another state or class");
        }
        if (++listed > ncached) return Broken("free lists longer than cache");
      }
    }
    if (listed != ncached) return Broken("cached block not in a free list");
    for (const HostBlock* b : pending_) {
      if (b->state != HostBlockState::kPending) {
        return Broken("pending queue holds a non-pending block");
      }
    }
    std::size_t reg = 0;
    end = 0;
    for (const auto& [addr, r] : registrations_) {
      if (addr < end) return Broken("registrations overlap");
      end = addr + r.bytes;
      if (r.active) reg += r.bytes;
    }
    if (reg != registered_bytes_) return Broken("registered_bytes");
    if (options_.host_budget_bytes != 0 &&
        Usage() > options_.host_budget_bytes) {
      return Broken(core_internal::Format("usage %d > host budget %d", Usage(),
                                          options_.host_budget_bytes));
    }
    return absl::OkStatus();
  }

 private:
  struct Registration {
    std::size_t bytes = 0;
    bool active = false;  // false while the driver call is in flight
  };

  static absl::Status Broken(absl::string_view what) {
    return absl::InternalError(
        absl::StrCat("CachingHostAllocator invariant broken: ", what));
  }

  std::size_t pinned_bytes() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return live_bytes_ + cached_bytes_ + pending_bytes_;
  }
  // Bytes counted against the host budget.
  std::size_t Usage() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return pinned_bytes() + in_flight_bytes_ + registered_bytes_ +
           registering_bytes_;
  }

  // The error of a request over the host budget; without host memory to
  // say more, a shorter one made up front (never throws).
  absl::Status BudgetError(absl::string_view call, std::size_t bytes,
                           std::size_t size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    try {
      return BudgetErrorText(call, bytes, size);
    } catch (const std::bad_alloc&) {
      return budget_exhausted_;
    }
  }
  absl::Status BudgetErrorText(absl::string_view call, std::size_t bytes,
                               std::size_t size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::string msg = core_internal::Format(
        "CachingHostAllocator::%s(%d bytes, %d after rounding): host budget "
        "of %d pinned bytes exhausted: %d in use (live %d, pending %d, cached "
        "%d, being pinned %d, registered %d); registered memory counts against "
        "the budget",
        call, bytes, size, options_.host_budget_bytes, Usage(), live_bytes_,
        pending_bytes_, cached_bytes_, in_flight_bytes_,
        registered_bytes_ + registering_bytes_);
    if (!options_.host_budget_source.empty()) {
      absl::StrAppend(&msg, "; the budget is ", options_.host_budget_source);
    }
    return absl::ResourceExhaustedError(msg);
  }

  // "registration [a, b)" or "pinned buffer [a, b)", or "" when free.
  std::string Overlap(std::uintptr_t addr, std::size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto check = [&](const auto& map, auto size_of,
                     absl::string_view what) -> std::string {
      auto it = map.lower_bound(addr + bytes);  // first start >= end
      if (it == map.begin()) return "";
      --it;  // last start < end
      const std::size_t size = size_of(it->second);
      if (it->first + size > addr) {
        return core_internal::Format("%s [%#x, %#x)", what, it->first,
                                     it->first + size);
      }
      return "";
    };
    std::string r = check(
        registrations_, [](const Registration& x) { return x.bytes; },
        "registration");
    if (r.empty()) {
      r = check(
          ranges_, [](std::size_t s) { return s; },
          "a pinned buffer of this allocator");
    }
    return r;
  }

  void MakeLive(HostBlock* b, std::size_t requested, StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    b->state = HostBlockState::kLive;
    b->requested = requested;
    b->stream = stream;
    b->needs_sync = false;
    live_bytes_ += b->size;
    requested_bytes_ += requested;
    ++live_count_;
  }

  void PushFree(HostBlock* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    b->state = HostBlockState::kCached;
    b->next_free = free_heads_[b->cls];
    free_heads_[b->cls] = b;
    cached_bytes_ += b->size;
    ++cached_count_;
  }

  // Deallocate: makes later reuse of `b` wait for the work now on `s`; a
  // stream neither queried nor given an event leaves `b` to a synchronise.
  void MarkStreamUse(HostBlock* b, StreamHandle s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!events_.MarkStreamUse(s, &b->events)) b->needs_sync = true;
  }

  // Moves pending blocks whose events completed to the free lists. With
  // `all` false it stops at the first block still pending (oldest first).
  void PollPending(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pending_.empty()) return;
    ScopedContext guard(driver_, ctx_);
    if (!guard.status().ok()) return;
    const std::size_t n = pending_.size();
    std::size_t kept = 0;
    std::size_t i = 0;
    while (i < n) {
      HostBlock* b = pending_[i++];
      if (EventsComplete(b)) {
        pending_bytes_ -= b->size;
        --pending_count_;
        PushFree(b);
      } else {
        pending_[kept++] = b;
        if (!all) break;
      }
    }
    while (i < n) pending_[kept++] = pending_[i++];
    pending_.resize(kept);
  }

  // True when every event of pending `b` completed (they go back to the pool).
  bool EventsComplete(HostBlock* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !b->needs_sync && events_.Complete(&b->events);
  }

  // Removes cached blocks, largest class first, until at most `keep_bytes`
  // stay cached; they go to `out` to be unpinned without the lock.
  void TakeCached(std::size_t keep_bytes,
                  std::vector<std::unique_ptr<HostBlock>>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    core_internal::MakeVectorRoom(*out, cached_count_);  // may throw: first
    for (int c = classes_.num_classes() - 1;
         c >= 0 && cached_bytes_ > keep_bytes; --c) {
      while (free_heads_[c] != nullptr && cached_bytes_ > keep_bytes) {
        HostBlock* b = free_heads_[c];
        free_heads_[c] = b->next_free;
        b->next_free = nullptr;
        cached_bytes_ -= b->size;
        --cached_count_;
        auto it = blocks_.find(Addr(b->ptr));
        ranges_.erase(it->first);
        out->push_back(std::move(it->second));
        blocks_.erase(it);
      }
    }
  }

  absl::StatusOr<void*> PinNew(std::size_t size) ABSL_LOCKS_EXCLUDED(mu_) {
    ScopedContext guard(driver_, ctx_);
    CTXPOOL_RETURN_IF_ERROR(guard.status());
    return driver_.MemHostAlloc(size, options_.host_alloc_flags);
  }

  // Forgets every buffer (their owners moved them out or freed them).
  void ClearBooks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    blocks_.clear();
    ranges_.clear();
    pending_.clear();
    std::fill(free_heads_.begin(), free_heads_.end(), nullptr);
    live_bytes_ = live_count_ = requested_bytes_ = 0;
    cached_bytes_ = cached_count_ = pending_bytes_ = pending_count_ = 0;
  }

  // The destructor's last resort when Reset found no host memory for its
  // lists: waits for every buffer's events and frees it in place, taking no
  // memory. A buffer the driver refuses to free is leaked (the driver frees
  // pinned memory at exit).
  void ReleaseInPlace() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    ScopedContext guard(driver_, ctx_);
    if (guard.status().ok()) {
      bool any_needs_sync = false;
      for (const auto& [addr, b] : blocks_) any_needs_sync |= b->needs_sync;
      const bool synced = !any_needs_sync || driver_.CtxSynchronize().ok();
      for (auto& [addr, b] : blocks_) {
        bool done = synced || !b->needs_sync;
        for (EventHandle e : b->events) {
          done = done && driver_.EventSynchronize(e).ok();
        }
        events_.Recycle(&b->events);  // the pool has room for every event
        if (done && driver_.MemFreeHost(b->ptr).ok()) ++upstream_frees_;
      }
    }
    ClearBooks();
  }

  // The host memory a buffer at `ptr` of `size` bytes takes on the books:
  // room for it in blocks_ and in the pending queue (Deallocate, noexcept,
  // must not allocate), and its entry in ranges_; the caller then puts it
  // in blocks_, which cannot allocate. Throws std::bad_alloc with the books
  // as they were (ranges_ is a std::map, unchanged by a throwing insert).
  void Admit(void* ptr, std::size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!core_internal::TableHasRoom(blocks_, 1)) {
      core_internal::MakeRoom(blocks_, 1);
    }
    core_internal::MakeVectorRoom(pending_,
                                  blocks_.size() + 1 - pending_.size());
    ranges_.emplace(Addr(ptr), size);
  }

  // Admit for block `b` (taken off the books, still pinned). False when
  // host memory ran out: the block is then released from its owner and its
  // pinned memory left to the driver (a driver failure and host memory
  // running out at once).
  bool Readmit(std::unique_ptr<HostBlock>& b)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    try {
      Admit(b->ptr, b->size);
      return true;
    } catch (const std::bad_alloc&) {
      events_.Recycle(&b->events);
      (void)b.release();  // leaked: its events are back in the pool
      return false;
    }
  }

  // Returns `blocks` to the driver. A block the driver refuses to free goes
  // back to the cache (the next Trim or Reset retries it), so no pinned byte
  // ever leaves the books; the first such error is returned.
  absl::Status FreeBlocks(std::vector<std::unique_ptr<HostBlock>> blocks)
      ABSL_LOCKS_EXCLUDED(mu_) {
    if (blocks.empty()) return absl::OkStatus();
    std::int64_t freed = 0;
    absl::Status first_error;
    std::size_t kept = 0;  // those the driver refused, moved to the front
    {
      ScopedContext guard(driver_, ctx_);
      for (auto& b : blocks) {
        absl::Status s = guard.status();
        if (s.ok()) s = driver_.MemFreeHost(b->ptr);
        if (s.ok()) {
          ++freed;
          b.reset();
        } else {
          first_error.Update(s);
          blocks[kept++] = std::move(b);
        }
      }
    }
    absl::MutexLock lock(&mu_);
    upstream_frees_ += freed;
    for (std::size_t i = 0; i < kept; ++i) {
      std::unique_ptr<HostBlock>& b = blocks[i];
      if (!Readmit(b)) continue;
      HostBlock* raw = b.get();
      blocks_.emplace(Addr(raw->ptr), std::move(b));
      PushFree(raw);
    }
    return first_error;
  }

  Driver& driver_;
  const HostAllocatorOptions options_;
  const HostSizeClasses classes_;
  const ContextHandle ctx_;
  const bool retained_;
  const ForkGuard fork_guard_;  // after fork(): every call fails

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::uintptr_t, std::unique_ptr<HostBlock>> blocks_
      ABSL_GUARDED_BY(mu_);
  // std::map, not absl::btree_map: an insert that throws std::bad_alloc
  // leaves it as it was (a btree's may leak the node it split).
  std::map<std::uintptr_t, std::size_t> ranges_ ABSL_GUARDED_BY(mu_);
  std::vector<HostBlock*> free_heads_ ABSL_GUARDED_BY(mu_);
  std::vector<HostBlock*> pending_ ABSL_GUARDED_BY(mu_);  // oldest first
  alloc_internal::PendingEvents events_ ABSL_GUARDED_BY(mu_);
  std::map<std::uintptr_t, Registration> registrations_ ABSL_GUARDED_BY(mu_);
  // Errors made up front, for when host memory runs out on the way to a
  // longer one (a copy shares the message: no allocation).
  const absl::Status host_oom_ = absl::ResourceExhaustedError(
      "CachingHostAllocator: out of host memory; nothing changed");
  const absl::Status invalid_free_ = absl::InvalidArgumentError(
      "CachingHostAllocator::Deallocate: not the start of a live buffer of "
      "this allocator (or a double free)");
  const absl::Status budget_exhausted_ = absl::ResourceExhaustedError(
      "CachingHostAllocator: host budget of pinned bytes exhausted");

  std::size_t live_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t live_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t requested_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t cached_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t pending_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t in_flight_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t registering_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::size_t peak_pinned_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_allocs_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t cache_hits_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t upstream_allocs_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t upstream_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_budget_failures_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_ooms_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_requests_ ABSL_GUARDED_BY(mu_) = 0;
};

absl::StatusOr<std::unique_ptr<CachingHostAllocator>>
CachingHostAllocator::Create(Driver& driver, HostAllocatorOptions options) {
  const int d = options.classes_per_doubling;
  if (d < 1 || d > HostSizeClasses::kMaxClassesPerDoubling || (d & (d - 1))) {
    return absl::InvalidArgumentError(core_internal::Format(
        "CachingHostAllocator: classes_per_doubling must be a power of two in "
        "[1, %d], got %d",
        HostSizeClasses::kMaxClassesPerDoubling, d));
  }
  const std::size_t limit =
      std::min(PhysicalMemoryBytes(), HostSizeClasses::kMaxBytes);
  if (options.max_request_bytes == 0 || options.max_request_bytes > limit) {
    options.max_request_bytes = limit;
  }
  ContextHandle ctx = options.context;
  bool retained = false;
  if (ctx.is_null()) {
    CTXPOOL_ASSIGN_OR_RETURN(ctx, driver.PrimaryCtxRetain(options.device));
    retained = true;
  }
  return std::unique_ptr<CachingHostAllocator>(new CachingHostAllocator(
      std::make_unique<Impl>(driver, options, ctx, retained)));
}

CachingHostAllocator::CachingHostAllocator(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
CachingHostAllocator::~CachingHostAllocator() = default;

absl::StatusOr<void*> CachingHostAllocator::Allocate(std::size_t bytes,
                                                     StreamHandle stream) {
  return impl_->Allocate(bytes, stream);
}
absl::Status CachingHostAllocator::Deallocate(void* ptr) noexcept {
  return impl_->Deallocate(ptr);
}
absl::Status CachingHostAllocator::RecordStream(void* ptr,
                                                StreamHandle stream) {
  return impl_->RecordStream(ptr, stream);
}
absl::StatusOr<TrimResult> CachingHostAllocator::Trim(std::size_t keep_bytes) {
  return impl_->Trim(keep_bytes);
}
absl::Status CachingHostAllocator::Reset(bool force) {
  return impl_->Reset(force);
}
absl::Status CachingHostAllocator::Register(void* ptr, std::size_t bytes) {
  return impl_->Register(ptr, bytes);
}
absl::Status CachingHostAllocator::Unregister(void* ptr) {
  return impl_->Unregister(ptr);
}
bool CachingHostAllocator::IsRegistered(const void* ptr,
                                        std::size_t bytes) const {
  return impl_->IsRegistered(ptr, bytes);
}
HostAllocatorStats CachingHostAllocator::Stats() const {
  return impl_->Stats();
}
FragmentationStats CachingHostAllocator::Fragmentation() const {
  return impl_->Fragmentation();
}
std::size_t CachingHostAllocator::RoundedSize(std::size_t bytes) const {
  return impl_->RoundedSize(bytes);
}
absl::Status CachingHostAllocator::CheckInvariants() const {
  return impl_->CheckInvariants();
}
Driver& CachingHostAllocator::driver() const { return impl_->driver(); }
const HostAllocatorOptions& CachingHostAllocator::options() const {
  return impl_->options();
}

}  // namespace ctxpool
