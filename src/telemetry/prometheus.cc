#include "ctxpool/telemetry/prometheus.h"

#include <unistd.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/cgroup.h"
#include "ctxpool/options.h"

namespace ctxpool {
namespace {

constexpr int kAgg = static_cast<int>(StatPool::kAggregate);

// What one device contributes, read once.
struct DeviceSample {
  int device = 0;
  DeviceAllocatorStats alloc;
  FragmentationStats frag;
  DeviceContextStats ctx;
  HostAllocatorStats host;
  std::size_t context_bytes = 0;
  ContextReport report;
  std::vector<std::pair<std::string, SessionStats>> sessions;
  std::vector<std::pair<std::string, ModelLeakTotals>> totals;
};

DeviceSample Sample(const DeviceContext& dc) {
  DeviceSample s;
  s.device = dc.device();
  s.alloc = dc.device_allocator().Stats();
  s.frag = dc.device_allocator().Fragmentation();
  s.ctx = dc.Stats();
  s.host = dc.host_allocator().Stats();
  s.report = dc.initial_context_report();
  s.context_bytes = s.report.context_bytes;
  dc.ForEachSession([&s](const ModelSession& session) {
    s.sessions.emplace_back(session.name(), session.Stats());
  });
  s.totals = dc.ModelTotals();
  return s;
}

std::string Number(std::int64_t v) { return absl::StrCat(v); }
std::string Number(std::size_t v) { return absl::StrCat(v); }
std::string Number(int v) { return absl::StrCat(v); }
std::string Number(double v) { return absl::StrFormat("%.6g", v); }

class Writer {
 public:
  // Starts a family.
  void Family(absl::string_view name, absl::string_view type,
              absl::string_view help) {
    name_ = std::string(name);
    absl::StrAppend(&out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ",
                    type, "\n");
  }
  void Sample(int device, const std::string& value) {
    absl::StrAppend(&out_, name_, "{device=\"", device, "\"} ", value, "\n");
  }
  void Sample(int device, absl::string_view model, const std::string& value) {
    absl::StrAppend(&out_, name_, "{device=\"", device, "\",model=\"",
                    EscapePrometheusLabelValue(model), "\"} ", value, "\n");
  }
  // A sample with extra labels after `device` (names and values as given,
  // values escaped here).
  void Sample(
      int device,
      std::initializer_list<std::pair<absl::string_view, std::string>> labels,
      const std::string& value) {
    absl::StrAppend(&out_, name_, "{device=\"", device, "\"");
    for (const auto& [k, v] : labels) {
      absl::StrAppend(&out_, ",", k, "=\"", EscapePrometheusLabelValue(v),
                      "\"");
    }
    absl::StrAppend(&out_, "} ", value, "\n");
  }
  void Raw(absl::string_view text) { absl::StrAppend(&out_, text); }
  std::string Take() { return std::move(out_); }

