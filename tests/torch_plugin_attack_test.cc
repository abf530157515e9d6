// Attacks on the inline fast paths of libctxpool_torch.so (ctxpool_malloc /
// ctxpool_try_malloc / ctxpool_free: MallocEntry / FreeEntry) and on
// ModelSession::Deallocate's stored FreeCheck.
//
// The plugin is dlopened as tests/torch_plugin_test.cc does, from
// CTXPOOL_TORCH_PLUGIN_PATH (set by tests/torch_plugin.cmake; empty when the
// plugin is not built, and the tests skip). The
// plugin's option table is read once per process, so the tests that need
// another environment (CTXPOOL_TRACE=1, 18 devices) re-execute this binary
// with one child test selected (suite AttackChild) and that environment.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/context/device_context.h"
#include "ctxpool/context/model_session.h"
#include "ctxpool/driver/sim_driver.h"
#include "gtest/gtest.h"
#include "torch_plugin_api.h"

namespace {

constexpr std::size_t kGiB = std::size_t{1} << 30;

using torch_plugin_test::Api;
using torch_plugin_test::JsonInt;

std::string PluginPath() { return CTXPOOL_TORCH_PLUGIN_PATH; }

std::string ModelJson(const std::string& stats, const std::string& model) {
  const std::size_t at = stats.find("\"" + model + "\":{");
  if (at == std::string::npos) return "";
  const std::size_t end = stats.find('}', at);
  return stats.substr(at, end - at);
}

void* g_handle = nullptr;
Api g_api;

bool LoadPlugin() {
  if (g_handle != nullptr) return true;
  // The children get their driver from the parent's environment.
  setenv("CTXPOOL_DRIVER", "sim:2xa10-24gb", /*overwrite=*/0);
  const std::string path = PluginPath();
  g_handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (g_handle == nullptr) return false;
  torch_plugin_test::ResolveApi(g_handle, &g_api);
  return true;
}

// Runs this executable with only AttackChild.<test> and the extra
// environment `env` ("K=V"); true when it ran that one test and it passed.
bool RunChild(const std::string& test, const std::vector<std::string>& env,
              std::string* output) {
  return torch_plugin_test::RunTestInChild("AttackChild", test,
                                           "CTXPOOL_ATTACK_CHILD", env, output);
}

class Attack : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { loaded_ = LoadPlugin(); }
  void SetUp() override {
    if (std::getenv("CTXPOOL_ATTACK_CHILD") != nullptr) {
      GTEST_SKIP() << "child process runs AttackChild only";
    }
    if (PluginPath().empty()) GTEST_SKIP() << "the plugin is not built";
    ASSERT_TRUE(loaded_) << PluginPath() << ": " << dlerror();
    ASSERT_NE(g_api.malloc, nullptr);
    g_api.set_model(nullptr);
    ASSERT_EQ(g_api.shutdown(1), 0);  // a fresh state
  }
  void TearDown() override {
    if (!loaded_ || std::getenv("CTXPOOL_ATTACK_CHILD") != nullptr) return;
    g_api.set_model(nullptr);
    EXPECT_EQ(g_api.shutdown(1), 0) << g_api.last_error();
  }
  static std::string Stats(int device = 0) {
    const char* s = g_api.memory_stats(device);
    EXPECT_NE(s, nullptr) << g_api.last_error();
    return s == nullptr ? std::string() : std::string(s);
  }
  static int64_t Stat(const std::string& key, int device = 0) {
    return JsonInt(Stats(device), key);
  }
  static std::string LastError() { return g_api.last_error(); }
  // A live allocation of the calling thread with a warm cache (the second
  // malloc of the thread on `device` takes the fast path).
  static void* Warm(std::size_t size, int device) {
    void* w = g_api.malloc(512, device, nullptr);
    g_api.free(w, 512, device, nullptr);
    return g_api.malloc(size, device, nullptr);
  }
  static inline bool loaded_ = false;
};

// ---- frees the fast path must refuse ----------------------------------------

TEST_F(Attack, FreeBeforeAnyMallocInAFreshState) {
  // No state yet: ctxpool_free must create it, refuse, count and say why.
  int host = 0;
  g_api.free(&host, sizeof(host), 0, nullptr);
  EXPECT_NE(LastError().find("not a live allocation"), std::string::npos)
      << LastError();
  g_api.free(reinterpret_cast<void*>(uintptr_t{0x7f0000200000}), 4096, -1,
             nullptr);
  EXPECT_NE(LastError().find("device -1"), std::string::npos) << LastError();
  EXPECT_EQ(Stat("num_invalid_frees", 0), 2);
  EXPECT_EQ(Stat("num_invalid_frees", 1), 2);  // the state's own counter
  EXPECT_EQ(Stat("num_mismatched_frees", 0), 0);
  const std::string info = g_api.info();
  EXPECT_NE(info.find("\"opened_devices\":[]"), std::string::npos) << info;
}

