// ctxpool/trace/replay.h — replaying an allocation trace against an allocator
// configuration, and capacity planning.
//
// Replay runs a trace's allocations and frees, in the order listed, on a
// fresh CachingDeviceAllocator — over a fresh SimDriver (any capacity preset)
// or over a Driver you pass in (a real GPU through CudaDriver) — and reports
// what that configuration would have done with the workload:
//
//   peak live        the most bytes the trace had allocated at once (sum of
//                    requested sizes); a property of the trace
//   peak reserved    the most bytes the allocator held from the driver
//   OOMs             allocations that failed, and the first one in detail
//   upstream calls   physical allocations: cuMemAlloc + cuMemCreate
//   fragmentation    reserved, live and external fragmentation, sampled
//   trim points      with replay_trims, at each kTrim event (e.g. the churn
//                    workload's trim after each unload): Trim(0), then
//                    reserved − live, the worst case and that residual in
//                    2 MiB granules per active stream
//   latency          p50 / p99 / p99.9 / max of Allocate and Deallocate:
//                    `sim_*` from SimDriver's cost model (simulated driver
//                    time), `wall_*` measured with a monotonic clock, and
//                    with `repeats`, `wall_*_min`: per call, the least wall
//                    time over that many runs (the machine's noise out)
//
//   absl::StatusOr<Trace> t = ReadTraceFile("run.rmm.csv");
//   ReplayConfig config;
//   config.device = "a10-24gb";
//   CTXPOOL_RETURN_IF_ERROR(ParseAllocatorConfig("backing=classic",
//                                                &config.allocator));
//   CTXPOOL_ASSIGN_OR_RETURN(ReplayResult r, Replay(*t, config));
//   std::cout << ReplayResultToJson(r);
//
// Rules of a replay:
//   * One stream per distinct stream id of the trace's allocations (created
//     on the device).
//     Threads are ignored: events run in the trace's order.
//   * Only kAlloc and kFree act (kTrim calls Trim(0) when replay_trims);
//     free completions, segment events and recorded OOMs are the recording
//     allocator's own doings and are skipped.
//   * A failed allocation is counted and replay continues (or stops, with
//     stop_at_first_oom); its later free is skipped.
//   * Allocations still live at the end are not freed by the trace; the
//     allocator's destruction returns everything.
//
// FindMinCapacity bisects the device capacity (in 2 MiB steps, the VMM
// granularity) for the smallest device on which the trace runs with no OOM —
// the OOM frontier — assuming more memory never causes an OOM. The capacity
// includes the device's context overhead (SimDeviceSpec), as a real card's
// does.
//
// Thread-safety: the functions are reentrant; concurrent replays are
// independent (each has its own SimDriver). Replay on a shared Driver must
// not run concurrently with other users of that device's memory if the
// numbers are to mean anything.
#ifndef CTXPOOL_TRACE_REPLAY_H_
#define CTXPOOL_TRACE_REPLAY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/trace/trace.h"

