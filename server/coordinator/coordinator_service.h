// The coordinator's gRPC service (proto/service.proto, ember.v1.Coordinator):
// the registry of workers (leases kept by heartbeat), and of collections —
// each planned over the live workers, allocated on them, and versioned by an
// epoch. Never on the data path.
//
// Checkpoints: Checkpoint has every worker holding a collection's shards
// write them (one replica of a data-parallel table) into a new directory
// under ROOT, then commits the manifest (server/checkpoint/); the last
// `keep_checkpoints` committed checkpoints of a collection under a ROOT are
// kept. Restore verifies a checkpoint (every file's size and CRC) before it
// creates anything, plans it afresh over the live workers and has them load
// their shards, re-cut by row and column range; the collection becomes
// visible only once loaded. Every checkpoint taken is in the catalogue
// (ListCheckpoints).
//
// Recovery: a monitor thread watches the leases of the workers holding each
// collection. When one lapses (or the worker re-registers, empty, at the
// same address), the collection goes RECOVERING (clients get UNAVAILABLE
// and retry), the dead worker's shards move to a spare live worker that
// holds nothing of the collection (a replacement), else to the live workers
// with the least assigned, at a new epoch; then they are loaded from the
// collection's latest checkpoint (spec.recovery: only the lost shards, or
// the whole collection rolled back), or come back freshly initialised where
// there is none. GetCollection reports the state, the checkpoint recovered
// from and what was lost. A data-parallel table just loses the dead
// replica (others still hold it).
//
// Thread-safe: gRPC calls it from many threads; collection creation,
// dropping and restoring are serialised, and so are checkpoints.
#ifndef EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include <cstdint>
#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "planner/cost_model.h"
#include "planner/planner.h"
#include "proto/service.grpc.pb.h"
#include "server/common/auth.h"
#include "server/coordinator/move_plan.h"
#include "server/coordinator/state_store.h"

