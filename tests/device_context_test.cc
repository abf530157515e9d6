#include "ctxpool/context/device_context.h"

#include <algorithm>
#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ctxpool/context/runtime.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "fake_cgroup.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::Test;

std::unique_ptr<SimDriver> MakeSim(absl::string_view preset = "h100-80gb") {
  return SimDriver::Create({.devices = {*SimDevicePreset(preset)}});
}

DeviceContextOptions Plain() {
  DeviceContextOptions o;
  o.use_option_table = false;
  o.stream_pool_reserve = 0;
  return o;
}

// CTXPOOL_MEMORY_LIMIT (and CTXPOOL_BACKING=auto) reach the device
// allocator through the option table; a bad value is refused.
TEST(DeviceContext, OptionTableSetsTheMemoryLimit) {
  std::unique_ptr<SimDriver> sim = MakeSim();
  ASSERT_TRUE(SetOption(OptionId::kMemoryLimit, "1GiB").ok());
  ASSERT_TRUE(SetOption(OptionId::kBacking, "auto").ok());
  DeviceContextOptions o = Plain();
  o.use_option_table = true;
  {
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    CachingDeviceAllocator& a = (*dc)->device_allocator();
    EXPECT_EQ(a.options().memory_limit_bytes, std::size_t{1} << 30);
    EXPECT_EQ(a.options().backing, BackingMode::kExpandable);
    ContextHandle ctx = *sim->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim->CtxSetCurrent(ctx).ok());
    absl::StatusOr<StreamHandle> s = sim->StreamCreate(kStreamNonBlocking, 0);
    ASSERT_TRUE(s.ok()) << s.status();
    absl::StatusOr<DevicePtr> big = a.Allocate(std::size_t{2} << 30, *s);
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(big.status().message().find("memory_limit_bytes"),
              std::string::npos)
        << big.status();
    ASSERT_TRUE(sim->StreamDestroy(*s).ok());
    ASSERT_TRUE(sim->PrimaryCtxRelease(0).ok());
  }
  EXPECT_FALSE(SetOption(OptionId::kMemoryLimit, "lots").ok());
  ReloadOptions();
}

// The pinned-host budget follows the container's cgroup: half of a fake
// memory.high of 256 MiB; growth past it trims the cache first, then fails
// naming the cgroup.
TEST(DeviceContext, HostBudgetFollowsTheCgroupAndNamesIt) {
  testing_internal::FakeCgroupRoot root;
  root.Write("proc/self/cgroup", "0::/kubepods/pod7/worker\n");
  root.Cgroup("/kubepods/pod7", "max", std::to_string(256 << 20));
  root.Cgroup("/kubepods/pod7/worker", "max", "max", "1048576");
  ASSERT_TRUE(SetOption(OptionId::kSysfsRoot, root.path()).ok());
  std::unique_ptr<SimDriver> sim = MakeSim();
  DeviceContextOptions o = Plain();
  o.use_option_table = true;
  {
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    CachingHostAllocator& host = (*dc)->host_allocator();
    EXPECT_EQ(host.Stats().host_budget_bytes, std::size_t{128} << 20);
    ASSERT_TRUE((*dc)->MakeCurrent().ok());
    const StreamHandle s = *sim->StreamCreate(kStreamNonBlocking, 0);
    absl::StatusOr<void*> a = host.Allocate(std::size_t{100} << 20, s);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(host.Deallocate(*a).ok());
    EXPECT_EQ(host.Stats().cached_bytes, host.Stats().pinned_bytes);
    // Another class: only fits once the cached 100 MiB is given back.
    absl::StatusOr<void*> b = host.Allocate(std::size_t{70} << 20, s);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(host.Stats().cached_bytes, 0u);
    EXPECT_LE(host.Stats().pinned_bytes, std::size_t{128} << 20);
    absl::StatusOr<void*> c = host.Allocate(std::size_t{64} << 20, s);
    ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(c.status().message().find("cgroup /kubepods/pod7 memory.high"),
              std::string::npos)
        << c.status();
    EXPECT_EQ(host.Stats().num_budget_failures, 1);
    ASSERT_TRUE(host.Deallocate(*b).ok());
    ASSERT_TRUE(sim->StreamDestroy(s).ok());
  }
  // The half is shared by the driver's devices.
  absl::StatusOr<DerivedHostBudget> two = DeriveHostBudget(2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->bytes, std::size_t{64} << 20);
  EXPECT_NE(two->source.find("shared by 2 devices"), std::string::npos)
      << two->source;
  // An explicit budget wins; 'unlimited' turns the cgroup's off.
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "1GiB").ok());
  {
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_EQ((*dc)->host_allocator().Stats().host_budget_bytes,
              std::size_t{1} << 30);
  }
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "unlimited").ok());
  {
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_EQ((*dc)->host_allocator().Stats().host_budget_bytes, 0u);
  }
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "lots").ok());
  EXPECT_EQ(DeviceContext::Create(*sim, 0, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  // No cgroup limit known (a v1 host): unlimited, and nothing fails.
  root.Write("proc/self/cgroup", "4:memory:/x\n");
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "auto").ok());
  {
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_EQ((*dc)->host_allocator().Stats().host_budget_bytes, 0u);
  }
  ReloadOptions();
}

