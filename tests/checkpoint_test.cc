// Checkpoints end to end, with real processes (`emberctl up`) on 127.0.0.1:
// a checkpoint restores exactly (weights, optimizer state, step) onto 2 -> 3
// and 3 -> 2 workers for every sharding type and optimizer; a damaged
// checkpoint is refused with the file named and nothing created; kill -9 of
// the coordinator or a worker while a checkpoint is written always leaves
// the latest committed checkpoint restorable.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "proto/service.grpc.pb.h"
#include "server/common/grpc_util.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "gtest/gtest.h"
#include "server/checkpoint/checkpoint_files.h"
#include "tests/local_cluster.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::InProcessCollection;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using client::SequenceEmbedding;
using ember::v1::CollectionSpec;
using testing_util::ExpectNear;
using testing_util::LocalCluster;
using testing_util::RandomKjt;
using testing_util::ExportAll;
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

// `steps` training steps (pooled and sequence features) on the collection
// and, if given, on the in-process reference too; the lookups must agree.
void Train(Client* c, const std::string& name, InProcessCollection* ref, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  for (int step = 0; step < steps; ++step) {
    KeyedJaggedTensor kjt = RandomKjt(rng, {"f_mean", "f_sum", "f_rw", "f_sum2"},
                                      {200, 301, 150, 301}, 5, step % 2 == 1);
    auto kt = c->Lookup(name, kjt);
    ASSERT_TRUE(kt.ok()) << kt.status();
    if (ref != nullptr) {
      auto want = ref->Lookup(kjt);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectNear(kt->values, want->values, name + " lookup");
    }
    KeyedTensor grads = *kt;
    for (float& g : grads.values) g = std::uniform_real_distribution<float>(-1, 1)(rng);
    ASSERT_TRUE(c->ApplyGradients(name, kjt, grads).ok());
    if (ref != nullptr) {
      ASSERT_TRUE(ref->ApplyGradients(kjt, grads).ok());
    }
    KeyedJaggedTensor seq = RandomKjt(rng, {"f_seq"}, {120}, 4, false);
    auto se = c->LookupSequence(name, seq);
    ASSERT_TRUE(se.ok()) << se.status();
    std::vector<SequenceEmbedding> sg = *se;
    for (float& g : sg[0].values) g = std::uniform_real_distribution<float>(-1, 1)(rng);
    ASSERT_TRUE(c->ApplySequenceGradients(name, seq, sg).ok());
    if (ref != nullptr) {
      ASSERT_TRUE(ref->ApplySequenceGradients(seq, sg).ok());
    }
  }
}

class CheckpointTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // Checkpoints lie under the servers' root: TempDir() makes its
    // directories in ::testing::TempDir().
    const std::string root = "--checkpoint_dir=" + ::testing::TempDir();
    two_ = new LocalCluster(kEmberctl, 2, {root});
    three_ = new LocalCluster(kEmberctl, 3, {root});
    ASSERT_TRUE(two_->ok() && three_->ok()) << "emberctl up did not come up";
  }
  static void TearDownTestSuite() {
    delete two_;
    delete three_;
    two_ = three_ = nullptr;
  }
  static LocalCluster* two_;
  static LocalCluster* three_;
};
LocalCluster* CheckpointTest::two_ = nullptr;
LocalCluster* CheckpointTest::three_ = nullptr;

