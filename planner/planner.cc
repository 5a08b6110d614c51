#include "planner/planner.h"

#include <algorithm>
#include <map>
#include <set>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "planner/plan_internal.h"
#include "planner/plan_view.h"
#include "planner/plan_search.h"
#include "planner/shard_geometry.h"
#include "planner/sharding_types.h"
#include "planner/spec_validation.h"

namespace ember {
namespace planner {

using namespace internal;  // the planner's parts (plan_internal.h)

Topology ResolveTopology(const Topology& in, const CostModel& model) {
  Topology t = in;
  if (t.local_world_size() == 0) t.set_local_world_size(t.world_size());
  if (t.batch_size() == 0) t.set_batch_size(kDefaultBatchSize);
  if (t.num_trainers() == 0) t.set_num_trainers(t.world_size());
  if (t.hbm_cap_bytes() == 0 && t.compute_device() == ember::v1::CUDA) {
    t.set_hbm_cap_bytes(model.hbm_cap_bytes);
  }
  if (t.ddr_cap_bytes() == 0) t.set_ddr_cap_bytes(model.ddr_cap_bytes);
  return t;
}


namespace {

// What Plan and CheckPlan start from: the inputs checked, the cost model
// and the topology with its defaults filled in.
struct Setup {
  ComputeDevice device;
  CostModel model;
  Topology topo;

