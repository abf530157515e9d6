#include "ctxpool/trace/replay.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "ctxpool/core/json_string.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

constexpr std::uint64_t kCapacityStep = 2 * kMiB;  // VMM granularity

std::int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<SimDeviceSpec> SpecFor(const ReplayConfig& config) {
  SimDeviceSpec spec;
  if (!config.device.empty()) {
    CTXPOOL_ASSIGN_OR_RETURN(spec, SimDevicePreset(config.device));
  }
  if (config.capacity_bytes > kSimMaxCapacityBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity ", FormatBytes(config.capacity_bytes),
                     " is more than the largest simulated device (",
                     FormatBytes(kSimMaxCapacityBytes), ")"));
  }
  if (config.capacity_bytes != 0) {
    spec.capacity_bytes = config.capacity_bytes;
    if (config.device.empty()) {
      spec.name = absl::StrCat("simulated GPU (",
                               FormatBytes(spec.capacity_bytes), ")");
    }
  }
  return spec;
}

struct LiveAlloc {
  DevicePtr ptr;
  std::uint64_t size = 0;
  std::uint64_t stream = 0;  // the trace's stream id
};

// Whether a replay folds each call's least wall time over its runs
// (ReplayConfig::repeats), and so logs its calls and keeps its samples in
// call order.
bool FoldsWallMinima(const ReplayConfig& config) {
  return config.repeats > 1 && config.wall_latency;
}

// Everything a replay creates on the driver, released in reverse order.
class ReplayRun {
 public:
  ReplayRun(const Trace& trace, Driver& driver, int device,
            const ReplayConfig& config)
      : trace_(trace), driver_(driver), device_(device), config_(config) {
    sim_ = dynamic_cast<SimDriver*>(&driver);
  }

  ~ReplayRun() {
    alloc_.reset();
    for (const auto& [id, stream] : streams_) {
      (void)driver_.StreamDestroy(stream);
    }
    if (retained_) {
      (void)driver_.CtxSetCurrent(previous_ctx_);
      (void)driver_.PrimaryCtxRelease(device_);
    }
  }

  absl::StatusOr<ReplayResult> Run();

  // The wall time of each Allocate / Deallocate, in call order (after Run,
  // with wall_latency).
  const std::vector<std::int64_t>& wall_alloc_samples() const {
    return wall_alloc_;
  }
  const std::vector<std::int64_t>& wall_free_samples() const {
    return wall_free_;
  }
  // With repeats and wall_latency, every timed call in order, as CallKey
  // encodes it: the runs of a repeated replay must log the same calls.
  const std::vector<std::uint64_t>& call_log() const { return call_log_; }
  static std::uint64_t CallKey(std::size_t event, bool free, bool ok) {
    return (static_cast<std::uint64_t>(event) << 2) |
           (static_cast<std::uint64_t>(free) << 1) |
           static_cast<std::uint64_t>(ok);
  }

 private:
  absl::Status Setup();
  void Sample(std::size_t index, std::uint64_t live);
  // After Trim(0) at event `index`: records reserved − live and the streams
  // with live blocks (ReplayResult::max_trim_residual_*).
  void MeasureTrimPoint(std::size_t index, std::size_t active_streams);
  // SimDriver's call counters now (all zero on another driver).
  std::array<std::uint64_t, kSimCallCount> CallCounts() const {
    if (sim_ == nullptr) return {};
    return sim_->call_counts();
  }
  // The calls made since `before`, by name (name order, non-zero only).
  void CallsSince(const std::array<std::uint64_t, kSimCallCount>& before,
                  std::vector<std::pair<std::string, std::uint64_t>>* out,
                  std::uint64_t* total) const {
    out->clear();
    *total = 0;
    const std::array<std::uint64_t, kSimCallCount> now = CallCounts();
    for (std::size_t c = 0; c < now.size(); ++c) {
      const std::uint64_t d = now[c] - before[c];
      if (d == 0) continue;
      out->emplace_back(std::string(SimCallName(static_cast<SimCall>(c))), d);
      *total += d;
    }
    std::sort(out->begin(), out->end());
  }

  const Trace& trace_;
  Driver& driver_;
  const int device_;
  const ReplayConfig& config_;
  SimDriver* sim_ = nullptr;
  bool retained_ = false;
  ContextHandle previous_ctx_;
  ContextHandle ctx_;
  absl::flat_hash_map<std::uint64_t, StreamHandle> streams_;
  std::unique_ptr<CachingDeviceAllocator> alloc_;
  ReplayResult result_;
  std::vector<std::int64_t> wall_alloc_;
  std::vector<std::int64_t> wall_free_;
  std::vector<std::uint64_t> call_log_;
};

absl::Status ReplayRun::Setup() {
  CTXPOOL_ASSIGN_OR_RETURN(previous_ctx_, driver_.CtxGetCurrent());
  CTXPOOL_ASSIGN_OR_RETURN(ctx_, driver_.PrimaryCtxRetain(device_));
  retained_ = true;
  CTXPOOL_RETURN_IF_ERROR(driver_.CtxSetCurrent(ctx_));
  for (const TraceEvent& e : trace_.events()) {
    if (e.op != TraceOp::kAlloc || streams_.contains(e.stream)) continue;
    CTXPOOL_ASSIGN_OR_RETURN(StreamHandle s,
                             driver_.StreamCreate(kStreamNonBlocking, 0));
    streams_.emplace(e.stream, s);
  }
  DeviceAllocatorOptions options = config_.allocator;
  options.context = ctx_;
  CTXPOOL_ASSIGN_OR_RETURN(alloc_, CachingDeviceAllocator::Create(
                                       driver_, device_, std::move(options)));
  return absl::OkStatus();
}