// The budget follows the lower of memory.high and memory.max, never
// rounds down to "unlimited", is shared by the devices a Runtime opens (not
// every device of the driver), and an empty CTXPOOL_HOST_BUDGET is unset.
TEST(DeviceContext, HostBudgetTakesTheBindingLimitAndTheOpenedDevices) {
  testing_internal::FakeCgroupRoot root;
  root.Write("proc/self/cgroup", "0::/pod/ctr\n");
  root.Cgroup("/pod", "max", std::to_string(2048 << 20));
  root.Cgroup("/pod/ctr", std::to_string(512 << 20), "max", "1");
  ASSERT_TRUE(SetOption(OptionId::kSysfsRoot, root.path()).ok());
  absl::StatusOr<DerivedHostBudget> b = DeriveHostBudget(1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->bytes, std::size_t{256} << 20);
  EXPECT_NE(b->source.find("/pod/ctr memory.max"), std::string::npos)
      << b->source;
  root.Cgroup("/pod/ctr", "0", "max");  // the strictest cgroup of all
  b = DeriveHostBudget(8);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->bytes, 1u);  // not 0, which would mean unlimited
  root.Cgroup("/pod/ctr", std::to_string(1024 << 20), "max");
  {
    auto sim = SimDriver::Create(
        {.devices = {*SimDevicePreset("a10-24gb"), *SimDevicePreset("a10-24gb"),
                     *SimDevicePreset("a10-24gb"),
                     *SimDevicePreset("a10-24gb")}});
    RuntimeOptions ro;
    ro.devices = {2};
    ro.device_options.stream_pool_reserve = 0;
    auto rt = Runtime::Create(std::move(sim), ro);
    ASSERT_TRUE(rt.ok()) << rt.status();
    EXPECT_EQ((*rt)->devices()[0]->host_allocator().Stats().host_budget_bytes,
              std::size_t{512} << 20);  // one of four opened: half, whole
  }
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "").ok());
  b = DeriveHostBudget(1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->bytes, std::size_t{512} << 20);
  ASSERT_TRUE(SetOption(OptionId::kHostBudget, "0.4").ok());
  EXPECT_EQ(DeriveHostBudget(1).status().code(),
            absl::StatusCode::kInvalidArgument);
  ReloadOptions();
}

