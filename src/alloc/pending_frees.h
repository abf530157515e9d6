// src/alloc/pending_frees.h — the events behind stream-ordered frees
// (internal to the pinned-host and slab allocators; not API).
//
// A buffer freed while a stream may still read or write it must not be
// handed out again before that stream's work completes. Both allocators do
// it the same way, never blocking the host: at free time each stream that
// used the buffer is queried (cuStreamQuery); on a busy one an event from a
// pool is recorded and the buffer becomes "pending". Later calls poll the
// pending buffers' events (cuEventQuery, newest first), and every completed
// event goes back to the pool, so a steady state creates no events.
//
//   PendingEvents events_ ABSL_GUARDED_BY(mu_){driver};
//   // Deallocate, lock held, context current:
//   if (!events_.MarkStreamUse(stream, &block->events)) block->needs_sync =
//   true;
//   // Polling, lock held, context current:
//   if (events_.Complete(&block->events)) ReuseNow(block);
//
// Thread-safety: not thread-safe. The owner declares it ABSL_GUARDED_BY its
// mutex, so clang's -Wthread-safety checks that every call holds the lock.
// Stream order: a list whose events are all complete orders nothing any
// more; the events of one list may sit on different streams.
#ifndef CTXPOOL_SRC_ALLOC_PENDING_FREES_H_
#define CTXPOOL_SRC_ALLOC_PENDING_FREES_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "ctxpool/core/internal/table_room.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {
namespace alloc_internal {

// The events a pending buffer waits for (one per busy stream; most buffers
// are used by one or two streams).
using EventList = absl::InlinedVector<EventHandle, 2>;

class PendingEvents {
 public:
  explicit PendingEvents(Driver& driver) : driver_(driver) {}
  PendingEvents(const PendingEvents&) = delete;
  PendingEvents& operator=(const PendingEvents&) = delete;

  // Orders a later reuse after the work now enqueued on `stream`: nothing to
  // do when the stream is idle; else an event (pooled, or created without
  // timing) is recorded on `stream` and appended to `events`. Returns false
  // when neither could be done (the caller must fall back to a host
  // synchronise); the event, if any, goes back to the pool.
  // Throws std::bad_alloc (host memory) before any event is taken, with
  // `events` and the pool as they were.
  // REQUIRES: the context of `stream` is current.
  bool MarkStreamUse(StreamHandle stream, EventList* events) {
    absl::StatusOr<bool> idle = driver_.StreamQuery(stream);
    if (idle.ok() && *idle) return true;
    events->reserve(events->size() + 1);
    EventHandle e;
    if (!pool_.empty()) {
      e = pool_.back();
      pool_.pop_back();
    } else {
      // The pool has room for every event ever created, so that returning
      // one to it (Complete, Recycle) never allocates.
      Reserve(1);
      absl::StatusOr<EventHandle> created =
          driver_.EventCreate(kEventDisableTiming);
      if (!created.ok()) return false;
      ++created_;
      e = *created;
    }
    if (!driver_.EventRecord(e, stream).ok()) {
      pool_.push_back(e);
      return false;
    }
    ++recorded_;
    events->push_back(e);
    return true;
  }

  // Room for `n` more events to be created, so that the next `n`
  // MarkStreamUse calls on lists with room of their own cannot throw.
  // Throws std::bad_alloc with nothing changed.
  void Reserve(std::size_t n) {
    core_internal::MakeVectorRoom(pool_, created_ + n - pool_.size());
  }

  // Queries `events` newest first and returns each completed one to the
  // pool; stops at the first that has not completed (or whose query fails).
  // True when the list is empty: the buffer may be reused.
  // REQUIRES: the context of the events is current.
  bool Complete(EventList* events) {
    while (!events->empty()) {
      absl::StatusOr<bool> done = driver_.EventQuery(events->back());
      if (!done.ok() || !*done) return false;
      pool_.push_back(events->back());
      events->pop_back();
    }
    return true;
  }

  // Returns `events` to the pool without a query: the caller synchronised
  // them (or dropped the work they order).
  void Recycle(EventList* events) {
    pool_.insert(pool_.end(), events->begin(), events->end());
    events->clear();
  }

  // Destroys the pooled events (at the owner's destruction).
  // REQUIRES: the context of the events is current; no list still holds an
  // event of this pool that the caller wants to query later.
  void DestroyPooled() {
    for (EventHandle e : pool_) driver_.EventDestroy(e).IgnoreError();
    created_ -= std::min(created_, pool_.size());
    pool_.clear();
  }

  // Events recorded so far (a busy stream seen by MarkStreamUse).
  std::int64_t recorded() const { return recorded_; }

 private:
  Driver& driver_;
  std::vector<EventHandle> pool_;  // capacity >= created_
  std::size_t created_ = 0;
  std::int64_t recorded_ = 0;
};

}  // namespace alloc_internal
}  // namespace ctxpool

#endif  // CTXPOOL_SRC_ALLOC_PENDING_FREES_H_
