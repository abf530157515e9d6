#include "ctxpool/trace/recorder.h"

#include <thread>
#include <vector>

#include "ctxpool/trace/trace_io.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

TEST(TraceRecorder, OffByDefaultAndRecordsNothing) {
  TraceRecorder r;
  EXPECT_FALSE(r.enabled());
  EXPECT_EQ(r.capacity(), 0u);
  r.Record(TraceOp::kAlloc, 1, 2, 3);
  EXPECT_EQ(r.recorded(), 0u);
  EXPECT_TRUE(r.Snapshot().empty());
}

TEST(TraceRecorder, RecordsInOrderWithTimeAndThread) {
  TraceRecorder r;
  r.Enable(16);
  ASSERT_TRUE(r.enabled());
  r.Record(TraceOp::kAlloc, 0x10, 512, 7, 3);
  r.Record(TraceOp::kFree, 0x10, 512, 7, 3);
  const Trace t = r.Snapshot();
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t.dropped_events(), 0u);
  EXPECT_EQ(t.events()[0].op, TraceOp::kAlloc);
  EXPECT_EQ(t.events()[0].stream, 7u);
  EXPECT_EQ(t.events()[0].tenant, 3u);
  EXPECT_EQ(t.events()[0].thread, TraceRecorder::ThreadId());
  EXPECT_LE(t.events()[0].time_ns, t.events()[1].time_ns);
  EXPECT_TRUE(t.Validate().ok());
  r.Disable();
  r.Record(TraceOp::kAlloc, 0x20, 1, 0);
  EXPECT_EQ(r.Snapshot().size(), 2u);  // kept, nothing added
}

TEST(TraceRecorder, RingOverwritesOldestAndCountsDrops) {
  TraceRecorder r;
  r.Enable(4);
  for (std::uint64_t i = 0; i < 10; ++i) {
    r.Record(TraceEvent{.time_ns = static_cast<std::int64_t>(i),
                        .op = TraceOp::kAlloc,
                        .ptr = i});
  }
  const Trace t = r.Snapshot();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t.dropped_events(), 6u);
  for (std::uint64_t i = 0; i < 4; ++i) EXPECT_EQ(t.events()[i].ptr, 6 + i);
  EXPECT_EQ(r.recorded(), 10u);
  r.Clear();
  EXPECT_TRUE(r.Snapshot().empty());
  EXPECT_TRUE(r.enabled());
}

TEST(TraceRecorder, WrappedTraceReadsBackWithSynthesizedAllocs) {
  TraceRecorder r;
  r.Enable(3);
  r.Record(TraceOp::kAlloc, 0x1, 100, 0);
  r.Record(TraceOp::kAlloc, 0x2, 200, 0);
  r.Record(TraceOp::kFree, 0x1, 100, 0);
  r.Record(TraceOp::kFree, 0x2, 200, 0);  // overwrites the alloc of 0x1
  const std::string csv = WriteTraceCsv(r.Snapshot());
  EXPECT_FALSE(ParseTrace(csv, "r").ok());
  absl::StatusOr<Trace> t = ParseTrace(
      csv, "r", {.unknown_free = UnknownFreePolicy::kSynthesizeAlloc});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->size(), 4u);
  EXPECT_TRUE(t->Validate().ok());
}

TEST(TraceRecorder, ConcurrentRecordersLoseNothing) {
  TraceRecorder r;
  constexpr int kThreads = 4, kPerThread = 2000;
  r.Enable(kThreads * kPerThread);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&r, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::uint64_t ptr = (static_cast<std::uint64_t>(t) << 32) | i;
        r.Record(TraceOp::kAlloc, ptr, 64, t);
        r.Record(TraceOp::kFree, ptr, 64, t);
      }
    });
  }
  // Enabled checks and snapshots race with recording, safely.
  for (int i = 0; i < 10; ++i) (void)r.Snapshot().size();
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(r.recorded(), 2u * kThreads * kPerThread);
  // Capacity is half the events: the newest half is kept.
  EXPECT_EQ(r.Snapshot().dropped_events(), 1u * kThreads * kPerThread);
}

}  // namespace
}  // namespace ctxpool
