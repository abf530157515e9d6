// bench_hotpath — ns per cached Allocate+Deallocate pair, ctxpool vs CUB.
//
// Workloads (the same pre-generated size arrays for every implementation):
//   mix:512B, mix:4KiB, mix:64KiB, mix:1MiB, mix:8MiB   one fixed size
//   mix:mixed_512B_8MiB   1024 sizes, log-uniform over [512 B, 8 MiB],
//                         seed 42 (a request stream that hits every pool)
// Each is run with 1 and 2 threads; each thread uses its own stream (the
// server case: one stream per request worker). One block is live per thread:
// the loop is Allocate(size, stream) then Deallocate at once. The
// BM_HotpathShared rows run 2 threads on ONE stream (workers sharing a
// stream).
//
// Implementations, in the same run and on SimDrivers (race detection off,
// zero cost model):
//   ctxpool  ctxpool::CachingDeviceAllocator, default options (classic
//            backing: one cuMemAlloc'd segment per block group)
//   ctxpool-vmm  the same with the expandable (VMM) backing, which
//            DeviceContext and the PyTorch plugin use by default
//   session  ModelSession::Allocate/Deallocate on a DeviceContext
//            (expandable backing), a session of 2 streams, one per thread:
//            the path a C++ server calls
//   plugin   libctxpool_torch.so through its C ABI, dlopened as PyTorch's
//            CUDAPluggableAllocator does (ctxpool_try_malloc / ctxpool_free,
//            CTXPOOL_DRIVER=sim:h100-80gb, CTXPOOL_BACKING=auto, the
//            default model's session, 2 streams from ctxpool_model_stream):
//            the path PyTorch calls. --plugin=PATH names the library
//            (default: the one built with this benchmark); absent: no rows.
//   cub      cub::CachingDeviceAllocator via the CUDA-runtime shim
//            (benchmarks/peers/), bins 8^3..8^8 (512 B .. 16 MiB), no cache
//            cap, so every mix is served from its cache too. Its hot path
//            makes one runtime call per free (cudaEventRecord), which here
//            costs what SimDriver::EventRecord costs, not what a GPU's does.
// The allocator and its cache are created and warmed (every size of the mix,
// on every thread's stream) before timing; no driver allocation happens in
// the timed loop.
//
// Counters: items_per_second (pairs per second, all threads together, wall
// clock), ns_per_pair (thread CPU time per pair, averaged over threads: the
// figure compared, robust when other processes share the cores) and
// wall_ns_per_pair (wall time per pair as one thread sees it, including
// sleeping lock waits and preemption). After the runs a table compares the
// implementations (median of repetitions when --benchmark_repetitions is
// given), and a second table compares the paths users call — session and
// plugin against the bare expandable allocator and CUB, and each path's
// two-thread cost against its one-thread cost:
//
//   ctxpool_bench_hotpath --benchmark_repetitions=7
//                         --benchmark_enable_random_interleaving=true
//                         --benchmark_report_aggregates_only=true
//
// Random interleaving spreads each row's repetitions over the whole run, so
// a machine whose speed drifts (other tenants of a shared host) slows every
// row alike and the ratios stay sound; without it a row's repetitions run
// back to back and a ratio can compare a quiet minute with a busy one.
//
// CPU placement: the CPUs of a shared machine need not be equally fast (a
// virtual CPU whose host core is busy runs all code slower; on the 2-core
// machine this table was made on, one CPU ran a plain integer loop 1.7x
// slower than the other). Left to the scheduler, a one-thread row would
// measure which CPU it landed on. So every run covers the same CPUs
// equally: thread i of a two-thread run is pinned to the i-th CPU this
// process may use, and a one-thread run makes the first half of its timed
// pairs on the first CPU and the second half on the second. The speed of
// each CPU (the same integer loop) is printed before the tables.
// --no_pin leaves placement to the scheduler.
//
// Paired rounds: after the runs, the paths' ratios are measured once more
// side by side (RunPairedRounds): each round times 20,000 pairs on each path
// (bare expandable, session, plugin) with one thread on each CPU and then
// two threads at once, and takes the ratios within the round, so a drift of
// the machine's speed cancels; the table gives medians over rounds. These
// are the figures to quote for the ratios. --paired_rounds=N (default 40;
// 0: none).
//
// Stack placement: where the timed loop's stack sits relative to the
// allocator's objects, modulo 4 KiB, changes a pair's time. On the machine
// the README's table was made on, one bare allocator ran 57-65 ns at 237 of
// 256 stack offsets (16-byte steps over 4 KiB) and 66-79 ns at the other 19,
// all within a few hundred bytes (likely 4K aliasing: a load whose address
// matches an earlier store's in its low 12 bits waits for that store). A run
// that draws one offset per path compares a lucky draw with an unlucky one. So
// every timed loop runs below a stack pad that changes from run to run
// (AtStackOffset: 67 x 16 bytes more, modulo 4 KiB, per run or round), and the
// medians over repetitions and rounds give the cost at a typical offset for
// every path alike.
//
// --mutex_deadlock_detection keeps absl::Mutex's deadlock detection at the
// library default (on in Debian's Abseil build); it is off otherwise.
// --smoke additionally checks both allocators for correctness before the
// runs. The process exits non-zero when a run fails, a check fails, or the
// simulated driver counted a misuse (this is the cub_peer_smoke ctest).
#include <alloca.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "benchmark/benchmark.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/driver/types.h"
#include "support/forwarding_reporter.h"

#if defined(CTXPOOL_HAVE_CUB_PEER)
#include "peers/cub_peer.h"
#include "peers/cuda_runtime_shim.h"
#endif
#ifndef CTXPOOL_TORCH_PLUGIN_PATH
#define CTXPOOL_TORCH_PLUGIN_PATH ""
#endif

// The plugin's stream type, as plugins/torch/ctxpool_torch.h declares it.
typedef struct CUstream_st* cudaStream_t;

