#include "server/checkpoint/checkpoint_files.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gtest/gtest.h"
#include "server/checkpoint/recut.h"

namespace ember {
namespace checkpoint {
namespace {

using backend::OptimizerType;

// Under $TEST_TMPDIR, which Bazel empties before each run.
std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "/ember_ckpt_test_XXXXXX";
  char* d = mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr);
  return d == nullptr ? ::testing::TempDir() : std::string(d);
}

ShardData Random(int64_t rows, int64_t cols, int64_t width, int64_t step, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  ShardData d;
  d.rows = rows;
  d.cols = cols;
  d.state_width = width;
  d.step = step;
  for (int64_t i = 0; i < rows * cols; ++i) d.weights.push_back(u(rng) - 0.5f);
  for (int64_t i = 0; i < rows * width; ++i) d.state.push_back(u(rng));
  return d;
}

ember::v1::ShardRef Ref(const std::string& table, int index) {
  ember::v1::ShardRef r;
  r.set_table(table);
  r.set_shard_index(index);
  return r;
}

// Writes a two-shard checkpoint of collection "c" under root; returns its dir.
std::string WriteCheckpoint(const std::string& root, int64_t ms, uint32_t seed) {
  auto dir = MakeCheckpointDir(root, "c", 3, ms);
  EXPECT_TRUE(dir.ok()) << dir.status();
  ember::v1::CheckpointManifest m;
  m.set_format_version(kFormatVersion);
  m.mutable_info()->set_collection("c");
  m.mutable_info()->set_created_unix_ms(ms);
  m.mutable_spec()->set_name("c");
  m.mutable_spec()->add_tables()->set_name("t/1");
  m.mutable_plan()->add_tables()->set_table("t/1");
  for (int i = 0; i < 2; ++i) {
    auto e = WriteShardFile(*dir, Ref("t/1", i), Random(50, 8, 1, 4, seed + i));
    EXPECT_TRUE(e.ok()) << e.status();
    *m.add_shards() = *e;
  }
  EXPECT_TRUE(CommitManifest(*dir, m).ok());
  return *dir;
}

void FlipByte(const std::string& path, long offset) {
  FILE* f = fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr) << path;
  fseek(f, offset, SEEK_SET);
  const int c = fgetc(f);
  fseek(f, offset, SEEK_SET);
  fputc(c ^ 0x10, f);
  fclose(f);
}

TEST(CheckpointFilesTest, ShardFileRoundTripsAndNamesAreSafe) {
  const std::string dir = TempDir();
  ShardData d = Random(17, 12, 24, 9, 1);
  d.applied_ids = {0xfeedfacecafebeefULL, 7};
  d.applied_unix_ms = {1000, 2000};
  auto e = WriteShardFile(dir, Ref("../evil table", 2), d);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->file().find('/'), std::string::npos);
  EXPECT_EQ(e->bytes(), 48 + 4 * (17 * 12 + 17 * 24) + 2 * 16);
  EXPECT_EQ(e->applied_ids(), 2);
  auto back = ReadShardFile(dir, *e);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->weights, d.weights);
  EXPECT_EQ(back->state, d.state);
  EXPECT_EQ(back->step, 9);
  EXPECT_EQ(back->applied_ids, d.applied_ids);
  EXPECT_EQ(back->applied_unix_ms, d.applied_unix_ms);
  EXPECT_TRUE(VerifyShardFile(dir, *e).ok());
  EXPECT_NE(ShardFileName(Ref("a/b", 0)), ShardFileName(Ref("a_b", 0)));
}

TEST(CheckpointFilesTest, ShardWithoutOptimizerStateRoundTrips) {
  const std::string dir = TempDir();
  const ShardData d = Random(5, 4, 0, 0, 3);  // SGD: no state
  auto e = WriteShardFile(dir, Ref("sgd", 0), d);
  ASSERT_TRUE(e.ok()) << e.status();
  auto back = ReadShardFile(dir, *e);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->weights, d.weights);
  EXPECT_TRUE(back->state.empty());
}

