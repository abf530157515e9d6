// ctxpool/trace/trace_io.h — reading and writing allocation traces.
//
// Three file forms, all read by one reader that detects the form:
//
// 1. ctxpool CSV, a superset of RMM's logging_resource_adaptor log:
//
//      Thread,Time,Action,Pointer,Size,Stream,Tenant
//      1,00:00:00.000001500,allocate,0x7f0000000000,4096,0x0,3
//      1,00:00:00.000002000,free,0x7f0000000000,4096,0x0,3
//
//    Time is HH:MM:SS.fraction (hours may exceed 24; up to 9 fraction
//    digits, i.e. nanoseconds). Action is a TraceOpName: "allocate",
//    "free", "free_completed", "segment_map", "segment_unmap", "trim",
//    "allocate failure". Pointer and Stream are hex (0x...) or decimal.
//    Columns are found by header name, in any order; Thread, Time, Stream and
//    Tenant are optional (Time defaults to the event index in microseconds).
//    Blank lines and lines starting with '#' are skipped.
//
// 2. RMM's own CSV (Thread,Time,Action,Pointer,Size,Stream) is form 1
//    without the Tenant column: RMM logs are read as they are, and
//    WriteTraceCsv(trace, {.rmm_compatible = true}) writes a file RMM's
//    replay benchmark reads (alloc/free/failure only, no Tenant).
//
// 3. JSON, the form tools/torch_snapshot_to_trace.py writes from a PyTorch
//    torch.cuda.memory._snapshot() pickle:
//
//      {"format": "ctxpool-trace", "version": 1, "source": "...",
//       "events": [
//         {"time_ns": 0, "op": "allocate", "ptr": 139637976727552,
//          "size": 4096, "stream": 0, "tenant": 0},
//         {"time_ns": 10, "op": "free", "ptr": "0x7f0000000000", "size": 4096}
//       ]}
//
//    "op" and "ptr" and "size" are required; "ptr" and "stream" may be
//    numbers or hex strings; "time_ns" defaults to the event's index, "stream",
//    "tenant" and "thread" to 0. Other keys are ignored.
//
// The reader validates as it goes and rejects a malformed trace with the line
// number: missing columns or fields, a negative or unparsable size, an
// unknown action, an allocation of a live pointer, and (by default) a free of
// a pointer that is not live:
//
//   absl::StatusOr<Trace> t = ReadTraceFile("run.rmm.csv");
//   // t.status(): INVALID_ARGUMENT "run.rmm.csv:7: free of unknown pointer
//   //             0x1234"
//
// Thread-safety: all functions are pure (they may run concurrently).
#ifndef CTXPOOL_TRACE_TRACE_IO_H_
#define CTXPOOL_TRACE_TRACE_IO_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/trace/trace.h"

namespace ctxpool {

enum class TraceFormat {
  kAuto,  // '{' first -> JSON, else CSV
  kCsv,   // ctxpool or RMM CSV
  kJson,
};

// What to do with a free of a pointer that is not live: a trace cut from a
// ring buffer or a snapshot misses the allocations made before it started.
enum class UnknownFreePolicy {
  kError,            // reject with the line number (default)
  kSynthesizeAlloc,  // add an allocation of that pointer and size at the top
                     // (the convention of the traces in ../shared/traces)
  kIgnore,           // drop the free
};

struct TraceReadOptions {
  TraceFormat format = TraceFormat::kAuto;
  UnknownFreePolicy unknown_free = UnknownFreePolicy::kError;
};

// Parses `text`. `name` prefixes error messages ("name:LINE: ...") and
// becomes the trace's source.
absl::StatusOr<Trace> ParseTrace(absl::string_view text,
                                 absl::string_view name = "trace",
                                 const TraceReadOptions& options = {});
// Reads a file (NOT_FOUND when it cannot be opened).
absl::StatusOr<Trace> ReadTraceFile(const std::string& path,
                                    const TraceReadOptions& options = {});

struct TraceCsvOptions {
  // Only allocate / free / "allocate failure" rows and no Tenant column, so
  // RMM's log parser accepts the file.
  bool rmm_compatible = false;
};

// Writes form 1 (or 2). ParseTrace(WriteTraceCsv(t)) == t, except for the
// Thread column, which is written and read back as a number.
std::string WriteTraceCsv(const Trace& trace,
                          const TraceCsvOptions& options = {});
// Writes form 3, one event per line.
std::string WriteTraceJson(const Trace& trace);
// Writes `contents` to `path` (INTERNAL when the file cannot be written).
absl::Status WriteFile(const std::string& path, absl::string_view contents);

}  // namespace ctxpool

#endif  // CTXPOOL_TRACE_TRACE_IO_H_
