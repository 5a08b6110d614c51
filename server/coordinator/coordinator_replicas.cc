// CoordinatorService's replicated collections (CollectionSpec.replicas):
// a lost rank's shards taken over by their backups at a new epoch with
// nothing rolled back (TakeOver), and the missing copies made anew live,
// on a spare worker or the least-loaded live ones (RestoreCopies, the
// live-move machinery of live_move.cc).
#include "server/coordinator/coordinator_service.h"

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "planner/planner.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/crash_point.h"
#include "server/coordinator/replacement_policy.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;

absl::Status CoordinatorService::TakeOver(const std::string& name, const CollectionInfo& before,
                                          CollectionInfo promoted,
                                          const std::vector<std::string>& ids,
                                          const std::set<int>& lost,
                                          const std::set<std::string>& alive, int promoted_shards,
                                          absl::Time start) {
  const std::string lost_names = DescribeRanks(before, lost);
  SetState(name, CollectionInfo::RECOVERING,
           absl::StrCat("backups taking over the shards of ", lost_names));
  auto next = NextEpoch();
  if (!next.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(next.status().message()));
    return next.status();
  }
  const int64_t epoch = *next;
  promoted.mutable_plan()->set_epoch(epoch);
  // Nothing is copied: the data is in place once it is persisted.
  if (absl::Status s = PersistMove(name, promoted, ids, /*data_in_place=*/true); !s.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
    return s;
  }
  CrashPoint("take_over_persisted");
  std::vector<std::string> at;
  const std::vector<grpc::Status> statuses =
      MoveHolders(promoted, planner::HoldingRanks(promoted.plan()), &at);
  for (size_t i = 0; i < at.size(); ++i) {
    if (statuses[i].ok()) continue;
    const std::string why = absl::StrCat("backups taking over the shards of ", lost_names,
                                         " failed on ", at[i], ": ", statuses[i].error_message(),
                                         "; retrying");
    LOG(WARNING) << "collection '" << name << "': " << why;
    SetState(name, CollectionInfo::DEGRADED, why);
    return FromGrpc(statuses[i], at[i]);
  }
  // A lost rank still alive (its copies reported behind) lets go of them.
  std::vector<std::string> drop;
  for (int r : lost) {
    if (r < static_cast<int>(ids.size()) && alive.count(ids[r])) {
      drop.push_back(before.worker_addresses(r));
    }
  }
  (void)DropOnWorkers(name, before.plan().epoch(), drop);
  promoted.set_state(CollectionInfo::SERVING);
  promoted.set_recovered_from("");
  promoted.set_recovered_unix_ms(absl::ToUnixMillis(absl::Now()));
  const int missing = MissingCopies(promoted);
  promoted.set_note(absl::StrCat(
      "lost ", lost_names, ": ", promoted_shards, " shard(s) taken over by their backups at epoch ",
      epoch, ", no acknowledged update lost",
      missing > 0 ? absl::StrCat("; ", missing, " shard(s) short of ", promoted.spec().replicas(),
                                 " copies until new ones are made")
                  : std::string()));
  {
    absl::MutexLock lock(&mu_);
    if (!collections_.count(name)) return absl::OkStatus();  // dropped meanwhile
  }
  if (absl::Status s = Register(promoted, ids); !s.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    force_lost_.erase(name);
    ++replica_takeovers_;
  }
  LOG(WARNING) << "collection '" << name << "' taken over at epoch " << epoch << " in "
               << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms: " << promoted.note();
  return absl::OkStatus();
}

absl::Status CoordinatorService::RestoreCopies(const std::string& name) {
  absl::MutexLock create(&create_mu_);
  const absl::Time start = absl::Now();
  CollectionInfo before;
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(name);
    if (it == collections_.end()) return absl::OkStatus();
    before = it->second;
    ids = rank_ids_[name];
  }
  if (before.state() != CollectionInfo::SERVING || MissingCopies(before) == 0) {
    return absl::OkStatus();
  }
  const int world = before.worker_addresses_size();
  ids.resize(world);
  // Ranks that may take copies: those holding some of the collection on a
  // live worker (not draining). A rank holding nothing (its shards taken
  // over) takes a spare, a live worker of none of the collection's ranks,
  // if there is one.
  std::map<std::string, Worker> usable;
  for (const Worker& w : LiveWorkers()) usable[w.id] = w;
  std::set<std::string> in_use(ids.begin(), ids.end());
  std::vector<const Worker*> spares;
  for (const Worker& w : LiveWorkers()) {
    if (!in_use.count(w.id)) spares.push_back(&usable[w.id]);
  }
  CollectionInfo after = before;
  std::vector<std::string> after_ids = ids;
  const std::set<int> holding = planner::HoldingRanks(before.plan());
  std::set<int> unavailable;
  size_t next_spare = 0;
  for (int r = 0; r < world; ++r) {
    // A rank holding nothing had its copies taken over: its worker (dead,
    // or reported behind and perhaps not yet known dead) takes no new ones.
    if (usable.count(ids[r]) && holding.count(r)) continue;
    if (holding.count(r) || next_spare == spares.size()) {
      unavailable.insert(r);
      continue;
    }
    const Worker* spare = spares[next_spare++];
    after.set_worker_addresses(r, spare->info.address());
    after_ids[r] = spare->id;
    // A data-parallel table has a replica on every rank that holds its
    // collection: the spare's is copied like the backups.
    for (auto& ts : *after.mutable_plan()->mutable_tables()) {
      if (planner::IsReplicated(ts)) ts.add_ranks(r);
    }
  }
  if (absl::Status s =
          planner::PlaceBackups(after.spec().replicas(), after.mutable_plan(), unavailable);
      !s.ok()) {
    absl::MutexLock lock(&mu_);
    retry_after_[name] = absl::Now() + absl::Seconds(30);
    auto it = collections_.find(name);
    if (it != collections_.end()) {
      it->second.set_note(absl::StrCat(MissingCopies(before), " shard(s) short of ",
                                        before.spec().replicas(), " copies: ", s.message(),
                                        " (start a worker: emberctl worker)"));
    }
    return s;
  }
  const std::string what = absl::StrCat("copying ", MissingCopies(before),
                                        " shard(s) anew to restore ", before.spec().replicas(),
                                        " copies");
  absl::StatusOr<MoveStats> moved =
      MoveTo(name, what, before, &after, after_ids, MoveKind::kCopies);
  if (!moved.ok()) {
    absl::MutexLock lock(&mu_);
    retry_after_[name] = absl::Now() + absl::Seconds(10);
    return moved.status();
  }
  after.set_state(CollectionInfo::SERVING);
  after.set_note(absl::StrCat(moved->shards, " shard copies made anew live, ",
                              after.spec().replicas(), " copies of every shard again (fenced ",
                              static_cast<int64_t>(moved->fence_ms), " ms)"));
  if (absl::Status s = Register(after, after_ids); !s.ok()) return s;
  LOG(INFO) << "collection '" << name << "': " << after.note() << " in "
            << absl::ToDoubleSeconds(absl::Now() - start) << " s";
  return absl::OkStatus();
}

}  // namespace coordinator
}  // namespace ember
