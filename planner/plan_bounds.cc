// Lower bounds on a plan's slowest worker, and the report when no plan
// fits, per plan_internal.h.
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
#include "planner/plan_search.h"

namespace ember {
namespace planner {
namespace internal {

double OptionAwareLowerBound(const std::vector<TableInfo>& tables, int w,
                             double simple_bound) {
  auto feasible = [&](double m) {
    double total = 0;
    for (const TableInfo& t : tables) {
      double best = kInf;
      for (const Option& o : t.options) {
        if (o.max_shard_cost <= m) best = std::min(best, o.total_cost);
      }
      total += best;
      if (!std::isfinite(total)) return false;
    }
    return total <= m * w;
  };
  double lo = simple_bound, hi = std::max(simple_bound, 1e-12);
  while (!feasible(hi)) {
    hi *= 2;
    if (hi > 1e300) return simple_bound;
  }
  if (feasible(lo)) return lo;
  for (int i = 0; i < 60 && hi - lo > 1e-9 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (feasible(mid) ? hi : lo) = mid;
  }
  return lo;
}

Bounds LowerBounds(const std::vector<TableInfo>& tables, int w, const CostModel& model) {
  double total = 0, largest = 0;
  for (const TableInfo& t : tables) {
    total += t.min_total_cost;
    largest = std::max(largest, t.min_max_shard_cost);
  }
  Bounds b;
  b.simple = std::max(total / w, largest);
  b.tight = OptionAwareLowerBound(tables, w, b.simple);
  b.cached_simple = b.simple;
  b.cached_tight = b.tight;
  if (model.cache_bytes <= 0) return b;
  // The most any worker's caches can save: its cache filled with the
  // densest savings any option of any table offers (a fractional knapsack
  // over every option's shards, a superset of any plan's); the most all
  // workers' can: W caches filled so, and no more than every table's
  // largest saving.
  const double cache = static_cast<double>(model.cache_bytes);
  std::vector<std::pair<double, double>> offers;  // (saving per byte, bytes)
  double savings = 0, largest_cached = 0;
  for (const TableInfo& t : tables) {
    double table_saving = 0, table_largest = kInf;
    for (const Option& o : t.options) {
      double saving = 0, shard_largest = 0;
      for (const Run& r : o.runs) {
        const ShardCost& c = r.cost;
        const double s = c.fwd_cache_saving_ms + c.bwd_cache_saving_ms;
        if (c.resident_bytes > 0 && s > 0) {
          offers.emplace_back(s / c.resident_bytes, static_cast<double>(r.count) * c.resident_bytes);
        }
        saving += r.count * s;
        const double f = c.resident_bytes > 0 ? std::min(1.0, cache / c.resident_bytes) : 0.0;
        shard_largest = std::max(shard_largest, c.total_ms() - f * s);
      }
      table_saving = std::max(table_saving, saving);
      table_largest = std::min(table_largest, shard_largest);
    }
    savings += table_saving;
    largest_cached = std::max(largest_cached, table_largest);
  }
  const double one = FillDensest(offers, cache);
  const double all = std::min(savings, FillDensest(std::move(offers), cache * w));
  b.cached_simple = std::max(std::max(0.0, total - all) / w, largest_cached);
  b.cached_tight = std::max(b.cached_simple, b.tight - one);
  return b;
}

absl::Status Infeasible(const CollectionSpec& spec,
                        const std::vector<TableInfo>& tables,
                        const std::vector<int64_t>& hbm_cap,
                        const std::vector<int64_t>& ddr_cap, Search* search,
                        int failed_table, const CostModel& model,
                        ComputeDevice device, bool uvm_served) {
  const int w = static_cast<int>(hbm_cap.size());
  const int64_t max_hbm = *std::max_element(hbm_cap.begin(), hbm_cap.end());
  const int64_t max_ddr = *std::max_element(ddr_cap.begin(), ddr_cap.end());
  const int64_t sum_hbm = std::accumulate(hbm_cap.begin(), hbm_cap.end(), int64_t{0});
  const int64_t sum_ddr = std::accumulate(ddr_cap.begin(), ddr_cap.end(), int64_t{0});
  const bool cpu = device == ember::v1::CPU;
  const std::string reserve =
      cpu ? absl::StrFormat("after reserving %.0f%% of host memory",
                            100 * model.ddr_reserved_fraction)
          : absl::StrFormat("after reserving %.0f%% of HBM and %.0f%% of host memory",
                            100 * model.hbm_reserved_fraction, 100 * model.ddr_reserved_fraction);
  // Memory as the workers have it: CPU workers have no HBM to speak of.
  auto memory = [cpu](int64_t hbm, int64_t ddr) {
    return cpu ? absl::StrCat(GiB(ddr), " host memory")
               : absl::StrCat(GiB(hbm), " HBM and ", GiB(ddr), " host memory");
  };
  std::vector<std::string> lines;

  // 1. Tables with no layout that fits on an empty cluster.
  for (size_t t = 0; t < tables.size(); ++t) {
    bool any = false;
    for (const Option& o : tables[t].options) {
      if (search->FitsAlone(o)) {
        any = true;
        break;
      }
    }
    if (any) continue;
    const Option* smallest = &tables[t].options[0];
    for (const Option& o : tables[t].options) {
      if (o.max_shard_hbm + o.max_shard_ddr <
          smallest->max_shard_hbm + smallest->max_shard_ddr) {
        smallest = &o;
      }
    }
    const TableConfig& tc = spec.tables(t);
    const double need = std::max(
        max_hbm > 0 ? static_cast<double>(smallest->max_shard_hbm) / max_hbm : 0.0,
        max_ddr > 0 ? static_cast<double>(smallest->max_shard_ddr) / max_ddr : kInf);
    std::vector<std::string> remedies;
    bool has_rw = false, has_uvm = false;
    for (const Option& o : tables[t].options) {
      has_rw |= o.type == ShardingType::kRowWise;
      has_uvm |= o.kernel == ComputeKernel::kFusedUvm;
    }
    if (!has_rw) remedies.push_back("allow row_wise in its constraints");
    if (!has_uvm && device == ember::v1::CUDA && uvm_served) {
      remedies.push_back("allow fused_uvm or fused_uvm_caching (host memory)");
    }
    if (smallest->type == ShardingType::kRowWise && std::isfinite(need)) {
      remedies.push_back(absl::StrCat("use at least ",
                                      static_cast<int64_t>(std::ceil(need * w)),
                                      " workers"));
    }
    if (smallest->max_shard_hbm > max_hbm) {
      remedies.push_back(absl::StrCat(
          "raise the HBM capacity so one worker has ",
          GiB(smallest->max_shard_hbm), " usable"));
    }
    if (smallest->max_shard_ddr > max_ddr) {
      remedies.push_back(absl::StrCat(
          "raise the host-memory capacity so one worker has ",
          GiB(smallest->max_shard_ddr), " usable"));
    }
    const std::vector<int64_t> ssd_cap = search->ssd_caps();
    const int64_t max_ssd =
        ssd_cap.empty() ? std::numeric_limits<int64_t>::max()
                        : *std::max_element(ssd_cap.begin(), ssd_cap.end());
    if (smallest->max_shard_ssd > max_ssd) {
      remedies.push_back(absl::StrCat("give a worker ", GiB(smallest->max_shard_ssd),
                                      " of SSD for its key_value files (--ssd_gib; it has ",
                                      GiB(max_ssd), ")"));
    }
    lines.push_back(absl::StrCat(
        "table '", tc.name(), "' (", tc.num_embeddings(), " x ",
        tc.embedding_dim(), ", ", ember::v1::DataType_Name(tc.data_type()),
        ", ", ember::v1::OptimizerSpec::Type_Name(tc.optimizer().type()),
        "): its smallest layout (", OptionName(*smallest), ") needs ",
        memory(smallest->max_shard_hbm, smallest->max_shard_ddr),
        " on one worker, but the largest worker has ", memory(max_hbm, max_ddr), " usable ",
        reserve, "; to fit: ", absl::StrJoin(remedies, ", or ")));
  }
  if (lines.empty()) {
    // 2. Totals: every table at its smallest footprint.
    int64_t need_hbm = 0, need_ddr = 0;
    for (const TableInfo& t : tables) {
      need_hbm += t.min_total_hbm;
      need_ddr += t.min_total_ddr;
    }
    if (need_hbm > sum_hbm) {
      lines.push_back(absl::StrCat(
          "all tables together need at least ", GiB(need_hbm),
          " of HBM (each at its smallest layout) but the ", w,
          " workers have ", GiB(sum_hbm), " usable ", reserve,
          "; to fit: use at least ",
          static_cast<int64_t>(std::ceil(static_cast<double>(need_hbm) / sum_hbm * w)),
          " workers, raise the HBM capacity",
          uvm_served ? ", or allow fused_uvm / fused_uvm_caching for the largest tables"
                     : " (these workers serve no fused_uvm kernel)"));
    }
    if (need_ddr > sum_ddr) {
      lines.push_back(absl::StrCat(
          "all tables together need at least ", GiB(need_ddr),
          " of host memory but the ", w, " workers have ", GiB(sum_ddr),
          " usable ", reserve, "; to fit: use at least ",
          sum_ddr > 0 ? static_cast<int64_t>(std::ceil(
                            static_cast<double>(need_ddr) / sum_ddr * w))
                      : 0,
          " workers or raise the host-memory capacity"));
    }
  }
  if (lines.empty() && failed_table >= 0) {
    // 3. Each table fits alone and the totals fit: packing failed.
    const Option& o = tables[failed_table].options[0];
    lines.push_back(absl::StrCat(
        "no placement keeps every worker within capacity: table '",
        spec.tables(failed_table).name(),
        "' found no worker with room (its cheapest layout ", OptionName(o),
        " needs ", memory(o.max_shard_hbm, o.max_shard_ddr), " per shard; workers have ",
        memory(max_hbm, max_ddr), " usable ", reserve,
        "); to fit: add workers, raise capacities, or allow row_wise",
        cpu || !uvm_served ? "" : " and fused_uvm", " layouts for the largest tables"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the collection does not fit on ", w, " worker(s):\n  ",
      absl::StrJoin(lines, "\n  ")));
}

}  // namespace internal
}  // namespace planner
}  // namespace ember
