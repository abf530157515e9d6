// Tests of CudaDriver::Load() on a machine without a GPU: the missing driver,
// a missing library path, and (when CUDA is compiled in) a fake libcuda that
// answers like the toolkit's stub library, like a driver without devices, or
// like a working CUDA 13 driver whose calls the test controls.
#include "ctxpool/driver/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "ctxpool/driver/cuda_errors.h"
#include "ctxpool/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;

// Sets an environment variable for the scope, restoring the old value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class CudaDriverTest : public ::testing::Test {
 protected:
  // The test's own CTXPOOL_LIBCUDA would override every options.library.
  ScopedEnv no_override_{"CTXPOOL_LIBCUDA", nullptr};
};

TEST_F(CudaDriverTest, CompiledInMatchesTheBuild) {
  EXPECT_EQ(CudaDriver::CompiledIn(), CTXPOOL_TEST_CUDA_COMPILED_IN == 1);
}

TEST_F(CudaDriverTest, DefaultLoadWithoutDriverIsUnavailable) {
  absl::StatusOr<std::unique_ptr<Driver>> driver = CudaDriver::Load();
  if (driver.ok()) {
    GTEST_SKIP() << "an NVIDIA driver is installed here: "
                 << (*driver)->Describe();
  }
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable)
      << driver.status();
  if (CudaDriver::CompiledIn()) {
    EXPECT_THAT(driver.status().message(), HasSubstr("libcuda.so.1"));
  }
}

TEST_F(CudaDriverTest, MissingLibraryPathIsUnavailableAndNamed) {
  const std::string path = "/nonexistent/ctxpool/libcuda-missing.so.1";
  absl::StatusOr<std::unique_ptr<Driver>> driver =
      CudaDriver::Load({.library = path});
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  if (CudaDriver::CompiledIn()) {
    EXPECT_THAT(driver.status().message(), HasSubstr(path));
    EXPECT_THAT(driver.status().message(), HasSubstr("no NVIDIA driver"));
  }
}

TEST_F(CudaDriverTest, EnvironmentOverridesTheLibrary) {
  if (!CudaDriver::CompiledIn()) GTEST_SKIP() << "built without CUDA";
  const std::string path = "/nonexistent/from-env/libcuda.so.1";
  ScopedEnv env("CTXPOOL_LIBCUDA", path.c_str());
  absl::StatusOr<std::unique_ptr<Driver>> driver =
      CudaDriver::Load({.library = "/nonexistent/from-options.so"});
  ASSERT_FALSE(driver.ok());
  EXPECT_THAT(driver.status().message(), HasSubstr(path));
}

TEST_F(CudaDriverTest, LibraryWithoutGetProcAddressIsUnavailable) {
  if (!CudaDriver::CompiledIn()) GTEST_SKIP() << "built without CUDA";
  // libdl/libc is loadable everywhere and exports no CUDA symbol.
  absl::StatusOr<std::unique_ptr<Driver>> driver =
      CudaDriver::Load({.library = "libc.so.6"});
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(driver.status().message(), HasSubstr("cuGetProcAddress_v2"));
}

#if CTXPOOL_TEST_CUDA_COMPILED_IN

// The fake libcuda lives next to this executable.
std::string StubPath() {
  char self[4096] = {};
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  std::string dir =
      n > 0 ? std::string(self, static_cast<std::size_t>(n)) : std::string(".");
  dir = dir.substr(0, dir.find_last_of('/'));
  return absl::StrCat(dir, "/", CTXPOOL_CUDA_STUB_NAME);
}

class CudaStubTest : public CudaDriverTest {
 protected:
  absl::StatusOr<std::unique_ptr<Driver>> LoadStub() {
    return CudaDriver::Load({.library = StubPath()});
  }
  // The cudaVersion CudaDriver last asked the stub for `symbol`.
  int RequestedVersion(const char* symbol) {
    void* handle = dlopen(StubPath().c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return -2;
    auto fn = reinterpret_cast<int (*)(const char*)>(
        dlsym(handle, "ctxpool_stub_requested_version"));
    int version = fn != nullptr ? fn(symbol) : -2;
    dlclose(handle);
    return version;
  }
};

TEST_F(CudaStubTest, StubLibraryIsUnavailable) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "stub");
  absl::StatusOr<std::unique_ptr<Driver>> driver = LoadStub();
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverErrorCode(driver.status()), cu::kErrorStubLibrary);
  EXPECT_THAT(driver.status().message(), HasSubstr("CUDA_ERROR_STUB_LIBRARY"));
  EXPECT_THAT(driver.status().message(), HasSubstr("stub library"));
  EXPECT_THAT(driver.status().message(), HasSubstr(StubPath()));
}

TEST_F(CudaStubTest, ToolkitStubIsUnavailable) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "toolkit");
  absl::StatusOr<std::unique_ptr<Driver>> driver = LoadStub();
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverErrorCode(driver.status()), cu::kErrorStubLibrary);
  EXPECT_THAT(driver.status().message(), HasSubstr("stub library"));
  EXPECT_THAT(driver.status().message(), HasSubstr("no NVIDIA driver"));
}

