// Client: the trainer's handle on an Ember deployment. Connects to the
// coordinator for plans, then talks to workers directly: one fused RPC per
// worker per call, all in parallel, merged into TorchRec's layouts.
//
// Routing follows the plan for every sharding type. Each shard covers a row
// range and a column range of its table: a feature's ids go to every shard
// whose rows hold them (as shard-local ids), and the shard's result lands in
// its columns of the feature's output, partial sums added (row-wise), column
// blocks side by side (column-wise). A row-split MEAN table is looked up as
// SUM and divided by the bag's total length here. A data-parallel table is
// read from one replica (rotating) and gradients go to every replica.
//
// Errors: unknown collection/feature NOT_FOUND; malformed KJT or gradients
// INVALID_ARGUMENT; a worker that cannot be reached UNAVAILABLE after
// retries with back-off, never later than the call's deadline. A stale plan
// (FAILED_PRECONDITION from a worker) is refreshed and the call retried.
//
// Thread-safe: any number of threads may call one Client.
#ifndef EMBER_CLIENT_CLIENT_H_
#define EMBER_CLIENT_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/kjt.h"
#include "proto/service.grpc.pb.h"

namespace ember {
namespace client {

// A KeyedJaggedTensor whose arrays lie in CUDA device memory (of
// ClientOptions::link_device): a GPU trainer's, for LookupOnDevice and
// ApplyGradientsOnDevice. With socket links (no GPU) "device memory" is
// host memory.
struct DeviceKjt {
  std::vector<std::string> keys;
  int64_t batch_size = 0;
  const int64_t* lengths = nullptr;  // [keys.size() * batch_size]
  const int64_t* values = nullptr;   // [num_values]
  int64_t num_values = 0;
  const float* weights = nullptr;    // [num_values], or null
};

// The training step a data call belongs to, and the trainer's rank, for a
// collection whose TrainingSpec is SYNC or BOUNDED: every lookup carries
// its step and every update its step and rank there (INVALID_ARGUMENT
// without); ASYNC collections ignore them. An update of a stepped
// collection goes to every worker holding a shard of it (with no gradients
// where the rank has none for it), and its call waits up to the collection's
// step_timeout_s (plus the client's timeout) for the other ranks.
struct StepTag {
  int64_t step = -1;  // < 0: none
  int32_t rank = -1;  // updates; < 0: none
};

struct ClientOptions {
  absl::Duration timeout = absl::Seconds(30);  // whole call, retries included
  // Sent as "authorization: Bearer TOKEN" on every call to the coordinator
  // and the workers (server/common/auth.h); empty: none.
  std::string auth_token;
  // TLS to the coordinator and the workers (server/common/tls.h:
  // ChannelCredentialsFrom); null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // Attempts per call for UNAVAILABLE and a busy worker (RESOURCE_EXHAUSTED
  // "worker busy"), waiting initial_backoff, then twice as long each time
  // up to max_backoff, never past the call's deadline. A collection the
  // coordinator reports RECOVERING (a live move's fence, a recovery), and
  // an unreachable worker of a replicated collection (its backups take
  // over within a lease), are waited for until the deadline, however many
  // attempts that takes.
  int max_attempts = 4;
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
  // Bulk arrays of lookups and updates travel through shared memory
  // (client/shm_channel.h) to workers on this host (a loopback address)
  // that offer it; others, and calls that find their channel busy, go
  // inline in the gRPC messages.
  bool shared_memory = true;
  // A directory (on tmpfs) this process shares with workers of its host,
  // mounted where their --shm_dir is (e.g. one volume two pods of a node
  // mount): channels are files in it, and every worker is tried, whatever
  // its address; one on another host refuses, and calls to it go inline
  // (asking again a minute later). Empty: POSIX shared memory, loopback
  // workers only.
  std::string shm_dir;
  // Link channels to every worker instead of shared memory: "nccl" (an
  // NCCL link from CUDA device `link_device` of this process to the
  // worker's GPU) or "socket" (a Unix-domain socket, same host: the NCCL
  // channel's protocol without a GPU). A worker that offers none (its
  // --links) gets its calls inline, and the first few such refusals are
  // said on stderr. Empty: none. Connect answers INVALID_ARGUMENT for
  // another name, UNAVAILABLE for "nccl" where libnccl.so.2 cannot be
  // loaded.
  std::string link;
  int link_device = 0;
  // This process's allocator keeps up to this much freed heap for reuse and
  // takes allocations under 32 MiB from the heap (glibc mallopt, as the
  // servers' --keep_freed_heap_mib): the megabytes of request and response
  // buffers each call makes are then not faulted in and zeroed afresh every
  // call (measured: docs/lab-notes/2026-11-benchmarks.md). Process-wide: set
  // at Connect, the last client connected wins. 0 leaves the allocator as
  // it was.
  int keep_freed_heap_mib = 256;
};

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& coordinator,
                                                         const ClientOptions& options = {});
  ~Client();