// For each sharding type: train on 2 workers, checkpoint, train on; restore
// on 3 workers and on 2 (exports equal the checkpoint exactly), train the
// 2-worker copy on beside the in-process reference stopped at the
// checkpoint (so optimizer state and steps came back too), then checkpoint
// the 3-worker copy and restore it on 2 workers: it trains on exactly as
// the first copy did.
TEST_F(CheckpointTest, RestoreOntoOtherWorkerCountsIsExact) {
  auto c2 = Connect(two_->coordinator());
  auto c3 = Connect(three_->coordinator());
  ASSERT_TRUE(c2 && c3);
  const std::string root = TempDir();
  uint32_t seed = 1;
  for (const std::string type :
       {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}) {
    SCOPED_TRACE(type);
    const std::string a = "a_" + type;
    const CollectionSpec spec = TestSpec(a);
    auto info = c2->CreateCollection(spec, type);
    ASSERT_TRUE(info.ok()) << info.status();
    auto ref = InProcessCollection::Create(spec, &info->plan());
    ASSERT_TRUE(ref.ok()) << ref.status();
    Train(c2.get(), a, ref->get(), seed++, 3);
    const Tables at_checkpoint = ExportAll(c2.get(), a, spec);

    auto ck = c2->Checkpoint(a, root);
    ASSERT_TRUE(ck.ok()) << ck.status();
    EXPECT_EQ(ck->collection(), a);
    EXPECT_GT(ck->bytes(), 0);
    EXPECT_GE(ck->max_pause_ms(), 0);
    Train(c2.get(), a, nullptr, seed++, 2);  // moves on: the checkpoint must not
    ASSERT_NE(ExportAll(c2.get(), a, spec), at_checkpoint);

    // 2 -> 3.
    auto b = c3->Restore(ck->path(), "b_" + type, type);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->collection().worker_addresses_size(), 3);
    EXPECT_EQ(ExportAll(c3.get(), "b_" + type, spec), at_checkpoint);

    // 2 -> 2, trained on beside the reference (state and step restored).
    auto b2 = c2->Restore(root + "/" + a, "b2_" + type, type);  // the ROOT/<collection> form
    ASSERT_TRUE(b2.ok()) << b2.status();
    EXPECT_EQ(ExportAll(c2.get(), "b2_" + type, spec), at_checkpoint);
    const uint32_t after_seed = seed++;
    Train(c2.get(), "b2_" + type, ref->get(), after_seed, 2);
    for (const auto& [table, values] : ExportAll(c2.get(), "b2_" + type, spec)) {
      int64_t rows, dim;
      ExpectNear(values, *(*ref)->ExportTable(table, &rows, &dim), type + " trained " + table);
    }

    // 3 -> 2: the copy on 3 workers, checkpointed and restored on 2, trains
    // on exactly as the first 2-worker copy did.
    auto ck3 = c3->Checkpoint("b_" + type, root);
    ASSERT_TRUE(ck3.ok()) << ck3.status();
    auto c = c2->Restore(ck3->path(), "c_" + type, type);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(ExportAll(c2.get(), "c_" + type, spec), at_checkpoint);
    Train(c2.get(), "c_" + type, nullptr, after_seed, 2);
    EXPECT_EQ(ExportAll(c2.get(), "c_" + type, spec), ExportAll(c2.get(), "b2_" + type, spec));

    for (const std::string& n : {a, "b2_" + type, "c_" + type}) {
      ASSERT_TRUE(c2->DropCollection(n).ok());
    }
    ASSERT_TRUE(c3->DropCollection("b_" + type).ok());
  }
  // The catalogue lists what was taken.
  auto list = c2->ListCheckpoints();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 5u);
}

TEST_F(CheckpointTest, RestoreChoosesANewShardingAndKeepsTheLastK) {
  auto c2 = Connect(two_->coordinator());
  ASSERT_TRUE(c2);
  const std::string root = TempDir();
  const CollectionSpec spec = TestSpec("k");
  ASSERT_TRUE(c2->CreateCollection(spec, "row_wise").ok());
  std::vector<std::string> paths;
  for (int i = 0; i < 5; ++i) {
    Train(c2.get(), "k", nullptr, 100 + i, 1);
    auto ck = c2->Checkpoint("k", root);
    ASSERT_TRUE(ck.ok()) << ck.status();
    paths.push_back(ck->path());
  }
  // The coordinator keeps 3 by default.
  EXPECT_EQ(checkpoint::ListCommitted(root, "k"),
            (std::vector<std::string>{paths[2], paths[3], paths[4]}));
  const Tables latest = ExportAll(c2.get(), "k", spec);
  // ROOT resolves to the latest; restored column-wise.
  auto r = c2->Restore(root, "k_cw", "column_wise");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->checkpoint().path(), paths[4]);
  for (const auto& t : r->collection().plan().tables()) EXPECT_EQ(t.sharding_type(), "column_wise");
  EXPECT_EQ(ExportAll(c2.get(), "k_cw", spec), latest);
  ASSERT_TRUE(c2->DropCollection("k_cw").ok());
  ASSERT_TRUE(c2->DropCollection("k").ok());
}

