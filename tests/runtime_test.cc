#include "ctxpool/context/runtime.h"

#include <cstdlib>
#include <memory>
#include <string>

#include "ctxpool/driver/cuda_driver.h"
#include "ctxpool/driver/sim_driver.h"
#include "ctxpool/options.h"
#include "fake_cgroup.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

class RuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("CTXPOOL_DRIVER");
    unsetenv("CTXPOOL_DEVICES");
    ReloadOptions();
  }
  void TearDown() override { SetUp(); }
};

bool GpuUsable() {
  auto cuda = CudaDriver::Load();
  if (!cuda.ok()) return false;
  auto n = (*cuda)->DeviceCount();
  return n.ok() && *n > 0;
}

TEST_F(RuntimeTest, AutoPicksTheGpuOrFallsBackToSimAndSaysWhy) {
  auto rt = Runtime::Create();
  ASSERT_TRUE(rt.ok()) << rt.status();
  const std::string& note = (*rt)->driver_note();
  std::cout << note << "\n";
  EXPECT_NE(note.find("'auto'"), std::string::npos) << note;
  if (GpuUsable()) {
    EXPECT_EQ((*rt)->driver_kind(), "cuda");
  } else {
    EXPECT_EQ((*rt)->driver_kind(), "sim");
    EXPECT_NE(note.find("because no GPU is usable"), std::string::npos) << note;
    // The reason is the CUDA driver's own (no libcuda, no device, or a build
    // without CUDA), so it names CUDA.
    EXPECT_NE(note.find("CUDA"), std::string::npos) << note;
    EXPECT_NE(note.find("CTXPOOL_DRIVER"), std::string::npos) << note;
  }
  ASSERT_FALSE((*rt)->devices().empty());
  auto d0 = (*rt)->device(0);
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ((*d0)->device(), 0);
}

TEST_F(RuntimeTest, ReadsTheCgroupAndSharesThePinnedBudget) {
  testing_internal::FakeCgroupRoot root;
  root.Write("proc/self/cgroup", "0::/svc\n");
  root.Cgroup("/svc", std::to_string(std::size_t{4} << 30), "max",
              std::to_string(std::size_t{1} << 30));
  ASSERT_TRUE(SetOption(OptionId::kSysfsRoot, root.path()).ok());
  auto rt = Runtime::Create({.driver = "sim:2xa10-24gb"});
  ASSERT_TRUE(rt.ok()) << rt.status();
  const CgroupMemory cg = (*rt)->ReadCgroup();
  EXPECT_EQ(cg.path, "/svc");
  EXPECT_EQ(cg.current, std::size_t{1} << 30);
  // Half of 4 GiB, shared by the two devices opened.
  EXPECT_EQ((*rt)->host_budget().bytes, std::size_t{1} << 30);
  for (DeviceContext* dc : (*rt)->devices()) {
    EXPECT_EQ(dc->host_allocator().Stats().host_budget_bytes,
              std::size_t{1} << 30);
  }
  root.Write("sys/fs/cgroup/svc/memory.current", "5\n");
  EXPECT_EQ((*rt)->ReadCgroup().current, 5u);  // read now, not at Create
}

TEST_F(RuntimeTest, SimSpecOpensEveryDevice) {
  auto rt = Runtime::Create({.driver = "sim:2xa10-24gb"});
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->driver_kind(), "sim");
  EXPECT_NE((*rt)->driver_note().find("requested"), std::string::npos);
  ASSERT_EQ((*rt)->devices().size(), 2u);
  const std::size_t capacity = SimDevicePreset("a10-24gb")->capacity_bytes;
  for (int d = 0; d < 2; ++d) {
    auto dc = (*rt)->device(d);
    ASSERT_TRUE(dc.ok());
    EXPECT_EQ((*dc)->initial_context_report().total_bytes, capacity);
  }
  auto* sim = dynamic_cast<SimDriver*>(&(*rt)->driver());
  ASSERT_NE(sim, nullptr);
  EXPECT_EQ(sim->primary_ctx_refcount(0), 1);
  EXPECT_EQ(sim->primary_ctx_refcount(1), 1);
  EXPECT_EQ((*rt)->device(2).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RuntimeTest, CtxpoolDriverAndDevicesComeFromTheEnvironment) {
  setenv("CTXPOOL_DRIVER", "sim:3xl4-24gb", 1);
  setenv("CTXPOOL_DEVICES", "2,0", 1);
  ReloadOptions();
  auto rt = Runtime::Create();
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->driver_kind(), "sim");
  ASSERT_EQ((*rt)->devices().size(), 2u);
  EXPECT_EQ((*rt)->devices()[0]->device(), 0);
  EXPECT_EQ((*rt)->devices()[1]->device(), 2);
  EXPECT_EQ((*rt)->device(1).status().code(), absl::StatusCode::kNotFound);
  auto* sim = dynamic_cast<SimDriver*>(&(*rt)->driver());
  ASSERT_NE(sim, nullptr);
  EXPECT_EQ(sim->primary_ctx_refcount(1), 0);  // not opened, not retained
}

TEST_F(RuntimeTest, ExplicitOptionsWinOverTheEnvironment) {
  setenv("CTXPOOL_DRIVER", "nonsense", 1);
  ReloadOptions();
  EXPECT_EQ(Runtime::Create().status().code(),
            absl::StatusCode::kInvalidArgument);
  auto rt = Runtime::Create({.driver = "sim", .devices = {0}});
  EXPECT_TRUE(rt.ok()) << rt.status();
}

TEST_F(RuntimeTest, BadRequestsAreRefused) {
  EXPECT_EQ(Runtime::Create({.driver = "opencl"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Runtime::Create({.driver = "sim:99xh100-80gb"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Runtime::Create({.driver = "sim", .devices = {0, 0}}).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Runtime::Create({.driver = "sim", .devices = {1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  setenv("CTXPOOL_DEVICES", "zero", 1);
  ReloadOptions();
  EXPECT_EQ(Runtime::Create({.driver = "sim"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Runtime::Create(std::unique_ptr<Driver>()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(RuntimeTest, CudaWithoutAGpuIsUnavailable) {
  if (GpuUsable()) GTEST_SKIP() << "a GPU is present";
  auto rt = Runtime::Create({.driver = "cuda"});
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kUnavailable) << rt.status();
  EXPECT_NE(rt.status().message().find("'cuda'"), std::string::npos);
}

TEST_F(RuntimeTest, CallerSuppliedDriverAndShutdownReleasesContexts) {
  auto owned = SimDriver::Create({.devices = {*SimDevicePreset("t4-16gb")}});
  SimDriver* sim = owned.get();
  auto rt = Runtime::Create(std::move(owned));
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_NE((*rt)->driver_note().find("given by caller"), std::string::npos);
  EXPECT_EQ(&(*rt)->driver(), sim);
  EXPECT_EQ(sim->primary_ctx_refcount(0), 1);
  auto dc = (*rt)->device(0);
  ASSERT_TRUE(dc.ok());
  {
    auto s = (*dc)->OpenSession("m", {.streams = 1});
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Allocate(1 << 20, (*s)->stream(0)).ok());
  }  // closed by its destructor
  EXPECT_EQ((*dc)->Stats().leaked_allocations, 1);
  EXPECT_FALSE((*rt)->InForkedChild());
  EXPECT_TRUE((*rt)->CheckFork("test").ok());
  EXPECT_EQ(sim->misuse_count(), 0u);
}

}  // namespace
}  // namespace ctxpool
