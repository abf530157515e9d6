// A seeded randomized differential test of CachingHostAllocator against a
// simple model: live buffers never overlap, a buffer freed while a stream
// that used it had pending work is not handed out again before that work
// completes, and the statistics equal the model's sums.
//
// CTXPOOL_DIFF_OPS overrides the number of operations (default 100000);
// CTXPOOL_DIFF_SEED the seed.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "alloc_test_support.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using testing_internal::StreamModel;
using testing_internal::Waits;

struct LiveBuffer {
  std::size_t requested = 0;
  std::size_t size = 0;
  int stream = 0;
  std::vector<int> recorded;  // other streams
  std::uint64_t tag = 0;
};

TEST(HostAllocatorDifferential, RandomOperationsMatchTheModel) {
  testing_internal::DifferentialSetup setup(/*default_ops=*/100000,
                                            /*default_seed=*/20240607);
  SCOPED_TRACE(setup.Trace());
  const std::uint64_t ops = setup.ops;
  std::mt19937_64& rng = setup.rng;
  SimDriver* sim = setup.sim.get();
  const ContextHandle ctx = setup.ctx;
  constexpr int kStreams = 4;
  StreamModel model(*sim, kStreams);
  std::vector<DevicePtr> copy_target;  // per stream: no cross-stream races
  for (int i = 0; i < kStreams; ++i) {
    copy_target.push_back(*sim->MemAlloc(4096));
  }

  HostAllocatorOptions options;
  options.context = ctx;
  options.host_budget_bytes = 256 * kMiB;
  auto alloc = *CachingHostAllocator::Create(*sim, options);

  // A small set of sizes so that buffers are reused (cache hits).
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 48; ++i) {
    const double l = std::uniform_real_distribution<double>(0, 20)(rng);
    sizes.push_back(static_cast<std::size_t>(std::exp2(l)) - 1);
  }

  std::map<std::uintptr_t, LiveBuffer> live;
  absl::flat_hash_map<std::uintptr_t, Waits> freed;  // not yet reused
  std::size_t model_bytes = 0, model_requested = 0;
  std::uint64_t next_tag = 1;
  std::uint64_t hits = 0, budget_failures = 0, reuses_checked = 0;

  auto use = [&](int s) {
    if (model.held(s)) {
      ASSERT_TRUE(sim->Touch(model.stream(s), copy_target[s], 64).ok());
      model.MarkUsed(s);
    }
  };

  for (std::uint64_t op = 0; op < ops; ++op) {
    const int r = static_cast<int>(rng() % 1000);
    if (r < 450 || live.empty()) {  // Allocate
      const std::size_t bytes = sizes[rng() % sizes.size()];
      const int s = static_cast<int>(rng() % kStreams);
      absl::StatusOr<void*> p = alloc->Allocate(bytes, model.stream(s));
      if (!p.ok()) {
        ASSERT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted)
            << p.status();
        ++budget_failures;
        continue;
      }
      const auto a = reinterpret_cast<std::uintptr_t>(*p);
      const std::size_t size = alloc->RoundedSize(bytes);
      // No overlap with any live buffer.
      auto next = live.lower_bound(a);
      if (next != live.end()) {
        ASSERT_GE(next->first, a + size);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.size, a);
      }
      // Reuse only after the streams that used it finished that work.
      if (auto f = freed.find(a); f != freed.end()) {
        ASSERT_TRUE(model.ReuseIsSafe(f->second)) << "buffer, op " << op;
        ++reuses_checked;
        freed.erase(f);
      }
      LiveBuffer b{bytes, size, s, {}, next_tag++};
      if (bytes >= 8) std::memcpy(*p, &b.tag, 8);
      live.emplace(a, b);
      model_bytes += size;
      model_requested += bytes;
      use(s);
    } else if (r < 880) {  // Deallocate
      auto it = live.begin();
      std::advance(it, rng() % std::min<std::size_t>(live.size(), 16));
      if (it->second.requested >= 8) {
        std::uint64_t tag;
        std::memcpy(&tag, reinterpret_cast<void*>(it->first), 8);
        ASSERT_EQ(tag, it->second.tag) << "buffer overwritten";
      }
      std::vector<int> used = it->second.recorded;
      used.push_back(it->second.stream);
      Waits waits = model.BusyAmong(used);
      ASSERT_TRUE(alloc->Deallocate(reinterpret_cast<void*>(it->first)).ok());
      freed[it->first] = std::move(waits);
      model_bytes -= it->second.size;
      model_requested -= it->second.requested;
      live.erase(it);
    } else if (r < 940) {  // RecordStream
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      const int o = static_cast<int>(rng() % kStreams);
      ASSERT_TRUE(alloc
                      ->RecordStream(reinterpret_cast<void*>(it->first),
                                     model.stream(o))
                      .ok());
      if (o != it->second.stream) it->second.recorded.push_back(o);
      use(o);
    } else if (r < 975) {  // Hold or release a stream
      model.ToggleHold(static_cast<int>(rng() % kStreams));
    } else if (r < 985) {  // Bad free: a freed buffer or an interior pointer
      void* bad = nullptr;
      if (!freed.empty() && (rng() & 1)) {
        bad = reinterpret_cast<void*>(freed.begin()->first);
      } else {
        bad = reinterpret_cast<void*>(live.begin()->first + 8);
      }
      ASSERT_EQ(alloc->Deallocate(bad).code(),
                absl::StatusCode::kInvalidArgument);
    } else if (r < 987) {  // Trim
      absl::StatusOr<TrimResult> t = alloc->Trim(rng() % (64 * kMiB));
      ASSERT_TRUE(t.ok()) << t.status();
    } else {
      // Let a cache hit be counted for the model (nothing else to do).
    }
    if (op % 1000 == 999 || op + 1 == ops) {
      ASSERT_TRUE(alloc->CheckInvariants().ok())
          << alloc->CheckInvariants() << " at op " << op;
      HostAllocatorStats st = alloc->Stats();
      ASSERT_EQ(st.live_count, live.size());
      ASSERT_EQ(st.live_bytes, model_bytes);
      ASSERT_EQ(st.requested_bytes, model_requested);
      ASSERT_LE(st.pinned_bytes + st.registered_bytes,
                options.host_budget_bytes);
      hits = static_cast<std::uint64_t>(st.cache_hits);
    }
  }
  model.ReleaseAll();
  for (const auto& [a, b] : live) {
    ASSERT_TRUE(alloc->Deallocate(reinterpret_cast<void*>(a)).ok());
  }
  ASSERT_TRUE(alloc->Trim(0).ok());
  HostAllocatorStats st = alloc->Stats();
  EXPECT_EQ(st.pinned_bytes, 0u);
  EXPECT_EQ(st.live_count, 0u);
  EXPECT_GT(hits, ops / 10) << "the cache was hardly used";
  EXPECT_GT(reuses_checked, 0u);
  EXPECT_GT(st.events_recorded, 0);
  alloc.reset();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(sim->MemFree(copy_target[i]).ok());
  }
  EXPECT_EQ(sim->race_count(), 0u);
  EXPECT_EQ(sim->misuse_count(), 0u);
  for (const std::string& m : sim->misuse_log()) ADD_FAILURE() << m;
  RecordProperty("budget_failures", static_cast<int>(budget_failures));
}

}  // namespace
}  // namespace ctxpool
