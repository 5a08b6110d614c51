#include "server/coordinator/coordinator_service.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "planner/planner.h"
#include "planner/spec_validation.h"
#include "server/backend/embedding_backend.h"
#include "server/backend/table_spec.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/replacement_policy.h"
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

absl::StatusOr<std::unique_ptr<CoordinatorService>> CoordinatorService::Create(
    const CoordinatorOptions& options) {
  std::unique_ptr<StateStore> store;
  StateStore::State state;
  if (!options.state_dir.empty()) {
    auto opened = StateStore::Open(options.state_dir);
    if (!opened.ok()) return opened.status();
    store = std::move(*opened);
    auto loaded = store->Load();
    if (!loaded.ok()) return loaded.status();
    state = std::move(*loaded);
  }
  std::unique_ptr<CoordinatorService> c(new CoordinatorService(options, std::move(store)));
  c->Load(state);
  return c;
}

void CoordinatorService::Load(const StateStore::State& state) {
  absl::MutexLock lock(&mu_);
  epoch_ = state.epoch;
  next_worker_ = state.next_worker;
  const absl::Time now = absl::Now();  // one lease to heartbeat again
  for (const auto& w : state.workers) {
    workers_[w.worker_id()] = Worker{w.worker_id(), w.info(), now, w.seq(), w.identity()};
  }
  for (const auto& c : state.collections) {
    collections_[c.info().spec().name()] = c.info();
    rank_ids_[c.info().spec().name()].assign(c.rank_worker_ids().begin(),
                                             c.rank_worker_ids().end());
    if (c.has_pending()) interrupted_[c.info().spec().name()] = c.pending();
  }
  catalogue_ = state.checkpoints;
  if (store_ != nullptr) {
    LOG(INFO) << "state from " << options_.state_dir << ": epoch " << epoch_ << ", "
              << workers_.size() << " worker(s), " << collections_.size() << " collection(s), "
              << catalogue_.size() << " checkpoint(s)";
    reconcile_pending_ = !workers_.empty();
  }
}

void CoordinatorService::Reconcile() {
  absl::MutexLock create(&create_mu_);
  // A move a previous run left under way: its placement if its data was in
  // place, else the old one (what is left over either way is dropped or
  // re-adopted below).
  std::map<std::string, ember::v1::StoredMove> interrupted;
  {
    absl::MutexLock lock(&mu_);
    interrupted.swap(interrupted_);
  }
  for (auto& [name, move] : interrupted) {
    if (move.data_in_place()) {
      LOG(WARNING) << "reconcile: '" << name << "' was moving to epoch "
                   << move.info().plan().epoch() << " with its data in place; adopting it";
      move.mutable_info()->set_state(CollectionInfo::SERVING);
      const std::vector<std::string> ids(move.rank_worker_ids().begin(),
                                         move.rank_worker_ids().end());
      (void)Register(move.info(), ids);
    } else {
      LOG(WARNING) << "reconcile: '" << name << "' was moving to epoch "
                   << move.info().plan().epoch() << " before its data was; keeping the old placement";
      CollectionInfo old;
      std::vector<std::string> ids;
      {
        absl::MutexLock lock(&mu_);
        old = collections_[name];
        ids = rank_ids_[name];
      }
      (void)Register(old, ids);  // clears the move from the store
    }
  }
  std::vector<Worker> live = LiveWorkers();
  std::map<std::string, CollectionInfo> collections;
  std::map<std::string, std::vector<std::string>> ids;
  {
    absl::MutexLock lock(&mu_);
    collections = collections_;
    ids = rank_ids_;
  }
  std::vector<std::string> addresses;
  for (const Worker& w : live) addresses.push_back(w.info.address());
  std::vector<ember::v1::ShardStatusResponse> held;
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::ShardStatusRequest, ember::v1::ShardStatusResponse>(
          addresses, std::vector<ember::v1::ShardStatusRequest>(addresses.size()),
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->ShardStatus(ctx, request, response, std::move(done));
          },
          absl::ZeroDuration(), &held);
  std::set<std::string> readopt;
  for (size_t i = 0; i < live.size(); ++i) {
    if (!statuses[i].ok()) continue;  // the lease decides about this one
    // What this worker holds: collection -> (epoch, shards).
    std::map<std::string, std::pair<int64_t, std::set<std::pair<std::string, int32_t>>>> here;
    for (const auto& sh : held[i].shards()) {
      auto& h = here[sh.collection()];
      h.first = sh.epoch();
      h.second.insert({sh.shard().table(), sh.shard().shard_index()});
    }
    for (const auto& [name, h] : here) {
      auto it = collections.find(name);
      std::vector<int> ranks;  // this worker's ranks of `name`
      if (it != collections.end()) {
        for (int r : planner::HoldingRanks(it->second.plan())) {
          if (r < static_cast<int>(ids[name].size()) && ids[name][r] == live[i].id) {
            ranks.push_back(r);
          }
        }
      }
      if (ranks.empty()) {  // unknown, or a leftover of an interrupted move
        LOG(WARNING) << "reconcile: worker " << live[i].id << " holds '" << name << "' at epoch "
                     << h.first << " where this coordinator places nothing; dropping it";
        (void)DropOnWorkers(name, h.first, {addresses[i]});
        continue;
      }
      for (int r : ranks) {
        bool complete = true;
        for (const auto& a : AssignmentsOf(it->second, r)) {
          complete = complete && h.second.count({a.ref().table(), a.ref().shard_index()});
        }
        if (!complete) {
          LOG(WARNING) << "reconcile: worker " << live[i].id << " lacks shards of '" << name
                       << "' rank " << r << "; recovering them";
          absl::MutexLock lock(&mu_);
          force_lost_[name].insert(r);
        } else if (h.first != it->second.plan().epoch()) {
          readopt.insert(name);  // an interrupted recovery or drain moved its epoch
        }
      }
    }
    // Collections this worker should hold and holds nothing of.
    for (const auto& [name, info] : collections) {
      if (here.count(name)) continue;
      const std::vector<std::string>& rank_ids = ids[name];
      for (int r : planner::HoldingRanks(info.plan())) {
        if (r < static_cast<int>(rank_ids.size()) && rank_ids[r] == live[i].id) {
          LOG(WARNING) << "reconcile: worker " << live[i].id << " lacks '" << name << "' rank "
                       << r << "; recovering it";
          absl::MutexLock lock(&mu_);
          force_lost_[name].insert(r);
        }
      }
    }
  }
  for (const std::string& name : readopt) {
    (void)ReadoptLocked(name, "epochs reconciled after a coordinator restart");
  }
}