std::string BaseName(const std::string& dir) { return dir.substr(dir.rfind('/') + 1); }

// Incremental chains, for every sharding type: a first incremental
// checkpoint is whole (no base), the next two hold only changed rows; the
// newest restores onto 3 workers exactly as a full checkpoint taken at the
// same moment does (exports equal, and both train on alike: state and steps
// came back), and a checkpoint of the restored copy is whole (its shards
// are new).
TEST_F(CheckpointTest, IncrementalChainsRestoreAsFullCheckpointsDo) {
  auto c2 = Connect(two_->coordinator());
  auto c3 = Connect(three_->coordinator());
  ASSERT_TRUE(c2 && c3);
  const std::string root = TempDir(), full_root = TempDir();
  uint32_t seed = 500;
  for (const std::string type :
       {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}) {
    SCOPED_TRACE(type);
    const std::string name = "inc_" + type;
    const CollectionSpec spec = TestSpec(name);
    ASSERT_TRUE(c2->CreateCollection(spec, type).ok());
    Train(c2.get(), name, nullptr, seed++, 3);
    auto ck0 = c2->Checkpoint(name, root, absl::Minutes(5), /*incremental=*/true);
    ASSERT_TRUE(ck0.ok()) << ck0.status();
    EXPECT_TRUE(ck0->base().empty());
    EXPECT_EQ(ck0->delta_shards(), 0);
    EXPECT_EQ(ck0->chain_length(), 1);
    std::vector<ember::v1::CheckpointInfo> chain = {*ck0};
    for (int k = 1; k <= 2; ++k) {
      Train(c2.get(), name, nullptr, seed++, 1);
      auto ck = c2->Checkpoint(name, root, absl::Minutes(5), /*incremental=*/true);
      ASSERT_TRUE(ck.ok()) << ck.status();
      EXPECT_EQ(ck->base(), BaseName(chain.back().path()));
      EXPECT_GT(ck->delta_shards(), 0);  // (a shard more than half changed is written whole)
      EXPECT_GT(ck->changed_rows(), 0);
      EXPECT_LT(ck->bytes(), ck0->bytes());
      EXPECT_EQ(ck->chain_length(), k + 1);
      chain.push_back(*ck);
    }
    const Tables at = ExportAll(c2.get(), name, spec);
    auto full = c2->Checkpoint(name, full_root);
    ASSERT_TRUE(full.ok()) << full.status();
    EXPECT_TRUE(full->base().empty());
    Train(c2.get(), name, nullptr, seed++, 1);  // moves on: the checkpoints must not

    auto a = c3->Restore(chain.back().path(), "inc_a_" + type, type);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = c3->Restore(full->path(), "inc_b_" + type, type);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(ExportAll(c3.get(), "inc_a_" + type, spec), at);
    EXPECT_EQ(ExportAll(c3.get(), "inc_b_" + type, spec), at);
    const uint32_t after = seed++;
    Train(c3.get(), "inc_a_" + type, nullptr, after, 2);
    Train(c3.get(), "inc_b_" + type, nullptr, after, 2);
    EXPECT_EQ(ExportAll(c3.get(), "inc_a_" + type, spec),
              ExportAll(c3.get(), "inc_b_" + type, spec));
    // The restored copy's shards are new: its first incremental is whole.
    auto again = c3->Checkpoint("inc_a_" + type, root, absl::Minutes(5), /*incremental=*/true);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->base().empty());
    for (const std::string& n : {"inc_a_" + type, "inc_b_" + type}) {
      ASSERT_TRUE(c3->DropCollection(n).ok());
    }
    ASSERT_TRUE(c2->DropCollection(name).ok());
  }
}

