// Multi-process tests: a coordinator and 2 or 3 worker processes on
// 127.0.0.1 (`emberctl up`), driven through the C++ client, compared with the
// single-process reference, InProcessCollection (client/inprocess.h).
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "client/inprocess.h"
#include "client/shared_buffer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "planner/plan_format.h"
#include "server/common/grpc_util.h"
#include "server/common/wire.h"
#include "tests/local_cluster.h"
#include "tests/test_collection.h"

namespace ember {
namespace {

using client::Client;
using client::InProcessCollection;
using client::KeyedJaggedTensor;
using client::KeyedTensor;
using ember::v1::CollectionSpec;
using ember::v1::OptimizerSpec;
using ember::v1::TableConfig;
using testing_util::ExpectNear;
using testing_util::RandomKjt;
using testing_util::TestSpec;

constexpr char kEmberctl[] = "cli/emberctl";

// Lookups, gradient steps and exports through the cluster equal the
// reference, for one sharding type.
void RunAgainstReference(Client* c, const std::string& type, int seed) {
  const std::string name = "c_" + type;
  const CollectionSpec spec = TestSpec(name);
  auto info = c->CreateCollection(spec, type);
  ASSERT_TRUE(info.ok()) << info.status();
  for (const auto& t : info->plan().tables()) ASSERT_EQ(t.sharding_type(), type);
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::mt19937 rng(seed);
  for (int step = 0; step < 3; ++step) {  // weighted on odd steps
    testing_util::StepAgainstReference(c, ref->get(), name, rng, 5, step % 2 == 1, true, type);
  }
  testing_util::ExpectTablesMatch(c, ref->get(), name, spec, type);
  ASSERT_TRUE(c->DropCollection(name).ok());
}

// Shared-memory regions (names are unlinked early, so they read
// "/dev/shm/ember-... (deleted)"; memfds read "/memfd:ember-channel
// (deleted)") under `where` ("memfd:ember-channel", "/dev/shm/ember-", or a
// shared directory's "DIR/ember-") mapped or held open by process `pid`.
int ShmHeld(int pid, const std::string& where) {
  const std::string proc = absl::StrCat("/proc/", pid);
  int held = 0;
  std::ifstream maps(proc + "/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find(where) != std::string::npos) ++held;
  }
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(proc + "/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (target.find(where) != std::string::npos) ++held;
  }
  return held;
}

// Unix-domain sockets process `pid` holds open: all of them, or (`named`)
// only those bound to a name containing it ("ember-link-": the worker's end
// of a socket link; a client's end is unnamed).
int UnixSockets(int pid, const std::string& named = "") {
  std::set<std::string> inodes;  // of the sockets /proc/net/unix lists
  std::ifstream table("/proc/net/unix");
  for (std::string line; std::getline(table, line);) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() < 7 || (!named.empty() && (f.size() < 8 || f[7].find(named) == std::string::npos))) {
      continue;
    }
    inodes.insert(f[6]);
  }
  int held = 0;
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (absl::StartsWith(target, "socket:[") &&
        inodes.count(target.substr(8, target.size() - 9)) > 0) {
      ++held;
    }
  }
  return held;
}

// Every case runs four times: arrays inline in the gRPC messages, through
// POSIX shared-memory channels (the workers are on this host), through
// channels that are files in a directory the workers share (--shm_dir, as
// pods of one node sharing a volume), and through link channels over
// socket links (--links=socket: the NCCL channel's protocol, with its
// bytes over a Unix-domain socket instead of between GPUs).
enum class Mode { kInline, kSharedMemory, kSharedDirectory, kSocketLink };

