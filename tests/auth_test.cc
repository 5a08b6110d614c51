// Token authentication end to end (server/common/auth.h): a cluster started
// with --auth_token_file refuses calls without a valid token
// (UNAUTHENTICATED) and calls beyond the token's role (PERMISSION_DENIED)
// before doing anything, and serves the rest: admins create and drop,
// trainers look up, apply gradients and read, workers register.
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "proto/service.grpc.pb.h"
#include "server/common/auth.h"
#include "server/common/grpc_util.h"
#include "tests/local_cluster.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

constexpr char kEmberctl[] = "cli/emberctl";
constexpr char kWorker[] = "w0rker-token-5e1f0a77c2";
constexpr char kTrainer[] = "tr4iner-token-91b3d00e4a";
constexpr char kAdmin[] = "adm1n-token-7c44e2f9b1";

absl::StatusOr<std::unique_ptr<client::Client>> Connect(const std::string& address,
                                                        const std::string& token) {
  client::ClientOptions o;
  o.timeout = absl::Seconds(20);
  o.max_attempts = 1;
  o.auth_token = token;
  return client::Client::Connect(address, o);
}

TEST(AuthTest, TokensAndRolesGuardEveryPort) {
  const std::string file = ::testing::TempDir() + "/ember_tokens";
  std::ofstream(file) << "worker " << kWorker << "\ntrainer " << kTrainer << "\nadmin " << kAdmin
                      << "\n";
  testing_util::LocalCluster cluster(kEmberctl, 2, {"--auth_token_file=" + file});
  ASSERT_TRUE(cluster.ok()) << "emberctl up with tokens did not come up";

  // Connecting reads the deployment: refused without a valid token.
  EXPECT_EQ(Connect(cluster.coordinator(), "").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(Connect(cluster.coordinator(), "not-a-token-0000000000").status().code(),
            absl::StatusCode::kUnauthenticated);
  auto trainer_or = Connect(cluster.coordinator(), kTrainer);
  auto admin_or = Connect(cluster.coordinator(), kAdmin);
  ASSERT_TRUE(trainer_or.ok()) << trainer_or.status();
  ASSERT_TRUE(admin_or.ok()) << admin_or.status();
  client::Client* trainer = trainer_or->get();
  client::Client* admin = admin_or->get();
  auto workers = trainer->ListWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  ASSERT_EQ(workers->workers_size(), 2);

  const auto spec = testing_util::TestSpec("guarded");
  EXPECT_EQ(trainer->CreateCollection(spec, "row_wise").status().code(),
            absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(admin->CreateCollection(spec, "row_wise").ok());

  // Trainers train: look up, apply gradients, read tables.
  std::mt19937 rng(3);
  const auto kjt = testing_util::RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 8, false);
  auto kt = trainer->Lookup("guarded", kjt);
  ASSERT_TRUE(kt.ok()) << kt.status();
  client::KeyedTensor grads = *kt;
  for (float& g : grads.values) g = 0.5f;
  EXPECT_TRUE(trainer->ApplyGradients("guarded", kjt, grads).ok());
  int64_t rows = 0, dim = 0;
  EXPECT_TRUE(trainer->ExportTable("guarded", "t_sum", &rows, &dim).ok());
  EXPECT_EQ(rows, 301);
  // ...but not change the deployment.
  EXPECT_EQ(trainer->DropCollection("guarded").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(trainer->Checkpoint("guarded").status().code(), absl::StatusCode::kPermissionDenied);

  // The workers' own ports: no token, or a trainer's for an admin call.
  const std::string worker_address = workers->workers(0).info().address();
  auto stub = ember::v1::Worker::NewStub(MakeChannel(worker_address));
  {
    grpc::ClientContext ctx;
    ember::v1::WorkerLookupRequest req;
    req.set_collection("guarded");
    ember::v1::WorkerLookupResponse resp;
    EXPECT_EQ(stub->Lookup(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ember::v1::DropShardsRequest req;
    req.set_collection("guarded");
    ember::v1::DropShardsResponse resp;
    EXPECT_EQ(stub->DropShards(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    AddToken(&ctx, kTrainer);
    ember::v1::DropShardsRequest req;
    req.set_collection("guarded");
    ember::v1::DropShardsResponse resp;
    EXPECT_EQ(stub->DropShards(&ctx, req, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // A stranger cannot register a worker; a trainer token is not a worker's.
  auto coordinator = ember::v1::Coordinator::NewStub(MakeChannel(cluster.coordinator()));
  for (const std::string& token : {std::string(), std::string(kTrainer)}) {
    grpc::ClientContext ctx;
    AddToken(&ctx, token);
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address("127.0.0.1:1");
    ember::v1::RegisterWorkerResponse resp;
    const grpc::Status s = coordinator->RegisterWorker(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), token.empty() ? grpc::StatusCode::UNAUTHENTICATED
                                            : grpc::StatusCode::PERMISSION_DENIED);
  }
  workers = admin->ListWorkers();
  ASSERT_TRUE(workers.ok());
  EXPECT_EQ(workers->workers_size(), 2);  // nothing was registered
  // The refused calls changed nothing: the collection is still served.
  EXPECT_TRUE(trainer->Lookup("guarded", kjt).ok());
  EXPECT_TRUE(admin->DropCollection("guarded").ok());
}

TEST(AuthTest, ServersRefuseABadTokenFile) {
  const std::string file = ::testing::TempDir() + "/ember_bad_tokens";
  std::ofstream(file) << "admin short\n";
  testing_util::LocalCluster cluster(kEmberctl, 1, {"--auth_token_file=" + file});
  EXPECT_FALSE(cluster.ok());
}

}  // namespace
}  // namespace ember
