// device_allocator_attack_test.cc — adversarial tests of the sharded
// CachingDeviceAllocator (per-stream shards, lock-free stream table / page
// map / range table, holder shards for the device totals and owners' live
// bytes, owners' budgets split into per-stream credit).
//
// Each test attacks one claim of include/ctxpool/alloc/device_allocator.h
// and docs/architecture.md ("Front end, pool, backing") with threads on a
// SimDriver device, in both backings (classic and expandable). Every test
// ends with CheckInvariants() and no race / misuse on the simulated GPU.
//
// Avoiding test-made ABA: a late or racing free of a pointer is only ever
// made while nothing else can allocate at that address (the stream of the
// block is used by one thread, and its segment stays partly used), or with
// a FreeCheck naming the owner (an owner's freed block can only come back
// to another owner).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/core/stats.h"
#include "ctxpool/driver/sim_driver.h"
#include "device_allocator_fixture.h"
#include "gtest/gtest.h"

#if defined(__SANITIZE_THREAD__)
#define CTXPOOL_ATTACK_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CTXPOOL_ATTACK_TSAN 1
#endif
#endif
#ifndef CTXPOOL_ATTACK_TSAN
#define CTXPOOL_ATTACK_TSAN 0
#endif

namespace ctxpool {
namespace {

// Fewer operations under ThreadSanitizer (5-20x slower).
int Scale(int n) { return CTXPOOL_ATTACK_TSAN ? std::max(1, n / 6) : n; }

// A reusable barrier (std::barrier without relying on the library's).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    const std::uint64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  std::uint64_t gen_ = 0;
};

constexpr const char* kStatNames[] = {
    "allocation",     "segment",         "active",
    "inactive_split", "allocated_bytes", "requested_bytes",
    "reserved_bytes", "active_bytes",    "inactive_split_bytes"};

std::vector<const StatArray*> Arrays(const PoolStats& p) {
  std::vector<const StatArray*> v;
  p.ForEach([&](const StatArray& a) { v.push_back(&a); });
  return v;
}

// One Stats() copy is consistent: every total's current value is the sum of
// the streams' (AllShards folds everything), peaks are at least the current
// value, and a total's peak lies within the documented window: never above
// the sum of the per-stream peaks, never below the largest per-stream peak.
// Returns the first problem, or "".
std::string CheckStatsCopy(const DeviceAllocatorStats& st) {
  const auto total = Arrays(st.total);
  for (std::size_t i = 0; i < total.size(); ++i) {
    for (int p = 0; p < 3; ++p) {
      std::int64_t sum_cur = 0, sum_peak = 0, max_peak = 0;
      for (const auto& [s, ps] : st.per_stream) {
        const Stat& x = (*Arrays(ps)[i])[p];
        if (x.peak < x.current) {
          return absl::StrFormat("stream 0x%x %s[%d]: peak %d < current %d",
                                 s.value(), kStatNames[i], p, x.peak,
                                 x.current);
        }
        sum_cur += x.current;
        sum_peak += x.peak;
        max_peak = std::max(max_peak, x.peak);
      }
      const Stat& t = (*total[i])[p];
      if (t.current != sum_cur) {
        return absl::StrFormat("total %s[%d].current %d != sum of streams %d",
                               kStatNames[i], p, t.current, sum_cur);
      }
      if (t.peak < t.current) {
        return absl::StrFormat("total %s[%d]: peak %d < current %d",
                               kStatNames[i], p, t.peak, t.current);
      }
      if (t.peak > sum_peak) {
        return absl::StrFormat(
            "total %s[%d].peak %d > sum of per-stream peaks %d", kStatNames[i],
            p, t.peak, sum_peak);
      }
      if (t.peak < max_peak) {
        return absl::StrFormat(
            "total %s[%d].peak %d < largest per-stream peak %d", kStatNames[i],
            p, t.peak, max_peak);
      }
    }
  }
  return "";
}

// A snapshot tiles every segment with its blocks.
std::string CheckSnapshot(const AllocatorSnapshot& snap) {
  for (const SegmentInfo& seg : snap.segments) {
    std::uint64_t at = seg.base.address();
    for (const BlockInfo& b : seg.blocks) {
      if (b.ptr.address() != at) {
        return absl::StrFormat("segment 0x%x: block at 0x%x, expected 0x%x",
                               seg.base.address(), b.ptr.address(), at);
      }
      at += b.size;
    }
    if (at != seg.base.address() + seg.size) {
      return absl::StrFormat("segment 0x%x: blocks end at 0x%x, not 0x%x",
                             seg.base.address(), at,
                             seg.base.address() + seg.size);
    }
  }
  return "";
}

const PoolStats* StreamStats(const DeviceAllocatorStats& st, StreamHandle s) {
  for (const auto& [h, ps] : st.per_stream) {
    if (h == s) return &ps;
  }
  return nullptr;
}

// Live figures a test keeps itself, with their exact running peaks.
struct Tracker {
  std::int64_t count = 0, bytes = 0, requested = 0;
  std::int64_t peak_count = 0, peak_bytes = 0, peak_requested = 0;
  void Add(std::size_t size, std::size_t req) {
    ++count;
    bytes += static_cast<std::int64_t>(size);
    requested += static_cast<std::int64_t>(req);
    peak_count = std::max(peak_count, count);
    peak_bytes = std::max(peak_bytes, bytes);
    peak_requested = std::max(peak_requested, requested);
  }
  void Sub(std::size_t size, std::size_t req) {
    --count;
    bytes -= static_cast<std::int64_t>(size);
    requested -= static_cast<std::int64_t>(req);
  }
};

struct LiveBlock {
  DevicePtr ptr;
  std::size_t size = 0;       // the block's (Lookup)
  std::size_t requested = 0;  // as asked
  StreamHandle stream;
};

class AttackTest : public test::DeviceAllocatorFixture,
                   public ::testing::WithParamInterface<BackingMode> {
 protected:
  // The fixture's device, streams and allocator, with the backing under
  // test and the real clock (threads read it concurrently).
  void Init(std::size_t capacity = 4 * kGiB, DeviceAllocatorOptions o = {}) {
    o.backing = GetParam();
    if (!o.clock) o.clock = [] { return absl::Now(); };
    InitAllocator(capacity, std::move(o));
  }

  // Every thread that touches memory or creates streams needs the context.
  void EnterThread() { EXPECT_TRUE(sim_->CtxSetCurrent(ctx_).ok()); }

  StreamHandle NewStream() {
    absl::StatusOr<StreamHandle> s = sim_->StreamCreate(kStreamNonBlocking, 0);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : StreamHandle();
  }

  // Allocate + Lookup + Touch; the block as the allocator describes it.
  absl::StatusOr<LiveBlock> AllocChecked(std::size_t bytes, StreamHandle s,
                                         OwnerId owner = kNoOwner) {
    absl::StatusOr<DevicePtr> p = owner == kNoOwner
                                      ? alloc_->Allocate(bytes, s)
                                      : alloc_->Allocate(bytes, s, owner);
    if (!p.ok()) return p.status();
    absl::StatusOr<BlockInfo> info = alloc_->Lookup(*p);
    if (!info.ok()) {
      return absl::InternalError(
          absl::StrCat("Lookup of a block just allocated failed: ",
                       info.status().ToString()));
    }
    if (info->stream != s || info->requested_bytes != bytes ||
        info->state != BlockState::kAllocated || info->size < bytes ||
        info->owner != owner) {
      return absl::InternalError(absl::StrFormat(
          "Lookup(0x%x): stream 0x%x (want 0x%x), requested %d (want %d), "
          "size %d, owner %d (want %d)",
          p->address(), info->stream.value(), s.value(), info->requested_bytes,
          bytes, info->size, info->owner, owner));
    }
    absl::Status t = sim_->Touch(s, *p, bytes == 0 ? 1 : bytes);
    if (!t.ok()) return t;
    return LiveBlock{*p, info->size, bytes, s};
  }

  // Test 4's scenario (defined with it).
  void RunOneWorker(bool slow_between);
};

// ---------------------------------------------------------------------------
// 1. Threads on distinct streams mix cached and slow paths (large own
// segments, cross-thread frees) while a chaos thread runs every slow path
// and reader (Trim, TrimIdle, Stats, Snapshot, CheckInvariants,
// ResetPeakStats, Fragmentation, PhysicalBytes). Each Stats() copy must be
// self-consistent; after the joins the totals must be exactly the test's.
TEST_P(AttackTest, ChurnWithSlowPathsKeepsExactTotals) {
  Init();
  constexpr int kThreads = 4;
  const int ops = Scale(3000);
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  std::mutex mail_mu;
  std::vector<std::vector<LiveBlock>> mail(kThreads);
  std::vector<std::vector<LiveBlock>> left(kThreads);
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};

  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(1000 + id);
    std::vector<LiveBlock> mine;
    const StreamHandle s = streams[id];
    auto free_one = [&](const LiveBlock& b) {
      absl::Status st = alloc_->Deallocate(b.ptr);
      if (!st.ok()) {
        ++errors;
        ADD_FAILURE() << "free of 0x" << std::hex << b.ptr.address() << ": "
                      << st;
      }
    };
    for (int i = 0; i < ops && errors.load() < 5; ++i) {
      const int r = static_cast<int>(rng() % 100);
      if (r < 45 || mine.empty()) {
        const int k = static_cast<int>(rng() % 100);
        std::size_t bytes;
        if (k < 70) {
          bytes = rng() % (64 * kKiB);
        } else if (k < 95) {
          bytes = kMiB + rng() % (4 * kMiB);
        } else {
          bytes = 10 * kMiB + rng() % (6 * kMiB);
        }
        absl::StatusOr<LiveBlock> b = AllocChecked(bytes, s);
        if (!b.ok()) {
          ++errors;
          ADD_FAILURE() << "Allocate(" << bytes << "): " << b.status();
          continue;
        }
        mine.push_back(*b);
      } else if (r < 85) {
        const std::size_t i2 = rng() % mine.size();
        LiveBlock b = mine[i2];
        mine[i2] = mine.back();
        mine.pop_back();
        free_one(b);
      } else if (r < 95) {
        const std::size_t i2 = rng() % mine.size();
        LiveBlock b = mine[i2];
        mine[i2] = mine.back();
        mine.pop_back();
        const int to =
            (id + 1 + static_cast<int>(rng() % (kThreads - 1))) % kThreads;
        std::lock_guard<std::mutex> l(mail_mu);
        mail[to].push_back(b);
      } else {
        std::vector<LiveBlock> got;
        {
          std::lock_guard<std::mutex> l(mail_mu);
          got.swap(mail[id]);
        }
        for (const LiveBlock& b : got) free_one(b);
      }
      while (mine.size() > 48) {
        free_one(mine.back());
        mine.pop_back();
      }
    }
    left[id] = std::move(mine);
  };

  std::string chaos_problem;
  auto chaos = [&] {
    EnterThread();
    int n = 0;
    while (!stop.load() && chaos_problem.empty()) {
      switch (n++ % 11) {
        case 9:
          alloc_->trace_recorder().Enable(1024);
          break;
        case 10:
          alloc_->trace_recorder().Disable();
          break;
        case 0: {
          auto t = alloc_->Trim(0);
          if (!t.ok()) chaos_problem = "Trim: " + t.status().ToString();
          break;
        }
        case 1: {
          auto t = alloc_->TrimIdle();
          if (!t.ok()) chaos_problem = "TrimIdle: " + t.status().ToString();
          break;
        }
        case 2:
        case 6: {
          std::string p = CheckStatsCopy(alloc_->Stats());
          if (!p.empty()) chaos_problem = "Stats: " + p;
          break;
        }
        case 3: {
          std::string p = CheckSnapshot(alloc_->Snapshot());
          if (!p.empty()) chaos_problem = "Snapshot: " + p;
          break;
        }
        case 4: {
          absl::Status inv = alloc_->CheckInvariants();
          if (!inv.ok()) chaos_problem = "CheckInvariants: " + inv.ToString();
          break;
        }
        case 5:
          alloc_->ResetPeakStats();
          break;
        case 7: {
          FragmentationStats f = alloc_->Fragmentation();
          (void)f;
          (void)alloc_->PhysicalBytes();
          break;
        }
        case 8: {
          auto t = alloc_->Trim(32 * kMiB);
          if (!t.ok()) chaos_problem = "Trim(32M): " + t.status().ToString();
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };

  std::thread chaos_thread(chaos);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  stop = true;
  chaos_thread.join();
  EXPECT_EQ(chaos_problem, "");
  EXPECT_EQ(errors.load(), 0);

  std::vector<LiveBlock> all;
  for (auto& v : left) all.insert(all.end(), v.begin(), v.end());
  for (auto& v : mail) all.insert(all.end(), v.begin(), v.end());

  // Exact current values after the joins, in total and per stream.
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(CheckStatsCopy(st), "");
  Tracker total;
  std::vector<Tracker> per(kThreads);
  for (const LiveBlock& b : all) {
    total.Add(b.size, b.requested);
    const int i = static_cast<int>(
        std::find(streams.begin(), streams.end(), b.stream) - streams.begin());
    per[i].Add(b.size, b.requested);
  }
  EXPECT_EQ(st.total.allocation[0].current, total.count);
  EXPECT_EQ(st.total.allocated_bytes[0].current, total.bytes);
  EXPECT_EQ(st.total.requested_bytes[0].current, total.requested);
  EXPECT_EQ(st.total.active[0].current, total.count);
  EXPECT_EQ(st.total.active_bytes[0].current, total.bytes);
  for (int i = 0; i < kThreads; ++i) {
    const PoolStats* ps = StreamStats(st, streams[i]);
    ASSERT_NE(ps, nullptr);
    EXPECT_EQ(ps->allocation[0].current, per[i].count) << "stream " << i;
    EXPECT_EQ(ps->allocated_bytes[0].current, per[i].bytes) << "stream " << i;
    EXPECT_EQ(ps->requested_bytes[0].current, per[i].requested)
        << "stream " << i;
  }
  for (const LiveBlock& b : all) EXPECT_TRUE(alloc_->Deallocate(b.ptr).ok());
  st = alloc_->Stats();
  EXPECT_EQ(st.total.allocation[0].current, 0);
  EXPECT_EQ(st.total.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.total.requested_bytes[0].current, 0);
  EXPECT_EQ(st.invalid_frees, 0);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  st = alloc_->Stats();
  EXPECT_EQ(st.total.reserved_bytes[0].current, 0);
  EXPECT_EQ(alloc_->PhysicalBytes(), 0u);
}

// ---------------------------------------------------------------------------
// 2. One thread switching streams: every peak is exact, op by op (Stats()
// after each op) and also when read only at the end (no Stats() in between
// to fold and release the sums).
TEST_P(AttackTest, OneThreadSwitchingStreamsHasExactPeaks) {
  Init();
  std::vector<StreamHandle> streams;
  for (int i = 0; i < 3; ++i) streams.push_back(NewStream());
  for (bool check_each_op : {true, false}) {
    SCOPED_TRACE(check_each_op ? "checked op by op" : "checked at the end");
    alloc_->ResetPeakStats();
    std::mt19937_64 rng(check_each_op ? 7 : 8);
    std::vector<LiveBlock> live;
    Tracker t;
    std::vector<Tracker> per(streams.size());
    auto index_of = [&](StreamHandle s) {
      return static_cast<std::size_t>(
          std::find(streams.begin(), streams.end(), s) - streams.begin());
    };
    const int ops = Scale(1500);
    for (int i = 0; i < ops; ++i) {
      if (live.empty() || rng() % 100 < 55) {
        const StreamHandle s = streams[rng() % streams.size()];
        const std::size_t bytes =
            rng() % 4 == 0 ? kMiB + rng() % (12 * kMiB) : rng() % (128 * kKiB);
        absl::StatusOr<LiveBlock> b = AllocChecked(bytes, s);
        ASSERT_TRUE(b.ok()) << b.status();
        live.push_back(*b);
        t.Add(b->size, b->requested);
        per[index_of(s)].Add(b->size, b->requested);
      } else {
        const std::size_t k = rng() % live.size();
        LiveBlock b = live[k];
        live[k] = live.back();
        live.pop_back();
        ASSERT_TRUE(alloc_->Deallocate(b.ptr).ok());
        t.Sub(b.size, b.requested);
        per[index_of(b.stream)].Sub(b.size, b.requested);
      }
      if (live.size() > 40) {
        LiveBlock b = live.front();
        live.erase(live.begin());
        ASSERT_TRUE(alloc_->Deallocate(b.ptr).ok());
        t.Sub(b.size, b.requested);
        per[index_of(b.stream)].Sub(b.size, b.requested);
      }
      if (check_each_op || i == ops - 1) {
        DeviceAllocatorStats st = alloc_->Stats();
        ASSERT_EQ(st.total.allocated_bytes[0].current, t.bytes) << "op " << i;
        ASSERT_EQ(st.total.allocated_bytes[0].peak, t.peak_bytes) << "op " << i;
        ASSERT_EQ(st.total.allocation[0].peak, t.peak_count) << "op " << i;
        ASSERT_EQ(st.total.requested_bytes[0].peak, t.peak_requested)
            << "op " << i;
        for (std::size_t j = 0; j < streams.size(); ++j) {
          const PoolStats* ps = StreamStats(st, streams[j]);
          ASSERT_EQ(ps == nullptr ? 0 : ps->allocated_bytes[0].peak,
                    per[j].peak_bytes)
              << "op " << i << " stream " << j;
        }
      }
    }
    for (const LiveBlock& b : live) ASSERT_TRUE(alloc_->Deallocate(b.ptr).ok());
  }
}

// ---------------------------------------------------------------------------
// 3. Several threads, even when they never run at the same moment, may
// leave a shard's changes pending across turns, so the header promises
// only bounds for device-wide and owner peaks: never below the largest
// per-stream peak, never above the sum of them; per-stream peaks and
// current values exact. Two threads, each on its own stream, strictly
// alternate (a baton). The peaks are read at the end.
TEST_P(AttackTest, ThreadsTakingTurnsKeepPeaksWithinTheDocumentedBounds) {
  Init();
  const StreamHandle streams[2] = {NewStream(), NewStream()};
  absl::StatusOr<OwnerId> owner = alloc_->RegisterOwner("turns");
  ASSERT_TRUE(owner.ok());
  // Warm both streams (first use is a slow path) and make their owner
  // sub-accounts, then start from clean peaks.
  std::vector<DevicePtr> warm;
  for (StreamHandle s : streams) {
    for (std::size_t bytes : {std::size_t{512}, 12 * kMiB, 3 * kMiB}) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
      ASSERT_TRUE(p.ok());
      warm.push_back(*p);
    }
  }
  for (DevicePtr p : warm) ASSERT_TRUE(alloc_->Deallocate(p).ok());
  for (StreamHandle s : streams) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(512, s, *owner);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  }
  alloc_->ResetPeakStats();

  std::mutex mu;
  std::condition_variable cv;
  int turn = 0;
  Tracker total;                           // guarded by the baton
  std::int64_t owned = 0;                  // the owner's charged bytes
  std::int64_t owned_by[2] = {0, 0};       // the owner's charge per thread
  std::int64_t owned_peak_by[2] = {0, 0};  // and its peak
  std::vector<Tracker> per(2);
  const int rounds = Scale(1500);
  std::atomic<int> errors{0};

  auto player = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(40 + id);
    std::vector<LiveBlock> mine;
    const StreamHandle s = streams[id];
    for (int round = 0; round < rounds; ++round) {
      std::unique_lock<std::mutex> l(mu);
      cv.wait(l, [&] { return turn == id; });
      const int n = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < n; ++k) {
        if (mine.empty() || rng() % 100 < 50) {
          const std::size_t bytes = rng() % 3 == 0
                                        ? 2 * kMiB + rng() % (10 * kMiB)
                                        : 512 * (1 + rng() % 128);
          absl::StatusOr<LiveBlock> b = AllocChecked(bytes, s, *owner);
          if (!b.ok()) {
            ++errors;
            ADD_FAILURE() << b.status();
            continue;
          }
          mine.push_back(*b);
          total.Add(b->size, b->requested);
          per[id].Add(b->size, b->requested);
          owned += static_cast<std::int64_t>((bytes + 511) / 512 * 512);
          owned_by[id] += static_cast<std::int64_t>((bytes + 511) / 512 * 512);
          owned_peak_by[id] = std::max(owned_peak_by[id], owned_by[id]);
        } else {
          const std::size_t i = rng() % mine.size();
          LiveBlock b = mine[i];
          mine[i] = mine.back();
          mine.pop_back();
          if (!alloc_->Deallocate(b.ptr).ok()) ++errors;
          total.Sub(b.size, b.requested);
          per[id].Sub(b.size, b.requested);
          owned -= static_cast<std::int64_t>((b.requested + 511) / 512 * 512);
          owned_by[id] -=
              static_cast<std::int64_t>((b.requested + 511) / 512 * 512);
        }
      }
      turn = 1 - id;
      cv.notify_all();
    }
    std::unique_lock<std::mutex> l(mu);
    for (const LiveBlock& b : mine) {
      if (!alloc_->Deallocate(b.ptr).ok()) ++errors;
    }
  };
  // The frees at the end lower the currents only: read the peaks after them.
  std::thread a(player, 0), b(player, 1);
  a.join();
  b.join();
  ASSERT_EQ(errors.load(), 0);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.allocated_bytes[0].current, 0);
  for (int i = 0; i < 2; ++i) {
    const PoolStats* ps = StreamStats(st, streams[i]);
    ASSERT_NE(ps, nullptr);
    EXPECT_EQ(ps->allocated_bytes[0].peak, per[i].peak_bytes)
        << "per-stream peak " << i;
  }
  // The bounds the header states, for each summed statistic.
  auto within = [&](StatArray PoolStats::*field, const char* what) {
    std::int64_t largest = 0, sum = 0;
    for (int i = 0; i < 2; ++i) {
      const std::int64_t p = (StreamStats(st, streams[i])->*field)[0].peak;
      largest = std::max(largest, p);
      sum += p;
    }
    const std::int64_t peak = (st.total.*field)[0].peak;
    EXPECT_GE(peak, largest) << what;
    EXPECT_LE(peak, sum) << what;
  };
  within(&PoolStats::allocated_bytes, "allocated_bytes");
  within(&PoolStats::allocation, "allocation");
  within(&PoolStats::requested_bytes, "requested_bytes");
  within(&PoolStats::active_bytes, "active_bytes");
  EXPECT_LE(total.peak_bytes,
            per[0].peak_bytes + per[1].peak_bytes);  // the model's own bound
  absl::StatusOr<OwnerStats> os = alloc_->GetOwnerStats(*owner);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(os->live_bytes, 0u);
  EXPECT_GE(static_cast<std::int64_t>(os->peak_live_bytes),
            std::max(owned_peak_by[0], owned_peak_by[1]));
  EXPECT_LE(static_cast<std::int64_t>(os->peak_live_bytes),
            owned_peak_by[0] + owned_peak_by[1]);
}

