// `ctxpool replay TRACE [options]`: replays an allocation trace against an
// allocator configuration on a simulated device (or the real GPU) and prints
// peak live, peak reserved, OOMs, upstream allocations, fragmentation,
// Allocate/Deallocate latency percentiles and the time spent.
//
// TRACE is a file (ctxpool CSV, RMM log CSV, or the JSON form written by
// tools/torch_snapshot_to_trace.py) or a generated workload,
// "workload:NAME[:key=value,...]" (see ctxpool/trace/workloads.h).
// Exit status: 0 when the replay ran (OOMs are results, not failures),
// 1 when it could not run, 2 on a usage error.
#include "ctxpool/trace/replay.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"
#include "tools/commands.h"

namespace ctxpool::tool {
namespace {

void PrintReplayUsage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: ctxpool replay TRACE [--device PRESET | --capacity SIZE] "
      "[--config K=V,...]\n"
      "                      [--find-min-capacity] [--stop-at-oom] "
      "[--no-cost-model] [--trims]\n"
      "                      [--passes N] [--repeat N] "
      "[--unknown-free error|synthesize|ignore]\n"
      "                      [--gpu] [--json] [--samples] [--progress]\n\n"
      "Replays TRACE on a fresh caching allocator over a simulated device.\n\n"
      "  TRACE              a trace file (ctxpool CSV, RMM log CSV, or "
      "ctxpool-trace JSON)\n"
      "                     or workload:NAME[:key=value,...] with NAME one of "
      "%s\n"
      "  --device PRESET    simulated device preset: %s\n"
      "  --capacity SIZE    simulated device capacity, e.g. 24GiB (overrides "
      "the preset's)\n"
      "  --config K=V,...   allocator options: "
      "backing=auto|classic|expandable (default\n"
      "                     auto, as DeviceContext: expandable where the "
      "device has VMM),\n"
      "                     memory_limit=SIZE, max_split_size=64MiB,\n"
      "                     vmm_unit_divisor=N (0: single granules), "
      "vmm_chunk_units=N,\n"
      "                     round_bytes, small_size_limit, "
      "small_segment_bytes, large_segment_bytes,\n"
      "                     large_round_bytes\n"
      "  --find-min-capacity  bisect (2 MiB steps) the smallest device on "
      "which the trace has no OOM\n"
      "  --stop-at-oom      stop at the first failed allocation\n"
      "  --passes N         replay the trace N times on the same allocator "
      "(what the trace\n"
      "                     leaves live is freed between passes); driver "
      "calls per pass\n"
      "  --repeat N         run the whole replay N times, each on a fresh "
      "device and allocator,\n"
      "                     and also report, per call, the least wall time "
      "of the N runs\n"
      "                     (the allocator's own cost, the machine's noise "
      "out)\n"
      "  --no-cost-model    simulated driver calls cost nothing (no simulated "
      "latency)\n"
      "  --trims            call Trim(0) at the trace's trim events and report "
      "what stays\n"
      "                     reserved after them (reserved - live, granules per "
      "active stream)\n"
      "  --unknown-free P   a free of a pointer the trace never allocated: "
      "error (default),\n"
      "                     synthesize (assume it was live before the trace) "
      "or ignore\n"
      "  --gpu              replay on the real GPU (device 0) through the CUDA "
      "driver\n"
      "  --json             print one JSON object\n"
      "  --samples          include fragmentation samples over time (JSON)\n"
      "  --progress         report progress on stderr (default: on a terminal "
      "for traces of\n"
      "                     more than 100000 events)\n",
      absl::StrJoin(WorkloadNames(), ", ").c_str(),
      absl::StrJoin(SimDevicePresetNames(), ", ").c_str());
}

struct Args {
  std::string trace;
  ReplayConfig config;
  TraceReadOptions read;
  bool find_min = false;
  bool gpu = false;
  bool json = false;
  bool samples = false;
  std::optional<bool> progress;
};

