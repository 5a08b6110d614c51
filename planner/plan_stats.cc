// A plan's per-rank statistics, per plan_internal.h.
#include "planner/plan_internal.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "planner/plan_view.h"

namespace ember {
namespace planner {
namespace internal {

void FillStats(const CollectionSpec& spec, const CostModel& model,
               const std::vector<int64_t>& hbm_cap, const std::vector<int64_t>& ddr_cap,
               const Bounds& bounds, ShardingPlan* plan) {
  const Topology& topo = plan->topology();
  const int w = topo.world_size();
  std::map<std::string, int> index;
  for (int t = 0; t < spec.tables_size(); ++t) index[spec.tables(t).name()] = t;
  std::vector<ember::v1::RankStats> per_rank(w);
  std::vector<bool> busy(w, false);  // holds a non-empty shard
  std::vector<std::vector<ShardCost>> held(w);  // each worker's shards
  for (int r = 0; r < w; ++r) {
    per_rank[r].set_rank(r);
    per_rank[r].set_hbm_cap_bytes(hbm_cap[r]);
    per_rank[r].set_ddr_cap_bytes(ddr_cap[r]);
  }
  const std::vector<int64_t> ssd_cap = SsdCapacities(topo);
  for (int r = 0; r < w; ++r) {
    if (ssd_cap[r] != std::numeric_limits<int64_t>::max()) per_rank[r].set_ssd_cap_bytes(ssd_cap[r]);
  }
  for (const auto& ts : plan->tables()) {
    const TableConfig& tc = spec.tables(index.at(ts.table()));
    const TableWorkload work = WorkloadFor(tc, ConstraintsFor(spec, tc.name()), topo, model);
    const ShardingType type = *ParseShardingType(ts.sharding_type());
    const ComputeKernel kernel = *ParseComputeKernel(ts.compute_kernel());
    // A backup copy (Shard.backups) takes the shard's memory and applies
    // its updates; lookups are the primary's.
    auto add = [&](int rank, const ShardBlock& b, bool backup) {
      ShardCost sc = EstimateShard(model, work, type, kernel, topo.compute_device(), b,
                                   tc.num_embeddings(), w);
      if (backup) sc.fwd_compute_ms = sc.fwd_comms_ms = sc.fwd_cache_saving_ms = 0;
      auto& rs = per_rank[rank];
      rs.set_hbm_bytes(rs.hbm_bytes() + sc.hbm_bytes);
      rs.set_ddr_bytes(rs.ddr_bytes() + sc.ddr_bytes);
      rs.set_ssd_bytes(rs.ssd_bytes() + sc.ssd_bytes);
      rs.set_fwd_compute_ms(rs.fwd_compute_ms() + sc.fwd_compute_ms);
      rs.set_fwd_comms_ms(rs.fwd_comms_ms() + sc.fwd_comms_ms);
      rs.set_bwd_compute_ms(rs.bwd_compute_ms() + sc.bwd_compute_ms);
      rs.set_bwd_comms_ms(rs.bwd_comms_ms() + sc.bwd_comms_ms);
      rs.set_num_shards(rs.num_shards() + 1);
      if (b.rows > 0 && b.cols > 0) busy[rank] = true;
      held[rank].push_back(sc);
    };
    for (const PlacedBlock& b : TableBlocks(ts, tc.num_embeddings(), tc.embedding_dim())) {
      const ShardBlock block{b.row_offset, b.col_offset, b.rows, b.cols};
      add(b.rank, block, /*backup=*/false);
      for (int r : b.backups) {
        if (r >= 0 && r < w) add(r, block, /*backup=*/true);
      }
    }
  }
  auto* stats = plan->mutable_stats();
  stats->clear_per_rank();
  double max_cost = 0, sum_cost = 0;
  for (auto& rs : per_rank) {
    // What the worker's caches save, from its forward and backward compute
    // (CachedFractions: the search's LocalSearch takes the same off).
    std::vector<const ShardCost*> shards;
    for (const ShardCost& c : held[rs.rank()]) shards.push_back(&c);
    const std::vector<double> cached = CachedFractions(model, shards);
    for (size_t i = 0; i < shards.size(); ++i) {
      rs.set_fwd_compute_ms(rs.fwd_compute_ms() - cached[i] * shards[i]->fwd_cache_saving_ms);
      rs.set_bwd_compute_ms(rs.bwd_compute_ms() - cached[i] * shards[i]->bwd_cache_saving_ms);
    }
    // Two calls per step reach each busy worker, a lookup and an update
    // (the model's per-call time; the search leaves it out: it is the same
    // for every busy worker).
    if (busy[rs.rank()]) {
      rs.set_fwd_compute_ms(rs.fwd_compute_ms() + model.per_call_overhead_ms);
      rs.set_bwd_compute_ms(rs.bwd_compute_ms() + model.per_call_overhead_ms);
    }
    rs.set_cost_ms(rs.fwd_compute_ms() + rs.fwd_comms_ms() + rs.bwd_compute_ms() +
                   rs.bwd_comms_ms());
    max_cost = std::max(max_cost, rs.cost_ms());
    sum_cost += rs.cost_ms();
    *stats->add_per_rank() = rs;
  }
  stats->set_max_cost_ms(max_cost);
  stats->set_mean_cost_ms(sum_cost / w);
  stats->set_balance(sum_cost > 0 ? max_cost / (sum_cost / w) : 1.0);
  // The bounds are on the search's costs: a busy worker's per-call time on
  // top, as on the plan's.
  stats->set_lower_bound_ms(bounds.cached_simple + 2 * model.per_call_overhead_ms);
  stats->set_option_lower_bound_ms(bounds.cached_tight + 2 * model.per_call_overhead_ms);
}

}  // namespace internal
}  // namespace planner
}  // namespace ember
