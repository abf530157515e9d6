// Tests of the lock-free lookups of the device allocator's cached paths
// (src/alloc/address_map.h): the stream table, the classic segments' page
// map and the expandable ranges' table, alone and with readers racing a
// writer.
#include "../src/alloc/address_map.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "ctxpool/core/segment.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace alloc_internal {
namespace {

constexpr std::uint64_t kMiB = 1 << 20;

TEST(StreamTableTest, FindsWhatWasInsertedIncludingTheNullStream) {
  StreamTable<int> table;
  std::vector<std::unique_ptr<int>> values;
  EXPECT_EQ(table.Find(0), nullptr);
  for (std::uint64_t k = 0; k < 1000; ++k) {
    values.push_back(std::make_unique<int>(static_cast<int>(k)));
    // Handles look like pointers: spaced, aligned.
    table.Insert(k * 0x40, values.back().get());
  }
  EXPECT_EQ(table.size(), 1000u);
  for (std::uint64_t k = 0; k < 1000; ++k) {
    ASSERT_NE(table.Find(k * 0x40), nullptr) << k;
    EXPECT_EQ(*table.Find(k * 0x40), static_cast<int>(k));
  }
  EXPECT_EQ(table.Find(0x41), nullptr);
  EXPECT_EQ(table.Find(1000 * 0x40), nullptr);
  EXPECT_EQ(table.Find(~std::uint64_t{0} - 1), nullptr);
}

// Readers never see a half-made entry while the writer grows the table.
TEST(StreamTableTest, ReadersRaceTheWriter) {
  StreamTable<std::uint64_t> table;
  constexpr std::uint64_t kKeys = 4096;
  std::vector<std::uint64_t> values(kKeys);
  for (std::uint64_t k = 0; k < kKeys; ++k) values[k] = k * 3;
  std::atomic<std::uint64_t> inserted{0};
  std::atomic<bool> bad{false};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      while (inserted.load(std::memory_order_acquire) < kKeys) {
        const std::uint64_t n = inserted.load(std::memory_order_acquire);
        for (std::uint64_t k = 0; k < n; ++k) {
          const std::uint64_t* v = table.Find(k * 0x1000 + 8);
          if (v == nullptr || *v != k * 3) bad = true;
        }
      }
    });
  }
  for (std::uint64_t k = 0; k < kKeys; ++k) {
    table.Insert(k * 0x1000 + 8, &values[k]);
    inserted.store(k + 1, std::memory_order_release);
  }
  for (auto& t : readers) t.join();
  EXPECT_FALSE(bad.load());
}

// Segments do not move; tables of them hold them by pointer.
std::unique_ptr<Segment> NewSegment(std::uint64_t base, std::size_t size) {
  auto s = std::make_unique<Segment>();
  s->base = base;
  s->size = size;
  return s;
}

// Classic segments at any 512 B alignment, of at least a page: the map finds
// each at its first and last byte and nothing outside any.
TEST(SegmentPageMapTest, FindsUnalignedSegmentsSharingPages) {
  SegmentPageMap map(/*page_shift=*/21);
  const std::uint64_t base = std::uint64_t{1} << 52;  // SimDriver's
  auto pa = NewSegment(base + 512, 2 * kMiB);         // ends inside page 1
  Segment& a = *pa;
  auto pb = NewSegment(a.base + a.size, 20 * kMiB);
  Segment& b = *pb;
  auto pc = NewSegment(b.base + b.size + 4096, 2 * kMiB);  // a gap
  Segment& c = *pc;
  map.Insert(&a);
  map.Insert(&b);
  map.Insert(&c);
  for (Segment* s : {&a, &b, &c}) {
    EXPECT_EQ(map.Find(s->base), s);
    EXPECT_EQ(map.Find(s->base + s->size / 2), s);
    EXPECT_EQ(map.Find(s->base + s->size - 1), s);
  }
  // The gap between b and c, and below a: a candidate from the page or
  // nothing, never another segment that does not hold the address.
  const Segment* in_gap = map.Find(b.base + b.size + 16);
  EXPECT_TRUE(in_gap == nullptr || in_gap == &b);
  EXPECT_EQ(map.Find(base), nullptr);
  EXPECT_EQ(map.Find(0x1000), nullptr);
  map.Erase(&b);
  EXPECT_EQ(map.Find(a.base + a.size - 1), &a);
  EXPECT_NE(map.Find(b.base + kMiB), &b);
  EXPECT_EQ(map.Find(c.base), &c);
  map.Erase(&a);
  map.Erase(&c);
  EXPECT_EQ(map.Find(c.base), nullptr);
}

// Pages smaller than 2 MiB for a configuration of small segments; and
// addresses high in the 64-bit space.
TEST(SegmentPageMapTest, SmallPagesAndHighAddresses) {
  SegmentPageMap map(/*page_shift=*/16);
  const std::uint64_t base = std::uint64_t{0xFFFF} << 48;
  std::vector<std::unique_ptr<Segment>> segs;
  std::uint64_t at = base;
  for (int i = 0; i < 64; ++i) {
    segs.push_back(NewSegment(at, 64 * 1024 + (i % 3) * 512));
    at += segs.back()->size;
  }
  for (auto& s : segs) map.Insert(s.get());
  for (auto& s : segs) {
    EXPECT_EQ(map.Find(s->base), s.get());
    EXPECT_EQ(map.Find(s->base + s->size - 1), s.get());
  }
}

