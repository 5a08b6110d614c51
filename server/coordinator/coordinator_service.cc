// CoordinatorService's core: creation, loading and reconciling durable
// state on start, the monitor loop, worker stubs and credentials, and the
// state store's writes. The RPCs live by concern: the worker registry
// (coordinator_workers.cc), collections (coordinator_collections.cc),
// checkpoints (coordinator_checkpoints.cc), recovery and drain
// (coordinator_recovery.cc, placing shards by replacement_policy.h).
#include "server/coordinator/coordinator_service.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/replacement_policy.h"
#include "server/coordinator/state_store.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

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
  // Two leases to heartbeat again: a worker's channel may be waiting out
  // its reconnect back-off (up to 1 s) when this coordinator comes back,
  // and a worker declared lost for that has its shards recovered for
  // nothing (rolled back, with one copy).
  const absl::Time now = absl::Now() + options_.lease;
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
      // A live move may have stopped before its switch: finish it.
      CollectionInfo old;
      {
        absl::MutexLock lock(&mu_);
        old = collections_[name];
      }
      if (auto plan = PlanMove(old, move.info()); plan.ok()) {
        FinishMove(name, *plan, move.info());
      }
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
      // What a live move staged for that epoch goes (NOT_FOUND is fine).
      std::vector<std::string> staged_at;
      for (int r : planner::HoldingRanks(move.info().plan())) {
        staged_at.push_back(move.info().worker_addresses(r));
      }
      (void)DropOnWorkers(name, move.info().plan().epoch(), staged_at, /*staged=*/true);
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
  if (!options_.checkpoint_dir.empty() && options_.checkpoint_compact_after > 0) {
    compactor_ = std::thread([this] { CompactCheckpoints(); });
  }
}

CoordinatorService::~CoordinatorService() {
  stop_.Notify();
  if (periodic_.joinable()) periodic_.join();
  if (monitor_.joinable()) monitor_.join();
  if (compactor_.joinable()) compactor_.join();
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

void CoordinatorService::SetState(const std::string& name, CollectionInfo::State state,
                                  const std::string& note) {
  absl::MutexLock lock(&mu_);
  auto it = collections_.find(name);
  if (it == collections_.end()) return;
  it->second.set_state(state);
  it->second.set_note(note);
}

void CoordinatorService::MonitorLoop() {
  const absl::Duration tick = std::max(options_.lease / 4, absl::Milliseconds(50));
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    if (reconcile_pending_.exchange(false)) Reconcile();
    std::vector<std::string> lost, short_of_copies;
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
        bool all_live = true;
        for (int r : planner::HoldingRanks(info.plan())) {
          auto w = r < static_cast<int>(ids.size()) ? workers_.find(ids[r]) : workers_.end();
          if (w == workers_.end() || !Live(w->second, now)) {
            lost.push_back(name);
            all_live = false;
            break;
          }
        }
        if (all_live && info.state() == CollectionInfo::SERVING && MissingCopies(info) > 0) {
          short_of_copies.push_back(name);
        }
      }
    }
    for (const std::string& name : lost) {
      if (stop_.HasBeenNotified()) return;
      (void)RecoverCollection(name);  // it records failures in the collection's state
    }
    for (const std::string& name : short_of_copies) {
      if (stop_.HasBeenNotified()) return;
      (void)RestoreCopies(name);  // it notes why it could not, and backs off
    }
    ForgetDeadWorkers();
  }
}

}  // namespace coordinator
}  // namespace ember
