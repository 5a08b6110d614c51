// Dynamic shards over the CPU backend against an independent reference: a
// fixed CPU shard with one dense row per id ever seen, driven by the naive
// model of the rules (naive_dynamic_model.h): it writes an id's initial row
// when the model creates it, and its updates leave out the ids without a
// row (SUM: dropped from their bags; MEAN: as SUM with weight 1/length of
// the whole bag; NONE: their gradient rows dropped). Lookups are summed by
// hand from the reference's rows. Every optimizer, pooling, TTL, LRU and
// LFU; refusals leave everything as it was (rows of evicted ids included);
// moves by ExportSlots / ImportSlots; imports by id.
#include "server/backend/dynamic/dynamic_backend.h"

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "server/backend/overflow_guard.h"
#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/emulated_backend.h"
#include "server/backend/forwarding_backend.h"
#include "server/backend/dynamic/naive_dynamic_model.h"

namespace ember {
namespace backend {
namespace {

constexpr int64_t kDim = 4;

std::unique_ptr<EmbeddingBackend> Cpu() {
  auto b = CreateCpuBackend(CpuBackendOptions());
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

ShardSpec SpecOf(OptimizerType opt, int64_t capacity, const DynamicConfig& d) {
  ShardSpec s;
  s.table = "t";
  s.rows = capacity;
  s.dim = kDim;
  s.table_rows = capacity;
  s.optimizer.type = opt;
  s.optimizer.learning_rate = 0.1f;
  if (opt == OptimizerType::kAdagrad) s.optimizer.initial_accumulator_value = 0.25f;
  s.initializer.seed = 7;
  s.is_dynamic = true;
  s.dynamic = d;
  return s;
}

struct Rows {
  std::vector<float> w, st;
};

// Row `row` of a shard of `be`.
Rows RowOf(const EmbeddingBackend& be, ShardId id, const ShardSpec& spec, int64_t row) {
  Rows r;
  r.w.resize(kDim);
  r.st.resize(OptimizerStateWidth(spec.optimizer.type, kDim));
  EXPECT_TRUE(be.ExportRows(id, row, row + 1, absl::MakeSpan(r.w), absl::MakeSpan(r.st)).ok());
  return r;
}

// The ids a dynamic shard holds and their slots, ascending.
std::map<int64_t, int64_t> Held(const EmbeddingBackend& be, ShardId id, int64_t capacity) {
  std::vector<EmbeddingBackend::SlotMeta> m(capacity);
  EXPECT_TRUE(be.ExportSlots(id, 0, capacity, absl::MakeSpan(m)).ok());
  std::map<int64_t, int64_t> held;
  for (int64_t s = 0; s < capacity; ++s) {
    if (m[s].held) held[m[s].id] = s;
  }
  return held;
}

void ExpectNear(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], 1e-5f * (1.0f + std::fabs(b[i]))) << what << " [" << i << "]";
  }
}

struct Case {
  OptimizerType opt;
  Pooling pooling;
  bool weighted;
  int64_t capacity, admit_after, ttl;
  Eviction eviction;
};

class DynamicBackendTest : public ::testing::TestWithParam<Case> {};

TEST_P(DynamicBackendTest, MatchesAFixedTableDrivenByTheNaiveModel) {
  const Case c = GetParam();
  DynamicConfig d;
  d.admit_after = c.admit_after;
  d.ttl_steps = c.ttl;
  d.eviction = c.eviction;
  const ShardSpec spec = SpecOf(c.opt, c.capacity, d);
  auto dyn = WithDynamicShards(Cpu());
  auto sid = dyn->CreateShard(spec);
  ASSERT_TRUE(sid.ok()) << sid.status();
  // The reference: one dense row per id, 40 ids at most.
  constexpr int64_t kUniverse = 40;
  ShardSpec fixed = spec;
  fixed.is_dynamic = false;
  fixed.rows = fixed.table_rows = kUniverse;
  auto ref = Cpu();
  auto rid = ref->CreateShard(fixed);
  ASSERT_TRUE(rid.ok()) << rid.status();
  std::map<int64_t, int64_t> dense;  // id -> reference row
  NaiveDynamicModel model(c.capacity, d);
  std::mt19937_64 rng(static_cast<uint64_t>(c.capacity) * 31 + static_cast<int>(c.opt));
  std::vector<int64_t> universe;
  for (int64_t i = 0; i < kUniverse; ++i) {
    universe.push_back(i % 2 ? -static_cast<int64_t>(rng() >> 1) : static_cast<int64_t>(rng()));
  }
  const std::vector<float> fresh_state = [&] {
    std::vector<float> s(OptimizerStateWidth(c.opt, kDim),
                         c.opt == OptimizerType::kAdagrad ? 0.25f : 0.0f);
    return s;
  }();
  const bool sequence = c.pooling == Pooling::kNone;
  for (int step = 0; step < 60; ++step) {
    // A batch of 3 bags over a skewed draw of the universe.
    std::vector<int64_t> lengths, ids;
    std::vector<float> weights;
    for (int b = 0; b < 3; ++b) {
      const int64_t n = static_cast<int64_t>(rng() % 5);
      lengths.push_back(n);
      for (int64_t k = 0; k < n; ++k) {
        const uint64_t r = rng() % 100;
        ids.push_back(universe[r < 60 ? r % 6 : r % kUniverse]);
        weights.push_back(0.5f + static_cast<float>(rng() % 4) * 0.25f);
      }
    }
    if (!c.weighted) weights.clear();
    const int64_t out_rows = sequence ? static_cast<int64_t>(ids.size()) : 3;
    // The lookup, by hand from the reference's rows.
    std::vector<float> want(out_rows * kDim, 0.0f);
    for (int64_t b = 0, k = 0; b < 3; ++b) {
      for (int64_t e = k + lengths[b]; k < e; ++k) {
        if (!model.Holds(ids[k])) continue;
        const Rows row = RowOf(*ref, *rid, fixed, dense.at(ids[k]));
        const float w = weights.empty() ? 1.0f : weights[k];
        const float scale = c.pooling == Pooling::kMean ? w / static_cast<float>(lengths[b]) : w;
        for (int64_t col = 0; col < kDim; ++col) {
          want[(sequence ? k : b) * kDim + col] += scale * row.w[col];
        }
      }
    }
    std::vector<float> got(out_rows * kDim, -1.0f);
    const LookupRequest lr{FeatureRequest{*sid, c.pooling, lengths, ids, weights},
                           absl::MakeSpan(got)};
    ASSERT_TRUE(dyn->Lookup({lr}).ok());
    ExpectNear(got, want, absl::StrCat("lookup at step ", step));
    // The update.
    std::vector<float> grad(out_rows * kDim);
    for (float& g : grad) g = static_cast<float>(static_cast<int>(rng() % 17) - 8) * 0.125f;
    const std::vector<int64_t> created = model.Update(ids);
    for (int64_t id : created) {
      if (!dense.count(id)) dense[id] = static_cast<int64_t>(dense.size());
      std::vector<float> init(kDim);
      InitialValues(spec.initializer, spec.table_rows, id, 1, 0, kDim, init.data());
      ASSERT_TRUE(ref->ImportRows(*rid, dense[id], dense[id] + 1, init, fresh_state).ok());
    }
    std::vector<int64_t> rlengths, rids;
    std::vector<float> rweights, rgrad;
    for (int64_t b = 0, k = 0; b < 3; ++b) {
      int64_t kept = 0;
      for (int64_t e = k + lengths[b]; k < e; ++k) {
        if (!model.Holds(ids[k])) continue;
        ++kept;
        rids.push_back(dense.at(ids[k]));
        const float w = weights.empty() ? 1.0f : weights[k];
        rweights.push_back(c.pooling == Pooling::kMean ? w / static_cast<float>(lengths[b]) : w);
        if (sequence) rgrad.insert(rgrad.end(), grad.begin() + k * kDim, grad.begin() + (k + 1) * kDim);
      }
      rlengths.push_back(kept);
    }
    if (!sequence) rgrad = grad;
    const bool ref_weighted = c.weighted || c.pooling == Pooling::kMean;
    const GradientRequest rg{
        FeatureRequest{*rid, sequence ? Pooling::kNone : Pooling::kSum, rlengths, rids,
                       ref_weighted && !sequence ? absl::MakeConstSpan(rweights)
                                                 : absl::Span<const float>()},
        rgrad};
    ASSERT_TRUE(ref->ApplyGradients({rg}).ok());
    const GradientRequest dg{FeatureRequest{*sid, c.pooling, lengths, ids, weights}, grad};
    const absl::Status applied = dyn->ApplyGradients({dg});
    ASSERT_TRUE(applied.ok()) << applied;
    // The same ids held, each row (weights and state) as the reference's.
    const std::map<int64_t, int64_t> held = Held(*dyn, *sid, c.capacity);
    std::vector<int64_t> held_ids;
    for (const auto& [id, slot] : held) held_ids.push_back(id);
    ASSERT_EQ(held_ids, model.Held()) << "step " << step;
    for (const auto& [id, slot] : held) {
      const Rows a = RowOf(*dyn, *sid, spec, slot), b = RowOf(*ref, *rid, fixed, dense.at(id));
      ExpectNear(a.w, b.w, absl::StrCat("weights of id ", id, " at step ", step));
      ExpectNear(a.st, b.st, absl::StrCat("state of id ", id, " at step ", step));
    }
  }
  auto stats = dyn->GetDynamicStats(*sid);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->steps, 60);
  EXPECT_GT(stats->admitted, 0);
  EXPECT_LE(stats->rows_held, c.capacity);
  if (c.admit_after > 1) EXPECT_GT(stats->dropped_pending, 0);
}