  static absl::StatusOr<Setup> Of(const CollectionSpec& spec, const Topology& topology,
                                  const PlannerOptions& options) {
    if (absl::Status s = ValidatePlanInputs(spec, topology); !s.ok()) return s;
    Setup out;
    out.device = topology.compute_device();
    out.model = options.cost_model.has_value() ? *options.cost_model : DefaultCostModel(out.device);
    out.topo = ResolveTopology(topology, out.model);
    return out;
  }
};


}  // namespace


absl::StatusOr<ShardingPlan> Plan(const CollectionSpec& spec_in,
                                  const Topology& topology_in,
                                  const PlannerOptions& options) {
  const CollectionSpec spec = WithDynamicRows(spec_in);
  auto setup = Setup::Of(spec, topology_in, options);
  if (!setup.ok()) return setup.status();
  const ComputeDevice device = setup->device;
  const CostModel& model = setup->model;
  const Topology& topo = setup->topo;
  const int w = topo.world_size();
  const int lw = topo.local_world_size();

  std::vector<int64_t> hbm_cap, ddr_cap;
  Capacities(topo, model, &hbm_cap, &ddr_cap);
  auto enumerated = EnumerateOptions(spec, topo, model);
  if (!enumerated.ok()) return enumerated.status();
  const std::vector<TableInfo>& tables = *enumerated;

  const Bounds bounds = LowerBounds(tables, w, model);
  Search search(tables, w, lw, hbm_cap, ddr_cap);
  search.SetSsdCaps(SsdCapacities(topo));
  Solution best = Solve(&search, tables, hbm_cap, bounds, model, options);
  if (!best.ok) {
    const auto& served = topo.compute_kernels();
    const bool uvm_served =
        served.empty() || std::find(served.begin(), served.end(), "fused_uvm") != served.end() ||
        std::find(served.begin(), served.end(), "fused_uvm_caching") != served.end();
    return Infeasible(spec, tables, hbm_cap, ddr_cap, &search, best.failed_table, model, device,
                      uvm_served);
  }
  // Seeds: the same search with every table held to one sharding type
  // (where the table allows it) can end lower than the free search, whose
  // greedy passes take each table's cheapest option first; the plan is the
  // best of them all, so it is never worse under the model than a plan
  // of one type for every table.
  // (Held options are a subset: their lower bounds are at least the free
  // ones', so a plan that meets the free bound needs no seed.)
  const bool optimal = best.makespan <= bounds.cached_tight * (1 + 1e-12);
  for (ShardingType type : AllShardingTypes()) {
    if (optimal) break;
    std::vector<TableInfo> held(tables.size());
    std::vector<std::vector<int>> original(tables.size());
    bool narrower = false;
    for (size_t t = 0; t < tables.size(); ++t) {
      for (int o = 0; o < static_cast<int>(tables[t].options.size()); ++o) {
        if (tables[t].options[o].type != type) continue;
        held[t].options.push_back(tables[t].options[o]);
        original[t].push_back(o);
      }
      if (held[t].options.empty()) {  // the table does not allow it: free
        held[t].options = tables[t].options;
        original[t].resize(tables[t].options.size());
        std::iota(original[t].begin(), original[t].end(), 0);
      } else if (held[t].options.size() < tables[t].options.size()) {
        narrower = true;
      }
      Summarize(&held[t]);
    }
    if (!narrower) continue;
    // A seed whose lower bound the plan already meets cannot beat it.
    const Bounds held_bounds = LowerBounds(held, w, model);
    if (held_bounds.cached_tight >= best.makespan * (1 - 1e-12)) continue;
    Search held_search(held, w, lw, hbm_cap, ddr_cap);
    held_search.SetSsdCaps(SsdCapacities(topo));
    Solution s = Solve(&held_search, held, hbm_cap, held_bounds, model, options);
    if (!s.ok || s.makespan >= best.makespan) continue;
    for (size_t t = 0; t < tables.size(); ++t) {
      s.tables[t].option = original[t][s.tables[t].option];
    }
    best = std::move(s);
  }
  const int n = spec.tables_size();

  // Build the plan.
  ShardingPlan plan;
  plan.set_collection(spec.name());
  *plan.mutable_topology() = topo;
  for (int t = 0; t < n; ++t) {
    const TableConfig& tc = spec.tables(t);
    const Option& o = tables[t].options[best.tables[t].option];
    const std::vector<int>& ranks = best.tables[t].ranks;
    auto* ts = plan.add_tables();
    ts->set_table(tc.name());
    ts->set_sharding_type(std::string(ShardingTypeName(o.type)));
    ts->set_compute_kernel(std::string(ComputeKernelName(o.kernel)));
    if (o.kernel == ComputeKernel::kKeyValue || o.kernel == ComputeKernel::kFusedUvmCaching) {
      ts->set_cache_load_factor(tables[t].cache_load_factor);
    }
    const std::vector<ShardBlock>& blocks = o.blocks;
    for (int i = 0; i < o.num_shards; ++i) {
      ts->add_ranks(ranks[i]);
      if (o.type == ShardingType::kDataParallel) continue;
      auto* shard = ts->add_shards();
      shard->set_row_offset(blocks[i].row_offset);
      shard->set_col_offset(blocks[i].col_offset);
      shard->set_rows(blocks[i].rows);
      shard->set_cols(blocks[i].cols);
      shard->set_rank(ranks[i]);
    }
  }
  FillStats(spec, model, hbm_cap, ddr_cap, bounds, &plan);
  // Backups are placed after the search, and priced with the rest.
  if (spec.replicas() > 1) return CheckPlan(spec_in, topology_in, plan, options);
  return plan;
}

absl::StatusOr<ShardingPlan> CheckPlan(const CollectionSpec& spec_in, const Topology& topology_in,
                                       const ShardingPlan& given, const PlannerOptions& options) {
  const CollectionSpec spec = WithDynamicRows(spec_in);
  auto setup = Setup::Of(spec, topology_in, options);
  if (!setup.ok()) return setup.status();
  const ComputeDevice device = setup->device;
  const CostModel& model = setup->model;
  const Topology& topo = setup->topo;
  const int w = topo.world_size();
  const int lw = topo.local_world_size();

  const int replicas = std::max(1, spec.replicas());
  constexpr int kMaxProblems = 20;
  std::vector<std::string> problems;
  auto problem = [&problems](auto&&... parts) {
    if (problems.size() < kMaxProblems) problems.push_back(absl::StrCat(parts...));
  };
  std::map<std::string, int> index;
  for (int t = 0; t < spec.tables_size(); ++t) index[spec.tables(t).name()] = t;
  std::vector<const ember::v1::TableSharding*> by_table(spec.tables_size(), nullptr);
  for (const auto& ts : given.tables()) {
    auto it = index.find(ts.table());
    if (it == index.end()) {
      problem("the plan names table '", ts.table().substr(0, 128), "', which the spec does not have");
      continue;
    }
    if (by_table[it->second] != nullptr) {
      problem("table '", ts.table(), "' is in the plan twice");
      continue;
    }
    by_table[it->second] = &ts;
  }

  ShardingPlan plan;
  plan.set_collection(spec.name());
  *plan.mutable_topology() = topo;
  for (int t = 0; t < spec.tables_size(); ++t) {
    const TableConfig& tc = spec.tables(t);
    const ember::v1::TableSharding* ts = by_table[t];
    const std::string label = absl::StrCat("table '", tc.name(), "'");
    if (ts == nullptr) {
      problem(label, " is not in the plan");
      continue;
    }
    auto type = ParseShardingType(ts->sharding_type());
    auto kernel = ParseComputeKernel(ts->compute_kernel());
    if (!type.ok()) problem(label, ": ", type.status().message());
    if (!kernel.ok()) problem(label, ": ", kernel.status().message());
    if (!type.ok() || !kernel.ok()) continue;
    const ParameterConstraints& c = ConstraintsFor(spec, tc.name());
    if (c.sharding_types_size() > 0 &&
        std::find(c.sharding_types().begin(), c.sharding_types().end(), ts->sharding_type()) ==
            c.sharding_types().end()) {
      problem(label, ": its constraints allow sharding types [",
              absl::StrJoin(c.sharding_types(), ", "), "], not ", ts->sharding_type());
    }
    if (tc.has_dynamic() && (!DynamicTableTakes(*type) || !DynamicTableTakes(*kernel))) {
      problem(label, ": a dynamic table takes table_wise or row_wise shards (on any kernel "
              "but dense), not ", ts->sharding_type(), " on ", ts->compute_kernel());
    }
    const std::vector<ComputeKernel> kernels =
        KernelsFor(*type, device, c, topo.compute_kernels());
    if (std::find(kernels.begin(), kernels.end(), *kernel) == kernels.end()) {
      std::vector<std::string> names;
      for (ComputeKernel k : kernels) names.emplace_back(ComputeKernelName(k));
      problem(label, ": ", ts->sharding_type(), " on ", ember::v1::ComputeDevice_Name(device),
              " workers takes compute kernel [", absl::StrJoin(names, ", "), "], not ",
              ts->compute_kernel());
    }
    auto* out = plan.add_tables();
    out->set_table(tc.name());
    out->set_sharding_type(ts->sharding_type());
    out->set_compute_kernel(ts->compute_kernel());
    const int64_t rows = tc.num_embeddings(), dim = tc.embedding_dim();
    if (*type == ShardingType::kDataParallel) {
      // A replica on every rank, and no shards.
      std::vector<int> ranks(ts->ranks().begin(), ts->ranks().end());
      std::sort(ranks.begin(), ranks.end());
      std::vector<int> all(w);
      std::iota(all.begin(), all.end(), 0);
      if (ts->shards_size() > 0) problem(label, ": data_parallel takes no shards");
      if (!ranks.empty() && ranks != all) {
        problem(label, ": data_parallel replicates to every rank 0..", w - 1);
      }
      for (int r = 0; r < w; ++r) out->add_ranks(r);
      continue;
    }
    if (ts->shards_size() == 0) {
      problem(label, ": ", ts->sharding_type(), " needs its shards (offsets, sizes, rank)");
      continue;
    }
    bool geometry_ok = true;
    std::set<int> ranks_used;
    std::set<int> hosts;
    for (int i = 0; i < ts->shards_size(); ++i) {
      const auto& sh = ts->shards(i);
      const std::string what = absl::StrCat(label, " shard ", i, " [", sh.row_offset(), ", ",
                                            sh.col_offset(), "] + [", sh.rows(), ", ", sh.cols(),
                                            "]");
      if (sh.rank() < 0 || sh.rank() >= w) {
        problem(what, ": rank ", sh.rank(), " is outside 0..", w - 1);
        geometry_ok = false;
        continue;
      }
      std::set<int> copies = {sh.rank()};
      for (int b : sh.backups()) {
        if (b < 0 || b >= w) {
          problem(what, ": backup rank ", b, " is outside 0..", w - 1);
          geometry_ok = false;
        } else if (!copies.insert(b).second) {
          problem(what, ": two copies on rank ", b);
          geometry_ok = false;
        }
      }
      if (sh.backups_size() > replicas - 1) {
        problem(what, ": ", sh.backups_size(), " backup(s); the collection's replicas (",
                replicas, ") takes ", replicas - 1);
        geometry_ok = false;
      }
      if (sh.row_offset() < 0 || sh.col_offset() < 0 || sh.rows() <= 0 || sh.cols() <= 0 ||
          sh.row_offset() > rows - sh.rows() || sh.col_offset() > dim - sh.cols()) {
        problem(what, ": outside the table's [", rows, ", ", dim, "] or empty");
        geometry_ok = false;
        continue;
      }
      // Column shards start at multiples of 4 and are as wide, but for a
      // table's last columns when its dim is not (CPU workers only:
      // ValidatePlanInputs asks CUDA's for multiples of 4).
      if (sh.col_offset() % 4 != 0 || (sh.cols() % 4 != 0 && sh.col_offset() + sh.cols() != dim)) {
        problem(what, ": column offsets and widths must be multiples of 4 (a width may end at "
                "the table's last column)");
        geometry_ok = false;
      }
      const bool full_width = sh.col_offset() == 0 && sh.cols() == dim;
      const bool full_height = sh.row_offset() == 0 && sh.rows() == rows;
      switch (*type) {
        case ShardingType::kTableWise:
          if (ts->shards_size() != 1 || !full_width || !full_height) {
            problem(label, ": table_wise is one shard of the whole table");
            geometry_ok = false;
          }
          break;
        case ShardingType::kRowWise:
        case ShardingType::kTableRowWise:
          if (!full_width) {
            problem(what, ": ", ts->sharding_type(), " shards take every column");
            geometry_ok = false;
          }
          if (!ranks_used.insert(sh.rank()).second) {
            problem(what, ": two row shards on rank ", sh.rank());
            geometry_ok = false;
          }
          break;
        case ShardingType::kColumnWise:
        case ShardingType::kTableColumnWise:
          if (!full_height) {
            problem(what, ": ", ts->sharding_type(), " shards take every row");
            geometry_ok = false;
          }
          break;
        case ShardingType::kDataParallel:
          break;
      }
      hosts.insert(sh.rank() / lw);
    }
    if ((*type == ShardingType::kTableRowWise || *type == ShardingType::kTableColumnWise) &&
        hosts.size() > 1) {
      problem(label, ": ", ts->sharding_type(), " keeps its shards on one host (",
              lw, " ranks each)");
      geometry_ok = false;
    }
    if (geometry_ok) {
      // Exact tiling: every cell of the grid the shards' edges cut is
      // covered once.
      std::set<int64_t> row_cuts = {0, rows}, col_cuts = {0, dim};
      for (const auto& sh : ts->shards()) {
        row_cuts.insert(sh.row_offset());
        row_cuts.insert(sh.row_offset() + sh.rows());
        col_cuts.insert(sh.col_offset());
        col_cuts.insert(sh.col_offset() + sh.cols());
      }
      const std::vector<int64_t> rc(row_cuts.begin(), row_cuts.end());
      const std::vector<int64_t> cc(col_cuts.begin(), col_cuts.end());
      bool tiled = true;
      for (size_t a = 0; a + 1 < rc.size() && tiled; ++a) {
        for (size_t b = 0; b + 1 < cc.size() && tiled; ++b) {
          int cover = 0;
          for (const auto& sh : ts->shards()) {
            cover += rc[a] >= sh.row_offset() && rc[a] < sh.row_offset() + sh.rows() &&
                     cc[b] >= sh.col_offset() && cc[b] < sh.col_offset() + sh.cols();
          }
          if (cover != 1) {
            problem(label, ": rows [", rc[a], ", ", rc[a + 1], ") x columns [", cc[b], ", ",
                    cc[b + 1], ") are covered by ", cover, " shards, not 1");
            tiled = false;
          }
        }
      }
    }
    for (const auto& sh : ts->shards()) {
      *out->add_shards() = sh;
      out->add_ranks(sh.rank());
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the plan does not fit the collection '", spec.name(), "' on ", w, " workers: ",
        absl::StrJoin(problems, "; "),
        problems.size() == kMaxProblems ? "; (more problems not listed)" : ""));
  }

