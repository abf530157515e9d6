#include "ctxpool/trace/trace_io.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "ctxpool/trace/trace.h"
#include "ctxpool/trace/workloads.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;

std::string DataPath(absl::string_view file) {
  const char* dir = std::getenv("CTXPOOL_TEST_DATA");
  return absl::StrCat(dir != nullptr ? dir : "tests/data", "/", file);
}

TraceEvent Ev(std::int64_t t, TraceOp op, std::uint64_t ptr, std::uint64_t size,
              std::uint64_t stream = 0, std::uint32_t tenant = 0) {
  TraceEvent e;
  e.time_ns = t;
  e.op = op;
  e.ptr = ptr;
  e.size = size;
  e.stream = stream;
  e.tenant = tenant;
  return e;
}

Trace AllOpsTrace() {
  Trace t;
  t.Append(Ev(0, TraceOp::kSegmentMap, 0x7f0000000000, 20 << 20, 3));
  t.Append(Ev(1500, TraceOp::kAlloc, 0x7f0000000000, 4097, 3, 2));
  t.Append(Ev(2000, TraceOp::kAlloc, 0x7f0000002000, 0, 0, 1));
  t.Append(Ev(2500, TraceOp::kFree, 0x7f0000000000, 4097, 3, 2));
  t.Append(Ev(3000, TraceOp::kFreeCompleted, 0x7f0000000000, 4097, 3, 2));
  t.Append(Ev(3600'000'000'123, TraceOp::kOom, 0, 1ull << 40, 3, 2));
  t.Append(Ev(3600'000'000'124, TraceOp::kTrim, 0, 20 << 20, 0));
  t.Append(Ev(3600'000'000'125, TraceOp::kSegmentUnmap, 0x7f0000000000,
              20 << 20, 3));
  t.mutable_events()[1].thread = 77;
  return t;
}

TEST(TraceCsv, RoundTripsEveryOpExactly) {
  const Trace t = AllOpsTrace();
  ASSERT_TRUE(t.Validate().ok());
  const std::string csv = WriteTraceCsv(t);
  EXPECT_THAT(csv,
              HasSubstr("Thread,Time,Action,Pointer,Size,Stream,Tenant\n"));
  EXPECT_THAT(csv, HasSubstr("77,00:00:00.000001500,allocate,0x7f0000000000,"
                             "4097,0x3,2\n"));
  EXPECT_THAT(csv, HasSubstr("01:00:00.000000123,allocate failure,0x0"));
  absl::StatusOr<Trace> back = ParseTrace(csv, "rt");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, t);
}

TEST(TraceCsv, RoundTripsAGeneratedWorkload) {
  const Trace t = MultiStream({.seed = 3, .streams = 3, .ops_per_stream = 300});
  absl::StatusOr<Trace> back = ParseTrace(WriteTraceCsv(t), "rt");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, t);
}

TEST(TraceCsv, RmmCompatibleOutputKeepsOnlyRmmActions) {
  const std::string csv =
      WriteTraceCsv(AllOpsTrace(), {.rmm_compatible = true});
  EXPECT_THAT(csv, HasSubstr("Thread,Time,Action,Pointer,Size,Stream\n"));
  EXPECT_THAT(csv, ::testing::Not(HasSubstr("segment_map")));
  EXPECT_THAT(csv, ::testing::Not(HasSubstr("Tenant")));
  absl::StatusOr<Trace> back = ParseTrace(csv, "rmm");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->size(), 4u);  // 2 allocs, 1 free, 1 failure
}

TEST(TraceCsv, ImportsRmmLogAsItIs) {
  absl::StatusOr<Trace> t = ReadTraceFile(DataPath("rmm_small.csv"));
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 8u);
  const auto& e = t->events();
  EXPECT_EQ(e[0], (TraceEvent{.time_ns = 1000,
                              .op = TraceOp::kAlloc,
                              .tenant = 0,
                              .ptr = 0x7f2a00000000,
                              .size = 1 << 20,
                              .stream = 0,
                              .thread = 140234}));
  EXPECT_EQ(e[2].stream, 0x5a5au);
  EXPECT_EQ(e[4].op, TraceOp::kOom);
  EXPECT_EQ(e[4].size, 1ull << 40);
  // The pointer is reused after its free, as real allocators do.
  EXPECT_EQ(e[5].ptr, e[0].ptr);
  EXPECT_EQ(e[5].time_ns, 1'500'000'000);
  EXPECT_EQ(e[5].thread, 140235u);
  EXPECT_TRUE(t->Validate().ok());
  const TraceSummary s = Summarize(*t);
  EXPECT_EQ(s.allocs, 4u);
  EXPECT_EQ(s.frees, 3u);
  EXPECT_EQ(s.peak_live_bytes, (1u << 20) + 512u + (20u << 20));
  EXPECT_EQ(s.end_live_bytes, 512u);
  EXPECT_EQ(s.streams, (std::vector<std::uint64_t>{0, 0x5a5a}));
}

TEST(TraceCsv, ColumnsAreFoundByNameInAnyOrder) {
  absl::StatusOr<Trace> t = ParseTrace(
      "Size,Pointer,Action\n"
      "64,10,allocate\n"
      "64,10,free\n",
      "x");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 2u);
  EXPECT_EQ(t->events()[0].ptr, 10u);
  EXPECT_EQ(t->events()[1].time_ns, 1000);  // index in microseconds
}