// Pruning keeps the bases a kept incremental checkpoint needs; a chain as
// long as --checkpoint_compact_after (4) is compacted in the background
// into a full checkpoint with the same contents, after which its bases go.
TEST_F(CheckpointTest, ChainsAreKeptWhileNeededAndCompacted) {
  auto c2 = Connect(two_->coordinator());
  ASSERT_TRUE(c2);
  const std::string root = TempDir();
  const CollectionSpec spec = TestSpec("chain");
  ASSERT_TRUE(c2->CreateCollection(spec, "row_wise").ok());
  std::vector<std::string> paths;
  for (int i = 0; i < 4; ++i) {
    Train(c2.get(), "chain", nullptr, 700 + i, 1);
    auto ck = c2->Checkpoint("chain", root, absl::Minutes(5), /*incremental=*/true);
    ASSERT_TRUE(ck.ok()) << ck.status();
    EXPECT_EQ(ck->chain_length(), i + 1);
    paths.push_back(ck->path());
  }
  const Tables at = ExportAll(c2.get(), "chain", spec);
  // Four committed although 3 are kept: the newest builds on the first.
  // The fourth is compacted in the background: wait for its catalogue entry.
  bool compacted = false;
  for (int i = 0; i < 100 && !compacted; ++i) {
    auto list = c2->ListCheckpoints("chain");
    ASSERT_TRUE(list.ok());
    for (const auto& c : *list) {
      if (c.path() == paths[3] && c.base().empty()) compacted = true;
    }
    if (!compacted) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(compacted) << "the chain of 4 was not compacted";
  auto m = checkpoint::ReadManifest(paths[3]);
  ASSERT_TRUE(m.ok()) << m.status();
  for (const auto& s : m->shards()) EXPECT_FALSE(s.delta());
  EXPECT_EQ(m->info().chain_length(), 1);
  // The next checkpoints build on the compacted one; once no kept one
  // needs the first three (the third, kept, builds on the first two), they go.
  Train(c2.get(), "chain", nullptr, 710, 1);
  auto next = c2->Checkpoint("chain", root, absl::Minutes(5), /*incremental=*/true);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->base(), BaseName(paths[3]));
  EXPECT_EQ(next->chain_length(), 2);
  EXPECT_EQ(checkpoint::ListCommitted(root, "chain"),
            (std::vector<std::string>{paths[0], paths[1], paths[2], paths[3], next->path()}));
  Train(c2.get(), "chain", nullptr, 711, 1);
  auto last = c2->Checkpoint("chain", root, absl::Minutes(5), /*incremental=*/true);
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->chain_length(), 3);
  EXPECT_EQ(checkpoint::ListCommitted(root, "chain"),
            (std::vector<std::string>{paths[3], next->path(), last->path()}));
  // The compacted checkpoint restores alone, as it was.
  auto r = c2->Restore(paths[3], "chain_r", "table_wise");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ExportAll(c2.get(), "chain_r", spec), at);
  ASSERT_TRUE(c2->DropCollection("chain_r").ok());
  ASSERT_TRUE(c2->DropCollection("chain").ok());
}

