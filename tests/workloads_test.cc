#include "ctxpool/trace/workloads.h"

#include <set>
#include <vector>

#include "ctxpool/trace/trace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;

std::uint64_t Count(const Trace& t, TraceOp op) {
  return Summarize(t).op_counts[static_cast<int>(op)];
}

TEST(Workloads, EveryGeneratorIsValidAndDeterministic) {
  for (const std::string& name : WorkloadNames()) {
    SCOPED_TRACE(name);
    absl::StatusOr<Trace> a = GenerateWorkload(name);
    absl::StatusOr<Trace> b = GenerateWorkload(name);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(a->Validate().ok()) << a->Validate();
    EXPECT_EQ(*a, *b);
    EXPECT_GT(a->size(), 1000u);
    absl::StatusOr<Trace> other = GenerateWorkload(name + ":seed=2");
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_NE(*a, *other);
    // Time never goes backwards.
    for (std::size_t i = 1; i < a->size(); ++i) {
      ASSERT_LE(a->events()[i - 1].time_ns, a->events()[i].time_ns);
    }
  }
}

TEST(Workloads, ChurnLoadsAndUnloadsModelsForAtLeast100Cycles) {
  const MultiModelChurnOptions o;
  EXPECT_GE(o.cycles, 100);
  const Trace t = MultiModelChurn(o);
  const TraceSummary s = Summarize(t);
  // Every weight tensor of every load is freed by an unload.
  EXPECT_EQ(s.end_live_count, 0u);
  // Each cycle loads one model's weight_tensors.
  std::uint64_t big = 0;
  for (const TraceEvent& e : t.events()) {
    if (e.op == TraceOp::kAlloc && e.size >= (4u << 20)) ++big;
  }
  EXPECT_GE(big, static_cast<std::uint64_t>(o.cycles) * 10);
  EXPECT_EQ(s.tenants.size(), static_cast<std::size_t>(o.models));
  EXPECT_EQ(s.streams.size(), static_cast<std::size_t>(o.models));
  // At most `resident` models' weights are live at once.
  EXPECT_LE(s.peak_live_bytes,
            static_cast<std::uint64_t>(o.resident) *
                (o.max_model_bytes + (o.max_model_bytes >> 2)));
}

TEST(Workloads, ChurnTrimsAfterEachUnloadInsideTheCycles) {
  const MultiModelChurnOptions o{.seed = 4, .models = 5, .cycles = 30};
  ASSERT_TRUE(o.trim_after_unload);  // the default
  const Trace t = MultiModelChurn(o);
  ASSERT_TRUE(t.Validate().ok()) << t.Validate();
  // Each cycle after the first `resident` evicts one model; the final
  // teardown does not trim.
  EXPECT_EQ(Count(t, TraceOp::kTrim),
            static_cast<std::uint64_t>(o.cycles - o.resident));
  const std::vector<TraceEvent>& ev = t.events();
  std::size_t last_alloc = 0, last_trim = 0;
  for (std::size_t i = 0; i < ev.size(); ++i) {
    if (ev[i].op == TraceOp::kAlloc) last_alloc = i;
    if (ev[i].op != TraceOp::kTrim) continue;
    last_trim = i;
    EXPECT_EQ(ev[i].size, 0u);
    // It follows the frees of an unloaded model's weights, and names that
    // model's stream and tenant.
    ASSERT_GT(i, static_cast<std::size_t>(o.weight_tensors));
    for (int k = 1; k <= o.weight_tensors; ++k) {
      const TraceEvent& f = ev[i - static_cast<std::size_t>(k)];
      ASSERT_EQ(f.op, TraceOp::kFree) << "event " << i;
      EXPECT_EQ(f.stream, ev[i].stream);
      EXPECT_EQ(f.tenant, ev[i].tenant);
    }
  }
  EXPECT_LT(last_trim, last_alloc);  // no trim in the teardown

  // Without trims the allocations and frees are the same.
  MultiModelChurnOptions no_trim = o;
  no_trim.trim_after_unload = false;
  const Trace u = MultiModelChurn(no_trim);
  EXPECT_EQ(Count(u, TraceOp::kTrim), 0u);
  std::vector<TraceEvent> t_ops;
  for (const TraceEvent& e : ev) {
    if (e.op != TraceOp::kTrim) t_ops.push_back(e);
  }
  ASSERT_EQ(t_ops.size(), u.size());
  for (std::size_t i = 0; i < u.size(); ++i) {
    EXPECT_EQ(t_ops[i].op, u.events()[i].op);
    EXPECT_EQ(t_ops[i].ptr, u.events()[i].ptr);
    EXPECT_EQ(t_ops[i].size, u.events()[i].size);
  }
}

