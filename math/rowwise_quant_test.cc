// Row-wise quantization against a reference written apart from it, from
// FBGEMM's description (scale and bias as fp16 values, lrint rounding,
// nibbles unpacked by hand), and against its error bound.
#include "math/rowwise_quant.h"

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace ember {
namespace backend {
namespace math {
namespace {

struct Reference {
  float scale, bias;
  std::vector<long> q;
};

Reference Quantize(int bits, const std::vector<float>& w) {
  Reference r;
  float lo = w[0], hi = w[0];
  for (float x : w) {
    lo = std::fmin(lo, x);
    hi = std::fmax(hi, x);
  }
  r.bias = Fp16ToFloat(FloatToFp16(lo));
  const float levels = static_cast<float>((1 << bits) - 1);
  const float range = hi - r.bias;
  r.scale = Fp16ToFloat(FloatToFp16(range == 0 ? 1.0f : range / levels));
  if (r.scale == 0 || std::isinf(1.0f / r.scale)) r.scale = 1.0f;
  const float inverse = 1.0f / r.scale;
  for (float x : w) {
    long q = std::lrint((x - r.bias) * inverse);
    r.q.push_back(q < 0 ? 0 : q > (1 << bits) - 1 ? (1 << bits) - 1 : q);
  }
  return r;
}

std::vector<float> Row(std::mt19937& rng, int64_t dim, float spread, float centre) {
  std::normal_distribution<float> n(centre, spread);
  std::vector<float> w(dim);
  for (float& x : w) x = n(rng);
  return w;
}

TEST(RowwiseQuantTest, MatchesTheReferenceBitForBit) {
  std::mt19937 rng(3);
  for (int bits : {8, 4}) {
    for (int64_t dim : {1, 2, 3, 7, 8, 33, 64, 129}) {
      for (int trial = 0; trial < 200; ++trial) {
        const float spread = std::pow(10.0f, static_cast<float>(trial % 9) - 5.0f);
        std::vector<float> w = Row(rng, dim, spread, trial % 3 == 0 ? 0.0f : 10 * spread);
        if (trial == 5) w.assign(dim, 0.75f);  // all equal: scale 1, q 0
        if (trial == 6) w.assign(dim, 1e-30f);  // the bias rounds to 0
        std::vector<uint8_t> row(QuantizedRowBytes(bits, dim), 0xAB);
        QuantizeRow(bits, w.data(), dim, row.data());
        const Reference want = Quantize(bits, w);
        float scale, bias;
        QuantScaleBias(row.data(), &scale, &bias);
        ASSERT_EQ(scale, want.scale) << bits << " bits, dim " << dim << ", trial " << trial;
        ASSERT_EQ(bias, want.bias) << bits << " bits, dim " << dim << ", trial " << trial;
        std::vector<float> back(dim);
        DequantizeRow(bits, row.data(), dim, back.data());
        for (int64_t c = 0; c < dim; ++c) {
          // Unpacked by hand: bytes after the 4-byte header, low nibble first.
          const uint8_t byte = row[4 + (bits == 8 ? c : c / 2)];
          const long q = bits == 8 ? byte : (c % 2 == 0 ? byte & 15 : byte >> 4);
          ASSERT_EQ(q, want.q[c]) << bits << " bits, dim " << dim << ", col " << c;
          ASSERT_EQ(QuantValue(bits, row.data(), c), static_cast<uint32_t>(q));
          ASSERT_EQ(back[c], want.scale * static_cast<float>(q) + want.bias);
          // The format's error bound: half a step, what fp16's rounding of
          // the scale moves the top values by (they clamp), and the bias's
          // rounding.
          float lo = w[0], hi = w[0];
          for (float x : w) lo = std::fmin(lo, x), hi = std::fmax(hi, x);
          const float levels = static_cast<float>((1 << bits) - 1);
          const float exact = hi == bias ? scale : (hi - bias) / levels;
          const float bound = scale / 2 + levels * std::fabs(exact - scale) +
                              std::fabs(lo - bias) + 1e-6f * (std::fabs(hi) + std::fabs(lo));
          ASSERT_LE(std::fabs(back[c] - w[c]), bound) << bits << " bits, col " << c;
        }
        if (bits == 4 && dim % 2 == 1) {
          EXPECT_EQ(row.back() >> 4, 0) << "the unused high nibble is zero";
        }
      }
    }
  }
}

TEST(RowwiseQuantTest, RowBytes) {
  EXPECT_EQ(QuantizedRowBytes(8, 64), 68);
  EXPECT_EQ(QuantizedRowBytes(4, 64), 36);
  EXPECT_EQ(QuantizedRowBytes(4, 7), 8);
  EXPECT_EQ(QuantizedRowBytes(8, 0), 4);
}

// Quantizing what a quantized row dequantizes to (a checkpoint or a move,
// which go through fp32) gives the same row but for a few rows whose scale
// fp16 rounded up (their top value then falls a step short, and the range
// shrinks); the row they become is a fixed point: a second round trip
// changes nothing.
TEST(RowwiseQuantTest, RequantizingADequantizedRowSettlesAtOnce) {
  std::mt19937 rng(9);
  int differ = 0, rows = 0;
  for (int bits : {8, 4}) {
    for (int trial = 0; trial < 2000; ++trial) {
      const int64_t dim = 1 + trial % 70;
      std::vector<float> w = Row(rng, dim, std::pow(10.0f, trial % 7 - 4.0f), 0.0f);
      std::vector<uint8_t> a(QuantizedRowBytes(bits, dim)), b(a.size());
      QuantizeRow(bits, w.data(), dim, a.data());
      std::vector<float> back(dim);
      DequantizeRow(bits, a.data(), dim, back.data());
      QuantizeRow(bits, back.data(), dim, b.data());
      ++rows;
      if (a != b) ++differ;
      std::vector<float> again(dim);
      DequantizeRow(bits, b.data(), dim, again.data());
      // A row moves by at most a step and what the fp16 scale's rounding
      // moves its top values by (large for scales among fp16's subnormals,
      // below 2^-14: rows spanning less than about 0.015 at INT8).
      float scale, bias;
      QuantScaleBias(a.data(), &scale, &bias);
      float b_scale, b_bias;
      QuantScaleBias(b.data(), &b_scale, &b_bias);
      const float levels = static_cast<float>((1 << bits) - 1);
      for (int64_t c = 0; c < dim; ++c) {
        ASSERT_LE(std::fabs(again[c] - back[c]),
                  scale * 1.001f + levels * std::fabs(b_scale - scale) + std::fabs(b_bias - bias))
            << "row " << trial << " col " << c;
      }
      std::vector<uint8_t> c(a.size());
      QuantizeRow(bits, again.data(), dim, c.data());
      ASSERT_EQ(b, c) << "a second round trip changed the row (" << bits << " bits, dim " << dim
                      << ")";
    }
  }
  EXPECT_LT(differ, rows / 50) << differ << " of " << rows << " rows changed";
  std::printf("%d of %d rows changed by a round trip through fp32\n", differ, rows);
}

// QuantizeRowKeeping: FBGEMM's rows for fresh values (or, where a row can
// hold them exactly, such a row), and for values that are a quantized
// row's (an export's), values that dequantize the same: a round trip
// through fp32 changes no value, whatever the scale (fp16 subnormals too).
TEST(RowwiseQuantTest, KeepingGivesAnExportedRowBack) {
  std::mt19937 rng(13);
  int rows = 0, exact_rows = 0;
  for (int bits : {8, 4}) {
    for (int trial = 0; trial < 4000; ++trial) {
      const int64_t dim = 1 + trial % 70;
      std::vector<float> w = Row(rng, dim, std::pow(10.0f, trial % 9 - 6.0f), trial % 5 - 2.0f);
      std::vector<uint8_t> fbgemm(QuantizedRowBytes(bits, dim)), kept(fbgemm.size());
      QuantizeRow(bits, w.data(), dim, fbgemm.data());
      QuantizeRowKeeping(bits, w.data(), dim, kept.data());
      // Fresh values: FBGEMM's row, unless a row holds them exactly.
      std::vector<float> exact(dim);
      DequantizeRow(bits, kept.data(), dim, exact.data());
      if (kept != fbgemm) {
        ASSERT_EQ(exact, w) << "neither FBGEMM's row nor exact (" << bits << " bits, trial "
                            << trial << ")";
        ++exact_rows;
      }
      std::vector<float> back(dim);
      DequantizeRow(bits, fbgemm.data(), dim, back.data());
      QuantizeRowKeeping(bits, back.data(), dim, kept.data());
      std::vector<float> again(dim);
      DequantizeRow(bits, kept.data(), dim, again.data());
      ASSERT_EQ(again, back) << "a round trip moved a value (" << bits << " bits, trial "
                             << trial << ")";
      ++rows;
    }
  }
  EXPECT_EQ(rows, 8000);
  EXPECT_LT(exact_rows, rows / 20) << "fresh rows held exactly, not as FBGEMM holds them";
  std::printf("%d of %d fresh rows held exactly (FBGEMM's row would not be)\n", exact_rows, rows);
}

}  // namespace
}  // namespace math
}  // namespace backend
}  // namespace ember
