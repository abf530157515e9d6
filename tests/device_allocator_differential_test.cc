// A seeded randomized differential test of CachingDeviceAllocator against a
// reference model (the set of live blocks), on SimDriver with its stream-race
// detector on.
//
// Phase 1 is single-threaded over several streams, some held for a while so
// frees stay pending and segments move between streams; every step is
// compared exactly with the model. Phase 2 runs threads that each own
// streams. Throughout: live blocks never overlap, every live pointer lies in
// a segment of Snapshot(), Stats() equals the model's sums, CheckInvariants()
// holds every 1000 steps and at the end, every block is touched on its
// stream(s) and the simulator reports no race and no misuse.
//
// The test runs in both backing modes (classic segments and expandable VMM
// ranges). Streams 0-1 belong to tenant "a" and 2-3 to tenant "b" with
// budgets (b has a low high, so its frees shed granules); each tenant's live
// bytes equal the model's and its mapped bytes stay under its max.
//
// Decay is on with a short idle_release_after on a clock that advances one
// millisecond per operation, and TrimIdle runs now and then (also while
// streams are held), so idle streams' granules and segments decay under the
// race detector throughout.
//
// Environment: CTXPOOL_TEST_SEED (default 20240601) and CTXPOOL_DIFF_OPS
// (total operations, default 200000; sanitizer builds may lower it).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

std::uint64_t EnvOr(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoull(v, nullptr, 10);
}

constexpr std::size_t kMaxLive = 192;
constexpr std::size_t kMaxLiveBytes = 3 * kGiB;

// Sizes from 1 B to 64 MiB, log-uniform within bands skewed to small.
std::size_t RandomSize(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double band = u(rng);
  double lo, hi;
  if (band < 0.60) {
    lo = 0, hi = 12;  // 1 B .. 4 KiB
  } else if (band < 0.85) {
    lo = 12, hi = 20;  // .. 1 MiB
  } else if (band < 0.97) {
    lo = 20, hi = 24;  // .. 16 MiB
  } else {
    lo = 24, hi = 26;  // .. 64 MiB
  }
  const double bytes = std::exp2(lo + (hi - lo) * u(rng));
  if (u(rng) < 0.02) return 0;
  return static_cast<std::size_t>(bytes);
}

std::size_t Rounded(std::size_t bytes) {
  return bytes == 0 ? 512 : (bytes + 511) / 512 * 512;
}

struct Live {
  std::size_t requested = 0;
  std::size_t size = 0;  // block size (from Lookup)
  StreamHandle stream;
  StreamHandle last_user;  // the stream that touched it last
};

// The reference model: live blocks by address.
class Model {
 public:
  // Adds a block; returns an error message if it overlaps a live one.
  std::string Add(DevicePtr p, const Live& l) {
    auto next = blocks_.lower_bound(p.address());
    if (next != blocks_.end() && next->first < p.address() + l.size) {
      return absl::StrFormat("block 0x%x+%d overlaps live 0x%x", p.address(),
                             l.size, next->first);
    }
    if (next != blocks_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second.size > p.address()) {
        return absl::StrFormat("block 0x%x overlaps live 0x%x+%d", p.address(),
                               prev->first, prev->second.size);
      }
    }
    blocks_.emplace(p.address(), l);
    requested_ += l.requested;
    allocated_ += l.size;
    return "";
  }
  Live Remove(std::uint64_t address) {
    auto it = blocks_.find(address);
    Live l = it->second;
    requested_ -= l.requested;
    allocated_ -= l.size;
    blocks_.erase(it);
    return l;
  }
  // A random live block (uniform enough for a test).
  std::uint64_t Pick(std::mt19937_64& rng) const {
    const std::uint64_t lo = blocks_.begin()->first;
    const std::uint64_t hi = blocks_.rbegin()->first;
    auto it = blocks_.lower_bound(lo + rng() % (hi - lo + 1));
    return it->first;
  }
  Live& Get(std::uint64_t address) { return blocks_.at(address); }
  std::size_t count() const { return blocks_.size(); }
  std::size_t requested() const { return requested_; }
  std::size_t allocated() const { return allocated_; }
  const std::map<std::uint64_t, Live>& blocks() const { return blocks_; }

 private:
  std::map<std::uint64_t, Live> blocks_;
  std::size_t requested_ = 0;
  std::size_t allocated_ = 0;
};

