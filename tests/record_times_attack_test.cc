// Opt-in allocation times: OwnerOptions and the RegisterOwner(name,
// OwnerOptions) overload, SessionOptions::record_times and
// CTXPOOL_SESSION_TIMES, LiveAllocation::ToString without an age, and the
// owner charge (ChargeInRange for sizes the device can hold, the saturating
// Charge for larger ones, and devices the allocator refuses).
//
// Timed and untimed owners share streams so that blocks (split, coalesced,
// of other sizes) pass between them on both backings; budgets stay exact
// through the new overload; sessions record times on several streams and
// threads; bad option values are refused with an error naming the
// variable; charges are checked from 0 to SIZE_MAX. The PyTorch plugin,
// which opens its sessions with default options, is run in a child process
// with CTXPOOL_SESSION_TIMES set (tests/record_times_attack.cmake gives this
// test the plugin's path; without it those tests skip).
//
// Assertions are on behaviour, never on durations: a stamp is only checked
// to be non-zero and within a generous window around the calls.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"
#include "torch_plugin_api.h"

namespace ctxpool {
namespace {

constexpr std::size_t kSizeMax = std::numeric_limits<std::size_t>::max();
// The coarse clock trails absl's by up to a few ticks; sanitizer builds and
// loaded CI machines stretch that. Generous on purpose: these tests check
// that a stamp is a time at all, not how precise it is.
constexpr std::int64_t kSlackBeforeNs = 1'000'000'000;
constexpr std::int64_t kSlackAfterNs = 1'000'000'000;

// The reference charge: `bytes` rounded up to 512 (512 for 0), saturating.
std::size_t RefCharge(std::size_t bytes) {
  if (bytes == 0) return 512;
  if (bytes > kSizeMax - 512) return kSizeMax;
  return (bytes + 511) / 512 * 512;
}

// "(N B charged)" in an over-budget message, or nullopt.
std::optional<std::size_t> ChargedIn(absl::string_view msg) {
  const std::size_t end = msg.find(" B charged)");
  if (end == absl::string_view::npos) return std::nullopt;
  const std::size_t open = msg.rfind('(', end);
  if (open == absl::string_view::npos) return std::nullopt;
  std::uint64_t n = 0;
  if (!absl::SimpleAtoi(msg.substr(open + 1, end - open - 1), &n)) {
    return std::nullopt;
  }
  return static_cast<std::size_t>(n);
}

// ---- The allocator's owners -------------------------------------------------

class RecordTimesAllocTest : public test::TenantAllocatorTest {
 protected:
  void SetUp() override { Init(1024 * kMiB); }

  OwnerId Owner(const std::string& name, OwnerOptions o) {
    absl::StatusOr<OwnerId> id = alloc_->RegisterOwner(name, o);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : kNoOwner;
  }
  OwnerStats OStats(OwnerId o) {
    absl::StatusOr<OwnerStats> s = alloc_->GetOwnerStats(o);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : OwnerStats();
  }
  std::vector<OwnedBlock> Owned(OwnerId o) {
    absl::StatusOr<std::vector<OwnedBlock>> b = alloc_->OwnedBlocks(o);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *b : std::vector<OwnedBlock>();
  }
  absl::Status FreeOwned(OwnerId o, DevicePtr p) {
    return alloc_->Deallocate(p, FreeCheck{.owner = o});
  }
  StreamHandle NewStream() {
    return *sim_->StreamCreate(kStreamNonBlocking, 0);
  }
};

// The budget is as exact through OwnerOptions as through the size_t
// overload, with and without times, and its rejections report the charge.
TEST_P(RecordTimesAllocTest, BudgetExactThroughTheOptionsOverloadEitherWay) {
  constexpr std::size_t kMax = 1 * kMiB;
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    OwnerId o = kNoOwner;
    if (variant == 0) {
      absl::StatusOr<OwnerId> id =
          alloc_->RegisterOwner(absl::StrCat("size_t", variant), kMax);
      ASSERT_TRUE(id.ok()) << id.status();
      o = *id;
    } else {
      o = Owner(
          absl::StrCat("opts", variant),
          OwnerOptions{.max_live_bytes = kMax, .record_times = variant == 2});
    }
    EXPECT_EQ(OStats(o).max_live_bytes, kMax);
    // Exactly the max, in charges that are not multiples of each other.
    std::vector<DevicePtr> live;
    std::size_t charged = 0;
    const std::size_t sizes[] = {1, 513, 4097, 65535, 0, 300000};
    for (std::size_t s : sizes) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(s, a1_, o, "fill");
      ASSERT_TRUE(p.ok()) << s << ": " << p.status();
      live.push_back(*p);
      charged += RefCharge(s);
    }
    // Top up to exactly kMax with one request.
    const std::size_t rest = kMax - charged;
    ASSERT_GT(rest, 0u);
    absl::StatusOr<DevicePtr> top = alloc_->Allocate(rest, a2_, o, "top");
    ASSERT_TRUE(top.ok()) << top.status();
    live.push_back(*top);
    EXPECT_EQ(OStats(o).live_bytes, kMax);
    // One byte more, on any stream, is refused with its charge named.
    for (StreamHandle s : {a1_, a2_, b1_}) {
      absl::StatusOr<DevicePtr> over = alloc_->Allocate(1, s, o, "over");
      ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted)
          << over.status();
      EXPECT_EQ(ChargedIn(over.status().message()), std::optional<size_t>(512))
          << over.status();
    }
    OwnerStats st = OStats(o);
    EXPECT_EQ(st.live_bytes, kMax);
    EXPECT_LE(st.peak_live_bytes, kMax);
    EXPECT_EQ(st.num_budget_rejections, 3);
    // Every listed block: charge as computed here; times only when asked.
    std::vector<OwnedBlock> owned = Owned(o);
    ASSERT_EQ(owned.size(), live.size());
    std::size_t sum = 0;
    for (const OwnedBlock& b : owned) {
      EXPECT_EQ(b.charged_bytes, RefCharge(b.requested_bytes));
      sum += b.charged_bytes;
      if (variant == 2) {
        EXPECT_NE(b.allocated_at_ns, 0);
      } else {
        EXPECT_EQ(b.allocated_at_ns, 0);
      }
    }
    EXPECT_EQ(sum, kMax);
    // A free makes exactly its charge available again.
    ASSERT_TRUE(FreeOwned(o, live[1]).ok());  // 513 -> 1024 charged
    EXPECT_EQ(OStats(o).live_bytes, kMax - 1024);
    absl::StatusOr<DevicePtr> fits = alloc_->Allocate(1024, b1_, o);
    ASSERT_TRUE(fits.ok()) << fits.status();
    EXPECT_EQ(alloc_->Allocate(0, b1_, o).status().code(),
              absl::StatusCode::kResourceExhausted);
    live[1] = *fits;
    for (DevicePtr p : live) ASSERT_TRUE(FreeOwned(o, p).ok());
    EXPECT_EQ(OStats(o).live_bytes, 0u);
  }
}