 private:
  std::string name_;
  std::string out_;
};

using DeviceValue = std::function<std::string(const DeviceSample&)>;
using SessionValue = std::function<std::string(const SessionStats&)>;
using TotalsValue = std::function<std::string(const ModelLeakTotals&)>;

void DeviceFamily(Writer& w, const std::vector<DeviceSample>& samples,
                  absl::string_view name, absl::string_view type,
                  absl::string_view help, const DeviceValue& value) {
  w.Family(name, type, help);
  for (const DeviceSample& s : samples) w.Sample(s.device, value(s));
}

void SessionFamily(Writer& w, const std::vector<DeviceSample>& samples,
                   absl::string_view name, absl::string_view type,
                   absl::string_view help, const SessionValue& value) {
  w.Family(name, type, help);
  for (const DeviceSample& s : samples) {
    for (const auto& [model, stats] : s.sessions) {
      w.Sample(s.device, model, value(stats));
    }
  }
}

void TotalsFamily(Writer& w, const std::vector<DeviceSample>& samples,
                  absl::string_view name, absl::string_view help,
                  const TotalsValue& value) {
  w.Family(name, "counter", help);
  for (const DeviceSample& s : samples) {
    for (const auto& [model, totals] : s.totals) {
      w.Sample(s.device, model, value(totals));
    }
  }
}

std::string Render(const std::vector<DeviceSample>& d) {
  Writer w;
  using S = DeviceSample;
  DeviceFamily(w, d, "ctxpool_device_live_bytes", "gauge",
               "Bytes of live allocations in the device allocator.",
               [](const S& s) {
                 return Number(s.alloc.total.allocated_bytes[kAgg].current);
               });
  DeviceFamily(w, d, "ctxpool_device_mapped_bytes", "gauge",
               "Bytes the device allocator holds from the driver.",
               [](const S& s) {
                 return Number(s.alloc.total.reserved_bytes[kAgg].current);
               });
  DeviceFamily(w, d, "ctxpool_device_cached_bytes", "gauge",
               "Bytes held from the driver but not allocated (mapped - live).",
               [](const S& s) {
                 return Number(s.alloc.total.reserved_bytes[kAgg].current -
                               s.alloc.total.allocated_bytes[kAgg].current);
               });
  DeviceFamily(w, d, "ctxpool_device_peak_bytes", "gauge",
               "Peak bytes of live allocations.", [](const S& s) {
                 return Number(s.alloc.total.allocated_bytes[kAgg].peak);
               });
  DeviceFamily(w, d, "ctxpool_device_peak_mapped_bytes", "gauge",
               "Peak bytes held from the driver.", [](const S& s) {
                 return Number(s.alloc.total.reserved_bytes[kAgg].peak);
               });
  DeviceFamily(w, d, "ctxpool_device_fragmentation_ratio", "gauge",
               "External fragmentation of cached memory: 1 - largest free "
               "block / free bytes.",
               [](const S& s) { return Number(s.frag.external); });
  DeviceFamily(w, d, "ctxpool_device_context_bytes", "gauge",
               "Device memory taken by the primary context.",
               [](const S& s) { return Number(s.context_bytes); });
  DeviceFamily(w, d, "ctxpool_device_open_sessions", "gauge",
               "Model sessions open on the device.",
               [](const S& s) { return Number(s.ctx.open_sessions); });
  DeviceFamily(w, d, "ctxpool_device_streams", "gauge",
               "Streams of the device's stream pool (idle and leased).",
               [](const S& s) { return Number(s.ctx.streams_created); });
  DeviceFamily(w, d, "ctxpool_device_ooms_total", "counter",
               "Allocations that failed for lack of device memory.",
               [](const S& s) { return Number(s.alloc.num_ooms); });
  DeviceFamily(w, d, "ctxpool_device_trims_total", "counter",
               "Trims that returned cached memory to the driver.",
               [](const S& s) { return Number(s.alloc.num_trims); });
  DeviceFamily(w, d, "ctxpool_device_cache_hits_total", "counter",
               "Allocations served from the cache without a driver call.",
               [](const S& s) { return Number(s.alloc.cache_hits); });
  DeviceFamily(w, d, "ctxpool_device_upstream_allocs_total", "counter",
               "Driver allocations (cuMemAlloc / cuMemCreate).",
               [](const S& s) { return Number(s.alloc.upstream_allocs); });
  DeviceFamily(w, d, "ctxpool_device_leaked_bytes_total", "counter",
               "Bytes still live when their session closed (reclaimed).",
               [](const S& s) { return Number(s.ctx.leaked_bytes); });
  DeviceFamily(w, d, "ctxpool_device_leaked_allocations_total", "counter",
               "Allocations still live when their session closed.",
               [](const S& s) { return Number(s.ctx.leaked_allocations); });
  DeviceFamily(w, d, "ctxpool_device_sessions_opened_total", "counter",
               "Model sessions opened on the device.",
               [](const S& s) { return Number(s.ctx.sessions_opened); });

  using M = SessionStats;
  SessionFamily(w, d, "ctxpool_model_live_bytes", "gauge",
                "Bytes of live allocations charged to the model.",
                [](const M& m) { return Number(m.live_bytes); });
  SessionFamily(w, d, "ctxpool_model_live_allocations", "gauge",
                "Live allocations of the model.",
                [](const M& m) { return Number(m.live_allocations); });
  SessionFamily(w, d, "ctxpool_model_mapped_bytes", "gauge",
                "Bytes the allocator holds on the model's streams.",
                [](const M& m) { return Number(m.mapped_bytes); });
  SessionFamily(w, d, "ctxpool_model_cached_bytes", "gauge",
                "Cached (mapped, not allocated) bytes on the model's streams.",
                [](const M& m) { return Number(m.cached_bytes); });
  SessionFamily(w, d, "ctxpool_model_peak_bytes", "gauge",
                "Peak bytes charged to the model.",
                [](const M& m) { return Number(m.peak_bytes); });
  SessionFamily(w, d, "ctxpool_model_max_bytes", "gauge",
                "The model's hard budget (0: none).",
                [](const M& m) { return Number(m.max_bytes); });
  SessionFamily(w, d, "ctxpool_model_fragmentation_ratio", "gauge",
                "External fragmentation of the free memory on the model's "
                "streams.",
                [](const M& m) { return Number(m.fragmentation); });
  SessionFamily(w, d, "ctxpool_model_ooms_total", "counter",
                "The model's allocations that failed for lack of device "
                "memory.",
                [](const M& m) { return Number(m.num_ooms); });
  SessionFamily(w, d, "ctxpool_model_budget_rejections_total", "counter",
                "The model's allocations refused by its max budget.",
                [](const M& m) { return Number(m.num_budget_rejections); });
  DeviceFamily(w, d, "ctxpool_device_pinned_bytes", "gauge",
               "Pinned host bytes the device's host allocator holds (live, "
               "cached, pending): host RAM the memory cgroup charges.",
               [](const S& s) { return Number(s.host.pinned_bytes); });
  DeviceFamily(w, d, "ctxpool_device_pinned_budget_bytes", "gauge",
               "The host allocator's pinned budget (+Inf: none); by default "
               "derived from the cgroup's memory.high or memory.max.",
               [](const S& s) {
                 return s.host.host_budget_bytes == 0
                            ? std::string("+Inf")
                            : Number(s.host.host_budget_bytes);
               });
  DeviceFamily(w, d, "ctxpool_device_context_created_timestamp_seconds",
               "gauge",
               "When this process's DeviceContext retained the primary "
               "context (Unix time).",
               [](const S& s) {
                 // Milliseconds: %.6g would round a 2026 time by ~1000 s.
                 return absl::StrFormat(
                     "%.3f", static_cast<double>(s.report.created_at_ns) / 1e9);
               });
  w.Family("ctxpool_device_context_sched_flags", "gauge",
           "The primary context's scheduling flag (value 1): kind=effective "
           "as the driver reports it, kind=requested as CTXPOOL_CTX_SCHED "
           "set it.");
  for (const S& s : d) {
    w.Sample(s.device,
             {{"kind", "effective"},
              {"flags", SchedFlagsName(s.report.effective_sched_flags)}},
             "1");
    if (s.report.sched_flags_requested) {
      w.Sample(s.device,
               {{"kind", "requested"},
                {"flags", SchedFlagsName(s.report.requested_sched_flags)}},
               "1");
    }
  }
  DeviceFamily(w, d, "ctxpool_device_context_sched_mismatch", "gauge",
               "1 when the driver runs the primary context with other "
               "scheduling flags than were set.",
               [](const S& s) { return Number(s.ctx.sched_flag_mismatches); });
  TotalsFamily(w, d, "ctxpool_model_leaked_bytes_total",
               "Bytes the model left live at session close (reclaimed).",
               [](const ModelLeakTotals& t) { return Number(t.leaked_bytes); });
  TotalsFamily(
      w, d, "ctxpool_model_leaked_allocations_total",
      "Allocations the model left live at session close.",
      [](const ModelLeakTotals& t) { return Number(t.leaked_allocations); });
  return w.Take();
}

// The length of the well-formed UTF-8 sequence at the start of `s` (1 to 4),
// or 0 when it starts with an ill-formed one; `*bad` is then the length of
// its maximal ill-formed prefix (at least 1), replaced by one U+FFFD.
std::size_t Utf8SequenceLength(absl::string_view s, std::size_t* bad) {
  const auto b = [&s](std::size_t i) {
    return static_cast<unsigned char>(s[i]);
  };
  const unsigned char lead = b(0);
  if (lead < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;  // no overlong forms
    if (lead == 0xED) hi = 0x9F;  // no surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;  // no overlong forms
    if (lead == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  }
  std::size_t i = 1;
  for (; n != 0 && i < n && i < s.size(); ++i) {
    const unsigned char c = b(i);
    if (c < (i == 1 ? lo : 0x80) || c > (i == 1 ? hi : 0xBF)) break;
  }
  if (n != 0 && i == n) return n;
  *bad = i;
  return 0;
}

}  // namespace

std::string EscapePrometheusLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (std::size_t i = 0; i < value.size();) {
    const char c = value[i];
    std::size_t bad = 0;
    const std::size_t n = Utf8SequenceLength(value.substr(i), &bad);
    if (n == 0) {
      // Not UTF-8: a Prometheus server rejects the whole scrape for one
      // such label value ("invalid label value").
      out += "\xEF\xBF\xBD";  // U+FFFD
      i += bad;
      continue;
    }
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out.append(value.data() + i, n);
    }
    i += n;
  }
  return out;
}

