// A worker whose backend reports itself lost (a sticky CUDA error, here a
// fake backend) stops heartbeating: the coordinator sees its lease lapse
// (which starts recovery of its shards elsewhere), while a healthy worker
// beside it stays live.
#include "server/worker/worker_server.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/service.grpc.pb.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/forwarding_backend.h"
#include "server/coordinator/coordinator_service.h"

namespace ember {
namespace worker {
namespace {

// A CPU backend whose Health() answers what the test says.
class FlakyBackend : public backend::ForwardingBackend {
 public:
  FlakyBackend(std::unique_ptr<backend::EmbeddingBackend> inner, std::atomic<bool>* lost)
      : ForwardingBackend(std::move(inner)), lost_(lost) {}
  std::string Name() const override { return "flaky/" + inner()->Name(); }
  absl::Status Health() const override {
    return lost_->load() ? absl::UnavailableError("device lost (test)") : absl::OkStatus();
  }

 private:
  std::atomic<bool>* lost_;
};

std::map<std::string, bool> LiveByAddress(ember::v1::Coordinator::Stub* stub) {
  grpc::ClientContext ctx;
  ember::v1::ListWorkersResponse resp;
  std::map<std::string, bool> out;
  if (stub->ListWorkers(&ctx, ember::v1::ListWorkersRequest(), &resp).ok()) {
    for (const auto& w : resp.workers()) out[w.info().address()] = w.live();
  }
  return out;
}

TEST(WorkerServerTest, LostBackendStopsHeartbeatsAndTheLeaseLapses) {
  coordinator::CoordinatorOptions co;
  co.lease = absl::Milliseconds(600);
  auto service = coordinator::CoordinatorService::Create(co);
  ASSERT_TRUE(service.ok()) << service.status();
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(service->get());
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_TRUE(server != nullptr && port != 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  std::atomic<bool> lost_a{false}, lost_b{false};
  auto start = [&](std::atomic<bool>* lost, bool shared_memory) {
    WorkerServerOptions o;
    o.coordinator = address;
    o.service.shared_memory = shared_memory;
    o.register_timeout = absl::Seconds(10);
    o.backend_factory = [lost]() -> absl::StatusOr<std::unique_ptr<backend::EmbeddingBackend>> {
      backend::CpuBackendOptions c;
      c.memory_limit_bytes = int64_t{1} << 26;
      auto inner = backend::CreateCpuBackend(c);
      if (!inner.ok()) return inner.status();
      return std::unique_ptr<backend::EmbeddingBackend>(
          std::make_unique<FlakyBackend>(std::move(*inner), lost));
    };
    return WorkerServer::Start(o);
  };
  auto a = start(&lost_a, true);
  auto w = start(&lost_b, false);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(w.ok()) << w.status();
  auto stub = ember::v1::Coordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto live = LiveByAddress(stub.get());
  ASSERT_TRUE(live[(*a)->address()]);
  ASSERT_TRUE(live[(*w)->address()]);
  {
    // Each advertises the transports it offers.
    grpc::ClientContext ctx;
    ember::v1::ListWorkersResponse resp;
    ASSERT_TRUE(stub->ListWorkers(&ctx, ember::v1::ListWorkersRequest(), &resp).ok());
    std::map<std::string, std::vector<std::string>> transports;
    for (const auto& x : resp.workers()) {
      transports[x.info().address()].assign(x.info().transports().begin(),
                                            x.info().transports().end());
    }
    EXPECT_EQ(transports[(*a)->address()], (std::vector<std::string>{"grpc", "shm"}));
    EXPECT_EQ(transports[(*w)->address()], (std::vector<std::string>{"grpc"}));
  }

  lost_a = true;
  // Within a few leases the coordinator sees a's lease lapse; b stays live.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && LiveByAddress(stub.get())[(*a)->address()]) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  live = LiveByAddress(stub.get());
  EXPECT_FALSE(live[(*a)->address()]);
  EXPECT_TRUE(live[(*w)->address()]);

  (*a)->Shutdown(absl::Milliseconds(100));
  (*w)->Shutdown(absl::Milliseconds(100));
  server->Shutdown();
}

}  // namespace
}  // namespace worker
}  // namespace ember