// A manifest (with a valid CRC) whose two shards of a table hold the same
// columns, as many cells as the table has: the restore once counted filled
// cells and returned OK with the other columns zero.
TEST_F(CheckpointTest, OverlappingShardsAreRefused) {
  auto c2 = Connect(two_->coordinator());
  ASSERT_TRUE(c2);
  ASSERT_TRUE(c2->CreateCollection(TestSpec("ov"), "column_wise").ok());
  auto ck = c2->Checkpoint("ov", absl::StrCat("ov-", getpid()));
  ASSERT_TRUE(ck.ok()) << ck.status();
  auto m = checkpoint::ReadManifest(ck->path());
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int> t_sum;
  for (int i = 0; i < m->shards_size(); ++i) {
    if (m->shards(i).ref().table() == "t_sum") t_sum.push_back(i);
  }
  ASSERT_EQ(t_sum.size(), 2u);
  const auto& a = m->shards(t_sum[0]);
  ASSERT_EQ(a.rows() * a.cols(), m->shards(t_sum[1]).rows() * m->shards(t_sum[1]).cols());
  // The second shard's file, placed over the first's columns.
  m->mutable_shards(t_sum[1])->set_row_offset(a.row_offset());
  m->mutable_shards(t_sum[1])->set_col_offset(a.col_offset());
  ASSERT_TRUE(checkpoint::CommitManifest(ck->path(), *m).ok());
  auto r = c2->Restore(ck->path(), "ov2", "table_wise");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("overlap"), std::string::npos) << r.status();
  auto names = c2->ListCollections();
  ASSERT_TRUE(names.ok());
  for (const auto& c : *names) EXPECT_NE(c.spec().name(), "ov2");  // nothing was created
  ASSERT_TRUE(c2->DropCollection("ov").ok());
}

