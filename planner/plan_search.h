// The planner's search (plan_internal.h): greedy passes placing every
// table's shards on the workers, then local search, under each worker's
// memory. Private to //planner:planner.
//
// Thread-compatible: one search per thread.
#ifndef EMBER_PLANNER_PLAN_SEARCH_H_
#define EMBER_PLANNER_PLAN_SEARCH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "planner/cost_model.h"
#include "planner/plan_internal.h"

namespace ember {
namespace planner {
namespace internal {

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
  // Each rank's SSD for key_value files (SsdCapacities); empty: no limit.
  void SetSsdCaps(std::vector<int64_t> caps) { ssd_cap_ = std::move(caps); }
  const std::vector<int64_t>& ssd_caps() const { return ssd_cap_; }

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
             L.ddr[r] + in.ddr_bytes - (out ? out->ddr_bytes : 0) <= ddr_cap_[r] &&
             (ssd_cap_.empty() ||
              L.ssd[r] + in.ssd_bytes - (out ? out->ssd_bytes : 0) <= ssd_cap_[r]);
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
           (ssd_cap_.empty() || L.ssd[r] + c.ssd_bytes <= ssd_cap_[r]) &&
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
  std::vector<int64_t> ssd_cap_;
  std::vector<char> used_;  // scratch for PlaceFree
  std::vector<int64_t> hbm_limit_;
};

}  // namespace internal
}  // namespace planner
}  // namespace ember

#endif  // EMBER_PLANNER_PLAN_SEARCH_H_
