// Human and machine renderings of a sharding plan.
//
// Thread-safe: pure functions.
#ifndef EMBER_PLANNER_PLAN_FORMAT_H_
#define EMBER_PLANNER_PLAN_FORMAT_H_

#include <string>

#include "absl/status/statusor.h"

#include "proto/plan.pb.h"

namespace ember {
namespace planner {

// TorchRec's printed form: a table of `param | sharding type | compute kernel
// | ranks`, then `param | shard offsets | shard sizes | placement` for every
// sharded table (data_parallel tables are replicated and have no shards;
// a replicated collection's placement names the backups after the primary),
// then per-worker statistics: memory by tier against usable capacity,
// estimated cost split into forward/backward compute/comms, shard counts by
// type, and the balance (max/mean cost) against the lower bound.
std::string FormatPlanTable(const ember::v1::ShardingPlan& plan);

// One JSON object:
//  {"plan": [{"table", "sharding_type", "compute_kernel", "ranks": [...],
//             "shards": [{"offsets": [row, col], "sizes": [rows, cols],
//                         "rank": r, "backups": [r...] (a replicated
//                         collection's: omitted when none)}]}],
//   "stats": {"per_rank": [{"rank", "hbm_bytes", "ddr_bytes", "cost_ms"}],
//             "balance": max/mean, "max_cost_ms", "mean_cost_ms",
//             "lower_bound_ms"}}
// data_parallel tables list every rank and no shards.
std::string FormatPlanJson(const ember::v1::ShardingPlan& plan);

// A plan from JSON, in either form:
//  - Ember's (FormatPlanJson above; "stats" is ignored);
//  - TorchRec's ParameterSharding per table, as a dict printed to JSON:
//    {"<table>": {"sharding_type", "compute_kernel", "ranks": [...],
//                 "sharding_spec": {"shards": [{"shard_offsets": [row, col],
//                   "shard_sizes": [rows, cols], "placement": "rank:3/cuda:1"}]}
//                 or null (data_parallel), and TorchRec's other fields
//                 (cache_params, enforce_hbm, ...), which are ignored}}.
// Only the structure is checked here (INVALID_ARGUMENT naming the place);
// planner::CheckPlan checks the plan against a collection.
absl::StatusOr<ember::v1::ShardingPlan> ParsePlanJson(const std::string& json);

// TorchRec's placement string: "rank:3/cuda:1" (cuda index = rank modulo the
// local world size) or "rank:3/cpu".
std::string PlacementString(const ember::v1::ShardingPlan& plan, int rank);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_PLAN_FORMAT_H_