  // Control plane.
  absl::StatusOr<ember::v1::CollectionInfo> CreateCollection(const ember::v1::CollectionSpec& spec,
                                                             const std::string& sharding_type = "");
  // Creates the collection with `plan` instead of planning (a plan made by
  // hand or by TorchRec; see planner::CheckPlan for what is checked). Its
  // ranks index the workers in ListWorkers order.
  absl::StatusOr<ember::v1::CollectionInfo> CreateCollectionWithPlan(
      const ember::v1::CollectionSpec& spec, const ember::v1::ShardingPlan& plan);
  absl::StatusOr<ember::v1::CollectionInfo> GetCollection(const std::string& collection);
  absl::StatusOr<std::vector<ember::v1::CollectionInfo>> ListCollections();
  absl::Status DropCollection(const std::string& collection);

  // Checkpoints and restores (see ember.v1.Coordinator.Checkpoint/Restore).
  // Checkpoint returns once the manifest is committed; the checkpoint holds
  // every update acknowledged before the call and none started after it
  // returned (an update running during the call may be in some shards and
  // not others: checkpoint between steps for a cross-table cut). `dir`: a
  // ROOT, empty for the coordinator's --checkpoint_dir. Restore creates the
  // collection (named `collection`, or the checkpoint's name) from a
  // checkpoint directory or the latest one under a ROOT, on the live
  // workers, planned afresh; DATA_LOSS naming the file when a checkpoint is
  // damaged (nothing is created). These calls move whole tables: their
  // deadline is their own. `incremental`: only the rows changed since the
  // latest checkpoint under the same ROOT (CheckpointRequest.incremental).
  absl::StatusOr<ember::v1::CheckpointInfo> Checkpoint(
      const std::string& collection, const std::string& dir = "",
      absl::Duration timeout = absl::Minutes(30), bool incremental = false);
  absl::StatusOr<ember::v1::RestoreResponse> Restore(const std::string& from,
                                                     const std::string& collection = "",
                                                     const std::string& sharding_type = "",
                                                     absl::Duration timeout = absl::Minutes(30));
  absl::StatusOr<std::vector<ember::v1::CheckpointInfo>> ListCheckpoints(
      const std::string& collection = "");
  // The restores under way (of `collection`, or all): bytes verified, then
  // loading on the workers.
  absl::StatusOr<std::vector<ember::v1::RestoreProgress>> ListRestores(
      const std::string& collection = "");
  // A SYNC or BOUNDED collection's trainer count from step `from_step` on
  // (ember.v1.Coordinator.SetTrainers); the collection as stored after.
  absl::StatusOr<ember::v1::CollectionInfo> SetTrainers(const std::string& collection,
                                                        int32_t trainers, int64_t from_step);
  // Moves every shard off a worker (copied live, no update lost) and keeps
  // it out of new plans; returns the collections moved.
  absl::StatusOr<std::vector<std::string>> DrainWorker(const std::string& worker_id,
                                                       absl::Duration timeout = absl::Minutes(30));
  // Serves `collection` from `workers` workers, its shards moved live while
  // it trains (ember.v1.Coordinator.ScaleCollection).
  absl::StatusOr<ember::v1::ScaleCollectionResponse> ScaleCollection(
      const std::string& collection, int32_t workers, absl::Duration timeout = absl::Minutes(30));
  absl::StatusOr<ember::v1::ListWorkersResponse> ListWorkers();
  // One worker's shards, memory and traffic counters (Worker.ShardStatus).
  absl::StatusOr<ember::v1::ShardStatusResponse> WorkerStatus(const std::string& address);
  absl::StatusOr<ember::v1::ShardingPlan> PreviewPlan(const ember::v1::CollectionSpec& spec,
                                                      const ember::v1::Topology& topology,
                                                      const std::string& sharding_type = "");

