// `ctxpool plan`: will these models fit on this GPU together, how many
// replicas of each, and with which budgets?
//
//   ctxpool plan --device h100-80gb
//       --model gpt2=../shared/traces/gpt2-large-train-step.rmm.csv
//       --model opt=../shared/traces/opt-federated-finetune.rmm.csv,replicas=4
//   (one command line)
//
// Each model is an allocation trace (any form `ctxpool replay` reads); each
// replica of it is a tenant of its own: a ModelSession with its own stream(s)
// and the model's budget in ctxpool mode, a context and a private cache in
// today's mode (tools/server_modes.h). The replicas run side by side on one
// simulated device:
//
//   * concurrent (default): every replica starts at time 0 and one pass of
//     its trace takes one period. A trace's own clock is its event order
//     (the RMM logs in ../shared/traces record the event index as the time);
//     stretching each trace to the period scales every model to the same
//     request rate, one pass per period, and the replicas' events are
//     interleaved by that common time. Replicas of a model run in phase, so
//     their peaks coincide: the plan is for the worst case.
//   * staggered: as concurrent, but replica r of a model starts frac(r * phi)
//     of a period late (phi = 0.618..., the golden ratio's fraction: the
//     first R offsets spread evenly over the period whatever R, and a plan
//     with one more replica moves no other, so the plans a search compares
//     are nested, as in phase).
//   * churn[:resident=K,cycles=C]: load / serve / unload, as workload:churn.
//     The replicas take turns, K loaded at once, C rounds: each load runs one
//     pass of its trace, then the replica is unloaded (what it holds is
//     freed; ctxpool closes its session and trims; today's framework keeps
//     its context and cache).
//
// Both modes replay the same merged trace on a fresh simulated device and
// report, side by side: fits (no allocation failed), the peak device memory
// (contexts, allocator segments or mapped granules, cached granules),
// headroom, context memory, OOMs and the first OOM's report.
//
// --max-replicas[=NAME] searches, for each model (or NAME) while the others
// stay as given, the largest replica count N such that every count 1..N
// fits, in each mode: each count is replayed up to kLinearScan (fitting is
// not always monotone in the count), then doubling and bisection (the
// answer is marked). It reports N and the first OOM of the plan with N + 1,
// which the search replayed: both numbers are replays, not estimates.
//
// --suggest-budgets proposes, from one replay of each model alone on the
// device (ctxpool mode, no budget) and its OOM frontier:
//   max   the session's peak charged bytes (what the session counts against
//         max: allocations rounded by the allocator), rounded up to the
//         2 MiB granule. Tight: the trace needs every byte of it.
//   high  its frontier: the smallest device (less the context) on which the
//         model alone replays with no OOM (FindMinCapacity), i.e. peak live
//         plus the slack this allocator measurably needs for this trace.
//         Above it the model gives cached memory back.
//   min   the live bytes it holds at least half the time (the median over
//         the trace's events), rounded up to the granule: its steady state,
//         protected from reclaim by the others; its peaks above that come
//         from the shared cache.
// It then replays the plan with those budgets (no OOM, no budget rejection
// wanted) and, for each model, with its max one granule lower (that model
// must fail), and prints both checks.
//
// --gpu replays the plan once on the real GPU (no search, no suggestion).
// Exit status: 0 when the plan ran (not fitting is a result), 1 when it could
// not run, 2 on bad input (unknown preset, missing trace, replicas 0, budgets
// whose min sum exceeds the device: every replica's min when all run at
// once, the resident replicas' under churn).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
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
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "ctxpool/status.h"
#include "ctxpool/telemetry/json.h"
#include "ctxpool/telemetry/svg.h"
#include "ctxpool/trace/replay.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"
#include "tools/commands.h"
#include "tools/server_modes.h"

namespace ctxpool::tool {
namespace {

constexpr std::uint64_t kGranule = 2ull << 20;
constexpr int kMaxReplicas = 4096;
// --max-replicas replays every count up to this one (then bisects).
constexpr int kLinearScan = 64;
// The most events a merged plan may replay (its trace is held in memory:
// about 60 B per event, twice while it is built).
constexpr std::uint64_t kMaxPlanEvents = 32'000'000;
// A replay stops counting after this many failed allocations (the plan does
// not fit; the count is then a lower bound, printed as "N+").
constexpr std::int64_t kMaxCountedOoms = 100'000;

std::uint64_t RoundUpGranule(std::uint64_t v) {
  return (v + kGranule - 1) / kGranule * kGranule;
}

void PrintPlanUsage(std::FILE* out) {
  std::fprintf(
      out,
      "usage: ctxpool plan [--device PRESET] [--capacity SIZE] "
      "--model NAME=TRACE[,replicas=N][,min=SIZE][,high=SIZE][,max=SIZE] "
      "...\n"
      "                    [--schedule concurrent|staggered|churn[:resident=K,"
      "cycles=C]]\n                    "
      "[--config K=V,...]\n"
      "                    [--max-replicas[=NAME]] [--suggest-budgets] "
      "[--svg FILE] [--json] [--gpu]\n\n"
      "Co-locates the models on one simulated device, each replica a tenant "
      "with its own\n"
      "stream, and replays them side by side with ctxpool (one context, a "
      "session per\n"
      "replica with its budget, one shared cache) and as servers do today (a "
      "context and\n"
      "a private cache per replica). Prints fits or not, peak device memory, "
      "headroom,\n"
      "context memory, OOMs and the first OOM for each.\n\n"
      "  --device PRESET     simulated device (default h100-80gb): %s\n"
      "  --capacity SIZE     override the preset's capacity (e.g. 40GiB)\n"
      "  --model NAME=TRACE  a model: a trace file (ctxpool CSV, RMM log CSV, "
      "ctxpool-trace JSON)\n"
      "                      or workload:NAME[:k=v,...]; then replicas=N "
      "(default 1) and the\n"
      "                      session budget min=, high=, max= (sizes: 8GiB, "
      "512MiB)\n"
      "  --schedule S        concurrent (default: every replica runs its "
      "trace once, in phase,\n"
      "                      scaled to one common period),\n"
      "                      staggered (the same, replica r starting "
      "frac(r * 0.618) of a\n"
      "                      period late: out of phase, evenly spread)\n"
      "                      or churn[:resident=K,cycles=C] (replicas take "
      "turns: K loaded at\n"
      "                      once, C rounds of load/serve/unload)\n"
      "  --config K=V,...    ctxpool's allocator options, as `ctxpool replay "
      "--config`\n"
      "  --max-replicas[=NAME]  the most replicas of each model (or NAME) "
      "that fit while the\n"
      "                      others stay as given, in each mode, and what "
      "breaks one more\n"
      "  --suggest-budgets   min/high/max per model from its replay, verified "
      "by replaying\n"
      "  --svg FILE          reserved memory over time, stacked by model, "
      "both modes\n"
      "  --json              one JSON object\n"
      "  --gpu               replay the plan once on the GPU (no search, no "
      "suggestion)\n",
      absl::StrJoin(SimDevicePresetNames(), ", ").c_str());
}

// ---- Input -----------------------------------------------------------------

struct ModelArg {
  std::string name;
  std::string trace_spec;
  int replicas = 1;
  std::optional<std::uint64_t> min, high, max;
  Trace trace;
  // Per trace event: the session stream it runs on (trace streams in order
  // of first use), and the event's position in the period [0, 1).
  std::vector<int> stream_index;
  int streams = 1;
  std::vector<double> phase;
  std::uint64_t peak_live = 0;
  std::uint64_t median_live = 0;
  std::uint64_t events = 0;  // allocations and frees (what a pass replays)
};

struct Schedule {
  bool churn = false;
  // Concurrent only: replica r starts frac(r * 0.618...) of a period late,
  // so the replicas of a model do not peak together.
  bool staggered = false;
  int resident = 1;
  int cycles = 1;
  std::string ToString() const {
    if (churn) {
      return absl::StrFormat("churn:resident=%d,cycles=%d", resident, cycles);
    }
    return staggered ? "staggered" : "concurrent";
  }
};

struct Args {
  std::string device = "h100-80gb";
  bool device_given = false;
  std::uint64_t capacity = 0;
  std::vector<ModelArg> models;
  Schedule schedule;
  DeviceAllocatorOptions allocator{.backing = BackingMode::kAuto};
  bool max_replicas = false;
  std::string max_replicas_model;  // empty: every model
  bool suggest = false;
  std::string svg;
  bool json = false;
  bool gpu = false;
};

// Non-printable bytes (a binary file's, newlines) as \xNN: one clean line.
std::string Printable(absl::string_view text) {
  std::string out;
  for (char c : text) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) {
      out += c;
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", u);
    }
  }
  return out;
}

