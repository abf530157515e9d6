#include "ctxpool/status.h"

#include <charconv>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/driver/cuda_errors.h"

namespace ctxpool {

std::optional<int> DriverErrorCode(const absl::Status& status) {
  if (status.ok()) return std::nullopt;
  absl::optional<absl::Cord> payload =
      status.GetPayload(kDriverErrorPayloadUrl);
  if (!payload.has_value()) return std::nullopt;
  std::string text(*payload);
  int code = 0;
  auto [end, ec] =
      std::from_chars(text.data(), text.data() + text.size(), code);
  if (ec != std::errc() || end != text.data() + text.size())
    return std::nullopt;
  return code;
}

absl::Status DriverError(int cuda_error, absl::string_view call,
                         absl::string_view detail) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  switch (cuda_error) {
    case cu::kSuccess:
      return absl::OkStatus();
    case cu::kErrorOutOfMemory:
      code = absl::StatusCode::kResourceExhausted;
      break;
    case cu::kErrorInvalidValue:
    case cu::kErrorInvalidHandle:
    case cu::kErrorInvalidDevice:
    case cu::kErrorNotMapped:
    case cu::kErrorHostMemoryAlreadyRegistered:
    case cu::kErrorHostMemoryNotRegistered:
      code = absl::StatusCode::kInvalidArgument;
      break;
    case cu::kErrorInvalidContext:
    case cu::kErrorContextIsDestroyed:
    case cu::kErrorPrimaryContextActive:
      code = absl::StatusCode::kFailedPrecondition;
      break;
    case cu::kErrorNotInitialized:
    case cu::kErrorDeinitialized:
    case cu::kErrorStubLibrary:
    case cu::kErrorNoDevice:
    case cu::kErrorNotReady:
    case cu::kErrorSystemNotReady:
    case cu::kErrorSystemDriverMismatch:
      code = absl::StatusCode::kUnavailable;
      break;
    case cu::kErrorNotSupported:
      code = absl::StatusCode::kUnimplemented;
      break;
    default:
      break;
  }
  std::string message =
      absl::StrCat(call, ": ", CudaErrorName(cuda_error), " (", cuda_error, ")",
                   detail.empty() ? "" : ": ", detail);
  absl::Status status(code, message);
  status.SetPayload(kDriverErrorPayloadUrl,
                    absl::Cord(absl::StrCat(cuda_error)));
  return status;
}

}  // namespace ctxpool