CoordinatorService::CoordinatorService(const CoordinatorOptions& options,
                                       std::unique_ptr<StateStore> store)
    : options_(options), store_(std::move(store)) {
  if (options_.checkpoint_every > absl::ZeroDuration() && !options_.checkpoint_dir.empty()) {
    periodic_ = std::thread([this] { PeriodicCheckpoints(); });
  }
  monitor_ = std::thread([this] { MonitorLoop(); });
}

CoordinatorService::~CoordinatorService() {
  stop_.Notify();
  if (periodic_.joinable()) periodic_.join();
  if (monitor_.joinable()) monitor_.join();
}

grpc::Status CoordinatorService::RegisterWorker(grpc::ServerContext* ctx,
                                                const ember::v1::RegisterWorkerRequest* req,
                                                ember::v1::RegisterWorkerResponse* resp) {
  Caller caller;
  if (grpc::Status a = options_.auth.Check(ctx, Role::kWorker, &caller); !a.ok()) return a;
  const auto& info = req->worker();
  const size_t colon = info.address().rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == info.address().size()) {
    return ToGrpc(absl::InvalidArgumentError(
        absl::StrCat("worker address '", info.address(), "' is not host:port")));
  }
  if (info.device() != ember::v1::CPU && info.device() != ember::v1::CUDA) {
    return ToGrpc(absl::InvalidArgumentError("worker device must be CPU or CUDA"));
  }
  if (info.hbm_bytes() < 0 || info.ddr_bytes() < 0) {
    return ToGrpc(absl::InvalidArgumentError("worker capacities must be >= 0"));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  // A live worker keeps its address: another process claiming it (a
  // stranger, or a restart that came too soon) waits for the old lease to
  // lapse. The same process registering again (it was forgotten) is fine.
  // A worker credential (token mode) is one worker: a second process using
  // it elsewhere waits for the first one's lease to lapse too.
  const bool one_per_identity = options_.auth.enabled() && caller.role == Role::kWorker;
  for (const auto& [id, old] : workers_) {
    const bool live = now - old.last_heartbeat < options_.lease;
    const bool same_process = old.info.pid() == info.pid() && old.info.host() == info.host();
    if (old.info.address() == info.address() && live && !same_process) {
      return ToGrpc(absl::AlreadyExistsError(absl::StrCat(
          "a live worker (", id, ", pid ", old.info.pid(), " on ", old.info.host(),
          ") holds address ", info.address(), "; retry once its lease (",
          absl::FormatDuration(options_.lease), ") has lapsed")));
    }
    if (one_per_identity && old.identity == caller.identity && live &&
        old.info.address() != info.address()) {
      return ToGrpc(absl::AlreadyExistsError(absl::StrCat(
          "worker ", caller.identity, " is live as ", id, " at ", old.info.address(),
          "; one process per worker credential (retry once its lease (",
          absl::FormatDuration(options_.lease), ") has lapsed)")));
    }
  }
  Worker w;
  w.seq = next_worker_ + 1;
  w.id = absl::StrCat("w", w.seq);
  w.info = info;
  w.last_heartbeat = now;
  w.identity = caller.identity;
  // A worker restarted at the same address replaces its old entry (its
  // collections' shards are recovered onto it, see MonitorLoop); one under
  // another credential only adds an entry (the old one's shards are
  // recovered as a dead worker's).
  StateStore::Batch batch;
  std::vector<std::string> replaced;
  for (const auto& [id, old] : workers_) {
    if (old.info.address() == info.address() &&
        (old.identity == w.identity || old.identity.empty())) {
      replaced.push_back(id);
      batch.DeleteWorker(id);
    }
  }
  // At most as many workers as a plan can use: past that, the longest
  // silent one that no collection names makes room (as forget_workers_after
  // would later), or the registration is refused.
  if (replaced.empty() && workers_.size() >= static_cast<size_t>(planner::kMaxWorldSize)) {
    const std::set<std::string> named = NamedWorkersLocked();
    const Worker* oldest = nullptr;
    for (const auto& [id, old] : workers_) {
      if (now - old.last_heartbeat < options_.lease || named.count(id)) continue;
      if (oldest == nullptr || old.last_heartbeat < oldest->last_heartbeat) oldest = &old;
    }
    if (oldest == nullptr) {
      return ToGrpc(absl::ResourceExhaustedError(absl::StrCat(
          workers_.size(), " workers are registered, the most a plan can use (",
          planner::kMaxWorldSize, "), and each is live or holds shards")));
    }
    replaced.push_back(oldest->id);
    batch.DeleteWorker(oldest->id);
  }
  ember::v1::StoredWorker stored;
  stored.set_worker_id(w.id);
  *stored.mutable_info() = info;
  stored.set_seq(w.seq);
  stored.set_identity(w.identity);
  if (absl::Status s = Persist(batch.PutWorker(stored).NextWorker(w.seq)); !s.ok()) {
    return ToGrpc(s);
  }
  for (const std::string& id : replaced) workers_.erase(id);
  next_worker_ = w.seq;
  workers_[w.id] = w;
  resp->set_worker_id(w.id);
  resp->set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
  LOG(INFO) << "worker " << w.id << " registered at " << info.address() << " (host "
            << info.host() << ")";
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx,
                                           const ember::v1::HeartbeatRequest* req,
                                           ember::v1::HeartbeatResponse* resp) {
  Caller caller;
  if (grpc::Status a = options_.auth.Check(ctx, Role::kWorker, &caller); !a.ok()) return a;
  if (req->worker_id().empty()) return ToGrpc(absl::InvalidArgumentError("worker_id is empty"));
  if (grpc::Status a = MayActFor(caller, req->worker_id()); !a.ok()) return a;
  // A worker back from a pause learns what it still holds. Answered under
  // create_mu_, so that no recovery of its shards is half done: either its
  // ranks moved (and it is told to drop them) or its heartbeat keeps them.
  // Never waited for (a restore holds it for minutes, and a handler thread
  // per heartbeat would pile up): the worker, serving nothing meanwhile,
  // asks again next round.
  if (req->after_pause() && !create_mu_.TryLock()) {
    return ToGrpc(absl::UnavailableError(
        "the coordinator is creating, dropping or moving shards; heartbeat again"));
  }
  struct Unlock {
    absl::Mutex* mu;
    ~Unlock() {
      if (mu != nullptr) mu->Unlock();
    }
  } unlock{req->after_pause() ? &create_mu_ : nullptr};
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(req->worker_id());
  if (it == workers_.end()) {
    return ToGrpc(absl::NotFoundError(
        absl::StrCat("unknown worker id '", req->worker_id(), "'; register again")));
  }
  it->second.last_heartbeat = absl::Now();
  resp->set_lease_ms(absl::ToInt64Milliseconds(options_.lease));
  if (req->after_pause()) {
    for (const std::string& name : CollectionsOnLocked(req->worker_id())) {
      auto* h = resp->add_holds();
      h->set_collection(name);
      h->set_epoch(collections_[name].plan().epoch());
    }
    LOG(WARNING) << "worker " << req->worker_id() << " is back from a pause; it holds "
                 << resp->holds_size() << " collection(s)";
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListWorkers(grpc::ServerContext* ctx,
                                             const ember::v1::ListWorkersRequest*,
                                             ember::v1::ListWorkersResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<const Worker*> order;
  for (const auto& [id, w] : workers_) order.push_back(&w);
  std::sort(order.begin(), order.end(), [](const Worker* a, const Worker* b) { return a->seq < b->seq; });
  for (const Worker* w : order) {
    auto* s = resp->add_workers();
    s->set_worker_id(w->id);
    *s->mutable_info() = w->info;
    s->set_live(now - w->last_heartbeat < options_.lease);
    s->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - w->last_heartbeat));
  }
  return grpc::Status::OK;
}

