#include "ctxpool/driver/cuda_errors.h"

namespace ctxpool {

absl::string_view CudaErrorName(int cuda_error) {
  switch (cuda_error) {
    case cu::kSuccess:
      return "CUDA_SUCCESS";
    case cu::kErrorInvalidValue:
      return "CUDA_ERROR_INVALID_VALUE";
    case cu::kErrorOutOfMemory:
      return "CUDA_ERROR_OUT_OF_MEMORY";
    case cu::kErrorNotInitialized:
      return "CUDA_ERROR_NOT_INITIALIZED";
    case cu::kErrorDeinitialized:
      return "CUDA_ERROR_DEINITIALIZED";
    case cu::kErrorStubLibrary:
      return "CUDA_ERROR_STUB_LIBRARY";
    case cu::kErrorNoDevice:
      return "CUDA_ERROR_NO_DEVICE";
    case cu::kErrorInvalidDevice:
      return "CUDA_ERROR_INVALID_DEVICE";
    case cu::kErrorDeviceNotLicensed:
      return "CUDA_ERROR_DEVICE_NOT_LICENSED";
    case cu::kErrorInvalidImage:
      return "CUDA_ERROR_INVALID_IMAGE";
    case cu::kErrorInvalidContext:
      return "CUDA_ERROR_INVALID_CONTEXT";
    case cu::kErrorContextAlreadyCurrent:
      return "CUDA_ERROR_CONTEXT_ALREADY_CURRENT";
    case cu::kErrorMapFailed:
      return "CUDA_ERROR_MAP_FAILED";
    case cu::kErrorUnmapFailed:
      return "CUDA_ERROR_UNMAP_FAILED";
    case cu::kErrorAlreadyMapped:
      return "CUDA_ERROR_ALREADY_MAPPED";
    case cu::kErrorNoBinaryForGpu:
      return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    case cu::kErrorAlreadyAcquired:
      return "CUDA_ERROR_ALREADY_ACQUIRED";
    case cu::kErrorNotMapped:
      return "CUDA_ERROR_NOT_MAPPED";
    case cu::kErrorUnsupportedLimit:
      return "CUDA_ERROR_UNSUPPORTED_LIMIT";
    case cu::kErrorContextAlreadyInUse:
      return "CUDA_ERROR_CONTEXT_ALREADY_IN_USE";
    case cu::kErrorInvalidSource:
      return "CUDA_ERROR_INVALID_SOURCE";
    case cu::kErrorFileNotFound:
      return "CUDA_ERROR_FILE_NOT_FOUND";
    case cu::kErrorOperatingSystem:
      return "CUDA_ERROR_OPERATING_SYSTEM";
    case cu::kErrorInvalidHandle:
      return "CUDA_ERROR_INVALID_HANDLE";
    case cu::kErrorIllegalState:
      return "CUDA_ERROR_ILLEGAL_STATE";
    case cu::kErrorNotFound:
      return "CUDA_ERROR_NOT_FOUND";
    case cu::kErrorNotReady:
      return "CUDA_ERROR_NOT_READY";
    case cu::kErrorIllegalAddress:
      return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case cu::kErrorLaunchOutOfResources:
      return "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES";
    case cu::kErrorLaunchTimeout:
      return "CUDA_ERROR_LAUNCH_TIMEOUT";
    case cu::kErrorPeerAccessAlreadyEnabled:
      return "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED";
    case cu::kErrorPrimaryContextActive:
      return "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE";
    case cu::kErrorContextIsDestroyed:
      return "CUDA_ERROR_CONTEXT_IS_DESTROYED";
    case cu::kErrorAssert:
      return "CUDA_ERROR_ASSERT";
    case cu::kErrorHostMemoryAlreadyRegistered:
      return "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED";
    case cu::kErrorHostMemoryNotRegistered:
      return "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED";
    case cu::kErrorHardwareStackError:
      return "CUDA_ERROR_HARDWARE_STACK_ERROR";
    case cu::kErrorLaunchFailed:
      return "CUDA_ERROR_LAUNCH_FAILED";
    case cu::kErrorNotPermitted:
      return "CUDA_ERROR_NOT_PERMITTED";
    case cu::kErrorNotSupported:
      return "CUDA_ERROR_NOT_SUPPORTED";
    case cu::kErrorSystemNotReady:
      return "CUDA_ERROR_SYSTEM_NOT_READY";
    case cu::kErrorSystemDriverMismatch:
      return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case cu::kErrorStreamCaptureUnsupported:
      return "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
    case cu::kErrorStreamCaptureInvalidated:
      return "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED";
    case cu::kErrorCapturedEvent:
      return "CUDA_ERROR_CAPTURED_EVENT";
    case cu::kErrorTimeout:
      return "CUDA_ERROR_TIMEOUT";
    case cu::kErrorUnknown:
      return "CUDA_ERROR_UNKNOWN";
    default:
      return "CUDA_ERROR_UNRECOGNIZED";
  }
}

absl::string_view CudaErrorDescription(int cuda_error) {
  switch (cuda_error) {
    case cu::kSuccess:
      return "no error";
    case cu::kErrorInvalidValue:
      return "invalid argument";
    case cu::kErrorOutOfMemory:
      return "out of memory";
    case cu::kErrorNotInitialized:
      return "driver not initialized";
    case cu::kErrorDeinitialized:
      return "driver shutting down";
    case cu::kErrorStubLibrary:
      return "CUDA driver is a stub library";
    case cu::kErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cu::kErrorInvalidDevice:
      return "invalid device ordinal";
    case cu::kErrorInvalidContext:
      return "invalid device context";
    case cu::kErrorMapFailed:
      return "mapping of buffer object failed";
    case cu::kErrorUnmapFailed:
      return "unmapping of buffer object failed";
    case cu::kErrorAlreadyMapped:
      return "resource already mapped";
    case cu::kErrorNotMapped:
      return "resource not mapped";
    case cu::kErrorUnsupportedLimit:
      return "limit is not supported on this architecture";
    case cu::kErrorInvalidSource:
      return "device kernel source is invalid";
    case cu::kErrorFileNotFound:
      return "file not found";
    case cu::kErrorOperatingSystem:
      return "OS call failed or operation not supported on this OS";
    case cu::kErrorInvalidHandle:
      return "invalid resource handle";
    case cu::kErrorNotFound:
      return "named symbol not found";
    case cu::kErrorNotReady:
      return "device not ready";
    case cu::kErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cu::kErrorPrimaryContextActive:
      return "primary context active";
    case cu::kErrorContextIsDestroyed:
      return "context is destroyed";
    case cu::kErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cu::kErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cu::kErrorLaunchFailed:
      return "unspecified launch failure";
    case cu::kErrorNotPermitted:
      return "operation not permitted";
    case cu::kErrorNotSupported:
      return "operation not supported";
    case cu::kErrorSystemNotReady:
      return "system not yet initialized";
    case cu::kErrorSystemDriverMismatch:
      return "system has unsupported display driver / cuda driver combination";
    case cu::kErrorTimeout:
      return "wait operation timed out";
    case cu::kErrorUnknown:
      return "unknown error";
    default:
      return "unknown error";
  }
}

}  // namespace ctxpool