INSTANTIATE_TEST_SUITE_P(
    EveryOptimizerAndPooling, DynamicBackendTest,
    ::testing::Values(Case{OptimizerType::kSgd, Pooling::kSum, true, 6, 1, 0, Eviction::kLru},
                      Case{OptimizerType::kAdagrad, Pooling::kSum, false, 6, 2, 0, Eviction::kLfu},
                      Case{OptimizerType::kRowwiseAdagrad, Pooling::kMean, true, 8, 1, 4,
                           Eviction::kLru},
                      Case{OptimizerType::kAdam, Pooling::kMean, false, 5, 3, 0, Eviction::kLfu},
                      Case{OptimizerType::kAdam, Pooling::kNone, false, 6, 1, 3, Eviction::kLru},
                      Case{OptimizerType::kSgd, Pooling::kNone, false, 40, 2, 0, Eviction::kLru}));

struct Fixture {
  std::unique_ptr<EmbeddingBackend> be = WithDynamicShards(Cpu());
  ShardSpec spec;
  ShardId id = 0;
  explicit Fixture(int64_t capacity, OptimizerType opt = OptimizerType::kSgd) {
    spec = SpecOf(opt, capacity, DynamicConfig{});
    spec.optimizer.learning_rate = 1.0f;
    auto s = be->CreateShard(spec);
    EXPECT_TRUE(s.ok()) << s.status();
    id = *s;
  }
  absl::Status Update(std::vector<int64_t> ids, float g) {
    std::vector<int64_t> lengths(ids.size(), 1);
    std::vector<float> grad(ids.size() * kDim, g);
    return be->ApplyGradients(
        {GradientRequest{FeatureRequest{id, Pooling::kSum, lengths, ids, {}}, grad}});
  }
  std::vector<float> Lookup(std::vector<int64_t> ids) {
    std::vector<int64_t> lengths(ids.size(), 1);
    std::vector<float> out(ids.size() * kDim);
    EXPECT_TRUE(
        be->Lookup({LookupRequest{FeatureRequest{id, Pooling::kSum, lengths, ids, {}},
                                  absl::MakeSpan(out)}})
            .ok());
    return out;
  }
};

