// The ISA row kernels against embedding_math.h / half.h's scalar formulas,
// bit for bit: widening every half and bf16 value, and stochastic
// rounding of values from every range (zeros, half subnormals, normals,
// overflow, Inf, NaN) at column offsets and widths that leave tails.
// Pooling against a sum in double, for every weight type and widths that
// use each register block (8, 4, 2, 1 registers, paired loads) and tails.
#include "server/backend/cpu/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "math/embedding_math.h"
#include "math/half.h"
#include "math/rowwise_quant.h"

namespace ember {
namespace backend {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Every table this CPU can run: both AVX-512 tables (one is chosen by the
// CPU's vendor, but either runs on any AVX-512 CPU).
std::vector<const RowKernels*> AvailableKernels() {
  std::vector<const RowKernels*> out;
  for (const std::string isa : {"scalar", "avx2", "avx512"}) {
    auto k = RowKernelsFor(isa);
    if (!k.ok()) continue;
    if (isa == "avx512") {
      out.push_back(&kAvx512RowKernels);
      out.push_back(&kAvx512IntelRowKernels);
    } else {
      out.push_back(*k);
    }
  }
  return out;
}

// The tables a test names in its failures: the ISA and, for AVX-512, the
// way 16-bit rows are loaded.
std::string KernelName(const RowKernels* k) {
  if (k == &kAvx512RowKernels) return "avx512 (paired loads)";
  if (k == &kAvx512IntelRowKernels) return "avx512 (conversions from memory)";
  return k->isa;
}

TEST(CpuKernelsTest, TheAvx512TableFollowsTheVendor) {
  auto k = RowKernelsFor("avx512");
  if (!k.ok()) GTEST_SKIP() << "no AVX-512 on this CPU";
  EXPECT_EQ(*k, CpuIsIntel() ? &kAvx512IntelRowKernels : &kAvx512RowKernels);
  EXPECT_EQ(&BestRowKernels(), *k);
}

TEST(CpuKernelsTest, WidenEveryHalfAndBf16Exactly) {
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    std::vector<float> out(all.size());
    k->widen[1](out.data(), all.data(), static_cast<int64_t>(all.size()));
    for (int i = 0; i < 65536; ++i) {
      const float want = Fp16ToFloat(all[i]);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(out[i])) << i;
      } else {
        ASSERT_EQ(Bits(out[i]), Bits(want)) << "half 0x" << std::hex << i;
      }
    }
    k->widen[2](out.data(), all.data(), static_cast<int64_t>(all.size()));
    for (int i = 0; i < 65536; ++i) ASSERT_EQ(Bits(out[i]), Bits(Bf16ToFloat(all[i]))) << i;
    std::vector<float> f32 = {1.5f, -0.0f, 3e38f, 1e-40f};
    std::vector<float> copy(4);
    k->widen[0](copy.data(), f32.data(), 4);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(Bits(copy[i]), Bits(f32[i]));
    // Odd lengths at odd offsets: every column, and nothing past the last.
    for (int64_t dim : {1, 2, 3, 5, 7, 13, 19, 31, 35}) {
      for (int type = 0; type < 3; ++type) {
        std::vector<float> got(dim + 1, 42.0f);
        std::vector<float> src(dim);
        for (int64_t c = 0; c < dim; ++c) src[c] = 0.25f * static_cast<float>(c) - 3.0f;
        if (type == 0) {
          k->widen[0](got.data(), src.data(), dim);
        } else {
          k->widen[type](got.data(), all.data() + 4097, dim);
        }
        for (int64_t c = 0; c < dim; ++c) {
          const float want = type == 0   ? src[c]
                             : type == 1 ? Fp16ToFloat(all[4097 + c])
                                         : Bf16ToFloat(all[4097 + c]);
          ASSERT_EQ(Bits(got[c]), Bits(want)) << "type " << type << " dim " << dim << " col " << c;
        }
        EXPECT_EQ(got[dim], 42.0f) << "type " << type << " dim " << dim << ": wrote past the row";
      }
    }
  }
}

