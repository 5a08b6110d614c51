// Coordinator restart, with real processes: `emberctl coordinator
// --state_dir` and two `emberctl worker`s. kill -9 the coordinator during
// training and start it again: training never stops (the coordinator is not
// on the data path), and afterwards the workers, collections, plans, epochs
// and checkpoint catalogue are as before; epochs never go backwards; shards
// a worker holds that the coordinator does not know are dropped.
#include <signal.h>

#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gtest/gtest.h"
#include "server/common/grpc_util.h"
#include "tests/local_cluster.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::InProcessCollection;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using ember::v1::CollectionSpec;
using testing_util::ApplyUntilAcknowledged;
using testing_util::ExpectNear;
using testing_util::RandomGradients;
using testing_util::RandomKjt;
using testing_util::TempDir;
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

std::string Describe(const ember::v1::CollectionInfo& c) {
  return absl::StrCat(c.spec().name(), " epoch ", c.plan().epoch(), " ",
                      absl::StrJoin(c.worker_addresses(), ","), " ",
                      c.plan().SerializeAsString().size());
}

TEST(CoordinatorRestartTest, TrainingGoesOnAndTheStateComesBack) {
  testing_util::StandaloneCluster cluster(
      kEmberctl, 2, {"--state_dir=" + TempDir(), "--checkpoint_dir=" + TempDir(), "--lease_ms=3000"});
  ASSERT_TRUE(cluster.ok());
  std::string address = cluster.address();
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(address, o);
  ASSERT_TRUE(c.ok()) << c.status();
  const CollectionSpec spec = TestSpec("s");
  ASSERT_TRUE((*c)->CreateCollection(spec, "row_wise").ok());
  ASSERT_TRUE((*c)->CreateCollection(TestSpec("t"), "table_wise").ok());
  ASSERT_TRUE((*c)->Checkpoint("s").ok());
  auto before = (*c)->ListCollections();
  ASSERT_TRUE(before.ok());
  auto workers_before = (*c)->ListWorkers();
  ASSERT_TRUE(workers_before.ok());

  // A stray collection on worker 0 that the coordinator never made.
  auto w0 = ember::v1::Worker::NewStub(MakeChannel((*before)[0].worker_addresses(0)));
  {
    grpc::ClientContext ctx;
    ember::v1::CreateShardsRequest stray;
    stray.set_collection("stray");
    stray.set_epoch(999);
    auto* a = stray.add_shards();
    a->mutable_ref()->set_table("t_sum");
    *a->mutable_table() = spec.tables(0);
    a->set_rows(10);
    a->set_cols(16);
    ember::v1::CreateShardsResponse resp;
    ASSERT_TRUE(w0->CreateShards(&ctx, stray, &resp).ok());
  }

  // Training in the background through the kill and the restart.
  std::atomic<bool> stop{false};
  std::atomic<int> steps{0}, failures{0};
  std::thread trainer([&] {
    std::mt19937 rng(3);
    while (!stop) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 4, false);
      auto kt = (*c)->Lookup("s", kjt);
      if (!kt.ok()) {
        ++failures;
        continue;
      }
      KeyedTensor g = *kt;
      for (float& v : g.values) v = 0.01f;
      if (!(*c)->ApplyGradients("s", kjt, g).ok()) ++failures;
      ++steps;
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  cluster.coordinator().Stop(SIGKILL);
  const int steps_at_kill = steps;
  absl::SleepFor(absl::Seconds(1));
  EXPECT_GT(steps.load(), steps_at_kill);  // training went on without a coordinator
  ASSERT_TRUE(cluster.RestartCoordinator());
  absl::SleepFor(absl::Seconds(2));  // heartbeats resume; the first monitor pass reconciles
  stop = true;
  trainer.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(steps.load(), 0);

  auto c2 = Client::Connect(address, o);
  ASSERT_TRUE(c2.ok()) << c2.status();
  auto after = (*c2)->ListCollections();
  ASSERT_TRUE(after.ok());
  ASSERT_EQ(after->size(), before->size());
  for (size_t i = 0; i < after->size(); ++i) {
    EXPECT_EQ(Describe((*after)[i]), Describe((*before)[i]));
    EXPECT_EQ((*after)[i].state(), ember::v1::CollectionInfo::SERVING);
  }
  auto workers_after = (*c2)->ListWorkers();
  ASSERT_TRUE(workers_after.ok());
  ASSERT_EQ(workers_after->workers_size(), workers_before->workers_size());
  for (int i = 0; i < workers_after->workers_size(); ++i) {
    EXPECT_EQ(workers_after->workers(i).worker_id(), workers_before->workers(i).worker_id());
    EXPECT_TRUE(workers_after->workers(i).live());
  }
  auto catalogue = (*c2)->ListCheckpoints();
  ASSERT_TRUE(catalogue.ok());
  EXPECT_EQ(catalogue->size(), 1u);
  // Epochs never go backwards.
  int64_t highest = 0;
  for (const auto& info : *before) highest = std::max(highest, info.plan().epoch());
  auto u = (*c2)->CreateCollection(TestSpec("u"), "table_wise");
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_GT(u->plan().epoch(), highest);
  // The stray collection was dropped by reconciliation.
  {
    grpc::ClientContext ctx;
    ember::v1::ShardStatusResponse st;
    ASSERT_TRUE(w0->ShardStatus(&ctx, ember::v1::ShardStatusRequest(), &st).ok());
    ASSERT_GT(st.shards_size(), 0);
    for (const auto& sh : st.shards()) EXPECT_NE(sh.collection(), "stray");
  }
  // And training continues through the restarted coordinator.
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {2};
  kjt.values = {1, 300};
  EXPECT_TRUE((*c2)->Lookup("s", kjt).ok());
}

// The coordinator dies in the middle of a drain (a fault-injection point):
// during its live copy, at its fence (every holder at the new epoch, the
// last catch-up not done) or once the data is in place; it is started again:
// it keeps the old placement or adopts the new one accordingly, and a
// trainer riding through it (each update retried under its id until
// acknowledged) ends with tables equal to the in-process reference.
void CrashDuringDrain(const std::string& point, bool expect_moved) {
  testing_util::StandaloneCluster cluster(
      kEmberctl, 3, {"--state_dir=" + TempDir(), "--checkpoint_dir=" + TempDir(), "--lease_ms=3000"},
      point);
  ASSERT_TRUE(cluster.ok());
  const std::string address = cluster.address();
  client::ClientOptions o;
  o.timeout = absl::Seconds(5);
  auto c = Client::Connect(address, o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("m");
  spec.mutable_tables()->RemoveLast();  // no sequence table
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok());
  std::mt19937 rng(11);
  auto step = [&](int k) {
    KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4, false);
    const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
    ASSERT_TRUE(ApplyUntilAcknowledged(c->get(), "m", kjt, g, absl::StrCat("s", k)).ok());
    ASSERT_TRUE((*ref)->ApplyGradients(kjt, g).ok());
  };
  for (int k = 0; k < 20; ++k) step(k);
  auto listed = (*c)->ListWorkers();
  ASSERT_TRUE(listed.ok());
  std::string drained;
  for (const auto& w : listed->workers()) {
    if (w.info().address() == info->worker_addresses(1)) drained = w.worker_id();
  }
  ASSERT_FALSE(drained.empty());
  EXPECT_FALSE((*c)->DrainWorker(drained, absl::Seconds(10)).ok());  // the coordinator dies
  ASSERT_TRUE(cluster.RestartCoordinator());  // reaps the dead one first
  for (int k = 20; k < 40; ++k) step(k);

  auto after = (*c)->GetCollection("m");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->state(), ember::v1::CollectionInfo::SERVING);
  bool on_drained = false;
  for (const auto& ts : after->plan().tables()) {
    for (const auto& sh : ts.shards()) {
      on_drained |= after->worker_addresses(sh.rank()) == info->worker_addresses(1);
    }
  }
  EXPECT_EQ(on_drained, !expect_moved);
  for (const auto& t : spec.tables()) {
    int64_t rows, dim, rr, rd;
    auto got = (*c)->ExportTable("m", t.name(), &rows, &dim);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(*got, *(*ref)->ExportTable(t.name(), &rr, &rd), point + " table " + t.name());
  }
}

