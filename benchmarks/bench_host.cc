// bench_host — the pinned host cache and the slab allocator against what
// they replace, in one run:
//
//   BM_HostCachedHit/<driver>/<bytes>   CachingHostAllocator Allocate +
//                                       Deallocate of a cached pinned buffer
//   BM_HostDriverAlloc/<driver>/<bytes> cuMemHostAlloc + cuMemFreeHost through
//                                       the Driver seam. On SimDriver the wall
//                                       time is the simulator's (malloc of
//                                       real memory); counter simulated_ns is
//                                       the documented realistic cost model's
//                                       time per pair (UseRealisticCosts).
//   BM_HostWaste/<scheme>               rounding waste on one seeded size
//                                       distribution (log-uniform 1 KiB ..
//                                       4 GiB, 100000 sizes; classes only, no
//                                       memory is pinned): ctxpool (8 classes
//                                       per doubling, the default), ctxpool4
//                                       (4 per doubling), pow2 (PyTorch's
//                                       rounding). Counter rounding_waste =
//                                       (rounded − requested) / rounded, summed
//                                       over bytes; mean_waste is the mean of
//                                       the per-request fraction.
//   BM_Small/<slab|device>/<bytes>      Allocate + Deallocate of one small
//                                       device object on one stream, through
//                                       the SlabAllocator or straight through
//                                       the CachingDeviceAllocator.
//
// <driver> is "sim" (SimDriver, race detection off) and, when libcuda and a
// device are present, "cuda" (the real driver). After the runs a table
// prints the ratios of CPU time per iteration (as ctxpool_bench_hotpath,
// robust when other processes share the cores) and checks the targets: cached
// pinned hit <= 100 ns, host rounding waste <= 12.5 %, slab faster than the
// device allocator for objects <= 1 KiB. absl::Mutex deadlock detection (on in
// Debian's Abseil build) is turned off, as in ctxpool_bench_hotpath. The exit
// status is non-zero when a run fails or the simulator counted a misuse.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/core/host_size_classes.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "support/forwarding_reporter.h"

