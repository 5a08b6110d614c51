// A worker process's server: the Worker service on a port, registered with
// the coordinator and kept live by a heartbeat thread (re-registering if the
// coordinator forgets it). grpc.health.v1 is served too. When the backend
// reports itself lost (EmbeddingBackend::Health, e.g. a sticky CUDA error),
// the worker goes NOT_SERVING and stops heartbeating, so its lease lapses and
// the coordinator recovers its shards on other workers.
//
// Thread-safe after Start.
#ifndef EMBER_SERVER_WORKER_WORKER_SERVER_H_
#define EMBER_SERVER_WORKER_WORKER_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proto/service.grpc.pb.h"
#include "server/common/grpc_util.h"
#include "server/common/metrics.h"
#include "server/worker/worker_service.h"

namespace ember {
namespace worker {

struct WorkerServerOptions {
  std::string listen = "127.0.0.1:0";  // host:port; port 0 picks a free one
  std::string coordinator;             // host:port of the coordinator
  std::string device = "cpu";          // "cpu" or "cuda"
  int cuda_device = 0;                 // cuda: the GPU ordinal
  // cuda: the fixed scratch (backend::CudaBackendOptions::scratch_bytes).
  int64_t cuda_scratch_bytes = int64_t{256} << 20;
  int threads = 1;                     // CPU backend threads per call
  // Dynamic tables: pending ids a shard counts exactly (then a sketch).
  int64_t dynamic_exact_pending_ids = int64_t{1} << 20;
  // Memory for shards. 0: for CPU workers 90% of what the host really has
  // (HostMemoryBytes: the cgroup limit or MemAvailable); for CUDA the card's.
  int64_t memory_limit_bytes = 0;
  // CUDA workers: host memory for fused_uvm shards (BackendConfig::
  // uvm_memory_bytes; 0: the host's share of each visible GPU).
  int64_t uvm_memory_bytes = 0;
  // key_value shards' files (backend::BackendConfig::ssd_dir); empty: the
  // worker does not serve that kernel. 0 bytes: 90% of the disk's free space.
  std::string ssd_dir;
  int64_t ssd_capacity_bytes = 0;
  std::string host;                    // empty: this machine's host name
  // The address registered with the coordinator (what clients dial), e.g. a
  // pod's stable DNS name; empty: the --listen address.
  std::string advertise_address;
  // A plaintext port serving only grpc.health.v1 (kubelet probes); empty: none.
  std::string health_bind;
  absl::Duration register_timeout = absl::Seconds(30);
  // Largest gRPC message received or sent; responses are kept under it
  // (service.max_response_bytes is lowered to fit).
  int64_t max_message_bytes = kMaxMessageBytes;
  WorkerServiceOptions service;
  // TLS (server/common/tls.h): this port's credentials (null: plaintext)
  // and those for calling the coordinator (null: plaintext).
  std::shared_ptr<grpc::ServerCredentials> server_credentials;
  std::shared_ptr<grpc::ChannelCredentials> coordinator_credentials;
  // Prometheus metrics on HOST:PORT (/metrics); empty: not served.
  std::string metrics_bind;
  // Tests: builds the backend instead of `device` (which then only names the
  // device kind the worker reports).
  std::function<absl::StatusOr<std::unique_ptr<backend::EmbeddingBackend>>()> backend_factory;
};

class WorkerServer {
 public:
  // Creates the backend, starts serving and registers. Errors: UNAVAILABLE
  // when the coordinator cannot be reached within register_timeout or the
  // device is missing, INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(const WorkerServerOptions& options);
  ~WorkerServer();

  const std::string& address() const { return address_; }
  // The port /metrics is served on (0: none).
  int metrics_port() const { return metrics_ != nullptr ? metrics_->port() : 0; }
  std::string worker_id() const;
  // Graceful drain: health NOT_SERVING, then the coordinator moves every
  // shard off this worker (copied live, no update lost) before it returns.
  // The worker keeps serving (and heartbeating) meanwhile; Shutdown after.
  absl::Status Drain(absl::Duration timeout = absl::Minutes(10));
  // Stops heartbeats and the server (in-flight calls get `grace`).
  void Shutdown(absl::Duration grace = absl::Seconds(5));

 private:
  WorkerServer() = default;
  void SetServing(bool serving);
  // A call to the coordinator: its deadline and the worker token.
  void PrepareContext(grpc::ClientContext* ctx, absl::Duration timeout) const;
  absl::Status Register(absl::Time deadline);
  void HeartbeatLoop();

  WorkerServerOptions options_;
  std::string address_;
  std::unique_ptr<WorkerService> service_;
  std::unique_ptr<ServerMetrics> metrics_;  // reads service_; destroyed before it
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::Server> health_server_;  // --health_port; may be null
  std::unique_ptr<ember::v1::Coordinator::Stub> coordinator_;
  ember::v1::WorkerInfo info_;
  mutable absl::Mutex id_mu_;
  std::string worker_id_ ABSL_GUARDED_BY(id_mu_);
  absl::Duration lease_ = absl::Seconds(5);
  absl::Notification stop_;
  std::thread heartbeat_;
  std::atomic<bool> shut_down_{false};
  bool backend_lost_ = false;  // heartbeat thread only
};

}  // namespace worker
}  // namespace ember

#endif  // EMBER_SERVER_WORKER_WORKER_SERVER_H_
