// Tests of CachingDeviceAllocator's per-stream shards: device totals and
// peaks kept across shards, owners' budgets split into per-stream credit,
// frees and lookups from any thread, streams appearing concurrently, on
// SimDriver with both backings.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

class ShardTest : public test::TenantAllocatorTest {
 protected:
  void SetUp() override { Init(1024 * kMiB); }

  std::size_t BlockSize(DevicePtr p) {
    absl::StatusOr<BlockInfo> info = alloc_->Lookup(p);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->size : 0;
  }
  StreamHandle NewStream() {
    return *sim_->StreamCreate(kStreamNonBlocking, 0);
  }
};

// Expected values of one stat, followed op by op.
struct Track {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  void Add(std::int64_t n) {
    current += n;
    peak = std::max(peak, current);
  }
};

// With one thread, whichever streams it uses in turn, the device totals
// and their peaks are those of the sum of the streams' stats, op by op; so
// are each stream's, and a peak reset restarts them from the current value.
TEST_P(ShardTest, OneThreadAcrossStreamsKeepsExactTotalsAndPeaks) {
  const StreamHandle streams[] = {a1_, a2_, b1_};
  std::mt19937_64 rng(7);
  struct Live {
    DevicePtr p;
    int stream;
    std::size_t size, requested;
  };
  std::vector<Live> live;
  Track allocated, requested, count;
  Track per_stream[3];
  auto check = [&](const char* when) {
    DeviceAllocatorStats s = alloc_->Stats();
    EXPECT_EQ(s.total.allocated_bytes[0].current, allocated.current) << when;
    EXPECT_EQ(s.total.allocated_bytes[0].peak, allocated.peak) << when;
    EXPECT_EQ(s.total.requested_bytes[0].current, requested.current) << when;
    EXPECT_EQ(s.total.requested_bytes[0].peak, requested.peak) << when;
    EXPECT_EQ(s.total.allocation[0].current, count.current) << when;
    EXPECT_EQ(s.total.allocation[0].peak, count.peak) << when;
    for (int i = 0; i < 3; ++i) {
      bool found = false;
      for (const auto& [stream, ps] : s.per_stream) {
        if (stream != streams[i]) continue;
        found = true;
        EXPECT_EQ(ps.allocated_bytes[0].current, per_stream[i].current)
            << when << " stream " << i;
        EXPECT_EQ(ps.allocated_bytes[0].peak, per_stream[i].peak)
            << when << " stream " << i;
      }
      EXPECT_TRUE(found || per_stream[i].peak == 0) << when;
    }
  };
  for (int round = 0; round < 2; ++round) {
    for (int op = 0; op < 3000; ++op) {
      // Bursts on one stream, then another: the sum's peak is reached
      // across streams, never on one alone.
      const int si = static_cast<int>((op / 50 + rng() % 2) % 3);
      const bool alloc = live.empty() || rng() % 100 < 52;
      if (alloc) {
        const std::size_t bytes =
            rng() % 10 == 0 ? (1 + rng() % 12) * kMiB : 1 + rng() % 200000;
        DevicePtr p = Alloc(bytes, streams[si]);
        if (p.address() == 0) return;
        const std::size_t size = BlockSize(p);
        live.push_back({p, si, size, bytes});
        allocated.Add(static_cast<std::int64_t>(size));
        requested.Add(static_cast<std::int64_t>(bytes));
        count.Add(1);
        per_stream[si].Add(static_cast<std::int64_t>(size));
      } else {
        const std::size_t i = rng() % live.size();
        Live l = live[i];
        live[i] = live.back();
        live.pop_back();
        Free(l.p);
        allocated.Add(-static_cast<std::int64_t>(l.size));
        requested.Add(-static_cast<std::int64_t>(l.requested));
        count.Add(-1);
        per_stream[l.stream].Add(-static_cast<std::int64_t>(l.size));
      }
    }
    check(round == 0 ? "first round" : "after the peak reset");
    alloc_->ResetPeakStats();
    allocated.peak = allocated.current;
    requested.peak = requested.current;
    count.peak = count.current;
    for (Track& t : per_stream) t.peak = t.current;
    check("right after the peak reset");
  }
  for (const Live& l : live) Free(l.p);
}