// Timed, untimed and plain (kNoOwner) allocations interleave on one stream
// with sizes that make the pool split and coalesce; whatever block an owner
// gets, it is stamped exactly when the owner records times, and the books
// (requested, charged, live) follow op by op.
TEST_P(RecordTimesAllocTest, InterleavedOwnersOnOneStreamSplitAndCoalesce) {
  const OwnerId timed =
      Owner("timed", OwnerOptions{.max_live_bytes = 0, .record_times = true});
  const OwnerId untimed = Owner("untimed", OwnerOptions{});
  const OwnerId budgeted =
      Owner("budgeted",
            OwnerOptions{.max_live_bytes = 48 * kMiB, .record_times = true});
  const OwnerId owners[] = {timed, untimed, budgeted, kNoOwner};
  struct Live {
    DevicePtr p;
    OwnerId owner;
    std::size_t bytes;
  };
  std::vector<Live> live;
  std::map<std::uint64_t, OwnerId> last_owner_at;  // address -> owner
  int handovers = 0;  // an address served one owner, then a different one
  std::mt19937_64 rng(20261206);
  const std::int64_t start = absl::GetCurrentTimeNanos();
  auto check = [&](int step) {
    const std::int64_t now = absl::GetCurrentTimeNanos();
    for (OwnerId o : {timed, untimed, budgeted}) {
      std::vector<OwnedBlock> owned = Owned(o);
      std::size_t expect_n = 0, expect_charge = 0, expect_req = 0;
      for (const Live& l : live) {
        if (l.owner != o) continue;
        ++expect_n;
        expect_charge += RefCharge(l.bytes);
        expect_req += l.bytes;
      }
      ASSERT_EQ(owned.size(), expect_n) << "step " << step << " owner " << o;
      std::size_t charge = 0;
      for (const OwnedBlock& b : owned) {
        charge += b.charged_bytes;
        EXPECT_EQ(b.charged_bytes, RefCharge(b.requested_bytes));
        EXPECT_EQ(b.stream, a1_);
        if (o == untimed) {
          EXPECT_EQ(b.allocated_at_ns, 0)
              << "step " << step << ": untimed block at 0x" << std::hex
              << b.ptr.address() << " carries a time";
        } else {
          EXPECT_GE(b.allocated_at_ns, start - kSlackBeforeNs) << step;
          EXPECT_LE(b.allocated_at_ns, now + kSlackAfterNs) << step;
        }
      }
      OwnerStats st = OStats(o);
      EXPECT_EQ(charge, expect_charge) << step;
      EXPECT_EQ(st.live_bytes, expect_charge) << step;
      EXPECT_EQ(st.requested_bytes, expect_req) << step;
      EXPECT_EQ(st.live_allocations, static_cast<std::int64_t>(expect_n));
    }
  };
  // Phases: big blocks, then many small ones carved out of the same
  // memory, then big again (the small ones' blocks coalesced).
  const std::size_t big[] = {8 * kMiB, 6 * kMiB + 1, 3 * kMiB + 513};
  const std::size_t small[] = {
      0, 1, 511, 512, 513, 4096, 4097, 65536 + 7, 1 * kMiB - 1, 2 * kMiB + 1};
  int step = 0;
  for (int round = 0; round < 6; ++round) {
    const bool use_big = round % 2 == 0;
    const int n = use_big ? 6 : 40;
    for (int i = 0; i < n; ++i, ++step) {
      const OwnerId o = owners[rng() % 4];
      const std::size_t bytes = use_big ? big[rng() % std::size(big)]
                                        : small[rng() % std::size(small)];
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, a1_, o, "x");
      ASSERT_TRUE(p.ok()) << p.status();
      auto prev = last_owner_at.find(p->address());
      if (prev != last_owner_at.end() && prev->second != o) ++handovers;
      last_owner_at[p->address()] = o;
      live.push_back({*p, o, bytes});
      // Free a random live block now and then so that blocks move on.
      if (rng() % 3 == 0) {
        const std::size_t k = rng() % live.size();
        ASSERT_TRUE(
            FreeOwned(live[k].owner == kNoOwner ? kAnyOwner : live[k].owner,
                      live[k].p)
                .ok());
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      }
      if (step % 7 == 0) check(step);
    }
    check(step);
    // Free everything in a shuffled order: neighbours coalesce.
    std::shuffle(live.begin(), live.end(), rng);
    for (const Live& l : live) {
      ASSERT_TRUE(
          FreeOwned(l.owner == kNoOwner ? kAnyOwner : l.owner, l.p).ok());
    }
    live.clear();
    check(step);
  }
  // The point of the test: memory did pass between owners.
  EXPECT_GT(handovers, 10);
}