namespace ember {
namespace coordinator {

struct CoordinatorOptions {
  // Tokens and roles (auth.h); disabled by default. A call to a worker
  // carries the coordinator credential made for the name that registered it
  // (TokenTable::CoordinatorTokenFor).
  TokenTable auth;
  // TLS for the calls to workers (tls.h); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
  // A worker that has not sent a heartbeat for this long is not live.
  absl::Duration lease = absl::Seconds(5);
  // A worker silent this long, whose shards have all been recovered
  // elsewhere, is removed from the registry (ListWorkers stops showing it).
  absl::Duration forget_workers_after = absl::Minutes(10);
  // Deadline of the coordinator's calls to workers (create and drop shards).
  absl::Duration worker_rpc_timeout = absl::Seconds(60);
  // Deadline of a worker's checkpoint write or load (its whole share).
  absl::Duration checkpoint_rpc_timeout = absl::Minutes(30);
  // Default ROOT for checkpoints; empty: Checkpoint needs a dir.
  std::string checkpoint_dir;
  // > 0: every collection is checkpointed under checkpoint_dir this often.
  absl::Duration checkpoint_every = absl::ZeroDuration();
  // Committed checkpoints kept per collection and ROOT (older ones removed,
  // except the bases a kept incremental checkpoint builds on).
  int keep_checkpoints = 3;
  // Periodic checkpoints are incremental (CheckpointRequest.incremental).
  bool checkpoint_incremental = false;
  // An incremental checkpoint whose chain would hold more than this many
  // checkpoints (itself included) is written whole instead; >= 1.
  int checkpoint_full_every = 8;
  // > 0: an incremental checkpoint whose chain holds at least this many
  // checkpoints is compacted into a full one in the background once it is
  // committed (checkpoint::CompactCheckpoint); 0: never.
  int checkpoint_compact_after = 4;
  // Non-empty: the state (workers, collections, plans, epochs, checkpoint
  // catalogue) is kept in a LevelDB store here, written before each answer
  // that changes it, and reloaded by a restarted coordinator.
  std::string state_dir;
  // Set: the planner's cost model (--cost_model=FILE, e.g. from emberctl
  // calibrate) for workers of `cost_model_device`; plans for workers of
  // another device are refused. Unset: the device's defaults.
  std::optional<planner::CostModel> cost_model;
  ember::v1::ComputeDevice cost_model_device = ember::v1::CPU;
};

class CoordinatorService final : public ember::v1::Coordinator::Service {
 public:
  // Opens options.state_dir (if set) and reloads what a previous run kept:
  // workers keep their ids (and get one lease to heartbeat again), the
  // collections their plans and epochs. The first monitor pass then
  // reconciles with what the workers hold: shards of unknown collections or
  // other epochs are dropped, missing ones recovered. UNAVAILABLE if the
  // store is held by another process, DATA_LOSS if it is damaged.
  static absl::StatusOr<std::unique_ptr<CoordinatorService>> Create(
      const CoordinatorOptions& options);
  ~CoordinatorService() override;

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const ember::v1::RegisterWorkerRequest* req,
                              ember::v1::RegisterWorkerResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const ember::v1::HeartbeatRequest* req,
                         ember::v1::HeartbeatResponse* resp) override;
  grpc::Status ListWorkers(grpc::ServerContext* ctx, const ember::v1::ListWorkersRequest* req,
                           ember::v1::ListWorkersResponse* resp) override;
  grpc::Status CreateCollection(grpc::ServerContext* ctx,
                                const ember::v1::CreateCollectionRequest* req,
                                ember::v1::CreateCollectionResponse* resp) override;
  grpc::Status GetCollection(grpc::ServerContext* ctx, const ember::v1::GetCollectionRequest* req,
                             ember::v1::GetCollectionResponse* resp) override;
  grpc::Status ListCollections(grpc::ServerContext* ctx,
                               const ember::v1::ListCollectionsRequest* req,
                               ember::v1::ListCollectionsResponse* resp) override;
  grpc::Status PreviewPlan(grpc::ServerContext* ctx, const ember::v1::PreviewPlanRequest* req,
                           ember::v1::PreviewPlanResponse* resp) override;
  grpc::Status DropCollection(grpc::ServerContext* ctx, const ember::v1::DropCollectionRequest* req,
                              ember::v1::DropCollectionResponse* resp) override;
  // A stepped collection's trainer count from a step on: stored first (the
  // source of truth for shards created later), then set on every worker
  // (UpdateTraining); idempotent, so a call that failed on a worker is
  // retried as it is.
  grpc::Status SetTrainers(grpc::ServerContext* ctx, const ember::v1::SetTrainersRequest* req,
                           ember::v1::SetTrainersResponse* resp) override;
  grpc::Status Checkpoint(grpc::ServerContext* ctx, const ember::v1::CheckpointRequest* req,
                          ember::v1::CheckpointResponse* resp) override;
  grpc::Status Restore(grpc::ServerContext* ctx, const ember::v1::RestoreRequest* req,
                       ember::v1::RestoreResponse* resp) override;
  grpc::Status ListCheckpoints(grpc::ServerContext* ctx,
                               const ember::v1::ListCheckpointsRequest* req,
                               ember::v1::ListCheckpointsResponse* resp) override;
  // Moves every shard off a worker (live copy, no update lost) and keeps it
  // out of new plans; the worker can then exit.
  grpc::Status DrainWorker(grpc::ServerContext* ctx, const ember::v1::DrainWorkerRequest* req,
                           ember::v1::DrainWorkerResponse* resp) override;
  // Serves a collection from another number of workers, moving its shards
  // live (coordinator_scale.cc).
  grpc::Status ScaleCollection(grpc::ServerContext* ctx,
                               const ember::v1::ScaleCollectionRequest* req,
                               ember::v1::ScaleCollectionResponse* resp) override;

  // Checkpoints one collection under `root` (empty: options.checkpoint_dir),
  // incrementally if asked (CheckpointRequest.incremental). Counted and
  // timed for the metrics (Stats).
  absl::StatusOr<ember::v1::CheckpointInfo> CheckpointCollection(const std::string& collection,
                                                                 const std::string& root,
                                                                 bool incremental = false);