int UsageError(const std::string& message) {
  std::fprintf(stderr, "ctxpool plan: %s\n", message.c_str());
  return 2;
}

// "NAME=TRACE[,replicas=N][,min=S][,high=S][,max=S]". The trace may itself
// hold commas (workload:churn:a=1,b=2): only the known keys are options.
absl::StatusOr<ModelArg> ParseModel(absl::string_view text) {
  const std::size_t eq = text.find('=');
  if (eq == absl::string_view::npos || eq == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--model '", text, "': want NAME=TRACE[,replicas=N][,min=..]"));
  }
  ModelArg m;
  m.name = std::string(text.substr(0, eq));
  if (m.name.find('#') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", m.name,
        "': a name may not hold '#' (replicas are named NAME#1, NAME#2, ...)"));
  }
  std::vector<std::string> trace_parts;
  absl::flat_hash_set<std::string> seen;
  for (absl::string_view part :
       absl::StrSplit(text.substr(eq + 1), ',', absl::AllowEmpty())) {
    auto value_of =
        [&](absl::string_view key) -> std::optional<absl::string_view> {
      if (absl::StartsWith(part, key)) return part.substr(key.size());
      return std::nullopt;
    };
    for (absl::string_view key : {"replicas=", "min=", "high=", "max="}) {
      if (absl::StartsWith(part, key) &&
          !seen.insert(std::string(key)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", m.name,
                         "': ", key.substr(0, key.size() - 1), " given twice"));
      }
    }
    if (auto v = value_of("replicas=")) {
      if (!absl::SimpleAtoi(*v, &m.replicas) || m.replicas < 1 ||
          m.replicas > kMaxReplicas) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", m.name, "': replicas='", *v,
                         "' must be 1 to ", kMaxReplicas));
      }
      continue;
    }
    bool budget = false;
    for (auto [key, slot] :
         {std::pair{"min=", &m.min}, std::pair{"high=", &m.high},
          std::pair{"max=", &m.max}}) {
      if (auto v = value_of(key)) {
        absl::StatusOr<std::uint64_t> bytes = ParseByteSize(*v);
        if (!bytes.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("model '", m.name, "': bad ", key, "'", *v, "'"));
        }
        // A session's 0 means "no limit": say so instead of taking it.
        if (*bytes == 0 && key != absl::string_view("min=")) {
          return absl::InvalidArgumentError(absl::StrCat(
              "model '", m.name, "': ", key, *v,
              " is 0 bytes, which a session takes as no limit; leave ",
              absl::string_view(key).substr(0, std::strlen(key) - 1),
              " out for none"));
        }
        *slot = *bytes;
        budget = true;
      }
    }
    if (budget) continue;
    if (!trace_parts.empty() || !part.empty()) {
      trace_parts.emplace_back(part);
    }
  }
  m.trace_spec = absl::StrJoin(trace_parts, ",");
  if (m.trace_spec.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", m.name, "' has no trace"));
  }
  // A file trace's later parts are options unless the file's name has them.
  if (!absl::StartsWith(m.trace_spec, "workload:") && trace_parts.size() > 1 &&
      access(m.trace_spec.c_str(), F_OK) != 0) {
    for (std::size_t i = 1; i < trace_parts.size(); ++i) {
      const std::string& part = trace_parts[i];
      const std::size_t k = part.find('=');
      if (k != std::string::npos && k > 0 &&
          std::all_of(part.begin(), part.begin() + k, [](char c) {
            return std::islower(static_cast<unsigned char>(c)) || c == '_';
          })) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", m.name, "': unknown option '", part,
                         "' (replicas=, min=, high=, max=)"));
      }
    }
  }
  if (m.min && m.max && *m.min > *m.max) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", m.name, "': min ", FormatBytes(*m.min),
                     " exceeds max ", FormatBytes(*m.max)));
  }
  if (m.min && m.high && *m.min > *m.high) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", m.name, "': min ", FormatBytes(*m.min),
                     " exceeds high ", FormatBytes(*m.high)));
  }
  return m;
}

int ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) return nullptr;
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      PrintPlanUsage(stdout);
      return -1;
    } else if (arg == "--device") {
      const char* v = value();
      if (v == nullptr || *v == '\0') {
        return UsageError(
            absl::StrCat("--device needs a preset name (",
                         absl::StrJoin(SimDevicePresetNames(), ", "), ")"));
      }
      a->device = v;
      a->device_given = true;
    } else if (arg == "--capacity") {
      const char* v = value();
      absl::StatusOr<std::uint64_t> bytes =
          v == nullptr ? absl::InvalidArgumentError("") : ParseByteSize(v);
      if (!bytes.ok() || *bytes == 0 || *bytes > kSimMaxCapacityBytes) {
        return UsageError(absl::StrCat("bad --capacity '", v ? v : "", "'"));
      }
      a->capacity = *bytes;
    } else if (arg == "--model") {
      const char* v = value();
      if (v == nullptr) return UsageError("--model needs NAME=TRACE");
      absl::StatusOr<ModelArg> m = ParseModel(v);
      if (!m.ok()) return UsageError(std::string(m.status().message()));
      for (const ModelArg& other : a->models) {
        if (other.name == m->name) {
          return UsageError(absl::StrCat("model '", m->name, "' given twice"));
        }
      }
      a->models.push_back(std::move(m).value());
    } else if (arg == "--schedule") {
      const char* v = value();
      const absl::string_view s = v == nullptr ? "" : v;
      if (s == "concurrent" || s == "staggered") {
        a->schedule = {};
        a->schedule.staggered = s == "staggered";
      } else if (s == "churn" || absl::StartsWith(s, "churn:")) {
        a->schedule = {};
        a->schedule.churn = true;
        a->schedule.resident = 1;
        a->schedule.cycles = 2;
        if (s.size() > 6) {
          absl::flat_hash_set<std::string> keys;
          for (absl::string_view kv : absl::StrSplit(s.substr(6), ',')) {
            int n = 0;
            if (!keys.insert(std::string(kv.substr(0, kv.find('=')))).second) {
              return UsageError(absl::StrCat("--schedule: '",
                                             kv.substr(0, kv.find('=')),
                                             "' given twice"));
            }
            if (absl::StartsWith(kv, "resident=") &&
                absl::SimpleAtoi(kv.substr(9), &n) && n >= 1) {
              a->schedule.resident = n;
            } else if (absl::StartsWith(kv, "cycles=") &&
                       absl::SimpleAtoi(kv.substr(7), &n) && n >= 1 &&
                       n <= 1000) {
              a->schedule.cycles = n;
            } else {
              return UsageError(absl::StrCat("bad --schedule option '", kv,
                                             "' (resident=K, cycles=C)"));
            }
          }
        }
      } else {
        return UsageError(absl::StrCat("bad --schedule '", s,
                                       "': concurrent, staggered or "
                                       "churn[:resident=K,cycles=C]"));
      }
    } else if (arg == "--config") {
      const char* v = value();
      if (v == nullptr) return UsageError("--config needs K=V,...");
      absl::Status s = ParseAllocatorConfig(v, &a->allocator);
      if (!s.ok()) return UsageError(std::string(s.message()));
    } else if (arg == "--max-replicas") {
      a->max_replicas = true;
    } else if (absl::StartsWith(arg, "--max-replicas=")) {
      a->max_replicas = true;
      a->max_replicas_model = std::string(arg.substr(15));
    } else if (arg == "--suggest-budgets") {
      a->suggest = true;
    } else if (arg == "--svg") {
      const char* v = value();
      if (v == nullptr || *v == '\0') return UsageError("--svg needs a file");
      a->svg = v;
    } else if (arg == "--json") {
      a->json = true;
    } else if (arg == "--gpu") {
      a->gpu = true;
    } else {
      std::fprintf(stderr, "ctxpool plan: unknown argument '%s'\n\n", argv[i]);
      PrintPlanUsage(stderr);
      return 2;
    }
  }
  if (a->models.empty()) {
    return UsageError("no --model given (try --help)");
  }
  if (!a->max_replicas_model.empty()) {
    bool known = false;
    for (const ModelArg& m : a->models)
      known |= m.name == a->max_replicas_model;
    if (!known) {
      return UsageError(absl::StrCat("--max-replicas=", a->max_replicas_model,
                                     ": no such --model"));
    }
  }
  if (a->schedule.churn) {
    int replicas = 0;
    for (const ModelArg& m : a->models) replicas += m.replicas;
    if (a->schedule.resident > replicas) {
      return UsageError(absl::StrFormat(
          "--schedule churn: resident=%d is more than the plan's %d "
          "replica(s)",
          a->schedule.resident, replicas));
    }
  }
  if (a->max_replicas && a->schedule.churn) {
    return UsageError(
        "--max-replicas needs --schedule concurrent or staggered: under "
        "churn at most "
        "resident=K replicas are loaded at once, whatever their number");
  }
  if (a->gpu && (a->max_replicas || a->suggest)) {
    return UsageError(
        "--gpu replays the plan once: no --max-replicas or --suggest-budgets");
  }
  if (a->gpu && (a->device_given || a->capacity != 0)) {
    return UsageError(
        "--gpu replays on the real device: no --device or --capacity");
  }
  if (!a->svg.empty()) {
    // Fail now, not after the replays: open the file for writing (without
    // truncating it), and remove it again if it is new.
    const bool existed = access(a->svg.c_str(), F_OK) == 0;
    std::FILE* f = std::fopen(a->svg.c_str(), "a");
    if (f == nullptr) {
      return UsageError(absl::StrCat("--svg ", a->svg, ": cannot write there (",
                                     std::strerror(errno), ")"));
    }
    std::fclose(f);
    if (!existed) std::remove(a->svg.c_str());
  }
  return 0;
}

