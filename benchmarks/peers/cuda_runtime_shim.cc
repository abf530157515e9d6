// The CUDA runtime subset of cuda_runtime_shim.h, forwarding to a Driver.
//
// Peer-benchmark code: one of the few places allowed to include CUDA headers
// (cuda_runtime_api.h, for the runtime's types and declarations only).
#include "peers/cuda_runtime_shim.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/driver.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace peers {
namespace {

// Global state. `driver` and `generation` are read on every call without the
// mutex (acquire/release atomics); the context table is written only by
// InstallShimDriver, which must not race with cuda* calls, and read under the
// mutex when a thread (re)binds its context.
struct ShimState {
  std::atomic<Driver*> driver{nullptr};
  // Bumped by each install, so threads rebind their context lazily.
  std::atomic<std::uint64_t> generation{1};
  absl::Mutex mu;
  std::vector<ContextHandle> primary_contexts ABSL_GUARDED_BY(mu);

  std::atomic<std::uint64_t> malloc_calls{0};
  std::atomic<std::uint64_t> free_calls{0};
  std::atomic<std::uint64_t> event_create_calls{0};
  std::atomic<std::uint64_t> event_destroy_calls{0};
  std::atomic<std::uint64_t> event_record_calls{0};
  std::atomic<std::uint64_t> event_query_calls{0};
  std::atomic<std::uint64_t> errors{0};
};

ShimState& State() {
  static ShimState* const state = new ShimState();  // never destroyed
  return *state;
}

// Per-thread runtime state, as libcudart keeps it.
struct ThreadState {
  int device = 0;
  std::uint64_t bound_generation = 0;  // generation whose ctx is current
  int bound_device = -1;
  cudaError_t last_error = cudaSuccess;
};
thread_local ThreadState tls;

void Bump(std::atomic<std::uint64_t>& counter) {
  counter.fetch_add(1, std::memory_order_relaxed);
}

// The runtime error for a driver Status (the numbers mostly coincide; the
// runtime keeps its own names).
cudaError_t ToRuntimeError(const absl::Status& status) {
  if (status.ok()) return cudaSuccess;
  std::optional<int> code = DriverErrorCode(status);
  if (!code.has_value()) return cudaErrorUnknown;
  switch (*code) {
    case cu::kErrorInvalidValue:
      return cudaErrorInvalidValue;
    case cu::kErrorOutOfMemory:
      return cudaErrorMemoryAllocation;
    case cu::kErrorNotInitialized:
      return cudaErrorInitializationError;
    case cu::kErrorDeinitialized:
      return cudaErrorCudartUnloading;
    case cu::kErrorStubLibrary:
      return cudaErrorStubLibrary;
    case cu::kErrorNoDevice:
      return cudaErrorNoDevice;
    case cu::kErrorInvalidDevice:
      return cudaErrorInvalidDevice;
    case cu::kErrorInvalidContext:
      return cudaErrorDeviceUninitialized;
    case cu::kErrorInvalidHandle:
      return cudaErrorInvalidResourceHandle;
    case cu::kErrorNotReady:
      return cudaErrorNotReady;
    case cu::kErrorIllegalAddress:
      return cudaErrorIllegalAddress;
    case cu::kErrorContextIsDestroyed:
      return cudaErrorContextIsDestroyed;
    case cu::kErrorNotPermitted:
      return cudaErrorNotPermitted;
    case cu::kErrorNotSupported:
      return cudaErrorNotSupported;
    default:
      return cudaErrorUnknown;
  }
}

// Records `error` as the thread's last error (cudaErrorNotReady is a status,
// not an error, as in the runtime) and returns it.
cudaError_t Fail(cudaError_t error) {
  if (error != cudaSuccess && error != cudaErrorNotReady) {
    tls.last_error = error;
    Bump(State().errors);
  }
  return error;
}

cudaError_t Report(const absl::Status& status) {
  return Fail(ToRuntimeError(status));
}

// Returns the installed driver with the calling thread's device's primary
// context current, or nullptr after recording the error in `*error`.
Driver* BoundDriver(cudaError_t* error) {
  ShimState& state = State();
  Driver* driver = state.driver.load(std::memory_order_acquire);
  if (driver == nullptr) {
    *error = Fail(cudaErrorNoDevice);
    return nullptr;
  }
  const std::uint64_t generation =
      state.generation.load(std::memory_order_acquire);
  if (tls.bound_generation == generation && tls.bound_device == tls.device) {
    return driver;
  }
  ContextHandle ctx;
  {
    absl::MutexLock lock(&state.mu);
    if (tls.device < 0 ||
        static_cast<std::size_t>(tls.device) >= state.primary_contexts.size()) {
      *error = Fail(cudaErrorInvalidDevice);
      return nullptr;
    }
    ctx = state.primary_contexts[static_cast<std::size_t>(tls.device)];
  }
  absl::Status status = driver->CtxSetCurrent(ctx);
  if (!status.ok()) {
    *error = Report(status);
    return nullptr;
  }
  tls.bound_generation = generation;
  tls.bound_device = tls.device;
  return driver;
}

// Releases the primary contexts retained for the installed driver.
absl::Status ReleaseContexts(ShimState& state, Driver* driver)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) {
  absl::Status result;
  for (std::size_t d = 0; d < state.primary_contexts.size(); ++d) {
    absl::Status s = driver->PrimaryCtxRelease(static_cast<int>(d));
    if (result.ok() && !s.ok()) result = s;
  }
  state.primary_contexts.clear();
  return result;
}

