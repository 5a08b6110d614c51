// The worker's gRPC service (proto/service.proto, ember.v1.Worker): holds
// the shards the coordinator assigns it in an EmbeddingBackend and serves
// fused lookups and gradient updates over them.
//
// Every request is checked before anything is applied: unknown collection
// (NOT_FOUND), stale epoch or a shard this worker does not hold
// (FAILED_PRECONDITION, the client refreshes its plan), malformed arrays, ids
// out of range, wrong gradient shape, NaN/Inf values (INVALID_ARGUMENT),
// responses or shards over the size or memory limits (RESOURCE_EXHAUSTED).
// Every mutating call carries the epoch it was planned at. ApplyGradients
// is exactly-once per request id and shard: each shard remembers the ids
// it applied (AppliedIds), so a retried update applies only the parts whose
// shards have not seen it, also after a shard moved between workers.
//
// Checkpoints: WriteCheckpoint fences a collection's updates only while its
// shards are copied in memory, then writes the files with updates flowing
// again; LoadCheckpoint fills the held shards from a checkpoint's files,
// re-cut to this worker's row and column ranges (server/checkpoint/).
//
// Thread-safe: gRPC calls it from many threads.
#ifndef EMBER_SERVER_WORKER_WORKER_SERVICE_H_
#define EMBER_SERVER_WORKER_WORKER_SERVICE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/service.grpc.pb.h"
#include "server/common/auth.h"
#include "server/backend/embedding_backend.h"
#include "server/worker/applied_ids.h"
#include "server/worker/request_codec.h"
#include "server/worker/shm_channels.h"
#include "server/worker/step_barrier.h"

namespace ember {
namespace worker {

struct WorkerServiceOptions {
  // The backend keeps key_value shards' rows on local SSD (--ssd_dir):
  // the worker serves that kernel.
  bool ssd_tier = false;
  // The fewest rows a key_value shard caches (or all of a smaller one):
  // one call's distinct rows of a shard must fit (--key_value_min_cache_rows).
  int64_t key_value_min_cache_rows = backend::math::kKeyValueMinCacheRows;
  // Tokens and roles (auth.h); disabled by default.
  TokenTable auth;
  // Largest response (lookup outputs or exported rows) in bytes.
  int64_t max_response_bytes = int64_t{1} << 30;
  // Exactly-once updates: a request id is remembered (per shard) for
  // dedup_ttl after it was applied, which must exceed every client's whole
  // retry deadline (ClientOptions::timeout, 30 s by default); memory is
  // bounded by dedup_window ids: past that the oldest are forgotten even if
  // younger than dedup_ttl, and counted (ShardStatus.dedup_forgotten_early).
  absl::Duration dedup_ttl = absl::Minutes(10);
  int dedup_window = 1 << 20;
  // The directory checkpoint files must lie under (checkpoint::ConfinedPath);
  // empty: this worker writes and reads no checkpoint.
  std::string checkpoint_root;
  // NaN/Inf in a gradient update: false refuses the whole update
  // (INVALID_ARGUMENT, nothing applied); true leaves out what they touch (a
  // pooled bag whose gradient row is not finite, an id whose weight or
  // sequence gradient row is not finite; a MEAN bag then averages over the
  // ids kept) and applies the rest. Both are counted (ShardStatus).
  bool skip_nonfinite = false;
  // Data calls (lookups, gradient updates) in the worker at once, running
  // or waiting for the backend; past it a call is refused at once with
  // RESOURCE_EXHAUSTED "worker busy ..." (kWorkerBusy; clients retry it
  // with back-off) instead of queueing without bound. 0: no bound.
  int max_queued_calls = 256;
  // Shared-memory channels (OpenChannel): offered when true; a channel
  // unused this long is forgotten; at most this many open at once.
  bool shared_memory = true;
  // A directory (on tmpfs) trainers of this host share with the worker,
  // e.g. a volume both pods mount: channels may be files in it as well as
  // POSIX shared-memory names. Empty: none.
  std::string shm_dir;
  absl::Duration channel_idle_timeout = absl::Minutes(10);
  int max_channels = 256;
  // Link channels (OpenChannelRequest.link): the kinds of peer link
  // offered ("nccl" where the backend is on a GPU; "socket" for tests and
  // machines without one), offered whatever shared_memory says.
  LinkChannelOptions links;
  // Steps of SYNC and BOUNDED collections (TrainingSpec): the most bytes
  // of updates one collection holds for its steps to complete; past it a
  // contribution is refused (RESOURCE_EXHAUSTED).
  int64_t max_pending_step_bytes = int64_t{1} << 30;
  // Replicated shards (ShardReplication): the credentials for calling the
  // backups a primary forwards updates to (null: plaintext), and how long
  // one forward may take at most (less if the caller's deadline is nearer).
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  absl::Duration forward_timeout = absl::Seconds(10);
};

class WorkerService final : public ember::v1::Worker::Service {
 public:
  WorkerService(std::unique_ptr<backend::EmbeddingBackend> backend,
                const WorkerServiceOptions& options);
  ~WorkerService() override;