TEST(CheckpointFilesTest, DynamicShardRoundTripsWithItsSlotsAndAdmissionCounts) {
  const std::string dir = TempDir();
  ShardData d = Random(3, 4, 0, 5, 4);
  d.slot_meta = {-7, 4, 2, 1, 0, 0, 0, 0, 9, 5, 1, 2};  // slot 1 free
  d.pending_counts = {-3, 1, 11, 2};
  auto e = WriteShardFile(dir, Ref("dyn", 1), d);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->dynamic());
  EXPECT_EQ(e->pending_counts(), 2);
  EXPECT_EQ(e->bytes(), 48 + 4 * 3 * 4 + 8 * 12 + 16 * 2);
  auto back = ReadShardFile(dir, *e);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->slot_meta, d.slot_meta);
  EXPECT_EQ(back->pending_counts, d.pending_counts);
  EXPECT_TRUE(VerifyShardFile(dir, *e).ok());
  // A manifest whose counts disagree with the file, or that gives counts
  // to a fixed shard, is refused.
  for (const auto& tamper : std::vector<std::function<void(ember::v1::CheckpointShard*)>>{
           [](ember::v1::CheckpointShard* m) { m->set_pending_counts(3); },
           [](ember::v1::CheckpointShard* m) { m->set_pending_counts(-1); },
           [](ember::v1::CheckpointShard* m) { m->set_dynamic(false); }}) {
    ember::v1::CheckpointShard bad = *e;
    tamper(&bad);
    EXPECT_EQ(ReadShardFile(dir, bad).status().code(), absl::StatusCode::kDataLoss);
  }
  // Odd pairs are not written.
  d.pending_counts.push_back(5);
  EXPECT_FALSE(WriteShardFile(dir, Ref("dyn", 2), d).ok());
}

// The pending ids' sketch goes at the end of a dynamic shard's file, whole;
// a manifest that says otherwise, a sketch of another size or a sketch on a
// fixed shard is refused.
TEST(CheckpointFilesTest, DynamicShardKeepsItsPendingSketch) {
  const std::string dir = TempDir();
  ShardData d = Random(2, 4, 0, 5, 4);
  d.slot_meta = {-7, 4, 2, 1, 0, 0, 0, 0};
  d.pending_counts = {11, 2};
  d.pending_sketch.assign(backend::kPendingSketchCounters, 0);
  for (size_t k = 0; k < d.pending_sketch.size(); k += 997) d.pending_sketch[k] = k % 13 + 1;
  auto e = WriteShardFile(dir, Ref("dyn", 1), d);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->pending_sketch());
  EXPECT_EQ(e->bytes(), 48 + 4 * 2 * 4 + 8 * 8 + 16 * 1 + 4 * (4 << 16));
  auto back = ReadShardFile(dir, *e);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->pending_sketch, d.pending_sketch);
  EXPECT_EQ(back->pending_counts, d.pending_counts);
  ember::v1::CheckpointShard bad = *e;
  bad.set_pending_sketch(false);
  EXPECT_EQ(ReadShardFile(dir, bad).status().code(), absl::StatusCode::kDataLoss);
  d.pending_sketch.pop_back();
  EXPECT_FALSE(WriteShardFile(dir, Ref("dyn", 2), d).ok());
  ShardData fixed = Random(2, 4, 0, 5, 4);
  fixed.pending_sketch.assign(backend::kPendingSketchCounters, 1);
  EXPECT_FALSE(WriteShardFile(dir, Ref("fixed", 0), fixed).ok());
}

// A checkpoint being written reports the bytes of its shard files alone:
// the MANIFEST (and its .tmp) written at the end, and any other file, are
// not progress.
TEST(CheckpointFilesTest, ProgressCountsShardFilesOnly) {
  const std::string dir = TempDir();
  auto e = WriteShardFile(dir, Ref("t", 0), Random(3, 4, 0, 5, 4));
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(ShardBytesInDirectory(dir), e->bytes());
  for (const char* other : {"MANIFEST.tmp", "MANIFEST", "notes.txt"}) {
    std::ofstream(dir + "/" + other) << std::string(1000, 'x');
  }
  EXPECT_EQ(ShardBytesInDirectory(dir), e->bytes());
  EXPECT_EQ(ShardBytesInDirectory(dir + "/absent"), 0);
}

