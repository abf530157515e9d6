#include "ctxpool/trace/replay.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/trace_io.h"
#include "ctxpool/trace/workloads.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TraceEvent Alloc(std::uint64_t ptr, std::uint64_t size, std::uint64_t s = 0) {
  return {.op = TraceOp::kAlloc, .ptr = ptr, .size = size, .stream = s};
}
TraceEvent Free(std::uint64_t ptr, std::uint64_t size, std::uint64_t s = 0) {
  return {.op = TraceOp::kFree, .ptr = ptr, .size = size, .stream = s};
}

TEST(Replay, CountsOpsLiveAndReserved) {
  Trace t;
  t.Append(Alloc(1, 100 << 20));
  t.Append(Alloc(2, 4096));
  t.Append({.op = TraceOp::kSegmentMap, .ptr = 9, .size = 2 << 20});
  t.Append(Free(1, 100 << 20));
  t.Append(Alloc(3, 50 << 20));  // fits in the freed 100 MiB: a cache hit
  absl::StatusOr<ReplayResult> r = Replay(t, {});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ops, 4u);
  EXPECT_EQ(r->allocs, 3u);
  EXPECT_EQ(r->frees, 1u);
  EXPECT_EQ(r->skipped_events, 1u);
  EXPECT_EQ(r->ooms, 0u);
  EXPECT_FALSE(r->first_oom.has_value());
  EXPECT_EQ(r->peak_live_bytes, (100u << 20) + 4096u);
  EXPECT_EQ(r->end_live_bytes, (50u << 20) + 4096u);
  EXPECT_GE(r->peak_reserved_bytes, r->peak_live_bytes);
  // One large segment for 100 MiB and one small segment for 4 KiB; the
  // 50 MiB request reuses the cached large block.
  EXPECT_EQ(r->upstream_allocations, 2u);
  EXPECT_GE(r->cache_hits, 1u);
  EXPECT_EQ(r->wall_alloc.count, 3u);
  EXPECT_EQ(r->wall_free.count, 1u);
  EXPECT_FALSE(r->samples.empty());
}

// Two replays of one trace and configuration did the same (wall clocks
// aside).
void ExpectSameOutcome(const ReplayResult& a, const ReplayResult& b) {
  EXPECT_EQ(a.ops, b.ops);
  EXPECT_EQ(a.peak_live_bytes, b.peak_live_bytes);
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);
  EXPECT_EQ(a.upstream_allocations, b.upstream_allocations);
  EXPECT_EQ(a.cache_hits, b.cache_hits);
  EXPECT_EQ(a.ooms, b.ooms);
  EXPECT_EQ(a.simulated_time_ns, b.simulated_time_ns);
  EXPECT_EQ(a.driver_calls, b.driver_calls);
  EXPECT_EQ(a.sim_alloc.p99, b.sim_alloc.p99);
  EXPECT_EQ(a.sim_alloc.max, b.sim_alloc.max);
  ASSERT_EQ(a.samples.size(), b.samples.size());
  for (std::size_t i = 0; i < a.samples.size(); ++i) {
    EXPECT_EQ(a.samples[i].reserved_bytes, b.samples[i].reserved_bytes);
    EXPECT_EQ(a.samples[i].largest_free_bytes, b.samples[i].largest_free_bytes);
  }
}

TEST(Replay, IsDeterministic) {
  const Trace t =
      MultiStream({.seed = 11, .streams = 3, .ops_per_stream = 600});
  ReplayConfig c;
  c.device = "a10-24gb";
  absl::StatusOr<ReplayResult> a = Replay(t, c);
  absl::StatusOr<ReplayResult> b = Replay(t, c);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSameOutcome(*a, *b);
  // The trace's peak live is the allocator-independent number.
  EXPECT_EQ(a->peak_live_bytes, Summarize(t).peak_live_bytes);
  // The JSON form carries the required keys.
  const std::string json = ReplayResultToJson(*a);
  for (const char* key :
       {"\"ops\"", "\"peak_live_bytes\"", "\"peak_reserved_bytes\"", "\"ooms\"",
        "\"upstream_allocations\"", "\"wall_time_ns\"", "\"p999_ns\""}) {
    EXPECT_THAT(json, HasSubstr(key));
  }
}