// Threads on their own streams, with cached and slow paths mixed (new
// segments and ranges, large blocks): the books balance after the join and
// the total counters are the sums of what the threads did.
TEST_P(ShardTest, ThreadsOnTheirOwnStreamsBalanceTheBooks) {
  constexpr int kThreads = 4;
  constexpr int kOps = 4000;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  std::atomic<int> failures{0};
  std::vector<std::int64_t> max_live(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (!sim_->CtxSetCurrent(ctx_).ok()) ++failures;
      std::mt19937_64 rng(100 + t);
      std::vector<DevicePtr> live;
      for (int i = 0; i < kOps; ++i) {
        if (live.empty() || rng() % 100 < 55) {
          const std::size_t bytes =
              rng() % 50 == 0 ? (1 + rng() % 24) * kMiB : 1 + rng() % 100000;
          absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, streams[t]);
          if (!p.ok() || !sim_->Touch(streams[t], *p, bytes).ok()) {
            ++failures;
            continue;
          }
          live.push_back(*p);
          max_live[t] = std::max<std::int64_t>(max_live[t], live.size());
        } else {
          const std::size_t k = rng() % live.size();
          if (!alloc_->Deallocate(live[k]).ok()) ++failures;
          live[k] = live.back();
          live.pop_back();
        }
        // A little reading from every thread: lookups of its own blocks
        // and device-wide stats, which take every shard.
        if (i % 500 == 0 && !live.empty()) {
          if (!alloc_->Lookup(live.front()).ok()) ++failures;
          (void)alloc_->PhysicalBytes();
        }
        if (i % 1500 == 0) (void)alloc_->Stats();
      }
      for (DevicePtr p : live) {
        if (!alloc_->Deallocate(p).ok()) ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
  DeviceAllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.total.allocation[0].current, 0);
  EXPECT_EQ(s.total.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.total.active_bytes[0].current, 0);
  std::int64_t allocs = 0, frees = 0, sum_of_maxima = 0, one_max = 0;
  for (const auto& [stream, ps] : s.per_stream) {
    allocs += ps.allocation[0].allocated;
    frees += ps.allocation[0].freed;
  }
  for (std::int64_t m : max_live) {
    sum_of_maxima += m;
    one_max = std::max(one_max, m);
  }
  EXPECT_EQ(s.total.allocation[0].allocated, allocs);
  EXPECT_EQ(s.total.allocation[0].freed, frees);
  // The device peak lies between the largest stream's and the sum of all.
  EXPECT_GE(s.total.allocation[0].peak, one_max);
  EXPECT_LE(s.total.allocation[0].peak, sum_of_maxima);
  EXPECT_EQ(static_cast<std::size_t>(s.total.reserved_bytes[0].current) +
                s.granule_cache_bytes,
            alloc_->PhysicalBytes());
  ASSERT_TRUE(alloc_->Trim().ok());
  EXPECT_EQ(alloc_->PhysicalBytes(), 0u);
}

// Blocks freed by a thread other than the one that allocated them, and the
// same block freed by two threads at once: exactly one free succeeds, the
// other is refused and counted, nothing is lost.
TEST_P(ShardTest, FreesFromOtherThreadsAndRacingDoubleFrees) {
  constexpr int kBlocks = 3000;
  std::vector<DevicePtr> blocks;
  for (int i = 0; i < kBlocks; ++i) {
    blocks.push_back(Alloc(512 * (1 + i % 40), i % 2 == 0 ? a1_ : b1_));
  }
  std::atomic<int> ok{0}, refused{0}, other{0};
  auto freer = [&](int from, int step) {
    for (int i = from; i >= 0 && i < kBlocks; i += step) {
      absl::Status st = alloc_->Deallocate(blocks[i]);
      if (st.ok()) {
        ++ok;
      } else if (st.code() == absl::StatusCode::kInvalidArgument) {
        ++refused;
      } else {
        ++other;
      }
    }
  };
  // A third thread keeps allocating on a stream of its own meanwhile, from
  // its own segment, warm before the frees start (a freed address may be
  // handed out again at once, and a late "double free" of it would then
  // free the new block).
  Free(Alloc(4096, a2_));
  // One thread walks forward, one backward: they meet on every block.
  std::thread t1(freer, 0, 1);
  std::thread t2(freer, kBlocks - 1, -1);
  std::thread t3([&] {
    for (int i = 0; i < 2000; ++i) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(4096, a2_);
      if (!p.ok() || !alloc_->Deallocate(*p).ok()) ++other;
    }
  });
  t1.join();
  t2.join();
  t3.join();
  EXPECT_EQ(ok.load(), kBlocks);
  EXPECT_EQ(refused.load(), kBlocks);
  EXPECT_EQ(other.load(), 0);
  DeviceAllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.invalid_frees, kBlocks);
  EXPECT_EQ(s.total.allocation[0].current, 0);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
}