// Verification reports (0, total) first, then the bytes after each file,
// ending at the manifest's total; a damaged file stops it there.
TEST(CheckpointFilesTest, VerificationReportsItsProgress) {
  const std::string dir = WriteCheckpoint(TempDir(), 1000, 3);
  std::vector<std::pair<int64_t, int64_t>> seen;
  auto m = VerifyCheckpoint(dir, [&](int64_t done, int64_t total) { seen.push_back({done, total}); });
  ASSERT_TRUE(m.ok()) << m.status();
  const int64_t a = m->shards(0).bytes(), b = m->shards(1).bytes();
  EXPECT_EQ(seen, (std::vector<std::pair<int64_t, int64_t>>{{0, a + b}, {a, a + b}, {a + b, a + b}}));
  FlipByte(dir + "/" + m->shards(1).file(), 100);
  seen.clear();
  EXPECT_EQ(VerifyCheckpoint(dir, [&](int64_t done, int64_t total) { seen.push_back({done, total}); })
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(seen, (std::vector<std::pair<int64_t, int64_t>>{{0, a + b}, {a, a + b}}));
}

TEST(CheckpointFilesTest, DamageIsRefusedWithTheFileNamed) {
  const std::string root = TempDir();
  const std::string dir = WriteCheckpoint(root, 1000, 7);
  auto m = VerifyCheckpoint(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  const std::string shard = dir + "/" + m->shards(1).file();

  FlipByte(shard, 100);  // a flipped weight byte
  auto s = VerifyCheckpoint(dir);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find(m->shards(1).file()), std::string::npos) << s.status();
  EXPECT_EQ(ReadShardFile(dir, m->shards(1)).status().code(), absl::StatusCode::kDataLoss);
  FlipByte(shard, 100);
  ASSERT_TRUE(VerifyCheckpoint(dir).ok());

  ASSERT_EQ(truncate(shard.c_str(), m->shards(1).bytes() - 4), 0);  // truncated
  s = VerifyCheckpoint(dir);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find(m->shards(1).file()), std::string::npos) << s.status();

  const std::string other = WriteCheckpoint(root, 2000, 9);
  FlipByte(other + "/MANIFEST", 200);  // inside the JSON body
  s = VerifyCheckpoint(other);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("MANIFEST"), std::string::npos) << s.status();

  const std::string third = WriteCheckpoint(root, 3000, 11);
  ASSERT_EQ(unlink((third + "/" + m->shards(0).file()).c_str()), 0);  // a missing shard file
  EXPECT_EQ(VerifyCheckpoint(third).status().code(), absl::StatusCode::kDataLoss);
  ember::v1::CheckpointShard escape = m->shards(0);  // a name that leaves the directory
  escape.set_file("../" + escape.file());
  EXPECT_EQ(ReadShardFile(third, escape).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyShardFile(third, escape).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(unlink((third + "/MANIFEST").c_str()), 0);  // no manifest: not a checkpoint
  EXPECT_EQ(VerifyCheckpoint(third).status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointFilesTest, ResolvePicksTheLatestCommittedAndPruneRemoves) {
  const std::string root = TempDir();
  EXPECT_EQ(ResolveCheckpoint(root).status().code(), absl::StatusCode::kNotFound);
  const std::string a = WriteCheckpoint(root, 1000, 1);
  const std::string b = WriteCheckpoint(root, 2000, 2);
  auto uncommitted = MakeCheckpointDir(root, "c", 3, 3000);  // a write that died
  ASSERT_TRUE(uncommitted.ok());
  EXPECT_EQ(*ResolveCheckpoint(root), b);
  EXPECT_EQ(*ResolveCheckpoint(root + "/c"), b);
  EXPECT_EQ(*ResolveCheckpoint(a), a);
  EXPECT_EQ(ListCommitted(root, "c"), (std::vector<std::string>{a, b}));
  EXPECT_EQ(ListUncommitted(root, "c"), (std::vector<std::string>{*uncommitted}));
  ASSERT_TRUE(RemoveCheckpoint(b).ok());
  EXPECT_EQ(*ResolveCheckpoint(root), a);
  // Two collections under one root: ambiguous.
  auto d = MakeCheckpointDir(root, "other", 1, 5000);
  ASSERT_TRUE(d.ok());
  ember::v1::CheckpointManifest m;
  m.set_format_version(kFormatVersion);
  m.mutable_spec()->set_name("other");
  ASSERT_TRUE(CommitManifest(*d, m).ok());
  EXPECT_EQ(ResolveCheckpoint(root).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*ResolveCheckpoint(root + "/other"), *d);
}

// kill -9 at random moments of a loop that writes checkpoints and prunes
// old ones: whatever the moment, the latest committed checkpoint verifies.
TEST(CheckpointFilesTest, KilledWriterNeverLeavesATornCheckpoint) {
  const std::string root = TempDir();
  WriteCheckpoint(root, 1, 1);
  std::mt19937 rng(42);
  int64_t next_ms = 2;
  for (int round = 0; round < 40; ++round) {
    const int64_t start_ms = next_ms;
    next_ms += 1000;
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (int64_t ms = start_ms;; ++ms) {
        WriteCheckpoint(root, ms, static_cast<uint32_t>(ms));
        std::vector<std::string> all = ListCommitted(root, "c");
        for (size_t i = 0; i + 2 < all.size(); ++i) (void)RemoveCheckpoint(all[i]);
      }
    }
    usleep(std::uniform_int_distribution<int>(200, 20000)(rng));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    auto latest = ResolveCheckpoint(root);
    ASSERT_TRUE(latest.ok()) << latest.status();
    auto m = VerifyCheckpoint(*latest);
    ASSERT_TRUE(m.ok()) << "round " << round << ": " << m.status();
    for (const std::string& dir : ListUncommitted(root, "c")) (void)RemoveCheckpoint(dir);
  }
}

