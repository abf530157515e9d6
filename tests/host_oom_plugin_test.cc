// Host memory running out inside the PyTorch plugin's C functions, one
// allocation at a time (tests/host_oom_sweep.h's idea): for k = 0, 1, ...
// the k-th host allocation of a call fails. No exception may leave a C
// function but ctxpool_malloc's documented std::bad_alloc, and with memory
// back the books must match: every block the calls returned frees, nothing
// stays live, and the state shuts down cleanly.
//
// The plugin's source is compiled into this test (tests/torch_plugin.cmake)
// rather than dlopened, so that its simulated driver is this binary's and
// heap_counter.h leaves the driver's own allocations alone, as the other
// sweeps do (the simulator is not the code under test).
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "heap_counter.h"
#include "host_oom_sweep.h"
#include "torch_plugin_api.h"

#ifdef CTXPOOL_PLUGIN_LINKED
#include "ctxpool_torch.h"
#endif

namespace {

#ifdef CTXPOOL_PLUGIN_LINKED

using torch_plugin_test::JsonInt;

constexpr std::size_t kGiB = std::size_t{1} << 30;

std::string Stats(int device) {
  const char* s = ctxpool_memory_stats(device);
  EXPECT_NE(s, nullptr) << ctxpool_last_error();
  return s == nullptr ? std::string() : std::string(s);
}

struct Call {
  const char* name;
  std::function<void()> run;
  bool may_throw = false;  // ctxpool_malloc's documented std::bad_alloc
  std::function<void()> setup = nullptr;  // more set-up, after p_
};

class HostOomPlugin : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef CTXPOOL_TEST_TSAN
    GTEST_SKIP() << "TSan replaces operator new";
#endif
    setenv("CTXPOOL_DRIVER", "sim:2xa10-24gb", /*overwrite=*/1);
  }
  void TearDown() override {
    ctxpool_set_model(nullptr);
    EXPECT_EQ(ctxpool_shutdown(/*force=*/1), 0) << ctxpool_last_error();
  }

  // Sweeps `c` (host_oom_sweep.h): a fresh state with block p_ of model "m"
  // live on device 0, c.setup, then c.run with host allocation k failing,
  // then the checks.
  void Sweep(const Call& c) {
    SCOPED_TRACE(c.name);
    ctxpool::test::SweepHostAllocations({
        .fresh =
            [&] {
              ASSERT_EQ(ctxpool_shutdown(1), 0) << ctxpool_last_error();
              ASSERT_EQ(ctxpool_set_model("m"), 0);
              p_ = ctxpool_malloc(4096, 0, nullptr);
              ASSERT_NE(p_, nullptr);
              got_.clear();
              got_.reserve(4);  // the test's own bookkeeping must not allocate
              escaped_ = nullptr;
            },
        .setup =
            [&] {
              if (c.setup) c.setup();
            },
        .op =
            [&] {
              // Noted, not reported here: the countdown may still be armed.
              try {
                c.run();
              } catch (const std::bad_alloc&) {
                if (c.may_throw) throw;
                escaped_ = "std::bad_alloc";
              } catch (const std::exception&) {
                escaped_ = "an exception";
              }
            },
        .give_back = [&] { CheckAndFreeAll(); },
        .in_op = &in_op_,
    });
  }

  // With memory back: nothing escaped, the books match what the call
  // returned, and everything frees.
  void CheckAndFreeAll() {
    EXPECT_EQ(escaped_, nullptr) << "an exception left the C function";
    ASSERT_NE(ctxpool_last_error(), nullptr);
    ctxpool_set_model(nullptr);
    // What the call returned, and p_ unless the call freed it.
    for (const auto& [ptr, size, device] : got_) {
      ctxpool_free(ptr, size, device, nullptr);
    }
    if (JsonInt(Stats(0), "allocation.all.current") == 1) {
      ctxpool_free(p_, 4096, 0, nullptr);
    }
    for (int d = 0; d < 2; ++d) {
      const std::string st = Stats(d);
      EXPECT_EQ(JsonInt(st, "allocation.all.current"), 0) << st;
      EXPECT_EQ(JsonInt(st, "num_invalid_frees"), 0) << st;
    }
    // Nothing live and nothing leaked: a plain shutdown succeeds.
    EXPECT_EQ(ctxpool_shutdown(0), 0) << ctxpool_last_error();
  }

  void* p_ = nullptr;
  bool in_op_ = false;
  const char* escaped_ = nullptr;  // what left the C function, if anything
  struct Got {
    void* ptr;
    std::size_t size;
    int device;
  };
  std::vector<Got> got_;  // blocks the call under the countdown returned
};

TEST_F(HostOomPlugin, FirstMallocOfAModel) {
  Sweep({"first malloc of a model on a new device", [&] {
           ctxpool_set_model("a-model-whose-name-needs-the-heap-0123456789");
           if (void* q = ctxpool_try_malloc(4096, 1, nullptr)) {
             got_.push_back({q, 4096, 1});
           }
         }});
}

TEST_F(HostOomPlugin, MallocOfANewSegment) {
  Sweep({"ctxpool_try_malloc of a new segment", [&] {
           if (void* q = ctxpool_try_malloc(300 << 20, 0, nullptr)) {
             got_.push_back({q, 300 << 20, 0});
           }
         }});
  Sweep({"ctxpool_malloc of a new segment",
         [&] {
           if (void* q = ctxpool_malloc(300 << 20, 0, nullptr)) {
             got_.push_back({q, 300 << 20, 0});
           }
         },
         /*may_throw=*/true});
}

TEST_F(HostOomPlugin, Free) {
  Sweep({"ctxpool_free", [&] { ctxpool_free(p_, 4096, 0, nullptr); }});
}