void ReplayRun::Sample(std::size_t index, std::uint64_t live) {
  const DeviceAllocatorStats stats = alloc_->Stats();
  const FragmentationStats frag = alloc_->Fragmentation();
  FragmentationSample s;
  s.event_index = index;
  s.live_bytes = live;
  s.reserved_bytes =
      static_cast<std::uint64_t>(stats.total.reserved_bytes[0].current);
  s.free_bytes = frag.free_bytes;
  s.largest_free_bytes = frag.largest_free_bytes;
  s.external = frag.external;
  result_.max_external_fragmentation =
      std::max(result_.max_external_fragmentation, s.external);
  result_.samples.push_back(s);
}

void ReplayRun::MeasureTrimPoint(std::size_t index,
                                 std::size_t active_streams) {
  const DeviceAllocatorStats stats = alloc_->Stats();
  const auto reserved =
      static_cast<std::uint64_t>(stats.total.reserved_bytes[0].current) +
      stats.granule_cache_bytes;
  const auto live =
      static_cast<std::uint64_t>(stats.total.allocated_bytes[0].current);
  const std::uint64_t residual = reserved > live ? reserved - live : 0;
  const double per_stream =
      active_streams == 0
          ? 0.0
          : static_cast<double>(residual) /
                static_cast<double>(kCapacityStep * active_streams);
  if (!result_.worst_trim_point || residual > result_.max_trim_residual_bytes) {
    result_.max_trim_residual_bytes = residual;
    result_.worst_trim_point = index;
  }
  result_.max_trim_residual_granules_per_stream =
      std::max(result_.max_trim_residual_granules_per_stream, per_stream);
}