class ServiceTest : public ::testing::TestWithParam<Mode> {
 protected:
  static void SetUpTestSuite() {
    // Every KeyedTensor of a page or more in shared memory: the tests'
    // small lookups take the placed-output path too.
    client::SharedBuffers::Global().set_shared_min_bytes(client::SharedBuffers::kFloorBytes);
    const std::string dir = absl::StrCat(::testing::TempDir(), "/service_test_shm_", getpid());
    std::filesystem::create_directories(dir);
    shm_dir_ = new std::string(std::filesystem::canonical(dir).string());  // as /proc shows it
    cluster_ = new testing_util::LocalCluster(kEmberctl, 2,
                                              {"--shm_dir=" + *shm_dir_, "--links=socket"});
    ASSERT_TRUE(cluster_->ok()) << "emberctl up did not come up";
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
    std::error_code ec;
    std::filesystem::remove_all(*shm_dir_, ec);
    delete shm_dir_;
  }
  std::unique_ptr<Client> Connect(absl::Duration timeout = absl::Seconds(20)) {
    client::ClientOptions o;
    o.timeout = timeout;
    o.shared_memory = SharedRegions();
    if (GetParam() == Mode::kSharedDirectory) o.shm_dir = *shm_dir_;
    if (GetParam() == Mode::kSocketLink) o.link = "socket";
    auto c = Client::Connect(cluster_->coordinator(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
  static bool Channels() { return GetParam() != Mode::kInline; }
  static bool SharedRegions() {
    return GetParam() == Mode::kSharedMemory || GetParam() == Mode::kSharedDirectory;
  }
  // Where this mode's regions live: files in the shared directory, or
  // memfds on this host (nothing named).
  static std::string RegionPrefix() {
    return GetParam() == Mode::kSharedDirectory ? *shm_dir_ + "/ember-" : "memfd:ember-channel";
  }
  static testing_util::LocalCluster* cluster_;
  static std::string* shm_dir_;
};
testing_util::LocalCluster* ServiceTest::cluster_ = nullptr;
std::string* ServiceTest::shm_dir_ = nullptr;

INSTANTIATE_TEST_SUITE_P(Transport, ServiceTest,
                         ::testing::Values(Mode::kInline, Mode::kSharedMemory,
                                           Mode::kSharedDirectory, Mode::kSocketLink),
                         [](const ::testing::TestParamInfo<Mode>& p) {
                           return p.param == Mode::kInline            ? "Inline"
                                  : p.param == Mode::kSharedMemory    ? "SharedMemory"
                                  : p.param == Mode::kSharedDirectory ? "SharedDirectory"
                                                                      : "SocketLink";
                         });

// The transport is the one asked for: with shared memory the workers hold
// this client's channels (and nothing else does), and no region is left
// named in /dev/shm (names are unlinked once both sides mapped them).
TEST_P(ServiceTest, TheTransportIsTheOneAskedFor) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const CollectionSpec spec = TestSpec("transport");
  ASSERT_TRUE(c->CreateCollection(spec, "row_wise").ok());
  std::mt19937 rng(5);
  auto kjt = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 32, false);
  auto kt = c->Lookup("transport", kjt);
  ASSERT_TRUE(kt.ok()) << kt.status();
  auto ref = InProcessCollection::Create(spec);
  ASSERT_TRUE(ref.ok());
  ExpectNear(kt->values, (*ref)->Lookup(kjt)->values, "lookup");
  int64_t channels = 0;
  auto workers = c->ListWorkers();
  ASSERT_TRUE(workers.ok());
  for (const auto& w : workers->workers()) {
    // Every worker here offers all three (emberctl up's default, and
    // --links=socket).
    EXPECT_EQ(std::vector<std::string>(w.info().transports().begin(), w.info().transports().end()),
              (std::vector<std::string>{"grpc", "shm", "socket"}));
    auto st = c->WorkerStatus(w.info().address());
    ASSERT_TRUE(st.ok()) << st.status();
    channels += st->shm_channels();
  }
  EXPECT_EQ(channels > 0, SharedRegions()) << channels << " shared-memory channel(s) open";
  int64_t links = 0, link_lookups = 0;
  for (const auto& w : workers->workers()) {
    auto st = c->WorkerStatus(w.info().address());
    ASSERT_TRUE(st.ok()) << st.status();
    links += st->link_channels();
    link_lookups += st->link_lookups();
  }
  EXPECT_EQ(links > 0, GetParam() == Mode::kSocketLink) << links << " link channel(s) open";
  EXPECT_EQ(link_lookups > 0, GetParam() == Mode::kSocketLink) << link_lookups << " through links";
  // Through a channel, pooled columns go straight into the KeyedTensor's
  // shared buffer (a row-wise table's partial sums above cannot):
  // column-wise, both workers write their columns of each row.
  auto placed = [&] {
    int64_t n = 0;
    for (const auto& w : workers->workers()) n += c->WorkerStatus(w.info().address())->placed_lookups();
    return n;
  };
  // And the ids come straight from the KeyedJaggedTensor's shared buffer
  // (its IdBuffer), where the channel is a memfd the worker opened through
  // /proc: not over a shared directory's files.
  auto ids_in_place = [&] {
    int64_t n = 0;
    for (const auto& w : workers->workers()) {
      n += c->WorkerStatus(w.info().address())->id_buffer_lookups();
    }
    return n;
  };
  const int64_t placed_before = placed(), ids_before = ids_in_place();
  ASSERT_TRUE(c->CreateCollection(TestSpec("placed"), "column_wise").ok());
  auto placed_ref = InProcessCollection::Create(TestSpec("placed"));
  ASSERT_TRUE(placed_ref.ok());
  for (int i = 0; i < 3; ++i) {
    auto kjt2 = RandomKjt(rng, {"f_sum", "f_mean", "f_sum2"}, {301, 200, 301}, 256, false);
    ASSERT_TRUE(client::SharedBuffers::Global()
                    .Find(kjt2.values.data(), kjt2.values.size() * sizeof(int64_t))
                    .has_value())
        << "the test's ids are not in a shared buffer";
    auto kt2 = c->Lookup("placed", kjt2);
    ASSERT_TRUE(kt2.ok()) << kt2.status();
    ExpectNear(kt2->values, (*placed_ref)->Lookup(kjt2)->values, "placed lookup");
  }
  EXPECT_EQ(placed() - placed_before, SharedRegions() ? 6 : 0)
      << "placed lookups (3 on each worker; not through links)";
  EXPECT_EQ(ids_in_place() - ids_before, GetParam() == Mode::kSharedMemory ? 6 : 0)
      << "lookups that read the KeyedJaggedTensor's ids in place";
  ASSERT_TRUE(c->DropCollection("placed").ok());
  const std::string mine = absl::StrCat("ember-", getpid(), "-");
  for (const std::string& dir : {std::string("/dev/shm"), *shm_dir_}) {
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      EXPECT_NE(entry.path().filename().string().rfind(mine, 0), 0u)
          << entry.path() << " was left in " << dir;
    }
  }
  // Mapped here and in the workers while open, where this mode puts them;
  // no descriptor kept anywhere.
  EXPECT_EQ(ShmHeld(getpid(), RegionPrefix()) > 0, SharedRegions());
  EXPECT_EQ(ShmHeld(getpid(), "/dev/shm/ember-"), 0) << "a named POSIX region";
  if (GetParam() == Mode::kSharedDirectory) {
    EXPECT_EQ(ShmHeld(getpid(), "memfd:ember-channel"), 0) << "a memfd despite shm_dir";
  }
  ASSERT_TRUE(c->DropCollection("transport").ok());
  c.reset();  // its channels closed
  EXPECT_EQ(ShmHeld(getpid(), RegionPrefix()), 0) << "the client kept a region mapped";
  for (const auto& w : workers->workers()) {
    auto other = Connect();
    ASSERT_NE(other, nullptr);
    auto st = other->WorkerStatus(w.info().address());
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->shm_channels(), 0) << "a closed client's channel is still open";
    EXPECT_EQ(st->link_channels(), 0) << "a closed client's link channel is still open";
  }
  for (int pid : cluster_->worker_pids()) {
    EXPECT_EQ(ShmHeld(pid, RegionPrefix()), 0)
        << "worker " << pid << " kept a closed channel's region";
    EXPECT_EQ(ShmHeld(pid, "memfd:ember-buffer"), 0)
        << "worker " << pid << " kept a closed channel's output buffer mapped";
  }
}

