// key_value shards over the CPU backend (and the CUDA backend's kernels,
// emulated) against the independent reference
// the issue names: the same shard held whole in memory (the fused kernel,
// a plain CPU backend), driven by the same calls. Lookups and final rows
// must equal it bit for bit under every optimizer and pooling, with a
// cache far smaller than the shard (so rows leave it and come back from
// the file many times). Then the cache's own counters against a sequence
// worked by hand, bad input and bad specs, a full disk (the process's file
// size limit) in a write-back and at creation, imports and exports through
// the cache, and concurrent callers against a count of their updates.
#include "server/backend/key_value/key_value_backend.h"
#include "server/backend/overflow_guard.h"

#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/forwarding_backend.h"

namespace ember {
namespace backend {
namespace {

std::string TempDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

std::unique_ptr<EmbeddingBackend> Cpu(int threads = 1) {
  CpuBackendOptions o;
  o.num_threads = threads;
  auto b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

std::unique_ptr<EmbeddingBackend> KeyValue(int64_t capacity = 0, int threads = 1) {
  KeyValueOptions o;
  o.dir = TempDir();
  o.capacity_bytes = capacity;
  return WithKeyValueShards(Cpu(threads), o);
}

ShardSpec Spec(OptimizerType opt, int64_t rows, int64_t dim, int64_t cache_rows) {
  ShardSpec s;
  s.table = "t";
  s.rows = rows;
  s.dim = dim;
  s.row_offset = 3;  // a row-wise shard: initial values by the global row
  s.table_rows = rows + 10;
  s.optimizer.type = opt;
  s.optimizer.learning_rate = 0.05f;
  if (opt == OptimizerType::kAdagrad || opt == OptimizerType::kRowwiseAdagrad) {
    s.optimizer.initial_accumulator_value = 0.1f;
  }
  if (opt == OptimizerType::kAdam) s.optimizer.weight_decay = 0.01f;
  s.initializer.seed = 11;
  s.cache_rows = cache_rows;
  return s;
}

ShardSpec Fused(ShardSpec s) {
  s.cache_rows = 0;
  s.host_mapped = false;
  return s;
}

// One batch: `bags` bags of 0-4 ids over `distinct` rows drawn skewed
// (low rows far more often), weights when pooled.
struct Batch {
  std::vector<int64_t> lengths, ids;
  std::vector<float> weights;
};
Batch MakeBatch(std::mt19937_64& rng, int64_t rows, int64_t bags, bool weighted) {
  Batch b;
  std::uniform_int_distribution<int64_t> len(0, 4);
  std::uniform_real_distribution<double> u(0, 1);
  for (int64_t i = 0; i < bags; ++i) {
    b.lengths.push_back(len(rng));
    for (int64_t k = 0; k < b.lengths.back(); ++k) {
      b.ids.push_back(static_cast<int64_t>(static_cast<double>(rows) * std::pow(u(rng), 3.0)) %
                      rows);
      if (weighted) b.weights.push_back(static_cast<float>(u(rng) + 0.5));
    }
  }
  return b;
}

FeatureRequest Feature(ShardId id, Pooling p, const Batch& b) {
  FeatureRequest f;
  f.shard = id;
  f.pooling = p;
  f.lengths = b.lengths;
  f.ids = b.ids;
  if (p != Pooling::kNone) f.weights = b.weights;
  return f;
}

int64_t OutRows(Pooling p, const Batch& b) {
  return p == Pooling::kNone ? static_cast<int64_t>(b.ids.size())
                             : static_cast<int64_t>(b.lengths.size());
}

std::vector<float> LookupOf(EmbeddingBackend& be, ShardId id, Pooling p, const Batch& b,
                            int64_t dim, absl::Status* status = nullptr) {
  std::vector<float> out(OutRows(p, b) * dim, -1.0f);
  LookupRequest r;
  r.feature = Feature(id, p, b);
  r.output = absl::MakeSpan(out);
  absl::Status s = be.Lookup({r});
  if (status != nullptr) {
    *status = s;
  } else {
    EXPECT_TRUE(s.ok()) << s;
  }
  return out;
}

absl::Status Update(EmbeddingBackend& be, ShardId id, Pooling p, const Batch& b, int64_t dim,
                    std::mt19937_64& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> grad(OutRows(p, b) * dim);
  for (float& x : grad) x = g(rng);
  GradientRequest r;
  r.feature = Feature(id, p, b);
  r.grad = grad;
  return be.ApplyGradients({r});
}

struct AllRows {
  std::vector<float> w, st;
};
AllRows Export(const EmbeddingBackend& be, ShardId id, const ShardSpec& spec) {
  AllRows a;
  a.w.resize(spec.rows * spec.dim);
  a.st.resize(spec.rows * OptimizerStateWidth(spec.optimizer.type, spec.dim));
  absl::Status s = be.ExportRows(id, 0, spec.rows, absl::MakeSpan(a.w), absl::MakeSpan(a.st));
  EXPECT_TRUE(s.ok()) << s;
  return a;
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

// Every row and its optimizer state of key_value shard `kid` against the
// same shard held whole in memory (`fid` of `fused`), bit for bit, each
// read once.
void ExpectSameShard(const EmbeddingBackend& kv, ShardId kid, const EmbeddingBackend& fused,
                     ShardId fid, const ShardSpec& spec) {
  const AllRows got = Export(kv, kid, spec);
  const AllRows want = Export(fused, fid, Fused(spec));
  ExpectSameBits(got.w, want.w, "weights");
  ExpectSameBits(got.st, want.st, "state");
}

struct ParityCase {
  OptimizerType opt;
  Pooling pooling;
  WeightType type;
  bool emulated_cuda = false;  // the CUDA backend's kernels (emulated) under both
  // fused_uvm_caching: the rows below the cache in a fused_uvm shard (host
  // memory the GPU maps) instead of a file; emulated CUDA under both.
  bool over_host = false;
};

std::unique_ptr<EmbeddingBackend> Under(const ParityCase& c) {
  return c.emulated_cuda || c.over_host ? CreateEmulatedCudaBackend() : Cpu();
}

class KeyValueParityTest : public ::testing::TestWithParam<ParityCase> {};

TEST_P(KeyValueParityTest, EqualsTheShardHeldWholeInMemoryBitForBit) {
  const ParityCase c = GetParam();
  ShardSpec spec = Spec(c.opt, 300, 12, 48);
  spec.weight_type = c.type;
  spec.optimizer.stochastic_rounding = false;
  spec.host_mapped = c.over_host;
  auto fused = Under(c);
  KeyValueOptions o;
  o.dir = TempDir();
  auto kv = WithKeyValueShards(Under(c), o);
  auto fid = fused->CreateShard(Fused(spec));
  auto kid = kv->CreateShard(spec);
  ASSERT_TRUE(fid.ok() && kid.ok()) << fid.status() << kid.status();
  std::mt19937_64 rng(static_cast<uint64_t>(c.opt) * 7 + static_cast<uint64_t>(c.pooling));
  for (int step = 0; step < 40; ++step) {
    const Batch b = MakeBatch(rng, spec.rows, 6, c.pooling != Pooling::kNone);
    ExpectSameBits(LookupOf(*kv, *kid, c.pooling, b, spec.dim),
                   LookupOf(*fused, *fid, c.pooling, b, spec.dim),
                   "lookup of step " + std::to_string(step));
    std::mt19937_64 g1(step), g2(step);
    ASSERT_TRUE(Update(*fused, *fid, c.pooling, b, spec.dim, g1).ok());
    ASSERT_TRUE(Update(*kv, *kid, c.pooling, b, spec.dim, g2).ok());
  }
  const AllRows want = Export(*fused, *fid, Fused(spec));
  const AllRows got = Export(*kv, *kid, spec);
  ExpectSameBits(got.w, want.w, "weights");
  ExpectSameBits(got.st, want.st, "optimizer state");
  EXPECT_EQ(*kv->ExportStep(*kid), *fused->ExportStep(*fid));
  auto stats = kv->GetTierStats(*kid);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_GT(stats->write_backs, 0);  // rows did leave the cache changed
  EXPECT_GT(stats->disk_reads, 0);   // and came back from the file (or host memory)
  EXPECT_EQ(stats->cached_rows, 48);
  EXPECT_EQ(stats->file_bytes > 0, !c.over_host);
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, KeyValueParityTest,
    ::testing::Values(
        ParityCase{OptimizerType::kSgd, Pooling::kSum, WeightType::kFp32},
        ParityCase{OptimizerType::kAdagrad, Pooling::kMean, WeightType::kFp32},
        ParityCase{OptimizerType::kRowwiseAdagrad, Pooling::kSum, WeightType::kFp32},
        ParityCase{OptimizerType::kAdam, Pooling::kNone, WeightType::kFp32},
        ParityCase{OptimizerType::kAdam, Pooling::kMean, WeightType::kFp32},
        ParityCase{OptimizerType::kRowwiseAdagrad, Pooling::kSum, WeightType::kFp16},
        ParityCase{OptimizerType::kSgd, Pooling::kNone, WeightType::kBf16},
        ParityCase{OptimizerType::kRowwiseAdagrad, Pooling::kSum, WeightType::kFp32, true},
        ParityCase{OptimizerType::kAdam, Pooling::kMean, WeightType::kFp32, true},
        ParityCase{OptimizerType::kAdagrad, Pooling::kNone, WeightType::kFp16, true},
        ParityCase{OptimizerType::kSgd, Pooling::kSum, WeightType::kFp32, false, true},
        ParityCase{OptimizerType::kAdam, Pooling::kMean, WeightType::kFp32, false, true},
        ParityCase{OptimizerType::kRowwiseAdagrad, Pooling::kNone, WeightType::kFp16, false, true},
        ParityCase{OptimizerType::kAdagrad, Pooling::kSum, WeightType::kBf16, false, true}));

// Records what a backend is asked to create and drop (the emulated CUDA
// backend below: it maps host memory).
class Recording : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::StatusOr<ShardId> CreateShard(const ShardSpec& spec) override {
    auto id = inner()->CreateShard(spec);
    if (id.ok()) made[*id] = spec;
    return id;
  }
  absl::Status DropShard(ShardId id) override {
    made.erase(id);
    return inner()->DropShard(id);
  }
  std::map<ShardId, ShardSpec> made;
};

// fused_uvm_caching: a cache shard in device memory and a fused_uvm shard
// of every row below it, both in the wrapped backend and both dropped with
// it; refused over a backend that maps no host memory, and needs no SSD.
TEST(KeyValueBackendTest, FusedUvmCachingCachesOverAFusedUvmShard) {
  auto owned = std::make_unique<Recording>(CreateEmulatedCudaBackend());
  Recording* rec = owned.get();
  auto kv = WithKeyValueShards(std::move(owned), KeyValueOptions());  // no SSD directory
  EXPECT_TRUE(kv->CachesOverHostMemory());
  ShardSpec spec = Spec(OptimizerType::kAdagrad, 100, 8, 10);
  spec.host_mapped = true;
  auto id = kv->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(rec->made.size(), 2u);
  const ShardSpec& cache = rec->made.at(*id);
  EXPECT_EQ(cache.rows, 10);
  EXPECT_FALSE(cache.host_mapped);
  EXPECT_EQ(cache.cache_rows, 0);
  for (const auto& [made_id, made_spec] : rec->made) {
    if (made_id == *id) continue;
    EXPECT_EQ(made_spec.rows, 100);  // every row, a record each: no log's slack
    EXPECT_TRUE(made_spec.host_mapped);
    EXPECT_EQ(made_spec.cache_rows, 0);
  }
  EXPECT_TRUE(kv->GetShardSpec(*id)->host_mapped);
  // Rows read before any update are the initial values, as in a shard held
  // whole...
  auto fused = CreateEmulatedCudaBackend();
  auto fid = fused->CreateShard(Fused(spec));
  ASSERT_TRUE(fid.ok());
  const AllRows want = Export(*fused, *fid, Fused(spec));
  const AllRows got = Export(*kv, *id, spec);
  ExpectSameBits(got.w, want.w, "initial weights");
  ExpectSameBits(got.st, want.st, "initial state");
  // ...read from the fused_uvm shard, not made by the wrapper: values
  // written there straight are what the table's rows read.
  ShardId backing = -1;
  for (const auto& [made_id, made_spec] : rec->made) {
    if (made_id != *id) backing = made_id;
  }
  std::vector<float> w(100 * 8), st(100 * 8, 0.5f);
  for (size_t k = 0; k < w.size(); ++k) w[k] = 7.0f + static_cast<float>(k % 13);
  ASSERT_TRUE(rec->ImportRows(backing, 0, 100, w, st).ok());
  const AllRows written = Export(*kv, *id, spec);
  ExpectSameBits(written.w, w, "weights written to the fused_uvm shard");
  ExpectSameBits(written.st, st, "state written to the fused_uvm shard");
  ASSERT_TRUE(kv->DropShard(*id).ok());
  EXPECT_TRUE(rec->made.empty());
  // Over a backend that maps no host memory.
  auto cpu = WithKeyValueShards(Cpu(), KeyValueOptions());
  EXPECT_FALSE(cpu->CachesOverHostMemory());
  const auto refused = cpu->CreateShard(spec);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("needs a CUDA worker"), std::string::npos)
      << refused.status();
  // Without the wrapper.
  EXPECT_EQ(CreateEmulatedCudaBackend()->CreateShard(spec).status().code(),
            absl::StatusCode::kInvalidArgument);
}

Batch Ids(std::vector<int64_t> ids) {
  Batch b;
  b.ids = std::move(ids);
  b.lengths.assign(b.ids.size(), 1);
  return b;
}

// The file is a log (rows + half again as records): every write-back goes
// to a record not live, ahead of a cursor. 300 steps over 64 rows with a
// cache of 8 take the cursor round the 96 records dozens of times; the
// rows still equal the table in memory bit for bit.
TEST(KeyValueBackendTest, RowsSurviveManyTurnsOfTheLog) {
  const ShardSpec spec = Spec(OptimizerType::kAdam, 64, 8, 8);
  auto fused = Cpu();
  auto kv = KeyValue();
  auto fid = fused->CreateShard(Fused(spec));
  auto kid = kv->CreateShard(spec);
  ASSERT_TRUE(fid.ok() && kid.ok()) << kid.status();
  std::mt19937_64 rng(9);
  for (int step = 0; step < 300; ++step) {
    std::vector<int64_t> ids;
    for (int k = 0; k < 6; ++k) ids.push_back(static_cast<int64_t>(rng() % 64));
    const Batch b = Ids(ids);
    std::mt19937_64 g1(step), g2(step);
    ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, b, 8, g1).ok());
    ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, b, 8, g2).ok());
  }
  const TierStats t = *kv->GetTierStats(*kid);
  EXPECT_GT(t.write_backs, 96 * 10);  // the cursor went round at least ten times
  EXPECT_GT(t.disk_reads, 96 * 10);
  ExpectSameShard(*kv, *kid, *fused, *fid, spec);
}