 private:
  absl::StatusOr<ember::v1::CheckpointInfo> WriteCollectionCheckpoint(
      const std::string& collection, const std::string& root, bool incremental);
  absl::StatusOr<ember::v1::ScaleCollectionResponse> Scale(const std::string& name, int workers)
      ABSL_LOCKS_EXCLUDED(create_mu_, mu_);
  // The base of an incremental checkpoint of `collection` under `root`: its
  // latest committed checkpoint, unless the chain is full
  // (checkpoint_full_every) or unreadable; nullopt: write it whole.
  std::optional<ember::v1::CheckpointManifest> IncrementalBase(const std::string& root,
                                                               const std::string& collection);
  // Keeps the newest keep_checkpoints of `collection` under `root` and the
  // bases they build on; removes the rest, what crashed writes left, and
  // compacted checkpoints' old delta files. Returns the removed directories.
  std::set<std::string> PruneCheckpoints(const std::string& root, const std::string& collection,
                                         const std::string& newest);
  // The compactor thread: rewrites queued incremental checkpoints whole.
  void CompactCheckpoints();
  // Marks `dir` and the bases it builds on as being read (a restore or a
  // recovery's load): pruning leaves them alone until Unpin. Returns what
  // it pinned.
  std::vector<std::string> PinCheckpoint(const std::string& dir) ABSL_LOCKS_EXCLUDED(prune_mu_);
  void Unpin(const std::vector<std::string>& dirs) ABSL_LOCKS_EXCLUDED(mu_);
  struct Worker {
    std::string id;
    ember::v1::WorkerInfo info;
    absl::Time last_heartbeat;
    int64_t seq = 0;  // registration order
    std::string identity;  // the credential that registered it (auth.h Caller)
  };

