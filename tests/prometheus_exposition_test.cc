// A rich Prometheus exposition for the real parsers (tests/metrics.cmake,
// tests/prometheus_check.py): RenderPrometheus(runtime) on two simulated
// devices with open sessions (every ctxpool_model_* gauge has samples),
// model names that need escaping (quote, backslash, newline, tab, UTF-8, and
// bytes that are not UTF-8), a budget rejection, a trim and a closed session
// that leaked.
//
// With CTXPOOL_PROMETHEUS_DUMP=<file> the exposition is written there;
// prometheus_check.py runs this test so, with CTXPOOL_SYSFS_ROOT (a fake
// cgroup) and CTXPOOL_CTX_SCHED set as well. Without it the test only checks
// the exposition has the series it is meant to exercise.
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "ctxpool/context/runtime.h"
#include "ctxpool/telemetry/prometheus.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

// Model names, one per session; the dump's checker expects these (after
// the renderer's U+FFFD replacement for the last one).
const std::vector<std::string>& ModelNames() {
  static const auto* names = new std::vector<std::string>{
      "bert",
      "we\"ird\\name\nx",
      "tab\there",
      "mod\xC3\xA8le-\xE6\xA8\xA1\xE5\x9E\x8B",
      "not-utf8-\xFF\xFE",
  };
  return *names;
}

TEST(PrometheusExposition, RichRuntime) {
  auto rt = std::move(Runtime::Create({.driver = "sim:2xl4-24gb"})).value();
  ASSERT_EQ(rt->devices().size(), 2u);
  std::vector<std::unique_ptr<ModelSession>> sessions;
  std::vector<std::pair<ModelSession*, DevicePtr>> live;
  int i = 0;
  for (const std::string& name : ModelNames()) {
    DeviceContext* dc = rt->devices()[i % 2];
    auto s = dc->OpenSession(name, {.streams = 2, .max_bytes = 64 * kMiB});
    ASSERT_TRUE(s.ok()) << s.status();
    for (int k = 0; k < 4; ++k) {
      auto p = (*s)->Allocate((k + 1) * kMiB, (*s)->stream(k % 2));
      ASSERT_TRUE(p.ok()) << p.status();
      live.emplace_back(s->get(), *p);
    }
    ++i;
    sessions.push_back(std::move(s).value());
  }
  // Some cached memory, a budget rejection, a trim and a leak.
  ASSERT_TRUE(live[1].first->Deallocate(live[1].second).ok());
  live.erase(live.begin() + 1);
  EXPECT_FALSE(sessions[0]->Allocate(80 * kMiB, sessions[0]->stream(0)).ok());
  ASSERT_TRUE(rt->devices()[1]->device_allocator().Trim(0).ok());
  {
    auto gone = std::move(rt->devices()[1]->OpenSession("gone", {})).value();
    ASSERT_TRUE(gone->Allocate(3000, gone->stream(0), "leak").ok());
    EXPECT_FALSE(gone->Close().ok());
  }

  const std::string text = RenderPrometheus(*rt);
  EXPECT_NE(text.find("ctxpool_model_live_bytes{device=\"1\",model=\"we\\\"ird"
                      "\\\\name\\nx\"} "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("model=\"not-utf8-\xEF\xBF\xBD\xEF\xBF\xBD\""),
            std::string::npos);
  EXPECT_NE(text.find("ctxpool_model_leaked_bytes_total{device=\"1\","
                      "model=\"gone\"} 3072\n"),
            std::string::npos);
  EXPECT_NE(text.find("ctxpool_model_budget_rejections_total{device=\"0\","
                      "model=\"bert\"} 1\n"),
            std::string::npos);

  if (const char* dump = std::getenv("CTXPOOL_PROMETHEUS_DUMP");
      dump != nullptr && *dump != '\0') {
    std::ofstream out(dump, std::ios::binary | std::ios::trunc);
    out << text;
    out.close();
    EXPECT_TRUE(out) << "cannot write " << dump;
  }

  for (const auto& [s, p] : live) ASSERT_TRUE(s->Deallocate(p).ok());
}

}  // namespace
}  // namespace ctxpool
