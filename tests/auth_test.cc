// Token authentication end to end (server/common/auth.h): a cluster started
// with --auth_token_file refuses calls without a valid token
// (UNAUTHENTICATED) and calls beyond the token's role (PERMISSION_DENIED)
// before doing anything, and serves the rest: admins create and drop,
// trainers look up, apply gradients and read, workers register.
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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
constexpr char kWorkerB[] = "w1rker-token-0d93b6e7f4";
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
  std::ofstream(file) << "worker a " << kWorker << "\nworker b " << kWorkerB << "\ntrainer " << kTrainer << "\nadmin " << kAdmin
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
  EXPECT_EQ(trainer->SetTrainers("guarded", 2, 0).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(admin->SetTrainers("guarded", 2, 0).status().code(),  // admitted; an ASYNC collection
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(trainer->ScaleCollection("guarded", 1).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(admin->ScaleCollection("guarded", 1000).status().code(),  // admitted; too few workers
            absl::StatusCode::kFailedPrecondition);

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
    ember::v1::UpdateTrainingRequest req;
    req.set_collection("guarded");
    ember::v1::UpdateTrainingResponse resp;
    EXPECT_EQ(stub->UpdateTraining(&ctx, req, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
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

// Records the credentials the coordinator presents to a worker it set up
// at an address the test controls (a process that registered under a
// worker's token), and refuses the work.
class FakeWorker final : public ember::v1::Worker::Service {
 public:
  grpc::Status CreateShards(grpc::ServerContext* ctx, const ember::v1::CreateShardsRequest*,
                            ember::v1::CreateShardsResponse*) override {
    return Record(ctx);
  }
  grpc::Status ImportRows(grpc::ServerContext* ctx, const ember::v1::ImportRowsRequest*,
                          ember::v1::ImportRowsResponse*) override {
    return Record(ctx);
  }
  grpc::Status DropShards(grpc::ServerContext* ctx, const ember::v1::DropShardsRequest*,
                          ember::v1::DropShardsResponse*) override {
    return Record(ctx);
  }
  std::vector<std::string> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  grpc::Status Record(grpc::ServerContext* ctx) {
    absl::MutexLock lock(&mu_);
    const auto a = AuthorizationOf(ctx);
    seen_.push_back(a.has_value() ? std::string(*a) : "");
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "a fake worker");
  }
  absl::Mutex mu_;
  std::vector<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

// A worker's token is one worker: it cannot heartbeat or drain another, a
// second process cannot register with it while the first is live, and what
// the coordinator sends to a worker registered with it is a credential only
// that worker accepts: never the admin token, and nothing the coordinator or
// another worker takes.
TEST(AuthTest, AWorkerTokenActsOnlyAsItsWorkerAndCapturesNothing) {
  const std::string file = ::testing::TempDir() + "/ember_worker_tokens";
  constexpr char kSpare[] = "sp4re-token-a61c0e9d27";
  std::ofstream(file) << "worker a " << kWorker << "\nworker b " << kWorkerB << "\nworker c "
                      << kSpare << "\ntrainer " << kTrainer << "\nadmin " << kAdmin << "\n";
  testing_util::LocalCluster cluster(kEmberctl, 2, {"--auth_token_file=" + file});
  ASSERT_TRUE(cluster.ok()) << "emberctl up with tokens did not come up";
  auto admin_or = Connect(cluster.coordinator(), kAdmin);
  ASSERT_TRUE(admin_or.ok()) << admin_or.status();
  client::Client* admin = admin_or->get();
  ASSERT_TRUE(admin->CreateCollection(testing_util::TestSpec("held"), "table_wise").ok());
  auto workers = admin->ListWorkers();
  ASSERT_TRUE(workers.ok());
  ASSERT_EQ(workers->workers_size(), 2);
  auto coordinator = ember::v1::Coordinator::NewStub(MakeChannel(cluster.coordinator()));

  // Worker a's token heartbeats exactly one of the two ids: its own.
  std::string own_id, other_id, other_address;
  for (const auto& w : workers->workers()) {
    grpc::ClientContext ctx;
    AddToken(&ctx, kWorker);
    ember::v1::HeartbeatRequest req;
    req.set_worker_id(w.worker_id());
    ember::v1::HeartbeatResponse resp;
    const grpc::Status s = coordinator->Heartbeat(&ctx, req, &resp);
    if (s.ok()) {
      own_id = w.worker_id();
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
      other_id = w.worker_id();
      other_address = w.info().address();
    }
  }
  ASSERT_FALSE(own_id.empty());
  ASSERT_FALSE(other_id.empty());
  {  // ...nor drains it.
    grpc::ClientContext ctx;
    AddToken(&ctx, kWorker);
    ember::v1::DrainWorkerRequest req;
    req.set_worker_id(other_id);
    ember::v1::DrainWorkerResponse resp;
    EXPECT_EQ(coordinator->DrainWorker(&ctx, req, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }

  // A process of the test's own, at an address it controls.
  FakeWorker fake;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&fake);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(port, 0);
  const std::string fake_address = absl::StrCat("127.0.0.1:", port);
  auto register_as = [&](const std::string& token) {
    grpc::ClientContext ctx;
    AddToken(&ctx, token);
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(fake_address);
    req.mutable_worker()->set_device(ember::v1::CPU);
    req.mutable_worker()->set_ddr_bytes(int64_t{64} << 30);
    req.mutable_worker()->set_host("elsewhere");
    req.mutable_worker()->set_pid(1);
    ember::v1::RegisterWorkerResponse resp;
    const grpc::Status s = coordinator->RegisterWorker(&ctx, req, &resp);
    return std::make_pair(s, resp.worker_id());
  };
  // Worker a is live: its token registers no second process.
  EXPECT_EQ(register_as(kWorker).first.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  // The spare's token registers one; a row-wise collection (a shard on
  // every live worker) sends it work, which it refuses.
  const auto [registered, fake_id] = register_as(kSpare);
  ASSERT_TRUE(registered.ok()) << registered.error_message();
  EXPECT_FALSE(admin->CreateCollection(testing_util::TestSpec("spread"), "row_wise").ok());
  const std::vector<std::string> seen = fake.seen();
  ASSERT_FALSE(seen.empty()) << "the drain sent the fake worker nothing";
  const std::string credential = seen[0];
  for (const std::string& c : seen) {
    EXPECT_EQ(c, credential);
    EXPECT_EQ(c.find(kAdmin), std::string::npos) << "the admin token went to a stranger";
  }
  ASSERT_EQ(credential.rfind("Bearer ", 0), 0u) << credential;
  const std::string captured = credential.substr(7);
  for (const char* token : {kWorker, kWorkerB, kSpare, kTrainer, kAdmin}) {
    EXPECT_NE(captured, token);
  }

  // The captured credential opens nothing: not the coordinator...
  {
    grpc::ClientContext ctx;
    AddToken(&ctx, captured);
    ember::v1::ListWorkersRequest req;
    ember::v1::ListWorkersResponse resp;
    EXPECT_EQ(coordinator->ListWorkers(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    AddToken(&ctx, captured);
    ember::v1::DrainWorkerRequest req;
    req.set_worker_id(own_id);
    ember::v1::DrainWorkerResponse resp;
    EXPECT_EQ(coordinator->DrainWorker(&ctx, req, &resp).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // ...nor the real workers' control or data RPCs.
  for (const auto& w : workers->workers()) {
    auto stub = ember::v1::Worker::NewStub(MakeChannel(w.info().address()));
    grpc::ClientContext ctx;
    AddToken(&ctx, captured);
    ember::v1::DropShardsRequest req;
    req.set_collection("held");
    ember::v1::DropShardsResponse resp;
    EXPECT_EQ(stub->DropShards(&ctx, req, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext lctx;
    AddToken(&lctx, captured);
    ember::v1::WorkerLookupRequest lreq;
    lreq.set_collection("held");
    ember::v1::WorkerLookupResponse lresp;
    EXPECT_EQ(stub->Lookup(&lctx, lreq, &lresp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // A worker token is not the coordinator's either: no worker takes control
  // calls from it.
  {
    auto stub = ember::v1::Worker::NewStub(MakeChannel(other_address));
    grpc::ClientContext ctx;
    AddToken(&ctx, kWorker);
    ember::v1::DropShardsRequest req;
    req.set_collection("held");
    ember::v1::DropShardsResponse resp;
    EXPECT_EQ(stub->DropShards(&ctx, req, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  // The collection is whole and served by the real workers.
  auto trainer_or = Connect(cluster.coordinator(), kTrainer);
  ASSERT_TRUE(trainer_or.ok());
  std::mt19937 rng(5);
  const auto kjt = testing_util::RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 8, false);
  EXPECT_TRUE((*trainer_or)->Lookup("held", kjt).ok());
  server->Shutdown();
}

// `emberctl tokens` writes files that work as they are: the servers' file
// brings a cluster up, the clients' tokens are accepted in their roles, each
// worker's own file holds its line alone; all readable by their owner only,
// and never replaced.
// A replicated collection under tokens: primaries forward trainers' updates
// to their backups (with the trainer's token and the replication key), and
// the copies stay equal; a trainer's update that claims to come from the
// primary, without the key or with a wrong one, is refused by the backup.
TEST(AuthTest, OnlyServersWriteABackupCopy) {
  const std::string file = ::testing::TempDir() + "/ember_tokens_replicas";
  std::ofstream(file) << "worker a " << kWorker << "\nworker b " << kWorkerB << "\ntrainer "
                      << kTrainer << "\nadmin " << kAdmin << "\n";
  testing_util::LocalCluster cluster(kEmberctl, 2, {"--auth_token_file=" + file});
  ASSERT_TRUE(cluster.ok());
  auto admin = Connect(cluster.coordinator(), kAdmin);
  auto trainer = Connect(cluster.coordinator(), kTrainer);
  ASSERT_TRUE(admin.ok() && trainer.ok());
  auto spec = testing_util::TestSpec("copies");
  spec.set_replicas(2);
  auto info = (*admin)->CreateCollection(spec, "table_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  std::mt19937 rng(5);
  const auto kjt = testing_util::RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 8, false);
  auto kt = (*trainer)->Lookup("copies", kjt);
  ASSERT_TRUE(kt.ok()) << kt.status();
  client::KeyedTensor grads = *kt;
  for (float& g : grads.values) g = 0.25f;
  ASSERT_TRUE((*trainer)->ApplyGradients("copies", kjt, grads).ok());

  const auto& ts = info->plan().tables(0);
  ASSERT_EQ(ts.shards(0).backups_size(), 1);
  const std::string primary = info->worker_addresses(ts.shards(0).rank());
  auto stub = ember::v1::Worker::NewStub(
      MakeChannel(info->worker_addresses(ts.shards(0).backups(0))));
  ember::v1::WorkerApplyGradientsRequest req = testing_util::OneIdUpdate(
      "copies", info->plan().epoch(), "forged", ts.table(), 0, "f_sum", 0, 16, 1.0f);
  req.set_from_primary(primary);
  for (const std::string key : {"", "0123456789abcdef0123456789abcdef"}) {
    grpc::ClientContext ctx;
    AddToken(&ctx, kTrainer);
    req.set_replication_key(key);
    ember::v1::WorkerApplyGradientsResponse resp;
    const grpc::Status s = stub->ApplyGradients(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find("replication key"), std::string::npos) << s.error_message();
  }
  // Nothing was applied to the backup alone: a copy read from either
  // worker (lookups spread over both) is the same after the refusals.
  auto again = (*trainer)->Lookup("copies", kjt);
  auto again2 = (*trainer)->Lookup("copies", kjt);
  ASSERT_TRUE(again.ok() && again2.ok());
  EXPECT_EQ(again->values, again2->values);

  // A SYNC collection's step reaches the backups with its trainer's token
  // and the key: the step is applied on both copies alike.
  auto sync = testing_util::TestSpec("sync_copies");
  sync.set_replicas(2);
  sync.mutable_training()->set_mode(ember::v1::TrainingSpec::SYNC);
  sync.mutable_training()->set_trainers(1);
  auto sync_info = (*admin)->CreateCollection(sync, "table_wise");
  ASSERT_TRUE(sync_info.ok()) << sync_info.status();
  ASSERT_TRUE(
      (*trainer)->ApplyGradients("sync_copies", kjt, grads, "s0", nullptr, {0, 0}).ok());
  int64_t rows = 0, dim = 0;
  auto primary_rows = (*admin)->ExportTable("sync_copies", ts.table(), &rows, &dim);
  ASSERT_TRUE(primary_rows.ok()) << primary_rows.status();
  const auto& sync_shard = sync_info->plan().tables(0).shards(0);
  ASSERT_EQ(sync_shard.backups_size(), 1);
  auto backup_stub = ember::v1::Worker::NewStub(
      MakeChannel(sync_info->worker_addresses(sync_shard.backups(0))));
  grpc::ClientContext ctx;
  AddToken(&ctx, kAdmin);
  ember::v1::ExportRowsRequest export_req;
  export_req.set_collection("sync_copies");
  export_req.mutable_shard()->set_table(ts.table());
  export_req.set_row_begin(0);
  export_req.set_row_end(rows);
  ember::v1::ExportRowsResponse backup_rows;
  const grpc::Status exported = backup_stub->ExportRows(&ctx, export_req, &backup_rows);
  ASSERT_TRUE(exported.ok()) << exported.error_message();
  std::vector<float> backup_values(backup_rows.weights().size() / sizeof(float));
  std::memcpy(backup_values.data(), backup_rows.weights().data(), backup_rows.weights().size());
  EXPECT_EQ(backup_values, *primary_rows);
  EXPECT_EQ(backup_rows.step(), 1);
}

TEST(AuthTest, TokensCommandWritesFilesThatWork) {
  const std::string dir = ::testing::TempDir() + "/ember_made_tokens";
  ASSERT_EQ(std::system(absl::StrCat(kEmberctl, " tokens --dir=", dir, " --workers=2").c_str()), 0);
  EXPECT_NE(std::system(absl::StrCat(kEmberctl, " tokens --dir=", dir, " 2>/dev/null").c_str()), 0);
  EXPECT_NE(std::system(absl::StrCat(kEmberctl, " tokens --dir=", dir,
                                     "-x --worker_names=../a 2>/dev/null").c_str()),
            0);
  for (const char* f : {"servers.tokens", "admin.token", "trainer.token", "workers/worker-0.tokens",
                        "workers/worker-1.tokens"}) {
    struct stat st;
    ASSERT_EQ(stat((dir + "/" + f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  auto own = TokenTable::Load(dir + "/workers/worker-1.tokens");
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->worker_names(), std::vector<std::string>{"worker-1"});
  ASSERT_TRUE(own->SetSelf("").ok());
  auto servers = TokenTable::Load(dir + "/servers.tokens");
  ASSERT_TRUE(servers.ok()) << servers.status();
  EXPECT_EQ(servers->worker_names(), (std::vector<std::string>{"worker-0", "worker-1"}));

  testing_util::LocalCluster cluster(kEmberctl, 2,
                                     {"--auth_token_file=" + dir + "/servers.tokens"});
  ASSERT_TRUE(cluster.ok()) << "emberctl up with the made tokens did not come up";
  auto admin_token = LoadClientToken(dir + "/admin.token");
  auto trainer_token = LoadClientToken(dir + "/trainer.token");
  ASSERT_TRUE(admin_token.ok() && trainer_token.ok());
  auto admin = Connect(cluster.coordinator(), *admin_token);
  auto trainer = Connect(cluster.coordinator(), *trainer_token);
  ASSERT_TRUE(admin.ok() && trainer.ok());
  ASSERT_TRUE((*admin)->CreateCollection(testing_util::TestSpec("made"), "row_wise").ok());
  EXPECT_EQ((*trainer)->DropCollection("made").code(), absl::StatusCode::kPermissionDenied);
  std::mt19937 rng(9);
  const auto kjt = testing_util::RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 4, false);
  EXPECT_TRUE((*trainer)->Lookup("made", kjt).ok());
}

TEST(AuthTest, ServersRefuseABadTokenFile) {
  const std::string file = ::testing::TempDir() + "/ember_bad_tokens";
  std::ofstream(file) << "admin short\n";
  testing_util::LocalCluster cluster(kEmberctl, 1, {"--auth_token_file=" + file});
  EXPECT_FALSE(cluster.ok());
  // The shared worker token of earlier versions, and too few worker lines
  // for `up`.
  std::ofstream(file) << "worker " << kWorker << "\nadmin " << kAdmin << "\n";
  testing_util::LocalCluster shared(kEmberctl, 1, {"--auth_token_file=" + file});
  EXPECT_FALSE(shared.ok());
  std::ofstream(file) << "worker a " << kWorker << "\nadmin " << kAdmin << "\n";
  testing_util::LocalCluster too_few(kEmberctl, 2, {"--auth_token_file=" + file});
  EXPECT_FALSE(too_few.ok());
}

}  // namespace
}  // namespace ember
