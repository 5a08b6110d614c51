// embedding_math.h pinned to hand-computed values and bit patterns.

#include "math/embedding_math.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"
#include "math/half.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {
namespace math {
namespace {

OptimizerConfig Config(OptimizerType type, float lr, float wd,
                       WeightDecayMode mode = WeightDecayMode::kDefault) {
  OptimizerConfig o;
  o.type = type;
  o.learning_rate = lr;
  o.weight_decay = wd;
  o.weight_decay_mode = mode;
  return o;
}

TEST(EmbeddingMathTest, BagScales) {
  EXPECT_EQ(MeanScale(4), 0.25f);
  EXPECT_EQ(MeanScale(0), 1.0f);
  EXPECT_EQ(FloatBits(MeanScale(3)), FloatBits(1.0f / 3.0f));
  EXPECT_EQ(IdScale(false, 123.0f, 0.25f), 0.25f);
  EXPECT_EQ(IdScale(true, 3.0f, 0.25f), 0.75f);
  // The weighted-MEAN factor is weight * (1/len), not weight / len: for
  // weight 0.3 and 3 ids they differ in the last bits.
  EXPECT_EQ(FloatBits(IdScale(true, 0.3f, MeanScale(3))), FloatBits(0.3f * (1.0f / 3.0f)));
  EXPECT_NE(FloatBits(0.3f * (1.0f / 3.0f)), FloatBits(0.3f / 3.0f));
}

TEST(EmbeddingMathTest, ResolvedDecayFollowsFbgemm) {
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kAdam, 0.1f, 0.01f)), kDecayDecouple);
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kRowwiseAdagrad, 0.1f, 0.01f)), kDecayL2);
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kAdam, 0.1f, 0.01f, WeightDecayMode::kL2)),
            kDecayL2);
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kAdagrad, 0.1f, 0.01f,
                                 WeightDecayMode::kDecouple)),
            kDecayDecouple);
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kAdam, 0.1f, 0.0f, WeightDecayMode::kL2)),
            kDecayNone);
  EXPECT_EQ(ResolvedDecay(Config(OptimizerType::kSgd, 0.1f, 0.5f)), kDecayNone);
}

TEST(EmbeddingMathTest, SgdAndAdagradByHand) {
  const StepParams sgd = MakeStepParams(Config(OptimizerType::kSgd, 0.5f, 0), 1);
  EXPECT_EQ(SgdStep(sgd, 1.0f, 0.25f), 0.875f);  // 1 - 0.5 * 0.25

  // Adagrad, eps 0 for exact numbers: G = 1 + 3^2 = 10 ... use G0 = 7, g = 3:
  // G = 16, w = 2 - 0.5 * 3 / 4 = 1.625.
  OptimizerConfig o = Config(OptimizerType::kAdagrad, 0.5f, 0);
  o.eps = 0;
  StepParams p = MakeStepParams(o, 1);
  float acc = 7.0f, m = 0, v = 0;
  EXPECT_EQ(ElementStep(p, 2.0f, 3.0f, &acc, &m, &v), 1.625f);
  EXPECT_EQ(acc, 16.0f);

  // L2: g' = 3 + 0.5 * 2 = 4; G = 0 + 16; w = 2 - 0.5 * 4 / 4 = 1.5.
  o = Config(OptimizerType::kAdagrad, 0.5f, 0.5f, WeightDecayMode::kL2);
  o.eps = 0;
  p = MakeStepParams(o, 1);
  acc = 0;
  EXPECT_EQ(ElementStep(p, 2.0f, 3.0f, &acc, &m, &v), 1.5f);
  EXPECT_EQ(acc, 16.0f);

  // DECOUPLE: G = 9; w = (1 - 0.5 * 0.5) * 2 - 0.5 * 3 / 3 = 1.5 - 0.5 = 1.
  o.weight_decay_mode = WeightDecayMode::kDecouple;
  p = MakeStepParams(o, 1);
  EXPECT_EQ(p.decay_keep, 0.75f);
  acc = 0;
  EXPECT_EQ(ElementStep(p, 2.0f, 3.0f, &acc, &m, &v), 1.0f);
  EXPECT_EQ(acc, 9.0f);
}

TEST(EmbeddingMathTest, RowwiseAdagradByHand) {
  OptimizerConfig o = Config(OptimizerType::kRowwiseAdagrad, 0.5f, 0);
  o.eps = 0;
  StepParams p = MakeStepParams(o, 1);
  // Row gradient (3, 5): mean square 17; G = 8 + 17 = 25; mult = 0.5 / 5.
  float acc = 8.0f;
  const float mult = RowwiseMultiplier(p, &acc, 17.0f);
  EXPECT_EQ(acc, 25.0f);
  EXPECT_EQ(FloatBits(mult), FloatBits(0.1f));
  EXPECT_EQ(FloatBits(RowwiseStep(p, 1.0f, 3.0f, mult)), FloatBits(1.0f - 0.1f * 3.0f));
  // DECOUPLE with wd 0.2: keep = 1 - 0.5 * 0.2 = 0.9; w = 0.9 * 1 - 0.1 * 5.
  o.weight_decay = 0.2f;
  o.weight_decay_mode = WeightDecayMode::kDecouple;
  p = MakeStepParams(o, 1);
  EXPECT_EQ(FloatBits(RowwiseStep(p, 1.0f, 5.0f, 0.1f)), FloatBits(0.9f * 1.0f - 0.1f * 5.0f));
}