// Sessions' CloseOwner lists each leak with its owner's kind of stamp;
// a block handed from a timed owner to an untimed one reports 0 there too.
TEST_P(RecordTimesAllocTest, CloseOwnerReportsTimesOnlyForTimedOwners) {
  const OwnerId timed = Owner(
      "timed", OwnerOptions{.max_live_bytes = 8 * kMiB, .record_times = true});
  const OwnerId untimed =
      Owner("untimed", OwnerOptions{.max_live_bytes = 8 * kMiB});
  const std::int64_t before = absl::GetCurrentTimeNanos();
  // Timed allocations, freed: their (split) blocks go back to the cache.
  std::vector<DevicePtr> warm;
  for (std::size_t s : {4096u, 100000u, 1u << 20, 0u}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(s, a1_, timed, "warm");
    ASSERT_TRUE(p.ok()) << p.status();
    warm.push_back(*p);
  }
  for (DevicePtr p : warm) ASSERT_TRUE(FreeOwned(timed, p).ok());
  // The untimed owner takes the same memory in other sizes; the timed one
  // takes some too.
  std::set<std::uint64_t> untimed_ptrs, timed_ptrs;
  for (std::size_t s : {1u << 20, 4096u, 512u, 99999u}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(s, a1_, untimed, "u");
    ASSERT_TRUE(p.ok()) << p.status();
    untimed_ptrs.insert(p->address());
  }
  for (std::size_t s : {0u, 7000u}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(s, a1_, timed, "t");
    ASSERT_TRUE(p.ok()) << p.status();
    timed_ptrs.insert(p->address());
  }
  const std::int64_t after = absl::GetCurrentTimeNanos();
  std::set<std::uint64_t> warm_addrs;
  for (DevicePtr p : warm) warm_addrs.insert(p.address());
  int reused = 0;
  for (std::uint64_t a : untimed_ptrs) reused += warm_addrs.count(a);
  EXPECT_GT(reused, 0) << "the untimed owner got none of the timed blocks";

  std::vector<OwnedBlock> freed;
  ASSERT_TRUE(alloc_->CloseOwner(untimed, &freed).ok());
  ASSERT_EQ(freed.size(), untimed_ptrs.size());
  for (const OwnedBlock& b : freed) {
    EXPECT_TRUE(untimed_ptrs.count(b.ptr.address()));
    EXPECT_EQ(b.allocated_at_ns, 0) << std::hex << b.ptr.address();
    EXPECT_STREQ(b.label, "u");
    EXPECT_EQ(b.charged_bytes, RefCharge(b.requested_bytes));
  }
  ASSERT_TRUE(alloc_->CloseOwner(timed, &freed).ok());
  ASSERT_EQ(freed.size(), timed_ptrs.size());
  for (const OwnedBlock& b : freed) {
    EXPECT_TRUE(timed_ptrs.count(b.ptr.address()));
    EXPECT_GE(b.allocated_at_ns, before - kSlackBeforeNs);
    EXPECT_LE(b.allocated_at_ns, after + kSlackAfterNs);
    EXPECT_STREQ(b.label, "t");
  }
  EXPECT_EQ(OStats(timed).live_bytes, 0u);
  EXPECT_EQ(OStats(untimed).live_bytes, 0u);
  // Closed owners refuse, whatever the size (the too-large path included).
  EXPECT_EQ(alloc_->Allocate(1, a1_, timed).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(alloc_->Allocate(kSizeMax, a1_, untimed).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(alloc_->UnregisterOwner(timed).ok());
  ASSERT_TRUE(alloc_->UnregisterOwner(untimed).ok());
}

// Size 0 is a real, distinct, stamped (when asked) 512 B charge.
TEST_P(RecordTimesAllocTest, SizeZeroIsChargedAndStamped) {
  const OwnerId timed = Owner(
      "timed", OwnerOptions{.max_live_bytes = 2048, .record_times = true});
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(0, a1_, timed, "zero");
    ASSERT_TRUE(p.ok()) << p.status();
    ps.push_back(*p);
  }
  std::set<DevicePtr> distinct(ps.begin(), ps.end());
  EXPECT_EQ(distinct.size(), 4u);
  EXPECT_EQ(OStats(timed).live_bytes, 2048u);
  absl::StatusOr<DevicePtr> fifth = alloc_->Allocate(0, a1_, timed);
  ASSERT_EQ(fifth.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ChargedIn(fifth.status().message()), std::optional<size_t>(512));
  for (const OwnedBlock& b : Owned(timed)) {
    EXPECT_EQ(b.requested_bytes, 0u);
    EXPECT_EQ(b.charged_bytes, 512u);
    EXPECT_NE(b.allocated_at_ns, 0);
  }
  // Freed with the size check at 0.
  for (DevicePtr p : ps) {
    ASSERT_TRUE(alloc_
                    ->Deallocate(p, FreeCheck{.owner = timed,
                                              .check_size = true,
                                              .requested_bytes = 0})
                    .ok());
  }
  EXPECT_EQ(OStats(timed).live_bytes, 0u);
}

// Charges at and beyond the device's total: the in-range formula up to the
// total, the saturating one above, never a wrap to a small charge.
TEST_P(RecordTimesAllocTest, ChargesAtAndBeyondTheDeviceTotal) {
  const std::size_t total = alloc_->device_total_bytes();
  ASSERT_EQ(total, 1024 * kMiB);
  // No max: the whole device is one charge of exactly the total.
  const OwnerId unlimited = Owner("unlimited", OwnerOptions{});
  absl::StatusOr<DevicePtr> whole = alloc_->Allocate(total, a1_, unlimited);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(OStats(unlimited).live_bytes, total);
  ASSERT_TRUE(FreeOwned(unlimited, *whole).ok());
  EXPECT_EQ(OStats(unlimited).live_bytes, 0u);
  // Just under the total: rounds up to the total.
  absl::StatusOr<DevicePtr> almost =
      alloc_->Allocate(total - 1, a1_, unlimited);
  ASSERT_TRUE(almost.ok()) << almost.status();
  EXPECT_EQ(OStats(unlimited).live_bytes, total);
  ASSERT_TRUE(FreeOwned(unlimited, *almost).ok());
  // Beyond the total, without a max: INVALID_ARGUMENT, nothing charged.
  for (std::size_t bytes :
       {total + 1, total + 512, std::size_t{1} << 63, kSizeMax - 512,
        kSizeMax - 511, kSizeMax - 1, kSizeMax}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, a1_, unlimited);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
        << bytes << ": " << p.status();
  }
  EXPECT_EQ(OStats(unlimited).live_bytes, 0u);
  EXPECT_EQ(OStats(unlimited).num_budget_rejections, 0);

  // With a max below the request: the budget speaks first, reporting the
  // rounded (or saturated) charge, never less than the request.
  const OwnerId capped =
      Owner("capped",
            OwnerOptions{.max_live_bytes = 64 * kMiB, .record_times = true});
  std::int64_t rejections = 0;
  for (std::size_t bytes :
       {64 * kMiB + 1, total - 1, total, total + 1, total + 513,
        std::size_t{1} << 63, (std::size_t{1} << 63) + 1, kSizeMax - 1023,
        kSizeMax - 512, kSizeMax - 511, kSizeMax - 1, kSizeMax}) {
    SCOPED_TRACE(bytes);
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, b1_, capped);
    ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
        << p.status();
    ++rejections;
    const std::optional<std::size_t> charged = ChargedIn(p.status().message());
    ASSERT_TRUE(charged.has_value()) << p.status();
    EXPECT_EQ(*charged, RefCharge(bytes)) << p.status();
    EXPECT_GE(*charged, bytes);
  }
  OwnerStats st = OStats(capped);
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.num_budget_rejections, rejections);
  EXPECT_TRUE(Owned(capped).empty());
  // A max of SIZE_MAX: everything the device can hold passes the budget;
  // larger requests fail (too large, or over the budget at SIZE_MAX) and
  // charge nothing.
  const OwnerId huge = Owner(
      "huge", OwnerOptions{.max_live_bytes = kSizeMax, .record_times = true});
  absl::StatusOr<DevicePtr> ok = alloc_->Allocate(total / 2 + 1, a2_, huge);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(OStats(huge).live_bytes, RefCharge(total / 2 + 1));
  for (std::size_t bytes : {total + 1, kSizeMax - 511, kSizeMax}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, a2_, huge);
    EXPECT_NE(p.status().code(), absl::StatusCode::kOk) << bytes;
  }
  EXPECT_EQ(OStats(huge).live_bytes, RefCharge(total / 2 + 1));
  ASSERT_TRUE(FreeOwned(huge, *ok).ok());
  EXPECT_EQ(OStats(huge).live_bytes, 0u);
}