StreamHandle ToStream(cudaStream_t stream) {
  return StreamHandle::From(stream);
}
EventHandle ToEvent(cudaEvent_t event) { return EventHandle::From(event); }

}  // namespace

absl::Status InstallShimDriver(Driver* driver) {
  ShimState& state = State();
  absl::MutexLock lock(&state.mu);
  Driver* previous = state.driver.load(std::memory_order_acquire);
  state.driver.store(nullptr, std::memory_order_release);
  absl::Status result;
  if (previous != nullptr) result = ReleaseContexts(state, previous);
  state.generation.fetch_add(1, std::memory_order_acq_rel);
  for (auto* counter :
       {&state.malloc_calls, &state.free_calls, &state.event_create_calls,
        &state.event_destroy_calls, &state.event_record_calls,
        &state.event_query_calls, &state.errors}) {
    counter->store(0, std::memory_order_relaxed);
  }
  tls.device = 0;
  if (driver == nullptr) return result;

  absl::StatusOr<int> count = driver->DeviceCount();
  if (!count.ok()) return count.status();
  for (int d = 0; d < *count; ++d) {
    absl::StatusOr<ContextHandle> ctx = driver->PrimaryCtxRetain(d);
    if (!ctx.ok()) {
      absl::Status release = ReleaseContexts(state, driver);
      (void)release;  // the retain failure is the error to report
      return ctx.status();
    }
    state.primary_contexts.push_back(*ctx);
  }
  state.driver.store(driver, std::memory_order_release);
  return result;
}

Driver* ShimDriver() { return State().driver.load(std::memory_order_acquire); }

ShimCallCounts GetShimCallCounts() {
  ShimState& s = State();
  ShimCallCounts c;
  c.malloc_calls = s.malloc_calls.load(std::memory_order_relaxed);
  c.free_calls = s.free_calls.load(std::memory_order_relaxed);
  c.event_create_calls = s.event_create_calls.load(std::memory_order_relaxed);
  c.event_destroy_calls = s.event_destroy_calls.load(std::memory_order_relaxed);
  c.event_record_calls = s.event_record_calls.load(std::memory_order_relaxed);
  c.event_query_calls = s.event_query_calls.load(std::memory_order_relaxed);
  c.errors = s.errors.load(std::memory_order_relaxed);
  return c;
}

}  // namespace peers
}  // namespace ctxpool

// ---- The runtime entry points ----------------------------------------------

using ctxpool::DevicePtr;
using ctxpool::Driver;
using ctxpool::peers::BoundDriver;
using ctxpool::peers::Bump;
using ctxpool::peers::Fail;
using ctxpool::peers::Report;
using ctxpool::peers::State;
using ctxpool::peers::tls;
using ctxpool::peers::ToEvent;
using ctxpool::peers::ToStream;

