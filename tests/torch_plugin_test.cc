// libctxpool_torch.so driven through its C ABI, as PyTorch's
// CUDAPluggableAllocator drives it: the test dlopens the built library
// (CTXPOOL_TORCH_PLUGIN_PATH, set by tests/torch_plugin.cmake) and runs it on
// the simulated driver (CTXPOOL_DRIVER=sim:2xa10-24gb: two 24 GiB devices).
// Each test starts from a fresh plugin state (ctxpool_shutdown(force) in
// TearDown).
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <functional>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "heap_counter.h"
#include "torch_plugin_api.h"

namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;

using torch_plugin_test::Api;
using torch_plugin_test::JsonInt;

class TorchPluginTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (CTXPOOL_TORCH_PLUGIN_PATH[0] == '\0') return;
    setenv("CTXPOOL_DRIVER", "sim:2xa10-24gb", /*overwrite=*/1);
    handle_ = dlopen(CTXPOOL_TORCH_PLUGIN_PATH, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    torch_plugin_test::ResolveApi(handle_, &api_);
  }
  // The library is built with -z nodelete; it is never dlclosed.

  void SetUp() override {
    if (CTXPOOL_TORCH_PLUGIN_PATH[0] == '\0') {
      GTEST_SKIP() << "libctxpool_torch.so is not built "
                      "(CTXPOOL_BUILD_TORCH_PLUGIN=OFF)";
    }
    ASSERT_NE(handle_, nullptr);
    ASSERT_NE(api_.malloc, nullptr);
    ASSERT_NE(api_.try_malloc, nullptr);
    ASSERT_NE(api_.shutdown, nullptr);
    api_.set_model(nullptr);
  }
  void TearDown() override {
    if (handle_ == nullptr) return;
    api_.set_model(nullptr);
    EXPECT_EQ(api_.shutdown(/*force=*/1), 0) << api_.last_error();
  }

  std::string Stats(int device = 0) {
    const char* s = api_.memory_stats(device);
    EXPECT_NE(s, nullptr) << api_.last_error();
    return s == nullptr ? std::string() : std::string(s);
  }
  int64_t Stat(const std::string& key, int device = 0) {
    return JsonInt(Stats(device), key);
  }
  std::string LastError() { return api_.last_error(); }

  static inline void* handle_ = nullptr;
  static inline Api api_;
};

TEST_F(TorchPluginTest, AllFunctionsAreExported) {
  const Api& a = api_;
  for (const void* fn :
       {(const void*)a.malloc, (const void*)a.free, (const void*)a.empty_cache,
        (const void*)a.memory_stats, (const void*)a.record_stream,
        (const void*)a.set_model, (const void*)a.get_model,
        (const void*)a.set_model_budget, (const void*)a.model_stream,
        (const void*)a.snapshot, (const void*)a.write_trace,
        (const void*)a.last_error, (const void*)a.info}) {
    EXPECT_NE(fn, nullptr);
  }
  // Nothing of libctxpool or Abseil leaks out of the library.
  EXPECT_EQ(dlsym(handle_, "_ZN7ctxpool9SimDriver6CreateENS_10SimOptionsE"),
            nullptr);
}

TEST_F(TorchPluginTest, MallocAndFreeOnTheNullStream) {
  void* p = api_.malloc(1000, 0, nullptr);
  ASSERT_NE(p, nullptr) << LastError();
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  EXPECT_EQ(Stat("allocated_bytes.all.current"), 1024);  // 512 B rounding
  EXPECT_EQ(Stat("requested_bytes.all.current"), 1000);
  EXPECT_EQ(Stat("allocated_bytes.small_pool.current"), 1024);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), 2 << 20);  // a small segment
  api_.free(p, 1000, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("allocated_bytes.all.peak"), 1024);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
  // The cached block is reused: same address, no new segment.
  void* q = api_.malloc(1000, 0, nullptr);
  EXPECT_EQ(q, p);
  EXPECT_EQ(Stat("num_device_alloc"), 1);
  api_.free(q, 1000, 0, nullptr);
}

TEST_F(TorchPluginTest, LargeAllocationsUseTheLargePool) {
  void* p = api_.malloc(8 << 20, 1, nullptr);
  ASSERT_NE(p, nullptr) << LastError();
  EXPECT_EQ(Stat("allocated_bytes.large_pool.current", 1), 8 << 20);
  EXPECT_EQ(Stat("allocated_bytes.all.current", 0), 0);  // other device
  api_.free(p, 8 << 20, 1, nullptr);
}