// A worker that cannot map the KeyedJaggedTensor's buffer (here: its
// descriptor made to name /dev/null, as a buffer of another process would
// look) refuses the call; the client retries it with the ids sent through
// the channel, the results are right, and that channel never names a
// buffer for ids again.
TEST_P(ServiceTest, IdsAWorkerCannotMapAreSentThroughTheChannel) {
  if (GetParam() != Mode::kSharedMemory) GTEST_SKIP() << "ids are read in place over memfd channels";
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  ASSERT_TRUE(c->CreateCollection(TestSpec("unmapped"), "column_wise").ok());
  auto ref = InProcessCollection::Create(TestSpec("unmapped"));
  ASSERT_TRUE(ref.ok());
  auto workers = c->ListWorkers();
  ASSERT_TRUE(workers.ok());
  auto ids_in_place = [&] {
    int64_t n = 0;
    for (const auto& w : workers->workers()) {
      n += c->WorkerStatus(w.info().address())->id_buffer_lookups();
    }
    return n;
  };
  std::mt19937 rng(17);
  auto kjt = [&] { return RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 256, false); };
  const auto first = kjt();
  const int64_t before = ids_in_place();
  auto kt = c->Lookup("unmapped", first);
  ASSERT_TRUE(kt.ok()) << kt.status();
  ExpectNear(kt->values, (*ref)->Lookup(first)->values, "lookup");
  ASSERT_EQ(ids_in_place() - before, 2) << "both workers read the ids in place";

  const auto sabotaged = kjt();
  auto info = client::SharedBuffers::Global().Find(sabotaged.values.data(),
                                                   sabotaged.values.size() * sizeof(int64_t));
  ASSERT_TRUE(info.has_value());
  const int saved = dup(info->fd);
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(saved, 0);
  ASSERT_GE(null_fd, 0);
  ASSERT_EQ(dup2(null_fd, info->fd), info->fd);
  auto retried = c->Lookup("unmapped", sabotaged);
  ASSERT_EQ(dup2(saved, info->fd), info->fd);  // the buffer's descriptor back
  close(saved);
  close(null_fd);
  ASSERT_TRUE(retried.ok()) << retried.status();
  ExpectNear(retried->values, (*ref)->Lookup(sabotaged)->values, "retried lookup");
  for (int i = 0; i < 2; ++i) {
    const auto next = kjt();
    auto later = c->Lookup("unmapped", next);
    ASSERT_TRUE(later.ok()) << later.status();
    ExpectNear(later->values, (*ref)->Lookup(next)->values, "later lookup");
  }
  EXPECT_EQ(ids_in_place() - before, 2) << "a channel named a buffer again after a refusal";
  ASSERT_TRUE(c->DropCollection("unmapped").ok());
}

// Connect sets this process's allocator to keep freed heap
// (ClientOptions::keep_freed_heap_mib, on by default): a 24 MiB block then
// comes from the heap, not from a mapping of its own as glibc's defaults
// give it. A negative amount is refused.
TEST_P(ServiceTest, ClientsKeepFreedHeapForTheNextCall) {
  client::ClientOptions bad;
  bad.keep_freed_heap_mib = -1;
  EXPECT_EQ(Client::Connect(cluster_->coordinator(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const size_t mapped_before = mallinfo2().hblkhd;
  void* block = malloc(24 << 20);
  ASSERT_NE(block, nullptr);
  EXPECT_EQ(mallinfo2().hblkhd, mapped_before) << "a 24 MiB block was mapped apart";
  free(block);
}

// A KeyedTensor kept across lookups of other shapes (the reusing forms of
// Client::Lookup and InProcessCollection::Lookup) ends up as a fresh one,
// whatever it held: under every sharding type, row-wise partial sums start
// from zero, and a feature without ids (its shards sent nothing) is zero.
TEST_P(ServiceTest, LookupsIntoAKeptKeyedTensor) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  for (const std::string type :
       {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}) {
    SCOPED_TRACE(type);
    const std::string name = "kept_" + type;
    CollectionSpec spec = TestSpec(name);
    ASSERT_TRUE(c->CreateCollection(spec, type).ok());
    auto ref = InProcessCollection::Create(spec);
    ASSERT_TRUE(ref.ok());
    std::mt19937 rng(8);
    KeyedTensor kept, kept_ref;
    for (int batch : {32, 8, 64, 64}) {
      auto kjt = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, batch, batch == 8);
      if (batch == 64 && kept.batch_size == 64) {  // the second 64: f_mean without ids
        const int64_t sum_ids = std::accumulate(kjt.lengths.begin(), kjt.lengths.begin() + 64,
                                                int64_t{0});
        std::fill(kjt.lengths.begin() + 64, kjt.lengths.end(), 0);
        kjt.values.resize(sum_ids);
        if (!kjt.weights.empty()) kjt.weights.resize(sum_ids);
      }
      kept.values.assign(kept.values.size(), std::nanf(""));  // nothing may survive
      kept_ref.values.assign(kept_ref.values.size(), std::nanf(""));
      ASSERT_TRUE(c->Lookup(name, kjt, &kept).ok());
      ASSERT_TRUE((*ref)->Lookup(kjt, &kept_ref).ok());
      auto fresh = c->Lookup(name, kjt);
      ASSERT_TRUE(fresh.ok()) << fresh.status();
      EXPECT_EQ(kept.keys, fresh->keys);
      EXPECT_EQ(kept.length_per_key, fresh->length_per_key);
      EXPECT_EQ(kept.batch_size, batch);
      EXPECT_EQ(kept.values, fresh->values) << "batch " << batch;
      EXPECT_EQ(kept_ref.keys, fresh->keys);
      ExpectNear(kept_ref.values, fresh->values, "in-process into a kept KeyedTensor");
    }
    ASSERT_TRUE(c->DropCollection(name).ok());
  }
}

// An id outside its table, at any position (the vectorised blocks and the
// tail) and negative ones, is refused by the client and by the in-process
// collection with the same message naming it. A lookup of a table whose
// shards hold all its rows leaves the check to the workers (the client
// names what they refuse); one of a row-wise table, and every update, is
// refused before anything is sent. Updates change nothing, through the
// service or in process (its backend checks the ids, the collection names
// them).
TEST_P(ServiceTest, OutOfRangeIdsAreRefusedAndNamed) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const CollectionSpec spec = TestSpec("range");
  ASSERT_TRUE(c->CreateCollection(spec, "table_wise").ok());
  ASSERT_TRUE(c->CreateCollection(TestSpec("range_rw"), "row_wise").ok());
  auto ref = InProcessCollection::Create(spec);
  ASSERT_TRUE(ref.ok());
  for (int64_t bad : {int64_t{301}, int64_t{-1}, int64_t{1} << 40}) {
    for (int pos : {0, 7, 8, 12, 18}) {
      KeyedJaggedTensor kjt;
      kjt.keys = {"f_sum"};
      kjt.lengths = {19};
      for (int i = 0; i < 19; ++i) kjt.values.push_back(i == pos ? bad : 300 - i);
      const std::string want = absl::StrCat("feature 'f_sum': id ", bad, " is outside [0, 301)");
      auto got = c->Lookup("range", kjt);
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
      EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr(want));
      auto row_wise = c->Lookup("range_rw", kjt);
      EXPECT_EQ(row_wise.status().code(), absl::StatusCode::kInvalidArgument) << row_wise.status();
      EXPECT_THAT(std::string(row_wise.status().message()), ::testing::HasSubstr(want));
      auto local = (*ref)->Lookup(kjt);
      EXPECT_EQ(local.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(local.status().message()), ::testing::HasSubstr(want));
      int64_t rows = 0, dim = 0;
      auto before = (*ref)->ExportTable("t_sum", &rows, &dim);
      ASSERT_TRUE(before.ok());
      KeyedTensor grads;
      grads.keys = {"f_sum"};
      grads.length_per_key = {dim};
      grads.batch_size = 1;
      grads.values.assign(dim, 0.5f);
      const absl::Status update = (*ref)->ApplyGradients(kjt, grads);
      EXPECT_EQ(update.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(update.message()), ::testing::HasSubstr(want));
      EXPECT_EQ(*(*ref)->ExportTable("t_sum", &rows, &dim), *before);
      if (pos != 0) continue;
      const absl::Status service_update = c->ApplyGradients("range", kjt, grads);
      EXPECT_EQ(service_update.code(), absl::StatusCode::kInvalidArgument) << service_update;
      EXPECT_THAT(std::string(service_update.message()), ::testing::HasSubstr(want));
    }
  }
  // The service's updates above changed nothing.
  testing_util::ExpectTablesMatch(c.get(), ref->get(), "range", spec, "table_wise");
  ASSERT_TRUE(c->DropCollection("range").ok());
  ASSERT_TRUE(c->DropCollection("range_rw").ok());
}