namespace ctxpool {
namespace {

// One driver with a current context, a stream and the allocators.
struct Backend {
  std::string name;  // "sim" or "cuda"
  Driver* driver = nullptr;
  SimDriver* sim = nullptr;  // when name == "sim"
  ContextHandle ctx;
  StreamHandle stream;
  std::unique_ptr<CachingHostAllocator> host;
  std::unique_ptr<CachingDeviceAllocator> device;
  std::unique_ptr<SlabAllocator> slab;
};

struct Env {
  std::unique_ptr<SimDriver> sim;
  // A second simulator with the realistic cost model, for simulated_ns.
  std::unique_ptr<SimDriver> sim_costed;
  ContextHandle costed_ctx;
  std::unique_ptr<Driver> cuda;
  std::vector<std::unique_ptr<Backend>> backends;
};
Env* env = nullptr;

absl::Status SetUpBackend(Backend& b) {
  CTXPOOL_ASSIGN_OR_RETURN(b.ctx, b.driver->PrimaryCtxRetain(0));
  CTXPOOL_RETURN_IF_ERROR(b.driver->CtxSetCurrent(b.ctx));
  CTXPOOL_ASSIGN_OR_RETURN(b.stream,
                           b.driver->StreamCreate(kStreamNonBlocking, 0));
  CTXPOOL_ASSIGN_OR_RETURN(
      b.host, CachingHostAllocator::Create(*b.driver, {.context = b.ctx}));
  DeviceAllocatorOptions dopt;
  dopt.context = b.ctx;
  CTXPOOL_ASSIGN_OR_RETURN(b.device,
                           CachingDeviceAllocator::Create(*b.driver, 0, dopt));
  SlabAllocatorOptions sopt;
  sopt.context = b.ctx;
  CTXPOOL_ASSIGN_OR_RETURN(b.slab, SlabAllocator::Create(*b.device, sopt));
  return absl::OkStatus();
}

absl::Status SetUpEnv() {
  env = new Env;
  env->sim = SimDriver::Create();
  env->sim->SetRaceDetection(false);
  auto sim = std::make_unique<Backend>();
  sim->name = "sim";
  sim->driver = env->sim.get();
  sim->sim = env->sim.get();
  CTXPOOL_RETURN_IF_ERROR(SetUpBackend(*sim));
  env->backends.push_back(std::move(sim));

  env->sim_costed = SimDriver::Create();
  env->sim_costed->SetRaceDetection(false);
  CTXPOOL_RETURN_IF_ERROR(env->sim_costed->UseRealisticCosts());
  CTXPOOL_ASSIGN_OR_RETURN(env->costed_ctx,
                           env->sim_costed->PrimaryCtxRetain(0));

  absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
  if (cuda.ok()) {
    absl::StatusOr<int> n = (*cuda)->DeviceCount();
    if (n.ok() && *n > 0) {
      env->cuda = std::move(*cuda);
      auto b = std::make_unique<Backend>();
      b->name = "cuda";
      b->driver = env->cuda.get();
      if (absl::Status s = SetUpBackend(*b); s.ok()) {
        env->backends.push_back(std::move(b));
      } else {
        std::fprintf(stderr, "cuda backend unavailable: %s\n",
                     s.ToString().c_str());
      }
    }
  }
  // Back to the simulator's context for the simulator's runs.
  return env->sim->CtxSetCurrent(env->backends[0]->ctx);
}

// ---- Pinned host ------------------------------------------------------------

void BM_HostCachedHit(benchmark::State& state, Backend* b) {
  if (!b->driver->CtxSetCurrent(b->ctx).ok()) {
    state.SkipWithError("CtxSetCurrent failed");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  {  // warm: one cached buffer of the class
    absl::StatusOr<void*> p = b->host->Allocate(bytes, b->stream);
    if (!p.ok() || !b->host->Deallocate(*p).ok()) {
      state.SkipWithError("warm-up failed");
      return;
    }
  }
  const std::int64_t upstream = b->host->Stats().upstream_allocs;
  for (auto _ : state) {
    absl::StatusOr<void*> p = b->host->Allocate(bytes, b->stream);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(*p);
    b->host->Deallocate(*p).IgnoreError();
  }
  if (b->host->Stats().upstream_allocs != upstream) {
    state.SkipWithError("the timed loop pinned memory: not a cache hit");
  }
}

void BM_HostDriverAlloc(benchmark::State& state, Backend* b) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  Driver* driver = b->driver;
  ContextHandle ctx = b->ctx;
  if (b->sim != nullptr) {  // the costed simulator: same calls, plus a clock
    driver = env->sim_costed.get();
    ctx = env->costed_ctx;
  }
  if (!driver->CtxSetCurrent(ctx).ok()) {
    state.SkipWithError("CtxSetCurrent failed");
    return;
  }
  const std::int64_t sim_before =
      b->sim != nullptr ? env->sim_costed->simulated_time_ns() : 0;
  for (auto _ : state) {
    absl::StatusOr<void*> p = driver->MemHostAlloc(bytes, kHostAllocPortable);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(*p);
    driver->MemFreeHost(*p).IgnoreError();
  }
  if (b->sim != nullptr && state.iterations() > 0) {
    state.counters["simulated_ns"] =
        static_cast<double>(env->sim_costed->simulated_time_ns() - sim_before) /
        static_cast<double>(state.iterations());
  }
  b->driver->CtxSetCurrent(b->ctx).IgnoreError();
}

// ---- Rounding waste
// ------------------------------------------------------------

const std::vector<std::size_t>& WasteSizes() {
  static const std::vector<std::size_t>* sizes = [] {
    auto* v = new std::vector<std::size_t>;
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> log2(10.0, 32.0);  // 1 KiB..4 GiB
    for (int i = 0; i < 100000; ++i) {
      v->push_back(static_cast<std::size_t>(std::exp2(log2(rng))));
    }
    return v;
  }();
  return *sizes;
}

template <typename Round>
void Waste(benchmark::State& state, Round round) {
  const std::vector<std::size_t>& sizes = WasteSizes();
  double requested = 0, rounded = 0, fraction_sum = 0;
  for (auto _ : state) {
    requested = rounded = fraction_sum = 0;
    for (std::size_t s : sizes) {
      const std::size_t r = round(s);
      requested += static_cast<double>(s);
      rounded += static_cast<double>(r);
      fraction_sum += static_cast<double>(r - s) / static_cast<double>(r);
    }
    benchmark::DoNotOptimize(rounded);
  }
  state.counters["rounding_waste"] = (rounded - requested) / rounded;
  state.counters["mean_waste"] =
      fraction_sum / static_cast<double>(sizes.size());
  state.counters["pinned_over_requested"] = rounded / requested;
}

// ---- Small device objects
// -------------------------------------------------------

void BM_SmallSlab(benchmark::State& state, Backend* b) {
  b->driver->CtxSetCurrent(b->ctx).IgnoreError();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  // Keep one object live so the slab is not emptied on every free.
  absl::StatusOr<DevicePtr> keep = b->slab->Allocate(bytes, b->stream);
  if (!keep.ok()) {
    state.SkipWithError(keep.status().ToString().c_str());
    return;
  }
  for (auto _ : state) {
    absl::StatusOr<DevicePtr> p = b->slab->Allocate(bytes, b->stream);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(p->address());
    b->slab->Deallocate(*p).IgnoreError();
  }
  b->slab->Deallocate(*keep).IgnoreError();
}

void BM_SmallDevice(benchmark::State& state, Backend* b) {
  b->driver->CtxSetCurrent(b->ctx).IgnoreError();
  const auto bytes = static_cast<std::size_t>(state.range(0));
  absl::StatusOr<DevicePtr> keep = b->device->Allocate(bytes, b->stream);
  if (!keep.ok()) {
    state.SkipWithError(keep.status().ToString().c_str());
    return;
  }
  for (auto _ : state) {
    absl::StatusOr<DevicePtr> p = b->device->Allocate(bytes, b->stream);
    if (!p.ok()) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    benchmark::DoNotOptimize(p->address());
    b->device->Deallocate(*p).IgnoreError();
  }
  b->device->Deallocate(*keep).IgnoreError();
}

constexpr std::int64_t kSmallSizes[] = {64, 256, 1024};
constexpr std::int64_t kHostSizes[] = {4096, 1 << 20};

void RegisterBenchmarks() {
  for (const auto& bp : env->backends) {
    Backend* b = bp.get();
    for (std::int64_t bytes : kHostSizes) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_HostCachedHit/", b->name).c_str(), BM_HostCachedHit,
          b)
          ->Arg(bytes);
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_HostDriverAlloc/", b->name).c_str(),
          BM_HostDriverAlloc, b)
          ->Arg(bytes);
    }
  }
  benchmark::RegisterBenchmark("BM_HostWaste/ctxpool", [](benchmark::State& s) {
    CachingHostAllocator* host = env->backends[0]->host.get();
    Waste(s, [host](std::size_t b) { return host->RoundedSize(b); });
  });
  benchmark::RegisterBenchmark(
      "BM_HostWaste/ctxpool4", [](benchmark::State& s) {
        static constexpr HostSizeClasses kFour(4);
        Waste(s, [](std::size_t b) { return kFour.RoundUp(b); });
      });
  benchmark::RegisterBenchmark("BM_HostWaste/pow2", [](benchmark::State& s) {
    Waste(s, [](std::size_t b) { return RoundUpPowerOfTwo(b); });
  });
  for (const auto& bp : env->backends) {
    Backend* b = bp.get();
    for (std::int64_t bytes : kSmallSizes) {
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Small/slab/", b->name).c_str(), BM_SmallSlab, b)
          ->Arg(bytes);
      benchmark::RegisterBenchmark(
          absl::StrCat("BM_Small/device/", b->name).c_str(), BM_SmallDevice, b)
          ->Arg(bytes);
    }
  }
}

