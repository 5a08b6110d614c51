#include "server/coordinator/replacement_policy.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "planner/plan_view.h"
#include "server/coordinator/assignments.h"

namespace ember {
namespace coordinator {

std::string DescribeRanks(const ember::v1::CollectionInfo& info, const std::set<int>& ranks) {
  std::string out;
  for (int r : ranks) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", "rank ", r, " (", info.worker_addresses(r),
                    ")");
  }
  return out;
}

absl::StatusOr<Replacement> PlaceLostShards(const ember::v1::CollectionInfo& old,
                                            const std::vector<std::string>& old_ids,
                                            const std::set<int>& lost,
                                            const std::vector<ReplacementCandidate>& candidates) {
  const int world = old.worker_addresses_size();
  if (static_cast<int>(old_ids.size()) != world) {
    return absl::InvalidArgumentError(
        absl::StrCat(old_ids.size(), " worker ids for ", world, " ranks"));
  }
  for (int r : lost) {
    if (r < 0 || r >= world) {
      return absl::InvalidArgumentError(
          absl::StrCat("lost rank ", r, " is not in [0, ", world, ")"));
    }
  }
  if (old.plan().tables_size() > old.spec().tables_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the plan has ", old.plan().tables_size(),
                                                   " tables, the spec ",
                                                   old.spec().tables_size()));
  }
  std::map<std::string, const ReplacementCandidate*> live;
  for (const ReplacementCandidate& c : candidates) live[c.id] = &c;

  Replacement out;
  out.info = old;
  out.ids = old_ids;
  ember::v1::CollectionInfo& info = out.info;
  std::vector<std::string>& ids = out.ids;
  std::map<int, int64_t>& load = out.load;
  auto& reload = out.reload;

  // Live workers that hold nothing of this collection replace lost ranks;
  // without one, a lost rank's shards go to the live ranks with the least.
  std::vector<std::string> spare;
  const std::set<std::string> in_use(ids.begin(), ids.end());
  for (const auto& [id, c] : live) {
    if (!in_use.count(id)) spare.push_back(id);
  }
  std::sort(spare.begin(), spare.end(), [&](const std::string& a, const std::string& b) {
    return live[a]->seq < live[b]->seq;
  });
  for (int r = 0; r < world; ++r) {
    if (lost.count(r) || !live.count(ids[r])) continue;
    for (const auto& a : AssignmentsOf(info, r)) load[r] += AssignmentBytes(a);
  }
  // The rank holding the fewest bytes, the lowest on ties.
  auto least = [&load] {
    return std::min_element(load.begin(), load.end(), [](const auto& a, const auto& b) {
             return a.second < b.second;
           })->first;
  };
  ember::v1::ShardingPlan& plan = *info.mutable_plan();
  for (int r : lost) {
    if (!spare.empty()) {
      ids[r] = spare.front();
      info.set_worker_addresses(r, live[spare.front()]->address);
      spare.erase(spare.begin());
      load[r] = 0;
      out.replaced.insert(r);
      continue;
    }
    for (int t = 0; t < plan.tables_size(); ++t) {
      auto* ts = plan.mutable_tables(t);
      for (int i = 0; i < ts->shards_size(); ++i) {
        auto* sh = ts->mutable_shards(i);
        if (sh->rank() != r || sh->rows() == 0 || load.empty()) continue;
        const int to = least();
        sh->set_rank(to);
        load[to] += AssignmentBytes(MakeAssignment(info.spec().tables(t), i, sh->row_offset(),
                                                   sh->col_offset(), sh->rows(), sh->cols()));
        reload[to].insert({ts->table(), i});
      }
    }
  }
  // Data-parallel tables drop lost replicas; one with none left gets one.
  for (int t = 0; t < plan.tables_size(); ++t) {
    auto* ts = plan.mutable_tables(t);
    if (!planner::IsReplicated(*ts)) continue;
    std::vector<int> kept;
    for (int r : ts->ranks()) {
      if (!lost.count(r)) kept.push_back(r);
    }
    if (kept.empty() && !load.empty()) {
      if (ts->ranks_size() == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("data-parallel table '", ts->table(), "' has no replica"));
      }
      const int to = least();
      kept.push_back(to);
      reload[to].insert({ts->table(), to});
      out.replica_source[{ts->table(), to}] = ts->ranks(0);
    }
    ts->clear_ranks();
    for (int r : kept) ts->add_ranks(r);
  }
  for (int r : out.replaced) {  // a replacement loads all it holds
    for (const auto& a : AssignmentsOf(info, r)) {
      reload[r].insert({a.ref().table(), a.ref().shard_index()});
    }
  }
  if (load.empty()) {
    return absl::UnavailableError("no live worker to take the shards of " +
                                  DescribeRanks(old, lost) + "; start one");
  }
  return out;
}

int PromoteCopies(const std::set<int>& lost, ember::v1::ShardingPlan* plan) {
  int promoted = 0;
  for (auto& ts : *plan->mutable_tables()) {
    if (planner::IsReplicated(ts)) {
      std::vector<int> left;
      for (int r : ts.ranks()) {
        if (!lost.count(r)) left.push_back(r);
      }
      if (left.empty()) continue;  // the last replica: reloaded
      ts.clear_ranks();
      for (int r : left) ts.add_ranks(r);
      continue;
    }
    for (auto& sh : *ts.mutable_shards()) {
      std::vector<int> backups;
      for (int b : sh.backups()) {
        if (!lost.count(b)) backups.push_back(b);
      }
      if (lost.count(sh.rank()) && !backups.empty()) {
        sh.set_rank(backups.front());
        backups.erase(backups.begin());
        ++promoted;
      }
      sh.clear_backups();
      for (int b : backups) sh.add_backups(b);
    }
    ts.clear_ranks();
    for (const auto& sh : ts.shards()) ts.add_ranks(sh.rank());
  }
  return promoted;
}

int MissingCopies(const ember::v1::CollectionInfo& info) {
  const int copies = std::max(1, info.spec().replicas());
  int missing = 0;
  for (const auto& ts : info.plan().tables()) {
    for (const auto& sh : ts.shards()) {
      if (sh.rows() > 0 && sh.backups_size() + 1 < copies) ++missing;
    }
  }
  return missing;
}

}  // namespace coordinator
}  // namespace ember