  // The compute kernels a worker serves (TorchRec's names), advertised in
  // WorkerInfo.compute_kernels: "dense" and "fused", a shard held whole in
  // its backend's memory (HBM on a GPU), "fused_uvm" (rows in host memory
  // the GPU maps) where the backend maps host memory (the CUDA backend),
  // "fused_uvm_caching" (such rows under a cache in GPU memory) where it
  // also caches over it (the key_value wrapper the factory puts on it),
  // and "key_value" (rows on local SSD) where it has an SSD tier
  // (WorkerServiceOptions::ssd_tier).
  std::vector<std::string> ServedComputeKernels() const {
    std::vector<std::string> k = {"dense", "fused"};
    if (backend_->MapsHostMemory()) k.push_back("fused_uvm");
    if (backend_->CachesOverHostMemory()) k.push_back("fused_uvm_caching");
    if (options_.ssd_tier) k.push_back("key_value");
    return k;
  }
  // The backend's health (EmbeddingBackend::Health).
  absl::Status BackendHealth() const { return backend_->Health(); }

  // Pause fencing, driven by WorkerServer's heartbeat thread. A worker whose
  // process was paused past its lease (SIGSTOP, a frozen VM) may have had
  // its shards moved by the coordinator; a client with an old plan would
  // then read stale rows from it and have updates acknowledged that no
  // current shard holds. So data calls are refused (UNAVAILABLE: clients
  // retry and refresh their plan) while the heartbeat thread has not ticked
  // for a lease, and once it noticed the pause (Fence) until the
  // coordinator's answer (Unfence). Without SetLease nothing is fenced.
  void SetLease(absl::Duration lease);
  // The heartbeat thread runs now; the time since it last did (or since
  // SetLease, or the last Unfence).
  absl::Duration Tick();
  void Fence();  // it found itself paused
  // Drops every collection held at an epoch other than `keep`'s (and every
  // one `keep` does not name), then serves again.
  void Unfence(const std::map<std::string, int64_t>& keep);

  // What the worker's metrics report (server/common/metrics.h).
  struct Stats {
    int64_t lookups = 0, lookup_ids = 0, lookup_bytes = 0;
    int64_t prefetches = 0, prefetch_ids = 0;  // prefetch calls served (not lookups), their ids
    int64_t updates = 0, update_ids = 0;  // ApplyGradients calls applied, their ids
    int64_t duplicates = 0;               // updates answered from the exactly-once record
    int64_t nonfinite_refused = 0, nonfinite_skipped_ids = 0, dedup_forgotten_early = 0;
    int64_t overflow_refused = 0;       // updates refused: a result would overflow
    int64_t overflow_skipped_rows = 0;  // rows the backend left alone (skip_nonfinite)
    int64_t available_bytes = 0, shards = 0, collections = 0, request_ids = 0;
    int64_t available_mapped_bytes = 0;  // fused_uvm shards' mapped host memory
    int64_t calls_in_progress = 0, busy_refused = 0;  // the max_queued_calls bound
    int64_t shm_channels = 0;                         // shared-memory channels open
    int64_t link_channels = 0, link_lookups = 0;      // link channels open, lookups through them
    int64_t link_channels_opened = 0;                 // since the worker started
    int64_t link_busy_kept = 0;  // busy refusals of link calls whose bytes were taken
    int64_t placed_lookups = 0;  // outputs written into the client's output buffer
    int64_t id_buffer_lookups = 0;  // ids read from the client's id buffer
    // Time inside the backend's Lookup / ApplyGradients (calls that succeeded
    // or failed alike), ns: the worker's busy time, apart from transport.
    int64_t backend_lookup_ns = 0, backend_update_ns = 0;
    // SYNC and BOUNDED collections (StepBarrier::Stats, summed): steps
    // applied and aborted, time updates and lookups waited for steps,
    // ranks missing from aborted steps, bytes held for steps.
    int64_t steps_applied = 0, steps_aborted = 0, step_wait_ns = 0, step_ranks_missing = 0;
    int64_t step_pending_bytes = 0;
    // Replicated shards: updates a primary forwarded to its backups, the
    // time they took (ns), and forwards that failed.
    int64_t forwards = 0, forward_ns = 0, forward_failures = 0;
    int64_t busy_forward_retries = 0;  // forwards sent again to a backup busy with a move
  };
  Stats GetStats() const;