// A cache of 2 rows; the CLOCK worked by hand.
TEST(KeyValueBackendTest, CountersFollowTheClock) {
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kSgd, 10, 4, 2);
  auto id = kv->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  LookupOf(*kv, *id, Pooling::kSum, Ids({0, 1, 0}),
           4);  // fills 0 -> slot 0, 1 -> slot 1
  TierStats s = *kv->GetTierStats(*id);
  EXPECT_EQ(s.fills, 2);
  EXPECT_EQ(s.hits, 0);
  std::mt19937_64 rng(1);
  ASSERT_TRUE(Update(*kv, *id, Pooling::kSum, Ids({0}), 4, rng).ok());  // a hit; row 0 changed
  const std::vector<float> row0 = LookupOf(*kv, *id, Pooling::kSum, Ids({0}), 4);
  s = *kv->GetTierStats(*id);
  EXPECT_EQ(s.hits, 2);
  // Row 2: the hand clears both used bits, then takes slot 0 (row 0,
  // changed): one write-back, one eviction, no read (row 2 never written).
  LookupOf(*kv, *id, Pooling::kSum, Ids({2}), 4);
  s = *kv->GetTierStats(*id);
  EXPECT_EQ(s.fills, 3);
  EXPECT_EQ(s.write_backs, 1);
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(s.disk_reads, 0);
  // Row 0 comes back from the file as it was updated: slot 1 (row 1,
  // unchanged) goes, without a write.
  ExpectSameBits(LookupOf(*kv, *id, Pooling::kSum, Ids({0}), 4), row0, "row 0 read back");
  s = *kv->GetTierStats(*id);
  EXPECT_EQ(s.disk_reads, 1);
  EXPECT_EQ(s.write_backs, 1);
  EXPECT_EQ(s.evictions, 2);
  EXPECT_EQ(s.cached_rows, 2);
  EXPECT_EQ(s.cache_rows, 2);
  EXPECT_EQ(s.file_bytes, KeyValueFileBytes(spec));
  EXPECT_EQ(s.file_bytes, (10 + 5) * 512);  // 16-byte rows padded to a sector; half again as slack
}