TEST(Replay, CostModelGivesSimulatedLatencyPercentiles) {
  const Trace t =
      MixedSizes({.seed = 2, .ops = 2000, .max_live_bytes = 2ull << 30});
  ReplayConfig c;
  c.cost_model = true;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->sim_alloc.count, r->allocs);
  // Most allocations hit the cache (no driver call, zero simulated cost);
  // the ones that map a segment pay cuMemAlloc: jitter is visible.
  EXPECT_EQ(r->sim_alloc.p50, 0);
  EXPECT_GT(r->sim_alloc.max, 0);
  EXPECT_LE(r->sim_alloc.p50, r->sim_alloc.p99);
  EXPECT_LE(r->sim_alloc.p99, r->sim_alloc.p999);
  EXPECT_LE(r->sim_alloc.p999, r->sim_alloc.max);
  EXPECT_GT(r->simulated_time_ns, 0);

  c.cost_model = false;
  absl::StatusOr<ReplayResult> free_run = Replay(t, c);
  ASSERT_TRUE(free_run.ok());
  EXPECT_EQ(free_run->sim_alloc.count, 0u);
  EXPECT_EQ(free_run->peak_reserved_bytes, r->peak_reserved_bytes);
}

TEST(Replay, ReportsTheFirstOomAndContinuesOrStops) {
  Trace t;
  t.Append(Alloc(1, 6ull << 30));
  t.Append(Alloc(2, 6ull << 30));  // the second does not fit in 8 GiB
  t.Append(Alloc(3, 1 << 20));
  t.Append(Free(2, 6ull << 30));  // free of the failed allocation: skipped
  t.Append(Free(1, 6ull << 30));
  ReplayConfig c;
  c.capacity_bytes = 8ull << 30;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ooms, 1u);
  ASSERT_TRUE(r->first_oom.has_value());
  EXPECT_EQ(r->first_oom->event_index, 1u);
  EXPECT_EQ(r->first_oom->requested_bytes, 6ull << 30);
  EXPECT_EQ(r->first_oom->live_bytes, 6ull << 30);
  EXPECT_EQ(r->skipped_frees, 1u);
  EXPECT_EQ(r->allocs, 2u);
  EXPECT_EQ(r->frees, 1u);
  EXPECT_FALSE(r->stopped_at_oom);

  c.stop_at_first_oom = true;
  r = Replay(t, c);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->stopped_at_oom);
  EXPECT_EQ(r->ops, 2u);
}

// Expandable: the first OOM says what the allocator held unmapped in its
// granule cache, which its reserved bytes leave out: with it, every byte of
// the device is accounted for.
TEST(Replay, FirstOomCountsTheGranuleCache) {
  Trace t;
  for (std::uint64_t i = 1; i <= 6; ++i) t.Append(Alloc(i, 501ull << 20));
  t.Append(Free(2, 501ull << 20));  // whole free granules between live blocks
  t.Append(Free(4, 501ull << 20));
  t.Append(Alloc(7, 2ull << 30));  // more than the holes and the rest
  ReplayConfig c;
  c.capacity_bytes = 4ull << 30;
  c.allocator.backing = BackingMode::kExpandable;
  c.stop_at_first_oom = true;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->first_oom.has_value());
  EXPECT_EQ(r->first_oom->event_index, 8u);
  EXPECT_GT(r->first_oom->cached_bytes, 0u);
  EXPECT_LE(r->first_oom->reserved_bytes + r->first_oom->cached_bytes +
                r->context_overhead_bytes,
            c.capacity_bytes);
  EXPECT_THAT(r->first_oom->message, HasSubstr("granule cache held"));
  EXPECT_THAT(ReplayResultToJson(*r),
              HasSubstr(absl::StrCat("\"cached_bytes\": ",
                                     r->first_oom->cached_bytes)));
  EXPECT_THAT(ReplayResultToText(*r),
              HasSubstr(absl::StrCat(FormatBytes(r->first_oom->cached_bytes),
                                     " cached")));
}

TEST(Replay, RejectsFreeOfUnknownPointerWithEventIndex) {
  Trace t;
  t.Append(Alloc(1, 512));
  t.Append(Free(2, 512));
  absl::StatusOr<ReplayResult> r = Replay(t, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(),
              HasSubstr("event 1: free of unknown pointer 0x2"));
}

TEST(Replay, UnknownPresetIsNotFound) {
  ReplayConfig c;
  c.device = "gtx-9000";
  EXPECT_EQ(Replay(Trace(), c).status().code(), absl::StatusCode::kNotFound);
}

