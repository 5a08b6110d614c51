// The planner's parts (planner.h is their one entry): the options a table
// may take and what they cost (plan_options.cc), the search over them
// (plan_search.h, plan_search.cc), the bounds it aims at and the report when
// nothing fits (plan_bounds.cc), and a plan's per-rank statistics
// (plan_stats.cc). Private to //planner:planner.
//
// Thread-safe: pure functions over plain data.
#ifndef EMBER_PLANNER_PLAN_INTERNAL_H_
#define EMBER_PLANNER_PLAN_INTERNAL_H_

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "planner/cost_model.h"
#include "planner/planner.h"
#include "planner/shard_geometry.h"
#include "planner/sharding_types.h"
#include "proto/collection.pb.h"
#include "proto/plan.pb.h"

namespace ember {
namespace planner {
namespace internal {

using ember::v1::CollectionSpec;
using ember::v1::ComputeDevice;
using ember::v1::ParameterConstraints;
using ember::v1::ShardingPlan;
using ember::v1::TableConfig;
using ember::v1::Topology;

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
inline constexpr int kDefaultBatchSize = 512;

inline std::string GiB(double bytes) { return absl::StrFormat("%.2f GiB", bytes / kGiB); }

// How an option's shards may be placed.
enum class Placement {
  kFree,       // each shard on any worker, shards of one table apart
  kFixed,      // shard i on rank i (row_wise; data_parallel replicas)
  kHostFixed,  // shard i on rank i of one host (table_row_wise)
  kHostFree,   // shards on distinct workers of one host (table_column_wise)
};

// Consecutive shards with the same shape and therefore the same cost.
struct Run {
  int count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  ShardCost cost;
};

struct Option {
  ShardingType type;
  ComputeKernel kernel;
  Placement placement;
  std::vector<ShardBlock> blocks;  // the shards, in order (data_parallel: one per replica)
  std::vector<Run> runs;
  int num_shards = 0;
  double total_cost = 0;
  double max_shard_cost = 0;
  int64_t total_hbm = 0;
  int64_t total_ddr = 0;
  int64_t max_shard_hbm = 0;
  int64_t max_shard_ddr = 0;
  int64_t max_shard_ssd = 0;  // the key_value kernel's file

  const Run& RunOf(int shard) const {
    for (const Run& r : runs) {
      if (shard < r.count) return r;
      shard -= r.count;
    }
    return runs.back();
  }
};

struct TableInfo {
  std::vector<Option> options;  // sorted: cheapest total cost first
  // The table's cache_load_factor (TableWorkload), for the kernels that cache.
  double cache_load_factor = 0;
  double min_total_cost = 0;
  double min_max_shard_cost = 0;
  int64_t min_total_hbm = 0;
  int64_t min_total_ddr = 0;
};

// Per-worker running totals.
struct Loads {
  std::vector<double> cost;
  std::vector<int64_t> hbm;
  std::vector<int64_t> ddr;
  std::vector<int64_t> ssd;