std::string RenderPrometheus(absl::Span<const DeviceContext* const> devices) {
  std::vector<DeviceSample> samples;
  for (const DeviceContext* dc : devices) {
    if (dc->InForkedChild()) continue;
    samples.push_back(Sample(*dc));
  }
  return Render(samples);
}

std::string RenderPrometheus(const DeviceContext& device) {
  const DeviceContext* one[] = {&device};
  return RenderPrometheus(absl::MakeConstSpan(one));
}

std::string RenderProcessMetrics(const CgroupMemory& cg) {
  std::string out = absl::StrCat(
      "# HELP ctxpool_process_info The process and its cgroup (value 1; "
      "cgroup \"\" when unknown).\n"
      "# TYPE ctxpool_process_info gauge\n"
      "ctxpool_process_info{pid=\"",
      getpid(), "\",cgroup=\"",
      EscapePrometheusLabelValue(cg.version == 2 ? cg.path : ""), "\"} 1\n");
  auto gauge = [&out](absl::string_view name, absl::string_view help,
                      const std::optional<std::uint64_t>& v) {
    if (!v.has_value()) return;  // unknown: no sample
    absl::StrAppend(
        &out, "# HELP ", name, " ", help, "\n# TYPE ", name, " gauge\n", name,
        " ", *v == kCgroupNoLimit ? std::string("+Inf") : Number(*v), "\n");
  };
  gauge("ctxpool_cgroup_memory_max_bytes",
        "The effective memory.max of the process's cgroup v2 (+Inf: none).",
        cg.effective_max);
  gauge("ctxpool_cgroup_memory_high_bytes",
        "The effective memory.high of the process's cgroup v2 (+Inf: none).",
        cg.effective_high);
  gauge("ctxpool_cgroup_memory_current_bytes",
        "memory.current of the process's cgroup v2.", cg.current);
  gauge("ctxpool_cgroup_memory_reclaimable_bytes",
        "Page cache in the cgroup (memory.stat active_file + inactive_file).",
        cg.reclaimable);
  return out;
}

std::string RenderPrometheus(const Runtime& runtime) {
  std::string out = absl::StrCat(
      "# HELP ctxpool_runtime_info The driver ctxpool uses (value 1).\n"
      "# TYPE ctxpool_runtime_info gauge\n"
      "ctxpool_runtime_info{driver=\"",
      EscapePrometheusLabelValue(runtime.driver_kind()), "\"} 1\n");
  absl::StrAppend(&out, RenderProcessMetrics(runtime.ReadCgroup()));
  if (runtime.InForkedChild()) return out;
  std::vector<DeviceContext*> devices = runtime.devices();
  std::vector<const DeviceContext*> cdevices(devices.begin(), devices.end());
  absl::StrAppend(&out, RenderPrometheus(absl::MakeConstSpan(cdevices)));
  return out;
}

}  // namespace ctxpool
