#include "ctxpool/driver/sim_driver.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "ctxpool/driver/internal/sim_race_detector.h"
#include "ctxpool/status.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

std::optional<int> Code(const absl::Status& status) {
  return DriverErrorCode(status);
}
template <typename T>
std::optional<int> Code(const absl::StatusOr<T>& s) {
  return DriverErrorCode(s.status());
}

class SimDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SimOptions options;
    options.devices.push_back(*SimDevicePreset("a10-24gb"));
    sim_ = SimDriver::Create(options);
    ctx_ = *sim_->PrimaryCtxRetain(0);
    ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
  }
  void TearDown() override {
    EXPECT_TRUE(sim_->CheckInvariants().ok()) << sim_->CheckInvariants();
  }
  StreamHandle NewStream() {
    return *sim_->StreamCreate(kStreamNonBlocking, 0);
  }
  EventHandle NewEvent() { return *sim_->EventCreate(kEventDisableTiming); }
  // Asserts the call failed with `error` and counted exactly one misuse.
  void ExpectMisuse(const absl::Status& status, int error) {
    EXPECT_EQ(Code(status), error) << status;
    EXPECT_EQ(sim_->misuse_count(), misuses_ + 1) << status;
    misuses_ = sim_->misuse_count();
  }

  std::unique_ptr<SimDriver> sim_;
  ContextHandle ctx_;
  std::uint64_t misuses_ = 0;
};

