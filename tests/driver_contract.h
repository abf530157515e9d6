// tests/driver_contract.h — behaviour every Driver must share.
//
// One value-parameterized suite, DriverContractTest, states what ctxpool
// relies on from the CUDA driver: SimDriver must match the real driver here,
// so a test that passes on SimDriver in CI means the same on a GPU. Each test
// binary instantiates it with a factory:
//
//   INSTANTIATE_TEST_SUITE_P(
//       Sim, DriverContractTest,
//       ::testing::Values(DriverFactory{"sim", [] { ... }, true}),
//       DriverFactoryName);
//
// The fixture retains device 0's primary context and makes it current; a
// factory that fails (no driver, no device) skips every test with its message.
// Only behaviour the real driver shows belongs here: sim-only features (Hold,
// Touch, misuse counting) are tested in sim_driver_test.cc. Ordering is
// checked with host funcs and atomics, never with timing.
#ifndef CTXPOOL_TESTS_DRIVER_CONTRACT_H_
#define CTXPOOL_TESTS_DRIVER_CONTRACT_H_

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/status.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace testing_contract {

struct DriverFactory {
  std::string name;
  std::function<absl::StatusOr<std::unique_ptr<Driver>>()> make;
  bool simulated = false;
};

inline std::string DriverFactoryName(
    const ::testing::TestParamInfo<DriverFactory>& info) {
  return info.param.name;
}

class DriverContractTest : public ::testing::TestWithParam<DriverFactory> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Driver>> driver = GetParam().make();
    if (!driver.ok()) {
      GTEST_SKIP() << "no CUDA driver: " << driver.status().message();
    }
    driver_ = std::move(*driver);
    absl::StatusOr<int> count = driver_->DeviceCount();
    if (!count.ok() || *count == 0) {
      GTEST_SKIP() << "no CUDA device: "
                   << (count.ok() ? "device count is 0"
                                  : std::string(count.status().message()));
    }
    absl::StatusOr<ContextHandle> ctx = driver_->PrimaryCtxRetain(0);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = *ctx;
    retained_ = true;
    ASSERT_TRUE(driver_->CtxSetCurrent(ctx_).ok());
  }

  void TearDown() override {
    if (driver_ == nullptr || !retained_) return;
    EXPECT_TRUE(driver_->CtxSynchronize().ok());
    EXPECT_TRUE(driver_->CtxSetCurrent(ContextHandle()).ok());
    EXPECT_TRUE(driver_->PrimaryCtxRelease(0).ok());
  }

  Driver& d() { return *driver_; }
  bool simulated() const { return GetParam().simulated; }

  std::unique_ptr<Driver> driver_;
  ContextHandle ctx_;
  bool retained_ = false;
};

inline std::optional<int> ErrorOf(const absl::Status& s) {
  return DriverErrorCode(s);
}

TEST_P(DriverContractTest, DevicesHaveNamesAndMemory) {
  const int count = *d().DeviceCount();
  EXPECT_GE(count, 1);
  for (int i = 0; i < count; ++i) {
    EXPECT_FALSE(d().DeviceName(i)->empty());
    EXPECT_GT(*d().DeviceTotalMem(i), std::size_t{1} << 30);
    EXPECT_GE(
        *d().DeviceGetAttribute(DeviceAttribute::kComputeCapabilityMajor, i),
        3);
    EXPECT_GT(*d().DeviceGetAttribute(DeviceAttribute::kMultiprocessorCount, i),
              0);
  }
  EXPECT_EQ(ErrorOf(d().DeviceName(count).status()), cu::kErrorInvalidDevice);
  EXPECT_EQ(ErrorOf(d().DeviceTotalMem(-1).status()), cu::kErrorInvalidDevice);
}

TEST_P(DriverContractTest, PrimaryContextIsReferenceCounted) {
  PrimaryContextState state = *d().PrimaryCtxGetState(0);
  EXPECT_TRUE(state.active);
  absl::StatusOr<ContextHandle> again = d().PrimaryCtxRetain(0);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, ctx_);  // one primary context per device
  ASSERT_TRUE(d().PrimaryCtxRelease(0).ok());
  EXPECT_TRUE(d().PrimaryCtxGetState(0)->active);  // the fixture still holds it
}

