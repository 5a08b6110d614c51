// WorkerService's shard bookkeeping: the collections and shards it holds,
// CreateShards / UpdateShards / DropShards (epochs, memory, retries), and
// the ShardStatus report. The data plane is worker_service.cc; rows in and
// out (export, import, checkpoints) are worker_rows.cc.
#include <algorithm>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/backend/table_spec.h"
#include "server/common/grpc_util.h"
#include "server/worker/shard_names.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {

using ember::v1::ShardRef;

namespace {

// The same shard: every field alike, the compute kernel compared as the
// worker serves it ("" is "fused": a shard created by a coordinator from
// before ShardAssignment.compute_kernel).
bool SameAssignment(const ember::v1::ShardAssignment& held, const ember::v1::ShardAssignment& a) {
  auto kernel = [](const std::string& k) { return k.empty() ? std::string("fused") : k; };
  if (kernel(held.compute_kernel()) != kernel(a.compute_kernel())) return false;
  google::protobuf::util::MessageDifferencer d;
  d.IgnoreField(ember::v1::ShardAssignment::descriptor()->FindFieldByName("compute_kernel"));
  // A shard's part in its replication is not its identity: a move to a new
  // epoch may promote it or give it other backups (UpdateShards adopts it).
  d.IgnoreField(ember::v1::ShardAssignment::descriptor()->FindFieldByName("replication"));
  return d.Compare(held, a);
}

}  // namespace

// True when a CreateShards retried at the held (or staged) epoch asks for
// exactly the shards held (or staged).
bool WorkerService::SameAssignments(
    const std::map<std::pair<std::string, int32_t>, ShardEntry>& held,
    const ember::v1::CreateShardsRequest& req) {
  if (held.size() != static_cast<size_t>(req.shards_size())) return false;
  for (const auto& a : req.shards()) {
    auto it = held.find({a.ref().table(), a.ref().shard_index()});
    if (it == held.end() || !SameAssignment(it->second.assignment, a)) {
      return false;
    }
  }
  return true;
}

absl::StatusOr<WorkerService::Collection*> WorkerService::HeldCollection(
    const std::string& name) const {
  auto it = collections_.find(name);
  if (it == collections_.end()) {
    return absl::NotFoundError(absl::StrCat("no collection '", name, "' on this worker"));
  }
  return it->second.get();
}

absl::StatusOr<WorkerService::Collection*> WorkerService::FindCollection(const std::string& name,
                                                                         int64_t epoch) const {
  auto c = HeldCollection(name);
  if (!c.ok()) return c;
  if (epoch != (*c)->epoch) {
    return absl::FailedPreconditionError(
        absl::StrCat("stale epoch ", epoch, " for collection '", name, "': the plan is at epoch ",
                     (*c)->epoch, "; refresh the plan"));
  }
  return c;
}

bool WorkerService::TouchesDynamicTable(const Collection& c,
                                        const ember::v1::WorkerApplyGradientsRequest& req) const {
  for (const ember::v1::ShardGradient& g : req.gradients()) {
    auto shard = FindShard(c, g.feature().shard());
    if (shard.ok() && (*shard)->assignment.table().has_dynamic()) return true;
  }
  return false;
}

absl::StatusOr<const WorkerService::ShardEntry*> WorkerService::FindShard(
    const Collection& c, const ShardRef& ref) const {
  auto it = c.shards.find({ref.table(), ref.shard_index()});
  if (it == c.shards.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("no ", RefString(ref), " on this worker; refresh the plan"));
  }
  return &it->second;
}

grpc::Status WorkerService::CreateShards(grpc::ServerContext* ctx,
                                         const ember::v1::CreateShardsRequest* req,
                                         ember::v1::CreateShardsResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (absl::Status s = CheckAssignments(req->collection(), req->epoch(), req->shards()); !s.ok()) {
    return ToGrpc(s);
  }
  if (req->staged()) return StageShards(*req);
  const std::string& name = req->collection();
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(name);
    if (it != collections_.end()) {
      if (it->second->epoch == req->epoch() && SameAssignments(it->second->shards, *req)) {
        return grpc::Status::OK;  // a retried create
      }
      return ToGrpc(absl::AlreadyExistsError(absl::StrCat(
          "collection '", name, "' is already held at epoch ", it->second->epoch,
          it->second->epoch == req->epoch() ? " with other shards" : "", "; drop it first")));
    }
    if (!creating_.insert(name).second) {
      return ToGrpc(absl::AbortedError(
          absl::StrCat("collection '", name, "' is being created by another call")));
    }
  }
  // Allocated and initialised unpublished, outside mu_: lookups and updates
  // of the other collections go on meanwhile.
  auto c = std::make_unique<Collection>();
  c->epoch = req->epoch();
  c->steps = MakeSteps(req->training());
  absl::Status s = AllocateShards(name, req->shards(), c.get());
  absl::MutexLock lock(&mu_);
  creating_.erase(name);
  if (!s.ok()) return ToGrpc(s);
  c->generation = next_generation_++;
  LOG(INFO) << "collection '" << name << "' epoch " << req->epoch() << ": " << c->shards.size()
            << " shard(s) created";
  collections_[name] = std::move(c);
  return grpc::Status::OK;
}