// Threads on several streams, timed and untimed owners sharing them, a
// timed owner with a max: the max is never exceeded, and a listing taken
// mid-flight (all shards locked) has a time on every timed block and on no
// untimed one.
TEST_P(RecordTimesAllocTest, ThreadsTimedAndUntimedOwnersShareStreams) {
  constexpr std::size_t kMax = 512 * 1024;
  const OwnerId timed = Owner(
      "timed", OwnerOptions{.max_live_bytes = kMax, .record_times = true});
  const OwnerId untimed =
      Owner("untimed", OwnerOptions{.max_live_bytes = kMax});
  const StreamHandle c1 = NewStream();
  const StreamHandle streams[] = {a1_, a2_, b1_, c1};
  constexpr int kThreads = 4;
  constexpr int kIters = 3000;
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  // Listings taken so far. Each worker waits halfway, blocks in hand, until
  // there is one, so at least one listing is taken mid-flight however the
  // threads are scheduled.
  std::atomic<int> listings{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      // Each thread alternates owners on two streams, so both owners
      // take blocks the other one freed.
      std::vector<std::pair<DevicePtr, OwnerId>> mine;
      for (int i = 0; i < kIters; ++i) {
        if (i == kIters / 2) {
          while (listings.load() == 0) std::this_thread::yield();
        }
        const OwnerId o = (rng() & 1) ? timed : untimed;
        const StreamHandle s = streams[(t + (rng() & 1)) % 4];
        const std::size_t bytes = (rng() % 4) * 4096 + (rng() % 600);
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s, o, "th");
        if (p.ok()) {
          mine.emplace_back(*p, o);
        } else if (p.status().code() != absl::StatusCode::kResourceExhausted) {
          bad.fetch_add(1);
        }
        if (mine.size() > 40 || (rng() % 2 == 0 && !mine.empty())) {
          const std::size_t k = rng() % mine.size();
          if (!alloc_
                   ->Deallocate(mine[k].first,
                                FreeCheck{.owner = mine[k].second})
                   .ok()) {
            bad.fetch_add(1);
          }
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (const auto& [p, o] : mine) {
        if (!alloc_->Deallocate(p, FreeCheck{.owner = o}).ok()) {
          bad.fetch_add(1);
        }
      }
    });
  }
  // Listings while the threads run.
  std::thread lister([&] {
    while (!stop.load()) {
      absl::StatusOr<std::vector<OwnedBlock>> tb = alloc_->OwnedBlocks(timed);
      absl::StatusOr<std::vector<OwnedBlock>> ub = alloc_->OwnedBlocks(untimed);
      if (!tb.ok() || !ub.ok()) {
        bad.fetch_add(1);
        continue;
      }
      std::size_t tsum = 0;
      for (const OwnedBlock& b : *tb) {
        if (b.allocated_at_ns == 0) bad.fetch_add(1000);
        tsum += b.charged_bytes;
      }
      if (tsum > kMax) bad.fetch_add(100000);
      for (const OwnedBlock& b : *ub) {
        if (b.allocated_at_ns != 0) bad.fetch_add(1000);
      }
      listings.fetch_add(1);
    }
  });
  for (std::thread& th : threads) th.join();
  stop.store(true);
  lister.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(listings, 0);
  for (OwnerId o : {timed, untimed}) {
    OwnerStats st = OStats(o);
    EXPECT_EQ(st.live_bytes, 0u);
    EXPECT_EQ(st.requested_bytes, 0u);
    EXPECT_EQ(st.live_allocations, 0);
    EXPECT_LE(st.peak_live_bytes, kMax);
    EXPECT_EQ(st.num_allocs, st.num_frees);
  }
}

INSTANTIATE_TEST_SUITE_P(Backings, RecordTimesAllocTest, test::kBothBackings,
                         test::BackingName);

// ---- Sessions
// -----------------------------------------------------------------

class RecordTimesSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ReloadOptions();
    sim_ = std::move(SimDriver::CreateFromSpec("sim:a10-24gb")).value();
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    dc_ = std::move(DeviceContext::Create(*sim_, 0, o)).value();
  }
  void TearDown() override {
    sessions_.clear();
    if (dc_ != nullptr) {
      absl::Status inv = dc_->device_allocator().CheckInvariants();
      EXPECT_TRUE(inv.ok()) << inv;
    }
    dc_.reset();
    EXPECT_EQ(sim_->misuse_count(), 0u)
        << (sim_->misuse_count() ? sim_->misuse_log().front() : "");
    EXPECT_EQ(sim_->used_bytes(0), 0u);
    unsetenv("CTXPOOL_SESSION_TIMES");
    ReloadOptions();
  }
  ModelSession& Open(absl::string_view name, SessionOptions o = {}) {
    if (!o.streams.has_value()) o.streams = 1;
    auto s = dc_->OpenSession(name, o);
    EXPECT_TRUE(s.ok()) << name << ": " << s.status();
    if (!s.ok()) {
      // Go on with a session that says what it wants, so that one failure
      // does not take the rest of the test down.
      o.record_times = false;
      s = dc_->OpenSession(absl::StrCat(name, "_fallback"), o);
      if (!s.ok()) std::abort();
    }
    sessions_.push_back(std::move(s).value());
    return *sessions_.back();
  }
  // Whether `s` stamps its allocations: allocate, look, free.
  static bool Stamps(ModelSession& s) {
    absl::StatusOr<DevicePtr> p = s.Allocate(4096, s.stream(0), "probe");
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return false;
    bool stamped = false;
    for (const LiveAllocation& l : s.LiveAllocations()) {
      if (l.ptr == *p) stamped = l.allocated_at_ns != 0;
    }
    EXPECT_TRUE(s.Deallocate(*p).ok());
    return stamped;
  }
  static int Count(const std::string& text, const std::string& what) {
    int n = 0;
    for (std::size_t at = text.find(what); at != std::string::npos;
         at = text.find(what, at + what.size())) {
      ++n;
    }
    return n;
  }

  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<DeviceContext> dc_;
  std::vector<std::unique_ptr<ModelSession>> sessions_;
};

