#include "ctxpool/status.h"

#include "ctxpool/driver/cuda_errors.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  CTXPOOL_ASSIGN_OR_RETURN(int h, Half(x));
  CTXPOOL_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  CTXPOOL_RETURN_IF_ERROR(Half(x));
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPropagatesErrors) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckEven(4).ok());
  EXPECT_FALSE(CheckEven(3).ok());
}

TEST(DriverError, CarriesTheCudaErrorAsPayload) {
  absl::Status s = DriverError(cu::kErrorOutOfMemory, "cuMemAlloc", "1 TiB");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorOutOfMemory);
  EXPECT_EQ(s.message(), "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): 1 TiB");
  EXPECT_EQ(DriverErrorCode(absl::InternalError("x")), std::nullopt);
  EXPECT_EQ(DriverErrorCode(absl::OkStatus()), std::nullopt);
  EXPECT_TRUE(DriverError(cu::kSuccess, "cuInit").ok());
}

TEST(DriverError, MapsCanonicalCodes) {
  EXPECT_EQ(DriverError(cu::kErrorInvalidValue, "f").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DriverError(cu::kErrorNoDevice, "f").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverError(cu::kErrorStubLibrary, "f").code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverError(cu::kErrorIllegalAddress, "f").code(),
            absl::StatusCode::kInternal);
}

TEST(CudaErrorName, UsesOwnTable) {
  EXPECT_EQ(CudaErrorName(0), "CUDA_SUCCESS");
  EXPECT_EQ(CudaErrorName(34), "CUDA_ERROR_STUB_LIBRARY");
  EXPECT_EQ(CudaErrorName(201), "CUDA_ERROR_INVALID_CONTEXT");
  EXPECT_EQ(CudaErrorName(12345), "CUDA_ERROR_UNRECOGNIZED");
  EXPECT_EQ(CudaErrorDescription(2), "out of memory");
}

}  // namespace
}  // namespace ctxpool
