// Replicated shards (CollectionSpec.replicas = 2) with real processes
// (`emberctl coordinator` and `emberctl worker`s): every shard on two
// workers, updates acknowledged once both copies applied them. A worker
// killed with SIGKILL while a trainer runs: its shards are taken over by
// their backups with nothing rolled back, the missing copies are made anew
// live, and every table equals an in-process reference holding every
// acknowledged update (each retried under its request id until
// acknowledged, so applied exactly once across the take-over). The copies
// of each shard are compared byte for byte (weights, optimizer state,
// step). A trainer's update sent straight to a backup is refused. The
// coordinator killed in the middle of a take-over finishes it when started
// again.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <map>
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
#include "proto/service.grpc.pb.h"
#include "server/common/grpc_util.h"
#include "tests/local_cluster.h"
#include "tests/netns.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::InProcessCollection;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using ember::v1::CollectionInfo;
using ember::v1::CollectionSpec;
using testing_util::ApplyUntilAcknowledged;
using testing_util::ExpectNear;
using testing_util::RandomGradients;
using testing_util::RandomKjt;
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

// A trainer and its reference: each update retried until acknowledged,
// then applied to the reference.
class Trainer {
 public:
  Trainer(Client* c, InProcessCollection* ref, std::string name, int seed)
      : c_(c), ref_(ref), name_(std::move(name)), rng_(seed) {}
  ~Trainer() { Stop(); }