  // Traffic per table of each collection held here, summed over the table's
  // shards on this worker (the metrics' collection and table labels).
  struct TableStats {
    std::string collection, table;
    int64_t shards = 0;
    int64_t lookup_ids = 0;    // ids of lookups served (each in one shard)
    int64_t gradient_ids = 0;  // ids of gradient updates applied
    // A dynamic table: its shards' counters here, summed (a shard moved
    // away takes its counters with it).
    bool dynamic = false;
    backend::DynamicStats dyn;
    // A key_value table (rows on SSD under a cache): its shards' counters.
    bool key_value = false;
    backend::TierStats tier;
  };
  std::vector<TableStats> GetTableStats() const;

  grpc::Status CreateShards(grpc::ServerContext* ctx, const ember::v1::CreateShardsRequest* req,
                            ember::v1::CreateShardsResponse* resp) override;
  grpc::Status DropShards(grpc::ServerContext* ctx, const ember::v1::DropShardsRequest* req,
                          ember::v1::DropShardsResponse* resp) override;
  grpc::Status Lookup(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest* req,
                      ember::v1::WorkerLookupResponse* resp) override;
  grpc::Status OpenChannel(grpc::ServerContext* ctx, const ember::v1::OpenChannelRequest* req,
                           ember::v1::OpenChannelResponse* resp) override;
  grpc::Status CloseChannel(grpc::ServerContext* ctx, const ember::v1::CloseChannelRequest* req,
                            ember::v1::CloseChannelResponse* resp) override;
  // Open shared-memory channels (for metrics and tests).
  int open_channels() const { return channels_.open_channels(); }
  // Replicated collections whose primary copies here stopped taking
  // updates: a forward to a backup failed and the backup may or may not
  // have applied it, so the copies may differ by that update until the
  // coordinator re-forms them at a new epoch (the heartbeat reports them).
  struct BrokenReplication {
    std::string collection;
    int64_t epoch = 0;
    // The copy that may be behind: the backup a forward failed to, or this
    // worker (its own address) when it refused what its backups applied.
    std::string backup;
    std::string why;
  };
  std::vector<BrokenReplication> BrokenReplications() const;
  // The address this worker is registered under (what a plan names it by):
  // a primary names itself so in what it forwards.
  void SetOwnAddress(const std::string& address);
  std::string OwnAddress() const;
  grpc::Status ApplyGradients(grpc::ServerContext* ctx,
                              const ember::v1::WorkerApplyGradientsRequest* req,
                              ember::v1::WorkerApplyGradientsResponse* resp) override;
  grpc::Status ExportRows(grpc::ServerContext* ctx, const ember::v1::ExportRowsRequest* req,
                          ember::v1::ExportRowsResponse* resp) override;
  grpc::Status ImportRows(grpc::ServerContext* ctx, const ember::v1::ImportRowsRequest* req,
                          ember::v1::ImportRowsResponse* resp) override;
  grpc::Status ShardStatus(grpc::ServerContext* ctx, const ember::v1::ShardStatusRequest* req,
                           ember::v1::ShardStatusResponse* resp) override;
  grpc::Status WriteCheckpoint(grpc::ServerContext* ctx,
                               const ember::v1::WriteCheckpointRequest* req,
                               ember::v1::WriteCheckpointResponse* resp) override;
  grpc::Status LoadCheckpoint(grpc::ServerContext* ctx, const ember::v1::LoadCheckpointRequest* req,
                              ember::v1::LoadCheckpointResponse* resp) override;
  grpc::Status UpdateShards(grpc::ServerContext* ctx, const ember::v1::UpdateShardsRequest* req,
                            ember::v1::UpdateShardsResponse* resp) override;
  grpc::Status UpdateTraining(grpc::ServerContext* ctx,
                              const ember::v1::UpdateTrainingRequest* req,
                              ember::v1::UpdateTrainingResponse* resp) override;

