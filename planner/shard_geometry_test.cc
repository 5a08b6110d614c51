#include "planner/shard_geometry.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ember {
namespace planner {
namespace {

std::vector<int64_t> Rows(const std::vector<ShardBlock>& blocks) {
  std::vector<int64_t> out;
  for (const auto& b : blocks) out.push_back(b.rows);
  return out;
}

std::vector<int64_t> RowOffsets(const std::vector<ShardBlock>& blocks) {
  std::vector<int64_t> out;
  for (const auto& b : blocks) out.push_back(b.row_offset);
  return out;
}

// TorchRec's documented examples (calculate_shard_sizes_and_offsets).
TEST(RowWiseBlocksTest, MatchesTorchRecExamples) {
  EXPECT_THAT(Rows(RowWiseBlocks(10, 8, 4)), testing::ElementsAre(3, 3, 3, 1));
  EXPECT_THAT(RowOffsets(RowWiseBlocks(10, 8, 4)), testing::ElementsAre(0, 3, 6, 9));
  EXPECT_THAT(Rows(RowWiseBlocks(5, 8, 4)), testing::ElementsAre(2, 2, 1, 0));
  EXPECT_THAT(RowOffsets(RowWiseBlocks(5, 8, 4)), testing::ElementsAre(0, 2, 4, 5));
  // The seed tutorial: 4096 and 1024 rows on 2 GPUs.
  EXPECT_THAT(Rows(RowWiseBlocks(4096, 64, 2)), testing::ElementsAre(2048, 2048));
  EXPECT_THAT(RowOffsets(RowWiseBlocks(4096, 64, 2)), testing::ElementsAre(0, 2048));
  EXPECT_THAT(Rows(RowWiseBlocks(1024, 64, 2)), testing::ElementsAre(512, 512));
}

TEST(RowWiseBlocksTest, MoreShardsThanRowsLeavesEmptyTail) {
  EXPECT_THAT(Rows(RowWiseBlocks(2, 4, 5)), testing::ElementsAre(1, 1, 0, 0, 0));
  EXPECT_THAT(Rows(RowWiseBlocks(7, 4, 1)), testing::ElementsAre(7));
}

TEST(RowWiseBlocksTest, TilesEveryTableExactly) {
  for (int64_t rows : {1, 2, 3, 7, 64, 1000, 4097, 99991}) {
    for (int n : {1, 2, 3, 4, 7, 8, 16, 64}) {
      const auto blocks = RowWiseBlocks(rows, 16, n);
      ASSERT_EQ(blocks.size(), static_cast<size_t>(n));
      int64_t next = 0;
      const int64_t block = (rows + n - 1) / n;
      for (const auto& b : blocks) {
        EXPECT_EQ(b.row_offset, next);
        EXPECT_GE(b.rows, 0);
        EXPECT_LE(b.rows, block);
        EXPECT_EQ(b.cols, 16);
        EXPECT_EQ(b.col_offset, 0);
        next += b.rows;
      }
      EXPECT_EQ(next, rows) << rows << " rows over " << n;
    }
  }
}

TEST(ColumnShardWidthTest, EvenSplitOverWorkersWithoutMinPartition) {
  EXPECT_EQ(ColumnShardWidth(64, 0, 2), 32);   // the seed tutorial
  EXPECT_EQ(ColumnShardWidth(64, 0, 3), 32);   // 3 does not divide 64
  EXPECT_EQ(ColumnShardWidth(64, 0, 8), 8);
  EXPECT_EQ(ColumnShardWidth(64, 0, 32), 4);   // never narrower than 4
  EXPECT_EQ(ColumnShardWidth(12, 0, 2), 12);   // 6 is not a multiple of 4
  EXPECT_EQ(ColumnShardWidth(12, 0, 3), 4);
  EXPECT_EQ(ColumnShardWidth(128, 0, 1), 128);
}

TEST(ColumnShardWidthTest, TorchRecRuleWithMinPartition) {
  // Smallest w in [min_partition, cols) dividing cols and divisible by 4.
  EXPECT_EQ(ColumnShardWidth(256, 128, 8), 128);
  EXPECT_EQ(ColumnShardWidth(512, 128, 2), 128);  // independent of W
  EXPECT_EQ(ColumnShardWidth(64, 128, 2), 64);    // no such w: whole dim
  EXPECT_EQ(ColumnShardWidth(96, 40, 4), 48);
  EXPECT_EQ(ColumnShardWidth(100, 8, 4), 20);
}

// Worked by hand: widths cols / k for k = 2 .. W that are multiples of 4
// and at least 32, widest first, then the even split if it is not among
// them; nothing when the dim cannot be split.
TEST(FreeColumnWidthsTest, WideBlocksThenTheEvenSplit) {
  using W = std::vector<int64_t>;
  EXPECT_EQ(FreeColumnWidths(128, 64), (W{64, 32, 4}));  // 128/32 = 4 is the even split
  EXPECT_EQ(FreeColumnWidths(256, 8), (W{128, 64, 32}));  // even split 32 already there
  EXPECT_EQ(FreeColumnWidths(64, 2), (W{32}));             // the seed tutorial's split
  EXPECT_EQ(FreeColumnWidths(96, 4), (W{48, 32, 24}));     // 24 < 32, but it is the even split
  EXPECT_EQ(FreeColumnWidths(96, 3), (W{48, 32}));
  EXPECT_EQ(FreeColumnWidths(16, 8), (W{4}));              // too narrow for wide blocks
  EXPECT_EQ(FreeColumnWidths(12, 2), (W{}));               // 6 is not a multiple of 4
  EXPECT_EQ(FreeColumnWidths(128, 1), (W{}));              // one worker: no split
}

TEST(ColumnWiseBlocksTest, OffsetsAndSizes) {
  const auto blocks = ColumnWiseBlocks(4096, 64, 0, 2);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[0].col_offset, 0);
  EXPECT_EQ(blocks[1].col_offset, 32);
  for (const auto& b : blocks) {
    EXPECT_EQ(b.rows, 4096);
    EXPECT_EQ(b.cols, 32);
    EXPECT_EQ(b.row_offset, 0);
  }
  EXPECT_EQ(ColumnWiseBlocks(10, 512, 128, 3).size(), 4u);
}

}  // namespace
}  // namespace planner
}  // namespace ember