absl::StatusOr<ReplayResult> ReplayRun::Run() {
  CTXPOOL_ASSIGN_OR_RETURN(result_.capacity_bytes,
                           driver_.DeviceTotalMem(device_));
  result_.device = driver_.Describe();
  result_.trace_source = trace_.source();
  const bool sim_costs = sim_ != nullptr && config_.cost_model;
  std::uint64_t upstream_before = 0, upstream_frees_before = 0;
  std::int64_t sim_time_before = 0;
  if (sim_ != nullptr) {
    result_.context_overhead_bytes =
        sim_->device_spec(device_).context_overhead_bytes;
    if (sim_costs) CTXPOOL_RETURN_IF_ERROR(sim_->UseRealisticCosts());
    sim_time_before = sim_->simulated_time_ns();
  }
  CTXPOOL_RETURN_IF_ERROR(Setup());
  result_.backing = alloc_->options().backing == BackingMode::kExpandable
                        ? "expandable"
                        : "classic";
  const std::array<std::uint64_t, kSimCallCount> calls_at_start = CallCounts();
  const std::int64_t driver_ns_at_start =
      sim_ != nullptr ? sim_->simulated_time_ns() : 0;
  if (sim_ != nullptr) {
    upstream_before = sim_->call_count(SimCall::kMemAlloc) +
                      sim_->call_count(SimCall::kMemCreate);
    upstream_frees_before = sim_->call_count(SimCall::kMemFree) +
                            sim_->call_count(SimCall::kMemRelease);
  }

  const std::vector<TraceEvent>& events = trace_.events();
  const std::size_t n = events.size();
  const std::size_t sample_every = config_.sample_every != 0
                                       ? config_.sample_every
                                       : std::max<std::size_t>(1, n / 200);
  const std::size_t progress_every =
      std::max<std::size_t>(1, config_.progress_every);
  std::vector<std::int64_t> sim_alloc, sim_free;
  std::vector<std::int64_t>& wall_alloc = wall_alloc_;
  std::vector<std::int64_t>& wall_free = wall_free_;
  wall_alloc.clear();
  wall_free.clear();
  call_log_.clear();
  const bool log_calls = FoldsWallMinima(config_);
  if (sim_costs) {
    sim_alloc.reserve(n / 2 + 1);
    sim_free.reserve(n / 2 + 1);
  }
  if (config_.wall_latency) {
    wall_alloc.reserve(n / 2 + 1);
    wall_free.reserve(n / 2 + 1);
  }
  absl::flat_hash_map<std::uint64_t, LiveAlloc> live;
  live.reserve(1024);
  // Live allocations per trace stream; `active_streams` counts non-zero ones.
  absl::flat_hash_map<std::uint64_t, std::uint64_t> stream_live;
  std::size_t active_streams = 0;
  absl::flat_hash_set<std::uint64_t> failed;  // trace ptrs whose alloc failed
  std::uint64_t live_bytes = 0;
  const std::int64_t start_ns = NowNs();

  // After each event, acted on or not: the fragmentation sample and the
  // progress report.
  auto tick = [&](std::size_t i) {
    if (i % sample_every == 0) Sample(i, live_bytes);
    if (config_.progress && (i + 1) % progress_every == 0) {
      config_.progress(i + 1, n);
    }
  };
  const int passes = std::max(1, config_.passes);
  for (int pass = 0; pass < passes && !result_.stopped_at_oom; ++pass) {
    const std::array<std::uint64_t, kSimCallCount> calls_at_pass = CallCounts();
    const std::int64_t driver_ns_at_pass =
        sim_ != nullptr ? sim_->simulated_time_ns() : 0;
    const std::uint64_t ops_at_pass = result_.ops;
    if (pass != 0) failed.clear();  // their frees belong to the last pass
    for (std::size_t i = 0; i < n; ++i) {
      const TraceEvent& e = events[i];
      if (e.op == TraceOp::kAlloc) {
        const StreamHandle stream = streams_.at(e.stream);
        const std::int64_t s0 =
            sim_costs ? SimDriver::thread_simulated_time_ns() : 0;
        const std::int64_t w0 = config_.wall_latency ? NowNs() : 0;
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(e.size, stream);
        if (config_.wall_latency) wall_alloc.push_back(NowNs() - w0);
        if (sim_costs) {
          sim_alloc.push_back(SimDriver::thread_simulated_time_ns() - s0);
        }
        if (log_calls) call_log_.push_back(CallKey(i, false, p.ok()));
        ++result_.ops;
        if (!p.ok()) {
          const absl::StatusCode code = p.status().code();
          if (code != absl::StatusCode::kResourceExhausted &&
              code != absl::StatusCode::kInvalidArgument) {
            return absl::Status(
                code, absl::StrCat("event ", i, ": Allocate(", e.size,
                                   ") failed: ", p.status().message()));
          }
          ++result_.ooms;
          failed.insert(e.ptr);
          if (!result_.first_oom) {
            OomInfo oom;
            oom.event_index = i;
            oom.requested_bytes = e.size;
            oom.live_bytes = live_bytes;
            const DeviceAllocatorStats stats = alloc_->Stats();
            oom.reserved_bytes = static_cast<std::uint64_t>(
                stats.total.reserved_bytes[0].current);
            oom.cached_bytes = stats.granule_cache_bytes;
            oom.message = std::string(p.status().message());
            result_.first_oom = std::move(oom);
          }
          if (config_.stop_at_first_oom) {
            result_.stopped_at_oom = true;
            break;
          }
          tick(i);
          continue;
        }
        if (!live.emplace(e.ptr, LiveAlloc{*p, e.size, e.stream}).second) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "event %d: allocation of pointer 0x%x, which is live", i, e.ptr));
        }
        ++result_.allocs;
        if (stream_live[e.stream]++ == 0) ++active_streams;
        live_bytes += e.size;
        result_.peak_live_bytes = std::max(result_.peak_live_bytes, live_bytes);
      } else if (e.op == TraceOp::kFree) {
        auto it = live.find(e.ptr);
        if (it == live.end()) {
          if (failed.erase(e.ptr) != 0) {
            ++result_.skipped_frees;
            tick(i);
            continue;
          }
          return absl::InvalidArgumentError(absl::StrFormat(
              "event %d: free of unknown pointer 0x%x", i, e.ptr));
        }
        const std::int64_t s0 =
            sim_costs ? SimDriver::thread_simulated_time_ns() : 0;
        const std::int64_t w0 = config_.wall_latency ? NowNs() : 0;
        absl::Status st = alloc_->Deallocate(it->second.ptr);
        if (config_.wall_latency) wall_free.push_back(NowNs() - w0);
        if (sim_costs) {
          sim_free.push_back(SimDriver::thread_simulated_time_ns() - s0);
        }
        if (log_calls) call_log_.push_back(CallKey(i, true, st.ok()));
        if (!st.ok()) {
          return absl::InternalError(
              absl::StrCat("event ", i, ": Deallocate failed: ", st.message()));
        }
        ++result_.ops;
        ++result_.frees;
        live_bytes -= it->second.size;
        if (--stream_live[it->second.stream] == 0) --active_streams;
        live.erase(it);
      } else if (e.op == TraceOp::kTrim && config_.replay_trims) {
        CTXPOOL_RETURN_IF_ERROR(alloc_->Trim(0).status());
        ++result_.trims;
        MeasureTrimPoint(i, active_streams);
      } else {
        ++result_.skipped_events;
      }
      tick(i);
    }
    if (pass + 1 < passes && !result_.stopped_at_oom) {
      // What the trace leaves live goes before the next pass, in address
      // order (deterministic).
      std::vector<std::pair<std::uint64_t, LiveAlloc>> rest(live.begin(),
                                                            live.end());
      std::sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) {
        return a.second.ptr < b.second.ptr;
      });
      for (const auto& [ptr, a] : rest) {
        absl::Status st = alloc_->Deallocate(a.ptr);
        if (!st.ok()) {
          return absl::InternalError(absl::StrCat(
              "end of pass ", pass + 1, ": Deallocate failed: ", st.message()));
        }
        ++result_.ops;
        ++result_.frees;
        live_bytes -= a.size;
        if (--stream_live[a.stream] == 0) --active_streams;
      }
      live.clear();
    }
    ReplayResult::Pass p;
    p.ops = result_.ops - ops_at_pass;
    CallsSince(calls_at_pass, &p.driver_calls, &p.driver_calls_total);
    if (sim_ != nullptr) {
      p.simulated_driver_ns = sim_->simulated_time_ns() - driver_ns_at_pass;
    }
    result_.passes.push_back(std::move(p));
  }
  result_.wall_time_ns = NowNs() - start_ns;
  CallsSince(calls_at_start, &result_.driver_calls,
             &result_.driver_calls_total);
  if (sim_ != nullptr) {
    result_.simulated_driver_ns =
        sim_->simulated_time_ns() - driver_ns_at_start;
  }
  if (n > 0) Sample(n - 1, live_bytes);
  if (config_.progress) config_.progress(n, n);

  const DeviceAllocatorStats stats = alloc_->Stats();
  result_.peak_reserved_bytes =
      static_cast<std::uint64_t>(stats.total.reserved_bytes[0].peak);
  result_.end_reserved_bytes =
      static_cast<std::uint64_t>(stats.total.reserved_bytes[0].current);
  result_.end_live_bytes = live_bytes;
  result_.cache_hits = static_cast<std::uint64_t>(stats.cache_hits);
  if (sim_ != nullptr) {
    result_.upstream_allocations = sim_->call_count(SimCall::kMemAlloc) +
                                   sim_->call_count(SimCall::kMemCreate) -
                                   upstream_before;
    result_.upstream_frees = sim_->call_count(SimCall::kMemFree) +
                             sim_->call_count(SimCall::kMemRelease) -
                             upstream_frees_before;
    result_.simulated_time_ns = sim_->simulated_time_ns() - sim_time_before;
  } else {
    result_.upstream_allocations =
        static_cast<std::uint64_t>(stats.upstream_allocs);
    result_.upstream_frees = static_cast<std::uint64_t>(stats.upstream_frees);
  }
  if (result_.peak_live_bytes > 0) {
    result_.peak_reserved_over_live =
        static_cast<double>(result_.peak_reserved_bytes) /
        static_cast<double>(result_.peak_live_bytes);
  }
  result_.sim_alloc = ComputeLatencyStats(sim_alloc);
  result_.sim_free = ComputeLatencyStats(sim_free);
  if (log_calls) {
    // The samples stay in call order: a repeated replay folds them per call.
    std::vector<std::int64_t> sorted = wall_alloc;
    result_.wall_alloc = ComputeLatencyStats(sorted);
    sorted = wall_free;
    result_.wall_free = ComputeLatencyStats(sorted);
  } else {
    result_.wall_alloc = ComputeLatencyStats(wall_alloc);
    result_.wall_free = ComputeLatencyStats(wall_free);
  }
  return std::move(result_);
}