grpc::Status WorkerService::StageShards(const ember::v1::CreateShardsRequest& req) {
  const std::string& name = req.collection();
  int64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto c = HeldCollection(name);
    if (!c.ok()) {
      return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
          "staging needs collection '", name, "' held here; create it at epoch ", req.epoch(),
          " instead")));
    }
    if (req.epoch() <= (*c)->epoch) {
      return ToGrpc(absl::FailedPreconditionError(
          absl::StrCat("collection '", name, "' is held at epoch ", (*c)->epoch,
                       "; shards are staged for a later epoch, not ", req.epoch())));
    }
    if ((*c)->staged_epoch == req.epoch() && SameAssignments((*c)->staged, req)) {
      return grpc::Status::OK;  // a retried stage
    }
    if (!updating_.insert(name).second) {
      return ToGrpc(absl::AbortedError(
          absl::StrCat("collection '", name, "' is being updated by another call")));
    }
    generation = (*c)->generation;
  }
  // Allocated outside mu_, as UpdateShards' new shards are.
  Collection added;
  absl::Status s = AllocateShards(name, req.shards(), &added);
  absl::MutexLock lock(&mu_);
  updating_.erase(name);
  if (!s.ok()) return ToGrpc(s);
  auto c = HeldCollection(name);
  if (c.ok() && ((*c)->generation != generation || req.epoch() <= (*c)->epoch)) {
    c = absl::FailedPreconditionError(absl::StrCat(
        "collection '", name, "' was dropped, created again or moved on meanwhile"));
  }
  if (!c.ok()) {
    DropAll(name, added);
    return ToGrpc(c.status());
  }
  DropAll(name, (*c)->staged);  // an older (or other) stage gives way
  (*c)->staged = std::move(added.shards);
  (*c)->staged_epoch = req.epoch();
  LOG(INFO) << "collection '" << name << "' epoch " << (*c)->epoch << ": "
            << (*c)->staged.size() << " shard(s) staged for epoch " << req.epoch();
  return grpc::Status::OK;
}

absl::Status WorkerService::CheckAssignments(
    const std::string& collection, int64_t epoch,
    const google::protobuf::RepeatedPtrField<ember::v1::ShardAssignment>& shards) const {
  if (collection.empty()) return absl::InvalidArgumentError("collection name is empty");
  if (epoch <= 0) return absl::InvalidArgumentError(absl::StrCat("epoch must be > 0, got ", epoch));
  const std::vector<std::string> served = ServedComputeKernels();
  for (const auto& a : shards) {
    if (a.ref().table() != a.table().name()) {
      return absl::InvalidArgumentError(absl::StrCat(
          RefString(a.ref()), " carries the config of table '", a.table().name(), "'"));
    }
    if (!a.compute_kernel().empty() &&
        std::find(served.begin(), served.end(), a.compute_kernel()) == served.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          RefString(a.ref()), ": compute kernel '", a.compute_kernel().substr(0, 64),
          "' is not served by this worker (it serves ", absl::StrJoin(served, ", "), ")"));
    }
    if (a.col_offset() < 0 || a.cols() <= 0 ||
        a.col_offset() + a.cols() > a.table().embedding_dim()) {
      return absl::InvalidArgumentError(
          absl::StrCat(RefString(a.ref()), ": columns [", a.col_offset(), ", ",
                       a.col_offset() + a.cols(), ") are outside the table's ",
                       a.table().embedding_dim()));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerService::AllocateShards(
    const std::string& collection,
    const google::protobuf::RepeatedPtrField<ember::v1::ShardAssignment>& shards, Collection* c) {
  // Refused before anything is allocated when the shards cannot all fit:
  // in the backend's memory, and fused_uvm shards in its mapped host memory.
  int64_t need = 0, need_mapped = 0;
  int in_memory = 0, mapped = 0;
  auto add = [](int64_t* sum, int64_t bytes) {
    *sum = bytes > std::numeric_limits<int64_t>::max() - *sum ? std::numeric_limits<int64_t>::max()
                                                              : *sum + bytes;
  };
  for (const auto& a : shards) {
    const backend::ShardSpec spec = ShardSpecOf(a, options_.key_value_min_cache_rows);
    const int64_t device = backend::DeviceShardBytes(spec);
    add(&need, device);
    add(&need_mapped, backend::MappedShardBytes(spec));
    in_memory += device > 0 ? 1 : 0;
    mapped += spec.host_mapped ? 1 : 0;
  }
  if (const int64_t available = backend_->AvailableBytes(); need > available) {
    return absl::ResourceExhaustedError(
        absl::StrCat("collection '", collection, "': ", in_memory, " shard(s) need ", need,
                     " bytes; this worker has ", available, " free for shards"));
  }
  if (const int64_t available = backend_->AvailableMappedBytes(); need_mapped > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "collection '", collection, "': ", mapped,
        " fused_uvm(_caching) shard(s) need ", need_mapped,
        " bytes of host memory mapped into the GPU; this worker has ", available,
        " free for them"));
  }
  std::vector<std::pair<std::string, int32_t>> made;
  absl::Status failed;
  for (const auto& a : shards) {
    const backend::ShardSpec spec =
        ShardSpecOf(a, options_.key_value_min_cache_rows);
    auto key = std::make_pair(a.ref().table(), a.ref().shard_index());
    if (c->shards.count(key)) {
      failed = absl::InvalidArgumentError(absl::StrCat("duplicate ", RefString(a.ref())));
      break;
    }
    auto id = backend_->CreateShard(spec);
    if (!id.ok()) {
      failed = absl::Status(id.status().code(),
                            absl::StrCat(RefString(a.ref()), ": ", id.status().message()));
      break;
    }
    c->shards[key] = ShardEntry{*id, a};
    made.push_back(key);
  }
  if (!failed.ok()) {  // all or nothing
    for (const auto& key : made) {
      (void)backend_->DropShard(c->shards[key].id);
      c->shards.erase(key);
    }
  }
  return failed;
}

