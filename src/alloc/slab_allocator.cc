#include "ctxpool/alloc/slab_allocator.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/core/fork_guard.h"
#include "ctxpool/core/internal/format.h"
#include "ctxpool/core/internal/table_room.h"
#include "pending_frees.h"

namespace ctxpool {

int SlabClassIndex(std::size_t bytes) {
  if (bytes <= kSlabMinObjectBytes) return 0;
  return std::bit_width(bytes - 1) - 3;
}

namespace {

enum class SlabList : std::uint8_t { kNone, kPartial, kEmpty };

// One slab: slab_bytes carved from the device allocator for one stream.
struct Slab {
  DevicePtr base;
  StreamHandle stream;
  int cls = -1;  // -1 while empty
  std::uint32_t capacity = 0;
  std::uint32_t used = 0;           // set bits: live + pending objects
  std::uint32_t hint = 0;           // no zero bit in words before it
  std::vector<std::uint64_t> bits;  // 1 = slot in use; padding bits are 1
  SlabList list = SlabList::kNone;
  Slab* prev = nullptr;
  Slab* next = nullptr;
  absl::Time empty_since;
};

// The per-stream lists.
struct StreamSlabs {
  std::array<Slab*, kNumSlabClasses> partial{};  // 0 < used < capacity
  Slab* empty_head = nullptr;                    // oldest first
  Slab* empty_tail = nullptr;
};

struct PendingObject {
  Slab* slab = nullptr;
  std::uint32_t slot = 0;
  alloc_internal::EventList events;
};

}  // namespace

class SlabAllocator::Impl {
 public:
  Impl(CachingDeviceAllocator& device, SlabAllocatorOptions options,
       ContextHandle ctx, bool retained)
      : device_(device),
        driver_(device.driver()),
        options_(std::move(options)),
        ctx_(ctx),
        retained_(retained),
        events_(driver_) {
    for (int c = 0; c < kNumSlabClasses; ++c) {
      class_stats_[c].object_bytes = SlabClassBytes(c);
    }
  }

  ~Impl() {
    // In a forked child the slabs (the device allocator's blocks), events and
    // context belong to the parent's driver state: touch none of it, leak it.
    if (fork_guard_.InForkedChild()) return;
    try {
      Reset(/*force=*/true).IgnoreError();
    } catch (const std::bad_alloc&) {
      ReleaseInPlace();  // Reset's lists found no host memory
    }
    ScopedContext guard(driver_, ctx_);
    events_.DestroyPooled();
    if (retained_) driver_.PrimaryCtxRelease(device_.device()).IgnoreError();
  }