// ---- The ratio table
// ---------------------------------------------------------

// Wraps the display reporter; keeps each run's time per iteration (ns) and
// counters (the median aggregate when repeated, else the last run).
class RatioReporter final : public bench::ForwardingReporter {
 public:
  using ForwardingReporter::ForwardingReporter;

  const double* Ns(const std::string& name) const {
    auto it = cells_.find(name);
    return it == cells_.end() ? nullptr : &it->second.ns;
  }
  const double* Counter(const std::string& name, const std::string& k) const {
    auto it = cells_.find(name);
    if (it == cells_.end()) return nullptr;
    auto c = it->second.counters.find(k);
    return c == it->second.counters.end() ? nullptr : &c->second;
  }

 private:
  void Collect(const Run& run) override {
    const bool median =
        run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
    if (run.run_type == Run::RT_Aggregate && !median) return;
    Cell& c = cells_[run.run_name.str()];
    if (c.from_median && !median) return;
    c.from_median = median;
    const double to_ns =
        benchmark::GetTimeUnitMultiplier(benchmark::kNanosecond) /
        benchmark::GetTimeUnitMultiplier(run.time_unit);
    c.ns = run.GetAdjustedCPUTime() * to_ns;
    c.wall_ns = run.GetAdjustedRealTime() * to_ns;
    for (const auto& [k, v] : run.counters) c.counters[k] = v.value;
  }

  struct Cell {
    double ns = 0;  // CPU time per iteration
    double wall_ns = 0;
    bool from_median = false;
    std::map<std::string, double> counters;
  };
  std::map<std::string, Cell> cells_;
};

