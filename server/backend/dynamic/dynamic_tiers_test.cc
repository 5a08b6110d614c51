// Dynamic shards below memory: the dynamic wrapper over a key_value shard
// (rows in a file under a small cache, CPU and emulated CUDA), over a
// fused_uvm_caching shard (a cache over rows in host memory the GPU maps)
// and over a fused_uvm shard (every row in mapped host memory, ids found
// by the backend), against the independent reference that is the same
// dynamic shard held whole in memory (the fused kernel, itself checked
// against the naive model in dynamic_backend_test). The same calls must
// give the same lookups, the same ids in the same slots, the same rows and
// optimizer state and the same bookkeeping, bit for bit, with the cache far
// smaller than the capacity so rows leave it and come back many times;
// imports by id evict alike; a refused update changes nothing in either.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"
#include "server/backend/key_value/key_value_backend.h"

namespace ember {
namespace backend {
namespace {

constexpr int64_t kCapacity = 16, kDim = 8, kCacheRows = 5, kUniverse = 48;

enum class Tier { kKeyValue, kKeyValueOnCuda, kFusedUvmCaching, kFusedUvm };

struct Case {
  Tier tier;
  OptimizerType opt;
  Pooling pooling;
  int64_t admit_after, ttl;
  Eviction eviction;
};

bool OnCuda(Tier t) { return t != Tier::kKeyValue; }

std::unique_ptr<EmbeddingBackend> Base(Tier t) {
  if (OnCuda(t)) return CreateEmulatedCudaBackend();
  auto b = CreateCpuBackend(CpuBackendOptions());
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

std::string TempDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

ShardSpec SpecOf(const Case& c) {
  ShardSpec s;
  s.table = "t";
  s.rows = s.table_rows = kCapacity;
  s.dim = kDim;
  s.optimizer.type = c.opt;
  s.optimizer.learning_rate = 0.1f;
  if (c.opt == OptimizerType::kAdagrad || c.opt == OptimizerType::kRowwiseAdagrad) {
    s.optimizer.initial_accumulator_value = 0.25f;
  }
  s.initializer.seed = 5;
  s.is_dynamic = true;
  s.dynamic.admit_after = c.admit_after;
  s.dynamic.ttl_steps = c.ttl;
  s.dynamic.eviction = c.eviction;
  return s;
}

// The tiered shard's spec: a cache of kCacheRows (not for fused_uvm), in
// mapped host memory below it on the fused_uvm kernels.
ShardSpec Tiered(const Case& c) {
  ShardSpec s = SpecOf(c);
  s.cache_rows = c.tier == Tier::kFusedUvm ? 0 : kCacheRows;
  s.host_mapped = c.tier == Tier::kFusedUvm || c.tier == Tier::kFusedUvmCaching;
  return s;
}

std::unique_ptr<EmbeddingBackend> TieredBackend(Tier t) {
  KeyValueOptions o;
  o.dir = TempDir();
  return WithDynamicShards(WithKeyValueShards(Base(t), o));
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                    const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

struct Pair {
  std::unique_ptr<EmbeddingBackend> ref, tiered;
  ShardId rid = -1, tid = -1;
  ShardSpec spec;
};

Pair Make(const Case& c) {
  Pair p;
  p.spec = SpecOf(c);
  p.ref = WithDynamicShards(Base(c.tier));
  p.tiered = TieredBackend(c.tier);
  auto r = p.ref->CreateShard(p.spec);
  auto t = p.tiered->CreateShard(Tiered(c));
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(t.ok()) << t.status();
  if (r.ok()) p.rid = *r;
  if (t.ok()) p.tid = *t;
  return p;
}

// Slots, rows, state and bookkeeping of both shards, bit for bit.
void ExpectSameShards(const Pair& p, const std::string& when) {
  std::vector<EmbeddingBackend::SlotMeta> a(kCapacity), b(kCapacity);
  ASSERT_TRUE(p.ref->ExportSlots(p.rid, 0, kCapacity, absl::MakeSpan(a)).ok());
  ASSERT_TRUE(p.tiered->ExportSlots(p.tid, 0, kCapacity, absl::MakeSpan(b)).ok());
  for (int64_t s = 0; s < kCapacity; ++s) {
    ASSERT_EQ(a[s].held, b[s].held) << "slot " << s << " " << when;
    if (!a[s].held) continue;
    EXPECT_EQ(a[s].id, b[s].id) << "slot " << s << " " << when;
    EXPECT_EQ(a[s].last_step, b[s].last_step) << "slot " << s << " " << when;
    EXPECT_EQ(a[s].updates, b[s].updates) << "slot " << s << " " << when;
    EXPECT_EQ(a[s].order, b[s].order) << "slot " << s << " " << when;
  }
  const int64_t width = OptimizerStateWidth(p.spec.optimizer.type, kDim);
  std::vector<float> wa(kCapacity * kDim), wb(wa.size()), sa(kCapacity * width), sb(sa.size());
  ASSERT_TRUE(p.ref->ExportRows(p.rid, 0, kCapacity, absl::MakeSpan(wa), absl::MakeSpan(sa)).ok());
  ASSERT_TRUE(
      p.tiered->ExportRows(p.tid, 0, kCapacity, absl::MakeSpan(wb), absl::MakeSpan(sb)).ok());
  for (int64_t s = 0; s < kCapacity; ++s) {  // free slots' contents are nobody's
    if (a[s].held) continue;
    std::fill_n(wa.begin() + s * kDim, kDim, 0.0f);
    std::fill_n(wb.begin() + s * kDim, kDim, 0.0f);
    std::fill_n(sa.begin() + s * width, width, 0.0f);
    std::fill_n(sb.begin() + s * width, width, 0.0f);
  }
  ExpectSameBits(wb, wa, "weights " + when);
  ExpectSameBits(sb, sa, "optimizer state " + when);
  auto da = p.ref->GetDynamicStats(p.rid);
  auto db = p.tiered->GetDynamicStats(p.tid);
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_EQ(db->rows_held, da->rows_held) << when;
  EXPECT_EQ(db->steps, da->steps) << when;
  EXPECT_EQ(db->admitted, da->admitted) << when;
  EXPECT_EQ(db->imported, da->imported) << when;
  EXPECT_EQ(db->evicted_ttl, da->evicted_ttl) << when;
  EXPECT_EQ(db->evicted_lru, da->evicted_lru) << when;
  EXPECT_EQ(db->evicted_lfu, da->evicted_lfu) << when;
  EXPECT_EQ(db->evicted_import, da->evicted_import) << when;
  EXPECT_EQ(db->dropped_pending, da->dropped_pending) << when;
  EXPECT_EQ(db->pending_ids, da->pending_ids) << when;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  static const char* const kTiers[] = {"key_value", "key_value_cuda", "fused_uvm_caching",
                                       "fused_uvm"};
  return absl::StrCat(kTiers[static_cast<int>(info.param.tier)], "_", info.index);
}

class DynamicTiersTest : public ::testing::TestWithParam<Case> {};

TEST_P(DynamicTiersTest, EqualsTheDynamicShardHeldWholeInMemoryBitForBit) {
  const Case c = GetParam();
  Pair p = Make(c);
  ASSERT_GE(p.tid, 0);
  ASSERT_GE(p.rid, 0);
  std::mt19937_64 rng(static_cast<uint64_t>(c.tier) * 131 + static_cast<uint64_t>(c.opt) * 7 +
                      static_cast<uint64_t>(c.pooling));
  std::vector<int64_t> universe;
  for (int64_t i = 0; i < kUniverse; ++i) universe.push_back(static_cast<int64_t>(rng()));
  universe[0] = std::numeric_limits<int64_t>::min();
  universe[1] = -1;
  const bool sequence = c.pooling == Pooling::kNone;
  for (int step = 0; step < 80; ++step) {
    // 4 bags of 0-4 ids, a hot eighth of the universe drawn most.
    std::vector<int64_t> lengths, ids;
    std::vector<float> weights;
    for (int b = 0; b < 4; ++b) {
      lengths.push_back(static_cast<int64_t>(rng() % 5));
      for (int64_t k = 0; k < lengths.back(); ++k) {
        const uint64_t r = rng() % 100;
        ids.push_back(universe[r < 60 ? r % 6 : r % kUniverse]);
        weights.push_back(0.5f + static_cast<float>(rng() % 4) * 0.25f);
      }
    }
    if (sequence) weights.clear();
    const int64_t out_rows = sequence ? static_cast<int64_t>(ids.size()) : 4;
    std::vector<float> want(out_rows * kDim, -1.0f), got(want.size(), -2.0f);
    if (step % 2 == 0) {  // the tiered shard alone: no value or count may change
      std::vector<int64_t> ahead = ids;
      ahead.push_back(static_cast<int64_t>(rng()));  // no row: the zero slot, not counted
      auto brought = p.tiered->Prefetch({FeatureRequest{p.tid, c.pooling, {}, ahead, {}}});
      ASSERT_TRUE(brought.ok()) << brought.status();
      if (c.tier == Tier::kFusedUvm) {
        EXPECT_EQ(*brought, 0);  // no cache
      }
    }
    ASSERT_TRUE(p.ref->Lookup({LookupRequest{FeatureRequest{p.rid, c.pooling, lengths, ids, weights},
                                             absl::MakeSpan(want)}})
                    .ok());
    const absl::Status looked = p.tiered->Lookup(
        {LookupRequest{FeatureRequest{p.tid, c.pooling, lengths, ids, weights},
                       absl::MakeSpan(got)}});
    ASSERT_TRUE(looked.ok()) << looked;
    ExpectSameBits(got, want, absl::StrCat("lookup at step ", step));
    std::vector<float> grad(out_rows * kDim);
    for (float& g : grad) g = static_cast<float>(static_cast<int>(rng() % 17) - 8) * 0.125f;
    ASSERT_TRUE(p.ref->ApplyGradients(
                         {GradientRequest{FeatureRequest{p.rid, c.pooling, lengths, ids, weights},
                                          grad}})
                    .ok());
    const absl::Status applied = p.tiered->ApplyGradients(
        {GradientRequest{FeatureRequest{p.tid, c.pooling, lengths, ids, weights}, grad}});
    ASSERT_TRUE(applied.ok()) << applied;
    if (step % 8 == 7) ExpectSameShards(p, absl::StrCat("after step ", step));
  }
  // Imports by id: held ids overwritten, new ones evicting by the policy.
  std::vector<int64_t> imported = {universe[2], universe[40], universe[41], 77, -77};
  std::vector<float> w(imported.size() * kDim), st(imported.size() *
                                                   OptimizerStateWidth(c.opt, kDim));
  for (size_t k = 0; k < w.size(); ++k) w[k] = 0.25f * static_cast<float>(k % 9) - 1.0f;
  for (size_t k = 0; k < st.size(); ++k) st[k] = 0.125f * static_cast<float>(k % 5);
  ASSERT_TRUE(p.ref->ImportIds(p.rid, imported, w, st).ok());
  const absl::Status in = p.tiered->ImportIds(p.tid, imported, w, st);
  ASSERT_TRUE(in.ok()) << in;
  ExpectSameShards(p, "after the import");
  // A refused update (a non-finite gradient) changes nothing in either.
  const std::vector<int64_t> one_len = {2}, two = {universe[3], 12345};
  std::vector<float> bad(sequence ? 2 * kDim : kDim, 1.0f);
  bad[1] = std::nanf("");
  EXPECT_FALSE(p.ref->ApplyGradients({GradientRequest{
                                         FeatureRequest{p.rid, c.pooling, one_len, two, {}}, bad}})
                   .ok());
  EXPECT_FALSE(p.tiered
                   ->ApplyGradients({GradientRequest{
                       FeatureRequest{p.tid, c.pooling, one_len, two, {}}, bad}})
                   .ok());
  ExpectSameShards(p, "after a refused update");
  if (c.tier != Tier::kFusedUvm) {  // rows did leave the cache and come back
    auto tier = p.tiered->GetTierStats(p.tid);
    ASSERT_TRUE(tier.ok()) << tier.status();
    EXPECT_EQ(tier->cache_rows, kCacheRows);
    EXPECT_GT(tier->write_backs, 0);
    EXPECT_GT(tier->disk_reads, 0);
    EXPECT_EQ(tier->file_bytes > 0, c.tier != Tier::kFusedUvmCaching);
  }
  ASSERT_TRUE(p.tiered->DropShard(p.tid).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Tiers, DynamicTiersTest,
    ::testing::Values(
        Case{Tier::kKeyValue, OptimizerType::kSgd, Pooling::kSum, 1, 0, Eviction::kLru},
        Case{Tier::kKeyValue, OptimizerType::kAdagrad, Pooling::kMean, 3, 0, Eviction::kLfu},
        Case{Tier::kKeyValue, OptimizerType::kRowwiseAdagrad, Pooling::kSum, 1, 4, Eviction::kLru},
        Case{Tier::kKeyValue, OptimizerType::kAdam, Pooling::kNone, 2, 3, Eviction::kLfu},
        Case{Tier::kKeyValueOnCuda, OptimizerType::kAdam, Pooling::kMean, 1, 5, Eviction::kLru},
        Case{Tier::kFusedUvmCaching, OptimizerType::kAdagrad, Pooling::kSum, 2, 0, Eviction::kLru},
        Case{Tier::kFusedUvmCaching, OptimizerType::kSgd, Pooling::kNone, 1, 4, Eviction::kLfu},
        Case{Tier::kFusedUvm, OptimizerType::kRowwiseAdagrad, Pooling::kMean, 1, 3,
             Eviction::kLfu},
        Case{Tier::kFusedUvm, OptimizerType::kAdam, Pooling::kSum, 3, 0, Eviction::kLru}),
    CaseName);

// A prefetch of ids with rows brings them into the cache, and an id without
// one the zero slot its lookup reads (the lookup after it fills nothing);
// the id is not counted toward its admission.
TEST(DynamicTiersPrefetch, TheNextCallFindsItsRowsCached) {
  const Case c{Tier::kKeyValue, OptimizerType::kSgd, Pooling::kSum, 2, 0, Eviction::kLru};
  Pair p = Make(c);
  ASSERT_GE(p.tid, 0);
  const std::vector<int64_t> ones(8, 1);
  std::vector<int64_t> held = {101, 102, 103, 104, 105, 106, 107, 108};
  std::vector<float> grad(8 * kDim, 0.5f);
  for (int twice = 0; twice < 2; ++twice) {  // admit_after 2: admitted the second time
    ASSERT_TRUE(p.tiered
                    ->ApplyGradients({GradientRequest{
                        FeatureRequest{p.tid, Pooling::kSum, ones, held, {}}, grad}})
                    .ok());
  }
  ASSERT_EQ(p.tiered->GetDynamicStats(p.tid)->rows_held, 8);
  const int64_t pending = p.tiered->GetDynamicStats(p.tid)->pending_ids;
  // 101-103 left the cache of 5 to the later rows.
  const std::vector<int64_t> ahead = {101, 102, 103, 999, 101};
  auto brought = p.tiered->Prefetch({FeatureRequest{p.tid, Pooling::kSum, {}, ahead, {}}});
  ASSERT_TRUE(brought.ok()) << brought.status();
  EXPECT_EQ(*brought, 4);  // 101-103 and the zero slot
  EXPECT_EQ(p.tiered->GetDynamicStats(p.tid)->pending_ids, pending);
  const TierStats before = *p.tiered->GetTierStats(p.tid);
  const std::vector<int64_t> lengths = {4}, ids = {101, 102, 999, 103};
  std::vector<float> out(kDim);
  ASSERT_TRUE(p.tiered
                  ->Lookup({LookupRequest{FeatureRequest{p.tid, Pooling::kSum, lengths, ids, {}},
                                          absl::MakeSpan(out)}})
                  .ok());
  const TierStats after = *p.tiered->GetTierStats(p.tid);
  EXPECT_EQ(after.fills, before.fills);
  EXPECT_EQ(after.hits, before.hits + 4);
  // Ids in device memory are refused, as a lookup's.
  FeatureRequest f{p.tid, Pooling::kSum, {}, ahead, {}};
  f.on_device = true;
  EXPECT_EQ(p.tiered->Prefetch({f}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Under a cache the backend's copy of the index is not kept (its shard is
// the cache's slots): lookups map ids on the host, and ids in device
// memory are refused with the reason.
TEST(DynamicTiersRefusals, DeviceIdsAreRefusedUnderACache) {
  const Case c{Tier::kFusedUvmCaching, OptimizerType::kSgd, Pooling::kSum, 1, 0, Eviction::kLru};
  Pair p = Make(c);
  ASSERT_GE(p.tid, 0);
  const std::vector<int64_t> lengths = {1}, ids = {42};
  std::vector<float> out(kDim);
  FeatureRequest f{p.tid, Pooling::kSum, lengths, ids, {}};
  f.on_device = true;
  const absl::Status s = p.tiered->Lookup({LookupRequest{f, absl::MakeSpan(out)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A key_value spec on a worker without an SSD tier is refused as a fixed one is.
  const Case k{Tier::kKeyValue, OptimizerType::kSgd, Pooling::kSum, 1, 0, Eviction::kLru};
  auto nowhere = WithDynamicShards(WithKeyValueShards(Base(Tier::kKeyValue), KeyValueOptions()));
  const auto refused = nowhere->CreateShard(Tiered(k));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("--ssd_dir"), std::string::npos) << refused.status();
}

}  // namespace
}  // namespace backend
}  // namespace ember
