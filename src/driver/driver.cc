#include "ctxpool/driver/driver.h"

namespace ctxpool {

ScopedContext::ScopedContext(Driver& driver, ContextHandle ctx)
    : driver_(driver) {
  absl::StatusOr<ContextHandle> current = driver_.CtxGetCurrent();
  if (!current.ok()) {
    status_ = current.status();
    return;
  }
  if (*current == ctx) return;
  previous_ = *current;
  status_ = driver_.CtxSetCurrent(ctx);
  restore_ = status_.ok();
}

ScopedContext::~ScopedContext() {
  if (restore_) driver_.CtxSetCurrent(previous_).IgnoreError();
}

}  // namespace ctxpool