TEST(DynamicBackendRefusals, ARefusedUpdateLeavesIdsRowsAndEvictedRowsAsTheyWere) {
  Fixture f(1);
  ASSERT_TRUE(f.Update({10}, 0.5f).ok());
  const std::vector<float> before = f.Lookup({10});
  // Admitting 20 evicts 10 and reuses its slot; the NaN refuses the call.
  const absl::Status s = f.Update({20}, std::nanf(""));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(f.Lookup({10}), before);
  EXPECT_EQ(f.Lookup({20}), std::vector<float>(kDim, 0.0f));
  EXPECT_EQ(Held(*f.be, f.id, 1), (std::map<int64_t, int64_t>{{10, 0}}));
  auto st = f.be->GetDynamicStats(f.id);
  EXPECT_EQ(st->steps, 1);
  EXPECT_EQ(st->evicted_lru, 0);
  // An overflow refusal (the wrapped backend's, after the rows were
  // written) is undone too.
  const absl::Status o = f.Update({20, 20}, 3e38f);
  EXPECT_EQ(o.code(), absl::StatusCode::kInvalidArgument) << o;
  EXPECT_EQ(f.Lookup({10}), before);
  EXPECT_EQ(Held(*f.be, f.id, 1), (std::map<int64_t, int64_t>{{10, 0}}));
  // And then the same update, fine, applies.
  ASSERT_TRUE(f.Update({20}, 1.0f).ok());
  EXPECT_EQ(Held(*f.be, f.id, 1), (std::map<int64_t, int64_t>{{20, 0}}));
}