// Many threads meet streams the allocator has never seen, at the same
// moment, some of them the same stream: each stream gets one shard.
TEST_P(ShardTest, StreamsFirstUsedConcurrentlyGetOneShardEach) {
  constexpr int kThreads = 6;
  constexpr int kStreams = 40;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(NewStream());
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      if (!sim_->CtxSetCurrent(ctx_).ok()) ++failures;
      std::vector<DevicePtr> mine;
      for (int i = 0; i < kStreams; ++i) {
        // Half the threads walk the streams in one order, half in another.
        const int k = t % 2 == 0 ? i : kStreams - 1 - i;
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(1000 + t, streams[k]);
        if (!p.ok()) {
          ++failures;
          continue;
        }
        mine.push_back(*p);
      }
      for (DevicePtr p : mine) {
        if (!alloc_->Deallocate(p).ok()) ++failures;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  DeviceAllocatorStats s = alloc_->Stats();
  int seen = 0;
  for (const auto& [stream, ps] : s.per_stream) {
    if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
      continue;
    }
    ++seen;
    EXPECT_EQ(ps.allocation[0].allocated, kThreads);
  }
  EXPECT_EQ(seen, kStreams);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
}

// An owner's max is split into credit per stream; credit parked on one
// stream never refuses what fits on another.
TEST_P(ShardTest, OwnerCreditOnOneStreamNeverRefusesAnother) {
  absl::StatusOr<OwnerId> o = alloc_->RegisterOwner("m", kMiB);
  ASSERT_TRUE(o.ok()) << o.status();
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(512 * 1024, a1_, *o);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  // a1 may keep credit now; the whole max must still fit on a2.
  absl::StatusOr<DevicePtr> q = alloc_->Allocate(kMiB, a2_, *o);
  ASSERT_TRUE(q.ok()) << q.status();
  // And nothing more, anywhere.
  absl::StatusOr<DevicePtr> r = alloc_->Allocate(1, a1_, *o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  absl::StatusOr<DevicePtr> r2 = alloc_->Allocate(1, b1_, *o);
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(alloc_->Deallocate(*q).ok());
  // Then the max again, in pieces spread over three streams.
  std::vector<DevicePtr> parts;
  const StreamHandle streams[] = {a1_, a2_, b1_, a1_};
  for (StreamHandle s : streams) {
    absl::StatusOr<DevicePtr> part = alloc_->Allocate(kMiB / 4, s, *o);
    ASSERT_TRUE(part.ok()) << part.status();
    parts.push_back(*part);
  }
  EXPECT_EQ(alloc_->Allocate(512, b1_, *o).status().code(),
            absl::StatusCode::kResourceExhausted);
  absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*o);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->live_bytes, kMiB);
  EXPECT_EQ(st->peak_live_bytes, kMiB);
  EXPECT_EQ(st->num_budget_rejections, 3);
  for (DevicePtr part : parts) ASSERT_TRUE(alloc_->Deallocate(part).ok());
  st = alloc_->GetOwnerStats(*o);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->live_bytes, 0u);
  EXPECT_EQ(st->live_allocations, 0);
}

// Two threads of one owner on two streams, together at the max: the owner
// never holds more than its max, and what one thread frees the other can
// always get (no refusal while the sum fits).
TEST_P(ShardTest, OwnerAtItsMaxOnTwoThreadsIsExact) {
  constexpr std::size_t kMax = 8 * kMiB;
  constexpr std::size_t kPiece = 256 * 1024;  // a multiple of round_bytes
  absl::StatusOr<OwnerId> o = alloc_->RegisterOwner("m", kMax);
  ASSERT_TRUE(o.ok());
  // Each thread holds exactly half the max, in pieces, and churns it:
  // every one of its Allocates fits, so none may be refused.
  std::atomic<int> refused{0}, failures{0};
  auto worker = [&](StreamHandle s) {
    if (!sim_->CtxSetCurrent(ctx_).ok()) ++failures;
    std::vector<DevicePtr> mine;
    for (int i = 0; i < 3000; ++i) {
      if (mine.size() < kMax / 2 / kPiece) {
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(kPiece, s, *o);
        if (p.ok()) {
          mine.push_back(*p);
        } else if (p.status().code() == absl::StatusCode::kResourceExhausted) {
          ++refused;
        } else {
          ++failures;
        }
      } else {
        if (!alloc_->Deallocate(mine[i % mine.size()]).ok()) ++failures;
        mine.erase(mine.begin() + static_cast<long>(i % mine.size()));
      }
    }
    for (DevicePtr p : mine) {
      if (!alloc_->Deallocate(p).ok()) ++failures;
    }
  };
  std::thread t1(worker, a1_), t2(worker, a2_);
  t1.join();
  t2.join();
  EXPECT_EQ(refused.load(), 0);
  EXPECT_EQ(failures.load(), 0);
  absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*o);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->num_budget_rejections, 0);
  EXPECT_LE(st->peak_live_bytes, kMax);
  EXPECT_EQ(st->live_bytes, 0u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
}

