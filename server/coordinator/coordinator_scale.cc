// CoordinatorService's ScaleCollection: a collection served from another
// number of workers while it trains. The new placement is RescalePlan's
// (move_plan.h), checked as strictly as any plan (planner::CheckPlan: the
// workers' memory too), and the shards move as a drain's do (MoveLive).
#include <algorithm>
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
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/move_plan.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;

grpc::Status CoordinatorService::ScaleCollection(grpc::ServerContext* ctx,
                                                 const ember::v1::ScaleCollectionRequest* req,
                                                 ember::v1::ScaleCollectionResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection is empty"));
  }
  if (req->workers() < 1) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("workers must be >= 1, got ", req->workers())));
  }
  auto scaled = Scale(req->collection(), req->workers());
  if (!scaled.ok()) return ToGrpc(scaled.status());
  *resp = *std::move(scaled);
  return grpc::Status::OK;
}

absl::StatusOr<ember::v1::ScaleCollectionResponse> CoordinatorService::Scale(
    const std::string& name, int workers) {
  absl::MutexLock create(&create_mu_);
  const absl::Time start = absl::Now();
  CollectionInfo before;
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(name);
    if (it == collections_.end()) {
      return absl::NotFoundError(absl::StrCat("no collection '", name, "'"));
    }
    before = it->second;
    ids = rank_ids_[name];
  }
  if (before.state() != CollectionInfo::SERVING) {
    return absl::FailedPreconditionError(absl::StrCat(
        "collection '", name, "' is ", CollectionInfo::State_Name(before.state()),
        " (", before.note(), "); scale it once it serves again"));
  }
  ids.resize(before.worker_addresses_size());
  // The workers that may serve it: live and not draining, in rank order.
  std::map<std::string, Worker> live;
  for (const Worker& w : LiveWorkers()) live[w.id] = w;
  // Its holders in rank order (each must be live: else the monitor is
  // recovering it), then the live workers holding none of it.
  std::vector<int> from;
  std::vector<Worker> chosen;
  std::set<std::string> taken;
  for (int r : planner::HoldingRanks(before.plan())) {
    if (!live.count(ids[r])) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker ", ids[r], " (rank ", r, ") of collection '", name,
          "' is not live or is draining; scale it once that is over"));
    }
    if (static_cast<int>(chosen.size()) == workers) break;
    from.push_back(r);
    chosen.push_back(live[ids[r]]);
    taken.insert(ids[r]);
  }
  const int holding = static_cast<int>(planner::HoldingRanks(before.plan()).size());
  for (const Worker& w : LiveWorkers()) {
    if (static_cast<int>(chosen.size()) == workers) break;
    if (taken.count(w.id)) continue;
    from.push_back(-1);
    chosen.push_back(w);
  }
  if (static_cast<int>(chosen.size()) < workers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "collection '", name, "' cannot be served from ", workers, " workers: ", chosen.size(),
        " live worker(s) can take its shards (start more: emberctl worker)"));
  }
  if (workers == holding && before.worker_addresses_size() == holding) {
    ember::v1::ScaleCollectionResponse same;
    *same.mutable_collection() = before;
    return same;  // served from that many already
  }

  // The new placement, checked as any plan is (memory included).
  absl::StatusOr<ember::v1::ShardingPlan> rescaled = RescalePlan(before, from);
  if (!rescaled.ok()) return rescaled.status();
  const ember::v1::Topology topology = TopologyOf(chosen);
  auto planner_options = PlannerOptionsFor(topology);
  if (!planner_options.ok()) return planner_options.status();
  auto plan = planner::CheckPlan(before.spec(), topology, *rescaled, *planner_options);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(),
                        absl::StrCat("serving '", name, "' from ", workers,
                                     " workers: ", plan.status().message()));
  }
  CollectionInfo after = before;
  *after.mutable_plan() = *std::move(plan);
  after.clear_worker_addresses();
  std::vector<std::string> after_ids;
  for (const Worker& w : chosen) {
    after.add_worker_addresses(w.info.address());
    after_ids.push_back(w.id);
  }
  const std::string what =
      absl::StrCat("scaling from ", holding, " to ", workers, " worker(s)");
  absl::StatusOr<MoveStats> moved =
      MoveTo(name, what, before, &after, after_ids, MoveKind::kScale);
  if (!moved.ok()) return moved.status();
  after.set_state(CollectionInfo::SERVING);
  after.set_note(absl::StrCat("scaled from ", holding, " to ", workers, " worker(s): ",
                              moved->shards, " shard(s) copied live, fenced ",
                              static_cast<int64_t>(moved->fence_ms), " ms"));
  if (absl::Status s = Register(after, after_ids); !s.ok()) return s;
  ember::v1::ScaleCollectionResponse resp;
  *resp.mutable_collection() = after;
  resp.set_shards_moved(moved->shards);
  resp.set_bytes_copied(moved->bytes_copied);
  resp.set_bytes_between_workers(moved->bytes_between_workers);
  resp.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  resp.set_fence_ms(moved->fence_ms);
  LOG(INFO) << "collection '" << name << "' " << after.note() << " in " << resp.seconds() << " s";
  return resp;
}

}  // namespace coordinator
}  // namespace ember