// Loads each model's trace and studies it.
absl::Status LoadModel(ModelArg& m) {
  absl::StatusOr<Trace> t =
      absl::StartsWith(m.trace_spec, "workload:")
          ? GenerateWorkload(absl::string_view(m.trace_spec).substr(9))
          : ReadTraceFile(m.trace_spec);
  if (!t.ok()) {
    return absl::Status(
        t.status().code(),
        absl::StrCat("model '", m.name, "': ", t.status().message()));
  }
  CTXPOOL_RETURN_IF_ERROR(t->Validate());
  m.trace = std::move(t).value();
  const std::vector<TraceEvent>& ev = m.trace.events();
  // The period: the trace's own clock when it moves forward, else its order.
  bool clock = !ev.empty() && ev.back().time_ns > ev.front().time_ns;
  for (std::size_t i = 1; clock && i < ev.size(); ++i) {
    clock = ev[i].time_ns >= ev[i - 1].time_ns;
  }
  absl::flat_hash_map<std::uint64_t, int> streams;
  m.stream_index.resize(ev.size());
  m.phase.resize(ev.size());
  const double t0 = ev.empty() ? 0 : static_cast<double>(ev.front().time_ns);
  const double span =
      ev.empty() ? 1 : static_cast<double>(ev.back().time_ns) - t0 + 1.0;
  std::vector<std::uint64_t> live_at;
  live_at.reserve(ev.size());
  absl::flat_hash_map<std::uint64_t, std::uint64_t> live;
  std::uint64_t now = 0;
  for (std::size_t i = 0; i < ev.size(); ++i) {
    const TraceEvent& e = ev[i];
    auto [it, added] =
        streams.try_emplace(e.stream, static_cast<int>(streams.size()));
    m.stream_index[i] = it->second;
    m.phase[i] = clock
                     ? (static_cast<double>(e.time_ns) - t0) / span
                     : static_cast<double>(i) / static_cast<double>(ev.size());
    if (e.op == TraceOp::kAlloc) {
      ++m.events;
      live[e.ptr] = e.size;
      now += e.size;
    } else if (e.op == TraceOp::kFree) {
      ++m.events;
      auto l = live.find(e.ptr);
      if (l != live.end()) {
        now -= l->second;
        live.erase(l);
      }
    }
    m.peak_live = std::max(m.peak_live, now);
    live_at.push_back(now);
  }
  m.streams = std::max<int>(1, static_cast<int>(streams.size()));
  if (m.peak_live == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", m.name, "': the trace allocates nothing (",
                     m.trace.size(), " events)"));
  }
  if (!live_at.empty()) {
    std::nth_element(live_at.begin(), live_at.begin() + live_at.size() / 2,
                     live_at.end());
    m.median_live = live_at[live_at.size() / 2];
  }
  return absl::OkStatus();
}

// ---- The merged trace ------------------------------------------------------

// One replica: a tenant of the plan.
struct Replica {
  int model = 0;
  int index = 0;  // within its model
  std::string name;
};

struct Plan {
  std::vector<int> replicas;  // per model
  // Per model: budget of its sessions (nullopt fields: none).
  std::vector<SessionOptions> budgets;
};

// The most the budgets' min can protect at once: the sum over every replica
// when all run together; under churn, the largest sum over the `resident`
// replicas loaded in one period (the same groups Merge loads). Saturates.
std::uint64_t MinSumAtOnce(const std::vector<ModelArg>& models,
                           const Plan& plan, const Schedule& schedule) {
  std::vector<std::uint64_t> mins;  // per tenant, in Merge's order
  for (std::size_t m = 0; m < models.size(); ++m) {
    const std::uint64_t min = plan.budgets[m].min_bytes.value_or(0);
    mins.insert(mins.end(), static_cast<std::size_t>(plan.replicas[m]), min);
  }
  const auto add = [](std::uint64_t a, std::uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
  };
  if (!schedule.churn || mins.empty()) {
    std::uint64_t sum = 0;
    for (std::uint64_t v : mins) sum = add(sum, v);
    return sum;
  }
  const std::size_t n = mins.size();
  const std::size_t k = std::min<std::size_t>(schedule.resident, n);
  const std::size_t instances = n * static_cast<std::size_t>(schedule.cycles);
  std::uint64_t most = 0;
  for (std::size_t start = 0; start < instances; start += k) {
    std::uint64_t sum = 0;
    for (std::size_t j = start; j < std::min(start + k, instances); ++j) {
      sum = add(sum, mins[j % n]);
    }
    most = std::max(most, sum);
  }
  return most;
}

// Replica r (0-based) of a model with `replicas` of them: the model's name
// alone, or NAME#k.
std::string ReplicaName(const std::string& model, int r, int replicas) {
  return replicas == 1 ? model : absl::StrCat(model, "#", r + 1);
}

struct Merged {
  Trace trace;
  std::vector<Replica> tenants;  // tenant id t is tenants[t - 1]
};

Merged Merge(const std::vector<ModelArg>& models, const Plan& plan,
             const Schedule& schedule) {
  Merged out;
  for (std::size_t m = 0; m < models.size(); ++m) {
    for (int r = 0; r < plan.replicas[m]; ++r) {
      out.tenants.push_back({static_cast<int>(m), r,
                             ReplicaName(models[m].name, r, plan.replicas[m])});
    }
  }
  // Instances: (tenant, first period).
  std::vector<std::pair<std::uint32_t, int>> instances;
  if (!schedule.churn) {
    for (std::size_t t = 0; t < out.tenants.size(); ++t) {
      instances.emplace_back(static_cast<std::uint32_t>(t + 1), 0);
    }
  } else {
    int j = 0;
    for (int c = 0; c < schedule.cycles; ++c) {
      for (std::size_t t = 0; t < out.tenants.size(); ++t, ++j) {
        instances.emplace_back(static_cast<std::uint32_t>(t + 1),
                               j / schedule.resident);
      }
    }
  }
  struct Item {
    double time;
    std::uint32_t instance;
    std::uint32_t index;  // event index; UINT32_MAX: the unload
  };
  std::vector<Item> items;
  std::size_t total = 0;
  for (const auto& [tenant, period] : instances) {
    total += models[out.tenants[tenant - 1].model].trace.size() + 1;
  }
  items.reserve(total);
  for (std::uint32_t k = 0; k < instances.size(); ++k) {
    const auto [tenant, period] = instances[k];
    const Replica& replica = out.tenants[tenant - 1];
    const ModelArg& m = models[replica.model];
    // Golden-ratio offsets depend on r only: adding a replica moves none.
    constexpr double kPhi = 0.6180339887498949;
    double whole = 0;
    const double offset =
        schedule.staggered
            ? std::modf(static_cast<double>(replica.index) * kPhi, &whole)
            : 0.0;
    for (std::uint32_t i = 0; i < m.trace.size(); ++i) {
      const TraceOp op = m.trace.events()[i].op;
      if (op != TraceOp::kAlloc && op != TraceOp::kFree) continue;
      items.push_back({period + offset + m.phase[i], k, i});
    }
    if (schedule.churn) items.push_back({period + 1.0, k, UINT32_MAX});
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) {
                     if (a.time != b.time) return a.time < b.time;
                     // At a period boundary unloads come first.
                     const bool ua = a.index == UINT32_MAX;
                     const bool ub = b.index == UINT32_MAX;
                     return ua && !ub;
                   });
  out.trace.Reserve(items.size());
  for (const Item& it : items) {
    const std::uint32_t tenant = instances[it.instance].first;
    TraceEvent e;
    e.tenant = tenant;
    if (it.index == UINT32_MAX) {
      e.op = TraceOp::kTrim;  // RunMode: unload this tenant
    } else {
      const ModelArg& m = models[out.tenants[tenant - 1].model];
      e = m.trace.events()[it.index];
      e.tenant = tenant;
      e.stream = static_cast<std::uint64_t>(m.stream_index[it.index]);
    }
    e.time_ns = static_cast<std::int64_t>(it.time * 1e9);
    out.trace.Append(e);
  }
  out.trace.set_source("plan");
  return out;
}