// Returns 0 when parsed, else the exit status.
int ParseArgs(int argc, char** argv, Args* a) {
  auto need_value = [&](int& i, const char* flag) -> const char* {
    if (i + 1 >= argc) {
      std::fprintf(stderr, "ctxpool replay: %s needs a value\n", flag);
      return nullptr;
    }
    return argv[++i];
  };
  // A whole number in [1, most] after `flag`, into *out.
  auto need_count = [&](int& i, const char* flag, int most, int* out) {
    const char* v = need_value(i, flag);
    if (v == nullptr) return false;
    if (!absl::SimpleAtoi(v, out) || *out < 1 || *out > most) {
      std::fprintf(stderr,
                   "ctxpool replay: %s needs a number in [1, %d], not '%s'\n",
                   flag, most, v);
      return false;
    }
    return true;
  };
  a->config.allocator.backing = BackingMode::kAuto;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      PrintReplayUsage(stdout);
      return -1;
    } else if (arg == "--device") {
      const char* v = need_value(i, "--device");
      if (v == nullptr) return 2;
      // An empty name is a mistake (an unset shell variable), not a request
      // for the default device.
      if (*v == '\0') {
        std::fprintf(stderr,
                     "ctxpool replay: --device needs a preset name (%s)\n",
                     absl::StrJoin(SimDevicePresetNames(), ", ").c_str());
        return 2;
      }
      a->config.device = v;
    } else if (arg == "--capacity") {
      const char* v = need_value(i, "--capacity");
      if (v == nullptr) return 2;
      absl::StatusOr<std::uint64_t> bytes = ParseByteSize(v);
      if (!bytes.ok() || *bytes == 0) {
        std::fprintf(stderr, "ctxpool replay: bad --capacity '%s'\n", v);
        return 2;
      }
      a->config.capacity_bytes = *bytes;
    } else if (arg == "--config") {
      const char* v = need_value(i, "--config");
      if (v == nullptr) return 2;
      absl::Status s = ParseAllocatorConfig(v, &a->config.allocator);
      if (!s.ok()) {
        std::fprintf(stderr, "ctxpool replay: %s\n",
                     std::string(s.message()).c_str());
        return 2;
      }
    } else if (arg == "--unknown-free") {
      const char* v = need_value(i, "--unknown-free");
      if (v == nullptr) return 2;
      const absl::string_view p = v;
      if (p == "error") {
        a->read.unknown_free = UnknownFreePolicy::kError;
      } else if (p == "synthesize") {
        a->read.unknown_free = UnknownFreePolicy::kSynthesizeAlloc;
      } else if (p == "ignore") {
        a->read.unknown_free = UnknownFreePolicy::kIgnore;
      } else {
        std::fprintf(stderr, "ctxpool replay: bad --unknown-free '%s'\n", v);
        return 2;
      }
    } else if (arg == "--find-min-capacity") {
      a->find_min = true;
    } else if (arg == "--stop-at-oom") {
      a->config.stop_at_first_oom = true;
    } else if (arg == "--passes") {
      if (!need_count(i, "--passes", 1000, &a->config.passes)) return 2;
    } else if (arg == "--repeat") {
      if (!need_count(i, "--repeat", 100, &a->config.repeats)) return 2;
    } else if (arg == "--no-cost-model") {
      a->config.cost_model = false;
    } else if (arg == "--trims") {
      a->config.replay_trims = true;
    } else if (arg == "--gpu") {
      a->gpu = true;
    } else if (arg == "--json") {
      a->json = true;
    } else if (arg == "--samples") {
      a->samples = true;
    } else if (arg == "--progress") {
      a->progress = true;
    } else if (arg == "--no-progress") {
      a->progress = false;
    } else if (absl::StartsWith(arg, "-")) {
      std::fprintf(stderr, "ctxpool replay: unknown option '%s'\n\n", argv[i]);
      PrintReplayUsage(stderr);
      return 2;
    } else if (a->trace.empty()) {
      a->trace = std::string(arg);
    } else {
      std::fprintf(stderr, "ctxpool replay: more than one TRACE given\n");
      return 2;
    }
  }
  if (a->trace.empty()) {
    PrintReplayUsage(stderr);
    return 2;
  }
  if (a->gpu && (a->find_min || !a->config.device.empty() ||
                 a->config.capacity_bytes != 0)) {
    std::fprintf(stderr,
                 "ctxpool replay: --gpu replays on the real device; "
                 "--device, --capacity and --find-min-capacity are for the "
                 "simulated one\n");
    return 2;
  }
  return 0;
}