TEST_P(DriverContractTest, CurrentContextStack) {
  EXPECT_EQ(*d().CtxGetCurrent(), ctx_);
  EXPECT_EQ(*d().CtxGetDevice(), 0);
  ASSERT_TRUE(d().CtxPushCurrent(ctx_).ok());
  EXPECT_EQ(*d().CtxPopCurrent(), ctx_);
  EXPECT_EQ(*d().CtxGetCurrent(), ctx_);
  {
    ScopedContext guard(d(), ctx_);
    EXPECT_TRUE(guard.status().ok());
    EXPECT_EQ(*d().CtxGetCurrent(), ctx_);
  }
  EXPECT_EQ(*d().CtxGetCurrent(), ctx_);
}

TEST_P(DriverContractTest, MemAllocFreeRoundTrip) {
  const MemInfo before = *d().MemGetInfo();
  EXPECT_EQ(before.total_bytes, *d().DeviceTotalMem(0));
  EXPECT_LE(before.free_bytes, before.total_bytes);
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  absl::StatusOr<DevicePtr> p = d().MemAlloc(kBytes);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_FALSE(p->is_null());
  EXPECT_EQ(p->address() % 256, 0u);
  const MemInfo during = *d().MemGetInfo();
  EXPECT_LT(during.free_bytes, before.free_bytes);
  absl::StatusOr<DevicePtr> q = d().MemAlloc(1000);
  ASSERT_TRUE(q.ok());
  EXPECT_TRUE(*q >= *p + kBytes || *q + 1000 <= *p);  // no overlap
  ASSERT_TRUE(d().MemFree(*q).ok());
  ASSERT_TRUE(d().MemFree(*p).ok());
  EXPECT_GT(d().MemGetInfo()->free_bytes, during.free_bytes);
}

TEST_P(DriverContractTest, MemAllocErrors) {
  const std::size_t total = *d().DeviceTotalMem(0);
  absl::StatusOr<DevicePtr> huge = d().MemAlloc(total * 2);
  EXPECT_EQ(ErrorOf(huge.status()), cu::kErrorOutOfMemory);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrorOf(d().MemAlloc(0).status()), cu::kErrorInvalidValue);
  DevicePtr p = *d().MemAlloc(4096);
  ASSERT_TRUE(d().MemFree(p).ok());
  EXPECT_EQ(ErrorOf(d().MemFree(p)), cu::kErrorInvalidValue);  // double free
}

TEST_P(DriverContractTest, EventsAndStreams) {
  StreamHandle s = *d().StreamCreate(kStreamNonBlocking, 0);
  EventHandle e = *d().EventCreate(kEventDisableTiming);
  EXPECT_TRUE(*d().EventQuery(e));  // never recorded
  EXPECT_TRUE(d().EventSynchronize(e).ok());
  DevicePtr p = *d().MemAlloc(1 << 20);
  ASSERT_TRUE(d().MemsetD8Async(p, 0x5a, 1 << 20, s).ok());
  ASSERT_TRUE(d().EventRecord(e, s).ok());
  ASSERT_TRUE(d().EventSynchronize(e).ok());
  EXPECT_TRUE(*d().EventQuery(e));
  ASSERT_TRUE(d().StreamSynchronize(s).ok());
  EXPECT_TRUE(*d().StreamQuery(s));
  // The legacy default stream (null handle) is a stream like any other.
  ASSERT_TRUE(d().EventRecord(e, StreamHandle()).ok());
  ASSERT_TRUE(d().StreamSynchronize(StreamHandle()).ok());
  EXPECT_TRUE(*d().EventQuery(e));
  ASSERT_TRUE(d().MemFree(p).ok());
  ASSERT_TRUE(d().EventDestroy(e).ok());
  ASSERT_TRUE(d().StreamDestroy(s).ok());
}

struct OrderLog {
  std::atomic<int> next{0};
  int seen[8] = {};
};
struct OrderItem {
  OrderLog* log;
  int id;
};
inline void RecordOrder(void* p) {
  auto* item = static_cast<OrderItem*>(p);
  item->log->seen[item->id] = item->log->next.fetch_add(1);
}