namespace ctxpool {
namespace {

constexpr int kMaxThreads = 2;

// ---- Workloads -------------------------------------------------------------

struct Mix {
  const char* name;
  std::vector<std::size_t> sizes;  // power-of-two length
};

std::vector<std::size_t> LogUniformSizes(std::size_t count, std::size_t lo,
                                         std::size_t hi, std::uint64_t seed) {
  // Computed by hand from the raw engine so the array is the same with every
  // standard library.
  std::mt19937_64 engine(seed);
  const double log_lo = std::log(static_cast<double>(lo));
  const double log_hi = std::log(static_cast<double>(hi));
  std::vector<std::size_t> sizes(count);
  for (std::size_t& s : sizes) {
    const double u = static_cast<double>(engine() >> 11) * 0x1.0p-53;
    const double v = std::exp(log_lo + u * (log_hi - log_lo));
    s = std::clamp(static_cast<std::size_t>(std::llround(v)), lo, hi);
  }
  return sizes;
}

const std::vector<Mix>& Mixes() {
  static const std::vector<Mix>* const mixes = new std::vector<Mix>{
      {"512B", {512}},
      {"4KiB", {4 * kKiB}},
      {"64KiB", {64 * kKiB}},
      {"1MiB", {1 * kMiB}},
      {"8MiB", {8 * kMiB}},
      {"mixed_512B_8MiB", LogUniformSizes(1024, 512, 8 * kMiB, 42)},
  };
  return *mixes;
}

enum class Impl : int {
  kCtxpool = 0,
  kCub = 1,
  kCtxpoolVmm = 2,
  kSession = 3,
  kPlugin = 4
};
constexpr std::array<const char*, 5> kImplNames = {
    "ctxpool", "cub", "ctxpool-vmm", "session", "plugin"};

// ---- The PyTorch plugin's C ABI, dlopened -----------------------------------

struct PluginApi {
  void* (*try_malloc)(size_t, int, cudaStream_t) = nullptr;
  void (*free)(void*, size_t, int, cudaStream_t) = nullptr;
  const char* (*memory_stats)(int) = nullptr;
  cudaStream_t (*model_stream)(int, int) = nullptr;
  const char* (*last_error)() = nullptr;
  int (*shutdown)(int) = nullptr;
};
PluginApi* plugin = nullptr;  // set in main when the library loads

absl::Status LoadPlugin(const std::string& path) {
  if (path.empty()) return absl::NotFoundError("no plugin library named");
  // The plugin's own simulated device, streams and sessions.
  setenv("CTXPOOL_DRIVER", "sim:h100-80gb", 1);
  setenv("CTXPOOL_BACKING", "auto", 1);
  setenv("CTXPOOL_SESSION_STREAMS", "2", 1);
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    return absl::NotFoundError(absl::StrCat("dlopen(", path, "): ", dlerror()));
  }
  auto api = std::make_unique<PluginApi>();
  api->try_malloc = reinterpret_cast<decltype(api->try_malloc)>(
      dlsym(h, "ctxpool_try_malloc"));
  api->free = reinterpret_cast<decltype(api->free)>(dlsym(h, "ctxpool_free"));
  api->memory_stats = reinterpret_cast<decltype(api->memory_stats)>(
      dlsym(h, "ctxpool_memory_stats"));
  api->model_stream = reinterpret_cast<decltype(api->model_stream)>(
      dlsym(h, "ctxpool_model_stream"));
  api->last_error = reinterpret_cast<decltype(api->last_error)>(
      dlsym(h, "ctxpool_last_error"));
  api->shutdown =
      reinterpret_cast<decltype(api->shutdown)>(dlsym(h, "ctxpool_shutdown"));
  if (!api->try_malloc || !api->free || !api->memory_stats ||
      !api->model_stream || !api->last_error || !api->shutdown) {
    return absl::NotFoundError(
        absl::StrCat(path, " lacks a ctxpool_* function"));
  }
  plugin = api.release();
  return absl::OkStatus();
}

// The integer after "key": in a JSON object; -1 if absent.
std::int64_t JsonInt(absl::string_view json, absl::string_view key) {
  const std::string needle = absl::StrCat("\"", key, "\":");
  const std::size_t at = json.find(needle);
  if (at == absl::string_view::npos) return -1;
  return std::strtoll(json.data() + at + needle.size(), nullptr, 10);
}

// ---- The process-wide simulated device -------------------------------------

struct Env {
  std::unique_ptr<SimDriver> sim;
  ContextHandle ctx;
  std::array<StreamHandle, kMaxThreads> streams;
};

Env* env = nullptr;  // set up in main before any benchmark thread starts

absl::Status SetUpEnv() {
  env = new Env();
  CTXPOOL_ASSIGN_OR_RETURN(SimDeviceSpec spec, SimDevicePreset("h100-80gb"));
  env->sim = SimDriver::Create({.devices = {spec}});
  env->sim->SetRaceDetection(false);
  CTXPOOL_ASSIGN_OR_RETURN(env->ctx, env->sim->PrimaryCtxRetain(0));
  CTXPOOL_RETURN_IF_ERROR(env->sim->CtxSetCurrent(env->ctx));
  for (StreamHandle& s : env->streams) {
    CTXPOOL_ASSIGN_OR_RETURN(s, env->sim->StreamCreate(kStreamNonBlocking, 0));
  }
#if defined(CTXPOOL_HAVE_CUB_PEER)
  CTXPOOL_RETURN_IF_ERROR(peers::InstallShimDriver(env->sim.get()));
#endif
  return absl::OkStatus();
}

absl::Status TearDownEnv() {
  absl::Status result;
#if defined(CTXPOOL_HAVE_CUB_PEER)
  result.Update(peers::InstallShimDriver(nullptr));
#endif
  for (StreamHandle s : env->streams) {
    result.Update(env->sim->StreamDestroy(s));
  }
  result.Update(env->sim->PrimaryCtxRelease(0));
  delete env;
  env = nullptr;
  return result;
}

// ---- One uniform interface over both allocators ----------------------------

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                             StreamHandle stream) = 0;
  // `bytes` as allocated (the plugin's free checks it, as PyTorch passes it).
  virtual absl::Status Deallocate(DevicePtr ptr, std::size_t bytes) = 0;
  // Nothing live, internal invariants hold.
  virtual absl::Status CheckIdle() = 0;
  // The stream of benchmark thread `t`.
  virtual StreamHandle stream(int t) const { return env->streams[t]; }
};

class CtxpoolAllocator final : public Allocator {
 public:
  explicit CtxpoolAllocator(std::unique_ptr<CachingDeviceAllocator> a)
      : a_(std::move(a)) {}
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle stream) override {
    return a_->Allocate(bytes, stream);
  }
  absl::Status Deallocate(DevicePtr ptr, std::size_t) override {
    return a_->Deallocate(ptr);
  }
  absl::Status CheckIdle() override {
    CTXPOOL_RETURN_IF_ERROR(a_->CheckInvariants());
    DeviceAllocatorStats stats = a_->Stats();
    const auto& live = stats.total.allocation[0];
    if (live.current != 0) {
      return absl::InternalError(
          absl::StrCat("ctxpool: ", live.current, " blocks still live"));
    }
    if (stats.invalid_frees != 0 || stats.invalid_requests != 0) {
      return absl::InternalError(
          absl::StrCat("ctxpool: invalid_frees=", stats.invalid_frees,
                       " invalid_requests=", stats.invalid_requests));
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<CachingDeviceAllocator> a_;
};

// ModelSession's front end on a DeviceContext of the shared SimDriver.
class SessionAllocator final : public Allocator {
 public:
  static absl::StatusOr<std::unique_ptr<Allocator>> Create() {
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    o.allocator.backing = BackingMode::kExpandable;
    auto a = std::unique_ptr<SessionAllocator>(new SessionAllocator());
    CTXPOOL_ASSIGN_OR_RETURN(a->dc_, DeviceContext::Create(*env->sim, 0, o));
    CTXPOOL_ASSIGN_OR_RETURN(a->session_,
                             a->dc_->OpenSession("bench", {.streams = 2}));
    return std::unique_ptr<Allocator>(std::move(a));
  }
  ~SessionAllocator() override {
    if (session_ != nullptr) session_->Close().IgnoreError();
  }
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle stream) override {
    return session_->Allocate(bytes, stream);
  }
  absl::Status Deallocate(DevicePtr ptr, std::size_t) override {
    return session_->Deallocate(ptr);
  }
  absl::Status CheckIdle() override {
    CTXPOOL_RETURN_IF_ERROR(dc_->device_allocator().CheckInvariants());
    const SessionStats st = session_->Stats();
    if (st.live_allocations != 0 || st.invalid_frees != 0) {
      return absl::InternalError(absl::StrCat("session: ", st.live_allocations,
                                              " live, ", st.invalid_frees,
                                              " invalid frees"));
    }
    return absl::OkStatus();
  }
  StreamHandle stream(int t) const override { return session_->stream(t); }

 private:
  SessionAllocator() = default;
  std::unique_ptr<DeviceContext> dc_;
  std::unique_ptr<ModelSession> session_;
};