TEST(TraceCsv, RejectsMissingColumnOnTheHeaderLine) {
  absl::StatusOr<Trace> t = ParseTrace(
      "\nThread,Time,Action,Pointer,Stream\n1,00:00:00.0,allocate,0x1,0x0\n",
      "f.csv");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("f.csv:2: missing column Size"));
}

TEST(TraceCsv, RejectsRowWithMissingFields) {
  absl::StatusOr<Trace> t = ParseTrace(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,00:00:00.000001,allocate,0x1000,512,0x0\n"
      "1,00:00:00.000002,free,0x1000,512\n",
      "f.csv");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(),
              HasSubstr("f.csv:3: expected 6 fields, found 5"));
}

TEST(TraceCsv, RejectsFreeOfUnknownPointerWithLineNumber) {
  const std::string path = DataPath("bad_unknown_free.csv");
  absl::StatusOr<Trace> t = ReadTraceFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      t.status().message(),
      HasSubstr(absl::StrCat(path, ":5: free of unknown pointer 0x2000")));
}

TEST(TraceCsv, RejectsNegativeSizeWithLineNumber) {
  absl::StatusOr<Trace> t = ParseTrace(
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "1,00:00:00.000001,allocate,0x1000,512,0x0\n"
      "1,00:00:00.000002,allocate,0x2000,-512,0x0\n",
      "f.csv");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("f.csv:3: negative size -512"));
}