// The streams (and cached blocks) a timed session gives back serve an
// untimed one next, and the other way round: each reads its own kind.
TEST_F(RecordTimesSessionTest, PooledStreamsCarryNoStaleTimesEitherWay) {
  const std::size_t sizes[] = {0, 700, 4096, 1 << 20, (3 << 20) + 1};
  std::set<std::uint64_t> addresses;
  for (int round = 0; round < 4; ++round) {
    const bool timed = round % 2 == 0;
    SCOPED_TRACE(timed ? "timed" : "untimed");
    ModelSession& s =
        Open(absl::StrCat("m", round), {.streams = 2, .record_times = timed});
    std::vector<DevicePtr> ps;
    const std::int64_t before = absl::GetCurrentTimeNanos();
    for (int i = 0; i < 2; ++i) {
      for (std::size_t b : sizes) {
        absl::StatusOr<DevicePtr> p = s.Allocate(b, s.stream(i), "blk");
        ASSERT_TRUE(p.ok()) << p.status();
        ps.push_back(*p);
        addresses.insert(p->address());
      }
    }
    const std::int64_t after = absl::GetCurrentTimeNanos();
    std::vector<LiveAllocation> live = s.LiveAllocations();
    ASSERT_EQ(live.size(), ps.size());
    for (const LiveAllocation& l : live) {
      if (timed) {
        EXPECT_GE(l.allocated_at_ns, before - kSlackBeforeNs);
        EXPECT_LE(l.allocated_at_ns, after + kSlackAfterNs);
        EXPECT_TRUE(absl::StrContains(l.ToString("m", after), ", age "));
      } else {
        EXPECT_EQ(l.allocated_at_ns, 0);
        EXPECT_FALSE(absl::StrContains(l.ToString("m", after), "age"))
            << l.ToString("m", after);
      }
      EXPECT_EQ(l.charged, RefCharge(l.bytes));
    }
    // Free half, leak the rest: Close lists the leaks with or without ages.
    for (std::size_t i = 0; i < ps.size(); i += 2) {
      ASSERT_TRUE(s.Deallocate(ps[i]).ok());
    }
    const std::size_t leaked = ps.size() / 2;
    absl::Status closed = s.Close();
    ASSERT_EQ(closed.code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(closed.message());
    EXPECT_EQ(Count(msg, "\n  leak: "), static_cast<int>(leaked)) << msg;
    EXPECT_EQ(Count(msg, ", age "), timed ? static_cast<int>(leaked) : 0)
        << msg;
  }
  // Memory was reused across the sessions (the pooled streams' cache).
  EXPECT_LT(addresses.size(), 4 * 2 * std::size(sizes));
  EXPECT_EQ(dc_->Stats().streams_leased, 0);
}

// A timed and an untimed session, several streams each, one thread per
// stream; listings and leak reports match each session's choice.
TEST_F(RecordTimesSessionTest, SessionsOnSeveralStreamsAndThreads) {
  ModelSession& timed = Open(
      "timed", {.streams = 3, .max_bytes = 64 * kMiB, .record_times = true});
  ModelSession& untimed =
      Open("untimed", {.streams = 3, .record_times = false});
  constexpr int kPerThread = 25;  // kept live (leaked) by each thread
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  const std::int64_t before = absl::GetCurrentTimeNanos();
  for (ModelSession* s : {&timed, &untimed}) {
    for (int i = 0; i < 3; ++i) {
      threads.emplace_back([s, i, &failures] {
        std::mt19937_64 rng(77 + i);
        std::vector<DevicePtr> churn;
        int kept = 0;
        for (int n = 0; n < 400; ++n) {
          const std::size_t bytes = rng() % 20000;
          absl::StatusOr<DevicePtr> p = s->Allocate(
              bytes, s->stream(i), kept < kPerThread ? "kept" : "churn");
          if (!p.ok()) {
            failures.fetch_add(1);
            continue;
          }
          if (kept < kPerThread) {
            ++kept;
          } else {
            churn.push_back(*p);
          }
          if (churn.size() > 8) {
            if (!s->Deallocate(churn.front()).ok()) failures.fetch_add(1);
            churn.erase(churn.begin());
          }
        }
        for (DevicePtr p : churn) {
          if (!s->Deallocate(p).ok()) failures.fetch_add(1);
        }
      });
    }
  }
  for (std::thread& t : threads) t.join();
  const std::int64_t after = absl::GetCurrentTimeNanos();
  ASSERT_EQ(failures.load(), 0);
  for (ModelSession* s : {&timed, &untimed}) {
    const bool is_timed = s == &timed;
    std::vector<LiveAllocation> live = s->LiveAllocations();
    ASSERT_EQ(live.size(), 3u * kPerThread);
    std::set<StreamHandle> streams;
    for (const LiveAllocation& l : live) {
      streams.insert(l.stream);
      EXPECT_STREQ(l.label, "kept");
      if (is_timed) {
        EXPECT_GE(l.allocated_at_ns, before - kSlackBeforeNs);
        EXPECT_LE(l.allocated_at_ns, after + kSlackAfterNs);
      } else {
        EXPECT_EQ(l.allocated_at_ns, 0);
      }
    }
    EXPECT_EQ(streams.size(), 3u);
    absl::Status closed = s->Close();
    ASSERT_EQ(closed.code(), absl::StatusCode::kFailedPrecondition);
    const std::string msg(closed.message());
    // Close lists the first 32 leaks, then "... and N more".
    constexpr int kListed = std::min(3 * kPerThread, 32);
    EXPECT_EQ(Count(msg, "\n  leak: "), kListed) << msg;
    EXPECT_EQ(Count(msg, ", age "), is_timed ? kListed : 0) << msg;
    EXPECT_TRUE(absl::StrContains(
        msg, absl::StrCat("... and ", 3 * kPerThread - kListed, " more")))
        << msg;
    EXPECT_EQ(s->Stats().leaked_allocations, 3 * kPerThread);
  }
}

// The option table: every documented spelling works; a bad value is
// refused by SetOption (the previous one stays); a bad environment value
// makes OpenSession fail cleanly, naming the variable, leasing nothing,
// unless SessionOptions (or SetOption) decides.
TEST_F(RecordTimesSessionTest, OptionTableSpellingsAndBadValues) {
  int n = 0;
  for (const char* on : {"1", "true", "TRUE", "on", "On", "yes", " yes "}) {
    ASSERT_TRUE(SetOption(OptionId::kSessionTimes, on).ok()) << on;
    ModelSession& s = Open(absl::StrCat("on", n++));
    EXPECT_TRUE(Stamps(s)) << on;
    EXPECT_FALSE(
        Stamps(Open(absl::StrCat("over", n++), {.record_times = false})))
        << on;
  }
  for (const char* off : {"0", "false", "OFF", "no", "No"}) {
    ASSERT_TRUE(SetOption(OptionId::kSessionTimes, off).ok()) << off;
    EXPECT_FALSE(Stamps(Open(absl::StrCat("off", n++)))) << off;
    EXPECT_TRUE(Stamps(Open(absl::StrCat("over", n++), {.record_times = true})))
        << off;
  }
  // Refused; the previous value ("No") stays.
  for (const char* bad : {"maybe", "", "2", "enabled", "tru"}) {
    absl::Status st = SetOption(OptionId::kSessionTimes, bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(GetOption(OptionId::kSessionTimes), "No");
  }
  EXPECT_FALSE(Stamps(Open(absl::StrCat("still_off", n++))));
  // FindOption by name and by variable.
  ASSERT_TRUE(FindOption("session_times").ok());
  EXPECT_EQ(*FindOption("CTXPOOL_SESSION_TIMES"), OptionId::kSessionTimes);
  EXPECT_EQ(GetOptionSpec(OptionId::kSessionTimes).kind, OptionKind::kBool);
  EXPECT_TRUE(absl::StrContains(DescribeOptions(), "CTXPOOL_SESSION_TIMES"));

  // A bad environment value.
  const DeviceContextStats before = dc_->Stats();
  setenv("CTXPOOL_SESSION_TIMES", "maybe", 1);
  ReloadOptions();
  EXPECT_EQ(GetOptionBool(OptionId::kSessionTimes).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<ModelSession>> failed =
      dc_->OpenSession("victim", {.streams = 2});
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInvalidArgument)
      << failed.status();
  EXPECT_TRUE(
      absl::StrContains(failed.status().message(), "CTXPOOL_SESSION_TIMES"))
      << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "maybe"))
      << failed.status();
  // Nothing leased, nothing half-open: the name is free.
  DeviceContextStats after = dc_->Stats();
  EXPECT_EQ(after.open_sessions, before.open_sessions);
  EXPECT_EQ(after.streams_leased, before.streams_leased);
  EXPECT_EQ(after.sessions_opened, before.sessions_opened);
  // SessionOptions decides without the table.
  EXPECT_TRUE(Stamps(Open("victim", {.streams = 2, .record_times = true})));
  EXPECT_FALSE(Stamps(Open("victim2", {.record_times = false})));
  // SetOption wins over the bad environment.
  ASSERT_TRUE(SetOption(OptionId::kSessionTimes, "yes").ok());
  EXPECT_TRUE(Stamps(Open("victim3")));
  // Empty in the environment: also a bad value, also a clean error.
  setenv("CTXPOOL_SESSION_TIMES", "", 1);
  ReloadOptions();
  absl::StatusOr<std::unique_ptr<ModelSession>> empty =
      dc_->OpenSession("victim4", {});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  setenv("CTXPOOL_SESSION_TIMES", "on", 1);
  ReloadOptions();
  EXPECT_TRUE(Stamps(Open("victim4")));
}