// Re-cutting against a naive reference: a whole table cut into one layout,
// then re-cut into another, equals the whole table cut straight into the
// second layout.
struct Layout {
  int64_t row_offset, col_offset, rows, cols;
};

ShardData Slice(const ShardData& whole, OptimizerType type, const Layout& l) {
  ShardData d;
  d.rows = l.rows;
  d.cols = l.cols;
  d.state_width = backend::OptimizerStateWidth(type, l.cols);
  d.step = whole.step;
  const int64_t wc = whole.cols;
  for (int64_t r = l.row_offset; r < l.row_offset + l.rows; ++r) {
    for (int64_t c = l.col_offset; c < l.col_offset + l.cols; ++c) {
      d.weights.push_back(whole.weights[r * wc + c]);
    }
    switch (type) {
      case OptimizerType::kSgd:
        break;
      case OptimizerType::kAdagrad:
        for (int64_t c = l.col_offset; c < l.col_offset + l.cols; ++c) {
          d.state.push_back(whole.state[r * wc + c]);
        }
        break;
      case OptimizerType::kAdam:
        for (int half = 0; half < 2; ++half) {
          for (int64_t c = l.col_offset; c < l.col_offset + l.cols; ++c) {
            d.state.push_back(whole.state[r * 2 * wc + half * wc + c]);
          }
        }
        break;
      case OptimizerType::kRowwiseAdagrad:
        d.state.push_back(whole.state[r]);
        break;
    }
  }
  return d;
}

// An incremental chain: a full checkpoint, then two deltas each holding
// some rows of the shard as it was then. Each delta's rows are taken from
// a whole copy of the shard kept by the test (the reference), so reading
// the chain must give that copy back, bit for bit.
struct Chain {
  std::string root;
  std::vector<std::string> dirs;       // oldest first
  std::vector<ShardData> states;       // the shard at each checkpoint
  std::vector<ember::v1::CheckpointShard> entries;
};

ShardData DeltaOf(const ShardData& now, const std::vector<int64_t>& rows) {
  ShardData d = now;
  d.delta = true;
  d.changed_rows = rows;
  d.weights.clear();
  d.state.clear();
  for (int64_t r : rows) {
    d.weights.insert(d.weights.end(), now.weights.begin() + r * now.cols,
                     now.weights.begin() + (r + 1) * now.cols);
    d.state.insert(d.state.end(), now.state.begin() + r * now.state_width,
                   now.state.begin() + (r + 1) * now.state_width);
  }
  return d;
}

Chain WriteChain() {
  Chain c;
  c.root = *ConfinedPath(TempDir(), "");  // normalised, as confined paths are
  std::mt19937 rng(9);
  ShardData now = Random(40, 6, 6, 1, 11);
  now.applied_ids = {1, 2};
  now.applied_unix_ms = {10, 20};
  for (int k = 0; k < 3; ++k) {
    std::vector<int64_t> changed;
    if (k > 0) {  // change a few rows (and the step, and the record)
      for (int64_t r = 0; r < now.rows; ++r) {
        if (rng() % 5 == 0) changed.push_back(r);
      }
      for (int64_t r : changed) {
        for (int64_t j = 0; j < now.cols; ++j) now.weights[r * now.cols + j] += 1.0f + k;
        now.state[r * now.state_width] += 0.5f;
      }
      now.step += 3;
      now.applied_ids.push_back(100 + k);
      now.applied_unix_ms.push_back(1000 + k);
    }
    auto dir = MakeCheckpointDir(c.root, "c", 1, 5000 + k);
    EXPECT_TRUE(dir.ok());
    ember::v1::CheckpointManifest m;
    m.set_format_version(kFormatVersion);
    m.mutable_info()->set_collection("c");
    m.mutable_info()->set_created_unix_ms(5000 + k);
    if (k > 0) m.mutable_info()->set_base(c.dirs.back().substr(c.dirs.back().rfind('/') + 1));
    m.mutable_spec()->set_name("c");
    m.mutable_spec()->add_tables()->set_name("t");
    m.mutable_plan()->add_tables()->set_table("t");
    auto e = WriteShardFile(*dir, Ref("t", 0), k == 0 ? now : DeltaOf(now, changed));
    EXPECT_TRUE(e.ok()) << e.status();
    e->set_lineage(77);
    e->set_generation(k + 1);
    if (k > 0) e->set_base_generation(k);
    *m.add_shards() = *e;
    EXPECT_TRUE(CommitManifest(*dir, m).ok());
    c.dirs.push_back(*dir);
    c.states.push_back(now);
    c.entries.push_back(*e);
  }
  return c;
}