// The plugin's C ABI (its own simulated device; a fresh state per run).
class PluginAllocator final : public Allocator {
 public:
  static absl::StatusOr<std::unique_ptr<Allocator>> Create() {
    if (plugin == nullptr) {
      return absl::UnavailableError("the plugin library was not loaded");
    }
    if (plugin->shutdown(/*force=*/0) != 0) {
      return absl::InternalError(plugin->last_error());
    }
    auto a = std::unique_ptr<PluginAllocator>(new PluginAllocator());
    for (int t = 0; t < kMaxThreads; ++t) {
      cudaStream_t s = plugin->model_stream(0, t);
      if (s == nullptr) return absl::InternalError(plugin->last_error());
      a->streams_[t] = StreamHandle::From(s);
    }
    return std::unique_ptr<Allocator>(std::move(a));
  }
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle stream) override {
    void* p = plugin->try_malloc(bytes, 0, stream.as<cudaStream_t>());
    if (ABSL_PREDICT_FALSE(p == nullptr)) {
      return absl::InternalError(plugin->last_error());
    }
    return DevicePtr::From(p);
  }
  absl::Status Deallocate(DevicePtr ptr, std::size_t bytes) override {
    plugin->free(ptr.get(), bytes, 0, nullptr);
    return absl::OkStatus();  // refusals are counted: CheckIdle sees them
  }
  absl::Status CheckIdle() override {
    const char* json = plugin->memory_stats(0);
    if (json == nullptr) return absl::InternalError(plugin->last_error());
    if (JsonInt(json, "allocation.all.current") != 0 ||
        JsonInt(json, "num_invalid_frees") != 0) {
      return absl::InternalError(absl::StrCat("plugin: ", json));
    }
    return absl::OkStatus();
  }
  StreamHandle stream(int t) const override { return streams_[t]; }

 private:
  PluginAllocator() = default;
  std::array<StreamHandle, kMaxThreads> streams_;
};

