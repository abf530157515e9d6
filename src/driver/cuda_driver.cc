// CudaDriver: the real CUDA driver, loaded at run time.
//
// The only library file that includes cuda.h. Load() dlopens libcuda, finds
// cuGetProcAddress_v2 and resolves each entry point at the CUDA version whose
// ABI matches the function-pointer typedef used here (cudaTypedefs.h names
// them PFN_<symbol>_v<version>). That is exactly what asking with
// cudaVersion = 13000 returns, since the driver hands out the newest ABI not
// newer than the version asked for, but it also keeps every signature right on
// a 12.x driver, which would refuse a request for 13000 with INVALID_VALUE.
// The two calls whose CUDA 13 ABI gained a context argument (cuCtxGetDevice,
// cuCtxSynchronize) are resolved at 13000 on 13.x drivers and at their
// original ABI on older ones.
//
// The function table is filled once in Load() and never written again, so
// every method is thread-safe without a lock; the CUDA driver itself is
// thread-safe. The library handle is never dlclose'd: libcuda does not
// support being unloaded while the CUDA runtime or other libraries use it.
#include "ctxpool/driver/cuda_driver.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/status.h"

namespace ctxpool {
namespace {

static_assert(CUDA_SUCCESS == cu::kSuccess);
static_assert(CUDA_ERROR_STUB_LIBRARY == cu::kErrorStubLibrary);
static_assert(CUDA_ERROR_NOT_READY == cu::kErrorNotReady);
static_assert(CUDA_ERROR_NO_DEVICE == cu::kErrorNoDevice);
static_assert(sizeof(CUdeviceptr) == sizeof(std::uint64_t));
static_assert(std::is_same_v<CUhostFn, HostFn>);
static_assert(CU_STREAM_NON_BLOCKING == kStreamNonBlocking);
static_assert(CU_EVENT_DISABLE_TIMING == kEventDisableTiming);
static_assert(CU_EVENT_BLOCKING_SYNC == kEventBlockingSync);
static_assert(CU_MEMHOSTALLOC_PORTABLE == kHostAllocPortable);
static_assert(CU_MEMHOSTALLOC_DEVICEMAP == kHostAllocDeviceMap);
static_assert(CU_MEMHOSTALLOC_WRITECOMBINED == kHostAllocWriteCombined);
static_assert(CU_MEMHOSTREGISTER_PORTABLE == kHostRegisterPortable);
static_assert(CU_MEMHOSTREGISTER_DEVICEMAP == kHostRegisterDeviceMap);

// The entry points ctxpool uses, at the ABI named by each typedef.
struct Api {
  PFN_cuInit_v2000 cuInit = nullptr;
  PFN_cuDriverGetVersion_v2020 cuDriverGetVersion = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetCount_v2000 cuDeviceGetCount = nullptr;
  PFN_cuDeviceGetName_v2000 cuDeviceGetName = nullptr;
  PFN_cuDeviceTotalMem_v3020 cuDeviceTotalMem = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 cuDevicePrimaryCtxRetain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 cuDevicePrimaryCtxRelease = nullptr;
  PFN_cuDevicePrimaryCtxSetFlags_v11000 cuDevicePrimaryCtxSetFlags = nullptr;
  PFN_cuDevicePrimaryCtxGetState_v7000 cuDevicePrimaryCtxGetState = nullptr;
  PFN_cuCtxCreate_v12050 cuCtxCreate = nullptr;
  PFN_cuCtxDestroy_v4000 cuCtxDestroy = nullptr;
  PFN_cuCtxPushCurrent_v4000 cuCtxPushCurrent = nullptr;
  PFN_cuCtxPopCurrent_v4000 cuCtxPopCurrent = nullptr;
  PFN_cuCtxGetCurrent_v4000 cuCtxGetCurrent = nullptr;
  PFN_cuCtxSetCurrent_v4000 cuCtxSetCurrent = nullptr;
  // Exactly one of each pair is set (see the file comment).
  PFN_cuCtxGetDevice_v13000 cuCtxGetDevice_v13000 = nullptr;
  PFN_cuCtxGetDevice_v2000 cuCtxGetDevice_v2000 = nullptr;
  PFN_cuCtxSynchronize_v13000 cuCtxSynchronize_v13000 = nullptr;
  PFN_cuCtxSynchronize_v2000 cuCtxSynchronize_v2000 = nullptr;
  PFN_cuCtxGetLimit_v3010 cuCtxGetLimit = nullptr;
  PFN_cuCtxSetLimit_v3010 cuCtxSetLimit = nullptr;
  PFN_cuCtxGetStreamPriorityRange_v5050 cuCtxGetStreamPriorityRange = nullptr;
  PFN_cuMemGetInfo_v3020 cuMemGetInfo = nullptr;
  PFN_cuStreamCreateWithPriority_v5050 cuStreamCreateWithPriority = nullptr;
  PFN_cuStreamDestroy_v4000 cuStreamDestroy = nullptr;
  PFN_cuStreamQuery_v2000 cuStreamQuery = nullptr;
  PFN_cuStreamSynchronize_v2000 cuStreamSynchronize = nullptr;
  PFN_cuStreamWaitEvent_v3020 cuStreamWaitEvent = nullptr;
  PFN_cuLaunchHostFunc_v10000 cuLaunchHostFunc = nullptr;
  PFN_cuEventCreate_v2000 cuEventCreate = nullptr;
  PFN_cuEventDestroy_v4000 cuEventDestroy = nullptr;
  PFN_cuEventRecord_v2000 cuEventRecord = nullptr;
  PFN_cuEventQuery_v2000 cuEventQuery = nullptr;
  PFN_cuEventSynchronize_v2000 cuEventSynchronize = nullptr;
  PFN_cuMemAlloc_v3020 cuMemAlloc = nullptr;
  PFN_cuMemFree_v3020 cuMemFree = nullptr;
  PFN_cuMemsetD8Async_v3020 cuMemsetD8Async = nullptr;
  PFN_cuMemcpyAsync_v4000 cuMemcpyAsync = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity =
      nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemHostAlloc_v2020 cuMemHostAlloc = nullptr;
  PFN_cuMemFreeHost_v2000 cuMemFreeHost = nullptr;
  PFN_cuMemHostRegister_v6050 cuMemHostRegister = nullptr;
  PFN_cuMemHostUnregister_v4000 cuMemHostUnregister = nullptr;
};

// Re-labels a driver error as UNAVAILABLE, keeping its message and payload.
absl::Status AsUnavailable(const absl::Status& status) {
  if (status.ok() || absl::IsUnavailable(status)) return status;
  absl::Status out(absl::StatusCode::kUnavailable, status.message());
  status.ForEachPayload([&out](absl::string_view url, const absl::Cord& p) {
    out.SetPayload(url, p);
  });
  return out;
}

// Resolves entry points through cuGetProcAddress_v2, remembering the first
// one that is missing.
class Resolver {
 public:
  Resolver(PFN_cuGetProcAddress_v12000 get_proc, std::string library)
      : get_proc_(get_proc), library_(std::move(library)) {}

