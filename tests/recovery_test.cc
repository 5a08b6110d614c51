// Worker death, with real processes (`emberctl up --workers=3`, lease 3 s):
// kill -9 one worker during training; the coordinator re-places its shards
// (on the restarted replacement, or on the survivors) and reloads them from
// the latest checkpoint. Lookups then equal the tables as they were, with
// the lost shards rolled back to the checkpoint and every acknowledged
// update on the surviving shards kept; within the stated time (< 10 s).
#include <signal.h>

#include <map>
#include <random>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "proto/service.grpc.pb.h"
#include "server/common/dynamic_route.h"
#include "server/common/grpc_util.h"
#include "gtest/gtest.h"
#include "tests/local_cluster.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using ember::v1::CollectionInfo;
using ember::v1::CollectionSpec;
using testing_util::LocalCluster;
using testing_util::RandomKjt;
using testing_util::ExportAll;
using testing_util::Tables;
using testing_util::TempDir;
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

void Train(Client* c, const std::string& name, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  for (int step = 0; step < steps; ++step) {
    KeyedJaggedTensor kjt = RandomKjt(rng, {"f_mean", "f_sum", "f_rw"}, {200, 301, 150}, 6, false);
    auto kt = c->Lookup(name, kjt);
    ASSERT_TRUE(kt.ok()) << kt.status();
    KeyedTensor grads = *kt;
    for (float& g : grads.values) g = std::uniform_real_distribution<float>(-1, 1)(rng);
    ASSERT_TRUE(c->ApplyGradients(name, kjt, grads).ok());
  }
}

// `now` with the rows of every shard the plan put on `rank` taken from `then`.
Tables RollBackRank(const Tables& now, const Tables& then, const CollectionInfo& info, int rank) {
  Tables want = now;
  for (int t = 0; t < info.plan().tables_size(); ++t) {
    const auto& ts = info.plan().tables(t);
    const int64_t dim = info.spec().tables(t).embedding_dim();
    for (const auto& sh : ts.shards()) {
      if (sh.rank() != rank) continue;
      for (int64_t r = sh.row_offset(); r < sh.row_offset() + sh.rows(); ++r) {
        for (int64_t c = sh.col_offset(); c < sh.col_offset() + sh.cols(); ++c) {
          want[ts.table()][r * dim + c] = then.at(ts.table())[r * dim + c];
        }
      }
    }
  }
  return want;
}

// *pid: the process of the worker serving at `address`, as it registered.
void PidOf(Client* c, const std::string& address, pid_t* pid) {
  auto workers = c->ListWorkers();
  ASSERT_TRUE(workers.ok()) << workers.status();
  *pid = -1;
  for (const auto& w : workers->workers()) {
    if (w.info().address() == address) *pid = static_cast<pid_t>(w.info().pid());
  }
  ASSERT_GT(*pid, 0) << "no worker at " << address;
}

// kill -9 the worker process serving at `address`.
void KillWorkerAt(Client* c, const std::string& address) {
  pid_t victim = -1;
  ASSERT_NO_FATAL_FAILURE(PidOf(c, address, &victim));
  ASSERT_EQ(kill(victim, SIGKILL), 0);
}

struct Case {
  bool restart_workers;  // the replacement path, else the survivors take the shards
  bool checkpoint;       // else the lost shards come back freshly initialised
  bool whole;            // CollectionSpec.recovery = WHOLE_COLLECTION
  // The checkpoint belongs to an earlier collection of the same name
  // (dropped and created again): recovery must not load it.
  bool recreate = false;
  // The checkpoint is incremental, a delta over one taken a step earlier:
  // the lost shards are loaded from the chain.
  bool incremental = false;
  // Every table on the key_value kernel (rows in files under the workers'
  // --ssd_dir, half of them cached): the killed worker's files go with it.
  bool key_value = false;
  // Every table on this CUDA worker kernel ("fused_uvm": rows in host memory
  // the GPU maps; "fused_uvm_caching": half of them cached in GPU memory
  // over those), on CUDA workers emulated on the CPU
  // (--device=cuda_emulated).
  const char* uvm = nullptr;
};