// ---- Running a plan --------------------------------------------------------

struct Device {
  std::string preset;
  SimDeviceSpec spec;
  bool gpu = false;
};

struct PlanRun {
  bool ran = false;
  ModeResult result;
  bool fits() const { return result.ooms == 0 && result.failed_loads == 0; }
};

struct PlanOutcome {
  std::uint64_t capacity = 0;
  std::string device;
  std::size_t events = 0;
  PlanRun today, ctxpool;
};

absl::StatusOr<std::unique_ptr<Driver>> MakeDriver(const Device& d) {
  if (d.gpu) return CudaDriver::Load();
  std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {d.spec}});
  sim->SetRaceDetection(false);  // a plan touches no memory
  return std::unique_ptr<Driver>(std::move(sim));
}

struct RunWhat {
  bool today = true;
  bool ctxpool = true;
  bool samples = false;                // per-tenant samples for the SVG
  bool stop_at_first_failure = false;  // a search: fits or not is enough
};

absl::StatusOr<PlanOutcome> RunPlan(const std::vector<ModelArg>& models,
                                    const Plan& plan, const Schedule& schedule,
                                    const Device& device,
                                    const DeviceAllocatorOptions& allocator,
                                    const RunWhat& what) {
  const Merged merged = Merge(models, plan, schedule);
  PlanOutcome out;
  out.events = merged.trace.size();
  RunOptions options;
  options.unload_when_empty = false;
  options.fragmentation_samples = false;
  options.per_tenant_samples = what.samples;
  options.max_samples = what.samples ? 400 : 1;
  options.stop_at_first_failure = what.stop_at_first_failure;
  options.max_ooms = kMaxCountedOoms;
  options.spec = [&](std::uint32_t tenant) {
    const Replica& r = merged.tenants[tenant - 1];
    LoadSpec spec;
    spec.name = r.name;
    spec.streams = models[r.model].streams;
    spec.session = plan.budgets[r.model];
    return spec;
  };
  // Each mode on a fresh device.
  auto run_on = [&](bool pooled, PlanRun* run) -> absl::Status {
    CTXPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Driver> driver,
                             MakeDriver(device));
    CTXPOOL_ASSIGN_OR_RETURN(out.capacity, driver->DeviceTotalMem(0));
    out.device = driver->Describe();
    options.label = pooled ? "ctxpool" : "today";
    std::unique_ptr<DeviceContext> ctx;
    if (pooled) {
      DeviceContextOptions dc;
      dc.allocator = allocator;
      CTXPOOL_ASSIGN_OR_RETURN(ctx, DeviceContext::Create(*driver, 0, dc));
    }
    absl::StatusOr<ModeResult> r;
    {
      std::unique_ptr<Mode> mode;
      if (pooled) {
        mode = std::make_unique<CtxpoolMode>(*ctx);
      } else {
        mode = std::make_unique<TodayMode>(*driver);
      }
      r = RunMode(*mode, merged.trace, options);
    }
    if (!r.ok()) {
      return absl::Status(
          r.status().code(),
          absl::StrCat(options.label, ": ", r.status().message()));
    }
    *run = {true, std::move(r).value()};
    return absl::OkStatus();
  };
  if (what.today) CTXPOOL_RETURN_IF_ERROR(run_on(false, &out.today));
  if (what.ctxpool) CTXPOOL_RETURN_IF_ERROR(run_on(true, &out.ctxpool));
  return out;
}

std::string TenantName(const std::vector<ModelArg>& models, const Plan& plan,
                       std::uint32_t tenant) {
  std::uint32_t t = 1;
  for (std::size_t m = 0; m < models.size(); ++m) {
    for (int r = 0; r < plan.replicas[m]; ++r, ++t) {
      if (t == tenant) return ReplicaName(models[m].name, r, plan.replicas[m]);
    }
  }
  return absl::StrCat("tenant ", tenant);
}

int ModelOfTenant(const Plan& plan, std::uint32_t tenant) {
  std::uint32_t t = 1;
  for (std::size_t m = 0; m < plan.replicas.size(); ++m) {
    t += static_cast<std::uint32_t>(plan.replicas[m]);
    if (tenant < t) return static_cast<int>(m);
  }
  return -1;
}

// The first line of an OOM report.
std::string FirstLine(absl::string_view s) {
  return std::string(s.substr(0, s.find('\n')));
}

// ---- --max-replicas --------------------------------------------------------

struct ReplicaSearch {
  std::string model;
  int given = 1;
  struct Side {
    // The most replicas that fit; -1: the other models do not fit even
    // without this one (breaker then describes that plan).
    int max = 0;
    // The search reached its limit (`limit` says which) with max still
    // fitting: max is a lower bound.
    bool at_least = false;
    std::string limit;
    // Counts above kLinearScan were bisected: the ones between were not
    // each replayed.
    bool bisected = false;
    // The plan with max + 1 replicas: who failed first and how (or, when
    // that plan is refused before any replay, why: breaker_message, with
    // refused set).
    bool refused = false;
    std::string breaker;
    std::int64_t breaker_ooms = 0;
    std::string breaker_message;
    int replays = 0;
  } ctxpool, today;
};

// Events in the merged trace of `plan` (the allocations and frees of every
// replica's passes, plus the unloads under churn), saturating.
std::uint64_t PlanEvents(const std::vector<ModelArg>& models, const Plan& plan,
                         const Schedule& schedule) {
  std::uint64_t n = 0;
  const std::uint64_t passes = schedule.churn ? schedule.cycles : 1;
  for (std::size_t m = 0; m < models.size(); ++m) {
    const std::uint64_t per = models[m].events + (schedule.churn ? 1 : 0);
    const std::uint64_t r = static_cast<std::uint64_t>(plan.replicas[m]);
    if (per != 0 && r > (UINT64_MAX - n) / per / passes) return UINT64_MAX;
    n += per * r * passes;
  }
  return n;
}

// Why a plan is refused before it is replayed (empty: it is not).
std::string RefusePlan(const std::vector<ModelArg>& models, const Plan& plan,
                       const Schedule& schedule, std::uint64_t capacity,
                       std::uint64_t context_bytes) {
  if (capacity < context_bytes + kGranule) {
    return absl::StrFormat(
        "the device's %s cannot hold its %s context and one 2 MiB granule",
        FormatBytes(capacity), FormatBytes(context_bytes));
  }
  if (const std::uint64_t events = PlanEvents(models, plan, schedule);
      events > kMaxPlanEvents) {
    return absl::StrFormat(
        "the plan replays %d events, more than the %d a plan may replay",
        events, kMaxPlanEvents);
  }
  if (const std::uint64_t min_sum = MinSumAtOnce(models, plan, schedule);
      min_sum > capacity || capacity - min_sum < context_bytes) {
    return absl::StrFormat(
        "the budgets' min sum to %s; with the %s context that is more than "
        "the device's %s",
        FormatBytes(min_sum), FormatBytes(context_bytes),
        FormatBytes(capacity));
  }
  return "";
}