// Checkpoint paths stay under the servers' root (--checkpoint_dir): a
// directory elsewhere, "..", a NUL byte are refused before anything is
// written, on the coordinator and on a worker called directly; the errors do
// not tell whether a directory outside exists; and a NUL byte no longer
// wedges the checkpoint lock (it once made every later checkpoint time out).
TEST_F(CheckpointTest, PathsStayUnderTheRoot) {
  auto c2 = Connect(two_->coordinator());
  ASSERT_TRUE(c2);
  ASSERT_TRUE(c2->CreateCollection(TestSpec("confined"), "row_wise").ok());
  const std::string escape = absl::StrCat("/var/tmp/ember-escape-", getpid());
  for (const std::string& dir :
       {escape, std::string("../../ember-escape"), std::string("a\0b", 3), std::string("/")}) {
    auto ck = c2->Checkpoint("confined", dir, absl::Seconds(10));
    EXPECT_EQ(ck.status().code(), absl::StatusCode::kInvalidArgument) << ck.status();
  }
  struct stat st;
  EXPECT_NE(stat(escape.c_str(), &st), 0) << escape << " was created";
  // Existing (/etc) or not, a directory outside gets the same answer.
  auto existing = c2->Restore("/etc", "r1");
  auto absent = c2->Restore("/etc-not-here-ember", "r2");
  EXPECT_EQ(existing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(absent.status().message()),
            absl::StrReplaceAll(existing.status().message(), {{"/etc", "/etc-not-here-ember"}}));
  // A worker called directly confines its files the same way.
  auto info = c2->GetCollection("confined");
  ASSERT_TRUE(info.ok()) << info.status();
  auto worker = ember::v1::Worker::NewStub(MakeChannel(info->worker_addresses(0)));
  grpc::ClientContext ctx;
  SetDeadline(&ctx, absl::Seconds(10));
  ember::v1::WriteCheckpointRequest wr;
  wr.set_collection("confined");
  wr.set_epoch(info->plan().epoch());
  wr.set_dir(escape);
  ember::v1::WriteCheckpointResponse wresp;
  EXPECT_EQ(worker->WriteCheckpoint(&ctx, wr, &wresp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(stat(escape.c_str(), &st), 0);
  // Checkpoints still work, in a relative directory of the root too.
  auto ck = c2->Checkpoint("confined", "", absl::Seconds(30));
  EXPECT_EQ(ck.status().code(), absl::StatusCode::kOk) << ck.status();
  const std::string rel = absl::StrCat("confined-", getpid());
  ck = c2->Checkpoint("confined", rel, absl::Seconds(30));
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->path().rfind(absl::StrCat(absl::StripSuffix(::testing::TempDir(), "/"), "/", rel), 0),
            0u)
      << ck->path();
  auto back = c2->Restore(rel, "confined2");
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(c2->DropCollection("confined2").ok());
  ASSERT_TRUE(c2->DropCollection("confined").ok());
}

// While a checkpoint is written, ListCheckpoints shows it in progress with
// the bytes on disk so far and the total it will have.
TEST_F(CheckpointTest, ProgressIsShownWhileWriting) {
  auto c2 = Connect(two_->coordinator());
  auto watcher = Connect(two_->coordinator());
  ASSERT_TRUE(c2 && watcher);
  CollectionSpec spec = TestSpec("p");
  spec.mutable_tables(0)->set_num_embeddings(400000);  // ~300 MB with Adam state
  spec.mutable_tables(0)->set_embedding_dim(64);
  spec.mutable_tables(0)->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAM);
  ASSERT_TRUE(c2->CreateCollection(spec, "row_wise").ok());
  absl::StatusOr<ember::v1::CheckpointInfo> done;
  std::thread writer([&] { done = c2->Checkpoint("p", TempDir()); });
  std::vector<ember::v1::CheckpointInfo> seen;
  for (int i = 0; i < 2000 && seen.empty(); ++i) {
    auto list = watcher->ListCheckpoints("p");
    ASSERT_TRUE(list.ok());
    for (const auto& c : *list) {
      if (c.in_progress()) seen.push_back(c);
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  writer.join();
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen[0].total_bytes(), done->bytes());  // the total is known up front
  EXPECT_LE(seen[0].bytes(), seen[0].total_bytes());
  EXPECT_EQ(seen[0].path(), done->path());
  auto after = watcher->ListCheckpoints("p");  // and it is gone once committed
  ASSERT_TRUE(after.ok());
  for (const auto& c : *after) EXPECT_FALSE(c.in_progress());
  ASSERT_TRUE(c2->DropCollection("p").ok());
}

// `up --checkpoint_dir --checkpoint_every`: every collection is checkpointed
// periodically, in the catalogue and on disk, pruned to --keep_checkpoints.
TEST(PeriodicCheckpointTest, EveryCollectionIsCheckpointedOnSchedule) {
  const std::string root = TempDir();
  LocalCluster cluster(kEmberctl, 2,
                       {"--checkpoint_dir=" + root, "--checkpoint_every=1s", "--keep_checkpoints=2"});
  ASSERT_TRUE(cluster.ok());
  auto c = Connect(cluster.coordinator());
  ASSERT_TRUE(c);
  ASSERT_TRUE(c->CreateCollection(TestSpec("x"), "row_wise").ok());
  ASSERT_TRUE(c->CreateCollection(TestSpec("y"), "table_wise").ok());
  Train(c.get(), "x", nullptr, 1, 1);
  const Tables trained = ExportAll(c.get(), "x", TestSpec("x"));
  // The catalogue's committed checkpoints of one collection, oldest first.
  auto taken = [&](const std::string& name) {
    std::vector<std::string> paths;
    auto list = c->ListCheckpoints(name);
    EXPECT_TRUE(list.ok());
    for (const auto& ck : *list) {
      if (!ck.in_progress()) paths.push_back(ck.path());
    }
    return paths;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((taken("x").size() < 2 || taken("y").size() < 2) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  const std::vector<std::string> first_two = taken("x");
  ASSERT_EQ(first_two.size(), 2u);
  while (taken("x").front() == first_two.front() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));  // a third round prunes the oldest
  }
  EXPECT_EQ(taken("x").size(), 2u);  // never more than --keep_checkpoints
  EXPECT_NE(taken("x").front(), first_two.front());
  EXPECT_EQ(taken("y").size(), 2u);
  EXPECT_EQ(checkpoint::ListCommitted(root, "x").size(), 2u);
  // The latest restores to the trained tables.
  auto r = c->Restore(root + "/x", "x2");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ExportAll(c.get(), "x2", TestSpec("x")), trained);
}

