// Graceful drain, with real processes (`emberctl coordinator` and three
// `emberctl worker`s): while a trainer applies a fixed sequence of updates
// (each retried under its request id until acknowledged), one worker is
// drained on demand (DrainWorker, as `emberctl drain`) and another gets
// SIGTERM. Their shards move to the other workers by live copy; afterwards
// the tables equal an in-process reference that applied every update
// exactly once: no update lost, none applied twice.
#include <signal.h>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <random>
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

// Drains (one asked for, one on SIGTERM) while a trainer's updates flow:
// every table ends equal to an in-process reference. `kernel`: every table
// on it ("fused": the default), on workers started with `worker_flags`.
void DrainWhileTraining(const std::string& kernel, const std::vector<std::string>& worker_flags) {
  testing_util::StandaloneCluster cluster(kEmberctl, 3, {"--lease_ms=3000"}, "", worker_flags);
  ASSERT_TRUE(cluster.ok());
  const std::string address = cluster.address();
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(address, o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("d");
  spec.mutable_tables()->RemoveLast();  // no sequence table
  if (kernel != "fused") {
    for (const auto& t : spec.tables()) {
      ember::v1::ParameterConstraints& pc = (*spec.mutable_constraints())[t.name()];
      pc.add_compute_kernels(kernel);
      pc.set_cache_load_factor(0.5);
    }
  }
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  for (const auto& ts : info->plan().tables()) EXPECT_EQ(ts.compute_kernel(), kernel);
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();

  std::atomic<int> done{0};
  std::atomic<bool> failed{false};
  constexpr int kSteps = 120;
  std::thread trainer([&] {
    std::mt19937 rng(9);
    for (int step = 0; step < kSteps && !failed; ++step) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4,
                                        step % 2 == 1);
      const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
      absl::Status s = ApplyUntilAcknowledged(c->get(), "d", kjt, g, absl::StrCat("step-", step));
      if (!s.ok()) {
        ADD_FAILURE() << "step " << step << ": " << s;
        failed = true;
        return;
      }
      if (!(*ref)->ApplyGradients(kjt, g).ok()) failed = true;
      ++done;
    }
  });
  auto wait_for = [&](int steps) {
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (done < steps && !failed && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  };
  // Which worker ids serve ranks 0 and 1.
  auto listed = (*c)->ListWorkers();
  ASSERT_TRUE(listed.ok());
  auto id_at = [&](int rank) {
    for (const auto& w : listed->workers()) {
      if (w.info().address() == info->worker_addresses(rank)) return w.worker_id();
    }
    return std::string();
  };
  const std::string drained = id_at(1);
  int sigterm_index = -1;
  for (int i = 0; i < listed->workers_size(); ++i) {
    if (listed->workers(i).info().address() == info->worker_addresses(0)) sigterm_index = i;
  }
  ASSERT_FALSE(drained.empty());
  ASSERT_GE(sigterm_index, 0);

  wait_for(30);
  auto moved = (*c)->DrainWorker(drained);  // as `emberctl drain --worker=ID`
  EXPECT_TRUE(moved.ok()) << moved.status();
  wait_for(60);
  // SIGTERM on the worker at rank 0: it drains itself, then exits.
  const pid_t pid = static_cast<pid_t>(listed->workers(sigterm_index).info().pid());
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  trainer.join();
  ASSERT_FALSE(failed);
  ASSERT_EQ(done.load(), kSteps);
  for (auto& w : cluster.workers()) {
    if (w->pid() == pid) w->Stop(SIGTERM);  // waits until it has drained and exited
  }

  auto after = (*c)->GetCollection("d");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->state(), ember::v1::CollectionInfo::SERVING);
  for (const auto& ts : after->plan().tables()) {
    EXPECT_EQ(ts.compute_kernel(), kernel);
    for (const auto& sh : ts.shards()) {
      EXPECT_NE(after->worker_addresses(sh.rank()), info->worker_addresses(0));
      EXPECT_NE(after->worker_addresses(sh.rank()), info->worker_addresses(1));
    }
  }
  for (const auto& t : spec.tables()) {
    int64_t rows, dim, rr, rd;
    auto got = (*c)->ExportTable("d", t.name(), &rows, &dim);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(*got, *(*ref)->ExportTable(t.name(), &rr, &rd), "table " + t.name());
  }
}

TEST(DrainTest, ShardsMoveLiveAndNoUpdateIsLostOrDoubled) { DrainWhileTraining("fused", {}); }