// The learned curve counts each call's distinct rows once, lookups and
// updates alike: rows 1, 2, 3, then 1 and 1 again in one call, then 3.
// Row 1's second access has rows 2 and 3 since (distance 2): it hits an
// LRU of 3 rows (0.3 of 10) and more, not of 1 or 2 rows. Row 3's has
// row 1 since (distance 1): hits from 2 rows (0.2) up.
TEST(KeyValueBackendTest, TheLearnedCurveCountsEachCallsRowsOnce) {
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kSgd, 10, 4, 2);
  auto id = kv->CreateShard(spec);
  ASSERT_TRUE(id.ok());
  std::mt19937_64 rng(1);
  LookupOf(*kv, *id, Pooling::kSum, Ids({1}), 4);
  ASSERT_TRUE(Update(*kv, *id, Pooling::kSum, Ids({2}), 4, rng).ok());
  LookupOf(*kv, *id, Pooling::kSum, Ids({3}), 4);
  LookupOf(*kv, *id, Pooling::kSum, Ids({1, 1}), 4);
  ASSERT_TRUE(Update(*kv, *id, Pooling::kSum, Ids({3}), 4, rng).ok());
  const TierStats s = *kv->GetTierStats(*id);
  EXPECT_EQ(s.sampled, 5);
  //                           1%  2%  5% 10% 20% 30% 50% 75% 100% (of 10 rows)
  const std::array<int64_t, 9> want = {0, 0, 0, 0, 1, 2, 2, 2, 2};
  EXPECT_EQ(s.curve_hits, want);
}

absl::StatusOr<int64_t> Prefetch(EmbeddingBackend& be, ShardId id,
                                 const std::vector<int64_t>& ids) {
  FeatureRequest f;
  f.shard = id;
  f.ids = ids;
  return be.Prefetch({f});
}

// A prefetch brings a call's rows in ahead of it, worked by hand on a
// cache of 4: the next call finds them (hits, no fills); rows it finds
// cached are kept for it, and the rows past the cache's room are left out.
// Nothing it does changes a value: a second backend without prefetches
// (the shard whole in memory) gives the same lookups and rows bit for bit
// through updates, write-backs and reads.
TEST(KeyValueBackendTest, PrefetchBringsTheNextCallsRowsIn) {
  auto kv = KeyValue();
  auto fused = Cpu();
  const ShardSpec spec = Spec(OptimizerType::kAdagrad, 20, 4, 4);
  auto id = kv->CreateShard(spec);
  auto fid = fused->CreateShard(Fused(spec));
  ASSERT_TRUE(id.ok() && fid.ok());
  std::mt19937_64 rk(7), rf(7);
  auto both_update = [&](const Batch& b) {
    ASSERT_TRUE(Update(*kv, *id, Pooling::kSum, b, 4, rk).ok());
    ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, b, 4, rf).ok());
  };
  auto same_lookup = [&](const Batch& b, const std::string& what) {
    ExpectSameBits(LookupOf(*kv, *id, Pooling::kSum, b, 4), LookupOf(*fused, *fid, Pooling::kSum, b, 4),
                   what);
  };
  // Rows 5, 6, 7 (5 twice): three fills, counted as prefetched; no hit and
  // nothing learned (the call that uses them counts them).
  auto brought = Prefetch(*kv, *id, {5, 6, 5, 7});
  ASSERT_TRUE(brought.ok()) << brought.status();
  EXPECT_EQ(*brought, 3);
  TierStats t = *kv->GetTierStats(*id);
  EXPECT_EQ(t.fills, 3);
  EXPECT_EQ(t.prefetched, 3);
  EXPECT_EQ(t.hits, 0);
  EXPECT_EQ(t.sampled, 0);
  EXPECT_EQ(t.cached_rows, 3);
  both_update(Ids({5, 6, 7}));  // all three hit; they are now changed
  t = *kv->GetTierStats(*id);
  EXPECT_EQ(t.hits, 3);
  EXPECT_EQ(t.fills, 3);
  // Row 5 is cached and kept for the prefetch; the cache has room for 3
  // more beside it: 8, 9, 10 come in (6 and 7 go, written back), 11 is
  // left out.
  brought = Prefetch(*kv, *id, {5, 8, 9, 10, 11});
  ASSERT_TRUE(brought.ok()) << brought.status();
  EXPECT_EQ(*brought, 3);
  t = *kv->GetTierStats(*id);
  EXPECT_EQ(t.prefetched, 6);
  EXPECT_EQ(t.write_backs, 2);
  EXPECT_EQ(t.cached_rows, 4);
  same_lookup(Ids({5, 8, 9, 10}), "the prefetched rows");
  t = *kv->GetTierStats(*id);
  EXPECT_EQ(t.hits, 3 + 4);
  EXPECT_EQ(t.fills, 6);
  // 6 and 7 come back from the file as they were updated.
  same_lookup(Ids({6, 7}), "rows written back by a prefetch's fills");
  EXPECT_EQ(kv->GetTierStats(*id)->disk_reads, 2);
  // A prefetch of rows all cached brings nothing.
  brought = Prefetch(*kv, *id, {6, 7});
  ASSERT_TRUE(brought.ok());
  EXPECT_EQ(*brought, 0);
  // Bad input: an id outside the shard, after ids that would fill, brings
  // nothing in; an unknown shard is refused.
  const int64_t fills = kv->GetTierStats(*id)->fills;
  auto bad = Prefetch(*kv, *id, {1, 2, 20});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("prefetch request 0"), std::string::npos) << bad.status();
  bad = Prefetch(*kv, *id, {-1});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_EQ(kv->GetTierStats(*id)->fills, fills);
  EXPECT_FALSE(Prefetch(*kv, *id + 1000, {1}).ok());
  // Rows made and updated after all this equal the shard held whole.
  for (int step = 0; step < 20; ++step) {
    Batch b = Ids({step % 20, (step * 7) % 20, (step * 3 + 1) % 20});
    ASSERT_TRUE(Prefetch(*kv, *id, b.ids).ok());
    both_update(b);
    same_lookup(Ids({(step * 5) % 20, (step * 11 + 2) % 20}), absl::StrCat("step ", step));
  }
  ExpectSameShard(*kv, *id, *fused, *fid, spec);
}

