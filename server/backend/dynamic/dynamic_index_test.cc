// DynamicIndex against a naive model of its rules (a map of rows and a map
// of counts, every decision by a full scan), under random streams; and the
// rules worked by hand: LRU and LFU order, TTL, admission at 3, no room,
// rollback.
#include "server/backend/dynamic/dynamic_index.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/dynamic/naive_dynamic_model.h"

namespace ember {
namespace backend {
namespace {

using ::ember::MixId;
using ::ember::RouteRow;

std::vector<int64_t> HeldIds(const DynamicIndex& x) {
  std::vector<int64_t> ids, slots;
  x.Held(&ids, &slots);
  return ids;
}

// Every held id is found at its slot, every slot distinct and in range.
void ExpectConsistent(const DynamicIndex& x) {
  std::vector<int64_t> ids, slots;
  x.Held(&ids, &slots);
  std::vector<int64_t> seen = slots;
  std::sort(seen.begin(), seen.end());
  EXPECT_TRUE(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(x.Find(ids[i]), slots[i]) << "id " << ids[i];
    ASSERT_GE(slots[i], 0);
    ASSERT_LT(slots[i], x.capacity());
  }
  // FindAll, both ways of comparing a line, against Find one id at a time:
  // held ids, and ids next to them (mostly absent: a probe that ends at an
  // empty entry or runs past full lines).
  std::vector<int64_t> queries = ids, expect = slots;
  for (const int64_t id : ids) {
    for (const int64_t other : {id + 1, -id, id ^ (int64_t{1} << 62)}) {
      queries.push_back(other);
      const int64_t s = x.Find(other);
      expect.push_back(s >= 0 ? s : -7);
    }
  }
  for (const auto probe : {DynamicIndex::Probe::kByCpu, DynamicIndex::Probe::kPortable}) {
    std::vector<int64_t> found(queries.size());
    x.FindAll(queries, -7, found.data(), probe);
    EXPECT_EQ(found, expect) << "probe " << static_cast<int>(probe);
  }
}

// A copy of the index kept as a backend that finds ids itself keeps it
// (SyncKeyIndex): whole once, then only the lines TakeChangedLines names.
class KeyIndexCopy {
 public:
  explicit KeyIndexCopy(DynamicIndex* x) : x_(x) {
    x->TrackChangedLines();
    lines_.assign(x->lines(), x->lines() + x->line_count());
  }
  // Takes the changed lines; then the copy must equal the index byte for
  // byte, and KeyProbe on it find what Find finds.
  void SyncAndCheck(absl::Span<const int64_t> queries) {
    for (const int64_t k : x_->TakeChangedLines()) {
      ASSERT_GE(k, 0);
      ASSERT_LT(k, x_->line_count());
      lines_[k] = x_->lines()[k];
    }
    EXPECT_TRUE(x_->TakeChangedLines().empty());
    ASSERT_EQ(std::memcmp(lines_.data(), x_->lines(), lines_.size() * sizeof(math::KeyLine)), 0)
        << "a changed line was not named";
    for (const int64_t id : queries) {
      const int64_t want = x_->Find(id);
      ASSERT_EQ(math::KeyProbe(lines_.data(), x_->mask(), id, -7), want < 0 ? -7 : want)
          << "id " << id;
    }
  }

