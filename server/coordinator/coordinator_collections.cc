// CoordinatorService's collections: create (planned over the live workers
// and allocated on them), get, list, preview a plan, drop.
#include "server/coordinator/coordinator_service.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/planner.h"
#include "planner/spec_validation.h"
#include "server/backend/table_spec.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/crash_point.h"
#include "server/coordinator/state_store.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

namespace {

// A collection's name names directories under checkpoint roots: letters,
// digits, '_', '-' and '.', not starting with '.', at most 128 characters.
absl::Status CheckCollectionName(const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError("the collection needs a name");
  bool ok = name.size() <= 128 && name[0] != '.';
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-' || c == '.');
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "collection name '", name.substr(0, 128),
        "' must be 1-128 letters, digits, '_', '-' or '.', not starting with '.'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CoordinatorService::DropOnWorkers(const std::string& collection, int64_t epoch,
                                               const std::vector<std::string>& addresses,
                                               bool staged) {
  ember::v1::DropShardsRequest req;
  req.set_collection(collection);
  req.set_epoch(epoch);
  req.set_staged(staged);
  const std::vector<grpc::Status> statuses = CallEach<ember::v1::DropShardsRequest,
                                                      ember::v1::DropShardsResponse>(
      addresses, std::vector<ember::v1::DropShardsRequest>(addresses.size(), req),
      [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
        async->DropShards(ctx, request, response, std::move(done));
      });
  absl::Status first;
  for (size_t i = 0; i < addresses.size(); ++i) {
    const grpc::Status& s = statuses[i];
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
      LOG(WARNING) << "dropping '" << collection << "' on " << addresses[i] << ": "
                   << s.error_message();
      if (first.ok()) first = FromGrpc(s, "worker " + addresses[i]);
    }
  }
  return first;
}

grpc::Status CoordinatorService::CreateCollection(grpc::ServerContext* ctx,
                                                  const ember::v1::CreateCollectionRequest* req,
                                                  ember::v1::CreateCollectionResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  absl::MutexLock create(&create_mu_);
  std::vector<std::string> ids;
  if (req->has_plan() && !req->sharding_type().empty()) {
    return ToGrpc(absl::InvalidArgumentError(
        "give a plan or a sharding type, not both (the plan names each table's type)"));
  }
  auto info = PlanAndCreate(req->spec(), req->sharding_type(), &ids,
                            req->has_plan() ? &req->plan() : nullptr);
  if (!info.ok()) return ToGrpc(info.status());
  if (absl::Status s = Register(*info, ids); !s.ok()) {
    const std::vector<std::string> addresses(info->worker_addresses().begin(),
                                             info->worker_addresses().end());
    (void)DropOnWorkers(info->spec().name(), info->plan().epoch(), addresses);
    return ToGrpc(s);
  }
  LOG(INFO) << "collection '" << info->spec().name() << "' created at epoch "
            << info->plan().epoch() << " on " << info->worker_addresses_size() << " worker(s)";
  *resp->mutable_collection() = *std::move(info);
  return grpc::Status::OK;
}

absl::StatusOr<planner::PlannerOptions> CoordinatorService::PlannerOptionsFor(
    const ember::v1::Topology& topology) const {
  planner::PlannerOptions o;
  if (!options_.cost_model.has_value()) return o;
  if (topology.compute_device() != options_.cost_model_device) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the coordinator's --cost_model is for ",
        ember::v1::ComputeDevice_Name(options_.cost_model_device), " workers; these are ",
        ember::v1::ComputeDevice_Name(topology.compute_device()),
        " (calibrate on them: emberctl calibrate)"));
  }
  o.cost_model = options_.cost_model;
  return o;
}