#if defined(CTXPOOL_HAVE_CUB_PEER)
class CubAllocator final : public Allocator {
 public:
  CubAllocator() : a_(peers::CubPeer::Create()) {}
  ~CubAllocator() override {
    absl::Status s = a_->FreeAllCached();
    if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
  }
  absl::StatusOr<DevicePtr> Allocate(std::size_t bytes,
                                     StreamHandle stream) override {
    return a_->Allocate(bytes, stream);
  }
  absl::Status Deallocate(DevicePtr ptr, std::size_t) override {
    return a_->Deallocate(ptr);
  }
  absl::Status CheckIdle() override {
    peers::CubPeerStats stats = a_->Stats();
    if (stats.live_blocks != 0 || stats.live_bytes != 0) {
      return absl::InternalError(
          absl::StrCat("cub: ", stats.live_blocks, " blocks still live"));
    }
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<peers::CubPeer> a_;
};
#endif

absl::StatusOr<std::unique_ptr<Allocator>> MakeAllocator(Impl impl) {
  if (impl == Impl::kSession) return SessionAllocator::Create();
  if (impl == Impl::kPlugin) return PluginAllocator::Create();
  if (impl == Impl::kCtxpool || impl == Impl::kCtxpoolVmm) {
    DeviceAllocatorOptions o;
    if (impl == Impl::kCtxpoolVmm) o.backing = BackingMode::kExpandable;
    CTXPOOL_ASSIGN_OR_RETURN(auto a,
                             CachingDeviceAllocator::Create(*env->sim, 0, o));
    return std::unique_ptr<Allocator>(new CtxpoolAllocator(std::move(a)));
  }
#if defined(CTXPOOL_HAVE_CUB_PEER)
  return std::unique_ptr<Allocator>(new CubAllocator());
#else
  return absl::UnavailableError("the CUB peer was not built");
#endif
}

// ---- CPU placement (see the file comment) ---------------------------------

struct Placement {
  bool pin = true;
  cpu_set_t original{};   // the process's mask, restored after each run
  std::vector<int> cpus;  // the first two CPUs of it
};
Placement& placement() {
  static Placement p;
  return p;
}

void InitPlacement(bool pin) {
  Placement& p = placement();
  p.pin = pin;
  CPU_ZERO(&p.original);
  if (sched_getaffinity(0, sizeof(p.original), &p.original) != 0) {
    p.pin = false;
    return;
  }
  for (int c = 0; c < CPU_SETSIZE && p.cpus.size() < 2; ++c) {
    if (CPU_ISSET(c, &p.original)) p.cpus.push_back(c);
  }
  if (p.cpus.size() < 2) p.pin = false;  // one CPU: nothing to balance
}

// Pins the calling thread to `cpu`, or back to the process's mask (-1).
void PinTo(int cpu) {
  Placement& p = placement();
  if (!p.pin) return;
  cpu_set_t set = p.original;
  if (cpu >= 0) {
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
  }
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// ns per step of a fixed integer loop on `cpu`: the CPU's speed as all code
// sees it.
double CpuSpeed(int cpu) {
  PinTo(cpu);
  volatile std::uint64_t x = 0;
  constexpr std::uint64_t kSteps = 50'000'000;
  const auto start = std::chrono::steady_clock::now();
  for (std::uint64_t i = 0; i < kSteps; ++i) x = x + i;
  const auto stop = std::chrono::steady_clock::now();
  PinTo(-1);
  return std::chrono::duration<double, std::nano>(stop - start).count() /
         kSteps;
}

// ---- Setup, the timed loop, teardown ---------------------------------------

std::int64_t ThreadCpuNanos() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// The allocator of the run in progress: written by Setup/Teardown, which
// Google Benchmark calls before starting and after joining the run's
// threads, read by those threads.
std::unique_ptr<Allocator> current;
absl::Status current_status;

// Runs the pair loop over every size of `mix` on each of `threads` streams,
// so the timed loop finds every size in the cache.
absl::Status Warm(Allocator& a, const Mix& mix, int threads) {
  for (int t = 0; t < threads; ++t) {
    for (int round = 0; round < 2; ++round) {
      for (std::size_t bytes : mix.sizes) {
        CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, a.Allocate(bytes, a.stream(t)));
        CTXPOOL_RETURN_IF_ERROR(a.Deallocate(p, bytes));
      }
    }
  }
  return a.CheckIdle();
}

template <Impl kImpl, int kMix, bool kShared>
void SetupRun(const benchmark::State& state) {
  current.reset();
  absl::StatusOr<std::unique_ptr<Allocator>> a = MakeAllocator(kImpl);
  if (!a.ok()) {
    current_status = a.status();
    return;
  }
  current = *std::move(a);
  current_status = Warm(*current, Mixes()[kMix], kShared ? 1 : state.threads());
}

template <Impl kImpl, int kMix, bool kShared>
void TeardownRun(const benchmark::State&) {
  if (current != nullptr && current_status.ok()) {
    current_status = current->CheckIdle();
    if (!current_status.ok()) {
      std::fprintf(stderr, "%s\n", current_status.ToString().c_str());
    }
  }
  current.reset();
}

// The stack pad of the k-th timed run: 67 x 16 bytes more per run, modulo
// 4 KiB (67 is odd, so 256 runs visit every 16-byte offset once).
std::size_t StackOffset(std::uint64_t k) { return (k * 67 * 16) % 4096; }

// Calls f() (not inlined) below `offset` bytes of stack, so that every frame
// of the timed loop and of the path it calls moves by `offset`.
template <typename F>
ABSL_ATTRIBUTE_NOINLINE auto AtStackOffset(std::size_t offset, F f) {
  void* pad = alloca(offset + 16);
  benchmark::DoNotOptimize(pad);
  return f();
}

// The timed runs so far, for their stack offsets.
std::atomic<std::uint64_t> timed_runs{0};

// The timed loop, one function for every row: each row's loop runs the same
// machine code at the same address, so rows differ only in the path they
// call.
ABSL_ATTRIBUTE_NOINLINE void RunPairsHere(benchmark::State& state,
                                          const std::vector<std::size_t>& sizes,
                                          bool shared);

// A row's run (each thread's): the timed loop below a stack pad of its own.
void RunPairs(benchmark::State& state, const std::vector<std::size_t>& sizes,
              bool shared) {
  AtStackOffset(
      StackOffset(timed_runs.fetch_add(1)),
      [&]() ABSL_ATTRIBUTE_NOINLINE { RunPairsHere(state, sizes, shared); });
}

void RunPairsHere(benchmark::State& state,
                  const std::vector<std::size_t>& sizes, bool shared) {
  if (!current_status.ok() || current == nullptr) {
    state.SkipWithError(current_status.ToString().c_str());
    return;
  }
  Allocator& a = *current;
  const std::size_t mask = sizes.size() - 1;
  const StreamHandle stream = a.stream(shared ? 0 : state.thread_index());
  // Threads start at different points of the mixed array.
  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 389 & mask;
  if (absl::Status s = env->sim->CtxSetCurrent(env->ctx); !s.ok()) {
    state.SkipWithError(s.ToString().c_str());
    return;
  }

  // Placement: thread i on CPU i; one thread moves to the second CPU halfway.
  const std::vector<int>& cpus = placement().cpus;
  const bool pinned = placement().pin;
  if (pinned) PinTo(cpus[state.thread_index() % cpus.size()]);
  const benchmark::IterationCount half =
      pinned && state.threads() == 1 ? state.max_iterations / 2 : -1;
  benchmark::IterationCount n = 0;

  // As a range-for: end() starts the timer after the threads' start barrier.
  auto it = state.begin();
  const auto last = state.end();
  const std::int64_t cpu_start = ThreadCpuNanos();
  const auto start = std::chrono::steady_clock::now();
  for (; it != last; ++it) {
    if (ABSL_PREDICT_FALSE(n++ == half)) PinTo(cpus[1]);
    absl::StatusOr<DevicePtr> p = a.Allocate(sizes[i], stream);
    if (ABSL_PREDICT_FALSE(!p.ok())) {
      state.SkipWithError(p.status().ToString().c_str());
      break;
    }
    absl::Status s = a.Deallocate(*p, sizes[i]);
    if (ABSL_PREDICT_FALSE(!s.ok())) {
      state.SkipWithError(s.ToString().c_str());
      break;
    }
    i = (i + 1) & mask;
  }
  const auto stop = std::chrono::steady_clock::now();
  const std::int64_t cpu_stop = ThreadCpuNanos();
  PinTo(-1);
  const double seconds = std::chrono::duration<double>(stop - start).count();
  const double pairs = static_cast<double>(state.iterations());
  if (pairs > 0 && seconds > 0) {
    using benchmark::Counter;
    // Summed over threads: total throughput (wall clock).
    state.counters["items_per_second"] = Counter(pairs / seconds);
    // Averaged over threads: the cost of one pair to the thread making it,
    // in thread CPU time (what the table compares: robust when other
    // processes share the cores; a mutex wait that sleeps is not counted)
    // and in wall time (includes sleeping waits and preemption).
    state.counters["ns_per_pair"] =
        Counter(static_cast<double>(cpu_stop - cpu_start) / pairs,
                Counter::kAvgThreads);
    state.counters["wall_ns_per_pair"] =
        Counter(seconds * 1e9 / pairs, Counter::kAvgThreads);
  }
}

template <Impl kImpl, int kMix, bool kShared>
void RunHotpath(benchmark::State& state) {
  RunPairs(state, Mixes()[kMix].sizes, kShared);
}

template <Impl kImpl, int kMix>
void Register() {
  const std::string name =
      absl::StrCat("BM_Hotpath/", kImplNames[static_cast<int>(kImpl)],
                   "/mix:", Mixes()[kMix].name);
  benchmark::RegisterBenchmark(name.c_str(), &RunHotpath<kImpl, kMix, false>)
      ->Setup(&SetupRun<kImpl, kMix, false>)
      ->Teardown(&TeardownRun<kImpl, kMix, false>)
      ->Threads(1)
      ->Threads(2);
  // Two threads on one stream: the ctxpool paths only.
  if constexpr (kImpl != Impl::kCub && kImpl != Impl::kCtxpool) {
    const std::string shared =
        absl::StrCat("BM_HotpathShared/", kImplNames[static_cast<int>(kImpl)],
                     "/mix:", Mixes()[kMix].name);
    benchmark::RegisterBenchmark(shared.c_str(), &RunHotpath<kImpl, kMix, true>)
        ->Setup(&SetupRun<kImpl, kMix, true>)
        ->Teardown(&TeardownRun<kImpl, kMix, true>)
        ->Threads(2);
  }
}

template <Impl kImpl, int... kMixes>
void RegisterAll(std::integer_sequence<int, kMixes...>) {
  (Register<kImpl, kMixes>(), ...);
}

constexpr int kMixCount = 6;

// Trim(0) of an expandable allocator whose granule cache holds
// state.range(0) GiB (unmapped by an earlier Trim): the cost of giving a
// large cache back to the driver, under the allocator's locks. Its own
// SimDriver (zero cost model), so the figure is the allocator's CPU time.
void BM_TrimGranuleCache(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0)) * kGiB;
  SimDeviceSpec spec;
  spec.capacity_bytes = bytes + 4 * kGiB;
  spec.context_overhead_bytes = 0;
  std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {spec}});
  sim->SetRaceDetection(false);
  ContextHandle ctx = *sim->PrimaryCtxRetain(0);
  (void)sim->CtxSetCurrent(ctx);
  StreamHandle s = *sim->StreamCreate(kStreamNonBlocking, 0);
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kExpandable;
  std::unique_ptr<CachingDeviceAllocator> a =
      *CachingDeviceAllocator::Create(*sim, 0, o);
  for (auto _ : state) {
    state.PauseTiming();
    absl::StatusOr<DevicePtr> p = a->Allocate(bytes, s);
    if (!p.ok() || !a->Deallocate(*p).ok() || !a->Trim(bytes).ok()) {
      state.SkipWithError("setup failed");
      break;
    }
    state.ResumeTiming();
    absl::StatusOr<TrimResult> t = a->Trim(0);
    if (!t.ok() || t->freed_bytes != bytes) {
      state.SkipWithError("Trim(0) did not free the cache");
      break;
    }
  }
  state.counters["granules"] = static_cast<double>(bytes / (2 * kMiB));
  a.reset();
  (void)sim->StreamDestroy(s);
  (void)sim->PrimaryCtxRelease(0);
}
BENCHMARK(BM_TrimGranuleCache)->Arg(8)->Arg(64)->Unit(benchmark::kMillisecond);

