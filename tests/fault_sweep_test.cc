// The fault sweep: every driver call kind an allocator makes, failing with
// out-of-memory, a transient error or a sticky one, once or persistently,
// injected at every step of a short mixed workload — on the device allocator
// in both backings, the pinned-host allocator, the slab allocator and model
// sessions. After each run:
//   * the allocator's CheckInvariants holds and the simulated GPU saw no race
//     and no misuse;
//   * the books balance: every byte the driver holds for the allocator is on
//     its books (reserved, cached) or counted in leaked_bytes — never silent;
//   * with the fault cleared, Reset(force) and destruction give every byte,
//     pinned page and context reference back to the driver;
//   * with a persistent fault in a free path kept through Reset(force), what
//     could not be freed is exactly what the allocator reports as leaked.
//
// A sticky error (CUDA_ERROR_ILLEGAL_ADDRESS) fails every call kind from the
// step on, as a real context does after one. Under the sanitizers the sweep
// runs every third step (CTXPOOL_SANITIZER).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/alloc/host_allocator.h"
#include "ctxpool/alloc/slab_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/status.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;

// One subject of the sweep: an allocator (or a session) on its own simulated
// GPU, and a workload of steps that tolerate any error.
class Subject {
 public:
  explicit Subject(std::size_t capacity) {
    SimDeviceSpec spec;
    spec.capacity_bytes = capacity;
    spec.context_overhead_bytes = 0;
    sim_ = SimDriver::Create({.devices = {spec}});
  }
  virtual ~Subject() = default;

  SimDriver& sim() { return *sim_; }
  const std::vector<std::function<void()>>& steps() const { return steps_; }

  // The allocator's own checks plus the balance of the books against the
  // simulated driver.
  virtual absl::Status Check() = 0;
  // Reset(force) of everything the subject holds.
  virtual absl::Status ResetForce() = 0;
  // What the allocator reports as leaked (device bytes).
  virtual std::size_t Leaked() = 0;
  // Destroys the allocator(s); the SimDriver stays.
  virtual void Destroy() = 0;

 protected:
  // Two streams on the device's primary context, which the allocator
  // created first holds (this reference is released again).
  void CreateStreams() {
    ContextHandle ctx = *sim_->PrimaryCtxRetain(0);
    sim_->CtxSetCurrent(ctx).IgnoreError();
    s1_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    s2_ = *sim_->StreamCreate(kStreamNonBlocking, 0);
    sim_->PrimaryCtxRelease(0).IgnoreError();
  }
  // A step that keeps `p` live when Allocate succeeded (and touches it on
  // `s`, as a kernel would), and one that frees it if it is live.
  template <typename Alloc>
  void AllocStep(DevicePtr* p, std::size_t bytes, StreamHandle s, Alloc alloc) {
    steps_.push_back([this, p, bytes, s, alloc] {
      if (!p->is_null()) return;
      absl::StatusOr<DevicePtr> got = alloc(bytes, s);
      if (!got.ok()) return;
      *p = *got;
      sim_->Touch(s, *p, bytes).IgnoreError();
    });
  }
  template <typename Free>
  void FreeStep(DevicePtr* p, Free free) {
    steps_.push_back([p, free] {
      if (p->is_null()) return;
      if (free(*p).ok()) *p = DevicePtr();
    });
  }

  std::unique_ptr<SimDriver> sim_;
  std::vector<std::function<void()>> steps_;
  StreamHandle s1_, s2_;
};

// The device allocator's books against the driver: physical bytes held ==
// reserved (mapped) + granule cache + leaked.
absl::Status CheckDeviceBooks(const CachingDeviceAllocator& a, SimDriver& sim,
                              std::size_t extra = 0) {
  CTXPOOL_RETURN_IF_ERROR(a.CheckInvariants());
  const DeviceAllocatorStats st = a.Stats();
  const std::size_t books =
      static_cast<std::size_t>(st.total.reserved_bytes[0].current) +
      st.granule_cache_bytes + st.leaked_bytes + extra;
  if (sim.used_bytes(0) != books) {
    return absl::InternalError(absl::StrFormat(
        "driver holds %d bytes, the books say %d (reserved %d, cache %d, "
        "leaked %d)",
        sim.used_bytes(0), books, st.total.reserved_bytes[0].current,
        st.granule_cache_bytes, st.leaked_bytes));
  }
  return absl::OkStatus();
}