void RunCase(const Case& k) {
  const std::string root = TempDir();
  std::vector<std::string> flags = {
      "--checkpoint_dir=" + root,
      absl::StrCat("--restart_workers=", k.restart_workers ? "true" : "false")};
  if (k.key_value) {  // small caches: rows leave them and come back
    flags.push_back("--ssd_dir=" + TempDir());
    flags.push_back("--key_value_min_cache_rows=1");
  }
  if (k.uvm != nullptr) {
    flags.push_back("--device=cuda_emulated");
    flags.push_back("--key_value_min_cache_rows=1");
  }
  LocalCluster cluster(kEmberctl, 3, flags);
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("r");
  spec.mutable_tables()->RemoveLast();  // the sequence table
  if (k.whole) spec.set_recovery(CollectionSpec::WHOLE_COLLECTION);
  const std::string kernel = k.key_value ? "key_value" : k.uvm != nullptr ? k.uvm : "fused";
  if (kernel != "fused") {
    for (const auto& t : spec.tables()) {
      ember::v1::ParameterConstraints& pc = (*spec.mutable_constraints())[t.name()];
      pc.add_compute_kernels(kernel);
      pc.set_cache_load_factor(0.5);
    }
  }
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  const Tables initial = ExportAll(c->get(), "r", spec);
  if (k.recreate) {
    Train(c->get(), "r", 7, 2);
    ASSERT_TRUE((*c)->Checkpoint("r").ok());
    ASSERT_TRUE((*c)->DropCollection("r").ok());
    info = (*c)->CreateCollection(spec, "row_wise");
    ASSERT_TRUE(info.ok()) << info.status();
  }
  Train(c->get(), "r", 1, 2);
  std::string base;
  if (k.incremental) {
    auto first = (*c)->Checkpoint("r", "", absl::Minutes(5), /*incremental=*/true);
    ASSERT_TRUE(first.ok()) << first.status();
    base = first->path().substr(first->path().rfind('/') + 1);
    Train(c->get(), "r", 4, 1);
  }
  // An update acknowledged before the checkpoint, on every row block: its
  // retry after the recovery must change nothing (the restored shards take
  // their exactly-once records back from the checkpoint).
  KeyedJaggedTensor every_block;
  every_block.keys = {"f_sum"};
  every_block.lengths = {3};
  every_block.values = {2, 151, 299};
  KeyedTensor pre_grad;
  pre_grad.keys = {"f_sum"};
  pre_grad.length_per_key = {16};
  pre_grad.batch_size = 1;
  pre_grad.values.assign(16, 0.5f);
  ASSERT_TRUE((*c)->ApplyGradients("r", every_block, pre_grad, "pre-checkpoint").ok());
  const Tables at_checkpoint = k.checkpoint ? ExportAll(c->get(), "r", spec) : initial;
  std::string path;
  if (k.checkpoint) {
    auto ck = (*c)->Checkpoint("r", "", absl::Minutes(5), k.incremental);
    ASSERT_TRUE(ck.ok()) << ck.status();
    EXPECT_EQ(ck->base(), base);  // a delta over the first, when incremental
    if (k.incremental) EXPECT_GT(ck->delta_shards(), 0);
    path = ck->path();
  }
  Train(c->get(), "r", 2, 2);  // acknowledged after the checkpoint
  const Tables now = ExportAll(c->get(), "r", spec);

  // kill -9 the worker at rank 1.
  ASSERT_NO_FATAL_FAILURE(KillWorkerAt(c->get(), info->worker_addresses(1)));
  const absl::Time killed = absl::Now();

  // Training goes on once the collection is back: lookups are retried.
  KeyedJaggedTensor probe;
  probe.keys = {"f_sum"};
  probe.lengths = {3};
  probe.values = {1, 150, 300};  // a row on each of the three row blocks
  absl::Status last;
  while (absl::Now() - killed < absl::Seconds(30)) {
    last = (*c)->Lookup("r", probe).status();
    if (last.ok()) break;
    EXPECT_EQ(last.code(), absl::StatusCode::kUnavailable) << last;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(last.ok()) << last;
  const absl::Duration took = absl::Now() - killed;
  EXPECT_LT(took, absl::Seconds(10));
  std::printf("recovery: serving again %.2f s after kill -9 (lease 3 s)\n",
              absl::ToDoubleSeconds(took));

  auto after = (*c)->GetCollection("r");
  ASSERT_TRUE(after.ok());
  for (const auto& ts : after->plan().tables()) {
    EXPECT_EQ(ts.compute_kernel(), kernel) << ts.table();
  }
  EXPECT_EQ(after->state(), CollectionInfo::SERVING);
  EXPECT_GT(after->plan().epoch(), info->plan().epoch());
  EXPECT_EQ(after->recovered_from(), path);
  EXPECT_FALSE(after->note().empty());
  if (k.restart_workers) {
    EXPECT_NE(after->worker_addresses(1), info->worker_addresses(1));  // the replacement
  } else {
    for (const auto& ts : after->plan().tables()) {
      for (const auto& sh : ts.shards()) EXPECT_NE(sh.rank(), 1);  // moved to the survivors
    }
  }
  const Tables want = k.whole ? at_checkpoint : RollBackRank(now, at_checkpoint, *info, 1);
  EXPECT_EQ(ExportAll(c->get(), "r", spec), want);
  if (k.checkpoint) {  // a retry of an update the checkpoint holds is not applied again
    ASSERT_TRUE((*c)->ApplyGradients("r", every_block, pre_grad, "pre-checkpoint").ok());
    EXPECT_EQ(ExportAll(c->get(), "r", spec), want);
  }
  Train(c->get(), "r", 3, 1);  // and it trains on
}

// A worker paused (SIGSTOP) past its lease and resumed, after the
// coordinator recovered its shards elsewhere: it once went on serving its
// copy to clients with the old plan (stale rows read, updates acknowledged
// into a copy nothing reads). Now it refuses data calls from the moment it
// resumes until the coordinator has said what it still holds, then drops
// the rest; a client with the old plan refreshes and trains on.
TEST(RecoveryTest, AWorkerBackFromAPauseServesNoStaleCopy) {
  const std::string root = TempDir();
  LocalCluster cluster(kEmberctl, 3,
                       {"--checkpoint_dir=" + root, "--restart_workers=false", "--lease_ms=2000"});
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(20);
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("p");
  spec.mutable_tables()->RemoveLast();  // the sequence table
  auto info = (*c)->CreateCollection(spec, "table_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE((*c)->Checkpoint("p").ok());
  int rank = -1;
  for (const auto& ts : info->plan().tables()) {
    if (ts.table() == "t_sum") rank = ts.shards(0).rank();
  }
  ASSERT_GE(rank, 0);
  const std::string paused_address = info->worker_addresses(rank);
  pid_t paused = -1;
  ASSERT_NO_FATAL_FAILURE(PidOf(c->get(), paused_address, &paused));

  ASSERT_EQ(kill(paused, SIGSTOP), 0);
  const absl::Time stopped = absl::Now();
  absl::StatusOr<CollectionInfo> moved;
  while (absl::Now() - stopped < absl::Seconds(30)) {
    moved = (*c)->GetCollection("p");
    if (moved.ok() && moved->plan().epoch() > info->plan().epoch() &&
        moved->state() == CollectionInfo::SERVING) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(moved.ok() && moved->plan().epoch() > info->plan().epoch())
      << "the coordinator did not recover the paused worker's shards";
  ASSERT_EQ(kill(paused, SIGCONT), 0);

  // The old plan's update, straight to the resumed worker: never applied.
  auto stub = ember::v1::Worker::NewStub(MakeChannel(paused_address));
  const ember::v1::WorkerApplyGradientsRequest req = testing_util::OneIdUpdate(
      "p", info->plan().epoch(), "stale", "t_sum", 0, "f_sum", 7, 16, 1.0f);
  bool dropped = false;
  for (const absl::Time resumed = absl::Now(); absl::Now() - resumed < absl::Seconds(10);) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Seconds(5));
    ember::v1::WorkerApplyGradientsResponse resp;
    const grpc::Status s = stub->ApplyGradients(&ctx, req, &resp);
    ASSERT_FALSE(s.ok()) << "the resumed worker applied an update of the old plan";
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {  // the copy is gone
      dropped = true;
      break;
    }
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_TRUE(dropped) << "the resumed worker kept its copy of the moved collection";

  // A client that planned before the pause refreshes and trains on; its
  // update is where the collection is read.
  const Tables before = ExportAll(c->get(), "p", spec);
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {1};
  kjt.values = {7};
  KeyedTensor grad;
  grad.keys = {"f_sum"};
  grad.length_per_key = {16};
  grad.batch_size = 1;
  grad.values.assign(16, 1.0f);
  ASSERT_TRUE((*c)->ApplyGradients("p", kjt, grad).ok());
  EXPECT_NE(ExportAll(c->get(), "p", spec), before);
}

TEST(RecoveryTest, ReplacementLoadsTheLostShardsFromTheCheckpoint) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/false});
}

