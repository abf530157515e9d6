// Stand-in for PyTorch's c10/util/Exception.h: the error types and check
// macros ctxpool_torch_allocator.h uses. See ../../README.md.
#ifndef CTXPOOL_FAKE_TORCH_C10_UTIL_EXCEPTION_H_
#define CTXPOOL_FAKE_TORCH_C10_UTIL_EXCEPTION_H_

#include <exception>
#include <sstream>
#include <string>
#include <utility>

namespace c10 {

class Error : public std::exception {
 public:
  explicit Error(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

namespace fake_detail {
template <typename... Args>
std::string Str(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace fake_detail

}  // namespace c10

// As in PyTorch: the first argument names a c10 error type.
#define TORCH_CHECK_WITH(error_t, cond, ...)                      \
  do {                                                            \
    if (!(cond)) {                                                \
      throw ::c10::error_t(::c10::fake_detail::Str(__VA_ARGS__)); \
    }                                                             \
  } while (false)
#define TORCH_CHECK(cond, ...) TORCH_CHECK_WITH(Error, cond, __VA_ARGS__)

#endif  // CTXPOOL_FAKE_TORCH_C10_UTIL_EXCEPTION_H_