  template <typename Fn>
  void Resolve(const char* symbol, int version, Fn& out) {
    if (!status_.ok()) return;
    void* fn = nullptr;
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult rc = get_proc_(symbol, &fn, version,
                            CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
    if (rc == CUDA_ERROR_STUB_LIBRARY) {
      // The toolkit's lib64/stubs/libcuda.so answers every call this way.
      status_ =
          AsUnavailable(DriverError(rc, "cuGetProcAddress", StubDetail()));
      return;
    }
    if (rc != CUDA_SUCCESS || fn == nullptr ||
        found != CU_GET_PROC_ADDRESS_SUCCESS) {
      absl::string_view why =
          found == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
              ? "the driver is too old for this entry point"
              : "the driver does not export it";
      status_ = absl::UnavailableError(absl::StrCat(
          "the CUDA driver ", library_, " lacks the entry point ", symbol,
          " (CUDA ABI ", version / 1000, ".", (version % 1000) / 10, "): ", why,
          " (cuGetProcAddress returned ", CudaErrorName(rc),
          "); install an NVIDIA driver for CUDA 13"));
      return;
    }
    out = reinterpret_cast<Fn>(fn);
  }

  const absl::Status& status() const { return status_; }
  std::string StubDetail() const {
    return absl::StrCat(library_,
                        " is the CUDA toolkit's stub library, not a driver: no "
                        "NVIDIA driver is installed on this machine");
  }

 private:
  PFN_cuGetProcAddress_v12000 get_proc_;
  std::string library_;
  absl::Status status_;
};

CUdevice_attribute ToCu(DeviceAttribute attribute) {
  switch (attribute) {
    case DeviceAttribute::kComputeCapabilityMajor:
      return CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
    case DeviceAttribute::kComputeCapabilityMinor:
      return CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR;
    case DeviceAttribute::kMultiprocessorCount:
      return CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    case DeviceAttribute::kVirtualMemoryManagementSupported:
      return CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
    case DeviceAttribute::kMemoryPoolsSupported:
      return CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED;
    case DeviceAttribute::kUnifiedAddressing:
      return CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING;
    case DeviceAttribute::kCanMapHostMemory:
      return CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY;
    case DeviceAttribute::kIntegrated:
      return CU_DEVICE_ATTRIBUTE_INTEGRATED;
    case DeviceAttribute::kPciBusId:
      return CU_DEVICE_ATTRIBUTE_PCI_BUS_ID;
  }
  return CU_DEVICE_ATTRIBUTE_MAX;
}

CUlimit ToCu(ContextLimit limit) {
  switch (limit) {
    case ContextLimit::kStackSize:
      return CU_LIMIT_STACK_SIZE;
    case ContextLimit::kPrintfFifoSize:
      return CU_LIMIT_PRINTF_FIFO_SIZE;
    case ContextLimit::kMallocHeapSize:
      return CU_LIMIT_MALLOC_HEAP_SIZE;
  }
  return CU_LIMIT_MAX;
}

CUmemAllocationProp PinnedDeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

CUstream Raw(StreamHandle s) { return s.as<CUstream>(); }
CUevent Raw(EventHandle e) { return e.as<CUevent>(); }
CUcontext Raw(ContextHandle c) { return c.as<CUcontext>(); }
CUdeviceptr Raw(DevicePtr p) { return static_cast<CUdeviceptr>(p.address()); }
CUmemGenericAllocationHandle Raw(PhysicalMemHandle h) {
  return h.as<CUmemGenericAllocationHandle>();
}

class CudaDriverImpl final : public Driver {
 public:
  CudaDriverImpl(const Api& api, int driver_version, std::string library)
      : api_(api),
        driver_version_(driver_version),
        library_(std::move(library)) {}