absl::StatusOr<CollectionInfo> CoordinatorService::PlanAndCreate(
    const ember::v1::CollectionSpec& requested, const std::string& sharding_type,
    std::vector<std::string>* worker_ids, const ember::v1::ShardingPlan* explicit_plan) {
  ember::v1::CollectionSpec spec = requested;
  if (absl::Status s = CheckCollectionName(spec.name()); !s.ok()) return s;
  if (!sharding_type.empty()) {
    if (absl::Status s = planner::ForceShardingType(sharding_type, &spec); !s.ok()) return s;
  }
  {
    absl::MutexLock lock(&mu_);
    if (collections_.count(spec.name())) {
      return absl::AlreadyExistsError(
          absl::StrCat("collection '", spec.name(), "' exists; drop it first"));
    }
  }
  const std::vector<Worker> workers = LiveWorkers();
  if (workers.empty()) {
    return absl::UnavailableError("no live workers: start some (emberctl worker / up)");
  }
  const absl::Time start = absl::Now();
  const ember::v1::Topology topology = TopologyOf(workers);
  auto planner_options = PlannerOptionsFor(topology);
  if (!planner_options.ok()) return planner_options.status();
  auto plan = explicit_plan != nullptr
                  ? planner::CheckPlan(spec, topology, *explicit_plan, *planner_options)
                  : planner::Plan(spec, topology, *planner_options);
  if (!plan.ok()) return plan.status();
  plan->mutable_stats()->set_planning_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  auto next = NextEpoch();
  if (!next.ok()) return next.status();
  const int64_t epoch = *next;
  plan->set_epoch(epoch);

  // The stored spec names every optimizer value a table runs with, and a
  // dynamic table's rows (its capacity).
  spec = planner::WithDynamicRows(spec);
  FillOptimizerDefaults(&spec);
  FillTrainingDefaults(&spec);
  CollectionInfo info;
  *info.mutable_spec() = spec;
  *info.mutable_plan() = *std::move(plan);
  info.set_created_epoch(epoch);
  std::vector<std::string> addresses;
  for (const Worker& w : workers) addresses.push_back(w.info.address());
  for (const std::string& a : addresses) info.add_worker_addresses(a);
  // Shard assignments per rank (a primary's name its backups' addresses).
  const int world = static_cast<int>(workers.size());
  std::vector<ember::v1::CreateShardsRequest> per_rank(world);
  for (int r = 0; r < world; ++r) {
    per_rank[r].set_collection(spec.name());
    per_rank[r].set_epoch(epoch);
    *per_rank[r].mutable_training() = info.spec().training();
    for (ShardAssignment& a : AssignmentsOf(info, r)) *per_rank[r].add_shards() = std::move(a);
  }
  // Every worker allocates and initialises its shards at once. If any
  // fails, the shards are dropped again wherever they were (or may have
  // been) created: a worker that refused (ALREADY_EXISTS, INVALID_ARGUMENT,
  // RESOURCE_EXHAUSTED...) is left as it was, and the drop names this
  // epoch, so a collection of the same name held at another epoch stays.
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::CreateShardsRequest, ember::v1::CreateShardsResponse>(
          addresses, per_rank, [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->CreateShards(ctx, request, response, std::move(done));
          });
  for (int r = 0; r < world; ++r) {
    if (statuses[r].ok()) continue;
    std::vector<std::string> undo;
    for (int i = 0; i < world; ++i) {
      const grpc::StatusCode code = statuses[i].error_code();
      if (code == grpc::StatusCode::OK || code == grpc::StatusCode::DEADLINE_EXCEEDED ||
          code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::CANCELLED) {
        undo.push_back(addresses[i]);
      }
    }
    (void)DropOnWorkers(spec.name(), epoch, undo);
    return FromGrpc(statuses[r], absl::StrCat("creating '", spec.name(), "' on worker ", r, " (",
                                              addresses[r], ")"));
  }
  worker_ids->clear();
  for (const Worker& w : workers) worker_ids->push_back(w.id);
  return info;
}