TEST_P(ServiceTest, EveryShardingTypeMatchesReference) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  int seed = 1;
  for (const std::string type :
       {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}) {
    SCOPED_TRACE(type);
    RunAgainstReference(c.get(), type, seed++);
  }
}

TEST_P(ServiceTest, ConcurrentClientsGetCorrectResults) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const CollectionSpec spec = TestSpec("concurrent");
  ASSERT_TRUE(c->CreateCollection(spec, "row_wise").ok());
  auto ref = *InProcessCollection::Create(spec);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto own = Connect();
      std::mt19937 rng(100 + t);
      for (int i = 0; i < 10; ++i) {
        KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 8, false);
        Client* which = (i % 2) ? own.get() : c.get();  // shared and own clients
        auto kt = which->Lookup("concurrent", kjt);
        if (!kt.ok()) {
          ++failures;
          continue;
        }
        failures += testing_util::Mismatches(kt->values, ref->Lookup(kjt)->values);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  ASSERT_TRUE(c->DropCollection("concurrent").ok());
}

// A collection created with a plan made elsewhere (here by hand, with
// shards on unusual ranks) serves what the reference computes on that
// plan; a plan that does not tile a table is refused and nothing is made.
TEST_P(ServiceTest, AnExplicitPlanIsCheckedAndServed) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const CollectionSpec spec = TestSpec("explicit");
  auto plan = planner::ParsePlanJson(R"({
    "t_sum": {"sharding_type": "row_wise", "compute_kernel": "fused", "ranks": [1, 0],
      "sharding_spec": {"shards": [
        {"shard_offsets": [0, 0], "shard_sizes": [100, 16], "placement": "rank:1/cpu"},
        {"shard_offsets": [100, 0], "shard_sizes": [201, 16], "placement": "rank:0/cpu"}]}},
    "t_mean": {"sharding_type": "column_wise", "compute_kernel": "fused", "ranks": [1, 0],
      "sharding_spec": {"shards": [
        {"shard_offsets": [0, 0], "shard_sizes": [200, 12], "placement": "rank:1/cpu"},
        {"shard_offsets": [0, 12], "shard_sizes": [200, 4], "placement": "rank:0/cpu"}]}},
    "t_rw": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [1],
      "sharding_spec": {"shards": [
        {"shard_offsets": [0, 0], "shard_sizes": [150, 16], "placement": "rank:1/cpu"}]}},
    "t_seq": {"sharding_type": "data_parallel", "compute_kernel": "dense", "ranks": [0, 1]}})");
  ASSERT_TRUE(plan.ok()) << plan.status();

  // Refused: a gap in t_sum.
  ember::v1::ShardingPlan gap = *plan;
  for (auto& t : *gap.mutable_tables()) {
    if (t.table() == "t_sum") t.mutable_shards(0)->set_rows(99);
  }
  auto refused = c->CreateCollectionWithPlan(spec, gap);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(std::string(refused.status().message()).find("covered by 0 shards"), std::string::npos)
      << refused.status();
  EXPECT_EQ(c->GetCollection("explicit").status().code(), absl::StatusCode::kNotFound);

  auto info = c->CreateCollectionWithPlan(spec, *plan);
  ASSERT_TRUE(info.ok()) << info.status();
  for (const auto& t : info->plan().tables()) {
    if (t.table() == "t_sum") {
      ASSERT_EQ(t.shards_size(), 2);
      EXPECT_EQ(t.shards(0).rank(), 1);
      EXPECT_EQ(t.shards(1).rows(), 201);
    }
    if (t.table() == "t_mean") EXPECT_EQ(t.shards(0).cols(), 12);
  }
  EXPECT_GT(info->plan().stats().max_cost_ms(), 0);  // scored by the model
  auto ref = InProcessCollection::Create(spec, &info->plan());
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::mt19937 rng(31);
  for (int step = 0; step < 3; ++step) {
    testing_util::StepAgainstReference(c.get(), ref->get(), "explicit", rng, 6, step == 1, true,
                                       "explicit plan");
  }
  testing_util::ExpectTablesMatch(c.get(), ref->get(), "explicit", spec, "explicit plan");
  ASSERT_TRUE(c->DropCollection("explicit").ok());
}

