#include "server/coordinator/replacement_policy.h"

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "planner/plan_view.h"
#include "server/coordinator/assignments.h"

namespace ember {
namespace coordinator {
namespace {

using ember::v1::CollectionInfo;

// Rank r's worker is "w<r+1>" at "h<r>:1"; tables are fp32 SGD with 4
// columns (16 bytes a row) unless said.
CollectionInfo Info(int world) {
  CollectionInfo info;
  info.mutable_spec()->set_name("c");
  for (int r = 0; r < world; ++r) info.add_worker_addresses("h" + std::to_string(r) + ":1");
  return info;
}

std::vector<std::string> Ids(int world) {
  std::vector<std::string> ids;
  for (int r = 0; r < world; ++r) ids.push_back("w" + std::to_string(r + 1));
  return ids;
}

ember::v1::TableConfig* AddConfig(CollectionInfo* info, const std::string& name, int64_t rows) {
  ember::v1::TableConfig* t = info->mutable_spec()->add_tables();
  t->set_name(name);
  t->set_num_embeddings(rows);
  t->set_embedding_dim(4);
  return t;
}

// A row-wise table: shard i has rows[i] rows on ranks[i].
ember::v1::TableConfig* AddRowWise(CollectionInfo* info, const std::string& name,
                                   const std::vector<int64_t>& rows,
                                   const std::vector<int>& ranks) {
  int64_t total = 0;
  auto* ts = info->mutable_plan()->add_tables();
  ts->set_table(name);
  ts->set_sharding_type("row_wise");
  for (size_t i = 0; i < rows.size(); ++i) {
    auto* sh = ts->add_shards();
    sh->set_row_offset(total);
    sh->set_rows(rows[i]);
    sh->set_cols(4);
    sh->set_rank(ranks[i]);
    ts->add_ranks(ranks[i]);
    total += rows[i];
  }
  return AddConfig(info, name, total);
}

// A data-parallel table of `rows` rows replicated on `ranks`.
void AddReplicated(CollectionInfo* info, const std::string& name, int64_t rows,
                   const std::vector<int>& ranks) {
  auto* ts = info->mutable_plan()->add_tables();
  ts->set_table(name);
  ts->set_sharding_type("data_parallel");
  for (int r : ranks) ts->add_ranks(r);
  AddConfig(info, name, rows);
}

std::vector<int> ShardRanks(const Replacement& p, int table) {
  std::vector<int> out;
  for (const auto& sh : p.info.plan().tables(table).shards()) out.push_back(sh.rank());
  return out;
}

std::vector<int> PlanRanks(const Replacement& p, int table) {
  const auto& r = p.info.plan().tables(table).ranks();
  return std::vector<int>(r.begin(), r.end());
}

using Shards = std::set<std::pair<std::string, int32_t>>;

TEST(ReplacementPolicyTest, SparesAreTakenInRegistrationOrderNotIdOrder) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {40, 30, 30}, {0, 1, 2});
  // w10 sorts before w9 by name; w9 registered first.
  auto p = PlaceLostShards(info, Ids(3), {1},
                           {{"w1", 1, "h0:1"}, {"w3", 3, "h2:1"}, {"w10", 10, "h10:1"},
                            {"w9", 9, "h9:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->ids, (std::vector<std::string>{"w1", "w9", "w3"}));
  EXPECT_EQ(p->info.worker_addresses(1), "h9:1");
  EXPECT_EQ(p->replaced, (std::set<int>{1}));
  EXPECT_EQ(ShardRanks(*p, 0), (std::vector<int>{0, 1, 2}));
  // 40 and 30 rows of 16 bytes; the spare starts at 0.
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{0, 640}, {1, 0}, {2, 480}}));
  EXPECT_EQ(p->reload, (std::map<int, Shards>{{1, {{"t", 1}}}}));
  EXPECT_TRUE(p->replica_source.empty());
}

TEST(ReplacementPolicyTest, ShardsGoToTheLeastLoadedRankLowestOnTies) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {10, 10, 10, 5, 0}, {0, 1, 2, 2, 2});
  auto p = PlaceLostShards(info, Ids(3), {2}, {{"w1", 1, "h0:1"}, {"w2", 2, "h1:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  // Shard 2: 160 against 160, rank 0 (then 320); shard 3: rank 1 (160 <
  // 320, then 240); the empty shard stays where it was.
  EXPECT_EQ(ShardRanks(*p, 0), (std::vector<int>{0, 1, 0, 1, 2}));
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{0, 320}, {1, 240}}));
  EXPECT_EQ(p->reload, (std::map<int, Shards>{{0, {{"t", 2}}}, {1, {{"t", 3}}}}));
  EXPECT_TRUE(p->replaced.empty());
  EXPECT_EQ(p->ids, Ids(3));  // no spare: the dead rank keeps its worker id
}