// Budgets through the session: the max is exact with times on, and a
// rejection leaves no stamped block behind.
TEST_F(RecordTimesSessionTest, SessionBudgetExactWithTimes) {
  ModelSession& s = Open(
      "capped", {.streams = 2, .max_bytes = 1 * kMiB, .record_times = true});
  std::vector<DevicePtr> ps;
  for (int i = 0; i < 2048; ++i) {
    absl::StatusOr<DevicePtr> p =
        s.Allocate(i % 3 == 0 ? 0 : 300, s.stream(i % 2), "b");
    ASSERT_TRUE(p.ok()) << i << ": " << p.status();
    ps.push_back(*p);
  }
  EXPECT_EQ(s.Stats().live_bytes, 1 * kMiB);
  absl::StatusOr<DevicePtr> over = s.Allocate(0, s.stream(1), "over");
  ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "capped"))
      << over.status();
  std::vector<LiveAllocation> live = s.LiveAllocations();
  EXPECT_EQ(live.size(), ps.size());
  for (const LiveAllocation& l : live) {
    EXPECT_NE(l.allocated_at_ns, 0);
    EXPECT_STREQ(l.label, "b");
  }
  for (DevicePtr p : ps) ASSERT_TRUE(s.Deallocate(p).ok());
  EXPECT_TRUE(s.Close().ok());
}

// A driver that reports a device total near SIZE_MAX (an "unlimited"
// all-ones total from a fake or broken driver; SimDriver takes it): every
// request would pass the too-large check, and a charge or a rounding of a
// size near 2^64 would wrap (a 0-byte charge let an owner capped at 1 MiB
// allocate SIZE_MAX - 100 bytes). Create refuses any total above 2^62 with
// a clear error; at exactly 2^62 the owner's budget stays a hard limit and
// a plain request of SIZE_MAX is refused as larger than the device.
// RegisterOwner(name, true) would quietly be a max of 1 byte: it does not
// compile; a max and OwnerOptions do.
template <typename A>
constexpr bool kRegistersWithBool = requires(A& a) {
  a.RegisterOwner("x", true);
};
template <typename A>
constexpr bool kRegistersWithMaxOrOptions = requires(A& a) {
  a.RegisterOwner("x", std::size_t{1} << 20);
  a.RegisterOwner("x", OwnerOptions{.record_times = true});
};
static_assert(!kRegistersWithBool<CachingDeviceAllocator>);
static_assert(kRegistersWithMaxOrOptions<CachingDeviceAllocator>);