void RegisterBenchmarks(bool with_cub) {
  RegisterAll<Impl::kCtxpool>(std::make_integer_sequence<int, kMixCount>());
  RegisterAll<Impl::kCtxpoolVmm>(std::make_integer_sequence<int, kMixCount>());
  RegisterAll<Impl::kSession>(std::make_integer_sequence<int, kMixCount>());
  if (plugin != nullptr) {
    RegisterAll<Impl::kPlugin>(std::make_integer_sequence<int, kMixCount>());
  }
  if (with_cub) {
    RegisterAll<Impl::kCub>(std::make_integer_sequence<int, kMixCount>());
  }
}

// ---- Smoke check: both allocators hand out disjoint, live memory -----------

absl::Status SmokeCheck(Impl impl) {
  CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Allocator> a, MakeAllocator(impl));
  const std::vector<std::size_t>& sizes = Mixes().back().sizes;
  std::vector<std::pair<DevicePtr, std::size_t>> live;
  for (std::size_t k = 0; k < 64; ++k) {
    const std::size_t bytes = sizes[k];
    const StreamHandle stream = a->stream(static_cast<int>(k % kMaxThreads));
    CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, a->Allocate(bytes, stream));
    if (p.is_null()) return absl::InternalError("null pointer returned");
    // Touch fails unless the range lies in memory the driver handed out
    // (the plugin's device is its own: not touched here).
    if (impl != Impl::kPlugin) {
      CTXPOOL_RETURN_IF_ERROR(env->sim->Touch(stream, p, bytes));
    }
    live.emplace_back(p, bytes);
  }
  std::vector<std::pair<DevicePtr, std::size_t>> sorted = live;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t k = 1; k < sorted.size(); ++k) {
    if (sorted[k - 1].first + sorted[k - 1].second > sorted[k].first) {
      return absl::InternalError(
          absl::StrCat(kImplNames[static_cast<int>(impl)],
                       ": live blocks overlap at ", sorted[k].first.address()));
    }
  }
  for (const auto& [p, bytes] : live) {
    CTXPOOL_RETURN_IF_ERROR(a->Deallocate(p, bytes));
  }
  CTXPOOL_RETURN_IF_ERROR(a->CheckIdle());
  // A second round must be served from the cache without error.
  for (std::size_t k = 0; k < 64; ++k) {
    CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, a->Allocate(sizes[k], a->stream(0)));
    CTXPOOL_RETURN_IF_ERROR(a->Deallocate(p, sizes[k]));
  }
  return a->CheckIdle();
}

// ---- The ratio table -------------------------------------------------------

// Wraps the display reporter; keeps ns_per_pair and wall_ns_per_pair of each
// run (the median aggregate when repetitions produce one, else the median of
// the runs).
class RatioReporter final : public bench::ForwardingReporter {
 public:
  using ForwardingReporter::ForwardingReporter;

  // `counter` of "<family>/<impl>/mix:<mix>" with `threads`.
  std::optional<double> Get(absl::string_view impl, absl::string_view mix,
                            int threads, absl::string_view counter,
                            absl::string_view family = "BM_Hotpath") const {
    auto it = cells_.find({absl::StrCat(family, "/", impl, "/mix:", mix),
                           threads, std::string(counter)});
    if (it == cells_.end()) return std::nullopt;
    const Cell& c = it->second;
    if (c.median.has_value()) return c.median;
    if (c.samples.empty()) return std::nullopt;
    std::vector<double> v = c.samples;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }

 private:
  void Collect(const Run& run) override {
    for (const char* counter_name : {"ns_per_pair", "wall_ns_per_pair"}) {
      auto counter = run.counters.find(counter_name);
      if (counter == run.counters.end()) continue;
      Cell& cell = cells_[{run.run_name.function_name,
                           static_cast<int>(run.threads), counter_name}];
      if (run.run_type == Run::RT_Aggregate) {
        if (run.aggregate_name == "median") cell.median = counter->second;
      } else {
        cell.samples.push_back(counter->second);
      }
    }
  }

  struct Cell {
    std::optional<double> median;
    std::vector<double> samples;
  };
  std::map<std::tuple<std::string, int, std::string>, Cell> cells_;
};