CoordinatorService::Stats CoordinatorService::GetStats() const {
  Stats s;
  for (const char* state : {"SERVING", "DEGRADED", "RECOVERING"}) s.collections_by_state[state] = 0;
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (const auto& [id, w] : workers_) {
    (now - w.last_heartbeat < options_.lease ? s.workers_live : s.workers_lost) += 1;
  }
  for (const auto& [name, info] : collections_) {
    ++s.collections_by_state[ember::v1::CollectionInfo::State_Name(info.state())];
  }
  s.checkpoints_ok = checkpoint_stats_.checkpoints_ok;
  s.checkpoints_failed = checkpoint_stats_.checkpoints_failed;
  s.checkpoint_seconds = checkpoint_stats_.checkpoint_seconds;
  s.last_checkpoint_seconds = checkpoint_stats_.last_checkpoint_seconds;
  s.last_checkpoint_unix_seconds = checkpoint_stats_.last_checkpoint_unix_seconds;
  s.checkpoints = static_cast<int64_t>(catalogue_.size());
  return s;
}

std::vector<CoordinatorService::Worker> CoordinatorService::LiveWorkers() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<Worker> live;
  for (const auto& [id, w] : workers_) {
    if (now - w.last_heartbeat < options_.lease && !draining_.count(id)) live.push_back(w);
  }
  // Hosts in order of their first registration, then registration order:
  // each host's workers get consecutive ranks (TorchRec's local groups).
  std::map<std::string, int64_t> host_first;
  for (const Worker& w : live) {
    auto [it, inserted] = host_first.emplace(w.info.host(), w.seq);
    if (!inserted) it->second = std::min(it->second, w.seq);
  }
  std::sort(live.begin(), live.end(), [&](const Worker& a, const Worker& b) {
    const int64_t ha = host_first[a.info.host()], hb = host_first[b.info.host()];
    return ha != hb ? ha < hb : a.seq < b.seq;
  });
  return live;
}

ember::v1::Topology CoordinatorService::TopologyOf(const std::vector<Worker>& workers) {
  ember::v1::Topology t;
  t.set_world_size(static_cast<int>(workers.size()));
  bool all_cuda = !workers.empty();
  std::map<std::string, int> per_host;
  for (const Worker& w : workers) {
    all_cuda = all_cuda && w.info.device() == ember::v1::CUDA;
    ++per_host[w.info.host()];
  }
  t.set_compute_device(all_cuda ? ember::v1::CUDA : ember::v1::CPU);
  // The planner's host groups are uniform; uneven hosts plan as one group.
  int local = per_host.empty() ? 0 : per_host.begin()->second;
  for (const auto& [host, n] : per_host) {
    if (n != local) local = t.world_size();
  }
  t.set_local_world_size(local);
  for (size_t r = 0; r < workers.size(); ++r) {
    const auto& info = workers[r].info;
    if (info.hbm_bytes() == 0 && info.ddr_bytes() == 0) continue;
    auto* d = t.add_devices();
    d->set_rank(static_cast<int>(r));
    d->set_hbm_bytes(info.hbm_bytes());
    d->set_ddr_bytes(info.ddr_bytes());
  }
  return t;
}

// Calls `rpc` on every address at once (gRPC's async callback API) and waits
// for all; returns one status per address.
template <typename Request, typename Response, typename Rpc>
std::vector<grpc::Status> CoordinatorService::CallEach(const std::vector<std::string>& addresses,
                                                       const std::vector<Request>& requests,
                                                       Rpc rpc, absl::Duration timeout,
                                                       std::vector<Response>* responses_out) {
  const size_t n = addresses.size();
  std::vector<grpc::ClientContext> contexts(n);
  std::vector<Response> own;
  std::vector<Response>& responses = responses_out != nullptr ? *responses_out : own;
  responses.assign(n, Response());
  std::vector<grpc::Status> statuses(n);
  absl::BlockingCounter pending(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    SetDeadline(&contexts[i], timeout == absl::ZeroDuration() ? options_.worker_rpc_timeout : timeout);
    AddToken(&contexts[i], CredentialFor(addresses[i]));
    rpc(StubFor(addresses[i])->async(), &contexts[i], &requests[i], &responses[i],
        [&statuses, &pending, i](grpc::Status s) {
          statuses[i] = std::move(s);
          pending.DecrementCount();
        });
  }
  pending.Wait();
  return statuses;
}

ember::v1::Worker::Stub* CoordinatorService::StubFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (!stub) stub = ember::v1::Worker::NewStub(MakeChannel(address, options_.worker_credentials));
  return stub.get();
}

std::string CoordinatorService::CredentialFor(const std::string& address) const {
  if (!options_.auth.enabled()) return "";
  absl::MutexLock lock(&mu_);
  const Worker* latest = nullptr;
  for (const auto& [id, w] : workers_) {
    if (w.info.address() == address && (latest == nullptr || w.seq > latest->seq)) latest = &w;
  }
  if (latest == nullptr || latest->identity.empty()) return "";
  return options_.auth.CoordinatorTokenFor(latest->identity);
}