void AppendLatencyJson(std::string* out, absl::string_view name,
                       const LatencyStats& l) {
  absl::StrAppendFormat(out,
                        "\"%s\": {\"count\": %d, \"p50_ns\": %d, "
                        "\"p99_ns\": %d, \"p999_ns\": %d, \"max_ns\": %d, "
                        "\"mean_ns\": %.1f, \"total_ns\": %d}",
                        name, l.count, l.p50, l.p99, l.p999, l.max, l.mean,
                        l.total);
}

void AppendCallsJson(
    std::string* out,
    const std::vector<std::pair<std::string, std::uint64_t>>& calls) {
  *out += "{";
  for (std::size_t i = 0; i < calls.size(); ++i) {
    absl::StrAppendFormat(out, "%s%s: %d", i == 0 ? "" : ", ",
                          JsonString(calls[i].first), calls[i].second);
  }
  *out += "}";
}

std::string CallsText(
    const std::vector<std::pair<std::string, std::uint64_t>>& calls) {
  std::vector<std::string> parts;
  parts.reserve(calls.size());
  for (const auto& [name, n] : calls)
    parts.push_back(absl::StrCat(name, " ", n));
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

std::string LatencyLine(absl::string_view name, const LatencyStats& l) {
  if (l.count == 0) return absl::StrCat("  ", name, ": not measured\n");
  return absl::StrFormat(
      "  %-22s p50 %8d ns  p99 %9d ns  p99.9 %9d ns  max %10d ns  (n=%d)\n",
      name, l.p50, l.p99, l.p999, l.max, l.count);
}

}  // namespace

LatencyStats ComputeLatencyStats(std::vector<std::int64_t>& samples) {
  LatencyStats l;
  l.count = samples.size();
  if (samples.empty()) return l;
  std::sort(samples.begin(), samples.end());
  auto rank = [&](double q) {
    // Nearest rank: the smallest value with at least q of samples <= it.
    const auto k = static_cast<std::size_t>(
        std::ceil(q * static_cast<double>(samples.size())));
    return samples[std::clamp<std::size_t>(k, 1, samples.size()) - 1];
  };
  l.p50 = rank(0.50);
  l.p99 = rank(0.99);
  l.p999 = rank(0.999);
  l.max = samples.back();
  for (std::int64_t v : samples) l.total += v;
  l.mean = static_cast<double>(l.total) / static_cast<double>(samples.size());
  return l;
}