TEST(EmbeddingMathTest, AdamByHandAndDecayNeverEntersMoments) {
  // t = 1, b1 = 0.5, b2 = 0.75, eps 0: m = 0.5 g, v = 0.25 g^2, bias
  // corrections 0.5 and 0.25 give m^ = g, v^ = g^2, so the step is lr * sign(g).
  OptimizerConfig o = Config(OptimizerType::kAdam, 0.25f, 0);
  o.beta1 = 0.5f;
  o.beta2 = 0.75f;
  o.eps = 0;
  StepParams p = MakeStepParams(o, 1);
  EXPECT_EQ(p.bias1, 0.5f);
  EXPECT_EQ(p.bias2, 0.25f);
  float acc = 0, m = 0, v = 0;
  EXPECT_EQ(ElementStep(p, 1.0f, 4.0f, &acc, &m, &v), 0.75f);
  EXPECT_EQ(m, 2.0f);
  EXPECT_EQ(v, 4.0f);
  // Decoupled decay 0.5 (the default for Adam): w -= 0.25 * (1 + 0.5 * 1);
  // m and v are as without decay.
  o.weight_decay = 0.5f;
  p = MakeStepParams(o, 1);
  m = v = 0;
  EXPECT_EQ(ElementStep(p, 1.0f, 4.0f, &acc, &m, &v), 0.625f);
  EXPECT_EQ(m, 2.0f);
  EXPECT_EQ(v, 4.0f);
  // L2 instead: g' = 4 + 0.5 = 4.5 enters m and v; step still lr * sign.
  o.weight_decay_mode = WeightDecayMode::kL2;
  p = MakeStepParams(o, 1);
  m = v = 0;
  EXPECT_EQ(ElementStep(p, 1.0f, 4.0f, &acc, &m, &v), 0.75f);
  EXPECT_EQ(m, 2.25f);
  EXPECT_EQ(v, 0.25f * 4.5f * 4.5f);
  // t = 2 bias corrections: 1 - 0.5^2, 1 - 0.75^2.
  p = MakeStepParams(o, 2);
  EXPECT_EQ(p.bias1, 0.75f);
  EXPECT_EQ(p.bias2, 0.4375f);
}

TEST(EmbeddingMathTest, StochasticRoundingBf16Bits) {
  // 1 + 2^-7 + 2^-10 lies between bf16 1.0078125 (0x3f81) and 1.015625
  // (0x3f82); its dropped 16 bits are 0x2000 (1/8 of the gap).
  const float x = 1.0f + 0.0078125f + 0.0009765625f;
  ASSERT_EQ(FloatBits(x) & 0xffffu, 0x2000u);
  EXPECT_EQ(FloatToBf16Stochastic(x, 0), 0x3f81);
  EXPECT_EQ(FloatToBf16Stochastic(x, 0xdfff), 0x3f81);  // 0x2000 + 0xdfff < 0x10000
  EXPECT_EQ(FloatToBf16Stochastic(x, 0xe000), 0x3f82);  // carries: rounds up
  EXPECT_EQ(FloatToBf16Stochastic(-x, 0xe000), 0xbf82);  // magnitude rounds up
  EXPECT_EQ(FloatToBf16Stochastic(2.0f, 0xffff), 0x4000);  // exact stays exact
  EXPECT_EQ(FloatToBf16Stochastic(std::numeric_limits<float>::infinity(), 0xffff), 0x7f80);
  EXPECT_EQ(FloatToBf16Stochastic(std::nanf(""), 0xffff) & 0x7fc0, 0x7fc0);
}