// ---------------------------------------------------------------------------
// 4. The shortest form of 3: the main thread last held the sums; then ONE
// worker thread runs alone (nothing concurrent at any moment):
//   B: alloc 4 KiB (B takes the sums over from the main thread's A)
//   C: alloc 8 MiB (C takes them over from B: same thread)
//   B: alloc 12 MiB            <- true peak: 20 MiB + 4 KiB
//   C: free the 8 MiB (then B's blocks)
// then Stats() / GetOwnerStats(). The device-wide and the owner's peak must
// be 20 MiB + 4 KiB (3 blocks); the per-stream peaks are 12 MiB + 4 KiB (B)
// and 8 MiB (C).
TEST_P(AttackTest, OneWorkerAfterMainThreadHasExactPeaks) {
  Init();
  RunOneWorker(/*slow_between=*/false);
}

// The same with a slow path (Stats()) made by the worker between steps 2 and
// 3: "with every shard held it ... leaves the sums without a holder, so that
// the slow path (and the next cached call of any shard) takes them over
// without a wait".
TEST_P(AttackTest, OneWorkerAfterMainThreadWithSlowPathBetweenHasExactPeaks) {
  Init();
  RunOneWorker(/*slow_between=*/true);
}

void AttackTest::RunOneWorker(bool slow_between) {
  const StreamHandle a = NewStream(), b = NewStream(), c = NewStream();
  absl::StatusOr<OwnerId> owner = alloc_->RegisterOwner("worker");
  ASSERT_TRUE(owner.ok());
  // Warm: each stream caches what the steps take, and has an owner
  // sub-account (tiny charges, so the owner's never-reset peak stays 512).
  // (All live at once, then all freed: in classic mode a stream with no
  // cached segment would take over another's wholly free one.)
  std::vector<DevicePtr> warm;
  for (auto [s, bytes] :
       {std::pair{a, 4 * kKiB}, std::pair{b, 4 * kKiB}, std::pair{b, 12 * kMiB},
        std::pair{c, 8 * kMiB}, std::pair{c, 4 * kKiB}}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
    ASSERT_TRUE(p.ok());
    warm.push_back(*p);
  }
  for (DevicePtr p : warm) ASSERT_TRUE(alloc_->Deallocate(p).ok());
  for (StreamHandle s : {a, b, c}) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(512, s, *owner);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  }
  alloc_->ResetPeakStats();
  // The main thread's cached op on A: A holds the sums, last used by main.
  {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(512, a, *owner);
    ASSERT_TRUE(p.ok());
    ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  }
  std::thread worker([&] {
    EnterThread();
    const std::uint64_t calls = sim_->total_call_count();
    absl::StatusOr<DevicePtr> pb = alloc_->Allocate(4 * kKiB, b, *owner);
    absl::StatusOr<DevicePtr> pc = alloc_->Allocate(8 * kMiB, c, *owner);
    if (slow_between) (void)alloc_->Stats();  // a slow path
    absl::StatusOr<DevicePtr> pb2 = alloc_->Allocate(12 * kMiB, b, *owner);
    // All three were cached (no driver call).
    EXPECT_EQ(sim_->total_call_count(), calls);
    ASSERT_TRUE(pb.ok() && pc.ok() && pb2.ok());
    ASSERT_TRUE(alloc_->Deallocate(*pc).ok());
    // (frees only lower the currents: the peaks are settled)
    EXPECT_TRUE(alloc_->Deallocate(*pb).ok());
    EXPECT_TRUE(alloc_->Deallocate(*pb2).ok());
  });
  worker.join();
  const std::int64_t want = 20 * kMiB + 4 * kKiB;
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.allocated_bytes[0].peak, want)
      << "device-wide peak after one thread ran alone";
  EXPECT_EQ(st.total.allocation[0].peak, 3);
  const PoolStats* sb = StreamStats(st, b);
  const PoolStats* sc = StreamStats(st, c);
  ASSERT_TRUE(sb != nullptr && sc != nullptr);
  EXPECT_EQ(sb->allocated_bytes[0].peak, 12 * kMiB + 4 * kKiB);
  EXPECT_EQ(sc->allocated_bytes[0].peak, 8 * kMiB);
  absl::StatusOr<OwnerStats> os = alloc_->GetOwnerStats(*owner);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(static_cast<std::int64_t>(os->peak_live_bytes), want)
      << "owner peak after one thread ran alone";
  EXPECT_EQ(CheckStatsCopy(st), "");
}