namespace {

// Folds one run's samples into the per-call minima `into` (empty: the first
// run's samples). REQUIRES: the run logged the first run's calls.
void FoldMinima(int run, const std::vector<std::int64_t>& samples,
                std::vector<std::int64_t>* into) {
  if (run == 0) {
    *into = samples;
    return;
  }
  for (std::size_t i = 0; i < samples.size(); ++i) {
    (*into)[i] = std::min((*into)[i], samples[i]);
  }
}

// OK when run `run` made the first run's calls (ReplayRun::call_log), with
// the same outcomes; else where the two part.
absl::Status SameCalls(int run, const std::vector<std::uint64_t>& log,
                       const std::vector<std::uint64_t>& first) {
  const std::size_t common = std::min(log.size(), first.size());
  const std::size_t k = static_cast<std::size_t>(
      std::mismatch(log.begin(), log.begin() + common, first.begin()).first -
      log.begin());
  if (k == log.size() && k == first.size()) return absl::OkStatus();
  auto describe = [](const std::vector<std::uint64_t>& calls, std::size_t k) {
    if (k >= calls.size()) return std::string("no call");
    const std::uint64_t c = calls[k];
    return absl::StrFormat("%s at event %d %s",
                           (c & 2) != 0 ? "Deallocate" : "Allocate", c >> 2,
                           (c & 1) != 0 ? "succeeded" : "failed");
  };
  return absl::InternalError(absl::StrFormat(
      "replay run %d parts from the first at timed call %d: %s, where the "
      "first run made %s; the runs did not replay the same way",
      run + 1, k + 1, describe(log, k), describe(first, k)));
}

// config.repeats runs, each on the driver `next_driver` gives (device
// `device`), folded as ReplayConfig::repeats says.
absl::StatusOr<ReplayResult> RepeatedReplay(
    const Trace& trace, int device, const ReplayConfig& config,
    absl::FunctionRef<absl::StatusOr<Driver*>()> next_driver) {
  if (config.repeats < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "replay: repeats must be at least 1, not %d", config.repeats));
  }
  std::optional<ReplayResult> first;
  std::vector<std::int64_t> alloc_min, free_min;
  std::vector<std::uint64_t> first_calls;
  const bool fold = FoldsWallMinima(config);
  for (int k = 0; k < config.repeats; ++k) {
    CTXPOOL_ASSIGN_OR_RETURN(Driver * driver, next_driver());
    ReplayRun run(trace, *driver, device, config);
    CTXPOOL_ASSIGN_OR_RETURN(ReplayResult r, run.Run());
    if (fold) {
      // Each call's minimum is over the same call: same event, same kind,
      // same outcome in every run.
      if (k == 0) {
        first_calls = run.call_log();
      } else {
        CTXPOOL_RETURN_IF_ERROR(SameCalls(k, run.call_log(), first_calls));
      }
      FoldMinima(k, run.wall_alloc_samples(), &alloc_min);
      FoldMinima(k, run.wall_free_samples(), &free_min);
    }
    if (k == 0) first = std::move(r);
  }
  first->repeats = config.repeats;
  if (fold) {
    first->wall_alloc_min = ComputeLatencyStats(alloc_min);
    first->wall_free_min = ComputeLatencyStats(free_min);
  }
  return std::move(*first);
}

}  // namespace

absl::StatusOr<ReplayResult> ReplayOnDriver(const Trace& trace, Driver& driver,
                                            int device,
                                            const ReplayConfig& config) {
  return RepeatedReplay(trace, device, config,
                        [&]() -> absl::StatusOr<Driver*> { return &driver; });
}

absl::StatusOr<ReplayResult> Replay(const Trace& trace,
                                    const ReplayConfig& config) {
  CTXPOOL_ASSIGN_OR_RETURN(SimDeviceSpec spec, SpecFor(config));
  std::unique_ptr<SimDriver> sim;
  return RepeatedReplay(trace, 0, config, [&]() -> absl::StatusOr<Driver*> {
    sim.reset();  // the previous run's, before the next is built
    sim = SimDriver::Create({.devices = {spec}});
    sim->SetRaceDetection(false);  // replays touch no memory
    return sim.get();
  });
}