class DifferentialTest : public ::testing::TestWithParam<BackingMode> {
 protected:
  void SetUp() override {
    seed_ = EnvOr("CTXPOOL_TEST_SEED", 20240601);
    ops_ = EnvOr("CTXPOOL_DIFF_OPS", 200000);
    sim_ = SimDriver::Create({.devices = {*SimDevicePreset("h100-80gb")}});
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
    for (int i = 0; i < 4; ++i) {
      streams_.push_back(*sim_->StreamCreate(kStreamNonBlocking, 0));
    }
    DeviceAllocatorOptions o;
    o.backing = GetParam();
    o.idle_release_after = absl::Milliseconds(3);
    o.clock = [this] {
      return absl::FromUnixMillis(clock_ms_.load(std::memory_order_relaxed));
    };
    auto a = CachingDeviceAllocator::Create(*sim_, 0, o);
    ASSERT_TRUE(a.ok()) << a.status();
    alloc_ = std::move(*a);
    absl::StatusOr<TenantId> ta = alloc_->RegisterTenant("a", kBudgetA);
    absl::StatusOr<TenantId> tb = alloc_->RegisterTenant("b", kBudgetB);
    ASSERT_TRUE(ta.ok() && tb.ok());
    tenants_[0] = *ta;
    tenants_[1] = *tb;
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(alloc_->BindStream(streams_[i], tenants_[i / 2]).ok());
    }
    std::printf("CTXPOOL_TEST_SEED=%llu CTXPOOL_DIFF_OPS=%llu\n",
                static_cast<unsigned long long>(seed_),
                static_cast<unsigned long long>(ops_));
  }

  // Later work on `later` waits for the work now on `earlier`.
  absl::Status OrderAfter(StreamHandle later, StreamHandle earlier) {
    CTXPOOL_ASSIGN_OR_RETURN(EventHandle e,
                             sim_->EventCreate(kEventDisableTiming));
    CTXPOOL_RETURN_IF_ERROR(sim_->EventRecord(e, earlier));
    CTXPOOL_RETURN_IF_ERROR(sim_->StreamWaitEvent(later, e));
    return sim_->EventDestroy(e);
  }

  // Stats and Snapshot agree with the model (single-threaded callers).
  void CheckAgainstModel(const Model& m, bool snapshot) {
    DeviceAllocatorStats st = alloc_->Stats();
    ASSERT_EQ(st.total.allocation[0].current,
              static_cast<std::int64_t>(m.count()));
    ASSERT_EQ(st.total.requested_bytes[0].current,
              static_cast<std::int64_t>(m.requested()));
    ASSERT_EQ(st.total.allocated_bytes[0].current,
              static_cast<std::int64_t>(m.allocated()));
    std::size_t tenant_live[2] = {0, 0};
    for (const auto& [address, live] : m.blocks()) {
      for (int i = 0; i < 4; ++i) {
        if (streams_[i] == live.stream) tenant_live[i / 2] += live.size;
      }
    }
    const Budget budgets[2] = {kBudgetA, kBudgetB};
    for (int t = 0; t < 2; ++t) {
      absl::StatusOr<TenantStats> ts = alloc_->GetTenantStats(tenants_[t]);
      ASSERT_TRUE(ts.ok());
      ASSERT_EQ(ts->live_bytes, tenant_live[t]) << "tenant " << t;
      ASSERT_LE(ts->mapped_bytes, budgets[t].max) << "tenant " << t;
      ASSERT_EQ(ts->num_ooms, 0);
    }
    if (!snapshot) return;
    absl::Status inv = alloc_->CheckInvariants();
    ASSERT_TRUE(inv.ok()) << inv;
    AllocatorSnapshot snap = alloc_->Snapshot();
    std::map<std::uint64_t, const SegmentInfo*> by_base;
    for (const SegmentInfo& seg : snap.segments) {
      by_base[seg.base.address()] = &seg;
    }
    for (const auto& [address, live] : m.blocks()) {
      auto it = by_base.upper_bound(address);
      ASSERT_NE(it, by_base.begin()) << "0x" << std::hex << address;
      const SegmentInfo& seg = *std::prev(it)->second;
      ASSERT_LE(address + live.size, seg.base.address() + seg.size)
          << "live block 0x" << std::hex << address << " not in a segment";
      ASSERT_EQ(seg.stream, live.stream);
    }
  }

  std::uint64_t seed_ = 0;
  std::uint64_t ops_ = 0;
  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  std::vector<StreamHandle> streams_;
  std::unique_ptr<CachingDeviceAllocator> alloc_;
  TenantId tenants_[2] = {};
  // The allocator's clock: each operation advances it by 1 ms.
  std::atomic<std::int64_t> clock_ms_{0};
  static constexpr Budget kBudgetA = {
      .min = 256 * kMiB, .high = kNoLimit, .max = 12 * kGiB};
  static constexpr Budget kBudgetB = {
      .min = 0, .high = 512 * kMiB, .max = 12 * kGiB};
};

