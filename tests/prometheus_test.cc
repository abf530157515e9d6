#include "ctxpool/telemetry/prometheus.h"

#include <unistd.h>

#include <cmath>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ctxpool/alloc/device_allocator.h"
#include "ctxpool/driver/sim_driver.h"
#include "fake_cgroup.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

constexpr int kAgg = static_cast<int>(StatPool::kAggregate);

// A parsed exposition: "name{k="v",...}" (labels in the order written, values
// unescaped) -> value.
struct Exposition {
  std::map<std::string, double> samples;
  std::map<std::string, std::string> types;  // family -> type
  std::set<std::string> helps;
};

std::string Unescape(const std::string& v) {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] == '\\' && i + 1 < v.size()) {
      ++i;
      out += v[i] == 'n' ? '\n' : v[i];
    } else {
      out += v[i];
    }
  }
  return out;
}

// Parses `text` against the text format 0.0.4, failing the test on any line
// that does not match it.
Exposition Parse(const std::string& text) {
  static const std::string kName = "[a-zA-Z_:][a-zA-Z0-9_:]*";
  static const std::string kLabelName = "[a-zA-Z_][a-zA-Z0-9_]*";
  static const std::string kLabelValue = R"re("((?:[^"\\\n]|\\[\\"n])*)")re";
  static const std::string kNumber =
      R"re([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?Inf|NaN)re";
  static const std::regex help("^# HELP (" + kName + ") (.*)$");
  static const std::regex type("^# TYPE (" + kName +
                               ") (counter|gauge|histogram|summary|untyped)$");
  static const std::regex sample("^(" + kName + ")(?:\\{((?:" + kLabelName +
                                 "=" + kLabelValue + ")(?:," + kLabelName +
                                 "=" + kLabelValue + ")*)?\\})? (" + kNumber +
                                 ")(?: -?[0-9]+)?$");
  static const std::regex label("(" + kLabelName + ")=" + kLabelValue);
  Exposition e;
  std::string family;
  std::set<std::string> finished;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  EXPECT_TRUE(text.empty() || text.back() == '\n');
  while (std::getline(in, line)) {
    ++n;
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      EXPECT_TRUE(e.helps.insert(m[1]).second) << "second HELP: " << line;
    } else if (std::regex_match(line, m, type)) {
      EXPECT_EQ(e.types.count(m[1]), 0u) << "second TYPE: " << line;
      EXPECT_EQ(finished.count(m[1]), 0u) << line;
      if (!family.empty()) finished.insert(family);
      family = m[1];
      e.types[family] = m[2];
    } else if (std::regex_match(line, m, sample)) {
      const std::string name = m[1];
      EXPECT_EQ(name, family) << "sample outside its family: " << line;
      if (e.types[family] == "counter") {
        EXPECT_TRUE(name.size() > 6 && name.substr(name.size() - 6) == "_total")
            << line;
      }
      std::string key = name + "{";
      const std::string labels = m[2];
      bool first = true;
      for (std::sregex_iterator it(labels.begin(), labels.end(), label), end;
           it != end; ++it) {
        absl::StrAppend(&key, first ? "" : ",", (*it)[1].str(), "=",
                        Unescape((*it)[2].str()));
        first = false;
      }
      key += "}";
      const std::string value = m[m.size() - 1];
      EXPECT_TRUE(e.samples.emplace(key, std::stod(value)).second)
          << "duplicate sample: " << line;
    } else {
      ADD_FAILURE() << "line " << n << " is not in the text format: '" << line
                    << "'";
    }
  }
  for (const auto& [f, t] : e.types) {
    EXPECT_EQ(e.helps.count(f), 1u) << "no HELP for " << f;
    EXPECT_EQ(f.rfind("ctxpool_", 0), 0u) << f;
  }
  return e;
}

class PrometheusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sim_ = SimDriver::Create({.devices = {*SimDevicePreset("a10-24gb")}});
    DeviceContextOptions o;
    o.use_option_table = false;
    dc_ = std::move(DeviceContext::Create(*sim_, 0, o)).value();
  }
  std::unique_ptr<SimDriver> sim_;
  std::unique_ptr<DeviceContext> dc_;
};

