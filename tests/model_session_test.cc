#include "ctxpool/context/model_session.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

constexpr int kAgg = static_cast<int>(StatPool::kAggregate);

class ModelSessionTest : public ::testing::Test {
 protected:
  void SetUp() override { Init("h100-80gb"); }
  void Init(absl::string_view spec) {
    sessions_.clear();
    dc_.reset();
    sim_ = std::move(SimDriver::CreateFromSpec(absl::StrCat("sim:", spec)))
               .value();
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    dc_ = std::move(DeviceContext::Create(*sim_, 0, o)).value();
  }
  // A small device (no context overhead) whose allocator maps granules
  // (kExpandable), so that tenants reclaim from each other under pressure.
  void InitExpandable(std::size_t capacity) {
    sessions_.clear();
    dc_.reset();
    SimDeviceSpec spec;
    spec.capacity_bytes = capacity;
    spec.context_overhead_bytes = 0;
    sim_ = SimDriver::Create({.devices = {spec}});
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    o.allocator.backing = BackingMode::kExpandable;
    dc_ = std::move(DeviceContext::Create(*sim_, 0, o)).value();
  }
  TenantStats Tenant(const ModelSession& s) const {
    absl::StatusOr<TenantStats> t =
        dc_->device_allocator().GetTenantStats(s.tenant());
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *t : TenantStats();
  }
  void TearDown() override {
    sessions_.clear();
    if (dc_ != nullptr) {
      EXPECT_TRUE(dc_->device_allocator().CheckInvariants().ok());
    }
    dc_.reset();
    EXPECT_EQ(sim_->misuse_count(), 0u)
        << (sim_->misuse_count() ? sim_->misuse_log().front() : "");
    EXPECT_EQ(sim_->used_bytes(0), 0u);
  }
  ModelSession& Open(absl::string_view name, SessionOptions o = {}) {
    if (!o.streams.has_value()) o.streams = 1;
    auto s = dc_->OpenSession(name, o);
    EXPECT_TRUE(s.ok()) << s.status();
    sessions_.push_back(std::move(s).value());
    return *sessions_.back();
  }
  std::int64_t DeviceLive() const {
    return dc_->device_allocator().Stats().total.allocated_bytes[kAgg].current;
  }

  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<DeviceContext> dc_;
  std::vector<std::unique_ptr<ModelSession>> sessions_;
};

TEST_F(ModelSessionTest, AllocationsAreChargedToTheSession) {
  ModelSession& bert = Open("bert");
  ModelSession& t5 = Open("t5");
  auto a = bert.Allocate(1000, bert.stream(0), "a");
  auto b = bert.Allocate(4 << 20, bert.stream(0), "b");
  auto c = t5.Allocate(512, t5.stream(0));
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  SessionStats s = bert.Stats();
  EXPECT_EQ(s.live_bytes, 1024u + (4u << 20));  // rounded to 512 B
  EXPECT_EQ(s.requested_bytes, 1000u + (4u << 20));
  EXPECT_EQ(s.live_allocations, 2);
  EXPECT_EQ(t5.Stats().live_bytes, 512u);
  std::vector<LiveAllocation> live = bert.LiveAllocations();
  ASSERT_EQ(live.size(), 2u);
  EXPECT_STREQ(live[0].label != nullptr && *a == live[0].ptr ? live[0].label
                                                             : live[1].label,
               "a");
  ASSERT_TRUE(bert.Deallocate(*a).ok());
  EXPECT_EQ(bert.Stats().live_bytes, 4u << 20);
  EXPECT_EQ(bert.Stats().peak_bytes, 1024u + (4u << 20));
  EXPECT_EQ(bert.Stats().num_frees, 1);
  ASSERT_TRUE(bert.Deallocate(*b).ok());
  ASSERT_TRUE(t5.Deallocate(*c).ok());
  EXPECT_EQ(DeviceLive(), 0);
  EXPECT_TRUE(bert.Close().ok());
  EXPECT_TRUE(t5.Close().ok());
}

TEST_F(ModelSessionTest, MaxBudgetRejectsNamingTheModelOthersUnaffected) {
  ModelSession& bert = Open("bert", {.max_bytes = 1 << 20});
  ModelSession& t5 = Open("t5");
  auto a = bert.Allocate(768 << 10, bert.stream(0));
  ASSERT_TRUE(a.ok());
  auto over = bert.Allocate(512 << 10, bert.stream(0));
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("'bert'"), std::string::npos)
      << over.status();
  EXPECT_NE(over.status().message().find("budget"), std::string::npos);
  EXPECT_EQ(bert.Stats().num_budget_rejections, 1);
  EXPECT_EQ(bert.Stats().live_bytes, 768u << 10);
  auto fits = bert.Allocate(256 << 10, bert.stream(0));  // exactly max
  EXPECT_TRUE(fits.ok()) << fits.status();
  auto other = t5.Allocate(64 << 20, t5.stream(0));
  EXPECT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(bert.Allocate(~std::size_t{0}, bert.stream(0)).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(bert.Deallocate(*a).ok());
  ASSERT_TRUE(bert.Deallocate(*fits).ok());
  ASSERT_TRUE(t5.Deallocate(*other).ok());
}