  // The data calls take the KJT (and gradients) as views: a KeyedJaggedTensor
  // / KeyedTensor converts, and the Python SDK passes NumPy or torch memory
  // without a copy. The memory is read during the call only.
  //
  // Pooled features (SUM/MEAN tables): a KeyedTensor of the KJT's features in
  // the collection's order (tables in spec order, then feature_names).
  absl::StatusOr<KeyedTensor> Lookup(const std::string& collection, KjtView kjt,
                                     const StepTag& tag = {});
  // The same into *out: its keys, dims and batch are set and its values
  // buffer reused (not reallocated when large enough, and cleared only
  // where no worker writes: row-split partial sums, shards given no ids), so
  // a trainer that keeps one KeyedTensor across steps does not fault fresh
  // pages in every step. On an error *out is unspecified.
  absl::Status Lookup(const std::string& collection, KjtView kjt, KeyedTensor* out,
                      const StepTag& tag = {});
  // Gradients of Lookup's output (same keys, dims and batch; `grads` with no
  // keys and no length_per_key is taken to be in that layout). request_id
  // makes retries exactly-once; empty: a fresh random id. The id used is
  // written to *used_request_id (if given) whatever the outcome: after a
  // failure that reached some workers and not others, calling again with
  // that id applies the rest without applying anything twice (workers
  // remember ids for their --dedup_ttl). An id names one update: a chosen
  // id travels with a hash of the KJT and gradients, and reused for another
  // update it is INVALID_ARGUMENT on the shards that applied it, nothing
  // applied.
  absl::Status ApplyGradients(const std::string& collection, KjtView kjt, KeyedTensorView grads,
                              const std::string& request_id = "",
                              std::string* used_request_id = nullptr, const StepTag& tag = {});

  // Pooled lookups and their gradients with the arrays in device memory,
  // over link channels (ClientOptions::link; FAILED_PRECONDITION without):
  // `out` / `grads` hold batch_size rows of the features' dims side by side
  // in the collection's order, as Lookup's KeyedTensor (`out_floats` /
  // `grad_floats`: their room, INVALID_ARGUMENT when short; `*layout`, if
  // given, says the keys and dims). Where the bytes go straight between
  // this device's memory and the link: the ids and weights of table-wise
  // and column-wise (all-rows) shards and their pooled outputs, and the
  // gradients of their columns. Staged through host memory: the lengths
  // (the routing reads them), the ids of row-wise shards (bucketed here),
  // row-wise outputs (partial sums, added here), an update's ids and
  // weights (all checked here first, so that no worker applies part of a bad update),
  // MEAN gradients of row-wise shards, and everything for a worker reached
  // without a link channel. Sequence features: use LookupSequence. The
  // arrays must be ready when the call starts (nothing still queued on
  // another stream writing them: the link's own stream reads them) and
  // stay put until it returns; `out` is complete when it returns.
  struct Layout {
    std::vector<std::string> keys;
    std::vector<int64_t> dims;
  };
  // `tag`: as Lookup's and ApplyGradients' (a stepped update's resend
  // must carry the same request id: its digest is the id's, the device
  // arrays not being read here).
  absl::Status LookupOnDevice(const std::string& collection, const DeviceKjt& kjt, float* out,
                              int64_t out_floats, Layout* layout = nullptr,
                              const StepTag& tag = {});
  absl::Status ApplyGradientsOnDevice(const std::string& collection, const DeviceKjt& kjt,
                                      const float* grads, int64_t grad_floats,
                                      const std::string& request_id = "",
                                      std::string* used_request_id = nullptr,
                                      const StepTag& tag = {});

  // Brings the rows `kjt` names into the caches of the shards that keep one
  // (key_value and fused_uvm_caching tables; every copy of a replicated
  // shard), so that this batch's lookup and update find them there:
  // TorchRec's prefetch pipeline, which ember.torch.TrainPipeline runs a
  // batch ahead (mode="prefetch"). Pooled and sequence features alike;
  // tables kept whole in memory get no call. Reads nothing back and
  // changes no value: the rows prefetched (rows already cached, and rows
  // past what a cache holds beside the batch's cached ones, are not; a
  // dynamic table's ids without a row bring in the zero row their lookup
  // reads, and are not counted toward admission). Ids are checked as an update's
  // (INVALID_ARGUMENT; NOT_FOUND for a key the collection does not have).
  absl::StatusOr<int64_t> Prefetch(const std::string& collection, KjtView kjt);