TEST(CpuKernelsTest, PoolMatchesASumInDouble) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2, 2);
  const int64_t rows = 37;
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    for (int type = 0; type < 3; ++type) {
      // Odd dims too: TorchRec's CPU modules take any, so the kernels do
      // (their last dim % 4 columns one at a time).
      for (int64_t dim : {1, 2, 3, 4, 5, 7, 8, 10, 13, 16, 20, 30, 32, 48, 64, 96, 127, 128, 144,
                          192, 256, 260, 262, 400, 528}) {
        const int64_t elem = type == 0 ? 4 : 2;
        std::vector<uint8_t> table(rows * dim * elem);
        std::vector<double> value(rows * dim);  // each stored weight, widened
        for (int64_t i = 0; i < rows * dim; ++i) {
          const float w = u(rng);
          if (type == 0) {
            std::memcpy(&table[i * 4], &w, 4);
            value[i] = w;
          } else {
            const uint16_t h = type == 1 ? FloatToFp16(w) : FloatToBf16(w);
            std::memcpy(&table[i * 2], &h, 2);
            value[i] = type == 1 ? Fp16ToFloat(h) : Bf16ToFloat(h);
          }
        }
        for (int64_t n : {0, 1, 7, 20}) {
          std::vector<int64_t> ids(n + 3);  // prefetching reads up to 3 ahead
          for (int64_t& id : ids) id = std::uniform_int_distribution<int64_t>(0, rows - 1)(rng);
          for (bool weighted : {false, true}) {
            std::vector<float> weights(ids.size());
            for (float& w : weights) w = u(rng);
            const float scale = n == 0 ? 1.0f : 1.0f / n;
            // Both stages; the outer one alone reaching past ids_avail (Intel's
            // setting); the L1 one alone; the outer one ending within the bag
            // (the kernel's ids with a prefetch, then those without), also
            // with every line into L1. None changes a result.
            for (const PrefetchAhead pf :
                 {PrefetchAhead{3, 2}, PrefetchAhead{64, 0}, PrefetchAhead{0, 3},
                  PrefetchAhead{8, 4}, PrefetchAhead{5, 0, true}}) {
              std::vector<float> out(dim, 1e30f);
              ASSERT_TRUE(k->pool[type](out.data(), table.data(), dim * elem, rows, ids.data(),
                                        weighted ? weights.data() : nullptr, n, n + 3, dim, scale,
                                        pf));
              for (int64_t c = 0; c < dim; ++c) {
                double want = 0;
                for (int64_t j = 0; j < n; ++j) {
                  want += (weighted ? weights[j] : 1.0) * value[ids[j] * dim + c];
                }
                want *= scale;
                ASSERT_NEAR(out[c], want, 1e-5 * (1 + n * 4))
                    << "type " << type << " dim " << dim << " n " << n << " weighted " << weighted
                    << " prefetch " << pf.outer << "/" << pf.l1 << "/" << pf.outer_into_l1
                    << " col " << c;
              }
            }
          }
        }
      }
    }
  }
}

// Ids are checked as they are gathered: one outside [0, rows) (negative,
// rows, huge) makes the call return false and reads row 0 in its place,
// never memory outside the table. The table here is exactly rows * dim
// elements, so a read past it shows under the sanitizers too.
TEST(CpuKernelsTest, IdsOutOfRangeAreCaughtAndNeverRead) {
  const int64_t rows = 5;
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    for (int type : {0, 1, 2}) {
      for (int64_t dim : {4, 5, 20, 23, 64, 132, 138, 260}) {
        const int64_t elem = type == 0 ? 4 : 2;
        std::vector<uint8_t> table(rows * dim * elem);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < dim; ++c) {
            // Small integers: exact in fp32, fp16 and bf16 alike.
            const float w = static_cast<float>(r + 1);
            if (type == 0) {
              std::memcpy(&table[(r * dim + c) * 4], &w, 4);
            } else {
              const uint16_t h = type == 1 ? FloatToFp16(w) : FloatToBf16(w);
              std::memcpy(&table[(r * dim + c) * 2], &h, 2);
            }
          }
        }
        for (int64_t bad : {int64_t{-1}, rows, int64_t{1} << 40,
                            std::numeric_limits<int64_t>::min()}) {
          for (int64_t at : {0, 3, 6}) {
            std::vector<int64_t> ids = {4, 2, 1, 3, 0, 4, 2};  // row r sums r + 1
            const int64_t want_in = 5 + 3 + 2 + 4 + 1 + 5 + 3;
            const float want = static_cast<float>(want_in - (ids[at] + 1) + 1);  // row 0 read
            ids[at] = bad;
            std::vector<float> out(dim, -1.0f);
            EXPECT_FALSE(k->pool[type](out.data(), table.data(), dim * elem, rows, ids.data(),
                                       nullptr, 7, 7, dim, 1.0f, PrefetchAhead{2, 1}))
                << "type " << type << " dim " << dim << " bad id " << bad << " at " << at;
            for (int64_t c = 0; c < dim; ++c) {
              ASSERT_EQ(out[c], want) << "type " << type << " dim " << dim << " col " << c;
            }
          }
        }
        // In range, the same call says so.
        std::vector<int64_t> ids = {4, 2, 1, 3, 0, 4, 2};
        std::vector<float> out(dim);
        EXPECT_TRUE(k->pool[type](out.data(), table.data(), dim * elem, rows, ids.data(), nullptr,
                                  7, 7, dim, 1.0f, PrefetchAhead{2, 1}));
        EXPECT_EQ(out[0], 23.0f);
      }
    }
  }
}