TEST(RecordTimesHugeDeviceTest, DriverReportingMoreThan2To62IsRefused) {
  for (std::size_t total :
       {kSizeMax, kSizeMax - 510, (std::size_t{1} << 62) + 1}) {
    SCOPED_TRACE(total);
    SimDeviceSpec spec;
    spec.capacity_bytes = total;
    spec.context_overhead_bytes = 0;
    std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {spec}});
    ContextHandle ctx = *sim->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim->CtxSetCurrent(ctx).ok());
    for (BackingMode m : {BackingMode::kClassic, BackingMode::kExpandable}) {
      DeviceAllocatorOptions o;
      o.backing = m;
      absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> a =
          CachingDeviceAllocator::Create(*sim, 0, o);
      ASSERT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition)
          << a.status();
      EXPECT_TRUE(absl::StrContains(a.status().message(), "2^62"))
          << a.status();
    }
    ASSERT_TRUE(sim->PrimaryCtxRelease(0).ok());
  }
}

TEST(RecordTimesHugeDeviceTest, BudgetHoldsOnTheLargestDeviceAccepted) {
  SimDeviceSpec spec;
  spec.capacity_bytes = std::size_t{1} << 62;
  spec.context_overhead_bytes = 0;
  std::unique_ptr<SimDriver> sim = SimDriver::Create({.devices = {spec}});
  ContextHandle ctx = *sim->PrimaryCtxRetain(0);
  ASSERT_TRUE(sim->CtxSetCurrent(ctx).ok());
  const StreamHandle s = *sim->StreamCreate(kStreamNonBlocking, 0);
  DeviceAllocatorOptions o;
  o.backing = BackingMode::kClassic;
  absl::StatusOr<std::unique_ptr<CachingDeviceAllocator>> a =
      CachingDeviceAllocator::Create(*sim, 0, o);
  ASSERT_TRUE(a.ok()) << a.status();
  CachingDeviceAllocator& alloc = **a;
  ASSERT_EQ(alloc.device_total_bytes(), std::size_t{1} << 62);
  absl::StatusOr<OwnerId> owner = alloc.RegisterOwner(
      "capped", OwnerOptions{.max_live_bytes = 1 * kMiB, .record_times = true});
  ASSERT_TRUE(owner.ok()) << owner.status();
  // Once cold (slow path), once with a cached block on the stream.
  for (int warm = 0; warm < 2; ++warm) {
    SCOPED_TRACE(warm ? "cached" : "cold");
    if (warm) {
      absl::StatusOr<DevicePtr> w = alloc.Allocate(4096, s, *owner);
      ASSERT_TRUE(w.ok()) << w.status();
      ASSERT_TRUE(alloc.Deallocate(*w).ok());
    }
    for (std::size_t bytes :
         {2 * kMiB, std::size_t{1} << 62, (std::size_t{1} << 62) + 1,
          kSizeMax - 510, kSizeMax - 100, kSizeMax}) {
      SCOPED_TRACE(bytes);
      absl::StatusOr<DevicePtr> p = alloc.Allocate(bytes, s, *owner);
      EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
          << p.status();
      absl::StatusOr<OwnerStats> st = alloc.GetOwnerStats(*owner);
      ASSERT_TRUE(st.ok());
      EXPECT_EQ(st->live_bytes, 0u);
      if (p.ok()) {
        ASSERT_TRUE(alloc.Deallocate(*p).ok());
      }
    }
  }
  // Without an owner: larger than the device, refused, nothing allocated.
  for (std::size_t bytes : {(std::size_t{1} << 62) + 1, kSizeMax}) {
    absl::StatusOr<DevicePtr> p = alloc.Allocate(bytes, s);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument)
        << bytes << ": " << p.status();
  }
  EXPECT_EQ(alloc.Stats().total.allocation[0].current, 0);
  EXPECT_TRUE(alloc.CheckInvariants().ok());
}

// ---- LiveAllocation::ToString
// ---------------------------------------------------