TEST_P(DriverContractTest, HostFuncsRunInStreamOrder) {
  StreamHandle s = *d().StreamCreate(kStreamNonBlocking, 0);
  OrderLog log;
  OrderItem items[4] = {{&log, 0}, {&log, 1}, {&log, 2}, {&log, 3}};
  for (OrderItem& item : items) {
    ASSERT_TRUE(d().LaunchHostFunc(s, &RecordOrder, &item).ok());
  }
  ASSERT_TRUE(d().StreamSynchronize(s).ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(log.seen[i], i);
  ASSERT_TRUE(d().StreamDestroy(s).ok());
}

TEST_P(DriverContractTest, StreamWaitEventOrdersStreams) {
  StreamHandle a = *d().StreamCreate(kStreamNonBlocking, 0);
  StreamHandle b = *d().StreamCreate(kStreamNonBlocking, 0);
  EventHandle e = *d().EventCreate(kEventDisableTiming);
  OrderLog log;
  OrderItem first{&log, 0};
  OrderItem second{&log, 1};
  ASSERT_TRUE(d().LaunchHostFunc(a, &RecordOrder, &first).ok());
  ASSERT_TRUE(d().EventRecord(e, a).ok());
  ASSERT_TRUE(d().StreamWaitEvent(b, e).ok());
  ASSERT_TRUE(d().LaunchHostFunc(b, &RecordOrder, &second).ok());
  ASSERT_TRUE(d().StreamSynchronize(b).ok());
  EXPECT_EQ(log.next.load(), 2);
  EXPECT_EQ(log.seen[0], 0);
  EXPECT_EQ(log.seen[1], 1);
  ASSERT_TRUE(d().StreamSynchronize(a).ok());
  ASSERT_TRUE(d().EventDestroy(e).ok());
  ASSERT_TRUE(d().StreamDestroy(a).ok());
  ASSERT_TRUE(d().StreamDestroy(b).ok());
}

TEST_P(DriverContractTest, DestroyedHandlesAreRejected) {
  EventHandle e = *d().EventCreate(kEventDisableTiming);
  ASSERT_TRUE(d().EventDestroy(e).ok());
  StreamHandle s = *d().StreamCreate(kStreamNonBlocking, 0);
  ASSERT_TRUE(d().StreamDestroy(s).ok());
  if (!simulated()) {
    GTEST_SKIP() << "using a destroyed handle is undefined on the real driver";
  }
  EXPECT_EQ(ErrorOf(d().EventQuery(e).status()), cu::kErrorInvalidHandle);
  EXPECT_EQ(ErrorOf(d().StreamQuery(s).status()), cu::kErrorInvalidHandle);
}

TEST_P(DriverContractTest, MemsetAndCopyThroughPinnedMemory) {
  constexpr std::size_t kBytes = 1 << 16;
  absl::StatusOr<void*> host = d().MemHostAlloc(kBytes, 0);
  ASSERT_TRUE(host.ok()) << host.status();
  std::memset(*host, 0, kBytes);
  StreamHandle s = *d().StreamCreate(kStreamNonBlocking, 0);
  DevicePtr p = *d().MemAlloc(kBytes);
  ASSERT_TRUE(d().MemsetD8Async(p, 0x7b, kBytes, s).ok());
  ASSERT_TRUE(d().MemcpyAsync(DevicePtr::From(*host), p, kBytes, s).ok());
  ASSERT_TRUE(d().StreamSynchronize(s).ok());
  if (!simulated()) {
    // SimDriver has no device memory behind its addresses.
    const auto* bytes = static_cast<const unsigned char*>(*host);
    EXPECT_EQ(bytes[0], 0x7b);
    EXPECT_EQ(bytes[kBytes - 1], 0x7b);
  }
  ASSERT_TRUE(d().MemFree(p).ok());
  ASSERT_TRUE(d().MemFreeHost(*host).ok());
  ASSERT_TRUE(d().StreamDestroy(s).ok());
}

TEST_P(DriverContractTest, VmmRoundTrip) {
  const int vmm = *d().DeviceGetAttribute(
      DeviceAttribute::kVirtualMemoryManagementSupported, 0);
  if (vmm == 0) GTEST_SKIP() << "device 0 does not support VMM";
  const std::size_t g = *d().MemGetAllocationGranularity(0);
  ASSERT_GT(g, 0u);
  EXPECT_EQ(g & (g - 1), 0u);
  EXPECT_EQ(ErrorOf(d().MemCreate(g + 1, 0).status()), cu::kErrorInvalidValue);
  absl::StatusOr<DevicePtr> va = d().MemAddressReserve(4 * g, 0);
  ASSERT_TRUE(va.ok()) << va.status();
  EXPECT_EQ(va->address() % g, 0u);
  const MemInfo before = *d().MemGetInfo();
  absl::StatusOr<PhysicalMemHandle> h = d().MemCreate(2 * g, 0);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_LT(d().MemGetInfo()->free_bytes, before.free_bytes);
  // Misaligned or out-of-range maps fail.
  EXPECT_EQ(ErrorOf(d().MemMap(*va + 4096, g, 0, *h)), cu::kErrorInvalidValue);
  EXPECT_EQ(ErrorOf(d().MemMap(*va, 3 * g, 0, *h)), cu::kErrorInvalidValue);
  ASSERT_TRUE(d().MemMap(*va, 2 * g, 0, *h).ok());
  ASSERT_TRUE(d().MemSetAccess(*va, 2 * g, 0).ok());
  StreamHandle s = *d().StreamCreate(kStreamNonBlocking, 0);
  ASSERT_TRUE(d().MemsetD8Async(*va, 1, 2 * g, s).ok());
  ASSERT_TRUE(d().StreamSynchronize(s).ok());
  // Release before unmap: the memory lives until unmapped.
  ASSERT_TRUE(d().MemRelease(*h).ok());
  ASSERT_TRUE(d().MemUnmap(*va, 2 * g).ok());
  EXPECT_FALSE(d().MemUnmap(*va, 2 * g).ok());  // nothing mapped any more
  ASSERT_TRUE(d().MemAddressFree(*va, 4 * g).ok());
  ASSERT_TRUE(d().StreamDestroy(s).ok());
}

TEST_P(DriverContractTest, HostRegisterRules) {
  constexpr std::size_t kBytes = 1 << 16;
  void* buffer = std::aligned_alloc(4096, kBytes);
  ASSERT_NE(buffer, nullptr);
  ASSERT_TRUE(d().MemHostRegister(buffer, kBytes, 0).ok());
  EXPECT_EQ(ErrorOf(d().MemHostRegister(buffer, kBytes, 0)),
            cu::kErrorHostMemoryAlreadyRegistered);
  ASSERT_TRUE(d().MemHostUnregister(buffer).ok());
  EXPECT_EQ(ErrorOf(d().MemHostUnregister(buffer)),
            cu::kErrorHostMemoryNotRegistered);
  std::free(buffer);
  absl::StatusOr<void*> pinned = d().MemHostAlloc(4096, kHostAllocPortable);
  ASSERT_TRUE(pinned.ok());
  ASSERT_TRUE(d().MemFreeHost(*pinned).ok());
}

TEST_P(DriverContractTest, PriorityRangeAndLimits) {
  StreamPriorityRange range = *d().StreamGetPriorityRange();
  EXPECT_EQ(range.least, 0);
  EXPECT_LT(range.greatest, range.least);
  absl::StatusOr<StreamHandle> s =
      d().StreamCreate(kStreamNonBlocking, range.greatest);
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(d().StreamDestroy(*s).ok());
  EXPECT_GT(*d().CtxGetLimit(ContextLimit::kStackSize), 0u);
  ASSERT_TRUE(
      d().CtxSetLimit(ContextLimit::kMallocHeapSize, std::size_t{16} << 20)
          .ok());
  EXPECT_GE(*d().CtxGetLimit(ContextLimit::kMallocHeapSize),
            std::size_t{16} << 20);
}

}  // namespace testing_contract
}  // namespace ctxpool

#endif  // CTXPOOL_TESTS_DRIVER_CONTRACT_H_