void WorkerService::DropAll(const std::string& collection, const Collection& c) {
  DropAll(collection, c.shards);
  DropAll(collection, c.staged);
}

void WorkerService::DropAll(const std::string& collection,
                            const std::map<std::pair<std::string, int32_t>, ShardEntry>& shards) {
  for (const auto& [key, entry] : shards) {
    if (absl::Status s = backend_->DropShard(entry.id); !s.ok()) {
      LOG(ERROR) << "dropping " << RefString(entry.assignment.ref()) << " of '" << collection
                 << "': " << s;
    }
  }
}

WorkerService::CollectionMap::iterator WorkerService::EraseCollection(
    CollectionMap::iterator it) {
  {
    absl::MutexLock apply(it->second->apply_mu.get());  // let an update in flight finish
    DropAll(it->first, *it->second);
    it->second->steps->AbortAll(absl::FailedPreconditionError(absl::StrCat(
        "collection '", it->first, "' was dropped on this worker while a step was held; "
        "refresh the plan")));
    RetireSteps(*it->second->steps);
  }
  return collections_.erase(it);
}

grpc::Status WorkerService::UpdateShards(grpc::ServerContext* ctx,
                                         const ember::v1::UpdateShardsRequest* req,
                                         ember::v1::UpdateShardsResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (absl::Status s = CheckAssignments(req->collection(), req->epoch(), req->create()); !s.ok()) {
    return ToGrpc(s);
  }
  const std::string& name = req->collection();
  CancelForwards(*req);  // before mu_, which a forward's primary holds
  auto placed = absl::MakeCleanup([this, req] { PlacedForwards(*req); });
  // Which shards are new: held ones with the same assignment stay (a
  // retry), staged ones for this epoch with the same assignment are adopted
  // (replacing a held one of the same ref: a re-cut shard), another
  // assignment for a held shard is refused.
  google::protobuf::RepeatedPtrField<ember::v1::ShardAssignment> create;
  std::vector<std::pair<std::string, int32_t>> adopt;
  int64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto c = HeldCollection(name);
    if (!c.ok()) return ToGrpc(c.status());
    generation = (*c)->generation;
    if (req->epoch() < (*c)->epoch) {
      return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
          "collection '", name, "' is held at epoch ", (*c)->epoch, ", newer than ", req->epoch())));
    }
    for (const auto& a : req->create()) {
      const std::pair<std::string, int32_t> key{a.ref().table(), a.ref().shard_index()};
      if ((*c)->staged_epoch == req->epoch()) {
        auto st = (*c)->staged.find(key);
        if (st != (*c)->staged.end() && SameAssignment(st->second.assignment, a)) {
          adopt.push_back(key);
          continue;
        }
      }
      auto it = (*c)->shards.find(key);
      if (it == (*c)->shards.end()) {
        if (req->require_staged()) {
          return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
              RefString(a.ref()), " is neither held nor staged for epoch ", req->epoch(),
              " (with the same assignment); the move must start again")));
        }
        *create.Add() = a;
      } else if (!SameAssignment(it->second.assignment, a)) {
        return ToGrpc(absl::AlreadyExistsError(
            absl::StrCat(RefString(a.ref()), " is held with another assignment")));
      }
    }
    if (!updating_.insert(name).second) {
      return ToGrpc(absl::AbortedError(
          absl::StrCat("collection '", name, "' is being updated by another call")));
    }
  }
  // The new shards, allocated and initialised outside mu_ (all or nothing),
  // then published with the new epoch.
  Collection added;
  absl::Status s = AllocateShards(name, create, &added);
  absl::MutexLock lock(&mu_);
  updating_.erase(name);
  if (!s.ok()) return ToGrpc(s);
  auto c = HeldCollection(name);
  if (c.ok() && (*c)->generation != generation) {
    c = absl::FailedPreconditionError(
        absl::StrCat("collection '", name, "' was dropped and created again meanwhile"));
  } else if (c.ok() && req->epoch() < (*c)->epoch) {
    c = absl::FailedPreconditionError(absl::StrCat(
        "collection '", name, "' is held at epoch ", (*c)->epoch, ", newer than ", req->epoch()));
  }
  if (c.ok() && !adopt.empty()) {
    for (const auto& key : adopt) {
      if ((*c)->staged_epoch != req->epoch() || !(*c)->staged.count(key)) {
        c = absl::FailedPreconditionError(absl::StrCat(
            "the shards of collection '", name, "' staged for epoch ", req->epoch(),
            " were dropped meanwhile"));
        break;
      }
    }
  }
  if (!c.ok()) {  // dropped or moved on meanwhile
    DropAll(name, added);
    return ToGrpc(c.status());
  }
  Collection& coll = **c;
  absl::MutexLock apply(coll.apply_mu.get());
  // The shards held before, and the primary each backed ("": its own);
  // an adopted stage replaces a held shard's rows: new here.
  std::map<std::pair<std::string, int32_t>, std::string> backed;
  for (const auto& [key, entry] : coll.shards) {
    backed[key] = entry.assignment.replication().primary();
  }
  for (const auto& key : adopt) backed.erase(key);
  for (auto& [key, entry] : added.shards) coll.shards.emplace(key, std::move(entry));
  // Staged shards: at their epoch those named come into service (a held
  // shard of the same ref gives way) and the rest are dropped; a move to a
  // later epoch drops them all, an earlier one (a live move's fence) keeps
  // them.
  for (const auto& key : adopt) {
    auto held = coll.shards.find(key);
    if (held != coll.shards.end()) {
      if (absl::Status d = backend_->DropShard(held->second.id); !d.ok()) {
        LOG(ERROR) << "dropping the replaced " << RefString(held->second.assignment.ref())
                   << " of '" << name << "': " << d;
      }
      coll.shards.erase(held);
    }
    coll.shards.emplace(key, std::move(coll.staged.at(key)));
    coll.staged.erase(key);
  }
  if (coll.staged_epoch != 0 && req->epoch() >= coll.staged_epoch) {
    DropAll(name, coll.staged);
    coll.staged.clear();
    coll.staged_epoch = 0;
  }
  // Every shard named takes its part in the replication from the request
  // (a held one too: a backup promoted, a primary with new backups).
  for (const auto& a : req->create()) {
    auto it = coll.shards.find({a.ref().table(), a.ref().shard_index()});
    if (it != coll.shards.end()) *it->second.assignment.mutable_replication() = a.replication();
  }
  // `exact`: the held shards are those named, no other.
  int dropped = 0;
  if (req->exact()) {
    std::set<std::pair<std::string, int32_t>> named;
    for (const auto& a : req->create()) named.insert({a.ref().table(), a.ref().shard_index()});
    for (auto it = coll.shards.begin(); it != coll.shards.end();) {
      if (named.count(it->first)) {
        ++it;
        continue;
      }
      if (absl::Status d = backend_->DropShard(it->second.id); !d.ok()) {
        LOG(ERROR) << "dropping " << RefString(it->second.assignment.ref()) << " of '" << name
                   << "': " << d;
      }
      it = coll.shards.erase(it);
      ++dropped;
    }
  }
  if (req->epoch() != coll.epoch) {
    // A new epoch re-forms the copies: a forward that failed at the old one
    // no longer stops updates.
    coll.broken_backup.clear();
    coll.broken_why.clear();
    // SYNC steps held at the old epoch are dropped: their trainers refresh
    // the plan and send them again to the new one. BOUNDED ones were
    // acknowledged: the new barrier takes them over, with those a promoted
    // backup's dead primary held (CarryBoundedSteps).
    const absl::Status moved = absl::FailedPreconditionError(
        absl::StrCat("collection '", name, "' moved to epoch ", req->epoch(),
                     " while a step was held; refresh the plan and send the step again"));
    std::optional<StepBarrier::Carried> carried;
    if (coll.steps->options().mode == ember::v1::TrainingSpec::BOUNDED &&
        req->training().mode() == ember::v1::TrainingSpec::BOUNDED) {
      carried = CarryBoundedSteps(coll, backed, moved);
    } else {
      coll.steps->AbortAll(moved);
    }
    // A SYNC step every shard here had applied stays applied: a rank that
    // sends it again (its answer lost with a dead primary whose backup
    // this worker now is) is answered as a retry, not held for ranks that
    // have moved on.
    const auto seed = req->training().mode() == ember::v1::TrainingSpec::SYNC
                          ? SeedOf(coll, backed)
                          : std::nullopt;
    RetireSteps(*coll.steps);
    coll.steps = MakeSteps(req->training());
    if (seed.has_value()) coll.steps->Seed(seed->first, seed->second);
    if (carried.has_value()) coll.steps->Resume(*std::move(carried));
    auto next = std::make_shared<ForwardedSteps>();
    {
      absl::MutexLock lock(&coll.forwarded->mu);
      coll.forwarded->moved = absl::FailedPreconditionError(absl::StrCat(
          "collection '", name, "' moved to epoch ", req->epoch(),
          " while a lookup waited for its step; refresh the plan"));
      KeepHeldForNewPrimaries(coll, backed, *coll.forwarded, next.get());
    }
    coll.forwarded = std::move(next);
  }
  LOG(INFO) << "collection '" << name << "' epoch " << coll.epoch << " -> " << req->epoch() << ": "
            << create.size() << " shard(s) added, " << adopt.size() << " staged one(s) adopted, "
            << dropped << " dropped";
  coll.epoch = req->epoch();
  return grpc::Status::OK;
}

