// Request planning, worked by hand: descriptors, totals, key ranges, the
// radix sort's bit count, idle shards, and Layout's alignment.
#include "server/backend/cuda/request_plan.h"

#include <map>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace {


struct Fixture {
  std::map<ShardId, ShardSpec> specs;
  std::map<ShardId, int64_t> steps;
  std::vector<char> memory = std::vector<char>(64);
  ShardResolver resolver() {
    return [this](ShardId id) {
      ShardView v;
      v.weights = memory.data() + id;  // distinct fake addresses
      v.spec = &specs.at(id);
      v.state_width = 0;
      v.step = steps[id];
      return v;
    };
  }
  void Add(ShardId id, int64_t rows, int64_t dim, WeightType wt = WeightType::kFp32) {
    ShardSpec s;
    s.table = "t";
    s.rows = rows;
    s.table_rows = rows;
    s.dim = dim;
    s.weight_type = wt;
    specs[id] = s;
  }
};

FeatureRequest Feature(ShardId shard, Pooling p, const std::vector<int64_t>& lengths,
                       const std::vector<int64_t>& ids) {
  FeatureRequest f;
  f.shard = shard;
  f.pooling = p;
  f.lengths = lengths;
  f.ids = ids;
  return f;
}

TEST(RequestPlanTest, LookupDescriptorsAndTotals) {
  Fixture fx;
  fx.Add(3, 10, 8, WeightType::kBf16);
  fx.Add(5, 20, 4);
  const std::vector<int64_t> l1 = {2, 0, 1}, i1 = {1, 2, 3}, l2 = {1, 1}, i2 = {7, 9};
  std::vector<float> o1(3 * 8), o2(2 * 4);
  const std::vector<LookupRequest> reqs = {
      {Feature(3, Pooling::kMean, l1, i1), absl::MakeSpan(o1)},
      {Feature(5, Pooling::kNone, l2, i2), absl::MakeSpan(o2)}};
  const LookupPlan p = PlanLookup(reqs, fx.resolver());
  // Items: 3 bags of the pooled feature, then 2 ids of the NONE one.
  EXPECT_EQ(p.item_begin, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(p.total_items, 5);
  EXPECT_EQ(p.total_bags, 5);
  EXPECT_EQ(p.total_ids, 5);
  EXPECT_EQ(p.total_out, 24 + 8);
  EXPECT_FALSE(p.any_weighted);
  ASSERT_EQ(p.descs.size(), 2u);
  EXPECT_EQ(p.descs[0].weights, fx.memory.data() + 3);
  EXPECT_EQ(p.descs[0].dim, 8);
  EXPECT_EQ(p.descs[0].weight_type, static_cast<int32_t>(WeightType::kBf16));
  EXPECT_EQ(p.descs[0].pooling, static_cast<int32_t>(Pooling::kMean));
  EXPECT_EQ(p.descs[1].bag_begin, 3);
  EXPECT_EQ(p.descs[1].id_begin, 3);
  EXPECT_EQ(p.descs[1].out_begin, 24);
}

TEST(RequestPlanTest, GradientSlotsKeysStepsAndIdleShards) {
  Fixture fx;
  fx.Add(2, 1000, 8);
  fx.Add(4, 24, 12);
  fx.Add(9, 5, 4);
  fx.steps[2] = 6;
  fx.steps[4] = 1;
  const std::vector<int64_t> l = {2}, ids = {3, 3}, none_l = {0}, none_ids = {};
  std::vector<float> g8(8), g12(12), g4(4);
  // Shard 4 first in the call, then 2; shard 9 named with no ids.
  const std::vector<GradientRequest> reqs = {{Feature(4, Pooling::kSum, l, ids), g12},
                                             {Feature(9, Pooling::kSum, none_l, none_ids), g4},
                                             {Feature(2, Pooling::kSum, l, ids), g8}};
  const GradientPlan p = PlanGradients(reqs, fx.resolver());
  // Slots in shard id order; keys [0, 1000) for shard 2, [1000, 1024) for 4.
  EXPECT_EQ(p.slots, (std::vector<ShardId>{2, 4}));
  EXPECT_EQ(p.key_base, (std::vector<uint64_t>{0, 1000, 1024}));
  EXPECT_EQ(p.idle, (std::vector<ShardId>{9}));
  EXPECT_EQ(p.end_bit, 10);  // keys < 1024 = 2^10
  EXPECT_EQ(p.max_dim, 12);
  EXPECT_EQ(p.updates[0].step, 7);
  EXPECT_EQ(p.updates[1].step, 2);
  EXPECT_EQ(p.id_begin, (std::vector<int64_t>{0, 2, 2, 4}));
  EXPECT_EQ(p.descs[0].key_base, 1000u);
  EXPECT_EQ(p.descs[2].key_base, 0u);
  EXPECT_EQ(p.descs[1].grad_begin, 12);
  EXPECT_EQ(p.descs[2].grad_begin, 16);
  EXPECT_EQ(p.total_grad, 24);
  EXPECT_EQ(p.total_bags, 3);
}

TEST(RequestPlanTest, EndBitEdges) {
  for (auto [rows, bits] : std::vector<std::pair<int64_t, int>>{{1, 1}, {2, 1}, {3, 2}, {1024, 10},
                                                                 {1025, 11}}) {
    Fixture fx;
    fx.Add(0, rows, 4);
    const std::vector<int64_t> l = {1}, ids = {0};
    std::vector<float> g(4);
    const std::vector<GradientRequest> reqs = {{Feature(0, Pooling::kSum, l, ids), g}};
    EXPECT_EQ(PlanGradients(reqs, fx.resolver()).end_bit, bits) << rows;
  }
}

TEST(RequestPlanTest, LayoutAlignsEveryArrayTo256Bytes) {
  Layout l;
  EXPECT_EQ(l.Add<int64_t>(3), 0u);
  EXPECT_EQ(l.Add<float>(1), 256u);
  EXPECT_EQ(l.Add<char>(0), 512u);
  EXPECT_EQ(l.Add<double>(40), 512u);
  EXPECT_EQ(l.bytes(), 512u + 320u);
}

// Runs longer than kHotRun (32) are cut into 32-id chunks; a hot run of L
// ids makes ceil(L / 32) < 2 * L / 32 chunks, so 2 * (ids / 32) + 1 bounds
// them all.
TEST(RequestPlanTest, MaxHotUnitsByHand) {
  EXPECT_EQ(MaxHotUnits(0), 1);
  EXPECT_EQ(MaxHotUnits(31), 1);
  EXPECT_EQ(MaxHotUnits(64), 5);
  EXPECT_EQ(MaxHotUnits(1000), 63);
}

}  // namespace
}  // namespace backend
}  // namespace ember