// ---------------------------------------------------------------------------
// 5. Concurrent threads on distinct streams: the documented bound of the
// peaks' window (total peak <= sum of per-stream peaks, >= the largest
// per-stream peak) and exact currents, for every statistic; owners' peaks
// within [live, max].
TEST_P(AttackTest, ConcurrentPeaksStayWithinTheDocumentedWindow) {
  Init();
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  const std::size_t kMax = 64 * kMiB;
  absl::StatusOr<OwnerId> owner = alloc_->RegisterOwner("window", kMax);
  ASSERT_TRUE(owner.ok());
  std::atomic<int> errors{0};
  Barrier start(kThreads);
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(77 + id);
    std::vector<LiveBlock> mine;
    std::int64_t mine_charged = 0;
    start.Wait();
    for (int i = 0; i < Scale(6000); ++i) {
      if (mine.empty() || rng() % 100 < 52) {
        const std::size_t bytes = 512 * (1 + rng() % 256);
        // Each thread stays within kMax / kThreads: no budget rejection.
        if (mine_charged + static_cast<std::int64_t>(bytes) >
            static_cast<std::int64_t>(kMax / kThreads)) {
          continue;
        }
        absl::StatusOr<DevicePtr> p =
            alloc_->Allocate(bytes, streams[id], *owner);
        if (!p.ok()) {
          ++errors;
          ADD_FAILURE() << p.status();
          continue;
        }
        mine.push_back({*p, bytes, bytes, streams[id]});
        mine_charged += static_cast<std::int64_t>(bytes);
      } else {
        const std::size_t k = rng() % mine.size();
        if (!alloc_->Deallocate(mine[k].ptr).ok()) ++errors;
        mine_charged -= static_cast<std::int64_t>(mine[k].requested);
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (const LiveBlock& b : mine) {
      if (!alloc_->Deallocate(b.ptr).ok()) ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(CheckStatsCopy(st), "");
  EXPECT_EQ(st.total.allocated_bytes[0].current, 0);
  absl::StatusOr<OwnerStats> os = alloc_->GetOwnerStats(*owner);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(os->live_bytes, 0u);
  EXPECT_LE(os->peak_live_bytes, kMax);
  EXPECT_EQ(os->num_budget_rejections, 0);
}

// ---------------------------------------------------------------------------
// 6. Racing double frees: two threads free the same live block at the same
// moment, in several flavours (plain, checked, plain + interior pointer,
// free + RecordStream, free + Lookup); exactly one free succeeds, the
// loser is counted once, nothing else is freed. The block's stream is used
// by the main thread only, and a pinned block keeps its segment partly used
// (so no other stream can take the segment over): no ABA is possible.
// Background threads churn on their own streams meanwhile.
TEST_P(AttackTest, RacingDoubleFreesHaveExactlyOneWinner) {
  Init();
  const StreamHandle s = NewStream(), other = NewStream();
  absl::StatusOr<LiveBlock> pin = AllocChecked(1024, s);
  ASSERT_TRUE(pin.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> bg_errors{0};
  auto background = [&](int id) {
    EnterThread();
    const StreamHandle bs = NewStream();
    std::mt19937_64 rng(id);
    std::vector<DevicePtr> mine;
    while (!stop.load()) {
      if (mine.size() < 16 && rng() % 2) {
        absl::StatusOr<DevicePtr> p =
            alloc_->Allocate(rng() % 3 == 0 ? 11 * kMiB : rng() % 65536, bs);
        if (p.ok()) {
          mine.push_back(*p);
        } else {
          ++bg_errors;
        }
      } else if (!mine.empty()) {
        if (!alloc_->Deallocate(mine.back()).ok()) ++bg_errors;
        mine.pop_back();
      }
    }
    for (DevicePtr p : mine) {
      if (!alloc_->Deallocate(p).ok()) ++bg_errors;
    }
  };
  std::thread bg1(background, 1), bg2(background, 2);

  Barrier go(3), done(3);
  std::atomic<int> mode{0};
  DevicePtr target;
  std::size_t target_bytes = 0;
  absl::Status results[2];
  std::atomic<bool> quit{false};
  auto racer = [&](int id) {
    EnterThread();
    while (true) {
      go.Wait();
      if (quit.load()) return;
      const int m = mode.load();
      const DevicePtr p = target;
      absl::Status r;
      switch (m) {
        case 0:  // plain + plain
          r = alloc_->Deallocate(p);
          break;
        case 1:  // checked (any owner, exact size) + checked
          r = alloc_->Deallocate(p, FreeCheck{.check_size = true,
                                              .requested_bytes = target_bytes});
          break;
        case 2:  // plain + interior pointer (never a block start)
          r = id == 0 ? alloc_->Deallocate(p) : alloc_->Deallocate(p + 512);
          break;
        case 3:  // free + RecordStream (either order is fine)
          r = id == 0 ? alloc_->Deallocate(p) : alloc_->RecordStream(p, other);
          break;
        case 4:  // free + Lookup
          if (id == 0) {
            r = alloc_->Deallocate(p);
          } else {
            absl::StatusOr<BlockInfo> info = alloc_->Lookup(p);
            r = info.status();
            // Racing the free: the live block as it was, or NOT_FOUND.
            if (info.ok() &&
                (info->requested_bytes != target_bytes ||
                 info->state != BlockState::kAllocated || info->ptr != p)) {
              r = absl::InternalError("Lookup saw a torn block");
            } else if (!info.ok() &&
                       info.status().code() != absl::StatusCode::kNotFound) {
              r = absl::InternalError(info.status().ToString());
            }
          }
          break;
        case 5:  // plain + checked free with order_after_stream
          r = id == 0
                  ? alloc_->Deallocate(p)
                  : alloc_->Deallocate(p, FreeCheck{.order_after_stream = true,
                                                    .stream = other});
          break;
      }
      results[id] = r;
      done.Wait();
    }
  };
  std::thread r0(racer, 0), r1(racer, 1);
  std::mt19937_64 rng(5);
  const int iters = Scale(1500);
  int wrong = 0;
  for (int i = 0; i < iters && wrong < 5; ++i) {
    const int m = i % 6;
    target_bytes = 1024 + 512 * (rng() % 120);
    absl::StatusOr<LiveBlock> b = AllocChecked(target_bytes, s);
    if (!b.ok()) {
      ADD_FAILURE() << b.status();
      break;
    }
    target = b->ptr;
    mode = m;
    const DeviceAllocatorStats before = alloc_->Stats();
    go.Wait();
    done.Wait();
    const DeviceAllocatorStats after = alloc_->Stats();
    const bool free0 = results[0].ok();
    const bool free1 = results[1].ok();
    int frees_ok = 0, frees_failed = 0;
    switch (m) {
      case 0:
      case 1:
      case 5:
        frees_ok = free0 + free1;
        frees_failed = 2 - frees_ok;
        if (frees_ok != 1) {
          ++wrong;
          ADD_FAILURE() << "mode " << m << ": " << results[0] << " / "
                        << results[1];
        }
        break;
      case 2:
        if (!free0 || free1) {
          ++wrong;
          ADD_FAILURE() << "free + interior: " << results[0] << " / "
                        << results[1];
        }
        frees_failed = 1;
        break;
      case 3:
      case 4:
        if (!free0 || results[1].code() == absl::StatusCode::kInternal) {
          ++wrong;
          ADD_FAILURE() << "mode " << m << ": " << results[0] << " / "
                        << results[1];
        }
        break;
    }
    if (m <= 2 || m == 5) {
      EXPECT_EQ(after.invalid_frees - before.invalid_frees, frees_failed)
          << "mode " << m;
    }
    EXPECT_EQ(absl::StatusCode::kNotFound,
              alloc_->Lookup(target).status().code())
        << "mode " << m;
    // The pin is untouched.
    absl::StatusOr<BlockInfo> pi = alloc_->Lookup(pin->ptr);
    if (!pi.ok() || pi->requested_bytes != 1024u) {
      ADD_FAILURE() << "the pinned block was freed or changed";
      break;
    }
  }
  quit = true;
  go.Wait();
  r0.join();
  r1.join();
  stop = true;
  bg1.join();
  bg2.join();
  EXPECT_EQ(bg_errors.load(), 0);
  EXPECT_TRUE(alloc_->Deallocate(pin->ptr).ok());
  EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 7. Interior, unaligned and foreign pointers, wrong sizes and wrong owners
// thrown at the blocks of threads that keep allocating and coalescing
// around them: nothing is ever freed, each refusal is counted exactly.
TEST_P(AttackTest, InteriorAndForeignPointersNeverFreeAnything) {
  Init();
  constexpr int kThreads = 3;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  absl::StatusOr<OwnerId> stranger = alloc_->RegisterOwner("stranger");
  ASSERT_TRUE(stranger.ok());
  // Long-lived targets on each stream, among churning neighbours.
  std::vector<LiveBlock> pinned;
  for (int i = 0; i < kThreads; ++i) {
    for (int k = 0; k < 6; ++k) {
      absl::StatusOr<LiveBlock> b =
          AllocChecked(k == 5 ? 12 * kMiB : 1024 * (1 + k * 7), streams[i]);
      ASSERT_TRUE(b.ok());
      pinned.push_back(*b);
    }
  }
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  auto churn = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(300 + id);
    std::vector<DevicePtr> mine;
    while (!stop.load()) {
      if (mine.size() < 32 && rng() % 2) {
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(
            rng() % 8 == 0 ? 2 * kMiB + rng() % (10 * kMiB) : rng() % 32768,
            streams[id]);
        if (!p.ok()) {
          ++errors;
          continue;
        }
        mine.push_back(*p);
      } else if (!mine.empty()) {
        const std::size_t k = rng() % mine.size();
        if (!alloc_->Deallocate(mine[k]).ok()) ++errors;
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (DevicePtr p : mine) {
      if (!alloc_->Deallocate(p).ok()) ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(churn, i);

  const DeviceAllocatorStats before = alloc_->Stats();
  const std::int64_t hits_before = before.cache_hits;
  std::int64_t want_invalid = 0, want_mismatched = 0, want_owner_invalid = 0;
  std::int64_t want_bad_requests = 0;
  std::mt19937_64 rng(9);
  const int iters = Scale(4000);
  // Attack until the neighbours churned a good while too.
  bool churned = false;
  for (int i = 0; i < iters || !churned; ++i) {
    if (i % 64 == 0) {
      churned = alloc_->Stats().cache_hits - hits_before >= Scale(30000);
    }
    const LiveBlock& t = pinned[rng() % pinned.size()];
    absl::Status st;
    switch (i % 9) {
      case 0:
        st = alloc_->Deallocate(t.ptr + 1);
        ++want_invalid;
        break;
      case 1:
        st = alloc_->Deallocate(t.ptr + 512);
        ++want_invalid;
        break;
      case 2:
        st = alloc_->Deallocate(t.ptr + 512, FreeCheck{});
        ++want_invalid;
        break;
      case 3:
        st = alloc_->Deallocate(
            t.ptr,
            FreeCheck{.check_size = true, .requested_bytes = t.requested + 1});
        ++want_invalid;
        ++want_mismatched;
        break;
      case 4:
        st = alloc_->Deallocate(t.ptr, FreeCheck{.owner = *stranger});
        ++want_owner_invalid;
        break;
      case 5:
        st = alloc_->Deallocate(t.ptr, FreeCheck{.owned_only = true});
        ++want_invalid;
        break;
      case 6:
        st = alloc_->RecordStream(t.ptr + 512, streams[0]);
        ++want_bad_requests;
        break;
      case 7:
        st =
            alloc_->Deallocate(DevicePtr(i % 2 ? 0x1000 : ~std::uint64_t{511}));
        ++want_invalid;
        break;
      case 8: {
        absl::StatusOr<BlockInfo> in = alloc_->Lookup(t.ptr + 512);
        EXPECT_EQ(in.status().code(), absl::StatusCode::kNotFound);
        absl::StatusOr<BlockInfo> at = alloc_->Lookup(t.ptr);
        if (!at.ok()) {
          ADD_FAILURE() << "pinned block lost: " << at.status();
          continue;
        }
        EXPECT_EQ(at->requested_bytes, t.requested);
        EXPECT_EQ(at->stream, t.stream);
        continue;
      }
    }
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument)
        << "attack " << i % 9 << ": " << st;
  }
  stop = true;
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  const DeviceAllocatorStats after = alloc_->Stats();
  EXPECT_EQ(after.invalid_frees - before.invalid_frees, want_invalid);
  EXPECT_EQ(after.mismatched_frees - before.mismatched_frees, want_mismatched);
  EXPECT_EQ(after.invalid_requests - before.invalid_requests,
            want_bad_requests);
  absl::StatusOr<OwnerStats> os = alloc_->GetOwnerStats(*stranger);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(os->invalid_frees, want_owner_invalid);
  for (const LiveBlock& b : pinned) {
    absl::StatusOr<BlockInfo> info = alloc_->Lookup(b.ptr);
    ASSERT_TRUE(info.ok()) << "a pinned block was freed by an attack";
    EXPECT_EQ(info->requested_bytes, b.requested);
    EXPECT_TRUE(alloc_->Deallocate(b.ptr).ok());
  }
  EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 8. An owner's budget: credit parked on idle streams never refuses what
// fits. Phase 1: twelve idle streams park credit, four threads whose quotas
// sum to exactly max allocate and free on their own streams — every Allocate
// must succeed. Phase 2: the four threads fill greedily with 4 KiB blocks
// until their first refusal; as live bytes only grow and max is a multiple
// of 4 KiB, the final live bytes must be exactly max (a refusal earlier is a
// false RESOURCE_EXHAUSTED, more is an overshoot).
TEST_P(AttackTest, OwnerBudgetIsExactWithParkedCredit) {
  Init();
  const std::size_t kMax = 1 * kMiB;  // credit chunk: 64 KiB
  absl::StatusOr<OwnerId> owner = alloc_->RegisterOwner("budget", kMax);
  ASSERT_TRUE(owner.ok());
  std::vector<StreamHandle> idle;
  for (int i = 0; i < 12; ++i) {
    idle.push_back(NewStream());
    absl::StatusOr<DevicePtr> p =
        alloc_->Allocate(64 * kKiB, idle.back(), *owner);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(alloc_->Deallocate(*p).ok());
  }
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  std::atomic<std::int64_t> visible{0};  // charges the test knows are live
  std::atomic<std::int64_t> visible_max{0};
  std::atomic<int> errors{0};
  std::vector<std::vector<DevicePtr>> filled(kThreads);
  Barrier phase(kThreads);
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(500 + id);
    const std::int64_t quota = kMax / kThreads;
    std::vector<std::pair<DevicePtr, std::int64_t>> mine;
    std::int64_t charged = 0;
    auto note = [&](std::int64_t d) {
      const std::int64_t v = visible.fetch_add(d) + d;
      std::int64_t m = visible_max.load();
      while (v > m && !visible_max.compare_exchange_weak(m, v)) {
      }
    };
    for (int i = 0; i < Scale(4000); ++i) {
      if (mine.empty() || rng() % 100 < 55) {
        const std::int64_t bytes =
            512 * (1 + static_cast<std::int64_t>(rng() % 32));
        if (charged + bytes > quota) continue;
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(
            static_cast<std::size_t>(bytes), streams[id], *owner);
        if (!p.ok()) {
          if (++errors < 5) {
            ADD_FAILURE() << "within quota (" << charged << " + " << bytes
                          << " of " << quota << "): " << p.status();
          }
          continue;
        }
        note(bytes);
        charged += bytes;
        mine.push_back({*p, bytes});
      } else {
        const std::size_t k = rng() % mine.size();
        note(-mine[k].second);
        charged -= mine[k].second;
        if (!alloc_->Deallocate(mine[k].first).ok()) ++errors;
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (auto& [p, n] : mine) {
      note(-n);
      if (!alloc_->Deallocate(p).ok()) ++errors;
    }
    phase.Wait();
    // Phase 2: greedy fill.
    while (true) {
      absl::StatusOr<DevicePtr> p =
          alloc_->Allocate(4 * kKiB, streams[id], *owner);
      if (!p.ok()) {
        if (p.status().code() != absl::StatusCode::kResourceExhausted) {
          ++errors;
          ADD_FAILURE() << p.status();
        }
        break;
      }
      note(4 * kKiB);
      filled[id].push_back(*p);
    }
  };
  std::atomic<bool> done{false};
  std::thread poller([&] {
    while (!done.load()) {
      absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*owner);
      if (!st.ok() || st->live_bytes > kMax || st->peak_live_bytes > kMax ||
          st->peak_live_bytes < st->live_bytes || st->live_allocations < 0 ||
          st->num_ooms != 0) {
        ++errors;
        ADD_FAILURE() << "GetOwnerStats mid-run: live " << st->live_bytes
                      << " peak " << st->peak_live_bytes;
        return;
      }
      std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  done = true;
  poller.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_LE(visible_max.load(), static_cast<std::int64_t>(kMax))
      << "overshoot of max_live_bytes";
  absl::StatusOr<OwnerStats> os = alloc_->GetOwnerStats(*owner);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(os->live_bytes, kMax) << "greedy fill stopped short of max";
  EXPECT_LE(os->peak_live_bytes, kMax);
  std::size_t blocks = 0;
  for (auto& v : filled) blocks += v.size();
  EXPECT_EQ(blocks * 4 * kKiB, kMax);
  // One more byte is refused; after one free, exactly that block fits.
  EXPECT_EQ(alloc_->Allocate(1, idle[3], *owner).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto& some = *std::find_if(filled.begin(), filled.end(),
                             [](const auto& v) { return !v.empty(); });
  ASSERT_TRUE(alloc_->Deallocate(some.back()).ok());
  some.pop_back();
  absl::StatusOr<DevicePtr> last = alloc_->Allocate(4 * kKiB, idle[7], *owner);
  EXPECT_TRUE(last.ok()) << last.status();
  if (last.ok()) some.push_back(*last);
  for (auto& v : filled) {
    for (DevicePtr p : v) EXPECT_TRUE(alloc_->Deallocate(p).ok());
  }
  os = alloc_->GetOwnerStats(*owner);
  ASSERT_TRUE(os.ok());
  EXPECT_EQ(os->live_bytes, 0u);
  EXPECT_EQ(os->live_allocations, 0);
}

// ---------------------------------------------------------------------------
// 9. CloseOwner racing with owned Allocate/Deallocate of two owners on
// several streams. X is closed mid-run; Y keeps going on the same streams
// (so X's reclaimed addresses come back as Y's blocks). Claims: a block
// never outlives the close (every X block is either freed by its thread or
// listed in `freed`, never both), no X allocation succeeds after
// CloseOwner returned, X's late checked frees never free Y's blocks, no
// false RESOURCE_EXHAUSTED (each thread within its quota of max), no
// overshoot, X ends with 0 live bytes.
TEST_P(AttackTest, CloseOwnerRacingWithOwnedTraffic) {
  Init();
  constexpr int kThreads = 4;
  const std::size_t kMaxX = 8 * kMiB;
  absl::StatusOr<OwnerId> x = alloc_->RegisterOwner("X", kMaxX);
  absl::StatusOr<OwnerId> y = alloc_->RegisterOwner("Y");
  ASSERT_TRUE(x.ok() && y.ok());
  std::vector<std::vector<StreamHandle>> streams(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    streams[i] = {NewStream(), NewStream()};
  }
  std::atomic<bool> close_started{false}, close_done{false}, stop{false};
  std::atomic<int> errors{0};
  std::atomic<std::int64_t> x_visible{0}, x_visible_max{0};
  std::atomic<std::int64_t> ops{0};
  std::mutex res_mu;
  std::vector<DevicePtr> x_refused;  // X frees refused (reclaimed by close)
  std::atomic<int> x_freed_ok{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(900 + id);
    std::vector<std::pair<DevicePtr, std::size_t>> xs, ys;
    std::int64_t x_charged = 0;
    const std::int64_t quota = kMaxX / kThreads;
    std::vector<DevicePtr> refused;
    auto note = [&](std::int64_t d) {
      const std::int64_t v = x_visible.fetch_add(d) + d;
      std::int64_t m = x_visible_max.load();
      while (v > m && !x_visible_max.compare_exchange_weak(m, v)) {
      }
    };
    auto free_x = [&](std::size_t k) {
      const auto [p, n] = xs[k];
      xs[k] = xs.back();
      xs.pop_back();
      note(-static_cast<std::int64_t>(n));
      x_charged -= static_cast<std::int64_t>(n);
      absl::Status st = alloc_->Deallocate(p, FreeCheck{.owner = *x});
      if (st.ok()) {
        ++x_freed_ok;
      } else if (st.code() == absl::StatusCode::kInvalidArgument &&
                 close_started.load()) {
        refused.push_back(p);
      } else {
        fail("X free: " + st.ToString());
      }
    };
    while (!stop.load()) {
      ++ops;
      const StreamHandle s = streams[id][rng() % 2];
      const int r = static_cast<int>(rng() % 100);
      if (r < 30) {
        const std::size_t bytes = 512 * (1 + rng() % 64);
        if (x_charged + static_cast<std::int64_t>(bytes) > quota) continue;
        const bool after_close = close_done.load();
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s, *x, "x");
        if (p.ok()) {
          if (after_close) fail("X allocation succeeded after CloseOwner");
          note(static_cast<std::int64_t>(bytes));
          x_charged += static_cast<std::int64_t>(bytes);
          xs.push_back({*p, bytes});
        } else if (p.status().code() != absl::StatusCode::kFailedPrecondition ||
                   !close_started.load()) {
          fail("X allocate: " + p.status().ToString());
        }
      } else if (r < 55) {
        const std::size_t bytes = 512 * (1 + rng() % 64);
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s, *y, "y");
        if (!p.ok()) {
          fail("Y allocate: " + p.status().ToString());
        } else {
          ys.push_back({*p, bytes});
        }
      } else if (r < 80) {
        if (!xs.empty()) free_x(rng() % xs.size());
      } else {
        if (!ys.empty()) {
          const std::size_t k = rng() % ys.size();
          absl::Status st = alloc_->Deallocate(
              ys[k].first, FreeCheck{.owner = *y,
                                     .check_size = true,
                                     .requested_bytes = ys[k].second});
          if (!st.ok())
            fail("Y free (someone freed a Y block?): " + st.ToString());
          ys[k] = ys.back();
          ys.pop_back();
        }
      }
      if (ys.size() > 64) {
        if (!alloc_->Deallocate(ys.back().first, FreeCheck{.owner = *y}).ok()) {
          fail("Y free");
        }
        ys.pop_back();
      }
    }
    while (!xs.empty()) free_x(xs.size() - 1);
    for (auto& [p, n] : ys) {
      if (!alloc_->Deallocate(p, FreeCheck{.owner = *y}).ok()) fail("Y free");
    }
    std::lock_guard<std::mutex> l(res_mu);
    x_refused.insert(x_refused.end(), refused.begin(), refused.end());
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  const std::int64_t warm = Scale(20000);
  while (ops.load() < warm) std::this_thread::yield();
  std::vector<OwnedBlock> freed;
  close_started = true;
  absl::Status closed = alloc_->CloseOwner(*x, &freed);
  close_done = true;
  const std::int64_t after = ops.load() + Scale(20000);
  while (ops.load() < after) std::this_thread::yield();
  stop = true;
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(closed.ok()) << closed;
  EXPECT_EQ(errors.load(), 0);
  EXPECT_LE(x_visible_max.load(), static_cast<std::int64_t>(kMaxX));
  // Every X block refused by a late free is one the close freed, and back.
  std::vector<DevicePtr> listed;
  for (const OwnedBlock& b : freed) {
    listed.push_back(b.ptr);
    EXPECT_STREQ(b.label, "x");
  }
  std::sort(listed.begin(), listed.end());
  std::sort(x_refused.begin(), x_refused.end());
  EXPECT_EQ(listed, x_refused) << freed.size() << " freed by close, "
                               << x_refused.size() << " refused late";
  absl::StatusOr<OwnerStats> xs = alloc_->GetOwnerStats(*x);
  ASSERT_TRUE(xs.ok());
  EXPECT_TRUE(xs->closed);
  EXPECT_EQ(xs->live_bytes, 0u);
  EXPECT_EQ(xs->live_allocations, 0);
  EXPECT_LE(xs->peak_live_bytes, kMaxX);
  EXPECT_EQ(xs->num_budget_rejections, 0);
  EXPECT_EQ(xs->num_frees, x_freed_ok.load());
  absl::StatusOr<OwnerStats> ys = alloc_->GetOwnerStats(*y);
  ASSERT_TRUE(ys.ok());
  EXPECT_EQ(ys->live_bytes, 0u);
  EXPECT_EQ(ys->invalid_frees, 0);
  absl::StatusOr<std::vector<OwnedBlock>> left = alloc_->OwnedBlocks(*x);
  ASSERT_TRUE(left.ok());
  EXPECT_TRUE(left->empty());
  EXPECT_TRUE(alloc_->UnregisterOwner(*x).ok());
  EXPECT_TRUE(alloc_->UnregisterOwner(*y).ok());
  EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 10. Many streams used for the first time at the same moment (the stream
// table grows from 16 slots while threads read it).
TEST_P(AttackTest, ManyStreamsFirstUsedConcurrently) {
  Init();
  constexpr int kThreads = 8;
  const int per_thread = CTXPOOL_ATTACK_TSAN ? 12 : 32;
  std::vector<std::vector<StreamHandle>> streams(kThreads);
  for (auto& v : streams) {
    for (int i = 0; i < per_thread; ++i) v.push_back(NewStream());
  }
  streams[0].back() = StreamHandle();  // the null (legacy) stream too
  Barrier start(kThreads);
  std::atomic<int> errors{0};
  std::vector<std::vector<LiveBlock>> got(kThreads);
  auto worker = [&](int id) {
    EnterThread();
    start.Wait();
    for (int round = 0; round < 3; ++round) {
      for (StreamHandle s : streams[id]) {
        absl::StatusOr<LiveBlock> b =
            AllocChecked(round == 1 ? kMiB : 4096 * (1 + round), s);
        if (!b.ok()) {
          if (++errors < 5) ADD_FAILURE() << b.status();
          continue;
        }
        got[id].push_back(*b);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.per_stream.size(),
            static_cast<std::size_t>(kThreads * per_thread));
  EXPECT_EQ(CheckStatsCopy(st), "");
  std::vector<DevicePtr> ptrs;
  for (auto& v : got) {
    for (const LiveBlock& b : v) {
      ptrs.push_back(b.ptr);
      absl::StatusOr<BlockInfo> info = alloc_->Lookup(b.ptr);
      ASSERT_TRUE(info.ok());
      EXPECT_EQ(info->stream, b.stream);
    }
  }
  std::sort(ptrs.begin(), ptrs.end());
  EXPECT_EQ(std::adjacent_find(ptrs.begin(), ptrs.end()), ptrs.end())
      << "a pointer was handed out twice";
  EXPECT_EQ(st.total.allocation[0].current,
            static_cast<std::int64_t>(ptrs.size()));
  // Free from other threads than the allocating ones.
  std::vector<std::thread> freers;
  for (int i = 0; i < kThreads; ++i) {
    freers.emplace_back([&, i] {
      for (const LiveBlock& b : got[(i + 3) % kThreads]) {
        if (!alloc_->Deallocate(b.ptr).ok()) ++errors;
      }
    });
  }
  for (std::thread& t : freers) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 11. Near OOM with memory_limit_bytes: four threads each hold at most one
// 10, 12 or 14 MiB block (own segments / whole granules) at a time, so the
// live bytes never pass 4 x 14 MiB = 56 MiB, the limit. Each allocation is
// made on a random stream of eight (so cached memory spreads over many
// streams and must move). Every Allocate must succeed: the OOM path must
// reclaim the other streams' cached memory.
TEST_P(AttackTest, NearOomOnlyLiveBytesCount) {
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 56 * kMiB;
  Init(1 * kGiB, o);
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  // One tenant (no limits) per stream: without pressure a stream never
  // reuses another tenant's cache, so the OOM path must do the moving.
  for (int i = 0; i < 8; ++i) {
    streams.push_back(NewStream());
    absl::StatusOr<TenantId> t =
        alloc_->RegisterTenant(absl::StrCat("t", i), Budget{});
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(alloc_->BindStream(streams.back(), *t).ok());
  }
  std::atomic<int> errors{0};
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id + 31);
    for (int i = 0; i < Scale(400); ++i) {
      // Whole granules: a block that is not a multiple of the 2 MiB granule
      // may straddle one more granule in expandable mode (legitimately).
      const std::size_t bytes = (10 + 2 * (rng() % 3)) * kMiB;
      const StreamHandle s = streams[rng() % streams.size()];
      absl::StatusOr<LiveBlock> b = AllocChecked(bytes, s);
      if (!b.ok()) {
        if (++errors < 5) {
          ADD_FAILURE() << "thread " << id << " op " << i << ": " << b.status();
        }
        continue;
      }
      if (rng() % 4 == 0) std::this_thread::yield();
      if (!alloc_->Deallocate(b->ptr).ok()) ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.num_ooms, 0);
  EXPECT_GT(st.num_alloc_retries, 0) << "the OOM path was not exercised";
  EXPECT_LE(alloc_->PhysicalBytes(), 56 * kMiB);
  EXPECT_EQ(CheckStatsCopy(st), "");
}

// Same, with small blocks beside the large ones and a roomier limit, plus a
// thread that trims: every Allocate must still succeed.
TEST_P(AttackTest, NearOomMixedSizesWithTrimmer) {
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 96 * kMiB;
  Init(1 * kGiB, o);
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  std::atomic<int> errors{0};
  std::atomic<bool> stop{false};
  // Big blocks (own segments) and a bounded set of small ones.
  auto worker2 = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id + 71);
    std::vector<DevicePtr> small;
    for (int i = 0; i < Scale(300); ++i) {
      absl::StatusOr<LiveBlock> big =
          AllocChecked(rng() % 2 ? 10 * kMiB : 14 * kMiB,
                       streams[(id + rng() % 2) % kThreads]);
      if (!big.ok()) {
        if (++errors < 5) ADD_FAILURE() << big.status();
        continue;
      }
      if (small.size() < 8) {
        absl::StatusOr<DevicePtr> p =
            alloc_->Allocate(512 * (1 + rng() % 32), streams[id]);
        if (p.ok()) {
          small.push_back(*p);
        } else if (++errors < 5) {
          ADD_FAILURE() << p.status();
        }
      } else {
        const std::size_t k = rng() % small.size();
        if (!alloc_->Deallocate(small[k]).ok()) ++errors;
        small.erase(small.begin() + static_cast<std::ptrdiff_t>(k));
      }
      if (!alloc_->Deallocate(big->ptr).ok()) ++errors;
    }
    for (DevicePtr p : small) {
      if (!alloc_->Deallocate(p).ok()) ++errors;
    }
  };
  std::thread trimmer([&] {
    EnterThread();
    int n = 0;
    while (!stop.load()) {
      if (n++ % 2) {
        if (!alloc_->Trim(0).ok()) ++errors;
      } else {
        if (!alloc_->TrimIdle().ok()) ++errors;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker2, i);
  for (std::thread& t : threads) t.join();
  stop = true;
  trimmer.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
}

// ---------------------------------------------------------------------------
// 12. Streams retired and destroyed while other threads allocate: a block
// still live on a retired (destroyed) stream is freed later by another
// thread; a block used (RecordStream) on a stream the allocator only knows
// through that use is freed after the stream was retired and destroyed;
// other streams take the retired streams' memory over and a trimmer waits
// for it. The allocator must never pass a destroyed handle to the driver
// (a misuse on the SimDriver), and stream order must hold (no race).
TEST_P(AttackTest, RetiredStreamsUnderConcurrentTraffic) {
  Init();
  constexpr int kThreads = 3;
  std::mutex orphan_mu;
  std::vector<DevicePtr> orphans;  // live blocks of retired streams
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id + 123);
    const StreamHandle home = NewStream();  // never destroyed
    for (int round = 0; round < Scale(80); ++round) {
      const StreamHandle s = NewStream();
      std::vector<LiveBlock> mine;
      for (int k = 0; k < 5; ++k) {
        const std::size_t bytes = k == 4 ? 10 * kMiB : 512 * (1 + rng() % 256);
        absl::StatusOr<LiveBlock> b = AllocChecked(bytes, s);
        if (!b.ok()) {
          fail(b.status().ToString());
          continue;
        }
        mine.push_back(*b);
      }
      // A block of `home` used on a stream known only through that use.
      const StreamHandle user = NewStream();
      absl::StatusOr<LiveBlock> shared = AllocChecked(8192, home);
      absl::StatusOr<EventHandle> e = sim_->EventCreate(kEventDisableTiming);
      if (!shared.ok() || !e.ok()) {
        fail("setup");
        return;
      }
      EXPECT_TRUE(sim_->EventRecord(*e, home).ok());
      EXPECT_TRUE(sim_->StreamWaitEvent(user, *e).ok());
      EXPECT_TRUE(sim_->Touch(user, shared->ptr, 8192).ok());
      EXPECT_TRUE(sim_->EventDestroy(*e).ok());
      if (!alloc_->RecordStream(shared->ptr, user).ok()) fail("RecordStream");
      // Keep one block of `s` alive past its retirement, for another thread.
      if (!mine.empty()) {
        std::lock_guard<std::mutex> l(orphan_mu);
        orphans.push_back(mine.back().ptr);
        mine.pop_back();
      }
      for (const LiveBlock& b : mine) {
        if (!alloc_->Deallocate(b.ptr).ok()) fail("free");
      }
      absl::Status r = alloc_->RetireStream(s);
      if (!r.ok()) fail("RetireStream: " + r.ToString());
      r = alloc_->RetireStream(user);
      if (!r.ok()) fail("RetireStream(user): " + r.ToString());
      if (!sim_->StreamDestroy(s).ok()) fail("StreamDestroy");
      if (!sim_->StreamDestroy(user).ok()) fail("StreamDestroy(user)");
      if (!alloc_->Deallocate(shared->ptr).ok()) fail("free of shared block");
      // Free someone's orphan.
      DevicePtr orphan;
      {
        std::lock_guard<std::mutex> l(orphan_mu);
        if (orphans.size() > 2) {
          const std::size_t k = rng() % orphans.size();
          orphan = orphans[k];
          orphans.erase(orphans.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      if (!orphan.is_null() && !alloc_->Deallocate(orphan).ok()) {
        fail("free of an orphan");
      }
      // Reuse on `home` (classic: may take over a retired stream's segment).
      absl::StatusOr<LiveBlock> h =
          AllocChecked(rng() % 2 ? 10 * kMiB : 512 * (1 + rng() % 256), home);
      if (!h.ok()) {
        fail(h.status().ToString());
      } else if (!alloc_->Deallocate(h->ptr).ok()) {
        fail("free on home");
      }
    }
  };
  std::thread trimmer([&] {
    EnterThread();
    int n = 0;
    while (!stop.load()) {
      absl::Status s;
      switch (n++ % 4) {
        case 0:
          s = alloc_->Trim(0).status();
          break;
        case 1:
          s = alloc_->TrimIdle().status();
          break;
        case 2:
          s = alloc_->CheckInvariants();
          break;
        case 3:
          s = alloc_->Trim(20 * kMiB).status();
          break;
      }
      if (!s.ok()) fail("trimmer: " + s.ToString());
      std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  stop = true;
  trimmer.join();
  for (DevicePtr p : orphans) EXPECT_TRUE(alloc_->Deallocate(p).ok());
  EXPECT_EQ(errors.load(), 0);
  ASSERT_TRUE(alloc_->Trim(0).ok());
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.allocation[0].current, 0);
  EXPECT_EQ(st.total.active[0].current, 0);
  EXPECT_EQ(st.driver_errors, 0);
}

// ---------------------------------------------------------------------------
// 13. BindStream / UnbindStream / SetBudget / TrimIdle / GetTenantStats race
// with allocation on the very streams being moved between tenants. The only
// acceptable Allocate failure is a tenant max (RESOURCE_EXHAUSTED); the
// tenants' books (I14) must hold at every check.
TEST_P(AttackTest, TenantRebindingRacesWithAllocation) {
  Init();
  constexpr int kThreads = 4;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  absl::StatusOr<TenantId> t1 =
      alloc_->RegisterTenant("t1", Budget{.high = 24 * kMiB, .max = 96 * kMiB});
  absl::StatusOr<TenantId> t2 = alloc_->RegisterTenant("t2", Budget{});
  ASSERT_TRUE(t1.ok() && t2.ok());
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  std::vector<std::vector<LiveBlock>> left(kThreads);
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id + 555);
    std::vector<LiveBlock> mine;
    while (!stop.load()) {
      if (mine.empty() || (mine.size() < 24 && rng() % 2)) {
        const std::size_t bytes =
            rng() % 5 == 0 ? kMiB + rng() % (6 * kMiB) : rng() % 65536;
        absl::StatusOr<LiveBlock> b = AllocChecked(bytes, streams[id]);
        if (b.ok()) {
          mine.push_back(*b);
        } else if (b.status().code() != absl::StatusCode::kResourceExhausted) {
          fail(b.status().ToString());
        }
      } else {
        const std::size_t k = rng() % mine.size();
        if (!alloc_->Deallocate(mine[k].ptr).ok()) fail("free");
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    left[id] = std::move(mine);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  std::vector<int> bound(kThreads, 0);  // 0: unbound, 1: t1, 2: t2
  std::mt19937_64 rng(1);
  for (int i = 0; i < Scale(1500); ++i) {
    const int k = static_cast<int>(rng() % kThreads);
    switch (rng() % 6) {
      case 0:
      case 1:
        if (bound[k] == 0) {
          const int to = 1 + static_cast<int>(rng() % 2);
          absl::Status s = alloc_->BindStream(streams[k], to == 1 ? *t1 : *t2);
          if (!s.ok()) fail("BindStream: " + s.ToString());
          bound[k] = to;
        } else {
          absl::Status s = alloc_->UnbindStream(streams[k]);
          if (!s.ok()) fail("UnbindStream: " + s.ToString());
          bound[k] = 0;
        }
        break;
      case 2: {
        const std::size_t high = (8 + rng() % 56) * kMiB;
        absl::StatusOr<TrimResult> r = alloc_->SetBudget(
            *t1, Budget{.high = high, .max = high + (rng() % 64) * kMiB});
        if (!r.ok()) fail("SetBudget: " + r.status().ToString());
        break;
      }
      case 3: {
        absl::StatusOr<TrimResult> r = alloc_->TrimIdle();
        if (!r.ok()) fail("TrimIdle: " + r.status().ToString());
        break;
      }
      case 4: {
        for (TenantId t : {kDefaultTenant, *t1, *t2}) {
          absl::StatusOr<TenantStats> ts = alloc_->GetTenantStats(t);
          if (!ts.ok() || ts->live_bytes > ts->mapped_bytes ||
              ts->cached_bytes != ts->mapped_bytes - ts->live_bytes) {
            fail("GetTenantStats inconsistent");
          }
        }
        break;
      }
      case 5: {
        absl::Status inv = alloc_->CheckInvariants();
        if (!inv.ok()) fail("CheckInvariants: " + inv.ToString());
        break;
      }
    }
  }
  stop = true;
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  // Live bytes per tenant match the test's books.
  std::vector<std::size_t> live(3, 0);
  for (int k = 0; k < kThreads; ++k) {
    for (const LiveBlock& b : left[k]) live[bound[k]] += b.size;
  }
  absl::StatusOr<TenantStats> s1 = alloc_->GetTenantStats(*t1);
  absl::StatusOr<TenantStats> s2 = alloc_->GetTenantStats(*t2);
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->live_bytes, live[1]);
  EXPECT_EQ(s2->live_bytes, live[2]);
  for (auto& v : left) {
    for (const LiveBlock& b : v) EXPECT_TRUE(alloc_->Deallocate(b.ptr).ok());
  }
  for (int k = 0; k < kThreads; ++k) {
    if (bound[k] != 0) {
      EXPECT_TRUE(alloc_->UnbindStream(streams[k]).ok());
    }
  }
  EXPECT_TRUE(alloc_->UnregisterTenant(*t1).ok());
  EXPECT_TRUE(alloc_->UnregisterTenant(*t2).ok());
}

// ---------------------------------------------------------------------------
// 14. RecordStream (and a free ordered after another stream) made from a
// thread other than the allocating one, with the user stream held so its
// work stays pending: the allocating thread keeps allocating on its stream
// and must never get the block back before the user's work completes (the
// SimDriver's race detector reports a reuse that is not ordered).
TEST_P(AttackTest, CrossThreadRecordStreamHonoursStreamOrder) {
  Init();
  constexpr int kPairs = 2;
  std::atomic<int> errors{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  auto pair = [&](int id) {
    EnterThread();
    const StreamHandle sa = NewStream(), sb = NewStream();
    std::mutex mu;
    std::condition_variable cv;
    int stage = 0;  // 0: A's turn, 1: B's turn
    DevicePtr p;
    const int rounds = Scale(200);
    std::thread b_thread([&] {
      EnterThread();
      absl::StatusOr<EventHandle> e = sim_->EventCreate(kEventDisableTiming);
      ASSERT_TRUE(e.ok());
      sim_->Hold(sb);
      for (int round = 0; round < rounds; ++round) {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stage == 1; });
        // Order sb after sa's use, use the block on sb (pending: held),
        // then tell the allocator.
        if (!sim_->EventRecord(*e, sa).ok() ||
            !sim_->StreamWaitEvent(sb, *e).ok() ||
            !sim_->Touch(sb, p, 64 * kKiB).ok()) {
          fail("sim setup");
        }
        if (round % 2 == 0) {
          absl::Status s = alloc_->RecordStream(p, sb);
          if (!s.ok()) fail("RecordStream: " + s.ToString());
        } else {
          // B frees it itself, ordered after sb.
          absl::Status s =
              alloc_->Deallocate(p, FreeCheck{.check_size = true,
                                              .requested_bytes = 64 * kKiB,
                                              .order_after_stream = true,
                                              .stream = sb});
          if (!s.ok()) fail("ordered free: " + s.ToString());
        }
        if (round % 16 == 15) {
          sim_->Release(sb);  // completes the pending uses
          sim_->Hold(sb);
        }
        stage = 0;
        cv.notify_all();
      }
      sim_->Release(sb);
      EXPECT_TRUE(sim_->EventDestroy(*e).ok());
    });
    EnterThread();
    std::vector<DevicePtr> keep;
    for (int round = 0; round < rounds; ++round) {
      absl::StatusOr<LiveBlock> b = AllocChecked(64 * kKiB, sa);
      if (!b.ok()) {
        fail(b.status().ToString());
        break;
      }
      {
        std::unique_lock<std::mutex> l(mu);
        p = b->ptr;
        stage = 1;
        cv.notify_all();
        cv.wait(l, [&] { return stage == 0; });
      }
      if (round % 2 == 0) {
        if (!alloc_->Deallocate(b->ptr).ok()) fail("free");
      }
      if (round % 8 == 0) {
        // sb is held: the block must wait for it (pending free).
        bool pending = false;
        for (const SegmentInfo& seg : alloc_->Snapshot().segments) {
          for (const BlockInfo& bi : seg.blocks) {
            if (bi.ptr == b->ptr) {
              pending = bi.state == BlockState::kPendingFree;
            }
          }
        }
        if (!pending) fail("a block used on a held stream was not pending");
      }
      // Allocate (and use on sa) what the cache offers now.
      for (int k = 0; k < 3; ++k) {
        absl::StatusOr<LiveBlock> c = AllocChecked(64 * kKiB, sa);
        if (!c.ok()) {
          fail(c.status().ToString());
          continue;
        }
        keep.push_back(c->ptr);
      }
      while (keep.size() > 6) {
        if (!alloc_->Deallocate(keep.front()).ok()) fail("free");
        keep.erase(keep.begin());
      }
    }
    b_thread.join();
    for (DevicePtr k : keep) {
      if (!alloc_->Deallocate(k).ok()) fail("free");
    }
    (void)id;
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kPairs; ++i) threads.emplace_back(pair, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  ASSERT_TRUE(alloc_->Trim(0).ok());  // every stream released: no wait fails
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.active[0].current, 0);
  EXPECT_EQ(st.total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 15. An OOM callback that frees a hoard of blocks and trims, called while
// threads on other streams keep allocating (it runs without the allocator's
// locks). The hoard (3 x 12 MiB) plus the workers' needs (3 x (12 MiB own
// segment + a small segment)) exceed the 64 MiB limit, the workers' needs
// alone do not: once the hoard is gone, nothing may fail. The callback frees
// under the test's mutex and always asks for the retry, so a second
// callback racing the first retries after the first one's frees.
TEST_P(AttackTest, OomCallbackFreesWhileOthersAllocate) {
  std::mutex hoard_mu;
  std::vector<DevicePtr> hoard;
  std::atomic<int> callbacks{0};
  CachingDeviceAllocator* self = nullptr;
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 64 * kMiB;
  o.on_oom = [&](const OomReport&) {
    ++callbacks;
    std::lock_guard<std::mutex> l(hoard_mu);
    for (DevicePtr p : hoard) EXPECT_TRUE(self->Deallocate(p).ok());
    hoard.clear();
    EXPECT_TRUE(self->Trim(0).ok());
    return true;
  };
  Init(1 * kGiB, o);
  self = alloc_.get();
  const StreamHandle hs = NewStream();
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<DevicePtr> p = alloc_->Allocate(12 * kMiB, hs);
    ASSERT_TRUE(p.ok()) << p.status();
    hoard.push_back(*p);
  }
  constexpr int kThreads = 3;
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  std::atomic<int> errors{0};
  Barrier holding(kThreads);
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id);
    // All three hold 12 MiB at once beside the hoard: 72 MiB > 64 MiB, so at
    // least one of them goes through the OOM path and the callback.
    absl::StatusOr<LiveBlock> first = AllocChecked(12 * kMiB, streams[id]);
    if (!first.ok()) {
      ++errors;
      ADD_FAILURE() << first.status();
    }
    holding.Wait();
    if (first.ok() && !alloc_->Deallocate(first->ptr).ok()) ++errors;
    for (int i = 0; i < Scale(600); ++i) {
      absl::StatusOr<LiveBlock> b =
          AllocChecked(rng() % 3 == 0 ? 12 * kMiB : rng() % 65536, streams[id]);
      if (!b.ok()) {
        if (++errors < 5) ADD_FAILURE() << b.status();
        continue;
      }
      if (!alloc_->Deallocate(b->ptr).ok()) ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GE(callbacks.load(), 1);
  EXPECT_EQ(alloc_->Stats().num_ooms, 0);
  for (DevicePtr p : hoard) EXPECT_TRUE(alloc_->Deallocate(p).ok());
  EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
}

// ---------------------------------------------------------------------------
// 16. CloseOwner while an owned Allocate of that owner waits in the OOM
// callback (called without the allocator's locks): the close frees the
// owner's block, which makes room, but the retry must be refused
// (FAILED_PRECONDITION): no block may be handed to a closed owner.
TEST_P(AttackTest, CloseOwnerDuringOomCallbackRefusesTheRetry) {
  std::atomic<int> stage{0};  // 1: in the callback, 2: closed
  DeviceAllocatorOptions o;
  o.memory_limit_bytes = 32 * kMiB;
  o.on_oom = [&](const OomReport&) {
    stage = 1;
    while (stage.load() != 2) std::this_thread::yield();
    return true;
  };
  Init(1 * kGiB, o);
  for (std::size_t max : {std::size_t{0}, 64 * kMiB}) {
    SCOPED_TRACE(max == 0 ? "no max" : "with a max (credit)");
    stage = 0;
    absl::StatusOr<OwnerId> x = alloc_->RegisterOwner("X", max);
    ASSERT_TRUE(x.ok());
    const StreamHandle s = NewStream();
    absl::StatusOr<DevicePtr> first = alloc_->Allocate(20 * kMiB, s, *x);
    ASSERT_TRUE(first.ok()) << first.status();
    absl::Status second;
    std::thread t([&] {
      EnterThread();
      second = alloc_->Allocate(20 * kMiB, NewStream(), *x).status();
    });
    while (stage.load() != 1) std::this_thread::yield();
    std::vector<OwnedBlock> freed;
    EXPECT_TRUE(alloc_->CloseOwner(*x, &freed).ok());
    EXPECT_EQ(freed.size(), 1u);
    stage = 2;
    t.join();
    EXPECT_EQ(second.code(), absl::StatusCode::kFailedPrecondition) << second;
    absl::StatusOr<OwnerStats> st = alloc_->GetOwnerStats(*x);
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->live_bytes, 0u);
    EXPECT_EQ(st->live_allocations, 0);
    EXPECT_EQ(alloc_->Stats().total.allocation[0].current, 0);
    absl::Status inv = alloc_->CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv;
    ASSERT_TRUE(alloc_->Trim(0).ok());
  }
}

// ---------------------------------------------------------------------------
// 17. UnregisterOwner (without CloseOwner) racing with owned traffic on
// several streams: blocks live at that moment stay allocated, owned by
// nobody; later owned calls are refused; a checked free naming the gone
// owner is refused and frees nothing; every block is freed exactly once.
TEST_P(AttackTest, UnregisterOwnerRacingWithOwnedTraffic) {
  Init();
  constexpr int kThreads = 3;
  absl::StatusOr<OwnerId> x = alloc_->RegisterOwner("X", 16 * kMiB);
  ASSERT_TRUE(x.ok());
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  // gone: UnregisterOwner was called (frees may be refused from then on);
  // gone_done: it returned (no owned allocation may succeed from then on).
  std::atomic<bool> gone{false}, gone_done{false}, stop{false};
  std::atomic<std::int64_t> ops{0};
  std::atomic<int> errors{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  auto worker = [&](int id) {
    EnterThread();
    std::mt19937_64 rng(id + 4242);
    std::vector<std::pair<DevicePtr, std::size_t>> mine;
    std::size_t charged = 0;
    auto free_one = [&](std::size_t k) {
      const auto [p, n] = mine[k];
      mine[k] = mine.back();
      mine.pop_back();
      charged -= (n + 511) / 512 * 512;
      absl::Status st = alloc_->Deallocate(
          p, FreeCheck{.owner = *x, .check_size = true, .requested_bytes = n});
      if (st.ok()) return;
      if (!gone.load() || st.code() != absl::StatusCode::kInvalidArgument) {
        fail("owned free: " + st.ToString());
        return;
      }
      // Owned by nobody now: exactly that block, still live, still n bytes.
      absl::StatusOr<BlockInfo> info = alloc_->Lookup(p);
      if (!info.ok() || info->owner != kNoOwner || info->requested_bytes != n) {
        fail("a block of the unregistered owner changed");
      }
      st = alloc_->Deallocate(
          p, FreeCheck{
                 .owner = kNoOwner, .check_size = true, .requested_bytes = n});
      if (!st.ok()) fail("free of a detached block: " + st.ToString());
    };
    while (!stop.load()) {
      ++ops;
      if (mine.empty() || rng() % 2) {
        const std::size_t n = 1 + rng() % 65536;
        if (charged + (n + 511) / 512 * 512 > 16 * kMiB / kThreads) {
          free_one(rng() % mine.size());
          continue;
        }
        const bool after = gone_done.load();
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, streams[id], *x);
        if (p.ok()) {
          if (after) fail("allocation for an unregistered owner succeeded");
          mine.push_back({*p, n});
          charged += (n + 511) / 512 * 512;
        } else if (!gone.load() ||
                   p.status().code() != absl::StatusCode::kInvalidArgument) {
          fail("owned allocate: " + p.status().ToString());
        }
      } else {
        free_one(rng() % mine.size());
      }
    }
    while (!mine.empty()) free_one(mine.size() - 1);
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  while (ops.load() < Scale(20000)) std::this_thread::yield();
  gone = true;
  absl::StatusOr<OwnerStats> last = alloc_->UnregisterOwner(*x);
  gone_done = true;
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_LE(last->live_bytes, 16 * kMiB);
  absl::Status inv = alloc_->CheckInvariants();
  EXPECT_TRUE(inv.ok()) << inv;
  const std::int64_t until = ops.load() + Scale(20000);
  while (ops.load() < until) std::this_thread::yield();
  stop = true;
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(alloc_->GetOwnerStats(*x).status().code(),
            absl::StatusCode::kNotFound);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.allocation[0].current, 0);
  EXPECT_EQ(st.total.requested_bytes[0].current, 0);
}

// ---------------------------------------------------------------------------
// 18. RetireStream called again and again on a stream another thread keeps
// allocating on (from the allocator's side the handle "comes back" each
// time: its next Allocate revives it), while a third thread allocates large
// blocks on its own stream (classic: it may take over the retired stream's
// wholly free segments) and the main thread trims. (No work is enqueued on
// the retired stream by the test itself: that would break RetireStream's
// REQUIRES.)
TEST_P(AttackTest, RetireStreamRacingWithTrafficOnThatStream) {
  Init();
  const StreamHandle s = NewStream(), u = NewStream();
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  auto fail = [&](const std::string& m) {
    if (++errors < 6) ADD_FAILURE() << m;
  };
  std::thread ts([&] {
    EnterThread();
    std::mt19937_64 rng(17);
    std::vector<std::pair<DevicePtr, std::size_t>> mine;
    while (!stop.load()) {
      if (mine.size() < 8 && (mine.empty() || rng() % 2)) {
        const std::size_t n = rng() % 4 == 0 ? 10 * kMiB : rng() % 65536;
        absl::StatusOr<DevicePtr> p = alloc_->Allocate(n, s);
        if (!p.ok()) {
          fail(p.status().ToString());
          continue;
        }
        mine.push_back({*p, n});
      } else {
        const std::size_t k = rng() % mine.size();
        if (!alloc_->Deallocate(mine[k].first).ok()) fail("free on s");
        mine[k] = mine.back();
        mine.pop_back();
      }
    }
    for (auto& [p, n] : mine) {
      if (!alloc_->Deallocate(p).ok()) fail("free on s");
    }
  });
  std::thread tu([&] {
    EnterThread();
    std::mt19937_64 rng(18);
    while (!stop.load()) {
      absl::StatusOr<LiveBlock> b =
          AllocChecked(rng() % 2 ? 10 * kMiB : 512 * (1 + rng() % 128), u);
      if (!b.ok()) {
        fail(b.status().ToString());
        continue;
      }
      if (!alloc_->Deallocate(b->ptr).ok()) fail("free on u");
    }
  });
  for (int i = 0; i < Scale(400); ++i) {
    absl::Status r = alloc_->RetireStream(s);
    if (!r.ok()) fail("RetireStream: " + r.ToString());
    if (i % 8 == 0) {
      absl::StatusOr<TrimResult> t = alloc_->Trim(0);
      if (!t.ok()) fail("Trim: " + t.status().ToString());
    }
    if (i % 16 == 0) {
      std::string p = CheckStatsCopy(alloc_->Stats());
      if (!p.empty()) fail("Stats: " + p);
    }
    std::this_thread::yield();
  }
  stop = true;
  ts.join();
  tu.join();
  EXPECT_EQ(errors.load(), 0);
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.allocation[0].current, 0);
  EXPECT_EQ(st.driver_errors, 0);
  EXPECT_EQ(st.destroyed_streams, 0);
}

// ---------------------------------------------------------------------------
// 19. "The cached path of Allocate and Deallocate ... makes no driver call":
// once every stream is warm, threads on distinct streams allocating and
// freeing what their caches hold (in any order, owned or not, with the sums
// handed over between threads all the time) make no driver call at all.
TEST_P(AttackTest, WarmCachedPathsMakeNoDriverCallUnderConcurrency) {
  Init();
  constexpr int kThreads = 4;
  absl::StatusOr<OwnerId> owner = alloc_->RegisterOwner("hot", 64 * kMiB);
  ASSERT_TRUE(owner.ok());
  std::vector<StreamHandle> streams;
  for (int i = 0; i < kThreads; ++i) streams.push_back(NewStream());
  // Each thread's working set: 8 small blocks (<= 64 KiB: one 2 MiB small
  // segment always holds them, whatever the order) and one 12 MiB block.
  auto sizes = [](int k) { return k == 8 ? 12 * kMiB : 4096 * (1 + 2 * k); };
  std::vector<DevicePtr> warm;
  for (int i = 0; i < kThreads; ++i) {
    for (int k = 0; k <= 8; ++k) {
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(sizes(k), streams[i]);
      ASSERT_TRUE(p.ok());
      warm.push_back(*p);
      absl::StatusOr<DevicePtr> q =
          alloc_->Allocate(sizes(k), streams[i], *owner);  // sub-accounts
      ASSERT_TRUE(q.ok());
      warm.push_back(*q);
    }
  }
  for (DevicePtr p : warm) ASSERT_TRUE(alloc_->Deallocate(p).ok());
  const std::uint64_t calls = sim_->total_call_count();
  const DeviceAllocatorStats before = alloc_->Stats();
  std::atomic<int> errors{0};
  Barrier start(kThreads);
  auto worker = [&](int id) {
    std::mt19937_64 rng(id + 99);
    std::vector<DevicePtr> mine;
    std::vector<int> order = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    start.Wait();
    for (int round = 0; round < Scale(3000); ++round) {
      std::shuffle(order.begin(), order.end(), rng);
      const bool owned = rng() % 2;
      for (int k : order) {
        absl::StatusOr<DevicePtr> p =
            owned ? alloc_->Allocate(sizes(k), streams[id], *owner)
                  : alloc_->Allocate(sizes(k), streams[id]);
        if (!p.ok()) {
          ++errors;
          continue;
        }
        mine.push_back(*p);
      }
      std::shuffle(mine.begin(), mine.end(), rng);
      for (DevicePtr p : mine) {
        if (!alloc_->Deallocate(p).ok()) ++errors;
      }
      mine.clear();
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) threads.emplace_back(worker, i);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(sim_->total_call_count(), calls)
      << "driver calls were made on warm cached paths";
  const DeviceAllocatorStats after = alloc_->Stats();
  EXPECT_EQ(after.upstream_allocs, before.upstream_allocs);
  EXPECT_EQ(after.num_stream_waits, before.num_stream_waits);
  EXPECT_EQ(after.cache_hits - before.cache_hits,
            static_cast<std::int64_t>(kThreads) * Scale(3000) * 9);
  EXPECT_EQ(CheckStatsCopy(after), "");
}

INSTANTIATE_TEST_SUITE_P(Backings, AttackTest,
                         ::testing::Values(BackingMode::kClassic,
                                           BackingMode::kExpandable),
                         [](const ::testing::TestParamInfo<BackingMode>& info) {
                           return info.param == BackingMode::kClassic
                                      ? std::string("Classic")
                                      : std::string("Expandable");
                         });

}  // namespace
}  // namespace ctxpool