void PrintTable(const RatioReporter& r, bool with_cub, std::FILE* out) {
  constexpr double kTargetNs = 100.0;
  auto fmt = [](std::optional<double> v) {
    return v.has_value() ? absl::StrFormat("%.1f", *v) : std::string("-");
  };
  std::string body;
  std::vector<std::string> misses;
  bool all_compared = true;
  for (const Mix& mix : Mixes()) {
    for (int threads = 1; threads <= kMaxThreads; ++threads) {
      std::optional<double> ours =
          r.Get("ctxpool", mix.name, threads, "ns_per_pair");
      std::optional<double> cub =
          r.Get("cub", mix.name, threads, "ns_per_pair");
      std::optional<double> vmm =
          r.Get("ctxpool-vmm", mix.name, threads, "ns_per_pair");
      std::optional<double> ours_wall =
          r.Get("ctxpool", mix.name, threads, "wall_ns_per_pair");
      std::optional<double> cub_wall =
          r.Get("cub", mix.name, threads, "wall_ns_per_pair");
      if (!ours.has_value() && !cub.has_value()) continue;
      std::string ratio = "-";
      std::string verdict;
      if (ours.has_value() && cub.has_value() && *ours > 0) {
        ratio = absl::StrFormat("%.2fx", *cub / *ours);
        if (*ours >= *cub) {
          verdict = absl::StrFormat("SLOWER than cub by %.1f ns (%.0f%%)",
                                    *ours - *cub, 100.0 * (*ours / *cub - 1));
          misses.push_back(
              absl::StrFormat("%s/threads:%d: %s", mix.name, threads, verdict));
        } else {
          verdict = "faster";
        }
      } else {
        all_compared = false;
      }
      if (vmm.has_value() && cub.has_value() && *vmm >= *cub) {
        const std::string v =
            absl::StrFormat("vmm SLOWER than cub by %.1f ns", *vmm - *cub);
        verdict += absl::StrCat(verdict.empty() ? "" : "; ", v);
        misses.push_back(
            absl::StrFormat("%s/threads:%d: %s", mix.name, threads, v));
      }
      if (threads == 1 && vmm.has_value() && *vmm > kTargetNs) {
        misses.push_back(absl::StrFormat("%s/threads:1: vmm %.1f ns > %.0f ns",
                                         mix.name, *vmm, kTargetNs));
      }
      if (threads == 1 && ours.has_value() && *ours > kTargetNs) {
        verdict += absl::StrFormat("%sover the %.0f ns target",
                                   verdict.empty() ? "" : "; ", kTargetNs);
        misses.push_back(absl::StrFormat("%s/threads:1: %.1f ns > %.0f ns",
                                         mix.name, *ours, kTargetNs));
      }
      absl::StrAppendFormat(
          &body, "%-17s %7d %16s %12s %12s %12s %18s  %s\n", mix.name, threads,
          fmt(ours), fmt(vmm), fmt(cub), ratio,
          absl::StrCat(fmt(ours_wall), " / ", fmt(cub_wall)), verdict);
    }
  }
  if (body.empty()) return;  // nothing run (a filter, --benchmark_list_tests)
  std::fprintf(out,
               "\nHot path: ns per Allocate+Deallocate pair, thread CPU time "
               "per thread (wall clock for reference); median when "
               "repeated\n%-17s %7s %16s %12s %12s %12s %18s  %s\n%s",
               "mix", "threads", "ctxpool ns/pair", "vmm ns/pair",
               "cub ns/pair", "cub/ctxpool", "wall ctxpool/cub", "verdict",
               body.c_str());
  if (!with_cub) {
    std::fprintf(out,
                 "(CUB peer not built: no CUB/CUDA runtime headers at "
                 "configure time; ctxpool only)\n");
  }
  std::fprintf(out,
               "Target: ctxpool and ctxpool-vmm <= %.0f ns/pair "
               "single-threaded and faster than cub on every mix: %s\n",
               kTargetNs,
               !misses.empty() ? "NOT met"
               : all_compared  ? "met for the mixes run"
                               : "not fully evaluated (cub missing)");
  for (const std::string& m : misses) std::fprintf(out, "  %s\n", m.c_str());
}

// The paths users call: session and plugin against the bare expandable
// allocator (the backing both use) and CUB, and each path's cost per pair
// with two threads (own streams; one shared stream) against one thread.
constexpr double kSessionTarget = 1.15;
constexpr double kPluginTarget = 1.3;
constexpr double kScalingTarget = 1.3;

void PrintPathsTable(const RatioReporter& r, bool with_cub, std::FILE* out) {
  auto fmt = [](std::optional<double> v, const char* unit = "") {
    return v.has_value() ? absl::StrFormat("%.1f%s", *v, unit)
                         : std::string("-");
  };
  auto ratio = [](std::optional<double> a, std::optional<double> b) {
    return a.has_value() && b.has_value() && *b > 0
               ? std::optional<double>(*a / *b)
               : std::nullopt;
  };
  auto fx = [](std::optional<double> v) {
    return v.has_value() ? absl::StrFormat("%.2fx", *v) : std::string("-");
  };
  struct Path {
    const char* impl;
    const char* label;
  };
  const Path paths[] = {
      {"ctxpool-vmm", "bare"}, {"session", "session"}, {"plugin", "plugin"}};
  std::string body;
  std::string scaling;
  std::vector<std::string> misses;
  bool any = false;
  for (const Mix& mix : Mixes()) {
    const std::optional<double> bare =
        r.Get("ctxpool-vmm", mix.name, 1, "ns_per_pair");
    const std::optional<double> cub = r.Get("cub", mix.name, 1, "ns_per_pair");
    const std::optional<double> session =
        r.Get("session", mix.name, 1, "ns_per_pair");
    const std::optional<double> plug =
        r.Get("plugin", mix.name, 1, "ns_per_pair");
    if (!bare.has_value() && !session.has_value() && !plug.has_value()) {
      continue;
    }
    any = true;
    const std::optional<double> rs = ratio(session, bare);
    const std::optional<double> rp = ratio(plug, bare);
    absl::StrAppendFormat(
        &body, "%-17s %10s %10s %10s %10s %12s %12s %11s %11s\n", mix.name,
        fmt(bare), fmt(session), fmt(plug), fmt(cub), fx(rs), fx(rp),
        fx(ratio(session, cub)), fx(ratio(plug, cub)));
    if (rs.has_value() && *rs > kSessionTarget) {
      misses.push_back(absl::StrFormat("%s: session %.2fx bare > %.2fx",
                                       mix.name, *rs, kSessionTarget));
    }
    if (rp.has_value() && *rp > kPluginTarget) {
      misses.push_back(absl::StrFormat("%s: plugin %.2fx bare > %.2fx",
                                       mix.name, *rp, kPluginTarget));
    }
    for (const Path& p : paths) {
      std::string cells;
      for (const char* counter : {"ns_per_pair", "wall_ns_per_pair"}) {
        const std::optional<double> one = r.Get(p.impl, mix.name, 1, counter);
        const std::optional<double> two = r.Get(p.impl, mix.name, 2, counter);
        const std::optional<double> shared =
            r.Get(p.impl, mix.name, 2, counter, "BM_HotpathShared");
        const std::optional<double> own = ratio(two, one);
        absl::StrAppendFormat(&cells, " %9s %9s %9s %8s %8s", fmt(one),
                              fmt(two), fmt(shared), fx(own),
                              fx(ratio(shared, one)));
        if (own.has_value() && *own > kScalingTarget) {
          misses.push_back(absl::StrFormat(
              "%s: %s 2 threads (own streams) %.2fx 1 thread (%s) > %.2fx",
              mix.name, p.label, *own,
              std::string(counter) == "ns_per_pair" ? "cpu" : "wall",
              kScalingTarget));
        }
      }
      if (cells.find_first_not_of(" -x") == std::string::npos) continue;
      absl::StrAppendFormat(&scaling, "%-17s %-8s%s\n", mix.name, p.label,
                            cells);
    }
  }
  if (!any) return;
  std::fprintf(
      out,
      "\nPaths users call, 1 thread: ns per pair (thread CPU time; median "
      "when repeated) and ratios\n%-17s %10s %10s %10s %10s %12s %12s %11s "
      "%11s\n%s",
      "mix", "bare-vmm", "session", "plugin", "cub", "session/bare",
      "plugin/bare", "session/cub", "plugin/cub", body.c_str());
  std::fprintf(
      out,
      "\nThreads: ns per pair with 1 thread, 2 threads on their own streams "
      "and 2 threads sharing one stream, and the ratios to 1 thread; thread "
      "CPU time first, then wall clock\n%-17s %-8s %9s %9s %9s %8s %8s "
      "%9s %9s %9s %8s %8s\n%s",
      "mix", "path", "cpu 1t", "cpu 2t", "cpu 2t/1s", "2t/1t", "1s/1t",
      "wall 1t", "wall 2t", "wall 2t/1s", "2t/1t", "1s/1t", scaling.c_str());
  if (!with_cub) std::fprintf(out, "(CUB peer not built: no cub columns)\n");
  std::fprintf(out,
               "Targets: session <= %.2fx and plugin <= %.2fx the bare pair "
               "single-threaded; 2 threads on their own streams <= %.2fx the "
               "same path's 1-thread cost: %s\n",
               kSessionTarget, kPluginTarget, kScalingTarget,
               misses.empty() ? "met for the rows run" : "NOT met");
  for (const std::string& m : misses) std::fprintf(out, "  %s\n", m.c_str());
}