TEST_F(Attack, FreeWithNegativeOrOutOfRangeDeviceOfALivePointer) {
  void* p = Warm(4096, 0);
  ASSERT_NE(p, nullptr) << LastError();
  const int bad[] = {-1, -2, INT_MIN, 2, 15, 16, 17, 1 << 20, INT_MAX};
  int64_t n = 0;
  for (int d : bad) {
    g_api.free(p, 4096, d, nullptr);
    ++n;
    const std::string e = LastError();
    EXPECT_NE(e.find("device " + std::to_string(d)), std::string::npos)
        << d << ": " << e;
    EXPECT_NE(e.find("was 4096 bytes on device 0"), std::string::npos)
        << d << ": " << e;
    EXPECT_EQ(Stat("allocation.all.current"), 1) << d;
    EXPECT_EQ(Stat("num_invalid_frees"), n) << d;
    EXPECT_EQ(Stat("num_mismatched_frees"), n) << d;
  }
  EXPECT_EQ(g_api.record_stream(p, nullptr), 0) << "p must still be live";
  g_api.free(p, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), n);
}

TEST_F(Attack, FreeOfTheOtherDevicesPointerWithBothOpenAndWarm) {
  void* a = Warm(4096, 0);
  void* b = Warm(8192, 1);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int64_t inv0 = Stat("num_invalid_frees", 0);
  const int64_t inv1 = Stat("num_invalid_frees", 1);
  g_api.free(b, 8192, 0, nullptr);  // b lives on device 1
  EXPECT_NE(LastError().find("on device 1"), std::string::npos) << LastError();
  g_api.free(b, 4096, 0, nullptr);  // wrong size and device
  EXPECT_NE(LastError().find("was 8192 bytes"), std::string::npos)
      << LastError();
  EXPECT_EQ(Stat("num_invalid_frees", 0), inv0 + 2);
  EXPECT_EQ(Stat("num_invalid_frees", 1), inv1);
  EXPECT_EQ(Stat("num_mismatched_frees", 1), 2);  // the state's counter
  EXPECT_EQ(Stat("allocation.all.current", 1), 1);
  EXPECT_EQ(Stat("allocation.all.current", 0), 1);
  g_api.free(a, 4096, 0, nullptr);
  g_api.free(b, 8192, 1, nullptr);
  EXPECT_EQ(Stat("allocation.all.current", 0), 0);
  EXPECT_EQ(Stat("allocation.all.current", 1), 0);
}

TEST_F(Attack, WrongSizesOnTheFastPathAreRefusedAndKept) {
  void* p = Warm(4097, 0);  // charged 4608 (512 B unit), requested 4097
  ASSERT_NE(p, nullptr);
  const std::size_t wrong[] = {0, 1, 4096, 4098, 4608, SIZE_MAX};
  int64_t n = 0;
  for (std::size_t s : wrong) {
    g_api.free(p, s, 0, nullptr);
    ++n;
    EXPECT_NE(LastError().find("was 4097 bytes"), std::string::npos)
        << s << ": " << LastError();
    EXPECT_EQ(Stat("allocation.all.current"), 1) << s;
    EXPECT_EQ(Stat("num_invalid_frees"), n) << s;
    EXPECT_EQ(Stat("num_mismatched_frees"), n) << s;
  }
  g_api.free(p, 4097, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), n);
  // Now a double free through the fast path.
  g_api.free(p, 4097, 0, nullptr);
  EXPECT_NE(LastError().find("double free"), std::string::npos) << LastError();
  EXPECT_EQ(Stat("num_invalid_frees"), n + 1);
}