TEST_F(PrometheusTest, ParsesAndEqualsStats) {
  const std::string weird = "we\"ird\\name\nx";
  auto bert = std::move(dc_->OpenSession("bert", {.streams = 2})).value();
  auto odd = std::move(dc_->OpenSession(weird, {.max_bytes = 1 << 20})).value();
  std::vector<DevicePtr> keep;
  for (int i = 0; i < 5; ++i) {
    keep.push_back(*bert->Allocate((i + 1) << 20, bert->stream(i % 2)));
  }
  ASSERT_TRUE(bert->Deallocate(keep[1]).ok());
  ASSERT_TRUE(bert->Deallocate(keep[3]).ok());
  auto small = odd->Allocate(1000, odd->stream(0));
  ASSERT_TRUE(small.ok());
  EXPECT_FALSE(odd->Allocate(2 << 20, odd->stream(0)).ok());  // over budget
  {
    auto gone = std::move(dc_->OpenSession("gone", {})).value();
    ASSERT_TRUE(gone->Allocate(3000, gone->stream(0), "leak").ok());
    EXPECT_FALSE(gone->Close().ok());
  }
  ASSERT_TRUE(dc_->device_allocator().Trim(0).ok());

  const std::string text = RenderPrometheus(*dc_);
  const Exposition e = Parse(text);
  ASSERT_FALSE(HasFailure()) << text;

  const DeviceAllocatorStats a = dc_->device_allocator().Stats();
  const FragmentationStats f = dc_->device_allocator().Fragmentation();
  const DeviceContextStats d = dc_->Stats();
  auto dev = [&](const std::string& name) {
    auto it = e.samples.find(name + "{device=0}");
    EXPECT_NE(it, e.samples.end()) << name;
    return it == e.samples.end() ? -1.0 : it->second;
  };
  auto model = [&](const std::string& name, const std::string& m) {
    auto it = e.samples.find(name + "{device=0,model=" + m + "}");
    EXPECT_NE(it, e.samples.end()) << name << " " << m;
    return it == e.samples.end() ? -1.0 : it->second;
  };
  EXPECT_EQ(dev("ctxpool_device_live_bytes"),
            a.total.allocated_bytes[kAgg].current);
  EXPECT_EQ(dev("ctxpool_device_mapped_bytes"),
            a.total.reserved_bytes[kAgg].current);
  EXPECT_EQ(dev("ctxpool_device_cached_bytes"),
            a.total.reserved_bytes[kAgg].current -
                a.total.allocated_bytes[kAgg].current);
  EXPECT_EQ(dev("ctxpool_device_peak_bytes"),
            a.total.allocated_bytes[kAgg].peak);
  EXPECT_NEAR(dev("ctxpool_device_fragmentation_ratio"), f.external, 1e-5);
  EXPECT_EQ(dev("ctxpool_device_ooms_total"), a.num_ooms);
  EXPECT_EQ(dev("ctxpool_device_trims_total"), a.num_trims);
  EXPECT_GE(a.num_trims, 1);
  EXPECT_EQ(dev("ctxpool_device_cache_hits_total"), a.cache_hits);
  EXPECT_EQ(dev("ctxpool_device_context_bytes"),
            sim_->device_spec(0).context_overhead_bytes);
  EXPECT_EQ(dev("ctxpool_device_leaked_bytes_total"), d.leaked_bytes);
  EXPECT_EQ(dev("ctxpool_device_leaked_bytes_total"), 3072);
  EXPECT_EQ(dev("ctxpool_device_open_sessions"), 2);

  for (const auto* s : {bert.get(), odd.get()}) {
    const SessionStats st = s->Stats();
    const std::string& m = s->name();
    EXPECT_EQ(model("ctxpool_model_live_bytes", m), st.live_bytes) << m;
    EXPECT_EQ(model("ctxpool_model_peak_bytes", m), st.peak_bytes);
    EXPECT_EQ(model("ctxpool_model_mapped_bytes", m), st.mapped_bytes);
    EXPECT_EQ(model("ctxpool_model_cached_bytes", m), st.cached_bytes);
    EXPECT_EQ(model("ctxpool_model_live_allocations", m), st.live_allocations);
    EXPECT_EQ(model("ctxpool_model_max_bytes", m), st.max_bytes);
    EXPECT_EQ(model("ctxpool_model_ooms_total", m), st.num_ooms);
    EXPECT_EQ(model("ctxpool_model_budget_rejections_total", m),
              st.num_budget_rejections);
    EXPECT_NEAR(model("ctxpool_model_fragmentation_ratio", m), st.fragmentation,
                1e-5);
  }
  EXPECT_EQ(model("ctxpool_model_live_bytes", "bert"), (1 + 3 + 5) << 20);
  EXPECT_EQ(model("ctxpool_model_budget_rejections_total", weird), 1);
  EXPECT_EQ(model("ctxpool_model_leaked_bytes_total", "gone"), 3072);
  EXPECT_EQ(model("ctxpool_model_leaked_allocations_total", "gone"), 1);
  EXPECT_EQ(model("ctxpool_model_leaked_bytes_total", "bert"), 0);
  // A closed model keeps its leak counters but has no live gauges.
  EXPECT_EQ(e.samples.count("ctxpool_model_live_bytes{device=0,model=gone}"),
            0u);

  for (DevicePtr p : {keep[0], keep[2], keep[4]}) {
    ASSERT_TRUE(bert->Deallocate(p).ok());
  }
  ASSERT_TRUE(odd->Deallocate(*small).ok());
}

