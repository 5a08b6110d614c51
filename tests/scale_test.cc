// Live rescaling, with real processes (`emberctl coordinator` and three
// `emberctl worker`s): collections served from three workers go to two and
// back to three (ScaleCollection, as `emberctl scale`) while a trainer
// applies updates, each retried under its request id until acknowledged.
// Row-wise tables are re-cut, table-wise ones leave the worker that goes,
// data-parallel ones gain and lose replicas; afterwards every table equals
// an in-process reference that applied every update exactly once. A pause
// point inside each move's live copy holds it open long enough to see
// training go on through it.
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gtest/gtest.h"
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
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

class ScaleTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    setenv("EMBER_COORDINATOR_PAUSE_AT", "live_move_copied", 1);
    setenv("EMBER_COORDINATOR_PAUSE_MS", "1500", 1);
    cluster_ = new testing_util::StandaloneCluster(kEmberctl, 3, {"--lease_ms=3000"});
    unsetenv("EMBER_COORDINATOR_PAUSE_AT");
    unsetenv("EMBER_COORDINATOR_PAUSE_MS");
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(cluster_->ok());
    client::ClientOptions o;
    o.timeout = absl::Seconds(10);
    auto c = Client::Connect(cluster_->address(), o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  // Creates `name` with `sharding` over every live worker, its reference
  // beside it.
  void Create(const std::string& name, const std::string& sharding) {
    spec_ = TestSpec(name);
    spec_.mutable_tables()->RemoveLast();  // no sequence table
    auto info = client_->CreateCollection(spec_, sharding);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->worker_addresses_size(), 3);
    auto ref = InProcessCollection::Create(spec_, &info->plan());
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
  }

  // One update through the cluster and the reference alike.
  absl::Status Step(const std::string& name, std::mt19937& rng, int step) {
    KeyedJaggedTensor kjt =
        RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4, step % 2 == 1);
    const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
    absl::Status s = ApplyUntilAcknowledged(client_.get(), name, kjt, g, absl::StrCat("s-", step));
    if (!s.ok()) return s;
    return ref_->ApplyGradients(kjt, g);
  }

  // Scales `name` to `workers` while a trainer runs; returns the response
  // and how many updates were acknowledged while the call was under way.
  ember::v1::ScaleCollectionResponse ScaleWhileTraining(const std::string& name, int workers,
                                                        int* during, int* first_step) {
    std::atomic<int> done{0};
    std::atomic<bool> stop{false}, failed{false};
    const int base = *first_step;
    std::thread trainer([&] {
      std::mt19937 rng(base + 1);
      for (int step = base; !stop && !failed; ++step) {
        if (absl::Status s = Step(name, rng, step); !s.ok()) {
          ADD_FAILURE() << "step " << step << ": " << s;
          failed = true;
        }
        ++done;
      }
    });
    while (done < 10 && !failed) absl::SleepFor(absl::Milliseconds(5));
    const int before = done;
    auto scaled = client_->ScaleCollection(name, workers);
    *during = done - before;
    const int after = done;
    while (done < after + 10 && !failed) absl::SleepFor(absl::Milliseconds(5));
    stop = true;
    trainer.join();
    *first_step = base + done;
    EXPECT_FALSE(failed);
    EXPECT_TRUE(scaled.ok()) << scaled.status();
    return scaled.ok() ? *scaled : ember::v1::ScaleCollectionResponse();
  }

  void ExpectTablesEqualTheReference(const std::string& name, const std::string& what) {
    for (const auto& t : spec_.tables()) {
      int64_t rows, dim, rr, rd;
      auto got = client_->ExportTable(name, t.name(), &rows, &dim);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectNear(*got, *ref_->ExportTable(t.name(), &rr, &rd), what + " table " + t.name());
    }
  }

  static testing_util::StandaloneCluster* cluster_;
  std::unique_ptr<Client> client_;
  CollectionSpec spec_;
  std::unique_ptr<InProcessCollection> ref_;
};

testing_util::StandaloneCluster* ScaleTest::cluster_ = nullptr;

// The workers a plan places shards or replicas on.
std::set<std::string> Holders(const ember::v1::CollectionInfo& info) {
  std::set<std::string> out;
  for (const auto& ts : info.plan().tables()) {
    for (int r : ts.ranks()) out.insert(info.worker_addresses(r));
  }
  return out;
}