absl::StatusOr<CapacitySearch> FindMinCapacity(const Trace& trace,
                                               const ReplayConfig& config) {
  CTXPOOL_ASSIGN_OR_RETURN(SimDeviceSpec spec, SpecFor(config));
  ReplayConfig probe = config;
  probe.cost_model = false;
  probe.wall_latency = false;
  probe.repeats = 1;
  probe.stop_at_first_oom = true;
  probe.sample_every = std::numeric_limits<std::size_t>::max();
  probe.progress = nullptr;

  CapacitySearch out;
  out.step_bytes = kCapacityStep;
  out.context_overhead_bytes = spec.context_overhead_bytes;
  const TraceSummary summary = Summarize(trace);
  out.peak_live_bytes = summary.peak_live_bytes;

  auto fits = [&](std::uint64_t capacity) -> absl::StatusOr<bool> {
    ReplayConfig c = probe;
    c.capacity_bytes = capacity;
    ++out.replays;
    CTXPOOL_ASSIGN_OR_RETURN(ReplayResult r, Replay(trace, c));
    return r.ooms == 0;
  };
  auto round_up = [](std::uint64_t v) {
    return (v + kCapacityStep - 1) / kCapacityStep * kCapacityStep;
  };

  // Upper bound: a device so large nothing fails, then the most physical
  // memory that run used.
  const std::uint64_t need =
      summary.peak_live_bytes + spec.context_overhead_bytes;
  const std::uint64_t huge = std::max<std::uint64_t>(
      std::uint64_t{1} << 40, round_up(4 * need + spec.capacity_bytes));
  std::uint64_t hi = 0;
  {
    ReplayConfig c = probe;
    c.capacity_bytes = huge;
    CTXPOOL_ASSIGN_OR_RETURN(SimDeviceSpec s, SpecFor(c));
    std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {s}});
    sim->SetRaceDetection(false);
    ++out.replays;
    CTXPOOL_ASSIGN_OR_RETURN(ReplayResult r, ReplayOnDriver(trace, *sim, 0, c));
    if (r.ooms != 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the trace runs out of memory even on a ", FormatBytes(huge),
          " device: ", r.first_oom ? r.first_oom->message : ""));
    }
    hi = round_up(std::max<std::uint64_t>(sim->peak_used_bytes(0), need));
  }
  CTXPOOL_ASSIGN_OR_RETURN(bool hi_fits, fits(hi));
  while (!hi_fits) {  // not monotone at the top: widen
    hi += std::max<std::uint64_t>(kCapacityStep, round_up(hi / 16));
    if (hi > huge) {
      return absl::ResourceExhaustedError("no capacity found that fits");
    }
    CTXPOOL_ASSIGN_OR_RETURN(hi_fits, fits(hi));
  }
  // Lower bound: less than live + context overhead cannot fit.
  std::uint64_t lo = need == 0 ? 0 : (need - 1) / kCapacityStep * kCapacityStep;
  while (hi - lo > kCapacityStep) {
    const std::uint64_t mid =
        lo + (hi - lo) / kCapacityStep / 2 * kCapacityStep;
    CTXPOOL_ASSIGN_OR_RETURN(bool ok, fits(mid));
    (ok ? hi : lo) = mid;
  }
  out.min_capacity_bytes = hi;
  return out;
}

absl::Status ParseAllocatorConfig(absl::string_view text,
                                  DeviceAllocatorOptions* options) {
  std::vector<absl::string_view> seen;
  for (absl::string_view kv : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> p =
        absl::StrSplit(kv, absl::MaxSplits('=', 1));
    const absl::string_view key = absl::StripAsciiWhitespace(p.first);
    const absl::string_view value = absl::StripAsciiWhitespace(p.second);
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--config: '", key, "' given twice"));
    }
    seen.push_back(key);
    if (key == "backing") {
      if (value == "classic") {
        options->backing = BackingMode::kClassic;
      } else if (value == "expandable" || value == "vmm") {
        options->backing = BackingMode::kExpandable;
      } else if (value == "auto") {
        options->backing = BackingMode::kAuto;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "--config: backing must be classic, expandable or auto, not '",
            value, "'"));
      }
      continue;
    }
    std::size_t* field = nullptr;
    if (key == "max_split_size") field = &options->max_split_size;
    if (key == "memory_limit") field = &options->memory_limit_bytes;
    // Counts, each with its range.
    struct Count {
      absl::string_view name;
      std::size_t* field;
      std::uint64_t lo, hi;
      std::string what;
    };
    const Count counts[] = {
        {"vmm_unit_divisor", &options->vmm_unit_divisor, 0,
         std::uint64_t{1} << 40, "a whole number (0: single granules)"},
        {"vmm_chunk_units", &options->vmm_chunk_units, 1, kMaxVmmChunkUnits,
         absl::StrCat("a whole number from 1 to ", kMaxVmmChunkUnits)},
    };
    const Count* count = nullptr;
    for (const Count& c : counts) {
      if (key == c.name) count = &c;
    }
    if (count != nullptr) {
      std::uint64_t n = 0;
      if (!absl::SimpleAtoi(value, &n) || n < count->lo || n > count->hi) {
        return absl::InvalidArgumentError(
            absl::StrCat("--config: ", count->name, " must be ", count->what,
                         ", not '", value, "'"));
      }
      *count->field = static_cast<std::size_t>(n);
      continue;
    }
    if (key == "round_bytes") field = &options->round_bytes;
    if (key == "small_size_limit") field = &options->small_size_limit;
    if (key == "small_segment_bytes") field = &options->small_segment_bytes;
    if (key == "large_segment_bytes") field = &options->large_segment_bytes;
    if (key == "large_round_bytes") field = &options->large_round_bytes;
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--config: unknown key '", key,
          "' (known: backing, memory_limit, vmm_unit_divisor, "
          "vmm_chunk_units, max_split_size, round_bytes, "
          "small_size_limit, small_segment_bytes, large_segment_bytes, "
          "large_round_bytes)"));
    }
    absl::StatusOr<std::uint64_t> bytes = ParseByteSize(value);
    // 0 means "none" for the limit.
    const bool zero_ok = field == &options->memory_limit_bytes;
    if (!bytes.ok() || (*bytes == 0 && !zero_ok)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--config: bad size '", value, "' for ", key, " (e.g. 64MiB)"));
    }
    *field = static_cast<std::size_t>(*bytes);
  }
  absl::Status valid = ValidateDeviceAllocatorOptions(*options);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config: ", valid.message()));
  }
  return absl::OkStatus();
}

