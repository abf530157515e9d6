// ctxpool costs — times each driver call kind and writes SimDriver's cost
// table (sim_costs.h) from what it measured.
//
//   ctxpool costs --gpu --out costs.json   on a GPU (scripts/gpu-check)
//   CTXPOOL_SIM_COSTS=costs.json ctxpool replay ...   replays with them
//
// Each kind runs `--reps` times (default 20) at 2 MiB and at 64 MiB where
// its cost depends on the size (cuMemAlloc, cuMemFree, cuMemCreate,
// cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess, cuMemHostAlloc,
// cuMemFreeHost); the median at each size gives the fixed part and the part
// per MiB (a straight line through the two, clamped at zero). Other kinds
// are timed once per repetition at no size. Kinds not measured keep the
// built-in estimate. Without --gpu it times SimDriver itself (the CPU cost
// of the simulation, useful only to test this command).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/sim_costs.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "tools/commands.h"

namespace ctxpool::tool {
namespace {

constexpr std::size_t kMiB = 1 << 20;
constexpr std::size_t kSmall = 2 * kMiB;
constexpr std::size_t kLarge = 64 * kMiB;

std::int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::int64_t Median(std::vector<std::int64_t> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Timings of one kind at one size.
struct Samples {
  std::vector<std::int64_t> ns;
  void Add(std::int64_t t) { ns.push_back(t); }
};

class Calibrator {
 public:
  Calibrator(Driver& driver, int reps) : d_(driver), reps_(reps) {}

  absl::Status Run(SimCostTable* table) {
    CTXPOOL_ASSIGN_OR_RETURN(ContextHandle ctx, d_.PrimaryCtxRetain(0));
    absl::Status s = d_.CtxSetCurrent(ctx);
    if (s.ok()) s = Measure(table);
    d_.PrimaryCtxRelease(0).IgnoreError();
    return s;
  }

 private:
  // Times fn() (which must do exactly one call of the kind being measured).
  template <typename Fn>
  absl::Status Time(Samples* out, Fn fn) {
    const std::int64_t t0 = NowNs();
    absl::Status s = fn();
    out->Add(NowNs() - t0);
    return s;
  }

  void Fit(SimCostTable* t, SimCall call, const Samples& small,
           const Samples& large) {
    const double a = static_cast<double>(Median(small.ns));
    const double b = static_cast<double>(Median(large.ns));
    const double per_mib = std::max(0.0, (b - a) / 62.0);
    const double fixed = std::max(0.0, a - 2.0 * per_mib);
    t->calls[static_cast<int>(call)] = {static_cast<std::int64_t>(fixed),
                                        static_cast<std::int64_t>(per_mib)};
  }
  void Flat(SimCostTable* t, SimCall call, const Samples& s) {
    t->calls[static_cast<int>(call)] = {Median(s.ns), 0};
  }

  absl::Status Measure(SimCostTable* t) {
    CTXPOOL_ASSIGN_OR_RETURN(std::size_t gran,
                             d_.MemGetAllocationGranularity(0));
    if (gran == 0 || kSmall % gran != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("VMM granularity ", gran, " does not divide 2 MiB"));
    }
    for (std::size_t size : {kSmall, kLarge}) {
      const int k = size == kSmall ? 0 : 1;
      for (int r = 0; r < reps_; ++r) {
        DevicePtr p;
        CTXPOOL_RETURN_IF_ERROR(Time(&alloc_[k], [&]() -> absl::Status {
          CTXPOOL_ASSIGN_OR_RETURN(p, d_.MemAlloc(size));
          return absl::OkStatus();
        }));
        CTXPOOL_RETURN_IF_ERROR(Time(&free_[k], [&] { return d_.MemFree(p); }));

        PhysicalMemHandle h;
        CTXPOOL_RETURN_IF_ERROR(Time(&create_[k], [&]() -> absl::Status {
          CTXPOOL_ASSIGN_OR_RETURN(h, d_.MemCreate(size, 0));
          return absl::OkStatus();
        }));
        DevicePtr va;
        CTXPOOL_RETURN_IF_ERROR(Time(&reserve_, [&]() -> absl::Status {
          CTXPOOL_ASSIGN_OR_RETURN(va, d_.MemAddressReserve(size, gran));
          return absl::OkStatus();
        }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&map_[k], [&] { return d_.MemMap(va, size, 0, h); }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&access_[k], [&] { return d_.MemSetAccess(va, size, 0); }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&unmap_[k], [&] { return d_.MemUnmap(va, size); }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&release_[k], [&] { return d_.MemRelease(h); }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&address_free_, [&] { return d_.MemAddressFree(va, size); }));

        void* host = nullptr;
        CTXPOOL_RETURN_IF_ERROR(Time(&host_alloc_[k], [&]() -> absl::Status {
          CTXPOOL_ASSIGN_OR_RETURN(host, d_.MemHostAlloc(size, 0));
          return absl::OkStatus();
        }));
        CTXPOOL_RETURN_IF_ERROR(
            Time(&host_free_[k], [&] { return d_.MemFreeHost(host); }));
      }
    }
    StreamHandle s1, s2;
    CTXPOOL_ASSIGN_OR_RETURN(s1, d_.StreamCreate(kStreamNonBlocking, 0));
    for (int r = 0; r < reps_; ++r) {
      CTXPOOL_RETURN_IF_ERROR(Time(&stream_create_, [&]() -> absl::Status {
        CTXPOOL_ASSIGN_OR_RETURN(s2, d_.StreamCreate(kStreamNonBlocking, 0));
        return absl::OkStatus();
      }));
      EventHandle e;
      CTXPOOL_RETURN_IF_ERROR(Time(&event_create_, [&]() -> absl::Status {
        CTXPOOL_ASSIGN_OR_RETURN(e, d_.EventCreate(kEventDisableTiming));
        return absl::OkStatus();
      }));
      CTXPOOL_RETURN_IF_ERROR(
          Time(&event_record_, [&] { return d_.EventRecord(e, s1); }));
      CTXPOOL_RETURN_IF_ERROR(Time(&event_query_, [&]() -> absl::Status {
        return d_.EventQuery(e).status();
      }));
      CTXPOOL_RETURN_IF_ERROR(
          Time(&wait_event_, [&] { return d_.StreamWaitEvent(s2, e); }));
      CTXPOOL_RETURN_IF_ERROR(
          Time(&event_destroy_, [&] { return d_.EventDestroy(e); }));
      CTXPOOL_RETURN_IF_ERROR(
          Time(&stream_destroy_, [&] { return d_.StreamDestroy(s2); }));
    }
    CTXPOOL_RETURN_IF_ERROR(d_.StreamDestroy(s1));

    Fit(t, SimCall::kMemAlloc, alloc_[0], alloc_[1]);
    Fit(t, SimCall::kMemFree, free_[0], free_[1]);
    Fit(t, SimCall::kMemCreate, create_[0], create_[1]);
    Fit(t, SimCall::kMemRelease, release_[0], release_[1]);
    Fit(t, SimCall::kMemMap, map_[0], map_[1]);
    Fit(t, SimCall::kMemUnmap, unmap_[0], unmap_[1]);
    Fit(t, SimCall::kMemSetAccess, access_[0], access_[1]);
    Fit(t, SimCall::kMemHostAlloc, host_alloc_[0], host_alloc_[1]);
    Fit(t, SimCall::kMemFreeHost, host_free_[0], host_free_[1]);
    Flat(t, SimCall::kMemAddressReserve, reserve_);
    Flat(t, SimCall::kMemAddressFree, address_free_);
    Flat(t, SimCall::kStreamCreate, stream_create_);
    Flat(t, SimCall::kStreamDestroy, stream_destroy_);
    Flat(t, SimCall::kEventCreate, event_create_);
    Flat(t, SimCall::kEventDestroy, event_destroy_);
    Flat(t, SimCall::kEventRecord, event_record_);
    Flat(t, SimCall::kEventQuery, event_query_);
    Flat(t, SimCall::kStreamWaitEvent, wait_event_);
    return absl::OkStatus();
  }

  Driver& d_;
  const int reps_;
  Samples alloc_[2], free_[2], create_[2], release_[2], map_[2], unmap_[2],
      access_[2], host_alloc_[2], host_free_[2];
  Samples reserve_, address_free_, stream_create_, stream_destroy_,
      event_create_, event_destroy_, event_record_, event_query_, wait_event_;
};

void Usage(std::FILE* out) {
  std::fprintf(out,
               "usage: ctxpool costs [--gpu] [--out FILE] [--reps N]\n\n"
               "Times each driver call kind (2 MiB and 64 MiB where the size "
               "matters) and prints\nSimDriver's cost table as JSON (to FILE "
               "with --out); CTXPOOL_SIM_COSTS=FILE makes\nthe simulated "
               "replays use it.\n\n"
               "  --gpu      time the CUDA driver on device 0 (default: "
               "SimDriver, a self-test)\n"
               "  --out FILE write the table to FILE\n"
               "  --reps N   repetitions per kind and size (default 20)\n");
}

}  // namespace

int RunCosts(int argc, char** argv) {
  bool gpu = false;
  std::string out_path;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      Usage(stdout);
      return 0;
    } else if (arg == "--gpu") {
      gpu = true;
    } else if (arg == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (arg == "--reps" && i + 1 < argc) {
      if (!absl::SimpleAtoi(argv[++i], &reps) || reps < 1 || reps > 10000) {
        std::fprintf(stderr, "ctxpool costs: --reps needs 1..10000\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "ctxpool costs: unknown argument '%s'\n",
                   arg.c_str());
      Usage(stderr);
      return 2;
    }
  }
  std::unique_ptr<Driver> driver;
  if (gpu) {
    absl::StatusOr<std::unique_ptr<Driver>> d = CudaDriver::Load();
    if (!d.ok()) {
      std::fprintf(stderr, "ctxpool costs: %s\n",
                   d.status().ToString().c_str());
      return 1;
    }
    driver = std::move(d).value();
  } else {
    std::unique_ptr<SimDriver> sim = SimDriver::Create();
    sim->SetRaceDetection(false);
    driver = std::move(sim);
  }
  SimCostTable table = RealisticSimCosts();
  absl::Status s = Calibrator(*driver, reps).Run(&table);
  if (!s.ok()) {
    std::fprintf(stderr, "ctxpool costs: %s\n", s.ToString().c_str());
    return 1;
  }
  const std::string json = SimCostTableToJson(table) + "\n";
  if (out_path.empty()) {
    std::fputs(json.c_str(), stdout);
    return 0;
  }
  std::FILE* f = std::fopen(out_path.c_str(), "w");
  if (f == nullptr || std::fputs(json.c_str(), f) < 0) {
    std::fprintf(stderr, "ctxpool costs: cannot write '%s'\n",
                 out_path.c_str());
    if (f != nullptr) std::fclose(f);
    return 1;
  }
  std::fclose(f);
  std::fprintf(stderr, "ctxpool costs: wrote %s (%s)\n", out_path.c_str(),
               driver->Describe().c_str());
  return 0;
}

}  // namespace ctxpool::tool