std::optional<std::pair<int64_t, StepBarrier::RankDigests>> WorkerService::SeedOf(
    const Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed) {
  const auto own = c.steps->LastApplied();
  absl::MutexLock lock(&c.forwarded->mu);
  std::optional<std::pair<int64_t, StepBarrier::RankDigests>> seed;
  for (const auto& [key, entry] : c.shards) {
    if (!entry.assignment.replication().primary().empty()) continue;  // a backup: not stepped here
    auto b = backed.find(key);
    if (b == backed.end()) return std::nullopt;  // new here: its steps unknown
    std::optional<std::pair<int64_t, StepBarrier::RankDigests>> at = own;
    if (!b->second.empty()) {  // a backup promoted: the steps its primary forwarded
      auto t = c.forwarded->through.find(b->second);
      if (t == c.forwarded->through.end()) return std::nullopt;
      auto d = c.forwarded->digests.find(b->second);
      at = std::make_pair(t->second, d == c.forwarded->digests.end() ? StepBarrier::RankDigests()
                                                                     : d->second);
    }
    if (!at.has_value() || at->second.empty()) return std::nullopt;
    if (!seed.has_value() || at->first < seed->first) seed = at;
  }
  return seed;
}

namespace {

// Adds `part` (a rank's update held for `step`, or some of its parts) to
// `ranks`: a rank there already gets the parts added (one update, one
// digest; another is left out, logged).
void JoinParts(std::map<int32_t, Contribution>* ranks, int64_t step, Contribution part) {
  const int32_t rank = part.rank;
  auto [it, fresh] = ranks->try_emplace(rank, std::move(part));  // (not moved from if held)
  if (fresh) return;
  if (it->second.digest != part.digest) {
    LOG(ERROR) << "rank " << rank << "'s update held for step " << step
               << " differs between the copies; the first is kept";
    return;
  }
  for (HeldPart& p : part.parts) it->second.parts.push_back(std::move(p));
}

}  // namespace

