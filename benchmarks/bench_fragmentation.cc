// bench_fragmentation — how much memory each allocator holds for the same
// workload: ctxpool (kClassic and kExpandable backing) and CUB's
// CachingDeviceAllocator (through the CUDA-runtime shim), on SimDriver.
//
// Workloads:
//   churn         MultiModelChurn: 6 models of 256 MiB - 4 GiB loaded,
//                 serving variable-size requests, unloaded, reloaded; 100
//                 cycles, 3 resident (seed 1); the server trims after each
//                 unload (97 trim points)
//   churn-no-trim the same trace without its trim events: a server that
//                 never trims (only the end of the replay is a trim point)
//   llm-serving   LlmServing defaults (7B weights, growing KV caches)
//   mixed         MixedSizes defaults
//   real:NAME     each *.rmm.csv in $CTXPOOL_TRACES_DIR (default
//                 ../shared/traces beside the checkout, fixed at build time):
//                 allocation traces PyTorch recorded on
//                 real GPUs (frees of blocks live before the recording are
//                 synthesised)
//
// Each benchmark replays its workload once per iteration on a fresh
// allocator over a fresh simulated 80 GiB device (race detection off); every
// figure but physical_allocs_per_1k_ops_warm comes from that single pass. The
// trace's kTrim events (trim points) are honoured by every implementation:
// ctxpool calls Trim(0), CUB FreeAllCached. The end of the replay is a trim
// point too. Live bytes are the trace's (requested sizes); an active stream
// has at least one live block. Google Benchmark counters:
//   peak_reserved_over_live  peak reserved / peak live (1.0 is perfect)
//   peak_reserved_bytes, peak_live_bytes
//   trim_residual_bytes      max over the trim points of reserved − live
//                            after trimming (expandable: mapped bytes)
//   trim_residual_granules_per_stream
//                            max over the trim points of residual /
//                            (2 MiB x active streams); 0 at a point with no
//                            active stream (target, expandable: <= 1)
//   driver_calls_per_1k_ops_cold
//                            every SimDriver call of any kind (cuMemAlloc,
//                            cuMemCreate, cuMemMap, cuMemSetAccess,
//                            cuMemUnmap, events, ...; CUB's runtime calls
//                            reach SimDriver through the shim) during the
//                            first pass, per 1000 of its alloc/free events
//   sim_driver_ms_cold       their simulated time (SimDriver's realistic
//                            cost table, CTXPOOL_SIM_COSTS to replace it)
//   driver_calls_per_1k_ops_warm, sim_driver_ms_warm
//                            the same during a second pass of the trace. A
//                            separate replay (WarmPass) runs the trace twice
//                            on one allocator and one simulated 80 GiB
//                            device with the same streams; what the first
//                            pass leaves live is freed between the passes
//                            and the end of the first pass is no trim point,
//                            so the second starts on whatever the allocator
//                            cached. Both passes honour the trace's trim
//                            points, so a trace that trims gives memory back
//                            to the driver and stays high here; 0 means the
//                            allocator served the whole second pass from
//                            memory it already held
//   oom_frontier_bytes       the smallest device (2 MiB steps, context
//                            included) on which the workload has no OOM
//   models_fit_24gb          (churn only) the largest number of resident
//                            models (of 12, 1 - 6 GiB each) a 24 GiB
//                            device serves through 100 churn cycles (with
//                            their trim points) without an OOM
// Benchmark names: BM_Fragmentation/<classic|expandable|cub>/<workload>. A
// configuration the library does not support yet (kExpandable before it
// lands) is reported with SkipWithError("unsupported: ...").
//
// After the runs a table prints the figures side by side, on stdout under
// the console reporter and on stderr otherwise, so that
// `--benchmark_format=json` prints pure JSON on stdout:
//
//   ctxpool_bench_fragmentation
//   ctxpool_bench_fragmentation --benchmark_format=json > results.json
//
// --quick replays smaller generated workloads and skips the frontier
// search (the smoke ctest). The process exits non-zero when a replay fails
// for another reason than an OOM or the simulated driver counted a misuse.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"

#if defined(CTXPOOL_HAVE_CUB_PEER)
#include "peers/cub_peer.h"
#include "peers/cuda_runtime_shim.h"
#endif