TEST(RangeTableTest, FindsRangesAndForgetsErased) {
  RangeTable table;
  auto p1 = NewSegment(std::uint64_t{1} << 40, std::uint64_t{160} << 30);
  Segment& r1 = *p1;
  auto p2 = NewSegment(r1.base + r1.size + 2 * kMiB, 64 * kMiB);
  Segment& r2 = *p2;
  EXPECT_EQ(table.Find(r1.base), nullptr);
  table.Insert(&r2);
  table.Insert(&r1);
  EXPECT_EQ(table.Find(r1.base), &r1);
  EXPECT_EQ(table.Find(r1.base + r1.size - 1), &r1);
  EXPECT_EQ(table.Find(r1.base + r1.size), nullptr);  // between
  EXPECT_EQ(table.Find(r2.base + 5), &r2);
  EXPECT_EQ(table.Find(r1.base - 1), nullptr);
  table.Erase(&r1);
  EXPECT_EQ(table.Find(r1.base), nullptr);
  EXPECT_EQ(table.Find(r2.base), &r2);
}

// A reader always finds a range inserted before it started, while the
// writer keeps replacing the table.
TEST(RangeTableTest, ReadersRaceTheWriter) {
  RangeTable table;
  std::vector<std::unique_ptr<Segment>> ranges;
  for (int i = 0; i < 200; ++i) {
    ranges.push_back(
        NewSegment((std::uint64_t{1} << 44) + i * (std::uint64_t{1} << 32),
                   std::uint64_t{1} << 31));
  }
  table.Insert(ranges[0].get());
  std::atomic<bool> done{false};
  std::atomic<bool> bad{false};
  std::thread reader([&] {
    while (!done.load()) {
      if (table.Find(ranges[0]->base + 100) != ranges[0].get()) bad = true;
    }
  });
  for (int i = 1; i < 200; ++i) table.Insert(ranges[i].get());
  for (int i = 199; i > 0; --i) table.Erase(ranges[i].get());
  done = true;
  reader.join();
  EXPECT_FALSE(bad.load());
}

// Ranges come and go (a stream's extra ranges, given back by Trim): the
// table's host memory follows how many ranges are held at once, not how
// many changes were made.
TEST(RangeTableTest, ChurnKeepsTheTablesBounded) {
  RangeTable table;
  std::vector<std::unique_ptr<Segment>> held;
  for (int i = 0; i < 20; ++i) {
    held.push_back(
        NewSegment((std::uint64_t{1} << 44) + i * (std::uint64_t{1} << 34),
                   std::uint64_t{1} << 33));
    table.Insert(held.back().get());
  }
  const std::size_t bytes = table.TableBytes();
  auto extra = NewSegment(std::uint64_t{1} << 42, std::uint64_t{1} << 33);
  for (int i = 0; i < 10000; ++i) {
    table.Insert(extra.get());
    ASSERT_EQ(table.Find(extra->base + 7), extra.get());
    table.Erase(extra.get());
  }
  EXPECT_EQ(table.Find(extra->base + 7), nullptr);
  EXPECT_EQ(table.TableBytes(), bytes);
  for (auto& r : held) EXPECT_EQ(table.Find(r->base + r->size - 1), r.get());
  // Growth keeps every table it replaced (a reader may still be in one),
  // so the tables of n ranges stay within a small multiple of n entries.
  EXPECT_LE(table.TableBytes(), 4 * 32 * 3 * sizeof(std::uint64_t));
}

// Readers racing a writer that inserts and erases ranges below theirs (so
// the entries move under them) always find the range they look for, and
// never a range that does not hold the address.
TEST(RangeTableTest, ReadersRaceEntriesMovingUnderThem) {
  RangeTable table;
  std::vector<std::unique_ptr<Segment>> below;
  for (int i = 0; i < 64; ++i) {
    below.push_back(
        NewSegment((std::uint64_t{1} << 40) + i * (std::uint64_t{1} << 32),
                   std::uint64_t{1} << 31));
  }
  auto probe = NewSegment(std::uint64_t{1} << 46, std::uint64_t{1} << 31);
  table.Insert(probe.get());
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  auto read = [&] {
    while (!done.load(std::memory_order_relaxed)) {
      if (table.Find(probe->base + 100) != probe.get()) ++bad;
      for (const auto& b : below) {
        const Segment* at = table.Find(b->base + 1);
        if (at != nullptr && at != b.get()) ++bad;
        if (table.Find(b->base + b->size + 1) != nullptr) ++bad;  // a gap
      }
    }
  };
  std::thread r1(read);
  std::thread r2(read);
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < 64; i += 1 + round % 3) table.Insert(below[i].get());
    for (int i = 0; i < 64; i += 1 + round % 3) table.Erase(below[i].get());
  }
  done = true;
  r1.join();
  r2.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace alloc_internal
}  // namespace ctxpool
