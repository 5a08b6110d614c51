// WorkerService in process (no gRPC transport): NaN/Inf in gradient updates,
// refused by default and left out with skip_nonfinite, against SGD values
// worked by hand.
#include "server/worker/worker_service.h"

#include <cmath>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu_backend.h"
#include "server/common/wire.h"

namespace ember {
namespace worker {
namespace {

using ember::v1::TableConfig;

std::unique_ptr<WorkerService> MakeService(WorkerServiceOptions so) {
  backend::CpuBackendOptions o;
  o.memory_limit_bytes = 1 << 20;
  auto b = backend::CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  auto s = std::make_unique<WorkerService>(std::move(*b), so);
  ember::v1::CreateShardsRequest req;
  req.set_collection("c");
  req.set_epoch(1);
  for (const char* name : {"t", "s"}) {
    auto* a = req.add_shards();
    a->mutable_ref()->set_table(name);
    TableConfig* t = a->mutable_table();
    t->set_name(name);
    t->set_num_embeddings(4);
    t->set_embedding_dim(4);
    t->set_pooling(std::string(name) == "s" ? TableConfig::NONE : TableConfig::SUM);
    t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::SGD);
    t->mutable_optimizer()->set_learning_rate(1.0);
    t->mutable_initializer()->set_type(ember::v1::InitializerSpec::CONSTANT);
    t->mutable_initializer()->set_value(0.0);
    a->set_rows(4);
    a->set_cols(4);
  }
  ember::v1::CreateShardsResponse resp;
  EXPECT_TRUE(s->CreateShards(nullptr, &req, &resp).ok());
  return s;
}

// Pooled table t: bag 0 = {id 0} with a NaN in its gradient row; bag 1 =
// {id 1 (weight 2), id 2 (weight Inf)} with gradient [1, 2, 3, 4].
// Sequence table s: id 0 with an Inf gradient row, id 3 with [1, 1, 1, 1].
ember::v1::WorkerApplyGradientsRequest Update(const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r;
  r.set_collection("c");
  r.set_epoch(1);
  r.set_request_id(id);
  auto* g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("t");
  g->mutable_feature()->set_pooling(TableConfig::SUM);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1, 2}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 1, 2}));
  g->mutable_feature()->set_weights(wire::Encode<float>(std::vector<float>{1, 2, INFINITY}));
  g->set_grad(wire::Encode<float>(std::vector<float>{NAN, 1, 1, 1, 1, 2, 3, 4}));
  g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("s");
  g->mutable_feature()->set_pooling(TableConfig::NONE);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{2}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0, 3}));
  g->set_grad(wire::Encode<float>(std::vector<float>{INFINITY, 0, 0, 0, 1, 1, 1, 1}));
  return r;
}

std::unique_ptr<WorkerService> MakeService(bool skip) {
  WorkerServiceOptions so;
  so.skip_nonfinite = skip;
  return MakeService(so);
}

std::vector<float> Table(WorkerService* s, const std::string& table) {
  ember::v1::ExportRowsRequest req;
  req.set_collection("c");
  req.mutable_shard()->set_table(table);
  req.set_row_end(4);
  ember::v1::ExportRowsResponse resp;
  EXPECT_TRUE(s->ExportRows(nullptr, &req, &resp).ok());
  std::vector<float> w;
  EXPECT_TRUE(wire::Decode(resp.weights(), "weights", &w).ok());
  return w;
}

TEST(WorkerServiceTest, NonFiniteUpdatesAreRefusedAndCounted) {
  auto s = MakeService(/*skip=*/false);
  auto req = Update("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  EXPECT_EQ(s->ApplyGradients(nullptr, &req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), std::vector<float>(16, 0.0f));  // nothing applied
  EXPECT_EQ(Table(s.get(), "s"), std::vector<float>(16, 0.0f));
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.nonfinite_refused(), 1);
  EXPECT_EQ(st.nonfinite_skipped_ids(), 0);
}

