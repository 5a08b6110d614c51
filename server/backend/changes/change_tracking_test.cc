// Change tracking against an independent reference: every row's values are
// exported before and after random updates and imports; a row whose values
// differ must be among ChangedRows, and ChangedRows must be exactly the rows
// the test itself named since the mark (a naive set). Marks of another
// shard or lineage are refused; a dynamic shard's changed slots cover every
// slot whose row changed and never its zero slot.
#include "server/backend/changes/change_tracking.h"

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/dynamic/dynamic_backend.h"

namespace ember {
namespace backend {
namespace {

constexpr int64_t kRows = 500, kDim = 8;

std::unique_ptr<EmbeddingBackend> Tracked(bool dynamic = false) {
  auto cpu = CreateCpuBackend(CpuBackendOptions());
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  auto tracked = WithChangeTracking(*std::move(cpu));
  return dynamic ? WithDynamicShards(std::move(tracked)) : std::move(tracked);
}

ShardSpec Spec(OptimizerType opt, bool dynamic = false) {
  ShardSpec s;
  s.table = "t";
  s.rows = kRows;
  s.dim = kDim;
  s.table_rows = kRows;
  s.optimizer.type = opt;
  s.optimizer.learning_rate = 0.1f;
  s.initializer.seed = 3;
  if (dynamic) {
    s.is_dynamic = true;
    s.dynamic.admit_after = 1;
  }
  return s;
}

std::vector<float> All(EmbeddingBackend& b, ShardId id, const ShardSpec& s) {
  const int64_t sw = OptimizerStateWidth(s.optimizer.type, s.dim);
  std::vector<float> w(s.rows * s.dim), st(s.rows * sw);
  EXPECT_TRUE(b.ExportRows(id, 0, s.rows, absl::MakeSpan(w), absl::MakeSpan(st)).ok());
  std::vector<float> out;
  for (int64_t r = 0; r < s.rows; ++r) {
    out.insert(out.end(), w.begin() + r * s.dim, w.begin() + (r + 1) * s.dim);
    out.insert(out.end(), st.begin() + r * sw, st.begin() + (r + 1) * sw);
  }
  return out;
}

// Rows whose exported values differ between two exports.
std::set<int64_t> Differing(const std::vector<float>& a, const std::vector<float>& b,
                            int64_t per_row) {
  std::set<int64_t> rows;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) rows.insert(static_cast<int64_t>(i) / per_row);
  }
  return rows;
}

// One pooled SUM update of `ids` (one bag each), gradients random.
absl::Status Update(EmbeddingBackend& b, ShardId id, const std::vector<int64_t>& ids,
                    std::mt19937* rng) {
  std::vector<int64_t> lengths(ids.size(), 1);
  std::vector<float> grad(ids.size() * kDim);
  for (float& g : grad) g = std::uniform_real_distribution<float>(-1, 1)(*rng);
  GradientRequest r;
  r.feature.shard = id;
  r.feature.lengths = lengths;
  r.feature.ids = ids;
  r.grad = grad;
  return b.ApplyGradients({r});
}

TEST(ChangeTrackingTest, ChangedRowsAreExactlyTheRowsNamedSinceTheMark) {
  for (OptimizerType opt : {OptimizerType::kSgd, OptimizerType::kAdagrad,
                            OptimizerType::kRowwiseAdagrad, OptimizerType::kAdam}) {
    SCOPED_TRACE(static_cast<int>(opt));
    auto b = Tracked();
    const ShardSpec spec = Spec(opt);
    auto id = b->CreateShard(spec);
    ASSERT_TRUE(id.ok());
    const int64_t per_row = kDim + OptimizerStateWidth(opt, kDim);
    std::mt19937 rng(static_cast<int>(opt) + 1);
    std::vector<EmbeddingBackend::ChangeMark> marks;
    std::vector<std::vector<float>> at_mark;
    std::vector<std::set<int64_t>> named;  // per mark: rows named since
    for (int round = 0; round < 4; ++round) {
      auto mark = b->MarkChanges(*id);
      ASSERT_TRUE(mark.ok()) << mark.status();
      if (!marks.empty()) {
        EXPECT_EQ(mark->lineage, marks.back().lineage);
        EXPECT_EQ(mark->generation, marks.back().generation + 1);
      }
      marks.push_back(*mark);
      at_mark.push_back(All(*b, *id, spec));
      named.emplace_back();
      // About 2% of rows per update, some twice; and an import of a range.
      for (int u = 0; u < 3; ++u) {
        std::vector<int64_t> ids(10);
        for (int64_t& i : ids) i = std::uniform_int_distribution<int64_t>(0, kRows - 1)(rng);
        ASSERT_TRUE(Update(*b, *id, ids, &rng).ok());
        for (auto& s : named) s.insert(ids.begin(), ids.end());
      }
      if (round == 2) {
        const int64_t sw = OptimizerStateWidth(opt, kDim);
        std::vector<float> w(3 * kDim, 0.5f), st(3 * sw, 0.25f);
        ASSERT_TRUE(b->ImportRows(*id, 100, 103, w, st).ok());
        for (auto& s : named) s.insert({100, 101, 102});
      }
      // A refused update names no row of the shard (its one id is out of range).
      ASSERT_FALSE(Update(*b, *id, {kRows + 5}, &rng).ok());
    }
    const std::vector<float> now = All(*b, *id, spec);
    for (size_t m = 0; m < marks.size(); ++m) {
      auto rows = b->ChangedRows(*id, marks[m]);
      ASSERT_TRUE(rows.ok()) << rows.status();
      EXPECT_EQ(std::set<int64_t>(rows->begin(), rows->end()), named[m]) << "mark " << m;
      EXPECT_TRUE(std::is_sorted(rows->begin(), rows->end()));
      for (int64_t r : Differing(at_mark[m], now, per_row)) {
        EXPECT_TRUE(std::binary_search(rows->begin(), rows->end(), r)) << "row " << r;
      }
      // A range gives the same rows, those inside it (end clamped).
      for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{
               {0, 0}, {0, 101}, {101, 350}, {350, kRows + 100}, {kRows, kRows}}) {
        auto in = b->ChangedRowsIn(*id, marks[m], begin, end);
        ASSERT_TRUE(in.ok()) << in.status();
        std::vector<int64_t> want;
        for (int64_t r : *rows) {
          if (r >= begin && r < end) want.push_back(r);
        }
        EXPECT_EQ(*in, want) << "mark " << m << " rows [" << begin << ", " << end << ")";
      }
    }
  }
}