TEST_F(PrometheusTest, EmptyDeviceStillParses) {
  const Exposition e = Parse(RenderPrometheus(*dc_));
  EXPECT_EQ(e.samples.at("ctxpool_device_live_bytes{device=0}"), 0);
  EXPECT_EQ(e.types.at("ctxpool_device_ooms_total"), "counter");
  EXPECT_EQ(e.types.at("ctxpool_model_live_bytes"), "gauge");
}

TEST(PrometheusRuntime, RendersEveryDeviceAndTheDriver) {
  auto rt = std::move(Runtime::Create({.driver = "sim:2xl4-24gb"})).value();
  auto s = std::move((*rt->device(1))->OpenSession("m", {})).value();
  auto p = s->Allocate(1 << 20, s->stream(0));
  ASSERT_TRUE(p.ok());
  const std::string text = RenderPrometheus(*rt);
  const Exposition e = Parse(text);
  EXPECT_EQ(e.samples.at("ctxpool_runtime_info{driver=sim}"), 1);
  EXPECT_EQ(e.samples.count("ctxpool_device_live_bytes{device=0}"), 1u);
  EXPECT_EQ(e.samples.at("ctxpool_device_live_bytes{device=1}"), 1 << 20);
  EXPECT_EQ(e.samples.at("ctxpool_model_live_bytes{device=1,model=m}"),
            1 << 20);
  ASSERT_TRUE(s->Deallocate(*p).ok());
}

TEST_F(PrometheusTest, HostAndContextSeriesParse) {
  const Exposition e = Parse(RenderPrometheus(*dc_));
  EXPECT_EQ(e.samples.at("ctxpool_device_pinned_bytes{device=0}"), 0);
  EXPECT_TRUE(
      std::isinf(e.samples.at("ctxpool_device_pinned_budget_bytes{device=0}")));
  EXPECT_NEAR(
      e.samples.at(
          "ctxpool_device_context_created_timestamp_seconds{device=0}"),
      static_cast<double>(dc_->initial_context_report().created_at_ns) / 1e9,
      0.01);
  EXPECT_EQ(
      e.samples.at("ctxpool_device_context_sched_flags{device=0,kind=effective,"
                   "flags=auto}"),
      1);
  EXPECT_EQ(e.samples.at("ctxpool_device_context_sched_mismatch{device=0}"), 0);
}