 private:
  DynamicIndex* x_;
  std::vector<math::KeyLine> lines_;
};

struct Case {
  int64_t capacity, admit_after, ttl;
  Eviction eviction;
  int64_t universe;  // ids drawn from [-universe, universe)
  int steps = 400;    // enough more compact the queues (Commit) many times
};

class DynamicIndexModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(DynamicIndexModelTest, AgreesWithTheNaiveModelAndRollsBackExactly) {
  const Case c = GetParam();
  DynamicConfig config;
  config.admit_after = c.admit_after;
  config.ttl_steps = c.ttl;
  config.eviction = c.eviction;
  DynamicIndex x(c.capacity, config);
  KeyIndexCopy copy(&x);
  NaiveDynamicModel m(c.capacity, config);
  std::mt19937_64 rng(c.capacity * 131 + c.admit_after * 7 + c.ttl);
  // Skewed ids: a hot few and a long tail, negative and huge ones too.
  std::uniform_int_distribution<int64_t> any(-c.universe, c.universe - 1);
  std::uniform_int_distribution<int> len(0, 24);
  for (int step = 0; step < c.steps; ++step) {
    std::vector<int64_t> ids;
    for (int i = len(rng); i > 0; --i) {
      const int64_t id = any(rng);
      ids.push_back(rng() % 3 == 0 ? id % 5 : id * int64_t{1000003});
    }
    if (step % 7 == 3) {  // an update that is rolled back changes nothing
      const std::vector<int64_t> before = HeldIds(x);
      const DynamicStats s0 = x.Stats();
      std::vector<int64_t> slots_before, unused;
      x.Held(&unused, &slots_before);
      x.BeginUpdate(ids);
      x.Rollback();
      std::vector<int64_t> slots_after;
      x.Held(&unused, &slots_after);
      EXPECT_EQ(HeldIds(x), before);
      EXPECT_EQ(slots_after, slots_before);
      EXPECT_EQ(x.Stats().steps, s0.steps);
      EXPECT_EQ(x.Stats().admitted, s0.admitted);
      EXPECT_EQ(x.Stats().pending_ids, s0.pending_ids);
      copy.SyncAndCheck(ids);
    }
    if (step % 11 == 5) {  // an import of a few distinct ids, some held
      std::vector<int64_t> some = HeldIds(x);
      some.resize(std::min<size_t>(some.size(), 2));
      for (int i = 0; i < 3; ++i) some.push_back(any(rng) * 7919 + 13);
      std::sort(some.begin(), some.end());
      some.erase(std::unique(some.begin(), some.end()), some.end());
      if (static_cast<int64_t>(some.size()) <= c.capacity) {
        auto imported = x.BeginImport(some);
        ASSERT_TRUE(imported.ok()) << imported.status();
        x.Commit();
        m.Import(some);
        ASSERT_EQ(HeldIds(x), m.Held()) << "import at step " << step;
        copy.SyncAndCheck(some);
      }
    }
    const auto created = x.BeginUpdate(ids);
    for (const auto& cr : created) EXPECT_EQ(x.Find(cr.id), cr.slot);
    x.Commit();
    m.Update(ids);
    ASSERT_EQ(HeldIds(x), m.Held()) << "step " << step;
    ExpectConsistent(x);
    std::vector<int64_t> queries = HeldIds(x);
    queries.insert(queries.end(), ids.begin(), ids.end());
    copy.SyncAndCheck(queries);
    ASSERT_LE(x.Stats().rows_held, c.capacity);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, DynamicIndexModelTest,
    ::testing::Values(Case{8, 1, 0, Eviction::kLru, 20}, Case{8, 1, 0, Eviction::kLfu, 20},
                      Case{16, 3, 0, Eviction::kLru, 30}, Case{16, 2, 0, Eviction::kLfu, 30},
                      Case{12, 1, 3, Eviction::kLru, 25}, Case{12, 2, 4, Eviction::kLfu, 25},
                      Case{64, 1, 0, Eviction::kLru, 1000}, Case{3, 1, 0, Eviction::kLfu, 6},
                      Case{8, 1, 0, Eviction::kLru, 20, 3000}, Case{12, 1, 3, Eviction::kLru, 25, 3000},
                      Case{16, 2, 0, Eviction::kLfu, 30, 3000}));

TEST(DynamicIndexTest, PendingCountsMoveToAnotherIndexAndAdmitThere) {
  DynamicConfig config;
  config.admit_after = 3;
  DynamicIndex a(8, config);
  auto step = [](DynamicIndex* x, std::vector<int64_t> ids) {
    x->BeginUpdate(ids);
    x->Commit();
  };
  step(&a, {5, 5, -9, 7});  // 5: 2, -9: 1, 7: 1
  step(&a, {7, 7});          // 7: 3, admitted
  EXPECT_EQ(a.PendingCounts(), (std::vector<int64_t>{-9, 1, 5, 2}));
  // Restored elsewhere (7 held there too: its count is done with).
  DynamicIndex b(8, config);
  step(&b, {7, 7, 7});
  step(&b, {11});  // a count the restore replaces
  ASSERT_TRUE(b.RestorePendingCounts({-9, 1, 5, 2, 7, 2}).ok());
  EXPECT_EQ(b.PendingCounts(), (std::vector<int64_t>{-9, 1, 5, 2}));
  EXPECT_EQ(b.Stats().pending_ids, 2);
  step(&b, {5, -9});  // 5 reaches 3; -9 is at 2
  EXPECT_EQ(HeldIds(b), (std::vector<int64_t>{5, 7}));
  step(&b, {-9});
  EXPECT_EQ(HeldIds(b), (std::vector<int64_t>{-9, 5, 7}));
  // Refused whole: an odd length, a count below 1.
  const std::vector<int64_t> before = a.PendingCounts();
  EXPECT_EQ(a.RestorePendingCounts({1, 2, 3}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.RestorePendingCounts({1, 2, 3, 0}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.PendingCounts(), before);
}

TEST(DynamicIndexTest, EvictionOrderSurvivesCompactingTheQueues) {
  // Rows 2, 3, 4 stay unwritten while row 1 is written 6,000 times: the
  // queues pass their compaction bound (3 x held + 4096 entries) and are
  // compacted; the rows written longest ago must still go first.
  for (const Eviction policy : {Eviction::kLru, Eviction::kLfu}) {
    DynamicConfig config;
    config.eviction = policy;
    DynamicIndex x(4, config);
    auto step = [&](std::vector<int64_t> ids) {
      x.BeginUpdate(ids);
      x.Commit();
    };
    step({1, 2, 3, 4});
    for (int i = 0; i < 6000; ++i) step({1});
    step({5});
    EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 3, 4, 5})) << static_cast<int>(policy);
    step({6});
    EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 4, 5, 6})) << static_cast<int>(policy);
  }
}