  // Whether `w` heartbeated within its lease at `now`.
  bool Live(const Worker& w, absl::Time now) const {
    return now - w.last_heartbeat < options_.lease;
  }
  // Live workers in rank order: grouped by host (hosts in order of first
  // registration), registration order within a host.
  std::vector<Worker> LiveWorkers() const ABSL_LOCKS_EXCLUDED(mu_);
  static ember::v1::Topology TopologyOf(const std::vector<Worker>& workers);
  ember::v1::Worker::Stub* StubFor(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  // The credential to present to the worker at `address`: the coordinator
  // token made for the identity that registered it (auth.h), "" when auth is
  // off or no registered worker is there (nothing is sent to a stranger).
  std::string CredentialFor(const std::string& address) const ABSL_LOCKS_EXCLUDED(mu_);
  // The collections whose plans place shards on worker `worker_id`.
  std::vector<std::string> CollectionsOnLocked(const std::string& worker_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Worker ids some collection's ranks name.
  std::set<std::string> NamedWorkersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OK when `caller` may act for worker `worker_id` (itself, or an admin).
  grpc::Status MayActFor(const Caller& caller, const std::string& worker_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Calls `rpc` on every address at once; one status (and, if asked, one
  // response) per address. timeout 0: options.worker_rpc_timeout.
  template <typename Request, typename Response, typename Rpc>
  std::vector<grpc::Status> CallEach(const std::vector<std::string>& addresses,
                                     const std::vector<Request>& requests, Rpc rpc,
                                     absl::Duration timeout = absl::ZeroDuration(),
                                     std::vector<Response>* responses = nullptr);
  // DropShards at `epoch` on each address (NOT_FOUND is fine); `staged`:
  // only the shards staged there for `epoch` (a live move that gave up).
  // One call to the worker at `address`, with options.worker_rpc_timeout
  // and the credential for it (call_each.h).
  template <typename Request, typename Response>
  absl::Status CallWorker(const std::string& address,
                          grpc::Status (ember::v1::Worker::Stub::*rpc)(grpc::ClientContext*,
                                                                         const Request&, Response*),
                          const Request& request, Response* response);
  absl::Status DropOnWorkers(const std::string& collection, int64_t epoch,
                             const std::vector<std::string>& addresses, bool staged = false);
  // Before a BOUNDED collection moves (its held steps would be dropped with
  // their trainers told nothing): fences its steps on the workers at
  // `addresses` (those of `info` still alive) at the highest step any holds
  // and waits, up to the step timeout, until every step through it is
  // applied on each (training/step_barrier.h: FenceAt, WaitApplied). A step
  // that does not complete in time is logged and the move goes on (its
  // trainers resend it, as after a step timeout).
  void FenceSteps(const ember::v1::CollectionInfo& info, const std::vector<std::string>& addresses);
  // Plans `spec` over the live workers (or, given `explicit_plan`, checks
  // that plan against them) and creates its shards on them (all or
  // nothing); the collection is not registered. Needs create_mu_.
  // *worker_ids: the id of the worker at each rank.
  // The planner's options for a topology: the configured cost model, or
  // FAILED_PRECONDITION when it is for another device.
  absl::StatusOr<planner::PlannerOptions> PlannerOptionsFor(const ember::v1::Topology& t) const;
  absl::StatusOr<ember::v1::CollectionInfo> PlanAndCreate(
      const ember::v1::CollectionSpec& spec, const std::string& sharding_type,
      std::vector<std::string>* worker_ids,
      const ember::v1::ShardingPlan* explicit_plan = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  CoordinatorService(const CoordinatorOptions& options, std::unique_ptr<StateStore> store);
  void Load(const StateStore::State& state) ABSL_LOCKS_EXCLUDED(mu_);
  // Compares what the live workers hold with the collections (see Create).
  void Reconcile() ABSL_LOCKS_EXCLUDED(create_mu_, mu_);
  // Writes to the state store (OK without one).
  absl::Status Persist(const StateStore::Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<int64_t> NextEpoch() ABSL_LOCKS_EXCLUDED(mu_);
  // Writes (before any worker hears of it) the placement a recovery or
  // drain is moving `name` to, and later that its data is in place.
  absl::Status PersistMove(const std::string& name, const ember::v1::CollectionInfo& next,
                           const std::vector<std::string>& next_ids, bool data_in_place)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Persists and publishes a collection with its rank -> worker id map.
  absl::Status Register(const ember::v1::CollectionInfo& info, const std::vector<std::string>& ids)
      ABSL_LOCKS_EXCLUDED(mu_);
  void PeriodicCheckpoints();
  void MonitorLoop();
  void ForgetDeadWorkers();

 public:
  // What the coordinator's metrics report (server/common/metrics.h).
  struct Stats {
    int64_t workers_live = 0, workers_lost = 0;
    std::map<std::string, int64_t> collections_by_state;  // SERVING, DEGRADED, RECOVERING
    int64_t checkpoints = 0;  // in the catalogue
    // Checkpoints written since start (periodic and asked for): how many
    // succeeded and failed, the time they took, the last one's duration and
    // when the last successful one finished (0: none yet).
    int64_t checkpoints_ok = 0, checkpoints_failed = 0;
    double checkpoint_seconds = 0, last_checkpoint_seconds = 0;
    double last_checkpoint_unix_seconds = 0;
    // Bytes of shard files the successful checkpoints wrote, whole ones and
    // incremental ones (CheckpointInfo.base set); background compactions of
    // incremental chains, by result.
    int64_t checkpoint_bytes_full = 0, checkpoint_bytes_incremental = 0;
    int64_t compactions_ok = 0, compactions_failed = 0;
    // Live moves (drains, rescales, copies made anew), by kind and result; the bytes the
    // successful ones copied between workers and within one (a re-cut
    // shard's rows that stay); the last successful one's fence.
    int64_t drains_ok = 0, drains_failed = 0, scales_ok = 0, scales_failed = 0;
    int64_t copies_ok = 0, copies_failed = 0;  // replicated shards' copies made anew
    int64_t move_bytes_between_workers = 0, move_bytes_local = 0;
    double last_move_fence_seconds = 0;
    // Replicated collections' lost ranks taken over by backups.
    int64_t replica_takeovers = 0;
  };
  Stats GetStats() const;

 private:
  // Re-places and reloads the shards of the collection's dead workers.
  // With drain_id: moves that worker's shards away instead, copying them
  // live (MoveLive), and returns how it went.
  absl::Status RecoverCollection(const std::string& name, const std::string& drain_id = "")
      ABSL_LOCKS_EXCLUDED(create_mu_, mu_);
  // Moves `ranks` of info to info's plan epoch with their assignments
  // under it (UpdateShards); the statuses, one per address in *at.
  std::vector<grpc::Status> MoveHolders(const ember::v1::CollectionInfo& info,
                                        const std::set<int>& ranks, std::vector<std::string>* at);
  // A replicated collection's lost ranks (coordinator_replicas.cc): every
  // shard on them taken over by a backup (`promoted`, PromoteCopies'
  // plan) at a new epoch, nothing rolled back; alive lost ranks (reported
  // behind) drop their copies. Under create_mu_ (RecoverCollection's).
  absl::Status TakeOver(const std::string& name, const ember::v1::CollectionInfo& before,
                        ember::v1::CollectionInfo promoted, const std::vector<std::string>& ids,
                        const std::set<int>& lost, const std::set<std::string>& alive,
                        int promoted_shards, absl::Time start)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  // Makes the copies a replicated collection lacks (MissingCopies) anew,
  // live (MoveLive): on a spare worker in the rank of a worker gone, else on
  // the least-loaded live ranks (planner::PlaceBackups). Retried by the
  // monitor (after 30 s when no worker can take them, 10 s after a failed
  // move).
  absl::Status RestoreCopies(const std::string& name) ABSL_LOCKS_EXCLUDED(create_mu_, mu_);
  // Moves every live holder of the collection to a new epoch with its
  // current (persisted) placement and publishes it SERVING with `why`: the
  // way back after a failed drain or an interrupted recovery.
  absl::Status ReadoptLocked(const std::string& name, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  // A live move (live_move.cc): the collection goes from placement
  // `before` to `after` (rank -> worker id `after_ids`) while `before`
  // serves. Every worker of `after` that held the collection stages the
  // shards it does not hold as they are; one new to it creates them at
  // after's epoch. fence_epoch lies between the two plans' epochs.
  struct LiveMove {
    std::string name;
    std::string what;  // for notes and logs ("draining rank 1 (...)")
    int64_t fence_epoch = 0;
    ember::v1::CollectionInfo before, after;
    std::vector<std::string> after_ids;
  };
  // What a live move copied: every row, and those that went from one
  // worker to another (the rest stayed on their worker, re-cut).
  struct MoveStats {
    int shards = 0;  // shards made (staged or created) and filled
    int64_t bytes_copied = 0, bytes_between_workers = 0;
    double fence_ms = 0, total_ms = 0;
  };
  // Copies the shards live: destinations staged or created, a bulk copy
  // and catch-up rounds (rows changed since the last mark) while `before`
  // serves; then the fence (every holder to fence_epoch), the last
  // catch-up with each shard's step and exactly-once record, the new
  // placement persisted with its data in place, and the switch (staged
  // shards adopted, shards no longer placed dropped). *fenced: the fence
  // was sent (a failure from then on needs the old placement re-adopted;
  // before it, `before` still serves and what was made is dropped).
  absl::StatusOr<MoveStats> MoveLive(const LiveMove& m, bool* fenced);
  // A live move that failed (`why`): after its fence, what it created on
  // workers new to the collection is dropped and the old placement
  // re-adopted at a newer epoch; before it, the old placement (which
  // served all along) is registered again, clearing the persisted move.
  void AbandonMove(const LiveMove& m, bool fenced, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  // Counts a live move for the metrics (Stats): `stats` null: it failed.
  enum class MoveKind { kDrain, kScale, kCopies };
  // MoveLive, counted; a failed move abandoned (AbandonMove, its note
  // "<what> failed (why)") and its status so worded.
  absl::StatusOr<MoveStats> Move(const LiveMove& m, MoveKind kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  // Move from `before` to *after (rank -> worker after_ids), the collection
  // serving meanwhile with the note `what`: a fence epoch and a new one
  // (*after's plan takes it), the new placement made durable, then Move.
  absl::StatusOr<MoveStats> MoveTo(const std::string& name, const std::string& what,
                                   const ember::v1::CollectionInfo& before,
                                   ember::v1::CollectionInfo* after,
                                   const std::vector<std::string>& after_ids, MoveKind kind)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(create_mu_);
  void CountMove(MoveKind kind, const MoveStats* stats) ABSL_LOCKS_EXCLUDED(mu_);
  // A live move's switch, once its data is in place and durable: the
  // holders adopt their stages at after's epoch and keep only what it
  // places on them; emptied workers drop the collection. Also finishes a
  // move a restarted coordinator finds with its data in place. A failure
  // is logged: the monitor recovers what a worker then lacks.
  void FinishMove(const std::string& name, const MovePlan& plan,
                  const ember::v1::CollectionInfo& after);
  // One pass of a live copy over `c`'s rows, in chunks of about 4 MiB:
  // `mark`: takes a new mark first; then every row (`whole`) or those
  // changed since c->mark. The rows copied, or the first failure.
  absl::StatusOr<int64_t> CopyPass(const std::string& collection, int64_t epoch, RowCopy* c,
                                   bool mark, bool whole);
  // Copies one shard's rows, optimizer state, step and exactly-once record
  // between workers, whole (a dynamic shard in a live move, under the fence).
  absl::Status CopyShard(const std::string& collection, int64_t epoch, const std::string& from,
                         const ember::v1::ShardRef& from_ref, const std::string& to,
                         const ember::v1::ShardRef& to_ref, int64_t rows);
  void SetState(const std::string& name, ember::v1::CollectionInfo::State state,
                const std::string& note) ABSL_LOCKS_EXCLUDED(mu_);
  // Committed checkpoints of this collection (not of an earlier one of the
  // same name), newest first: the catalogue's and those under
  // checkpoint_dir.
  std::vector<std::string> CheckpointCandidates(const ember::v1::CollectionInfo& info)
      ABSL_LOCKS_EXCLUDED(mu_);

  const CoordinatorOptions options_;
  absl::Mutex create_mu_;  // one create or drop at a time
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);  // by id
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, ember::v1::CollectionInfo> collections_ ABSL_GUARDED_BY(mu_);
  // The id of the worker serving each rank of a collection.
  std::map<std::string, std::vector<std::string>> rank_ids_ ABSL_GUARDED_BY(mu_);
  // Ranks found not to hold their shards (reconciliation): recovered as lost.
  std::map<std::string, std::set<int>> force_lost_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> draining_ ABSL_GUARDED_BY(mu_);  // worker ids: not in new plans
  std::map<std::string, absl::Time> retry_after_ ABSL_GUARDED_BY(mu_);  // recovery back-off
  // Replicated collections' lost ranks taken over by backups.
  int64_t replica_takeovers_ ABSL_GUARDED_BY(mu_) = 0;
  // Moves a previous run left under way (from the state store).
  std::map<std::string, ember::v1::StoredMove> interrupted_ ABSL_GUARDED_BY(mu_);
  const std::unique_ptr<StateStore> store_;  // null without state_dir
  std::atomic<bool> reconcile_pending_{false};
  std::map<std::string, std::unique_ptr<ember::v1::Worker::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  absl::Mutex checkpoint_mu_;  // one checkpoint at a time
  Stats checkpoint_stats_ ABSL_GUARDED_BY(mu_);  // the checkpoint_* and move fields only
  std::vector<ember::v1::CheckpointInfo> catalogue_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::map<std::string, ember::v1::CheckpointInfo> in_progress_ ABSL_GUARDED_BY(mu_);  // by dir
  // Restores under way, by a key of their own (ListCheckpoints shows them).
  std::map<int64_t, ember::v1::RestoreProgress> restoring_ ABSL_GUARDED_BY(mu_);
  int64_t next_restore_ ABSL_GUARDED_BY(mu_) = 0;
  // Held while checkpoints are pruned and while a load pins what it reads,
  // so a prune never removes a directory a load has started on.
  absl::Mutex prune_mu_;
  // Checkpoint directories being read by restores and recoveries (counts).
  std::map<std::string, int> reading_ ABSL_GUARDED_BY(mu_);
  // Incremental checkpoints waiting to be compacted (directories).
  absl::Mutex compact_mu_;
  std::deque<std::string> compact_queue_ ABSL_GUARDED_BY(compact_mu_);
  absl::Notification stop_;
  std::thread periodic_;
  std::thread monitor_;
  std::thread compactor_;
};

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
