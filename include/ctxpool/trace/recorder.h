// ctxpool/trace/recorder.h — an allocator's optional trace ring buffer.
//
// TraceRecorder keeps the last `capacity` TraceEvents an allocator reports
// (allocations, frees, free completions, segment maps and unmaps, trims,
// OOMs). It is off by default; when off, the only cost on an allocator's hot
// path is one relaxed atomic load and a predictable branch:
//
//   // In the allocator (owner of a TraceRecorder recorder_):
//   if (recorder_.enabled()) {
//     recorder_.Record(TraceOp::kAlloc, ptr.address(), requested_bytes,
//                      stream.value(), tenant);
//   }
//
//   // A user or tool:
//   recorder.Enable(/*capacity=*/1 << 20);
//   ... run the workload ...
//   Trace t = recorder.Snapshot();     // oldest first
//   WriteFile("run.csv", WriteTraceCsv(t));
//
// When the buffer is full the oldest events are overwritten and counted
// (Trace::dropped_events()); a trace with dropped events may free pointers
// whose allocation was overwritten: read it back with
// UnknownFreePolicy::kSynthesizeAlloc (trace_io.h).
//
// Thread-safety: all methods are thread-safe. Record takes one internal mutex
// (never calls out while holding it), so an allocator may call it with its own
// lock held. Events from different threads are stored in the order their
// Record calls took the mutex.
#ifndef CTXPOOL_TRACE_RECORDER_H_
#define CTXPOOL_TRACE_RECORDER_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/trace/trace.h"

namespace ctxpool {

class TraceRecorder {
 public:
  // A disabled recorder with no buffer (no memory is allocated until Enable).
  TraceRecorder();
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  // True while recording. One relaxed load: test it before building an event.
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Starts recording into a ring buffer of `capacity` events, dropping what
  // was recorded before. Times are measured from this call.
  // REQUIRES: capacity > 0.
  void Enable(std::size_t capacity = std::size_t{1} << 16)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Stops recording; what was recorded stays readable by Snapshot.
  void Disable() ABSL_LOCKS_EXCLUDED(mu_);

  // Appends `event` as given (time, thread and all). Dropped silently when
  // the recorder is disabled.
  void Record(const TraceEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  // Appends an event stamped with the time since Enable and a small id of
  // the calling thread (1, 2, ... in order of first use).
  void Record(TraceOp op, std::uint64_t ptr, std::uint64_t size,
              std::uint64_t stream, std::uint32_t tenant = 0)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The buffered events, oldest first, with dropped_events() set to the
  // number overwritten since Enable. Does not clear the buffer.
  Trace Snapshot() const ABSL_LOCKS_EXCLUDED(mu_);
  // Empties the buffer and the dropped count (recording state unchanged).
  void Clear() ABSL_LOCKS_EXCLUDED(mu_);

  std::size_t capacity() const ABSL_LOCKS_EXCLUDED(mu_);
  // Events recorded since Enable, including overwritten ones.
  std::uint64_t recorded() const ABSL_LOCKS_EXCLUDED(mu_);

  // Nanoseconds since Enable (monotonic clock).
  std::int64_t NowNs() const;
  // The calling thread's small id.
  static std::uint64_t ThreadId();

 private:
  std::atomic<bool> enabled_{false};
  // Written only under mu_ by Enable; read by NowNs without it.
  std::atomic<std::int64_t> epoch_ns_{0};
  mutable absl::Mutex mu_;
  std::vector<TraceEvent> ring_ ABSL_GUARDED_BY(mu_);
  std::size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // slot of the next event
  std::uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ctxpool

#endif  // CTXPOOL_TRACE_RECORDER_H_
