// ctxpool/driver/cuda_driver.h — the real CUDA driver behind the Driver seam.
//
// CudaDriver loads libcuda at run time: dlopen("libcuda.so.1"), then
// cuGetProcAddress for each entry point at the CUDA 13 version of it. ctxpool
// never has a link-time dependency on libcuda, so the same binary runs on a
// machine without a GPU (and falls back to SimDriver, see context/runtime.h).
//
//   absl::StatusOr<std::unique_ptr<Driver>> d = CudaDriver::Load();
//   if (absl::IsUnavailable(d.status())) { /* no driver or no GPU here */ }
//
// Load() returns UNAVAILABLE when libcuda.so.1 cannot be found (the message
// names the library and dlerror()), when it is a stub library, when cuInit
// fails with CUDA_ERROR_NO_DEVICE, or when ctxpool was built without CUDA.
// Error names come from ctxpool's own table (cuda_errors.h).
//
// Thread-safety: all methods are thread-safe, as the driver is.
#ifndef CTXPOOL_DRIVER_CUDA_DRIVER_H_
#define CTXPOOL_DRIVER_CUDA_DRIVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ctxpool/driver/driver.h"

namespace ctxpool {

struct CudaDriverOptions {
  // Library to dlopen; CTXPOOL_LIBCUDA overrides it when set.
  std::string library = "libcuda.so.1";
};

// Entry points for the real driver. The implementation (src/cuda_driver.cc)
// is the only ctxpool file besides the plugin and peer benchmarks that
// includes cuda.h.
class CudaDriver {
 public:
  // Creates the real driver. See the file comment for the errors.
  static absl::StatusOr<std::unique_ptr<Driver>> Load(
      const CudaDriverOptions& options = {});
  // True when ctxpool was built with CUDA support (CTXPOOL_WITH_CUDA).
  static bool CompiledIn();
};

}  // namespace ctxpool

#endif  // CTXPOOL_DRIVER_CUDA_DRIVER_H_