void PrintTable(const RatioReporter& r, std::FILE* out) {
  std::vector<std::string> misses;
  std::string body;
  for (const auto& bp : env->backends) {
    const std::string& d = bp->name;
    for (std::int64_t bytes : kHostSizes) {
      const double* hit =
          r.Ns(absl::StrCat("BM_HostCachedHit/", d, "/", bytes));
      const double* drv =
          r.Ns(absl::StrCat("BM_HostDriverAlloc/", d, "/", bytes));
      const double* simulated = r.Counter(
          absl::StrCat("BM_HostDriverAlloc/", d, "/", bytes), "simulated_ns");
      if (hit == nullptr) continue;
      std::string line = absl::StrFormat(
          "pinned %-4s %8d B: cached hit %8.1f ns", d, bytes, *hit);
      if (drv != nullptr) {
        absl::StrAppendFormat(&line, " | driver alloc+free %10.1f ns (%.0fx)",
                              *drv, *drv / *hit);
      }
      if (simulated != nullptr) {
        absl::StrAppendFormat(&line, " | simulated cost %10.0f ns (%.0fx)",
                              *simulated, *simulated / *hit);
      }
      if (*hit > 100.0) {
        misses.push_back(
            absl::StrFormat("cached pinned hit on %s, %d B: "
                            "%.1f ns > 100 ns",
                            d, bytes, *hit));
      }
      absl::StrAppend(&body, line, "\n");
    }
  }
  const double* ours = r.Counter("BM_HostWaste/ctxpool", "rounding_waste");
  const double* four = r.Counter("BM_HostWaste/ctxpool4", "rounding_waste");
  const double* pow2 = r.Counter("BM_HostWaste/pow2", "rounding_waste");
  if (ours != nullptr && pow2 != nullptr) {
    absl::StrAppendFormat(
        &body,
        "host rounding waste (log-uniform 1 KiB..4 GiB, bytes): ctxpool "
        "%.2f %%, 4/doubling %s, pow2 %.2f %% (%.1fx less waste)\n",
        100 * *ours,
        four != nullptr ? absl::StrFormat("%.2f %%", 100 * *four) : "-",
        100 * *pow2, *pow2 / std::max(*ours, 1e-9));
    if (*ours > 0.125) {
      misses.push_back(absl::StrFormat("host rounding waste %.2f %% > 12.5 %%",
                                       100 * *ours));
    }
  }
  for (const auto& bp : env->backends) {
    const std::string& d = bp->name;
    for (std::int64_t bytes : kSmallSizes) {
      const double* slab = r.Ns(absl::StrCat("BM_Small/slab/", d, "/", bytes));
      const double* dev = r.Ns(absl::StrCat("BM_Small/device/", d, "/", bytes));
      if (slab == nullptr || dev == nullptr) continue;
      absl::StrAppendFormat(&body,
                            "small %-4s %5d B: slab %7.1f ns | device "
                            "allocator %7.1f ns (slab %.2fx faster)\n",
                            d, bytes, *slab, *dev, *dev / *slab);
      if (*slab >= *dev) {
        misses.push_back(absl::StrFormat(
            "slab not faster than the device allocator on %s for %d B", d,
            bytes));
      }
    }
  }
  if (body.empty()) return;
  std::fprintf(out,
               "\nctxpool_bench_host summary: CPU ns per iteration (robust "
               "when other processes share the cores; wall time is in the "
               "table above), median when repeated\n%s",
               body.c_str());
  std::fprintf(out,
               "Targets (hit <= 100 ns, waste <= 12.5 %%, slab faster <= 1 "
               "KiB): %s\n",
               misses.empty() ? "met for the runs made" : "NOT met");
  for (const std::string& m : misses) std::fprintf(out, "  %s\n", m.c_str());
}

}  // namespace
}  // namespace ctxpool

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  benchmark::AddCustomContext("absl_mutex_deadlock_detection", "off");
  if (absl::Status s = ctxpool::SetUpEnv(); !s.ok()) {
    std::fprintf(stderr, "setup failed: %s\n", s.ToString().c_str());
    return 1;
  }
  ctxpool::RegisterBenchmarks();
  std::unique_ptr<benchmark::BenchmarkReporter> display(
      benchmark::CreateDefaultDisplayReporter());
  ctxpool::RatioReporter reporter(display.get());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  ctxpool::PrintTable(reporter, reporter.console() ? stdout : stderr);
  int failures = reporter.errors();
  const std::uint64_t misuse = ctxpool::env->sim->misuse_count();
  if (misuse != 0) {
    std::fprintf(stderr, "SimDriver counted %llu misuse(s)\n",
                 static_cast<unsigned long long>(misuse));
    for (const std::string& m : ctxpool::env->sim->misuse_log()) {
      std::fprintf(stderr, "  %s\n", m.c_str());
    }
    ++failures;
  }
  delete ctxpool::env;  // allocators first, then the drivers
  return failures == 0 ? 0 : 1;
}