TEST_F(ModelSessionTest, CloseReportsLeaksNamingTheAllocationAndReclaims) {
  ModelSession& bert = Open("bert", {.streams = 2, .record_times = true});
  auto kv = bert.Allocate(4096, bert.stream(1), "kv_cache");
  auto ok = bert.Allocate(8192, bert.stream(0), "scratch");
  ASSERT_TRUE(kv.ok() && ok.ok());
  ASSERT_TRUE(bert.Deallocate(*ok).ok());
  absl::Status s = bert.Close();
  ASSERT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(s.message());
  EXPECT_NE(msg.find("bert"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1 leaked allocation"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4096 B 'kv_cache'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(absl::StrFormat("0x%x", kv->address())), std::string::npos)
      << msg;
  EXPECT_NE(
      msg.find(absl::StrFormat("on stream 0x%x", bert.streams()[1].value())),
      std::string::npos)
      << msg;
  EXPECT_NE(msg.find("age"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("scratch"), std::string::npos) << msg;  // freed
  EXPECT_EQ(DeviceLive(), 0);                                // reclaimed
  SessionStats st = bert.Stats();
  EXPECT_TRUE(st.closed);
  EXPECT_EQ(st.leaked_allocations, 1);
  EXPECT_EQ(st.leaked_bytes, 4096u);
  EXPECT_EQ(st.live_bytes, 0u);
  DeviceContextStats ds = dc_->Stats();
  EXPECT_EQ(ds.leaked_allocations, 1);
  EXPECT_EQ(ds.leaked_bytes, 4096u);
  EXPECT_EQ(ds.streams_leased, 0);
  EXPECT_EQ(bert.Close().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModelSessionTest, LiveAllocationTimesAreOnAbslClock) {
  // The allocation time is taken from a coarse clock (one kernel tick, a few
  // milliseconds): it lies within a tick of the calls around the Allocate,
  // and later allocations are never older than earlier ones.
  ModelSession& bert = Open("bert", {.record_times = true});
  const std::int64_t before = absl::GetCurrentTimeNanos();
  auto a = bert.Allocate(4096, bert.stream(0), "a");
  absl::SleepFor(absl::Milliseconds(30));
  auto b = bert.Allocate(4096, bert.stream(0), "b");
  const std::int64_t after = absl::GetCurrentTimeNanos();
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<LiveAllocation> live = bert.LiveAllocations();
  ASSERT_EQ(live.size(), 2u);
  std::int64_t at_a = 0, at_b = 0;
  for (const LiveAllocation& l : live) {
    (l.ptr == *a ? at_a : at_b) = l.allocated_at_ns;
  }
  // The coarse clock trails by 0 to a few ticks (measured up to 10.6 ms on a
  // loaded 2-core VM); 100 ms leaves room for sanitizer builds in CI. It
  // never leads: 1 ms above covers absl's interpolation of its clock.
  constexpr std::int64_t kTick = 100'000'000;
  EXPECT_GE(at_a, before - kTick);
  EXPECT_LE(at_b, after + 1'000'000);
  EXPECT_GE(at_b - at_a, 10'000'000);  // the 30 ms sleep shows
  ASSERT_TRUE(bert.Deallocate(*a).ok());
  ASSERT_TRUE(bert.Deallocate(*b).ok());
}

TEST_F(ModelSessionTest, TimesAreRecordedOnlyWhenAsked) {
  // Off by default: the leak report names every allocation without an age
  // and LiveAllocations reads 0; CTXPOOL_SESSION_TIMES (the option table)
  // turns it on for sessions that do not say, and SessionOptions wins over
  // the table either way.
  ReloadOptions();
  ModelSession& plain = Open("plain");
  ASSERT_TRUE(SetOption(OptionId::kSessionTimes, "true").ok());
  ModelSession& by_table = Open("by_table");
  ModelSession& refused = Open("refused", {.record_times = false});
  ReloadOptions();
  const std::int64_t before = absl::GetCurrentTimeNanos();
  auto p = plain.Allocate(4096, plain.stream(0), "p");
  auto t = by_table.Allocate(4096, by_table.stream(0), "t");
  auto r = refused.Allocate(4096, refused.stream(0), "r");
  ASSERT_TRUE(p.ok() && t.ok() && r.ok());
  ASSERT_EQ(plain.LiveAllocations().size(), 1u);
  EXPECT_EQ(plain.LiveAllocations()[0].allocated_at_ns, 0);
  ASSERT_EQ(refused.LiveAllocations().size(), 1u);
  EXPECT_EQ(refused.LiveAllocations()[0].allocated_at_ns, 0);
  ASSERT_EQ(by_table.LiveAllocations().size(), 1u);
  EXPECT_GE(by_table.LiveAllocations()[0].allocated_at_ns,
            before - 100'000'000);
  ASSERT_TRUE(by_table.Deallocate(*t).ok());
  ASSERT_TRUE(plain.Deallocate(*p).ok());
  auto leak = plain.Allocate(4096, plain.stream(0), "leaked");
  ASSERT_TRUE(leak.ok());
  absl::Status closed = plain.Close();
  ASSERT_EQ(closed.code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(closed.message());
  EXPECT_NE(msg.find("4096 B 'leaked'"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("age"), std::string::npos) << msg;
  ASSERT_TRUE(refused.Deallocate(*r).ok());
}

TEST(LiveAllocationTest, AgeIsNeverNegative) {
  // A wall-clock step back puts "now" before the stamp: the age reads 0.
  LiveAllocation l;
  l.bytes = 4096;
  l.allocated_at_ns = 2'000'000'000;
  EXPECT_TRUE(absl::EndsWith(l.ToString("bert", 1'000'000'000), ", age 0"))
      << l.ToString("bert", 1'000'000'000);
  EXPECT_TRUE(absl::EndsWith(l.ToString("bert", 2'001'500'000), ", age 1.5ms"))
      << l.ToString("bert", 2'001'500'000);
  // No time recorded: no age.
  l.allocated_at_ns = 0;
  EXPECT_TRUE(absl::EndsWith(l.ToString("bert", 2'001'500'000), "stream 0x0"))
      << l.ToString("bert", 2'001'500'000);
}

TEST_F(ModelSessionTest, CloseReturnsMemoryForTheNextSession) {
  Init("8GiB");  // 8 GiB device, 500 MiB of context
  ModelSession& a = Open("a");
  auto big = a.Allocate(std::size_t{6} << 30, a.stream(0), "weights");
  ASSERT_TRUE(big.ok()) << big.status();
  ModelSession& b = Open("b");
  auto no = b.Allocate(std::size_t{6} << 30, b.stream(0));
  ASSERT_EQ(no.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(no.status().message().find("'b'"), std::string::npos);
  EXPECT_EQ(b.Stats().num_ooms, 1);
  EXPECT_FALSE(a.Close().ok());  // leaks the weights, which are reclaimed
  auto yes = b.Allocate(std::size_t{6} << 30, b.stream(0));
  ASSERT_TRUE(yes.ok()) << yes.status();
  ASSERT_TRUE(b.Deallocate(*yes).ok());
  EXPECT_TRUE(b.Close().ok());
}

TEST_F(ModelSessionTest, DestroyingWithoutCloseClosesAndCountsLeaks) {
  {
    auto s = dc_->OpenSession("bert", {.streams = 1});
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Allocate(1 << 20, (*s)->stream(0), "act").ok());
    ASSERT_TRUE((*s)->Allocate(3 << 20, (*s)->stream(0), "act2").ok());
  }
  DeviceContextStats st = dc_->Stats();
  EXPECT_EQ(st.sessions_destroyed_unclosed, 1);
  EXPECT_EQ(st.leaked_allocations, 2);
  EXPECT_EQ(st.leaked_bytes, 4u << 20);
  EXPECT_EQ(st.open_sessions, 0);
  EXPECT_EQ(st.streams_leased, 0);
  EXPECT_EQ(DeviceLive(), 0);
  auto totals = dc_->ModelTotals();
  ASSERT_EQ(totals.size(), 1u);
  EXPECT_EQ(totals[0].first, "bert");
  EXPECT_EQ(totals[0].second.leaked_bytes, 4u << 20);
}

TEST_F(ModelSessionTest, BadFreesAreReportedNotFatal) {
  ModelSession& a = Open("a");
  ModelSession& b = Open("b");
  auto p = a.Allocate(1 << 10, a.stream(0));
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(b.Deallocate(*p).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Deallocate(DevicePtr(12345)).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.Deallocate(*p).ok());
  absl::Status twice = a.Deallocate(*p);
  EXPECT_EQ(twice.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("'a'"), std::string::npos);
  EXPECT_EQ(a.Stats().invalid_frees, 2);
  EXPECT_EQ(b.Stats().invalid_frees, 1);
  EXPECT_EQ(a.RecordStream(*p, b.stream(0)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelSessionTest, CallsAfterCloseFail) {
  ModelSession& a = Open("a");
  ASSERT_TRUE(a.Close().ok());
  EXPECT_EQ(a.Allocate(1, StreamHandle()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.Deallocate(DevicePtr(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.AcquireEvent().status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.Warmup({}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModelSessionTest, RecordStreamAndTheAllocatorHandle) {
  ModelSession& a = Open("a", {.streams = 2});
  SessionDeviceAllocator alloc = a.device_allocator();
  auto p = alloc.Allocate(2 << 20, a.stream(0), "shared");
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(dc_->MakeCurrent().ok());  // the "kernels" below need it
  ASSERT_TRUE(sim_->Touch(a.stream(0), *p, 2 << 20).ok());
  ASSERT_TRUE(alloc.RecordStream(*p, a.stream(1)).ok());
  auto e = a.AcquireEvent();  // order stream 1 after stream 0's write
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(sim_->EventRecord(*e, a.stream(0)).ok());
  ASSERT_TRUE(sim_->StreamWaitEvent(a.stream(1), *e).ok());
  ASSERT_TRUE(a.ReleaseEvent(*e).ok());
  ASSERT_TRUE(sim_->Touch(a.stream(1), *p, 2 << 20).ok());
  EXPECT_EQ(a.Stats().live_allocations, 1);
  ASSERT_TRUE(alloc.Deallocate(*p).ok());
  EXPECT_EQ(&alloc.session(), &a);
  EXPECT_TRUE(a.Close().ok());
  EXPECT_EQ(sim_->race_count(), 0u);
}

TEST_F(ModelSessionTest, EventsComeFromAPool) {
  ModelSession& a = Open("a");
  auto e1 = a.AcquireEvent();
  ASSERT_TRUE(e1.ok());
  ASSERT_TRUE(a.ReleaseEvent(*e1).ok());
  auto e2 = a.AcquireEvent();
  ASSERT_TRUE(e2.ok());
  EXPECT_EQ(*e1, *e2);
  EXPECT_EQ(sim_->call_count(SimCall::kEventCreate), 1u);
  ASSERT_TRUE(a.ReleaseEvent(*e2).ok());
  ASSERT_TRUE(a.Close().ok());
  ModelSession& b = Open("b");  // the device's pool keeps a's event
  auto e3 = b.AcquireEvent();
  ASSERT_TRUE(e3.ok());
  EXPECT_EQ(*e3, *e1);
  EXPECT_EQ(sim_->call_count(SimCall::kEventCreate), 1u);
  ASSERT_TRUE(b.ReleaseEvent(*e3).ok());
}

// The request mix of a model, as the test serves it.
WarmupPlan Mix() {
  WarmupPlan plan;
  plan.items = {
      {0, 3 << 20, 2}, {0, 256 << 10, 4}, {1, 64 << 20, 1}, {1, 700, 3}};
  plan.events = 3;
  return plan;
}

// Serves one request of Mix(): allocates it all, uses events, frees it all.
void ServeMix(ModelSession& s) {
  std::vector<DevicePtr> blocks;
  for (const WarmupPlan::Item& item : Mix().items) {
    for (int i = 0; i < item.count; ++i) {
      auto p = s.Allocate(item.bytes, s.stream(item.stream_index), "req");
      ASSERT_TRUE(p.ok()) << p.status();
      blocks.push_back(*p);
    }
  }
  std::vector<EventHandle> events;
  for (int i = 0; i < Mix().events; ++i) {
    auto e = s.AcquireEvent();
    ASSERT_TRUE(e.ok());
    events.push_back(*e);
  }
  for (EventHandle e : events) ASSERT_TRUE(s.ReleaseEvent(e).ok());
  for (DevicePtr p : blocks) ASSERT_TRUE(s.Deallocate(p).ok());
}

struct DriverWork {
  std::uint64_t mem_alloc, mem_create, event_create, stream_create, reserve;
  bool operator==(const DriverWork&) const = default;
};
DriverWork Work(const SimDriver& sim) {
  return {sim.call_count(SimCall::kMemAlloc),
          sim.call_count(SimCall::kMemCreate),
          sim.call_count(SimCall::kEventCreate),
          sim.call_count(SimCall::kStreamCreate),
          sim.call_count(SimCall::kMemAddressReserve)};
}

TEST_F(ModelSessionTest, WarmupMakesTheFirstRequestDriverFree) {
  ModelSession& s = Open("bert", {.streams = 2});
  ASSERT_TRUE(s.Warmup(Mix()).ok());
  EXPECT_EQ(s.Stats().idle_events, 3);
  const DriverWork before = Work(*sim_);
  ServeMix(s);
  EXPECT_EQ(Work(*sim_), before) << "the first request called the driver";
  ServeMix(s);
  EXPECT_EQ(Work(*sim_), before);
  EXPECT_TRUE(s.Close().ok());
}

TEST_F(ModelSessionTest, WithoutWarmupTheFirstRequestCallsTheDriver) {
  ModelSession& s = Open("bert", {.streams = 2});
  const DriverWork before = Work(*sim_);
  ServeMix(s);
  const DriverWork after = Work(*sim_);
  EXPECT_GT(after.mem_alloc + after.mem_create,
            before.mem_alloc + before.mem_create);
  EXPECT_GT(after.event_create, before.event_create);
  EXPECT_TRUE(s.Close().ok());
}

TEST_F(ModelSessionTest, WarmupRejectsABadPlan) {
  ModelSession& s = Open("bert", {.streams = 1});
  WarmupPlan bad;
  bad.items = {{1, 1024, 1}};
  EXPECT_EQ(s.Warmup(bad).code(), absl::StatusCode::kInvalidArgument);
  WarmupPlan too_big;
  too_big.items = {{0, std::size_t{1} << 40, 1}};
  EXPECT_FALSE(s.Warmup(too_big).ok());
  EXPECT_EQ(s.Stats().live_bytes, 0u);
}

TEST_F(ModelSessionTest, MappedAndCachedBytesCoverTheSessionsStreams) {
  ModelSession& a = Open("a");
  ModelSession& b = Open("b");
  auto p = a.Allocate(1 << 20, a.stream(0));
  ASSERT_TRUE(p.ok());
  SessionStats live = a.Stats();
  EXPECT_GE(live.mapped_bytes, 1u << 20);
  EXPECT_EQ(live.cached_bytes, live.mapped_bytes - (1u << 20));
  ASSERT_TRUE(a.Deallocate(*p).ok());
  SessionStats after = a.Stats();
  EXPECT_EQ(after.cached_bytes, after.mapped_bytes);
  EXPECT_EQ(b.Stats().mapped_bytes, 0u);
}

TEST_F(ModelSessionTest, TheBudgetIsTheModelsTenantInTheAllocator) {
  constexpr std::size_t kMiB = 1 << 20;
  ModelSession& bert = Open("bert", {.streams = 2,
                                     .min_bytes = 4 * kMiB,
                                     .high_bytes = 32 * kMiB,
                                     .max_bytes = 64 * kMiB});
  ModelSession& t5 = Open("t5");
  TenantStats b = Tenant(bert);
  EXPECT_EQ(b.name, "bert");
  EXPECT_EQ(b.budget.min, 4 * kMiB);
  EXPECT_EQ(b.budget.high, 32 * kMiB);
  EXPECT_EQ(b.budget.max, kNoLimit);  // the session enforces max (live)
  EXPECT_EQ(b.num_streams, 2);
  TenantStats t = Tenant(t5);
  EXPECT_EQ(t.budget.min, 0u);
  EXPECT_EQ(t.budget.high, kNoLimit);
  EXPECT_EQ(t.budget.max, kNoLimit);
  EXPECT_NE(bert.tenant(), t5.tenant());
  auto p = bert.Allocate(3 * kMiB, bert.stream(1));
  ASSERT_TRUE(p.ok()) << p.status();
  b = Tenant(bert);
  EXPECT_EQ(b.live_bytes, 3 * kMiB);
  EXPECT_EQ(b.mapped_bytes, bert.Stats().mapped_bytes);
  EXPECT_EQ(Tenant(t5).mapped_bytes, 0u);
  ASSERT_TRUE(bert.Deallocate(*p).ok());
  // Close gives the streams back to the default tenant and frees the name:
  // the next session of the model registers again.
  const TenantId old = bert.tenant();
  ASSERT_TRUE(bert.Close().ok());
  EXPECT_EQ(dc_->device_allocator().GetTenantStats(old).status().code(),
            absl::StatusCode::kNotFound);
  ModelSession& again = Open("bert", {.streams = 2});
  EXPECT_EQ(Tenant(again).num_streams, 2);
  EXPECT_EQ(Tenant(again).budget.min, 0u);
}

TEST_F(ModelSessionTest, MinProtectsASessionFromReclaimByAnother) {
  constexpr std::size_t kMiB = 1 << 20;
  InitExpandable(64 * kMiB);
  ModelSession& a = Open("a", {.min_bytes = 16 * kMiB});
  ModelSession& b = Open("b");
  auto big = a.Allocate(48 * kMiB, a.stream(0));
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(a.Deallocate(*big).ok());  // a keeps its granules mapped
  EXPECT_GE(Tenant(a).mapped_bytes, 48 * kMiB);
  // b needs more than the device has free: a's free granules move to b,
  // but a keeps at least its min.
  auto p = b.Allocate(40 * kMiB, b.stream(0));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_GE(Tenant(a).mapped_bytes, 16 * kMiB);
  EXPECT_GT(Tenant(a).reclaimed_from_bytes, 0u);
  EXPECT_EQ(Tenant(b).reclaimed_by_bytes, Tenant(a).reclaimed_from_bytes);
  ASSERT_TRUE(b.Deallocate(*p).ok());
  // Taking more would need a's min: b fails, naming its model.
  auto q = b.Allocate(56 * kMiB, b.stream(0));
  ASSERT_EQ(q.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(q.status().message().find("'b'"), std::string::npos) << q.status();
  EXPECT_GE(Tenant(a).mapped_bytes, 16 * kMiB);
  EXPECT_EQ(b.Stats().num_ooms, 1);
  EXPECT_EQ(Tenant(a).num_ooms, 0);
  // a gets its protected memory at once.
  auto mine = a.Allocate(16 * kMiB, a.stream(0));
  EXPECT_TRUE(mine.ok()) << mine.status();
  if (mine.ok()) {
    EXPECT_TRUE(a.Deallocate(*mine).ok());
  }
}

TEST_F(ModelSessionTest, ConcurrentSessionsAndThreads) {
  constexpr int kModels = 4;
  constexpr int kThreadsPerModel = 2;
  constexpr int kIters = 200;
  std::vector<ModelSession*> models;
  for (int m = 0; m < kModels; ++m) {
    models.push_back(&Open(absl::StrCat("m", m), {.streams = 2}));
  }
  std::vector<std::thread> threads;
  for (int m = 0; m < kModels; ++m) {
    for (int t = 0; t < kThreadsPerModel; ++t) {
      threads.emplace_back([s = models[m], t] {
        std::vector<DevicePtr> held;
        for (int i = 0; i < kIters; ++i) {
          const std::size_t bytes = std::size_t{512} << ((i * 7 + t) % 13);
          auto p = s->Allocate(bytes, s->stream(t % 2));
          ASSERT_TRUE(p.ok()) << p.status();
          held.push_back(*p);
          if (held.size() > 4) {
            ASSERT_TRUE(s->Deallocate(held.front()).ok());
            held.erase(held.begin());
          }
          if (i % 50 == 0) (void)s->Stats();
        }
        for (DevicePtr p : held) ASSERT_TRUE(s->Deallocate(p).ok());
      });
    }
  }
  for (auto& t : threads) t.join();
  for (ModelSession* s : models) {
    EXPECT_EQ(s->Stats().live_bytes, 0u);
    EXPECT_EQ(s->Stats().num_allocs, kThreadsPerModel * kIters);
    EXPECT_TRUE(s->Close().ok());
  }
  EXPECT_EQ(DeviceLive(), 0);
}

// ---- The front end: one critical section, no heap, exact budgets -------

TEST_F(ModelSessionTest, CachedPathMakesNoHeapAllocationNorDriverCall) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  for (bool expandable : {false, true}) {
    if (expandable) InitExpandable(8 * kGiB);
    ModelSession& m =
        Open(expandable ? "vmm" : "classic", {.max_bytes = 1 * kGiB});
    const StreamHandle s = m.stream(0);
    const std::size_t sizes[] = {0, 512, 4096, 65536, 1 << 20, 8 << 20};
    for (std::size_t b : sizes) {  // warm: every size cached on the stream
      absl::StatusOr<DevicePtr> p = m.Allocate(b, s, "warm");
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE(m.Deallocate(*p).ok());
    }
    const std::uint64_t calls = sim_->total_call_count();
    g_allocations = 0;
    g_count_allocations = true;
    bool ok = true;
    for (int round = 0; round < 100; ++round) {
      for (std::size_t b : sizes) {
        absl::StatusOr<DevicePtr> p = m.Allocate(b, s, "hot");
        ok = ok && p.ok() && m.Deallocate(*p).ok();
      }
    }
    g_count_allocations = false;
    EXPECT_TRUE(ok);
    EXPECT_EQ(g_allocations, 0) << (expandable ? "expandable" : "classic");
    EXPECT_EQ(sim_->total_call_count(), calls);
    EXPECT_EQ(m.Stats().num_allocs, 6 + 600);
    EXPECT_EQ(m.Stats().live_bytes, 0u);
    EXPECT_TRUE(m.Close().ok());
    sessions_.clear();
  }
}

TEST_F(ModelSessionTest, BudgetAtItsLimitFromManyThreadsIsExactNeverOver) {
  // Two sessions, each with two streams used by two threads; every thread
  // tries to keep more blocks live than the budget allows. The test's own
  // count of live bytes (raised after a successful Allocate, lowered before
  // Deallocate) is a lower bound of the session's, so it must never pass
  // max; and every refusal must be counted, none invented.
  constexpr std::size_t kMax = 256 * kKiB;
  constexpr std::size_t kBlock = 4 * kKiB;
  constexpr int kWant = 80;  // per thread: 80 x 4 KiB > 256 KiB
  constexpr int kRounds = 20000;
  struct Tally {
    std::atomic<std::int64_t> live{0};
    std::atomic<std::int64_t> worst{0};
    std::atomic<std::int64_t> ok{0};
    std::atomic<std::int64_t> refused{0};
    std::atomic<std::int64_t> other{0};
  };
  ModelSession& a = Open("a", {.streams = 2, .max_bytes = kMax});
  ModelSession& b = Open("b", {.streams = 2, .max_bytes = kMax});
  Tally ta, tb;
  std::atomic<int> ready{0};
  auto worker = [&ready](ModelSession* m, StreamHandle s, Tally* t, int seed) {
    ++ready;
    while (ready.load() < 4) {
    }
    std::vector<DevicePtr> mine;
    unsigned x = static_cast<unsigned>(seed) * 2654435761u + 1;
    for (int r = 0; r < kRounds; ++r) {
      x = x * 1664525u + 1013904223u;
      // 512 B .. 4 KiB (charged in 512 B units), mostly the full block.
      const std::size_t bytes = (x >> 29) == 0 ? 1 + (x >> 8) % kBlock : kBlock;
      if (static_cast<int>(mine.size()) < kWant && (x & 0x300) != 0) {
        absl::StatusOr<DevicePtr> p = m->Allocate(bytes, s, "race");
        if (p.ok()) {
          const std::int64_t charged =
              static_cast<std::int64_t>((bytes + 511) / 512 * 512);
          const std::int64_t now = t->live.fetch_add(charged) + charged;
          std::int64_t w = t->worst.load();
          while (now > w && !t->worst.compare_exchange_weak(w, now)) {
          }
          ++t->ok;
          mine.push_back(*p);
        } else if (absl::IsResourceExhausted(p.status())) {
          ++t->refused;
        } else {
          ++t->other;
        }
      } else if (!mine.empty()) {
        const std::size_t i = (x >> 4) % mine.size();
        absl::StatusOr<BlockInfo> info =
            m->device().device_allocator().Lookup(mine[i]);
        if (!info.ok()) {
          ++t->other;
          continue;
        }
        const std::int64_t charged = static_cast<std::int64_t>(
            (info->requested_bytes + 511) / 512 * 512);
        t->live.fetch_sub(charged);
        if (!m->Deallocate(mine[i]).ok()) ++t->other;
        mine[i] = mine.back();
        mine.pop_back();
      }
    }
    for (DevicePtr p : mine) {
      absl::StatusOr<BlockInfo> info = m->device().device_allocator().Lookup(p);
      if (info.ok()) {
        t->live.fetch_sub(static_cast<std::int64_t>(
            (info->requested_bytes + 511) / 512 * 512));
      }
      if (!m->Deallocate(p).ok()) ++t->other;
    }
  };
  std::vector<std::thread> threads;
  threads.emplace_back(worker, &a, a.stream(0), &ta, 1);
  threads.emplace_back(worker, &a, a.stream(1), &ta, 2);
  threads.emplace_back(worker, &b, b.stream(0), &tb, 3);
  threads.emplace_back(worker, &b, b.stream(1), &tb, 4);
  for (std::thread& t : threads) t.join();
  for (auto [m, t] : {std::pair{&a, &ta}, std::pair{&b, &tb}}) {
    const SessionStats st = m->Stats();
    EXPECT_EQ(t->other.load(), 0) << m->name();
    EXPECT_LE(t->worst.load(), static_cast<std::int64_t>(kMax)) << m->name();
    EXPECT_LE(st.peak_bytes, kMax) << m->name();
    EXPECT_EQ(st.num_allocs, t->ok.load()) << m->name();
    EXPECT_EQ(st.num_frees, t->ok.load()) << m->name();
    EXPECT_EQ(st.num_budget_rejections, t->refused.load()) << m->name();
    EXPECT_GT(t->refused.load(), 0) << m->name() << ": the limit was reached";
    EXPECT_EQ(st.live_bytes, 0u);
    EXPECT_EQ(st.live_allocations, 0);
    EXPECT_EQ(t->live.load(), 0);
  }
  EXPECT_TRUE(dc_->device_allocator().CheckInvariants().ok());
}

TEST_F(ModelSessionTest, FreeOfAnotherSessionsBlockIsRefusedAndKept) {
  ModelSession& a = Open("a");
  ModelSession& b = Open("b");
  absl::StatusOr<DevicePtr> p = a.Allocate(4096, a.stream(0), "a's");
  ASSERT_TRUE(p.ok());
  absl::Status wrong = b.Deallocate(*p);
  EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
  EXPECT_NE(wrong.message().find("'b'"), std::string::npos) << wrong;
  EXPECT_NE(wrong.message().find("'a'"), std::string::npos) << wrong;
  EXPECT_EQ(b.Stats().invalid_frees, 1);
  EXPECT_EQ(a.Stats().live_allocations, 1);  // still a's, still live
  EXPECT_TRUE(dc_->device_allocator().Lookup(*p).ok());
  // A bare free through the shared allocator is charged back to a.
  EXPECT_TRUE(dc_->device_allocator().Deallocate(*p).ok());
  EXPECT_EQ(a.Stats().live_bytes, 0u);
  EXPECT_EQ(a.Stats().num_frees, 1);
  EXPECT_TRUE(a.Deallocate(*p).code() == absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelSessionTest, AllocateRacingCloseNeverOutlivesTheSession) {
  // Threads allocate while another closes the session: whatever they got
  // before Close is reported and reclaimed by it; after Close they get
  // FAILED_PRECONDITION, and nothing is left live or charged.
  for (int trial = 0; trial < 20; ++trial) {
    ModelSession& m = Open(absl::StrCat("m", trial), {.streams = 2});
    std::atomic<bool> go{false};
    std::atomic<int> after_close_ok{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&, t] {
        while (!go.load()) {
        }
        for (int i = 0; i < 200; ++i) {
          const bool closed_before = m.closed();
          absl::StatusOr<DevicePtr> p = m.Allocate(512, m.stream(t));
          if (p.ok() && closed_before) ++after_close_ok;
          if (!p.ok()) {
            EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition)
                << p.status();
          }
        }
      });
    }
    go = true;
    absl::Status closed = m.Close();
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(after_close_ok.load(), 0);
    (void)closed;  // leaks or not, depending on the interleaving
    EXPECT_EQ(DeviceLive(), 0);
    sessions_.clear();
  }
}

TEST_F(ModelSessionTest, StatsDuringCloseNeverLoseTheCounters) {
  // Close unregisters the owner and keeps its final figures in one step, so
  // a Stats() racing with it sees one or the other, never zeros.
  for (int trial = 0; trial < 300; ++trial) {
    ModelSession& m = Open(absl::StrCat("s", trial));
    std::vector<DevicePtr> blocks;
    for (int i = 0; i < 20; ++i)
      blocks.push_back(*m.Allocate(512, m.stream(0)));
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(m.Deallocate(blocks[i]).ok());
    std::atomic<bool> done{false};
    std::atomic<int> wrong{0};
    std::thread poll([&] {
      while (!done.load()) {
        const SessionStats st = m.Stats();
        if (st.num_allocs != 20) ++wrong;
        if (!st.closed && st.live_allocations != 10) ++wrong;
      }
    });
    (void)m.Close();  // 10 leaks
    done = true;
    poll.join();
    EXPECT_EQ(wrong.load(), 0) << trial;
    EXPECT_EQ(m.Stats().num_allocs, 20);
    EXPECT_EQ(m.Stats().leaked_allocations, 10);
    sessions_.clear();
  }
}

TEST_F(ModelSessionTest, CloseRacingFreesCountsOnlyWhatItReclaimed) {
  for (int trial = 0; trial < 50; ++trial) {
    ModelSession& m = Open(absl::StrCat("r", trial), {.streams = 2});
    std::vector<DevicePtr> blocks;
    for (int i = 0; i < 64; ++i)
      blocks.push_back(*m.Allocate(4096, m.stream(0)));
    std::atomic<int> freed{0};
    std::atomic<bool> go{false};
    std::thread t([&] {
      while (!go.load()) {
      }
      for (DevicePtr p : blocks) {
        if (m.Deallocate(p).ok()) ++freed;
      }
    });
    go = true;
    const absl::Status closed = m.Close();
    t.join();
    const SessionStats st = m.Stats();
    EXPECT_EQ(st.leaked_allocations + freed.load(), 64) << closed;
    EXPECT_EQ(st.leaked_bytes,
              static_cast<std::size_t>(64 - freed.load()) * 4096);
    EXPECT_EQ(st.invalid_frees, 0);
    EXPECT_EQ(DeviceLive(), 0);
    sessions_.clear();
  }
}

TEST_F(ModelSessionTest, FreeAfterCloseIsRefusedAndCountsNowhere) {
  ModelSession& m = Open("a");
  const DevicePtr p = *m.Allocate(4096, m.stream(0));
  (void)m.Close();  // reclaims p
  const std::int64_t before = dc_->device_allocator().Stats().invalid_frees;
  EXPECT_EQ(m.Deallocate(p).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(dc_->device_allocator().Stats().invalid_frees, before);
}

TEST_F(ModelSessionTest, HostBadAllocInAnOwnedAllocateLeavesNoTagBehind) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  ModelSession& m = Open("m");
  CachingDeviceAllocator& a = dc_->device_allocator();
  const StreamHandle other = m.stream(0);
  bool threw = false;
  g_fail_allocations = true;  // the new segment's bookkeeping cannot be made
  try {
    (void)m.Allocate(64 << 20, m.stream(0), "boom");
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  g_fail_allocations = false;
  ASSERT_TRUE(threw);
  // A plain allocation afterwards belongs to nobody.
  absl::StatusOr<DevicePtr> p = a.Allocate(4096, other);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(a.Lookup(*p)->owner, kNoOwner);
  EXPECT_EQ(a.Lookup(*p)->label, nullptr);
  EXPECT_EQ(m.Stats().live_allocations, 0);
  EXPECT_TRUE(m.Close().ok());
  EXPECT_TRUE(a.Lookup(*p).ok());  // Close did not take it
  EXPECT_TRUE(a.CheckInvariants().ok());
  EXPECT_TRUE(a.Deallocate(*p).ok());
}

}  // namespace
}  // namespace ctxpool