  absl::string_view Kind() const override { return "cuda"; }
  std::string Describe() const override {
    return absl::StrCat("CUDA driver ", driver_version_ / 1000, ".",
                        (driver_version_ % 1000) / 10, " (", library_, ")");
  }

  // ---- Devices -------------------------------------------------------------
  absl::StatusOr<int> DeviceCount() override {
    int count = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuDeviceGetCount(&count), "cuDeviceGetCount"));
    return count;
  }
  absl::StatusOr<std::string> DeviceName(int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    char name[256] = {};
    CTXPOOL_RETURN_IF_ERROR(Check(
        api_.cuDeviceGetName(name, sizeof(name) - 1, dev), "cuDeviceGetName"));
    return std::string(name);
  }
  absl::StatusOr<std::size_t> DeviceTotalMem(int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    std::size_t bytes = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuDeviceTotalMem(&bytes, dev), "cuDeviceTotalMem"));
    return bytes;
  }
  absl::StatusOr<int> DeviceGetAttribute(DeviceAttribute attribute,
                                         int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    int value = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuDeviceGetAttribute(&value, ToCu(attribute), dev),
              "cuDeviceGetAttribute"));
    return value;
  }

  // ---- Primary context -----------------------------------------------------
  absl::StatusOr<ContextHandle> PrimaryCtxRetain(int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    CUcontext ctx = nullptr;
    CTXPOOL_RETURN_IF_ERROR(Check(api_.cuDevicePrimaryCtxRetain(&ctx, dev),
                                  "cuDevicePrimaryCtxRetain"));
    return ContextHandle::From(ctx);
  }
  absl::Status PrimaryCtxRelease(int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    return Check(api_.cuDevicePrimaryCtxRelease(dev),
                 "cuDevicePrimaryCtxRelease");
  }
  absl::Status PrimaryCtxSetFlags(int device, unsigned flags) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    return Check(api_.cuDevicePrimaryCtxSetFlags(dev, flags),
                 "cuDevicePrimaryCtxSetFlags");
  }
  absl::StatusOr<PrimaryContextState> PrimaryCtxGetState(int device) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    unsigned flags = 0;
    int active = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuDevicePrimaryCtxGetState(dev, &flags, &active),
              "cuDevicePrimaryCtxGetState"));
    return PrimaryContextState{.flags = flags, .active = active != 0};
  }

  // ---- Contexts ------------------------------------------------------------
  absl::StatusOr<ContextHandle> CtxCreate(int device, unsigned flags) override {
    CTXPOOL_ASSIGN_OR_RETURN(CUdevice dev, Device(device));
    CUcontext ctx = nullptr;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuCtxCreate(&ctx, nullptr, flags, dev), "cuCtxCreate"));
    return ContextHandle::From(ctx);
  }
  absl::Status CtxDestroy(ContextHandle ctx) override {
    return Check(api_.cuCtxDestroy(Raw(ctx)), "cuCtxDestroy");
  }
  absl::Status CtxPushCurrent(ContextHandle ctx) override {
    return Check(api_.cuCtxPushCurrent(Raw(ctx)), "cuCtxPushCurrent");
  }
  absl::StatusOr<ContextHandle> CtxPopCurrent() override {
    CUcontext ctx = nullptr;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuCtxPopCurrent(&ctx), "cuCtxPopCurrent"));
    return ContextHandle::From(ctx);
  }
  absl::StatusOr<ContextHandle> CtxGetCurrent() override {
    CUcontext ctx = nullptr;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent"));
    return ContextHandle::From(ctx);
  }
  absl::Status CtxSetCurrent(ContextHandle ctx) override {
    return Check(api_.cuCtxSetCurrent(Raw(ctx)), "cuCtxSetCurrent");
  }
  absl::StatusOr<int> CtxGetDevice() override {
    CUdevice dev = 0;
    CUresult rc = api_.cuCtxGetDevice_v13000 != nullptr
                      ? api_.cuCtxGetDevice_v13000(&dev, nullptr)
                      : api_.cuCtxGetDevice_v2000(&dev);
    CTXPOOL_RETURN_IF_ERROR(Check(rc, "cuCtxGetDevice"));
    return static_cast<int>(dev);
  }
  absl::Status CtxSynchronize() override {
    CUresult rc = api_.cuCtxSynchronize_v13000 != nullptr
                      ? api_.cuCtxSynchronize_v13000(nullptr)
                      : api_.cuCtxSynchronize_v2000();
    return Check(rc, "cuCtxSynchronize");
  }
  absl::StatusOr<std::size_t> CtxGetLimit(ContextLimit limit) override {
    std::size_t value = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuCtxGetLimit(&value, ToCu(limit)), "cuCtxGetLimit"));
    return value;
  }
  absl::Status CtxSetLimit(ContextLimit limit, std::size_t value) override {
    return Check(api_.cuCtxSetLimit(ToCu(limit), value), "cuCtxSetLimit");
  }
  absl::StatusOr<MemInfo> MemGetInfo() override {
    MemInfo info;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuMemGetInfo(&info.free_bytes, &info.total_bytes),
              "cuMemGetInfo"));
    return info;
  }

  // ---- Streams -------------------------------------------------------------
  absl::StatusOr<StreamHandle> StreamCreate(unsigned flags,
                                            int priority) override {
    CUstream stream = nullptr;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuStreamCreateWithPriority(&stream, flags, priority),
              "cuStreamCreateWithPriority"));
    return StreamHandle::From(stream);
  }
  absl::Status StreamDestroy(StreamHandle stream) override {
    return Check(api_.cuStreamDestroy(Raw(stream)), "cuStreamDestroy");
  }
  absl::StatusOr<bool> StreamQuery(StreamHandle stream) override {
    CUresult rc = api_.cuStreamQuery(Raw(stream));
    if (rc == CUDA_ERROR_NOT_READY) return false;
    CTXPOOL_RETURN_IF_ERROR(Check(rc, "cuStreamQuery"));
    return true;
  }
  absl::Status StreamSynchronize(StreamHandle stream) override {
    return Check(api_.cuStreamSynchronize(Raw(stream)), "cuStreamSynchronize");
  }
  absl::StatusOr<StreamPriorityRange> StreamGetPriorityRange() override {
    StreamPriorityRange range;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuCtxGetStreamPriorityRange(&range.least, &range.greatest),
              "cuCtxGetStreamPriorityRange"));
    return range;
  }
  absl::Status StreamWaitEvent(StreamHandle stream,
                               EventHandle event) override {
    return Check(api_.cuStreamWaitEvent(Raw(stream), Raw(event), 0),
                 "cuStreamWaitEvent");
  }
  absl::Status LaunchHostFunc(StreamHandle stream, HostFn fn,
                              void* user_data) override {
    return Check(api_.cuLaunchHostFunc(Raw(stream), fn, user_data),
                 "cuLaunchHostFunc");
  }

  // ---- Events --------------------------------------------------------------
  absl::StatusOr<EventHandle> EventCreate(unsigned flags) override {
    CUevent event = nullptr;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuEventCreate(&event, flags), "cuEventCreate"));
    return EventHandle::From(event);
  }
  absl::Status EventDestroy(EventHandle event) override {
    return Check(api_.cuEventDestroy(Raw(event)), "cuEventDestroy");
  }
  absl::Status EventRecord(EventHandle event, StreamHandle stream) override {
    return Check(api_.cuEventRecord(Raw(event), Raw(stream)), "cuEventRecord");
  }
  absl::StatusOr<bool> EventQuery(EventHandle event) override {
    CUresult rc = api_.cuEventQuery(Raw(event));
    if (rc == CUDA_ERROR_NOT_READY) return false;
    CTXPOOL_RETURN_IF_ERROR(Check(rc, "cuEventQuery"));
    return true;
  }
  absl::Status EventSynchronize(EventHandle event) override {
    return Check(api_.cuEventSynchronize(Raw(event)), "cuEventSynchronize");
  }

  // ---- Classic device memory -----------------------------------------------
  absl::StatusOr<DevicePtr> MemAlloc(std::size_t bytes) override {
    CUdeviceptr ptr = 0;
    CTXPOOL_RETURN_IF_ERROR(Check(api_.cuMemAlloc(&ptr, bytes), "cuMemAlloc",
                                  absl::StrCat(bytes, " bytes")));
    return DevicePtr(ptr);
  }
  absl::Status MemFree(DevicePtr ptr) override {
    return Check(api_.cuMemFree(Raw(ptr)), "cuMemFree");
  }
  absl::Status MemsetD8Async(DevicePtr dst, unsigned char value,
                             std::size_t bytes, StreamHandle stream) override {
    return Check(api_.cuMemsetD8Async(Raw(dst), value, bytes, Raw(stream)),
                 "cuMemsetD8Async");
  }
  absl::Status MemcpyAsync(DevicePtr dst, DevicePtr src, std::size_t bytes,
                           StreamHandle stream) override {
    return Check(api_.cuMemcpyAsync(Raw(dst), Raw(src), bytes, Raw(stream)),
                 "cuMemcpyAsync");
  }

  // ---- Virtual memory management -------------------------------------------
  absl::StatusOr<std::size_t> MemGetAllocationGranularity(int device) override {
    CUmemAllocationProp prop = PinnedDeviceProp(device);
    std::size_t granularity = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuMemGetAllocationGranularity(
                  &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity"));
    return granularity;
  }
  absl::StatusOr<DevicePtr> MemAddressReserve(std::size_t bytes,
                                              std::size_t alignment) override {
    CUdeviceptr ptr = 0;
    CTXPOOL_RETURN_IF_ERROR(
        Check(api_.cuMemAddressReserve(&ptr, bytes, alignment, 0, 0),
              "cuMemAddressReserve", absl::StrCat(bytes, " bytes")));
    return DevicePtr(ptr);
  }
  absl::Status MemAddressFree(DevicePtr ptr, std::size_t bytes) override {
    return Check(api_.cuMemAddressFree(Raw(ptr), bytes), "cuMemAddressFree");
  }
  absl::StatusOr<PhysicalMemHandle> MemCreate(std::size_t bytes,
                                              int device) override {
    CUmemAllocationProp prop = PinnedDeviceProp(device);
    CUmemGenericAllocationHandle handle = 0;
    CTXPOOL_RETURN_IF_ERROR(Check(api_.cuMemCreate(&handle, bytes, &prop, 0),
                                  "cuMemCreate",
                                  absl::StrCat(bytes, " bytes")));
    return PhysicalMemHandle::From(handle);
  }
  absl::Status MemRelease(PhysicalMemHandle handle) override {
    return Check(api_.cuMemRelease(Raw(handle)), "cuMemRelease");
  }
  absl::Status MemMap(DevicePtr ptr, std::size_t bytes, std::size_t offset,
                      PhysicalMemHandle handle) override {
    return Check(api_.cuMemMap(Raw(ptr), bytes, offset, Raw(handle), 0),
                 "cuMemMap");
  }
  absl::Status MemUnmap(DevicePtr ptr, std::size_t bytes) override {
    return Check(api_.cuMemUnmap(Raw(ptr), bytes), "cuMemUnmap");
  }
  absl::Status MemSetAccess(DevicePtr ptr, std::size_t bytes,
                            int device) override {
    CUmemAccessDesc desc = {};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return Check(api_.cuMemSetAccess(Raw(ptr), bytes, &desc, 1),
                 "cuMemSetAccess");
  }

  // ---- Pinned host memory --------------------------------------------------
  absl::StatusOr<void*> MemHostAlloc(std::size_t bytes,
                                     unsigned flags) override {
    void* ptr = nullptr;
    CTXPOOL_RETURN_IF_ERROR(Check(api_.cuMemHostAlloc(&ptr, bytes, flags),
                                  "cuMemHostAlloc",
                                  absl::StrCat(bytes, " bytes")));
    return ptr;
  }
  absl::Status MemFreeHost(void* ptr) override {
    return Check(api_.cuMemFreeHost(ptr), "cuMemFreeHost");
  }
  absl::Status MemHostRegister(void* ptr, std::size_t bytes,
                               unsigned flags) override {
    return Check(api_.cuMemHostRegister(ptr, bytes, flags),
                 "cuMemHostRegister");
  }
  absl::Status MemHostUnregister(void* ptr) override {
    return Check(api_.cuMemHostUnregister(ptr), "cuMemHostUnregister");
  }

 private:
  static absl::Status Check(CUresult rc, absl::string_view call,
                            absl::string_view detail = {}) {
    if (rc == CUDA_SUCCESS) return absl::OkStatus();
    return DriverError(static_cast<int>(rc), call, detail);
  }

  absl::StatusOr<CUdevice> Device(int ordinal) const {
    CUdevice dev = 0;
    CTXPOOL_RETURN_IF_ERROR(Check(api_.cuDeviceGet(&dev, ordinal),
                                  "cuDeviceGet",
                                  absl::StrCat("device ", ordinal)));
    return dev;
  }

  const Api api_;
  const int driver_version_;
  const std::string library_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Driver>> CudaDriver::Load(
    const CudaDriverOptions& options) {
  std::string library = options.library;
  if (const char* env = std::getenv("CTXPOOL_LIBCUDA");
      env != nullptr && *env != '\0') {
    library = env;
  }
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    return absl::UnavailableError(absl::StrCat(
        "the CUDA driver library ", library, " was not found (",
        error != nullptr ? error : "dlopen failed",
        "): no NVIDIA driver is installed on this machine (libcuda.so.1 comes "
        "with the driver; set CTXPOOL_LIBCUDA to its path if it lives "
        "elsewhere)"));
  }
  dlerror();
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(
      dlsym(handle, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "the CUDA driver library ", library,
        " has no cuGetProcAddress_v2: the NVIDIA driver is older than CUDA "
        "12.0; ctxpool needs a driver for CUDA 12.5 or newer (13.0 "
        "recommended)"));
  }

  Api api;
  Resolver resolver(get_proc, library);
  resolver.Resolve("cuInit", 2000, api.cuInit);
  resolver.Resolve("cuDriverGetVersion", 2020, api.cuDriverGetVersion);
  CTXPOOL_RETURN_IF_ERROR(resolver.status());

  CUresult rc = api.cuInit(0);
  if (rc == CUDA_ERROR_STUB_LIBRARY) {
    return AsUnavailable(DriverError(rc, "cuInit", resolver.StubDetail()));
  }
  if (rc == CUDA_ERROR_NO_DEVICE) {
    return AsUnavailable(DriverError(
        rc, "cuInit", "the NVIDIA driver is loaded but sees no GPU"));
  }
  if (rc != CUDA_SUCCESS) {
    return AsUnavailable(DriverError(
        rc, "cuInit",
        absl::StrCat("the CUDA driver ", library, " cannot be initialised")));
  }
  int version = 0;
  rc = api.cuDriverGetVersion(&version);
  if (rc != CUDA_SUCCESS) {
    return AsUnavailable(DriverError(rc, "cuDriverGetVersion"));
  }

  resolver.Resolve("cuDeviceGet", 2000, api.cuDeviceGet);
  resolver.Resolve("cuDeviceGetCount", 2000, api.cuDeviceGetCount);
  resolver.Resolve("cuDeviceGetName", 2000, api.cuDeviceGetName);
  resolver.Resolve("cuDeviceTotalMem", 3020, api.cuDeviceTotalMem);
  resolver.Resolve("cuDeviceGetAttribute", 2000, api.cuDeviceGetAttribute);
  resolver.Resolve("cuDevicePrimaryCtxRetain", 7000,
                   api.cuDevicePrimaryCtxRetain);
  resolver.Resolve("cuDevicePrimaryCtxRelease", 11000,
                   api.cuDevicePrimaryCtxRelease);
  resolver.Resolve("cuDevicePrimaryCtxSetFlags", 11000,
                   api.cuDevicePrimaryCtxSetFlags);
  resolver.Resolve("cuDevicePrimaryCtxGetState", 7000,
                   api.cuDevicePrimaryCtxGetState);
  resolver.Resolve("cuCtxCreate", 12050, api.cuCtxCreate);
  resolver.Resolve("cuCtxDestroy", 4000, api.cuCtxDestroy);
  resolver.Resolve("cuCtxPushCurrent", 4000, api.cuCtxPushCurrent);
  resolver.Resolve("cuCtxPopCurrent", 4000, api.cuCtxPopCurrent);
  resolver.Resolve("cuCtxGetCurrent", 4000, api.cuCtxGetCurrent);
  resolver.Resolve("cuCtxSetCurrent", 4000, api.cuCtxSetCurrent);
  if (version >= 13000) {
    resolver.Resolve("cuCtxGetDevice", 13000, api.cuCtxGetDevice_v13000);
    resolver.Resolve("cuCtxSynchronize", 13000, api.cuCtxSynchronize_v13000);
  } else {
    resolver.Resolve("cuCtxGetDevice", 2000, api.cuCtxGetDevice_v2000);
    resolver.Resolve("cuCtxSynchronize", 2000, api.cuCtxSynchronize_v2000);
  }
  resolver.Resolve("cuCtxGetLimit", 3010, api.cuCtxGetLimit);
  resolver.Resolve("cuCtxSetLimit", 3010, api.cuCtxSetLimit);
  resolver.Resolve("cuCtxGetStreamPriorityRange", 5050,
                   api.cuCtxGetStreamPriorityRange);
  resolver.Resolve("cuMemGetInfo", 3020, api.cuMemGetInfo);
  resolver.Resolve("cuStreamCreateWithPriority", 5050,
                   api.cuStreamCreateWithPriority);
  resolver.Resolve("cuStreamDestroy", 4000, api.cuStreamDestroy);
  resolver.Resolve("cuStreamQuery", 2000, api.cuStreamQuery);
  resolver.Resolve("cuStreamSynchronize", 2000, api.cuStreamSynchronize);
  resolver.Resolve("cuStreamWaitEvent", 3020, api.cuStreamWaitEvent);
  resolver.Resolve("cuLaunchHostFunc", 10000, api.cuLaunchHostFunc);
  resolver.Resolve("cuEventCreate", 2000, api.cuEventCreate);
  resolver.Resolve("cuEventDestroy", 4000, api.cuEventDestroy);
  resolver.Resolve("cuEventRecord", 2000, api.cuEventRecord);
  resolver.Resolve("cuEventQuery", 2000, api.cuEventQuery);
  resolver.Resolve("cuEventSynchronize", 2000, api.cuEventSynchronize);
  resolver.Resolve("cuMemAlloc", 3020, api.cuMemAlloc);
  resolver.Resolve("cuMemFree", 3020, api.cuMemFree);
  resolver.Resolve("cuMemsetD8Async", 3020, api.cuMemsetD8Async);
  resolver.Resolve("cuMemcpyAsync", 4000, api.cuMemcpyAsync);
  resolver.Resolve("cuMemGetAllocationGranularity", 10020,
                   api.cuMemGetAllocationGranularity);
  resolver.Resolve("cuMemAddressReserve", 10020, api.cuMemAddressReserve);
  resolver.Resolve("cuMemAddressFree", 10020, api.cuMemAddressFree);
  resolver.Resolve("cuMemCreate", 10020, api.cuMemCreate);
  resolver.Resolve("cuMemRelease", 10020, api.cuMemRelease);
  resolver.Resolve("cuMemMap", 10020, api.cuMemMap);
  resolver.Resolve("cuMemUnmap", 10020, api.cuMemUnmap);
  resolver.Resolve("cuMemSetAccess", 10020, api.cuMemSetAccess);
  resolver.Resolve("cuMemHostAlloc", 2020, api.cuMemHostAlloc);
  resolver.Resolve("cuMemFreeHost", 2000, api.cuMemFreeHost);
  resolver.Resolve("cuMemHostRegister", 6050, api.cuMemHostRegister);
  resolver.Resolve("cuMemHostUnregister", 4000, api.cuMemHostUnregister);
  CTXPOOL_RETURN_IF_ERROR(resolver.status());

  return std::unique_ptr<Driver>(
      std::make_unique<CudaDriverImpl>(api, version, library));
}

bool CudaDriver::CompiledIn() { return true; }

}  // namespace ctxpool