 private:
  // A shard's traffic (GetTableStats); it moves with the shard's entry.
  struct ShardTraffic {
    std::atomic<int64_t> lookup_ids{0}, gradient_ids{0};
  };
  struct ShardEntry {
    backend::ShardId id = 0;
    ember::v1::ShardAssignment assignment;
    std::shared_ptr<ShardTraffic> traffic = std::make_shared<ShardTraffic>();
    // Exactly-once, per shard (it moves with the shard); under apply_mu.
    std::shared_ptr<AppliedIds> applied = std::make_shared<AppliedIds>();
    // Records for some rows only (a shard filled from several by a live
    // move: ImportRowsRequest.applied_for_rows); under apply_mu.
    std::shared_ptr<std::vector<RowsRecord>> rows_applied =
        std::make_shared<std::vector<RowsRecord>>();
  };
  // A SYNC or BOUNDED collection's backup copies here: the last step each
  // primary forwarded at the current epoch (a primary forwards every step
  // to every worker holding backups of its shards, with their parts or
  // none), which a lookup of those copies waits for. Shared: waited on
  // without mu_.
  struct ForwardedSteps {
    absl::Mutex mu;
    std::map<std::string, int64_t> through ABSL_GUARDED_BY(mu);  // by primary address
    // The ranks' digests of the step `through` names, by primary.
    std::map<std::string, StepBarrier::RankDigests> digests ABSL_GUARDED_BY(mu);
    // BOUNDED: the ranks' updates each primary holds for steps it has not
    // forwarded yet (WorkerApplyGradientsRequest.hold), by primary, step
    // and rank, with the parts of the shards backed here; their bytes are
    // bounded by max_pending_step_bytes.
    std::map<std::string, std::map<int64_t, std::map<int32_t, Contribution>>> held
        ABSL_GUARDED_BY(mu);
    int64_t held_bytes ABSL_GUARDED_BY(mu) = 0;
    // Set when the collection moves to another epoch (this is replaced):
    // the waiting lookups' answer.
    std::optional<absl::Status> moved ABSL_GUARDED_BY(mu);
  };
  struct Collection {
    int64_t epoch = 0;
    int64_t generation = 0;  // tells a collection from a later one of the same name
    std::map<std::pair<std::string, int32_t>, ShardEntry> shards;
    // Shards staged for a live move to epoch `staged_epoch` (> epoch; 0:
    // none): filled by ImportRows at that epoch, unseen by the data plane,
    // adopted by the UpdateShards to it (CreateShardsRequest.staged).
    int64_t staged_epoch = 0;
    std::map<std::pair<std::string, int32_t>, ShardEntry> staged;
    // Serialises updates, imports and checkpoint copies of the collection.
    std::unique_ptr<absl::Mutex> apply_mu = std::make_unique<absl::Mutex>();
    // Orders the updates a trainer sends (taken before apply_mu, held while
    // they are forwarded to backups, which apply_mu is not): replication.cc.
    std::unique_ptr<absl::Mutex> forward_mu = std::make_unique<absl::Mutex>();
    // Set when a forward to `broken_backup` failed (BrokenReplication):
    // updates are refused until the collection moves to another epoch.
    // Under apply_mu.
    std::string broken_backup, broken_why;
    // Its trainers' steps (TrainingSpec); replaced, its held steps dropped,
    // when the collection moves to another epoch. Shared: a caller waits on
    // it without mu_.
    std::shared_ptr<StepBarrier> steps = std::make_shared<StepBarrier>(StepBarrier::Options{});
    // Replaced with the barrier at a new epoch (steps may start over).
    std::shared_ptr<ForwardedSteps> forwarded = std::make_shared<ForwardedSteps>();
  };
  // The step a SYNC collection's new barrier takes over at a new epoch:
  // the last every shard it steps here had applied (its own barrier's, or
  // a promoted backup's forwarded), none when a shard is new here.
  // `backed`: each shard held before the epoch and the primary it backed
  // ("" for its own).
  static std::optional<std::pair<int64_t, StepBarrier::RankDigests>> SeedOf(
      const Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed);

