#include "planner/plan_view.h"

#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace planner {
namespace {

ember::v1::TableSharding RowWise() {
  // 10 + 6 + 0 rows of 8 columns on ranks 2, 0, 1 (the last one empty).
  ember::v1::TableSharding ts;
  ts.set_table("t");
  ts.set_sharding_type("row_wise");
  const int64_t rows[] = {10, 6, 0}, ranks[] = {2, 0, 1};
  int64_t offset = 0;
  for (int i = 0; i < 3; ++i) {
    auto* s = ts.add_shards();
    s->set_row_offset(offset);
    s->set_rows(rows[i]);
    s->set_cols(8);
    s->set_rank(static_cast<int32_t>(ranks[i]));
    ts.add_ranks(static_cast<int32_t>(ranks[i]));
    offset += rows[i];
  }
  return ts;
}

ember::v1::TableSharding Replicated(const std::vector<int>& ranks) {
  ember::v1::TableSharding ts;
  ts.set_table("d");
  ts.set_sharding_type("data_parallel");
  for (int r : ranks) ts.add_ranks(r);
  return ts;
}

TEST(PlanViewTest, ShardsInIndexOrderEmptyOnesIncluded) {
  const std::vector<PlacedBlock> b = TableBlocks(RowWise(), 16, 8);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].rank, 2);
  EXPECT_EQ(b[0].index, 0);
  EXPECT_EQ(b[1].row_offset, 10);
  EXPECT_EQ(b[1].rows, 6);
  EXPECT_EQ(b[1].cols, 8);
  EXPECT_EQ(b[1].rank, 0);
  EXPECT_EQ(b[1].index, 1);
  EXPECT_FALSE(b[1].replica);
  EXPECT_TRUE(b[1].Held());
  EXPECT_FALSE(b[2].Held());  // the empty trailing shard
  EXPECT_FALSE(IsReplicated(RowWise()));
}

TEST(PlanViewTest, AReplicaPerRankNamedByItsRank) {
  const std::vector<PlacedBlock> b = TableBlocks(Replicated({3, 1}), 100, 16);
  ASSERT_EQ(b.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(b[i].replica);
    EXPECT_TRUE(b[i].Held());
    EXPECT_EQ(b[i].index, b[i].rank);
    EXPECT_EQ(b[i].row_offset, 0);
    EXPECT_EQ(b[i].col_offset, 0);
    EXPECT_EQ(b[i].rows, 100);
    EXPECT_EQ(b[i].cols, 16);
  }
  EXPECT_EQ(b[0].rank, 3);  // the plan's order
  EXPECT_EQ(b[1].rank, 1);
  EXPECT_TRUE(IsReplicated(Replicated({})));
  EXPECT_TRUE(TableBlocks(Replicated({}), 100, 16).empty());
}

TEST(PlanViewTest, HoldingRanksSkipsEmptyShards) {
  ember::v1::ShardingPlan plan;
  *plan.add_tables() = RowWise();        // ranks 2 and 0 hold rows; 1 holds none
  *plan.add_tables() = Replicated({4});  // a replica holds its table
  EXPECT_EQ(HoldingRanks(plan), (std::set<int>{0, 2, 4}));
  EXPECT_TRUE(HoldingRanks(ember::v1::ShardingPlan()).empty());
}

TEST(PlanViewTest, RankOfBlock) {
  EXPECT_EQ(RankOfBlock(RowWise(), 0), 2);
  EXPECT_EQ(RankOfBlock(RowWise(), 2), 1);
  EXPECT_EQ(RankOfBlock(RowWise(), 3), -1);
  EXPECT_EQ(RankOfBlock(RowWise(), -1), -1);
  EXPECT_EQ(RankOfBlock(Replicated({3, 1}), 3), 3);  // a replica: its rank
}

}  // namespace
}  // namespace planner
}  // namespace ember
