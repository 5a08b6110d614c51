// Bad input on every RPC of both services, against a live cluster
// (coordinator + 2 workers, `emberctl up --max_message_mb=16`): each call
// gets its precise status, the cluster's state (workers, collections, shards
// and their optimizer steps, every table's weights) is unchanged afterwards,
// and the servers keep serving. Also: grpc.health.v1 on every server.
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "server/checkpoint/checkpoint_files.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "tests/local_cluster.h"
#include "tests/raw_call.h"

namespace ember {
namespace {

using client::Client;
using client::KeyedJaggedTensor;
using ember::v1::CollectionSpec;
using ember::v1::ShardFeature;
using ember::v1::TableConfig;
using grpc::StatusCode;

constexpr char kEmberctl[] = "cli/emberctl";
constexpr int kMaxMessageMb = 16;

CollectionSpec Spec(const std::string& name) {
  CollectionSpec spec;
  spec.set_name(name);
  TableConfig* t = spec.add_tables();
  t->set_name("t_sum");
  t->set_num_embeddings(301);
  t->set_embedding_dim(16);
  t->add_feature_names("f_sum");
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAM);
  t->mutable_optimizer()->set_learning_rate(0.05);
  t = spec.add_tables();
  t->set_name("t_seq");
  t->set_num_embeddings(120);
  t->set_embedding_dim(8);
  t->add_feature_names("f_seq");
  t->set_pooling(TableConfig::NONE);
  return spec;
}

// Calls one generated stub method with a deadline; returns the status code.
template <typename Stub, typename Req, typename Resp>
StatusCode Call(Stub* stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
                const Req& req, Resp* resp = nullptr) {
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(30));
  Resp own;
  return (stub->*method)(&ctx, req, resp != nullptr ? resp : &own).error_code();
}

// Sends raw bytes as the request of `method` ("/pkg.Service/Method");
// the response's bytes go to *reply if given.
using testing_util::RawCall;

std::vector<std::string> MethodsOf(const std::string& service) {
  const auto* d = google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(service);
  std::vector<std::string> out;
  for (int i = 0; d != nullptr && i < d->method_count(); ++i) {
    out.push_back(absl::StrCat("/", service, "/", d->method(i)->name()));
  }
  return out;
}

// What the cluster holds, to compare before and after.
struct Snapshot {
  std::vector<std::string> workers, collections, shards;
  std::map<std::string, std::vector<float>> tables;
  bool operator==(const Snapshot& o) const {
    return workers == o.workers && collections == o.collections && shards == o.shards &&
           tables == o.tables;
  }
};

class BadInputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new testing_util::LocalCluster(
        kEmberctl, 2,
        {absl::StrCat("--max_message_mb=", kMaxMessageMb),
         "--checkpoint_dir=" + ::testing::TempDir()});
    ASSERT_TRUE(cluster_->ok()) << "emberctl up did not come up";
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  void SetUp() override {
    auto c = Client::Connect(cluster_->coordinator());
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
    coordinator_ = ember::v1::Coordinator::NewStub(MakeChannel(cluster_->coordinator()));
    auto info = client_->CreateCollection(Spec("bad"), "table_wise");
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    for (const auto& t : info_.plan().tables()) {
      rank_of_[t.table()] = t.shards(0).rank();
    }
    for (const auto& a : info_.worker_addresses()) {
      workers_.push_back(ember::v1::Worker::NewStub(MakeChannel(a)));
    }
    // One step so that the optimizer state and steps are not all zero.
    KeyedJaggedTensor kjt;
    kjt.keys = {"f_sum"};
    kjt.lengths = {2};
    kjt.values = {3, 7};
    auto kt = client_->Lookup("bad", kjt);
    ASSERT_TRUE(kt.ok()) << kt.status();
    ASSERT_TRUE(client_->ApplyGradients("bad", kjt, *kt).ok());
  }
  void TearDown() override {
    if (client_) (void)client_->DropCollection("bad");
  }

  ember::v1::Worker::Stub* WorkerFor(const std::string& table) {
    return workers_[rank_of_.at(table)].get();
  }

  Snapshot Take() {
    Snapshot s;
    ember::v1::ListWorkersResponse w;
    EXPECT_EQ(Call(coordinator_.get(), &ember::v1::Coordinator::Stub::ListWorkers,
                   ember::v1::ListWorkersRequest(), &w),
              StatusCode::OK);
    for (const auto& x : w.workers()) {
      s.workers.push_back(absl::StrCat(x.worker_id(), "@", x.info().address(), " ", x.live()));
    }
    ember::v1::ListCollectionsResponse c;
    EXPECT_EQ(Call(coordinator_.get(), &ember::v1::Coordinator::Stub::ListCollections,
                   ember::v1::ListCollectionsRequest(), &c),
              StatusCode::OK);
    for (const auto& x : c.collections()) {
      s.collections.push_back(absl::StrCat(x.plan().collection(), "@", x.plan().epoch()));
    }
    for (const auto& stub : workers_) {
      ember::v1::ShardStatusResponse st;
      EXPECT_EQ(Call(stub.get(), &ember::v1::Worker::Stub::ShardStatus,
                     ember::v1::ShardStatusRequest(), &st),
                StatusCode::OK);
      for (const auto& x : st.shards()) {
        s.shards.push_back(absl::StrCat(x.collection(), "@", x.epoch(), " ", x.shard().table(),
                                        "/", x.shard().shard_index(), " step ", x.step()));
      }
    }
    for (const std::string table : {"t_sum", "t_seq"}) {
      int64_t rows, dim;
      auto values = client_->ExportTable("bad", table, &rows, &dim);
      EXPECT_TRUE(values.ok()) << values.status();
      if (values.ok()) s.tables[table] = *values;
    }
    return s;
  }

  ShardFeature Feature(const std::string& table, std::vector<int64_t> lengths,
                       std::vector<int64_t> ids) {
    ShardFeature f;
    f.mutable_shard()->set_table(table);
    f.set_feature(table == "t_sum" ? "f_sum" : "f_seq");
    f.set_pooling(table == "t_sum" ? TableConfig::SUM : TableConfig::NONE);
    f.set_lengths(wire::Encode<int64_t>(lengths));
    f.set_ids(wire::Encode<int64_t>(ids));
    return f;
  }

  static testing_util::LocalCluster* cluster_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<ember::v1::Coordinator::Stub> coordinator_;
  std::vector<std::unique_ptr<ember::v1::Worker::Stub>> workers_;
  std::map<std::string, int> rank_of_;
  ember::v1::CollectionInfo info_;
};
testing_util::LocalCluster* BadInputTest::cluster_ = nullptr;

