// CoordinatorService's recovery and drain: a dead or draining worker's
// shards re-placed (replacement_policy.h), reloaded from the latest
// checkpoint or copied live from the draining worker, under a new epoch;
// and re-adopting a move a restarted coordinator finds half done.
#include "server/coordinator/coordinator_service.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "planner/planner.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/crash_point.h"
#include "server/coordinator/replacement_policy.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

absl::Status CoordinatorService::RecoverCollection(const std::string& name,
                                                  const std::string& drain_id) {
  absl::MutexLock create(&create_mu_);
  const absl::Time start = absl::Now();
  const bool drain = !drain_id.empty();
  CollectionInfo info;
  std::vector<std::string> ids;
  // `live` may receive shards (a draining worker may not); `alive` holds a
  // lease (a draining worker too: it is not lost).
  std::map<std::string, Worker> live, alive;
  for (const Worker& w : LiveWorkers()) live[w.id] = w;
  std::set<int> lost;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(name);
    if (it == collections_.end()) return absl::OkStatus();
    info = it->second;
    ids = rank_ids_[name];
    if (!drain && force_lost_.count(name)) lost = force_lost_[name];
    const absl::Time now = absl::Now();
    for (const auto& [id, w] : workers_) {
      if (Live(w, now)) alive[id] = w;
    }
  }
  const int world = info.worker_addresses_size();
  ids.resize(world);
  const std::set<int> holding = planner::HoldingRanks(info.plan());
  for (int r : holding) {
    if (drain ? ids[r] == drain_id : !alive.count(ids[r])) lost.insert(r);
  }
  if (lost.empty()) return absl::OkStatus();
  // A replicated collection: surviving copies take over first, nothing
  // rolled back; only what has no copy left comes from the checkpoint.
  std::string promotion;
  if (!drain && info.spec().replicas() > 1) {
    CollectionInfo promoted = info;
    const int n = PromoteCopies(lost, promoted.mutable_plan());
    const std::set<int> still_holding = planner::HoldingRanks(promoted.plan());
    std::set<int> uncovered;
    for (int r : lost) {
      if (still_holding.count(r)) uncovered.insert(r);
    }
    if (uncovered.empty()) {
      std::set<std::string> alive_ids;
      for (const auto& [id, w] : alive) alive_ids.insert(id);
      return TakeOver(name, info, promoted, ids, lost, alive_ids, n, start);
    }
    promotion = absl::StrCat(n, " shard(s) of ", DescribeRanks(info, lost),
                             " taken over by their backups; ");
    info = std::move(promoted);
    lost = std::move(uncovered);
  }
  const CollectionInfo before = info;  // the old plan and addresses (drain copies from them)
  const std::string lost_names = DescribeRanks(info, lost);
  LOG(WARNING) << "collection '" << name << "': " << (drain ? "draining " : "lost ") << lost_names;
  if (!drain && info.spec().training().mode() == ember::v1::TrainingSpec::BOUNDED) {
    // Held BOUNDED steps have returned to their trainers: they apply before
    // anything moves, while the collection still serves (a trainer that
    // refreshes its plan to send a step the fence waits for is refused
    // while the collection recovers).
    SetState(name, CollectionInfo::SERVING,
             "fencing the steps before recovering the shards of " + lost_names);
    std::vector<std::string> reachable;
    for (int r : holding) {
      if (alive.count(ids[r])) reachable.push_back(info.worker_addresses(r));
    }
    FenceSteps(info, reachable);
  }
  // A drain copies live (MoveLive): the collection serves on until its
  // fence. A recovery stops it now.
  SetState(name, drain ? CollectionInfo::SERVING : CollectionInfo::RECOVERING,
           (drain ? "moving the shards of " : "recovering the shards of ") + lost_names);

  // The checkpoint to reload from, chosen (and every file verified) before
  // anything changes: the newest usable one of this collection.
  std::string path;
  ember::v1::CheckpointManifest manifest;
  std::vector<std::string> pinned;
  auto unpin = absl::MakeCleanup([this, &pinned] { Unpin(pinned); });
  if (!drain) {
    const std::vector<std::string> candidates = CheckpointCandidates(info);
    std::string unusable;
    for (const std::string& candidate : candidates) {
      // Not pruned while it is verified and loaded (an incremental one's
      // bases too); released when this recovery returns.
      Unpin(pinned);
      pinned = PinCheckpoint(candidate);
      auto m = checkpoint::VerifyCheckpoint(candidate, nullptr, options_.checkpoint_dir);
      if (m.ok()) {
        path = candidate;
        manifest = *std::move(m);
        break;
      }
      absl::StrAppend(&unusable, unusable.empty() ? "" : "; ", m.status().message());
    }
    if (path.empty() && !candidates.empty()) {
      const std::string why =
          absl::StrCat("no usable checkpoint to recover ", lost_names, " from: ", unusable,
                       "; retrying in 30 s");
      SetState(name, CollectionInfo::DEGRADED, why);
      absl::MutexLock lock(&mu_);
      retry_after_[name] = absl::Now() + absl::Seconds(30);
      return absl::DataLossError(why);
    }
  }

  // Where the lost ranks' shards go (replacement_policy.h).
  std::vector<ReplacementCandidate> candidates;
  for (const auto& [id, w] : live) candidates.push_back({id, w.seq, w.info.address()});
  // A replicated collection's drain: backups on other workers take over
  // the draining worker's primaries, and the copies it held are made anew
  // on the others (as after a loss, but live: MoveLive copies them from the
  // copies serving meanwhile). Too few workers left: fewer copies until
  // more join (the monitor then makes them).
  std::optional<Replacement> by_copies;
  if (drain && info.spec().replicas() > 1) {
    Replacement r;
    r.info = info;
    r.ids = ids;
    PromoteCopies(lost, r.info.mutable_plan());
    const std::set<int> holding_after = planner::HoldingRanks(r.info.plan());
    bool emptied = true;
    for (int l : lost) emptied &= !holding_after.count(l);
    if (emptied) {
      // Copies go to ranks holding some of it on a live worker, the
      // draining one's excepted (as RestoreCopies places them).
      std::set<int> unavailable = lost;
      for (int k = 0; k < world; ++k) {
        if (!holding_after.count(k) || !live.count(ids[k])) unavailable.insert(k);
      }
      (void)planner::PlaceBackups(info.spec().replicas(), r.info.mutable_plan(), unavailable);
      by_copies = std::move(r);
    }
  }
  absl::StatusOr<Replacement> placed = by_copies.has_value()
                                           ? absl::StatusOr<Replacement>(std::move(*by_copies))
                                           : PlaceLostShards(info, ids, lost, candidates);
  if (!placed.ok()) {
    SetState(name, drain ? CollectionInfo::SERVING : CollectionInfo::DEGRADED,
             drain ? "" : std::string(placed.status().message()));
    return placed.status();
  }
  info = std::move(placed->info);
  ids = std::move(placed->ids);
  ember::v1::ShardingPlan& plan = *info.mutable_plan();
  const std::set<int>& replaced = placed->replaced;
  const std::map<int, int64_t>& load = placed->load;
  std::map<int, std::set<std::pair<std::string, int32_t>>>& reload = placed->reload;
  // Every rank holding something under the new plan moves to its epoch
  // (replacements are created there); a drained rank holds nothing now.
  std::set<int> kept = planner::HoldingRanks(info.plan());
  for (int r : replaced) kept.erase(r);
  // A live move's fence epoch comes between the plans' (MoveLive).
  int64_t fence_epoch = 0;
  if (drain) {
    auto fence = NextEpoch();
    if (!fence.ok()) return fence.status();
    fence_epoch = *fence;
  }
  auto next = NextEpoch();
  if (!next.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(next.status().message()));
    return next.status();
  }
  const int64_t epoch = *next;
  plan.set_epoch(epoch);
  // The new placement is durable before any worker hears of it, so a
  // restarted coordinator knows what an interrupted move was doing.
  if (absl::Status s = PersistMove(name, info, ids, /*data_in_place=*/false); !s.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
    return s;
  }

  std::string note;
  if (drain) {
    LiveMove move;
    move.name = name;
    move.what = absl::StrCat("draining ", lost_names);
    move.fence_epoch = fence_epoch;
    move.before = before;
    move.after = info;
    move.after_ids = ids;
    absl::StatusOr<MoveStats> moved = Move(move, MoveKind::kDrain);
    if (!moved.ok()) return moved.status();
    info.set_state(CollectionInfo::SERVING);
    info.set_note(absl::StrCat("drained ", lost_names, ": ", moved->shards,
                               " shard(s) copied live while serving, no update lost (fenced ",
                               static_cast<int64_t>(moved->fence_ms), " ms)"));
    {
      absl::MutexLock lock(&mu_);
      if (!collections_.count(name)) return absl::OkStatus();  // dropped meanwhile
    }
    if (absl::Status s = Register(info, ids); !s.ok()) {
      SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
      return s;
    }
    LOG(INFO) << "collection '" << name << "' moved at epoch " << epoch << " in "
              << absl::ToDoubleMilliseconds(absl::Now() - start) << " ms: " << info.note();
    return absl::OkStatus();
  }
  // Replacements create their shards; the other live ranks move to the new
  // epoch and create what they were given.
  std::vector<std::string> create_at, update_at;
  std::vector<ember::v1::CreateShardsRequest> creates;
  std::vector<ember::v1::UpdateShardsRequest> updates;
  for (int r : replaced) {
    ember::v1::CreateShardsRequest c;
    c.set_collection(name);
    c.set_epoch(epoch);
    *c.mutable_training() = info.spec().training();
    for (const auto& a : AssignmentsOf(info, r)) *c.add_shards() = a;
    create_at.push_back(info.worker_addresses(r));
    creates.push_back(std::move(c));
  }
  for (int r : kept) {
    ember::v1::UpdateShardsRequest u;
    u.set_collection(name);
    u.set_epoch(epoch);
    *u.mutable_training() = info.spec().training();
    for (const auto& a : AssignmentsOf(info, r)) *u.add_create() = a;
    update_at.push_back(info.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  // A failed attempt lets go of what it created on replacements.
  auto give_up = [&](const absl::Status& why) {
    (void)DropOnWorkers(name, epoch, create_at);
    return why;
  };
  absl::Status failure;
  auto failed = [&](const std::vector<grpc::Status>& statuses,
                    const std::vector<std::string>& at) -> bool {
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (statuses[i].ok()) continue;
      const std::string why =
          absl::StrCat("recovery of ", lost_names, " failed on ", at[i], ": ",
                       statuses[i].error_message(), "; retrying");
      LOG(WARNING) << "collection '" << name << "': " << why;
      SetState(name, CollectionInfo::DEGRADED, why);
      failure = FromGrpc(statuses[i], at[i]);
      return true;
    }
    return false;
  };
  if (failed(CallEach<ember::v1::CreateShardsRequest, ember::v1::CreateShardsResponse>(
                 create_at, creates,
                 [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
                   async->CreateShards(ctx, request, response, std::move(done));
                 }),
             create_at) ||
      failed(CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
                 update_at, updates,
                 [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
                   async->UpdateShards(ctx, request, response, std::move(done));
                 }),
             update_at)) {
    return give_up(failure);
  }
  CrashPoint("move_before_data");

  // Reload from the checkpoint: the lost shards, or everything.
  const bool whole = info.spec().recovery() == ember::v1::CollectionSpec::WHOLE_COLLECTION;
  if (path.empty()) {
    note = absl::StrCat("no checkpoint: the shards of ", lost_names,
                        " came back freshly initialised");
  } else {
    std::vector<std::string> at;
    std::vector<ember::v1::LoadCheckpointRequest> loads;
    for (const auto& [r, bytes] : load) {
      if (!whole && !reload.count(r)) continue;
      ember::v1::LoadCheckpointRequest l;
      l.set_collection(name);
      l.set_epoch(epoch);
      l.set_dir(path);
      *l.mutable_sources() = manifest.shards();
      if (!whole) {
        for (const auto& [table, index] : reload[r]) {
          auto* ref = l.add_only();
          ref->set_table(table);
          ref->set_shard_index(index);
        }
      }
      at.push_back(info.worker_addresses(r));
      loads.push_back(std::move(l));
    }
    if (failed(CallEach<ember::v1::LoadCheckpointRequest, ember::v1::LoadCheckpointResponse>(
                   at, loads,
                   [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
                     async->LoadCheckpoint(ctx, request, response, std::move(done));
                   },
                   options_.checkpoint_rpc_timeout),
               at)) {
      return give_up(failure);
    }
    note = whole ? absl::StrCat("the whole collection rolled back to ", path, " (lost ",
                                lost_names, ")")
                 : absl::StrCat("the shards of ", lost_names, " rolled back to ", path,
                                "; their updates since then are lost");
  }
  note = promotion + note;
  // The data is in place: from here a restarted coordinator keeps the new
  // placement.
  if (absl::Status s = PersistMove(name, info, ids, /*data_in_place=*/true); !s.ok()) {
    std::vector<std::string> created;
    for (int r : replaced) created.push_back(info.worker_addresses(r));
    (void)DropOnWorkers(name, epoch, created);
    return s;
  }
  CrashPoint("move_after_data");
  info.set_state(CollectionInfo::SERVING);
  info.set_recovered_from(path);
  info.set_recovered_unix_ms(absl::ToUnixMillis(absl::Now()));
  info.set_note(note);
  {
    absl::MutexLock lock(&mu_);
    if (!collections_.count(name)) return absl::OkStatus();  // dropped meanwhile
  }
  if (absl::Status s = Register(info, ids); !s.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
    return s;
  }
  {
    absl::MutexLock lock(&mu_);
    force_lost_.erase(name);
  }
  LOG(INFO) << "collection '" << name << "' recovered at epoch "
            << epoch << " in " << absl::ToDoubleMilliseconds(absl::Now() - start)
            << " ms: " << note;
  return absl::OkStatus();
}