absl::StatusOr<ReplicaSearch> SearchReplicas(
    const std::vector<ModelArg>& models, const Plan& base, std::size_t m,
    const Schedule& schedule, const Device& device,
    const DeviceAllocatorOptions& allocator) {
  ReplicaSearch out;
  out.model = models[m].name;
  out.given = base.replicas[m];
  auto with = [&](int n) {
    Plan p = base;
    p.replicas[m] = n;
    return p;
  };
  // The largest count a plan may have: kMaxReplicas, or fewer when the
  // merged trace would be too long (its events grow by `per` a replica; the
  // plan as given is within the limit, so at least one replica is).
  int limit = kMaxReplicas;
  std::string limit_reason =
      absl::StrCat("the search stops at ", kMaxReplicas, " replicas");
  const std::uint64_t others = PlanEvents(models, with(0), schedule);
  const std::uint64_t per = PlanEvents(models, with(1), schedule) - others;
  if (per != 0 && (kMaxPlanEvents - others) / per < kMaxReplicas) {
    limit = std::max<int>(1, static_cast<int>((kMaxPlanEvents - others) / per));
    limit_reason = absl::StrFormat(
        "the search stops where the plan would replay more than %d events",
        kMaxPlanEvents);
  }
  // Whether the plan with n replicas is refused (its min sum; within the
  // limit nothing else refuses it).
  auto min_refuses = [&](int n) {
    return !RefusePlan(models, with(n), schedule, device.spec.capacity_bytes,
                       device.spec.context_overhead_bytes)
                .empty();
  };
  for (int side = 0; side < 2; ++side) {
    const bool pooled = side == 0;
    ReplicaSearch::Side& s = pooled ? out.ctxpool : out.today;
    // One replay of the plan with n replicas of model m; a plan whose min
    // sum the device cannot hold does not fit and is not replayed.
    auto replay = [&](int n, bool stop) -> absl::StatusOr<PlanOutcome> {
      RunWhat what;
      what.today = !pooled;
      what.ctxpool = pooled;
      what.stop_at_first_failure = stop;
      ++s.replays;
      return RunPlan(models, with(n), schedule, device, allocator, what);
    };
    auto run_of = [&](const PlanOutcome& o) -> const PlanRun& {
      return pooled ? o.ctxpool : o.today;
    };
    // fits(n); a failing replay is kept in hi_outcome (reset when the plan
    // is refused, not replayed).
    std::optional<PlanOutcome> hi_outcome;
    auto fits = [&](int n) -> absl::StatusOr<bool> {
      if (pooled && min_refuses(n)) {
        hi_outcome.reset();
        return false;
      }
      CTXPOOL_ASSIGN_OR_RETURN(PlanOutcome o, replay(n, /*stop=*/true));
      const bool ok = run_of(o).fits();
      if (!ok) hi_outcome = std::move(o);
      return ok;
    };
    // Fitting is not always monotone in the count (placement is path
    // dependent: a plan can fit with 44 replicas and not with 38), so every
    // count from 1 is replayed while that is cheap and the answer is the
    // first that fails, less one: each count up to it fits. Above
    // kLinearScan: doubling, then bisection between lo (fits) and hi
    // (fails), and the answer says it was bisected.
    int lo = 0, hi = 0;
    bool capped = false;
    for (int n = 1; n <= std::min(limit, kLinearScan); ++n) {
      CTXPOOL_ASSIGN_OR_RETURN(bool ok, fits(n));
      if (!ok) {
        hi = n;
        break;
      }
      lo = n;
    }
    if (hi == 0 && lo >= limit) capped = true;
    if (hi == 0 && !capped) {
      s.bisected = true;
      hi = lo;
      while (true) {
        hi = std::min(limit, hi * 2);
        CTXPOOL_ASSIGN_OR_RETURN(bool ok, fits(hi));
        if (!ok) break;
        lo = hi;
        if (hi >= limit) {
          capped = true;
          break;
        }
      }
    }
    if (capped) {
      s.max = lo;
      s.at_least = true;
      s.limit = limit_reason;
      continue;
    }
    // hi_outcome is the last failing replay; bisection keeps it at hi.
    std::optional<PlanOutcome> at_hi = std::move(hi_outcome);
    while (hi - lo > 1) {
      const int mid = lo + (hi - lo) / 2;
      CTXPOOL_ASSIGN_OR_RETURN(bool ok, fits(mid));
      if (ok) {
        lo = mid;
      } else {
        hi = mid;
        at_hi = std::move(hi_outcome);
      }
    }
    int breaking = hi;
    if (lo == 0) {
      // Not even one fits: do the others fit without this model at all?
      CTXPOOL_ASSIGN_OR_RETURN(bool ok, fits(0));
      if (!ok) {
        s.max = -1;
        at_hi = std::move(hi_outcome);
        breaking = 0;
      }
    }
    if (s.max >= 0) s.max = lo;
    // The failing plan, replayed to its end for its count of OOMs (the
    // search stopped at the first).
    if (at_hi) {
      const PlanRun* run = &run_of(*at_hi);
      std::optional<PlanOutcome> full;
      if (run->result.stopped_early) {
        CTXPOOL_ASSIGN_OR_RETURN(full, replay(breaking, /*stop=*/false));
        run = &run_of(*full);
      }
      if (run->result.first_oom) {
        s.breaker =
            TenantName(models, with(breaking), run->result.first_oom->tenant);
        s.breaker_message = FirstLine(run->result.first_oom->message);
      }
      s.breaker_ooms = run->result.ooms;
    } else {
      s.refused = true;
      s.breaker = out.model;
      s.breaker_message = RefusePlan(models, with(breaking), schedule,
                                     device.spec.capacity_bytes,
                                     device.spec.context_overhead_bytes);
    }
  }
  return out;
}

// ---- --suggest-budgets -----------------------------------------------------

// The backing DeviceContext will use (CTXPOOL_BACKING, which --config's
// backing= sets for this process).
BackingMode EffectiveBacking() {
  const std::string b = absl::AsciiStrToLower(GetOption(OptionId::kBacking));
  if (b == "classic") return BackingMode::kClassic;
  if (b == "expandable") return BackingMode::kExpandable;
  return BackingMode::kAuto;
}

struct Suggestion {
  std::string model;
  std::uint64_t min = 0, high = 0, max = 0;
  std::uint64_t peak_live = 0, peak_charged = 0, frontier = 0;
  // The plan replayed with max one granule lower: this model's allocations
  // its max rejected (-1: not replayed).
  std::int64_t tighter_failures = 0;
  // Non-empty: the model does not fit the device alone, so it has no
  // suggestion (the fields above are 0) and keeps the budget it was given.
  std::string error;
};

struct Suggestions {
  std::vector<Suggestion> models;
  bool min_fits = true;
  std::uint64_t min_sum = 0;
  PlanOutcome verified;
};