TEST_F(Attack, ZeroSizeAllocationsOnTheFastPath) {
  void* w = Warm(0, 0);
  ASSERT_NE(w, nullptr) << LastError();
  void* a = g_api.malloc(0, 0, nullptr);
  void* b = g_api.try_malloc(0, 0, nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_NE(a, w);
  g_api.free(a, 1, 0, nullptr);  // not its size
  EXPECT_EQ(Stat("allocation.all.current"), 3);
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
  g_api.free(a, 0, 0, nullptr);
  g_api.free(b, 0, 0, nullptr);
  g_api.free(w, 0, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
}

// ---- failures of ctxpool_malloc on a warm cache -----------------------------

TEST_F(Attack, WarmMallocThrowsBadAllocForEveryOutOfMemory) {
  void* big = Warm(20 * kGiB, 0);
  ASSERT_NE(big, nullptr) << LastError();
  const std::size_t sizes[] = {20 * kGiB, 24 * kGiB + 1, std::size_t{1} << 50,
                               std::size_t{1} << 63, SIZE_MAX};
  for (std::size_t s : sizes) {
    bool bad_alloc = false;
    std::string what;
    try {
      (void)g_api.malloc(s, 0, nullptr);
      ADD_FAILURE() << s << ": no exception";
    } catch (const std::bad_alloc& e) {
      bad_alloc = true;
      what = e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << s << ": not bad_alloc: " << e.what();
    }
    EXPECT_TRUE(bad_alloc) << s;
    EXPECT_NE(what.find("out of memory"), std::string::npos) << s << what;
    EXPECT_EQ("ctxpool: " + LastError(), what) << s;
    EXPECT_EQ(g_api.try_malloc(s, 0, nullptr), nullptr) << s;
    EXPECT_NE(LastError().find("out of memory"), std::string::npos) << s;
  }
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  g_api.free(big, 20 * kGiB, 0, nullptr);
}

TEST_F(Attack, WarmMallocOfABadDeviceThrowsRuntimeError) {
  void* p = Warm(4096, 0);
  ASSERT_NE(p, nullptr);
  for (int d : {-1, INT_MIN, 2, 15, 16, INT_MAX}) {
    std::string what;
    try {
      (void)g_api.malloc(512, d, nullptr);
      ADD_FAILURE() << d << ": no exception";
    } catch (const std::bad_alloc& e) {
      ADD_FAILURE() << d << ": a bad device is not out of memory: " << e.what();
    } catch (const std::runtime_error& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("device " + std::to_string(d) + " does not exist"),
              std::string::npos)
        << what;
    EXPECT_EQ(g_api.try_malloc(512, d, nullptr), nullptr);
    EXPECT_NE(LastError().find("does not exist"), std::string::npos);
  }
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  g_api.free(p, 4096, 0, nullptr);
}

TEST_F(Attack, WarmBudgetExhaustionThrowsBadAllocNamingTheModel) {
  ASSERT_EQ(g_api.set_model_budget("capped", 64 << 10), 0) << LastError();
  ASSERT_EQ(g_api.set_model("capped"), 0);
  void* a = Warm(32 << 10, 0);
  ASSERT_NE(a, nullptr) << LastError();
  std::string what;
  try {
    (void)g_api.malloc(48 << 10, 0, nullptr);
    ADD_FAILURE() << "no exception";
  } catch (const std::bad_alloc& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("capped"), std::string::npos) << what;
  EXPECT_EQ(g_api.try_malloc(48 << 10, 0, nullptr), nullptr);
  EXPECT_NE(LastError().find("capped"), std::string::npos) << LastError();
  EXPECT_EQ(JsonInt(ModelJson(Stats(), "capped"), "num_budget_rejections"), 2);
  g_api.free(a, 32 << 10, 0, nullptr);
}

// ---- the per-thread cache ---------------------------------------------------

TEST_F(Attack, SwitchingModelsNeverUsesTheCachedSession) {
  ASSERT_EQ(g_api.set_model_budget("tiny", 4096), 0);
  ASSERT_EQ(g_api.set_model("big"), 0);
  void* b0 = Warm(8192, 0);
  void* b1 = Warm(8192, 1);
  ASSERT_NE(b0, nullptr);
  ASSERT_NE(b1, nullptr);
  // The cache holds big's sessions on both devices; tiny's budget must apply.
  ASSERT_EQ(g_api.set_model("tiny"), 0);
  EXPECT_EQ(g_api.try_malloc(8192, 1, nullptr), nullptr)
      << "allocated with the cached session of 'big'";
  EXPECT_NE(LastError().find("tiny"), std::string::npos) << LastError();
  void* t1 = g_api.try_malloc(4096, 1, nullptr);
  ASSERT_NE(t1, nullptr) << LastError();
  EXPECT_EQ(JsonInt(ModelJson(Stats(1), "tiny"), "live_bytes"), 4096);
  EXPECT_EQ(JsonInt(ModelJson(Stats(1), "big"), "live_allocations"), 1);
  // A refused (too long) name leaves the model as it was.
  EXPECT_EQ(g_api.set_model(std::string(300, 'x').c_str()), -1);
  EXPECT_STREQ(g_api.get_model(), "tiny");
  EXPECT_EQ(g_api.try_malloc(512, 1, nullptr), nullptr);  // over tiny's 4 KiB
  // Back to big: its cached session is found again.
  ASSERT_EQ(g_api.set_model("big"), 0);
  void* b2 = g_api.malloc(8192, 1, nullptr);
  EXPECT_EQ(JsonInt(ModelJson(Stats(1), "big"), "live_allocations"), 2);
  // Default after NULL.
  ASSERT_EQ(g_api.set_model(nullptr), 0);
  void* d0 = g_api.malloc(512, 0, nullptr);
  EXPECT_EQ(JsonInt(ModelJson(Stats(0), "default"), "live_allocations"), 1)
      << Stats(0);
  EXPECT_EQ(JsonInt(ModelJson(Stats(0), "big"), "live_allocations"), 1);
  for (auto [p, s, d] : {std::tuple<void*, std::size_t, int>{b0, 8192, 0},
                         {b1, 8192, 1},
                         {t1, 4096, 1},
                         {b2, 8192, 1},
                         {d0, 512, 0}}) {
    g_api.free(p, s, d, nullptr);
  }
  EXPECT_EQ(Stat("allocation.all.current", 0), 0);
  EXPECT_EQ(Stat("allocation.all.current", 1), 0);
  EXPECT_EQ(Stat("num_invalid_frees", 0), 0);
}

TEST_F(Attack, AColdThreadFreesAndAllocates) {
  ASSERT_EQ(g_api.set_model("warm"), 0);
  std::vector<void*> mine;
  for (int i = 0; i < 8; ++i) mine.push_back(g_api.malloc(4096, 0, nullptr));
  std::thread([&] {
    // Cold cache: frees go to "warm"'s session, the malloc to "default".
    g_api.free(mine[0], 4096, 0, nullptr);
    g_api.free(mine[0], 4096, 0, nullptr);  // double
    void* own = g_api.malloc(4096, 0, nullptr);
    EXPECT_NE(own, nullptr);
    for (std::size_t i = 1; i < mine.size(); ++i)
      g_api.free(mine[i], 4096, 0, nullptr);
    g_api.free(own, 4096, 0, nullptr);
  }).join();
  const std::string s = Stats();
  EXPECT_EQ(JsonInt(ModelJson(s, "warm"), "num_frees"), 8) << s;
  EXPECT_EQ(JsonInt(ModelJson(s, "warm"), "live_allocations"), 0) << s;
  EXPECT_EQ(JsonInt(ModelJson(s, "default"), "num_allocs"), 1) << s;
  EXPECT_EQ(JsonInt(s, "num_invalid_frees"), 1);
  EXPECT_EQ(JsonInt(s, "allocation.all.current"), 0);
}

TEST_F(Attack, ShutdownThenReuseDropsTheStaleCache) {
  ASSERT_EQ(g_api.set_model("m"), 0);
  void* p = Warm(8192, 0);
  ASSERT_NE(p, nullptr);
  g_api.free(p, 8192, 0, nullptr);
  ASSERT_EQ(g_api.shutdown(0), 0) << LastError();
  // New state: m has no session yet, so a budget is accepted; the thread's
  // cached (destroyed) session must not serve the next malloc.
  ASSERT_EQ(g_api.set_model_budget("m", 4096), 0) << LastError();
  EXPECT_EQ(g_api.try_malloc(8192, 0, nullptr), nullptr)
      << "served by the stale cached session";
  EXPECT_NE(LastError().find("'m'"), std::string::npos) << LastError();
  void* q = g_api.malloc(4096, 0, nullptr);
  ASSERT_NE(q, nullptr);
  const std::string s = Stats();
  EXPECT_EQ(JsonInt(ModelJson(s, "m"), "num_allocs"), 1) << s;
  EXPECT_EQ(JsonInt(s, "allocation.all.current"), 1);
  g_api.free(q, 4096, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(Attack, ForcedShutdownWithLivePointersThenStaleFrees) {
  void* p = Warm(4096, 0);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(g_api.shutdown(0), -1);          // refused: the state stays
  void* q = g_api.malloc(4096, 0, nullptr);  // still the warm cache
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 2);
  ASSERT_EQ(g_api.shutdown(1), 0);
  // New state, device 0 not open: a stale pointer is refused and counted.
  g_api.free(p, 4096, 0, nullptr);
  EXPECT_NE(LastError().find("not a live allocation"), std::string::npos)
      << LastError();
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  // The warm thread's next malloc goes to the new state.
  void* r = g_api.malloc(1000, 0, nullptr);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 1);
  EXPECT_EQ(Stat("requested_bytes.all.current"), 1000);
  g_api.free(r, 1000, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(Attack, ManyShutdownCyclesWithWarmThreads) {
  for (int cycle = 0; cycle < 20; ++cycle) {
    std::vector<std::thread> threads;
    std::atomic<int> bad{0};
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        g_api.set_model(t == 0 ? nullptr : ("c" + std::to_string(t)).c_str());
        for (int i = 0; i < 50; ++i) {
          void* p = g_api.try_malloc(1024 * (i + 1), t % 2, nullptr);
          if (p == nullptr) {
            ++bad;
            continue;
          }
          g_api.free(p, 1024 * (i + 1), t % 2, nullptr);
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(bad.load(), 0) << LastError();
    for (int d = 0; d < 2; ++d) {
      EXPECT_EQ(Stat("allocation.all.current", d), 0);
      EXPECT_EQ(Stat("num_invalid_frees", d), 0);
    }
    // This thread's cache is warm; shut down and go again.
    void* w = Warm(512, cycle % 2);
    g_api.free(w, 512, cycle % 2, nullptr);
    ASSERT_EQ(g_api.shutdown(0), 0) << LastError();
  }
}

TEST_F(Attack, FourThreadsFreeEachOthersPointersWithDeliberateBadFrees) {
  constexpr int kThreads = 4;
  constexpr int kIters = 1500;
  std::mutex mu;
  std::deque<std::tuple<void*, std::size_t, int>> queue;
  std::atomic<int> nulls{0};
  std::atomic<int> bad_frees{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      g_api.set_model(("m" + std::to_string(t)).c_str());
      for (int i = 0; i < kIters; ++i) {
        const int dev = (i + t) % 2;
        const std::size_t size =
            (static_cast<std::size_t>(i * 13 + t) % 40 + 1) * 1000;
        void* p = g_api.try_malloc(size, dev, nullptr);
        if (p == nullptr) {
          ++nulls;
          continue;
        }
        std::tuple<void*, std::size_t, int> victim{nullptr, 0, 0};
        {
          std::lock_guard<std::mutex> lock(mu);
          queue.emplace_back(p, size, dev);
          if (queue.size() > 24) {
            victim = queue.front();
            queue.pop_front();
          }
        }
        auto [vp, vs, vd] = victim;
        if (vp == nullptr) continue;
        if (i % 7 == 0) {  // wrong size on the right device: refused
          g_api.free(vp, vs + 1, vd, nullptr);
          ++bad_frees;
        }
        g_api.free(vp, vs, vd, nullptr);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto [p, s, d] : queue) g_api.free(p, s, d, nullptr);
  EXPECT_EQ(nulls.load(), 0) << LastError();
  int64_t allocs = 0;
  int64_t frees = 0;
  int64_t invalid = 0;
  for (int d = 0; d < 2; ++d) {
    const std::string s = Stats(d);
    EXPECT_EQ(JsonInt(s, "allocation.all.current"), 0) << d;
    EXPECT_EQ(JsonInt(s, "num_live_pointers"), 0) << d;
    invalid += JsonInt(s, "num_invalid_frees");
    for (int t = 0; t < kThreads; ++t) {
      const std::string m = ModelJson(s, "m" + std::to_string(t));
      allocs += JsonInt(m, "num_allocs");
      frees += JsonInt(m, "num_frees");
      EXPECT_EQ(JsonInt(m, "live_bytes"), 0) << m;
    }
  }
  EXPECT_EQ(allocs, kThreads * kIters);
  EXPECT_EQ(frees, kThreads * kIters);
  EXPECT_EQ(invalid, bad_frees.load());
  EXPECT_GT(bad_frees.load(), 0);
}

TEST_F(Attack, ForkedChildHonoursItsOwnBudgetDespiteTheWarmCache) {
  ASSERT_EQ(g_api.set_model("fm"), 0);
  void* p = Warm(8192, 0);
  ASSERT_NE(p, nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    if (g_api.set_model_budget("fm", 4096) != 0) code |= 1;
    if (g_api.try_malloc(8192, 0, nullptr) != nullptr) code |= 2;  // stale
    void* q = g_api.try_malloc(4096, 0, nullptr);
    if (q == nullptr) code |= 4;
    const char* s = g_api.memory_stats(0);
    if (s == nullptr || JsonInt(s, "allocation.all.current") != 1) code |= 8;
    g_api.free(p, 8192, 0, nullptr);  // the parent's: not live here
    s = g_api.memory_stats(0);
    if (s == nullptr || JsonInt(s, "num_invalid_frees") != 1) code |= 16;
    _exit(code);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  g_api.free(p, 8192, 0, nullptr);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
  EXPECT_EQ(Stat("num_invalid_frees"), 0);
}

// ---- tests in a child process with another environment ----------------------

TEST_F(Attack, TracingRecordsEveryWarmMallocAndFree) {
  std::string out;
  EXPECT_TRUE(RunChild("Traced", {"CTXPOOL_TRACE=1"}, &out)) << out;
}

TEST_F(Attack, DevicesBeyondTheSessionCache) {
  std::string out;
  EXPECT_TRUE(
      RunChild("EighteenDevices", {"CTXPOOL_DRIVER=sim:18xa10-24gb"}, &out))
      << out;
}

class AttackChild : public Attack {
 protected:
  void SetUp() override {
    if (!torch_plugin_test::InChildFor("CTXPOOL_ATTACK_CHILD")) {
      GTEST_SKIP() << "runs in a child process only";
    }
    ASSERT_TRUE(loaded_) << PluginPath() << ": " << dlerror();
  }
  void TearDown() override {}
};

std::vector<std::vector<std::string>> ReadCsv(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) f.push_back(cell);
    rows.push_back(f);
  }
  return rows;
}

TEST_F(AttackChild, Traced) {
  const std::string info = g_api.info();
  ASSERT_NE(info.find("\"trace\":true"), std::string::npos) << info;
  ASSERT_EQ(g_api.set_model("tr"), 0);
  constexpr int kN = 50;
  std::vector<void*> ps;
  for (int i = 0; i < kN; ++i) {
    void* p = g_api.malloc(4096 + i, 0, nullptr);  // warm after the first
    ASSERT_NE(p, nullptr);
    ps.push_back(p);
  }
  // Another thread (cold) frees half, this one (warm) the rest.
  std::thread([&] {
    for (int i = 0; i < kN / 2; ++i) g_api.free(ps[i], 4096 + i, 0, nullptr);
  }).join();
  for (int i = kN / 2; i < kN; ++i) g_api.free(ps[i], 4096 + i, 0, nullptr);
  // Refused frees record nothing; an OOM records a failure.
  g_api.free(ps[0], 4096, 0, nullptr);
  EXPECT_EQ(g_api.try_malloc(100 * kGiB, 0, nullptr), nullptr);
  bool threw = false;
  try {
    (void)g_api.malloc(100 * kGiB, 0, nullptr);
  } catch (const std::bad_alloc&) {
    threw = true;
  }
  EXPECT_TRUE(threw);
  const std::string path = ::testing::TempDir() + "/ctxpool_attack_trace_" +
                           std::to_string(getpid()) + ".csv";
  ASSERT_EQ(g_api.write_trace(path.c_str()), 0) << LastError();
  const auto rows = ReadCsv(path);
  std::remove(path.c_str());
  int allocs = 0, frees = 0, fails = 0;
  std::string alloc_tenant, free_tenant;
  for (const auto& r : rows) {
    ASSERT_GE(r.size(), 7u);
    if (r[2] == "allocate") {
      ++allocs;
      alloc_tenant = r[6];
    } else if (r[2] == "free") {
      ++frees;
      free_tenant = r[6];
    } else if (r[2] == "allocate failure") {
      ++fails;
    }
  }
  EXPECT_EQ(allocs, kN);
  EXPECT_EQ(frees, kN);
  EXPECT_EQ(fails, 2);
  EXPECT_EQ(alloc_tenant, free_tenant);
  EXPECT_NE(free_tenant, "0");
  EXPECT_EQ(Stat("num_invalid_frees"), 1);
  EXPECT_EQ(Stat("allocation.all.current"), 0);
}

TEST_F(AttackChild, EighteenDevices) {
  const std::string info = g_api.info();
  ASSERT_EQ(JsonInt(info, "device_count"), 18) << info;
  for (int round = 0; round < 3; ++round) {
    for (int d : {0, 15, 16, 17}) {
      ASSERT_EQ(g_api.set_model(round == 1 ? "r1" : nullptr), 0);
      void* p = g_api.malloc(4096, d, nullptr);
      void* q = g_api.malloc(4096, d, nullptr);
      ASSERT_NE(p, nullptr) << d << LastError();
      ASSERT_NE(q, nullptr) << d << LastError();
      EXPECT_EQ(Stat("allocation.all.current", d), 2) << d;
      g_api.free(p, 4095, d, nullptr);  // refused
      EXPECT_EQ(Stat("allocation.all.current", d), 2) << d;
      g_api.free(p, 4096, d, nullptr);
      g_api.free(q, 4096, d, nullptr);
      EXPECT_EQ(Stat("allocation.all.current", d), 0) << d;
    }
  }
  // A device-16 pointer freed as device 17 (both open) and as 18 (none).
  void* p = g_api.malloc(8192, 16, nullptr);
  ASSERT_NE(p, nullptr);
  g_api.free(p, 8192, 17, nullptr);
  EXPECT_NE(LastError().find("on device 16"), std::string::npos) << LastError();
  g_api.free(p, 8192, 18, nullptr);
  EXPECT_NE(LastError().find("on device 16"), std::string::npos) << LastError();
  EXPECT_EQ(Stat("allocation.all.current", 16), 1);
  g_api.free(p, 8192, 16, nullptr);
  EXPECT_EQ(Stat("allocation.all.current", 16), 0);
  // The r1 model on 16/17 has its own session there.
  const std::string s = Stats(17);
  EXPECT_EQ(JsonInt(ModelJson(s, "r1"), "num_allocs"), 2) << s;
  EXPECT_EQ(JsonInt(ModelJson(s, "default"), "num_allocs"), 4) << s;
  bool runtime = false;
  try {
    (void)g_api.malloc(512, 18, nullptr);
  } catch (const std::bad_alloc&) {
  } catch (const std::runtime_error&) {
    runtime = true;
  }
  EXPECT_TRUE(runtime);
  EXPECT_EQ(g_api.shutdown(0), 0) << LastError();
}

// ---- ModelSession::Deallocate with the stored FreeCheck ---------------------

class SessionAttack : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_ =
        std::move(ctxpool::SimDriver::CreateFromSpec("sim:2xa10-24gb")).value();
    ctxpool::DeviceContextOptions o;
    o.use_option_table = false;
    o.stream_pool_reserve = 0;
    dc0_ = std::move(ctxpool::DeviceContext::Create(*sim_, 0, o)).value();
    dc1_ = std::move(ctxpool::DeviceContext::Create(*sim_, 1, o)).value();
  }
  void TearDown() override {
    sessions_.clear();
    for (auto* dc : {dc0_.get(), dc1_.get()}) {
      EXPECT_TRUE(dc->device_allocator().CheckInvariants().ok());
    }
    dc0_.reset();
    dc1_.reset();
    EXPECT_EQ(sim_->misuse_count(), 0u);
    EXPECT_EQ(sim_->used_bytes(0), 0u);
    EXPECT_EQ(sim_->used_bytes(1), 0u);
  }
  ctxpool::ModelSession& Open(ctxpool::DeviceContext& dc,
                              const std::string& name) {
    auto s = dc.OpenSession(name, {.streams = 1});
    EXPECT_TRUE(s.ok()) << s.status();
    sessions_.push_back(std::move(s).value());
    return *sessions_.back();
  }
  std::unique_ptr<ctxpool::SimDriver> sim_;
  std::unique_ptr<ctxpool::DeviceContext> dc0_, dc1_;
  std::vector<std::unique_ptr<ctxpool::ModelSession>> sessions_;
};

TEST_F(SessionAttack, EachSessionFreesOnlyItsOwnBlocks) {
  // Many sessions, so that owner ids differ from 1/0/kAnyOwner patterns.
  std::vector<ctxpool::ModelSession*> ss;
  std::vector<ctxpool::DevicePtr> ps;
  for (int i = 0; i < 12; ++i) {
    ss.push_back(&Open(*dc0_, "s" + std::to_string(i)));
    auto p = ss.back()->Allocate(4096, ss.back()->stream(0));
    ASSERT_TRUE(p.ok()) << p.status();
    ps.push_back(*p);
  }
  for (int i = 0; i < 12; ++i) {
    ctxpool::ModelSession& other = *ss[(i + 1) % 12];
    absl::Status wrong = other.Deallocate(ps[i]);
    EXPECT_TRUE(absl::IsInvalidArgument(wrong)) << wrong;
    EXPECT_NE(wrong.message().find("'" + other.name() + "'"), std::string::npos)
        << wrong;
    EXPECT_EQ(ss[i]->Stats().live_allocations, 1) << i;
    EXPECT_EQ(other.Stats().invalid_frees, 1) << i;
    // Through the allocator handle too.
    absl::Status wrong2 = other.device_allocator().Deallocate(ps[i]);
    EXPECT_TRUE(absl::IsInvalidArgument(wrong2)) << wrong2;
    EXPECT_EQ(ss[i]->Stats().live_allocations, 1) << i;
  }
  for (int i = 0; i < 12; ++i) {
    EXPECT_TRUE(ss[i]->Deallocate(ps[i]).ok()) << i;
    absl::Status twice = ss[i]->Deallocate(ps[i]);
    EXPECT_TRUE(absl::IsInvalidArgument(twice)) << twice;
    EXPECT_NE(twice.message().find("'s" + std::to_string(i) + "'"),
              std::string::npos)
        << twice;
    EXPECT_EQ(ss[i]->Stats().live_allocations, 0);
    EXPECT_EQ(ss[i]->Stats().num_frees, 1);
  }
}

TEST_F(SessionAttack, ForeignAndCrossDevicePointersAreRefused) {
  ctxpool::ModelSession& a = Open(*dc0_, "a");
  ctxpool::ModelSession& b = Open(*dc1_, "b");
  auto pa = a.Allocate(8192, a.stream(0));
  auto pb = b.Allocate(8192, b.stream(0));
  ASSERT_TRUE(pa.ok() && pb.ok());
  // b's pointer freed through a (another device's allocator).
  absl::Status s = a.Deallocate(*pb);
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("'a'"), std::string::npos) << s;
  EXPECT_EQ(b.Stats().live_allocations, 1);
  // Interior and bogus pointers.
  EXPECT_TRUE(absl::IsInvalidArgument(
      a.Deallocate(ctxpool::DevicePtr(pa->address() + 512))));
  EXPECT_TRUE(absl::IsInvalidArgument(a.Deallocate(ctxpool::DevicePtr(1))));
  EXPECT_TRUE(absl::IsInvalidArgument(a.Deallocate(ctxpool::DevicePtr())));
  EXPECT_EQ(a.Stats().live_allocations, 1);
  EXPECT_EQ(a.Stats().invalid_frees, 4);
  // A bare block of the allocator (no owner) is not a's either.
  auto bare = dc0_->device_allocator().Allocate(4096, a.stream(0));
  ASSERT_TRUE(bare.ok());
  absl::Status s2 = a.Deallocate(*bare);
  EXPECT_TRUE(absl::IsInvalidArgument(s2)) << s2;
  EXPECT_TRUE(dc0_->device_allocator().Lookup(*bare).ok());
  EXPECT_TRUE(dc0_->device_allocator().Deallocate(*bare).ok());
  // The sized free checks the owner as well as the size.
  auto pa2 = a.Allocate(1000, a.stream(0));
  ASSERT_TRUE(pa2.ok());
  ctxpool::ModelSession& a2 = Open(*dc0_, "a2");
  EXPECT_TRUE(absl::IsInvalidArgument(a2.Deallocate(*pa2, 1000, a2.stream(0))));
  EXPECT_TRUE(absl::IsInvalidArgument(a.Deallocate(*pa2, 999, a.stream(0))));
  EXPECT_EQ(a.Stats().live_allocations, 2);
  EXPECT_TRUE(a.Deallocate(*pa2, 1000, a.stream(0)).ok());
  EXPECT_TRUE(a.Deallocate(*pa).ok());
  EXPECT_TRUE(b.Deallocate(*pb).ok());
}

TEST_F(SessionAttack, AReopenedModelCannotFreeTheClosedSessionsOldPointer) {
  ctxpool::ModelSession& old = Open(*dc0_, "m");
  auto p = old.Allocate(4096, old.stream(0));
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(old.Deallocate(*p).ok());
  ASSERT_TRUE(old.Close().ok());
  ctxpool::ModelSession& fresh = Open(*dc0_, "m");
  EXPECT_NE(fresh.owner(), old.owner());
  auto q = fresh.Allocate(4096, fresh.stream(0));  // may reuse p's address
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(old.Deallocate(*q).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(fresh.Stats().live_allocations, 1);
  EXPECT_TRUE(fresh.Deallocate(*q).ok());
}

TEST_F(SessionAttack, ConcurrentCrossSessionFreesAreAllRefused) {
  ctxpool::ModelSession& a = Open(*dc0_, "a");
  ctxpool::ModelSession& b = Open(*dc0_, "b");
  constexpr int kN = 400;
  std::vector<ctxpool::DevicePtr> pa, pb;
  for (int i = 0; i < kN; ++i) {
    pa.push_back(*a.Allocate(1024, a.stream(0)));
    pb.push_back(*b.Allocate(1024, b.stream(0)));
  }
  std::atomic<int> wrongly_ok{0};
  std::thread t1([&] {
    for (auto p : pb)
      if (a.Deallocate(p).ok()) ++wrongly_ok;
  });
  std::thread t2([&] {
    for (auto p : pa)
      if (b.Deallocate(p).ok()) ++wrongly_ok;
  });
  t1.join();
  t2.join();
  EXPECT_EQ(wrongly_ok.load(), 0);
  EXPECT_EQ(a.Stats().live_allocations, kN);
  EXPECT_EQ(b.Stats().live_allocations, kN);
  EXPECT_EQ(a.Stats().invalid_frees, kN);
  EXPECT_EQ(b.Stats().invalid_frees, kN);
  for (auto p : pa) EXPECT_TRUE(a.Deallocate(p).ok());
  for (auto p : pb) EXPECT_TRUE(b.Deallocate(p).ok());
}

}  // namespace
