#include "server/common/metrics.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace ember {

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

// The registry with the RPC families, and the scrape-time families.
class ServerMetrics::Impl : public prometheus::Collectable {
 public:
  explicit Impl(const std::string& server)
      : server_(server),
        registry_(std::make_shared<prometheus::Registry>()),
        rpcs_(prometheus::BuildCounter()
                  .Name("ember_rpc_total")
                  .Help("RPCs served, by method and status code")
                  .Labels({{"server", server}})
                  .Register(*registry_)),
        latency_(prometheus::BuildHistogram()
                     .Name("ember_rpc_duration_seconds")
                     .Help("RPC latency as the server sees it, by method")
                     .Labels({{"server", server}})
                     .Register(*registry_)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out = registry_->Collect();
    absl::MutexLock lock(&mu_);
    for (const Dynamic& d : dynamic_) {
      prometheus::MetricFamily f;
      f.name = d.name;
      f.help = d.help;
      f.type = d.type;
      for (const Sample& s : d.source()) {
        prometheus::ClientMetric m;
        m.label.push_back({"server", server_});
        for (const auto& [k, v] : s.labels) m.label.push_back({k, v});
        if (d.type == prometheus::MetricType::Counter) {
          m.counter.value = s.value;
        } else {
          m.gauge.value = s.value;
        }
        f.metric.push_back(std::move(m));
      }
      out.push_back(std::move(f));
    }
    return out;
  }

  void Observe(const std::string& method, grpc::StatusCode code, double seconds) {
    rpcs_.Add({{"method", method}, {"code", StatusCodeName(code)}}).Increment();
    static const prometheus::Histogram::BucketBoundaries kBuckets = {
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
    latency_.Add({{"method", method}}, kBuckets).Observe(seconds);
  }

  void Add(const std::string& name, const std::string& help, prometheus::MetricType type,
           Source source) {
    absl::MutexLock lock(&mu_);
    dynamic_.push_back({name, help, type, std::move(source)});
  }

 private:
  struct Dynamic {
    std::string name, help;
    prometheus::MetricType type;
    Source source;
  };
  const std::string server_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& latency_;
  mutable absl::Mutex mu_;
  std::vector<Dynamic> dynamic_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Times one RPC from its initial metadata to its status.
class RpcInterceptor : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(ServerMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      metrics_->ObserveRpc(method_, methods->GetSendStatus().error_code(), seconds);
    }
    methods->Proceed();
  }

 private:
  ServerMetrics* const metrics_;
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
};

class RpcInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(ServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // "/ember.v1.Worker/Lookup" -> "Worker/Lookup"
    std::string method = info->method() != nullptr ? info->method() : "unknown";
    const size_t dot = method.rfind('.');
    if (dot != std::string::npos) method = method.substr(dot + 1);
    return new RpcInterceptor(metrics_, std::move(method));
  }

 private:
  ServerMetrics* const metrics_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Start(const std::string& bind,
                                                                    const std::string& server) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics());
  m->impl_ = std::make_shared<Impl>(server);
  if (bind.empty()) return m;
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(bind);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", bind, ": ", e.what()));
  }
  m->exposer_->RegisterCollectable(m->impl_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  m->port_ = ports.empty() ? 0 : ports[0];
  return m;
}

ServerMetrics::~ServerMetrics() = default;

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
ServerMetrics::Interceptors() {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
  v.push_back(std::make_unique<RpcInterceptorFactory>(this));
  return v;
}

void ServerMetrics::AddGauge(const std::string& name, const std::string& help, Source source) {
  impl_->Add(name, help, prometheus::MetricType::Gauge, std::move(source));
}

void ServerMetrics::AddCounter(const std::string& name, const std::string& help, Source source) {
  impl_->Add(name, help, prometheus::MetricType::Counter, std::move(source));
}

void ServerMetrics::ObserveRpc(const std::string& method, grpc::StatusCode code, double seconds) {
  impl_->Observe(method, code, seconds);
}

}  // namespace ember