absl::StatusOr<Suggestions> SuggestBudgets(
    const std::vector<ModelArg>& models, const Plan& base,
    const Schedule& schedule, const Device& device,
    const DeviceAllocatorOptions& allocator) {
  Suggestions out;
  Plan suggested = base;
  for (std::size_t m = 0; m < models.size(); ++m) {
    Suggestion s;
    s.model = models[m].name;
    s.peak_live = models[m].peak_live;
    // Alone on the device, no budget: what the session counts.
    Plan alone;
    alone.replicas.assign(models.size(), 0);
    alone.replicas[m] = 1;
    alone.budgets.assign(models.size(), SessionOptions{});
    RunWhat what;
    what.today = false;
    CTXPOOL_ASSIGN_OR_RETURN(PlanOutcome o, RunPlan(models, alone, Schedule{},
                                                    device, allocator, what));
    // A model that fits nowhere has no suggestion (a result, not an error).
    auto none = [&](std::string why) {
      s.error = std::move(why);
      s.tighter_failures = -1;
      out.models.push_back(std::move(s));
    };
    if (!o.ctxpool.fits()) {
      none(absl::StrCat("does not fit on the device even alone: ",
                        o.ctxpool.result.first_oom
                            ? FirstLine(o.ctxpool.result.first_oom->message)
                            : ""));
      continue;
    }
    for (const auto& [tenant, t] : o.ctxpool.result.tenants) {
      s.peak_charged = std::max(s.peak_charged, t.peak_charged);
    }
    s.max = RoundUpGranule(s.peak_charged);
    // The frontier, on this allocator's backing.
    ReplayConfig rc;
    rc.device = device.preset;
    rc.capacity_bytes = device.spec.capacity_bytes;
    rc.allocator = allocator;
    rc.allocator.backing = EffectiveBacking();  // as DeviceContext's
    absl::StatusOr<CapacitySearch> frontier =
        FindMinCapacity(models[m].trace, rc);
    if (!frontier.ok() &&
        frontier.status().code() == absl::StatusCode::kResourceExhausted) {
      none(absl::StrCat("no OOM frontier: ", frontier.status().message()));
      continue;
    }
    CTXPOOL_RETURN_IF_ERROR(frontier.status());
    const CapacitySearch& f = *frontier;
    s.frontier = f.min_capacity_bytes > f.context_overhead_bytes
                     ? f.min_capacity_bytes - f.context_overhead_bytes
                     : 0;
    s.high = RoundUpGranule(std::max(s.frontier, s.peak_live));
    s.min = std::min(RoundUpGranule(models[m].median_live), s.high);
    SessionOptions b;
    b.min_bytes = s.min;
    b.high_bytes = s.high;
    b.max_bytes = s.max;
    suggested.budgets[m] = b;
    out.models.push_back(s);
  }
  out.min_sum = MinSumAtOnce(models, suggested, schedule);
  RunWhat what;
  what.today = false;
  CTXPOOL_ASSIGN_OR_RETURN(out.verified, RunPlan(models, suggested, schedule,
                                                 device, allocator, what));
  out.min_fits = out.min_sum + out.verified.ctxpool.result.context_bytes <=
                 out.verified.capacity;
  for (std::size_t m = 0; m < models.size(); ++m) {
    if (!out.models[m].error.empty()) continue;
    Plan tighter = suggested;
    tighter.budgets[m].max_bytes = out.models[m].max - kGranule;
    if (*tighter.budgets[m].max_bytes == 0) {
      out.models[m].tighter_failures = -1;  // a max of 0 means no limit
      continue;
    }
    if (*tighter.budgets[m].min_bytes > *tighter.budgets[m].max_bytes) {
      tighter.budgets[m].min_bytes = tighter.budgets[m].max_bytes;
    }
    CTXPOOL_ASSIGN_OR_RETURN(PlanOutcome o, RunPlan(models, tighter, schedule,
                                                    device, allocator, what));
    // Rejections by the model's max, not device OOMs: those the plan may
    // have without the tightening too.
    for (const auto& [tenant, t] : o.ctxpool.result.tenants) {
      if (ModelOfTenant(tighter, tenant) == static_cast<int>(m)) {
        out.models[m].tighter_failures += t.budget_rejections;
      }
    }
  }
  return out;
}

// ---- Output ----------------------------------------------------------------

// `text` as one shell word: as is when it holds only safe characters, else
// in single quotes.
std::string ShellQuote(const std::string& text) {
  const bool safe =
      !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) ||
               std::strchr("_-.,/:=+@%", c) != nullptr;
      });
  if (safe) return text;
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string Signed(std::uint64_t capacity, std::uint64_t used) {
  return used <= capacity ? FormatBytes(capacity - used)
                          : absl::StrCat("-", FormatBytes(used - capacity));
}

struct ModelRow {
  std::int64_t failed = 0, rejections = 0;
  std::uint64_t peak_mapped = 0;  // largest of its replicas
  std::uint64_t peak_charged = 0;
};

std::vector<ModelRow> ModelRows(const std::vector<ModelArg>& models,
                                const Plan& plan, const ModeResult& r) {
  std::vector<ModelRow> rows(models.size());
  for (const auto& [tenant, t] : r.tenants) {
    const int m = ModelOfTenant(plan, tenant);
    if (m < 0) continue;
    rows[m].failed += t.failed;
    rows[m].rejections += t.budget_rejections;
    rows[m].peak_mapped = std::max(rows[m].peak_mapped, t.peak_mapped);
    rows[m].peak_charged = std::max(rows[m].peak_charged, t.peak_charged);
  }
  return rows;
}

// `sampled`: per-tenant samples were taken (--svg), so the sampled peaks of
// mapped bytes are known; else they are null. Today's replicas have no
// session, hence no charged bytes (null).
std::string ModeJson(const std::vector<ModelArg>& models, const Plan& plan,
                     const PlanRun& run, std::uint64_t capacity, bool sampled) {
  const ModeResult& r = run.result;
  std::string oom = "null";
  if (r.first_oom) {
    const int m = ModelOfTenant(plan, r.first_oom->tenant);
    oom = absl::StrCat(
        "{\"replica\":",
        JsonString(TenantName(models, plan, r.first_oom->tenant)),
        ",\"model\":", JsonString(m >= 0 ? models[m].name : ""),
        ",\"event\":", r.first_oom->event, ",\"bytes\":", r.first_oom->bytes,
        ",\"message\":", JsonString(r.first_oom->message), "}");
  }
  std::string per_model;
  const std::vector<ModelRow> rows = ModelRows(models, plan, r);
  for (std::size_t m = 0; m < models.size(); ++m) {
    absl::StrAppend(
        &per_model, m ? "," : "", "{\"name\":", JsonString(models[m].name),
        ",\"replicas\":", plan.replicas[m],
        ",\"failed_allocations\":", rows[m].failed,
        ",\"budget_rejections\":", rows[m].rejections,
        ",\"sampled_peak_mapped_bytes\":",
        sampled ? absl::StrCat(rows[m].peak_mapped) : "null",
        ",\"peak_charged_bytes\":",
        r.mode == "ctxpool" ? absl::StrCat(rows[m].peak_charged) : "null", "}");
  }
  return absl::StrCat(
      "{\"mode\":", JsonString(r.mode),
      ",\"fits\":", run.fits() ? "true" : "false",
      ",\"peak_device_bytes\":", r.peak_device, ",\"headroom_bytes\":",
      static_cast<std::int64_t>(capacity) -
          static_cast<std::int64_t>(r.peak_device),
      ",\"contexts\":", r.contexts, ",\"context_bytes\":", r.context_bytes,
      ",\"ooms\":", r.ooms,
      ",\"stopped_early\":", r.stopped_early ? "true" : "false",
      ",\"failed_loads\":", r.failed_loads,
      ",\"budget_rejections\":", r.budget_rejections, ",\"first_oom\":", oom,
      ",\"models\":[", per_model, "]}");
}

void PrintModes(const std::vector<ModelArg>& models, const Plan& plan,
                const PlanOutcome& o) {
  const char* kFmt = "%-8s %5s %16s %14s %9s %15s %6s  %s\n";
  std::printf(kFmt, "mode", "fits", "peak device mem", "headroom", "contexts",
              "context memory", "OOMs", "first OOM");
  for (const PlanRun* run : {&o.today, &o.ctxpool}) {
    const ModeResult& r = run->result;
    std::string first = "-";
    if (r.first_oom) {
      first = absl::StrFormat(
          "%s, event %d, %s: %s", TenantName(models, plan, r.first_oom->tenant),
          r.first_oom->event, FormatBytes(r.first_oom->bytes),
          FirstLine(r.first_oom->message));
      if (first.size() > 160) first = first.substr(0, 157) + "...";
    }
    std::printf(kFmt, r.mode.c_str(), run->fits() ? "yes" : "NO",
                FormatBytes(r.peak_device).c_str(),
                Signed(o.capacity, r.peak_device).c_str(),
                absl::StrCat(r.contexts).c_str(),
                FormatBytes(r.context_bytes).c_str(),
                absl::StrCat(r.ooms, r.stopped_early ? "+" : "").c_str(),
                first.c_str());
  }
  if (o.today.result.stopped_early || o.ctxpool.result.stopped_early) {
    std::printf(
        "(+: the replay stopped after %d failed allocations; its figures "
        "cover the events up to there)\n",
        static_cast<int>(kMaxCountedOoms));
  }
}