TEST(ChangeTrackingTest, ForeignOrFutureMarksAreRefused) {
  auto b = Tracked();
  auto a = b->CreateShard(Spec(OptimizerType::kSgd));
  auto c = b->CreateShard(Spec(OptimizerType::kSgd));
  ASSERT_TRUE(a.ok() && c.ok());
  auto ma = b->MarkChanges(*a);
  auto mc = b->MarkChanges(*c);
  ASSERT_TRUE(ma.ok() && mc.ok());
  EXPECT_NE(ma->lineage, mc->lineage);
  EXPECT_EQ(b->ChangedRows(*a, *mc).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->ChangedRows(*a, {ma->lineage, ma->generation + 1}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->ChangedRows(*a, {ma->lineage, 0}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b->ChangedRows(99, *ma).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b->ChangedRowsIn(*a, *ma, -1, 5).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b->ChangedRowsIn(*a, *ma, 6, 5).status().code(), absl::StatusCode::kInvalidArgument);
  // A shard made again (dropped, re-created) starts a new lineage.
  ASSERT_TRUE(b->DropShard(*a).ok());
  auto again = b->CreateShard(Spec(OptimizerType::kSgd));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(b->ChangedRows(*again, *ma).status().code(), absl::StatusCode::kFailedPrecondition);
  auto fresh = b->ChangedRows(*c, *mc);
  ASSERT_TRUE(fresh.ok());
  EXPECT_TRUE(fresh->empty());
}

TEST(ChangeTrackingTest, DynamicShardsReportChangedSlotsWithoutTheZeroSlot) {
  auto b = Tracked(/*dynamic=*/true);
  const ShardSpec spec = Spec(OptimizerType::kAdagrad, /*dynamic=*/true);
  auto id = b->CreateShard(spec);
  ASSERT_TRUE(id.ok()) << id.status();
  std::mt19937 rng(5);
  // Fill most slots, mark, then update a few held ids and admit new ones
  // (evicting by LRU once full).
  std::vector<int64_t> first;
  for (int64_t i = 0; i < kRows - 20; ++i) first.push_back(int64_t{1} << 40 | i);
  ASSERT_TRUE(Update(*b, *id, first, &rng).ok());
  auto mark = b->MarkChanges(*id);
  ASSERT_TRUE(mark.ok());
  const std::vector<float> before = All(*b, *id, spec);
  std::vector<int64_t> next = {first[3], first[77], first[400]};
  for (int64_t i = 0; i < 40; ++i) next.push_back(-(i + 1));  // 40 new: 20 free, 20 evicted
  ASSERT_TRUE(Update(*b, *id, next, &rng).ok());
  auto rows = b->ChangedRows(*id, *mark);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->size(), 43u);  // 3 updated slots, 40 written by admissions
  EXPECT_LT(rows->back(), kRows);
  const std::vector<float> after = All(*b, *id, spec);
  for (int64_t r : Differing(before, after, kDim + kDim)) {
    EXPECT_TRUE(std::binary_search(rows->begin(), rows->end(), r)) << "slot " << r;
  }
}

}  // namespace
}  // namespace backend
}  // namespace ember