TEST(Replay, OnAGivenDriverWithSeveralStreams) {
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  const Trace t = MultiStream({.seed = 1, .streams = 4, .ops_per_stream = 200});
  ReplayConfig c;
  ASSERT_TRUE(ParseAllocatorConfig("max_split_size=64MiB", &c.allocator).ok());
  absl::StatusOr<ReplayResult> r = ReplayOnDriver(t, *sim, 0, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ooms, 0u);
  EXPECT_EQ(r->ops, Summarize(t).allocs + Summarize(t).frees);
  // Everything the replay made on the driver is gone again.
  EXPECT_EQ(sim->misuse_count(), 0u)
      << ::testing::PrintToString(sim->misuse_log());
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  EXPECT_EQ(sim->used_bytes(0), 0u);
}

TraceEvent TrimEvent() { return {.op = TraceOp::kTrim}; }

TEST(Replay, MeasuresReservedMinusLiveAtTrimPoints) {
  // Stream 1 keeps 3 MiB live. With single-granule units the granules under
  // it (the second one half used) stay mapped and the freed 5 MiB is
  // unmapped by Trim.
  Trace t;
  t.Append(Alloc(1, 3 << 20, 1));
  t.Append(Alloc(2, 5 << 20, 1));
  t.Append(Free(2, 5 << 20, 1));
  t.Append(TrimEvent());
  ReplayConfig c;
  c.allocator.backing = BackingMode::kExpandable;
  c.allocator.vmm_unit_divisor = 0;
  c.replay_trims = true;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->trims, 1u);
  ASSERT_TRUE(r->worst_trim_point.has_value());
  EXPECT_EQ(*r->worst_trim_point, 3u);
  EXPECT_EQ(r->end_reserved_bytes, 4u << 20);
  EXPECT_EQ(r->max_trim_residual_bytes, 1u << 20);
  EXPECT_DOUBLE_EQ(r->max_trim_residual_granules_per_stream, 0.5);
  EXPECT_THAT(ReplayResultToText(*r), HasSubstr("trim points:      1;"));
  EXPECT_THAT(ReplayResultToJson(*r),
              HasSubstr("\"max_trim_residual_bytes\": 1048576"));

  // With the default units on this roomy device the 3 MiB request maps
  // ahead to 16 MiB as one unit (its pool's 20 MiB segment rounded down to a
  // power of two granules), which the live block keeps: Trim is exact to
  // the unit, not the granule.
  c.allocator.vmm_unit_divisor = DeviceAllocatorOptions().vmm_unit_divisor;
  r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->end_reserved_bytes, 16u << 20);
  EXPECT_EQ(r->max_trim_residual_bytes, 13u << 20);

  // Without replay_trims the kTrim event is skipped and nothing is measured.
  c.replay_trims = false;
  r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->trims, 0u);
  EXPECT_EQ(r->skipped_events, 1u);
  EXPECT_FALSE(r->worst_trim_point.has_value());
  EXPECT_THAT(ReplayResultToText(*r), Not(HasSubstr("trim points")));
  EXPECT_THAT(ReplayResultToJson(*r), HasSubstr("\"worst_trim_point\": null"));
}