TEST(CpuKernelsTest, StochasticRoundingMatchesTheFormulasBitForBit) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  const float inf = std::numeric_limits<float>::infinity();
  // Zeros, half subnormals and the 2^-25 edge, the overflow edges, Inf,
  // and NaNs of either sign, quiet and signalling.
  const float specials[] = {0.0f,     -0.0f,          1e-30f,         -2.9e-8f,
                            2.98e-8f, 3e-8f,          6e-8f,          -1.5e-5f,
                            -5.9e-5f, 6.1e-5f,        6.2e-5f,        65504.0f,
                            65519.0f, 65520.0f,       65535.0f,       -70000.0f,
                            1e38f,    inf,            -inf,           std::nanf(""),
                            1.0f,     -std::nanf(""), BitsFloat(0x7f800001u),
                            -3.25f,   BitsFloat(0xffbfffffu)};
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    for (int64_t dim : {1, 3, 4, 10, 12, 16, 20, 63, 64, 68, 132, 135, 256}) {
      for (int64_t col_offset : {0, 4, 100}) {
        for (int round = 0; round < 8; ++round) {
          std::vector<float> w(dim);
          for (int64_t c = 0; c < dim; ++c) {
            // A mix: specials, small values around the half subnormal range,
            // and ordinary weights.
            const int pick = static_cast<int>(rng() % 4);
            if (pick == 0) {
              w[c] = specials[rng() % (sizeof(specials) / sizeof(specials[0]))];
            } else if (pick == 1) {
              w[c] = unit(rng) * 1e-4f;
            } else {
              w[c] = unit(rng) * 0.05f;
            }
          }
          const uint64_t key = rng();
          for (int type : {1, 2}) {
            std::vector<uint16_t> got(dim);
            k->narrow_stochastic[type](got.data(), w.data(), dim, key, col_offset);
            for (int64_t c = 0; c < dim; ++c) {
              const uint32_t noise = math::ElementNoise(key, col_offset + c);
              const uint16_t want = type == 1 ? math::FloatToFp16Stochastic(w[c], noise)
                                              : math::FloatToBf16Stochastic(w[c], noise);
              ASSERT_EQ(got[c], want) << "type " << type << " dim " << dim << " col "
                                      << col_offset + c << " w " << w[c];
            }
          }
        }
      }
    }
  }
}

