// A seeded randomized differential test of SlabAllocator against a simple
// model, on SimDriver with the race detector on: every object is touched on
// its stream (and on streams it is recorded on), live objects never overlap,
// an object freed while another stream still used it is not handed out
// before that work completes, and the statistics equal the model's sums.
//
// CTXPOOL_DIFF_OPS overrides the number of operations (default 200000);
// CTXPOOL_DIFF_SEED the seed.
#include <array>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"
#include "alloc_test_support.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using testing_internal::StreamModel;
using testing_internal::Waits;

struct LiveObject {
  std::size_t bytes = 0;
  int cls = 0;
  int stream = 0;
  std::vector<int> recorded;
};

TEST(SlabAllocatorDifferential, RandomOperationsMatchTheModel) {
  testing_internal::DifferentialSetup setup(/*default_ops=*/200000,
                                            /*default_seed=*/777);
  SCOPED_TRACE(setup.Trace());
  const std::uint64_t ops = setup.ops;
  std::mt19937_64& rng = setup.rng;
  SimDriver* sim = setup.sim.get();
  const ContextHandle ctx = setup.ctx;
  constexpr int kStreams = 3;
  StreamModel model(*sim, kStreams);

  DeviceAllocatorOptions dopt;
  dopt.context = ctx;
  auto device = *CachingDeviceAllocator::Create(*sim, 0, dopt);
  absl::Time now = absl::UnixEpoch();
  SlabAllocatorOptions sopt;
  sopt.context = ctx;
  sopt.slab_bytes = 64 << 10;  // small slabs: more slab turnover
  sopt.decay = absl::Milliseconds(10);
  sopt.clock = [&now] { return now; };
  auto slabs = *SlabAllocator::Create(*device, sopt);

  std::map<std::uint64_t, LiveObject> live;
  absl::flat_hash_map<std::uint64_t, Waits> freed;
  std::array<std::size_t, kNumSlabClasses> model_live{};
  std::uint64_t reuses_checked = 0;

  auto touch = [&](int s, DevicePtr p, std::size_t bytes) {
    ASSERT_TRUE(sim->Touch(model.stream(s), p, bytes == 0 ? 1 : bytes).ok())
        << "object " << p.address();
    model.MarkUsed(s);
  };

  for (std::uint64_t op = 0; op < ops; ++op) {
    now += absl::Microseconds(rng() % 50);
    const int r = static_cast<int>(rng() % 1000);
    if (r < 470 || live.empty()) {  // Allocate: mostly small objects
      const int shift =
          static_cast<int>(rng() % 100 < 85 ? rng() % 8 : rng() % 17);
      const std::size_t bytes = rng() % ((std::size_t{1} << shift) + 1);
      const int s = static_cast<int>(rng() % kStreams);
      absl::StatusOr<DevicePtr> p = slabs->Allocate(bytes, model.stream(s));
      ASSERT_TRUE(p.ok()) << p.status();
      const int cls = SlabClassIndex(bytes);
      const std::uint64_t a = p->address();
      const std::size_t size = SlabClassBytes(cls);
      ASSERT_EQ(a % std::min<std::size_t>(size, 512), 0u) << "misaligned";
      auto next = live.lower_bound(a);
      if (next != live.end()) {
        ASSERT_GE(next->first, a + size);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + SlabClassBytes(prev->second.cls), a);
      }
      if (auto f = freed.find(a); f != freed.end()) {
        ASSERT_TRUE(model.ReuseIsSafe(f->second)) << "object, op " << op;
        ++reuses_checked;
        freed.erase(f);
      }
      live[a] = LiveObject{bytes, cls, s, {}};
      ++model_live[cls];
      touch(s, *p, bytes);
    } else if (r < 900) {  // Deallocate
      auto it = live.begin();
      std::advance(it, rng() % std::min<std::size_t>(live.size(), 32));
      Waits waits = model.BusyAmong(it->second.recorded);
      ASSERT_TRUE(slabs->Deallocate(DevicePtr(it->first)).ok());
      freed[it->first] = std::move(waits);
      --model_live[it->second.cls];
      live.erase(it);
    } else if (r < 940) {  // RecordStream + work on that stream
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      const int o = static_cast<int>(rng() % kStreams);
      ASSERT_TRUE(
          slabs->RecordStream(DevicePtr(it->first), model.stream(o)).ok());
      if (o != it->second.stream) {
        it->second.recorded.push_back(o);
        // The other stream's work on the object follows the work of the
        // owner and earlier users (as a consumer kernel's would, through
        // events); the owner's later reuse of the slot is the allocator's
        // job.
        std::vector<int> before = it->second.recorded;
        before.back() = it->second.stream;  // owner + earlier users
        for (int b : before) {
          if (b == o) continue;
          EventHandle e = *sim->EventCreate(kEventDisableTiming);
          ASSERT_TRUE(sim->EventRecord(e, model.stream(b)).ok());
          ASSERT_TRUE(sim->StreamWaitEvent(model.stream(o), e).ok());
          ASSERT_TRUE(sim->EventDestroy(e).ok());
        }
        touch(o, DevicePtr(it->first), it->second.bytes);
      }
    } else if (r < 975) {  // Hold or release a stream
      model.ToggleHold(static_cast<int>(rng() % kStreams));
    } else if (r < 990) {  // Bad frees
      const auto& [a, obj] = *live.begin();
      DevicePtr bad = rng() % 2 == 0 && SlabClassBytes(obj.cls) > 8
                          ? DevicePtr(a + 4)  // inside an object
                          : DevicePtr(a ^ (std::uint64_t{1} << 45));  // foreign
      ASSERT_EQ(slabs->Deallocate(bad).code(),
                absl::StatusCode::kInvalidArgument);
      if (!freed.empty()) {
        const std::uint64_t f = freed.begin()->first;
        if (!live.contains(f)) {
          ASSERT_EQ(slabs->Deallocate(DevicePtr(f)).code(),
                    absl::StatusCode::kInvalidArgument);
        }
      }
    } else if (r < 993) {
      ASSERT_TRUE(slabs->Trim().ok());
    } else if (r < 995) {
      now += absl::Milliseconds(20);  // past the decay
    }
    if (op % 1000 == 999 || op + 1 == ops) {
      absl::Status inv = slabs->CheckInvariants();
      ASSERT_TRUE(inv.ok()) << inv << " at op " << op;
      SlabAllocatorStats st = slabs->Stats();
      ASSERT_EQ(st.live_objects, live.size());
      for (int c = 0; c < kNumSlabClasses; ++c) {
        ASSERT_EQ(st.classes[c].live_objects, model_live[c]) << "class " << c;
      }
      ASSERT_EQ(st.slab_bytes_held, st.slabs_held * sopt.slab_bytes);
    }
  }
  model.ReleaseAll();
  for (const auto& [a, obj] : live) {
    ASSERT_TRUE(slabs->Deallocate(DevicePtr(a)).ok());
  }
  ASSERT_TRUE(slabs->Trim().ok());
  SlabAllocatorStats st = slabs->Stats();
  EXPECT_EQ(st.slabs_held, 0u);
  EXPECT_GT(st.decay_returns, 0);
  EXPECT_GT(st.events_recorded, 0);
  EXPECT_GT(reuses_checked, ops / 10);
  EXPECT_EQ(device->Stats()
                .total.allocated_bytes[static_cast<int>(StatPool::kAggregate)]
                .current,
            0);
  slabs.reset();
  device.reset();
  EXPECT_EQ(sim->race_count(), 0u);
  for (const SimRace& race : sim->Races()) ADD_FAILURE() << race.description;
  EXPECT_EQ(sim->misuse_count(), 0u);
  for (const std::string& m : sim->misuse_log()) ADD_FAILURE() << m;
}

}  // namespace
}  // namespace ctxpool