namespace ctxpool {
namespace {

bool g_quick = false;
bool g_failed = false;

enum class Impl { kClassic, kExpandable, kCub };
const char* ImplName(Impl i) {
  switch (i) {
    case Impl::kClassic:
      return "classic";
    case Impl::kExpandable:
      return "expandable";
    case Impl::kCub:
      return "cub";
  }
  return "?";
}

// ---- One allocator under test over one simulated device ---------------------

class Subject {
 public:
  virtual ~Subject() = default;
  virtual absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                             StreamHandle stream) = 0;
  virtual absl::Status Free(DevicePtr p) = 0;
  virtual absl::Status TrimAll() = 0;
  virtual std::uint64_t Reserved() const = 0;
};

class CtxpoolSubject final : public Subject {
 public:
  explicit CtxpoolSubject(std::unique_ptr<CachingDeviceAllocator> a)
      : a_(std::move(a)) {}
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle s) override {
    return a_->Allocate(bytes, s);
  }
  absl::Status Free(DevicePtr p) override { return a_->Deallocate(p); }
  absl::Status TrimAll() override { return a_->Trim(0).status(); }
  std::uint64_t Reserved() const override {
    return static_cast<std::uint64_t>(
        a_->Stats()
            .total.reserved_bytes[StatIndex(StatPool::kAggregate)]
            .current);
  }

 private:
  std::unique_ptr<CachingDeviceAllocator> a_;
};

#if defined(CTXPOOL_HAVE_CUB_PEER)
class CubSubject final : public Subject {
 public:
  CubSubject() : cub_(peers::CubPeer::Create()) {}
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle s) override {
    return cub_->Allocate(bytes, s);
  }
  absl::Status Free(DevicePtr p) override { return cub_->Deallocate(p); }
  absl::Status TrimAll() override { return cub_->FreeAllCached(); }
  std::uint64_t Reserved() const override {
    const peers::CubPeerStats s = cub_->Stats();
    return s.live_bytes + s.cached_bytes;
  }

 private:
  std::unique_ptr<peers::CubPeer> cub_;
};
#endif

struct ReplayFigures {
  std::uint64_t peak_live = 0;
  std::uint64_t peak_reserved = 0;
  std::uint64_t end_live = 0;
  // Max over the pass's trim points of reserved − live after trimming, and of
  // that residual / (2 MiB x active streams).
  std::uint64_t trim_residual = 0;
  double trim_residual_granules_per_stream = 0;
  int trim_points = 0;
  // Driver calls of every kind during the pass, their simulated time, and
  // the pass's alloc/free events.
  std::uint64_t driver_calls = 0;
  std::int64_t sim_driver_ns = 0;
  std::uint64_t ops = 0;
  std::int64_t ooms = 0;

  double DriverCallsPer1kOps() const {
    return ops == 0 ? 0.0
                    : 1000.0 * static_cast<double>(driver_calls) /
                          static_cast<double>(ops);
  }
  double SimDriverMs() const {
    return static_cast<double>(sim_driver_ns) / 1e6;
  }
};