TEST(DynamicIndexTest, LruEvictsTheRowWrittenLongestAgoTiesByFirstOccurrence) {
  DynamicIndex x(3, DynamicConfig{});
  auto step = [&](std::vector<int64_t> ids) {
    x.BeginUpdate(ids);
    x.Commit();
  };
  step({30, 10, 30});  // 30 then 10 at step 1 (first occurrences)
  step({20});          // 20 at step 2
  step({40});          // full: 30 (written first at step 1) goes
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{10, 20, 40}));
  step({10, 50});  // 10 refreshed; 20 (step 2) goes
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{10, 40, 50}));
  EXPECT_EQ(x.Stats().evicted_lru, 2);
  EXPECT_EQ(x.Stats().admitted, 5);
}

TEST(DynamicIndexTest, LfuEvictsTheFewestUpdatedThenTheOldest) {
  DynamicConfig c;
  c.eviction = Eviction::kLfu;
  DynamicIndex x(3, c);
  auto step = [&](std::vector<int64_t> ids) {
    x.BeginUpdate(ids);
    x.Commit();
  };
  step({1, 2, 3});  // all once
  step({1, 1, 1});  // occurrences in one step count once: 1 twice
  step({2});        // 2 twice
  step({4});        // 3 (once) goes
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 2, 4}));
  step({5});  // 4 (once) goes, though it is the newest
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 2, 5}));
  step({2, 6});  // 5 (once) goes; 1 and 2 stay
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 2, 6}));
  EXPECT_EQ(x.Stats().evicted_lfu, 3);
}