// CTXPOOL_CTX_SCHED is set before the first retain and read back; a driver
// that accepts the flag but ignores it (as one did under a constrained
// cgroup) is caught: the report says so and a counter counts it.
TEST(DeviceContext, SchedulingFlagIsVerifiedAfterTheRetain) {
  DeviceContextOptions o = Plain();
  o.sched_flags = kCtxSchedBlockingSync;
  {
    std::unique_ptr<SimDriver> sim = MakeSim();
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    const ContextReport& r = (*dc)->initial_context_report();
    EXPECT_TRUE(r.sched_flags_requested);
    EXPECT_EQ(r.effective_sched_flags, kCtxSchedBlockingSync);
    EXPECT_FALSE(r.sched_flags_mismatch);
    EXPECT_EQ((*dc)->Stats().sched_flag_mismatches, 0);
    EXPECT_NE(r.ToString().find("scheduling: blocking_sync"), std::string::npos)
        << r.ToString();
    EXPECT_GT(r.created_at_ns, 0);
  }
  {
    std::unique_ptr<SimDriver> sim = MakeSim();
    sim->SetIgnorePrimaryCtxFlags(true);
    auto dc = DeviceContext::Create(*sim, 0, o);
    ASSERT_TRUE(dc.ok()) << dc.status();
    const ContextReport& r = (*dc)->initial_context_report();
    EXPECT_TRUE(r.sched_flags_mismatch);
    EXPECT_EQ(r.effective_sched_flags, kCtxSchedAuto);
    EXPECT_EQ((*dc)->Stats().sched_flag_mismatches, 1);
    EXPECT_NE(r.ToString().find("WARNING"), std::string::npos);
  }
  // Through the option table; a bad spelling is refused.
  {
    std::unique_ptr<SimDriver> sim = MakeSim();
    DeviceContextOptions t = Plain();
    t.use_option_table = true;
    ASSERT_TRUE(SetOption(OptionId::kCtxSched, "yield").ok());
    auto dc = DeviceContext::Create(*sim, 0, t);
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_EQ((*dc)->initial_context_report().effective_sched_flags,
              kCtxSchedYield);
    ASSERT_TRUE(SetOption(OptionId::kCtxSched, "fast").ok());
    std::unique_ptr<SimDriver> sim2 = MakeSim();
    EXPECT_EQ(DeviceContext::Create(*sim2, 0, t).status().code(),
              absl::StatusCode::kInvalidArgument);
    ReloadOptions();
  }
  // Not a scheduling flag: refused.
  {
    std::unique_ptr<SimDriver> sim = MakeSim();
    DeviceContextOptions bad = Plain();
    for (unsigned f : {0x3u, 0x8u}) {
      bad.sched_flags = f;
      EXPECT_EQ(DeviceContext::Create(*sim, 0, bad).status().code(),
                absl::StatusCode::kInvalidArgument);
    }
  }
  // Unset: the flags are left alone (whatever cudaSetDeviceFlags chose).
  {
    std::unique_ptr<SimDriver> sim = MakeSim();
    ASSERT_TRUE(sim->PrimaryCtxSetFlags(0, kCtxSchedSpin).ok());
    auto dc = DeviceContext::Create(*sim, 0, Plain());
    ASSERT_TRUE(dc.ok()) << dc.status();
    const ContextReport& r = (*dc)->initial_context_report();
    EXPECT_FALSE(r.sched_flags_requested);
    EXPECT_EQ(r.effective_sched_flags, kCtxSchedSpin);
  }
}

TEST(DeviceContext, EightSessionsShareOnePrimaryContext) {
  auto sim = MakeSim();
  const std::size_t overhead = sim->device_spec(0).context_overhead_bytes;
  std::size_t shared_total = 0;
  {
    auto dc = DeviceContext::Create(*sim, 0, Plain());
    ASSERT_TRUE(dc.ok()) << dc.status();
    std::vector<std::unique_ptr<ModelSession>> sessions;
    for (int i = 0; i < 8; ++i) {
      auto s = (*dc)->OpenSession(absl::StrCat("model", i), {.streams = 1});
      ASSERT_TRUE(s.ok()) << s.status();
      auto p = (*s)->Allocate(1 << 20, (*s)->stream(0));
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE((*s)->Deallocate(*p).ok());
      sessions.push_back(std::move(*s));
    }
    EXPECT_EQ(sim->primary_ctx_refcount(0), 1);
    EXPECT_EQ(sim->contexts_created(0), 1);
    EXPECT_EQ(sim->context_bytes(0), overhead);
    EXPECT_EQ(sim->call_count(SimCall::kPrimaryCtxRetain), 1u);
    EXPECT_EQ((*dc)->Stats().primary_retains, 1);
    EXPECT_EQ((*dc)->initial_context_report().context_bytes, overhead);
    shared_total = sim->context_bytes(0);
    for (auto& s : sessions) EXPECT_TRUE(s->Close().ok());
  }
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  EXPECT_EQ(sim->context_bytes(0), 0u);
  EXPECT_EQ(sim->misuse_count(), 0u);

  // The baseline: each model makes its own context.
  auto baseline = MakeSim();
  std::vector<ContextHandle> own;
  for (int i = 0; i < 8; ++i) {
    auto ctx = baseline->CtxCreate(0, 0);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    own.push_back(*ctx);
  }
  EXPECT_EQ(baseline->contexts_created(0), 8);
  EXPECT_EQ(baseline->context_bytes(0), 8 * overhead);
  const std::size_t own_total = baseline->context_bytes(0);
  for (ContextHandle c : own) EXPECT_TRUE(baseline->CtxDestroy(c).ok());

  std::cout << "context memory for 8 models on " << sim->device_spec(0).name
            << ": shared primary context " << (shared_total >> 20)
            << " MiB (1 context) vs one context per model " << (own_total >> 20)
            << " MiB (8 contexts)\n";
  ::testing::Test::RecordProperty("shared_context_bytes",
                                  std::to_string(shared_total));
  ::testing::Test::RecordProperty("per_model_context_bytes",
                                  std::to_string(own_total));
}

