// Tests of ctxpool/interop/cub.h on SimDriver, with algorithms that behave
// as CUB's device algorithms do (a size query with a null buffer, then the
// run, each returning a cudaError_t-like code).
#include <cstdint>
#include <memory>
#include <utility>

#include "ctxpool/interop/cub.h"
#include "gtest/gtest.h"
#include "interop/interop_fixture.h"

namespace ctxpool::interop {
namespace {

constexpr std::size_t kMiB = kInteropMiB;

// cudaError_t's shape: an unscoped enum whose zero is success.
enum FakeCudaError { kFakeSuccess = 0, kFakeInvalidValue = 1 };

// A CUB-like algorithm needing `need` bytes of temporary storage; the run
// "launches" a kernel over the buffer (a SimDriver Touch on the stream).
struct FakeAlgorithm {
  SimDriver* sim;
  StreamHandle stream;
  std::size_t need;
  FakeCudaError query_result = kFakeSuccess;
  FakeCudaError run_result = kFakeSuccess;
  int queries = 0;
  int runs = 0;
  void* last_temp = nullptr;
  std::size_t last_bytes = 0;

  FakeCudaError operator()(void* temp, std::size_t& bytes) {
    if (temp == nullptr) {
      ++queries;
      bytes = need;
      return query_result;
    }
    ++runs;
    last_temp = temp;
    last_bytes = bytes;
    EXPECT_GE(bytes, need);
    if (need > 0) {
      EXPECT_TRUE(sim->Touch(stream, DevicePtr::From(temp), need).ok());
    }
    return run_result;
  }
};

class InteropCubTest : public InteropFixture {
 protected:
  StreamHandle s() const { return s0(); }
};

TEST_F(InteropCubTest, RunsBothPhasesAndFreesTheTempStorage) {
  FakeAlgorithm algo{sim_.get(), s(), 12345};
  ASSERT_TRUE(RunWithTempStorage(MemoryRef(*bert_), s(), algo).ok());
  EXPECT_EQ(algo.queries, 1);
  EXPECT_EQ(algo.runs, 1);
  EXPECT_NE(algo.last_temp, nullptr);
  EXPECT_EQ(algo.last_bytes, 12345u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(algo.last_temp) % 256, 0u);
  EXPECT_EQ(Live(), 0);
  EXPECT_EQ(bert_->Stats().num_allocs, 1);  // charged to the model
}

TEST_F(InteropCubTest, TempStorageIsFreedInStreamOrder) {
  // The kernel is still pending when the temp storage is freed; the next
  // user of the block on the same stream comes after it, so no race.
  sim_->Hold(s());
  FakeAlgorithm algo{sim_.get(), s(), 1 * kMiB};
  ASSERT_TRUE(RunWithTempStorage(MemoryRef(*bert_), s(), algo).ok());
  FakeAlgorithm again{sim_.get(), s(), 1 * kMiB};
  ASSERT_TRUE(RunWithTempStorage(MemoryRef(*bert_), s(), again).ok());
  EXPECT_EQ(again.last_temp, algo.last_temp);  // reused, stream-ordered
  sim_->Release(s());
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCubTest, ZeroBytesStillGetsARealBuffer) {
  FakeAlgorithm algo{sim_.get(), s(), 0};
  ASSERT_TRUE(RunWithTempStorage(MemoryRef(*bert_), s(), algo).ok());
  EXPECT_EQ(algo.runs, 1);  // a null buffer would have been another query
  EXPECT_NE(algo.last_temp, nullptr);
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCubTest, AlgorithmErrorsAreReturnedAndNothingLeaks) {
  FakeAlgorithm bad_query{sim_.get(), s(), 4096, kFakeInvalidValue};
  absl::Status st = RunWithTempStorage(MemoryRef(*bert_), s(), bad_query);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("size query"), absl::string_view::npos) << st;
  EXPECT_EQ(bad_query.runs, 0);
  EXPECT_EQ(bert_->Stats().num_allocs, 0);

  FakeAlgorithm bad_run{sim_.get(), s(), 4096, kFakeSuccess, kFakeInvalidValue};
  st = RunWithTempStorage(MemoryRef(*bert_), s(), bad_run);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("run"), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("cudaError_t 1"), absl::string_view::npos) << st;
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCubTest, OverTheBudgetTheAlgorithmDoesNotRun) {
  FakeAlgorithm huge{sim_.get(), s(), 9 * kMiB};
  absl::Status st = RunWithTempStorage(MemoryRef(*bert_), s(), huge);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("bert"), absl::string_view::npos) << st;
  EXPECT_EQ(huge.runs, 0);
  EXPECT_EQ(Live(), 0);
}

TEST_F(InteropCubTest, KeptStorageGrowsOnlyWhenACallNeedsMore) {
  const std::int64_t before = bert_->Stats().num_allocs;
  {
    CubTempStorage temp(MemoryRef(*bert_), s());
    EXPECT_EQ(temp.capacity(), 0u);
    for (std::size_t need : {1000u, 500u, 1000u, 2000u, 10u}) {
      FakeAlgorithm algo{sim_.get(), s(), need};
      ASSERT_TRUE(temp.Run(algo).ok());
      EXPECT_EQ(algo.last_bytes, temp.capacity());
    }
    EXPECT_EQ(temp.capacity(), 2000u);
    EXPECT_EQ(bert_->Stats().num_allocs - before, 2);  // 1000, then 2000
    EXPECT_EQ(bert_->Stats().live_allocations, 1);
  }
  EXPECT_EQ(Live(), 0);
}

// Growth frees the old buffer first: old and new need not fit the model's
// 8 MiB together.
TEST_F(InteropCubTest, GrowthUnderTheBudgetNeedsOnlyTheNewSize) {
  CubTempStorage temp(MemoryRef(*bert_), s());
  FakeAlgorithm five{sim_.get(), s(), 5 * kMiB};
  ASSERT_TRUE(temp.Run(five).ok());
  FakeAlgorithm six{sim_.get(), s(), 6 * kMiB};
  absl::Status st = temp.Run(six);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(temp.capacity(), 6 * kMiB);
  EXPECT_EQ(bert_->Stats().num_budget_rejections, 0);
  FakeAlgorithm nine{sim_.get(), s(), 9 * kMiB};
  EXPECT_EQ(temp.Run(nine).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(temp.capacity(), 0u);  // consistent: empty, nothing live
  EXPECT_EQ(Live(), 0);
  ASSERT_TRUE(temp.Run(five).ok());  // and usable again
}

TEST_F(InteropCubTest, IntegralResultTypesWork) {
  int calls = 0;
  auto algo = [&](void* temp, std::size_t& bytes) -> int {
    ++calls;
    if (temp == nullptr) bytes = 64;
    return 0;
  };
  EXPECT_TRUE(RunWithTempStorage(MemoryRef(alloc()), s(), algo).ok());
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(Live(), 0);
}

}  // namespace
}  // namespace ctxpool::interop