TEST_P(DifferentialTest, MatchesReferenceModel) {
  std::mt19937_64 rng(seed_);
  Model model;
  std::vector<bool> held(streams_.size(), false);
  auto release_all = [&] {
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (held[i]) sim_->Release(streams_[i]);
      held[i] = false;
    }
  };
  const std::uint64_t phase1 = ops_ / 2;
  std::uint64_t trims = 0;
  for (std::uint64_t step = 0; step < phase1; ++step) {
    SCOPED_TRACE(absl::StrFormat("seed %d, phase 1, step %d", seed_, step));
    clock_ms_.fetch_add(1, std::memory_order_relaxed);
    const int op = static_cast<int>(rng() % 1000);
    const bool full =
        model.count() >= kMaxLive || model.allocated() >= kMaxLiveBytes;
    if (op < 5) {  // hold or release a stream
      const std::size_t i = rng() % streams_.size();
      if (held[i]) {
        sim_->Release(streams_[i]);
      } else {
        sim_->Hold(streams_[i]);
      }
      held[i] = !held[i];
    } else if (op < 7 && rng() % 2 == 0) {  // never waits: held is fine
      absl::StatusOr<TrimResult> t = alloc_->TrimIdle();
      ASSERT_TRUE(t.ok()) << t.status();
    } else if (op < 7) {  // trim (never while a stream is held)
      release_all();
      absl::StatusOr<TrimResult> t =
          alloc_->Trim(rng() % 2 == 0 ? 0 : 256 * kMiB);
      ASSERT_TRUE(t.ok()) << t.status();
      ++trims;
    } else if (op < 90 && model.count() > 0) {  // use on a second stream
      const std::uint64_t a = model.Pick(rng);
      Live& l = model.Get(a);
      StreamHandle other = streams_[rng() % streams_.size()];
      if (other == l.last_user) continue;
      // As a caller must: order the new use after the previous one.
      ASSERT_TRUE(OrderAfter(other, l.last_user).ok());
      l.last_user = other;
      ASSERT_TRUE(alloc_->RecordStream(DevicePtr(a), other).ok());
      ASSERT_TRUE(sim_->Touch(other, DevicePtr(a),
                              std::max<std::size_t>(l.requested, 1))
                      .ok());
    } else if (!full && (op < 560 || model.count() == 0)) {  // allocate
      const std::size_t bytes = RandomSize(rng);
      StreamHandle s = streams_[rng() % streams_.size()];
      absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
      ASSERT_TRUE(p.ok()) << p.status();
      absl::StatusOr<BlockInfo> info = alloc_->Lookup(*p);
      ASSERT_TRUE(info.ok()) << info.status();
      const std::size_t rounded = Rounded(bytes);
      ASSERT_EQ(info->requested_bytes, bytes);
      ASSERT_EQ(info->stream, s);
      ASSERT_GE(info->size, rounded);
      // Small blocks are exact; large ones keep at most 1 MiB of remainder.
      ASSERT_LE(info->size - rounded, rounded <= kMiB ? 0 : kMiB);
      std::string overlap = model.Add(*p, Live{bytes, info->size, s, s});
      ASSERT_EQ(overlap, "");
      {
        absl::Status ts = sim_->Touch(s, *p, std::max<std::size_t>(bytes, 1));
        ASSERT_TRUE(ts.ok()) << ts;
      }
    } else if (model.count() > 0) {  // free
      const std::uint64_t a = model.Pick(rng);
      model.Remove(a);
      absl::Status s = alloc_->Deallocate(DevicePtr(a));
      ASSERT_TRUE(s.ok()) << s;
    }
    if (step % 97 == 0) CheckAgainstModel(model, /*snapshot=*/false);
    if (step % 1000 == 0) CheckAgainstModel(model, /*snapshot=*/true);
    if (HasFatalFailure()) return;
  }
  release_all();
  CheckAgainstModel(model, /*snapshot=*/true);
  ASSERT_GT(trims, 0u);

  // Phase 2: threads, each owning two streams and its own model; a shared
  // map of live ranges checks cross-thread overlap.
  constexpr int kThreads = 2;
  std::mutex ranges_mu;
  Model ranges;
  for (const auto& [address, live] : model.blocks()) {
    ASSERT_EQ(ranges.Add(DevicePtr(address), live), "");
  }
  std::vector<std::string> errors(kThreads);
  std::vector<std::unique_ptr<Model>> models;
  for (int t = 0; t < kThreads; ++t)
    models.push_back(std::make_unique<Model>());
  const std::uint64_t per_thread = (ops_ - phase1) / kThreads;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 trng(seed_ * 7919 + t);
      Model& m = *models[t];
      std::string& error = errors[t];
      const StreamHandle mine[2] = {streams_[2 * t], streams_[2 * t + 1]};
      if (!sim_->CtxSetCurrent(ctx_).ok()) error = "CtxSetCurrent";
      for (std::uint64_t step = 0; step < per_thread && error.empty(); ++step) {
        clock_ms_.fetch_add(1, std::memory_order_relaxed);
        const int op = static_cast<int>(trng() % 1000);
        const bool full =
            m.count() >= kMaxLive / 2 || m.allocated() >= kMaxLiveBytes / 2;
        if (op < 1) {
          if (!alloc_->Trim(64 * kMiB).ok()) error = "Trim failed";
        } else if (op < 2) {
          if (!alloc_->TrimIdle().ok()) error = "TrimIdle failed";
        } else if (op < 60 && m.count() > 0) {
          const std::uint64_t a = m.Pick(trng);
          Live& l = m.Get(a);
          const StreamHandle other = l.last_user == mine[0] ? mine[1] : mine[0];
          const StreamHandle previous = l.last_user;
          l.last_user = other;
          if (!OrderAfter(other, previous).ok() ||
              !alloc_->RecordStream(DevicePtr(a), other).ok() ||
              !sim_->Touch(other, DevicePtr(a),
                           std::max<std::size_t>(l.requested, 1))
                   .ok()) {
            error = absl::StrFormat("RecordStream/Touch of 0x%x failed", a);
          }
        } else if (!full && (op < 540 || m.count() == 0)) {
          const std::size_t bytes = RandomSize(trng);
          const StreamHandle s = mine[trng() % 2];
          absl::StatusOr<DevicePtr> p = alloc_->Allocate(bytes, s);
          if (!p.ok()) {
            error = p.status().ToString();
            break;
          }
          absl::StatusOr<BlockInfo> info = alloc_->Lookup(*p);
          if (!info.ok() || info->size < Rounded(bytes)) {
            error = "Lookup after Allocate";
            break;
          }
          Live l{bytes, info->size, s, s};
          {
            std::lock_guard<std::mutex> lock(ranges_mu);
            error = ranges.Add(*p, l);
          }
          m.Add(*p, l);
          if (!sim_->Touch(s, *p, std::max<std::size_t>(bytes, 1)).ok()) {
            error = "Touch failed";
          }
        } else if (m.count() > 0) {
          const std::uint64_t a = m.Pick(trng);
          m.Remove(a);
          {
            std::lock_guard<std::mutex> lock(ranges_mu);
            ranges.Remove(a);
          }
          if (!alloc_->Deallocate(DevicePtr(a)).ok()) error = "Deallocate";
        }
        if (t == 0 && step % 1000 == 0) {
          absl::Status inv = alloc_->CheckInvariants();
          if (!inv.ok()) error = inv.ToString();
        }
        if (!error.empty()) {
          error = absl::StrFormat("seed %d, phase 2, thread %d, step %d: %s",
                                  seed_, t, step, error);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  // Merge the models: the allocator's stats equal the sums.
  for (const auto& m : models) {
    for (const auto& [address, live] : m->blocks()) {
      ASSERT_EQ(model.Add(DevicePtr(address), live), "");
    }
  }
  CheckAgainstModel(model, /*snapshot=*/true);

  // Free everything: Trim(0) gives all memory back.
  for (const auto& [address, live] : std::map(model.blocks())) {
    model.Remove(address);
    ASSERT_TRUE(alloc_->Deallocate(DevicePtr(address)).ok());
  }
  CheckAgainstModel(model, /*snapshot=*/true);
  absl::StatusOr<TrimResult> t = alloc_->Trim(0);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->remaining_bytes, 0u);
  EXPECT_EQ(sim_->used_bytes(0), sim_->context_bytes(0));
  EXPECT_TRUE(alloc_->CheckInvariants().ok());
  DeviceAllocatorStats st = alloc_->Stats();
  EXPECT_EQ(st.total.reserved_bytes[0].current, 0);
  EXPECT_EQ(st.num_ooms, 0);
  EXPECT_EQ(st.invalid_frees, 0);
  std::printf(
      "%s: cache hits %lld, upstream allocs %lld, stream waits %lld, host "
      "syncs %lld, retries %lld, trims %lld, granule maps %lld, peak "
      "reserved / peak allocated %.3f\n",
      GetParam() == BackingMode::kClassic ? "classic" : "expandable",
      static_cast<long long>(st.cache_hits),
      static_cast<long long>(st.upstream_allocs),
      static_cast<long long>(st.num_stream_waits),
      static_cast<long long>(st.num_host_syncs),
      static_cast<long long>(st.num_alloc_retries),
      static_cast<long long>(st.num_trims),
      static_cast<long long>(st.granule_maps),
      static_cast<double>(st.total.reserved_bytes[0].peak) /
          static_cast<double>(st.total.allocated_bytes[0].peak));
  EXPECT_EQ(sim_->race_count(), 0u);
  for (const SimRace& race : sim_->Races()) ADD_FAILURE() << race.description;
  EXPECT_EQ(sim_->misuse_count(), 0u);
  for (const std::string& m : sim_->misuse_log()) ADD_FAILURE() << m;
}

INSTANTIATE_TEST_SUITE_P(Backings, DifferentialTest,
                         ::testing::Values(BackingMode::kClassic,
                                           BackingMode::kExpandable),
                         [](const auto& info) {
                           return info.param == BackingMode::kClassic
                                      ? std::string("Classic")
                                      : std::string("Expandable");
                         });

}  // namespace
}  // namespace ctxpool
