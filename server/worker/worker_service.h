// The worker's gRPC service (proto/service.proto, ember.v1.Worker): holds
// the shards the coordinator assigns it in an EmbeddingBackend and serves
// fused lookups and gradient updates over them.
//
// Every request is checked before anything is applied: unknown collection or
// shard (NOT_FOUND), stale epoch (FAILED_PRECONDITION, the client refreshes
// its plan), malformed arrays, ids out of range, wrong gradient shape
// (INVALID_ARGUMENT), responses over the size limit (RESOURCE_EXHAUSTED).
// ApplyGradients is exactly-once per request id: the last
// `dedup_window` ids per collection are remembered.
//
// Thread-safe: gRPC calls it from many threads.
#ifndef EMBER_SERVER_WORKER_WORKER_SERVICE_H_
#define EMBER_SERVER_WORKER_WORKER_SERVICE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "proto/service.grpc.pb.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace worker {

struct WorkerServiceOptions {
  // Largest response (lookup outputs or exported rows) in bytes.
  int64_t max_response_bytes = int64_t{1} << 30;
  // Request ids remembered per collection for exactly-once updates.
  int dedup_window = 65536;
};

class WorkerService final : public ember::v1::Worker::Service {
 public:
  WorkerService(std::unique_ptr<backend::EmbeddingBackend> backend,
                const WorkerServiceOptions& options);
  ~WorkerService() override;

  grpc::Status CreateShards(grpc::ServerContext* ctx, const ember::v1::CreateShardsRequest* req,
                            ember::v1::CreateShardsResponse* resp) override;
  grpc::Status DropShards(grpc::ServerContext* ctx, const ember::v1::DropShardsRequest* req,
                          ember::v1::DropShardsResponse* resp) override;
  grpc::Status Lookup(grpc::ServerContext* ctx, const ember::v1::WorkerLookupRequest* req,
                      ember::v1::WorkerLookupResponse* resp) override;
  grpc::Status ApplyGradients(grpc::ServerContext* ctx,
                              const ember::v1::WorkerApplyGradientsRequest* req,
                              ember::v1::WorkerApplyGradientsResponse* resp) override;
  grpc::Status ExportRows(grpc::ServerContext* ctx, const ember::v1::ExportRowsRequest* req,
                          ember::v1::ExportRowsResponse* resp) override;
  grpc::Status ImportRows(grpc::ServerContext* ctx, const ember::v1::ImportRowsRequest* req,
                          ember::v1::ImportRowsResponse* resp) override;
  grpc::Status ShardStatus(grpc::ServerContext* ctx, const ember::v1::ShardStatusRequest* req,
                           ember::v1::ShardStatusResponse* resp) override;

 private:
  struct ShardEntry {
    backend::ShardId id = 0;
    ember::v1::ShardAssignment assignment;
  };
  struct Collection {
    int64_t epoch = 0;
    std::map<std::pair<std::string, int32_t>, ShardEntry> shards;
    // Exactly-once: ids applied, oldest first; apply_mu serialises updates.
    std::deque<std::string> applied_order;
    absl::flat_hash_set<std::string> applied;
    std::unique_ptr<absl::Mutex> apply_mu = std::make_unique<absl::Mutex>();
  };
  // Decoded arrays of one ShardFeature (owned storage for the backend's spans).
  struct Decoded;

  absl::Status DecodeFeature(const Collection& c, const ember::v1::ShardFeature& f, int64_t* cols,
                             Decoded* out) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // NOT_FOUND unless this worker holds the collection.
  absl::StatusOr<Collection*> HeldCollection(const std::string& name) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // HeldCollection, and FAILED_PRECONDITION unless `epoch` is current.
  absl::StatusOr<Collection*> FindCollection(const std::string& name, int64_t epoch) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const ShardEntry*> FindShard(const Collection& c,
                                              const ember::v1::ShardRef& ref) const;

  const std::unique_ptr<backend::EmbeddingBackend> backend_;
  const WorkerServiceOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Collection>> collections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_WORKER_SERVICE_H_
