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
  EXPECT_EQ(pool.capacity(), BlockPool::kChunkBlocks);
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