void ExpectSame(const ShardData& a, const ShardData& b) {
  EXPECT_EQ(a.weights, b.weights);
  EXPECT_EQ(a.state, b.state);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.applied_ids, b.applied_ids);
  EXPECT_EQ(a.applied_unix_ms, b.applied_unix_ms);
}

TEST(IncrementalCheckpointTest, ChainReadsBackEachCheckpointExactly) {
  Chain c = WriteChain();
  EXPECT_TRUE(c.entries[1].delta());
  // Manifests with deltas are committed as version 2, whole ones as 1.
  EXPECT_EQ(ReadManifest(c.dirs[0])->format_version(), kFormatVersion);
  EXPECT_EQ(ReadManifest(c.dirs[2])->format_version(), kIncrementalFormatVersion);
  EXPECT_LT(c.entries[2].bytes(), c.entries[0].bytes());
  EXPECT_EQ(c.entries[2].file(), ShardFileName(Ref("t", 0), true));
  for (size_t k = 0; k < c.dirs.size(); ++k) {
    SCOPED_TRACE(k);
    int64_t read = 0;
    auto d = ReadShardChain(c.dirs[k], c.entries[k], c.root, &read);
    ASSERT_TRUE(d.ok()) << d.status();
    ExpectSame(*d, c.states[k]);
    int64_t want = 0;
    for (size_t j = 0; j <= k; ++j) want += c.entries[j].bytes();
    EXPECT_EQ(read, want);
    auto chain = CheckpointChain(c.dirs[k], c.root);
    ASSERT_TRUE(chain.ok()) << chain.status();
    EXPECT_EQ(chain->size(), k + 1);
    EXPECT_EQ(chain->back(), c.dirs[0]);
    // Verification covers every file of the chain.
    int64_t total = -1;
    ASSERT_TRUE(VerifyCheckpoint(c.dirs[k], [&](int64_t, int64_t t) { total = t; }).ok());
    EXPECT_EQ(total, want);
  }
}

TEST(IncrementalCheckpointTest, DamagedOrMissingLinksAreRefusedWithTheFileNamed) {
  {
    Chain c = WriteChain();
    const std::string delta = c.dirs[1] + "/" + c.entries[1].file();
    FlipByte(delta, 60);
    auto d = ReadShardChain(c.dirs[2], c.entries[2], c.root);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(d.status().message().find(delta), std::string::npos) << d.status();
    auto v = VerifyCheckpoint(c.dirs[2]);
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(v.status().message().find(delta), std::string::npos) << v.status();
  }
  {
    Chain c = WriteChain();
    ASSERT_TRUE(RemoveCheckpoint(c.dirs[0]).ok());  // the full base is gone
    auto d = ReadShardChain(c.dirs[2], c.entries[2], c.root);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(d.status().message().find("is missing"), std::string::npos) << d.status();
    EXPECT_EQ(CheckpointChain(c.dirs[2], c.root).status().code(), absl::StatusCode::kDataLoss);
  }
  {
    Chain c = WriteChain();
    ember::v1::CheckpointShard wrong = c.entries[2];
    wrong.set_base_generation(1);  // not the generation its base was taken at
    auto d = ReadShardChain(c.dirs[2], wrong, c.root);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(d.status().message().find("no matching shard"), std::string::npos) << d.status();
    wrong = c.entries[2];
    wrong.set_lineage(78);  // another shard's tracking
    EXPECT_EQ(ReadShardChain(c.dirs[2], wrong, c.root).status().code(), absl::StatusCode::kDataLoss);
  }
  {
    // A delta whose rows are not ascending is refused, not applied.
    Chain c = WriteChain();
    ShardData bad = DeltaOf(c.states[1], {3, 1});
    EXPECT_EQ(WriteShardFile(c.dirs[1], Ref("t", 0), bad).status().code(),
              absl::StatusCode::kInternal);
    ShardData base = c.states[0];
    EXPECT_EQ(ApplyDelta(bad, "x", &base).code(), absl::StatusCode::kDataLoss);
    ExpectSame(base, c.states[0]);
  }
}