TEST(DeviceContext, ContextReportMeasuresTheFirstRetain) {
  auto sim = MakeSim("a10-24gb");
  const SimDeviceSpec& spec = sim->device_spec(0);
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok()) << dc.status();
  const ContextReport& r = (*dc)->initial_context_report();
  EXPECT_FALSE(r.primary_was_active);
  EXPECT_EQ(r.total_bytes, spec.capacity_bytes);
  EXPECT_EQ(r.free_before_retain_bytes, spec.capacity_bytes);
  EXPECT_EQ(r.free_after_retain_bytes,
            spec.capacity_bytes - spec.context_overhead_bytes);
  EXPECT_EQ(r.context_bytes, spec.context_overhead_bytes);
  EXPECT_EQ(r.device_name, spec.name);
  EXPECT_GT(r.limits.stack_size, 0u);
  EXPECT_GT(r.limits.malloc_heap_size, 0u);
  EXPECT_GT(r.limits.printf_fifo_size, 0u);
  EXPECT_LE(r.priorities.greatest, r.priorities.least);
  const std::string text = r.ToString();
  EXPECT_NE(text.find("primary context"), std::string::npos) << text;
  EXPECT_NE(text.find("limits"), std::string::npos) << text;
}

TEST(DeviceContext, PrimaryAlreadyRetainedElsewhereIsSharedNotRecreated) {
  auto sim = MakeSim();
  ASSERT_TRUE(sim->PrimaryCtxRetain(0).ok());  // e.g. the CUDA runtime
  {
    auto dc = DeviceContext::Create(*sim, 0, Plain());
    ASSERT_TRUE(dc.ok()) << dc.status();
    EXPECT_TRUE((*dc)->initial_context_report().primary_was_active);
    EXPECT_EQ((*dc)->initial_context_report().context_bytes, 0u);
    EXPECT_EQ(sim->primary_ctx_refcount(0), 2);
    EXPECT_EQ(sim->contexts_created(0), 1);
  }
  EXPECT_EQ(sim->primary_ctx_refcount(0), 1);  // ours released, theirs kept
  EXPECT_TRUE(sim->PrimaryCtxRelease(0).ok());
}

TEST(DeviceContext, SetContextLimitsLowersThem) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok()) << dc.status();
  const ContextLimits before = (*dc)->initial_context_report().limits;
  auto now = (*dc)->SetContextLimits(
      {.stack_size = 512, .malloc_heap_size = 0, .printf_fifo_size = 64 << 10});
  ASSERT_TRUE(now.ok()) << now.status();
  EXPECT_EQ(now->stack_size, 512u);
  EXPECT_EQ(now->malloc_heap_size, before.malloc_heap_size);  // unchanged
  EXPECT_EQ(now->printf_fifo_size, 64u << 10);
  auto report = (*dc)->GetContextReport();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->limits.stack_size, 512u);
  EXPECT_EQ(sim->misuse_count(), 0u);
}

TEST(DeviceContext, WarnsWhenAnotherContextIsCurrent) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok()) << dc.status();
  EXPECT_TRUE((*dc)->CheckCurrentContext().ok());  // nothing current
  ASSERT_TRUE((*dc)->MakeCurrent().ok());
  EXPECT_EQ(*sim->CtxGetCurrent(), (*dc)->context());
  EXPECT_TRUE((*dc)->CheckCurrentContext().ok());
  auto foreign = sim->CtxCreate(0, 0);  // current on this thread now
  ASSERT_TRUE(foreign.ok());
  absl::Status s = (*dc)->CheckCurrentContext();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("context explosion"), std::string::npos) << s;
  EXPECT_EQ((*dc)->Stats().foreign_context_warnings, 1);
  ASSERT_TRUE(sim->CtxDestroy(*foreign).ok());
  ASSERT_TRUE(sim->CtxSetCurrent(ContextHandle()).ok());
}

