// CoordinatorService's worker registry: registration and identities,
// heartbeats and leases, the live workers in rank order and their topology,
// and forgetting workers silent too long.
#include "server/coordinator/coordinator_service.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "planner/sharding_types.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "planner/plan_view.h"
#include "planner/spec_validation.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/state_store.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

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
  if (info.hbm_bytes() < 0 || info.ddr_bytes() < 0 || info.host_memory_bytes() < 0) {
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
    const bool live = Live(old, now);
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
  // A worker whose shard memory defaulted to its whole host's, beside live
  // workers of the same host that already claim part of it: together they
  // would promise shards memory the host does not have.
  if (info.host_memory_bytes() > 0 && info.ddr_bytes() > 0) {
    auto gib = [](int64_t bytes) { return bytes / 1073741824.0; };
    int64_t claimed = 0;
    std::vector<std::string> holders;
    for (const auto& [id, old] : workers_) {
      if (!Live(old, now) || old.info.host() != info.host() || old.info.address() == info.address()) {
        continue;
      }
      claimed += old.info.ddr_bytes();
      holders.push_back(absl::StrFormat("%s (%s, %.2f GiB)", id, old.info.address(),
                                        gib(old.info.ddr_bytes())));
    }
    if (claimed > 0 && claimed + info.ddr_bytes() > info.host_memory_bytes()) {
      const double left = gib(std::max<int64_t>(0, info.host_memory_bytes() - claimed));
      return ToGrpc(absl::ResourceExhaustedError(absl::StrFormat(
          "host %s has %.2f GiB of memory and its live workers %s already advertise %.2f GiB "
          "of it for shards; this worker would advertise %.2f GiB more: start it with "
          "%s at most %.2f",
          info.host(), gib(info.host_memory_bytes()), absl::StrJoin(holders, ", "), gib(claimed),
          gib(info.ddr_bytes()),
          info.device() == ember::v1::CUDA ? "--uvm_memory_gib" : "--memory_gib", left)));
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
      if (Live(old, now) || named.count(id)) continue;
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
  // A primary here found a copy that may be behind (replication.cc): that
  // copy's rank is recovered as lost (its shards promoted elsewhere, then
  // copied anew), if the report is about the current epoch and comes from
  // a holder of the collection.
  for (const ember::v1::BrokenReplication& b : req->broken()) {
    auto c = collections_.find(b.collection());
    if (c == collections_.end() || c->second.plan().epoch() != b.epoch()) continue;
    const std::vector<std::string>& ids = rank_ids_[b.collection()];
    const std::set<int> holding = planner::HoldingRanks(c->second.plan());
    bool reporter_holds = false;
    for (int r : holding) {
      reporter_holds |= r < static_cast<int>(ids.size()) && ids[r] == req->worker_id();
    }
    if (!reporter_holds) continue;
    for (int r : holding) {
      if (r >= c->second.worker_addresses_size() || c->second.worker_addresses(r) != b.behind()) {
        continue;
      }
      if (force_lost_[b.collection()].insert(r).second) {
        LOG(WARNING) << "collection '" << b.collection() << "': worker " << req->worker_id()
                     << " reports the copies on rank " << r << " (" << b.behind()
                     << ") may be behind (" << b.why().substr(0, 512)
                     << "); re-forming the copies without it";
      }
    }
  }
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
    s->set_live(Live(*w, now));
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
    (Live(w, now) ? s.workers_live : s.workers_lost) += 1;
  }
  for (const auto& [name, info] : collections_) {
    ++s.collections_by_state[ember::v1::CollectionInfo::State_Name(info.state())];
  }
  s.checkpoints_ok = checkpoint_stats_.checkpoints_ok;
  s.checkpoints_failed = checkpoint_stats_.checkpoints_failed;
  s.checkpoint_seconds = checkpoint_stats_.checkpoint_seconds;
  s.last_checkpoint_seconds = checkpoint_stats_.last_checkpoint_seconds;
  s.last_checkpoint_unix_seconds = checkpoint_stats_.last_checkpoint_unix_seconds;
  s.checkpoint_bytes_full = checkpoint_stats_.checkpoint_bytes_full;
  s.checkpoint_bytes_incremental = checkpoint_stats_.checkpoint_bytes_incremental;
  s.compactions_ok = checkpoint_stats_.compactions_ok;
  s.compactions_failed = checkpoint_stats_.compactions_failed;
  s.drains_ok = checkpoint_stats_.drains_ok;
  s.drains_failed = checkpoint_stats_.drains_failed;
  s.scales_ok = checkpoint_stats_.scales_ok;
  s.scales_failed = checkpoint_stats_.scales_failed;
  s.copies_ok = checkpoint_stats_.copies_ok;
  s.copies_failed = checkpoint_stats_.copies_failed;
  s.replica_takeovers = replica_takeovers_;
  s.move_bytes_between_workers = checkpoint_stats_.move_bytes_between_workers;
  s.move_bytes_local = checkpoint_stats_.move_bytes_local;
  s.last_move_fence_seconds = checkpoint_stats_.last_move_fence_seconds;
  s.checkpoints = static_cast<int64_t>(catalogue_.size());
  return s;
}

std::vector<CoordinatorService::Worker> CoordinatorService::LiveWorkers() const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  std::vector<Worker> live;
  for (const auto& [id, w] : workers_) {
    if (Live(w, now) && !draining_.count(id)) live.push_back(w);
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
  // The kernels every worker serves (a worker from before the field: the
  // two every worker has served).
  std::vector<std::string> served;
  for (size_t r = 0; r < workers.size(); ++r) {
    // Names this build's planner does not know (a newer worker's) are
    // left out: it plans what it knows.
    std::vector<std::string> its;
    for (const std::string& k : workers[r].info.compute_kernels()) {
      if (planner::ParseComputeKernel(k).ok()) its.push_back(k);
    }
    if (workers[r].info.compute_kernels().empty()) its = {"dense", "fused"};
    if (r == 0) {
      served = its;
      continue;
    }
    served.erase(std::remove_if(served.begin(), served.end(),
                                [&](const std::string& k) {
                                  return std::find(its.begin(), its.end(), k) == its.end();
                                }),
                 served.end());
  }
  for (const std::string& k : served) t.add_compute_kernels(k);
  for (size_t r = 0; r < workers.size(); ++r) {
    const auto& info = workers[r].info;
    if (info.hbm_bytes() == 0 && info.ddr_bytes() == 0) continue;
    auto* d = t.add_devices();
    d->set_rank(static_cast<int>(r));
    d->set_hbm_bytes(info.hbm_bytes());
    d->set_ddr_bytes(info.ddr_bytes());
    d->set_ssd_bytes(info.ssd_bytes());
  }
  return t;
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

}  // namespace coordinator
}  // namespace ember