grpc::Status CoordinatorService::MayActFor(const Caller& caller,
                                           const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.identity == caller.identity) return grpc::Status::OK;
  if (options_.auth.enabled()) {
    if (caller.role == Role::kAdmin) return grpc::Status::OK;
  } else {
    // No roles (open or mutual-TLS-only mode): a certificate that
    // registered a worker acts only as that worker; any other caller is an
    // operator.
    bool a_workers = false;
    for (const auto& [id, w] : workers_) a_workers = a_workers || w.identity == caller.identity;
    if (caller.identity.empty() || !a_workers) return grpc::Status::OK;
  }
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat("worker ", caller.identity.empty() ? "(unnamed)" : caller.identity,
                   " may act only as itself; ", worker_id, " is another worker"));
}

std::vector<std::string> CoordinatorService::CollectionsOnLocked(
    const std::string& worker_id) const {
  std::vector<std::string> names;
  for (const auto& [name, ids] : rank_ids_) {
    auto info = collections_.find(name);
    if (info == collections_.end()) continue;
    for (int r : planner::HoldingRanks(info->second.plan())) {
      if (r < static_cast<int>(ids.size()) && ids[r] == worker_id) {
        names.push_back(name);
        break;
      }
    }
  }
  return names;
}

std::set<std::string> CoordinatorService::NamedWorkersLocked() const {
  std::set<std::string> named;
  for (const auto& [name, ids] : rank_ids_) named.insert(ids.begin(), ids.end());
  return named;
}

absl::Status CoordinatorService::DropOnWorkers(const std::string& collection, int64_t epoch,
                                               const std::vector<std::string>& addresses) {
  ember::v1::DropShardsRequest req;
  req.set_collection(collection);
  req.set_epoch(epoch);
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

  CollectionInfo info;
  *info.mutable_spec() = spec;
  *info.mutable_plan() = *std::move(plan);
  info.set_created_epoch(epoch);
  // Shard assignments per rank.
  const int world = static_cast<int>(workers.size());
  std::vector<ember::v1::CreateShardsRequest> per_rank(world);
  for (int r = 0; r < world; ++r) {
    per_rank[r].set_collection(spec.name());
    per_rank[r].set_epoch(epoch);
    for (ShardAssignment& a : AssignmentsOf(info, r)) *per_rank[r].add_shards() = std::move(a);
  }
  std::vector<std::string> addresses;
  for (const Worker& w : workers) addresses.push_back(w.info.address());
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
  for (const std::string& a : addresses) info.add_worker_addresses(a);
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

absl::StatusOr<ember::v1::CheckpointInfo> CoordinatorService::CheckpointCollection(
    const std::string& collection, const std::string& root) {
  const absl::Time start = absl::Now();
  auto info = WriteCollectionCheckpoint(collection, root);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (absl::IsNotFound(info.status())) return info;  // no such collection: nothing was written
  absl::MutexLock lock(&mu_);
  Stats& s = checkpoint_stats_;
  (info.ok() ? s.checkpoints_ok : s.checkpoints_failed) += 1;
  s.checkpoint_seconds += seconds;
  s.last_checkpoint_seconds = seconds;
  if (info.ok()) s.last_checkpoint_unix_seconds = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  return info;
}

absl::StatusOr<ember::v1::CheckpointInfo> CoordinatorService::WriteCollectionCheckpoint(
    const std::string& collection, const std::string& requested_root) {
  {
    absl::MutexLock lock(&mu_);
    if (!collections_.count(collection)) {
      return absl::NotFoundError(absl::StrCat("no collection '", collection, "'"));
    }
  }
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "no checkpoint directory: start the coordinator with --checkpoint_dir (checkpoints are "
        "written under it)");
  }
  auto confined = checkpoint::ConfinedPath(options_.checkpoint_dir, requested_root);
  if (!confined.ok()) return confined.status();
  const std::string root = *confined;
  absl::MutexLock one_at_a_time(&checkpoint_mu_);
  CollectionInfo info;
  {
    absl::MutexLock lock(&mu_);
    auto it = collections_.find(collection);
    if (it == collections_.end()) {
      return absl::NotFoundError(absl::StrCat("no collection '", collection, "'"));
    }
    info = it->second;
  }
  const absl::Time start = absl::Now();
  const int64_t epoch = info.plan().epoch();
  auto dir = checkpoint::MakeCheckpointDir(root, collection, epoch, absl::ToUnixMillis(start));
  if (!dir.ok()) return dir.status();

  // Each shard is written by the worker holding it; a data-parallel table
  // by its first replica only.
  const int world = info.worker_addresses_size();
  std::vector<ember::v1::WriteCheckpointRequest> per_rank(world);
  for (auto& r : per_rank) {
    r.set_collection(collection);
    r.set_epoch(epoch);
    r.set_dir(*dir);
  }
  for (const auto& ts : info.plan().tables()) {
    for (const planner::PlacedBlock& b : planner::TableBlocks(ts, 0, 0)) {
      if (!b.Held()) continue;
      auto* ref = per_rank[b.rank].add_shards();
      ref->set_table(ts.table());
      ref->set_shard_index(b.index);
      if (b.replica) break;  // a replicated table is written once, from its first replica
    }
  }
  // Only ranks with something to write are called (a dead rank whose
  // shards moved elsewhere holds nothing).
  std::vector<std::string> addresses;
  std::vector<ember::v1::WriteCheckpointRequest> requests;
  for (int r = 0; r < world; ++r) {
    if (per_rank[r].shards_size() == 0) continue;
    addresses.push_back(info.worker_addresses(r));
    requests.push_back(std::move(per_rank[r]));
  }
  // Shown by ListCheckpoints while it is written (bytes: the files so far).
  {
    ember::v1::CheckpointInfo progress;
    progress.set_path(*dir);
    progress.set_collection(collection);
    progress.set_epoch(epoch);
    progress.set_created_unix_ms(absl::ToUnixMillis(start));
    progress.set_in_progress(true);
    for (const auto& r : requests) {
      for (const auto& ref : r.shards()) {
        const std::optional<ShardAssignment> a = AssignmentOf(info, ref);
        if (!a) continue;
        const backend::ShardSpec spec = ShardSpecFromTable(a->table(), a->row_offset(),
                                                           a->col_offset(), a->rows(), a->cols());
        progress.set_total_bytes(
            progress.total_bytes() +
            checkpoint::ShardFileBytes(spec.rows, spec.dim,
                                       backend::OptimizerStateWidth(spec.optimizer.type, spec.dim)));
      }
    }
    absl::MutexLock lock(&mu_);
    in_progress_[*dir] = progress;
  }
  struct Done {
    CoordinatorService* self;
    std::string dir;
    ~Done() {
      absl::MutexLock lock(&self->mu_);
      self->in_progress_.erase(dir);
    }
  } done{this, *dir};
  std::vector<ember::v1::WriteCheckpointResponse> responses;
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::WriteCheckpointRequest, ember::v1::WriteCheckpointResponse>(
          addresses, requests,
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->WriteCheckpoint(ctx, request, response, std::move(done));
          },
          options_.checkpoint_rpc_timeout, &responses);
  for (size_t r = 0; r < addresses.size(); ++r) {
    if (statuses[r].ok()) continue;
    if (absl::Status s = checkpoint::RemoveCheckpoint(*dir); !s.ok()) {
      LOG(WARNING) << "removing the failed checkpoint " << *dir << ": " << s;
    }
    return FromGrpc(statuses[r], absl::StrCat("checkpoint of '", collection, "' on worker ",
                                              addresses[r]));
  }
  ember::v1::CheckpointManifest manifest;
  manifest.set_format_version(checkpoint::kFormatVersion);
  ember::v1::CheckpointInfo* ci = manifest.mutable_info();
  ci->set_collection(collection);
  ci->set_epoch(epoch);
  ci->set_created_unix_ms(absl::ToUnixMillis(start));
  for (const auto& resp : responses) {
    for (const auto& shard : resp.shards()) {
      ci->set_bytes(ci->bytes() + shard.bytes());
      *manifest.add_shards() = shard;
    }
    ci->set_max_pause_ms(std::max(ci->max_pause_ms(), resp.pause_ms()));
    ci->set_write_ms(std::max(ci->write_ms(), resp.write_ms()));
  }
  ci->set_shards(manifest.shards_size());
  *manifest.mutable_spec() = info.spec();
  *manifest.mutable_plan() = info.plan();
  ci->set_total_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  if (absl::Status s = checkpoint::CommitManifest(*dir, manifest); !s.ok()) {
    (void)checkpoint::RemoveCheckpoint(*dir);
    return s;
  }
  ci->set_total_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
  ci->set_path(*dir);
  LOG(INFO) << "checkpoint of '" << collection << "' epoch " << epoch << " committed: " << *dir
            << ", " << ci->shards() << " shard(s), " << ci->bytes() << " bytes, pause "
            << ci->max_pause_ms() << " ms, total " << ci->total_ms() << " ms";

  // Keep the newest keep_checkpoints; remove what crashed writes left.
  std::set<std::string> removed;
  const std::vector<std::string> committed = checkpoint::ListCommitted(root, collection);
  for (size_t i = 0; i + std::max(options_.keep_checkpoints, 1) < committed.size(); ++i) {
    if (absl::Status s = checkpoint::RemoveCheckpoint(committed[i]); s.ok()) {
      removed.insert(committed[i]);
    } else {
      LOG(WARNING) << "removing old checkpoint " << committed[i] << ": " << s;
    }
  }
  for (const std::string& d : checkpoint::ListUncommitted(root, collection)) {
    if (d < *dir) (void)checkpoint::RemoveCheckpoint(d);
  }
  absl::MutexLock lock(&mu_);
  StateStore::Batch batch;
  batch.PutCheckpoint(*ci);
  for (const auto& c : catalogue_) {
    if (removed.count(c.path())) batch.DeleteCheckpoint(c);
  }
  if (absl::Status s = Persist(batch); !s.ok()) {
    LOG(ERROR) << "checkpoint " << *dir << " is committed but not in the state store: " << s;
  }
  catalogue_.erase(std::remove_if(catalogue_.begin(), catalogue_.end(),
                                  [&](const ember::v1::CheckpointInfo& c) {
                                    return removed.count(c.path()) > 0;
                                  }),
                   catalogue_.end());
  catalogue_.push_back(*ci);
  return *ci;
}