TEST_F(ScaleTest, RowWiseTablesAreReCutWhileTraining) {
  Create("rw", "row_wise");
  int step = 0, during = 0;
  const ember::v1::ScaleCollectionResponse down = ScaleWhileTraining("rw", 2, &during, &step);
  EXPECT_GT(during, 0) << "no update was acknowledged while the shards moved";
  EXPECT_EQ(down.collection().state(), ember::v1::CollectionInfo::SERVING);
  EXPECT_EQ(Holders(down.collection()).size(), 2u);
  for (const auto& ts : down.collection().plan().tables()) {
    EXPECT_EQ(ts.shards_size(), 2) << ts.table();
  }
  // Rows that stay on their worker are re-cut there, not sent across.
  EXPECT_GT(down.shards_moved(), 0);
  EXPECT_GT(down.bytes_between_workers(), 0);
  EXPECT_LT(down.bytes_between_workers(), down.bytes_copied());
  ExpectTablesEqualTheReference("rw", "3 -> 2");

  const ember::v1::ScaleCollectionResponse up = ScaleWhileTraining("rw", 3, &during, &step);
  EXPECT_GT(during, 0);
  EXPECT_EQ(Holders(up.collection()).size(), 3u);
  EXPECT_GT(up.collection().plan().epoch(), down.collection().plan().epoch());
  ExpectTablesEqualTheReference("rw", "2 -> 3");
  // Three more: each fence may catch an update in flight, applied by some
  // of a merged shard's sources and not others (its retry must then reach
  // just the rows that lacked it).
  for (int workers : {2, 3, 1}) {
    ScaleWhileTraining("rw", workers, &during, &step);
    ExpectTablesEqualTheReference("rw", absl::StrCat("to ", workers));
  }
  std::cout << "3 -> 2: " << down.bytes_copied() << " bytes copied, "
            << down.bytes_between_workers() << " between workers, fenced " << down.fence_ms()
            << " ms; 2 -> 3: fenced " << up.fence_ms() << " ms\n";
}

TEST_F(ScaleTest, TableWiseAndReplicatedTablesFollowTheirWorkers) {
  for (const std::string sharding : {"table_wise", "data_parallel"}) {
    const std::string name = sharding == "table_wise" ? "tw" : "dp";
    Create(name, sharding);
    int step = 0, during = 0;
    const auto down = ScaleWhileTraining(name, 2, &during, &step);
    EXPECT_EQ(Holders(down.collection()).size(), 2u) << sharding;
    ExpectTablesEqualTheReference(name, sharding + " 3 -> 2");
    const auto up = ScaleWhileTraining(name, 3, &during, &step);
    // A replica on each; table-wise tables even out onto the new worker
    // where that lightens the fullest.
    if (sharding == "data_parallel") {
      EXPECT_EQ(Holders(up.collection()).size(), 3u);
    } else {
      EXPECT_GE(Holders(up.collection()).size(), 2u);
    }
    ExpectTablesEqualTheReference(name, sharding + " 2 -> 3");
    ASSERT_TRUE(client_->DropCollection(name).ok());
  }
}

TEST_F(ScaleTest, BadRequestsAreRefusedAndChangeNothing) {
  Create("bad", "row_wise");
  auto before = client_->GetCollection("bad");
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(client_->ScaleCollection("bad", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto too_many = client_->ScaleCollection("bad", 4);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(too_many.status().message().find("3 live worker(s)"), std::string::npos)
      << too_many.status();
  EXPECT_EQ(client_->ScaleCollection("nope", 2).status().code(), absl::StatusCode::kNotFound);
  auto same = client_->ScaleCollection("bad", 3);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->shards_moved(), 0);
  auto after = client_->GetCollection("bad");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->plan().epoch(), before->plan().epoch());
  EXPECT_EQ(after->state(), ember::v1::CollectionInfo::SERVING);
  ASSERT_TRUE(client_->DropCollection("bad").ok());
}

// A move that fails before its fence leaves the old placement serving (it
// never stopped: same epoch); one that fails after it puts the collection
// back on its old placement at a newer epoch; either way no update is lost,
// and the next attempt succeeds (fault injection: each point fails once).
TEST(ScaleFailureTest, AFailedMoveLeavesTheOldPlacementServing) {
  setenv("EMBER_COORDINATOR_FAIL_AT", "live_move_copied,live_move_fenced", 1);
  testing_util::StandaloneCluster cluster(kEmberctl, 3, {"--lease_ms=3000"});
  unsetenv("EMBER_COORDINATOR_FAIL_AT");
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(cluster.address(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("f");
  spec.mutable_tables()->RemoveLast();
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok());
  std::mt19937 rng(5);
  int step = 0;
  auto train = [&](int n) {
    for (int k = 0; k < n; ++k, ++step) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4,
                                        false);
      const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
      ASSERT_TRUE(
          ApplyUntilAcknowledged(c->get(), "f", kjt, g, absl::StrCat("f-", step)).ok());
      ASSERT_TRUE((*ref)->ApplyGradients(kjt, g).ok());
    }
  };
  auto expect_equal = [&](const std::string& what) {
    for (const auto& t : spec.tables()) {
      int64_t rows, dim, rr, rd;
      auto got = (*c)->ExportTable("f", t.name(), &rows, &dim);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectNear(*got, *(*ref)->ExportTable(t.name(), &rr, &rd), what + " table " + t.name());
    }
  };
  train(10);
  auto before_fence = (*c)->ScaleCollection("f", 2);
  EXPECT_EQ(before_fence.status().code(), absl::StatusCode::kUnavailable);
  auto now = (*c)->GetCollection("f");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->state(), ember::v1::CollectionInfo::SERVING);
  EXPECT_EQ(now->plan().epoch(), info->plan().epoch());  // never stopped
  EXPECT_NE(now->note().find("the old placement serves on"), std::string::npos) << now->note();
  EXPECT_EQ(Holders(*now).size(), 3u);
  train(10);
  expect_equal("after a failure before the fence");

  auto after_fence = (*c)->ScaleCollection("f", 2);
  EXPECT_EQ(after_fence.status().code(), absl::StatusCode::kUnavailable);
  now = (*c)->GetCollection("f");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->state(), ember::v1::CollectionInfo::SERVING);
  EXPECT_GT(now->plan().epoch(), info->plan().epoch());  // re-adopted
  EXPECT_EQ(Holders(*now).size(), 3u);
  train(10);
  expect_equal("after a failure after the fence");

  auto scaled = (*c)->ScaleCollection("f", 2);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_EQ(Holders(scaled->collection()).size(), 2u);
  train(10);
  expect_equal("after the move");
}

