#include "ctxpool/core/free_index.h"

#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

struct Node : FreeIndexNode {
  std::size_t size = 0;
  std::uint64_t address = 0;
};

TEST(FreeIndex, EmptyIndexFindsNothing) {
  FreeIndex<Node> index;
  EXPECT_TRUE(index.empty());
  EXPECT_EQ(index.LowerBound(1), nullptr);
  EXPECT_EQ(index.First(), nullptr);
  EXPECT_EQ(index.Last(), nullptr);
  EXPECT_EQ(index.Validate(), "");
}

TEST(FreeIndex, LowerBoundIsBestFitLowestAddressFirst) {
  FreeIndex<Node> index;
  Node a, b, c, d;
  index.Insert(&a, 4096, 0x3000);
  index.Insert(&b, 1024, 0x1000);
  index.Insert(&c, 4096, 0x2000);
  index.Insert(&d, 65536, 0x9000);
  EXPECT_EQ(index.size(), 4u);
  EXPECT_EQ(index.LowerBound(1), &b);
  EXPECT_EQ(index.LowerBound(1024), &b);
  EXPECT_EQ(index.LowerBound(1025), &c);  // same size: lower address first
  EXPECT_EQ(index.LowerBound(4096, 0x2001), &a);
  EXPECT_EQ(index.LowerBound(5000), &d);
  EXPECT_EQ(index.LowerBound(65537), nullptr);
  EXPECT_EQ(index.First(), &b);
  EXPECT_EQ(index.Last(), &d);
  EXPECT_EQ(FreeIndex<Node>::Next(&b), &c);
  EXPECT_EQ(FreeIndex<Node>::Next(&c), &a);
  EXPECT_EQ(FreeIndex<Node>::Next(&d), nullptr);
  EXPECT_TRUE(index.Contains(&a));
  index.Erase(&c);
  EXPECT_FALSE(index.Contains(&c));
  EXPECT_FALSE(c.linked());
  EXPECT_EQ(index.LowerBound(1025), &a);
  EXPECT_EQ(index.Validate(), "");
}

TEST(FreeIndex, NodeBelongsToOneIndex) {
  FreeIndex<Node> x, y;
  Node n;
  x.Insert(&n, 512, 0x1000);
  EXPECT_TRUE(x.Contains(&n));
  EXPECT_FALSE(y.Contains(&n));
  x.Erase(&n);
  y.Insert(&n, 512, 0x1000);
  EXPECT_TRUE(y.Contains(&n));
  EXPECT_TRUE(x.empty());
  y.Erase(&n);
}

// Randomized comparison against std::set on (size, address) keys, with the
// structural invariants validated along the way.
TEST(FreeIndex, MatchesStdSetUnderRandomOperations) {
  constexpr int kNodes = 2000;
  constexpr int kOps = 60000;
  std::mt19937_64 rng(12345);
  std::vector<Node> nodes(kNodes);
  for (int i = 0; i < kNodes; ++i) {
    nodes[i].address = 0x100000 + 512 * static_cast<std::uint64_t>(i);
  }
  FreeIndex<Node> index;
  std::set<std::pair<std::size_t, std::uint64_t>> model;
  for (int op = 0; op < kOps; ++op) {
    SCOPED_TRACE(op);
    Node& n = nodes[rng() % kNodes];
    if (!n.linked()) {
      n.size = 512 * (1 + rng() % 64);
      index.Insert(&n, n.size, n.address);
      model.emplace(n.size, n.address);
    } else {
      index.Erase(&n);
      model.erase({n.size, n.address});
    }
    const std::size_t want = 512 * (1 + rng() % 70);
    Node* got = index.LowerBound(want);
    auto it = model.lower_bound({want, 0});
    if (it == model.end()) {
      ASSERT_EQ(got, nullptr);
    } else {
      ASSERT_NE(got, nullptr);
      ASSERT_EQ(got->size, it->first);
      ASSERT_EQ(got->address, it->second);
    }
    ASSERT_EQ(index.size(), model.size());
    if (op % 5000 == 0) {
      ASSERT_EQ(index.Validate(), "");
    }
  }
  // In-order iteration equals the model's order.
  auto it = model.begin();
  for (Node* n = index.First(); n != nullptr; n = FreeIndex<Node>::Next(n)) {
    ASSERT_NE(it, model.end());
    EXPECT_EQ(std::make_pair(n->size, n->address), *it);
    ++it;
  }
  EXPECT_EQ(it, model.end());
  EXPECT_EQ(index.Validate(), "");
}

// Sorted insertion (the worst case of an unbalanced tree) stays shallow
// enough that 100k inserts and lookups are quick.
TEST(FreeIndex, SortedInsertionsStayBalanced) {
  constexpr int kNodes = 100000;
  std::vector<Node> nodes(kNodes);
  FreeIndex<Node> index;
  for (int i = 0; i < kNodes; ++i) {
    index.Insert(&nodes[i], 512, 512 * static_cast<std::uint64_t>(i));
  }
  for (int i = 0; i < kNodes; i += 97) {
    ASSERT_EQ(index.LowerBound(512, 512 * static_cast<std::uint64_t>(i)),
              &nodes[i]);
  }
  EXPECT_EQ(index.Validate(), "");
  for (int i = 0; i < kNodes; ++i) index.Erase(&nodes[i]);
  EXPECT_TRUE(index.empty());
}

}  // namespace
}  // namespace ctxpool
