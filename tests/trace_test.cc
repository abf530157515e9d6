#include "ctxpool/trace/trace.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

using ::testing::HasSubstr;

TEST(TraceOp, NamesRoundTrip) {
  for (int i = 0; i < kTraceOpCount; ++i) {
    const auto op = static_cast<TraceOp>(i);
    ASSERT_EQ(ParseTraceOp(TraceOpName(op)), op);
  }
  EXPECT_EQ(ParseTraceOp("free_requested"), TraceOp::kFree);
  EXPECT_EQ(ParseTraceOp("segment_alloc"), TraceOp::kSegmentMap);
  EXPECT_EQ(ParseTraceOp("bogus"), std::nullopt);
}

TEST(Trace, ValidateNamesTheFirstBadEvent) {
  Trace t;
  t.Append({.op = TraceOp::kAlloc, .ptr = 1, .size = 10});
  t.Append({.op = TraceOp::kFree, .ptr = 1, .size = 10});
  t.Append({.op = TraceOp::kAlloc, .ptr = 1, .size = 20});  // reuse: fine
  EXPECT_TRUE(t.Validate().ok());
  t.Append({.op = TraceOp::kAlloc, .ptr = 1, .size = 20});
  EXPECT_THAT(t.Validate().message(), HasSubstr("event 3: allocation"));
  t.mutable_events().pop_back();
  t.Append({.op = TraceOp::kFree, .ptr = 2, .size = 0});
  EXPECT_THAT(t.Validate().message(),
              HasSubstr("event 3: free of unknown pointer 0x2"));
  t.mutable_events().back() = {.op = TraceOp::kFree, .ptr = 1, .size = 7};
  EXPECT_THAT(t.Validate().message(), HasSubstr("with size 7"));
  t.mutable_events().back().size = 0;  // size 0 on a free means "unknown"
  EXPECT_TRUE(t.Validate().ok());
}

TEST(Trace, SummaryCountsPeaksAndBuckets) {
  Trace t;
  t.Append({.time_ns = 5,
            .op = TraceOp::kAlloc,
            .ptr = 1,
            .size = 100,
            .stream = 2});
  t.Append({.time_ns = 6,
            .op = TraceOp::kAlloc,
            .tenant = 4,
            .ptr = 2,
            .size = 1000});
  t.Append({.time_ns = 7, .op = TraceOp::kFree, .ptr = 1, .size = 100});
  t.Append({.time_ns = 8, .op = TraceOp::kAlloc, .ptr = 3, .size = 64});
  t.Append({.time_ns = 9, .op = TraceOp::kOom, .size = 1 << 30});
  const TraceSummary s = Summarize(t);
  EXPECT_EQ(s.events, 5u);
  EXPECT_EQ(s.allocs, 3u);
  EXPECT_EQ(s.frees, 1u);
  EXPECT_EQ(s.op_counts[static_cast<int>(TraceOp::kOom)], 1u);
  EXPECT_EQ(s.peak_live_bytes, 1100u);
  EXPECT_EQ(s.peak_live_event, 1u);
  EXPECT_EQ(s.peak_live_count, 2u);
  EXPECT_EQ(s.end_live_bytes, 1064u);
  EXPECT_EQ(s.end_live_count, 2u);
  EXPECT_EQ(s.min_size, 64u);
  EXPECT_EQ(s.max_size, 1000u);
  EXPECT_EQ(s.alloc_bytes, 1164u);
  EXPECT_EQ(s.duration_ns, 4);
  EXPECT_EQ(s.streams, (std::vector<std::uint64_t>{0, 2}));
  EXPECT_EQ(s.tenants, (std::vector<std::uint32_t>{0, 4}));
  ASSERT_EQ(s.size_histogram.size(), 2u);  // [64,128) and [512,1024)
  EXPECT_EQ(s.size_histogram[0].lo, 64u);
  EXPECT_EQ(s.size_histogram[0].count, 2u);  // 100 and 64
  EXPECT_EQ(s.size_histogram[0].bytes, 164u);
  EXPECT_EQ(s.size_histogram[1].lo, 512u);
}

TEST(ByteSize, ParsesAndFormats) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("64MiB"), 64u << 20);
  EXPECT_EQ(*ParseByteSize("24GiB"), 24ull << 30);
  EXPECT_EQ(*ParseByteSize("24gb"), 24'000'000'000ull);
  EXPECT_EQ(*ParseByteSize("1.5G"), 3ull << 29);
  EXPECT_EQ(*ParseByteSize(" 512k "), 512u << 10);
  EXPECT_FALSE(ParseByteSize("-1GiB").ok());
  EXPECT_FALSE(ParseByteSize("GiB").ok());
  EXPECT_FALSE(ParseByteSize("12 parsecs").ok());
  EXPECT_EQ(FormatBytes(512), "512 B");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.50 GiB");
  EXPECT_EQ(FormatBytes(20u << 20), "20.00 MiB");
}

}  // namespace
}  // namespace ctxpool