  CachingDeviceAllocator& device() const { return device_; }
  const SlabAllocatorOptions& options() const { return options_; }

  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes, StreamHandle stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("SlabAllocator::Allocate"));
    if (bytes > kSlabMaxObjectBytes) {
      absl::MutexLock lock(&mu_);
      ++invalid_requests_;
      return absl::InvalidArgumentError(core_internal::Format(
          "SlabAllocator::Allocate: %d bytes is above the largest slab class "
          "(%d bytes); use the device allocator",
          bytes, kSlabMaxObjectBytes));
    }
    const int cls = SlabClassIndex(bytes);
    {
      absl::MutexLock lock(&mu_);
      ++num_allocs_;
      if (!pending_.empty()) PollPending(/*all=*/false);
      StreamSlabs& ss = StreamOf(stream);
      if (Slab* s = ss.partial[cls]; s != nullptr) return Take(ss, s);  // hot
      MaybeDecay();
      if (!pending_.empty()) {
        PollPending(/*all=*/true);
        if (Slab* s = ss.partial[cls]; s != nullptr) return Take(ss, s);
      }
      if (Slab* s = ss.empty_head; s != nullptr) {
        PrepareFormat(s, cls);  // may throw std::bad_alloc: nothing changed
        Unlink(ss, s);
        Format(s, cls);
        LinkPartial(ss, s);
        return Take(ss, s);
      }
    }
    // A new slab, without the lock: the device allocator may take its time.
    absl::StatusOr<DevicePtr> base =
        device_.Allocate(options_.slab_bytes, stream);
    if (!base.ok() &&
        base.status().code() == absl::StatusCode::kResourceExhausted) {
      if (ReturnEmptySlabs() > 0) {
        base = device_.Allocate(options_.slab_bytes, stream);
      }
    }
    absl::ReleasableMutexLock lock(&mu_);
    if (!base.ok()) return base.status();
    // Host memory before the books change: the slab, its bitmap, its
    // stream's lists (Reset may have dropped them meanwhile) and its entry
    // in slabs_ (a std::map: unchanged if the insert throws). Without it the
    // slab goes back to the device allocator.
    Slab* s = nullptr;
    StreamSlabs* ss = nullptr;
    try {
      auto owned = std::make_unique<Slab>();
      s = owned.get();
      s->base = *base;
      s->stream = stream;
      PrepareFormat(s, cls);
      ss = &StreamOf(stream);
      slabs_.emplace(base->address(), std::move(owned));
    } catch (const std::bad_alloc&) {
      lock.Release();
      device_.Deallocate(*base).IgnoreError();
      throw;
    }
    ++slabs_allocated_;
    Format(s, cls);
    LinkPartial(*ss, s);
    return Take(*ss, s);
  }

  absl::Status Deallocate(DevicePtr ptr) noexcept ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("SlabAllocator::Deallocate"));
    absl::MutexLock lock(&mu_);
    Slab* s = nullptr;
    std::uint32_t slot = 0;
    absl::Status found;
    try {
      found = Find(ptr, "Deallocate", &s, &slot);
    } catch (const std::bad_alloc&) {
      found = invalid_free_;  // a copy shares the message: no allocation
    }
    if (!found.ok()) {
      ++invalid_frees_;
      return found;
    }
    auto it =
        recorded_.empty() ? recorded_.end() : recorded_.find(ptr.address());
    // Host memory first (a pending entry, an event for each stream, room
    // in its list): without it the object stays live.
    alloc_internal::EventList events;
    if (it != recorded_.end()) {
      try {
        if (!core_internal::TableHasRoom(pending_, 1)) {
          core_internal::MakeRoom(pending_, 1);
        }
        events.reserve(it->second.size());
        events_.Reserve(it->second.size());
      } catch (const std::bad_alloc&) {
        return host_oom_;
      }
    }
    ++num_frees_;
    --class_stats_[s->cls].live_objects;
    if (it != recorded_.end()) {
      {
        PendingObject p{s, slot, std::move(events)};
        {
          ScopedContext guard(driver_, ctx_);
          for (StreamHandle other : it->second) {
            MarkStreamUse(guard.status().ok(), other, &p);
          }
        }
        recorded_.erase(it);
        if (!p.events.empty()) {
          ++class_stats_[s->cls].pending_objects;
          pending_.emplace(ptr.address(), std::move(p));
          return absl::OkStatus();
        }
      }
    }
    Release(s, slot);
    return absl::OkStatus();
  }

  absl::Status RecordStream(DevicePtr ptr, StreamHandle stream)
      ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("SlabAllocator::RecordStream"));
    absl::MutexLock lock(&mu_);
    Slab* s = nullptr;
    std::uint32_t slot = 0;
    if (absl::Status st = Find(ptr, "RecordStream", &s, &slot); !st.ok()) {
      ++invalid_requests_;
      return st;
    }
    if (stream == s->stream) return absl::OkStatus();
    if (!core_internal::TableHasRoom(recorded_, 1)) {
      core_internal::MakeRoom(recorded_, 1);
    }
    auto& list = recorded_[ptr.address()];
    if (std::find(list.begin(), list.end(), stream) == list.end()) {
      list.push_back(stream);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<TrimResult> Trim() ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("SlabAllocator::Trim"));
    {
      absl::MutexLock lock(&mu_);
      ++num_trims_;
      PollPending(/*all=*/true);
    }
    TrimResult r;
    r.freed_bytes = ReturnEmptySlabs() * options_.slab_bytes;
    absl::MutexLock lock(&mu_);
    r.remaining_bytes = slabs_.size() * options_.slab_bytes;
    for (const auto& [addr, p] : pending_) {
      r.busy_bytes += SlabClassBytes(p.slab->cls);
    }
    return r;
  }

  absl::Status Reset(bool force) ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(fork_guard_.Check("SlabAllocator::Reset"));
    std::vector<std::unique_ptr<Slab>> taken;
    std::vector<EventHandle> waits;
    {
      absl::MutexLock lock(&mu_);
      std::size_t live = 0;
      for (const SlabClassStats& c : class_stats_) live += c.live_objects;
      if (live > 0 && !force) {
        return absl::FailedPreconditionError(core_internal::Format(
            "SlabAllocator::Reset: %d live objects in %d slabs; deallocate "
            "them or pass force=true",
            live, slabs_.size()));
      }
      for (auto& [addr, p] : pending_) {
        for (EventHandle e : p.events) waits.push_back(e);
      }
    }
    absl::Status error;
    {
      ScopedContext guard(driver_, ctx_);
      for (EventHandle e : waits) error.Update(driver_.EventSynchronize(e));
    }
    if (!error.ok()) return error;
    {
      absl::MutexLock lock(&mu_);
      taken.reserve(slabs_.size());  // may throw: first
      for (auto& [addr, p] : pending_) events_.Recycle(&p.events);
      for (auto& [addr, s] : slabs_) taken.push_back(std::move(s));
      ClearBooks();
    }
    for (auto& s : taken) error.Update(device_.Deallocate(s->base));
    return error;
  }

  SlabAllocatorStats Stats() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    SlabAllocatorStats st;
    st.classes = class_stats_;
    st.slabs_held = slabs_.size();
    st.empty_slabs = empty_slabs_;
    st.slab_bytes_held = slabs_.size() * options_.slab_bytes;
    for (int c = 0; c < kNumSlabClasses; ++c) {
      st.live_objects += class_stats_[c].live_objects;
      st.live_bytes += class_stats_[c].live_objects * SlabClassBytes(c);
      st.pending_objects += class_stats_[c].pending_objects;
    }
    for (const auto& [addr, s] : slabs_) {
      if (s->used > 0 && s->used < s->capacity) {
        st.fragmentation_bytes +=
            (s->capacity - s->used) * SlabClassBytes(s->cls);
      }
    }
    st.num_allocs = num_allocs_;
    st.num_frees = num_frees_;
    st.slabs_allocated = slabs_allocated_;
    st.slabs_returned = slabs_returned_;
    st.decay_returns = decay_returns_;
    st.num_trims = num_trims_;
    st.events_recorded = events_.recorded();
    st.invalid_frees = invalid_frees_;
    st.invalid_requests = invalid_requests_;
    return st;
  }

  FragmentationStats Fragmentation() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    FragmentationStats f;
    std::size_t live_bytes = 0;
    for (const auto& [addr, s] : slabs_) {
      if (s->used == 0) {
        f.free_bytes += options_.slab_bytes;
        f.largest_free_bytes = options_.slab_bytes;
        ++f.free_blocks;
      } else {
        const std::size_t object = SlabClassBytes(s->cls);
        live_bytes += s->used * object;
        if (s->used < s->capacity) {
          f.free_bytes += (s->capacity - s->used) * object;
          f.free_blocks += s->capacity - s->used;
          f.largest_free_bytes = std::max(f.largest_free_bytes, object);
        }
      }
    }
    if (f.free_bytes > 0) {
      f.external = 1.0 - static_cast<double>(f.largest_free_bytes) /
                             static_cast<double>(f.free_bytes);
    }
    if (live_bytes > 0) {
      f.reserved_over_live =
          static_cast<double>(slabs_.size() * options_.slab_bytes) /
          static_cast<double>(live_bytes);
    }
    return f;
  }

  absl::Status CheckInvariants() const ABSL_LOCKS_EXCLUDED(mu_) {
    CTXPOOL_RETURN_IF_ERROR(
        fork_guard_.Check("SlabAllocator::CheckInvariants"));
    absl::MutexLock lock(&mu_);
    std::array<SlabClassStats, kNumSlabClasses> sums{};
    std::size_t empty = 0;
    std::size_t partial = 0;
    std::uint64_t end = 0;
    for (const auto& [addr, s] : slabs_) {
      if (addr != s->base.address()) return Broken("slab key != base");
      if (addr < end) return Broken("slabs overlap");
      end = addr + options_.slab_bytes;
      std::uint32_t set = 0;
      for (std::uint64_t w : s->bits) set += std::popcount(w);
      const std::uint32_t padding =
          static_cast<std::uint32_t>(s->bits.size() * 64) - s->capacity;
      if (s->used == 0) {
        ++empty;
        if (s->list != SlabList::kEmpty) return Broken("empty slab unlisted");
        continue;
      }
      if (s->cls < 0 || s->cls >= kNumSlabClasses) return Broken("class");
      if (s->capacity != options_.slab_bytes / SlabClassBytes(s->cls)) {
        return Broken("capacity != slab_bytes / class bytes");
      }
      if (set != s->used + padding) {
        return Broken(core_internal::Format(
            "bitmap has %d bits, used %d + pad %d", set, s->used, padding));
      }
      for (std::uint32_t w = 0; w < s->hint && w < s->bits.size(); ++w) {
        if (s->bits[w] != ~std::uint64_t{0}) return Broken("hint skips a slot");
      }
      sums[s->cls].capacity += s->capacity;
      ++sums[s->cls].slabs;
      sums[s->cls].live_objects += s->used;  // minus pending below
      const bool full = s->used == s->capacity;
      if (full != (s->list == SlabList::kNone)) {
        return Broken("full slab listed, or partial slab unlisted");
      }
      if (!full) ++partial;
    }
    for (const auto& [addr, p] : pending_) {
      ++sums[p.slab->cls].pending_objects;
      --sums[p.slab->cls].live_objects;
      if ((p.slab->bits[p.slot / 64] >> (p.slot % 64) & 1) == 0) {
        return Broken("pending object's slot is free");
      }
    }
    for (int c = 0; c < kNumSlabClasses; ++c) {
      const SlabClassStats& a = class_stats_[c];
      const SlabClassStats& b = sums[c];
      if (a.live_objects != b.live_objects ||
          a.pending_objects != b.pending_objects || a.capacity != b.capacity ||
          a.slabs != b.slabs) {
        return Broken(core_internal::Format(
            "class %d stats (live %d pending %d capacity %d slabs %d) != "
            "slabs (live %d pending %d capacity %d slabs %d)",
            c, a.live_objects, a.pending_objects, a.capacity, a.slabs,
            b.live_objects, b.pending_objects, b.capacity, b.slabs));
      }
    }
    if (empty != empty_slabs_) return Broken("empty_slabs count");
    std::size_t listed_empty = 0, listed_partial = 0;
    for (const auto& [stream, ss] : streams_) {
      for (const Slab* s = ss.empty_head; s != nullptr; s = s->next) {
        if (s->stream != stream || s->used != 0) {
          return Broken("empty list holds a used or foreign slab");
        }
        if (++listed_empty > empty) return Broken("empty list cycle");
        if (s->next == nullptr && s != ss.empty_tail) {
          return Broken("empty tail");
        }
      }
      for (int c = 0; c < kNumSlabClasses; ++c) {
        for (const Slab* s = ss.partial[c]; s != nullptr; s = s->next) {
          if (s->stream != stream || s->cls != c || s->used == 0 ||
              s->used == s->capacity) {
            return Broken("partial list holds a wrong slab");
          }
          if (++listed_partial > partial) return Broken("partial list cycle");
        }
      }
    }
    if (listed_empty != empty || listed_partial != partial) {
      return Broken("slab missing from its list");
    }
    return absl::OkStatus();
  }

 private:
  static absl::Status Broken(absl::string_view what) {
    return absl::InternalError(
        absl::StrCat("SlabAllocator invariant broken: ", what));
  }

  absl::Time Now() const {
    return options_.clock ? options_.clock() : absl::Now();
  }

  // Finds the live object at `ptr`: INVALID_ARGUMENT naming what is wrong.
  absl::Status Find(DevicePtr ptr, absl::string_view call, Slab** slab,
                    std::uint32_t* slot) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = slabs_.upper_bound(ptr.address());
    if (it != slabs_.begin()) --it;
    if (it == slabs_.end() || ptr.address() < it->first ||
        ptr.address() >= it->first + options_.slab_bytes) {
      return absl::InvalidArgumentError(core_internal::Format(
          "SlabAllocator::%s(%#x): not an object of this allocator", call,
          ptr.address()));
    }
    Slab* s = it->second.get();
    const std::uint64_t offset = ptr.address() - it->first;
    if (s->used == 0) {
      return absl::InvalidArgumentError(core_internal::Format(
          "SlabAllocator::%s(%#x): double free (the slab is empty)", call,
          ptr.address()));
    }
    const std::size_t object = SlabClassBytes(s->cls);
    if (offset % object != 0) {
      return absl::InvalidArgumentError(core_internal::Format(
          "SlabAllocator::%s(%#x): points %d bytes into a %d-byte object", call,
          ptr.address(), offset % object, object));
    }
    const auto i = static_cast<std::uint32_t>(offset / object);
    if (i >= s->capacity || (s->bits[i / 64] >> (i % 64) & 1) == 0 ||
        (!pending_.empty() && pending_.contains(ptr.address()))) {
      return absl::InvalidArgumentError(core_internal::Format(
          "SlabAllocator::%s(%#x): double free (the object is not live)", call,
          ptr.address()));
    }
    *slab = s;
    *slot = i;
    return absl::OkStatus();
  }

  // The lists of `stream`, added on first use. Throws std::bad_alloc with
  // the table as it was (table_room.h).
  StreamSlabs& StreamOf(StreamHandle stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = streams_.find(stream);
    if (ABSL_PREDICT_TRUE(it != streams_.end())) return it->second;
    if (!core_internal::TableHasRoom(streams_, 1)) {
      core_internal::MakeRoom(streams_, 1);
    }
    return streams_[stream];
  }

  // Takes a free slot of partial slab `s` (the head of its list).
  DevicePtr Take(StreamSlabs& ss, Slab* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::uint32_t w = s->hint;
    while (s->bits[w] == ~std::uint64_t{0}) ++w;
    const int bit = std::countr_one(s->bits[w]);
    s->bits[w] |= std::uint64_t{1} << bit;
    s->hint = w;
    ++s->used;
    ++class_stats_[s->cls].live_objects;
    if (s->used == s->capacity) Unlink(ss, s);
    const std::uint32_t slot = w * 64 + static_cast<std::uint32_t>(bit);
    return s->base + std::uint64_t{slot} * SlabClassBytes(s->cls);
  }

  // Frees slot `slot` of `s` for reuse on s's stream.
  void Release(Slab* s, std::uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    s->bits[slot / 64] &= ~(std::uint64_t{1} << (slot % 64));
    s->hint = std::min(s->hint, slot / 64);
    StreamSlabs& ss = streams_.find(s->stream)->second;  // a slab's stream
    const bool was_full = s->used == s->capacity;
    --s->used;
    if (s->used == 0) {
      Unlink(ss, s);
      class_stats_[s->cls].capacity -= s->capacity;
      --class_stats_[s->cls].slabs;
      s->cls = -1;
      s->empty_since = Now();
      LinkEmpty(ss, s);
      MaybeDecay();
    } else if (was_full) {
      LinkPartial(ss, s);
    }
  }

  std::uint32_t CapacityOf(int cls) const {
    return static_cast<std::uint32_t>(options_.slab_bytes /
                                      SlabClassBytes(cls));
  }
  // Room in `s`'s bitmap for class `cls`, so that Format does not allocate.
  // Throws std::bad_alloc with `s` as it was.
  void PrepareFormat(Slab* s, int cls) const {
    s->bits.reserve((CapacityOf(cls) + 63) / 64);
  }
  // REQUIRES: PrepareFormat(s, cls).
  void Format(Slab* s, int cls) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    s->cls = cls;
    s->capacity = CapacityOf(cls);
    s->used = 0;
    s->hint = 0;
    s->bits.assign((s->capacity + 63) / 64, 0);
    if (const std::uint32_t tail = s->capacity % 64; tail != 0) {
      s->bits.back() = ~std::uint64_t{0} << tail;  // padding is "in use"
    }
    class_stats_[cls].capacity += s->capacity;
    ++class_stats_[cls].slabs;
  }

  void LinkPartial(StreamSlabs& ss, Slab* s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Slab*& head = ss.partial[s->cls];
    s->prev = nullptr;
    s->next = head;
    if (head != nullptr) head->prev = s;
    head = s;
    s->list = SlabList::kPartial;
  }

  void LinkEmpty(StreamSlabs& ss, Slab* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    s->next = nullptr;
    s->prev = ss.empty_tail;
    if (ss.empty_tail != nullptr) {
      ss.empty_tail->next = s;
    } else {
      ss.empty_head = s;
    }
    ss.empty_tail = s;
    s->list = SlabList::kEmpty;
    ++empty_slabs_;
  }

  void Unlink(StreamSlabs& ss, Slab* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (s->list == SlabList::kNone) return;
    if (s->list == SlabList::kEmpty) {
      --empty_slabs_;
      if (s->prev == nullptr) ss.empty_head = s->next;
      if (s->next == nullptr) ss.empty_tail = s->prev;
    } else if (s->prev == nullptr) {
      ss.partial[s->cls] = s->next;
    }
    if (s->prev != nullptr) s->prev->next = s->next;
    if (s->next != nullptr) s->next->prev = s->prev;
    s->prev = s->next = nullptr;
    s->list = SlabList::kNone;
  }

  // Deallocate: makes the slot wait for the work now on `other`.
  void MarkStreamUse(bool have_context, StreamHandle other, PendingObject* p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    // Without an event, ordering the slab's stream after `other` cannot be
    // done without a driver, so wait on the host (rare error path).
    // The same when host memory runs out for the event list.
    if (!have_context) return;
    bool ordered = false;
    try {
      ordered = events_.MarkStreamUse(other, &p->events);
    } catch (const std::bad_alloc&) {
    }
    if (!ordered) driver_.StreamSynchronize(other).IgnoreError();
  }

  void PollPending(bool all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (pending_.empty()) return;
    ScopedContext guard(driver_, ctx_);
    if (!guard.status().ok()) return;
    // A std::bad_alloc below leaves an object whose events completed
    // pending with an empty list: the next poll releases it.
    std::vector<std::uint64_t> done;
    for (auto& [addr, p] : pending_) {
      const bool ready = events_.Complete(&p.events);
      if (ready) done.push_back(addr);
      if (!ready && !all) break;
    }
    for (std::uint64_t addr : done) {
      auto it = pending_.find(addr);
      PendingObject p = std::move(it->second);
      pending_.erase(it);
      --class_stats_[p.slab->cls].pending_objects;
      Release(p.slab, p.slot);
    }
  }

  // Returns empty slabs at most every decay / 4, those empty for `decay`.
  void MaybeDecay() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (empty_slabs_ == 0 || options_.decay == absl::InfiniteDuration()) {
      return;
    }
    const absl::Time now = Now();
    if (now < next_decay_check_) return;
    // Host memory first; without it (Deallocate is noexcept) the check
    // waits for the next call.
    std::vector<DevicePtr> bases;
    try {
      bases.reserve(empty_slabs_);
    } catch (const std::bad_alloc&) {
      return;
    }
    next_decay_check_ = now + options_.decay / 4;
    for (auto& [stream, ss] : streams_) {
      while (ss.empty_head != nullptr &&
             now - ss.empty_head->empty_since >= options_.decay) {
        Slab* s = ss.empty_head;
        Unlink(ss, s);
        bases.push_back(s->base);
        slabs_.erase(s->base.address());
      }
    }
    decay_returns_ += static_cast<std::int64_t>(bases.size());
    slabs_returned_ += static_cast<std::int64_t>(bases.size());
    // The device allocator's Deallocate takes only its own lock and calls
    // nothing back, so it is safe under ours.
    for (DevicePtr b : bases) device_.Deallocate(b).IgnoreError();
  }

  // The destructor's last resort when Reset found no host memory for its
  // lists: waits for the pending objects' events and returns every slab in
  // place, taking no memory.
  void ReleaseInPlace() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    {
      ScopedContext guard(driver_, ctx_);
      for (auto& [addr, p] : pending_) {
        for (EventHandle e : p.events) {
          if (guard.status().ok()) driver_.EventSynchronize(e).IgnoreError();
        }
        events_.Recycle(&p.events);  // the pool has room for every event
      }
    }
    // The device allocator's Deallocate takes only its own lock.
    for (auto& [addr, s] : slabs_) device_.Deallocate(s->base).IgnoreError();
    ClearBooks();
  }

  // Forgets every slab and object (the caller returned the slabs or moved
  // them out, and recycled the pending objects' events); counts the slabs
  // as returned.
  void ClearBooks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    pending_.clear();
    recorded_.clear();
    streams_.clear();
    slabs_returned_ += static_cast<std::int64_t>(slabs_.size());
    slabs_.clear();
    for (SlabClassStats& c : class_stats_) {
      c.live_objects = c.pending_objects = c.capacity = c.slabs = 0;
    }
    empty_slabs_ = 0;
  }

  // Returns every empty slab; returns how many.
  std::size_t ReturnEmptySlabs() ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<DevicePtr> bases;
    {
      absl::MutexLock lock(&mu_);
      bases.reserve(empty_slabs_);  // may throw: first
      for (auto& [stream, ss] : streams_) {
        while (ss.empty_head != nullptr) {
          Slab* s = ss.empty_head;
          Unlink(ss, s);
          bases.push_back(s->base);
          slabs_.erase(s->base.address());
        }
      }
      slabs_returned_ += static_cast<std::int64_t>(bases.size());
    }
    for (DevicePtr b : bases) device_.Deallocate(b).IgnoreError();
    return bases.size();
  }

  CachingDeviceAllocator& device_;
  Driver& driver_;
  const SlabAllocatorOptions options_;
  const ContextHandle ctx_;
  const bool retained_;
  const ForkGuard fork_guard_;  // after fork(): every call fails

  mutable absl::Mutex mu_;
  // std::map, not absl::btree_map: an insert that throws std::bad_alloc
  // leaves it as it was (a btree's may leak the node it split).
  std::map<std::uint64_t, std::unique_ptr<Slab>> slabs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<StreamHandle, StreamSlabs> streams_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, absl::InlinedVector<StreamHandle, 2>>
      recorded_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::uint64_t, PendingObject> pending_
      ABSL_GUARDED_BY(mu_);
  alloc_internal::PendingEvents events_ ABSL_GUARDED_BY(mu_);
  std::array<SlabClassStats, kNumSlabClasses> class_stats_ ABSL_GUARDED_BY(mu_);
  std::size_t empty_slabs_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time next_decay_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::int64_t num_allocs_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t slabs_allocated_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t slabs_returned_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t decay_returns_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t num_trims_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_frees_ ABSL_GUARDED_BY(mu_) = 0;
  std::int64_t invalid_requests_ ABSL_GUARDED_BY(mu_) = 0;
  // Deallocate's errors when host memory runs out on the way to a longer
  // one, made up front (a copy shares the message: no allocation).
  const absl::Status host_oom_ = absl::ResourceExhaustedError(
      "SlabAllocator::Deallocate: out of host memory; the object stays live");
  const absl::Status invalid_free_ = absl::InvalidArgumentError(
      "SlabAllocator::Deallocate: not a live object of this allocator (or a "
      "double free)");
};