TEST_F(CudaDriverTest, RealToolkitStubIsUnavailable) {
  if (!CudaDriver::CompiledIn()) GTEST_SKIP() << "built without CUDA";
  const char* cuda_home = std::getenv("CUDA_HOME");
  const std::string path =
      absl::StrCat(cuda_home != nullptr ? cuda_home : "/usr/local/cuda",
                   "/lib64/stubs/libcuda.so");
  if (access(path.c_str(), R_OK) != 0) {
    GTEST_SKIP() << "no CUDA toolkit stub at " << path;
  }
  absl::StatusOr<std::unique_ptr<Driver>> driver =
      CudaDriver::Load({.library = path});
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverErrorCode(driver.status()), cu::kErrorStubLibrary);
  EXPECT_THAT(driver.status().message(), HasSubstr("stub library"));
}

TEST_F(CudaStubTest, NoDeviceIsUnavailable) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "nodevice");
  absl::StatusOr<std::unique_ptr<Driver>> driver = LoadStub();
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(DriverErrorCode(driver.status()), cu::kErrorNoDevice);
  EXPECT_THAT(driver.status().message(), HasSubstr("CUDA_ERROR_NO_DEVICE"));
}

TEST_F(CudaStubTest, MissingEntryPointIsUnavailableAndNamed) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "ok");
  ScopedEnv missing("CTXPOOL_STUB_MISSING", "cuMemSetAccess");
  absl::StatusOr<std::unique_ptr<Driver>> driver = LoadStub();
  ASSERT_FALSE(driver.ok());
  EXPECT_EQ(driver.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(driver.status().message(), HasSubstr("cuMemSetAccess"));
}

TEST_F(CudaStubTest, WorkingDriverLoadsAndMapsCalls) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "ok");
  absl::StatusOr<std::unique_ptr<Driver>> loaded = LoadStub();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  Driver& driver = **loaded;
  EXPECT_EQ(driver.Kind(), "cuda");
  EXPECT_THAT(driver.Describe(), HasSubstr("CUDA driver 13.0"));

  EXPECT_EQ(*driver.DeviceCount(), 2);
  EXPECT_EQ(*driver.DeviceName(0), "ctxpool stub GPU");
  EXPECT_EQ(*driver.DeviceTotalMem(1), std::size_t{2} << 30);
  absl::StatusOr<std::size_t> bad_device = driver.DeviceTotalMem(7);
  EXPECT_EQ(DriverErrorCode(bad_device.status()), cu::kErrorInvalidDevice);

  // cuCtxGetDevice through its CUDA 13 ABI, asking for the current context.
  EXPECT_EQ(*driver.CtxGetDevice(), 1);

  // NOT_READY is an answer, not an error.
  EXPECT_EQ(*driver.StreamQuery(StreamHandle(0x1234)), false);
  EXPECT_EQ(*driver.StreamQuery(StreamHandle()), true);
  EXPECT_EQ(*driver.EventQuery(EventHandle(0x10)), true);

  absl::StatusOr<DevicePtr> p = driver.MemAlloc(1 << 20);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(DriverErrorCode(p.status()), cu::kErrorOutOfMemory);
  EXPECT_THAT(p.status().message(), HasSubstr("cuMemAlloc"));
  EXPECT_THAT(p.status().message(), HasSubstr("CUDA_ERROR_OUT_OF_MEMORY"));

  // Everything else in the stub answers CUDA_ERROR_NOT_SUPPORTED, which each
  // method must pass on with the call's name.
  absl::Status s = driver.MemSetAccess(DevicePtr(1 << 21), 2 << 20, 0);
  EXPECT_EQ(DriverErrorCode(s), cu::kErrorNotSupported);
  EXPECT_THAT(s.message(), HasSubstr("cuMemSetAccess"));
  EXPECT_EQ(DriverErrorCode(driver.CtxSynchronize()), cu::kErrorNotSupported);
  EXPECT_EQ(DriverErrorCode(driver.MemHostAlloc(4096, 0).status()),
            cu::kErrorNotSupported);
  EXPECT_EQ(DriverErrorCode(driver.PrimaryCtxRetain(0).status()),
            cu::kErrorNotSupported);
}

TEST_F(CudaStubTest, EntryPointsAreResolvedAtTheirCuda13Abi) {
  ScopedEnv mode("CTXPOOL_STUB_MODE", "ok");
  ASSERT_TRUE(LoadStub().ok());
  // The versions whose ABI matches CUDA 13's cuda.h (the _v2/_v4 variants).
  EXPECT_EQ(RequestedVersion("cuCtxCreate"), 12050);
  EXPECT_EQ(RequestedVersion("cuMemGetInfo"), 3020);
  EXPECT_EQ(RequestedVersion("cuDeviceTotalMem"), 3020);
  EXPECT_EQ(RequestedVersion("cuMemAlloc"), 3020);
  EXPECT_EQ(RequestedVersion("cuCtxGetDevice"), 13000);
  EXPECT_EQ(RequestedVersion("cuCtxSynchronize"), 13000);
  EXPECT_EQ(RequestedVersion("cuMemHostRegister"), 6050);
  EXPECT_EQ(RequestedVersion("cuNoSuchCall"), -1);
}

#else

TEST(CudaStubTest, SkippedWithoutCuda) {
  GTEST_SKIP() << "ctxpool was built without CUDA: the fake libcuda tests "
                  "need CudaDriver compiled in";
}

#endif  // CTXPOOL_TEST_CUDA_COMPILED_IN

}  // namespace
}  // namespace ctxpool
