// What a live move does (a pure function of the two placements): which
// workers stage or create which shards, which rows each new shard copies
// from which old one, and which workers are emptied. Workers are told
// apart by address: rank numbers may differ between the plans.
//
// A shard a worker holds with the same assignment in both plans stays
// where it is (its part in a replicated shard may change: a backup
// promoted, a primary given a new backup). Any other shard of the new plan,
// a new backup copy too, is filled from the old (primary) shards of its
// table whose rows overlap it, each overlap a block of whole
// rows (the columns must be the same: a live move re-cuts rows, never
// columns); a data-parallel replica copies one old replica (one on the same
// worker if there is one). A dynamic table's shard moves only whole (its
// rows are hash-placed slots: re-cutting them is a re-hash).
//
// Thread-safe: no shared state.
#ifndef EMBER_SERVER_COORDINATOR_MOVE_PLAN_H_
#define EMBER_SERVER_COORDINATOR_MOVE_PLAN_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/plan.pb.h"
#include "proto/service.pb.h"

namespace ember {
namespace coordinator {

// One block of rows copied in a live move: rows [from_row, from_row + rows)
// of shard from_ref on worker `from` into rows [to_row, ...) of to_ref on
// `to`, same columns; and the source's change mark the copied rows are
// current to (the copy fills it in).
struct RowCopy {
  std::string from, to;  // addresses
  ember::v1::ShardRef from_ref, to_ref;
  int64_t from_row = 0, to_row = 0, rows = 0;
  int64_t cols = 0, state_width = 0;
  bool dynamic = false;  // a dynamic table's shard: copied whole under the fence
  ember::v1::ChangeMark mark;
};

struct MovePlan {
  // Workers new to the collection: all their shards, created at the new
  // epoch (address -> assignments).
  std::map<std::string, std::vector<ember::v1::ShardAssignment>> create;
  // Workers that hold it: the shards they stage (none: they keep theirs),
  // and every assignment they hold after the switch.
  std::map<std::string, std::vector<ember::v1::ShardAssignment>> stage, after;
  // Workers holding something now and nothing after.
  std::set<std::string> emptied;
  std::vector<RowCopy> copies;
  // Bytes of weights and state the copies carry, all and between workers.
  int64_t bytes = 0, bytes_between_workers = 0;
};

// INVALID_ARGUMENT when a new shard cannot be filled from the old plan: a
// column layout changed, a dynamic shard re-cut, or rows no old shard
// covers.
absl::StatusOr<MovePlan> PlanMove(const ember::v1::CollectionInfo& before,
                                  const ember::v1::CollectionInfo& after);

// The plan of `before` on from.size() ranks, new rank i serving what old
// rank from[i] did (-1: a worker new to the collection):
//   row_wise        re-cut into one row block per rank (planner::
//                   RowWiseBlocks), block i on rank i;
//   data_parallel   a replica on every rank;
//   any other       each shard keeps its block, on its old rank's new one;
//                   a shard whose rank leaves goes to the rank holding the
//                   fewest bytes (of equals, a new worker's, then the
//                   lowest); then, while moving a table_wise or
//                   column_wise shard from the fullest rank to the emptiest
//                   leaves both below the fullest's load, the largest such
//                   moves.
// Topology and statistics are left to planner::CheckPlan. INVALID_ARGUMENT
// for an empty `from`, an old rank out of range or named twice, or a
// dynamic row_wise table whose worker count changes (a re-hash: not done
// live).
absl::StatusOr<ember::v1::ShardingPlan> RescalePlan(const ember::v1::CollectionInfo& before,
                                                    const std::vector<int>& from);

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_MOVE_PLAN_H_