// Workers bound the data calls in progress (--max_queued_calls=1 here):
// the calls past it are refused "worker busy", and clients wait them out
// with back-off, so every concurrent call still gets the reference's
// answer; the refusals are counted in ShardStatus. Over link channels
// (`link`: "socket") a busy worker takes a call's bytes before refusing
// it, and the client keeps the channel: a link is joined once per worker
// (the client keeps one channel per worker; calls that find it taken go
// inline), not again after each refusal.
void BusyWorkersAreWaitedOut(const std::string& link) {
  std::vector<std::string> flags = {"--max_queued_calls=1"};
  if (!link.empty()) flags.push_back("--links=" + link);
  testing_util::LocalCluster cluster(kEmberctl, 2, flags);
  ASSERT_TRUE(cluster.ok()) << "emberctl up did not come up";
  client::ClientOptions o;
  o.timeout = absl::Seconds(60);
  o.max_attempts = 1000;
  o.initial_backoff = absl::Milliseconds(1);
  o.link = link;
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  const CollectionSpec spec = TestSpec("bounded");
  ASSERT_TRUE((*c)->CreateCollection(spec, "row_wise").ok());
  auto ref = *InProcessCollection::Create(spec);
  // The workers' counts, summed.
  struct Totals {
    int64_t refused = 0, kept = 0, opened = 0, link_lookups = 0;
  };
  auto totals = [&] {
    Totals t;
    auto workers = (*c)->ListWorkers();
    EXPECT_TRUE(workers.ok()) << workers.status();
    if (!workers.ok()) return t;
    for (const auto& w : workers->workers()) {
      auto st = (*c)->WorkerStatus(w.info().address());
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) continue;
      t.refused += st->busy_refused();
      t.kept += st->link_busy_kept();
      t.opened += st->link_channels_opened();
      t.link_lookups += st->link_lookups();
    }
    return t;
  };
  // Rounds of 6 threads x 20 lookups until the workers have refused some
  // (nearly always the first round), and over links until they have
  // refused at least 8 link channels' calls (a few rounds; at most 90: on
  // a loaded 2-core machine 30 rounds have ended at 7).
  Totals t;
  for (int round = 0; round < 90 && (t.refused == 0 || (!link.empty() && t.kept < 8)); ++round) {
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int th = 0; th < 6; ++th) {
      threads.emplace_back([&, th] {
        std::mt19937 rng(200 + 10 * round + th);
        for (int i = 0; i < 20; ++i) {
          KeyedJaggedTensor kjt = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 512, false);
          auto kt = (*c)->Lookup("bounded", kjt);
          if (!kt.ok()) {
            ADD_FAILURE() << kt.status();
            ++failures;
            continue;
          }
          failures += testing_util::Mismatches(kt->values, ref->Lookup(kjt)->values);
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failures.load(), 0);
    t = totals();
  }
  EXPECT_GT(t.refused, 0) << "6 threads never found a worker busy at --max_queued_calls=1";
  if (!link.empty()) {
    EXPECT_GT(t.link_lookups, 0) << "no lookup went through a link channel";
    EXPECT_GE(t.kept, 8) << "too few link channels' calls found a worker busy to tell";
    // A link per worker, and another each time a call needs a larger
    // region (rare): not one per refusal.
    EXPECT_LE(t.opened, 2 * 3) << t.kept << " link channels' calls refused as busy";
  }
  ASSERT_TRUE((*c)->DropCollection("bounded").ok());
}

TEST(ServiceBoundTest, BusyWorkersAreWaitedOutByClients) { BusyWorkersAreWaitedOut(""); }
TEST(ServiceBoundTest, BusyWorkersAreWaitedOutOverLinkChannels) {
  BusyWorkersAreWaitedOut("socket");
}