TEST(CoordinatorRestartTest, CrashDuringADrainsLiveCopyKeepsTheOldPlacement) {
  CrashDuringDrain("live_move_copied", /*expect_moved=*/false);
}

TEST(CoordinatorRestartTest, CrashAtADrainsFenceKeepsTheOldPlacement) {
  CrashDuringDrain("live_move_fenced", /*expect_moved=*/false);
}

TEST(CoordinatorRestartTest, CrashDuringADrainAfterTheDataMovedAdoptsTheNewOne) {
  CrashDuringDrain("move_after_data", /*expect_moved=*/true);
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

// The coordinator dies after storing a new trainer count and before the
// workers have it (a fault-injection point): restarted, it shows the new
// count, and the same SetTrainers call again puts it on the workers, where
// one rank alone then completes a step.
TEST(CoordinatorRestartTest, ACrashBetweenStoringAndPushingATrainerCountIsFinishedByTheSameCall) {
  testing_util::StandaloneCluster cluster(
      kEmberctl, 2, {"--state_dir=" + TempDir(), "--lease_ms=3000"}, "set_trainers_stored");
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(5);
  auto c = Client::Connect(cluster.address(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("t2");
  spec.mutable_tables()->RemoveLast();
  spec.mutable_training()->set_mode(ember::v1::TrainingSpec::SYNC);
  spec.mutable_training()->set_trainers(2);
  spec.mutable_training()->set_step_timeout_s(5);
  ASSERT_TRUE((*c)->CreateCollection(spec, "row_wise").ok());
  EXPECT_FALSE((*c)->SetTrainers("t2", 1, 0).ok());  // the coordinator dies
  ASSERT_TRUE(cluster.RestartCoordinator());
  auto stored = (*c)->GetCollection("t2");
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->spec().training().trainers(), 1);
  auto again = (*c)->SetTrainers("t2", 1, 0);
  ASSERT_TRUE(again.ok()) << again.status();
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {2};
  kjt.values = {1, 300};
  KeyedTensor g;
  g.keys = {"f_sum"};
  g.length_per_key = {16};
  g.batch_size = 1;
  g.values.assign(16, 0.5f);
  const absl::Status applied =
      (*c)->ApplyGradients("t2", kjt, g, "solo-step0", nullptr, client::StepTag{0, 0});
  EXPECT_TRUE(applied.ok()) << applied;  // SYNC: returns once applied, rank 0 alone
}

}  // namespace
}  // namespace ember
