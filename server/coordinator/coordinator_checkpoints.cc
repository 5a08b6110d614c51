// CoordinatorService's checkpoints: writing one (every worker's shard files,
// then the manifest), periodic ones, listing them, and restoring one onto
// the live workers.
#include "server/coordinator/coordinator_service.h"

#include <algorithm>
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
#include "server/backend/embedding_backend.h"
#include "server/backend/table_spec.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/common/grpc_util.h"
#include "server/coordinator/assignments.h"
#include "server/coordinator/call_each.h"
#include "server/coordinator/state_store.h"

namespace ember {
namespace coordinator {

using ember::v1::CollectionInfo;
using ember::v1::ShardAssignment;

absl::StatusOr<ember::v1::CheckpointInfo> CoordinatorService::CheckpointCollection(
    const std::string& collection, const std::string& root, bool incremental) {
  const absl::Time start = absl::Now();
  auto info = WriteCollectionCheckpoint(collection, root, incremental);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (absl::IsNotFound(info.status())) return info;  // no such collection: nothing was written
  absl::MutexLock lock(&mu_);
  Stats& s = checkpoint_stats_;
  (info.ok() ? s.checkpoints_ok : s.checkpoints_failed) += 1;
  s.checkpoint_seconds += seconds;
  s.last_checkpoint_seconds = seconds;
  if (info.ok()) {
    s.last_checkpoint_unix_seconds = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
    (info->base().empty() ? s.checkpoint_bytes_full : s.checkpoint_bytes_incremental) +=
        info->bytes();
  }
  return info;
}

namespace {

std::string BaseName(const std::string& dir) {
  const size_t slash = dir.rfind('/');
  return slash == std::string::npos ? dir : dir.substr(slash + 1);
}

}  // namespace

std::optional<ember::v1::CheckpointManifest> CoordinatorService::IncrementalBase(
    const std::string& root, const std::string& collection) {
  const std::vector<std::string> committed = checkpoint::ListCommitted(root, collection);
  if (committed.empty()) return std::nullopt;
  auto m = checkpoint::ReadManifest(committed.back());
  if (!m.ok()) {
    LOG(WARNING) << "incremental checkpoint of '" << collection << "': its base "
                 << committed.back() << " is unreadable (" << m.status()
                 << "); writing a full one";
    return std::nullopt;
  }
  if (std::max(1, m->info().chain_length()) >= std::max(1, options_.checkpoint_full_every)) {
    return std::nullopt;  // the chain is as long as allowed: a full one starts the next
  }
  // A base whose own chain is broken would make every delta over it
  // unrestorable: a full one starts a new chain instead.
  if (auto chain = checkpoint::CheckpointChain(committed.back(), options_.checkpoint_dir);
      !chain.ok()) {
    LOG(WARNING) << "incremental checkpoint of '" << collection << "': the chain of "
                 << committed.back() << " is broken (" << chain.status()
                 << "); writing a full one";
    return std::nullopt;
  }
  return *std::move(m);
}

absl::StatusOr<ember::v1::CheckpointInfo> CoordinatorService::WriteCollectionCheckpoint(
    const std::string& collection, const std::string& requested_root, bool incremental) {
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
  // Read before the new directory exists (it would be the latest).
  const std::optional<ember::v1::CheckpointManifest> base =
      incremental ? IncrementalBase(root, collection) : std::nullopt;
  // Its entries by shard: what each worker is sent, and what each delta
  // it writes must build on.
  std::map<std::pair<std::string, int32_t>, const ember::v1::CheckpointShard*> base_entry;
  if (base) {
    for (const auto& e : base->shards()) base_entry[{e.ref().table(), e.ref().shard_index()}] = &e;
  }
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
      // The base's entry of the shard: the worker decides if it fits.
      if (auto e = base_entry.find({ref->table(), ref->shard_index()}); e != base_entry.end()) {
        *per_rank[b.rank].add_base() = *e->second;
      }
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
  // A delta must build on the base's entry of its shard (lineage and
  // generation), or the chain it would start is unrestorable.
  for (const auto& resp : responses) {
    for (const auto& shard : resp.shards()) {
      if (!shard.delta()) continue;
      const auto e = base_entry.find({shard.ref().table(), shard.ref().shard_index()});
      if (e == base_entry.end() || e->second->lineage() != shard.lineage() ||
          e->second->generation() != shard.base_generation()) {
        (void)checkpoint::RemoveCheckpoint(*dir);
        return absl::InternalError(absl::StrCat(
            "checkpoint of '", collection, "': a worker wrote table '", shard.ref().table(),
            "' shard ", shard.ref().shard_index(), " as a delta over no matching base entry"));
      }
    }
  }
  for (const auto& resp : responses) {
    for (const auto& shard : resp.shards()) {
      ci->set_bytes(ci->bytes() + shard.bytes());
      if (shard.delta()) {
        ci->set_delta_shards(ci->delta_shards() + 1);
        ci->set_changed_rows(ci->changed_rows() + shard.changed_rows());
      }
      *manifest.add_shards() = shard;
    }
    ci->set_max_pause_ms(std::max(ci->max_pause_ms(), resp.pause_ms()));
    ci->set_write_ms(std::max(ci->write_ms(), resp.write_ms()));
  }
  ci->set_shards(manifest.shards_size());
  ci->set_chain_length(1);
  if (ci->delta_shards() > 0) {
    ci->set_base(BaseName(base->info().path()));
    ci->set_chain_length(std::max(1, base->info().chain_length()) + 1);
  }
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
            << ci->max_pause_ms() << " ms, total " << ci->total_ms() << " ms"
            << (ci->base().empty()
                    ? std::string()
                    : absl::StrCat("; incremental: ", ci->delta_shards(), " delta shard(s), ",
                                   ci->changed_rows(), " changed row(s) over ", ci->base(),
                                   ", chain of ", ci->chain_length()));
  if (!ci->base().empty() && options_.checkpoint_compact_after > 0 &&
      ci->chain_length() >= options_.checkpoint_compact_after) {
    absl::MutexLock lock(&compact_mu_);
    compact_queue_.push_back(*dir);
  }
  const std::set<std::string> removed = PruneCheckpoints(root, collection, *dir);
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

std::vector<std::string> CoordinatorService::PinCheckpoint(const std::string& dir) {
  absl::MutexLock pruning(&prune_mu_);
  std::vector<std::string> dirs = {dir};
  if (auto chain = checkpoint::CheckpointChain(dir, options_.checkpoint_dir); chain.ok()) {
    dirs = *std::move(chain);
  }
  absl::MutexLock lock(&mu_);
  for (const std::string& d : dirs) ++reading_[d];
  return dirs;
}

void CoordinatorService::Unpin(const std::vector<std::string>& dirs) {
  absl::MutexLock lock(&mu_);
  for (const std::string& d : dirs) {
    if (--reading_[d] <= 0) reading_.erase(d);
  }
}

std::set<std::string> CoordinatorService::PruneCheckpoints(const std::string& root,
                                                          const std::string& collection,
                                                          const std::string& newest) {
  absl::MutexLock pruning(&prune_mu_);
  std::set<std::string> removed;
  std::set<std::string> reading;  // left alone: a load is reading them
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [d, n] : reading_) reading.insert(d);
  }
  const std::vector<std::string> committed = checkpoint::ListCommitted(root, collection);
  const size_t keep = std::min(committed.size(), static_cast<size_t>(
                                                     std::max(options_.keep_checkpoints, 1)));
  // The kept ones and every base they build on; an unreadable chain keeps
  // everything older (never remove what a restore may need).
  std::set<std::string> needed(committed.end() - keep, committed.end());
  bool known = true;
  for (size_t i = committed.size() - keep; i < committed.size(); ++i) {
    auto chain = checkpoint::CheckpointChain(committed[i], options_.checkpoint_dir);
    if (!chain.ok()) {
      LOG(WARNING) << "checkpoint " << committed[i] << ": " << chain.status()
                   << "; keeping every older checkpoint";
      known = false;
      break;
    }
    needed.insert(chain->begin(), chain->end());
  }
  for (size_t i = 0; known && i + keep < committed.size(); ++i) {
    if (needed.count(committed[i]) || reading.count(committed[i])) continue;
    if (absl::Status s = checkpoint::RemoveCheckpoint(committed[i]); s.ok()) {
      removed.insert(committed[i]);
    } else {
      LOG(WARNING) << "removing old checkpoint " << committed[i] << ": " << s;
    }
  }
  // Delta files a compaction replaced, once the compaction is older than
  // the longest load (a restore or recovery that read the old manifest
  // before it still finds them).
  for (const std::string& d : needed) {
    if (d != newest && !reading.count(d)) {
      checkpoint::RemoveUnlistedShardFiles(d, options_.checkpoint_rpc_timeout);
    }
  }
  for (const std::string& d : checkpoint::ListUncommitted(root, collection)) {
    if (d < newest) (void)checkpoint::RemoveCheckpoint(d);
  }
  return removed;
}

void CoordinatorService::CompactCheckpoints() {
  auto queued = [](std::deque<std::string>* q) { return !q->empty(); };
  while (!stop_.HasBeenNotified()) {
    std::string dir;
    {
      absl::MutexLock lock(&compact_mu_);
      compact_mu_.AwaitWithTimeout(absl::Condition(+queued, &compact_queue_),
                                   absl::Milliseconds(200));
      if (stop_.HasBeenNotified()) return;
      if (compact_queue_.empty()) continue;
      dir = compact_queue_.front();
      compact_queue_.pop_front();
    }
    absl::MutexLock one_at_a_time(&checkpoint_mu_);  // never beside a write or prune
    const absl::Time start = absl::Now();
    auto written = checkpoint::CompactCheckpoint(dir, options_.checkpoint_dir);
    if (!written.ok()) {
      LOG(WARNING) << "compacting checkpoint " << dir << ": " << written.status()
                   << " (it stays incremental)";
      absl::MutexLock lock(&mu_);
      ++checkpoint_stats_.compactions_failed;
      continue;
    }
    if (*written == 0) continue;
    auto m = checkpoint::ReadManifest(dir);
    if (!m.ok()) continue;
    LOG(INFO) << "checkpoint " << dir << " compacted into a full one: " << *written
              << " bytes written in " << absl::ToDoubleSeconds(absl::Now() - start) << " s";
    absl::MutexLock lock(&mu_);
    ++checkpoint_stats_.compactions_ok;
    for (auto& c : catalogue_) {
      if (c.path() != dir) continue;
      c = m->info();
      StateStore::Batch batch;
      batch.PutCheckpoint(c);
      if (absl::Status s = Persist(batch); !s.ok()) {
        LOG(ERROR) << "compacted checkpoint " << dir << " is not updated in the state store: " << s;
      }
    }
  }
}

grpc::Status CoordinatorService::Checkpoint(grpc::ServerContext* ctx,
                                            const ember::v1::CheckpointRequest* req,
                                            ember::v1::CheckpointResponse* resp) {
  if (grpc::Status a = options_.auth.Check(ctx, Role::kAdmin); !a.ok()) return a;
  if (req->collection().empty()) {
    return ToGrpc(absl::InvalidArgumentError("collection name is empty"));
  }
  auto info = CheckpointCollection(req->collection(), req->dir(), req->incremental());
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
  // Not pruned while it is read (an incremental one's bases too).
  const std::vector<std::string> pinned = PinCheckpoint(*path);
  auto unpin = absl::MakeCleanup([this, &pinned] { Unpin(pinned); });
  // Shown by ListCheckpoints while it runs: bytes verified, then loading.
  int64_t key;
  {
    absl::MutexLock lock(&mu_);
    key = next_restore_++;
    ember::v1::RestoreProgress& p = restoring_[key];
    p.set_from(*path);
    p.set_collection(req->collection());
    p.set_phase("verifying");
    p.set_started_unix_ms(absl::ToUnixMillis(absl::Now()));
  }
  auto done_restoring = absl::MakeCleanup([this, key] {
    absl::MutexLock lock(&mu_);
    restoring_.erase(key);
  });
  // Every file is checked before anything is created.
  auto manifest = checkpoint::VerifyCheckpoint(
      *path,
      [this, key](int64_t done, int64_t total) {
        absl::MutexLock lock(&mu_);
        ember::v1::RestoreProgress& p = restoring_[key];
        p.set_bytes_verified(done);
        p.set_total_bytes(total);
      },
      options_.checkpoint_dir);
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
  {
    absl::MutexLock lock(&mu_);
    ember::v1::RestoreProgress& p = restoring_[key];
    p.set_collection(spec.name());
    p.set_phase("loading");
    p.set_workers(static_cast<int32_t>(addresses.size()));
  }
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
    for (const auto& [key, r] : restoring_) {
      if (req->collection().empty() || r.collection() == req->collection()) {
        *resp->add_restores() = r;
      }
    }
  }
  for (auto& c : writing) {  // the files' sizes, read outside the lock
    c.set_bytes(checkpoint::ShardBytesInDirectory(c.path()));
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
      auto info = CheckpointCollection(name, "", options_.checkpoint_incremental);
      if (!info.ok() && !absl::IsNotFound(info.status())) {
        LOG(WARNING) << "periodic checkpoint of '" << name << "': " << info.status();
      }
    }
  }
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

}  // namespace coordinator
}  // namespace ember