// Replays `trace` `passes` times, one pass after the other, on one allocator
// over a fresh simulated device of `capacity` (the same streams throughout);
// returns the figures of each pass. Each pass honours the trace's trim
// points; the end of the last pass is a trim point too, the end of an
// earlier one is not (the next pass starts on what the allocator cached).
// Blocks a pass leaves live are freed after it (after the trim point at the
// end of the last pass), outside every pass's figures. A pass that hits an
// OOM with `stop_at_oom` ends the replay. UNIMPLEMENTED when the
// configuration is not supported.
absl::StatusOr<std::vector<ReplayFigures>> ReplayPasses(Impl impl,
                                                        const Trace& trace,
                                                        std::size_t capacity,
                                                        bool stop_at_oom,
                                                        int passes) {
  SimDeviceSpec spec = *SimDevicePreset("h100-80gb");
  spec.capacity_bytes = capacity;
  std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {spec}});
  sim->SetRaceDetection(false);
  CTXPOOL_RETURN_IF_ERROR(sim->UseRealisticCosts());
  CTXPOOL_ASSIGN_OR_RETURN(ContextHandle ctx, sim->PrimaryCtxRetain(0));
  CTXPOOL_RETURN_IF_ERROR(sim->CtxPushCurrent(ctx));
  std::vector<ReplayFigures> figures;
  absl::Status status;
  {
    std::unique_ptr<Subject> subject;
    if (impl == Impl::kCub) {
#if defined(CTXPOOL_HAVE_CUB_PEER)
      status = peers::InstallShimDriver(sim.get());
      if (status.ok()) subject = std::make_unique<CubSubject>();
#else
      status = absl::UnimplementedError("the CUB peer was not built");
#endif
    } else {
      DeviceAllocatorOptions o;
      o.backing = impl == Impl::kExpandable ? BackingMode::kExpandable
                                            : BackingMode::kClassic;
      absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> a =
          CachingDeviceAllocator::Create(*sim, 0, o);
      if (a.ok()) {
        subject = std::make_unique<CtxpoolSubject>(std::move(a).value());
      } else {
        status = a.status();
      }
    }
    // One stream per trace stream id, created up front.
    absl::flat_hash_map<std::uint64_t, StreamHandle> streams;
    for (const TraceEvent& e : trace.events()) {
      if (!status.ok()) break;
      if (e.op != TraceOp::kAlloc || streams.contains(e.stream)) continue;
      absl::StatusOr<StreamHandle> s = sim->StreamCreate(kStreamNonBlocking, 0);
      if (!s.ok())
        status = s.status();
      else
        streams[e.stream] = *s;
    }
    struct Live {
      DevicePtr ptr;  // null when the allocation failed
      std::uint64_t size = 0;
      std::uint64_t stream = 0;
    };
    // Trace pointer -> allocation of the current pass.
    absl::flat_hash_map<std::uint64_t, Live> live;
    auto free_live = [&]() {
      for (auto& [ptr, l] : live) {
        if (!l.ptr.is_null()) status.Update(subject->Free(l.ptr));
      }
      live.clear();
    };
    for (int pass = 0; pass < passes && subject != nullptr && status.ok();
         ++pass) {
      ReplayFigures& f = figures.emplace_back();
      std::uint64_t live_bytes = 0;
      // Successful live allocations per trace stream, and the non-zero count.
      absl::flat_hash_map<std::uint64_t, std::uint64_t> stream_live;
      std::uint64_t active_streams = 0;
      auto trim_point = [&]() -> absl::Status {
        CTXPOOL_RETURN_IF_ERROR(subject->TrimAll());
        const std::uint64_t reserved = subject->Reserved();
        const std::uint64_t residual =
            reserved > live_bytes ? reserved - live_bytes : 0;
        f.trim_residual = std::max(f.trim_residual, residual);
        if (active_streams != 0) {
          f.trim_residual_granules_per_stream =
              std::max(f.trim_residual_granules_per_stream,
                       static_cast<double>(residual) /
                           static_cast<double>((2ull << 20) * active_streams));
        }
        ++f.trim_points;
        return absl::OkStatus();
      };
      const std::uint64_t calls_start = sim->total_call_count();
      const std::int64_t ns_start = sim->simulated_time_ns();
      for (const TraceEvent& e : trace.events()) {
        if (!status.ok()) break;
        if (e.op == TraceOp::kAlloc || e.op == TraceOp::kFree) ++f.ops;
        if (e.op == TraceOp::kAlloc) {
          absl::StatusOr<DevicePtr> p =
              subject->Allocate(e.size, streams.at(e.stream));
          if (!p.ok()) {
            if (p.status().code() != absl::StatusCode::kResourceExhausted) {
              status = p.status();
              break;
            }
            ++f.ooms;
            if (stop_at_oom) break;
            live[e.ptr] = {DevicePtr(), e.size, e.stream};
          } else {
            live[e.ptr] = {*p, e.size, e.stream};
            if (stream_live[e.stream]++ == 0) ++active_streams;
          }
          live_bytes += e.size;
          f.peak_live = std::max(f.peak_live, live_bytes);
          f.peak_reserved = std::max(f.peak_reserved, subject->Reserved());
        } else if (e.op == TraceOp::kFree) {
          auto it = live.find(e.ptr);
          if (it == live.end()) continue;
          live_bytes -= it->second.size;
          if (!it->second.ptr.is_null()) {
            status = subject->Free(it->second.ptr);
            if (--stream_live[it->second.stream] == 0) --active_streams;
          }
          live.erase(it);
        } else if (e.op == TraceOp::kTrim) {
          status = trim_point();
        }
      }
      if (status.ok()) {
        f.driver_calls = sim->total_call_count() - calls_start;
        f.sim_driver_ns = sim->simulated_time_ns() - ns_start;
        f.end_live = live_bytes;
        if (pass + 1 == passes) status = trim_point();
      }
      free_live();
      if (stop_at_oom && f.ooms != 0) break;
    }
    if (subject != nullptr) free_live();
    subject.reset();
    for (auto& [id, s] : streams) status.Update(sim->StreamDestroy(s));
#if defined(CTXPOOL_HAVE_CUB_PEER)
    if (impl == Impl::kCub) status.Update(peers::InstallShimDriver(nullptr));
#endif
  }
  status.Update(sim->CtxPopCurrent().status());
  status.Update(sim->PrimaryCtxRelease(0));
  if (sim->misuse_count() != 0) {
    status.Update(absl::InternalError(
        absl::StrCat("simulated driver misuse: ", sim->misuse_log().back())));
  }
  if (!status.ok()) return status;
  return figures;
}

