// ctxpool/status.h — Status helpers shared by every layer.
//
// ctxpool reports every failure as an `absl::Status` (or `absl::StatusOr<T>`)
// with a canonical code: RESOURCE_EXHAUSTED for out-of-memory and exhausted
// budgets, INVALID_ARGUMENT for bad pointers and sizes, FAILED_PRECONDITION for
// misuse of state (a forked child, a Reset with live blocks), UNAVAILABLE when
// there is no GPU or driver, INTERNAL for anything the driver reports that has
// no better mapping. No ctxpool function throws.
//
// When a failure comes from the CUDA driver (real or simulated), the driver's
// own error number (the CUresult value) rides along as a payload, so callers
// and tests can assert the exact CUDA error independent of the message:
//
//   absl::StatusOr<DevicePtr> p = driver.MemAlloc(1 << 40);
//   if (DriverErrorCode(p.status()) == cu::kErrorOutOfMemory) { ... }
//
// The Abseil release ctxpool builds against (20220623) has no status macros,
// so this header defines CTXPOOL_RETURN_IF_ERROR and CTXPOOL_ASSIGN_OR_RETURN.
#ifndef CTXPOOL_STATUS_H_
#define CTXPOOL_STATUS_H_

#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ctxpool {

// Payload type URL under which a driver error number is attached.
inline constexpr absl::string_view kDriverErrorPayloadUrl =
    "type.ctxpool.dev/cuda-error";

// Returns the CUresult attached to `status` by a Driver, or std::nullopt when
// the status is OK or did not come from a driver call.
std::optional<int> DriverErrorCode(const absl::Status& status);

// Builds the Status a Driver returns for a failed call: the canonical code is
// derived from the CUresult (OUT_OF_MEMORY -> RESOURCE_EXHAUSTED, INVALID_VALUE
// and INVALID_HANDLE -> INVALID_ARGUMENT, NO_DEVICE / NOT_INITIALIZED / stub
// library -> UNAVAILABLE, NOT_READY -> UNAVAILABLE, anything else -> INTERNAL);
// the message reads "<call>: CUDA_ERROR_<NAME> (<code>)[: detail]"; the code
// is attached as the payload that DriverErrorCode() reads.
absl::Status DriverError(int cuda_error, absl::string_view call,
                         absl::string_view detail = {});

namespace status_internal {
inline const absl::Status& AsStatus(const absl::Status& s) { return s; }
template <typename T>
inline const absl::Status& AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace status_internal

}  // namespace ctxpool

#define CTXPOOL_STATUS_CONCAT_INNER_(a, b) a##b
#define CTXPOOL_STATUS_CONCAT_(a, b) CTXPOOL_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status or absl::StatusOr<T>) and returns its
// status from the enclosing function when it is not OK.
#define CTXPOOL_RETURN_IF_ERROR(expr)                                  \
  do {                                                                 \
    const auto& ctxpool_status_ = (expr);                              \
    if (!::ctxpool::status_internal::AsStatus(ctxpool_status_).ok()) { \
      return ::ctxpool::status_internal::AsStatus(ctxpool_status_);    \
    }                                                                  \
  } while (false)

// CTXPOOL_ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>);
// on error returns its status, otherwise moves the value into `lhs`, which may
// be a declaration (`auto x`) or an existing lvalue.
#define CTXPOOL_ASSIGN_OR_RETURN(lhs, expr) \
  CTXPOOL_ASSIGN_OR_RETURN_IMPL_(           \
      CTXPOOL_STATUS_CONCAT_(ctxpool_statusor_, __LINE__), lhs, expr)

#define CTXPOOL_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

#endif  // CTXPOOL_STATUS_H_