namespace ctxpool {

struct ReplayConfig {
  // SimDevicePreset name ("h100-80gb", "a10-24gb", ...). Empty: the default
  // SimDeviceSpec (80 GiB).
  std::string device;
  // When non-zero, overrides the device's capacity.
  std::uint64_t capacity_bytes = 0;
  DeviceAllocatorOptions allocator;
  bool stop_at_first_oom = false;
  // Replay the trace this many times on the same allocator. Allocations the
  // trace leaves live are freed at the end of each pass but the last (those
  // frees count as the pass's ops). ReplayResult::passes has each pass's
  // driver calls; the other figures cover all passes.
  int passes = 1;
  // Charge SimDriver's realistic cost table (UseRealisticCosts) and report
  // simulated latencies. Off: the simulated costs are all zero.
  bool cost_model = true;
  // Measure each Allocate/Deallocate with a monotonic clock.
  bool wall_latency = true;
  // Run the whole replay this many times (Replay: each on a fresh SimDriver;
  // ReplayOnDriver: on the same driver), each on a fresh allocator, and
  // report in ReplayResult::wall_*_min, for each call, the least of its wall
  // times over the runs: the allocator's own cost, without what the machine
  // adds to a few calls at random (preemption, a hypervisor's steal, timer
  // interrupts) nor a fresh process's one-time costs (first touch of host
  // memory). Every other figure is the first run's; `progress` is called
  // for each run. Needs wall_latency (else the minima are not measured).
  // REQUIRES: >= 1.
  int repeats = 1;
  // Call Trim(0) at kTrim events (trim points) and measure what stays
  // reserved (ReplayResult::max_trim_residual_*).
  bool replay_trims = false;
  // Take a fragmentation sample every this many events (0: about 200
  // samples over the trace).
  std::size_t sample_every = 0;
  // Called every `progress_every` events (and at the end) with
  // (events done, events total). Must not call back into the replay.
  std::function<void(std::size_t, std::size_t)> progress;
  std::size_t progress_every = 100000;
};

// Latency distribution of one kind of call, in nanoseconds.
struct LatencyStats {
  std::uint64_t count = 0;
  std::int64_t p50 = 0;
  std::int64_t p99 = 0;
  std::int64_t p999 = 0;
  std::int64_t max = 0;
  double mean = 0;
  std::int64_t total = 0;
};
// Nearest-rank percentiles of `samples` (reordered in place).
LatencyStats ComputeLatencyStats(std::vector<std::int64_t>& samples);

struct OomInfo {
  std::size_t event_index = 0;  // in the trace
  std::uint64_t requested_bytes = 0;
  std::uint64_t live_bytes = 0;      // the trace's live bytes before it
  std::uint64_t reserved_bytes = 0;  // the allocator's, after the failure
  // Expandable: physical memory unmapped in the granule cache then (not in
  // reserved_bytes); classic: 0.
  std::uint64_t cached_bytes = 0;
  std::string message;  // the allocator's OOM report
};

struct FragmentationSample {
  std::size_t event_index = 0;
  std::uint64_t live_bytes = 0;      // trace live (requested)
  std::uint64_t reserved_bytes = 0;  // allocator reserved
  std::uint64_t free_bytes = 0;      // cached in free blocks
  std::uint64_t largest_free_bytes = 0;
  double external = 0;  // 1 − largest_free / free
};

struct ReplayResult {
  std::string trace_source;
  std::string device;  // the driver's Describe()
  std::uint64_t capacity_bytes = 0;
  std::uint64_t context_overhead_bytes = 0;  // sim only
  std::uint64_t ops = 0;                     // allocations + frees executed
  std::uint64_t allocs = 0;                  // successful
  std::uint64_t frees = 0;
  std::uint64_t skipped_events = 0;  // events that do not act (see above)
  std::uint64_t skipped_frees = 0;   // frees of allocations that failed
  std::uint64_t trims = 0;
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t end_live_bytes = 0;
  std::uint64_t end_reserved_bytes = 0;
  std::uint64_t ooms = 0;
  std::optional<OomInfo> first_oom;
  bool stopped_at_oom = false;
  std::uint64_t upstream_allocations = 0;  // cuMemAlloc + cuMemCreate
  std::uint64_t upstream_frees = 0;        // cuMemFree + cuMemRelease
  std::uint64_t cache_hits = 0;
  double peak_reserved_over_live = 0;  // peak_reserved / peak_live
  double max_external_fragmentation = 0;
  // Trim points (replay_trims): after each kTrim's Trim(0), residual =
  // reserved − live, where reserved is the allocator's reserved bytes plus
  // its granule cache (expandable: mapped + cached granules) and live is the
  // allocator's allocated bytes (the replay's live blocks, rounded to the
  // allocator's 512 B); an active stream is a trace stream with at least one
  // live allocation. The maximum residual over the trim points, the event
  // where it occurred, and the maximum over the trim points of
  // residual / (2 MiB x active streams) (0 at a point with no active stream;
  // the target for expandable segments is <= 1).
  std::uint64_t max_trim_residual_bytes = 0;
  std::optional<std::size_t> worst_trim_point;  // event index; none: no trim
  double max_trim_residual_granules_per_stream = 0;
  std::vector<FragmentationSample> samples;
  LatencyStats sim_alloc;  // simulated driver time per Allocate
  LatencyStats sim_free;
  LatencyStats wall_alloc;  // measured wall-clock time per Allocate
  LatencyStats wall_free;
  // config.repeats, and with more than one (and wall_latency), the per-call
  // minima of the wall times over the runs (ReplayConfig::repeats; each
  // order statistic is at most wall_alloc's / wall_free's).
  int repeats = 1;
  LatencyStats wall_alloc_min;
  LatencyStats wall_free_min;
  std::int64_t simulated_time_ns = 0;  // all simulated driver time
  std::int64_t wall_time_ns = 0;       // the whole replay loop
  // The backing the allocator used: "classic" or "expandable".
  std::string backing;
  // Every driver call the allocator made during the replay (SimDriver's
  // counters, from the first event to the last; not the set-up of the
  // context and streams), by the driver's name ("cuMemMap"), in name order,
  // kinds with no call left out. Empty on a driver that does not count.
  std::vector<std::pair<std::string, std::uint64_t>> driver_calls;
  std::uint64_t driver_calls_total = 0;
  // Their simulated time (the cost model; no context start-up).
  std::int64_t simulated_driver_ns = 0;
  struct Pass {
    std::uint64_t ops = 0;
    std::vector<std::pair<std::string, std::uint64_t>> driver_calls;
    std::uint64_t driver_calls_total = 0;
    std::int64_t simulated_driver_ns = 0;
  };
  std::vector<Pass> passes;  // config.passes of them (fewer after a stop)
};

// Replays on a fresh SimDriver built from config.device/capacity_bytes.
// INVALID_ARGUMENT for a trace that frees a pointer never allocated (with the
// event index), NOT_FOUND for an unknown preset.
absl::StatusOr<ReplayResult> Replay(const Trace& trace,
                                    const ReplayConfig& config);

// Replays on `driver` (e.g. a CudaDriver on a real GPU), device `device`.
// config.device / capacity_bytes are ignored; cost_model applies only when
// `driver` is a SimDriver. INVALID_ARGUMENT for repeats < 1; INTERNAL, naming
// the call, when a run of a repeated replay parts from the first (another
// call, or the same call with another outcome: the driver did not behave
// the same way twice). REQUIRES: the driver outlives
// the call.
absl::StatusOr<ReplayResult> ReplayOnDriver(const Trace& trace, Driver& driver,
                                            int device,
                                            const ReplayConfig& config);

struct CapacitySearch {
  std::uint64_t min_capacity_bytes = 0;  // smallest that ran with no OOM
  std::uint64_t step_bytes = 0;          // search granularity (2 MiB)
  std::uint64_t peak_live_bytes = 0;
  std::uint64_t context_overhead_bytes = 0;
  int replays = 0;  // replays the bisection ran
};

// Bisects between peak live + context overhead (too small) and the peak the
// unconstrained replay used. RESOURCE_EXHAUSTED if even that fails.
absl::StatusOr<CapacitySearch> FindMinCapacity(const Trace& trace,
                                               const ReplayConfig& config);

// Parses "key=value,key=value" into `options`. Keys: backing
// (auto|classic|expandable), memory_limit (0: none), vmm_unit_divisor (a
// whole number; 0: single granules), vmm_chunk_units (1 to 65536),
// max_split_size, round_bytes,
// small_size_limit, small_segment_bytes, large_segment_bytes,
// large_round_bytes; sizes accept units (64MiB). INVALID_ARGUMENT naming
// the bad key or value, or options ValidateDeviceAllocatorOptions refuses.
absl::Status ParseAllocatorConfig(absl::string_view text,
                                  DeviceAllocatorOptions* options);

// One JSON object with every scalar field (latencies as nested objects,
// `first_oom` or null, samples only when `with_samples`).
std::string ReplayResultToJson(const ReplayResult& result,
                               bool with_samples = false);
// A human-readable multi-line report.
std::string ReplayResultToText(const ReplayResult& result);

}  // namespace ctxpool

#endif  // CTXPOOL_TRACE_REPLAY_H_
