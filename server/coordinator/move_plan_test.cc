// PlanMove against moves worked by hand: a row-wise table re-cut from two
// workers to three, a table-wise table and a replica moving off an emptied
// worker, and the moves it must refuse.
#include "server/coordinator/move_plan.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace coordinator {
namespace {

using ember::v1::CollectionInfo;

// Table t: 12 rows of 8 columns, SGD (no optimizer state: 32 bytes a row).
ember::v1::TableConfig Table(const std::string& name, bool dynamic = false) {
  ember::v1::TableConfig t;
  t.set_name(name);
  t.set_num_embeddings(dynamic ? 0 : 12);
  t.set_embedding_dim(8);
  t.mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
  if (dynamic) t.mutable_dynamic()->set_capacity(12);
  return t;
}

struct Block {
  int rank;
  int64_t row_offset, rows, col_offset = 0, cols = 8;
};

// A collection on `addresses` whose table `name` has these shards (none:
// replicated on every rank).
CollectionInfo Info(const std::vector<std::string>& addresses,
                    const std::vector<std::pair<ember::v1::TableConfig, std::vector<Block>>>& tables) {
  CollectionInfo info;
  info.mutable_spec()->set_name("c");
  for (const std::string& a : addresses) info.add_worker_addresses(a);
  for (const auto& [table, blocks] : tables) {
    *info.mutable_spec()->add_tables() = table;
    auto* ts = info.mutable_plan()->add_tables();
    ts->set_table(table.name());
    ts->set_compute_kernel("fused");
    if (blocks.empty()) {
      ts->set_sharding_type("data_parallel");
      for (size_t r = 0; r < addresses.size(); ++r) ts->add_ranks(static_cast<int>(r));
      continue;
    }
    ts->set_sharding_type("row_wise");
    for (const Block& b : blocks) {
      auto* s = ts->add_shards();
      s->set_rank(b.rank);
      s->set_row_offset(b.row_offset);
      s->set_rows(b.rows);
      s->set_col_offset(b.col_offset);
      s->set_cols(b.cols);
      ts->add_ranks(b.rank);
    }
  }
  return info;
}

std::string Describe(const RowCopy& c) {
  return c.from + "/" + std::to_string(c.from_ref.shard_index()) + "[" +
         std::to_string(c.from_row) + "] -> " + c.to + "/" +
         std::to_string(c.to_ref.shard_index()) + "[" + std::to_string(c.to_row) + "] x" +
         std::to_string(c.rows);
}

TEST(MovePlanTest, ARowWiseTableIsReCutFromTwoWorkersToThree) {
  const CollectionInfo before = Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {1, 6, 6}}}});
  const CollectionInfo after =
      Info({"A", "B", "C"}, {{Table("t"), {{0, 0, 4}, {1, 4, 4}, {2, 8, 4}}}});
  auto plan = PlanMove(before, after);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->create.size(), 1u);
  ASSERT_EQ(plan->create.at("C").size(), 1u);
  EXPECT_EQ(plan->create.at("C")[0].row_offset(), 8);
  ASSERT_EQ(plan->stage.at("A").size(), 1u);
  EXPECT_EQ(plan->stage.at("A")[0].rows(), 4);
  ASSERT_EQ(plan->stage.at("B").size(), 1u);
  EXPECT_EQ(plan->stage.at("B")[0].row_offset(), 4);
  EXPECT_TRUE(plan->emptied.empty());
  std::vector<std::string> got;
  for (const RowCopy& c : plan->copies) got.push_back(Describe(c));
  // New shard 1 (rows 4..8) takes rows 4, 5 from A's old shard 0 (its rows
  // 4, 5) and rows 6, 7 from B's old shard 1 (its rows 0, 1).
  EXPECT_EQ(got, (std::vector<std::string>{"A/0[0] -> A/0[0] x4", "A/0[4] -> B/1[0] x2",
                                           "B/1[0] -> B/1[2] x2", "B/1[2] -> C/2[0] x4"}));
  EXPECT_EQ(plan->bytes, 12 * 32);
  EXPECT_EQ(plan->bytes_between_workers, 6 * 32);  // rows 4, 5 and 8..11 change worker
}

TEST(MovePlanTest, ShardsAndReplicasLeaveAnEmptiedWorker) {
  // u: table-wise on B; r: replicated on A and B. B is emptied onto C.
  const CollectionInfo before =
      Info({"A", "B"}, {{Table("u"), {{1, 0, 12}}}, {Table("r"), {}}});
  const CollectionInfo after =
      Info({"A", "C"}, {{Table("u"), {{1, 0, 12}}}, {Table("r"), {}}});
  auto plan = PlanMove(before, after);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->emptied, (std::set<std::string>{"B"}));
  EXPECT_TRUE(plan->stage.at("A").empty());  // A keeps its replica as it is
  ASSERT_EQ(plan->create.at("C").size(), 2u);
  std::vector<std::string> got;
  for (const RowCopy& c : plan->copies) got.push_back(Describe(c));
  // The replica on C (index 1, its rank) copies the first old replica
  // (A's, index 0): none is on C.
  EXPECT_EQ(got, (std::vector<std::string>{"B/0[0] -> C/0[0] x12", "A/0[0] -> C/1[0] x12"}));
  EXPECT_EQ(plan->bytes_between_workers, plan->bytes);
}