// kill -9 of the worker a rescale is filling, during its live copy (held
// open by a pause point): the move fails, the old placement (which never
// held anything on that worker) serves on, and no update is lost.
TEST(ScaleFailureTest, ADestinationKilledDuringTheCopyLosesNothing) {
  setenv("EMBER_COORDINATOR_PAUSE_AT", "live_move_copied", 1);
  setenv("EMBER_COORDINATOR_PAUSE_MS", "3000", 1);
  testing_util::StandaloneCluster cluster(kEmberctl, 3, {"--lease_ms=1500"});
  unsetenv("EMBER_COORDINATOR_PAUSE_AT");
  unsetenv("EMBER_COORDINATOR_PAUSE_MS");
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(20);
  auto c = Client::Connect(cluster.address(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("k");
  spec.mutable_tables()->RemoveLast();
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok());
  auto two = (*c)->ScaleCollection("k", 2);  // the third worker now holds nothing
  ASSERT_TRUE(two.ok()) << two.status();
  std::set<std::string> holding = Holders(two->collection());
  pid_t spare = -1;
  auto listed = (*c)->ListWorkers();
  ASSERT_TRUE(listed.ok());
  for (const auto& w : listed->workers()) {
    if (!holding.count(w.info().address())) spare = static_cast<pid_t>(w.info().pid());
  }
  ASSERT_GT(spare, 0);

  std::atomic<bool> stop{false}, failed{false};
  std::atomic<int> done{0};
  std::thread trainer([&] {
    std::mt19937 rng(17);
    for (int step = 0; !stop && !failed; ++step) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4,
                                        false);
      const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
      absl::Status s = ApplyUntilAcknowledged(c->get(), "k", kjt, g, absl::StrCat("k-", step));
      if (!s.ok() || !(*ref)->ApplyGradients(kjt, g).ok()) {
        ADD_FAILURE() << "step " << step << ": " << s;
        failed = true;
      }
      ++done;
    }
  });
  absl::Status scaled;
  std::thread mover([&] { scaled = (*c)->ScaleCollection("k", 3).status(); });
  // Inside the live copy (its shards made and filled, the move paused at
  // the pause point): kill -9.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool copying = false;
  while (!copying && absl::Now() < deadline) {
    auto now = (*c)->GetCollection("k");
    copying = now.ok() && now->note().find("block(s) copied (") != std::string::npos;
    if (!copying) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(copying);
  absl::SleepFor(absl::Milliseconds(300));  // the small bulk copy is over: the move is paused
  ASSERT_EQ(kill(spare, SIGKILL), 0);
  for (auto& w : cluster.workers()) {
    if (w->pid() == spare) w->Wait(absl::Seconds(10));
  }
  mover.join();
  EXPECT_FALSE(scaled.ok());
  const int at_failure = done;
  while (done < at_failure + 20 && !failed) absl::SleepFor(absl::Milliseconds(5));
  stop = true;
  trainer.join();
  ASSERT_FALSE(failed);
  auto now = (*c)->GetCollection("k");
  ASSERT_TRUE(now.ok());
  EXPECT_EQ(now->state(), ember::v1::CollectionInfo::SERVING) << now->note();
  EXPECT_EQ(Holders(*now), holding);
  for (const auto& t : spec.tables()) {
    int64_t rows, dim, rr, rd;
    auto got = (*c)->ExportTable("k", t.name(), &rows, &dim);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(*got, *(*ref)->ExportTable(t.name(), &rr, &rd), "table " + t.name());
  }
}

}  // namespace
}  // namespace ember