// A shard held whole in memory beside a key_value one: the wrapped backend
// checks its ids and brings nothing in; one call takes both.
TEST(KeyValueBackendTest, PrefetchOfAShardInMemoryChecksItsIdsOnly) {
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kSgd, 20, 4, 4);
  auto cached = kv->CreateShard(spec);
  auto whole = kv->CreateShard(Fused(spec));
  ASSERT_TRUE(cached.ok() && whole.ok());
  FeatureRequest a, b;
  const std::vector<int64_t> ids = {1, 2}, outside = {20};
  a.shard = *cached;
  a.ids = ids;
  b.shard = *whole;
  b.ids = ids;
  auto brought = kv->Prefetch({a, b});
  ASSERT_TRUE(brought.ok()) << brought.status();
  EXPECT_EQ(*brought, 2);
  b.ids = outside;
  a.ids = {};
  auto bad = kv->Prefetch({a, b});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("prefetch request 1"), std::string::npos) << bad.status();
  auto plain = Cpu();
  auto pid = plain->CreateShard(Fused(spec));
  ASSERT_TRUE(pid.ok());
  FeatureRequest c;
  c.shard = *pid;
  c.ids = ids;
  brought = plain->Prefetch({c});
  ASSERT_TRUE(brought.ok());
  EXPECT_EQ(*brought, 0);
  c.ids = outside;
  EXPECT_EQ(plain->Prefetch({c}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KeyValueBackendTest, RefusesBadInputAndChangesNothing) {
  auto fused = Cpu();
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kAdagrad, 50, 4, 4);
  auto kid = kv->CreateShard(spec);
  auto fid = fused->CreateShard(Fused(spec));
  ASSERT_TRUE(kid.ok() && fid.ok());
  std::mt19937_64 rng(2);
  absl::Status s;
  // An id out of range, after ids that would fill: nothing is filled.
  LookupOf(*kv, *kid, Pooling::kSum, Ids({1, 2, 50}), 4, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  LookupOf(*kv, *kid, Pooling::kSum, Ids({-1}), 4, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(kv->GetTierStats(*kid)->fills, 0);
  // More distinct rows in one bag than the cache holds (a lookup).
  Batch five;
  five.ids = {1, 2, 3, 4, 5};
  five.lengths = {5};
  LookupOf(*kv, *kid, Pooling::kSum, five, 4, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(kv->GetTierStats(*kid)->fills, 0);
  // A NaN gradient after a fill: the fill stays (the row unchanged), nothing
  // applied.
  Batch b = Ids({7, 8});
  std::vector<float> grad(2 * 4, 1.0f);
  grad[5] = std::nanf("");
  GradientRequest g;
  g.feature = Feature(*kid, Pooling::kSum, b);
  g.grad = grad;
  EXPECT_EQ(kv->ApplyGradients({g}).code(), absl::StatusCode::kInvalidArgument);
  // Keys and device memory are not for key_value shards.
  LookupRequest r;
  r.feature = Feature(*kid, Pooling::kSum, b);
  r.feature.keyed = true;
  std::vector<float> out(2 * 4);
  r.output = absl::MakeSpan(out);
  EXPECT_EQ(kv->Lookup({r}).code(), absl::StatusCode::kInvalidArgument);
  // Export / import ranges outside the shard.
  std::vector<float> w(4), st(4);
  EXPECT_EQ(kv->ExportRows(*kid, 50, 51, absl::MakeSpan(w), absl::MakeSpan(st)).code(),
            absl::StatusCode::kInvalidArgument);
  w[0] = std::nanf("");
  EXPECT_EQ(kv->ImportRows(*kid, 0, 1, w, st).code(), absl::StatusCode::kInvalidArgument);
  // Everything is as on the reference, which saw none of it.
  const AllRows want = Export(*fused, *fid, Fused(spec));
  const AllRows got = Export(*kv, *kid, spec);
  ExpectSameBits(got.w, want.w, "weights");
  ExpectSameBits(got.st, want.st, "state");
  EXPECT_EQ(*kv->ExportStep(*kid), 0);
}

TEST(KeyValueBackendTest, RefusesBadSpecs) {
  auto kv = KeyValue();
  ShardSpec s = Spec(OptimizerType::kSgd, 10, 4, 11);
  EXPECT_EQ(kv->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.cache_rows = -1;
  EXPECT_EQ(kv->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.cache_rows = 2;
  s.weight_type = WeightType::kFp16;  // stochastic rounding on
  EXPECT_EQ(kv->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.weight_type = WeightType::kFp32;
  s.is_dynamic = true;
  EXPECT_EQ(kv->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.is_dynamic = false;
  s.dim = 0;
  EXPECT_EQ(kv->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  s.dim = 4;
  // A backend without the wrapper, or without a directory, refuses it.
  EXPECT_EQ(Cpu()->CreateShard(s).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WithKeyValueShards(Cpu(), KeyValueOptions())->CreateShard(s).status().code(),
            absl::StatusCode::kFailedPrecondition);
  KeyValueOptions nowhere;
  nowhere.dir = TempDir() + "/no/such/dir";
  EXPECT_EQ(WithKeyValueShards(Cpu(), nowhere)->CreateShard(s).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // The SSD capacity: two shards of 160 bytes fit in 320, a third does not,
  // and dropping one makes room.
  auto small = KeyValue(2 * KeyValueFileBytes(s));
  auto a = small->CreateShard(s);
  auto b = small->CreateShard(s);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(small->CreateShard(s).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(small->DropShard(*a).ok());
  EXPECT_TRUE(small->CreateShard(s).ok());
  // Tier counters are for key_value shards.
  auto fixed = small->CreateShard(Fused(s));
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(small->GetTierStats(*fixed).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(small->GetTierStats(99).status().code(), absl::StatusCode::kNotFound);
}

// The process's file size limit stands in for a full disk: a write past it
// fails with EFBIG, as a write to a full disk fails with ENOSPC.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    std::signal(SIGXFSZ, SIG_IGN);
    getrlimit(RLIMIT_FSIZE, &old_);
    rlimit l = old_;
    l.rlim_cur = bytes;
    EXPECT_EQ(setrlimit(RLIMIT_FSIZE, &l), 0);
  }
  ~FileSizeLimit() { setrlimit(RLIMIT_FSIZE, &old_); }

 private:
  rlimit old_;
};

TEST(KeyValueBackendTest, AFullDiskRefusesTheCallAndLosesNothing) {
  auto fused = Cpu();
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kRowwiseAdagrad, 4096, 8, 4);
  {
    FileSizeLimit full(256);  // less than the shard's file
    EXPECT_EQ(kv->CreateShard(spec).status().code(), absl::StatusCode::kResourceExhausted);
  }
  auto kid = kv->CreateShard(spec);
  auto fid = fused->CreateShard(Fused(spec));
  ASSERT_TRUE(kid.ok() && fid.ok()) << kid.status();
  std::mt19937_64 g1(3), g2(3);
  const Batch hot = Ids({4000, 4001, 4002, 4003});  // cached, then changed
  ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, hot, 8, g1).ok());
  ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, hot, 8, g2).ok());
  {
    FileSizeLimit full(256);  // not even the first record can be written
    absl::Status s;
    // New rows need the changed ones written back: refused, as a full disk.
    LookupOf(*kv, *kid, Pooling::kSum, Ids({1, 2}), 8, &s);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_EQ(kv->GetTierStats(*kid)->write_backs, 0);
    // The cached rows still serve, updates of them too.
    ExpectSameBits(LookupOf(*kv, *kid, Pooling::kSum, hot, 8),
                   LookupOf(*fused, *fid, Pooling::kSum, hot, 8), "cached rows on a full disk");
    ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, hot, 8, g1).ok());
    ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, hot, 8, g2).ok());
  }
  // Room again: the same call goes through and nothing was lost.
  ExpectSameBits(LookupOf(*kv, *kid, Pooling::kSum, Ids({1, 2}), 8),
                 LookupOf(*fused, *fid, Pooling::kSum, Ids({1, 2}), 8), "after the disk freed");
  ExpectSameShard(*kv, *kid, *fused, *fid, spec);
  EXPECT_EQ(kv->GetTierStats(*kid)->write_backs, 2);
}

