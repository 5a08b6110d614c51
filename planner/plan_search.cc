// The search driver (Solve), per plan_internal.h; the search itself is
// plan_search.h.
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

namespace {

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

}  // namespace

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
  // By regret: what a table loses in its cheapest option that takes less
  // memory than its cheapest one (on a cache over SSD or host memory
  // instead of held whole), largest first, so that the tables that lose the
  // most by leaving memory get it first: with learned hit-rate curves, the
  // ones that cache worst. Tables with no such option go last. Run where
  // some table has one.
  std::vector<double> regret(n, -1);
  for (int t = 0; t < n; ++t) {
    const auto& opts = tables[t].options;  // sorted by cost: 0 is cheapest
    if (opts.empty()) continue;
    const int64_t least = opts[0].total_hbm + opts[0].total_ddr;
    for (const Option& o : opts) {
      if (o.total_hbm + o.total_ddr < least) {
        regret[t] = o.total_cost - opts[0].total_cost;
        break;
      }
    }
  }
  if (std::any_of(regret.begin(), regret.end(), [](double r) { return r >= 0; })) {
    std::vector<int> by_regret = by_cost;
    std::stable_sort(by_regret.begin(), by_regret.end(),
                     [&](int a, int b) { return regret[a] > regret[b]; });
    keep_better(search->BestGreedy(by_regret, bounds.tight, options.search_steps));
  }
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

}  // namespace internal
}  // namespace planner
}  // namespace ember