TEST(DynamicBackendRefusals, BadSpecsAndDeviceIdsAreRefused) {
  auto be = WithDynamicShards(Cpu());
  DynamicConfig d;
  d.admit_after = -1;
  auto s = be->CreateShard(SpecOf(OptimizerType::kSgd, 4, d));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), testing::HasSubstr("admit_after"));
  d = DynamicConfig{};
  d.ttl_steps = -2;
  s = be->CreateShard(SpecOf(OptimizerType::kSgd, 4, d));
  EXPECT_THAT(std::string(s.status().message()), testing::HasSubstr("ttl_steps"));
  s = be->CreateShard(SpecOf(OptimizerType::kSgd, 0, DynamicConfig{}));
  EXPECT_THAT(std::string(s.status().message()), testing::HasSubstr("capacity"));
  Fixture f(4);
  const std::vector<int64_t> lengths = {1}, ids = {5};
  std::vector<float> out(kDim);
  FeatureRequest r{f.id, Pooling::kSum, lengths, ids, {}};
  r.on_device = true;
  const absl::Status l = f.be->Lookup({LookupRequest{r, absl::MakeSpan(out)}});
  EXPECT_EQ(l.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(l.message()), testing::HasSubstr("host memory"));
  // Slot ranges stop before the zero slot; fixed shards have no slots.
  std::vector<float> w(kDim), st;
  EXPECT_FALSE(f.be->ExportRows(f.id, 4, 5, absl::MakeSpan(w), absl::MakeSpan(st)).ok());
  ShardSpec plain = SpecOf(OptimizerType::kSgd, 4, DynamicConfig{});
  plain.is_dynamic = false;
  auto fixed = f.be->CreateShard(plain);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(f.be->GetDynamicStats(*fixed).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DynamicBackendRefusals, LookupsOfUnknownIdsAreZeroAndChangeNothing) {
  Fixture f(4);
  EXPECT_EQ(f.Lookup({int64_t{-1}, int64_t{1} << 62}), std::vector<float>(2 * kDim, 0.0f));
  auto st = f.be->GetDynamicStats(f.id);
  EXPECT_EQ(st->rows_held, 0);
  EXPECT_EQ(st->pending_ids, 0);
  EXPECT_EQ(st->steps, 0);
}

TEST(DynamicBackendLookups, ALargeLookupOnTheBackendsThreadsMatchesOneThread) {
  // More ids than one thread's share of the id-to-slot pass (kFindGrain,
  // 8192): on 3 threads the pass is split over the CPU backend's pool.
  // Rows admitted by an update, then held and unknown ids looked up
  // together, against the same on a 1-thread backend.
  CpuBackendOptions three;
  three.num_threads = 3;
  auto many = CreateCpuBackend(three);
  ASSERT_TRUE(many.ok());
  std::unique_ptr<EmbeddingBackend> be[2] = {WithDynamicShards(Cpu()),
                                             WithDynamicShards(*std::move(many))};
  const ShardSpec spec = SpecOf(OptimizerType::kSgd, 30000, DynamicConfig{});
  std::vector<int64_t> held(20000), asked;
  for (int64_t i = 0; i < 20000; ++i) held[i] = (i * 2654435761) ^ (i << 40);
  for (int64_t i = 0; i < 30000; ++i) asked.push_back(i % 3 == 0 ? -i - 5 : held[(i * 7) % 20000]);
  std::vector<float> out[2];
  for (int k = 0; k < 2; ++k) {
    auto id = be[k]->CreateShard(spec);
    ASSERT_TRUE(id.ok()) << id.status();
    const std::vector<int64_t> one(held.size(), 1);
    const std::vector<float> grad(held.size() * kDim, 0.5f);
    ASSERT_TRUE(be[k]->ApplyGradients({GradientRequest{
                    FeatureRequest{*id, Pooling::kNone, one, held, {}}, grad}})
                    .ok());
    const std::vector<int64_t> lengths(asked.size(), 1);
    out[k].assign(asked.size() * kDim, -1.0f);
    ASSERT_TRUE(be[k]->Lookup({LookupRequest{FeatureRequest{*id, Pooling::kNone, lengths, asked, {}},
                                             absl::MakeSpan(out[k])}})
                    .ok());
  }
  EXPECT_EQ(out[1], out[0]);
  // Unknown ids read zeros; held ones their (updated) rows.
  for (int64_t d = 0; d < kDim; ++d) EXPECT_EQ(out[0][d], 0.0f);
  EXPECT_NE(out[0][kDim], 0.0f);
}

