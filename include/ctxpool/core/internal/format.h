// ctxpool/core/internal/format.h — absl::StrFormat and StrAppendFormat for
// paths that must let a std::bad_alloc unwind. Not API.
//
// absl::StrFormat writes through a buffer that flushes into the result in its
// destructor. When that flush grows the string and host memory runs out, the
// std::bad_alloc leaves a destructor and the process terminates, even where
// every caller would catch it. Format formats into a stack buffer with
// absl::SNPrintF, which allocates nothing, and makes the string afterwards,
// in code that unwinds; a longer text is formatted again into a string of
// its exact size. The format is checked at compile time as StrFormat's is.
//
//   return absl::InvalidArgumentError(
//       core_internal::Format("Deallocate(0x%x): not live", ptr.address()));
#ifndef CTXPOOL_CORE_INTERNAL_FORMAT_H_
#define CTXPOOL_CORE_INTERNAL_FORMAT_H_

#include <cstddef>
#include <string>

#include "absl/strings/str_format.h"

namespace ctxpool {
namespace core_internal {

template <typename... Args>
std::string Format(const absl::FormatSpec<Args...>& format,
                   const Args&... args) {
  char buf[512];
  const int n = absl::SNPrintF(buf, sizeof(buf), format, args...);
  if (n < 0) return std::string();
  if (static_cast<std::size_t>(n) < sizeof(buf)) {
    return std::string(buf, static_cast<std::size_t>(n));
  }
  std::string out(static_cast<std::size_t>(n), '\0');
  absl::SNPrintF(out.data(), out.size() + 1, format, args...);
  return out;
}

// Format's answer appended to *out (for absl::StrAppendFormat).
template <typename... Args>
void AppendFormat(std::string* out, const absl::FormatSpec<Args...>& format,
                  const Args&... args) {
  out->append(Format(format, args...));
}

}  // namespace core_internal
}  // namespace ctxpool

#endif  // CTXPOOL_CORE_INTERNAL_FORMAT_H_