TEST(IncrementalCheckpointTest, CompactionMakesTheNewestFullAndKeepsItsContents) {
  Chain c = WriteChain();
  auto written = CompactCheckpoint(c.dirs[2], c.root);
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(*written, ShardFileBytes(40, 6, 6, /*applied=*/4));  // one whole shard file
  auto m = ReadManifest(c.dirs[2]);
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->info().base().empty());
  ASSERT_EQ(m->shards_size(), 1);
  EXPECT_FALSE(m->shards(0).delta());
  EXPECT_EQ(m->shards(0).lineage(), 77u);
  EXPECT_EQ(m->shards(0).generation(), 3);
  // The delta stays until swept (a reader of the old manifest may want it).
  const std::string delta = c.dirs[2] + "/" + c.entries[2].file();
  struct stat st;
  EXPECT_EQ(stat(delta.c_str(), &st), 0);
  EXPECT_EQ(RemoveUnlistedShardFiles(c.dirs[2], absl::Hours(1)), 0);  // within its grace
  EXPECT_EQ(stat(delta.c_str(), &st), 0);
  EXPECT_EQ(RemoveUnlistedShardFiles(c.dirs[2], absl::ZeroDuration()), 1);
  EXPECT_NE(stat(delta.c_str(), &st), 0);
  EXPECT_EQ(RemoveUnlistedShardFiles(c.dirs[2], absl::ZeroDuration()), 0);
  // Its bases can go now.
  ASSERT_TRUE(RemoveCheckpoint(c.dirs[0]).ok());
  ASSERT_TRUE(RemoveCheckpoint(c.dirs[1]).ok());
  auto d = ReadShardChain(c.dirs[2], m->shards(0), c.root);
  ASSERT_TRUE(d.ok()) << d.status();
  ExpectSame(*d, c.states[2]);
  EXPECT_EQ(*CompactCheckpoint(c.dirs[2], c.root), 0);  // nothing left to do
}

TEST(RecutTest, AnyLayoutToAnyLayoutMatchesTheNaiveSlice) {
  const int64_t rows = 37, cols = 24;
  const std::vector<std::vector<Layout>> layouts = {
      {{0, 0, 37, 24}},                                     // table-wise
      {{0, 0, 13, 24}, {13, 0, 13, 24}, {26, 0, 11, 24}},   // row-wise on 3
      {{0, 0, 19, 24}, {19, 0, 18, 24}},                    // row-wise on 2
      {{0, 0, 37, 12}, {0, 12, 37, 12}},                    // column-wise on 2
      {{0, 0, 37, 8}, {0, 8, 37, 8}, {0, 16, 37, 8}},       // column-wise on 3
      {{0, 0, 20, 12}, {20, 0, 17, 12}, {0, 12, 20, 12}, {20, 12, 17, 12}},  // a grid
  };
  for (OptimizerType type : {OptimizerType::kSgd, OptimizerType::kAdagrad, OptimizerType::kAdam,
                             OptimizerType::kRowwiseAdagrad}) {
    const int64_t width = backend::OptimizerStateWidth(type, cols);
    // Row-wise Adagrad's accumulator is per row here (one value for every
    // column shard), so any re-cut must return it unchanged.
    const ShardData whole = Random(rows, cols, type == OptimizerType::kRowwiseAdagrad ? 1 : width,
                                   5, static_cast<uint32_t>(type) + 3);
    for (const auto& from : layouts) {
      std::vector<ember::v1::CheckpointShard> entries;
      std::vector<ShardData> datas;
      for (const Layout& l : from) {
        ember::v1::CheckpointShard e;
        e.set_file(absl::StrCat("s", entries.size()));
        e.set_row_offset(l.row_offset);
        e.set_col_offset(l.col_offset);
        e.set_rows(l.rows);
        e.set_cols(l.cols);
        entries.push_back(e);
        datas.push_back(Slice(whole, type, l));
      }
      for (const auto& to : layouts) {
        for (const Layout& l : to) {
          RecutTarget t(type, l.row_offset, l.col_offset, l.rows, l.cols);
          for (size_t i = 0; i < entries.size(); ++i) {
            if (Overlaps(entries[i], t)) {
              ASSERT_TRUE(CopyOverlap(entries[i], datas[i], &t).ok());
            }
          }
          ASSERT_TRUE(FinishTarget("t", &t).ok());
          const ShardData want = Slice(whole, type, l);
          EXPECT_EQ(t.weights, want.weights);
          EXPECT_EQ(t.state, want.state);
          EXPECT_EQ(t.step, 5);
        }
      }
    }
  }
}