// The same with every table on the CUDA workers' host-memory kernels, on
// CUDA workers emulated on the CPU: the moved shards keep their kernel.
TEST(DrainTest, FusedUvmShardsMoveLive) {
  DrainWhileTraining("fused_uvm", {"--device=cuda_emulated", "--uvm_memory_gib=1"});
}
TEST(DrainTest, FusedUvmCachingShardsMoveLive) {
  DrainWhileTraining("fused_uvm_caching", {"--device=cuda_emulated", "--uvm_memory_gib=1",
                                           "--key_value_min_cache_rows=1"});
}

// A drain copies live: while its copy is under way (held open by a pause
// point after the bulk copy) the collection stays SERVING on the old plan
// and the trainer's updates are acknowledged; they reach the new places by
// the catch-up, and afterwards the tables equal the reference.
TEST(DrainTest, TrainingGoesOnWhileTheShardsAreCopied) {
  setenv("EMBER_COORDINATOR_PAUSE_AT", "live_move_copied", 1);
  setenv("EMBER_COORDINATOR_PAUSE_MS", "4000", 1);
  testing_util::StandaloneCluster cluster(kEmberctl, 3, {"--lease_ms=3000"});
  unsetenv("EMBER_COORDINATOR_PAUSE_AT");
  unsetenv("EMBER_COORDINATOR_PAUSE_MS");
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(cluster.address(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("live");
  spec.mutable_tables()->RemoveLast();  // no sequence table
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();

  std::atomic<int> done{0};
  std::atomic<bool> stop{false}, failed{false};
  std::thread trainer([&] {
    std::mt19937 rng(21);
    for (int step = 0; !stop && !failed; ++step) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4,
                                        step % 2 == 1);
      const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
      absl::Status s = ApplyUntilAcknowledged(c->get(), "live", kjt, g, absl::StrCat("s-", step));
      if (!s.ok()) {
        ADD_FAILURE() << "step " << step << ": " << s;
        failed = true;
        return;
      }
      if (!(*ref)->ApplyGradients(kjt, g).ok()) failed = true;
      ++done;
    }
  });
  while (done < 20 && !failed) absl::SleepFor(absl::Milliseconds(5));
  auto listed = (*c)->ListWorkers();
  ASSERT_TRUE(listed.ok());
  std::string drained;
  for (const auto& w : listed->workers()) {
    if (w.info().address() == info->worker_addresses(1)) drained = w.worker_id();
  }
  ASSERT_FALSE(drained.empty());
  absl::Status drain_status;
  std::thread drain([&] { drain_status = (*c)->DrainWorker(drained).status(); });
  // The bulk copy is done and the move waits at the pause point.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::string note;
  while (absl::Now() < deadline) {
    auto now = (*c)->GetCollection("live");
    if (now.ok() && now->note().find("block(s) copied (") != std::string::npos) {
      EXPECT_EQ(now->state(), ember::v1::CollectionInfo::SERVING);
      EXPECT_EQ(now->plan().epoch(), info->plan().epoch());  // the old plan serves
      note = now->note();
      break;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_FALSE(note.empty()) << "the drain never reported its live copy";
  const int before = done;
  absl::SleepFor(absl::Milliseconds(1000));
  const int during = done - before;
  auto still = (*c)->GetCollection("live");
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(still->plan().epoch(), info->plan().epoch()) << "the pause ended early: " << note;
  EXPECT_GT(during, 0) << "no update was acknowledged during the live copy";
  drain.join();
  EXPECT_TRUE(drain_status.ok()) << drain_status;
  const int at_end = done;
  while (done < at_end + 10 && !failed) absl::SleepFor(absl::Milliseconds(5));
  stop = true;
  trainer.join();
  ASSERT_FALSE(failed);

  auto after = (*c)->GetCollection("live");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->state(), ember::v1::CollectionInfo::SERVING);
  EXPECT_GT(after->plan().epoch(), info->plan().epoch());
  EXPECT_NE(after->note().find("copied live while serving"), std::string::npos) << after->note();
  for (const auto& ts : after->plan().tables()) {
    for (const auto& sh : ts.shards()) {
      EXPECT_NE(after->worker_addresses(sh.rank()), info->worker_addresses(1));
    }
  }
  for (const auto& t : spec.tables()) {
    int64_t rows, dim, rr, rd;
    auto got = (*c)->ExportTable("live", t.name(), &rows, &dim);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectNear(*got, *(*ref)->ExportTable(t.name(), &rr, &rd), "table " + t.name());
  }
  std::cout << "updates acknowledged during the 1 s inside the live copy: " << during << "\n";
}

}  // namespace
}  // namespace ember
