// ctxpool/driver/driver.h — the seam between ctxpool and CUDA.
//
// `Driver` is every CUDA driver call ctxpool makes, as an abstract class.
// Allocators, the context manager and the tools take a `Driver&` and nothing
// else, so each line of them runs on two implementations:
//
//   * CudaDriver (cuda_driver.h): the real driver, loaded at run time with
//     dlopen("libcuda.so.1") + cuGetProcAddress. ctxpool never links libcuda.
//   * SimDriver (sim_driver.h): a simulated GPU on the CPU, stricter than the
//     real driver, used by every test in CI and by capacity planning.
//
// Conventions, identical for both implementations:
//   * Each method mirrors one driver entry point (named in its comment) and
//     returns absl::Status / absl::StatusOr. On failure the CUresult is
//     attached as a payload: DriverErrorCode(status) == cu::kErrorOutOfMemory.
//   * Calls that act on "the current context" (memory, streams, events) need
//     a context current on the calling thread, as in CUDA: make one current
//     with CtxSetCurrent / CtxPushCurrent first. Without one the call fails
//     with CUDA_ERROR_INVALID_CONTEXT.
//   * Queries that complete asynchronously (StreamQuery, EventQuery) return
//     `true` when the work is done and `false` for CUDA_ERROR_NOT_READY; they
//     never block.
//   * Thread-safety: every method may be called from any thread concurrently.
//
// Example:
//
//   CTXPOOL_ASSIGN_OR_RETURN(ContextHandle ctx, driver.PrimaryCtxRetain(0));
//   CTXPOOL_RETURN_IF_ERROR(driver.CtxSetCurrent(ctx));
//   CTXPOOL_ASSIGN_OR_RETURN(DevicePtr p, driver.MemAlloc(1 << 20));
//   CTXPOOL_RETURN_IF_ERROR(driver.MemFree(p));
//   CTXPOOL_RETURN_IF_ERROR(driver.PrimaryCtxRelease(0));
#ifndef CTXPOOL_DRIVER_DRIVER_H_
#define CTXPOOL_DRIVER_DRIVER_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/driver/types.h"
#include "ctxpool/status.h"

namespace ctxpool {

class Driver {
 public:
  virtual ~Driver() = default;

  // "cuda" or "sim"; used in reports and metric labels.
  virtual absl::string_view Kind() const = 0;
  // One line for humans: driver version or simulated preset.
  virtual std::string Describe() const = 0;

  // ---- Devices -----------------------------------------------------------
  // cuDeviceGetCount.
  virtual absl::StatusOr<int> DeviceCount() = 0;
  // cuDeviceGetName.
  virtual absl::StatusOr<std::string> DeviceName(int device) = 0;
  // cuDeviceTotalMem.
  virtual absl::StatusOr<std::size_t> DeviceTotalMem(int device) = 0;
  // cuDeviceGetAttribute.
  virtual absl::StatusOr<int> DeviceGetAttribute(DeviceAttribute attribute,
                                                 int device) = 0;

  // ---- Primary context ---------------------------------------------------
  // cuDevicePrimaryCtxRetain: reference-counted; the first retain creates the
  // context (and charges its memory overhead).
  virtual absl::StatusOr<ContextHandle> PrimaryCtxRetain(int device) = 0;
  // cuDevicePrimaryCtxRelease: the last release destroys the context.
  virtual absl::Status PrimaryCtxRelease(int device) = 0;
  // cuDevicePrimaryCtxSetFlags.
  virtual absl::Status PrimaryCtxSetFlags(int device, unsigned flags) = 0;
  // cuDevicePrimaryCtxGetState.
  virtual absl::StatusOr<PrimaryContextState> PrimaryCtxGetState(
      int device) = 0;

  // ---- Contexts ----------------------------------------------------------
  // cuCtxCreate: a new, non-primary context, made current on this thread.
  // ctxpool uses it only for the one-context-per-model baseline.
  virtual absl::StatusOr<ContextHandle> CtxCreate(int device,
                                                  unsigned flags) = 0;
  // cuCtxDestroy.
  virtual absl::Status CtxDestroy(ContextHandle ctx) = 0;
  // cuCtxPushCurrent / cuCtxPopCurrent / cuCtxGetCurrent / cuCtxSetCurrent.
  virtual absl::Status CtxPushCurrent(ContextHandle ctx) = 0;
  virtual absl::StatusOr<ContextHandle> CtxPopCurrent() = 0;
  // Returns the null handle when no context is current.
  virtual absl::StatusOr<ContextHandle> CtxGetCurrent() = 0;
  virtual absl::Status CtxSetCurrent(ContextHandle ctx) = 0;
  // cuCtxGetDevice: the device of the current context.
  virtual absl::StatusOr<int> CtxGetDevice() = 0;
  // cuCtxSynchronize: waits for all work in the current context.
  virtual absl::Status CtxSynchronize() = 0;
  // cuCtxGetLimit / cuCtxSetLimit on the current context.
  virtual absl::StatusOr<std::size_t> CtxGetLimit(ContextLimit limit) = 0;
  virtual absl::Status CtxSetLimit(ContextLimit limit, std::size_t value) = 0;
  // cuMemGetInfo for the current context's device.
  virtual absl::StatusOr<MemInfo> MemGetInfo() = 0;