// Replays `trace` once on a fresh allocator over a fresh simulated device of
// `capacity`. UNIMPLEMENTED when the configuration is not supported.
absl::StatusOr<ReplayFigures> ReplayOn(Impl impl, const Trace& trace,
                                       std::size_t capacity, bool stop_at_oom) {
  CTXPOOL_ASSIGN_OR_RETURN(
      std::vector<ReplayFigures> passes,
      ReplayPasses(impl, trace, capacity, stop_at_oom, /*passes=*/1));
  return passes.front();
}

// The second of two passes of `trace` on one allocator over an 80 GiB
// device: physical allocations once warm.
absl::StatusOr<ReplayFigures> WarmPass(Impl impl, const Trace& trace) {
  CTXPOOL_ASSIGN_OR_RETURN(
      std::vector<ReplayFigures> passes,
      ReplayPasses(impl, trace, 80 * kGiB, false, /*passes=*/2));
  return passes.back();
}

// The smallest capacity (2 MiB steps) with no OOM; the device's context
// overhead is part of it.
absl::StatusOr<std::uint64_t> OomFrontier(Impl impl, const Trace& trace,
                                          const ReplayFigures& unconstrained) {
  constexpr std::uint64_t kStep = 2 << 20;
  const std::uint64_t overhead =
      SimDevicePreset("h100-80gb")->context_overhead_bytes;
  std::uint64_t lo = (unconstrained.peak_live + overhead) / kStep;  // fails?
  std::uint64_t hi =
      (unconstrained.peak_reserved + overhead + kStep - 1) / kStep + 1;  // runs
  while (lo + 1 < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    CTXPOOL_ASSIGN_OR_RETURN(ReplayFigures f,
                             ReplayOn(impl, trace, mid * kStep, true));
    if (f.ooms == 0) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi * kStep;
}

// The most resident churn models a 24 GiB device serves without an OOM.
absl::StatusOr<int> ModelsFit24GiB(Impl impl) {
  constexpr int kModels = 12;
  int fit = 0;
  for (int resident = 1; resident <= kModels; ++resident) {
    MultiModelChurnOptions o;
    o.models = kModels;
    o.resident = resident;
    o.min_model_bytes = 1ull << 30;
    o.max_model_bytes = 6ull << 30;
    o.cycles = g_quick ? 20 : 100;
    const Trace t = MultiModelChurn(o);
    CTXPOOL_ASSIGN_OR_RETURN(ReplayFigures f,
                             ReplayOn(impl, t, 24 * kGiB, true));
    if (f.ooms != 0) break;
    fit = resident;
  }
  return fit;
}

// ---- Workloads --------------------------------------------------------------

struct Workload {
  std::string name;
  Trace trace;
};

std::vector<Workload>& Workloads() {
  static std::vector<Workload>* w = new std::vector<Workload>();
  return *w;
}

absl::Status LoadWorkloads() {
  std::vector<Workload>& w = Workloads();
  MultiModelChurnOptions churn;
  churn.cycles = g_quick ? 20 : 100;
  w.push_back({"churn", MultiModelChurn(churn)});
  churn.trim_after_unload = false;
  w.push_back({"churn-no-trim", MultiModelChurn(churn)});
  LlmServingOptions llm;
  if (g_quick) llm.requests = 8;
  w.push_back({"llm-serving", LlmServing(llm)});
  MixedSizesOptions mixed;
  if (g_quick) mixed.ops = 2000;
  w.push_back({"mixed", MixedSizes(mixed)});
  const char* env = std::getenv("CTXPOOL_TRACES_DIR");
  const std::filesystem::path dir =
      env != nullptr && *env != '\0' ? env : CTXPOOL_DEFAULT_TRACES_DIR;
  std::error_code ec;
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 8 && name.substr(name.size() - 8) == ".rmm.csv") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  for (const auto& file : files) {
    TraceReadOptions read;
    read.unknown_free = UnknownFreePolicy::kSynthesizeAlloc;
    absl::StatusOr<Trace> t = ReadTraceFile(file.string(), read);
    if (!t.ok()) return t.status();
    std::string name = file.filename().string();
    name = name.substr(0, name.size() - 8);
    w.push_back({absl::StrCat("real:", name), std::move(t).value()});
  }
  if (files.empty()) {
    std::fprintf(stderr,
                 "bench_fragmentation: no *.rmm.csv in %s (set "
                 "CTXPOOL_TRACES_DIR); running generated workloads only\n",
                 dir.string().c_str());
  }
  return absl::OkStatus();
}

