// Prometheus metrics of a server process (coordinator or worker), served in
// the text format over plain HTTP on --metrics_port at /metrics (no
// embedding data there; in Kubernetes a NetworkPolicy limits who reaches
// it). Uses Debian's prometheus-cpp.
//
//   ember_rpc_total{method, code}            every RPC served, by status code
//   ember_rpc_duration_seconds{method}       their latency (histogram)
// plus what each server adds through AddGauges / AddCounters (scrape-time
// callbacks over its own state, e.g. ember_worker_lookup_ids_total).
//
// Thread-safe.
#ifndef EMBER_SERVER_COMMON_METRICS_H_
#define EMBER_SERVER_COMMON_METRICS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
class Registry;
}  // namespace prometheus

namespace ember {

class ServerMetrics {
 public:
  // One sample of a scrape-time family: its labels and value.
  struct Sample {
    std::map<std::string, std::string> labels;
    double value = 0;
  };
  using Source = std::function<std::vector<Sample>()>;

  // Serves on `bind` ("HOST:PORT"; port 0 picks one), or not at all when
  // `bind` is empty (the RPC metrics are still kept). `server`: the
  // `server` label of every series ("coordinator", "worker").
  static absl::StatusOr<std::unique_ptr<ServerMetrics>> Start(const std::string& bind,
                                                              const std::string& server);
  ~ServerMetrics();

  // The port /metrics is served on (0 when not served).
  int port() const { return port_; }

  // Interceptor creators to install on the grpc::ServerBuilder
  // (builder.experimental().SetInterceptorCreators): they count and time
  // every RPC.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
  Interceptors();

  // Families computed at scrape time. Names follow Prometheus conventions:
  // ember_ prefix, _total for counters, _bytes / _seconds units.
  void AddGauge(const std::string& name, const std::string& help, Source source);
  void AddCounter(const std::string& name, const std::string& help, Source source);

  // Records one RPC (what the interceptors call).
  void ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds);

 private:
  class Impl;
  ServerMetrics() = default;
  std::shared_ptr<Impl> impl_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

// The canonical name of a status code, as the `code` label has it ("OK",
// "INVALID_ARGUMENT", ...).
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace ember

#endif  // EMBER_SERVER_COMMON_METRICS_H_