TEST(DeviceContext, DriverCallsRestoreTheCallersContext) {
  auto sim = MakeSim();
  ASSERT_TRUE(sim->CtxGetCurrent()->is_null());
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok());
  EXPECT_TRUE(sim->CtxGetCurrent()->is_null());
  auto s = (*dc)->OpenSession("bert", {.streams = 2});
  ASSERT_TRUE(s.ok());
  auto p = (*s)->Allocate(4 << 20, (*s)->stream(1));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE((*s)->Deallocate(*p).ok());
  EXPECT_TRUE((*s)->Close().ok());
  EXPECT_TRUE(sim->CtxGetCurrent()->is_null());
  EXPECT_EQ(sim->misuse_count(), 0u) << sim->misuse_log().front();
}

TEST(DeviceContext, StreamsAreCreatedOnceAndReusedAcrossSessions) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok());
  std::set<StreamHandle> first;
  {
    auto a = (*dc)->OpenSession("a", {.streams = 3});
    ASSERT_TRUE(a.ok());
    first.insert((*a)->streams().begin(), (*a)->streams().end());
    EXPECT_EQ(first.size(), 3u);
    EXPECT_TRUE((*a)->Close().ok());
  }
  EXPECT_EQ(sim->call_count(SimCall::kStreamCreate), 3u);
  for (int round = 0; round < 4; ++round) {
    auto b = (*dc)->OpenSession("b", {.streams = 3});
    ASSERT_TRUE(b.ok());
    std::set<StreamHandle> again((*b)->streams().begin(),
                                 (*b)->streams().end());
    EXPECT_EQ(again, first);
    EXPECT_TRUE((*b)->Close().ok());
  }
  EXPECT_EQ(sim->call_count(SimCall::kStreamCreate), 3u);
  DeviceContextStats st = (*dc)->Stats();
  EXPECT_EQ(st.streams_created, 3);
  EXPECT_EQ(st.streams_idle, 3);
  EXPECT_EQ(st.streams_leased, 0);
  EXPECT_EQ(st.stream_leases, 15);
  EXPECT_EQ(st.sessions_opened, 5);
  EXPECT_EQ(st.sessions_closed, 5);
}

TEST(DeviceContext, OpenSessionsHaveDisjointStreamsAndPrioritiesArePooled) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok());
  auto low = (*dc)->OpenSession("low", {.streams = 2});
  auto high = (*dc)->OpenSession(
      "high", {.streams = 2, .priority = StreamPriority::kHigh});
  ASSERT_TRUE(low.ok() && high.ok());
  std::set<StreamHandle> all((*low)->streams().begin(),
                             (*low)->streams().end());
  all.insert((*high)->streams().begin(), (*high)->streams().end());
  EXPECT_EQ(all.size(), 4u);
  std::vector<StreamHandle> high_streams((*high)->streams().begin(),
                                         (*high)->streams().end());
  EXPECT_TRUE((*low)->Close().ok());
  EXPECT_TRUE((*high)->Close().ok());
  // A new high-priority session gets the high-priority streams back.
  auto high2 = (*dc)->OpenSession(
      "high2", {.streams = 2, .priority = StreamPriority::kHigh});
  ASSERT_TRUE(high2.ok());
  std::vector<StreamHandle> again((*high2)->streams().begin(),
                                  (*high2)->streams().end());
  std::sort(again.begin(), again.end());
  std::sort(high_streams.begin(), high_streams.end());
  EXPECT_EQ(again, high_streams);
  EXPECT_EQ(sim->call_count(SimCall::kStreamCreate), 4u);
}

TEST(DeviceContext, StreamPoolReserveCreatesUpFront) {
  auto sim = MakeSim();
  DeviceContextOptions o = Plain();
  o.stream_pool_reserve = 2;
  auto dc = DeviceContext::Create(*sim, 0, o);
  ASSERT_TRUE(dc.ok()) << dc.status();
  EXPECT_EQ(sim->call_count(SimCall::kStreamCreate), 4u);
  auto s = (*dc)->OpenSession("m", {.streams = 2});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(sim->call_count(SimCall::kStreamCreate), 4u);
  EXPECT_EQ((*dc)->Stats().stream_leases, 2);
}