TEST(RecoveryTest, SurvivorsTakeTheLostShardsWhenNoWorkerReplacesIt) {
  RunCase({/*restart_workers=*/false, /*checkpoint=*/true, /*whole=*/false});
}

TEST(RecoveryTest, WholeCollectionRollsBackToTheCheckpoint) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/true});
}

TEST(RecoveryTest, LostShardsComeBackFromAnIncrementalChain) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/false, /*recreate=*/false,
           /*incremental=*/true});
}

TEST(RecoveryTest, KeyValueShardsComeBackFromAnIncrementalChain) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/false, /*recreate=*/false,
           /*incremental=*/true, /*key_value=*/true});
}

TEST(RecoveryTest, FusedUvmShardsComeBackFromAnIncrementalChain) {
  Case k{/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/false, /*recreate=*/false,
         /*incremental=*/true};
  k.uvm = "fused_uvm";
  RunCase(k);
}

TEST(RecoveryTest, FusedUvmCachingShardsComeBackFromAnIncrementalChain) {
  Case k{/*restart_workers=*/true, /*checkpoint=*/true, /*whole=*/false, /*recreate=*/false,
         /*incremental=*/true};
  k.uvm = "fused_uvm_caching";
  RunCase(k);
}

TEST(RecoveryTest, WithoutACheckpointTheLostShardsComeBackFresh) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/false, /*whole=*/false});
}

