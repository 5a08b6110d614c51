// Where a replicated collection's backup copies go (planner.h, PlaceBackups).
#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "planner/plan_view.h"
#include "planner/planner.h"

namespace ember {
namespace planner {

absl::Status PlaceBackups(int replicas, ember::v1::ShardingPlan* plan,
                          const std::set<int>& unavailable) {
  const ember::v1::Topology& topo = plan->topology();
  const int w = topo.world_size();
  const int lw = topo.local_world_size() > 0 ? topo.local_world_size() : w;
  const int copies = std::max(1, replicas);
  // Cells (rows x columns) each rank holds, and the backups kept: those on
  // an available rank of the plan other than the shard's other copies, up
  // to copies - 1 of them.
  std::vector<int64_t> load(w, 0);
  std::vector<ember::v1::Shard*> shards;
  for (auto& ts : *plan->mutable_tables()) {
    for (auto& sh : *ts.mutable_shards()) {
      const int64_t cells = sh.rows() * sh.cols();
      std::set<int> used = {sh.rank()};
      std::vector<int> kept;
      for (int b : sh.backups()) {
        if (b < 0 || b >= w || unavailable.count(b) || !used.insert(b).second) continue;
        if (static_cast<int>(kept.size()) + 1 >= copies) continue;
        kept.push_back(b);
      }
      sh.clear_backups();
      for (int b : kept) {
        sh.add_backups(b);
        load[b] += cells;
      }
      if (sh.rank() >= 0 && sh.rank() < w) load[sh.rank()] += cells;
      if (sh.rows() > 0 && sh.rank() >= 0 && sh.rank() < w) shards.push_back(&sh);
    }
  }
  if (copies == 1) return absl::OkStatus();
  if (copies > w - static_cast<int>(unavailable.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "replicas ", copies, " needs at least ", copies, " workers (each copy of a shard on "
        "another); the plan has ", w - static_cast<int>(unavailable.size()),
        unavailable.empty() ? "" : " available"));
  }
  // Largest shards first, so that the small ones even the load out.
  std::stable_sort(shards.begin(), shards.end(), [](const auto* a, const auto* b) {
    return a->rows() * a->cols() > b->rows() * b->cols();
  });
  for (ember::v1::Shard* sh : shards) {
    std::set<int> hosts = {sh->rank() / lw}, used = {sh->rank()};
    for (int b : sh->backups()) {
      hosts.insert(b / lw);
      used.insert(b);
    }
    while (sh->backups_size() + 1 < copies) {
      // Another host than every copy so far if there is one, then the
      // fewest cells, then the lowest rank.
      int pick = -1;
      for (int r = 0; r < w; ++r) {
        if (used.count(r) || unavailable.count(r)) continue;
        if (pick < 0) {
          pick = r;
          continue;
        }
        const bool new_host = !hosts.count(r / lw), pick_new_host = !hosts.count(pick / lw);
        if (new_host != pick_new_host ? new_host : load[r] < load[pick]) pick = r;
      }
      sh->add_backups(pick);
      used.insert(pick);
      hosts.insert(pick / lw);
      load[pick] += sh->rows() * sh->cols();
    }
  }
  return absl::OkStatus();
}

}  // namespace planner
}  // namespace ember