class DeviceSubject : public Subject {
 public:
  // unit_divisor: DeviceAllocatorOptions::vmm_unit_divisor (on this 256 MiB
  // device the default 1024 makes every unit a single granule; 2 makes
  // units of many granules that shrink as the device fills).
  explicit DeviceSubject(BackingMode backing, std::size_t unit_divisor = 1024)
      : Subject(256 * kMiB) {
    DeviceAllocatorOptions o;
    o.backing = backing;
    o.vmm_unit_divisor = unit_divisor;
    alloc_ = *CachingDeviceAllocator::Create(*sim_, 0, o);
    CreateStreams();
    auto alloc = [this](std::size_t n, StreamHandle s) {
      return alloc_->Allocate(n, s);
    };
    auto free = [this](DevicePtr p) { return alloc_->Deallocate(p); };
    AllocStep(&p_[0], 4 * kKiB, s1_, alloc);
    AllocStep(&p_[1], 3 * kMiB, s1_, alloc);
    AllocStep(&p_[2], 24 * kMiB, s2_, alloc);
    steps_.push_back([this] {
      if (!p_[1].is_null()) alloc_->RecordStream(p_[1], s2_).IgnoreError();
    });
    FreeStep(&p_[0], free);
    FreeStep(&p_[1], free);  // used by s2: an event, a pending free
    AllocStep(&p_[3], 3 * kMiB, s2_, alloc);
    steps_.push_back([this] { alloc_->Trim(0).IgnoreError(); });
    FreeStep(&p_[2], free);
    AllocStep(&p_[4], 40 * kMiB, s1_, alloc);
    AllocStep(&p_[5], 200 * kMiB, s2_, alloc);  // pressure: reclaim or OOM
    steps_.push_back([this] { alloc_->TrimIdle().IgnoreError(); });
    FreeStep(&p_[3], free);
    FreeStep(&p_[4], free);
    FreeStep(&p_[5], free);
    steps_.push_back([this] { alloc_->Reset(false).IgnoreError(); });
  }
  absl::Status Check() override { return CheckDeviceBooks(*alloc_, *sim_); }
  absl::Status ResetForce() override { return alloc_->Reset(true); }
  std::size_t Leaked() override { return alloc_->Stats().leaked_bytes; }
  void Destroy() override { alloc_.reset(); }

 private:
  std::unique_ptr<CachingDeviceAllocator> alloc_;
  DevicePtr p_[6];
};

class HostSubject : public Subject {
 public:
  HostSubject() : Subject(64 * kMiB), registered_(256 * kKiB) {
    alloc_ = *CachingHostAllocator::Create(*sim_, {});
    CreateStreams();
    auto alloc = [this](std::size_t n, StreamHandle s) {
      return alloc_->Allocate(n, s);
    };
    auto free = [this](void* p) { return alloc_->Deallocate(p); };
    HostAlloc(&p_[0], 4 * kKiB, s1_, alloc);
    HostAlloc(&p_[1], 1 * kMiB, s1_, alloc);
    steps_.push_back([this] {
      if (p_[1] != nullptr) alloc_->RecordStream(p_[1], s2_).IgnoreError();
    });
    steps_.push_back([this] {
      if (alloc_->Register(registered_.data(), registered_.size()).ok()) {
        is_registered_ = true;
      }
    });
    HostFree(&p_[0], free);
    HostFree(&p_[1], free);
    HostAlloc(&p_[2], 8 * kMiB, s2_, alloc);
    HostAlloc(&p_[3], 1 * kMiB, s2_, alloc);
    steps_.push_back([this] { alloc_->Trim(0).IgnoreError(); });
    steps_.push_back([this] {
      if (is_registered_ && alloc_->Unregister(registered_.data()).ok()) {
        is_registered_ = false;
      }
    });
    HostFree(&p_[2], free);
    HostFree(&p_[3], free);
    steps_.push_back([this] { alloc_->Reset(false).IgnoreError(); });
  }
  absl::Status Check() override {
    CTXPOOL_RETURN_IF_ERROR(alloc_->CheckInvariants());
    const HostAllocatorStats st = alloc_->Stats();
    // A pinned buffer whose free fails stays cached: nothing leaves the
    // books while the allocator lives.
    const std::size_t books = st.pinned_bytes + st.registered_bytes;
    if (sim_->host_bytes() != books) {
      return absl::InternalError(absl::StrFormat(
          "driver holds %d pinned bytes, the books say %d (pinned %d, "
          "registered %d)",
          sim_->host_bytes(), books, st.pinned_bytes, st.registered_bytes));
    }
    return absl::OkStatus();
  }
  absl::Status ResetForce() override { return alloc_->Reset(true); }
  std::size_t Leaked() override { return 0; }
  void Destroy() override { alloc_.reset(); }