  explicit Loads(int w) : cost(w, 0.0), hbm(w, 0), ddr(w, 0), ssd(w, 0) {}
  void Add(int r, const ShardCost& c, int sign) {
    cost[r] += sign * c.total_ms();
    hbm[r] += sign * c.hbm_bytes;
    ddr[r] += sign * c.ddr_bytes;
    ssd[r] += sign * c.ssd_bytes;
  }
  double Max() const { return *std::max_element(cost.begin(), cost.end()); }
};

struct Assignment {
  int option = -1;
  std::vector<int> ranks;  // one per shard
};

struct Solution {
  bool ok = false;
  int failed_table = -1;
  std::vector<Assignment> tables;
  Loads loads{0};
  double makespan = kInf;
};

class Search;  // plan_search.h

// Lower bounds on the slowest worker's cost: max(total / W, largest shard)
// and the option-aware one (OptionAwareLowerBound), on the shards' costs
// (the greedy passes' targets); and the same with the workers' caches,
// which a plan's makespan cannot go below (equal to the first two when the
// model has no caches). With caches: no worker saves more than its caches
// hold at the hottest bytes' rate (s_max), the workers together no more
// than W * s_max or every table's largest saving, and a shard's worker no
// less than the shard less its own saving with the whole cache.
struct Bounds {
  double simple = 0, tight = 0;
  double cached_simple = 0, cached_tight = 0;
};

// --- Options (plan_options.cc) ---

// A table's constraints, or empty ones when the spec gives none.
const ParameterConstraints& ConstraintsFor(const CollectionSpec& spec,
                                           const std::string& table);

// Blocks of a table under a sharding type.
std::vector<ShardBlock> BlocksFor(ShardingType type, const TableConfig& t,
                                  const ParameterConstraints& c, int w,
                                  int lw);

Placement PlacementFor(ShardingType type);

// Kernels a sharding type may use on a device, within the constraints and
// the kernels the workers serve (`served`, TorchRec's names; empty: all).
// On CPU workers every kernel is host memory: a constraint naming a UVM
// kernel is honoured as `fused`.
std::vector<ComputeKernel> KernelsFor(
    ShardingType type, ComputeDevice device, const ParameterConstraints& c,
    const google::protobuf::RepeatedPtrField<std::string>& served);

TableWorkload WorkloadFor(const TableConfig& t, const ParameterConstraints& c,
                          const Topology& topo, const CostModel& model);

Option MakeOption(ShardingType type, ComputeKernel kernel,
                  const std::vector<ShardBlock>& blocks,
                  const TableWorkload& work, const TableConfig& t,
                  const CostModel& model, ComputeDevice device, int w);

std::string OptionName(const Option& o);

// Fills a table's summary of its options (least cost, memory...).
void Summarize(TableInfo* info);

// Usable capacity per worker: the topology's (per-rank overrides
// included) less the model's reserved fractions.
void Capacities(const Topology& topo, const CostModel& model, std::vector<int64_t>* hbm_cap,
                std::vector<int64_t>* ddr_cap);
// Each rank's SSD for key_value files (DeviceCapacity.ssd_bytes, else the
// topology's ssd_cap_bytes); INT64_MAX where neither says.
std::vector<int64_t> SsdCapacities(const Topology& topo);

// Every table's options (allowed sharding type x compute kernel), cheapest
// first. INVALID_ARGUMENT when a table's constraints allow none.
absl::StatusOr<std::vector<TableInfo>> EnumerateOptions(const CollectionSpec& spec,
                                                        const Topology& topo,
                                                        const CostModel& model);

// --- Bounds, and why nothing fits (plan_bounds.cc) ---

// A tighter lower bound than max(total / W, largest shard): in any plan with
// makespan M each table uses a layout whose largest shard costs at most M,
// so M * W >= sum over tables of the least total cost among such layouts.
// The smallest M meeting that is found by bisection.
double OptionAwareLowerBound(const std::vector<TableInfo>& tables, int w,
                             double simple_bound);

Bounds LowerBounds(const std::vector<TableInfo>& tables, int w, const CostModel& model);

// Explains why no plan fits, naming tables, bytes and remedies (the UVM
// kernels among them only where the workers serve them: uvm_served).
absl::Status Infeasible(const CollectionSpec& spec,
                        const std::vector<TableInfo>& tables,
                        const std::vector<int64_t>& hbm_cap,
                        const std::vector<int64_t>& ddr_cap, Search* search,
                        int failed_table, const CostModel& model,
                        ComputeDevice device, bool uvm_served);

// --- The search (plan_search.cc) ---

// The search on `tables` (Search's): greedy passes in two table orders (by
// work, by memory footprint) with a search on the target, again under HBM
// budgets when HBM binds, then local search on the best. !ok, with
// failed_table, when nothing fits.
Solution Solve(Search* search, const std::vector<TableInfo>& tables,
               const std::vector<int64_t>& hbm_cap, const Bounds& bounds,
               const CostModel& model, const PlannerOptions& options);

// --- Statistics (plan_stats.cc) ---

// The per-rank statistics of `plan` (whose tables list their sharding
// type, kernel and shards; data_parallel: a replica on every rank), each
// shard estimated by the cost model, against the usable capacities.
void FillStats(const CollectionSpec& spec, const CostModel& model,
               const std::vector<int64_t>& hbm_cap, const std::vector<int64_t>& ddr_cap,
               const Bounds& bounds, ShardingPlan* plan);

}  // namespace internal
}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_PLAN_INTERNAL_H_