grpc::Status CoordinatorService::Checkpoint(grpc::ServerContext* ctx,
                                            const ember::v1::CheckpointRequest* req,
                                            ember::v1::CheckpointResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection name is empty"));
  }
  auto info = CheckpointCollection(req->collection(), req->dir());
  if (!info.ok()) return ToGrpc(info.status());
  *resp->mutable_checkpoint() = *std::move(info);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Restore(grpc::ServerContext* ctx, const ember::v1::RestoreRequest* req,
                                         ember::v1::RestoreResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->from().empty()) {
    return ToGrpc(absl::InvalidArgumentError("no checkpoint path given"));
  }
  auto from = checkpoint::ConfinedPath(options_.checkpoint_dir, req->from());
  if (!from.ok()) return ToGrpc(from.status());
  auto path = checkpoint::ResolveCheckpoint(*from);
  if (!path.ok()) return ToGrpc(path.status());
  // Every file is checked before anything is created.
  auto manifest = checkpoint::VerifyCheckpoint(*path);
  if (!manifest.ok()) return ToGrpc(manifest.status());
  if (absl::Status s = checkpoint::CheckCoverage(*manifest); !s.ok()) {
    return ToGrpc(absl::DataLossError(absl::StrCat(*path, ": ", s.message())));
  }
  ember::v1::CollectionSpec spec = manifest->spec();
  if (!req->collection().empty()) spec.set_name(req->collection());
  absl::MutexLock create(&create_mu_);
  std::vector<std::string> ids;
  auto info = PlanAndCreate(spec, req->sharding_type(), &ids);
  if (!info.ok()) return ToGrpc(info.status());
  const int64_t epoch = info->plan().epoch();
  const std::vector<std::string> addresses(info->worker_addresses().begin(),
                                           info->worker_addresses().end());
  ember::v1::LoadCheckpointRequest load;
  load.set_collection(spec.name());
  load.set_epoch(epoch);
  load.set_dir(*path);
  *load.mutable_sources() = manifest->shards();
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::LoadCheckpointRequest, ember::v1::LoadCheckpointResponse>(
          addresses, std::vector<ember::v1::LoadCheckpointRequest>(addresses.size(), load),
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->LoadCheckpoint(ctx, request, response, std::move(done));
          },
          options_.checkpoint_rpc_timeout);
  for (size_t r = 0; r < addresses.size(); ++r) {
    if (statuses[r].ok()) continue;
    (void)DropOnWorkers(spec.name(), epoch, addresses);
    return ToGrpc(FromGrpc(statuses[r], absl::StrCat("restoring '", spec.name(), "' from ", *path,
                                                     " on worker ", r, " (", addresses[r], ")")));
  }
  info->set_recovered_from(*path);
  info->set_recovered_unix_ms(absl::ToUnixMillis(absl::Now()));
  info->set_note(absl::StrCat("restored from ", *path));
  if (absl::Status s = Register(*info, ids); !s.ok()) {
    (void)DropOnWorkers(spec.name(), epoch, addresses);
    return ToGrpc(s);
  }
  LOG(INFO) << "collection '" << spec.name() << "' restored from " << *path << " at epoch " << epoch
            << " on " << addresses.size() << " worker(s)";
  *resp->mutable_collection() = *std::move(info);
  *resp->mutable_checkpoint() = manifest->info();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListCheckpoints(grpc::ServerContext* ctx,
                                                 const ember::v1::ListCheckpointsRequest* req,
                                                 ember::v1::ListCheckpointsResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kTrainer); !a.ok()) return a;
  std::vector<ember::v1::CheckpointInfo> writing;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& c : catalogue_) {
      if (req->collection().empty() || c.collection() == req->collection()) {
        *resp->add_checkpoints() = c;
      }
    }
    for (const auto& [dir, c] : in_progress_) {
      if (req->collection().empty() || c.collection() == req->collection()) writing.push_back(c);
    }
  }
  for (auto& c : writing) {  // the files' sizes, read outside the lock
    c.set_bytes(checkpoint::BytesInDirectory(c.path()));
    *resp->add_checkpoints() = std::move(c);
  }
  return grpc::Status::OK;
}