TEST(TraceCsv, RejectsOtherMalformedRows) {
  const std::string header = "Thread,Time,Action,Pointer,Size,Stream\n";
  struct Case {
    std::string row;
    std::string want;
  } cases[] = {
      {"1,00:00:00.1,allocate,0x10,12ab,0x0\n", "f:2: bad size '12ab'"},
      {"1,00:00:00.1,malloc,0x10,12,0x0\n", "f:2: unknown action 'malloc'"},
      {"1,00:00:00.1,allocate,zz,12,0x0\n", "f:2: bad pointer 'zz'"},
      {"1,yesterday,allocate,0x10,12,0x0\n", "f:2: bad time 'yesterday'"},
      {"1,00:61:00.0,allocate,0x10,12,0x0\n", "f:2: bad time '00:61:00.0'"},
      {"1,99999999999:00:00.0,allocate,0x10,12,0x0\n",
       "f:2: bad time '99999999999:00:00.0'"},
      {"1,00:00:00.1,allocate,0x10,12,s1\n", "f:2: bad stream 's1'"},
      {"1,00:00:00.1,allocate,0x10,12,0x0\n1,00:00:00.2,allocate,0x10,8,0x0\n",
       "f:3: allocation of pointer 0x10, which is live"},
      {"1,00:00:00.1,allocate,0x10,12,0x0\n1,00:00:00.2,free,0x10,8,0x0\n",
       "f:3: free of 0x10 with size 8, allocated with size 12"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Trace> t = ParseTrace(header + c.row, "f");
    ASSERT_FALSE(t.ok()) << c.row;
    EXPECT_THAT(t.status().message(), HasSubstr(c.want)) << c.row;
  }
  EXPECT_THAT(ParseTrace("", "f").status().message(),
              HasSubstr("no header line"));
  EXPECT_EQ(ReadTraceFile("/nonexistent/trace.csv").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(TraceCsv, UnknownFreePolicies) {
  const std::string text =
      "Action,Pointer,Size\n"
      "allocate,0x10,12\n"
      "free,0x20,100\n"
      "free,0x10,12\n";
  absl::StatusOr<Trace> synth = ParseTrace(
      text, "f", {.unknown_free = UnknownFreePolicy::kSynthesizeAlloc});
  ASSERT_TRUE(synth.ok()) << synth.status();
  ASSERT_EQ(synth->size(), 4u);
  EXPECT_EQ(synth->events()[0].op, TraceOp::kAlloc);
  EXPECT_EQ(synth->events()[0].ptr, 0x20u);
  EXPECT_EQ(synth->events()[0].size, 100u);
  EXPECT_TRUE(synth->Validate().ok());

  absl::StatusOr<Trace> ignored =
      ParseTrace(text, "f", {.unknown_free = UnknownFreePolicy::kIgnore});
  ASSERT_TRUE(ignored.ok());
  EXPECT_EQ(ignored->size(), 2u);

  // A double free is never explained away.
  absl::StatusOr<Trace> dbl = ParseTrace(
      "Action,Pointer,Size\nallocate,0x10,12\nfree,0x10,12\nfree,0x10,12\n",
      "f", {.unknown_free = UnknownFreePolicy::kSynthesizeAlloc});
  ASSERT_FALSE(dbl.ok());
  EXPECT_THAT(dbl.status().message(), HasSubstr("f:4: free of pointer 0x10"));
}

TEST(TraceJson, ReadsTheDocumentedForm) {
  absl::StatusOr<Trace> t = ReadTraceFile(DataPath("small.trace.json"));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->source(), "handcrafted");
  ASSERT_EQ(t->size(), 6u);
  EXPECT_EQ(t->events()[1].op, TraceOp::kSegmentMap);
  EXPECT_EQ(t->events()[1].ptr, 0x100000u);
  EXPECT_EQ(t->events()[2].stream, 7u);
  EXPECT_EQ(t->events()[2].tenant, 2u);
  EXPECT_EQ(t->events()[4].op, TraceOp::kFreeCompleted);
  EXPECT_EQ(Summarize(*t).peak_live_bytes, 3001000u);
}

TEST(TraceJson, RoundTrips) {
  const Trace t = AllOpsTrace();
  absl::StatusOr<Trace> back = ParseTrace(WriteTraceJson(t), "j");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, t);
}

TEST(TraceJson, RejectsMalformedEventsWithLineNumber) {
  const std::string head = "{\"format\": \"ctxpool-trace\", \"events\": [\n";
  struct Case {
    std::string body;
    std::string want;
  } cases[] = {
      {"{\"op\": \"allocate\", \"ptr\": 1}]}",
       "j:2: event is missing \"size\""},
      {"{\"op\": \"allocate\", \"ptr\": 1, \"size\": 8},\n"
       "{\"op\": \"free\", \"ptr\": 2, \"size\": 8}]}",
       "j:3: free of unknown pointer 0x2"},
      {"\n\n{\"op\": \"allocate\", \"ptr\": 1, \"size\": -8}]}",
       "j:4: negative size -8"},
      {"{\"op\": \"allocate\", \"ptr\": 1, \"size\": 8}",
       "j:2: JSON: expected"},
      {"{\"op\": \"grab\", \"ptr\": 1, \"size\": 8}]}",
       "j:2: unknown op 'grab'"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Trace> t = ParseTrace(head + c.body, "j");
    ASSERT_FALSE(t.ok()) << c.body;
    EXPECT_THAT(t.status().message(), HasSubstr(c.want)) << c.body;
  }
  EXPECT_THAT(ParseTrace("{\"events\": []}", "j").status().message(),
              HasSubstr("format"));
  EXPECT_THAT(
      ParseTrace(
          "{\"format\": \"ctxpool-trace\", \"version\": 2, \"events\": []}",
          "j")
          .status()
          .message(),
      HasSubstr("unsupported version 2"));
}

// Whatever a trace holds, its CSV form reads back: times up to the int64
// limit of nanoseconds (2562047 hours) included.
TEST(TraceCsv, RoundTripsTimesUpToTheInt64Limit) {
  for (std::int64_t t :
       {std::int64_t{9'000'000'000'000'000'000}, std::int64_t{INT64_MAX},
        std::int64_t{7'200'000'000'000'000}}) {
    Trace trace;
    trace.Append(Ev(t, TraceOp::kAlloc, 0x1000, 512));
    trace.Append(Ev(t, TraceOp::kFree, 0x1000, 512));
    absl::StatusOr<Trace> back = ParseTrace(WriteTraceCsv(trace), "big");
    ASSERT_TRUE(back.ok()) << t << ": " << back.status();
    EXPECT_EQ(*back, trace) << t;
    absl::StatusOr<Trace> json = ParseTrace(WriteTraceJson(trace), "big");
    ASSERT_TRUE(json.ok()) << json.status();
    EXPECT_EQ(*json, trace);
  }
  // One nanosecond past the limit is refused, not wrapped.
  const std::string over =
      "Thread,Time,Action,Pointer,Size,Stream\n"
      "0,2562047:47:16.854775808,allocate,0x1000,512,0x0\n";
  EXPECT_THAT(ParseTrace(over, "over").status().message(),
              HasSubstr("bad time"));
}

// A directory, a missing file: a Status naming the path, never an
// exception.
TEST(TraceFile, DirectoryOrMissingFileIsAnError) {
  const std::string dir = DataPath("");
  absl::StatusOr<Trace> t = ReadTraceFile(dir);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("is a directory"));
  absl::StatusOr<Trace> missing = ReadTraceFile(DataPath("no-such.csv"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("no-such.csv"));
}

// A PyTorch snapshot given as a trace: named as a pickle, with the converter.
TEST(TraceFile, PickleIsNamedWithItsConverter) {
  const std::string path = ::testing::TempDir() + "/snapshot.pickle";
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const char bytes[] = "\x80\x04\x95\x02\x00segments";
    std::fwrite(bytes, 1, sizeof(bytes) - 1, f);
    std::fclose(f);
  }
  absl::StatusOr<Trace> t = ReadTraceFile(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("pickle"));
  EXPECT_THAT(t.status().message(), HasSubstr("torch_snapshot_to_trace.py"));
  std::remove(path.c_str());
}

}  // namespace
}  // namespace ctxpool