TEST_F(BadInputTest, CoordinatorRpcs) {
  using Stub = ember::v1::Coordinator::Stub;
  Stub* co = coordinator_.get();
  const Snapshot before = Take();

  // RegisterWorker.
  auto reg = [&](const std::string& address, int64_t hbm, int device) {
    ember::v1::RegisterWorkerRequest r;
    r.mutable_worker()->set_address(address);
    r.mutable_worker()->set_hbm_bytes(hbm);
    r.mutable_worker()->set_device(static_cast<ember::v1::ComputeDevice>(device));
    return Call(co, &Stub::RegisterWorker, r);
  };
  EXPECT_EQ(reg("", 0, ember::v1::CPU), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reg("no-port", 0, ember::v1::CPU), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reg("127.0.0.1:", 0, ember::v1::CPU), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reg("127.0.0.1:1", -1, ember::v1::CPU), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reg("127.0.0.1:1", 0, 7), StatusCode::INVALID_ARGUMENT);

  // Heartbeat.
  ember::v1::HeartbeatRequest hb;
  EXPECT_EQ(Call(co, &Stub::Heartbeat, hb), StatusCode::INVALID_ARGUMENT);
  hb.set_worker_id("w999");
  EXPECT_EQ(Call(co, &Stub::Heartbeat, hb), StatusCode::NOT_FOUND);

  // CreateCollection: malformed specs, a bad sharding type, a name in use.
  auto create = [&](const CollectionSpec& spec, const std::string& type = "") {
    ember::v1::CreateCollectionRequest r;
    *r.mutable_spec() = spec;
    r.set_sharding_type(type);
    return Call(co, &Stub::CreateCollection, r);
  };
  CollectionSpec s = Spec("");
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);  // no name
  s = Spec("x");
  s.clear_tables();
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);  // no tables
  s = Spec("x");
  s.mutable_tables(0)->set_num_embeddings(0);
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  s = Spec("x");
  s.mutable_tables(0)->set_embedding_dim(-4);
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  s = Spec("x");
  s.mutable_tables(1)->set_name("t_sum");  // two tables of one name
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  s = Spec("x");
  s.mutable_tables(1)->set_feature_names(0, "f_sum");  // one feature, two tables
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  for (const char* name : {"a/b", "..", ".hidden", "a b"}) {
    EXPECT_EQ(create(Spec(name)), StatusCode::INVALID_ARGUMENT) << name;  // names directories
  }
  s = Spec("x");
  s.mutable_tables(0)->clear_feature_names();
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  s = Spec("x");
  s.mutable_tables(0)->mutable_optimizer()->set_learning_rate(-1);
  EXPECT_EQ(create(s), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(create(Spec("x"), "diagonal"), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(create(Spec("bad")), StatusCode::ALREADY_EXISTS);

  // DrainWorker.
  ember::v1::DrainWorkerRequest drain_req;
  EXPECT_EQ(Call(co, &Stub::DrainWorker, drain_req), StatusCode::INVALID_ARGUMENT);
  drain_req.set_worker_id("w999");
  EXPECT_EQ(Call(co, &Stub::DrainWorker, drain_req), StatusCode::NOT_FOUND);

  // ScaleCollection: nothing moves on a refusal.
  ember::v1::ScaleCollectionRequest scale;
  scale.set_workers(1);
  EXPECT_EQ(Call(co, &Stub::ScaleCollection, scale), StatusCode::INVALID_ARGUMENT);
  scale.set_collection("bad");
  for (int workers : {0, -3}) {
    scale.set_workers(workers);
    EXPECT_EQ(Call(co, &Stub::ScaleCollection, scale), StatusCode::INVALID_ARGUMENT);
  }
  scale.set_workers(1000);
  EXPECT_EQ(Call(co, &Stub::ScaleCollection, scale), StatusCode::FAILED_PRECONDITION);
  scale.set_collection("nope");
  scale.set_workers(1);
  EXPECT_EQ(Call(co, &Stub::ScaleCollection, scale), StatusCode::NOT_FOUND);

  // GetCollection / DropCollection.
  ember::v1::GetCollectionRequest get;
  EXPECT_EQ(Call(co, &Stub::GetCollection, get), StatusCode::INVALID_ARGUMENT);
  get.set_collection("nope");
  EXPECT_EQ(Call(co, &Stub::GetCollection, get), StatusCode::NOT_FOUND);
  ember::v1::DropCollectionRequest drop;
  EXPECT_EQ(Call(co, &Stub::DropCollection, drop), StatusCode::INVALID_ARGUMENT);
  drop.set_collection("nope");
  EXPECT_EQ(Call(co, &Stub::DropCollection, drop), StatusCode::NOT_FOUND);

  // PreviewPlan: bad spec, bad topology, bad sharding type.
  auto preview = [&](const CollectionSpec& spec, int world, int local, const std::string& type) {
    ember::v1::PreviewPlanRequest r;
    *r.mutable_spec() = spec;
    r.mutable_topology()->set_world_size(world);
    r.mutable_topology()->set_local_world_size(local);
    r.set_sharding_type(type);
    return Call(co, &Stub::PreviewPlan, r);
  };
  EXPECT_EQ(preview(Spec("p"), 4, 2, ""), StatusCode::OK);  // the control
  s = Spec("p");
  s.mutable_tables(0)->set_num_embeddings(-5);
  EXPECT_EQ(preview(s, 4, 2, ""), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(preview(Spec("p"), -1, 0, ""), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(preview(Spec("p"), 4, 3, ""), StatusCode::INVALID_ARGUMENT);  // 3 does not divide 4
  EXPECT_EQ(preview(Spec("p"), 4, 2, "sideways"), StatusCode::INVALID_ARGUMENT);
  // A topology of 2^31 - 1 workers once took the coordinator's memory (677
  // MiB at a million); it is refused before anything is allocated.
  const absl::Time start = absl::Now();
  EXPECT_EQ(preview(Spec("p"), 2147483647, 0, ""), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(preview(Spec("p"), 1000000, 1, ""), StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // a generous bound: it answers at once

  EXPECT_TRUE(Take() == before);
}

// A worker that refuses its shards makes the whole create fail; the shards
// already made elsewhere are dropped, and the refusing worker keeps its own.
// Errors echo input (names, addresses); a request cannot make them large.
TEST_F(BadInputTest, ErrorMessagesAreBoundedWhateverTheInput) {
  const std::string huge(1 << 20, 'x');
  const Snapshot before = Take();
  {
    grpc::ClientContext ctx;
    ember::v1::GetCollectionRequest req;
    req.set_collection(huge);
    ember::v1::GetCollectionResponse resp;
    const grpc::Status s = coordinator_->GetCollection(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::NOT_FOUND);
    EXPECT_LE(s.error_message().size(), 2200u);
    EXPECT_NE(s.error_message().find("more bytes"), std::string::npos);
  }
  {
    grpc::ClientContext ctx;
    ember::v1::RegisterWorkerRequest req;
    req.mutable_worker()->set_address(huge);
    ember::v1::RegisterWorkerResponse resp;
    const grpc::Status s = coordinator_->RegisterWorker(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_LE(s.error_message().size(), 2200u);
  }
  {
    grpc::ClientContext ctx;
    ember::v1::WorkerLookupRequest req;
    req.set_collection(huge);
    ember::v1::WorkerLookupResponse resp;
    const grpc::Status s = workers_[0]->Lookup(&ctx, req, &resp);
    EXPECT_NE(s.error_code(), StatusCode::OK);
    EXPECT_LE(s.error_message().size(), 2200u);
  }
  EXPECT_TRUE(Take() == before);
}

TEST_F(BadInputTest, FailedCreateLeavesNothingBehind) {
  ember::v1::CreateShardsRequest own;
  own.set_collection("clash");
  own.set_epoch(999);
  ASSERT_EQ(Call(workers_[1].get(), &ember::v1::Worker::Stub::CreateShards, own), StatusCode::OK);
  const Snapshot before = Take();
  auto info = client_->CreateCollection(Spec("clash"), "table_wise");
  EXPECT_EQ(info.status().code(), absl::StatusCode::kAlreadyExists) << info.status();
  EXPECT_TRUE(Take() == before);  // nothing on worker 0, worker 1's own "clash" untouched
  ember::v1::DropShardsRequest drop;
  drop.set_collection("clash");
  drop.set_epoch(999);
  EXPECT_EQ(Call(workers_[1].get(), &ember::v1::Worker::Stub::DropShards, drop), StatusCode::OK);
  EXPECT_EQ(Call(workers_[1].get(), &ember::v1::Worker::Stub::DropShards, drop),
            StatusCode::NOT_FOUND);
}

TEST_F(BadInputTest, WorkerRpcs) {
  using Stub = ember::v1::Worker::Stub;
  Stub* w = WorkerFor("t_sum");
  const int64_t epoch = info_.plan().epoch();
  const Snapshot before = Take();

  // CreateShards.
  ember::v1::CreateShardsRequest cs;
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);  // no name
  cs.set_collection("new");
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);  // epoch 0
  cs.set_epoch(50);
  auto* a = cs.add_shards();
  a->mutable_ref()->set_table("t_sum");
  *a->mutable_table() = Spec("new").tables(0);
  a->set_rows(301);
  a->set_cols(16);
  *cs.add_shards() = *a;  // the same shard twice
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);
  cs.mutable_shards()->RemoveLast();
  a->set_rows(302);  // past the table's rows
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);
  a->set_rows(301);
  a->set_col_offset(8);  // columns [8, 24) of a 16-wide table
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);
  a->set_col_offset(0);
  a->mutable_ref()->set_table("t_other");
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::INVALID_ARGUMENT);
  cs.set_collection("bad");  // held, at another epoch
  a->mutable_ref()->set_table("t_sum");
  EXPECT_EQ(Call(w, &Stub::CreateShards, cs), StatusCode::ALREADY_EXISTS);
  // More than the worker's memory: refused before anything is allocated.
  {
    ember::v1::CreateShardsRequest huge = cs;
    huge.set_collection("huge");
    huge.mutable_shards(0)->mutable_table()->set_num_embeddings(int64_t{1} << 40);
    huge.mutable_shards(0)->set_rows(int64_t{1} << 40);
    EXPECT_EQ(Call(w, &Stub::CreateShards, huge), StatusCode::RESOURCE_EXHAUSTED);
  }
  // A create retried at the same epoch: the same shards are fine, other
  // shards are refused.
  {
    ember::v1::CreateShardsRequest again = cs;
    again.set_collection("again");
    again.set_epoch(60);
    EXPECT_EQ(Call(w, &Stub::CreateShards, again), StatusCode::OK);
    EXPECT_EQ(Call(w, &Stub::CreateShards, again), StatusCode::OK);
    again.mutable_shards(0)->set_rows(300);
    EXPECT_EQ(Call(w, &Stub::CreateShards, again), StatusCode::ALREADY_EXISTS);
    ember::v1::DropShardsRequest d;
    d.set_collection("again");
    d.set_epoch(59);  // older than the epoch held
    EXPECT_EQ(Call(w, &Stub::DropShards, d), StatusCode::FAILED_PRECONDITION);
    d.set_epoch(60);
    EXPECT_EQ(Call(w, &Stub::DropShards, d), StatusCode::OK);
  }

  // DropShards.
  ember::v1::DropShardsRequest ds;
  ds.set_collection("nope");
  EXPECT_EQ(Call(w, &Stub::DropShards, ds), StatusCode::INVALID_ARGUMENT);  // epoch 0
  ds.set_epoch(epoch);
  EXPECT_EQ(Call(w, &Stub::DropShards, ds), StatusCode::NOT_FOUND);
  ds.set_collection("bad");
  ds.set_epoch(epoch - 1);
  EXPECT_EQ(Call(w, &Stub::DropShards, ds), StatusCode::FAILED_PRECONDITION);

  // Lookup.
  auto lookup = [&](const std::string& collection, int64_t e, std::vector<ShardFeature> fs) {
    ember::v1::WorkerLookupRequest r;
    r.set_collection(collection);
    r.set_epoch(e);
    for (auto& f : fs) *r.add_features() = f;
    return Call(w, &Stub::Lookup, r);
  };
  const ShardFeature good = Feature("t_sum", {2}, {1, 2});
  EXPECT_EQ(lookup("bad", epoch, {good}), StatusCode::OK);  // the control
  EXPECT_EQ(lookup("nope", epoch, {good}), StatusCode::NOT_FOUND);
  EXPECT_EQ(lookup("bad", epoch + 1, {good}), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(lookup("bad", epoch - 1, {good}), StatusCode::FAILED_PRECONDITION);
  // A shard this worker does not hold: the client's plan is stale.
  ShardFeature f = good;
  f.mutable_shard()->set_table("t_nope");
  EXPECT_EQ(lookup("bad", epoch, {f}), StatusCode::FAILED_PRECONDITION);
  f = good;
  f.mutable_shard()->set_shard_index(3);
  EXPECT_EQ(lookup("bad", epoch, {f}), StatusCode::FAILED_PRECONDITION);
  // Lengths whose sum overflows int64 to exactly the id count.
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", {kMax, kMax, 4}, {1, 2})}),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", {kMax, 1}, {1})}), StatusCode::INVALID_ARGUMENT);
  f = good;
  f.set_weights(wire::Encode<float>(std::vector<float>{1.0f, NAN}));
  EXPECT_EQ(lookup("bad", epoch, {f}), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(lookup("bad", epoch, {good, Feature("t_sum", {2}, {1, 301})}),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", {2}, {-1, 2})}), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", {3}, {1, 2})}), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", {-1, 3}, {1, 2})}),
            StatusCode::INVALID_ARGUMENT);
  f = good;
  f.set_ids("abc");  // not whole int64s
  EXPECT_EQ(lookup("bad", epoch, {f}), StatusCode::INVALID_ARGUMENT);
  f = good;
  f.set_weights(wire::Encode<float>(std::vector<float>{1.0f}));  // 1 weight for 2 ids
  EXPECT_EQ(lookup("bad", epoch, {f}), StatusCode::INVALID_ARGUMENT);
  // Output over the response limit (16 MiB): 300k bags x 16 floats.
  EXPECT_EQ(lookup("bad", epoch, {Feature("t_sum", std::vector<int64_t>(300000, 0), {})}),
            StatusCode::RESOURCE_EXHAUSTED);

  // ApplyGradients: the bad feature comes after a good one, so a partial
  // apply would show.
  auto apply = [&](int64_t e, const std::string& id, std::vector<ShardFeature> fs,
                   std::vector<int64_t> grad_floats) {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("bad");
    r.set_epoch(e);
    r.set_request_id(id);
    for (size_t i = 0; i < fs.size(); ++i) {
      auto* g = r.add_gradients();
      *g->mutable_feature() = fs[i];
      g->set_grad(wire::Encode<float>(std::vector<float>(grad_floats[i], 1.0f)));
    }
    return Call(w, &Stub::ApplyGradients, r);
  };
  EXPECT_EQ(apply(epoch, "", {good}, {16}), StatusCode::INVALID_ARGUMENT);  // no request id
  EXPECT_EQ(apply(epoch + 1, "a", {good}, {16}), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(apply(epoch, "b", {good, Feature("t_sum", {2}, {1, 301})}, {16, 16}),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(apply(epoch, "c", {good, Feature("t_sum", {3}, {1, 2})}, {16, 16}),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(apply(epoch, "d", {good, good}, {16, 15}), StatusCode::INVALID_ARGUMENT);  // shape
  EXPECT_EQ(apply(epoch, "e", {good, good}, {16, 32}), StatusCode::INVALID_ARGUMENT);
  f = good;
  f.mutable_shard()->set_table("t_nope");
  EXPECT_EQ(apply(epoch, "f", {good, f}, {16, 16}), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(apply(epoch, "h", {good, Feature("t_sum", {kMax, kMax, 4}, {1, 2})}, {16, 48}),
            StatusCode::INVALID_ARGUMENT);
  f = good;
  f.set_weights(wire::Encode<float>(std::vector<float>{INFINITY, 1.0f}));
  EXPECT_EQ(apply(epoch, "i", {good, f}, {16, 16}), StatusCode::INVALID_ARGUMENT);
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("bad");
    r.set_epoch(epoch);
    r.set_request_id(absl::StrCat("j", bad));
    *r.add_gradients()->mutable_feature() = good;
    r.mutable_gradients(0)->set_grad(wire::Encode<float>(std::vector<float>(16, 1.0f)));
    *r.add_gradients()->mutable_feature() = good;
    std::vector<float> grad(16, 1.0f);
    grad[5] = bad;
    r.mutable_gradients(1)->set_grad(wire::Encode<float>(grad));
    EXPECT_EQ(Call(w, &Stub::ApplyGradients, r), StatusCode::INVALID_ARGUMENT) << bad;
  }
  // Finite gradients whose update overflows: id 1 twice in one bag with a
  // gradient of 3e38 merges to Inf in fp32, and Adam's state would follow.
  // Refused, after a valid request in the same call (nothing applied: the
  // cluster's state is compared at the end).
  {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("bad");
    r.set_epoch(epoch);
    r.set_request_id("overflow");
    *r.add_gradients()->mutable_feature() = good;
    r.mutable_gradients(0)->set_grad(wire::Encode<float>(std::vector<float>(16, 1.0f)));
    *r.add_gradients()->mutable_feature() = Feature("t_sum", {2}, {1, 1});
    r.mutable_gradients(1)->set_grad(wire::Encode<float>(std::vector<float>(16, 3e38f)));
    EXPECT_EQ(Call(w, &Stub::ApplyGradients, r), StatusCode::INVALID_ARGUMENT);
  }
  {
    ember::v1::ShardStatusResponse st;
    ASSERT_EQ(Call(w, &Stub::ShardStatus, ember::v1::ShardStatusRequest(), &st), StatusCode::OK);
    EXPECT_GE(st.nonfinite_refused(), 4);  // the weight and the three gradients
    EXPECT_EQ(st.nonfinite_skipped_ids(), 0);
    EXPECT_EQ(st.overflow_refused(), 1);
    EXPECT_EQ(st.overflow_skipped_rows(), 0);
    EXPECT_GT(st.available_bytes(), 0);
  }
  {
    ember::v1::WorkerApplyGradientsRequest r;
    r.set_collection("bad");
    r.set_epoch(epoch);
    r.set_request_id("g");
    auto* g = r.add_gradients();
    *g->mutable_feature() = good;
    g->set_grad("12345");  // not whole floats
    EXPECT_EQ(Call(w, &Stub::ApplyGradients, r), StatusCode::INVALID_ARGUMENT);
  }

  // The client refuses the same overflowing lengths, and NaN gradients,
  // before any worker sees them.
  {
    KeyedJaggedTensor overflow;
    overflow.keys = {"f_sum"};
    overflow.lengths = {kMax, kMax, 4};
    overflow.values = {1, 2};
    EXPECT_EQ(client_->Lookup("bad", overflow).status().code(), absl::StatusCode::kInvalidArgument);
    KeyedJaggedTensor one;
    one.keys = {"f_sum"};
    one.lengths = {1};
    one.values = {4};
    auto kt = client_->Lookup("bad", one);
    ASSERT_TRUE(kt.ok()) << kt.status();
    kt->values[3] = NAN;
    EXPECT_EQ(client_->ApplyGradients("bad", one, *kt).code(), absl::StatusCode::kInvalidArgument);
  }

  // ExportRows / ImportRows.
  auto export_rows = [&](const std::string& table, int64_t b, int64_t e) {
    ember::v1::ExportRowsRequest r;
    r.set_collection("bad");
    r.mutable_shard()->set_table(table);
    r.set_row_begin(b);
    r.set_row_end(e);
    return Call(w, &Stub::ExportRows, r);
  };
  EXPECT_EQ(export_rows("t_sum", 0, 301), StatusCode::OK);  // the control
  EXPECT_EQ(export_rows("t_nope", 0, 1), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(export_rows("t_sum", -1, 1), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(export_rows("t_sum", 5, 4), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(export_rows("t_sum", 0, 302), StatusCode::INVALID_ARGUMENT);
  {
    ember::v1::ExportRowsRequest r;
    r.set_collection("nope");
    EXPECT_EQ(Call(w, &Stub::ExportRows, r), StatusCode::NOT_FOUND);
  }
  auto import_rows = [&](const std::string& collection, int64_t b, int64_t e, size_t weights,
                         size_t state, int64_t at_epoch = 0, float value = 9.0f,
                         float state_value = 9.0f) {
    ember::v1::ImportRowsRequest r;
    r.set_collection(collection);
    r.set_epoch(at_epoch != 0 ? at_epoch : epoch);
    r.mutable_shard()->set_table("t_sum");
    r.set_row_begin(b);
    r.set_row_end(e);
    r.set_weights(wire::Encode<float>(std::vector<float>(weights, value)));
    r.set_state(wire::Encode<float>(std::vector<float>(state, state_value)));
    r.set_step(7);
    return Call(w, &Stub::ImportRows, r);
  };
  // t_sum is Adam: state is 2 x 16 floats per row.
  EXPECT_EQ(import_rows("nope", 0, 1, 16, 32), StatusCode::NOT_FOUND);
  EXPECT_EQ(import_rows("bad", 0, 302, 302 * 16, 302 * 32), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import_rows("bad", 2, 1, 0, 0), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import_rows("bad", 0, 2, 16, 64), StatusCode::INVALID_ARGUMENT);  // 1 row of weights
  EXPECT_EQ(import_rows("bad", 0, 2, 32, 32), StatusCode::INVALID_ARGUMENT);  // 1 row of state
  EXPECT_EQ(import_rows("bad", 0, 1, 16, 32, epoch + 1), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(import_rows("bad", 0, 1, 16, 32, -1), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import_rows("bad", 0, 1, 16, 32, epoch, NAN), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import_rows("bad", 0, 1, 16, 32, epoch, 1.0f, INFINITY), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(import_rows("bad", 0, 1, 16, 32, epoch, 1.0f, -1.0f), StatusCode::INVALID_ARGUMENT);
  {
    ember::v1::ImportRowsRequest r;
    r.set_collection("bad");
    r.set_epoch(epoch);
    r.mutable_shard()->set_table("t_sum");
    r.set_row_end(1);
    r.set_weights("xyz");
    EXPECT_EQ(Call(w, &Stub::ImportRows, r), StatusCode::INVALID_ARGUMENT);
  }

  EXPECT_TRUE(Take() == before);
}

// Checkpoint and restore RPCs with bad input: precise codes, nothing changes.
TEST_F(BadInputTest, CheckpointRpcs) {
  const int64_t epoch = info_.plan().epoch();
  const Snapshot before = Take();
  using CStub = ember::v1::Coordinator::Stub;
  ember::v1::CheckpointRequest ck;
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Checkpoint, ck), StatusCode::INVALID_ARGUMENT);
  ck.set_collection("nope");
  ck.set_dir("/tmp");
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Checkpoint, ck), StatusCode::NOT_FOUND);
  ck.set_collection("bad");  // /tmp is outside the servers' --checkpoint_dir
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Checkpoint, ck), StatusCode::INVALID_ARGUMENT);

  ember::v1::RestoreRequest rs;
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Restore, rs), StatusCode::INVALID_ARGUMENT);
  // Outside the root: refused whether it exists or not (it said NOT_FOUND,
  // which told that it did not).
  rs.set_from("/nonexistent/ember/checkpoints");
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Restore, rs), StatusCode::INVALID_ARGUMENT);
  std::string tmpl = ::testing::TempDir() + "/ember_bad_input_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  rs.set_from(tmpl);  // exists, holds no checkpoint
  EXPECT_EQ(Call(coordinator_.get(), &CStub::Restore, rs), StatusCode::NOT_FOUND);

  using WStub = ember::v1::Worker::Stub;
  WStub* w = WorkerFor("t_sum");
  ember::v1::WriteCheckpointRequest wr;
  wr.set_collection("bad");
  wr.set_epoch(epoch);
  wr.add_shards()->set_table("t_sum");
  EXPECT_EQ(Call(w, &WStub::WriteCheckpoint, wr), StatusCode::INVALID_ARGUMENT);  // no dir
  wr.set_dir(tmpl);
  wr.set_epoch(epoch + 1);
  EXPECT_EQ(Call(w, &WStub::WriteCheckpoint, wr), StatusCode::FAILED_PRECONDITION);
  wr.set_epoch(epoch);
  wr.mutable_shards(0)->set_table("t_nope");
  EXPECT_EQ(Call(w, &WStub::WriteCheckpoint, wr), StatusCode::FAILED_PRECONDITION);
  wr.set_collection("nope");
  EXPECT_EQ(Call(w, &WStub::WriteCheckpoint, wr), StatusCode::NOT_FOUND);

  ember::v1::LoadCheckpointRequest ld;
  ld.set_collection("bad");
  ld.set_epoch(epoch);
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::INVALID_ARGUMENT);  // no dir
  ld.set_dir(tmpl);
  ld.set_epoch(epoch - 1);
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::FAILED_PRECONDITION);
  ld.set_epoch(epoch);
  auto* src = ld.add_sources();  // covers t_sum, but its file is not there
  src->mutable_ref()->set_table("t_sum");
  src->set_file("missing.shard");
  src->set_rows(301);
  src->set_cols(16);
  src->set_state_width(32);
  src->set_bytes(40 + 4 * 301 * 48);
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::DATA_LOSS);
  ld.clear_sources();  // nothing covers the shards
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::DATA_LOSS);
  ld.add_only()->set_table("t_nope");
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::FAILED_PRECONDITION);
  ld.clear_only();
  // Two sources holding the same rows, as many cells as the shard has: the
  // count of filled cells matched, and rows [151, 301) were left zero.
  for (int64_t rows : {150, 151}) {
    checkpoint::ShardData d;
    d.rows = rows;
    d.cols = 16;
    d.state_width = 32;
    d.weights.assign(rows * 16, 0.5f);
    d.state.assign(rows * 32, 0.25f);
    ember::v1::ShardRef ref;
    ref.set_table("t_sum");
    ref.set_shard_index(static_cast<int32_t>(rows - 150));
    auto entry = checkpoint::WriteShardFile(tmpl, ref, d);
    ASSERT_TRUE(entry.ok()) << entry.status();
    *ld.add_sources() = *entry;
  }
  EXPECT_EQ(Call(w, &WStub::LoadCheckpoint, ld), StatusCode::DATA_LOSS);

  // UpdateShards (recovery's move to a new epoch).
  ember::v1::UpdateShardsRequest up;
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::INVALID_ARGUMENT);  // no name
  up.set_collection("bad");
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::INVALID_ARGUMENT);  // epoch 0
  up.set_epoch(epoch - 1);
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::FAILED_PRECONDITION);  // older
  up.set_collection("nope");
  up.set_epoch(epoch + 1);
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::NOT_FOUND);
  up.set_collection("bad");
  auto* a = up.add_create();  // t_sum is held whole: a different assignment is refused
  a->mutable_ref()->set_table("t_sum");
  *a->mutable_table() = info_.spec().tables(0);
  a->set_rows(100);
  a->set_cols(16);
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::ALREADY_EXISTS);
  a->set_col_offset(8);  // columns outside the table
  EXPECT_EQ(Call(w, &WStub::UpdateShards, up), StatusCode::INVALID_ARGUMENT);

  EXPECT_TRUE(Take() == before);
}

