// The key_value kernel end to end (`emberctl up --ssd_dir`): tables whose
// constraints name it are planned on it with their cache_load_factor,
// their shards keep their rows in files under the workers' --ssd_dir with
// half of them in memory, and training through the client matches the
// in-process reference (every row held in memory) for table-wise and
// row-wise shards and every optimizer; a checkpoint restores exactly; a
// drain moves the shards live. A cluster without an SSD tier refuses such
// tables when it plans. (Recovery after kill -9: recovery_test.)
#include <atomic>
#include <memory>
#include <random>
#include <string>
#include <thread>

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
using testing_util::ExpectTablesMatch;
using testing_util::ExportAll;
using testing_util::LocalCluster;
using testing_util::RandomGradients;
using testing_util::RandomKjt;
using testing_util::StepAgainstReference;
using testing_util::Tables;
using testing_util::TempDir;
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

std::unique_ptr<Client> Connect(const std::string& address) {
  client::ClientOptions o;
  o.timeout = absl::Seconds(20);
  auto c = Client::Connect(address, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// TestSpec with every table on the key_value kernel, half its rows cached.
CollectionSpec KeyValueSpec(const std::string& name) {
  CollectionSpec spec = TestSpec(name);
  for (const auto& t : spec.tables()) {
    ember::v1::ParameterConstraints& c = (*spec.mutable_constraints())[t.name()];
    c.add_compute_kernels("key_value");
    c.set_cache_load_factor(0.5);
  }
  return spec;
}

void Train(Client* c, const std::string& name, InProcessCollection* ref, uint32_t seed,
           int steps) {
  std::mt19937 rng(seed);
  for (int step = 0; step < steps; ++step) {
    ASSERT_NO_FATAL_FAILURE(StepAgainstReference(c, ref, name, rng, 5, step % 2 == 1,
                                                 /*sequence=*/true, name));
  }
}

TEST(KeyValueTest, TrainsAsTheTablesHeldInMemoryAndCheckpoints) {
  LocalCluster cluster(kEmberctl, 2,
                       {"--ssd_dir=" + ::testing::TempDir(), "--ssd_gib=1", "--key_value_min_cache_rows=1",
                        "--checkpoint_dir=" + ::testing::TempDir()});
  ASSERT_TRUE(cluster.ok());
  auto c = Connect(cluster.coordinator());
  ASSERT_TRUE(c);
  const std::string root = TempDir();
  uint32_t seed = 5;
  for (const std::string type : {"table_wise", "row_wise"}) {
    SCOPED_TRACE(type);
    const std::string name = "kv_" + type;
    const CollectionSpec spec = KeyValueSpec(name);
    auto info = c->CreateCollection(spec, type);
    ASSERT_TRUE(info.ok()) << info.status();
    for (const auto& ts : info->plan().tables()) {
      EXPECT_EQ(ts.compute_kernel(), "key_value") << ts.table();
      EXPECT_EQ(ts.cache_load_factor(), 0.5) << ts.table();
    }
    auto ref = InProcessCollection::Create(spec, &info->plan());
    ASSERT_TRUE(ref.ok()) << ref.status();
    Train(c.get(), name, ref->get(), seed++, 12);
    ExpectTablesMatch(c.get(), ref->get(), name, spec, type + " trained");
    // A checkpoint (read through the caches) restores exactly, and trains on.
    const Tables at_checkpoint = ExportAll(c.get(), name, spec);
    auto ck = c->Checkpoint(name, root);
    ASSERT_TRUE(ck.ok()) << ck.status();
    auto back = c->Restore(ck->path(), name + "_back", type);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(ExportAll(c.get(), name + "_back", spec), at_checkpoint);
    Train(c.get(), name + "_back", ref->get(), seed++, 3);
    ASSERT_TRUE(c->DropCollection(name).ok());
    ASSERT_TRUE(c->DropCollection(name + "_back").ok());
  }
}

// A drain moves key_value shards live (their rows read through the caches
// and written into the new workers' files) while a trainer goes on; no
// update is lost or doubled.
TEST(KeyValueTest, ADrainMovesKeyValueShardsLive) {
  LocalCluster cluster(kEmberctl, 3, {"--ssd_dir=" + ::testing::TempDir(), "--ssd_gib=1",
                                         "--key_value_min_cache_rows=1"});
  ASSERT_TRUE(cluster.ok());
  auto c = Connect(cluster.coordinator());
  ASSERT_TRUE(c);
  CollectionSpec spec = KeyValueSpec("kv_drain");
  spec.mutable_tables()->RemoveLast();  // no sequence table
  spec.mutable_constraints()->erase("t_seq");
  auto info = c->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto listed = c->ListWorkers();
  ASSERT_TRUE(listed.ok());
  std::string drained;
  for (const auto& w : listed->workers()) {
    if (w.info().address() == info->worker_addresses(1)) drained = w.worker_id();
  }
  ASSERT_FALSE(drained.empty());

  std::atomic<int> done{0};
  std::atomic<bool> failed{false};
  constexpr int kSteps = 60;
  std::thread trainer([&] {
    std::mt19937 rng(3);
    for (int step = 0; step < kSteps && !failed; ++step) {
      KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean", "f_rw"}, {301, 200, 150}, 4,
                                        step % 2 == 1);
      const KeyedTensor g = RandomGradients(rng, {"f_sum", "f_mean", "f_rw"}, {16, 16, 16}, 4);
      absl::Status s = ApplyUntilAcknowledged(c.get(), "kv_drain", kjt, g,
                                              absl::StrCat("step-", step));
      if (!s.ok()) {
        ADD_FAILURE() << "step " << step << ": " << s;
        failed = true;
        return;
      }
      if (!(*ref)->ApplyGradients(kjt, g).ok()) failed = true;
      ++done;
    }
  });
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (done < 20 && !failed && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  auto moved = c->DrainWorker(drained);
  EXPECT_TRUE(moved.ok()) << moved.status();
  trainer.join();
  ASSERT_FALSE(failed);
  ASSERT_EQ(done.load(), kSteps);
  auto after = c->GetCollection("kv_drain");
  ASSERT_TRUE(after.ok());
  for (const auto& ts : after->plan().tables()) {
    EXPECT_EQ(ts.compute_kernel(), "key_value");
    for (const auto& sh : ts.shards()) {
      EXPECT_NE(after->worker_addresses(sh.rank()), info->worker_addresses(1));
    }
  }
  ExpectTablesMatch(c.get(), ref->get(), "kv_drain", spec, "after the drain");
}

TEST(KeyValueTest, WorkersWithoutAnSsdTierAreNotPlannedOnIt) {
  LocalCluster cluster(kEmberctl, 1);
  ASSERT_TRUE(cluster.ok());
  auto c = Connect(cluster.coordinator());
  ASSERT_TRUE(c);
  auto info = c->CreateCollection(KeyValueSpec("no_ssd"), "table_wise");
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument) << info.status();
  EXPECT_NE(info.status().message().find("key_value"), std::string::npos) << info.status();
}

}  // namespace
}  // namespace ember
