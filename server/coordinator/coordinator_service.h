// The coordinator's gRPC service (proto/service.proto, ember.v1.Coordinator):
// the registry of workers (leases kept by heartbeat), and of collections —
// each planned over the live workers, allocated on them, and versioned by an
// epoch. Never on the data path.
//
// Thread-safe: gRPC calls it from many threads; collection creation and
// dropping are serialised.
#ifndef EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/service.grpc.pb.h"

namespace ember {
namespace coordinator {

struct CoordinatorOptions {
  // A worker that has not sent a heartbeat for this long is not live.
  absl::Duration lease = absl::Seconds(5);
  // Deadline of the coordinator's calls to workers (create and drop shards).
  absl::Duration worker_rpc_timeout = absl::Seconds(60);
};

class CoordinatorService final : public ember::v1::Coordinator::Service {
 public:
  explicit CoordinatorService(const CoordinatorOptions& options);

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

 private:
  struct Worker {
    std::string id;
    ember::v1::WorkerInfo info;
    absl::Time last_heartbeat;
    int64_t seq = 0;  // registration order
  };

  // Live workers in rank order: grouped by host (hosts in order of first
  // registration), registration order within a host.
  std::vector<Worker> LiveWorkers() const ABSL_LOCKS_EXCLUDED(mu_);
  static ember::v1::Topology TopologyOf(const std::vector<Worker>& workers);
  ember::v1::Worker::Stub* StubFor(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  template <typename Request, typename Response, typename Rpc>
  std::vector<grpc::Status> CallEach(const std::vector<std::string>& addresses,
                                     const std::vector<Request>& requests, Rpc rpc);
  absl::Status DropOnWorkers(const std::string& collection,
                             const std::vector<std::string>& addresses);

  const CoordinatorOptions options_;
  absl::Mutex create_mu_;  // one create or drop at a time
  mutable absl::Mutex mu_;
  std::map<std::string, Worker> workers_ ABSL_GUARDED_BY(mu_);  // by id
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, ember::v1::CollectionInfo> collections_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<ember::v1::Worker::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace coordinator
}  // namespace ember

#endif  // EMBER_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