TEST(RecutTest, RowwiseAccumulatorsOfDifferentColumnShardsAverageByWidth) {
  // Two column shards (8 and 24 columns) with accumulators 1 and 5, merged
  // into one 32-column shard: (1 * 8 + 5 * 24) / 32 = 4.
  ember::v1::CheckpointShard a, b;
  a.set_rows(1);
  a.set_cols(8);
  b.set_rows(1);
  b.set_cols(24);
  b.set_col_offset(8);
  ShardData da = Random(1, 8, 1, 2, 1), db = Random(1, 24, 1, 2, 2);
  da.state = {1.0f};
  db.state = {5.0f};
  RecutTarget t(OptimizerType::kRowwiseAdagrad, 0, 0, 1, 32);
  ASSERT_TRUE(CopyOverlap(a, da, &t).ok());
  ASSERT_TRUE(CopyOverlap(b, db, &t).ok());
  ASSERT_TRUE(FinishTarget("t", &t).ok());
  EXPECT_EQ(t.state[0], 4.0f);
}

TEST(RecutTest, GapsAndBadShapesAreRefused) {
  ember::v1::CheckpointShard a;
  a.set_rows(10);
  a.set_cols(8);
  const ShardData d = Random(10, 8, 16, 1, 1);  // Adam width for 8 columns
  RecutTarget t(OptimizerType::kAdam, 0, 0, 12, 8);  // 2 rows no source covers
  ASSERT_TRUE(CopyOverlap(a, d, &t).ok());
  EXPECT_EQ(FinishTarget("t", &t).code(), absl::StatusCode::kDataLoss);
  RecutTarget adagrad(OptimizerType::kAdagrad, 0, 0, 10, 8);  // width 8, the file has 16
  EXPECT_EQ(CopyOverlap(a, d, &adagrad).code(), absl::StatusCode::kDataLoss);
}

// Two sources over the same cells: the count of filled cells used to hide
// the rows neither held.
TEST(RecutTest, OverlappingSourcesAreRefused) {
  ember::v1::CheckpointShard a, b;
  a.set_rows(6);
  a.set_cols(8);
  a.set_file("a");
  b.set_rows(6);
  b.set_cols(8);
  b.set_file("b");  // rows [0, 6) again; rows [6, 12) in no source
  const ShardData d = Random(6, 8, 0, 1, 1);
  RecutTarget t(OptimizerType::kSgd, 0, 0, 12, 8);
  ASSERT_TRUE(CopyOverlap(a, d, &t).ok());
  const absl::Status s = CopyOverlap(b, d, &t);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("a and b both hold rows [0, 6) columns [0, 8)"), std::string::npos)
      << s;
  EXPECT_EQ(FinishTarget("t", &t).code(), absl::StatusCode::kDataLoss);
}

