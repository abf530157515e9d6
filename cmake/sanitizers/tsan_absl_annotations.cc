// cmake/sanitizers/tsan_absl_annotations.cc — teaches ThreadSanitizer about
// Abseil's synchronization primitives when Abseil itself is not instrumented.
//
// Debian's libabsl is built without -fsanitize=thread. absl::Mutex takes and
// releases its lock inside libabsl_synchronization.so with atomics and futex
// calls that TSan never sees, so every access guarded by an absl::Mutex is
// reported as a data race. An Abseil built with TSan annotates each lock
// operation itself (ABSL_TSAN_MUTEX_PRE_LOCK & co in mutex.cc); this file
// adds exactly those annotations from outside.
//
// How: the TSan build links with `-Wl,--wrap=<symbol>` for each entry point
// below (cmake/CtxpoolWarnings.cmake generates the list), so a call to
// absl::Mutex::Lock from ctxpool code lands in the wrapper here, which tells
// TSan "about to lock" / "locked" around the real call (`__real_<symbol>`):
//
//   ctxpool code: mu.Lock()  -->  __wrap_Mutex::Lock   (this file)
//                                   __tsan_mutex_pre_lock(&mu)
//                                   __real_Mutex::Lock  (libabsl)
//                                   __tsan_mutex_post_lock(&mu)
//
// Calls Abseil makes to itself inside the shared library are not wrapped;
// ctxpool only relies on the public entry points listed here.
//
// Only compiled into TSan builds (CTXPOOL_SANITIZE=thread). The symbol names
// are built from Abseil's inline namespace, passed in as
// CTXPOOL_ABSL_NS_MANGLED (e.g. "7debian3" or "12lts_20220623").
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>

#include "absl/synchronization/barrier.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

#ifndef CTXPOOL_ABSL_NS_MANGLED
#error "CTXPOOL_ABSL_NS_MANGLED must name Abseil's mangled inline namespace"
#endif

// "_ZN4absl7debian35Mutex4LockEv" from ("N", "5Mutex4LockEv"); "NK" for const
// member functions.
#define CTXPOOL_ABSL_SYMBOL(n, rest) "_Z" n "4absl" CTXPOOL_ABSL_NS_MANGLED rest
#define CTXPOOL_WRAP(n, rest) __asm__("__wrap_" CTXPOOL_ABSL_SYMBOL(n, rest))
#define CTXPOOL_REAL(n, rest) __asm__("__real_" CTXPOOL_ABSL_SYMBOL(n, rest))

