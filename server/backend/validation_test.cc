// The request validation shared by both backends, against naive references.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "math/half.h"
#include "server/backend/embedding_backend.h"

namespace ember {
namespace backend {
namespace {

int64_t NaiveFirstNonFinite(const std::vector<float>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i]) || std::isinf(v[i])) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(FirstNonFiniteTest, MatchesNaiveScanAtEveryPositionAndLength) {
  const float bad_values[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::quiet_NaN()};
  // Lengths around the 16-element blocks; every position; every kind.
  for (size_t n : {0, 1, 15, 16, 17, 31, 32, 33, 47, 100}) {
    std::vector<float> v(n, 1.5f);
    EXPECT_EQ(FirstNonFinite(v), -1) << n;
    for (size_t p = 0; p < n; ++p) {
      for (float bad : bad_values) {
        v[p] = bad;
        ASSERT_EQ(FirstNonFinite(v), static_cast<int64_t>(p)) << "n=" << n << " p=" << p;
        v[p] = 1.5f;
      }
    }
  }
}

TEST(FirstNonFiniteTest, ExtremeFiniteValuesPassAndFirstOfSeveralIsReported) {
  std::vector<float> v = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(), -0.0f, 0.0f,
                          std::numeric_limits<float>::min()};
  EXPECT_EQ(FirstNonFinite(v), -1);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1e30f, 1e30f);
  std::vector<float> r(1000);
  for (float& x : r) x = u(rng);
  r[700] = std::numeric_limits<float>::infinity();
  r[345] = std::numeric_limits<float>::quiet_NaN();
  r[999] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(FirstNonFinite(r), NaiveFirstNonFinite(r));
  EXPECT_EQ(FirstNonFinite(r), 345);
}

// The largest magnitude, at every length and position of the largest,
// against a plain scan; what CheckFinite reports with it.
TEST(MaxAbsBitsTest, MatchesNaiveMaximumAtEveryPositionAndLength) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-100, 100);
  for (size_t n = 0; n <= 70; ++n) {
    std::vector<float> v(n);
    for (float& x : v) x = u(rng);
    for (size_t p = 0; p < n; ++p) {
      std::vector<float> w = v;
      w[p] = (p % 2 ? -1 : 1) * 1e9f;
      uint32_t bits;
      const float expected = 1e9f;
      std::memcpy(&bits, &expected, sizeof(bits));
      ASSERT_EQ(MaxAbsBits(w), bits) << "n=" << n << " p=" << p;
    }
    float naive = 0;
    for (const float x : v) naive = std::max(naive, std::fabs(x));
    float got;
    const uint32_t top = MaxAbsBits(v);
    std::memcpy(&got, &top, sizeof(got));
    ASSERT_EQ(got, naive) << n;
    float reported = -1;
    ASSERT_TRUE(CheckFinite(v, "w", "x", 0, &reported).ok());
    EXPECT_EQ(reported, naive);
  }
  std::vector<float> v(37, 1.0f);
  v[20] = -std::numeric_limits<float>::infinity();
  EXPECT_GE(MaxAbsBits(v), 0x7f800000u);
  v[20] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_GT(MaxAbsBits(v), 0x7f800000u);
}