StepBarrier::Carried WorkerService::CarryBoundedSteps(
    Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed,
    const absl::Status& why) {
  using Key = std::pair<std::string, int32_t>;
  using Held = std::map<int64_t, std::map<int32_t, Contribution>>;
  StepBarrier::Carried own = c.steps->CarryAndAbort(why);
  // The shards stepped here at the new epoch, by where their steps were
  // held: "" this worker's barrier, else the primary whose backups were
  // promoted here. A shard new here has no step held anywhere (a move
  // copies rows after its fence).
  std::map<std::string, std::set<Key>> shards_of;
  for (const auto& [key, entry] : c.shards) {
    if (!entry.assignment.replication().primary().empty()) continue;  // a backup
    auto b = backed.find(key);
    if (b != backed.end()) shards_of[b->second].insert(key);
  }
  struct Source {
    std::optional<int64_t> applied;  // the last step applied to its shards
    const Held* held;
    const std::set<Key>* shards;
  };
  static const Held kNone;
  absl::MutexLock lock(&c.forwarded->mu);
  StepBarrier::Carried out;
  out.digests = own.digests;
  out.horizon = own.horizon;
  std::vector<Source> sources;
  for (const auto& [primary, shards] : shards_of) {
    Source src{std::nullopt, &kNone, &shards};
    if (primary.empty()) {
      src.applied = own.applied;
      src.held = &own.held;
    } else {
      auto t = c.forwarded->through.find(primary);
      if (t != c.forwarded->through.end()) {
        src.applied = t->second;
        auto d = c.forwarded->digests.find(primary);
        if (d != c.forwarded->digests.end()) out.digests.emplace(t->second, d->second);
      }
      auto h = c.forwarded->held.find(primary);
      if (h != c.forwarded->held.end()) src.held = &h->second;
    }
    sources.push_back(src);
  }
  // The new barrier goes on from the earliest step any source applied
  // (one that applied none known: from before its first held step); the
  // steps after it that others applied complete again with the shards'
  // applied request ids skipping what they applied.
  for (const Source& src : sources) {
    std::optional<int64_t> a = src.applied;
    for (auto it = src.held->begin(); !a.has_value() && it != src.held->end(); ++it) {
      if (!it->second.empty()) a = it->first - 1;
    }
    if (!a.has_value()) continue;
    out.applied = out.applied.has_value() ? std::min(*out.applied, *a) : *a;
    if (src.applied.has_value()) {
      out.horizon = out.horizon.has_value() ? std::max(*out.horizon, *src.applied) : *src.applied;
    }
  }
  // A rank's update held for a step: its parts for each source's shards,
  // joined (one update, one digest).
  for (const Source& src : sources) {
    for (const auto& [step, ranks] : *src.held) {
      if (out.applied.has_value() && step <= *out.applied) continue;
      for (const auto& [rank, held] : ranks) {
        JoinParts(&out.held[step], step, held.PartsOf(*src.shards));
      }
    }
  }
  // Held by some sources but not all (its trainer has not had it
  // acknowledged, and sends it again): partial.
  std::string held_ranks;
  for (auto& [step, ranks] : out.held) {
    absl::StrAppend(&held_ranks, " ", step, ":");
    for (auto& [rank, held] : ranks) {
      for (const Source& src : sources) {
        const bool applied = src.applied.has_value() && step <= *src.applied;
        auto at = src.held->find(step);
        if (!applied && (at == src.held->end() || !at->second.count(rank))) held.partial = true;
      }
      absl::StrAppend(&held_ranks, held.partial ? "~" : "", rank, ",");
    }
  }
  std::string from;
  for (const auto& [primary, shards] : shards_of) {
    absl::StrAppend(&from, from.empty() ? "" : "; ", primary.empty() ? "its own" : primary, " (",
                    shards.size(), " shard(s))");
  }
  LOG(INFO) << "BOUNDED steps carried to the new epoch from " << (from.empty() ? "none" : from)
            << ": applied through "
            << (out.applied.has_value() ? absl::StrCat(*out.applied) : std::string("none"))
            << ", horizon "
            << (out.horizon.has_value() ? absl::StrCat(*out.horizon) : std::string("none"))
            << ", held (step: ranks, ~ partial):" << (held_ranks.empty() ? " none" : held_ranks);
  return out;
}