void CoordinatorService::PeriodicCheckpoints() {
  while (!stop_.WaitForNotificationWithTimeout(options_.checkpoint_every)) {
    std::vector<std::string> names;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [name, info] : collections_) names.push_back(name);
    }
    for (const std::string& name : names) {
      if (stop_.HasBeenNotified()) return;
      auto info = CheckpointCollection(name, "");
      if (!info.ok() && !absl::IsNotFound(info.status())) {
        LOG(WARNING) << "periodic checkpoint of '" << name << "': " << info.status();
      }
    }
  }
}


absl::Status CoordinatorService::Persist(const StateStore::Batch& batch) {
  if (store_ == nullptr) return absl::OkStatus();
  absl::Status s = store_->Write(batch);
  if (!s.ok()) LOG(ERROR) << s;
  return s;
}

absl::StatusOr<int64_t> CoordinatorService::NextEpoch() {
  absl::MutexLock lock(&mu_);
  // Written before it is used: epochs never go backwards across restarts.
  if (absl::Status s = Persist(StateStore::Batch().Epoch(epoch_ + 1)); !s.ok()) return s;
  return ++epoch_;
}

absl::Status CoordinatorService::Register(const CollectionInfo& info,
                                          const std::vector<std::string>& ids) {
  ember::v1::StoredCollection stored;
  *stored.mutable_info() = info;
  for (const std::string& id : ids) stored.add_rank_worker_ids(id);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Persist(StateStore::Batch().PutCollection(stored)); !s.ok()) return s;
  collections_[info.spec().name()] = info;
  rank_ids_[info.spec().name()] = ids;
  return absl::OkStatus();
}

absl::Status CoordinatorService::PersistMove(const std::string& name, const CollectionInfo& next,
                                             const std::vector<std::string>& next_ids,
                                             bool data_in_place) {
  absl::MutexLock lock(&mu_);
  auto it = collections_.find(name);
  if (it == collections_.end()) return absl::NotFoundError(absl::StrCat("no collection '", name, "'"));
  ember::v1::StoredCollection stored;
  *stored.mutable_info() = it->second;
  for (const std::string& id : rank_ids_[name]) stored.add_rank_worker_ids(id);
  ember::v1::StoredMove* move = stored.mutable_pending();
  *move->mutable_info() = next;
  for (const std::string& id : next_ids) move->add_rank_worker_ids(id);
  move->set_data_in_place(data_in_place);
  return Persist(StateStore::Batch().PutCollection(stored));
}

// A fault-injection point for tests: EMBER_COORDINATOR_CRASH_AT=<point> makes
// the coordinator exit there at once, as kill -9 would.
void CrashPoint(const char* point) {
  static const char* at = std::getenv("EMBER_COORDINATOR_CRASH_AT");
  if (at != nullptr && std::string(at) == point) {
    LOG(ERROR) << "EMBER_COORDINATOR_CRASH_AT=" << point << ": exiting";
    _exit(137);
  }
}

void CoordinatorService::SetState(const std::string& name, CollectionInfo::State state,
                                  const std::string& note) {
  absl::MutexLock lock(&mu_);
  auto it = collections_.find(name);
  if (it == collections_.end()) return;
  it->second.set_state(state);
  it->second.set_note(note);
}

std::vector<std::string> CoordinatorService::CheckpointCandidates(const CollectionInfo& info) {
  const std::string& name = info.spec().name();
  std::vector<std::pair<int64_t, std::string>> found;  // (created ms, path)
  std::set<std::string> seen;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& c : catalogue_) {
      if (c.collection() == name && c.epoch() >= info.created_epoch()) {
        found.emplace_back(c.created_unix_ms(), c.path());
        seen.insert(c.path());
      }
    }
  }
  // Manifests are read outside the lock (a slow disk must not stall
  // heartbeats).
  if (!options_.checkpoint_dir.empty()) {
    for (const std::string& dir : checkpoint::ListCommitted(options_.checkpoint_dir, name)) {
      if (seen.count(dir)) continue;
      auto m = checkpoint::ReadManifest(dir);
      if (m.ok() && m->info().epoch() >= info.created_epoch()) {
        found.emplace_back(m->info().created_unix_ms(), dir);
      }
    }
  }
  // The checkpoint the collection was restored or last recovered from.
  if (!info.recovered_from().empty() && !seen.count(info.recovered_from())) {
    auto m = checkpoint::ReadManifest(info.recovered_from());
    if (m.ok()) found.emplace_back(m->info().created_unix_ms(), info.recovered_from());
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

void CoordinatorService::MonitorLoop() {
  const absl::Duration tick = std::max(options_.lease / 4, absl::Milliseconds(50));
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    if (reconcile_pending_.exchange(false)) Reconcile();
    std::vector<std::string> lost;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (const auto& [name, info] : collections_) {
        if (auto r = retry_after_.find(name); r != retry_after_.end() && now < r->second) continue;
        if (force_lost_.count(name)) {
          lost.push_back(name);
          continue;
        }
        const std::vector<std::string>& ids = rank_ids_[name];
        for (int r : planner::HoldingRanks(info.plan())) {
          auto w = r < static_cast<int>(ids.size()) ? workers_.find(ids[r]) : workers_.end();
          if (w == workers_.end() || now - w->second.last_heartbeat >= options_.lease) {
            lost.push_back(name);
            break;
          }
        }
      }
    }
    for (const std::string& name : lost) {
      if (stop_.HasBeenNotified()) return;
      (void)RecoverCollection(name);  // it records failures in the collection's state
    }
    ForgetDeadWorkers();
  }
}

