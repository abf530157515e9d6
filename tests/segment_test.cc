#include "ctxpool/core/segment.h"

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace ctxpool {
namespace {

class SegmentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seg_.base = 0x100000;
    seg_.size = 4096;
    seg_.first = pool_.New();
    seg_.first->address = seg_.base;
    seg_.first->size = seg_.size;
    seg_.first->segment = &seg_;
  }
  void TearDown() override {
    for (Block* b = seg_.first; b != nullptr;) {
      Block* next = b->next;
      pool_.Delete(b);
      b = next;
    }
  }
  BlockPool pool_;
  Segment seg_;
};

TEST_F(SegmentTest, OneFreeBlockIsWhollyFreeAndTiles) {
  EXPECT_TRUE(seg_.wholly_free());
  EXPECT_TRUE(CheckSegmentTiling(seg_).ok());
}

TEST_F(SegmentTest, SplitBlocksTile) {
  seg_.first->state = BlockState::kAllocated;
  Block* rest = SplitBlock(seg_.first, 1024, pool_);
  rest->state = BlockState::kFree;
  EXPECT_FALSE(seg_.wholly_free());
  EXPECT_TRUE(CheckSegmentTiling(seg_).ok());
}

TEST_F(SegmentTest, DetectsAdjacentFreeBlocks) {
  SplitBlock(seg_.first, 1024, pool_);  // both free
  absl::Status s = CheckSegmentTiling(seg_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("coalesced"), absl::string_view::npos);
}

TEST_F(SegmentTest, DetectsGapAndShortfall) {
  seg_.first->state = BlockState::kAllocated;
  Block* rest = SplitBlock(seg_.first, 1024, pool_);
  rest->address += 512;  // a gap
  rest->size -= 512;
  EXPECT_EQ(CheckSegmentTiling(seg_).code(), absl::StatusCode::kInternal);
  rest->address -= 512;  // no gap, but the blocks stop short of the end
  EXPECT_EQ(CheckSegmentTiling(seg_).code(), absl::StatusCode::kInternal);
  rest->size += 512;
  EXPECT_TRUE(CheckSegmentTiling(seg_).ok());
}

TEST_F(SegmentTest, DetectsForeignBlock) {
  Segment other;
  seg_.first->segment = &other;
  EXPECT_EQ(CheckSegmentTiling(seg_).code(), absl::StatusCode::kInternal);
  seg_.first->segment = &seg_;
}

}  // namespace
}  // namespace ctxpool