// ---- Paired rounds: the paths' ratios measured side by side ---------------
//
// The tables above compare medians of runs made at different moments; on a
// machine whose speed drifts (see the file comment) a ratio of two such
// medians carries the drift. Here every round runs `pairs` cached pairs on
// each path in turn, one thread on the first CPU, one on the second, then
// two threads at once (one per CPU, own streams), each timed in thread CPU
// time; ratios are taken within the round, where the machine's speed is one,
// and the table gives the median over rounds. The order of the paths
// rotates between rounds.

// Thread CPU ns per pair of `pairs` pairs on `stream`, or -1 on an error.
ABSL_ATTRIBUTE_NOINLINE double TimePairsHere(
    Allocator& a, const std::vector<std::size_t>& sizes, StreamHandle stream,
    std::size_t start, int pairs);
// As TimePairsHere, below a stack pad of `offset` bytes.
double TimePairs(Allocator& a, const std::vector<std::size_t>& sizes,
                 StreamHandle stream, std::size_t start, int pairs,
                 std::size_t offset) {
  return AtStackOffset(offset, [&]() ABSL_ATTRIBUTE_NOINLINE {
    return TimePairsHere(a, sizes, stream, start, pairs);
  });
}
double TimePairsHere(Allocator& a, const std::vector<std::size_t>& sizes,
                     StreamHandle stream, std::size_t start, int pairs) {
  const std::size_t mask = sizes.size() - 1;
  std::size_t i = start & mask;
  const std::int64_t t0 = ThreadCpuNanos();
  for (int k = 0; k < pairs; ++k) {
    absl::StatusOr<DevicePtr> p = a.Allocate(sizes[i], stream);
    if (ABSL_PREDICT_FALSE(!p.ok())) return -1;
    if (ABSL_PREDICT_FALSE(!a.Deallocate(*p, sizes[i]).ok())) return -1;
    i = (i + 1) & mask;
  }
  return static_cast<double>(ThreadCpuNanos() - t0) / pairs;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Runs the paired rounds over every mix and prints their table; returns the
// number of failures (an allocator that could not be made, a failed pair).
int RunPairedRounds(int rounds, std::FILE* out) {
  if (rounds <= 0) return 0;
  std::vector<Impl> impls = {Impl::kCtxpoolVmm, Impl::kSession};
  if (plugin != nullptr) impls.push_back(Impl::kPlugin);
  const std::size_t n = impls.size();
  constexpr int kPairs = 20000;
  const std::vector<int>& cpus = placement().cpus;
  const bool pinned = placement().pin;
  std::string body;
  std::vector<std::string> misses;
  int failures = 0;
  for (const Mix& mix : Mixes()) {
    // One allocator per path, warmed on both streams. The plugin has one
    // process-wide state, so it is made last and kept to this mix.
    std::vector<std::unique_ptr<Allocator>> allocs;
    for (Impl impl : impls) {
      absl::StatusOr<std::unique_ptr<Allocator>> a = MakeAllocator(impl);
      absl::Status s = a.ok() ? Warm(**a, mix, 2) : a.status();
      if (!s.ok()) {
        std::fprintf(stderr, "paired rounds, %s: %s\n",
                     kImplNames[static_cast<int>(impl)], s.ToString().c_str());
        return failures + 1;
      }
      allocs.push_back(*std::move(a));
    }
    // Per round and path: one thread (mean of the two CPUs) and two threads
    // (mean of the two threads).
    std::vector<std::vector<double>> one(n), two(n), vs_bare(n), scaling(n);
    bool failed = false;
    for (int r = 0; r < rounds && !failed; ++r) {
      std::vector<double> t1(n), t2(n);
      for (std::size_t k = 0; k < n; ++k) {
        const std::size_t p = (k + static_cast<std::size_t>(r)) % n;
        Allocator& a = *allocs[p];
        double sum1 = 0;
        for (int c = 0; c < 2; ++c) {
          if (pinned) PinTo(cpus[c]);
          const double ns = TimePairs(a, mix.sizes, a.stream(c), 0, kPairs,
                                      StackOffset(4 * r + c));
          failed |= ns < 0;
          sum1 += ns;
        }
        if (pinned) PinTo(-1);
        std::array<double, 2> ns2{};
        std::atomic<int> ready{0};
        auto run = [&](int t) {
          if (pinned) PinTo(cpus[t]);
          ready.fetch_add(1);
          while (ready.load() < 2) {
          }
          ns2[t] = TimePairs(a, mix.sizes, a.stream(t),
                             static_cast<std::size_t>(t) * 389, kPairs,
                             StackOffset(4 * r + 2 + t));
        };
        std::thread other(run, 1);
        run(0);
        other.join();
        if (pinned) PinTo(-1);
        failed |= ns2[0] < 0 || ns2[1] < 0;
        t1[p] = sum1 / 2;
        t2[p] = (ns2[0] + ns2[1]) / 2;
      }
      for (std::size_t p = 0; p < n; ++p) {
        one[p].push_back(t1[p]);
        two[p].push_back(t2[p]);
        vs_bare[p].push_back(t1[p] / t1[0]);
        scaling[p].push_back(t2[p] / t1[p]);
      }
    }
    for (auto& a : allocs) {
      if (absl::Status s = a->CheckIdle(); !s.ok()) {
        std::fprintf(stderr, "paired rounds: %s\n", s.ToString().c_str());
        failed = true;
      }
    }
    allocs.clear();
    if (failed) {
      std::fprintf(stderr, "paired rounds, %s: a pair failed\n", mix.name);
      ++failures;
      continue;
    }
    std::string row = absl::StrFormat("%-17s", mix.name);
    for (std::size_t p = 0; p < 3; ++p) {
      absl::StrAppendFormat(
          &row, " %9s",
          p < n ? absl::StrFormat("%.1f", Median(one[p])) : std::string("-"));
    }
    for (std::size_t p = 1; p < 3; ++p) {
      absl::StrAppendFormat(&row, " %12s",
                            p < n ? absl::StrFormat("%.2fx", Median(vs_bare[p]))
                                  : std::string("-"));
    }
    for (std::size_t p = 0; p < 3; ++p) {
      absl::StrAppendFormat(&row, " %9s",
                            p < n ? absl::StrFormat("%.2fx", Median(scaling[p]))
                                  : std::string("-"));
    }
    body += row + "\n";
    const double rs = Median(vs_bare[1]);
    if (rs > kSessionTarget) {
      misses.push_back(absl::StrFormat("%s: session %.2fx bare > %.2fx",
                                       mix.name, rs, kSessionTarget));
    }
    if (n > 2 && Median(vs_bare[2]) > kPluginTarget) {
      misses.push_back(absl::StrFormat("%s: plugin %.2fx bare > %.2fx",
                                       mix.name, Median(vs_bare[2]),
                                       kPluginTarget));
    }
    for (std::size_t p = 0; p < n; ++p) {
      if (Median(scaling[p]) > kScalingTarget) {
        misses.push_back(
            absl::StrFormat("%s: %s 2 threads %.2fx 1 thread > %.2fx", mix.name,
                            kImplNames[static_cast<int>(impls[p])],
                            Median(scaling[p]), kScalingTarget));
      }
    }
  }
  std::fprintf(
      out,
      "\nPaired rounds: %d rounds of %d pairs per path, one thread on each "
      "CPU then two threads at once (own streams); ratios taken within each "
      "round, medians over rounds; thread CPU ns per pair\n%-17s %9s %9s %9s "
      "%12s %12s %9s %9s %9s\n%s",
      rounds, kPairs, "mix", "bare-vmm", "session", "plugin", "session/bare",
      "plugin/bare", "bare 2t", "sess 2t", "plug 2t", body.c_str());
  std::fprintf(out,
               "Targets (paired): session <= %.2fx and plugin <= %.2fx the "
               "bare pair; 2 threads <= %.2fx 1 thread: %s\n",
               kSessionTarget, kPluginTarget, kScalingTarget,
               misses.empty() ? "met" : "NOT met");
  for (const std::string& m : misses) std::fprintf(out, "  %s\n", m.c_str());
  return failures;
}

}  // namespace
}  // namespace ctxpool