  // Sequence features (NONE tables): one [num_ids, dim] block per KJT key.
  absl::StatusOr<std::vector<SequenceEmbedding>> LookupSequence(const std::string& collection,
                                                                KjtView kjt,
                                                                const StepTag& tag = {});
  absl::Status ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                      const std::vector<SequenceEmbedding>& grads,
                                      const std::string& request_id = "",
                                      std::string* used_request_id = nullptr,
                                      const StepTag& tag = {});
  // The same over caller-owned gradient blocks (no copy).
  absl::Status ApplySequenceGradients(const std::string& collection, KjtView kjt,
                                      absl::Span<const SequenceEmbeddingView> grads,
                                      const std::string& request_id = "",
                                      std::string* used_request_id = nullptr,
                                      const StepTag& tag = {});

  // Replaces a table's weights with `values` (float32 [rows, dim], the
  // table's shape; finite), on every shard and replica; optimizer state and
  // steps are kept. Not atomic with updates running meanwhile: load weights
  // before training (e.g. a TorchRec state dict).
  absl::Status ImportTable(const std::string& collection, const std::string& table,
                           absl::Span<const float> values, int64_t rows, int64_t dim);

  // The whole table as float32 [rows, dim], reassembled from its shards.
  // A dynamic table: ExportDynamicTable.
  absl::StatusOr<std::vector<float>> ExportTable(const std::string& collection,
                                                 const std::string& table, int64_t* rows,
                                                 int64_t* dim);

  // A dynamic (hash-keyed) table's rows: the ids it holds, ascending, and
  // their weights, float32 [ids, dim].
  absl::Status ExportDynamicTable(const std::string& collection, const std::string& table,
                                  std::vector<int64_t>* ids, std::vector<float>* rows,
                                  int64_t* dim);
  // Writes rows for `ids` (distinct; float32 [ids, dim], finite) into a
  // dynamic table: an id held keeps its optimizer state, a new one gets a
  // row with fresh state (its shard evicting by the table's policy to make
  // room: the import counts as writing every row it names). Refused before
  // any worker sees a row when ids repeat, a value is not finite, or more
  // ids go to one shard than it holds (INVALID_ARGUMENT, RESOURCE_EXHAUSTED).
  absl::Status ImportDynamicTable(const std::string& collection, const std::string& table,
                                  absl::Span<const int64_t> ids, absl::Span<const float> rows,
                                  int64_t dim);

  struct Routing;  // a collection's plan prepared for routing (routing.h)

 private:
  // Rows [b, e) of shard `shard_index` of a table, from the worker of
  // `rank` at `address` (ExportRows), in *resp.
  absl::Status ExportRowsOf(const std::string& address, int rank, const std::string& collection,
                            const std::string& table, int32_t shard_index, int64_t b, int64_t e,
                            ember::v1::ExportRowsResponse* resp);
  // The coordinator's ListCheckpoints answer: checkpoints and restores.
  absl::StatusOr<ember::v1::ListCheckpointsResponse> CatalogueOf(const std::string& collection);
  // The client's state: its coordinator stub, the routing and worker stubs
  // it caches, and its transports (shared-memory and link channels), all
  // in client.cc, so that this header names no transport.
  struct Impl;

  Client(const std::string& coordinator, const ClientOptions& options);
  absl::StatusOr<std::shared_ptr<const Routing>> RoutingFor(const std::string& collection,
                                                            bool refresh);
  ember::v1::Worker::Stub* StubFor(const std::string& address);
  // A unary call's deadline and token (the fan-outs set theirs in Fanout).
  void PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const;
  // One unary call to the coordinator with its own deadline.
  template <typename Request, typename Response>
  absl::StatusOr<Response> CallCoordinator(
      grpc::Status (ember::v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Request&,
                                                           Response*),
      const Request& request, absl::Duration timeout);
  // Runs one routed call with stale-plan refresh and UNAVAILABLE retries.
  // An update of a stepped collection (`step_update`) may wait for the
  // other ranks: its deadline grows by the collection's step_timeout_s.
  template <typename Fn>
  absl::Status WithRetries(const std::string& collection, bool retry_unavailable, Fn&& fn,
                           bool step_update = false);

  std::unique_ptr<Impl> impl_;
};

}  // namespace client
}  // namespace ember

#endif  // EMBER_CLIENT_CLIENT_H_
