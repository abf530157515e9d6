// The driver contract (driver_contract.h) on the real CUDA driver. Skips with
// "no CUDA driver: ..." when CudaDriver::Load() fails (no libcuda, a stub
// library, no device, or ctxpool built without CUDA).
#include "ctxpool/driver/cuda_driver.h"
#include "driver_contract.h"

namespace ctxpool {
namespace testing_contract {
namespace {

absl::StatusOr<std::unique_ptr<Driver>> LoadCuda() {
  return CudaDriver::Load();
}

INSTANTIATE_TEST_SUITE_P(Cuda, DriverContractTest,
                         ::testing::Values(DriverFactory{"cuda", &LoadCuda,
                                                         false}),
                         DriverFactoryName);

}  // namespace
}  // namespace testing_contract
}  // namespace ctxpool