TEST(ReplacementPolicyTest, AReplacementTakesShardsFromLaterLostRanks) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {10, 10, 10}, {0, 1, 2});
  auto p = PlaceLostShards(info, Ids(3), {0, 2}, {{"w2", 2, "h1:1"}, {"w9", 9, "h9:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  // Rank 0 takes the one spare (load 0), so rank 2's shard goes to it, and
  // it loads both.
  EXPECT_EQ(p->ids[0], "w9");
  EXPECT_EQ(ShardRanks(*p, 0), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{0, 160}, {1, 160}}));
  EXPECT_EQ(p->reload, (std::map<int, Shards>{{0, {{"t", 0}, {"t", 2}}}}));
  EXPECT_EQ(p->replaced, (std::set<int>{0}));
}

TEST(ReplacementPolicyTest, OrphanedReplicasGoToTheLeastLoadedRankWithoutAddingLoad) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {10, 20}, {0, 1});
  AddReplicated(&info, "d", 8, {1, 2});
  AddReplicated(&info, "e", 8, {2});
  AddReplicated(&info, "f", 8, {2});
  auto p = PlaceLostShards(info, Ids(3), {2}, {{"w1", 1, "h0:1"}, {"w2", 2, "h1:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(PlanRanks(*p, 1), (std::vector<int>{1}));  // d keeps its live replica
  EXPECT_EQ(PlanRanks(*p, 2), (std::vector<int>{0}));
  EXPECT_EQ(PlanRanks(*p, 3), (std::vector<int>{0}));
  // Rank 1 holds 20 rows of t and d's 8-row replica: 320 + 128.
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{0, 160}, {1, 448}}));
  EXPECT_EQ(p->reload, (std::map<int, Shards>{{0, {{"e", 0}, {"f", 0}}}}));
  using Source = std::map<std::pair<std::string, int32_t>, int>;
  EXPECT_EQ(p->replica_source, (Source{{{"e", 0}, 2}, {{"f", 0}, 2}}));
}

TEST(ReplacementPolicyTest, NoLiveWorkerIsUnavailableNamingTheRanks) {
  CollectionInfo info = Info(2);
  AddRowWise(&info, "t", {10, 10}, {0, 1});
  auto p = PlaceLostShards(info, Ids(2), {0, 1}, {});
  ASSERT_EQ(p.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(p.status().message(),
            "no live worker to take the shards of rank 0 (h0:1), rank 1 (h1:1); start one");
}

TEST(ReplacementPolicyTest, RanksHoldingNothingTakeNothing) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {10, 10}, {0, 1});
  // Every worker is live (rank 0 is lost by force), none is a spare, and
  // rank 2 holds nothing.
  auto p = PlaceLostShards(info, Ids(3), {0},
                           {{"w1", 1, "h0:1"}, {"w2", 2, "h1:1"}, {"w3", 3, "h2:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(ShardRanks(*p, 0), (std::vector<int>{1, 1}));
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{1, 320}}));
}

TEST(ReplacementPolicyTest, LoadIsBytesNotRows) {
  CollectionInfo info = Info(3);
  ember::v1::TableConfig* a = AddRowWise(&info, "a", {10}, {0});
  a->set_data_type(ember::v1::FP16);
  a->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAM);
  AddRowWise(&info, "t", {20, 10}, {1, 2});
  auto p = PlaceLostShards(info, Ids(3), {2}, {{"w1", 1, "h0:1"}, {"w2", 2, "h1:1"}});
  ASSERT_TRUE(p.ok()) << p.status();
  // a's rows: 4 fp16 weights and 8 fp32 moments, 40 bytes: rank 0 holds 400
  // bytes in 10 rows, rank 1 320 bytes in 20 rows, so rank 1 takes it.
  EXPECT_EQ(ShardRanks(*p, 1), (std::vector<int>{1, 1}));
  EXPECT_EQ(p->load, (std::map<int, int64_t>{{0, 400}, {1, 480}}));
}

TEST(ReplacementPolicyTest, TheInputIsLeftAsItWas) {
  CollectionInfo info = Info(2);
  AddRowWise(&info, "t", {10, 10}, {0, 1});
  const std::string before = info.SerializeAsString();
  ASSERT_TRUE(PlaceLostShards(info, Ids(2), {1}, {{"w1", 1, "h0:1"}}).ok());
  EXPECT_EQ(info.SerializeAsString(), before);
}