TEST(DeviceContext, OpenSessionRejectsBadArguments) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok());
  EXPECT_EQ((*dc)->OpenSession("", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*dc)->OpenSession("m", {.streams = 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*dc)
                ->OpenSession("m", {.min_bytes = 2 << 20, .max_bytes = 1 << 20})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  auto m = (*dc)->OpenSession("m", {.streams = 1});
  ASSERT_TRUE(m.ok());
  auto dup = (*dc)->OpenSession("m", {.streams = 1});
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("'m'"), std::string::npos);
  EXPECT_EQ((*dc)->Stats().streams_leased, 1);  // dup returned its streams
  EXPECT_TRUE((*m)->Close().ok());
  EXPECT_TRUE((*dc)->OpenSession("m", {.streams = 1}).ok());  // reopen
}

TEST(DeviceContext, FailedStreamCreationLeasesNothing) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  ASSERT_TRUE(dc.ok());
  sim->InjectFault(SimCall::kStreamCreate, 1, cu::kErrorOutOfMemory);
  auto s = (*dc)->OpenSession("m", {.streams = 2});
  EXPECT_EQ(DriverErrorCode(s.status()), cu::kErrorOutOfMemory);
  EXPECT_EQ((*dc)->Stats().streams_leased, 0);
  EXPECT_EQ((*dc)->Stats().open_sessions, 0);
}

TEST(DeviceContext, BadOrdinalRetainsNothing) {
  auto sim = MakeSim();
  auto dc = DeviceContext::Create(*sim, 3, Plain());
  EXPECT_EQ(dc.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
}

TEST(DeviceContext, FailedRetainLeavesNothing) {
  auto sim = MakeSim();
  sim->InjectFault(SimCall::kPrimaryCtxRetain, 1, cu::kErrorOutOfMemory);
  auto dc = DeviceContext::Create(*sim, 0, Plain());
  EXPECT_EQ(DriverErrorCode(dc.status()), cu::kErrorOutOfMemory);
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
}

TEST(DeviceContext, DestructionReturnsEverything) {
  auto sim = MakeSim();
  {
    auto dc = DeviceContext::Create(*sim, 0, Plain());
    ASSERT_TRUE(dc.ok());
    auto s = (*dc)->OpenSession("m", {.streams = 2});
    ASSERT_TRUE(s.ok());
    auto p = (*s)->Allocate(64 << 20, (*s)->stream(0));
    ASSERT_TRUE(p.ok());
    auto e = (*s)->AcquireEvent();
    ASSERT_TRUE(e.ok());
    ASSERT_TRUE((*s)->ReleaseEvent(*e).ok());
    ASSERT_TRUE((*s)->Deallocate(*p).ok());
    EXPECT_TRUE((*s)->Close().ok());
    EXPECT_GT(sim->used_bytes(0), sim->context_bytes(0));  // cached segments
  }
  EXPECT_EQ(sim->used_bytes(0), 0u);
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  EXPECT_EQ(sim->call_count(SimCall::kStreamDestroy), 2u);
  EXPECT_EQ(sim->call_count(SimCall::kEventDestroy),
            sim->call_count(SimCall::kEventCreate));
  EXPECT_EQ(sim->misuse_count(), 0u) << sim->misuse_log().front();
  EXPECT_GT(sim->total_call_count(), 0u);
}

TEST(DeviceContext, HostAndSlabAllocatorsShareThePrimaryContext) {
  auto sim = MakeSim();
  {
    auto dc = DeviceContext::Create(*sim, 0, Plain());
    ASSERT_TRUE(dc.ok()) << dc.status();
    auto s = (*dc)->OpenSession("m", {.streams = 1});
    ASSERT_TRUE(s.ok());
    auto host = (*dc)->host_allocator().Allocate(1 << 20, (*s)->stream(0));
    ASSERT_TRUE(host.ok()) << host.status();
    auto obj = (*dc)->slab_allocator().Allocate(256, (*s)->stream(0));
    ASSERT_TRUE(obj.ok()) << obj.status();
    EXPECT_EQ(sim->primary_ctx_refcount(0), 1);
    EXPECT_EQ(sim->call_count(SimCall::kPrimaryCtxRetain), 1u);
    ASSERT_TRUE((*dc)->slab_allocator().Deallocate(*obj).ok());
    ASSERT_TRUE((*dc)->host_allocator().Deallocate(*host).ok());
    EXPECT_TRUE((*s)->Close().ok());
  }
  EXPECT_EQ(sim->primary_ctx_refcount(0), 0);
  EXPECT_EQ(sim->used_bytes(0), 0u);
  EXPECT_EQ(sim->misuse_count(), 0u);
}

}  // namespace
}  // namespace ctxpool