// Workers silent for options_.forget_workers_after that no collection names
// any more (recovery has moved their shards) are removed from the registry.
void CoordinatorService::ForgetDeadWorkers() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  const std::set<std::string> named = NamedWorkersLocked();
  StateStore::Batch batch;
  std::vector<std::string> gone;
  for (const auto& [id, w] : workers_) {
    if (now - w.last_heartbeat >= options_.forget_workers_after && !named.count(id)) {
      gone.push_back(id);
      batch.DeleteWorker(id);
    }
  }
  if (gone.empty() || !Persist(batch).ok()) return;
  for (const std::string& id : gone) {
    LOG(INFO) << "worker " << id << " (" << workers_[id].info.address()
              << ") forgotten: silent for " << absl::FormatDuration(options_.forget_workers_after);
    workers_.erase(id);
  }
}

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
      if (now - w.last_heartbeat < options_.lease) alive[id] = w;
    }
  }
  const int world = info.worker_addresses_size();
  ids.resize(world);
  const std::set<int> holding = planner::HoldingRanks(info.plan());
  for (int r : holding) {
    if (drain ? ids[r] == drain_id : !alive.count(ids[r])) lost.insert(r);
  }
  if (lost.empty()) return absl::OkStatus();
  const CollectionInfo before = info;  // the old plan and addresses (drain copies from them)
  const std::string lost_names = DescribeRanks(info, lost);
  LOG(WARNING) << "collection '" << name << "': " << (drain ? "draining " : "lost ") << lost_names;
  SetState(name, CollectionInfo::RECOVERING,
           (drain ? "moving the shards of " : "recovering the shards of ") + lost_names);

  // The checkpoint to reload from, chosen (and every file verified) before
  // anything changes: the newest usable one of this collection.
  std::string path;
  ember::v1::CheckpointManifest manifest;
  if (!drain) {
    const std::vector<std::string> candidates = CheckpointCandidates(info);
    std::string unusable;
    for (const std::string& candidate : candidates) {
      auto m = checkpoint::VerifyCheckpoint(candidate);
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
  absl::StatusOr<Replacement> placed = PlaceLostShards(info, ids, lost, candidates);
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
  const std::map<std::pair<std::string, int32_t>, int>& dp_source = placed->replica_source;
  // Every rank holding something under the new plan moves to its epoch
  // (replacements are created there); a drained rank holds nothing now.
  std::set<int> kept = planner::HoldingRanks(info.plan());
  for (int r : replaced) kept.erase(r);
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

  // Replacements create their shards; the other live ranks move to the new
  // epoch and create what they were given.
  std::vector<std::string> create_at, update_at;
  std::vector<ember::v1::CreateShardsRequest> creates;
  std::vector<ember::v1::UpdateShardsRequest> updates;
  for (int r : replaced) {
    ember::v1::CreateShardsRequest c;
    c.set_collection(name);
    c.set_epoch(epoch);
    for (const auto& a : AssignmentsOf(info, r)) *c.add_shards() = a;
    create_at.push_back(info.worker_addresses(r));
    creates.push_back(std::move(c));
  }
  for (int r : kept) {
    ember::v1::UpdateShardsRequest u;
    u.set_collection(name);
    u.set_epoch(epoch);
    for (const auto& a : AssignmentsOf(info, r)) *u.add_create() = a;
    update_at.push_back(info.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  // A failed attempt lets go of what it created on replacements; a drain
  // goes back to the old placement (the drained worker still holds it).
  auto give_up = [&](const absl::Status& why) {
    (void)DropOnWorkers(name, epoch, create_at);
    if (drain) {
      (void)ReadoptLocked(name, absl::StrCat("moving ", lost_names, " failed (", why.message(),
                                             "); back on the old placement"));
    }
    return why;
  };
  absl::Status failure;
  auto failed = [&](const std::vector<grpc::Status>& statuses,
                    const std::vector<std::string>& at) -> bool {
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (statuses[i].ok()) continue;
      const std::string why =
          absl::StrCat(drain ? "moving " : "recovery of ", lost_names, " failed on ", at[i], ": ",
                       statuses[i].error_message(), drain ? "" : "; retrying");
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

  // Reload from the checkpoint: the lost shards, or everything. A drain
  // copies them live from the draining worker instead.
  const bool whole = info.spec().recovery() == ember::v1::CollectionSpec::WHOLE_COLLECTION;
  std::string note;
  if (drain) {
    if (absl::Status s = CopyFromDrained(name, epoch, before, info, lost, reload, dp_source);
        !s.ok()) {
      return give_up(s);
    }
    note = absl::StrCat("drained ", lost_names, ": shards copied live, no update lost");
  } else if (path.empty()) {
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
  // The data is in place: from here a restarted coordinator keeps the new
  // placement; only then does a drained worker let go of its copy.
  if (absl::Status s = PersistMove(name, info, ids, /*data_in_place=*/true); !s.ok()) {
    return give_up(s);
  }
  CrashPoint("move_after_data");
  if (drain) {
    std::vector<std::string> sources;
    for (int r : lost) sources.push_back(before.worker_addresses(r));
    if (absl::Status s = DropOnWorkers(name, epoch, sources); !s.ok()) {
      LOG(WARNING) << "collection '" << name << "': moved, but the drained copy stays: " << s;
    }
  }
  info.set_state(CollectionInfo::SERVING);
  if (!drain) {
    info.set_recovered_from(path);
    info.set_recovered_unix_ms(absl::ToUnixMillis(absl::Now()));
  }
  info.set_note(note);
  {
    absl::MutexLock lock(&mu_);
    if (!collections_.count(name)) return absl::OkStatus();  // dropped meanwhile
  }
  if (absl::Status s = Register(info, ids); !s.ok()) {
    SetState(name, CollectionInfo::DEGRADED, std::string(s.message()));
    return s;
  }
  if (!drain) {
    absl::MutexLock lock(&mu_);
    force_lost_.erase(name);
  }
  LOG(INFO) << "collection '" << name << "' " << (drain ? "moved" : "recovered") << " at epoch "
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
      if (now - w.last_heartbeat < options_.lease) alive.insert(id);
    }
  }
  auto next = NextEpoch();
  if (!next.ok()) return next.status();
  info.mutable_plan()->set_epoch(*next);
  ids.resize(info.worker_addresses_size());
  std::vector<std::string> at;
  std::vector<ember::v1::UpdateShardsRequest> updates;
  for (int r : planner::HoldingRanks(info.plan())) {
    if (!alive.count(ids[r])) continue;  // a dead rank is the monitor's to recover
    ember::v1::UpdateShardsRequest u;
    u.set_collection(name);
    u.set_epoch(*next);
    for (const auto& a : AssignmentsOf(info, r)) *u.add_create() = a;
    at.push_back(info.worker_addresses(r));
    updates.push_back(std::move(u));
  }
  const std::vector<grpc::Status> statuses =
      CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
          at, updates, [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->UpdateShards(ctx, request, response, std::move(done));
          });
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

absl::Status CoordinatorService::CopyFromDrained(
    const std::string& name, int64_t epoch, const CollectionInfo& before,
    const CollectionInfo& after, const std::set<int>& drained,
    const std::map<int, std::set<std::pair<std::string, int32_t>>>& moved,
    const std::map<std::pair<std::string, int32_t>, int>& dp_source) {
  // 1. The draining worker moves to the new epoch too: every client still on
  //    the old plan is refused everywhere (and refreshes, and waits for
  //    RECOVERING to end), so no update lands on a shard being copied.
  std::vector<std::string> sources;
  for (int r : drained) sources.push_back(before.worker_addresses(r));
  ember::v1::UpdateShardsRequest fence;
  fence.set_collection(name);
  fence.set_epoch(epoch);
  const std::vector<grpc::Status> fenced =
      CallEach<ember::v1::UpdateShardsRequest, ember::v1::UpdateShardsResponse>(
          sources, std::vector<ember::v1::UpdateShardsRequest>(sources.size(), fence),
          [](auto* async, auto* ctx, auto* request, auto* response, auto done) {
            async->UpdateShards(ctx, request, response, std::move(done));
          });
  for (size_t i = 0; i < sources.size(); ++i) {
    if (!fenced[i].ok()) return FromGrpc(fenced[i], sources[i]);
  }
  // 2. Each moved shard: rows exported from the old place, imported into the
  //    new, in chunks of about 4 MiB, with the optimizer step.
  for (const auto& [to, refs] : moved) {
    for (const auto& [table, index] : refs) {
      // A new data-parallel replica copies an old one; a shard copies itself.
      auto dp = dp_source.find({table, index});
      ember::v1::ShardRef from_ref, to_ref;
      from_ref.set_table(table);
      from_ref.set_shard_index(dp != dp_source.end() ? dp->second : index);
      to_ref.set_table(table);
      to_ref.set_shard_index(index);
      const std::optional<ShardAssignment> from = AssignmentOf(before, from_ref);
      if (!from) return absl::InternalError(absl::StrCat("no shard to copy for table '", table,
                                                         "' shard ", index));
      if (absl::Status s = CopyShard(name, epoch, before.worker_addresses(RankOf(before, from_ref)),
                                     from_ref, after.worker_addresses(to), to_ref, from->rows());
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();  // the caller drops the drained copy once this is durable
}

absl::Status CoordinatorService::CopyShard(const std::string& collection, int64_t epoch,
                                           const std::string& from,
                                           const ember::v1::ShardRef& from_ref,
                                           const std::string& to,
                                           const ember::v1::ShardRef& to_ref, int64_t rows) {
  ember::v1::Worker::Stub* src = StubFor(from);
  ember::v1::Worker::Stub* dst = StubFor(to);
  // Rows [b, e) across, with the step; the first call (no rows) carries the
  // shard's exactly-once record and tells the row width.
  auto copy = [&](int64_t b, int64_t e, bool first, ember::v1::ExportRowsResponse* got) {
    ember::v1::ExportRowsRequest ex;
    ex.set_collection(collection);
    *ex.mutable_shard() = from_ref;
    ex.set_row_begin(b);
    ex.set_row_end(e);
    ex.set_with_applied_ids(first);
    {
      grpc::ClientContext ctx;
      SetDeadline(&ctx, options_.worker_rpc_timeout);
      AddToken(&ctx, CredentialFor(from));
      if (grpc::Status s = src->ExportRows(&ctx, ex, got); !s.ok()) return FromGrpc(s, from);
    }
    ember::v1::ImportRowsRequest im;
    im.set_collection(collection);
    im.set_epoch(epoch);
    *im.mutable_shard() = to_ref;
    im.set_row_begin(b);
    im.set_row_end(e);
    im.set_weights(std::move(*got->mutable_weights()));
    im.set_state(std::move(*got->mutable_state()));
    im.set_step(got->step());
    *im.mutable_applied_ids() = got->applied_ids();
    *im.mutable_applied_unix_ms() = got->applied_unix_ms();
    ember::v1::ImportRowsResponse done;
    grpc::ClientContext ctx;
    SetDeadline(&ctx, options_.worker_rpc_timeout);
    AddToken(&ctx, CredentialFor(to));
    if (grpc::Status s = dst->ImportRows(&ctx, im, &done); !s.ok()) return FromGrpc(s, to);
    return absl::OkStatus();
  };
  ember::v1::ExportRowsResponse shape;
  if (absl::Status s = copy(0, 0, true, &shape); !s.ok()) return s;
  const int64_t chunk =
      std::max<int64_t>(1, (int64_t{4} << 20) / (4 * (shape.cols() + shape.state_width())));
  for (int64_t b = 0; b < rows; b += chunk) {
    ember::v1::ExportRowsResponse got;
    if (absl::Status s = copy(b, std::min(rows, b + chunk), false, &got); !s.ok()) return s;
  }
  return absl::OkStatus();
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
