// `ctxpool demo`: the multi-model server scenario, run twice on the same
// device — the way servers do it today and with ctxpool — printed side by
// side, with an SVG memory map.
//
// The device is the GPU when the CUDA driver loads and has one, else a
// simulated 80 GB H100 (SimDriver); --driver chooses (as CTXPOOL_DRIVER).
// Both modes replay the same seeded MultiModelChurn trace (trace/workloads.h):
// models of different sizes are loaded, serve variable-size requests, and
// are unloaded to make room for others. A model is loaded when its first
// allocation arrives and unloaded when its last one is freed.
//
//   today    per model: its own context (cuCtxCreate, created at its first
//            load and kept, as a framework instance per model keeps its
//            own), its own stream and its own CachingDeviceAllocator; nothing
//            is trimmed, so an unloaded model's cache stays reserved (as
//            PyTorch keeps its cache unless empty_cache() is called) and one
//            model's cache cannot serve another.
//   ctxpool  one Runtime, one primary context, a ModelSession per loaded
//            model (leased stream, a budget of 1.25x the model's peak), one
//            shared allocator; unloading closes the session and trims.
//
// Every number printed is measured in this run. Exit status: 0 when both
// modes ran (OOMs are results), 1 when a mode could not run, 2 on a usage
// error.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "ctxpool/telemetry/json.h"
#include "ctxpool/telemetry/svg.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/workloads.h"
#include "tools/commands.h"
#include "tools/server_modes.h"

namespace ctxpool::tool {
namespace {

void PrintDemoUsage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: ctxpool demo [--driver auto|cuda|sim[:PRESET]] [--models N] "
      "[--resident N]\n"
      "                    [--cycles N] [--seed N] [--out FILE.svg] [--json] "
      "[--progress]\n\n"
      "Runs one multi-model server scenario twice on the same device: as "
      "servers do\n"
      "today (a context and a cache per model, no trim) and with ctxpool "
      "(one context,\n"
      "model sessions with budgets, a shared cache, trim on unload), and "
      "prints them\n"
      "side by side. Writes an SVG memory map of both at the moment of peak "
      "live memory.\n\n"
      "  --driver SPEC   auto (default: CTXPOOL_DRIVER, else the GPU if "
      "usable, else a\n"
      "                  simulated h100-80gb), cuda, or sim[:PRESET]\n"
      "  --models N      distinct models (default 8)\n"
      "  --resident N    models loaded at once (default 3)\n"
      "  --cycles N      load/serve/unload cycles (default 60)\n"
      "  --seed N        workload seed (default 1)\n"
      "  --out FILE      the SVG memory map (default ctxpool-demo.svg)\n"
      "  --json          print one JSON object with a row per mode\n"
      "  --progress      report progress on stderr (default: on a terminal "
      "for long runs)\n");
}

struct Args {
  std::string driver;
  int models = 8;
  int resident = 3;
  int cycles = 60;
  std::uint64_t seed = 1;
  std::string out = "ctxpool-demo.svg";
  bool json = false;
  std::optional<bool> progress;
};

int ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "ctxpool demo: %s needs a value\n", argv[i]);
        return nullptr;
      }
      return argv[++i];
    };
    auto int_value = [&](int lo, int* out) -> bool {
      const char* v = value();
      if (v == nullptr) return false;
      if (!absl::SimpleAtoi(v, out) || *out < lo) {
        std::fprintf(stderr, "ctxpool demo: bad value '%s' for %s\n", v,
                     argv[i - 1]);
        return false;
      }
      return true;
    };
    if (arg == "--help" || arg == "-h") {
      PrintDemoUsage(stdout);
      return -1;
    } else if (arg == "--driver") {
      const char* v = value();
      if (v == nullptr) return 2;
      a->driver = v;
    } else if (arg == "--models") {
      if (!int_value(1, &a->models)) return 2;
    } else if (arg == "--resident") {
      if (!int_value(1, &a->resident)) return 2;
    } else if (arg == "--cycles") {
      if (!int_value(1, &a->cycles)) return 2;
    } else if (arg == "--seed") {
      const char* v = value();
      if (v == nullptr || !absl::SimpleAtoi(v, &a->seed)) {
        std::fprintf(stderr, "ctxpool demo: bad --seed\n");
        return 2;
      }
    } else if (arg == "--out") {
      const char* v = value();
      if (v == nullptr) return 2;
      a->out = v;
    } else if (arg == "--json") {
      a->json = true;
    } else if (arg == "--progress") {
      a->progress = true;
    } else if (arg == "--no-progress") {
      a->progress = false;
    } else {
      std::fprintf(stderr, "ctxpool demo: unknown argument '%s'\n\n", argv[i]);
      PrintDemoUsage(stderr);
      return 2;
    }
  }
  if (a->resident > a->models) {
    std::fprintf(stderr, "ctxpool demo: --resident must be <= --models\n");
    return 2;
  }
  return 0;
}