  // ---- Streams -----------------------------------------------------------
  // cuStreamCreateWithPriority.
  virtual absl::StatusOr<StreamHandle> StreamCreate(unsigned flags,
                                                    int priority) = 0;
  // cuStreamDestroy. Pending work still completes, as in CUDA.
  virtual absl::Status StreamDestroy(StreamHandle stream) = 0;
  // cuStreamQuery: true when all work is complete.
  virtual absl::StatusOr<bool> StreamQuery(StreamHandle stream) = 0;
  // cuStreamSynchronize: blocks the host until the stream's work completes.
  virtual absl::Status StreamSynchronize(StreamHandle stream) = 0;
  // cuCtxGetStreamPriorityRange.
  virtual absl::StatusOr<StreamPriorityRange> StreamGetPriorityRange() = 0;
  // cuStreamWaitEvent: later work on `stream` waits for `event` (no host
  // synchronisation).
  virtual absl::Status StreamWaitEvent(StreamHandle stream,
                                       EventHandle event) = 0;
  // cuLaunchHostFunc: runs fn(user_data) on a driver thread once the work
  // before it on `stream` completes.
  virtual absl::Status LaunchHostFunc(StreamHandle stream, HostFn fn,
                                      void* user_data) = 0;

  // ---- Events ------------------------------------------------------------
  // cuEventCreate.
  virtual absl::StatusOr<EventHandle> EventCreate(unsigned flags) = 0;
  // cuEventDestroy.
  virtual absl::Status EventDestroy(EventHandle event) = 0;
  // cuEventRecord: the event completes when the work now on `stream` does.
  virtual absl::Status EventRecord(EventHandle event, StreamHandle stream) = 0;
  // cuEventQuery: true when complete (or never recorded).
  virtual absl::StatusOr<bool> EventQuery(EventHandle event) = 0;
  // cuEventSynchronize: blocks the host until the event completes.
  virtual absl::Status EventSynchronize(EventHandle event) = 0;

  // ---- Classic device memory ---------------------------------------------
  // cuMemAlloc on the current context's device.
  virtual absl::StatusOr<DevicePtr> MemAlloc(std::size_t bytes) = 0;
  // cuMemFree: implicitly synchronises the device.
  virtual absl::Status MemFree(DevicePtr ptr) = 0;
  // cuMemsetD8Async and cuMemcpyAsync (unified addressing): stream work that
  // touches memory (SimDriver's race detector sees it).
  virtual absl::Status MemsetD8Async(DevicePtr dst, unsigned char value,
                                     std::size_t bytes,
                                     StreamHandle stream) = 0;
  virtual absl::Status MemcpyAsync(DevicePtr dst, DevicePtr src,
                                   std::size_t bytes, StreamHandle stream) = 0;

  // ---- Virtual memory management (VMM) -----------------------------------
  // cuMemGetAllocationGranularity (minimum, pinned device memory).
  virtual absl::StatusOr<std::size_t> MemGetAllocationGranularity(
      int device) = 0;
  // cuMemAddressReserve: a virtual range, nothing mapped.
  virtual absl::StatusOr<DevicePtr> MemAddressReserve(
      std::size_t bytes, std::size_t alignment) = 0;
  // cuMemAddressFree: the whole range; nothing may still be mapped in it.
  virtual absl::Status MemAddressFree(DevicePtr ptr, std::size_t bytes) = 0;
  // cuMemCreate: physical pinned device memory on `device`.
  virtual absl::StatusOr<PhysicalMemHandle> MemCreate(std::size_t bytes,
                                                      int device) = 0;
  // cuMemRelease: memory is freed once it is also unmapped everywhere.
  virtual absl::Status MemRelease(PhysicalMemHandle handle) = 0;
  // cuMemMap: maps `handle` (from `offset`) at `ptr`, inside a reservation.
  virtual absl::Status MemMap(DevicePtr ptr, std::size_t bytes,
                              std::size_t offset, PhysicalMemHandle handle) = 0;
  // cuMemUnmap.
  virtual absl::Status MemUnmap(DevicePtr ptr, std::size_t bytes) = 0;
  // cuMemSetAccess: read-write access for `device` to a mapped range.
  virtual absl::Status MemSetAccess(DevicePtr ptr, std::size_t bytes,
                                    int device) = 0;

  // ---- Pinned host memory ------------------------------------------------
  // cuMemHostAlloc.
  virtual absl::StatusOr<void*> MemHostAlloc(std::size_t bytes,
                                             unsigned flags) = 0;
  // cuMemFreeHost.
  virtual absl::Status MemFreeHost(void* ptr) = 0;
  // cuMemHostRegister / cuMemHostUnregister: pin memory the caller owns.
  virtual absl::Status MemHostRegister(void* ptr, std::size_t bytes,
                                       unsigned flags) = 0;
  virtual absl::Status MemHostUnregister(void* ptr) = 0;
};

// Makes `ctx` current on the calling thread for the guard's lifetime and
// restores the previous one after (cuCtxGetCurrent + cuCtxSetCurrent). When
// `ctx` is already current it makes no driver call on exit.
//
//   ScopedContext guard(driver, ctx);
//   CTXPOOL_RETURN_IF_ERROR(guard.status());
class ScopedContext {
 public:
  ScopedContext(Driver& driver, ContextHandle ctx);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;

  // OK when `ctx` is now current.
  const absl::Status& status() const { return status_; }

 private:
  Driver& driver_;
  ContextHandle previous_;
  bool restore_ = false;
  absl::Status status_;
};

}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_DRIVER_H_