TEST(ReplacementPolicyTest, RefusesInputTheCoordinatorNeverMakes) {
  CollectionInfo info = Info(3);
  AddRowWise(&info, "t", {10, 10, 10}, {0, 1, 2});
  auto few = PlaceLostShards(info, Ids(2), {1}, {});
  EXPECT_EQ(few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(few.status().message(), "2 worker ids for 3 ranks");
  auto outside = PlaceLostShards(info, Ids(3), {5}, {});
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(outside.status().message(), "lost rank 5 is not in [0, 3)");
  CollectionInfo orphan = Info(2);
  AddRowWise(&orphan, "t", {10}, {0});
  AddReplicated(&orphan, "d", 8, {});
  auto none = PlaceLostShards(orphan, Ids(2), {1}, {{"w1", 1, "h0:1"}});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(none.status().message(), "data-parallel table 'd' has no replica");
}

TEST(ReplacementPolicyTest, DescribeRanksNamesRankAndAddress) {
  CollectionInfo info = Info(3);
  EXPECT_EQ(DescribeRanks(info, {0, 2}), "rank 0 (h0:1), rank 2 (h2:1)");
  EXPECT_EQ(DescribeRanks(info, {}), "");
}

}  // namespace
}  // namespace coordinator
}  // namespace ember

namespace ember {
namespace coordinator {
namespace {

// A replicated collection: shard i of a row-wise table with its primary on
// ranks[i] and one backup on backups[i].
CollectionInfo Replicated(const std::vector<int>& ranks, const std::vector<int>& backups) {
  CollectionInfo info = Info(3);
  info.mutable_spec()->set_replicas(2);
  AddRowWise(&info, "t", std::vector<int64_t>(ranks.size(), 10), ranks);
  for (size_t i = 0; i < backups.size(); ++i) {
    info.mutable_plan()->mutable_tables(0)->mutable_shards(i)->add_backups(backups[i]);
  }
  return info;
}

TEST(PromoteCopiesTest, BackupsTakeOverLostPrimariesAndLostBackupsGo) {
  CollectionInfo info = Replicated({0, 1, 2}, {1, 2, 0});
  AddReplicated(&info, "dp", 5, {0, 1, 2});
  EXPECT_EQ(MissingCopies(info), 0);
  ember::v1::ShardingPlan plan = info.plan();
  EXPECT_EQ(PromoteCopies({0}, &plan), 1);
  const auto& shards = plan.tables(0).shards();
  EXPECT_EQ(shards[0].rank(), 1);  // its backup took over
  EXPECT_EQ(shards[0].backups_size(), 0);
  EXPECT_EQ(shards[1].rank(), 1);  // untouched
  EXPECT_EQ(shards[1].backups(0), 2);
  EXPECT_EQ(shards[2].rank(), 2);  // lost its backup on rank 0
  EXPECT_EQ(shards[2].backups_size(), 0);
  EXPECT_EQ(std::vector<int>(plan.tables(0).ranks().begin(), plan.tables(0).ranks().end()),
            (std::vector<int>{1, 1, 2}));
  EXPECT_EQ(std::vector<int>(plan.tables(1).ranks().begin(), plan.tables(1).ranks().end()),
            (std::vector<int>{1, 2}));
  CollectionInfo after = info;
  *after.mutable_plan() = plan;
  EXPECT_EQ(MissingCopies(after), 2);
  EXPECT_EQ(planner::HoldingRanks(plan).count(0), 0u);
}

TEST(PromoteCopiesTest, AShardWithNoCopyLeftStaysForTheCheckpoint) {
  const CollectionInfo info = Replicated({0, 1}, {1, 0});
  ember::v1::ShardingPlan plan = info.plan();
  EXPECT_EQ(PromoteCopies({0, 1}, &plan), 0);
  EXPECT_EQ(plan.tables(0).shards(0).rank(), 0);
  EXPECT_EQ(plan.tables(0).shards(1).rank(), 1);
  EXPECT_EQ(planner::HoldingRanks(plan), (std::set<int>{0, 1}));
  // A collection of one copy is never short of copies.
  CollectionInfo one = Info(2);
  AddRowWise(&one, "t", {10, 10}, {0, 1});
  EXPECT_EQ(MissingCopies(one), 0);
}

}  // namespace
}  // namespace coordinator
}  // namespace ember