std::string ModelName(std::uint32_t tenant) {
  return absl::StrCat("model", tenant);
}

// Where the trace's live bytes peak, and each model's peak.
struct TraceFacts {
  absl::flat_hash_map<std::uint32_t, std::uint64_t> tenant_peak;
  std::size_t snapshot_event = 0;
};

TraceFacts Study(const Trace& trace) {
  TraceFacts f;
  f.tenant_peak = TenantPeaks(trace);
  f.snapshot_event = static_cast<std::size_t>(Summarize(trace).peak_live_event);
  return f;
}

// The demo's sessions get a budget of 1.25x the model's peak, rounded up to
// 256 MiB.
RunOptions DemoRun(const TraceFacts& facts, const std::string& label,
                   std::function<void(std::size_t, std::size_t)> progress) {
  RunOptions o;
  o.label = label;
  o.snapshot_event = facts.snapshot_event;
  o.progress = std::move(progress);
  o.spec = [&facts](std::uint32_t tenant) {
    LoadSpec spec;
    spec.name = ModelName(tenant);
    const auto it = facts.tenant_peak.find(tenant);
    const std::uint64_t peak = it == facts.tenant_peak.end() ? 0 : it->second;
    const std::uint64_t unit = 256ull << 20;
    spec.session.max_bytes =
        static_cast<std::size_t>((peak + peak / 4 + unit - 1) / unit * unit);
    return spec;
  };
  return o;
}

// ---- Output ----------------------------------------------------------------

std::string Percent(double f) { return absl::StrFormat("%.0f%%", 100 * f); }

void PrintTable(const std::vector<ModeResult>& rows) {
  const char* kFmt = "%-8s %9s %15s %14s %23s %6s %20s\n";
  std::printf(kFmt, "mode", "contexts", "context memory", "peak reserved",
              "reserved after unload", "OOMs", "fragmentation (mean/max)");
  for (const ModeResult& r : rows) {
    std::printf(kFmt, r.mode.c_str(), absl::StrCat(r.contexts).c_str(),
                FormatBytes(r.context_bytes).c_str(),
                FormatBytes(r.peak_reserved).c_str(),
                FormatBytes(r.reserved_after_unload).c_str(),
                absl::StrCat(r.ooms).c_str(),
                absl::StrCat(Percent(r.mean_fragmentation), " / ",
                             Percent(r.max_fragmentation))
                    .c_str());
  }
}

std::string RowJson(const ModeResult& r) {
  return absl::StrCat(
      "{\"mode\":", JsonString(r.mode),
      ",\"description\":", JsonString(r.description),
      ",\"contexts\":", r.contexts, ",\"context_bytes\":", r.context_bytes,
      ",\"peak_reserved_bytes\":", r.peak_reserved,
      ",\"reserved_after_unload_bytes\":", r.reserved_after_unload,
      ",\"ooms\":", r.ooms, ",\"budget_rejections\":", r.budget_rejections,
      ",\"trims\":", r.trims, ",\"model_loads\":", r.loads,
      ",\"failed_loads\":", r.failed_loads,
      ",\"upstream_allocations\":", r.upstream_allocs,
      ",\"fragmentation_mean\":", absl::StrFormat("%.4f", r.mean_fragmentation),
      ",\"fragmentation_max\":", absl::StrFormat("%.4f", r.max_fragmentation),
      "}");
}