TEST(KeyValueBackendTest, ImportsAndExportsGoThroughTheCache) {
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kAdam, 64, 4, 8);
  auto kid = kv->CreateShard(spec);
  ASSERT_TRUE(kid.ok());
  std::mt19937_64 rng(4);
  ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, Ids({5, 6, 7}), 4, rng).ok());  // cached, changed
  // Import every row: cached ones and the rest alike.
  std::vector<float> w(64 * 4), st(64 * 8);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.5f;
  for (size_t i = 0; i < st.size(); ++i) st[i] = static_cast<float>(i % 7);
  ASSERT_TRUE(kv->ImportRows(*kid, 0, 64, w, st).ok());
  AllRows got = Export(*kv, *kid, spec);
  ExpectSameBits(got.w, w, "weights after an import");
  ExpectSameBits(got.st, st, "state after an import");
  // Lookups see the import, cached rows (5) and others (40).
  ExpectSameBits(LookupOf(*kv, *kid, Pooling::kNone, Ids({5, 40}), 4),
                 {w[20], w[21], w[22], w[23], w[160], w[161], w[162], w[163]}, "lookup");
  // Rows anywhere, a row at a time.
  std::vector<float> one(2 * 4), one_st(2 * 8);
  const std::vector<int64_t> rows = {63, 5};
  ASSERT_TRUE(kv->ExportRowsAt(*kid, rows, absl::MakeSpan(one), absl::MakeSpan(one_st)).ok());
  EXPECT_EQ(one[0], w[63 * 4]);
  EXPECT_EQ(one[4], w[5 * 4]);
  std::vector<float> put(2 * 4, 2.0f), put_st(2 * 8, 1.0f);
  ASSERT_TRUE(kv->ImportRowsAt(*kid, rows, put, put_st).ok());
  got = Export(*kv, *kid, spec);
  EXPECT_EQ(got.w[63 * 4], 2.0f);
  EXPECT_EQ(got.w[5 * 4], 2.0f);
  EXPECT_EQ(got.w[4 * 4], w[4 * 4]);
}

// Exports larger than one read of the file (4,096 records): the whole
// shard as a range and most of it as rows anywhere, in an order far from
// the file's, equal bit for bit to the shard held whole in memory. Every
// row is in the file (imported), a few also changed in the cache, and a
// few never written at all (their initial values).
TEST(KeyValueBackendTest, ExportsLargerThanOneReadComeBackInOrder) {
  constexpr int64_t kRows = 10000, kDim = 4;
  const ShardSpec spec = Spec(OptimizerType::kAdagrad, kRows, kDim, 16);
  auto fused = Cpu();
  auto kv = KeyValue();
  auto fid = fused->CreateShard(Fused(spec));
  auto kid = kv->CreateShard(spec);
  ASSERT_TRUE(fid.ok() && kid.ok()) << kid.status();
  const int64_t width = OptimizerStateWidth(spec.optimizer.type, kDim);
  const int64_t imported = kRows - 100;  // the last 100 rows never written
  std::vector<float> w(imported * kDim), st(imported * width);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 997) * 0.25f;
  for (size_t i = 0; i < st.size(); ++i) st[i] = static_cast<float>(i % 13);
  ASSERT_TRUE(fused->ImportRows(*fid, 0, imported, w, st).ok());
  ASSERT_TRUE(kv->ImportRows(*kid, 0, imported, w, st).ok());
  std::mt19937_64 g1(5), g2(5);
  const Batch b = Ids({3, 4999, 8000, 9950});
  ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, b, kDim, g1).ok());
  ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, b, kDim, g2).ok());
  ExpectSameShard(*kv, *kid, *fused, *fid, spec);
  std::vector<int64_t> rows(kRows);
  for (int64_t r = 0; r < kRows; ++r) rows[r] = r;
  std::shuffle(rows.begin(), rows.end(), std::mt19937_64(6));
  rows.resize(9000);
  std::vector<float> a(rows.size() * kDim), as(rows.size() * width);
  std::vector<float> c(a.size()), cs(as.size());
  ASSERT_TRUE(kv->ExportRowsAt(*kid, rows, absl::MakeSpan(a), absl::MakeSpan(as)).ok());
  ASSERT_TRUE(fused->ExportRowsAt(*fid, rows, absl::MakeSpan(c), absl::MakeSpan(cs)).ok());
  ExpectSameBits(a, c, "weights, rows anywhere");
  ExpectSameBits(as, cs, "state, rows anywhere");
}

