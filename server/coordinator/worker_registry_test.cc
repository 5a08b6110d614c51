// The coordinator's worker registry: a live worker's address cannot be taken
// by another process (only its own re-registration, or anyone once its lease
// lapsed), and workers silent for forget_workers_after that hold nothing are
// removed.
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/service.grpc.pb.h"
#include "server/coordinator/coordinator_service.h"

namespace ember {
namespace coordinator {
namespace {

class WorkerRegistryTest : public testing::Test {
 protected:
  void Start(absl::Duration lease, absl::Duration forget) {
    CoordinatorOptions o;
    o.lease = lease;
    o.forget_workers_after = forget;
    auto s = CoordinatorService::Create(o);
    ASSERT_TRUE(s.ok()) << s.status();
    service_ = std::move(*s);
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr && port != 0);
    stub_ = ember::v1::Coordinator::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  grpc::Status Register(const std::string& address, int pid, std::string* id = nullptr) {
    grpc::ClientContext ctx;
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(address);
    req.mutable_worker()->set_host("h");
    req.mutable_worker()->set_pid(pid);
    ember::v1::RegisterWorkerResponse resp;
    grpc::Status s = stub_->RegisterWorker(&ctx, req, &resp);
    if (id != nullptr) *id = resp.worker_id();
    return s;
  }
  // A CPU worker of `host` advertising `ddr` bytes, and (when its memory
  // defaulted to the host's) the host's `host_memory`.
  grpc::Status RegisterOn(const std::string& address, const std::string& host, int64_t ddr,
                          int64_t host_memory, int pid,
                          ember::v1::ComputeDevice device = ember::v1::CPU) {
    grpc::ClientContext ctx;
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_device(device);
    req.mutable_worker()->set_address(address);
    req.mutable_worker()->set_host(host);
    req.mutable_worker()->set_pid(pid);
    req.mutable_worker()->set_ddr_bytes(ddr);
    req.mutable_worker()->set_host_memory_bytes(host_memory);
    ember::v1::RegisterWorkerResponse resp;
    return stub_->RegisterWorker(&ctx, req, &resp);
  }
  // A CUDA worker of host "h" with 1 GiB of HBM and `ddr` bytes of host
  // memory, serving `kernels`.
  grpc::Status RegisterCuda(const std::string& address, const std::vector<std::string>& kernels,
                            int64_t ddr = int64_t{64} << 30) {
    grpc::ClientContext ctx;
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(address);
    req.mutable_worker()->set_host("h");
    req.mutable_worker()->set_pid(1);
    req.mutable_worker()->set_device(ember::v1::CUDA);
    req.mutable_worker()->set_hbm_bytes(int64_t{1} << 30);
    req.mutable_worker()->set_ddr_bytes(ddr);
    for (const auto& k : kernels) req.mutable_worker()->add_compute_kernels(k);
    ember::v1::RegisterWorkerResponse resp;
    return stub_->RegisterWorker(&ctx, req, &resp);
  }
  int Listed() {
    grpc::ClientContext ctx;
    ember::v1::ListWorkersResponse resp;
    EXPECT_TRUE(stub_->ListWorkers(&ctx, ember::v1::ListWorkersRequest(), &resp).ok());
    return resp.workers_size();
  }

  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ember::v1::Coordinator::Stub> stub_;
};

TEST_F(WorkerRegistryTest, ALiveWorkersAddressIsNotTakenOver) {
  Start(absl::Milliseconds(400), absl::Minutes(10));
  std::string first;
  ASSERT_TRUE(Register("127.0.0.1:7001", 100, &first).ok());
  const grpc::Status other = Register("127.0.0.1:7001", 200);
  EXPECT_EQ(other.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(other.error_message().find("live worker"), std::string::npos) << other.error_message();
  // The same process again (it was forgotten): allowed, replacing its entry.
  std::string again;
  ASSERT_TRUE(Register("127.0.0.1:7001", 100, &again).ok());
  EXPECT_NE(again, first);
  EXPECT_EQ(Listed(), 1);
  // Once the lease has lapsed, a new process may take the address.
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_TRUE(Register("127.0.0.1:7001", 200).ok());
  EXPECT_EQ(Listed(), 1);
}

TEST_F(WorkerRegistryTest, SilentWorkersHoldingNothingAreForgotten) {
  Start(absl::Milliseconds(200), absl::Milliseconds(500));
  ASSERT_TRUE(Register("127.0.0.1:7002", 1).ok());
  ASSERT_TRUE(Register("127.0.0.1:7003", 2).ok());
  EXPECT_EQ(Listed(), 2);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Listed() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(Listed(), 0);
}

// No more workers are kept than a plan can use (4,096): past that a
// registration makes room by forgetting the longest silent worker that holds
// nothing, or is refused while every one is live. (Registrations at fresh
// addresses once grew the registry without bound.)
TEST_F(WorkerRegistryTest, TheRegistryIsBounded) {
  Start(absl::Seconds(8), absl::Minutes(10));
  std::string first;
  ASSERT_TRUE(Register("127.0.0.1:1", 1, &first).ok());
  for (int i = 2; i <= 4096; ++i) {
    ASSERT_TRUE(Register("127.0.0.1:" + std::to_string(i), i).ok()) << i;
  }
  EXPECT_EQ(Listed(), 4096);
  const grpc::Status full = Register("127.0.0.1:5000", 5000);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  absl::SleepFor(absl::Milliseconds(8200));  // every lease lapses
  std::string fresh;
  ASSERT_TRUE(Register("127.0.0.1:5000", 5000, &fresh).ok());
  EXPECT_EQ(Listed(), 4096);
  grpc::ClientContext ctx;
  ember::v1::HeartbeatRequest req;
  req.set_worker_id(first);  // the longest silent: forgotten to make room
  ember::v1::HeartbeatResponse resp;
  EXPECT_EQ(stub_->Heartbeat(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A worker whose memory defaulted to its host's is refused beside live
// workers of the same host that already claim part of it (it would
// overcommit the host); the message names them and the most it may take.
// Explicit capacities (no host_memory_bytes), other hosts, a worker's own
// re-registration and hosts with nothing claimed are let through.
TEST_F(WorkerRegistryTest, DefaultMemoryMayNotOvercommitTheHost) {
  Start(absl::Seconds(30), absl::Minutes(10));
  constexpr int64_t kGiB = int64_t{1} << 30;
  ASSERT_TRUE(RegisterOn("127.0.0.1:1", "h", 40 * kGiB, 0, 1).ok());  // explicit
  ASSERT_TRUE(RegisterOn("127.0.0.1:2", "h", 40 * kGiB, 0, 2).ok());
  const grpc::Status s = RegisterOn("127.0.0.1:3", "h", 90 * kGiB, 100 * kGiB, 3);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(s.error_message().find("host h has 100.00 GiB"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("already advertise 80.00 GiB"), std::string::npos);
  EXPECT_NE(s.error_message().find("--memory_gib at most 20.00"), std::string::npos);
  EXPECT_NE(s.error_message().find("127.0.0.1:1"), std::string::npos);
  EXPECT_EQ(Listed(), 2);
  // A CUDA worker's ddr_bytes is its fused_uvm shards' host memory, which
  // --uvm_memory_gib sets.
  const grpc::Status gpu =
      RegisterOn("127.0.0.1:6", "h", 30 * kGiB, 100 * kGiB, 6, ember::v1::CUDA);
  EXPECT_EQ(gpu.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(gpu.error_message().find("--uvm_memory_gib at most 20.00"), std::string::npos)
      << gpu.error_message();
  // A negative host memory is malformed, as a negative capacity is.
  EXPECT_EQ(RegisterOn("127.0.0.1:5", "h", 1, -1, 5).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // What fits is taken; another host is another host's memory.
  EXPECT_TRUE(RegisterOn("127.0.0.1:3", "h", 20 * kGiB, 100 * kGiB, 3).ok());
  EXPECT_TRUE(RegisterOn("127.0.0.1:4", "other", 90 * kGiB, 100 * kGiB, 4).ok());
  // The same worker registering again (same address) does not count itself.
  EXPECT_TRUE(RegisterOn("127.0.0.1:4", "other", 90 * kGiB, 100 * kGiB, 4).ok());
  EXPECT_EQ(Listed(), 4);
}

// Plans over live workers take only the kernels every one of them serves
// (WorkerInfo.compute_kernels; a worker advertising none: dense and
// fused): a table too large for HBM is not put behind a UVM kernel no
// worker implements, and the refusal offers none.
TEST_F(WorkerRegistryTest, PlansUseOnlyTheKernelsEveryWorkerServes) {
  Start(absl::Seconds(30), absl::Minutes(10));
  ASSERT_TRUE(
      RegisterCuda("127.0.0.1:7101", {"dense", "fused", "fused_uvm", "fused_uvm_caching"}).ok());
  ASSERT_TRUE(RegisterCuda("127.0.0.1:7102", {}).ok());
  ember::v1::PreviewPlanRequest req;
  auto* spec = req.mutable_spec();
  spec->set_name("p");
  auto* t = spec->add_tables();
  t->set_name("t");
  t->set_num_embeddings(1000);
  t->set_embedding_dim(64);
  t->add_feature_names("f");
  {
    grpc::ClientContext ctx;
    ember::v1::PreviewPlanResponse resp;
    ASSERT_TRUE(stub_->PreviewPlan(&ctx, req, &resp).ok());
    EXPECT_EQ(std::vector<std::string>(resp.plan().topology().compute_kernels().begin(),
                                       resp.plan().topology().compute_kernels().end()),
              (std::vector<std::string>{"dense", "fused"}));
    EXPECT_EQ(resp.plan().tables(0).compute_kernel(), "fused");
  }
  t->set_num_embeddings(int64_t{8} << 20);  // 2 GiB: more than both GPUs' HBM
  grpc::ClientContext ctx;
  ember::v1::PreviewPlanResponse resp;
  const grpc::Status st = stub_->PreviewPlan(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_EQ(st.error_message().find("allow fused_uvm"), std::string::npos) << st.error_message();
  // A topology given with the request plans offline, with every kernel.
  req.mutable_topology()->set_world_size(2);
  req.mutable_topology()->set_compute_device(ember::v1::CUDA);
  req.mutable_topology()->set_hbm_cap_bytes(int64_t{1} << 30);
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub_->PreviewPlan(&ctx2, req, &resp).ok());
  EXPECT_NE(resp.plan().tables(0).compute_kernel(), "fused");
}

// CUDA workers that serve fused_uvm (and advertise host memory for it):
// a table too large for their HBM is planned there instead of refused,
// one small enough stays fused; without the host memory it is refused.
TEST_F(WorkerRegistryTest, ATableBeyondHbmIsPlannedOnFusedUvm) {
  Start(absl::Seconds(30), absl::Minutes(10));
  ASSERT_TRUE(RegisterCuda("127.0.0.1:7201", {"dense", "fused", "fused_uvm"}).ok());
  ASSERT_TRUE(RegisterCuda("127.0.0.1:7202", {"dense", "fused", "fused_uvm"}).ok());
  ember::v1::PreviewPlanRequest req;
  auto* spec = req.mutable_spec();
  spec->set_name("p");
  auto* t = spec->add_tables();
  t->set_name("t");
  t->set_num_embeddings(1000);
  t->set_embedding_dim(64);
  t->add_feature_names("f");
  auto plan = [&](ember::v1::PreviewPlanResponse* resp) {
    grpc::ClientContext ctx;
    return stub_->PreviewPlan(&ctx, req, resp);
  };
  ember::v1::PreviewPlanResponse resp;
  ASSERT_TRUE(plan(&resp).ok());
  EXPECT_EQ(resp.plan().tables(0).compute_kernel(), "fused");
  EXPECT_EQ(std::vector<std::string>(resp.plan().topology().compute_kernels().begin(),
                                     resp.plan().topology().compute_kernels().end()),
            (std::vector<std::string>{"dense", "fused", "fused_uvm"}));
  t->set_num_embeddings(int64_t{8} << 20);  // 2 GiB of weights: more than both GPUs' HBM
  const grpc::Status st = plan(&resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(resp.plan().tables(0).compute_kernel(), "fused_uvm");
  t->set_num_embeddings(int64_t{1} << 30);  // 256 GiB: past their host memory too
  const grpc::Status too_big = plan(&resp);
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << too_big.error_message();
}

}  // namespace
}  // namespace coordinator
}  // namespace ember