TEST_F(HostOomPlugin, BudgetsStreamsAndReports) {
  const std::string path = ::testing::TempDir() + "/ctxpool_host_oom_plugin";
  for (const Call& c : std::vector<Call>{
           {"ctxpool_set_model_budget",
            [] { ctxpool_set_model_budget("budgeted-model-long-name", kGiB); }},
           {"ctxpool_model_stream", [] { (void)ctxpool_model_stream(1, 0); }},
           {"ctxpool_record_stream",
            [&] {
              (void)ctxpool_record_stream(p_, ctxpool_model_stream(0, 0));
            }},
           {"ctxpool_memory_stats", [] { (void)ctxpool_memory_stats(0); }},
           {"ctxpool_info", [] { (void)ctxpool_info(); }},
           {"ctxpool_get_model", [] { (void)ctxpool_get_model(); }},
           {"ctxpool_snapshot", [&] { (void)ctxpool_snapshot(path.c_str()); }},
           {"ctxpool_empty_cache", [] { (void)ctxpool_empty_cache(); }},
           {"ctxpool_last_error", [] { (void)ctxpool_last_error(); }},
       }) {
    Sweep(c);
  }
  std::remove(path.c_str());
}

TEST_F(HostOomPlugin, Shutdown) {
  // Forced, with blocks live on both devices in two models: the device
  // allocators' destructors run with host memory out.
  void* a = nullptr;
  void* b = nullptr;
  Sweep({.name = "ctxpool_shutdown(1) with live blocks",
         .run =
             [&] {
               if (ctxpool_shutdown(1) != 0) {  // refused: all still live
                 got_.push_back({a, 300 << 20, 1});
                 got_.push_back({b, 4096, 0});
               }
             },
         .setup =
             [&] {
               ctxpool_set_model("second-model-with-a-long-enough-name");
               a = ctxpool_try_malloc(300 << 20, 1, nullptr);
               b = ctxpool_try_malloc(4096, 0, nullptr);
               ASSERT_NE(a, nullptr);
               ASSERT_NE(b, nullptr);
               ctxpool_set_model(nullptr);
             }});
  // Plain, with everything freed.
  Sweep({.name = "ctxpool_shutdown(0) after frees",
         .run = [] { (void)ctxpool_shutdown(0); },
         .setup = [&] { ctxpool_free(p_, 4096, 0, nullptr); }});
}

// Names with control characters are escaped in the stats and the snapshot
// (\u00XX); that too must survive host memory running out.
TEST_F(HostOomPlugin, ReportsOfAModelWithControlCharacters) {
  const std::string path = ::testing::TempDir() + "/ctxpool_host_oom_ctl";
  for (const Call& c : std::vector<Call>{
           {"ctxpool_memory_stats", [] { (void)ctxpool_memory_stats(0); }},
           {"ctxpool_snapshot", [&] { (void)ctxpool_snapshot(path.c_str()); }},
       }) {
    Call named = c;
    named.setup = [&] {
      ctxpool_set_model("\x1b[1mresnet50-imagenet\x1b[0m\x01\x02\x03");
      void* q = ctxpool_malloc(4096, 0, nullptr);
      ASSERT_NE(q, nullptr);
      got_.push_back({q, 4096, 0});
      ctxpool_set_model("m");
    };
    Sweep(named);
  }
  const char* stats = ctxpool_memory_stats(0);
  ASSERT_NE(stats, nullptr);
  std::remove(path.c_str());
}

// Reading the last error when host memory is out returns a note and keeps
// the error: the next read, with memory, gives it again.
TEST_F(HostOomPlugin, ReadingTheLastErrorKeepsIt) {
  int on_stack = 0;
  ctxpool_free(&on_stack, sizeof(on_stack), 0, nullptr);  // refused
  const std::string before = ctxpool_last_error();
  ASSERT_NE(before.find("not a live allocation"), std::string::npos) << before;
  g_fail_allocations = true;
  const char* during = ctxpool_last_error();
  g_fail_allocations = false;
  ASSERT_NE(during, nullptr);
  EXPECT_EQ(std::string(ctxpool_last_error()), before);
}

// With the trace recorder on (CTXPOOL_TRACE=1, read once per process, so
// in a child process): a malloc and a free also record, and name the model.
TEST_F(HostOomPlugin, TracedMallocAndFree) {
  constexpr const char* kMarker = "CTXPOOL_HOST_OOM_CHILD";
  if (!torch_plugin_test::InChildFor(kMarker)) {
    std::string output;
    EXPECT_TRUE(torch_plugin_test::RunTestInChild(
        "HostOomPlugin", "TracedMallocAndFree", kMarker, {"CTXPOOL_TRACE=1"},
        &output))
        << output;
    return;
  }
  const std::string path = ::testing::TempDir() + "/ctxpool_host_oom_trace";
  ASSERT_EQ(ctxpool_write_trace(path.c_str()), 0) << ctxpool_last_error();
  Sweep({"traced first malloc of a model", [&] {
           ctxpool_set_model("a-model-whose-name-needs-the-heap-0123456789");
           if (void* q = ctxpool_try_malloc(4096, 0, nullptr)) {
             got_.push_back({q, 4096, 0});
           }
         }});
  Sweep({"traced free", [&] { ctxpool_free(p_, 4096, 0, nullptr); }});
  Sweep({"ctxpool_write_trace",
         [&] { (void)ctxpool_write_trace(path.c_str()); }});
  std::remove(path.c_str());
}

#else  // !CTXPOOL_PLUGIN_LINKED

TEST(HostOomPlugin, Skipped) {
  GTEST_SKIP() << "the PyTorch plugin is not built "
                  "(CTXPOOL_BUILD_TORCH_PLUGIN=OFF)";
}

#endif  // CTXPOOL_PLUGIN_LINKED

}  // namespace
