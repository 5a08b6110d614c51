// overflow_guard.h's bounds against values worked by hand, and the Adam
// invariant they rest on against simulated Adam runs.
#include "server/backend/overflow_guard.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "math/half.h"

namespace ember {
namespace backend {
namespace {

ShardSpec Spec(WeightType t, OptimizerType o, int64_t dim = 8) {
  ShardSpec s;
  s.table = "t";
  s.rows = 4;
  s.dim = dim;
  s.table_rows = 4;
  s.weight_type = t;
  s.optimizer.type = o;
  s.optimizer.learning_rate = 1.0f;
  return s;
}

TEST(OverflowGuardTest, LimitsOfEachType) {
  EXPECT_EQ(WeightLimitOf(WeightType::kFp16), 65504.0f);
  EXPECT_EQ(WeightLimitOf(WeightType::kBf16), Bf16ToFloat(0x7f7f));
  EXPECT_EQ(WeightLimitOf(WeightType::kFp32), std::numeric_limits<float>::max());
  EXPECT_TRUE(math::Fits(65504.0f, 65504.0f));
  EXPECT_FALSE(math::Fits(65504.5f, 65504.0f));
  EXPECT_FALSE(math::Fits(-INFINITY, 3e38f));
  EXPECT_FALSE(math::Fits(NAN, 3e38f));
}

TEST(OverflowGuardTest, SgdStepBoundsByHand) {
  const ShardSpec spec = Spec(WeightType::kFp16, OptimizerType::kSgd);
  const math::StepParams p = MakeStepParams(spec.optimizer, 1);
  ValueBounds before;
  before.weight = 1000;
  ValueBounds after;
  // 1000 + 1 * 60000 = 61000 <= 65504; stored in fp16 it may round up by
  // a gap (2^-10 of it, plus 2^-24 for subnormals).
  ASSERT_TRUE(StepStaysFinite(spec, p, before, 60000, &after));
  EXPECT_NEAR(after.weight, 61000 * (1 + 0x1p-10) + 0x1p-24, 1);
  EXPECT_FALSE(after.measured);
  // 1000 + 65000 passes the limit: the bounds cannot tell.
  EXPECT_FALSE(StepStaysFinite(spec, p, before, 65000, &after));
  // A non-finite or negative bound never passes.
  EXPECT_FALSE(StepStaysFinite(spec, p, before, INFINITY, &after));
  before.weight = NAN;
  EXPECT_FALSE(StepStaysFinite(spec, p, before, 1, &after));
}

TEST(OverflowGuardTest, AdagradStateAndWeightBoundsByHand) {
  ShardSpec spec = Spec(WeightType::kFp32, OptimizerType::kAdagrad);
  spec.optimizer.learning_rate = 0.5f;
  spec.optimizer.eps = 1e-8f;
  const math::StepParams p = MakeStepParams(spec.optimizer, 1);
  ValueBounds before;
  before.weight = 2;
  before.acc = 100;
  ValueBounds after;
  ASSERT_TRUE(StepStaysFinite(spec, p, before, 10, &after));
  EXPECT_NEAR(after.acc, 200, 1e-3);            // + 10^2
  EXPECT_NEAR(after.weight, 2 + 0.5 * 1.01, 1e-3);  // moves at most lr
  // 2e19^2 overflows fp32.
  EXPECT_FALSE(StepStaysFinite(spec, p, before, 2e19, &after));
  // eps = 0 can divide 0 by 0: always checked, and measuring cannot help.
  spec.optimizer.eps = 0;
  EXPECT_FALSE(StepStaysFinite(spec, MakeStepParams(spec.optimizer, 1), before, 10, &after));
  EXPECT_TRUE(BoundsCannotTell(spec, MakeStepParams(spec.optimizer, 1)));
  // A tiny eps: a gradient whose square vanishes in fp32 moves w by
  // lr g / eps, so the bound grows by lr 2^-50 / eps (about 5.6e-8 here).
  spec.optimizer.eps = 1e-8f;
  ASSERT_TRUE(StepStaysFinite(spec, MakeStepParams(spec.optimizer, 1), before, 10, &after));
  EXPECT_NEAR(after.weight, 2 + 0.5 * (1.01 + 0x1p-50 / 1e-8f), 1e-3);
  EXPECT_FALSE(BoundsCannotTell(spec, MakeStepParams(spec.optimizer, 1)));
  spec.optimizer.eps = 1e-30f;
  EXPECT_TRUE(BoundsCannotTell(spec, MakeStepParams(spec.optimizer, 1)));
}

TEST(OverflowGuardTest, RowwiseMovesAtMostLrSqrtDim) {
  ShardSpec spec = Spec(WeightType::kFp16, OptimizerType::kRowwiseAdagrad, 16);
  spec.optimizer.learning_rate = 100.0f;
  const math::StepParams p = MakeStepParams(spec.optimizer, 1);
  ValueBounds before;
  before.weight = 1;
  ValueBounds after;
  ASSERT_TRUE(StepStaysFinite(spec, p, before, 1e6, &after));
  // (1 + lr 1.01 sqrt(16) + lr 2^-50 / eps), then fp16's rounding gap.
  EXPECT_NEAR(after.weight, (1 + 100 * 1.01 * 4 + 100 * 0x1p-50 / 1e-8) * (1 + 0x1p-10), 1e-2);
  EXPECT_NEAR(after.acc, 1e12, 1e7);
}

TEST(OverflowGuardTest, AdamRatioBoundOfDefaultBetas) {
  OptimizerConfig o;
  o.beta1 = 0.9f;
  o.beta2 = 0.999f;
  // 0.1 / sqrt(0.001 * (1 - 0.81 / 0.999)) = 7.2700..., with 1% to spare (in
  // the betas as floats).
  const double b1 = 0.9f, b2 = 0.999f;
  EXPECT_NEAR(AdamRatioBound(o), 1.01 * (1 - b1) / std::sqrt((1 - b2) * (1 - b1 * b1 / b2)), 1e-9);
  EXPECT_NEAR(AdamRatioBound(o), 7.343, 1e-3);
  o.beta1 = 0.99f;
  o.beta2 = 0.9f;  // b1^2 >= b2: no bound
  EXPECT_EQ(AdamRatioBound(o), 0);
}

// |m| <= C sqrt(v) after any run of Adam steps from zeros, whatever the
// gradients (heavy-tailed, sign-flipping, long quiet stretches).
TEST(OverflowGuardTest, AdamInvariantHoldsOnSimulatedRuns) {
  std::mt19937 rng(9);
  for (const auto& betas : {std::pair<float, float>{0.9f, 0.999f}, {0.5f, 0.3f}, {0.0f, 0.99f},
                            {0.95f, 0.9999f}}) {
    OptimizerConfig o;
    o.beta1 = betas.first;
    o.beta2 = betas.second;
    const double c = AdamRatioBound(o);
    ASSERT_GT(c, 0);
    for (int run = 0; run < 50; ++run) {
      float m = 0, v = 0;
      double worst = 0;
      for (int t = 0; t < 2000; ++t) {
        float g = std::cauchy_distribution<float>(0, 1)(rng);
        if (rng() % 5 == 0) g = 0;
        if (run % 2 && t % 3) g = (t % 2 ? 1e3f : -1e3f);
        m = o.beta1 * m + (1 - o.beta1) * g;
        v = o.beta2 * v + (1 - o.beta2) * g * g;
        if (v > 0) worst = std::max(worst, std::fabs(static_cast<double>(m)) / std::sqrt(static_cast<double>(v)));
      }
      EXPECT_LE(worst, c) << o.beta1 << " " << o.beta2;
    }
  }
}

TEST(OverflowGuardTest, MeasureImportAndMergedGradientBounds) {
  ShardSpec spec = Spec(WeightType::kFp16, OptimizerType::kAdam, 4);
  const std::vector<float> w = {1, -300, 2, 3, 0, 0, 0, -4};
  // m then v per row; row 1's m = 1 with v = 0 breaks the invariant.
  std::vector<float> st = {0.1f, 0, 0, 0, 1, 1, 1, 4, 1, 0, 0, 0, 0, 0, 0, 0};
  ValueBounds b = MeasureValues(spec, w, st);
  EXPECT_EQ(b.weight, 300);
  EXPECT_EQ(b.acc, 4);
  EXPECT_FALSE(b.adam_ok);
  EXPECT_TRUE(b.measured);
  st[8] = 0;
  EXPECT_TRUE(MeasureValues(spec, w, st).adam_ok);
  // Past the vectorised blocks (16 floats), Inf and NaN anywhere.
  std::vector<float> many(37, 0.5f);
  many[33] = -700;
  EXPECT_EQ(MeasureValues(Spec(WeightType::kFp32, OptimizerType::kSgd, 37), many, {}).weight, 700);
  many[5] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isinf(MeasureValues(Spec(WeightType::kFp32, OptimizerType::kSgd, 37), many, {})
                             .weight));
  many[20] = std::nanf("");
  EXPECT_TRUE(std::isnan(MeasureValues(Spec(WeightType::kFp32, OptimizerType::kSgd, 37), many, {})
                             .weight));
  const ValueBounds imported = ImportedBounds(spec, w, st);
  EXPECT_FALSE(imported.measured);
  EXPECT_GT(imported.weight, 300);  // fp16 rounding's room
  // MEAN bags of weighted ids: (|2| + |-4|) / 2 + |0.5| / 1 = 3.5, times 10.
  FeatureRequest f;
  const std::vector<int64_t> lengths = {2, 1, 0}, ids = {0, 1, 2};
  const std::vector<float> weights = {2, -4, 0.5f};
  f.lengths = lengths;
  f.ids = ids;
  f.weights = weights;
  f.pooling = Pooling::kMean;
  EXPECT_NEAR(MergedGradientBound(f, 10), 35, 1e-3);
  f.pooling = Pooling::kSum;
  EXPECT_NEAR(MergedGradientBound(f, 10), 65, 1e-3);
  f.weights = {};
  EXPECT_NEAR(MergedGradientBound(f, 10), 30, 1e-3);
}

TEST(OverflowGuardTest, InitialBoundsAndRefusalMessage) {
  ShardSpec spec = Spec(WeightType::kFp16, OptimizerType::kAdagrad);
  spec.initializer.type = InitializerType::kUniform;
  spec.initializer.low = -3;
  spec.initializer.high = 2;
  spec.optimizer.initial_accumulator_value = 0.5f;
  const ValueBounds b = InitialBounds(spec);
  EXPECT_DOUBLE_EQ(b.weight, 3 * (1 + 0x1p-10) + 0x1p-24);  // rounded into fp16
  EXPECT_EQ(b.acc, 0.5);
  spec.row_offset = 40;
  spec.col_offset = 8;
  OverflowReport r;
  r.row = 2;
  r.col = 5;
  r.value = -70000;
  EXPECT_EQ(OverflowRefusal(spec, r).message(),
            "gradient update of table 't': row 42 column 13: the weight would become -70000, "
            "beyond the largest finite fp16 value 65504; nothing of the call was applied");
  r.state = true;
  r.value = INFINITY;
  EXPECT_EQ(OverflowRefusal(spec, r).message(),
            "gradient update of table 't': row 42: optimizer state[5] would become inf (fp32 "
            "state must stay finite); nothing of the call was applied");
  // An initializer beyond the type is refused when the shard is made.
  spec.initializer.high = 1e5f;
  EXPECT_EQ(ValidateShardSpec(spec).code(), absl::StatusCode::kInvalidArgument);
  spec.initializer.high = 2;
  spec.initializer.low = -INFINITY;
  EXPECT_EQ(ValidateShardSpec(spec).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace backend
}  // namespace ember