absl::Status CoordinatorService::ReadoptLocked(const std::string& name, const std::string& why) {
  CollectionInfo info;
  std::vector<std::string> ids;
  std::set<std::string> alive;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(name);
    if (it == collections_.end()) return absl::OkStatus();
    info = it->second;
    ids = rank_ids_[name];
    const absl::Time now = absl::Now();
    for (const auto& [id, w] : workers_) {
      if (Live(w, now)) alive.insert(id);
    }
  }
  auto next = NextEpoch();
  if (!next.ok()) return next.status();
  info.mutable_plan()->set_epoch(*next);
  ids.resize(info.worker_addresses_size());
  std::set<int> live_ranks;
  for (int r : planner::HoldingRanks(info.plan())) {
    if (alive.count(ids[r])) live_ranks.insert(r);  // a dead rank is the monitor's to recover
  }
  std::vector<std::string> at;
  const std::vector<grpc::Status> statuses = MoveHolders(info, live_ranks, &at);
  for (size_t i = 0; i < at.size(); ++i) {
    if (statuses[i].ok()) continue;
    const absl::Status s = FromGrpc(statuses[i], at[i]);
    SetState(name, CollectionInfo::DEGRADED, absl::StrCat(why, "; re-adopting failed: ", s.message()));
    return s;
  }
  info.set_state(CollectionInfo::SERVING);
  info.set_note(why);
  LOG(WARNING) << "collection '" << name << "' re-adopted at epoch " << *next << ": " << why;
  return Register(info, ids);
}