// Loads TRACE: a file, or workload:NAME[:options].
absl::StatusOr<Trace> LoadTraceArg(const std::string& arg,
                                   const TraceReadOptions& read) {
  if (absl::StartsWith(arg, "workload:")) {
    return GenerateWorkload(absl::string_view(arg).substr(9));
  }
  return ReadTraceFile(arg, read);
}

}  // namespace

int RunReplay(int argc, char** argv) {
  Args a;
  if (int rc = ParseArgs(argc, argv, &a); rc != 0) return rc < 0 ? 0 : rc;

  absl::StatusOr<Trace> trace = LoadTraceArg(a.trace, a.read);
  if (!trace.ok()) {
    std::fprintf(stderr, "ctxpool replay: %s\n",
                 trace.status().ToString().c_str());
    return 1;
  }
  const bool show_progress =
      a.progress.value_or(isatty(STDERR_FILENO) != 0 && trace->size() > 100000);
  if (show_progress) {
    a.config.progress_every = std::max<std::size_t>(10000, trace->size() / 100);
    a.config.progress = [](std::size_t done, std::size_t total) {
      std::fprintf(stderr, "\rreplay: %zu / %zu events (%.0f%%)", done, total,
                   total == 0 ? 100.0
                              : 100.0 * static_cast<double>(done) /
                                    static_cast<double>(total));
      if (done == total) std::fprintf(stderr, "\n");
    };
  }

  absl::StatusOr<ReplayResult> result;
  if (a.gpu) {
    absl::StatusOr<std::unique_ptr<Driver>> cuda = CudaDriver::Load();
    if (!cuda.ok()) {
      std::fprintf(stderr, "ctxpool replay: --gpu: %s\n",
                   cuda.status().ToString().c_str());
      return 1;
    }
    result = ReplayOnDriver(*trace, **cuda, 0, a.config);
  } else {
    result = Replay(*trace, a.config);
  }
  if (!result.ok()) {
    std::fprintf(stderr, "ctxpool replay: %s\n",
                 result.status().ToString().c_str());
    return 1;
  }

  std::optional<CapacitySearch> search;
  if (a.find_min) {
    absl::StatusOr<CapacitySearch> s = FindMinCapacity(*trace, a.config);
    if (!s.ok()) {
      std::fprintf(stderr, "ctxpool replay: --find-min-capacity: %s\n",
                   s.status().ToString().c_str());
      return 1;
    }
    search = *s;
  }

  if (a.json) {
    std::string json = ReplayResultToJson(*result, a.samples);
    if (search) {
      json.pop_back();  // '}'
      absl::StrAppendFormat(&json,
                            ", \"min_capacity\": {\"min_capacity_bytes\": %d, "
                            "\"step_bytes\": %d, \"peak_live_bytes\": %d, "
                            "\"context_overhead_bytes\": %d, \"replays\": %d}}",
                            search->min_capacity_bytes, search->step_bytes,
                            search->peak_live_bytes,
                            search->context_overhead_bytes, search->replays);
    }
    std::printf("%s\n", json.c_str());
  } else {
    std::printf("%s", ReplayResultToText(*result).c_str());
    if (search) {
      std::printf(
          "min capacity:     %s (OOM frontier, %d replays, %s steps; includes "
          "a %s context) vs peak live %s: x%.3f\n",
          FormatBytes(search->min_capacity_bytes).c_str(), search->replays,
          FormatBytes(search->step_bytes).c_str(),
          FormatBytes(search->context_overhead_bytes).c_str(),
          FormatBytes(search->peak_live_bytes).c_str(),
          search->peak_live_bytes == 0
              ? 0.0
              : static_cast<double>(search->min_capacity_bytes) /
                    static_cast<double>(search->peak_live_bytes));
    }
  }
  return 0;
}

}  // namespace ctxpool::tool
