// Tests of SimDriver's cost table: the built-in estimates, the JSON form
// (CTXPOOL_SIM_COSTS), and that the VMM calls' costs grow with their size.
#include "ctxpool/driver/sim_costs.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kMiB = 1 << 20;

int Index(SimCall c) { return static_cast<int>(c); }

// cuMemCreate, like cuMemAlloc, costs more for more bytes: one 1 GiB chunk
// is not 512 times cheaper per byte than 2 MiB granules, and a mapping's
// create + map + access costs about what cuMemAlloc does.
TEST(SimCosts, VmmCostsGrowWithSizeLikeMemAlloc) {
  const SimCostTable t = RealisticSimCosts();
  auto cost = [&](SimCall c, std::size_t bytes) {
    const SimCost& k = t.calls[Index(c)];
    return k.ns + k.ns_per_mib * static_cast<std::int64_t>(bytes / kMiB);
  };
  for (SimCall c : {SimCall::kMemAlloc, SimCall::kMemCreate,
                    SimCall::kMemSetAccess, SimCall::kMemRelease}) {
    EXPECT_GT(t.calls[Index(c)].ns_per_mib, 0) << SimCallName(c);
  }
  // One 1 GiB call against 512 calls of 2 MiB: the big call is cheaper per
  // byte by about as much for cuMemCreate as for cuMemAlloc (their fixed
  // costs), not 512 times as a flat per-call cost would make it.
  const double create_gain =
      static_cast<double>(512 * cost(SimCall::kMemCreate, 2 * kMiB)) /
      static_cast<double>(cost(SimCall::kMemCreate, 1024 * kMiB));
  const double alloc_gain =
      static_cast<double>(512 * cost(SimCall::kMemAlloc, 2 * kMiB)) /
      static_cast<double>(cost(SimCall::kMemAlloc, 1024 * kMiB));
  EXPECT_GT(create_gain, alloc_gain / 2);
  EXPECT_LT(create_gain, alloc_gain * 2);
  EXPECT_LT(create_gain, 10.0);
  const std::int64_t vmm = cost(SimCall::kMemCreate, 1024 * kMiB) +
                           cost(SimCall::kMemMap, 1024 * kMiB) +
                           cost(SimCall::kMemSetAccess, 1024 * kMiB);
  const std::int64_t alloc = cost(SimCall::kMemAlloc, 1024 * kMiB);
  EXPECT_GE(vmm, alloc);
  EXPECT_LE(vmm, alloc + alloc / 10);
}

// SimDriver charges the per-MiB part of the VMM calls by their size.
TEST(SimCosts, DriverChargesVmmCallsBySize) {
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  ASSERT_TRUE(sim->UseRealisticCosts().ok());
  const SimCostTable t = RealisticSimCosts();
  auto ctx = sim->PrimaryCtxRetain(0);
  ASSERT_TRUE(ctx.ok());
  ASSERT_TRUE(sim->CtxSetCurrent(*ctx).ok());
  std::int64_t before = sim->simulated_time_ns();
  auto h = sim->MemCreate(64 * kMiB, 0);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(sim->simulated_time_ns() - before,
            t.calls[Index(SimCall::kMemCreate)].ns +
                64 * t.calls[Index(SimCall::kMemCreate)].ns_per_mib);
  auto va = sim->MemAddressReserve(64 * kMiB, 0);
  ASSERT_TRUE(va.ok());
  ASSERT_TRUE(sim->MemMap(*va, 64 * kMiB, 0, *h).ok());
  before = sim->simulated_time_ns();
  ASSERT_TRUE(sim->MemSetAccess(*va, 64 * kMiB, 0).ok());
  EXPECT_EQ(sim->simulated_time_ns() - before,
            t.calls[Index(SimCall::kMemSetAccess)].ns +
                64 * t.calls[Index(SimCall::kMemSetAccess)].ns_per_mib);
  ASSERT_TRUE(sim->MemUnmap(*va, 64 * kMiB).ok());
  before = sim->simulated_time_ns();
  ASSERT_TRUE(sim->MemRelease(*h).ok());
  EXPECT_EQ(sim->simulated_time_ns() - before,
            t.calls[Index(SimCall::kMemRelease)].ns +
                64 * t.calls[Index(SimCall::kMemRelease)].ns_per_mib);
  ASSERT_TRUE(sim->MemAddressFree(*va, 64 * kMiB).ok());
  ASSERT_TRUE(sim->PrimaryCtxRelease(0).ok());
}

TEST(SimCosts, JsonRoundTripAndOverrides) {
  const SimCostTable base = RealisticSimCosts();
  absl::StatusOr<SimCostTable> same =
      ParseSimCostTable(SimCostTableToJson(base), SimCostTable{});
  ASSERT_TRUE(same.ok()) << same.status();
  for (int i = 0; i < kSimCallCount; ++i) {
    EXPECT_EQ(same->calls[i].ns, base.calls[i].ns) << i;
    EXPECT_EQ(same->calls[i].ns_per_mib, base.calls[i].ns_per_mib) << i;
  }
  EXPECT_EQ(same->work_ns, base.work_ns);
  EXPECT_EQ(same->context_create_ns, base.context_create_ns);
  // Named rows replace the base's; the rest stay. Measured values may be
  // fractional nanoseconds.
  absl::StatusOr<SimCostTable> t = ParseSimCostTable(
      R"({"cuMemMap": {"ns": 1234.4}, "cuMemCreate": {"ns": 7, "ns_per_mib": 9},
          "work_ns": 3})",
      base);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->calls[Index(SimCall::kMemMap)].ns, 1234);
  EXPECT_EQ(t->calls[Index(SimCall::kMemMap)].ns_per_mib, 0);
  EXPECT_EQ(t->calls[Index(SimCall::kMemCreate)].ns_per_mib, 9);
  EXPECT_EQ(t->calls[Index(SimCall::kMemAlloc)].ns,
            base.calls[Index(SimCall::kMemAlloc)].ns);
  EXPECT_EQ(t->work_ns, 3);
}