// Every method of both services: a request over the 16 MiB limit gets
// RESOURCE_EXHAUSTED and bytes that are no protobuf message an error; the
// servers serve on and nothing changes.
TEST_F(BadInputTest, OversizedAndMalformedMessagesOnEveryMethod) {
  const Snapshot before = Take();
  // A length-delimited field 15 of (limit + 1 MiB) bytes.
  const int64_t big = (int64_t{kMaxMessageMb} + 1) << 20;
  std::string oversized = "\x7a";
  for (int64_t v = big; v > 0; v >>= 7) oversized.push_back(static_cast<char>((v & 0x7f) | (v > 0x7f ? 0x80 : 0)));
  oversized.append(big, 'x');
  const std::string garbage = "\xff\xff\xff\xff";  // a truncated varint tag
  const std::vector<std::string> coordinator_methods = MethodsOf("ember.v1.Coordinator");
  const std::vector<std::string> worker_methods = MethodsOf("ember.v1.Worker");
  ASSERT_EQ(coordinator_methods.size(), 14u);
  ASSERT_EQ(worker_methods.size(), 13u);
  for (const std::string& m : coordinator_methods) {
    EXPECT_EQ(RawCall(cluster_->coordinator(), m, oversized), StatusCode::RESOURCE_EXHAUSTED) << m;
    EXPECT_NE(RawCall(cluster_->coordinator(), m, garbage), StatusCode::OK) << m;
  }
  for (const std::string& m : worker_methods) {
    for (const auto& address : info_.worker_addresses()) {
      EXPECT_EQ(RawCall(address, m, oversized), StatusCode::RESOURCE_EXHAUSTED) << m;
      EXPECT_NE(RawCall(address, m, garbage), StatusCode::OK) << m;
    }
  }
  EXPECT_TRUE(Take() == before);
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {1};
  kjt.values = {5};
  EXPECT_TRUE(client_->Lookup("bad", kjt).ok());
}

// grpc.health.v1 on both kinds of server: the overall status (service "")
// is SERVING; an unknown service is NOT_FOUND.
TEST_F(BadInputTest, HealthServiceOnEveryServer) {
  std::vector<std::string> servers = {cluster_->coordinator()};
  servers.insert(servers.end(), info_.worker_addresses().begin(), info_.worker_addresses().end());
  const std::string serving("\x08\x01", 2);  // HealthCheckResponse{status: SERVING}
  for (const std::string& s : servers) {
    std::string reply;
    EXPECT_EQ(RawCall(s, "/grpc.health.v1.Health/Check", "", &reply), StatusCode::OK) << s;
    EXPECT_EQ(reply, serving) << s;
    // HealthCheckRequest{service: "nope"}
    EXPECT_EQ(RawCall(s, "/grpc.health.v1.Health/Check", std::string("\x0a\x04nope", 6)),
              StatusCode::NOT_FOUND)
        << s;
  }
}

}  // namespace
}  // namespace ember
