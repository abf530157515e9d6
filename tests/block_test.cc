#include "ctxpool/core/block.h"

#include <set>

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

TEST(BlockPool, RecyclesBlocks) {
  BlockPool pool;
  Block* a = pool.New();
  Block* b = pool.New();
  EXPECT_NE(a, b);
  EXPECT_EQ(pool.live(), 2u);
  EXPECT_EQ(pool.capacity(), BlockPool::kRefillBlocks);  // a page's worth
  a->size = 4096;
  a->stream_uses.push_back(7);
  pool.Delete(a);
  EXPECT_EQ(pool.live(), 1u);
  Block* c = pool.New();
  EXPECT_EQ(c, a);  // LIFO reuse
  EXPECT_EQ(c->size, 0u);
  EXPECT_TRUE(c->stream_uses.empty());
  EXPECT_EQ(c->next, nullptr);
  pool.Delete(b);
  pool.Delete(c);
  EXPECT_EQ(pool.live(), 0u);
}

TEST(BlockPool, GrowsByChunks) {
  BlockPool pool;
  std::set<Block*> seen;
  for (std::size_t i = 0; i < 3 * BlockPool::kChunkBlocks; ++i) {
    EXPECT_TRUE(seen.insert(pool.New()).second);
  }
  EXPECT_EQ(pool.capacity(), 3 * BlockPool::kChunkBlocks);
  for (Block* b : seen) pool.Delete(b);
}

// A chunk's blocks are made about a page at a time as they are needed (so
// a new chunk's memory is touched a page at a time, not all at once), and
// freed blocks are reused before any new one is made.
TEST(BlockPool, MakesBlocksOnFirstUseAndReusesThemFirst) {
  BlockPool pool;
  const std::size_t n = BlockPool::kChunkBlocks + 44;  // into a second chunk
  std::set<Block*> first;
  for (std::size_t i = 0; i < n; ++i) {
    Block* b = pool.New();
    EXPECT_GE(pool.capacity(), i + 1);
    EXPECT_LT(pool.capacity(), i + 1 + BlockPool::kRefillBlocks);
    EXPECT_EQ(b->size, 0u);
    EXPECT_EQ(b->next, nullptr);
    EXPECT_FALSE(b->linked());
    b->size = 512 * (i + 1);
    b->stream_uses.assign({1, 2, 3});  // on the heap: the pool frees it
    EXPECT_TRUE(first.insert(b).second);
  }
  const std::size_t made = pool.capacity();
  for (Block* b : first) pool.Delete(b);
  EXPECT_EQ(pool.live(), 0u);
  for (std::size_t i = 0; i < n; ++i) {
    Block* b = pool.New();
    EXPECT_EQ(first.count(b), 1u);
    EXPECT_EQ(b->size, 0u);
    EXPECT_TRUE(b->stream_uses.empty());
  }
  EXPECT_EQ(pool.capacity(), made);
  Block* more = pool.New();  // never handed out before
  EXPECT_EQ(first.count(more), 0u);
  EXPECT_LE(pool.capacity(), made + BlockPool::kRefillBlocks);
  // Destroyed with blocks handed out: every block made is destroyed (ASan
  // sees a leak of stream_uses otherwise).
  more->stream_uses.assign({4, 5, 6});
}

TEST(Block, SplitAndMergeRestoreTheBlock) {
  BlockPool pool;
  Block* b = pool.New();
  b->address = 0x10000;
  b->size = 8192;
  Block* rest = SplitBlock(b, 1024, pool);
  EXPECT_EQ(b->size, 1024u);
  EXPECT_EQ(rest->address, 0x10400u);
  EXPECT_EQ(rest->size, 7168u);
  EXPECT_EQ(b->next, rest);
  EXPECT_EQ(rest->prev, b);
  EXPECT_TRUE(b->is_split());
  Block* tail = SplitBlock(rest, 2048, pool);
  EXPECT_EQ(tail->prev, rest);
  EXPECT_EQ(tail->end(), 0x10000u + 8192);
  MergeNext(b, pool);  // absorbs `rest`
  EXPECT_EQ(b->size, 3072u);
  EXPECT_EQ(b->next, tail);
  EXPECT_EQ(tail->prev, b);
  MergeNext(b, pool);
  EXPECT_EQ(b->size, 8192u);
  EXPECT_FALSE(b->is_split());
  EXPECT_EQ(pool.live(), 1u);
  pool.Delete(b);
}

}  // namespace
}  // namespace ctxpool