TEST_F(TorchPluginTest, ZeroBytesGiveUniqueValidPointers) {
  void* a = api_.malloc(0, 0, nullptr);
  void* b = api_.malloc(0, 0, nullptr);
  ASSERT_NE(a, nullptr) << LastError();
  ASSERT_NE(b, nullptr) << LastError();
  EXPECT_NE(a, b);
  api_.free(a, 0, 0, nullptr);
  api_.free(b, 0, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

TEST_F(TorchPluginTest, ForeignPointersAreCountedNotFreed) {
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  int host_object = 0;
  api_.free(&host_object, sizeof(host_object), 0, nullptr);
  EXPECT_NE(LastError().find("not a live allocation"), std::string::npos)
      << LastError();
  // An interior pointer of a live block is foreign too.
  api_.free(static_cast<char*>(p) + 512, 512, 0, nullptr);
  api_.free(reinterpret_cast<void*>(uintptr_t{0xdeadbeef}), 16, 1, nullptr);
  api_.free(nullptr, 0, 0, nullptr);  // a no-op, not counted
  EXPECT_EQ(Stat("num_invalid_frees"), 3);
  EXPECT_EQ(Stat("allocation.all.current"), 1);  // p untouched
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 3);
}

TEST_F(TorchPluginTest, DoubleFreeIsCounted) {
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  api_.free(p, 4096, 0, nullptr);
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
  EXPECT_NE(LastError().find("double free"), std::string::npos);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(TorchPluginTest, SizeOrDeviceMismatchIsRefusedAndTheBlockStaysLive) {
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  api_.free(p, 4095, 0, nullptr);
  EXPECT_NE(LastError().find("was 4096 bytes"), std::string::npos)
      << LastError();
  api_.free(p, 4096, 1, nullptr);
  EXPECT_NE(LastError().find("on device 0"), std::string::npos) << LastError();
  EXPECT_EQ(Stat("num_invalid_frees"), 2);
  EXPECT_EQ(Stat("num_mismatched_frees"), 2);
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  // The right free still works.
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 2);
}

TEST_F(TorchPluginTest, WrongDeviceThatIsOpenCountsOnceAndHugeSizesAreChecked) {
  void* a = api_.malloc(4096, 0, nullptr);
  void* b = api_.malloc(8192, 1, nullptr);  // device 1 is open now
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  api_.free(a, 4096, 1, nullptr);  // the wrong device
  EXPECT_NE(LastError().find("on device 0"), std::string::npos) << LastError();
  EXPECT_EQ(Stat("num_invalid_frees", 1), 1);
  EXPECT_EQ(Stat("num_mismatched_frees", 1), 1);
  // Every size is compared, SIZE_MAX included: refused, nothing freed.
  const int64_t mismatched = Stat("num_mismatched_frees", 0);
  api_.free(a, SIZE_MAX, 0, nullptr);
  EXPECT_NE(LastError().find("was 4096 bytes"), std::string::npos)
      << LastError();
  EXPECT_EQ(Stat("allocation.all.current", 0), 1);
  EXPECT_EQ(Stat("num_mismatched_frees", 0), mismatched + 1);
  api_.free(a, 4096, 0, nullptr);
  api_.free(b, 8192, 1, nullptr);
  EXPECT_EQ(Stat("allocation.all.current", 0), 0);
  EXPECT_EQ(Stat("allocation.all.current", 1), 0);
}

TEST_F(TorchPluginTest, TryMallocOutOfMemoryReturnsNullWithAReport) {
  void* a = api_.try_malloc(20 * kGiB, 0, nullptr);
  ASSERT_NE(a, nullptr) << LastError();
  EXPECT_EQ(api_.try_malloc(20 * kGiB, 0, nullptr), nullptr);
  EXPECT_NE(LastError().find("out of memory"), std::string::npos)
      << LastError();
  EXPECT_EQ(Stat("num_ooms"), 1);
  EXPECT_GE(Stat("num_alloc_retries"), 1);
  // More than the device has at all.
  EXPECT_EQ(api_.try_malloc(100 * kGiB, 1, nullptr), nullptr);
  EXPECT_FALSE(LastError().empty());
  // The other device is unaffected.
  void* b = api_.try_malloc(20 * kGiB, 1, nullptr);
  EXPECT_NE(b, nullptr) << LastError();
  api_.free(a, 20 * kGiB, 0, nullptr);
  api_.free(b, 20 * kGiB, 1, nullptr);
}

// PyTorch does not check the pluggable allocator's result for NULL, so
// ctxpool_malloc reports out-of-memory as PyTorch's own allocator does: by
// throwing (std::bad_alloc here; c10::OutOfMemoryError through the libtorch
// header), with the report in what(). Nothing leaks and the device keeps
// working.
TEST_F(TorchPluginTest, MallocThrowsBadAllocWithTheReport) {
  void* a = api_.malloc(20 * kGiB, 0, nullptr);
  ASSERT_NE(a, nullptr);
  std::string what;
  try {
    (void)api_.malloc(20 * kGiB, 0, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const std::bad_alloc& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("ctxpool: "), std::string::npos) << what;
  EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
  EXPECT_EQ(LastError(), what.substr(std::string("ctxpool: ").size()));
  EXPECT_EQ(Stat("num_ooms"), 1);
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  // A model over its hard budget: the report names the model.
  ASSERT_EQ(api_.set_model_budget("capped", 1 << 20), 0);
  ASSERT_EQ(api_.set_model("capped"), 0);
  void* small = api_.malloc(512 << 10, 0, nullptr);
  what.clear();
  try {
    (void)api_.malloc(1 << 20, 0, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const std::bad_alloc& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("capped"), std::string::npos) << what;
  api_.free(small, 512 << 10, 0, nullptr);
  ASSERT_EQ(api_.set_model(nullptr), 0);
  api_.free(a, 20 * kGiB, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  void* again = api_.malloc(20 * kGiB, 0, nullptr);
  EXPECT_NE(again, nullptr);
  api_.free(again, 20 * kGiB, 0, nullptr);
}

// More than the whole device can never fit: PyTorch's allocator (and
// cudaMalloc) call that out of memory, so ctxpool_malloc throws bad_alloc.
TEST_F(TorchPluginTest, MallocLargerThanTheDeviceIsOutOfMemory) {
  for (std::size_t size : {std::size_t{1} << 50, std::size_t{1} << 63}) {
    std::string what;
    try {
      (void)api_.malloc(size, 0, nullptr);
      ADD_FAILURE() << "no exception";
    } catch (const std::bad_alloc& e) {
      what = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not out of memory: " << e.what();
    }
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("total memory"), std::string::npos) << what;
  }
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(TorchPluginTest, MallocThrowsRuntimeErrorForABadDevice) {
  std::string what;
  try {
    (void)api_.malloc(512, 2, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const std::bad_alloc&) {
    ADD_FAILURE() << "a bad device is not out of memory";
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("device 2 does not exist"), std::string::npos) << what;
}

TEST_F(TorchPluginTest, BadDeviceReturnsNull) {
  EXPECT_EQ(api_.try_malloc(512, 2, nullptr), nullptr);
  EXPECT_NE(LastError().find("device 2 does not exist"), std::string::npos)
      << LastError();
  EXPECT_EQ(api_.try_malloc(512, -1, nullptr), nullptr);
  EXPECT_EQ(api_.memory_stats(7), nullptr);
  api_.free(reinterpret_cast<void*>(uintptr_t{4096}), 512, 9, nullptr);
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
}

TEST_F(TorchPluginTest, MemoryStatsUsePyTorchKeyNames) {
  const std::string json = Stats(0);
  ASSERT_FALSE(json.empty());
  EXPECT_EQ(json.front(), '{');
  EXPECT_EQ(json.back(), '}');
  for (const char* stat : {"allocation", "segment", "active", "inactive_split",
                           "allocated_bytes", "reserved_bytes", "active_bytes",
                           "inactive_split_bytes", "requested_bytes"}) {
    for (const char* pool : {"all", "small_pool", "large_pool"}) {
      for (const char* metric : {"current", "peak", "allocated", "freed"}) {
        const std::string key = std::string(stat) + "." + pool + "." + metric;
        EXPECT_EQ(JsonInt(json, key), 0) << key << " in " << json;
      }
    }
  }
  for (const char* key :
       {"num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
        "num_sync_all_streams", "num_invalid_frees"}) {
    EXPECT_EQ(JsonInt(json, key), 0) << key;
  }
  EXPECT_EQ(JsonInt(json, "max_split_size"), -1);
  EXPECT_NE(json.find("\"models\":{"), std::string::npos);
}

TEST_F(TorchPluginTest, ModelsAreChargedToTheirOwnSessions) {
  EXPECT_STREQ(api_.get_model(), "default");
  ASSERT_EQ(api_.set_model_budget("small", 1 << 20), 0) << LastError();
  ASSERT_EQ(api_.set_model("big"), 0);
  EXPECT_STREQ(api_.get_model(), "big");
  void* big = api_.malloc(64 << 20, 0, nullptr);
  ASSERT_NE(big, nullptr) << LastError();
  ASSERT_EQ(api_.set_model("small"), 0);
  void* small = api_.malloc(512 << 10, 0, nullptr);
  ASSERT_NE(small, nullptr) << LastError();
  // Over small's budget; big's usage does not matter.
  EXPECT_EQ(api_.try_malloc(768 << 10, 0, nullptr), nullptr);
  EXPECT_NE(LastError().find("small"), std::string::npos) << LastError();
  const std::string json = Stats(0);
  const std::size_t small_at = json.find("\"small\":{");
  const std::size_t big_at = json.find("\"big\":{");
  ASSERT_NE(small_at, std::string::npos) << json;
  ASSERT_NE(big_at, std::string::npos) << json;
  EXPECT_EQ(JsonInt(json.substr(small_at), "live_bytes"), 512 << 10);
  EXPECT_EQ(JsonInt(json.substr(small_at), "max_bytes"), 1 << 20);
  EXPECT_EQ(JsonInt(json.substr(small_at), "num_budget_rejections"), 1);
  EXPECT_EQ(JsonInt(json.substr(big_at), "live_bytes"), 64 << 20);
  // A free from another thread (and another current model) goes to the
  // session that allocated.
  std::thread([&] {
    api_.free(small, 512 << 10, 0, nullptr);
    api_.free(big, 64 << 20, 0, nullptr);
  }).join();
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
  api_.set_model("");
  EXPECT_STREQ(api_.get_model(), "default");
  EXPECT_EQ(api_.set_model(std::string(300, 'x').c_str()), -1);
}

TEST_F(TorchPluginTest, BudgetAfterFirstUseIsRefused) {
  api_.set_model("bert");
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(api_.set_model_budget("bert", 1 << 30), -1);
  EXPECT_NE(LastError().find("before its first allocation"), std::string::npos);
  api_.free(p, 4096, 0, nullptr);
}

TEST_F(TorchPluginTest, EmptyCacheGivesCachedMemoryBack) {
  void* p = api_.malloc(30 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  api_.free(p, 30 << 20, 0, nullptr);
  EXPECT_GT(Stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(api_.empty_cache(), 30 << 20);
  EXPECT_EQ(Stat("reserved_bytes.all.current"), 0);
  EXPECT_EQ(Stat("reserved_bytes.all.peak"), 30 << 20);
  EXPECT_EQ(api_.empty_cache(), 0);
}

TEST_F(TorchPluginTest, RecordStreamOnAModelStream) {
  api_.set_model("bert");
  cudaStream_t side = api_.model_stream(0, 0);
  ASSERT_NE(side, nullptr) << LastError();
  EXPECT_EQ(api_.model_stream(0, 99), nullptr);
  void* p = api_.malloc(1 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(api_.record_stream(p, side), 0) << LastError();
  api_.free(p, 1 << 20, 0, nullptr);
  EXPECT_EQ(api_.record_stream(p, side), -1);  // freed
  int host_object = 0;
  EXPECT_EQ(api_.record_stream(&host_object, nullptr), -1);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(TorchPluginTest, SnapshotAndTrace) {
  api_.set_model("bert");
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const std::string path = ::testing::TempDir() + "/ctxpool_torch_snapshot_" +
                           std::to_string(getpid()) + ".json";
  ASSERT_EQ(api_.snapshot(path.c_str()), 0) << LastError();
  std::stringstream text;
  text << std::ifstream(path).rdbuf();
  EXPECT_NE(text.str().find("\"devices\":[{"), std::string::npos);
  EXPECT_NE(text.str().find("\"bert\""), std::string::npos) << text.str();
  std::remove(path.c_str());
  EXPECT_EQ(api_.snapshot("/nonexistent-dir/x.json"), -1);
  EXPECT_EQ(api_.snapshot(nullptr), -1);
  // CTXPOOL_TRACE is not set in this test.
  EXPECT_EQ(api_.write_trace(path.c_str()), -1);
  EXPECT_NE(LastError().find("CTXPOOL_TRACE"), std::string::npos);
  api_.free(p, 4096, 0, nullptr);
}

TEST_F(TorchPluginTest, InfoNamesTheDriver) {
  const std::string info = api_.info();
  EXPECT_NE(info.find("\"driver\":\"sim\""), std::string::npos) << info;
  EXPECT_EQ(JsonInt(info, "device_count"), 2);
  EXPECT_EQ(JsonInt(info, "pid"), getpid());
}

TEST_F(TorchPluginTest, ShutdownRefusesLiveAllocationsUnlessForced) {
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(api_.shutdown(0), -1);
  EXPECT_NE(LastError().find("still live"), std::string::npos);
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(api_.shutdown(0), 0);
  // The next call creates a fresh state.
  EXPECT_EQ(Stat("allocated_bytes.all.peak"), 0);
}

TEST_F(TorchPluginTest, ManyThreadsManyModels) {
  const int kThreads = 4;
  const int kIters = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      api_.set_model(t % 2 ? "odd" : "even");
      std::vector<std::pair<void*, std::size_t>> live;
      for (int i = 0; i < kIters; ++i) {
        const std::size_t size =
            (static_cast<std::size_t>(i * 7 + t) % 64 + 1) * 4096;
        void* p = api_.try_malloc(size, t % 2, nullptr);
        if (p != nullptr) live.emplace_back(p, size);
        if (live.size() > 8 || (i % 3 == 0 && !live.empty())) {
          api_.free(live.front().first, live.front().second, t % 2, nullptr);
          live.erase(live.begin());
        }
      }
      for (auto [p, size] : live) api_.free(p, size, t % 2, nullptr);
    });
  }
  for (auto& th : threads) th.join();
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(Stat("allocation.all.current", d), 0);
    EXPECT_EQ(Stat("num_invalid_frees", d), 0);
    EXPECT_EQ(Stat("num_ooms", d), 0);
  }
}

// The "models" entry of `model` in memory_stats JSON, e.g. {"live_bytes":..}.
std::string ModelJson(const std::string& stats, const std::string& model) {
  const std::size_t at = stats.find("\"" + model + "\":{");
  if (at == std::string::npos) return "";
  const std::size_t end = stats.find('}', at);
  return stats.substr(at, end - at);
}

TEST_F(TorchPluginTest, FreesOnOtherThreadsGoToTheAllocatingModel) {
  std::vector<void*> handed;
  std::thread a([&] {
    api_.set_model("a");
    for (int i = 0; i < 10; ++i)
      handed.push_back(api_.malloc(8192, 0, nullptr));
  });
  a.join();
  EXPECT_EQ(JsonInt(ModelJson(Stats(), "a"), "live_allocations"), 10);
  std::thread b([&] {
    api_.set_model("b");
    void* own = api_.malloc(512, 0, nullptr);  // b has a session too
    for (void* p : handed) api_.free(p, 8192, 0, nullptr);
    api_.free(own, 512, 0, nullptr);
  });
  b.join();
  const std::string stats = Stats();
  EXPECT_EQ(JsonInt(ModelJson(stats, "a"), "live_allocations"), 0) << stats;
  EXPECT_EQ(JsonInt(ModelJson(stats, "a"), "live_bytes"), 0) << stats;
  EXPECT_EQ(JsonInt(ModelJson(stats, "a"), "num_frees"), 10) << stats;
  EXPECT_EQ(JsonInt(ModelJson(stats, "b"), "num_frees"), 1) << stats;
  EXPECT_EQ(JsonInt(stats, "num_invalid_frees"), 0);
  EXPECT_EQ(JsonInt(stats, "num_live_pointers"), 0);
}

TEST_F(TorchPluginTest, FourThreadsFreeEachOthersBlocks) {
  // Four threads with a model each allocate into one shared queue and free
  // whatever they take from it, mostly blocks of the other threads' models.
  constexpr int kThreads = 4;
  constexpr int kIters = 2000;
  std::mutex mu;
  std::deque<std::pair<void*, std::size_t>> queue;
  std::atomic<int> nulls{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      api_.set_model(("m" + std::to_string(t)).c_str());
      for (int i = 0; i < kIters; ++i) {
        const std::size_t size =
            (static_cast<std::size_t>(i * 13 + t) % 32 + 1) * 1024;
        void* p = api_.try_malloc(size, 0, nullptr);
        if (p == nullptr) {
          ++nulls;
          continue;
        }
        std::pair<void*, std::size_t> victim{nullptr, 0};
        {
          std::lock_guard<std::mutex> lock(mu);
          queue.emplace_back(p, size);
          if (queue.size() > 16) {
            victim = queue.front();
            queue.pop_front();
          }
        }
        if (victim.first != nullptr) {
          api_.free(victim.first, victim.second, 0, nullptr);
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto [p, size] : queue) api_.free(p, size, 0, nullptr);
  EXPECT_EQ(nulls.load(), 0) << LastError();
  const std::string stats = Stats();
  for (int t = 0; t < kThreads; ++t) {
    const std::string m = ModelJson(stats, "m" + std::to_string(t));
    EXPECT_EQ(JsonInt(m, "num_allocs"), kIters) << m;
    EXPECT_EQ(JsonInt(m, "num_frees"), kIters) << m;
    EXPECT_EQ(JsonInt(m, "live_bytes"), 0) << m;
  }
  EXPECT_EQ(JsonInt(stats, "allocation.all.current"), 0);
  EXPECT_EQ(JsonInt(stats, "num_invalid_frees"), 0);
  EXPECT_EQ(JsonInt(stats, "num_live_pointers"), 0);
}

TEST_F(TorchPluginTest, CachedMallocAndFreeMakeNoHeapAllocation) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  const std::size_t sizes[] = {0, 512, 4096, 1 << 20, 8 << 20};
  for (int round = 0; round < 2; ++round) {
    for (std::size_t b : sizes)
      api_.free(api_.malloc(b, 0, nullptr), b, 0, nullptr);
  }
  // The counter sees the plugin's allocations (memory_stats builds strings).
  g_allocations = 0;
  g_count_allocations = true;
  (void)api_.memory_stats(0);
  g_count_allocations = false;
  ASSERT_GT(g_allocations, 0) << "operator new of the plugin is not counted";
  g_allocations = 0;
  g_count_allocations = true;
  int nulls = 0;
  for (int i = 0; i < 200; ++i) {
    for (std::size_t b : sizes) {
      void* p = api_.try_malloc(b, 0, nullptr);
      if (p == nullptr) ++nulls;
      api_.free(p, b, 0, nullptr);
    }
  }
  g_count_allocations = false;
  EXPECT_EQ(nulls, 0);
  EXPECT_EQ(g_allocations, 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

// Host memory running out inside a C function (std::bad_alloc) must not
// cross it: an exception cannot pass a C frame (ctypes) and a free runs in
// PyTorch's noexcept deleters. Every function but ctxpool_malloc reports it
// as an error; ctxpool_malloc throws std::bad_alloc, as documented. Nothing
// is lost: the books match after memory returns.
TEST_F(TorchPluginTest, HostMemoryRunningOutIsAnErrorNotACrash) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  ASSERT_EQ(api_.set_model("m"), 0);
  void* p = api_.malloc(4096, 0, nullptr);
  void* big = api_.malloc(64 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(big, nullptr);
  cudaStream_t ms = api_.model_stream(0, 0);
  ASSERT_NE(ms, nullptr) << LastError();
  const std::string path =
      ::testing::TempDir() + "/ctxpool_host_oom_snapshot.json";
  const std::string long_name(100, 'x');
  std::vector<void*> got;  // what calls under the failure returned
  struct Call {
    const char* name;
    std::function<bool()> failed;  // true: the call reported a failure
    bool may_throw_bad_alloc = false;
  };
  const std::vector<Call> calls = {
      {"ctxpool_memory_stats", [&] { return api_.memory_stats(0) == nullptr; }},
      {"ctxpool_info", [&] { return api_.info() == nullptr; }},
      {"ctxpool_get_model", [&] { return api_.get_model() == nullptr; }},
      {"ctxpool_set_model",
       [&] { return api_.set_model(long_name.c_str()) != 0; }},
      {"ctxpool_set_model_budget",
       [&] { return api_.set_model_budget("n", kGiB) != 0; }},
      {"ctxpool_model_stream",
       [&] { return api_.model_stream(0, 1) == nullptr; }},
      {"ctxpool_snapshot", [&] { return api_.snapshot(path.c_str()) != 0; }},
      {"ctxpool_write_trace",
       [&] { return api_.write_trace(path.c_str()) != 0; }},
      {"ctxpool_empty_cache", [&] { return api_.empty_cache() < 0; }},
      {"ctxpool_record_stream", [&] { return api_.record_stream(p, ms) != 0; }},
      {"ctxpool_try_malloc",
       [&] {
         void* q = api_.try_malloc(100 << 20, 0, nullptr);
         if (q != nullptr) got.push_back(q);
         return q == nullptr;
       }},
      {"ctxpool_malloc",
       [&] {
         void* q = api_.malloc(100 << 20, 0, nullptr);
         if (q != nullptr) got.push_back(q);
         return q == nullptr;
       },
       /*may_throw_bad_alloc=*/true},
      {"ctxpool_free",
       [&] {
         api_.free(big, 64 << 20, 0, nullptr);
         return false;
       }},
      {"ctxpool_last_error", [&] { return api_.last_error() == nullptr; }},
      {"ctxpool_shutdown", [&] { return api_.shutdown(0) != 0; }},
  };
  for (const Call& c : calls) {
    SCOPED_TRACE(c.name);
    bool failed = false;
    std::string escaped;
    g_fail_allocations = true;
    try {
      failed = c.failed();
    } catch (const std::bad_alloc&) {
      if (!c.may_throw_bad_alloc) escaped = "std::bad_alloc";
      failed = true;
    } catch (const std::exception& e) {
      escaped = e.what();
    }
    g_fail_allocations = false;
    EXPECT_EQ(escaped, "") << "an exception left the C function";
    const char* err = api_.last_error();
    ASSERT_NE(err, nullptr);
    // ctxpool_shutdown refuses the live blocks whatever memory does.
    if (failed && std::string(c.name) != "ctxpool_shutdown") {
      EXPECT_NE(std::string(err).find("host memory"), std::string::npos) << err;
    }
  }
  // Memory is back: nothing was lost and everything still works.
  EXPECT_STREQ(api_.get_model(), "m");
  for (void* q : got) api_.free(q, 100 << 20, 0, nullptr);
  const std::string stats = Stats();
  // The free under the failure either happened or left the block live.
  const int64_t live = JsonInt(stats, "allocation.all.current");
  EXPECT_TRUE(live == 1 || live == 2) << stats;
  if (live == 2) api_.free(big, 64 << 20, 0, nullptr);
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
  void* q = api_.malloc(100 << 20, 0, nullptr);
  ASSERT_NE(q, nullptr);
  api_.free(q, 100 << 20, 0, nullptr);
  std::remove(path.c_str());
}

TEST_F(TorchPluginTest, ForkedChildCreatesItsOwnState) {
  void* p = api_.malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // A new state serves the child: the parent's allocation is not in it.
    // (The simulated driver is deterministic, so the child's first block
    // may have the parent's address; only the counts tell them apart.)
    int code = 0;
    const char* info = api_.info();
    if (info == nullptr || JsonInt(info, "pid") != getpid()) code |= 1;
    if (JsonInt(info ? info : "", "live_allocations") != 0) code |= 2;
    void* q = api_.try_malloc(4096, 0, nullptr);
    if (q == nullptr) code |= 4;
    const char* stats = api_.memory_stats(0);
    if (stats == nullptr || JsonInt(stats, "allocation.all.current") != 1) {
      code |= 8;
    }
    if (q != nullptr) api_.free(q, 4096, 0, nullptr);
    stats = api_.memory_stats(0);
    if (stats == nullptr || JsonInt(stats, "num_invalid_frees") != 0) {
      code |= 16;
    }
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The parent is unaffected.
  api_.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

}  // namespace