SvgPlot ReservedPlot(const std::vector<ModeResult>& rows) {
  SvgPlot p;
  p.title = "Device memory reserved over time";
  p.x_label = "trace event (#)";
  p.y_label = "reserved (GiB)";
  constexpr double kGiBd = 1024.0 * 1024 * 1024;
  for (const ModeResult& r : rows) {
    SvgSeries s{r.mode, {}};
    for (const Sample& x : r.samples) {
      s.points.emplace_back(static_cast<double>(x.event),
                            static_cast<double>(x.reserved) / kGiBd);
    }
    p.series.push_back(std::move(s));
  }
  if (!rows.empty()) {
    SvgSeries live{"live (in use, dashed)", {}};
    live.dashed = true;
    for (const Sample& x : rows.front().samples) {
      live.points.emplace_back(static_cast<double>(x.event),
                               static_cast<double>(x.live) / kGiBd);
    }
    p.series.push_back(std::move(live));
  }
  return p;
}

SvgPlot FragmentationPlot(const std::vector<ModeResult>& rows) {
  SvgPlot p;
  p.title = "External fragmentation of the cached memory";
  p.x_label = "trace event (#)";
  p.y_label = "1 - largest free / free (%)";
  p.y_max = 100;
  for (const ModeResult& r : rows) {
    SvgSeries s{r.mode, {}};
    for (const Sample& x : r.samples) {
      s.points.emplace_back(static_cast<double>(x.event), 100 * x.external);
    }
    p.series.push_back(std::move(s));
  }
  return p;
}

}  // namespace