TEST(DynamicBackendMoves, SlotsAndRowsCopiedToAnotherBackendServeTheSame) {
  Fixture a(5, OptimizerType::kAdagrad), b(5, OptimizerType::kAdagrad);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(a.Update({i * 3 - 7, i, 100}, 0.25f * i).ok());
  std::vector<EmbeddingBackend::SlotMeta> meta(5);
  ASSERT_TRUE(a.be->ExportSlots(a.id, 0, 5, absl::MakeSpan(meta)).ok());
  std::vector<float> w(5 * kDim), st(5 * kDim);
  ASSERT_TRUE(a.be->ExportRows(a.id, 0, 5, absl::MakeSpan(w), absl::MakeSpan(st)).ok());
  auto step = a.be->ExportStep(a.id);
  ASSERT_TRUE(b.be->ImportRows(b.id, 0, 5, w, st).ok());
  ASSERT_TRUE(b.be->ImportSlots(b.id, 0, 5, meta).ok());
  ASSERT_TRUE(b.be->ImportStep(b.id, *step).ok());
  EXPECT_EQ(Held(*b.be, b.id, 5), Held(*a.be, a.id, 5));
  const std::vector<int64_t> probe = {-7, 0, 7, 100, 14, 42};
  EXPECT_EQ(b.Lookup(probe), a.Lookup(probe));
  // They go on alike: the same evictions, the same rows.
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(a.Update({50 + i, 100}, 1.0f).ok());
    ASSERT_TRUE(b.Update({50 + i, 100}, 1.0f).ok());
  }
  EXPECT_EQ(Held(*b.be, b.id, 5), Held(*a.be, a.id, 5));
  EXPECT_EQ(b.Lookup(probe), a.Lookup(probe));
  // An id held twice is refused, nothing changed.
  meta[1] = meta[0];
  EXPECT_EQ(b.be->ImportSlots(b.id, 0, 5, meta).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.Lookup(probe), a.Lookup(probe));
}