// ---- Results table ----------------------------------------------------------

struct Row {
  bool unsupported = false;
  std::string error;
  ReplayFigures figures;  // the single fresh pass
  ReplayFigures warm;     // the second pass of WarmPass
  std::optional<std::uint64_t> frontier;
  std::optional<int> models_fit;
};

absl::Mutex g_rows_mu;
std::map<std::pair<std::string, int>, Row>& Rows() {
  static auto* rows = new std::map<std::pair<std::string, int>, Row>();
  return *rows;
}

void BM_Fragmentation(benchmark::State& state, Impl impl,
                      const Workload* workload) {
  Row row;
  for (auto _ : state) {
    absl::StatusOr<ReplayFigures> f =
        ReplayOn(impl, workload->trace, 80 * kGiB, false);
    absl::StatusOr<ReplayFigures> warm =
        f.ok() ? WarmPass(impl, workload->trace) : f;
    if (!f.ok() || !warm.ok()) {
      if (f.ok()) f = warm.status();
      if (f.status().code() == absl::StatusCode::kUnimplemented) {
        row.unsupported = true;
        row.error = std::string(f.status().message());
        state.SkipWithError(absl::StrCat("unsupported: ", row.error).c_str());
      } else {
        g_failed = true;
        row.error = f.status().ToString();
        state.SkipWithError(row.error.c_str());
      }
      break;
    }
    row.figures = *f;
    row.warm = *warm;
  }
  if (row.error.empty()) {
    const ReplayFigures& f = row.figures;
    state.counters["peak_reserved_over_live"] =
        f.peak_live == 0 ? 0.0
                         : static_cast<double>(f.peak_reserved) /
                               static_cast<double>(f.peak_live);
    state.counters["peak_reserved_bytes"] =
        static_cast<double>(f.peak_reserved);
    state.counters["peak_live_bytes"] = static_cast<double>(f.peak_live);
    state.counters["trim_residual_bytes"] =
        static_cast<double>(f.trim_residual);
    state.counters["trim_residual_granules_per_stream"] =
        f.trim_residual_granules_per_stream;
    state.counters["driver_calls_per_1k_ops_cold"] = f.DriverCallsPer1kOps();
    state.counters["sim_driver_ms_cold"] = f.SimDriverMs();
    state.counters["driver_calls_per_1k_ops_warm"] =
        row.warm.DriverCallsPer1kOps();
    state.counters["sim_driver_ms_warm"] = row.warm.SimDriverMs();
    state.counters["ooms"] = static_cast<double>(f.ooms);
    if (!g_quick) {
      absl::StatusOr<std::uint64_t> frontier =
          OomFrontier(impl, workload->trace, f);
      if (frontier.ok()) {
        row.frontier = *frontier;
        state.counters["oom_frontier_bytes"] = static_cast<double>(*frontier);
      } else {
        g_failed = true;
        state.SkipWithError(frontier.status().ToString().c_str());
      }
    }
    if (workload->name == "churn") {
      absl::StatusOr<int> fit = ModelsFit24GiB(impl);
      if (fit.ok()) {
        row.models_fit = *fit;
        state.counters["models_fit_24gb"] = *fit;
      } else {
        g_failed = true;
        state.SkipWithError(fit.status().ToString().c_str());
      }
    }
  }
  absl::MutexLock lock(&g_rows_mu);
  Rows()[{workload->name, static_cast<int>(impl)}] = row;
}