// Past the max, from both threads: the owner's live bytes never exceed it,
// seen from a third thread that reads the owner's stats meanwhile.
TEST_P(ShardTest, OwnerOverItsMaxFromTwoThreadsNeverOvershoots) {
  constexpr std::size_t kMax = 4 * kMiB;
  absl::StatusOr<OwnerId> o = alloc_->RegisterOwner("m", kMax);
  ASSERT_TRUE(o.ok());
  std::atomic<bool> done{false};
  std::atomic<int> failures{0};
  std::atomic<std::size_t> max_seen{0};
  auto worker = [&](StreamHandle s, int seed) {
    if (!sim_->CtxSetCurrent(ctx_).ok()) ++failures;
    std::mt19937_64 rng(seed);
    std::vector<DevicePtr> mine;
    for (int i = 0; i < 4000; ++i) {
      if (mine.empty() || rng() % 100 < 60) {
        absl::StatusOr<DevicePtr> p =
            alloc_->Allocate(1 + rng() % (512 * 1024), s, *o);
        if (p.ok()) {
          mine.push_back(*p);
        } else if (p.status().code() != absl::StatusCode::kResourceExhausted) {
          ++failures;
        }
      } else {
        const std::size_t k = rng() % mine.size();
        if (!alloc_->Deallocate(mine[k]).ok()) ++failures;
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (DevicePtr p : mine) {
      if (!alloc_->Deallocate(p).ok()) ++failures;
    }
  };
  std::thread reader([&] {
    while (!done.load()) {
      absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*o);
      if (!st.ok()) {
        ++failures;
        return;
      }
      std::size_t m = max_seen.load();
      while (st->live_bytes > m &&
             !max_seen.compare_exchange_weak(m, st->live_bytes)) {
      }
    }
  });
  std::thread t1(worker, a1_, 1), t2(worker, b1_, 2);
  t1.join();
  t2.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(max_seen.load(), kMax);
  absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*o);
  ASSERT_TRUE(st.ok());
  EXPECT_LE(st->peak_live_bytes, kMax);
  EXPECT_GT(st->num_budget_rejections, 0);
  EXPECT_EQ(st->live_bytes, 0u);
  EXPECT_TRUE(alloc_->CheckInvariants().ok()) << alloc_->CheckInvariants();
}

// The owned cached path on an owner that uses two streams in turn makes no
// heap allocation once both streams are warm.
TEST_P(ShardTest, OwnedCachedPathOnTwoStreamsMakesNoHeapAllocation) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "operator new cannot be replaced under TSan";
#endif
  absl::StatusOr<OwnerId> o = alloc_->RegisterOwner("m", 64 * kMiB);
  ASSERT_TRUE(o.ok());
  // Both streams warm at once, so each has a segment of its own (classic
  // mode hands a wholly free segment to another stream of the tenant that
  // has none, with an event).
  std::vector<DevicePtr> warm;
  for (StreamHandle s : {a1_, a2_}) {
    for (int i = 0; i < 32; ++i) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(512 * (1 + i % 9), s, *o);
      ASSERT_TRUE(p.ok());
      warm.push_back(*p);
    }
  }
  for (DevicePtr p : warm) ASSERT_TRUE(alloc_->Deallocate(p).ok());
  const std::uint64_t calls = sim_->total_call_count();
  g_allocations = 0;
  g_count_allocations = true;
  for (int i = 0; i < 2000; ++i) {
    const StreamHandle s = i % 2 == 0 ? a1_ : a2_;
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(512 * (1 + i % 9), s, *o);
    if (p.ok()) {
      alloc_->Deallocate(*p, FreeCheck{.owner = *o}).IgnoreError();
    }
  }
  g_count_allocations = false;
  EXPECT_EQ(g_allocations, 0);
  EXPECT_EQ(sim_->total_call_count(), calls);
}