namespace ctxpool_tsan {
namespace {

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// The one data member of absl::Mutex is `std::atomic<intptr_t> mu_`; bit
// kMuWriter (0x0008) is set while a writer holds the lock. Await and
// CondVar::Wait may be called with a reader lock, and TSan must be told
// which kind is released and re-taken.
static_assert(sizeof(Mutex) == sizeof(std::atomic<std::intptr_t>),
              "absl::Mutex layout changed; update the TSan annotations");
constexpr std::intptr_t kMuWriter = 0x0008;

unsigned HeldFlags(const Mutex* mu) {
  const auto* word = reinterpret_cast<const std::atomic<std::intptr_t>*>(mu);
  return (word->load(std::memory_order_relaxed) & kMuWriter)
             ? 0u
             : static_cast<unsigned>(__tsan_mutex_read_lock);
}

void PreLock(const Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_lock(const_cast<Mutex*>(mu), flags);
}
void PostLock(const Mutex* mu, unsigned flags) {
  __tsan_mutex_post_lock(const_cast<Mutex*>(mu), flags, 0);
}
void PreUnlock(const Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_unlock(const_cast<Mutex*>(mu), flags);
}
void PostUnlock(const Mutex* mu, unsigned flags) {
  __tsan_mutex_post_unlock(const_cast<Mutex*>(mu), flags);
}
// For calls that release the lock, block, and take it again.
void PreRelock(const Mutex* mu, unsigned flags) {
  PreUnlock(mu, flags);
  PostUnlock(mu, flags);
  PreLock(mu, flags);
}

// absl::Notification is `Mutex mutex_; std::atomic<bool> notified_yet_;`.
// HasBeenNotified() is an inline (instrumented) acquire load of
// notified_yet_, so Notify releases on that address.
static_assert(sizeof(absl::Notification) == 2 * sizeof(Mutex),
              "absl::Notification layout changed; update the annotations");
void* NotifiedFlag(const absl::Notification* n) {
  return const_cast<char*>(reinterpret_cast<const char*>(n) + sizeof(Mutex));
}

}  // namespace

// The link names this symbol (--undefined) so the archive member holding the
// wrappers is always linked.
extern "C" const int ctxpool_tsan_absl_annotations_linked = 1;

// ---- declarations of the real functions (in libabsl) ----------------------
extern "C" {
void RealLock(Mutex*) CTXPOOL_REAL("N", "5Mutex4LockEv");
void RealReaderLock(Mutex*) CTXPOOL_REAL("N", "5Mutex10ReaderLockEv");
bool RealTryLock(Mutex*) CTXPOOL_REAL("N", "5Mutex7TryLockEv");
bool RealReaderTryLock(Mutex*) CTXPOOL_REAL("N", "5Mutex13ReaderTryLockEv");
void RealUnlock(Mutex*) CTXPOOL_REAL("N", "5Mutex6UnlockEv");
void RealReaderUnlock(Mutex*) CTXPOOL_REAL("N", "5Mutex12ReaderUnlockEv");
void RealLockWhen(Mutex*, const Condition&)
    CTXPOOL_REAL("N", "5Mutex8LockWhenERKNS0_9ConditionE");
void RealReaderLockWhen(Mutex*, const Condition&)
    CTXPOOL_REAL("N", "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
bool RealLockWhenWithTimeout(Mutex*, const Condition&, Duration)
    CTXPOOL_REAL("N",
                 "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool RealLockWhenWithDeadline(Mutex*, const Condition&, Time)
    CTXPOOL_REAL("N",
                 "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
bool RealReaderLockWhenWithTimeout(Mutex*, const Condition&, Duration)
    CTXPOOL_REAL(
        "N",
        "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool RealReaderLockWhenWithDeadline(Mutex*, const Condition&, Time)
    CTXPOOL_REAL(
        "N", "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
void RealAwait(Mutex*, const Condition&)
    CTXPOOL_REAL("N", "5Mutex5AwaitERKNS0_9ConditionE");
bool RealAwaitWithTimeout(Mutex*, const Condition&, Duration)
    CTXPOOL_REAL("N",
                 "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool RealAwaitWithDeadline(Mutex*, const Condition&, Time)
    CTXPOOL_REAL("N", "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
void RealMutexDtor1(Mutex*) CTXPOOL_REAL("N", "5MutexD1Ev");
void RealMutexDtor2(Mutex*) CTXPOOL_REAL("N", "5MutexD2Ev");
void RealReleasableRelease(absl::ReleasableMutexLock*)
    CTXPOOL_REAL("N", "19ReleasableMutexLock7ReleaseEv");
void RealCondVarWait(absl::CondVar*, Mutex*)
    CTXPOOL_REAL("N", "7CondVar4WaitEPNS0_5MutexE");
bool RealCondVarWaitWithTimeout(absl::CondVar*, Mutex*, Duration)
    CTXPOOL_REAL("N", "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
bool RealCondVarWaitWithDeadline(absl::CondVar*, Mutex*, Time)
    CTXPOOL_REAL("N", "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
void RealNotify(absl::Notification*)
    CTXPOOL_REAL("N", "12Notification6NotifyEv");
void RealWaitForNotification(const absl::Notification*)
    CTXPOOL_REAL("NK", "12Notification19WaitForNotificationEv");
bool RealWaitForNotificationWithTimeout(const absl::Notification*, Duration)
    CTXPOOL_REAL("NK",
                 "12Notification30WaitForNotificationWithTimeoutENS0_"
                 "8DurationE");
bool RealWaitForNotificationWithDeadline(const absl::Notification*, Time)
    CTXPOOL_REAL("NK",
                 "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
bool RealBlockingCounterDecrement(absl::BlockingCounter*)
    CTXPOOL_REAL("N", "15BlockingCounter14DecrementCountEv");
void RealBlockingCounterWait(absl::BlockingCounter*)
    CTXPOOL_REAL("N", "15BlockingCounter4WaitEv");
bool RealBarrierBlock(absl::Barrier*) CTXPOOL_REAL("N", "7Barrier5BlockEv");
}  // extern "C"

// ---- the wrappers ----------------------------------------------------------
extern "C" {

void WrapLock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex4LockEv");
void WrapLock(Mutex* mu) {
  PreLock(mu, 0);
  RealLock(mu);
  PostLock(mu, 0);
}

void WrapReaderLock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex10ReaderLockEv");
void WrapReaderLock(Mutex* mu) {
  PreLock(mu, __tsan_mutex_read_lock);
  RealReaderLock(mu);
  PostLock(mu, __tsan_mutex_read_lock);
}

bool WrapTryLock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex7TryLockEv");
bool WrapTryLock(Mutex* mu) {
  PreLock(mu, __tsan_mutex_try_lock);
  const bool locked = RealTryLock(mu);
  PostLock(mu, __tsan_mutex_try_lock |
                   (locked ? 0u : unsigned{__tsan_mutex_try_lock_failed}));
  return locked;
}

bool WrapReaderTryLock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex13ReaderTryLockEv");
bool WrapReaderTryLock(Mutex* mu) {
  const unsigned flags = __tsan_mutex_read_lock | __tsan_mutex_try_lock;
  PreLock(mu, flags);
  const bool locked = RealReaderTryLock(mu);
  PostLock(mu, flags | (locked ? 0u : unsigned{__tsan_mutex_try_lock_failed}));
  return locked;
}

void WrapUnlock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex6UnlockEv");
void WrapUnlock(Mutex* mu) {
  PreUnlock(mu, 0);
  RealUnlock(mu);
  PostUnlock(mu, 0);
}

void WrapReaderUnlock(Mutex* mu) CTXPOOL_WRAP("N", "5Mutex12ReaderUnlockEv");
void WrapReaderUnlock(Mutex* mu) {
  PreUnlock(mu, __tsan_mutex_read_lock);
  RealReaderUnlock(mu);
  PostUnlock(mu, __tsan_mutex_read_lock);
}

void WrapLockWhen(Mutex* mu, const Condition& c)
    CTXPOOL_WRAP("N", "5Mutex8LockWhenERKNS0_9ConditionE");
void WrapLockWhen(Mutex* mu, const Condition& c) {
  PreLock(mu, 0);
  RealLockWhen(mu, c);
  PostLock(mu, 0);
}

void WrapReaderLockWhen(Mutex* mu, const Condition& c)
    CTXPOOL_WRAP("N", "5Mutex14ReaderLockWhenERKNS0_9ConditionE");
void WrapReaderLockWhen(Mutex* mu, const Condition& c) {
  PreLock(mu, __tsan_mutex_read_lock);
  RealReaderLockWhen(mu, c);
  PostLock(mu, __tsan_mutex_read_lock);
}

// The *WithTimeout/*WithDeadline lock calls return with the lock held
// whatever they return.
bool WrapLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d)
    CTXPOOL_WRAP("N",
                 "5Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool WrapLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d) {
  PreLock(mu, 0);
  const bool r = RealLockWhenWithTimeout(mu, c, d);
  PostLock(mu, 0);
  return r;
}

bool WrapLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t)
    CTXPOOL_WRAP("N",
                 "5Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
bool WrapLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t) {
  PreLock(mu, 0);
  const bool r = RealLockWhenWithDeadline(mu, c, t);
  PostLock(mu, 0);
  return r;
}

bool WrapReaderLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d)
    CTXPOOL_WRAP(
        "N",
        "5Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool WrapReaderLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d) {
  PreLock(mu, __tsan_mutex_read_lock);
  const bool r = RealReaderLockWhenWithTimeout(mu, c, d);
  PostLock(mu, __tsan_mutex_read_lock);
  return r;
}

bool WrapReaderLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t)
    CTXPOOL_WRAP(
        "N", "5Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
bool WrapReaderLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t) {
  PreLock(mu, __tsan_mutex_read_lock);
  const bool r = RealReaderLockWhenWithDeadline(mu, c, t);
  PostLock(mu, __tsan_mutex_read_lock);
  return r;
}

void WrapAwait(Mutex* mu, const Condition& c)
    CTXPOOL_WRAP("N", "5Mutex5AwaitERKNS0_9ConditionE");
void WrapAwait(Mutex* mu, const Condition& c) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  RealAwait(mu, c);
  PostLock(mu, flags);
}

bool WrapAwaitWithTimeout(Mutex* mu, const Condition& c, Duration d)
    CTXPOOL_WRAP("N",
                 "5Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
bool WrapAwaitWithTimeout(Mutex* mu, const Condition& c, Duration d) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  const bool r = RealAwaitWithTimeout(mu, c, d);
  PostLock(mu, flags);
  return r;
}

bool WrapAwaitWithDeadline(Mutex* mu, const Condition& c, Time t)
    CTXPOOL_WRAP("N", "5Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
bool WrapAwaitWithDeadline(Mutex* mu, const Condition& c, Time t) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  const bool r = RealAwaitWithDeadline(mu, c, t);
  PostLock(mu, flags);
  return r;
}

void WrapMutexDtor1(Mutex* mu) CTXPOOL_WRAP("N", "5MutexD1Ev");
void WrapMutexDtor1(Mutex* mu) {
  __tsan_mutex_destroy(mu, __tsan_mutex_not_static);
  RealMutexDtor1(mu);
}

void WrapMutexDtor2(Mutex* mu) CTXPOOL_WRAP("N", "5MutexD2Ev");
void WrapMutexDtor2(Mutex* mu) {
  __tsan_mutex_destroy(mu, __tsan_mutex_not_static);
  RealMutexDtor2(mu);
}

// ReleasableMutexLock is `Mutex* mu_;`; Release() unlocks it (out of line).
void WrapReleasableRelease(absl::ReleasableMutexLock* l)
    CTXPOOL_WRAP("N", "19ReleasableMutexLock7ReleaseEv");
void WrapReleasableRelease(absl::ReleasableMutexLock* l) {
  static_assert(sizeof(absl::ReleasableMutexLock) == sizeof(Mutex*));
  Mutex* mu = *reinterpret_cast<Mutex**>(l);
  PreUnlock(mu, 0);
  RealReleasableRelease(l);
  PostUnlock(mu, 0);
}

void WrapCondVarWait(absl::CondVar* cv, Mutex* mu)
    CTXPOOL_WRAP("N", "7CondVar4WaitEPNS0_5MutexE");
void WrapCondVarWait(absl::CondVar* cv, Mutex* mu) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  RealCondVarWait(cv, mu);
  PostLock(mu, flags);
}

bool WrapCondVarWaitWithTimeout(absl::CondVar* cv, Mutex* mu, Duration d)
    CTXPOOL_WRAP("N", "7CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
bool WrapCondVarWaitWithTimeout(absl::CondVar* cv, Mutex* mu, Duration d) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  const bool r = RealCondVarWaitWithTimeout(cv, mu, d);
  PostLock(mu, flags);
  return r;
}

bool WrapCondVarWaitWithDeadline(absl::CondVar* cv, Mutex* mu, Time t)
    CTXPOOL_WRAP("N", "7CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
bool WrapCondVarWaitWithDeadline(absl::CondVar* cv, Mutex* mu, Time t) {
  const unsigned flags = HeldFlags(mu);
  PreRelock(mu, flags);
  const bool r = RealCondVarWaitWithDeadline(cv, mu, t);
  PostLock(mu, flags);
  return r;
}

void WrapNotify(absl::Notification* n)
    CTXPOOL_WRAP("N", "12Notification6NotifyEv");
void WrapNotify(absl::Notification* n) {
  __tsan_release(NotifiedFlag(n));
  RealNotify(n);
}

void WrapWaitForNotification(const absl::Notification* n)
    CTXPOOL_WRAP("NK", "12Notification19WaitForNotificationEv");
void WrapWaitForNotification(const absl::Notification* n) {
  RealWaitForNotification(n);
  __tsan_acquire(NotifiedFlag(n));
}

bool WrapWaitForNotificationWithTimeout(const absl::Notification* n, Duration d)
    CTXPOOL_WRAP("NK",
                 "12Notification30WaitForNotificationWithTimeoutENS0_"
                 "8DurationE");
bool WrapWaitForNotificationWithTimeout(const absl::Notification* n,
                                        Duration d) {
  const bool r = RealWaitForNotificationWithTimeout(n, d);
  if (r) __tsan_acquire(NotifiedFlag(n));
  return r;
}

bool WrapWaitForNotificationWithDeadline(const absl::Notification* n, Time t)
    CTXPOOL_WRAP("NK",
                 "12Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
bool WrapWaitForNotificationWithDeadline(const absl::Notification* n, Time t) {
  const bool r = RealWaitForNotificationWithDeadline(n, t);
  if (r) __tsan_acquire(NotifiedFlag(n));
  return r;
}

bool WrapBlockingCounterDecrement(absl::BlockingCounter* c)
    CTXPOOL_WRAP("N", "15BlockingCounter14DecrementCountEv");
bool WrapBlockingCounterDecrement(absl::BlockingCounter* c) {
  __tsan_release(c);
  return RealBlockingCounterDecrement(c);
}

void WrapBlockingCounterWait(absl::BlockingCounter* c)
    CTXPOOL_WRAP("N", "15BlockingCounter4WaitEv");
void WrapBlockingCounterWait(absl::BlockingCounter* c) {
  RealBlockingCounterWait(c);
  __tsan_acquire(c);
}

bool WrapBarrierBlock(absl::Barrier* b) CTXPOOL_WRAP("N", "7Barrier5BlockEv");
bool WrapBarrierBlock(absl::Barrier* b) {
  __tsan_release(b);
  const bool r = RealBarrierBlock(b);
  __tsan_acquire(b);
  return r;
}

}  // extern "C"
}  // namespace ctxpool_tsan
