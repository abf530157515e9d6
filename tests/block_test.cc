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

// Chunks double from 256 blocks to 1024, then stay at 1024.
TEST(BlockPool, GrowsByDoublingChunks) {
  BlockPool pool;
  std::set<Block*> seen;
  const std::size_t c = BlockPool::kChunkBlocks;
  EXPECT_EQ(pool.capacity(), 0u);
  for (std::size_t want : {c, 3 * c, 7 * c, 11 * c, 15 * c}) {
    while (seen.size() < want) EXPECT_TRUE(seen.insert(pool.New()).second);
    EXPECT_EQ(pool.capacity(), want);  // the next New() refills
  }
  EXPECT_EQ(BlockPool::ChunkBlocks(0), c);
  EXPECT_EQ(BlockPool::ChunkBlocks(2), 4 * c);
  EXPECT_EQ(BlockPool::ChunkBlocks(100), 4 * c);
  for (Block* b : seen) pool.Delete(b);
  EXPECT_EQ(pool.live(), 0u);
  EXPECT_EQ(pool.capacity(), 15 * c);  // kept for reuse
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