// Rounding to nearest even, against half.h's scalar functions: every
// half and bf16 value, the midpoints between neighbours (ties) and the
// floats just either side of them, specials, and random bit patterns
// (NaN payloads among them).
TEST(CpuKernelsTest, RoundingToNearestMatchesHalfHBitForBit) {
  std::vector<float> w;
  const auto add_around = [&](float x) {
    w.push_back(x);
    w.push_back(std::nextafter(x, std::numeric_limits<float>::infinity()));
    w.push_back(std::nextafter(x, -std::numeric_limits<float>::infinity()));
  };
  for (uint32_t h = 0; h < 0xffff; ++h) {
    if ((h & 0x7c00u) == 0x7c00u) continue;  // Inf and NaN: among the specials
    add_around(Fp16ToFloat(static_cast<uint16_t>(h)));
    if ((h & 0x7fffu) != 0x7bffu) {  // the largest finite has no finite neighbour above
      add_around(0.5f * (Fp16ToFloat(static_cast<uint16_t>(h)) +
                         Fp16ToFloat(static_cast<uint16_t>(h + 1))));
    }
    // bf16: the value, and the tie halfway to the next (the low 16 bits 0x8000).
    add_around(BitsFloat(h << 16 | 0x8000u));
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e38f, inf, -inf,
                  std::nanf(""), -std::nanf(""), BitsFloat(0x7f800001u), BitsFloat(0xffbfffffu),
                  2.98e-8f, 2.9802322e-8f, 5.96e-8f}) {
    w.push_back(x);
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) w.push_back(BitsFloat(static_cast<uint32_t>(rng())));
  while (w.size() % 4 != 0) w.push_back(1.0f);
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    for (int type : {1, 2}) {
      // In rows of 132 columns (16-lane blocks and a 4-column tail) and the
      // whole vector as one row.
      std::vector<uint16_t> got(w.size());
      for (size_t at = 0; at < w.size(); at += 132) {
        const int64_t dim = static_cast<int64_t>(std::min<size_t>(132, w.size() - at));
        k->narrow_nearest[type](got.data() + at, w.data() + at, dim);
      }
      std::vector<uint16_t> whole(w.size());
      k->narrow_nearest[type](whole.data(), w.data(), static_cast<int64_t>(w.size()));
      for (size_t i = 0; i < w.size(); ++i) {
        const uint16_t want = type == 1 ? FloatToFp16(w[i]) : FloatToBf16(w[i]);
        ASSERT_EQ(got[i], want) << "type " << type << " bits " << std::hex << FloatBits(w[i]);
        ASSERT_EQ(whole[i], want) << "type " << type << " bits " << std::hex << FloatBits(w[i]);
      }
    }
  }
}

// A half subnormal rounds up only when the noise under its dropped bits is
// below them: equal is down. Random noise is equal one time in 2^14 or
// less, so the keys here are searched for: each gives some column of the
// row noise equal to the dropped bits of its weight.
TEST(CpuKernelsTest, HalfSubnormalsWhereTheNoiseEqualsTheDroppedBitsRoundDown) {
  constexpr int64_t kDim = 64;
  const int64_t col_offset = 4;
  // |w| in [2^-15, 2^-14): 14 dropped bits.
  std::vector<float> w(kDim);
  for (int64_t c = 0; c < kDim; ++c) w[c] = (c % 2 ? -1.0f : 1.0f) * (3.1e-5f + 4.5e-7f * c);
  int found = 0;
  for (uint64_t key = 1; found < 4 && key < 200000; ++key) {
    int64_t tie = -1;
    for (int64_t c = 0; c < kDim && tie < 0; ++c) {
      const uint32_t dropped = (FloatBits(w[c]) & 0x7fffffu) & 0x3fffu;
      if ((math::ElementNoise(key, col_offset + c) & 0x3fffu) == dropped) tie = c;
    }
    if (tie < 0) continue;
    ++found;
    for (const RowKernels* k : AvailableKernels()) {
      SCOPED_TRACE(KernelName(k));
      std::vector<uint16_t> got(kDim);
      k->narrow_stochastic[1](got.data(), w.data(), kDim, key, col_offset);
      const uint16_t want =
          math::FloatToFp16Stochastic(w[tie], math::ElementNoise(key, col_offset + tie));
      EXPECT_EQ(got[tie], want) << "key " << key << " col " << tie;
      // Equal noise is not below: the value rounds down (toward zero).
      EXPECT_EQ(Fp16ToFloat(want), std::ldexp(std::floor(std::ldexp(std::fabs(w[tie]), 24)), -24) *
                                       (w[tie] < 0 ? -1.0f : 1.0f));
    }
  }
  EXPECT_EQ(found, 4);
}

// A kernel that rounds a value the wrong way must fail the comparison
// above: the noise really decides (two keys round some element apart).
TEST(CpuKernelsTest, TheNoiseDecidesTheRounding) {
  const RowKernels& k = BestRowKernels();
  std::vector<float> w(64, 0.0123f);
  std::vector<uint16_t> a(64), b(64);
  k.narrow_stochastic[1](a.data(), w.data(), 64, 1, 0);
  k.narrow_stochastic[1](b.data(), w.data(), 64, 2, 0);
  EXPECT_NE(a, b);
}