TEST(MovePlanTest, ColumnChangesDynamicReCutsAndGapsAreRefused) {
  const CollectionInfo before = Info({"A", "B"}, {{Table("t"), {{0, 0, 12, 0, 4}, {1, 0, 12, 4, 4}}}});
  const CollectionInfo whole = Info({"A", "B"}, {{Table("t"), {{0, 0, 12}}}});
  EXPECT_EQ(PlanMove(before, whole).status().code(), absl::StatusCode::kInvalidArgument);
  const CollectionInfo dyn = Info({"A", "B"}, {{Table("d", true), {{0, 0, 6}, {1, 6, 6}}}});
  const CollectionInfo dyn3 =
      Info({"A", "B", "C"}, {{Table("d", true), {{0, 0, 4}, {1, 4, 4}, {2, 8, 4}}}});
  auto refused = PlanMove(dyn, dyn3);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("re-hash"), std::string::npos) << refused.status();
  // A dynamic shard moved whole is fine.
  const CollectionInfo dyn_moved = Info({"A", "C"}, {{Table("d", true), {{0, 0, 6}, {1, 6, 6}}}});
  EXPECT_TRUE(PlanMove(dyn, dyn_moved).ok());
  // Rows no old shard holds.
  const CollectionInfo short_before = Info({"A"}, {{Table("t"), {{0, 0, 6}}}});
  EXPECT_EQ(PlanMove(short_before, whole).status().code(), absl::StatusCode::kInvalidArgument);
}

// RescalePlan against plans worked by hand: row_wise re-cut, replicas on
// every rank, a table-wise shard leaving with its worker, evening out onto
// a new worker, and the refusals.
TEST(RescalePlanTest, RowWiseIsReCutAndOtherShardsFollowTheirWorkers) {
  // t: row_wise on A, B; u and v: table_wise on B; r: replicated on A, B.
  // Bytes (fp32, dim 8, SGD: 32 B a row): t 384 in all, u, v and each
  // replica of r 384.
  CollectionInfo before = Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {1, 6, 6}}},
                                            {Table("u"), {{1, 0, 12}}},
                                            {Table("v"), {{1, 0, 12}}},
                                            {Table("r"), {}}});
  before.mutable_plan()->mutable_tables(1)->set_sharding_type("table_wise");
  before.mutable_plan()->mutable_tables(2)->set_sharding_type("table_wise");
  // Grow: new ranks 0, 1 are old 0, 1; rank 2 is new.
  auto grown = RescalePlan(before, {0, 1, -1});
  ASSERT_TRUE(grown.ok()) << grown.status();
  const ember::v1::TableSharding& t = grown->tables(0);
  ASSERT_EQ(t.shards_size(), 3);  // 12 rows over 3: 4, 4, 4
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(t.shards(i).row_offset(), 4 * i);
    EXPECT_EQ(t.shards(i).rows(), 4);
    EXPECT_EQ(t.shards(i).rank(), i);
  }
  EXPECT_EQ(grown->tables(3).ranks_size(), 3);  // a replica on each
  // Loads: rank 0 128 + 384, rank 1 128 + 384 + 768 (u, v), rank 2 512.
  // Moving u (the first of the largest) to the emptiest (ranks 0 and 2
  // tie: the new worker's) leaves 896 and 896, both below 1280: it moves;
  // then nothing lightens the fullest further.
  EXPECT_EQ(grown->tables(1).shards(0).rank(), 2);
  EXPECT_EQ(grown->tables(2).shards(0).rank(), 1);
  // Shrink to B alone (new rank 0 is old rank 1): all there, t one block.
  auto shrunk = RescalePlan(before, {1});
  ASSERT_TRUE(shrunk.ok()) << shrunk.status();
  ASSERT_EQ(shrunk->tables(0).shards_size(), 1);
  EXPECT_EQ(shrunk->tables(0).shards(0).rows(), 12);
  EXPECT_EQ(shrunk->tables(1).shards(0).rank(), 0);
  EXPECT_EQ(shrunk->tables(3).ranks_size(), 1);
  // B leaves for a new worker: u and v go to the emptiest rank each in turn
  // (both hold 192 + 384: the new worker's first; then rank 0).
  auto without_b = RescalePlan(before, {0, -1});
  ASSERT_TRUE(without_b.ok());
  EXPECT_EQ(without_b->tables(1).shards(0).rank(), 1);
  EXPECT_EQ(without_b->tables(2).shards(0).rank(), 0);
  // PlanMove covers every new shard of the grown plan from the old one.
  CollectionInfo after = before;
  *after.mutable_plan() = *grown;
  after.clear_worker_addresses();
  for (const char* a : {"A", "B", "C"}) after.add_worker_addresses(a);
  auto moves = PlanMove(before, after);
  ASSERT_TRUE(moves.ok()) << moves.status();
  EXPECT_TRUE(moves->emptied.empty());
  EXPECT_EQ(moves->create.at("C").size(), 3u);  // t's third block, u, r's replica
}