  // A replicated collection's shards get the backups the plan does not name.
  if (replicas > 1) {
    if (absl::Status s = PlaceBackups(replicas, &plan); !s.ok()) return s;
  }
  std::vector<int64_t> hbm_cap, ddr_cap;
  Capacities(topo, model, &hbm_cap, &ddr_cap);
  auto tables = EnumerateOptions(spec, topo, model);
  FillStats(spec, model, hbm_cap, ddr_cap,
            tables.ok() ? LowerBounds(*tables, w, model) : Bounds(), &plan);
  std::vector<std::string> over;
  for (const auto& rs : plan.stats().per_rank()) {
    if (rs.hbm_bytes() > rs.hbm_cap_bytes() || rs.ddr_bytes() > rs.ddr_cap_bytes()) {
      over.push_back(absl::StrCat("rank ", rs.rank(), " needs ", GiB(rs.hbm_bytes()), " of HBM (",
                                  GiB(rs.hbm_cap_bytes()), " usable) and ", GiB(rs.ddr_bytes()),
                                  " of host memory (", GiB(rs.ddr_cap_bytes()), " usable)"));
    }
  }
  for (const auto& rs : plan.stats().per_rank()) {
    if (rs.ssd_cap_bytes() > 0 && rs.ssd_bytes() > rs.ssd_cap_bytes()) {
      over.push_back(absl::StrCat("rank ", rs.rank(), " needs ", GiB(rs.ssd_bytes()),
                                  " of SSD for key_value files (", GiB(rs.ssd_cap_bytes()),
                                  " usable)"));
    }
  }
  if (!over.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the plan does not fit the workers' memory: ", absl::StrJoin(over, "; ")));
  }
  return plan;
}

absl::Status ForceShardingType(const std::string& type, ember::v1::CollectionSpec* spec) {
  auto parsed = ParseShardingType(type);
  if (!parsed.ok()) return parsed.status();
  for (const auto& table : spec->tables()) {
    auto& c = (*spec->mutable_constraints())[table.name()];
    c.clear_sharding_types();
    c.add_sharding_types(type);
  }
  return absl::OkStatus();
}

}  // namespace planner
}  // namespace ember