// Rows anywhere in one batch: a mix of cached rows, rows in the file and
// rows never written, in any order, read and written as a shard held whole
// in memory reads and writes them (bit for bit); a row named twice or out
// of range, or a non-finite value, is refused with nothing written.
TEST(KeyValueBackendTest, RowsAnywhereGoThroughTheCacheAndTheFileInOneBatch) {
  auto kv = KeyValue();
  auto fused = Cpu();
  const ShardSpec spec = Spec(OptimizerType::kAdagrad, 200, 4, 8);
  auto kid = kv->CreateShard(spec);
  auto fid = fused->CreateShard(Fused(spec));
  ASSERT_TRUE(kid.ok() && fid.ok());
  std::mt19937_64 rng(9);
  // The same updates on both: skewed over rows [0, 120).
  auto train = [&](int steps) {
    for (int step = 0; step < steps; ++step) {
      const Batch b = MakeBatch(rng, 120, 4, true);
      std::mt19937_64 g1(step), g2(step);
      ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, b, 4, g1).ok());
      ASSERT_TRUE(Update(*fused, *fid, Pooling::kSum, b, 4, g2).ok());
    }
  };
  train(30);  // rows in the file, 8 in the cache
  std::vector<int64_t> rows(60);
  for (size_t k = 0; k < rows.size(); ++k) rows[k] = static_cast<int64_t>((k * 37) % 200);
  std::shuffle(rows.begin(), rows.end(), rng);  // cached, written and fresh rows
  std::vector<float> a(60 * 4), ast(60 * 4), b(60 * 4), bst(60 * 4);
  ASSERT_TRUE(kv->ExportRowsAt(*kid, rows, absl::MakeSpan(a), absl::MakeSpan(ast)).ok());
  ASSERT_TRUE(fused->ExportRowsAt(*fid, rows, absl::MakeSpan(b), absl::MakeSpan(bst)).ok());
  ExpectSameBits(a, b, "weights read anywhere");
  ExpectSameBits(ast, bst, "state read anywhere");
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i) * 0.25f;
    ast[i] = static_cast<float>(i % 5);
  }
  ASSERT_TRUE(kv->ImportRowsAt(*kid, rows, a, ast).ok());
  ASSERT_TRUE(fused->ImportRowsAt(*fid, rows, a, ast).ok());
  AllRows got = Export(*kv, *kid, spec), want = Export(*fused, *fid, Fused(spec));
  ExpectSameBits(got.w, want.w, "weights after writing anywhere");
  ExpectSameBits(got.st, want.st, "state after writing anywhere");
  // Refusals change nothing.
  std::vector<int64_t> twice = {3, 150, 3};
  std::vector<float> w3(3 * 4, 1.0f), st3(3 * 4, 1.0f);
  absl::Status s = kv->ImportRowsAt(*kid, twice, w3, st3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  std::vector<int64_t> outside = {3, 200, 4};
  s = kv->ImportRowsAt(*kid, outside, w3, st3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  std::vector<int64_t> fine = {3, 150, 4};
  w3[5] = std::nanf("");
  s = kv->ImportRowsAt(*kid, fine, w3, st3);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  got = Export(*kv, *kid, spec);
  ExpectSameBits(got.w, want.w, "weights after the refusals");
  ExpectSameBits(got.st, want.st, "state after the refusals");
  // An import that fits the cache puts its uncached rows there, reading
  // nothing: the next lookup of them finds them cached; they reach the
  // file when they leave it, as updated rows do.
  const std::vector<int64_t> three = {190, 191, 192};  // in the file, not cached
  for (int64_t r : three) {
    std::vector<float> one(4), one_st(4);
    ASSERT_TRUE(kv->ExportRowsAt(*kid, {r}, absl::MakeSpan(one), absl::MakeSpan(one_st)).ok());
  }
  const TierStats before = *kv->GetTierStats(*kid);
  std::vector<float> w9(3 * 4), st9(3 * 4);
  for (size_t i = 0; i < w9.size(); ++i) {
    w9[i] = 9.0f + static_cast<float>(i);
    st9[i] = 0.5f;
  }
  ASSERT_TRUE(kv->ImportRowsAt(*kid, three, w9, st9).ok());
  ASSERT_TRUE(fused->ImportRowsAt(*fid, three, w9, st9).ok());
  const TierStats imported = *kv->GetTierStats(*kid);
  EXPECT_EQ(imported.disk_reads, before.disk_reads);
  EXPECT_EQ(imported.fills, before.fills);
  ExpectSameBits(LookupOf(*kv, *kid, Pooling::kNone, Ids(three), 4),
                 LookupOf(*fused, *fid, Pooling::kNone, Ids(three), 4), "imported rows");
  const TierStats looked = *kv->GetTierStats(*kid);
  EXPECT_EQ(looked.hits, imported.hits + 3);
  EXPECT_EQ(looked.fills, imported.fills);
  // A range import (a restore's, a move's) leaves the cache to the rows in
  // use: rows not cached go to the file, and the next lookup reads them
  // from it (calibrate's SSD probe relies on it).
  const TierStats before_range = *kv->GetTierStats(*kid);
  std::vector<float> w3r(3 * 4, 0.75f), st3r(3 * 4, 0.25f);
  ASSERT_TRUE(kv->ImportRows(*kid, 195, 198, w3r, st3r).ok());
  ASSERT_TRUE(fused->ImportRows(*fid, 195, 198, w3r, st3r).ok());
  EXPECT_EQ(kv->GetTierStats(*kid)->fills, before_range.fills);
  ExpectSameBits(LookupOf(*kv, *kid, Pooling::kNone, Ids({195, 196, 197}), 4),
                 LookupOf(*fused, *fid, Pooling::kNone, Ids({195, 196, 197}), 4),
                 "rows imported by range");
  const TierStats after_range = *kv->GetTierStats(*kid);
  EXPECT_EQ(after_range.fills, before_range.fills + 3);
  EXPECT_EQ(after_range.disk_reads, before_range.disk_reads + 3);
  train(10);  // they leave the cache, changed
  got = Export(*kv, *kid, spec);
  want = Export(*fused, *fid, Fused(spec));
  ExpectSameBits(got.w, want.w, "weights after imported rows left the cache");
  ExpectSameBits(got.st, want.st, "state after imported rows left the cache");
}

// Threads update disjoint rows of one shard (each row once a call, gradient
// 1, SGD) while others look up and export; each row's final value is its
// initial value less lr once for every update it got, in float, worked
// here from the counts.
TEST(KeyValueBackendTest, ConcurrentCallersLoseNoUpdate) {
  auto kv = KeyValue(0, 2);
  ShardSpec spec = Spec(OptimizerType::kSgd, 2000, 4, 64);
  auto kid = kv->CreateShard(spec);
  ASSERT_TRUE(kid.ok());
  const AllRows initial = Export(*kv, *kid, spec);
  constexpr int kThreads = 3;
  std::vector<std::vector<int>> counts(kThreads, std::vector<int>(spec.rows, 0));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int call = 0; call < 150; ++call) {
        std::vector<int64_t> ids;
        for (int k = 0; k < 8; ++k) {  // rows of this thread only: r % kThreads == t
          const int64_t r = (static_cast<int64_t>(rng() % (spec.rows / kThreads)) * kThreads + t);
          if (std::find(ids.begin(), ids.end(), r) == ids.end()) ids.push_back(r);
        }
        const Batch b = Ids(ids);
        std::vector<float> ones(ids.size() * 4, 1.0f);
        GradientRequest g;
        g.feature = Feature(*kid, Pooling::kSum, b);
        g.grad = ones;
        ASSERT_TRUE(kv->ApplyGradients({g}).ok());
        for (int64_t r : ids) ++counts[t][r];
        LookupOf(*kv, *kid, Pooling::kSum, Ids({static_cast<int64_t>(rng() % spec.rows)}), 4);
      }
    });
  }
  std::thread exporter([&] {
    for (int i = 0; i < 20; ++i) Export(*kv, *kid, spec);
  });
  for (auto& t : threads) t.join();
  exporter.join();
  const AllRows got = Export(*kv, *kid, spec);
  for (int64_t r = 0; r < spec.rows; ++r) {
    int n = 0;
    for (int t = 0; t < kThreads; ++t) n += counts[t][r];
    for (int64_t c = 0; c < 4; ++c) {
      float want = initial.w[r * 4 + c];
      for (int k = 0; k < n; ++k) want -= spec.optimizer.learning_rate * 1.0f;
      ASSERT_EQ(got.w[r * 4 + c], want) << "row " << r << " updated " << n << " times";
    }
  }
  EXPECT_GT(kv->GetTierStats(*kid)->write_backs, 0);
}