TEST(RecoveryTest, ACheckpointOfAnEarlierCollectionOfTheSameNameIsNotUsed) {
  RunCase({/*restart_workers=*/true, /*checkpoint=*/false, /*whole=*/false, /*recreate=*/true});
}

// A SYNC step held when a worker dies (docs/training.md, "Moves"): rank 0's update
// is held on the workers when worker 1 is killed; rank 1 sends its own
// meanwhile (retrying until the collection serves again). Whatever each
// worker had applied of the step when it moved, the step ends applied
// exactly once everywhere: the tables equal the checkpoint (taken before
// the step: the lost shards come back from it, the survivors never moved
// past it) plus one trainer's update with the global batch, halved.
TEST(RecoveryTest, ASyncStepHeldWhenAWorkerDiesIsAppliedOnce) {
  const std::string root = TempDir();
  LocalCluster cluster(kEmberctl, 3, {"--checkpoint_dir=" + root, "--restart_workers=false"});
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  CollectionSpec spec = TestSpec("sync");
  spec.mutable_tables()->RemoveLast();  // the sequence table
  spec.mutable_training()->set_mode(ember::v1::TrainingSpec::SYNC);
  spec.mutable_training()->set_trainers(2);
  spec.mutable_training()->set_step_timeout_s(60);
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  CollectionSpec ref_spec = spec;
  ref_spec.set_name("ref");
  ref_spec.clear_training();
  ASSERT_TRUE((*c)->CreateCollection(ref_spec, "row_wise").ok());
  ASSERT_TRUE((*c)->Checkpoint("sync").ok());
  for (const auto& [table, values] : ExportAll(c->get(), "sync", spec)) {
    ASSERT_TRUE((*c)->ImportTable("ref", table, values, values.size() / 16, 16).ok());
  }

  // Each rank's slice, and the global batch: per key, rank 0's bags then 1's.
  const std::vector<std::string> keys = {"f_sum", "f_mean", "f_rw", "f_sum2"};
  const std::vector<int> rows = {301, 200, 150, 301};
  std::mt19937 rng(17);
  std::vector<std::vector<std::vector<int64_t>>> ids[2], global(keys.size());
  for (int r = 0; r < 2; ++r) {
    ids[r].resize(keys.size());
    for (size_t k = 0; k < keys.size(); ++k) {
      for (int b = 0; b < 5; ++b) {
        std::vector<int64_t> bag;
        for (int i = 0, n = 1 + rng() % 5; i < n; ++i) bag.push_back(rng() % (rng() % 2 ? 7 : rows[k]));
        ids[r][k].push_back(bag);
        global[k].push_back(bag);
      }
    }
  }
  std::vector<KeyedJaggedTensor> kjt;
  for (int r = 0; r < 2; ++r) kjt.push_back(*KeyedJaggedTensor::FromJagged(keys, ids[r], {}));
  const KeyedJaggedTensor all = *KeyedJaggedTensor::FromJagged(keys, global, {});
  std::vector<KeyedTensor> grads;
  for (int r = 0; r < 2; ++r) {
    auto layout = (*c)->Lookup("sync", kjt[r], client::StepTag{0, -1});
    ASSERT_TRUE(layout.ok()) << layout.status();
    grads.push_back(testing_util::RandomGradients(rng, layout->keys, layout->length_per_key, 5));
  }
  KeyedTensor both = grads[0];  // rows of rank 0 then rank 1, halved
  both.batch_size = 10;
  both.values.insert(both.values.end(), grads[1].values.begin(), grads[1].values.end());
  for (float& g : both.values) g /= 2.0f;

  // Sends rank r's step 0 until it is acknowledged, as a trainer would
  // (with its own id: a resend is the same update).
  auto send = [&](int r, absl::Status* last) {
    auto mine = Client::Connect(cluster.coordinator(), o);
    if (!mine.ok()) {
      *last = mine.status();
      return;
    }
    const absl::Time start = absl::Now();
    while (absl::Now() - start < absl::Seconds(60)) {
      *last = (*mine)->ApplyGradients("sync", kjt[r], grads[r], absl::StrCat("rank", r, "-step0"),
                                      nullptr, client::StepTag{0, r});
      if (last->ok()) return;
      absl::SleepFor(absl::Milliseconds(100));
    }
  };
  absl::Status rank0, rank1;
  std::thread t0([&] { send(0, &rank0); });
  absl::SleepFor(absl::Milliseconds(500));  // held on the workers, waiting for rank 1

  ASSERT_NO_FATAL_FAILURE(KillWorkerAt(c->get(), info->worker_addresses(1)));
  std::thread t1([&] { send(1, &rank1); });
  t0.join();
  t1.join();
  ASSERT_TRUE(rank0.ok()) << rank0;
  ASSERT_TRUE(rank1.ok()) << rank1;
  ASSERT_TRUE((*c)->ApplyGradients("ref", all, both).ok());
  auto after = (*c)->GetCollection("sync");
  ASSERT_TRUE(after.ok());
  EXPECT_GT(after->plan().epoch(), info->plan().epoch());  // it moved
  const Tables got = ExportAll(c->get(), "sync", spec), want = ExportAll(c->get(), "ref", ref_spec);
  for (const auto& [table, values] : want) {
    SCOPED_TRACE(table);
    testing_util::ExpectNear(got.at(table), values, table);
  }
  // And it trains on: step 1 from both ranks.
  std::thread u0([&] {
    rank0 = (*c)->ApplyGradients("sync", kjt[0], grads[0], "", nullptr, client::StepTag{1, 0});
  });
  rank1 = (*c)->ApplyGradients("sync", kjt[1], grads[1], "", nullptr, client::StepTag{1, 1});
  u0.join();
  EXPECT_TRUE(rank0.ok()) << rank0;
  EXPECT_TRUE(rank1.ok()) << rank1;
}

}  // namespace
}  // namespace ember