// A server trims after each unload: in expandable mode what stays reserved is
// at most the partly used granule at the end of each stream's live blocks
// with single-granule units, and at most one unit with the default units
// (here the 16 MiB a weight tensor's run maps ahead).
TEST(Replay, ChurnTrimPointsLeaveAtMostOneGranulePerActiveStream) {
  const MultiModelChurnOptions o{.seed = 3,
                                 .models = 4,
                                 .cycles = 12,
                                 .resident = 2,
                                 .min_model_bytes = 24ull << 20,
                                 .max_model_bytes = 96ull << 20,
                                 .weight_tensors = 6,
                                 .requests_per_cycle = 3};
  const Trace t = MultiModelChurn(o);
  ReplayConfig c;
  c.allocator.backing = BackingMode::kExpandable;
  c.allocator.vmm_unit_divisor = 0;
  c.replay_trims = true;
  c.cost_model = false;
  c.wall_latency = false;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ooms, 0u);
  EXPECT_EQ(r->trims, static_cast<std::uint64_t>(o.cycles - o.resident));
  // Every trim point has a resident model, so the maximum ratio bounds the
  // residual at each of them.
  EXPECT_LE(r->max_trim_residual_granules_per_stream, 1.0)
      << "worst trim point: event " << r->worst_trim_point.value_or(0)
      << ", residual " << r->max_trim_residual_bytes;
  EXPECT_LE(r->max_trim_residual_bytes,
            static_cast<std::uint64_t>(o.resident) * (2u << 20));
  // Not trivially: resident weights end inside a granule.
  EXPECT_GT(r->max_trim_residual_bytes, 0u);

  c.allocator.vmm_unit_divisor = DeviceAllocatorOptions().vmm_unit_divisor;
  absl::StatusOr<ReplayResult> units = Replay(t, c);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_EQ(units->ooms, 0u);
  EXPECT_LE(units->max_trim_residual_granules_per_stream, 8.0)
      << "worst trim point: event " << units->worst_trim_point.value_or(0)
      << ", residual " << units->max_trim_residual_bytes;

  // Classic segments report the figure too (its size is not a target).
  c.allocator.backing = BackingMode::kClassic;
  absl::StatusOr<ReplayResult> classic = Replay(t, c);
  ASSERT_TRUE(classic.ok()) << classic.status();
  EXPECT_EQ(classic->trims, r->trims);
  EXPECT_TRUE(classic->worst_trim_point.has_value());
  EXPECT_THAT(ReplayResultToText(*classic), HasSubstr("trim points:"));
}

TEST(FindMinCapacity, FindsTheOomFrontier) {
  Trace t;
  t.Append(Alloc(1, 1ull << 30));
  t.Append(Alloc(2, 512ull << 20));
  t.Append(Free(1, 1ull << 30));
  t.Append(Alloc(3, 300ull << 20));
  ReplayConfig c;
  absl::StatusOr<CapacitySearch> s = FindMinCapacity(t, c);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->peak_live_bytes, (1ull << 30) + (512ull << 20));
  EXPECT_EQ(s->step_bytes, 2u << 20);
  EXPECT_GE(s->min_capacity_bytes,
            s->peak_live_bytes + s->context_overhead_bytes);
  EXPECT_EQ(s->min_capacity_bytes % s->step_bytes, 0u);
  // The frontier: it fits there and not one step below.
  c.capacity_bytes = s->min_capacity_bytes;
  EXPECT_EQ(Replay(t, c)->ooms, 0u);
  c.capacity_bytes = s->min_capacity_bytes - s->step_bytes;
  EXPECT_GT(Replay(t, c)->ooms, 0u);
}

TEST(ParseAllocatorConfig, SetsKnownKeysAndRejectsOthers) {
  DeviceAllocatorOptions o;
  ASSERT_TRUE(ParseAllocatorConfig("max_split_size=64MiB, backing=classic,"
                                   "large_segment_bytes=40MiB",
                                   &o)
                  .ok());
  EXPECT_EQ(o.max_split_size, 64u << 20);
  EXPECT_EQ(o.large_segment_bytes, 40u << 20);
  EXPECT_EQ(o.backing, BackingMode::kClassic);
  ASSERT_TRUE(ParseAllocatorConfig("backing=expandable", &o).ok());
  EXPECT_EQ(o.backing, BackingMode::kExpandable);
  EXPECT_THAT(ParseAllocatorConfig("colour=red", &o).message(),
              HasSubstr("unknown key 'colour'"));
  EXPECT_THAT(ParseAllocatorConfig("max_split_size=lots", &o).message(),
              HasSubstr("bad size 'lots'"));
  EXPECT_THAT(ParseAllocatorConfig("backing=magic", &o).message(),
              HasSubstr("classic, expandable or auto"));
  EXPECT_THAT(
      ParseAllocatorConfig("backing=classic,backing=expandable", &o).message(),
      HasSubstr("'backing' given twice"));
  // Values the allocator would refuse are refused here, as bad input.
  DeviceAllocatorOptions fresh;
  EXPECT_THAT(ParseAllocatorConfig("round_bytes=3", &fresh).message(),
              HasSubstr("powers of two"));
  fresh = {};
  EXPECT_THAT(ParseAllocatorConfig("small_segment_bytes=1", &fresh).message(),
              HasSubstr("inconsistent segment sizes"));
  ASSERT_TRUE(ParseAllocatorConfig("backing=auto,memory_limit=1GiB", &o).ok());
  EXPECT_EQ(o.backing, BackingMode::kAuto);
  EXPECT_EQ(o.memory_limit_bytes, 1u << 30);
  ASSERT_TRUE(
      ParseAllocatorConfig("memory_limit=0,vmm_unit_divisor=0", &o).ok());
  EXPECT_EQ(o.memory_limit_bytes, 0u);
  EXPECT_EQ(o.vmm_unit_divisor, 0u);
  ASSERT_TRUE(ParseAllocatorConfig("vmm_unit_divisor=256", &o).ok());
  EXPECT_EQ(o.vmm_unit_divisor, 256u);
  EXPECT_FALSE(ParseAllocatorConfig("round_bytes=0", &o).ok());
  EXPECT_THAT(ParseAllocatorConfig("vmm_unit_divisor=many", &o).message(),
              HasSubstr("vmm_unit_divisor must be a whole number"));
  EXPECT_FALSE(ParseAllocatorConfig("vmm_unit_divisor=-1", &o).ok());
  ASSERT_TRUE(ParseAllocatorConfig("vmm_chunk_units=1", &o).ok());
  EXPECT_EQ(o.vmm_chunk_units, 1u);
  EXPECT_THAT(ParseAllocatorConfig("vmm_chunk_units=0", &o).message(),
              HasSubstr("vmm_chunk_units must be a whole number from 1"));
  EXPECT_FALSE(ParseAllocatorConfig("vmm_chunk_units=65537", &o).ok());
  EXPECT_FALSE(ParseAllocatorConfig("vmm_map_whole_chunks=true", &o).ok());
}

