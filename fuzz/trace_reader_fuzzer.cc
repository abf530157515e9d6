// Fuzz target: the trace reader, in all its forms (RMM log CSV, ctxpool CSV
// with a Tenant column, ctxpool JSON), under every unknown-free policy.
// Whatever the bytes, ParseTrace returns a Trace or an error Status (never a
// crash, an exception or a hang), a Trace it accepts validates, and its CSV
// and JSON forms read back to the same events.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"

namespace {

void CheckRoundTrip(const ctxpool::Trace& trace) {
  if (!trace.Validate().ok()) std::abort();
  const ctxpool::TraceReadOptions strict;
  absl::StatusOr<ctxpool::Trace> csv =
      ctxpool::ParseTrace(ctxpool::WriteTraceCsv(trace), "csv", strict);
  if (!csv.ok() || csv->events() != trace.events()) std::abort();
  absl::StatusOr<ctxpool::Trace> json =
      ctxpool::ParseTrace(ctxpool::WriteTraceJson(trace), "json", strict);
  if (!json.ok() || json->events() != trace.events()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data,
                                      std::size_t size) {
  if (size == 0) return 0;
  // The first byte picks the form and the policy; the rest is the file.
  const std::uint8_t pick = data[0];
  const absl::string_view text(reinterpret_cast<const char*>(data + 1),
                               size - 1);
  ctxpool::TraceReadOptions options;
  switch (pick % 3) {
    case 0:
      options.format = ctxpool::TraceFormat::kAuto;
      break;
    case 1:
      options.format = ctxpool::TraceFormat::kCsv;
      break;
    default:
      options.format = ctxpool::TraceFormat::kJson;
      break;
  }
  switch ((pick / 3) % 3) {
    case 0:
      options.unknown_free = ctxpool::UnknownFreePolicy::kError;
      break;
    case 1:
      options.unknown_free = ctxpool::UnknownFreePolicy::kSynthesizeAlloc;
      break;
    default:
      options.unknown_free = ctxpool::UnknownFreePolicy::kIgnore;
      break;
  }
  absl::StatusOr<ctxpool::Trace> trace =
      ctxpool::ParseTrace(text, "fuzz", options);
  if (trace.ok()) CheckRoundTrip(*trace);
  return 0;
}