 private:
  template <typename Alloc>
  void HostAlloc(void** p, std::size_t bytes, StreamHandle s, Alloc alloc) {
    steps_.push_back([p, bytes, s, alloc] {
      if (*p != nullptr) return;
      absl::StatusOr<void*> got = alloc(bytes, s);
      if (got.ok()) *p = *got;
    });
  }
  template <typename Free>
  void HostFree(void** p, Free free) {
    steps_.push_back([p, free] {
      if (*p != nullptr && free(*p).ok()) *p = nullptr;
    });
  }
  std::unique_ptr<CachingHostAllocator> alloc_;
  std::vector<char> registered_;
  bool is_registered_ = false;
  void* p_[4] = {};
};

class SlabSubject : public Subject {
 public:
  SlabSubject() : Subject(64 * kMiB) {
    device_ = *CachingDeviceAllocator::Create(*sim_, 0, {});
    slab_ = *SlabAllocator::Create(*device_, {});
    CreateStreams();
    auto alloc = [this](std::size_t n, StreamHandle s) {
      return slab_->Allocate(n, s);
    };
    auto free = [this](DevicePtr p) { return slab_->Deallocate(p); };
    AllocStep(&p_[0], 64, s1_, alloc);
    AllocStep(&p_[1], 4 * kKiB, s1_, alloc);
    AllocStep(&p_[2], 64 * kKiB, s2_, alloc);
    steps_.push_back([this] {
      if (!p_[1].is_null()) slab_->RecordStream(p_[1], s2_).IgnoreError();
    });
    FreeStep(&p_[0], free);
    FreeStep(&p_[1], free);
    AllocStep(&p_[3], 4 * kKiB, s2_, alloc);
    steps_.push_back([this] { slab_->Trim().IgnoreError(); });
    FreeStep(&p_[2], free);
    FreeStep(&p_[3], free);
    steps_.push_back([this] { slab_->Reset(false).IgnoreError(); });
  }
  absl::Status Check() override {
    CTXPOOL_RETURN_IF_ERROR(slab_->CheckInvariants());
    return CheckDeviceBooks(*device_, *sim_);
  }
  absl::Status ResetForce() override {
    absl::Status s = slab_->Reset(true);
    s.Update(device_->Reset(true));
    return s;
  }
  std::size_t Leaked() override { return device_->Stats().leaked_bytes; }
  void Destroy() override {
    slab_.reset();
    device_.reset();
  }

 private:
  std::unique_ptr<CachingDeviceAllocator> device_;
  std::unique_ptr<SlabAllocator> slab_;
  DevicePtr p_[4];
};

class SessionSubject : public Subject {
 public:
  SessionSubject() : Subject(256 * kMiB) {
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    o.allocator.backing = BackingMode::kExpandable;
    ctx_ = *DeviceContext::Create(*sim_, 0, o);
    Open();
    steps_.push_back([this] {
      if (a_ == nullptr) return;
      absl::StatusOr<DevicePtr> p = a_->Allocate(8 * kMiB, a_->stream(0));
      if (p.ok()) pa_ = *p;
    });
    steps_.push_back([this] {
      if (b_ == nullptr) return;
      absl::StatusOr<DevicePtr> p = b_->Allocate(32 * kMiB, b_->stream(0));
      if (p.ok()) pb_ = *p;
    });
    steps_.push_back([this] {
      if (a_ != nullptr && !pa_.is_null() && a_->Deallocate(pa_).ok()) {
        pa_ = DevicePtr();
      }
    });
    steps_.push_back([this] {
      if (b_ != nullptr) ctx_->device_allocator().Trim(0).IgnoreError();
    });
    steps_.push_back([this] {  // unload a with nothing live, reload it
      if (a_ == nullptr) return;
      if (a_->Close().ok()) a_.reset();
      Open();
    });
    steps_.push_back([this] {  // unload b with a live block: a leak report
      if (b_ == nullptr) return;
      b_->Close().IgnoreError();
      b_.reset();
      pb_ = DevicePtr();
    });
    steps_.push_back([this] {
      if (a_ == nullptr) return;
      absl::StatusOr<DevicePtr> p = a_->Allocate(64 * kMiB, a_->stream(0));
      if (p.ok()) a_->Deallocate(*p).IgnoreError();
    });
  }
  absl::Status Check() override {
    return CheckDeviceBooks(ctx_->device_allocator(), *sim_);
  }
  absl::Status ResetForce() override {
    if (a_ != nullptr) a_->Close().IgnoreError();
    if (b_ != nullptr) b_->Close().IgnoreError();
    a_.reset();
    b_.reset();
    return ctx_->device_allocator().Reset(true);
  }
  std::size_t Leaked() override {
    return ctx_->device_allocator().Stats().leaked_bytes;
  }
  void Destroy() override {
    a_.reset();
    b_.reset();
    ctx_.reset();
  }