TEST(DynamicIndexTest, TtlEvictsAtTheStartOfTheStepAfterExpiry) {
  DynamicConfig c;
  c.ttl_steps = 2;
  DynamicIndex x(10, c);
  auto step = [&](std::vector<int64_t> ids) {
    x.BeginUpdate(ids);
    x.Commit();
  };
  step({7});  // step 1
  step({});   // 2
  step({});   // 3: age 2, kept
  EXPECT_EQ(HeldIds(x), std::vector<int64_t>{7});
  step({8});  // 4: age 3 > 2, evicted
  EXPECT_EQ(HeldIds(x), std::vector<int64_t>{8});
  EXPECT_EQ(x.Stats().evicted_ttl, 1);
  EXPECT_EQ(x.Find(7), -1);
}

TEST(DynamicIndexTest, AdmissionCountsOccurrencesAndAnEvictedIdStartsOver) {
  DynamicConfig c;
  c.admit_after = 3;
  DynamicIndex x(1, c);
  auto step = [&](std::vector<int64_t> ids) {
    x.BeginUpdate(ids);
    x.Commit();
  };
  step({-5, -5});  // count 2
  EXPECT_EQ(x.Find(-5), -1);
  EXPECT_EQ(x.Stats().dropped_pending, 2);
  EXPECT_EQ(x.Stats().pending_ids, 1);
  step({-5});  // 3: admitted
  EXPECT_GE(x.Find(-5), 0);
  EXPECT_EQ(x.Stats().pending_ids, 0);
  step({9, 9, 9});  // admitted, evicting -5
  EXPECT_EQ(HeldIds(x), std::vector<int64_t>{9});
  step({-5});  // starts over: count 1
  EXPECT_EQ(HeldIds(x), std::vector<int64_t>{9});
  EXPECT_EQ(x.Stats().pending_ids, 1);
}

TEST(DynamicIndexTest, RowsOfTheCurrentStepAreNeverEvictedByIt) {
  DynamicIndex x(2, DynamicConfig{});
  const auto created = x.BeginUpdate(std::vector<int64_t>{1, 2, 3});
  x.Commit();
  EXPECT_EQ(created.size(), 2u);
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(x.Stats().dropped_no_room, 1);
  // The next step has room for 3 (1 and 2 are older).
  x.BeginUpdate(std::vector<int64_t>{3});
  x.Commit();
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{2, 3}));
}

TEST(DynamicIndexTest, ImportsPlaceRowsAndRefuseMoreThanFitsWholesale) {
  DynamicIndex x(3, DynamicConfig{});
  auto a = x.BeginImport(std::vector<int64_t>{5, 6});
  ASSERT_TRUE(a.ok());
  x.Commit();
  auto b = x.BeginImport(std::vector<int64_t>{1, 2, 3, 4});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{5, 6}));
  auto d = x.BeginImport(std::vector<int64_t>{7, 7});
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  auto e = x.BeginImport(std::vector<int64_t>{6, 8, 9});  // 5 makes room (LRU)
  ASSERT_TRUE(e.ok());
  x.Commit();
  EXPECT_EQ(HeldIds(x), (std::vector<int64_t>{6, 8, 9}));
  EXPECT_EQ(x.Stats().evicted_import, 1);
}

TEST(DynamicIndexTest, PendingCountsPastTheBoundGoToTheSketch) {
  DynamicConfig c;
  c.admit_after = 2;
  DynamicIndex x(100, c, /*max_pending_ids=*/4);
  std::vector<int64_t> first;
  for (int64_t id = 0; id < 10; ++id) first.push_back(id);
  x.BeginUpdate(first);
  x.Commit();
  EXPECT_EQ(x.Stats().pending_ids, 4);
  EXPECT_EQ(x.Stats().sketch_counts, 6);
  x.BeginUpdate(first);  // every id reaches 2, exact or sketched
  x.Commit();
  EXPECT_EQ(HeldIds(x), first);
}

