// `ctxpool report TRACE [--json]`: what a trace asks of an allocator, as a
// table — event counts by kind, allocations and frees, peak live bytes (and
// when), what is still live at the end, streams, tenants, duration and the
// size histogram (power-of-two buckets). Needs no device and runs no
// allocator; `ctxpool replay` does that.
//
// TRACE is a file (ctxpool CSV, RMM log CSV, ctxpool-trace JSON) or
// "workload:NAME[:key=value,...]". Exit status: 0 on success, 1 when the
// trace cannot be read, 2 on a usage error.
#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"
#include "tools/commands.h"

namespace ctxpool::tool {
namespace {

void PrintReportUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: ctxpool report TRACE [--json] "
               "[--unknown-free error|synthesize|ignore]\n\n"
               "Summarises a trace: events by kind, peak live bytes, live at "
               "the end,\nstreams, tenants and the allocation size "
               "histogram.\n\n"
               "  TRACE   a trace file (ctxpool CSV, RMM log CSV, "
               "ctxpool-trace JSON)\n"
               "          or workload:NAME[:key=value,...] with NAME one of "
               "%s\n",
               absl::StrJoin(WorkloadNames(), ", ").c_str());
}

std::string Percent(std::uint64_t part, std::uint64_t whole) {
  if (whole == 0) return "-";
  return absl::StrFormat(
      "%.1f%%", 100.0 * static_cast<double>(part) / static_cast<double>(whole));
}

std::string ToJson(const Trace& t, const TraceSummary& s) {
  std::string out = "{";
  std::string source;
  for (char c : t.source()) {
    if (c == '"' || c == '\\') source.push_back('\\');
    if (static_cast<unsigned char>(c) >= 0x20) source.push_back(c);
  }
  absl::StrAppendFormat(&out, "\"trace\": \"%s\", \"events\": %d, ", source,
                        s.events);
  out += "\"op_counts\": {";
  for (int i = 0; i < kTraceOpCount; ++i) {
    absl::StrAppendFormat(&out, "%s\"%s\": %d", i == 0 ? "" : ", ",
                          TraceOpName(static_cast<TraceOp>(i)), s.op_counts[i]);
  }
  absl::StrAppendFormat(
      &out,
      "}, \"allocs\": %d, \"frees\": %d, \"alloc_bytes\": %d, "
      "\"peak_live_bytes\": %d, \"peak_live_event\": %d, "
      "\"peak_live_count\": %d, \"end_live_bytes\": %d, "
      "\"end_live_count\": %d, \"min_size\": %d, \"max_size\": %d, "
      "\"duration_ns\": %d, \"dropped_events\": %d, ",
      s.allocs, s.frees, s.alloc_bytes, s.peak_live_bytes, s.peak_live_event,
      s.peak_live_count, s.end_live_bytes, s.end_live_count, s.min_size,
      s.max_size, s.duration_ns, t.dropped_events());
  absl::StrAppendFormat(&out, "\"streams\": [%s], \"tenants\": [%s], ",
                        absl::StrJoin(s.streams, ", "),
                        absl::StrJoin(s.tenants, ", "));
  out += "\"size_histogram\": [";
  for (std::size_t i = 0; i < s.size_histogram.size(); ++i) {
    const SizeBucket& b = s.size_histogram[i];
    absl::StrAppendFormat(&out, "%s{\"lo\": %d, \"count\": %d, \"bytes\": %d}",
                          i == 0 ? "" : ", ", b.lo, b.count, b.bytes);
  }
  out += "]}";
  return out;
}

std::string ToTable(const Trace& t, const TraceSummary& s) {
  std::string out;
  absl::StrAppendFormat(&out, "trace            %s\n", t.source());
  absl::StrAppendFormat(&out, "events           %d", s.events);
  if (t.dropped_events() != 0) {
    absl::StrAppendFormat(&out, " (%d dropped by the recorder)",
                          t.dropped_events());
  }
  out += "\n";
  for (int i = 0; i < kTraceOpCount; ++i) {
    if (s.op_counts[i] == 0) continue;
    absl::StrAppendFormat(&out, "  %-16s %10d\n",
                          TraceOpName(static_cast<TraceOp>(i)), s.op_counts[i]);
  }
  absl::StrAppendFormat(&out,
                        "allocated        %s in %d allocations (%s .. %s)\n",
                        FormatBytes(s.alloc_bytes), s.allocs,
                        FormatBytes(s.min_size), FormatBytes(s.max_size));
  absl::StrAppendFormat(
      &out, "peak live        %s at event %d (%d blocks at most)\n",
      FormatBytes(s.peak_live_bytes), s.peak_live_event, s.peak_live_count);
  absl::StrAppendFormat(&out, "live at end      %s in %d blocks\n",
                        FormatBytes(s.end_live_bytes), s.end_live_count);
  absl::StrAppendFormat(&out, "streams          %d (%s)\n", s.streams.size(),
                        absl::StrJoin(s.streams, ", "));
  absl::StrAppendFormat(&out, "tenants          %d (%s)\n", s.tenants.size(),
                        absl::StrJoin(s.tenants, ", "));
  absl::StrAppendFormat(&out, "duration         %.6f s\n",
                        static_cast<double>(s.duration_ns) / 1e9);
  out +=
      "\nsize                            count   count%          bytes   "
      "bytes%\n";
  for (const SizeBucket& b : s.size_histogram) {
    const std::string range = b.lo == 0
                                  ? "0 B"
                                  : absl::StrCat("[", FormatBytes(b.lo), ", ",
                                                 FormatBytes(b.lo * 2), ")");
    absl::StrAppendFormat(&out, "%-26s %10d %8s %14s %8s\n", range, b.count,
                          Percent(b.count, s.allocs), FormatBytes(b.bytes),
                          Percent(b.bytes, s.alloc_bytes));
  }
  return out;
}

}  // namespace

int RunReport(int argc, char** argv) {
  std::string path;
  bool json = false;
  TraceReadOptions read;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintReportUsage(stdout);
      return 0;
    } else if (arg == "--json") {
      json = true;
    } else if (arg == "--unknown-free" && i + 1 < argc) {
      const absl::string_view p = argv[++i];
      if (p == "error") {
        read.unknown_free = UnknownFreePolicy::kError;
      } else if (p == "synthesize") {
        read.unknown_free = UnknownFreePolicy::kSynthesizeAlloc;
      } else if (p == "ignore") {
        read.unknown_free = UnknownFreePolicy::kIgnore;
      } else {
        std::fprintf(stderr, "ctxpool report: bad --unknown-free '%s'\n",
                     argv[i]);
        return 2;
      }
    } else if (absl::StartsWith(arg, "-") || !path.empty()) {
      std::fprintf(stderr, "ctxpool report: unexpected argument '%s'\n\n",
                   argv[i]);
      PrintReportUsage(stderr);
      return 2;
    } else {
      path = std::string(arg);
    }
  }
  if (path.empty()) {
    PrintReportUsage(stderr);
    return 2;
  }
  absl::StatusOr<Trace> trace =
      absl::StartsWith(path, "workload:")
          ? GenerateWorkload(absl::string_view(path).substr(9))
          : ReadTraceFile(path, read);
  if (!trace.ok()) {
    std::fprintf(stderr, "ctxpool report: %s\n",
                 trace.status().ToString().c_str());
    return 1;
  }
  const TraceSummary s = Summarize(*trace);
  std::printf("%s\n",
              json ? ToJson(*trace, s).c_str() : ToTable(*trace, s).c_str());
  return 0;
}

}  // namespace ctxpool::tool
