// A collection's plan as shard assignments: what each rank holds
// (ShardAssignment: the shard's ref, its table's config, its row and column
// ranges), where one shard lives, and what a shard weighs in memory. The
// plan is read through planner/plan_view.h (the replica rule).
//
// Thread-safe: pure functions.
#ifndef EMBER_SERVER_COORDINATOR_ASSIGNMENTS_H_
#define EMBER_SERVER_COORDINATOR_ASSIGNMENTS_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "proto/service.pb.h"

namespace ember {
namespace coordinator {

// One assignment: shard `index` of `table` (a replica: its rank).
ember::v1::ShardAssignment MakeAssignment(const ember::v1::TableConfig& table, int index,
                                          int64_t row_offset, int64_t col_offset, int64_t rows,
                                          int64_t cols);

// Every assignment of `rank` under info's plan, in plan order, as
// PlanAndCreate makes them: the primary copies it holds (with their
// backups' addresses) and the backup copies (with their primary's).
std::vector<ember::v1::ShardAssignment> AssignmentsOf(const ember::v1::CollectionInfo& info,
                                                      int rank);

// The rank holding shard `ref` (a data-parallel replica: its rank; a
// replicated shard: its primary's); -1 if
// the plan has no such table or shard.
int RankOf(const ember::v1::CollectionInfo& info, const ember::v1::ShardRef& ref);

// The assignment of shard `ref`; nullopt if the plan has no such shard.
std::optional<ember::v1::ShardAssignment> AssignmentOf(const ember::v1::CollectionInfo& info,
                                                       const ember::v1::ShardRef& ref);

// The bytes a worker holds for `a`: weights and optimizer state
// (backend::ShardBytes of its shard spec).
int64_t AssignmentBytes(const ember::v1::ShardAssignment& a);

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_ASSIGNMENTS_H_
