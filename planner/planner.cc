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
#include "planner/plan_view.h"
#include "planner/shard_geometry.h"
#include "planner/sharding_types.h"
#include "planner/spec_validation.h"

namespace ember {
namespace planner {
namespace {

using ember::v1::CollectionSpec;
using ember::v1::ComputeDevice;
using ember::v1::ParameterConstraints;
using ember::v1::ShardingPlan;
using ember::v1::TableConfig;
using ember::v1::Topology;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kDefaultBatchSize = 512;

std::string GiB(double bytes) { return absl::StrFormat("%.2f GiB", bytes / kGiB); }

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

  explicit Loads(int w) : cost(w, 0.0), hbm(w, 0), ddr(w, 0) {}
  void Add(int r, const ShardCost& c, int sign) {
    cost[r] += sign * c.total_ms();
    hbm[r] += sign * c.hbm_bytes;
    ddr[r] += sign * c.ddr_bytes;
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

class Search {
 public:
  Search(const std::vector<TableInfo>& tables, int world_size,
         int local_world_size, std::vector<int64_t> hbm_cap,
         std::vector<int64_t> ddr_cap)
      : tables_(tables),
        w_(world_size),
        lw_(local_world_size),
        hbm_cap_(std::move(hbm_cap)),
        ddr_cap_(std::move(ddr_cap)),
        used_(world_size, 0) {}

  // Per table, the most HBM (summed over its shards) an option may use;
  // empty means no limit. Set by the HBM-budget strategy.
  void SetHbmLimits(std::vector<int64_t> limits) { hbm_limit_ = std::move(limits); }

  // Places every table in `order` with no worker above `target`.
  Solution Greedy(const std::vector<int>& order, double target) {
    Solution s;
    s.tables.resize(tables_.size());
    s.loads = Loads(w_);
    for (int t : order) {
      bool placed = false;
      const auto& options = tables_[t].options;
      for (int o = 0; o < static_cast<int>(options.size()); ++o) {
        if (!hbm_limit_.empty() && options[o].total_hbm > hbm_limit_[t]) continue;
        if (TryPlace(options[o], target, &s.loads, &s.tables[t].ranks)) {
          s.tables[t].option = o;
          placed = true;
          break;
        }
      }
      if (!placed) {
        s.failed_table = t;
        return s;
      }
    }
    s.ok = true;
    s.makespan = s.loads.Max();
    return s;
  }

  // Greedy plus a search on the target. The greedy pass is not monotone in
  // the target, so a coarse geometric probe up from the lower bound comes
  // first, then bisection between the last target that failed and the best
  // plan found.
  Solution BestGreedy(const std::vector<int>& order, double lower_bound,
                      int steps) {
    Solution best = Greedy(order, kInf);
    if (!best.ok) return best;
    double lo = lower_bound, hi = best.makespan;
    for (double f : {1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0}) {
      const double target = lower_bound * f;
      if (target >= hi) break;
      Solution s = Greedy(order, target);
      if (s.ok) {
        if (s.makespan < best.makespan) best = std::move(s);
        hi = std::min(target, best.makespan);
        break;
      }
      lo = target;
    }
    for (int i = 0; i < steps && hi - lo > 1e-4 * hi; ++i) {
      const double mid = 0.5 * (lo + hi);
      Solution s = Greedy(order, mid);
      if (s.ok) {
        if (s.makespan < best.makespan) best = std::move(s);
        hi = std::min(mid, best.makespan);
      } else {
        lo = mid;
      }
    }
    return best;
  }

  // Moves or swaps free shards off the slowest worker while that strictly
  // lowers the larger of the two workers' costs. A worker's cost here is
  // its shards' less what its caches save (CacheSavingMs; nothing when the
  // model has no caches), which depends on which shards share the worker:
  // the greedy passes, additive, do not see it, so this is where it acts.
  // Each step replaces the slowest worker's cost and another's by two lower
  // ones, so the workers' costs sorted in decreasing order fall
  // lexicographically and it terminates; `max_moves` bounds it anyway.
  // Sets the makespan to the slowest worker's cost with its caches. With
  // caches each cost is a pass over the worker's shards, so each search
  // stops after kCacheVisits shard visits (deterministic: counted, not
  // timed; a plan runs up to seven searches, with the seeds): 0.4-0.6 s
  // for 1,000 tables (docs/lab-notes/2026-11-benchmarks.md).
  static constexpr int64_t kCacheVisits = 20'000'000;
  void LocalSearch(Solution* s, const CostModel& model, int max_moves) {
    struct Item {
      int table, shard;
      const ShardCost* cost;  // its option's, fixed during the search
      double total_ms;        // cost->total_ms(), at hand for the swap scan
    };
    const bool cached = model.cache_bytes > 0;
    // The shards that may move (table_wise, column_wise), and, for the
    // caches only, those that may not.
    std::vector<std::vector<Item>> on_rank(w_);
    std::vector<std::vector<const ShardCost*>> fixed_on_rank(w_);
    for (int t = 0; t < static_cast<int>(tables_.size()); ++t) {
      const Option& opt = tables_[t].options[s->tables[t].option];
      const bool free =
          opt.placement == Placement::kFree || opt.placement == Placement::kHostFree;
      for (int i = 0; i < opt.num_shards; ++i) {
        const int r = s->tables[t].ranks[i];
        if (free) {
          const ShardCost* c = &opt.RunOf(i).cost;
          on_rank[r].push_back({t, i, c, c->total_ms()});
        } else if (cached) {
          fixed_on_rank[r].push_back(&opt.RunOf(i).cost);
        }
      }
    }
    Loads& L = s->loads;
    int64_t visits = 0;
    std::vector<const ShardCost*> scratch;
    // Worker r's cost with its shard `out` (an index into on_rank[r], or -1)
    // taken off and `in` (or none) put on.
    auto rank_cost = [&](int r, int out, const Item* in) {
      double c = L.cost[r];
      if (out >= 0) c -= on_rank[r][out].total_ms;
      if (in != nullptr) c += in->total_ms;
      if (!cached) return c;
      scratch.assign(fixed_on_rank[r].begin(), fixed_on_rank[r].end());
      for (int k = 0; k < static_cast<int>(on_rank[r].size()); ++k) {
        if (k != out) scratch.push_back(on_rank[r][k].cost);
      }
      if (in != nullptr) scratch.push_back(in->cost);
      visits += static_cast<int64_t>(scratch.size());
      return c - CacheSavingMs(model, scratch);
    };
    auto allowed = [&](int t, int i, int from, int to) {
      const Option& opt = tables_[t].options[s->tables[t].option];
      if (opt.placement == Placement::kHostFree && from / lw_ != to / lw_) {
        return false;
      }
      // Keep a table's shards on distinct workers.
      const auto& ranks = s->tables[t].ranks;
      if (opt.num_shards <= w_) {
        for (int j = 0; j < opt.num_shards; ++j) {
          if (j != i && ranks[j] == to) return false;
        }
      }
      return true;
    };
    auto fits = [&](int r, const ShardCost& in, const ShardCost* out) {
      return L.hbm[r] + in.hbm_bytes - (out ? out->hbm_bytes : 0) <= hbm_cap_[r] &&
             L.ddr[r] + in.ddr_bytes - (out ? out->ddr_bytes : 0) <= ddr_cap_[r];
    };
    std::vector<double> cost(w_);
    for (int r = 0; r < w_; ++r) cost[r] = rank_cost(r, -1, nullptr);
    std::vector<int> by_load(w_);
    for (int move = 0; move < max_moves && visits < kCacheVisits; ++move) {
      const int top = static_cast<int>(std::max_element(cost.begin(), cost.end()) - cost.begin());
      const double top_cost = cost[top];
      double best = top_cost - 1e-12 * std::max(1.0, top_cost);
      int best_k = -1, best_r = -1, best_u = -1;
      // Moves.
      for (int k = 0; k < static_cast<int>(on_rank[top].size()) && visits < kCacheVisits; ++k) {
        const Item it = on_rank[top][k];
        const ShardCost& c = *it.cost;
        const double without = rank_cost(top, k, nullptr);
        if (without >= best) continue;
        for (int r = 0; r < w_; ++r) {
          if (r == top || cost[r] >= best) continue;
          // The cheap tests first: without caches the pair's cost is a sum,
          // with them a pass over r's shards.
          double pair = 0;
          if (!cached) {
            pair = std::max(without, cost[r] + it.total_ms);
            if (pair >= best) continue;
          }
          if (!fits(r, c, nullptr) || !allowed(it.table, it.shard, top, r)) continue;
          if (cached) {
            pair = std::max(without, rank_cost(r, -1, &it));
            if (pair >= best) continue;
          }
          best = pair;
          best_k = k;
          best_r = r;
        }
      }
      // Swaps with the least-loaded workers when no move helps.
      if (best_k < 0) {
        std::iota(by_load.begin(), by_load.end(), 0);
        const int consider = std::min(w_, 16);
        std::partial_sort(by_load.begin(), by_load.begin() + consider, by_load.end(),
                          [&](int a, int b) { return cost[a] != cost[b] ? cost[a] < cost[b] : a < b; });
        for (int k = 0; k < static_cast<int>(on_rank[top].size()) && visits < kCacheVisits;
             ++k) {
          const Item it = on_rank[top][k];
          const ShardCost& a = *it.cost;
          for (int q = 0; q < consider && visits < kCacheVisits; ++q) {
            const int r = by_load[q];
            if (r == top) continue;
            for (int u = 0; u < static_cast<int>(on_rank[r].size()) && visits < kCacheVisits;
                 ++u) {
              const Item jt = on_rank[r][u];
              const ShardCost& b = *jt.cost;
              // Without caches a swap helps only a cheaper shard onto the
              // top worker, and the pair's cost is a sum; with them, which
              // shards share a cache counts too, at a pass over each.
              double pair = 0;
              if (!cached) {
                const double delta = it.total_ms - jt.total_ms;
                if (delta <= 0) continue;
                pair = std::max(top_cost - delta, cost[r] + delta);
                if (pair >= best) continue;
              }
              if (!fits(r, a, &b) || !fits(top, b, &a) || jt.table == it.table) continue;
              if (!allowed(it.table, it.shard, top, r) || !allowed(jt.table, jt.shard, r, top)) {
                continue;
              }
              if (cached) {
                const double at_top = rank_cost(top, k, &jt);
                if (at_top >= best) continue;
                pair = std::max(at_top, rank_cost(r, u, &it));
                if (pair >= best) continue;
              }
              best = pair;
              best_k = k;
              best_r = r;
              best_u = u;
            }
          }
        }
      }
      if (best_k < 0) break;
      const Item it = on_rank[top][best_k];
      L.Add(top, *it.cost, -1);
      L.Add(best_r, *it.cost, +1);
      s->tables[it.table].ranks[it.shard] = best_r;
      if (best_u >= 0) {
        const Item jt = on_rank[best_r][best_u];
        L.Add(best_r, *jt.cost, -1);
        L.Add(top, *jt.cost, +1);
        s->tables[jt.table].ranks[jt.shard] = top;
        on_rank[best_r].erase(on_rank[best_r].begin() + best_u);
        on_rank[top].push_back(jt);
      }
      on_rank[top].erase(on_rank[top].begin() + best_k);
      on_rank[best_r].push_back(it);
      cost[top] = rank_cost(top, -1, nullptr);
      cost[best_r] = rank_cost(best_r, -1, nullptr);
    }
    s->makespan = *std::max_element(cost.begin(), cost.end());
  }

  // True if `opt` can be placed on an empty cluster (ignoring cost).
  bool FitsAlone(const Option& opt) {
    Loads empty(w_);
    std::vector<int> ranks;
    return TryPlace(opt, kInf, &empty, &ranks);
  }

 private:
  bool Fits(int r, const ShardCost& c, const Loads& L, double target) const {
    return L.hbm[r] + c.hbm_bytes <= hbm_cap_[r] &&
           L.ddr[r] + c.ddr_bytes <= ddr_cap_[r] &&
           L.cost[r] + c.total_ms() <= target;
  }

  // Places shards [0, n) of `opt` on ranks base + i. Applies on success.
  bool PlaceFixed(const Option& opt, int base, double target, Loads* L,
                  std::vector<int>* ranks) {
    int i = 0;
    for (const Run& run : opt.runs) {
      for (int k = 0; k < run.count; ++k, ++i) {
        if (!Fits(base + i, run.cost, *L, target)) return false;
      }
    }
    i = 0;
    for (const Run& run : opt.runs) {
      for (int k = 0; k < run.count; ++k, ++i) {
        L->Add(base + i, run.cost, +1);
        (*ranks)[i] = base + i;
      }
    }
    return true;
  }

  // Places each shard on the least-loaded fitting worker in [lo, hi), shards
  // of one table on distinct workers when there are enough. Applies on
  // success; leaves `L` unchanged on failure.
  bool PlaceFree(const Option& opt, int lo, int hi, double target, Loads* L,
                 std::vector<int>* ranks) {
    const bool distinct = opt.num_shards <= hi - lo;
    int i = 0;
    bool ok = true;
    for (const Run& run : opt.runs) {
      for (int k = 0; k < run.count && ok; ++k, ++i) {
        int best = -1;
        for (int r = lo; r < hi; ++r) {
          if (distinct && used_[r]) continue;
          if (!Fits(r, run.cost, *L, target)) continue;
          if (best < 0 || L->cost[r] < L->cost[best]) best = r;
        }
        if (best < 0) {
          ok = false;
          break;
        }
        (*ranks)[i] = best;
        used_[best] = 1;
        L->Add(best, run.cost, +1);
      }
      if (!ok) break;
    }
    for (int j = 0; j < i; ++j) used_[(*ranks)[j]] = 0;
    if (!ok) {
      for (int j = 0; j < i; ++j) L->Add((*ranks)[j], opt.RunOf(j).cost, -1);
    }
    return ok;
  }

  double MaxOver(const Loads& L, int lo, int hi) const {
    return *std::max_element(L.cost.begin() + lo, L.cost.begin() + hi);
  }

  bool TryPlace(const Option& opt, double target, Loads* L,
                std::vector<int>* ranks) {
    ranks->assign(opt.num_shards, -1);
    switch (opt.placement) {
      case Placement::kFixed:
        return PlaceFixed(opt, 0, target, L, ranks);
      case Placement::kFree:
        return PlaceFree(opt, 0, w_, target, L, ranks);
      case Placement::kHostFixed:
      case Placement::kHostFree: {
        // Try each host, keep the one whose busiest worker ends lowest.
        int best_host = -1;
        double best_max = kInf;
        std::vector<int> trial(opt.num_shards);
        for (int h = 0; h < w_ / lw_; ++h) {
          const int lo = h * lw_, hi = lo + lw_;
          const bool ok = opt.placement == Placement::kHostFixed
                              ? PlaceFixed(opt, lo, target, L, &trial)
                              : PlaceFree(opt, lo, hi, target, L, &trial);
          if (!ok) continue;
          const double m = MaxOver(*L, lo, hi);
          for (int i = 0; i < opt.num_shards; ++i) {
            L->Add(trial[i], opt.RunOf(i).cost, -1);
          }
          if (m < best_max) {
            best_max = m;
            best_host = h;
          }
        }
        if (best_host < 0) return false;
        const int lo = best_host * lw_;
        return opt.placement == Placement::kHostFixed
                   ? PlaceFixed(opt, lo, kInf, L, ranks)
                   : PlaceFree(opt, lo, lo + lw_, kInf, L, ranks);
      }
    }
    return false;
  }

  const std::vector<TableInfo>& tables_;
  const int w_;
  const int lw_;
  const std::vector<int64_t> hbm_cap_;
  const std::vector<int64_t> ddr_cap_;
  std::vector<char> used_;  // scratch for PlaceFree
  std::vector<int64_t> hbm_limit_;
};

// HBM budget: when the cheapest layouts of all tables need more HBM than
// `fraction` of the cluster's, move tables to layouts that use less HBM
// (fused_uvm_caching, fused_uvm, row splits...) where that costs the least
// extra time per byte saved, until the cheapest layouts fit. Returns each
// table's HBM limit, or an empty vector when no limit is needed.
std::vector<int64_t> HbmBudget(const std::vector<TableInfo>& tables,
                               int64_t cluster_hbm, double fraction) {
  const int n = static_cast<int>(tables.size());
  std::vector<int> choice(n, 0);  // options are sorted by cost: 0 is cheapest
  double used = 0;
  for (const TableInfo& t : tables) used += t.options[0].total_hbm;
  const double budget = fraction * cluster_hbm;
  if (used <= budget) return {};
  // Repeatedly take the demotion with the least extra cost per byte saved.
  // n is at most tens of thousands and few tables move, so a linear scan per
  // step is fine; each table's next step is the cheapest option using less
  // HBM than its current one.
  auto next_step = [&](int t, int* to, double* rate) {
    const auto& opts = tables[t].options;
    const Option& cur = opts[choice[t]];
    *to = -1;
    for (int o = 0; o < static_cast<int>(opts.size()); ++o) {
      if (opts[o].total_hbm >= cur.total_hbm) continue;
      const double r = (opts[o].total_cost - cur.total_cost) /
                       static_cast<double>(cur.total_hbm - opts[o].total_hbm);
      if (*to < 0 || r < *rate) {
        *to = o;
        *rate = r;
      }
    }
  };
  std::vector<int> to(n);
  std::vector<double> rate(n);
  for (int t = 0; t < n; ++t) next_step(t, &to[t], &rate[t]);
  while (used > budget) {
    int best = -1;
    for (int t = 0; t < n; ++t) {
      if (to[t] >= 0 && (best < 0 || rate[t] < rate[best])) best = t;
    }
    if (best < 0) break;
    used -= tables[best].options[choice[best]].total_hbm -
            tables[best].options[to[best]].total_hbm;
    choice[best] = to[best];
    next_step(best, &to[best], &rate[best]);
  }
  std::vector<int64_t> limits(n);
  for (int t = 0; t < n; ++t) limits[t] = tables[t].options[choice[t]].total_hbm;
  return limits;
}

// A tighter lower bound than max(total / W, largest shard): in any plan with
// makespan M each table uses a layout whose largest shard costs at most M,
// so M * W >= sum over tables of the least total cost among such layouts.
// The smallest M meeting that is found by bisection.
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

// A table's constraints, or empty ones when the spec gives none.
const ParameterConstraints& ConstraintsFor(const CollectionSpec& spec,
                                           const std::string& table) {
  static const ParameterConstraints* const kNone = new ParameterConstraints();
  auto it = spec.constraints().find(table);
  return it == spec.constraints().end() ? *kNone : it->second;
}

// Blocks of a table under a sharding type.
std::vector<ShardBlock> BlocksFor(ShardingType type, const TableConfig& t,
                                  const ParameterConstraints& c, int w,
                                  int lw) {
  const int64_t rows = t.num_embeddings(), cols = t.embedding_dim();
  switch (type) {
    case ShardingType::kTableWise:
      return {ShardBlock{0, 0, rows, cols}};
    case ShardingType::kRowWise:
      return RowWiseBlocks(rows, cols, w);
    case ShardingType::kTableRowWise:
      return RowWiseBlocks(rows, cols, lw);
    case ShardingType::kColumnWise:
      return ColumnWiseBlocks(rows, cols, c.min_partition(), w);
    case ShardingType::kTableColumnWise:
      return ColumnWiseBlocks(rows, cols, c.min_partition(), lw);
    case ShardingType::kDataParallel:
      return std::vector<ShardBlock>(w, ShardBlock{0, 0, rows, cols});
  }
  return {};
}

Placement PlacementFor(ShardingType type) {
  switch (type) {
    case ShardingType::kTableWise:
    case ShardingType::kColumnWise:
      return Placement::kFree;
    case ShardingType::kRowWise:
    case ShardingType::kDataParallel:
      return Placement::kFixed;
    case ShardingType::kTableRowWise:
      return Placement::kHostFixed;
    case ShardingType::kTableColumnWise:
      return Placement::kHostFree;
  }
  return Placement::kFree;
}

// Kernels a sharding type may use on a device, within the constraints.
// On CPU workers every kernel is host memory: a constraint naming a UVM
// kernel is honoured as `fused`.
std::vector<ComputeKernel> KernelsFor(ShardingType type, ComputeDevice device,
                                      const ParameterConstraints& c) {
  std::vector<ComputeKernel> wanted;
  if (type == ShardingType::kDataParallel) {
    wanted = {ComputeKernel::kDense};
  } else if (device == ember::v1::CPU) {
    wanted = {ComputeKernel::kFused};
  } else {
    wanted = {ComputeKernel::kFused, ComputeKernel::kFusedUvmCaching,
              ComputeKernel::kFusedUvm};
  }
  if (c.compute_kernels_size() == 0) return wanted;
  std::vector<ComputeKernel> allowed;
  for (const std::string& name : c.compute_kernels()) {
    ComputeKernel k = *ParseComputeKernel(name);  // validated earlier
    if (device == ember::v1::CPU && k != ComputeKernel::kDense) {
      k = ComputeKernel::kFused;
    }
    allowed.push_back(k);
  }
  std::vector<ComputeKernel> out;
  for (ComputeKernel k : wanted) {
    if (std::find(allowed.begin(), allowed.end(), k) != allowed.end()) {
      out.push_back(k);
    }
  }
  return out;
}

TableWorkload WorkloadFor(const TableConfig& t, const ParameterConstraints& c,
                          const Topology& topo, const CostModel& model) {
  TableWorkload w;
  for (int f = 0; f < t.feature_names_size(); ++f) {
    const double batch =
        static_cast<double>(c.batch_sizes_size() ? c.batch_sizes(f)
                                                 : topo.batch_size()) *
        topo.num_trainers();
    const double pf = c.pooling_factors_size() ? c.pooling_factors(f) : 1.0;
    const double np = c.num_poolings_size() ? c.num_poolings(f) : 1.0;
    w.ids += batch * pf * np;
    w.bags += batch * np;
  }
  w.pooling_factor = w.bags > 0 ? w.ids / w.bags : 0.0;
  w.weighted = c.is_weighted();
  w.sequence = t.pooling() == TableConfig::NONE;
  w.dtype_bytes = DataTypeBytes(t.data_type());
  w.optimizer = t.optimizer().type();
  w.cache_load_factor = c.cache_load_factor() > 0
                            ? c.cache_load_factor()
                            : model.default_cache_load_factor;
  return w;
}

Option MakeOption(ShardingType type, ComputeKernel kernel,
                  const std::vector<ShardBlock>& blocks,
                  const TableWorkload& work, const TableConfig& t,
                  const CostModel& model, ComputeDevice device, int w) {
  Option o;
  o.type = type;
  o.kernel = kernel;
  o.placement = PlacementFor(type);
  o.blocks = blocks;
  o.num_shards = static_cast<int>(blocks.size());
  for (const ShardBlock& b : blocks) {
    if (!o.runs.empty() && o.runs.back().rows == b.rows &&
        o.runs.back().cols == b.cols) {
      ++o.runs.back().count;
      continue;
    }
    Run run;
    run.count = 1;
    run.rows = b.rows;
    run.cols = b.cols;
    run.cost = EstimateShard(model, work, type, kernel, device, b,
                             t.num_embeddings(), w);
    o.runs.push_back(run);
  }
  for (const Run& r : o.runs) {
    o.total_cost += r.count * r.cost.total_ms();
    o.max_shard_cost = std::max(o.max_shard_cost, r.cost.total_ms());
    o.total_hbm += r.count * r.cost.hbm_bytes;
    o.total_ddr += r.count * r.cost.ddr_bytes;
    o.max_shard_hbm = std::max(o.max_shard_hbm, r.cost.hbm_bytes);
    o.max_shard_ddr = std::max(o.max_shard_ddr, r.cost.ddr_bytes);
  }
  return o;
}

std::string OptionName(const Option& o) {
  return absl::StrCat(ShardingTypeName(o.type), "/", ComputeKernelName(o.kernel));
}

// Explains why no plan fits, naming tables, bytes and remedies.
absl::Status Infeasible(const CollectionSpec& spec,
                        const std::vector<TableInfo>& tables,
                        const std::vector<int64_t>& hbm_cap,
                        const std::vector<int64_t>& ddr_cap, Search* search,
                        int failed_table, const CostModel& model,
                        ComputeDevice device) {
  const int w = static_cast<int>(hbm_cap.size());
  const int64_t max_hbm = *std::max_element(hbm_cap.begin(), hbm_cap.end());
  const int64_t max_ddr = *std::max_element(ddr_cap.begin(), ddr_cap.end());
  const int64_t sum_hbm = std::accumulate(hbm_cap.begin(), hbm_cap.end(), int64_t{0});
  const int64_t sum_ddr = std::accumulate(ddr_cap.begin(), ddr_cap.end(), int64_t{0});
  const std::string reserve = absl::StrFormat(
      "after reserving %.0f%% of HBM and %.0f%% of host memory",
      100 * model.hbm_reserved_fraction, 100 * model.ddr_reserved_fraction);
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
    if (!has_uvm && device == ember::v1::CUDA) {
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
    lines.push_back(absl::StrCat(
        "table '", tc.name(), "' (", tc.num_embeddings(), " x ",
        tc.embedding_dim(), ", ", ember::v1::DataType_Name(tc.data_type()),
        ", ", ember::v1::OptimizerSpec::Type_Name(tc.optimizer().type()),
        "): its smallest layout (", OptionName(*smallest), ") needs ",
        GiB(smallest->max_shard_hbm), " HBM and ",
        GiB(smallest->max_shard_ddr), " host memory on one worker, but the largest worker has ",
        GiB(max_hbm), " HBM and ", GiB(max_ddr), " host memory usable ",
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
          " workers, raise the HBM capacity, or allow fused_uvm / "
          "fused_uvm_caching for the largest tables"));
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
        " needs ", GiB(o.max_shard_hbm), " HBM and ", GiB(o.max_shard_ddr),
        " host memory per shard; workers have ", GiB(max_hbm), " HBM and ",
        GiB(max_ddr), " host memory usable ", reserve,
        "); to fit: add workers, raise capacities, or allow row_wise and "
        "fused_uvm layouts for the largest tables"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the collection does not fit on ", w, " worker(s):\n  ",
      absl::StrJoin(lines, "\n  ")));
}

}  // namespace

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

// Fills a table's summary of its options (least cost, memory...).
void Summarize(TableInfo* info) {
  info->min_total_cost = kInf;
  info->min_max_shard_cost = kInf;
  info->min_total_hbm = std::numeric_limits<int64_t>::max();
  info->min_total_ddr = std::numeric_limits<int64_t>::max();
  for (const Option& o : info->options) {
    info->min_total_cost = std::min(info->min_total_cost, o.total_cost);
    info->min_max_shard_cost = std::min(info->min_max_shard_cost, o.max_shard_cost);
    info->min_total_hbm = std::min(info->min_total_hbm, o.total_hbm);
    info->min_total_ddr = std::min(info->min_total_ddr, o.total_ddr);
  }
}

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

// The search on `tables` (Search's): greedy passes in two table orders (by
// work, by memory footprint) with a search on the target, again under HBM
// budgets when HBM binds, then local search on the best. !ok, with
// failed_table, when nothing fits.
Solution Solve(Search* search, const std::vector<TableInfo>& tables,
               const std::vector<int64_t>& hbm_cap, const Bounds& bounds,
               const CostModel& model, const PlannerOptions& options) {
  const int n = static_cast<int>(tables.size());
  std::vector<int> by_cost(n), by_memory(n);
  std::iota(by_cost.begin(), by_cost.end(), 0);
  std::iota(by_memory.begin(), by_memory.end(), 0);
  std::stable_sort(by_cost.begin(), by_cost.end(), [&](int a, int b) {
    const TableInfo &x = tables[a], &y = tables[b];
    if (x.min_total_cost != y.min_total_cost) return x.min_total_cost > y.min_total_cost;
    return x.min_total_hbm + x.min_total_ddr > y.min_total_hbm + y.min_total_ddr;
  });
  std::stable_sort(by_memory.begin(), by_memory.end(), [&](int a, int b) {
    const TableInfo &x = tables[a], &y = tables[b];
    const int64_t mx = x.min_total_hbm + x.min_total_ddr;
    const int64_t my = y.min_total_hbm + y.min_total_ddr;
    if (mx != my) return mx > my;
    return x.min_total_cost > y.min_total_cost;
  });
  Solution best = search->BestGreedy(by_cost, bounds.tight, options.search_steps);
  auto keep_better = [&best](Solution s) {
    if (!best.ok || (s.ok && s.makespan < best.makespan)) best = std::move(s);
  };
  keep_better(search->BestGreedy(by_memory, bounds.tight, options.search_steps));
  // When HBM is the binding constraint, plan again with layouts chosen to
  // fit an HBM budget, tightening the budget until a plan is found.
  const int64_t cluster_hbm = std::accumulate(hbm_cap.begin(), hbm_cap.end(), int64_t{0});
  for (double fraction : {0.95, 0.85, 0.7, 0.5}) {
    std::vector<int64_t> limits = HbmBudget(tables, cluster_hbm, fraction);
    if (limits.empty()) break;
    search->SetHbmLimits(std::move(limits));
    keep_better(search->BestGreedy(by_memory, bounds.tight, options.search_steps));
    keep_better(search->BestGreedy(by_cost, bounds.tight, options.search_steps));
    if (best.ok) break;
  }
  search->SetHbmLimits({});
  if (best.ok) search->LocalSearch(&best, model, options.max_local_search_moves);
  return best;
}

// Usable capacity per worker: the topology's (per-rank overrides
// included) less the model's reserved fractions.
void Capacities(const Topology& topo, const CostModel& model, std::vector<int64_t>* hbm_cap,
                std::vector<int64_t>* ddr_cap) {
  const int w = topo.world_size();
  const ComputeDevice device = topo.compute_device();
  hbm_cap->assign(w, 0);
  ddr_cap->assign(w, 0);
  for (int r = 0; r < w; ++r) {
    (*hbm_cap)[r] = device == ember::v1::CUDA ? topo.hbm_cap_bytes() : 0;
    (*ddr_cap)[r] = topo.ddr_cap_bytes();
  }
  for (const auto& d : topo.devices()) {
    (*hbm_cap)[d.rank()] = device == ember::v1::CUDA ? d.hbm_bytes() : 0;
    (*ddr_cap)[d.rank()] = d.ddr_bytes();
  }
  for (int r = 0; r < w; ++r) {
    (*hbm_cap)[r] = static_cast<int64_t>((*hbm_cap)[r] * (1.0 - model.hbm_reserved_fraction));
    (*ddr_cap)[r] = static_cast<int64_t>((*ddr_cap)[r] * (1.0 - model.ddr_reserved_fraction));
  }
}

// Every table's options (allowed sharding type x compute kernel), cheapest
// first. INVALID_ARGUMENT when a table's constraints allow none.
absl::StatusOr<std::vector<TableInfo>> EnumerateOptions(const CollectionSpec& spec,
                                                        const Topology& topo,
                                                        const CostModel& model) {
  const ComputeDevice device = topo.compute_device();
  const int w = topo.world_size();
  const int lw = topo.local_world_size();
  std::vector<TableInfo> tables(spec.tables_size());
  for (int t = 0; t < spec.tables_size(); ++t) {
    const TableConfig& tc = spec.tables(t);
    const ParameterConstraints& c = ConstraintsFor(spec, tc.name());
    std::vector<ShardingType> types;
    for (const std::string& name : c.sharding_types()) {
      const ShardingType type = *ParseShardingType(name);  // validated
      if (std::find(types.begin(), types.end(), type) == types.end()) {
        types.push_back(type);
      }
    }
    const bool free_choice = types.empty();
    if (free_choice) types = AllShardingTypes();
    const TableWorkload work = WorkloadFor(tc, c, topo, model);
    for (ShardingType type : types) {
      const std::vector<ComputeKernel> kernels = KernelsFor(type, device, c);
      if (kernels.empty()) continue;
      // Column splits: chosen freely, every width FreeColumnWidths offers
      // (wide blocks as TorchRec makes them, down to the even split); forced
      // or with a min_partition, the one split ColumnShardWidth gives.
      std::vector<std::vector<ShardBlock>> splits;
      const bool column = type == ShardingType::kColumnWise ||
                          type == ShardingType::kTableColumnWise;
      if (column && free_choice && c.min_partition() == 0) {
        const int workers = type == ShardingType::kColumnWise ? w : lw;
        for (int64_t width : FreeColumnWidths(tc.embedding_dim(), workers)) {
          splits.push_back(ColumnBlocksOfWidth(tc.num_embeddings(), tc.embedding_dim(), width));
        }
      }
      if (splits.empty()) splits.push_back(BlocksFor(type, tc, c, w, lw));
      for (const std::vector<ShardBlock>& blocks : splits) {
        for (ComputeKernel k : kernels) {
          tables[t].options.push_back(
              MakeOption(type, k, blocks, work, tc, model, device, w));
        }
      }
    }
    if (tables[t].options.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", tc.name(),
          "': its constraints allow no (sharding type, compute kernel) pair "
          "on ", ember::v1::ComputeDevice_Name(device),
          " workers: sharding_types [", absl::StrJoin(c.sharding_types(), ", "),
          "], compute_kernels [", absl::StrJoin(c.compute_kernels(), ", "),
          "]; data_parallel uses dense, the other types fused",
          device == ember::v1::CUDA ? ", fused_uvm_caching or fused_uvm" : "",
          ""));
    }
    auto& opts = tables[t].options;
    std::stable_sort(opts.begin(), opts.end(), [](const Option& a, const Option& b) {
      if (a.total_cost != b.total_cost) return a.total_cost < b.total_cost;
      return a.total_hbm + a.total_ddr < b.total_hbm + b.total_ddr;
    });
    Summarize(&tables[t]);
  }
  return tables;
}