std::string ReplayResultToJson(const ReplayResult& r, bool with_samples) {
  std::string out = "{";
  absl::StrAppendFormat(
      &out,
      "\"trace\": %s, \"device\": %s, \"capacity_bytes\": %d, "
      "\"context_overhead_bytes\": %d, \"ops\": %d, \"allocs\": %d, "
      "\"frees\": %d, \"skipped_events\": %d, \"skipped_frees\": %d, "
      "\"trims\": %d, \"peak_live_bytes\": %d, \"peak_reserved_bytes\": %d, "
      "\"peak_reserved_over_live\": %.4f, \"end_live_bytes\": %d, "
      "\"end_reserved_bytes\": %d, \"ooms\": %d, \"stopped_at_oom\": %s, "
      "\"upstream_allocations\": %d, \"upstream_frees\": %d, "
      "\"cache_hits\": %d, \"max_external_fragmentation\": %.4f, "
      "\"max_trim_residual_bytes\": %d, "
      "\"max_trim_residual_granules_per_stream\": %.4f, "
      "\"worst_trim_point\": %s, "
      "\"simulated_time_ns\": %d, \"wall_time_ns\": %d, "
      "\"repeats\": %d, ",
      JsonString(r.trace_source), JsonString(r.device), r.capacity_bytes,
      r.context_overhead_bytes, r.ops, r.allocs, r.frees, r.skipped_events,
      r.skipped_frees, r.trims, r.peak_live_bytes, r.peak_reserved_bytes,
      r.peak_reserved_over_live, r.end_live_bytes, r.end_reserved_bytes, r.ooms,
      r.stopped_at_oom ? "true" : "false", r.upstream_allocations,
      r.upstream_frees, r.cache_hits, r.max_external_fragmentation,
      r.max_trim_residual_bytes, r.max_trim_residual_granules_per_stream,
      r.worst_trim_point ? absl::StrCat(*r.worst_trim_point) : "null",
      r.simulated_time_ns, r.wall_time_ns, r.repeats);
  absl::StrAppendFormat(&out,
                        "\"backing\": %s, \"driver_calls_total\": %d, "
                        "\"simulated_driver_ns\": %d, \"driver_calls\": ",
                        JsonString(r.backing), r.driver_calls_total,
                        r.simulated_driver_ns);
  AppendCallsJson(&out, r.driver_calls);
  out += ", \"passes\": [";
  for (std::size_t i = 0; i < r.passes.size(); ++i) {
    const ReplayResult::Pass& p = r.passes[i];
    absl::StrAppendFormat(&out,
                          "%s{\"ops\": %d, \"driver_calls_total\": %d, "
                          "\"simulated_driver_ns\": %d, \"driver_calls\": ",
                          i == 0 ? "" : ", ", p.ops, p.driver_calls_total,
                          p.simulated_driver_ns);
    AppendCallsJson(&out, p.driver_calls);
    out += "}";
  }
  out += "], ";
  if (r.first_oom) {
    absl::StrAppendFormat(
        &out,
        "\"first_oom\": {\"event_index\": %d, \"requested_bytes\": %d, "
        "\"live_bytes\": %d, \"reserved_bytes\": %d, \"cached_bytes\": %d, "
        "\"message\": %s}, ",
        r.first_oom->event_index, r.first_oom->requested_bytes,
        r.first_oom->live_bytes, r.first_oom->reserved_bytes,
        r.first_oom->cached_bytes, JsonString(r.first_oom->message));
  } else {
    out += "\"first_oom\": null, ";
  }
  out += "\"latency\": {";
  AppendLatencyJson(&out, "sim_allocate", r.sim_alloc);
  out += ", ";
  AppendLatencyJson(&out, "sim_deallocate", r.sim_free);
  out += ", ";
  AppendLatencyJson(&out, "wall_allocate", r.wall_alloc);
  out += ", ";
  AppendLatencyJson(&out, "wall_deallocate", r.wall_free);
  if (r.wall_alloc_min.count != 0 || r.wall_free_min.count != 0) {
    out += ", ";
    AppendLatencyJson(&out, "wall_allocate_min", r.wall_alloc_min);
    out += ", ";
    AppendLatencyJson(&out, "wall_deallocate_min", r.wall_free_min);
  }
  out += "}";
  if (with_samples) {
    out += ", \"samples\": [";
    for (std::size_t i = 0; i < r.samples.size(); ++i) {
      const FragmentationSample& s = r.samples[i];
      absl::StrAppendFormat(
          &out,
          "%s{\"event\": %d, \"live_bytes\": %d, \"reserved_bytes\": %d, "
          "\"free_bytes\": %d, \"largest_free_bytes\": %d, "
          "\"external\": %.4f}",
          i == 0 ? "" : ", ", s.event_index, s.live_bytes, s.reserved_bytes,
          s.free_bytes, s.largest_free_bytes, s.external);
    }
    out += "]";
  }
  out += "}";
  return out;
}