TEST(Workloads, LlmServingGrowsKvCachesAndVariesSequenceLength) {
  const LlmServingOptions o{.seed = 5, .requests = 32};
  const Trace t = LlmServing(o);
  ASSERT_TRUE(t.Validate().ok());
  std::set<std::uint64_t> kv_sizes;
  for (const TraceEvent& e : t.events()) {
    if (e.op == TraceOp::kAlloc &&
        e.size % (o.kv_bytes_per_token * o.kv_grow_tokens) == 0) {
      kv_sizes.insert(e.size / o.kv_bytes_per_token);
    }
  }
  // Many distinct KV sizes: variable lengths and step-wise growth.
  EXPECT_GT(kv_sizes.size(), 10u);
  const TraceSummary s = Summarize(t);
  EXPECT_GT(s.peak_live_bytes, o.weights_bytes);
  EXPECT_EQ(s.end_live_count, 0u);
}

TEST(Workloads, MixedSizesRespectsTheLiveBoundAndMixesSizes) {
  const MixedSizesOptions o{
      .seed = 9, .ops = 5000, .max_live_bytes = 1ull << 30};
  const TraceSummary s = Summarize(MixedSizes(o));
  EXPECT_LE(s.peak_live_bytes, o.max_live_bytes + o.max_large_bytes);
  EXPECT_LT(s.min_size, 4096u);
  EXPECT_GT(s.max_size, 1u << 20);
  EXPECT_EQ(s.allocs, 5000u);
}

TEST(Workloads, MultiStreamUsesEveryStream) {
  const Trace t = MultiStream({.seed = 4, .streams = 5, .ops_per_stream = 400});
  EXPECT_EQ(Summarize(t).streams, (std::vector<std::uint64_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(Count(t, TraceOp::kAlloc), 2000u);
}

TEST(Workloads, SpecStringsSetOptionsAndRejectNonsense) {
  absl::StatusOr<Trace> t =
      GenerateWorkload("churn:seed=3,cycles=120,models=4,max_model_bytes=1GiB");
  ASSERT_TRUE(t.ok()) << t.status();
  const MultiModelChurnOptions o{
      .seed = 3, .models = 4, .cycles = 120, .max_model_bytes = 1ull << 30};
  EXPECT_EQ(*t, MultiModelChurn(o));
  absl::StatusOr<Trace> quiet =
      GenerateWorkload("churn:seed=3,trim_after_unload=false");
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  EXPECT_EQ(*quiet, MultiModelChurn({.seed = 3, .trim_after_unload = false}));
  EXPECT_THAT(
      GenerateWorkload("churn:trim_after_unload=maybe").status().message(),
      HasSubstr("bad value 'maybe'"));
  EXPECT_THAT(GenerateWorkload("nope").status().message(),
              HasSubstr("unknown workload 'nope'"));
  EXPECT_THAT(GenerateWorkload("mixed:colour=red").status().message(),
              HasSubstr("unknown option 'colour'"));
  EXPECT_THAT(GenerateWorkload("mixed:ops=many").status().message(),
              HasSubstr("bad value 'many'"));
}

}  // namespace
}  // namespace ctxpool