int RunDemo(int argc, char** argv) {
  Args a;
  if (int rc = ParseArgs(argc, argv, &a); rc != 0) return rc < 0 ? 0 : rc;

  // Choose the device once, then give each mode a fresh driver for it.
  RuntimeOptions probe_options;
  probe_options.driver = a.driver;
  probe_options.devices = {0};
  absl::StatusOr<std::unique_ptr<Runtime>> probe =
      Runtime::Create(probe_options);
  if (!probe.ok()) {
    std::fprintf(stderr, "ctxpool demo: %s\n",
                 probe.status().ToString().c_str());
    return 1;
  }
  const std::string note = (*probe)->driver_note();
  const bool sim = (*probe)->driver_kind() == "sim";
  std::optional<SimDeviceSpec> spec;
  if (sim) spec = static_cast<SimDriver&>((*probe)->driver()).device_spec(0);
  const std::string device_desc = (*probe)->driver().Describe();
  absl::StatusOr<std::size_t> capacity = (*probe)->driver().DeviceTotalMem(0);
  probe->reset();
  if (!capacity.ok()) {
    std::fprintf(stderr, "ctxpool demo: %s\n",
                 capacity.status().ToString().c_str());
    return 1;
  }
  auto make_driver = [&]() -> absl::StatusOr<std::unique_ptr<Driver>> {
    if (sim) {
      std::unique_ptr<Driver> d = SimDriver::Create({.devices = {*spec}});
      return d;
    }
    return CudaDriver::Load();
  };

  // The workload, scaled to the device: models of 1/16 to 1/4 of it.
  MultiModelChurnOptions w;
  w.seed = a.seed;
  w.models = a.models;
  w.resident = a.resident;
  w.cycles = a.cycles;
  w.min_model_bytes = *capacity / 16;
  w.max_model_bytes = *capacity / 4;
  const Trace trace = MultiModelChurn(w);
  const TraceFacts facts = Study(trace);

  const bool show_progress =
      a.progress.value_or(isatty(STDERR_FILENO) != 0 && trace.size() > 100000);
  auto progress_for = [&](const std::string& mode)
      -> std::function<void(std::size_t, std::size_t)> {
    if (!show_progress) return nullptr;
    return [mode](std::size_t done, std::size_t total) {
      std::fprintf(stderr, "\rdemo: %s: %zu / %zu events (%.0f%%)",
                   mode.c_str(), done, total,
                   100.0 * static_cast<double>(done) /
                       static_cast<double>(std::max<std::size_t>(total, 1)));
      if (done == total) std::fprintf(stderr, "\n");
    };
  };

  std::vector<ModeResult> rows;
  {
    absl::StatusOr<std::unique_ptr<Driver>> driver = make_driver();
    if (!driver.ok()) {
      std::fprintf(stderr, "ctxpool demo: %s\n",
                   driver.status().ToString().c_str());
      return 1;
    }
    absl::StatusOr<ModeResult> r;
    {
      TodayMode today(**driver);
      r = RunMode(today, trace, DemoRun(facts, "today", progress_for("today")));
    }
    if (!r.ok()) {
      std::fprintf(stderr, "ctxpool demo: today: %s\n",
                   r.status().ToString().c_str());
      return 1;
    }
    r->description =
        "a context and a caching allocator per model, never trimmed";
    r->panel.title = "today: a context and a cache per model";
    rows.push_back(std::move(r).value());
  }
  {
    absl::StatusOr<std::unique_ptr<Driver>> driver = make_driver();
    if (!driver.ok()) {
      std::fprintf(stderr, "ctxpool demo: %s\n",
                   driver.status().ToString().c_str());
      return 1;
    }
    RuntimeOptions options;
    options.devices = {0};
    absl::StatusOr<std::unique_ptr<Runtime>> rt =
        Runtime::Create(std::move(driver).value(), options);
    if (!rt.ok()) {
      std::fprintf(stderr, "ctxpool demo: %s\n",
                   rt.status().ToString().c_str());
      return 1;
    }
    absl::StatusOr<ModeResult> r;
    {
      CtxpoolMode pooled(*(*rt)->device(0).value());
      r = RunMode(pooled, trace,
                  DemoRun(facts, "ctxpool", progress_for("ctxpool")));
    }
    if (!r.ok()) {
      std::fprintf(stderr, "ctxpool demo: ctxpool: %s\n",
                   r.status().ToString().c_str());
      return 1;
    }
    r->description =
        "one primary context, a session per model with a budget, one shared "
        "cache, trim on unload";
    r->panel.title = "ctxpool: one context, sessions, shared cache";
    rows.push_back(std::move(r).value());
  }

  const TraceSummary summary = Summarize(trace);
  const std::string workload = absl::StrFormat(
      "%d models (%s to %s of weights), %d resident, %d load/serve/unload "
      "cycles, seed %d: %d events, peak live %s",
      a.models, FormatBytes(w.min_model_bytes), FormatBytes(w.max_model_bytes),
      a.resident, a.cycles, a.seed, trace.size(),
      FormatBytes(summary.peak_live_bytes));

  // The SVG.
  std::vector<MemoryMapPanel> panels;
  for (const ModeResult& r : rows) panels.push_back(r.panel);
  SvgOptions svg_options;
  svg_options.title = absl::StrCat("ctxpool demo: ", device_desc);
  svg_options.subtitle = workload;
  const std::string svg = RenderMemoryMapSvg(
      panels, {ReservedPlot(rows), FragmentationPlot(rows)}, svg_options);
  bool svg_ok = false;
  {
    std::ofstream f(a.out, std::ios::binary | std::ios::trunc);
    if (f) {
      f << svg;
      f.close();
      svg_ok = static_cast<bool>(f);
    }
  }
  if (!svg_ok) {
    std::fprintf(stderr, "ctxpool demo: cannot write %s\n", a.out.c_str());
    return 1;
  }

  if (a.json) {
    std::string out = absl::StrCat(
        "{\"device\":", JsonString(device_desc),
        ",\"driver\":", JsonString(sim ? "sim" : "cuda"),
        ",\"capacity_bytes\":", *capacity,
        ",\"workload\":", JsonString(workload), ",\"events\":", trace.size(),
        ",\"peak_live_bytes\":", summary.peak_live_bytes,
        ",\"svg\":", JsonString(a.out), ",\"modes\":[");
    for (std::size_t i = 0; i < rows.size(); ++i) {
      absl::StrAppend(&out, i ? "," : "", RowJson(rows[i]));
    }
    out += "]}\n";
    std::fputs(out.c_str(), stdout);
    return 0;
  }
  std::printf("%s\n", note.c_str());
  std::printf("workload: %s\n\n", workload.c_str());
  PrintTable(rows);
  std::printf(
      "\ntoday:   %s\nctxpool: %s\n"
      "context memory: device memory the contexts took; peak reserved and "
      "reserved after unload:\n"
      "allocator memory (all models unloaded at the end); fragmentation: 1 - "
      "largest free block / cached free bytes, sampled.\n"
      "ctxpool: %d budget rejections, %d trims.\n\nmemory map: %s\n",
      rows[0].description.c_str(), rows[1].description.c_str(),
      static_cast<int>(rows[1].budget_rejections),
      static_cast<int>(rows[1].trims), a.out.c_str());
  return 0;
}

}  // namespace ctxpool::tool