// A retried update (same request id) is applied once; the client's own
// checks reject bad input before any RPC. (Bad input on every raw RPC:
// bad_input_test.cc.)
TEST_P(ServiceTest, ExactlyOnceUpdatesAndClientSideChecks) {
  auto c = Connect();
  ASSERT_NE(c, nullptr);
  const CollectionSpec spec = TestSpec("bad");
  auto info = c->CreateCollection(spec, "table_wise");
  ASSERT_TRUE(info.ok()) << info.status();
  int64_t rows, dim;
  const std::vector<float> before = *c->ExportTable("bad", "t_sum", &rows, &dim);
  int rank = -1;
  for (const auto& t : info->plan().tables()) {
    if (t.table() == "t_sum") rank = t.shards(0).rank();
  }
  auto stub = ember::v1::Worker::NewStub(MakeChannel(info->worker_addresses(rank)));
  auto feature = [](std::vector<int64_t> lengths, std::vector<int64_t> ids) {
    ember::v1::ShardFeature f;
    f.mutable_shard()->set_table("t_sum");
    f.set_feature("f_sum");
    f.set_lengths(wire::Encode<int64_t>(lengths));
    f.set_ids(wire::Encode<int64_t>(ids));
    return f;
  };
  auto apply = [&](const ember::v1::ShardFeature& f, int64_t grad_floats, int64_t epoch,
                   const std::string& id, ember::v1::WorkerApplyGradientsResponse* resp) {
    grpc::ClientContext ctx;
    SetDeadline(&ctx, absl::Seconds(10));
    ember::v1::WorkerApplyGradientsRequest req;
    req.set_collection("bad");
    req.set_epoch(epoch);
    req.set_request_id(id);
    auto* g = req.add_gradients();
    *g->mutable_feature() = f;
    g->set_grad(wire::Encode<float>(std::vector<float>(grad_floats, 1.0f)));
    return stub->ApplyGradients(&ctx, req, resp).error_code();
  };
  const int64_t epoch = info->plan().epoch();
  ember::v1::WorkerApplyGradientsResponse resp;
  EXPECT_EQ(apply(feature({2}, {1, 301}), 16, epoch, "a", &resp), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(*c->ExportTable("bad", "t_sum", &rows, &dim), before);  // nothing applied

  // Exactly once: the same request id twice applies once.
  EXPECT_EQ(apply(feature({2}, {3, 3}), 16, epoch, "once", &resp), grpc::StatusCode::OK);
  EXPECT_FALSE(resp.duplicate());
  const std::vector<float> after_one = *c->ExportTable("bad", "t_sum", &rows, &dim);
  EXPECT_NE(after_one, before);
  EXPECT_EQ(apply(feature({2}, {3, 3}), 16, epoch, "once", &resp), grpc::StatusCode::OK);
  EXPECT_TRUE(resp.duplicate());
  EXPECT_EQ(*c->ExportTable("bad", "t_sum", &rows, &dim), after_one);
  // SGD, lr 0.05, grad 1 twice on row 3: w -= 0.1 per column, once.
  for (int col = 0; col < 16; ++col) {
    EXPECT_NEAR(after_one[3 * 16 + col], before[3 * 16 + col] - 0.1f, 1e-6);
  }

  // Client-side checks: unknown collection / feature, bad KJT, wrong grads.
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {1};
  kjt.values = {2};
  EXPECT_EQ(c->Lookup("no_such", kjt).status().code(), absl::StatusCode::kNotFound);
  KeyedJaggedTensor unknown_key = kjt;
  unknown_key.keys = {"zzz"};
  EXPECT_EQ(c->Lookup("bad", unknown_key).status().code(), absl::StatusCode::kNotFound);
  KeyedJaggedTensor mismatch = kjt;
  mismatch.lengths = {2};
  EXPECT_EQ(c->Lookup("bad", mismatch).status().code(), absl::StatusCode::kInvalidArgument);
  KeyedTensor g;
  g.keys = {"f_sum"};
  g.length_per_key = {8};
  g.batch_size = 1;
  g.values.assign(8, 1.0f);
  EXPECT_EQ(c->ApplyGradients("bad", kjt, g).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*c->ExportTable("bad", "t_sum", &rows, &dim), after_one);
  // And it still serves.
  EXPECT_TRUE(c->Lookup("bad", kjt).ok());
  ASSERT_TRUE(c->DropCollection("bad").ok());
}

TEST_P(ServiceTest, StaleEpochRefreshesThePlan) {
  auto a = Connect();
  auto b = Connect();
  ASSERT_TRUE(a->CreateCollection(TestSpec("stale"), "row_wise").ok());
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {2};
  kjt.values = {2, 299};
  ASSERT_TRUE(b->Lookup("stale", kjt).ok());  // b caches epoch N
  ASSERT_TRUE(a->DropCollection("stale").ok());
  ASSERT_TRUE(a->CreateCollection(TestSpec("stale"), "table_wise").ok());  // epoch > N
  auto kt = b->Lookup("stale", kjt);  // FAILED_PRECONDITION inside, refreshed, retried
  EXPECT_TRUE(kt.ok()) << kt.status();
  ASSERT_TRUE(a->DropCollection("stale").ok());
}

// A separate 3-worker cluster: row-wise and column-wise over 3 workers, then
// a worker is killed: clients get UNAVAILABLE within the deadline.
TEST(ThreeWorkerTest, ShardingOverThreeWorkersAndAKilledWorker) {
  client::SharedBuffers::Global().set_shared_min_bytes(client::SharedBuffers::kFloorBytes);
  testing_util::LocalCluster cluster(kEmberctl, 3);
  ASSERT_TRUE(cluster.ok());
  ASSERT_EQ(cluster.worker_pids().size(), 3u);
  client::ClientOptions o;
  o.timeout = absl::Seconds(5);
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  RunAgainstReference(c->get(), "row_wise", 21);
  RunAgainstReference(c->get(), "column_wise", 22);
  ASSERT_TRUE((*c)->CreateCollection(TestSpec("kill"), "row_wise").ok());
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {3};
  kjt.values = {1, 150, 300};  // one id per worker's row block
  auto first = (*c)->Lookup("kill", kjt);
  ASSERT_TRUE(first.ok()) << first.status();
  // Shared memory (the default) to every worker: a region each, memfds.
  EXPECT_EQ(ShmHeld(getpid(), "memfd:ember-channel"), 3);
  // A column-wise collection looked up into a kept KeyedTensor in shared
  // memory: every worker writes its columns into it.
  ASSERT_TRUE((*c)->CreateCollection(TestSpec("kept"), "column_wise").ok());
  std::mt19937 rng(8);
  const KeyedJaggedTensor wide = RandomKjt(rng, {"f_sum", "f_mean"}, {301, 200}, 64, false);
  client::KeyedTensor kept;
  ASSERT_TRUE((*c)->Lookup("kept", wide, &kept).ok());
  auto kept_buffer = client::SharedBuffers::Global().Find(kept.values.data(), 4);
  ASSERT_TRUE(kept_buffer.has_value());
  kill(cluster.worker_pids()[1], SIGKILL);
  const absl::Time start = absl::Now();
  auto kt = (*c)->Lookup("kill", kjt);
  EXPECT_EQ(kt.status().code(), absl::StatusCode::kUnavailable) << kt.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(6));  // the deadline, not a hang
  // The failed lookup's buffer is let go (the workers that answered may
  // not be the only writers): the kept KeyedTensor holds another.
  EXPECT_EQ((*c)->Lookup("kept", wide, &kept).code(), absl::StatusCode::kUnavailable);
  auto now_buffer = client::SharedBuffers::Global().Find(kept.values.data(), 4);
  EXPECT_TRUE(!now_buffer.has_value() || now_buffer->id != kept_buffer->id);
  // A failed update applies nothing and leaves nothing behind either.
  EXPECT_EQ((*c)->ApplyGradients("kill", kjt, *first).code(), absl::StatusCode::kUnavailable);
  c->reset();
  EXPECT_EQ(ShmHeld(getpid(), "memfd:ember-channel"), 0)
      << "regions of a dead worker's channels stayed mapped";
  for (int pid : {cluster.worker_pids()[0], cluster.worker_pids()[2]}) {
    EXPECT_EQ(ShmHeld(pid, "memfd:ember-channel"), 0)
        << "worker " << pid << " kept a closed channel's region";
  }
}