SvgPlot StackedPlot(const std::vector<ModelArg>& models, const Plan& plan,
                    const ModeResult& r, std::uint64_t capacity,
                    const std::string& title) {
  constexpr double kGiBd = 1024.0 * 1024 * 1024;
  SvgPlot p;
  p.title = title;
  p.x_label = "merged trace event (#)";
  p.y_label = "device memory (GiB)";
  p.stacked = true;
  p.y_max =
      static_cast<double>(std::max(capacity, r.peak_device)) * 1.05 / kGiBd;
  std::vector<SvgSeries> per_model(models.size());
  for (std::size_t m = 0; m < models.size(); ++m) {
    per_model[m].name = models[m].name;
  }
  SvgSeries contexts{"contexts", {}}, rest{"cached, shared", {}};
  for (const Sample& s : r.samples) {
    const double x = static_cast<double>(s.event);
    std::vector<std::uint64_t> sum(models.size(), 0);
    std::uint64_t owned = 0;
    for (const auto& [tenant, bytes] : s.tenants) {
      const int m = ModelOfTenant(plan, tenant);
      if (m >= 0) sum[m] += bytes;
      owned += bytes;
    }
    for (std::size_t m = 0; m < models.size(); ++m) {
      per_model[m].points.emplace_back(x, static_cast<double>(sum[m]) / kGiBd);
    }
    const std::uint64_t ctx = r.context_bytes;
    contexts.points.emplace_back(x, static_cast<double>(ctx) / kGiBd);
    const std::uint64_t other =
        s.device > ctx + owned ? s.device - ctx - owned : 0;
    rest.points.emplace_back(x, static_cast<double>(other) / kGiBd);
  }
  p.series.push_back(std::move(contexts));
  for (SvgSeries& s : per_model) p.series.push_back(std::move(s));
  p.series.push_back(std::move(rest));
  SvgSeries cap{"device capacity", {}};
  cap.dashed = true;
  if (!r.samples.empty()) {
    cap.points = {{static_cast<double>(r.samples.front().event),
                   static_cast<double>(capacity) / kGiBd},
                  {static_cast<double>(r.samples.back().event),
                   static_cast<double>(capacity) / kGiBd}};
  }
  p.series.push_back(std::move(cap));
  return p;
}

}  // namespace