int main(int argc, char** argv) {
  using ctxpool::env;
  // Our own flags, removed before Google Benchmark parses the rest.
  bool smoke = false;
  bool keep_deadlock_detection = false;
  bool pin = true;
  int paired_rounds = 40;
  std::string plugin_path = CTXPOOL_TORCH_PLUGIN_PATH;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--plugin=", 9) == 0) {
      plugin_path = argv[i] + 9;
    } else if (std::strcmp(argv[i], "--smoke") == 0) {
      smoke = true;
    } else if (std::strncmp(argv[i], "--paired_rounds=", 16) == 0) {
      paired_rounds = std::atoi(argv[i] + 16);
    } else if (std::strcmp(argv[i], "--no_pin") == 0) {
      pin = false;
    } else if (std::strcmp(argv[i], "--mutex_deadlock_detection") == 0) {
      keep_deadlock_detection = true;
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;

#if defined(CTXPOOL_HAVE_CUB_PEER)
  const bool with_cub = true;
  benchmark::AddCustomContext("cub_peer",
                              "cub::CachingDeviceAllocator via CUDA shim");
#else
  const bool with_cub = false;
  benchmark::AddCustomContext("cub_peer", "not built (no CUB headers)");
  std::fprintf(stderr,
               "ctxpool_bench_hotpath: CUB peer not built (CUB or CUDA "
               "runtime headers not found at configure time); running "
               "ctxpool only\n");
#endif
  benchmark::AddCustomContext("driver",
                              "SimDriver h100-80gb, race detection "
                              "off, zero cost model");
  benchmark::AddCustomContext("streams", "one stream per thread");

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  // Debian's Abseil is built without NDEBUG, so absl::Mutex tracks lock
  // order for deadlock detection on every Lock/Unlock (a graph lookup and a
  // pthread_getspecific), roughly doubling an uncontended lock. Production
  // builds of Abseil leave it off; so does this benchmark (CUB's std::mutex
  // never pays it). --mutex_deadlock_detection keeps it on.
  if (!keep_deadlock_detection) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  benchmark::AddCustomContext(
      "absl_mutex_deadlock_detection",
      keep_deadlock_detection ? "library default" : "off");

  if (absl::Status s = ctxpool::SetUpEnv(); !s.ok()) {
    std::fprintf(stderr, "setup failed: %s\n", s.ToString().c_str());
    return 1;
  }
  int failures = 0;
  if (absl::Status s = ctxpool::LoadPlugin(plugin_path); !s.ok()) {
    std::fprintf(stderr, "ctxpool_bench_hotpath: no plugin rows: %s\n",
                 std::string(s.message()).c_str());
    // Built with the plugin but it does not load: that is a failure.
    if (!plugin_path.empty()) ++failures;
  }
  benchmark::AddCustomContext(
      "plugin", ctxpool::plugin != nullptr ? plugin_path : "not loaded");
  if (smoke) {
    std::vector<ctxpool::Impl> impls = {ctxpool::Impl::kCtxpool,
                                        ctxpool::Impl::kCtxpoolVmm,
                                        ctxpool::Impl::kSession};
    if (ctxpool::plugin != nullptr) impls.push_back(ctxpool::Impl::kPlugin);
    if (with_cub) impls.push_back(ctxpool::Impl::kCub);
    for (ctxpool::Impl impl : impls) {
      absl::Status s = ctxpool::SmokeCheck(impl);
      std::fprintf(stderr, "smoke %s: %s\n",
                   ctxpool::kImplNames[static_cast<int>(impl)],
                   s.ToString().c_str());
      if (!s.ok()) ++failures;
    }
  }

  ctxpool::InitPlacement(pin);
  std::string where;
  {
    const ctxpool::Placement& p = ctxpool::placement();
    where = "scheduler (--no_pin or fewer than 2 CPUs)";
    if (p.pin) {
      where =
          absl::StrFormat("CPUs %d and %d; integer loop %.3f and %.3f ns/step",
                          p.cpus[0], p.cpus[1], ctxpool::CpuSpeed(p.cpus[0]),
                          ctxpool::CpuSpeed(p.cpus[1]));
    }
    benchmark::AddCustomContext("placement", where);
  }
  ctxpool::RegisterBenchmarks(with_cub);
  std::unique_ptr<benchmark::BenchmarkReporter> display(
      benchmark::CreateDefaultDisplayReporter());
  ctxpool::RatioReporter reporter(display.get());
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  std::fprintf(reporter.console() ? stdout : stderr, "\nPlacement: %s\n",
               where.c_str());
  ctxpool::PrintTable(reporter, with_cub, reporter.console() ? stdout : stderr);
  ctxpool::PrintPathsTable(reporter, with_cub,
                           reporter.console() ? stdout : stderr);
  failures += reporter.errors();
  failures += ctxpool::RunPairedRounds(paired_rounds,
                                       reporter.console() ? stdout : stderr);

  const std::uint64_t misuse = env->sim->misuse_count();
  if (misuse != 0) {
    std::fprintf(stderr, "SimDriver counted %llu misuse(s):\n",
                 static_cast<unsigned long long>(misuse));
    for (const std::string& m : env->sim->misuse_log()) {
      std::fprintf(stderr, "  %s\n", m.c_str());
    }
    ++failures;
  }
#if defined(CTXPOOL_HAVE_CUB_PEER)
  const ctxpool::peers::ShimCallCounts calls =
      ctxpool::peers::GetShimCallCounts();
  if (calls.errors != 0) {
    std::fprintf(stderr, "CUDA runtime shim returned %llu error(s)\n",
                 static_cast<unsigned long long>(calls.errors));
    ++failures;
  }
#endif
  if (absl::Status s = ctxpool::TearDownEnv(); !s.ok()) {
    std::fprintf(stderr, "teardown failed: %s\n", s.ToString().c_str());
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}
