// A plan read as blocks on ranks: what every reader of a sharding plan (the
// planner's stats, the coordinator's assignments and checkpoints, the
// client's routing, the in-process collection) derives from it, written
// once.
//
// The replica rule: a table with no shards in the plan (data_parallel) has
// a full replica, rows [0, table_rows) and columns [0, table_cols), on each
// of its plan's ranks, and a replica is named by its rank (ShardRef.
// shard_index). Any other table is its shards, in index order; a shard of 0
// rows (a trailing row-wise one) holds nothing, and readers skip it. A
// shard of a replicated collection (CollectionSpec.replicas) is one block:
// its rank holds the primary copy, `backups` the others.
//
// Thread-safe: pure functions.
#ifndef EMBER_PLANNER_PLAN_VIEW_H_
#define EMBER_PLANNER_PLAN_VIEW_H_

#include <cstdint>
#include <set>
#include <vector>

#include "proto/plan.pb.h"

namespace ember {
namespace planner {

struct PlacedBlock {
  int rank = 0;
  int32_t index = 0;  // ShardRef.shard_index: the shard's index; a replica's rank
  int64_t row_offset = 0;
  int64_t col_offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  bool replica = false;  // a data-parallel table's full copy
  // The ranks of the shard's other copies (Shard.backups; not a
  // data-parallel replica's).
  std::vector<int> backups;
  // Something a worker holds: a replica, or a shard with rows.
  bool Held() const { return replica || rows > 0; }
};

// Whether the table is replicated (data_parallel: no shards in the plan).
bool IsReplicated(const ember::v1::TableSharding& ts);

// Whether the table's kernel keeps a cache of its rows over a lower tier
// (math::KernelCachesRows): what a prefetch fills.
bool CachesRows(const ember::v1::TableSharding& ts);

// The table's blocks: a replica on each of ts.ranks() (in that order,
// table_rows x table_cols), or its shards in index order (empty ones too).
std::vector<PlacedBlock> TableBlocks(const ember::v1::TableSharding& ts, int64_t table_rows,
                                     int64_t table_cols);

// The ranks that hold something of the plan (PlacedBlock::Held), a shard's
// backups included.
std::set<int> HoldingRanks(const ember::v1::ShardingPlan& plan);

// The rank holding block `index` of the table: a replica's is its index,
// a shard's is its rank; -1 if the table has no such shard.
int RankOfBlock(const ember::v1::TableSharding& ts, int32_t index);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_PLAN_VIEW_H_