TEST(WorkerServiceTest, SkipNonFiniteLeavesOutWhatTheyTouchAndAppliesTheRest) {
  auto s = MakeService(/*skip=*/true);
  auto req = Update("a");
  ember::v1::WorkerApplyGradientsResponse resp;
  ASSERT_TRUE(s->ApplyGradients(nullptr, &req, &resp).ok());
  // SGD, lr 1, from 0: only id 1 of t (weight 2 x [1, 2, 3, 4]) and id 3
  // of s move.
  std::vector<float> t(16, 0.0f), q(16, 0.0f);
  for (int c = 0; c < 4; ++c) t[4 + c] = -2.0f * (c + 1);
  for (int c = 0; c < 4; ++c) q[12 + c] = -1.0f;
  EXPECT_EQ(Table(s.get(), "t"), t);
  EXPECT_EQ(Table(s.get(), "s"), q);
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.nonfinite_skipped_ids(), 3);  // t's ids 0 and 2, s's id 0
  EXPECT_EQ(st.nonfinite_refused(), 0);
  // A malformed request is still refused whole, NaN or not.
  auto bad = Update("b");
  bad.mutable_gradients(0)->mutable_feature()->set_lengths(
      wire::Encode<int64_t>(std::vector<int64_t>{1, 5}));
  EXPECT_EQ(s->ApplyGradients(nullptr, &bad, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Table(s.get(), "t"), t);
}

// One SGD step of -1 on row 0 of t under `id`; true if applied (not a
// duplicate).
bool Step(WorkerService* s, const std::string& id) {
  ember::v1::WorkerApplyGradientsRequest r;
  r.set_collection("c");
  r.set_epoch(1);
  r.set_request_id(id);
  auto* g = r.add_gradients();
  g->mutable_feature()->mutable_shard()->set_table("t");
  g->mutable_feature()->set_pooling(TableConfig::SUM);
  g->mutable_feature()->set_lengths(wire::Encode<int64_t>(std::vector<int64_t>{1}));
  g->mutable_feature()->set_ids(wire::Encode<int64_t>(std::vector<int64_t>{0}));
  g->set_grad(wire::Encode<float>(std::vector<float>{1, 1, 1, 1}));
  ember::v1::WorkerApplyGradientsResponse resp;
  EXPECT_TRUE(s->ApplyGradients(nullptr, &r, &resp).ok());
  return !resp.duplicate();
}

TEST(WorkerServiceTest, RequestIdsAreRememberedForTheTimeWindowThenForgotten) {
  WorkerServiceOptions o;
  o.dedup_ttl = absl::Milliseconds(300);
  auto s = MakeService(o);
  EXPECT_TRUE(Step(s.get(), "x"));
  EXPECT_FALSE(Step(s.get(), "x"));  // a retry inside the window: applied once
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_TRUE(Step(s.get(), "y"));  // ages "x" out
  EXPECT_TRUE(Step(s.get(), "x"));
  EXPECT_EQ(Table(s.get(), "t")[0], -3.0f);  // three steps of lr 1 x grad 1
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.dedup_forgotten_early(), 0);
}

TEST(WorkerServiceTest, TheMemoryBoundForgetsTheOldestEarlyAndSaysSo) {
  WorkerServiceOptions o;
  o.dedup_window = 2;
  auto s = MakeService(o);
  EXPECT_TRUE(Step(s.get(), "a"));
  EXPECT_TRUE(Step(s.get(), "b"));
  EXPECT_TRUE(Step(s.get(), "c"));  // "a" forgotten inside its window
  EXPECT_FALSE(Step(s.get(), "b"));
  EXPECT_TRUE(Step(s.get(), "a"));
  ember::v1::ShardStatusRequest sreq;
  ember::v1::ShardStatusResponse st;
  ASSERT_TRUE(s->ShardStatus(nullptr, &sreq, &st).ok());
  EXPECT_EQ(st.dedup_forgotten_early(), 2);  // "a", then "b" when "a" came again
}

}  // namespace
}  // namespace worker
}  // namespace ember