std::string ReplayResultToText(const ReplayResult& r) {
  std::string out;
  absl::StrAppendFormat(&out, "trace:            %s\n", r.trace_source);
  absl::StrAppendFormat(&out, "device:           %s (%s", r.device,
                        FormatBytes(r.capacity_bytes));
  if (r.context_overhead_bytes != 0) {
    absl::StrAppendFormat(&out, ", context %s",
                          FormatBytes(r.context_overhead_bytes));
  }
  out += ")\n";
  absl::StrAppendFormat(&out,
                        "ops:              %d (%d allocs, %d frees; %d "
                        "events skipped)\n",
                        r.ops, r.allocs, r.frees, r.skipped_events);
  absl::StrAppendFormat(&out, "peak live:        %s\n",
                        FormatBytes(r.peak_live_bytes));
  absl::StrAppendFormat(&out, "peak reserved:    %s (x%.3f of peak live)\n",
                        FormatBytes(r.peak_reserved_bytes),
                        r.peak_reserved_over_live);
  absl::StrAppendFormat(&out, "end:              %s live, %s reserved\n",
                        FormatBytes(r.end_live_bytes),
                        FormatBytes(r.end_reserved_bytes));
  absl::StrAppendFormat(&out, "backing:          %s\n", r.backing);
  absl::StrAppendFormat(&out,
                        "upstream:         %d allocations, %d frees "
                        "(cuMemAlloc+cuMemCreate / cuMemFree+cuMemRelease)\n",
                        r.upstream_allocations, r.upstream_frees);
  absl::StrAppendFormat(&out, "driver calls:     %d, %.3f ms simulated (%s)\n",
                        r.driver_calls_total,
                        static_cast<double>(r.simulated_driver_ns) / 1e6,
                        CallsText(r.driver_calls));
  if (r.passes.size() > 1) {
    for (std::size_t i = 0; i < r.passes.size(); ++i) {
      const ReplayResult::Pass& p = r.passes[i];
      absl::StrAppendFormat(
          &out,
          "  pass %-3d        %d ops, %d driver calls (%.2f per 1000 ops), "
          "%.3f ms simulated (%s)\n",
          i + 1, p.ops, p.driver_calls_total,
          p.ops == 0 ? 0.0
                     : 1000.0 * static_cast<double>(p.driver_calls_total) /
                           static_cast<double>(p.ops),
          static_cast<double>(p.simulated_driver_ns) / 1e6,
          CallsText(p.driver_calls));
    }
  }
  absl::StrAppendFormat(&out, "fragmentation:    max external %.3f\n",
                        r.max_external_fragmentation);
  if (r.trims != 0) {
    absl::StrAppendFormat(
        &out,
        "trim points:      %d; after Trim(0) reserved - live at most %s "
        "(event %d), %.3f granules per active stream\n",
        r.trims, FormatBytes(r.max_trim_residual_bytes),
        r.worst_trim_point.value_or(0),
        r.max_trim_residual_granules_per_stream);
  }
  if (!r.samples.empty()) {
    // Ten rows spread over the replay (all samples: --json --samples).
    absl::StrAppendFormat(&out, "  %-10s%10s %11s %11s %13s %9s\n", "over time",
                          "event", "live", "reserved", "largest free",
                          "external");
    const std::size_t rows = std::min<std::size_t>(10, r.samples.size());
    for (std::size_t k = 0; k < rows; ++k) {
      const FragmentationSample& s =
          r.samples[rows == 1 ? 0 : k * (r.samples.size() - 1) / (rows - 1)];
      absl::StrAppendFormat(&out, "  %20d %11s %11s %13s %9.3f\n",
                            s.event_index, FormatBytes(s.live_bytes),
                            FormatBytes(s.reserved_bytes),
                            FormatBytes(s.largest_free_bytes), s.external);
    }
  }
  if (r.first_oom) {
    absl::StrAppendFormat(
        &out,
        "OOMs:             %d; first at event %d: %s requested, %s live, %s "
        "reserved, %s cached%s\n",
        r.ooms, r.first_oom->event_index,
        FormatBytes(r.first_oom->requested_bytes),
        FormatBytes(r.first_oom->live_bytes),
        FormatBytes(r.first_oom->reserved_bytes),
        FormatBytes(r.first_oom->cached_bytes),
        r.stopped_at_oom ? " (stopped)" : "");
  } else {
    out += "OOMs:             0\n";
  }
  out += "latency:\n";
  out += LatencyLine("Allocate (sim cost)", r.sim_alloc);
  out += LatencyLine("Deallocate (sim cost)", r.sim_free);
  out += LatencyLine("Allocate (wall clock)", r.wall_alloc);
  out += LatencyLine("Deallocate (wall clock)", r.wall_free);
  if (r.wall_alloc_min.count != 0 || r.wall_free_min.count != 0) {
    absl::StrAppendFormat(&out, "  per call, the least wall time of %d runs:\n",
                          r.repeats);
    out += LatencyLine("Allocate (wall, min)", r.wall_alloc_min);
    out += LatencyLine("Deallocate (wall, min)", r.wall_free_min);
  }
  absl::StrAppendFormat(&out,
                        "time:             %.3f ms wall, %.3f ms simulated "
                        "driver time\n",
                        static_cast<double>(r.wall_time_ns) / 1e6,
                        static_cast<double>(r.simulated_time_ns) / 1e6);
  return out;
}

}  // namespace ctxpool