  // A data call refused as busy (`busy`, EnterDataCall's): a link
  // channel's bytes are taken off the link first (up to kMaxBusyReceives
  // calls at once; past that the channel is dropped), so that the link
  // stays in step and the channel is kept, and the refusal says so
  // (kLinkBytesTaken). A channel whose bytes cannot be taken is dropped
  // (Use), and its refusal is the answer instead.
  absl::Status RefuseBusy(const std::string& owner, uint64_t channel, uint64_t seq,
                          const ember::v1::ShmSlice& sent, const absl::Status& busy);
  // NOT_FOUND unless this worker holds the collection.
  absl::StatusOr<Collection*> HeldCollection(const std::string& name) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // HeldCollection, and FAILED_PRECONDITION unless `epoch` is current.
  absl::StatusOr<Collection*> FindCollection(const std::string& name, int64_t epoch) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const ShardEntry*> FindShard(const Collection& c,
                                              const ember::v1::ShardRef& ref) const;
  // FindShard, as the codec's ShardResolver sees it; each shard found is
  // appended to *found (the codec resolves features in request order, once
  // each), so the handler has a feature's entry without a second lookup.
  auto ShapesOf(const Collection& c, std::vector<const ShardEntry*>* found) const {
    return [this, &c, found](const ember::v1::ShardRef& ref) -> absl::StatusOr<ShardShape> {
      auto shard = FindShard(c, ref);
      if (!shard.ok()) return shard.status();
      found->push_back(*shard);
      return ShardShape{(*shard)->id, (*shard)->assignment.rows(), (*shard)->assignment.cols(),
                        (*shard)->assignment.table().has_dynamic()};
    };
  }
  static bool SameAssignments(const std::map<std::pair<std::string, int32_t>, ShardEntry>& held,
                              const ember::v1::CreateShardsRequest& req);
  // CreateShards with `staged`: a live move's shards, allocated beside the
  // held collection for a later epoch.
  grpc::Status StageShards(const ember::v1::CreateShardsRequest& req);
  // The shard ImportRows at `epoch` writes: a held one at the held epoch,
  // or a staged one at the staged epoch (*staged set).
  absl::StatusOr<const ShardEntry*> ImportTarget(const std::string& collection, int64_t epoch,
                                                 const ember::v1::ShardRef& ref,
                                                 Collection** c, bool* staged) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // ImportRows' copy_from: rows of another shard held here (the rows it
  // changed since a mark, or all) into `to`; the rows copied.
  absl::StatusOr<int64_t> CopyWithin(const Collection& c, const ShardEntry& to,
                                     const ember::v1::ImportRowsRequest& req)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Whether an update names a shard of a dynamic table (shards it does not
  // hold count as not: the codec refuses them).
  bool TouchesDynamicTable(const Collection& c,
                           const ember::v1::WorkerApplyGradientsRequest& req) const;
  // ImportRows' writing: a fixed shard's rows, or a dynamic one's slots with
  // their slot_meta, or rows by id.
  absl::Status ImportInto(const ShardEntry& shard, const ember::v1::ImportRowsRequest& req,
                          const std::vector<float>& weights, const std::vector<float>& state);
  // A step barrier for `training` (max_pending_step_bytes its bound).
  std::shared_ptr<StepBarrier> MakeSteps(const ember::v1::TrainingSpec& training) const;
  // An update applied as it arrives (ASYNC collections).
  grpc::Status ApplyNow(const grpc::ServerContext* ctx, Collection& coll, GradientCall& in,
                        const ember::v1::WorkerApplyGradientsRequest& req,
                        ember::v1::WorkerApplyGradientsResponse* resp)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Replication (replication.cc). OK when the update may go on here: the
  // caller is a trainer and no shard touched is a backup copy, or the
  // caller is the primary of every shard touched (from_primary, with the
  // collection's replication key where tokens are on).
  absl::Status CheckReplicationRole(const ShardEntry& entry,
                                    const ember::v1::WorkerApplyGradientsRequest& req) const;
  // Whether any shard of c has backups (its updates are forwarded: they
  // come to the host whole).
  static bool ForwardsUpdates(const Collection& c);
  // A primary's forward of an update (requests[i] on entries[i], the parts
  // it is about to apply) to the backups of those shards, all at once
  // (StartForward; null when no shard has backups), and the wait for them
  // (FinishForward, apply_mu not held: a backup's apply takes it), before
  // it applies them itself. OK when every backup applied it. A refusal
  // every backup gave alike (nothing applied anywhere) is returned as it
  // came; any other failure marks c broken (Collection::broken_backup) and
  // is UNAVAILABLE. Both under forward_mu: backups apply in the primary's
  // order.
  struct Forwarding;
  struct ForwardingDeleter {
    void operator()(Forwarding* f) const;  // waits for the calls in flight
  };
  using ForwardingPtr = std::unique_ptr<Forwarding, ForwardingDeleter>;
  // `header`: the forward's collection, epoch, request id and digest (and
  // a step's step and step_ranks); `features[i]`: requests[i]'s KJT key;
  // `authorization`: the trainer's token, sent on; `deadline`: the
  // trainer's (the forward timeout caps it).
  // `everyone`: backups sent the forward even with no parts for them (a
  // SYNC step's, which their lookups wait for).
  ForwardingPtr StartForward(const ember::v1::WorkerApplyGradientsRequest& header,
                             const std::optional<std::string>& authorization,
                             absl::Time deadline, const std::vector<std::string>& features,
                             const std::vector<backend::GradientRequest>& requests,
                             const std::vector<const ShardEntry*>& entries,
                             const std::set<std::string>& everyone = {});
  // The requests of such a forward, one per backup address (what
  // StartForward sends); mean_lengths[i] (if given): requests[i]'s
  // ShardGradient.mean_lengths.
  std::map<std::string, ember::v1::WorkerApplyGradientsRequest> ForwardRequests(
      const ember::v1::WorkerApplyGradientsRequest& header, const std::vector<std::string>& features,
      const std::vector<backend::GradientRequest>& requests,
      const std::vector<const ShardEntry*>& entries, const std::set<std::string>& everyone,
      const std::vector<absl::Span<const int64_t>>* mean_lengths = nullptr) const;
  // Every worker holding a backup of a shard c holds (as its primary).
  static std::set<std::string> BackupWorkers(const Collection& c);
  // Sends `out` (a request per backup address) at once; null when empty.
  ForwardingPtr LaunchForward(std::map<std::string, ember::v1::WorkerApplyGradientsRequest> out,
                              const std::string& collection, int64_t epoch,
                              const std::optional<std::string>& authorization,
                              absl::Time deadline);
  // BOUNDED replicas: a rank's update `held` for its step by this primary
  // (WorkerApplyGradientsRequest.hold) goes to every worker backing a shard
  // of it, with the parts of the shards each backs (MirrorRequests, under
  // mu_; none when the collection is not BOUNDED or has no backups), and is
  // acknowledged once every one keeps it (SendMirror, without mu_: else
  // UNAVAILABLE, and the trainer's retry sends it again).
  std::map<std::string, ember::v1::WorkerApplyGradientsRequest> MirrorRequests(
      const Collection& c, const ember::v1::WorkerApplyGradientsRequest& req,
      const Contribution& held) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status SendMirror(std::map<std::string, ember::v1::WorkerApplyGradientsRequest> mirror,
                          const std::string& collection, int64_t epoch,
                          const std::optional<std::string>& authorization, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A backup keeps a held update from its primary in c.forwarded (nothing
  // applied; dropped when the primary forwards its step).
  absl::Status KeepHeld(const Collection& c, GradientCall& in,
                        const ember::v1::WorkerApplyGradientsRequest& req)
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // A BOUNDED collection's steps at a new epoch (c's shards and their
  // replication already the new epoch's; `backed` as SeedOf's): what its
  // barrier applied and held, with what each primary whose shards were
  // promoted here had forwarded and held (c.forwarded), for the new barrier
  // (StepBarrier::Resume). Aborts the old barrier with `why`.
  static StepBarrier::Carried CarryBoundedSteps(
      Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed,
      const absl::Status& why);
  // BOUNDED with more than one backup: the updates a primary replaced at
  // a new epoch held (`before`, under its mu) kept here for the new primary
  // of the shards backed here (`after`, not shared yet): if it dies in turn
  // before it applies them, the next copy promoted completes them.
  static void KeepHeldForNewPrimaries(
      const Collection& c, const std::map<std::pair<std::string, int32_t>, std::string>& backed,
      const ForwardedSteps& before, ForwardedSteps* after) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // A forward's sender, whatever it carries: the replication key (where
  // tokens are on) and the primary of a shard this worker backs.
  absl::Status CheckForwardSender(const Collection& c,
                                  const ember::v1::WorkerApplyGradientsRequest& req) const;
  // Records a primary's step forward (`req`, applied or a duplicate) in
  // c.forwarded.
  static void NoteForwardedStep(Collection& c, const ember::v1::WorkerApplyGradientsRequest& req);
  // A lookup of backup copies of a SYNC collection: waits until each of
  // their primaries' forwarded step reaches `target`; UNAVAILABLE with
  // kSignalReadPrimary when one has forwarded none at this epoch.
  static absl::Status WaitForwarded(ForwardedSteps* f, const std::set<std::string>& primaries,
                                    int64_t target, int64_t step, absl::Time deadline);
  absl::Status FinishForward(ForwardingPtr f, const std::string& collection, Collection* c);
  // Applies requests[i] on entries[i] here once `forward` (null: none) has
  // them on every backup; c->apply_mu is held on entry and on return. A
  // refusal here of what the backups applied leaves this copy behind: c is
  // marked broken with itself as the one behind. *forwarded (if given):
  // false when the backups did not all apply it (nothing applied here).
  absl::Status ApplyAfterBackups(ForwardingPtr forward, const std::string& collection,
                                 Collection* c,
                                 const std::vector<backend::GradientRequest>& requests,
                                 const std::vector<const ShardEntry*>& entries,
                                 bool* forwarded = nullptr);
  // UNAVAILABLE while a forward of c failed (Collection::broken_backup).
  static absl::Status RefuseWhileBroken(const Collection& c, const std::string& collection);
  ember::v1::Worker::Stub* PeerStub(const std::string& address);
  // A SYNC/BOUNDED update checked and copied into *held (nothing applied).
  absl::Status HoldContribution(const Collection& coll, GradientCall& in,
                                const ember::v1::WorkerApplyGradientsRequest& req,
                                Contribution* held) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Applies a complete step of collection `name` (as StepBarrier::ApplyFn)
  // if it is still held with barrier `steps`: the ranks' parts in rank
  // order, in one backend call; shards that applied a contribution's
  // request id before (a retry after a move) skip it.
  absl::Status ApplyStep(const std::string& name, const StepBarrier* steps, int64_t step,
                         const std::vector<const Contribution*>& ranks) ABSL_LOCKS_EXCLUDED(mu_);
  // ApplyStep for collection `name`'s barrier `steps`, as the barrier calls it.
  StepBarrier::ApplyFn StepApplier(const std::string& name, const StepBarrier* steps) {
    return [this, name, steps](int64_t step, const std::vector<const Contribution*>& ranks) {
      return ApplyStep(name, steps, step, ranks);
    };
  }
  // Lookup's prefetch form (WorkerLookupRequest.prefetch): the features
  // checked as a lookup's, their rows brought into the shards' caches
  // (EmbeddingBackend::Prefetch), no outputs; never waits for a step.
  grpc::Status Prefetch(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest& req,
                        ember::v1::WorkerLookupResponse* resp);
  // A lookup of a SYNC/BOUNDED collection waits (without mu_) until the
  // steps it must see are applied; INVALID_ARGUMENT without a step.
  absl::Status WaitForStep(const ember::v1::WorkerLookupRequest& req, absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts a refusal for NaN/Inf or overflow (the message says so) and
  // passes it on.
  absl::Status CountRefusal(const absl::Status& s);
  // The backend's update of `requests` (requests[i] on shard entries[i]),
  // timed and counted; its refusal counted and returned.
  absl::Status RunUpdate(const std::vector<backend::GradientRequest>& requests,
                         const std::vector<const ShardEntry*>& entries);
  // Remembers update `id` (with its digest) on every shard touched
  // (exactly-once), counting ids forgotten early.
  void RecordApplied(const std::set<const ShardEntry*>& touched, uint64_t id, uint64_t digest,
                     const std::string& collection);
  // INVALID_ARGUMENT for a bad name, epoch or assignment.
  absl::Status CheckAssignments(
      const std::string& collection, int64_t epoch,
      const google::protobuf::RepeatedPtrField<ember::v1::ShardAssignment>& shards) const;
  // Creates the shards in c (memory checked first; all or nothing). Called
  // without mu_: allocating and initialising a large shard must not stall
  // the lookups and updates of the collections already held. `c` is not
  // published yet (CreateShards) or a private set of new shards
  // (UpdateShards), so nothing else sees it meanwhile.
  absl::Status AllocateShards(
      const std::string& collection,
      const google::protobuf::RepeatedPtrField<ember::v1::ShardAssignment>& shards, Collection* c)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops every shard of c from the backend (an unpublished set, or one
  // being dropped).
  void DropAll(const std::string& collection, const Collection& c);
  void DropAll(const std::string& collection,
               const std::map<std::pair<std::string, int32_t>, ShardEntry>& shards);
  // DropAll (once an update in flight finished), then the collection out of
  // collections_; the iterator after it.
  using CollectionMap = std::map<std::string, std::unique_ptr<Collection>>;
  CollectionMap::iterator EraseCollection(CollectionMap::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<backend::EmbeddingBackend> backend_;
  const WorkerServiceOptions options_;
  std::atomic<int64_t> prefetches_{0}, prefetch_ids_{0};
  std::atomic<int64_t> lookups_{0}, lookup_ids_{0}, lookup_bytes_{0}, placed_lookups_{0},
      id_buffer_lookups_{0}, link_lookups_{0}, link_busy_kept_{0};
  // Busy refusals taking a link call's bytes now (RefuseBusy), and the most
  // at once.
  std::atomic<int> busy_receives_{0};
  static constexpr int kMaxBusyReceives = 8;
  std::atomic<int64_t> backend_lookup_ns_{0}, backend_update_ns_{0};
  std::atomic<int64_t> lookup_handler_ns_{0};  // successful lookups, whole handler
  std::atomic<int64_t> updates_{0}, update_ids_{0}, duplicates_{0};
  std::atomic<int64_t> nonfinite_refused_{0};
  std::atomic<int64_t> nonfinite_skipped_ids_{0};
  std::atomic<int64_t> overflow_refused_{0};
  std::atomic<int64_t> dedup_forgotten_early_{0};
  // The step counters of barriers gone (a collection dropped or moved), so
  // that the metrics' counters never go down.
  std::atomic<int64_t> retired_steps_applied_{0}, retired_steps_aborted_{0},
      retired_step_wait_ns_{0}, retired_step_ranks_missing_{0};
  void RetireSteps(const StepBarrier& steps);
  // Data calls in progress, and those refused for max_queued_calls.
  std::atomic<int64_t> calls_in_progress_{0}, busy_refused_{0};
  // Counts a data call in (EnterDataCall) and out (when destroyed).
  class DataCall {
   public:
    explicit DataCall(std::atomic<int64_t>* n) : n_(n) {}
    DataCall(DataCall&& o) : n_(o.n_) { o.n_ = nullptr; }
    DataCall(const DataCall&) = delete;
    ~DataCall() {
      if (n_ != nullptr) n_->fetch_sub(1);
    }

   private:
    std::atomic<int64_t>* n_;
  };
  // RESOURCE_EXHAUSTED (kWorkerBusy) when max_queued_calls are in progress;
  // UNAVAILABLE while fenced (SetLease). `bounded` false: counted, never
  // refused as busy (a primary's forward, which lookups here waiting for
  // its step would otherwise keep out).
  absl::StatusOr<DataCall> EnterDataCall(const char* what, bool bounded = true);
  // Steady-clock nanoseconds of the last Tick; the lease (0: no fencing).
  std::atomic<int64_t> last_tick_ns_{0}, lease_ns_{0};
  std::atomic<bool> fenced_{false};
  mutable absl::Mutex mu_;
  CollectionMap collections_ ABSL_GUARDED_BY(mu_);
  ShmChannels channels_;
  const RequestCodec codec_;  // decodes data calls from every transport of channels_
  // Collections whose CreateShards is allocating (outside mu_): a second
  // create of the same name meanwhile is refused (ABORTED).
  std::set<std::string> creating_ ABSL_GUARDED_BY(mu_);
  // UpdateShards calls allocating shards for a collection (outside mu_):
  // one at a time per collection.
  std::set<std::string> updating_ ABSL_GUARDED_BY(mu_);
  int64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
  // Forwards to backups: calls, their time (ns), and those that failed.
  std::atomic<int64_t> forwards_{0}, forward_ns_{0}, forward_failures_{0};
  std::atomic<int64_t> busy_forward_retries_{0};
  // Forwards in flight (replication.cc). A new placement's UpdateShards
  // cancels those of older epochs to backups it no longer names before it
  // waits for mu_, which their primaries hold while a forward waits: a
  // backup cut off without a reset (a partition) would otherwise hold a
  // take-over for the forward timeout.
  absl::Mutex in_flight_mu_;
  std::set<Forwarding*> in_flight_ ABSL_GUARDED_BY(in_flight_mu_);
  // A placement under way, by collection (from CancelForwards until it is
  // in place, PlacedForwards): forwards started meanwhile at an older
  // epoch to backups it does not name are cancelled as they start.
  struct Placing {
    int64_t epoch = 0;
    std::set<std::string> named;  // the backups it names
  };
  std::map<std::string, Placing> placing_ ABSL_GUARDED_BY(in_flight_mu_);
  void CancelLocked(Forwarding* f, const Placing& placing)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(in_flight_mu_);
  void CancelForwards(const ember::v1::UpdateShardsRequest& placement)
      ABSL_LOCKS_EXCLUDED(in_flight_mu_);
  void PlacedForwards(const ember::v1::UpdateShardsRequest& placement)
      ABSL_LOCKS_EXCLUDED(in_flight_mu_);
  void ForgetForward(Forwarding* f) ABSL_LOCKS_EXCLUDED(in_flight_mu_);
  mutable absl::Mutex peers_mu_;
  std::string own_address_ ABSL_GUARDED_BY(peers_mu_);
  std::map<std::string, std::unique_ptr<ember::v1::Worker::Stub>> peers_
      ABSL_GUARDED_BY(peers_mu_);
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_WORKER_SERVICE_H_