// An update that would overflow a row is refused naming the table's row,
// not the cache slot the wrapped backend holds it in; nothing is applied.
TEST(KeyValueBackendTest, AnOverflowRefusalNamesTheRow) {
  auto be = KeyValue();
  ShardSpec spec = Spec(OptimizerType::kSgd, 1000, 8, 16);
  spec.optimizer.learning_rate = 10.0f;
  auto id = be->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  Batch b;
  b.lengths = {1};
  b.ids = {950};  // the first row cached: slot 0
  const std::vector<float> small(8, 0.5f);
  ASSERT_TRUE(be->ApplyGradients({GradientRequest{Feature(*id, Pooling::kSum, b), small}}).ok());
  std::vector<float> before(8), state;
  ASSERT_TRUE(be->ExportRows(*id, 950, 951, absl::MakeSpan(before), absl::MakeSpan(state)).ok());
  const std::vector<float> huge(8, -3e38f);  // w + 10 * 3e38: beyond fp32
  const absl::Status s =
      be->ApplyGradients({GradientRequest{Feature(*id, Pooling::kSum, b), huge}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("table 't': row 953 column "), std::string::npos) << s;
  EXPECT_TRUE(IsOverflowRefusal(s)) << s;
  std::vector<float> after(8);
  ASSERT_TRUE(be->ExportRows(*id, 950, 951, absl::MakeSpan(after), absl::MakeSpan(state)).ok());
  EXPECT_EQ(after, before);
}

// A lookup naming more distinct rows of a shard than its cache holds runs
// in pieces (its bags in order, each piece within the cache): pooled,
// weighted, MEAN and NONE, packed and strided outputs, beside a request on
// a shard held in memory, all equal to the table in memory bit for bit. A
// bag alone past the cache is still refused.
TEST(KeyValueBackendTest, LookupsLargerThanTheCacheRunInPieces) {
  auto fused = Cpu();
  auto kv = KeyValue();
  const ShardSpec spec = Spec(OptimizerType::kSgd, 400, 8, 16);
  auto kid = kv->CreateShard(spec);
  auto fid = fused->CreateShard(Fused(spec));
  ShardSpec plain = Fused(spec);
  plain.table = "plain";
  auto pid = kv->CreateShard(plain);  // held in memory, beside
  ASSERT_TRUE(kid.ok() && fid.ok() && pid.ok());
  std::mt19937_64 rng(4);
  // Train a little first, so that rows differ from their initial values.
  for (int step = 0; step < 30; ++step) {
    const Batch b = MakeBatch(rng, spec.rows, 4, false);
    std::vector<float> g(OutRows(Pooling::kSum, b) * 8);
    for (float& x : g) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    ASSERT_TRUE(kv->ApplyGradients({GradientRequest{Feature(*kid, Pooling::kSum, b), g}}).ok());
    ASSERT_TRUE(
        fused->ApplyGradients({GradientRequest{Feature(*fid, Pooling::kSum, b), g}}).ok());
  }
  for (Pooling p : {Pooling::kSum, Pooling::kMean, Pooling::kNone}) {
    for (bool weighted : {false, true}) {
      SCOPED_TRACE(static_cast<int>(p) * 2 + weighted);
      // 60 bags of 0-4 rows over all 400: about 150 distinct rows.
      Batch b;
      std::uniform_int_distribution<int64_t> len(0, 4), row(0, spec.rows - 1);
      for (int i = 0; i < 60; ++i) {
        b.lengths.push_back(len(rng));
        for (int64_t k = 0; k < b.lengths.back(); ++k) {
          b.ids.push_back(row(rng));
          if (weighted) b.weights.push_back(static_cast<float>(k) + 0.5f);
        }
      }
      const std::vector<float> want = LookupOf(*fused, *fid, p, b, 8);
      const std::vector<float> got = LookupOf(*kv, *kid, p, b, 8);
      ExpectSameBits(got, want, "packed");
      // Strided, in one call with a request on the shard held in memory.
      const int64_t n = OutRows(p, b);
      std::vector<float> wide(n * 12, -7.0f), beside(8, 0.0f);
      LookupRequest r;
      r.feature = Feature(*kid, p, b);
      r.output = absl::MakeSpan(wide);
      r.output_stride = 12;
      const Batch one = Ids({3});
      LookupRequest q;
      q.feature = Feature(*pid, Pooling::kSum, one);
      q.output = absl::MakeSpan(beside);
      ASSERT_TRUE(kv->Lookup({q, r}).ok());
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t c = 0; c < 12; ++c) {
          if (c < 8) {
            ASSERT_EQ(FloatBits(wide[i * 12 + c]), FloatBits(want[i * 8 + c])) << i;
          } else {
            ASSERT_EQ(wide[i * 12 + c], -7.0f) << "a gap between strided rows was written";
          }
        }
      }
      EXPECT_NE(beside, std::vector<float>(8, 0.0f));
    }
  }
  // A bag of 17 distinct rows is past a cache of 16.
  std::vector<int64_t> many(17);
  for (int64_t i = 0; i < 17; ++i) many[i] = 10 * i;
  Batch bag;
  bag.ids = many;
  bag.lengths = {17};
  absl::Status s;
  LookupOf(*kv, *kid, Pooling::kSum, bag, 8, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ExpectSameBits(Export(*kv, *kid, spec).w, Export(*fused, *fid, Fused(spec)).w, "weights");
}

// An update naming more distinct rows of a shard than its cache holds runs
// in pieces (each within the cache, all of a row's occurrences in one) as
// one step: under every optimizer (Adam's t once a call) and pooling,
// weighted or not, two requests on the shard and one on a shard held in
// memory in the same call, the rows equal the table in memory bit for bit,
// over the CPU backend and the CUDA backend's kernels (emulated).
struct PiecesCase {
  OptimizerType opt;
  Pooling pooling;
  bool weighted;
  bool emulated_cuda = false;  // the CUDA backend's kernels (emulated) under both
  bool over_host = false;      // fused_uvm_caching (ParityCase::over_host)
};
class KeyValuePiecesTest : public ::testing::TestWithParam<PiecesCase> {};