// Periodic incremental checkpoints (--checkpoint_incremental) build chains
// of at most --checkpoint_full_every, then start a full one; the latest
// restores to the trained tables.
TEST(PeriodicCheckpointTest, IncrementalChainsAreCappedAndRestore) {
  const std::string root = TempDir();
  LocalCluster cluster(kEmberctl, 2,
                       {"--checkpoint_dir=" + root, "--checkpoint_every=1s",
                        "--checkpoint_incremental", "--checkpoint_full_every=3",
                        "--checkpoint_compact_after=0", "--keep_checkpoints=2"});
  ASSERT_TRUE(cluster.ok());
  auto c = Connect(cluster.coordinator());
  ASSERT_TRUE(c);
  const CollectionSpec spec = TestSpec("x");
  ASSERT_TRUE(c->CreateCollection(spec, "row_wise").ok());
  std::map<int64_t, int> chain_at;  // created ms -> chain length, as committed
  auto poll = [&] {
    auto list = c->ListCheckpoints("x");
    ASSERT_TRUE(list.ok());
    for (const auto& ck : *list) {
      if (!ck.in_progress()) chain_at[ck.created_unix_ms()] = std::max(1, ck.chain_length());
    }
  };
  // Until a chain of 3 was followed by a full one.
  auto capped = [&] {
    bool three = false;
    for (const auto& [ms, len] : chain_at) {
      if (len == 3) three = true;
      if (three && len == 1) return true;
    }
    return false;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(40);
  uint32_t seed = 900;
  while (!capped() && absl::Now() < deadline) {
    Train(c.get(), "x", nullptr, seed++, 1);
    absl::SleepFor(absl::Milliseconds(200));
    poll();
  }
  ASSERT_TRUE(capped()) << "no full checkpoint after a chain of 3";
  for (const auto& [ms, len] : chain_at) EXPECT_LE(len, 3);
  const Tables trained = ExportAll(c.get(), "x", spec);
  const int64_t after = absl::ToUnixMillis(absl::Now());
  while (chain_at.rbegin()->first <= after && absl::Now() < deadline + absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(100));
    poll();
  }
  ASSERT_GT(chain_at.rbegin()->first, after);
  auto r = c->Restore(root + "/x", "x2");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ExportAll(c.get(), "x2", spec), trained);
}