std::string Gib(std::uint64_t b) {
  return absl::StrFormat("%.2f", static_cast<double>(b) / (1ull << 30));
}

// `out`: stdout under the console reporter, stderr otherwise (so that
// --benchmark_format=json|csv leaves stdout to the reporter alone).
void PrintTable(std::FILE* out) {
  absl::MutexLock lock(&g_rows_mu);
  std::fprintf(
      out,
      "\nFragmentation: peak reserved / peak live; after trimming at the trim "
      "points (max):\nreserved - live and that in 2 MiB granules per active "
      "stream; driver calls of\nevery kind per 1000 ops and their simulated "
      "time (ms) in the first pass (cold) and\nin a second pass of the trace "
      "on the same allocator (warm); OOM frontier.\nSizes in GiB.\n");
  std::fprintf(out,
               "%-38s %-11s %9s %9s %8s %10s %8s %9s %9s %9s %9s %9s %8s\n",
               "workload", "impl", "peak live", "peak res", "res/live",
               "trim resid", "gran/str", "calls/1k", "drv ms", "warm/1k",
               "warm ms", "frontier", "fit 24GB");
  std::string last;
  for (const auto& [key, row] : Rows()) {
    const std::string& w = key.first;
    const char* impl = ImplName(static_cast<Impl>(key.second));
    if (!row.error.empty()) {
      std::fprintf(out, "%-38s %-11s %s\n", w == last ? "" : w.c_str(), impl,
                   row.unsupported ? "unsupported" : "error");
    } else {
      const ReplayFigures& f = row.figures;
      std::fprintf(
          out,
          "%-38s %-11s %9s %9s %8.3f %10s %8.3f %9.2f %9.2f %9.2f %9.2f %9s "
          "%8s\n",
          w == last ? "" : w.c_str(), impl, Gib(f.peak_live).c_str(),
          Gib(f.peak_reserved).c_str(),
          f.peak_live ? static_cast<double>(f.peak_reserved) /
                            static_cast<double>(f.peak_live)
                      : 0.0,
          Gib(f.trim_residual).c_str(), f.trim_residual_granules_per_stream,
          f.DriverCallsPer1kOps(), f.SimDriverMs(),
          row.warm.DriverCallsPer1kOps(), row.warm.SimDriverMs(),
          row.frontier ? Gib(*row.frontier).c_str() : "-",
          row.models_fit ? absl::StrCat(*row.models_fit).c_str() : "-");
    }
    last = w;
  }
}

}  // namespace
}  // namespace ctxpool

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      ctxpool::g_quick = true;
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  // A flag neither Benchmark nor this program knows is a typo: say so.
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  if (absl::Status s = ctxpool::LoadWorkloads(); !s.ok()) {
    std::fprintf(stderr, "bench_fragmentation: %s\n", s.ToString().c_str());
    return 1;
  }
  for (const ctxpool::Workload& w : ctxpool::Workloads()) {
    for (ctxpool::Impl impl :
         {ctxpool::Impl::kClassic, ctxpool::Impl::kExpandable,
          ctxpool::Impl::kCub}) {
#if !defined(CTXPOOL_HAVE_CUB_PEER)
      if (impl == ctxpool::Impl::kCub) continue;
#endif
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Fragmentation/", ctxpool::ImplName(impl), "/",
                       w.name)
              .c_str(),
          [impl, &w](benchmark::State& st) {
            ctxpool::BM_Fragmentation(st, impl, &w);
          })
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
    }
  }
  // The display reporter --benchmark_format asks for; the table goes to
  // stdout only beside the console one (--benchmark_out writes its own file).
  std::unique_ptr<benchmark::BenchmarkReporter> display(
      benchmark::CreateDefaultDisplayReporter());
  const bool console =
      dynamic_cast<benchmark::ConsoleReporter*>(display.get()) != nullptr;
  const std::size_t ran = benchmark::RunSpecifiedBenchmarks(display.get());
  benchmark::Shutdown();
  if (ran == 0) {  // a --benchmark_filter that matches nothing
    std::fprintf(stderr,
                 "bench_fragmentation: no benchmark matches the filter "
                 "(--benchmark_list_tests lists them)\n");
    return 1;
  }
  ctxpool::PrintTable(console ? stdout : stderr);
  return ctxpool::g_failed ? 1 : 0;
}