TEST(EmbeddingMathTest, StochasticRoundingFp16Bits) {
  // 1 + 2^-11 is half-way between fp16 1.0 (0x3c00) and 1 + 2^-10 (0x3c01):
  // dropped bits 0x1000 of 0x2000.
  const float x = 1.0f + 0.00048828125f;
  EXPECT_EQ(FloatToFp16Stochastic(x, 0), 0x3c00);
  EXPECT_EQ(FloatToFp16Stochastic(x, 0x0fff), 0x3c00);
  EXPECT_EQ(FloatToFp16Stochastic(x, 0x1000), 0x3c01);
  EXPECT_EQ(FloatToFp16Stochastic(-x, 0x1000), 0xbc01);
  EXPECT_EQ(FloatToFp16Stochastic(65504.0f, 0x1fff), 0x7bff);     // max stays max
  EXPECT_EQ(FloatToFp16Stochastic(65519.0f, 0x1fff), 0x7c00);     // may round to Inf
  EXPECT_EQ(FloatToFp16Stochastic(65519.0f, 0), 0x7bff);
  EXPECT_EQ(FloatToFp16Stochastic(1e6f, 0), 0x7c00);
  EXPECT_EQ(FloatToFp16Stochastic(-std::numeric_limits<float>::infinity(), 0), 0xfc00);
  EXPECT_EQ(FloatToFp16Stochastic(std::nanf(""), 0) & 0x7e00, 0x7e00);
  // Subnormal: 1.5 * 2^-24 is between 0x0001 and 0x0002, rounding up with
  // probability 1/2 (the dropped bits are half the mask's range).
  const float sub = 1.5f * std::ldexp(1.0f, -24);
  EXPECT_EQ(FloatToFp16Stochastic(sub, 0), 0x0002 - 1 + 1);  // noise 0 < rem: up
  EXPECT_EQ(FloatToFp16Stochastic(sub, 0xffffffffu), 0x0001);
  EXPECT_EQ(FloatToFp16Stochastic(std::ldexp(1.0f, -26), 0), 0x0000);  // below 2^-25
}

// Over many draws the rounding is unbiased: the mean of the rounded values
// approaches the value (an update far below half an ulp survives on average).
TEST(EmbeddingMathTest, StochasticRoundingIsUnbiased) {
  const float x = 1.0f + 0.0001f;  // 0.05 of a bf16 ulp (2^-7), 0.1 of an fp16 ulp
  double bf = 0, fp = 0;
  const int n = 200000;
  const uint64_t key = RowNoiseKey(42, 7, 1000);
  for (int i = 0; i < n; ++i) {
    const uint32_t noise = ElementNoise(key, i);
    bf += Bf16ToFloat(FloatToBf16Stochastic(x, noise));
    fp += Fp16ToFloat(FloatToFp16Stochastic(x, noise));
  }
  EXPECT_NEAR(bf / n, x, 2e-5);
  EXPECT_NEAR(fp / n, x, 4e-6);
  // Nearest rounding loses it entirely.
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(x)), 1.0f);
}

TEST(EmbeddingMathTest, NoiseDependsOnEveryCoordinate) {
  const uint64_t k = RowNoiseKey(1, 2, 3);
  EXPECT_EQ(k, RowNoiseKey(1, 2, 3));
  EXPECT_NE(k, RowNoiseKey(2, 2, 3));
  EXPECT_NE(k, RowNoiseKey(1, 3, 3));
  EXPECT_NE(k, RowNoiseKey(1, 2, 4));
  EXPECT_NE(ElementNoise(k, 0), ElementNoise(k, 1));
}

// Pinned against values worked out by an independent implementation
// (Python's integers, masked to 32 and 64 bits), so a change to the hash,
// which changes every half-precision table's training, is deliberate.
TEST(EmbeddingMathTest, NoiseIsPinned) {
  EXPECT_EQ(Fmix32(1), 0x514e28b7u);  // MurmurHash3's fmix32
  EXPECT_EQ(Fmix32(0xdeadbeefu), 0x0de5c6a9u);
  const uint64_t k = RowNoiseKey(1, 2, 3);
  EXPECT_EQ(k, 0x4a2a45a1bd1c8017ull);
  EXPECT_EQ(ElementNoise(k, 0), 3673154415u);
  EXPECT_EQ(ElementNoise(k, 5), 1332273884u);
  EXPECT_EQ(ElementNoise(k, 1000), 3761830985u);
}

// The noise's bits are fair along a row and down a column: each of the 32
// bits is set in half the draws (within 1%), and rounding a value 0.1 of
// an fp16 ulp above 1 stochastically is unbiased over rows as over
// columns. A hash whose bits depended on the column alone, or on a part of
// the row key, fails.
TEST(EmbeddingMathTest, NoiseBitsAreFairOverRowsAndColumns) {
  const int n = 100000;
  const float x = 1.0f + 0.0001f;
  for (const bool down_a_column : {false, true}) {
    int ones[32] = {};
    double fp = 0;
    const uint64_t row_key = RowNoiseKey(5, 9, 77);
    for (int i = 0; i < n; ++i) {
      const uint32_t noise = down_a_column ? ElementNoise(RowNoiseKey(5, 9, i), 3)
                                           : ElementNoise(row_key, i);
      for (int b = 0; b < 32; ++b) ones[b] += (noise >> b) & 1u;
      fp += Fp16ToFloat(FloatToFp16Stochastic(x, noise));
    }
    for (int b = 0; b < 32; ++b) {
      EXPECT_NEAR(ones[b] / static_cast<double>(n), 0.5, 0.01)
          << "bit " << b << (down_a_column ? " down a column" : " along a row");
    }
    EXPECT_NEAR(fp / n, x, 6e-6) << (down_a_column ? "down a column" : "along a row");
  }
}

}  // namespace
}  // namespace math
}  // namespace backend
}  // namespace ember
