// ctxpool/driver/cuda_errors.h — CUDA driver error numbers and their names.
//
// ctxpool keeps its own table of CUresult values and names instead of asking
// the driver (cuGetErrorName): a stub libcuda answers CUDA_ERROR_STUB_LIBRARY
// (34) even for that call, and SimDriver has no driver to ask. The values are
// those of cuda.h, so an error from SimDriver and one from the real driver
// carry the same number.
//
//   absl::Status s = DriverError(cu::kErrorOutOfMemory, "cuMemAlloc");
//   CudaErrorName(cu::kErrorOutOfMemory);  // "CUDA_ERROR_OUT_OF_MEMORY"
#ifndef CTXPOOL_DRIVER_CUDA_ERRORS_H_
#define CTXPOOL_DRIVER_CUDA_ERRORS_H_

#include "absl/strings/string_view.h"

namespace ctxpool {
namespace cu {

inline constexpr int kSuccess = 0;
inline constexpr int kErrorInvalidValue = 1;
inline constexpr int kErrorOutOfMemory = 2;
inline constexpr int kErrorNotInitialized = 3;
inline constexpr int kErrorDeinitialized = 4;
inline constexpr int kErrorStubLibrary = 34;
inline constexpr int kErrorNoDevice = 100;
inline constexpr int kErrorInvalidDevice = 101;
inline constexpr int kErrorDeviceNotLicensed = 102;
inline constexpr int kErrorInvalidImage = 200;
inline constexpr int kErrorInvalidContext = 201;
inline constexpr int kErrorContextAlreadyCurrent = 202;
inline constexpr int kErrorMapFailed = 205;
inline constexpr int kErrorUnmapFailed = 206;
inline constexpr int kErrorAlreadyMapped = 208;
inline constexpr int kErrorNoBinaryForGpu = 209;
inline constexpr int kErrorAlreadyAcquired = 210;
inline constexpr int kErrorNotMapped = 211;
inline constexpr int kErrorUnsupportedLimit = 215;
inline constexpr int kErrorContextAlreadyInUse = 216;
inline constexpr int kErrorInvalidSource = 300;
inline constexpr int kErrorFileNotFound = 301;
inline constexpr int kErrorOperatingSystem = 304;
inline constexpr int kErrorInvalidHandle = 400;
inline constexpr int kErrorIllegalState = 401;
inline constexpr int kErrorNotFound = 500;
inline constexpr int kErrorNotReady = 600;
inline constexpr int kErrorIllegalAddress = 700;
inline constexpr int kErrorLaunchOutOfResources = 701;
inline constexpr int kErrorLaunchTimeout = 702;
inline constexpr int kErrorPeerAccessAlreadyEnabled = 704;
inline constexpr int kErrorPrimaryContextActive = 708;
inline constexpr int kErrorContextIsDestroyed = 709;
inline constexpr int kErrorAssert = 710;
inline constexpr int kErrorHostMemoryAlreadyRegistered = 712;
inline constexpr int kErrorHostMemoryNotRegistered = 713;
inline constexpr int kErrorHardwareStackError = 714;
inline constexpr int kErrorLaunchFailed = 719;
inline constexpr int kErrorNotPermitted = 800;
inline constexpr int kErrorNotSupported = 801;
inline constexpr int kErrorSystemNotReady = 802;
inline constexpr int kErrorSystemDriverMismatch = 803;
inline constexpr int kErrorStreamCaptureUnsupported = 900;
inline constexpr int kErrorStreamCaptureInvalidated = 901;
inline constexpr int kErrorCapturedEvent = 907;
inline constexpr int kErrorTimeout = 909;
inline constexpr int kErrorUnknown = 999;

}  // namespace cu

// "CUDA_ERROR_OUT_OF_MEMORY" for 2, "CUDA_SUCCESS" for 0, and
// "CUDA_ERROR_UNRECOGNIZED" for any number not in the table.
absl::string_view CudaErrorName(int cuda_error);

// A short English description ("out of memory"), or "unknown error".
absl::string_view CudaErrorDescription(int cuda_error);

}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_CUDA_ERRORS_H_