// ResetPeakStats sets every peak to its current value: the device's, the
// streams', the owners' and the tenants'.
TEST_P(ShardTest, ResetPeakStatsResetsOwnersAndTenantsToo) {
  absl::StatusOr<OwnerId> o = alloc_->RegisterOwner("m");
  ASSERT_TRUE(o.ok());
  TenantId t = Register("t", Budget{});
  ASSERT_TRUE(alloc_->BindStream(a1_, t).ok());
  absl::StatusOr<DevicePtr> big = alloc_->Allocate(8 * kMiB, a1_, *o);
  absl::StatusOr<DevicePtr> small = alloc_->Allocate(4096, a1_, *o);
  ASSERT_TRUE(big.ok() && small.ok());
  ASSERT_TRUE(alloc_->Deallocate(*big).ok());
  ASSERT_TRUE(alloc_->Trim().ok());  // the tenant's mapped bytes drop too
  EXPECT_GT(alloc_->GetOwnerStats(*o)->peak_live_bytes, 8 * kMiB);
  const std::size_t tenant_peak = Stats(t).peak_mapped_bytes;
  EXPECT_GT(tenant_peak, Stats(t).mapped_bytes);
  alloc_->ResetPeakStats();
  EXPECT_EQ(alloc_->GetOwnerStats(*o)->peak_live_bytes, 4096u);
  EXPECT_EQ(Stats(t).peak_mapped_bytes, Stats(t).mapped_bytes);
  DeviceAllocatorStats s = alloc_->Stats();
  EXPECT_EQ(s.total.allocated_bytes[0].peak,
            s.total.allocated_bytes[0].current);
  EXPECT_EQ(s.total.reserved_bytes[0].peak, s.total.reserved_bytes[0].current);
  ASSERT_TRUE(alloc_->Deallocate(*small).ok());
}

// Only an owner that records times has its blocks stamped; a block one
// owner freed and another took again carries no stale time, and a charge
// of any size in range is the request rounded up to 512 B (512 B for 0).
TEST_P(ShardTest, OwnersRecordTimesOnlyWhenAsked) {
  absl::StatusOr<OwnerId> timed = alloc_->RegisterOwner(
      "timed", OwnerOptions{.max_live_bytes = 64 * kMiB, .record_times = true});
  absl::StatusOr<OwnerId> plain =
      alloc_->RegisterOwner("plain", OwnerOptions{.max_live_bytes = 64 * kMiB});
  ASSERT_TRUE(timed.ok() && plain.ok());
  const std::int64_t before = absl::GetCurrentTimeNanos();
  absl::StatusOr<DevicePtr> t = alloc_->Allocate(4096, a1_, *timed, "t");
  ASSERT_TRUE(t.ok()) << t.status();
  absl::StatusOr<std::vector<OwnedBlock>> tb = alloc_->OwnedBlocks(*timed);
  ASSERT_TRUE(tb.ok());
  ASSERT_EQ(tb->size(), 1u);
  // The coarse clock trails by up to a few ticks (100 ms: sanitizer builds)
  // and never leads by more than absl's interpolation.
  EXPECT_GE((*tb)[0].allocated_at_ns, before - 100'000'000);
  EXPECT_LE((*tb)[0].allocated_at_ns, absl::GetCurrentTimeNanos() + 1'000'000);
  ASSERT_TRUE(alloc_->Deallocate(*t).ok());
  // The same stream, the same size: the cached path hands the same block on.
  absl::StatusOr<DevicePtr> p = alloc_->Allocate(4096, a1_, *plain, "p");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->address(), t->address());
  absl::StatusOr<std::vector<OwnedBlock>> pb = alloc_->OwnedBlocks(*plain);
  ASSERT_TRUE(pb.ok());
  ASSERT_EQ(pb->size(), 1u);
  EXPECT_EQ((*pb)[0].allocated_at_ns, 0);
  ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  const std::pair<std::size_t, std::size_t> charges[] = {
      {0, 512},    {1, 512},     {511, 512},   {512, 512},
      {513, 1024}, {4096, 4096}, {4097, 4608}, {3 * kMiB + 1, 3 * kMiB + 512}};
  for (const auto& [bytes, charge] : charges) {
    absl::StatusOr<DevicePtr> c = alloc_->Allocate(bytes, a1_, *plain);
    ASSERT_TRUE(c.ok()) << bytes << ": " << c.status();
    EXPECT_EQ(alloc_->GetOwnerStats(*plain)->live_bytes, charge) << bytes;
    ASSERT_TRUE(alloc_->Deallocate(*c).ok());
    EXPECT_EQ(alloc_->GetOwnerStats(*plain)->live_bytes, 0u) << bytes;
  }
}

INSTANTIATE_TEST_SUITE_P(Backings, ShardTest, test::kBothBackings,
                         test::BackingName);

}  // namespace
}  // namespace ctxpool