// Quantized rows (3 INT8, 4 INT4): every table's pool against a sum in
// double of the rows dequantized by rowwise_quant.h's formula, for widths
// using each register block and tails (odd widths leave INT4's last high
// nibble unused); widen and narrow_nearest are rowwise_quant.h's
// (DequantizeRow, QuantizeRowKeeping) bit for bit; ids out of range are caught and read row 0. The table is exactly
// rows * row_bytes bytes: a read past it shows under the sanitizers.
TEST(CpuKernelsTest, QuantizedRowsPoolWidenAndNarrow) {
  std::mt19937 rng(23);
  std::uniform_real_distribution<float> u(-2, 2);
  const int64_t rows = 29;
  for (const RowKernels* k : AvailableKernels()) {
    SCOPED_TRACE(KernelName(k));
    for (int type : {3, 4}) {
      const int bits = type == 3 ? 8 : 4;
      for (int64_t dim : {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 64, 100, 128, 129, 200,
                          256, 264, 520}) {
        const int64_t row_bytes = math::QuantizedRowBytes(bits, dim);
        std::vector<uint8_t> table(rows * row_bytes);
        std::vector<double> value(rows * dim);
        std::vector<float> w(dim), back(dim), widened(dim);
        std::vector<uint8_t> mine(row_bytes);
        for (int64_t r = 0; r < rows; ++r) {
          const float centre = u(rng) * 5, spread = std::abs(u(rng)) + 0.01f;
          for (float& x : w) x = centre + spread * u(rng);
          uint8_t* row = table.data() + r * row_bytes;
          math::QuantizeRowKeeping(bits, w.data(), dim, row);
          k->narrow_nearest[type](mine.data(), w.data(), dim);
          ASSERT_EQ(0, std::memcmp(mine.data(), row, row_bytes)) << "quantize, dim " << dim;
          math::DequantizeRow(bits, row, dim, back.data());
          k->widen[type](widened.data(), row, dim);
          for (int64_t c = 0; c < dim; ++c) {
            ASSERT_EQ(Bits(widened[c]), Bits(back[c])) << "dequantize, dim " << dim;
            value[r * dim + c] = back[c];
          }
        }
        EXPECT_EQ(k->narrow_stochastic[type], nullptr);
        for (int64_t n : {0, 1, 5, 20}) {
          std::vector<int64_t> ids(n + 3);
          for (int64_t& id : ids) id = std::uniform_int_distribution<int64_t>(0, rows - 1)(rng);
          for (bool weighted : {false, true}) {
            std::vector<float> weights(ids.size());
            for (float& x : weights) x = u(rng);
            const float scale = n == 0 ? 1.0f : 1.0f / n;
            for (const PrefetchAhead pf : {PrefetchAhead{3, 2}, PrefetchAhead{0, 0},
                                           PrefetchAhead{64, 0}, PrefetchAhead{2, 0, true}}) {
              std::vector<float> out(dim, 1e30f);
              ASSERT_TRUE(k->pool[type](out.data(), table.data(), row_bytes, rows, ids.data(),
                                        weighted ? weights.data() : nullptr, n, n + 3, dim,
                                        scale, pf));
              for (int64_t c = 0; c < dim; ++c) {
                double want = 0, mag = 0;
                for (int64_t j = 0; j < n; ++j) {
                  const double x = (weighted ? weights[j] : 1.0) * value[ids[j] * dim + c];
                  want += x;
                  mag += std::abs(x) + 16;  // the bias and scaled values apart
                }
                ASSERT_NEAR(out[c], want * scale, 2e-6 * mag * scale + 1e-6)
                    << "type " << type << " dim " << dim << " n " << n << " col " << c;
              }
            }
          }
        }
        // An id out of range reads row 0 and is reported.
        std::vector<int64_t> ids = {3, int64_t{1} << 40, 5};
        std::vector<int64_t> as_read = {3, 0, 5};
        std::vector<float> got(dim), want(dim);
        EXPECT_FALSE(k->pool[type](got.data(), table.data(), row_bytes, rows, ids.data(), nullptr,
                                   3, 3, dim, 1.0f, PrefetchAhead{1, 1}));
        ASSERT_TRUE(k->pool[type](want.data(), table.data(), row_bytes, rows, as_read.data(),
                                  nullptr, 3, 3, dim, 1.0f, PrefetchAhead{1, 1}));
        EXPECT_EQ(got, want);
        // accumulate: acc += scale * the dequantized row.
        std::vector<float> acc(dim, 1.0f);
        k->accumulate[type](acc.data(), table.data() + 2 * row_bytes, dim, 0.5f);
        for (int64_t c = 0; c < dim; ++c) {
          ASSERT_NEAR(acc[c], 1.0 + 0.5 * value[2 * dim + c], 1e-5 * (2 + std::abs(value[2 * dim + c])));
        }
      }
    }
  }
}

}  // namespace
}  // namespace backend
}  // namespace ember