// driver_calls counts every SimDriver call the allocator made, by kind,
// and their sum and simulated time agree with the driver's own counters.
TEST(Replay, CountsEveryDriverCallByKind) {
  absl::StatusOr<Trace> t = GenerateWorkload("mixed:ops=4000");
  ASSERT_TRUE(t.ok()) << t.status();
  for (BackingMode mode : {BackingMode::kClassic, BackingMode::kExpandable}) {
    ReplayConfig c;
    c.allocator.backing = mode;
    absl::StatusOr<ReplayResult> r = Replay(*t, c);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->backing,
              mode == BackingMode::kClassic ? "classic" : "expandable");
    std::uint64_t sum = 0;
    for (const auto& [name, n] : r->driver_calls) {
      EXPECT_GT(n, 0u) << name;
      sum += n;
    }
    EXPECT_EQ(sum, r->driver_calls_total);
    ASSERT_FALSE(r->driver_calls.empty());
    auto count = [&](absl::string_view name) -> std::uint64_t {
      for (const auto& [k, n] : r->driver_calls) {
        if (k == name) return n;
      }
      return 0;
    };
    if (mode == BackingMode::kClassic) {
      EXPECT_EQ(count("cuMemAlloc"), r->upstream_allocations);
      EXPECT_EQ(count("cuMemMap"), 0u);
    } else {
      EXPECT_EQ(count("cuMemCreate"), r->upstream_allocations);
      EXPECT_GE(count("cuMemMap"), count("cuMemCreate"));
    }
    // The driver time excludes the context's start-up (100 ms simulated).
    EXPECT_GT(r->simulated_driver_ns, 0);
    EXPECT_LT(r->simulated_driver_ns, r->simulated_time_ns);
    ASSERT_EQ(r->passes.size(), 1u);
    EXPECT_EQ(r->passes[0].driver_calls_total, r->driver_calls_total);
    EXPECT_EQ(r->passes[0].ops, r->ops);
    const std::string json = ReplayResultToJson(*r);
    EXPECT_THAT(json, HasSubstr(absl::StrCat("\"driver_calls_total\": ",
                                             r->driver_calls_total)));
    EXPECT_THAT(json, HasSubstr("\"driver_calls\": {\"c"));
    EXPECT_THAT(ReplayResultToText(*r), HasSubstr("driver calls:"));
  }
}

// A second pass over the same allocator is warm: the expandable backing
// maps nothing new and unmaps nothing (no pressure on 80 GiB).
TEST(Replay, SecondPassIsWarm) {
  absl::StatusOr<Trace> t = GenerateWorkload("llm-serving:requests=32");
  ASSERT_TRUE(t.ok()) << t.status();
  ReplayConfig c;
  c.allocator.backing = BackingMode::kExpandable;
  c.passes = 2;
  absl::StatusOr<ReplayResult> r = Replay(*t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->passes.size(), 2u);
  EXPECT_GT(r->passes[0].driver_calls_total, 0u);
  EXPECT_LE(r->passes[1].driver_calls_total * 1000, r->passes[1].ops)
      << ReplayResultToText(*r);
  for (const auto& [name, n] : r->driver_calls) {
    EXPECT_NE(name, "cuMemUnmap") << n;
  }
  EXPECT_EQ(r->passes[0].ops + r->passes[1].ops, r->ops);
  EXPECT_THAT(ReplayResultToText(*r), HasSubstr("pass 2"));
}