// Damage of every kind is refused before anything is created.
TEST_F(CheckpointTest, DamagedCheckpointIsRefusedAndNothingIsCreated) {
  auto c2 = Connect(two_->coordinator());
  ASSERT_TRUE(c2);
  const CollectionSpec spec = TestSpec("d");
  ASSERT_TRUE(c2->CreateCollection(spec, "row_wise").ok());
  Train(c2.get(), "d", nullptr, 7, 1);
  auto collections = [&] {
    std::vector<std::string> out;
    for (const char* n : {"d", "d2"}) out.push_back(absl::StrCat(n, c2->GetCollection(n).ok()));
    return out;
  };
  const auto before = collections();
  auto damaged = [&](auto damage) {
    auto ck = c2->Checkpoint("d", TempDir());
    EXPECT_TRUE(ck.ok()) << ck.status();
    auto m = checkpoint::ReadManifest(ck->path());
    EXPECT_TRUE(m.ok());
    const std::string file = damage(ck->path(), *m);
    auto r = c2->Restore(ck->path(), "d2");
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find(file), std::string::npos) << r.status();
    EXPECT_EQ(collections(), before);
    return r.status().code();
  };
  auto flip = [](const std::string& path, long at) {
    FILE* f = fopen(path.c_str(), "r+b");
    fseek(f, at, SEEK_SET);
    const int ch = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(ch ^ 1, f);
    fclose(f);
  };
  EXPECT_EQ(damaged([&](const std::string& dir, const ember::v1::CheckpointManifest& m) {
              flip(dir + "/" + m.shards(0).file(), m.shards(0).bytes() / 2);
              return m.shards(0).file();
            }),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(damaged([&](const std::string& dir, const ember::v1::CheckpointManifest& m) {
              const std::string p = dir + "/" + m.shards(1).file();
              EXPECT_EQ(truncate(p.c_str(), m.shards(1).bytes() - 1), 0);
              return m.shards(1).file();
            }),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(damaged([&](const std::string& dir, const ember::v1::CheckpointManifest&) {
              flip(dir + "/MANIFEST", 300);
              return std::string("MANIFEST");
            }),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(damaged([&](const std::string& dir, const ember::v1::CheckpointManifest&) {
              EXPECT_EQ(unlink((dir + "/MANIFEST").c_str()), 0);
              return std::string("MANIFEST");
            }),
            absl::StatusCode::kNotFound);
  // A damaged delta under an incremental checkpoint, and a missing base.
  {
    const std::string root = TempDir();
    ASSERT_TRUE(c2->Checkpoint("d", root, absl::Minutes(5), true).ok());
    Train(c2.get(), "d", nullptr, 41, 1);
    auto mid = c2->Checkpoint("d", root, absl::Minutes(5), true);
    ASSERT_TRUE(mid.ok()) << mid.status();
    Train(c2.get(), "d", nullptr, 42, 1);
    auto top = c2->Checkpoint("d", root, absl::Minutes(5), true);
    ASSERT_TRUE(top.ok()) << top.status();
    ASSERT_EQ(top->chain_length(), 3);
    auto m = checkpoint::ReadManifest(mid->path());
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE(m->shards(0).delta());
    const std::string delta = mid->path() + "/" + m->shards(0).file();
    flip(delta, m->shards(0).bytes() - 3);
    auto r = c2->Restore(top->path(), "d2");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find(delta), std::string::npos) << r.status();
    EXPECT_EQ(collections(), before);
    ASSERT_TRUE(checkpoint::RemoveCheckpoint(mid->path()).ok());
    r = c2->Restore(top->path(), "d2");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
    EXPECT_NE(r.status().message().find("is missing"), std::string::npos) << r.status();
    EXPECT_EQ(collections(), before);
  }
  ASSERT_TRUE(c2->DropCollection("d").ok());
}

// kill -9 of the coordinator (`up`) or of a worker at a random moment of a
// checkpoint's write: the latest committed checkpoint under the ROOT always
// verifies and restores to the tables it was taken of.
TEST_F(CheckpointTest, KillDuringCheckpointLeavesTheLastCommittedOneRestorable) {
  auto c3 = Connect(three_->coordinator());
  ASSERT_TRUE(c3);
  CollectionSpec spec = TestSpec("big");
  spec.mutable_tables(0)->set_num_embeddings(400000);  // ~100 MB with Adam state: a slow write
  spec.mutable_tables(0)->set_embedding_dim(64);
  spec.mutable_tables(0)->mutable_optimizer()->set_type(ember::v1::OptimizerSpec::ADAM);
  std::mt19937 rng(5);
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(absl::StrCat("round ", round));
    const bool kill_worker = round % 2 == 1;
    const std::string root = TempDir();
    auto cluster = std::make_unique<LocalCluster>(
        kEmberctl, 2, std::vector<std::string>{"--checkpoint_dir=" + root});
    ASSERT_TRUE(cluster->ok());
    auto c = Connect(cluster->coordinator());
    ASSERT_TRUE(c);
    ASSERT_TRUE(c->CreateCollection(spec, "row_wise").ok());
    Train(c.get(), "big", nullptr, 50 + round, 1);
    const Tables want = ExportAll(c.get(), "big", spec);
    ASSERT_TRUE(c->Checkpoint("big", root).ok());
    // A second checkpoint of the same tables, killed part-way.
    std::thread writer([&] { (void)c->Checkpoint("big", root); });
    usleep(std::uniform_int_distribution<int>(1000, 300000)(rng));
    const pid_t victim = kill_worker ? cluster->worker_pids()[0] : cluster->pid();
    ASSERT_EQ(kill(victim, SIGKILL), 0);
    writer.join();
    cluster.reset();  // the rest of it goes too

    auto latest = checkpoint::ResolveCheckpoint(root);
    ASSERT_TRUE(latest.ok()) << latest.status();
    ASSERT_TRUE(checkpoint::VerifyCheckpoint(*latest).ok());
    const std::string name = absl::StrCat("big", round);
    auto r = c3->Restore(*latest, name);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ExportAll(c3.get(), name, spec), want);
    ASSERT_TRUE(c3->DropCollection(name).ok());
  }
}

}  // namespace
}  // namespace ember
