// tests/interop/interop_fixture.h — the interop tests' fixture: a simulated
// device, its DeviceContext and one model session "bert" (two streams, an
// 8 MiB max), the context current on the test's thread (SimDriver's Touch
// needs it). TearDown closes the session (no leak allowed), checks the
// allocator's invariants, and fails on any misuse or race the simulated
// driver saw.
#ifndef CTXPOOL_TESTS_INTEROP_INTEROP_FIXTURE_H_
#define CTXPOOL_TESTS_INTEROP_INTEROP_FIXTURE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"

namespace ctxpool::interop {

inline constexpr std::size_t kInteropMiB = std::size_t{1} << 20;

class InteropFixture : public ::testing::Test {
 protected:
  void SetUp() override { Init("h100-80gb"); }
  // A fresh device of `spec` (a SimDriver preset or capacity).
  void Init(const std::string& spec) {
    bert_.reset();
    dc_.reset();
    sim_ = std::move(SimDriver::CreateFromSpec("sim:" + spec)).value();
    DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    dc_ = std::move(DeviceContext::Create(*sim_, 0, o)).value();
    bert_ = std::move(dc_->OpenSession(
                          "bert", {.streams = 2, .max_bytes = 8 * kInteropMiB}))
                .value();
    ASSERT_TRUE(sim_->CtxSetCurrent(dc_->context()).ok());
  }
  void TearDown() override {
    if (bert_ != nullptr) {
      EXPECT_TRUE(bert_->Close().ok());
    }
    bert_.reset();
    EXPECT_TRUE(alloc().CheckInvariants().ok());
    dc_.reset();
    EXPECT_EQ(sim_->misuse_count(), 0u)
        << (sim_->misuse_count() ? sim_->misuse_log().front() : "");
    EXPECT_EQ(sim_->race_count(), 0u)
        << (sim_->race_count() ? sim_->Races().front().description : "");
    EXPECT_EQ(sim_->used_bytes(0), 0u);
  }

  CachingDeviceAllocator& alloc() { return dc_->device_allocator(); }
  // The device allocator's live bytes and its allocations so far.
  std::int64_t Live() {
    return alloc().Stats().total.allocated_bytes[kAggregate()].current;
  }
  std::int64_t Allocs() {
    return alloc().Stats().total.allocation[kAggregate()].allocated;
  }
  StreamHandle s0() const { return bert_->stream(0); }
  StreamHandle s1() const { return bert_->stream(1); }

  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<DeviceContext> dc_;
  std::unique_ptr<ModelSession> bert_;

 private:
  static constexpr int kAggregate() {
    return static_cast<int>(StatPool::kAggregate);
  }
};

}  // namespace ctxpool::interop

#endif  // CTXPOOL_TESTS_INTEROP_INTEROP_FIXTURE_H_