TEST(CheckFiniteTest, MessageNamesArrayAndPosition) {
  std::vector<float> v(40, 0.25f);
  v[33] = std::numeric_limits<float>::infinity();
  const absl::Status s = CheckFinite(v, "gradient request 2", "gradient");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("gradient[33]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("gradient request 2"), std::string::npos) << s.message();
}

TEST(CheckIdsTest, FirstOutOfRangeIdAtEveryPositionAroundBlocks) {
  const int64_t rows = 100;
  for (size_t n : {0, 1, 7, 8, 9, 16, 17, 40}) {
    std::vector<int64_t> ids(n);
    for (size_t i = 0; i < n; ++i) ids[i] = static_cast<int64_t>(i * 37 % rows);
    EXPECT_TRUE(CheckIds(ids, rows, "f").ok()) << n;
    for (size_t p = 0; p < n; ++p) {
      for (int64_t bad : {rows, int64_t{-1}, std::numeric_limits<int64_t>::min(),
                          std::numeric_limits<int64_t>::max()}) {
        const int64_t keep = ids[p];
        ids[p] = bad;
        const absl::Status s = CheckIds(ids, rows, "f", /*first_position=*/1000);
        ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n << " " << p;
        EXPECT_NE(s.message().find(absl::StrCat("id ", bad, " at position ", 1000 + p,
                                                " is outside [0, 100)")),
                  std::string::npos)
            << s.message();
        ids[p] = keep;
      }
    }
  }
  // The boundary values themselves are fine.
  EXPECT_TRUE(CheckIds(std::vector<int64_t>{0, 99}, rows, "f").ok());
}

TEST(CheckLengthsTest, RefusesNegativeOverflowingAndMismatchedLengths) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_TRUE(CheckLengths(std::vector<int64_t>{2, 0, 3}, 5, "f").ok());
  EXPECT_TRUE(CheckLengths(std::vector<int64_t>{}, 0, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{2, 0, 3}, 4, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{}, 1, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{3, -1}, 2, "f").ok());
  // Sums that wrap around to the id count must not pass.
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{big, big, 4}, 2, "f").ok());
  EXPECT_FALSE(CheckLengths(std::vector<int64_t>{big, 1}, std::numeric_limits<int64_t>::min(), "f").ok());
}

// InitialValues computes a block with each column's hash once; every
// element must be InitialValue's, bit for bit, for every initializer, at
// offsets into the table, down to a block of one element.
TEST(InitialValuesTest, MatchInitialValueBitForBit) {
  std::vector<InitializerConfig> inits(4);
  inits[0].type = InitializerType::kDefault;
  inits[0].seed = 3;
  inits[1].type = InitializerType::kUniform;
  inits[1].low = -0.5f;
  inits[1].high = 2.0f;
  inits[1].seed = 11;
  inits[2].type = InitializerType::kNormal;
  inits[2].mean = 0.25f;
  inits[2].std = 0.1f;
  inits[2].seed = 12345;
  inits[3].type = InitializerType::kConstant;
  inits[3].value = -1.5f;
  const std::vector<std::vector<int64_t>> blocks = {  // row, rows, col, cols
      {0, 1, 0, 1}, {0, 40, 0, 16}, {1000, 7, 36, 12}, {999999, 1, 123, 4},
      // Eight columns at a time where the CPU has AVX-512DQ: whole groups,
      // a tail of every length, an offset column.
      {5, 3, 0, 64}, {77, 2, 3, 67}, {123456, 9, 0, 130}, {1, 1, 1, 7}};
  for (const InitializerConfig& init : inits) {
    for (const auto& b : blocks) {
      const int64_t row = b[0], rows = b[1], col = b[2], cols = b[3];
      std::vector<float> out(rows * cols, std::nanf(""));
      InitialValues(init, 1000000, row, rows, col, cols, out.data());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const float want = InitialValue(init, 1000000, row + r, col + c);
          ASSERT_EQ(FloatBits(out[r * cols + c]), FloatBits(want))
              << "initializer " << static_cast<int>(init.type) << " element (" << row + r << ", "
              << col + c << ")";
        }
      }
    }
    // By id (a dynamic table's rows): any int64, negative and huge too.
    const std::vector<int64_t> ids = {-1, 0, 7, int64_t{1} << 62, -(int64_t{1} << 40), 123456789};
    std::vector<float> out(ids.size() * 9, std::nanf(""));
    InitialValuesOf(init, 1000000, ids, 5, 9, out.data());
    for (size_t r = 0; r < ids.size(); ++r) {
      for (int64_t c = 0; c < 9; ++c) {
        ASSERT_EQ(FloatBits(out[r * 9 + c]), FloatBits(InitialValue(init, 1000000, ids[r], 5 + c)))
            << "initializer " << static_cast<int>(init.type) << " id " << ids[r] << " col " << c;
      }
    }
  }
}