// Each order statistic of the per-call minima is at most the first run's.
void ExpectAtMost(const LatencyStats& min, const LatencyStats& one) {
  EXPECT_EQ(min.count, one.count);
  EXPECT_LE(min.p50, one.p50);
  EXPECT_LE(min.p99, one.p99);
  EXPECT_LE(min.p999, one.p999);
  EXPECT_LE(min.max, one.max);
  EXPECT_LE(min.total, one.total);
  EXPECT_GT(min.total, 0);
}

TEST(Replay, RepeatsReportTheLeastWallTimeOfEachCall) {
  const Trace t = MixedSizes({.seed = 3, .ops = 2000});
  ReplayConfig c;
  c.passes = 2;
  absl::StatusOr<ReplayResult> once = Replay(t, c);
  ASSERT_TRUE(once.ok()) << once.status();
  EXPECT_EQ(once->repeats, 1);
  EXPECT_EQ(once->wall_alloc_min.count, 0u);
  EXPECT_THAT(ReplayResultToJson(*once), Not(HasSubstr("wall_allocate_min")));
  EXPECT_THAT(ReplayResultToText(*once), Not(HasSubstr("least wall time")));

  c.repeats = 3;
  absl::StatusOr<ReplayResult> r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->repeats, 3);
  ExpectAtMost(r->wall_alloc_min, r->wall_alloc);
  ExpectAtMost(r->wall_free_min, r->wall_free);
  // Everything else is one run's, as without repeats.
  ExpectSameOutcome(*r, *once);
  const std::string json = ReplayResultToJson(*r);
  EXPECT_THAT(json, HasSubstr("\"repeats\": 3"));
  EXPECT_THAT(json, HasSubstr("\"wall_allocate_min\": {\"count\": "));
  EXPECT_THAT(json, HasSubstr("\"wall_deallocate_min\": {\"count\": "));
  EXPECT_THAT(ReplayResultToText(*r),
              HasSubstr("per call, the least wall time of 3 runs"));

  // Without wall clocks there is nothing to fold.
  c.wall_latency = false;
  r = Replay(t, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->wall_alloc_min.count, 0u);
}

TEST(Replay, RepeatsOnAGivenDriverLeaveNothingBehind) {
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  const Trace t = MultiStream({.seed = 2, .streams = 2, .ops_per_stream = 300});
  ReplayConfig c;
  c.repeats = 2;
  absl::StatusOr<ReplayResult> r = ReplayOnDriver(t, *sim, 0, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->repeats, 2);
  ExpectAtMost(r->wall_alloc_min, r->wall_alloc);
  EXPECT_EQ(sim->misuse_count(), 0u)
      << ::testing::PrintToString(sim->misuse_log());
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  EXPECT_EQ(sim->used_bytes(0), 0u);
}

TEST(Replay, RefusesRepeatsBelowOne) {
  const Trace t = MixedSizes({.seed = 1, .ops = 10});
  for (int repeats : {0, -1}) {
    ReplayConfig c;
    c.repeats = repeats;
    absl::StatusOr<ReplayResult> r = Replay(t, c);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr("repeats"));
    std::unique_ptr<SimDriver> sim = SimDriver::Create();
    r = ReplayOnDriver(t, *sim, 0, c);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(sim->call_count(SimCall::kPrimaryCtxRetain), 0u);
  }
}

TEST(Replay, RepeatsThatReplayDifferentlyAreAnError) {
  // The second run's driver refuses every allocation, so it stops at its
  // first OOM: its calls cannot be matched with the first run's.
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  const Trace t = MixedSizes({.seed = 1, .ops = 200});
  ReplayConfig c;
  ASSERT_TRUE(ParseAllocatorConfig("backing=classic", &c.allocator).ok());
  c.repeats = 2;
  c.stop_at_first_oom = true;
  c.progress_every = t.size();
  int runs_ended = 0;
  c.progress = [&](std::size_t done, std::size_t total) {
    if (done == total && ++runs_ended == 1) {
      sim->InjectFault(SimCall::kMemAlloc, 1000,
                       /*CUDA_ERROR_OUT_OF_MEMORY=*/2);
    }
  };
  absl::StatusOr<ReplayResult> r = ReplayOnDriver(t, *sim, 0, c);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("did not replay the same way"));
  EXPECT_EQ(sim->used_bytes(0), 0u);
}