// The sketch's counts move too: restored elsewhere (exact counts, then the
// sketch merged), every id reaches admission there on the same update as
// here; without the sketch the sketched ones would start over. A sketch of
// another size is refused, nothing changed.
TEST(DynamicIndexTest, SketchedCountsMoveToAnotherIndexAndAdmitThere) {
  DynamicConfig c;
  c.admit_after = 3;
  DynamicIndex a(100, c, /*max_pending_ids=*/4);
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < 10; ++id) ids.push_back(id * 1000003 - 5);
  for (int k = 0; k < 2; ++k) {  // every id at 2: 4 exact, 6 sketched
    a.BeginUpdate(ids);
    a.Commit();
  }
  ASSERT_EQ(a.PendingSketch().size(), DynamicIndex::kSketchCounters);
  DynamicIndex b(100, c, /*max_pending_ids=*/4), without(100, c, /*max_pending_ids=*/4);
  ASSERT_TRUE(b.RestorePendingCounts(a.PendingCounts()).ok());
  ASSERT_TRUE(b.MergePendingSketch(a.PendingSketch()).ok());
  ASSERT_TRUE(without.RestorePendingCounts(a.PendingCounts()).ok());
  for (DynamicIndex* x : {&a, &b, &without}) {
    x->BeginUpdate(ids);
    x->Commit();
  }
  EXPECT_EQ(HeldIds(a), HeldIds(b));
  EXPECT_EQ(HeldIds(b).size(), ids.size());
  EXPECT_LT(HeldIds(without).size(), ids.size());
  const std::vector<uint32_t> kept = b.PendingSketch();
  EXPECT_EQ(b.MergePendingSketch({1, 2, 3}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b.PendingSketch(), kept);
  EXPECT_TRUE(b.MergePendingSketch({}).ok());
}

TEST(DynamicIndexTest, MemoryStaysWithinCapacityUnderTenTimesAsManyIds) {
  DynamicConfig c;
  c.admit_after = 1;
  DynamicIndex x(1000, c);
  for (int64_t b = 0; b < 100; ++b) {
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < 100; ++i) ids.push_back(static_cast<int64_t>(0x9e3779b97f4a7c15ull * static_cast<uint64_t>(b * 100 + i)));
    x.BeginUpdate(ids);
    x.Commit();
    ASSERT_LE(x.Stats().rows_held, 1000);
  }
  EXPECT_EQ(x.Stats().evicted_lru, 9000);
  ExpectConsistent(x);
}

TEST(DynamicIndexTest, RouteRowIsTheDocumentedMix) {
  // SplitMix64's finaliser of 1, worked in Python: 0x5692161d100b05e5.
  EXPECT_EQ(MixId(1), 0x5692161d100b05e5ull);
  EXPECT_EQ(RouteRow(1, 1000), static_cast<int64_t>(0x5692161d100b05e5ull % 1000));
  EXPECT_GE(RouteRow(-1, 7), 0);
}

// A restore (RestoreSlots) names every line it changes too: a copy synced
// by changed lines alone equals the restored index, and an index restored
// into another's place finds every id its source held.
TEST(DynamicIndexTest, RestoredSlotsNameTheLinesTheyChange) {
  DynamicConfig config;
  DynamicIndex source(64, config);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < 40; ++i) ids.push_back(i * 7919 - 100000);
  source.BeginUpdate(ids);
  source.Commit();
  std::vector<EmbeddingBackend::SlotMeta> meta(64);
  source.ExportSlots(0, 64, meta.data());
  DynamicIndex target(64, config);
  KeyIndexCopy copy(&target);
  target.BeginUpdate({5, 6, 7});  // rows the restore replaces
  target.Commit();
  copy.SyncAndCheck(ids);
  ASSERT_TRUE(target.RestoreSlots(0, 64, meta.data()).ok());
  copy.SyncAndCheck(ids);
  for (const int64_t id : ids) EXPECT_EQ(target.Find(id), source.Find(id)) << "id " << id;
  EXPECT_EQ(target.Find(5), -1);
}

}  // namespace
}  // namespace backend
}  // namespace ember