// The initializers' values against their definitions: default within
// TorchRec's +-1/sqrt(table rows) and centred, uniform within [low, high]
// with the mean halfway, normal with its mean and deviation (20,000
// draws; bounds several standard errors wide).
TEST(InitialValuesTest, FollowTheirDistributions) {
  const int64_t rows = 1000, cols = 20;
  std::vector<float> v(rows * cols);
  auto stats = [&](double* mean, double* sd) {
    double s = 0, s2 = 0;
    for (float x : v) {
      s += x;
      s2 += static_cast<double>(x) * x;
    }
    *mean = s / v.size();
    *sd = std::sqrt(s2 / v.size() - *mean * *mean);
  };
  double mean, sd;
  InitializerConfig init;
  init.seed = 5;
  InitialValues(init, 40000, 0, rows, 0, cols, v.data());  // bound 1/200
  for (float x : v) ASSERT_LE(std::abs(x), 0.005f);
  stats(&mean, &sd);
  EXPECT_NEAR(mean, 0.0, 0.0001);
  EXPECT_NEAR(sd, 0.005 / std::sqrt(3.0), 0.0001);
  init.type = InitializerType::kUniform;
  init.low = 1.0f;
  init.high = 3.0f;
  InitialValues(init, 40000, 0, rows, 0, cols, v.data());
  for (float x : v) ASSERT_TRUE(x >= 1.0f && x <= 3.0f) << x;
  stats(&mean, &sd);
  EXPECT_NEAR(mean, 2.0, 0.03);
  init.type = InitializerType::kNormal;
  init.mean = -1.0f;
  init.std = 0.5f;
  InitialValues(init, 40000, 0, rows, 0, cols, v.data());
  stats(&mean, &sd);
  EXPECT_NEAR(mean, -1.0, 0.02);
  EXPECT_NEAR(sd, 0.5, 0.02);
}

// Keyed ids (a dynamic shard's keys, found by the backend) are any int64
// in a lookup and are refused in an update; SyncKeyIndex's arguments are
// checked before anything is copied.
TEST(KeyedRequestTest, KeysAreAnyInt64InLookupsAndRefusedInUpdates) {
  ShardSpec spec;
  spec.table = "t";
  spec.rows = 4;
  spec.dim = 4;
  auto find_spec = [&](ShardId) { return &spec; };
  const std::vector<int64_t> lengths = {2}, ids = {-5, int64_t{1} << 60};
  std::vector<float> out(4), grad(4, 1.0f);
  FeatureRequest f;
  f.lengths = lengths;
  f.ids = ids;
  LookupRequest lookup{f, absl::MakeSpan(out)};
  EXPECT_EQ(ValidateRequests(absl::MakeConstSpan(&lookup, 1), find_spec).code(),
            absl::StatusCode::kInvalidArgument);  // not keyed: out of range
  lookup.feature.keyed = true;
  EXPECT_TRUE(ValidateRequests(absl::MakeConstSpan(&lookup, 1), find_spec, Checks::kAll, false,
                               false, /*finds_keys=*/true)
                  .ok());
  const absl::Status no_finder = ValidateRequests(absl::MakeConstSpan(&lookup, 1), find_spec);
  EXPECT_EQ(no_finder.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_finder.message().find("does not find keys"), std::string::npos) << no_finder;
  GradientRequest update{f, grad};
  update.feature.keyed = true;
  const absl::Status refused = ValidateRequests(absl::MakeConstSpan(&update, 1), find_spec);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("keyed ids are for lookups"), std::string::npos) << refused;

  std::vector<math::KeyLine> lines(8);
  const std::vector<int64_t> good = {0, 3, 7};
  EXPECT_TRUE(CheckKeySync(lines.data(), 8, good).ok());
  EXPECT_TRUE(CheckKeySync(lines.data(), 8, {}).ok());
  for (const auto& [count, changed] : std::vector<std::pair<int64_t, std::vector<int64_t>>>{
           {8, {3, 3}}, {8, {4, 2}}, {8, {8}}, {8, {-1}}, {6, {}}, {0, {}}}) {
    EXPECT_EQ(CheckKeySync(lines.data(), count, changed).code(), absl::StatusCode::kInvalidArgument)
        << count << " lines, changed " << changed.size();
  }
  EXPECT_EQ(CheckKeySync(nullptr, 8, {}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace backend
}  // namespace ember