// Device KJTs (LookupOnDevice / ApplyGradientsOnDevice) over socket links,
// where "device memory" is host memory: every sharding type against the
// in-process reference, weighted and not, several steps, then the tables;
// and their bad input.
TEST(LinkChannelTest, DeviceKjtsMatchTheReferenceForEverySharding) {
  testing_util::LocalCluster cluster(kEmberctl, 2, {"--links=socket"});
  ASSERT_TRUE(cluster.ok());
  client::ClientOptions o;
  o.timeout = absl::Seconds(20);
  o.link = "socket";
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  std::mt19937 rng(41);
  for (const std::string type :
       {"table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"}) {
    const std::string name = "dev_" + type;
    const CollectionSpec spec = TestSpec(name);
    auto info = (*c)->CreateCollection(spec, type);
    ASSERT_TRUE(info.ok()) << type << ": " << info.status();
    auto ref = InProcessCollection::Create(spec, &info->plan());  // the plan's shards
    ASSERT_TRUE(ref.ok());
    for (int step = 0; step < 3; ++step) {
      const bool weighted = step % 2 == 1;
      const KeyedJaggedTensor kjt = RandomKjt(rng, {"f_mean", "f_sum", "f_rw", "f_sum2"},
                                              {200, 301, 150, 301}, 24, weighted);
      client::DeviceKjt dev;
      dev.keys = kjt.keys;
      dev.batch_size = 24;
      dev.lengths = kjt.lengths.data();
      dev.values = kjt.values.data();
      dev.num_values = static_cast<int64_t>(kjt.values.size());
      dev.weights = weighted ? kjt.weights.data() : nullptr;
      auto want = (*ref)->Lookup(kjt);
      ASSERT_TRUE(want.ok()) << want.status();
      std::vector<float> out(want->values.size(), std::nanf(""));  // every element written
      Client::Layout layout;
      absl::Status st =
          (*c)->LookupOnDevice(name, dev, out.data(), static_cast<int64_t>(out.size()), &layout);
      ASSERT_TRUE(st.ok()) << type << ": " << st;
      EXPECT_EQ(layout.keys, want->keys);
      ExpectNear(out, want->values, absl::StrCat(type, " device lookup, step ", step));
      auto host = (*c)->Lookup(name, kjt);  // and what the host path gives
      ASSERT_TRUE(host.ok());
      ExpectNear(out, host->values, absl::StrCat(type, " device vs host lookup, step ", step));
      std::vector<float> grads(out.size());
      for (float& g : grads) g = std::uniform_real_distribution<float>(-1, 1)(rng);
      st = (*c)->ApplyGradientsOnDevice(name, dev, grads.data(), static_cast<int64_t>(grads.size()));
      ASSERT_TRUE(st.ok()) << type << ": " << st;
      client::KeyedTensor kt = *want;
      std::copy(grads.begin(), grads.end(), kt.values.begin());
      ASSERT_TRUE((*ref)->ApplyGradients(kjt, kt).ok());
    }
    testing_util::ExpectTablesMatch(c->get(), ref->get(), name, spec, type);
    ASSERT_TRUE((*c)->DropCollection(name).ok());
  }
  // Bad input and edge cases, table-wise (all-rows: device ids the client
  // never reads) and row-wise.
  client::DeviceKjt dev;
  auto point = [&dev](const KeyedJaggedTensor& kjt, const std::vector<int64_t>* values = nullptr) {
    dev.keys = kjt.keys;
    dev.batch_size = kjt.batch_size();
    dev.lengths = kjt.lengths.data();
    dev.values = values != nullptr ? values->data() : kjt.values.data();
    dev.num_values = static_cast<int64_t>(kjt.values.size());
    dev.weights = nullptr;
  };
  for (const std::string type : {"table_wise", "row_wise"}) {
    const std::string name = "dev_bad_" + type;
    ASSERT_TRUE((*c)->CreateCollection(TestSpec(name), type).ok());
    auto counts = [&] {  // (lookups, of them through links) over the workers
      std::pair<int64_t, int64_t> n{0, 0};
      auto workers = (*c)->ListWorkers();
      for (const auto& w : workers->workers()) {
        auto st = (*c)->WorkerStatus(w.info().address());
        n.first += st->lookups();
        n.second += st->link_lookups();
      }
      return n;
    };
    const auto before = counts();
    // f_sum given ids, f_mean only empty bags: its columns are zeros.
    auto kjt = KeyedJaggedTensor::FromJagged({"f_sum", "f_mean"}, {{{1, 2}, {3}}, {{}, {}}});
    ASSERT_TRUE(kjt.ok());
    point(*kjt);
    std::vector<float> out(2 * 32, std::nanf(""));
    ASSERT_TRUE((*c)->LookupOnDevice(name, dev, out.data(), 64).ok()) << type;
    for (int b = 0; b < 2; ++b) {
      for (int col = 16; col < 32; ++col) EXPECT_EQ(out[b * 32 + col], 0.0f) << type << " " << col;
      for (int col = 0; col < 16; ++col) EXPECT_FALSE(std::isnan(out[b * 32 + col])) << type;
    }
    const auto after = counts();
    EXPECT_GT(after.second - before.second, 0) << type;
    EXPECT_EQ(after.second - before.second, after.first - before.first)
        << type << ": every device lookup went through the links";
    EXPECT_EQ((*c)->LookupOnDevice(name, dev, out.data(), 63).code(),
              absl::StatusCode::kInvalidArgument)
        << "an output too small";
    // An id past the table: refused and named, in a lookup and in an update,
    // which applies nothing anywhere.
    std::vector<int64_t> far(kjt->values.begin(), kjt->values.end());
    far.back() = 301;
    point(*kjt, &far);
    const absl::Status looked = (*c)->LookupOnDevice(name, dev, out.data(), 64);
    EXPECT_EQ(looked.code(), absl::StatusCode::kInvalidArgument) << looked;
    EXPECT_THAT(std::string(looked.message()), ::testing::HasSubstr("301")) << looked;
    int64_t rows = 0, dim = 0;
    const std::vector<float> weights_before = *(*c)->ExportTable(name, "t_sum", &rows, &dim);
    std::vector<float> grads(64, 1.0f);
    const absl::Status bad = (*c)->ApplyGradientsOnDevice(name, dev, grads.data(), 64);
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(bad.message()), ::testing::HasSubstr("301")) << bad;
    EXPECT_EQ(*(*c)->ExportTable(name, "t_sum", &rows, &dim), weights_before) << "applied";
    ASSERT_TRUE((*c)->DropCollection(name).ok());
  }
  client::ClientOptions plain;
  auto no_link = Client::Connect(cluster.coordinator(), plain);
  ASSERT_TRUE(no_link.ok());
  std::vector<float> out(64);
  EXPECT_EQ((*no_link)->LookupOnDevice("any", dev, out.data(), 64).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Link channels (socket links: the NCCL channel's protocol) to a worker that
// is killed: clients get UNAVAILABLE within the deadline, and the surviving
// worker's link channels go with the client. A client asking for links
// from workers that offer none gets its calls inline.
TEST(LinkChannelTest, AKilledWorkerAndWorkersWithoutLinks) {
  testing_util::LocalCluster cluster(kEmberctl, 2, {"--links=socket"});
  ASSERT_TRUE(cluster.ok());
  const int sockets_before = UnixSockets(getpid());
  client::ClientOptions o;
  o.timeout = absl::Seconds(5);
  o.link = "socket";
  auto c = Client::Connect(cluster.coordinator(), o);
  ASSERT_TRUE(c.ok()) << c.status();
  RunAgainstReference(c->get(), "row_wise", 31);
  RunAgainstReference(c->get(), "table_wise", 32);
  ASSERT_TRUE((*c)->CreateCollection(TestSpec("kill"), "row_wise").ok());
  KeyedJaggedTensor kjt;
  kjt.keys = {"f_sum"};
  kjt.lengths = {2};
  kjt.values = {1, 300};  // one id per worker's row block
  auto first = (*c)->Lookup("kill", kjt);
  ASSERT_TRUE(first.ok()) << first.status();
  auto workers = (*c)->ListWorkers();
  ASSERT_TRUE(workers.ok());
  std::string survivor;
  for (const auto& w : workers->workers()) {
    auto st = (*c)->WorkerStatus(w.info().address());
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(st->link_channels(), 1) << w.info().address();
    EXPECT_EQ(st->shm_channels(), 0) << "links were asked for";
    if (w.info().pid() != cluster.worker_pids()[1]) survivor = w.info().address();
  }
  EXPECT_EQ(UnixSockets(getpid()) - sockets_before, 2) << "one link per worker";
  for (int pid : cluster.worker_pids()) EXPECT_EQ(UnixSockets(pid, "ember-link-"), 1) << pid;
  ASSERT_FALSE(survivor.empty());
  kill(cluster.worker_pids()[1], SIGKILL);
  const absl::Time start = absl::Now();
  EXPECT_EQ((*c)->Lookup("kill", kjt).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*c)->ApplyGradients("kill", kjt, *first).code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - start, absl::Seconds(12));  // two deadlines, not a hang
  c->reset();
  client::ClientOptions plain;
  auto other = Client::Connect(cluster.coordinator(), plain);
  ASSERT_TRUE(other.ok()) << other.status();
  auto st = (*other)->WorkerStatus(survivor);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->link_channels(), 0) << "a closed client's link channel is still open";
  EXPECT_EQ(UnixSockets(getpid()), sockets_before) << "the client kept a link's socket";
  EXPECT_EQ(UnixSockets(cluster.worker_pids()[0], "ember-link-"), 0)
      << "the surviving worker kept a closed link's socket";

  // Workers without links (emberctl up's default on a CPU host).
  testing_util::LocalCluster linkless(kEmberctl, 2);
  ASSERT_TRUE(linkless.ok());
  auto asking = Client::Connect(linkless.coordinator(), o);
  ASSERT_TRUE(asking.ok()) << asking.status();
  RunAgainstReference(asking->get(), "row_wise", 33);
  auto ws = (*asking)->ListWorkers();
  ASSERT_TRUE(ws.ok());
  for (const auto& w : ws->workers()) {
    auto ls = (*asking)->WorkerStatus(w.info().address());
    ASSERT_TRUE(ls.ok());
    EXPECT_EQ(ls->link_channels() + ls->shm_channels(), 0) << "inline, as no link is offered";
    EXPECT_GT(ls->lookups(), 0);
  }
  // And a link kind that does not exist is refused at Connect.
  client::ClientOptions bad = o;
  bad.link = "carrier-pigeon";
  EXPECT_EQ(Client::Connect(linkless.coordinator(), bad).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ember