TEST(PrometheusProcess, CgroupGaugesFromAFakeTree) {
  testing_internal::FakeCgroupRoot root;
  root.Write("proc/self/cgroup", "0::/pod/ctr\n");
  root.Cgroup("/pod", "1073741824", "max");
  root.Cgroup("/pod/ctr", "max", "536870912", "1048576");
  root.Write("sys/fs/cgroup/pod/ctr/memory.stat",
             "active_file 4096\ninactive_file 4096\n");
  const Exposition e =
      Parse(RenderProcessMetrics(ReadCgroupMemory(root.path())));
  EXPECT_EQ(e.samples.at(absl::StrCat("ctxpool_process_info{pid=", getpid(),
                                      ",cgroup=/pod/ctr}")),
            1);
  EXPECT_EQ(e.samples.at("ctxpool_cgroup_memory_max_bytes{}"), 1073741824.0);
  EXPECT_EQ(e.samples.at("ctxpool_cgroup_memory_high_bytes{}"), 536870912.0);
  EXPECT_EQ(e.samples.at("ctxpool_cgroup_memory_current_bytes{}"), 1048576.0);
  EXPECT_EQ(e.samples.at("ctxpool_cgroup_memory_reclaimable_bytes{}"), 8192.0);
  // A v1 host: the info line with an empty cgroup, no limit gauges.
  root.Write("proc/self/cgroup", "4:memory:/x\n");
  const Exposition v1 =
      Parse(RenderProcessMetrics(ReadCgroupMemory(root.path())));
  EXPECT_EQ(v1.samples.count("ctxpool_cgroup_memory_max_bytes{}"), 0u);
  EXPECT_EQ(v1.samples.at(absl::StrCat("ctxpool_process_info{pid=", getpid(),
                                       ",cgroup=}")),
            1);
}

TEST(PrometheusEscape, EscapesBackslashQuoteAndNewline) {
  EXPECT_EQ(EscapePrometheusLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapePrometheusLabelValue("plain"), "plain");
}

// promtool (and a Prometheus server, for the whole scrape) rejects a label
// value that is not UTF-8: such bytes become U+FFFD, valid UTF-8 stays.
TEST(PrometheusEscape, ReplacesBytesThatAreNotUtf8) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(
      EscapePrometheusLabelValue("caf\xC3\xA9-\xE6\xA8\xA1\xF0\x9F\x98\x80"),
      "caf\xC3\xA9-\xE6\xA8\xA1\xF0\x9F\x98\x80");
  EXPECT_EQ(EscapePrometheusLabelValue("a\xFF\xFE"
                                       "b"),
            "a" + fffd + fffd + "b");
  // Truncated sequences: one U+FFFD for the prefix.
  EXPECT_EQ(EscapePrometheusLabelValue("\xC3"), fffd);
  EXPECT_EQ(EscapePrometheusLabelValue("\xE6\xA8\""), fffd + "\\\"");
  // Overlong forms, surrogates, code points above U+10FFFF: one per byte.
  EXPECT_EQ(EscapePrometheusLabelValue("\xC0\xAF"), fffd + fffd);
  EXPECT_EQ(EscapePrometheusLabelValue("\xED\xA0\x80"), fffd + fffd + fffd);
  EXPECT_EQ(EscapePrometheusLabelValue("\xF4\x90\x80\x80"),
            fffd + fffd + fffd + fffd);
  EXPECT_EQ(EscapePrometheusLabelValue("\x80\\"), fffd + "\\\\");

  // A model name that is not UTF-8 still renders a parseable exposition.
  auto sim = SimDriver::Create({.devices = {*SimDevicePreset("a10-24gb")}});
  DeviceContextOptions o;
  o.use_option_table = false;
  auto dc = std::move(DeviceContext::Create(*sim, 0, o)).value();
  auto s = std::move(dc->OpenSession("bad\xFFname", {})).value();
  const Exposition e = Parse(RenderPrometheus(*dc));
  EXPECT_EQ(e.samples.count("ctxpool_model_live_bytes{device=0,model=bad" +
                            fffd + "name}"),
            1u);
}

}  // namespace
}  // namespace ctxpool