 private:
  void Open() {
    if (a_ == nullptr) {
      auto a = ctx_->OpenSession("a", {.streams = 1, .max_bytes = 96 * kMiB});
      if (a.ok()) a_ = std::move(*a);
    }
    if (b_ == nullptr) {
      auto b = ctx_->OpenSession("b", {.streams = 1, .min_bytes = 32 * kMiB});
      if (b.ok()) b_ = std::move(*b);
    }
  }
  std::unique_ptr<DeviceContext> ctx_;
  std::unique_ptr<ModelSession> a_, b_;
  DevicePtr pa_, pb_;
};

enum class Kind {
  kDeviceClassic,
  kDeviceExpandable,
  kDeviceUnits,  // expandable, units of many granules (vmm_unit_divisor 2)
  kHost,
  kSlab,
  kSession
};

std::string KindName(const ::testing::TestParamInfo<Kind>& info) {
  switch (info.param) {
    case Kind::kDeviceClassic:
      return "DeviceClassic";
    case Kind::kDeviceExpandable:
      return "DeviceExpandable";
    case Kind::kDeviceUnits:
      return "DeviceUnits";
    case Kind::kHost:
      return "Host";
    case Kind::kSlab:
      return "Slab";
    case Kind::kSession:
      return "Session";
  }
  return "?";
}

std::unique_ptr<Subject> Make(Kind kind) {
  switch (kind) {
    case Kind::kDeviceClassic:
      return std::make_unique<DeviceSubject>(BackingMode::kClassic);
    case Kind::kDeviceExpandable:
      return std::make_unique<DeviceSubject>(BackingMode::kExpandable);
    case Kind::kDeviceUnits:
      return std::make_unique<DeviceSubject>(BackingMode::kExpandable,
                                             /*unit_divisor=*/2);
    case Kind::kHost:
      return std::make_unique<HostSubject>();
    case Kind::kSlab:
      return std::make_unique<SlabSubject>();
    case Kind::kSession:
      return std::make_unique<SessionSubject>();
  }
  return nullptr;
}

// Calls that give memory back: a persistent fault there may leak, and must
// say so.
bool IsFreePath(SimCall c) {
  return c == SimCall::kMemFree || c == SimCall::kMemUnmap ||
         c == SimCall::kMemRelease || c == SimCall::kMemAddressFree ||
         c == SimCall::kMemFreeHost || c == SimCall::kMemHostUnregister;
}

struct Fault {
  std::vector<SimCall> calls;  // all kinds for a sticky error
  int error = 0;
  int count = 0;  // 1: once; large: persistent
  std::string name;
};

class FaultSweepTest : public ::testing::TestWithParam<Kind> {
 protected:
  // The call kinds the workload makes, from a clean run.
  std::vector<SimCall> CallsMade() {
    std::unique_ptr<Subject> s = Make(GetParam());
    const auto before = s->sim().call_counts();
    for (const auto& step : s->steps()) step();
    EXPECT_TRUE(s->Check().ok()) << s->Check();
    EXPECT_TRUE(s->ResetForce().ok());
    s->Destroy();
    const auto after = s->sim().call_counts();
    std::vector<SimCall> made;
    for (int c = 0; c < kSimCallCount; ++c) {
      if (after[c] > before[c]) made.push_back(static_cast<SimCall>(c));
    }
    return made;
  }