TEST(SimCosts, BadTablesAreRefusedWithTheReason) {
  const SimCostTable base = RealisticSimCosts();
  struct Case {
    const char* json;
    const char* why;
  } cases[] = {
      {R"({"cuMemTeleport": {"ns": 1}})", "unknown call 'cuMemTeleport'"},
      {R"({"cuMemMap": {"ns": -1}})", "costs must be in"},
      {R"({"cuMemMap": {"us": 1}})", "unknown field 'us'"},
      {R"({"cuMemMap": {"ns": 1})", "expected '}'"},
      {R"({"cuMemMap": {"ns": "1"}})", "expected a number"},
      {R"({} x)", "trailing text"},
      {"", "expected '{'"},
      {R"({"cuMemMap\"": 1})", "escapes"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SimCostTable> t = ParseSimCostTable(c.json, base);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(t.status().message(), HasSubstr(c.why)) << c.json;
  }
  EXPECT_EQ(LoadSimCostTable("/nonexistent/costs.json", base).status().code(),
            absl::StatusCode::kNotFound);
}

// Huge costs are refused, and the largest accepted ones saturate the
// simulated clock instead of overflowing it.
TEST(SimCosts, HugeCostsAreRefusedOrSaturate) {
  EXPECT_FALSE(
      ParseSimCostTable(R"({"cuMemCreate": {"ns": 1e15, "ns_per_mib": 1e15}})",
                        SimCostTable{})
          .ok());
  absl::StatusOr<SimCostTable> t = ParseSimCostTable(
      R"({"cuMemCreate": {"ns": 1e12, "ns_per_mib": 1e12}})", SimCostTable{});
  ASSERT_TRUE(t.ok()) << t.status();
  SimDeviceSpec spec = *SimDevicePreset("h100-80gb");
  std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {spec}});
  sim->SetCostTable(*t);
  auto ctx = sim->PrimaryCtxRetain(0);
  ASSERT_TRUE(ctx.ok());
  ASSERT_TRUE(sim->CtxSetCurrent(*ctx).ok());
  std::int64_t last = 0;
  for (int i = 0; i < 4; ++i) {
    auto h = sim->MemCreate(16 * 1024 * kMiB, 0);  // 16 GiB: 1.7e16 ns each
    ASSERT_TRUE(h.ok());
    EXPECT_GE(sim->simulated_time_ns(), last);
    last = sim->simulated_time_ns();
    ASSERT_TRUE(sim->MemRelease(*h).ok());
  }
  for (int i = 0; i < 1000; ++i) {
    auto h = sim->MemCreate(16 * 1024 * kMiB, 0);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(sim->MemRelease(*h).ok());
  }
  EXPECT_EQ(sim->simulated_time_ns(), std::numeric_limits<std::int64_t>::max());
  ASSERT_TRUE(sim->PrimaryCtxRelease(0).ok());
}

// CTXPOOL_SIM_COSTS: UseRealisticCosts loads the file over the built-in
// table; a bad file is an error and leaves the built-in table in force.
TEST(SimCosts, UseRealisticCostsLoadsTheEnvironmentsTable) {
  const std::string path =
      std::string(::testing::TempDir()) + "/sim_costs_test.json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(R"({"cuMemAlloc": {"ns": 777, "ns_per_mib": 0}})", f);
  std::fclose(f);
  ASSERT_TRUE(SetOption(OptionId::kSimCosts, path).ok());
  std::unique_ptr<SimDriver> sim = SimDriver::Create();
  ASSERT_TRUE(sim->UseRealisticCosts().ok());
  auto ctx = sim->PrimaryCtxRetain(0);
  ASSERT_TRUE(ctx.ok());
  ASSERT_TRUE(sim->CtxSetCurrent(*ctx).ok());
  std::int64_t before = sim->simulated_time_ns();
  auto p = sim->MemAlloc(100 * kMiB);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(sim->simulated_time_ns() - before, 777);
  ASSERT_TRUE(sim->MemFree(*p).ok());

  ASSERT_TRUE(SetOption(OptionId::kSimCosts, path + ".missing").ok());
  absl::Status s = sim->UseRealisticCosts();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  before = sim->simulated_time_ns();
  p = sim->MemAlloc(100 * kMiB);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(
      sim->simulated_time_ns() - before,
      RealisticSimCosts().calls[Index(SimCall::kMemAlloc)].ns +
          100 *
              RealisticSimCosts().calls[Index(SimCall::kMemAlloc)].ns_per_mib);
  ASSERT_TRUE(sim->MemFree(*p).ok());
  ReloadOptions();
  ASSERT_TRUE(sim->PrimaryCtxRelease(0).ok());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace ctxpool