// A manifest's shards against its spec: inside the table, disjoint, covering.
TEST(CheckCoverageTest, DistinctRowsAndColumns) {
  auto manifest = [](std::vector<std::array<int64_t, 4>> blocks) {
    ember::v1::CheckpointManifest m;
    auto* t = m.mutable_spec()->add_tables();
    t->set_name("t");
    t->set_num_embeddings(10);
    t->set_embedding_dim(8);
    for (const auto& [r, c, rows, cols] : blocks) {
      auto* s = m.add_shards();
      s->mutable_ref()->set_table("t");
      s->set_row_offset(r);
      s->set_col_offset(c);
      s->set_rows(rows);
      s->set_cols(cols);
      s->set_file(absl::StrCat("s", r, "_", c));
    }
    return m;
  };
  EXPECT_TRUE(CheckCoverage(manifest({{0, 0, 5, 8}, {5, 0, 5, 8}})).ok());
  EXPECT_TRUE(CheckCoverage(manifest({{0, 0, 10, 4}, {0, 4, 10, 4}})).ok());
  struct Case {
    std::vector<std::array<int64_t, 4>> blocks;
    const char* needle;
  } bad[] = {
      {{{0, 0, 5, 8}, {0, 0, 5, 8}}, "overlap"},                    // same rows twice, equal area
      {{{0, 0, 6, 8}, {4, 0, 4, 8}}, "overlap"},
      {{{0, 0, 5, 8}}, "cover 40 of its 80 cells"},                 // a gap
      {{{0, 0, 5, 8}, {5, 0, 6, 8}}, "lies outside"},               // past the last row
      {{{0, 0, 10, 8}, {0, 0, 0, 8}, {-1, 0, 1, 8}}, "lies outside"},
      {{{0, 0, 10, 4}, {0, 4, 10, 5}}, "lies outside"},             // past the last column
      {{}, "cover 0 of its 80 cells"},
  };
  for (const Case& c : bad) {
    const absl::Status s = CheckCoverage(manifest(c.blocks));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.needle;
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s;
  }
}

// Request paths stay under the root: NUL and control bytes, "..", absolute
// paths elsewhere and links out of it are refused, with messages that do not
// depend on what exists outside.
TEST(ConfinedPathTest, KeepsRequestsUnderTheRoot) {
  char real[PATH_MAX];
  ASSERT_NE(realpath(TempDir().c_str(), real), nullptr);
  const std::string root = real;
  EXPECT_EQ(*ConfinedPath(root, ""), root);
  EXPECT_EQ(*ConfinedPath(root, "a/b"), root + "/a/b");
  EXPECT_EQ(*ConfinedPath(root, "./a//b/"), root + "/a/b");
  EXPECT_EQ(*ConfinedPath(root, root + "/x"), root + "/x");
  EXPECT_EQ(*ConfinedPath(root + "/", root), root);
  struct Case {
    std::string path, needle;
  } refused[] = {
      {std::string("a\0b", 3), "NUL or control byte"},
      {"a\nb", "NUL or control byte"},
      {"../x", "'..' component"},
      {root + "/../x", "'..' component"},
      {"a/../../x", "'..' component"},
      {"/var/tmp/x", "outside this server's checkpoint root"},
      {"/", "outside this server's checkpoint root"},
      {root + "x", "outside this server's checkpoint root"},  // a sibling sharing a prefix
  };
  for (const Case& c : refused) {
    auto p = ConfinedPath(root, c.path);
    ASSERT_FALSE(p.ok()) << c.path;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << c.path;
    EXPECT_NE(p.status().message().find(c.needle), std::string::npos) << p.status();
  }
  // A link inside the root to a directory outside it.
  const std::string outside = TempDir();
  ASSERT_EQ(symlink(outside.c_str(), (root + "/link").c_str()), 0);
  EXPECT_EQ(ConfinedPath(root, "link/ckpt").status().code(), absl::StatusCode::kInvalidArgument);
  // Existing or not, a directory outside gets the same words.
  auto a = ConfinedPath(root, outside);
  auto b = ConfinedPath(root, outside + "-absent");
  ASSERT_FALSE(a.ok());
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(std::string(b.status().message()),
            absl::StrReplaceAll(a.status().message(), {{outside, outside + "-absent"}}));
  // No root configured: no path is accepted.
  EXPECT_EQ(ConfinedPath("", "x").status().code(), absl::StatusCode::kFailedPrecondition);
}

// A NUL byte once made the name search retry forever (the truncated path
// always existed); now it is refused at once, and the search is bounded.
TEST(MakeCheckpointDirTest, RefusesNulAndGivesUp) {
  const std::string root = TempDir();
  EXPECT_EQ(MakeCheckpointDir(std::string("x\0y", 3), "c", 1, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeCheckpointDir(root, std::string("c\0", 2), 1, 1000).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (int n = 0; n < 1000; ++n) {
    ASSERT_EQ(mkdir(absl::StrCat(root, "/c").c_str(), 0755) == 0 || errno == EEXIST, true);
    ASSERT_EQ(mkdir(absl::StrCat(root, "/c/ckpt-", 1000 + n, "-e1").c_str(), 0755), 0);
  }
  EXPECT_EQ(MakeCheckpointDir(root, "c", 1, 1000).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(MakeCheckpointDir(root, "c", 1, 5000).ok());
}

}  // namespace
}  // namespace checkpoint
}  // namespace ember
