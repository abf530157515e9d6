// Built when ctxpool is configured without CUDA (CTXPOOL_WITH_CUDA=OFF or no
// toolkit found): the real driver is never available.
#include "absl/status/status.h"
#include "ctxpool/driver/cuda_driver.h"

namespace ctxpool {

absl::StatusOr<std::unique_ptr<Driver>> CudaDriver::Load(
    const CudaDriverOptions&) {
  return absl::UnavailableError(
      "ctxpool was built without CUDA support (CTXPOOL_WITH_CUDA=OFF or no "
      "CUDA toolkit at configure time); rebuild with the CUDA toolkit to use "
      "a GPU");
}

bool CudaDriver::CompiledIn() { return false; }

}  // namespace ctxpool