std::vector<grpc::Status> CoordinatorService::MoveHolders(const CollectionInfo& info,
                                                          const std::set<int>& ranks,
                                                          std::vector<std::string>* at) {
  std::vector<ember::v1::UpdateShardsRequest> updates;
  at->clear();
  for (int r : ranks) {
    ember::v1::UpdateShardsRequest u;
    u.set_collection(info.spec().name());
    u.set_epoch(info.plan().epoch());
    *u.mutable_training() = info.spec().training();
    for (const auto& a : AssignmentsOf(info, r)) *u.add_create() = a;
    at->push_back(info.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  return CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
      *at, updates, [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
        async->UpdateShards(ctx, request, response, std::move(done));
      });
}

void CoordinatorService::FenceSteps(const CollectionInfo& info,
                                    const std::vector<std::string>& addresses) {
  if (addresses.empty()) return;
  const std::string& name = info.spec().name();
  ember::v1::UpdateTrainingRequest u;
  u.set_collection(name);
  u.set_epoch(info.plan().epoch());
  auto call = [&](const ember::v1::UpdateTrainingRequest& req, absl::Duration timeout,
                  std::vector<ember::v1::UpdateTrainingResponse>* out) {
    return CallEach<ember::v1::UpdateTrainingRequest, ember::v1::UpdateTrainingResponse>(
        addresses, std::vector<ember::v1::UpdateTrainingRequest>(addresses.size(), req),
        [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
          async->UpdateTraining(ctx, request, response, std::move(done));
        },
        timeout, out);
  };
  auto highest = [&](const std::vector<grpc::Status>& st,
                     const std::vector<ember::v1::UpdateTrainingResponse>& out) {
    int64_t h = -1;
    for (size_t i = 0; i < st.size(); ++i) {
      if (st[i].ok()) h = std::max(h, out[i].highest_step());
    }
    return h;
  };
  // The highest step held anywhere; fenced there, and again higher while a
  // worker took a later one meanwhile (trainers run at most max_staleness
  // steps apart, so this ends).
  std::vector<ember::v1::UpdateTrainingResponse> out;
  u.set_fence_query(true);
  int64_t fence = highest(call(u, absl::ZeroDuration(), &out), out);
  u.set_fence_query(false);
  for (int round = 0; round < 8; ++round) {
    u.set_fence_at(fence);
    const int64_t seen = highest(call(u, absl::ZeroDuration(), &out), out);
    if (seen <= fence) break;
    fence = seen;
  }
  if (fence < 0) return;  // no step yet
  u.set_fence_at(fence);
  u.set_fence_wait(true);
  const double wait_s = info.spec().training().step_timeout_s() > 0
                            ? info.spec().training().step_timeout_s()
                            : 300;
  const std::vector<grpc::Status> waited =
      call(u, absl::Seconds(wait_s) + absl::Seconds(10), &out);
  for (size_t i = 0; i < waited.size(); ++i) {
    if (waited[i].ok()) continue;
    LOG(WARNING) << "collection '" << name << "': step " << fence << " not applied on "
                 << addresses[i] << " before the move (" << waited[i].error_message()
                 << "); its held steps are dropped and sent again by their trainers";
  }
  LOG(INFO) << "collection '" << name << "': BOUNDED steps through " << fence
            << " applied before the move";
}

grpc::Status CoordinatorService::DrainWorker(grpc::ServerContext* ctx,
                                             const ember::v1::DrainWorkerRequest* req,
                                             ember::v1::DrainWorkerResponse* resp) {
  Caller caller;
  if (grpc::Status a = options_.auth.Check(ctx, Role::kWorker, &caller); !a.ok()) return a;
  if (req->worker_id().empty()) return ToGrpc(absl::InvalidArgumentError("worker_id is empty"));
  if (grpc::Status a = MayActFor(caller, req->worker_id()); !a.ok()) return a;
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    if (!workers_.count(req->worker_id())) {
      return ToGrpc(absl::NotFoundError(absl::StrCat("no worker '", req->worker_id(), "'")));
    }
    draining_.insert(req->worker_id());
    names = CollectionsOnLocked(req->worker_id());
  }
  LOG(INFO) << "draining worker " << req->worker_id() << ": " << names.size() << " collection(s)";
  for (const std::string& name : names) {
    if (absl::Status s = RecoverCollection(name, req->worker_id()); !s.ok()) {
      absl::MutexLock lock(&mu_);
      draining_.erase(req->worker_id());
      return ToGrpc(absl::Status(s.code(), absl::StrCat("draining ", req->worker_id(), ": ",
                                                        s.message())));
    }
    resp->add_collections(name);
  }
  return grpc::Status::OK;
}

}  // namespace coordinator
}  // namespace ember