int RunPlan(int argc, char** argv) {
  Args a;
  if (int rc = ParseArgs(argc, argv, &a); rc != 0) return rc < 0 ? 0 : rc;

  Device device;
  device.gpu = a.gpu;
  if (!a.gpu) {
    absl::StatusOr<SimDeviceSpec> spec = SimDevicePreset(a.device);
    if (!spec.ok()) return UsageError(std::string(spec.status().message()));
    device.spec = *spec;
    device.preset = a.device;
    if (a.capacity != 0) device.spec.capacity_bytes = a.capacity;
  }
  for (ModelArg& m : a.models) {
    absl::Status s = LoadModel(m);
    // Escaped: a binary file's bytes may be in the message, and it stays
    // one line.
    if (!s.ok()) return UsageError(Printable(s.message()));
  }
  // DeviceContext takes its backing from the option table: --config's
  // backing= goes there.
  DeviceAllocatorOptions allocator = a.allocator;
  if (allocator.backing != BackingMode::kAuto) {
    absl::Status set = SetOption(
        OptionId::kBacking,
        allocator.backing == BackingMode::kClassic ? "classic" : "expandable");
    if (!set.ok()) return UsageError(std::string(set.message()));
  }
  Plan plan;
  for (const ModelArg& m : a.models) {
    plan.replicas.push_back(m.replicas);
    SessionOptions b;
    b.min_bytes = m.min.value_or(0);
    b.high_bytes = m.high.value_or(0);
    b.max_bytes = m.max.value_or(0);
    plan.budgets.push_back(b);
  }
  if (!a.gpu) {
    const std::string why =
        RefusePlan(a.models, plan, a.schedule, device.spec.capacity_bytes,
                   device.spec.context_overhead_bytes);
    if (!why.empty()) return UsageError(why);
  } else if (PlanEvents(a.models, plan, a.schedule) > kMaxPlanEvents) {
    return UsageError(RefusePlan(a.models, plan, a.schedule, UINT64_MAX, 0));
  }

  RunWhat what;
  what.samples = !a.svg.empty();
  absl::StatusOr<PlanOutcome> outcome =
      RunPlan(a.models, plan, a.schedule, device, allocator, what);
  if (!outcome.ok()) {
    std::fprintf(stderr, "ctxpool plan: %s\n",
                 outcome.status().ToString().c_str());
    return 1;
  }
  if (a.gpu) {
    const std::string why =
        RefusePlan(a.models, plan, a.schedule, outcome->capacity,
                   outcome->ctxpool.result.context_bytes);
    if (!why.empty()) return UsageError(why);
  }

  std::vector<ReplicaSearch> searches;
  if (a.max_replicas) {
    for (std::size_t m = 0; m < a.models.size(); ++m) {
      if (!a.max_replicas_model.empty() &&
          a.models[m].name != a.max_replicas_model) {
        continue;
      }
      absl::StatusOr<ReplicaSearch> s =
          SearchReplicas(a.models, plan, m, a.schedule, device, allocator);
      if (!s.ok()) {
        std::fprintf(stderr, "ctxpool plan: --max-replicas: %s\n",
                     s.status().ToString().c_str());
        return 1;
      }
      searches.push_back(std::move(s).value());
    }
  }
  std::optional<Suggestions> suggestions;
  if (a.suggest) {
    absl::StatusOr<Suggestions> s =
        SuggestBudgets(a.models, plan, a.schedule, device, allocator);
    if (!s.ok()) {
      std::fprintf(stderr, "ctxpool plan: --suggest-budgets: %s\n",
                   s.status().ToString().c_str());
      return 1;
    }
    suggestions = std::move(s).value();
  }

  if (!a.svg.empty()) {
    SvgOptions svg;
    svg.title = absl::StrCat("ctxpool plan: ", outcome->device);
    std::vector<std::string> names;
    for (std::size_t m = 0; m < a.models.size(); ++m) {
      names.push_back(absl::StrCat(a.models[m].name, " x", plan.replicas[m]));
    }
    svg.subtitle = absl::StrCat(absl::StrJoin(names, ", "), "; schedule ",
                                a.schedule.ToString());
    const std::string text = RenderMemoryMapSvg(
        {},
        {StackedPlot(a.models, plan, outcome->today.result, outcome->capacity,
                     "today: a context and a cache per replica"),
         StackedPlot(a.models, plan, outcome->ctxpool.result, outcome->capacity,
                     "ctxpool: one context, a session per replica")},
        svg);
    absl::Status w = WriteFile(a.svg, text);
    if (!w.ok()) {
      std::fprintf(stderr, "ctxpool plan: %s\n", w.ToString().c_str());
      return 1;
    }
  }

  if (a.json) {
    std::string models_json;
    auto opt = [](const std::optional<std::uint64_t>& v) {  // null: not given
      return v ? absl::StrCat(*v) : std::string("null");
    };
    for (std::size_t m = 0; m < a.models.size(); ++m) {
      const ModelArg& x = a.models[m];
      absl::StrAppend(
          &models_json, m ? "," : "", "{\"name\":", JsonString(x.name),
          ",\"trace\":", JsonString(x.trace_spec), ",\"replicas\":", x.replicas,
          ",\"events\":", x.trace.size(), ",\"peak_live_bytes\":", x.peak_live,
          ",\"streams\":", x.streams, ",\"min_bytes\":", opt(x.min),
          ",\"high_bytes\":", opt(x.high), ",\"max_bytes\":", opt(x.max), "}");
    }
    std::string out =
        absl::StrCat("{\"device\":", JsonString(outcome->device),
                     ",\"driver\":", JsonString(a.gpu ? "cuda" : "sim"),
                     ",\"capacity_bytes\":", outcome->capacity,
                     ",\"schedule\":", JsonString(a.schedule.ToString()),
                     ",\"events\":", outcome->events, ",\"peak_live_bytes\":",
                     (outcome->ctxpool.ran ? outcome->ctxpool : outcome->today)
                         .result.peak_live,
                     ",\"models\":[", models_json, "],\"modes\":[",
                     ModeJson(a.models, plan, outcome->today, outcome->capacity,
                              what.samples),
                     ",",
                     ModeJson(a.models, plan, outcome->ctxpool,
                              outcome->capacity, what.samples),
                     "]");
    if (a.max_replicas) {
      out += ",\"max_replicas\":[";
      for (std::size_t i = 0; i < searches.size(); ++i) {
        const ReplicaSearch& s = searches[i];
        auto side = [](const ReplicaSearch::Side& x) {
          return absl::StrCat(
              "{\"max\":",
              x.max < 0 ? std::string("null") : absl::StrCat(x.max),
              ",\"at_least\":", x.at_least ? "true" : "false",
              ",\"limit\":", x.at_least ? JsonString(x.limit) : "null",
              ",\"refused\":", x.refused ? "true" : "false",
              ",\"every_count_replayed\":", x.bisected ? "false" : "true",
              ",\"breaker\":", JsonString(x.breaker),
              // The N + 1 plan's OOMs: null when it was not replayed (the
              // search's limit, or refused by the min sum); with max null
              // the plan without the model is the one replayed.
              ",\"ooms_at_max_plus_1\":",
              x.max >= 0 && !x.at_least && !x.refused
                  ? absl::StrCat(x.breaker_ooms)
                  : std::string("null"),
              ",\"ooms_without_model\":",
              x.max < 0 ? absl::StrCat(x.breaker_ooms) : std::string("null"),
              ",\"message\":", JsonString(x.breaker_message),
              ",\"replays\":", x.replays, "}");
        };
        absl::StrAppend(&out, i ? "," : "", "{\"model\":", JsonString(s.model),
                        ",\"ctxpool\":", side(s.ctxpool),
                        ",\"today\":", side(s.today), "}");
      }
      out += "]";
    }
    if (suggestions) {
      const ModeResult& v = suggestions->verified.ctxpool.result;
      out += ",\"suggested_budgets\":{\"models\":[";
      for (std::size_t i = 0; i < suggestions->models.size(); ++i) {
        const Suggestion& s = suggestions->models[i];
        const bool ok = s.error.empty();
        auto bytes = [ok](std::uint64_t v) {
          return ok ? absl::StrCat(v) : std::string("null");
        };
        absl::StrAppend(
            &out, i ? "," : "", "{\"model\":", JsonString(s.model),
            ",\"error\":", ok ? "null" : JsonString(s.error),
            ",\"min_bytes\":", bytes(s.min), ",\"high_bytes\":", bytes(s.high),
            ",\"max_bytes\":", bytes(s.max),
            ",\"peak_live_bytes\":", s.peak_live,
            ",\"peak_charged_bytes\":", bytes(s.peak_charged),
            ",\"frontier_bytes\":", bytes(s.frontier),
            ",\"rejections_with_max_minus_granule\":",
            s.tighter_failures < 0 ? std::string("null")
                                   : absl::StrCat(s.tighter_failures),
            "}");
      }
      absl::StrAppend(
          &out, "],\"min_sum_bytes\":", suggestions->min_sum,
          ",\"min_fits\":", suggestions->min_fits ? "true" : "false",
          ",\"verified\":{\"fits\":",
          suggestions->verified.ctxpool.fits() ? "true" : "false",
          ",\"ooms\":", v.ooms, ",\"budget_rejections\":", v.budget_rejections,
          "}}");
    }
    absl::StrAppend(
        &out, ",\"svg\":", a.svg.empty() ? "null" : JsonString(a.svg), "}\n");
    std::fputs(out.c_str(), stdout);
    return 0;
  }

  std::printf("device: %s, %s; schedule %s; %d events\n",
              outcome->device.c_str(), FormatBytes(outcome->capacity).c_str(),
              a.schedule.ToString().c_str(), static_cast<int>(outcome->events));
  const char* kModelFmt = "  %-16s %8s %12s %8s  %s\n";
  std::printf(kModelFmt, "model", "replicas", "peak live", "streams", "trace");
  for (const ModelArg& m : a.models) {
    std::printf(kModelFmt, m.name.c_str(), absl::StrCat(m.replicas).c_str(),
                FormatBytes(m.peak_live).c_str(),
                absl::StrCat(m.streams).c_str(), m.trace_spec.c_str());
  }
  const PlanRun& any = outcome->ctxpool.ran ? outcome->ctxpool : outcome->today;
  std::printf(
      "  together: peak live %s (requested bytes live at once, "
      "the same in both modes)\n\n",
      FormatBytes(any.result.peak_live).c_str());
  PrintModes(a.models, plan, *outcome);
  std::printf(
      "\npeak device mem: contexts + allocator memory (segments or mapped "
      "granules, and cached\ngranules), the most held at once; headroom: "
      "capacity - peak.\n");
  if (!searches.empty()) {
    std::printf(
        "\nmax replicas (the others as given; every count up to it and the "
        "next one replayed):\n");
    const char* kFmt = "  %-16s %8s %8s  %s\n";
    std::printf(kFmt, "model", "ctxpool", "today",
                "one more replica breaks it");
    for (const ReplicaSearch& s : searches) {
      const ReplicaSearch::Side& c = s.ctxpool;
      std::string why;
      if (c.at_least) {
        why = absl::StrCat("ctxpool: still fits: ", c.limit);
      } else if (c.max < 0) {
        why = absl::StrFormat(
            "ctxpool: the others do not fit even without %s (%d OOMs, first "
            "in %s)",
            s.model, c.breaker_ooms, c.breaker);
      } else if (c.refused) {
        why = absl::StrCat("ctxpool: refused: ", c.breaker_message);
      } else {
        why = absl::StrFormat("ctxpool: %d OOMs, first in %s: %s",
                              c.breaker_ooms, c.breaker, c.breaker_message);
      }
      if (why.size() > 150) why = why.substr(0, 147) + "...";
      auto count = [](const ReplicaSearch::Side& x) {
        if (x.max < 0) return std::string("none");
        return absl::StrCat(x.max, x.at_least ? "+" : "",
                            x.bisected ? "*" : "");
      };
      std::printf(kFmt, s.model.c_str(), count(s.ctxpool).c_str(),
                  count(s.today).c_str(), why.c_str());
    }
    bool any_bisected = false;
    for (const ReplicaSearch& s : searches) {
      any_bisected |= s.ctxpool.bisected || s.today.bisected;
    }
    if (any_bisected) {
      std::printf(
          "  *: above %d replicas the count was bisected: the counts between "
          "%d and it were\n     not each replayed\n",
          kLinearScan, kLinearScan);
    }
  }
  if (suggestions) {
    std::printf(
        "\nsuggested budgets (per replica; max on charged bytes, min "
        "and high on mapped bytes):\n");
    const char* kFmt = "  %-16s %11s %11s %11s  %s\n";
    std::printf(kFmt, "model", "min", "high", "max", "max - 2 MiB");
    for (const Suggestion& s : suggestions->models) {
      if (!s.error.empty()) {
        std::string why = s.error;
        if (why.size() > 120) why = why.substr(0, 117) + "...";
        std::printf("  %-16s none: %s\n", s.model.c_str(), why.c_str());
        continue;
      }
      std::printf(kFmt, s.model.c_str(), FormatBytes(s.min).c_str(),
                  FormatBytes(s.high).c_str(), FormatBytes(s.max).c_str(),
                  s.tighter_failures < 0 ? "-"
                                         : absl::StrFormat("%d rejected by max",
                                                           s.tighter_failures)
                                               .c_str());
    }
    const ModeResult& v = suggestions->verified.ctxpool.result;
    std::printf(
        "  verified: the plan with these budgets %s (%d OOMs, %d budget "
        "rejections); min sum %s%s\n",
        suggestions->verified.ctxpool.fits() ? "fits" : "does NOT fit",
        static_cast<int>(v.ooms), static_cast<int>(v.budget_rejections),
        FormatBytes(suggestions->min_sum).c_str(),
        suggestions->min_fits ? "" : " (more than the device holds)");
    std::printf("  as flags:\n");
    for (std::size_t m = 0; m < a.models.size(); ++m) {
      const Suggestion& s = suggestions->models[m];
      if (!s.error.empty()) continue;
      std::printf(
          "    --model %s\n",
          ShellQuote(absl::StrFormat(
                         "%s=%s,replicas=%d,min=%lluMiB,high=%lluMiB,"
                         "max=%lluMiB",
                         s.model, a.models[m].trace_spec, a.models[m].replicas,
                         static_cast<unsigned long long>(s.min >> 20),
                         static_cast<unsigned long long>(s.high >> 20),
                         static_cast<unsigned long long>(s.max >> 20)))
              .c_str());
    }
  }
  if (!a.svg.empty()) std::printf("\nmemory over time: %s\n", a.svg.c_str());
  return 0;
}

}  // namespace ctxpool::tool