absl::StatusOr<std::unique_ptr<SlabAllocator>> SlabAllocator::Create(
    CachingDeviceAllocator& device, SlabAllocatorOptions options) {
  const std::size_t b = options.slab_bytes;
  if (b < kSlabMaxObjectBytes || b > (std::size_t{64} << 20) ||
      !std::has_single_bit(b)) {
    return absl::InvalidArgumentError(core_internal::Format(
        "SlabAllocator: slab_bytes must be a power of two in [64 KiB, "
        "64 MiB], got %d",
        b));
  }
  if (options.decay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("SlabAllocator: negative decay");
  }
  ContextHandle ctx = options.context;
  bool retained = false;
  if (ctx.is_null()) {
    CTXPOOL_ASSIGN_OR_RETURN(ctx,
                             device.driver().PrimaryCtxRetain(device.device()));
    retained = true;
  }
  return std::unique_ptr<SlabAllocator>(new SlabAllocator(
      std::make_unique<Impl>(device, std::move(options), ctx, retained)));
}

SlabAllocator::SlabAllocator(std::unique_ptr<Impl> impl)
    : impl_(std::move(impl)) {}
SlabAllocator::~SlabAllocator() = default;

absl::StatusOr<DevicePtr> SlabAllocator::Allocate(std::size_t bytes,
                                                  StreamHandle stream) {
  return impl_->Allocate(bytes, stream);
}
absl::Status SlabAllocator::Deallocate(DevicePtr ptr) noexcept {
  return impl_->Deallocate(ptr);
}
absl::Status SlabAllocator::RecordStream(DevicePtr ptr, StreamHandle stream) {
  return impl_->RecordStream(ptr, stream);
}
absl::StatusOr<TrimResult> SlabAllocator::Trim() { return impl_->Trim(); }
absl::Status SlabAllocator::Reset(bool force) { return impl_->Reset(force); }
SlabAllocatorStats SlabAllocator::Stats() const { return impl_->Stats(); }
FragmentationStats SlabAllocator::Fragmentation() const {
  return impl_->Fragmentation();
}
absl::Status SlabAllocator::CheckInvariants() const {
  return impl_->CheckInvariants();
}
CachingDeviceAllocator& SlabAllocator::device_allocator() const {
  return impl_->device();
}
const SlabAllocatorOptions& SlabAllocator::options() const {
  return impl_->options();
}

}  // namespace ctxpool