extern "C" {

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  Driver* driver = State().driver.load(std::memory_order_acquire);
  if (driver == nullptr) return Fail(cudaErrorNoDevice);
  absl::StatusOr<int> n = driver->DeviceCount();
  if (!n.ok()) return Report(n.status());
  *count = *n;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = tls.device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (device == tls.device) return cudaSuccess;
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return error;
  if (device < 0 || device >= count) return Fail(cudaErrorInvalidDevice);
  tls.device = device;  // the context is bound by the next call needing it
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetLastError(void) {
  cudaError_t error = tls.last_error;
  tls.last_error = cudaSuccess;
  return error;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) { return tls.last_error; }

const char* CUDARTAPI cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
      return "cudaErrorInitializationError";
    case cudaErrorCudartUnloading:
      return "cudaErrorCudartUnloading";
    case cudaErrorStubLibrary:
      return "cudaErrorStubLibrary";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorDeviceUninitialized:
      return "cudaErrorDeviceUninitialized";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorContextIsDestroyed:
      return "cudaErrorContextIsDestroyed";
    case cudaErrorNotPermitted:
      return "cudaErrorNotPermitted";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    default:
      return "cudaErrorUnknown";
  }
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInitializationError:
      return "initialization error";
    case cudaErrorCudartUnloading:
      return "driver shutting down";
    case cudaErrorStubLibrary:
      return "CUDA driver is a stub library";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorDeviceUninitialized:
      return "invalid device context";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorContextIsDestroyed:
      return "context is destroyed";
    case cudaErrorNotPermitted:
      return "operation not permitted";
    case cudaErrorNotSupported:
      return "operation not supported";
    default:
      return "unknown error";
  }
}

cudaError_t CUDARTAPI cudaMalloc(void** dev_ptr, size_t size) {
  if (dev_ptr == nullptr) return Fail(cudaErrorInvalidValue);
  *dev_ptr = nullptr;
  Bump(State().malloc_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  absl::StatusOr<DevicePtr> p = driver->MemAlloc(size);
  if (!p.ok()) return Report(p.status());
  *dev_ptr = p->get();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaFree(void* dev_ptr) {
  if (dev_ptr == nullptr) return cudaSuccess;  // as the runtime
  Bump(State().free_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->MemFree(DevicePtr::From(dev_ptr)));
}

cudaError_t CUDARTAPI cudaMemGetInfo(size_t* free, size_t* total) {
  if (free == nullptr || total == nullptr) return Fail(cudaErrorInvalidValue);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  absl::StatusOr<ctxpool::MemInfo> info = driver->MemGetInfo();
  if (!info.ok()) return Report(info.status());
  *free = info->free_bytes;
  *total = info->total_bytes;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event,
                                               unsigned int flags) {
  if (event == nullptr) return Fail(cudaErrorInvalidValue);
  Bump(State().event_create_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  // cudaEventDefault/BlockingSync/DisableTiming share the driver's values.
  absl::StatusOr<ctxpool::EventHandle> e = driver->EventCreate(flags);
  if (!e.ok()) return Report(e.status());
  *event = e->as<cudaEvent_t>();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  Bump(State().event_destroy_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->EventDestroy(ToEvent(event)));
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  Bump(State().event_record_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->EventRecord(ToEvent(event), ToStream(stream)));
}

cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  Bump(State().event_query_calls);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  absl::StatusOr<bool> done = driver->EventQuery(ToEvent(event));
  if (!done.ok()) return Report(done.status());
  return *done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->EventSynchronize(ToEvent(event)));
}

cudaError_t CUDARTAPI cudaStreamWaitEvent(cudaStream_t stream,
                                          cudaEvent_t event,
                                          unsigned int flags) {
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->StreamWaitEvent(ToStream(stream), ToEvent(event)));
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->StreamSynchronize(ToStream(stream)));
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
  cudaError_t error = cudaSuccess;
  Driver* driver = BoundDriver(&error);
  if (driver == nullptr) return error;
  return Report(driver->CtxSynchronize());
}

}  // extern "C"