void WorkerService::KeepHeldForNewPrimaries(
    const Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed,
    const ForwardedSteps& before, ForwardedSteps* after) {
  // (old primary, new primary) -> the shards backed here that went from one to the other.
  std::map<std::pair<std::string, std::string>, std::set<std::pair<std::string, int32_t>>> moved;
  for (const auto& [key, entry] : c.shards) {
    const std::string& now = entry.assignment.replication().primary();
    auto b = backed.find(key);
    if (now.empty() || b == backed.end() || b->second.empty() || b->second == now) continue;
    moved[{b->second, now}].insert(key);
  }
  for (const auto& [pair, shards] : moved) {
    auto held = before.held.find(pair.first);
    if (held == before.held.end()) continue;
    auto through = before.through.find(pair.first);
    for (const auto& [step, ranks] : held->second) {
      if (through != before.through.end() && step <= through->second) continue;
      for (const auto& [rank, contribution] : ranks) {
        JoinParts(&after->held[pair.second][step], step, contribution.PartsOf(shards));
      }
    }
  }
  after->held_bytes = 0;
  for (const auto& [primary, steps] : after->held) {
    for (const auto& [step, ranks] : steps) {
      for (const auto& [rank, contribution] : ranks) after->held_bytes += contribution.Bytes();
    }
  }
}

void WorkerService::RetireSteps(const StepBarrier& steps) {
  const StepBarrier::Stats st = steps.GetStats();
  retired_steps_applied_.fetch_add(st.steps_applied, std::memory_order_relaxed);
  retired_steps_aborted_.fetch_add(st.steps_aborted, std::memory_order_relaxed);
  retired_step_wait_ns_.fetch_add(st.wait_ns, std::memory_order_relaxed);
  retired_step_ranks_missing_.fetch_add(st.ranks_missing, std::memory_order_relaxed);
}

grpc::Status WorkerService::UpdateTraining(grpc::ServerContext* ctx,
                                           const ember::v1::UpdateTrainingRequest* req,
                                           ember::v1::UpdateTrainingResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  std::shared_ptr<StepBarrier> steps;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto c = FindCollection(req->collection(), req->epoch());
    if (!c.ok()) return ToGrpc(c.status());
    steps = (*c)->steps;
  }
  if (!steps->stepped()) {
    return ToGrpc(absl::FailedPreconditionError(absl::StrCat(
        "collection '", req->collection(), "' trains ASYNC: it counts no trainers")));
  }
  if (req->fence_query()) {
    resp->set_highest_step(steps->HighestStep());
    return grpc::Status::OK;
  }
  if (req->has_fence_at()) {
    resp->set_highest_step(steps->FenceAt(req->fence_at()));
    if (!req->fence_wait()) return grpc::Status::OK;
    const StepBarrier::ApplyFn kick = StepApplier(req->collection(), steps.get());
    const absl::Status waited =
        steps->WaitApplied(req->fence_at(), absl::Now() + steps->options().timeout, &kick);
    if (!waited.ok()) return ToGrpc(waited);
    LOG(INFO) << "collection '" << req->collection() << "': steps through " << req->fence_at()
              << " applied, later ones fenced for a move";
    return grpc::Status::OK;
  }
  absl::Status s = steps->SetTrainers(req->trainers(), req->from_step(),
                                      StepApplier(req->collection(), steps.get()));
  if (s.ok()) {
    LOG(INFO) << "collection '" << req->collection() << "': " << req->trainers()
              << " trainer(s) from step " << req->from_step();
  }
  return ToGrpc(s);
}

