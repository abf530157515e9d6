// ctxpool/trace/trace.h — allocation trace events and the in-memory trace.
//
// A trace is the ordered list of what an allocator was asked and did:
// allocations, frees (when the caller freed), free completions (when the
// memory really became reusable after its streams finished), segment maps and
// unmaps (memory taken from or given back to the driver), trims and
// out-of-memory failures. Each event carries a time, the pointer, the size in
// bytes, the stream and the tenant (model) it belongs to.
//
// Traces come from three places and all end up as a `Trace`:
//   * TraceRecorder (recorder.h) — an allocator's own ring buffer;
//   * trace files (trace_io.h) — ctxpool CSV, RMM's logging_resource_adaptor
//     CSV, or the JSON form tools/torch_snapshot_to_trace.py writes from a
//     PyTorch memory snapshot;
//   * workload generators (workloads.h).
// A trace is replayed against any allocator configuration by replay.h.
//
//   Trace t;
//   t.Append({.op = TraceOp::kAlloc, .ptr = 0x1000, .size = 4096});
//   t.Append({.op = TraceOp::kFree, .ptr = 0x1000, .size = 4096});
//   CTXPOOL_RETURN_IF_ERROR(t.Validate());
//   TraceSummary s = Summarize(t);   // s.peak_live_bytes == 4096
//
// Validity (Validate): sizes are >= 0 (they are unsigned once parsed), an
// allocation's pointer is not live, a free names a live pointer (and, when
// its size is non-zero, the size it was allocated with). Pointers may be
// reused after they are freed, as real allocators do. Allocations still live
// at the end of a trace are simply never freed.
//
// Thread-safety: Trace is a plain value type; const methods may be called
// concurrently, mutation needs external synchronisation.
#ifndef CTXPOOL_TRACE_TRACE_H_
#define CTXPOOL_TRACE_TRACE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ctxpool {

// What happened. The numeric values are stable (they appear in no file: files
// use the names from TraceOpName).
enum class TraceOp : std::uint8_t {
  kAlloc = 0,          // a caller got `ptr` of `size` bytes
  kFree = 1,           // the caller freed `ptr` (stream-ordered)
  kFreeCompleted = 2,  // `ptr`'s memory became reusable (its streams finished)
  kSegmentMap = 3,     // the allocator took `size` bytes at `ptr` from the
                       // driver (cuMemAlloc, or cuMemCreate + cuMemMap)
  kSegmentUnmap = 4,   // ... and gave them back
  kTrim = 5,           // a Trim released `size` bytes
  kOom = 6,            // an allocation of `size` bytes failed
};
inline constexpr int kTraceOpCount = 7;

// The name used in files: "allocate", "free", "free_completed",
// "segment_map", "segment_unmap", "trim", "allocate failure" (the last is
// RMM's spelling of an OOM).
absl::string_view TraceOpName(TraceOp op);
// Inverse of TraceOpName; also accepts "alloc", "oom", "segment_alloc",
// "segment_free", "free_requested" (PyTorch's names). Case-sensitive.
std::optional<TraceOp> ParseTraceOp(absl::string_view name);

// One event. 40 bytes, trivially copyable.
struct TraceEvent {
  std::int64_t time_ns = 0;  // since the trace's start (monotonic)
  TraceOp op = TraceOp::kAlloc;
  std::uint32_t tenant = 0;  // model / session id; 0 = none
  std::uint64_t ptr = 0;     // device address (or any unique id)
  std::uint64_t size = 0;    // bytes requested (alloc, free, oom) or moved
  std::uint64_t stream = 0;  // stream id as the recorder saw it (0 = default)
  std::uint64_t thread = 0;  // recording thread; informational only

  friend bool operator==(const TraceEvent&, const TraceEvent&) = default;
};

// An ordered list of events and where it came from.
class Trace {
 public:
  Trace() = default;
  explicit Trace(std::vector<TraceEvent> events) : events_(std::move(events)) {}

  void Append(const TraceEvent& event) { events_.push_back(event); }
  void Reserve(std::size_t n) { events_.reserve(n); }

  const std::vector<TraceEvent>& events() const { return events_; }
  std::vector<TraceEvent>& mutable_events() { return events_; }
  std::size_t size() const { return events_.size(); }
  bool empty() const { return events_.empty(); }

  // Free-form provenance ("rmm:/path/file.csv", "workload:llm-serving").
  const std::string& source() const { return source_; }
  void set_source(std::string source) { source_ = std::move(source); }

  // Events a ring buffer overwrote before this trace was taken (0 for files).
  std::uint64_t dropped_events() const { return dropped_events_; }
  void set_dropped_events(std::uint64_t n) { dropped_events_ = n; }

  // Checks the validity rules in the file comment. INVALID_ARGUMENT naming
  // the first offending event ("event 12: free of unknown pointer 0x...").
  absl::Status Validate() const;

  friend bool operator==(const Trace& a, const Trace& b) {
    return a.events_ == b.events_;
  }

 private:
  std::vector<TraceEvent> events_;
  std::string source_;
  std::uint64_t dropped_events_ = 0;
};

// Power-of-two size bucket: allocations with size in [lo, 2*lo).
struct SizeBucket {
  std::uint64_t lo = 0;  // 0 for size 0, else a power of two
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;
};

// What a trace asks for, independent of any allocator. Live bytes are the
// sum of the sizes of allocations not yet freed (kFree ends an allocation).
struct TraceSummary {
  std::uint64_t events = 0;
  std::uint64_t op_counts[kTraceOpCount] = {};
  std::uint64_t allocs = 0;       // == op_counts[kAlloc]
  std::uint64_t frees = 0;        // == op_counts[kFree]
  std::uint64_t alloc_bytes = 0;  // total bytes ever allocated
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t peak_live_event = 0;  // index of the event that set the peak
  std::uint64_t peak_live_count = 0;  // live allocations at any moment, max
  std::uint64_t end_live_bytes = 0;   // still live after the last event
  std::uint64_t end_live_count = 0;
  std::uint64_t min_size = 0;  // over allocations (0 when none)
  std::uint64_t max_size = 0;
  std::int64_t duration_ns = 0;            // last time − first time
  std::vector<std::uint64_t> streams;      // distinct ids, ascending
  std::vector<std::uint32_t> tenants;      // distinct ids, ascending
  std::vector<SizeBucket> size_histogram;  // non-empty buckets, ascending
};

// Summarises a trace. Frees of unknown pointers are ignored here (Validate
// reports them).
TraceSummary Summarize(const Trace& trace);

// Parses a byte count: "4096", "64MiB", "24GiB", "1.5GB", "512k". Binary
// suffixes (KiB, MiB, GiB, TiB, and K/M/G/T alone) are powers of 1024; decimal
// ones (KB, MB, GB, TB) powers of 1000. Case-insensitive. INVALID_ARGUMENT on
// anything else, including negative numbers.
absl::StatusOr<std::uint64_t> ParseByteSize(absl::string_view text);
// "1.50 GiB", "20.00 MiB", "512 B": binary units, two decimals.
std::string FormatBytes(std::uint64_t bytes);

}  // namespace ctxpool

#endif  // CTXPOOL_TRACE_TRACE_H_