// Ten allocations of 64 MiB and more on stream 1, then frees of the first
// `frees` of them.
Trace TenLarge(int frees) {
  Trace t;
  for (std::uint64_t i = 0; i < 10; ++i) {
    t.Append(Alloc(0x1000 + i, (64 << 20) + i * (4 << 20), 1));
  }
  for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(frees); ++i) {
    t.Append(Free(0x1000 + i, (64 << 20) + i * (4 << 20), 1));
  }
  return t;
}

TEST(Replay, RepeatsWhoseCallsEndDifferentlyAreAnError) {
  // Each run makes as many Allocate and Deallocate calls as the first, but
  // in the second the driver refuses memory from a given event on (two
  // refusals: the call and the allocator's retry), so one call's outcome
  // differs: its times must not be paired with the first run's.
  struct Case {
    int frees;
    std::size_t fail_first, fail_second;  // event indexes; -1: none
  };
  constexpr std::size_t kNone = ~std::size_t{0};
  for (const Case& k : {Case{9, kNone, 9}, Case{10, 2, 7}}) {
    SCOPED_TRACE(::testing::Message() << "frees " << k.frees);
    std::unique_ptr<SimDriver> sim = SimDriver::Create();
    const Trace t = TenLarge(k.frees);
    ReplayConfig c;
    ASSERT_TRUE(ParseAllocatorConfig("backing=classic", &c.allocator).ok());
    c.repeats = 2;
    c.progress_every = 1;
    int run = -1;
    c.progress = [&](std::size_t done, std::size_t) {
      if (done == 1) ++run;
      const std::size_t at = run == 0 ? k.fail_first : k.fail_second;
      if (at != kNone && done == at) {
        sim->InjectFault(SimCall::kMemAlloc, 2, /*CUDA_ERROR_OUT_OF_MEMORY=*/2);
      }
    };
    absl::StatusOr<ReplayResult> r = ReplayOnDriver(t, *sim, 0, c);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr("did not replay the same way"));
    EXPECT_THAT(r.status().message(), HasSubstr("Allocate at event"));
    EXPECT_EQ(sim->used_bytes(0), 0u);
    EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  }
}

TEST(Replay, ReportsProgressForEveryEventIncludingFailedOnes) {
  // The first allocation fails (the driver refuses it and its retry), so
  // its free is skipped: both events still count as done.
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  const Trace t = TenLarge(10);
  ReplayConfig c;
  ASSERT_TRUE(ParseAllocatorConfig("backing=classic", &c.allocator).ok());
  c.progress_every = 1;
  std::vector<std::size_t> done;
  c.progress = [&](std::size_t d, std::size_t total) {
    EXPECT_EQ(total, t.size());
    done.push_back(d);
  };
  sim->InjectFault(SimCall::kMemAlloc, 2, /*CUDA_ERROR_OUT_OF_MEMORY=*/2);
  absl::StatusOr<ReplayResult> r = ReplayOnDriver(t, *sim, 0, c);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->ooms, 1u);
  EXPECT_EQ(r->skipped_frees, 1u);
  std::vector<std::size_t> want;
  for (std::size_t i = 1; i <= t.size(); ++i) want.push_back(i);
  want.push_back(t.size());  // the end
  EXPECT_EQ(done, want);
}

TEST(LatencyStats, NearestRankPercentiles) {
  std::vector<std::int64_t> v;
  for (int i = 1000; i >= 1; --i) v.push_back(i);
  const LatencyStats l = ComputeLatencyStats(v);
  EXPECT_EQ(l.count, 1000u);
  EXPECT_EQ(l.p50, 500);
  EXPECT_EQ(l.p99, 990);
  EXPECT_EQ(l.p999, 999);
  EXPECT_EQ(l.max, 1000);
  EXPECT_DOUBLE_EQ(l.mean, 500.5);
  std::vector<std::int64_t> empty;
  EXPECT_EQ(ComputeLatencyStats(empty).count, 0u);
}

}  // namespace
}  // namespace ctxpool
