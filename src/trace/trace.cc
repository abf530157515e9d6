#include "ctxpool/trace/trace.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <set>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/core/internal/format.h"

namespace ctxpool {

absl::string_view TraceOpName(TraceOp op) {
  switch (op) {
    case TraceOp::kAlloc:
      return "allocate";
    case TraceOp::kFree:
      return "free";
    case TraceOp::kFreeCompleted:
      return "free_completed";
    case TraceOp::kSegmentMap:
      return "segment_map";
    case TraceOp::kSegmentUnmap:
      return "segment_unmap";
    case TraceOp::kTrim:
      return "trim";
    case TraceOp::kOom:
      return "allocate failure";
  }
  return "unknown";
}

std::optional<TraceOp> ParseTraceOp(absl::string_view name) {
  struct Alias {
    absl::string_view name;
    TraceOp op;
  };
  static constexpr Alias kAliases[] = {
      {"allocate", TraceOp::kAlloc},
      {"alloc", TraceOp::kAlloc},
      {"free", TraceOp::kFree},
      {"free_requested", TraceOp::kFree},
      {"free_completed", TraceOp::kFreeCompleted},
      {"segment_map", TraceOp::kSegmentMap},
      {"segment_alloc", TraceOp::kSegmentMap},
      {"segment_unmap", TraceOp::kSegmentUnmap},
      {"segment_free", TraceOp::kSegmentUnmap},
      {"trim", TraceOp::kTrim},
      {"allocate failure", TraceOp::kOom},
      {"oom", TraceOp::kOom},
  };
  for (const Alias& a : kAliases) {
    if (a.name == name) return a.op;
  }
  return std::nullopt;
}

absl::Status Trace::Validate() const {
  absl::flat_hash_map<std::uint64_t, std::uint64_t> live;  // ptr -> size
  for (std::size_t i = 0; i < events_.size(); ++i) {
    const TraceEvent& e = events_[i];
    if (e.op == TraceOp::kAlloc) {
      if (!live.emplace(e.ptr, e.size).second) {
        return absl::InvalidArgumentError(core_internal::Format(
            "event %d: allocation of pointer 0x%x, which is already live", i,
            e.ptr));
      }
    } else if (e.op == TraceOp::kFree) {
      auto it = live.find(e.ptr);
      if (it == live.end()) {
        return absl::InvalidArgumentError(core_internal::Format(
            "event %d: free of unknown pointer 0x%x", i, e.ptr));
      }
      if (e.size != 0 && e.size != it->second) {
        return absl::InvalidArgumentError(core_internal::Format(
            "event %d: free of 0x%x with size %d, allocated with size %d", i,
            e.ptr, e.size, it->second));
      }
      live.erase(it);
    }
  }
  return absl::OkStatus();
}

TraceSummary Summarize(const Trace& trace) {
  TraceSummary s;
  const std::vector<TraceEvent>& events = trace.events();
  s.events = events.size();
  absl::flat_hash_map<std::uint64_t, std::uint64_t> live;
  std::set<std::uint64_t> streams;
  std::set<std::uint32_t> tenants;
  std::map<std::uint64_t, SizeBucket> buckets;
  std::uint64_t live_bytes = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const TraceEvent& e = events[i];
    ++s.op_counts[static_cast<int>(e.op)];
    streams.insert(e.stream);
    tenants.insert(e.tenant);
    if (e.op == TraceOp::kAlloc) {
      if (!live.emplace(e.ptr, e.size).second) continue;  // invalid; skip
      live_bytes += e.size;
      s.alloc_bytes += e.size;
      if (s.allocs == 0 || e.size < s.min_size) s.min_size = e.size;
      s.max_size = std::max(s.max_size, e.size);
      ++s.allocs;
      if (live_bytes > s.peak_live_bytes) {
        s.peak_live_bytes = live_bytes;
        s.peak_live_event = i;
      }
      s.peak_live_count =
          std::max<std::uint64_t>(s.peak_live_count, live.size());
      const std::uint64_t lo = e.size == 0 ? 0 : std::bit_floor(e.size);
      SizeBucket& b = buckets[lo];
      b.lo = lo;
      ++b.count;
      b.bytes += e.size;
    } else if (e.op == TraceOp::kFree) {
      auto it = live.find(e.ptr);
      if (it == live.end()) continue;
      live_bytes -= it->second;
      live.erase(it);
      ++s.frees;
    }
  }
  s.end_live_bytes = live_bytes;
  s.end_live_count = live.size();
  if (!events.empty()) {
    s.duration_ns = events.back().time_ns - events.front().time_ns;
  }
  s.streams.assign(streams.begin(), streams.end());
  s.tenants.assign(tenants.begin(), tenants.end());
  for (const auto& [lo, b] : buckets) s.size_histogram.push_back(b);
  return s;
}

absl::StatusOr<std::uint64_t> ParseByteSize(absl::string_view text) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  std::size_t i = 0;
  while (i < t.size() && ((t[i] >= '0' && t[i] <= '9') || t[i] == '.')) ++i;
  absl::string_view number = t.substr(0, i);
  const std::string unit =
      absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(i)));
  double value = 0;
  if (number.empty() || !absl::SimpleAtod(number, &value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad byte size '", text, "' (want e.g. 64MiB, 24GiB)"));
  }
  struct Unit {
    absl::string_view name;
    double factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1.0},       {"b", 1.0},      {"k", 0x1p10},   {"kib", 0x1p10},
      {"kb", 1e3},     {"m", 0x1p20},   {"mib", 0x1p20}, {"mb", 1e6},
      {"g", 0x1p30},   {"gib", 0x1p30}, {"gb", 1e9},     {"t", 0x1p40},
      {"tib", 0x1p40}, {"tb", 1e12},
  };
  for (const Unit& u : kUnits) {
    if (unit == u.name) {
      const double bytes = value * u.factor;
      if (bytes >= 0x1p63) break;
      return static_cast<std::uint64_t>(bytes + 0.5);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("bad byte size '", text, "' (want e.g. 64MiB, 24GiB)"));
}

std::string FormatBytes(std::uint64_t bytes) {
  static constexpr const char* kNames[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024 && u < 3) {
    v /= 1024;
    ++u;
  }
  return core_internal::Format("%.2f %s", v, kNames[u]);
}

}  // namespace ctxpool