TEST_F(SimDriverTest, EventBehindHeldWorkStaysPendingUntilRelease) {
  StreamHandle s = NewStream();
  EventHandle e = NewEvent();
  DevicePtr p = *sim_->MemAlloc(4096);
  sim_->Hold(s);
  ASSERT_TRUE(sim_->Touch(s, p, 4096).ok());
  ASSERT_TRUE(sim_->EventRecord(e, s).ok());
  EXPECT_EQ(sim_->PendingOps(s), 2u);
  EXPECT_FALSE(*sim_->EventQuery(e));
  EXPECT_FALSE(*sim_->StreamQuery(s));
  EXPECT_EQ(sim_->Advance(s, 1), 1u);  // the touch
  EXPECT_FALSE(*sim_->EventQuery(e));
  EXPECT_EQ(sim_->Advance(s, 5), 1u);  // the record
  EXPECT_TRUE(*sim_->EventQuery(e));
  EXPECT_TRUE(*sim_->StreamQuery(s));
  // Still held: new work stays pending until Release.
  ASSERT_TRUE(sim_->EventRecord(e, s).ok());
  EXPECT_FALSE(*sim_->EventQuery(e));
  sim_->Release(s);
  EXPECT_TRUE(*sim_->EventQuery(e));
  EXPECT_EQ(sim_->PendingOps(s), 0u);
  ASSERT_TRUE(sim_->MemFree(p).ok());
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(SimDriverTest, NeverRecordedEventIsComplete) {
  EventHandle e = NewEvent();
  EXPECT_TRUE(*sim_->EventQuery(e));
  EXPECT_TRUE(sim_->EventSynchronize(e).ok());
}

TEST_F(SimDriverTest, WaitEventOrdersTwoStreams) {
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  EventHandle e = NewEvent();
  sim_->Hold(a);
  ASSERT_TRUE(sim_->EventRecord(e, a).ok());
  ASSERT_TRUE(sim_->StreamWaitEvent(b, e).ok());
  EventHandle after = NewEvent();
  ASSERT_TRUE(sim_->EventRecord(after, b).ok());
  // b is not held, but its work waits for a's event.
  EXPECT_FALSE(*sim_->EventQuery(after));
  EXPECT_FALSE(*sim_->StreamQuery(b));
  EXPECT_EQ(sim_->PendingOps(b), 2u);
  // Re-recording e later does not change what b waits for.
  sim_->Release(a);
  EXPECT_TRUE(*sim_->EventQuery(after));
  EXPECT_EQ(sim_->PendingOps(b), 0u);
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(SimDriverTest, AdvanceStopsAtAnIncompleteEvent) {
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  EventHandle e = NewEvent();
  sim_->Hold(a);
  sim_->Hold(b);
  ASSERT_TRUE(sim_->EventRecord(e, a).ok());
  ASSERT_TRUE(sim_->StreamWaitEvent(b, e).ok());
  EXPECT_EQ(sim_->Advance(b, 10), 0u);
  EXPECT_EQ(sim_->Advance(a, 10), 1u);
  EXPECT_EQ(sim_->Advance(b, 10), 1u);
}

TEST_F(SimDriverTest, SynchronizeOnHeldWorkFailsInsteadOfDeadlocking) {
  StreamHandle s = NewStream();
  EventHandle e = NewEvent();
  sim_->Hold(s);
  ASSERT_TRUE(sim_->EventRecord(e, s).ok());
  ExpectMisuse(sim_->StreamSynchronize(s), cu::kErrorNotReady);
  ExpectMisuse(sim_->EventSynchronize(e), cu::kErrorNotReady);
  ExpectMisuse(sim_->CtxSynchronize(), cu::kErrorNotReady);
  sim_->Release(s);
  EXPECT_TRUE(sim_->StreamSynchronize(s).ok());
  EXPECT_TRUE(sim_->EventSynchronize(e).ok());
  EXPECT_TRUE(sim_->CtxSynchronize().ok());
}

TEST_F(SimDriverTest, LegacyDefaultStreamWaitsForBlockingStreams) {
  StreamHandle blocking = *sim_->StreamCreate(kStreamDefault, 0);
  StreamHandle nonblocking = NewStream();
  sim_->Hold(blocking);
  EventHandle e = NewEvent();
  ASSERT_TRUE(sim_->EventRecord(e, blocking).ok());
  EventHandle on_null = NewEvent();
  ASSERT_TRUE(sim_->EventRecord(on_null, StreamHandle()).ok());
  EXPECT_FALSE(*sim_->EventQuery(on_null));
  EventHandle on_nonblocking = NewEvent();
  ASSERT_TRUE(sim_->EventRecord(on_nonblocking, nonblocking).ok());
  EXPECT_TRUE(*sim_->EventQuery(on_nonblocking));
  sim_->Release(blocking);
  EXPECT_TRUE(*sim_->EventQuery(on_null));
}

TEST_F(SimDriverTest, LegacyDefaultStreamOrdersAccesses) {
  DevicePtr p = *sim_->MemAlloc(1 << 20);
  StreamHandle blocking = *sim_->StreamCreate(kStreamDefault, 0);
  StreamHandle nonblocking = NewStream();
  ASSERT_TRUE(sim_->Touch(blocking, p, 4096).ok());
  ASSERT_TRUE(sim_->Touch(StreamHandle(), p, 4096).ok());
  ASSERT_TRUE(sim_->Touch(blocking, p, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 0u);
  ASSERT_TRUE(sim_->Touch(nonblocking, p, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 1u);  // non-blocking streams are not ordered
  ASSERT_TRUE(sim_->MemFree(p).ok());
}

TEST_F(SimDriverTest, DestroyingAContextFreesItsMemory) {
  const std::size_t before = sim_->used_bytes(0);
  ContextHandle other = *sim_->CtxCreate(0, 0);
  ASSERT_TRUE(sim_->MemAlloc(64 * kMiB).ok());
  StreamHandle s = NewStream();
  EXPECT_GT(sim_->used_bytes(0), before + 64 * kMiB);
  ASSERT_TRUE(sim_->CtxDestroy(other).ok());
  EXPECT_EQ(sim_->used_bytes(0), before);
  ExpectMisuse(sim_->StreamQuery(s).status(), cu::kErrorInvalidHandle);
}

TEST_F(SimDriverTest, HostFuncsRunInStreamOrder) {
  StreamHandle s = NewStream();
  struct Log {
    std::vector<int> order;
  } log;
  struct Item {
    Log* log;
    int id;
  };
  std::vector<Item> items;
  for (int i = 0; i < 5; ++i) items.push_back({&log, i});
  const HostFn fn = [](void* p) {
    auto* item = static_cast<Item*>(p);
    item->log->order.push_back(item->id);
  };
  ASSERT_TRUE(sim_->LaunchHostFunc(s, fn, &items[0]).ok());
  EXPECT_EQ(log.order, std::vector<int>({0}));  // ran at once: not held
  sim_->Hold(s);
  for (int i = 1; i < 5; ++i) {
    ASSERT_TRUE(sim_->LaunchHostFunc(s, fn, &items[i]).ok());
  }
  EXPECT_EQ(log.order.size(), 1u);
  sim_->Advance(s, 2);
  EXPECT_EQ(log.order, std::vector<int>({0, 1, 2}));
  sim_->Release(s);
  EXPECT_EQ(log.order, std::vector<int>({0, 1, 2, 3, 4}));
}

TEST_F(SimDriverTest, HostFuncMayCallTheDriver) {
  StreamHandle s = NewStream();
  struct Ctx {
    SimDriver* sim;
    ContextHandle ctx;
    bool ok = false;
  } c{sim_.get(), ctx_};
  ASSERT_TRUE(sim_->LaunchHostFunc(
                      s,
                      [](void* p) {
                        auto* c = static_cast<Ctx*>(p);
                        // A host func runs without the driver's mutex held.
                        c->ok = c->sim->DeviceCount().ok();
                      },
                      &c)
                  .ok());
  EXPECT_TRUE(c.ok);
}

TEST_F(SimDriverTest, MisuseReturnsTheDriverErrorAndIsCounted) {
  DevicePtr p = *sim_->MemAlloc(1024);
  ASSERT_TRUE(sim_->MemFree(p).ok());
  ExpectMisuse(sim_->MemFree(p), cu::kErrorInvalidValue);  // double free
  ExpectMisuse(sim_->MemFree(DevicePtr(0x1234)), cu::kErrorInvalidValue);
  DevicePtr q = *sim_->MemAlloc(1024);
  ExpectMisuse(sim_->MemFree(q + 512), cu::kErrorInvalidValue);  // interior
  ASSERT_TRUE(sim_->MemFree(q).ok());

  StreamHandle s = NewStream();
  ASSERT_TRUE(sim_->StreamDestroy(s).ok());
  ExpectMisuse(sim_->StreamQuery(s).status(), cu::kErrorInvalidHandle);
  ExpectMisuse(sim_->StreamDestroy(s), cu::kErrorInvalidHandle);
  EventHandle e = NewEvent();
  ExpectMisuse(sim_->EventRecord(e, s), cu::kErrorInvalidHandle);
  ASSERT_TRUE(sim_->EventDestroy(e).ok());
  ExpectMisuse(sim_->EventQuery(e).status(), cu::kErrorInvalidHandle);
  ExpectMisuse(sim_->EventRecord(e, StreamHandle()), cu::kErrorInvalidHandle);
  ExpectMisuse(sim_->EventDestroy(e), cu::kErrorInvalidHandle);

  ExpectMisuse(sim_->MemUnmap(DevicePtr(0x200000), 2 * kMiB),
               cu::kErrorInvalidValue);
  const std::size_t g = *sim_->MemGetAllocationGranularity(0);
  DevicePtr va = *sim_->MemAddressReserve(4 * g, 0);
  PhysicalMemHandle h = *sim_->MemCreate(g, 0);
  ASSERT_TRUE(sim_->MemMap(va, g, 0, h).ok());
  ExpectMisuse(sim_->MemAddressFree(va, 4 * g), cu::kErrorInvalidValue);
  ExpectMisuse(sim_->MemUnmap(va + g, g), cu::kErrorInvalidValue);
  ASSERT_TRUE(sim_->MemUnmap(va, g).ok());
  ExpectMisuse(sim_->MemUnmap(va, g), cu::kErrorInvalidValue);
  ASSERT_TRUE(sim_->MemRelease(h).ok());
  ExpectMisuse(sim_->MemRelease(h), cu::kErrorInvalidValue);
  ASSERT_TRUE(sim_->MemAddressFree(va, 4 * g).ok());

  int local = 0;
  ExpectMisuse(sim_->MemFreeHost(&local), cu::kErrorInvalidValue);
  ExpectMisuse(sim_->MemHostUnregister(&local),
               cu::kErrorHostMemoryNotRegistered);
  ExpectMisuse(sim_->PrimaryCtxRelease(7), cu::kErrorInvalidDevice);

  // No current context.
  ASSERT_TRUE(sim_->CtxSetCurrent(ContextHandle()).ok());
  EXPECT_TRUE(sim_->CtxGetCurrent()->is_null());
  ExpectMisuse(sim_->MemAlloc(1024).status(), cu::kErrorInvalidContext);
  ExpectMisuse(sim_->StreamCreate(0, 0).status(), cu::kErrorInvalidContext);
  ExpectMisuse(sim_->EventCreate(0).status(), cu::kErrorInvalidContext);
  ExpectMisuse(sim_->CtxPopCurrent().status(), cu::kErrorInvalidContext);
  ASSERT_TRUE(sim_->CtxSetCurrent(ctx_).ok());
  EXPECT_EQ(sim_->misuse_log().size(), sim_->misuse_count());
}

TEST_F(SimDriverTest, DestroyedContextIsRejected) {
  ContextHandle other = *sim_->CtxCreate(0, 0);
  EXPECT_EQ(*sim_->CtxGetCurrent(), other);  // cuCtxCreate makes it current
  ASSERT_TRUE(sim_->CtxDestroy(other).ok());
  EXPECT_EQ(*sim_->CtxGetCurrent(), ctx_);  // and destroy pops it
  ExpectMisuse(sim_->CtxSetCurrent(other), cu::kErrorContextIsDestroyed);
  ExpectMisuse(sim_->CtxDestroy(other), cu::kErrorContextIsDestroyed);
  ExpectMisuse(sim_->CtxDestroy(ctx_), cu::kErrorInvalidContext);  // primary
  // The primary context released while current on this thread.
  ContextHandle again = *sim_->PrimaryCtxRetain(0);
  EXPECT_EQ(again, ctx_);
  ASSERT_TRUE(sim_->PrimaryCtxRelease(0).ok());
  ASSERT_TRUE(sim_->PrimaryCtxRelease(0).ok());
  ExpectMisuse(sim_->MemAlloc(1).status(), cu::kErrorContextIsDestroyed);
  ExpectMisuse(sim_->PrimaryCtxRelease(0), cu::kErrorInvalidContext);
  // Retaining again revives the same handle.
  EXPECT_EQ(*sim_->PrimaryCtxRetain(0), ctx_);
  EXPECT_TRUE(sim_->MemGetInfo().ok());
}

TEST_F(SimDriverTest, FaultInjectionFailsTheNextCallsWithoutSideEffects) {
  const std::size_t used = sim_->used_bytes(0);
  sim_->InjectFault(SimCall::kMemAlloc, 2, cu::kErrorOutOfMemory);
  EXPECT_EQ(Code(sim_->MemAlloc(4096)), cu::kErrorOutOfMemory);
  EXPECT_EQ(Code(sim_->MemAlloc(4096)), cu::kErrorOutOfMemory);
  EXPECT_EQ(sim_->used_bytes(0), used);
  absl::StatusOr<DevicePtr> p = sim_->MemAlloc(4096);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(sim_->call_count(SimCall::kMemAlloc), 3u);
  sim_->InjectFault(SimCall::kEventRecord, 1, cu::kErrorLaunchFailed);
  EventHandle e = NewEvent();
  StreamHandle s = NewStream();
  sim_->Hold(s);
  EXPECT_EQ(Code(sim_->EventRecord(e, s)), cu::kErrorLaunchFailed);
  EXPECT_EQ(sim_->PendingOps(s), 0u);
  EXPECT_TRUE(sim_->EventRecord(e, s).ok());
  EXPECT_EQ(sim_->PendingOps(s), 1u);
  sim_->Release(s);
  ASSERT_TRUE(sim_->MemFree(*p).ok());
  EXPECT_EQ(sim_->misuse_count(), 0u);  // injected faults are not misuse
}

TEST_F(SimDriverTest, VmmMapRules) {
  const std::size_t g = *sim_->MemGetAllocationGranularity(0);
  EXPECT_EQ(g, 2 * kMiB);
  ExpectMisuse(sim_->MemCreate(g + 1, 0).status(), cu::kErrorInvalidValue);
  ExpectMisuse(sim_->MemAddressReserve(g / 2, 0).status(),
               cu::kErrorInvalidValue);
  DevicePtr va = *sim_->MemAddressReserve(8 * g, 0);
  EXPECT_EQ(va.address() % g, 0u);
  PhysicalMemHandle h = *sim_->MemCreate(2 * g, 0);
  const std::size_t used = sim_->used_bytes(0);
  ExpectMisuse(sim_->MemMap(va + 4096, g, 0, h), cu::kErrorInvalidValue);
  ExpectMisuse(sim_->MemMap(va, 3 * g, 0, h), cu::kErrorInvalidValue);
  ExpectMisuse(sim_->MemMap(va + 7 * g, 2 * g, 0, h),
               cu::kErrorInvalidValue);  // crosses the reservation's end
  ASSERT_TRUE(sim_->MemMap(va, 2 * g, 0, h).ok());
  ExpectMisuse(sim_->MemMap(va + g, g, 0, h), cu::kErrorInvalidValue);
  StreamHandle s = NewStream();
  // Mapped but no access yet: an illegal address.
  ExpectMisuse(sim_->Touch(s, va, 1024), cu::kErrorIllegalAddress);
  ASSERT_TRUE(sim_->MemSetAccess(va, 2 * g, 0).ok());
  EXPECT_TRUE(sim_->Touch(s, va, 2 * g).ok());
  ExpectMisuse(sim_->Touch(s, va + g, 2 * g), cu::kErrorIllegalAddress);
  // Release is deferred until unmapped.
  ASSERT_TRUE(sim_->MemRelease(h).ok());
  EXPECT_EQ(sim_->used_bytes(0), used);
  ASSERT_TRUE(sim_->MemUnmap(va, 2 * g).ok());
  EXPECT_EQ(sim_->used_bytes(0), used - 2 * g);
  ExpectMisuse(sim_->Touch(s, va, 1024), cu::kErrorIllegalAddress);
  ASSERT_TRUE(sim_->MemAddressFree(va, 8 * g).ok());
}

TEST_F(SimDriverTest, CapacityExhaustionIsOutOfMemoryNotMisuse) {
  const std::size_t capacity = *sim_->DeviceTotalMem(0);
  EXPECT_EQ(capacity, 24 * kGiB);
  EXPECT_EQ(Code(sim_->MemAlloc(capacity)), cu::kErrorOutOfMemory);
  EXPECT_EQ(sim_->MemAlloc(capacity).status().code(),
            absl::StatusCode::kResourceExhausted);
  std::vector<DevicePtr> blocks;
  for (;;) {
    absl::StatusOr<DevicePtr> p = sim_->MemAlloc(4 * kGiB);
    if (!p.ok()) {
      EXPECT_EQ(Code(p), cu::kErrorOutOfMemory);
      break;
    }
    blocks.push_back(*p);
  }
  EXPECT_EQ(blocks.size(), 5u);  // 24 GiB - 300 MiB context overhead
  EXPECT_EQ(Code(sim_->MemCreate(4 * kGiB, 0)), cu::kErrorOutOfMemory);
  MemInfo info = *sim_->MemGetInfo();
  EXPECT_EQ(info.total_bytes, capacity);
  EXPECT_EQ(info.free_bytes, capacity - sim_->used_bytes(0));
  for (DevicePtr p : blocks) ASSERT_TRUE(sim_->MemFree(p).ok());
  EXPECT_EQ(sim_->misuse_count(), 0u);
  EXPECT_EQ(Code(sim_->MemAlloc(0)), cu::kErrorInvalidValue);
}

TEST_F(SimDriverTest, ContextOverheadChargedPerRetainSequenceAndCtxCreate) {
  const std::size_t overhead = sim_->device_spec(0).context_overhead_bytes;
  EXPECT_EQ(sim_->primary_ctx_refcount(0), 1);
  EXPECT_EQ(sim_->context_bytes(0), overhead);
  EXPECT_EQ(*sim_->PrimaryCtxRetain(0), ctx_);
  EXPECT_EQ(sim_->primary_ctx_refcount(0), 2);
  EXPECT_EQ(sim_->context_bytes(0), overhead);  // not charged again
  EXPECT_EQ(sim_->contexts_created(0), 1);
  ContextHandle c = *sim_->CtxCreate(0, 0);
  EXPECT_EQ(sim_->context_bytes(0), 2 * overhead);
  EXPECT_EQ(sim_->contexts_created(0), 2);
  ASSERT_TRUE(sim_->CtxDestroy(c).ok());
  EXPECT_EQ(sim_->context_bytes(0), overhead);
  ASSERT_TRUE(sim_->PrimaryCtxRelease(0).ok());
  ASSERT_TRUE(sim_->PrimaryCtxRelease(0).ok());
  EXPECT_EQ(sim_->context_bytes(0), 0u);
  EXPECT_EQ(sim_->used_bytes(0), 0u);
  EXPECT_FALSE(sim_->PrimaryCtxGetState(0)->active);
  EXPECT_EQ(*sim_->PrimaryCtxRetain(0), ctx_);
  EXPECT_EQ(sim_->contexts_created(0), 3);
  EXPECT_EQ(sim_->peak_used_bytes(0), 2 * overhead);
}

TEST_F(SimDriverTest, RaceDetectorFlagsUnorderedTouches) {
  DevicePtr p = *sim_->MemAlloc(1 << 20);
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  ASSERT_TRUE(sim_->Touch(a, p, 4096).ok());
  ASSERT_TRUE(sim_->Touch(b, p + 2048, 4096).ok());
  ASSERT_EQ(sim_->race_count(), 1u);
  std::vector<SimRace> races = sim_->Races();
  ASSERT_EQ(races.size(), 1u);
  EXPECT_EQ(races[0].first_stream, a);
  EXPECT_EQ(races[0].second_stream, b);
  EXPECT_EQ(races[0].first_ptr, p);
  EXPECT_EQ(races[0].second_ptr, p + 2048);
  EXPECT_FALSE(races[0].description.empty());
  // Disjoint ranges never race.
  ASSERT_TRUE(sim_->Touch(a, p + 65536, 4096).ok());
  ASSERT_TRUE(sim_->Touch(b, p + 65536 + 4096, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 1u);
  ASSERT_TRUE(sim_->MemFree(p).ok());
}

TEST_F(SimDriverTest, RaceDetectorSilentWhenEventOrdersTheStreams) {
  DevicePtr p = *sim_->MemAlloc(1 << 20);
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  EventHandle e = NewEvent();
  sim_->Hold(a);  // ordering is logical: holds do not matter
  ASSERT_TRUE(sim_->Touch(a, p, 4096).ok());
  ASSERT_TRUE(sim_->EventRecord(e, a).ok());
  ASSERT_TRUE(sim_->StreamWaitEvent(b, e).ok());
  ASSERT_TRUE(sim_->Touch(b, p, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 0u);
  // Work on a after the record is not ordered with b's touch.
  ASSERT_TRUE(sim_->Touch(a, p + 1024, 16).ok());
  EXPECT_EQ(sim_->race_count(), 1u);
  sim_->Release(a);
  ASSERT_TRUE(sim_->MemFree(p).ok());
}

TEST_F(SimDriverTest, RaceDetectorSilentAfterHostSynchronisation) {
  DevicePtr p = *sim_->MemAlloc(1 << 20);
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  ASSERT_TRUE(sim_->Touch(a, p, 4096).ok());
  ASSERT_TRUE(sim_->StreamSynchronize(a).ok());
  ASSERT_TRUE(sim_->Touch(b, p, 4096).ok());
  EventHandle e = NewEvent();
  ASSERT_TRUE(sim_->EventRecord(e, b).ok());
  EXPECT_TRUE(*sim_->EventQuery(e));  // a completed query synchronises too
  ASSERT_TRUE(sim_->Touch(a, p, 4096).ok());
  ASSERT_TRUE(sim_->CtxSynchronize().ok());
  ASSERT_TRUE(sim_->MemsetD8Async(p, 0, 4096, b).ok());
  EXPECT_EQ(sim_->race_count(), 0u);
  // Memcpy races like any access.
  ASSERT_TRUE(sim_->MemcpyAsync(p + 8192, p, 1024, a).ok());
  EXPECT_EQ(sim_->race_count(), 1u);
  sim_->SetRaceDetection(false);
  ASSERT_TRUE(sim_->Touch(b, p, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 1u);
  ASSERT_TRUE(sim_->MemFree(p).ok());
}

TEST_F(SimDriverTest, FreedMemoryForgetsItsAccesses) {
  StreamHandle a = NewStream();
  StreamHandle b = NewStream();
  DevicePtr p = *sim_->MemAlloc(4096);
  ASSERT_TRUE(sim_->Touch(a, p, 4096).ok());
  ASSERT_TRUE(sim_->MemFree(p).ok());  // synchronises the device
  ExpectMisuse(sim_->Touch(b, p, 4096), cu::kErrorIllegalAddress);
  DevicePtr q = *sim_->MemAlloc(4096);
  EXPECT_NE(q, p);  // addresses are never reused
  ASSERT_TRUE(sim_->Touch(b, q, 4096).ok());
  EXPECT_EQ(sim_->race_count(), 0u);
  ASSERT_TRUE(sim_->MemFree(q).ok());
}

TEST_F(SimDriverTest, FreeingMemoryAHeldStreamTouchesIsUseAfterFree) {
  StreamHandle s = NewStream();
  DevicePtr p = *sim_->MemAlloc(4096);
  sim_->Hold(s);
  ASSERT_TRUE(sim_->Touch(s, p, 4096).ok());
  EXPECT_TRUE(sim_->MemFree(p).ok());  // the driver would wait; we report
  EXPECT_EQ(sim_->misuse_count(), 1u);
  EXPECT_NE(sim_->misuse_log().back().find("use after free"),
            std::string::npos);
  sim_->Release(s);
}

TEST_F(SimDriverTest, HostMemoryAllocRegisterRules) {
  void* p = *sim_->MemHostAlloc(10000, 0);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 4096, 0u);
  std::memset(p, 0xab, 10000);  // real memory
  ExpectMisuse(sim_->MemHostRegister(p, 100, 0),
               cu::kErrorHostMemoryAlreadyRegistered);
  std::vector<char> buffer(1 << 16);
  ASSERT_TRUE(sim_->MemHostRegister(buffer.data(), 8192, 0).ok());
  ExpectMisuse(sim_->MemHostRegister(buffer.data() + 4096, 8192, 0),
               cu::kErrorHostMemoryAlreadyRegistered);
  ASSERT_TRUE(sim_->MemHostRegister(buffer.data() + 8192, 4096, 0).ok());
  ExpectMisuse(sim_->MemHostUnregister(buffer.data() + 1),
               cu::kErrorHostMemoryNotRegistered);
  ExpectMisuse(sim_->MemFreeHost(buffer.data()), cu::kErrorInvalidValue);
  ASSERT_TRUE(sim_->MemHostUnregister(buffer.data()).ok());
  ASSERT_TRUE(sim_->MemHostUnregister(buffer.data() + 8192).ok());
  ASSERT_TRUE(sim_->MemFreeHost(p).ok());
  ExpectMisuse(sim_->MemFreeHost(p), cu::kErrorInvalidValue);
  // Leaked pinned memory is freed by the SimDriver's destructor.
  EXPECT_TRUE(sim_->MemHostAlloc(100, 0).ok());
}

TEST_F(SimDriverTest, StreamDestroyWithPendingWorkStillCompletes) {
  StreamHandle s = NewStream();
  EventHandle e = NewEvent();
  sim_->Hold(s);
  ASSERT_TRUE(sim_->EventRecord(e, s).ok());
  ASSERT_TRUE(sim_->StreamDestroy(s).ok());
  EXPECT_FALSE(*sim_->EventQuery(e));
  sim_->Release(s);
  EXPECT_TRUE(*sim_->EventQuery(e));
  EXPECT_EQ(sim_->misuse_count(), 0u);
}

TEST_F(SimDriverTest, PriorityRangeAndLimits) {
  StreamPriorityRange range = *sim_->StreamGetPriorityRange();
  EXPECT_EQ(range.least, 0);
  EXPECT_EQ(range.greatest, -5);
  EXPECT_TRUE(sim_->StreamCreate(kStreamNonBlocking, -100).ok());  // clamped
  ASSERT_TRUE(sim_->CtxSetLimit(ContextLimit::kMallocHeapSize, 1 << 24).ok());
  EXPECT_EQ(*sim_->CtxGetLimit(ContextLimit::kMallocHeapSize), 1u << 24);
}

TEST_F(SimDriverTest, CostModelAccumulates) {
  EXPECT_EQ(sim_->simulated_time_ns(), 0);
  const std::int64_t thread_before = SimDriver::thread_simulated_time_ns();
  sim_->SetCost(SimCall::kMemAlloc, 1000);
  sim_->SetCost(SimCall::kMemFree, 50);
  sim_->SetWorkCost(7);
  StreamHandle s = NewStream();
  DevicePtr p = *sim_->MemAlloc(4096);
  ASSERT_TRUE(sim_->Touch(s, p, 16).ok());
  ASSERT_TRUE(sim_->Touch(s, p, 16).ok());
  EXPECT_EQ(sim_->simulated_time_ns(), 1000);
  ASSERT_TRUE(sim_->MemFree(p).ok());  // pays for the work it waits for
  EXPECT_EQ(sim_->simulated_time_ns(), 1000 + 50 + 14);
  EXPECT_EQ(SimDriver::thread_simulated_time_ns() - thread_before,
            1000 + 50 + 14);
  ASSERT_TRUE(sim_->UseRealisticCosts().ok());
  const std::int64_t before = sim_->simulated_time_ns();
  DevicePtr big = *sim_->MemAlloc(100 * kMiB);
  EXPECT_EQ(sim_->simulated_time_ns() - before, 10'000 + 100 * 1000);
  ASSERT_TRUE(sim_->MemFree(big).ok());
}

TEST(SimDriverSpec, ParsesPresetsAndCapacities) {
  auto d = SimDriver::CreateFromSpec("sim");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceCount(), 1);
  EXPECT_EQ((*d)->Kind(), "sim");
  d = SimDriver::CreateFromSpec("sim:h100-80gb");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceTotalMem(0), 80 * kGiB);
  d = SimDriver::CreateFromSpec("sim:2xa10-24gb");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceCount(), 2);
  EXPECT_EQ(*(*d)->DeviceName(1), "NVIDIA A10");
  d = SimDriver::CreateFromSpec("sim:24GiB");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceTotalMem(0), 24 * kGiB);
  d = SimDriver::CreateFromSpec("sim:24GB");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceTotalMem(0), std::size_t{24'000'000'000});
  d = SimDriver::CreateFromSpec("sim:4x512MiB");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*(*d)->DeviceCount(), 4);
  for (const char* bad :
       {"", "cuda", "sim:", "sim:nonsense", "sim:0xa10-24gb", "sim:24XB",
        "sim:-1GiB", "simh100-80gb",
        // more than size_t holds, or than any device has
        "sim:844373354775820mb", "sim:999999999999999tib", "sim:17TiB"}) {
    EXPECT_EQ(SimDriver::CreateFromSpec(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(SimDevicePreset("nope").status().code(),
            absl::StatusCode::kNotFound);
  for (const std::string& name : SimDevicePresetNames()) {
    EXPECT_TRUE(SimDevicePreset(name).ok()) << name;
  }
}

// The same calls give the same handles and addresses.
std::vector<std::uint64_t> Script(SimDriver& sim) {
  std::vector<std::uint64_t> out;
  ContextHandle ctx = *sim.PrimaryCtxRetain(0);
  EXPECT_TRUE(sim.CtxSetCurrent(ctx).ok());
  out.push_back(ctx.value());
  for (int i = 0; i < 20; ++i) {
    DevicePtr p = *sim.MemAlloc(1000 + i * 4097);
    out.push_back(p.address());
    if (i % 3 == 0) EXPECT_TRUE(sim.MemFree(p).ok());
  }
  out.push_back(sim.StreamCreate(0, 0)->value());
  out.push_back(sim.EventCreate(0)->value());
  out.push_back(sim.MemAddressReserve(64 * kMiB, 0)->address());
  out.push_back(sim.MemCreate(2 * kMiB, 0)->value());
  return out;
}

TEST(SimDriverDeterminism, SameCallsSameAddresses) {
  auto a = SimDriver::Create();
  auto b = SimDriver::Create();
  EXPECT_EQ(Script(*a), Script(*b));
}

TEST(SimDriverThreads, ConcurrentCallsAreSafe) {
  auto sim = SimDriver::Create();
  ContextHandle ctx = *sim->PrimaryCtxRetain(0);
  std::atomic<int> host_funcs{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      ASSERT_TRUE(sim->CtxSetCurrent(ctx).ok());
      StreamHandle s = *sim->StreamCreate(kStreamNonBlocking, 0);
      EventHandle e = *sim->EventCreate(0);
      std::mt19937 rng(t);
      for (int i = 0; i < 300; ++i) {
        DevicePtr p = *sim->MemAlloc(4096 + rng() % 65536);
        ASSERT_TRUE(sim->Touch(s, p, 4096).ok());
        ASSERT_TRUE(sim->EventRecord(e, s).ok());
        ASSERT_TRUE(sim->StreamWaitEvent(s, e).ok());
        ASSERT_TRUE(sim->EventQuery(e).ok());
        ASSERT_TRUE(sim->LaunchHostFunc(
                           s,
                           [](void* c) {
                             static_cast<std::atomic<int>*>(c)->fetch_add(1);
                           },
                           &host_funcs)
                        .ok());
        ASSERT_TRUE(sim->MemFree(p).ok());
      }
      ASSERT_TRUE(sim->StreamSynchronize(s).ok());
      ASSERT_TRUE(sim->StreamDestroy(s).ok());
      ASSERT_TRUE(sim->EventDestroy(e).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(host_funcs.load(), 4 * 300);
  EXPECT_EQ(sim->misuse_count(), 0u);
  EXPECT_EQ(sim->race_count(), 0u);  // each thread touches its own memory
  EXPECT_TRUE(sim->CheckInvariants().ok());
}

// The race detector stays fast and bounded under a long randomized workload:
// three streams reusing blocks of one arena, ordered by events.
TEST(SimDriverScale, ManyOrderedAccessesStayRaceFreeAndBounded) {
  auto sim = SimDriver::Create();
  ContextHandle ctx = *sim->PrimaryCtxRetain(0);
  ASSERT_TRUE(sim->CtxSetCurrent(ctx).ok());
  constexpr int kStreams = 3;
  StreamHandle streams[kStreams];
  EventHandle events[kStreams];
  for (int i = 0; i < kStreams; ++i) {
    streams[i] = *sim->StreamCreate(kStreamNonBlocking, 0);
    events[i] = *sim->EventCreate(kEventDisableTiming);
  }
  constexpr std::size_t kArena = 64 * kMiB;
  DevicePtr arena = *sim->MemAlloc(kArena);
  int ops = 20000;
  if (const char* env = std::getenv("CTXPOOL_SIM_SCALE_OPS"))
    ops = std::atoi(env);
  std::mt19937_64 rng(42);
  int last_stream = 0;
  for (int i = 0; i < ops; ++i) {
    const int s = static_cast<int>(rng() % kStreams);
    if (s != last_stream) {
      // Hand the arena over: record on the old stream, wait on the new.
      ASSERT_TRUE(
          sim->EventRecord(events[last_stream], streams[last_stream]).ok());
      ASSERT_TRUE(sim->StreamWaitEvent(streams[s], events[last_stream]).ok());
      last_stream = s;
    }
    for (int k = 0; k < 5; ++k) {
      const std::size_t bytes = 512 * (1 + rng() % 64);
      const std::size_t offset = (rng() % (kArena / 512)) * 512;
      ASSERT_TRUE(sim->Touch(streams[s], arena + offset,
                             std::min(bytes, kArena - offset))
                      .ok());
    }
    if (i % 1000 == 999) EXPECT_TRUE(*sim->EventQuery(events[s]));
  }
  EXPECT_EQ(sim->race_count(), 0u);
  EXPECT_EQ(sim->misuse_count(), 0u);
  ASSERT_TRUE(sim->MemFree(arena).ok());
}

TEST(SimRaceShadow, KeepsOneEntryPerStreamAndPrunes) {
  sim_internal::RaceShadow shadow;
  std::vector<sim_internal::RaceShadow::Conflict> conflicts;
  sim_internal::VectorClock a = {1, 0};
  sim_internal::VectorClock b = {0, 1};
  sim_internal::VectorClock host;
  shadow.Access(0, 100, 0, a, host, &conflicts);
  shadow.Access(50, 150, 1, b, host, &conflicts);
  ASSERT_EQ(conflicts.size(), 1u);
  EXPECT_EQ(conflicts[0].stream, 0u);
  EXPECT_EQ(shadow.segment_count(), 3u);  // [0,50) [50,100) [100,150)
  conflicts.clear();
  sim_internal::VectorClock c = {1, 2};  // after both
  shadow.Access(0, 150, 1, c, host, &conflicts);
  EXPECT_TRUE(conflicts.empty());
  EXPECT_EQ(shadow.segment_count(), 1u);
  shadow.Prune(c);
  EXPECT_EQ(shadow.segment_count(), 0u);
  shadow.Access(0, 10, 0, a, host, &conflicts);
  shadow.Forget(5, 10);
  EXPECT_EQ(shadow.segment_count(), 1u);
}

}  // namespace
}  // namespace ctxpool
