#include "ctxpool/trace/recorder.h"

#include <algorithm>
#include <atomic>
#include <chrono>

namespace ctxpool {
namespace {

std::int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

TraceRecorder::TraceRecorder() = default;

void TraceRecorder::Enable(std::size_t capacity) {
  capacity = std::max<std::size_t>(capacity, 1);
  absl::MutexLock lock(&mu_);
  ring_.assign(capacity, TraceEvent{});
  next_ = 0;
  recorded_ = 0;
  epoch_ns_.store(MonotonicNs(), std::memory_order_relaxed);
  enabled_.store(true, std::memory_order_release);
}

void TraceRecorder::Disable() {
  absl::MutexLock lock(&mu_);
  enabled_.store(false, std::memory_order_release);
}

void TraceRecorder::Record(const TraceEvent& event) {
  absl::MutexLock lock(&mu_);
  if (!enabled_.load(std::memory_order_relaxed) || ring_.empty()) return;
  ring_[next_] = event;
  next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
  ++recorded_;
}

void TraceRecorder::Record(TraceOp op, std::uint64_t ptr, std::uint64_t size,
                           std::uint64_t stream, std::uint32_t tenant) {
  TraceEvent e;
  e.op = op;
  e.ptr = ptr;
  e.size = size;
  e.stream = stream;
  e.tenant = tenant;
  e.thread = ThreadId();
  e.time_ns = NowNs();
  Record(e);
}

Trace TraceRecorder::Snapshot() const {
  absl::MutexLock lock(&mu_);
  const std::size_t cap = ring_.size();
  const std::size_t n =
      static_cast<std::size_t>(std::min<std::uint64_t>(recorded_, cap));
  std::vector<TraceEvent> events;
  events.reserve(n);
  const std::size_t start = (next_ + cap - n) % std::max<std::size_t>(cap, 1);
  for (std::size_t i = 0; i < n; ++i)
    events.push_back(ring_[(start + i) % cap]);
  Trace t(std::move(events));
  t.set_source("recorder");
  t.set_dropped_events(recorded_ - n);
  return t;
}

void TraceRecorder::Clear() {
  absl::MutexLock lock(&mu_);
  next_ = 0;
  recorded_ = 0;
}

std::size_t TraceRecorder::capacity() const {
  absl::MutexLock lock(&mu_);
  return ring_.size();
}

std::uint64_t TraceRecorder::recorded() const {
  absl::MutexLock lock(&mu_);
  return recorded_;
}

std::int64_t TraceRecorder::NowNs() const {
  return MonotonicNs() - epoch_ns_.load(std::memory_order_relaxed);
}

std::uint64_t TraceRecorder::ThreadId() {
  static std::atomic<std::uint64_t> next_id{1};
  thread_local const std::uint64_t id =
      next_id.fetch_add(1, std::memory_order_relaxed);
  return id;
}

}  // namespace ctxpool