grpc::Status WorkerService::DropShards(grpc::ServerContext* ctx, const ember::v1::DropShardsRequest* req,
                                       ember::v1::DropShardsResponse*) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kCoordinator); !a.ok()) return a;
  if (req->epoch() <= 0) {
    return ToGrpc(absl::InvalidArgumentError(absl::StrCat("epoch must be > 0, got ", req->epoch())));
  }
  absl::MutexLock lock(&mu_);
  auto c = HeldCollection(req->collection());
  if (!c.ok()) return ToGrpc(c.status());
  if (req->staged()) {  // a live move gave up: its stage goes, the collection stays
    if ((*c)->staged_epoch == req->epoch()) {
      DropAll(req->collection(), (*c)->staged);
      LOG(INFO) << "collection '" << req->collection() << "': " << (*c)->staged.size()
                << " shard(s) staged for epoch " << req->epoch() << " dropped";
      (*c)->staged.clear();
      (*c)->staged_epoch = 0;
    }
    return grpc::Status::OK;
  }
  // A drop names the newest epoch its sender knows: a copy held at that
  // epoch or an older one goes; a newer one (a later create) stays.
  if ((*c)->epoch > req->epoch()) {
    return ToGrpc(absl::FailedPreconditionError(
        absl::StrCat("collection '", req->collection(), "' is held at epoch ", (*c)->epoch,
                     ", newer than ", req->epoch())));
  }
  EraseCollection(collections_.find(req->collection()));
  LOG(INFO) << "collection '" << req->collection() << "' epoch " << req->epoch() << " dropped";
  return grpc::Status::OK;
}

std::vector<WorkerService::TableStats> WorkerService::GetTableStats() const {
  std::map<std::pair<std::string, std::string>, TableStats> by_table;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, c] : collections_) {
    for (const auto& [key, entry] : c->shards) {
      TableStats& t = by_table[{name, key.first}];
      t.collection = name;
      t.table = key.first;
      ++t.shards;
      t.lookup_ids += entry.traffic->lookup_ids.load(std::memory_order_relaxed);
      t.gradient_ids += entry.traffic->gradient_ids.load(std::memory_order_relaxed);
      if (CachesRows(entry.assignment)) {
        if (auto k = backend_->GetTierStats(entry.id); k.ok()) {
          t.key_value = true;
          t.tier.cache_rows += k->cache_rows;
          t.tier.cached_rows += k->cached_rows;
          t.tier.hits += k->hits;
          t.tier.fills += k->fills;
          t.tier.prefetched += k->prefetched;
          t.tier.disk_reads += k->disk_reads;
          t.tier.write_backs += k->write_backs;
          t.tier.evictions += k->evictions;
          t.tier.file_bytes += k->file_bytes;
          // Each shard's curve is over its own rows, at the same fractions.
          t.tier.sampled += k->sampled;
          for (size_t i = 0; i < k->curve_hits.size(); ++i) {
            t.tier.curve_hits[i] += k->curve_hits[i];
          }
        }
      }
      if (!entry.assignment.table().has_dynamic()) continue;
      auto d = backend_->GetDynamicStats(entry.id);
      if (!d.ok()) continue;
      t.dynamic = true;
      backend::DynamicStats& sum = t.dyn;
      sum.capacity += d->capacity;
      sum.rows_held += d->rows_held;
      sum.steps = std::max(sum.steps, d->steps);
      sum.admitted += d->admitted;
      sum.imported += d->imported;
      sum.evicted_ttl += d->evicted_ttl;
      sum.evicted_lru += d->evicted_lru;
      sum.evicted_lfu += d->evicted_lfu;
      sum.evicted_import += d->evicted_import;
      sum.dropped_pending += d->dropped_pending;
      sum.dropped_no_room += d->dropped_no_room;
      sum.pending_ids += d->pending_ids;
      sum.sketch_counts += d->sketch_counts;
      sum.index_slots += d->index_slots;
    }
  }
  std::vector<TableStats> out;
  for (auto& [key, t] : by_table) out.push_back(std::move(t));
  return out;
}

