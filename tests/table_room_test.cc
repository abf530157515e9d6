// core_internal::MakeRoom / TableHasRoom (table_room.h): room made ahead
// means the inserts it was made for allocate nothing, and a MakeRoom that
// runs out of host memory leaves the table as it was, whatever step fails.
#include "ctxpool/core/internal/table_room.h"

#include <cstdint>
#include <map>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gtest/gtest.h"
#include "heap_counter.h"

namespace ctxpool {
namespace {

using core_internal::MakeRoom;
using core_internal::TableHasRoom;

TEST(TableRoom, InsertsItMadeRoomForDoNotAllocate) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  absl::flat_hash_map<std::uint64_t, int> t;
  for (std::size_t n : {1u, 7u, 40u, 300u}) {
    MakeRoom(t, n);
    ASSERT_TRUE(TableHasRoom(t, n));
    g_allocations = 0;
    g_count_allocations = true;
    for (std::size_t i = 0; i < n; ++i) t.emplace(t.size() + 1, 1);
    g_count_allocations = false;
    EXPECT_EQ(g_allocations, 0) << n << " inserts";
  }
}

// Keys too long for the short-string buffer: every copy of one allocates,
// and moving a map's element copies its const key.
std::string LongKey(int i) {
  return "model-name-long-enough-to-live-on-the-heap-" + std::to_string(i);
}

TEST(TableRoom, OutOfHostMemoryAtAnyStepLeavesTheTableWhole) {
#ifdef CTXPOOL_TEST_TSAN
  GTEST_SKIP() << "TSan replaces operator new";
#endif
  absl::flat_hash_map<std::string, int> t;
  std::map<std::string, int> want;
  // Fill to the edge of the room, so that MakeRoom must grow.
  MakeRoom(t, 1);
  for (int i = 0; TableHasRoom(t, 1); ++i) {
    t.emplace(LongKey(i), i);
    want.emplace(LongKey(i), i);
  }
  int k = 0;
  for (; k < 10000; ++k) {
    SCOPED_TRACE(::testing::Message() << "host allocation " << k << " fails");
    bool threw = false;
    g_fail_after = k;
    try {
      MakeRoom(t, 1);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    const bool fired = g_fail_after == -1;
    g_fail_after = -1;
    EXPECT_EQ(threw, fired);
    ASSERT_EQ(t.size(), want.size());
    for (const auto& [key, value] : want) {
      auto it = t.find(key);
      ASSERT_NE(it, t.end()) << key;
      EXPECT_EQ(it->second, value);
    }
    if (!fired) {
      EXPECT_TRUE(TableHasRoom(t, 1));
      break;
    }
  }
  // Growing copies every long key: one host allocation each, at least (a
  // copy that throws must not leak the others: the ASan build's leak check).
  ASSERT_GT(want.size(), 16u);
  EXPECT_GT(k, static_cast<int>(want.size()));
}

}  // namespace
}  // namespace ctxpool
