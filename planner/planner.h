// The sharding planner: collection spec + topology in, sharding plan out.
//
// A pure library (no RPC, CUDA, clock or file system), so the coordinator,
// the CLI, tests and benchmarks all plan the same way.
//
// Search. Every table gets one option per allowed (sharding type, compute
// kernel) pair, each with its shards' estimated cost and memory (see
// cost_model.h); column splits chosen freely get one per column width
// FreeColumnWidths offers (shard_geometry.h). The objective is the slowest worker's estimated step time,
// subject to every worker's own HBM and host-memory capacity:
//  1. For a makespan target T, a greedy pass takes tables in decreasing order
//     of work and gives each the cheapest option (least total cost) that can
//     be placed with no worker above T or over capacity; free shards
//     (table_wise, column_wise) go to the least-loaded worker that fits.
//     Binary search on T, from the lower bound up to an unconstrained greedy
//     plan, finds the tightest T the greedy pass meets. Two table orders are
//     tried (by work, by memory), and a third where some table may leave
//     memory (key_value, fused_uvm_caching, fused_uvm: by what its cheapest
//     option that takes less memory costs it over its cheapest, largest
//     first, so the tables that cache worst keep memory); the best plan is
//     kept.
//  2. Local search then moves, or swaps, free shards off the slowest worker
//     while that strictly lowers the pair's maximum. Where the model has
//     caches (CostModel::cache_bytes) a worker's cost here is its shards'
//     less what its caches save (CachedFractions: shards on one worker
//     share them), which the additive greedy passes cannot see.
// Unlike TorchEasyRec's DP proposer, which tracks only the total HBM, every
// placement is checked against each worker's capacity; unlike TorchRec's
// greedy proposers, the search is polynomial (about tables x options x
// workers x log(1/precision)). Deterministic: no randomness, stable ties.
// Tables are never dropped: a plan lists every table, or planning fails.
//
// Thread-safe: Plan() has no shared state.
#ifndef EMBER_PLANNER_PLANNER_H_
#define EMBER_PLANNER_PLANNER_H_

#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "planner/cost_model.h"
#include "proto/collection.pb.h"
#include "proto/plan.pb.h"

namespace ember {
namespace planner {

struct PlannerOptions {
  // Cost and capacity constants. Unset: DefaultCostModel(compute_device).
  // The topology's hbm_cap_bytes/ddr_cap_bytes and per-rank overrides take
  // precedence over the model's capacities.
  std::optional<CostModel> cost_model;
  // Binary-search steps on the makespan target (each one greedy pass).
  int search_steps = 24;
  // Upper bound on local-search moves.
  int max_local_search_moves = 200000;
};

// Plans `spec` on `topology`.
// Errors:
//  INVALID_ARGUMENT    the spec or topology is malformed (every problem
//                      listed), or constraints leave a table no option;
//  RESOURCE_EXHAUSTED  the tables cannot fit: the message names the tables,
//                      bytes needed against bytes available per worker, and
//                      what would make them fit.
absl::StatusOr<ember::v1::ShardingPlan> Plan(
    const ember::v1::CollectionSpec& spec, const ember::v1::Topology& topology,
    const PlannerOptions& options = PlannerOptions());

// Checks a plan made elsewhere (by hand, by TorchRec) for `spec` on
// `topology` as strictly as the planner's own output is made: one entry per
// table of the spec and nothing else, a sharding type the table's
// constraints allow and a compute kernel that type takes on the device,
// shards that tile the table exactly (every cell once, column offsets and
// widths multiples of 4) in the type's shape (table_wise one shard;
// row-wise shards take every column, one per rank; column-wise ones every
// row; table_* ones on one host), ranks in the topology, data_parallel with
// no shards and a replica on every rank; a shard's backups (Shard.backups)
// at most CollectionSpec.replicas - 1, on ranks of the topology other than
// its other copies' (those not named are placed: PlaceBackups). Returns the plan with the resolved
// topology, `ranks` listing each shard's rank, and the model's statistics.
// Errors: INVALID_ARGUMENT listing every problem (up to 20);
// RESOURCE_EXHAUSTED naming each rank over its memory.
absl::StatusOr<ember::v1::ShardingPlan> CheckPlan(
    const ember::v1::CollectionSpec& spec, const ember::v1::Topology& topology,
    const ember::v1::ShardingPlan& plan, const PlannerOptions& options = PlannerOptions());

// Gives every shard with rows of `plan` (a resolved plan: its topology
// filled in; data-parallel tables have no shards and are left alone)
// replicas - 1 backups. Backups it has on ranks outside `unavailable`, each
// on another rank than the shard's other copies, are kept (up to that
// many); each missing one goes to a rank outside `unavailable` other than
// the shard's copies, on another host than theirs where one is left, then
// to the rank holding the fewest cells (rows x columns, primaries and the
// backups so far; of equals the lowest rank), largest shards first. The
// search itself places primaries only: CheckPlan then prices every copy
// and refuses a plan whose copies do not fit (RESOURCE_EXHAUSTED).
// replicas <= 1 clears the backups. FAILED_PRECONDITION when fewer ranks
// than replicas are available.
absl::Status PlaceBackups(int replicas, ember::v1::ShardingPlan* plan,
                          const std::set<int>& unavailable = {});

// Restricts every table of `spec` to one sharding type (as the seed
// tutorial's constraints do), keeping the tables' other constraints.
// INVALID_ARGUMENT listing the valid names for an unknown type.
absl::Status ForceShardingType(const std::string& type, ember::v1::CollectionSpec* spec);

// The topology with every default filled in (local_world_size, batch_size,
// num_trainers, capacities from the cost model).
ember::v1::Topology ResolveTopology(const ember::v1::Topology& topology,
                                    const CostModel& model);

}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_PLANNER_H_