grpc::Status CoordinatorService::GetCollection(grpc::ServerContext* ctx,
                                               const ember::v1::GetCollectionRequest* req,
                                               ember::v1::GetCollectionResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection name is empty"));
  }
  absl::MutexLock lock(&mu_);
  auto it = collections_.find(req->collection());
  if (it == collections_.end()) {
    return ToGrpc(absl::NotFoundError(absl::StrCat("no collection '", req->collection(), "'")));
  }
  *resp->mutable_collection() = it->second;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListCollections(grpc::ServerContext* ctx,
                                                 const ember::v1::ListCollectionsRequest*,
                                                 ember::v1::ListCollectionsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  absl::MutexLock lock(&mu_);
  for (const auto& [name, info] : collections_) *resp->add_collections() = info;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::PreviewPlan(grpc::ServerContext* ctx,
                                             const ember::v1::PreviewPlanRequest* req,
                                             ember::v1::PreviewPlanResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  ember::v1::CollectionSpec spec = req->spec();
  if (!req->sharding_type().empty()) {
    if (absl::Status s = planner::ForceShardingType(req->sharding_type(), &spec); !s.ok()) {
      return ToGrpc(s);
    }
  }
  ember::v1::Topology topology = req->topology();
  if (topology.world_size() == 0) {
    const std::vector<Worker> workers = LiveWorkers();
    if (workers.empty()) {
      return ToGrpc(absl::UnavailableError("no live workers; give a topology to preview"));
    }
    topology = TopologyOf(workers);
  }
  const absl::Time start = absl::Now();
  auto planner_options = PlannerOptionsFor(topology);
  if (!planner_options.ok()) return ToGrpc(planner_options.status());
  auto plan = planner::Plan(spec, topology, *planner_options);
  if (!plan.ok()) return ToGrpc(plan.status());
  plan->mutable_stats()->set_planning_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  *resp->mutable_plan() = *plan;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::DropCollection(grpc::ServerContext* ctx,
                                                const ember::v1::DropCollectionRequest* req,
                                                ember::v1::DropCollectionResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection name is empty"));
  }
  absl::MutexLock create(&create_mu_);
  CollectionInfo info;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(req->collection());
    if (it == collections_.end()) {
      return ToGrpc(absl::NotFoundError(absl::StrCat("no collection '", req->collection(), "'")));
    }
    info = it->second;
    if (absl::Status s = Persist(StateStore::Batch().DeleteCollection(req->collection()));
        !s.ok()) {
      return ToGrpc(s);
    }
    collections_.erase(it);
    rank_ids_.erase(req->collection());
  }
  const std::vector<std::string> addresses(info.worker_addresses().begin(),
                                           info.worker_addresses().end());
  // The collection is gone for clients whatever happens; a worker that
  // cannot be reached keeps its shards until it restarts.
  // At the newest epoch handed out: workers drop a collection held at that
  // epoch or an older one (a failed recovery may have moved some forward).
  int64_t newest;
  {
    absl::MutexLock lock(&mu_);
    newest = epoch_;
  }
  if (absl::Status s = DropOnWorkers(req->collection(), newest, addresses); !s.ok()) {
    LOG(WARNING) << "collection '" << req->collection() << "' dropped; " << s;
  }
  LOG(INFO) << "collection '" << req->collection() << "' dropped";
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::SetTrainers(grpc::ServerContext* ctx,
                                             const ember::v1::SetTrainersRequest* req,
                                             ember::v1::SetTrainersResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->trainers() < 1 || req->trainers() > planner::kMaxTrainingRanks) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat(
        "trainers must be in [1, ", planner::kMaxTrainingRanks, "], got ", req->trainers())));
  }
  if (req->from_step() < 0) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("from_step must be >= 0, got ", req->from_step())));
  }
  absl::MutexLock create(&create_mu_);  // no create, drop or move meanwhile
  CollectionInfo info;
  std::vector<std::string> ids;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(req->collection());
    if (it == collections_.end()) {
      return ToGrpc(absl::NotFoundError(absl::StrCat("no collection '", req->collection(), "'")));
    }
    info = it->second;
    ids = rank_ids_[req->collection()];
  }
  if (info.spec().training().mode() == ember::v1::TrainingSpec::ASYNC) {
    return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
        "collection '", req->collection(), "' trains ASYNC: it counts no trainers")));
  }
  info.mutable_spec()->mutable_training()->set_trainers(req->trainers());
  if (absl::Status s = Register(info, ids); !s.ok()) return ToGrpc(s);
  CrashPoint("set_trainers_stored");  // stored, not yet on the workers
  ember::v1::UpdateTrainingRequest u;
  u.set_collection(req->collection());
  u.set_epoch(info.plan().epoch());
  u.set_trainers(req->trainers());
  u.set_from_step(req->from_step());
  const std::vector<std::string> addresses(info.worker_addresses().begin(),
                                           info.worker_addresses().end());
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::UpdateTrainingRequest, ember::v1::UpdateTrainingResponse>(
          addresses, std::vector<ember::v1::UpdateTrainingRequest>(addresses.size(), u),
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->UpdateTraining(ctx, request, response, std::move(done));
          });
  for (size_t r = 0; r < addresses.size(); ++r) {
    if (statuses[r].ok()) continue;
    return ToGrpc(FromGrpc(statuses[r],
                           absl::StrCat("setting ", req->trainers(), " trainer(s) from step ",
                                        req->from_step(), " on worker ", r, " (",
                                        addresses[r], "); the same call again finishes it")));
  }
  LOG(INFO) << "collection '" << req->collection() << "': " << req->trainers()
            << " trainer(s) from step " << req->from_step();
  *resp->mutable_collection() = std::move(info);
  return grpc::Status::OK;
}

}  // namespace coordinator
}  // namespace ember