  // One run: the steps before `at`, the fault, the rest; then the checks.
  void RunOne(const Fault& f, std::size_t at, bool keep_through_reset) {
    std::unique_ptr<Subject> s = Make(GetParam());
    SimDriver& sim = s->sim();
    const std::string where =
        absl::StrCat(f.name, " from step ", at,
                     keep_through_reset ? ", kept through Reset(force)" : "");
    const auto& steps = s->steps();
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (i == at) {
        for (SimCall c : f.calls) sim.InjectFault(c, f.count, f.error);
      }
      steps[i]();
    }
    absl::Status check = s->Check();
    EXPECT_TRUE(check.ok()) << where << ": " << check;
    if (!keep_through_reset) {
      for (SimCall c : f.calls) sim.InjectFault(c, 0, 0);
    }
    s->ResetForce().IgnoreError();
    check = s->Check();
    EXPECT_TRUE(check.ok()) << where << ", after Reset(force): " << check;
    const std::size_t leaked = s->Leaked();
    for (SimCall c : f.calls) sim.InjectFault(c, 0, 0);
    s->Destroy();
    EXPECT_EQ(sim.race_count(), 0u) << where;
    for (const SimRace& race : sim.Races()) {
      ADD_FAILURE() << where << ": " << race.description;
    }
    EXPECT_EQ(sim.misuse_count(), 0u) << where;
    for (const std::string& m : sim.misuse_log()) {
      ADD_FAILURE() << where << ": " << m;
    }
    EXPECT_EQ(sim.primary_ctx_refcount(0), 0) << where;
    if (keep_through_reset) {
      // Check() above balanced the driver against the books (cached +
      // leaked); with the fault cleared the destructor frees the cache, so
      // at most what was counted as leaked remains (the context's end may
      // return part of it, as a real driver does).
      EXPECT_LE(sim.used_bytes(0) + sim.host_bytes(), leaked) << where;
    } else {
      EXPECT_EQ(sim.used_bytes(0), 0u) << where;
      EXPECT_EQ(sim.host_bytes(), 0u) << where;
      EXPECT_EQ(leaked, 0u) << where;
    }
    ++runs_;
  }

  int runs_ = 0;
};

TEST_P(FaultSweepTest, EveryCallKindEveryStep) {
  const std::vector<SimCall> calls = CallsMade();
  ASSERT_FALSE(calls.empty());
  const std::size_t steps = Make(GetParam())->steps().size();
  const bool sanitized = std::getenv("CTXPOOL_SANITIZER") != nullptr;
  const std::size_t stride = sanitized ? 3 : 1;
  std::vector<Fault> faults;
  std::vector<SimCall> all;
  for (int c = 0; c < kSimCallCount; ++c)
    all.push_back(static_cast<SimCall>(c));
  faults.push_back({all, cu::kErrorIllegalAddress, 1 << 30, "sticky error"});
  for (SimCall c : calls) {
    const std::string name(SimCallName(c));
    for (int error : {cu::kErrorOutOfMemory, cu::kErrorOperatingSystem}) {
      const std::string e =
          error == cu::kErrorOutOfMemory ? "out of memory" : "transient error";
      faults.push_back({{c}, error, 1, absl::StrCat(name, " ", e, " once")});
      if (!sanitized || error == cu::kErrorOutOfMemory) {
        faults.push_back(
            {{c}, error, 1 << 30, absl::StrCat(name, " ", e, " persistent")});
      }
    }
  }
  for (const Fault& f : faults) {
    for (std::size_t at = 0; at < steps; at += stride) {
      RunOne(f, at, /*keep_through_reset=*/false);
      if (f.count > 1 && f.calls.size() == 1 && IsFreePath(f.calls[0])) {
        RunOne(f, at, /*keep_through_reset=*/true);
      }
      if (HasFailure()) return;  // one failure explains the rest
    }
  }
  std::printf("%d runs over %zu call kinds and %zu steps\n", runs_,
              calls.size(), steps);
}

INSTANTIATE_TEST_SUITE_P(Allocators, FaultSweepTest,
                         ::testing::Values(Kind::kDeviceClassic,
                                           Kind::kDeviceExpandable,
                                           Kind::kDeviceUnits, Kind::kHost,
                                           Kind::kSlab, Kind::kSession),
                         KindName);

}  // namespace
}  // namespace ctxpool
