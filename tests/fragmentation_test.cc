#include "ctxpool/core/fragmentation.h"

#include "gtest/gtest.h"

namespace ctxpool {
namespace {

TEST(Fragmentation, NothingCachedIsZero) {
  FragmentationStats f = ComputeFragmentation({});
  EXPECT_EQ(f.external, 0.0);
  EXPECT_EQ(f.rounding_waste, 0.0);
  EXPECT_EQ(f.reserved_over_live, 0.0);
}

TEST(Fragmentation, ComputesRatios) {
  FragmentationInputs in;
  in.free_bytes = 3000;
  in.largest_free_bytes = 1000;
  in.free_blocks = 3;
  in.allocated_bytes = 4000;
  in.requested_bytes = 3000;
  in.reserved_bytes = 7000;
  FragmentationStats f = ComputeFragmentation(in);
  EXPECT_DOUBLE_EQ(f.external, 1.0 - 1000.0 / 3000.0);
  EXPECT_EQ(f.rounding_waste_bytes, 1000u);
  EXPECT_DOUBLE_EQ(f.rounding_waste, 0.25);
  EXPECT_DOUBLE_EQ(f.reserved_over_live, 1.75);
  EXPECT_EQ(f.free_blocks, 3u);
  in.largest_free_bytes = 3000;  // one hole: no external fragmentation
  EXPECT_EQ(ComputeFragmentation(in).external, 0.0);
}

}  // namespace
}  // namespace ctxpool