TEST_P(KeyValuePiecesTest, UpdatesLargerThanTheCacheRunInPiecesAsOneStep) {
  const PiecesCase c = GetParam();
  const ParityCase under{c.opt, c.pooling, WeightType::kFp32, c.emulated_cuda, c.over_host};
  auto fused = Under(under);
  KeyValueOptions o;
  o.dir = TempDir();
  auto kv = WithKeyValueShards(Under(under), o);
  ShardSpec spec = Spec(c.opt, 400, 8, 16);
  spec.host_mapped = c.over_host;
  ShardSpec plain = Fused(spec);
  plain.table = "plain";
  plain.row_offset = 0;
  auto kid = kv->CreateShard(spec);
  auto pid = kv->CreateShard(plain);
  auto fid = fused->CreateShard(Fused(spec));
  auto fpid = fused->CreateShard(plain);
  ASSERT_TRUE(kid.ok() && pid.ok() && fid.ok() && fpid.ok());
  std::mt19937_64 rng(static_cast<uint64_t>(c.opt) * 3 + static_cast<uint64_t>(c.pooling));
  std::uniform_int_distribution<int64_t> len(0, 4), row(0, spec.rows - 1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  auto batch = [&](int bags) {
    Batch b;
    for (int i = 0; i < bags; ++i) {
      b.lengths.push_back(len(rng));
      for (int64_t k = 0; k < b.lengths.back(); ++k) {
        // Low rows often (repeats within and across bags), the rest spread.
        b.ids.push_back(k % 2 == 0 ? row(rng) % 24 : row(rng));
        if (c.weighted) b.weights.push_back(std::uniform_real_distribution<float>(0.5, 2)(rng));
      }
    }
    return b;
  };
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE(step);
    const Batch a = batch(40), b = batch(25), q = batch(3);  // ~100 distinct rows: 7 pieces
    auto grad = [&](const Batch& x, Pooling p) {
      std::vector<float> v(OutRows(p, x) * 8);
      for (float& e : v) e = g(rng);
      return v;
    };
    const std::vector<float> ga = grad(a, c.pooling), gb = grad(b, c.pooling),
                             gq = grad(q, Pooling::kSum);
    auto call = [&](EmbeddingBackend& be, ShardId t, ShardId other) {
      const FeatureRequest fa = Feature(t, c.pooling, a), fb = Feature(t, c.pooling, b);
      return be.ApplyGradients({GradientRequest{fa, ga},
                                GradientRequest{Feature(other, Pooling::kSum, q), gq},
                                GradientRequest{fb, gb}});
    };
    const absl::Status want = call(*fused, *fid, *fpid);
    ASSERT_TRUE(want.ok()) << want;
    const absl::Status s = call(*kv, *kid, *pid);
    ASSERT_TRUE(s.ok()) << s;
  }
  const AllRows want = Export(*fused, *fid, Fused(spec));
  const AllRows got = Export(*kv, *kid, spec);
  ExpectSameBits(got.w, want.w, "weights");
  ExpectSameBits(got.st, want.st, "optimizer state");
  ExpectSameBits(Export(*kv, *pid, plain).w, Export(*fused, *fpid, plain).w, "the other shard");
  EXPECT_EQ(*kv->ExportStep(*kid), 8);
  EXPECT_EQ(*kv->ExportStep(*kid), *fused->ExportStep(*fid));
  EXPECT_EQ(*kv->ExportStep(*pid), *fused->ExportStep(*fpid));
  EXPECT_GT(kv->GetTierStats(*kid)->write_backs, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Kernels, KeyValuePiecesTest,
    ::testing::Values(PiecesCase{OptimizerType::kSgd, Pooling::kSum, true},
                      PiecesCase{OptimizerType::kAdagrad, Pooling::kMean, true},
                      PiecesCase{OptimizerType::kRowwiseAdagrad, Pooling::kMean, false},
                      PiecesCase{OptimizerType::kAdam, Pooling::kSum, false},
                      PiecesCase{OptimizerType::kAdam, Pooling::kNone, false},
                      PiecesCase{OptimizerType::kSgd, Pooling::kNone, false},
                      PiecesCase{OptimizerType::kAdam, Pooling::kMean, true, true},
                      PiecesCase{OptimizerType::kRowwiseAdagrad, Pooling::kNone, false, true},
                      PiecesCase{OptimizerType::kAdam, Pooling::kMean, true, false, true}));

// An update in pieces is one call: a piece refused (here an overflow, in a
// middle piece and in the last one) puts back every row the earlier pieces
// changed and the step, and the request on the other shard (run with the
// last piece) is not applied either; the refusal names the table's row.
TEST(KeyValueBackendTest, AnUpdateInPiecesIsAppliedWholeOrNotAtAll) {
  for (const int64_t bad : {20, 59}) {  // the 2nd of 4 pieces, the last
    SCOPED_TRACE(bad);
    auto kv = KeyValue();
    ShardSpec spec = Spec(OptimizerType::kSgd, 400, 8, 16);
    spec.optimizer.learning_rate = 10.0f;
    ShardSpec plain = Fused(spec);
    plain.table = "plain";
    auto kid = kv->CreateShard(spec);
    auto pid = kv->CreateShard(plain);
    ASSERT_TRUE(kid.ok() && pid.ok());
    std::mt19937_64 rng(9);
    // A first update, so that rows are cached and changed.
    std::vector<int64_t> warm(10);
    for (int64_t i = 0; i < 10; ++i) warm[i] = 3 * i;
    ASSERT_TRUE(Update(*kv, *kid, Pooling::kSum, Ids(warm), 8, rng).ok());
    const AllRows before = Export(*kv, *kid, spec);
    const AllRows other_before = Export(*kv, *pid, plain);
    // 60 distinct rows (a NONE request: a gradient row each), one of them
    // pushed past fp32.
    Batch b;
    for (int64_t i = 0; i < 60; ++i) b.ids.push_back((7 * i) % 400);
    b.lengths.assign(60, 1);
    std::vector<float> grad(60 * 8, 0.25f);
    std::fill_n(grad.begin() + bad * 8, 8, -3e38f);
    const Batch one = Ids({5});
    const std::vector<float> g1(8, 1.0f);
    const absl::Status s =
        kv->ApplyGradients({GradientRequest{Feature(*kid, Pooling::kNone, b), grad},
                            GradientRequest{Feature(*pid, Pooling::kSum, one), g1}});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(IsOverflowRefusal(s)) << s;
    EXPECT_NE(std::string(s.message()).find(absl::StrCat("row ", 3 + (7 * bad) % 400, " column")),
              std::string::npos)
        << s;
    const AllRows after = Export(*kv, *kid, spec);
    ExpectSameBits(after.w, before.w, "weights");
    ExpectSameBits(after.st, before.st, "state");
    ExpectSameBits(Export(*kv, *pid, plain).w, other_before.w, "the other shard");
    EXPECT_EQ(*kv->ExportStep(*kid), 1);
    EXPECT_EQ(*kv->ExportStep(*pid), 0);
    EXPECT_GT(kv->GetTierStats(*kid)->fills, 16);  // the pieces did run
  }
}

}  // namespace
}  // namespace backend
}  // namespace ember
