// tests/heap_counter.h — counts the calling thread's heap allocations, to
// prove a cached path does not allocate.
//
// Replaces the global operator new / delete of the test executable (a
// dlopened library's operator new resolves to it too), so include it from
// exactly ONE translation unit per test binary. TSan's runtime defines
// operator new itself: there CTXPOOL_TEST_TSAN is defined, nothing is
// replaced and the tests that count skip.
//
//   g_allocations = 0;
//   g_count_allocations = true;
//   ... the path under test ...
//   g_count_allocations = false;
//   EXPECT_EQ(g_allocations, 0);
#ifndef CTXPOOL_TESTS_HEAP_COUNTER_H_
#define CTXPOOL_TESTS_HEAP_COUNTER_H_

#include <cstdint>
#include <cstdlib>
#include <new>

#include "ctxpool/driver/sim_driver.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CTXPOOL_TEST_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define CTXPOOL_TEST_TSAN 1
#endif

namespace {
thread_local bool g_count_allocations = false;
thread_local std::int64_t g_allocations = 0;
// While set, operator new of this thread throws std::bad_alloc (host memory
// running out in the middle of a call).
thread_local bool g_fail_allocations = false;
// When >= 0: this thread's operator new succeeds that many more times, then
// throws std::bad_alloc once and the countdown stops (-1). A sweep over it
// fails each allocation of a call in turn. Allocations inside SimDriver
// calls are neither counted nor failed.
thread_local std::int64_t g_fail_after = -1;
inline bool FailThisAllocation() {
  if (g_fail_allocations) return true;
  // The simulated driver's own bookkeeping is not the allocator's.
  if (g_fail_after < 0 || ctxpool::SimDriver::InCall()) return false;
  if (g_fail_after-- > 0) return false;
  return true;  // the countdown is now -1
}
}  // namespace

#ifndef CTXPOOL_TEST_TSAN
void* operator new(std::size_t n) {
  if (FailThisAllocation()) throw std::bad_alloc();
  if (g_count_allocations) ++g_allocations;
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
// GCC sees free() of a pointer that came from operator new; here that is
// right, since this operator new takes its memory from malloc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
// Over-aligned types (alignas(64) state) come through these.
void* operator new(std::size_t n, std::align_val_t al) {
  if (FailThisAllocation()) throw std::bad_alloc();
  if (g_count_allocations) ++g_allocations;
  const std::size_t a = static_cast<std::size_t>(al);
  void* p = std::aligned_alloc(a, ((n == 0 ? 1 : n) + a - 1) / a * a);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

#endif  // CTXPOOL_TESTS_HEAP_COUNTER_H_