  absl::Status Step() {
    KeyedJaggedTensor kjt =
        RandomKjt(rng_, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4, step_ % 2 == 1);
    const KeyedTensor g = RandomGradients(rng_, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
    absl::Status s =
        ApplyUntilAcknowledged(c_, name_, kjt, g, absl::StrCat(name_, "-", step_++));
    if (!s.ok()) return s;
    last_ack_ = absl::Now();
    ++acked_;
    return ref_->ApplyGradients(kjt, g);
  }
  void Start() {
    thread_ = std::thread([this] {
      while (!stop_ && !failed_) {
        if (absl::Status s = Step(); !s.ok()) {
          ADD_FAILURE() << "step " << step_ << ": " << s;
          failed_ = true;
        }
      }
    });
  }
  void Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  void WaitFor(int more) {
    const int until = acked_ + more;
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (acked_ < until && !failed_ && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
  int acked() const { return acked_; }
  bool failed() const { return failed_; }
  absl::Time last_ack() const { return last_ack_; }

 private:
  Client* c_;
  InProcessCollection* ref_;
  std::string name_;
  std::mt19937 rng_;
  int step_ = 0;
  std::atomic<int> acked_{0};
  std::atomic<bool> stop_{false}, failed_{false};
  std::atomic<absl::Time> last_ack_{absl::InfinitePast()};
  std::thread thread_;
};

// The shards of `info` with fewer than two copies.
int ShortOfCopies(const CollectionInfo& info) {
  int n = 0;
  for (const auto& ts : info.plan().tables()) {
    for (const auto& sh : ts.shards()) n += sh.rows() > 0 && sh.backups_size() != 1;
  }
  return n;
}

// Every copy of every shard of `info`, read from its worker: equal bytes.
void ExpectCopiesIdentical(const CollectionInfo& info) {
  for (const auto& ts : info.plan().tables()) {
    for (int i = 0; i < ts.shards_size(); ++i) {
      const auto& sh = ts.shards(i);
      if (sh.rows() == 0) continue;
      std::vector<int> ranks = {sh.rank()};
      ranks.insert(ranks.end(), sh.backups().begin(), sh.backups().end());
      ASSERT_EQ(ranks.size(), 2u) << ts.table() << " shard " << i;
      std::vector<ember::v1::ExportRowsResponse> copies;
      for (int r : ranks) {
        auto stub = ember::v1::Worker::NewStub(MakeChannel(info.worker_addresses(r)));
        grpc::ClientContext ctx;
        SetDeadline(&ctx, absl::Seconds(10));
        ember::v1::ExportRowsRequest req;
        req.set_collection(info.spec().name());
        req.mutable_shard()->set_table(ts.table());
        req.mutable_shard()->set_shard_index(i);
        req.set_row_begin(0);
        req.set_row_end(sh.rows());
        ember::v1::ExportRowsResponse resp;
        const grpc::Status s = stub->ExportRows(&ctx, req, &resp);
        ASSERT_TRUE(s.ok()) << info.worker_addresses(r) << ": " << s.error_message();
        copies.push_back(std::move(resp));
      }
      const std::string what = absl::StrCat(ts.table(), " shard ", i, " on ranks ", ranks[0],
                                            " and ", ranks[1]);
      EXPECT_EQ(copies[0].weights(), copies[1].weights()) << what << ": weights differ";
      EXPECT_EQ(copies[0].state(), copies[1].state()) << what << ": optimizer state differs";
      EXPECT_EQ(copies[0].step(), copies[1].step()) << what;
      EXPECT_FALSE(copies[0].weights().empty()) << what;
    }
  }
}

class ReplicasTest : public ::testing::Test {
 protected:
  void Start(int workers, const std::string& sharding, const std::string& crash_at = "") {
    cluster_ = std::make_unique<testing_util::StandaloneCluster>(
        kEmberctl, workers,
        std::vector<std::string>{"--lease_ms=1500", "--state_dir=" + testing_util::TempDir()},
        crash_at);
    ASSERT_TRUE(cluster_->ok());
    client::ClientOptions o;
    o.timeout = absl::Seconds(30);
    auto c = Client::Connect(cluster_->address(), o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
    if (!sharding.empty()) Create(sharding);
  }

  // Collection "r", replicated twice, on every live worker.
  void Create(const std::string& sharding) {
    spec_ = TestSpec("r");
    spec_.mutable_tables()->RemoveLast();  // no sequence table
    spec_.set_replicas(2);
    auto info = client_->CreateCollection(spec_, sharding);
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    auto ref = InProcessCollection::Create(spec_, &info->plan());
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
  }

  // The collection as the coordinator has it (empty while the coordinator
  // cannot be reached: it may be starting again).
  CollectionInfo Get() {
    auto info = client_->GetCollection("r");
    return info.ok() ? *info : CollectionInfo();
  }

  // Waits until the collection serves with two copies of every shard at an
  // epoch past `epoch`, none on the worker at `without` (if given).
  CollectionInfo WaitForTwoCopies(int64_t epoch, absl::Duration limit,
                                  const std::string& without = "") {
    const absl::Time deadline = absl::Now() + limit;
    CollectionInfo info;
    auto on_without = [&without](const CollectionInfo& i) {
      for (const auto& ts : i.plan().tables()) {
        for (const auto& sh : ts.shards()) {
          if (sh.rows() == 0) continue;
          if (i.worker_addresses(sh.rank()) == without) return true;
          for (int b : sh.backups()) {
            if (i.worker_addresses(b) == without) return true;
          }
        }
      }
      return false;
    };
    while (absl::Now() < deadline) {
      info = Get();
      if (info.plan().epoch() > epoch && info.state() == CollectionInfo::SERVING &&
          ShortOfCopies(info) == 0 && (without.empty() || !on_without(info))) {
        return info;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ADD_FAILURE() << "no two copies of every shard within " << limit << ": state "
                  << CollectionInfo::State_Name(info.state()) << ", note: " << info.note();
    return info;
  }

  // Polls the collection until its plan is past info_'s epoch (and it
  // serves again, with `serving`), for at most `limit`: the last read.
  CollectionInfo WaitPastEpoch(absl::Duration limit, bool serving) {
    const absl::Time deadline = absl::Now() + limit;
    CollectionInfo now;
    do {
      absl::SleepFor(absl::Milliseconds(10));
      now = Get();
    } while ((now.plan().epoch() == info_.plan().epoch() ||
              (serving && now.state() != CollectionInfo::SERVING)) &&
             absl::Now() < deadline);
    return now;
  }

  // No shard of `info` has a copy (primary or backup) on `address`.
  static void ExpectNoCopyOn(const CollectionInfo& info, const std::string& address) {
    for (const auto& ts : info.plan().tables()) {
      for (const auto& sh : ts.shards()) {
        EXPECT_NE(info.worker_addresses(sh.rank()), address) << ts.table();
        for (int b : sh.backups()) EXPECT_NE(info.worker_addresses(b), address) << ts.table();
      }
    }
  }

  void ExpectTablesEqualTheReference(const std::string& what) {
    for (const auto& t : spec_.tables()) {
      int64_t rows, dim, rr, rd;
      auto got = client_->ExportTable("r", t.name(), &rows, &dim);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectNear(*got, *ref_->ExportTable(t.name(), &rr, &rd), what + " table " + t.name());
    }
  }

  // The pid of the worker at `address`.
  pid_t PidOf(const std::string& address) {
    auto listed = client_->ListWorkers();
    EXPECT_TRUE(listed.ok());
    for (const auto& w : listed->workers()) {
      if (w.info().address() == address) return static_cast<pid_t>(w.info().pid());
    }
    return -1;
  }

  std::unique_ptr<testing_util::StandaloneCluster> cluster_;
  std::unique_ptr<Client> client_;
  CollectionSpec spec_;
  CollectionInfo info_;
  std::unique_ptr<InProcessCollection> ref_;
};

TEST_F(ReplicasTest, EveryShardHasTwoCopiesOnTwoWorkersAndTheyStayIdentical) {
  Start(3, "row_wise");
  EXPECT_EQ(ShortOfCopies(info_), 0);
  for (const auto& ts : info_.plan().tables()) {
    for (const auto& sh : ts.shards()) {
      if (sh.rows() == 0) continue;
      ASSERT_EQ(sh.backups_size(), 1) << ts.table();
      EXPECT_NE(sh.backups(0), sh.rank()) << ts.table();
    }
  }
  Trainer trainer(client_.get(), ref_.get(), "r", 3);
  for (int i = 0; i < 30; ++i) ASSERT_TRUE(trainer.Step().ok());
  ExpectTablesEqualTheReference("two copies");
  ExpectCopiesIdentical(info_);

  // A trainer's update sent to a backup copy is refused: only the primary
  // takes updates (and forwards them).
  const auto& ts = info_.plan().tables(0);
  const auto& sh = ts.shards(0);
  auto stub = ember::v1::Worker::NewStub(MakeChannel(info_.worker_addresses(sh.backups(0))));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(10));
  ember::v1::WorkerApplyGradientsRequest req = testing_util::OneIdUpdate(
      "r", info_.plan().epoch(), "straight-to-a-backup", ts.table(), 0, "f_sum", 0, 16, 1.0f);
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status s = stub->ApplyGradients(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
  EXPECT_NE(s.error_message().find("backup copy"), std::string::npos) << s.error_message();
  // ... and so is one claiming to come from a primary it does not have.
  grpc::ClientContext ctx2;
  SetDeadline(&ctx2, absl::Seconds(10));
  req.set_from_primary("127.0.0.1:1");
  const grpc::Status forged = stub->ApplyGradients(&ctx2, req, &resp);
  EXPECT_EQ(forged.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << forged.error_message();
  ExpectCopiesIdentical(info_);
  ExpectTablesEqualTheReference("after the refused updates");
}

// SIGKILL of a worker while a trainer runs: no acknowledged update is lost
// (nothing comes from a checkpoint: there is none), and two copies of every
// shard exist again afterwards.
TEST_F(ReplicasTest, AWorkerKilledDuringTrainingLosesNoAcknowledgedUpdate) {
  for (const std::string sharding : {"row_wise", "table_wise"}) {
    SCOPED_TRACE(sharding);
    Start(3, sharding);
    Trainer trainer(client_.get(), ref_.get(), "r", 11);
    trainer.Start();
    trainer.WaitFor(20);
    const std::string victim = info_.worker_addresses(0);
    const pid_t pid = PidOf(victim);
    ASSERT_GT(pid, 0);
    const absl::Time killed = absl::Now();
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    // Serving again: its shards taken over at a new epoch.
    const CollectionInfo now = WaitPastEpoch(absl::Seconds(30), /*serving=*/true);
    const absl::Duration failover = absl::Now() - killed;
    EXPECT_NE(now.note().find("no acknowledged update lost"), std::string::npos) << now.note();
    const CollectionInfo after =
        WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(60), victim);
    trainer.WaitFor(20);
    trainer.Stop();
    ASSERT_FALSE(trainer.failed());
    EXPECT_EQ(after.recovered_from(), "") << after.note();
    ExpectNoCopyOn(after, victim);
    ExpectTablesEqualTheReference("after the kill");
    ExpectCopiesIdentical(WaitForTwoCopies(0, absl::Seconds(60)));
    std::cout << sharding << ": failover (kill -9 to serving at the take-over's epoch) "
              << absl::ToDoubleMilliseconds(failover) << " ms with a 1500 ms lease; "
              << trainer.acked() << " updates acknowledged\n";
    cluster_.reset();
  }
}

// A SYNC or BOUNDED collection of two trainer ranks, two copies of every
// shard: a step's ranks are merged on each shard's primary and forwarded to
// its backup as one update (BOUNDED: each rank's update is kept by the
// backups too once its primary holds it, before the rank is answered).
// SIGKILL of a worker mid-run: every rank's every step ends applied exactly
// once (the tables equal one trainer sending the global batch, rank 0's
// bags then rank 1's, gradients halved), with no checkpoint, and the copies
// are identical again.
class ReplicasStepKillTest
    : public ReplicasTest,
      public ::testing::WithParamInterface<ember::v1::TrainingSpec::Mode> {};

TEST_P(ReplicasStepKillTest, ASteppedCollectionLosesNoStepWhenAWorkerIsKilled) {
  Start(3, "");
  spec_ = TestSpec("r");
  spec_.mutable_tables()->RemoveLast();  // no sequence table
  spec_.set_replicas(2);
  spec_.mutable_training()->set_mode(GetParam());
  if (GetParam() == ember::v1::TrainingSpec::BOUNDED) {
    spec_.mutable_training()->set_max_staleness(2);
  }
  spec_.mutable_training()->set_trainers(2);
  spec_.mutable_training()->set_step_timeout_s(60);
  auto info = client_->CreateCollection(spec_, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  info_ = *info;
  CollectionSpec ref_spec = spec_;
  ref_spec.clear_training();
  auto ref = InProcessCollection::Create(ref_spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  ref_ = *std::move(ref);

  // Rank r's bags and gradients at step s, the same wherever made.
  const std::vector<std::string> keys = {"f_sum", "f_mean", "f_rw"};
  const std::vector<int> rows = {301, 200, 150};
  constexpr int kBatch = 4;
  auto bags = [&](int s, int r) {
    std::mt19937 rng(1000 + 2 * s + r);
    std::vector<std::vector<std::vector<int64_t>>> ids(keys.size());
    for (size_t k = 0; k < keys.size(); ++k) {
      for (int b = 0; b < kBatch; ++b) {
        std::vector<int64_t> bag;
        for (int i = 0, n = rng() % 4; i < n; ++i) bag.push_back(rng() % rows[k]);
        ids[k].push_back(bag);
      }
    }
    return ids;
  };
  auto grads = [&](int s, int r) {
    std::mt19937 rng(5000 + 2 * s + r);
    return RandomGradients(rng, keys, {16, 16, 16}, kBatch);
  };

  constexpr int kSteps = 36, kKillAt = 12;
  std::atomic<int> done[2] = {{0}, {0}};
  std::atomic<bool> failed{false};
  auto rank = [&](int r) {
    auto mine = Client::Connect(cluster_->address(), client::ClientOptions{});
    if (!mine.ok()) {
      ADD_FAILURE() << mine.status();
      failed = true;
      return;
    }
    for (int s = 0; s < kSteps && !failed; ++s) {
      const KeyedJaggedTensor kjt = *KeyedJaggedTensor::FromJagged(keys, bags(s, r));
      const absl::Time deadline = absl::Now() + absl::Seconds(90);
      absl::Status last;
      do {  // the step's lookup (from either copy), then its update
        auto looked = (*mine)->Lookup("r", kjt, client::StepTag{s, r});
        last = looked.status();
        if (last.ok()) {
          last = (*mine)->ApplyGradients("r", kjt, grads(s, r), absl::StrCat("rank", r, "-", s),
                                        nullptr, client::StepTag{s, r});
        }
        if (!last.ok()) absl::SleepFor(absl::Milliseconds(50));
      } while (!last.ok() && absl::Now() < deadline);
      if (!last.ok()) {
        ADD_FAILURE() << "rank " << r << " step " << s << ": " << last;
        failed = true;
      }
      ++done[r];
    }
  };
  std::thread r0(rank, 0), r1(rank, 1);
  const absl::Time start = absl::Now();
  while (done[0] < kKillAt && !failed && absl::Now() - start < absl::Seconds(60)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::string victim = info_.worker_addresses(0);
  const pid_t pid = PidOf(victim);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  r0.join();
  r1.join();
  ASSERT_FALSE(failed);
  const CollectionInfo after = WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(60), victim);
  EXPECT_EQ(after.recovered_from(), "") << after.note();

  for (int s = 0; s < kSteps; ++s) {
    std::vector<std::vector<std::vector<int64_t>>> global = bags(s, 0);
    const auto second = bags(s, 1);
    for (size_t k = 0; k < keys.size(); ++k) {
      global[k].insert(global[k].end(), second[k].begin(), second[k].end());
    }
    client::KeyedTensor both = grads(s, 0);
    const client::KeyedTensor other = grads(s, 1);
    both.batch_size = 2 * kBatch;
    both.values.insert(both.values.end(), other.values.begin(), other.values.end());
    for (float& g : both.values) g /= 2.0f;
    ASSERT_TRUE(ref_->ApplyGradients(*KeyedJaggedTensor::FromJagged(keys, global), both).ok());
  }
  // A lookup for the step after the last (BOUNDED: the first that must
  // see every step) reads either copy alike (each call takes the next
  // copy; a backup that has had no step since its epoch began sends the
  // client to the primary).
  const int after_last = kSteps + spec_.training().max_staleness();
  const KeyedJaggedTensor probe = *KeyedJaggedTensor::FromJagged(keys, bags(kSteps, 0));
  auto want = ref_->Lookup(probe);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int i = 0; i < 4; ++i) {
    auto got = client_->Lookup("r", probe, client::StepTag{after_last, 0});
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(got->values, want->values, absl::StrCat("lookup ", i, " after the steps"));
  }
  ExpectTablesEqualTheReference(absl::StrCat(
      ember::v1::TrainingSpec::Mode_Name(GetParam()), " steps across a take-over"));
  ExpectCopiesIdentical(after);
}

INSTANTIATE_TEST_SUITE_P(Modes, ReplicasStepKillTest,
                         ::testing::Values(ember::v1::TrainingSpec::SYNC,
                                           ember::v1::TrainingSpec::BOUNDED),
                         [](const auto& info) {
                           return ember::v1::TrainingSpec::Mode_Name(info.param);
                         });

// SIGKILL of the worker a lost rank's copies are being made on, during the
// live copy (held open by a pause point): the copy fails, the collection
// serves on with one copy of those shards, and the copies are made on the
// workers left instead; nothing acknowledged is lost.
TEST_F(ReplicasTest, AWorkerKilledWhileCopiesAreMadeLosesNothing) {
  setenv("EMBER_COORDINATOR_PAUSE_AT", "live_move_copied", 1);
  setenv("EMBER_COORDINATOR_PAUSE_MS", "3000", 1);
  Start(4, "table_wise");
  unsetenv("EMBER_COORDINATOR_PAUSE_AT");
  unsetenv("EMBER_COORDINATOR_PAUSE_MS");
  // Served from three: the fourth is a spare, which a lost rank takes.
  auto three = client_->ScaleCollection("r", 3);
  ASSERT_TRUE(three.ok()) << three.status();
  info_ = three->collection();
  std::set<std::string> holders;
  for (int r = 0; r < info_.worker_addresses_size(); ++r) holders.insert(info_.worker_addresses(r));
  std::string spare;
  auto listed = client_->ListWorkers();
  ASSERT_TRUE(listed.ok());
  for (const auto& w : listed->workers()) {
    if (!holders.count(w.info().address())) spare = w.info().address();
  }
  ASSERT_FALSE(spare.empty());
  Trainer trainer(client_.get(), ref_.get(), "r", 21);
  trainer.Start();
  trainer.WaitFor(10);
  std::string victim;
  for (int r : {0, 1, 2}) {
    if (info_.worker_addresses(r) != spare) victim = info_.worker_addresses(r);
    if (!victim.empty()) break;
  }
  ASSERT_EQ(kill(PidOf(victim), SIGKILL), 0);
  // The copies go to the spare; kill it while they are copied.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  bool copying = false;
  while (absl::Now() < deadline && !copying) {
    const CollectionInfo now = Get();
    copying = now.note().find("anew") != std::string::npos;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(copying) << "no copy under way: " << Get().note();
  ASSERT_EQ(kill(PidOf(spare), SIGKILL), 0);
  const CollectionInfo after = WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(90), spare);
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  ExpectNoCopyOn(after, spare);
  ExpectTablesEqualTheReference("after both kills");
  ExpectCopiesIdentical(WaitForTwoCopies(0, absl::Seconds(60)));
}

// The coordinator killed (a fault-injection point) once a take-over is
// stored and before any worker heard of it: started again, it finishes the
// take-over, the copies are made anew, and nothing acknowledged is lost.
TEST_F(ReplicasTest, ACoordinatorKilledDuringATakeOverFinishesIt) {
  Start(3, "row_wise", "take_over_persisted");
  Trainer trainer(client_.get(), ref_.get(), "r", 31);
  trainer.Start();
  trainer.WaitFor(20);
  ASSERT_EQ(kill(PidOf(info_.worker_addresses(1)), SIGKILL), 0);
  // The coordinator dies at the take-over (within the lease and a monitor
  // round), then starts again.
  absl::SleepFor(absl::Seconds(3));
  ASSERT_TRUE(cluster_->RestartCoordinator());
  const CollectionInfo after =
      WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(60), info_.worker_addresses(1));
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  ExpectNoCopyOn(after, info_.worker_addresses(1));
  ExpectTablesEqualTheReference("after the coordinator's restart");
  ExpectCopiesIdentical(WaitForTwoCopies(0, absl::Seconds(60)));
}

// A replicated collection rescaled 3 -> 2 -> 3 workers while a trainer
// runs: copies stay on the workers that stay, a backup takes over from a
// primary whose worker leaves, the missing copies are made by the same
// move; two copies of every shard after each, equal to the reference.
TEST_F(ReplicasTest, RescalingKeepsTwoCopiesWhileTraining) {
  Start(3, "row_wise");
  Trainer trainer(client_.get(), ref_.get(), "r", 41);
  trainer.Start();
  trainer.WaitFor(10);
  for (int workers : {2, 3, 2}) {
    auto scaled = client_->ScaleCollection("r", workers);
    ASSERT_TRUE(scaled.ok()) << scaled.status();
    EXPECT_EQ(ShortOfCopies(scaled->collection()), 0) << workers;
    std::set<int> ranks;
    for (const auto& ts : scaled->collection().plan().tables()) {
      for (const auto& sh : ts.shards()) {
        ranks.insert(sh.rank());
        ranks.insert(sh.backups().begin(), sh.backups().end());
      }
    }
    EXPECT_EQ(static_cast<int>(ranks.size()), workers);
    trainer.WaitFor(10);
  }
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  ExpectTablesEqualTheReference("after 3 -> 2 -> 3 -> 2");
  ExpectCopiesIdentical(WaitForTwoCopies(0, absl::Seconds(60)));
}

// A worker cut off from the coordinator and from nothing else (its
// heartbeats stop, it serves on: fault injection) while it holds primaries:
// the coordinator takes its shards over, and from then on it acknowledges
// nothing, though a client with the old plan still reaches it: its
// forwards are refused at the newer epoch. No split brain: the tables
// equal the reference of every acknowledged update, and the copies agree.
TEST_F(ReplicasTest, APrimaryCutOffFromTheCoordinatorAcknowledgesNothing) {
  Start(3, "");
  setenv("EMBER_WORKER_SILENT_AFTER_MS", "3000", 1);
  testing_util::Process cut({kEmberctl, "worker", "--coordinator=" + cluster_->address(),
                             "--listen=127.0.0.1:0", "--memory_gib=2"});
  unsetenv("EMBER_WORKER_SILENT_AFTER_MS");
  ASSERT_FALSE(cut.Line("worker ").empty());
  Create("row_wise");
  ASSERT_EQ(info_.worker_addresses_size(), 4);
  int cut_rank = -1;
  auto listed = client_->ListWorkers();
  ASSERT_TRUE(listed.ok());
  for (const auto& w : listed->workers()) {
    for (int r = 0; r < 4; ++r) {
      if (w.info().pid() == cut.pid() && info_.worker_addresses(r) == w.info().address()) {
        cut_rank = r;
      }
    }
  }
  ASSERT_GE(cut_rank, 0);
  Trainer trainer(client_.get(), ref_.get(), "r", 51);
  trainer.Start();
  // Taken over once its lease lapses (3 s of heartbeats, then 1.5 s).
  const CollectionInfo now = WaitPastEpoch(absl::Seconds(30), /*serving=*/false);
  ASSERT_GT(now.plan().epoch(), info_.plan().epoch()) << now.note();
  // An update of the old plan sent to the cut-off worker, for a shard it
  // was the primary of, is not acknowledged.
  const auto& ts = info_.plan().tables(0);
  int shard = -1;
  for (int i = 0; i < ts.shards_size(); ++i) {
    if (ts.shards(i).rank() == cut_rank && ts.shards(i).rows() > 0) shard = i;
  }
  ASSERT_GE(shard, 0);
  auto stub = ember::v1::Worker::NewStub(MakeChannel(info_.worker_addresses(cut_rank)));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(10));
  const ember::v1::WorkerApplyGradientsRequest req = testing_util::OneIdUpdate(
      "r", info_.plan().epoch(), "to-the-cut-off-primary", ts.table(), shard, "f_sum", 0, 16,
      100.0f);
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status s = stub->ApplyGradients(&ctx, req, &resp);
  EXPECT_FALSE(s.ok()) << "a cut-off primary acknowledged an update";
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  const CollectionInfo after = WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(60),
                                                info_.worker_addresses(cut_rank));
  ExpectNoCopyOn(after, info_.worker_addresses(cut_rank));
  ExpectTablesEqualTheReference("after the cut");
  ExpectCopiesIdentical(after);
  std::cout << "the cut-off primary answered: " << s.error_message() << "\n";
}

// A real network partition (network namespaces, as tests/multihost_test
// makes hosts): a primary's host loses its routes to the coordinator and to
// the other workers and keeps the one to the trainer (this process). Its
// lease lapses and its shards are taken over at a new epoch; an update of
// the old plan sent to it is not acknowledged (its forwards cannot reach
// its backups), and every update the trainer saw acknowledged is in the
// tables. Healed, it takes part again and the copies agree.
TEST_F(ReplicasTest, APrimaryPartitionedFromTheClusterAcknowledgesNothing) {
  testing_util::Hosts hosts(absl::StrCat("ember-rp", getpid()));
  if (!hosts.Start()) {
    GTEST_SKIP() << "needs root and `ip` to make network namespaces with a bridge";
  }
  // Its own subnet per run (runs of this test may overlap).
  const std::string subnet = absl::StrCat("10.97.", getpid() % 250, ".");
  const std::string coordinator_ip = subnet + "2";
  std::vector<std::string> worker_ips;
  ASSERT_TRUE(hosts.Add("coord", coordinator_ip));
  for (int i = 0; i < 3; ++i) {
    worker_ips.push_back(absl::StrCat(subnet, 10 + i));
    ASSERT_TRUE(hosts.Add(absl::StrCat("w", i), worker_ips.back()));
  }
  ASSERT_TRUE(hosts.AddThisHost(subnet + "50"));
  const std::string emberctl = testing_util::Absolute(kEmberctl);
  std::vector<std::string> argv = hosts.Exec("coord");
  for (const std::string& a :
       {emberctl, std::string("coordinator"), "--listen=" + coordinator_ip + ":7000",
        std::string("--lease_ms=1500"), "--state_dir=" + testing_util::TempDir()}) {
    argv.push_back(a);
  }
  testing_util::Process coordinator(argv);
  ASSERT_FALSE(coordinator.Line("coordinator listening on ").empty());
  std::vector<std::unique_ptr<testing_util::Process>> workers;
  for (int i = 0; i < 3; ++i) {
    argv = hosts.Exec(absl::StrCat("w", i));
    for (const std::string& a : {emberctl, std::string("worker"),
                                 "--coordinator=" + coordinator_ip + ":7000",
                                 "--listen=" + worker_ips[i] + ":7000",
                                 std::string("--memory_gib=2")}) {
      argv.push_back(a);
    }
    workers.push_back(std::make_unique<testing_util::Process>(argv));
    ASSERT_FALSE(workers.back()->Line("worker ").empty()) << "worker " << i;
  }
  client::ClientOptions o;
  o.timeout = absl::Seconds(30);
  auto c = Client::Connect(coordinator_ip + ":7000", o);
  ASSERT_TRUE(c.ok()) << c.status();
  client_ = *std::move(c);
  Create("row_wise");
  const std::string cut = worker_ips[0] + ":7000";
  int cut_rank = -1;
  for (int r = 0; r < info_.worker_addresses_size(); ++r) {
    if (info_.worker_addresses(r) == cut) cut_rank = r;
  }
  ASSERT_GE(cut_rank, 0);
  Trainer trainer(client_.get(), ref_.get(), "r", 61);
  trainer.Start();
  trainer.WaitFor(10);

  // The partition: worker 0 and the rest of the cluster cannot reach each
  // other; the trainer reaches both sides.
  const std::vector<std::string> others = {coordinator_ip, worker_ips[1], worker_ips[2]};
  for (const std::string& other : others) ASSERT_TRUE(hosts.Blackhole("w0", other, true));
  for (const char* name : {"coord", "w1", "w2"}) {
    ASSERT_TRUE(hosts.Blackhole(name, worker_ips[0], true));
  }
  const absl::Time partitioned = absl::Now();
  const CollectionInfo now = WaitPastEpoch(absl::Seconds(30), /*serving=*/true);
  ASSERT_GT(now.plan().epoch(), info_.plan().epoch()) << now.note();
  std::cout << "partition to serving at the take-over's epoch: "
            << absl::ToDoubleMilliseconds(absl::Now() - partitioned)
            << " ms with a 1500 ms lease\n";
  const auto& ts = info_.plan().tables(0);
  int shard = -1;
  for (int i = 0; i < ts.shards_size(); ++i) {
    if (ts.shards(i).rank() == cut_rank && ts.shards(i).rows() > 0) shard = i;
  }
  ASSERT_GE(shard, 0);
  auto stub = ember::v1::Worker::NewStub(MakeChannel(cut));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(10));
  const ember::v1::WorkerApplyGradientsRequest req = testing_util::OneIdUpdate(
      "r", info_.plan().epoch(), "to-the-partitioned-primary", ts.table(), shard, "f_sum", 0, 16,
      100.0f);
  ember::v1::WorkerApplyGradientsResponse resp;
  const grpc::Status s = stub->ApplyGradients(&ctx, req, &resp);
  EXPECT_FALSE(s.ok()) << "a partitioned primary acknowledged an update";
  std::cout << "the partitioned primary answered: " << s.error_message() << "\n";
  trainer.WaitFor(20);

  // Healed: the routes back.
  for (const std::string& other : others) EXPECT_TRUE(hosts.Blackhole("w0", other, false));
  for (const char* name : {"coord", "w1", "w2"}) {
    EXPECT_TRUE(hosts.Blackhole(name, worker_ips[0], false));
  }
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  const CollectionInfo after = WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(60));
  ExpectTablesEqualTheReference("after the partition");
  ExpectCopiesIdentical(after);
  client_.reset();
  for (auto& w : workers) w->Stop(SIGKILL);
  coordinator.Stop(SIGKILL);
}

// SIGKILL of a worker holding copies while a rescale 2 -> 3 moves them,
// held open at a point of the move (its shards made but nothing copied, after
// the live copy, or while fenced):
// the move fails and the old placement comes back (at once, or re-adopted
// after the fence), the dead worker's shards are taken over by their
// backups and copied anew; nothing acknowledged is lost.
class ReplicasRescaleKillTest : public ReplicasTest,
                                public ::testing::WithParamInterface<const char*> {};

TEST_P(ReplicasRescaleKillTest, AHolderKilledDuringARescaleLosesNothing) {
  setenv("EMBER_COORDINATOR_PAUSE_AT", GetParam(), 1);
  setenv("EMBER_COORDINATOR_PAUSE_MS", "3000", 1);
  Start(3, "");
  unsetenv("EMBER_COORDINATOR_PAUSE_AT");
  unsetenv("EMBER_COORDINATOR_PAUSE_MS");
  Create("table_wise");
  // From 2 workers (the setup move pauses too) to 3.
  auto two = client_->ScaleCollection("r", 2);
  ASSERT_TRUE(two.ok()) << two.status();
  info_ = two->collection();
  Trainer trainer(client_.get(), ref_.get(), "r", 61);
  trainer.Start();
  trainer.WaitFor(10);
  const std::string victim = info_.worker_addresses(0);
  const pid_t pid = PidOf(victim);
  ASSERT_GT(pid, 0);
  std::thread killer([&] {
    // Into the pause (before the copy, after it, or fenced), then the kill.
    absl::SleepFor(absl::Milliseconds(1500));
    kill(pid, SIGKILL);
  });
  auto three = client_->ScaleCollection("r", 3);
  killer.join();
  EXPECT_FALSE(three.ok()) << "the move went through with a source dead";
  const CollectionInfo after = WaitForTwoCopies(info_.plan().epoch(), absl::Seconds(90), victim);
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  ExpectNoCopyOn(after, victim);
  ExpectTablesEqualTheReference(std::string("killed at ") + GetParam());
  ExpectCopiesIdentical(after);
}

INSTANTIATE_TEST_SUITE_P(Points, ReplicasRescaleKillTest,
                         ::testing::Values("live_move_created", "live_move_copied",
                                           "live_move_fenced"));

// The coordinator killed during a rescale 3 -> 2 of a replicated
// collection while a trainer runs: after its live copy, while fenced, or
// once the new placement's data is in place. Started again it finishes or
// undoes the move; two copies of every shard, nothing acknowledged lost.
class ReplicasCoordinatorKillTest : public ReplicasTest,
                                    public ::testing::WithParamInterface<const char*> {};

TEST_P(ReplicasCoordinatorKillTest, ACoordinatorKilledDuringARescaleLosesNothing) {
  Start(3, "row_wise", GetParam());
  Trainer trainer(client_.get(), ref_.get(), "r", 71);
  trainer.Start();
  trainer.WaitFor(10);
  EXPECT_FALSE(client_->ScaleCollection("r", 2).ok()) << "the coordinator did not die";
  ASSERT_TRUE(cluster_->RestartCoordinator());
  trainer.WaitFor(20);
  trainer.Stop();
  ASSERT_FALSE(trainer.failed());
  const CollectionInfo after = WaitForTwoCopies(0, absl::Seconds(60));
  ExpectTablesEqualTheReference(std::string("coordinator killed at ") + GetParam());
  ExpectCopiesIdentical(after);
  std::set<int> holders;
  for (const auto& ts : after.plan().tables()) {
    for (const auto& sh : ts.shards()) {
      if (sh.rows() == 0) continue;
      holders.insert(sh.rank());
      holders.insert(sh.backups().begin(), sh.backups().end());
    }
  }
  std::cout << GetParam() << ": " << holders.size()
            << " worker(s) hold the collection after the restart; note: " << after.note() << "\n";
}

INSTANTIATE_TEST_SUITE_P(Points, ReplicasCoordinatorKillTest,
                         ::testing::Values("live_move_copied", "live_move_fenced",
                                           "move_after_data"));

TEST_F(ReplicasTest, BadReplicaSettingsAreRefused) {
  Start(2, "table_wise");
  CollectionSpec spec = TestSpec("bad");
  spec.set_replicas(3);  // more copies than workers
  auto too_many = client_->CreateCollection(spec, "table_wise");
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kFailedPrecondition) << too_many.status();
  spec.set_replicas(9);
  EXPECT_EQ(client_->CreateCollection(spec, "table_wise").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(client_->GetCollection("bad").ok());
}

}  // namespace
}  // namespace ember
