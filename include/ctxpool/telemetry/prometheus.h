// ctxpool/telemetry/prometheus.h — metrics in the Prometheus text format.
//
// RenderPrometheus() turns the statistics of the device allocators, device
// contexts and model sessions into the Prometheus text exposition format
// (version 0.0.4), ready to be served on a /metrics endpoint:
//
//   # HELP ctxpool_model_live_bytes Bytes of live allocations charged to ...
//   # TYPE ctxpool_model_live_bytes gauge
//   ctxpool_model_live_bytes{device="0",model="bert"} 1048576
//
//   std::string body = RenderPrometheus(*runtime);   // serve as text/plain;
//                                                    // version=0.0.4
//
// Families (all names ctxpool_*; labels `device`, and `model` for the
// ctxpool_model_* ones), each number read from one Stats() call:
//   ctxpool_device_{live,mapped,cached,peak,peak_mapped,context}_bytes,
//   ctxpool_device_fragmentation_ratio, ctxpool_device_open_sessions,
//   ctxpool_device_streams, ctxpool_device_{ooms,trims,cache_hits,
//   upstream_allocs,leaked_bytes,leaked_allocations,sessions_opened}_total
//     from CachingDeviceAllocator::Stats()/Fragmentation(), the context
//     report and DeviceContext::Stats();
//   ctxpool_model_{live,mapped,cached,peak,max}_bytes,
//   ctxpool_model_live_allocations, ctxpool_model_fragmentation_ratio,
//   ctxpool_model_{ooms,budget_rejections}_total for each open session
//     (ModelSession::Stats());
//   ctxpool_model_leaked_{bytes,allocations}_total for every model that had a
//     session on the device (DeviceContext::ModelTotals());
//   ctxpool_device_pinned_bytes, ctxpool_device_pinned_budget_bytes (the host
//     allocator), ctxpool_device_context_created_timestamp_seconds,
//     ctxpool_device_context_sched_flags{kind,flags},
//     ctxpool_device_context_sched_mismatch (the context report);
//   and, for a Runtime, ctxpool_process_info{pid,cgroup} and the cgroup's
//     ctxpool_cgroup_memory_{max,high,current,reclaimable}_bytes.
// Byte values are integers; ratios are decimal fractions in [0, 1].
//
// Thread-safety: safe to call concurrently with any use of the objects;
// each object's numbers are a consistent snapshot, different objects are
// read one after the other.
#ifndef CTXPOOL_TELEMETRY_PROMETHEUS_H_
#define CTXPOOL_TELEMETRY_PROMETHEUS_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/core/cgroup.h"

namespace ctxpool {

// Every opened device of `runtime`, plus ctxpool_runtime_info{driver=...}.
// In a forked child: only the info line.
std::string RenderPrometheus(const Runtime& runtime);
// One device, or several.
std::string RenderPrometheus(const DeviceContext& device);
std::string RenderPrometheus(absl::Span<const DeviceContext* const> devices);

// ctxpool_process_info{pid,cgroup} and the cgroup's memory gauges
// (ctxpool_cgroup_memory_{max,high,current,reclaimable}_bytes, +Inf for
// "max", absent when unknown); RenderPrometheus(runtime) includes them.
std::string RenderProcessMetrics(const CgroupMemory& cgroup);

// A label value escaped for the text format: \ -> \\, " -> \", newline -> \n;
// bytes that are not UTF-8 become U+FFFD (one per maximal ill-formed
// subsequence), since one such value makes a Prometheus server reject the
// whole scrape.
std::string EscapePrometheusLabelValue(absl::string_view value);

}  // namespace ctxpool

#endif  // CTXPOOL_TELEMETRY_PROMETHEUS_H_
