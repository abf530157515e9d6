// Builds ctxpool_torch_allocator.h against the stand-in PyTorch API in
// fake_torch/ and drives the allocator it installs on the simulated GPU:
// the hooks reach ctxpool, out-of-memory becomes c10::OutOfMemoryError with
// ctxpool's report, other failures c10::Error, and ScopedModel charges the
// right model. Built twice (device parameter `int` and c10::DeviceIndex);
// see tests/torch_plugin.cmake.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "ctxpool_torch_allocator.h"
#include "gtest/gtest.h"

namespace {

namespace pa = torch::cuda::CUDAPluggableAllocator;
using AllocatorPtr =
    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>;

constexpr std::size_t kMiB = std::size_t{1} << 20;

// The integer value of "key" in ctxpool_memory_stats(0); -1 if absent.
long long Stat(const std::string& key) {
  const std::string json = ctxpool_memory_stats(0);
  const std::size_t at = json.find("\"" + key + "\":");
  return at == std::string::npos
             ? -1
             : std::atoll(json.c_str() + at + key.size() + 3);
}

class TorchAllocatorHeaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    setenv("CTXPOOL_DRIVER", "sim:2xa10-24gb", /*overwrite=*/0);
    installed_ = new AllocatorPtr(ctxpool_torch::InstallAllocator());
  }
  static AllocatorPtr& allocator() { return *installed_; }
  static AllocatorPtr* installed_;
};
AllocatorPtr* TorchAllocatorHeaderTest::installed_ = nullptr;

TEST_F(TorchAllocatorHeaderTest, InstallMakesItTheCurrentAllocator) {
  ASSERT_NE(allocator(), nullptr);
  EXPECT_EQ(pa::getCurrentAllocator(), allocator());
  EXPECT_NE(dynamic_cast<pa::CUDAPluggableAllocator*>(allocator().get()),
            nullptr);
  // PyTorch refuses a second swap; so does the stand-in.
  EXPECT_THROW(ctxpool_torch::InstallAllocator(), c10::Error);
}

TEST_F(TorchAllocatorHeaderTest, MallocAndFreeReachCtxpool) {
  const long long before = Stat("allocation.all.current");
  void* p = allocator()->malloc(3 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), before + 1);
  EXPECT_GE(Stat("allocated_bytes.all.current"),
            static_cast<long long>(3 * kMiB));
  allocator()->raw_delete(p);
  EXPECT_EQ(Stat("allocation.all.current"), before);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

TEST_F(TorchAllocatorHeaderTest,
       OverBudgetIsC10OutOfMemoryErrorNamingTheModel) {
  ASSERT_EQ(ctxpool_set_model_budget("capped", 2 * kMiB), 0);
  ctxpool_torch::ScopedModel capped("capped");
  void* fits = allocator()->malloc(kMiB, 0, nullptr);
  ASSERT_NE(fits, nullptr);
  std::string what;
  try {
    (void)allocator()->malloc(4 * kMiB, 0, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const c10::OutOfMemoryError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("capped"), std::string::npos) << what;
  EXPECT_NE(what.find("ctxpool: "), std::string::npos) << what;
  // Nothing leaked and the model keeps working.
  allocator()->raw_delete(fits);
  void* again = allocator()->malloc(kMiB, 0, nullptr);
  EXPECT_NE(again, nullptr);
  allocator()->raw_delete(again);
}

TEST_F(TorchAllocatorHeaderTest, DeviceExhaustionIsC10OutOfMemoryError) {
  // The simulated A10 has 24 GiB: the second 20 GiB does not fit.
  constexpr std::size_t k20GiB = std::size_t{20} << 30;
  void* a = allocator()->malloc(k20GiB, 1, nullptr);
  ASSERT_NE(a, nullptr);
  EXPECT_THROW((void)allocator()->malloc(k20GiB, 1, nullptr),
               c10::OutOfMemoryError);
  allocator()->raw_delete(a);
  // More than the device has at all is a bad request, not out of memory.
  EXPECT_THROW((void)allocator()->malloc(std::size_t{40} << 30, 1, nullptr),
               c10::Error);
}

TEST_F(TorchAllocatorHeaderTest, OtherFailuresAreC10ErrorNotOutOfMemory) {
  std::string what;
  try {
    (void)allocator()->malloc(512, 5, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const c10::OutOfMemoryError&) {
    ADD_FAILURE() << "a bad device is not out of memory";
  } catch (const c10::Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("device 5 does not exist"), std::string::npos) << what;
}

TEST_F(TorchAllocatorHeaderTest, EmptyCacheCallsCtxpoolTrim) {
  void* p = allocator()->malloc(8 * kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr);
  allocator()->raw_delete(p);
  const long long trims = Stat("num_trims");
  const long long reserved = Stat("reserved_bytes.all.current");
  EXPECT_GT(reserved, 0);
  allocator()->emptyCache();
  EXPECT_EQ(Stat("num_trims"), trims + 1);
  EXPECT_LT(Stat("reserved_bytes.all.current"), reserved);
}

TEST_F(TorchAllocatorHeaderTest, RecordStreamHookReachesCtxpool) {
  int dummy = 0;
  allocator()->recordStream(&dummy, nullptr);
  EXPECT_NE(std::string(ctxpool_last_error()).find("ctxpool_record_stream"),
            std::string::npos)
      << ctxpool_last_error();
  void* p = allocator()->malloc(kMiB, 0, nullptr);
  ASSERT_NE(p, nullptr);
  cudaStream_t side = ctxpool_model_stream(0, 0);
  ASSERT_NE(side, nullptr) << ctxpool_last_error();
  allocator()->recordStream(p, side);
  allocator()->raw_delete(p);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

TEST_F(TorchAllocatorHeaderTest, ScopedModelChargesAndRestores) {
  EXPECT_STREQ(ctxpool_get_model(), "default");
  {
    ctxpool_torch::ScopedModel bert("bert");
    EXPECT_STREQ(ctxpool_get_model(), "bert");
    {
      ctxpool_torch::ScopedModel gpt("gpt");
      EXPECT_STREQ(ctxpool_get_model(), "gpt");
    }
    EXPECT_STREQ(ctxpool_get_model(), "bert");
    void* p = allocator()->malloc(kMiB, 0, nullptr);
    const std::string json = ctxpool_memory_stats(0);
    EXPECT_NE(json.find("\"bert\":{"), std::string::npos) << json;
    allocator()->raw_delete(p);
  }
  EXPECT_STREQ(ctxpool_get_model(), "default");
}

}  // namespace