TEST(RescalePlanTest, BadRankMapsAndDynamicReCutsAreRefused) {
  const CollectionInfo before = Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {1, 6, 6}}}});
  EXPECT_EQ(RescalePlan(before, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RescalePlan(before, {0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RescalePlan(before, {5}).status().code(), absl::StatusCode::kInvalidArgument);
  const CollectionInfo dyn = Info({"A", "B"}, {{Table("d", true), {{0, 0, 6}, {1, 6, 6}}}});
  auto grown = RescalePlan(dyn, {0, 1, -1});
  EXPECT_EQ(grown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(grown.status().message().find("restore"), std::string::npos) << grown.status();
  // The same count keeps a dynamic table's blocks (a worker swapped: moved whole).
  auto swapped = RescalePlan(dyn, {0, -1});
  ASSERT_TRUE(swapped.ok()) << swapped.status();
  EXPECT_EQ(swapped->tables(0).shards(1).rows(), 6);
  EXPECT_EQ(swapped->tables(0).shards(1).rank(), 1);
}

}  // namespace
}  // namespace coordinator
}  // namespace ember

namespace ember {
namespace coordinator {
namespace {

// `info` with shard s of table 0 given backups b[s].
CollectionInfo WithBackups(CollectionInfo info, const std::vector<std::vector<int>>& b) {
  info.mutable_spec()->set_replicas(2);
  for (size_t s = 0; s < b.size(); ++s) {
    for (int r : b[s]) info.mutable_plan()->mutable_tables(0)->mutable_shards(s)->add_backups(r);
  }
  return info;
}

TEST(MovePlanTest, ANewBackupIsCopiedFromItsPrimaryAndAPromotionCopiesNothing) {
  // Shard 0 on A (backup gone), shard 1 on B with its backup on A.
  const CollectionInfo before =
      WithBackups(Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {1, 6, 6}}}}), {{}, {0}});
  // A promotion (B's shard 1 now primary on A) moves no row.
  const CollectionInfo promoted =
      WithBackups(Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {0, 6, 6}}}}), {{}, {}});
  auto none = PlanMove(before, promoted);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->copies.empty());
  EXPECT_EQ(none->emptied, (std::set<std::string>{"B"}));
  // A new backup of shard 0 on B: staged there, filled from A's primary
  // (never from a backup: one source per row).
  const CollectionInfo after =
      WithBackups(Info({"A", "B"}, {{Table("t"), {{0, 0, 6}, {1, 6, 6}}}}), {{1}, {0}});
  auto plan = PlanMove(before, after);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::string> got;
  for (const RowCopy& c : plan->copies) got.push_back(Describe(c));
  EXPECT_EQ(got, (std::vector<std::string>{"A/0[0] -> B/0[0] x6"}));
  ASSERT_EQ(plan->stage.at("B").size(), 1u);
  EXPECT_EQ(plan->stage.at("B")[0].replication().primary(), "A");
  EXPECT_TRUE(plan->stage.at("A").empty());  // its primary stays, now with a backup
  // After the switch A forwards shard 0's updates to B.
  bool forwards = false;
  for (const auto& a : plan->after.at("A")) {
    if (a.ref().shard_index() == 0) forwards = a.replication().backups_size() == 1 &&
                                               a.replication().backups(0) == "B";
  }
  EXPECT_TRUE(forwards);
}

TEST(RescalePlanTest, BackupsStayWithTheirWorkersAndTakeOverFromOnesThatLeave) {
  ember::v1::TableConfig t = Table("t");
  CollectionInfo before = Info({"A", "B", "C"}, {{t, {{0, 0, 12}}}});
  before.mutable_plan()->mutable_tables(0)->set_sharding_type("table_wise");
  before = WithBackups(before, {{2}});
  // A (rank 0, the primary) leaves: C's backup takes over.
  auto plan = RescalePlan(before, {1, 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tables(0).shards(0).rank(), 1);  // C, rank 1 now
  EXPECT_EQ(plan->tables(0).shards(0).backups_size(), 0);  // CheckPlan places one
  // B leaves: the primary and its backup stay where they are.
  plan = RescalePlan(before, {0, 2});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->tables(0).shards(0).rank(), 0);
  ASSERT_EQ(plan->tables(0).shards(0).backups_size(), 1);
  EXPECT_EQ(plan->tables(0).shards(0).backups(0), 1);
}

}  // namespace
}  // namespace coordinator
}  // namespace ember