namespace ember {
namespace {

// A dynamic (hash-keyed) table row_wise over 3 workers, kill -9 of the one
// at rank 1: its shards come back from the checkpoint (each held row placed
// by its id's routing row), the survivors' rows stay as they were, and
// training goes on. The ids held afterwards: the checkpoint's on the lost
// rows' range, the last ones elsewhere, each with its row. On `kernel`:
// fused, or below memory under a cache of a tenth of each shard (key_value:
// the killed worker's files go with it; fused_uvm_caching on emulated CUDA
// workers).
void RunDynamicCase(const std::string& kernel) {
  const std::string root = TempDir();
  std::vector<std::string> flags = {"--checkpoint_dir=" + root, "--restart_workers=true",
                                    "--key_value_min_cache_rows=1"};
  if (kernel == "key_value") flags.push_back("--ssd_dir=" + TempDir());
  if (kernel == "fused_uvm_caching") flags.push_back("--device=cuda_emulated");
  LocalCluster cluster(kEmberctl, 3, flags);
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(10);
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  constexpr int64_t kCapacity = 300, kDim = 8;
  CollectionSpec spec;
  spec.set_name("dyn");
  auto* t = spec.add_tables();
  t->set_name("t");
  t->set_embedding_dim(kDim);
  t->add_feature_names("f");
  t->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAGRAD);
  t->mutable_optimizer()->set_learning_rate(0.1);
  t->mutable_dynamic()->set_capacity(kCapacity);
  if (kernel != "fused") {
    ember::v1::ParameterConstraints& pc = (*spec.mutable_constraints())["t"];
    pc.add_compute_kernels(kernel);
    pc.set_cache_load_factor(0.1);
  }
  auto info = (*c)->CreateCollection(spec, "row_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_EQ(info->plan().tables(0).compute_kernel(), kernel);
  std::mt19937_64 rng(3);
  std::vector<int64_t> universe;
  for (int i = 0; i < 120; ++i) universe.push_back(static_cast<int64_t>(rng()));
  auto train = [&](int steps) {
    for (int s = 0; s < steps; ++s) {
      KeyedJaggedTensor kjt;
      kjt.keys = {"f"};
      for (int b = 0; b < 8; ++b) {
        kjt.lengths.push_back(3);
        for (int k = 0; k < 3; ++k) kjt.values.push_back(universe[rng() % universe.size()]);
      }
      KeyedTensor g;
      g.keys = {"f"};
      g.length_per_key = {kDim};
      g.batch_size = 8;
      for (int i = 0; i < 8 * kDim; ++i) g.values.push_back(std::uniform_real_distribution<float>(-1, 1)(rng));
      ASSERT_TRUE((*c)->ApplyGradients("dyn", kjt, g).ok());
    }
  };
  auto rows = [&]() {
    std::vector<int64_t> ids;
    std::vector<float> values;
    int64_t dim = 0;
    EXPECT_TRUE((*c)->ExportDynamicTable("dyn", "t", &ids, &values, &dim).ok());
    std::map<int64_t, std::vector<float>> out;
    for (size_t i = 0; i < ids.size(); ++i) {
      out[ids[i]].assign(values.begin() + i * kDim, values.begin() + (i + 1) * kDim);
    }
    return out;
  };
  ASSERT_NO_FATAL_FAILURE(train(6));
  const auto at_checkpoint = rows();
  ASSERT_TRUE((*c)->Checkpoint("dyn").ok());
  ASSERT_NO_FATAL_FAILURE(train(6));
  const auto now = rows();
  ASSERT_NE(now, at_checkpoint);
  // The routing rows rank 1 held.
  std::vector<std::pair<int64_t, int64_t>> lost;
  for (const auto& sh : info->plan().tables(0).shards()) {
    if (sh.rank() == 1) lost.emplace_back(sh.row_offset(), sh.row_offset() + sh.rows());
  }
  ASSERT_FALSE(lost.empty());
  auto on_lost = [&](int64_t id) {
    const int64_t row = RouteRow(id, kCapacity);
    for (const auto& [b, e] : lost) {
      if (row >= b && row < e) return true;
    }
    return false;
  };
  ASSERT_NO_FATAL_FAILURE(KillWorkerAt(c->get(), info->worker_addresses(1)));
  const absl::Time killed = absl::Now();
  absl::Status last;
  KeyedJaggedTensor probe;
  probe.keys = {"f"};
  probe.lengths = {1};
  probe.values = {universe[0]};
  while (absl::Now() - killed < absl::Seconds(30)) {
    last = (*c)->Lookup("dyn", probe).status();
    if (last.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(last.ok()) << last;
  std::map<int64_t, std::vector<float>> want;
  for (const auto& [id, row] : at_checkpoint) {
    if (on_lost(id)) want[id] = row;
  }
  for (const auto& [id, row] : now) {
    if (!on_lost(id)) want[id] = row;
  }
  EXPECT_EQ(rows(), want);
  ASSERT_NO_FATAL_FAILURE(train(3));  // and it trains on
  EXPECT_NE(rows(), want);
}

TEST(RecoveryTest, ADynamicTablesLostShardsComeBackFromTheCheckpointById) {
  RunDynamicCase("fused");
}

TEST(RecoveryTest, ADynamicTableOnKeyValueComesBackFromTheCheckpointById) {
  RunDynamicCase("key_value");
}

TEST(RecoveryTest, ADynamicTableOnFusedUvmCachingComesBackFromTheCheckpointById) {
  RunDynamicCase("fused_uvm_caching");
}

}  // namespace
}  // namespace ember