TEST(DynamicBackendImports, ImportIdsWritesRowsAndEvictsByThePolicy) {
  Fixture f(3);
  ASSERT_TRUE(f.Update({1}, 1.0f).ok());
  const std::vector<int64_t> ids = {8, 9};
  const std::vector<float> w = {1, 2, 3, 4, 5, 6, 7, 8};
  ASSERT_TRUE(f.be->ImportIds(f.id, ids, w, {}).ok());
  EXPECT_EQ(f.Lookup({8, 9}), w);
  // Full: 1 (oldest) makes room for 10.
  const std::vector<float> w10 = {9, 9, 9, 9};
  ASSERT_TRUE(f.be->ImportIds(f.id, std::vector<int64_t>{10}, w10, {}).ok());
  std::vector<int64_t> held;
  for (const auto& [id, s] : Held(*f.be, f.id, 3)) held.push_back(id);
  EXPECT_EQ(held, (std::vector<int64_t>{8, 9, 10}));
  // Bad values and more new ids than fit are refused whole.
  const std::vector<float> nan_row = {1, std::nanf(""), 1, 1};
  EXPECT_EQ(f.be->ImportIds(f.id, std::vector<int64_t>{11}, nan_row, {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(f.be->ImportIds(f.id, std::vector<int64_t>{11, 12, 13, 14},
                            std::vector<float>(16, 1.0f), {})
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(f.Lookup({8, 9}), w);
}

TEST(DynamicBackendInit, AnIdsInitialRowDependsOnItAloneNotOnItsSlotOrShard) {
  Fixture a(4), b(16);
  ASSERT_TRUE(a.Update({3, -99}, 0.0f).ok());
  ASSERT_TRUE(b.Update({77, 5, -99}, 0.0f).ok());
  // SGD with a zero gradient: the initial rows. b's spec has another
  // capacity (the default initializer's bound is the table's), so compare
  // against InitialValues of each.
  std::vector<float> want(kDim);
  InitialValues(a.spec.initializer, 4, -99, 1, 0, kDim, want.data());
  EXPECT_EQ(a.Lookup({-99}), want);
  InitialValues(b.spec.initializer, 16, -99, 1, 0, kDim, want.data());
  EXPECT_EQ(b.Lookup({-99}), want);
}

// Over a backend that finds keys (the CUDA kernels' emulation) whose
// syncs can be made to fail: a failed sync leaves the update applied and
// the shard's lookups mapped here (not keyed: no stale copy is read), ids
// in device memory answered UNAVAILABLE; the next update's sync catches up
// and lookups go keyed again, all equal to the CPU backend's. A caller's
// keyed request is refused: keys are the wrapper's to hand on.
class FlakySync : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status SyncKeyIndex(ShardId id, const math::KeyLine* lines, int64_t count,
                            absl::Span<const int64_t> changed) override {
    if (fail) return absl::UnavailableError("sync failed (test)");
    return ForwardingBackend::SyncKeyIndex(id, lines, count, changed);
  }
  absl::Status Lookup(absl::Span<const LookupRequest> r) override {
    last_keyed = !r.empty() && r[0].feature.keyed;
    return ForwardingBackend::Lookup(r);
  }
  bool fail = false;
  bool last_keyed = false;
};

TEST(DynamicBackendTest, AFailedKeySyncFallsBackToTheHostFindUntilTheNextUpdate) {
  auto flaky = std::make_unique<FlakySync>(CreateEmulatedCudaBackend());
  FlakySync* inner = flaky.get();
  auto dyn = WithDynamicShards(std::move(flaky));
  auto ref = WithDynamicShards(Cpu());
  const ShardSpec spec = SpecOf(OptimizerType::kSgd, 8, DynamicConfig{});
  auto a = dyn->CreateShard(spec);
  auto b = ref->CreateShard(spec);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const std::vector<int64_t> lengths = {2, 2}, grad_len = {2, 2};
  std::vector<float> grad(2 * kDim, 0.5f);
  auto update = [&](std::vector<int64_t> ids) {
    for (EmbeddingBackend* be : {dyn.get(), ref.get()}) {
      const ShardId id = be == dyn.get() ? *a : *b;
      const GradientRequest r{FeatureRequest{id, Pooling::kSum, lengths, ids, {}}, grad};
      ASSERT_TRUE(be->ApplyGradients({r}).ok());
    }
  };
  auto same_lookups = [&](bool keyed) {
    const std::vector<int64_t> ids = {-5, 1LL << 50, 77, 12};
    std::vector<float> out_a(2 * kDim), out_b(2 * kDim);
    ASSERT_TRUE(dyn->Lookup({LookupRequest{FeatureRequest{*a, Pooling::kSum, lengths, ids, {}},
                                           absl::MakeSpan(out_a)}})
                    .ok());
    ASSERT_TRUE(ref->Lookup({LookupRequest{FeatureRequest{*b, Pooling::kSum, lengths, ids, {}},
                                           absl::MakeSpan(out_b)}})
                    .ok());
    EXPECT_EQ(out_a, out_b);
    EXPECT_EQ(inner->last_keyed, keyed);
  };
  update({-5, 1LL << 50, 3, 4});
  same_lookups(/*keyed=*/true);
  inner->fail = true;
  update({77, 12, -5, 9});  // applied; its sync fails
  same_lookups(/*keyed=*/false);
  std::vector<float> out(2 * kDim);
  FeatureRequest on_device{*a, Pooling::kSum, lengths, grad_len, {}};
  on_device.on_device = true;
  EXPECT_EQ(dyn->Lookup({LookupRequest{on_device, absl::MakeSpan(out)}}).code(),
            absl::StatusCode::kUnavailable);
  inner->fail = false;
  update({3, 3, 4, 4});  // its sync brings the copy up to date
  same_lookups(/*keyed=*/true);
  FeatureRequest keyed{*a, Pooling::kSum, lengths, grad_len, {}};
  keyed.keyed = true;
  EXPECT_EQ(dyn->Lookup({LookupRequest{keyed, absl::MakeSpan(out)}}).code(),
            absl::StatusCode::kInvalidArgument);
}

// An update that would overflow a row is refused naming the row's id, not
// the slot the wrapped backend holds it in; nothing of it is applied.
// A backend whose row writes fail once `writes_left` reaches 0 (a tier
// below memory on a full disk).
class FailingWrites : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status ImportRowsAt(ShardId id, absl::Span<const int64_t> rows,
                            absl::Span<const float> weights,
                            absl::Span<const float> state) override {
    if (writes_left-- <= 0) return absl::ResourceExhaustedError("disk full (test)");
    return ForwardingBackend::ImportRowsAt(id, rows, weights, state);
  }
  int writes_left = 1 << 30;
};

// A refused update whose rollback cannot write back the rows its
// admissions replaced says so: DATA_LOSS with both reasons, not the
// refusal alone (the evicted ids are held again without their rows).
TEST(DynamicBackendRefusals, ARollbackThatCannotPutRowsBackIsDataLoss) {
  auto owned = std::make_unique<FailingWrites>(Cpu());
  FailingWrites* inner = owned.get();
  auto be = WithDynamicShards(std::move(owned));
  ShardSpec spec = SpecOf(OptimizerType::kSgd, 2, DynamicConfig{});
  spec.optimizer.learning_rate = 10.0f;
  auto id = be->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  auto update = [&](std::vector<int64_t> ids, float g) {
    std::vector<int64_t> lengths(ids.size(), 1);
    std::vector<float> grad(ids.size() * kDim, g);
    return be->ApplyGradients(
        {GradientRequest{FeatureRequest{*id, Pooling::kSum, lengths, ids, {}}, grad}});
  };
  ASSERT_TRUE(update({11, 12}, 0.5f).ok());  // full
  // Id 13 evicts 11's row, then the wrapped backend refuses the update
  // (w - 10 * -3e38 is beyond fp32) and the rollback's write fails.
  inner->writes_left = 1;  // the admission's write, not the rollback's
  const absl::Status s = update({13}, -3e38f);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("could not be put back"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("disk full (test)"));
  // With the write working, the same refusal is the refusal alone.
  inner->writes_left = 1 << 30;
  const absl::Status again = update({13}, -3e38f);
  EXPECT_EQ(again.code(), absl::StatusCode::kInvalidArgument) << again;
  EXPECT_TRUE(IsOverflowRefusal(again)) << again;
}

TEST(DynamicBackendTest, AnOverflowRefusalNamesTheId) {
  auto be = WithDynamicShards(Cpu());
  ShardSpec spec = SpecOf(OptimizerType::kSgd, 8, DynamicConfig{});
  spec.optimizer.learning_rate = 10.0f;
  auto id = be->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  const std::vector<int64_t> one = {1};
  const std::vector<int64_t> ids = {int64_t{1} << 40, -77};  // slots 0 and 1
  for (int64_t key : ids) {
    const std::vector<int64_t> k = {key};
    const std::vector<float> g(kDim, 0.5f);
    ASSERT_TRUE(be->ApplyGradients({GradientRequest{FeatureRequest{*id, Pooling::kSum, one, k, {}},
                                                    g}})
                    .ok());
  }
  const auto held = Held(*be, *id, 8);
  ASSERT_EQ(held.at(-77), 1);
  const Rows before = RowOf(*be, *id, spec, 1);
  const std::vector<int64_t> k = {-77};
  const std::vector<float> g(kDim, -3e38f);  // w + 10 * 3e38: beyond fp32
  const absl::Status s =
      be->ApplyGradients({GradientRequest{FeatureRequest{*id, Pooling::kSum, one, k, {}}, g}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), testing::HasSubstr("table 't': id -77 column "));
  EXPECT_TRUE(IsOverflowRefusal(s)) << s;
  EXPECT_EQ(RowOf(*be, *id, spec, 1).w, before.w);
  EXPECT_EQ(Held(*be, *id, 8), held);
}

}  // namespace
}  // namespace backend
}  // namespace ember