WorkerService::Stats WorkerService::GetStats() const {
  Stats s;
  s.lookups = lookups_.load(std::memory_order_relaxed);
  s.prefetches = prefetches_.load(std::memory_order_relaxed);
  s.prefetch_ids = prefetch_ids_.load(std::memory_order_relaxed);
  s.lookup_ids = lookup_ids_.load(std::memory_order_relaxed);
  s.lookup_bytes = lookup_bytes_.load(std::memory_order_relaxed);
  s.updates = updates_.load(std::memory_order_relaxed);
  s.update_ids = update_ids_.load(std::memory_order_relaxed);
  s.duplicates = duplicates_.load(std::memory_order_relaxed);
  s.nonfinite_refused = nonfinite_refused_.load(std::memory_order_relaxed);
  s.nonfinite_skipped_ids = nonfinite_skipped_ids_.load(std::memory_order_relaxed);
  s.dedup_forgotten_early = dedup_forgotten_early_.load(std::memory_order_relaxed);
  s.overflow_skipped_rows = backend_->OverflowSkippedRows();
  s.overflow_refused = overflow_refused_.load(std::memory_order_relaxed);
  s.available_bytes = backend_->AvailableBytes();
  s.available_mapped_bytes = backend_->MapsHostMemory() ? backend_->AvailableMappedBytes() : 0;
  s.calls_in_progress = calls_in_progress_.load(std::memory_order_relaxed);
  s.busy_refused = busy_refused_.load(std::memory_order_relaxed);
  s.link_channels = channels_.link_channels();
  s.shm_channels = channels_.open_channels() - s.link_channels;
  s.link_lookups = link_lookups_.load(std::memory_order_relaxed);
  s.link_channels_opened = channels_.link_channels_opened();
  s.link_busy_kept = link_busy_kept_.load(std::memory_order_relaxed);
  s.placed_lookups = placed_lookups_.load(std::memory_order_relaxed);
  s.id_buffer_lookups = id_buffer_lookups_.load(std::memory_order_relaxed);
  s.backend_lookup_ns = backend_lookup_ns_.load(std::memory_order_relaxed);
  s.backend_update_ns = backend_update_ns_.load(std::memory_order_relaxed);
  s.forwards = forwards_.load(std::memory_order_relaxed);
  s.forward_ns = forward_ns_.load(std::memory_order_relaxed);
  s.forward_failures = forward_failures_.load(std::memory_order_relaxed);
  s.busy_forward_retries = busy_forward_retries_.load(std::memory_order_relaxed);
  absl::ReaderMutexLock lock(&mu_);  // retiring happens under it: no count seen twice or lost
  s.steps_applied = retired_steps_applied_.load(std::memory_order_relaxed);
  s.steps_aborted = retired_steps_aborted_.load(std::memory_order_relaxed);
  s.step_wait_ns = retired_step_wait_ns_.load(std::memory_order_relaxed);
  s.step_ranks_missing = retired_step_ranks_missing_.load(std::memory_order_relaxed);
  s.collections = static_cast<int64_t>(collections_.size());
  for (const auto& [name, c] : collections_) {
    s.shards += static_cast<int64_t>(c->shards.size());
    const StepBarrier::Stats st = c->steps->GetStats();  // added to the retired ones
    s.steps_applied += st.steps_applied;
    s.steps_aborted += st.steps_aborted;
    s.step_wait_ns += st.wait_ns;
    s.step_ranks_missing += st.ranks_missing;
    s.step_pending_bytes += st.pending_bytes;
    absl::MutexLock apply(c->apply_mu.get());  // the records change under it
    for (const auto& [key, entry] : c->shards) {
      s.request_ids += static_cast<int64_t>(entry.applied->size());
    }
  }
  return s;
}

grpc::Status WorkerService::ShardStatus(grpc::ServerContext* ctx, const ember::v1::ShardStatusRequest*,
                                        ember::v1::ShardStatusResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  absl::ReaderMutexLock lock(&mu_);
  resp->set_backend(backend_->Name());
  resp->set_nonfinite_refused(nonfinite_refused_.load(std::memory_order_relaxed));
  resp->set_nonfinite_skipped_ids(nonfinite_skipped_ids_.load(std::memory_order_relaxed));
  resp->set_overflow_refused(overflow_refused_.load(std::memory_order_relaxed));
  resp->set_overflow_skipped_rows(backend_->OverflowSkippedRows());
  resp->set_available_bytes(backend_->AvailableBytes());
  if (backend_->MapsHostMemory()) resp->set_available_mapped_bytes(backend_->AvailableMappedBytes());
  resp->set_dedup_forgotten_early(dedup_forgotten_early_.load(std::memory_order_relaxed));
  resp->set_lookups(lookups_.load(std::memory_order_relaxed));
  resp->set_lookup_ids(lookup_ids_.load(std::memory_order_relaxed));
  resp->set_updates(updates_.load(std::memory_order_relaxed));
  resp->set_busy_refused(busy_refused_.load(std::memory_order_relaxed));
  const int links = channels_.link_channels();
  resp->set_shm_channels(channels_.open_channels() - links);
  resp->set_link_channels(links);
  resp->set_link_lookups(link_lookups_.load(std::memory_order_relaxed));
  resp->set_link_channels_opened(channels_.link_channels_opened());
  resp->set_link_busy_kept(link_busy_kept_.load(std::memory_order_relaxed));
  resp->set_placed_lookups(placed_lookups_.load(std::memory_order_relaxed));
  resp->set_id_buffer_lookups(id_buffer_lookups_.load(std::memory_order_relaxed));
  resp->set_backend_lookup_ns(backend_lookup_ns_.load(std::memory_order_relaxed));
  resp->set_lookup_handler_ns(lookup_handler_ns_.load(std::memory_order_relaxed));
  for (const auto& [name, c] : collections_) {
    for (const auto& [key, entry] : c->shards) {
      auto* info = resp->add_shards();
      info->set_collection(name);
      info->set_epoch(c->epoch);
      *info->mutable_shard() = entry.assignment.ref();
      info->set_row_offset(entry.assignment.row_offset());
      info->set_col_offset(entry.assignment.col_offset());
      info->set_rows(entry.assignment.rows());
      info->set_cols(entry.assignment.cols());
      auto step = backend_->ExportStep(entry.id);
      info->set_step(step.ok() ? *step : -1);
      if (CachesRows(entry.assignment)) {
        if (auto t = backend_->GetTierStats(entry.id); t.ok()) {
          info->set_lru_sampled(t->sampled);
          for (int64_t hits : t->curve_hits) info->add_lru_curve_hits(hits);
        }
      }
    }
  }
  return grpc::Status::OK;
}

}  // namespace worker
}  // namespace ember