TEST(RecordTimesToStringTest, AgeOnlyWhenATimeWasRecorded) {
  LiveAllocation l;
  l.ptr = DevicePtr(0x7f0000200000);
  l.bytes = 4096;
  l.stream = StreamHandle(0x1);
  l.label = "page_table";  // contains "age": the check is for ", age "
  EXPECT_EQ(l.ToString("bert", 5'000'000'000),
            "bert: 4096 B 'page_table' at 0x7f0000200000 on stream 0x1");
  l.label = nullptr;
  EXPECT_EQ(l.ToString("bert", 5'000'000'000),
            "bert: 4096 B at 0x7f0000200000 on stream 0x1");
  // Recorded: the age, never negative.
  l.allocated_at_ns = 4'998'800'000;
  EXPECT_EQ(l.ToString("bert", 5'000'000'000),
            "bert: 4096 B at 0x7f0000200000 on stream 0x1, age 1.2ms");
  EXPECT_EQ(l.ToString("bert", 1),
            "bert: 4096 B at 0x7f0000200000 on stream 0x1, age 0");
  // now_ns 0 with a recorded time: still an age (0), no crash.
  EXPECT_TRUE(absl::EndsWith(l.ToString("bert", 0), ", age 0"))
      << l.ToString("bert", 0);
  // Extreme values do not overflow into nonsense.
  l.allocated_at_ns = 1;
  const std::string big =
      l.ToString("bert", std::numeric_limits<std::int64_t>::max());
  EXPECT_TRUE(absl::StrContains(big, ", age ")) << big;
  EXPECT_FALSE(absl::StrContains(big, "-")) << big;
  l.allocated_at_ns = std::numeric_limits<std::int64_t>::max();
  EXPECT_TRUE(absl::EndsWith(l.ToString("bert", 0), ", age 0"))
      << l.ToString("bert", 0);
  // The size 0 and SIZE_MAX render as numbers.
  l.allocated_at_ns = 0;
  l.bytes = 0;
  EXPECT_EQ(l.ToString("m", 0), "m: 0 B at 0x7f0000200000 on stream 0x1");
  l.bytes = kSizeMax;
  EXPECT_EQ(l.ToString("m", 0),
            "m: 18446744073709551615 B at 0x7f0000200000 on stream 0x1");
}

// ---- The PyTorch plugin with CTXPOOL_SESSION_TIMES
// -------------------------------

std::string PluginPath() { return CTXPOOL_TORCH_PLUGIN_PATH; }

// Runs this executable with only PluginChild.<test> on two simulated A10s
// and the extra environment `env` ("K=V" sets, a bare "K" unsets); true
// when that one test ran and passed.
bool RunChild(const std::string& test, std::vector<std::string> env,
              std::string* output) {
  env.insert(env.begin(), "CTXPOOL_DRIVER=sim:2xa10-24gb");
  return torch_plugin_test::RunTestInChild("PluginChild", test,
                                           "CTXPOOL_TIMES_CHILD", env, output);
}

class PluginChild : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!torch_plugin_test::InChildFor("CTXPOOL_TIMES_CHILD")) {
      GTEST_SKIP() << "runs in a child process only";
    }
    handle_ = dlopen(PluginPath().c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    torch_plugin_test::ResolveApi(handle_, &api_);
    ASSERT_NE(api_.try_malloc, nullptr);
  }
  // Leaks one 4096 B block of model "leaky" on device 0 and shuts down with
  // force: the session is destroyed unclosed and its leak report goes to
  // stderr (the parent reads it).
  void LeakAndShutDown() {
    ASSERT_EQ(api_.set_model("leaky"), 0);
    void* p = api_.try_malloc(4096, 0, nullptr);
    ASSERT_NE(p, nullptr) << api_.last_error();
    EXPECT_EQ(api_.shutdown(0), -1);  // refused: one live allocation
    EXPECT_EQ(api_.shutdown(1), 0) << api_.last_error();
  }
  void* handle_ = nullptr;
  torch_plugin_test::Api api_;
};

TEST_F(PluginChild, TimesOn) {
  ASSERT_EQ(api_.set_model("timed_model"), 0);
  std::vector<void*> ps;
  for (std::size_t s : {std::size_t{0}, std::size_t{1}, std::size_t{4096},
                        std::size_t{3} << 20}) {
    void* p = api_.try_malloc(s, 0, nullptr);
    ASSERT_NE(p, nullptr) << s << ": " << api_.last_error();
    ps.push_back(p);
  }
  void* p1 = api_.malloc(1000, 1, nullptr);
  ASSERT_NE(p1, nullptr);
  const std::string stats = api_.memory_stats(0);
  EXPECT_EQ(torch_plugin_test::JsonInt(stats, "allocation.all.current"), 4)
      << stats;
  std::size_t i = 0;
  for (std::size_t s : {std::size_t{0}, std::size_t{1}, std::size_t{4096},
                        std::size_t{3} << 20}) {
    api_.free(ps[i++], s, 0, nullptr);
  }
  api_.free(p1, 1000, 1, nullptr);
  EXPECT_EQ(torch_plugin_test::JsonInt(api_.memory_stats(0),
                                       "allocation.all.current"),
            0);
  EXPECT_EQ(api_.shutdown(0), 0) << api_.last_error();
  LeakAndShutDown();
}

// The same leak without times (the parent checks the report has no age).
TEST_F(PluginChild, TimesOff) { LeakAndShutDown(); }

TEST_F(PluginChild, TimesBad) {
  ASSERT_EQ(api_.set_model("m"), 0);
  for (int attempt = 0; attempt < 2; ++attempt) {
    void* p = api_.try_malloc(4096, 0, nullptr);
    EXPECT_EQ(p, nullptr);
    const std::string err = api_.last_error() ? api_.last_error() : "";
    EXPECT_TRUE(absl::StrContains(err, "CTXPOOL_SESSION_TIMES")) << err;
    EXPECT_TRUE(absl::StrContains(err, "maybe")) << err;
  }
  // The throwing entry reports it as an error, not as out of memory, and
  // does not crash.
  bool threw = false;
  try {
    void* p = api_.malloc(4096, 0, nullptr);
    EXPECT_EQ(p, nullptr);
  } catch (const std::bad_alloc& e) {
    ADD_FAILURE() << "a bad option reported as out of memory: " << e.what();
    threw = true;
  } catch (const std::exception& e) {
    threw = true;
    EXPECT_TRUE(absl::StrContains(e.what(), "CTXPOOL_SESSION_TIMES"))
        << e.what();
  }
  EXPECT_TRUE(threw);
  EXPECT_EQ(api_.shutdown(0), 0) << api_.last_error();
}

class RecordTimesPluginTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::getenv("CTXPOOL_TIMES_CHILD") != nullptr) {
      GTEST_SKIP() << "child process runs PluginChild only";
    }
    if (PluginPath().empty()) GTEST_SKIP() << "the plugin is not built";
  }
};

// The plugin's sessions take CTXPOOL_SESSION_TIMES (they open with default
// options): a session destroyed with a leak reports its age on stderr only
// when times are on.
TEST_F(RecordTimesPluginTest, PluginWorksWithSessionTimesOn) {
  std::string out;
  EXPECT_TRUE(RunChild("TimesOn", {"CTXPOOL_SESSION_TIMES=1"}, &out)) << out;
  EXPECT_TRUE(absl::StrContains(out, "leak: leaky: 4096 B at 0x")) << out;
  EXPECT_TRUE(absl::StrContains(out, ", age ")) << out;
}

TEST_F(RecordTimesPluginTest, PluginLeakReportHasNoAgeWithoutTimes) {
  for (const char* env : {"CTXPOOL_SESSION_TIMES", "CTXPOOL_SESSION_TIMES=0",
                          "CTXPOOL_SESSION_TIMES=off"}) {
    std::string out;
    EXPECT_TRUE(RunChild("TimesOff", {env}, &out)) << env << "\n" << out;
    EXPECT_TRUE(absl::StrContains(out, "leak: leaky: 4096 B at 0x"))
        << env << "\n"
        << out;
    EXPECT_FALSE(absl::StrContains(out, ", age ")) << env << "\n" << out;
  }
}

TEST_F(RecordTimesPluginTest, PluginRefusesABadSessionTimesCleanly) {
  std::string out;
  EXPECT_TRUE(RunChild("TimesBad", {"CTXPOOL_SESSION_TIMES=maybe"}, &out))
      << out;
}

}  // namespace
}  // namespace ctxpool