// The per-rank statistics of `plan` (whose tables list their sharding
// type, kernel and shards; data_parallel: a replica on every rank), each
// shard estimated by the cost model, against the usable capacities.
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
  for (const auto& ts : plan->tables()) {
    const TableConfig& tc = spec.tables(index.at(ts.table()));
    const TableWorkload work = WorkloadFor(tc, ConstraintsFor(spec, tc.name()), topo, model);
    const ShardingType type = *ParseShardingType(ts.sharding_type());
    const ComputeKernel kernel = *ParseComputeKernel(ts.compute_kernel());
    auto add = [&](int rank, const ShardBlock& b) {
      const ShardCost sc = EstimateShard(model, work, type, kernel, topo.compute_device(), b,
                                         tc.num_embeddings(), w);
      auto& rs = per_rank[rank];
      rs.set_hbm_bytes(rs.hbm_bytes() + sc.hbm_bytes);
      rs.set_ddr_bytes(rs.ddr_bytes() + sc.ddr_bytes);
      rs.set_fwd_compute_ms(rs.fwd_compute_ms() + sc.fwd_compute_ms);
      rs.set_fwd_comms_ms(rs.fwd_comms_ms() + sc.fwd_comms_ms);
      rs.set_bwd_compute_ms(rs.bwd_compute_ms() + sc.bwd_compute_ms);
      rs.set_bwd_comms_ms(rs.bwd_comms_ms() + sc.bwd_comms_ms);
      rs.set_num_shards(rs.num_shards() + 1);
      if (b.rows > 0 && b.cols > 0) busy[rank] = true;
      held[rank].push_back(sc);
    };
    for (const PlacedBlock& b : TableBlocks(ts, tc.num_embeddings(), tc.embedding_dim())) {
      add(b.rank, ShardBlock{b.row_offset, b.col_offset, b.rows, b.cols});
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

absl::StatusOr<ShardingPlan> Plan(const CollectionSpec& spec,
                                  const Topology& topology_in,
                                  const PlannerOptions& options) {
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
  Solution best = Solve(&search, tables, hbm_cap, bounds, model, options);
  if (!best.ok) {
    return Infeasible(spec, tables, hbm_cap, ddr_cap, &search, best.failed_table,
                      model, device);
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
  return plan;
}

absl::StatusOr<ShardingPlan> CheckPlan(const CollectionSpec& spec, const Topology& topology_in,
                                       const ShardingPlan& given, const PlannerOptions& options) {
  auto setup = Setup::Of(spec, topology_in, options);
  if (!setup.ok()) return setup.status();
  const ComputeDevice device = setup->device;
  const CostModel& model = setup->model;
  const Topology& topo = setup->topo;
  const int w = topo.world_size();
  const int lw = topo.local_world_size();

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
    const std::vector<ComputeKernel> kernels = KernelsFor(*type, device, c);
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
      if (sh.row_offset() < 0 || sh.col_offset() < 0 || sh.rows() <= 0 || sh.cols() <= 0 ||
          sh.row_offset() > rows - sh.rows() || sh.col_offset() > dim - sh.cols()) {
        problem(what, ": outside the table's [", rows, ", ", dim, "] or empty");
        geometry_ok = false;
        continue;
      }
      if (sh.cols() % 4 != 0 || sh.col_offset() % 4 != 0) {
        problem(what, ": column offsets and widths must be multiples of 4");
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
